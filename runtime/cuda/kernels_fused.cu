//===- kernels_fused.cu - softmax, layer norm and RMS norm ----------------===//
//
// The row-wise kernels of gpu.h that normalize: softmax and log-softmax
// along any axis, layer norm and RMS norm, and their gradients, with the
// semantics of their CPU counterparts in runtime/src/kernels_*.cpp. Their
// neighbours in "Reductions, normalization, attention, loss" are
// kernels_loss.cu (cross-entropy, also vocabulary-parallel) and
// kernels_attention.cu; `reduce` is in kernels_basic.cu. The warp and block
// reductions they share are in row_reduce.cuh.
//
// Layout of the work:
// - A row is handled by one warp when it is short and by one block when it
//   is long (softmax along the last axis), so that a row's reductions are
//   shuffles; along an inner axis, one thread owns a column and adjacent
//   threads read adjacent columns.
// - Layer and RMS norm take one block per row; the gradients of scale and
//   bias are summed per block into partial rows and then across blocks in a
//   fixed order, so that they are the same from run to run (no float atomics).
//
//===----------------------------------------------------------------------===//

#include "kernel_util.cuh"
#include "row_reduce.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace carve::gpu {
namespace {

/// Threads per block for one row of n elements.
int rowThreads(int64_t n) { return n <= 128 ? 64 : n <= 512 ? 128 : n <= 2048 ? 256 : 512; }

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
template <class X>
__device__ void rowMoments(X xr, int64_t N, float eps, float *sh, float &mean, float &rstd) {
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
template <class X> __device__ float rowRms(X xr, int64_t N, float eps, float *sh) {
  float s = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x)
    s += xr[i] * xr[i];
  return 1.0f / sqrtf(blockSum(s, sh) / static_cast<float>(N) + eps);
}

/// X, S: `const float *`, or In16 (an operand read as its 16-bit tensor).
/// Y: `float *`, or Out16 (the result with its 16-bit copy).
template <class X, class S, class Y>
__global__ void layerNormKernel(X x, S scale, S bias, float eps, Y y, int64_t R, int64_t N) {
  __shared__ float sh[32];
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const X xr = x + r * N;
    float mean, rstd;
    rowMoments(xr, N, eps, sh, mean, rstd);
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
      float v = (xr[i] - mean) * rstd;
      if (scale)
        v *= scale[i];
      if (bias)
        v += bias[i];
      store(y, r * N + i, v);
    }
  }
}

/// A norm gradient's input gradient added to the residual branch's
/// gradient `res` (carve-select-kernels' rule 4c: the add after it, computed
/// here): the sum written to `y` and its 16-bit copy `y16` (fmt 1: bf16, 2:
/// fp16; rounded to nearest even, as toBf16 / toF16 round), each skipped
/// where null. The sum is the add's: the same two f32 values, added once
/// (__fadd_rn: never contracted into the product before it).
struct AddOut {
  const float *res;
  float *y;
  uint16_t *y16;
  int fmt;
};
__device__ __forceinline__ void store(const AddOut &o, int64_t e, float v) {
  const float s = __fadd_rn(o.res[e], v);
  if (o.y)
    o.y[e] = s;
  if (o.y16)
    o.y16[e] = o.fmt == 1 ? carve::rt::ew::bf16Bits(s) : carve::rt::ew::f16Bits(s);
}

/// dx per row (D: `float *`, or AddOut); with `part`, block b also sums
/// dy * xhat and dy over its rows into part[b][0, N) and part[b][N, 2N)
/// (each thread owns its columns, so no two threads touch one entry).
template <class X, class S, class D>
__global__ void layerNormGradKernel(X x, S scale, float eps, const float *dy, D dx, float *part,
                                    int64_t R, int64_t N) {
  __shared__ float sh[32];
  float *ps = part ? part + static_cast<int64_t>(blockIdx.x) * 2 * N : nullptr;
  bool first = true;
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const X xr = x + r * N;
    const float *gr = dy + r * N;
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
      store(dx, r * N + i, rstd * (g - mg - xh * mgx));
      if (ps) {
        ps[i] = first ? gr[i] * xh : ps[i] + gr[i] * xh;
        ps[N + i] = first ? gr[i] : ps[N + i] + gr[i];
      }
    }
    first = false;
  }
}

template <class X, class S, class Y>
__global__ void rmsNormKernel(X x, S scale, float eps, Y y, int64_t R, int64_t N) {
  __shared__ float sh[32];
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const X xr = x + r * N;
    const float rs = rowRms(xr, N, eps, sh);
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x)
      store(y, r * N + i, scale ? xr[i] * rs * scale[i] : xr[i] * rs);
  }
}

/// As layerNormGradKernel; `part` (when set) gets the sums of dy * xhat only.
template <class X, class S, class D>
__global__ void rmsNormGradKernel(X x, S scale, float eps, const float *dy, D dx, float *part,
                                  int64_t R, int64_t N) {
  __shared__ float sh[32];
  float *ps = part ? part + static_cast<int64_t>(blockIdx.x) * N : nullptr;
  bool first = true;
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const X xr = x + r * N;
    const float *gr = dy + r * N;
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
      store(dx, r * N + i, rs * (g - xh * mgx));
      if (ps)
        ps[i] = first ? gr[i] * xh : ps[i] + gr[i] * xh;
    }
    first = false;
  }
}

/// A parameter gradient's outputs: the f32 value and/or its 16-bit copy (fmt
/// 1: bf16, 2: fp16; the bits toBf16 / toF16 write: layer_norm_grad16's
/// dscale16, dbias16), each skipped where null.
struct GradOut {
  float *y = nullptr;
  uint16_t *y16 = nullptr;
  int fmt = 0;
  bool any() const { return y || y16; }
};

__device__ __forceinline__ void put(const GradOut &o, int64_t i, float v) {
  if (o.y)
    o.y[i] = v;
  if (o.y16)
    o.y16[i] = o.fmt == 1 ? carve::rt::ew::bf16Bits(v) : carve::rt::ew::f16Bits(v);
}

/// Zeros (sums over no row) in a gradient's outputs.
void zeroGrad(const GradOut &o, int64_t N) {
  if (o.y)
    CARVE_CUDA_CHECK(cudaMemsetAsync(o.y, 0, N * sizeof(float), stream()));
  if (o.y16)
    CARVE_CUDA_CHECK(cudaMemsetAsync(o.y16, 0, N * sizeof(uint16_t), stream()));
}

/// out[c][i] = sum over blocks b of part[b][c][i] (parts of `width` rows of N
/// each, c < width), in a fixed order.
__global__ void sumPartials(const float *part, int64_t blocks, int64_t N, int width, GradOut out0,
                            GradOut out1) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < N;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double s0 = 0, s1 = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      s0 += part[b * width * N + i];
      if (width > 1)
        s1 += part[b * width * N + N + i];
    }
    put(out0, i, static_cast<float>(s0));
    put(out1, i, static_cast<float>(s1));
  }
}

/// Blocks of the norm gradients: enough to fill the device, few enough that
/// their partial rows (`width` x N floats each) stay small.
int64_t normGradBlocks(int64_t R, int64_t N, int width) {
  const int64_t byMemory = std::max<int64_t>(1, (int64_t(1) << 26) / (width * N));
  return std::max<int64_t>(1, std::min<int64_t>({R, 1024, byMemory}));
}

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
    CARVE_KERNEL(blocksFor(O * I), kThreads, 0, stream(), softmaxColumns)(x, y, O, A, I, log);
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
    CARVE_KERNEL(blocksFor(O * I), kThreads, 0, stream(), softmaxGradColumns)
    (y, dy, dx, O, A, I, log);
  checkLaunch("softmax_grad");
}

//===--- Layer and RMS norm -----------------------------------------------===//

namespace {

// X, S: `const float *`, or In16 (the f32 entries' operands, or those the
// *16 entries read as their 16-bit tensors: carve.read16).

template <class X, class S, class Y>
void layerNormAs(X x, Dims xs, int axis, S scale, S bias, float eps, Y y) {
  axis = normAxis(axis, xs.rank, "layer_norm");
  const int64_t R = prod(xs, 0, axis), N = prod(xs, axis, xs.rank);
  if (R * N == 0)
    return;
  CARVE_KERNEL(gridFor(R), rowThreads(N), 0, stream(), layerNormKernel)
  (x, scale, bias, eps, y, R, N);
  checkLaunch("layer_norm");
}

template <class X, class S, class D>
void layerNormGradAs(X x, Dims xs, int axis, S scale, float eps, const float *dy, D dx,
                     GradOut dscale, GradOut dbias) {
  axis = normAxis(axis, xs.rank, "layer_norm_grad");
  const int64_t R = prod(xs, 0, axis), N = prod(xs, axis, xs.rank);
  if (N == 0)
    return;
  const bool params = dscale.any() || dbias.any();
  if (R == 0) {
    // Sums over no row.
    zeroGrad(dscale, N);
    zeroGrad(dbias, N);
    return;
  }
  const int64_t blocks = params ? normGradBlocks(R, N, 2) : gridFor(R);
  float *part =
      params ? static_cast<float *>(workspace(blocks * 2 * N * sizeof(float), kWsFused1)) : nullptr;
  CARVE_KERNEL(static_cast<int>(blocks), rowThreads(N), 0, stream(), layerNormGradKernel)
  (x, scale, eps, dy, dx, part, R, N);
  checkLaunch("layer_norm_grad");
  if (!params)
    return;
  CARVE_KERNEL(blocksFor(N), kThreads, 0, stream(), sumPartials)(part, blocks, N, 2, dscale, dbias);
  checkLaunch("layer_norm_grad");
}

template <class X, class S, class Y>
void rmsNormAs(X x, Dims xs, int axis, S scale, float eps, Y y) {
  axis = normAxis(axis, xs.rank, "rms_norm");
  const int64_t R = prod(xs, 0, axis), N = prod(xs, axis, xs.rank);
  if (R * N == 0)
    return;
  CARVE_KERNEL(gridFor(R), rowThreads(N), 0, stream(), rmsNormKernel)(x, scale, eps, y, R, N);
  checkLaunch("rms_norm");
}

template <class X, class S, class D>
void rmsNormGradAs(X x, Dims xs, int axis, S scale, float eps, const float *dy, D dx,
                   GradOut dscale) {
  axis = normAxis(axis, xs.rank, "rms_norm_grad");
  const int64_t R = prod(xs, 0, axis), N = prod(xs, axis, xs.rank);
  if (N == 0)
    return;
  if (R == 0) {
    zeroGrad(dscale, N);
    return;
  }
  const int64_t blocks = dscale.any() ? normGradBlocks(R, N, 1) : gridFor(R);
  float *part = dscale.any()
                    ? static_cast<float *>(workspace(blocks * N * sizeof(float), kWsFused1))
                    : nullptr;
  CARVE_KERNEL(static_cast<int>(blocks), rowThreads(N), 0, stream(), rmsNormGradKernel)
  (x, scale, eps, dy, dx, part, R, N);
  checkLaunch("rms_norm_grad");
  if (!dscale.any())
    return;
  CARVE_KERNEL(blocksFor(N), kThreads, 0, stream(), sumPartials)
  (part, blocks, N, 1, dscale, GradOut{});
  checkLaunch("rms_norm_grad");
}

} // namespace

void layer_norm(const float *x, Dims xs, int axis, const float *scale, const float *bias, float eps,
                float *y) {
  layerNormAs(x, xs, axis, scale, bias, eps, y);
}

void layer_norm16(const void *x, bool x16, Dims xs, int axis, const void *scale, bool scale16,
                  const void *bias, bool bias16, float eps, float *y, uint16_t *y16, bool round) {
  const char *op = "layer_norm16";
  const In16 xi = in16(op, x, x16), si = in16(op, scale, scale16), bi = in16(op, bias, bias16);
  if (y16)
    layerNormAs(xi, xs, axis, si, bi, eps, Out16{y, y16, format16For(op), round});
  else
    layerNormAs(xi, xs, axis, si, bi, eps, y);
}

void layer_norm_grad(const float *x, Dims xs, int axis, const float *scale, float eps,
                     const float *dy, float *dx, float *dscale, float *dbias) {
  layerNormGradAs(x, xs, axis, scale, eps, dy, dx, GradOut{dscale}, GradOut{dbias});
}

void layer_norm_grad16(const void *x, bool x16, Dims xs, int axis, const void *scale, bool scale16,
                       float eps, const float *dy, float *dx, uint16_t *dx16, float *dscale,
                       float *dbias, uint16_t *dscale16, uint16_t *dbias16) {
  const char *op = "layer_norm_grad16";
  const int fmt = dx16 || dscale16 || dbias16 ? format16For(op) : 0;
  if (dx16)
    layerNormGradAs(in16(op, x, x16), xs, axis, in16(op, scale, scale16), eps, dy,
                    Out16{dx, dx16, fmt, false}, GradOut{dscale, dscale16, fmt},
                    GradOut{dbias, dbias16, fmt});
  else
    layerNormGradAs(in16(op, x, x16), xs, axis, in16(op, scale, scale16), eps, dy, dx,
                    GradOut{dscale, dscale16, fmt}, GradOut{dbias, dbias16, fmt});
}

void layer_norm_grad_add(const float *x, Dims xs, int axis, const float *scale, float eps,
                         const float *dy, const float *residual, float *dx, float *dscale,
                         float *dbias) {
  layerNormGradAs(x, xs, axis, scale, eps, dy, AddOut{residual, dx, nullptr, 0}, GradOut{dscale},
                  GradOut{dbias});
}

void layer_norm_grad_add16(const void *x, bool x16, Dims xs, int axis, const void *scale,
                           bool scale16, float eps, const float *dy, const float *residual,
                           float *dx, uint16_t *dx16, float *dscale, float *dbias,
                           uint16_t *dscale16, uint16_t *dbias16) {
  const char *op = "layer_norm_grad_add16";
  const int fmt = dx16 || dscale16 || dbias16 ? format16For(op) : 0;
  layerNormGradAs(in16(op, x, x16), xs, axis, in16(op, scale, scale16), eps, dy,
                  AddOut{residual, dx, dx16, fmt}, GradOut{dscale, dscale16, fmt},
                  GradOut{dbias, dbias16, fmt});
}

void rms_norm(const float *x, Dims xs, int axis, const float *scale, float eps, float *y) {
  rmsNormAs(x, xs, axis, scale, eps, y);
}

//===--- Rotary position embedding ----------------------------------------===//

namespace {

/// cos's and sin's element strides against x ([0, rank)), 0 where broadcast.
struct RotaryArgs {
  int rank = 0;
  int64_t xd[carve::rt::kMaxRank] = {}, cst[carve::rt::kMaxRank] = {},
          sst[carve::rt::kMaxRank] = {};
  int64_t d = 0, n = 0;
};

RotaryArgs rotaryArgs(const char *op, const Dims &xs, const Dims &cs, const Dims &ss) {
  RotaryArgs a;
  a.rank = xs.rank;
  if (xs.rank < 1 || xs.d[xs.rank - 1] % 2 != 0)
    fatal("%s: the input's last dimension must be even", op);
  for (int t = 0; t < 2; ++t) {
    const Dims &ts = t ? ss : cs;
    int64_t *st = t ? a.sst : a.cst;
    if (ts.rank > xs.rank)
      fatal("%s: %s of rank %d does not broadcast to the input's rank %d", op, t ? "sin" : "cos",
            ts.rank, xs.rank);
    int64_t stride = 1;
    for (int i = xs.rank - 1; i >= 0; --i) {
      const int k = i - (xs.rank - ts.rank);
      const int64_t dim = k >= 0 ? ts.d[k] : 1;
      if (dim != 1 && dim != xs.d[i])
        fatal("%s: %s dimension %d of size %lld does not broadcast to %lld", op, t ? "sin" : "cos",
              k, (long long)dim, (long long)xs.d[i]);
      st[i] = dim == 1 ? 0 : stride;
      stride *= dim;
    }
  }
  for (int i = 0; i < xs.rank; ++i)
    a.xd[i] = xs.d[i];
  a.d = xs.d[xs.rank - 1];
  a.n = xs.numel();
  return a;
}

/// The offsets of element e's cos and sin entries.
__device__ __forceinline__ void rotaryOffsets(const RotaryArgs &a, int64_t e, int64_t &co,
                                              int64_t &so) {
  co = so = 0;
  for (int i = a.rank - 1; i >= 0; --i) {
    const int64_t at = e % a.xd[i];
    e /= a.xd[i];
    co += at * a.cst[i];
    so += at * a.sst[i];
  }
}

/// X: `const float *`, or In16 (read as stored); Y: `float *`, or Out16
/// (with its 16-bit copy).
template <class X, class Y>
__global__ void rotaryKernel(RotaryArgs a, X x, const float *cos, const float *sin, Y y) {
  const int64_t h = a.d / 2;
  CARVE_GRID_LOOP(e, a.n) {
    const int64_t j = e % a.d;
    int64_t co, so;
    rotaryOffsets(a, e, co, so);
    const float rh = j < h ? -x[e + h] : x[e - h];
    store(y, e, __fadd_rn(__fmul_rn(x[e], cos[co]), __fmul_rn(rh, sin[so])));
  }
}

template <class X, class Y>
__global__ void rotaryGradKernel(RotaryArgs a, X dy, const float *cos, const float *sin, Y dx) {
  const int64_t h = a.d / 2;
  CARVE_GRID_LOOP(e, a.n) {
    const int64_t j = e % a.d;
    const int64_t k = j < h ? e + h : e - h; // the element rotate_half moved to e
    int64_t co, so, kc, ks;
    rotaryOffsets(a, e, co, so);
    rotaryOffsets(a, k, kc, ks);
    const float z = __fmul_rn(dy[k], sin[ks]);
    const float t = j < h ? __fadd_rn(0.0f, z) : __fadd_rn(-z, 0.0f);
    store(dx, e, __fadd_rn(t, __fmul_rn(dy[e], cos[co])));
  }
}

} // namespace

void rotary(const float *x, Dims xs, const float *cos, Dims cs, const float *sin, Dims ss,
            float *y) {
  const RotaryArgs a = rotaryArgs("rotary", xs, cs, ss);
  if (a.n == 0)
    return;
  CARVE_KERNEL(blocksFor(a.n), kThreads, 0, stream(), rotaryKernel)(a, x, cos, sin, y);
  checkLaunch("rotary");
}

void rotary_grad(const float *dy, Dims xs, const float *cos, Dims cs, const float *sin, Dims ss,
                 float *dx) {
  const RotaryArgs a = rotaryArgs("rotary_grad", xs, cs, ss);
  if (a.n == 0)
    return;
  CARVE_KERNEL(blocksFor(a.n), kThreads, 0, stream(), rotaryGradKernel)(a, dy, cos, sin, dx);
  checkLaunch("rotary_grad");
}

void rotary16(const void *x, bool x16, Dims xs, const float *cos, Dims cs, const float *sin,
              Dims ss, float *y, uint16_t *y16, bool round) {
  const char *op = "rotary16";
  const RotaryArgs a = rotaryArgs(op, xs, cs, ss);
  if (a.n == 0)
    return;
  const In16 xi = in16(op, x, x16);
  if (y16) {
    const Out16 out{y, y16, format16For(op), round};
    CARVE_KERNEL(blocksFor(a.n), kThreads, 0, stream(), rotaryKernel)(a, xi, cos, sin, out);
  } else {
    CARVE_KERNEL(blocksFor(a.n), kThreads, 0, stream(), rotaryKernel)(a, xi, cos, sin, y);
  }
  checkLaunch(op);
}

void rotary_grad16(const void *dy, bool dy16, Dims xs, const float *cos, Dims cs, const float *sin,
                   Dims ss, float *dx, uint16_t *dx16, bool round) {
  const char *op = "rotary_grad16";
  const RotaryArgs a = rotaryArgs(op, xs, cs, ss);
  if (a.n == 0)
    return;
  const In16 gi = in16(op, dy, dy16);
  if (dx16) {
    const Out16 out{dx, dx16, format16For(op), round};
    CARVE_KERNEL(blocksFor(a.n), kThreads, 0, stream(), rotaryGradKernel)(a, gi, cos, sin, out);
  } else {
    CARVE_KERNEL(blocksFor(a.n), kThreads, 0, stream(), rotaryGradKernel)(a, gi, cos, sin, dx);
  }
  checkLaunch(op);
}

void rms_norm16(const void *x, bool x16, Dims xs, int axis, const void *scale, bool scale16,
                float eps, float *y, uint16_t *y16, bool round) {
  const char *op = "rms_norm16";
  const In16 xi = in16(op, x, x16), si = in16(op, scale, scale16);
  if (y16)
    rmsNormAs(xi, xs, axis, si, eps, Out16{y, y16, format16For(op), round});
  else
    rmsNormAs(xi, xs, axis, si, eps, y);
}

void rms_norm_grad(const float *x, Dims xs, int axis, const float *scale, float eps,
                   const float *dy, float *dx, float *dscale) {
  rmsNormGradAs(x, xs, axis, scale, eps, dy, dx, GradOut{dscale});
}

void rms_norm_grad16(const void *x, bool x16, Dims xs, int axis, const void *scale, bool scale16,
                     float eps, const float *dy, float *dx, uint16_t *dx16, float *dscale,
                     uint16_t *dscale16) {
  const char *op = "rms_norm_grad16";
  const int fmt = dx16 || dscale16 ? format16For(op) : 0;
  if (dx16)
    rmsNormGradAs(in16(op, x, x16), xs, axis, in16(op, scale, scale16), eps, dy,
                  Out16{dx, dx16, fmt, false}, GradOut{dscale, dscale16, fmt});
  else
    rmsNormGradAs(in16(op, x, x16), xs, axis, in16(op, scale, scale16), eps, dy, dx,
                  GradOut{dscale, dscale16, fmt});
}

void rms_norm_grad_add(const float *x, Dims xs, int axis, const float *scale, float eps,
                       const float *dy, const float *residual, float *dx, float *dscale) {
  rmsNormGradAs(x, xs, axis, scale, eps, dy, AddOut{residual, dx, nullptr, 0}, GradOut{dscale});
}

void rms_norm_grad_add16(const void *x, bool x16, Dims xs, int axis, const void *scale,
                         bool scale16, float eps, const float *dy, const float *residual, float *dx,
                         uint16_t *dx16, float *dscale, uint16_t *dscale16) {
  const char *op = "rms_norm_grad_add16";
  const int fmt = dx16 || dscale16 ? format16For(op) : 0;
  rmsNormGradAs(in16(op, x, x16), xs, axis, in16(op, scale, scale16), eps, dy,
                AddOut{residual, dx, dx16, fmt}, GradOut{dscale, dscale16, fmt});
}

} // namespace carve::gpu
