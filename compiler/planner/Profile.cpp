//===- Profile.cpp - measuring a model's training step by layer -----------===//

#include "compiler/planner/Profile.h"

#include "compiler/autodiff/Autodiff.h"
#include "compiler/frontend/Builtin.h"
#include "compiler/frontend/Passes.h"
#include "compiler/fusion/Fusion.h"
#include "compiler/lower/Passes.h"
#include "compiler/partition/ExpertParallel.h"
#include "compiler/stages/StageSplit.h"
#include "dialects/carve/Annotation.h"
#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/dist/DistDialect.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/Pass/PassManager.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/ADT/SetVector.h"
#include "llvm/ADT/StringMap.h"

#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <set>

using namespace mlir;

namespace carve::planner {

const char *commKindName(int kind) {
  static const char *names[] = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all"};
  return kind >= 0 && kind < kNumCommKinds ? names[kind] : "?";
}

namespace {

double elemsOf(Value v) {
  if (auto t = dyn_cast<RankedTensorType>(v.getType()))
    return (double)t.getNumElements();
  return 0;
}

/// Ops whose result shares memory with an operand, or has none: a gather
/// its matmuls gather themselves (carve.fold = "gather", a convolution's
/// windows) is read from its table, which is what is kept.
bool isView(Operation *op) {
  return isa<ReshapeOp, TransposeOp, SliceOp>(op) ||
         (isa<GatherOp>(op) && foldOf(op) == kFoldGather);
}

/// Walks @train_step and fills the profile.
class Profiler {
public:
  Profiler(func::FuncOp fn, Profile &p) : fn(fn), p(p) {}
  bool run(std::string &error);

private:
  void findLayers();
  void markBatch();
  void assignSegments();
  void countWork();
  void gemmDims(Operation *o, OpWork &w);
  void countActivations();
  bool packedIn16(Value root) const;
  void countTransients();
  void countBoundaries();
  void countParameters();
  void countSplitCosts();
  void collectSites();

public:
  /// The routed experts (carve-expert-parallel's analysis of @forward):
  /// their parameters and the exchanges' elements, in their layers' parts.
  void countExperts(func::FuncOp forward);

private:
  func::FuncOp fn;
  Profile &p;
  // Segment order: 0 embedding, 1..L layers, L+1 head.
  std::vector<Segment *> segs;
  llvm::DenseMap<Operation *, int> segOf;
  std::map<std::string, int> nodeSeg; // forward node -> segment
  llvm::DenseSet<Value> batch;        // values that depend on the batch
  /// Of `batch`, those whose size does not: sums over the batch (a weight's
  /// gradient, a batch norm's statistics) and what is computed from them.
  llvm::DenseSet<Value> fixedSize;
  std::string prefix;                 // the numbered layers' prefix ("h")
  int numLayers = 0;
  std::map<std::string, int> layerIndex; // layer name ("h.3") -> dense index
  /// Without numbered layers: each forward op on the batch -> its piece.
  llvm::DenseMap<Operation *, int> unitOf;
  int headSeg = 0;               // the head's segment

  bool isBackward(Operation *op) const {
    return StringRef(nodeName(op->getLoc())).starts_with(kBackwardPrefix);
  }
  std::string forwardNode(Operation *op) const {
    std::string n = nodeName(op->getLoc());
    StringRef s(n);
    if (s.starts_with(kBackwardPrefix))
      return s.drop_front(StringRef(kBackwardPrefix).size()).str();
    return n;
  }
};

/// The numbered layers: those of the most common prefix among forward node
/// names, or of every prefix numbering two or more where there are several;
/// one segment per layer between the embedding and the head.
void Profiler::findLayers() {
  Block &body = fn.getBody().front();
  std::map<std::string, std::set<int>> byPrefix;
  for (Operation &op : body.without_terminator()) {
    std::string pre;
    int n;
    if (layerOfNode(forwardNode(&op), pre, n))
      byPrefix[pre].insert(n);
  }
  for (auto &[pre, nums] : byPrefix)
    if ((int)nums.size() > numLayers) {
      prefix = pre;
      numLayers = (int)nums.size();
    }
  int numbered = 0;
  for (auto &[pre, nums] : byPrefix)
    numbered += nums.size() >= 2;
  std::vector<std::string> names;
  p.layersDiffer = numbered > 1;
  if (numbered > 1) {
    // Several numbered prefixes (ResNet's layer1 .. layer4, VGG's features
    // and classifier): every layer of each, in program order, as
    // carve-recompute's full recomputation takes them.
    prefix.clear();
    for (Operation &op : body.without_terminator()) {
      std::string pre;
      int n;
      if (!isBackward(&op) && layerOfNode(forwardNode(&op), pre, n) && byPrefix[pre].size() >= 2) {
        std::string name = pre + "." + std::to_string(n);
        if (layerIndex.emplace(name, (int)names.size()).second)
          names.push_back(name);
      }
    }
  } else if (numLayers) {
    for (int n : byPrefix[prefix]) {
      std::string name = prefix + "." + std::to_string(n);
      layerIndex.emplace(name, (int)names.size());
      names.push_back(name);
    }
  }
  if (names.empty()) {
    // No numbered layers: the pieces carve-split-stages cuts such a model
    // between (where exactly one value on the batch crosses).
    std::vector<Operation *> fwd;
    for (Operation &op : body.without_terminator())
      if (!isBackward(&op) &&
          llvm::any_of(op.getResults(), [&](Value r) { return batch.count(r) > 0; }))
        fwd.push_back(&op);
    if (!fwd.empty()) {
      const std::vector<int> unit = crossingUnits(fwd);
      for (size_t i = 0; i < fwd.size(); ++i) {
        if (i == 0 || unit[i] != unit[i - 1])
          names.push_back(nodeName(fwd[i]->getLoc()));
        unitOf[fwd[i]] = unit[i];
      }
      p.layersDiffer = true;
    }
  }
  numLayers = (int)names.size();
  p.stagesUnmodelled = numLayers == 0;
  p.layers.assign(numLayers, Segment{});
  for (int i = 0; i < numLayers; ++i)
    p.layers[i].name = names[i];
  p.embedding.name = numLayers ? "embedding" : "model";
  p.head.name = "head";
  segs.push_back(&p.embedding);
  for (Segment &s : p.layers)
    segs.push_back(&s);
  segs.push_back(&p.head);
  headSeg = (int)segs.size() - 1;
}

/// The values that depend on the batch.
void Profiler::markBatch() {
  Block &body = fn.getBody().front();
  for (BlockArgument a : body.getArguments())
    if (fn.getArgAttr(a.getArgNumber(), kInputAttr))
      batch.insert(a);
  for (Operation &op : body.without_terminator())
    for (Value v : op.getOperands())
      if (batch.count(v)) {
        for (Value r : op.getResults())
          batch.insert(r);
        break;
      }
  // Fixed-size results: a product of two per-sample matrices contracts over
  // their rows (A^T dY, a weight's gradient); a reduction over dimension 0
  // (where carve keeps the batch, alone or folded with the sequence) sums
  // the batch away; a gather's gradient by per-sample indices fills its
  // table; and an op whose batch-dependent operands are all fixed-size.
  for (Operation &op : body.without_terminator()) {
    Operation *o = &op;
    bool anyBatch = false, allFixed = true;
    for (Value v : o->getOperands())
      if (batch.count(v)) {
        anyBatch = true;
        allFixed &= fixedSize.count(v) > 0;
      }
    if (!anyBatch)
      continue;
    bool fixed = allFixed;
    if (auto mm = dyn_cast<MatmulOp>(o)) {
      auto a = dyn_cast<RankedTensorType>(mm.getOperand(0).getType());
      auto b = dyn_cast<RankedTensorType>(mm.getOperand(1).getType());
      fixed |= a && b && a.getRank() == 2 && b.getRank() == 2 && batch.count(mm.getOperand(0)) &&
               batch.count(mm.getOperand(1));
    } else if (isa<ReduceSumOp, ReduceMeanOp, ReduceMaxOp>(o)) {
      auto axes = o->getAttrOfType<DenseI64ArrayAttr>("axes");
      fixed |= axes && llvm::is_contained(axes.asArrayRef(), 0);
    } else if (isa<GatherGradOp>(o)) {
      fixed |= batch.count(o->getOperand(1)) > 0;
    } else if (isa<Conv2dGradWeightOp>(o)) {
      fixed = true; // summed over the samples, as a weight's GEMM gradient
    }
    if (fixed)
      for (Value r : o->getResults())
        fixedSize.insert(r);
  }
}

/// Segments: forward ops by layer; a forward op outside the layers belongs
/// to the head when it reads (through any chain of ops) a layer's result,
/// to the part of its first reader when it depends on neither the batch nor
/// a layer (a tied embedding's transpose for the head), else to the
/// embedding, whatever its position (a Llama's rotary tables may be built
/// after its first layer's ops and still belong to the first stage, as the
/// pipeline splitter places them); backward ops by the forward node they
/// differentiate.
void Profiler::assignSegments() {
  Block &body = fn.getBody().front();
  int current = 0;
  // An op between two layers (a functional ReLU or pooling between a
  // model's numbered convolutions) joins the layer before it, as
  // carve-split-stages' units take it; after the last layer, the head.
  int lastLayerOp = -1, here = 0, lastLayerSeg = -1;
  if (numLayers > 0)
    for (Operation &op : body.without_terminator()) {
      std::string pre;
      int n;
      if (!isBackward(&op) && layerOfNode(forwardNode(&op), pre, n) &&
          layerIndex.count(pre + "." + std::to_string(n)))
        lastLayerOp = here;
      ++here;
    }
  here = -1;
  llvm::DenseSet<Value> fromLayers;
  std::vector<Operation *> weightOnly; // placed by their readers, below
  for (Operation &op : body.without_terminator()) {
    Operation *o = &op;
    std::string node = forwardNode(o);
    int seg = -1;
    std::string pre;
    int n;
    bool readsLayers = false;
    for (Value v : o->getOperands())
      readsLayers |= fromLayers.contains(v);
    ++here;
    if (auto u = unitOf.find(o); u != unitOf.end()) {
      seg = 1 + u->second;
    } else if (layerOfNode(node, pre, n) && layerIndex.count(pre + "." + std::to_string(n))) {
      seg = 1 + layerIndex[pre + "." + std::to_string(n)];
      if (!isBackward(o))
        lastLayerSeg = seg;
    } else if (!isBackward(o)) {
      if (!node.empty())
        seg = readsLayers ? (here < lastLayerOp ? lastLayerSeg : headSeg) : 0;
      bool perSample = false;
      for (Value r : o->getResults())
        perSample |= batch.count(r) > 0;
      if (!node.empty() && !readsLayers && !perSample)
        weightOnly.push_back(o);
    } else {
      auto it = nodeSeg.find(node);
      if (it != nodeSeg.end())
        seg = it->second;
    }
    if (seg < 0)
      seg = current;
    if (!isBackward(o)) {
      if (readsLayers || (seg >= 1 && seg < headSeg))
        for (Value r : o->getResults())
          fromLayers.insert(r);
      if (!node.empty())
        nodeSeg[node] = seg;
    }
    current = seg;
    segOf[o] = seg;
  }
  // Readers come later in the block: walk back so that a chain of
  // weight-only ops takes its last reader's part.
  std::map<std::string, int> moved;
  for (auto it = weightOnly.rbegin(); it != weightOnly.rend(); ++it) {
    Operation *o = *it;
    int seg = -1;
    for (Operation *u : o->getUsers())
      if (!isBackward(u) && segOf.count(u))
        seg = seg < 0 ? segOf[u] : std::min(seg, segOf[u]);
    if (seg < 0 || seg == segOf[o])
      continue;
    segOf[o] = seg;
    moved[forwardNode(o)] = seg;
  }
  if (moved.empty())
    return;
  for (Operation &op : body.without_terminator())
    if (isBackward(&op))
      if (auto it = moved.find(forwardNode(&op)); it != moved.end())
        segOf[&op] = it->second;
}

/// The GEMM dimensions of a matmul or attention op (OpWork::gemmFixed,
/// gemmPerSample). A matmul `[..., M, K] x [..., K, N]` of a per-sample
/// operand and a weight folds the per-sample side's batch dimensions into
/// its rows (M, or N when the weight is on the left), which grow with the
/// micro-batch; a product of two per-sample matrices (a weight's gradient,
/// `A^T @ dY`) contracts over the rows (K grows); a batched product of
/// per-sample operands (attention written out) and carve.attention (M = Tq,
/// N = Tk, K = d) repeat a fixed-size GEMM.
void Profiler::gemmDims(Operation *o, OpWork &w) {
  auto dims = [](Value v) {
    std::vector<double> d;
    if (auto t = dyn_cast<RankedTensorType>(v.getType()))
      for (int64_t x : t.getShape())
        d.push_back((double)std::max<int64_t>(x, 1));
    return d;
  };
  // A convolution kept whole: the GEMM im2col would run, [pixels, C/g kh kw]
  // x [C/g kh kw, O/g] per group, the pixels growing with the micro-batch;
  // its weight gradient contracts over them (K grows).
  if (isa<Conv2dOp, Conv2dGradInputOp, Conv2dGradWeightOp>(o)) {
    const bool filter = isa<Conv2dGradWeightOp>(o);
    auto wt = cast<RankedTensorType>((filter ? o->getResult(0) : o->getOperand(1)).getType());
    auto yt = cast<RankedTensorType>(
        (isa<Conv2dOp>(o) ? o->getResult(0) : o->getOperand(filter ? 1 : 0)).getType());
    const double k = (double)(wt.getDimSize(1) * wt.getDimSize(2) * wt.getDimSize(3));
    const double groups = (double)cast<IntegerAttr>(o->getAttr("group")).getInt();
    const double n = (double)wt.getDimSize(0) / groups;
    const double pixels = (double)(yt.getDimSize(2) * yt.getDimSize(3));
    w.gemmFixed = std::min(k, n);
    w.gemmPerSample = pixels; // M (forward, data gradient) or K (weight gradient)
    return;
  }
  std::vector<double> a = dims(o->getOperand(0)), b = dims(o->getOperand(1));
  if (a.size() < 2 || b.size() < 2) {
    w.gemmFixed = 1; // a vector product: no GEMM to speak of
    return;
  }
  auto lead = [](const std::vector<double> &d, size_t keep) {
    double p = 1;
    for (size_t i = 0; i + keep < d.size(); ++i)
      p *= d[i];
    return p;
  };
  if (!isa<MatmulOp>(o)) {
    // q [..., Tq, d], k [..., Tk, d].
    w.gemmFixed = std::min({a[a.size() - 2], b[b.size() - 2], a.back()});
    return;
  }
  double M = a[a.size() - 2], K = a.back(), N = b.back();
  bool aB = batch.count(o->getOperand(0)) > 0, bB = batch.count(o->getOperand(1)) > 0;
  if (aB && !bB) {
    w.gemmFixed = std::min(K, N);
    w.gemmPerSample = M * lead(a, 2);
  } else if (!aB && bB) {
    w.gemmFixed = std::min(M, K);
    w.gemmPerSample = N * lead(b, 2);
  } else if (aB && bB && a.size() == 2 && b.size() == 2) {
    w.gemmFixed = std::min(M, N);
    w.gemmPerSample = K;
    w.fixedElems += elemsOf(o->getResult(0)); // [M, N]: one per micro-batch
  } else {
    w.gemmFixed = std::min({M, N, K});
  }
}

/// Work, collectives and the largest op of each segment.
void Profiler::countWork() {
  Block &body = fn.getBody().front();
  for (Operation &op : body.without_terminator()) {
    Operation *o = &op;
    Segment &s = *segs[segOf[o]];
    bool bwd = isBackward(o);
    bool perSample = false;
    for (Value r : o->getResults())
      perSample |= batch.count(r) > 0;
    if (o->getDialect()->getNamespace() == "dist") {
      double e = 0;
      int kind = -1;
      if (isa<dist::AllReduceOp>(o))
        kind = kAllReduce, e = elemsOf(o->getResult(0));
      else if (isa<dist::AllGatherOp>(o))
        kind = kAllGather, e = elemsOf(o->getResult(0));
      else if (isa<dist::ReduceScatterOp>(o))
        kind = kReduceScatter, e = elemsOf(o->getOperand(0));
      else if (isa<dist::AllToAllOp>(o))
        kind = kAllToAll, e = elemsOf(o->getResult(0));
      if (kind >= 0 && perSample)
        (bwd ? s.backwardComm : s.forwardComm).add(kind, e);
      continue;
    }
    if (isa<ReshapeOp>(o) || isa<ConstantOp>(o))
      continue;
    OpWork w;
    w.flops = opFlops(o);
    for (Value v : o->getOperands()) {
      w.elems += elemsOf(v);
      if (!batch.count(v))
        w.fixedElems += elemsOf(v);
    }
    double out = 0;
    for (Value r : o->getResults())
      out += elemsOf(r);
    w.elems += out;
    w.matmul = isa<MatmulOp, AttentionOp, AttentionGradOp, Conv2dOp, Conv2dGradInputOp,
                   Conv2dGradWeightOp>(o);
    if (w.matmul)
      gemmDims(o, w);
    w.perSample = perSample;
    w.attentionCore = isa<AttentionOp>(o);
    (bwd ? s.backward : s.forward).push_back(w);
    ++s.ops;
    if (!bwd && isa<AttentionOp>(o)) {
      auto q = cast<RankedTensorType>(o->getOperand(0).getType());
      auto k = cast<RankedTensorType>(o->getOperand(1).getType());
      double scores = (double)q.getNumElements() / (double)q.getShape().back() *
                      (double)k.getShape()[k.getRank() - 2];
      s.core += scores;
      s.coreFlops += w.flops;
      // The output and, per query row, its log-sum-exp.
      const double outElems = elemsOf(o->getResult(0));
      s.attentionStats +=
          outElems +
          outElems / (double)cast<RankedTensorType>(o->getResult(0).getType()).getShape().back();
      if (o->hasAttr(kDropoutAttr)) {
        s.coreMasks += scores;
        s.coreDropped += scores;
      }
    } else if (!bwd && o->hasAttr(kDropoutAttr) && perSample) {
      s.hiddenMasks += out;
    }
  }
}

/// Transient working memory per part and pass: walking the ops in order,
/// each batch-dependent result is alive from its op to its last reader
/// (through views), and the part's peak is the most alive at once.
/// Forward values backward reads are kept activations (countActivations),
/// and the returned gradients live in the gradient region: neither counts;
/// nor does an elementwise result only elementwise ops of the same pass read
/// (inside a fused kernel it never reaches memory: carve-fuse-elementwise).
void Profiler::countTransients() {
  Block &body = fn.getBody().front();
  llvm::DenseMap<Operation *, int> pos;
  int n = 0;
  for (Operation &op : body.without_terminator())
    pos[&op] = n++;
  llvm::DenseSet<Value> returned;
  for (Value v : body.getTerminator()->getOperands())
    returned.insert(v);
  // A transpose no matmul folds into its flags or product: the compiler
  // writes its result (a convolution's windows reordered for the deep
  // layers' GEMM), so here it is no view: its input dies where it runs.
  auto copies = [](Operation *op) { return isa<TransposeOp>(op) && foldOf(op).empty(); };
  // An elementwise result only elementwise ops of its pass read is inside
  // a fused kernel (carve-fuse-elementwise): it never reaches memory.
  auto fusedAway = [&](Value r) {
    Operation *o = r.getDefiningOp();
    if (!o || !isFusible(o) || r.use_empty())
      return false;
    for (Operation *u : r.getUsers())
      if (!isFusible(u) || isBackward(u) != isBackward(o))
        return false;
    return true;
  };
  // Last reader (through views, and through the fused kernels that read
  // it: such a kernel runs where its chain ends) and whether backward
  // reads it.
  llvm::DenseMap<Value, std::pair<int, bool>> memo;
  std::function<std::pair<int, bool>(Value)> reach = [&](Value v) -> std::pair<int, bool> {
    if (auto it = memo.find(v); it != memo.end())
      return it->second;
    std::pair<int, bool> r{-1, false};
    for (Operation *u : v.getUsers()) {
      auto p = pos.find(u);
      if (p == pos.end()) {
        r.first = n; // the terminator
        continue;
      }
      r.first = std::max(r.first, p->second);
      r.second |= isBackward(u);
      if (isView(u) && !copies(u))
        for (Value res : u->getResults()) {
          auto [last, bwd] = reach(res);
          r.first = std::max(r.first, last);
          r.second |= bwd;
        }
      else if (u->getNumResults() == 1 && fusedAway(u->getResult(0)))
        r.first = std::max(r.first, reach(u->getResult(0)).first);
    }
    return memo[v] = r;
  };
  // A value a returned gradient is a view of is that gradient's storage
  // (the gradient region), as the returned value itself is.
  llvm::DenseMap<Value, bool> returnedMemo;
  std::function<bool(Value)> isReturned = [&](Value v) -> bool {
    if (auto it = returnedMemo.find(v); it != returnedMemo.end())
      return it->second;
    bool r = returned.contains(v);
    for (Operation *u : v.getUsers())
      if (!r && pos.count(u) && isView(u) && !copies(u))
        for (Value res : u->getResults())
          r |= isReturned(res);
    return returnedMemo[v] = r;
  };
  struct Live {
    int last;
    double elems, elems16; // elems16: a whole convolution's result as half
    bool fixed;
    Value value;
  };
  // Whether an op of part and pass `key` reads v (through views).
  std::function<bool(Value, int)> readIn = [&](Value v, int key) -> bool {
    for (Operation *u : v.getUsers()) {
      if (!pos.count(u))
        continue;
      if (segOf[u] * 2 + (isBackward(u) ? 1 : 0) == key)
        return true;
      if (isView(u) && !copies(u))
        for (Value res : u->getResults())
          if (readIn(res, key))
            return true;
    }
    return false;
  };
  std::vector<Live> live;
  double perSample = 0, fixed = 0, perSample16 = 0, fixed16 = 0;
  auto drop = [&](const Live &l) {
    (l.fixed ? fixed : perSample) -= l.elems;
    (l.fixed ? fixed16 : perSample16) -= l.elems16;
  };
  int group = -1;
  for (Operation &op : body.without_terminator()) {
    Operation *o = &op;
    const bool bwd = isBackward(o);
    const int key = segOf[o] * 2 + (bwd ? 1 : 0);
    if (key != group) {
      // What an earlier part wrote and this one reads is alive here too
      // (the gradient backward passes from a layer to the one before it).
      for (size_t i = 0; i < live.size();)
        if (live[i].last < pos[o] || !readIn(live[i].value, key)) {
          drop(live[i]);
          live[i] = live.back();
          live.pop_back();
        } else {
          ++i;
        }
      group = key;
    }
    // Returned gradients this op writes (gradientHere16: not a whole
    // convolution's weight gradient, which it writes in 16 bits directly).
    double gradientHere = 0, gradientHere16 = 0;
    if ((!isView(o) || copies(o)) && !isa<ConstantOp>(o))
      for (Value r : o->getResults()) {
        if (batch.count(r) && isReturned(r)) {
          gradientHere += elemsOf(r);
          if (!isa<Conv2dGradWeightOp>(o))
            gradientHere16 += elemsOf(r);
        }
        if (!batch.count(r) || isReturned(r))
          continue;
        auto [last, readByBackward] = reach(r);
        if (!bwd && readByBackward)
          continue;
        // A convolution's windows' gradient: computed a block at a time by
        // the gather_grad that reads it (carve.fold = "scatter").
        if (isScatteredProduct(o))
          continue;
        const bool fused = fusedAway(r);
        if (fused)
          continue;
        const bool isFixed = fixedSize.contains(r);
        const double e16 =
            isa<Conv2dOp, Conv2dGradInputOp, Conv2dGradWeightOp>(o) ? elemsOf(r) / 2 : elemsOf(r);
        live.push_back({last, elemsOf(r), e16, isFixed, r});
        (isFixed ? fixed : perSample) += elemsOf(r);
        (isFixed ? fixed16 : perSample16) += e16;
      }
    Segment &seg = *segs[segOf[o]];
    Segment::notePeak(seg.transientPeaks, perSample, fixed);
    Segment::notePeak(seg.transientPeaksGrads, perSample, fixed + gradientHere);
    Segment::notePeak(seg.transientPeaks16, perSample16, fixed16);
    Segment::notePeak(seg.transientPeaksGrads16, perSample16, fixed16 + gradientHere16);
    const int here = pos[o];
    for (size_t i = 0; i < live.size();)
      if (live[i].last <= here) {
        drop(live[i]);
        live[i] = live.back();
        live.pop_back();
      } else {
        ++i;
      }
  }
}

/// Whether a bf16/fp16 plan keeps `root` for backward as a 16-bit copy:
/// not where a reader of it (or of a forward view of it) is the return, a
/// send, or a transpose a matmul folds into its operand
/// (carve-pack-activations refuses those and keeps the fp32 value).
bool Profiler::packedIn16(Value root) const {
  llvm::SetVector<Value> alias;
  alias.insert(root);
  for (size_t k = 0; k < alias.size(); ++k)
    for (Operation *u : alias[k].getUsers()) {
      if (isa<func::ReturnOp, dist::SendOp>(u) || foldOf(u) == kFoldOperand)
        return false;
      // The profile's views (a transpose among them, which the compiler may
      // run as a copy that is then the kept value).
      if (isView(u) && !isBackward(u))
        alias.insert(u->getResult(0));
    }
  return true;
}

/// Activations kept for backward: forward values with a backward user,
/// counted once per storage, in the first part whose backward reads them.
void Profiler::countActivations() {
  Block &body = fn.getBody().front();
  llvm::DenseMap<Value, int> rootSeg;       // root -> segment charged
  llvm::DenseMap<Value, bool> rootRegather; // kept sharded, gathered again in backward
  // Kept for the matmuls that gather from it (a convolution's image, in
  // fp32 whatever the precision), or read by backward otherwise.
  llvm::DenseSet<Value> rootWide, rootDirect;
  std::vector<Value> roots;
  for (Operation &op : body.without_terminator()) {
    if (isBackward(&op))
      continue;
    for (Value v : op.getResults()) {
      int first = -1;
      for (Operation *u : v.getUsers())
        if (isBackward(u) && segOf.count(u)) {
          int sg = segOf[u];
          first = first < 0 ? sg : std::min(first, sg);
        }
      if (first < 0)
        continue;
      Value root = v;
      bool throughGather = false;
      while (Operation *d = root.getDefiningOp()) {
        if (isView(d) && d->getNumOperands() >= 1) {
          throughGather |= isa<GatherOp>(d);
          root = d->getOperand(0);
          continue;
        }
        break;
      }
      bool regather = false;
      if (Operation *d = root.getDefiningOp())
        if (isa<dist::AllGatherOp>(d)) {
          root = d->getOperand(0);
          regather = true;
        }
      (throughGather ? rootWide : rootDirect).insert(root);
      auto it = rootSeg.find(root);
      if (it == rootSeg.end()) {
        rootSeg[root] = first;
        rootRegather[root] = regather;
        roots.push_back(root);
      } else {
        it->second = std::min(it->second, first);
        rootRegather[root] = rootRegather[root] || regather;
      }
    }
  }
  for (Value r : roots) {
    Segment &s = *segs[rootSeg[r]];
    if (!batch.count(r))
      continue; // weights seen through a transpose: parameters, not activations
    // The 16-bit copy backward reads (a bf16/fp16 plan's) and, for gathering
    // GEMMs, the value itself in fp32: both may be kept. A value a matmul
    // reads through a transpose it folds (carve.fold = "operand"), or that
    // the step returns or sends, has no 16-bit copy: it is kept in fp32
    // (carve-pack-activations).
    if (rootDirect.contains(r))
      (packedIn16(r) ? s.saved : s.savedWide) += elemsOf(r);
    if (rootWide.contains(r))
      s.savedWide += elemsOf(r);
    if (rootRegather[r]) {
      // Gathered again before its backward use (tp all-gather of the shard).
      Operation *d = nullptr;
      for (Operation *u : r.getUsers())
        if (isa<dist::AllGatherOp>(u))
          d = u;
      if (d)
        s.backwardComm.add(kAllGather, elemsOf(d->getResult(0)));
    }
  }
}

/// Inputs from earlier parts and what crosses to later parts.
void Profiler::countBoundaries() {
  Block &body = fn.getBody().front();
  llvm::DenseSet<Value> countedIn, countedOut;
  for (Operation &op : body.without_terminator()) {
    if (isBackward(&op))
      continue;
    int sg = segOf[&op];
    for (Value v : op.getOperands()) {
      if (!batch.count(v))
        continue;
      Operation *d = v.getDefiningOp();
      int from = d ? segOf.lookup(d) : -1;
      if (d && isBackward(d))
        continue;
      if (from == sg)
        continue;
      if (d && countedIn.insert(v).second)
        segs[sg]->input += elemsOf(v);
      if (from >= 0 && countedOut.insert(v).second)
        segs[from]->boundary += elemsOf(v);
    }
  }
}

/// Parameters: local elements, in every part that uses them; and the most
/// any one op of a part reads.
void Profiler::countParameters() {
  Block &body = fn.getBody().front();
  llvm::DenseMap<Operation *, double> read;
  for (BlockArgument a : body.getArguments()) {
    unsigned i = a.getArgNumber();
    if (!fn.getArgAttr(i, kParamAttr))
      continue;
    bool trainable = fn.getArgAttr(i, kTrainableAttr) != nullptr;
    std::set<int> users;
    for (Operation *u : a.getUsers())
      if (!isBackward(u) && segOf.count(u))
        users.insert(segOf[u]);
    double e = elemsOf(a);
    if (trainable)
      for (Operation *u : a.getUsers())
        if (segOf.count(u))
          read[u] += e;
    for (int sg : users)
      (trainable ? segs[sg]->params : segs[sg]->frozen) += e;
    if (users.size() > 1)
      (trainable ? p.sharedParams : p.sharedFrozen) += e * (double)(users.size() - 1);
  }
  for (auto &[u, e] : read) {
    Segment &s = *segs[segOf[u]];
    s.paramRead = std::max(s.paramRead, e);
  }
}

void Profiler::countExperts(func::FuncOp forward) {
  std::vector<ExpertLayerInfo> layers;
  std::string error;
  if (!forward || !findExpertLayers(forward, layers, error) || layers.empty())
    return;
  int64_t g = 0;
  for (const ExpertLayerInfo &l : layers)
    g = std::gcd(g, l.experts);
  p.experts = (int)g;
  std::map<std::string, unsigned> argOf;
  for (BlockArgument a : fn.getArguments())
    if (auto n = fn.getArgAttrOfType<StringAttr>(a.getArgNumber(), kParamAttr))
      argOf[n.getValue().str()] = a.getArgNumber();
  for (const ExpertLayerInfo &l : layers) {
    int seg = -1;
    for (const std::string &name : l.params) {
      auto it = argOf.find(name);
      if (it == argOf.end())
        continue;
      BlockArgument a = fn.getArgument(it->second);
      int at = -1;
      for (Operation *u : a.getUsers())
        if (!isBackward(u) && segOf.count(u)) {
          at = segOf[u];
          break;
        }
      if (at < 0)
        continue;
      seg = at;
      segs[at]->expertParams += elemsOf(a);
    }
    // @forward is at one sample: per sample already.
    if (seg >= 0)
      segs[seg]->expertExchange += (double)l.experts * (double)(l.inElems + l.outElems);
  }
}

/// What carve-split-stages balances stages by, per part: the FLOPs of
/// every op (forward and backward) of each node its forward ops on the batch
/// carry, counted in the part of the node's first such op (unitCosts).
void Profiler::countSplitCosts() {
  Block &body = fn.getBody().front();
  // Per node: FLOPs that grow with the batch (an op reading or writing a
  // per-sample value) and those that do not (a weight's transpose).
  auto perSampleOp = [&](Operation *op) {
    for (Value v : op->getOperands())
      if (batch.count(v) && !fixedSize.count(v))
        return true;
    for (Value v : op->getResults())
      if (batch.count(v) && !fixedSize.count(v))
        return true;
    return false;
  };
  llvm::StringMap<std::pair<double, double>> nodeFlops;
  for (Operation &op : body.without_terminator()) {
    auto &f = nodeFlops[forwardNode(&op)];
    (perSampleOp(&op) ? f.first : f.second) += opFlops(&op);
  }
  std::set<std::string> counted;
  for (Operation &op : body.without_terminator()) {
    if (isBackward(&op) || !segOf.count(&op) ||
        llvm::none_of(op.getResults(), [&](Value r) { return batch.count(r) > 0; }))
      continue;
    Segment &seg = *segs[segOf[&op]];
    std::string n = nodeName(op.getLoc());
    if (n.empty()) {
      (perSampleOp(&op) ? seg.splitFlops : seg.splitFlopsFixed) += opFlops(&op);
    } else if (counted.insert(n).second) {
      seg.splitFlops += nodeFlops[n].first;
      seg.splitFlopsFixed += nodeFlops[n].second;
    }
  }
}

bool Profiler::run(std::string &error) {
  markBatch();
  findLayers();
  assignSegments();
  countWork();
  countActivations();
  countTransients();
  countBoundaries();
  countParameters();
  countSplitCosts();
  collectSites();
  (void)error;
  return true;
}

void Profiler::collectSites() {
  // Forward ops that act on the batch and carry the partitioner's choice;
  // ops on parameters alone take their consumers' layout and are not choices.
  llvm::DenseMap<Operation *, int> siteOf;
  for (Operation &op : fn.getBody().front().without_terminator()) {
    Operation *o = &op;
    auto ann = o->getAttrOfType<StringAttr>(kAnnotationAttr);
    auto choice = o->getAttrOfType<StringAttr>(kChoiceAttr);
    std::string node = nodeName(o->getLoc());
    if (!ann || !choice || node.empty() || isBackward(o))
      continue;
    bool onBatch = false;
    for (Value r : o->getResults())
      onBatch |= batch.count(r) > 0;
    if (!onBatch)
      continue;
    ChoiceSite s;
    s.node = node;
    s.annotation = ann.str();
    StringRef c = choice.getValue();
    c.consume_front("tp: ");
    s.chosen = c.str();
    Annotation a;
    std::string why;
    if (Annotation::parse(s.annotation, a, why))
      s.dims = a.names();
    // Producers: walk operands back through ops that are not choices
    // (views, casts, the collectives the partitioner inserted).
    std::set<int> producers;
    llvm::SmallVector<Value> work(o->getOperands().begin(), o->getOperands().end());
    llvm::DenseSet<Operation *> seen;
    while (!work.empty()) {
      Operation *d = work.pop_back_val().getDefiningOp();
      if (!d || !seen.insert(d).second)
        continue;
      auto it = siteOf.find(d);
      if (it != siteOf.end()) {
        producers.insert(it->second);
        continue;
      }
      if (!d->hasAttr(kAnnotationAttr) || d->getDialect()->getNamespace() == "dist")
        for (Value v : d->getOperands())
          work.push_back(v);
    }
    s.producers.assign(producers.begin(), producers.end());
    siteOf[o] = (int)p.sites.size();
    p.sites.push_back(std::move(s));
  }
}

} // namespace

bool buildProfile(const ProfileModel &model, const ProfileRequest &req, Profile &profile,
                  std::string &error) {
  ModuleOp src = const_cast<ProfileModel &>(model).module.get();
  OwningOpRef<ModuleOp> local(cast<ModuleOp>(src->clone()));
  profile = Profile{};
  profile.tp = req.tp;
  profile.sequenceParallel = req.sequenceParallel;
  profile.modelBatch = model.modelBatch;
  profile.seq = model.seq;
  if (req.tp > 1) {
    PartitionOptions po;
    po.tp = req.tp;
    po.sequenceParallel = req.sequenceParallel;
    po.overrides = req.pins;
    po.annotations = req.annotations;
    po.verify = false; // priced, never emitted (PartitionOptions::verify)
    PartitionReport report;
    if (!partitionTrainStep(*local, po, report, error))
      return false;
  } else if (!req.pins.empty()) {
    // Pins choose splits over tp; with tp = 1 they are checked for matches only.
  }
  // What carve compile keeps out of memory: a convolution's windows (read
  // by the GEMMs that gather them) and their gradient (computed by the
  // gather_grad that sums it). Marks only: the ops stay as they are priced.
  {
    PassManager fold(local->getContext());
    fold.enableVerifier(false); // priced, never emitted (as the partition above)
    CarveFoldTransposesOptions fo;
    fo.scatterProducts = true;
    fo.gatherOperands = true;
    fo.undoTransposes = false;
    fold.addPass(createCarveFoldTransposes(fo));
    if (failed(fold.run(*local))) {
      error = req.model + ": carve-fold-transposes failed on the profile";
      return false;
    }
  }
  auto fn = local->lookupSymbol<func::FuncOp>("train_step");
  if (!fn) {
    error = req.model + ": the training step was not built";
    return false;
  }
  Profiler prof(fn, profile);
  if (!prof.run(error))
    return false;
  prof.countExperts(local->lookupSymbol<func::FuncOp>("forward"));
  // A builtin model was built with at most three layers: its first, a middle
  // one standing for all the others, and its last.
  if (model.builtinLayers > (int)profile.layers.size() && profile.layers.size() == 3) {
    std::vector<Segment> all;
    all.reserve(model.builtinLayers);
    std::string pre = profile.layers[0].name.substr(0, profile.layers[0].name.rfind('.'));
    const int last = model.builtinLayers - 1;
    for (int i = 0; i < model.builtinLayers; ++i) {
      const int from = i == 0 ? 0 : i == last ? 2 : 1;
      Segment s = profile.layers[from];
      s.name = pre + "." + std::to_string(i);
      all.push_back(std::move(s));
      profile.layerOrigin.push_back(i == 0 ? 0 : i == last ? last : 1);
    }
    profile.layers = std::move(all);
  }
  // Whole-model totals (as if tp = 1): parameters and FLOPs.
  auto sum = [&](const Segment &s) {
    double f = 0;
    for (const OpWork &w : s.forward)
      f += w.perSample ? w.flops : 0;
    for (const OpWork &w : s.backward)
      f += w.perSample ? w.flops : 0;
    profile.modelFlops += f * req.tp;
    profile.totalParams += s.params;
  };
  sum(profile.embedding);
  for (const Segment &s : profile.layers)
    sum(s);
  sum(profile.head);
  profile.totalParams -= profile.sharedParams;
  return true;
}

} // namespace carve::planner
