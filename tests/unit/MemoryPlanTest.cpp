//===- MemoryPlanTest.cpp - first-fit placement of the activations --------===//
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

TEST(MemoryPlan, NothingToPlace) {
  std::vector<ArenaBlock> v;
  int64_t unplanned = 7;
  EXPECT_EQ(placeFirstFit(v, 64, unplanned), 0);
  EXPECT_EQ(unplanned, 0);
}

} // namespace
