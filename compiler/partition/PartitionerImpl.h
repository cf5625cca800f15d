//===- PartitionerImpl.h - the partitioner's state, shared by its sources -===//
//
// Partitioner.cpp decides a layout for every value (annotations, choices,
// the search over collective sequences); Materialize.cpp rewrites the
// function to local shapes with the collectives the decisions need.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_PARTITION_PARTITIONERIMPL_H
#define CARVE_COMPILER_PARTITION_PARTITIONERIMPL_H

#include "compiler/partition/Partitioner.h"
#include "dialects/carve/Annotation.h"
#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/dist/DistDialect.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/Support/GlobPattern.h"

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace carve::partition {

using namespace mlir;
using dist::SbpKind;

/// Exchange rate between computing and communicating: bytes a collective
/// moves per FLOP an op does, from the CPU target's rough figures (about
/// 10 GB/s between ranks, 50 GFLOP/s per rank). The planner (docs/planner.md)
/// will calibrate it per cluster.
struct CostModel {
  double bytesPerFlop = 0.2;
  /// A local copy (R -> S) costs this fraction of its bytes.
  double copyFactor = 0.05;
};

struct Layout {
  SbpKind kind = SbpKind::Replicated;
  int64_t dim = -1;
  int64_t groups = 1;
  static Layout R() { return {}; }
  static Layout S(int64_t d, int64_t g) { return {SbpKind::Split, d, g}; }
  static Layout P(bool max = false) {
    return {max ? SbpKind::PartialMax : SbpKind::PartialSum, -1, 1};
  }
  bool isSplit() const { return kind == SbpKind::Split; }
  bool isPartial() const { return kind == SbpKind::PartialSum || kind == SbpKind::PartialMax; }
  bool operator==(const Layout &o) const {
    return kind == o.kind && dim == o.dim && groups == o.groups;
  }
  bool operator!=(const Layout &o) const { return !(*this == o); }
  bool operator<(const Layout &o) const {
    return std::tie(kind, dim, groups) < std::tie(o.kind, o.dim, o.groups);
  }
  std::string str() const {
    switch (kind) {
    case SbpKind::Replicated:
      return "R";
    case SbpKind::Split:
      return "S(" + std::to_string(dim) + (groups != 1 ? " x " + std::to_string(groups) : "") + ")";
    case SbpKind::PartialSum:
      return "P(sum)";
    case SbpKind::PartialMax:
      return "P(max)";
    }
    return "?";
  }
  dist::SbpAttr attr(MLIRContext *ctx) const { return dist::SbpAttr::get(ctx, kind, dim, groups); }
};

struct Choice {
  std::string name; // empty: replicate (or pass partial sums, below)
  int64_t groups = 1;
  /// A linear op (add, sub, neg, reshape, transpose) on partial sums gives
  /// partial sums: the all-reduce waits until a consumer needs the value.
  bool partial = false;
  bool replicate() const { return name.empty() && !partial; }
  bool operator==(const Choice &o) const {
    return name == o.name && groups == o.groups && partial == o.partial;
  }
  std::string str() const {
    if (partial)
      return "partial";
    if (replicate())
      return "replicate";
    return groups == 1 ? name : name + " x " + std::to_string(groups);
  }
};

inline RankedTensorType typeOf(Value v) { return cast<RankedTensorType>(v.getType()); }

inline std::vector<int64_t> shapeOf(Value v) {
  auto s = typeOf(v).getShape();
  return std::vector<int64_t>(s.begin(), s.end());
}

inline int64_t numel(ArrayRef<int64_t> s) {
  int64_t n = 1;
  for (int64_t d : s)
    n *= d;
  return n;
}

inline int64_t bytesOf(Value v) {
  auto t = typeOf(v);
  unsigned bits = t.getElementType().getIntOrFloatBitWidth();
  return numel(t.getShape()) * std::max<unsigned>(1, bits / 8);
}

inline std::string opLabel(Operation *op) {
  std::string node = nodeName(op->getLoc());
  std::string name = op->getName().getStringRef().str();
  return node.empty() ? name : name + " (node " + node + ")";
}

/// A pending conversion of an operand to the layout its consumer needs.
struct Need {
  Operation *op;
  unsigned operand;
  Layout target;
};

class Partitioner {
public:
  Partitioner(ModuleOp m, func::FuncOp f, const PartitionOptions &o, PartitionReport &r)
      : module(m), fn(f), opts(o), report(r), t(o.tp), ctx(m.getContext()) {
    // Globs are compiled once; an invalid glob matches no node (and an
    // override with one is reported as matching nothing).
    auto compile = [](const std::string &glob) -> std::optional<llvm::GlobPattern> {
      auto g = llvm::GlobPattern::create(glob);
      if (!g) {
        llvm::consumeError(g.takeError());
        return std::nullopt;
      }
      return std::move(*g);
    };
    for (const OpOverride &x : o.overrides)
      overrideGlobs.push_back(compile(x.glob));
    for (const AnnotationOverride &x : o.annotations)
      annotationGlobs.push_back(compile(x.glob));
  }

  bool run(std::string &error);

private:
  ModuleOp module;
  func::FuncOp fn;
  const PartitionOptions &opts;
  PartitionReport &report;
  int64_t t;
  MLIRContext *ctx;
  CostModel cost;
  std::string err;

  llvm::DenseMap<Value, Layout> layout;
  llvm::DenseSet<Value> freeValues;
  llvm::DenseMap<Operation *, Choice> choices;
  std::map<Operation *, Annotation> annotations;
  std::vector<Need> needs;
  /// Per plan "ops" entry: whether it decides some op, whether it matches some.
  std::vector<bool> overrideUsed, overrideMatched;
  /// Per entry that matched a node another entry decides: that node, for errors.
  std::vector<std::string> overrideLost;
  std::vector<Layout> returnLayouts;
  std::vector<std::optional<llvm::GlobPattern>> overrideGlobs, annotationGlobs;

  static bool globMatches(const std::optional<llvm::GlobPattern> &g, StringRef node) {
    return g && !node.empty() && g->match(node);
  }

  bool fail(Operation *op, const std::string &msg) {
    if (err.empty()) {
      err = opLabel(op) + ": " + msg;
      report.errorLoc = op->getLoc();
    }
    return false;
  }

  const Annotation *annotationOf(Operation *op);
  bool isParamDerived(Value v);
  std::optional<Choice> followOf(const Annotation &a, const TensorFactors &dims, Layout l);
  bool legal(Operation *op, const Annotation &a, const Choice &c, std::string *why = nullptr);
  Layout operandLayout(const Annotation &a, unsigned i, const Choice &c);
  Layout resultLayout(const Annotation &a, unsigned i, const Choice &c);
  double redistributionCost(Value v, Layout from, Layout to);
  std::vector<Layout> path(Value v, Layout from, Layout to, double *total);
  double flops(Operation *op);
  double choiceCost(Operation *op, const Annotation &a, const Choice &c);
  bool resolve(Value v, Layout want, bool dry);
  int64_t preferredGroups(Value v, int64_t dim, int depth);
  /// Whether v's consumers (to `depth` ops on) can keep layout l; when not,
  /// `blocker` (if given) receives the first that cannot.
  bool canCarry(Value v, Layout l, int depth, Operation **blocker = nullptr);
  /// Why the default rule left a parameter projection replicated (a note).
  llvm::DenseMap<Operation *, std::string> replicatedWhy;
  /// Ops a plan's "ops" entry decided.
  llvm::DenseSet<Operation *> overridden;
  bool overrideChoice(Operation *op, const Annotation &a, std::optional<Choice> &c);
  bool defaultRule(Operation *op, const Annotation &a, std::optional<Choice> &c);
  bool decide(Operation *op);
  void noteReplicated(Operation *op, const Choice &c);
  void require(Operation *op, unsigned i, Layout want);
  bool finishReturn();
  bool materialize();
  RankedTensorType localType(RankedTensorType global, Layout l);
  Value convert(OpBuilder &b, Location loc, Value v, Layout from, Layout to);
};

} // namespace carve::partition

#endif // CARVE_COMPILER_PARTITION_PARTITIONERIMPL_H
