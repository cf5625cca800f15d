//===- KernelsTest.cpp - CPU kernels against naive float64 loops ----------===//
//
// Every kernel of kernels.h is compared with a reference written here as the
// plainest loop over float64, for float and double, on shapes that take the
// kernels' fast paths (same shape, bias, scalar, folded GEMM) and their
// general ones (broadcast on both sides, strided reductions, tiled
// transposes), and on sizes large enough to run in parallel. Backward kernels
// are checked against central finite differences of the forward kernels in
// double.
//
// This file: elementwise kernels; KernelsMathTest.cpp and
// KernelsLayoutTest.cpp hold the others, KernelsTesting.h what they share.
//
//===----------------------------------------------------------------------===//

#include "KernelsTesting.h"

#include "carve/rt/fused.h"

using namespace carve::rt;
using namespace kernels_test;

namespace {

//===--- Elementwise ------------------------------------------------------===//

struct UnaryCase {
  Unary f;
  const char *name;
  double (*ref)(double);
  double (*dref)(double);
  double lo, hi; // domain of the test inputs
};

double sigmoidD(double x) { return 1 / (1 + std::exp(-x)); }
double geluTanhD(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}

const UnaryCase kUnary[] = {
    {Unary::Neg, "neg", [](double x) { return -x; }, nullptr, -3, 3},
    {Unary::Abs, "abs", [](double x) { return std::fabs(x); }, nullptr, -3, 3},
    {Unary::Exp, "exp", [](double x) { return std::exp(x); }, nullptr, -20, 20},
    {Unary::Log, "log", [](double x) { return std::log(x); }, nullptr, 0.01, 50},
    {Unary::Sqrt, "sqrt", [](double x) { return std::sqrt(x); }, nullptr, 0.01, 50},
    {Unary::Rsqrt, "rsqrt", [](double x) { return 1 / std::sqrt(x); }, nullptr, 0.01, 50},
    {Unary::Reciprocal, "reciprocal", [](double x) { return 1 / x; }, nullptr, 0.1, 5},
    {Unary::Tanh, "tanh", [](double x) { return std::tanh(x); }, nullptr, -6, 6},
    {Unary::Erf, "erf", [](double x) { return std::erf(x); }, nullptr, -4.5, 4.5},
    {Unary::Sigmoid, "sigmoid", sigmoidD, nullptr, -12, 12},
    {Unary::Relu, "relu", [](double x) { return x > 0 ? x : 0; }, nullptr, -3, 3},
    {Unary::Sin, "sin", [](double x) { return std::sin(x); }, nullptr, -4, 4},
    {Unary::Cos, "cos", [](double x) { return std::cos(x); }, nullptr, -4, 4},
    {Unary::Silu, "silu", [](double x) { return x * sigmoidD(x); }, nullptr, -12, 12},
    {Unary::Gelu, "gelu", [](double x) { return x * 0.5 * (1 + std::erf(x / std::sqrt(2.0))); },
     nullptr, -6, 6},
    {Unary::GeluTanh, "gelu_tanh", geluTanhD, nullptr, -6, 6},
};

template <class T> void checkUnary(int64_t n) {
  for (const UnaryCase &c : kUnary) {
    const Vec x = uniform(n, 11, c.lo, c.hi);
    std::vector<T> y(n);
    unary<T>(c.f, to<T>(x).data(), y.data(), n);
    Vec want(n);
    const std::vector<T> xt = to<T>(x);
    for (int64_t i = 0; i < n; ++i)
      want[i] = c.ref(static_cast<double>(xt[i]));
    // float: within about 12 ulp of the exact function of the rounded input
    // (exp, tanh and erf are approximations of a few ulp; sigmoid, silu and
    // gelu round a few more times). erf's approximation has an absolute error
    // of 3.3e-7 (the SIMD erf PyTorch uses has 1.5e-7), which gelu scales by
    // |x| / 2 <= 3 where 1 + erf cancels; gelu_tanh cancels in 1 + tanh the
    // same way: absolute floors of 2e-6 and 1e-6.
    const double rtol = std::is_same_v<T, float> ? 1.5e-6 : 1e-12;
    const double atol = !std::is_same_v<T, float> ? 1e-12 : (c.f == Unary::Gelu ? 2e-6 : 1e-6);
    expectClose(y, want, rtol, atol, std::string(c.name) + " n=" + std::to_string(n));
  }
}

TEST(Unary, FloatMatchesReference) {
  checkUnary<float>(1000);
  checkUnary<float>(100003); // parallel
}

TEST(Unary, DoubleMatchesReference) { checkUnary<double>(1000); }

TEST(Unary, SpecialValues) {
  const std::vector<float> x = {-INFINITY, INFINITY, NAN, -100.f, 100.f, 0.f};
  std::vector<float> y(x.size());
  unary<float>(Unary::Exp, x.data(), y.data(), x.size());
  EXPECT_EQ(y[0], 0.f);
  EXPECT_EQ(y[1], INFINITY);
  EXPECT_TRUE(std::isnan(y[2]));
  EXPECT_EQ(y[3], std::exp(-100.f)); // subnormal, 0 in float
  EXPECT_EQ(y[4], INFINITY);
  EXPECT_EQ(y[5], 1.f);
  unary<float>(Unary::Sigmoid, x.data(), y.data(), x.size());
  EXPECT_EQ(y[0], 0.f);
  EXPECT_EQ(y[1], 1.f);
  EXPECT_TRUE(std::isnan(y[2]));
  unary<float>(Unary::Tanh, x.data(), y.data(), x.size());
  EXPECT_EQ(y[0], -1.f);
  EXPECT_EQ(y[1], 1.f);
  EXPECT_TRUE(std::isnan(y[2]));
  unary<float>(Unary::Relu, x.data(), y.data(), x.size());
  EXPECT_TRUE(std::isnan(y[2])); // NaN propagates, as clamp_min
}

TEST(UnaryGrad, MatchesFiniteDifferences) {
  const int64_t n = 50;
  for (const UnaryCase &c : kUnary) {
    // Keep away from the kinks of abs and relu.
    Vec x = uniform(n, 12, c.lo, c.hi);
    for (double &v : x)
      if (std::fabs(v) < 1e-3)
        v = 0.5;
    const Vec dy = uniform(n, 13);
    Vec dx(n);
    unary_grad<double>(c.f, x.data(), dy.data(), dx.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      auto f = [&](const Vec &xi) {
        double y;
        unary<double>(c.f, &xi[0], &y, 1);
        return y * dy[i];
      };
      const double num = numericGrad(f, Vec{x[i]})[0];
      EXPECT_NEAR(dx[i], num, kFdTol * std::max(1.0, std::fabs(num))) << c.name << " at x=" << x[i];
    }
    // And the float kernel agrees with the double one.
    std::vector<float> dxf(n);
    unary_grad<float>(c.f, to<float>(x).data(), to<float>(dy).data(), dxf.data(), n);
    expectClose(dxf, dx, 1e-4, 1e-5, std::string(c.name) + " float grad");
  }
}

TEST(UnaryGrad, KinksFollowPyTorch) {
  const double x[] = {0.0, 0.0}, dy[] = {3.0, 3.0};
  double dx[2];
  unary_grad<double>(Unary::Relu, x, dy, dx, 1);
  EXPECT_EQ(dx[0], 0.0);
  unary_grad<double>(Unary::Abs, x, dy, dx, 1);
  EXPECT_EQ(dx[0], 0.0);
}

struct BinaryCase {
  Dims a, b, y;
};

const BinaryCase kBroadcast[] = {
    {{3, 4, 5}, {3, 4, 5}, {3, 4, 5}},       // same shape
    {{2, 3, 8}, {8}, {2, 3, 8}},             // bias along the last dim
    {{8}, {2, 3, 8}, {2, 3, 8}},             // the bias on the left
    {{2, 3, 8}, {}, {2, 3, 8}},              // scalar b
    {{}, {2, 3, 8}, {2, 3, 8}},              // scalar a
    {{2, 1, 4}, {3, 1}, {2, 3, 4}},          // both sides broadcast
    {{5, 1}, {1, 6}, {5, 6}},                // outer product
    {{4, 1, 3}, {4, 5, 1}, {4, 5, 3}},       // inner broadcast
    {{2, 3, 1, 5}, {3, 4, 1}, {2, 3, 4, 5}}, // rank 4, mixed
    {{1, 1}, {1}, {1, 1}},                   // all ones
    {{300, 257}, {257}, {300, 257}},         // parallel bias
    {{300, 1, 1}, {1, 17, 9}, {300, 17, 9}}, // parallel, short rows
    {{0, 3}, {3}, {0, 3}},                   // empty
};

double binaryRef(Binary f, double a, double b) {
  switch (f) {
  case Binary::Add:
    return a + b;
  case Binary::Sub:
    return a - b;
  case Binary::Mul:
    return a * b;
  case Binary::Div:
    return a / b;
  case Binary::Pow:
    return std::pow(a, b);
  case Binary::Max:
    return std::max(a, b);
  case Binary::Min:
    return std::min(a, b);
  }
  return NAN;
}

template <class T> void checkBinary() {
  const Binary ops[] = {Binary::Add, Binary::Sub, Binary::Mul, Binary::Div,
                        Binary::Pow, Binary::Max, Binary::Min};
  for (const BinaryCase &c : kBroadcast) {
    // Positive operands keep pow and div well defined.
    const std::vector<T> a = to<T>(uniform(c.a.numel(), 21, 0.5, 2.0));
    const std::vector<T> b = to<T>(uniform(c.b.numel(), 22, 0.5, 2.0));
    for (Binary f : ops) {
      std::vector<T> y(c.y.numel());
      binary<T>(f, a.data(), c.a, b.data(), c.b, y.data(), c.y);
      Vec want(c.y.numel());
      for (int64_t i = 0; i < c.y.numel(); ++i)
        want[i] = binaryRef(f, a[source(i, c.y, c.a)], b[source(i, c.y, c.b)]);
      expectClose(y, want, rtolFor<T>(), atolFor<T>(),
                  "binary " + std::to_string(static_cast<int>(f)) + " " + str(c.a) + " " +
                      str(c.b));
    }
  }
}

TEST(Binary, FloatBroadcasting) { checkBinary<float>(); }
TEST(Binary, DoubleBroadcasting) { checkBinary<double>(); }

TEST(Binary, PowScalarExponents) {
  const Vec base = uniform(1000, 23, 0.1, 3.0);
  for (double e : {2.0, 3.0, 0.5, -0.5, -1.0, -2.0, 1.7, 1.0, 0.0}) {
    const float ef = static_cast<float>(e);
    std::vector<float> y(base.size());
    const std::vector<float> bf = to<float>(base);
    binary<float>(Binary::Pow, bf.data(), {1000}, &ef, {}, y.data(), {1000});
    Vec want(base.size());
    for (size_t i = 0; i < base.size(); ++i)
      want[i] = std::pow(static_cast<double>(bf[i]), e);
    expectClose(y, want, 2e-6, 0, "pow exponent " + std::to_string(e));
  }
}

TEST(Binary, MaxMinPropagateNaN) {
  const float a[] = {1.f, NAN, 3.f}, b[] = {NAN, 2.f, 1.f};
  float y[3];
  binary<float>(Binary::Max, a, {3}, b, {3}, y, {3});
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_TRUE(std::isnan(y[1]));
  EXPECT_EQ(y[2], 3.f);
  binary<float>(Binary::Min, a, {3}, b, {3}, y, {3});
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_TRUE(std::isnan(y[1]));
  EXPECT_EQ(y[2], 1.f);
}

TEST(Binary, IntegersTruncateLikeOnnx) {
  const int64_t a[] = {7, -7, 9}, b[] = {2};
  int64_t y[3];
  binary<int64_t>(Binary::Div, a, {3}, b, {1}, y, {3});
  EXPECT_EQ(y[0], 3);
  EXPECT_EQ(y[1], -3);
  EXPECT_EQ(y[2], 4);
  binary<int64_t>(Binary::Max, a, {3}, b, {1}, y, {3});
  EXPECT_EQ(y[1], 2);
}

TEST(Compare, Broadcasting) {
  for (const BinaryCase &c : kBroadcast) {
    // Small integers make equality frequent.
    Vec av = uniform(c.a.numel(), 31, 0, 3), bv = uniform(c.b.numel(), 32, 0, 3);
    for (double &v : av)
      v = std::floor(v);
    for (double &v : bv)
      v = std::floor(v);
    const std::vector<float> a = to<float>(av), b = to<float>(bv);
    const std::vector<int64_t> ai = to<int64_t>(av), bi = to<int64_t>(bv);
    for (Compare f : {Compare::Eq, Compare::Lt, Compare::Gt}) {
      std::vector<uint8_t> y(c.y.numel()), yi(c.y.numel());
      compare<float>(f, a.data(), c.a, b.data(), c.b, y.data(), c.y);
      compare<int64_t>(f, ai.data(), c.a, bi.data(), c.b, yi.data(), c.y);
      Vec want(c.y.numel());
      for (int64_t i = 0; i < c.y.numel(); ++i) {
        const double u = av[source(i, c.y, c.a)], v = bv[source(i, c.y, c.b)];
        want[i] = f == Compare::Eq ? u == v : (f == Compare::Lt ? u < v : u > v);
      }
      expectClose(y, want, 0, 0, "compare float " + str(c.a) + " " + str(c.b));
      expectClose(yi, want, 0, 0, "compare int64 " + str(c.a) + " " + str(c.b));
    }
  }
}

TEST(Logic, AndOrNot) {
  const uint8_t a[] = {0, 1, 0, 1, 1, 0}, b[] = {0, 1, 1};
  uint8_t y[6];
  logic(Logic::And, a, {2, 3}, b, {3}, y, {2, 3});
  EXPECT_EQ(std::vector<uint8_t>(y, y + 6), (std::vector<uint8_t>{0, 1, 0, 0, 1, 0}));
  logic(Logic::Or, a, {2, 3}, b, {3}, y, {2, 3});
  EXPECT_EQ(std::vector<uint8_t>(y, y + 6), (std::vector<uint8_t>{0, 1, 1, 1, 1, 1}));
  logic(Logic::Not, a, {2, 3}, nullptr, {}, y, {2, 3});
  EXPECT_EQ(std::vector<uint8_t>(y, y + 6), (std::vector<uint8_t>{1, 0, 1, 0, 0, 1}));
  logic(Logic::Not, b, {3}, nullptr, {}, y, {2, 3}); // broadcast
  EXPECT_EQ(std::vector<uint8_t>(y, y + 6), (std::vector<uint8_t>{1, 0, 0, 1, 0, 0}));
}

TEST(Where, BroadcastsAllThree) {
  const Dims cs{4, 1}, as{1, 5}, bs{}, ys{4, 5};
  const Vec cv = uniform(4, 41, 0, 2);
  std::vector<uint8_t> c(4);
  for (int i = 0; i < 4; ++i)
    c[i] = cv[i] > 1;
  c[0] = 1;
  c[1] = 0;
  const Vec av = uniform(5, 42), bv = {7.5};
  std::vector<double> y(20);
  where<double>(c.data(), cs, av.data(), as, bv.data(), bs, y.data(), ys);
  Vec want(20);
  for (int i = 0; i < 20; ++i)
    want[i] = c[source(i, ys, cs)] ? av[source(i, ys, as)] : bv[0];
  expectClose(y, want, 0, 0, "where");
  // Same shapes, the contiguous path, on int64.
  const int64_t ai[] = {1, 2, 3}, bi[] = {-1, -2, -3};
  const uint8_t ci[] = {1, 0, 1};
  int64_t yi[3];
  where<int64_t>(ci, {3}, ai, {3}, bi, {3}, yi, {3});
  EXPECT_EQ(std::vector<int64_t>(yi, yi + 3), (std::vector<int64_t>{1, -2, 3}));
}

TEST(Cast, ConvertsLikeOnnx) {
  const float f[] = {-2.7f, 0.0f, 0.5f, 3.9f};
  int64_t i64[4];
  cast<float, int64_t>(f, i64, 4);
  EXPECT_EQ(std::vector<int64_t>(i64, i64 + 4), (std::vector<int64_t>{-2, 0, 0, 3}));
  uint8_t b[4];
  cast<float, uint8_t>(f, b, 4); // to bool: non-zero is true
  EXPECT_EQ(std::vector<uint8_t>(b, b + 4), (std::vector<uint8_t>{1, 0, 1, 1}));
  const int64_t big[] = {256, 0, -1};
  cast<int64_t, uint8_t>(big, b, 3);
  EXPECT_EQ(std::vector<uint8_t>(b, b + 3), (std::vector<uint8_t>{1, 0, 1}));
  const uint8_t u[] = {0, 1};
  double d[2];
  cast<uint8_t, double>(u, d, 2);
  EXPECT_EQ(d[0], 0.0);
  EXPECT_EQ(d[1], 1.0);
  const double dd[] = {1.0 / 3};
  float ff;
  cast<double, float>(dd, &ff, 1);
  EXPECT_EQ(ff, static_cast<float>(1.0 / 3));
  const int64_t l[] = {-5, 1LL << 33};
  int32_t i32[2];
  cast<int64_t, int32_t>(l, i32, 2);
  EXPECT_EQ(i32[0], -5);
}

TEST(FillCopy, LargeAndSmall) {
  for (int64_t n : {int64_t(5), int64_t(1) << 20}) {
    std::vector<float> y(n, 1.f);
    fill<float>(y.data(), n, 2.5f);
    EXPECT_EQ(std::count(y.begin(), y.end(), 2.5f), n);
    std::vector<int64_t> src(n), dst(n, 0);
    for (int64_t i = 0; i < n; ++i)
      src[i] = i * 3;
    copy<int64_t>(src.data(), dst.data(), n);
    EXPECT_EQ(src, dst);
  }
}

// fused(): the chain per element, each input broadcast (NumPy rules), against
// the same functor called on every output position by hand. Shapes that
// coalesce to one run, broadcasts along the inner and outer dimensions (the
// strided runs), a scalar output, the most inputs and outputs a chain has,
// and one large enough for the OpenMP team; the results are bitwise equal,
// as the functor is the same code.
struct FusedThree {
  void operator()(const float (&x)[3], float (&y)[2]) const {
    const float t = x[0] * x[1];
    y[0] = t + x[2];
    y[1] = t;
  }
};
struct FusedWide {
  void operator()(const float (&x)[kMaxFusedInputs], float (&y)[kMaxFusedOutputs]) const {
    float s = 0.f;
    for (int k = 0; k < kMaxFusedInputs; ++k)
      s = s * 0.5f + x[k];
    for (int j = 0; j < kMaxFusedOutputs; ++j)
      y[j] = s + float(j);
  }
};

/// The offset in an input of shape `s` of output position `pos` (shape ys).
int64_t broadcastOffset(const Dims &s, const Dims &ys, const int64_t *pos) {
  int64_t off = 0;
  for (int i = 0; i < s.rank; ++i) {
    const int64_t p = pos[ys.rank - s.rank + i];
    off = off * s.d[i] + (s.d[i] == 1 ? 0 : p);
  }
  return off;
}

template <int NI, int NO, class F> void checkFused(const Dims (&shapes)[NI], Dims ys) {
  std::vector<std::vector<float>> ins(NI);
  const float *in[NI];
  for (int k = 0; k < NI; ++k) {
    const Vec v = uniform(std::max<int64_t>(shapes[k].numel(), 1), 40 + k);
    ins[k].assign(v.begin(), v.end());
    in[k] = ins[k].data();
  }
  const int64_t n = ys.numel();
  std::vector<std::vector<float>> outs(NO, std::vector<float>(std::max<int64_t>(n, 1), -7.f));
  float *out[NO];
  for (int j = 0; j < NO; ++j)
    out[j] = outs[j].data();
  fused("test chain", F{}, in, shapes, out, ys);
  int64_t pos[kMaxRank] = {};
  for (int64_t e = 0; e < n; ++e) {
    float x[NI], y[NO];
    for (int k = 0; k < NI; ++k)
      x[k] = in[k][broadcastOffset(shapes[k], ys, pos)];
    F{}(x, y);
    for (int j = 0; j < NO; ++j)
      ASSERT_EQ(outs[j][e], y[j]) << "output " << j << ", element " << e << " of " << n;
    for (int i = ys.rank - 1; i >= 0 && ++pos[i] == ys.d[i]; --i)
      pos[i] = 0;
  }
}

TEST(Fused, BroadcastsLikeTheUnfusedKernels) {
  // Contiguous: one run.
  checkFused<3, 2, FusedThree>({Dims{4, 5, 6}, Dims{4, 5, 6}, Dims{4, 5, 6}}, {4, 5, 6});
  // A bias along the last axis (contiguous runs) and a per-row scale (strided).
  checkFused<3, 2, FusedThree>({Dims{4, 5, 6}, Dims{6}, Dims{4, 5, 1}}, {4, 5, 6});
  // A channel broadcast in the middle, a scalar, an input of lower rank.
  checkFused<3, 2, FusedThree>({Dims{2, 3, 4, 5}, Dims{3, 1, 1}, Dims{}}, {2, 3, 4, 5});
  // Every input broadcast: the output is an outer product.
  checkFused<3, 2, FusedThree>({Dims{7, 1}, Dims{1, 9}, Dims{1}}, {7, 9});
  // A rank-0 output, and an empty one (nothing written, nothing read).
  checkFused<3, 2, FusedThree>({Dims{}, Dims{}, Dims{}}, Dims{});
  checkFused<3, 2, FusedThree>({Dims{0, 4}, Dims{4}, Dims{}}, {0, 4});
  // The most inputs and outputs of a chain, some broadcast.
  checkFused<kMaxFusedInputs, kMaxFusedOutputs, FusedWide>(
      {Dims{3, 8}, Dims{8}, Dims{3, 1}, Dims{3, 8}, Dims{}, Dims{1, 8}, Dims{3, 8}, Dims{3, 8}},
      {3, 8});
  // Large enough to split over the OpenMP team, with runs that straddle the
  // threads' boundaries.
  checkFused<3, 2, FusedThree>({Dims{37, 1001}, Dims{1001}, Dims{37, 1}}, {37, 1001});
  checkFused<3, 2, FusedThree>({Dims{300, 301}, Dims{300, 301}, Dims{300, 301}}, {300, 301});
}

TEST(KernelErrors, FusedShapeThatDoesNotBroadcastIsFatal) {
  const std::vector<float> a(12), b(5);
  float y0[12], y1[12];
  const float *in[] = {a.data(), b.data(), a.data()};
  const Dims shapes[] = {Dims{3, 4}, Dims{5}, Dims{3, 4}};
  float *out[] = {y0, y1};
  EXPECT_EXIT(fused("Fused7 (mul, add)", FusedThree{}, in, shapes, out, {3, 4}),
              testing::ExitedWithCode(1),
              "Fused7 \\(mul, add\\): dimension 1 of size 5 does not broadcast to size 4");
}

} // namespace
