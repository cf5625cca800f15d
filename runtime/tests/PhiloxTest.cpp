//===- PhiloxTest.cpp - the counter-based generator -----------------------===//
//
// Philox-4x32-10 against Random123's known-answer vectors (tests/kat_vectors
// of its distribution), and the dropout keep decision: its keep fraction,
// and that an element's decision depends on its index and nothing else.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/philox.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

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
