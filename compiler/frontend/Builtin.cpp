//===- Builtin.cpp - GPT and Llama generators that mirror the importer ----===//
//
// Builds `func.func @forward` for `builtin:gpt:...` and `builtin:llama:...`
// directly in the form that `carve import` gives the ONNX export of
// models/reference.py's GPT and Llama after carve-raise, canonicalization and
// CSE. Each function below writes out, in export order, the ops that survive
// that pipeline for one module of the PyTorch model, each located at the ONNX
// node it came from:
//
//   1. arguments: the graph inputs (input_ids, targets), then the parameters in
//      `named_parameters()` order; buffers (causal masks, rope tables) are
//      folded into constants by the importer and never become arguments;
//   2. constants: the folder hoists constants to the top of the function, the
//      last one it meets first, each located at its first user;
//   3. ops: a Linear is `transpose(W)`, `matmul`, `add(bias, ...)`; a split,
//      three slices; a causal attention chain, one `carve.attention` whose key
//      transpose the raise pattern re-creates at the attention's node;
//   4. large constants print as resource blobs named after their ONNX value.
//
// Node names and value names are the exporter's (torch.onnx, opset 17); the
// e2e test builtin_models compares both forms for several configurations. A
// location is `NameLoc(node, "builtin:FAMILY":0:0)`: the importer's file name
// and node index have no counterpart here, and nothing reads them.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Builtin.h"
#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Shapes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/AsmState.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/DialectResourceBlobManager.h"
#include "mlir/IR/Verifier.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/Support/GlobPattern.h"
#include "llvm/Support/raw_ostream.h"

#include <cmath>
#include <set>
#include <vector>

using namespace mlir;

namespace carve {
namespace {

//===----------------------------------------------------------------------===//
// Spec keys
//===----------------------------------------------------------------------===//

enum class KeyKind { Positive, Flag, Fraction, PositiveReal };

/// One key of a family: its kind and, for an optional key, its default (a
/// default of NAN is computed from the other keys once they are known).
struct KeyInfo {
  const char *name;
  KeyKind kind;
  bool required;
  double dflt;
};

const std::vector<KeyInfo> &keysOf(llvm::StringRef family) {
  static const std::vector<KeyInfo> gpt = {
      {"layers", KeyKind::Positive, true, 0},   {"hidden", KeyKind::Positive, true, 0},
      {"heads", KeyKind::Positive, true, 0},    {"seq", KeyKind::Positive, true, 0},
      {"vocab", KeyKind::Positive, true, 0},    {"batch", KeyKind::Positive, false, 1},
      {"ffn", KeyKind::Positive, false, NAN},   {"block_size", KeyKind::Positive, false, NAN},
      {"tied", KeyKind::Flag, false, 1},        {"gelu_tanh", KeyKind::Flag, false, 0},
      {"dropout", KeyKind::Fraction, false, 0},
  };
  static const std::vector<KeyInfo> llama = {
      {"layers", KeyKind::Positive, true, 0},
      {"hidden", KeyKind::Positive, true, 0},
      {"heads", KeyKind::Positive, true, 0},
      {"seq", KeyKind::Positive, true, 0},
      {"vocab", KeyKind::Positive, true, 0},
      {"batch", KeyKind::Positive, false, 1},
      {"kv_heads", KeyKind::Positive, false, NAN},
      {"ffn", KeyKind::Positive, false, NAN},
      {"block_size", KeyKind::Positive, false, NAN},
      {"norm_eps", KeyKind::PositiveReal, false, 1e-5},
      {"rope_theta", KeyKind::PositiveReal, false, 10000.0},
      {"dropout", KeyKind::Fraction, false, 0},
  };
  static const std::vector<KeyInfo> none;
  return family == "gpt" ? gpt : family == "llama" ? llama : none;
}

/// Dimensions beyond this are typos, and would overflow the products below.
constexpr int64_t kMaxDim = (int64_t(1) << 31) - 1;

/// Parses one value of `key`; on failure returns false with the reason.
bool parseValue(const KeyInfo &key, llvm::StringRef text, double &out, std::string &error) {
  std::string what = "key '" + std::string(key.name) + "' ";
  if (key.kind == KeyKind::Positive || key.kind == KeyKind::Flag) {
    int64_t v;
    if (text.getAsInteger(10, v)) {
      error = what + "must be an integer, got '" + text.str() + "'";
      return false;
    }
    if (key.kind == KeyKind::Flag && v != 0 && v != 1) {
      error = what + "must be 0 or 1, got '" + text.str() + "'";
      return false;
    }
    if (key.kind == KeyKind::Positive && v <= 0) {
      error = what + "must be a positive integer, got '" + text.str() + "'";
      return false;
    }
    if (v > kMaxDim) {
      error = what + "is too large (" + text.str() + ")";
      return false;
    }
    out = (double)v;
    return true;
  }
  double v;
  if (text.getAsDouble(v) || !std::isfinite(v)) {
    error = what + "must be a number, got '" + text.str() + "'";
    return false;
  }
  if (key.kind == KeyKind::Fraction && (v < 0 || v >= 1)) {
    error = what + "must be in [0, 1), got '" + text.str() + "'";
    return false;
  }
  if (key.kind == KeyKind::PositiveReal && v <= 0) {
    error = what + "must be positive, got '" + text.str() + "'";
    return false;
  }
  out = v;
  return true;
}

std::string keyList(const std::vector<KeyInfo> &keys) {
  std::string s;
  for (const KeyInfo &k : keys)
    s += (s.empty() ? "" : ", ") + std::string(k.name);
  return s;
}

/// The defaults computed from other keys, and the checks between keys.
bool completeSpec(BuiltinSpec &spec, std::string &error) {
  auto &v = spec.values;
  int64_t hidden = spec.get("hidden"), heads = spec.get("heads");
  if (!v.count("block_size"))
    v["block_size"] = v["seq"];
  if (!v.count("ffn")) {
    if (spec.family == "gpt") {
      v["ffn"] = 4.0 * hidden;
    } else {
      // Llama's FeedForward: 2/3 of 4 * hidden, rounded up to a multiple of 256.
      int64_t f = 8 * hidden / 3;
      v["ffn"] = (double)((f + 255) / 256 * 256);
    }
  }
  if (spec.family == "llama" && !v.count("kv_heads"))
    v["kv_heads"] = v["heads"];
  if (hidden % heads != 0) {
    error = "key 'hidden' (" + std::to_string(hidden) + ") must be a multiple of 'heads' (" +
            std::to_string(heads) + ")";
    return false;
  }
  if (spec.get("block_size") < spec.get("seq")) {
    error = "key 'block_size' (" + std::to_string(spec.get("block_size")) +
            ") must be at least 'seq' (" + std::to_string(spec.get("seq")) + ")";
    return false;
  }
  if (spec.family == "llama") {
    int64_t kv = spec.get("kv_heads");
    if (heads % kv != 0) {
      error = "key 'heads' (" + std::to_string(heads) + ") must be a multiple of 'kv_heads' (" +
              std::to_string(kv) + ")";
      return false;
    }
    if ((hidden / heads) % 2 != 0) {
      error = "key 'hidden' (" + std::to_string(hidden) + ") over 'heads' (" +
              std::to_string(heads) + ") must give an even head size for rotary embeddings, got " +
              std::to_string(hidden / heads);
      return false;
    }
  }
  return true;
}

//===----------------------------------------------------------------------===//
// Deterministic initial weights
//===----------------------------------------------------------------------===//

/// splitmix64: a small generator whose stream is the same on every platform
/// (std::normal_distribution is not).
struct SplitMix {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  /// Uniform in (0, 1].
  double uniform() { return ((next() >> 11) + 1) * (1.0 / 9007199254740992.0); }
};

/// How `_init_transformer` (models/reference.py) starts a parameter.
enum class Init { Normal, Zeros, Ones };

/// Fills `data` as Init says; normal values are N(0, 0.02) by Box-Muller from
/// a stream seeded by the parameter's name, so a parameter's values do not
/// depend on the rest of the model.
void fillInitial(Init init, llvm::StringRef name, std::vector<float> &data) {
  if (init != Init::Normal) {
    std::fill(data.begin(), data.end(), init == Init::Ones ? 1.0f : 0.0f);
    return;
  }
  uint64_t seed = 0xCA4E5EEDull;
  for (char c : name)
    seed = (seed ^ (uint8_t)c) * 0x100000001B3ull;
  SplitMix rng{seed};
  for (size_t k = 0; k < data.size(); k += 2) {
    double r = std::sqrt(-2.0 * std::log(rng.uniform())) * 0.02;
    double t = 2.0 * M_PI * rng.uniform();
    data[k] = (float)(r * std::cos(t));
    if (k + 1 < data.size())
      data[k + 1] = (float)(r * std::sin(t));
  }
}

//===----------------------------------------------------------------------===//
// The graph builder
//===----------------------------------------------------------------------===//

/// A parameter before it becomes an argument.
struct ParamDecl {
  std::string name;
  SmallVector<int64_t> shape;
  Init init;
};

/// Builds one model; ops are appended to the function's entry block.
class ModelBuilder {
public:
  ModelBuilder(MLIRContext &ctx, const BuiltinSpec &spec, const ImportOptions &opts,
               llvm::StringRef file)
      : ctx(ctx), spec(spec), opts(opts), b(&ctx), file(file.str()) {
    batch = opts.batch > 0 ? opts.batch : spec.get("batch");
    seq = spec.get("seq");
    hidden = spec.get("hidden");
    heads = spec.get("heads");
    headDim = hidden / heads;
    vocab = spec.get("vocab");
    dropout = spec.values.at("dropout");
  }

  OwningOpRef<ModuleOp> build(std::string &error);

private:
  // Arguments.
  void declareInputs();
  void declareParam(std::string name, ArrayRef<int64_t> shape, Init init);
  bool makeArguments(std::string &error);
  Value param(llvm::StringRef name) { return params.lookup(name); }

  // Ops, located at the ONNX node `node`.
  Location at(const Twine &node) {
    return NameLoc::get(b.getStringAttr(node), FileLineColLoc::get(&ctx, file, 0, 0));
  }
  RankedTensorType f32(ArrayRef<int64_t> shape) {
    return RankedTensorType::get(shape, b.getF32Type());
  }
  static ArrayRef<int64_t> shapeOf(Value v) {
    return cast<RankedTensorType>(v.getType()).getShape();
  }
  Value constant(ArrayRef<int64_t> shape, ArrayRef<float> f, ArrayRef<int64_t> i,
                 llvm::StringRef blobName, const Twine &node);
  template <typename OpTy> Value binary(Value l, Value r, const Twine &node) {
    ShapeOrError s = broadcastShapes(shapeOf(l), shapeOf(r));
    auto type =
        RankedTensorType::get(s.shape, cast<RankedTensorType>(l.getType()).getElementType());
    return OpTy::create(b, at(node), type, l, r);
  }
  Value add(Value l, Value r, const Twine &node) { return binary<AddOp>(l, r, node); }
  Value mul(Value l, Value r, const Twine &node) { return binary<MulOp>(l, r, node); }
  Value matmul(Value l, Value r, const Twine &node) {
    return MatmulOp::create(b, at(node), f32(matmulShape(shapeOf(l), shapeOf(r)).shape), l, r);
  }
  Value transpose(Value x, ArrayRef<int64_t> perm, const Twine &node) {
    return TransposeOp::create(b, at(node), f32(transposeShape(shapeOf(x), perm).shape), x,
                               b.getDenseI64ArrayAttr(perm));
  }
  Value reshape(Value x, ArrayRef<int64_t> shape, const Twine &node) {
    auto elt = cast<RankedTensorType>(x.getType()).getElementType();
    return ReshapeOp::create(b, at(node), RankedTensorType::get(shape, elt), x);
  }
  /// x[..., from:to] on the last axis.
  Value sliceLast(Value x, int64_t from, int64_t to, const Twine &node) {
    SmallVector<int64_t> starts(shapeOf(x).size(), 0), ends(shapeOf(x)),
        steps(shapeOf(x).size(), 1);
    starts.back() = from;
    ends.back() = to;
    SmallVector<int64_t> shape(shapeOf(x));
    shape.back() = to - from;
    return SliceOp::create(b, at(node), f32(shape), x, b.getDenseI64ArrayAttr(starts),
                           b.getDenseI64ArrayAttr(ends), b.getDenseI64ArrayAttr(steps));
  }
  /// nn.Linear under `prefix`: x @ W^T (+ bias).
  Value linear(Value x, llvm::StringRef weight, llvm::StringRef bias, const Twine &prefix) {
    Value wt = transpose(param(weight), {1, 0}, prefix + "/Transpose");
    Value y = matmul(x, wt, prefix + "/MatMul");
    return bias.empty() ? y : add(param(bias), y, prefix + "/Add");
  }
  Value attention(Value q, Value k, Value v, const Twine &node);
  Value loss(Value logits);
  /// Marks an op whose result PyTorch would pass through dropout.
  void markDropout(Value v) {
    if (dropout > 0)
      v.getDefiningOp()->setAttr(kDropoutAttr, b.getF64FloatAttr(dropout));
  }

  // The two families.
  void declareGpt();
  Value buildGpt();
  void declareLlama();
  Value buildLlama();

  MLIRContext &ctx;
  const BuiltinSpec &spec;
  const ImportOptions &opts;
  OpBuilder b;
  std::string file;
  int64_t batch, seq, hidden, heads, headDim, vocab;
  double dropout;

  Block *entry = nullptr;
  SmallVector<Attribute> argAttrs;
  std::vector<ParamDecl> decls;
  llvm::StringMap<Value> params;
  Value inputIds, targets;
};

void ModelBuilder::declareInputs() {
  Location loc = FileLineColLoc::get(&ctx, file, 0, 0);
  auto i64 = RankedTensorType::get({batch, seq}, b.getI64Type());
  for (const char *name : {"input_ids", "targets"}) {
    Value arg = entry->addArgument(i64, loc);
    argAttrs.push_back(b.getDictionaryAttr({b.getNamedAttr(kInputAttr, b.getStringAttr(name))}));
    (llvm::StringRef(name) == "targets" ? targets : inputIds) = arg;
  }
}

void ModelBuilder::declareParam(std::string name, ArrayRef<int64_t> shape, Init init) {
  decls.push_back({std::move(name), SmallVector<int64_t>(shape), init});
}

bool ModelBuilder::makeArguments(std::string &error) {
  std::set<std::string> frozen;
  for (const std::string &glob : opts.frozen) {
    auto pattern = llvm::GlobPattern::create(glob);
    if (!pattern) {
      error = "--frozen '" + glob + "' is not a valid glob: " + llvm::toString(pattern.takeError());
      return false;
    }
    bool matched = false;
    for (const ParamDecl &d : decls)
      if (pattern->match(d.name)) {
        frozen.insert(d.name);
        matched = true;
      }
    if (!matched) {
      error = "--frozen '" + glob + "' matches no parameter of the model";
      return false;
    }
  }
  if (opts.initialValues) {
    int64_t total = 0;
    for (const ParamDecl &d : decls) {
      int64_t n = 1;
      for (int64_t s : d.shape)
        n *= s;
      total += n;
    }
    if (total > (int64_t(1) << 31)) {
      error = "the model has " + std::to_string(total) +
              " parameter elements; builtin initial weights are generated only up to 2^31 "
              "elements (plan such a model without weights, or export it from PyTorch)";
      return false;
    }
  }
  Location loc = FileLineColLoc::get(&ctx, file, 0, 0);
  for (const ParamDecl &d : decls) {
    Value arg = entry->addArgument(f32(d.shape), loc);
    SmallVector<NamedAttribute> attrs = {b.getNamedAttr(kParamAttr, b.getStringAttr(d.name))};
    if (!frozen.count(d.name))
      attrs.push_back(b.getNamedAttr(kTrainableAttr, b.getUnitAttr()));
    argAttrs.push_back(b.getDictionaryAttr(attrs));
    params[d.name] = arg;
    if (opts.initialValues) {
      ImportOptions::InitialValue v;
      v.name = d.name;
      v.shape.assign(d.shape.begin(), d.shape.end());
      int64_t n = 1;
      for (int64_t s : d.shape)
        n *= s;
      v.data.resize(n);
      fillInitial(d.init, d.name, v.data);
      opts.initialValues->push_back(std::move(v));
    }
  }
  return true;
}

/// As the importer materializes a folded ONNX value: a splat or at most 64
/// elements inline, anything larger as a resource blob named after the value.
Value ModelBuilder::constant(ArrayRef<int64_t> shape, ArrayRef<float> f, ArrayRef<int64_t> i,
                             llvm::StringRef blobName, const Twine &node) {
  bool isFloat = i.empty();
  size_t n = isFloat ? f.size() : i.size();
  bool splat = n > 0;
  for (size_t k = 1; k < n && splat; ++k)
    splat = isFloat ? f[k] == f[0] : i[k] == i[0];
  Type elt = isFloat ? Type(b.getF32Type()) : Type(b.getI64Type());
  auto type = RankedTensorType::get(shape, elt);
  ElementsAttr attr;
  if (!splat && n > 64 && isFloat)
    attr = DenseResourceElementsAttr::get(type, blobName,
                                          HeapAsmResourceBlob::allocateAndCopyInferAlign(f));
  else if (!splat && n > 64)
    attr = DenseResourceElementsAttr::get(type, blobName,
                                          HeapAsmResourceBlob::allocateAndCopyInferAlign(i));
  else if (isFloat)
    attr = DenseElementsAttr::get(type, f);
  else
    attr = DenseElementsAttr::get(type, i);
  return ConstantOp::create(b, at(node), attr);
}

/// The raised causal attention over [B, H, T, D] operands.
Value ModelBuilder::attention(Value q, Value k, Value v, const Twine &node) {
  float scale = (float)(1.0 / std::sqrt((double)headDim));
  Value o = AttentionOp::create(b, at(node), q.getType(), q, k, v, Value(),
                                b.getF32FloatAttr(scale), b.getBoolAttr(true));
  markDropout(o);
  return o;
}

/// F.cross_entropy(logits.view(-1, V), targets.view(-1)).
Value ModelBuilder::loss(Value logits) {
  Value flat = reshape(logits, {batch * seq, vocab}, "/Reshape");
  Value labels = reshape(targets, {batch * seq}, "/Reshape_1");
  return CrossEntropyOp::create(b, at("/SoftmaxCrossEntropyLoss"), f32({}), flat, labels,
                                b.getStringAttr("mean"), b.getI64IntegerAttr(-100));
}

//===----------------------------------------------------------------------===//
// GPT (models/reference.py: GPT, GPTBlock, CausalSelfAttention, GPTMLP)
//===----------------------------------------------------------------------===//

void ModelBuilder::declareGpt() {
  int64_t ffn = spec.get("ffn");
  declareParam("wte.weight", {vocab, hidden}, Init::Normal);
  declareParam("wpe.weight", {spec.get("block_size"), hidden}, Init::Normal);
  for (int64_t l = 0; l < spec.get("layers"); ++l) {
    std::string p = "h." + std::to_string(l) + ".";
    declareParam(p + "ln_1.weight", {hidden}, Init::Ones);
    declareParam(p + "ln_1.bias", {hidden}, Init::Zeros);
    declareParam(p + "attn.c_attn.weight", {3 * hidden, hidden}, Init::Normal);
    declareParam(p + "attn.c_attn.bias", {3 * hidden}, Init::Zeros);
    declareParam(p + "attn.c_proj.weight", {hidden, hidden}, Init::Normal);
    declareParam(p + "attn.c_proj.bias", {hidden}, Init::Zeros);
    declareParam(p + "ln_2.weight", {hidden}, Init::Ones);
    declareParam(p + "ln_2.bias", {hidden}, Init::Zeros);
    declareParam(p + "mlp.c_fc.weight", {ffn, hidden}, Init::Normal);
    declareParam(p + "mlp.c_fc.bias", {ffn}, Init::Zeros);
    declareParam(p + "mlp.c_proj.weight", {hidden, ffn}, Init::Normal);
    declareParam(p + "mlp.c_proj.bias", {hidden}, Init::Zeros);
  }
  declareParam("ln_f.weight", {hidden}, Init::Ones);
  declareParam("ln_f.bias", {hidden}, Init::Zeros);
  if (!spec.get("tied"))
    declareParam("lm_head.weight", {vocab, hidden}, Init::Normal);
}

Value ModelBuilder::buildGpt() {
  auto layerNorm = [&](Value x, llvm::StringRef scale, llvm::StringRef bias, const Twine &node) {
    return LayerNormOp::create(b, at(node), x.getType(), x, param(scale), param(bias),
                               b.getI64IntegerAttr(2), b.getF32FloatAttr(1e-5f));
  };
  // pos = torch.arange(T), exported as a root Constant node. TorchScript's
  // constant pooling merges the view sizes of the attention (heads, head size)
  // with equal root-scope ints -- add's alpha 1 and arange's dtype torch.long,
  // 4 -- into root Constant nodes numbered before this one; its value name
  // (the blob's name when T > 64) counts them.
  std::vector<int64_t> positions(seq);
  for (int64_t t = 0; t < seq; ++t)
    positions[t] = t;
  int pooled = 0;
  for (int64_t v : {1, 4})
    pooled += heads == v || headDim == v;
  std::string posName = pooled ? "/Constant_" + std::to_string(pooled) + "_output_0"
                               : std::string("/Constant_output_0");
  Value pos = constant({seq}, {}, positions, posName, "/wpe/Gather");

  Value tok = GatherOp::create(b, at("/wte/Gather"), f32({batch, seq, hidden}), param("wte.weight"),
                               inputIds, b.getI64IntegerAttr(0));
  Value wpe = GatherOp::create(b, at("/wpe/Gather"), f32({seq, hidden}), param("wpe.weight"), pos,
                               b.getI64IntegerAttr(0));
  Value x = add(tok, wpe, "/Add");
  markDropout(x);

  bool tanh = spec.get("gelu_tanh");
  for (int64_t l = 0; l < spec.get("layers"); ++l) {
    std::string n = "/h." + std::to_string(l), p = "h." + std::to_string(l) + ".";
    // x = x + attn(ln_1(x))
    Value h = layerNorm(x, p + "ln_1.weight", p + "ln_1.bias", n + "/ln_1/LayerNormalization");
    Value qkv = linear(h, p + "attn.c_attn.weight", p + "attn.c_attn.bias", n + "/attn/c_attn");
    Value q = sliceLast(qkv, 0, hidden, n + "/attn/Split");
    Value k = sliceLast(qkv, hidden, 2 * hidden, n + "/attn/Split");
    Value v = sliceLast(qkv, 2 * hidden, 3 * hidden, n + "/attn/Split");
    SmallVector<int64_t> split = {batch, seq, heads, headDim};
    SmallVector<int64_t> perm = {0, 2, 1, 3};
    q = transpose(reshape(q, split, n + "/attn/Reshape"), perm, n + "/attn/Transpose");
    k = reshape(k, split, n + "/attn/Reshape_1");
    v = transpose(reshape(v, split, n + "/attn/Reshape_2"), perm, n + "/attn/Transpose_1");
    k = transpose(k, perm, n + "/attn/MatMul_1");
    Value y = attention(q, k, v, n + "/attn/MatMul_1");
    y = reshape(transpose(y, perm, n + "/attn/Transpose_3"), {batch, seq, hidden},
                n + "/attn/Reshape_3");
    y = linear(y, p + "attn.c_proj.weight", p + "attn.c_proj.bias", n + "/attn/c_proj");
    markDropout(y);
    x = add(x, y, n + "/Add");
    // x = x + mlp(ln_2(x))
    h = layerNorm(x, p + "ln_2.weight", p + "ln_2.bias", n + "/ln_2/LayerNormalization");
    h = linear(h, p + "mlp.c_fc.weight", p + "mlp.c_fc.bias", n + "/mlp/c_fc");
    h = GeluOp::create(b, at(n + (tanh ? "/mlp/Mul_5" : "/mlp/Mul_1")), h.getType(), h,
                       b.getStringAttr(tanh ? "tanh" : "none"));
    h = linear(h, p + "mlp.c_proj.weight", p + "mlp.c_proj.bias", n + "/mlp/c_proj");
    markDropout(h);
    x = add(x, h, n + "/Add_1");
  }
  x = layerNorm(x, "ln_f.weight", "ln_f.bias", "/ln_f/LayerNormalization");
  Value logits = linear(x, spec.get("tied") ? "wte.weight" : "lm_head.weight", "", "/lm_head");
  return loss(logits);
}

//===----------------------------------------------------------------------===//
// Llama (models/reference.py: Llama, LlamaBlock, LlamaAttention, SwiGLU)
//===----------------------------------------------------------------------===//

void ModelBuilder::declareLlama() {
  int64_t ffn = spec.get("ffn"), kv = spec.get("kv_heads") * headDim;
  declareParam("tok_embeddings.weight", {vocab, hidden}, Init::Normal);
  for (int64_t l = 0; l < spec.get("layers"); ++l) {
    std::string p = "layers." + std::to_string(l) + ".";
    declareParam(p + "attention_norm.weight", {hidden}, Init::Ones);
    declareParam(p + "attention.wq.weight", {hidden, hidden}, Init::Normal);
    declareParam(p + "attention.wk.weight", {kv, hidden}, Init::Normal);
    declareParam(p + "attention.wv.weight", {kv, hidden}, Init::Normal);
    declareParam(p + "attention.wo.weight", {hidden, hidden}, Init::Normal);
    declareParam(p + "ffn_norm.weight", {hidden}, Init::Ones);
    declareParam(p + "feed_forward.w1.weight", {ffn, hidden}, Init::Normal);
    declareParam(p + "feed_forward.w2.weight", {hidden, ffn}, Init::Normal);
    declareParam(p + "feed_forward.w3.weight", {ffn, hidden}, Init::Normal);
  }
  declareParam("norm.weight", {hidden}, Init::Ones);
  declareParam("output.weight", {vocab, hidden}, Init::Normal);
}

Value ModelBuilder::buildLlama() {
  float eps = (float)spec.values.at("norm_eps");
  auto rmsNorm = [&](Value x, llvm::StringRef scale, const Twine &node) {
    return RmsNormOp::create(b, at(node), x.getType(), x, param(scale), b.getI64IntegerAttr(2),
                             b.getF32FloatAttr(eps));
  };
  // The rope tables as Llama.__init__ computes them in float32, sliced to T.
  // inv_freq and freqs round exactly as torch's do; cos and sin are rounded
  // from double (torch's vectorized float32 cos/sin differ by an ulp at times).
  double theta = spec.values.at("rope_theta");
  int64_t half = headDim / 2;
  std::vector<float> invFreq(half);
  for (int64_t j = 0; j < half; ++j) {
    float e = (float)(2 * j) / (float)headDim;
    invFreq[j] = 1.0f / (float)std::pow(theta, (double)e);
  }
  std::vector<float> cosT(seq * headDim), sinT(seq * headDim);
  for (int64_t t = 0; t < seq; ++t)
    for (int64_t j = 0; j < headDim; ++j) {
      float f = (float)t * invFreq[j % half];
      cosT[t * headDim + j] = (float)std::cos((double)f);
      sinT[t * headDim + j] = (float)std::sin((double)f);
    }
  Value sin = constant({seq, headDim}, sinT, {}, "/Slice_1_output_0", "/layers.0/attention/Mul_1");
  Value cos = constant({seq, headDim}, cosT, {}, "/Slice_output_0", "/layers.0/attention/Mul");

  Value x = GatherOp::create(b, at("/tok_embeddings/Gather"), f32({batch, seq, hidden}),
                             param("tok_embeddings.weight"), inputIds, b.getI64IntegerAttr(0));
  markDropout(x);

  int64_t kvHeads = spec.get("kv_heads"), rep = heads / kvHeads;
  SmallVector<int64_t> perm = {0, 2, 1, 3};
  for (int64_t l = 0; l < spec.get("layers"); ++l) {
    std::string n = "/layers." + std::to_string(l), a = n + "/attention",
                p = "layers." + std::to_string(l) + ".";
    // x = x + attention(attention_norm(x), cos, sin, mask)
    Value h = rmsNorm(x, p + "attention_norm.weight", n + "/attention_norm/Mul_1");
    Value q = linear(h, p + "attention.wq.weight", "", a + "/wq");
    q = transpose(reshape(q, {batch, seq, heads, headDim}, a + "/Reshape"), perm, a + "/Transpose");
    Value k = linear(h, p + "attention.wk.weight", "", a + "/wk");
    k = transpose(reshape(k, {batch, seq, kvHeads, headDim}, a + "/Reshape_1"), perm,
                  a + "/Transpose_1");
    Value v = linear(h, p + "attention.wv.weight", "", a + "/wv");
    v = transpose(reshape(v, {batch, seq, kvHeads, headDim}, a + "/Reshape_2"), perm,
                  a + "/Transpose_2");
    // apply_rotary: x * cos + cat(-x2, x1) * sin, for q and then k, which
    // carve-raise makes one carve.rotary at the Add's node.
    auto rotary = [&](Value t, int first) {
      auto suffix = [](int k) { return k ? "_" + std::to_string(k) : std::string(); };
      return RotaryOp::create(b, at(a + "/Add" + suffix(first)), t.getType(), t, cos, sin)
          .getResult();
    };
    q = rotary(q, 0);
    k = rotary(k, 1);
    // _repeat_kv: x[:, :, None].expand(B, KV, rep, T, D).reshape(B, H, T, D); the
    // importer folds it away when rep is 1.
    auto repeat = [&](Value t, const char *unsqueeze, const char *expand, const char *merge) {
      Value u = reshape(t, {batch, kvHeads, 1, seq, headDim}, a + unsqueeze);
      Value e = ExpandOp::create(b, at(a + expand), f32({batch, kvHeads, rep, seq, headDim}), u);
      return reshape(e, {batch, heads, seq, headDim}, a + merge);
    };
    if (rep > 1) {
      k = repeat(k, "/Unsqueeze_12", "/Expand", "/Reshape_4");
      v = repeat(v, "/Unsqueeze_22", "/Expand_1", "/Reshape_6");
    }
    Value y = attention(q, k, v, a + "/MatMul_1");
    y = reshape(transpose(y, perm, a + "/Transpose_4"), {batch, seq, hidden}, a + "/Reshape_7");
    y = linear(y, p + "attention.wo.weight", "", a + "/wo");
    markDropout(y);
    x = add(x, y, n + "/Add");
    // x = x + feed_forward(ffn_norm(x)): w2(silu(w1(x)) * w3(x))
    std::string f = n + "/feed_forward";
    h = rmsNorm(x, p + "ffn_norm.weight", n + "/ffn_norm/Mul_1");
    Value gate = linear(h, p + "feed_forward.w1.weight", "", f + "/w1");
    gate = SiluOp::create(b, at(f + "/Mul"), gate.getType(), gate);
    Value up = linear(h, p + "feed_forward.w3.weight", "", f + "/w3");
    h = mul(gate, up, f + "/Mul_1");
    h = linear(h, p + "feed_forward.w2.weight", "", f + "/w2");
    markDropout(h);
    x = add(x, h, n + "/Add_1");
  }
  x = rmsNorm(x, "norm.weight", "/norm/Mul_1");
  return loss(linear(x, "output.weight", "", "/output"));
}

OwningOpRef<ModuleOp> ModelBuilder::build(std::string &error) {
  if (!opts.dims.empty()) {
    error = "--set-dim " + opts.dims.begin()->getKey().str() +
            ": the model has no symbolic dimension of that name (it has none)";
    return nullptr;
  }
  Location loc = FileLineColLoc::get(&ctx, file, 0, 0);
  OwningOpRef<ModuleOp> module(ModuleOp::create(loc));
  module->setSymName("torch_jit");
  if (dropout > 0)
    (*module)->setAttr(kDropoutAttr, b.getF64FloatAttr(dropout));
  b.setInsertionPointToEnd(module->getBody());
  auto func = func::FuncOp::create(b, loc, "forward", b.getFunctionType({}, {}));
  entry = func.addEntryBlock();

  declareInputs();
  bool gpt = spec.family == "gpt";
  if (gpt)
    declareGpt();
  else
    declareLlama();
  if (!makeArguments(error))
    return nullptr;
  b.setInsertionPointToEnd(entry);
  Value result = gpt ? buildGpt() : buildLlama();
  func::ReturnOp::create(b, loc, result);

  func.setFunctionType(b.getFunctionType(entry->getArgumentTypes(), TypeRange{result}));
  func.setAllArgAttrs(argAttrs);
  SmallVector<DictionaryAttr> resultAttrs = {
      b.getDictionaryAttr({b.getNamedAttr(kOutputAttr, b.getStringAttr("loss"))})};
  func.setAllResultAttrs(resultAttrs);
  return module;
}

} // namespace

//===----------------------------------------------------------------------===//
// Entry points
//===----------------------------------------------------------------------===//

bool isBuiltinModel(llvm::StringRef model) { return model.starts_with("builtin:"); }

bool parseBuiltinSpec(llvm::StringRef model, BuiltinSpec &spec, std::string &error) {
  llvm::StringRef rest = model;
  if (!rest.consume_front("builtin:")) {
    error = "a builtin model is written 'builtin:FAMILY:KEY=VALUE,...'";
    return false;
  }
  auto [family, list] = rest.split(':');
  const std::vector<KeyInfo> &keys = keysOf(family);
  if (keys.empty()) {
    error = "unknown builtin model family '" + family.str() + "' (known: gpt, llama)";
    return false;
  }
  spec = BuiltinSpec();
  spec.family = family.str();
  SmallVector<llvm::StringRef> entries;
  if (!list.empty())
    list.split(entries, ',');
  for (llvm::StringRef e : entries) {
    auto [key, value] = e.split('=');
    key = key.trim();
    value = value.trim();
    if (!e.contains('=') || key.empty() || value.empty()) {
      error = "'" + e.str() + "' is not KEY=VALUE";
      return false;
    }
    const KeyInfo *info = nullptr;
    for (const KeyInfo &k : keys)
      if (key == k.name)
        info = &k;
    if (!info) {
      error =
          "unknown key '" + key.str() + "' for " + spec.family + " (keys: " + keyList(keys) + ")";
      return false;
    }
    if (spec.values.count(key.str())) {
      error = "key '" + key.str() + "' is given twice";
      return false;
    }
    if (!parseValue(*info, value, spec.values[key.str()], error))
      return false;
  }
  for (const KeyInfo &k : keys) {
    if (spec.values.count(k.name))
      continue;
    if (k.required) {
      error = "missing key '" + std::string(k.name) + "' (" + spec.family + " needs " +
              "layers, hidden, heads, seq, vocab)";
      return false;
    }
    if (!std::isnan(k.dflt))
      spec.values[k.name] = k.dflt;
  }
  return completeSpec(spec, error);
}

OwningOpRef<ModuleOp> buildBuiltinModel(MLIRContext &context, const BuiltinSpec &spec,
                                        const ImportOptions &opts, std::string &error) {
  context.loadDialect<CarveDialect, func::FuncDialect>();
  ModelBuilder builder(context, spec, opts, "builtin:" + spec.family);
  OwningOpRef<ModuleOp> module = builder.build(error);
  if (!module)
    return nullptr;
  std::string diag;
  ScopedDiagnosticHandler handler(&context, [&](Diagnostic &d) {
    if (diag.empty()) {
      llvm::raw_string_ostream os(diag);
      os << d.getLocation() << ": " << d.str();
    }
    return success();
  });
  if (failed(verify(*module))) {
    error = "internal error: the builtin model does not verify: " + diag;
    return nullptr;
  }
  return module;
}

OwningOpRef<ModuleOp> loadModel(MLIRContext &context, llvm::StringRef model,
                                const ImportOptions &opts, std::string &error) {
  if (!isBuiltinModel(model))
    return importOnnxFile(context, model, opts, error);
  BuiltinSpec spec;
  if (!parseBuiltinSpec(model, spec, error))
    return nullptr;
  return buildBuiltinModel(context, spec, opts, error);
}

} // namespace carve
