//===- MemoryPlan.h - the arena's layout, on the IR -----------------------===//
//
// carve-plan-memory (MemoryPlan.cpp; its rules are in Passes.td) lays out
// the persistent tensors and places the activations of each emitted
// function, and records the offsets on the IR;
// the emitter reads them back with the readers below. The placement
// algorithm is exposed for unit tests.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_MEMORY_MEMORYPLAN_H
#define CARVE_COMPILER_MEMORY_MEMORYPLAN_H

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace carve {

/// A buffer to place: `bytes`, written by op `def`, last read by op
/// `lastUse`; placement sets `offset`.
struct ArenaBlock {
  int64_t bytes = 0;
  int64_t def = -1, lastUse = -1;
  int64_t offset = -1;
};

/// First fit in order of definition (stable): each block, its bytes rounded
/// up to `align` (at least one byte), takes the lowest offset that overlaps
/// no placed block still live when it is written (lastUse >= its def).
/// Returns the peak (the region's size); `unplanned` receives the sum of
/// the rounded sizes (the region without reuse).
int64_t placeFirstFit(std::vector<ArenaBlock> &blocks, int64_t align, int64_t &unplanned);

/// Largest first: each block, in order of decreasing rounded size (ties in
/// order of definition), takes the lowest offset that overlaps no placed
/// block whose lifetime overlaps its own. First fit leaves holes where a
/// small buffer lands under a large one's path; placing the large ones
/// first packs them (the greedy-by-size offset assignment of TFLite's
/// memory planner). Same contract as placeFirstFit.
int64_t placeBySize(std::vector<ArenaBlock> &blocks, int64_t align, int64_t &unplanned);

/// What carve-plan-memory uses: with `placement` "best", both placements
/// and the one with the smaller peak (first fit where they tie); else
/// "first-fit" or "largest-first" alone.
int64_t placeBlocks(std::vector<ArenaBlock> &blocks, int64_t align, int64_t &unplanned,
                    const std::string &placement = "best");

/// carve.activation_plan of an emitted function.
struct ActivationPlan {
  int64_t bytes = 0, unplanned = 0;
  /// A stage: [0, slot) is what one micro-batch keeps from its forward to
  /// its backward (and its forward sends), [slot, slot + sends) what its
  /// backward sends, [slot + sends, bytes) scratch that the rank's calls
  /// share; slot = -1 (@train_step): no split.
  int64_t slot = -1, sends = 0;
  std::vector<int64_t> copies; // per carve.gradients entry; -1: none
};

/// carve.persistent_plan of an emitted function.
struct PersistentPlan {
  int64_t begin = 0, paramsEnd = 0, gradsEnd = 0, stateEnd = 0, end = 0;
  std::vector<int64_t> grads;  // per carve.gradients entry
  std::vector<int64_t> states; // two per entry; -1: none
  std::vector<int64_t> masters; // per entry: the fp32 master of a 16-bit copy; -1: none
};

// Readers for the emitter; false with `error` when the record is missing
// or malformed (carve-plan-memory has not run).
bool readActivationPlan(mlir::func::FuncOp fn, ActivationPlan &plan, std::string &error);
bool readPersistentPlan(mlir::func::FuncOp fn, PersistentPlan &plan, std::string &error);
/// The arena offset of argument `arg` (-1: none recorded).
int64_t persistentOffsetOf(mlir::func::FuncOp fn, unsigned arg);
/// The offset of result `result` of `op` (-1: none; -2: no record).
int64_t activationOffsetOf(mlir::Operation *op, unsigned result);
/// The ZeRO-3 gather buffers' offsets of argument `arg` ({-1, -1}: none).
std::array<int64_t, 2> gatherOffsetsOf(mlir::func::FuncOp fn, unsigned arg);

#define GEN_PASS_DECL
#include "compiler/memory/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/memory/Passes.h.inc"

} // namespace carve

#endif // CARVE_COMPILER_MEMORY_MEMORYPLAN_H
