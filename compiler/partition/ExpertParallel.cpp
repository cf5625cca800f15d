//===- ExpertParallel.cpp - carve-expert-parallel -------------------------===//
//
// Expert parallelism on a routed mixture of experts (docs/moe.md). The
// importer holds NonZero at its bound (compiler/frontend/Bounded.cpp), so an
// expert of a routed layer is, in @forward:
//
//   rows_e = carve.gather(x, positions_e)      the tokens routed to expert e
//   ... ops that use expert e's parameters and rows_e, row by row ...
//   out_e                                      its result, one row per token
//
// with every expert of a layer gathering from the same `x`. On ep rank r of
// a group of `ep` ranks (consecutive dp ranks, each with its own tokens),
// this pass keeps experts [r * E/ep, (r+1) * E/ep) and rewrites each layer as
//
//   stacked = [rows_0, ..., rows_{E-1}]                 [1, E, N, H]
//   mine    = expert_all_to_all(stacked)  (dispatch)    [ep, E/ep, N, H]
//   each kept expert on its rows from all ep ranks      [ep * N, H]
//   back    = expert_all_to_all(outputs)  (combine)     [1, E, N, H']
//   out_e   = back[0, e]
//
// before autodiff, which differentiates the exchange (its gradient is the
// exchange the other way). The other experts' parameters leave the
// function; the kept ones are marked carve.expert, so that
// carve-data-parallel sums their gradients over the ranks that hold the same
// experts (edp) instead of dp. The padding rows of a routed expert's rows
// travel too and are masked where they come back, as at 1 rank.
//
//===----------------------------------------------------------------------===//

#include "compiler/partition/ExpertParallel.h"
#include "compiler/partition/Passes.h"
#include "dialects/carve/Annotation.h"

#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"

#include "mlir/Analysis/TopologicalSortUtils.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/IRMapping.h"

#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/ADT/MapVector.h"

#include <array>
#include <iterator>
#include <string>

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVEEXPERTPARALLEL
#include "compiler/partition/Passes.h.inc"
} // namespace carve

namespace {

using namespace carve;

RankedTensorType typeOf(Value v) { return cast<RankedTensorType>(v.getType()); }

/// The op's model node name (its location), else its op name.
std::string nodeOf(Operation *op) {
  std::string n = nodeName(op->getLoc());
  return n.empty() ? op->getName().getStringRef().str() : n;
}

/// One expert: the gather of its rows, the ops after it, their result.
struct Expert {
  GatherOp entry;
  std::vector<Operation *> ops; // in program order
  llvm::DenseMap<Value, int64_t> rowDim;
  Value output;
  llvm::SetVector<unsigned> params; // argument numbers
};

/// The analysis: which gathers start experts, their ops, rows, parameters.
struct ExpertFinder {
  explicit ExpertFinder(func::FuncOp fn) : fn(fn) {}

  func::FuncOp fn;
  Operation *errorOp = nullptr;
  std::string errorMsg;
  llvm::DenseSet<Value> routed; // depends on a NonZero
  llvm::DenseSet<Value> fixed;  // depends on parameters and constants only

  LogicalResult failAt(Operation *op, const std::string &msg) {
    errorOp = op;
    errorMsg = "node '" + nodeOf(op) + "': " + msg;
    return failure();
  }

  /// What each value depends on, then the experts by layer (the tensor
  /// whose rows they gather).
  LogicalResult find(llvm::MapVector<Value, std::vector<Expert>> &layers) {
    Block &body = fn.getBody().front();
    for (BlockArgument a : fn.getArguments())
      if (fn.getArgAttr(a.getArgNumber(), kParamAttr))
        fixed.insert(a);
    for (Operation &op : body) {
      bool nz = isa<NonzeroOp>(op), allFixed = true;
      for (Value v : op.getOperands()) {
        nz |= routed.count(v) > 0;
        allFixed &= fixed.count(v) > 0;
      }
      for (Value r : op.getResults()) {
        if (nz)
          routed.insert(r);
        if (allFixed)
          fixed.insert(r);
      }
    }
    for (Operation &op : body) {
      // (The data may depend on an earlier layer's routing: it is whole.)
      auto g = dyn_cast<GatherOp>(op);
      if (!g || !routed.count(g.getIndices()))
        continue;
      Expert e;
      bool isExpert = false;
      if (failed(grow(g, e, isExpert)))
        return failure();
      if (isExpert)
        layers[g.getData()].push_back(std::move(e));
    }
    return success();
  }

  /// Where the row dimension of each result of `op` is, from the rows of
  /// its operands, by the op's partition annotation; false when a result
  /// has no such dimension by itself.
  bool carryRows(Operation *op, Expert &e) {
    auto iface = dyn_cast<PartitionableOpInterface>(op);
    Annotation a;
    std::string error;
    std::vector<std::vector<int64_t>> ins, outs;
    for (Value v : op->getOperands())
      ins.push_back(typeOf(v).getShape().vec());
    for (Value v : op->getResults())
      outs.push_back(typeOf(v).getShape().vec());
    if (!iface || !Annotation::parse(iface.getPartitionAnnotation(), a, error) ||
        !a.bind(ins, outs, error))
      return false;
    for (unsigned i = 0; i < op->getNumOperands(); ++i) {
      auto it = e.rowDim.find(op->getOperand(i));
      if (it == e.rowDim.end())
        continue;
      std::string name;
      for (const Factor &f : a.operands[i][it->second])
        if (f.count != 1)
          name = f.name;
      if (name.empty() || a.markOf(name) != Mark::Plain)
        return false;
      for (unsigned r = 0; r < op->getNumResults(); ++r) {
        int64_t rd, outer;
        if (!Annotation::find(a.results[r], name, rd, outer))
          return false;
        e.rowDim[op->getResult(r)] = rd;
      }
      return true;
    }
    return false;
  }

  /// The expert whose rows `g` gathers: the ops after it that read only its
  /// rows (and what they make), parameters and constants.
  LogicalResult grow(GatherOp g, Expert &e, bool &isExpert) {
    isExpert = false;
    e.entry = g;
    if (typeOf(g.getIndices()).getRank() != 1)
      return success(); // not the routed form's rows
    llvm::DenseSet<Value> inside{g.getResult()};
    e.rowDim[g.getResult()] = g.getAxis();
    Operation *mixing = nullptr;
    // Uses of the rows' values not visited yet: the walk ends where there
    // are none (users follow their operands in the block).
    int64_t open = (int64_t)std::distance(g->use_begin(), g->use_end());
    for (Operation *op = g->getNextNode(); op && open > 0 && !isa<func::ReturnOp>(op);
         op = op->getNextNode()) {
      bool reads = false, other = false;
      for (Value v : op->getOperands()) {
        if (inside.count(v)) {
          reads = true;
          --open;
        } else if (!fixed.count(v)) {
          other = true;
        }
      }
      if (!reads || other)
        continue;
      if (!carryRows(op, e)) {
        // An error only if the rows are an expert's (it has parameters).
        if (!mixing)
          mixing = op;
        continue;
      }
      e.ops.push_back(op);
      for (Value r : op->getResults()) {
        inside.insert(r);
        open += (int64_t)std::distance(r.use_begin(), r.use_end());
      }
      for (Value v : op->getOperands())
        collectParams(v, e);
    }
    if (e.params.empty())
      return success(); // rows without an expert (the routing weights' gather)
    if (mixing)
      return failAt(mixing, "carve splits the experts of a routed mixture of experts over ep "
                            "ranks, and this op of an expert does not keep the expert's rows "
                            "(tokens) apart");
    // The expert's result: its one value read outside it.
    llvm::DenseSet<Operation *> mine(e.ops.begin(), e.ops.end());
    for (Operation *op : e.ops)
      for (Value r : op->getResults())
        for (Operation *user : r.getUsers())
          if (!mine.count(user)) {
            if (e.output && e.output != r)
              return failAt(op, "an expert of a routed mixture of experts has more than one "
                                "result; carve-expert-parallel sends one back per expert");
            e.output = r;
          }
    isExpert = (bool)e.output;
    return success();
  }

  void collectParams(Value v, Expert &e) {
    if (auto arg = dyn_cast<BlockArgument>(v)) {
      if (fn.getArgAttr(arg.getArgNumber(), kParamAttr))
        e.params.insert(arg.getArgNumber());
      return;
    }
    if (Operation *def = v.getDefiningOp())
      if (fixed.count(v))
        for (Value o : def->getOperands())
          collectParams(o, e);
  }

  /// Whether every use of parameter `arg` is inside `e` (directly or through
  /// ops on parameters that only `e` reads).
  bool onlyIn(Value v, const llvm::DenseSet<Operation *> &mine) {
    for (Operation *user : v.getUsers()) {
      if (mine.count(user))
        continue;
      if (user->getNumResults() == 0 || !llvm::all_of(user->getResults(), [&](Value r) {
            return fixed.count(r) && onlyIn(r, mine);
          }))
        return false;
    }
    return true;
  }
};

struct ExpertParallelPass : carve::impl::CarveExpertParallelBase<ExpertParallelPass> {
  using CarveExpertParallelBase::CarveExpertParallelBase;

  func::FuncOp fn;

  LogicalResult failAt(Operation *op, const std::string &msg) {
    return op->emitError() << "plan: \"ep\": node '" << nodeOf(op) << "': " << msg;
  }

  /// `v` reshaped to [1, 1, N, rest] around its row dimension `d` (the
  /// dimensions before it are of size 1).
  Value asSlab(OpBuilder &b, Location loc, Value v, int64_t d) {
    ArrayRef<int64_t> s = typeOf(v).getShape();
    int64_t rest = 1;
    for (int64_t i = d + 1; i < (int64_t)s.size(); ++i)
      rest *= s[i];
    return ReshapeOp::create(
        b, loc, RankedTensorType::get({1, 1, s[d], rest}, typeOf(v).getElementType()), v);
  }

  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<PlanAttrs> plan = readPlan(module);
    if (failed(plan))
      return signalPassFailure();
    const int64_t ep = plan->ep;
    module->setAttr(kEpRankAttr, IntegerAttr::get(IntegerType::get(&getContext(), 64), epRank));
    if (ep <= 1)
      return;
    if (epRank < 0 || epRank >= ep) {
      module.emitError() << "carve-expert-parallel: ep-rank " << (int64_t)epRank
                         << " is outside [0, " << ep << ")";
      return signalPassFailure();
    }
    fn = module.lookupSymbol<func::FuncOp>("forward");
    if (!fn) {
      module.emitError() << "carve-expert-parallel: the module has no @forward";
      return signalPassFailure();
    }
    Block &body = fn.getBody().front();
    ExpertFinder finder(fn);
    llvm::MapVector<Value, std::vector<Expert>> layers;
    if (failed(finder.find(layers))) {
      finder.errorOp->emitError() << "plan: \"ep\": " << finder.errorMsg;
      return signalPassFailure();
    }
    if (layers.empty()) {
      module.emitError() << "plan: \"ep\" is " << ep
                         << ", but the model has no routed mixture-of-experts layer (experts "
                            "that run on the tokens torch.where / NonZero picks for them); "
                            "nothing to split: remove \"ep\" (docs/moe.md)";
      return signalPassFailure();
    }
    OpBuilder b(&getContext());
    llvm::SetVector<unsigned> dropped;
    int64_t kept = 0, total = 0;
    for (auto &[source, experts] : layers) {
      const int64_t E = (int64_t)experts.size(), per = E / ep;
      Operation *first = experts.front().entry;
      if (E % ep != 0) {
        first->emitError() << "plan: \"ep\": the mixture-of-experts layer at node '"
                           << nodeOf(first) << "' has " << E << " experts, which do not divide "
                           << "by ep = " << ep;
        return signalPassFailure();
      }
      // Every expert's parameters are its own.
      for (Expert &e : experts) {
        llvm::DenseSet<Operation *> mine(e.ops.begin(), e.ops.end());
        for (unsigned p : e.params)
          if (!finder.onlyIn(fn.getArgument(p), mine)) {
            failAt(e.entry, "parameter '" +
                                fn.getArgAttrOfType<StringAttr>(p, kParamAttr).getValue().str() +
                                "' of this expert is also used outside it, so it cannot live on "
                                "the expert's rank only");
            return signalPassFailure();
          }
      }
      Expert &e0 = experts.front();
      Type in0 = e0.entry.getType(), out0 = e0.output.getType();
      const int64_t inRow = e0.rowDim.lookup(e0.entry.getResult());
      const int64_t outRow = e0.rowDim.lookup(e0.output);
      for (Expert &e : experts) {
        if (e.entry.getType() != in0 || e.output.getType() != out0 ||
            e.rowDim.lookup(e.output) != outRow) {
          failAt(e.entry, "the experts of one layer must take and give tensors of one shape (" +
                              std::to_string(E) + " experts gather from the same tensor)");
          return signalPassFailure();
        }
        for (Value v : std::array<Value, 2>{e.entry.getResult(), e.output}) {
          ArrayRef<int64_t> s = typeOf(v).getShape();
          const int64_t d = e.rowDim.lookup(v);
          for (int64_t i = 0; i < d; ++i)
            if (s[i] != 1) {
              failAt(e.entry, "an expert's rows must be the outermost dimension of its input "
                              "and result");
              return signalPassFailure();
            }
        }
      }
      Location loc = e0.entry.getLoc();
      b.setInsertionPoint(body.getTerminator());
      // Dispatch.
      SmallVector<Value> slabs;
      for (Expert &e : experts)
        slabs.push_back(asSlab(b, loc, e.entry.getResult(), inRow));
      auto slabType = typeOf(slabs.front());
      const int64_t N = slabType.getDimSize(2), H = slabType.getDimSize(3);
      Type f = slabType.getElementType();
      Value stacked = ConcatOp::create(b, loc, RankedTensorType::get({1, E, N, H}, f), slabs,
                                       b.getI64IntegerAttr(1));
      Value mine = ExpertAllToAllOp::create(b, loc, RankedTensorType::get({ep, per, N, H}, f),
                                            stacked, b.getI64IntegerAttr(0), b.getI64IntegerAttr(1),
                                            b.getI64IntegerAttr(ep));
      SmallVector<Value> results;
      for (int64_t j = 0; j < per; ++j) {
        Expert &e = experts[epRank * per + j];
        Value part = SliceOp::create(b, loc, RankedTensorType::get({ep, 1, N, H}, f), mine,
                                     b.getDenseI64ArrayAttr({0, j, 0, 0}),
                                     b.getDenseI64ArrayAttr({ep, j + 1, N, H}),
                                     b.getDenseI64ArrayAttr({1, 1, 1, 1}));
        SmallVector<int64_t> rowsShape(typeOf(e.entry.getResult()).getShape());
        rowsShape[inRow] *= ep;
        IRMapping map;
        map.map(e.entry.getResult(),
                ReshapeOp::create(b, loc, RankedTensorType::get(rowsShape, f), part));
        for (Operation *op : e.ops) {
          Operation *c = b.clone(*op, map);
          for (unsigned r = 0; r < c->getNumResults(); ++r) {
            SmallVector<int64_t> s(typeOf(op->getResult(r)).getShape());
            s[e.rowDim.lookup(op->getResult(r))] *= ep;
            c->getResult(r).setType(
                RankedTensorType::get(s, typeOf(op->getResult(r)).getElementType()));
          }
          if (auto sl = dyn_cast<SliceOp>(c)) {
            const int64_t d = e.rowDim.lookup(op->getOperand(0));
            SmallVector<int64_t> ends(sl.getEnds());
            if (sl.getStarts()[d] != 0 || sl.getSteps()[d] != 1 ||
                ends[d] != typeOf(op->getOperand(0)).getDimSize(d)) {
              failAt(op, "a slice of an expert's rows cannot be split over ep ranks");
              return signalPassFailure();
            }
            ends[d] *= ep;
            sl.setEndsAttr(b.getDenseI64ArrayAttr(ends));
          }
        }
        Value out = map.lookup(e.output);
        results.push_back(asSlab(b, loc, out, outRow));
      }
      // Each result slab is [1, 1, ep*N, H'] here; as [ep, 1, N, H'].
      const int64_t Ho = typeOf(results.front()).getDimSize(3);
      SmallVector<Value> byRank;
      for (Value r : results)
        byRank.push_back(ReshapeOp::create(b, loc, RankedTensorType::get({ep, 1, N, Ho}, f), r));
      Value gathered = byRank.size() == 1
                           ? byRank.front()
                           : ConcatOp::create(b, loc, RankedTensorType::get({ep, per, N, Ho}, f),
                                              byRank, b.getI64IntegerAttr(1))
                                 .getResult();
      Value back = ExpertAllToAllOp::create(b, loc, RankedTensorType::get({1, E, N, Ho}, f),
                                            gathered, b.getI64IntegerAttr(1),
                                            b.getI64IntegerAttr(0), b.getI64IntegerAttr(ep));
      for (int64_t k = 0; k < E; ++k) {
        Expert &e = experts[k];
        Value piece = SliceOp::create(b, loc, RankedTensorType::get({1, 1, N, Ho}, f), back,
                                      b.getDenseI64ArrayAttr({0, k, 0, 0}),
                                      b.getDenseI64ArrayAttr({1, k + 1, N, Ho}),
                                      b.getDenseI64ArrayAttr({1, 1, 1, 1}));
        Value asBefore = ReshapeOp::create(b, loc, e.output.getType(), piece);
        llvm::DenseSet<Operation *> region(e.ops.begin(), e.ops.end());
        e.output.replaceUsesWithIf(asBefore,
                                   [&](OpOperand &u) { return !region.count(u.getOwner()); });
      }
      // The original experts go; so do the other ranks' parameters.
      for (int64_t k = 0; k < E; ++k) {
        Expert &e = experts[k];
        for (auto it = e.ops.rbegin(); it != e.ops.rend(); ++it)
          (*it)->erase();
        const bool local = k / per == epRank;
        for (unsigned p : e.params) {
          if (local)
            fn.setArgAttr(p, kExpertAttr, b.getUnitAttr());
          else
            dropped.insert(p);
        }
        total += (int64_t)e.params.size();
        kept += local ? (int64_t)e.params.size() : 0;
      }
    }
    // Parameters read only by other ranks' experts (and what computed on
    // them alone) leave the function.
    for (Operation &op : llvm::make_early_inc_range(llvm::reverse(body)))
      if (!isa<func::ReturnOp>(op) && op.use_empty() && isPure(&op))
        op.erase();
    llvm::BitVector erase(fn.getNumArguments());
    for (unsigned p : dropped)
      if (fn.getArgument(p).use_empty())
        erase.set(p);
    if (failed(fn.eraseArguments(erase)))
      return signalPassFailure();
    if (!sortTopologically(&body)) {
      module.emitError() << "carve-expert-parallel: the exchanged layers do not order";
      return signalPassFailure();
    }
    numLayers += layers.size();
    numKept += kept;
    numDropped += total - kept;
  }
};

} // namespace

namespace carve {

bool findExpertLayers(func::FuncOp forward, std::vector<ExpertLayerInfo> &out, std::string &error) {
  out.clear();
  ExpertFinder finder(forward);
  llvm::MapVector<Value, std::vector<Expert>> layers;
  if (failed(finder.find(layers))) {
    error = finder.errorMsg;
    return false;
  }
  for (auto &[source, experts] : layers) {
    ExpertLayerInfo info;
    info.node = nodeOf(experts.front().entry);
    info.experts = (int64_t)experts.size();
    info.inElems = typeOf(experts.front().entry.getResult()).getNumElements();
    info.outElems = typeOf(experts.front().output).getNumElements();
    for (Expert &e : experts)
      for (unsigned p : e.params)
        info.params.push_back(forward.getArgAttrOfType<StringAttr>(p, kParamAttr).getValue().str());
    out.push_back(std::move(info));
  }
  return true;
}

} // namespace carve
