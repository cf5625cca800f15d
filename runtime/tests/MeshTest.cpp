//===- MeshTest.cpp - world rank <-> places on the pp x dp x tp mesh ------===//

#include "carve/rt/mesh.h"

#include <gtest/gtest.h>

#include <set>
#include <utility>

using carve::rt::Mesh;

namespace {

// Tests that every world rank maps to distinct places, pp outermost, and back.
TEST(MeshTest, RoundTrip) {
  for (int pp : {1, 2, 3})
    for (int dp : {1, 2, 4})
      for (int tp : {1, 2, 3}) {
        std::set<std::pair<int, std::pair<int, int>>> seen;
        for (int r = 0; r < pp * dp * tp; ++r) {
          const Mesh m = Mesh::ofRank(r, dp, tp, pp);
          EXPECT_EQ(m.worldRank(), r);
          EXPECT_EQ(m.rankAt(m.ppRank, m.dpRank, m.tpRank), r);
          EXPECT_EQ(m.ppRank, r / (dp * tp));
          EXPECT_EQ(m.dpRank, r / tp % dp);
          EXPECT_EQ(m.tpRank, r % tp);
          EXPECT_TRUE(seen.insert({m.ppRank, {m.dpRank, m.tpRank}}).second);
        }
      }
}

// Tests that two ranks share an axis's group exactly when they differ only on
// that axis.
TEST(MeshTest, AxisGroups) {
  const int pp = 2, dp = 3, tp = 2;
  for (int a = 0; a < pp * dp * tp; ++a)
    for (int b = 0; b < pp * dp * tp; ++b) {
      const Mesh x = Mesh::ofRank(a, dp, tp, pp), y = Mesh::ofRank(b, dp, tp, pp);
      EXPECT_EQ(x.tpGroupIndex() == y.tpGroupIndex(), x.ppRank == y.ppRank && x.dpRank == y.dpRank);
      EXPECT_EQ(x.dpGroupIndex() == y.dpGroupIndex(), x.ppRank == y.ppRank && x.tpRank == y.tpRank);
      EXPECT_EQ(x.ppGroupIndex() == y.ppGroupIndex(), x.dpRank == y.dpRank && x.tpRank == y.tpRank);
    }
}

} // namespace
