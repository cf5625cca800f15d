//===- DataParallel.cpp - carve-data-parallel -----------------------------===//
//
// The rules are in Passes.td; the records' format in dialects/carve/
// Contract.h. The emitter (compiler/codegen) prints the collectives and
// gathers from the readers at the end of this file.
//
//===----------------------------------------------------------------------===//

#include "compiler/dataparallel/DataParallel.h"

#include "compiler/fusion/Fusion.h"
#include "compiler/stages/StageSplit.h"

#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"

#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/DenseSet.h"

#include <algorithm>
#include <map>
#include <set>

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVEDATAPARALLEL
#include "compiler/dataparallel/Passes.h.inc"
} // namespace carve

namespace carve {

std::vector<GradientBucket> formBuckets(ArrayRef<int64_t> bytes, ArrayRef<int64_t> ready,
                                        int64_t cap) {
  std::vector<GradientBucket> buckets;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (buckets.empty() || buckets.back().bytes + bytes[i] > cap) {
      GradientBucket b;
      b.first = b.last = (int64_t)i;
      b.bytes = bytes[i];
      b.ready = ready[i];
      buckets.push_back(b);
    } else {
      buckets.back().last = (int64_t)i;
      buckets.back().bytes += bytes[i];
      buckets.back().ready = ready[i];
    }
  }
  return buckets;
}

void setBucketWaits(std::vector<GradientBucket> &buckets, int64_t end) {
  for (size_t k = 0; k < buckets.size(); ++k)
    buckets[k].waitAt =
        k + 1 < buckets.size() ? std::max(buckets[k + 1].ready, buckets[k].ready) : end;
}

} // namespace carve

namespace {

using namespace carve;

int64_t numelOf(Value v) { return cast<RankedTensorType>(v.getType()).getNumElements(); }
/// The bytes of `v`'s elements: f32 4, a 16-bit gradient (carve-store-grads16) 2.
int64_t bytesOf(Value v) {
  auto t = cast<RankedTensorType>(v.getType());
  return t.getNumElements() * (t.getElementType().getIntOrFloatBitWidth() / 8);
}

/// What the pass decides for one function.
class FunctionPlan {
public:
  FunctionPlan(func::FuncOp fn, int64_t dp, int64_t zero)
      : fn(fn), dp(dp), zero(zero), order(fn), ops(order.ops), index(order.index) {
    stage = fn->hasAttr(kStageAttr);
  }

  /// The slots in the order backward finishes them.
  LogicalResult orderGradients() {
    auto ret = cast<func::ReturnOp>(fn.getBody().front().getTerminator());
    const int64_t end = (int64_t)ops.size();
    unsigned first = 1;
    if (stage)
      first = ret.getNumOperands() > 0 && fn.getResultAttr(0, kLossAttr) ? 1 : 0;
    else if (ret.getNumOperands() < 1)
      return fn.emitError("@train_step returns nothing (the loss comes first)");
    // @train_step: the loss and each gradient computed in place keep their
    // memory (a reshape's is its input's); a gradient whose memory is taken
    // is copied after the last op.
    llvm::DenseSet<Value> pinned;
    if (!stage)
      pinned.insert(aliasRoot(ret.getOperand(0)));
    const std::vector<std::optional<unsigned>> paramArgs = paramArgsOfGrads(fn);
    for (unsigned k = first; k < ret.getNumOperands(); ++k) {
      StringAttr of = gradOf(fn, k);
      Value g = ret.getOperand(k);
      Location loc = g.getDefiningOp() ? g.getDefiningOp()->getLoc() : fn.getLoc();
      if (!of)
        return emitError(loc) << "result " << k << " of @" << fn.getSymName()
                              << " is not a gradient (carve.grad_of)";
      std::optional<unsigned> param = paramArgs[k];
      if (!param || (stage && !g.getDefiningOp()))
        return emitError(loc) << "gradient of unknown parameter '" << of.getValue() << "'";
      Type e = cast<RankedTensorType>(g.getType()).getElementType();
      if (!e.isF32() && !e.isBF16() && !e.isF16())
        return emitError(loc) << "the gradient of parameter '" << of.getValue()
                              << "' is not float32, bfloat16 or float16";
      GradientSlot s;
      s.result = k;
      s.param = *param;
      if (stage) {
        s.copy = true;
        s.ready = index.lookup(g.getDefiningOp());
      } else {
        Value r = aliasRoot(g);
        Operation *def = r.getDefiningOp();
        if (!def || isa<ConstantOp>(def) || !pinned.insert(r).second) {
          s.copy = true;
          s.ready = end;
        } else {
          s.ready = index.lookup(def);
        }
      }
      slots.push_back(s);
    }
    std::stable_sort(slots.begin(), slots.end(), [](const GradientSlot &a, const GradientSlot &b) {
      return a.ready < b.ready;
    });
    return success();
  }

  /// Buckets over the slots (a stage's only when dp > 1).
  void cutBuckets(int64_t cap) {
    if (stage && dp <= 1)
      return;
    std::vector<int64_t> bytes, ready;
    auto ret = fn.getBody().front().getTerminator();
    for (const GradientSlot &s : slots) {
      bytes.push_back(alignArena(bytesOf(ret->getOperand(s.result))));
      ready.push_back(s.ready);
    }
    const char *reduce = dp <= 1 ? "none" : zero >= 2 ? "reduce_scatter" : "all_reduce";
    // Expert parallelism: the experts' gradients are summed over the ranks
    // that hold the same experts, the others over dp; a bucket holds one kind.
    size_t i = 0;
    while (i < slots.size()) {
      const bool expert = (bool)fn.getArgAttr(slots[i].param, kExpertAttr);
      size_t j = i;
      while (j < slots.size() && (bool)fn.getArgAttr(slots[j].param, kExpertAttr) == expert)
        ++j;
      std::vector<GradientBucket> run = formBuckets(ArrayRef<int64_t>(bytes).slice(i, j - i),
                                                    ArrayRef<int64_t>(ready).slice(i, j - i), cap);
      for (GradientBucket &b : run) {
        b.first += (int64_t)i;
        b.last += (int64_t)i;
        b.reduce = reduce;
        b.axis = expert ? "edp" : "dp";
        buckets.push_back(b);
      }
      i = j;
    }
    if (zero >= 2)
      setBucketWaits(buckets, (int64_t)ops.size());
  }

  /// ZeRO-3: each sharded parameter's first and last read in forward and in
  /// backward, where the reads run.
  std::map<unsigned, std::array<int64_t, 4>> gatherRanges() {
    std::map<unsigned, std::array<int64_t, 4>> ranges;
    std::set<unsigned> sharded;
    for (const GradientSlot &s : slots)
      sharded.insert(s.param);
    const int64_t backwardBegin = order.backwardBegin();
    for (Operation *op : ops) {
      StringRef fold = foldOf(op);
      if (fold == kFoldOperand || isa<ReshapeOp>(op) || isProductMatmul(op) ||
          isScatteredProduct(op))
        continue;
      // A "product" transpose runs as its matmul: the matmul's reads; a
      // "scatter" gather_grad its matmul's and its own indices.
      Operation *reader = fold == kFoldProduct ? op->getOperand(0).getDefiningOp() : op;
      Operation *scattered = scatteredMatmul(op);
      SmallVector<Value> reads;
      for (unsigned k = 0; k < reader->getNumOperands(); ++k)
        reads.push_back(scattered && k == 0 ? Value() : readOperand(reader, k));
      if (scattered)
        for (unsigned k = 0; k < 2; ++k)
          reads.push_back(readOperand(scattered, k));
      for (Value read : reads) {
        if (!read)
          continue;
        // Through a folded transpose (the matmul's flag) and reshapes (aliases).
        auto arg = dyn_cast<BlockArgument>(aliasRoot(read));
        if (!arg || !sharded.count(arg.getArgNumber()))
          continue;
        auto it = ranges.try_emplace(arg.getArgNumber(), std::array<int64_t, 4>{-1, -1, -1, -1});
        std::array<int64_t, 4> &r = it.first->second;
        const int p = index.lookup(op) >= backwardBegin ? 2 : 0;
        const int64_t at = order.readAt(op);
        if (r[p] < 0 || at < r[p])
          r[p] = at;
        r[p + 1] = std::max(r[p + 1], at);
      }
    }
    return ranges;
  }

  /// Writes the records (Contract.h).
  void record(bool gather) {
    Builder b(fn.getContext());
    auto i64 = [&](int64_t x) { return b.getI64IntegerAttr(x); };
    auto ret = fn.getBody().front().getTerminator();
    SmallVector<Attribute> gs;
    for (const GradientSlot &s : slots)
      gs.push_back(b.getDictionaryAttr(
          {b.getNamedAttr("copy", b.getBoolAttr(s.copy)), b.getNamedAttr("param", i64(s.param)),
           b.getNamedAttr("ready", i64(s.ready)), b.getNamedAttr("result", i64(s.result))}));
    fn->setAttr(kGradientsAttr, b.getArrayAttr(gs));
    if (!stage || dp > 1) {
      SmallVector<Attribute> bs;
      for (const GradientBucket &k : buckets) {
        SmallVector<NamedAttribute> f = {
            b.getNamedAttr("bytes", i64(k.bytes)), b.getNamedAttr("first", i64(k.first)),
            b.getNamedAttr("last", i64(k.last)), b.getNamedAttr("ready", i64(k.ready)),
            b.getNamedAttr("reduce", b.getStringAttr(k.reduce))};
        if (k.axis != "dp")
          f.push_back(b.getNamedAttr("axis", b.getStringAttr(k.axis)));
        if (k.waitAt >= 0)
          f.push_back(b.getNamedAttr("wait_at", i64(k.waitAt)));
        bs.push_back(b.getDictionaryAttr(f));
      }
      fn->setAttr(kBucketsAttr, b.getArrayAttr(bs));
    }
    if (zero >= 1) {
      ArgAttrEdits edits(fn);
      for (const GradientSlot &s : slots)
        edits.set(s.param, kZeroChunkAttr, i64(zeroChunk(numelOf(ret->getOperand(s.result)), dp)));
    }
    if (gather) {
      auto ranges = gatherRanges();
      std::map<unsigned, std::array<int64_t, 2>> issue = prefetchIssues(ranges);
      ArgAttrEdits edits(fn);
      for (auto &[arg, r] : ranges) {
        SmallVector<int64_t> rec(r.begin(), r.end());
        if (prefetch > 0)
          rec.append({issue[arg][0], issue[arg][1]});
        edits.set(arg, kZero3GatherAttr, b.getDenseI64ArrayAttr(rec));
      }
    }
  }

  /// The layer an op at program index `at` belongs to ("h.3"; for an op
  /// outside numbered layers, a key of its own).
  std::string layerAt(int64_t at) {
    std::string node = nodeName(ops[at]->getLoc());
    StringRef n(node);
    n.consume_front(kBackwardPrefix);
    std::string l = layerName(n);
    return l.empty() ? "#" + std::to_string(at) : l;
  }

  /// ZeRO-3 prefetch: in each pass, the gathers' layers in the order of
  /// their first reads; a gather of the i-th layer starts where the
  /// (i - prefetch)-th layer's first read runs (the first layer's for the
  /// first `prefetch` ones). Without prefetch each starts at its first read.
  std::map<unsigned, std::array<int64_t, 2>>
  prefetchIssues(const std::map<unsigned, std::array<int64_t, 4>> &ranges) {
    std::map<unsigned, std::array<int64_t, 2>> issue;
    for (auto &[arg, r] : ranges)
      issue[arg] = {r[0], r[2]};
    if (prefetch <= 0)
      return issue;
    for (int pass = 0; pass < 2; ++pass) {
      std::map<std::string, int64_t> start; // layer -> its first read
      for (auto &[arg, r] : ranges)
        if (r[2 * pass] >= 0) {
          std::string l = layerAt(r[2 * pass]);
          auto it = start.find(l);
          if (it == start.end() || r[2 * pass] < it->second)
            start[l] = r[2 * pass];
        }
      std::vector<int64_t> starts;
      for (auto &[l, at] : start)
        starts.push_back(at);
      llvm::sort(starts);
      for (auto &[arg, r] : ranges)
        if (r[2 * pass] >= 0) {
          const int64_t mine = start[layerAt(r[2 * pass])];
          const int64_t i = std::lower_bound(starts.begin(), starts.end(), mine) - starts.begin();
          issue[arg][pass] = starts[std::max<int64_t>(0, i - prefetch)];
        }
    }
    return issue;
  }

  func::FuncOp fn;
  int64_t dp, zero;
  int64_t prefetch = 0; // carve.plan's zero3_prefetch_layers
  bool stage = false;
  ProgramOrder order;
  const std::vector<Operation *> &ops;
  const llvm::DenseMap<Operation *, int64_t> &index;
  std::vector<GradientSlot> slots;
  std::vector<GradientBucket> buckets;

private:
  static int64_t alignArena(int64_t x) { return (x + kArenaAlign - 1) / kArenaAlign * kArenaAlign; }
};

struct DataParallelPass : carve::impl::CarveDataParallelBase<DataParallelPass> {
  using CarveDataParallelBase::CarveDataParallelBase;

  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<PlanAttrs> plan = readPlan(module);
    if (failed(plan))
      return signalPassFailure();
    if (bucketBytes < 1) {
      module.emitError() << "carve-data-parallel: bucket-bytes must be positive, not "
                         << std::to_string((int64_t)bucketBytes);
      return signalPassFailure();
    }
    const int64_t zero = plan->dp > 1 ? plan->zero : 0;
    for (auto fn : module.getOps<func::FuncOp>()) {
      if (!isEmittedFunction(fn))
        continue;
      FunctionPlan p(fn, plan->dp, zero);
      p.prefetch = plan->zero3PrefetchLayers;
      if (failed(p.orderGradients()))
        return signalPassFailure();
      p.cutBuckets(bucketBytes);
      p.record(zero == 3);
      numGradients += p.slots.size();
      numBuckets += p.buckets.size();
      if (zero == 3)
        for (const GradientSlot &s : p.slots)
          numGathered += fn.getArgAttr(s.param, kZero3GatherAttr) ? 1 : 0;
    }
  }
};

} // namespace

namespace carve {

namespace {
/// Field `key` of `d` as an integer; false when absent or not one.
bool intField(DictionaryAttr d, StringRef key, int64_t &x) {
  auto a = d.getAs<IntegerAttr>(key);
  if (!a)
    return false;
  x = a.getInt();
  return true;
}
} // namespace

bool readGradients(func::FuncOp fn, std::vector<GradientSlot> &slots, std::string &error) {
  auto list = fn->getAttrOfType<ArrayAttr>(kGradientsAttr);
  const std::string where = "@" + fn.getSymName().str() + " ";
  if (!list) {
    error = where + "has no " + std::string(kGradientsAttr) + " (run carve-data-parallel first)";
    return false;
  }
  const unsigned results = fn.getNumResults(), args = fn.getNumArguments();
  slots.clear();
  for (Attribute a : list) {
    auto d = dyn_cast<DictionaryAttr>(a);
    int64_t result, param, ready;
    auto copy = d ? d.getAs<BoolAttr>("copy") : BoolAttr();
    if (!d || !copy || !intField(d, "result", result) || !intField(d, "param", param) ||
        !intField(d, "ready", ready) || result < 0 || result >= results || param < 0 ||
        param >= args) {
      error = where + std::string(kGradientsAttr) + ": malformed entry (" +
              std::to_string(slots.size()) + ")";
      return false;
    }
    slots.push_back({(unsigned)result, (unsigned)param, ready, copy.getValue()});
  }
  return true;
}

bool readBuckets(func::FuncOp fn, std::vector<GradientBucket> &buckets, std::string &error) {
  buckets.clear();
  auto list = fn->getAttrOfType<ArrayAttr>(kBucketsAttr);
  if (!list)
    return true; // none formed
  auto grads = fn->getAttrOfType<ArrayAttr>(kGradientsAttr);
  const int64_t n = grads ? (int64_t)grads.size() : 0;
  int64_t next = 0;
  for (Attribute a : list) {
    auto d = dyn_cast<DictionaryAttr>(a);
    GradientBucket b;
    auto reduce = d ? d.getAs<StringAttr>("reduce") : StringAttr();
    if (!d || !reduce || !intField(d, "first", b.first) || !intField(d, "last", b.last) ||
        !intField(d, "bytes", b.bytes) || !intField(d, "ready", b.ready) || b.first != next ||
        b.last < b.first || b.last >= n) {
      error = "@" + fn.getSymName().str() + " " + std::string(kBucketsAttr) +
              ": malformed bucket " + std::to_string(buckets.size()) +
              " (buckets must cover carve.gradients in order)";
      return false;
    }
    intField(d, "wait_at", b.waitAt);
    b.reduce = reduce.getValue().str();
    if (auto axis = d.getAs<StringAttr>("axis"))
      b.axis = axis.getValue().str();
    next = b.last + 1;
    buckets.push_back(b);
  }
  if (next != n) {
    error = "@" + fn.getSymName().str() + " " + std::string(kBucketsAttr) +
            ": the buckets do not cover every gradient";
    return false;
  }
  return true;
}

int64_t zeroChunkOf(func::FuncOp fn, unsigned arg) {
  auto a = fn.getArgAttrOfType<IntegerAttr>(arg, kZeroChunkAttr);
  return a ? a.getInt() : 0;
}

bool zero3GatherOf(func::FuncOp fn, unsigned arg, std::array<int64_t, 4> &range) {
  auto a = fn.getArgAttrOfType<DenseI64ArrayAttr>(arg, kZero3GatherAttr);
  if (!a || (a.size() != 4 && a.size() != 6))
    return false;
  for (int i = 0; i < 4; ++i)
    range[i] = a[i];
  return true;
}

std::array<int64_t, 2> zero3IssueOf(func::FuncOp fn, unsigned arg) {
  auto a = fn.getArgAttrOfType<DenseI64ArrayAttr>(arg, kZero3GatherAttr);
  if (a && a.size() == 6)
    return {a[4], a[5]};
  if (a && a.size() == 4)
    return {a[0], a[2]};
  return {-1, -1};
}

} // namespace carve
