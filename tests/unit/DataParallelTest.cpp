//===- DataParallelTest.cpp - bucket forming, waits, ZeRO chunks ----------===//
//
// The algorithms of carve-data-parallel (compiler/dataparallel) and the
// readers the emitter uses, which refuse a record that does not describe
// the function (the lit tests check the pass on whole functions).
//
//===----------------------------------------------------------------------===//

#include "compiler/dataparallel/DataParallel.h"
#include "dialects/carve/Contract.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/MLIRContext.h"

#include <gtest/gtest.h>

using namespace carve;
using namespace mlir;

namespace {

struct Cut {
  int64_t first, last, bytes, ready;
};

std::vector<Cut> cuts(const std::vector<GradientBucket> &b) {
  std::vector<Cut> c;
  for (const GradientBucket &x : b)
    c.push_back({x.first, x.last, x.bytes, x.ready});
  return c;
}

bool operator==(const Cut &a, const Cut &b) {
  return a.first == b.first && a.last == b.last && a.bytes == b.bytes && a.ready == b.ready;
}

TEST(DataParallel, BucketsTakeConsecutiveGradientsUpToTheCap) {
  // 3 x 64 B fit a 192 B bucket exactly; the fourth starts the next.
  auto b = formBuckets({64, 64, 64, 64, 128}, {3, 5, 9, 12, 20}, 192);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_TRUE(cuts(b)[0] == (Cut{0, 2, 192, 9}));
  EXPECT_TRUE(cuts(b)[1] == (Cut{3, 4, 192, 20}));
}

TEST(DataParallel, AGradientLargerThanTheCapIsABucketOfItsOwn) {
  auto b = formBuckets({64, 1024, 64}, {1, 2, 3}, 256);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_TRUE(cuts(b)[0] == (Cut{0, 0, 64, 1}));
  EXPECT_TRUE(cuts(b)[1] == (Cut{1, 1, 1024, 2}));
  EXPECT_TRUE(cuts(b)[2] == (Cut{2, 2, 64, 3}));
}

TEST(DataParallel, NoGradientsNoBuckets) { EXPECT_TRUE(formBuckets({}, {}, 4096).empty()); }

TEST(DataParallel, OneBucketInFlight) {
  // Bucket k is waited for when bucket k+1 is ready; the last at the end.
  auto b = formBuckets({64, 64, 64}, {4, 7, 7}, 64);
  setBucketWaits(b, 30);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0].waitAt, 7);
  EXPECT_EQ(b[1].waitAt, 7); // the next is ready with it
  EXPECT_EQ(b[2].waitAt, 30);
}

TEST(DataParallel, ZeroChunksCoverEveryElement) {
  EXPECT_EQ(zeroChunk(12, 4), 3);
  EXPECT_EQ(zeroChunk(18, 4), 5); // 4 x 5 = 20: the last chunk has 3 and 2 of padding
  EXPECT_EQ(zeroChunk(3, 4), 1);  // fewer elements than ranks: one each, one empty
  EXPECT_EQ(zeroChunk(7, 1), 7);
}

struct Records : ::testing::Test {
  Records() {
    context.loadDialect<func::FuncDialect>();
    module = ModuleOp::create(UnknownLoc::get(&context));
    OpBuilder b(&context);
    b.setInsertionPointToEnd(module.getBody());
    auto t = RankedTensorType::get({4}, b.getF32Type());
    fn = func::FuncOp::create(b, UnknownLoc::get(&context), "train_step",
                              b.getFunctionType({t, t}, {t, t, t}));
  }
  ~Records() override { module->erase(); }
  DictionaryAttr grad(int64_t result, int64_t param, int64_t ready, bool copy) {
    Builder b(&context);
    return b.getDictionaryAttr({b.getNamedAttr("copy", b.getBoolAttr(copy)),
                                b.getNamedAttr("param", b.getI64IntegerAttr(param)),
                                b.getNamedAttr("ready", b.getI64IntegerAttr(ready)),
                                b.getNamedAttr("result", b.getI64IntegerAttr(result))});
  }
  DictionaryAttr bucket(int64_t first, int64_t last) {
    Builder b(&context);
    return b.getDictionaryAttr({b.getNamedAttr("bytes", b.getI64IntegerAttr(64)),
                                b.getNamedAttr("first", b.getI64IntegerAttr(first)),
                                b.getNamedAttr("last", b.getI64IntegerAttr(last)),
                                b.getNamedAttr("ready", b.getI64IntegerAttr(3)),
                                b.getNamedAttr("reduce", b.getStringAttr("all_reduce"))});
  }
  MLIRContext context;
  ModuleOp module;
  func::FuncOp fn;
};

TEST_F(Records, GradientsReadBackInOrder) {
  Builder b(&context);
  fn->setAttr(kGradientsAttr, b.getArrayAttr({grad(2, 1, 3, false), grad(1, 0, 9, true)}));
  std::vector<GradientSlot> slots;
  std::string error;
  ASSERT_TRUE(readGradients(fn, slots, error)) << error;
  ASSERT_EQ(slots.size(), 2u);
  EXPECT_EQ(slots[0].result, 2u);
  EXPECT_EQ(slots[0].param, 1u);
  EXPECT_EQ(slots[0].ready, 3);
  EXPECT_FALSE(slots[0].copy);
  EXPECT_TRUE(slots[1].copy);
}

TEST_F(Records, MissingOrMalformedGradientsAreRefused) {
  std::vector<GradientSlot> slots;
  std::string error;
  EXPECT_FALSE(readGradients(fn, slots, error));
  EXPECT_NE(error.find("run carve-data-parallel first"), std::string::npos) << error;
  Builder b(&context);
  fn->setAttr(kGradientsAttr, b.getArrayAttr({grad(7, 0, 3, false)})); // no result 7
  EXPECT_FALSE(readGradients(fn, slots, error));
  EXPECT_NE(error.find("malformed entry"), std::string::npos) << error;
}

TEST_F(Records, BucketsMustCoverTheGradientsInOrder) {
  Builder b(&context);
  fn->setAttr(kGradientsAttr, b.getArrayAttr({grad(1, 0, 3, false), grad(2, 1, 3, false)}));
  std::vector<GradientBucket> buckets;
  std::string error;
  fn->setAttr(kBucketsAttr, b.getArrayAttr({bucket(0, 1)}));
  EXPECT_TRUE(readBuckets(fn, buckets, error)) << error;
  EXPECT_EQ(buckets.size(), 1u);
  fn->setAttr(kBucketsAttr, b.getArrayAttr({bucket(0, 0)})); // gradient 1 in none
  EXPECT_FALSE(readBuckets(fn, buckets, error));
  EXPECT_NE(error.find("do not cover every gradient"), std::string::npos) << error;
  fn->setAttr(kBucketsAttr, b.getArrayAttr({bucket(1, 1), bucket(0, 0)})); // out of order
  EXPECT_FALSE(readBuckets(fn, buckets, error));
  EXPECT_NE(error.find("malformed bucket 0"), std::string::npos) << error;
}

} // namespace
