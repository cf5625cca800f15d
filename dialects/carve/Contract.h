//===- Contract.h - the attributes the compiler's stages hand each other --===//
//
// Every discardable attribute that one stage of the compiler writes and a
// later one reads is named here, once, with an accessor for each question a
// stage asks of it ("which parameter is argument 3?", "which argument is the
// parameter of result 5's gradient?"). Call sites use these; no attribute
// name is spelled as a string literal anywhere else.
//
// Who writes what:
//   importer (compiler/frontend)   carve.param, carve.trainable, carve.buffer,
//                                  carve.input, carve.output
//   plan (compiler/plan)           carve.plan on the module (PlanAttr.h)
//   autodiff (carve-autodiff)      carve.loss_seed, carve.grad_of,
//                                  carve.loss_reduction, carve.unused_params
//   stage split (carve-split-stages)
//                                  carve.stage, carve.num_stages, carve.loss,
//                                  carve.shared_grad, carve.phase,
//                                  carve.from_stage, carve.to_stage,
//                                  carve.stage_summary
//   partition (carve-partition)    dist.layout, dist.annotation, dist.choice,
//                                  dist.sharded_rows, dist.partition_summary
//   fusion (carve-fuse-elementwise, carve-fold-transposes)
//                                  carve.fusion_group, carve.fold
//   recomputation (carve-recompute)
//                                  carve.recomputed
//   16-bit storage (carve-round-activations, carve-store-params16)
//                                  carve.round16, carve.master
//   data parallelism (carve-data-parallel)
//                                  carve.gradients, carve.buckets,
//                                  carve.zero_chunk, carve.zero3_gather
//   memory plan (carve-plan-memory)
//                                  carve.arena_offset, carve.activation_plan,
//                                  carve.zero3_gather_offsets,
//                                  carve.persistent_offset, carve.persistent_plan
//   optimizer (carve-optimizer)    no attributes: the step's tail as ops
//                                  (CarveOptimizerOps.td)
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_DIALECTS_CARVE_CONTRACT_H
#define CARVE_DIALECTS_CARVE_CONTRACT_H

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/BuiltinOps.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace carve {

// Function arguments and results (the importer).
/// On an argument: the model's parameter or buffer name (PyTorch's
/// state_dict key).
constexpr const char *kParamAttr = "carve.param";
/// On a parameter argument: present when the optimizer updates it.
constexpr const char *kTrainableAttr = "carve.trainable";
/// On an argument: a buffer (a non-trainable state tensor) and its name.
constexpr const char *kBufferAttr = "carve.buffer";
/// On an argument: the graph input's name.
constexpr const char *kInputAttr = "carve.input";
/// On a result: the graph output's name.
constexpr const char *kOutputAttr = "carve.output";

/// On an op of a builtin model that dropout follows, and on the module: the
/// dropout probability (the planner's activation accounting).
constexpr const char *kDropoutAttr = "carve.dropout";

// The training step (autodiff).
/// On the last argument of @train_step: the gradient fed into the loss.
constexpr const char *kLossSeedAttr = "carve.loss_seed";
/// On a result: the name of the parameter whose gradient it is.
constexpr const char *kGradOfAttr = "carve.grad_of";
/// On @train_step: "mean", "sum" or "unknown" (how the loss reduces the batch).
constexpr const char *kLossReductionAttr = "carve.loss_reduction";
/// On @train_step: trainable parameters that do not reach the loss.
constexpr const char *kUnusedParamsAttr = "carve.unused_params";

// Pipeline stages (the stage split).
/// On a stage function: its index and the number of stages.
constexpr const char *kStageAttr = "carve.stage";
constexpr const char *kNumStagesAttr = "carve.num_stages";
/// On result 0 of the last stage: the loss.
constexpr const char *kLossAttr = "carve.loss";
/// On a gradient result: this stage's part of a gradient summed over pp.
constexpr const char *kSharedGradAttr = "carve.shared_grad";
/// On the receives that open a stage's backward part: "backward".
constexpr const char *kPhaseAttr = "carve.phase";
/// On an op carve-recompute cloned into backward (unit).
constexpr const char *kRecomputedAttr = "carve.recomputed";
/// On dist.recv / dist.send: the stage at the other end.
constexpr const char *kFromStageAttr = "carve.from_stage";
constexpr const char *kToStageAttr = "carve.to_stage";
/// On a stage function: what the stage holds and costs (StageSummary).
constexpr const char *kStageSummaryAttr = "carve.stage_summary";

// Fusion (carve-fuse-elementwise).
/// On an op: the fused kernel it runs in (numbered in program order within
/// its function; the group's last op is its root).
constexpr const char *kFusionGroupAttr = "carve.fusion_group";
/// On a transpose (carve-fold-transposes): "operand" when each matmul that
/// reads it takes its input with a transpose flag instead (the transpose is
/// never computed); "product" when the matmul that produces its input writes
/// its product transposed instead (neither is computed on its own). On a
/// gather_grad: "scatter" when it computes the matmul whose product (through
/// reshapes) it reads, a block of rows at a time, the product never in
/// memory (the runtimes' matmul_gather_grad: an im2col convolution's
/// input gradient). On a gather: "gather" when every reader of its result
/// (through reshapes and "operand" transposes) is a matmul reading it as its
/// right operand, which gathers each of its batch matrices as it needs it,
/// the result never in memory (the runtimes' matmul_gathered: an im2col
/// convolution's forward and weight gradient).
constexpr const char *kFoldAttr = "carve.fold";
constexpr const char *kFoldOperand = "operand";
constexpr const char *kFoldProduct = "product";
constexpr const char *kFoldScatter = "scatter";
constexpr const char *kFoldGather = "gather";
/// On a slice: "view" when every reader of its result (through reshapes) is
/// a transpose that reads it in place, as a strided view of the slice's
/// source (carve-fold-views; the runtimes' transpose_view): the slice is
/// never in memory.
constexpr const char *kFoldView = "view";
/// On a transpose: "producer" when the op that writes its input writes it
/// transposed instead, in the transpose's result (carve-fold-views: cuDNN's
/// attention gradient writing dq, dk and dv as [b, t, h, d]); the input is
/// never in memory and the transpose is no call.
constexpr const char *kFoldProducer = "producer";
/// On a transpose: "consumer" when the op that reads its result, its only
/// reader, reads its input in place instead, transposed (carve-fold-views:
/// cuDNN's attention gradient reading dy as [b, t, h, d]); the transpose is
/// never in memory and no call.
constexpr const char *kFoldConsumer = "consumer";
/// On an add: "accumulate" when one operand is a layer or RMS norm
/// gradient's input gradient, read by the add alone, and the other is
/// defined before that gradient: the norm gradient adds the other operand
/// (the residual branch's gradient) as it writes its input gradient, into
/// the add's result and its 16-bit copy (carve-fold-views; the CUDA
/// runtime's layer_norm_grad_add, rms_norm_grad_add and their 16-bit
/// forms). The input gradient is never in memory and the add is no call.
constexpr const char *kFoldAccumulate = "accumulate";
/// On a concat along the last axis: "assemble" when each operand is, through
/// a reshape, a transpose marked "producer" of cuDNN's attention gradient
/// (dq, dk and dv as [b, t, h, d]) and every reader of the concat reads its
/// 16-bit copy (the first among the copies right after it): the gradient
/// writes each piece in 16 bits into the copy, at its columns
/// (carve-fold-views; the CUDA runtime's attention_grad_stats_cudnn with
/// dq16, dk16, dv16). The concat is marked carve.round16 too (its values
/// are the 16-bit pieces), no call, and neither it nor its pieces are in
/// memory in f32.
constexpr const char *kFoldAssemble = "assemble";
/// On a transpose to [b, h, t, d] of a column slice (marked "view", through
/// a reshape) of a rank-3 tensor, and on the transpose's 16-bit copy:
/// "strided" when the transpose is q, k or v of cuDNN's attention, which
/// reads it (forward and gradient) as its copy, and the sliced tensor's
/// writer writes a 16-bit copy of it (the first among the casts right after
/// the writer; the writer is marked carve.round16 too): the attention reads
/// the piece in place there, as [b, t, h, d] rows of the tensor's width
/// (carve-fold-views; the CUDA runtime's attention_stats_cudnn and
/// attention_grad_stats_cudnn with inRowStride16: q, k and v read from the
/// QKV projection as it is stored). Neither the transpose nor its copy is a
/// call or in memory, and the sliced tensor is never in memory in f32.
constexpr const char *kFoldStrided = "strided";
/// On an add of a 1-D bias (an f32 view of a 16-bit tensor, along the last
/// dimension) to a matmul's product, its only reader, where the add is the
/// source of q, k and v marked "strided" (its 16-bit copy all the program
/// keeps): "epilogue" when the matmul adds the bias to its fp32 product
/// before it rounds it into the add's copy (carve-fold-views; the CUDA
/// runtime's matmul16_bias, cuBLASLt's BIAS epilogue). The add is no call;
/// neither its result nor the product is in memory.
constexpr const char *kFoldEpilogue = "epilogue";

// Lowering (carve-select-kernels).
/// On an op the emitter prints: the runtime entry it runs as on the plan's
/// target (runtime/include/carve/rt/kernels.def), or "none" for an op that
/// is no call of its own (a view, a constant, a folded transpose or product).
constexpr const char *kKernelAttr = "carve.kernel";
/// On an op that runs as `matmul16` (CUDA): for each matmul operand, whether
/// the kernel reads the 16-bit tensor the operand is an exact f32 view of (a
/// cast from the plan's 16-bit format) instead of the view.
constexpr const char *kRead16Attr = "carve.read16";
/// On an attention op that runs as carve's own kernel on the CUDA target
/// where a library entry exists for other cases (`attention_stats` rather
/// than `attention_stats_cudnn`): why the library cannot take it.
constexpr const char *kKernelWhyAttr = "carve.kernel_why";

// 16-bit activations and parameters (carve-round-activations,
// carve-pack-activations, carve-store-params16).
/// On a forward op under a bf16/fp16 plan: its result is rounded to the
/// plan's 16-bit format as it is written, for every reader (backward reads
/// it, so it may be kept in 16 bits).
constexpr const char *kRound16Attr = "carve.round16";
/// On an op marked carve.round16 (CUDA target): its rounding is done by the
/// 16-bit copy of its result right after it (carve-select-kernels' rule 3d:
/// the cast runs as roundCopyBf16 / roundCopyF16), not by a kernel of its own.
constexpr const char *kRound16InCopyAttr = "carve.round16_in_copy";
/// On an op whose f32 result has a 16-bit copy right after it (CUDA target):
/// the op writes that copy itself, in the plan's 16-bit format, and no f32
/// result (carve-select-kernels' rule 3e; every other reader reads the copy).
constexpr const char *kWrite16Attr = "carve.write16";
/// On a 16-bit copy of a fused chain's rounded output, right after the
/// chain's root (CUDA target): the chain's kernel writes it as it writes the
/// f32 value (carve-select-kernels' rule 3f); the copy is no call.
constexpr const char *kCopyInFusedAttr = "carve.copy_in_fused";
/// On a 16-bit copy right after the op that writes its f32 input (a binary
/// op, a unary gradient or a concatenation; CUDA target): that op writes the
/// copy as it writes the value (carve-select-kernels' rule 3h: binary16,
/// unary_grad16, concat16); the copy is no call.
constexpr const char *kCopyByWriterAttr = "carve.copy_by_writer";
/// On a bias gradient's reduction (a sum over every axis but the last) whose
/// 16-bit result the weight gradient's GEMM writes (CUDA target, bf16/fp16:
/// carve-select-kernels' rule 3i, cuBLASLt's BGRADA/BGRADB epilogue): the
/// reduction is no call.
constexpr const char *kBiasGradInGemmAttr = "carve.bias_grad_in_gemm";
/// On a cross-entropy whose loss its gradient's call computes in the same
/// pass (CUDA target: carve-select-kernels' rule 3j, cross_entropy_with_grad):
/// the forward's call runs only under train --eval-data (ctx.evaluating).
constexpr const char *kLossInGradAttr = "carve.loss_in_grad";
/// On the weight gradient's GEMM of rule 3i (matmul16_to16_bgrad): which of
/// its call's operands (0: a, 1: b) the bias gradient sums the columns of.
constexpr const char *kBiasGradOfAttr = "carve.bias_grad_of";
/// On a trainable parameter argument under a bf16/fp16 plan
/// (carve-store-params16): the argument is the 16-bit copy the step reads;
/// its fp32 master lives with the optimizer state (carve.persistent_plan's
/// `masters`), which updates it and rounds it into the copy.
constexpr const char *kMasterAttr = "carve.master";

/// Every tensor in the arena starts at a multiple of this many bytes (the
/// emitter's memory plan; gradient buckets count their bytes so).
constexpr int64_t kArenaAlign = 64;

// Data parallelism (carve-data-parallel).
/// On an emitted function: the gradients it returns in the order backward
/// finishes them, each {result, param (argument), ready (index of the op
/// after which it is final), copy (copied into its slot after the last op)}.
constexpr const char *kGradientsAttr = "carve.gradients";
/// On an emitted function: the gradient buckets, each {first, last
/// (positions in carve.gradients), bytes, ready, wait_at (ZeRO >= 2: the op
/// after which its reduce-scatter is waited for), reduce ("all_reduce",
/// "reduce_scatter" or "none" at dp = 1)}.
constexpr const char *kBucketsAttr = "carve.buckets";
/// On a trainable parameter's argument under ZeRO over dp: the elements of
/// each dp rank's chunk (the last chunk padded).
constexpr const char *kZeroChunkAttr = "carve.zero_chunk";
/// Expert parallelism (carve-expert-parallel): on a parameter argument, the
/// unit attribute that it belongs to an expert (its gradient is summed over
/// the ranks holding the same experts, "edp", not over dp); on the module,
/// the ep rank whose experts the module holds.
constexpr const char *kExpertAttr = "carve.expert";
constexpr const char *kEpRankAttr = "carve.ep_rank";
/// On a trainable parameter's argument under ZeRO-3: the ops (indices in the
/// function) between which it is gathered whole, [forward first, forward
/// last, backward first, backward last] (-1: no use in that pass).
constexpr const char *kZero3GatherAttr = "carve.zero3_gather";

// The memory plan (carve-plan-memory).
/// On an op: the byte offset of each result's buffer from the start of the
/// activation region (a pipeline stage: of its slot, send and scratch parts,
/// one after another; see carve.activation_plan); -1 for a
/// result without an activation buffer of its own.
constexpr const char *kArenaOffsetAttr = "carve.arena_offset";
/// On a ZeRO-3 argument: the offsets of its gathered buffers [forward,
/// backward] (-1: not gathered in that pass).
constexpr const char *kZero3GatherOffsetsAttr = "carve.zero3_gather_offsets";
/// On an emitted function: {bytes (the region's size), unplanned (without
/// reuse), copies (per carve.gradients entry, the offset of its copy under
/// ZeRO >= 2 in @train_step, of its reduce-scattered chunk's staging buffer
/// under ZeRO >= 2 in a stage, else -1); a stage also slot and sends: its
/// region is [0, slot) what a micro-batch keeps from forward to backward and
/// its forward sends, [slot, slot + sends) what its backward sends, the rest
/// scratch}.
constexpr const char *kActivationPlanAttr = "carve.activation_plan";
/// On an argument of an emitted function: its byte offset in the rank's
/// arena (parameters and buffers, graph inputs, the loss seed).
constexpr const char *kPersistentOffsetAttr = "carve.persistent_offset";
/// On an emitted function: its persistent regions in the arena, {begin,
/// params_end, grads_end, state_end, end} ([begin, params_end) parameters and
/// buffers, then the gradient slots or ZeRO chunks, then the optimizer
/// state; @train_step's inputs and loss seed, or a stage's seed, up to end),
/// grads (the offset of each carve.gradients entry's slot), states (two
/// per entry: its optimizer state tensors, -1 for none) and masters (per
/// entry: the fp32 master of a 16-bit parameter copy, carve.master, in the
/// optimizer state region; -1 for none).
constexpr const char *kPersistentPlanAttr = "carve.persistent_plan";

// Layouts (the partitioner).
/// On function arguments and results a dictionary {dp = #dist.sbp, tp =
/// #dist.sbp}; on ops an array with one #dist.sbp per result (the tp axis).
constexpr const char *kLayoutAttr = "dist.layout";
/// On ops: the annotation and the chosen dimension ("tp: n" or "tp: replicate").
constexpr const char *kAnnotationAttr = "dist.annotation";
constexpr const char *kChoiceAttr = "dist.choice";
/// On gather / gather_grad whose table rows are split over tp: the full row
/// count; on cross_entropy(_grad) whose classes are split: the full class count.
constexpr const char *kShardedRowsAttr = "dist.sharded_rows";
/// On the module: what the partitioner did ({ops_split, all_reduce,
/// all_gather, reduce_scatter, all_to_all}: ops split over tp and the
/// collectives it inserted, per step).
constexpr const char *kPartitionSummaryAttr = "dist.partition_summary";
/// On the module: one line per large parameter projection that tp > 1 left
/// replicated, "NODE (a AxB weight) left replicated: WHY" (carve compile
/// prints each as a note).
constexpr const char *kReplicatedProjectionsAttr = "dist.replicated_projections";

// The plan (compiler/plan writes it; every pass and the emitter read it).
/// On the module: a dictionary with the fields of PlanAttrs (absent fields
/// take their defaults), e.g.
///   module attributes {carve.plan = {dp = 2 : i64, tp = 2 : i64, zero = 1 : i64}}
constexpr const char *kPlanAttr = "carve.plan";

/// The plan as the module holds it: what the passes after import need of
/// the plan file (docs/plan.md), resolved (micro-batches counted, schedule
/// named). Read with readPlan, written with writePlan; passes keep no copy.
struct PlanAttrs {
  int64_t dp = 1, tp = 1, pp = 1;
  /// Expert parallelism: the experts of each mixture-of-experts layer split
  /// over groups of `ep` consecutive data-parallel ranks (docs/moe.md).
  int64_t ep = 1;
  int64_t zero = 0;
  /// ZeRO-3: gathers start this many layers ahead of their use (0: at it).
  int64_t zero3PrefetchLayers = 0;
  bool sequenceParallel = false;
  /// Batch norm's statistics summed over the data-parallel replicas
  /// (carve-lower-convolutions; `sync_batch_norm` in the plan file).
  bool syncBatchNorm = false;
  int64_t microBatches = 1;  // per step of each data-parallel replica
  int64_t virtualStages = 1; // stages per pipeline rank
  std::string schedule = "1f1b";
  std::string precision = "fp32";
  /// The CUDA target's matmuls of fp32 inputs through TF32 tensor cores
  /// (plan field `tf32`; the runtime's setTf32). No effect on the CPU target.
  bool tf32 = false;
  /// Under bf16/fp16: "fp32" or "16bit", where micro-batches accumulate
  /// gradients (gradients16, fp32ChunkAccumulators).
  std::string gradAccumulation = "fp32";
  int64_t globalBatch = 0; // 0: not known (a lit test's module)
  /// The programs' target: "cpu" (C++ against carve::rt) or "cuda" (CUDA
  /// C++ against carve::gpu); carve-select-kernels chooses its entries.
  std::string target = "cpu";
  /// The CUDA target's attention under bf16/fp16: "cudnn" (cuDNN's fused
  /// flash attention where it can take the call) or "carve" (carve's own
  /// kernel everywhere; `carve compile --attention carve`).
  std::string attention = "cudnn";
  /// The CUDA target's convolutions: "cudnn" (carve.conv2d kept whole
  /// through autodiff, run as cuDNN's convolutions) or "carve" (im2col
  /// gathers and GEMMs, as on the CPU target; `carve compile --convolution
  /// carve`).
  std::string convolution = "cudnn";
  /// Tensors of optimizer state per parameter, each the parameter's size
  /// (or its ZeRO chunk): AdamW 2 (exp_avg, exp_avg_sq), SGD with momentum
  /// 1, plain SGD 0.
  int64_t optimizerState = 2;
  /// Activation recomputation: "none", "selective" or "full"; with
  /// recomputeLayers, full on the layers those globs name only.
  std::string recompute = "none";
  std::vector<std::string> recomputeLayers;
  /// Pipeline cut points: op-name globs, one per stage boundary.
  std::vector<std::string> cuts;
  /// The "ops" overrides in file order: op-name glob, dimension ("replicate").
  std::vector<std::pair<std::string, std::string>> ops;

  int64_t worldSize() const { return dp * tp * pp; }
  /// Whether gradients are produced, reduced and kept in the plan's 16-bit
  /// format (docs/training.md#16-bit-gradients): under bf16/fp16, unless
  /// micro-batches accumulate whole gradients (ZeRO-0/1) in fp32.
  bool gradients16() const {
    return precision != "fp32" && !(microBatches > 1 && zero < 2 && gradAccumulation == "fp32");
  }
  /// Whether ZeRO-2/3 accumulate the 16-bit gradients' chunks over the
  /// micro-batches in fp32 chunk accumulators.
  bool fp32ChunkAccumulators() const {
    return precision != "fp32" && zero >= 2 && microBatches > 1 && gradAccumulation == "fp32";
  }
  /// Whether the step runs as pipeline stages (several stages or micro-batches).
  bool pipelined() const { return pp > 1 || microBatches > 1; }
};

/// Writes `plan` as the module's `carve.plan`.
void writePlan(mlir::ModuleOp module, const PlanAttrs &plan);
/// Reads the module's `carve.plan`; a module without one has the default
/// plan (one rank). A malformed field is an error on the module.
mlir::FailureOr<PlanAttrs> readPlan(mlir::ModuleOp module);

/// The parameter (or buffer) name of argument `arg`, null when it is neither.
mlir::StringAttr paramNameOf(mlir::func::FuncOp fn, unsigned arg);
/// The graph input name of argument `arg`, null when it is no input.
mlir::StringAttr inputNameOf(mlir::func::FuncOp fn, unsigned arg);
/// The parameter whose gradient result `result` is, null when it is none.
mlir::StringAttr gradOf(mlir::func::FuncOp fn, unsigned result);
/// The argument that holds the parameter of gradient result `result`, or
/// nullopt when the result is no gradient or no argument holds its parameter.
std::optional<unsigned> paramArgOfGrad(mlir::func::FuncOp fn, unsigned result);
/// paramArgOfGrad for every result of `fn` at once (one pass over the
/// arguments: a loop over the results calls this, not paramArgOfGrad).
std::vector<std::optional<unsigned>> paramArgsOfGrads(mlir::func::FuncOp fn);

/// Argument (or result) attributes of `fn` set in bulk. FuncOp::setArgAttr
/// builds a new array of every argument's dictionary on each call, which the
/// context keeps for good: a loop over a large model's parameters setting one
/// each is quadratic in time and memory (the 1T GPT's as-compiled check spent
/// 160 MB on it). `set` collects; `apply` (or the destructor) writes one array.
class ArgAttrEdits {
public:
  explicit ArgAttrEdits(mlir::func::FuncOp fn, bool results = false) : fn(fn), results(results) {}
  ArgAttrEdits(const ArgAttrEdits &) = delete;
  ArgAttrEdits &operator=(const ArgAttrEdits &) = delete;
  ~ArgAttrEdits() { apply(); }
  void set(unsigned index, llvm::StringRef name, mlir::Attribute value);
  void apply();

private:
  mlir::func::FuncOp fn;
  bool results;
  std::vector<mlir::NamedAttrList> lists; // empty until the first set
};
/// True when argument `arg` is a parameter the optimizer updates.
bool isTrainable(mlir::func::FuncOp fn, unsigned arg);
/// The functions the emitter prints, which the passes after the stage split
/// work on: @train_step, or the stages (carve.stage).
bool isEmittedFunction(mlir::func::FuncOp fn);

/// Whether `v` holds values the plan's 16-bit format represents exactly: its
/// storage (through reshapes) is written by an op marked carve.round16.
bool isRounded16(mlir::Value v);

/// carve-select-kernels' rule 3c: why cuDNN's fused flash attention cannot
/// run this carve.attention_stats / carve.attention_grad_stats under `plan`
/// on the CUDA target (empty: it can). carve-pack-activations reads it too
/// (the forward's q, k, v copies are made before such a call, which reads
/// them as stored).
std::string cudnnAttentionRefusal(mlir::Operation *op, const PlanAttrs &plan);
/// The 16-bit copy of `x` (a carve.cast from f32 to the plan's 16-bit
/// format `precision`) made before `op` in its block, or null.
mlir::Value copy16Before(mlir::Value x, mlir::Operation *op, llvm::StringRef precision);
/// copy16Before of `x`, or of the value `x` is a reshape of (through
/// reshapes: the same memory, so the copy's bits in `x`'s order): the copy
/// a cuDNN attention forward reads for its operand `x` (rule 3c).
mlir::Value copy16BeforeView(mlir::Value x, mlir::Operation *op, llvm::StringRef precision);
/// The 16-bit tensor (of the plan's format `precision`) that holds exactly
/// the bits an f32 operand `v` of `reader` rounds to, or null. Through
/// reshapes (the same memory) to the value they alias, that is: the tensor
/// it is an exact f32 view of (the input of a carve.cast from the 16-bit
/// format: a parameter's copy, a saved activation), or its 16-bit copy made
/// before `reader` (copy16Before). carve-select-kernels' carve.read16
/// (matmul16, cuDNN attention) and the emitter read operands through it.
mlir::Value stored16(mlir::Value v, mlir::Operation *reader, llvm::StringRef precision);
/// stored16 for a reader that computes in f32 rather than rounding its
/// operand (a norm, an elementwise kernel, a gather): the 16-bit tensor that
/// holds exactly the f32 values of `v` (through reshapes), or null. The
/// tensor `v` is a view of, or its 16-bit copy made before `reader` where
/// `v`'s writer rounds it to the format as written (carve.round16), so the
/// copy loses nothing.
mlir::Value exact16(mlir::Value v, mlir::Operation *reader, llvm::StringRef precision);

} // namespace carve

#endif // CARVE_DIALECTS_CARVE_CONTRACT_H
