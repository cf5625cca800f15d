//===- Raise.cpp - recognize high-level ops in exported elementwise chains ===//
//
// Implements the carve-raise pass (see Passes.td for the patterns). Each
// pattern matches exactly the chain it names -- same operands, splat constants
// with the right values, single-use intermediates -- and replaces only its
// root; the intermediates die when they lose their last user.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Passes.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "llvm/ADT/SmallPtrSet.h"

#include "mlir/IR/DialectResourceBlobManager.h"
#include "mlir/IR/PatternMatch.h"
#include "mlir/Transforms/GreedyPatternRewriteDriver.h"

#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace carve {
#define GEN_PASS_DEF_CARVERAISE
#include "compiler/frontend/Passes.h.inc"
} // namespace carve

using namespace mlir;
using namespace carve;

namespace {

/// The value of a splat constant (any shape), as a double.
std::optional<double> splatValue(Value v) {
  auto c = v.getDefiningOp<ConstantOp>();
  if (!c)
    return std::nullopt;
  auto dense = dyn_cast<DenseElementsAttr>(c.getValue());
  if (!dense || !dense.isSplat())
    return std::nullopt;
  Type elt = dense.getElementType();
  if (isa<FloatType>(elt)) {
    APFloat f = dense.getSplatValue<APFloat>();
    bool lost;
    f.convert(APFloat::IEEEdouble(), APFloat::rmNearestTiesToEven, &lost);
    return f.convertToDouble();
  }
  if (elt.isInteger() && elt.getIntOrFloatBitWidth() > 1)
    return (double)dense.getSplatValue<APInt>().getSExtValue();
  return std::nullopt;
}

/// True if `v` is a splat constant within a relative 1e-6 of `expected`
/// (constants pass through float32 on export).
bool isSplat(Value v, double expected) {
  auto s = splatValue(v);
  return s && std::fabs(*s - expected) <= 1e-6 * std::max(1.0, std::fabs(expected));
}

/// True if a splat constant does not change the shape of `other` when
/// broadcast against it.
bool scalarLike(Value c, Value other) {
  auto ct = cast<RankedTensorType>(c.getType());
  auto ot = cast<RankedTensorType>(other.getType());
  if (ct.getRank() > ot.getRank())
    return false;
  for (int64_t d : ct.getShape())
    if (d != 1)
      return false;
  return true;
}

bool singleUse(Value v) { return v.hasOneUse(); }

/// Whether `v` is computed from a trainable parameter (an argument of the
/// function marked carve.trainable); with `gatheredOnly`, only from one that
/// a gather reads as its table (a learned table, such as T5's relative
/// position bias).
bool dependsOnTrainable(Value v, bool gatheredOnly) {
  llvm::SmallPtrSet<Operation *, 16> seen;
  SmallVector<std::pair<Value, bool>> work = {{v, !gatheredOnly}};
  while (!work.empty()) {
    auto [x, counts] = work.pop_back_val();
    if (auto arg = dyn_cast<BlockArgument>(x)) {
      auto fn = dyn_cast<func::FuncOp>(arg.getOwner()->getParentOp());
      if (counts && fn && fn.getArgAttr(arg.getArgNumber(), kTrainableAttr))
        return true;
      continue;
    }
    Operation *op = x.getDefiningOp();
    if (!op || !seen.insert(op).second)
      continue;
    auto gather = dyn_cast<GatherOp>(op);
    for (Value o : op->getOperands())
      work.push_back({o, counts || (gather && o == gather.getData())});
  }
  return false;
}

/// `lhs op rhs` with either operand order: binds the operand matching `pred`
/// to `match` and the other to `other`.
template <typename Pred>
bool eitherSide(Operation *op, Pred pred, Value &match, Value &other) {
  for (int k = 0; k < 2; ++k) {
    Value a = op->getOperand(k), b = op->getOperand(1 - k);
    if (pred(a, b)) {
      match = a;
      other = b;
      return true;
    }
  }
  return false;
}

/// True if `axes` are exactly the trailing dims [first, rank).
bool trailingAxes(ArrayRef<int64_t> axes, int64_t rank, int64_t &first) {
  if (axes.empty())
    return false;
  first = axes.front();
  for (size_t k = 0; k < axes.size(); ++k)
    if (axes[k] != first + (int64_t)k)
      return false;
  return axes.back() == rank - 1;
}

/// Matches `x^2` (Pow with exponent 2, or x * x) and returns x.
Value matchSquare(Value v) {
  if (auto pow = v.getDefiningOp<PowOp>())
    if (isSplat(pow.getRhs(), 2.0) && scalarLike(pow.getRhs(), pow.getLhs()))
      return pow.getLhs();
  if (auto mul = v.getDefiningOp<MulOp>())
    if (mul.getLhs() == mul.getRhs())
      return mul.getLhs();
  return {};
}

/// Matches `mean(x^2 over trailing axes, keepdims) + eps`; returns x, eps, axis.
bool matchMeanSquarePlusEps(Value v, Value &x, double &eps, int64_t &axis) {
  auto add = v.getDefiningOp<AddOp>();
  if (!add)
    return false;
  Value meanV, epsV;
  if (!eitherSide(
          add, [](Value a, Value b) { return a.getDefiningOp<ReduceMeanOp>() && splatValue(b); },
          meanV, epsV))
    return false;
  auto mean = meanV.getDefiningOp<ReduceMeanOp>();
  if (!mean.getKeepDims())
    return false;
  Value sq = matchSquare(mean.getInput());
  if (!sq)
    return false;
  int64_t rank = cast<RankedTensorType>(sq.getType()).getRank();
  if (!trailingAxes(mean.getAxes(), rank, axis) || !scalarLike(epsV, meanV))
    return false;
  eps = *splatValue(epsV);
  x = sq;
  return eps >= 0;
}

/// Matches `1 / sqrt(y)` written as rsqrt, reciprocal(sqrt), or 1 / sqrt; returns y.
Value matchRsqrt(Value v) {
  if (auto r = v.getDefiningOp<RsqrtOp>())
    return r.getInput();
  if (auto r = v.getDefiningOp<ReciprocalOp>())
    if (auto s = r.getInput().getDefiningOp<SqrtOp>())
      return s.getInput();
  if (auto d = v.getDefiningOp<DivOp>())
    if (isSplat(d.getLhs(), 1.0) && scalarLike(d.getLhs(), d.getRhs()))
      if (auto s = d.getRhs().getDefiningOp<SqrtOp>())
        return s.getInput();
  return {};
}

/// 1. x * sigmoid(x) -> silu(x).
struct RaiseSilu : OpRewritePattern<MulOp> {
  using OpRewritePattern::OpRewritePattern;
  LogicalResult matchAndRewrite(MulOp op, PatternRewriter &rw) const override {
    Value sig, x;
    if (!eitherSide(
            op,
            [](Value a, Value b) {
              auto s = a.getDefiningOp<SigmoidOp>();
              return s && s.getInput() == b;
            },
            sig, x))
      return failure();
    if (x.getType() != op.getType())
      return failure();
    rw.replaceOpWithNewOp<SiluOp>(op, op.getType(), x);
    return success();
  }
};

/// Collects the factors of a product tree rooted at `root` (through
/// single-use inner multiplications).
void productFactors(Value v, bool isRoot, SmallVectorImpl<Value> &out) {
  auto mul = v.getDefiningOp<MulOp>();
  if (mul && (isRoot || singleUse(v)) && out.size() < 4) {
    productFactors(mul.getLhs(), false, out);
    productFactors(mul.getRhs(), false, out);
    return;
  }
  out.push_back(v);
}

/// Matches `x * x * x` or `x^3`; returns x.
Value matchCube(Value v) {
  if (auto pow = v.getDefiningOp<PowOp>())
    if (isSplat(pow.getRhs(), 3.0))
      return pow.getLhs();
  SmallVector<Value> f;
  productFactors(v, true, f);
  if (f.size() == 3 && f[0] == f[1] && f[1] == f[2])
    return f[0];
  return {};
}

/// 2. GELU, erf and tanh forms, factors in any order.
struct RaiseGelu : OpRewritePattern<MulOp> {
  using OpRewritePattern::OpRewritePattern;
  LogicalResult matchAndRewrite(MulOp op, PatternRewriter &rw) const override {
    SmallVector<Value> f;
    productFactors(op.getResult(), true, f);
    if (f.size() != 3)
      return failure();
    // Find the 0.5 constant and the (1 + erf/tanh(...)) term; the rest is x.
    int half = -1, term = -1;
    for (int k = 0; k < 3; ++k) {
      if (isSplat(f[k], 0.5))
        half = k;
      else if (auto add = f[k].getDefiningOp<AddOp>())
        if (singleUse(f[k]) && (isSplat(add.getLhs(), 1.0) || isSplat(add.getRhs(), 1.0)))
          term = k;
    }
    if (half < 0 || term < 0)
      return failure();
    Value x = f[3 - half - term];
    if (x.getType() != op.getType() || !scalarLike(f[half], x))
      return failure();
    auto add = f[term].getDefiningOp<AddOp>();
    Value inner = isSplat(add.getLhs(), 1.0) ? add.getRhs() : add.getLhs();
    StringRef approx;
    if (auto erf = inner.getDefiningOp<ErfOp>()) {
      Value arg = erf.getInput();
      bool ok = false;
      if (auto div = arg.getDefiningOp<DivOp>())
        ok = div.getLhs() == x && isSplat(div.getRhs(), M_SQRT2);
      else if (auto mul = arg.getDefiningOp<MulOp>())
        ok = (mul.getLhs() == x && isSplat(mul.getRhs(), M_SQRT1_2)) ||
             (mul.getRhs() == x && isSplat(mul.getLhs(), M_SQRT1_2));
      if (!ok)
        return failure();
      approx = "none";
    } else if (auto tanh = inner.getDefiningOp<TanhOp>()) {
      // tanh(sqrt(2/pi) * (x + 0.044715 * x^3))
      auto mul = tanh.getInput().getDefiningOp<MulOp>();
      if (!mul)
        return failure();
      Value beta, sum;
      if (!eitherSide(mul, [](Value a, Value) { return isSplat(a, std::sqrt(2.0 / M_PI)); },
                      beta, sum))
        return failure();
      auto s = sum.getDefiningOp<AddOp>();
      if (!s)
        return failure();
      Value xs, cubic;
      if (!eitherSide(s, [&](Value a, Value) { return a == x; }, xs, cubic))
        return failure();
      auto cm = cubic.getDefiningOp<MulOp>();
      if (!cm)
        return failure();
      Value kappa, cube;
      if (!eitherSide(cm, [](Value a, Value) { return isSplat(a, 0.044715); }, kappa, cube) ||
          matchCube(cube) != x)
        return failure();
      approx = "tanh";
    } else {
      return failure();
    }
    rw.replaceOpWithNewOp<GeluOp>(op, op.getType(), x, rw.getStringAttr(approx));
    return success();
  }
};

/// 3. (x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) -> layer_norm(x).
struct RaiseLayerNorm : OpRewritePattern<DivOp> {
  using OpRewritePattern::OpRewritePattern;
  LogicalResult matchAndRewrite(DivOp op, PatternRewriter &rw) const override {
    auto sub = op.getLhs().getDefiningOp<SubOp>();
    auto sqrt = op.getRhs().getDefiningOp<SqrtOp>();
    if (!sub || !sqrt)
      return failure();
    Value x = sub.getLhs();
    auto mean = sub.getRhs().getDefiningOp<ReduceMeanOp>();
    if (!mean || mean.getInput() != x || !mean.getKeepDims() || x.getType() != op.getType())
      return failure();
    Value centered;
    double eps;
    int64_t axis;
    if (!matchMeanSquarePlusEps(sqrt.getInput(), centered, eps, axis) ||
        centered != sub.getResult())
      return failure();
    int64_t axis2;
    if (!trailingAxes(mean.getAxes(), cast<RankedTensorType>(x.getType()).getRank(), axis2) ||
        axis2 != axis)
      return failure();
    rw.replaceOpWithNewOp<LayerNormOp>(op, op.getType(), x, Value(), Value(),
                                       rw.getI64IntegerAttr(axis), rw.getF32FloatAttr(eps));
    return success();
  }
};

/// 4. x * rsqrt(mean(x^2) + eps) (or x / sqrt(...)) -> rms_norm(x).
struct RaiseRmsNorm : RewritePattern {
  RaiseRmsNorm(MLIRContext *ctx) : RewritePattern(MatchAnyOpTypeTag(), 1, ctx) {}
  LogicalResult matchAndRewrite(Operation *op, PatternRewriter &rw) const override {
    Value x, norm;
    if (auto mul = dyn_cast<MulOp>(op)) {
      if (!eitherSide(mul, [](Value a, Value) { return (bool)matchRsqrt(a); }, norm, x))
        return failure();
      norm = matchRsqrt(norm);
    } else if (auto div = dyn_cast<DivOp>(op)) {
      auto s = div.getRhs().getDefiningOp<SqrtOp>();
      if (!s)
        return failure();
      x = div.getLhs();
      norm = s.getInput();
    } else {
      return failure();
    }
    Value squared;
    double eps;
    int64_t axis;
    if (!matchMeanSquarePlusEps(norm, squared, eps, axis) || squared != x ||
        x.getType() != op->getResult(0).getType())
      return failure();
    rw.replaceOpWithNewOp<RmsNormOp>(op, x.getType(), x, Value(), rw.getI64IntegerAttr(axis),
                                     rw.getF32FloatAttr(eps));
    return success();
  }
};

/// The trailing shape a normalization's scale and bias have.
ArrayRef<int64_t> normShape(Value x, int64_t axis) {
  return cast<RankedTensorType>(x.getType()).getShape().drop_front(axis);
}

/// 3b/4b. norm(x) * w -> norm(x) scale w; layer_norm(x) + b -> ... bias b.
struct FoldNormAffine : RewritePattern {
  FoldNormAffine(MLIRContext *ctx) : RewritePattern(MatchAnyOpTypeTag(), 1, ctx) {}
  LogicalResult matchAndRewrite(Operation *op, PatternRewriter &rw) const override {
    bool isMul = isa<MulOp>(op), isAdd = isa<AddOp>(op);
    if (!isMul && !isAdd)
      return failure();
    Value normV, param;
    auto isNorm = [&](Value a, Value b) {
      if (!singleUse(a) || a.getType() != op->getResult(0).getType())
        return false;
      if (auto ln = a.getDefiningOp<LayerNormOp>())
        return isMul ? !ln.getScale() && !ln.getBias()
                     : !ln.getBias();
      if (auto rms = a.getDefiningOp<RmsNormOp>())
        return isMul && !rms.getScale();
      return false;
    };
    if (!eitherSide(op, isNorm, normV, param))
      return failure();
    Operation *norm = normV.getDefiningOp();
    int64_t axis = isa<LayerNormOp>(norm) ? cast<LayerNormOp>(norm).getAxis()
                                          : cast<RmsNormOp>(norm).getAxis();
    Value x = norm->getOperand(0);
    if (cast<RankedTensorType>(param.getType()).getShape() != normShape(x, axis))
      return failure();
    if (auto ln = dyn_cast<LayerNormOp>(norm)) {
      Value scale = isMul ? param : ln.getScale();
      Value bias = isMul ? Value() : param;
      // A bias without a scale is only exact when there was no scale to apply
      // after it, which holds here: the bias is the last op of the chain.
      rw.replaceOpWithNewOp<LayerNormOp>(op, op->getResult(0).getType(), x, scale, bias,
                                         ln.getAxisAttr(), ln.getEpsilonAttr());
    } else {
      auto rms = cast<RmsNormOp>(norm);
      rw.replaceOpWithNewOp<RmsNormOp>(op, op->getResult(0).getType(), x, param,
                                       rms.getAxisAttr(), rms.getEpsilonAttr());
    }
    return success();
  }
};

/// True if the constant `cond` (broadcast to [..., Tq, Tk]) is true exactly
/// where j > i (the masked, future positions).
bool isCausalCondition(Value cond, int64_t tq, int64_t tk, bool maskedWhenTrue) {
  auto c = cond.getDefiningOp<ConstantOp>();
  if (!c)
    return false;
  auto dense = dyn_cast<DenseElementsAttr>(c.getValue());
  auto type = cast<RankedTensorType>(cond.getType());
  if (!dense || type.getRank() < 2 || type.getShape().back() != tk ||
      type.getShape()[type.getRank() - 2] != tq || tq != tk)
    return false;
  auto values = dense.getValues<bool>();
  int64_t n = type.getNumElements();
  for (int64_t k = 0; k < n; ++k) {
    int64_t j = k % tk, i = (k / tk) % tq;
    bool masked = values[k] == maskedWhenTrue;
    if (masked != (j > i))
      return false;
  }
  return true;
}

/// True if `mask` is a constant additive causal mask (broadcast to [..., Tq,
/// Tk], every leading dimension 1): 0 where j <= i, and where j > i -inf or
/// a value at or below -1e30 (Hugging Face's finfo(float32).min). Adding it
/// is the causal mask exactly: a masked score plus such a value has an
/// exponential of 0 in f32 unless the score is beyond 1e29, and never
/// reaches the row's maximum, which its diagonal sets.
bool isAdditiveCausal(Value mask, int64_t tq, int64_t tk) {
  auto c = mask.getDefiningOp<ConstantOp>();
  if (!c || tq != tk)
    return false;
  auto type = cast<RankedTensorType>(mask.getType());
  if (!type.getElementType().isF32() || type.getRank() < 2 || type.getShape().back() != tk ||
      type.getShape()[type.getRank() - 2] != tq || type.getNumElements() != tq * tk)
    return false;
  // Inline (dense) or a blob (dense_resource: an exported buffer's slice).
  std::vector<float> values;
  if (auto dense = dyn_cast<DenseElementsAttr>(c.getValue())) {
    auto all = dense.getValues<float>();
    values.assign(all.begin(), all.end());
  } else if (auto res = dyn_cast<DenseResourceElementsAttr>(c.getValue())) {
    AsmResourceBlob *blob = res.getRawHandle().getBlob();
    if (!blob || blob->getData().size() != size_t(tq * tk) * sizeof(float))
      return false;
    values.resize(tq * tk);
    std::memcpy(values.data(), blob->getData().data(), values.size() * sizeof(float));
  } else {
    return false;
  }
  if (values.size() != size_t(tq * tk))
    return false;
  for (int64_t e = 0; e < tq * tk; ++e) {
    const int64_t j = e % tk, i = e / tk;
    const float v = values[e];
    if (j <= i ? v != 0.0f : !(v <= -1e30f))
      return false;
  }
  return true;
}

/// 5. softmax(scale(q @ k^T) [masked]) @ v -> attention(q, k, v).
struct RaiseAttention : OpRewritePattern<MatmulOp> {
  RaiseAttention(MLIRContext *ctx, bool learnedMasks)
      : OpRewritePattern(ctx), learnedMasks(learnedMasks) {}
  bool learnedMasks;
  LogicalResult matchAndRewrite(MatmulOp op, PatternRewriter &rw) const override {
    auto softmax = op.getLhs().getDefiningOp<SoftmaxOp>();
    if (!softmax || !singleUse(softmax.getResult()))
      return failure();
    auto probsType = cast<RankedTensorType>(softmax.getType());
    int64_t rank = probsType.getRank();
    if (rank < 2 || (int64_t)softmax.getAxis() != rank - 1)
      return failure();
    int64_t tq = probsType.getShape()[rank - 2], tk = probsType.getShape()[rank - 1];
    Value scores = softmax.getInput();
    Value mask;
    bool causal = false;
    if (auto where = scores.getDefiningOp<WhereOp>()) {
      if (!singleUse(scores))
        return failure();
      // where(future, -inf, s) or where(past, s, -inf)
      auto isNegInf = [](Value v) {
        auto s = splatValue(v);
        return s && (std::isinf(*s) && *s < 0);
      };
      if (isNegInf(where.getOnTrue()) &&
          isCausalCondition(where.getCondition(), tq, tk, /*maskedWhenTrue=*/true))
        scores = where.getOnFalse();
      else if (isNegInf(where.getOnFalse()) &&
               isCausalCondition(where.getCondition(), tq, tk, /*maskedWhenTrue=*/false))
        scores = where.getOnTrue();
      else
        return failure();
      causal = true;
    } else if (auto add = scores.getDefiningOp<AddOp>()) {
      if (!singleUse(scores))
        return failure();
      // The scores side is q @ k^T, possibly scaled; the other side is the mask
      // (which may itself be a product, as BERT's (1 - m) * -10000 is).
      auto isScaledQK = [](Value a, Value) {
        if (a.getDefiningOp<MatmulOp>())
          return true;
        Operation *op = a.getDefiningOp();
        if (!op || !isa<MulOp, DivOp>(op))
          return false;
        return (bool)op->getOperand(0).getDefiningOp<MatmulOp>() ||
               (isa<MulOp>(op) && op->getOperand(1).getDefiningOp<MatmulOp>());
      };
      if (!eitherSide(add, isScaledQK, scores, mask))
        return failure();
      if (scores.getType() != add.getType())
        return failure();
      // A learned additive bias (T5's relative position buckets, Swin's
      // table) needs its gradient, which carve.attention gives no mask: keep
      // the ops. (Decided before the rewriter creates anything.)
      if (dependsOnTrainable(mask, /*gatheredOnly=*/!learnedMasks))
        return failure();
      // A constant additive causal mask (0 and finfo.min, as Hugging Face
      // builds one) is the causal flag: no mask tensor, half the pairs.
      if (isAdditiveCausal(mask, tq, tk)) {
        mask = Value();
        causal = true;
      }
    }
    double scale = 1.0;
    Value qk = scores;
    if (auto mul = scores.getDefiningOp<MulOp>()) {
      Value c, s;
      if (!singleUse(scores) ||
          !eitherSide(mul, [](Value a, Value b) { return splatValue(a) && scalarLike(a, b); },
                      c, s))
        return failure();
      scale = *splatValue(c);
      qk = s;
    } else if (auto div = scores.getDefiningOp<DivOp>()) {
      if (!singleUse(scores) || !splatValue(div.getRhs()) ||
          !scalarLike(div.getRhs(), div.getLhs()))
        return failure();
      scale = 1.0 / *splatValue(div.getRhs());
      qk = div.getLhs();
    }
    auto qkMatmul = qk.getDefiningOp<MatmulOp>();
    if (!qkMatmul || !singleUse(qk))
      return failure();
    Value q = qkMatmul.getLhs(), kT = qkMatmul.getRhs(), v = op.getRhs();
    auto qType = cast<RankedTensorType>(q.getType());
    if (qType.getRank() != rank || cast<RankedTensorType>(kT.getType()).getRank() != rank ||
        cast<RankedTensorType>(v.getType()).getRank() != rank)
      return failure();
    Value k;
    SmallVector<int64_t> swap;
    for (int64_t d = 0; d < rank; ++d)
      swap.push_back(d);
    std::swap(swap[rank - 1], swap[rank - 2]);
    auto tr = kT.getDefiningOp<TransposeOp>();
    if (tr && tr.getPerm() == ArrayRef<int64_t>(swap)) {
      k = tr.getInput();
    } else {
      auto kTType = cast<RankedTensorType>(kT.getType());
      SmallVector<int64_t> shape(kTType.getShape());
      std::swap(shape[rank - 1], shape[rank - 2]);
      k = TransposeOp::create(rw, op.getLoc(),
                              RankedTensorType::get(shape, kTType.getElementType()), kT,
                              rw.getDenseI64ArrayAttr(swap));
    }
    auto kType = cast<RankedTensorType>(k.getType());
    auto vType = cast<RankedTensorType>(v.getType());
    if (qType.getShape().drop_back(2) != kType.getShape().drop_back(2) ||
        qType.getShape().drop_back(2) != vType.getShape().drop_back(2) ||
        vType.getShape()[rank - 2] != tk)
      return failure();
    if (mask && cast<RankedTensorType>(mask.getType()).getElementType() !=
                    qType.getElementType())
      return failure();

    rw.replaceOpWithNewOp<AttentionOp>(op, op.getType(), q, k, v, mask,
                                       rw.getF32FloatAttr(scale), rw.getBoolAttr(causal));
    return success();
  }
};

/// 6. (x * cos) + (rotate_half(x) * sin) -> rotary(x, cos, sin), where
/// rotate_half(x) = concat(-x[..., d/2:], x[..., :d/2]) over the last
/// dimension (Hugging Face's apply_rotary_pos_emb), any operand order, and
/// cos and sin depend on no trainable value (they get no gradient).
struct RaiseRotary : OpRewritePattern<AddOp> {
  using OpRewritePattern::OpRewritePattern;

  /// `v` as slice(x) of the last dimension [from, to), whole elsewhere, step 1.
  static bool lastSlice(Value v, Value &x, int64_t from, int64_t to) {
    auto s = v.getDefiningOp<SliceOp>();
    if (!s || !singleUse(v))
      return false;
    ArrayRef<int64_t> shape = cast<RankedTensorType>(s.getInput().getType()).getShape();
    const int64_t r = shape.size();
    for (int64_t i = 0; i < r; ++i) {
      const int64_t lo = i + 1 == r ? from : 0, hi = i + 1 == r ? to : shape[i];
      if (s.getStarts()[i] != lo || s.getEnds()[i] != hi || s.getSteps()[i] != 1)
        return false;
    }
    x = s.getInput();
    return true;
  }

  /// `r` as rotate_half(x): concat(neg(x[..., h:]), x[..., :h]) on the last axis.
  static bool rotateHalf(Value r, Value &x) {
    auto cat = r.getDefiningOp<ConcatOp>();
    if (!cat || !singleUse(r) || cat->getNumOperands() != 2)
      return false;
    auto type = cast<RankedTensorType>(r.getType());
    const int64_t rank = type.getRank(), d = rank ? type.getShape().back() : 0;
    if (rank == 0 || d % 2 != 0 || (cat.getAxis() != rank - 1 && cat.getAxis() != -1))
      return false;
    auto neg = cat->getOperand(0).getDefiningOp<NegOp>();
    Value a, b;
    if (!neg || !singleUse(neg.getResult()) || !lastSlice(neg.getInput(), a, d / 2, d) ||
        !lastSlice(cat->getOperand(1), b, 0, d / 2) || a != b || a.getType() != r.getType())
      return false;
    x = a;
    return true;
  }

  LogicalResult matchAndRewrite(AddOp op, PatternRewriter &rw) const override {
    for (int k = 0; k < 2; ++k) {
      auto plain = op->getOperand(k).getDefiningOp<MulOp>();
      auto rotated = op->getOperand(1 - k).getDefiningOp<MulOp>();
      if (!plain || !rotated || !singleUse(plain.getResult()) || !singleUse(rotated.getResult()))
        continue;
      // rotated = rotate_half(x) * sin, either order.
      Value x, rot, sin;
      if (!eitherSide(
              rotated, [&](Value a, Value) { return rotateHalf(a, x); }, rot, sin))
        continue;
      // plain = x * cos, either order.
      Value xv, cos;
      if (!eitherSide(
              plain, [&](Value a, Value) { return a == x; }, xv, cos))
        continue;
      auto xt = cast<RankedTensorType>(x.getType());
      // f32 (the kernels' type; other precisions come from the plan).
      if (op.getType() != xt || !xt.getElementType().isF32() || plain.getType() != xt ||
          rotated.getType() != xt ||
          cast<RankedTensorType>(cos.getType()).getElementType() != xt.getElementType() ||
          cast<RankedTensorType>(sin.getType()).getElementType() != xt.getElementType())
        continue;
      // The tables get no gradient: positions, never a trained value.
      if (dependsOnTrainable(cos, false) || dependsOnTrainable(sin, false))
        continue;
      rw.replaceOpWithNewOp<RotaryOp>(op, xt, x, cos, sin);
      return success();
    }
    return failure();
  }
};

struct CarveRaisePass : carve::impl::CarveRaiseBase<CarveRaisePass> {
  using CarveRaiseBase::CarveRaiseBase;
  void runOnOperation() override {
    RewritePatternSet patterns(&getContext());
    patterns.add<RaiseSilu, RaiseGelu, RaiseLayerNorm, RaiseRmsNorm, FoldNormAffine, RaiseRotary>(
        &getContext());
    patterns.add<RaiseAttention>(&getContext(), learnedMasks);
    // Count raised roots by the ops the patterns create.
    int64_t before = 0, after = 0;
    auto count = [&]() {
      int64_t n = 0;
      getOperation().walk([&](Operation *op) {
        if (isa<SiluOp, GeluOp, LayerNormOp, RmsNormOp, RotaryOp, AttentionOp>(op))
          ++n;
      });
      return n;
    };
    before = count();
    if (failed(applyPatternsGreedily(getOperation(), std::move(patterns))))
      return signalPassFailure();
    after = count();
    numRaised += after - before;
  }
};

} // namespace
