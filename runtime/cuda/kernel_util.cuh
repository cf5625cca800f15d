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

} // namespace
} // namespace carve::gpu

#endif // CARVE_RT_CUDA_KERNEL_UTIL_CUH
