//===- Recompute.cpp - carve-recompute: forward ops again in backward -----===//
//
// Groups the forward ops the plan's `recompute` names (numbered layers for
// `full`, attention cores for `selective`), and for each group clones the
// ops behind the values only backward reads to just before their first
// backward reader (Passes.td states the rules).
//
//===----------------------------------------------------------------------===//

#include "compiler/recompute/Recompute.h"

#include "compiler/fusion/Fusion.h"

#include "compiler/stages/StageSplit.h"
#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"
#include "dialects/dist/DistDialect.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/IRMapping.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/Support/GlobPattern.h"

#include <map>
#include <set>

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVERECOMPUTE
#include "compiler/recompute/Passes.h.inc"
} // namespace carve

namespace carve {

namespace {
/// "h.3" for a forward op of layer 3 of "h"; empty outside numbered layers
/// and for backward ops.
std::string forwardLayer(Operation *op) {
  std::string node = nodeName(op->getLoc());
  return StringRef(node).starts_with(kBackwardPrefix) ? "" : layerName(node);
}
} // namespace

bool layersMatching(ModuleOp module, const std::string &glob, std::vector<std::string> &layers,
                    std::string &error) {
  auto pattern = llvm::GlobPattern::create(glob);
  if (!pattern) {
    error = "recompute_layers: '" + glob + "' is not a valid glob (" +
            llvm::toString(pattern.takeError()) + ")";
    return false;
  }
  std::set<std::string> found;
  module.walk([&](Operation *op) {
    std::string l = forwardLayer(op);
    if (!l.empty() && pattern->match(l))
      found.insert(l);
  });
  layers.assign(found.begin(), found.end());
  return true;
}

namespace {

/// One function's forward ops grouped for recomputation.
class Recomputer {
public:
  explicit Recomputer(func::FuncOp fn) : fn(fn) {
    Block &block = fn.getBody().front();
    for (Operation &op : block.without_terminator()) {
      index[&op] = (int)ops.size();
      ops.push_back(&op);
    }
    backwardBegin = (int)ops.size();
    for (Operation *op : ops)
      if (opensBackward(op, true)) {
        backwardBegin = index[op];
        break;
      }
    for (Operation *op : ops)
      if (auto g = op->getAttrOfType<IntegerAttr>(kFusionGroupAttr)) {
        fusionGroups[g.getInt()].push_back(op);
        nextGroup = std::max(nextGroup, g.getInt() + 1);
      }
  }

  /// `def`, an operand of `op`, runs in one kernel with it: the same fused
  /// group, a transpose folded into `op`'s matmul flag, or a matmul whose
  /// product the transpose `op` writes (carve.fold).
  static bool sameKernel(Operation *def, Operation *op) {
    auto a = def->getAttrOfType<IntegerAttr>(kFusionGroupAttr);
    auto b = op->getAttrOfType<IntegerAttr>(kFusionGroupAttr);
    if (a && b && a.getInt() == b.getInt())
      return true;
    auto fd = def->getAttrOfType<StringAttr>(kFoldAttr);
    auto fo = op->getAttrOfType<StringAttr>(kFoldAttr);
    return (fd && fd.getValue() == kFoldOperand) ||
           (fo && (fo.getValue() == kFoldProduct || fo.getValue() == kFoldScatter));
  }

  /// Forward ops that may be run again: not the pipeline's sends and receives.
  bool clonable(Operation *op) const {
    return index.lookup(op) < backwardBegin && !isa<dist::SendOp, dist::RecvOp>(op) &&
           op->getNumResults() > 0 && op->getNumRegions() == 0;
  }

  /// `full`: the forward ops of each selected layer, in program order.
  std::vector<std::vector<Operation *>> layerGroups(const std::vector<llvm::GlobPattern> &only) {
    std::map<std::string, std::vector<Operation *>> byLayer;
    std::vector<std::string> order;
    for (Operation *op : ops) {
      if (!clonable(op))
        continue;
      std::string l = forwardLayer(op);
      if (l.empty())
        continue;
      if (!only.empty() &&
          llvm::none_of(only, [&](const llvm::GlobPattern &g) { return g.match(l); }))
        continue;
      if (!byLayer.count(l))
        order.push_back(l);
      byLayer[l].push_back(op);
    }
    std::vector<std::vector<Operation *>> groups;
    for (const std::string &l : order)
      groups.push_back(byLayer[l]);
    return groups;
  }

  /// `selective`: each attention core written out op by op: a softmax over
  /// scores that a matmul made (through elementwise ops: scale, mask), and
  /// the matmuls that weight the values by it.
  std::vector<std::vector<Operation *>> attentionGroups() {
    std::vector<std::vector<Operation *>> groups;
    for (Operation *op : ops) {
      auto sm = dyn_cast<SoftmaxOp>(op);
      if (!sm || !clonable(op))
        continue;
      std::set<Operation *> core{op};
      Operation *scores = nullptr;
      Value v = sm.getInput();
      for (int depth = 0; depth < 8; ++depth) {
        Operation *def = v.getDefiningOp();
        if (!def || !clonable(def))
          break;
        if (isa<MatmulOp>(def)) {
          scores = def;
          break;
        }
        if (def->getNumResults() != 1 || def->getResult(0).getType() != v.getType() ||
            def->getNumOperands() == 0)
          break;
        core.insert(def);
        v = def->getOperand(0); // the scores flow through the first operand
      }
      if (!scores)
        continue;
      core.insert(scores);
      for (Operation *user : sm->getUsers())
        if (isa<MatmulOp>(user) && clonable(user))
          core.insert(user);
      std::vector<Operation *> group(core.begin(), core.end());
      llvm::sort(group, [&](Operation *a, Operation *b) { return index[a] < index[b]; });
      groups.push_back(group);
    }
    return groups;
  }

  /// Clones what backward reads of `group` before its first backward reader;
  /// returns the number of ops cloned.
  int recompute(const std::vector<Operation *> &group) {
    llvm::DenseSet<Operation *> in(group.begin(), group.end());
    Operation *ret = fn.getBody().front().getTerminator();
    // The values only backward reads, and the first backward op reading one.
    SmallVector<Value> redo;
    for (Operation *op : group)
      for (Value r : op->getResults()) {
        bool backward = false, keep = false;
        for (Operation *user : r.getUsers()) {
          if (user == ret || (!in.count(user) && index.lookup(user) < backwardBegin))
            keep = true;
          else if (index.lookup(user) >= backwardBegin)
            backward = true;
        }
        if (backward && !keep)
          redo.push_back(r);
      }
    if (redo.empty())
      return 0;
    Operation *first = nullptr;
    for (Value r : redo)
      for (Operation *user : r.getUsers())
        if (index.lookup(user) >= backwardBegin && (!first || index[user] < index[first]))
          first = user;
    // The ops behind them inside the group, and whatever runs as one kernel
    // with one of those (a fused group's other members, the transpose a
    // matmul's product is written by), so that each clone runs the kernel
    // its original ran and computes the same bits.
    llvm::DenseSet<Operation *> needed;
    SmallVector<Operation *> work;
    for (Value r : redo)
      work.push_back(r.getDefiningOp());
    while (!work.empty()) {
      Operation *op = work.pop_back_val();
      if (!needed.insert(op).second)
        continue;
      for (Value o : op->getOperands())
        if (Operation *d = o.getDefiningOp(); d && (in.count(d) || sameKernel(d, op)))
          work.push_back(d);
      if (auto g = op->getAttrOfType<IntegerAttr>(kFusionGroupAttr))
        for (Operation *member : fusionGroups[g.getInt()])
          work.push_back(member);
      for (Operation *user : op->getUsers())
        if (clonable(user) && sameKernel(op, user))
          work.push_back(user);
    }
    SmallVector<Operation *> order(needed.begin(), needed.end());
    llvm::sort(order, [&](Operation *a, Operation *b) { return index[a] < index[b]; });
    // Clone them, in program order, before the first backward reader; a
    // fused group's clones form a group of their own.
    OpBuilder b(first);
    IRMapping map;
    std::map<int64_t, int64_t> newGroup;
    for (Operation *op : order) {
      Operation *c = b.clone(*op, map);
      c->setLoc(NameLoc::get(
          b.getStringAttr(std::string(kBackwardPrefix) + nodeName(op->getLoc()) + " (recomputed)"),
          op->getLoc()));
      c->setAttr(kRecomputedAttr, b.getUnitAttr());
      if (auto g = op->getAttrOfType<IntegerAttr>(kFusionGroupAttr)) {
        auto it = newGroup.find(g.getInt());
        if (it == newGroup.end())
          it = newGroup.emplace(g.getInt(), nextGroup++).first;
        c->setAttr(kFusionGroupAttr, b.getI64IntegerAttr(it->second));
      }
    }
    const int cloned = (int)order.size();
    // Backward reads the clones.
    for (Value r : redo)
      r.replaceUsesWithIf(map.lookup(r), [&](OpOperand &u) {
        auto it = index.find(u.getOwner());
        return it != index.end() && it->second >= backwardBegin;
      });
    return cloned;
  }

private:
  func::FuncOp fn;
  std::vector<Operation *> ops;
  llvm::DenseMap<Operation *, int> index;
  int backwardBegin = 0;
  std::map<int64_t, std::vector<Operation *>> fusionGroups; // carve.fusion_group
  int64_t nextGroup = 0;
};

struct RecomputePass : carve::impl::CarveRecomputeBase<RecomputePass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<PlanAttrs> plan = readPlan(module);
    if (failed(plan))
      return signalPassFailure();
    if (plan->recompute == "none")
      return;
    std::vector<llvm::GlobPattern> only;
    for (const std::string &g : plan->recomputeLayers) {
      std::vector<std::string> layers;
      std::string error;
      if (!layersMatching(module, g, layers, error)) {
        module.emitError() << "carve-recompute: " << error;
        return signalPassFailure();
      }
      if (layers.empty()) {
        std::vector<std::string> all;
        layersMatching(module, "*", all, error);
        module.emitError() << "carve-recompute: recompute_layers '" << g
                           << "' names no layer of the model (its layers: "
                           << (all.empty() ? std::string("none")
                                           : all.front() + " .. " + all.back())
                           << ")";
        return signalPassFailure();
      }
      only.push_back(std::move(*llvm::GlobPattern::create(g)));
    }
    for (auto fn : module.getOps<func::FuncOp>()) {
      if (!isEmittedFunction(fn))
        continue;
      Recomputer r(fn);
      auto groups = plan->recompute == "selective" ? r.attentionGroups() : r.layerGroups(only);
      for (const auto &g : groups)
        if (int n = r.recompute(g)) {
          ++numGroups;
          numCloned += n;
        }
    }
  }
};

} // namespace

} // namespace carve
