//===- Gradients.cpp - gradient rules of the carve ops ----------------------===//
//
// One `buildGradients` per differentiable op (DifferentiableOpInterface). A
// rule sees the gradients of its op's results (null where none flows) and
// builds the operand gradients with carve ops: forward ops where they say it
// plainly (matmul, reshape, transpose, reduce), backward ops (unary_grad,
// softmax_grad, layer_norm_grad, attention_grad, ...) where a fused kernel is
// both faster and clearer. Broadcast operands get their gradient summed back
// to their own shape (`unbroadcast`). Every rule is checked against central
// finite differences in float64 (tests/unit/GradientTest.cpp).
//
//===----------------------------------------------------------------------===//

#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Shapes.h"

#include "mlir/IR/Builders.h"
#include "llvm/ADT/Sequence.h"

using namespace mlir;
using namespace carve;

namespace {

RankedTensorType typeOf(Value v) { return cast<RankedTensorType>(v.getType()); }

RankedTensorType withShape(Value like, ArrayRef<int64_t> shape) {
  return RankedTensorType::get(shape, typeOf(like).getElementType());
}

bool isFloat(Value v) { return isa<FloatType>(typeOf(v).getElementType()); }

/// A splat constant of `v`'s element type and `shape`.
Value splat(OpBuilder &b, Location loc, Value like, ArrayRef<int64_t> shape, double x) {
  auto type = withShape(like, shape);
  auto ft = cast<FloatType>(type.getElementType());
  return ConstantOp::create(b, loc, DenseElementsAttr::get(type, b.getFloatAttr(ft, x)));
}

/// A zero constant of any element type.
Value zeros(OpBuilder &b, Location loc, RankedTensorType type) {
  return ConstantOp::create(b, loc,
                            DenseElementsAttr::get(type, b.getZeroAttr(type.getElementType())));
}

Value reshape(OpBuilder &b, Location loc, Value v, ArrayRef<int64_t> shape) {
  if (typeOf(v).getShape() == shape)
    return v;
  return ReshapeOp::create(b, loc, withShape(v, shape), v);
}

Value transpose(OpBuilder &b, Location loc, Value v, ArrayRef<int64_t> perm) {
  auto s = transposeShape(typeOf(v).getShape(), perm);
  return TransposeOp::create(b, loc, withShape(v, s.shape), v, b.getDenseI64ArrayAttr(perm));
}

/// Swaps the last two dimensions.
Value transposeLast2(OpBuilder &b, Location loc, Value v) {
  int64_t r = typeOf(v).getRank();
  SmallVector<int64_t> perm = llvm::to_vector(llvm::seq<int64_t>(0, r));
  std::swap(perm[r - 1], perm[r - 2]);
  return transpose(b, loc, v, perm);
}

Value reduceSum(OpBuilder &b, Location loc, Value v, ArrayRef<int64_t> axes, bool keep) {
  if (axes.empty())
    return v;
  auto s = reduceShape(typeOf(v).getShape(), axes, keep);
  return ReduceSumOp::create(b, loc, withShape(v, s.shape), v, b.getDenseI64ArrayAttr(axes),
                             b.getBoolAttr(keep));
}

/// Sums `g` (shaped like a broadcast result) back to `target`'s shape.
Value unbroadcast(OpBuilder &b, Location loc, Value g, Value target) {
  ArrayRef<int64_t> gs = typeOf(g).getShape(), ts = typeOf(target).getShape();
  if (gs == ts)
    return g;
  int64_t lead = (int64_t)gs.size() - (int64_t)ts.size();
  SmallVector<int64_t> axes;
  for (int64_t i = 0; i < (int64_t)gs.size(); ++i)
    if (i < lead || (ts[i - lead] == 1 && gs[i] != 1))
      axes.push_back(i);
  Value r = reduceSum(b, loc, g, axes, /*keep=*/true);
  return reshape(b, loc, r, ts);
}

/// Broadcasts `v` to `shape` (NumPy rules); no-op when equal.
Value expandTo(OpBuilder &b, Location loc, Value v, ArrayRef<int64_t> shape) {
  if (typeOf(v).getShape() == shape)
    return v;
  return ExpandOp::create(b, loc, withShape(v, shape), v);
}

template <typename OpTy> Value bin(OpBuilder &b, Location loc, Value l, Value r) {
  auto s = broadcastShapes(typeOf(l).getShape(), typeOf(r).getShape());
  return OpTy::create(b, loc, withShape(l, s.shape), l, r);
}

template <typename OpTy> Value cmp(OpBuilder &b, Location loc, Value l, Value r) {
  auto s = broadcastShapes(typeOf(l).getShape(), typeOf(r).getShape());
  return OpTy::create(b, loc, RankedTensorType::get(s.shape, b.getI1Type()), l, r);
}

Value toFloat(OpBuilder &b, Location loc, Value mask, Value like) {
  return CastOp::create(b, loc, withShape(like, typeOf(mask).getShape()), mask);
}

Value unaryGrad(OpBuilder &b, Location loc, StringRef fn, Value x, Value g) {
  return UnaryGradOp::create(b, loc, x.getType(), x, g, b.getStringAttr(fn));
}

/// Gradients of the binary ops with broadcasting.
LogicalResult binaryGrads(Operation *op, OpBuilder &b, ArrayRef<Value> rg,
                          SmallVectorImpl<Value> &og) {
  Value g = rg[0];
  Value l = op->getOperand(0), r = op->getOperand(1), y = op->getResult(0);
  Location loc = op->getLoc();
  og.assign(2, Value());
  if (!g || !isFloat(y))
    return success();
  Value gl, gr;
  if (isa<AddOp>(op)) {
    gl = g, gr = g;
  } else if (isa<SubOp>(op)) {
    gl = g, gr = NegOp::create(b, loc, g.getType(), g);
  } else if (isa<MulOp>(op)) {
    gl = bin<MulOp>(b, loc, g, r), gr = bin<MulOp>(b, loc, g, l);
  } else if (isa<DivOp>(op)) {
    // d(l/r)/dl = 1/r; d(l/r)/dr = -y/r.
    gl = bin<DivOp>(b, loc, g, r);
    Value t = bin<MulOp>(b, loc, g, bin<DivOp>(b, loc, y, r));
    gr = NegOp::create(b, loc, t.getType(), t);
  } else if (isa<PowOp>(op)) {
    // d(l^r)/dl = r * l^(r-1); d(l^r)/dr = y * log(l).
    Value one = splat(b, loc, r, {}, 1.0);
    Value rm1 = bin<SubOp>(b, loc, r, one);
    gl = bin<MulOp>(b, loc, g, bin<MulOp>(b, loc, r, bin<PowOp>(b, loc, l, rm1)));
    Value logl = LogOp::create(b, loc, l.getType(), l);
    gr = bin<MulOp>(b, loc, g, bin<MulOp>(b, loc, y, logl));
  } else if (isa<MaximumOp, MinimumOp>(op)) {
    // PyTorch: the winner takes the gradient; ties split it evenly.
    Value wins = isa<MaximumOp>(op) ? cmp<GreaterOp>(b, loc, l, r) : cmp<LessOp>(b, loc, l, r);
    Value ties = cmp<EqualOp>(b, loc, l, r);
    Value half = splat(b, loc, y, {}, 0.5);
    Value wl = bin<AddOp>(b, loc, toFloat(b, loc, wins, y),
                          bin<MulOp>(b, loc, toFloat(b, loc, ties, y), half));
    Value wr = bin<SubOp>(b, loc, splat(b, loc, y, {}, 1.0), wl);
    gl = bin<MulOp>(b, loc, g, wl), gr = bin<MulOp>(b, loc, g, wr);
  } else {
    return op->emitOpError("has no gradient rule");
  }
  og[0] = unbroadcast(b, loc, gl, l);
  og[1] = unbroadcast(b, loc, gr, r);
  return success();
}

LogicalResult unaryGrads(Operation *op, StringRef fn, OpBuilder &b, ArrayRef<Value> rg,
                         SmallVectorImpl<Value> &og) {
  og.assign(1, Value());
  if (!rg[0])
    return success();
  og[0] = unaryGrad(b, op->getLoc(), fn, op->getOperand(0), rg[0]);
  return success();
}

template <typename ReduceOpTy>
LogicalResult reduceGrads(ReduceOpTy op, OpBuilder &b, ArrayRef<Value> rg,
                          SmallVectorImpl<Value> &og) {
  og.assign(1, Value());
  Value g = rg[0];
  if (!g)
    return success();
  Location loc = op.getLoc();
  Value x = op.getInput();
  ArrayRef<int64_t> xs = typeOf(x).getShape();
  auto kept = reduceShape(xs, op.getAxes(), /*keepDims=*/true);
  Value gk = reshape(b, loc, g, kept.shape);
  if (isa<ReduceSumOp>(op.getOperation())) {
    og[0] = expandTo(b, loc, gk, xs);
  } else if (isa<ReduceMeanOp>(op.getOperation())) {
    int64_t n = 1;
    for (int64_t a : op.getAxes())
      n *= xs[a];
    og[0] = expandTo(b, loc, bin<MulOp>(b, loc, gk, splat(b, loc, g, {}, 1.0 / n)), xs);
  } else {
    // reduce_max: the maxima share the gradient evenly (torch.amax).
    Value yk = reshape(b, loc, op.getResult(), kept.shape);
    Value m = toFloat(b, loc, cmp<EqualOp>(b, loc, x, yk), x);
    Value count = reduceSum(b, loc, m, op.getAxes(), /*keep=*/true);
    og[0] = bin<MulOp>(b, loc, m, bin<DivOp>(b, loc, gk, count));
  }
  return success();
}

} // namespace

//===--- Elementwise --------------------------------------------------------===//

#define CARVE_BINARY_GRAD(OP)                                                                      \
  LogicalResult OP::buildGradients(OpBuilder &b, ArrayRef<Value> rg, SmallVectorImpl<Value> &og) { \
    return binaryGrads(getOperation(), b, rg, og);                                                 \
  }
CARVE_BINARY_GRAD(AddOp)
CARVE_BINARY_GRAD(SubOp)
CARVE_BINARY_GRAD(MulOp)
CARVE_BINARY_GRAD(DivOp)
CARVE_BINARY_GRAD(PowOp)
CARVE_BINARY_GRAD(MaximumOp)
CARVE_BINARY_GRAD(MinimumOp)
#undef CARVE_BINARY_GRAD

LogicalResult NegOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg, SmallVectorImpl<Value> &og) {
  og.assign(1, Value());
  if (rg[0])
    og[0] = NegOp::create(b, getLoc(), rg[0].getType(), rg[0]);
  return success();
}

#define CARVE_UNARY_GRAD(OP, FN)                                                                   \
  LogicalResult OP::buildGradients(OpBuilder &b, ArrayRef<Value> rg, SmallVectorImpl<Value> &og) { \
    return unaryGrads(getOperation(), FN, b, rg, og);                                              \
  }
CARVE_UNARY_GRAD(AbsOp, "abs")
CARVE_UNARY_GRAD(ExpOp, "exp")
CARVE_UNARY_GRAD(LogOp, "log")
CARVE_UNARY_GRAD(SqrtOp, "sqrt")
CARVE_UNARY_GRAD(RsqrtOp, "rsqrt")
CARVE_UNARY_GRAD(ReciprocalOp, "reciprocal")
CARVE_UNARY_GRAD(TanhOp, "tanh")
CARVE_UNARY_GRAD(ErfOp, "erf")
CARVE_UNARY_GRAD(SigmoidOp, "sigmoid")
CARVE_UNARY_GRAD(ReluOp, "relu")
CARVE_UNARY_GRAD(SinOp, "sin")
CARVE_UNARY_GRAD(CosOp, "cos")
CARVE_UNARY_GRAD(SiluOp, "silu")
#undef CARVE_UNARY_GRAD

LogicalResult GeluOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg, SmallVectorImpl<Value> &og) {
  return unaryGrads(getOperation(), getApproximate() == "tanh" ? "gelu_tanh" : "gelu", b, rg, og);
}

LogicalResult DropoutOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                        SmallVectorImpl<Value> &og) {
  // The same mask on the gradient: the same op with the same attributes.
  og.assign(1, Value());
  if (!rg[0])
    return success();
  og[0] = DropoutOp::create(b, getLoc(), rg[0].getType(), rg[0], getPAttr(), getNodeAttr(),
                            getBatchDimAttr(), getBatchOuterAttr());
  return success();
}

LogicalResult ReplicaSumOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                           SmallVectorImpl<Value> &og) {
  // y_r = sum_s x_s on every replica r: dL/dx_s = sum_r dL/dy_r.
  og.assign(1, Value());
  if (rg[0])
    og[0] = ReplicaSumOp::create(b, getLoc(), rg[0].getType(), rg[0]);
  return success();
}

LogicalResult EvalSelectOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                           SmallVectorImpl<Value> &og) {
  og.assign(2, Value());
  og[0] = rg[0]; // a training step computes `train`
  return success();
}

LogicalResult WhereOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                      SmallVectorImpl<Value> &og) {
  og.assign(3, Value());
  Value g = rg[0];
  if (!g || !isFloat(getResult()))
    return success();
  Location loc = getLoc();
  Value zero = splat(b, loc, g, {}, 0.0);
  Value c = getOperand(0);
  Value ga = WhereOp::create(b, loc, g.getType(), c, g, zero);
  Value gb = WhereOp::create(b, loc, g.getType(), c, zero, g);
  og[1] = unbroadcast(b, loc, ga, getOperand(1));
  og[2] = unbroadcast(b, loc, gb, getOperand(2));
  return success();
}

LogicalResult CastOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg, SmallVectorImpl<Value> &og) {
  og.assign(1, Value());
  // Only float-to-float casts carry a gradient (back to the source type).
  if (rg[0] && isFloat(getInput()) && isFloat(getResult()))
    og[0] = CastOp::create(b, getLoc(), getInput().getType(), rg[0]);
  return success();
}

//===--- Linear algebra -----------------------------------------------------===//

LogicalResult MatmulOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                       SmallVectorImpl<Value> &og) {
  og.assign(2, Value());
  Value g = rg[0];
  if (!g)
    return success();
  Location loc = getLoc();
  Value a = getLhs(), w = getRhs();
  int64_t ra = typeOf(a).getRank(), rw = typeOf(w).getRank();
  if (ra < 2 || rw < 2)
    return emitOpError("gradient of a matmul with a vector operand is not supported yet; "
                       "reshape the vector to a matrix in the model");
  ArrayRef<int64_t> as = typeOf(a).getShape();
  ArrayRef<int64_t> gs = typeOf(g).getShape();

  // dA = g @ w^T (broadcast batch dims of A summed back).
  Value wt = transposeLast2(b, loc, w);
  auto sa = matmulShape(gs, typeOf(wt).getShape());
  Value ga = MatmulOp::create(b, loc, withShape(g, sa.shape), g, wt);
  og[0] = unbroadcast(b, loc, ga, a);

  // dW: when W is a plain matrix shared by the whole batch of A, fold A's
  // batch into the rows: dW = A2^T @ g2 with A2 = [M, k], g2 = [M, n]; one GEMM
  // and no batch of partial products.
  if (rw == 2 && ra > 2) {
    int64_t k = as[ra - 1], n = gs.back();
    int64_t rows = numElements(as) / k;
    Value a2 = reshape(b, loc, a, {rows, k});
    Value g2 = reshape(b, loc, g, {rows, n});
    og[1] = MatmulOp::create(b, loc, withShape(w, {k, n}), transposeLast2(b, loc, a2), g2);
    return success();
  }
  Value at = transposeLast2(b, loc, a);
  auto s = matmulShape(typeOf(at).getShape(), gs);
  Value gw = MatmulOp::create(b, loc, withShape(w, s.shape), at, g);
  og[1] = unbroadcast(b, loc, gw, w);
  return success();
}

LogicalResult ReduceSumOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                          SmallVectorImpl<Value> &og) {
  return reduceGrads(*this, b, rg, og);
}
LogicalResult ReduceMeanOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                           SmallVectorImpl<Value> &og) {
  return reduceGrads(*this, b, rg, og);
}
LogicalResult ReduceMaxOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                          SmallVectorImpl<Value> &og) {
  return reduceGrads(*this, b, rg, og);
}

//===--- Normalization and attention ----------------------------------------===//

LogicalResult SoftmaxOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                        SmallVectorImpl<Value> &og) {
  og.assign(1, Value());
  if (rg[0])
    og[0] = SoftmaxGradOp::create(b, getLoc(), getType(), getResult(), rg[0], getAxisAttr(),
                                  b.getBoolAttr(false));
  return success();
}

LogicalResult LogSoftmaxOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                           SmallVectorImpl<Value> &og) {
  og.assign(1, Value());
  if (rg[0])
    og[0] = SoftmaxGradOp::create(b, getLoc(), getType(), getResult(), rg[0], getAxisAttr(),
                                  b.getBoolAttr(true));
  return success();
}

LogicalResult LayerNormOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                          SmallVectorImpl<Value> &og) {
  og.assign(getNumOperands(), Value());
  if (!rg[0])
    return success();
  Value x = getInput();
  auto normType = withShape(x, typeOf(x).getShape().drop_front(getAxis()));
  auto grad = LayerNormGradOp::create(b, getLoc(), x.getType(), normType, normType, x, rg[0],
                                      getScale(), getAxisAttr(), getEpsilonAttr());
  og[0] = grad.getInputGrad();
  unsigned k = 1;
  if (getScale())
    og[k++] = grad.getScaleGrad();
  if (getBias())
    og[k++] = grad.getBiasGrad();
  return success();
}

LogicalResult RmsNormOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                        SmallVectorImpl<Value> &og) {
  og.assign(getNumOperands(), Value());
  if (!rg[0])
    return success();
  Value x = getInput();
  auto normType = withShape(x, typeOf(x).getShape().drop_front(getAxis()));
  auto grad = RmsNormGradOp::create(b, getLoc(), x.getType(), normType, x, rg[0], getScale(),
                                    getAxisAttr(), getEpsilonAttr());
  og[0] = grad.getInputGrad();
  if (getScale())
    og[1] = grad.getScaleGrad();
  return success();
}

LogicalResult RotaryOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                       SmallVectorImpl<Value> &og) {
  // cos and sin: tables of positions, no gradient (carve-raise makes this
  // op only where they depend on no trainable value).
  og.assign(getNumOperands(), Value());
  if (!rg[0])
    return success();
  og[0] = RotaryGradOp::create(b, getLoc(), getInput().getType(), rg[0], getCos(), getSin());
  return success();
}

LogicalResult Conv2dOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                       SmallVectorImpl<Value> &og) {
  og.assign(getNumOperands(), Value());
  if (!rg[0])
    return success();
  const Location loc = getLoc();
  Value g = rg[0];
  og[0] = Conv2dGradInputOp::create(b, loc, getInput().getType(), g, getWeight(), getStridesAttr(),
                                    getPadsAttr(), getDilationsAttr(), getGroupAttr());
  og[1] = Conv2dGradWeightOp::create(b, loc, getWeight().getType(), getInput(), g, getStridesAttr(),
                                     getPadsAttr(), getDilationsAttr(), getGroupAttr());
  if (getBias())
    og[2] = reduceSum(b, loc, g, {0, 2, 3}, /*keep=*/false);
  return success();
}

LogicalResult AttentionOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                          SmallVectorImpl<Value> &og) {
  og.assign(getNumOperands(), Value());
  if (!rg[0])
    return success();
  auto grad = AttentionGradOp::create(b, getLoc(), getQuery().getType(), getKey().getType(),
                                      getValue().getType(), getQuery(), getKey(), getValue(), rg[0],
                                      getMask(), getScaleAttr(), getCausalAttr());
  og[0] = grad.getQueryGrad();
  og[1] = grad.getKeyGrad();
  og[2] = grad.getValueGrad();
  return success(); // the mask (operand 3) gets none; autodiff refuses a trainable mask
}

LogicalResult CrossEntropyOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                             SmallVectorImpl<Value> &og) {
  og.assign(2, Value());
  if (!rg[0])
    return success();
  og[0] = CrossEntropyGradOp::create(b, getLoc(), getLogits().getType(), getLogits(), getTargets(),
                                     rg[0], getReductionAttr(), getIgnoreIndexAttr());
  return success();
}

//===--- Data movement ------------------------------------------------------===//

LogicalResult ReshapeOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                        SmallVectorImpl<Value> &og) {
  og.assign(1, Value());
  if (rg[0])
    og[0] = reshape(b, getLoc(), rg[0], typeOf(getInput()).getShape());
  return success();
}

LogicalResult TransposeOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                          SmallVectorImpl<Value> &og) {
  og.assign(1, Value());
  if (!rg[0])
    return success();
  ArrayRef<int64_t> perm = getPerm();
  SmallVector<int64_t> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i)
    inv[perm[i]] = (int64_t)i;
  og[0] = transpose(b, getLoc(), rg[0], inv);
  return success();
}

LogicalResult SliceOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                      SmallVectorImpl<Value> &og) {
  og.assign(1, Value());
  if (rg[0])
    og[0] = SliceGradOp::create(b, getLoc(), getInput().getType(), rg[0], getStartsAttr(),
                                getEndsAttr(), getStepsAttr());
  return success();
}

LogicalResult ConcatOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                       SmallVectorImpl<Value> &og) {
  og.assign(getNumOperands(), Value());
  Value g = rg[0];
  if (!g)
    return success();
  ArrayRef<int64_t> gs = typeOf(g).getShape();
  int64_t axis = getAxis(), offset = 0;
  for (unsigned k = 0; k < getNumOperands(); ++k) {
    ArrayRef<int64_t> s = typeOf(getOperand(k)).getShape();
    SmallVector<int64_t> starts(gs.size(), 0), ends(gs.begin(), gs.end()), steps(gs.size(), 1);
    starts[axis] = offset;
    ends[axis] = offset + s[axis];
    offset += s[axis];
    og[k] = SliceOp::create(b, getLoc(), getOperand(k).getType(), g, b.getDenseI64ArrayAttr(starts),
                            b.getDenseI64ArrayAttr(ends), b.getDenseI64ArrayAttr(steps));
  }
  return success();
}

LogicalResult GatherOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                       SmallVectorImpl<Value> &og) {
  og.assign(2, Value());
  if (rg[0])
    og[0] =
        GatherGradOp::create(b, getLoc(), getData().getType(), rg[0], getIndices(), getAxisAttr());
  return success();
}

LogicalResult ExpertAllToAllOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                               SmallVectorImpl<Value> &og) {
  og.assign(1, Value());
  if (rg[0])
    og[0] = ExpertAllToAllOp::create(b, getLoc(), getInput().getType(), rg[0], getDstDimAttr(),
                                     getSrcDimAttr(), getRanksAttr());
  return success();
}

LogicalResult GatherGradOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                           SmallVectorImpl<Value> &og) {
  og.assign(2, Value());
  if (rg[0])
    og[0] = GatherOp::create(b, getLoc(), getGrad().getType(), rg[0], getIndices(), getAxisAttr());
  return success();
}

LogicalResult ExpandOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                       SmallVectorImpl<Value> &og) {
  og.assign(1, Value());
  if (rg[0])
    og[0] = unbroadcast(b, getLoc(), rg[0], getInput());
  return success();
}

//===--- User-defined ops ---------------------------------------------------===//

LogicalResult CustomOp::buildGradients(OpBuilder &b, ArrayRef<Value> rg,
                                       SmallVectorImpl<Value> &og) {
  og.assign(getNumOperands(), Value());
  if (getBackward().empty())
    return emitOpError("(")
           << getDomain() << "::" << getOpType()
           << ") has no backward kernel, but a trainable parameter's gradient flows through it; "
              "name one in the rules file (\"cpu\": {\"backward\": ...})";
  // The kernel reads every result gradient: zeros where none flows.
  SmallVector<Value> operands(getInputs());
  for (auto [r, g] : llvm::zip(getOutputs(), rg))
    operands.push_back(g ? g : zeros(b, getLoc(), typeOf(r)));
  auto grad = CustomGradOp::create(b, getLoc(), getInputs().getTypes(), operands, getDomainAttr(),
                                   getOpTypeAttr(), getBackwardAnnotationAttr(), getBackwardAttr(),
                                   getCudaBackwardAttr());
  for (auto [k, v] : llvm::enumerate(getInputs()))
    if (isFloat(v))
      og[k] = grad.getResult(k);
  return success();
}
