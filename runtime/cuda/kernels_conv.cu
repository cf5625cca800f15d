//===- kernels_conv.cu - 2-D convolutions by carve's own direct kernels ----===//
//
// conv_fallback.h's conv2dByCarve: the convolution, its data gradient and its
// filter gradient written out, one thread per output element. They run where
// cuDNN refuses a call (conv_cudnn.cpp); correctness, not speed, is their
// job. Each sum runs in f32 in increasing order of its indices (channel, then
// tap row, then tap column; for the filter gradient sample, then output row,
// then output column).
//
//===----------------------------------------------------------------------===//

#include "conv_fallback.h"
#include "kernel_util.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace carve::gpu {
namespace {

/// x rounded to the plan's 16-bit format and back (f32: unchanged).
__device__ __forceinline__ float round16(float x, int prec) {
  if (prec == static_cast<int>(Precision::BF16))
    return __bfloat162float(__float2bfloat16_rn(x));
  if (prec == static_cast<int>(Precision::F16))
    return __half2float(__float2half_rn(x));
  return x;
}

__global__ void convForwardKernel(const float *x, const float *w, float *y, ConvDims d, int prec) {
  const int64_t total = d.n * d.o * d.ho * d.wo;
  const int64_t cg = d.c / d.group, og = d.o / d.group;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = e % d.wo, i = (e / d.wo) % d.ho, o = (e / (d.wo * d.ho)) % d.o;
    const int64_t n = e / (d.wo * d.ho * d.o), c0 = (o / og) * cg;
    float acc = 0;
    for (int64_t c = 0; c < cg; ++c)
      for (int64_t a = 0; a < d.kh; ++a) {
        const int64_t yy = i * d.stride[0] - d.pad[0] + a * d.dil[0];
        if (yy < 0 || yy >= d.h)
          continue;
        for (int64_t b = 0; b < d.kw; ++b) {
          const int64_t xx = j * d.stride[1] - d.pad[1] + b * d.dil[1];
          if (xx < 0 || xx >= d.w)
            continue;
          acc += round16(x[((n * d.c + c0 + c) * d.h + yy) * d.w + xx], prec) *
                 round16(w[((o * cg + c) * d.kh + a) * d.kw + b], prec);
        }
      }
    y[e] = round16(acc, prec);
  }
}

__global__ void convDataKernel(const float *dy, const float *w, float *dx, ConvDims d, int prec) {
  const int64_t total = d.n * d.c * d.h * d.w;
  const int64_t cg = d.c / d.group, og = d.o / d.group;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t xx = e % d.w, yy = (e / d.w) % d.h, c = (e / (d.w * d.h)) % d.c;
    const int64_t n = e / (d.w * d.h * d.c), g = c / cg, cw = c - g * cg;
    float acc = 0;
    for (int64_t o = g * og; o < (g + 1) * og; ++o)
      for (int64_t a = 0; a < d.kh; ++a) {
        const int64_t iy = yy + d.pad[0] - a * d.dil[0];
        if (iy < 0 || iy % d.stride[0] || iy / d.stride[0] >= d.ho)
          continue;
        for (int64_t b = 0; b < d.kw; ++b) {
          const int64_t ix = xx + d.pad[1] - b * d.dil[1];
          if (ix < 0 || ix % d.stride[1] || ix / d.stride[1] >= d.wo)
            continue;
          acc += round16(dy[((n * d.o + o) * d.ho + iy / d.stride[0]) * d.wo + ix / d.stride[1]],
                         prec) *
                 round16(w[((o * cg + cw) * d.kh + a) * d.kw + b], prec);
        }
      }
    dx[e] = round16(acc, prec);
  }
}

__global__ void convFilterKernel(const float *x, const float *dy, float *dw, ConvDims d, int prec) {
  const int64_t cg = d.c / d.group, og = d.o / d.group;
  const int64_t total = d.o * cg * d.kh * d.kw;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = e % d.kw, a = (e / d.kw) % d.kh, cw = (e / (d.kw * d.kh)) % cg;
    const int64_t o = e / (d.kw * d.kh * cg), c = (o / og) * cg + cw;
    float acc = 0;
    for (int64_t n = 0; n < d.n; ++n)
      for (int64_t i = 0; i < d.ho; ++i) {
        const int64_t yy = i * d.stride[0] - d.pad[0] + a * d.dil[0];
        if (yy < 0 || yy >= d.h)
          continue;
        for (int64_t j = 0; j < d.wo; ++j) {
          const int64_t xx = j * d.stride[1] - d.pad[1] + b * d.dil[1];
          if (xx < 0 || xx >= d.w)
            continue;
          acc += round16(dy[((n * d.o + o) * d.ho + i) * d.wo + j], prec) *
                 round16(x[((n * d.c + c) * d.h + yy) * d.w + xx], prec);
        }
      }
    dw[e] = round16(acc, prec);
  }
}

} // namespace

void conv2dByCarve(ConvKind kind, const float *a, const float *b, float *c, const ConvDims &d,
                   int prec) {
  int64_t total = 0;
  switch (kind) {
  case ConvKind::Forward:
    total = d.n * d.o * d.ho * d.wo;
    if (total)
      CARVE_KERNEL(blocksFor(total), kThreads, 0, stream(), convForwardKernel)(a, b, c, d, prec);
    break;
  case ConvKind::Data:
    total = d.n * d.c * d.h * d.w;
    if (total)
      CARVE_KERNEL(blocksFor(total), kThreads, 0, stream(), convDataKernel)(a, b, c, d, prec);
    break;
  case ConvKind::Filter:
    total = d.o * (d.c / d.group) * d.kh * d.kw;
    if (total)
      CARVE_KERNEL(blocksFor(total), kThreads, 0, stream(), convFilterKernel)(a, b, c, d, prec);
    break;
  }
}

} // namespace carve::gpu
