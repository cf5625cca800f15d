//===- CarveOps.cpp - verifiers and folders of the carve ops --------------===//
//
// Every verifier checks static shapes and element types through the shape rules
// in Shapes.h, the same rules the importer uses to type the ops it builds.
//
//===----------------------------------------------------------------------===//

#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"
#include "dialects/carve/Shapes.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/DialectImplementation.h"
#include "llvm/ADT/Sequence.h"

using namespace mlir;
using namespace carve;

static RankedTensorType tensorType(Value v) {
  return cast<RankedTensorType>(v.getType());
}
static ArrayRef<int64_t> shapeOf(Value v) { return tensorType(v).getShape(); }
static Type elementOf(Value v) { return tensorType(v).getElementType(); }

/// Every operand and result of a carve op has a static shape.
static LogicalResult verifyStatic(Operation *op) {
  for (Value v : op->getOperands())
    if (!tensorType(v).hasStaticShape())
      return op->emitOpError("operand of type ") << v.getType() << " has a dynamic shape";
  for (Value v : op->getResults())
    if (!tensorType(v).hasStaticShape())
      return op->emitOpError("result of type ") << v.getType() << " has a dynamic shape";
  return success();
}

/// Checks a computed shape against the result's declared shape.
static LogicalResult expectShape(Operation *op, const ShapeOrError &shape, Value result) {
  if (!shape.ok())
    return op->emitOpError(shape.error);
  if (ArrayRef<int64_t>(shape.shape) != shapeOf(result))
    return op->emitOpError("result shape ")
           << formatShape(shapeOf(result)) << " should be " << formatShape(shape.shape);
  return success();
}

static LogicalResult expectFloat(Operation *op, Value v, StringRef what) {
  if (!isa<FloatType>(elementOf(v)))
    return op->emitOpError(what) << " must have a floating-point element type, got "
                                 << elementOf(v);
  return success();
}

static LogicalResult expectSameElement(Operation *op, Value a, Value b) {
  if (elementOf(a) != elementOf(b))
    return op->emitOpError("element types differ: ")
           << elementOf(a) << " vs " << elementOf(b);
  return success();
}

static bool isBool(Type t) { return t.isInteger(1); }

//===----------------------------------------------------------------------===//
// Constants and casts
//===----------------------------------------------------------------------===//

LogicalResult ConstantOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  if (getValue().getType() != getType())
    return emitOpError("value type ") << getValue().getType() << " differs from result type "
                                      << getType();
  return success();
}

OpFoldResult ConstantOp::fold(FoldAdaptor) { return getValue(); }

LogicalResult CastOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  if (shapeOf(getInput()) != shapeOf(getResult()))
    return emitOpError("cast cannot change the shape");
  return success();
}

//===----------------------------------------------------------------------===//
// Elementwise ops
//===----------------------------------------------------------------------===//

namespace {
enum class BinaryKind { Numeric, Compare, Logical };
} // namespace

static LogicalResult verifyBinary(Operation *op, BinaryKind kind) {
  if (failed(verifyStatic(op)))
    return failure();
  Value lhs = op->getOperand(0), rhs = op->getOperand(1), res = op->getResult(0);
  if (failed(expectSameElement(op, lhs, rhs)))
    return failure();
  if (failed(expectShape(op, broadcastShapes(shapeOf(lhs), shapeOf(rhs)), res)))
    return failure();
  Type resElt = elementOf(res);
  switch (kind) {
  case BinaryKind::Numeric:
    if (resElt != elementOf(lhs))
      return op->emitOpError("result element type must equal the operands'");
    if (isBool(resElt))
      return op->emitOpError("arithmetic on i1 is not defined; use carve.and/carve.or");
    break;
  case BinaryKind::Compare:
    if (!isBool(resElt))
      return op->emitOpError("comparison result must be i1");
    break;
  case BinaryKind::Logical:
    if (!isBool(resElt) || !isBool(elementOf(lhs)))
      return op->emitOpError("logical ops take and return i1");
    break;
  }
  return success();
}

LogicalResult AddOp::verify() { return verifyBinary(*this, BinaryKind::Numeric); }
LogicalResult SubOp::verify() { return verifyBinary(*this, BinaryKind::Numeric); }
LogicalResult MulOp::verify() { return verifyBinary(*this, BinaryKind::Numeric); }
LogicalResult DivOp::verify() { return verifyBinary(*this, BinaryKind::Numeric); }
LogicalResult PowOp::verify() { return verifyBinary(*this, BinaryKind::Numeric); }
LogicalResult MaximumOp::verify() { return verifyBinary(*this, BinaryKind::Numeric); }
LogicalResult MinimumOp::verify() { return verifyBinary(*this, BinaryKind::Numeric); }
LogicalResult EqualOp::verify() { return verifyBinary(*this, BinaryKind::Compare); }
LogicalResult LessOp::verify() { return verifyBinary(*this, BinaryKind::Compare); }
LogicalResult GreaterOp::verify() { return verifyBinary(*this, BinaryKind::Compare); }
LogicalResult AndOp::verify() { return verifyBinary(*this, BinaryKind::Logical); }
LogicalResult OrOp::verify() { return verifyBinary(*this, BinaryKind::Logical); }

/// Float-only unary math; relu, neg and abs also take integers.
static LogicalResult verifyUnary(Operation *op, bool floatOnly) {
  if (failed(verifyStatic(op)))
    return failure();
  Type elt = elementOf(op->getResult(0));
  if (floatOnly && !isa<FloatType>(elt))
    return op->emitOpError("needs a floating-point element type, got ") << elt;
  if (!floatOnly && isBool(elt))
    return op->emitOpError("is not defined on i1");
  return success();
}

LogicalResult NegOp::verify() { return verifyUnary(*this, false); }
LogicalResult AbsOp::verify() { return verifyUnary(*this, false); }
LogicalResult ReluOp::verify() { return verifyUnary(*this, false); }
LogicalResult ExpOp::verify() { return verifyUnary(*this, true); }
LogicalResult LogOp::verify() { return verifyUnary(*this, true); }
LogicalResult SqrtOp::verify() { return verifyUnary(*this, true); }
LogicalResult RsqrtOp::verify() { return verifyUnary(*this, true); }
LogicalResult ReciprocalOp::verify() { return verifyUnary(*this, true); }
LogicalResult TanhOp::verify() { return verifyUnary(*this, true); }
LogicalResult ErfOp::verify() { return verifyUnary(*this, true); }
LogicalResult SigmoidOp::verify() { return verifyUnary(*this, true); }
LogicalResult SinOp::verify() { return verifyUnary(*this, true); }
LogicalResult CosOp::verify() { return verifyUnary(*this, true); }
LogicalResult SiluOp::verify() { return verifyUnary(*this, true); }

LogicalResult NotOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  if (!isBool(elementOf(getResult())))
    return emitOpError("takes and returns i1");
  return success();
}

LogicalResult GeluOp::verify() {
  if (failed(verifyUnary(*this, true)))
    return failure();
  if (getApproximate() != "none" && getApproximate() != "tanh")
    return emitOpError("approximate must be \"none\" or \"tanh\", got \"")
           << getApproximate() << "\"";
  return success();
}

LogicalResult DropoutOp::verify() {
  if (failed(verifyUnary(*this, true)))
    return failure();
  const double p = getP().convertToDouble();
  if (!(p >= 0 && p < 1))
    return emitOpError("p must be in [0, 1), got ") << p;
  if (nodeIndex() < 0 || nodeIndex() > 0xffffffffLL)
    return emitOpError("node must be in [0, 2^32), got ") << nodeIndex();
  const int64_t rank = cast<RankedTensorType>(getInput().getType()).getRank();
  if (batchDim() < -1 || batchDim() >= rank)
    return emitOpError("batch_dim ") << batchDim() << " is out of range for rank " << rank;
  if (batchOuter() < 1)
    return emitOpError("batch_outer must be at least 1, got ") << batchOuter();
  return success();
}

LogicalResult EvalSelectOp::verify() { return verifyStatic(*this); }

LogicalResult ReplicaSumOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  Type et = cast<RankedTensorType>(getInput().getType()).getElementType();
  if (!et.isF32() && !et.isF64())
    return emitOpError("sums f32 or f64 tensors, got ") << getInput().getType();
  return success();
}

LogicalResult AssignOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  auto arg = dyn_cast<BlockArgument>(getBuffer());
  auto fn = arg ? dyn_cast<func::FuncOp>(arg.getOwner()->getParentOp()) : func::FuncOp();
  if (!fn || !fn.getArgAttr(arg.getArgNumber(), kBufferAttr))
    return emitOpError("the buffer must be a function argument that holds a model buffer (")
           << kBufferAttr << ")";
  return success();
}

LogicalResult WhereOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  if (!isBool(elementOf(getCondition())))
    return emitOpError("condition must be i1");
  if (failed(expectSameElement(*this, getOnTrue(), getOnFalse())) ||
      failed(expectSameElement(*this, getOnTrue(), getResult())))
    return failure();
  ShapeOrError s = broadcastShapes(shapeOf(getOnTrue()), shapeOf(getOnFalse()));
  if (s.ok())
    s = broadcastShapes(shapeOf(getCondition()), s.shape);
  return expectShape(*this, s, getResult());
}

//===----------------------------------------------------------------------===//
// Contractions, reductions and normalizations
//===----------------------------------------------------------------------===//

LogicalResult MatmulOp::verify() {
  if (failed(verifyStatic(*this)) || failed(expectSameElement(*this, getLhs(), getRhs())) ||
      failed(expectSameElement(*this, getLhs(), getResult())))
    return failure();
  if (isBool(elementOf(getLhs())))
    return emitOpError("is not defined on i1");
  return expectShape(*this, matmulShape(shapeOf(getLhs()), shapeOf(getRhs())), getResult());
}

template <typename ReduceOp>
static LogicalResult verifyReduce(ReduceOp op) {
  if (failed(verifyStatic(op)) ||
      failed(expectSameElement(op, op.getInput(), op.getResult())))
    return failure();
  return expectShape(op, reduceShape(shapeOf(op.getInput()), op.getAxes(), op.getKeepDims()),
                     op.getResult());
}

LogicalResult ReduceSumOp::verify() { return verifyReduce(*this); }
LogicalResult ReduceMeanOp::verify() {
  if (failed(expectFloat(*this, getInput(), "input")))
    return failure();
  return verifyReduce(*this);
}
LogicalResult ReduceMaxOp::verify() { return verifyReduce(*this); }

static LogicalResult verifyAxisOp(Operation *op, int64_t axis) {
  if (failed(verifyStatic(op)) || failed(expectFloat(op, op->getOperand(0), "input")))
    return failure();
  int64_t rank = shapeOf(op->getOperand(0)).size();
  if (axis < 0 || axis >= rank)
    return op->emitOpError("axis ") << axis << " is out of range for rank " << rank;
  return success();
}

LogicalResult SoftmaxOp::verify() { return verifyAxisOp(*this, getAxis()); }
LogicalResult LogSoftmaxOp::verify() { return verifyAxisOp(*this, getAxis()); }

/// `scale` / `bias` of a normalization are shaped like the normalized dims.
static LogicalResult verifyNormParam(Operation *op, Value param, int64_t axis,
                                     StringRef what) {
  if (!param)
    return success();
  ArrayRef<int64_t> in = shapeOf(op->getOperand(0));
  if (shapeOf(param) != in.drop_front(axis))
    return op->emitOpError(what) << " shape " << formatShape(shapeOf(param))
                                 << " should be " << formatShape(in.drop_front(axis));
  return expectSameElement(op, op->getOperand(0), param);
}

LogicalResult LayerNormOp::verify() {
  if (failed(verifyAxisOp(*this, getAxis())) ||
      failed(expectShape(*this, {SmallVector<int64_t>(shapeOf(getInput())), ""}, getResult())))
    return failure();
  if (failed(verifyNormParam(*this, getScale(), getAxis(), "scale")))
    return failure();
  return verifyNormParam(*this, getBias(), getAxis(), "bias");
}

LogicalResult RmsNormOp::verify() {
  if (failed(verifyAxisOp(*this, getAxis())) ||
      failed(expectShape(*this, {SmallVector<int64_t>(shapeOf(getInput())), ""}, getResult())))
    return failure();
  return verifyNormParam(*this, getScale(), getAxis(), "scale");
}

/// rotary and rotary_grad: a float tensor whose last dimension is even, cos
/// and sin of its element type broadcasting to it, the result shaped like it.
static LogicalResult verifyRotary(Operation *op) {
  if (failed(verifyStatic(op)))
    return failure();
  Value x = op->getOperand(0), res = op->getResult(0);
  if (failed(expectFloat(op, x, "input")))
    return failure();
  for (unsigned k = 1; k < 3; ++k) {
    Value t = op->getOperand(k);
    if (failed(expectSameElement(op, x, t)))
      return failure();
    ShapeOrError s = broadcastShapes(shapeOf(x), shapeOf(t));
    if (!s.ok() || ArrayRef<int64_t>(s.shape) != shapeOf(x))
      return op->emitOpError(k == 1 ? "cos" : "sin")
             << " of shape " << formatShape(shapeOf(t)) << " does not broadcast to the input's "
             << formatShape(shapeOf(x));
  }
  ArrayRef<int64_t> xs = shapeOf(x);
  if (xs.empty() || xs.back() % 2 != 0)
    return op->emitOpError("the input's last dimension must be even (rotate_half splits it in "
                           "two), got shape ")
           << formatShape(xs);
  if (elementOf(res) != elementOf(x))
    return op->emitOpError("result element type must equal the input's");
  return expectShape(op, {SmallVector<int64_t>(xs), ""}, res);
}

LogicalResult RotaryOp::verify() { return verifyRotary(*this); }
LogicalResult RotaryGradOp::verify() { return verifyRotary(*this); }

LogicalResult AttentionOp::verify() {
  if (failed(verifyStatic(*this)) || failed(expectFloat(*this, getQuery(), "query")) ||
      failed(expectSameElement(*this, getQuery(), getKey())) ||
      failed(expectSameElement(*this, getQuery(), getValue())))
    return failure();
  ShapeOrError s = attentionShape(shapeOf(getQuery()), shapeOf(getKey()), shapeOf(getValue()));
  if (failed(expectShape(*this, s, getResult())))
    return failure();
  if (Value mask = getMask()) {
    ArrayRef<int64_t> q = shapeOf(getQuery()), k = shapeOf(getKey());
    SmallVector<int64_t> scores(q.drop_back());
    scores.push_back(k[k.size() - 2]);
    if (!broadcastsTo(shapeOf(mask), scores))
      return emitOpError("mask shape ") << formatShape(shapeOf(mask))
                                        << " does not broadcast to the scores "
                                        << formatShape(scores);
    if (failed(expectSameElement(*this, mask, getQuery())))
      return failure();
  }
  return success();
}

//===----------------------------------------------------------------------===//
// Data movement
//===----------------------------------------------------------------------===//

LogicalResult ReshapeOp::verify() {
  if (failed(verifyStatic(*this)) || failed(expectSameElement(*this, getInput(), getResult())))
    return failure();
  if (numElements(shapeOf(getInput())) != numElements(shapeOf(getResult())))
    return emitOpError("cannot reshape ")
           << formatShape(shapeOf(getInput())) << " to " << formatShape(shapeOf(getResult()))
           << ": element counts differ";
  return success();
}

OpFoldResult ReshapeOp::fold(FoldAdaptor adaptor) {
  if (getInput().getType() == getType())
    return getInput();
  if (auto producer = getInput().getDefiningOp<ReshapeOp>()) {
    getInputMutable().assign(producer.getInput());
    return getResult();
  }
  return {};
}

LogicalResult TransposeOp::verify() {
  if (failed(verifyStatic(*this)) || failed(expectSameElement(*this, getInput(), getResult())))
    return failure();
  return expectShape(*this, transposeShape(shapeOf(getInput()), getPerm()), getResult());
}

OpFoldResult TransposeOp::fold(FoldAdaptor) {
  ArrayRef<int64_t> perm = getPerm();
  if (llvm::equal(perm, llvm::seq<int64_t>(0, perm.size())))
    return getInput();
  if (auto inner = getInput().getDefiningOp<TransposeOp>()) {
    SmallVector<int64_t> combined;
    for (int64_t p : perm)
      combined.push_back(inner.getPerm()[p]);
    getInputMutable().assign(inner.getInput());
    setPerm(combined);
    if (llvm::equal(combined, llvm::seq<int64_t>(0, combined.size())) &&
        getInput().getType() == getType())
      return getInput();
    return getResult();
  }
  return {};
}

LogicalResult SliceOp::verify() {
  if (failed(verifyStatic(*this)) || failed(expectSameElement(*this, getInput(), getResult())))
    return failure();
  return expectShape(*this,
                     sliceShape(shapeOf(getInput()), getStarts(), getEnds(), getSteps()),
                     getResult());
}

LogicalResult ConcatOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  SmallVector<SmallVector<int64_t>> shapes;
  for (Value v : getInputs()) {
    if (failed(expectSameElement(*this, v, getResult())))
      return failure();
    shapes.emplace_back(shapeOf(v));
  }
  return expectShape(*this, concatShape(shapes, getAxis()), getResult());
}

LogicalResult GatherOp::verify() {
  if (failed(verifyStatic(*this)) || failed(expectSameElement(*this, getData(), getResult())))
    return failure();
  Type idx = elementOf(getIndices());
  if (!idx.isInteger(64) && !idx.isInteger(32))
    return emitOpError("indices must be i32 or i64, got ") << idx;
  return expectShape(*this, gatherShape(shapeOf(getData()), shapeOf(getIndices()), getAxis()),
                     getResult());
}

LogicalResult ExpandOp::verify() {
  if (failed(verifyStatic(*this)) || failed(expectSameElement(*this, getInput(), getResult())))
    return failure();
  if (!broadcastsTo(shapeOf(getInput()), shapeOf(getResult())))
    return emitOpError("cannot broadcast ")
           << formatShape(shapeOf(getInput())) << " to " << formatShape(shapeOf(getResult()));
  return success();
}

//===----------------------------------------------------------------------===//
// Convolutional networks
//===----------------------------------------------------------------------===//

LogicalResult Conv2dOp::verify() {
  if (failed(verifyStatic(*this)) || failed(expectFloat(*this, getInput(), "input")) ||
      failed(expectSameElement(*this, getInput(), getWeight())) ||
      failed(expectSameElement(*this, getInput(), getResult())))
    return failure();
  if (Value bias = getBias()) {
    if (shapeOf(bias).size() != 1 || shapeOf(bias)[0] != shapeOf(getWeight())[0])
      return emitOpError("bias needs one value per output channel");
  }
  return expectShape(*this,
                     conv2dShape(shapeOf(getInput()), shapeOf(getWeight()), getStrides(),
                                 getPads(), getDilations(), getGroup()),
                     getResult());
}

/// conv2d_grad_input / conv2d_grad_weight: the convolution they differentiate
/// (input, weight -> grad) is well formed and gives grad's shape.
static LogicalResult verifyConvGrad(Operation *op, Value input, Value weight, Value grad,
                                    ArrayRef<int64_t> strides, ArrayRef<int64_t> pads,
                                    ArrayRef<int64_t> dilations, int64_t group) {
  if (failed(verifyStatic(op)) || failed(expectFloat(op, input, "input")) ||
      failed(expectSameElement(op, input, weight)) || failed(expectSameElement(op, input, grad)))
    return failure();
  ShapeOrError want = conv2dShape(shapeOf(input), shapeOf(weight), strides, pads, dilations, group);
  if (!want.ok())
    return op->emitOpError(want.error);
  if (ArrayRef<int64_t>(want.shape) != shapeOf(grad))
    return op->emitOpError("grad has shape ")
           << formatShape(shapeOf(grad)) << ", the convolution's output is "
           << formatShape(want.shape);
  return success();
}

LogicalResult Conv2dGradInputOp::verify() {
  return verifyConvGrad(*this, getInputGrad(), getWeight(), getGrad(), getStrides(), getPads(),
                        getDilations(), getGroup());
}

LogicalResult Conv2dGradWeightOp::verify() {
  return verifyConvGrad(*this, getInput(), getWeightGrad(), getGrad(), getStrides(), getPads(),
                        getDilations(), getGroup());
}

LogicalResult MaxPool2dOp::verify() {
  if (failed(verifyStatic(*this)) || failed(expectSameElement(*this, getInput(), getResult())))
    return failure();
  return expectShape(*this,
                     pool2dShape(shapeOf(getInput()), getKernel(), getStrides(), getPads()),
                     getResult());
}

LogicalResult BatchNormOp::verify() {
  if (failed(verifyStatic(*this)) || failed(expectFloat(*this, getInput(), "input")))
    return failure();
  ArrayRef<int64_t> in = shapeOf(getInput());
  if (in.size() < 2)
    return emitOpError("input needs rank >= 2 ([N, C, ...])");
  for (Value v : {getScale(), getBias(), getRunningMean(), getRunningVar(),
                  getNewRunningMean(), getNewRunningVar()}) {
    if (shapeOf(v).size() != 1 || shapeOf(v)[0] != in[1])
      return emitOpError("per-channel tensors must have shape [") << in[1] << "]";
    if (failed(expectSameElement(*this, v, getInput())))
      return failure();
  }
  return expectShape(*this, {SmallVector<int64_t>(in), ""}, getResult());
}

//===----------------------------------------------------------------------===//
// Losses
//===----------------------------------------------------------------------===//

LogicalResult CrossEntropyOp::verify() {
  if (failed(verifyStatic(*this)) || failed(expectFloat(*this, getLogits(), "logits")) ||
      failed(expectSameElement(*this, getLogits(), getResult())))
    return failure();
  Type t = elementOf(getTargets());
  if (!t.isInteger(64) && !t.isInteger(32))
    return emitOpError("targets must be i32 or i64 class indices, got ") << t;
  StringRef red = getReduction();
  if (red != "mean" && red != "sum" && red != "none")
    return emitOpError("reduction must be mean, sum or none, got \"") << red << "\"";
  return expectShape(*this,
                     crossEntropyShape(shapeOf(getLogits()), shapeOf(getTargets()),
                                       red != "none"),
                     getResult());
}

#define GET_OP_CLASSES
#include "dialects/carve/CarveOps.cpp.inc"

//===----------------------------------------------------------------------===//
// Backward ops
//===----------------------------------------------------------------------===//

static LogicalResult sameShape(Operation *op, Value a, Value b, StringRef what) {
  if (shapeOf(a) != shapeOf(b))
    return op->emitOpError(what) << " has type " << b.getType() << ", expected the shape of "
                                 << a.getType();
  return success();
}

LogicalResult UnaryGradOp::verify() {
  static const char *fns[] = {"abs",     "exp",  "log",  "sqrt", "rsqrt",
                              "reciprocal", "tanh", "erf", "sigmoid", "relu",
                              "sin",     "cos",  "silu", "gelu", "gelu_tanh"};
  for (const char *f : fns)
    if (getFn() == f)
      return verifyStatic(*this);
  return emitOpError("unknown function '") << getFn() << "'";
}

LogicalResult SoftmaxGradOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  int64_t axis = (int64_t)getAxis();
  if (axis < 0 || axis >= tensorType(getOutput()).getRank())
    return emitOpError("axis ") << axis << " out of range";
  return success();
}

/// Shared checks of layer_norm_grad / rms_norm_grad: grad and input_grad like
/// input; the parameter gradients (and scale) shaped like dims [axis, rank).
static LogicalResult verifyNormGrad(Operation *op, Value input, Value grad, Value scale,
                                    int64_t axis, ValueRange paramGrads, Value inputGrad) {
  if (failed(verifyStatic(op)))
    return failure();
  int64_t rank = tensorType(input).getRank();
  if (axis < 0 || axis >= rank)
    return op->emitOpError("axis ") << axis << " out of range for rank " << rank;
  if (failed(sameShape(op, input, grad, "grad")) ||
      failed(sameShape(op, input, inputGrad, "input_grad")))
    return failure();
  ArrayRef<int64_t> norm = shapeOf(input).drop_front(axis);
  for (Value v : paramGrads)
    if (shapeOf(v) != norm)
      return op->emitOpError("parameter gradient of type ")
             << v.getType() << " is not shaped like the normalized dimensions";
  if (scale && shapeOf(scale) != norm)
    return op->emitOpError("scale of type ")
           << scale.getType() << " is not shaped like the normalized dimensions";
  return success();
}

LogicalResult LayerNormGradOp::verify() {
  return verifyNormGrad(*this, getInput(), getGrad(), getScale(), getAxis(),
                        ValueRange{getScaleGrad(), getBiasGrad()}, getInputGrad());
}

LogicalResult RmsNormGradOp::verify() {
  return verifyNormGrad(*this, getInput(), getGrad(), getScale(), getAxis(),
                        ValueRange{getScaleGrad()}, getInputGrad());
}

LogicalResult AttentionGradOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  auto shape = attentionShape(shapeOf(getQuery()), shapeOf(getKey()), shapeOf(getValue()));
  if (!shape.ok())
    return emitOpError(shape.error);
  if (ArrayRef<int64_t>(shape.shape) != shapeOf(getGrad()))
    return emitOpError("grad has type ") << getGrad().getType() << ", expected the output shape";
  if (failed(sameShape(*this, getQuery(), getQueryGrad(), "query_grad")) ||
      failed(sameShape(*this, getKey(), getKeyGrad(), "key_grad")) ||
      failed(sameShape(*this, getValue(), getValueGrad(), "value_grad")))
    return failure();
  return success();
}

/// The row statistics of attention: the result's shape without its last dimension, f32.
static LogicalResult verifyAttentionLse(Operation *op, Value result, Value lse) {
  ArrayRef<int64_t> r = shapeOf(result);
  if (shapeOf(lse) != r.drop_back() || !cast<ShapedType>(lse.getType()).getElementType().isF32())
    return op->emitOpError("lse has type ")
           << lse.getType() << ", expected f32 " << formatShape(r.drop_back());
  return success();
}

LogicalResult AttentionStatsOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  ShapeOrError s = attentionShape(shapeOf(getQuery()), shapeOf(getKey()), shapeOf(getValue()));
  if (failed(expectShape(*this, s, getResult())))
    return failure();
  return verifyAttentionLse(*this, getResult(), getLse());
}

LogicalResult AttentionGradStatsOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  auto shape = attentionShape(shapeOf(getQuery()), shapeOf(getKey()), shapeOf(getValue()));
  if (!shape.ok())
    return emitOpError(shape.error);
  if (ArrayRef<int64_t>(shape.shape) != shapeOf(getGrad()) ||
      ArrayRef<int64_t>(shape.shape) != shapeOf(getOutput()))
    return emitOpError("grad and output must have the attention's output shape ")
           << formatShape(shape.shape);
  if (failed(verifyAttentionLse(*this, getOutput(), getLse())) ||
      failed(sameShape(*this, getQuery(), getQueryGrad(), "query_grad")) ||
      failed(sameShape(*this, getKey(), getKeyGrad(), "key_grad")) ||
      failed(sameShape(*this, getValue(), getValueGrad(), "value_grad")))
    return failure();
  return success();
}

LogicalResult CrossEntropyGradOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  StringRef r = getReduction();
  if (r != "mean" && r != "sum" && r != "none")
    return emitOpError("reduction must be mean, sum or none, got '") << r << "'";
  auto shape = crossEntropyShape(shapeOf(getLogits()), shapeOf(getTargets()), r != "none");
  if (!shape.ok())
    return emitOpError(shape.error);
  if (ArrayRef<int64_t>(shape.shape) != shapeOf(getGrad()))
    return emitOpError("grad has type ") << getGrad().getType() << ", expected the loss shape";
  return sameShape(*this, getLogits(), getResult(), "result");
}

LogicalResult ExpertAllToAllOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  ArrayRef<int64_t> in = shapeOf(getInput());
  const int64_t rank = static_cast<int64_t>(in.size()), s = getSrcDim(), d = getDstDim();
  const int64_t n = getRanks();
  if (s < 0 || s >= rank || d < 0 || d >= rank || s == d)
    return emitOpError("src_dim and dst_dim must be two different dimensions of the input");
  if (n < 1 || in[d] % n != 0)
    return emitOpError("dimension ")
           << d << " (" << in[d] << ") must divide by ranks (" << n << ")";
  SmallVector<int64_t> want(in);
  want[s] *= n;
  want[d] /= n;
  if (ArrayRef<int64_t>(want) != shapeOf(getResult()) ||
      elementOf(getResult()) != elementOf(getInput()))
    return emitOpError("result has type ") << getResult().getType() << ", expected the input "
                                           << "re-split from dimension " << d << " to " << s;
  return success();
}

LogicalResult NonzeroOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  ArrayRef<int64_t> in = shapeOf(getInput());
  if (in.empty())
    return emitOpError("the input must have at least one dimension");
  int64_t numel = 1;
  for (int64_t d : in)
    numel *= d;
  const int64_t want[2] = {static_cast<int64_t>(in.size()), numel};
  if (ArrayRef<int64_t>(want) != shapeOf(getResult()) || !elementOf(getResult()).isInteger(64))
    return emitOpError("result has type ")
           << getResult().getType() << ", expected tensor<" << want[0] << "x" << want[1]
           << "xi64> (the rank by the element count)";
  return success();
}

LogicalResult GatherGradOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  if (!isa<IntegerType>(elementOf(getIndices())))
    return emitOpError("indices must be integers");
  auto shape = gatherShape(shapeOf(getResult()), shapeOf(getIndices()), getAxis());
  if (!shape.ok())
    return emitOpError(shape.error);
  if (ArrayRef<int64_t>(shape.shape) != shapeOf(getGrad()))
    return emitOpError("grad has type ")
           << getGrad().getType() << ", expected the shape gather would produce";
  return success();
}

LogicalResult SliceGradOp::verify() {
  if (failed(verifyStatic(*this)))
    return failure();
  auto shape = sliceShape(shapeOf(getResult()), getStarts(), getEnds(), getSteps());
  if (!shape.ok())
    return emitOpError(shape.error);
  if (ArrayRef<int64_t>(shape.shape) != shapeOf(getGrad()))
    return emitOpError("grad has type ")
           << getGrad().getType() << ", expected the shape of the slice";
  return success();
}
