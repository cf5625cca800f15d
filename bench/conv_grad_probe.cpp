// A convolution's input gradient on the CPU two ways, on the same inputs:
//
//   (a) the two kernels the lowering's ops map to: matmul (W^T [C*9, O] x
//       dY [N, O, P] -> the windows' gradient [N, C*9, P], written whole)
//       then gather_grad (summed back into the image [N, C, H*W + 1]);
//   (b) matmul_gather_grad, what the CPU target runs since carve-fold-
//       transposes marks the pair "scatter": the product a block of rows at a
//       time, added into the image while the block is in cache.
//
// 3x3 windows, stride 1, padding 1, as VGG's and ResNet-18's convolutions
// whose input gradient goes through it, at 32x32 images, batch 32. Not part
// of the build (it links the runtime built by `make build`). By hand:
//
//   g++ -O2 -std=c++17 -fopenmp bench/conv_grad_probe.cpp -Iruntime/include \
//     build/lib/libcarve_rt_kernels.a \
//     -L/usr/lib/x86_64-linux-gnu/openblas-openmp -lopenblas \
//     -Wl,-rpath,/usr/lib/x86_64-linux-gnu/openblas-openmp -o /tmp/conv_grad_probe
//   OMP_NUM_THREADS=2 /tmp/conv_grad_probe
//
// Prints, per shape, both times (best of 9, the two alternating), the ratio
// and the largest difference between the two gradients relative to the
// largest element (the product's blocks may round differently; docs/
// performance.md has the numbers).
#include "carve/rt/kernels.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

using namespace carve::rt;
using Clock = std::chrono::steady_clock;

int main() {
  struct Shape {
    int64_t n, c, o, h, w;
  };
  const Shape shapes[] = {{32, 32, 32, 32, 32},
                          {32, 32, 64, 16, 16},
                          {32, 64, 64, 16, 16},
                          {32, 64, 64, 32, 32},
                          {32, 128, 128, 8, 8}};
  std::printf("threads: %d\n", omp_get_max_threads());
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
    std::vector<float> wt(s.o * ck), dy(s.n * s.o * p), prod(s.n * ck * p), da(s.n * s.c * l),
        db(da.size());
    for (size_t i = 0; i < wt.size(); ++i)
      wt[i] = (float)((i * 40503u) % 1000) / 5000.f - 0.1f;
    for (size_t i = 0; i < dy.size(); ++i)
      dy[i] = (float)((i * 2654435761u) % 1000) / 500.f - 1.f;
    const Dims as{s.o, ck}, bs{s.n, s.o, p}, ys{s.n, ck, p}, is{taps, p}, ts{s.n, s.c, l};
    auto twoOps = [&] {
      matmul<float>(wt.data(), as, true, dy.data(), bs, false, prod.data(), ys);
      gather_grad<float>(prod.data(), idx.data(), is, 2, da.data(), ts);
    };
    auto fused = [&] {
      matmul_gather_grad<float>(wt.data(), as, true, dy.data(), bs, false, ys, idx.data(), is,
                                db.data(), ts);
    };
    twoOps();
    fused();
    double ta = 1e9, tb = 1e9;
    for (int r = 0; r < 9; ++r) {
      auto t = Clock::now();
      twoOps();
      ta = std::min(ta, std::chrono::duration<double>(Clock::now() - t).count());
      t = Clock::now();
      fused();
      tb = std::min(tb, std::chrono::duration<double>(Clock::now() - t).count());
    }
    double worst = 0, scale = 0;
    for (size_t i = 0; i < da.size(); ++i) {
      worst = std::max(worst, (double)std::fabs(da[i] - db[i]));
      scale = std::max(scale, (double)std::fabs(da[i]));
    }
    const double flops = 2.0 * s.n * ck * p * s.o;
    std::printf("C%lld -> O%lld %lldx%lld, N%lld: matmul + gather_grad %.2f ms (%.1f GFLOP/s) | "
                "matmul_gather_grad %.2f ms (%.1f GFLOP/s) | %.2fx | max diff %.1e of %.1e\n",
                (long long)s.c, (long long)s.o, (long long)s.h, (long long)s.w, (long long)s.n,
                ta * 1e3, flops / ta / 1e9, tb * 1e3, flops / tb / 1e9, ta / tb, worst, scale);
  }
}
