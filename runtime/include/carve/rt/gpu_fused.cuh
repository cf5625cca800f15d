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

/// The pointers of one fused call, passed to the kernel by value: input k is
/// floats, or where bit k of `in16` is set the 16-bit tensor (format `fmt16`:
/// 1 bf16, 2 fp16) of its f32 values, widened as read (carve.read16);
/// out16[j], where not null, receives output j's bits in that format as well
/// (a value the chain rounded to it, so exactly); a null out[j] (with a copy)
/// is an output no one reads in f32.
template <int NI, int NO> struct FusedArgs {
  const void *in[NI];
  uint32_t in16;
  float *out[NO];
  uint16_t *out16[NO];
  int fmt16;
};

template <int NI, int NO, class F>
__global__ void fusedKernel(F f, FusedArgs<NI, NO> a, carve::rt::ew::Nest<NI> n, int64_t total) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t off[NI];
    carve::rt::ew::offsetsOf(n, e, off);
    float x[NI], y[NO];
#pragma unroll
    for (int k = 0; k < NI; ++k) {
      if (!(a.in16 >> k & 1u)) {
        x[k] = static_cast<const float *>(a.in[k])[off[k]];
      } else {
        const uint16_t h = static_cast<const uint16_t *>(a.in[k])[off[k]];
        x[k] = a.fmt16 == 1 ? carve::rt::ew::bf16Float(h) : carve::rt::ew::f16Float(h);
      }
    }
    f(x, y);
#pragma unroll
    for (int j = 0; j < NO; ++j) {
      if (a.out[j]) // null: only its 16-bit copy is kept (neverStoredF32)
        a.out[j][e] = y[j];
      if (a.out16[j])
        a.out16[j][e] = a.fmt16 == 1 ? carve::rt::ew::bf16Bits(y[j]) : carve::rt::ew::f16Bits(y[j]);
    }
  }
}

/// As carve::rt::fused (fused.h), on device pointers, enqueued on the
/// compute stream; in16[k]: input k is the 16-bit tensor (the precision's
/// format) of its f32 values (carve.read16: a parameter's copy, a saved
/// activation), widened as read; out16[j] (not null): output j's 16-bit copy
/// in the precision's format, written in the same pass (carve.copy_in_fused).
template <int NI, int NO, class F>
void fused(const char *what, F f, const void *const (&in)[NI], const bool (&in16)[NI],
           const Dims (&shapes)[NI], float *const (&out)[NO], uint16_t *const (&out16)[NO],
           Dims ys) {
  static_assert(NI <= 32, "a fused chain reads at most 32 inputs");
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  const carve::rt::ew::Nest<NI> n = carve::rt::ew::broadcastNest<NI>(what, shapes, ys);
  FusedArgs<NI, NO> a;
  a.in16 = 0;
  for (int k = 0; k < NI; ++k) {
    a.in[k] = in[k];
    a.in16 |= in16[k] ? 1u << k : 0u;
  }
  bool any16 = a.in16 != 0;
  for (int j = 0; j < NO; ++j) {
    a.out[j] = out[j];
    a.out16[j] = out16[j];
    any16 |= out16[j] != nullptr;
  }
  a.fmt16 = precision() == Precision::BF16 ? 1 : precision() == Precision::F16 ? 2 : 0;
  if (any16 && a.fmt16 == 0)
    fatal("%s: 16-bit inputs or copies of a fused chain's outputs under the fp32 precision", what);
  constexpr int kThreads = 256;
  constexpr int64_t kMaxBlocks = 65535 * 8;
  int64_t blocks = (total + kThreads - 1) / kThreads;
  blocks = blocks > kMaxBlocks ? kMaxBlocks : blocks;
  CARVE_KERNEL(static_cast<unsigned>(blocks), kThreads, 0,
               static_cast<cudaStream_t>(computeStream()), fusedKernel<NI, NO, F>)
  (f, a, n, total);
  checkLaunch(what);
}

/// fused with f32 inputs.
template <int NI, int NO, class F>
void fused(const char *what, F f, const float *const (&in)[NI], const Dims (&shapes)[NI],
           float *const (&out)[NO], uint16_t *const (&out16)[NO], Dims ys) {
  const void *inv[NI];
  bool f32[NI];
  for (int k = 0; k < NI; ++k) {
    inv[k] = in[k];
    f32[k] = false;
  }
  fused(what, f, inv, f32, shapes, out, out16, ys);
}

/// fused with f32 inputs and without 16-bit copies.
template <int NI, int NO, class F>
void fused(const char *what, F f, const float *const (&in)[NI], const Dims (&shapes)[NI],
           float *const (&out)[NO], Dims ys) {
  uint16_t *const none[NO] = {};
  fused(what, f, in, shapes, out, none, ys);
}

} // namespace carve::gpu

#endif // CARVE_RT_GPU_FUSED_CUH
