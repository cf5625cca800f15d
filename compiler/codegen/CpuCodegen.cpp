//===- CpuCodegen.cpp - per-rank C++ programs for the CPU target ----------===//
//
// The generated step function is straight-line code: one runtime kernel call
// per op of @train_step, in program order. Three rewrites keep it lean:
//   - a reshape is a new name for its input's memory (no copy);
//   - a transpose that swaps the last two dimensions and feeds only matmuls
//     becomes the GEMM's transpose flag;
//   - activations share memory: a first-fit plan over their live ranges.
// Gradients are placed contiguously in the order backward produces them, so
// each all-reduce bucket is one contiguous range started as soon as its last
// gradient is written.
//
//===----------------------------------------------------------------------===//

#include "compiler/codegen/CpuCodegen.h"

#include "dialects/carve/CarveOps.h"
#include "dialects/dist/DistDialect.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/DialectResourceBlobManager.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/ADT/StringSet.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <memory>
#include <cctype>
#include <queue>
#include <set>

using namespace mlir;

namespace carve {

namespace {
/// A number as Python prints it in a repr (shortest form that reads back).
std::string py(double x) {
  char buf[64];
  for (int p = 1; p <= 17; ++p) {
    snprintf(buf, sizeof buf, "%.*g", p, x);
    if (strtod(buf, nullptr) == x)
      break;
  }
  return buf;
}
struct PyNum {
  double x;
};
llvm::raw_ostream &operator<<(llvm::raw_ostream &os, PyNum n) { return os << py(n.x); }
} // namespace

std::string OptimizerConfig::describe() const {
  std::string s;
  llvm::raw_string_ostream os(s);
  double wd = effectiveWeightDecay();
  if (kind == "adamw")
    os << "AdamW(lr=" << PyNum{lr} << ", betas=(" << PyNum{beta1} << ", " << PyNum{beta2}
       << "), eps=" << PyNum{eps} << ", weight_decay=" << PyNum{wd} << ")";
  else
    os << "SGD(lr=" << PyNum{lr} << ", momentum=" << PyNum{momentum}
       << ", dampening=" << PyNum{dampening} << ", weight_decay=" << PyNum{wd}
       << ", nesterov=" << (nesterov ? "True" : "False") << ")";
  if (clipGradNorm > 0)
    os << ", clip_grad_norm=" << PyNum{clipGradNorm};
  if (warmupSteps > 0 || decaySteps > 0)
    os << ", schedule: warmup " << warmupSteps << " steps, cosine decay over " << decaySteps
       << " steps to " << PyNum{minLrRatio} << " x lr";
  return s;
}

namespace {

constexpr int64_t kAlign = 64;

int64_t alignUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

RankedTensorType typeOf(Value v) { return cast<RankedTensorType>(v.getType()); }

/// A C identifier from a model name: "/h.0/attn/c_attn/MatMul" -> "h0_attn_c_attn_MatMul".
std::string identifier(StringRef name) {
  std::string s;
  for (char c : name) {
    if (isalnum((unsigned char)c)) {
      s += c;
    } else if (c == '.' && !s.empty() && isdigit((unsigned char)s.back())) {
      s += '_';
    } else if (!s.empty() && s.back() != '_') {
      s += '_';
    }
  }
  while (!s.empty() && s.back() == '_')
    s.pop_back();
  if (s.empty() || isdigit((unsigned char)s[0]))
    s = "v" + s;
  return s;
}

/// The C element type, the runtime's DType, and the size of an element type.
bool elementInfo(Type t, std::string &ctype, std::string &dtype, int &size) {
  if (t.isF32())
    return ctype = "float", dtype = "F32", size = 4, true;
  if (t.isF64())
    return ctype = "double", dtype = "F64", size = 8, true;
  if (t.isInteger(64))
    return ctype = "int64_t", dtype = "I64", size = 8, true;
  if (t.isInteger(32))
    return ctype = "int32_t", dtype = "I32", size = 4, true;
  if (t.isInteger(1))
    return ctype = "uint8_t", dtype = "Bool", size = 1, true;
  return false;
}

std::string typeString(Type t) {
  std::string s;
  llvm::raw_string_ostream os(s);
  t.print(os);
  return s;
}

std::string dims(ArrayRef<int64_t> d) {
  std::string s = "{";
  for (size_t i = 0; i < d.size(); ++i)
    s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "}";
}

std::string shapeText(ArrayRef<int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i)
    s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

std::string number(double x, bool isFloat) {
  std::string s;
  llvm::raw_string_ostream os(s);
  os << llvm::format("%.9g", x);
  if (isFloat) {
    if (s.find_first_of(".eEn") == std::string::npos)
      s += ".0";
    if (s == "inf" || s == "-inf" || s == "nan")
      return s == "nan" ? "NAN" : (s[0] == '-' ? "-INFINITY" : "INFINITY");
    s += "f";
  }
  return s;
}

std::string bytesText(int64_t b) {
  char buf[64];
  if (b >= (1 << 20))
    snprintf(buf, sizeof buf, "%.1f MiB", b / 1048576.0);
  else if (b >= 1024)
    snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else
    snprintf(buf, sizeof buf, "%lld B", (long long)b);
  return buf;
}

enum class Region { Activation, Param, Grad, State, Input, Seed, Constant };

struct Buffer {
  Region region = Region::Activation;
  int64_t bytes = 0;
  int def = -1;     // index of the defining op (-1: lives for the whole step)
  int lastUse = -1; // index of the last op that reads it
  int64_t offset = -1;
  std::string name; // C variable of the root value
};

struct TensorRow {
  std::string name, dtype;
  SmallVector<int64_t> shape, global;
  int tpDim = -1;
  int64_t tpGroups = 1, zeroChunk = 0;
  bool paramZero = false, stateZero = false;
  int64_t numel = 0, offset = 0;
  bool trainable = false;
  int64_t gradOffset = -1, state[2] = {-1, -1};
};

/// The runtime's table `name` (TensorSpec rows, program.h).
void emitTensorRows(llvm::raw_ostream &os, const char *name, const std::vector<TensorRow> &rs) {
  os << "const TensorSpec " << name << "[] = {\n";
  for (const TensorRow &r : rs)
    os << "    {\"" << r.name << "\", DType::" << r.dtype << ", " << r.shape.size() << ", "
       << dims(r.shape) << ", " << r.numel << ", " << r.offset << ", "
       << (r.trainable ? "true" : "false") << ", " << r.gradOffset << ", {" << r.state[0] << ", "
       << r.state[1] << "}, " << dims(r.global) << ", " << r.tpDim << ", " << r.tpGroups << ", "
       << r.zeroChunk << ", " << (r.paramZero ? "true" : "false") << ", "
       << (r.stateZero ? "true" : "false") << "},\n";
  if (rs.empty())
    os << "    {\"\", DType::F32, 0, {}, 0, 0, false, -1, {-1, -1}},\n";
  os << "};\n";
}

/// The runtime headers a generated source includes.
std::string runtimeIncludes(const CodegenOptions &opts, bool pipelined) {
  if (opts.cuda())
    return "#include \"carve/rt/gpu.h\"\n#include \"carve/rt/gpu_fused.cuh\"\n";
  return std::string("#include \"carve/rt/dist.h\"\n#include \"carve/rt/fused.h\"\n"
                     "#include \"carve/rt/kernels.h\"\n#include \"carve/rt/optim.h\"\n") +
         (pipelined ? "#include \"carve/rt/pipeline.h\"\n" : "") +
         "#include \"carve/rt/program.h\"\n";
}

/// Writes `gpu::` before every call of a carve::gpu kernel in a CUDA source.
/// The carve::rt types in their arguments (Dims, Split, Precision, ...) would
/// otherwise let argument-dependent lookup find the CPU kernel of the same
/// name too, and the call would be ambiguous (or worse, resolve to the CPU).
void qualifyGpuCalls(std::string &src) {
  static const std::set<std::string> names = {
      "unary", "unary_grad", "binary", "compare", "logic", "where", "cast", "fill", "copy",
      "matmul", "reduce", "softmax", "softmax_grad", "layer_norm", "layer_norm_grad", "rms_norm",
      "rms_norm_grad", "attention", "attention_grad", "cross_entropy", "cross_entropy_grad",
      "transpose", "slice", "slice_grad", "concat", "gather", "gather_grad", "expand",
      "takeShard", "placeShard", "allGatherSplit", "reduceScatterSplit", "allToAllSplit",
      "gather_sharded", "gather_sharded_grad", "cross_entropy_vocab_parallel",
      "cross_entropy_vocab_parallel_grad", "sgdUpdate", "adamwUpdate", "sumSquares",
      "addInPlace", "scaleInPlace", "setPrecision", "readScalar", "fused", "normAccumulators",
      "sumSquaresAdd", "readScalars", "graphStep"};
  std::string out;
  out.reserve(src.size() + src.size() / 16);
  size_t i = 0, lineStart = 0;
  bool comment = false; // inside a // comment: leave the prose alone
  while (i < src.size()) {
    char c = src[i];
    if (c == '\n') {
      comment = false;
      lineStart = i + 1;
    } else if (c == '/' && i + 1 < src.size() && src[i + 1] == '/') {
      comment = true;
    }
    if (!comment && (std::isalpha((unsigned char)c) || c == '_') &&
        (i == lineStart || !(std::isalnum((unsigned char)src[i - 1]) || src[i - 1] == '_' ||
                             src[i - 1] == ':' || src[i - 1] == '.' || src[i - 1] == '>'))) {
      size_t j = i;
      while (j < src.size() && (std::isalnum((unsigned char)src[j]) || src[j] == '_'))
        ++j;
      std::string word = src.substr(i, j - i);
      if (j < src.size() && src[j] == '(' && names.count(word))
        out += "gpu::";
      out += word;
      i = j;
      continue;
    }
    out += c;
    ++i;
  }
  src = std::move(out);
}

/// Declares the gradient norm's two sums of squares (tp-split gradients, and
/// the rest). On CUDA they accumulate on the device, so the norm costs one
/// read instead of one per gradient.
std::string normDeclarations(const CodegenOptions &opts) {
  std::string s = "  double sqSplit = 0, sqWhole = 0;\n";
  if (opts.cuda())
    s += "  // On the device: [0] the tp-split gradients, [1] the rest; added in this order,\n"
         "  // read once below.\n  double *sqDevice = normAccumulators();\n";
  return s;
}

/// CUDA: reads the device sums into sqSplit and sqWhole (nothing on the CPU).
std::string normRead(const CodegenOptions &opts) {
  if (!opts.cuda())
    return "";
  return "  double sqHost[2];\n  readScalars(sqDevice, sqHost, 2);  // waits for the step's "
         "kernels\n  sqSplit = sqHost[0], sqWhole = sqHost[1];\n";
}

/// The step's first statement under a bf16/fp16 plan (nothing under fp32).
std::string precisionLine(const CodegenOptions &opts) {
  if (opts.precision == "fp32")
    return "";
  return std::string("  // Plan precision ") + opts.precision +
         ": matmul and attention round their inputs to it and accumulate in fp32.\n" +
         "  setPrecision(Precision::" + (opts.precision == "bf16" ? "BF16" : "F16") + ");\n";
}

/// The namespace whose kernels the step calls (the same names on both targets).
std::string usingLine(const CodegenOptions &opts) {
  return opts.cuda() ? "// The CUDA target: every call below runs on the device's compute stream "
                       "(carve/rt/gpu.h),\n// named gpu:: where a CPU kernel of the same name exists.\nnamespace gpu = carve::gpu;\nnamespace ew = carve::rt::ew;\nusing namespace carve::gpu;\n"
                     : "using namespace carve::rt;\n";
}

/// The tensor tables and the `Program` of a rank's source (program.h); with
/// `pipe`, the pipeline fields too. Closes the anonymous namespace.
void emitProgramTables(llvm::raw_ostream &os, const CodegenOptions &opts,
                       const GeneratedProgram &out, const std::vector<TensorRow> &inputs,
                       const std::vector<TensorRow> &params, const PipelineCodegenOptions *pipe) {
  emitTensorRows(os, "kInputs", inputs);
  emitTensorRows(os, "kParams", params);
  int64_t seq = 0;
  bool tokens = inputs.size() == 2 && inputs[0].dtype == "I64" && inputs[1].dtype == "I64" &&
                inputs[0].shape.size() == 2 && inputs[0].shape == inputs[1].shape;
  if (tokens)
    seq = inputs[0].shape[1];
  const OptimizerConfig &o = opts.optimizer;
  bool adam = o.kind == "adamw";
  int slots = adam ? 2 : o.momentum != 0 ? 1 : 0;
  auto escape = [](const std::string &x) {
    std::string e;
    for (char c : x)
      e += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
    return e;
  };
  const std::string &P = opts.programName;
  const int p = pipe ? pipe->pp : 1;
  os << "\n} // namespace\n\nextern const Program " << P << " = {\n"
     << "    \"" << P << "\", \"" << escape(opts.modelName) << "\",\n"
     << "    /*worldSize=*/" << opts.dp * opts.tp * p << ", /*dp=*/" << opts.dp << ",\n"
     << "    /*globalBatch=*/" << opts.globalBatch << ", /*localBatch=*/"
     << opts.globalBatch / std::max(1, opts.dp) << ", /*seqLen=*/" << seq << ",\n"
     << "    DataKind::" << (tokens ? "Tokens" : "Tensors") << ",\n"
     << "    " << inputs.size() << ", kInputs, " << params.size() << ", kParams,\n"
     << "    /*arenaBytes=*/" << out.arenaBytes << ",\n"
     << "    OptimizerKind::" << (adam ? "AdamW" : "SGD") << ", /*numStateSlots=*/" << slots
     << ",\n"
     << "    \"" << escape(o.describe()) << "\",\n"
     << "    step,\n"
     << "    /*tp=*/" << opts.tp << ", /*zeroStage=*/" << (opts.dp > 1 ? opts.zero : 0) << ",\n"
     << "    /*paramBytes=*/" << out.paramBytes << ", /*gradBytes=*/" << out.gradBytes
     << ", /*stateBytes=*/" << out.stateBytes << ",\n";
  const bool more = opts.cuda() || opts.precision != "fp32";
  if (pipe || more)
    os << "    /*pp=*/" << p << ", /*ppRank=*/" << (pipe ? pipe->rank : 0)
       << ", /*numMicroBatches=*/" << (pipe ? opts.numMicroBatches : 1)
       << ", /*activationBytes=*/" << out.activationBytes << ",\n";
  if (more)
    os << "    /*device=*/" << (opts.cuda() ? "&kCudaTarget" : "nullptr") << ", /*precision=*/\""
       << opts.precision << "\",\n";
  os << "};\n";
}

/// The global loss from this rank's share: summed over the dp replicas, and
/// for a mean divided by their number.
void emitDpLoss(llvm::raw_ostream &os, const CodegenOptions &opts, const std::string &reduction) {
  if (opts.dp <= 1)
    return;
  os << "  ctx.dpComm->allReduce(&loss, 1, CommType::F32, ReduceOp::Sum);  // reason: report "
        "the global loss\n";
  if (reduction == "mean")
    os << "  loss /= " << opts.dp << ".0f;  // the mean of " << opts.dp
       << " equal shares is the global mean\n";
}

class Generator {
public:
  Generator(func::FuncOp fn, const CodegenOptions &opts, GeneratedProgram &out, std::string &error)
      : fn(fn), opts(opts), out(out), error(error) {}

  bool run();

  /// A pipeline stage's pieces, for generatePipelineProgram to assemble.
  struct StageOut {
    std::string constants, forward, backward; // definitions in the chunk's namespace
    std::string init;                         // statements at the start of the step
    std::string bucketWaits, norm, clip, updates, unscale;
    std::vector<std::pair<std::string, std::string>> sharedGrads; // name -> pointer
    std::map<std::string, std::string> customKernels;
    std::vector<TensorRow> params, inputs;
    int64_t persistentEnd = 0, activationBytes = 0, unplannedBytes = 0;
    int64_t paramBytes = 0, gradBytes = 0, stateBytes = 0;
    int numBuckets = 0, kernelCalls = 0;
    bool hasLoss = false;
    std::string lossReduction = "unknown";
    std::string plan; // memory-plan comment lines
  };
  /// Generates chunk `chunk` (a @stageN function): persistent tensors from
  /// byte `base`, graph inputs at `inputOffsets`, activations relative to the
  /// micro-batch's slot.
  bool runStage(const PipelineCodegenOptions &pipe, int chunk, int64_t base,
                const std::map<std::string, int64_t> &inputOffsets, StageOut &so);

private:
  func::FuncOp fn;
  const CodegenOptions &opts;
  GeneratedProgram &out;
  std::string &error;

  std::vector<Operation *> ops;
  DenseMap<Operation *, int> index;
  DenseMap<Value, int> bufferOf;    // value -> buffer
  DenseMap<Value, std::string> var; // value -> C variable
  std::vector<Buffer> buffers;
  llvm::StringSet<> usedNames;
  std::set<Operation *> foldedTransposes;
  // transpose(matmul(a, b)) computed as matmul(b^T, a^T): transpose -> matmul.
  DenseMap<Operation *, Operation *> transposedMatmul;
  std::set<Operation *> fusedMatmuls;
  std::map<std::pair<Operation *, unsigned>, Value> foldedOperand;

  // Fused elementwise chains (fuseElementwise): each group runs as one kernel
  // at its root, the member with the highest index.
  struct FusionGroup {
    Operation *root = nullptr;
    std::vector<Operation *> ops; // members in program order, the root last
    std::vector<Value> inputs;    // read from memory, in first-use order
    std::vector<Value> outputs;   // written: the root's result, then intermediates read later
  };
  std::vector<FusionGroup> groups;
  DenseMap<Operation *, int> groupOf; // every member -> its group
  llvm::DenseSet<Value> interior;     // member results nothing outside reads: no buffer
  std::string fusedDefs;              // the groups' functors
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

  // The gradients @train_step returns, in the order backward finishes them.
  struct GradSlot {
    unsigned param; // argument number of the parameter
    Value value;
    int buffer;          // its buffer in the gradient region
    bool copy;           // the value lives elsewhere; copy it into the slot
    int ready;           // index of the op after which it is final
    bool shared = false; // pipeline: one stage's part of a gradient summed over pp
  };
  std::vector<GradSlot> grads;
  // ZeRO over dp: per parameter argument, its elements and chunk size; the
  // optimizer-state offsets; stage >= 2: the buffer of its gradient chunk.
  int zero = 0;
  std::map<unsigned, int64_t> chunkOf, numelOf;
  std::map<unsigned, std::array<int64_t, 2>> stateOf;
  std::map<unsigned, int> shardOf;
  /// Base of the activation pointers: "A" (the arena) for the whole step,
  /// "S" (the micro-batch's slot) in a pipeline stage.
  std::string actBase = "A";

  std::string paramName(unsigned arg) {
    return fn.getArgAttrOfType<StringAttr>(arg, "carve.param").getValue().str();
  }
  std::string gradPtr(const GradSlot &g) {
    return "(float *)(A + " + std::to_string(buffers[g.buffer].offset) + ")";
  }
  std::string chunkPtr(unsigned param) {
    return "(float *)(A + " + std::to_string(buffers[shardOf[param]].offset) + ")";
  }
  /// C++ for the elements of chunk `rank` of a parameter (the last is short).
  std::string chunkCount(unsigned arg, const std::string &rank) {
    return "std::max<int64_t>(0, std::min<int64_t>(" + std::to_string(chunkOf[arg]) + ", " +
           std::to_string(numelOf[arg]) + " - (int64_t)" + rank + " * " +
           std::to_string(chunkOf[arg]) + "))";
  }
  bool tpSplit(unsigned arg) {
    auto d = fn.getArgAttrOfType<DictionaryAttr>(arg, "dist.layout");
    auto l = d ? d.getAs<dist::SbpAttr>("tp") : dist::SbpAttr();
    return l && l.isSplit();
  }
  /// `sqSplit += ...` / `sqWhole += ...` for each gradient `counted` accepts.
  void emitNormTerms(llvm::raw_ostream &ts, const std::function<bool(const GradSlot &)> &counted);
  /// Scales every gradient by `clip`.
  void emitClip(llvm::raw_ostream &ts);
  /// fp16: divides every gradient by the loss scale (nothing for other precisions).
  void emitUnscale(llvm::raw_ostream &ts);
  /// `*ptr = value;` as a statement line; a one-element fill on the device.
  std::string seedStore(const std::string &ptr, const std::string &value) const {
    std::string v = opts.precision == "fp16" ? "(" + value + ") * ctx.lossScale" : value;
    if (opts.cuda())
      return "  fill(" + ptr + ", (int64_t)1, " + v + ");\n";
    return "  *" + ptr + " = " + v + ";\n";
  }
  /// The first element of a tensor, read on the host.
  std::string scalarRead(const std::string &ptr) const {
    return opts.cuda() ? "readScalar(" + ptr + ")" : ptr + "[0]";
  }
  /// The optimizer update of every parameter (and ZeRO-1/2's gathers).
  void emitUpdates(llvm::raw_ostream &ts);
  void buildTables(int64_t microBatches);
  /// Lays out each gradient's optimizer state (0, 1 or 2 slots; ZeRO chunks)
  /// from byte `at`; returns the end.
  int64_t placeOptimizerState(int64_t at) {
    const bool adam = opts.optimizer.kind == "adamw";
    const bool momentum = !adam && opts.optimizer.momentum != 0;
    const int slots = adam ? 2 : momentum ? 1 : 0;
    for (GradSlot &g : grads) {
      std::array<int64_t, 2> st = {-1, -1};
      for (int k = 0; k < slots; ++k) {
        st[k] = at;
        at += alignUp((zero ? chunkOf[g.param] : numelOf[g.param]) * 4);
      }
      stateOf[g.param] = st;
    }
    return at;
  }
  /// Consecutive gradients (in the order backward finishes them) up to
  /// bucketBytes each.
  struct Bucket {
    size_t first, last;
    int64_t bytes;
    int ready;
    int waitAt = -1; // ZeRO >= 2: index of the op after which it is waited for
  };
  std::vector<Bucket> formBuckets() {
    std::vector<Bucket> buckets;
    for (size_t i = 0; i < grads.size(); ++i) {
      int64_t b = alignUp(bytesOf(grads[i].value));
      if (buckets.empty() || buckets.back().bytes + b > opts.bucketBytes)
        buckets.push_back({i, i, b, grads[i].ready});
      else
        buckets.back().last = i, buckets.back().bytes += b, buckets.back().ready = grads[i].ready;
    }
    return buckets;
  }
  std::vector<TensorRow> inputRows, paramRows;
  int kernelCalls = 0;

  bool fail(const std::string &msg) {
    error = msg;
    return false;
  }
  bool failOp(Operation *op, const std::string &msg) {
    std::string node = nodeName(op->getLoc());
    return fail("'" + op->getName().getStringRef().str() + "'" +
                (node.empty() ? "" : " (node '" + node + "')") + ": " + msg);
  }

  std::string uniqueName(std::string base) {
    if (base.size() > 60)
      base = base.substr(base.size() - 60), base = identifier(base);
    std::string n = base;
    for (int k = 2; usedNames.count(n); ++k)
      n = base + "_" + std::to_string(k);
    usedNames.insert(n);
    return n;
  }

  std::string ctypeOf(Value v) {
    std::string c, d;
    int s;
    elementInfo(typeOf(v).getElementType(), c, d, s);
    return c;
  }
  int64_t bytesOf(Value v) {
    std::string c, d;
    int s = 0;
    elementInfo(typeOf(v).getElementType(), c, d, s);
    return typeOf(v).getNumElements() * s;
  }

  int newBuffer(Region r, int64_t bytes, int def, std::string name) {
    Buffer b;
    b.region = r;
    b.bytes = bytes;
    b.def = def;
    b.name = std::move(name);
    buffers.push_back(b);
    return (int)buffers.size() - 1;
  }

  Value operandOf(Operation *op, unsigned k) {
    auto it = foldedOperand.find({op, k});
    return it == foldedOperand.end() ? op->getOperand(k) : it->second;
  }

  bool checkTypes();
  void foldTransposes();
  void fuseElementwise();
  bool emitFused(const FusionGroup &g);
  bool assignBuffers();
  void planActivations();
  bool emitConstant(ConstantOp op);
  bool emitOp(Operation *op);
  bool emitCollective(Operation *op, llvm::raw_ostream &os);
  bool emitCustom(Operation *op, llvm::raw_ostream &os);
  /// The whole source: `plan` (the memory-plan comment) opens the step
  /// function, `tail` (sync, loss, optimizer) closes it.
  std::string emitProgram(const std::string &plan, const std::string &tail);
};

bool Generator::checkTypes() {
  for (BlockArgument a : fn.getArguments()) {
    std::string c, d;
    int s;
    auto t = dyn_cast<RankedTensorType>(a.getType());
    if (!t || !t.hasStaticShape() || !elementInfo(t.getElementType(), c, d, s))
      return fail("argument " + std::to_string(a.getArgNumber()) + " has type " +
                  typeString(a.getType()) +
                  ", which the CPU target does not support (f32, f64, i64, i32, i1)");
  }
  for (Operation *op : ops)
    for (Value v : op->getResults()) {
      std::string c, d;
      int s;
      auto t = dyn_cast<RankedTensorType>(v.getType());
      if (!t || !elementInfo(t.getElementType(), c, d, s))
        return failOp(op, "result type " + typeString(v.getType()) +
                              " is not supported by the CPU target (f32, f64, i64, i32, i1)");
      // The CUDA kernels compute in f32 (f64 only moves data); constants may be anything.
      if (opts.cuda() && t.getElementType().isF64() && !isa<ConstantOp>(op) &&
          !isa<CastOp, ReshapeOp>(op))
        return failOp(op, "result type " + typeString(v.getType()) +
                              ": the CUDA target computes in f32 (export the model in float32)");
    }
  return true;
}

/// A transpose that swaps only the last two dimensions and feeds only matmuls
/// becomes the matmul's transpose flag.
void Generator::foldTransposes() {
  auto swapsLastTwo = [](TransposeOp t) {
    ArrayRef<int64_t> p = t.getPerm();
    int64_t r = (int64_t)p.size();
    if (r < 2)
      return false;
    for (int64_t i = 0; i < r - 2; ++i)
      if (p[i] != i)
        return false;
    return p[r - 2] == r - 1 && p[r - 1] == r - 2;
  };
  for (Operation *op : ops) {
    auto t = dyn_cast<TransposeOp>(op);
    if (!t || !swapsLastTwo(t))
      continue;
    // (A B)^T = B^T A^T: write the product transposed instead of transposing it
    // (the weight gradients of Linear layers: dW = (x^T dy)^T).
    if (auto m = t.getInput().getDefiningOp<MatmulOp>()) {
      if (m->hasOneUse() && typeOf(m.getLhs()).getRank() >= 2 &&
          typeOf(m.getRhs()).getRank() >= 2 && !foldedTransposes.count(op)) {
        transposedMatmul[op] = m;
        fusedMatmuls.insert(m);
        continue;
      }
    }
    bool allMatmul = !t->use_empty() &&
                     llvm::all_of(t->getUsers(), [](Operation *u) { return isa<MatmulOp>(u); });
    if (!allMatmul)
      continue;
    foldedTransposes.insert(op);
    for (OpOperand &use : t->getUses())
      foldedOperand[{use.getOwner(), use.getOperandNumber()}] = t.getInput();
  }
}

const char *unaryEnum(StringRef fn);

/// The op name a Unary enum is looked up by (gelu with the tanh
/// approximation is "gelu_tanh").
std::string unaryName(Operation *op) {
  if (auto g = dyn_cast<GeluOp>(op); g && g.getApproximate() == "tanh")
    return "gelu_tanh";
  return op->getName().stripDialect().str();
}

/// The scalar C++ of an elementwise op on `a` (its operands' expressions),
/// calling elementwise.h; "" for an op that does not fuse (Pow takes special
/// cases on its exponent, comparisons and casts change the type).
std::string fusedExpr(Operation *op, ArrayRef<std::string> a) {
  if (isa<AddOp, SubOp, MulOp, DivOp, MaximumOp, MinimumOp>(op)) {
    const char *k = isa<AddOp>(op)       ? "Add"
                    : isa<SubOp>(op)     ? "Sub"
                    : isa<MulOp>(op)     ? "Mul"
                    : isa<DivOp>(op)     ? "Div"
                    : isa<MaximumOp>(op) ? "Max"
                                         : "Min";
    return std::string("ew::binary<Binary::") + k + ">(" + a[0] + ", " + a[1] + ")";
  }
  if (isa<NegOp, AbsOp, ExpOp, LogOp, SqrtOp, RsqrtOp, ReciprocalOp, TanhOp, ErfOp, SigmoidOp,
          ReluOp, SinOp, CosOp, SiluOp, GeluOp>(op)) {
    const char *k = unaryEnum(unaryName(op));
    return k ? std::string("ew::unary<Unary::") + k + ">(" + a[0] + ")" : "";
  }
  if (auto g = dyn_cast<UnaryGradOp>(op)) {
    const char *k = unaryEnum(g.getFn());
    return k ? std::string("ew::unaryGrad<Unary::") + k + ">(" + a[0] + ", " + a[1] + ")" : "";
  }
  return "";
}

/// An f32 elementwise op that fusedExpr can write.
bool fusible(Operation *op) {
  if (op->getNumResults() != 1 || !typeOf(op->getResult(0)).getElementType().isF32())
    return false;
  for (Value v : op->getOperands()) {
    auto t = dyn_cast<RankedTensorType>(v.getType());
    if (!t || !t.getElementType().isF32())
      return false;
  }
  std::vector<std::string> args(op->getNumOperands(), "x");
  return !fusedExpr(op, args).empty();
}

/// Groups chains of elementwise ops into fused kernels. Walking back from
/// each not-yet-grouped elementwise op (the root), an op P producing one of
/// the group's operands joins when
///  - P is elementwise over the root's shape (its result is read element for
///    element, never broadcast) and on the same side of forward/backward;
///  - every reader of P's result outside the group runs after the root: the
///    kernel writes it there (an extra output, e.g. the pre-activation that
///    backward reads), or nothing else reads it and it is never stored;
///  - neither P's result nor its operands are results of the step (the
///    gradients, which bucket reductions update in place once final): the
///    kernel reads P's operands at the root, later than P would have;
///  - the kernel stays small: at most 16 ops, 8 inputs and 4 outputs.
/// Candidates are taken from the highest index down, so an op's readers inside
/// the group have all been decided when it is considered.
void Generator::fuseElementwise() {
  if (!opts.fuse)
    return;
  constexpr size_t kMaxOps = 16, kMaxInputs = 8, kMaxOutputs = 4;
  llvm::DenseSet<Value> returned;
  for (Value v : fn.getBody().front().getTerminator()->getOperands())
    returned.insert(v);
  int phaseBegin = (int)ops.size();
  for (Operation *op : ops)
    if (StringRef(nodeName(op->getLoc())).starts_with("backward of ") ||
        op->getAttr("carve.phase")) {
      phaseBegin = index[op];
      break;
    }
  auto definer = [&](Value v) {
    Operation *d = v.getDefiningOp();
    auto it = d ? index.find(d) : index.end();
    return it == index.end() ? -1 : it->second;
  };
  auto countInputs = [&](const std::set<int> &m) {
    llvm::DenseSet<Value> in;
    for (int i : m)
      for (Value v : ops[i]->getOperands())
        if (!m.count(definer(v)))
          in.insert(v);
    return in.size();
  };
  auto readOutside = [&](Value v, const std::set<int> &m) {
    return llvm::any_of(v.getUsers(), [&](Operation *u) {
      auto it = index.find(u);
      return it == index.end() || !m.count(it->second);
    });
  };
  auto countOutputs = [&](const std::set<int> &m) {
    size_t n = 1; // the root's result
    for (int i : m)
      if (i != *m.rbegin() && readOutside(ops[i]->getResult(0), m))
        ++n;
    return n;
  };
  std::vector<FusionGroup> found;
  std::set<Operation *> taken;
  for (int r = (int)ops.size() - 1; r >= 0; --r) {
    Operation *root = ops[r];
    if (taken.count(root) || !fusible(root))
      continue;
    ArrayRef<int64_t> shape = typeOf(root->getResult(0)).getShape();
    std::set<int> members{r};
    std::priority_queue<int> todo;
    auto pushOperands = [&](Operation *op) {
      for (Value v : op->getOperands())
        if (int d = definer(v); d >= 0)
          todo.push(d);
    };
    pushOperands(root);
    while (!todo.empty()) {
      int p = todo.top();
      todo.pop();
      Operation *P = ops[p];
      if (members.count(p) || taken.count(P) || !fusible(P) || members.size() >= kMaxOps ||
          (p >= phaseBegin) != (r >= phaseBegin))
        continue;
      Value v = P->getResult(0);
      if (typeOf(v).getShape() != shape || returned.count(v) ||
          llvm::any_of(P->getOperands(), [&](Value o) { return returned.count(o); }))
        continue;
      bool laterOnly = llvm::all_of(v.getUsers(), [&](Operation *u) {
        auto it = index.find(u);
        return it != index.end() && (members.count(it->second) || it->second > r);
      });
      if (!laterOnly)
        continue;
      std::set<int> next = members;
      next.insert(p);
      if (countInputs(next) > kMaxInputs || countOutputs(next) > kMaxOutputs)
        continue;
      members = std::move(next);
      pushOperands(P);
    }
    if (members.size() < 2)
      continue;
    FusionGroup g;
    g.root = root;
    llvm::DenseSet<Value> seen;
    for (int i : members) {
      g.ops.push_back(ops[i]);
      taken.insert(ops[i]);
      for (Value v : ops[i]->getOperands())
        if (!members.count(definer(v)) && seen.insert(v).second)
          g.inputs.push_back(v);
    }
    g.outputs.push_back(root->getResult(0));
    for (int i : members) {
      Value v = ops[i]->getResult(0);
      if (i == r)
        continue;
      if (readOutside(v, members))
        g.outputs.push_back(v);
      else
        interior.insert(v);
    }
    found.push_back(std::move(g));
  }
  // In program order, so the functors are numbered as they run.
  std::reverse(found.begin(), found.end());
  groups = std::move(found);
  for (size_t k = 0; k < groups.size(); ++k)
    for (Operation *op : groups[k].ops)
      groupOf[op] = (int)k;
}

bool Generator::assignBuffers() {
  // Arguments: parameters, buffers, inputs and the loss seed live all step.
  for (BlockArgument a : fn.getArguments()) {
    unsigned i = a.getArgNumber();
    Region r = Region::Param;
    std::string name;
    if (auto p = fn.getArgAttrOfType<StringAttr>(i, "carve.param"))
      name = p.getValue().str();
    else if (auto p = fn.getArgAttrOfType<StringAttr>(i, "carve.buffer"))
      name = p.getValue().str();
    else if (auto p = fn.getArgAttrOfType<StringAttr>(i, "carve.input"))
      name = p.getValue().str(), r = Region::Input;
    else if (fn.getArgAttr(i, "carve.loss_seed"))
      name = "loss_seed", r = Region::Seed;
    else
      return fail("argument " + std::to_string(i) +
                  " is neither an input, a parameter, a buffer nor the loss seed");
    std::string v = uniqueName(identifier(name));
    var[a] = v;
    bufferOf[a] = newBuffer(r, bytesOf(a), -1, v);
  }
  // Op results.
  for (Operation *op : ops) {
    int k = index[op];
    std::string node = nodeName(op->getLoc());
    std::string base;
    if (StringRef(node).starts_with("backward of "))
      base = "d_" + identifier(StringRef(node).drop_front(12));
    else if (!node.empty())
      base = identifier(node);
    else
      base = identifier(op->getName().stripDialect());
    if (isa<ConstantOp>(op))
      base = "const_" + base;
    for (Value r : op->getResults()) {
      unsigned resultNumber = cast<OpResult>(r).getResultNumber();
      std::string name =
          uniqueName(op->getNumResults() > 1 ? base + "_" + std::to_string(resultNumber) : base);
      var[r] = name;
      if (isa<ReshapeOp>(op)) {
        bufferOf[r] = bufferOf.lookup(op->getOperand(0));
        continue;
      }
      if (foldedTransposes.count(op) || fusedMatmuls.count(op) || interior.count(r))
        continue; // never materialized
      Region reg = isa<ConstantOp>(op) ? Region::Constant : Region::Activation;
      bufferOf[r] = newBuffer(reg, bytesOf(r), k, name);
    }
  }
  // Reads.
  for (Operation *op : ops) {
    if (foldedTransposes.count(op) || fusedMatmuls.count(op) || isa<ReshapeOp>(op))
      continue;
    if (Operation *m = transposedMatmul.lookup(op)) {
      for (unsigned i = 0; i < 2; ++i) {
        Buffer &b = buffers[bufferOf.lookup(operandOf(m, i))];
        b.lastUse = std::max(b.lastUse, index[op]);
      }
      continue;
    }
    for (unsigned i = 0; i < op->getNumOperands(); ++i) {
      if (interior.count(operandOf(op, i)))
        continue; // computed in registers by the group's kernel
      Buffer &b = buffers[bufferOf.lookup(operandOf(op, i))];
      b.lastUse = std::max(b.lastUse, readAt(op));
    }
  }
  return true;
}

/// First fit over live ranges, in definition order: a buffer may take the
/// memory of any buffer whose last reader ran before it is written.
void Generator::planActivations() {
  std::vector<int> order;
  for (int i = 0; i < (int)buffers.size(); ++i)
    if (buffers[i].region == Region::Activation)
      order.push_back(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return buffers[a].def < buffers[b].def; });
  std::vector<int> live; // placed buffers
  int64_t peak = 0, total = 0;
  for (int i : order) {
    Buffer &b = buffers[i];
    int64_t size = alignUp(std::max<int64_t>(b.bytes, 1));
    total += size;
    std::vector<std::pair<int64_t, int64_t>> taken;
    std::vector<int> still;
    for (int j : live) {
      const Buffer &o = buffers[j];
      if (o.lastUse >= b.def) {
        still.push_back(j);
        taken.push_back({o.offset, o.offset + alignUp(std::max<int64_t>(o.bytes, 1))});
      }
    }
    std::sort(taken.begin(), taken.end());
    int64_t at = 0;
    for (auto &[lo, hi] : taken) {
      if (at + size <= lo)
        break;
      at = std::max(at, hi);
    }
    b.offset = at;
    peak = std::max(peak, at + size);
    still.push_back(i);
    live = std::move(still);
  }
  out.activationBytes = peak;
  out.unplannedBytes = total;
}

bool Generator::emitConstant(ConstantOp op) {
  Value r = op.getResult();
  auto type = typeOf(r);
  std::string ctype = ctypeOf(r);
  int64_t n = type.getNumElements();
  Type elt = type.getElementType();
  std::vector<std::string> values;
  values.reserve(n);
  ElementsAttr attr = op.getValue();
  if (auto dense = dyn_cast<DenseElementsAttr>(attr)) {
    if (isa<FloatType>(elt)) {
      for (APFloat f : dense.getValues<APFloat>())
        values.push_back(number(f.convertToDouble(), elt.isF32()));
    } else if (elt.isInteger(1)) {
      for (bool x : dense.getValues<bool>())
        values.push_back(x ? "1" : "0");
    } else {
      for (APInt x : dense.getValues<APInt>())
        values.push_back(std::to_string(x.getSExtValue()) + (elt.isInteger(64) ? "LL" : ""));
    }
  } else if (auto res = dyn_cast<DenseResourceElementsAttr>(attr)) {
    AsmResourceBlob *blob = res.getRawHandle().getBlob();
    if (!blob)
      return failOp(op, "its dense_resource data is missing");
    ArrayRef<char> data = blob->getData();
    int64_t size = bytesOf(r);
    if ((int64_t)data.size() != size)
      return failOp(op, "its dense_resource data has " + std::to_string(data.size()) +
                            " bytes, expected " + std::to_string(size));
    for (int64_t k = 0; k < n; ++k) {
      if (elt.isF32()) {
        float f;
        memcpy(&f, data.data() + 4 * k, 4);
        values.push_back(number(f, true));
      } else if (elt.isF64()) {
        double f;
        memcpy(&f, data.data() + 8 * k, 8);
        values.push_back(number(f, false));
      } else if (elt.isInteger(64)) {
        int64_t x;
        memcpy(&x, data.data() + 8 * k, 8);
        values.push_back(std::to_string(x) + "LL");
      } else if (elt.isInteger(32)) {
        int32_t x;
        memcpy(&x, data.data() + 4 * k, 4);
        values.push_back(std::to_string(x));
      } else {
        values.push_back(data[k] ? "1" : "0");
      }
    }
  } else {
    return failOp(op, "unsupported constant attribute");
  }
  if ((int64_t)values.size() == 1 && n > 1)
    values.assign(n, values[0]); // a splat
  std::string &c = constants;
  c += "// " + var[r] + ": " + typeString(type) +
       (nodeName(op.getLoc()).empty() ? "" : " (node '" + nodeName(op.getLoc()) + "')") + "\n";
  // The CUDA target's kernels read constants from managed memory (the same
  // address on the host and the device).
  c += std::string(opts.cuda() ? "__managed__ " : "") + "alignas(64) " + ctype + " " + var[r] + "[" + std::to_string(std::max<int64_t>(n, 1)) +
       "] = {";
  for (int64_t k = 0; k < n; ++k) {
    if (k % 12 == 0)
      c += "\n    ";
    c += values[k] + (k + 1 < n ? ", " : "");
  }
  c += "};\n";
  return true;
}

const char *unaryEnum(StringRef fn) {
  static const std::pair<const char *, const char *> table[] = {{"neg", "Neg"},
                                                                {"abs", "Abs"},
                                                                {"exp", "Exp"},
                                                                {"log", "Log"},
                                                                {"sqrt", "Sqrt"},
                                                                {"rsqrt", "Rsqrt"},
                                                                {"reciprocal", "Reciprocal"},
                                                                {"tanh", "Tanh"},
                                                                {"erf", "Erf"},
                                                                {"sigmoid", "Sigmoid"},
                                                                {"relu", "Relu"},
                                                                {"sin", "Sin"},
                                                                {"cos", "Cos"},
                                                                {"silu", "Silu"},
                                                                {"gelu", "Gelu"},
                                                                {"gelu_tanh", "GeluTanh"}};
  for (auto &[k, v] : table)
    if (fn == k)
      return v;
  return nullptr;
}

bool Generator::emitOp(Operation *op) {
  if (foldedTransposes.count(op) || fusedMatmuls.count(op))
    return true;
  if (auto it = groupOf.find(op); it != groupOf.end())
    return groups[it->second].root == op ? emitFused(groups[it->second]) : true;
  auto name = [&](Value v) { return var.lookup(v); };
  auto opnd = [&](unsigned k) { return name(operandOf(op, k)); };
  auto shapeOf = [&](Value v) { return dims(typeOf(v).getShape()); };
  auto oshape = [&](unsigned k) { return shapeOf(operandOf(op, k)); };
  auto isF32 = [&](Value v) { return typeOf(v).getElementType().isF32(); };
  auto scalar = [&](double x, Value like) { return number(x, isF32(like)); };
  auto nullOf = [&](Value like) { return "(const " + ctypeOf(like) + " *)nullptr"; };
  Value res = op->getNumResults() ? op->getResult(0) : Value();
  std::string &s = body;

  // The comment: the op, its shapes and its model node.
  std::string node = nodeName(op->getLoc());
  s += "  // " + op->getName().getStringRef().str() + " ";
  for (unsigned k = 0; k < op->getNumOperands(); ++k)
    s += (k ? ", " : "") + shapeText(typeOf(op->getOperand(k)).getShape());
  s += " -> ";
  for (unsigned k = 0; k < op->getNumResults(); ++k)
    s += (k ? ", " : "") + shapeText(typeOf(op->getResult(k)).getShape());
  if (!node.empty())
    s += "   [" + node + "]";
  s += "\n";

  if (auto c = dyn_cast<ConstantOp>(op))
    return emitConstant(c);
  if (isa<ReshapeOp>(op)) {
    s += "  " + ctypeOf(res) + " *" + name(res) + " = " + opnd(0) + ";  // same memory\n";
    return true;
  }
  ++kernelCalls;
  for (Value r : op->getResults()) {
    const Buffer &b = buffers[bufferOf.lookup(r)];
    s += "  " + ctypeOf(r) + " *" + name(r) + " = (" + ctypeOf(r) + " *)(" +
         (b.region == Region::Activation ? actBase : std::string("A")) + " + " +
         std::to_string(b.offset) + ");\n";
  }
  std::string call;
  llvm::raw_string_ostream os(call);
  os << "  ";

  if (isa<AddOp, SubOp, MulOp, DivOp, PowOp, MaximumOp, MinimumOp>(op)) {
    const char *k = isa<AddOp>(op)       ? "Add"
                    : isa<SubOp>(op)     ? "Sub"
                    : isa<MulOp>(op)     ? "Mul"
                    : isa<DivOp>(op)     ? "Div"
                    : isa<PowOp>(op)     ? "Pow"
                    : isa<MaximumOp>(op) ? "Max"
                                         : "Min";
    os << "binary(Binary::" << k << ", " << opnd(0) << ", " << oshape(0) << ", " << opnd(1) << ", "
       << oshape(1) << ", " << name(res) << ", " << shapeOf(res) << ");";
  } else if (isa<EqualOp, LessOp, GreaterOp>(op)) {
    const char *k = isa<EqualOp>(op) ? "Eq" : isa<LessOp>(op) ? "Lt" : "Gt";
    os << "compare(Compare::" << k << ", " << opnd(0) << ", " << oshape(0) << ", " << opnd(1)
       << ", " << oshape(1) << ", " << name(res) << ", " << shapeOf(res) << ");";
  } else if (isa<AndOp, OrOp>(op)) {
    os << "logic(Logic::" << (isa<AndOp>(op) ? "And" : "Or") << ", " << opnd(0) << ", " << oshape(0)
       << ", " << opnd(1) << ", " << oshape(1) << ", " << name(res) << ", " << shapeOf(res) << ");";
  } else if (isa<NotOp>(op)) {
    os << "logic(Logic::Not, " << opnd(0) << ", " << oshape(0) << ", " << opnd(0) << ", "
       << oshape(0) << ", " << name(res) << ", " << shapeOf(res) << ");";
  } else if (isa<NegOp, AbsOp, ExpOp, LogOp, SqrtOp, RsqrtOp, ReciprocalOp, TanhOp, ErfOp,
                 SigmoidOp, ReluOp, SinOp, CosOp, SiluOp, GeluOp>(op)) {
    os << "unary(Unary::" << unaryEnum(unaryName(op)) << ", " << opnd(0) << ", " << name(res) << ", "
       << typeOf(res).getNumElements() << ");";
  } else if (auto g = dyn_cast<UnaryGradOp>(op)) {
    const char *k = unaryEnum(g.getFn());
    if (!k)
      return failOp(op, "unknown function " + g.getFn().str());
    os << "unary_grad(Unary::" << k << ", " << opnd(0) << ", " << opnd(1) << ", " << name(res)
       << ", " << typeOf(res).getNumElements() << ");";
  } else if (isa<WhereOp>(op)) {
    os << "where(" << opnd(0) << ", " << oshape(0) << ", " << opnd(1) << ", " << oshape(1) << ", "
       << opnd(2) << ", " << oshape(2) << ", " << name(res) << ", " << shapeOf(res) << ");";
  } else if (isa<CastOp>(op)) {
    os << "cast(" << opnd(0) << ", " << name(res) << ", " << typeOf(res).getNumElements() << ");";
  } else if (auto m = dyn_cast<MatmulOp>(op)) {
    auto matDims = [&](unsigned k, bool &trans) {
      Value v = operandOf(op, k);
      trans = v != op->getOperand(k);
      SmallVector<int64_t> d(typeOf(v).getShape());
      if (d.size() == 1) // a vector: a 1-row (lhs) or 1-column (rhs) matrix
        d.insert(k == 0 ? d.begin() : d.end(), 1);
      return dims(d);
    };
    bool ta, tb;
    std::string da = matDims(0, ta), db = matDims(1, tb);
    SmallVector<int64_t> ys(typeOf(res).getShape());
    int64_t ra = typeOf(m.getLhs()).getRank(), rb = typeOf(m.getRhs()).getRank();
    if (ra == 1)
      ys.insert(ys.end() - (rb == 1 ? 0 : 1), 1);
    if (rb == 1)
      ys.push_back(1);
    os << "matmul(" << opnd(0) << ", " << da << ", " << (ta ? "true" : "false") << ", " << opnd(1)
       << ", " << db << ", " << (tb ? "true" : "false") << ", " << name(res) << ", " << dims(ys)
       << ");";
  } else if (isa<ReduceSumOp, ReduceMeanOp, ReduceMaxOp>(op)) {
    ArrayRef<int64_t> axes = op->getAttrOfType<DenseI64ArrayAttr>("axes").asArrayRef();
    uint32_t mask = 0;
    for (int64_t a : axes)
      mask |= 1u << a;
    const char *k = isa<ReduceSumOp>(op) ? "Sum" : isa<ReduceMeanOp>(op) ? "Mean" : "Max";
    os << "reduce(Reduce::" << k << ", " << opnd(0) << ", " << oshape(0) << ", 0x";
    os.write_hex(mask);
    os << "u, " << name(res) << ");";
  } else if (auto sm = dyn_cast<SoftmaxOp>(op)) {
    os << "softmax(" << opnd(0) << ", " << oshape(0) << ", " << sm.getAxis() << ", false, "
       << name(res) << ");";
  } else if (auto sm = dyn_cast<LogSoftmaxOp>(op)) {
    os << "softmax(" << opnd(0) << ", " << oshape(0) << ", " << sm.getAxis() << ", true, "
       << name(res) << ");";
  } else if (auto g = dyn_cast<SoftmaxGradOp>(op)) {
    os << "softmax_grad(" << opnd(0) << ", " << opnd(1) << ", " << oshape(0) << ", " << g.getAxis()
       << ", " << (g.getLog() ? "true" : "false") << ", " << name(res) << ");";
  } else if (auto ln = dyn_cast<LayerNormOp>(op)) {
    Value x = ln.getInput();
    os << "layer_norm(" << name(x) << ", " << shapeOf(x) << ", " << ln.getAxis() << ", "
       << (ln.getScale() ? name(ln.getScale()) : nullOf(x)) << ", "
       << (ln.getBias() ? name(ln.getBias()) : nullOf(x)) << ", "
       << scalar(ln.getEpsilon().convertToDouble(), x) << ", " << name(res) << ");";
  } else if (auto g = dyn_cast<LayerNormGradOp>(op)) {
    Value x = g.getInput();
    os << "layer_norm_grad(" << name(x) << ", " << shapeOf(x) << ", " << g.getAxis() << ", "
       << (g.getScale() ? name(g.getScale()) : nullOf(x)) << ", "
       << scalar(g.getEpsilon().convertToDouble(), x) << ", " << name(g.getGrad()) << ", "
       << name(g.getInputGrad()) << ", " << name(g.getScaleGrad()) << ", " << name(g.getBiasGrad())
       << ");";
  } else if (auto rn = dyn_cast<RmsNormOp>(op)) {
    Value x = rn.getInput();
    os << "rms_norm(" << name(x) << ", " << shapeOf(x) << ", " << rn.getAxis() << ", "
       << (rn.getScale() ? name(rn.getScale()) : nullOf(x)) << ", "
       << scalar(rn.getEpsilon().convertToDouble(), x) << ", " << name(res) << ");";
  } else if (auto g = dyn_cast<RmsNormGradOp>(op)) {
    Value x = g.getInput();
    os << "rms_norm_grad(" << name(x) << ", " << shapeOf(x) << ", " << g.getAxis() << ", "
       << (g.getScale() ? name(g.getScale()) : nullOf(x)) << ", "
       << scalar(g.getEpsilon().convertToDouble(), x) << ", " << name(g.getGrad()) << ", "
       << name(g.getInputGrad()) << ", " << name(g.getScaleGrad()) << ");";
  } else if (auto at = dyn_cast<AttentionOp>(op)) {
    Value q = at.getQuery(), k = at.getKey(), v = at.getValue(), mk = at.getMask();
    os << "attention(" << name(q) << ", " << shapeOf(q) << ", " << name(k) << ", " << shapeOf(k)
       << ", " << name(v) << ", " << shapeOf(v) << ", " << (mk ? name(mk) : nullOf(q)) << ", "
       << (mk ? shapeOf(mk) : "{}") << ", " << scalar(at.getScale().convertToDouble(), q) << ", "
       << (at.getCausal() ? "true" : "false") << ", " << name(res) << ");";
  } else if (auto g = dyn_cast<AttentionGradOp>(op)) {
    Value q = g.getQuery(), k = g.getKey(), v = g.getValue(), mk = g.getMask();
    os << "attention_grad(" << name(q) << ", " << shapeOf(q) << ", " << name(k) << ", "
       << shapeOf(k) << ", " << name(v) << ", " << shapeOf(v) << ", " << (mk ? name(mk) : nullOf(q))
       << ", " << (mk ? shapeOf(mk) : "{}") << ", " << scalar(g.getScale().convertToDouble(), q)
       << ", " << (g.getCausal() ? "true" : "false") << ", " << name(g.getGrad()) << ", "
       << name(g.getQueryGrad()) << ", " << name(g.getKeyGrad()) << ", " << name(g.getValueGrad())
       << ");";
  } else if (isa<CrossEntropyOp, CrossEntropyGradOp>(op)) {
    StringRef red = op->getAttrOfType<StringAttr>("reduction")
                        ? op->getAttrOfType<StringAttr>("reduction").getValue()
                        : StringRef("mean");
    auto ig = op->getAttrOfType<IntegerAttr>("ignore_index");
    Value logits = op->getOperand(0), targets = op->getOperand(1);
    if (!typeOf(targets).getElementType().isInteger(64))
      return failOp(op, "targets must be int64 for the CPU target");
    int r = red == "mean" ? 0 : red == "sum" ? 1 : 2;
    if (auto rows = op->getAttrOfType<IntegerAttr>("dist.sharded_rows")) {
      // Vocab-parallel: this rank holds classes [tpRank * C, (tpRank + 1) * C).
      int64_t c = typeOf(logits).getDimSize(1);
      os << "// Vocab-parallel: the classes are split over tp; the kernel all-reduces row\n"
         << "  // maxima, sums of exponentials and the target logits (no rank holds all "
         << rows.getInt() << " logits).\n  "
         << (isa<CrossEntropyOp>(op) ? "cross_entropy_vocab_parallel("
                                     : "cross_entropy_vocab_parallel_grad(")
         << "*ctx.tpComm, " << name(logits) << ", " << shapeOf(logits) << ", (int64_t)ctx.tpRank * "
         << c << ", ";
    } else {
      os << (isa<CrossEntropyOp>(op) ? "cross_entropy(" : "cross_entropy_grad(") << name(logits)
         << ", " << shapeOf(logits) << ", ";
    }
    os << name(targets) << ", " << r << " /*" << red << "*/, " << (ig ? "true" : "false") << ", "
       << (ig ? ig.getInt() : 0) << "LL, ";
    if (isa<CrossEntropyGradOp>(op))
      os << opnd(2) << ", ";
    os << name(res) << ");";
  } else if (Operation *mm = transposedMatmul.lookup(op)) {
    // y = (op(a) op(b))^T = op(b)^T op(a)^T
    auto stored = [&](unsigned k, bool &trans) {
      Value v = operandOf(mm, k);
      trans = v != mm->getOperand(k);
      return v;
    };
    bool ta, tb;
    Value a = stored(0, ta), b = stored(1, tb);
    os << "matmul(" << name(b) << ", " << shapeOf(b) << ", " << (tb ? "false" : "true") << ", "
       << name(a) << ", " << shapeOf(a) << ", " << (ta ? "false" : "true") << ", " << name(res)
       << ", " << shapeOf(res) << ");  // (a b)^T as b^T a^T";
  } else if (auto t = dyn_cast<TransposeOp>(op)) {
    os << "transpose(" << opnd(0) << ", " << oshape(0) << ", " << dims(t.getPerm()) << ", "
       << name(res) << ");";
  } else if (auto sl = dyn_cast<SliceOp>(op)) {
    os << "slice(" << opnd(0) << ", " << oshape(0) << ", " << dims(sl.getStarts()) << ", "
       << dims(sl.getSteps()) << ", " << name(res) << ", " << shapeOf(res) << ");";
  } else if (auto sg = dyn_cast<SliceGradOp>(op)) {
    os << "slice_grad(" << opnd(0) << ", " << oshape(0) << ", " << dims(sg.getStarts()) << ", "
       << dims(sg.getSteps()) << ", " << name(res) << ", " << shapeOf(res) << ");";
  } else if (auto cc = dyn_cast<ConcatOp>(op)) {
    std::string ct = ctypeOf(res);
    os << "{\n    const " << ct << " *parts[] = {";
    for (unsigned k = 0; k < op->getNumOperands(); ++k)
      os << (k ? ", " : "") << opnd(k);
    os << "};\n    const Dims shapes[] = {";
    for (unsigned k = 0; k < op->getNumOperands(); ++k)
      os << (k ? ", " : "") << "Dims" << oshape(k);
    os << "};\n    concat(" << op->getNumOperands() << ", parts, shapes, " << cc.getAxis() << ", "
       << name(res) << ");\n  }";
  } else if (auto g = dyn_cast<GatherOp>(op)) {
    if (!typeOf(g.getIndices()).getElementType().isInteger(64))
      return failOp(op, "indices must be int64 for the CPU target");
    if (auto rows = op->getAttrOfType<IntegerAttr>("dist.sharded_rows")) {
      int64_t local = typeOf(g.getData()).getDimSize(0);
      os << "// Vocab-parallel embedding: this rank holds rows [tpRank * " << local << ", +"
         << local << ") of " << rows.getInt() << "; others give zeros (partial sums).\n  "
         << "gather_sharded(" << opnd(0) << ", " << oshape(0) << ", (int64_t)ctx.tpRank * " << local
         << ", " << rows.getInt() << "LL, " << opnd(1) << ", " << oshape(1) << ", " << name(res)
         << ");";
    } else {
      os << "gather(" << opnd(0) << ", " << oshape(0) << ", " << opnd(1) << ", " << oshape(1)
         << ", " << g.getAxis() << ", " << name(res) << ");";
    }
  } else if (auto g = dyn_cast<GatherGradOp>(op)) {
    if (!typeOf(g.getIndices()).getElementType().isInteger(64))
      return failOp(op, "indices must be int64 for the CPU target");
    if (auto rows = op->getAttrOfType<IntegerAttr>("dist.sharded_rows")) {
      int64_t local = typeOf(g.getResult()).getDimSize(0);
      os << "gather_sharded_grad(" << opnd(0) << ", " << opnd(1) << ", " << oshape(1)
         << ", (int64_t)ctx.tpRank * " << local << ", " << rows.getInt() << "LL, " << name(res)
         << ", " << shapeOf(res) << ");  // rows this rank holds";
    } else {
      os << "gather_grad(" << opnd(0) << ", " << opnd(1) << ", " << oshape(1) << ", " << g.getAxis()
         << ", " << name(res) << ", " << shapeOf(res) << ");";
    }
  } else if (isa<dist::AllReduceOp, dist::AllGatherOp, dist::ReduceScatterOp, dist::AllToAllOp,
                 dist::LocalSplitOp, dist::BroadcastOp>(op)) {
    if (!emitCollective(op, os))
      return false;
  } else if (isa<ExpandOp>(op)) {
    os << "expand(" << opnd(0) << ", " << oshape(0) << ", " << name(res) << ", " << shapeOf(res)
       << ");";
  } else if (isa<CustomOp, CustomGradOp>(op)) {
    if (!emitCustom(op, os))
      return false;
  } else {
    return failOp(op, std::string("the ") + (opts.cuda() ? "CUDA" : "CPU") +
                          " target has no kernel for this op yet");
  }
  s += call + "\n";
  return true;
}

/// A user-defined op: a call of the user's `extern "C"` kernel with the ABI of
/// runtime/include/carve/rt/custom.h, on this rank's local shapes.
/// One fused group: the members' comments, the functor (into fusedDefs) and
/// one `fused(...)` call at the root.
bool Generator::emitFused(const FusionGroup &g) {
  std::string &s = body;
  const int id = groupOf.lookup(g.root);
  const std::string fname = "Fused" + std::to_string(id);
  std::string chain;
  for (Operation *op : g.ops) {
    std::string node = nodeName(op->getLoc());
    s += "  // " + op->getName().getStringRef().str() + " ";
    for (unsigned k = 0; k < op->getNumOperands(); ++k)
      s += (k ? ", " : "") + shapeText(typeOf(op->getOperand(k)).getShape());
    s += " -> " + shapeText(typeOf(op->getResult(0)).getShape());
    if (!node.empty())
      s += "   [" + node + "]";
    s += "\n";
    std::string n = isa<UnaryGradOp>(op) ? unaryName(op) + "(" +
                                               cast<UnaryGradOp>(op).getFn().str() + ")"
                                         : op->getName().stripDialect().str();
    chain += (chain.empty() ? "" : ", ") + n;
  }
  ++kernelCalls;
  for (Value r : g.outputs) {
    const Buffer &b = buffers[bufferOf.lookup(r)];
    s += "  float *" + var[r] + " = (float *)(" +
         (b.region == Region::Activation ? actBase : std::string("A")) + " + " +
         std::to_string(b.offset) + ");\n";
  }
  const size_t ni = g.inputs.size(), no = g.outputs.size();
  std::string rootNode = nodeName(g.root->getLoc());
  std::string f;
  llvm::raw_string_ostream fs(f);
  fs << "// " << fname << ": " << chain << (rootNode.empty() ? "" : " [" + rootNode + "]")
     << "\nstruct " << fname << " {\n  CARVE_HD void operator()(const float (&x)[" << ni
     << "], float (&y)[" << no << "]) const {\n";
  DenseMap<Value, std::string> expr;
  for (size_t k = 0; k < ni; ++k)
    expr[g.inputs[k]] = "x[" + std::to_string(k) + "]";
  for (size_t j = 0; j < g.ops.size(); ++j) {
    Operation *op = g.ops[j];
    std::vector<std::string> args;
    for (Value v : op->getOperands())
      args.push_back(expr.lookup(v));
    std::string t = "t" + std::to_string(j);
    fs << "    const float " << t << " = " << fusedExpr(op, args) << ";  // " << var[op->getResult(0)]
       << "\n";
    expr[op->getResult(0)] = t;
  }
  for (size_t j = 0; j < no; ++j)
    fs << "    y[" << j << "] = " << expr.lookup(g.outputs[j]) << ";\n";
  fs << "  }\n};\n\n";
  fusedDefs += f;

  std::string in, shapes, outs;
  for (size_t k = 0; k < ni; ++k) {
    in += (k ? ", " : "") + var.lookup(g.inputs[k]);
    shapes += (k ? ", " : "") + dims(typeOf(g.inputs[k]).getShape());
  }
  for (size_t j = 0; j < no; ++j)
    outs += (j ? ", " : "") + var.lookup(g.outputs[j]);
  s += "  {  // one pass: " + std::to_string(g.ops.size()) + " ops, " + std::to_string(ni) +
       " input(s), " + std::to_string(no) + " output(s)" +
       (no > 1 ? " (the intermediates are read later)" : "") + "\n";
  s += "    const float *in[" + std::to_string(ni) + "] = {" + in + "};\n";
  s += "    const Dims shapes[" + std::to_string(ni) + "] = {" + shapes + "};\n";
  s += "    float *out[" + std::to_string(no) + "] = {" + outs + "};\n";
  s += "    fused(\"" + fname + " (" + chain + ")\", " + fname + "{}, in, shapes, out, " +
       dims(typeOf(g.root->getResult(0)).getShape()) + ");\n  }\n";
  return true;
}

bool Generator::emitCustom(Operation *op, llvm::raw_ostream &os) {
  auto tensors = [&](ValueRange values, const char *array, bool isConst) -> std::string {
    if (values.empty())
      return "";
    std::string t =
        std::string("    ") + (isConst ? "const " : "") + "CarveTensor " + array + "[] = {";
    for (auto [k, v] : llvm::enumerate(values)) {
      std::string c, d;
      int size;
      elementInfo(typeOf(v).getElementType(), c, d, size);
      std::string code = d == "Bool" ? "CARVE_BOOL" : "CARVE_" + d;
      t += std::string(k ? ",\n        " : "") + "{" + var.lookup(v) + ", " + code + ", " +
           std::to_string(typeOf(v).getRank()) + ", " + dims(typeOf(v).getShape()) + "}";
    }
    return t + "};\n";
  };
  for (Value v : llvm::concat<Value>(op->getOperands(), op->getResults()))
    if (typeOf(v).getRank() > 8)
      return failOp(op, "a custom kernel's tensors have at most 8 dimensions (CarveTensor::dims)");
  auto arg = [](ValueRange values, const char *array) {
    return (values.empty() ? std::string("nullptr") : std::string(array)) + ", " +
           std::to_string(values.size());
  };
  std::string what = op->getAttrOfType<StringAttr>("domain").str() +
                     "::" + op->getAttrOfType<StringAttr>("op_type").str();
  // The CUDA target calls the rules file's "cuda" kernels, with the rank's
  // compute stream, and checks for a launch error naming the op.
  const bool cuda = opts.cuda();
  const std::string target = cuda ? "CUDA" : "CPU";
  const std::string streamParam = cuda ? ", CarveStream stream" : "";
  const std::string streamArg = cuda ? ", (CarveStream)gpu::computeStream()" : "";
  auto check = [&](const char *role) {
    return cuda ? "    gpu::checkLaunch(\"" + what + " (the user's " + role + " kernel)\");\n"
                : std::string();
  };
  if (auto c = dyn_cast<CustomOp>(op)) {
    std::string fn = (cuda ? c.getCudaForward() : c.getForward()).str();
    if (fn.empty())
      return failOp(op, what + " has no CUDA kernels: its rules file gives only \"cpu\" kernels; "
                               "add a \"cuda\" section (docs/custom-ops.md) or compile with "
                               "--target cpu");
    customKernels[fn] = "extern \"C\" void " + fn +
                        "(const CarveTensor *in, int nin, CarveTensor *out, int nout" +
                        streamParam + ");";
    os << "{\n    // " << what << ": the user's " << target
       << " forward kernel (rules file), on this rank's shapes.\n"
       << tensors(c.getInputs(), "in", true) << tensors(c.getOutputs(), "out", false)
       << "    ::" << fn << "(" << arg(c.getInputs(), "in") << ", " << arg(c.getOutputs(), "out")
       << streamArg << ");\n"
       << check("forward") << "  }";
    return true;
  }
  auto g = cast<CustomGradOp>(op);
  std::string fn = (cuda ? g.getCudaBackward() : g.getBackward()).str();
  if (fn.empty())
    return failOp(op, what + " has no CUDA backward kernel (the rules file's \"cuda\" section)");
  customKernels[fn] = "extern \"C\" void " + fn +
                      "(const CarveTensor *in, int nin, const CarveTensor *outGrad, int nout, "
                      "CarveTensor *inGrad" +
                      streamParam + ");";
  size_t nin = g.getInputGrads().size();
  ValueRange inputs = g.getInputs().take_front(nin), outGrads = g.getInputs().drop_front(nin);
  os << "{\n    // " << what << ": the user's " << target
     << " backward kernel (rules file), on this rank's shapes.\n"
     << tensors(inputs, "in", true) << tensors(outGrads, "outGrad", true)
     << tensors(g.getInputGrads(), "inGrad", false) << "    ::" << fn << "(" << arg(inputs, "in")
     << ", " << (outGrads.empty() ? "nullptr" : "outGrad") << ", " << outGrads.size() << ", "
     << (nin ? "inGrad" : "nullptr") << streamArg << ");\n"
     << check("backward") << "  }";
  return true;
}

/// A collective of the dist dialect on the axis's communicator. Each comment
/// says which layout change it makes (the partitioner's reason).
bool Generator::emitCollective(Operation *op, llvm::raw_ostream &os) {
  auto axis = op->getAttrOfType<StringAttr>("axis").getValue();
  std::string comm = axis == "tp" ? "*ctx.tpComm" : axis == "dp" ? "*ctx.dpComm" : "";
  int parts = axis == "tp" ? opts.tp : opts.dp;
  if (comm.empty())
    return failOp(op, "the CPU target has no communicator for mesh axis '" + axis.str() + "'");
  Value in = op->getOperand(0), res = op->getResult(0);
  Type et = typeOf(in).getElementType();
  std::string ct = et.isF32()         ? "CommType::F32"
                   : et.isF64()       ? "CommType::F64"
                   : et.isInteger(64) ? "CommType::I64"
                                      : "";
  if (ct.empty())
    return failOp(op, "collectives on the CPU target take f32, f64 or i64 tensors");
  auto i64 = [&](const char *n) { return op->getAttrOfType<IntegerAttr>(n).getInt(); };
  auto split = [&](int64_t d, int64_t g) {
    return "Split{" + std::to_string(d) + ", " + std::to_string(g) + ", " + std::to_string(parts) +
           "}";
  };
  std::string n = std::to_string(typeOf(in).getNumElements());
  std::string red = "ReduceOp::Sum";
  if (auto r = op->getAttrOfType<StringAttr>("reduction"); r && r.getValue() == "max")
    red = "ReduceOp::Max";
  std::string x = var.lookup(operandOf(op, 0)), y = var.lookup(res);
  if (isa<dist::AllReduceOp>(op)) {
    os << "// partial sums -> replicated over " << axis << "\n  copy(" << x << ", " << y << ", "
       << n << ");\n  " << comm.substr(1) << "->allReduce(" << y << ", " << n << ", " << ct << ", "
       << red << ");";
  } else if (auto g = dyn_cast<dist::AllGatherOp>(op)) {
    os << "// split -> replicated over " << axis << "\n  allGatherSplit(" << comm << ", " << x
       << ", " << dims(typeOf(in).getShape()) << ", " << split(g.getDim(), g.getGroups()) << ", "
       << y << ", " << ct << ");";
  } else if (auto rs = dyn_cast<dist::ReduceScatterOp>(op)) {
    os << "// partial sums -> split over " << axis << "\n  reduceScatterSplit(" << comm << ", " << x
       << ", " << dims(typeOf(in).getShape()) << ", " << split(rs.getDim(), rs.getGroups()) << ", "
       << y << ", " << ct << ", " << red << ");";
  } else if (isa<dist::AllToAllOp>(op)) {
    os << "// re-split along another dimension over " << axis << "\n  allToAllSplit(" << comm
       << ", " << x << ", " << dims(typeOf(in).getShape()) << ", "
       << split(i64("src_dim"), i64("src_groups")) << ", "
       << split(i64("dst_dim"), i64("dst_groups")) << ", " << y << ", " << ct << ");";
  } else if (auto ls = dyn_cast<dist::LocalSplitOp>(op)) {
    os << "// replicated -> split over " << axis << ": keep this rank's piece (no communication)\n"
       << "  takeShard(" << x << ", " << dims(typeOf(in).getShape()) << ", "
       << split(ls.getDim(), ls.getGroups()) << ", " << (axis == "tp" ? "ctx.tpRank" : "ctx.dpRank")
       << ", " << y << ", " << bytesOf(in) / std::max<int64_t>(1, typeOf(in).getNumElements())
       << ");";
  } else if (auto b = dyn_cast<dist::BroadcastOp>(op)) {
    os << "copy(" << x << ", " << y << ", " << n << ");\n  " << comm.substr(1) << "->broadcast("
       << y << ", " << bytesOf(in) << ", " << b.getRoot() << ");";
  }
  return true;
}

bool Generator::run() {
  Block &block = fn.getBody().front();
  for (Operation &op : block.without_terminator()) {
    index[&op] = (int)ops.size();
    ops.push_back(&op);
  }
  auto ret = cast<func::ReturnOp>(block.getTerminator());
  int end = (int)ops.size();
  if (!checkTypes())
    return false;
  foldTransposes();
  fuseElementwise();
  if (!assignBuffers())
    return false;
  if (ret.getNumOperands() < 1)
    return fail("@train_step returns nothing");

  // Results: the loss lives to the end; gradients go to the gradient region.
  Value loss = ret.getOperand(0);
  buffers[bufferOf.lookup(loss)].lastUse = end;
  std::set<int> pinned{bufferOf.lookup(loss)};
  for (unsigned k = 1; k < ret.getNumOperands(); ++k) {
    auto of = fn.getResultAttrOfType<StringAttr>(k, "carve.grad_of");
    if (!of)
      return fail("@train_step result " + std::to_string(k) + " is not a gradient");
    unsigned param = ~0u;
    for (BlockArgument a : fn.getArguments())
      if (auto p = fn.getArgAttrOfType<StringAttr>(a.getArgNumber(), "carve.param"))
        if (p == of)
          param = a.getArgNumber();
    if (param == ~0u)
      return fail("gradient of unknown parameter '" + of.getValue().str() + "'");
    Value g = ret.getOperand(k);
    if (!typeOf(g).getElementType().isF32())
      return fail("parameter '" + of.getValue().str() +
                  "' is not float32; the CPU target trains float32 parameters");
    int b = bufferOf.lookup(g);
    GradSlot slot{param, g, b, false, buffers[b].def};
    if (buffers[b].region != Region::Activation || pinned.count(b)) {
      slot.copy = true;
      slot.buffer = newBuffer(Region::Grad, bytesOf(g), end, "grad_" + var[fn.getArgument(param)]);
      slot.ready = end; // copied after the last op
      buffers[b].lastUse = end;
    } else {
      buffers[b].region = Region::Grad;
      pinned.insert(b);
    }
    grads.push_back(slot);
  }
  std::stable_sort(grads.begin(), grads.end(),
                   [](const GradSlot &a, const GradSlot &b) { return a.ready < b.ready; });

  // ZeRO over dp (docs/zero.md): every trainable parameter's (tp-local)
  // elements are cut into dp chunks of `chunk` (the last padded); dp rank d
  // owns chunk d. Stage 1 keeps optimizer state for its chunk only, stage 2
  // also only its chunk of the summed gradient (reduce-scattered per bucket;
  // the full gradients become short-lived activations), stage 3 also only its
  // chunk of the parameter (gathered just before use in forward and again in
  // backward, into short-lived buffers).
  zero = opts.dp > 1 ? opts.zero : 0;
  const int64_t dp = opts.dp;
  for (GradSlot &g : grads) {
    int64_t n = typeOf(g.value).getNumElements();
    numelOf[g.param] = n;
    chunkOf[g.param] = zero ? (n + dp - 1) / dp : n;
  }
  auto isZero3 = [&](unsigned arg) { return zero == 3 && chunkOf.count(arg); };
  // Stage 1 and 2 gather parameters in place: pad them to dp * chunk.
  if (zero == 1 || zero == 2)
    for (auto &[arg, c] : chunkOf)
      buffers[bufferOf.lookup(fn.getArgument(arg))].bytes = dp * c * 4;
  // Stage 3: the arena keeps the chunk; forward and backward each gather the
  // whole parameter into a buffer that lives from just before its first use
  // to its last use in that pass.
  struct Gathered {
    int buffer = -1;
    int first = -1, last = -1;
    std::string var;
  };
  std::map<unsigned, std::array<Gathered, 2>> gathered; // [0] forward, [1] backward
  int backwardBegin = end;
  for (Operation *op : ops)
    if (StringRef(nodeName(op->getLoc())).starts_with("backward of ")) {
      backwardBegin = index[op];
      break;
    }
  if (zero == 3) {
    for (Operation *op : ops) {
      if (foldedTransposes.count(op) || fusedMatmuls.count(op) || isa<ReshapeOp>(op))
        continue;
      Operation *reader = transposedMatmul.lookup(op) ? transposedMatmul.lookup(op) : op;
      for (unsigned i = 0; i < reader->getNumOperands(); ++i) {
        Value v = operandOf(reader, i);
        // Reshapes alias their input: a reshape of a parameter reads it.
        while (v.getDefiningOp() && isa<ReshapeOp>(v.getDefiningOp()))
          v = v.getDefiningOp()->getOperand(0);
        auto arg = dyn_cast<BlockArgument>(v);
        if (!arg || !isZero3(arg.getArgNumber()))
          continue;
        Gathered &gg = gathered[arg.getArgNumber()][index[op] >= backwardBegin ? 1 : 0];
        if (gg.first < 0 || readAt(op) < gg.first)
          gg.first = readAt(op);
        gg.last = std::max(gg.last, readAt(op));
      }
    }
    for (auto &[arg, pair] : gathered) {
      std::string base = var[fn.getArgument(arg)];
      for (int pass = 0; pass < 2; ++pass) {
        Gathered &gg = pair[pass];
        if (gg.first < 0)
          continue;
        gg.var = uniqueName(base + (pass ? "_full_bwd" : "_full_fwd"));
        gg.buffer = newBuffer(Region::Activation, dp * chunkOf[arg] * 4, gg.first - 1, gg.var);
        buffers[gg.buffer].lastUse = gg.last;
      }
      buffers[bufferOf.lookup(fn.getArgument(arg))].bytes = chunkOf[arg] * 4;
    }
  }
  // Stage 2 and 3: gradients are activations until their bucket's
  // reduce-scatter has finished; each rank keeps its chunk in the gradient region.
  if (zero >= 2) {
    for (GradSlot &g : grads) {
      if (g.copy)
        buffers[g.buffer].region = Region::Activation;
      else
        buffers[g.buffer].region = Region::Activation, pinned.erase(g.buffer);
      shardOf[g.param] = newBuffer(Region::Grad, chunkOf[g.param] * 4, -1,
                                   "grad_chunk_" + var[fn.getArgument(g.param)]);
    }
  }

  // Buckets: consecutive gradients (in the order backward finishes them) up
  // to bucketBytes.
  std::vector<Bucket> buckets = formBuckets();
  out.numBuckets = (int)buckets.size();
  // Stage >= 2: one bucket in flight; bucket k is waited for when bucket k+1
  // starts (the last at the end), so its full gradients can be freed there.
  if (zero >= 2)
    for (size_t k = 0; k < buckets.size(); ++k) {
      buckets[k].waitAt =
          k + 1 < buckets.size() ? std::max(buckets[k + 1].ready, buckets[k].ready) : end;
      for (size_t i = buckets[k].first; i <= buckets[k].last; ++i)
        buffers[grads[i].buffer].lastUse =
            std::max(buffers[grads[i].buffer].lastUse, buckets[k].waitAt);
    }

  // Persistent layout: parameters and buffers, gradients (in the order
  // backward finishes them), optimizer state, inputs, the seed; then activations.
  int64_t at = 0;
  auto place = [&](int b) {
    buffers[b].offset = at;
    at += alignUp(std::max<int64_t>(buffers[b].bytes, 1));
  };
  for (BlockArgument a : fn.getArguments())
    if (buffers[bufferOf.lookup(a)].region == Region::Param)
      place(bufferOf.lookup(a));
  int64_t paramEnd = at;
  int64_t gradBegin = at;
  for (GradSlot &g : grads)
    place(zero >= 2 ? shardOf[g.param] : g.buffer);
  int64_t gradEnd = at;
  at = placeOptimizerState(at);
  int64_t stateEnd = at;
  for (BlockArgument a : fn.getArguments()) {
    Region r = buffers[bufferOf.lookup(a)].region;
    if (r == Region::Input || r == Region::Seed)
      place(bufferOf.lookup(a));
  }
  int64_t activationBase = at;
  planActivations();
  for (Buffer &b : buffers)
    if (b.region == Region::Activation)
      b.offset += activationBase;
  out.arenaBytes = alignUp(activationBase + out.activationBytes);
  out.paramBytes = paramEnd;
  out.gradBytes = gradEnd - gradBegin;
  out.stateBytes = stateEnd - gradEnd;

  // Emit the ops, starting each bucket's reduction after its last gradient.
  std::string &s = body;
  size_t nextBucket = 0, nextWait = 0;
  auto waitBuckets = [&](int after) {
    while (zero >= 2 && nextWait < nextBucket && buckets[nextWait].waitAt <= after) {
      s += "  for (CommHandle &h : bucket" + std::to_string(nextWait) +
           ") ctx.dpComm->wait(h);  // its full gradients are dead from here\n";
      ++nextWait;
    }
  };
  auto startBuckets = [&](int after) {
    if (opts.dp <= 1)
      return;
    while (nextBucket < buckets.size() && buckets[nextBucket].ready <= after) {
      const Bucket &bk = buckets[nextBucket];
      std::string names;
      for (size_t i = bk.first; i <= bk.last; ++i) {
        names += (i > bk.first ? ", " : "") + paramName(grads[i].param);
        if (i - bk.first >= 3 && i < bk.last) {
          names += ", ... (" + std::to_string(bk.last - i) + " more)";
          break;
        }
      }
      std::string k = std::to_string(nextBucket);
      s += "\n  // Gradient bucket " + k + " is complete (" + names + "; " + bytesText(bk.bytes) +
           ").\n";
      if (zero < 2) {
        const Buffer &first = buffers[grads[bk.first].buffer];
        const Buffer &last = buffers[grads[bk.last].buffer];
        int64_t begin = first.offset, stop = last.offset + alignUp(last.bytes);
        s += "  // Data parallel: sum it over the " + std::to_string(opts.dp) +
             " replicas so that every replica applies the same update.\n";
        s += "  CommHandle bucket" + k + " = ctx.dpComm->allReduceAsync(A + " +
             std::to_string(begin) + ", " + std::to_string((stop - begin) / 4) +
             ", CommType::F32, ReduceOp::Sum);\n\n";
      } else {
        s += "  // ZeRO-" + std::to_string(zero) +
             ": reduce-scatter it; each replica keeps the "
             "sum of its chunk of each gradient.\n";
        s += "  CommHandle bucket" + k + "[" + std::to_string(bk.last - bk.first + 1) + "];\n";
        for (size_t i = bk.first; i <= bk.last; ++i) {
          unsigned p = grads[i].param;
          s += "  {\n    int64_t counts[" + std::to_string(dp) + "];\n    for (int r = 0; r < " +
               std::to_string(dp) + "; ++r) counts[r] = " + chunkCount(p, "r") + ";\n    bucket" +
               k + "[" + std::to_string(i - bk.first) + "] = ctx.dpComm->reduceScatterAsync(" +
               gradPtr(grads[i]) + ", " + chunkPtr(p) +
               ", counts, CommType::F32, ReduceOp::Sum);  // " + paramName(p) + "\n  }\n";
        }
        s += "\n";
      }
      ++nextBucket;
    }
  };
  std::string lossReduction = "unknown";
  if (auto r = fn->getAttrOfType<StringAttr>("carve.loss_reduction"))
    lossReduction = r.getValue().str();
  if (opts.dp > 1 && lossReduction == "unknown")
    return fail("cannot tell how the loss reduces over the batch (a mean or a sum of "
                "cross_entropy, reduce_mean or reduce_sum); data parallelism needs to know");
  std::string seedName;
  for (BlockArgument a : fn.getArguments())
    if (fn.getArgAttr(a.getArgNumber(), "carve.loss_seed"))
      seedName = var[a];
  if (seedName.empty())
    return fail("@train_step has no loss-seed argument");
  std::string seedValue = lossReduction == "mean" && opts.dp > 1
                              ? "1.0f / " + std::to_string(opts.dp)
                              : std::string("1.0f");
  std::string seedLines =
      "  // d(loss)/d(loss): " +
      std::string(lossReduction == "mean" && opts.dp > 1
                      ? "the loss is a mean over the batch and each replica sees 1/" +
                            std::to_string(opts.dp) +
                            " of it, so the summed gradients equal the global mean's."
                      : "1.");
  if (opts.cuda()) {
    // Outside the captured forward and backward: under fp16 the seed is the
    // loss scale, which changes between steps.
    Value seedArg;
    for (BlockArgument a : fn.getArguments())
      if (fn.getArgAttr(a.getArgNumber(), "carve.loss_seed"))
        seedArg = a;
    graphBefore = seedLines + "\n" +
                  seedStore("(float *)(A + " +
                                std::to_string(buffers[bufferOf.lookup(seedArg)].offset) + ")",
                            seedValue);
  } else {
    s += seedLines + "\n" + seedStore(seedName, seedValue) + "\n";
  }
  bool backward = false;
  std::map<unsigned, std::string> shardVar;
  for (auto &[arg, pair] : gathered)
    shardVar[arg] = var[fn.getArgument(arg)];
  for (Operation *op : ops) {
    if (!backward && index[op] >= backwardBegin) {
      backward = true;
      s += "\n  // ---- Backward ----\n\n";
    }
    for (auto &[arg, pair] : gathered) {
      const Gathered &gg = pair[backward ? 1 : 0];
      if (gg.first != index[op])
        continue;
      var[fn.getArgument(arg)] = gg.var;
      s += "  // ZeRO-3: gather " + paramName(arg) + " for its " +
           (backward ? std::string("backward") : std::string("forward")) + " uses (ops " +
           std::to_string(gg.first) + "-" + std::to_string(gg.last) +
           "); the buffer is free after the last.\n  float *" + gg.var + " = (float *)(A + " +
           std::to_string(buffers[gg.buffer].offset) + ");\n  ctx.dpComm->allGather(" +
           shardVar[arg] + ", " + gg.var + ", " + std::to_string(chunkOf[arg]) +
           ", CommType::F32);\n";
    }
    if (!emitOp(op))
      return false;
    startBuckets(index[op]);
    waitBuckets(index[op]);
  }
  for (auto &[arg, v] : shardVar)
    var[fn.getArgument(arg)] = v;
  for (GradSlot &g : grads)
    if (g.copy)
      s += "  copy(" + var[g.value] + ", " + gradPtr(g) + ", " +
           std::to_string(typeOf(g.value).getNumElements()) + ");  // gradient of " +
           paramName(g.param) + "\n";
  startBuckets(end);
  waitBuckets(end);

  // The step's tail: wait for the buckets, the loss, clipping, the optimizer.
  std::string t;
  llvm::raw_string_ostream ts(t);
  const OptimizerConfig &o = opts.optimizer;
  if (opts.dp > 1 && zero < 2) {
    // CUDA: inside forwardBackward, so that a captured graph joins the
    // collectives' stream back into the compute stream.
    std::string waits = "\n  // Wait for the gradient all-reduces before the optimizer reads them.\n";
    for (size_t b = 0; b < buckets.size(); ++b)
      waits += "  ctx.dpComm->wait(bucket" + std::to_string(b) + ");\n";
    if (opts.cuda())
      s += waits;
    else
      ts << waits;
  }
  if (opts.cuda()) {
    if (!bufferOf.count(loss))
      return fail("the loss has no buffer the step's tail can read");
    graphAfter = "  " + ctypeOf(loss) + " *" + var[loss] + " = (" + ctypeOf(loss) + " *)(A + " +
                 std::to_string(buffers[bufferOf.lookup(loss)].offset) +
                 ");  // the loss, written by forwardBackward\n";
  }
  ts << "\n  // The loss of the whole global batch.\n";
  ts << "  float loss = (float)" << scalarRead(var[loss]) << ";\n";
  emitDpLoss(ts, opts, lossReduction);
  ts << "  ctx.loss = loss;\n";
  emitUnscale(ts);

  // The gradient norm over the whole model: tp-split gradients (and ZeRO
  // chunks) are summed over their axis, replicated ones counted once.
  ts << "\n  if (ctx.hooks)\n    ctx.hooks->gradientsReady(ctx);  // train --on-nan\n";
  ts << "\n  // Gradient norm: squares summed over this rank's gradient elements";
  if (opts.tp > 1)
    ts << "; tp-split ones\n  // summed over tp, replicated ones counted once";
  if (zero >= 2)
    ts << "; each ZeRO chunk summed over dp";
  ts << ".\n" << normDeclarations(opts);
  emitNormTerms(ts, [](const GradSlot &) { return true; });
  ts << normRead(opts);
  if (zero >= 2) {
    ts << "  ctx.dpComm->allReduce(&sqSplit, 1, CommType::F64, ReduceOp::Sum);\n";
    ts << "  ctx.dpComm->allReduce(&sqWhole, 1, CommType::F64, ReduceOp::Sum);\n";
  }
  if (opts.tp > 1)
    ts << "  ctx.tpComm->allReduce(&sqSplit, 1, CommType::F64, ReduceOp::Sum);\n";
  ts << "  double norm = std::sqrt(sqSplit + sqWhole);\n  ctx.gradNorm = (float)norm;\n";
  ts << "  if (ctx.hooks && !ctx.hooks->updateAllowed(ctx, norm))\n"
        "    return;  // a non-finite loss or gradient: no update (train --on-nan)\n";
  if (o.clipGradNorm > 0) {
    ts << "  // torch.nn.utils.clip_grad_norm_(max_norm=" << number(o.clipGradNorm, false) << ")\n";
    ts << "  const float clip = clipCoefficient(norm, " << number(o.clipGradNorm, false) << ");\n";
    emitClip(ts);
  }
  ts << "\n  // " << o.describe() << "\n";
  ts << "  const double lr = scheduledLr(ctx.step, " << number(o.lr, false) << ", " << o.warmupSteps
     << ", " << o.decaySteps << ", " << number(o.minLrRatio, false) << ");\n";
  ts << "  ctx.lr = (float)lr;\n";
  emitUpdates(ts);

  buildTables(1);

  out.numKernelCalls = kernelCalls;
  std::string header;
  llvm::raw_string_ostream hs(header);
  hs << "  // Memory plan (one arena, " << bytesText(out.arenaBytes) << "):\n"
     << "  //   parameters and buffers   [0, " << paramEnd << ")\n"
     << "  //   gradients                [" << gradBegin << ", " << gradEnd << ")\n"
     << "  //   optimizer state          [" << gradEnd << ", " << stateEnd << ")\n"
     << "  //   inputs and loss seed     [" << stateEnd << ", " << activationBase << ")\n"
     << "  //   activations              [" << activationBase << ", "
     << activationBase + out.activationBytes << "): " << bytesText(out.activationBytes)
     << " reused by liveness (" << bytesText(out.unplannedBytes) << " without reuse)\n";
  out.source = emitProgram(header, t);
  if (opts.cuda())
    qualifyGpuCalls(out.source);
  return true;
}

void Generator::emitNormTerms(llvm::raw_ostream &ts,
                              const std::function<bool(const GradSlot &)> &counted) {
  for (GradSlot &g : grads) {
    if (!counted(g))
      continue;
    std::string ptr = zero >= 2 ? chunkPtr(g.param) : gradPtr(g);
    std::string count;
    if (zero >= 2)
      count = chunkCount(g.param, "ctx.dpRank");
    else
      count = std::to_string(numelOf[g.param]);
    if (opts.cuda())
      ts << "  sumSquaresAdd(" << ptr << ", " << count << ", sqDevice + "
         << (tpSplit(g.param) ? 0 : 1) << ");  // " << paramName(g.param) << "\n";
    else
      ts << "  " << (tpSplit(g.param) ? "sqSplit" : "sqWhole") << " += sumSquares(" << ptr
         << ", " << count << ");  // " << paramName(g.param) << "\n";
  }
}

void Generator::emitClip(llvm::raw_ostream &ts) {
  for (GradSlot &g : grads)
    ts << "  scaleInPlace(" << (zero >= 2 ? chunkPtr(g.param) : gradPtr(g)) << ", "
       << (zero >= 2 ? chunkOf[g.param] : numelOf[g.param]) << ", clip);\n";
}

void Generator::emitUnscale(llvm::raw_ostream &ts) {
  if (opts.precision != "fp16")
    return;
  ts << "\n  // fp16: the gradients carry the dynamic loss scale (train_main adjusts it); divide it\n"
     << "  // out before the norm, the check for overflow and the update.\n"
     << "  if (ctx.lossScale != 1.0f) {\n    const float unscale = 1.0f / ctx.lossScale;\n";
  for (GradSlot &g : grads)
    ts << "    scaleInPlace(" << (zero >= 2 ? chunkPtr(g.param) : gradPtr(g)) << ", "
       << (zero >= 2 ? chunkOf[g.param] : numelOf[g.param]) << ", unscale);\n";
  ts << "  }\n";
}

void Generator::emitUpdates(llvm::raw_ostream &ts) {
  const OptimizerConfig &o = opts.optimizer;
  const bool adam = o.kind == "adamw";
  const bool momentum = !adam && o.momentum != 0;
  if (zero)
    ts << "  // ZeRO-" << zero << ": this replica updates its chunk of each parameter.\n";
  double wd = o.effectiveWeightDecay();
  for (GradSlot &g : grads) {
    unsigned a = g.param;
    std::string pbase =
        "(float *)(A + " + std::to_string(buffers[bufferOf.lookup(fn.getArgument(a))].offset) + ")";
    std::string p = pbase, go = gradPtr(g), n = std::to_string(numelOf[a]);
    auto st = stateOf[a];
    if (zero) {
      std::string c = std::to_string(chunkOf[a]);
      std::string off = "(int64_t)ctx.dpRank * " + c;
      n = chunkCount(a, "ctx.dpRank");
      p = zero == 3 ? pbase : pbase + " + " + off;
      go = zero >= 2 ? chunkPtr(a) : gradPtr(g) + " + " + off;
    }
    if (adam)
      ts << "  adamwUpdate(" << p << ", " << go << ", (float *)(A + " << st[0]
         << "), (float *)(A + " << st[1] << "), " << n << ", lr, " << number(o.beta1, false) << ", "
         << number(o.beta2, false) << ", " << number(o.eps, false) << ", " << number(wd, false)
         << ", ctx.step + 1);  // " << paramName(a) << "\n";
    else
      ts << "  sgdUpdate(" << p << ", " << go << ", "
         << (momentum ? "(float *)(A + " + std::to_string(st[0]) + ")" : "nullptr") << ", " << n
         << ", lr, " << number(o.momentum, false) << ", " << number(o.dampening, false) << ", "
         << number(wd, false) << ", " << (o.nesterov ? "true" : "false") << ", ctx.step == 0);  // "
         << paramName(a) << "\n";
  }
  if (zero == 1 || zero == 2) {
    ts << "\n  // ZeRO-" << zero << ": every replica needs every updated parameter: gather the "
       << "chunks in place.\n  {\n    CommHandle h[" << grads.size() << "];\n";
    for (size_t i = 0; i < grads.size(); ++i) {
      unsigned a = grads[i].param;
      int64_t off = buffers[bufferOf.lookup(fn.getArgument(a))].offset;
      ts << "    h[" << i << "] = ctx.dpComm->allGatherAsync((float *)(A + " << off
         << ") + (int64_t)ctx.dpRank * " << chunkOf[a] << ", (float *)(A + " << off << "), "
         << chunkOf[a] << ", CommType::F32);  // " << paramName(a) << "\n";
    }
    ts << "    for (CommHandle &x : h) ctx.dpComm->wait(x);\n  }\n";
  }
}

bool Generator::runStage(const PipelineCodegenOptions &pipe, int chunk, int64_t base,
                         const std::map<std::string, int64_t> &inputOffsets, StageOut &so) {
  Block &block = fn.getBody().front();
  for (Operation &op : block.without_terminator()) {
    index[&op] = (int)ops.size();
    ops.push_back(&op);
  }
  auto ret = cast<func::ReturnOp>(block.getTerminator());
  const int end = (int)ops.size();
  const int m = opts.numMicroBatches;
  const int stage = (int)fn->getAttrOfType<IntegerAttr>("carve.stage").getInt();
  if (!checkTypes())
    return false;
  foldTransposes();
  fuseElementwise();
  if (!assignBuffers())
    return false;
  actBase = "S";
  int backwardBegin = end;
  for (Operation *op : ops)
    if (StringRef(nodeName(op->getLoc())).starts_with("backward of ") ||
        op->getAttr("carve.phase")) {
      backwardBegin = index[op];
      break;
    }
  // A send reads its tensor until the slot is taken by another micro-batch.
  int maxTag = -1;
  for (Operation *op : ops) {
    if (auto snd = dyn_cast<dist::SendOp>(op)) {
      buffers[bufferOf.lookup(snd.getInput())].lastUse = end;
      maxTag = std::max(maxTag, (int)snd.getTag());
    }
    if (auto r = dyn_cast<dist::RecvOp>(op))
      maxTag = std::max(maxTag, (int)r.getTag());
  }
  if ((int64_t)(maxTag + 1) * m > 32767)
    return fail("pipeline: " + std::to_string(maxTag + 1) + " transfers x " + std::to_string(m) +
                " micro-batches exceed the 32767 message tags of the runtime");

  so.hasLoss = ret.getNumOperands() > 0 && fn.getResultAttr(0, "carve.loss");
  Value loss = so.hasLoss ? ret.getOperand(0) : Value();
  if (so.hasLoss)
    buffers[bufferOf.lookup(loss)].lastUse = end;
  for (unsigned k = so.hasLoss ? 1 : 0; k < ret.getNumOperands(); ++k) {
    auto of = fn.getResultAttrOfType<StringAttr>(k, "carve.grad_of");
    if (!of)
      return fail("@stage" + std::to_string(stage) + " result " + std::to_string(k) +
                  " is not a gradient");
    unsigned param = ~0u;
    for (BlockArgument a : fn.getArguments())
      if (fn.getArgAttrOfType<StringAttr>(a.getArgNumber(), "carve.param") == of)
        param = a.getArgNumber();
    Value g = ret.getOperand(k);
    if (param == ~0u || !g.getDefiningOp())
      return fail("gradient of unknown parameter '" + of.getValue().str() + "'");
    if (!typeOf(g).getElementType().isF32())
      return fail("parameter '" + of.getValue().str() +
                  "' is not float32; the CPU target trains float32 parameters");
    int vb = bufferOf.lookup(g);
    int ready = std::max(buffers[vb].def, index[g.getDefiningOp()]);
    buffers[vb].lastUse = std::max(buffers[vb].lastUse, ready);
    GradSlot slot{
        param, g,     newBuffer(Region::Grad, bytesOf(g), -1, "grad_" + var[fn.getArgument(param)]),
        true,  ready, (bool)fn.getResultAttr(k, "carve.shared_grad")};
    grads.push_back(slot);
  }
  std::stable_sort(grads.begin(), grads.end(),
                   [](const GradSlot &a, const GradSlot &b) { return a.ready < b.ready; });
  zero = opts.dp > 1 ? opts.zero : 0;
  if (zero >= 2)
    return fail("pipeline: ZeRO stage " + std::to_string(zero) +
                " is not supported with pipelines");
  const int64_t dp = opts.dp;
  for (GradSlot &g : grads) {
    int64_t n = typeOf(g.value).getNumElements();
    numelOf[g.param] = n;
    chunkOf[g.param] = zero ? (n + dp - 1) / dp : n;
  }
  if (zero == 1)
    for (auto &[arg, c] : chunkOf)
      buffers[bufferOf.lookup(fn.getArgument(arg))].bytes = dp * c * 4;

  std::vector<Bucket> buckets = opts.dp > 1 ? formBuckets() : std::vector<Bucket>();
  so.numBuckets = (int)buckets.size();

  // Persistent layout from `base`: parameters, gradients, optimizer state,
  // the loss seed; graph inputs where the program put them.
  int64_t at = base;
  auto place = [&](int b) {
    buffers[b].offset = at;
    at += alignUp(std::max<int64_t>(buffers[b].bytes, 1));
  };
  for (BlockArgument a : fn.getArguments())
    if (buffers[bufferOf.lookup(a)].region == Region::Param)
      place(bufferOf.lookup(a));
  int64_t paramEnd = at;
  for (GradSlot &g : grads)
    place(g.buffer);
  int64_t gradEnd = at;
  at = placeOptimizerState(at);
  int64_t stateEnd = at;
  for (BlockArgument a : fn.getArguments()) {
    Buffer &b = buffers[bufferOf.lookup(a)];
    if (b.region == Region::Seed)
      place(bufferOf.lookup(a));
    if (b.region == Region::Input) {
      auto name = fn.getArgAttrOfType<StringAttr>(a.getArgNumber(), "carve.input").getValue();
      auto it = inputOffsets.find(name.str());
      if (it == inputOffsets.end())
        return fail("pipeline: stage " + std::to_string(stage) + " has input '" + name.str() +
                    "' that stage 0 does not have");
      b.offset = it->second;
    }
  }
  so.persistentEnd = alignUp(at);
  planActivations(); // offsets relative to the slot
  so.activationBytes = out.activationBytes;
  so.unplannedBytes = out.unplannedBytes;
  so.paramBytes = paramEnd - base;
  so.gradBytes = gradEnd - paramEnd;
  so.stateBytes = stateEnd - gradEnd;

  std::string lossReduction = "unknown";
  if (auto r = fn->getAttrOfType<StringAttr>("carve.loss_reduction"))
    lossReduction = r.getValue().str();
  so.lossReduction = lossReduction;
  if ((opts.dp > 1 || m > 1) && lossReduction == "unknown")
    return fail("cannot tell how the loss reduces over the batch (a mean or a sum of "
                "cross_entropy, reduce_mean or reduce_sum); data parallelism and micro-batches "
                "need to know");
  for (BlockArgument a : fn.getArguments())
    if (fn.getArgAttr(a.getArgNumber(), "carve.loss_seed")) {
      int64_t replicas = (int64_t)opts.dp * m;
      bool mean = lossReduction == "mean" && replicas > 1;
      so.init += "  // d(loss)/d(loss) of one micro-batch: " +
                 std::string(mean ? "the loss is a mean over the batch and each micro-batch is 1/" +
                                        std::to_string(replicas) +
                                        " of the global batch, so the summed gradients equal "
                                        "the global mean's."
                                  : "1.") +
                 "\n" +
                 seedStore("(float *)(A + " +
                               std::to_string(buffers[bufferOf.lookup(a)].offset) + ")",
                           mean ? "1.0f / " + std::to_string(replicas) : std::string("1.0f"));
    }

  // The two functions. Values the backward part reads from the forward part
  // are declared again at its top, at the same slot offsets.
  auto declare = [&](Value v) -> std::string {
    Value root = v;
    while (root.getDefiningOp() && isa<ReshapeOp>(root.getDefiningOp()))
      root = root.getDefiningOp()->getOperand(0);
    const Buffer &b = buffers[bufferOf.lookup(root)];
    if (b.region == Region::Constant && root == v)
      return "";
    std::string target = b.region == Region::Activation
                             ? "(" + ctypeOf(v) + " *)(S + " + std::to_string(b.offset) + ")"
                             : "(" + ctypeOf(v) + " *)" + var[root];
    return "  " + ctypeOf(v) + " *" + var[v] + " = " + target + ";\n";
  };
  std::string argPreamble = "  char *const A = ctx.arena;\n";
  for (BlockArgument a : fn.getArguments()) {
    const Buffer &b = buffers[bufferOf.lookup(a)];
    std::string what = b.region == Region::Input  ? "input"
                       : b.region == Region::Seed ? "loss seed"
                                                  : "parameter";
    argPreamble += "  " + ctypeOf(a) + " *" + var[a] + " = (" + ctypeOf(a) + " *)(A + " +
                   std::to_string(b.offset) + ")";
    if (b.region == Region::Input)
      argPreamble += " + (int64_t)mb * " + std::to_string(typeOf(a).getNumElements());
    argPreamble += ";  // " + what + " " + shapeText(typeOf(a).getShape()) +
                   (b.region == Region::Input ? " (micro-batch mb)" : "") + "\n";
  }
  std::set<Value, std::function<bool(Value, Value)>> stash(
      [&](Value x, Value y) { return var[x] < var[y]; });
  for (int i = backwardBegin; i < end; ++i) {
    Operation *op = ops[i];
    std::vector<Operation *> readers{op};
    if (Operation *fused = transposedMatmul.lookup(op))
      readers.push_back(fused);
    for (Operation *r : readers)
      for (unsigned k = 0; k < r->getNumOperands(); ++k) {
        Value v = operandOf(r, k);
        Operation *d = v.getDefiningOp();
        if (d && index.count(d) && index[d] < backwardBegin)
          stash.insert(v);
      }
  }
  std::string stashDecl;
  for (Value v : stash)
    stashDecl += declare(v);

  std::string forwardBody, backwardBody;
  std::vector<std::string> pendingRecv;
  auto flushRecvs = [&]() {
    for (const std::string &h : pendingRecv)
      body += "  ctx.ppComm->wait(" + h + ");\n";
    if (!pendingRecv.empty())
      body += "\n";
    pendingRecv.clear();
  };
  auto peer = [](int64_t offset) {
    return offset >= 0 ? "ctx.ppRank + " + std::to_string(offset)
                       : "ctx.ppRank - " + std::to_string(-offset);
  };
  size_t nextBucket = 0;
  for (Operation *op : ops) {
    if (index[op] == backwardBegin) {
      flushRecvs();
      forwardBody = body;
      body.clear();
    }
    if (auto r = dyn_cast<dist::RecvOp>(op)) {
      Value res = r.getResult();
      const Buffer &b = buffers[bufferOf.lookup(res)];
      int64_t from = r->getAttrOfType<IntegerAttr>("carve.from_stage").getInt();
      std::string h = "recv_" + var[res];
      std::string node = nodeName(op->getLoc());
      body += "  // " + std::string(index[op] >= backwardBegin ? "gradient" : "activation") + " " +
              shapeText(typeOf(res).getShape()) + " from stage " + std::to_string(from) +
              (node.empty() ? "" : " [" + node + "]") + "\n";
      body += "  " + ctypeOf(res) + " *" + var[res] + " = (" + ctypeOf(res) + " *)(S + " +
              std::to_string(b.offset) + ");\n";
      body += "  CommHandle " + h + " = ctx.ppComm->recvAsync(" + var[res] + ", " +
              std::to_string(bytesOf(res)) + ", " + peer((int64_t)r.getOffset()) + ", " +
              std::to_string((int64_t)r.getTag()) + " * " + std::to_string(m) + " + mb);\n";
      pendingRecv.push_back(h);
      continue;
    }
    flushRecvs();
    if (auto snd = dyn_cast<dist::SendOp>(op)) {
      Value v = snd.getInput();
      int64_t to = snd->getAttrOfType<IntegerAttr>("carve.to_stage").getInt();
      body += "  // send " + std::string(index[op] >= backwardBegin ? "the gradient " : "") +
              var[v] + " to stage " + std::to_string(to) +
              "; it stays in this slot until the send completes\n";
      body += "  sends[slot].push_back(ctx.ppComm->sendAsync(" + var[v] + ", " +
              std::to_string(bytesOf(v)) + ", " + peer((int64_t)snd.getOffset()) + ", " +
              std::to_string((int64_t)snd.getTag()) + " * " + std::to_string(m) + " + mb));\n";
      continue;
    }
    if (!emitOp(op))
      return false;
    int i = index[op];
    if (so.hasLoss && loss.getDefiningOp() == op)
      body += "  pipeLoss += (double)" + scalarRead(var[loss]) + ";  // this micro-batch's loss\n";
    for (GradSlot &g : grads)
      if (g.ready == i) {
        std::string n = std::to_string(typeOf(g.value).getNumElements());
        body += "  // accumulate the gradient of " + paramName(g.param) +
                (g.shared ? " (this stage's part)" : "") + "\n  if (mb == 0)\n    copy(" +
                var[g.value] + ", " + gradPtr(g) + ", " + n + ");\n  else\n    addInPlace(" +
                gradPtr(g) + ", " + var[g.value] + ", " + n + ");\n";
      }
    while (nextBucket < buckets.size() && buckets[nextBucket].ready <= i) {
      const Bucket &bk = buckets[nextBucket];
      const Buffer &first = buffers[grads[bk.first].buffer];
      const Buffer &last = buffers[grads[bk.last].buffer];
      int64_t begin = first.offset, stop = last.offset + alignUp(last.bytes);
      body += "  // Gradient bucket " + std::to_string(nextBucket) + " is complete (" +
              bytesText(bk.bytes) + "): after the last micro-batch, sum it over the " +
              std::to_string(opts.dp) + " data-parallel replicas.\n  if (last)\n    buckets[" +
              std::to_string(nextBucket) + "] = ctx.dpComm->allReduceAsync(A + " +
              std::to_string(begin) + ", " + std::to_string((stop - begin) / 4) +
              ", CommType::F32, ReduceOp::Sum);\n";
      so.bucketWaits += "  ctx.dpComm->wait(c" + std::to_string(chunk) + "::buckets[" +
                        std::to_string(nextBucket) + "]);\n";
      ++nextBucket;
    }
  }
  flushRecvs();
  if (backwardBegin == end) {
    forwardBody = body;
    body.clear();
  }
  backwardBody = body;

  std::string sig = "(StepContext &ctx, int mb, int slot, char *S";
  so.forward =
      "/// Forward of micro-batch `mb`, its activations in slot `slot` (at S).\nvoid forward" +
      sig + ") {\n" + argPreamble + "  (void)slot;\n\n" + forwardBody + "}\n";
  so.backward =
      "/// Backward of micro-batch `mb` (slot `slot`); `last`: the step's last micro-batch.\n"
      "void backward" +
      sig + ", bool last) {\n" + argPreamble + stashDecl + "  (void)slot;\n  (void)last;\n\n" +
      backwardBody + "}\n";
  so.constants = constants + fusedDefs;
  so.constants += "std::vector<CommHandle> sends[" + std::to_string(pipe.slots[chunk]) +
                  "]; // sends in flight, per slot\n";
  if (!buckets.empty())
    so.constants += "CommHandle buckets[" + std::to_string(buckets.size()) + "];\n";
  so.customKernels = customKernels;
  so.kernelCalls = kernelCalls;

  // The tail's pieces.
  std::map<std::string, int> owner;
  for (const auto &sh : pipe.shared)
    owner[sh.name] = sh.owner;
  llvm::raw_string_ostream ns(so.norm), cs(so.clip), us(so.updates), ss(so.unscale);
  emitUnscale(ss);
  emitNormTerms(ns,
                [&](const GradSlot &g) { return !g.shared || owner[paramName(g.param)] == stage; });
  emitClip(cs);
  emitUpdates(us);
  for (GradSlot &g : grads)
    if (g.shared)
      so.sharedGrads.push_back({paramName(g.param), gradPtr(g)});
  buildTables(m);
  so.params = paramRows;
  so.inputs = inputRows;
  so.plan = "  //   stage " + std::to_string(stage) + ": parameters [" + std::to_string(base) +
            ", " + std::to_string(paramEnd) + "), gradients [" + std::to_string(paramEnd) + ", " +
            std::to_string(gradEnd) + "), optimizer state [" + std::to_string(gradEnd) + ", " +
            std::to_string(stateEnd) + "); activations " + bytesText(so.activationBytes) +
            " per micro-batch (" + bytesText(so.unplannedBytes) + " without reuse)\n";
  return true;
}

/// The runtime's tables of inputs and parameters (tp pieces, ZeRO chunks,
/// offsets). `microBatches` inputs lie one after another in the arena.
void Generator::buildTables(int64_t microBatches) {
  for (BlockArgument a : fn.getArguments()) {
    unsigned i = a.getArgNumber();
    const Buffer &b = buffers[bufferOf.lookup(a)];
    if (b.region != Region::Param && b.region != Region::Input)
      continue;
    TensorRow row;
    auto nameAttr = fn.getArgAttrOfType<StringAttr>(i, "carve.param");
    if (!nameAttr)
      nameAttr = fn.getArgAttrOfType<StringAttr>(i, "carve.buffer");
    if (!nameAttr)
      nameAttr = fn.getArgAttrOfType<StringAttr>(i, "carve.input");
    row.name = nameAttr.getValue().str();
    std::string c;
    int sz;
    elementInfo(typeOf(a).getElementType(), c, row.dtype, sz);
    row.shape.assign(typeOf(a).getShape().begin(), typeOf(a).getShape().end());
    row.global = row.shape;
    if (auto d = fn.getArgAttrOfType<DictionaryAttr>(i, "dist.layout"))
      if (auto l = d.getAs<dist::SbpAttr>("tp"); l && l.isSplit()) {
        row.tpDim = (int)l.getDim();
        row.tpGroups = l.getGroups();
        row.global[l.getDim()] *= opts.tp;
      }
    row.numel = typeOf(a).getNumElements();
    if (b.region == Region::Input && microBatches > 1) {
      // The arena holds all micro-batches of this rank's share, one after another.
      row.shape[0] *= microBatches;
      row.global[0] *= microBatches;
      row.numel *= microBatches;
    }
    row.offset = b.offset;
    for (GradSlot &g : grads)
      if (g.param == i) {
        row.trainable = true;
        row.gradOffset = zero >= 2 ? buffers[shardOf[i]].offset : buffers[g.buffer].offset;
        row.state[0] = stateOf[i][0];
        row.state[1] = stateOf[i][1];
        if (zero) {
          row.zeroChunk = chunkOf[i];
          row.paramZero = zero == 3;
          row.stateZero = true;
        }
      }
    (b.region == Region::Param ? paramRows : inputRows).push_back(row);
  }
}

std::string Generator::emitProgram(const std::string &plan, const std::string &tail) {
  std::string src;
  llvm::raw_string_ostream os(src);
  const std::string &P = opts.programName;
  os << "// " << P << (opts.cuda() ? ".cu" : ".cpp") << ": one rank's training step, generated by `carve compile` from "
     << opts.modelName << ".\n"
     << "// Regenerate it rather than editing it.\n//\n"
     << "// Plan: " << opts.planJson << "\n"
     << "// Data parallel over " << opts.dp << " rank(s): this program sees "
     << opts.globalBatch / std::max(1, opts.dp) << " of the global batch of " << opts.globalBatch
     << ".\n"
     << "// Optimizer: " << opts.optimizer.describe() << "\n"
     << "// " << kernelCalls << " kernel calls, " << out.numBuckets
     << " gradient bucket(s); every call is annotated with the model node it comes from.\n\n"
     << runtimeIncludes(opts, false)
     << (customKernels.empty() ? "" : "#include \"carve/rt/custom.h\"\n")
     << "\n#include <cmath>\n#include <cstdint>\n\n";
  if (!customKernels.empty()) {
    os << "// The user's kernels, from the rules file's sources (OUT/src/custom/); the ABI is in\n"
       << "// carve/rt/custom.h.\n";
    for (const auto &[fn, decl] : customKernels)
      os << decl << "\n";
    os << "\n";
  }
  os << usingLine(opts) << "\nnamespace {\n\n";
  if (!constants.empty())
    os << "// ---- Constants ----\n\n" << constants << "\n";
  if (!fusedDefs.empty())
    os << "// ---- Fused elementwise chains (carve/rt/fused.h) ----\n\n" << fusedDefs;
  if (opts.cuda()) {
    os << "// The step's forward and backward, with their collectives: what `train --cuda-graph`\n"
       << "// captures in a CUDA graph and replays (graphStep in step below; docs/cuda.md).\n"
       << "void forwardBackward(StepContext &ctx) {\n  char *const A = ctx.arena;\n";
  } else {
    os << "void step(StepContext &ctx) {\n";
    os << plan << "\n  char *const A = ctx.arena;\n" << precisionLine(opts) << "\n";
  }
  os << "  // ---- Inputs, parameters and buffers ----\n";
  for (BlockArgument a : fn.getArguments()) {
    const Buffer &b = buffers[bufferOf.lookup(a)];
    std::string what = b.region == Region::Input  ? "input"
                       : b.region == Region::Seed ? "loss seed"
                                                  : "parameter";
    os << "  " << ctypeOf(a) << " *" << var[a] << " = (" << ctypeOf(a) << " *)(A + " << b.offset
       << ");  // " << what << " " << shapeText(typeOf(a).getShape()) << "\n";
  }
  os << "\n  // ---- Forward ----\n\n" << body;
  if (opts.cuda()) {
    os << "}\n\nvoid step(StepContext &ctx) {\n"
       << plan << "\n  char *const A = ctx.arena;\n" << precisionLine(opts) << "\n"
       << graphBefore
       << "\n  // Forward and backward: run as they are, or (train --cuda-graph) run once, then\n"
       << "  // captured in a CUDA graph and replayed.\n"
       << "  graphStep(ctx, forwardBackward);\n"
       << graphAfter;
  }
  os << tail << "}\n\n";

  emitProgramTables(os, opts, out, inputRows, paramRows, nullptr);
  return src;
}

} // namespace

bool generateCpuProgram(ModuleOp module, const CodegenOptions &opts, GeneratedProgram &out,
                        std::string &error) {
  auto fn = module.lookupSymbol<func::FuncOp>("train_step");
  if (!fn) {
    error = "the module has no @train_step (run autodiff first)";
    return false;
  }
  if (fn.getBody().getBlocks().size() != 1) {
    error = "@train_step must be a single block";
    return false;
  }
  Generator g(fn, opts, out, error);
  return g.run();
}

bool generatePipelineProgram(ModuleOp module, const CodegenOptions &opts,
                             const PipelineCodegenOptions &pipe, GeneratedProgram &out,
                             std::string &error) {
  const int p = pipe.pp, v = pipe.virtualStages, m = opts.numMicroBatches;
  std::vector<func::FuncOp> fns;
  for (int c = 0; c < v; ++c) {
    std::string name = "stage" + std::to_string(c * p + pipe.rank);
    auto fn = module.lookupSymbol<func::FuncOp>(name);
    if (!fn) {
      error = "the module has no @" + name + " (run the pipeline split first)";
      return false;
    }
    fns.push_back(fn);
  }
  // Graph inputs first, all micro-batches of this replica's share, as stage 0
  // of this rank lists them (every stage lists every input).
  std::map<std::string, int64_t> inputOffsets;
  int64_t at = 0;
  for (BlockArgument a : fns[0].getArguments())
    if (auto in = fns[0].getArgAttrOfType<StringAttr>(a.getArgNumber(), "carve.input")) {
      auto t = typeOf(a);
      std::string c, d;
      int size = 0;
      elementInfo(t.getElementType(), c, d, size);
      inputOffsets[in.getValue().str()] = at;
      at += alignUp(t.getNumElements() * size * m);
    }
  const int64_t inputsEnd = at;
  std::vector<Generator::StageOut> chunks(v);
  std::vector<std::unique_ptr<Generator>> gens;
  std::vector<GeneratedProgram> scratch(v);
  for (int c = 0; c < v; ++c) {
    gens.push_back(std::make_unique<Generator>(fns[c], opts, scratch[c], error));
    if (!gens.back()->runStage(pipe, c, at, inputOffsets, chunks[c]))
      return false;
    at = chunks[c].persistentEnd;
  }
  const int64_t persistentEnd = at;
  std::vector<int64_t> slotBase(v), slotBytes(v);
  for (int c = 0; c < v; ++c) {
    slotBytes[c] = alignUp(std::max<int64_t>(chunks[c].activationBytes, 1));
    slotBase[c] = at;
    at += slotBytes[c] * pipe.slots[c];
  }
  out.arenaBytes = alignUp(at);
  out.activationBytes = at - persistentEnd;
  for (auto &ch : chunks) {
    out.unplannedBytes += ch.unplannedBytes;
    out.paramBytes += ch.paramBytes;
    out.gradBytes += ch.gradBytes;
    out.stateBytes += ch.stateBytes;
    out.numBuckets += ch.numBuckets;
    out.numKernelCalls += ch.kernelCalls;
  }

  // Parameter names must not repeat on one rank (two chunks would update two copies).
  std::set<std::string> seen;
  for (auto &ch : chunks)
    for (const TensorRow &r : ch.params)
      if (!seen.insert(r.name).second) {
        error = "pipeline: parameter '" + r.name + "' is used by two stages of pipeline rank " +
                std::to_string(pipe.rank) +
                "; this version keeps one copy per rank (choose other cut points or fewer "
                "virtual stages)";
        return false;
      }

  std::string src;
  llvm::raw_string_ostream os(src);
  const std::string &P = opts.programName;
  std::string stages;
  for (int c = 0; c < v; ++c)
    stages += (c ? ", " : "") + std::to_string(c * p + pipe.rank);
  os << "// " << P << (opts.cuda() ? ".cu" : ".cpp") << ": pipeline rank " << pipe.rank
     << "'s training step, generated by `carve "
     << "compile` from " << opts.modelName << ".\n"
     << "// Regenerate it rather than editing it.\n//\n"
     << "// Plan: " << opts.planJson << "\n"
     << "// Pipeline: " << p * v << " stages over pp=" << p << " rank(s)"
     << (v > 1 ? " (" + std::to_string(v) + " per rank)" : std::string())
     << "; this rank runs stage" << (v > 1 ? "s " : " ") << stages << ". Schedule " << pipe.schedule
     << " over " << m << " micro-batch(es) of "
     << opts.globalBatch / std::max(1, opts.dp) / std::max(1, m)
     << " samples per step (data parallel over " << opts.dp << ", global batch " << opts.globalBatch
     << ").\n"
     << "// Optimizer: " << opts.optimizer.describe() << "\n"
     << "// " << out.numKernelCalls << " kernel calls per micro-batch, " << out.numBuckets
     << " gradient bucket(s); every call is annotated with the model node it comes from.\n\n"
     << runtimeIncludes(opts, true);
  std::map<std::string, std::string> custom;
  for (auto &ch : chunks)
    custom.insert(ch.customKernels.begin(), ch.customKernels.end());
  if (!custom.empty())
    os << "#include \"carve/rt/custom.h\"\n";
  os << "\n#include <cmath>\n#include <cstdint>\n#include <vector>\n\n";
  if (!custom.empty()) {
    os << "// The user's kernels, from the rules file's sources (OUT/src/custom/); the ABI is in\n"
       << "// carve/rt/custom.h.\n";
    for (const auto &[fn, decl] : custom)
      os << decl << "\n";
    os << "\n";
  }
  os << usingLine(opts) << "\nnamespace {\n\n"
     << "double pipeLoss = 0; // the last stage's losses of this step, summed over "
        "micro-batches\n\n";
  for (int c = 0; c < v; ++c) {
    os << "// ==== Stage " << c * p + pipe.rank << " (chunk " << c << " of this rank) ====\n"
       << "namespace c" << c << " {\n\n"
       << chunks[c].constants << "\n"
       << chunks[c].forward << "\n"
       << chunks[c].backward << "\n} // namespace c" << c << "\n\n";
  }

  // The step: the schedule, then the synchronization and the optimizer.
  os << "void step(StepContext &ctx) {\n"
     << precisionLine(opts) << "  // Memory plan (one arena, " << bytesText(out.arenaBytes) << "):\n"
     << "  //   inputs (" << m << " micro-batch(es))    [0, " << inputsEnd << ")\n";
  for (int c = 0; c < v; ++c)
    os << chunks[c].plan;
  for (int c = 0; c < v; ++c)
    os << "  //   stage " << c * p + pipe.rank << " activations: " << pipe.slots[c]
       << " slot(s) of " << bytesText(slotBytes[c]) << " at [" << slotBase[c] << ", "
       << slotBase[c] + slotBytes[c] * pipe.slots[c] << ")\n";
  os << "  char *const A = ctx.arena;\n  pipeLoss = 0;\n";
  for (auto &ch : chunks)
    os << ch.init;
  os << "\n  // ---- Schedule (" << pipe.schedule << ", pp=" << p << ", " << m << " micro-batches"
     << (v > 1 ? ", " + std::to_string(v) + " chunks per rank" : std::string())
     << "): F = forward, B = backward of micro-batch k ----\n";
  for (const auto &st : pipe.steps) {
    int stage = st.chunk * p + pipe.rank;
    std::string c = "c" + std::to_string(st.chunk);
    std::string slot = "A + " + std::to_string(slotBase[st.chunk]) + " + " +
                       std::to_string(st.slot) + " * " + std::to_string(slotBytes[st.chunk]);
    if (st.forward) {
      os << "  waitAll(*ctx.ppComm, " << c << "::sends[" << st.slot << "]);  // slot " << st.slot
         << " is free once its sends are done\n";
      os << "  { TraceSpan t(ctx, 'F', " << st.microBatch << ", " << stage << "); " << c
         << "::forward(ctx, " << st.microBatch << ", " << st.slot << ", " << slot << "); }\n";
    } else {
      os << "  { TraceSpan t(ctx, 'B', " << st.microBatch << ", " << stage << "); " << c
         << "::backward(ctx, " << st.microBatch << ", " << st.slot << ", " << slot << ", "
         << (st.microBatch == m - 1 ? "true" : "false") << "); }\n";
    }
  }
  os << "\n  // Every send has completed before the step ends.\n";
  for (int c = 0; c < v; ++c)
    os << "  for (auto &s : c" << c << "::sends) waitAll(*ctx.ppComm, s);\n";
  bool anyBuckets = false;
  for (auto &ch : chunks)
    anyBuckets |= !ch.bucketWaits.empty();
  if (anyBuckets) {
    os << "\n  // Wait for the gradient all-reduces before the optimizer reads them.\n";
    for (auto &ch : chunks)
      os << ch.bucketWaits;
  }
  if (!pipe.shared.empty()) {
    os << "\n  // Parameters used on several stages (a tied embedding): sum their gradient parts "
          "over pp\n  // (every pp rank joins each all-reduce; ranks without the parameter add "
          "zeros).\n";
    for (const auto &sh : pipe.shared) {
      std::string ptr;
      for (auto &ch : chunks)
        for (auto &[name, q] : ch.sharedGrads)
          if (name == sh.name)
            ptr = q;
      if (!ptr.empty())
        os << "  ctx.ppComm->allReduce(" << ptr << ", " << sh.numel
           << ", CommType::F32, ReduceOp::Sum);  // " << sh.name << "\n";
      else
        os << "  {\n    std::vector<float> zeros(" << sh.numel
           << ");\n    ctx.ppComm->allReduce(zeros.data(), " << sh.numel
           << ", CommType::F32, ReduceOp::Sum);  // " << sh.name << " (not on this rank)\n  }\n";
    }
  }
  const std::string &red = chunks.back().lossReduction;
  os << "\n  // The loss of the whole global batch";
  if (p > 1)
    os << " (only the last stage computes it)";
  os << ".\n  float loss = (float)pipeLoss;\n";
  if (red == "mean" && m > 1)
    os << "  loss /= " << m << ".0f;  // the mean of " << m << " equal micro-batches\n";
  if (p > 1)
    os << "  ctx.ppComm->allReduce(&loss, 1, CommType::F32, ReduceOp::Sum);\n";
  emitDpLoss(os, opts, red);
  os << "  ctx.loss = loss;\n";
  for (auto &ch : chunks)
    os << ch.unscale;
  os << "\n  if (ctx.hooks)\n    ctx.hooks->gradientsReady(ctx);  // train --on-nan\n";
  os << "\n  // Gradient norm: squares summed over this rank's gradients";
  if (opts.tp > 1)
    os << " (tp-split ones summed over tp)";
  if (p > 1)
    os << ", then over the pipeline stages (a shared parameter counted on its first stage)";
  os << ".\n" << normDeclarations(opts);
  for (auto &ch : chunks)
    os << ch.norm;
  os << normRead(opts);
  if (opts.tp > 1)
    os << "  ctx.tpComm->allReduce(&sqSplit, 1, CommType::F64, ReduceOp::Sum);\n";
  os << "  double sq = sqSplit + sqWhole;\n";
  if (p > 1)
    os << "  ctx.ppComm->allReduce(&sq, 1, CommType::F64, ReduceOp::Sum);\n";
  os << "  double norm = std::sqrt(sq);\n  ctx.gradNorm = (float)norm;\n";
  os << "  if (ctx.hooks && !ctx.hooks->updateAllowed(ctx, norm))\n"
        "    return;  // a non-finite loss or gradient: no update (train --on-nan)\n";
  const OptimizerConfig &o = opts.optimizer;
  if (o.clipGradNorm > 0) {
    os << "  // torch.nn.utils.clip_grad_norm_(max_norm=" << number(o.clipGradNorm, false) << ")\n";
    os << "  const float clip = clipCoefficient(norm, " << number(o.clipGradNorm, false) << ");\n";
    for (auto &ch : chunks)
      os << ch.clip;
  }
  os << "\n  // " << o.describe() << "\n";
  os << "  const double lr = scheduledLr(ctx.step, " << number(o.lr, false) << ", " << o.warmupSteps
     << ", " << o.decaySteps << ", " << number(o.minLrRatio, false) << ");\n";
  os << "  ctx.lr = (float)lr;\n";
  for (auto &ch : chunks)
    os << ch.updates;
  os << "}\n\n";

  // Tables.
  std::vector<TensorRow> params, inputs = chunks[0].inputs;
  for (auto &ch : chunks)
    params.insert(params.end(), ch.params.begin(), ch.params.end());
  emitProgramTables(os, opts, out, inputs, params, &pipe);
  out.source = src;
  if (opts.cuda())
    qualifyGpuCalls(out.source);
  return true;
}

std::string generateProgramTable(const std::vector<std::string> &programNames,
                                 const std::vector<int> &rankToProgram) {
  std::string s;
  llvm::raw_string_ostream os(s);
  os << "// programs.cpp: which program each rank runs (generated by `carve compile`).\n\n"
     << "#include \"carve/rt/program.h\"\n\nusing carve::rt::Program;\n\n";
  for (const std::string &p : programNames)
    os << "extern const Program " << p << ";\n";
  os << "\nextern \"C\" int carve_world_size() { return " << rankToProgram.size() << "; }\n\n"
     << "extern \"C\" const Program *carve_program_for_rank(int rank) {\n"
     << "  static const Program *const table[] = {";
  for (size_t r = 0; r < rankToProgram.size(); ++r)
    os << (r ? ", " : "") << "&" << programNames[rankToProgram[r]];
  os << "};\n  if (rank < 0 || rank >= " << rankToProgram.size()
     << ")\n    return nullptr;\n  return table[rank];\n}\n";
  return s;
}

} // namespace carve
