//===- OptimTest.cpp - optimizer updates against PyTorch's formulas -------===//
//
// SGD cases use exactly representable numbers (powers of two), so every step
// is exact in float and is checked for equality against values worked out by
// hand in the comments. AdamW with a constant gradient has a closed form
// (m / bc1 = g and sqrt(v / bc2) = |g| at every step); a varying gradient is
// checked against the recurrence in double.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/optim.h"

#include "carve/rt/elementwise.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

using namespace carve::rt;

namespace {

TEST(Sgd, PlainWithWeightDecay) {
  // p -= lr * (g + wd * p): lr 0.5, wd 0.25, p 2, g 1.
  // step 1: d = 1 + 0.5 = 1.5, p = 2 - 0.75 = 1.25
  // step 2: d = 1 + 0.3125 = 1.3125, p = 1.25 - 0.65625 = 0.59375
  float p = 2, g = 1;
  sgdUpdate(&p, &g, nullptr, 1, 0.5, 0, 0, 0.25, false, true);
  EXPECT_EQ(p, 1.25f);
  sgdUpdate(&p, &g, nullptr, 1, 0.5, 0, 0, 0.25, false, false);
  EXPECT_EQ(p, 0.59375f);
}

TEST(Sgd, MomentumDampeningWeightDecay) {
  // lr 0.5, momentum 0.5, dampening 0.5, wd 0.25, p0 2, g 1 every step.
  // step 1: d = 1 + 0.25*2 = 1.5; buf = d = 1.5 (no dampening on the first
  //         step); p = 2 - 0.5*1.5 = 1.25
  // step 2: d = 1 + 0.25*1.25 = 1.3125; buf = 0.5*1.5 + 0.5*1.3125 = 1.40625;
  //         p = 1.25 - 0.5*1.40625 = 0.546875
  // step 3: d = 1 + 0.25*0.546875 = 1.13671875;
  //         buf = 0.5*1.40625 + 0.5*1.13671875 = 1.271484375;
  //         p = 0.546875 - 0.6357421875 = -0.0888671875
  float p = 2, g = 1, buf = 123;
  const float wantP[] = {1.25f, 0.546875f, -0.0888671875f};
  const float wantBuf[] = {1.5f, 1.40625f, 1.271484375f};
  for (int step = 0; step < 3; ++step) {
    sgdUpdate(&p, &g, &buf, 1, 0.5, 0.5, 0.5, 0.25, false, step == 0);
    EXPECT_EQ(p, wantP[step]) << "step " << step + 1;
    EXPECT_EQ(buf, wantBuf[step]) << "step " << step + 1;
  }
}

TEST(Sgd, Nesterov) {
  // lr 0.5, momentum 0.5, no dampening or decay, p0 2, g 1.
  // step 1: buf = 1;   d = 1 + 0.5*1 = 1.5;    p = 2 - 0.75 = 1.25
  // step 2: buf = 1.5; d = 1 + 0.75 = 1.75;    p = 1.25 - 0.875 = 0.375
  // step 3: buf = 1.75; d = 1 + 0.875 = 1.875; p = 0.375 - 0.9375 = -0.5625
  float p = 2, g = 1, buf = 0;
  const float wantP[] = {1.25f, 0.375f, -0.5625f};
  const float wantBuf[] = {1.0f, 1.5f, 1.75f};
  for (int step = 0; step < 3; ++step) {
    sgdUpdate(&p, &g, &buf, 1, 0.5, 0.5, 0, 0, true, step == 0);
    EXPECT_EQ(p, wantP[step]) << "step " << step + 1;
    EXPECT_EQ(buf, wantBuf[step]) << "step " << step + 1;
  }
}

TEST(Sgd, ManyElementsMatchScalarUpdates) {
  // The parallel path: every element behaves as its own scalar update.
  const int64_t n = 100000;
  std::vector<float> p(n), g(n), buf(n, 0);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = static_cast<float>(i % 17) * 0.25f;
    g[i] = static_cast<float>(i % 5) - 2.0f;
  }
  std::vector<float> p1 = p, buf1 = buf;
  sgdUpdate(p.data(), g.data(), buf.data(), n, 0.1, 0.9, 0.1, 0.01, false, true);
  sgdUpdate(p.data(), g.data(), buf.data(), n, 0.1, 0.9, 0.1, 0.01, false, false);
  for (int64_t i : {int64_t(0), int64_t(1), int64_t(777), n - 1}) {
    float ps = p1[i], bs = buf1[i];
    sgdUpdate(&ps, &g[i], &bs, 1, 0.1, 0.9, 0.1, 0.01, false, true);
    sgdUpdate(&ps, &g[i], &bs, 1, 0.1, 0.9, 0.1, 0.01, false, false);
    EXPECT_EQ(p[i], ps) << i;
    EXPECT_EQ(buf[i], bs) << i;
  }
}

TEST(AdamW, ConstantGradientClosedForm) {
  // With a constant g, m_t = g (1 - b1^t) and v_t = g^2 (1 - b2^t), so
  // m / bc1 = g and sqrt(v) / sqrt(bc2) = |g|: every step is
  //   p <- p (1 - lr wd) - lr g / (|g| + eps).
  // lr 0.1, wd 0.01, g 0.5, eps 1e-8:
  //   p1 = 1 * 0.999 - 0.1 * 0.5 / 0.50000001        = 0.899000002
  //   p2 = 0.899000002 * 0.999 - 0.099999998         = 0.798101004
  //   p3 = 0.798101004 * 0.999 - 0.099999998         = 0.697302905
  float p = 1, g = 0.5f, m = 0, v = 0;
  const double wantP[] = {0.899000002, 0.798101004, 0.697302905};
  for (int step = 1; step <= 3; ++step) {
    adamwUpdate(&p, &g, &m, &v, 1, 0.1, 0.9, 0.999, 1e-8, 0.01, step);
    EXPECT_NEAR(p, wantP[step - 1], 5e-7) << "step " << step;
    EXPECT_NEAR(m, 0.5 * (1 - std::pow(0.9, step)), 1e-7) << "step " << step;
    EXPECT_NEAR(v, 0.25 * (1 - std::pow(0.999, step)), 1e-9) << "step " << step;
  }
}

TEST(AdamW, VaryingGradientMatchesRecurrence) {
  const double lr = 1e-3, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  const float grads[][2] = {{0.3f, -2.0f}, {-0.1f, 1.5f}, {0.7f, 0.0f}, {0.2f, -0.5f}};
  float p[2] = {0.5f, -1.0f}, m[2] = {0, 0}, v[2] = {0, 0};
  double pd[2] = {0.5, -1.0}, md[2] = {0, 0}, vd[2] = {0, 0};
  for (int step = 1; step <= 4; ++step) {
    adamwUpdate(p, grads[step - 1], m, v, 2, lr, b1, b2, eps, wd, step);
    for (int i = 0; i < 2; ++i) {
      const double g = grads[step - 1][i];
      pd[i] *= 1 - lr * wd;
      md[i] = md[i] * b1 + g * (1 - b1);
      vd[i] = vd[i] * b2 + g * g * (1 - b2);
      const double denom = std::sqrt(vd[i]) / std::sqrt(1 - std::pow(b2, step)) + eps;
      pd[i] -= lr / (1 - std::pow(b1, step)) * md[i] / denom;
      EXPECT_NEAR(p[i], pd[i], 1e-6) << "step " << step << " element " << i;
      EXPECT_NEAR(m[i], md[i], 1e-6) << "step " << step << " element " << i;
      EXPECT_NEAR(v[i], vd[i], 1e-6) << "step " << step << " element " << i;
    }
  }
  // The first element moved against its gradients, by about lr per step.
  EXPECT_LT(p[0], 0.5f);
  EXPECT_GT(p[0], 0.5f - 4.5f * static_cast<float>(lr));
}

TEST(AdamW, ZeroGradientOnlyDecays) {
  float p = 2, g = 0, m = 0, v = 0;
  adamwUpdate(&p, &g, &m, &v, 1, 0.5, 0.9, 0.999, 1e-8, 0.5, 1);
  EXPECT_EQ(p, 1.5f); // 2 * (1 - 0.25), then + 0 / eps
  EXPECT_EQ(m, 0.f);
  EXPECT_EQ(v, 0.f);
}

TEST(Clipping, NormAndCoefficient) {
  const float g[] = {3, 4};
  EXPECT_EQ(sumSquares(g, 2), 25.0);
  std::vector<float> big(100000, 0.5f);
  EXPECT_DOUBLE_EQ(sumSquares(big.data(), big.size()), 25000.0);
  // Random values over blocks and lanes with a ragged end: within double's
  // rounding of an exact (long double) sum, and the same bits on 1 thread
  // as on the whole team.
  std::vector<float> r(100003);
  uint32_t x = 12345;
  long double exact = 0;
  for (float &v : r) {
    x = x * 1664525u + 1013904223u;
    v = static_cast<float>(x >> 8) / 16777216.f - 0.5f;
    exact += static_cast<long double>(v) * v;
  }
  const double team = sumSquares(r.data(), r.size());
  EXPECT_NEAR(team, static_cast<double>(exact), 1e-12 * static_cast<double>(exact));
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const double one = sumSquares(r.data(), r.size());
  omp_set_num_threads(threads);
  EXPECT_EQ(std::memcmp(&one, &team, sizeof one), 0) << one << " on 1 thread, " << team;
  EXPECT_NEAR(clipCoefficient(5.0, 1.0), 0.2f, 1e-7);
  EXPECT_EQ(clipCoefficient(0.5, 1.0), 1.0f);
  EXPECT_EQ(clipCoefficient(0.0, 1.0), 1.0f);
  EXPECT_NEAR(clipCoefficient(1.0, 1.0), 1.0f / (1.0f + 1e-6f), 1e-7); // just below 1
  std::vector<float> s = {2, -4, 6};
  scaleInPlace(s.data(), 3, 0.5f);
  EXPECT_EQ(s, (std::vector<float>{1, -2, 3}));
}

TEST(Schedule, WarmupCosineFloor) {
  const double lr = 0.1, minRatio = 0.1;
  // Linear warm-up over 4 steps: lr * (t + 1) / 4.
  EXPECT_DOUBLE_EQ(scheduledLr(0, lr, 4, 10, minRatio), 0.025);
  EXPECT_DOUBLE_EQ(scheduledLr(3, lr, 4, 10, minRatio), 0.1);
  // Cosine from lr at t = 4 to lr * minRatio at t = 14.
  EXPECT_DOUBLE_EQ(scheduledLr(4, lr, 4, 10, minRatio), 0.1);
  EXPECT_NEAR(scheduledLr(9, lr, 4, 10, minRatio), lr * (minRatio + (1 - minRatio) * 0.5), 1e-15);
  EXPECT_NEAR(scheduledLr(6, lr, 4, 10, minRatio),
              lr * (minRatio + (1 - minRatio) * 0.5 * (1 + std::cos(M_PI * 0.2))), 1e-15);
  EXPECT_NEAR(scheduledLr(14, lr, 4, 10, minRatio), 0.01, 1e-15);
  EXPECT_NEAR(scheduledLr(1000, lr, 4, 10, minRatio), 0.01, 1e-15);
  // No decay: constant after warm-up; no warm-up: starts at lr.
  EXPECT_DOUBLE_EQ(scheduledLr(50, lr, 4, 0, minRatio), 0.1);
  EXPECT_DOUBLE_EQ(scheduledLr(0, lr, 0, 0, minRatio), 0.1);
  EXPECT_DOUBLE_EQ(scheduledLr(0, lr, 0, 10, minRatio), 0.1);
}

TEST(Schedule, RunTimeSchedules) {
  Hyperparameters h;
  h.lr = 0.1, h.minLrRatio = 0.1, h.warmupSteps = 4, h.decaySteps = 10, h.endStep = 40;
  // Cosine: the function above.
  h.schedule = Schedule::Cosine;
  for (int64_t t : {0, 3, 4, 6, 9, 14, 100})
    EXPECT_DOUBLE_EQ(scheduledLr(t, h), scheduledLr(t, 0.1, 4, 10, 0.1)) << t;
  // Every schedule warms up the same way.
  for (Schedule s : {Schedule::Linear, Schedule::Constant, Schedule::Wsd}) {
    h.schedule = s;
    EXPECT_DOUBLE_EQ(scheduledLr(0, h), 0.025) << scheduleName(s);
    EXPECT_DOUBLE_EQ(scheduledLr(3, h), 0.1) << scheduleName(s);
  }
  // Linear: a straight line from lr at t = 4 to lr * 0.1 at t = 14.
  h.schedule = Schedule::Linear;
  EXPECT_DOUBLE_EQ(scheduledLr(4, h), 0.1);
  EXPECT_NEAR(scheduledLr(9, h), 0.1 * (0.1 + 0.9 * 0.5), 1e-15);
  EXPECT_NEAR(scheduledLr(13, h), 0.1 * (0.1 + 0.9 * 0.1), 1e-15);
  EXPECT_NEAR(scheduledLr(14, h), 0.01, 1e-15);
  EXPECT_NEAR(scheduledLr(99, h), 0.01, 1e-15);
  // Constant: lr after warm-up.
  h.schedule = Schedule::Constant;
  EXPECT_DOUBLE_EQ(scheduledLr(4, h), 0.1);
  EXPECT_DOUBLE_EQ(scheduledLr(99, h), 0.1);
  // WSD: stable at lr until decaySteps before the end (t = 30), then a
  // straight line to lr * 0.1 at t = 40.
  h.schedule = Schedule::Wsd;
  EXPECT_DOUBLE_EQ(scheduledLr(4, h), 0.1);
  EXPECT_DOUBLE_EQ(scheduledLr(29, h), 0.1);
  EXPECT_DOUBLE_EQ(scheduledLr(30, h), 0.1);
  EXPECT_NEAR(scheduledLr(35, h), 0.1 * (0.1 + 0.9 * 0.5), 1e-15);
  EXPECT_NEAR(scheduledLr(39, h), 0.1 * (0.1 + 0.9 * 0.1), 1e-15);
  EXPECT_NEAR(scheduledLr(40, h), 0.01, 1e-15);
  // A run shorter than warm-up plus decay decays right after warm-up.
  h.endStep = 8;
  EXPECT_DOUBLE_EQ(scheduledLr(4, h), 0.1);
  EXPECT_NEAR(scheduledLr(5, h), 0.1 * (0.1 + 0.9 * 0.9), 1e-15);
  // No decay steps: lr after warm-up, under every schedule.
  h.decaySteps = 0;
  for (Schedule s : {Schedule::Cosine, Schedule::Linear, Schedule::Constant, Schedule::Wsd}) {
    h.schedule = s;
    EXPECT_DOUBLE_EQ(scheduledLr(50, h), 0.1) << scheduleName(s);
  }
  // Names.
  Schedule parsed;
  for (Schedule s : {Schedule::Cosine, Schedule::Linear, Schedule::Constant, Schedule::Wsd}) {
    ASSERT_TRUE(parseSchedule(scheduleName(s), parsed));
    EXPECT_EQ(parsed, s);
  }
  EXPECT_FALSE(parseSchedule("exponential", parsed));
  // No clipping at max_norm 0.
  EXPECT_EQ(clipCoefficient(1e9, 0), 1.0f);
}

/// 16-bit gradients (Grad16): each function reads the 16-bit values exactly
/// as floats, so it must equal the fp32 function on the widened gradient bit
/// for bit; those that write round to nearest even.
TEST(Grad16, SameAsFp32OnTheWidenedGradient) {
  for (bool f16 : {false, true}) {
    auto bits = [&](float x) { return f16 ? ew::f16Bits(x) : ew::bf16Bits(x); };
    auto value = [&](uint16_t h) { return f16 ? ew::f16Float(h) : ew::bf16Float(h); };
    const int64_t n = 1000;
    std::vector<uint16_t> g16(n);
    std::vector<float> g(n), p0(n), m0(n), v0(n);
    for (int64_t i = 0; i < n; ++i) {
      g16[i] = bits(std::sin(0.37f * i) * (i % 7 + 1) * 0.01f);
      g[i] = value(g16[i]);
      p0[i] = std::cos(0.11f * i);
      m0[i] = 0.001f * (i % 13);
      v0[i] = 0.0001f * (i % 5);
    }
    Grad16 gh{g16.data(), f16};
    // AdamW.
    std::vector<float> p = p0, m = m0, v = v0, pw = p0, mw = m0, vw = v0;
    adamwUpdate(p.data(), gh, m.data(), v.data(), n, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3);
    adamwUpdate(pw.data(), g.data(), mw.data(), vw.data(), n, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3);
    EXPECT_EQ(p, pw);
    EXPECT_EQ(m, mw);
    EXPECT_EQ(v, vw);
    // SGD with momentum, offset by 10 elements (Grad16 + k).
    std::vector<float> q = p0, b = m0, qw = p0, bw = m0;
    sgdUpdate(q.data(), gh + 10, b.data(), n - 10, 0.1, 0.9, 0.1, 0.01, true, false);
    sgdUpdate(qw.data(), g.data() + 10, bw.data(), n - 10, 0.1, 0.9, 0.1, 0.01, true, false);
    EXPECT_EQ(q, qw);
    EXPECT_EQ(b, bw);
    // Norm.
    EXPECT_EQ(sumSquares(gh, n), sumSquares(g.data(), n));
    // Widen, and accumulate into fp32.
    std::vector<float> acc(n, -1.0f);
    widen(gh, acc.data(), n);
    EXPECT_EQ(acc, g);
    addInPlace(acc.data(), gh, n);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(acc[i], g[i] + g[i]) << i;
    // 16-bit accumulation and scaling, rounded: 1 + half an ulp of 1 is a tie
    // that rounds to the even 1; 3 * 1.5 = 4.5 is exact; 1 * 1.75 ulp rounds.
    const float halfUlp = f16 ? 1.0f / 2048 : 1.0f / 256;
    std::vector<uint16_t> a{bits(1.0f), bits(1.5f), bits(3.0f)},
        c{bits(halfUlp), bits(0.25f), bits(1.5f)};
    addInPlace(Grad16{a.data(), f16}, Grad16{c.data(), f16}, 3);
    EXPECT_EQ(value(a[0]), 1.0f);
    EXPECT_EQ(value(a[1]), 1.75f);
    EXPECT_EQ(value(a[2]), 4.5f);
    scaleInPlace(Grad16{a.data(), f16}, 3, 1.0f + 3 * halfUlp);
    EXPECT_EQ(value(a[0]), 1.0f + 4 * halfUlp); // 1 + 1.5 ulp: a tie, to the even 1 + 2 ulp
    EXPECT_EQ(a[1], bits(1.75f * (1.0f + 3 * halfUlp)));
    EXPECT_EQ(a[2], bits(4.5f * (1.0f + 3 * halfUlp)));
  }
}

} // namespace
