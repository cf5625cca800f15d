//===- kernel_util.cuh - what the CUDA kernel files share -----------------===//
//
// Private to runtime/cuda/: the grid-stride loop, the shape helpers, the
// broadcast loop nests of elementwise.h (passed to kernels by value) and the
// double-precision warp combine of the reductions. Used by kernels_basic.cu,
// kernels_data.cu and kernels_optim.cu; kernels_fused.cu and kernels_loss.cu
// take the shape helpers. Everything is a macro or sits in an anonymous
// namespace, so each file compiles its own copy and none of it is a symbol of
// the library.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_CUDA_KERNEL_UTIL_CUH
#define CARVE_RT_CUDA_KERNEL_UTIL_CUH

#include "internal.h"

#include "carve/rt/elementwise.h"

#include <cstdint>

/// for (int64_t i ...) over [0, n), strided by the whole 1-D grid.
#define CARVE_GRID_LOOP(i, n)                                                                      \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n);           \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

namespace carve::gpu {
namespace {

int64_t prod(const Dims &s, int lo, int hi) {
  int64_t n = 1;
  for (int i = lo; i < hi; ++i)
    n *= s.d[i];
  return n;
}

int normAxis(int axis, int rank, const char *op) {
  if (axis < 0)
    axis += rank;
  if (axis < 0 || axis >= rank)
    fatal("%s: axis %d is out of range for rank %d", op, axis, rank);
  return axis;
}

//===--- Broadcast loop nests (elementwise.h, passed to kernels by value) --===//

using carve::rt::ew::broadcastNest;
using carve::rt::ew::coalesce;
using carve::rt::ew::divMod;
using carve::rt::ew::Nest;
using carve::rt::ew::offsetsOf;
using carve::rt::ew::ReduceGeom;
using carve::rt::ew::reduceGeom;
using carve::rt::ew::sliceNest;
using carve::rt::ew::stridesOf;
using carve::rt::ew::transposeNest;

using carve::rt::ew::maxNan;
using carve::rt::ew::minNan;

//===--- Combining in double (reductions, the gradient norm) --------------===//

__device__ __forceinline__ double combine(bool isMax, double acc, double x) {
  return isMax ? maxNan(x, acc) : acc + x;
}

__device__ __forceinline__ double warpCombine(bool isMax, double acc) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    acc = combine(isMax, acc, __shfl_xor_sync(0xffffffffu, acc, o));
  return acc;
}

//===--- Operands read as stored (carve.read16) ----------------------------===//

/// An f32 operand that the kernel reads through the 16-bit tensor of its bits
/// where the plan stores one (carve-select-kernels' carve.read16): element i
/// as a float, widened in registers (exact). fmt 0: float, 1: bf16, 2: fp16.
/// Kernels templated on an operand's type take it or a plain `const float *`
/// (the f32 entry, which stays as it was).
struct In16 {
  const void *p;
  int fmt;
  __host__ __device__ explicit operator bool() const { return p != nullptr; }
  __device__ __forceinline__ float operator[](int64_t i) const {
    if (fmt == 0)
      return static_cast<const float *>(p)[i];
    const uint16_t h = static_cast<const uint16_t *>(p)[i];
    return fmt == 1 ? carve::rt::ew::bf16Float(h) : carve::rt::ew::f16Float(h);
  }
  __host__ __device__ In16 operator+(int64_t k) const {
    if (!p)
      return *this;
    if (fmt == 0)
      return {static_cast<const float *>(p) + k, 0};
    return {static_cast<const uint16_t *>(p) + k, fmt};
  }
};

/// A float output written with its 16-bit copy (the precision's format, 1:
/// bf16, 2: fp16; rounded to nearest even, the bits toBf16 / toF16 write):
/// carve-select-kernels' rule 3h, an op that writes its result's copy as it
/// writes the result; with `round`, the result itself is rounded to the
/// format as written (carve.round16; the copy's bits are the same). A null
/// `y` writes the copy only.
struct Out16 {
  float *y;
  uint16_t *y16;
  int fmt;
  bool round;
};

/// Element e of an output: a plain pointer, or an Out16 (value and copy).
template <class T, class V> __device__ __forceinline__ void store(T *y, int64_t e, V v) {
  y[e] = v;
}
__device__ __forceinline__ void store(const Out16 &o, int64_t e, float v) {
  const uint16_t h = o.fmt == 1 ? carve::rt::ew::bf16Bits(v) : carve::rt::ew::f16Bits(v);
  if (o.y)
    o.y[e] = !o.round ? v : o.fmt == 1 ? carve::rt::ew::bf16Float(h) : carve::rt::ew::f16Float(h);
  o.y16[e] = h;
}

/// The precision's 16-bit format (1: bf16, 2: fp16) for op `op` reading or
/// writing 16-bit `what` (a copy of its result, an operand, logits); a fatal
/// error under the fp32 precision.
inline int format16For(const char *op, const char *what = "copies of its result") {
  switch (precision()) {
  case Precision::BF16:
    return 1;
  case Precision::F16:
    return 2;
  default:
    fatal("%s: 16-bit %s under the fp32 precision", op, what);
  }
}

/// `p` as op `op` reads it: the precision's 16-bit format where `is16`, else
/// float. A 16-bit operand under the fp32 precision is a fatal error.
inline In16 in16(const char *op, const void *p, bool is16) {
  return is16 ? In16{p, format16For(op, "operands")} : In16{p, 0};
}

/// The row of index k of a gather along an axis of `size` rows, or -1 (after
/// recording the error) when it is out of range.
__device__ __forceinline__ int64_t checkedIndex(const int64_t *idx, int64_t k, int64_t size,
                                                DeviceError *err) {
  const int64_t v = idx[k];
  if (v < -size || v >= size) {
    raiseDeviceError(err, kBadIndex, v, k, size);
    return -1;
  }
  return v < 0 ? v + size : v;
}

/// How many row ranges gather_grad splits a table of `size` rows into, for
/// `owners` (outer * inner) threads per range: enough for about 2^16
/// threads, each range at least 64 rows.
inline int64_t gatherGradParts(int64_t owners, int64_t size) {
  int64_t parts = (int64_t(1) << 16) / (owners > 0 ? owners : 1);
  const int64_t most = (size + 63) / 64;
  if (parts > most)
    parts = most;
  return parts < 1 ? 1 : parts;
}

} // namespace
} // namespace carve::gpu

#endif // CARVE_RT_CUDA_KERNEL_UTIL_CUH
