//===- FuseElementwise.cpp - carve-fuse-elementwise -----------------------===//
//
// The grouping rules are in Passes.td; the emitter (compiler/codegen) writes
// one kernel per group from fusionGroups.
//
//===----------------------------------------------------------------------===//

#include "compiler/fusion/Fusion.h"

#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"

#include "llvm/ADT/DenseMap.h"

#include <algorithm>
#include <map>
#include <queue>
#include <set>

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVEFUSEELEMENTWISE
#include "compiler/fusion/Passes.h.inc"
} // namespace carve

namespace carve {

const char *binaryKernel(Operation *op) {
  return isa<AddOp>(op)       ? "Add"
         : isa<SubOp>(op)     ? "Sub"
         : isa<MulOp>(op)     ? "Mul"
         : isa<DivOp>(op)     ? "Div"
         : isa<PowOp>(op)     ? "Pow"
         : isa<MaximumOp>(op) ? "Max"
         : isa<MinimumOp>(op) ? "Min"
                              : nullptr;
}

const char *unaryKernel(StringRef fn) {
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

std::string unaryName(Operation *op) {
  if (auto g = dyn_cast<GeluOp>(op); g && g.getApproximate() == "tanh")
    return "gelu_tanh";
  return op->getName().stripDialect().str();
}

bool isFusible(Operation *op) {
  if (op->getNumResults() != 1 ||
      !cast<RankedTensorType>(op->getResult(0).getType()).getElementType().isF32())
    return false;
  for (Value v : op->getOperands()) {
    auto t = dyn_cast<RankedTensorType>(v.getType());
    if (!t || !t.getElementType().isF32())
      return false;
  }
  if (isa<AddOp, SubOp, MulOp, DivOp, MaximumOp, MinimumOp>(op))
    return true;
  if (isa<NegOp, AbsOp, ExpOp, LogOp, SqrtOp, RsqrtOp, ReciprocalOp, TanhOp, ErfOp, SigmoidOp,
          ReluOp, SinOp, CosOp, SiluOp, GeluOp>(op))
    return unaryKernel(unaryName(op)) != nullptr;
  if (auto g = dyn_cast<UnaryGradOp>(op))
    return unaryKernel(g.getFn()) != nullptr;
  return false;
}

std::vector<FusionGroup> fusionGroups(func::FuncOp fn, llvm::DenseSet<Value> &interior) {
  std::map<int64_t, FusionGroup> byId;
  llvm::DenseMap<Operation *, int64_t> groupOf;
  for (Operation &op : fn.getBody().front().without_terminator())
    if (auto k = op.getAttrOfType<IntegerAttr>(kFusionGroupAttr)) {
      byId[k.getInt()].ops.push_back(&op);
      groupOf[&op] = k.getInt();
    }
  std::vector<FusionGroup> groups;
  for (auto &[id, g] : byId) {
    g.root = g.ops.back();
    auto member = [&, id = id](Operation *o) {
      auto it = o ? groupOf.find(o) : groupOf.end();
      return it != groupOf.end() && it->second == id;
    };
    llvm::DenseSet<Value> seen;
    for (Operation *op : g.ops)
      for (Value v : op->getOperands())
        if (!member(v.getDefiningOp()) && seen.insert(v).second)
          g.inputs.push_back(v);
    g.outputs.push_back(g.root->getResult(0));
    for (Operation *op : g.ops) {
      if (op == g.root)
        continue;
      Value v = op->getResult(0);
      if (llvm::any_of(v.getUsers(), [&](Operation *u) { return !member(u); }))
        g.outputs.push_back(v);
      else
        interior.insert(v);
    }
    groups.push_back(std::move(g));
  }
  return groups;
}

ProgramOrder::ProgramOrder(func::FuncOp fn) {
  for (Operation &op : fn.getBody().front().without_terminator()) {
    index[&op] = (int64_t)ops.size();
    ops.push_back(&op);
  }
  for (const FusionGroup &g : fusionGroups(fn, interior))
    for (Operation *op : g.ops)
      rootOf[op] = g.root;
}

bool opensBackward(Operation *op, bool phaseMarks) {
  return StringRef(nodeName(op->getLoc())).starts_with("backward of ") ||
         (phaseMarks && op->getAttr(kPhaseAttr));
}

int64_t ProgramOrder::backwardBegin(bool phaseMarks) const {
  for (Operation *op : ops)
    if (opensBackward(op, phaseMarks))
      return index.lookup(op);
  return (int64_t)ops.size();
}

} // namespace carve

namespace {

using namespace carve;

// kMaxInputs and kMaxOutputs: the runtime's kMaxFusedInputs and
// kMaxFusedOutputs (carve/rt/fused.h), which a generated program checks.
constexpr size_t kMaxOps = 16, kMaxInputs = 8, kMaxOutputs = 4;

/// The grouping of one function (the rules in Passes.td).
class Grouper {
public:
  explicit Grouper(func::FuncOp fn) {
    Block &block = fn.getBody().front();
    for (Operation &op : block.without_terminator()) {
      index[&op] = (int)ops.size();
      ops.push_back(&op);
    }
    for (Value v : block.getTerminator()->getOperands())
      returned.insert(v);
    phaseBegin = (int)ops.size();
    for (Operation *op : ops)
      if (opensBackward(op, true)) {
        phaseBegin = index[op];
        break;
      }
  }

  /// Groups of two or more ops, each as its members' indices, latest root first.
  std::vector<std::set<int>> run() {
    std::vector<std::set<int>> found;
    std::set<int> taken;
    for (int r = (int)ops.size() - 1; r >= 0; --r) {
      if (taken.count(r) || !isFusible(ops[r]))
        continue;
      std::set<int> members = grow(r, taken);
      if (members.size() < 2)
        continue;
      taken.insert(members.begin(), members.end());
      found.push_back(std::move(members));
    }
    return found;
  }

  std::vector<Operation *> ops;

private:
  int definer(Value v) {
    Operation *d = v.getDefiningOp();
    auto it = d ? index.find(d) : index.end();
    return it == index.end() ? -1 : it->second;
  }
  size_t countInputs(const std::set<int> &m) {
    llvm::DenseSet<Value> in;
    for (int i : m)
      for (Value v : ops[i]->getOperands())
        if (!m.count(definer(v)))
          in.insert(v);
    return in.size();
  }
  bool readOutside(Value v, const std::set<int> &m) {
    return llvm::any_of(v.getUsers(), [&](Operation *u) {
      auto it = index.find(u);
      return it == index.end() || !m.count(it->second);
    });
  }
  size_t countOutputs(const std::set<int> &m) {
    size_t n = 1; // the root's result
    for (int i : m)
      if (i != *m.rbegin() && readOutside(ops[i]->getResult(0), m))
        ++n;
    return n;
  }

  /// The group rooted at op r: producers join by rules 1-4 of Passes.td.
  std::set<int> grow(int r, const std::set<int> &taken) {
    Operation *root = ops[r];
    ArrayRef<int64_t> shape = cast<RankedTensorType>(root->getResult(0).getType()).getShape();
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
      if (members.count(p) || taken.count(p) || !isFusible(P) || members.size() >= kMaxOps ||
          (p >= phaseBegin) != (r >= phaseBegin))
        continue;
      Value v = P->getResult(0);
      if (cast<RankedTensorType>(v.getType()).getShape() != shape || returned.count(v) ||
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
    return members;
  }

  llvm::DenseMap<Operation *, int> index;
  llvm::DenseSet<Value> returned;
  int phaseBegin = 0;
};

struct FuseElementwisePass : carve::impl::CarveFuseElementwiseBase<FuseElementwisePass> {
  void runOnOperation() override {
    for (auto fn : getOperation().getOps<func::FuncOp>()) {
      if (!isEmittedFunction(fn))
        continue;
      Grouper g(fn);
      std::vector<std::set<int>> groups = g.run();
      // In program order, so that the kernels are numbered as they run.
      std::reverse(groups.begin(), groups.end());
      Builder b(fn.getContext());
      for (size_t k = 0; k < groups.size(); ++k) {
        for (int i : groups[k])
          g.ops[i]->setAttr(kFusionGroupAttr, b.getI64IntegerAttr((int64_t)k));
        numFused += groups[k].size();
      }
      numGroups += groups.size();
    }
  }
};

} // namespace
