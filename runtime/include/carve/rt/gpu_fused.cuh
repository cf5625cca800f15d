//===- gpu_fused.cuh - fused elementwise chains (CUDA) ---------------------===//
//
// The CUDA twin of fused.h, included by generated CUDA programs only: the
// same functor (its operator() is __host__ __device__ through CARVE_HD), run
// by a grid-stride kernel on the compute stream, one thread per output
// element, every input read through its broadcast strides (elementwise.h's
// nest, one dimension for equal shapes, so no division).
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_GPU_FUSED_CUH
#define CARVE_RT_GPU_FUSED_CUH

#include "carve/rt/elementwise.h"
#include "carve/rt/gpu.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace carve::gpu {

/// The pointers of one fused call, passed to the kernel by value.
template <int NI, int NO> struct FusedArgs {
  const float *in[NI];
  float *out[NO];
};

template <int NI, int NO, class F>
__global__ void fusedKernel(F f, FusedArgs<NI, NO> a, carve::rt::ew::Nest<NI> n, int64_t total) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t off[NI];
    carve::rt::ew::offsetsOf(n, e, off);
    float x[NI], y[NO];
#pragma unroll
    for (int k = 0; k < NI; ++k)
      x[k] = a.in[k][off[k]];
    f(x, y);
#pragma unroll
    for (int j = 0; j < NO; ++j)
      a.out[j][e] = y[j];
  }
}

/// As carve::rt::fused (fused.h), on device pointers, enqueued on the
/// compute stream.
template <int NI, int NO, class F>
void fused(const char *what, F f, const float *const (&in)[NI], const Dims (&shapes)[NI],
           float *const (&out)[NO], Dims ys) {
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  const carve::rt::ew::Nest<NI> n = carve::rt::ew::broadcastNest<NI>(what, shapes, ys);
  FusedArgs<NI, NO> a;
  for (int k = 0; k < NI; ++k)
    a.in[k] = in[k];
  for (int j = 0; j < NO; ++j)
    a.out[j] = out[j];
  constexpr int kThreads = 256;
  constexpr int64_t kMaxBlocks = 65535 * 8;
  int64_t blocks = (total + kThreads - 1) / kThreads;
  blocks = blocks > kMaxBlocks ? kMaxBlocks : blocks;
  CARVE_KERNEL(static_cast<unsigned>(blocks), kThreads, 0,
               static_cast<cudaStream_t>(computeStream()), fusedKernel<NI, NO, F>)
  (f, a, n, total);
  checkLaunch(what);
}

} // namespace carve::gpu

#endif // CARVE_RT_GPU_FUSED_CUH
