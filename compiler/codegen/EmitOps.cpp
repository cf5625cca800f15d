//===- EmitOps.cpp - one runtime call per op ------------------------------===//
//
// Each op of the function becomes one call of the runtime's kernels
// (carve/rt/kernels.h, or carve/rt/gpu.h on the CUDA target: the same names
// and arguments), with a comment naming the op, its shapes and its model
// node. Families of ops share an emitter; collectives and user-defined ops
// have their own. The norms, attention, dropout and cross-entropy are in
// EmitNeuralOps.cpp.
//
//===----------------------------------------------------------------------===//

#include "compiler/codegen/EmitUtil.h"
#include "compiler/codegen/Generator.h"
#include "compiler/lower/Kernels.h"

#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/DialectResourceBlobManager.h"

#include <cstring>

using namespace mlir;

namespace carve::codegen {

std::string Generator::name(Value v) { return var.lookup(v); }

std::string Generator::opnd(Operation *op, unsigned k) { return name(operandOf(op, k)); }

std::string Generator::oshape(Operation *op, unsigned k) { return shapeOf(operandOf(op, k)); }

std::string Generator::nullOf(Value like) { return "(const " + ctypeOf(like) + " *)nullptr"; }

std::string Generator::opComment(Operation *op) {
  std::string node = nodeName(op->getLoc());
  if (layer)
    node = layerNode(node);
  std::string s = "  // " + op->getName().getStringRef().str() + " ";
  for (unsigned k = 0; k < op->getNumOperands(); ++k)
    s += (k ? ", " : "") + shapeText(typeOf(op->getOperand(k)).getShape());
  s += " -> ";
  for (unsigned k = 0; k < op->getNumResults(); ++k)
    s += (k ? ", " : "") + shapeText(typeOf(op->getResult(k)).getShape());
  if (!node.empty())
    s += "   [" + node + "]";
  return s + "\n";
}

std::string Generator::resultPointer(Value r) {
  if (!bufferOf.count(r))
    return ""; // never stored (neverStoredF32): its readers read its 16-bit tensor
  if (layer)
    return layerResultPointer(r);
  const Buffer &b = buffers[bufferOf.lookup(r)];
  return "  " + ctypeOf(r) + " *" + var[r] + " = (" + ctypeOf(r) + " *)(" +
         (b.region == Region::Activation ? activationAt(b.offset)
                                         : "A + " + std::to_string(b.offset)) +
         ");\n";
}

std::string Generator::activationAt(int64_t offset) {
  if (slotLimit >= 0 && offset >= slotLimit + sendLimit)
    return "W + " + std::to_string(offset - slotLimit - sendLimit);
  if (slotLimit >= 0 && offset >= slotLimit)
    return "Q + " + std::to_string(offset - slotLimit);
  return actBase + " + " + std::to_string(offset);
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
  c += std::string(opts.cuda() ? "__managed__ " : "") + "alignas(64) " + ctype + " " + var[r] +
       "[" + std::to_string(std::max<int64_t>(n, 1)) + "] = {";
  for (int64_t k = 0; k < n; ++k) {
    if (k % 12 == 0)
      c += "\n    ";
    c += values[k] + (k + 1 < n ? ", " : "");
  }
  c += "};\n";
  return true;
}

bool Generator::emitOp(Operation *op) {
  // carve-select-kernels chose the call (or none); this prints it.
  StringRef kernel = kernelOf(op);
  if (kernel.empty())
    return failOp(op, "no carve.kernel: the IR is not lowered (the pass carve-select-kernels "
                      "chooses each op's runtime entry)");
  if (kernel == kFusedKernel) {
    auto it = groupOf.find(op);
    if (it == groupOf.end())
      return failOp(op, "carve.kernel = \"fused\" on an op of no fused chain");
    return groups[it->second].root == op ? emitFused(groups[it->second]) : true;
  }
  if (kernel == kNoKernel) {
    std::string &s = body;
    if (auto c = dyn_cast<ConstantOp>(op)) {
      if (layer)
        return true; // its array is printed; a layer's function reads it by name
      s += opComment(op);
      return emitConstant(c);
    }
    if (isa<ReshapeOp>(op)) {
      if (gatheredOperands.count(op) || scatteredProducts.count(op))
        return true; // a view of a value that is never in memory
      // A reshape of a value never stored (an f32 view, or a result, that
      // every reader reads as its 16-bit tensor: neverStoredF32): no pointer.
      if (!bufferOf.count(op->getResult(0)))
        return true;
      Value res = op->getResult(0);
      if (layer)
        layer->defined.insert(res);
      s += opComment(op) + "  " + ctypeOf(res) + " *" + name(res) + " = " + opnd(op, 0) +
           ";  // same memory\n";
      viewsInScope.push_back(res);
      return true;
    }
    if (isa<GatherOp>(op))
      s += opComment(op) + "  // never in memory: gathered by each matmul that reads it\n";
    if (foldedViews.count(op))
      s += opComment(op) + "  // never in memory: read in place by the transposes that read it\n";
    if (producedTransposes.count(op))
      s += opComment(op) + "  // written transposed by the attention gradient above\n";
    if (accumulatedAdds.count(op))
      s += opComment(op) +
           "  // computed by the norm gradient above (it added the residual's gradient)\n";
    if (assembledConcats.count(op))
      s += opComment(op) + "  // its pieces written in 16 bits into " +
           name(assembledConcats.lookup(op)) + " by the attention gradient above\n";
    if (epilogueAdds.count(op))
      s += opComment(op) +
           (isa<UnaryGradOp>(op) ? "  // multiplied in by the matmul above as it wrote "
            : isa<GeluOp>(op)    ? "  // applied by the matmul above as it wrote "
                                 : "  // added by the matmul above as it wrote ") +
           name(epilogueAdds.lookup(op)) +
           (isa<UnaryGradOp>(op) ? " (cuBLASLt's DGELU epilogue)\n"
            : isa<GeluOp>(op)    ? " (cuBLASLt's GELU_AUX_BIAS epilogue)\n"
                                 : " (cuBLASLt's bias epilogue)\n");
    if (op->hasAttr(kBiasGradInGemmAttr))
      s += opComment(op) + "  // summed by the weight gradient's GEMM below (cuBLASLt's "
                           "bias-gradient epilogue)\n";
    return true;
  }
  std::string &s = body;
  s += opComment(op);
  ++kernelCalls;
  for (Value r : op->getResults())
    if (Value t = producedInto(r))
      s += resultPointer(t); // written transposed, in the transpose's place
    else
      s += resultPointer(r);
  // carve.write16: the op writes the 16-bit copy right after it (no call of
  // its own) instead of its f32 result.
  Value copy16;
  if (op->hasAttr(kWrite16Attr)) {
    Operation *c = op->getNextNode();
    if (!c || !isa<CastOp>(c) || c->getOperand(0) != op->getResult(0))
      return failOp(op, "carve.write16 on an op not followed by the 16-bit copy of its result");
    copy16 = c->getResult(0);
    s += resultPointer(copy16);
  }
  // carve.copy_by_writer (rule 3h): the op writes the copies after it too.
  for (unsigned k = 0; k < op->getNumResults(); ++k)
    if (Value byWriter = copyByWriter(op, k))
      s += resultPointer(byWriter);
  // A norm gradient that computes the add reading its input gradient
  // (carve.fold = "accumulate") writes that add's copy too (rule 4c).
  if (accumulatedResidual(op))
    if (Value byWriter = copyByWriter(producedInto(op->getResult(0)).getDefiningOp(), 0))
      s += resultPointer(byWriter);
  // A weight gradient's GEMM writes the bias gradient's copy (rule 3i).
  if (kernel == "matmul16_to16_bgrad")
    if (Operation *r = biasGradReduceOf(op))
      if (Value c = copyByWriter(r))
        s += resultPointer(c);
  // A matmul that adds its add's bias writes the add's copy ("epilogue").
  if (Operation *e = epilogueAddOf(op); e && epilogueAdds.count(e))
    s += resultPointer(epilogueAdds.lookup(e));
  // And the GELU's copy where it applies the GELU too (GELU_AUX_BIAS).
  if (Operation *g = epilogueGeluOf(op); g && epilogueAdds.count(g))
    s += resultPointer(epilogueAdds.lookup(g));
  // An attention forward writes O into its transpose's copy (rule 4d).
  if (isa<AttentionStatsOp>(op))
    if (Value o16 = outputCopy16(op->getResult(0)))
      s += resultPointer(o16);
  // An attention gradient whose dq, dk and dv are the pieces of a concat
  // marked "assemble" writes them into that concat's copy (rule 4d).
  if (isa<AttentionGradStatsOp>(op))
    if (Value t = producedInto(op->getResult(0))) {
      int64_t column = 0;
      if (Operation *c = assembledInto(t.getDefiningOp(), column); c && assembledConcats.count(c))
        s += resultPointer(assembledConcats.lookup(c));
    }
  std::string call;
  llvm::raw_string_ostream os(call);
  os << "  ";
  bool ok;
  if (isa<AddOp, SubOp, MulOp, DivOp, PowOp, MaximumOp, MinimumOp, EqualOp, LessOp, GreaterOp,
          AndOp, OrOp, NotOp, NegOp, AbsOp, ExpOp, LogOp, SqrtOp, RsqrtOp, ReciprocalOp, TanhOp,
          ErfOp, SigmoidOp, ReluOp, SinOp, CosOp, SiluOp, GeluOp, UnaryGradOp, WhereOp, CastOp>(op))
    ok = emitElementwise(op, kernel, os);
  else if (auto d = dyn_cast<DropoutOp>(op))
    ok = emitDropout(d, os);
  else if (auto e = dyn_cast<EvalSelectOp>(op)) {
    os << "// train --eval-data's forward takes the second (PyTorch's eval mode)\n  "
       << callee(opts, "copy") << "(ctx.evaluating ? "
       << opnd(op, 1) << " : " << opnd(op, 0) << ", " << name(e.getResult()) << ", (int64_t)"
       << typeOf(e.getResult()).getNumElements() << ");";
    ok = true;
  } else if (auto r = dyn_cast<ReplicaSumOp>(op)) {
    const int64_t n = typeOf(r.getResult()).getNumElements();
    os << "// SyncBatchNorm: the statistics' sums over the " << opts.dp << " data-parallel replica"
       << (opts.dp == 1 ? "" : "s") << "\n  " + callee(opts, "copy") + "(" << opnd(op, 0) << ", "
       << name(r.getResult()) << ", (int64_t)" << n << ");";
    if (opts.dp > 1)
      os << "\n  ctx.dpComm->allReduce(" << name(r.getResult()) << ", " << n
         << ", CommType::" << (typeOf(r.getResult()).getElementType().isF64() ? "F64" : "F32")
         << ", ReduceOp::Sum);";
    ok = true;
  } else if (auto a = dyn_cast<AssignOp>(op)) {
    const int64_t n = typeOf(a.getResult()).getNumElements();
    os << callee(opts, "copy") + "(" << opnd(op, 0) << ", " << name(a.getResult()) << ", (int64_t)"
       << n << ");\n  if (!ctx.evaluating)  // the buffer's new value (running statistics)\n    "
       << callee(opts, "copy") << "(" << opnd(op, 0) << ", " << opnd(op, 1) << ", (int64_t)" << n
       << ");";
    ok = true;
  } else if (kernel == "matmul" || kernel == "matmul16" || kernel == "matmul16_to16" ||
             kernel == "matmul16_to16_bgrad" || kernel == "matmul16_bias" ||
             kernel == "matmul16_dgelu" || kernel == "matmul16_bias_gelu" ||
             kernel == "matmul_gathered")
    ok = emitMatmul(op, kernel, os);
  else if (isa<ReduceSumOp, ReduceMeanOp, ReduceMaxOp, SoftmaxOp, LogSoftmaxOp, SoftmaxGradOp>(op))
    ok = emitReduction(op, os);
  else if (isa<LayerNormOp, LayerNormGradOp, RmsNormOp, RmsNormGradOp>(op))
    ok = emitNormalization(op, os);
  else if (isa<AttentionOp, AttentionGradOp, AttentionStatsOp, AttentionGradStatsOp>(op))
    ok = emitAttention(op, os);
  else if (isa<CrossEntropyOp, CrossEntropyGradOp>(op))
    ok = emitCrossEntropy(op, kernel, os);
  else if (isa<RotaryOp, RotaryGradOp>(op))
    ok = emitRotary(op, kernel, os);
  else if (isa<Conv2dOp, Conv2dGradInputOp, Conv2dGradWeightOp>(op))
    ok = emitConvolution(op, kernel, os);
  else if (isa<TransposeOp, SliceOp, SliceGradOp, ConcatOp, ExpandOp>(op))
    ok = emitDataMovement(op, os);
  else if (isa<GatherOp, GatherGradOp, NonzeroOp>(op))
    ok = emitGather(op, kernel, os);
  else if (auto x = dyn_cast<ExpertAllToAllOp>(op)) {
    auto split = [&](int64_t d) {
      return "Split{" + std::to_string(d) + ", 1, " + std::to_string(x.getRanks()) + "}";
    };
    const bool dispatch = x.getSrcDim() < x.getDstDim();
    os << "// Expert parallelism: "
       << (dispatch ? "send each expert's rows to its rank" : "send the experts' results back")
       << " (all-to-all over the " << x.getRanks()
       << " ep ranks)\n  " + callee(opts, "allToAllSplit") + "(*ctx.epComm, " << opnd(op, 0) << ", "
       << oshape(op, 0) << ", " << split(x.getSrcDim()) << ", " << split(x.getDstDim()) << ", "
       << name(op->getResult(0)) << ", CommType::F32);";
    ok = true;
  } else if (isa<dist::AllReduceOp, dist::AllGatherOp, dist::ReduceScatterOp, dist::AllToAllOp,
                 dist::LocalSplitOp, dist::BroadcastOp>(op))
    ok = emitCollective(op, os);
  else if (isa<CustomOp, CustomGradOp>(op))
    ok = emitCustom(op, os);
  else
    return failOp(op, std::string("the ") + (opts.cuda() ? "CUDA" : "CPU") +
                          " target has no kernel for this op yet");
  if (!ok)
    return false;
  s += call + "\n";
  // A cast from 16 bits is exact; carve.round16_in_copy: the copy after it
  // rounds (roundCopyBf16).
  // carve.copy_by_writer: the op rounds as it writes its copy (rule 3h).
  // (cuDNN's convolutions compute their result in 16 bits: rounded.)
  if (op->hasAttr(kRound16Attr) && !isa<CastOp>(op) && !op->hasAttr(kRound16InCopyAttr) &&
      !op->hasAttr(kWrite16Attr) && !copyByWriter(op) &&
      !isa<Conv2dOp, Conv2dGradInputOp, Conv2dGradWeightOp>(op))
    s += round16(op->getResult(0));
  return true;
}

/// carve.round16: the result rounded in place to the plan's 16-bit format
/// (carve-round-activations), after the kernel that wrote it.
std::string Generator::round16(Value r) {
  return "  " + callee(opts, opts.precision == "fp16" ? "roundF16" : "roundBf16") + "(" +
         var.lookup(r) + ", " + std::to_string(typeOf(r).getNumElements()) + ");  // rounded to " +
         opts.precision + " as written (kept for backward)\n";
}

/// Binary, comparison, logic, unary, where and cast: elementwise kernels
/// that broadcast their operands to the result's shape.
bool Generator::emitElementwise(Operation *op, StringRef kernel, llvm::raw_ostream &os) {
  Value res = op->getNumResults() ? op->getResult(0) : Value();
  if (const char *k = binaryKernel(op); k && kernel == "binary16") {
    // carve.read16: an operand read as the 16-bit tensor of its values.
    std::string a, b;
    bool a16, b16;
    if (!exact16Operand(op, 0, a, a16) || !exact16Operand(op, 1, b, b16))
      return false;
    os << callee(opts, "binary16") + "(Binary::" << k << ", " << a << ", " << flag("a16", a16)
       << ", " << oshape(op, 0) << ", " << b << ", " << flag("b16", b16) << ", " << oshape(op, 1)
       << ", " << resultOrNull(res) << ", " << copyArgs(op) << ", " << shapeOf(res) << ");";
  } else if (const char *k = binaryKernel(op)) {
    os << callee(opts, "binary") + "(Binary::" << k << ", " << opnd(op, 0) << ", " << oshape(op, 0)
       << ", " << opnd(op, 1) << ", " << oshape(op, 1) << ", " << name(res) << ", " << shapeOf(res)
       << ");";
  } else if (isa<EqualOp, LessOp, GreaterOp>(op)) {
    const char *k = isa<EqualOp>(op) ? "Eq" : isa<LessOp>(op) ? "Lt" : "Gt";
    os << callee(opts, "compare") + "(Compare::" << k << ", " << opnd(op, 0) << ", "
       << oshape(op, 0) << ", " << opnd(op, 1) << ", " << oshape(op, 1) << ", " << name(res) << ", "
       << shapeOf(res) << ");";
  } else if (isa<AndOp, OrOp>(op)) {
    os << callee(opts, "logic") + "(Logic::" << (isa<AndOp>(op) ? "And" : "Or") << ", "
       << opnd(op, 0) << ", " << oshape(op, 0) << ", " << opnd(op, 1) << ", " << oshape(op, 1)
       << ", " << name(res) << ", " << shapeOf(res) << ");";
  } else if (isa<NotOp>(op)) {
    os << callee(opts, "logic") + "(Logic::Not, " << opnd(op, 0) << ", " << oshape(op, 0) << ", "
       << opnd(op, 0) << ", " << oshape(op, 0) << ", " << name(res) << ", " << shapeOf(res) << ");";
  } else if (isa<NegOp, AbsOp, ExpOp, LogOp, SqrtOp, RsqrtOp, ReciprocalOp, TanhOp, ErfOp,
                 SigmoidOp, ReluOp, SinOp, CosOp, SiluOp, GeluOp>(op)) {
    os << callee(opts, "unary") + "(Unary::" << unaryKernel(unaryName(op)) << ", " << opnd(op, 0)
       << ", " << name(res) << ", " << typeOf(res).getNumElements() << ");";
  } else if (auto g = dyn_cast<UnaryGradOp>(op)) {
    const char *k = unaryKernel(g.getFn());
    if (!k)
      return failOp(op, "unknown function " + g.getFn().str());
    if (kernel == "unary_grad16") {
      std::string x;
      bool x16;
      if (!exact16Operand(op, 0, x, x16))
        return false;
      os << callee(opts, "unary_grad16") + "(Unary::" << k << ", " << x << ", " << flag("x16", x16)
         << ", " << opnd(op, 1) << ", " << resultOrCopyOnly(res, copyByWriter(op)) << ", "
         << copyArgs(op) << ", " << typeOf(res).getNumElements() << ");";
      return true;
    }
    os << callee(opts, "unary_grad") + "(Unary::" << k << ", " << opnd(op, 0) << ", " << opnd(op, 1)
       << ", " << name(res) << ", " << typeOf(res).getNumElements() << ");";
  } else if (isa<WhereOp>(op)) {
    os << callee(opts, "where") + "(" << opnd(op, 0) << ", " << oshape(op, 0) << ", " << opnd(op, 1)
       << ", " << oshape(op, 1) << ", " << opnd(op, 2) << ", " << oshape(op, 2) << ", " << name(res)
       << ", " << shapeOf(res) << ");";
  } else if (isa<CastOp>(op)) {
    // A 16-bit copy of a rounded activation and back (carve-pack-activations):
    // the conversion carve-select-kernels chose (roundCopyBf16 / roundCopyF16
    // also round the input in place: carve.round16_in_copy on its writer).
    os << callee(opts, kernel) << "(" << opnd(op, 0) << ", " << name(res) << ", "
       << typeOf(res).getNumElements() << ");";
  }
  return true;
}

std::string Generator::matmulOperands(Operation *m) {
  std::string out;
  for (unsigned k = 0; k < 2; ++k) {
    Value v = operandOf(m, k); // through a transpose folded into the flag
    out += (k ? ", " : "") + name(v) + ", " + shapeOf(v) + ", " +
           flag(k ? "transB" : "transA", v != m->getOperand(k));
  }
  return out;
}

/// Operand `k` of matmul `mm` as `op` (the op that runs it: the matmul, or
/// the transpose of its product) passes it to matmul16: the 16-bit tensor of
/// its f32 view where carve.read16 says so (`is16`), else the operand.
bool Generator::read16Operand(Operation *op, Operation *mm, unsigned k, std::string &out,
                              bool &is16) {
  auto flags = op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
  if (!flags || flags.size() != 2)
    return failOp(op, "carve.kernel = \"matmul16\" without carve.read16 for both operands");
  Value v = operandOf(mm, k);
  is16 = flags[k];
  if (!is16) {
    out = name(v);
    return true;
  }
  Value s16 = stored16(v, op, opts.precision);
  if (!s16)
    return failOp(op, "carve.read16 marks an operand with no 16-bit tensor of its bits (no view "
                      "of one, no 16-bit copy before the call)");
  out = name(s16);
  return true;
}

Value Generator::copyByWriter(Operation *op, unsigned k) {
  if (k >= op->getNumResults())
    return Value();
  for (Operation *n = op->getNextNode(); n && isa<CastOp, ReshapeOp>(n); n = n->getNextNode())
    if (isa<CastOp>(n) && n->hasAttr(kCopyByWriterAttr) &&
        aliasRoot(n->getOperand(0)) == op->getResult(k))
      return n->getResult(0);
  return Value();
}

std::string Generator::resultOrCopyOnly(Value r, Value copy) {
  return copy && bufferOf.count(r) && onlyRead16(r) ? std::string("nullptr") : resultOrNull(r);
}

std::string Generator::resultOrNull(Value r) {
  return bufferOf.count(r) ? name(r) : std::string("nullptr");
}

std::string Generator::copyArgs(Operation *op) {
  Value copy = copyByWriter(op);
  return (copy ? name(copy) : std::string("nullptr")) + ", " +
         flag("round", copy && op->hasAttr(kRound16Attr));
}

bool Generator::exact16Operand(Operation *op, unsigned k, std::string &out, bool &is16) {
  auto flags = op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
  if (!flags || flags.size() != (int64_t)op->getNumOperands())
    return failOp(op, "carve.read16 needs one flag per operand on a 16-bit entry (rule 3g)");
  Value v = op->getOperand(k);
  is16 = flags[k];
  if (!is16) {
    out = name(v);
    return true;
  }
  Value s16 = exact16(v, op, opts.precision);
  if (!s16)
    return failOp(op, "carve.read16 marks an operand with no 16-bit tensor holding its values (no "
                      "view of one, no copy of a rounded value before the call)");
  out = name(s16);
  return true;
}

/// Where the matmul `op` runs as (`kernel`) writes: its result, or for
/// matmul16_to16 (carve.write16) the 16-bit copy right after it.
bool Generator::matmulResult(Operation *op, StringRef kernel, std::string &out) {
  if (kernel != "matmul16_to16" && kernel != "matmul16_to16_bgrad") {
    out = name(op->getResult(0));
    return true;
  }
  Operation *c = op->getNextNode();
  if (!op->hasAttr(kWrite16Attr) || !c || !isa<CastOp>(c))
    return failOp(op, "carve.kernel = \"matmul16_to16\" without carve.write16 and the 16-bit "
                      "copy after it");
  out = name(c->getResult(0));
  return true;
}

/// matmul16_to16_bgrad's last arguments (rule 3i): which operand's columns
/// the bias gradient sums, and the bias gradient's 16-bit copy.
bool Generator::biasGradArgs(Operation *op, std::string &out) {
  Operation *r = biasGradReduceOf(op);
  Value copy = r ? copyByWriter(r) : Value();
  if (!copy)
    return failOp(op, "carve.kernel = \"matmul16_to16_bgrad\" on a GEMM without the bias "
                      "gradient's reduction it computes (carve.bias_grad_in_gemm) and that "
                      "gradient's 16-bit copy (carve.copy_by_writer)");
  out = name(copy);
  return true;
}

/// A matmul, with folded transposes as its flags; or a transpose of a matmul
/// computed as the product of the transposed operands.
bool Generator::emitMatmul(Operation *op, StringRef kernel, llvm::raw_ostream &os) {
  Value res = op->getNumResults() ? op->getResult(0) : Value();
  if (auto m = dyn_cast<MatmulOp>(op)) {
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
    if (kernel == "matmul_gathered") {
      // matmul(a, gather(table, idx)) with the gather's result never whole
      // in memory (carve.fold = "gather").
      Operation *g = gatheredOperand(op);
      if (!g)
        return failOp(op, "carve.kernel = \"matmul_gathered\" on a matmul whose right operand "
                          "is no gather marked carve.fold = \"gather\"");
      os << callee(opts, "matmul_gathered") + "(" << opnd(op, 0) << ", " << da << ", "
         << flag("transA", ta) << ", " << opnd(g, 0) << ", " << oshape(g, 0) << ", " << opnd(g, 1)
         << ", " << oshape(g, 1) << ", " << db << ", " << flag("transB", tb) << ", " << name(res)
         << ", " << dims(ys) << ");  // its right operand gathered a matrix at a time";
      return true;
    }
    if (kernel == "matmul16_bias" || kernel == "matmul16_bias_gelu") {
      // carve-fold-views' "epilogue": the bias added to the fp32 product
      // before it is rounded into the add's 16-bit copy (cuBLASLt), and
      // (matmul16_bias_gelu) GELU of that sum rounded into the GELU's copy.
      Operation *e = epilogueAddOf(op);
      Operation *g = kernel == "matmul16_bias_gelu" ? epilogueGeluOf(op) : nullptr;
      if (kernel == "matmul16_bias_gelu" && (!g || !epilogueAdds.count(g)))
        return failOp(op, "carve.kernel = \"matmul16_bias_gelu\" on a matmul whose bias add "
                          "no GELU marked carve.fold = \"epilogue\" reads");
      Value bias;
      if (!e || !epilogueAdds.count(e) || !epilogueMatmulOf(e, &bias))
        return failOp(op, "carve.kernel = \"matmul16_bias\" on a matmul whose product no add "
                          "marked carve.fold = \"epilogue\" reads");
      Value bias16 = exact16(bias, op, opts.precision);
      std::string a, b;
      bool a16, b16;
      if (!bias16 || !read16Operand(op, op, 0, a, a16) || !read16Operand(op, op, 1, b, b16))
        return bias16 ? false : failOp(op, "matmul16_bias: its bias has no 16-bit tensor");
      os << callee(opts, kernel) + "(" << a << ", " << flag("a16", a16) << ", " << da << ", "
         << flag("transA", ta) << ", " << b << ", " << flag("b16", b16) << ", " << db << ", "
         << flag("transB", tb) << ", " << name(bias16) << ", " << name(epilogueAdds.lookup(e))
         << (g ? ", " + name(epilogueAdds.lookup(g)) : std::string()) << ", " << dims(ys)
         << ");  // + the bias of " << nodeName(e->getLoc())
         << (g ? ", then " + nodeName(g->getLoc()) + " (tanh GELU)" : std::string());
      return true;
    }
    if (kernel == "matmul16_dgelu") {
      // carve-fold-views' "epilogue" on a GELU gradient: the fp32 product
      // times GELU's derivative at the 16-bit pre-activation, rounded into
      // the gradient's 16-bit copy (cuBLASLt's DGELU).
      Operation *e = epilogueAddOf(op);
      Value x;
      if (!e || !isa<UnaryGradOp>(e) || !epilogueAdds.count(e) || !epilogueMatmulOf(e, &x))
        return failOp(op, "carve.kernel = \"matmul16_dgelu\" on a matmul whose product no GELU "
                          "gradient marked carve.fold = \"epilogue\" reads");
      Value x16 = exact16(x, op, opts.precision);
      std::string a, b;
      bool a16, b16;
      if (!x16 || !read16Operand(op, op, 0, a, a16) || !read16Operand(op, op, 1, b, b16))
        return x16 ? false : failOp(op, "matmul16_dgelu: the GELU input has no 16-bit tensor");
      os << callee(opts, kernel) + "(" << a << ", " << flag("a16", a16) << ", " << da << ", "
         << flag("transA", ta) << ", " << b << ", " << flag("b16", b16) << ", " << db << ", "
         << flag("transB", tb) << ", " << name(x16) << ", " << name(epilogueAdds.lookup(e)) << ", "
         << dims(ys) << ");  // times GELU's derivative: " << nodeName(e->getLoc());
      return true;
    }
    if (kernel == "matmul16_to16_bgrad") {
      // Rule 3i: a^T b in 16 bits, and the bias gradient's column sums.
      std::string a, b, out, bgrad;
      bool a16, b16;
      if (!read16Operand(op, op, 0, a, a16) || !read16Operand(op, op, 1, b, b16) ||
          !matmulResult(op, kernel, out) || !biasGradArgs(op, bgrad))
        return false;
      if (!ta || tb || !a16 || !b16)
        return failOp(op, "matmul16_to16_bgrad on a matmul that is not a^T b of 16-bit operands");
      const int64_t which = op->getAttrOfType<IntegerAttr>(kBiasGradOfAttr).getInt();
      os << callee(opts, kernel) + "(" << a << ", " << da << ", " << b << ", " << db << ", "
         << flag("biasOfA", which == 0) << ", " << out << ", " << dims(ys) << ", " << bgrad
         << ");  // a^T b, and the bias gradient (cuBLASLt's " << (which == 0 ? "BGRADB" : "BGRADA")
         << " epilogue)";
      return true;
    }
    if (kernel == "matmul16" || kernel == "matmul16_to16") {
      // carve.read16: cuBLAS reads the 16-bit tensor an operand is a view of;
      // matmul16_to16 (carve.write16) writes the product's 16-bit copy.
      std::string a, b;
      bool a16, b16;
      if (!read16Operand(op, op, 0, a, a16) || !read16Operand(op, op, 1, b, b16))
        return false;
      std::string out;
      if (!matmulResult(op, kernel, out))
        return false;
      os << callee(opts, kernel) + "(" << a << ", " << flag("a16", a16) << ", " << da << ", "
         << flag("transA", ta) << ", " << b << ", " << flag("b16", b16) << ", " << db << ", "
         << flag("transB", tb) << ", " << out << ", " << dims(ys) << ");";
      return true;
    }
    os << callee(opts, "matmul") + "(" << opnd(op, 0) << ", " << da << ", " << flag("transA", ta)
       << ", " << opnd(op, 1) << ", " << db << ", " << flag("transB", tb) << ", " << name(res)
       << ", " << dims(ys) << ");";
  } else if (Operation *mm = transposedMatmul.lookup(op)) {
    // y = (op(a) op(b))^T = op(b)^T op(a)^T
    auto stored = [&](unsigned k, bool &trans) {
      Value v = operandOf(mm, k);
      trans = v != mm->getOperand(k);
      return v;
    };
    bool ta, tb;
    Value a = stored(0, ta), b = stored(1, tb);
    if (kernel == "matmul16_to16_bgrad") {
      // Rule 3i: (a b)^T as b^T a^T, a call a^T b of 16-bit operands, and
      // the bias gradient's column sums.
      std::string an, bn, out, bgrad;
      bool a16, b16;
      if (!read16Operand(op, mm, 0, an, a16) || !read16Operand(op, mm, 1, bn, b16) ||
          !matmulResult(op, kernel, out) || !biasGradArgs(op, bgrad))
        return false;
      if (tb || !ta || !a16 || !b16)
        return failOp(op, "matmul16_to16_bgrad on a product that is not a^T b of 16-bit operands");
      const int64_t which = op->getAttrOfType<IntegerAttr>(kBiasGradOfAttr).getInt();
      os << callee(opts, kernel) + "(" << bn << ", " << shapeOf(b) << ", " << an << ", "
         << shapeOf(a) << ", " << flag("biasOfA", which == 0) << ", " << out << ", " << shapeOf(res)
         << ", " << bgrad << ");  // (a b)^T as b^T a^T, and the bias gradient "
         << "(cuBLASLt's " << (which == 0 ? "BGRADB" : "BGRADA") << " epilogue)";
      return true;
    }
    if (kernel == "matmul16" || kernel == "matmul16_to16") {
      std::string an, bn;
      bool a16, b16;
      if (!read16Operand(op, mm, 0, an, a16) || !read16Operand(op, mm, 1, bn, b16))
        return false;
      std::string out;
      if (!matmulResult(op, kernel, out))
        return false;
      os << callee(opts, kernel) + "(" << bn << ", " << flag("a16", b16) << ", " << shapeOf(b)
         << ", " << flag("transA", !tb) << ", " << an << ", " << flag("b16", a16) << ", "
         << shapeOf(a) << ", " << flag("transB", !ta) << ", " << out << ", " << shapeOf(res)
         << ");  // (a b)^T as b^T a^T";
      return true;
    }
    os << callee(opts, "matmul") + "(" << name(b) << ", " << shapeOf(b) << ", "
       << flag("transA", !tb) << ", " << name(a) << ", " << shapeOf(a) << ", "
       << flag("transB", !ta) << ", " << name(res) << ", " << shapeOf(res)
       << ");  // (a b)^T as b^T a^T";
  }
  return true;
}

/// Reductions over an axis mask, softmax and its gradient.
bool Generator::emitReduction(Operation *op, llvm::raw_ostream &os) {
  Value res = op->getNumResults() ? op->getResult(0) : Value();
  if (isa<ReduceSumOp, ReduceMeanOp, ReduceMaxOp>(op)) {
    ArrayRef<int64_t> axes = op->getAttrOfType<DenseI64ArrayAttr>("axes").asArrayRef();
    uint32_t mask = 0;
    for (int64_t a : axes)
      mask |= 1u << a;
    const char *k = isa<ReduceSumOp>(op) ? "Sum" : isa<ReduceMeanOp>(op) ? "Mean" : "Max";
    if (kernelOf(op) != "reduce16") {
      os << callee(opts, "reduce") + "(Reduce::" << k << ", " << opnd(op, 0) << ", "
         << oshape(op, 0) << ", 0x";
      os.write_hex(mask);
      os << "u, " << name(res) << ");";
      return true;
    }
    // reduce16: the input as its exact 16-bit tensor where carve.read16 says
    // so (rule 3g); the result's 16-bit cast where it is carve.copy_by_writer
    // (rule 3h), the f32 result where it is stored.
    Value copy = copyByWriter(op);
    std::string x = opnd(op, 0);
    bool x16 = false;
    if (op->hasAttr(kRead16Attr) && !exact16Operand(op, 0, x, x16))
      return false;
    const std::string y = resultPointer(res).empty() ? "(float *)nullptr" : name(res);
    os << callee(opts, "reduce16") + "(Reduce::" << k << ", " << x << ", " << flag("x16", x16)
       << ", " << oshape(op, 0) << ", 0x";
    os.write_hex(mask);
    os << "u, " << y << ", " << (copy ? name(copy) : "nullptr") << ");";
  } else if (auto sm = dyn_cast<SoftmaxOp>(op)) {
    os << callee(opts, "softmax") + "(" << opnd(op, 0) << ", " << oshape(op, 0) << ", "
       << sm.getAxis() << ", " << flag("log", false) << ", " << name(res) << ");";
  } else if (auto sm = dyn_cast<LogSoftmaxOp>(op)) {
    os << callee(opts, "softmax") + "(" << opnd(op, 0) << ", " << oshape(op, 0) << ", "
       << sm.getAxis() << ", " << flag("log", true) << ", " << name(res) << ");";
  } else if (auto g = dyn_cast<SoftmaxGradOp>(op)) {
    os << callee(opts, "softmax_grad") + "(" << opnd(op, 0) << ", " << opnd(op, 1) << ", "
       << oshape(op, 0) << ", " << g.getAxis() << ", " << flag("log", g.getLog()) << ", "
       << name(res) << ");";
  }
  return true;
}

/// Layer and RMS normalization and their gradients.
bool Generator::emitDataMovement(Operation *op, llvm::raw_ostream &os) {
  Value res = op->getNumResults() ? op->getResult(0) : Value();
  if (auto t = dyn_cast<TransposeOp>(op)) {
    if (std::optional<StridedView> view = foldedViewOf(op->getOperand(0))) {
      // carve-fold-views: the slice's elements read where they are.
      StringRef kernel = kernelOf(op);
      const bool copy = (bool)copyByWriter(op);
      if (kernel != (copy ? "transpose16_view" : "transpose_view"))
        return failOp(op, "a transpose of a folded slice (carve.fold = \"view\") runs as " +
                              std::string(copy ? "transpose16_view" : "transpose_view") +
                              ", not carve.kernel = \"" + kernel.str() + "\"");
      std::string x = name(view->base);
      if (view->offset)
        x += " + " + std::to_string(view->offset);
      os << callee(opts, kernel) + "(" << x << ", " << dims(view->shape) << ", "
         << dims(view->strides) << ", " << dims(t.getPerm()) << ", ";
      if (copy)
        os << resultOrNull(res) << ", " << copyArgs(op) << ");";
      else
        os << name(res) << ");";
      return true;
    }
    if (copyByWriter(op)) // carve.copy_by_writer: the copy too (transpose16)
      os << callee(opts, "transpose16") + "(" << opnd(op, 0) << ", " << oshape(op, 0) << ", "
         << dims(t.getPerm()) << ", " << resultOrNull(res) << ", " << copyArgs(op) << ");";
    else
      os << callee(opts, "transpose") + "(" << opnd(op, 0) << ", " << oshape(op, 0) << ", "
         << dims(t.getPerm()) << ", " << name(res) << ");";
  } else if (auto sl = dyn_cast<SliceOp>(op)) {
    os << callee(opts, "slice") + "(" << opnd(op, 0) << ", " << oshape(op, 0) << ", "
       << dims(sl.getStarts()) << ", " << dims(sl.getSteps()) << ", " << name(res) << ", "
       << shapeOf(res) << ");";
  } else if (auto sg = dyn_cast<SliceGradOp>(op)) {
    os << callee(opts, "slice_grad") + "(" << opnd(op, 0) << ", " << oshape(op, 0) << ", "
       << dims(sg.getStarts()) << ", " << dims(sg.getSteps()) << ", " << name(res) << ", "
       << shapeOf(res) << ");";
  } else if (auto cc = dyn_cast<ConcatOp>(op)) {
    std::string ct = ctypeOf(res);
    os << "{\n    const " << ct << " *parts[] = {";
    for (unsigned k = 0; k < op->getNumOperands(); ++k)
      os << (k ? ", " : "") << opnd(op, k);
    os << "};\n    const Dims shapes[] = {";
    for (unsigned k = 0; k < op->getNumOperands(); ++k)
      os << (k ? ", " : "") << "Dims" << oshape(op, k);
    if (copyByWriter(op)) // carve.copy_by_writer: the copy too (concat16)
      os << "};\n    " + callee(opts, "concat16") + "(" << op->getNumOperands()
         << ", parts, shapes, " << cc.getAxis() << ", " << resultOrNull(res) << ", " << copyArgs(op)
         << ");\n  }";
    else
      os << "};\n    " + callee(opts, "concat") + "(" << op->getNumOperands() << ", parts, shapes, "
         << cc.getAxis() << ", " << name(res) << ");\n  }";
  } else if (isa<ExpandOp>(op)) {
    if (copyByWriter(op)) // carve.copy_by_writer: the copy too (expand16, rule 3h)
      os << callee(opts, "expand16") + "(" << opnd(op, 0) << ", " << oshape(op, 0) << ", "
         << shapeOf(res) << ", " << resultOrNull(res) << ", " << copyArgs(op) << ");";
    else
      os << callee(opts, "expand") + "(" << opnd(op, 0) << ", " << oshape(op, 0) << ", "
         << name(res) << ", " << shapeOf(res) << ");";
  }
  return true;
}

/// Embedding lookups and their gradients, vocab-parallel where the rows are
/// split over tp; NonZero's positions (indices for gathers).
bool Generator::emitGather(Operation *op, StringRef kernel, llvm::raw_ostream &os) {
  Value res = op->getNumResults() ? op->getResult(0) : Value();
  auto rows = op->getAttrOfType<IntegerAttr>(kShardedRowsAttr);
  if (kernel.contains("sharded") && !rows)
    return failOp(op, "carve.kernel = \"" + kernel.str() +
                          "\" on a gather whose rows are not "
                          "split over tp");
  if (auto g = dyn_cast<GatherOp>(op)) {
    if (kernel == "gather_sharded") {
      int64_t local = typeOf(g.getData()).getDimSize(0);
      os << "// Vocab-parallel embedding: this rank holds rows [tpRank * " << local << ", +"
         << local << ") of " << rows.getInt() << "; others give zeros (partial sums).\n  "
         << callee(opts, "gather_sharded") + "(" << opnd(op, 0) << ", " << oshape(op, 0)
         << ", (int64_t)ctx.tpRank * " << local << ", " << rows.getInt() << "LL, " << opnd(op, 1)
         << ", " << oshape(op, 1) << ", " << name(res) << ");";
    } else if (kernel == "gather16") {
      // carve.read16: the table read as its 16-bit tensor (a parameter's copy).
      std::string t;
      bool t16;
      if (!exact16Operand(op, 0, t, t16))
        return false;
      if (!t16)
        return failOp(op, "carve.kernel = \"gather16\" without carve.read16 on the table");
      os << callee(opts, "gather16") + "(" << t << ", " << oshape(op, 0) << ", " << opnd(op, 1)
         << ", " << oshape(op, 1) << ", " << g.getAxis() << ", " << name(res) << ");";
    } else {
      os << callee(opts, "gather") + "(" << opnd(op, 0) << ", " << oshape(op, 0) << ", "
         << opnd(op, 1) << ", " << oshape(op, 1) << ", " << g.getAxis() << ", " << name(res)
         << ");";
    }
  } else if (auto nz = dyn_cast<NonzeroOp>(op)) {
    os << callee(opts, "nonzero") + "(" << opnd(op, 0) << ", " << oshape(op, 0) << ", " << name(res)
       << ");  // positions, then zeros up to the bound";
  } else if (auto g = dyn_cast<GatherGradOp>(op)) {
    if (kernel == "matmul_gather_grad") {
      // gather_grad(matmul(a, b)) without the product in memory.
      Operation *m = scatterMatmul.lookup(op);
      if (!m)
        return failOp(op, "carve.kernel = \"matmul_gather_grad\" on a gather_grad not marked "
                          "carve.fold = \"scatter\"");
      os << callee(opts, "matmul_gather_grad") + "(" << matmulOperands(m) << ", "
         << shapeOf(m->getResult(0)) << ", " << opnd(op, 1) << ", " << oshape(op, 1) << ", "
         << name(res) << ", " << shapeOf(res) << ");  // the product never whole in memory";
    } else if (kernel == "gather_sharded_grad") {
      int64_t local = typeOf(g.getResult()).getDimSize(0);
      os << callee(opts, "gather_sharded_grad") + "(" << opnd(op, 0) << ", " << opnd(op, 1) << ", "
         << oshape(op, 1) << ", (int64_t)ctx.tpRank * " << local << ", " << rows.getInt() << "LL, "
         << name(res) << ", " << shapeOf(res) << ");  // rows this rank holds";
    } else if (kernel == "gather_grad16") {
      // Rule 3h: its sums' 16-bit copy (the embedding's 16-bit gradient)
      // written by the same kernel.
      Value copy = copyByWriter(op);
      if (!copy)
        return failOp(op, "carve.kernel = \"gather_grad16\" without the 16-bit copy after it "
                          "(carve.copy_by_writer)");
      os << callee(opts, "gather_grad16") + "(" << opnd(op, 0) << ", " << opnd(op, 1) << ", "
         << oshape(op, 1) << ", " << g.getAxis() << ", " << name(res) << ", " << shapeOf(res)
         << ", " << name(copy) << ");";
    } else {
      os << callee(opts, "gather_grad") + "(" << opnd(op, 0) << ", " << opnd(op, 1) << ", "
         << oshape(op, 1) << ", " << g.getAxis() << ", " << name(res) << ", " << shapeOf(res)
         << ");";
    }
  }
  return true;
}

void emitCustomKernelDecls(llvm::raw_ostream &os,
                           const std::map<std::string, std::string> &customKernels) {
  if (customKernels.empty())
    return;
  os << "// The user's kernels, from the rules file's sources (OUT/src/custom/); the ABI is in\n"
     << "// carve/rt/custom.h.\n";
  for (const auto &[fn, decl] : customKernels)
    os << decl << "\n";
  os << "\n";
}

/// A user-defined op: a call of the user's `extern "C"` kernel with the ABI of
/// runtime/include/carve/rt/custom.h, on this rank's local shapes.
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
  auto split = [&](int64_t d, int64_t g) {
    return "Split{" + std::to_string(d) + ", " + std::to_string(g) + ", " + std::to_string(parts) +
           "}";
  };
  std::string x = var.lookup(operandOf(op, 0)), y = var.lookup(res);
  if (auto ls = dyn_cast<dist::LocalSplitOp>(op)) {
    // Bytes, whatever the element type (a bool mask too).
    os << "// replicated -> split over " << axis << ": keep this rank's piece (no communication)\n"
       << "  " + callee(opts, "takeShard") + "(" << x << ", " << dims(typeOf(in).getShape()) << ", "
       << split(ls.getDim(), ls.getGroups()) << ", " << (axis == "tp" ? "ctx.tpRank" : "ctx.dpRank")
       << ", " << y << ", " << bytesOf(in) / std::max<int64_t>(1, typeOf(in).getNumElements())
       << ");";
    return true;
  }
  Type et = typeOf(in).getElementType();
  std::string ct = et.isF32()         ? "CommType::F32"
                   : et.isF64()       ? "CommType::F64"
                   : et.isInteger(64) ? "CommType::I64"
                                      : "";
  if (ct.empty())
    return failOp(op, "collectives on the CPU target take f32, f64 or i64 tensors");
  auto i64 = [&](const char *n) { return op->getAttrOfType<IntegerAttr>(n).getInt(); };
  std::string n = std::to_string(typeOf(in).getNumElements());
  std::string red = "ReduceOp::Sum";
  if (auto r = op->getAttrOfType<StringAttr>("reduction"); r && r.getValue() == "max")
    red = "ReduceOp::Max";
  if (isa<dist::AllReduceOp>(op)) {
    os << "// partial sums -> replicated over " << axis << "\n  " + callee(opts, "copy") + "(" << x
       << ", " << y << ", " << n << ");\n  " << comm.substr(1) << "->allReduce(" << y << ", " << n
       << ", " << ct << ", " << red << ");";
  } else if (auto g = dyn_cast<dist::AllGatherOp>(op)) {
    os << "// split -> replicated over " << axis << "\n  " + callee(opts, "allGatherSplit") + "("
       << comm << ", " << x << ", " << dims(typeOf(in).getShape()) << ", "
       << split(g.getDim(), g.getGroups()) << ", " << y << ", " << ct << ");";
  } else if (auto rs = dyn_cast<dist::ReduceScatterOp>(op)) {
    os << "// partial sums -> split over " << axis
       << "\n  " + callee(opts, "reduceScatterSplit") + "(" << comm << ", " << x << ", "
       << dims(typeOf(in).getShape()) << ", " << split(rs.getDim(), rs.getGroups()) << ", " << y
       << ", " << ct << ", " << red << ");";
  } else if (isa<dist::AllToAllOp>(op)) {
    os << "// re-split along another dimension over " << axis
       << "\n  " + callee(opts, "allToAllSplit") + "(" << comm << ", " << x << ", "
       << dims(typeOf(in).getShape()) << ", " << split(i64("src_dim"), i64("src_groups")) << ", "
       << split(i64("dst_dim"), i64("dst_groups")) << ", " << y << ", " << ct << ");";
  } else if (auto b = dyn_cast<dist::BroadcastOp>(op)) {
    os << callee(opts, "copy") + "(" << x << ", " << y << ", " << n << ");\n  " << comm.substr(1)
       << "->broadcast(" << y << ", " << bytesOf(in) << ", " << b.getRoot() << ");";
  }
  return true;
}

} // namespace carve::codegen
