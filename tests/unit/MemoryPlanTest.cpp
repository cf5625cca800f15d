//===- MemoryPlanTest.cpp - placement of the activations -----------------===//
//
// The algorithm of carve-plan-memory (compiler/memory): offsets, reuse by
// liveness, alignment, the peak and the sum without reuse (the lit test
// checks the pass on whole functions).
//
//===----------------------------------------------------------------------===//

#include "compiler/memory/MemoryPlan.h"

#include <gtest/gtest.h>

using namespace carve;

namespace {

ArenaBlock block(int64_t bytes, int64_t def, int64_t lastUse) {
  ArenaBlock b;
  b.bytes = bytes;
  b.def = def;
  b.lastUse = lastUse;
  return b;
}

TEST(MemoryPlan, ADeadBufferLendsItsMemory) {
  // a (0..1) is dead when c is written at 2: c takes a's bytes; b is still live.
  std::vector<ArenaBlock> v = {block(64, 0, 1), block(64, 1, 3), block(64, 2, 3)};
  int64_t unplanned = 0;
  EXPECT_EQ(placeFirstFit(v, 64, unplanned), 128);
  EXPECT_EQ(unplanned, 192);
  EXPECT_EQ(v[0].offset, 0);
  EXPECT_EQ(v[1].offset, 64);
  EXPECT_EQ(v[2].offset, 0);
}

TEST(MemoryPlan, ABufferReadWhenTheNextIsWrittenIsStillLive) {
  // lastUse == def: the op reads a while writing b, so they may not share.
  std::vector<ArenaBlock> v = {block(64, 0, 1), block(64, 1, 2)};
  int64_t unplanned = 0;
  EXPECT_EQ(placeFirstFit(v, 64, unplanned), 128);
  EXPECT_EQ(v[1].offset, 64);
}

TEST(MemoryPlan, SizesRoundUpToTheAlignment) {
  // 1, 65 and 0 bytes take 64, 128 and 64 (an empty tensor still gets a unit).
  std::vector<ArenaBlock> v = {block(1, 0, 9), block(65, 1, 9), block(0, 2, 9)};
  int64_t unplanned = 0;
  EXPECT_EQ(placeFirstFit(v, 64, unplanned), 256);
  EXPECT_EQ(unplanned, 256);
  EXPECT_EQ(v[1].offset, 64);
  EXPECT_EQ(v[2].offset, 192);
}

TEST(MemoryPlan, FirstFitTakesTheLowestGapThatIsLargeEnough) {
  // At op 4 live: [0,64) and [192,256); the gap [64,192) fits 128 bytes.
  std::vector<ArenaBlock> v = {block(64, 0, 9), block(128, 1, 3), block(64, 2, 9), block(128, 4, 9),
                               block(256, 5, 9)};
  int64_t unplanned = 0;
  EXPECT_EQ(placeFirstFit(v, 64, unplanned), 512);
  EXPECT_EQ(v[1].offset, 64);
  EXPECT_EQ(v[2].offset, 192);
  EXPECT_EQ(v[3].offset, 64);
  EXPECT_EQ(v[4].offset, 256);
}

TEST(MemoryPlan, PlacedInOrderOfDefinitionNotOfTheList) {
  // The list order differs from definition order; ties keep the list order.
  std::vector<ArenaBlock> v = {block(64, 3, 4), block(64, 0, 1), block(64, 3, 4)};
  int64_t unplanned = 0;
  EXPECT_EQ(placeFirstFit(v, 64, unplanned), 128);
  EXPECT_EQ(v[1].offset, 0);
  EXPECT_EQ(v[0].offset, 0);  // block 1 is dead at op 3
  EXPECT_EQ(v[2].offset, 64); // after block 0, live at the same time
}

TEST(MemoryPlan, LargestFirstPacksWhatFirstFitFragments) {
  // a (64 bytes, ops 0..2), b (64, 1..9), c (128, 3..9). First fit: a at 0,
  // b at 64; when c is written a is dead, but its 64-byte hole is too small,
  // so c goes to 128: peak 256. Largest first: c at 0, a (never live with
  // c) at 0 too, b (live with both) at 128: peak 192.
  const std::vector<ArenaBlock> v = {block(64, 0, 2), block(64, 1, 9), block(128, 3, 9)};
  std::vector<ArenaBlock> ff = v, ls = v, best = v, chosen = v;
  int64_t unplanned = 0;
  EXPECT_EQ(placeFirstFit(ff, 64, unplanned), 256);
  EXPECT_EQ(ff[0].offset, 0);
  EXPECT_EQ(ff[1].offset, 64);
  EXPECT_EQ(ff[2].offset, 128);
  EXPECT_EQ(placeBySize(ls, 64, unplanned), 192);
  EXPECT_EQ(unplanned, 256);
  EXPECT_EQ(ls[0].offset, 0);
  EXPECT_EQ(ls[1].offset, 128);
  EXPECT_EQ(ls[2].offset, 0);
  // carve-plan-memory keeps the smaller; "first-fit" forces the other.
  EXPECT_EQ(placeBlocks(best, 64, unplanned), 192);
  EXPECT_EQ(best[1].offset, 128);
  EXPECT_EQ(placeBlocks(chosen, 64, unplanned, "first-fit"), 256);
  EXPECT_EQ(chosen[2].offset, 128);
}

TEST(MemoryPlan, LargestFirstKeepsLiveBlocksApart) {
  // Equal sizes in order of definition; a block live at another's writing
  // never shares its bytes (lastUse == def counts as live, as in first fit).
  std::vector<ArenaBlock> v = {block(64, 0, 1), block(64, 1, 2), block(64, 2, 3)};
  int64_t unplanned = 0;
  EXPECT_EQ(placeBySize(v, 64, unplanned), 128);
  EXPECT_EQ(v[0].offset, 0);
  EXPECT_EQ(v[1].offset, 64);
  EXPECT_EQ(v[2].offset, 0);
}

TEST(MemoryPlan, TiesKeepFirstFit) {
  // Both placements reach 128 here: placeBlocks keeps first fit's offsets.
  std::vector<ArenaBlock> v = {block(64, 0, 1), block(128, 2, 3)};
  int64_t unplanned = 0;
  EXPECT_EQ(placeBlocks(v, 64, unplanned), 128);
  EXPECT_EQ(v[0].offset, 0);
  EXPECT_EQ(v[1].offset, 0);
}

TEST(MemoryPlan, NothingToPlace) {
  std::vector<ArenaBlock> v;
  int64_t unplanned = 7;
  EXPECT_EQ(placeFirstFit(v, 64, unplanned), 0);
  EXPECT_EQ(unplanned, 0);
}

} // namespace
