//===- ShapesTest.cpp - the static shape rules ----------------------------===//

#include "dialects/carve/Shapes.h"

#include <gtest/gtest.h>

using namespace carve;
using V = llvm::SmallVector<int64_t>;

TEST(Shapes, BroadcastAlignsTrailingDims) {
  EXPECT_EQ(broadcastShapes({4, 1, 8}, {3, 1}).shape, (V{4, 3, 8}));
  EXPECT_EQ(broadcastShapes({}, {2, 3}).shape, (V{2, 3}));
  ShapeOrError bad = broadcastShapes({2, 3}, {4, 5});
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.error.find("[2, 3] and [4, 5]"), std::string::npos);
}

TEST(Shapes, BroadcastsTo) {
  EXPECT_TRUE(broadcastsTo({1, 8}, {4, 3, 8}));
  EXPECT_FALSE(broadcastsTo({2, 8}, {4, 3, 8}));
  EXPECT_FALSE(broadcastsTo({1, 1, 1, 8}, {3, 8}));
}

TEST(Shapes, MatmulFollowsNumpy) {
  EXPECT_EQ(matmulShape({4, 16, 32}, {32, 96}).shape, (V{4, 16, 96}));
  EXPECT_EQ(matmulShape({2, 1, 5, 6}, {3, 6, 7}).shape, (V{2, 3, 5, 7}));
  EXPECT_EQ(matmulShape({6}, {6, 7}).shape, (V{7}));
  EXPECT_EQ(matmulShape({5, 6}, {6}).shape, (V{5}));
  EXPECT_EQ(matmulShape({6}, {6}).shape, (V{}));
  EXPECT_FALSE(matmulShape({2, 3}, {4, 5}).ok());
  EXPECT_FALSE(matmulShape({2, 3, 4}, {5, 4, 6}).ok());
}

TEST(Shapes, Reduce) {
  EXPECT_EQ(reduceShape({4, 16, 32}, {2}, true).shape, (V{4, 16, 1}));
  EXPECT_EQ(reduceShape({4, 16, 32}, {0, 2}, false).shape, (V{16}));
  EXPECT_FALSE(reduceShape({4, 16}, {2}, true).ok());
  EXPECT_FALSE(reduceShape({4, 16}, {1, 0}, true).ok());
}

TEST(Shapes, TransposeSliceConcatGather) {
  EXPECT_EQ(transposeShape({4, 16, 2, 8}, {0, 2, 1, 3}).shape, (V{4, 2, 16, 8}));
  EXPECT_FALSE(transposeShape({4, 16}, {0, 0}).ok());
  EXPECT_EQ(sliceShape({10, 8}, {1, 0}, {10, 8}, {3, 2}).shape, (V{3, 4}));
  EXPECT_FALSE(sliceShape({10}, {2}, {11}, {1}).ok());
  EXPECT_EQ(concatShape({V{2, 3}, V{2, 5}}, 1).shape, (V{2, 8}));
  EXPECT_FALSE(concatShape({V{2, 3}, V{3, 5}}, 1).ok());
  EXPECT_EQ(gatherShape({64, 32}, {4, 16}, 0).shape, (V{4, 16, 32}));
  EXPECT_EQ(gatherShape({4, 16, 32}, {}, 1).shape, (V{4, 32}));
}

TEST(Shapes, ConvAndPool) {
  // ResNet stem: 7x7 stride 2 pad 3, then 3x3 stride 2 pad 1 pooling.
  EXPECT_EQ(conv2dShape({4, 3, 32, 32}, {8, 3, 7, 7}, {2, 2}, {3, 3, 3, 3}, {1, 1}, 1).shape,
            (V{4, 8, 16, 16}));
  EXPECT_EQ(pool2dShape({4, 8, 16, 16}, {3, 3}, {2, 2}, {1, 1, 1, 1}).shape,
            (V{4, 8, 8, 8}));
  EXPECT_EQ(conv2dShape({1, 8, 5, 5}, {8, 1, 3, 3}, {1, 1}, {1, 1, 1, 1}, {1, 1}, 8).shape,
            (V{1, 8, 5, 5}));
  EXPECT_FALSE(conv2dShape({1, 4, 5, 5}, {8, 3, 3, 3}, {1, 1}, {0, 0, 0, 0}, {1, 1}, 1).ok());
  EXPECT_FALSE(pool2dShape({1, 1, 2, 2}, {3, 3}, {1, 1}, {0, 0, 0, 0}).ok());
}

TEST(Shapes, AttentionAndCrossEntropy) {
  EXPECT_EQ(attentionShape({4, 2, 16, 8}, {4, 2, 12, 8}, {4, 2, 12, 5}).shape,
            (V{4, 2, 16, 5}));
  EXPECT_FALSE(attentionShape({4, 2, 16, 8}, {4, 2, 12, 4}, {4, 2, 12, 5}).ok());
  EXPECT_FALSE(attentionShape({4, 2, 16, 8}, {4, 1, 12, 8}, {4, 1, 12, 5}).ok());
  EXPECT_EQ(crossEntropyShape({64, 10}, {64}, true).shape, (V{}));
  EXPECT_EQ(crossEntropyShape({4, 10, 7}, {4, 7}, false).shape, (V{4, 7}));
  EXPECT_FALSE(crossEntropyShape({64, 10}, {32}, true).ok());
}
