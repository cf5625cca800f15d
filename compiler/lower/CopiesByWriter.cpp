//===- CopiesByWriter.cpp - 16-bit copies written by another op's call ----===//
//
// carve-select-kernels' rules 3h and 4d for copies that the call of another
// op than the cast writes: a cuDNN attention gradient's dq, dk, dv, a norm
// gradient's input gradient, the add a norm gradient computes, an assembled
// concat and an attention output's transpose (CopiesByWriter.h).
//
//===----------------------------------------------------------------------===//

#include "compiler/lower/CopiesByWriter.h"

#include "compiler/fusion/Fusion.h"
#include "compiler/lower/Kernels.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"

using namespace mlir;

namespace carve {

namespace {
Type elementOf(Value v) { return cast<ShapedType>(v.getType()).getElementType(); }
} // namespace

/// Rule 3h for cuDNN's attention gradient: the 16-bit copies of dq, dk
/// and dv among the casts right after it (carve-round-operands16 puts them
/// there; all three, or none is taken) are written by the call in 16 bits
/// (the copy is no call, marked carve.copy_by_writer). The same bits:
/// cuDNN writes the gradients in 16 bits, which the call widened before.
unsigned attentionGradCopies(Operation *g, StringRef precision) {
  MLIRContext *ctx = g->getContext();
  Operation *found[3] = {nullptr, nullptr, nullptr};
  for (Operation *n = g->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode()) {
    Type to = elementOf(n->getResult(0));
    if (!((precision == "bf16" && to.isBF16()) || (precision == "fp16" && to.isF16())))
      continue;
    for (unsigned i = 0; i < 3; ++i)
      if (n->getOperand(0) == g->getResult(i) && !found[i])
        found[i] = n;
  }
  if (!found[0] || !found[1] || !found[2])
    return 0;
  for (Operation *n : found) {
    n->setAttr(kKernelAttr, StringAttr::get(ctx, kNoKernel));
    n->setAttr(kCopyByWriterAttr, UnitAttr::get(ctx));
  }
  return 3;
}

/// Rule 3h for cuDNN's convolutions: the first 16-bit copy of the result
/// among the casts right after it is written by the call (the copy is no
/// call, marked carve.copy_by_writer). The same bits: the graph computes the
/// result in 16 bits, which the call widened before.
unsigned convolutionCopy(Operation *c, StringRef precision) {
  MLIRContext *ctx = c->getContext();
  for (Operation *n = c->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode()) {
    StringAttr ck = n->getAttrOfType<StringAttr>(kKernelAttr);
    Type to = elementOf(n->getResult(0));
    if (n->getOperand(0) != c->getResult(0) || !ck ||
        (ck.getValue() != "toBf16" && ck.getValue() != "toF16") ||
        !((precision == "bf16" && to.isBF16()) || (precision == "fp16" && to.isF16())))
      continue;
    n->setAttr(kKernelAttr, StringAttr::get(ctx, kNoKernel));
    n->setAttr(kCopyByWriterAttr, UnitAttr::get(ctx));
    return 1;
  }
  return 0;
}

/// Rule 3h for a layer or RMS norm gradient (not one that computes the add
/// after it, rule 4c): the first 16-bit copy of its input gradient among
/// the copies right after it is written by the gradient's kernel as it
/// writes the input gradient (layer_norm_grad16, rms_norm_grad16; the copy
/// is no call, marked carve.copy_by_writer). The same bits.
unsigned normGradInputCopy(Operation *g, StringRef precision) {
  MLIRContext *ctx = g->getContext();
  StringRef gk = g->getAttrOfType<StringAttr>(kKernelAttr).getValue();
  for (Operation *n = g->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode()) {
    auto c = cast<CastOp>(n);
    StringAttr ck = n->getAttrOfType<StringAttr>(kKernelAttr);
    Type to = elementOf(c.getResult());
    if (c.getInput() != g->getResult(0) || !ck ||
        (ck.getValue() != "toBf16" && ck.getValue() != "toF16") ||
        !((precision == "bf16" && to.isBF16()) || (precision == "fp16" && to.isF16())))
      continue;
    if (!g->hasAttr(kRead16Attr))
      g->setAttr(kRead16Attr,
                 DenseBoolArrayAttr::get(ctx, SmallVector<bool>(g->getNumOperands(), false)));
    if (!gk.ends_with("16"))
      g->setAttr(kKernelAttr, StringAttr::get(ctx, gk.str() + "16"));
    n->setAttr(kKernelAttr, StringAttr::get(ctx, kNoKernel));
    n->setAttr(kCopyByWriterAttr, UnitAttr::get(ctx));
    return 1; // one copy per writer
  }
  return 0;
}

/// Rule 3h for an add a norm gradient computes (carve.fold =
/// "accumulate"): its 16-bit copy among the copies right after it is
/// written by the norm gradient as it writes the sum (layer_norm_grad_add16,
/// rms_norm_grad_add16; the copy is no call, marked carve.copy_by_writer).
unsigned accumulatedAddCopy(Operation *add, StringRef precision) {
  MLIRContext *ctx = add->getContext();
  Operation *g = producerOf(add);
  StringAttr gk = g ? g->getAttrOfType<StringAttr>(kKernelAttr) : StringAttr();
  if (!gk)
    return 0;
  for (Operation *n = add->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode()) {
    auto c = cast<CastOp>(n);
    StringAttr ck = n->getAttrOfType<StringAttr>(kKernelAttr);
    Type to = elementOf(c.getResult());
    if (c.getInput() != add->getResult(0) || !ck ||
        (ck.getValue() != "toBf16" && ck.getValue() != "toF16") ||
        !((precision == "bf16" && to.isBF16()) || (precision == "fp16" && to.isF16())))
      continue;
    if (!g->hasAttr(kRead16Attr))
      g->setAttr(kRead16Attr,
                 DenseBoolArrayAttr::get(ctx, SmallVector<bool>(g->getNumOperands(), false)));
    if (!gk.getValue().ends_with("16"))
      g->setAttr(kKernelAttr, StringAttr::get(ctx, gk.getValue().str() + "16"));
    n->setAttr(kKernelAttr, StringAttr::get(ctx, kNoKernel));
    n->setAttr(kCopyByWriterAttr, UnitAttr::get(ctx));
    return 1; // one copy per writer
  }
  return 0;
}

/// Rule 4d: the 16-bit copy (the first among the copies right after it)
/// of a concat marked "assemble" is written by the attention gradient
/// whose dq, dk and dv are its pieces, and that of an attention output's
/// transpose marked "producer" by the attention forward (no call,
/// carve.copy_by_writer).
unsigned copyWrittenElsewhere(Operation *op, StringRef precision) {
  MLIRContext *ctx = op->getContext();
  for (Operation *n = op->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode()) {
    auto c = cast<CastOp>(n);
    Type to = elementOf(c.getResult());
    if (c.getInput() != op->getResult(0) ||
        !((precision == "bf16" && to.isBF16()) || (precision == "fp16" && to.isF16())))
      continue;
    n->setAttr(kKernelAttr, StringAttr::get(ctx, kNoKernel));
    n->setAttr(kCopyByWriterAttr, UnitAttr::get(ctx));
    return 1;
  }
  return 0;
}

} // namespace carve
