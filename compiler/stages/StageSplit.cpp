//===- StageSplit.cpp - cutting the training step into pipeline stages ----===//
//
// See StageSplit.h. The cut works on the order of @train_step: every forward op
// comes before every backward op, and the forward ops are in a topological
// order, so contiguous pieces of the forward ops only ever pass values to
// later pieces.
//
//===----------------------------------------------------------------------===//

#include "compiler/stages/StageSplit.h"
#include "compiler/stages/Passes.h"

#include "compiler/partition/Partitioner.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/dist/DistDialect.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/IRMapping.h"
#include "mlir/IR/Verifier.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/Support/GlobPattern.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVESPLITSTAGES
#include "compiler/stages/Passes.h.inc"
namespace {

RankedTensorType typeOf(Value v) { return cast<RankedTensorType>(v.getType()); }

int64_t bytesOf(Value v) {
  auto t = typeOf(v);
  unsigned bits = t.getElementType().getIntOrFloatBitWidth();
  return t.getNumElements() * std::max<unsigned>(1, bits / 8);
}

} // namespace

double opFlops(Operation *op) {
  StringRef name = op->getName().getStringRef();
  double out = 0;
  for (Value r : op->getResults())
    if (auto t = dyn_cast<RankedTensorType>(r.getType()))
      out += (double)t.getNumElements();
  if (name == "carve.matmul" && op->getNumOperands() >= 2) {
    auto a = typeOf(op->getOperand(0));
    return 2.0 * out * (double)a.getShape().back();
  }
  // A convolution kept whole (the CUDA target's cuDNN convolutions) and its
  // gradients: the FLOPs of the GEMMs im2col would run, 2 per output element
  // per weight element of its channel group, the same for all three.
  if ((name == "carve.conv2d" || name == "carve.conv2d_grad_input" ||
       name == "carve.conv2d_grad_weight") &&
      op->getNumOperands() >= 2) {
    const bool filter = name == "carve.conv2d_grad_weight";
    auto w = typeOf(filter ? op->getResult(0) : op->getOperand(1)).getShape();
    auto y = typeOf(name == "carve.conv2d" ? op->getResult(0) : op->getOperand(filter ? 1 : 0));
    return 2.0 * (double)y.getNumElements() * (double)(w[1] * w[2] * w[3]);
  }
  if ((name == "carve.attention" || name == "carve.attention_grad") && op->getNumOperands() >= 3) {
    auto q = typeOf(op->getOperand(0)), k = typeOf(op->getOperand(1));
    int64_t r = q.getRank();
    double rows = (double)q.getNumElements() / (double)q.getShape()[r - 1];
    double f = 4.0 * rows * (double)k.getShape()[r - 2] * (double)q.getShape()[r - 1];
    return name == "carve.attention" ? f : 2.5 * f;
  }
  return out;
}

std::string layerName(StringRef node) {
  std::string prefix;
  int number = 0;
  return layerOfNode(node, prefix, number) ? prefix + "." + std::to_string(number) : "";
}

bool layerOfNode(StringRef node, std::string &prefix, int &number) {
  SmallVector<StringRef> parts;
  node.split(parts, '/');
  for (StringRef p : parts) {
    size_t dot = p.rfind('.');
    if (dot == StringRef::npos || dot == 0 || dot + 1 >= p.size())
      continue;
    StringRef num = p.drop_front(dot + 1);
    if (num.size() > 9 || !llvm::all_of(num, [](char c) { return isdigit((unsigned char)c); }))
      continue; // (a number too large for an int is no layer number)
    StringRef pre = p.take_front(dot);
    if (!llvm::all_of(pre, [](char c) { return isalnum((unsigned char)c) || c == '_'; }))
      continue;
    prefix = pre.str();
    number = std::stoi(num.str());
    return true;
  }
  return false;
}

std::vector<int> crossingUnits(const std::vector<Operation *> &fwd) {
  std::vector<int> unitOf(fwd.size(), 0);
  DenseMap<Value, int> lastUse;
  for (size_t i = 0; i < fwd.size(); ++i)
    for (Value v : fwd[i]->getOperands())
      lastUse[v] = (int)i;
  int unit = 0;
  for (size_t i = 1; i < fwd.size(); ++i) {
    int crossing = 0;
    for (size_t j = 0; j < i; ++j)
      for (Value r : fwd[j]->getResults())
        if (lastUse.count(r) && lastUse[r] >= (int)i)
          ++crossing;
    if (crossing == 1 && i + 1 < fwd.size())
      ++unit;
    unitOf[i] = unit;
  }
  return unitOf;
}

std::vector<int> balancedPartition(const std::vector<double> &unitCost, int S) {
  const int units = (int)unitCost.size();
  std::vector<int> perStage(std::max(S, 0), 0);
  if (S < 1 || S > units)
    return perStage;
  // Dynamic programming; a model has few layers.
  std::vector<double> prefixSum(units + 1, 0);
  for (int u = 0; u < units; ++u)
    prefixSum[u + 1] = prefixSum[u] + unitCost[u];
  const double inf = 1e300;
  std::vector<std::vector<double>> best(S + 1, std::vector<double>(units + 1, inf));
  std::vector<std::vector<int>> from(S + 1, std::vector<int>(units + 1, -1));
  best[0][0] = 0;
  for (int s = 1; s <= S; ++s)
    for (int u = s; u <= units; ++u)
      for (int w = s - 1; w < u; ++w) {
        double c = std::max(best[s - 1][w], prefixSum[u] - prefixSum[w]);
        if (c < best[s][u] - 1e-9 * std::max(1.0, c)) {
          best[s][u] = c;
          from[s][u] = w;
        }
      }
  for (int s = S, u = units; s > 0; --s) {
    int w = from[s][u];
    perStage[s - 1] = u - w;
    u = w;
  }
  return perStage;
}

namespace {

struct Transfer {
  Value value;       // in @train_step
  int from, to;      // stages
  bool fromBackward; // sent from the sender's backward part
  bool toBackward;   // first needed in the receiver's backward part
  int tag;
};

class Splitter {
public:
  Splitter(ModuleOp module, func::FuncOp fn, const PipelineOptions &opts, PipelineReport &report)
      : module(module), fn(fn), opts(opts), report(report), S(opts.pp * opts.virtualStages) {}

  bool run(std::string &error);

private:
  ModuleOp module;
  func::FuncOp fn;
  const PipelineOptions &opts;
  PipelineReport &report;
  const int S;

  std::vector<Operation *> ops;
  DenseMap<Operation *, int> index;
  int firstBackward = 0;
  DenseMap<Operation *, int> stageOf; // -1: cloned into its consumers
  DenseSet<Operation *> cloned;
  DenseSet<Value> batchDependent, trained;
  std::map<std::string, int> nodeStage; // forward node name -> stage (latest)
  std::vector<Transfer> transfers;
  /// Result index -> (stage, that stage's part) for gradients summed over stages.
  std::map<unsigned, std::vector<std::pair<int, Value>>> sharedParts;
  /// Per stage: the arguments it reads, the weight-only ops cloned into it.
  std::vector<std::set<unsigned>> argsOf;
  std::vector<DenseSet<Operation *>> clonedInto;
  /// Per non-shared gradient result: the stage that returns it.
  std::map<unsigned, int> gradStage;

  bool fail(std::string &error, const std::string &msg) {
    error = msg;
    return false;
  }
  bool isBackward(Operation *op) const { return index.lookup(op) >= firstBackward; }
  /// The units stages are cut between (findUnits).
  struct Units {
    std::vector<int> unitOf;        // per forward op on the batch
    std::vector<std::string> names; // per unit: "h.3", or its first node
    std::string prefix;             // the numbered layers' prefix ("" when none)
    int count = 0;
  };
  Units findUnits(const std::vector<Operation *> &fwd);
  std::vector<double> unitCosts(const std::vector<Operation *> &fwd, const Units &u);
  bool stagesAtCuts(const std::vector<Operation *> &fwd, std::vector<int> &stageOfFwd,
                    std::string &error);
  bool balancedStages(const std::vector<Operation *> &fwd, const Units &u,
                      std::vector<int> &stageOfFwd, std::string &error);
  bool cutForward(std::string &error);
  bool assignRest(std::string &error);
  bool splitSharedGradients(std::string &error);
  bool collectTransfers(std::string &error);
  bool build(std::string &error);
  /// The stages an op's value is consumed on (through cloned ops).
  void consumerStages(Operation *op, std::set<int> &out);
};

bool Splitter::run(std::string &error) {
  Block &block = fn.getBody().front();
  for (Operation &op : block.without_terminator()) {
    index[&op] = (int)ops.size();
    ops.push_back(&op);
  }
  firstBackward = (int)ops.size();
  for (Operation *op : ops)
    if (StringRef(nodeName(op->getLoc())).starts_with(kBackwardPrefix)) {
      firstBackward = index[op];
      break;
    }
  // Which values depend on the batch, and which on trainable parameters.
  for (BlockArgument a : fn.getArguments()) {
    if (fn.getArgAttr(a.getArgNumber(), kInputAttr) ||
        fn.getArgAttr(a.getArgNumber(), kLossSeedAttr))
      batchDependent.insert(a);
    if (fn.getArgAttr(a.getArgNumber(), kTrainableAttr))
      trained.insert(a);
  }
  for (Operation *op : ops) {
    bool batch = false, train = false;
    for (Value v : op->getOperands())
      batch |= batchDependent.count(v) > 0, train |= trained.count(v) > 0;
    for (Value r : op->getResults()) {
      if (batch)
        batchDependent.insert(r);
      if (train)
        trained.insert(r);
    }
  }
  return cutForward(error) && assignRest(error) && splitSharedGradients(error) &&
         collectTransfers(error) && build(error);
}

/// Units that stages are cut between: numbered layers (the most common
/// prefix; the ops before the first join it, those after the last join the
/// last), else pieces where exactly one value on the batch crosses.
Splitter::Units Splitter::findUnits(const std::vector<Operation *> &fwd) {
  Units u;
  std::vector<int> &unitOf = u.unitOf;
  std::vector<std::string> &unitName = u.names;
  std::string &prefix = u.prefix;
  unitOf.assign(fwd.size(), 0);
  std::map<std::string, int> prefixCount;
  std::map<std::string, std::set<int>> numbers;
  for (Operation *op : fwd) {
    std::string p;
    int n;
    if (layerOfNode(nodeName(op->getLoc()), p, n)) {
      ++prefixCount[p];
      numbers[p].insert(n);
    }
  }
  for (auto &[p, c] : prefixCount)
    if (prefix.empty() || c > prefixCount[prefix])
      prefix = p;
  int numbered = 0;
  for (auto &[p, ns] : numbers)
    numbered += ns.size() >= 2;
  if (numbered > 1) {
    // Several prefixes number two layers or more (ResNet's layer1 ..
    // layer4, VGG's features and classifier): every layer of each, in
    // program order, is a unit (as the planner's profile and full
    // recomputation take them); the ops before the first join it, the
    // others the layer before them.
    std::set<std::string> seen;
    int unit = -1;
    for (size_t i = 0; i < fwd.size(); ++i) {
      std::string p;
      int n;
      if (layerOfNode(nodeName(fwd[i]->getLoc()), p, n) && numbers[p].size() >= 2 &&
          seen.insert(p + "." + std::to_string(n)).second) {
        ++unit;
        unitName.push_back(p + "." + std::to_string(n));
      }
      unitOf[i] = std::max(unit, 0);
    }
    report.numLayers = (int)unitName.size();
  } else if (!prefix.empty()) {
    int unit = -1, lastNumber = -1;
    for (size_t i = 0; i < fwd.size(); ++i) {
      std::string p;
      int n;
      if (layerOfNode(nodeName(fwd[i]->getLoc()), p, n) && p == prefix && n != lastNumber &&
          (unit < 0 || n > lastNumber)) {
        ++unit;
        lastNumber = n;
        unitName.push_back(prefix + "." + std::to_string(n));
      }
      unitOf[i] = std::max(unit, 0);
    }
    report.numLayers = (int)unitName.size();
  } else {
    // No numbered layers: cut where exactly one value on the batch crosses.
    unitOf = crossingUnits(fwd);
    for (size_t i = 0; i < fwd.size(); ++i)
      if (i == 0 || unitOf[i] != unitOf[i - 1])
        unitName.push_back(nodeName(fwd[i]->getLoc()));
  }
  u.count = unitOf.back() + 1;
  return u;
}

/// Cost of each unit: the FLOPs of its forward ops and their backward ops.
std::vector<double> Splitter::unitCosts(const std::vector<Operation *> &fwd, const Units &u) {
  llvm::StringMap<double> nodeFlops;
  for (Operation *op : ops) {
    std::string nameText = nodeName(op->getLoc());
    StringRef n = nameText;
    if (n.starts_with(kBackwardPrefix))
      n = n.drop_front(strlen(kBackwardPrefix));
    nodeFlops[n] += opFlops(op);
  }
  std::vector<double> unitCost(u.count, 0);
  std::set<std::string> counted;
  for (size_t i = 0; i < fwd.size(); ++i) {
    std::string n = nodeName(fwd[i]->getLoc());
    if (n.empty())
      unitCost[u.unitOf[i]] += opFlops(fwd[i]);
    else if (counted.insert(n).second)
      unitCost[u.unitOf[i]] += nodeFlops[n];
  }

  return unitCost;
}

/// Stages at the plan's cut points (stage k + 1 starts at the first forward
/// op matching cuts[k]).
bool Splitter::stagesAtCuts(const std::vector<Operation *> &fwd, std::vector<int> &stageOfFwd,
                            std::string &error) {
  if ((int)opts.cuts.size() != S - 1)
    return fail(error, "plan: \"cuts\" has " + std::to_string(opts.cuts.size()) +
                           " cut point(s); pp=" + std::to_string(opts.pp) +
                           (opts.virtualStages > 1
                                ? " x virtual_stages=" + std::to_string(opts.virtualStages)
                                : std::string()) +
                           " makes " + std::to_string(S) + " stages, which need " +
                           std::to_string(S - 1));
  std::vector<size_t> at;
  for (size_t k = 0; k < opts.cuts.size(); ++k) {
    auto glob = llvm::GlobPattern::create(opts.cuts[k]);
    if (!glob)
      return fail(error, "plan: cut point '" + opts.cuts[k] +
                             "' is not a valid glob: " + llvm::toString(glob.takeError()));
    size_t found = fwd.size();
    for (size_t i = 0; i < fwd.size(); ++i)
      if (glob->match(nodeName(fwd[i]->getLoc()))) {
        found = i;
        break;
      }
    if (found == fwd.size())
      return fail(error, "plan: cut point '" + opts.cuts[k] +
                             "' names no forward op of the model (ONNX node names look "
                             "like '/h.1/attn/c_attn/MatMul'; the comments of any compiled "
                             "OUT/src/program0.cpp show them)");
    if (found == 0)
      return fail(error, "plan: cut point '" + opts.cuts[k] +
                             "' matches the model's first op; stage 0 would be empty");
    if (!at.empty() && found <= at.back())
      return fail(error, "plan: cut point '" + opts.cuts[k] + "' (at '" +
                             nodeName(fwd[found]->getLoc()) + "') does not come after cut point '" +
                             opts.cuts[k - 1] + "'; list cut points in model order");
    at.push_back(found);
  }
  for (size_t i = 0, k = 0; i < fwd.size(); ++i) {
    while (k < at.size() && at[k] <= i)
      ++k;
    stageOfFwd[i] = (int)k;
  }
  return true;
}

/// Stages balanced by cost: the contiguous partition of the units into S
/// stages that minimizes the largest stage cost.
bool Splitter::balancedStages(const std::vector<Operation *> &fwd, const Units &u,
                              std::vector<int> &stageOfFwd, std::string &error) {
  const int units = u.count;
  const std::vector<int> &unitOf = u.unitOf;
  const std::vector<std::string> &unitName = u.names;
  const std::vector<double> unitCost = unitCosts(fwd, u);
  if (S > units) {
    std::string what = report.numLayers
                           ? std::to_string(units) + " layer" + (units == 1 ? "" : "s") + " ('" +
                                 unitName.front() + "' .. '" + unitName.back() + "')"
                           : std::to_string(units) + " piece" + (units == 1 ? "" : "s") +
                                 " (no numbered layers; cut where one tensor crosses)";
    return fail(error, "plan: pp=" + std::to_string(opts.pp) +
                           (opts.virtualStages > 1
                                ? " x virtual_stages=" + std::to_string(opts.virtualStages)
                                : std::string()) +
                           " needs " + std::to_string(S) +
                           " pipeline stages but the model has only " + what +
                           "; a stage holds at least one");
  }
  const std::vector<int> perStage = balancedPartition(unitCost, S);
  std::vector<int> stageOfUnit;
  for (int st = 0; st < S; ++st)
    stageOfUnit.insert(stageOfUnit.end(), perStage[st], st);
  for (size_t i = 0; i < fwd.size(); ++i)
    stageOfFwd[i] = stageOfUnit[unitOf[i]];
  return true;
}

/// Stages of the forward ops that depend on the batch.
bool Splitter::cutForward(std::string &error) {
  std::vector<Operation *> fwd; // forward ops on the batch, in order
  for (int i = 0; i < firstBackward; ++i)
    if (llvm::any_of(ops[i]->getResults(), [&](Value r) { return batchDependent.count(r); }))
      fwd.push_back(ops[i]);
  if (fwd.empty())
    return fail(error, "pipeline: the training step has no forward ops on the batch");
  const Units u = findUnits(fwd);
  const std::vector<int> &unitOf = u.unitOf;
  std::vector<int> stageOfFwd(fwd.size(), 0);
  if (!opts.cuts.empty() ? !stagesAtCuts(fwd, stageOfFwd, error)
                         : !balancedStages(fwd, u, stageOfFwd, error))
    return false;
  for (size_t i = 0; i < fwd.size(); ++i) {
    stageOf[fwd[i]] = stageOfFwd[i];
    std::string n = nodeName(fwd[i]->getLoc());
    if (!n.empty())
      nodeStage[n] = stageOfFwd[i];
  }
  report.stages.assign(S, StageSummary());
  for (size_t i = 0; i < fwd.size(); ++i) {
    StageSummary &st = report.stages[stageOfFwd[i]];
    std::string n = nodeName(fwd[i]->getLoc());
    if (st.first.empty())
      st.first = n;
    if (!n.empty())
      st.last = n;
  }
  if (!u.prefix.empty() || opts.cuts.empty())
    for (size_t i = 0; i < fwd.size(); ++i)
      if (i == 0 || unitOf[i] != unitOf[i - 1])
        ++report.stages[stageOfFwd[i]].layers;
  for (int s = 0; s < S; ++s)
    if (report.stages[s].first.empty())
      return fail(error, "plan: pipeline stage " + std::to_string(s) +
                             " would hold no ops; move the cut points apart");
  return true;
}

void Splitter::consumerStages(Operation *op, std::set<int> &out) {
  for (Operation *u : op->getUsers()) {
    if (isa<func::ReturnOp>(u))
      continue;
    if (cloned.count(u)) {
      consumerStages(u, out);
      continue;
    }
    auto it = stageOf.find(u);
    if (it != stageOf.end())
      out.insert(it->second);
  }
}

/// Backward ops follow their forward op; ops on weights alone follow their
/// consumers.
bool Splitter::assignRest(std::string &error) {
  auto byNode = [&](Operation *op) -> int {
    std::string nameText = nodeName(op->getLoc());
    StringRef n = nameText;
    if (!n.starts_with(kBackwardPrefix))
      return -1;
    auto it = nodeStage.find(n.drop_front(strlen(kBackwardPrefix)).str());
    return it == nodeStage.end() ? -1 : it->second;
  };
  // 1. Backward ops of forward ops on the batch.
  for (int i = firstBackward; i < (int)ops.size(); ++i)
    if (int s = byNode(ops[i]); s >= 0)
      stageOf[ops[i]] = s;
  // 2. Forward ops on weights alone, last to first: cloned when nothing
  // trains them, else on their first consumer's stage.
  for (int i = firstBackward - 1; i >= 0; --i) {
    Operation *op = ops[i];
    if (stageOf.count(op))
      continue;
    bool isTrained = llvm::any_of(op->getResults(), [&](Value r) { return trained.count(r); });
    if (!isTrained) {
      cloned.insert(op);
      continue;
    }
    std::set<int> users;
    consumerStages(op, users);
    // Its backward ops, assigned by node in step 1 only if the node was on
    // the batch; otherwise they follow this op below.
    stageOf[op] = users.empty() ? S - 1 : *users.begin();
    std::string n = nodeName(op->getLoc());
    if (!n.empty() && !nodeStage.count(n))
      nodeStage[n] = stageOf[op];
  }
  // 3. The remaining backward ops: by node now, else after the latest stage
  // of what they read (the loss seed's reshape goes with the loss).
  for (int i = firstBackward; i < (int)ops.size(); ++i) {
    Operation *op = ops[i];
    if (stageOf.count(op))
      continue;
    int s = byNode(op);
    if (s < 0) {
      for (Value v : op->getOperands())
        if (Operation *d = v.getDefiningOp(); d && stageOf.count(d))
          s = std::max(s, stageOf[d]);
      if (s < 0)
        s = S - 1;
    }
    stageOf[op] = s;
  }
  (void)error;
  return true;
}

/// A parameter used on several stages gets one gradient part per stage: the
/// add tree that sums its contributions is regrouped by stage.
bool Splitter::splitSharedGradients(std::string &error) {
  auto ret = cast<func::ReturnOp>(fn.getBody().front().getTerminator());
  for (unsigned k = 1; k < ret.getNumOperands(); ++k) {
    auto of = fn.getResultAttrOfType<StringAttr>(k, kGradOfAttr);
    if (!of)
      continue;
    Value g = ret.getOperand(k);
    // Leaves of the add tree (adds made by autodiff in the backward part).
    SmallVector<Value> leaves, work{g};
    SmallVector<Operation *> adds;
    while (!work.empty()) {
      Value v = work.pop_back_val();
      Operation *d = v.getDefiningOp();
      if (d && isa<AddOp>(d) && isBackward(d) && d->getOperand(0).getType() == v.getType() &&
          d->getOperand(1).getType() == v.getType() && d->hasOneUse()) {
        adds.push_back(d);
        work.push_back(d->getOperand(1));
        work.push_back(d->getOperand(0));
        continue;
      }
      leaves.push_back(v);
    }
    std::map<int, SmallVector<Value>> byStage;
    for (Value l : leaves) {
      Operation *d = l.getDefiningOp();
      if (!d || !stageOf.count(d))
        return fail(error, "pipeline: the gradient of '" + of.getValue().str() +
                               "' is not computed by an op (an internal error)");
      byStage[stageOf[d]].push_back(l);
    }
    if (byStage.size() <= 1)
      continue;
    report.sharedParams.push_back(of.getValue().str());
    // Sum each stage's leaves right before the return, as that stage's part.
    OpBuilder b(ret);
    SmallVector<Value> parts;
    SmallVector<int> partStages;
    for (auto &[s, ls] : byStage) {
      Value sum = ls[0];
      for (size_t i = 1; i < ls.size(); ++i) {
        auto add = AddOp::create(b, ls[i].getLoc(), sum.getType(), sum, ls[i]);
        stageOf[add] = s;
        index[add] = (int)ops.size();
        ops.push_back(add);
        sum = add;
      }
      parts.push_back(sum);
      partStages.push_back(s);
    }
    for (size_t i = 0; i < parts.size(); ++i)
      sharedParts[k].push_back({partStages[i], parts[i]});
    // The old tree is dead: the stage functions return the parts.
    ret->setOperand(k, parts[0]);
    for (Operation *a : adds)
      a->erase();
  }
  // Renumber (the regrouping added and removed ops).
  ops.clear();
  index.clear();
  for (Operation &op : fn.getBody().front().without_terminator()) {
    index[&op] = (int)ops.size();
    ops.push_back(&op);
  }
  return true;
}

bool Splitter::collectTransfers(std::string &error) {
  argsOf.assign(S, {});
  clonedInto.assign(S, {});
  // (value, to) -> transfer number
  std::map<std::pair<void *, int>, int> found;
  std::function<void(Operation *, int)> cloneInto = [&](Operation *op, int s) {
    if (!clonedInto[s].insert(op).second)
      return;
    for (Value v : op->getOperands()) {
      if (auto a = dyn_cast<BlockArgument>(v))
        argsOf[s].insert(a.getArgNumber());
      else if (cloned.count(v.getDefiningOp()))
        cloneInto(v.getDefiningOp(), s);
    }
  };
  auto describe = [&](Value v) {
    Operation *d = v.getDefiningOp();
    std::string n = d ? nodeName(d->getLoc()) : "";
    return d ? "'" + d->getName().getStringRef().str() + "'" + (n.empty() ? "" : " ('" + n + "')")
             : std::string("an argument");
  };
  // A use of `v` on stage s, in its backward part or not.
  Operation *user = nullptr; // the op being looked at, for errors
  auto use = [&](Value v, int s, bool backward) -> bool {
    if (auto a = dyn_cast<BlockArgument>(v)) {
      argsOf[s].insert(a.getArgNumber());
      return true;
    }
    Operation *d = v.getDefiningOp();
    if (cloned.count(d)) {
      cloneInto(d, s);
      return true;
    }
    int t = stageOf.lookup(d);
    if (t == s)
      return true;
    bool fromBackward = isBackward(d);
    bool ok = fromBackward ? (backward && t > s) : (backward || t < s);
    if (!ok)
      return fail(error, "pipeline: the value of " + describe(v) + " is computed on stage " +
                             std::to_string(t) + (fromBackward ? " (backward)" : " (forward)") +
                             " but needed earlier, on stage " + std::to_string(s) +
                             (backward ? " (backward)" : " (forward)") +
                             (user ? " by " + describe(user->getResult(0)) : std::string()) +
                             "; no pipeline schedule can run that (an internal error)");
    if (t % opts.pp == s % opts.pp)
      return fail(error, "pipeline: the value of " + describe(v) + " goes from stage " +
                             std::to_string(t) + " to stage " + std::to_string(s) +
                             ", which run on the same pipeline rank; choose other cut points "
                             "or fewer virtual stages");
    auto key = std::make_pair(v.getAsOpaquePointer(), s);
    auto it = found.find(key);
    if (it != found.end()) {
      transfers[it->second].toBackward &= backward;
      return true;
    }
    found[key] = (int)transfers.size();
    transfers.push_back({v, t, s, fromBackward, backward, (int)transfers.size()});
    return true;
  };
  for (Operation *op : ops) {
    if (cloned.count(op))
      continue;
    int s = stageOf.lookup(op);
    user = op->getNumResults() ? op : nullptr;
    for (Value v : op->getOperands())
      if (!use(v, s, isBackward(op)))
        return false;
  }
  user = nullptr;
  // The return: the loss on the last stage; each gradient on the stage that
  // holds its parameter.
  auto ret = cast<func::ReturnOp>(fn.getBody().front().getTerminator());
  if (!use(ret.getOperand(0), S - 1, false))
    return false;
  const std::vector<std::optional<unsigned>> paramArgs = paramArgsOfGrads(fn);
  for (unsigned k = 1; k < ret.getNumOperands(); ++k) {
    StringAttr of = gradOf(fn, k);
    if (!of)
      return fail(error,
                  "pipeline: @train_step result " + std::to_string(k) + " is not a gradient");
    std::optional<unsigned> arg = paramArgs[k];
    int param = arg ? (int)*arg : -1;
    if (param < 0)
      return fail(error, "pipeline: gradient of unknown parameter '" + of.getValue().str() + "'");
    std::set<int> holders;
    for (int s = 0; s < S; ++s)
      if (argsOf[s].count(param))
        holders.insert(s);
    if (sharedParts.count(k)) {
      std::set<int> parts;
      for (auto &[s, v] : sharedParts[k])
        parts.insert(s);
      if (parts != holders)
        return fail(error, "pipeline: parameter '" + of.getValue().str() +
                               "' is used on stages that do not all compute a part of its "
                               "gradient; this version cannot keep its copies equal");
      continue;
    }
    Operation *d = ret.getOperand(k).getDefiningOp();
    int home = holders.empty() ? (d ? stageOf.lookup(d) : S - 1) : *holders.begin();
    if (holders.size() > 1)
      return fail(error, "pipeline: parameter '" + of.getValue().str() +
                             "' is used on several stages but its gradient is one value");
    gradStage[k] = home;
    argsOf[home].insert(param);
    if (!use(ret.getOperand(k), home, true))
      return false;
  }
  int maxTransfers = 32767;
  if ((int)transfers.size() > maxTransfers)
    return fail(error, "pipeline: " + std::to_string(transfers.size()) +
                           " values cross stage boundaries; at most 32767 are supported");
  report.transfers = (int)transfers.size();
  return true;
}

bool Splitter::build(std::string &error) {
  MLIRContext *ctx = module.getContext();
  OpBuilder mb(ctx);
  // The mesh gains the pp axis (outermost).
  if (Operation *old = module.lookupSymbol(kMeshName))
    old->erase();
  mb.setInsertionPointToStart(module.getBody());
  dist::MeshOp::create(mb, module.getLoc(), mb.getStringAttr(kMeshName),
                       mb.getStrArrayAttr({"pp", "dp", "tp"}),
                       mb.getDenseI64ArrayAttr({opts.pp, opts.dp, opts.tp}));
  auto ret = cast<func::ReturnOp>(fn.getBody().front().getTerminator());
  auto meshRef = FlatSymbolRefAttr::get(ctx, kMeshName);
  auto ppAxis = mb.getStringAttr("pp");
  // The order in which a stage sends its messages to one other stage: the
  // forward values first, then the backward values, each in program order
  // (an op's results in order, then the transfers of one value in order).
  DenseMap<Operation *, int> position;
  for (size_t i = 0; i < ops.size(); ++i)
    position[ops[i]] = (int)i;
  auto sendOrder = [&](const Transfer &t) {
    auto r = cast<OpResult>(t.value);
    return std::make_tuple(t.fromBackward, position.lookup(r.getOwner()), r.getResultNumber(),
                           t.tag);
  };
  mb.setInsertionPoint(fn);
  for (int s = 0; s < S; ++s) {
    StageSummary &summary = report.stages[s];
    // Arguments: what the stage reads, every graph input (the runtime fills
    // them on every rank), the loss seed on the last stage.
    std::vector<unsigned> args;
    for (BlockArgument a : fn.getArguments()) {
      unsigned i = a.getArgNumber();
      if (argsOf[s].count(i) || fn.getArgAttr(i, kInputAttr))
        args.push_back(i);
    }
    SmallVector<Type> argTypes;
    SmallVector<DictionaryAttr> argAttrs;
    for (unsigned i : args) {
      argTypes.push_back(fn.getArgument(i).getType());
      argAttrs.push_back(fn.getArgAttrDict(i) ? fn.getArgAttrDict(i) : mb.getDictionaryAttr({}));
      if (fn.getArgAttr(i, kParamAttr))
        summary.paramBytes += bytesOf(fn.getArgument(i));
    }
    auto stage = func::FuncOp::create(mb, fn.getLoc(), "stage" + std::to_string(s),
                                      mb.getFunctionType(argTypes, {}));
    for (NamedAttribute a : fn->getDiscardableAttrs())
      stage->setAttr(a.getName(), a.getValue());
    stage->setAttr(kStageAttr, mb.getI64IntegerAttr(s));
    stage->setAttr(kNumStagesAttr, mb.getI64IntegerAttr(S));
    Block *body = stage.addEntryBlock();
    for (size_t k = 0; k < args.size(); ++k)
      stage.setArgAttrs(k, argAttrs[k]);
    IRMapping map;
    for (size_t k = 0; k < args.size(); ++k)
      map.map(fn.getArgument(args[k]), body->getArgument(k));
    OpBuilder b = OpBuilder::atBlockEnd(body);
    // NCCL matches the messages between two ranks by order alone (no tags),
    // so both sides post them in one order. A message goes in the forward
    // part when it goes down the pipeline (t.from < t.to) and in the
    // backward part when it goes up; so each direction between two stages
    // carries one part's messages, which both stages run micro-batch by
    // micro-batch in the same order whatever their schedules interleave.
    // Within a part the receiver posts them in the order the sender sends:
    // up, the forward values the receiver's backward reads (sent at the
    // start of the sender's backward, kept until then), then the backward
    // values, each in program order.
    auto recvs = [&](bool backward) {
      std::vector<const Transfer *> in;
      for (const Transfer &t : transfers)
        if (t.to == s && (t.from > t.to) == backward)
          in.push_back(&t);
      std::stable_sort(in.begin(), in.end(), [&](const Transfer *x, const Transfer *y) {
        return sendOrder(*x) < sendOrder(*y);
      });
      for (const Transfer *tp : in) {
        const Transfer &t = *tp;
        int64_t offset = (int64_t)(t.from % opts.pp) - (int64_t)(s % opts.pp);
        Location loc = t.value.getDefiningOp() ? t.value.getDefiningOp()->getLoc() : fn.getLoc();
        auto r = dist::RecvOp::create(b, loc, t.value.getType(), meshRef, ppAxis,
                                      b.getI64IntegerAttr(offset), b.getI64IntegerAttr(t.tag));
        r->setAttr(kFromStageAttr, b.getI64IntegerAttr(t.from));
        if (backward)
          r->setAttr(kPhaseAttr, b.getStringAttr("backward"));
        if (!t.fromBackward && isRounded16(t.value)) // the sender rounded it (carve-round-activations)
          r->setAttr(kRound16Attr, b.getUnitAttr());
        map.map(t.value, r.getResult());
      }
    };
    auto send = [&](const Transfer &t, Location loc) {
      int64_t offset = (int64_t)(t.to % opts.pp) - (int64_t)(s % opts.pp);
      auto snd = dist::SendOp::create(b, loc, map.lookup(t.value), meshRef, ppAxis,
                                      b.getI64IntegerAttr(offset), b.getI64IntegerAttr(t.tag));
      snd->setAttr(kToStageAttr, b.getI64IntegerAttr(t.to));
      summary.sendBytes += bytesOf(t.value);
    };
    // Forward values that go up: sent when the backward part starts.
    auto sendsUp = [&]() {
      std::vector<const Transfer *> up;
      for (const Transfer &t : transfers)
        if (t.from == s && t.to < s && !t.fromBackward)
          up.push_back(&t);
      std::stable_sort(up.begin(), up.end(), [&](const Transfer *x, const Transfer *y) {
        return sendOrder(*x) < sendOrder(*y);
      });
      for (const Transfer *t : up)
        send(*t, t->value.getDefiningOp()->getLoc());
    };
    recvs(false);
    bool inBackward = false;
    for (Operation *op : ops) {
      bool mine = cloned.count(op) ? clonedInto[s].count(op) > 0 : stageOf.lookup(op) == s;
      if (!mine)
        continue;
      if (!inBackward && isBackward(op)) {
        inBackward = true;
        sendsUp();
        recvs(true);
      }
      Operation *c = b.clone(*op, map);
      ++summary.ops;
      summary.flops += opFlops(op);
      (isBackward(op) ? summary.backwardFlops : summary.forwardFlops) += opFlops(op);
      for (Value r : op->getResults())
        for (const Transfer &t : transfers)
          if (t.value == r && (t.to > s || t.fromBackward))
            send(t, c->getLoc());
    }
    if (!inBackward) {
      sendsUp();
      recvs(true);
    }
    // Results.
    SmallVector<Value> results;
    SmallVector<DictionaryAttr> resultAttrs;
    if (s == S - 1) {
      results.push_back(map.lookup(ret.getOperand(0)));
      resultAttrs.push_back(b.getDictionaryAttr(b.getNamedAttr(kLossAttr, b.getUnitAttr())));
    }
    for (unsigned k = 1; k < ret.getNumOperands(); ++k) {
      DictionaryAttr attrs = fn.getResultAttrDict(k);
      if (auto it = sharedParts.find(k); it != sharedParts.end()) {
        for (auto &[ps, v] : it->second)
          if (ps == s) {
            results.push_back(map.lookup(v));
            NamedAttrList l(attrs);
            l.set(kSharedGradAttr, b.getUnitAttr());
            resultAttrs.push_back(l.getDictionary(ctx));
          }
        continue;
      }
      if (gradStage[k] != s)
        continue;
      results.push_back(map.lookup(ret.getOperand(k)));
      resultAttrs.push_back(attrs);
    }
    func::ReturnOp::create(b, ret.getLoc(), results);
    SmallVector<Type> resultTypes;
    for (Value v : results)
      resultTypes.push_back(v.getType());
    stage.setFunctionType(mb.getFunctionType(argTypes, resultTypes));
    for (size_t k = 0; k < resultAttrs.size(); ++k)
      stage.setResultAttrs(k, resultAttrs[k]);
  }
  fn.erase();
  if (failed(verify(module)))
    return fail(error, "pipeline: the stage functions do not verify (an internal error; the "
                       "diagnostic above names the op)");
  return true;
}

} // namespace

bool splitPipelineStages(ModuleOp module, const PipelineOptions &opts, PipelineReport &report,
                         std::string &error) {
  auto fn = module.lookupSymbol<func::FuncOp>("train_step");
  if (!fn) {
    error = "pipeline: the module has no @train_step (run autodiff first)";
    return false;
  }
  if (opts.pp < 1 || opts.virtualStages < 1) {
    error = "pipeline: pp and virtual_stages must be >= 1";
    return false;
  }
  if (fn.getBody().getBlocks().size() != 1) {
    error = "pipeline: @train_step must be a single block";
    return false;
  }
  Splitter s(module, fn, opts, report);
  return s.run(error);
}

namespace {

struct SplitStagesPass : carve::impl::CarveSplitStagesBase<SplitStagesPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<PlanAttrs> plan = readPlan(module);
    if (failed(plan))
      return signalPassFailure();
    PipelineOptions o;
    o.pp = (int)plan->pp;
    o.virtualStages = (int)plan->virtualStages;
    o.dp = (int)plan->dp;
    o.tp = (int)plan->tp;
    o.cuts = plan->cuts;
    PipelineReport report;
    std::string error;
    if (!splitPipelineStages(module, o, report, error)) {
      module.emitError(error);
      return signalPassFailure();
    }
    std::vector<func::FuncOp> stages = stageFunctions(module);
    for (size_t s = 0; s < stages.size() && s < report.stages.size(); ++s)
      writeStageSummary(stages[s], report.stages[s]);
    numTransfers = report.transfers;
  }
};

} // namespace

} // namespace carve
