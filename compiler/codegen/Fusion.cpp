//===- Fusion.cpp - elementwise chains as one kernel each -----------------===//
//
// Chains of f32 elementwise ops (a bias add, an activation, a residual add)
// run as one `fused(...)` call each: a functor computes the chain per element
// in registers, so the intermediates are never stored unless read later
// (carve/rt/fused.h, docs/fusion.md).
//
//===----------------------------------------------------------------------===//

#include "compiler/codegen/Generator.h"

#include <algorithm>
#include <queue>

using namespace mlir;

namespace carve::codegen {

const char *unaryEnum(StringRef fn) {
  static const std::pair<const char *, const char *> table[] = {{"neg", "Neg"},
                                                                {"abs", "Abs"},
                                                                {"exp", "Exp"},
                                                                {"log", "Log"},
                                                                {"sqrt", "Sqrt"},
                                                                {"rsqrt", "Rsqrt"},
                                                                {"reciprocal", "Reciprocal"},
                                                                {"tanh", "Tanh"},
                                                                {"erf", "Erf"},
                                                                {"sigmoid", "Sigmoid"},
                                                                {"relu", "Relu"},
                                                                {"sin", "Sin"},
                                                                {"cos", "Cos"},
                                                                {"silu", "Silu"},
                                                                {"gelu", "Gelu"},
                                                                {"gelu_tanh", "GeluTanh"}};
  for (auto &[k, v] : table)
    if (fn == k)
      return v;
  return nullptr;
}

/// The op name a Unary enum is looked up by (gelu with the tanh
/// approximation is "gelu_tanh").
std::string unaryName(Operation *op) {
  if (auto g = dyn_cast<GeluOp>(op); g && g.getApproximate() == "tanh")
    return "gelu_tanh";
  return op->getName().stripDialect().str();
}

namespace {

/// The scalar C++ of an elementwise op on `a` (its operands' expressions),
/// calling elementwise.h; "" for an op that does not fuse (Pow takes special
/// cases on its exponent, comparisons and casts change the type).
std::string fusedExpr(Operation *op, ArrayRef<std::string> a) {
  if (isa<AddOp, SubOp, MulOp, DivOp, MaximumOp, MinimumOp>(op)) {
    const char *k = isa<AddOp>(op)       ? "Add"
                    : isa<SubOp>(op)     ? "Sub"
                    : isa<MulOp>(op)     ? "Mul"
                    : isa<DivOp>(op)     ? "Div"
                    : isa<MaximumOp>(op) ? "Max"
                                         : "Min";
    return std::string("ew::binary<Binary::") + k + ">(" + a[0] + ", " + a[1] + ")";
  }
  if (isa<NegOp, AbsOp, ExpOp, LogOp, SqrtOp, RsqrtOp, ReciprocalOp, TanhOp, ErfOp, SigmoidOp,
          ReluOp, SinOp, CosOp, SiluOp, GeluOp>(op)) {
    const char *k = unaryEnum(unaryName(op));
    return k ? std::string("ew::unary<Unary::") + k + ">(" + a[0] + ")" : "";
  }
  if (auto g = dyn_cast<UnaryGradOp>(op)) {
    const char *k = unaryEnum(g.getFn());
    return k ? std::string("ew::unaryGrad<Unary::") + k + ">(" + a[0] + ", " + a[1] + ")" : "";
  }
  return "";
}

/// An f32 elementwise op that fusedExpr can write.
bool fusible(Operation *op) {
  if (op->getNumResults() != 1 || !typeOf(op->getResult(0)).getElementType().isF32())
    return false;
  for (Value v : op->getOperands()) {
    auto t = dyn_cast<RankedTensorType>(v.getType());
    if (!t || !t.getElementType().isF32())
      return false;
  }
  std::vector<std::string> args(op->getNumOperands(), "x");
  return !fusedExpr(op, args).empty();
}

} // namespace

/// Groups chains of elementwise ops into fused kernels. Walking back from
/// each not-yet-grouped elementwise op (the root), an op P producing one of
/// the group's operands joins when
///  - P is elementwise over the root's shape (its result is read element for
///    element, never broadcast) and on the same side of forward/backward;
///  - every reader of P's result outside the group runs after the root: the
///    kernel writes it there (an extra output, e.g. the pre-activation that
///    backward reads), or nothing else reads it and it is never stored;
///  - neither P's result nor its operands are results of the step (the
///    gradients, which bucket reductions update in place once final): the
///    kernel reads P's operands at the root, later than P would have;
///  - the kernel stays small: at most 16 ops, 8 inputs and 4 outputs.
/// Candidates are taken from the highest index down, so an op's readers inside
/// the group have all been decided when it is considered.
void Generator::fuseElementwise() {
  if (!opts.fuse)
    return;
  constexpr size_t kMaxOps = 16, kMaxInputs = 8, kMaxOutputs = 4;
  llvm::DenseSet<Value> returned;
  for (Value v : fn.getBody().front().getTerminator()->getOperands())
    returned.insert(v);
  const int phaseBegin = firstBackwardOp(true);
  auto definer = [&](Value v) {
    Operation *d = v.getDefiningOp();
    auto it = d ? index.find(d) : index.end();
    return it == index.end() ? -1 : it->second;
  };
  auto countInputs = [&](const std::set<int> &m) {
    llvm::DenseSet<Value> in;
    for (int i : m)
      for (Value v : ops[i]->getOperands())
        if (!m.count(definer(v)))
          in.insert(v);
    return in.size();
  };
  auto readOutside = [&](Value v, const std::set<int> &m) {
    return llvm::any_of(v.getUsers(), [&](Operation *u) {
      auto it = index.find(u);
      return it == index.end() || !m.count(it->second);
    });
  };
  auto countOutputs = [&](const std::set<int> &m) {
    size_t n = 1; // the root's result
    for (int i : m)
      if (i != *m.rbegin() && readOutside(ops[i]->getResult(0), m))
        ++n;
    return n;
  };
  std::vector<FusionGroup> found;
  std::set<Operation *> taken;
  for (int r = (int)ops.size() - 1; r >= 0; --r) {
    Operation *root = ops[r];
    if (taken.count(root) || !fusible(root))
      continue;
    ArrayRef<int64_t> shape = typeOf(root->getResult(0)).getShape();
    std::set<int> members{r};
    std::priority_queue<int> todo;
    auto pushOperands = [&](Operation *op) {
      for (Value v : op->getOperands())
        if (int d = definer(v); d >= 0)
          todo.push(d);
    };
    pushOperands(root);
    while (!todo.empty()) {
      int p = todo.top();
      todo.pop();
      Operation *P = ops[p];
      if (members.count(p) || taken.count(P) || !fusible(P) || members.size() >= kMaxOps ||
          (p >= phaseBegin) != (r >= phaseBegin))
        continue;
      Value v = P->getResult(0);
      if (typeOf(v).getShape() != shape || returned.count(v) ||
          llvm::any_of(P->getOperands(), [&](Value o) { return returned.count(o); }))
        continue;
      bool laterOnly = llvm::all_of(v.getUsers(), [&](Operation *u) {
        auto it = index.find(u);
        return it != index.end() && (members.count(it->second) || it->second > r);
      });
      if (!laterOnly)
        continue;
      std::set<int> next = members;
      next.insert(p);
      if (countInputs(next) > kMaxInputs || countOutputs(next) > kMaxOutputs)
        continue;
      members = std::move(next);
      pushOperands(P);
    }
    if (members.size() < 2)
      continue;
    FusionGroup g;
    g.root = root;
    llvm::DenseSet<Value> seen;
    for (int i : members) {
      g.ops.push_back(ops[i]);
      taken.insert(ops[i]);
      for (Value v : ops[i]->getOperands())
        if (!members.count(definer(v)) && seen.insert(v).second)
          g.inputs.push_back(v);
    }
    g.outputs.push_back(root->getResult(0));
    for (int i : members) {
      Value v = ops[i]->getResult(0);
      if (i == r)
        continue;
      if (readOutside(v, members))
        g.outputs.push_back(v);
      else
        interior.insert(v);
    }
    found.push_back(std::move(g));
  }
  // In program order, so the functors are numbered as they run.
  std::reverse(found.begin(), found.end());
  groups = std::move(found);
  for (size_t k = 0; k < groups.size(); ++k)
    for (Operation *op : groups[k].ops)
      groupOf[op] = (int)k;
}

/// One fused group: the members' comments, the functor (into fusedDefs) and
/// one `fused(...)` call at the root.
bool Generator::emitFused(const FusionGroup &g) {
  std::string &s = body;
  const int id = groupOf.lookup(g.root);
  const std::string fname = "Fused" + std::to_string(id);
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
  std::string rootNode = nodeName(g.root->getLoc());
  std::string f;
  llvm::raw_string_ostream fs(f);
  fs << "// " << fname << ": " << chain << (rootNode.empty() ? "" : " [" + rootNode + "]")
     << "\nstruct " << fname << " {\n  CARVE_HD void operator()(const float (&x)[" << ni
     << "], float (&y)[" << no << "]) const {\n";
  DenseMap<Value, std::string> expr;
  for (size_t k = 0; k < ni; ++k)
    expr[g.inputs[k]] = "x[" + std::to_string(k) + "]";
  for (size_t j = 0; j < g.ops.size(); ++j) {
    Operation *op = g.ops[j];
    std::vector<std::string> args;
    for (Value v : op->getOperands())
      args.push_back(expr.lookup(v));
    std::string t = "t" + std::to_string(j);
    fs << "    const float " << t << " = " << fusedExpr(op, args) << ";  // "
       << var[op->getResult(0)] << "\n";
    expr[op->getResult(0)] = t;
  }
  for (size_t j = 0; j < no; ++j)
    fs << "    y[" << j << "] = " << expr.lookup(g.outputs[j]) << ";\n";
  fs << "  }\n};\n\n";
  fusedDefs += f;

  std::string in, shapes, outs;
  for (size_t k = 0; k < ni; ++k) {
    in += (k ? ", " : "") + var.lookup(g.inputs[k]);
    shapes += (k ? ", " : "") + dims(typeOf(g.inputs[k]).getShape());
  }
  for (size_t j = 0; j < no; ++j)
    outs += (j ? ", " : "") + var.lookup(g.outputs[j]);
  s += "  {  // one pass: " + std::to_string(g.ops.size()) + " ops, " + std::to_string(ni) +
       " input(s), " + std::to_string(no) + " output(s)" +
       (no > 1 ? " (the intermediates are read later)" : "") + "\n";
  s += "    const float *in[" + std::to_string(ni) + "] = {" + in + "};\n";
  s += "    const Dims shapes[" + std::to_string(ni) + "] = {" + shapes + "};\n";
  s += "    float *out[" + std::to_string(no) + "] = {" + outs + "};\n";
  s += "    fused(\"" + fname + " (" + chain + ")\", " + fname + "{}, in, shapes, out, " +
       dims(typeOf(g.root->getResult(0)).getShape()) + ");\n  }\n";
  return true;
}

} // namespace carve::codegen
