// swiglu.cu - CUDA kernels of carve.example::SwiGLU, y = silu(a) * b, for
// swiglu.json (`--target cuda`). The ABI is runtime/include/carve/rt/custom.h:
// the tensors are this rank's pieces in device memory, and every launch goes
// on the stream the program passes (no synchronization, no allocation), so the
// call may be captured in a CUDA graph.
//
// The arithmetic is swiglu.cpp's, operation for operation, so that the GPU
// differs from the CPU target only by the rounding of expf and contracted
// multiply-adds.

#include "carve/rt/custom.h"

#include <cstdio>
#include <cstdlib>

namespace {

constexpr int kThreads = 256;

void requireF32(const CarveTensor &t, const char *what) {
  if (t.dtype != CARVE_F32) {
    std::fprintf(stderr, "swiglu (CUDA): %s is not float32 (dtype %d)\n", what, t.dtype);
    std::abort();
  }
}

// Enough blocks to cover n with a grid-stride loop, at most 65535 x 8 of them.
unsigned blocksFor(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : b > 65535 * 8 ? 65535 * 8 : b);
}

__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__global__ void forwardKernel(const float *a, const float *b, float *y, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    y[i] = a[i] * sigmoid(a[i]) * b[i];
}

__global__ void backwardKernel(const float *a, const float *b, const float *g, float *da,
                               float *db, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    float s = sigmoid(a[i]);
    // d silu(a) / da = s * (1 + a * (1 - s))
    da[i] = g[i] * b[i] * s * (1.0f + a[i] * (1.0f - s));
    db[i] = g[i] * a[i] * s;
  }
}

} // namespace

extern "C" void swiglu_forward_cuda(const CarveTensor *in, int nin, CarveTensor *out, int nout,
                                    CarveStream stream) {
  requireF32(in[0], "a");
  requireF32(in[1], "b");
  int64_t n = carve_numel(&out[0]);
  forwardKernel<<<blocksFor(n), kThreads, 0, stream>>>(static_cast<const float *>(in[0].data),
                                                      static_cast<const float *>(in[1].data),
                                                      static_cast<float *>(out[0].data), n);
}

extern "C" void swiglu_backward_cuda(const CarveTensor *in, int nin, const CarveTensor *outGrad,
                                     int nout, CarveTensor *inGrad, CarveStream stream) {
  int64_t n = carve_numel(&in[0]);
  backwardKernel<<<blocksFor(n), kThreads, 0, stream>>>(
      static_cast<const float *>(in[0].data), static_cast<const float *>(in[1].data),
      static_cast<const float *>(outGrad[0].data), static_cast<float *>(inGrad[0].data),
      static_cast<float *>(inGrad[1].data), n);
}
