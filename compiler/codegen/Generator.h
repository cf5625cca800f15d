//===- Generator.h - the code generator's shared state (private) ----------===//
//
// Private to compiler/codegen: the Generator that turns one function
// (@train_step, or one pipeline stage @stageN) into C++ statements, and the
// helpers its files share. The public entry points are in CpuCodegen.h.
//
// Who does what:
//   Generator.cpp       C names and literals; the op list, its checks, folds
//   Fusion.cpp          elementwise chains fused into one kernel each
//   MemoryPlan.cpp      buffers, live ranges, the arena's persistent regions
//   EmitOps.cpp         one runtime call per op (kernels, collectives, custom)
//   Target.cpp          what differs between the cpu and cuda targets
//   Optimizer.cpp       the step's tail as carve-optimizer's ops say it
//   Tables.cpp          the runtime's tensor tables and the Program record
//   Step.cpp            the whole-step program (generateCpuProgram)
//   PipelineStage.cpp   one pipeline chunk's forward and backward
//   PipelineProgram.cpp a pipeline rank's program (generatePipelineProgram)
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_CODEGEN_GENERATOR_H
#define CARVE_COMPILER_CODEGEN_GENERATOR_H

#include "compiler/codegen/CpuCodegen.h"
#include "compiler/dataparallel/DataParallel.h"
#include "compiler/fusion/Fusion.h"
#include "compiler/memory/MemoryPlan.h"

#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"
#include "dialects/dist/DistDialect.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/ADT/StringSet.h"
#include "llvm/Support/raw_ostream.h"

#include <array>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace carve::codegen {

/// The driver's choices with the plan the module holds (carve.plan): what
/// every part of the emitter reads.
struct EmitOptions : CodegenOptions {
  /// The module's carve.plan.
  PlanAttrs plan;
  /// "cpu" (C++ against kernels.h) or "cuda" (a .cu source against gpu.h:
  /// the same calls on device pointers, constants in managed memory, scalars
  /// read back explicitly): the plan's `target`.
  std::string target = "cpu";
  bool cuda() const { return target == "cuda"; }
  int dp = 1;
  int tp = 1;              // tensor-parallel degree (the partitioner has split the step)
  int zero = 0;            // ZeRO stage over dp
  int pp = 1;              // pipeline ranks
  int ep = 1;              // expert-parallel degree (carve-expert-parallel)
  int epRank = 0;          // the ep rank this program is (its experts)
  int numMicroBatches = 1; // micro-batches per step of each dp replica
  int64_t globalBatch = 0;
  /// "fp32", "bf16" or "fp16": the step sets it for matmul and attention;
  /// fp16 also scales the loss seed by StepContext::lossScale and divides
  /// the gradients by it.
  std::string precision = "fp32";
  /// ZeRO-2/3 accumulate 16-bit gradients' chunks over micro-batches in fp32
  /// (PlanAttrs::fp32ChunkAccumulators).
  bool fp32Accumulators = false;
  /// Gradients are 16-bit (PlanAttrs::gradients16, carve-store-grads16).
  bool gradients16 = false;
  /// Whether the optimizer's tail reads 16-bit gradients: the gradients', or
  /// under ZeRO-2/3 their chunks'.
  bool tail16() const { return gradients16 && !(zero >= 2 && fp32Accumulators); }
  /// The CommType of the tail's gradients.
  std::string tailCommType() const {
    return !tail16() ? "CommType::F32" : precision == "fp16" ? "CommType::F16" : "CommType::BF16";
  }
  /// The optimizer the tail ops say (readOptimizer).
  OptimizerConfig optimizer;
};

/// `given` with the module's plan; false (with `error`) when the module's
/// carve.plan is malformed.
bool withPlan(mlir::ModuleOp module, const CodegenOptions &given, EmitOptions &opts,
              std::string &error);

using mlir::ArrayRef;
using mlir::Operation;
using mlir::StringRef;
using mlir::Value;

/// Every tensor in the arena starts at a multiple of this.
constexpr int64_t kAlign = kArenaAlign;

inline int64_t alignUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

inline mlir::RankedTensorType typeOf(Value v) {
  return mlir::cast<mlir::RankedTensorType>(v.getType());
}

/// A C identifier from a model name: "/h.0/attn/c_attn/MatMul" -> "h0_attn_c_attn_MatMul".
std::string identifier(StringRef name);
/// Whether `name` is one of the runtime's types (a variable of that name would hide it).
bool isRuntimeType(StringRef name);
/// The C element type, the runtime's DType, and the size of an element type.
bool elementInfo(mlir::Type t, std::string &ctype, std::string &dtype, int &size);
/// The type as MLIR prints it.
std::string typeString(mlir::Type t);
/// A shape as a C++ initializer: "{2, 3}".
std::string dims(ArrayRef<int64_t> d);
/// A shape as the comments show it: "[2, 3]".
std::string shapeText(ArrayRef<int64_t> d);
/// A C++ literal for `x` ("1.5f", "INFINITY"; no suffix unless `isFloat`).
std::string number(double x, bool isFloat);
/// A size for a reader: "512 B", "1.5 KiB", "2.0 MiB".
std::string bytesText(int64_t b);

/// Where a buffer lives in the arena.
enum class Region { Activation, Param, Grad, State, Input, Seed, Constant };

struct Buffer {
  Region region = Region::Activation;
  int64_t bytes = 0;
  int def = -1;     // index of the defining op (-1: lives for the whole step)
  int lastUse = -1; // index of the last op that reads it
  int64_t offset = -1;
  std::string name; // C variable of the root value
  // Where carve-plan-memory recorded an activation's offset: the op result
  // that owns it, or a ZeRO-3 gather (argument, pass); copied gradients
  // under ZeRO >= 2 are found through the gradient slots.
  mlir::Value owner;
  int gatherArg = -1, gatherPass = -1;
};

/// One row of the runtime's TensorSpec tables (program.h).
struct TensorRow {
  std::string name, dtype;
  mlir::SmallVector<int64_t> shape, global;
  int tpDim = -1;
  int64_t tpGroups = 1, zeroChunk = 0;
  bool paramZero = false, stateZero = false;
  int64_t numel = 0, offset = 0;
  bool trainable = false;
  int64_t gradOffset = -1, state[2] = {-1, -1};
  int64_t masterOffset = -1;     // a 16-bit copy's fp32 master (the row's dtype is the master's)
  std::string copyDtype = "F32"; // the copy's dtype ("BF16", "F16") where there is a master
  std::string gradDtype = "F32"; // the gradient's (or its ZeRO-2/3 chunk's) dtype
  int64_t classes = 0;           // a cross-entropy's targets: its classes (0: not one)
  bool hasIgnore = false;
  int64_t ignoreIndex = 0;
};

/// The rows of the (whole, not tp-split) table a gather of `fn` indexes with
/// graph input `input`: a token model's vocabulary; 0 when no gather does.
int64_t tokenVocab(mlir::func::FuncOp fn, const std::string &input, int tp);
/// CUDA programs that draw dropout masks: the statement that puts the step's
/// seed and number where the dropout kernels read them on the device (so a
/// captured CUDA graph draws each step's masks); empty otherwise.
std::string dropoutStateLine(const EmitOptions &opts, int dropoutNodes);
/// The dropout nodes whose masks `fn` draws (forward ops; their gradients
/// draw the same masks).
int dropoutNodes(mlir::func::FuncOp fn);

/// The headers a generated source includes (Target.cpp).
std::string runtimeIncludes(const EmitOptions &opts, bool pipelined);
/// The name a generated source calls runtime entry `entry` by: `gpu::entry`
/// in a CUDA source for an entry carve::gpu declares (kernels.def), since the
/// carve::rt types in its arguments (Dims, Split, Precision, ...) would let
/// argument-dependent lookup find the CPU kernel of the same name too; else
/// `entry`.
std::string callee(const EmitOptions &opts, llvm::StringRef entry);
/// Declares the gradient norm's two sums of squares.
std::string normDeclarations(const EmitOptions &opts);
/// CUDA: reads the device sums into sqSplit and sqWhole (nothing on the CPU).
std::string normRead(const EmitOptions &opts);
/// Expert parallelism: sums this rank's experts' squares over the ep group
/// into sqSplit and sqWhole (nothing without ep).
std::string expertNormSum(const EmitOptions &opts);
/// The step's first statement under a bf16/fp16 plan (nothing under fp32).
std::string precisionLine(const EmitOptions &opts);
/// The namespace whose kernels the step calls (the same names on both targets).
std::string usingLine(const EmitOptions &opts);
/// CPU target: the lines that open and close the functions built at -O1
/// (CARVE_GLUE_BEGIN and CARVE_GLUE_END of carve/rt/program.h).
std::string glueBegin();
std::string glueEnd();

/// The `extern "C"` declarations of the user's kernels (none: nothing).
void emitCustomKernelDecls(llvm::raw_ostream &os,
                           const std::map<std::string, std::string> &customKernels);

/// The tensor tables and the `Program` of a rank's source (Tables.cpp).
void emitProgramTables(llvm::raw_ostream &os, const EmitOptions &opts, const GeneratedProgram &out,
                       const std::vector<TensorRow> &inputs, const std::vector<TensorRow> &params,
                       const PipelineCodegenOptions *pipe);

/// The global loss from this rank's share (Optimizer.cpp).
void emitDpLoss(llvm::raw_ostream &os, const EmitOptions &opts, const std::string &reduction);
/// The hook after the gradients are final and before the norm.
void emitGradientsReadyHook(llvm::raw_ostream &os);
/// `norm` from the expression `sumOfSquares`, `ctx.gradNorm`, and the hook
/// that may skip the update.
void emitUpdateGuard(llvm::raw_ostream &os, const char *sumOfSquares);
/// `clip`, the coefficient every gradient is scaled by (clipping on only).
void emitClipCoefficient(llvm::raw_ostream &os, const OptimizerConfig &o);
/// The optimizer's comment and the scheduled learning rate `lr`.
void emitLearningRate(llvm::raw_ostream &os, const OptimizerConfig &o);

/// Turns one function into the statements of a generated program: the whole
/// step (run) or one pipeline chunk (runStage). One Generator per function.
class Generator {
public:
  /// The first number of this generator's multi-tensor call sites (the
  /// pipeline's chunks share one program: each numbers its own).
  void firstMultiSite(int n) { multiSites = n; }
  Generator(mlir::func::FuncOp fn, const EmitOptions &opts, GeneratedProgram &out,
            std::string &error)
      : fn(fn), opts(opts), out(out), error(error) {}

  /// The whole step of @train_step into `out` (Step.cpp).
  bool run();

  /// A pipeline stage's pieces, for generatePipelineProgram to assemble.
  struct StageOut {
    std::string constants, forward, backward; // definitions in the chunk's namespace
    std::string init;                         // statements at the start of the step
    std::string bucketWaits, pointers, norm, clip, updates, unscale;
    std::vector<std::pair<std::string, std::string>> sharedGrads; // name -> pointer
    std::map<std::string, std::string> customKernels;
    std::vector<TensorRow> params, inputs;
    int64_t persistentEnd = 0, activationBytes = 0, unplannedBytes = 0;
    int64_t scratchBytes = 0; // activations shared by the rank's calls (at W)
    int64_t sendBytes = 0;    // what one micro-batch's backward sends (at Q)
    int64_t paramBytes = 0, gradBytes = 0, stateBytes = 0;
    int numBuckets = 0, kernelCalls = 0;
    bool hasLoss = false;
    std::string lossReduction = "unknown";
    std::string plan; // memory-plan comment lines
  };
  /// Generates chunk `chunk` (a @stageN function): persistent tensors from
  /// byte `base`, graph inputs at `inputOffsets`, activations relative to the
  /// micro-batch's slot (PipelineStage.cpp).
  bool runStage(const PipelineCodegenOptions &pipe, int chunk, int64_t base,
                const std::map<std::string, int64_t> &inputOffsets, StageOut &so);

private:
  mlir::func::FuncOp fn;
  const EmitOptions &opts;
  GeneratedProgram &out;
  std::string &error;

  std::vector<Operation *> ops;
  llvm::DenseMap<Operation *, int> index;
  llvm::DenseMap<Value, int> bufferOf;    // value -> buffer
  /// value -> C variable. While a layer's statements print as a function
  /// (Layers.cpp) the layer's scope names every value; while the step
  /// prints, each lookup is noted with the op record that made it.
  struct ValueNames {
    llvm::DenseMap<Value, std::string> map;
    std::function<std::string &(Value)> scoped;
    int reader = -2; // -2: not noting; -1: outside the op records; k: record k
    llvm::DenseMap<Value, llvm::SmallVector<int, 2>> readers;
    std::string &operator[](Value v) {
      if (scoped)
        return scoped(v);
      note(v);
      return map[v];
    }
    std::string lookup(Value v) {
      if (scoped)
        return scoped(v);
      note(v);
      return map.lookup(v);
    }
    void note(Value v) {
      if (reader == -2)
        return;
      auto &r = readers[v];
      if (r.empty() || r.back() != reader)
        r.push_back(reader);
    }
  };
  ValueNames var;
  std::vector<Buffer> buffers;
  llvm::StringSet<> usedNames;
  /// Per base name, the suffix uniqueName tries first: the ones below it are
  /// taken (names are never released), so the search need not retry them.
  llvm::StringMap<int> nextSuffix;
  std::set<Operation *> foldedTransposes;
  // transpose(matmul(a, b)) computed as matmul(b^T, a^T): transpose -> matmul.
  llvm::DenseMap<Operation *, Operation *> transposedMatmul;
  std::set<Operation *> fusedMatmuls;
  std::map<std::pair<Operation *, unsigned>, Value> foldedOperand;
  // gather_grad(reshape(matmul(a, b))) computed as matmul_gather_grad:
  // gather_grad -> matmul; the matmul and the reshapes between are in
  // scatteredProducts (no buffer, no code).
  llvm::DenseMap<Operation *, Operation *> scatterMatmul;
  std::set<Operation *> scatteredProducts;
  // A gather marked "gather" and the reshapes of its result: no buffer, no
  // code; each matmul reading it runs matmul_gathered on its table.
  std::set<Operation *> gatheredOperands;
  // A slice marked "view" (carve-fold-views): no buffer, no code; each
  // transpose reading it (through reshapes) runs transpose_view on its source.
  std::set<Operation *> foldedViews;
  // A transpose marked "producer" (carve-fold-views): no code; its buffer is
  // written by the op before it (cuDNN's attention gradient), from there.
  std::set<Operation *> producedTransposes;
  // A transpose marked "consumer" (carve-fold-views): no buffer, no code;
  // its reader (cuDNN's attention gradient) reads its input transposed.
  std::set<Operation *> consumedTransposes;
  /// q, k and v transposes and their copies that cuDNN's attention reads in
  /// place in their source's 16-bit copy (carve-fold-views' "strided").
  llvm::DenseSet<Operation *> stridedOps;
  /// Bias adds their matmuls compute (carve-fold-views' "epilogue"), with
  /// the 16-bit copy the matmul writes.
  llvm::DenseMap<Operation *, Value> epilogueAdds;
  // An add marked "accumulate" (carve-fold-views): no code; its buffer (and
  // its 16-bit copy's) is written by the norm gradient whose input gradient
  // it reads, from there.
  std::set<Operation *> accumulatedAdds;
  // A concat marked "assemble" (carve-fold-views), with the 16-bit copy its
  // pieces are written into by cuDNN's attention gradient, from there.
  llvm::DenseMap<Operation *, Value> assembledConcats;

  // Fused elementwise chains (carve-fuse-elementwise marked them; read back
  // by fuseElementwise): each group runs as one kernel at its root, the
  // member with the highest index.
  std::vector<FusionGroup> groups;
  llvm::DenseMap<Operation *, int> groupOf; // every member -> its group
  llvm::DenseSet<Value> interior;           // member results nothing outside reads: no buffer
  std::string fusedDefs;                    // the groups' functors
  /// A functor's code (comments aside) -> its name: chains that compute the
  /// same share one functor.
  std::map<std::string, std::string> functorByCode;
  /// Where an op's reads happen: its group's root for a fused member.
  int readAt(Operation *op) {
    auto it = groupOf.find(op);
    return it == groupOf.end() ? index[op] : index[groups[it->second].root];
  }

  std::string constants; // static arrays
  /// The user's kernels (carve.custom, carve.custom_grad): name -> declaration.
  std::map<std::string, std::string> customKernels;
  std::string body; // the step function's statements
  /// CUDA: the statements `step` runs before `graphStep(ctx, forwardBackward)`
  /// (the loss seed, whose fp16 value changes between steps) and after it,
  /// before the tail (the loss pointer the tail reads); docs/cuda.md.
  std::string graphBefore, graphAfter;
  /// The forward part of `body`: train --eval-data runs it alone (the
  /// `evaluate` function). Each pass gathers its own ZeRO-3 parameters, so
  /// it leaves no collective open.
  size_t forwardEnd = std::string::npos;
  std::string evalTail; // evaluate's statements after the forward: the global loss

  // The gradients the function returns, in the order backward finishes them.
  struct GradSlot {
    unsigned param; // argument number of the parameter
    Value value;
    int buffer;          // its buffer in the gradient region
    bool copy;           // the value lives elsewhere; copy it into the slot
    int ready;           // index of the op after which it is final
    bool shared = false; // pipeline: one stage's part of a gradient summed over pp
    unsigned result = 0; // the function's result it is
  };
  /// carve-data-parallel's record of each gradient result (carve.gradients).
  std::map<unsigned, GradientSlot> irGrad;
  /// Set by an addSlot callback whose record contradicts the function.
  std::string contractError;
  std::vector<GradSlot> grads;
  // ZeRO over dp: per parameter argument, its elements and chunk size; the
  // optimizer-state offsets; stage >= 2: the buffer of its gradient chunk.
  int zero = 0;
  std::map<unsigned, int64_t> chunkOf, numelOf;
  std::map<unsigned, std::array<int64_t, 2>> stateOf;
  /// A 16-bit parameter copy's fp32 master (carve.master): its offset.
  std::map<unsigned, int64_t> masterOf;
  std::map<unsigned, int> shardOf;
  /// Base of the activation pointers: "A" (the arena) for the whole step,
  /// "S" (the micro-batch's slot) in a pipeline stage.
  std::string actBase = "A";
  /// A stage (carve.activation_plan's slot and sends): activation offsets
  /// below slotLimit are the micro-batch's slot (at S), the next sendLimit
  /// bytes what its backward sends (at Q), the rest scratch (at W), shared by
  /// the rank's calls; slotLimit -1: none.
  int64_t slotLimit = -1, sendLimit = 0;
  /// The pointer expression of activation byte `offset` (S/A + offset, Q + ..., W + ...).
  std::string activationAt(int64_t offset);
  std::vector<TensorRow> inputRows, paramRows;
  int kernelCalls = 0;

  /// Consecutive gradients (in the order backward finishes them) reduced
  /// together (carve.buckets).
  struct Bucket {
    size_t first, last;
    int64_t bytes;
    int ready;
    int waitAt = -1;      // ZeRO >= 2: index of the op after which it is waited for
    bool experts = false; // summed over the ranks holding the same experts (edp)
  };
  /// The persistent regions a layout placed: [begin, paramEnd) parameters,
  /// [paramEnd, gradEnd) gradients, [gradEnd, stateEnd) optimizer state,
  /// then up to `end` the step's inputs and loss seed (a stage: its seed).
  struct PersistentLayout {
    int64_t begin = 0, paramEnd = 0, gradEnd = 0, stateEnd = 0, end = 0;
  };
  /// ZeRO-3: a parameter gathered whole for its uses in one pass.
  struct Gathered {
    int buffer = -1;
    int first = -1, last = -1;
    int issue = -1; // where the gather starts (< first: prefetched, asynchronous)
    std::string var;
  };
  using GatherPlan = std::map<unsigned, std::array<Gathered, 2>>; // [0] forward, [1] backward

  // Generator.cpp: names, errors, the op list and what every plan starts with.
  /// The name of parameter argument `arg` (carve.param).
  std::string paramName(unsigned arg);
  /// Whether parameter argument `arg` is split over tp (its norm term is summed over tp).
  bool tpSplit(unsigned arg);
  /// Sets `error` to `msg`; returns false.
  bool fail(const std::string &msg);
  /// fail() with the op's name and model node in front.
  bool failOp(Operation *op, const std::string &msg);
  /// `base`, or `base_2`, `base_3`, ... if taken (long names keep their end).
  std::string uniqueName(std::string base);
  /// The C element type and the bytes of a tensor value.
  std::string ctypeOf(Value v);
  int64_t bytesOf(Value v);
  /// Operand `k` as the op reads it: a folded transpose's input.
  Value operandOf(Operation *op, unsigned k);
  /// A matmul's operands as matmul's arguments: "a, shape, transA, b, shape,
  /// transB" (both of rank >= 2).
  std::string matmulOperands(Operation *m);
  /// Lists the ops, checks their types, folds transposes, fuses elementwise
  /// chains and gives every value a buffer.
  bool prepare();
  /// The first backward op (the number of ops if none): the first whose node
  /// is "backward of ...", or with `phaseMarks` also the first the pipeline
  /// split marked with carve.phase.
  int firstBackwardOp(bool phaseMarks);
  /// The loss's reduction over the batch ("mean", "sum" or "unknown").
  std::string lossReduction();

  /// `"  T *x = (T *)(A + offset);  // parameter [shape]"` for an argument;
  /// `perMicroBatch`: inputs hold every micro-batch, `mb` picks one.
  std::string argumentPointer(mlir::BlockArgument a, bool perMicroBatch);
  /// Every argument and result has a type the targets support.
  bool checkTypes();
  /// Reads carve-fold-transposes' marks (foldedTransposes, transposedMatmul).
  bool foldTransposes();

  // Fusion.cpp.
  /// Reads the fusion groups off the IR (groups, groupOf, interior).
  void fuseElementwise();
  /// A group's functor (into fusedDefs) and its one `fused(...)` call.
  bool emitFused(const FusionGroup &g);

  // MemoryPlan.cpp.
  /// A new buffer; returns its number.
  int newBuffer(Region r, int64_t bytes, int def, std::string name);
  /// A buffer (and a C name) for every argument and result; live ranges.
  bool assignBuffers();
  /// The activations' offsets from 0 as carve-plan-memory recorded them,
  /// checked against the live ranges above (no two buffers live at once
  /// share a byte); sets out.activationBytes and out.unplannedBytes.
  bool readActivations();
  /// Checks each gradient the function returns (results from `first` on;
  /// `what` names the function in errors) names a float32 parameter and,
  /// with `computedHere`, is computed by an op of the function; `addSlot`
  /// adds its GradSlot (irGrad holds its record). Then orders the slots as
  /// carve.gradients does.
  bool
  collectGradients(mlir::func::ReturnOp ret, unsigned first, const std::string &what,
                   bool computedHere,
                   const std::function<void(unsigned result, unsigned param, Value grad)> &addSlot);
  /// The gradient buckets carve-data-parallel formed (carve.buckets).
  bool readBucketsOffIr(std::vector<Bucket> &buckets);
  /// ZeRO over dp: every gradient's elements and chunk (carve.zero_chunk);
  /// stage 1 and 2 pad their parameters to dp chunks (gathered in place).
  bool shardOverDp();
  /// Parameters and buffers, gradients, optimizer state and (the whole
  /// step) inputs and the loss seed, or (a stage) its seed, where
  /// carve-plan-memory placed them from byte `base` (carve.persistent_plan),
  /// each checked to lie in its region and over no other.
  bool readPersistent(int64_t base, PersistentLayout &layout);
  /// The byte range [begin, end) of a bucket's gradients.
  std::pair<int64_t, int64_t> bucketRange(const Bucket &bk);

  // EmitOps.cpp.
  /// The C variable of `v`.
  std::string name(Value v);
  /// The C variable and the shape of operand `k` as the call reads it.
  std::string opnd(Operation *op, unsigned k);
  std::string oshape(Operation *op, unsigned k);
  /// A null pointer of `like`'s element type (an absent optional operand).
  std::string nullOf(Value like);
  /// A constant's static array (into constants).
  bool emitConstant(ConstantOp op);
  /// The op's comment and call (nothing for a folded or fused op but a
  /// group's root); false with `error` set for an op no target supports.
  bool emitOp(Operation *op);
  /// `// op [shapes] -> [shapes]   [node]`, the line above every call.
  std::string opComment(Operation *op);
  /// The declaration of a result's pointer into the arena (or the slot).
  std::string resultPointer(Value r);
  /// One family of ops each: the call into `os`.
  bool emitElementwise(Operation *op, StringRef kernel, llvm::raw_ostream &os);
  bool emitMatmul(Operation *op, StringRef kernel, llvm::raw_ostream &os);
  bool emitReduction(Operation *op, llvm::raw_ostream &os);
  bool emitNormalization(Operation *op, llvm::raw_ostream &os);
  bool emitRotary(Operation *op, llvm::StringRef kernel, llvm::raw_ostream &os);
  bool emitConvolution(Operation *op, llvm::StringRef kernel, llvm::raw_ostream &os);
  mlir::Value gradCopy16(Operation *op, unsigned i);
  bool stridedCopy(mlir::Value c, std::string &out, int64_t &rowStride, int &count);
  bool hasMemory(mlir::Value v);
  bool emitAttention(Operation *op, llvm::raw_ostream &os);
  bool read16Operand(Operation *op, Operation *mm, unsigned k, std::string &out, bool &is16);
  /// Operand `k` of `op` as a kernel of rule 3g reads it (carve.read16):
  /// the 16-bit tensor holding its values (exact16) and `is16`, or the
  /// operand ("" and false: the flag is unset).
  bool exact16Operand(Operation *op, unsigned k, std::string &out, bool &is16);
  /// The 16-bit copy of result `k` (through reshapes) among the ops right
  /// after `op` that `op` writes as well (carve.copy_by_writer, rule 3h), or
  /// null.
  Value copyByWriter(Operation *op, unsigned k = 0);
  /// The `y16, round` arguments of a 16-bit entry: the copy copyByWriter
  /// names (or nullptr) and whether the op rounds its result as written
  /// (carve.round16).
  std::string copyArgs(Operation *op);
  /// A result's pointer, or nullptr where it is never stored (neverStoredF32:
  /// its writer writes only its 16-bit copy).
  /// resultOrNull, and null where the op writes `r`'s 16-bit copy `copy`
  /// and nothing reads `r` as f32 (onlyRead16: its memory stays planned).
  std::string resultOrCopyOnly(mlir::Value r, mlir::Value copy);
  std::string resultOrNull(Value r);
  bool biasGradArgs(mlir::Operation *op, std::string &out);
  std::string inputGradArgs(mlir::Operation *op);
  bool matmulResult(Operation *op, StringRef kernel, std::string &out);
  bool emitCrossEntropy(Operation *op, StringRef kernel, llvm::raw_ostream &os);
  bool emitDataMovement(Operation *op, llvm::raw_ostream &os);
  bool emitGather(Operation *op, StringRef kernel, llvm::raw_ostream &os);
  bool emitDropout(DropoutOp d, llvm::raw_ostream &os);
  bool emitCollective(Operation *op, llvm::raw_ostream &os);
  bool emitCustom(Operation *op, llvm::raw_ostream &os);
  std::string round16(Value r);

  // Target.cpp.
  /// `*ptr = value;` as a statement line; a one-element fill on the device.
  std::string seedStore(const std::string &ptr, const std::string &value) const;
  /// The first element of a tensor, read on the host.
  std::string scalarRead(const std::string &ptr) const;

  // Optimizer.cpp.
  /// The names the step's tail gives each parameter's tensors (tailPointers).
  struct TailNames {
    std::string param, grad, state[2];
    std::string master; // a 16-bit copy's fp32 master; empty: none
  };
  std::map<unsigned, TailNames> tailNames;
  /// The tail ops carve-optimizer appended (gradients by slot: grads[i]).
  OptimizerTail tail;
  /// Declares the tail's pointers (tailNames): every parameter, its gradient
  /// slot or (ZeRO >= 2) chunk, its optimizer state; `prefix` starts each
  /// name (a pipeline rank's chunks share the tail's scope).
  std::string tailPointers(const std::string &prefix);
  /// Raw pointers to a gradient's slot and (ZeRO >= 2) its chunk, for the
  /// body: float *, or uint16_t * where it is 16-bit (carve-store-grads16).
  std::string gradPtr(const GradSlot &g);
  std::string chunkPtr(const GradSlot &g);
  /// Whether the gradient is 16-bit, and whether its ZeRO-2/3 chunk is
  /// (not when fp32 accumulators take 16-bit gradients).
  bool grad16(const GradSlot &g);
  bool chunk16(const GradSlot &g);
  /// Whether what the tail reads of the gradient is 16-bit: the gradient,
  /// or under ZeRO-2/3 its chunk.
  bool tailGrad16(const GradSlot &g) { return zero >= 2 ? chunk16(g) : grad16(g); }
  /// The gradient's (or its chunk's) bytes per element.
  int64_t gradElementBytes(const GradSlot &g) { return grad16(g) ? 2 : 4; }
  int64_t chunkElementBytes(const GradSlot &g) { return chunk16(g) ? 2 : 4; }
  /// `ptr` as the runtime's 16-bit gradient (optim.h Grad16) of the plan's format.
  std::string asGrad16(const std::string &ptr);
  /// The CommType of a gradient's elements (F32, BF16 or F16).
  std::string gradCommType(const GradSlot &g);
  /// The CommType of parameter argument `arg`'s elements (a 16-bit copy: BF16, F16).
  std::string commTypeOf(unsigned arg);
  /// The bytes of one element of parameter argument `arg` (a 16-bit copy: 2).
  int64_t elementBytes(unsigned arg);
  /// C++ for the elements of chunk `rank` of a parameter (the last is short).
  std::string chunkCount(unsigned arg, const std::string &rank);
  /// Reads the tail ops (tail) and checks that they do what the plan needs:
  /// fp16 unscales and clipping scales every gradient, ZeRO-1 and 2 gather
  /// every updated parameter. After shardOverDp.
  bool readStepTail();
  /// `sqSplit += ...` / `sqWhole += ...` for each gradient carve.grad_norm lists.
  void emitNormTerms(llvm::raw_ostream &ts);
  /// Whether carve-select-kernels chose `kernel` (adamwMulti,
  /// sumSquaresMulti) for the tail's ops: one call over every parameter.
  bool tailKernel(llvm::StringRef kernel);
  /// Multi-tensor call sites printed so far (each one's runtime table key;
  /// firstMultiSite sets where they start).
  int multiSites = 0;
  /// Scales the gradients carve.scale_gradients lists by `clip`.
  void emitClip(llvm::raw_ostream &ts);
  /// carve.unscale_gradients (fp16): divides them by the loss scale.
  void emitUnscale(llvm::raw_ostream &ts);
  /// Each carve.adamw / carve.sgd, then carve.zero_gather (ZeRO-1/2).
  void emitUpdates(llvm::raw_ostream &ts);
  /// The whole step: the tail as loops over a table with one row per
  /// parameter (TailRow of the generated source), where every list of the
  /// tail is in the gradients' order with one format (planTailTable).
  bool tailAsTable = false;
  bool planTailTable();
  /// The table `tail` (instead of tailPointers).
  std::string tailTable();
  void emitTableNormTerms(llvm::raw_ostream &ts);
  /// Every gradient scaled by `factor` (clip, unscale).
  void emitTableScale(llvm::raw_ostream &ts, const char *factor);
  void emitTableUpdates(llvm::raw_ostream &ts);

  // Tables.cpp.
  /// inputRows and paramRows; `microBatches` inputs lie one after another.
  void buildTables(int64_t microBatches);
  /// The classes of input `a` where a cross-entropy reads it as its targets.
  void targetClasses(mlir::BlockArgument a, TensorRow &row);

  // Step.cpp: the pieces of run, in the order it calls them (documented there).
  bool collectStepGradients(mlir::func::ReturnOp ret, std::set<int> &pinned);
  GatherPlan planZero3Gathers();
  /// Reshape results (views: the same memory) declared so far in the
  /// function being emitted; a ZeRO-3 gather points the views of its
  /// parameter at the gathered buffer (a convolution's weight read as
  /// [O, C*kh*kw] through a reshape emitted before the gather).
  std::vector<Value> viewsInScope;
  void keepGradientChunks();
  bool emitStepSeed(const std::string &reduction);
  void startBuckets(const std::vector<Bucket> &buckets, size_t &next, int after);
  bool emitStepBody(const std::vector<Bucket> &buckets, GatherPlan &gathered, int backwardBegin);
  void indexGatherEvents(const GatherPlan &gathered);
  /// 2 * op index + (backward): the parameters gathered or prefetched there.
  std::unordered_map<int64_t, std::vector<unsigned>> gatherEvents;
  std::string gatherStatements(mlir::Operation *op, bool backward, const GatherPlan &gathered,
                               const std::map<unsigned, std::string> &shardVar);
  bool emitStepTail(Value loss, const std::vector<Bucket> &buckets, const std::string &reduction,
                    llvm::raw_ostream &ts);

  // Layers.cpp: one function per repeated layer.
  /// The statements one op printed into `body`: [begin, end).
  struct OpRecord {
    Operation *op;
    size_t begin, end;
  };
  std::vector<OpRecord> records;
  /// The layers' functions and their buffer tables (before the step).
  std::string layerDefs;
  /// The arguments only the layers' functions read: the step declares no
  /// pointer to them.
  llvm::DenseSet<Value> onlyInLayers;
  /// The step's pointers to its arguments (all but onlyInLayers).
  std::string argumentPointers();
  /// Per record, whether an outlined layer's function prints it.
  std::vector<bool> recordOutlined;
  /// The pointers to the forward's values that the statements after it read
  /// (the step's backward and tail, evaluate's loss), declared again where
  /// the forward wrote them: the forward is a function of its own.
  std::string forwardValuesReadAfter(int backwardBegin);
  /// Set while a layer's statements print as a function: its names and slots.
  struct LayerScope {
    std::string component; // this layer's node component ("h.3")
    /// Names by the order they are asked for (the printing of the function);
    /// null: positional names ("v0", "v1", ...), which is how twins are found.
    const std::vector<std::string> *given = nullptr;
    llvm::DenseMap<Value, std::string> names;
    std::vector<Value> order;        // the values in the order they were named
    std::vector<Value> slots;        // at[k]: the arena offset of slots[k]
    llvm::DenseSet<Value> defined;   // what the layer's statements write (or view)
    std::string declarations;        // pointers to what it reads from outside
    bool failed = false;             // a value with no arena address
  };
  LayerScope *layer = nullptr;
  /// The name a value has in the layer being printed (var.scoped).
  std::string &layerName(Value v);
  /// The first constant of the step with the same type and value as `c`:
  /// layers read equal constants through one name.
  llvm::DenseMap<Operation *, std::string> constantByValue;
  /// A layer's result pointer: `T *name = (T *)(A + at[k]);`.
  std::string layerResultPointer(Value r);
  /// A node name as a layer function's comments show it ("/h.*/attn/...").
  std::string layerNode(const std::string &node);
  /// Prints the ops of the records `members` as a function body in `scope`;
  /// false where one of them cannot (a value with no arena address).
  bool printLayer(const std::vector<size_t> &members, LayerScope &scope, std::string &text);
  /// Finds the runs of op records that are one layer each (by the model
  /// node's `name.N` component), prints each run that has a twin (the same
  /// statements on other buffers) once as a function, and replaces the runs
  /// in `body` by calls with the layer's buffer table. Moves forwardEnd.
  bool outlineLayers(int backwardBegin);
  /// The whole source: `plan` (the memory-plan comment) opens the step
  /// function, `tail` (sync, loss, optimizer) closes it.
  std::string emitProgram(const std::string &plan, const std::string &tail, int backwardBegin);

  // PipelineStage.cpp: the pieces of runStage (documented there).
  bool collectStageGradients(mlir::func::ReturnOp ret, int stage);
  bool checkMessageTags(int end, int64_t maxTag);
  std::string messageTag(int64_t tag) const;
  int tagWindow = 1; // micro-batches with distinct tags per transfer
  bool placeStageInputs(const std::map<std::string, int64_t> &inputOffsets, int stage);
  std::string stageSeed(const std::string &lossReduction);
  std::string stashDeclarations(int backwardBegin);
  /// The forward values backward reads (stashDeclarations declares them).
  std::vector<Value> stashedValues(int backwardBegin);
  bool stageGradientChunks(const std::vector<Bucket> &buckets, int stage);
  bool emitStageBodies(int chunk, int backwardBegin, Value loss, const std::vector<Bucket> &buckets,
                       const GatherPlan &gathered, StageOut &so, std::string &forwardBody,
                       std::string &backwardBody);
  std::string stageBucketStart(const Bucket &bk, size_t k, int chunk, StageOut &so);
  std::string stageBucketWait(const Bucket &bk, size_t k);
  std::string recvStatements(mlir::Operation *op, bool backward);
  std::string sendStatements(mlir::Operation *op, bool backward);
  void stageTail(const PipelineCodegenOptions &pipe, int chunk, StageOut &so);
};

} // namespace carve::codegen

#endif // CARVE_COMPILER_CODEGEN_GENERATOR_H
