//===- kernels_basic.cu - elementwise maps and reductions -----------------===//
//
// The gpu.h functions that are one pass over memory (elementwise maps with
// NumPy broadcasting, casts, fills and copies) and reductions (matmul through
// cuBLAS and cuBLASLt is in kernels_matmul.cu). Each mirrors the CPU kernel of the same name in
// runtime/src/kernels_*.cpp: same shape checks and messages, same formulas,
// and the same order of float operations where the CPU fixes one. Data
// movement and the shard layouts are in kernels_data.cu, the optimizer
// updates in kernels_optim.cu; the helpers they share in kernel_util.cuh.
//
// Kernels use grid-stride loops over int64 indices with 1-D grids, so any
// tensor size launches with a bounded grid. Broadcasting operands are read
// through per-operand strides (0 on broadcast dimensions) of the output's
// dimensions after dropping size-1 ones and merging neighbours, as the CPU
// loop nests do: equal shapes and scalars become one dimension, whose offsets
// need no division.
//
//===----------------------------------------------------------------------===//

#include "kernel_util.cuh"

#include "carve/rt/philox.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <type_traits>

namespace carve::gpu {

using carve::rt::kMaxRank;

namespace {

__host__ __device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

//===--- Broadcast maps ----------------------------------------------------===//

/// A, B: pointers, or In16 (an operand read as its 16-bit tensor: binary16).
/// Y: a pointer, or Out16 (the result and its 16-bit copy: binary16).
template <class Op, class Y, class A, class B>
__global__ void broadcast2Kernel(Op op, A a, B b, Y y, Nest<2> n, int64_t total) {
  CARVE_GRID_LOOP(e, total) {
    int64_t off[2];
    offsetsOf(n, e, off);
    store(y, e, op(a[off[0]], b[off[1]]));
  }
}

template <class Op, class Y, class A, class B>
void broadcast2(const char *op, Op f, A a, const Dims &as, B b, const Dims &bs, Y y,
                const Dims &ys) {
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  const Dims in[2] = {as, bs};
  const Nest<2> n = broadcastNest<2>(op, in, ys);
  CARVE_KERNEL(blocksFor(total), kThreads, 0, stream(), broadcast2Kernel)(f, a, b, y, n, total);
  checkLaunch(op);
}

//===--- Elementwise functions (elementwise.h) -----------------------------===//

template <Unary F> __device__ __forceinline__ float unaryOp(float v) {
  return carve::rt::ew::unary<F>(v);
}

template <Unary F> __device__ __forceinline__ float unaryGradOp(float v, float g) {
  return carve::rt::ew::unaryGrad<F>(v, g);
}

template <Unary F> __global__ void unaryKernel(const float *x, float *y, int64_t n) {
  CARVE_GRID_LOOP(i, n) y[i] = unaryOp<F>(x[i]);
}

/// X: `const float *`, or In16 (x read as its 16-bit tensor: unary_grad16).
/// DX: `float *`, or Out16 (the gradient and its 16-bit copy).
template <Unary F, class X, class DX>
__global__ void unaryGradKernel(X x, const float *dy, DX dx, int64_t n) {
  CARVE_GRID_LOOP(i, n) store(dx, i, unaryGradOp<F>(x[i], dy[i]));
}

template <Unary F> void launchUnary(const float *x, float *y, int64_t n) {
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), unaryKernel<F>)(x, y, n);
  checkLaunch("unary");
}

template <Unary F, class X, class DX> void launchUnaryGrad(X x, const float *dy, DX dx, int64_t n) {
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), unaryGradKernel<F, X, DX>)(x, dy, dx, n);
  checkLaunch("unary_grad");
}

// Dropout (carve/rt/philox.h): one Philox draw per element, the element's
// word of its block's four (the CPU kernel shares a draw between the four).
// The seed and step (setDropoutState), read by every dropout kernel.
__device__ uint64_t gDropoutState[2];

__global__ void setDropoutStateKernel(uint64_t seed, uint64_t step) {
  gDropoutState[0] = seed;
  gDropoutState[1] = step;
}

__global__ void dropoutKernel(const float *x, carve::rt::philox::DropoutPiece piece, float p,
                              float scale, uint32_t node, float *y, int64_t n) {
  const uint64_t seed = gDropoutState[0];
  const uint32_t step = static_cast<uint32_t>(gDropoutState[1]);
  CARVE_GRID_LOOP(i, n) {
    const uint64_t g = carve::rt::philox::fullIndex(piece, i);
    y[i] = carve::rt::philox::dropoutKeep(seed, step, node, g, p) ? x[i] * scale : 0.0f;
  }
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
  CARVE_KERNEL(blocksFor(total), kThreads, 0, stream(), whereKernel)(c, a, b, y, n, total);
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

template <int F> __global__ void round16Kernel(float *x, int64_t n) {
  CARVE_GRID_LOOP(i, n) x[i] = F == 0 ? carve::rt::ew::roundBf16(x[i]) : carve::rt::ew::roundF16(x[i]);
}
template <int F> __global__ void roundCopy16Kernel(float *x, uint16_t *copy, int64_t n) {
  CARVE_GRID_LOOP(i, n) {
    const uint16_t b = F == 0 ? carve::rt::ew::bf16Bits(x[i]) : carve::rt::ew::f16Bits(x[i]);
    copy[i] = b;
    x[i] = F == 0 ? carve::rt::ew::bf16Float(b) : carve::rt::ew::f16Float(b);
  }
}
template <int F> __global__ void to16Kernel(const float *x, uint16_t *y, int64_t n) {
  CARVE_GRID_LOOP(i, n) y[i] = F == 0 ? carve::rt::ew::bf16Bits(x[i]) : carve::rt::ew::f16Bits(x[i]);
}
template <int F> __global__ void from16Kernel(const uint16_t *x, float *y, int64_t n) {
  CARVE_GRID_LOOP(i, n) y[i] = F == 0 ? carve::rt::ew::bf16Float(x[i]) : carve::rt::ew::f16Float(x[i]);
}

template <class T> __global__ void fillKernel(T *y, int64_t n, T v) {
  CARVE_GRID_LOOP(i, n) y[i] = v;
}

//===--- Reductions --------------------------------------------------------===//

/// Warp w's result for output o: its lanes' `acc` combined, into y[o] when
/// the output is one segment (S == 1), else into partial[w].
/// Y (here and in the reduction kernels below): `float *`, or Out16 (the
/// result written in 16 bits: reduce16). X: `const float *`, or In16 (the
/// input read as stored in 16 bits, widened: reduce16 with x16).
template <class Y>
__device__ __forceinline__ void warpStore(bool isMax, double acc, int lane, int64_t S, double div,
                                          int64_t w, int64_t o, double *partial, Y y) {
  acc = warpCombine(isMax, acc);
  if (lane == 0) {
    if (S == 1)
      store(y, o, static_cast<float>(acc / div));
    else
      partial[w] = acc;
  }
}

/// x seen as [O, R] (the reduced run innermost): warp w reduces segment
/// w % S (of `seg` rows) of row w / S, into y when S == 1, else into
/// partial[w].
template <class X, class Y>
__global__ void reduceRowsKernel(X x, int64_t O, int64_t R, int64_t seg, int64_t S, bool isMax,
                                 double div, double *partial, Y y) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t stride = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const double identity = isMax ? -CUDART_INF : 0.0;
  for (int64_t w = first; w < O * S; w += stride) {
    const int64_t o = w / S, s = w - o * S;
    const int64_t r0 = s * seg, r1 = imin(R, r0 + seg);
    const auto p = x + o * R;
    double acc = identity;
    for (int64_t r = r0 + lane; r < r1; r += 32)
      acc = combine(isMax, acc, p[r]);
    warpStore(isMax, acc, lane, S, div, w, o, partial, y);
  }
}

/// x seen as [O, R, I]: thread t = (o * S + s) * I + i reduces rows
/// [s * seg, (s + 1) * seg) of column (o, i) into y when S == 1, else into
/// partial[t].
template <class X, class Y>
__global__ void reduceColumnsKernel(X x, int64_t O, int64_t R, int64_t I, int64_t seg, int64_t S,
                                    bool isMax, double div, double *partial, Y y) {
  const double identity = isMax ? -CUDART_INF : 0.0;
  CARVE_GRID_LOOP(t, O * S * I) {
    const int64_t i = t % I, q = t / I;
    const int64_t s = q % S, o = q / S;
    const int64_t r0 = s * seg, r1 = imin(R, r0 + seg);
    const auto p = x + o * R * I + i;
    double acc = identity;
    for (int64_t r = r0; r < r1; ++r)
      acc = combine(isMax, acc, p[r * I]);
    if (S == 1)
      store(y, o * I + i, static_cast<float>(acc / div));
    else
      partial[t] = acc;
  }
}

/// y[o, i] = the S partials of (o, i) combined in order.
template <class Y>
__global__ void reducePartialsKernel(const double *partial, int64_t O, int64_t S, int64_t I,
                                     bool isMax, double div, Y y) {
  CARVE_GRID_LOOP(t, O * I) {
    const int64_t o = t / I, i = t - o * I;
    const double *p = partial + o * S * I + i;
    double acc = p[0];
    for (int64_t s = 1; s < S; ++s)
      acc = combine(isMax, acc, p[s * I]);
    store(y, t, static_cast<float>(acc / div));
  }
}

/// reduceColumnsKernel and reducePartialsKernel in one launch: block (b, s)
/// reduces rows [s * seg, (s + 1) * seg) of the columns c = b * blockDim.x +
/// threadIdx.x < O * I into partial[(o * S + s) * I + i]; the last of the S
/// blocks of a column tile to arrive (counted in arrived[b], which it sets
/// back to zero) combines the tile's S partials in order s = 0 .. S - 1, as
/// reducePartialsKernel does: the same bits, one launch less (a bias
/// gradient of a GPT layer: four a layer).
template <class X, class Y>
__global__ void reduceColumnsLastKernel(X x, int64_t O, int64_t R, int64_t I, int64_t seg,
                                        int64_t S, bool isMax, double div, double *partial,
                                        unsigned *arrived, Y y) {
  const double identity = isMax ? -CUDART_INF : 0.0;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t s = blockIdx.y;
  const bool mine = c < O * I;
  const int64_t o = mine ? c / I : 0, i = mine ? c - o * I : 0;
  if (mine) {
    const int64_t r0 = s * seg, r1 = imin(R, r0 + seg);
    const auto p = x + o * R * I + i;
    double acc = identity;
    for (int64_t r = r0; r < r1; ++r)
      acc = combine(isMax, acc, p[r * I]);
    partial[(o * S + s) * I + i] = acc;
  }
  // Publish the partials, then count this block in.
  __threadfence();
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0)
    last = atomicAdd(&arrived[blockIdx.x], 1u) == gridDim.y - 1;
  __syncthreads();
  if (!last)
    return;
  __threadfence();
  if (mine) {
    // Read past any cached copy: other blocks wrote these.
    const volatile double *p = partial + o * S * I + i;
    double acc = p[0];
    for (int64_t k = 1; k < S; ++k)
      acc = combine(isMax, acc, p[k * I]);
    store(y, c, static_cast<float>(acc / div));
  }
  if (threadIdx.x == 0)
    arrived[blockIdx.x] = 0; // for the next call (and a graph's next replay)
}

/// A reduction that is not [O, R, I] (batch norm's statistics: [N, C, H*W]
/// over N and H*W). Warp w reduces segment w % S (`seg` elements, in the
/// order of the reduced dimensions) of output w / S, into y when S == 1, else
/// into partial[w]. The lanes take consecutive elements, so the innermost
/// reduced run is read coalesced where its stride is 1. A lane finds its
/// first element's offset by division once, then steps 32 elements at a time
/// by adding the step's digits with carries (`dig[j]` is the index in reduced
/// dimension nr - 1 - j) instead of dividing for every element: ResNet-18's
/// calls went from 23.3 to 20.5 us on average on an H200.
/// The digits of q over the reduced dimensions, innermost first: dig[j] is
/// the index in reduced dimension nr - 1 - j (what q does not fill is lost
/// past the outermost).
__device__ __forceinline__ void reducedDigits(const ReduceGeom &g, int64_t q,
                                              int64_t (&dig)[kMaxRank]) {
#pragma unroll
  for (int j = 0; j < kMaxRank; ++j) {
    dig[j] = 0;
    if (j < g.nr) {
      const int64_t d = g.rd[g.nr - 1 - j];
      dig[j] = q % d;
      q /= d;
    }
  }
}

template <class X, class Y>
__global__ void reduceGeneralKernel(X x, ReduceGeom g, int64_t seg, int64_t S, bool isMax,
                                    double div, double *partial, Y y) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t stride = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const double identity = isMax ? -CUDART_INF : 0.0;
  int64_t step[kMaxRank];
  reducedDigits(g, 32, step);
  for (int64_t w = first; w < g.outCount * S; w += stride) {
    const int64_t o = w / S, s = w - o * S;
    int64_t off = 0, rem = o;
    for (int i = g.no - 1; i >= 0; --i) {
      off += (rem % g.od[i]) * g.os[i];
      rem /= g.od[i];
    }
    const int64_t r0 = s * seg + lane, r1 = imin(g.redCount, (s + 1) * seg);
    int64_t dig[kMaxRank];
    reducedDigits(g, r0, dig);
#pragma unroll
    for (int j = 0; j < kMaxRank; ++j)
      if (j < g.nr)
        off += dig[j] * g.rs[g.nr - 1 - j];
    double acc = identity;
    for (int64_t r = r0; r < r1; r += 32) {
      acc = combine(isMax, acc, x[off]);
      // Past r1 the digits may overflow the outermost dimension: never read.
      int64_t carry = 0;
#pragma unroll
      for (int j = 0; j < kMaxRank; ++j) {
        if (j < g.nr) {
          const int64_t d = g.rd[g.nr - 1 - j];
          int64_t v = dig[j] + step[j] + carry;
          carry = v >= d;
          if (carry)
            v -= d;
          off += (v - dig[j]) * g.rs[g.nr - 1 - j];
          dig[j] = v;
        }
      }
    }
    warpStore(isMax, acc, lane, S, div, w, o, partial, y);
  }
}

/// Threads (I > 1) or warps (I == 1) that keep the GPU busy without making
/// the partials large.
constexpr int64_t kReduceThreads = int64_t(1) << 18;
constexpr int64_t kReduceWarps = 8192;
/// The grid's y and x limits (reduceColumnsLastKernel's segments and tiles).
constexpr int64_t kMaxGridY = 65535, kMaxGridX = 2147483647;

template <class X, class Y>
void reduceORI(bool isMax, double div, X x, int64_t O, int64_t R, int64_t I, Y y) {
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
    CARVE_KERNEL(blocksFor(warps * 32), kThreads, 0, stream(), reduceRowsKernel)
    (x, O, R, seg, S, isMax, div, partial, y);
  } else if (S > 1 && S <= kMaxGridY && O * I <= int64_t(kThreads) * kMaxGridX) {
    const int64_t tiles = ceilDiv(O * I, kThreads);
    auto *arrived = static_cast<unsigned *>(workspace(sizeof(unsigned) * tiles, kWsCounters));
    CARVE_KERNEL(dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(S)), kThreads, 0,
                 stream(), reduceColumnsLastKernel)
    (x, O, R, I, seg, S, isMax, div, partial, arrived, y);
    checkLaunch("reduce");
    return;
  } else {
    CARVE_KERNEL(blocksFor(O * S * I), kThreads, 0, stream(), reduceColumnsKernel)
    (x, O, R, I, seg, S, isMax, div, partial, y);
  }
  checkLaunch("reduce");
  if (S > 1) {
    CARVE_KERNEL(blocksFor(O * I), kThreads, 0, stream(), reducePartialsKernel)
    (partial, O, S, I, isMax, div, y);
    checkLaunch("reduce");
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

namespace {

template <class X, class DX> void unaryGradAs(Unary f, X x, const float *dy, DX dx, int64_t n) {
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

} // namespace

void unary_grad(Unary f, const float *x, const float *dy, float *dx, int64_t n) {
  unaryGradAs(f, x, dy, dx, n);
}

void unary_grad16(Unary f, const void *x, bool x16, const float *dy, float *dx, uint16_t *dx16,
                  bool round, int64_t n) {
  const In16 xi = in16("unary_grad16", x, x16);
  if (dx16)
    unaryGradAs(f, xi, dy, Out16{dx, dx16, format16For("unary_grad16"), round}, n);
  else
    unaryGradAs(f, xi, dy, dx, n);
}

void setDropoutState(uint64_t seed, int64_t step) {
  CARVE_KERNEL(1, 1, 0, stream(), setDropoutStateKernel)(seed, static_cast<uint64_t>(step));
  checkLaunch("setDropoutState");
}

void dropout(const float *x, const carve::rt::philox::DropoutPiece &piece, double p, int64_t node,
             float *y) {
  const int64_t n = piece.dims.numel();
  if (n <= 0)
    return;
  if (p <= 0)
    return copy(x, y, n);
  if (!(p < 1))
    fatal("dropout: p = %g is outside [0, 1)", p);
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), dropoutKernel)
  (x, piece, (float)p, carve::rt::philox::dropoutScale(p), (uint32_t)node, y, n);
  checkLaunch("dropout");
}

namespace {

template <class A, class B, class Y>
void binaryAs(Binary f, A a, Dims as, B b, Dims bs, Y y, Dims ys) {
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

} // namespace

void binary(Binary f, const float *a, Dims as, const float *b, Dims bs, float *y, Dims ys) {
  binaryAs(f, a, as, b, bs, y, ys);
}

void binary16(Binary f, const void *a, bool a16, Dims as, const void *b, bool b16, Dims bs,
              float *y, uint16_t *y16, bool round, Dims ys) {
  const In16 ai = in16("binary16", a, a16), bi = in16("binary16", b, b16);
  if (y16)
    binaryAs(f, ai, as, bi, bs, Out16{y, y16, format16For("binary16"), round}, ys);
  else
    binaryAs(f, ai, as, bi, bs, y, ys);
}

/// Integer arithmetic (index computations: `token * k + slot`): the CPU
/// target's function (elementwise.h), so both compute the same integers.
template <Binary F> struct IntBinaryOp {
  __device__ __forceinline__ int64_t operator()(int64_t u, int64_t v) const {
    return carve::rt::ew::binary<F>(u, v);
  }
};

void binary(Binary f, const int64_t *a, Dims as, const int64_t *b, Dims bs, int64_t *y, Dims ys) {
  switch (f) {
  case Binary::Add:
    return broadcast2("add", IntBinaryOp<Binary::Add>(), a, as, b, bs, y, ys);
  case Binary::Sub:
    return broadcast2("sub", IntBinaryOp<Binary::Sub>(), a, as, b, bs, y, ys);
  case Binary::Mul:
    return broadcast2("mul", IntBinaryOp<Binary::Mul>(), a, as, b, bs, y, ys);
  case Binary::Div:
    return broadcast2("div", IntBinaryOp<Binary::Div>(), a, as, b, bs, y, ys);
  case Binary::Max:
    return broadcast2("max", IntBinaryOp<Binary::Max>(), a, as, b, bs, y, ys);
  case Binary::Min:
    return broadcast2("min", IntBinaryOp<Binary::Min>(), a, as, b, bs, y, ys);
  case Binary::Pow:
    break;
  }
  fatal("binary: function %d has no int64 kernel", static_cast<int>(f));
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

#define CARVE_16BIT(NAME, KERNEL, F, IN, OUT)                                                      \
  void NAME(IN x, OUT y, int64_t n) {                                                              \
    if (n <= 0)                                                                                    \
      return;                                                                                      \
    CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), KERNEL<F>)(x, y, n);                         \
    checkLaunch(#NAME);                                                                            \
  }
CARVE_16BIT(toBf16, to16Kernel, 0, const float *, uint16_t *)
CARVE_16BIT(toF16, to16Kernel, 1, const float *, uint16_t *)
CARVE_16BIT(fromBf16, from16Kernel, 0, const uint16_t *, float *)
CARVE_16BIT(fromF16, from16Kernel, 1, const uint16_t *, float *)
#undef CARVE_16BIT
void roundBf16(float *x, int64_t n) {
  if (n <= 0)
    return;
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), round16Kernel<0>)(x, n);
  checkLaunch("roundBf16");
}
void roundCopyBf16(float *x, uint16_t *copy, int64_t n) {
  if (n <= 0)
    return;
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), roundCopy16Kernel<0>)(x, copy, n);
  checkLaunch("roundCopyBf16");
}
void roundCopyF16(float *x, uint16_t *copy, int64_t n) {
  if (n <= 0)
    return;
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), roundCopy16Kernel<1>)(x, copy, n);
  checkLaunch("roundCopyF16");
}
void roundF16(float *x, int64_t n) {
  if (n <= 0)
    return;
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), round16Kernel<1>)(x, n);
  checkLaunch("roundF16");
}

template <class From, class To> void cast(const From *x, To *y, int64_t n) {
  if (n <= 0)
    return;
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), castKernel)(x, y, n);
  checkLaunch("cast");
}

template <class T> void fill(T *y, int64_t n, T v) {
  if (n <= 0)
    return;
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), fillKernel)(y, n, v);
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

#define CARVE_FILL_COPY(T)                                                                         \
  template void fill<T>(T *, int64_t, T);                                                          \
  template void copy<T>(const T *, T *, int64_t);
CARVE_FILL_COPY(float)
CARVE_FILL_COPY(double)
CARVE_FILL_COPY(int64_t)
CARVE_FILL_COPY(int32_t)
CARVE_FILL_COPY(uint8_t)
#undef CARVE_FILL_COPY
// 16-bit floats' bits (a 16-bit gradient into its slot).
template void copy<uint16_t>(const uint16_t *, uint16_t *, int64_t);

//===--- Reductions --------------------------------------------------------===//

namespace {

/// A reduction over no element: `v` in every output.
void fillOut(float *y, int64_t n, float v) { fill(y, n, v); }
void fillOut(const Out16 &y, int64_t n, float v) {
  fill<uint16_t>(y.y16, n, y.fmt == 1 ? carve::rt::ew::bf16Bits(v) : carve::rt::ew::f16Bits(v));
}

template <class X, class Y> void reduceAs(Reduce f, X x, Dims xs, uint32_t axesMask, Y y) {
  const ReduceGeom geom = reduceGeom(xs, axesMask);
  const int64_t outCount = geom.outCount, redCount = geom.redCount;
  if (outCount == 0)
    return;
  if (redCount == 0) {
    if (f == Reduce::Max)
      fatal("reduce: max over an empty dimension");
    fillOut(y, outCount, f == Reduce::Sum ? 0.0f : std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const bool isMax = f == Reduce::Max;
  const double div = f == Reduce::Mean ? static_cast<double>(redCount) : 1.0;
  if (geom.ori)
    return reduceORI(isMax, div, x, geom.O, geom.R, geom.I, y);
  // As reduceORI's rows: about kReduceWarps warps, segments of at least
  // 1024 elements, combined in order by reducePartialsKernel.
  auto ceilDiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  int64_t S = std::clamp<int64_t>(ceilDiv(kReduceWarps, outCount), 1, ceilDiv(redCount, 1024));
  const int64_t seg = ceilDiv(redCount, S);
  S = ceilDiv(redCount, seg);
  double *partial = nullptr;
  if (S > 1)
    partial = static_cast<double *>(workspace(sizeof(double) * outCount * S, kWsBasic2));
  CARVE_KERNEL(blocksFor(outCount * S * 32), kThreads, 0, stream(), reduceGeneralKernel)
  (x, geom, seg, S, isMax, div, partial, y);
  checkLaunch("reduce");
  if (S > 1) {
    CARVE_KERNEL(blocksFor(outCount), kThreads, 0, stream(), reducePartialsKernel)
    (partial, outCount, S, 1, isMax, div, y);
    checkLaunch("reduce");
  }
}

} // namespace

void reduce(Reduce f, const float *x, Dims xs, uint32_t axesMask, float *y) {
  reduceAs(f, x, xs, axesMask, y);
}

void reduce16(Reduce f, const void *x, bool x16, Dims xs, uint32_t axesMask, float *y,
              uint16_t *y16) {
  if (!y && !y16)
    fatal("reduce16: no result to write (neither f32 nor 16-bit)");
  if (x16) {
    const In16 xi = in16("reduce16", x, true);
    if (y16)
      return reduceAs(f, xi, xs, axesMask, Out16{y, y16, format16For("reduce16"), false});
    return reduceAs(f, xi, xs, axesMask, y);
  }
  const auto *xf = static_cast<const float *>(x);
  if (y16)
    return reduceAs(f, xf, xs, axesMask, Out16{y, y16, format16For("reduce16"), false});
  reduceAs(f, xf, xs, axesMask, y);
}

} // namespace carve::gpu
