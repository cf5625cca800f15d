//===- ImportOps.cpp - the per-op import table ----------------------------===//
//
// A node that is not folded becomes carve ops typed by the shape rules in
// dialects/carve/Shapes.h. The table sends each op type to the function of
// its family; data movement is in ImportDataMovement.cpp, convolutions and
// pooling in ImportConvolution.cpp.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Importer.h"
#include "compiler/frontend/LowerConvolutions.h"

#include "dialects/carve/CarveOps.h"

#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/raw_ostream.h"

#include <cctype>
#include <cmath>
#include <map>
#include <set>

using namespace mlir;
using llvm::ArrayRef;
using llvm::SmallVector;
using llvm::StringRef;

namespace carve::frontend {

template <typename OpTy> Value Importer::binary(Value l, Value r, bool boolResult) {
  if (eltOf(l) != eltOf(r)) {
    std::string a, c;
    llvm::raw_string_ostream(a) << eltOf(l);
    llvm::raw_string_ostream(c) << eltOf(r);
    fail("operand element types differ (" + a + " vs " + c + ")");
  }
  ShapeOrError s = broadcastShapes(shp(l), shp(r));
  expect(s);
  bool logical = std::is_same_v<OpTy, AndOp> || std::is_same_v<OpTy, OrOp>;
  if (logical != eltOf(l).isInteger(1))
    fail(logical ? "the inputs must be BOOL" : "arithmetic on BOOL is not supported");
  Type elt = boolResult ? b.getI1Type() : eltOf(l);
  return OpTy::create(b, loc, tensorType(s.shape, elt), l, r);
}

void Importer::build(const onnx::NodeProto &n) {
  using Family = void (Importer::*)(const onnx::NodeProto &);
  static const llvm::StringMap<Family> table = [] {
    llvm::StringMap<Family> t;
    auto add = [&](Family f, std::initializer_list<StringRef> ops) {
      for (StringRef op : ops)
        t[op] = f;
    };
    add(&Importer::buildElementwise,
        {"Add",   "Sub",   "Mul",       "Div",        "Max",      "Min",      "Pow",
         "Equal", "Less",  "Greater",   "And",        "Or",       "Neg",      "Abs",
         "Exp",   "Log",   "Sqrt",      "Reciprocal", "Tanh",     "Erf",      "Sigmoid",
         "Relu",  "Sin",   "Cos",       "Not",        "Gelu",     "Identity", "Dropout",
         "Cast",  "Where", "LeakyRelu", "Clip",       "Softplus", "OneHot",   "HardSigmoid",
         "HardSwish", "CastLike", "LessOrEqual", "GreaterOrEqual"});
    add(&Importer::buildContraction, {"MatMul", "Gemm", "Einsum", "CumSum"});
    add(&Importer::buildNormalization,
        {"TopK", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2", "Softmax", "LogSoftmax",
         "LayerNormalization", "BatchNormalization"});
    add(&Importer::buildReshape, {"Reshape", "Unsqueeze", "Squeeze", "Flatten"});
    add(&Importer::buildDataMovement,
        {"Transpose", "Slice", "Split", "Concat", "Gather", "Expand", "Pad", "SplitToSequence",
         "SequenceAt", "Tile", "GatherElements"});
    add(&Importer::buildConvolution,
        {"Conv", "MaxPool", "AveragePool", "GlobalAveragePool", "Resize"});
    add(&Importer::buildLoss, {"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"});
    add(&Importer::buildRecurrent, {"LSTM", "GRU"});
    add(&Importer::buildNonZero, {"NonZero"});
    add(&Importer::buildScatterElements, {"ScatterElements"});
    add(&Importer::buildScatterND, {"ScatterND"});
    return t;
  }();
  auto it = table.find(n.op_type());
  if (it == table.end())
    failUnsupported();
  (this->*it->second)(n);
}

void Importer::buildElementwise(const onnx::NodeProto &n) {
  const std::string &op = n.op_type();

  // Elementwise binary ops.
  if (op == "Add")
    return define(0, binary<AddOp>(val(0), val(1)));
  if (op == "Sub")
    return define(0, binary<SubOp>(val(0), val(1)));
  if (op == "Mul")
    return define(0, binary<MulOp>(val(0), val(1)));
  if (op == "Div")
    return define(0, binary<DivOp>(val(0), val(1)));
  if (op == "Max" || op == "Min") {
    if (n.input_size() != 2)
      fail(op + " with " + std::to_string(n.input_size()) + " inputs is not supported (two are)");
    return define(0, op == "Max" ? binary<MaximumOp>(val(0), val(1))
                                 : binary<MinimumOp>(val(0), val(1)));
  }
  if (op == "Pow") {
    Value base = val(0), exponent = val(1);
    if (eltOf(exponent) != eltOf(base))
      exponent = CastOp::create(b, loc, tensorType(shp(exponent), eltOf(base)), exponent);
    return define(0, binary<PowOp>(base, exponent));
  }
  if (op == "Equal")
    return define(0, binary<EqualOp>(val(0), val(1), true));
  if (op == "Less")
    return define(0, binary<LessOp>(val(0), val(1), true));
  if (op == "Greater")
    return define(0, binary<GreaterOp>(val(0), val(1), true));
  // Computed operands (a mask compared with <=): the strict comparison or
  // equality, exactly (NaN compares false either way, as ONNX's does).
  if (op == "LessOrEqual" || op == "GreaterOrEqual") {
    Value a = val(0), c = val(1);
    Value strict = op == "LessOrEqual" ? binary<LessOp>(a, c, true) : binary<GreaterOp>(a, c, true);
    return define(0, binary<OrOp>(strict, binary<EqualOp>(a, c, true), true));
  }
  if (op == "And")
    return define(0, binary<AndOp>(val(0), val(1), true));
  if (op == "Or")
    return define(0, binary<OrOp>(val(0), val(1), true));

  // Elementwise unary ops.
  static const std::set<std::string> anyNumeric = {"Neg", "Abs", "Relu"};
  auto unary = [&](auto tag) {
    using OpTy = decltype(tag);
    Value x = val(0);
    Type elt = eltOf(x);
    if (op == "Not"            ? !elt.isInteger(1)
        : anyNumeric.count(op) ? elt.isInteger(1)
                               : !isa<FloatType>(elt))
      fail(op == "Not"            ? std::string("the input must be BOOL")
           : anyNumeric.count(op) ? std::string("the input must be numeric")
                                  : std::string("the input must be floating-point"));
    return define(0, OpTy::create(b, loc, x.getType(), x));
  };
  if (op == "Neg")
    return unary(NegOp());
  if (op == "Abs")
    return unary(AbsOp());
  if (op == "Exp")
    return unary(ExpOp());
  if (op == "Log")
    return unary(LogOp());
  if (op == "Sqrt")
    return unary(SqrtOp());
  if (op == "Reciprocal")
    return unary(ReciprocalOp());
  if (op == "Tanh")
    return unary(TanhOp());
  if (op == "Erf")
    return unary(ErfOp());
  if (op == "Sigmoid")
    return unary(SigmoidOp());
  if (op == "Relu")
    return unary(ReluOp());
  if (op == "Sin")
    return unary(SinOp());
  if (op == "Cos")
    return unary(CosOp());
  if (op == "Not")
    return unary(NotOp());
  if (op == "Gelu") {
    std::string approx = attrString("approximate", "none");
    if (approx != "none" && approx != "tanh")
      fail("approximate must be 'none' or 'tanh', got '" + approx + "'");
    Value x = val(0);
    if (!isa<FloatType>(eltOf(x)))
      fail("the input must be floating-point");
    return define(0, GeluOp::create(b, loc, x.getType(), x, b.getStringAttr(approx)));
  }
  // Composites, built from ops that have kernels on both targets, gradients
  // and partition rules (docs/onnx-ops.md gives each one's gradient).
  auto scalar = [&](float v) {
    return materialize(HostTensor::floats((ElemKind)kindOf(0), {}, {v}), "");
  };
  auto floatInput = [&]() {
    Value x = val(0);
    if (!isa<FloatType>(eltOf(x)))
      fail("the input must be floating-point");
    return x;
  };
  if (op == "LeakyRelu") {
    // x where x > 0, alpha x elsewhere: PyTorch's gradient at 0 is alpha too.
    Value x = floatInput();
    Value alpha = scalar(attrFloat("alpha", 0.01f));
    Value positive = binary<GreaterOp>(x, scalar(0.0f), true);
    return define(0, WhereOp::create(b, loc, x.getType(), positive, x, binary<MulOp>(x, alpha)));
  }
  if (op == "Clip") {
    // Where(x < lo, lo, x), then Where(y > hi, hi, y): the gradient passes
    // where lo <= x <= hi, as torch.clamp's does. Bounds are inputs from
    // opset 11 (either may be absent), attributes before.
    Value y = floatInput();
    auto bound = [&](int k, StringRef name) -> std::optional<Value> {
      if (attr(name))
        return scalar(attrFloat(name, 0.0f));
      if (!hasInput(k))
        return std::nullopt;
      Value v = val(k);
      if (eltOf(v) != eltOf(y))
        fail("the " + name.str() + " bound's element type differs from the input's");
      if (!shp(v).empty())
        fail("the " + name.str() + " bound must be a scalar");
      return v;
    };
    if (std::optional<Value> lo = bound(1, "min"))
      y = WhereOp::create(b, loc, y.getType(), binary<LessOp>(y, *lo, true), *lo, y);
    if (std::optional<Value> hi = bound(2, "max"))
      y = WhereOp::create(b, loc, y.getType(), binary<GreaterOp>(y, *hi, true), *hi, y);
    return define(0, y);
  }
  if (op == "HardSigmoid" || op == "HardSwish") {
    // HardSigmoid: max(0, min(1, alpha x + beta)), clamped as Clip is (the
    // gradient alpha where 0 <= alpha x + beta <= 1, PyTorch's strictly
    // inside); HardSwish: x HardSigmoid(x) with alpha = 1/6, beta = 1/2
    // (MobileNetV3's squeeze-excitation gates and activations), whose
    // gradient is (2x + 3) / 6 inside [-3, 3], 1 above and 0 below.
    Value x = floatInput();
    const bool swish = op == "HardSwish";
    const float alpha = swish ? 1.0f / 6.0f : attrFloat("alpha", 0.2f);
    const float beta = swish ? 0.5f : attrFloat("beta", 0.5f);
    Value t = binary<AddOp>(binary<MulOp>(x, scalar(alpha)), scalar(beta));
    Value zero = scalar(0.0f), one = scalar(1.0f);
    t = WhereOp::create(b, loc, t.getType(), binary<LessOp>(t, zero, true), zero, t);
    t = WhereOp::create(b, loc, t.getType(), binary<GreaterOp>(t, one, true), one, t);
    return define(0, swish ? binary<MulOp>(x, t) : t);
  }
  if (op == "Softplus") {
    // log(1 + e^x) = relu(x) + log(1 + e^-|x|): no overflow for large |x|,
    // and the gradient is sigmoid(x) (0 instead of 1/2 at exactly 0).
    Value x = floatInput();
    Value t = NegOp::create(b, loc, x.getType(), AbsOp::create(b, loc, x.getType(), x));
    t = binary<AddOp>(ExpOp::create(b, loc, x.getType(), t), scalar(1.0f));
    t = LogOp::create(b, loc, x.getType(), t);
    return define(0, binary<AddOp>(ReluOp::create(b, loc, x.getType(), x), t));
  }
  if (op == "OneHot") {
    // Where(indices[..., None] == range(depth), on, off), the range along
    // `axis`; a negative index counts from depth, as ONNX says.
    Value idx = val(0);
    Type it = eltOf(idx);
    if (!it.isInteger(64) && !it.isInteger(32))
      fail("the indices must be int64 or int32");
    const HostTensor &depthT = needConst(1, "depth");
    if (depthT.size() != 1)
      fail("depth must be a scalar");
    const int64_t depth = (int64_t)depthT.asDouble(0);
    if (depth < 1)
      fail("depth must be positive, got " + std::to_string(depth));
    const HostTensor &values = needConst(2, "values");
    if (values.size() != 2)
      fail("values must hold two elements (off, on)");
    const int64_t rank = (int64_t)shp(idx).size();
    int64_t axis = attrInt("axis", -1);
    if (axis < -rank - 1 || axis > rank)
      fail("axis " + std::to_string(axis) + " is out of range for indices of rank " +
           std::to_string(rank));
    if (axis < 0)
      axis += rank + 1;
    const ElemKind ik = kindOf(0);
    SmallVector<int64_t> rangeShape(rank + 1, 1), idxShape(shp(idx));
    rangeShape[axis] = depth;
    idxShape.insert(idxShape.begin() + axis, 1);
    std::vector<int64_t> iota(depth);
    for (int64_t k = 0; k < depth; ++k)
      iota[k] = k;
    // A negative index k hits depth + k: a second comparison, with the range
    // shifted by -depth (no integer arithmetic, which the CUDA target lacks).
    std::vector<int64_t> shifted(iota);
    for (int64_t &k : shifted)
      k -= depth;
    Value idxU = reshape(idx, idxShape);
    Value hit =
        binary<EqualOp>(idxU, materialize(HostTensor::ints(ik, rangeShape, iota), ""), true);
    Value hitNegative =
        binary<EqualOp>(idxU, materialize(HostTensor::ints(ik, rangeShape, shifted), ""), true);
    auto pick = [&](int64_t k) {
      return values.isFloat() ? materialize(HostTensor::floats(values.kind, {}, {values.f[k]}), "")
                              : materialize(HostTensor::ints(values.kind, {}, {values.i[k]}), "");
    };
    Value on = pick(1), off = pick(0);
    SmallVector<int64_t> outShape(shp(idx));
    outShape.insert(outShape.begin() + axis, depth);
    auto outType = tensorType(outShape, eltOf(on));
    off = WhereOp::create(b, loc, outType, hitNegative, on, off);
    return define(0, WhereOp::create(b, loc, outType, hit, on, off));
  }
  if (op == "Identity") {
    if (unmergedNames.count(n.output(0)))
      return; // a parameter of its own (classifyInitializers)
    return define(0, val(0));
  }
  if (op == "Dropout") {
    if (outputUsed(1))
      fail("the Dropout mask output is not supported");
    bool training = hasInput(2) && needConst(2, "training_mode").asInt(0) != 0;
    double ratio = hasInput(1) ? needConst(1, "ratio").asDouble(0) : 0.5;
    if (!training || ratio == 0)
      return define(0, val(0)); // eval mode, or p = 0: the identity
    if (!(ratio > 0 && ratio < 1))
      fail("the dropout probability (ratio) must be in [0, 1), got " +
           llvm::formatv("{0}", ratio).str());
    Value x = val(0);
    if (!isa<FloatType>(eltOf(x)))
      fail("dropout takes a floating-point tensor");
    // Where x holds the batch when this import is one rank's (or one
    // micro-batch's) share of it; codegen adds the share's offset.
    BatchAt at = localBatch() ? batchAt(x) : BatchAt{};
    if (localBatch() && at.dim < 0 && dependsOnInputs(x))
      fail("carve cannot tell which dimension of the dropout's input holds the batch, so "
           "data-parallel ranks and micro-batches would not draw the 1-rank program's masks; "
           "export the model with a dynamic batch (dynamic_axes) or use dp=1 and one "
           "micro-batch");
    return define(0, DropoutOp::create(b, loc, x.getType(), x, b.getF64FloatAttr(ratio),
                                       b.getI64IntegerAttr(dropoutNodes++),
                                       b.getI64IntegerAttr(at.dim), b.getI64IntegerAttr(at.outer)));
  }
  if (op == "Cast" || op == "CastLike") {
    // CastLike: to the element type of its second input (opset 15).
    int to = op == "CastLike" ? (int)kindOf(1) : attrInt("to", 0);
    Value x = val(0);
    Type elt = mlirType(to, "Cast target");
    if (elt == eltOf(x))
      return define(0, x);
    return define(0, CastOp::create(b, loc, tensorType(shp(x), elt), x));
  }
  if (op == "Where") {
    Value c = val(0), x = val(1), y = val(2);
    if (!eltOf(c).isInteger(1))
      fail("the condition must be BOOL");
    if (eltOf(x) != eltOf(y))
      fail("the two branches have different element types");
    ShapeOrError s = broadcastShapes(shp(x), shp(y));
    expect(s);
    s = broadcastShapes(shp(c), s.shape);
    expect(s);
    return define(0, WhereOp::create(b, loc, tensorType(s.shape, eltOf(x)), c, x, y));
  }
  failUnsupported();
}

void Importer::buildContraction(const onnx::NodeProto &n) {
  const std::string &op = n.op_type();

  if (op == "Einsum")
    return define(0, einsum(attrString("equation", "")));
  if (op == "CumSum") {
    // A product with a constant triangle of ones along `axis` (moved last):
    // y[.., j] = sum over i <= j (exclusive: i < j; reverse: i >= j) of
    // x[.., i]. Integers go through float32: exact while every partial sum
    // stays below 2^24 in magnitude.
    Value x = val(0);
    Type elt = eltOf(x);
    const bool isFloat = isa<FloatType>(elt);
    if (!isFloat && !elt.isInteger(64) && !elt.isInteger(32))
      fail("the input must be floating-point, int64 or int32");
    const HostTensor &axisT = needConst(1, "axis");
    if (axisT.size() != 1)
      fail("axis must be a scalar");
    const int64_t rank = (int64_t)shp(x).size();
    if (rank == 0)
      fail("the input must have at least one dimension");
    const int64_t axis = normAxis(axisT.asInt(0), rank);
    const bool exclusive = attrInt("exclusive", 0) != 0, reverse = attrInt("reverse", 0) != 0;
    const int64_t len = shp(x)[axis];
    if (len > 2048)
      fail("a cumulative sum over " + std::to_string(len) +
           " elements: carve builds it as a product with a " + std::to_string(len) + "x" +
           std::to_string(len) + " constant, and allows at most 2048");
    Type f = isFloat ? elt : b.getF32Type();
    Value y = isFloat ? x : CastOp::create(b, loc, tensorType(shp(x), f), x).getResult();
    SmallVector<int64_t> perm, moved;
    for (int64_t d = 0; d < rank; ++d)
      if (d != axis)
        perm.push_back(d);
    perm.push_back(axis);
    for (int64_t d : perm)
      moved.push_back(shp(x)[d]);
    const bool identity = axis == rank - 1;
    if (!identity)
      y = TransposeOp::create(b, loc, tensorType(moved, f), y, b.getDenseI64ArrayAttr(perm));
    std::vector<double> tri(len * len, 0.0);
    for (int64_t i = 0; i < len; ++i)
      for (int64_t j = 0; j < len; ++j) {
        bool in = reverse ? (exclusive ? i > j : i >= j) : (exclusive ? i < j : i <= j);
        tri[i * len + j] = in ? 1.0 : 0.0;
      }
    const ElemKind fk = isFloat ? kindOf(0) : ElemKind::F32;
    Value t = materialize(HostTensor::floats(fk, {len, len}, tri), "");
    y = MatmulOp::create(b, loc, tensorType(moved, f), y, t);
    if (!identity) {
      SmallVector<int64_t> back(rank);
      for (int64_t d = 0; d < rank; ++d)
        back[perm[d]] = d;
      y = TransposeOp::create(b, loc, tensorType(shp(x), f), y, b.getDenseI64ArrayAttr(back));
    }
    if (!isFloat)
      y = CastOp::create(b, loc, tensorType(shp(x), elt), y);
    return define(0, y);
  }

  if (op == "MatMul") {
    Value l = val(0), r = val(1);
    if (eltOf(l) != eltOf(r))
      fail("operand element types differ");
    ShapeOrError s = matmulShape(shp(l), shp(r));
    expect(s);
    return define(0, MatmulOp::create(b, loc, tensorType(s.shape, eltOf(l)), l, r));
  }
  if (op == "Gemm") {
    Value a = val(0), w = val(1);
    if (shp(a).size() != 2 || shp(w).size() != 2)
      fail("Gemm needs 2-D A and B");
    auto transpose2d = [&](Value v) {
      SmallVector<int64_t> s = {shp(v)[1], shp(v)[0]};
      return TransposeOp::create(b, loc, tensorType(s, eltOf(v)), v, b.getDenseI64ArrayAttr({1, 0}))
          .getResult();
    };
    if (attrInt("transA", 0))
      a = transpose2d(a);
    if (attrInt("transB", 0))
      w = transpose2d(w);
    ShapeOrError s = matmulShape(shp(a), shp(w));
    expect(s);
    Value y = MatmulOp::create(b, loc, tensorType(s.shape, eltOf(a)), a, w);
    auto scalar = [&](float v) {
      return materialize(HostTensor::floats((ElemKind)kindOf(0), {}, {v}), "");
    };
    float alpha = attrFloat("alpha", 1.0f), beta = attrFloat("beta", 1.0f);
    if (alpha != 1.0f)
      y = binary<MulOp>(y, scalar(alpha));
    if (hasInput(2) && beta != 0.0f) {
      Value c = val(2);
      if (beta != 1.0f)
        c = binary<MulOp>(c, scalar(beta));
      y = binary<AddOp>(y, c);
    }
    return define(0, y);
  }
  failUnsupported();
}

/// Einsum as transposes, reshapes, sums and batched matrix products: each
/// operand's labels that appear nowhere else are summed out, then operands
/// are contracted left to right (labels both share and still need are batch
/// dimensions, labels both share and no longer need are contracted), and
/// the result is transposed to the output's order. `...` stands for the
/// same dimensions in every operand (right-aligned, equal sizes).
Value Importer::einsum(const std::string &equation) {
  std::string eq;
  for (char c : equation)
    if (c != ' ')
      eq += c;
  const size_t arrow = eq.find("->");
  std::string lhs = eq.substr(0, arrow), rhs;
  std::vector<std::string> terms;
  for (size_t start = 0;;) {
    size_t comma = lhs.find(',', start);
    terms.push_back(lhs.substr(start, comma == std::string::npos ? comma : comma - start));
    if (comma == std::string::npos)
      break;
    start = comma + 1;
  }
  if ((int)terms.size() != node->input_size())
    fail("the equation '" + equation + "' has " + std::to_string(terms.size()) +
         " operand(s), the node " + std::to_string(node->input_size()));
  std::vector<Value> vals;
  for (size_t k = 0; k < terms.size(); ++k) {
    vals.push_back(val((int)k));
    if (!isa<FloatType>(eltOf(vals.back())) || eltOf(vals.back()) != eltOf(vals[0]))
      fail("the operands must be floating-point, of one element type");
  }
  // `...`: digits stand for its dimensions, right-aligned over the operands.
  int64_t ellipsis = 0;
  for (size_t k = 0; k < terms.size(); ++k) {
    size_t dots = terms[k].find("...");
    int64_t letters = (int64_t)terms[k].size() - (dots == std::string::npos ? 0 : 3);
    int64_t rank = (int64_t)shp(vals[k]).size();
    if (dots == std::string::npos ? letters != rank : letters > rank)
      fail("operand " + std::to_string(k) + " '" + terms[k] + "' does not match its rank " +
           std::to_string(rank));
    if (dots != std::string::npos)
      ellipsis = std::max(ellipsis, rank - letters);
  }
  if (ellipsis > 10)
    fail("'...' stands for more than 10 dimensions");
  auto expand = [&](std::string t, int64_t rank) {
    size_t dots = t.find("...");
    if (dots == std::string::npos)
      return t;
    int64_t r = rank - ((int64_t)t.size() - 3);
    std::string digits;
    for (int64_t d = ellipsis - r; d < ellipsis; ++d)
      digits += (char)('0' + d);
    return t.substr(0, dots) + digits + t.substr(dots + 3);
  };
  for (size_t k = 0; k < terms.size(); ++k)
    terms[k] = expand(terms[k], (int64_t)shp(vals[k]).size());
  std::map<char, int64_t> size;
  std::map<char, int> uses;
  for (size_t k = 0; k < terms.size(); ++k) {
    for (size_t i = 0; i < terms[k].size(); ++i) {
      char c = terms[k][i];
      if (!std::isalpha((unsigned char)c) && !std::isdigit((unsigned char)c))
        fail("the equation '" + equation + "' has an unexpected character '" + std::string(1, c) +
             "'");
      if (terms[k].find(c) != i)
        fail("operand " + std::to_string(k) + " repeats the index '" + std::string(1, c) +
             "' (a diagonal); carve does not support that");
      int64_t d = shp(vals[k])[i];
      auto [it, fresh] = size.emplace(c, d);
      if (!fresh && it->second != d)
        fail((std::isdigit((unsigned char)c) ? std::string("a dimension of '...'")
                                             : "index '" + std::string(1, c) + "'") +
             " is " + std::to_string(it->second) + " in one operand and " + std::to_string(d) +
             " in another (broadcasting is not supported)");
      ++uses[c];
    }
  }
  if (arrow == std::string::npos) {
    // Implicit output: the ellipsis, then the labels used once, sorted.
    for (int64_t d = 0; d < ellipsis; ++d)
      rhs += (char)('0' + d);
    for (auto &[c, u] : uses)
      if (u == 1 && std::isalpha((unsigned char)c))
        rhs += c;
  } else {
    rhs = eq.substr(arrow + 2);
    size_t dots = rhs.find("...");
    if (dots != std::string::npos) {
      std::string digits;
      for (int64_t d = 0; d < ellipsis; ++d)
        digits += (char)('0' + d);
      rhs = rhs.substr(0, dots) + digits + rhs.substr(dots + 3);
    }
    for (size_t i = 0; i < rhs.size(); ++i)
      if (!size.count(rhs[i]) || rhs.find(rhs[i]) != i)
        fail("output index '" + std::string(1, rhs[i]) + "' is not an operand's, or repeats");
  }

  auto has = [](const std::string &s, char c) { return s.find(c) != std::string::npos; };
  auto shapeOf = [&](const std::string &labels) {
    SmallVector<int64_t> out;
    for (char c : labels)
      out.push_back(size[c]);
    return out;
  };
  auto product = [&](const std::string &labels) {
    int64_t p = 1;
    for (char c : labels)
      p *= size[c];
    return p;
  };
  // Sums `x` (labels `l`) over the labels not in `keep`.
  auto sumOut = [&](Value x, std::string &l, const std::string &keep) {
    SmallVector<int64_t> axes;
    std::string left;
    for (size_t i = 0; i < l.size(); ++i) {
      if (has(keep, l[i]))
        left += l[i];
      else
        axes.push_back((int64_t)i);
    }
    if (axes.empty())
      return x;
    l = left;
    return (Value)ReduceSumOp::create(b, loc, tensorType(shapeOf(left), eltOf(x)), x,
                                      b.getDenseI64ArrayAttr(axes), b.getBoolAttr(false));
  };
  // `x` (labels `l`) with its dimensions in the order of `to`.
  auto permute = [&](Value x, const std::string &l, const std::string &to) {
    if (l == to)
      return x;
    SmallVector<int64_t> perm;
    for (char c : to)
      perm.push_back((int64_t)l.find(c));
    return (Value)TransposeOp::create(b, loc, tensorType(shapeOf(to), eltOf(x)), x,
                                      b.getDenseI64ArrayAttr(perm));
  };
  auto needed = [&](size_t from) {
    std::string keep = rhs;
    for (size_t k = from; k < terms.size(); ++k)
      keep += terms[k];
    return keep;
  };
  std::string l = terms[0];
  Value cur = sumOut(vals[0], l, needed(1));
  for (size_t k = 1; k < terms.size(); ++k) {
    const std::string keep = needed(k + 1);
    std::string r = terms[k];
    std::string others = keep + l;
    Value rv = sumOut(vals[k], r, others);
    cur = sumOut(cur, l, keep + r);
    std::string batch, contracted, aOnly, bOnly;
    for (char c : l)
      (has(r, c) ? (has(keep, c) ? batch : contracted) : aOnly) += c;
    for (char c : r)
      if (!has(l, c))
        bOnly += c;
    const int64_t bt = product(batch), m = product(aOnly), kk = product(contracted),
                  nn = product(bOnly);
    SmallVector<int64_t> ashape, bshape, cshape;
    if (!batch.empty())
      ashape.push_back(bt), bshape.push_back(bt), cshape.push_back(bt);
    ashape.append({m, kk});
    bshape.append({kk, nn});
    cshape.append({m, nn});
    Value a = reshape(permute(cur, l, batch + aOnly + contracted), ashape);
    Value bb = reshape(permute(rv, r, batch + contracted + bOnly), bshape);
    Value c = MatmulOp::create(b, loc, tensorType(cshape, eltOf(a)), a, bb);
    l = batch + aOnly + bOnly;
    cur = reshape(c, shapeOf(l));
  }
  cur = sumOut(cur, l, rhs);
  return permute(cur, l, rhs);
}

void Importer::buildNormalization(const onnx::NodeProto &n) {
  const std::string &op = n.op_type();

  if (op == "ReduceSum" || op == "ReduceMean" || op == "ReduceMax") {
    Value x = val(0);
    SmallVector<int64_t> axes = reduceAxes(n, shp(x).size());
    if (axes.empty())
      return define(0, x);
    bool keep = attrInt("keepdims", 1) != 0;
    ShapeOrError s = reduceShape(shp(x), axes, keep);
    expect(s);
    auto type = tensorType(s.shape, eltOf(x));
    auto axesAttr = b.getDenseI64ArrayAttr(axes);
    auto keepAttr = b.getBoolAttr(keep);
    if (op == "ReduceSum")
      return define(0, ReduceSumOp::create(b, loc, type, x, axesAttr, keepAttr));
    if (op == "ReduceMean") {
      if (!isa<FloatType>(eltOf(x)))
        fail("ReduceMean of integers is not supported");
      return define(0, ReduceMeanOp::create(b, loc, type, x, axesAttr, keepAttr));
    }
    return define(0, ReduceMaxOp::create(b, loc, type, x, axesAttr, keepAttr));
  }
  if (op == "TopK") {
    // k rounds of: the maximum along `axis` (carve.reduce_max, whose
    // gradient goes to the maximum), its first position (the smallest index
    // holding it: ONNX's and PyTorch's order for ties), then that position
    // masked with -inf for the next round. Values come out sorted; indices
    // are computed in float (exact below 2^24) and cast to int64.
    Value x = val(0);
    if (!isa<FloatType>(eltOf(x)))
      fail("the input must be floating-point");
    const HostTensor &kT = needConst(1, "K");
    if (kT.size() != 1)
      fail("K must hold one value");
    const int64_t rank = (int64_t)shp(x).size();
    if (rank == 0)
      fail("the input must have at least one dimension");
    const int64_t axis = normAxis(attrInt("axis", -1), rank), len = shp(x)[axis];
    const int64_t k = kT.asInt(0);
    if (k < 1 || k > len)
      fail("K is " + std::to_string(k) + ", the axis has " + std::to_string(len) + " elements");
    if (k > 16)
      fail("K is " + std::to_string(k) + "; carve builds TopK from K maxima and allows at most 16");
    const bool largest = attrInt("largest", 1) != 0;
    const ElemKind fk = kindOf(0);
    auto scalarF = [&](double v) { return materialize(HostTensor::floats(fk, {}, {v}), ""); };
    SmallVector<int64_t> iotaShape(rank, 1), keepShape(shp(x));
    iotaShape[axis] = len;
    keepShape[axis] = 1;
    std::vector<double> iota(len);
    for (int64_t i = 0; i < len; ++i)
      iota[i] = (double)i;
    Value positions = materialize(HostTensor::floats(fk, iotaShape, iota), "");
    Value beyond = scalarF((double)len), hidden = scalarF(-INFINITY);
    auto axesAttr = b.getDenseI64ArrayAttr({axis});
    auto keepType = tensorType(keepShape, eltOf(x));
    auto max = [&](Value v) {
      return (Value)ReduceMaxOp::create(b, loc, keepType, v, axesAttr, b.getBoolAttr(true));
    };
    auto neg = [&](Value v) { return (Value)NegOp::create(b, loc, v.getType(), v); };
    Value cur = largest ? x : neg(x);
    SmallVector<Value> values, indices;
    for (int64_t j = 0; j < k; ++j) {
      Value m = max(cur);
      Value where =
          WhereOp::create(b, loc, x.getType(), binary<EqualOp>(cur, m, true), positions, beyond);
      Value first = neg(max(neg(where)));
      values.push_back(m);
      indices.push_back(first);
      if (j + 1 < k)
        cur = WhereOp::create(b, loc, x.getType(), binary<EqualOp>(positions, first, true), hidden,
                              cur);
    }
    SmallVector<int64_t> outShape(shp(x));
    outShape[axis] = k;
    auto join = [&](SmallVector<Value> &parts) {
      if (parts.size() == 1)
        return parts.front();
      return (Value)ConcatOp::create(b, loc, tensorType(outShape, eltOf(x)), parts,
                                     b.getI64IntegerAttr(axis));
    };
    Value v = join(values);
    define(0, largest ? v : neg(v));
    if (node->output_size() > 1)
      define(1, CastOp::create(b, loc, tensorType(outShape, b.getI64Type()), join(indices)));
    return;
  }
  if (op == "ReduceL2") {
    // sqrt(sum(x^2)) (F.normalize, torch.norm): the gradient x / norm, NaN
    // for an all-zero slice (PyTorch's is 0 there).
    Value x = val(0);
    if (!isa<FloatType>(eltOf(x)))
      fail("the input must be floating-point");
    SmallVector<int64_t> axes = reduceAxes(n, shp(x).size());
    bool keep = attrInt("keepdims", 1) != 0;
    if (axes.empty())
      return define(0, AbsOp::create(b, loc, x.getType(), x));
    ShapeOrError s = reduceShape(shp(x), axes, keep);
    expect(s);
    auto type = tensorType(s.shape, eltOf(x));
    Value sum = ReduceSumOp::create(b, loc, type, binary<MulOp>(x, x), b.getDenseI64ArrayAttr(axes),
                                    b.getBoolAttr(keep));
    return define(0, SqrtOp::create(b, loc, type, sum));
  }
  if (op == "Softmax" || op == "LogSoftmax") {
    Value x = val(0);
    if (!isa<FloatType>(eltOf(x)))
      fail("the input must be floating-point");
    int64_t axis = normAxis(attrInt("axis", -1), shp(x).size());
    if (op == "Softmax")
      return define(0, SoftmaxOp::create(b, loc, x.getType(), x, b.getI64IntegerAttr(axis)));
    return define(0, LogSoftmaxOp::create(b, loc, x.getType(), x, b.getI64IntegerAttr(axis)));
  }
  if (op == "LayerNormalization") {
    if (outputUsed(1) || outputUsed(2))
      fail("the Mean and InvStdDev outputs are not supported");
    Value x = val(0);
    if (!isa<FloatType>(eltOf(x)))
      fail("the input must be floating-point");
    int64_t axis = normAxis(attrInt("axis", -1), shp(x).size());
    Value scale = hasInput(1) ? val(1) : Value();
    Value bias = hasInput(2) ? val(2) : Value();
    ArrayRef<int64_t> norm = shp(x).drop_front(axis);
    for (Value p : {scale, bias})
      if (p && !broadcastsTo(shp(p), norm))
        fail("scale/bias shape " + formatShape(shp(p)) +
             " does not match the normalized dimensions " + formatShape(norm));
    if (scale && shp(scale) != norm)
      scale = ExpandOp::create(b, loc, tensorType(norm, eltOf(scale)), scale);
    if (bias && shp(bias) != norm)
      bias = ExpandOp::create(b, loc, tensorType(norm, eltOf(bias)), bias);
    return define(0, LayerNormOp::create(b, loc, x.getType(), x, scale, bias,
                                         b.getI64IntegerAttr(axis),
                                         b.getF32FloatAttr(attrFloat("epsilon", 1e-5f))));
  }
  if (op == "BatchNormalization") {
    Value x = val(0);
    if (shp(x).size() < 2)
      fail("the input needs rank >= 2");
    // Opset 13 has no training_mode: the optional statistics outputs mark it.
    int present = 0;
    for (const auto &o : n.output())
      present += !o.empty();
    bool training = opset >= 14 ? attrInt("training_mode", 0) != 0 : present > 1;
    if (outputUsed(3) || outputUsed(4))
      fail("the saved_mean / saved_var outputs are not supported");
    if (!training && (outputUsed(1) || outputUsed(2)))
      fail("running statistics outputs need training_mode=1");
    if (!training && inferenceBatchNorms++ == 0)
      firstInferenceBatchNorm = n.name();
    SmallVector<Value> ops = {x, val(1), val(2), val(3), val(4)};
    for (int k = 1; k < 5; ++k)
      if (shp(ops[k]) != ArrayRef<int64_t>{shp(x)[1]})
        fail("input " + std::to_string(k) + " must have shape [" + std::to_string(shp(x)[1]) + "]");
    auto chan = ops[3].getType();
    auto bn = BatchNormOp::create(
        b, loc, TypeRange{x.getType(), chan, chan}, ops[0], ops[1], ops[2], ops[3], ops[4],
        b.getF32FloatAttr(attrFloat("epsilon", 1e-5f)),
        b.getF32FloatAttr(attrFloat("momentum", 0.9f)), b.getBoolAttr(training));
    define(0, bn.getResult());
    define(1, bn.getNewRunningMean());
    define(2, bn.getNewRunningVar());
    return;
  }
  failUnsupported();
}

void Importer::buildLoss(const onnx::NodeProto &n) {
  const std::string &op = n.op_type();

  if (op == "SoftmaxCrossEntropyLoss" || op == "NegativeLogLikelihoodLoss") {
    if (hasInput(2))
      fail("class weights are not supported");
    if (outputUsed(1))
      fail("the log_prob output is not supported");
    Value logits = val(0), targets = val(1);
    if (op == "NegativeLogLikelihoodLoss") {
      // NLL(log_softmax(x)) is cross-entropy of x; carve keeps it whole.
      auto ls = logits.getDefiningOp<LogSoftmaxOp>();
      if (!ls || ls.getAxis() != 1)
        fail("NegativeLogLikelihoodLoss is supported on the output of LogSoftmax over "
             "axis 1 only");
      logits = ls.getInput();
    }
    if (!isa<FloatType>(eltOf(logits)))
      fail("the scores must be floating-point");
    if (!eltOf(targets).isInteger(64) && !eltOf(targets).isInteger(32))
      fail("the labels must be INT32 or INT64");
    std::string red = attrString("reduction", "mean");
    if (red != "mean" && red != "sum" && red != "none")
      fail("reduction '" + red + "' is not one of mean, sum, none");
    ShapeOrError s = crossEntropyShape(shp(logits), shp(targets), red != "none");
    expect(s);
    IntegerAttr ignore;
    if (attr("ignore_index"))
      ignore = b.getI64IntegerAttr(attrInt("ignore_index", -100));
    return define(0, CrossEntropyOp::create(b, loc, tensorType(s.shape, eltOf(logits)), logits,
                                            targets, b.getStringAttr(red), ignore));
  }
  failUnsupported();
}

} // namespace carve::frontend
