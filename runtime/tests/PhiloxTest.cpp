//===- PhiloxTest.cpp - the counter-based generator -----------------------===//
//
// Philox-4x32-10 against Random123's known-answer vectors (tests/kat_vectors
// of its distribution), and the dropout keep decision: its keep fraction,
// and that an element's decision depends on its index and nothing else. The
// CPU dropout kernel: its masks and scale, and that every rank's piece of a
// tensor draws the full tensor's mask at its elements.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/philox.h"
#include "carve/rt/kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

using namespace carve::rt::philox;

namespace {

std::string hex(const Words4 &r) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%08x %08x %08x %08x", r.w[0], r.w[1], r.w[2], r.w[3]);
  return buf;
}

} // namespace

TEST(Philox, KnownAnswers) {
  EXPECT_EQ(hex(philox4x32_10(Words4{{0, 0, 0, 0}}, 0, 0)), "6627e8d5 e169c58d bc57ac4c 9b00dbd8");
  EXPECT_EQ(hex(philox4x32_10(Words4{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
                              0xffffffffu, 0xffffffffu)),
            "408f276d 41c83b0e a20bc7c6 6d5451fd");
  EXPECT_EQ(hex(philox4x32_10(Words4{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
                              0xa4093822u, 0x299f31d0u)),
            "d16cfe09 94fdcceb 5001e420 24126ea1");
}

TEST(Philox, Uniform01Range) {
  EXPECT_EQ(uniform01(0), 0.0f);
  EXPECT_LT(uniform01(0xffffffffu), 1.0f);
  EXPECT_EQ(uniform01(0xffffffffu), 16777215.0f / 16777216.0f);
}

// Over 1e6 draws the kept fraction is within 4 standard deviations of 1 - p.
TEST(Philox, DropoutKeepFraction) {
  const int64_t n = 1000000;
  for (float p : {0.1f, 0.5f, 0.9f}) {
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i)
      kept += dropoutKeep(1234, 7, 3, static_cast<uint64_t>(i), p) ? 1 : 0;
    const double q = 1.0 - p, sigma = std::sqrt(n * q * (1 - q));
    EXPECT_LT(std::fabs(static_cast<double>(kept) - n * q), 4 * sigma)
        << "p = " << p << ": kept " << kept << " of " << n;
  }
}

// Each of seed, step, node and index changes the decisions; the same four
// give the same decision whatever was drawn before (no hidden state).
TEST(Philox, DropoutKeepIsAFunctionOfItsArguments) {
  const int64_t n = 4096;
  auto pattern = [&](uint64_t seed, uint32_t step, uint32_t node, uint64_t offset) {
    std::string s;
    for (int64_t i = 0; i < n; ++i)
      s += dropoutKeep(seed, step, node, offset + static_cast<uint64_t>(i), 0.5f) ? '1' : '0';
    return s;
  };
  const std::string base = pattern(1, 2, 3, 0);
  EXPECT_EQ(base, pattern(1, 2, 3, 0));
  EXPECT_NE(base, pattern(2, 2, 3, 0));
  EXPECT_NE(base, pattern(1, 3, 3, 0));
  EXPECT_NE(base, pattern(1, 2, 4, 0));
  EXPECT_NE(base, pattern(1, 2, 3, 1));
  // A piece of the tensor drawn on its own (a rank's share) is that piece of
  // the whole tensor's draw.
  EXPECT_EQ(base.substr(1000, 1000), pattern(1, 2, 3, 1000).substr(0, 1000));
  // Indices beyond 2^32 (large tensors) use the counter's high word.
  EXPECT_NE(pattern(1, 2, 3, uint64_t(1) << 34), pattern(1, 2, 3, 0));
}

//===--- The dropout kernel and the pieces of a tensor --------------------===//

namespace {

using carve::rt::Dims;

/// Deterministic values in [-1, 1).
std::vector<float> values(int64_t n) {
  std::vector<float> v(n);
  uint64_t z = 88172645463325252ull;
  for (auto &x : v) {
    z ^= z << 13, z ^= z >> 7, z ^= z << 17;
    x = static_cast<float>(z >> 40) * (1.0f / 8388608.0f) - 1.0f;
  }
  return v;
}

} // namespace

// The kernel keeps element i exactly when dropoutKeep does, and scales it by
// PyTorch's float 1 / (1 - p).
TEST(Dropout, KernelIsKeepTimesScale) {
  DropoutPiece whole;
  whole.dims = Dims{3, 5, 7};
  const int64_t n = whole.dims.numel();
  std::vector<float> x = values(n), y(n);
  carve::rt::dropout<float>(x.data(), whole, 0.3, 99, 4, 2, y.data());
  const float scale = 1.0f / static_cast<float>(1.0 - 0.3);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = dropoutKeep(99, 4, 2, static_cast<uint64_t>(i), 0.3f);
    kept += keep;
    EXPECT_EQ(y[i], keep ? x[i] * scale : 0.0f) << "element " << i;
  }
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, n);
  // p = 0 (and the eval forward) is the identity.
  carve::rt::dropout<float>(x.data(), whole, 0.0, 99, 4, 2, y.data());
  EXPECT_EQ(x, y);
}

// Over 1e6 elements of ones the kept fraction is within 4 standard deviations
// of 1 - p, and every kept element is exactly the scale.
TEST(Dropout, KernelKeepFraction) {
  DropoutPiece whole;
  whole.dims = Dims{1000, 1000};
  std::vector<float> x(1000000, 1.0f), y(x.size());
  for (double p : {0.1, 0.5}) {
    carve::rt::dropout<float>(x.data(), whole, p, 5, 11, 0, y.data());
    const float scale = 1.0f / static_cast<float>(1.0 - p);
    int64_t kept = 0, other = 0;
    for (float v : y)
      kept += v == scale, other += v != scale && v != 0.0f;
    const double n = 1e6, q = 1 - p, sigma = std::sqrt(n * q * (1 - q));
    EXPECT_LT(std::fabs(static_cast<double>(kept) - n * q), 4 * sigma) << "p = " << p;
    EXPECT_EQ(other, 0);
  }
}

// Every rank's piece, under data parallelism with micro-batches and a tensor-
// parallel split (with groups, and on the batch's own dimension), draws the
// full tensor's mask at its elements. The pieces' places are worked out here
// from their coordinates, independently of DropoutPiece's arithmetic.
TEST(Dropout, PiecesDrawTheFullTensorsMask) {
  struct Case {
    const char *what;
    std::vector<int64_t> full;
    int batchDim;
    int64_t outer; // factors before the batch in its dimension
    int tpDim;
    int64_t groups;
  };
  const int64_t B = 8, dp = 2, m = 2, tp = 2, micro = B / (dp * m);
  const std::vector<Case> cases = {
      {"[B, T, C], tp along C", {B, 6, 12}, 0, 1, 2, 1},
      {"[T, B*H, D] (seq-first attention), tp along T", {6, B * 3, 4}, 1, 1, 0, 1},
      {"[T*B, C] (batch inside), tp along C in 2 groups", {3 * B, 8}, 0, 3, 1, 2},
      {"[B*T, C], tp along the batch's dimension (sequence parallel)", {B * 4, 6}, 0, 1, 0, 1},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.what);
    const int r = static_cast<int>(c.full.size());
    DropoutPiece whole;
    whole.dims = Dims(c.full.data(), r);
    const int64_t n = whole.dims.numel();
    std::vector<float> x = values(n), y(n);
    carve::rt::dropout<float>(x.data(), whole, 0.5, 7, 3, 1, y.data());
    for (int dpRank = 0; dpRank < dp; ++dpRank)
      for (int mb = 0; mb < m; ++mb)
        for (int tpRank = 0; tpRank < tp; ++tpRank) {
          const int64_t offset = (dpRank * m + mb) * micro;
          // The full coordinates each local coordinate stands for, per dimension.
          std::vector<std::vector<int64_t>> at(r);
          for (int d = 0; d < r; ++d) {
            std::vector<int64_t> idx;
            for (int64_t i = 0; i < c.full[d]; ++i)
              idx.push_back(i);
            if (d == c.batchDim) { // this share's samples
              const int64_t inner = c.full[d] / (c.outer * B);
              std::vector<int64_t> keep;
              for (int64_t i : idx)
                if (i / inner % B >= offset && i / inner % B < offset + micro)
                  keep.push_back(i);
              idx = keep;
            }
            if (d == c.tpDim) { // piece tpRank of each group
              const int64_t len = static_cast<int64_t>(idx.size()), chunk = len / (c.groups * tp);
              std::vector<int64_t> keep;
              for (int64_t k = 0; k < len; ++k)
                if (k / chunk % tp == tpRank)
                  keep.push_back(idx[k]);
              idx = keep;
            }
            at[d] = idx;
          }
          DropoutPiece piece;
          int64_t local[carve::rt::kMaxRank];
          for (int d = 0; d < r; ++d)
            local[d] = static_cast<int64_t>(at[d].size());
          piece.dims = Dims(local, r);
          piece.tpDim = c.tpDim, piece.tpGroups = c.groups, piece.tpParts = tp;
          piece.tpRank = tpRank;
          piece.batchDim = c.batchDim, piece.batchOuter = c.outer, piece.localBatch = micro;
          piece.globalBatch = B, piece.batchOffset = offset;
          const int64_t ln = piece.dims.numel();
          std::vector<float> xl(ln), yl(ln);
          std::vector<int64_t> where(ln);
          for (int64_t i = 0; i < ln; ++i) {
            int64_t rest = i, g = 0, stride = 1;
            for (int d = r - 1; d >= 0; --d) {
              g += at[d][rest % local[d]] * stride;
              rest /= local[d];
              stride *= c.full[d];
            }
            where[i] = g;
            xl[i] = x[g];
          }
          carve::rt::dropout<float>(xl.data(), piece, 0.5, 7, 3, 1, yl.data());
          int64_t wrong = 0;
          for (int64_t i = 0; i < ln; ++i)
            wrong += yl[i] != y[where[i]];
          EXPECT_EQ(wrong, 0) << "dp rank " << dpRank << ", micro-batch " << mb << ", tp rank "
                              << tpRank;
        }
  }
}
