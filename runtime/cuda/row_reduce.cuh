//===- row_reduce.cuh - reductions within a warp, a block, a row group ---===//
//
// Private to runtime/cuda/: the shuffle and shared-memory reductions of the
// row-wise kernels in kernels_fused.cu, kernels_loss.cu and
// kernels_attention.cu, the row group (a warp for short rows, the block for
// long ones) they are written against, and the launch of a kernel over rows
// in either shape. Everything is a macro or sits in an anonymous namespace,
// so each file compiles its own copy and none of it is a symbol of the
// library.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_CUDA_ROW_REDUCE_CUH
#define CARVE_RT_CUDA_ROW_REDUCE_CUH

#include "internal.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace carve::gpu {
namespace {

constexpr float kNegInf = -INFINITY;
/// Most blocks a grid-stride launch asks for (gridDim.x allows far more; past
/// this the loops take over).
constexpr int64_t kMaxGrid = 65535 * 8;

int gridFor(int64_t units) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(units, kMaxGrid)));
}

//===--- Reductions within a warp, a block, a row group --------------------===//

__device__ __forceinline__ float warpSum(float v) {
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warpMax(float v) {
  for (int o = 16; o > 0; o >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/// Sum over the block (blockDim.x a multiple of 32), returned to every
/// thread. `sh` holds 32 values; the leading barrier lets calls follow each
/// other on the same `sh`.
template <class T> __device__ T blockSum(T v, T *sh) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0)
    sh[w] = v;
  __syncthreads();
  if (w == 0) {
    v = lane < nw ? sh[lane] : T(0);
    for (int o = 16; o > 0; o >>= 1)
      v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0)
      sh[0] = v;
  }
  __syncthreads();
  return sh[0];
}

__device__ float blockMax(float v, float *sh) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warpMax(v);
  __syncthreads();
  if (lane == 0)
    sh[w] = v;
  __syncthreads();
  if (w == 0) {
    v = warpMax(lane < nw ? sh[lane] : kNegInf);
    if (lane == 0)
      sh[0] = v;
  }
  __syncthreads();
  return sh[0];
}

/// The threads that share a row: a warp (short rows, several rows per
/// block) or the whole block (long rows).
template <bool kBlock> struct RowGroup {
  int64_t first, stride;
  int lane, size;
  __device__ RowGroup() {
    if (kBlock) {
      first = blockIdx.x;
      stride = gridDim.x;
      lane = threadIdx.x;
      size = blockDim.x;
    } else {
      const int wpb = blockDim.x >> 5;
      first = static_cast<int64_t>(blockIdx.x) * wpb + (threadIdx.x >> 5);
      stride = static_cast<int64_t>(gridDim.x) * wpb;
      lane = threadIdx.x & 31;
      size = 32;
    }
  }
  __device__ float sum(float v, float *sh) const { return kBlock ? blockSum(v, sh) : warpSum(v); }
  __device__ float max(float v, float *sh) const { return kBlock ? blockMax(v, sh) : warpMax(v); }
};

/// Rows up to this long go to one warp each.
constexpr int64_t kWarpRow = 1024;
constexpr int kWarpRowThreads = 256;
constexpr int kBlockRowThreads = 512;

/// Launches `kernel<true or false>` over `rows` rows of `len` elements.
/// CARVE_LAUNCH_ROWS for a kernel with one more template argument before
/// kBlock (`kernel<targ, false>`).
#define CARVE_LAUNCH_ROWS_T(kernel, targ, rows, len, ...)                                          \
  do {                                                                                             \
    if ((len) <= kWarpRow)                                                                         \
      CARVE_KERNEL(gridFor(((rows) + kWarpRowThreads / 32 - 1) / (kWarpRowThreads / 32)),          \
                   kWarpRowThreads, 0, stream(), kernel<targ, false>)                              \
    (__VA_ARGS__);                                                                                 \
    else CARVE_KERNEL(gridFor(rows), kBlockRowThreads, 0, stream(),                                \
                      kernel<targ, true>)(__VA_ARGS__);                                            \
  } while (0)

#define CARVE_LAUNCH_ROWS(kernel, rows, len, ...)                                                  \
  do {                                                                                             \
    if ((len) <= kWarpRow)                                                                         \
      CARVE_KERNEL(gridFor(((rows) + kWarpRowThreads / 32 - 1) / (kWarpRowThreads / 32)),          \
                   kWarpRowThreads, 0, stream(), kernel<false>)                                    \
      (__VA_ARGS__);                                                                               \
    else                                                                                           \
      CARVE_KERNEL(gridFor(rows), kBlockRowThreads, 0, stream(), kernel<true>)(__VA_ARGS__);       \
  } while (0)

} // namespace
} // namespace carve::gpu

#endif // CARVE_RT_CUDA_ROW_REDUCE_CUH
