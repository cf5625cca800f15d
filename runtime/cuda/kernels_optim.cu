//===- kernels_optim.cu - optimizer updates and the gradient norm ---------===//
//
// The gpu.h functions of the optimizer step: the SGD and AdamW updates, the
// sum of squares behind the gradient norm (to the host, or accumulated on the
// device in stream order), and the in-place add and scale of gradient
// buffers. They mirror runtime/src/optim.cpp; the updates are bit-identical
// to the CPU's.
//
//===----------------------------------------------------------------------===//

#include "kernel_util.cuh"

#include <algorithm>

namespace carve::gpu {
namespace {

//===--- Optimizer (optim.cpp, with its rounding spelled out) ---------------===//
//
// optim.cpp compiles with contraction off and explicit std::fma where
// PyTorch's kernels fuse; the _rn intrinsics keep nvcc from contracting
// anything else, so the updates are bit-identical to the CPU's.

// A gradient's elements as floats: fp32 as they are, 16-bit ones widened
// (exact), as optim.cpp reads them.
struct F32Elems {
  const float *g;
  __device__ float operator[](int64_t i) const { return g[i]; }
};
struct Bf16Elems {
  const uint16_t *g;
  __device__ float operator[](int64_t i) const { return carve::rt::ew::bf16Float(g[i]); }
};
struct F16Elems {
  const uint16_t *g;
  __device__ float operator[](int64_t i) const { return carve::rt::ew::f16Float(g[i]); }
};

__device__ uint16_t round16(float x, bool f16) {
  return f16 ? carve::rt::ew::f16Bits(x) : carve::rt::ew::bf16Bits(x);
}

template <class G>
__global__ void sgdKernel(float *p, G g, float *buf, int64_t n, float wd, float mom, float keep,
                          float negLr, bool decay, bool useMomentum, bool nesterov,
                          bool firstStep) {
  CARVE_GRID_LOOP(i, n) {
    const float gi = g[i];
    float d = decay ? __fmaf_rn(p[i], wd, gi) : gi;
    if (useMomentum) {
      const float b = firstStep ? d : __fmaf_rn(d, keep, __fmul_rn(buf[i], mom));
      buf[i] = b;
      d = nesterov ? __fmaf_rn(b, mom, d) : b;
    }
    p[i] = __fmaf_rn(d, negLr, p[i]);
  }
}

template <class G>
__global__ void adamwKernel(float *p, G g, float *m, float *v, int64_t n, float decay, float b1,
                            float b2, float c1, float c2, float bc2Sqrt, float eps, float negStep,
                            uint16_t *copy, bool copyF16) {
  CARVE_GRID_LOOP(i, n) {
    const float gi = g[i];
    const float pi = __fmul_rn(p[i], decay);
    const float mi = __fmaf_rn(gi, c1, __fmul_rn(m[i], b1));
    const float vi = __fadd_rn(__fmul_rn(v[i], b2), __fmul_rn(__fmul_rn(c2, gi), gi));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2Sqrt), eps);
    const float pn = __fadd_rn(pi, __fdiv_rn(__fmul_rn(negStep, mi), denom));
    p[i] = pn;
    m[i] = mi;
    v[i] = vi;
    // The parameter's 16-bit copy, rounded to nearest even as toBf16 / toF16 round.
    if (copy)
      copy[i] = copyF16 ? carve::rt::ew::f16Bits(pn) : carve::rt::ew::bf16Bits(pn);
  }
}

__global__ void addKernel(float *dst, const float *src, int64_t n) {
  CARVE_GRID_LOOP(i, n) dst[i] = __fadd_rn(dst[i], src[i]);
}

__global__ void scaleKernel(float *g, int64_t n, float s) {
  CARVE_GRID_LOOP(i, n) g[i] = __fmul_rn(g[i], s);
}

template <class G> __global__ void scale16Kernel(uint16_t *g, G e, int64_t n, float s, bool f16) {
  CARVE_GRID_LOOP(i, n) g[i] = round16(__fmul_rn(e[i], s), f16);
}

template <class G> __global__ void add16Kernel(uint16_t *dst, G d, G s, int64_t n, bool f16) {
  CARVE_GRID_LOOP(i, n) dst[i] = round16(__fadd_rn(d[i], s[i]), f16);
}

template <class G> __global__ void addWideKernel(float *dst, G s, int64_t n) {
  CARVE_GRID_LOOP(i, n) dst[i] = __fadd_rn(dst[i], s[i]);
}

template <class G> __global__ void widenKernel(G s, float *dst, int64_t n) {
  CARVE_GRID_LOOP(i, n) dst[i] = s[i];
}

/// partial[block] = the block's sum of g^2 in double.
template <class G> __global__ void sumSquaresKernel(G g, int64_t n, double *partial) {
  __shared__ double warpSums[kThreads / 32];
  double acc = 0;
  CARVE_GRID_LOOP(i, n) {
    const double x = (float)g[i];
    acc += x * x;
  }
  acc = warpCombine(false, acc);
  if ((threadIdx.x & 31) == 0)
    warpSums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0;
    for (int w = 0; w < kThreads / 32; ++w)
      s += warpSums[w];
    partial[blockIdx.x] = s;
  }
}

/// out = the sum of the n partials (one block); with Add, *out += it (the
/// gradient norm's accumulators, in stream order).
template <bool Add> __global__ void sumPartialsKernel(const double *partial, int n, double *out) {
  __shared__ double warpSums[kThreads / 32];
  double acc = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    acc += partial[i];
  acc = warpCombine(false, acc);
  if ((threadIdx.x & 31) == 0)
    warpSums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0;
    for (int w = 0; w < kThreads / 32; ++w)
      s += warpSums[w];
    *out = Add ? *out + s : s;
  }
}

} // namespace

//===--- Optimizer ---------------------------------------------------------===//

namespace {

/// Calls f with the accessor of `g`'s format.
template <class F> void withElems(Grad16 g, F &&f) {
  if (g.f16)
    f(F16Elems{g.p});
  else
    f(Bf16Elems{g.p});
}

template <class G>
void sgdLaunch(float *p, G g, float *buf, int64_t n, double lr, double momentum, double dampening,
               double weightDecay, bool nesterov, bool firstStep) {
  if (n <= 0)
    return;
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), sgdKernel<G>)
  (p, g, buf, n, static_cast<float>(weightDecay), static_cast<float>(momentum),
   static_cast<float>(1.0 - dampening), static_cast<float>(-lr), weightDecay != 0, momentum != 0,
   nesterov, firstStep);
  checkLaunch("sgdUpdate");
}

template <class G>
void adamwLaunch(float *p, G g, float *m, float *v, int64_t n, double lr, double beta1,
                 double beta2, double eps, double weightDecay, int64_t step,
                 uint16_t *copy = nullptr, bool copyF16 = false) {
  if (n <= 0)
    return;
  // The scalar coefficients of the CPU update (optim.h).
  const carve::rt::AdamwCoefficients k =
      carve::rt::adamwCoefficients(lr, beta1, beta2, eps, weightDecay, step);
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), adamwKernel<G>)
  (p, g, m, v, n, k.decay, k.b1, k.b2, k.c1, k.c2, k.bc2Sqrt, k.eps, k.negStep, copy, copyF16);
  checkLaunch("adamwUpdate");
}

constexpr int kMaxPartials = 1024;

template <class G> double sumSquaresOf(G g, int64_t n) {
  if (n <= 0)
    return 0;
  const int blocks = std::min(blocksFor(n), kMaxPartials);
  double *partial =
      static_cast<double *>(workspace(sizeof(double) * (kMaxPartials + 1), kWsBasic2));
  CARVE_KERNEL(blocks, kThreads, 0, stream(), sumSquaresKernel<G>)(g, n, partial);
  checkLaunch("sumSquares");
  CARVE_KERNEL(1, kThreads, 0, stream(), sumPartialsKernel<false>)
  (partial, blocks, partial + kMaxPartials);
  checkLaunch("sumSquares");
  return readScalar(partial + kMaxPartials);
}

template <class G> void sumSquaresAddOf(G g, int64_t n, double *acc) {
  if (n <= 0)
    return;
  // The partials' slot is reused by the next call only after this call's
  // kernels have run: one stream orders them.
  const int blocks = std::min(blocksFor(n), kMaxPartials);
  double *partial = static_cast<double *>(workspace(sizeof(double) * kMaxPartials, kWsBasic2));
  CARVE_KERNEL(blocks, kThreads, 0, stream(), sumSquaresKernel<G>)(g, n, partial);
  checkLaunch("sumSquaresAdd");
  CARVE_KERNEL(1, kThreads, 0, stream(), sumPartialsKernel<true>)(partial, blocks, acc);
  checkLaunch("sumSquaresAdd");
}

} // namespace

void sgdUpdate(float *p, const float *g, float *buf, int64_t n, double lr, double momentum,
               double dampening, double weightDecay, bool nesterov, bool firstStep) {
  sgdLaunch(p, F32Elems{g}, buf, n, lr, momentum, dampening, weightDecay, nesterov, firstStep);
}

void sgdUpdate(float *p, Grad16 g, float *buf, int64_t n, double lr, double momentum,
               double dampening, double weightDecay, bool nesterov, bool firstStep) {
  withElems(g, [&](auto e) {
    sgdLaunch(p, e, buf, n, lr, momentum, dampening, weightDecay, nesterov, firstStep);
  });
}

void adamwUpdate(float *p, const float *g, float *m, float *v, int64_t n, double lr, double beta1,
                 double beta2, double eps, double weightDecay, int64_t step) {
  adamwLaunch(p, F32Elems{g}, m, v, n, lr, beta1, beta2, eps, weightDecay, step);
}

void adamwUpdate(float *p, Grad16 g, float *m, float *v, int64_t n, double lr, double beta1,
                 double beta2, double eps, double weightDecay, int64_t step) {
  withElems(g,
            [&](auto e) { adamwLaunch(p, e, m, v, n, lr, beta1, beta2, eps, weightDecay, step); });
}

void adamwUpdateCopy16(float *p, const float *g, float *m, float *v, int64_t n, double lr,
                       double beta1, double beta2, double eps, double weightDecay, int64_t step,
                       uint16_t *copy, bool copyF16) {
  adamwLaunch(p, F32Elems{g}, m, v, n, lr, beta1, beta2, eps, weightDecay, step, copy, copyF16);
}

void adamwUpdateCopy16(float *p, Grad16 g, float *m, float *v, int64_t n, double lr, double beta1,
                       double beta2, double eps, double weightDecay, int64_t step, uint16_t *copy,
                       bool copyF16) {
  withElems(g, [&](auto e) {
    adamwLaunch(p, e, m, v, n, lr, beta1, beta2, eps, weightDecay, step, copy, copyF16);
  });
}

double sumSquares(const float *g, int64_t n) { return sumSquaresOf(F32Elems{g}, n); }

double sumSquares(Grad16 g, int64_t n) {
  double s = 0;
  withElems(g, [&](auto e) { s = sumSquaresOf(e, n); });
  return s;
}

double *normAccumulators() {
  // [0], [1]: tp-split and other gradients; [2], [3]: the same of this
  // rank's experts under expert parallelism.
  double *acc = static_cast<double *>(workspace(4 * sizeof(double), kWsNorm));
  CARVE_CUDA_CHECK(cudaMemsetAsync(acc, 0, 4 * sizeof(double), stream()));
  return acc;
}

void sumSquaresAdd(const float *g, int64_t n, double *acc) { sumSquaresAddOf(F32Elems{g}, n, acc); }

void sumSquaresAdd(Grad16 g, int64_t n, double *acc) {
  withElems(g, [&](auto e) { sumSquaresAddOf(e, n, acc); });
}

void addInPlace(float *dst, const float *src, int64_t n) {
  if (n <= 0)
    return;
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), addKernel)(dst, src, n);
  checkLaunch("addInPlace");
}

void scaleInPlace(float *g, int64_t n, float s) {
  if (n <= 0)
    return;
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), scaleKernel)(g, n, s);
  checkLaunch("scaleInPlace");
}

void scaleInPlace(Grad16 g, int64_t n, float s) {
  if (n <= 0)
    return;
  withElems(g, [&](auto e) {
    CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), scale16Kernel<decltype(e)>)
    (g.p, e, n, s, g.f16);
  });
  checkLaunch("scaleInPlace");
}

void addInPlace(Grad16 dst, Grad16 src, int64_t n) {
  if (n <= 0)
    return;
  // One format (the generator pairs gradients of one plan); read both as dst's.
  withElems(dst, [&](auto d) {
    using G = decltype(d);
    CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), add16Kernel<G>)
    (dst.p, d, G{src.p}, n, dst.f16);
  });
  checkLaunch("addInPlace");
}

void addInPlace(float *dst, Grad16 src, int64_t n) {
  if (n <= 0)
    return;
  withElems(src, [&](auto e) {
    CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), addWideKernel<decltype(e)>)(dst, e, n);
  });
  checkLaunch("addInPlace");
}

void widen(Grad16 src, float *dst, int64_t n) {
  if (n <= 0)
    return;
  withElems(src, [&](auto e) {
    CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), widenKernel<decltype(e)>)(e, dst, n);
  });
  checkLaunch("widen");
}

} // namespace carve::gpu
