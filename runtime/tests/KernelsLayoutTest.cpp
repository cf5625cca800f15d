//===- KernelsLayoutTest.cpp - data movement kernels and kernel errors ----===//
//
// Transpose, slice, concat, gather, expand against float64 loops; the
// kernels' fatal errors; dtype sizes (KernelsTest.cpp says how).
//
//===----------------------------------------------------------------------===//

#include "KernelsTesting.h"
#include <cstring>

using namespace carve::rt;
using namespace kernels_test;

namespace {

//===--- Data movement ----------------------------------------------------===//

template <class T> void checkTranspose(const Dims &xs, const Dims &perm) {
  std::vector<T> x(xs.numel());
  for (int64_t i = 0; i < xs.numel(); ++i)
    x[i] = static_cast<T>(i % 251);
  Dims ys;
  ys.rank = xs.rank;
  for (int i = 0; i < xs.rank; ++i)
    ys.d[i] = xs.d[perm.d[i]];
  std::vector<T> y(xs.numel());
  transpose<T>(x.data(), xs, perm, y.data());
  int64_t xst[kMaxRank], acc = 1;
  for (int i = xs.rank - 1; i >= 0; --i) {
    xst[i] = acc;
    acc *= xs.d[i];
  }
  Vec want(xs.numel());
  for (int64_t i = 0; i < ys.numel(); ++i) {
    int64_t rem = i, src = 0;
    for (int d = ys.rank - 1; d >= 0; --d) {
      src += (rem % ys.d[d]) * xst[perm.d[d]];
      rem /= ys.d[d];
    }
    want[i] = static_cast<double>(x[src]);
  }
  expectClose(y, want, 0, 0, "transpose " + str(xs) + " perm " + str(perm));
}

TEST(Transpose, AllPermutationsOfRank4) {
  int64_t p[] = {0, 1, 2, 3};
  do {
    checkTranspose<float>({2, 3, 4, 5}, Dims(p, 4));
    checkTranspose<uint8_t>({2, 3, 1, 5}, Dims(p, 4));
  } while (std::next_permutation(p, p + 4));
}

TEST(Transpose, TiledAndTypes) {
  checkTranspose<float>({300, 500}, {1, 0});
  checkTranspose<double>({7, 45, 33}, {0, 2, 1});
  checkTranspose<int64_t>({4, 64, 6, 32}, {0, 2, 1, 3}); // heads split
  checkTranspose<int32_t>({37, 1, 41}, {2, 1, 0});
  checkTranspose<float>({3}, {0});
}

template <class T> void checkSlice(const Dims &xs, const Dims &starts, const Dims &steps) {
  Dims ys = xs;
  for (int i = 0; i < xs.rank; ++i)
    ys.d[i] = (xs.d[i] - starts.d[i] + steps.d[i] - 1) / steps.d[i];
  std::vector<T> x(xs.numel());
  for (int64_t i = 0; i < xs.numel(); ++i)
    x[i] = static_cast<T>(i % 113 + 1);
  std::vector<T> y(ys.numel());
  slice<T>(x.data(), xs, starts, steps, y.data(), ys);
  Vec want(ys.numel());
  Vec wantGrad(xs.numel(), 0.0);
  for (int64_t i = 0; i < ys.numel(); ++i) {
    int64_t rem = i, src = 0, mul = 1;
    for (int d = ys.rank - 1; d >= 0; --d) {
      src += (starts.d[d] + (rem % ys.d[d]) * steps.d[d]) * mul;
      rem /= ys.d[d];
      mul *= xs.d[d];
    }
    want[i] = static_cast<double>(x[src]);
    wantGrad[src] = static_cast<double>(y[i]);
  }
  const std::string what = "slice " + str(xs) + " from " + str(starts) + " by " + str(steps);
  expectClose(y, want, 0, 0, what);
  std::vector<T> dx(xs.numel(), T(9));
  slice_grad<T>(y.data(), ys, starts, steps, dx.data(), xs);
  expectClose(dx, wantGrad, 0, 0, what + " grad");
}

TEST(Slice, ForwardAndGrad) {
  checkSlice<float>({5, 6, 7}, {1, 0, 2}, {1, 1, 1});
  checkSlice<float>({5, 6, 7}, {0, 1, 0}, {2, 3, 2});
  checkSlice<double>({4, 9}, {0, 3}, {1, 1});
  checkSlice<int64_t>({8, 3, 256}, {0, 1, 0}, {1, 1, 1}); // GPT's qkv split
  checkSlice<uint8_t>({10, 10}, {9, 0}, {1, 4});
  checkSlice<float>({400, 300}, {3, 5}, {1, 2}); // parallel
}

TEST(Concat, AlongEachAxis) {
  for (int axis : {0, 1, 2, -1}) {
    const int a = axis < 0 ? axis + 3 : axis;
    Dims s0{2, 3, 4}, s1{2, 3, 4}, s2{2, 3, 4};
    s1.d[a] = 1;
    s2.d[a] = 5;
    const Dims shapes[] = {s0, s1, s2};
    std::vector<int32_t> x0(s0.numel()), x1(s1.numel()), x2(s2.numel());
    for (size_t i = 0; i < x0.size(); ++i)
      x0[i] = static_cast<int32_t>(i);
    for (size_t i = 0; i < x1.size(); ++i)
      x1[i] = static_cast<int32_t>(1000 + i);
    for (size_t i = 0; i < x2.size(); ++i)
      x2[i] = static_cast<int32_t>(2000 + i);
    const int32_t *xs[] = {x0.data(), x1.data(), x2.data()};
    Dims ys = s0;
    ys.d[a] = s0.d[a] + s1.d[a] + s2.d[a];
    std::vector<int32_t> y(ys.numel());
    concat<int32_t>(3, xs, shapes, axis, y.data());
    Vec want(ys.numel());
    for (int64_t i = 0; i < ys.numel(); ++i) {
      int64_t c[3], rem = i;
      for (int d = 2; d >= 0; --d) {
        c[d] = rem % ys.d[d];
        rem /= ys.d[d];
      }
      int which = 0;
      while (c[a] >= shapes[which].d[a])
        c[a] -= shapes[which++].d[a];
      const Dims &s = shapes[which];
      want[i] = xs[which][(c[0] * s.d[1] + c[1]) * s.d[2] + c[2]];
    }
    expectClose(y, want, 0, 0, "concat axis " + std::to_string(axis));
  }
}

TEST(Gather, NegativeIndicesAndAxes) {
  // Embedding lookup: axis 0 of [5, 3] by [2, 2] indices, some negative.
  const Dims ts{5, 3}, is{2, 2};
  std::vector<float> table(15);
  for (int i = 0; i < 15; ++i)
    table[i] = static_cast<float>(i);
  const int64_t idx[] = {4, -1, 0, -5};
  std::vector<float> y(12);
  gather<float>(table.data(), ts, idx, is, 0, y.data());
  EXPECT_EQ(y, (std::vector<float>{12, 13, 14, 12, 13, 14, 0, 1, 2, 0, 1, 2}));
  // Axis 1 of [2, 4, 3] by [3]: y [2, 3, 3].
  const Dims ts2{2, 4, 3}, is2{3};
  std::vector<int64_t> t2(24);
  for (int i = 0; i < 24; ++i)
    t2[i] = i;
  const int64_t idx2[] = {3, -3, 3};
  std::vector<int64_t> y2(18);
  gather<int64_t>(t2.data(), ts2, idx2, is2, 1, y2.data());
  EXPECT_EQ(y2, (std::vector<int64_t>{9, 10, 11, 3, 4, 5, 9, 10, 11, 21, 22, 23, 15, 16, 17, 21, 22,
                                      23}));
  // Last axis with a scalar index.
  const int64_t one[] = {-1};
  std::vector<int64_t> y3(8);
  gather<int64_t>(t2.data(), ts2, one, {}, -1, y3.data());
  EXPECT_EQ(y3, (std::vector<int64_t>{2, 5, 8, 11, 14, 17, 20, 23}));
}

TEST(GatherGrad, ScatterAddsRepeatedIndices) {
  for (int64_t width : {int64_t(3), int64_t(600)}) { // one and several column blocks
    const Dims ts{4, width}, is{5};
    const int64_t idx[] = {1, 3, -3, 0, 1};
    const Vec dy = uniform(5 * width, 151);
    Vec dt(ts.numel(), 7.0);
    gather_grad<double>(dy.data(), idx, is, 0, dt.data(), ts);
    Vec want(ts.numel(), 0.0);
    for (int k = 0; k < 5; ++k) {
      const int64_t row = idx[k] < 0 ? idx[k] + 4 : idx[k];
      for (int64_t c = 0; c < width; ++c)
        want[row * width + c] += dy[k * width + c];
    }
    expectClose(dt, want, 1e-15, 1e-15, "gather_grad width " + std::to_string(width));
  }
  // Axis 1 of [2, 3, 2].
  const Dims ts{2, 3, 2}, is{2};
  const int64_t idx[] = {2, 2};
  const float dy[] = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<float> dt(12);
  gather_grad<float>(dy, idx, is, 1, dt.data(), ts);
  EXPECT_EQ(dt, (std::vector<float>{0, 0, 0, 0, 4, 6, 0, 0, 0, 0, 12, 14}));
}

TEST(Gather, RunsOfSingleElements) {
  // im2col's shape: single elements (inner 1) of 3 rows, by indices that
  // are mostly runs of consecutive positions (copied and added whole),
  // overlapping (the gradient adds both), one of them negative, and a lone
  // index after them; then scattered indices (the loop per element).
  const Dims ts{3, 12};
  const Vec table = uniform(36, 152);
  const std::vector<std::vector<int64_t>> cases = {
      {0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, -4, -3, -2, -1, 0}, {5, 0, 7, 7}};
  for (const std::vector<int64_t> &idx : cases) {
    const int64_t ni = static_cast<int64_t>(idx.size());
    const Dims is{ni};
    auto at = [&](int64_t k) { return idx[k] < 0 ? idx[k] + 12 : idx[k]; };
    Vec y(3 * ni), want(3 * ni);
    gather<double>(table.data(), ts, idx.data(), is, 1, y.data());
    for (int64_t o = 0; o < 3; ++o)
      for (int64_t k = 0; k < ni; ++k)
        want[o * ni + k] = table[o * 12 + at(k)];
    const std::string what = "gather of " + std::to_string(ni) + " single elements";
    expectClose(y, want, 0, 0, what);
    const Vec dy = uniform(3 * ni, 153);
    Vec dt(36, 7.0), dwant(36, 0.0);
    gather_grad<double>(dy.data(), idx.data(), is, 1, dt.data(), ts);
    for (int64_t o = 0; o < 3; ++o)
      for (int64_t k = 0; k < ni; ++k)
        dwant[o * 12 + at(k)] += dy[o * ni + k];
    expectClose(dt, dwant, 0, 0, what + ", gradient");
  }
}

namespace {

/// im2col's indices, tap-major [K, P], of a kh x kw window over an h x w
/// image (stride `st`, padding 1); taps in the padding read position h * w.
std::vector<int64_t> im2colIndices(int64_t h, int64_t w, int64_t kh, int64_t kw, int64_t st,
                                   int64_t &pixels) {
  const int64_t ho = (h + 2 - kh) / st + 1, wo = (w + 2 - kw) / st + 1;
  pixels = ho * wo;
  std::vector<int64_t> idx;
  for (int64_t ky = 0; ky < kh; ++ky)
    for (int64_t kx = 0; kx < kw; ++kx)
      for (int64_t oy = 0; oy < ho; ++oy)
        for (int64_t ox = 0; ox < wo; ++ox) {
          const int64_t y = oy * st - 1 + ky, x = ox * st - 1 + kx;
          idx.push_back(y >= 0 && y < h && x >= 0 && x < w ? y * w + x : h * w);
        }
  return idx;
}

/// A convolution's shapes: N samples, C -> O channels, an h x w image, a
/// k x k window at a stride (padding 1).
struct ConvCase {
  int64_t n, c, o, h, w, k, stride;
  std::string name() const {
    return "N" + std::to_string(n) + " C" + std::to_string(c) + " O" + std::to_string(o) + " " +
           std::to_string(h) + "x" + std::to_string(w) + " k" + std::to_string(k) + " s" +
           std::to_string(stride);
  }
};

/// matmul_gather_grad against matmul then gather_grad (the two ops it
/// replaces) on the same operands.
template <class T>
void checkMatmulGatherGrad(const std::vector<T> &a, Dims as, bool ta, const std::vector<T> &b,
                           Dims bs, bool tb, Dims ys, const std::vector<int64_t> &idx, Dims is,
                           Dims ts, double tol, const std::string &what) {
  std::vector<T> prod(ys.numel()), want(ts.numel()), got(ts.numel(), T(7));
  matmul<T>(a.data(), as, ta, b.data(), bs, tb, prod.data(), ys);
  gather_grad<T>(prod.data(), idx.data(), is, ts.rank - 1, want.data(), ts);
  matmul_gather_grad<T>(a.data(), as, ta, b.data(), bs, tb, ys, idx.data(), is, got.data(), ts);
  double worst = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::fabs((double)got[i] - (double)want[i]));
    scale = std::max(scale, std::fabs((double)want[i]));
  }
  EXPECT_GT(scale, 0.0) << what;
  EXPECT_LE(worst, tol * scale) << what << ": largest difference " << worst << " of " << scale;
}

template <class T> std::vector<T> uniformOf(int64_t n, uint64_t seed) {
  const Vec v = uniform(n, seed);
  return std::vector<T>(v.begin(), v.end());
}

} // namespace

// matmul's plain float32 products through the packed GEMM (AVX-512 builds;
// elsewhere OpenBLAS, held to the same bound): every element within float32's
// bound for a sum of k products, (k + 1) * 2^-24 * (sum |a||b| + |y0|) with
// accumulate, of a float64 sum, for each transpose flag, a batch folded into
// M, and accumulate. With the packed GEMM, the first rows (a dp rank's
// samples) and the first columns (a tp rank's output features) alone give
// the same bits.
TEST(Matmul, PackedGemmWithinFloatRounding) {
  struct Case {
    int64_t nb, m, k, n;
  };
  for (const Case &c :
       {Case{1, 100, 300, 70}, Case{1, 37, 20, 600}, Case{1, 16, 16, 2048}, Case{3, 40, 50, 80}})
    for (int flags = 0; flags < 8; ++flags) {
      const bool ta = flags & 1, tb = flags & 2, acc = flags & 4;
      if (c.nb > 1 && ta)
        continue; // a transposed A's batch does not fold into M
      const int64_t rows = c.nb * c.m;
      const std::vector<float> a = uniformOf<float>(rows * c.k, 191),
                               b = uniformOf<float>(c.k * c.n, 192),
                               y0 = uniformOf<float>(rows * c.n, 193);
      const Dims as = c.nb > 1 ? Dims{c.nb, c.m, c.k} : ta ? Dims{c.k, c.m} : Dims{c.m, c.k};
      const Dims bs = tb ? Dims{c.n, c.k} : Dims{c.k, c.n};
      const Dims ys = c.nb > 1 ? Dims{c.nb, c.m, c.n} : Dims{c.m, c.n};
      std::vector<float> y = y0;
      matmul<float>(a.data(), as, ta, b.data(), bs, tb, y.data(), ys, acc);
      auto A = [&](int64_t i, int64_t kk) { return ta ? a[kk * c.m + i] : a[i * c.k + kk]; };
      auto B = [&](int64_t kk, int64_t j) { return tb ? b[j * c.k + kk] : b[kk * c.n + j]; };
      int64_t over = 0;
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < c.n; ++j) {
          double exact = acc ? y0[i * c.n + j] : 0, mag = acc ? std::fabs(exact) : 0;
          for (int64_t kk = 0; kk < c.k; ++kk) {
            const double t = double(A(i, kk)) * B(kk, j);
            exact += t;
            mag += std::fabs(t);
          }
          over += std::fabs(y[i * c.n + j] - exact) > (c.k + 1) * 0x1p-24 * mag;
        }
      const std::string what = "nb" + std::to_string(c.nb) + " m" + std::to_string(c.m) + " k" +
                               std::to_string(c.k) + " n" + std::to_string(c.n) +
                               (ta ? " transA" : "") + (tb ? " transB" : "") +
                               (acc ? " accumulate" : "");
      EXPECT_EQ(over, 0) << what << ": elements outside float32's bound";
      if (!packedMatmuls() || c.nb > 1 || ta)
        continue;
      // The first half of the rows, and the first half of the columns.
      const int64_t mh = c.m / 2, nh = c.n / 2;
      std::vector<float> yr(y0.begin(), y0.begin() + mh * c.n);
      matmul<float>(a.data(), {mh, c.k}, false, b.data(), bs, tb, yr.data(), {mh, c.n}, acc);
      EXPECT_EQ(std::memcmp(yr.data(), y.data(), yr.size() * 4), 0) << what << ": first rows";
      std::vector<float> bh(c.k * nh), yc(c.m * nh);
      for (int64_t kk = 0; kk < c.k; ++kk)
        for (int64_t j = 0; j < nh; ++j)
          (tb ? bh[j * c.k + kk] : bh[kk * nh + j]) = B(kk, j);
      for (int64_t i = 0; i < c.m; ++i)
        for (int64_t j = 0; j < nh; ++j)
          yc[i * nh + j] = y0[i * c.n + j];
      matmul<float>(a.data(), as, false, bh.data(), tb ? Dims{nh, c.k} : Dims{c.k, nh}, tb,
                    yc.data(), {c.m, nh}, acc);
      int64_t differ = 0;
      for (int64_t i = 0; i < c.m; ++i)
        differ += std::memcmp(yc.data() + i * nh, y.data() + i * c.n, nh * 4) != 0;
      EXPECT_EQ(differ, 0) << what << ": first columns, " << differ << " rows differ";
    }
}

// A convolution's input gradient, the product never whole in memory: the
// weight [O, C*K] transposed by its flag times dY [N, O, P], scattered into
// the image [N, C, H*W + 1] by im2col's indices.
TEST(MatmulGatherGrad, EqualsMatmulThenGatherGrad) {
  using Case = ConvCase;
  // Stride 1 at 32x32 (each position takes at most one pixel of each tap,
  // but the padding element: one GEMM of O * 9 terms over the output
  // gradient's windows): one block of positions per sample, then several
  // with a ragged last one (O * 9 = 360 rows: 720 positions to a 256K
  // block). Smaller images (the product scattered a block of rows at a
  // time): stride 1, a 1x1 window, stride 2 in small rows (runs average
  // under 4: the loop per element), and stride 2 in a 64x64 image (a
  // quarter of the positions hit; 12 channels of 9 taps x 1024 pixels: 7
  // channels to a block, the last ragged).
  for (const Case &c :
       {Case{3, 12, 5, 32, 32, 3, 1}, Case{2, 4, 40, 32, 32, 3, 1}, Case{2, 3, 4, 5, 6, 3, 1},
        Case{2, 4, 3, 4, 4, 1, 1}, Case{2, 3, 4, 7, 7, 3, 2}, Case{2, 12, 5, 64, 64, 3, 2}}) {
    int64_t p = 0;
    const std::vector<int64_t> idx = im2colIndices(c.h, c.w, c.k, c.k, c.stride, p);
    const int64_t taps = c.k * c.k, ck = c.c * taps, l = c.h * c.w + 1;
    const Dims as{c.o, ck}, bs{c.n, c.o, p}, ys{c.n, ck, p}, is{taps, p}, ts{c.n, c.c, l};
    const std::string what = c.name();
    // Double: the same sums to rounding (the GEMM's blocking may differ);
    // float: the same, at float's rounding over O terms.
    checkMatmulGatherGrad<double>(uniformOf<double>(c.o * ck, 161), as, true,
                                  uniformOf<double>(c.n * c.o * p, 162), bs, false, ys, idx, is, ts,
                                  1e-14, what + " (double)");
    checkMatmulGatherGrad<float>(uniformOf<float>(c.o * ck, 163), as, true,
                                 uniformOf<float>(c.n * c.o * p, 164), bs, false, ys, idx, is, ts,
                                 1e-5, what + " (float)");
  }
  // Grouped: A [G, Cg*K, Og] (batch G, broadcast over the samples) times dY
  // [N, G, Og, P]; A stored as is, B transposed by its flag; both ways.
  for (int64_t side : {int64_t(6), int64_t(32)}) {
    int64_t p = 0;
    const std::vector<int64_t> idx = im2colIndices(side, side, 3, 3, 1, p);
    const int64_t g = 2, cg = 3, og = 4, n = 3, taps = 9;
    checkMatmulGatherGrad<double>(
        uniformOf<double>(g * cg * taps * og, 165), {g, cg * taps, og}, false,
        uniformOf<double>(n * g * p * og, 166), {n, g, p, og}, true, {n, g, cg * taps, p}, idx,
        {taps, p}, {n, g * cg, side * side + 1}, 1e-14, "grouped " + std::to_string(side));
    // Float, dY as stored (the packed GEMM's case where the runtime has it):
    // the weight per group broadcast over the samples.
    checkMatmulGatherGrad<float>(uniformOf<float>(g * cg * taps * og, 167), {g, cg * taps, og},
                                 false, uniformOf<float>(n * g * og * p, 168), {n, g, og, p}, false,
                                 {n, g, cg * taps, p}, idx, {taps, p}, {n, g * cg, side * side + 1},
                                 1e-5, "grouped float " + std::to_string(side));
  }
}

TEST(KernelErrors, MatmulGatherGradShapesAreChecked) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::vector<float> a(6, 1.f), b(6, 1.f);
  std::vector<float> t(8);
  const int64_t idx[] = {0, 1, 2, 3, 0, 1};
  // A [3 x 2] x [2 x 3] product is 3 rows of 3, not rows of 4 indices.
  EXPECT_EXIT(matmul_gather_grad<float>(a.data(), {3, 2}, false, b.data(), {2, 3}, false, {3, 3},
                                        idx, {4}, t.data(), {2, 4}),
              testing::ExitedWithCode(1), "carve: error: .*matmul_gather_grad: .*not 2 rows of 4");
  // Index 5 in rows of 4.
  const int64_t bad[] = {0, 1, 2, 5, 0, 1, 2, 3, 0};
  EXPECT_EXIT(matmul_gather_grad<float>(a.data(), {3, 2}, false, b.data(), {2, 3}, false, {3, 3},
                                        bad, {9}, t.data(), {1, 4}),
              testing::ExitedWithCode(1), "carve: error: .*index 5 is out of range");
}

namespace {

/// matmul_gathered against gather then matmul (the two ops it replaces) on
/// the same operands: bitwise, as it runs matmul's GEMMs on the same values.
template <class T>
void checkMatmulGathered(const std::vector<T> &a, Dims as, bool ta, const std::vector<T> &table,
                         Dims ts, const std::vector<int64_t> &idx, Dims is, Dims bs, bool tb,
                         Dims ys, const std::string &what) {
  std::vector<T> windows(bs.numel()), want(ys.numel()), got(ys.numel(), T(7));
  gather<T>(table.data(), ts, idx.data(), is, ts.rank - 1, windows.data());
  matmul<T>(a.data(), as, ta, windows.data(), bs, tb, want.data(), ys);
  matmul_gathered<T>(a.data(), as, ta, table.data(), ts, idx.data(), is, bs, tb, got.data(), ys);
  ASSERT_EQ(got.size(), want.size());
  int64_t differ = 0;
  for (size_t i = 0; i < want.size(); ++i)
    differ += std::memcmp(&got[i], &want[i], sizeof(T)) != 0;
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << want.size() << " elements differ";
}

} // namespace

// A convolution's forward (the weight [O, C*K] times the windows [N, C*K, P])
// and weight gradient (dY [N, O, P] times the windows transposed by the
// flag), the windows never whole in memory: the same bits as gather then
// matmul. The sizes take each of matmul's ways through a batch: small GEMMs
// spread over the threads, at least 4 large ones per thread, a few large
// ones one at a time (the gather then split over the threads), and one
// operand matrix (N = 1: the batch folds into M, or one GEMM).
TEST(MatmulGathered, BitwiseMatmulOfTheGather) {
  // The forward's own packed GEMM (next test) off: this is the BLAS path.
  setPackedGemm(false);
  using Case = ConvCase;
  for (const Case &c :
       {Case{4, 3, 8, 8, 8, 3, 1}, Case{16, 16, 32, 32, 32, 3, 1}, Case{2, 16, 32, 32, 32, 3, 1},
        Case{1, 8, 16, 16, 16, 3, 1}, Case{3, 3, 4, 7, 7, 3, 2}, Case{2, 4, 3, 4, 4, 1, 1}}) {
    int64_t p = 0;
    const std::vector<int64_t> idx = im2colIndices(c.h, c.w, c.k, c.k, c.stride, p);
    const int64_t taps = c.k * c.k, ck = c.c * taps, l = c.h * c.w + 1;
    const Dims ts{c.n, c.c, l}, is{taps, p}, bs{c.n, ck, p};
    const std::string what = c.name();
    const std::vector<float> table = uniformOf<float>(c.n * c.c * l, 171);
    checkMatmulGathered<float>(uniformOf<float>(c.o * ck, 172), {c.o, ck}, false, table, ts, idx,
                               is, bs, false, {c.n, c.o, p}, what + " forward");
    checkMatmulGathered<float>(uniformOf<float>(c.n * c.o * p, 173), {c.n, c.o, p}, false, table,
                               ts, idx, is, bs, true, {c.n, c.o, ck}, what + " weight gradient");
    checkMatmulGathered<double>(uniformOf<double>(c.o * ck, 174), {c.o, ck}, false,
                                uniformOf<double>(c.n * c.c * l, 175), ts, idx, is, bs, false,
                                {c.n, c.o, p}, what + " forward (double)");
  }
  // Grouped: the weight [G, Og, Cg*K] broadcast over the samples' windows
  // [N, G, Cg*K, P].
  int64_t p = 0;
  const std::vector<int64_t> idx = im2colIndices(12, 12, 3, 3, 1, p);
  const int64_t g = 2, cg = 3, og = 4, n = 5, taps = 9, l = 12 * 12 + 1;
  checkMatmulGathered<float>(uniformOf<float>(g * og * cg * taps, 176), {g, og, cg * taps}, false,
                             uniformOf<float>(n * g * cg * l, 177), {n, g * cg, l}, idx, {taps, p},
                             {n, g, cg * taps, p}, false, {n, g, og, p}, "grouped");
  // A bf16 plan rounds the operands: the table's values, then gathered.
  setPrecision(Precision::BF16);
  checkMatmulGathered<float>(uniformOf<float>(og * cg * taps, 178), {og, cg * taps}, false,
                             uniformOf<float>(n * cg * l, 179), {n, cg, l}, idx, {taps, p},
                             {n, cg * taps, p}, false, {n, og, p}, "bf16");
  setPrecision(Precision::F32);
  setPackedGemm(true);
}

// A convolution's forward through carve's own packed GEMM (packed_gemm.h):
// the windows packed from the image, the sums in another order than BLAS's.
// Each element is held to the error bound of a float32 sum of k products,
// |y - exact| <= k * 2^-24 * sum |w| |x| (exact: the same sum in double),
// and must be bitwise the same whatever the batch or the output channels
// (how a plan splits them over ranks). The shapes cover partial tiles of
// rows and columns, more terms than one block (k > 256), strided windows
// (lanes packed one by one), a 1x1 kernel and panels patched at the image's
// edges.
TEST(MatmulGathered, DirectConvolutionWithinFloatRounding) {
  if (!packedGemm())
    GTEST_SKIP() << "this runtime was built without AVX2/FMA or AVX-512: no packed GEMM";
  using Case = ConvCase;
  for (const Case &c :
       {Case{3, 3, 5, 8, 8, 3, 1}, Case{2, 40, 13, 10, 10, 3, 1}, Case{2, 16, 32, 32, 32, 3, 1},
        Case{3, 8, 7, 20, 20, 3, 2}, Case{2, 300, 9, 9, 9, 1, 1}, Case{4, 30, 70, 16, 16, 3, 1}}) {
    int64_t p = 0;
    const std::vector<int64_t> idx = im2colIndices(c.h, c.w, c.k, c.k, c.stride, p);
    const int64_t taps = c.k * c.k, ck = c.c * taps, l = c.h * c.w + 1;
    const Dims ts{c.n, c.c, l}, is{taps, p}, bs{c.n, ck, p}, ys{c.n, c.o, p};
    const std::string what = c.name();
    const std::vector<float> a = uniformOf<float>(c.o * ck, 181),
                             table = uniformOf<float>(c.n * c.c * l, 182);
    std::vector<float> got(ys.numel(), 7.f), windows(bs.numel());
    matmul_gathered<float>(a.data(), {c.o, ck}, false, table.data(), ts, idx.data(), is, bs, false,
                           got.data(), ys);
    gather<float>(table.data(), ts, idx.data(), is, 2, windows.data());
    int64_t over = 0;
    for (int64_t s = 0; s < c.n; ++s)
      for (int64_t o = 0; o < c.o; ++o)
        for (int64_t q = 0; q < p; ++q) {
          double exact = 0, mag = 0;
          for (int64_t kk = 0; kk < ck; ++kk) {
            const double t = double(a[o * ck + kk]) * windows[(s * ck + kk) * p + q];
            exact += t;
            mag += std::fabs(t);
          }
          over += std::fabs(got[(s * c.o + o) * p + q] - exact) > ck * 0x1p-24 * mag;
        }
    EXPECT_EQ(over, 0) << what << ": elements outside float32's bound of " << ck << " terms";
    // One sample alone, and the first half of the output channels (a dp
    // rank's batch, a tp rank's weight rows): the same bits.
    const int64_t oh = (c.o + 1) / 2;
    std::vector<float> one(c.o * p), half(c.n * oh * p);
    matmul_gathered<float>(a.data(), {c.o, ck}, false, table.data() + (c.n - 1) * c.c * l,
                           {1, c.c, l}, idx.data(), is, {1, ck, p}, false, one.data(), {1, c.o, p});
    EXPECT_EQ(std::memcmp(one.data(), got.data() + (c.n - 1) * c.o * p, one.size() * 4), 0)
        << what << ": the last sample alone differs";
    matmul_gathered<float>(a.data(), {oh, ck}, false, table.data(), ts, idx.data(), is, bs, false,
                           half.data(), {c.n, oh, p});
    int64_t differ = 0;
    for (int64_t s = 0; s < c.n; ++s)
      differ += std::memcmp(half.data() + s * oh * p, got.data() + s * c.o * p, oh * p * 4) != 0;
    EXPECT_EQ(differ, 0) << what << ": " << oh << " of " << c.o << " output channels differ";

    // The weight gradient of each sample: dY [N, O, P] times the windows
    // transposed, p terms a sum.
    const std::vector<float> dy = uniformOf<float>(c.n * c.o * p, 183);
    std::vector<float> dw(c.n * c.o * ck, 7.f);
    matmul_gathered<float>(dy.data(), {c.n, c.o, p}, false, table.data(), ts, idx.data(), is, bs,
                           true, dw.data(), {c.n, c.o, ck});
    over = 0;
    for (int64_t s = 0; s < c.n; ++s)
      for (int64_t o = 0; o < c.o; ++o)
        for (int64_t kk = 0; kk < ck; ++kk) {
          double exact = 0, mag = 0;
          for (int64_t q = 0; q < p; ++q) {
            const double t = double(dy[(s * c.o + o) * p + q]) * windows[(s * ck + kk) * p + q];
            exact += t;
            mag += std::fabs(t);
          }
          over += std::fabs(dw[(s * c.o + o) * ck + kk] - exact) > p * 0x1p-24 * mag;
        }
    EXPECT_EQ(over, 0) << what << ": weight gradient elements outside float32's bound of " << p
                       << " terms";
    std::vector<float> dyHalf(c.n * oh * p), dwHalf(c.n * oh * ck);
    for (int64_t s = 0; s < c.n; ++s)
      std::copy_n(dy.data() + s * c.o * p, oh * p, dyHalf.data() + s * oh * p);
    matmul_gathered<float>(dyHalf.data(), {c.n, oh, p}, false, table.data(), ts, idx.data(), is, bs,
                           true, dwHalf.data(), {c.n, oh, ck});
    differ = 0;
    for (int64_t s = 0; s < c.n; ++s)
      differ +=
          std::memcmp(dwHalf.data() + s * oh * ck, dw.data() + s * c.o * ck, oh * ck * 4) != 0;
    EXPECT_EQ(differ, 0) << what << ": the weight gradient of " << oh << " of " << c.o
                         << " output channels differs";
    std::vector<float> dwOne(c.o * ck);
    matmul_gathered<float>(dy.data() + (c.n - 1) * c.o * p, {1, c.o, p}, false,
                           table.data() + (c.n - 1) * c.c * l, {1, c.c, l}, idx.data(), is,
                           {1, ck, p}, true, dwOne.data(), {1, c.o, ck});
    EXPECT_EQ(std::memcmp(dwOne.data(), dw.data() + (c.n - 1) * c.o * ck, dwOne.size() * 4), 0)
        << what << ": the weight gradient of the last sample alone differs";
  }
  // A bf16 plan rounds the operands first: the same bits as the packed GEMM
  // of operands rounded beforehand.
  int64_t p = 0;
  const std::vector<int64_t> idx = im2colIndices(12, 12, 3, 3, 1, p);
  const int64_t ck = 4 * 9, l = 12 * 12 + 1;
  std::vector<float> a = uniformOf<float>(6 * ck, 184), table = uniformOf<float>(2 * 4 * l, 185);
  std::vector<float> y16(2 * 6 * p), y32(y16.size());
  setPrecision(Precision::BF16);
  matmul_gathered<float>(a.data(), {6, ck}, false, table.data(), {2, 4, l}, idx.data(), {9, p},
                         {2, ck, p}, false, y16.data(), {2, 6, p});
  setPrecision(Precision::F32);
  for (float &v : a)
    v = roundToBf16(v);
  for (float &v : table)
    v = roundToBf16(v);
  matmul_gathered<float>(a.data(), {6, ck}, false, table.data(), {2, 4, l}, idx.data(), {9, p},
                         {2, ck, p}, false, y32.data(), {2, 6, p});
  EXPECT_EQ(std::memcmp(y16.data(), y32.data(), y16.size() * 4), 0) << "bf16";
}

TEST(KernelErrors, MatmulGatheredShapesAreChecked) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::vector<float> a(6, 1.f), t(8, 1.f);
  std::vector<float> y(9);
  const int64_t idx[] = {0, 1, 2, 3, 0, 1};
  // 2 table rows of 3 indices are 6 elements, not the 8 of a [2 x 4] operand.
  EXPECT_EXIT(matmul_gathered<float>(a.data(), {3, 2}, false, t.data(), {2, 4}, idx, {3}, {2, 4},
                                     false, y.data(), {3, 4}),
              testing::ExitedWithCode(1),
              "carve: error: .*matmul_gathered: 2 table rows of 3 indices do not make");
  // Index 5 in rows of 4.
  const int64_t bad[] = {0, 1, 5};
  EXPECT_EXIT(matmul_gathered<float>(a.data(), {3, 2}, false, t.data(), {2, 4}, bad, {3}, {2, 3},
                                     false, y.data(), {3, 3}),
              testing::ExitedWithCode(1), "carve: error: .*index 5 is out of range");
}

TEST(Expand, Broadcasts) {
  const Dims xs{3, 1}, ys{2, 3, 4};
  const double x[] = {1, 2, 3};
  Vec y(24);
  expand<double>(x, xs, y.data(), ys);
  Vec want(24);
  for (int i = 0; i < 24; ++i)
    want[i] = x[source(i, ys, xs)];
  expectClose(y, want, 0, 0, "expand [3,1] -> [2,3,4]");
  const uint8_t one = 1;
  std::vector<uint8_t> yb(5);
  expand<uint8_t>(&one, {}, yb.data(), {5});
  EXPECT_EQ(yb, (std::vector<uint8_t>(5, 1)));
  std::vector<float> big(400 * 300), row(300);
  for (int i = 0; i < 300; ++i)
    row[i] = static_cast<float>(i);
  expand<float>(row.data(), {300}, big.data(), {400, 300});
  EXPECT_EQ(big[399 * 300 + 123], 123.f);
}

//===--- Errors and the program contract -----------------------------------===//

// The kernels' OpenMP team is alive by now: the death tests re-run the binary
// rather than fork a threaded process.
TEST(KernelErrors, GatherOutOfRangeIsFatal) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const float table[] = {1, 2};
  const int64_t idx[] = {2};
  float y;
  EXPECT_EXIT(gather<float>(table, {2}, idx, {1}, 0, &y), testing::ExitedWithCode(1),
              "carve: error: .*gather: index 2 is out of range for axis 0 of size 2");
}

TEST(KernelErrors, CrossEntropyBadTargetIsFatal) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const float x[] = {1, 2};
  const int64_t t[] = {5};
  float y;
  EXPECT_EXIT(cross_entropy<float>(x, {1, 2}, t, 0, false, -100, &y), testing::ExitedWithCode(1),
              "carve: error: .*target 5 .*outside \\[0, 2\\)");
}

TEST(KernelErrors, FatalCallsTheHook) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        fatalHook = [](int code) { std::_Exit(40 + code); };
        fatal("boom %d", 7);
      },
      testing::ExitedWithCode(41), "carve: error: .*boom 7");
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtypeSize(DType::F32), 4);
  EXPECT_EQ(dtypeSize(DType::F64), 8);
  EXPECT_EQ(dtypeSize(DType::I64), 8);
  EXPECT_EQ(dtypeSize(DType::I32), 4);
  EXPECT_EQ(dtypeSize(DType::Bool), 1);
  EXPECT_STREQ(dtypeName(DType::F32), "F32");
  EXPECT_STREQ(dtypeName(DType::F64), "F64");
  EXPECT_STREQ(dtypeName(DType::I64), "I64");
  EXPECT_STREQ(dtypeName(DType::I32), "I32");
  EXPECT_STREQ(dtypeName(DType::Bool), "BOOL");
}

} // namespace
