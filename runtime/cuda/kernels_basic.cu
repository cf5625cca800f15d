//===- kernels_basic.cu - elementwise, GEMM, reduce, data movement, TP, optim -===//
//
// The gpu.h functions that are one pass over memory (elementwise maps with
// NumPy broadcasting, casts, copies, data movement, shard layouts, optimizer
// updates), reductions, and matmul through cuBLAS. Each mirrors the CPU kernel
// of the same name in runtime/src/kernels_*.cpp, dist.cpp or optim.cpp: same shape checks
// and messages, same formulas, and the same order of float operations where
// the CPU fixes one (the optimizer updates are bit-identical).
//
// Kernels use grid-stride loops over int64 indices with 1-D grids, so any
// tensor size launches with a bounded grid. Broadcasting operands are read
// through per-operand strides (0 on broadcast dimensions) of the output's
// dimensions after dropping size-1 ones and merging neighbours, as the CPU
// loop nests do: equal shapes and scalars become one dimension, whose offsets
// need no division.
//
//===----------------------------------------------------------------------===//

#include "internal.h"

#include "carve/rt/elementwise.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace carve::gpu {

using carve::rt::kMaxRank;

namespace {

#define CARVE_GRID_LOOP(i, n)                                                                      \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n);           \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

__host__ __device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

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
using carve::rt::ew::Nest;
using carve::rt::ew::offsetsOf;
using carve::rt::ew::ReduceGeom;
using carve::rt::ew::reduceGeom;
using carve::rt::ew::sliceNest;
using carve::rt::ew::stridesOf;
using carve::rt::ew::transposeNest;

template <class Op, class Y, class A, class B>
__global__ void broadcast2Kernel(Op op, const A *a, const B *b, Y *y, Nest<2> n, int64_t total) {
  CARVE_GRID_LOOP(e, total) {
    int64_t off[2];
    offsetsOf(n, e, off);
    y[e] = op(a[off[0]], b[off[1]]);
  }
}

template <class Op, class Y, class A, class B>
void broadcast2(const char *op, Op f, const A *a, const Dims &as, const B *b, const Dims &bs, Y *y,
                const Dims &ys) {
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  const Dims in[2] = {as, bs};
  const Nest<2> n = broadcastNest<2>(op, in, ys);
  broadcast2Kernel<<<blocksFor(total), kThreads, 0, stream()>>>(f, a, b, y, n, total);
  checkLaunch(op);
}

//===--- Elementwise functions (elementwise.h) -----------------------------===//

using carve::rt::ew::maxNan;
using carve::rt::ew::minNan;

template <Unary F> __device__ __forceinline__ float unaryOp(float v) {
  return carve::rt::ew::unary<F>(v);
}

template <Unary F> __device__ __forceinline__ float unaryGradOp(float v, float g) {
  return carve::rt::ew::unaryGrad<F>(v, g);
}

template <Unary F> __global__ void unaryKernel(const float *x, float *y, int64_t n) {
  CARVE_GRID_LOOP(i, n) y[i] = unaryOp<F>(x[i]);
}

template <Unary F>
__global__ void unaryGradKernel(const float *x, const float *dy, float *dx, int64_t n) {
  CARVE_GRID_LOOP(i, n) dx[i] = unaryGradOp<F>(x[i], dy[i]);
}

template <Unary F> void launchUnary(const float *x, float *y, int64_t n) {
  unaryKernel<F><<<blocksFor(n), kThreads, 0, stream()>>>(x, y, n);
  checkLaunch("unary");
}

template <Unary F> void launchUnaryGrad(const float *x, const float *dy, float *dx, int64_t n) {
  unaryGradKernel<F><<<blocksFor(n), kThreads, 0, stream()>>>(x, dy, dx, n);
  checkLaunch("unary_grad");
}

#define CARVE_UNARY_CASES(M)                                                                       \
  M(Neg)                                                                                           \
  M(Abs) M(Exp) M(Log) M(Sqrt) M(Rsqrt) M(Reciprocal) M(Tanh) M(Erf) M(Sigmoid) M(Relu) M(Sin)     \
      M(Cos) M(Silu) M(Gelu) M(GeluTanh)

template <Binary F> struct BinaryOp {
  /// The exponent of Pow is one scalar: PyTorch's exact special cases apply.
  bool scalarExponent = false;
  __device__ __forceinline__ float operator()(float u, float v) const {
    if constexpr (F != Binary::Pow) {
      return carve::rt::ew::binary<F>(u, v);
    } else {
      if (scalarExponent) {
        if (v == 2.0f)
          return u * u;
        if (v == 3.0f)
          return u * u * u;
        if (v == 0.5f)
          return sqrtf(u);
        if (v == -0.5f)
          return 1.0f / sqrtf(u);
        if (v == -1.0f)
          return 1.0f / u;
        if (v == -2.0f)
          return 1.0f / (u * u);
      }
      return powf(u, v);
    }
  }
};

template <Compare F> struct CompareOp {
  template <class T> __device__ __forceinline__ uint8_t operator()(T u, T v) const {
    if constexpr (F == Compare::Eq)
      return u == v;
    else if constexpr (F == Compare::Lt)
      return u < v;
    else
      return u > v;
  }
};

template <Logic F> struct LogicOp {
  __device__ __forceinline__ uint8_t operator()(uint8_t u, uint8_t v) const {
    if constexpr (F == Logic::And)
      return u && v;
    else if constexpr (F == Logic::Or)
      return u || v;
    else
      return !u;
  }
};

template <class T>
void compareT(Compare f, const T *a, Dims as, const T *b, Dims bs, uint8_t *y, Dims ys) {
  switch (f) {
  case Compare::Eq:
    return broadcast2("equal", CompareOp<Compare::Eq>(), a, as, b, bs, y, ys);
  case Compare::Lt:
    return broadcast2("less", CompareOp<Compare::Lt>(), a, as, b, bs, y, ys);
  case Compare::Gt:
    return broadcast2("greater", CompareOp<Compare::Gt>(), a, as, b, bs, y, ys);
  }
  fatal("compare: unknown comparison %d", static_cast<int>(f));
}

template <class T>
__global__ void whereKernel(const uint8_t *c, const T *a, const T *b, T *y, Nest<3> n,
                            int64_t total) {
  CARVE_GRID_LOOP(e, total) {
    int64_t off[3];
    offsetsOf(n, e, off);
    y[e] = c[off[0]] ? a[off[1]] : b[off[2]];
  }
}

template <class T>
void whereT(const uint8_t *c, Dims cs, const T *a, Dims as, const T *b, Dims bs, T *y, Dims ys) {
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  const Dims in[3] = {cs, as, bs};
  const Nest<3> n = broadcastNest<3>("where", in, ys);
  whereKernel<<<blocksFor(total), kThreads, 0, stream()>>>(c, a, b, y, n, total);
  checkLaunch("where");
}

template <class From, class To> __global__ void castKernel(const From *x, To *y, int64_t n) {
  CARVE_GRID_LOOP(i, n) {
    // uint8_t holds bool: any non-zero value is true, as ONNX Cast to bool.
    if constexpr (std::is_same_v<To, uint8_t> && !std::is_same_v<From, uint8_t>)
      y[i] = x[i] != From(0);
    else
      y[i] = static_cast<To>(x[i]);
  }
}

template <class T> __global__ void fillKernel(T *y, int64_t n, T v) {
  CARVE_GRID_LOOP(i, n) y[i] = v;
}

//===--- Reductions --------------------------------------------------------===//

__device__ __forceinline__ double combine(bool isMax, double acc, double x) {
  return isMax ? maxNan(x, acc) : acc + x;
}

__device__ __forceinline__ double warpCombine(bool isMax, double acc) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    acc = combine(isMax, acc, __shfl_xor_sync(0xffffffffu, acc, o));
  return acc;
}

/// x seen as [O, R] (the reduced run innermost): warp w reduces segment
/// w % S (of `seg` rows) of row w / S, into y when S == 1, else into
/// partial[w].
__global__ void reduceRowsKernel(const float *x, int64_t O, int64_t R, int64_t seg, int64_t S,
                                 bool isMax, double div, double *partial, float *y) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t stride = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const double identity = isMax ? -CUDART_INF : 0.0;
  for (int64_t w = first; w < O * S; w += stride) {
    const int64_t o = w / S, s = w - o * S;
    const int64_t r0 = s * seg, r1 = imin(R, r0 + seg);
    const float *p = x + o * R;
    double acc = identity;
    for (int64_t r = r0 + lane; r < r1; r += 32)
      acc = combine(isMax, acc, p[r]);
    acc = warpCombine(isMax, acc);
    if (lane == 0) {
      if (S == 1)
        y[o] = static_cast<float>(acc / div);
      else
        partial[w] = acc;
    }
  }
}

/// x seen as [O, R, I]: thread t = (o * S + s) * I + i reduces rows
/// [s * seg, (s + 1) * seg) of column (o, i) into y when S == 1, else into
/// partial[t].
__global__ void reduceColumnsKernel(const float *x, int64_t O, int64_t R, int64_t I, int64_t seg,
                                    int64_t S, bool isMax, double div, double *partial, float *y) {
  const double identity = isMax ? -CUDART_INF : 0.0;
  CARVE_GRID_LOOP(t, O * S * I) {
    const int64_t i = t % I, q = t / I;
    const int64_t s = q % S, o = q / S;
    const int64_t r0 = s * seg, r1 = imin(R, r0 + seg);
    const float *p = x + o * R * I + i;
    double acc = identity;
    for (int64_t r = r0; r < r1; ++r)
      acc = combine(isMax, acc, p[r * I]);
    if (S == 1)
      y[o * I + i] = static_cast<float>(acc / div);
    else
      partial[t] = acc;
  }
}

/// y[o, i] = the S partials of (o, i) combined in order.
__global__ void reducePartialsKernel(const double *partial, int64_t O, int64_t S, int64_t I,
                                     bool isMax, double div, float *y) {
  CARVE_GRID_LOOP(t, O * I) {
    const int64_t o = t / I, i = t - o * I;
    const double *p = partial + o * S * I + i;
    double acc = p[0];
    for (int64_t s = 1; s < S; ++s)
      acc = combine(isMax, acc, p[s * I]);
    y[t] = static_cast<float>(acc / div);
  }
}

/// Kept and reduced dimension runs of a reduction that is not [O, R, I].
/// One thread per output element, walking the reduced runs with an odometer.
__global__ void reduceGeneralKernel(const float *x, ReduceGeom g, int64_t outCount, bool isMax,
                                    double div, float *y) {
  CARVE_GRID_LOOP(o, outCount) {
    int64_t base = 0, rem = o;
    for (int i = g.no - 1; i >= 0; --i) {
      base += (rem % g.od[i]) * g.os[i];
      rem /= g.od[i];
    }
    int64_t idx[kMaxRank] = {};
    const int64_t inLen = g.rd[g.nr - 1], inStride = g.rs[g.nr - 1];
    double acc = isMax ? -CUDART_INF : 0.0;
    for (;;) {
      int64_t off = base;
      for (int i = 0; i < g.nr - 1; ++i)
        off += idx[i] * g.rs[i];
      const float *p = x + off;
      for (int64_t j = 0; j < inLen; ++j)
        acc = combine(isMax, acc, p[j * inStride]);
      int i = g.nr - 2;
      for (; i >= 0; --i) {
        if (++idx[i] < g.rd[i])
          break;
        idx[i] = 0;
      }
      if (i < 0)
        break;
    }
    y[o] = static_cast<float>(acc / div);
  }
}

/// Threads (I > 1) or warps (I == 1) that keep the GPU busy without making
/// the partials large.
constexpr int64_t kReduceThreads = int64_t(1) << 18;
constexpr int64_t kReduceWarps = 8192;

void reduceORI(bool isMax, double div, const float *x, int64_t O, int64_t R, int64_t I, float *y) {
  auto ceilDiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  int64_t S;
  if (I == 1)
    S = std::clamp<int64_t>(ceilDiv(kReduceWarps, O), 1, ceilDiv(R, 1024));
  else
    S = std::clamp<int64_t>(ceilDiv(kReduceThreads, O * I), 1, ceilDiv(R, 32));
  const int64_t seg = ceilDiv(R, S);
  S = ceilDiv(R, seg);
  double *partial = nullptr;
  if (S > 1)
    partial = static_cast<double *>(workspace(sizeof(double) * O * S * I, kWsBasic2));
  if (I == 1) {
    const int64_t warps = O * S;
    reduceRowsKernel<<<blocksFor(warps * 32), kThreads, 0, stream()>>>(x, O, R, seg, S, isMax, div,
                                                                       partial, y);
  } else {
    reduceColumnsKernel<<<blocksFor(O * S * I), kThreads, 0, stream()>>>(x, O, R, I, seg, S, isMax,
                                                                         div, partial, y);
  }
  checkLaunch("reduce");
  if (S > 1) {
    reducePartialsKernel<<<blocksFor(O * I), kThreads, 0, stream()>>>(partial, O, S, I, isMax, div,
                                                                      y);
    checkLaunch("reduce");
  }
}

//===--- Matmul ------------------------------------------------------------===//

template <class H> __global__ void roundKernel(const float *x, H *y, int64_t n);

template <>
__global__ void roundKernel<__nv_bfloat16>(const float *x, __nv_bfloat16 *y, int64_t n) {
  CARVE_GRID_LOOP(i, n) y[i] = __float2bfloat16_rn(x[i]);
}

template <> __global__ void roundKernel<__half>(const float *x, __half *y, int64_t n) {
  CARVE_GRID_LOOP(i, n) y[i] = __float2half_rn(x[i]);
}

/// An operand as cuBLAS reads it: fp32, or rounded to bf16 / fp16 in scratch.
struct Operand {
  const char *p;
  int elemBytes;
};

Operand roundedOperand(const float *x, int64_t n, int slot, Precision p) {
  if (p == Precision::F32)
    return {reinterpret_cast<const char *>(x), 4};
  void *buf = workspace(sizeof(uint16_t) * static_cast<size_t>(n), slot);
  if (p == Precision::BF16)
    roundKernel<<<blocksFor(n), kThreads, 0, stream()>>>(x, static_cast<__nv_bfloat16 *>(buf), n);
  else
    roundKernel<<<blocksFor(n), kThreads, 0, stream()>>>(x, static_cast<__half *>(buf), n);
  checkLaunch("matmul (input rounding)");
  return {static_cast<const char *>(buf), 2};
}

int gemmInt(int64_t v, const char *what) {
  if (v > INT_MAX)
    fatal("matmul: %s %lld exceeds cuBLAS's int range", what, (long long)v);
  return static_cast<int>(v);
}

/// `count` row-major GEMMs C_i = op(A_i) op(B_i) (+ C_i) with A_i at
/// a + i * strideA elements, and so on. cuBLAS is column-major: a row-major
/// matrix is its transpose, so it computes C^T = op(B)^T op(A)^T.
void gemmBatch(bool ta, bool tb, int64_t m, int64_t n, int64_t k, Operand a, int64_t lda,
               int64_t strideA, Operand b, int64_t ldb, int64_t strideB, float beta, float *c,
               int64_t strideC, int64_t count, Precision p) {
  const cudaDataType_t type = p == Precision::BF16  ? CUDA_R_16BF
                              : p == Precision::F16 ? CUDA_R_16F
                                                    : CUDA_R_32F;
  const cublasOperation_t opA = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opB = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int im = gemmInt(m, "M"), in = gemmInt(n, "N"), ik = gemmInt(k, "K");
  const int ilda = gemmInt(lda, "the leading dimension of A");
  const int ildb = gemmInt(ldb, "the leading dimension of B");
  const float alpha = 1.0f;
  // Batches beyond the grid's y/z limit of some cuBLAS kernels go in pieces.
  constexpr int64_t kMaxBatch = 65535;
  for (int64_t i0 = 0; i0 < count; i0 += kMaxBatch) {
    const int64_t nb = std::min(kMaxBatch, count - i0);
    const char *pa = a.p + i0 * strideA * a.elemBytes;
    const char *pb = b.p + i0 * strideB * b.elemBytes;
    float *pc = c + i0 * strideC;
    if (nb == 1) {
      CARVE_CUBLAS_CHECK(cublasGemmEx(cublas(), opB, opA, in, im, ik, &alpha, pb, type, ildb, pa,
                                      type, ilda, &beta, pc, CUDA_R_32F, in, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
    } else {
      CARVE_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
          cublas(), opB, opA, in, im, ik, &alpha, pb, type, ildb, strideB, pa, type, ilda, strideA,
          &beta, pc, CUDA_R_32F, in, strideC, static_cast<int>(nb), CUBLAS_COMPUTE_32F,
          CUBLAS_GEMM_DEFAULT));
    }
  }
}

//===--- Data movement -----------------------------------------------------===//

/// y[e] = x[offset of e in the view].
template <class T> __global__ void viewKernel(const T *x, Nest<1> n, T *y, int64_t total) {
  CARVE_GRID_LOOP(e, total) {
    int64_t off[1];
    offsetsOf(n, e, off);
    y[e] = x[off[0]];
  }
}

/// x[offset of e in the view] = y[e].
template <class T> __global__ void scatterViewKernel(const T *y, Nest<1> n, T *x, int64_t total) {
  CARVE_GRID_LOOP(e, total) {
    int64_t off[1];
    offsetsOf(n, e, off);
    x[off[0]] = y[e];
  }
}

template <class T>
void gatherView(const char *op, const T *x, const Nest<1> &n, T *y, int64_t total) {
  viewKernel<<<blocksFor(total), kThreads, 0, stream()>>>(x, n, y, total);
  checkLaunch(op);
}

/// The outer dimensions of a tiled transpose and their strides in x and y.
struct TileOuter {
  int no = 0;
  int64_t od[kMaxRank] = {}, xs[kMaxRank] = {}, ys[kMaxRank] = {};
};

constexpr int kTile = 32;
constexpr int kTileRows = 8;

/// Transposes 32 x 32 tiles between dimension k (contiguous in x, stride yk
/// in y) and dimension l (stride xl in x, contiguous in y) through shared
/// memory, so that both the reads and the writes are coalesced.
template <class T>
__global__ void transposeTilesKernel(const T *x, T *y, TileOuter g, int64_t dk, int64_t dl,
                                     int64_t xl, int64_t yk, int64_t tk, int64_t tl,
                                     int64_t tiles) {
  __shared__ T tile[kTile][kTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    int64_t o = t / (tk * tl);
    const int64_t rem = t - o * (tk * tl);
    const int64_t k0 = (rem / tl) * kTile, l0 = (rem % tl) * kTile;
    int64_t xo = 0, yo = 0;
    for (int i = g.no - 1; i >= 0; --i) {
      const int64_t ii = o % g.od[i];
      o /= g.od[i];
      xo += ii * g.xs[i];
      yo += ii * g.ys[i];
    }
    for (int j = ty; j < kTile; j += kTileRows) {
      const int64_t k = k0 + tx, l = l0 + j;
      if (k < dk && l < dl)
        tile[j][tx] = x[xo + k + l * xl];
    }
    __syncthreads();
    for (int j = ty; j < kTile; j += kTileRows) {
      const int64_t k = k0 + j, l = l0 + tx;
      if (k < dk && l < dl)
        y[yo + k * yk + l] = tile[tx][j];
    }
    __syncthreads();
  }
}

template <class T>
__global__ void concatKernel(const T *x, T *y, int64_t outer, int64_t len, int64_t row,
                             int64_t col0) {
  CARVE_GRID_LOOP(e, outer * len) {
    const int64_t o = e / len, j = e - o * len;
    y[o * row + col0 + j] = x[e];
  }
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

template <class T>
__global__ void gatherKernel(const T *table, const int64_t *idx, T *y, int64_t ni, int64_t size,
                             int64_t inner, int64_t total, DeviceError *err) {
  CARVE_GRID_LOOP(e, total) {
    const int64_t t = e / inner, c = e - t * inner;
    const int64_t o = t / ni, k = t - o * ni;
    const int64_t v = checkedIndex(idx, k, size, err);
    y[e] = v < 0 ? T(0) : table[(o * size + v) * inner + c];
  }
}

template <class T> __device__ __forceinline__ void atomicAddT(T *p, T v) { atomicAdd(p, v); }

/// Scatter-add of dy into the zeroed dtable; float and double only (atomics).
template <class T>
__global__ void gatherGradAtomicKernel(const T *dy, const int64_t *idx, T *dtable, int64_t ni,
                                       int64_t size, int64_t inner, int64_t total,
                                       DeviceError *err) {
  CARVE_GRID_LOOP(e, total) {
    const int64_t t = e / inner, c = e - t * inner;
    const int64_t o = t / ni, k = t - o * ni;
    const int64_t v = checkedIndex(idx, k, size, err);
    if (v >= 0)
      atomicAddT(dtable + (o * size + v) * inner + c, dy[e]);
  }
}

/// The same for integer types: a thread owns a column of one outer index and
/// walks every index (no atomics for every width, and a fixed order).
template <class T>
__global__ void gatherGradOwnedKernel(const T *dy, const int64_t *idx, T *dtable, int64_t ni,
                                      int64_t size, int64_t inner, int64_t outer,
                                      DeviceError *err) {
  CARVE_GRID_LOOP(e, outer * inner) {
    const int64_t o = e / inner, c = e - o * inner;
    for (int64_t k = 0; k < ni; ++k) {
      const int64_t v = checkedIndex(idx, k, size, err);
      if (v >= 0)
        dtable[(o * size + v) * inner + c] += dy[(o * ni + k) * inner + c];
    }
  }
}

__global__ void gatherShardedKernel(const float *table, const int64_t *idx, float *y, int64_t rows,
                                    int64_t rowOffset, int64_t globalRows, int64_t inner,
                                    int64_t total, DeviceError *err) {
  CARVE_GRID_LOOP(e, total) {
    const int64_t k = e / inner, c = e - k * inner;
    const int64_t v = checkedIndex(idx, k, globalRows, err) - rowOffset;
    y[e] = v >= 0 && v < rows ? table[v * inner + c] : 0.0f;
  }
}

__global__ void gatherShardedGradKernel(const float *dy, const int64_t *idx, float *dtable,
                                        int64_t rows, int64_t rowOffset, int64_t globalRows,
                                        int64_t inner, int64_t total, DeviceError *err) {
  CARVE_GRID_LOOP(e, total) {
    const int64_t k = e / inner, c = e - k * inner;
    const int64_t g = checkedIndex(idx, k, globalRows, err);
    const int64_t v = g - rowOffset;
    if (g >= 0 && v >= 0 && v < rows)
      atomicAdd(dtable + v * inner + c, dy[e]);
  }
}

void checkShardRows(const char *op, const Dims &ts, int64_t rowOffset, int64_t globalRows) {
  if (ts.rank < 1)
    fatal("%s: a table of rank 0", op);
  if (rowOffset < 0 || rowOffset + ts.d[0] > globalRows)
    fatal("%s: local rows [%lld, %lld) are outside the table's %lld rows", op, (long long)rowOffset,
          (long long)(rowOffset + ts.d[0]), (long long)globalRows);
}

//===--- Shard layouts (dist.h SplitRows) ----------------------------------===//

using carve::rt::checkSplit;
using carve::rt::checkSplitIndex;
using carve::rt::checkSplitParts;
using carve::rt::SplitRows;
using carve::rt::splitRows;

template <class U>
__global__ void copyRowsKernel(const U *from, U *to, int64_t rows, int64_t rowUnits, int64_t parts,
                               int64_t index, bool toLocal) {
  CARVE_GRID_LOOP(e, rows * rowUnits) {
    const int64_t r = e / rowUnits, c = e - r * rowUnits;
    const int64_t fullRow = r * parts + index;
    if (toLocal)
      to[r * rowUnits + c] = from[fullRow * rowUnits + c];
    else
      to[fullRow * rowUnits + c] = from[r * rowUnits + c];
  }
}

template <class U>
void copyRows(const SplitRows &g, int index, const char *from, char *to, bool toLocal) {
  const int64_t rows = g.outer * g.groups, units = g.rowBytes / static_cast<int64_t>(sizeof(U));
  copyRowsKernel<<<blocksFor(rows * units), kThreads, 0, stream()>>>(
      reinterpret_cast<const U *>(from), reinterpret_cast<U *>(to), rows, units, g.parts, index,
      toLocal);
  checkLaunch("shard copy");
}

/// Copies piece `index` between the full layout (row (o * groups + g) *
/// parts + index) and the local one (row o * groups + g), in the widest
/// units that the addresses and the row length allow.
void copyPiece(const SplitRows &g, int index, const char *from, char *to, bool toLocal) {
  const int64_t rows = g.outer * g.groups;
  if (rows == 0 || g.rowBytes == 0)
    return;
  if (rows == 1) {
    const int64_t off = static_cast<int64_t>(index) * g.rowBytes;
    CARVE_CUDA_CHECK(cudaMemcpyAsync(toLocal ? to : to + off, toLocal ? from + off : from,
                                     static_cast<size_t>(g.rowBytes), cudaMemcpyDeviceToDevice,
                                     stream()));
    return;
  }
  const uintptr_t bits = reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to) |
                         static_cast<uintptr_t>(g.rowBytes);
  if (bits % 16 == 0)
    copyRows<uint4>(g, index, from, to, toLocal);
  else if (bits % 8 == 0)
    copyRows<uint2>(g, index, from, to, toLocal);
  else if (bits % 4 == 0)
    copyRows<uint32_t>(g, index, from, to, toLocal);
  else if (bits % 2 == 0)
    copyRows<uint16_t>(g, index, from, to, toLocal);
  else
    copyRows<uint8_t>(g, index, from, to, toLocal);
}

//===--- Optimizer (optim.cpp, with its rounding spelled out) ---------------===//
//
// optim.cpp compiles with contraction off and explicit std::fma where
// PyTorch's kernels fuse; the _rn intrinsics keep nvcc from contracting
// anything else, so the updates are bit-identical to the CPU's.

__global__ void sgdKernel(float *p, const float *g, float *buf, int64_t n, float wd, float mom,
                          float keep, float negLr, bool decay, bool useMomentum, bool nesterov,
                          bool firstStep) {
  CARVE_GRID_LOOP(i, n) {
    float d = decay ? __fmaf_rn(p[i], wd, g[i]) : g[i];
    if (useMomentum) {
      const float b = firstStep ? d : __fmaf_rn(d, keep, __fmul_rn(buf[i], mom));
      buf[i] = b;
      d = nesterov ? __fmaf_rn(b, mom, d) : b;
    }
    p[i] = __fmaf_rn(d, negLr, p[i]);
  }
}

__global__ void adamwKernel(float *p, const float *g, float *m, float *v, int64_t n, float decay,
                            float b1, float b2, float c1, float c2, float bc2Sqrt, float eps,
                            float negStep) {
  CARVE_GRID_LOOP(i, n) {
    const float gi = g[i];
    const float pi = __fmul_rn(p[i], decay);
    const float mi = __fmaf_rn(gi, c1, __fmul_rn(m[i], b1));
    const float vi = __fadd_rn(__fmul_rn(v[i], b2), __fmul_rn(__fmul_rn(c2, gi), gi));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2Sqrt), eps);
    p[i] = __fadd_rn(pi, __fdiv_rn(__fmul_rn(negStep, mi), denom));
    m[i] = mi;
    v[i] = vi;
  }
}

__global__ void addKernel(float *dst, const float *src, int64_t n) {
  CARVE_GRID_LOOP(i, n) dst[i] = __fadd_rn(dst[i], src[i]);
}

__global__ void scaleKernel(float *g, int64_t n, float s) {
  CARVE_GRID_LOOP(i, n) g[i] = __fmul_rn(g[i], s);
}

/// partial[block] = the block's sum of g^2 in double.
__global__ void sumSquaresKernel(const float *g, int64_t n, double *partial) {
  __shared__ double warpSums[kThreads / 32];
  double acc = 0;
  CARVE_GRID_LOOP(i, n) {
    const double x = g[i];
    acc += x * x;
  }
  acc = warpCombine(false, acc);
  if ((threadIdx.x & 31) == 0)
    warpSums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0;
    for (int w = 0; w < kThreads / 32; ++w)
      s += warpSums[w];
    partial[blockIdx.x] = s;
  }
}

/// out = the sum of the n partials (one block); with Add, *out += it (the
/// gradient norm's accumulators, in stream order).
template <bool Add> __global__ void sumPartialsKernel(const double *partial, int n, double *out) {
  __shared__ double warpSums[kThreads / 32];
  double acc = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    acc += partial[i];
  acc = warpCombine(false, acc);
  if ((threadIdx.x & 31) == 0)
    warpSums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0;
    for (int w = 0; w < kThreads / 32; ++w)
      s += warpSums[w];
    *out = Add ? *out + s : s;
  }
}

} // namespace

//===--- Elementwise -------------------------------------------------------===//

void unary(Unary f, const float *x, float *y, int64_t n) {
  if (n <= 0)
    return;
  switch (f) {
#define CARVE_CASE(F)                                                                              \
  case Unary::F:                                                                                   \
    return launchUnary<Unary::F>(x, y, n);
    CARVE_UNARY_CASES(CARVE_CASE)
#undef CARVE_CASE
  }
  fatal("unary: unknown function %d", static_cast<int>(f));
}

void unary_grad(Unary f, const float *x, const float *dy, float *dx, int64_t n) {
  if (n <= 0)
    return;
  switch (f) {
#define CARVE_CASE(F)                                                                              \
  case Unary::F:                                                                                   \
    return launchUnaryGrad<Unary::F>(x, dy, dx, n);
    CARVE_UNARY_CASES(CARVE_CASE)
#undef CARVE_CASE
  }
  fatal("unary_grad: unknown function %d", static_cast<int>(f));
}

void binary(Binary f, const float *a, Dims as, const float *b, Dims bs, float *y, Dims ys) {
  switch (f) {
  case Binary::Add:
    return broadcast2("add", BinaryOp<Binary::Add>(), a, as, b, bs, y, ys);
  case Binary::Sub:
    return broadcast2("sub", BinaryOp<Binary::Sub>(), a, as, b, bs, y, ys);
  case Binary::Mul:
    return broadcast2("mul", BinaryOp<Binary::Mul>(), a, as, b, bs, y, ys);
  case Binary::Div:
    return broadcast2("div", BinaryOp<Binary::Div>(), a, as, b, bs, y, ys);
  case Binary::Max:
    return broadcast2("max", BinaryOp<Binary::Max>(), a, as, b, bs, y, ys);
  case Binary::Min:
    return broadcast2("min", BinaryOp<Binary::Min>(), a, as, b, bs, y, ys);
  case Binary::Pow: {
    // The exponent's value is on the device: the kernel picks the special
    // case, the host only knows that there is one exponent (as the CPU,
    // which then broadcasts it as a rank-0 operand).
    BinaryOp<Binary::Pow> op;
    op.scalarExponent = bs.numel() == 1;
    return broadcast2("pow", op, a, as, b, op.scalarExponent ? Dims() : bs, y, ys);
  }
  }
  fatal("binary: unknown function %d", static_cast<int>(f));
}

void compare(Compare f, const float *a, Dims as, const float *b, Dims bs, uint8_t *y, Dims ys) {
  compareT(f, a, as, b, bs, y, ys);
}

void compare(Compare f, const int64_t *a, Dims as, const int64_t *b, Dims bs, uint8_t *y, Dims ys) {
  compareT(f, a, as, b, bs, y, ys);
}

void logic(Logic f, const uint8_t *a, Dims as, const uint8_t *b, Dims bs, uint8_t *y, Dims ys) {
  switch (f) {
  case Logic::And:
    return broadcast2("and", LogicOp<Logic::And>(), a, as, b, bs, y, ys);
  case Logic::Or:
    return broadcast2("or", LogicOp<Logic::Or>(), a, as, b, bs, y, ys);
  case Logic::Not:
    // b is ignored: broadcast a against itself.
    return broadcast2("not", LogicOp<Logic::Not>(), a, as, a, as, y, ys);
  }
  fatal("logic: unknown operation %d", static_cast<int>(f));
}

void where(const uint8_t *c, Dims cs, const float *a, Dims as, const float *b, Dims bs, float *y,
           Dims ys) {
  whereT(c, cs, a, as, b, bs, y, ys);
}

void where(const uint8_t *c, Dims cs, const int64_t *a, Dims as, const int64_t *b, Dims bs,
           int64_t *y, Dims ys) {
  whereT(c, cs, a, as, b, bs, y, ys);
}

template <class From, class To> void cast(const From *x, To *y, int64_t n) {
  if (n <= 0)
    return;
  castKernel<<<blocksFor(n), kThreads, 0, stream()>>>(x, y, n);
  checkLaunch("cast");
}

template <class T> void fill(T *y, int64_t n, T v) {
  if (n <= 0)
    return;
  fillKernel<<<blocksFor(n), kThreads, 0, stream()>>>(y, n, v);
  checkLaunch("fill");
}

template <class T> void copy(const T *x, T *y, int64_t n) {
  if (x == y || n <= 0)
    return;
  CARVE_CUDA_CHECK(cudaMemcpyAsync(y, x, sizeof(T) * n, cudaMemcpyDeviceToDevice, stream()));
}

#define CARVE_CAST_TO(From)                                                                        \
  template void cast<From, float>(const From *, float *, int64_t);                                 \
  template void cast<From, double>(const From *, double *, int64_t);                               \
  template void cast<From, int64_t>(const From *, int64_t *, int64_t);                             \
  template void cast<From, int32_t>(const From *, int32_t *, int64_t);                             \
  template void cast<From, uint8_t>(const From *, uint8_t *, int64_t);
CARVE_CAST_TO(float)
CARVE_CAST_TO(double)
CARVE_CAST_TO(int64_t)
CARVE_CAST_TO(int32_t)
CARVE_CAST_TO(uint8_t)
#undef CARVE_CAST_TO

//===--- Linear algebra ----------------------------------------------------===//

void matmul(const float *a, Dims as, bool transA, const float *b, Dims bs, bool transB, float *y,
            Dims ys, bool accumulate) {
  const int ar = as.rank, br = bs.rank, yr = ys.rank;
  if (ar < 2 || br < 2 || yr != std::max(ar, br))
    fatal("matmul: operands of rank %d and %d with a result of rank %d (both ranks must be "
          ">= 2 and the result's their maximum)",
          ar, br, yr);
  const int64_t m = transA ? as.d[ar - 1] : as.d[ar - 2];
  const int64_t k = transA ? as.d[ar - 2] : as.d[ar - 1];
  const int64_t kb = transB ? bs.d[br - 1] : bs.d[br - 2];
  const int64_t n = transB ? bs.d[br - 2] : bs.d[br - 1];
  if (k != kb || ys.d[yr - 2] != m || ys.d[yr - 1] != n)
    fatal("matmul: [%lld x %lld] @ [%lld x %lld] does not give [%lld x %lld]", (long long)m,
          (long long)k, (long long)kb, (long long)n, (long long)ys.d[yr - 2],
          (long long)ys.d[yr - 1]);
  const Dims batch(ys.d, yr - 2), aBatch(as.d, ar - 2), bBatch(bs.d, br - 2);
  const Dims in[2] = {aBatch, bBatch};
  const Nest<2> nest = broadcastNest<2>("matmul", in, batch);
  const int64_t nb = batch.numel();
  if (m == 0 || n == 0 || nb == 0)
    return;
  if (k == 0) {
    if (!accumulate)
      fill(y, nb * m * n, 0.0f);
    return;
  }
  const Precision p = precision();
  const Operand oa = roundedOperand(a, as.numel(), kWsBasic0, p);
  const Operand ob = roundedOperand(b, bs.numel(), kWsBasic1, p);
  const float beta = accumulate ? 1.0f : 0.0f;
  const int64_t lda = as.d[ar - 1], ldb = bs.d[br - 1];
  const int64_t aMat = m * k, bMat = k * n, yMat = m * n;
  // One GEMM when B is shared by every batch matrix and A's batch rows are
  // contiguous: the batch folds into M.
  if (bBatch.numel() == 1 && !transA && aBatch.numel() == nb && nb * m <= INT_MAX) {
    gemmBatch(false, transB, nb * m, n, k, oa, lda, 0, ob, ldb, 0, beta, y, 0, 1, p);
    return;
  }
  if (nest.rank <= 1) {
    // One stride per operand (0 for a shared one): a strided batch.
    const int64_t sa = nest.inner(0) * aMat, sb = nest.inner(1) * bMat;
    gemmBatch(transA, transB, m, n, k, oa, lda, sa, ob, ldb, sb, beta, y, yMat, nb, p);
    return;
  }
  // Batch dimensions that do not merge: a strided batch along the innermost
  // one for each index of the others.
  const int last = nest.rank - 1;
  const int64_t inner = nest.d[last], outer = nb / inner;
  for (int64_t o = 0; o < outer; ++o) {
    int64_t offA = 0, offB = 0, rem = o;
    for (int i = last - 1; i >= 0; --i) {
      const int64_t ii = rem % nest.d[i];
      rem /= nest.d[i];
      offA += ii * nest.st[0][i];
      offB += ii * nest.st[1][i];
    }
    const Operand pa = {oa.p + offA * aMat * oa.elemBytes, oa.elemBytes};
    const Operand pb = {ob.p + offB * bMat * ob.elemBytes, ob.elemBytes};
    gemmBatch(transA, transB, m, n, k, pa, lda, nest.st[0][last] * aMat, pb, ldb,
              nest.st[1][last] * bMat, beta, y + o * inner * yMat, yMat, inner, p);
  }
}

//===--- Reductions --------------------------------------------------------===//

void reduce(Reduce f, const float *x, Dims xs, uint32_t axesMask, float *y) {
  const ReduceGeom geom = reduceGeom(xs, axesMask);
  const int64_t outCount = geom.outCount, redCount = geom.redCount;
  if (outCount == 0)
    return;
  if (redCount == 0) {
    if (f == Reduce::Max)
      fatal("reduce: max over an empty dimension");
    fill(y, outCount, f == Reduce::Sum ? 0.0f : std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const bool isMax = f == Reduce::Max;
  const double div = f == Reduce::Mean ? static_cast<double>(redCount) : 1.0;
  if (geom.ori)
    return reduceORI(isMax, div, x, geom.O, geom.R, geom.I, y);
  reduceGeneralKernel<<<blocksFor(outCount), kThreads, 0, stream()>>>(x, geom, outCount, isMax, div,
                                                                      y);
  checkLaunch("reduce");
}

//===--- Data movement -----------------------------------------------------===//

template <class T> void transpose(const T *x, Dims xs, Dims perm, T *y) {
  const Nest<1> n = transposeNest(xs, perm);
  const int64_t total = xs.numel();
  if (total == 0)
    return;
  if (n.rank == 0 || n.inner(0) == 1)
    return gatherView("transpose", x, n, y, total);

  // The last y dimension is strided in x: tiles between it and the y
  // dimension that is contiguous in x.
  const int last = n.rank - 1;
  int kx = 0;
  while (n.st[0][kx] != 1)
    ++kx;
  int64_t yst[kMaxRank];
  yst[last] = 1;
  for (int i = last - 1; i >= 0; --i)
    yst[i] = yst[i + 1] * n.d[i + 1];
  TileOuter g;
  for (int i = 0; i < n.rank; ++i) {
    if (i == kx || i == last)
      continue;
    g.od[g.no] = n.d[i];
    g.xs[g.no] = n.st[0][i];
    g.ys[g.no++] = yst[i];
  }
  const int64_t dk = n.d[kx], dl = n.d[last], xl = n.st[0][last], yk = yst[kx];
  const int64_t tk = (dk + kTile - 1) / kTile, tl = (dl + kTile - 1) / kTile;
  const int64_t tiles = total / (dk * dl) * tk * tl;
  const int blocks = static_cast<int>(std::min<int64_t>(tiles, 65535 * 8));
  transposeTilesKernel<<<blocks, dim3(kTile, kTileRows), 0, stream()>>>(x, y, g, dk, dl, xl, yk, tk,
                                                                        tl, tiles);
  checkLaunch("transpose");
}

template <class T> void slice(const T *x, Dims xs, Dims starts, Dims steps, T *y, Dims ys) {
  int64_t base;
  const Nest<1> n = sliceNest("slice", xs, starts, steps, ys, base);
  const int64_t total = ys.numel();
  if (total)
    gatherView("slice", x + base, n, y, total);
}

template <class T> void slice_grad(const T *dy, Dims ys, Dims starts, Dims steps, T *dx, Dims xs) {
  int64_t base;
  const Nest<1> n = sliceNest("slice_grad", xs, starts, steps, ys, base);
  fill(dx, xs.numel(), T(0));
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  scatterViewKernel<<<blocksFor(total), kThreads, 0, stream()>>>(dy, n, dx + base, total);
  checkLaunch("slice_grad");
}

template <class T> void concat(int n, const T *const *xs, const Dims *shapes, int axis, T *y) {
  if (n < 1)
    fatal("concat: no inputs");
  const Dims &s0 = shapes[0];
  axis = normAxis(axis, s0.rank, "concat");
  const int64_t outer = prod(s0, 0, axis);
  int64_t row = 0;
  for (int i = 0; i < n; ++i) {
    const Dims &s = shapes[i];
    if (s.rank != s0.rank)
      fatal("concat: input %d has rank %d, input 0 rank %d", i, s.rank, s0.rank);
    for (int j = 0; j < s.rank; ++j)
      if (j != axis && s.d[j] != s0.d[j])
        fatal("concat: input %d has size %lld on axis %d, input 0 %lld", i, (long long)s.d[j], j,
              (long long)s0.d[j]);
    row += prod(s, axis, s.rank);
  }
  if (outer == 0 || row == 0)
    return;
  int64_t col = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t len = prod(shapes[i], axis, shapes[i].rank);
    if (len > 0) {
      concatKernel<<<blocksFor(outer * len), kThreads, 0, stream()>>>(xs[i], y, outer, len, row,
                                                                      col);
      checkLaunch("concat");
    }
    col += len;
  }
}

template <class T>
void gather(const T *table, Dims ts, const int64_t *idx, Dims is, int axis, T *y) {
  axis = normAxis(axis, ts.rank, "gather");
  const int64_t outer = prod(ts, 0, axis), size = ts.d[axis], inner = prod(ts, axis + 1, ts.rank);
  const int64_t total = outer * is.numel() * inner;
  if (total == 0)
    return;
  gatherKernel<<<blocksFor(total), kThreads, 0, stream()>>>(table, idx, y, is.numel(), size, inner,
                                                            total, deviceError());
  checkLaunch("gather");
}

template <class T>
void gather_grad(const T *dy, const int64_t *idx, Dims is, int axis, T *dtable, Dims ts) {
  axis = normAxis(axis, ts.rank, "gather_grad");
  const int64_t outer = prod(ts, 0, axis), size = ts.d[axis], inner = prod(ts, axis + 1, ts.rank);
  const int64_t ni = is.numel();
  fill(dtable, ts.numel(), T(0));
  const int64_t total = outer * ni * inner;
  if (total == 0)
    return;
  if constexpr (std::is_floating_point_v<T>) {
    gatherGradAtomicKernel<<<blocksFor(total), kThreads, 0, stream()>>>(
        dy, idx, dtable, ni, size, inner, total, deviceError());
  } else {
    gatherGradOwnedKernel<<<blocksFor(outer * inner), kThreads, 0, stream()>>>(
        dy, idx, dtable, ni, size, inner, outer, deviceError());
  }
  checkLaunch("gather_grad");
}

template <class T> void expand(const T *x, Dims xs, T *y, Dims ys) {
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  const Dims in[1] = {xs};
  gatherView("expand", x, broadcastNest<1>("expand", in, ys), y, total);
}

#define CARVE_DATA_MOVEMENT(T)                                                                     \
  template void fill<T>(T *, int64_t, T);                                                          \
  template void copy<T>(const T *, T *, int64_t);                                                  \
  template void transpose<T>(const T *, Dims, Dims, T *);                                          \
  template void slice<T>(const T *, Dims, Dims, Dims, T *, Dims);                                  \
  template void slice_grad<T>(const T *, Dims, Dims, Dims, T *, Dims);                             \
  template void concat<T>(int, const T *const *, const Dims *, int, T *);                          \
  template void gather<T>(const T *, Dims, const int64_t *, Dims, int, T *);                       \
  template void gather_grad<T>(const T *, const int64_t *, Dims, int, T *, Dims);                  \
  template void expand<T>(const T *, Dims, T *, Dims);
CARVE_DATA_MOVEMENT(float)
CARVE_DATA_MOVEMENT(double)
CARVE_DATA_MOVEMENT(int64_t)
CARVE_DATA_MOVEMENT(int32_t)
CARVE_DATA_MOVEMENT(uint8_t)
#undef CARVE_DATA_MOVEMENT

//===--- Tensor parallelism ------------------------------------------------===//

void takeShard(const void *full, Dims fullShape, Split s, int index, void *local, int elemBytes) {
  const SplitRows g = splitRows("takeShard", fullShape, s, elemBytes);
  checkSplitIndex("takeShard", s, index);
  copyPiece(g, index, static_cast<const char *>(full), static_cast<char *>(local), true);
}

void placeShard(const void *local, Dims localShape, Split s, int index, void *full, int elemBytes) {
  const SplitRows g = splitRows("placeShard", carve::rt::fullShape(localShape, s), s, elemBytes);
  checkSplitIndex("placeShard", s, index);
  copyPiece(g, index, static_cast<const char *>(local), static_cast<char *>(full), false);
}

void allGatherSplit(Communicator &c, const void *local, Dims localShape, Split s, void *full,
                    CommType t) {
  checkSplitParts("allGatherSplit", c, s);
  const int es = commTypeBytes(t);
  const Dims fs = carve::rt::fullShape(localShape, s);
  const SplitRows g = splitRows("allGatherSplit", fs, s, es);
  const int64_t n = localShape.numel();
  if (g.outer * g.groups == 1) {
    c.wait(c.allGatherAsync(local, full, n, t));
    return;
  }
  char *gathered = static_cast<char *>(workspace(n * es * c.size(), kWsBasic0));
  c.wait(c.allGatherAsync(local, gathered, n, t));
  for (int r = 0; r < c.size(); ++r)
    copyPiece(g, r, gathered + r * n * es, static_cast<char *>(full), false);
}

void reduceScatterSplit(Communicator &c, const void *full, Dims fullShape, Split s, void *local,
                        CommType t, ReduceOp op) {
  checkSplitParts("reduceScatterSplit", c, s);
  const int es = commTypeBytes(t);
  const SplitRows g = splitRows("reduceScatterSplit", fullShape, s, es);
  const int64_t n = fullShape.numel() / s.parts;
  const std::vector<int64_t> counts(static_cast<size_t>(c.size()), n);
  if (g.outer * g.groups == 1) {
    c.wait(c.reduceScatterAsync(full, local, counts.data(), t, op));
    return;
  }
  char *packed = static_cast<char *>(workspace(n * es * c.size(), kWsBasic0));
  for (int r = 0; r < c.size(); ++r)
    copyPiece(g, r, static_cast<const char *>(full), packed + r * n * es, true);
  c.wait(c.reduceScatterAsync(packed, local, counts.data(), t, op));
}

void allToAllSplit(Communicator &c, const void *in, Dims inLocalShape, Split from, Split to,
                   void *out, CommType t) {
  checkSplitParts("allToAllSplit", c, from);
  checkSplitParts("allToAllSplit", c, to);
  checkSplit("allToAllSplit", inLocalShape, to);
  if (from.dim == to.dim)
    fatal("allToAllSplit: from and to split the same dimension %d", from.dim);
  // Splits of different dimensions commute: the block this rank sends to
  // rank r is piece r (split `to`) of its input, and the block it receives
  // from rank i is piece i (split `from`) of its output.
  const int es = commTypeBytes(t);
  const Dims outShape = carve::rt::shardShape(carve::rt::fullShape(inLocalShape, from), to);
  const SplitRows send = splitRows("allToAllSplit", inLocalShape, to, es);
  const SplitRows recv = splitRows("allToAllSplit", outShape, from, es);
  const int64_t n = inLocalShape.numel() / c.size();
  char *packed = static_cast<char *>(workspace(n * es * c.size(), kWsBasic0));
  char *received = static_cast<char *>(workspace(n * es * c.size(), kWsBasic1));
  for (int r = 0; r < c.size(); ++r)
    copyPiece(send, r, static_cast<const char *>(in), packed + r * n * es, true);
  c.wait(c.allToAllAsync(packed, received, n, t));
  for (int r = 0; r < c.size(); ++r)
    copyPiece(recv, r, received + r * n * es, static_cast<char *>(out), false);
}

void gather_sharded(const float *table, Dims ts, int64_t rowOffset, int64_t globalRows,
                    const int64_t *idx, Dims is, float *y) {
  checkShardRows("gather_sharded", ts, rowOffset, globalRows);
  const int64_t rows = ts.d[0], inner = prod(ts, 1, ts.rank), total = is.numel() * inner;
  if (total == 0)
    return;
  gatherShardedKernel<<<blocksFor(total), kThreads, 0, stream()>>>(
      table, idx, y, rows, rowOffset, globalRows, inner, total, deviceError());
  checkLaunch("gather_sharded");
}

void gather_sharded_grad(const float *dy, const int64_t *idx, Dims is, int64_t rowOffset,
                         int64_t globalRows, float *dtable, Dims ts) {
  checkShardRows("gather_sharded_grad", ts, rowOffset, globalRows);
  const int64_t rows = ts.d[0], inner = prod(ts, 1, ts.rank), total = is.numel() * inner;
  fill(dtable, ts.numel(), 0.0f);
  if (total == 0)
    return;
  gatherShardedGradKernel<<<blocksFor(total), kThreads, 0, stream()>>>(
      dy, idx, dtable, rows, rowOffset, globalRows, inner, total, deviceError());
  checkLaunch("gather_sharded_grad");
}

//===--- Optimizer ---------------------------------------------------------===//

void sgdUpdate(float *p, const float *g, float *buf, int64_t n, double lr, double momentum,
               double dampening, double weightDecay, bool nesterov, bool firstStep) {
  if (n <= 0)
    return;
  sgdKernel<<<blocksFor(n), kThreads, 0, stream()>>>(
      p, g, buf, n, static_cast<float>(weightDecay), static_cast<float>(momentum),
      static_cast<float>(1.0 - dampening), static_cast<float>(-lr), weightDecay != 0, momentum != 0,
      nesterov, firstStep);
  checkLaunch("sgdUpdate");
}

void adamwUpdate(float *p, const float *g, float *m, float *v, int64_t n, double lr, double beta1,
                 double beta2, double eps, double weightDecay, int64_t step) {
  if (n <= 0)
    return;
  // The scalar coefficients of the CPU update (optim.h).
  const carve::rt::AdamwCoefficients k =
      carve::rt::adamwCoefficients(lr, beta1, beta2, eps, weightDecay, step);
  adamwKernel<<<blocksFor(n), kThreads, 0, stream()>>>(p, g, m, v, n, k.decay, k.b1, k.b2, k.c1,
                                                       k.c2, k.bc2Sqrt, k.eps, k.negStep);
  checkLaunch("adamwUpdate");
}

double sumSquares(const float *g, int64_t n) {
  if (n <= 0)
    return 0;
  constexpr int kMaxPartials = 1024;
  const int blocks = std::min(blocksFor(n), kMaxPartials);
  double *partial =
      static_cast<double *>(workspace(sizeof(double) * (kMaxPartials + 1), kWsBasic2));
  sumSquaresKernel<<<blocks, kThreads, 0, stream()>>>(g, n, partial);
  checkLaunch("sumSquares");
  sumPartialsKernel<false><<<1, kThreads, 0, stream()>>>(partial, blocks, partial + kMaxPartials);
  checkLaunch("sumSquares");
  return readScalar(partial + kMaxPartials);
}

double *normAccumulators() {
  double *acc = static_cast<double *>(workspace(2 * sizeof(double), kWsNorm));
  CARVE_CUDA_CHECK(cudaMemsetAsync(acc, 0, 2 * sizeof(double), stream()));
  return acc;
}

void sumSquaresAdd(const float *g, int64_t n, double *acc) {
  if (n <= 0)
    return;
  // The partials' slot is reused by the next call only after this call's
  // kernels have run: one stream orders them.
  constexpr int kMaxPartials = 1024;
  const int blocks = std::min(blocksFor(n), kMaxPartials);
  double *partial = static_cast<double *>(workspace(sizeof(double) * kMaxPartials, kWsBasic2));
  sumSquaresKernel<<<blocks, kThreads, 0, stream()>>>(g, n, partial);
  checkLaunch("sumSquaresAdd");
  sumPartialsKernel<true><<<1, kThreads, 0, stream()>>>(partial, blocks, acc);
  checkLaunch("sumSquaresAdd");
}

void addInPlace(float *dst, const float *src, int64_t n) {
  if (n <= 0)
    return;
  addKernel<<<blocksFor(n), kThreads, 0, stream()>>>(dst, src, n);
  checkLaunch("addInPlace");
}

void scaleInPlace(float *g, int64_t n, float s) {
  if (n <= 0)
    return;
  scaleKernel<<<blocksFor(n), kThreads, 0, stream()>>>(g, n, s);
  checkLaunch("scaleInPlace");
}

} // namespace carve::gpu
