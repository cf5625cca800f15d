//===- kernels_fused.cu - softmax, norms, attention and cross-entropy ----===//
//
// The row-wise kernels of gpu.h (everything in "Reductions, normalization,
// attention, loss" but `reduce`, and the vocabulary-parallel cross-entropy),
// with the semantics of their CPU counterparts in runtime/src/kernels_*.cpp and dist.cpp.
//
// Layout of the work:
// - A row is handled by one warp when it is short and by one block when it
//   is long (softmax along the last axis, contiguous cross-entropy), so that
//   a row's reductions are shuffles; along an inner axis, one thread owns a
//   column and adjacent threads read adjacent columns.
// - Layer and RMS norm take one block per row; the gradients of scale and
//   bias are summed per block into partial rows and then across blocks in a
//   fixed order, so that they are the same from run to run (no float atomics).
// - Attention is tiled in the flash-attention way: 32 queries by 32 keys per
//   step, scores in registers and shared memory only, the softmax online
//   (running max and sum). The backward recomputes the forward once to get
//   the row log-sum-exp and O (D_i = dY_i . O_i), then computes dQ query
//   tile by query tile and dK, dV key tile by key tile, each owner summing
//   its own rows (deterministic, no atomics).
// - Cross-entropy validates targets on the device into the device error
//   record (internal.h), reported at the next synchronize as the CPU kernel's
//   message; the sums of a reduction go through per-block partials too.
//
//===----------------------------------------------------------------------===//

#include "internal.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace carve::gpu {
namespace {

using carve::rt::kMaxRank;

constexpr float kNegInf = -INFINITY;
/// Most blocks a grid-stride launch asks for (gridDim.x allows far more; past
/// this the loops take over).
constexpr int64_t kMaxGrid = 65535 * 8;

int gridFor(int64_t units) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(units, kMaxGrid)));
}

int normAxis(int axis, int rank, const char *op) {
  if (axis < 0)
    axis += rank;
  if (axis < 0 || axis >= rank)
    fatal("%s: axis %d is out of range for rank %d", op, axis, rank);
  return axis;
}

int64_t prod(const Dims &s, int lo, int hi) {
  int64_t n = 1;
  for (int i = lo; i < hi; ++i)
    n *= s.d[i];
  return n;
}

/// Threads per block for one row of n elements.
int rowThreads(int64_t n) { return n <= 128 ? 64 : n <= 512 ? 128 : n <= 2048 ? 256 : 512; }

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
#define CARVE_LAUNCH_ROWS(kernel, rows, len, ...)                                                  \
  do {                                                                                             \
    if ((len) <= kWarpRow)                                                                         \
      kernel<false><<<gridFor(((rows) + kWarpRowThreads / 32 - 1) / (kWarpRowThreads / 32)),       \
                      kWarpRowThreads, 0, stream()>>>(__VA_ARGS__);                                \
    else                                                                                           \
      kernel<true><<<gridFor(rows), kBlockRowThreads, 0, stream()>>>(__VA_ARGS__);                 \
  } while (0)

//===--- Softmax ----------------------------------------------------------===//

/// Softmax along the last axis: rows of A contiguous elements.
template <bool kBlock>
__global__ void softmaxRows(const float *x, float *y, int64_t rows, int64_t A, bool log) {
  __shared__ float sh[32];
  const RowGroup<kBlock> g;
  for (int64_t row = g.first; row < rows; row += g.stride) {
    const float *xr = x + row * A;
    float *yr = y + row * A;
    float m = kNegInf;
    for (int64_t j = g.lane; j < A; j += g.size)
      m = fmaxf(m, xr[j]);
    m = g.max(m, sh);
    float s = 0;
    for (int64_t j = g.lane; j < A; j += g.size)
      s += expf(xr[j] - m);
    s = g.sum(s, sh);
    if (log) {
      const float ls = logf(s);
      for (int64_t j = g.lane; j < A; j += g.size)
        yr[j] = xr[j] - m - ls;
    } else {
      const float inv = 1.0f / s;
      for (int64_t j = g.lane; j < A; j += g.size)
        yr[j] = expf(xr[j] - m) * inv;
    }
  }
}

/// Softmax along an inner axis (stride I): one thread per (outer, inner).
__global__ void softmaxColumns(const float *x, float *y, int64_t O, int64_t A, int64_t I,
                               bool log) {
  const int64_t cols = O * I;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < cols;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t o = c / I, i = c % I;
    const float *xr = x + o * A * I + i;
    float *yr = y + o * A * I + i;
    float m = kNegInf;
    for (int64_t j = 0; j < A; ++j)
      m = fmaxf(m, xr[j * I]);
    float s = 0;
    for (int64_t j = 0; j < A; ++j)
      s += expf(xr[j * I] - m);
    if (log) {
      const float ls = logf(s);
      for (int64_t j = 0; j < A; ++j)
        yr[j * I] = xr[j * I] - m - ls;
    } else {
      const float inv = 1.0f / s;
      for (int64_t j = 0; j < A; ++j)
        yr[j * I] = expf(xr[j * I] - m) * inv;
    }
  }
}

template <bool kBlock>
__global__ void softmaxGradRows(const float *y, const float *dy, float *dx, int64_t rows, int64_t A,
                                bool log) {
  __shared__ float sh[32];
  const RowGroup<kBlock> g;
  for (int64_t row = g.first; row < rows; row += g.stride) {
    const float *yr = y + row * A, *gr = dy + row * A;
    float *dr = dx + row * A;
    float s = 0;
    for (int64_t j = g.lane; j < A; j += g.size)
      s += log ? gr[j] : gr[j] * yr[j];
    s = g.sum(s, sh);
    for (int64_t j = g.lane; j < A; j += g.size)
      dr[j] = log ? gr[j] - expf(yr[j]) * s : yr[j] * (gr[j] - s);
  }
}

__global__ void softmaxGradColumns(const float *y, const float *dy, float *dx, int64_t O, int64_t A,
                                   int64_t I, bool log) {
  const int64_t cols = O * I;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < cols;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t o = c / I, i = c % I, base = o * A * I + i;
    const float *yr = y + base, *gr = dy + base;
    float *dr = dx + base;
    float s = 0;
    for (int64_t j = 0; j < A; ++j)
      s += log ? gr[j * I] : gr[j * I] * yr[j * I];
    for (int64_t j = 0; j < A; ++j)
      dr[j * I] = log ? gr[j * I] - expf(yr[j * I]) * s : yr[j * I] * (gr[j * I] - s);
  }
}

//===--- Layer and RMS norm -----------------------------------------------===//

/// Mean and 1/sqrt(biased variance + eps) of a row, two passes (the second
/// reads the row from cache) so that a large mean does not cancel the
/// variance.
__device__ void rowMoments(const float *xr, int64_t N, float eps, float *sh, float &mean,
                           float &rstd) {
  float s = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x)
    s += xr[i];
  mean = blockSum(s, sh) / static_cast<float>(N);
  float v = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    const float d = xr[i] - mean;
    v += d * d;
  }
  rstd = 1.0f / sqrtf(blockSum(v, sh) / static_cast<float>(N) + eps);
}

/// 1/sqrt(mean(x^2) + eps) of a row.
__device__ float rowRms(const float *xr, int64_t N, float eps, float *sh) {
  float s = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x)
    s += xr[i] * xr[i];
  return 1.0f / sqrtf(blockSum(s, sh) / static_cast<float>(N) + eps);
}

__global__ void layerNormKernel(const float *x, const float *scale, const float *bias, float eps,
                                float *y, int64_t R, int64_t N) {
  __shared__ float sh[32];
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const float *xr = x + r * N;
    float *yr = y + r * N;
    float mean, rstd;
    rowMoments(xr, N, eps, sh, mean, rstd);
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
      float v = (xr[i] - mean) * rstd;
      if (scale)
        v *= scale[i];
      if (bias)
        v += bias[i];
      yr[i] = v;
    }
  }
}

/// dx per row; with `part`, block b also sums dy * xhat and dy over its rows
/// into part[b][0, N) and part[b][N, 2N) (each thread owns its columns, so
/// no two threads touch one entry).
__global__ void layerNormGradKernel(const float *x, const float *scale, float eps, const float *dy,
                                    float *dx, float *part, int64_t R, int64_t N) {
  __shared__ float sh[32];
  float *ps = part ? part + static_cast<int64_t>(blockIdx.x) * 2 * N : nullptr;
  bool first = true;
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const float *xr = x + r * N, *gr = dy + r * N;
    float *dr = dx + r * N;
    float mean, rstd;
    rowMoments(xr, N, eps, sh, mean, rstd);
    // With g = dy * scale and xhat = (x - mean) * rstd:
    // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
    float sg = 0, sgx = 0;
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
      const float xh = (xr[i] - mean) * rstd;
      const float g = scale ? gr[i] * scale[i] : gr[i];
      sg += g;
      sgx += g * xh;
    }
    const float mg = blockSum(sg, sh) / static_cast<float>(N);
    const float mgx = blockSum(sgx, sh) / static_cast<float>(N);
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
      const float xh = (xr[i] - mean) * rstd;
      const float g = scale ? gr[i] * scale[i] : gr[i];
      dr[i] = rstd * (g - mg - xh * mgx);
      if (ps) {
        ps[i] = first ? gr[i] * xh : ps[i] + gr[i] * xh;
        ps[N + i] = first ? gr[i] : ps[N + i] + gr[i];
      }
    }
    first = false;
  }
}

__global__ void rmsNormKernel(const float *x, const float *scale, float eps, float *y, int64_t R,
                              int64_t N) {
  __shared__ float sh[32];
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const float *xr = x + r * N;
    float *yr = y + r * N;
    const float rs = rowRms(xr, N, eps, sh);
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x)
      yr[i] = scale ? xr[i] * rs * scale[i] : xr[i] * rs;
  }
}

/// As layerNormGradKernel; `part` (when set) gets the sums of dy * xhat only.
__global__ void rmsNormGradKernel(const float *x, const float *scale, float eps, const float *dy,
                                  float *dx, float *part, int64_t R, int64_t N) {
  __shared__ float sh[32];
  float *ps = part ? part + static_cast<int64_t>(blockIdx.x) * N : nullptr;
  bool first = true;
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const float *xr = x + r * N, *gr = dy + r * N;
    float *dr = dx + r * N;
    const float rs = rowRms(xr, N, eps, sh);
    // With g = dy * scale and xhat = x * rs: dx = rs * (g - xhat * mean(g * xhat)).
    float sgx = 0;
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
      const float g = scale ? gr[i] * scale[i] : gr[i];
      sgx += g * (xr[i] * rs);
    }
    const float mgx = blockSum(sgx, sh) / static_cast<float>(N);
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
      const float xh = xr[i] * rs;
      const float g = scale ? gr[i] * scale[i] : gr[i];
      dr[i] = rs * (g - xh * mgx);
      if (ps)
        ps[i] = first ? gr[i] * xh : ps[i] + gr[i] * xh;
    }
    first = false;
  }
}

/// out[c][i] = sum over blocks b of part[b][c][i] (parts of `width` rows of N
/// each, c < width), in a fixed order; out[c] null is skipped.
__global__ void sumPartials(const float *part, int64_t blocks, int64_t N, int width, float *out0,
                            float *out1) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < N;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double s0 = 0, s1 = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      s0 += part[b * width * N + i];
      if (width > 1)
        s1 += part[b * width * N + N + i];
    }
    if (out0)
      out0[i] = static_cast<float>(s0);
    if (out1)
      out1[i] = static_cast<float>(s1);
  }
}

/// Blocks of the norm gradients: enough to fill the device, few enough that
/// their partial rows (`width` x N floats each) stay small.
int64_t normGradBlocks(int64_t R, int64_t N, int width) {
  const int64_t byMemory = std::max<int64_t>(1, (int64_t(1) << 26) / (width * N));
  return std::max<int64_t>(1, std::min<int64_t>({R, 1024, byMemory}));
}

//===--- Attention --------------------------------------------------------===//

/// Queries (and keys) per tile; a block is 32 rows of 8 threads.
constexpr int kTile = 32;
constexpr int kAttnThreads = 256;
/// Head-dimension elements per step of a tile's dot products.
constexpr int kChunk = 32;
constexpr int kPad = kTile + 1;

/// One attention call's shapes and mask, by value into the kernels.
struct AttnArgs {
  int64_t items = 1, tq = 0, tk = 0, d = 0, dv = 0;
  int nb = 0;
  int64_t bd[kMaxRank] = {};  // batch dims
  int64_t mbs[kMaxRank] = {}; // the mask's stride along each (0: broadcast)
  int64_t mRow = 0, mCol = 0; // the mask's query and key strides
  const float *mask = nullptr;
  float scale = 1;
  bool causal = false;
  int prec = 0; // Precision of q, k, v and dy on load

  __host__ __device__ int64_t maskOffset(int64_t item) const {
    int64_t off = 0;
    for (int i = nb - 1; i >= 0; --i) {
      off += (item % bd[i]) * mbs[i];
      item /= bd[i];
    }
    return off;
  }
};

/// The checks and mask strides of attnGeom (runtime/src/kernels_linalg.cpp).
AttnArgs attnArgs(const char *op, const Dims &qs, const Dims &ks, const Dims &vs, const float *mask,
                  const Dims &ms, float scale, bool causal) {
  const int r = qs.rank;
  if (r < 2 || ks.rank != r || vs.rank != r)
    fatal("%s: q, k and v must have one rank >= 2 (got %d, %d, %d)", op, qs.rank, ks.rank, vs.rank);
  AttnArgs g;
  g.nb = r - 2;
  for (int i = 0; i < g.nb; ++i) {
    if (ks.d[i] != qs.d[i] || vs.d[i] != qs.d[i])
      fatal("%s: the batch dimensions of q, k and v differ at dimension %d", op, i);
    g.bd[i] = qs.d[i];
    g.items *= qs.d[i];
  }
  g.tq = qs.d[r - 2];
  g.d = qs.d[r - 1];
  g.tk = ks.d[r - 2];
  g.dv = vs.d[r - 1];
  if (ks.d[r - 1] != g.d || vs.d[r - 2] != g.tk)
    fatal("%s: k [.., %lld, %lld] and v [.., %lld, %lld] do not match q [.., %lld, %lld]", op,
          (long long)ks.d[r - 2], (long long)ks.d[r - 1], (long long)vs.d[r - 2],
          (long long)vs.d[r - 1], (long long)g.tq, (long long)g.d);
  if (mask) {
    Dims target(qs.d, r);
    target.d[r - 1] = g.tk;
    if (ms.rank > r)
      fatal("%s: the mask's rank %d exceeds the scores' rank %d", op, ms.rank, r);
    const int off = r - ms.rank;
    int64_t stride = 1;
    int64_t st[kMaxRank];
    for (int i = r - 1; i >= 0; --i) {
      const int64_t dim = i >= off ? ms.d[i - off] : 1;
      if (dim != 1 && dim != target.d[i])
        fatal("%s: mask dimension of size %lld does not broadcast to %lld", op, (long long)dim,
              (long long)target.d[i]);
      st[i] = dim == 1 ? 0 : stride;
      stride *= dim;
    }
    for (int i = 0; i < g.nb; ++i)
      g.mbs[i] = st[i];
    g.mRow = st[r - 2];
    g.mCol = st[r - 1];
  }
  if (g.d == 0)
    fatal("%s: head dimension 0", op);
  g.mask = mask;
  g.scale = scale;
  g.causal = causal;
  g.prec = static_cast<int>(precision());
  return g;
}

/// x rounded to the matmul precision (Precision's values) and back, as the
/// CPU target's roundInput.
__device__ __forceinline__ float roundTo(float x, int prec) {
  if (prec == static_cast<int>(Precision::BF16))
    return __bfloat162float(__float2bfloat16_rn(x));
  if (prec == static_cast<int>(Precision::F16))
    return __half2float(__float2half_rn(x));
  return x;
}

/// acc[m] = a_r . b_(l8 + 8m) for the thread's row r = tid / 8 and lane
/// l8 = tid % 8: the dot products of `na` rows at `a` with `nb` rows at `b`
/// (both of `width` elements, row-major, rows past na / nb read as 0), a
/// chunk of the width at a time through shared memory `sa` and `sb`
/// (kTile x kPad each).
__device__ void tileDot(const float *a, int na, const float *b, int nb, int64_t width, int prec,
                        float (&acc)[4], float *sa, float *sb) {
  const int tid = threadIdx.x, r = tid >> 3, l8 = tid & 7;
#pragma unroll
  for (int m = 0; m < 4; ++m)
    acc[m] = 0;
  for (int64_t c0 = 0; c0 < width; c0 += kChunk) {
    const int cw = static_cast<int>(min(static_cast<int64_t>(kChunk), width - c0));
    __syncthreads();
    for (int idx = tid; idx < kTile * kChunk; idx += kAttnThreads) {
      const int rr = idx / kChunk, cc = idx % kChunk;
      sa[rr * kPad + cc] = rr < na && cc < cw ? roundTo(a[rr * width + c0 + cc], prec) : 0.0f;
      sb[rr * kPad + cc] = rr < nb && cc < cw ? roundTo(b[rr * width + c0 + cc], prec) : 0.0f;
    }
    __syncthreads();
    for (int cc = 0; cc < cw; ++cc) {
      const float av = sa[r * kPad + cc];
#pragma unroll
      for (int m = 0; m < 4; ++m)
        acc[m] = fmaf(av, sb[(l8 + 8 * m) * kPad + cc], acc[m]);
    }
  }
}

/// Loads columns [col0, col0 + W) of `n` rows at `g` (row stride ld, `cols`
/// columns) into sc [kTile][W], zeros past the edges.
template <int W>
__device__ void loadColumns(const float *g, int64_t ld, int n, int64_t col0, int64_t cols, int prec,
                            float *sc) {
  for (int idx = threadIdx.x; idx < kTile * W; idx += kAttnThreads) {
    const int j = idx / W, c = idx % W;
    sc[idx] = j < n && col0 + c < cols ? roundTo(g[j * ld + col0 + c], prec) : 0.0f;
  }
}

/// acc[n] += sum_j ps[r][j] * sc[j][l8 + 8n] over the n rows of sc.
template <int NV>
__device__ __forceinline__ void accumulate(const float *ps, const float *sc, int n,
                                           float (&acc)[NV]) {
  constexpr int W = 8 * NV;
  const int r = threadIdx.x >> 3, l8 = threadIdx.x & 7;
  for (int j = 0; j < n; ++j) {
    const float p = ps[r * kPad + j];
#pragma unroll
    for (int c = 0; c < NV; ++c)
      acc[c] = fmaf(p, sc[j * W + l8 + 8 * c], acc[c]);
  }
}

/// Shared memory of the attention kernels: the dot-product chunks, later the
/// column tile of the accumulation (never live at once), and one score tile.
template <int NV> struct AttnShared {
  static constexpr int kBuf = 2 * kTile * kPad > kTile * 8 * NV ? 2 * kTile *kPad : kTile * 8 * NV;
  float buf[kBuf];
  float ps[kTile * kPad];
};

/// The score of query i against key j: scale * (q_i . k_j) + mask, or -inf
/// when the pair is outside the tile or hidden by causality.
__device__ __forceinline__ float score(const AttnArgs &g, int64_t moff, bool inside, int64_t i,
                                       int64_t j, float dot) {
  if (!inside || (g.causal && j > i))
    return kNegInf;
  float s = dot * g.scale;
  if (g.mask)
    s += g.mask[moff + i * g.mRow + j * g.mCol];
  return s;
}

/// y = softmax(scores) v for a tile of 32 queries and columns
/// [blockIdx.y * 8NV, +8NV) of v; with `lse`, also each row's log-sum-exp
/// (-inf for a row with no visible key).
template <int NV>
__global__ void __launch_bounds__(kAttnThreads, 2)
    attnForward(AttnArgs g, const float *q, const float *k, const float *v, float *y, float *lse) {
  constexpr int W = 8 * NV;
  __shared__ AttnShared<NV> sm;
  const int r = threadIdx.x >> 3, l8 = threadIdx.x & 7;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * W;
  const int64_t qTiles = (g.tq + kTile - 1) / kTile;
  for (int64_t t = blockIdx.x; t < g.items * qTiles; t += gridDim.x) {
    const int64_t item = t / qTiles, i0 = (t % qTiles) * kTile, i = i0 + r;
    const int nq = static_cast<int>(min(static_cast<int64_t>(kTile), g.tq - i0));
    const int64_t nk = g.causal ? min(g.tk, i0 + nq) : g.tk;
    const int64_t moff = g.mask ? g.maskOffset(item) : 0;
    const float *qb = q + (item * g.tq + i0) * g.d;
    float m = kNegInf, l = 0, o[NV];
#pragma unroll
    for (int c = 0; c < NV; ++c)
      o[c] = 0;
    for (int64_t j0 = 0; j0 < nk; j0 += kTile) {
      const int nkt = static_cast<int>(min(static_cast<int64_t>(kTile), nk - j0));
      float s[4];
      tileDot(qb, nq, k + (item * g.tk + j0) * g.d, nkt, g.d, g.prec, s, sm.buf,
              sm.buf + kTile * kPad);
      float tm = kNegInf;
#pragma unroll
      for (int mm = 0; mm < 4; ++mm) {
        const int jj = l8 + 8 * mm;
        s[mm] = score(g, moff, r < nq && jj < nkt, i, j0 + jj, s[mm]);
        tm = fmaxf(tm, s[mm]);
      }
      // The 8 threads of a row are 8 adjacent lanes.
      for (int o8 = 4; o8 > 0; o8 >>= 1)
        tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, o8));
      const float mNew = fmaxf(m, tm);
      // While every score so far is -inf nothing is accumulated; guarding
      // keeps exp(-inf - -inf) from turning the row into NaN.
      const float alpha = mNew == kNegInf ? 1.0f : expf(m - mNew);
      float rs = 0;
#pragma unroll
      for (int mm = 0; mm < 4; ++mm) {
        const float p = mNew == kNegInf ? 0.0f : expf(s[mm] - mNew);
        rs += p;
        sm.ps[r * kPad + l8 + 8 * mm] = p;
      }
      for (int o8 = 4; o8 > 0; o8 >>= 1)
        rs += __shfl_xor_sync(0xffffffffu, rs, o8);
      l = l * alpha + rs;
      m = mNew;
#pragma unroll
      for (int c = 0; c < NV; ++c)
        o[c] *= alpha;
      __syncthreads();
      loadColumns<W>(v + (item * g.tk + j0) * g.dv, g.dv, nkt, col0, g.dv, g.prec, sm.buf);
      __syncthreads();
      accumulate<NV>(sm.ps, sm.buf, nkt, o);
      __syncthreads();
    }
    if (r < nq) {
      // l == 0: no visible key (the CPU's all -inf row) gives 0; a NaN score
      // leaves l NaN, and the NaN propagates as on the CPU.
      const float inv = l == 0.0f ? 0.0f : 1.0f / l;
      float *yr = y + (item * g.tq + i) * g.dv;
#pragma unroll
      for (int c = 0; c < NV; ++c)
        if (col0 + l8 + 8 * c < g.dv)
          yr[col0 + l8 + 8 * c] = l == 0.0f ? 0.0f : o[c] * inv;
      if (lse && blockIdx.y == 0 && l8 == 0)
        lse[item * g.tq + i] = l == 0.0f ? kNegInf : m + logf(l);
    }
  }
}

/// di[row] = dy[row] . o[row] (dy rounded as the backward reads it): the
/// sum over keys of P * dP that the softmax backward subtracts.
__global__ void attnRowDot(const float *dy, const float *o, float *di, int64_t rows, int64_t dv,
                           int prec) {
  const RowGroup<false> g;
  for (int64_t row = g.first; row < rows; row += g.stride) {
    float s = 0;
    for (int64_t c = g.lane; c < dv; c += 32)
      s += roundTo(dy[row * dv + c], prec) * o[row * dv + c];
    s = warpSum(s);
    if (g.lane == 0)
      di[row] = s;
  }
}

/// dq for a tile of 32 queries and columns [blockIdx.y * 8NV, +8NV) of q:
/// dq_i = sum_j dS_ij k_j with dS = P * (dP - D_i) * scale, dP = dY V^T.
template <int NV>
__global__ void __launch_bounds__(kAttnThreads, 2)
    attnGradQ(AttnArgs g, const float *q, const float *k, const float *v, const float *dy,
              const float *lse, const float *di, float *dq) {
  constexpr int W = 8 * NV;
  __shared__ AttnShared<NV> sm;
  const int r = threadIdx.x >> 3, l8 = threadIdx.x & 7;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * W;
  const int64_t qTiles = (g.tq + kTile - 1) / kTile;
  for (int64_t t = blockIdx.x; t < g.items * qTiles; t += gridDim.x) {
    const int64_t item = t / qTiles, i0 = (t % qTiles) * kTile, i = i0 + r;
    const int nq = static_cast<int>(min(static_cast<int64_t>(kTile), g.tq - i0));
    const int64_t nk = g.causal ? min(g.tk, i0 + nq) : g.tk;
    const int64_t moff = g.mask ? g.maskOffset(item) : 0;
    const float *qb = q + (item * g.tq + i0) * g.d;
    const float *dyb = dy + (item * g.tq + i0) * g.dv;
    const float li = r < nq ? lse[item * g.tq + i] : kNegInf;
    const float dii = r < nq ? di[item * g.tq + i] : 0.0f;
    float acc[NV];
#pragma unroll
    for (int c = 0; c < NV; ++c)
      acc[c] = 0;
    for (int64_t j0 = 0; j0 < nk; j0 += kTile) {
      const int nkt = static_cast<int>(min(static_cast<int64_t>(kTile), nk - j0));
      float s[4], dp[4];
      tileDot(qb, nq, k + (item * g.tk + j0) * g.d, nkt, g.d, g.prec, s, sm.buf,
              sm.buf + kTile * kPad);
      tileDot(dyb, nq, v + (item * g.tk + j0) * g.dv, nkt, g.dv, g.prec, dp, sm.buf,
              sm.buf + kTile * kPad);
#pragma unroll
      for (int mm = 0; mm < 4; ++mm) {
        const int jj = l8 + 8 * mm;
        const float sv = score(g, moff, r < nq && jj < nkt, i, j0 + jj, s[mm]);
        const float p = li == kNegInf || sv == kNegInf ? 0.0f : expf(sv - li);
        sm.ps[r * kPad + jj] = p * (dp[mm] - dii) * g.scale;
      }
      __syncthreads();
      loadColumns<W>(k + (item * g.tk + j0) * g.d, g.d, nkt, col0, g.d, g.prec, sm.buf);
      __syncthreads();
      accumulate<NV>(sm.ps, sm.buf, nkt, acc);
      __syncthreads();
    }
    if (r < nq) {
      float *dr = dq + (item * g.tq + i) * g.d;
#pragma unroll
      for (int c = 0; c < NV; ++c)
        if (col0 + l8 + 8 * c < g.d)
          dr[col0 + l8 + 8 * c] = acc[c];
    }
  }
}

/// dk or dv for a tile of 32 keys: blockIdx.y below ceil(d / 8NV) is a
/// column chunk of dk (dk_j = sum_i dS_ij q_i), the rest chunks of dv
/// (dv_j = sum_i P_ij dy_i). Causally, key j has queries i >= j only.
template <int NV>
__global__ void __launch_bounds__(kAttnThreads, 2)
    attnGradKV(AttnArgs g, const float *q, const float *k, const float *v, const float *dy,
               const float *lse, const float *di, float *dk, float *dv) {
  constexpr int W = 8 * NV;
  __shared__ AttnShared<NV> sm;
  const int r = threadIdx.x >> 3, l8 = threadIdx.x & 7;
  const int64_t chunksD = (g.d + W - 1) / W;
  const bool isV = blockIdx.y >= chunksD;
  const int64_t col0 = (isV ? blockIdx.y - chunksD : blockIdx.y) * static_cast<int64_t>(W);
  const int64_t width = isV ? g.dv : g.d;
  const int64_t kTiles = (g.tk + kTile - 1) / kTile;
  for (int64_t t = blockIdx.x; t < g.items * kTiles; t += gridDim.x) {
    const int64_t item = t / kTiles, j0 = (t % kTiles) * kTile, j = j0 + r;
    const int nkt = static_cast<int>(min(static_cast<int64_t>(kTile), g.tk - j0));
    const int64_t moff = g.mask ? g.maskOffset(item) : 0;
    const float *kb = k + (item * g.tk + j0) * g.d;
    const float *vb = v + (item * g.tk + j0) * g.dv;
    float acc[NV];
#pragma unroll
    for (int c = 0; c < NV; ++c)
      acc[c] = 0;
    for (int64_t i0 = g.causal ? j0 : 0; i0 < g.tq; i0 += kTile) {
      const int nq = static_cast<int>(min(static_cast<int64_t>(kTile), g.tq - i0));
      const float *qb = q + (item * g.tq + i0) * g.d;
      const float *dyb = dy + (item * g.tq + i0) * g.dv;
      float s[4], dp[4] = {0, 0, 0, 0};
      tileDot(kb, nkt, qb, nq, g.d, g.prec, s, sm.buf, sm.buf + kTile * kPad);
      if (!isV)
        tileDot(vb, nkt, dyb, nq, g.dv, g.prec, dp, sm.buf, sm.buf + kTile * kPad);
#pragma unroll
      for (int mm = 0; mm < 4; ++mm) {
        const int ii = l8 + 8 * mm;
        const bool inside = r < nkt && ii < nq;
        const int64_t i = i0 + ii;
        const float sv = score(g, moff, inside, i, j, s[mm]);
        const float li = inside ? lse[item * g.tq + i] : kNegInf;
        const float p = li == kNegInf || sv == kNegInf ? 0.0f : expf(sv - li);
        sm.ps[r * kPad + ii] =
            isV ? p : (inside ? p * (dp[mm] - di[item * g.tq + i]) * g.scale : 0.0f);
      }
      __syncthreads();
      loadColumns<W>(isV ? dyb : qb, width, nq, col0, width, g.prec, sm.buf);
      __syncthreads();
      accumulate<NV>(sm.ps, sm.buf, nq, acc);
      __syncthreads();
    }
    if (r < nkt) {
      float *dr = (isV ? dv : dk) + (item * g.tk + j) * width;
#pragma unroll
      for (int c = 0; c < NV; ++c)
        if (col0 + l8 + 8 * c < width)
          dr[col0 + l8 + 8 * c] = acc[c];
    }
  }
}

/// Accumulators per thread (8 threads share a row) for `width` columns per
/// block: the smallest of 2, 4, 8, 16, 32 that covers it, 32 past 256.
int accumulatorsFor(int64_t width) {
  const int64_t need = (width + 7) / 8;
  return need <= 2 ? 2 : need <= 4 ? 4 : need <= 8 ? 8 : need <= 16 ? 16 : 32;
}

/// Column chunks of `width` for blocks of 8 * nv columns.
unsigned chunksFor(int64_t width, int nv, const char *op) {
  const int64_t c = std::max<int64_t>(1, (width + 8 * nv - 1) / (8 * nv));
  if (c > 65535)
    fatal("%s: a head dimension of %lld is too large for the CUDA kernel", op, (long long)width);
  return static_cast<unsigned>(c);
}

#define CARVE_ATTN_DISPATCH(nv, kernel, grid, ...)                                                 \
  do {                                                                                             \
    switch (nv) {                                                                                  \
    case 2:                                                                                        \
      kernel<2><<<grid, kAttnThreads, 0, stream()>>>(__VA_ARGS__);                                 \
      break;                                                                                       \
    case 4:                                                                                        \
      kernel<4><<<grid, kAttnThreads, 0, stream()>>>(__VA_ARGS__);                                 \
      break;                                                                                       \
    case 8:                                                                                        \
      kernel<8><<<grid, kAttnThreads, 0, stream()>>>(__VA_ARGS__);                                 \
      break;                                                                                       \
    case 16:                                                                                       \
      kernel<16><<<grid, kAttnThreads, 0, stream()>>>(__VA_ARGS__);                                \
      break;                                                                                       \
    default:                                                                                       \
      kernel<32><<<grid, kAttnThreads, 0, stream()>>>(__VA_ARGS__);                                \
      break;                                                                                       \
    }                                                                                              \
  } while (0)

/// The forward into y (and the row log-sum-exp into lse when set).
void attnForwardLaunch(const AttnArgs &g, const float *q, const float *k, const float *v, float *y,
                       float *lse, const char *op) {
  const int nv = accumulatorsFor(g.dv);
  const dim3 grid(gridFor(g.items * ((g.tq + kTile - 1) / kTile)), chunksFor(g.dv, nv, op));
  CARVE_ATTN_DISPATCH(nv, attnForward, grid, g, q, k, v, y, lse);
  checkLaunch(op);
}

//===--- Cross entropy ----------------------------------------------------===//

/// Logits [N, C, S...] against targets [N, S...]: e = N * S elements, class
/// stride s.
struct CeGeom {
  int64_t n = 0, c = 0, s = 1, e = 0;
};

CeGeom ceGeom(const char *op, const Dims &ls, int reduction) {
  if (reduction < 0 || reduction > 2)
    fatal("%s: unknown reduction %d", op, reduction);
  if (ls.rank < 2)
    fatal("%s: logits of rank %d (need [N, C, ...])", op, ls.rank);
  CeGeom g;
  g.n = ls.d[0];
  g.c = ls.d[1];
  g.s = prod(ls, 2, ls.rank);
  g.e = g.n * g.s;
  return g;
}

__device__ __forceinline__ bool ignored(int64_t t, bool hasIgnore, int64_t ignoreIndex) {
  return hasIgnore && t == ignoreIndex;
}

/// *count += the targets not ignored; with `classes` >= 0, a target outside
/// [0, classes) is recorded in the device error record.
__global__ void ceCount(const int64_t *targets, int64_t e, bool hasIgnore, int64_t ignoreIndex,
                        int64_t classes, DeviceError *err, unsigned long long *count) {
  __shared__ unsigned long long sh[32];
  unsigned long long n = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < e;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = targets[i];
    if (ignored(t, hasIgnore, ignoreIndex))
      continue;
    ++n;
    if (classes >= 0 && (t < 0 || t >= classes))
      raiseDeviceError(err, kBadTarget, t, i, classes);
  }
  n = blockSum(n, sh);
  if (threadIdx.x == 0 && n)
    atomicAdd(count, n);
}

/// The weight of element i in dlogits: 0 if ignored, dy[i] for reduction
/// none, dy[0] / count for mean, dy[0] for sum.
__device__ __forceinline__ double ceWeight(int64_t t, int64_t i, bool hasIgnore,
                                           int64_t ignoreIndex, int reduction, const float *dy,
                                           const unsigned long long *count) {
  if (ignored(t, hasIgnore, ignoreIndex))
    return 0.0;
  if (reduction == 2)
    return dy[i];
  return reduction == 0 ? dy[0] / static_cast<double>(*count) : static_cast<double>(dy[0]);
}

/// Sums per-thread values of the block in a fixed order into part[blockIdx.x].
__device__ void blockPartial(double v, double *sh, double *part) {
  v = blockSum(v, sh);
  if (threadIdx.x == 0)
    part[blockIdx.x] = v;
}

/// Loss of contiguous rows (class stride 1), one row per group.
template <bool kBlock>
__global__ void ceLossRows(const float *logits, const int64_t *targets, int64_t rows, int64_t C,
                           bool hasIgnore, int64_t ignoreIndex, int reduction, float *y,
                           double *part) {
  __shared__ float sh[32];
  __shared__ double shd[32];
  const RowGroup<kBlock> g;
  double acc = 0; // on the group's lane 0
  for (int64_t row = g.first; row < rows; row += g.stride) {
    const float *xr = logits + row * C;
    float m = kNegInf;
    for (int64_t j = g.lane; j < C; j += g.size)
      m = fmaxf(m, xr[j]);
    m = g.max(m, sh);
    float s = 0;
    for (int64_t j = g.lane; j < C; j += g.size)
      s += expf(xr[j] - m);
    s = g.sum(s, sh);
    if (g.lane == 0) {
      const int64_t t = targets[row];
      double loss = 0;
      // -log_softmax at the target: -(x_t - max - log(sum)). Out-of-range
      // targets were recorded by ceCount; they add nothing here.
      if (!ignored(t, hasIgnore, ignoreIndex) && t >= 0 && t < C)
        loss = -((static_cast<double>(xr[t]) - m) - log(static_cast<double>(s)));
      if (reduction == 2)
        y[row] = static_cast<float>(loss);
      else
        acc += loss;
    }
  }
  if (reduction != 2)
    blockPartial(acc, shd, part);
}

/// Loss with a class stride s > 1: one thread per element, adjacent threads
/// on adjacent positions.
__global__ void ceLossStrided(const float *logits, const int64_t *targets, int64_t e, int64_t C,
                              int64_t S, bool hasIgnore, int64_t ignoreIndex, int reduction,
                              float *y, double *part) {
  __shared__ double shd[32];
  double acc = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < e;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / S, u = i % S;
    const float *base = logits + n * C * S + u;
    float m = kNegInf;
    for (int64_t j = 0; j < C; ++j)
      m = fmaxf(m, base[j * S]);
    float s = 0;
    for (int64_t j = 0; j < C; ++j)
      s += expf(base[j * S] - m);
    const int64_t t = targets[i];
    double loss = 0;
    if (!ignored(t, hasIgnore, ignoreIndex) && t >= 0 && t < C)
      loss = -((static_cast<double>(base[t * S]) - m) - log(static_cast<double>(s)));
    if (reduction == 2)
      y[i] = static_cast<float>(loss);
    else
      acc += loss;
  }
  if (reduction != 2)
    blockPartial(acc, shd, part);
}

/// y[0] = the sum of `np` partials, divided by *count for the mean (0/0 is
/// NaN, as in PyTorch, when every element is ignored).
__global__ void ceFinish(const double *part, int np, const unsigned long long *count, int reduction,
                         float *y) {
  __shared__ double shd[32];
  double s = 0;
  for (int b = threadIdx.x; b < np; b += blockDim.x)
    s += part[b];
  s = blockSum(s, shd);
  if (threadIdx.x == 0)
    y[0] = static_cast<float>(reduction == 0 ? s / static_cast<double>(*count) : s);
}

/// dlogits = w * (softmax - onehot(target)) for contiguous rows.
template <bool kBlock>
__global__ void ceGradRows(const float *logits, const int64_t *targets, int64_t rows, int64_t C,
                           bool hasIgnore, int64_t ignoreIndex, int reduction, const float *dy,
                           const unsigned long long *count, float *dlogits) {
  __shared__ float sh[32];
  const RowGroup<kBlock> g;
  for (int64_t row = g.first; row < rows; row += g.stride) {
    const float *xr = logits + row * C;
    float *dr = dlogits + row * C;
    float m = kNegInf;
    for (int64_t j = g.lane; j < C; j += g.size)
      m = fmaxf(m, xr[j]);
    m = g.max(m, sh);
    float s = 0;
    for (int64_t j = g.lane; j < C; j += g.size)
      s += expf(xr[j] - m);
    s = g.sum(s, sh);
    const int64_t t = targets[row];
    const double w = ceWeight(t, row, hasIgnore, ignoreIndex, reduction, dy, count);
    const float ws = static_cast<float>(w / s), wf = static_cast<float>(w);
    for (int64_t j = g.lane; j < C; j += g.size) {
      float d = ws * expf(xr[j] - m);
      if (j == t && w != 0.0)
        d -= wf;
      dr[j] = d;
    }
  }
}

__global__ void ceGradStrided(const float *logits, const int64_t *targets, int64_t e, int64_t C,
                              int64_t S, bool hasIgnore, int64_t ignoreIndex, int reduction,
                              const float *dy, const unsigned long long *count, float *dlogits) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < e;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / S, u = i % S;
    const float *base = logits + n * C * S + u;
    float *dbase = dlogits + n * C * S + u;
    float m = kNegInf;
    for (int64_t j = 0; j < C; ++j)
      m = fmaxf(m, base[j * S]);
    float s = 0;
    for (int64_t j = 0; j < C; ++j)
      s += expf(base[j * S] - m);
    const int64_t t = targets[i];
    const double w = ceWeight(t, i, hasIgnore, ignoreIndex, reduction, dy, count);
    const float ws = static_cast<float>(w / s), wf = static_cast<float>(w);
    for (int64_t j = 0; j < C; ++j) {
      float d = ws * expf(base[j * S] - m);
      if (j == t && w != 0.0)
        d -= wf;
      dbase[j * S] = d;
    }
  }
}

/// Device scratch of one cross-entropy call: the count of elements not
/// ignored, then the per-block partial sums.
struct CeScratch {
  unsigned long long *count;
  double *part;
};

CeScratch ceScratch(int parts, size_t extraBytes, void **extra) {
  const size_t head = 256,
               partBytes = (static_cast<size_t>(parts) * sizeof(double) + 255) / 256 * 256;
  char *p = static_cast<char *>(workspace(head + partBytes + extraBytes, kWsFused0));
  CARVE_CUDA_CHECK(cudaMemsetAsync(p, 0, sizeof(unsigned long long), stream()));
  if (extra)
    *extra = p + head + partBytes;
  return {reinterpret_cast<unsigned long long *>(p), reinterpret_cast<double *>(p + head)};
}

/// Counts (and with classes >= 0 checks) the targets into s.count.
void ceCountLaunch(const int64_t *targets, int64_t e, bool hasIgnore, int64_t ignoreIndex,
                   int64_t classes, const CeScratch &s, const char *op) {
  if (e == 0)
    return;
  ceCount<<<blocksFor(e), kThreads, 0, stream()>>>(targets, e, hasIgnore, ignoreIndex, classes,
                                                   deviceError(), s.count);
  checkLaunch(op);
}

//===--- Vocabulary-parallel cross entropy --------------------------------===//

/// mx[e] = the max of element e over this rank's classes.
template <bool kBlock>
__global__ void vpMaxRows(const float *logits, int64_t rows, int64_t C, float *mx) {
  __shared__ float sh[32];
  const RowGroup<kBlock> g;
  for (int64_t row = g.first; row < rows; row += g.stride) {
    float m = kNegInf;
    for (int64_t j = g.lane; j < C; j += g.size)
      m = fmaxf(m, logits[row * C + j]);
    m = g.max(m, sh);
    if (g.lane == 0)
      mx[row] = m;
  }
}

__global__ void vpMaxStrided(const float *logits, int64_t e, int64_t C, int64_t S, float *mx) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < e;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float *base = logits + (i / S) * C * S + i % S;
    float m = kNegInf;
    for (int64_t j = 0; j < C; ++j)
      m = fmaxf(m, base[j * S]);
    mx[i] = m;
  }
}

/// acc[i] = sum over this rank's classes of exp(x - mx[i]); with `tlogit`,
/// tlogit[i] = the target's logit when this rank holds its class, else 0.
template <bool kBlock>
__global__ void vpSumRows(const float *logits, const int64_t *targets, int64_t rows, int64_t C,
                          int64_t vocabOffset, bool hasIgnore, int64_t ignoreIndex, const float *mx,
                          double *acc, double *tlogit) {
  __shared__ float sh[32];
  const RowGroup<kBlock> g;
  for (int64_t row = g.first; row < rows; row += g.stride) {
    const float *xr = logits + row * C;
    const float m = mx[row];
    float s = 0;
    for (int64_t j = g.lane; j < C; j += g.size)
      s += expf(xr[j] - m);
    s = g.sum(s, sh);
    if (g.lane == 0) {
      acc[row] = s;
      if (tlogit) {
        const int64_t t = targets[row], k = t - vocabOffset;
        const bool mine = !ignored(t, hasIgnore, ignoreIndex) && k >= 0 && k < C;
        tlogit[row] = mine ? static_cast<double>(xr[k]) : 0.0;
      }
    }
  }
}

__global__ void vpSumStrided(const float *logits, const int64_t *targets, int64_t e, int64_t C,
                             int64_t S, int64_t vocabOffset, bool hasIgnore, int64_t ignoreIndex,
                             const float *mx, double *acc, double *tlogit) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < e;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float *base = logits + (i / S) * C * S + i % S;
    const float m = mx[i];
    float s = 0;
    for (int64_t j = 0; j < C; ++j)
      s += expf(base[j * S] - m);
    acc[i] = s;
    if (tlogit) {
      const int64_t t = targets[i], k = t - vocabOffset;
      const bool mine = !ignored(t, hasIgnore, ignoreIndex) && k >= 0 && k < C;
      tlogit[i] = mine ? static_cast<double>(base[k * S]) : 0.0;
    }
  }
}

/// Records the CPU kernel's stops once the vocabulary (the sum of every
/// rank's class count) is known: this rank's classes outside it (reported as
/// its last class at element -1), or a target outside [0, vocab).
__device__ void vpCheck(int64_t i, int64_t t, bool hasIgnore, int64_t ignoreIndex,
                        int64_t vocabOffset, int64_t C, int64_t vocab, DeviceError *err) {
  if (i == 0 && (vocabOffset < 0 || vocabOffset + C > vocab))
    raiseDeviceError(err, kBadTarget, vocabOffset < 0 ? vocabOffset : vocabOffset + C - 1, -1,
                     vocab);
  if (!ignored(t, hasIgnore, ignoreIndex) && (t < 0 || t >= vocab))
    raiseDeviceError(err, kBadTarget, t, i, vocab);
}

/// The loss from the all-reduced statistics: acc = [sum of exp (e) | target
/// logit (e) | vocabulary (1)].
__global__ void vpLoss(const int64_t *targets, int64_t e, int64_t C, int64_t vocabOffset,
                       bool hasIgnore, int64_t ignoreIndex, int reduction, const float *mx,
                       const double *acc, DeviceError *err, float *y, double *part) {
  __shared__ double shd[32];
  const int64_t vocab = static_cast<int64_t>(acc[2 * e]);
  double sum = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < e;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = targets[i];
    vpCheck(i, t, hasIgnore, ignoreIndex, vocabOffset, C, vocab, err);
    double loss = 0;
    if (!ignored(t, hasIgnore, ignoreIndex))
      loss = -((acc[e + i] - mx[i]) - log(acc[i]));
    if (reduction == 2)
      y[i] = static_cast<float>(loss);
    else
      sum += loss;
  }
  if (reduction != 2)
    blockPartial(sum, shd, part);
}

/// This rank's dlogits: w * (softmax - onehot(target)), the onehot term only
/// where this rank holds the target class; acc = [sum of exp (e) | vocab].
template <bool kBlock>
__global__ void vpGradRows(const float *logits, const int64_t *targets, int64_t rows, int64_t C,
                           int64_t vocabOffset, bool hasIgnore, int64_t ignoreIndex, int reduction,
                           const float *dy, const unsigned long long *count, const float *mx,
                           const double *acc, DeviceError *err, float *dlogits) {
  const RowGroup<kBlock> g;
  const int64_t vocab = static_cast<int64_t>(acc[rows]);
  for (int64_t row = g.first; row < rows; row += g.stride) {
    const float *xr = logits + row * C;
    float *dr = dlogits + row * C;
    const int64_t t = targets[row], k = t - vocabOffset;
    if (g.lane == 0)
      vpCheck(row, t, hasIgnore, ignoreIndex, vocabOffset, C, vocab, err);
    const double w = ceWeight(t, row, hasIgnore, ignoreIndex, reduction, dy, count);
    const float ws = static_cast<float>(w / acc[row]), wf = static_cast<float>(w), m = mx[row];
    for (int64_t j = g.lane; j < C; j += g.size) {
      float d = ws * expf(xr[j] - m);
      if (j == k && w != 0.0)
        d -= wf;
      dr[j] = d;
    }
  }
}

__global__ void vpGradStrided(const float *logits, const int64_t *targets, int64_t e, int64_t C,
                              int64_t S, int64_t vocabOffset, bool hasIgnore, int64_t ignoreIndex,
                              int reduction, const float *dy, const unsigned long long *count,
                              const float *mx, const double *acc, DeviceError *err,
                              float *dlogits) {
  const int64_t vocab = static_cast<int64_t>(acc[e]);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < e;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / S, u = i % S;
    const float *base = logits + n * C * S + u;
    float *dbase = dlogits + n * C * S + u;
    const int64_t t = targets[i], k = t - vocabOffset;
    vpCheck(i, t, hasIgnore, ignoreIndex, vocabOffset, C, vocab, err);
    const double w = ceWeight(t, i, hasIgnore, ignoreIndex, reduction, dy, count);
    const float ws = static_cast<float>(w / acc[i]), wf = static_cast<float>(w), m = mx[i];
    for (int64_t j = 0; j < C; ++j) {
      float d = ws * expf(base[j * S] - m);
      if (j == k && w != 0.0)
        d -= wf;
      dbase[j * S] = d;
    }
  }
}

/// Writes v to *p (the local class count that the all-reduce turns into the
/// vocabulary).
__global__ void setDouble(double *p, double v) { *p = v; }

/// In-place all-reduce of device memory on `c`, ordered after the compute
/// stream's work and before its next (the NCCL communicator's contract).
void allReduceDevice(Communicator &c, void *buf, int64_t n, CommType t, ReduceOp op) {
  c.wait(c.allReduceAsync(buf, n, t, op));
}

/// Elements per block of the partial sums of the strided and loss kernels.
int partsFor(int64_t e) { return blocksFor(e); }

} // namespace

//===--- Softmax ----------------------------------------------------------===//

void softmax(const float *x, Dims xs, int axis, bool log, float *y) {
  axis = normAxis(axis, xs.rank, "softmax");
  const int64_t O = prod(xs, 0, axis), A = xs.d[axis], I = prod(xs, axis + 1, xs.rank);
  if (O * A * I == 0)
    return;
  if (I == 1)
    CARVE_LAUNCH_ROWS(softmaxRows, O, A, x, y, O, A, log);
  else
    softmaxColumns<<<blocksFor(O * I), kThreads, 0, stream()>>>(x, y, O, A, I, log);
  checkLaunch("softmax");
}

void softmax_grad(const float *y, const float *dy, Dims s, int axis, bool log, float *dx) {
  axis = normAxis(axis, s.rank, "softmax_grad");
  const int64_t O = prod(s, 0, axis), A = s.d[axis], I = prod(s, axis + 1, s.rank);
  if (O * A * I == 0)
    return;
  if (I == 1)
    CARVE_LAUNCH_ROWS(softmaxGradRows, O, A, y, dy, dx, O, A, log);
  else
    softmaxGradColumns<<<blocksFor(O * I), kThreads, 0, stream()>>>(y, dy, dx, O, A, I, log);
  checkLaunch("softmax_grad");
}

//===--- Layer and RMS norm -----------------------------------------------===//

void layer_norm(const float *x, Dims xs, int axis, const float *scale, const float *bias, float eps,
                float *y) {
  axis = normAxis(axis, xs.rank, "layer_norm");
  const int64_t R = prod(xs, 0, axis), N = prod(xs, axis, xs.rank);
  if (R * N == 0)
    return;
  layerNormKernel<<<gridFor(R), rowThreads(N), 0, stream()>>>(x, scale, bias, eps, y, R, N);
  checkLaunch("layer_norm");
}

void layer_norm_grad(const float *x, Dims xs, int axis, const float *scale, float eps,
                     const float *dy, float *dx, float *dscale, float *dbias) {
  axis = normAxis(axis, xs.rank, "layer_norm_grad");
  const int64_t R = prod(xs, 0, axis), N = prod(xs, axis, xs.rank);
  if (N == 0)
    return;
  const bool params = dscale || dbias;
  if (R == 0) {
    // Sums over no row.
    if (dscale)
      CARVE_CUDA_CHECK(cudaMemsetAsync(dscale, 0, N * sizeof(float), stream()));
    if (dbias)
      CARVE_CUDA_CHECK(cudaMemsetAsync(dbias, 0, N * sizeof(float), stream()));
    return;
  }
  const int64_t blocks = params ? normGradBlocks(R, N, 2) : gridFor(R);
  float *part =
      params ? static_cast<float *>(workspace(blocks * 2 * N * sizeof(float), kWsFused1)) : nullptr;
  layerNormGradKernel<<<static_cast<int>(blocks), rowThreads(N), 0, stream()>>>(x, scale, eps, dy,
                                                                                dx, part, R, N);
  checkLaunch("layer_norm_grad");
  if (!params)
    return;
  sumPartials<<<blocksFor(N), kThreads, 0, stream()>>>(part, blocks, N, 2, dscale, dbias);
  checkLaunch("layer_norm_grad");
}

void rms_norm(const float *x, Dims xs, int axis, const float *scale, float eps, float *y) {
  axis = normAxis(axis, xs.rank, "rms_norm");
  const int64_t R = prod(xs, 0, axis), N = prod(xs, axis, xs.rank);
  if (R * N == 0)
    return;
  rmsNormKernel<<<gridFor(R), rowThreads(N), 0, stream()>>>(x, scale, eps, y, R, N);
  checkLaunch("rms_norm");
}

void rms_norm_grad(const float *x, Dims xs, int axis, const float *scale, float eps,
                   const float *dy, float *dx, float *dscale) {
  axis = normAxis(axis, xs.rank, "rms_norm_grad");
  const int64_t R = prod(xs, 0, axis), N = prod(xs, axis, xs.rank);
  if (N == 0)
    return;
  if (R == 0) {
    if (dscale)
      CARVE_CUDA_CHECK(cudaMemsetAsync(dscale, 0, N * sizeof(float), stream()));
    return;
  }
  const int64_t blocks = dscale ? normGradBlocks(R, N, 1) : gridFor(R);
  float *part =
      dscale ? static_cast<float *>(workspace(blocks * N * sizeof(float), kWsFused1)) : nullptr;
  rmsNormGradKernel<<<static_cast<int>(blocks), rowThreads(N), 0, stream()>>>(x, scale, eps, dy, dx,
                                                                              part, R, N);
  checkLaunch("rms_norm_grad");
  if (!dscale)
    return;
  sumPartials<<<blocksFor(N), kThreads, 0, stream()>>>(part, blocks, N, 1, dscale, nullptr);
  checkLaunch("rms_norm_grad");
}

//===--- Attention --------------------------------------------------------===//

void attention(const float *q, Dims qs, const float *k, Dims ks, const float *v, Dims vs,
               const float *mask, Dims ms, float scale, bool causal, float *y) {
  const AttnArgs g = attnArgs("attention", qs, ks, vs, mask, ms, scale, causal);
  if (g.items == 0 || g.tq == 0 || g.dv == 0)
    return;
  attnForwardLaunch(g, q, k, v, y, nullptr, "attention");
}

void attention_grad(const float *q, Dims qs, const float *k, Dims ks, const float *v, Dims vs,
                    const float *mask, Dims ms, float scale, bool causal, const float *dy,
                    float *dq, float *dk, float *dv) {
  const char *op = "attention_grad";
  const AttnArgs g = attnArgs(op, qs, ks, vs, mask, ms, scale, causal);
  if (g.items == 0)
    return;
  const int64_t rows = g.items * g.tq;
  if (rows > 0) {
    // O (rows x dv), then the row log-sum-exp and D (rows each), 256-byte aligned.
    const size_t oBytes = (static_cast<size_t>(rows * g.dv) * sizeof(float) + 255) / 256 * 256;
    const size_t rBytes = (static_cast<size_t>(rows) * sizeof(float) + 255) / 256 * 256;
    char *w = static_cast<char *>(workspace(oBytes + 2 * rBytes, kWsFused2));
    float *o = reinterpret_cast<float *>(w);
    float *lse = reinterpret_cast<float *>(w + oBytes);
    float *di = reinterpret_cast<float *>(w + oBytes + rBytes);
    attnForwardLaunch(g, q, k, v, o, lse, op);
    attnRowDot<<<gridFor((rows + 7) / 8), 256, 0, stream()>>>(dy, o, di, rows, g.dv, g.prec);
    checkLaunch(op);
    const int nvq = accumulatorsFor(g.d);
    const dim3 gridQ(gridFor(g.items * ((g.tq + kTile - 1) / kTile)), chunksFor(g.d, nvq, op));
    CARVE_ATTN_DISPATCH(nvq, attnGradQ, gridQ, g, q, k, v, dy, lse, di, dq);
    checkLaunch(op);
    if (g.tk > 0) {
      const int nv = accumulatorsFor(std::max(g.d, g.dv));
      const unsigned chunks = chunksFor(g.d, nv, op) + (g.dv ? chunksFor(g.dv, nv, op) : 0);
      if (chunks > 65535)
        fatal("%s: head dimensions %lld and %lld are too large for the CUDA kernel", op,
              (long long)g.d, (long long)g.dv);
      const dim3 gridKV(gridFor(g.items * ((g.tk + kTile - 1) / kTile)), chunks);
      CARVE_ATTN_DISPATCH(nv, attnGradKV, gridKV, g, q, k, v, dy, lse, di, dk, dv);
      checkLaunch(op);
    }
    return;
  }
  // No query: dk and dv are sums over nothing.
  if (g.tk > 0) {
    CARVE_CUDA_CHECK(cudaMemsetAsync(dk, 0, g.items * g.tk * g.d * sizeof(float), stream()));
    if (g.dv)
      CARVE_CUDA_CHECK(cudaMemsetAsync(dv, 0, g.items * g.tk * g.dv * sizeof(float), stream()));
  }
}

//===--- Cross entropy ----------------------------------------------------===//

void cross_entropy(const float *logits, Dims ls, const int64_t *targets, int reduction,
                   bool hasIgnore, int64_t ignoreIndex, float *y) {
  const char *op = "cross_entropy";
  const CeGeom g = ceGeom(op, ls, reduction);
  const bool rows = g.s == 1;
  // Partials: one per block of the loss kernel.
  const int np =
      g.e == 0 ? 0
      : rows ? (g.c <= kWarpRow ? gridFor((g.e + kWarpRowThreads / 32 - 1) / (kWarpRowThreads / 32))
                                : gridFor(g.e))
             : partsFor(g.e);
  const CeScratch s = ceScratch(np, 0, nullptr);
  ceCountLaunch(targets, g.e, hasIgnore, ignoreIndex, g.c, s, op);
  if (g.e > 0) {
    if (rows)
      CARVE_LAUNCH_ROWS(ceLossRows, g.e, g.c, logits, targets, g.e, g.c, hasIgnore, ignoreIndex,
                        reduction, y, s.part);
    else
      ceLossStrided<<<np, kThreads, 0, stream()>>>(logits, targets, g.e, g.c, g.s, hasIgnore,
                                                   ignoreIndex, reduction, y, s.part);
    checkLaunch(op);
  }
  if (reduction != 2) {
    ceFinish<<<1, kThreads, 0, stream()>>>(s.part, np, s.count, reduction, y);
    checkLaunch(op);
  }
}

void cross_entropy_grad(const float *logits, Dims ls, const int64_t *targets, int reduction,
                        bool hasIgnore, int64_t ignoreIndex, const float *dy, float *dlogits) {
  const char *op = "cross_entropy_grad";
  const CeGeom g = ceGeom(op, ls, reduction);
  if (g.e == 0)
    return;
  const CeScratch s = ceScratch(0, 0, nullptr);
  ceCountLaunch(targets, g.e, hasIgnore, ignoreIndex, g.c, s, op);
  if (g.c == 0)
    return;
  if (g.s == 1)
    CARVE_LAUNCH_ROWS(ceGradRows, g.e, g.c, logits, targets, g.e, g.c, hasIgnore, ignoreIndex,
                      reduction, dy, s.count, dlogits);
  else
    ceGradStrided<<<blocksFor(g.e), kThreads, 0, stream()>>>(
        logits, targets, g.e, g.c, g.s, hasIgnore, ignoreIndex, reduction, dy, s.count, dlogits);
  checkLaunch(op);
}

//===--- Vocabulary-parallel cross entropy --------------------------------===//

namespace {

/// Scratch of a vocabulary-parallel call after the CeScratch head: mx (e
/// floats), then acc (`accDoubles` doubles).
struct VpScratch {
  CeScratch ce;
  float *mx;
  double *acc;
};

VpScratch vpScratch(int parts, int64_t e, int64_t accDoubles) {
  const size_t mxBytes = (static_cast<size_t>(e) * sizeof(float) + 255) / 256 * 256;
  void *extra = nullptr;
  VpScratch v;
  v.ce = ceScratch(parts, mxBytes + static_cast<size_t>(accDoubles) * sizeof(double), &extra);
  v.mx = static_cast<float *>(extra);
  v.acc = reinterpret_cast<double *>(static_cast<char *>(extra) + mxBytes);
  return v;
}

/// mx = the max over every rank's classes (all-reduced).
void vpGlobalMax(Communicator &c, const CeGeom &g, const float *logits, float *mx, const char *op) {
  if (g.e == 0)
    return;
  if (g.s == 1)
    CARVE_LAUNCH_ROWS(vpMaxRows, g.e, g.c, logits, g.e, g.c, mx);
  else
    vpMaxStrided<<<blocksFor(g.e), kThreads, 0, stream()>>>(logits, g.e, g.c, g.s, mx);
  checkLaunch(op);
  allReduceDevice(c, mx, g.e, CommType::F32, ReduceOp::Max);
}

/// acc[0, e) = this rank's sums of exp(x - mx), with `tlogit` the target
/// logits it holds; acc[tail] = its class count. Then all-reduced (sum) over
/// [0, tail + 1).
void vpGlobalSums(Communicator &c, const CeGeom &g, const float *logits, const int64_t *targets,
                  int64_t vocabOffset, bool hasIgnore, int64_t ignoreIndex, const float *mx,
                  double *acc, double *tlogit, int64_t tail, const char *op) {
  if (g.e > 0) {
    if (g.s == 1)
      CARVE_LAUNCH_ROWS(vpSumRows, g.e, g.c, logits, targets, g.e, g.c, vocabOffset, hasIgnore,
                        ignoreIndex, mx, acc, tlogit);
    else
      vpSumStrided<<<blocksFor(g.e), kThreads, 0, stream()>>>(
          logits, targets, g.e, g.c, g.s, vocabOffset, hasIgnore, ignoreIndex, mx, acc, tlogit);
    checkLaunch(op);
  }
  setDouble<<<1, 1, 0, stream()>>>(acc + tail, static_cast<double>(g.c));
  checkLaunch(op);
  allReduceDevice(c, acc, tail + 1, CommType::F64, ReduceOp::Sum);
}

} // namespace

void cross_entropy_vocab_parallel(Communicator &c, const float *logits, Dims ls,
                                  int64_t vocabOffset, const int64_t *targets, int reduction,
                                  bool hasIgnore, int64_t ignoreIndex, float *y) {
  const char *op = "cross_entropy_vocab_parallel";
  const CeGeom g = ceGeom(op, ls, reduction);
  const int np = g.e == 0 ? 0 : partsFor(g.e);
  // acc: [sum of exp (e) | target logit (e) | local classes (1)], summed at once.
  const VpScratch s = vpScratch(np, g.e, 2 * g.e + 1);
  ceCountLaunch(targets, g.e, hasIgnore, ignoreIndex, -1, s.ce, op);
  vpGlobalMax(c, g, logits, s.mx, op);
  vpGlobalSums(c, g, logits, targets, vocabOffset, hasIgnore, ignoreIndex, s.mx, s.acc, s.acc + g.e,
               2 * g.e, op);
  if (g.e > 0) {
    vpLoss<<<np, kThreads, 0, stream()>>>(targets, g.e, g.c, vocabOffset, hasIgnore, ignoreIndex,
                                          reduction, s.mx, s.acc, deviceError(), y, s.ce.part);
    checkLaunch(op);
  }
  if (reduction != 2) {
    ceFinish<<<1, kThreads, 0, stream()>>>(s.ce.part, np, s.ce.count, reduction, y);
    checkLaunch(op);
  }
}

void cross_entropy_vocab_parallel_grad(Communicator &c, const float *logits, Dims ls,
                                       int64_t vocabOffset, const int64_t *targets, int reduction,
                                       bool hasIgnore, int64_t ignoreIndex, const float *dy,
                                       float *dlogits) {
  const char *op = "cross_entropy_vocab_parallel_grad";
  const CeGeom g = ceGeom(op, ls, reduction);
  // acc: [sum of exp (e) | local classes (1)].
  const VpScratch s = vpScratch(0, g.e, g.e + 1);
  ceCountLaunch(targets, g.e, hasIgnore, ignoreIndex, -1, s.ce, op);
  vpGlobalMax(c, g, logits, s.mx, op);
  vpGlobalSums(c, g, logits, targets, vocabOffset, hasIgnore, ignoreIndex, s.mx, s.acc, nullptr,
               g.e, op);
  if (g.e == 0)
    return;
  if (g.s == 1)
    CARVE_LAUNCH_ROWS(vpGradRows, g.e, std::max<int64_t>(g.c, 1), logits, targets, g.e, g.c,
                      vocabOffset, hasIgnore, ignoreIndex, reduction, dy, s.ce.count, s.mx, s.acc,
                      deviceError(), dlogits);
  else
    vpGradStrided<<<blocksFor(g.e), kThreads, 0, stream()>>>(
        logits, targets, g.e, g.c, g.s, vocabOffset, hasIgnore, ignoreIndex, reduction, dy,
        s.ce.count, s.mx, s.acc, deviceError(), dlogits);
  checkLaunch(op);
}

} // namespace carve::gpu
