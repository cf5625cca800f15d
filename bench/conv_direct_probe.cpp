// The CPU convolution's next step, measured before it is built: a 3x3,
// stride-1, padding-1 convolution's forward (NCHW, float32) done two ways on
// the same inputs, against OpenBLAS's sgemm rate at 2048^3.
//
//   (a) what carve does today: im2col (the windows [N, C*9, H*W], tap-major)
//       then one OpenBLAS sgemm per sample, W[O, C*9] x windows[n];
//   (b) a direct packed GEMM: the windows packed straight from the input into
//       K x 32 panels that stay in cache, an AVX-512 12 x 32 microkernel, the
//       output written in place (no windows tensor, no OpenBLAS packing copy,
//       no beta pass zeroing C).
//
// Not part of the build (it needs AVX-512; carve's kernels must not). By hand:
//
//   g++ -O3 -march=native -fopenmp -ffp-contract=off bench/conv_direct_probe.cpp \
//     -I/usr/include/x86_64-linux-gnu/openblas-openmp \
//     -L/usr/lib/x86_64-linux-gnu/openblas-openmp -lopenblas \
//     -Wl,-rpath,/usr/lib/x86_64-linux-gnu/openblas-openmp -o /tmp/conv_direct_probe
//   OMP_NUM_THREADS=2 /tmp/conv_direct_probe
//
// Prints, per shape (VGG's and ResNet-18's at 32x32 images, batch 32), both
// times, GFLOP/s and the largest difference between the two outputs (only
// summation order differs). docs/performance.md has the numbers.
#include <cblas.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifndef __AVX512F__
int main() {
  std::fprintf(stderr, "conv_direct_probe: built without AVX-512 (-march=native on a machine "
                       "without it); nothing measured\n");
  return 1;
}
#else

using Clock = std::chrono::steady_clock;

struct Conv {
  int N, C, O, H, W;
};

// im2col windows, tap-major: cols[n][c*9+t][p].
static void im2col(const float *x, const Conv &s, float *cols, int n) {
  const int P = s.H * s.W;
  for (int c = 0; c < s.C; ++c)
    for (int t = 0; t < 9; ++t) {
      const int dh = t / 3 - 1, dw = t % 3 - 1;
      float *row = cols + ((size_t)(c * 9 + t)) * P;
      const float *xc = x + ((size_t)n * s.C + c) * P;
      for (int h = 0; h < s.H; ++h) {
        const int ih = h + dh;
        float *r = row + h * s.W;
        if (ih < 0 || ih >= s.H) {
          std::memset(r, 0, sizeof(float) * s.W);
          continue;
        }
        for (int w = 0; w < s.W; ++w) {
          const int iw = w + dw;
          r[w] = (iw < 0 || iw >= s.W) ? 0.f : xc[ih * s.W + iw];
        }
      }
    }
}

static void convIm2col(const float *x, const float *wt, const Conv &s, float *y,
                       std::vector<float> &cols) {
  const int P = s.H * s.W, K = s.C * 9;
  // Whole samples per thread, as carve's batched matmul runs a batch of 4 or
  // more matrices per thread (OpenBLAS runs on the calling thread inside an
  // OpenMP team); the windows tensor is materialized, as carve's gather does.
#pragma omp parallel for schedule(static)
  for (int n = 0; n < s.N; ++n) {
    im2col(x, s, cols.data() + (size_t)n * K * P, n);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s.O, P, K, 1.f, wt, K,
                cols.data() + (size_t)n * K * P, P, 0.f, y + (size_t)n * s.O * P, P);
  }
}

constexpr int MR = 12, NR = 32;

// A packed: [ceil(O/MR)][K][MR], zero-padded rows.
static std::vector<float> packA(const float *wt, int O, int K) {
  const int ob = (O + MR - 1) / MR;
  std::vector<float> a((size_t)ob * K * MR, 0.f);
  for (int b = 0; b < ob; ++b)
    for (int k = 0; k < K; ++k)
      for (int i = 0; i < MR; ++i) {
        const int o = b * MR + i;
        a[((size_t)b * K + k) * MR + i] = o < O ? wt[(size_t)o * K + k] : 0.f;
      }
  return a;
}

// Panel [K][NR] of output pixels p0..p0+NR-1 of one sample, the windows packed
// from x directly: for each (channel, tap) row, runs of pixels within an output
// row, zeros for padding and past the last pixel.
static void packB(const float *xn, const Conv &s, int p0, float *panel) {
  const int P = s.H * s.W;
  for (int c = 0; c < s.C; ++c) {
    const float *xc = xn + (size_t)c * P;
    for (int t = 0; t < 9; ++t) {
      const int dh = t / 3 - 1, dw = t % 3 - 1;
      float *dst = panel + (size_t)(c * 9 + t) * NR;
      int j = 0;
      while (j < NR) {
        const int p = p0 + j;
        if (p >= P) {
          dst[j++] = 0.f;
          continue;
        }
        const int h = p / s.W, w = p % s.W, ih = h + dh;
        const int run = std::min(NR - j, s.W - w); // pixels left in this output row
        if (ih < 0 || ih >= s.H) {
          std::memset(dst + j, 0, sizeof(float) * run);
        } else {
          const float *src = xc + ih * s.W;
          for (int q = 0; q < run; ++q) {
            const int iw = w + q + dw;
            dst[j + q] = (iw < 0 || iw >= s.W) ? 0.f : src[iw];
          }
        }
        j += run;
      }
    }
  }
}

// C[MR x NR] = A panel [K][MR] x B panel [K][NR], stored to y rows (ldy) for
// rows < mr and columns < nr.
static void micro(const float *a, const float *b, int K, float *y, int ldy, int mr, int nr) {
  __m512 c[MR][2];
  for (int i = 0; i < MR; ++i)
    c[i][0] = c[i][1] = _mm512_setzero_ps();
  for (int k = 0; k < K; ++k) {
    const __m512 b0 = _mm512_loadu_ps(b + k * NR), b1 = _mm512_loadu_ps(b + k * NR + 16);
    const float *ak = a + k * MR;
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512 ai = _mm512_set1_ps(ak[i]);
      c[i][0] = _mm512_fmadd_ps(ai, b0, c[i][0]);
      c[i][1] = _mm512_fmadd_ps(ai, b1, c[i][1]);
    }
  }
  if (nr == NR) {
    for (int i = 0; i < mr; ++i) {
      _mm512_storeu_ps(y + (size_t)i * ldy, c[i][0]);
      _mm512_storeu_ps(y + (size_t)i * ldy + 16, c[i][1]);
    }
  } else {
    alignas(64) float tmp[NR];
    for (int i = 0; i < mr; ++i) {
      _mm512_store_ps(tmp, c[i][0]);
      _mm512_store_ps(tmp + 16, c[i][1]);
      std::memcpy(y + (size_t)i * ldy, tmp, sizeof(float) * nr);
    }
  }
}

static void convDirect(const float *x, const std::vector<float> &ap, const Conv &s, float *y) {
  const int P = s.H * s.W, K = s.C * 9, ob = (s.O + MR - 1) / MR, pb = (P + NR - 1) / NR;
#pragma omp parallel
  {
    std::vector<float> panel((size_t)K * NR + 16);
#pragma omp for schedule(static)
    for (int job = 0; job < s.N * pb; ++job) {
      const int n = job / pb, p0 = (job % pb) * NR, nr = std::min(NR, P - p0);
      packB(x + (size_t)n * s.C * P, s, p0, panel.data());
      for (int b = 0; b < ob; ++b) {
        const int mr = std::min(MR, s.O - b * MR);
        micro(ap.data() + (size_t)b * K * MR, panel.data(), K,
              y + ((size_t)n * s.O + b * MR) * P + p0, P, mr, nr);
      }
    }
  }
}

int main() {
  const Conv shapes[] = {{32, 32, 32, 32, 32}, {32, 32, 64, 16, 16}, {32, 64, 64, 16, 16},
                         {32, 64, 128, 8, 8}, {32, 64, 64, 8, 8}, {32, 128, 128, 4, 4}};
  // sgemm peak: 2048^3.
  {
    const int n = 2048;
    std::vector<float> a((size_t)n * n, 1.f), b((size_t)n * n, 1.f), c((size_t)n * n);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.f, a.data(), n, b.data(),
                n, 0.f, c.data(), n);
    double best = 1e9;
    for (int r = 0; r < 5; ++r) {
      auto t = Clock::now();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.f, a.data(), n,
                  b.data(), n, 0.f, c.data(), n);
      best = std::min(best, std::chrono::duration<double>(Clock::now() - t).count());
    }
    std::printf("sgemm 2048^3: %.1f GFLOP/s (%d threads)\n", 2.0 * n * n * n / best / 1e9,
                omp_get_max_threads());
  }
  for (const Conv &s : shapes) {
    const int P = s.H * s.W, K = s.C * 9;
    std::vector<float> x((size_t)s.N * s.C * P), wt((size_t)s.O * K);
    for (size_t i = 0; i < x.size(); ++i)
      x[i] = (float)((i * 2654435761u) % 1000) / 500.f - 1.f;
    for (size_t i = 0; i < wt.size(); ++i)
      wt[i] = (float)((i * 40503u) % 1000) / 5000.f - 0.1f;
    std::vector<float> y1((size_t)s.N * s.O * P), y2(y1.size()), cols((size_t)s.N * K * P);
    const std::vector<float> ap = packA(wt.data(), s.O, K);
    const double flops = 2.0 * s.N * s.O * P * K;
    auto bench = [&](auto fn) {
      fn();
      double best = 1e9;
      for (int r = 0; r < 7; ++r) {
        auto t = Clock::now();
        fn();
        best = std::min(best, std::chrono::duration<double>(Clock::now() - t).count());
      }
      return best;
    };
    const double t1 = bench([&] { convIm2col(x.data(), wt.data(), s, y1.data(), cols); });
    const double t2 = bench([&] { convDirect(x.data(), ap, s, y2.data()); });
    double worst = 0, scale = 0;
    for (size_t i = 0; i < y1.size(); ++i) {
      worst = std::max(worst, (double)std::fabs(y1[i] - y2[i]));
      scale = std::max(scale, (double)std::fabs(y1[i]));
    }
    std::printf("N%d C%d O%d %dx%d: im2col+sgemm %.2f ms %.1f GFLOP/s | direct %.2f ms %.1f "
                "GFLOP/s | %.2fx | max diff %.2e of %.2e\n",
                s.N, s.C, s.O, s.H, s.W, t1 * 1e3, flops / t1 / 1e9, t2 * 1e3, flops / t2 / 1e9,
                t1 / t2, worst, scale);
  }
}

#endif // __AVX512F__
