//===- Fusion.cpp - elementwise chains as one kernel each -----------------===//
//
// Chains of f32 elementwise ops (a bias add, an activation, a residual add)
// run as one `fused(...)` call each: a functor computes the chain per element
// in registers, so the intermediates are never stored unless read later
// (carve/rt/fused.h, docs/fusion.md). carve-fuse-elementwise
// (compiler/fusion) chose the groups; this file writes their kernels.
//
//===----------------------------------------------------------------------===//

#include "compiler/codegen/Generator.h"

using namespace mlir;

namespace carve::codegen {

namespace {

/// The scalar C++ of an elementwise op on `a` (its operands' expressions),
/// calling elementwise.h; "" for an op that does not fuse (Pow takes special
/// cases on its exponent, comparisons and casts change the type).
std::string fusedExpr(Operation *op, ArrayRef<std::string> a) {
  if (isa<AddOp, SubOp, MulOp, DivOp, MaximumOp, MinimumOp>(op))
    return std::string("ew::binary<Binary::") + binaryKernel(op) + ">(" + a[0] + ", " + a[1] +
           ")";
  if (isa<NegOp, AbsOp, ExpOp, LogOp, SqrtOp, RsqrtOp, ReciprocalOp, TanhOp, ErfOp, SigmoidOp,
          ReluOp, SinOp, CosOp, SiluOp, GeluOp>(op)) {
    const char *k = unaryKernel(unaryName(op));
    return k ? std::string("ew::unary<Unary::") + k + ">(" + a[0] + ")" : "";
  }
  if (auto g = dyn_cast<UnaryGradOp>(op)) {
    const char *k = unaryKernel(g.getFn());
    return k ? std::string("ew::unaryGrad<Unary::") + k + ">(" + a[0] + ", " + a[1] + ")" : "";
  }
  return "";
}

} // namespace

void Generator::fuseElementwise() {
  groups = fusionGroups(fn, interior);
  for (size_t k = 0; k < groups.size(); ++k)
    for (Operation *op : groups[k].ops)
      groupOf[op] = (int)k;
}

/// One fused group: the members' comments, the functor (into fusedDefs) and
/// one `fused(...)` call at the root.
bool Generator::emitFused(const FusionGroup &g) {
  std::string &s = body;
  std::string chain;
  for (Operation *op : g.ops) {
    s += opComment(op);
    std::string n = isa<UnaryGradOp>(op)
                        ? unaryName(op) + "(" + cast<UnaryGradOp>(op).getFn().str() + ")"
                        : op->getName().stripDialect().str();
    chain += (chain.empty() ? "" : ", ") + n;
  }
  ++kernelCalls;
  for (Value r : g.outputs)
    s += resultPointer(r);
  const size_t ni = g.inputs.size(), no = g.outputs.size();
  // The functor's code; chains that compute the same (each layer's, mostly)
  // share one functor, the first's (with its comments).
  std::string code;
  llvm::raw_string_ostream cs(code);
  cs << "  CARVE_HD void operator()(const float (&x)[" << ni << "], float (&y)[" << no
     << "]) const {\n";
  DenseMap<Value, std::string> expr;
  for (size_t k = 0; k < ni; ++k)
    expr[g.inputs[k]] = "x[" + std::to_string(k) + "]";
  for (size_t j = 0; j < g.ops.size(); ++j) {
    Operation *op = g.ops[j];
    std::vector<std::string> args;
    for (Value v : op->getOperands())
      args.push_back(expr.lookup(v));
    std::string t = "t" + std::to_string(j);
    std::string e = fusedExpr(op, args);
    if (op->hasAttr(kRound16Attr)) // rounded as written, for every reader (carve.round16)
      e = std::string(opts.precision == "fp16" ? "ew::roundF16(" : "ew::roundBf16(") + e + ")";
    cs << "    const float " << t << " = " << e << ";\n";
    expr[op->getResult(0)] = t;
  }
  for (size_t j = 0; j < no; ++j)
    cs << "    y[" << j << "] = " << expr.lookup(g.outputs[j]) << ";\n";
  cs << "  }\n";
  auto [known, isNew] =
      functorByCode.try_emplace(code, "Fused" + std::to_string(functorByCode.size()));
  const std::string fname = known->second;
  if (isNew) {
    // Printed with each line's value named after it.
    std::string f;
    llvm::raw_string_ostream fs(f);
    std::string rootNode = nodeName(g.root->getLoc());
    fs << "// " << fname << ": " << chain << (rootNode.empty() ? "" : " [" + rootNode + "]")
       << "\nstruct " << fname << " {\n";
    size_t line = 0;
    for (StringRef rest = code; !rest.empty();) {
      auto [l, next] = rest.split('\n');
      fs << l;
      if (l.starts_with("    const float t"))
        fs << "  // " << var[g.ops[line++]->getResult(0)];
      fs << "\n";
      rest = next;
    }
    fs << "};\n\n";
    fusedDefs += f;
  }

  // The 16-bit copies of outputs that the kernel writes as well
  // (carve.copy_in_fused: right after the root, no call of their own).
  std::vector<std::string> copy16(no, "nullptr");
  bool anyCopy = false;
  for (Operation *n = g.root->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode()) {
    if (!n->hasAttr(kCopyInFusedAttr))
      continue;
    auto it = llvm::find(g.outputs, n->getOperand(0));
    if (it == g.outputs.end())
      return failOp(n, "carve.copy_in_fused on a copy of no output of the fused chain before it");
    s += resultPointer(n->getResult(0));
    copy16[it - g.outputs.begin()] = name(n->getResult(0));
    anyCopy = true;
  }
  // Inputs a member reads as the 16-bit tensor of their values (carve.read16,
  // carve-select-kernels' rule 3g): the kernel widens them as it reads.
  std::string in, in16, shapes, outs, outs16;
  bool anyIn16 = false;
  for (size_t k = 0; k < ni; ++k) {
    Value v = g.inputs[k];
    std::string p = var.lookup(v);
    bool is16 = false;
    for (Operation *m : g.ops) {
      auto flags = m->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
      for (unsigned j = 0; flags && !is16 && j < m->getNumOperands(); ++j)
        if (m->getOperand(j) == v && j < flags.size() && flags[j] && !exact16Operand(m, j, p, is16))
          return false;
      if (is16)
        break;
    }
    anyIn16 |= is16;
    in += (k ? ", " : "") + p;
    in16 += std::string(k ? ", " : "") + (is16 ? "true" : "false");
    shapes += (k ? ", " : "") + dims(typeOf(v).getShape());
  }
  for (size_t j = 0; j < no; ++j) {
    // An output never stored in f32 (neverStoredF32: only its 16-bit copy).
    outs += std::string(j ? ", " : "") +
            (bufferOf.count(g.outputs[j]) ? var.lookup(g.outputs[j]) : std::string("nullptr"));
    outs16 += (j ? ", " : "") + copy16[j];
  }
  s += "  {  // one pass: " + std::to_string(g.ops.size()) + " ops, " + std::to_string(ni) +
       " input(s), " + std::to_string(no) + " output(s)" +
       (no > 1 ? " (the intermediates are read later)" : "") + "\n";
  if (anyIn16) {
    s += "    const void *in[" + std::to_string(ni) + "] = {" + in + "};\n";
    s += "    const bool in16[" + std::to_string(ni) + "] = {" + in16 +
         "};  // read as their 16-bit tensors\n";
  } else {
    s += "    const float *in[" + std::to_string(ni) + "] = {" + in + "};\n";
  }
  s += "    const Dims shapes[" + std::to_string(ni) + "] = {" + shapes + "};\n";
  s += "    float *out[" + std::to_string(no) + "] = {" + outs + "};\n";
  if (anyCopy)
    s += "    uint16_t *out16[" + std::to_string(no) + "] = {" + outs16 +
         "};  // their 16-bit copies, written in the same pass\n";
  else if (anyIn16)
    s += "    uint16_t *none16[" + std::to_string(no) + "] = {};\n";
  s += "    " + callee(opts, "fused") + "(\"" + fname + " (" + chain + ")\", " + fname +
       "{}, in, " + (anyIn16 ? "in16, " : "") + "shapes, out, " +
       (anyCopy || anyIn16 ? (anyCopy ? "out16, " : "none16, ") : "") +
       dims(typeOf(g.root->getResult(0)).getShape()) + ");\n  }\n";
  return true;
}

} // namespace carve::codegen
