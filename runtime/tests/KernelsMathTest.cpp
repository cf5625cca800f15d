//===- KernelsMathTest.cpp - matmul, reductions, norms, attention, CE ----===//
//
// The CPU kernels of linear algebra, reductions, softmax, normalization,
// attention and cross-entropy against float64 loops and finite differences
// (KernelsTest.cpp says how).
//
//===----------------------------------------------------------------------===//

#include "KernelsTesting.h"

#include "carve/rt/elementwise.h"

#include <cstring>

using namespace carve::rt;
using namespace kernels_test;

namespace {

//===--- Linear algebra ---------------------------------------------------===//

struct MatmulCase {
  Dims a;
  bool ta;
  Dims b;
  bool tb;
  Dims y;
};

const MatmulCase kMatmul[] = {
    {{3, 4}, false, {4, 5}, false, {3, 5}},
    {{4, 3}, true, {4, 5}, false, {3, 5}},
    {{3, 4}, false, {5, 4}, true, {3, 5}},
    {{4, 3}, true, {5, 4}, true, {3, 5}},
    {{2, 3, 4, 5}, false, {5, 6}, false, {2, 3, 4, 6}},    // batch folds into M
    {{2, 3, 4, 5}, false, {6, 5}, true, {2, 3, 4, 6}},     // folded, transB
    {{2, 3, 5, 4}, true, {5, 6}, false, {2, 3, 4, 6}},     // transA: a loop
    {{4, 5}, false, {2, 3, 5, 6}, false, {2, 3, 4, 6}},    // A broadcast
    {{2, 1, 4, 5}, false, {3, 5, 6}, false, {2, 3, 4, 6}}, // both broadcast
    {{2, 3, 4, 5}, false, {2, 3, 6, 5}, true, {2, 3, 4, 6}},
    {{1, 4, 5}, false, {1, 5, 6}, false, {1, 4, 6}},
    {{64, 8, 9}, false, {64, 9, 7}, false, {64, 8, 7}},   // many small: parallel batches
    {{2, 70, 90}, false, {90, 110}, false, {2, 70, 110}}, // threaded by OpenBLAS
    {{3, 0}, false, {0, 4}, false, {3, 4}},               // K = 0
};

Vec matmulRef(const Vec &a, const MatmulCase &c, const Vec &b) {
  const int ar = c.a.rank, br = c.b.rank, yr = c.y.rank;
  const int64_t m = c.y.d[yr - 2], n = c.y.d[yr - 1];
  const int64_t k = c.ta ? c.a.d[ar - 2] : c.a.d[ar - 1];
  const Dims yb(c.y.d, yr - 2), ab(c.a.d, ar - 2), bb(c.b.d, br - 2);
  Vec y(c.y.numel(), 0.0);
  for (int64_t t = 0; t < yb.numel(); ++t) {
    const int64_t ai = source(t, yb, ab), bi = source(t, yb, bb);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t l = 0; l < k; ++l) {
          const double av = c.ta ? a[ai * m * k + l * m + i] : a[ai * m * k + i * k + l];
          const double bv = c.tb ? b[bi * k * n + j * k + l] : b[bi * k * n + l * n + j];
          s += av * bv;
        }
        y[t * m * n + i * n + j] = s;
      }
  }
  return y;
}

template <class T> void checkMatmul() {
  for (const MatmulCase &c : kMatmul) {
    const Vec a = uniform(c.a.numel(), 51), b = uniform(c.b.numel(), 52);
    const std::vector<T> at = to<T>(a), bt = to<T>(b);
    const Vec want = matmulRef(toD(at), c, toD(bt));
    std::vector<T> y(c.y.numel(), T(99));
    matmul<T>(at.data(), c.a, c.ta, bt.data(), c.b, c.tb, y.data(), c.y);
    // Float dot products of up to 90 terms of size ~4.
    const double rtol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
    const double atol = std::is_same_v<T, float> ? 2e-5 : 1e-12;
    const std::string what = str(c.a) + (c.ta ? "T" : "") + " @ " + str(c.b) + (c.tb ? "T" : "");
    expectClose(y, want, rtol, atol, what);
    // accumulate adds to what is there.
    const Vec y0 = uniform(c.y.numel(), 53);
    std::vector<T> acc = to<T>(y0);
    matmul<T>(at.data(), c.a, c.ta, bt.data(), c.b, c.tb, acc.data(), c.y, true);
    Vec wantAcc = want;
    for (size_t i = 0; i < want.size(); ++i)
      wantAcc[i] += static_cast<T>(y0[i]);
    expectClose(acc, wantAcc, rtol, atol, what + " accumulate");
  }
}

TEST(Matmul, Float) { checkMatmul<float>(); }
TEST(Matmul, Double) { checkMatmul<double>(); }

//===--- Reductions -------------------------------------------------------===//

struct ReduceCase {
  Dims x;
  uint32_t mask;
};

const ReduceCase kReduce[] = {
    {{4, 5, 6}, 0b001},       {{4, 5, 6}, 0b010},  {{4, 5, 6}, 0b100},
    {{4, 5, 6}, 0b011},       {{4, 5, 6}, 0b110},  {{4, 5, 6}, 0b101},     // general
    {{4, 5, 6}, 0b111},       {{4, 5, 6}, 0},      {{2, 3, 4, 5}, 0b1010}, // general
    {{2, 3, 4, 5}, 0b0101},   {{3, 1, 4}, 0b010},  {{3, 1, 4}, 0b011},
    {{3000, 40}, 0b01},    // bias gradient: few columns, many rows (partials)
    {{40, 3000}, 0b10},    // row sums
    {{100000}, 0b1},       // full, parallel partials
    {{2, 50000}, 0b10},    // two long rows
    {{8, 2000, 3}, 0b010}, // middle
    {{5, 300, 200}, 0b001},   {{6, 7, 40}, 0b101}, // general, contiguous runs of 40: vectorized
                                                   // spans
    {{4, 8, 10, 10}, 0b1101},                      // batch norm's statistics: general, runs of 100
};

template <class T> void checkReduce() {
  for (const ReduceCase &c : kReduce) {
    const Vec x = uniform(c.x.numel(), 61);
    const std::vector<T> xt = to<T>(x);
    Dims ys = c.x;
    for (int i = 0; i < ys.rank; ++i)
      if ((c.mask >> i) & 1)
        ys.d[i] = 1;
    for (Reduce f : {Reduce::Sum, Reduce::Mean, Reduce::Max}) {
      Vec want(ys.numel(), f == Reduce::Max ? -kInf : 0.0);
      const int64_t count = c.x.numel() / ys.numel();
      for (int64_t i = 0; i < c.x.numel(); ++i) {
        // The output element: x's coordinates with reduced ones zeroed.
        int64_t rem = i, o = 0, mul = 1;
        for (int d = c.x.rank - 1; d >= 0; --d) {
          const int64_t cd = rem % c.x.d[d];
          rem /= c.x.d[d];
          if (!((c.mask >> d) & 1))
            o += cd * mul;
          mul *= ys.d[d];
        }
        const double v = xt[i];
        want[o] = f == Reduce::Max ? std::max(want[o], v) : want[o] + v;
      }
      if (f == Reduce::Mean)
        for (double &w : want)
          w /= count;
      std::vector<T> y(ys.numel());
      reduce<T>(f, xt.data(), c.x, c.mask, y.data());
      // Sums of up to 1e5 terms of size 2: compare with an absolute tolerance
      // scaled by the count (double accumulation, one final rounding).
      const double atol = std::is_same_v<T, float> ? 1e-6 * std::sqrt(double(count)) : 1e-10;
      expectClose(y, want, rtolFor<T>(), atol,
                  "reduce " + std::to_string(static_cast<int>(f)) + " " + str(c.x) + " mask " +
                      std::to_string(c.mask));
    }
  }
}

// ew::divMod: 32-bit division where the dividend fits (elementwise offsets,
// the CUDA kernels' indices), 64-bit above; either way the quotient and
// remainder of plain division, at the edges of the 32-bit range too.
TEST(DivMod, EqualsPlainDivision) {
  const int64_t big = int64_t(1) << 32;
  const int64_t as[] = {
      0, 1, 5, 31, 32, 33, 1000, big - 2, big - 1, big, big + 1, 3 * big + 7, int64_t(1) << 62};
  const int64_t bs[] = {1, 2, 3, 32, 1000, big - 1, big, big + 1, int64_t(1) << 40};
  for (int64_t a : as)
    for (int64_t b : bs) {
      int64_t q = -1, r = -1;
      ew::divMod(a, b, q, r);
      EXPECT_EQ(q, a / b) << a << " / " << b;
      EXPECT_EQ(r, a % b) << a << " % " << b;
    }
}

TEST(Reduce, Float) { checkReduce<float>(); }
TEST(Reduce, Double) { checkReduce<double>(); }

TEST(Reduce, MaxPropagatesNaN) {
  const float x[] = {1.f, NAN, 3.f, 4.f};
  float y[2];
  reduce<float>(Reduce::Max, x, {2, 2}, 0b10, y);
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_EQ(y[1], 4.f);
}

TEST(Reduce, MaxPropagatesNaNThroughSpans) {
  // General (axes 0 and 2 of [2, 2, 40]) with contiguous runs of 40: the
  // vectorized span path.
  std::vector<float> x(160);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<float>(i);
  x[45] = NAN; // channel 1 of sample 0
  float y[2];
  reduce<float>(Reduce::Max, x.data(), {2, 2, 40}, 0b101, y);
  EXPECT_EQ(y[0], 119.f);
  EXPECT_TRUE(std::isnan(y[1]));
}

//===--- Softmax ----------------------------------------------------------===//

Vec softmaxRef(const Vec &x, const Dims &s, int axis, bool log) {
  int64_t o = 1, a = s.d[axis], in = 1;
  for (int i = 0; i < axis; ++i)
    o *= s.d[i];
  for (int i = axis + 1; i < s.rank; ++i)
    in *= s.d[i];
  Vec y(x.size());
  for (int64_t oi = 0; oi < o; ++oi)
    for (int64_t ii = 0; ii < in; ++ii) {
      auto at = [&](int64_t j) { return (oi * a + j) * in + ii; };
      double m = -kInf, sum = 0;
      for (int64_t j = 0; j < a; ++j)
        m = std::max(m, x[at(j)]);
      for (int64_t j = 0; j < a; ++j)
        sum += std::exp(x[at(j)] - m);
      for (int64_t j = 0; j < a; ++j)
        y[at(j)] = log ? x[at(j)] - m - std::log(sum) : std::exp(x[at(j)] - m) / sum;
    }
  return y;
}

template <class T> void checkSoftmax(const Dims &s, int axis) {
  const Vec x = uniform(s.numel(), 71, -8, 8);
  const std::vector<T> xt = to<T>(x);
  for (bool log : {false, true}) {
    std::vector<T> y(s.numel());
    softmax<T>(xt.data(), s, axis, log, y.data());
    expectClose(y, softmaxRef(toD(xt), s, axis < 0 ? axis + s.rank : axis, log), rtolFor<T>(),
                atolFor<T>(), std::string(log ? "log_" : "") + "softmax " + str(s));
  }
}

TEST(Softmax, LastAndInnerAxes) {
  checkSoftmax<float>({4, 7}, 1);
  checkSoftmax<float>({4, 7}, -1);
  checkSoftmax<float>({3, 5, 4}, 1);
  checkSoftmax<float>({3, 5, 4}, 0);
  checkSoftmax<float>({2000, 33}, 1); // parallel rows
  checkSoftmax<double>({3, 5, 4}, 2);
  checkSoftmax<double>({3, 5, 4}, 1);
}

TEST(Softmax, LargeLogitsAreStable) {
  const float x[] = {1000.f, 1001.f, 999.f};
  float y[3];
  softmax<float>(x, {3}, 0, false, y);
  const Vec want = softmaxRef({1000, 1001, 999}, {3}, 0, false);
  expectClose(std::vector<float>(y, y + 3), want, 1e-6, 1e-7, "softmax large");
  softmax<float>(x, {3}, 0, true, y);
  EXPECT_NEAR(y[1], -std::log(1 + std::exp(-1.0) + std::exp(-2.0)), 1e-6);
}

TEST(SoftmaxGrad, MatchesFiniteDifferences) {
  for (bool log : {false, true})
    for (int axis : {1, 2}) {
      const Dims s{2, 4, 3};
      const Vec x = uniform(s.numel(), 72), dy = uniform(s.numel(), 73);
      auto loss = [&](const Vec &xi) {
        Vec y(xi.size());
        softmax<double>(xi.data(), s, axis, log, y.data());
        return dot(y, dy);
      };
      Vec y(x.size()), dx(x.size());
      softmax<double>(x.data(), s, axis, log, y.data());
      softmax_grad<double>(y.data(), dy.data(), s, axis, log, dx.data());
      expectClose(dx, numericGrad(loss, x), kFdTol, kFdTol,
                  std::string(log ? "log_" : "") + "softmax_grad axis " + std::to_string(axis));
    }
}

//===--- Normalization ----------------------------------------------------===//

Vec layerNormRef(const Vec &x, const Dims &s, int axis, const Vec *scale, const Vec *bias,
                 double eps) {
  int64_t rows = 1, n = 1;
  for (int i = 0; i < axis; ++i)
    rows *= s.d[i];
  for (int i = axis; i < s.rank; ++i)
    n *= s.d[i];
  Vec y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < n; ++i)
      mean += x[r * n + i] / n;
    for (int64_t i = 0; i < n; ++i)
      var += (x[r * n + i] - mean) * (x[r * n + i] - mean) / n;
    for (int64_t i = 0; i < n; ++i) {
      double v = (x[r * n + i] - mean) / std::sqrt(var + eps);
      if (scale)
        v *= (*scale)[i];
      if (bias)
        v += (*bias)[i];
      y[r * n + i] = v;
    }
  }
  return y;
}

Vec rmsNormRef(const Vec &x, const Dims &s, int axis, const Vec *scale, double eps) {
  int64_t rows = 1, n = 1;
  for (int i = 0; i < axis; ++i)
    rows *= s.d[i];
  for (int i = axis; i < s.rank; ++i)
    n *= s.d[i];
  Vec y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t i = 0; i < n; ++i)
      ms += x[r * n + i] * x[r * n + i] / n;
    for (int64_t i = 0; i < n; ++i)
      y[r * n + i] = x[r * n + i] / std::sqrt(ms + eps) * (scale ? (*scale)[i] : 1.0);
  }
  return y;
}

TEST(LayerNorm, Forward) {
  struct Case {
    Dims s;
    int axis;
  };
  for (const Case &c :
       {Case{{3, 4, 5}, 2}, Case{{3, 4, 5}, 1}, Case{{3, 4, 5}, -1}, Case{{600, 96}, 1}}) {
    const int axis = c.axis < 0 ? c.axis + c.s.rank : c.axis;
    int64_t n = 1;
    for (int i = axis; i < c.s.rank; ++i)
      n *= c.s.d[i];
    // An offset mean checks that the variance is not E[x^2] - E[x]^2 in float.
    const Vec x = uniform(c.s.numel(), 81, 95, 105), sc = uniform(n, 82), bi = uniform(n, 83);
    for (int variant = 0; variant < 3; ++variant) {
      const Vec *scale = variant < 2 ? &sc : nullptr, *bias = variant < 1 ? &bi : nullptr;
      const Vec want = layerNormRef(x, c.s, axis, scale, bias, 1e-5);
      std::vector<float> y(x.size());
      const std::vector<float> xf = to<float>(x), sf = to<float>(sc), bf = to<float>(bi);
      layer_norm<float>(xf.data(), c.s, c.axis, scale ? sf.data() : nullptr,
                        bias ? bf.data() : nullptr, 1e-5f, y.data());
      // x has float rounding of 100 * 6e-8 = 6e-6 against a spread of ~1.
      expectClose(
          y, layerNormRef(toD(xf), c.s, axis, scale ? &sc : nullptr, bias ? &bi : nullptr, 1e-5),
          1e-4, 1e-4, "layer_norm float " + str(c.s));
      std::vector<double> yd(x.size());
      layer_norm<double>(x.data(), c.s, c.axis, scale ? sc.data() : nullptr,
                         bias ? bi.data() : nullptr, 1e-5, yd.data());
      expectClose(yd, want, 1e-10, 1e-10, "layer_norm double " + str(c.s));
    }
  }
}

TEST(LayerNormGrad, MatchesFiniteDifferences) {
  const Dims s{3, 2, 4};
  for (int axis : {1, 2})
    for (bool withScale : {true, false}) {
      const int64_t n = axis == 1 ? 8 : 4;
      const Vec x = uniform(s.numel(), 84), sc = uniform(n, 85), bi = uniform(n, 86),
                dy = uniform(s.numel(), 87);
      const double *scp = withScale ? sc.data() : nullptr;
      auto run = [&](const Vec &xi, const Vec &si, const Vec &bii) {
        Vec y(xi.size());
        layer_norm<double>(xi.data(), s, axis, withScale ? si.data() : nullptr, bii.data(), 1e-5,
                           y.data());
        return dot(y, dy);
      };
      Vec dx(x.size()), dsc(n), dbi(n);
      layer_norm_grad<double>(x.data(), s, axis, scp, 1e-5, dy.data(), dx.data(), dsc.data(),
                              dbi.data());
      const std::string what = "layer_norm_grad axis " + std::to_string(axis);
      expectClose(dx, numericGrad([&](const Vec &v) { return run(v, sc, bi); }, x), kFdTol, kFdTol,
                  what + " dx");
      if (withScale)
        expectClose(dsc, numericGrad([&](const Vec &v) { return run(x, v, bi); }, sc), kFdTol,
                    kFdTol, what + " dscale");
      expectClose(dbi, numericGrad([&](const Vec &v) { return run(x, sc, v); }, bi), kFdTol, kFdTol,
                  what + " dbias");
      // Null outputs are skipped.
      Vec dx2(x.size());
      layer_norm_grad<double>(x.data(), s, axis, scp, 1e-5, dy.data(), dx2.data(), nullptr,
                              nullptr);
      expectClose(dx2, dx, 0, 0, what + " dx without dscale/dbias");
    }
}

TEST(LayerNormGrad, FloatManyRowsMatchesDouble) {
  // Parallel rows with per-thread partial dscale/dbias.
  const Dims s{700, 64};
  const Vec x = uniform(s.numel(), 88), sc = uniform(64, 89), dy = uniform(s.numel(), 90);
  Vec dx(x.size()), dsc(64), dbi(64);
  layer_norm_grad<double>(x.data(), s, 1, sc.data(), 1e-5, dy.data(), dx.data(), dsc.data(),
                          dbi.data());
  std::vector<float> dxf(x.size()), dscf(64), dbif(64);
  layer_norm_grad<float>(to<float>(x).data(), s, 1, to<float>(sc).data(), 1e-5f,
                         to<float>(dy).data(), dxf.data(), dscf.data(), dbif.data());
  expectClose(dxf, dx, 1e-4, 1e-5, "dx");
  expectClose(dscf, dsc, 1e-4, 1e-4, "dscale");
  expectClose(dbif, dbi, 1e-4, 1e-4, "dbias");
}

TEST(RmsNorm, Forward) {
  for (const Dims &s : {Dims{3, 4, 5}, Dims{500, 128}}) {
    const int64_t n = s.d[s.rank - 1];
    const Vec x = uniform(s.numel(), 91), sc = uniform(n, 92);
    for (bool withScale : {true, false}) {
      const std::vector<float> xf = to<float>(x), sf = to<float>(sc);
      std::vector<float> y(x.size());
      rms_norm<float>(xf.data(), s, -1, withScale ? sf.data() : nullptr, 1e-6f, y.data());
      expectClose(y, rmsNormRef(toD(xf), s, s.rank - 1, withScale ? &sc : nullptr, 1e-6),
                  rtolFor<float>(), atolFor<float>(), "rms_norm " + str(s));
    }
  }
  const Dims s{3, 4, 5};
  const Vec x = uniform(s.numel(), 93), sc = uniform(20, 94);
  Vec y(x.size());
  rms_norm<double>(x.data(), s, 1, sc.data(), 1e-6, y.data());
  expectClose(y, rmsNormRef(x, s, 1, &sc, 1e-6), 1e-12, 1e-12, "rms_norm over two dims");
}

TEST(Rotary, ForwardMatchesDefinition) {
  // x [2, 3, 5, 8]; cos and sin [5, 8] (rows of positions) and [1, 3, 1, 8]
  // (per head), broadcast; y = x * cos + rotate_half(x) * sin.
  const Dims xs{2, 3, 5, 8};
  for (const Dims &ts : {Dims{5, 8}, Dims{1, 3, 1, 8}}) {
    const Vec x = uniform(xs.numel(), 120), c = uniform(ts.numel(), 121),
              sn = uniform(ts.numel(), 122);
    Vec y(x.size());
    rotary<double>(x.data(), xs, c.data(), ts, sn.data(), ts, y.data());
    Vec want(x.size());
    for (int64_t e = 0; e < xs.numel(); ++e) {
      const int64_t j = e % 8, t = (e / 8) % 5, h = (e / 40) % 3;
      const int64_t ti = ts.rank == 2 ? t * 8 + j : h * 8 + j;
      const double rh = j < 4 ? -x[e + 4] : x[e - 4];
      want[e] = x[e] * c[ti] + rh * sn[ti];
    }
    expectClose(y, want, 0, 0, "rotary " + str(ts));
    // The gradient is the adjoint: <rotary(x), g> = <x, rotary_grad(g)>.
    const Vec g = uniform(xs.numel(), 123);
    Vec dx(x.size());
    rotary_grad<double>(g.data(), xs, c.data(), ts, sn.data(), ts, dx.data());
    EXPECT_NEAR(dot(y, g), dot(x, dx), 1e-12 * (1 + std::fabs(dot(y, g))))
        << "rotary_grad is not rotary's adjoint (cos, sin " << str(ts) << ")";
  }
}

TEST(Rotary, FloatIsTheUnfusedChainBitwise) {
  // Each element as Mul / Neg / Concat / Mul / Add compute it in float, and
  // the gradient as the unraised chain's gradient sums it (signed zeros too).
  const Dims xs{4, 6}, ts{6};
  std::vector<float> x = to<float>(uniform(xs.numel(), 124)), c = to<float>(uniform(6, 125)),
                     sn = to<float>(uniform(6, 126)), g = to<float>(uniform(xs.numel(), 127));
  x[1] = -0.0f; // -x[1] is +0 in rotate_half's first half
  g[3] = -0.0f;
  std::vector<float> y(x.size()), dx(x.size());
  rotary<float>(x.data(), xs, c.data(), ts, sn.data(), ts, y.data());
  rotary_grad<float>(g.data(), xs, c.data(), ts, sn.data(), ts, dx.data());
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t j = 0; j < 6; ++j) {
      const int64_t e = r * 6 + j, k = j < 3 ? e + 3 : e - 3;
      const float rh = j < 3 ? -x[k] : x[k];
      const float a = x[e] * c[j], b = rh * sn[j];
      const float want = a + b;
      EXPECT_EQ(std::memcmp(&y[e], &want, 4), 0) << "rotary element " << e;
      const float z = g[k] * sn[k % 6];
      const float t = j < 3 ? 0.0f + z : -z + 0.0f;
      const float gc = g[e] * c[j];
      const float wantG = t + gc;
      EXPECT_EQ(std::memcmp(&dx[e], &wantG, 4), 0) << "rotary_grad element " << e;
    }
}

TEST(Rotary, BadShapesAreFatal) {
  const Dims odd{2, 5}, ts{5};
  const std::vector<float> x(10, 1.0f), c(5, 1.0f);
  std::vector<float> y(10);
  auto message = [](auto f) {
    FatalTrap trap;
    try {
      f();
    } catch (const FatalTrapped &t) {
      return std::string(t.message);
    }
    return std::string("(no error)");
  };
  EXPECT_NE(message([&] {
              rotary<float>(x.data(), odd, c.data(), ts, c.data(), ts, y.data());
            }).find("rotary: the input's last dimension must be even"),
            std::string::npos);
  const Dims xs{2, 4}, bad{3};
  EXPECT_NE(message([&] {
              rotary<float>(x.data(), xs, c.data(), bad, c.data(), bad, y.data());
            }).find("rotary: cos dimension 0 of size 3 does not broadcast to 4"),
            std::string::npos);
}

TEST(RmsNormGrad, MatchesFiniteDifferences) {
  const Dims s{3, 2, 4};
  for (int axis : {1, 2}) {
    const int64_t n = axis == 1 ? 8 : 4;
    const Vec x = uniform(s.numel(), 95), sc = uniform(n, 96), dy = uniform(s.numel(), 97);
    auto run = [&](const Vec &xi, const Vec &si) {
      Vec y(xi.size());
      rms_norm<double>(xi.data(), s, axis, si.data(), 1e-6, y.data());
      return dot(y, dy);
    };
    Vec dx(x.size()), dsc(n);
    rms_norm_grad<double>(x.data(), s, axis, sc.data(), 1e-6, dy.data(), dx.data(), dsc.data());
    expectClose(dx, numericGrad([&](const Vec &v) { return run(v, sc); }, x), kFdTol, kFdTol,
                "rms_norm_grad dx");
    expectClose(dsc, numericGrad([&](const Vec &v) { return run(x, v); }, sc), kFdTol, kFdTol,
                "rms_norm_grad dscale");
  }
  // Without scale, and the float path with many rows.
  const Dims big{300, 48};
  const Vec x = uniform(big.numel(), 98), dy = uniform(big.numel(), 99);
  Vec dx(x.size());
  rms_norm_grad<double>(x.data(), big, 1, nullptr, 1e-6, dy.data(), dx.data(), nullptr);
  std::vector<float> dxf(x.size());
  rms_norm_grad<float>(to<float>(x).data(), big, 1, nullptr, 1e-6f, to<float>(dy).data(),
                       dxf.data(), nullptr);
  expectClose(dxf, dx, 1e-4, 1e-5, "rms_norm_grad float");
}

//===--- Attention --------------------------------------------------------===//

struct AttnCase {
  Dims q, k, v;
  bool causal;
  Dims m; // rank 0 with hasMask false: no mask
  bool hasMask;
  const char *name;
};

const AttnCase kAttn[] = {
    {{2, 3, 5, 4}, {2, 3, 5, 4}, {2, 3, 5, 4}, false, {}, false, "plain"},
    {{2, 3, 5, 4}, {2, 3, 5, 4}, {2, 3, 5, 4}, true, {}, false, "causal"},
    {{2, 4, 3}, {2, 6, 3}, {2, 6, 5}, false, {4, 6}, true, "mask [Tq,Tk], Tq != Tk, Dv != D"},
    {{2, 2, 4, 3}, {2, 2, 4, 3}, {2, 2, 4, 3}, false, {2, 1, 4, 4}, true, "mask [B,1,Tq,Tk]"},
    {{2, 2, 4, 3}, {2, 2, 4, 3}, {2, 2, 4, 3}, true, {2, 1, 1, 4}, true, "causal + padding"},
    {{3, 4, 3}, {3, 5, 3}, {3, 5, 2}, false, {4, 1}, true, "mask [Tq,1]"},
    {{5, 3}, {5, 3}, {5, 3}, true, {}, false, "no batch dims"},
};

Vec attentionRef(const Vec &q, const Vec &k, const Vec &v, const Vec *mask, const AttnCase &c,
                 double scale) {
  const int r = c.q.rank;
  const int64_t tq = c.q.d[r - 2], d = c.q.d[r - 1], tk = c.k.d[r - 2], dv = c.v.d[r - 1];
  const int64_t items = c.q.numel() / (tq * d);
  Dims target = c.q;
  target.d[r - 1] = tk;
  Vec y(items * tq * dv, 0.0);
  for (int64_t b = 0; b < items; ++b)
    for (int64_t i = 0; i < tq; ++i) {
      Vec s(tk);
      double m = -kInf;
      for (int64_t j = 0; j < tk; ++j) {
        double acc = 0;
        for (int64_t l = 0; l < d; ++l)
          acc += q[(b * tq + i) * d + l] * k[(b * tk + j) * d + l];
        s[j] = scale * acc;
        if (mask)
          s[j] += (*mask)[source((b * tq + i) * tk + j, target, c.m)];
        if (c.causal && j > i)
          s[j] = -kInf;
        m = std::max(m, s[j]);
      }
      if (m == -kInf)
        continue;
      double sum = 0;
      for (int64_t j = 0; j < tk; ++j)
        sum += std::exp(s[j] - m);
      for (int64_t j = 0; j < tk; ++j)
        for (int64_t l = 0; l < dv; ++l)
          y[(b * tq + i) * dv + l] += std::exp(s[j] - m) / sum * v[(b * tk + j) * dv + l];
    }
  return y;
}

TEST(Attention, ForwardMatchesReference) {
  for (const AttnCase &c : kAttn) {
    const Vec q = uniform(c.q.numel(), 101), k = uniform(c.k.numel(), 102),
              v = uniform(c.v.numel(), 103);
    Vec m = uniform(c.m.numel(), 104, -3, 1);
    if (c.hasMask)
      m[0] = -kInf; // a hidden key
    const Vec *mp = c.hasMask ? &m : nullptr;
    const double scale = 1 / std::sqrt(static_cast<double>(c.q.d[c.q.rank - 1]));
    Dims ys = c.q;
    ys.d[ys.rank - 1] = c.v.d[c.v.rank - 1];
    const Vec want = attentionRef(q, k, v, mp, c, scale);
    Vec y(ys.numel());
    attention<double>(q.data(), c.q, k.data(), c.k, v.data(), c.v, mp ? m.data() : nullptr, c.m,
                      scale, c.causal, y.data());
    expectClose(y, want, 1e-12, 1e-12, std::string("attention double ") + c.name);
    std::vector<float> yf(ys.numel());
    attention<float>(to<float>(q).data(), c.q, to<float>(k).data(), c.k, to<float>(v).data(), c.v,
                     mp ? to<float>(m).data() : nullptr, c.m, static_cast<float>(scale), c.causal,
                     yf.data());
    expectClose(yf, want, 1e-5, 1e-5, std::string("attention float ") + c.name);
  }
}

TEST(Attention, FullyMaskedRowIsZero) {
  const Dims qs{3, 2}, ms{3, 3};
  const Vec q = uniform(6, 105), k = uniform(6, 106), v = uniform(6, 107);
  Vec m(9, 0.0);
  m[3] = m[4] = m[5] = -kInf; // query row 1 sees nothing
  Vec y(6);
  attention<double>(q.data(), qs, k.data(), qs, v.data(), qs, m.data(), ms, 0.5, false, y.data());
  EXPECT_EQ(y[2], 0.0);
  EXPECT_EQ(y[3], 0.0);
  EXPECT_NE(y[0], 0.0);
  Vec dq(6), dk(6), dv(6);
  const Vec dy = uniform(6, 108);
  attention_grad<double>(q.data(), qs, k.data(), qs, v.data(), qs, m.data(), ms, 0.5, false,
                         dy.data(), dq.data(), dk.data(), dv.data());
  EXPECT_EQ(dq[2], 0.0);
  EXPECT_EQ(dq[3], 0.0);
  for (double x : dq)
    EXPECT_TRUE(std::isfinite(x));
}

TEST(Attention, LongSequencesUseChunksAndBlocks) {
  // Tq = 100 spans four query blocks and Tk = 300 with D = 64 three key chunks.
  AttnCase c{{2, 100, 64}, {2, 300, 64}, {2, 300, 48}, false, {100, 300}, true, "long"};
  const Vec q = uniform(c.q.numel(), 109), k = uniform(c.k.numel(), 110),
            v = uniform(c.v.numel(), 111), m = uniform(c.m.numel(), 112, -2, 0);
  const Vec want = attentionRef(q, k, v, &m, c, 0.125);
  std::vector<float> y(2 * 100 * 48);
  attention<float>(to<float>(q).data(), c.q, to<float>(k).data(), c.k, to<float>(v).data(), c.v,
                   to<float>(m).data(), c.m, 0.125f, false, y.data());
  expectClose(y, want, 1e-4, 1e-5, "long attention");
  c.causal = true;
  c.q = {2, 300, 64};
  const Vec q2 = uniform(c.q.numel(), 113);
  const Vec want2 = attentionRef(q2, k, v, nullptr, c, 0.125);
  std::vector<float> y2(2 * 300 * 48);
  attention<float>(to<float>(q2).data(), c.q, to<float>(k).data(), c.k, to<float>(v).data(), c.v,
                   nullptr, {}, 0.125f, true, y2.data());
  expectClose(y2, want2, 1e-4, 1e-5, "long causal attention");
}

TEST(AttentionGrad, MatchesFiniteDifferences) {
  for (const AttnCase &c : kAttn) {
    const Vec q = uniform(c.q.numel(), 121), k = uniform(c.k.numel(), 122),
              v = uniform(c.v.numel(), 123);
    const Vec m = uniform(c.m.numel(), 124, -3, 1);
    const double *mp = c.hasMask ? m.data() : nullptr;
    Dims ys = c.q;
    ys.d[ys.rank - 1] = c.v.d[c.v.rank - 1];
    const Vec dy = uniform(ys.numel(), 125);
    const double scale = 0.7;
    auto run = [&](const Vec &qi, const Vec &ki, const Vec &vi) {
      Vec y(ys.numel());
      attention<double>(qi.data(), c.q, ki.data(), c.k, vi.data(), c.v, mp, c.m, scale, c.causal,
                        y.data());
      return dot(y, dy);
    };
    Vec dq(q.size()), dk(k.size()), dv(v.size());
    attention_grad<double>(q.data(), c.q, k.data(), c.k, v.data(), c.v, mp, c.m, scale, c.causal,
                           dy.data(), dq.data(), dk.data(), dv.data());
    const std::string what = std::string("attention_grad ") + c.name;
    expectClose(dq, numericGrad([&](const Vec &x) { return run(x, k, v); }, q), kFdTol, kFdTol,
                what + " dq");
    expectClose(dk, numericGrad([&](const Vec &x) { return run(q, x, v); }, k), kFdTol, kFdTol,
                what + " dk");
    expectClose(dv, numericGrad([&](const Vec &x) { return run(q, k, x); }, v), kFdTol, kFdTol,
                what + " dv");
  }
}

TEST(AttentionGrad, FloatLongMatchesDouble) {
  const Dims qs{3, 80, 64}, vs{3, 80, 32};
  const Vec q = uniform(qs.numel(), 126), k = uniform(qs.numel(), 127),
            v = uniform(vs.numel(), 128), dy = uniform(vs.numel(), 129);
  Vec dq(q.size()), dk(k.size()), dv(v.size());
  attention_grad<double>(q.data(), qs, k.data(), qs, v.data(), vs, nullptr, {}, 0.125, true,
                         dy.data(), dq.data(), dk.data(), dv.data());
  std::vector<float> dqf(q.size()), dkf(k.size()), dvf(v.size());
  attention_grad<float>(to<float>(q).data(), qs, to<float>(k).data(), qs, to<float>(v).data(), vs,
                        nullptr, {}, 0.125f, true, to<float>(dy).data(), dqf.data(), dkf.data(),
                        dvf.data());
  expectClose(dqf, dq, 1e-4, 1e-4, "dq");
  expectClose(dkf, dk, 1e-4, 1e-4, "dk");
  expectClose(dvf, dv, 1e-4, 1e-4, "dv");
}

//===--- Cross entropy ----------------------------------------------------===//

/// Per-element losses (0 where ignored) and the count of counted elements.
Vec crossEntropyRef(const Vec &x, const Dims &ls, const std::vector<int64_t> &t, bool hasIgnore,
                    int64_t ignore, int64_t &count) {
  const int64_t n = ls.d[0], c = ls.d[1], s = ls.numel() / (n * c);
  Vec loss(n * s, 0.0);
  count = 0;
  for (int64_t ni = 0; ni < n; ++ni)
    for (int64_t si = 0; si < s; ++si) {
      const int64_t e = ni * s + si;
      if (hasIgnore && t[e] == ignore)
        continue;
      ++count;
      double m = -kInf, sum = 0;
      for (int64_t j = 0; j < c; ++j)
        m = std::max(m, x[(ni * c + j) * s + si]);
      for (int64_t j = 0; j < c; ++j)
        sum += std::exp(x[(ni * c + j) * s + si] - m);
      loss[e] = -(x[(ni * c + t[e]) * s + si] - m - std::log(sum));
    }
  return loss;
}

struct CeCase {
  Dims ls;
  bool hasIgnore;
};

const CeCase kCe[] = {
    {{6, 5}, false},    {{6, 5}, true},     {{2, 4, 3, 5}, true}, // S = 15 < 16
    {{3, 4, 20}, true}, {{2000, 50}, true}, {{40, 7, 33}, false},
};

std::vector<int64_t> targetsFor(const Dims &ls, bool hasIgnore, int64_t ignore, uint64_t seed) {
  const int64_t e = ls.numel() / ls.d[1];
  const Vec r = uniform(e, seed, 0, static_cast<double>(ls.d[1]));
  std::vector<int64_t> t(e);
  for (int64_t i = 0; i < e; ++i)
    t[i] = static_cast<int64_t>(r[i]);
  if (hasIgnore)
    for (int64_t i = 0; i < e; i += 3)
      t[i] = ignore;
  return t;
}

TEST(CrossEntropy, ForwardAllReductions) {
  const int64_t ignore = -100;
  for (const CeCase &c : kCe) {
    const Vec x = uniform(c.ls.numel(), 131, -5, 5);
    const std::vector<int64_t> t = targetsFor(c.ls, c.hasIgnore, ignore, 132);
    int64_t count;
    const std::vector<float> xf = to<float>(x);
    const Vec loss = crossEntropyRef(toD(xf), c.ls, t, c.hasIgnore, ignore, count);
    double total = 0;
    for (double l : loss)
      total += l;
    std::vector<float> none(t.size());
    float mean, sum;
    cross_entropy<float>(xf.data(), c.ls, t.data(), 0, c.hasIgnore, ignore, &mean);
    cross_entropy<float>(xf.data(), c.ls, t.data(), 1, c.hasIgnore, ignore, &sum);
    cross_entropy<float>(xf.data(), c.ls, t.data(), 2, c.hasIgnore, ignore, none.data());
    const std::string what = "cross_entropy " + str(c.ls);
    expectClose(none, loss, 1e-5, 1e-5, what + " none");
    EXPECT_NEAR(mean, total / count, 1e-5 * std::fabs(total / count)) << what;
    EXPECT_NEAR(sum, total, 1e-5 * std::fabs(total)) << what;
  }
}

TEST(CrossEntropy, AllIgnoredMeanIsNaN) {
  const float x[] = {1, 2, 3, 4};
  const int64_t t[] = {7, 7};
  float y;
  cross_entropy<float>(x, {2, 2}, t, 0, true, 7, &y);
  EXPECT_TRUE(std::isnan(y));
  cross_entropy<float>(x, {2, 2}, t, 1, true, 7, &y);
  EXPECT_EQ(y, 0.f);
}

TEST(CrossEntropyGrad, MatchesFiniteDifferences) {
  const int64_t ignore = 2; // an ignore index inside [0, C) must still be skipped
  for (const CeCase &c : {CeCase{{5, 4}, true}, CeCase{{2, 3, 17}, true}, CeCase{{3, 5}, false}})
    for (int reduction : {0, 1, 2}) {
      const Vec x = uniform(c.ls.numel(), 141, -3, 3);
      const std::vector<int64_t> t = targetsFor(c.ls, c.hasIgnore, ignore, 142);
      const int64_t e = static_cast<int64_t>(t.size());
      const Vec dy = uniform(reduction == 2 ? e : 1, 143);
      auto loss = [&](const Vec &xi) {
        Vec y(reduction == 2 ? e : 1);
        cross_entropy<double>(xi.data(), c.ls, t.data(), reduction, c.hasIgnore, ignore, y.data());
        return dot(y, dy);
      };
      Vec dx(x.size());
      cross_entropy_grad<double>(x.data(), c.ls, t.data(), reduction, c.hasIgnore, ignore,
                                 dy.data(), dx.data());
      expectClose(dx, numericGrad(loss, x), kFdTol, kFdTol,
                  "cross_entropy_grad " + str(c.ls) + " reduction " + std::to_string(reduction));
    }
}

TEST(CrossEntropyGrad, FloatLargeMatchesDouble) {
  const Dims ls{3000, 40};
  const Vec x = uniform(ls.numel(), 144, -4, 4);
  const std::vector<int64_t> t = targetsFor(ls, true, -1, 145);
  const double dy = 1.5;
  const float dyf = 1.5f;
  Vec dx(x.size());
  cross_entropy_grad<double>(x.data(), ls, t.data(), 0, true, -1, &dy, dx.data());
  std::vector<float> dxf(x.size());
  cross_entropy_grad<float>(to<float>(x).data(), ls, t.data(), 0, true, -1, &dyf, dxf.data());
  expectClose(dxf, dx, 1e-4, 1e-9, "cross_entropy_grad float");
}

//===--- 16-bit formats ---------------------------------------------------===//

/// bf16 of x by the definition: the nearest of the two bf16 neighbours, ties
/// to the even one (float64 arithmetic on the neighbours).
uint16_t bf16Reference(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x))
    return (uint16_t)((u >> 16) | 0x40u);
  const uint32_t lo = u & 0xFFFF0000u, hi = lo + 0x10000u; // towards and away from zero
  float fl, fh;
  std::memcpy(&fl, &lo, 4);
  std::memcpy(&fh, &hi, 4);
  // Past the largest finite value the neighbour is 2^128 with an unbounded
  // exponent (IEEE: what rounds to it overflows to infinity).
  const double dh = std::isinf(fh) ? std::ldexp(1.0, 128) - std::fabs((double)x)
                                   : std::fabs((double)fh - x),
               dl = std::fabs((double)x - fl);
  if (dl < dh || (dl == dh && !((lo >> 16) & 1u)))
    return (uint16_t)(lo >> 16);
  return (uint16_t)(hi >> 16);
}

uint16_t bitsOf(_Float16 h) {
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

// The integer conversions the CPU and the CUDA kernels share (elementwise.h)
// against the compiler's IEEE binary16 and the bf16 definition, on every
// 127th float bit pattern (34 million, every exponent and both signs) and on
// the edges: 65504, 65520 (to infinity), the subnormals' ties, 2^-25.
TEST(Formats16, EveryExponentAgainstReferences) {
  auto check = [](uint32_t u) {
    float x;
    std::memcpy(&x, &u, 4);
    const uint16_t h = ew::f16Bits(x), want = bitsOf((_Float16)x);
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(ew::f16Float(h))) << std::hex << u;
      ASSERT_TRUE(std::isnan(ew::bf16Float(ew::bf16Bits(x)))) << std::hex << u;
      return;
    }
    ASSERT_EQ(h, want) << "fp16 of bits 0x" << std::hex << u;
    ASSERT_EQ(ew::f16Float(h), (float)(_Float16)x) << std::hex << u;
    ASSERT_EQ(ew::bf16Bits(x), bf16Reference(x)) << "bf16 of bits 0x" << std::hex << u;
    uint32_t back = (uint32_t)ew::bf16Bits(x) << 16;
    float b;
    std::memcpy(&b, &back, 4);
    ASSERT_EQ(ew::bf16Float(ew::bf16Bits(x)), b);
  };
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 127)
    check((uint32_t)u);
  const float edges[] = {65504.0f,        65519.99f,      65520.0f,      1e9f,
                         0x1p-25f,        0x1.0p-24f,     0x1.8p-24f,    0x1.8p-25f,
                         0x1p-14f,        0x1.ffcp-15f,   3.4028235e38f, 1.0f + 0x1p-8f,
                         1.0f + 0x1p-11f, 1.0f + 0x3p-11f};
  for (float e : edges)
    for (float x : {e, -e}) {
      uint32_t u;
      std::memcpy(&u, &x, 4);
      check(u);
    }
  // Every fp16 value round-trips exactly.
  for (uint32_t h = 0; h < 0x10000u; ++h)
    if (((h >> 10) & 0x1Fu) != 0x1Fu)
      ASSERT_EQ(ew::f16Bits(ew::f16Float((uint16_t)h)), h) << std::hex << h;
}

// The kernels the generated programs call: in place, and copies both ways.
TEST(Formats16, Kernels) {
  std::vector<float> x = {1.0f + 0x1p-9f, -3.14159f, 70000.0f, 1e-8f, 0.0f};
  std::vector<float> r = x, back(x.size());
  std::vector<uint16_t> bits(x.size());
  roundBf16(r.data(), (int64_t)r.size());
  toBf16(x.data(), bits.data(), (int64_t)x.size());
  fromBf16(bits.data(), back.data(), (int64_t)x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(r[i], roundToBf16(x[i]));
    EXPECT_EQ(back[i], r[i]);
  }
  EXPECT_EQ(r[0], 1.0f); // the tie to even
  r = x;
  roundF16(r.data(), (int64_t)r.size());
  toF16(x.data(), bits.data(), (int64_t)x.size());
  fromF16(bits.data(), back.data(), (int64_t)x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(r[i], roundToF16(x[i]));
    EXPECT_EQ(back[i], r[i]);
  }
  EXPECT_TRUE(std::isinf(r[2]));
}

} // namespace
