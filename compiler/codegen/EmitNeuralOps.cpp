//===- EmitNeuralOps.cpp - norms, attention, dropout, cross-entropy -------===//
//
// The op emitters of EmitOps.cpp for the ops with more than one runtime
// form: normalizations (fused with the residual's gradient where the plan
// says so), rotary embeddings (16-bit reads and copies), attention (carve's kernel or cuDNN's, q, k
// and v read in place), dropout's Philox masks, and cross-entropy (vocab-parallel under tp, 16-bit
// logits under bf16/fp16).
//
//===----------------------------------------------------------------------===//

#include "compiler/codegen/EmitUtil.h"
#include "compiler/codegen/Generator.h"

#include "llvm/Support/Format.h"

using namespace mlir;

namespace carve::codegen {

/// A norm gradient's 16-bit entry's input gradient (no residual add): its
/// f32 value (null where only its copy is read) and its 16-bit copy where
/// the gradient writes it (rule 3h; null otherwise).
std::string Generator::inputGradArgs(Operation *op) {
  Value copy = copyByWriter(op, 0);
  return resultOrCopyOnly(op->getResult(0), copy) + ", " +
         (copy ? name(copy) : std::string("nullptr"));
}

bool Generator::emitNormalization(Operation *op, llvm::raw_ostream &os) {
  Value res = op->getNumResults() ? op->getResult(0) : Value();
  // A gradient marked to compute the add that reads its input gradient
  // (rule 4c): the residual it adds, then the add's result and its 16-bit
  // copy (or null) where the input gradient would go.
  Value residual = accumulatedResidual(op);
  std::string inputGrad;
  if (residual) {
    Value sum = producedInto(op->getResult(0));
    Value copy = copyByWriter(sum.getDefiningOp(), 0);
    inputGrad = name(residual) + ", " + resultOrCopyOnly(sum, copy) + ", " +
                (copy ? name(copy) : std::string("nullptr"));
  } else if (isa<LayerNormGradOp, RmsNormGradOp>(op)) {
    inputGrad = name(op->getResult(0));
  }
  if (op->hasAttr(kRead16Attr)) {
    // carve.read16 (rule 3g): the input, scale or bias read as the 16-bit
    // tensors of their values (layer_norm16, ...).
    auto arg = [&](Value v, const char *flagName, std::string &out) {
      if (!v) {
        out = nullOf(op->getOperand(0)) + ", " + flag(flagName, false);
        return true;
      }
      unsigned k = 0;
      while (op->getOperand(k) != v)
        ++k;
      std::string p;
      bool is16;
      if (!exact16Operand(op, k, p, is16))
        return false;
      out = p + ", " + flag(flagName, is16);
      return true;
    };
    std::string x, scale, bias;
    if (auto ln = dyn_cast<LayerNormOp>(op)) {
      if (!arg(ln.getInput(), "x16", x) || !arg(ln.getScale(), "scale16", scale) ||
          !arg(ln.getBias(), "bias16", bias))
        return false;
      os << callee(opts, "layer_norm16") + "(" << x << ", " << shapeOf(ln.getInput()) << ", "
         << ln.getAxis() << ", " << scale << ", " << bias << ", "
         << scalar(ln.getEpsilon().convertToDouble(), ln.getInput()) << ", " << resultOrNull(res)
         << ", " << copyArgs(op) << ");";
    } else if (auto g = dyn_cast<LayerNormGradOp>(op)) {
      if (!arg(g.getInput(), "x16", x) || !arg(g.getScale(), "scale16", scale))
        return false;
      // The scale and bias gradients' 16-bit casts where they write them
      // (rule 3h), the f32 sums where stored.
      Value s16 = copyByWriter(op, 1), b16 = copyByWriter(op, 2);
      os << callee(opts, residual ? "layer_norm_grad_add16" : "layer_norm_grad16") + "(" << x
         << ", " << shapeOf(g.getInput()) << ", " << g.getAxis() << ", " << scale << ", "
         << scalar(g.getEpsilon().convertToDouble(), g.getInput()) << ", " << name(g.getGrad())
         << ", " << (residual ? inputGrad : inputGradArgs(op)) << ", "
         << resultOrNull(g.getScaleGrad()) << ", " << resultOrNull(g.getBiasGrad()) << ", "
         << (s16 ? name(s16) : std::string("nullptr")) << ", "
         << (b16 ? name(b16) : std::string("nullptr")) << ");";
    } else if (auto rn = dyn_cast<RmsNormOp>(op)) {
      if (!arg(rn.getInput(), "x16", x) || !arg(rn.getScale(), "scale16", scale))
        return false;
      os << callee(opts, "rms_norm16") + "(" << x << ", " << shapeOf(rn.getInput()) << ", "
         << rn.getAxis() << ", " << scale << ", "
         << scalar(rn.getEpsilon().convertToDouble(), rn.getInput()) << ", " << resultOrNull(res)
         << ", " << copyArgs(op) << ");";
    } else if (auto g = dyn_cast<RmsNormGradOp>(op)) {
      if (!arg(g.getInput(), "x16", x) || !arg(g.getScale(), "scale16", scale))
        return false;
      Value s16 = copyByWriter(op, 1);
      os << callee(opts, residual ? "rms_norm_grad_add16" : "rms_norm_grad16") + "(" << x << ", "
         << shapeOf(g.getInput()) << ", " << g.getAxis() << ", " << scale << ", "
         << scalar(g.getEpsilon().convertToDouble(), g.getInput()) << ", " << name(g.getGrad())
         << ", " << (residual ? inputGrad : inputGradArgs(op)) << ", "
         << resultOrNull(g.getScaleGrad()) << ", " << (s16 ? name(s16) : std::string("nullptr"))
         << ");";
    }
    return true;
  }
  if (auto ln = dyn_cast<LayerNormOp>(op)) {
    Value x = ln.getInput();
    os << callee(opts, "layer_norm") + "(" << name(x) << ", " << shapeOf(x) << ", " << ln.getAxis()
       << ", " << (ln.getScale() ? name(ln.getScale()) : nullOf(x)) << ", "
       << (ln.getBias() ? name(ln.getBias()) : nullOf(x)) << ", "
       << scalar(ln.getEpsilon().convertToDouble(), x) << ", " << name(res) << ");";
  } else if (auto g = dyn_cast<LayerNormGradOp>(op)) {
    Value x = g.getInput();
    if (residual)
      inputGrad = name(residual) + ", " + name(producedInto(op->getResult(0)));
    os << callee(opts, residual ? "layer_norm_grad_add" : "layer_norm_grad") + "(" << name(x)
       << ", " << shapeOf(x) << ", " << g.getAxis() << ", "
       << (g.getScale() ? name(g.getScale()) : nullOf(x)) << ", "
       << scalar(g.getEpsilon().convertToDouble(), x) << ", " << name(g.getGrad()) << ", "
       << inputGrad << ", " << name(g.getScaleGrad()) << ", " << name(g.getBiasGrad()) << ");";
  } else if (auto rn = dyn_cast<RmsNormOp>(op)) {
    Value x = rn.getInput();
    os << callee(opts, "rms_norm") + "(" << name(x) << ", " << shapeOf(x) << ", " << rn.getAxis()
       << ", " << (rn.getScale() ? name(rn.getScale()) : nullOf(x)) << ", "
       << scalar(rn.getEpsilon().convertToDouble(), x) << ", " << name(res) << ");";
  } else if (auto g = dyn_cast<RmsNormGradOp>(op)) {
    Value x = g.getInput();
    if (residual)
      inputGrad = name(residual) + ", " + name(producedInto(op->getResult(0)));
    os << callee(opts, residual ? "rms_norm_grad_add" : "rms_norm_grad") + "(" << name(x) << ", "
       << shapeOf(x) << ", " << g.getAxis() << ", "
       << (g.getScale() ? name(g.getScale()) : nullOf(x)) << ", "
       << scalar(g.getEpsilon().convertToDouble(), x) << ", " << name(g.getGrad()) << ", "
       << inputGrad << ", " << name(g.getScaleGrad()) << ");";
  }
  return true;
}

/// The 16-bit copy of an attention gradient's result `i` (dq, dk, dv) that
/// the gradient writes (carve.copy_by_writer, among the casts right after
/// it), or null.
Value Generator::gradCopy16(Operation *op, unsigned i) {
  for (Operation *n = op->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode())
    if (n->getOperand(0) == op->getResult(i) && n->hasAttr(kCopyByWriterAttr))
      return n->getResult(0);
  return Value();
}

/// Rotary position embedding and its gradient: x (or dy), cos, sin with
/// their shapes, then the result; rotary16 / rotary_grad16: x read as its
/// 16-bit tensor where flagged (rule 3g), the result's 16-bit copy written
/// with it (rule 3h).
bool Generator::emitRotary(Operation *op, StringRef kernel, llvm::raw_ostream &os) {
  std::string x = opnd(op, 0);
  const bool entry16 = kernel.ends_with("16");
  if (entry16) {
    bool x16;
    if (!exact16Operand(op, 0, x, x16))
      return false;
    x += ", " + flag(isa<RotaryOp>(op) ? "x16" : "dy16", x16);
  }
  Value res = op->getResult(0);
  os << callee(opts, kernel.str()) << "(" << x << ", " << oshape(op, 0) << ", " << opnd(op, 1)
     << ", " << oshape(op, 1) << ", " << opnd(op, 2) << ", " << oshape(op, 2) << ", "
     << (entry16 ? resultOrCopyOnly(res, copyByWriter(op)) + ", " + copyArgs(op) : name(res))
     << ");";
  return true;
}

/// A convolution kept whole (CUDA target): its two operands, each with its
/// 16-bit flag (carve.read16: the operand's 16-bit tensor read as stored) and
/// its shape, the geometry (carve::gpu::Conv2dGeometry: strides, pads,
/// dilations, group), then the result, its 16-bit copy and its shape.
bool Generator::emitConvolution(Operation *op, StringRef kernel, llvm::raw_ostream &os) {
  auto list = [](ArrayRef<int64_t> v) {
    std::string s = "{";
    for (size_t i = 0; i < v.size(); ++i)
      s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "}";
  };
  auto geometry = [&](auto c) {
    return "carve::gpu::Conv2dGeometry{" + list(c.getStrides()) + ", " + list(c.getPads()) + ", " +
           list(c.getDilations()) + ", " + std::to_string(c.getGroup()) + "}";
  };
  std::string geo;
  if (auto c = dyn_cast<Conv2dOp>(op))
    geo = geometry(c);
  else if (auto c = dyn_cast<Conv2dGradInputOp>(op))
    geo = geometry(c);
  else
    geo = geometry(cast<Conv2dGradWeightOp>(op));
  static const char *const flags[3][2] = {{"x16", "w16"}, {"dy16", "w16"}, {"x16", "dy16"}};
  const int which = isa<Conv2dOp>(op) ? 0 : isa<Conv2dGradInputOp>(op) ? 1 : 2;
  auto read16 = op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
  if (read16 && read16.size() != 2)
    return failOp(op, "carve.read16 needs one flag per operand on a convolution");
  std::string in[2];
  for (unsigned k = 0; k < 2; ++k) {
    const bool is16 = read16 && read16[k];
    in[k] = opnd(op, k);
    if (is16) {
      // The tensor the call would round the operand to (stored16).
      Value s16 = stored16(op->getOperand(k), op, opts.precision);
      if (!s16)
        return failOp(op, "carve.read16 marks an operand with no 16-bit tensor of its bits (no "
                          "view of one, no 16-bit copy before the call)");
      in[k] = name(s16);
    }
    in[k] += ", " + flag(flags[which][k], is16) + ", " + oshape(op, k);
  }
  // The result, or nullptr where only its 16-bit copy is stored, and that
  // copy where the call writes it (rule 3h).
  Value res = op->getResult(0), copy = copyByWriter(op);
  os << callee(opts, kernel.str()) << "(" << in[0] << ", " << in[1] << ", " << geo << ", "
     << resultOrCopyOnly(res, copy) << ", " << (copy ? name(copy) : std::string("nullptr")) << ", "
     << shapeOf(res) << ");";
  return true;
}

/// For an attention operand's 16-bit copy `c` marked "strided"
/// (carve-fold-views): `out` becomes the piece's first element in its
/// source's copy, `rowStride` the source's width (the same for all three
/// operands), and `count` counts it.
bool Generator::stridedCopy(Value c, std::string &out, int64_t &rowStride, int &count) {
  std::optional<StridedPiece> piece = stridedPieceOf(c.getDefiningOp());
  if (!piece)
    return true;
  if (!bufferOf.count(aliasRoot(piece->source16)))
    return failOp(c.getDefiningOp(), "carve.fold = \"strided\" on a copy whose source's 16-bit "
                                     "copy is not in memory");
  if (rowStride && rowStride != piece->rowStride)
    return failOp(c.getDefiningOp(), "carve.fold = \"strided\" on q, k and v of sources of "
                                     "different widths");
  rowStride = piece->rowStride;
  out = name(piece->source16) + " + " + std::to_string(piece->column);
  ++count;
  return true;
}

/// Fused scaled dot-product attention and its gradient.
bool Generator::emitAttention(Operation *op, llvm::raw_ostream &os) {
  Value res = op->getNumResults() ? op->getResult(0) : Value();
  if (auto at = dyn_cast<AttentionOp>(op)) {
    Value q = at.getQuery(), k = at.getKey(), v = at.getValue(), mk = at.getMask();
    os << callee(opts, "attention") + "(" << name(q) << ", " << shapeOf(q) << ", " << name(k)
       << ", " << shapeOf(k) << ", " << name(v) << ", " << shapeOf(v) << ", "
       << (mk ? name(mk) : nullOf(q)) << ", " << (mk ? shapeOf(mk) : "{}") << ", "
       << scalar(at.getScale().convertToDouble(), q) << ", " << flag("causal", at.getCausal())
       << ", " << name(res) << ");";
  } else if (auto g = dyn_cast<AttentionGradOp>(op)) {
    Value q = g.getQuery(), k = g.getKey(), v = g.getValue(), mk = g.getMask();
    os << callee(opts, "attention_grad") + "(" << name(q) << ", " << shapeOf(q) << ", " << name(k)
       << ", " << shapeOf(k) << ", " << name(v) << ", " << shapeOf(v) << ", "
       << (mk ? name(mk) : nullOf(q)) << ", " << (mk ? shapeOf(mk) : "{}") << ", "
       << scalar(g.getScale().convertToDouble(), q) << ", " << flag("causal", g.getCausal()) << ", "
       << name(g.getGrad()) << ", " << name(g.getQueryGrad()) << ", " << name(g.getKeyGrad())
       << ", " << name(g.getValueGrad()) << ");";
  } else if (auto at = dyn_cast<AttentionStatsOp>(op);
             at && kernelOf(op) == "attention_stats_cudnn") {
    // cuDNN's forward: beside each of q, k, v its 16-bit copy where
    // carve-pack-activations made one before the call and carve.read16 says
    // the call reads it (null: the call converts).
    auto flags = op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
    if (flags && flags.size() != 3)
      return failOp(op, "carve.read16 on an attention needs 3 flags (q, k, v)");
    std::string args[3];
    int64_t inRowStride = 0;
    int strided = 0;
    for (unsigned i = 0; i < 3; ++i) {
      Value x = op->getOperand(i);
      std::string copy = "nullptr", f32 = name(x);
      if (flags && flags[i]) {
        Value c = copy16BeforeView(x, op, opts.precision);
        if (!c)
          return failOp(op, "carve.read16 marks an attention operand with no 16-bit copy before "
                            "it");
        copy = name(c);
        if (!stridedCopy(c, copy, inRowStride, strided))
          return false;
        if (!bufferOf.count(aliasRoot(x)))
          f32 = nullOf(x); // never stored (neverStoredF32): the copy only
      }
      args[i] = f32 + ", " + copy + ", " + shapeOf(x);
    }
    if (strided != 0 && strided != 3)
      return failOp(op, "carve.fold = \"strided\" on some of the attention's q, k and v but not "
                        "all three");
    Value q = at.getQuery(), mk = at.getMask();
    // carve-fold-views: O written in 16 bits, as [b, t, h, d], into its
    // transpose's copy (no f32 O).
    Value o16 = outputCopy16(at.getResult());
    os << callee(opts, kernelOf(op)) + "(" << args[0] << ", " << args[1] << ", " << args[2] << ", "
       << (mk ? name(mk) : nullOf(q)) << ", " << (mk ? shapeOf(mk) : "{}") << ", "
       << scalar(at.getScale().convertToDouble(), q) << ", " << flag("causal", at.getCausal())
       << ", " << (o16 ? std::string("(float *)nullptr") : name(at.getResult())) << ", "
       << name(at.getLse())
       << (o16 || strided ? ", " + (o16 ? name(o16) : std::string("nullptr")) : std::string())
       << (strided ? ", " + std::to_string(inRowStride) : std::string())
       << (strided ? ");  // q, k, v read in place in the rows of their source's 16-bit copy"
                   : ");");
  } else if (auto at = dyn_cast<AttentionStatsOp>(op)) {
    // carve-save-attention-stats: the row log-sum-exp kept for the gradient.
    Value q = at.getQuery(), k = at.getKey(), v = at.getValue(), mk = at.getMask();
    os << callee(opts, kernelOf(op)) + "(" << name(q) << ", " << shapeOf(q) << ", " << name(k)
       << ", " << shapeOf(k) << ", " << name(v) << ", " << shapeOf(v) << ", "
       << (mk ? name(mk) : nullOf(q)) << ", " << (mk ? shapeOf(mk) : "{}") << ", "
       << scalar(at.getScale().convertToDouble(), q) << ", " << flag("causal", at.getCausal())
       << ", " << name(at.getResult()) << ", " << name(at.getLse()) << ");";
  } else if (auto g = dyn_cast<AttentionGradStatsOp>(op)) {
    Value q = g.getQuery(), k = g.getKey(), v = g.getValue(), mk = g.getMask();
    if (kernelOf(op) == "attention_grad_stats_cudnn") {
      // q, k and v as the 16-bit tensors they are views of, where
      // carve.read16 says so (carve-select-kernels' rule 3c).
      auto flags = op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
      if (flags && flags.size() != 3)
        return failOp(op, "carve.read16 on an attention gradient needs 3 flags (q, k, v)");
      std::string args[3];
      int64_t inRowStride = 0;
      int strided = 0;
      for (unsigned i = 0; i < 3; ++i) {
        Value x = op->getOperand(i);
        const bool is16 = flags && flags[i];
        std::string src = name(x);
        if (is16) {
          Value s16 = stored16(x, op, opts.precision);
          if (!s16)
            return failOp(op, "carve.read16 marks an attention operand with no 16-bit tensor of "
                              "its bits");
          src = name(s16);
          if (!stridedCopy(s16, src, inRowStride, strided))
            return false;
        }
        args[i] = src + ", " +
                  flag(i == 0   ? "q16"
                       : i == 1 ? "k16"
                                : "v16",
                       is16) +
                  ", " + shapeOf(x);
      }
      // carve-fold-views: dy read as [b, t, h, d], its transpose's input; o
      // as the forward wrote it, in 16 bits into its transpose's copy.
      Value dyIn = consumedFrom(g.getGrad());
      Value o16 = outputCopy16(g.getOutput());
      // dy written in 16 bits only by its matmul (carve.write16): its copy.
      Value dy = dyIn ? dyIn : g.getGrad(), dy16;
      if (Operation *w = aliasRoot(dy).getDefiningOp(); w && w->hasAttr(kWrite16Attr)) {
        dy16 = copy16Before(aliasRoot(dy), op, opts.precision);
        if (!dy16)
          return failOp(op, "the attention gradient's dy is not in memory and has no 16-bit copy");
      }
      if (strided != 0 && strided != 3)
        return failOp(op, "carve.fold = \"strided\" on some of the attention gradient's q, k and "
                          "v but not all three");
      os << callee(opts, kernelOf(op)) + "(" << args[0] << ", " << args[1] << ", " << args[2]
         << ", " << (mk ? name(mk) : nullOf(q)) << ", " << (mk ? shapeOf(mk) : "{}") << ", "
         << scalar(g.getScale().convertToDouble(), q) << ", " << flag("causal", g.getCausal())
         << ", " << (o16 ? nullOf(g.getOutput()) : name(g.getOutput())) << ", " << name(g.getLse())
         << ", " << (dy16 ? nullOf(dy) : name(dy)) << ", ";
      // carve-fold-views: dq, dk, dv written as [b, t, h, d] in their
      // transposes' places, all three or none.
      Value grads[3] = {g.getQueryGrad(), g.getKeyGrad(), g.getValueGrad()};
      const int produced = (int)(bool)producedInto(grads[0]) + (int)(bool)producedInto(grads[1]) +
                           (int)(bool)producedInto(grads[2]);
      if (produced != 0 && produced != 3)
        return failOp(op, "carve.fold = \"producer\" on the transposes of some of the attention "
                          "gradient's dq, dk and dv but not all three");
      // carve-fold-views' "assemble": the transposes are pieces of a concat
      // whose 16-bit copy cuDNN writes them into, at their columns.
      std::string dst16[3] = {"nullptr", "nullptr", "nullptr"};
      int64_t rowStride = 0, assembled = 0;
      Operation *concat = nullptr;
      for (int i = 0; i < 3 && produced; ++i) {
        int64_t column = 0;
        Operation *t = producedInto(grads[i]).getDefiningOp();
        Operation *c = assembledInto(t, column);
        if (!c || (concat && c != concat) || !assembledConcats.count(c))
          continue;
        concat = c;
        dst16[i] = name(assembledConcats.lookup(c)) + " + " + std::to_string(column);
        rowStride = typeOf(c->getResult(0)).getShape().back();
        ++assembled;
      }
      if (assembled != 0 && assembled != 3)
        return failOp(op, "carve.fold = \"assemble\" on a concat of some of the attention "
                          "gradient's dq, dk and dv but not all three");
      // carve-round-operands16's 16-bit copies of dq, dk, dv, which their
      // readers read: cuDNN writes them (carve.copy_by_writer), shaped as q,
      // k and v; the f32 values only where stored.
      int copied = 0;
      for (int i = 0; i < 3 && !produced; ++i)
        if (Value c = gradCopy16(op, i)) {
          dst16[i] = name(c);
          ++copied;
        }
      if (copied != 0 && copied != 3)
        return failOp(op, "16-bit copies written by the attention gradient of some of its dq, "
                          "dk and dv but not all three");
      for (int i = 0; i < 3; ++i)
        os << (i ? ", " : "")
           << (assembled ? std::string("(float *)nullptr")
               : copied  ? resultOrNull(grads[i])
                         : name(produced ? producedInto(grads[i]) : grads[i]));
      os << ", " << flag("bthd", produced) << ", " << flag("dy_bthd", (bool)dyIn) << ", "
         << dst16[0] << ", " << dst16[1] << ", " << dst16[2] << ", " << rowStride << ", "
         << (o16 ? name(o16) : std::string("nullptr")) << ", "
         << (dy16 ? name(dy16) : std::string("nullptr"))
         << (strided ? ", " + std::to_string(inRowStride) : std::string())
         << ");  // from the forward's saved output and log-sum-exp"
         << (strided ? "; q, k, v read in place" : "");
      return true;
    }
    os << callee(opts, kernelOf(op)) + "(" << name(q) << ", " << shapeOf(q) << ", " << name(k)
       << ", " << shapeOf(k) << ", " << name(v) << ", " << shapeOf(v) << ", "
       << (mk ? name(mk) : nullOf(q)) << ", " << (mk ? shapeOf(mk) : "{}") << ", "
       << scalar(g.getScale().convertToDouble(), q) << ", " << flag("causal", g.getCausal()) << ", "
       << name(g.getOutput()) << ", " << name(g.getLse()) << ", " << name(g.getGrad()) << ", "
       << name(g.getQueryGrad()) << ", " << name(g.getKeyGrad()) << ", " << name(g.getValueGrad())
       << ");  // from the forward's saved output and log-sum-exp";
  }
  return true;
}

/// Dropout: the mask of the full tensor (carve/rt/philox.h) at this rank's
/// piece of it, which the call describes: the tp split of the op's result
/// (its dist.layout) and, where the program holds a share of the batch
/// (batch_dim), the share's first sample in the global batch.
bool Generator::emitDropout(DropoutOp d, llvm::raw_ostream &os) {
  Operation *op = d;
  Value res = d.getResult();
  if (!typeOf(res).getElementType().isF32())
    return failOp(op, "dropout takes f32 tensors on the CPU and CUDA targets");
  if (opts.ep > 1)
    return failOp(op, "dropout under expert parallelism (ep > 1) is not supported yet: routed "
                      "tokens have no place in the full tensor that the masks are drawn over");
  int64_t tpDim = -1, groups = 1;
  if (auto ls = op->getAttrOfType<mlir::ArrayAttr>(kLayoutAttr); ls && !ls.empty())
    if (auto l = mlir::dyn_cast<dist::SbpAttr>(ls[0]); l && l.isSplit())
      tpDim = l.getDim(), groups = l.getGroups();
  const int64_t m = std::max(1, opts.numMicroBatches);
  const int64_t micro = opts.globalBatch / std::max<int64_t>(1, opts.dp * m);
  const bool share = d.batchDim() >= 0 && micro < opts.globalBatch;
  const bool pipelined = opts.pp > 1 || m > 1;
  std::vector<int64_t> full(typeOf(res).getShape().begin(), typeOf(res).getShape().end());
  if (tpDim >= 0)
    full[tpDim] *= opts.tp;
  if (share)
    full[d.batchDim()] = full[d.batchDim()] / micro * opts.globalBatch;
  const std::string offset = !share ? "0"
                                    : "((int64_t)ctx.dpRank * " + std::to_string(m) + " + " +
                                          (pipelined ? "mb" : "0") + ") * " + std::to_string(micro);
  os << "// Dropout p=" << number(d.getP().convertToDouble(), false) << " (node " << d.nodeIndex()
     << "): the mask of the full tensor " << shapeText(full);
  if (tpDim >= 0)
    os << ", split over tp along dimension " << tpDim;
  if (share)
    os << ", samples from " << offset << " of the global batch of " << opts.globalBatch
       << " in dimension " << d.batchDim();
  os << "\n  " + callee(opts, "dropout") + "(" << opnd(op, 0)
     << ", carve::rt::philox::DropoutPiece{carve::rt::Dims" << dims(typeOf(res).getShape()) << ", "
     << tpDim << ", " << groups << ", " << (tpDim >= 0 ? opts.tp : 1) << ", "
     << (tpDim >= 0 ? "ctx.tpRank" : "0") << ", " << (share ? d.batchDim() : -1) << ", "
     << d.batchOuter() << ", " << (share ? micro : 1) << ", " << (share ? opts.globalBatch : 1)
     << ", " << offset
     << "}, ctx.evaluating ? 0.0 : " << llvm::format("%.17g", d.getP().convertToDouble())
     << (opts.cuda() ? ", " : ", ctx.seed, ctx.step, ") << d.nodeIndex() << ", " << name(res)
     << ");" << (opts.cuda() ? "  // seed and step: setDropoutState's, on the device" : "");
  return true;
}

/// Cross entropy and its gradient; vocab-parallel where the classes are
/// split over tp.
bool Generator::emitCrossEntropy(Operation *op, StringRef kernel, llvm::raw_ostream &os) {
  Value res = op->getNumResults() ? op->getResult(0) : Value();
  if (isa<CrossEntropyOp, CrossEntropyGradOp>(op)) {
    StringRef red = op->getAttrOfType<StringAttr>("reduction")
                        ? op->getAttrOfType<StringAttr>("reduction").getValue()
                        : StringRef("mean");
    auto ig = op->getAttrOfType<IntegerAttr>("ignore_index");
    Value logits = op->getOperand(0), targets = op->getOperand(1);
    int r = red == "mean" ? 0 : red == "sum" ? 1 : 2;
    const bool vp = kernel.contains("vocab_parallel");
    std::string logitsArg; // cross_entropy16's 16-bit logits, for count_correct16
    auto rows = op->getAttrOfType<IntegerAttr>(kShardedRowsAttr);
    if (vp && !rows)
      return failOp(op, "carve.kernel = \"" + kernel.str() +
                            "\" on a cross-entropy whose classes are not split over tp");
    // Rule 3j: the training step's gradient call computes this loss too.
    if (isa<CrossEntropyOp>(op) && op->hasAttr(kLossInGradAttr))
      os << "if (ctx.evaluating)  // the step's loss: computed with its gradient "
            "(cross_entropy_with_grad)\n    ";
    const bool withGrad = kernel == "cross_entropy_with_grad";
    Value loss;
    if (withGrad) {
      for (Operation *p = op->getPrevNode(); p && !loss; p = p->getPrevNode())
        if (isa<CrossEntropyOp>(p) && p->hasAttr(kLossInGradAttr))
          loss = p->getResult(0);
      if (!loss)
        return failOp(op, "carve.kernel = \"cross_entropy_with_grad\" without the cross-entropy "
                          "before it marked carve.loss_in_grad");
    }
    if (vp) {
      // Vocab-parallel: this rank holds classes [tpRank * C, (tpRank + 1) * C).
      int64_t c = typeOf(logits).getDimSize(1);
      os << "// Vocab-parallel: the classes are split over tp; the kernel all-reduces row\n"
         << "  // maxima, sums of exponentials and the target logits (no rank holds all "
         << rows.getInt() << " logits).\n  " << callee(opts, kernel) << "(*ctx.tpComm, "
         << name(logits) << ", " << shapeOf(logits) << ", (int64_t)ctx.tpRank * " << c << ", ";
    } else if (kernel == "cross_entropy16" || kernel == "cross_entropy_grad16" || withGrad) {
      // carve.read16: the logits' 16-bit tensor; carve.write16: the
      // gradient's 16-bit copy (the next op) instead of the f32 result.
      auto f = op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
      if (!f || f.size() != 1)
        return failOp(op, "carve.kernel = \"" + kernel.str() + "\" without carve.read16 (1 flag)");
      std::string src = name(logits);
      if (f[0]) {
        Value s16 = stored16(logits, op, opts.precision);
        if (!s16)
          return failOp(op, "carve.read16 marks logits with no 16-bit tensor of their bits");
        src = name(s16);
      }
      logitsArg = src;
      os << callee(opts, kernel) << "(" << src << ", ";
      if (kernel == "cross_entropy_grad16" || withGrad)
        os << flag("l16", f[0]) << ", ";
      os << shapeOf(logits) << ", ";
    } else {
      os << callee(opts, kernel) << "(" << name(logits) << ", " << shapeOf(logits) << ", ";
    }
    os << name(targets) << ", " << r << " /*" << red << "*/, " << flag("hasIgnore", (bool)ig)
       << ", " << (ig ? ig.getInt() : 0) << "LL, ";
    if (isa<CrossEntropyGradOp>(op))
      os << opnd(op, 2) << ", ";
    if (kernel == "cross_entropy_grad16" || withGrad) {
      const bool w16 = op->hasAttr(kWrite16Attr);
      Operation *c = op->getNextNode();
      if (w16 && (!c || !isa<CastOp>(c)))
        return failOp(op, "carve.write16 without the 16-bit copy after it");
      os << (w16 ? name(c->getResult(0)) : name(res)) << ", " << flag("d16", w16);
      if (withGrad)
        os << ", " << name(loss) << ");  // and the loss (one pass over the logits)";
      else
        os << ");";
    } else {
      os << name(res) << ");";
    }
    if (isa<CrossEntropyOp>(op)) {
      const bool c16 = kernel == "cross_entropy16";
      os << "\n  if (ctx.evaluating)  // train --eval-data: accuracy (the target's logit is the "
            "largest)\n    " +
                callee(opts, c16 ? "count_correct16" : "count_correct") + "("
         << (vp ? "ctx.tpComm" : "nullptr") << ", " << (c16 ? logitsArg : name(logits)) << ", "
         << shapeOf(logits) << ", "
         << (vp ? "(int64_t)ctx.tpRank * " + std::to_string(typeOf(logits).getDimSize(1))
                : std::string("0"))
         << ", " << name(targets) << ", " << flag("hasIgnore", (bool)ig) << ", "
         << (ig ? ig.getInt() : 0) << "LL, ctx.counts);";
    }
  }
  return true;
}

/// Transpose, slice, concat and expand: copies that move elements.

} // namespace carve::codegen
