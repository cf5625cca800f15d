//===- Generator.cpp - names, literals and the op list --------------------===//
//
// What every plan starts with: the ops in program order, their types checked,
// transposes folded into matmuls, elementwise chains fused and every value
// given a buffer; and the C names and literals every emitter writes.
//
//===----------------------------------------------------------------------===//

#include "compiler/codegen/Generator.h"

#include "mlir/IR/Diagnostics.h"

#include "llvm/Support/Format.h"

#include <cctype>

using namespace mlir;

namespace carve::codegen {

bool withPlan(ModuleOp module, const CodegenOptions &given, EmitOptions &opts, std::string &error) {
  std::string why;
  ScopedDiagnosticHandler handler(module.getContext(), [&](Diagnostic &d) {
    why = d.str();
    return success();
  });
  FailureOr<PlanAttrs> plan = readPlan(module);
  if (failed(plan)) {
    error = why;
    return false;
  }
  static_cast<CodegenOptions &>(opts) = given;
  opts.plan = *plan;
  opts.dp = (int)plan->dp;
  opts.tp = (int)plan->tp;
  opts.zero = (int)plan->zero;
  opts.pp = (int)plan->pp;
  opts.ep = (int)plan->ep;
  if (auto r = module->getAttrOfType<IntegerAttr>(kEpRankAttr))
    opts.epRank = (int)r.getInt();
  opts.numMicroBatches = (int)plan->microBatches;
  opts.globalBatch = plan->globalBatch;
  opts.precision = plan->precision;
  opts.target = plan->target;
  opts.fp32Accumulators = plan->fp32ChunkAccumulators();
  opts.gradients16 = plan->gradients16();
  return readOptimizer(module, opts.optimizer, error);
}

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
  // 16-bit copies of activations (carve-pack-activations): the bits.
  if (t.isBF16())
    return ctype = "uint16_t", dtype = "BF16", size = 2, true;
  if (t.isF16())
    return ctype = "uint16_t", dtype = "F16", size = 2, true;
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

std::string Generator::paramName(unsigned arg) { return paramNameOf(fn, arg).getValue().str(); }

bool Generator::tpSplit(unsigned arg) {
  auto d = fn.getArgAttrOfType<DictionaryAttr>(arg, kLayoutAttr);
  auto l = d ? d.getAs<dist::SbpAttr>("tp") : dist::SbpAttr();
  return l && l.isSplit();
}

bool Generator::fail(const std::string &msg) {
  error = msg;
  return false;
}

bool Generator::failOp(Operation *op, const std::string &msg) {
  std::string node = nodeName(op->getLoc());
  return fail("'" + op->getName().getStringRef().str() + "'" +
              (node.empty() ? "" : " (node '" + node + "')") + ": " + msg);
}

bool isRuntimeType(StringRef name) {
  // The runtime's types, which a model's node names may spell (an ONNX node
  // '/Split' makes a value `Split`, which would hide carve::rt::Split).
  static const llvm::StringSet<> runtimeTypes = {
      "Binary",   "CommType", "Communicator", "Compare",    "DType",   "Dims",           "Fused3",
      "Grad16",   "Logic",    "Mesh",         "Precision",  "Program", "Reduce",         "ReduceOp",
      "Schedule", "Split",    "StepContext",  "TensorSpec", "Unary",   "Hyperparameters"};
  return runtimeTypes.count(name) > 0;
}

std::string Generator::uniqueName(std::string base) {
  if (base.size() > 60)
    base = base.substr(base.size() - 60), base = identifier(base);
  if (isRuntimeType(base))
    base += "_v";
  std::string n = base;
  if (usedNames.count(n)) {
    int &k = nextSuffix.try_emplace(base, 2).first->second;
    for (n = base + "_" + std::to_string(k); usedNames.count(n);)
      n = base + "_" + std::to_string(++k);
  }
  usedNames.insert(n);
  return n;
}

std::string Generator::ctypeOf(Value v) {
  std::string c, d;
  int s;
  elementInfo(typeOf(v).getElementType(), c, d, s);
  return c;
}

int64_t Generator::bytesOf(Value v) {
  std::string c, d;
  int s = 0;
  elementInfo(typeOf(v).getElementType(), c, d, s);
  return typeOf(v).getNumElements() * s;
}

Value Generator::operandOf(Operation *op, unsigned k) {
  auto it = foldedOperand.find({op, k});
  return it == foldedOperand.end() ? op->getOperand(k) : it->second;
}

bool Generator::prepare() {
  Block &block = fn.getBody().front();
  for (Operation &op : block.without_terminator()) {
    if (isOptimizerOp(&op))
      continue; // the step's tail (readTail)
    index[&op] = (int)ops.size();
    ops.push_back(&op);
  }
  if (!checkTypes())
    return false;
  if (!foldTransposes())
    return false;
  fuseElementwise();
  return assignBuffers();
}

int Generator::firstBackwardOp(bool phaseMarks) {
  for (Operation *op : ops)
    if (opensBackward(op, phaseMarks))
      return index[op];
  return (int)ops.size();
}

std::string Generator::lossReduction() {
  if (auto r = fn->getAttrOfType<StringAttr>(kLossReductionAttr))
    return r.getValue().str();
  return "unknown";
}

std::string Generator::argumentPointer(BlockArgument a, bool perMicroBatch) {
  const Buffer &b = buffers[bufferOf.lookup(a)];
  std::string what = b.region == Region::Input  ? "input"
                     : b.region == Region::Seed ? "loss seed"
                                                : "parameter";
  const bool micro = perMicroBatch && b.region == Region::Input;
  std::string s = "  " + ctypeOf(a) + " *" + var[a] + " = (" + ctypeOf(a) + " *)(A + " +
                  std::to_string(b.offset) + ")";
  if (micro)
    s += " + (int64_t)mb * " + std::to_string(typeOf(a).getNumElements());
  return s + ";  // " + what + " " + shapeText(typeOf(a).getShape()) +
         (micro ? " (micro-batch mb)" : "") + "\n";
}

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

/// The transposes carve-fold-transposes marked (carve.fold): "product" is
/// computed by the matmul below it, "operand" becomes its readers' flag; a
/// "scatter" gather_grad computes the matmul below it (matmul_gather_grad).
bool Generator::foldTransposes() {
  for (Operation *op : ops) {
    if (isScatteredProduct(op))
      scatteredProducts.insert(op);
    if (isGatheredOperand(op))
      gatheredOperands.insert(op);
    StringRef fold = foldOf(op);
    if (fold == kFoldGather) {
      if (!isa<GatherOp>(op))
        return failOp(op, "carve.fold = \"gather\" on an op that is no gather");
      // Every reader, through reshapes and folded transposes, a matmul
      // reading it as its right operand.
      SmallVector<Value> pending{op->getResult(0)};
      while (!pending.empty()) {
        Value v = pending.pop_back_val();
        for (OpOperand &use : v.getUses()) {
          Operation *u = use.getOwner();
          if (isa<ReshapeOp>(u) || (isa<TransposeOp>(u) && foldOf(u) == kFoldOperand)) {
            pending.push_back(u->getResult(0));
            continue;
          }
          Operation *lhs =
              isa<MatmulOp>(u) ? aliasRoot(readOperand(u, 0)).getDefiningOp() : nullptr;
          if (!isa<MatmulOp>(u) || use.getOperandNumber() != 1 || gatheredOperand(u) != op ||
              (lhs && isGatheredOperand(lhs)) || isProductMatmul(u)) {
            return failOp(op, "carve.fold = \"gather\" on a gather read by " +
                                  u->getName().getStringRef().str() +
                                  ", not only by matmuls reading it as their right operand");
          }
        }
      }
      continue;
    }
    if (fold == kFoldView) {
      // Read in place by every transpose that reads it, through reshapes.
      if (!isa<SliceOp>(op))
        return failOp(op, "carve.fold = \"view\" on an op that is no slice");
      SmallVector<Value> pending{op->getResult(0)};
      while (!pending.empty()) {
        Value v = pending.pop_back_val();
        for (Operation *u : v.getUsers()) {
          if (isa<ReshapeOp>(u)) {
            pending.push_back(u->getResult(0));
            continue;
          }
          if (!isa<TransposeOp>(u) || !foldedViewOf(u->getOperand(0)))
            return failOp(op, "carve.fold = \"view\" on a slice read by " +
                                  u->getName().getStringRef().str() +
                                  ", not only by transposes that read it as a strided view");
        }
      }
      foldedViews.insert(op);
      continue;
    }
    if (fold == kFoldProducer && isa_and_nonnull<AttentionStatsOp>(producerOf(op))) {
      // O's transpose: cuDNN's attention forward writes O in 16 bits into
      // its copy, where the gradients read it (carve-fold-views).
      Operation *p = producerOf(op);
      auto pk = p->getAttrOfType<StringAttr>(kKernelAttr);
      Value copy = outputCopy16(p->getResult(0));
      if (!pk || pk.getValue() != "attention_stats_cudnn" || !copy ||
          !copy.getDefiningOp()->hasAttr(kCopyByWriterAttr))
        return failOp(op, "carve.fold = \"producer\" on the transpose of an attention output "
                          "that attention_stats_cudnn does not write into its 16-bit copy");
      producedTransposes.insert(op);
      continue;
    }
    if (fold == kFoldProducer) {
      // Written transposed by cuDNN's attention gradient (carve-fold-views).
      Operation *p = producerOf(op);
      auto pk = p ? p->getAttrOfType<StringAttr>(kKernelAttr) : StringAttr();
      if (!p || !isa<AttentionGradStatsOp>(p) || !pk ||
          pk.getValue() != "attention_grad_stats_cudnn" ||
          producedInto(op->getOperand(0)) != op->getResult(0))
        return failOp(op, "carve.fold = \"producer\" on a transpose that is not the only reader "
                          "of a gradient of an attention_grad_stats_cudnn");
      producedTransposes.insert(op);
      continue;
    }
    if (fold == kFoldConsumer) {
      // Read in place, transposed, by cuDNN's attention gradient (dy).
      Operation *u = op->hasOneUse() ? *op->getUsers().begin() : nullptr;
      auto uk = u ? u->getAttrOfType<StringAttr>(kKernelAttr) : StringAttr();
      if (!u || !isa<AttentionGradStatsOp>(u) || !uk ||
          uk.getValue() != "attention_grad_stats_cudnn" ||
          cast<AttentionGradStatsOp>(u).getGrad() != op->getResult(0))
        return failOp(op, "carve.fold = \"consumer\" on a transpose that is not read only as the "
                          "dy of an attention_grad_stats_cudnn");
      consumedTransposes.insert(op);
      continue;
    }
    if (fold == kFoldAccumulate) {
      // Computed by the norm gradient whose input gradient it reads.
      Operation *g = producerOf(op);
      auto gk = g ? g->getAttrOfType<StringAttr>(kKernelAttr) : StringAttr();
      if (!g || !gk || !gk.getValue().contains("norm_grad_add") ||
          producedInto(g->getResult(0)) != op->getResult(0) || !accumulatedResidual(g))
        return failOp(op, "carve.fold = \"accumulate\" on an add whose norm gradient does not "
                          "run as layer_norm_grad_add or rms_norm_grad_add");
      accumulatedAdds.insert(op);
      continue;
    }
    if (fold == kFoldAssemble) {
      // Its pieces written in 16 bits into its copy by cuDNN's attention
      // gradient (carve-fold-views); neither it nor they are in f32 memory.
      Operation *g = assemblerOf(op);
      auto gk = g ? g->getAttrOfType<StringAttr>(kKernelAttr) : StringAttr();
      if (!g || !isa<AttentionGradStatsOp>(g) || !gk ||
          gk.getValue() != "attention_grad_stats_cudnn")
        return failOp(op, "carve.fold = \"assemble\" on a concat whose pieces are not the dq, "
                          "dk and dv of an attention_grad_stats_cudnn");
      Value copy;
      for (Operation *n = op->getNextNode(); n && isa<CastOp>(n) && !copy; n = n->getNextNode())
        if (n->getOperand(0) == op->getResult(0) && n->hasAttr(kCopyByWriterAttr))
          copy = n->getResult(0);
      if (!copy)
        return failOp(op, "carve.fold = \"assemble\" on a concat without the 16-bit copy its "
                          "pieces are written into (carve.copy_by_writer)");
      assembledConcats[op] = copy;
      continue;
    }
    if (fold == kFoldEpilogue) {
      // Added by its matmul as it writes the add's 16-bit copy (cuBLASLt's
      // bias epilogue, carve-fold-views).
      Operation *m = epilogueMatmulOf(op);
      auto mk = m ? m->getAttrOfType<StringAttr>(kKernelAttr) : StringAttr();
      Value copy;
      for (Operation *n = op->getNextNode(); n && isa<CastOp>(n) && !copy; n = n->getNextNode())
        if (n->getOperand(0) == op->getResult(0) && n->hasAttr(kCopyByWriterAttr))
          copy = n->getResult(0);
      // (Or a GELU gradient, multiplied in by its gradient's matmul:
      // cuBLASLt's DGELU epilogue.)
      // (Or a GELU of such an add: GELU_AUX_BIAS, whose matmul writes both
      // copies.)
      const char *want = isa<UnaryGradOp>(op)                           ? "matmul16_dgelu"
                         : isa<GeluOp>(op) || (mk && epilogueGeluOf(m)) ? "matmul16_bias_gelu"
                                                                        : "matmul16_bias";
      if (!m || !mk || mk.getValue() != want || !copy)
        return failOp(op, std::string("carve.fold = \"epilogue\" on ") +
                              (isa<UnaryGradOp>(op) ? "a GELU gradient"
                               : isa<GeluOp>(op)    ? "a GELU"
                                                    : "an add") +
                              " whose matmul does not run as " + want + " writing its 16-bit copy");
      epilogueAdds[op] = copy;
      continue;
    }
    if (fold == kFoldStrided) {
      // q, k or v read in place by cuDNN's attention in its source's 16-bit
      // copy (carve-fold-views): no call, no memory; its readers say where.
      if (!stridedPieceOf(op))
        return failOp(op, "carve.fold = \"strided\" on an op that is no transpose of a folded "
                          "slice (or its 16-bit copy) whose source has a 16-bit copy");
      for (Operation *u : op->getUsers())
        if (!isa<AttentionStatsOp, AttentionGradStatsOp, CastOp>(u))
          return failOp(op, "carve.fold = \"strided\" on a value read by " +
                                u->getName().getStringRef().str() +
                                ", not only by cuDNN's attention");
      stridedOps.insert(op);
      continue;
    }
    if (fold == kFoldScatter) {
      Operation *m = scatteredMatmul(op);
      if (!m || !isScatteredProduct(m))
        return failOp(op, "carve.fold = \"scatter\" on an op that is no gather_grad of a "
                          "matmul's product read only through reshapes");
      scatterMatmul[op] = m;
      continue;
    }
    if (!fold.empty() && !(isa<TransposeOp>(op) && swapsLastTwo(cast<TransposeOp>(op))))
      return failOp(op, "carve.fold marks an op that is no transpose of the last two dimensions");
    if (fold == kFoldProduct) {
      Operation *m = op->getOperand(0).getDefiningOp();
      if (!m || !isa<MatmulOp>(m) || !m->hasOneUse())
        return failOp(op, "carve.fold = \"product\" on a transpose whose input is not a matmul "
                          "read only by it");
      transposedMatmul[op] = m;
      fusedMatmuls.insert(m);
    } else if (fold == kFoldOperand) {
      if (op->use_empty() ||
          !llvm::all_of(op->getUsers(), [](Operation *u) { return isa<MatmulOp>(u); }))
        return failOp(op, "carve.fold = \"operand\" on a transpose that is read by an op other "
                          "than a matmul");
      foldedTransposes.insert(op);
      for (OpOperand &use : op->getUses())
        foldedOperand[{use.getOwner(), use.getOperandNumber()}] = op->getOperand(0);
    } else if (!fold.empty()) {
      return failOp(op, "unknown carve.fold '" + fold.str() + "'");
    }
  }
  return true;
}

} // namespace carve::codegen
