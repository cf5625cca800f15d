// swiglu.cpp - CPU kernels of carve.example::SwiGLU, y = silu(a) * b, for
// swiglu.json. The ABI is runtime/include/carve/rt/custom.h: the tensors are
// this rank's pieces, so the loops run over whatever shape arrives.

#include "carve/rt/custom.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace {

void requireF32(const CarveTensor &t, const char *what) {
  if (t.dtype != CARVE_F32) {
    std::fprintf(stderr, "swiglu: %s is not float32 (dtype %d)\n", what, t.dtype);
    std::abort();
  }
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

} // namespace

extern "C" void swiglu_forward(const CarveTensor *in, int nin, CarveTensor *out, int nout) {
  requireF32(in[0], "a");
  requireF32(in[1], "b");
  const float *a = static_cast<const float *>(in[0].data);
  const float *b = static_cast<const float *>(in[1].data);
  float *y = static_cast<float *>(out[0].data);
  int64_t n = carve_numel(&out[0]);
  for (int64_t i = 0; i < n; ++i)
    y[i] = a[i] * sigmoid(a[i]) * b[i];
}

extern "C" void swiglu_backward(const CarveTensor *in, int nin, const CarveTensor *outGrad,
                                int nout, CarveTensor *inGrad) {
  const float *a = static_cast<const float *>(in[0].data);
  const float *b = static_cast<const float *>(in[1].data);
  const float *g = static_cast<const float *>(outGrad[0].data);
  float *da = static_cast<float *>(inGrad[0].data);
  float *db = static_cast<float *>(inGrad[1].data);
  int64_t n = carve_numel(&in[0]);
  for (int64_t i = 0; i < n; ++i) {
    float s = sigmoid(a[i]);
    // d silu(a) / da = s * (1 + a * (1 - s))
    da[i] = g[i] * b[i] * s * (1.0f + a[i] * (1.0f - s));
    db[i] = g[i] * a[i] * s;
  }
}
