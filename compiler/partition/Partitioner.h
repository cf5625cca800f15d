//===- Partitioner.h - the training step split over a device mesh ---------===//
//
// Reads the plan's mesh (dp x tp), sequence parallelism, ZeRO stage and per-op
// overrides, chooses for every op of `@train_step` which annotated dimension
// (PartitionableOpInterface) is split over the tp axis, inserts the cheapest
// collectives where a producer's layout differs from what a consumer needs,
// and rewrites the function to local (per-rank) shapes with `dist` ops. The
// program is SPMD: every rank runs it on its own pieces. docs/partition.md.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_PARTITION_PARTITIONER_H
#define CARVE_COMPILER_PARTITION_PARTITIONER_H

#include "dialects/carve/Contract.h"
#include "dialects/dist/DistDialect.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"
#include "llvm/Support/GlobPattern.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace carve {

/// A plan's `ops` entry: ops whose model node name matches `glob` split
/// annotated dimension `dim` over tp (`dim` empty: replicate them).
struct OpOverride {
  std::string glob;
  std::string dim;
};

/// Whether the entry keeps its ops whole ("replicate", or no dimension).
bool replicates(const OpOverride &o);

/// How specific an `ops` glob is: its characters that are not wildcards
/// (`*` and `?` count nothing, a `[...]` class one, an escaped character one).
size_t globSpecificity(llvm::StringRef glob);

/// The `ops` entry that decides the op of model node `node`: of the entries
/// whose glob (`globs[k]`, compiled from `entries[k].glob`; empty when it did
/// not compile) matches the node, the most specific. So "/h.*/attn/c_attn/Add"
/// decides c_attn's bias and "/h.*/Add" the residual adds, although the second
/// glob matches both, in whatever order the entries come (a plan's `ops` is a
/// JSON object, which has none). Returns -1 when no entry matches. When two
/// equally specific entries match and split differently, returns -2 and
/// `conflict` names them.
int decidingOverride(const std::vector<OpOverride> &entries,
                     const std::vector<std::optional<llvm::GlobPattern>> &globs,
                     llvm::StringRef node, std::string &conflict);

/// A rules file's replacement of a built-in op's annotation: ops whose model
/// node name matches `glob`, or whose op name equals it ("carve.matmul"), use
/// `annotation` (checked against each op's shapes) instead of their own.
struct AnnotationOverride {
  std::string glob;
  std::string annotation;
  std::string origin; // where it came from, for errors ("rules.json: ops[2]")
};

struct PartitionOptions {
  int dp = 1;
  int tp = 1;
  bool sequenceParallel = false;
  std::vector<OpOverride> overrides;
  std::vector<AnnotationOverride> annotations;
  /// Verify the partitioned module. The planner's profiles turn it off:
  /// they are priced, never emitted, and the plan it chooses is partitioned
  /// again, verified, by the as-compiled check and by carve compile.
  bool verify = true;
};

/// What the partitioner did, for the compile log and tests.
/// A forward matrix product with a parameter that tp left replicated.
struct ReplicatedProjection {
  std::string node;
  std::vector<int64_t> shape; // the weight operand's
  int64_t weightElements = 0;
  std::string why;
};

struct PartitionReport {
  int allReduce = 0, allGather = 0, reduceScatter = 0, allToAll = 0, localSplit = 0;
  /// Bytes of the tensors each kind of collective moves, summed (full sizes).
  int64_t commBytes = 0;
  /// One line per op whose tp choice is not "replicate": "NODE: op annotation -> dim".
  std::vector<std::string> choices;
  /// Parameter projections tp left replicated, in program order, and the
  /// most weight elements of any parameter projection.
  std::vector<ReplicatedProjection> replicated;
  int64_t largestProjection = 0;
  /// On failure: the op at fault, where there is one (its location names the node).
  std::optional<mlir::Location> errorLoc;
};

/// The name `carve compile` and the lit tests give the mesh.
constexpr const char *kMeshName = "mesh";
/// Partitions `@train_step` of `module` in place. On failure returns false with
/// one line in `error` naming the op (its model node) or the plan field.
bool partitionTrainStep(mlir::ModuleOp module, const PartitionOptions &opts,
                        PartitionReport &report, std::string &error);

/// `carve-partition` with a rules file's annotation overrides (the
/// registered pass has none).
std::unique_ptr<mlir::Pass> createPartitionPass(std::vector<AnnotationOverride> annotations);

} // namespace carve

#endif // CARVE_COMPILER_PARTITION_PARTITIONER_H
