// A convolution's forward, weight gradient and input gradient on the CPU, the
// two ways matmul_gathered and matmul_gather_grad can run them, on the same
// inputs:
//
//   (a) BLAS (setPackedGemm(false)): each sample's windows (or dY's,
//       or a block of the windows' gradient) gathered into a per-thread
//       buffer, then OpenBLAS's sgemm on it;
//   (b) carve's packed GEMM (the default where the runtime has AVX2 + FMA or
//       AVX-512): the windows packed from the image (or dY) straight into the
//       microkernel's panels (runtime/src/packed_gemm.h).
//
// 3x3 windows, stride 1, padding 1, batch 32, VGG's and ResNet-18's layer
// shapes at 32x32 images. Not part of the build (it links the runtime built
// by `make build`). By hand:
//
//   g++ -O2 -march=native -std=c++17 -fopenmp bench/conv_packed_probe.cpp -Iruntime/include \
//     build/lib/libcarve_rt_kernels.a \
//     -L/usr/lib/x86_64-linux-gnu/openblas-openmp -lopenblas \
//     -Wl,-rpath,/usr/lib/x86_64-linux-gnu/openblas-openmp -o /tmp/conv_packed_probe
//   OMP_NUM_THREADS=2 /tmp/conv_packed_probe
//
// Prints the cores' FMA limit (measured: chains of FMAs in registers on every
// thread) and OpenBLAS's sgemm rate at 2048^3, then per shape and op both times (best of 9, the two
// alternating), GFLOP/s, the ratio and the largest difference between the
// two results relative to the largest element (summation order only;
// docs/performance.md has the numbers).
#include "carve/rt/kernels.h"

#include <cblas.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

using namespace carve::rt;
using Clock = std::chrono::steady_clock;

namespace {

double seconds(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double sgemmPeak() {
  const int n = 2048;
  std::vector<float> a((size_t)n * n, 1.f), b((size_t)n * n, 1.f), c((size_t)n * n);
  double best = 1e9;
  for (int r = 0; r < 6; ++r) {
    const auto t = Clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.f, a.data(), n, b.data(), n,
                0.f, c.data(), n);
    if (r > 0)
      best = std::min(best, seconds(t));
  }
  return 2.0 * n * n * n / best / 1e9;
}

/// The cores' FMA limit: independent chains of fused multiply-adds in
/// registers on every thread, at the vectors the runtime's microkernel uses
/// (the probe is built -march=native, as the runtime is).
#if defined(__AVX512F__)
using V = __m512;
constexpr int kLanes = 16, kChains = 24;
const char *kIsa = "AVX-512";
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V splat(float x) { return _mm512_set1_ps(x); }
#else
using V = __m256;
constexpr int kLanes = 8, kChains = 12;
const char *kIsa = "AVX2";
inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V splat(float x) { return _mm256_set1_ps(x); }
#endif

double fmaLimit() {
  const int64_t iters = 20000000;
  double best = 1e9;
  for (int r = 0; r < 3; ++r) {
    const auto t = Clock::now();
    float sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
      const V a = splat(0.999f), b = splat(1e-6f);
      V acc[kChains];
#pragma GCC unroll 32
      for (int i = 0; i < kChains; ++i) // distinct chains, or the compiler merges them
        acc[i] = splat(1e-3f * (i + 1) + 1e-4f * omp_get_thread_num());
      for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 32
        for (int i = 0; i < kChains; ++i)
          acc[i] = fma(acc[i], a, b);
      }
      float out[kLanes];
#pragma GCC unroll 32
      for (int i = 0; i < kChains; ++i) {
        std::memcpy(out, &acc[i], sizeof out);
        for (int l = 0; l < kLanes; ++l)
          sink += out[l];
      }
    }
    best = std::min(best, seconds(t));
    if (sink == 42.f)
      std::printf(" ");
  }
  return 2.0 * iters * kChains * kLanes * omp_get_max_threads() / best / 1e9;
}

} // namespace

int main() {
  if (!packedGemm()) {
    std::fprintf(stderr, "conv_packed_probe: this runtime has no packed GEMM (built without "
                         "AVX2/FMA or AVX-512); nothing to compare\n");
    return 1;
  }
  struct Shape {
    int64_t n, c, o, h, w;
  };
  const Shape shapes[] = {{32, 3, 32, 32, 32},  {32, 32, 32, 32, 32}, {32, 32, 64, 16, 16},
                          {32, 64, 64, 32, 32}, {32, 64, 64, 16, 16}, {32, 64, 128, 8, 8},
                          {32, 128, 128, 8, 8}};
  const double peak = sgemmPeak();
  const double fma = fmaLimit();
  std::printf("threads: %d; FMA limit (%s, measured): %.1f GFLOP/s; OpenBLAS sgemm 2048^3: %.1f "
              "GFLOP/s (%.0f%% of it)\n",
              omp_get_max_threads(), kIsa, fma, peak, 100 * peak / fma);
  std::printf("(percent columns: of the FMA limit)\n");
  for (const Shape &s : shapes) {
    const int64_t p = s.h * s.w, taps = 9, ck = s.c * taps, l = p + 1;
    std::vector<int64_t> idx;
    for (int64_t ky = 0; ky < 3; ++ky)
      for (int64_t kx = 0; kx < 3; ++kx)
        for (int64_t oy = 0; oy < s.h; ++oy)
          for (int64_t ox = 0; ox < s.w; ++ox) {
            const int64_t y = oy - 1 + ky, x = ox - 1 + kx;
            idx.push_back(y >= 0 && y < s.h && x >= 0 && x < s.w ? y * s.w + x : p);
          }
    std::vector<float> wt(s.o * ck), table(s.n * s.c * l), dy(s.n * s.o * p);
    for (size_t i = 0; i < wt.size(); ++i)
      wt[i] = (float)((i * 40503u) % 1000) / 5000.f - 0.1f;
    for (size_t i = 0; i < table.size(); ++i)
      table[i] = i % l == (size_t)p ? 0.f : (float)((i * 2654435761u) % 1000) / 500.f - 1.f;
    for (size_t i = 0; i < dy.size(); ++i)
      dy[i] = (float)((i * 2246822519u) % 1000) / 500.f - 1.f;
    const Dims ts{s.n, s.c, l}, is{taps, p}, bs{s.n, ck, p};
    const double flops = 2.0 * s.n * s.o * p * ck;
    for (const int op : {0, 1, 2}) {
      if (op == 2 && s.c == 3)
        continue; // an input image has no gradient
      const bool grad = op == 1;
      const Dims as = grad ? Dims{s.n, s.o, p} : Dims{s.o, ck};
      const Dims ys = op == 2 ? ts : grad ? Dims{s.n, s.o, ck} : Dims{s.n, s.o, p};
      std::vector<float> ya(ys.numel()), yb(ys.numel());
      auto run = [&](bool direct, std::vector<float> &y) {
        setPackedGemm(direct);
        const auto t = Clock::now();
        if (op == 2)
          matmul_gather_grad<float>(wt.data(), {s.o, ck}, true, dy.data(), {s.n, s.o, p}, false, bs,
                                    idx.data(), is, y.data(), ts);
        else
          matmul_gathered<float>(grad ? dy.data() : wt.data(), as, false, table.data(), ts,
                                 idx.data(), is, bs, grad, y.data(), ys);
        return seconds(t);
      };
      run(false, ya);
      run(true, yb);
      double ta = 1e9, tb = 1e9;
      for (int r = 0; r < 9; ++r) {
        ta = std::min(ta, run(false, ya));
        tb = std::min(tb, run(true, yb));
      }
      double worst = 0, scale = 0;
      for (size_t i = 0; i < ya.size(); ++i) {
        worst = std::max(worst, (double)std::fabs(ya[i] - yb[i]));
        scale = std::max(scale, (double)std::fabs(ya[i]));
      }
      std::printf("C%-3lld -> O%-3lld %2lldx%-2lld %-15s BLAS %6.2f ms %6.1f GFLOP/s (%3.0f%%) | "
                  "packed %6.2f ms %6.1f GFLOP/s (%3.0f%%) | %.2fx | max diff %.1e of %.1e\n",
                  (long long)s.c, (long long)s.o, (long long)s.h, (long long)s.w,
                  op == 2 ? "input gradient"
                  : grad  ? "weight gradient"
                          : "forward",
                  ta * 1e3, flops / ta / 1e9, 100 * flops / ta / 1e9 / fma, tb * 1e3,
                  flops / tb / 1e9, 100 * flops / tb / 1e9 / fma, ta / tb, worst, scale);
    }
  }
  setPackedGemm(true);
}
