//===- DataParallel.h - gradient order, buckets and ZeRO on the IR --------===//
//
// carve-data-parallel (DataParallel.cpp; its rules are in Passes.td) records
// how data parallelism treats each emitted function's gradients; the
// emitter reads the records back with the readers below. The algorithms
// (bucket forming, waits, chunks) are exposed for unit tests.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_DATAPARALLEL_DATAPARALLEL_H
#define CARVE_COMPILER_DATAPARALLEL_DATAPARALLEL_H

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace carve {

/// One entry of carve.gradients: result `result` of the function is the
/// gradient of argument `param`, final after op `ready`; `copy`: copied into
/// its slot after the last op instead of computed there.
struct GradientSlot {
  unsigned result = 0, param = 0;
  int64_t ready = 0;
  bool copy = false;
};

/// One entry of carve.buckets: gradients [first, last] of carve.gradients,
/// `bytes` in all, ready after op `ready`; ZeRO >= 2: waited for after op
/// `waitAt` (-1: at the step's tail); `reduce` is "all_reduce",
/// "reduce_scatter" or "none".
struct GradientBucket {
  int64_t first = 0, last = 0, bytes = 0, ready = 0, waitAt = -1;
  std::string reduce = "none";
  /// The group it is summed over: "dp", or "edp" for experts' gradients
  /// under expert parallelism (the ranks that hold the same experts).
  std::string axis = "dp";
};

/// Cuts items (in order, item i of `bytes[i]`, final after op `ready[i]`,
/// non-decreasing) into buckets of consecutive items up to `cap` bytes each;
/// an item larger than `cap` is a bucket of its own.
std::vector<GradientBucket> formBuckets(llvm::ArrayRef<int64_t> bytes,
                                        llvm::ArrayRef<int64_t> ready, int64_t cap);
/// One bucket in flight (ZeRO >= 2): bucket k is waited for when bucket k+1
/// is ready (never before its own ready), the last after op `end`.
void setBucketWaits(std::vector<GradientBucket> &buckets, int64_t end);
/// The elements of each of `dp` chunks of `numel` (the last padded).
inline int64_t zeroChunk(int64_t numel, int64_t dp) { return (numel + dp - 1) / dp; }

// Readers for the emitter; each returns false with `error` set when the
// record is missing or malformed (carve-data-parallel has not run).
bool readGradients(mlir::func::FuncOp fn, std::vector<GradientSlot> &slots, std::string &error);
bool readBuckets(mlir::func::FuncOp fn, std::vector<GradientBucket> &buckets, std::string &error);
/// The ZeRO chunk of argument `arg` (0: not sharded).
int64_t zeroChunkOf(mlir::func::FuncOp fn, unsigned arg);
/// ZeRO-3's gather ranges of argument `arg` ([forward first, forward last,
/// backward first, backward last], -1: none); false when it has none.
bool zero3GatherOf(mlir::func::FuncOp fn, unsigned arg, std::array<int64_t, 4> &range);
/// Where ZeRO-3's gathers of argument `arg` start: [forward, backward], each
/// at or before its first read (the plan's zero3_prefetch_layers), -1: none.
std::array<int64_t, 2> zero3IssueOf(mlir::func::FuncOp fn, unsigned arg);

#define GEN_PASS_DECL
#include "compiler/dataparallel/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/dataparallel/Passes.h.inc"

} // namespace carve

#endif // CARVE_COMPILER_DATAPARALLEL_DATAPARALLEL_H
