//===- Partitioner.cpp - choose splits, insert collectives, localize ------===//
//
// One pass over @train_step in program order (forward, then backward):
//
// 1. Parameters and the transposes / reshapes / casts / slices of parameters
//    (nn.MultiheadAttention's cross-attention slices q and k, v out of its
//    in_proj_weight) are *free*:
//    they take whatever layout their first consumer wants, at no cost (the
//    runtime loads each rank's shard).
// 2. Every other op gets a choice for the tp axis: one annotated dimension
//    (with a group count when its layout is blocked, e.g. per QKV section) or
//    "replicate". The choice comes from a plan override, else from the default
//    Megatron rules (a matmul with a parameter splits the parameter's output
//    dimension - column parallel - unless its activation already arrives split
//    along the contraction - row parallel; an embedding splits its rows), else
//    from the cheapest of: following a split its operands already have,
//    replicating, or (sequence parallel) splitting the sequence of a norm or
//    elementwise op. Costs are the bytes collectives move plus the op's FLOPs
//    at a fixed exchange rate (CostModel).
// 3. Where an operand's layout differs from the one the choice needs, the
//    cheapest collective sequence comes from a shortest path over layout
//    states (R, P, S(d x g)).
// 4. Every value is retyped to its local shape; slices, embeddings and
//    cross-entropy whose split dimension needs rank-dependent offsets are
//    marked for codegen.
//
//===----------------------------------------------------------------------===//

#include "compiler/partition/Partitioner.h"
#include "compiler/partition/PartitionerImpl.h"

#include "compiler/autodiff/Autodiff.h"
#include "dialects/carve/Annotation.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/dist/DistDialect.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/Verifier.h"
#include "mlir/Pass/Pass.h"
#include "mlir/Pass/PassRegistry.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/Support/GlobPattern.h"

#include <map>
#include <mutex>
#include <queue>
#include <unordered_map>
#include <set>

using namespace mlir;
using namespace carve;

namespace carve {
#define GEN_PASS_DEF_CARVEPARTITION
#include "compiler/partition/Passes.h.inc"
} // namespace carve

namespace carve::partition {

//===----------------------------------------------------------------------===//
// Annotations and layouts
//===----------------------------------------------------------------------===//

const Annotation *Partitioner::annotationOf(Operation *op) {
  auto it = annotations.find(op);
  if (it != annotations.end())
    return &it->second;
  auto p = dyn_cast<PartitionableOpInterface>(op);
  std::string text, origin;
  std::string node = nodeName(op->getLoc());
  for (size_t k = 0; k < opts.annotations.size(); ++k) {
    const AnnotationOverride &o = opts.annotations[k];
    if (o.glob == op->getName().getStringRef() || globMatches(annotationGlobs[k], node)) {
      text = o.annotation;
      origin = o.origin;
      break;
    }
  }
  if (text.empty()) {
    if (!p) {
      fail(op, "has no partition annotation (PartitionableOpInterface); a custom op needs a "
               "rule in the --rules file");
      return nullptr;
    }
    text = p.getPartitionAnnotation();
  }
  std::vector<std::vector<int64_t>> ins, outs;
  for (Value v : op->getOperands())
    ins.push_back(shapeOf(v));
  for (Value v : op->getResults())
    outs.push_back(shapeOf(v));
  // Bound annotations, remembered by text and shapes for the process: the
  // layers of a model repeat them, and the planner partitions it many times.
  static std::mutex boundLock;
  static std::unordered_map<std::string, Annotation> bound;
  std::string key = text;
  for (const auto *list : {&ins, &outs}) {
    key += '|';
    for (const std::vector<int64_t> &shape : *list) {
      key += '[';
      for (int64_t d : shape)
        key += std::to_string(d) + ',';
    }
  }
  {
    std::lock_guard<std::mutex> hold(boundLock);
    auto it = bound.find(key);
    if (it != bound.end())
      return &annotations.emplace(op, it->second).first->second;
  }
  Annotation a;
  std::string e;
  if (!Annotation::parse(text, a, e)) {
    fail(op, origin.empty() ? e : origin + ": " + e);
    return nullptr;
  }
  if (!a.bind(ins, outs, e)) {
    fail(op, origin.empty() ? e : origin + ": " + e);
    return nullptr;
  }
  {
    std::lock_guard<std::mutex> hold(boundLock);
    bound.emplace(std::move(key), a);
  }
  return &annotations.emplace(op, std::move(a)).first->second;
}

bool Partitioner::isParamDerived(Value v) {
  if (auto arg = dyn_cast<BlockArgument>(v))
    return fn.getArgAttr(arg.getArgNumber(), kParamAttr) ||
           fn.getArgAttr(arg.getArgNumber(), kBufferAttr);
  Operation *op = v.getDefiningOp();
  if (isa<TransposeOp, ReshapeOp, CastOp, SliceOp>(op))
    return isParamDerived(op->getOperand(0));
  return false;
}

/// The choice that keeps a tensor laid out as `l` (described by `dims`)
/// without communication: the name whose split is S(d x g).
std::optional<Choice> Partitioner::followOf(const Annotation &a, const TensorFactors &dims,
                                            Layout l) {
  if (!l.isSplit() || l.dim >= static_cast<int64_t>(dims.size()))
    return std::nullopt;
  int64_t before = 1;
  for (const Factor &f : dims[l.dim]) {
    if (!f.name.empty() && l.groups % before == 0) {
      int64_t g = l.groups / before;
      if (g < f.count && f.count % g == 0)
        return Choice{f.name, g};
    }
    before *= f.count;
  }
  return std::nullopt;
}

Layout Partitioner::operandLayout(const Annotation &a, unsigned i, const Choice &c) {
  int64_t dim, outer;
  if (c.partial)
    return Layout::P(false);
  if (c.replicate() || !Annotation::find(a.operands[i], c.name, dim, outer))
    return Layout::R();
  return Layout::S(dim, outer * c.groups);
}

Layout Partitioner::resultLayout(const Annotation &a, unsigned i, const Choice &c) {
  int64_t dim, outer;
  if (c.partial)
    return Layout::P(false);
  if (c.replicate())
    return Layout::R();
  if (Annotation::find(a.results[i], c.name, dim, outer))
    return Layout::S(dim, outer * c.groups);
  switch (a.markOf(c.name)) {
  case Mark::Sum:
    return Layout::P(false);
  case Mark::Max:
    return Layout::P(true);
  default:
    return Layout::R();
  }
}

bool Partitioner::legal(Operation *op, const Annotation &a, const Choice &c, std::string *why) {
  if (c.replicate())
    return true;
  if (c.partial) {
    // Linear in every operand, no broadcasting (a broadcast operand would be
    // counted once per rank).
    if (!isa<AddOp, SubOp, NegOp, ReshapeOp, TransposeOp>(op))
      return false;
    for (Value v : op->getOperands())
      if (typeOf(v).getShape() != typeOf(op->getResult(0)).getShape() &&
          !isa<ReshapeOp, TransposeOp>(op))
        return false;
    return true;
  }
  auto no = [&](const std::string &m) {
    if (why)
      *why = m;
    return false;
  };
  auto size = a.sizes.find(c.name);
  if (size == a.sizes.end())
    return no("the annotation '" + a.text + "' has no dimension '" + c.name + "'");
  Mark m = a.markOf(c.name);
  if (m == Mark::Never)
    return no("dimension '" + c.name + "' of '" + a.text + "' is never split");
  if (c.groups < 1 || size->second % (c.groups * t) != 0)
    return no("tp=" + std::to_string(t) + " does not divide dimension '" + c.name + "' (" +
              std::to_string(size->second) +
              (c.groups > 1 ? " in " + std::to_string(c.groups) + " groups" : "") + ")");
  if (m == Mark::Internal && !isa<CrossEntropyOp, CrossEntropyGradOp>(op))
    return no("'~' (split handled inside the kernel) is only implemented for cross_entropy");
  bool inOperands = false;
  int64_t d, o;
  for (const TensorFactors &x : a.operands)
    inOperands |= Annotation::find(x, c.name, d, o);
  if (m == Mark::Plain && inOperands)
    for (const TensorFactors &x : a.results)
      if (!Annotation::find(x, c.name, d, o))
        return no("a result of '" + a.text + "' lacks '" + c.name +
                  "' and the name is not marked + (partial sums)");
  return true;
}

//===----------------------------------------------------------------------===//
// Costs and the search over layout states
//===----------------------------------------------------------------------===//

double Partitioner::flops(Operation *op) {
  if (op->getNumResults() == 0)
    return 0;
  double out = static_cast<double>(numel(typeOf(op->getResult(0)).getShape()));
  if (auto mm = dyn_cast<MatmulOp>(op)) {
    auto a = typeOf(mm.getLhs());
    return 2 * out * static_cast<double>(a.getDimSize(a.getRank() - 1));
  }
  if (isa<AttentionOp, AttentionGradOp>(op)) {
    auto q = typeOf(op->getOperand(0)), k = typeOf(op->getOperand(1));
    double f = 4.0 * static_cast<double>(numel(q.getShape())) *
               static_cast<double>(k.getDimSize(k.getRank() - 2));
    return isa<AttentionGradOp>(op) ? 2.5 * f : f;
  }
  double sum = 0;
  for (Value r : op->getResults())
    sum += static_cast<double>(numel(typeOf(r).getShape()));
  return 4 * sum;
}

/// Shortest path from `from` to `to` over layout states; edge costs are the
/// bytes each collective moves (ring algorithms), a local split costs a copy.
std::vector<Layout> Partitioner::path(Value v, Layout from, Layout to, double *total) {
  double n = static_cast<double>(bytesOf(v)), tt = static_cast<double>(t);
  std::vector<int64_t> shape = shapeOf(v);
  std::set<int64_t> groupSet = {1};
  for (Layout l : {from, to})
    if (l.isSplit())
      groupSet.insert(l.groups);
  std::vector<Layout> states = {Layout::R(), Layout::P(false), Layout::P(true)};
  for (size_t d = 0; d < shape.size(); ++d)
    for (int64_t g : groupSet)
      if (shape[d] % (g * t) == 0)
        states.push_back(Layout::S(static_cast<int64_t>(d), g));
  for (Layout l : {from, to})
    if (std::find(states.begin(), states.end(), l) == states.end())
      states.push_back(l);
  auto edge = [&](Layout a, Layout b) -> double {
    if (a == b)
      return -1;
    if (a.isPartial()) {
      if (b.kind == SbpKind::Replicated)
        return 2 * n * (tt - 1) / tt;
      if (b.isSplit())
        return n * (tt - 1) / tt;
      return -1;
    }
    if (a.isSplit() && b.kind == SbpKind::Replicated)
      return n * (tt - 1) / tt;
    if (a.isSplit() && b.isSplit() && a.dim != b.dim)
      return n * (tt - 1) / (tt * tt);
    if (a.kind == SbpKind::Replicated && b.isSplit())
      return cost.copyFactor * n / tt;
    return -1;
  };
  std::map<Layout, double> dist;
  std::map<Layout, Layout> prev;
  using Item = std::pair<double, Layout>;
  auto cmp = [](const Item &x, const Item &y) { return x.first > y.first; };
  std::priority_queue<Item, std::vector<Item>, decltype(cmp)> queue(cmp);
  dist[from] = 0;
  queue.push({0, from});
  while (!queue.empty()) {
    auto [d, l] = queue.top();
    queue.pop();
    if (d > dist[l])
      continue;
    for (Layout next : states) {
      double w = edge(l, next);
      if (w < 0)
        continue;
      if (!dist.count(next) || d + w < dist[next]) {
        dist[next] = d + w;
        prev[next] = l;
        queue.push({d + w, next});
      }
    }
  }
  if (!dist.count(to)) {
    if (total)
      *total = -1;
    return {};
  }
  if (total)
    *total = dist[to];
  std::vector<Layout> steps;
  for (Layout l = to; l != from; l = prev[l])
    steps.insert(steps.begin(), l);
  return steps;
}

double Partitioner::redistributionCost(Value v, Layout from, Layout to) {
  if (from == to)
    return 0;
  double c;
  path(v, from, to, &c);
  return c < 0 ? 1e30 : c;
}

double Partitioner::choiceCost(Operation *op, const Annotation &a, const Choice &c) {
  double total = 0;
  for (unsigned i = 0; i < op->getNumOperands(); ++i) {
    Value v = op->getOperand(i);
    Layout want = operandLayout(a, i, c);
    if (freeValues.count(v))
      total += resolve(v, want, true) ? 0 : redistributionCost(v, Layout::R(), want);
    else
      total += redistributionCost(v, layout.lookup(v), want);
  }
  double f = flops(op) * cost.bytesPerFlop;
  total += c.replicate() || c.partial ? f : f / static_cast<double>(t);
  // A partial result will need an all-reduce (or a reduce-scatter) later.
  for (unsigned i = 0; i < op->getNumResults(); ++i)
    if (resultLayout(a, i, c).isPartial())
      total += static_cast<double>(bytesOf(op->getResult(i))) * (t - 1) / t;
  return total;
}

//===----------------------------------------------------------------------===//
// Free values: parameters and their transposes, reshapes, casts and slices
//===----------------------------------------------------------------------===//

bool Partitioner::resolve(Value v, Layout want, bool dry) {
  if (!freeValues.count(v))
    return layout.lookup(v) == want;
  if (want.isPartial())
    return false;
  if (isa<BlockArgument>(v)) {
    if (want.isSplit() && shapeOf(v)[want.dim] % (want.groups * t) != 0)
      return false;
    if (!dry) {
      layout[v] = want;
      freeValues.erase(v);
    }
    return true;
  }
  Operation *op = v.getDefiningOp();
  const Annotation *a = annotationOf(op);
  if (!a)
    return false;
  Choice c;
  if (want.isSplit()) {
    auto f = followOf(*a, a->results[0], want);
    if (!f || !legal(op, *a, *f) || resultLayout(*a, 0, *f) != want)
      return false;
    c = *f;
  }
  Layout in = operandLayout(*a, 0, c);
  if (!resolve(op->getOperand(0), in, dry))
    return false;
  if (!dry) {
    choices[op] = c;
    layout[v] = want;
    freeValues.erase(v);
  }
  return true;
}

/// The group count a split of dimension `dim` of `v` should have so that its
/// consumers can keep it: a consumer that sees the dimension as `(3 c)` (a
/// fused projection cut into sections) wants 3.
int64_t Partitioner::preferredGroups(Value v, int64_t dim, int depth) {
  for (OpOperand &use : v.getUses()) {
    Operation *user = use.getOwner();
    const Annotation *a = isa<func::ReturnOp>(user) ? nullptr : annotationOf(user);
    if (!a)
      continue;
    const DimFactors &d = a->operands[use.getOperandNumber()][dim];
    if (d.size() > 1 && d[0].name.empty())
      return d[0].count;
    if (d.size() != 1 || depth == 0)
      continue;
    for (unsigned r = 0; r < user->getNumResults(); ++r) {
      int64_t rd, outer;
      if (Annotation::find(a->results[r], d[0].name, rd, outer) && outer == 1)
        if (int64_t g = preferredGroups(user->getResult(r), rd, depth - 1); g > 1)
          return g;
    }
  }
  return 1;
}

/// Whether the consumers of `v` (to `depth` levels) can keep its split `l`
/// without communication.
bool Partitioner::canCarry(Value v, Layout l, int depth, Operation **blocker) {
  for (OpOperand &use : v.getUses()) {
    Operation *user = use.getOwner();
    if (isa<func::ReturnOp>(user))
      continue;
    const Annotation *a = annotationOf(user);
    std::optional<Choice> c;
    if (a)
      c = followOf(*a, a->operands[use.getOperandNumber()], l);
    if (!a || !c || !legal(user, *a, *c)) {
      if (blocker)
        *blocker = user;
      return false;
    }
    if (depth == 0)
      continue;
    for (unsigned r = 0; r < user->getNumResults(); ++r) {
      // An attention gradient splits dq, dk and dv alike, but of them only
      // the gradient of the operand followed here carries its split: the
      // others are the key's and value's, whose projections decide their
      // own layout (a grouped-query key with fewer heads than tp arrives
      // replicated and is sliced, its gradient gathered).
      if (isa<AttentionGradOp, AttentionGradStatsOp>(user) && use.getOperandNumber() < 3 &&
          r != use.getOperandNumber())
        continue;
      Layout rl = resultLayout(*a, r, *c);
      if (rl.isSplit() && !canCarry(user->getResult(r), rl, depth - 1, blocker))
        return false;
    }
  }
  return true;
}

//===----------------------------------------------------------------------===//
// Choices
//===----------------------------------------------------------------------===//

bool Partitioner::overrideChoice(Operation *op, const Annotation &a, std::optional<Choice> &c) {
  std::string node = nodeName(op->getLoc());
  if (node.empty())
    return true;
  std::string conflict;
  int k = decidingOverride(opts.overrides, overrideGlobs, node, conflict);
  if (k == -2)
    return fail(op, "the plan's \"ops\" entries " + conflict);
  for (size_t j = 0; j < opts.overrides.size(); ++j)
    if (globMatches(overrideGlobs[j], node)) {
      overrideMatched[j] = true;
      // An equally specific entry that agrees (else k is -2) decides it too.
      if ((int)j != k &&
          globSpecificity(opts.overrides[j].glob) == globSpecificity(opts.overrides[k].glob))
        overrideUsed[j] = true;
      else if ((int)j != k && overrideLost[j].empty())
        overrideLost[j] = node + ", which \"" + opts.overrides[k].glob + "\" decides";
    }
  if (k >= 0) {
    const OpOverride &o = opts.overrides[k];
    overrideUsed[k] = true;
    overridden.insert(op);
    if (replicates(o)) {
      c = Choice{};
      return true;
    }
    if (!a.sizes.count(o.dim))
      return fail(op, "the plan's \"ops\" entry \"" + o.glob + "\" splits dimension '" + o.dim +
                          "', which its annotation '" + a.text + "' does not have");
    Choice want{o.dim, 1};
    // Keep the group count an operand already has for this name.
    for (unsigned i = 0; i < op->getNumOperands(); ++i)
      if (!freeValues.count(op->getOperand(i)))
        if (auto f = followOf(a, a.operands[i], layout.lookup(op->getOperand(i))))
          if (f->name == o.dim)
            want.groups = f->groups;
    std::string why;
    if (!legal(op, a, want, &why))
      return fail(op, "the plan's \"ops\" entry \"" + o.glob + "\" cannot split '" + o.dim +
                          "': " + why);
    c = want;
  }
  return true;
}

/// Whether `v` is the logits of a cross-entropy, directly or through at most
/// `depth` reshapes, transposes, casts and same-shaped elementwise binaries
/// (a bias): a classifier head's output.
static bool feedsCrossEntropy(Value v, int depth) {
  for (Operation *user : v.getUsers()) {
    if (auto ce = dyn_cast<CrossEntropyOp>(user)) {
      if (ce.getLogits() == v)
        return true;
      continue;
    }
    bool passes = isa<ReshapeOp, TransposeOp, CastOp>(user) ||
                  (isa<AddOp, SubOp, MulOp>(user) && user->getResult(0).getType() == v.getType());
    if (depth > 0 && passes && feedsCrossEntropy(user->getResult(0), depth - 1))
      return true;
  }
  return false;
}

/// Megatron's choices for the ops that decide a transformer's layout.
bool Partitioner::defaultRule(Operation *op, const Annotation &a, std::optional<Choice> &c) {
  if (auto mm = dyn_cast<MatmulOp>(op)) {
    bool pa = isParamDerived(mm.getLhs()), pb = isParamDerived(mm.getRhs());
    if (pa == pb)
      return true;
    unsigned act = pa ? 1 : 0, w = pa ? 0 : 1;
    Value actV = op->getOperand(act);
    // The column-parallel choice: the weight's output dimension, when it is
    // one dimension of the result (`grouped`: a group of several, a reshaped
    // weight, which the rule does not split).
    const TensorFactors &wd = a.operands[w];
    bool grouped = false;
    auto column = [&]() -> std::optional<Choice> {
      if (wd.size() < 2)
        return std::nullopt;
      const DimFactors &nd = wd[pa ? wd.size() - 2 : wd.size() - 1];
      grouped = nd.size() != 1;
      int64_t rdim, outer;
      if (grouped || !Annotation::find(a.results[0], nd[0].name, rdim, outer))
        return std::nullopt;
      return Choice{nd[0].name, preferredGroups(op->getResult(0), rdim, 4)};
    };
    // A classifier head (its output is a cross-entropy's logits) splits its
    // classes when it can: the vocab-parallel cross-entropy then never holds
    // all logits, and an activation that arrives split along the contraction
    // is gathered (its bytes) instead of all-reducing the logits (twice
    // theirs) - TorchShard's and Megatron's parallel head. Not when the
    // logits are the smaller (few classes): then the row-parallel rule below.
    if (feedsCrossEntropy(op->getResult(0), 3) && 2 * bytesOf(op->getResult(0)) > bytesOf(actV))
      if (std::optional<Choice> col = column();
          col && legal(op, a, *col) && canCarry(op->getResult(0), resultLayout(a, 0, *col), 4)) {
        c = col;
        return true;
      }
    // Row parallel: the activation arrives split along the contraction.
    if (!freeValues.count(actV))
      if (auto f = followOf(a, a.operands[act], layout.lookup(actV)))
        if (a.markOf(f->name) == Mark::Sum && legal(op, a, *f)) {
          c = f;
          return true;
        }
    // Column parallel: split the weight's output dimension.
    std::optional<Choice> colChoice = column();
    if (!colChoice) {
      if (grouped)
        replicatedWhy[op] = "its weight's output dimension is a group of several dimensions "
                            "(a reshaped weight), which the column-parallel rule does not split";
      return true;
    }
    Choice col = *colChoice;
    std::string why;
    if (!legal(op, a, col, &why))
      return fail(op, "tensor parallelism (tp=" + std::to_string(t) +
                          ") cannot split this projection's output: " + why +
                          "; choose a tp that divides it or replicate the op with an \"ops\" "
                          "entry in the plan");
    // A projection whose consumers cannot keep the split (grouped-query
    // attention with fewer key/value heads than tp) stays replicated.
    Operation *blocker = nullptr;
    if (!canCarry(op->getResult(0), resultLayout(a, 0, col), 4, &blocker)) {
      std::string node = blocker ? nodeName(blocker->getLoc()) : std::string();
      replicatedWhy[op] = "its output, split by columns, would reach " +
                          (blocker ? (node.empty() ? std::string() : node + " ") + "(" +
                                         blocker->getName().getStringRef().str() + ")"
                                   : std::string("an op")) +
                          ", which cannot take that split";
      c = Choice{};
      return true;
    }
    c = col;
    return true;
  }
  if (auto g = dyn_cast<GatherOp>(op)) {
    // Token embeddings (indices from the data) are vocab-parallel; tables
    // looked up with constant indices (positions) stay whole.
    if (!isParamDerived(g.getData()) || g.getAxis() != 0 ||
        isa_and_nonnull<ConstantOp>(g.getIndices().getDefiningOp()))
      return true;
    Choice rows{a.operands[0][0][0].name, 1};
    std::string why;
    if (!legal(op, a, rows, &why))
      return fail(op, "tensor parallelism (tp=" + std::to_string(t) +
                          ") cannot split the embedding's rows (vocab-parallel): " + why);
    c = rows;
    return true;
  }
  if (auto gg = dyn_cast<GatherGradOp>(op)) {
    // The embedding's gradient follows its forward lookup: rows split alike.
    for (Operation *user : gg.getIndices().getUsers())
      if (auto g = dyn_cast<GatherOp>(user))
        if (g.getAxis() == gg.getAxis() && layout.count(g.getData()) &&
            layout.lookup(g.getData()) == Layout::S(g.getAxis(), 1)) {
          Choice rows{a.results[0][gg.getAxis()][0].name, 1};
          if (legal(op, a, rows))
            c = rows;
        }
    return true;
  }
  if (isa<AttentionOp>(op)) {
    // Heads are the dimension before the sequence.
    const TensorFactors &q = a.operands[0];
    if (q.size() < 3)
      return true;
    std::string heads = q[q.size() - 3][0].name;
    if (heads.empty() || a.sizes.at(heads) % t == 0)
      return true;
    // Heads tp does not divide: fine when the operands arrive split some
    // other way (the op follows them), an error for Megatron's head split.
    for (Value v : op->getOperands())
      if (!freeValues.count(v) && layout.lookup(v).isSplit())
        return true;
    return fail(op, "tp=" + std::to_string(t) + " does not divide the " +
                        std::to_string(a.sizes.at(heads)) + " attention heads");
  }
  return true;
}

/// A forward matrix product with a parameter that tp > 1 leaves replicated
/// (not by the plan's "ops"): a line for the report, with the weight's size
/// and why; carve compile prints the large ones as notes.
void Partitioner::noteReplicated(Operation *op, const Choice &c) {
  auto mm = dyn_cast<MatmulOp>(op);
  if (t <= 1 || !mm)
    return;
  std::string node = nodeName(op->getLoc());
  if (StringRef(node).starts_with("backward of "))
    return;
  bool pa = isParamDerived(mm.getLhs()), pb = isParamDerived(mm.getRhs());
  if (pa == pb)
    return;
  auto w = typeOf(pa ? mm.getLhs() : mm.getRhs());
  report.largestProjection = std::max(report.largestProjection, w.getNumElements());
  if (!c.replicate() || c.partial || overridden.count(op))
    return;
  auto it = replicatedWhy.find(op);
  ReplicatedProjection r;
  r.node = node.empty() ? op->getName().getStringRef().str() : node;
  r.weightElements = w.getNumElements();
  r.shape = w.getShape().vec();
  r.why = it != replicatedWhy.end() ? it->second
                                    : "the cost model found replicating it cheaper than "
                                      "splitting it with the layouts around it";
  report.replicated.push_back(r);
}

bool Partitioner::decide(Operation *op) {
  // Transposes, reshapes and casts of free values stay free.
  if (isa<TransposeOp, ReshapeOp, CastOp, SliceOp>(op) && freeValues.count(op->getOperand(0))) {
    freeValues.insert(op->getResult(0));
    return true;
  }
  const Annotation *ap = annotationOf(op);
  if (!ap)
    return false;
  const Annotation &a = *ap;
  std::optional<Choice> chosen;
  if (!overrideChoice(op, a, chosen))
    return false;
  if (!chosen && t > 1 && !defaultRule(op, a, chosen))
    return false;
  if (!chosen) {
    std::vector<Choice> cands;
    auto add = [&](Choice c) {
      if (std::find(cands.begin(), cands.end(), c) == cands.end() && legal(op, a, c))
        cands.push_back(c);
    };
    for (unsigned i = 0; i < op->getNumOperands(); ++i) {
      Value v = op->getOperand(i);
      if (!freeValues.count(v))
        if (auto f = followOf(a, a.operands[i], layout.lookup(v)))
          add(*f);
    }
    add(Choice{});
    for (Value v : op->getOperands())
      if (!freeValues.count(v) && layout.lookup(v) == Layout::P(false)) {
        Choice p;
        p.partial = true;
        add(p);
      }
    if (opts.sequenceParallel && op->getNumResults() >= 1 &&
        isa<LayerNormOp, RmsNormOp, LayerNormGradOp, RmsNormGradOp, AddOp, SubOp, MulOp, DivOp>(
            op) &&
        typeOf(op->getResult(0)).getRank() == 3 && a.results[0][1].size() == 1)
      add(Choice{a.results[0][1][0].name, 1});
    double best = 0;
    for (const Choice &c : cands) {
      double k = choiceCost(op, a, c);
      if (!chosen || k < best - 1e-9) {
        chosen = c;
        best = k;
      }
    }
  }
  choices[op] = *chosen;
  noteReplicated(op, *chosen);
  for (unsigned i = 0; i < op->getNumOperands(); ++i)
    require(op, i, operandLayout(a, i, *chosen));
  for (unsigned i = 0; i < op->getNumResults(); ++i)
    layout[op->getResult(i)] = resultLayout(a, i, *chosen);
  if (!chosen->replicate())
    report.choices.push_back((nodeName(op->getLoc()).empty() ? op->getName().getStringRef().str()
                                                             : nodeName(op->getLoc())) +
                             ": " + op->getName().getStringRef().str() + " '" + a.text + "' -> " +
                             chosen->str());
  return true;
}

void Partitioner::require(Operation *op, unsigned i, Layout want) {
  Value v = op->getOperand(i);
  if (freeValues.count(v)) {
    if (resolve(v, want, false))
      return;
    resolve(v, Layout::R(), false);
  }
  if (layout.lookup(v) != want)
    needs.push_back({op, i, want});
}

bool Partitioner::finishReturn() {
  auto ret = cast<func::ReturnOp>(fn.getBody().front().getTerminator());
  std::map<std::string, Value> params;
  for (BlockArgument arg : fn.getArguments())
    if (auto name = fn.getArgAttrOfType<StringAttr>(arg.getArgNumber(), kParamAttr))
      params[name.str()] = arg;
  for (unsigned k = 0; k < ret.getNumOperands(); ++k) {
    Layout want = Layout::R();
    if (auto of = fn.getResultAttrOfType<StringAttr>(k, kGradOfAttr)) {
      Value p = params.at(of.str());
      if (freeValues.count(p))
        resolve(p, Layout::R(), false);
      want = layout.lookup(p);
    }
    require(ret, k, want);
    returnLayouts.push_back(want);
  }
  // Whatever is still free (parameters nothing consumes) stays whole.
  std::vector<Value> rest(freeValues.begin(), freeValues.end());
  for (Value v : rest)
    if (freeValues.count(v))
      resolve(v, Layout::R(), false);
  return true;
}

bool Partitioner::run(std::string &error) {
  Block &block = fn.getBody().front();
  overrideUsed.assign(opts.overrides.size(), false);
  overrideMatched.assign(opts.overrides.size(), false);
  overrideLost.assign(opts.overrides.size(), std::string());
  for (BlockArgument arg : block.getArguments()) {
    if (isParamDerived(arg))
      freeValues.insert(arg);
    else
      layout[arg] = Layout::R();
  }
  for (Operation &op : block.without_terminator())
    if (!decide(&op)) {
      error = err;
      return false;
    }
  finishReturn();
  for (size_t k = 0; k < opts.overrides.size(); ++k) {
    if (!overrideMatched[k]) {
      error = "plan: \"ops\" entry \"" + opts.overrides[k].glob +
              "\" matches no op of the model (globs match ONNX node names, e.g. "
              "\"/h.0/attn/c_attn/MatMul\"; the comments of OUT/src/program0.cpp show them)";
      return false;
    }
    if (!overrideUsed[k]) {
      error = "plan: \"ops\" entry \"" + opts.overrides[k].glob +
              "\" decides no op: a more specific entry decides every op it matches (e.g. " +
              overrideLost[k] +
              "; of the entries that match a node, the one with the most characters that are "
              "not wildcards decides it)";
      return false;
    }
  }
  if (!materialize()) {
    error = err;
    return false;
  }
  return true;
}

} // namespace carve::partition

size_t carve::globSpecificity(llvm::StringRef glob) {
  size_t n = 0;
  for (size_t i = 0; i < glob.size(); ++i) {
    char ch = glob[i];
    if (ch == '*' || ch == '?')
      continue;
    if (ch == '\\') {
      ++i;
    } else if (ch == '[') {
      // A class counts one; "]" first in it is a member, not its end.
      size_t end = glob.find(']', i + 2);
      if (end != llvm::StringRef::npos)
        i = end;
    }
    ++n;
  }
  return n;
}

bool carve::replicates(const OpOverride &o) { return o.dim.empty() || o.dim == "replicate"; }

int carve::decidingOverride(const std::vector<OpOverride> &entries,
                            const std::vector<std::optional<llvm::GlobPattern>> &globs,
                            llvm::StringRef node, std::string &conflict) {
  // The most specific first, then whether another as specific disagrees: a
  // tie below it is no conflict.
  int best = -1;
  size_t bestSpec = 0;
  auto matches = [&](size_t k) {
    return k < globs.size() && globs[k] && !node.empty() && globs[k]->match(node);
  };
  for (size_t k = 0; k < entries.size(); ++k)
    if (matches(k))
      if (size_t spec = globSpecificity(entries[k].glob); best < 0 || spec > bestSpec) {
        best = (int)k;
        bestSpec = spec;
      }
  for (size_t k = best + 1; best >= 0 && k < entries.size(); ++k) {
    const OpOverride &e = entries[k], &b = entries[best];
    if (matches(k) && globSpecificity(e.glob) == bestSpec && e.dim != b.dim &&
        !(replicates(e) && replicates(b))) {
      conflict = "\"" + b.glob + "\" and \"" + e.glob + "\" both match node " + node.str() +
                 ", are equally specific and split it differently; make one of them more "
                 "specific";
      return -2;
    }
  }
  return best;
}

bool carve::partitionTrainStep(ModuleOp module, const PartitionOptions &opts,
                               PartitionReport &report, std::string &error) {
  auto fn = module.lookupSymbol<func::FuncOp>("train_step");
  if (!fn) {
    error = "partition: the module has no @train_step (run autodiff first)";
    return false;
  }
  if (opts.tp < 1 || opts.dp < 1) {
    error = "partition: dp and tp must be >= 1";
    return false;
  }
  OpBuilder b(module.getBodyRegion());
  b.setInsertionPointToStart(module.getBody());
  if (!module.lookupSymbol(kMeshName))
    dist::MeshOp::create(b, module.getLoc(), b.getStringAttr(kMeshName),
                         b.getStrArrayAttr({"dp", "tp"}),
                         b.getDenseI64ArrayAttr({opts.dp, opts.tp}));
  partition::Partitioner p(module, fn, opts, report);
  if (!p.run(error))
    return false;
  if (opts.verify && failed(verify(module))) {
    error = "partition: the partitioned program does not verify (an internal error; the "
            "diagnostic above names the op)";
    return false;
  }
  return true;
}

namespace {

struct PartitionPass : carve::impl::CarvePartitionBase<PartitionPass> {
  PartitionPass() = default;
  explicit PartitionPass(std::vector<AnnotationOverride> annotations)
      : annotations(std::move(annotations)) {}

  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<PlanAttrs> plan = readPlan(module);
    if (failed(plan))
      return signalPassFailure();
    PartitionOptions o;
    o.dp = (int)plan->dp;
    o.tp = (int)plan->tp;
    o.sequenceParallel = plan->sequenceParallel;
    for (const auto &[glob, dim] : plan->ops)
      o.overrides.push_back({glob, dim});
    o.annotations = annotations;
    PartitionReport report;
    std::string error;
    if (!partitionTrainStep(module, o, report, error)) {
      // On the op at fault (its location names the model node), else the module.
      emitError(report.errorLoc ? *report.errorLoc : module.getLoc()) << error;
      return signalPassFailure();
    }
    Builder b(module.getContext());
    auto i64 = [&](int64_t v) { return b.getI64IntegerAttr(v); };
    module->setAttr(kPartitionSummaryAttr,
                    b.getDictionaryAttr({
                        b.getNamedAttr("ops_split", i64(report.choices.size())),
                        b.getNamedAttr("all_reduce", i64(report.allReduce)),
                        b.getNamedAttr("all_gather", i64(report.allGather)),
                        b.getNamedAttr("reduce_scatter", i64(report.reduceScatter)),
                        b.getNamedAttr("all_to_all", i64(report.allToAll)),
                    }));
    // The large projections tp left replicated (weights of at least 1/16 of
    // the largest projection's elements): carve compile notes each.
    SmallVector<Attribute> notes;
    for (const ReplicatedProjection &r : report.replicated) {
      if (r.weightElements * 16 < report.largestProjection)
        continue;
      std::string shape;
      for (size_t k = 0; k < r.shape.size(); ++k)
        shape += (k ? "x" : "") + std::to_string(r.shape[k]);
      notes.push_back(
          b.getStringAttr(r.node + " (a " + shape + " weight) left replicated: " + r.why));
    }
    if (!notes.empty())
      module->setAttr(kReplicatedProjectionsAttr, b.getArrayAttr(notes));
    numSplit = report.choices.size();
    numCollectives = report.allReduce + report.allGather + report.reduceScatter + report.allToAll +
                     report.localSplit;
  }

  /// A rules file's annotation overrides (compiler/rules): C++ only.
  std::vector<AnnotationOverride> annotations;
};

} // namespace

std::unique_ptr<Pass> carve::createPartitionPass(std::vector<AnnotationOverride> annotations) {
  return std::make_unique<PartitionPass>(std::move(annotations));
}
