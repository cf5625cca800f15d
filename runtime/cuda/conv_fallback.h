//===- conv_fallback.h - carve's own convolution kernels --------*- C++ -*-===//
//
// What conv_cudnn.cpp runs where cuDNN cannot take a convolution: one thread
// per output element, the sums in f32 in a fixed order, the operands rounded
// to the plan's 16-bit format as they are loaded and the result rounded to
// it (under bf16/fp16, as cuDNN's 16-bit engines read and write), so that
// either path computes the same quantity (kernels_conv.cu).
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_CUDA_CONV_FALLBACK_H
#define CARVE_RT_CUDA_CONV_FALLBACK_H

#include <cstdint>

namespace carve::gpu {

/// One convolution's sizes: x [n, c, h, w], weight [o, c / group, kh, kw],
/// y [n, o, ho, wo].
struct ConvDims {
  int64_t n = 0, c = 0, h = 0, w = 0, o = 0, kh = 0, kw = 0, ho = 0, wo = 0, group = 1;
  int64_t stride[2] = {1, 1}, pad[2] = {0, 0}, dil[2] = {1, 1}; // pad: top, left
};

enum class ConvKind : int { Forward = 0, Data = 1, Filter = 2 };

/// Forward: c = conv(a = x, b = w); Data: c = dx from a = dy, b = w;
/// Filter: c = dw from a = x, b = dy. `prec`: Precision's value.
void conv2dByCarve(ConvKind kind, const float *a, const float *b, float *c, const ConvDims &d,
                   int prec);

} // namespace carve::gpu

#endif // CARVE_RT_CUDA_CONV_FALLBACK_H
