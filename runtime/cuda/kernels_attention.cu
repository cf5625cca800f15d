//===- kernels_attention.cu - scaled dot-product attention and its gradient -===//
//
// gpu.h's attention and attention_grad, with the semantics of the CPU
// kernels in runtime/src/kernels_linalg.cpp (the same shape checks and
// messages, masks that broadcast, causality, rows with no visible key giving
// 0) and the matmul precision applied to q, k, v and dy as they are loaded.
//
// Attention is tiled in the flash-attention way: 32 queries by 32 keys per
// step, scores in registers and shared memory only, the softmax online
// (running max and sum). The backward recomputes the forward once to get the
// row log-sum-exp and O (D_i = dY_i . O_i), then computes dQ query tile by
// query tile and dK, dV key tile by key tile, each owner summing its own rows
// (deterministic, no atomics).
//
//===----------------------------------------------------------------------===//

#include "attention_fallback.h"
#include "kernel_util.cuh"
#include "row_reduce.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace carve::gpu {
namespace {

using carve::rt::kMaxRank;

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
      CARVE_KERNEL(grid, kAttnThreads, 0, stream(), kernel<2>)(__VA_ARGS__);                       \
      break;                                                                                       \
    case 4:                                                                                        \
      CARVE_KERNEL(grid, kAttnThreads, 0, stream(), kernel<4>)(__VA_ARGS__);                       \
      break;                                                                                       \
    case 8:                                                                                        \
      CARVE_KERNEL(grid, kAttnThreads, 0, stream(), kernel<8>)(__VA_ARGS__);                       \
      break;                                                                                       \
    case 16:                                                                                       \
      CARVE_KERNEL(grid, kAttnThreads, 0, stream(), kernel<16>)(__VA_ARGS__);                      \
      break;                                                                                       \
    default:                                                                                       \
      CARVE_KERNEL(grid, kAttnThreads, 0, stream(), kernel<32>)(__VA_ARGS__);                      \
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

} // namespace

//===--- Attention --------------------------------------------------------===//

void attention(const float *q, Dims qs, const float *k, Dims ks, const float *v, Dims vs,
               const float *mask, Dims ms, float scale, bool causal, float *y) {
  const AttnArgs g = attnArgs("attention", qs, ks, vs, mask, ms, scale, causal);
  if (g.items == 0 || g.tq == 0 || g.dv == 0)
    return;
  attnForwardLaunch(g, q, k, v, y, nullptr, "attention");
}

namespace {

/// The backward from the forward's output o and row log-sum-exp lse: D_i =
/// dY_i . O_i (attnRowDot), then dQ by query tiles and dK, dV by key tiles.
void attnBackward(const AttnArgs &g, const char *op, const float *q, const float *k, const float *v,
                  const float *dy, const float *o, const float *lse, float *dq, float *dk,
                  float *dv) {
  const int64_t rows = g.items * g.tq;
  const size_t rBytes = (static_cast<size_t>(rows) * sizeof(float) + 255) / 256 * 256;
  float *di = static_cast<float *>(workspace(rBytes, kWsFused1));
  CARVE_KERNEL(gridFor((rows + 7) / 8), 256, 0, stream(), attnRowDot)
  (dy, o, di, rows, g.dv, g.prec);
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
}

/// dk and dv of attention with no query: sums over nothing.
void attnNoQuery(const AttnArgs &g, float *dk, float *dv) {
  if (g.tk > 0) {
    CARVE_CUDA_CHECK(cudaMemsetAsync(dk, 0, g.items * g.tk * g.d * sizeof(float), stream()));
    if (g.dv)
      CARVE_CUDA_CHECK(cudaMemsetAsync(dv, 0, g.items * g.tk * g.dv * sizeof(float), stream()));
  }
}

} // namespace

void attention_grad(const float *q, Dims qs, const float *k, Dims ks, const float *v, Dims vs,
                    const float *mask, Dims ms, float scale, bool causal, const float *dy,
                    float *dq, float *dk, float *dv) {
  const char *op = "attention_grad";
  const AttnArgs g = attnArgs(op, qs, ks, vs, mask, ms, scale, causal);
  if (g.items == 0)
    return;
  const int64_t rows = g.items * g.tq;
  if (rows == 0)
    return attnNoQuery(g, dk, dv);
  // The forward again: O (rows x dv) and the row log-sum-exp, 256-byte aligned.
  const size_t oBytes = (static_cast<size_t>(rows * g.dv) * sizeof(float) + 255) / 256 * 256;
  const size_t rBytes = (static_cast<size_t>(rows) * sizeof(float) + 255) / 256 * 256;
  char *w = static_cast<char *>(workspace(oBytes + rBytes, kWsFused2));
  float *o = reinterpret_cast<float *>(w);
  float *lse = reinterpret_cast<float *>(w + oBytes);
  attnForwardLaunch(g, q, k, v, o, lse, op);
  attnBackward(g, op, q, k, v, dy, o, lse, dq, dk, dv);
}

void attention_stats(const float *q, Dims qs, const float *k, Dims ks, const float *v, Dims vs,
                     const float *mask, Dims ms, float scale, bool causal, float *y, float *lse) {
  const AttnArgs g = attnArgs("attention_stats", qs, ks, vs, mask, ms, scale, causal);
  // With dv = 0 the output is empty but the statistics are not.
  if (g.items == 0 || g.tq == 0)
    return;
  attnForwardLaunch(g, q, k, v, y, lse, "attention_stats");
}

void attention_grad_stats(const float *q, Dims qs, const float *k, Dims ks, const float *v, Dims vs,
                          const float *mask, Dims ms, float scale, bool causal, const float *o,
                          const float *lse, const float *dy, float *dq, float *dk, float *dv) {
  const char *op = "attention_grad_stats";
  const AttnArgs g = attnArgs(op, qs, ks, vs, mask, ms, scale, causal);
  if (g.items == 0)
    return;
  if (g.items * g.tq == 0)
    return attnNoQuery(g, dk, dv);
  attnBackward(g, op, q, k, v, dy, o, lse, dq, dk, dv);
}

//===--- The mask as cuDNN's bias -----------------------------------------===//

namespace {

/// out[n, h, i, j] (bb x hh x tq x tk, row-major) = the mask at item n * heads
/// + h, query i, key j, a finite value clamped to the 16-bit format's finite
/// range, rounded to nearest even (fmt 1: bf16, 2: fp16).
__global__ void maskBias16Kernel(AttnArgs g, int64_t bb, int64_t hh, int64_t heads, int fmt,
                                 uint16_t *out) {
  const int64_t n = bb * hh * g.tq * g.tk;
  const float hi = fmt == 1 ? 3.38953139e38f : 65504.0f;
  CARVE_GRID_LOOP(e, n) {
    const int64_t j = e % g.tk, i = (e / g.tk) % g.tq, h = (e / (g.tk * g.tq)) % hh;
    const int64_t b = e / (g.tk * g.tq * hh);
    float v = g.mask[g.maskOffset(b * heads + h) + i * g.mRow + j * g.mCol];
    // Finite values beyond the format's range (-FLT_MAX, Hugging Face's
    // masks) stay finite; infinities and NaN stay what they are.
    if (v < -hi && v != -INFINITY)
      v = -hi;
    else if (v > hi && v != INFINITY)
      v = hi;
    out[e] = fmt == 1 ? carve::rt::ew::bf16Bits(v) : carve::rt::ew::f16Bits(v);
  }
}

} // namespace

void attentionMaskBias16(const Dims &qs, const Dims &ks, const Dims &vs, const float *mask,
                         const Dims &ms, int64_t bb, int64_t hh, uint16_t *out) {
  const char *op = "attention_stats_cudnn (the mask as cuDNN's bias)";
  const AttnArgs g = attnArgs(op, qs, ks, vs, mask, ms, 1.0f, false);
  const int64_t heads = qs.rank >= 3 ? qs.d[qs.rank - 3] : 1;
  const int64_t n = bb * hh * g.tq * g.tk;
  if (n == 0)
    return;
  const int fmt = format16For(op, "the mask as cuDNN's bias");
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), maskBias16Kernel)
  (g, bb, hh, heads, fmt, out);
  checkLaunch(op);
}

} // namespace carve::gpu
