//===- kernels_loss.cu - cross-entropy, also vocabulary-parallel ----------===//
//
// gpu.h's cross_entropy and cross_entropy_grad, and the vocabulary-parallel
// cross-entropy of dist.h (logits split by classes over a group, the row
// statistics all-reduced through the Communicator), with the semantics and
// messages of the CPU kernels in runtime/src/kernels_gather_loss.cpp and
// dist.cpp.
//
// Layout of the work: contiguous rows (class stride 1) go to one warp when
// they are short and one block when they are long (row_reduce.cuh); with a
// class stride, one thread owns an element and adjacent threads read
// adjacent positions. Targets are validated on the device into the device
// error record (internal.h), reported at the next synchronize as the CPU
// kernel's message. The sums of a reduction go through per-block partials,
// added in a fixed order.
//
//===----------------------------------------------------------------------===//

#include "kernel_util.cuh"
#include "row_reduce.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace carve::gpu {
namespace {

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

/// Logits (and logit gradients) stored as f32 (F = 0), bf16 (1) or fp16 (2):
/// element i as a float, and a float stored (16 bits: rounded to nearest even).
template <int F> __device__ __forceinline__ float loadAs(const void *p, int64_t i) {
  if constexpr (F == 0)
    return static_cast<const float *>(p)[i];
  else if constexpr (F == 1)
    return carve::rt::ew::bf16Float(static_cast<const uint16_t *>(p)[i]);
  else
    return carve::rt::ew::f16Float(static_cast<const uint16_t *>(p)[i]);
}
template <int F> __device__ __forceinline__ void storeAs(void *p, int64_t i, float v) {
  if constexpr (F == 0)
    static_cast<float *>(p)[i] = v;
  else if constexpr (F == 1)
    static_cast<uint16_t *>(p)[i] = carve::rt::ew::bf16Bits(v);
  else
    static_cast<uint16_t *>(p)[i] = carve::rt::ew::f16Bits(v);
}

/// Sums per-thread values of the block in a fixed order into part[blockIdx.x].
__device__ void blockPartial(double v, double *sh, double *part) {
  v = blockSum(v, sh);
  if (threadIdx.x == 0)
    part[blockIdx.x] = v;
}

/// Loss of contiguous rows (class stride 1), one row per group.
template <int F, bool kBlock>
__global__ void ceLossRows(const void *logits, const int64_t *targets, int64_t rows, int64_t C,
                           bool hasIgnore, int64_t ignoreIndex, int reduction, float *y,
                           double *part) {
  __shared__ float sh[32];
  __shared__ double shd[32];
  const RowGroup<kBlock> g;
  double acc = 0; // on the group's lane 0
  for (int64_t row = g.first; row < rows; row += g.stride) {
    const int64_t xr = row * C;
    float m = kNegInf;
    for (int64_t j = g.lane; j < C; j += g.size)
      m = fmaxf(m, loadAs<F>(logits, xr + j));
    m = g.max(m, sh);
    float s = 0;
    for (int64_t j = g.lane; j < C; j += g.size)
      s += expf(loadAs<F>(logits, xr + j) - m);
    s = g.sum(s, sh);
    if (g.lane == 0) {
      const int64_t t = targets[row];
      double loss = 0;
      // -log_softmax at the target: -(x_t - max - log(sum)). Out-of-range
      // targets were recorded by ceCount; they add nothing here.
      if (!ignored(t, hasIgnore, ignoreIndex) && t >= 0 && t < C)
        loss =
            -((static_cast<double>(loadAs<F>(logits, xr + t)) - m) - log(static_cast<double>(s)));
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
template <int F>
__global__ void ceLossStrided(const void *logits, const int64_t *targets, int64_t e, int64_t C,
                              int64_t S, bool hasIgnore, int64_t ignoreIndex, int reduction,
                              float *y, double *part) {
  __shared__ double shd[32];
  double acc = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < e;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / S, u = i % S;
    const int64_t base = n * C * S + u;
    float m = kNegInf;
    for (int64_t j = 0; j < C; ++j)
      m = fmaxf(m, loadAs<F>(logits, base + j * S));
    float s = 0;
    for (int64_t j = 0; j < C; ++j)
      s += expf(loadAs<F>(logits, base + j * S) - m);
    const int64_t t = targets[i];
    double loss = 0;
    if (!ignored(t, hasIgnore, ignoreIndex) && t >= 0 && t < C)
      loss = -((static_cast<double>(loadAs<F>(logits, base + t * S)) - m) -
               log(static_cast<double>(s)));
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
/// FIO = 3 * (logits' format) + (dlogits' format), formats as loadAs.
template <int FIO, bool kBlock>
__global__ void ceGradRows(const void *logits, const int64_t *targets, int64_t rows, int64_t C,
                           bool hasIgnore, int64_t ignoreIndex, int reduction, const float *dy,
                           const unsigned long long *count, void *dlogits) {
  constexpr int FI = FIO / 3, FO = FIO % 3;
  __shared__ float sh[32];
  const RowGroup<kBlock> g;
  for (int64_t row = g.first; row < rows; row += g.stride) {
    const int64_t xr = row * C;
    float m = kNegInf;
    for (int64_t j = g.lane; j < C; j += g.size)
      m = fmaxf(m, loadAs<FI>(logits, xr + j));
    m = g.max(m, sh);
    float s = 0;
    for (int64_t j = g.lane; j < C; j += g.size)
      s += expf(loadAs<FI>(logits, xr + j) - m);
    s = g.sum(s, sh);
    const int64_t t = targets[row];
    const double w = ceWeight(t, row, hasIgnore, ignoreIndex, reduction, dy, count);
    const float ws = static_cast<float>(w / s), wf = static_cast<float>(w);
    for (int64_t j = g.lane; j < C; j += g.size) {
      float d = ws * expf(loadAs<FI>(logits, xr + j) - m);
      if (j == t && w != 0.0)
        d -= wf;
      storeAs<FO>(dlogits, xr + j, d);
    }
  }
}

/// ceLossRows and ceGradRows in one pass: the same statistics per row, the
/// loss term and the partial sums ceLossRows writes (same grid), and the
/// gradient ceGradRows writes. Every lane reads the target's logit before a
/// synchronization of the group that precedes the gradient's writes, so
/// that a gradient written in place over the logits cannot overwrite it
/// first.
template <int FIO, bool kBlock>
__global__ void ceLossGradRows(const void *logits, const int64_t *targets, int64_t rows, int64_t C,
                               bool hasIgnore, int64_t ignoreIndex, int reduction, const float *dy,
                               const unsigned long long *count, void *dlogits, float *y,
                               double *part) {
  constexpr int FI = FIO / 3, FO = FIO % 3;
  __shared__ float sh[32];
  __shared__ double shd[32];
  const RowGroup<kBlock> g;
  double acc = 0; // on the group's lane 0
  for (int64_t row = g.first; row < rows; row += g.stride) {
    const int64_t xr = row * C;
    float m = kNegInf;
    for (int64_t j = g.lane; j < C; j += g.size)
      m = fmaxf(m, loadAs<FI>(logits, xr + j));
    m = g.max(m, sh);
    float s = 0;
    for (int64_t j = g.lane; j < C; j += g.size)
      s += expf(loadAs<FI>(logits, xr + j) - m);
    const int64_t t = targets[row];
    const bool counted = !ignored(t, hasIgnore, ignoreIndex) && t >= 0 && t < C;
    const float xt = counted ? loadAs<FI>(logits, xr + t) : 0.0f;
    s = g.sum(s, sh); // a block's sum ends with __syncthreads
    if constexpr (!kBlock)
      __syncwarp(); // every lane's read of xt before any write of the row
    if (g.lane == 0) {
      const double loss =
          counted ? -((static_cast<double>(xt) - m) - log(static_cast<double>(s))) : 0.0;
      if (reduction == 2)
        y[row] = static_cast<float>(loss);
      else
        acc += loss;
    }
    const double w = ceWeight(t, row, hasIgnore, ignoreIndex, reduction, dy, count);
    const float ws = static_cast<float>(w / s), wf = static_cast<float>(w);
    for (int64_t j = g.lane; j < C; j += g.size) {
      float d = ws * expf(loadAs<FI>(logits, xr + j) - m);
      if (j == t && w != 0.0)
        d -= wf;
      storeAs<FO>(dlogits, xr + j, d);
    }
  }
  if (reduction != 2)
    blockPartial(acc, shd, part);
}

template <int FIO>
__global__ void ceGradStrided(const void *logits, const int64_t *targets, int64_t e, int64_t C,
                              int64_t S, bool hasIgnore, int64_t ignoreIndex, int reduction,
                              const float *dy, const unsigned long long *count, void *dlogits) {
  constexpr int FI = FIO / 3, FO = FIO % 3;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < e;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / S, u = i % S;
    const int64_t base = n * C * S + u;
    float m = kNegInf;
    for (int64_t j = 0; j < C; ++j)
      m = fmaxf(m, loadAs<FI>(logits, base + j * S));
    float s = 0;
    for (int64_t j = 0; j < C; ++j)
      s += expf(loadAs<FI>(logits, base + j * S) - m);
    const int64_t t = targets[i];
    const double w = ceWeight(t, i, hasIgnore, ignoreIndex, reduction, dy, count);
    const float ws = static_cast<float>(w / s), wf = static_cast<float>(w);
    for (int64_t j = 0; j < C; ++j) {
      float d = ws * expf(loadAs<FI>(logits, base + j * S) - m);
      if (j == t && w != 0.0)
        d -= wf;
      storeAs<FO>(dlogits, base + j * S, d);
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
  CARVE_KERNEL(blocksFor(e), kThreads, 0, stream(), ceCount)
  (targets, e, hasIgnore, ignoreIndex, classes, deviceError(), s.count);
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

//===--- Cross entropy ----------------------------------------------------===//

namespace {

/// The loadAs format of the precision's 16-bit storage (bf16: 1, fp16: 2).
int format16(const char *op) { return format16For(op, "logits"); }

template <int F>
void crossEntropyAs(const char *op, const void *logits, Dims ls, const int64_t *targets,
                    int reduction, bool hasIgnore, int64_t ignoreIndex, float *y) {
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
      CARVE_LAUNCH_ROWS_T(ceLossRows, F, g.e, g.c, logits, targets, g.e, g.c, hasIgnore,
                          ignoreIndex, reduction, y, s.part);
    else
      CARVE_KERNEL(np, kThreads, 0, stream(), ceLossStrided<F>)
      (logits, targets, g.e, g.c, g.s, hasIgnore, ignoreIndex, reduction, y, s.part);
    checkLaunch(op);
  }
  if (reduction != 2) {
    CARVE_KERNEL(1, kThreads, 0, stream(), ceFinish)(s.part, np, s.count, reduction, y);
    checkLaunch(op);
  }
}

template <int FIO>
void crossEntropyGradAs(const char *op, const void *logits, Dims ls, const int64_t *targets,
                        int reduction, bool hasIgnore, int64_t ignoreIndex, const float *dy,
                        void *dlogits) {
  const CeGeom g = ceGeom(op, ls, reduction);
  if (g.e == 0)
    return;
  const CeScratch s = ceScratch(0, 0, nullptr);
  ceCountLaunch(targets, g.e, hasIgnore, ignoreIndex, g.c, s, op);
  if (g.c == 0)
    return;
  if (g.s == 1)
    CARVE_LAUNCH_ROWS_T(ceGradRows, FIO, g.e, g.c, logits, targets, g.e, g.c, hasIgnore,
                        ignoreIndex, reduction, dy, s.count, dlogits);
  else
    CARVE_KERNEL(blocksFor(g.e), kThreads, 0, stream(), ceGradStrided<FIO>)
    (logits, targets, g.e, g.c, g.s, hasIgnore, ignoreIndex, reduction, dy, s.count, dlogits);
  checkLaunch(op);
}

template <int FIO>
void crossEntropyWithGradAs(const char *op, const void *logits, Dims ls, const int64_t *targets,
                            int reduction, bool hasIgnore, int64_t ignoreIndex, const float *dy,
                            void *dlogits, float *y) {
  const CeGeom g = ceGeom(op, ls, reduction);
  // crossEntropyAs's partials: one per block of the rows' kernel.
  const int np =
      g.e == 0
          ? 0
          : (g.c <= kWarpRow ? gridFor((g.e + kWarpRowThreads / 32 - 1) / (kWarpRowThreads / 32))
                             : gridFor(g.e));
  const CeScratch s = ceScratch(np, 0, nullptr);
  ceCountLaunch(targets, g.e, hasIgnore, ignoreIndex, g.c, s, op);
  if (g.e > 0) {
    CARVE_LAUNCH_ROWS_T(ceLossGradRows, FIO, g.e, g.c, logits, targets, g.e, g.c, hasIgnore,
                        ignoreIndex, reduction, dy, s.count, dlogits, y, s.part);
    checkLaunch(op);
  }
  if (reduction != 2) {
    CARVE_KERNEL(1, kThreads, 0, stream(), ceFinish)(s.part, np, s.count, reduction, y);
    checkLaunch(op);
  }
}

} // namespace

void cross_entropy_with_grad(const void *logits, bool l16, Dims ls, const int64_t *targets,
                             int reduction, bool hasIgnore, int64_t ignoreIndex, const float *dy,
                             void *dlogits, bool d16, float *y) {
  const char *op = "cross_entropy_with_grad";
  const CeGeom g = ceGeom(op, ls, reduction);
  if (g.s != 1 || g.c == 0) {
    // Classes with a stride (or none): the two calls, the loss first (the
    // gradient may overwrite the logits).
    if (l16)
      cross_entropy16(logits, ls, targets, reduction, hasIgnore, ignoreIndex, y);
    else
      cross_entropy(static_cast<const float *>(logits), ls, targets, reduction, hasIgnore,
                    ignoreIndex, y);
    return cross_entropy_grad16(logits, l16, ls, targets, reduction, hasIgnore, ignoreIndex, dy,
                                dlogits, d16);
  }
  const int f = l16 || d16 ? format16(op) : 0;
  const int fio = 3 * (l16 ? f : 0) + (d16 ? f : 0);
  switch (fio) {
#define CARVE_CASE(N)                                                                              \
  case N:                                                                                          \
    return crossEntropyWithGradAs<N>(op, logits, ls, targets, reduction, hasIgnore, ignoreIndex,   \
                                     dy, dlogits, y);
    CARVE_CASE(0)
    CARVE_CASE(1)
    CARVE_CASE(2)
    CARVE_CASE(3)
    CARVE_CASE(4)
    CARVE_CASE(6)
    CARVE_CASE(8)
#undef CARVE_CASE
  }
  fatal("%s: unexpected formats %d", op, fio);
}

void cross_entropy(const float *logits, Dims ls, const int64_t *targets, int reduction,
                   bool hasIgnore, int64_t ignoreIndex, float *y) {
  crossEntropyAs<0>("cross_entropy", logits, ls, targets, reduction, hasIgnore, ignoreIndex, y);
}

void cross_entropy16(const void *logits, Dims ls, const int64_t *targets, int reduction,
                     bool hasIgnore, int64_t ignoreIndex, float *y) {
  const char *op = "cross_entropy16";
  if (format16(op) == 1)
    crossEntropyAs<1>(op, logits, ls, targets, reduction, hasIgnore, ignoreIndex, y);
  else
    crossEntropyAs<2>(op, logits, ls, targets, reduction, hasIgnore, ignoreIndex, y);
}

void cross_entropy_grad(const float *logits, Dims ls, const int64_t *targets, int reduction,
                        bool hasIgnore, int64_t ignoreIndex, const float *dy, float *dlogits) {
  crossEntropyGradAs<0>("cross_entropy_grad", logits, ls, targets, reduction, hasIgnore,
                        ignoreIndex, dy, dlogits);
}

void cross_entropy_grad16(const void *logits, bool l16, Dims ls, const int64_t *targets,
                          int reduction, bool hasIgnore, int64_t ignoreIndex, const float *dy,
                          void *dlogits, bool d16) {
  const char *op = "cross_entropy_grad16";
  const int f = l16 || d16 ? format16(op) : 0;
  const int fio = 3 * (l16 ? f : 0) + (d16 ? f : 0);
  switch (fio) {
#define CARVE_CASE(N)                                                                              \
  case N:                                                                                          \
    return crossEntropyGradAs<N>(op, logits, ls, targets, reduction, hasIgnore, ignoreIndex, dy,   \
                                 dlogits);
    CARVE_CASE(0)
    CARVE_CASE(1)
    CARVE_CASE(2)
    CARVE_CASE(3)
    CARVE_CASE(4)
    CARVE_CASE(6)
    CARVE_CASE(8)
#undef CARVE_CASE
  }
  fatal("%s: unexpected formats %d", op, fio);
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
    CARVE_KERNEL(blocksFor(g.e), kThreads, 0, stream(), vpMaxStrided)(logits, g.e, g.c, g.s, mx);
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
      CARVE_KERNEL(blocksFor(g.e), kThreads, 0, stream(), vpSumStrided)
      (logits, targets, g.e, g.c, g.s, vocabOffset, hasIgnore, ignoreIndex, mx, acc, tlogit);
    checkLaunch(op);
  }
  CARVE_KERNEL(1, 1, 0, stream(), setDouble)(acc + tail, static_cast<double>(g.c));
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
    CARVE_KERNEL(np, kThreads, 0, stream(), vpLoss)
    (targets, g.e, g.c, vocabOffset, hasIgnore, ignoreIndex, reduction, s.mx, s.acc, deviceError(),
     y, s.ce.part);
    checkLaunch(op);
  }
  if (reduction != 2) {
    CARVE_KERNEL(1, kThreads, 0, stream(), ceFinish)(s.ce.part, np, s.ce.count, reduction, y);
    checkLaunch(op);
  }
}

/// count_correct's row statistics: stats[r] = the row's largest logit here,
/// stats[e + r] = the target's logit (-inf where this rank lacks the target).
template <int F>
__global__ void ccRowStats(const void *logits, const int64_t *targets, int64_t e, int64_t c,
                           int64_t s, int64_t vocabOffset, float *stats) {
  for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < e;
       r += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = r / s, u = r % s;
    const int64_t base = i * c * s + u;
    float mx = -INFINITY;
    for (int64_t k = 0; k < c; ++k)
      mx = fmaxf(mx, loadAs<F>(logits, base + k * s));
    const int64_t t = targets[r] - vocabOffset;
    stats[r] = mx;
    stats[e + r] = t >= 0 && t < c ? loadAs<F>(logits, base + t * s) : -INFINITY;
  }
}

/// counts[0] += rows whose target logit is the largest, counts[1] += rows counted.
__global__ void ccCount(const float *stats, const int64_t *targets, int64_t e, bool hasIgnore,
                        int64_t ignoreIndex, double *counts) {
  double right = 0, counted = 0;
  for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < e;
       r += (int64_t)gridDim.x * blockDim.x) {
    if (ignored(targets[r], hasIgnore, ignoreIndex))
      continue;
    counted += 1;
    right += stats[e + r] >= stats[r] ? 1 : 0;
  }
  if (counted > 0) {
    atomicAdd(counts, right);
    atomicAdd(counts + 1, counted);
  }
}

namespace {
void countCorrectAs(int f, const char *op, Communicator *c, const void *logits, Dims ls,
                    int64_t vocabOffset, const int64_t *targets, bool hasIgnore,
                    int64_t ignoreIndex, double *counts) {
  const CeGeom g = ceGeom(op, ls, 0);
  if (g.e == 0)
    return;
  const size_t statBytes = (static_cast<size_t>(2 * g.e) * sizeof(float) + 255) / 256 * 256;
  char *w = static_cast<char *>(workspace(statBytes + 2 * sizeof(double), kWsFused0));
  float *stats = reinterpret_cast<float *>(w);
  double *dev = reinterpret_cast<double *>(w + statBytes);
  if (f == 0)
    CARVE_KERNEL(blocksFor(g.e), kThreads, 0, stream(), ccRowStats<0>)
  (logits, targets, g.e, g.c, g.s, vocabOffset, stats);
  else if (f == 1) CARVE_KERNEL(blocksFor(g.e), kThreads, 0, stream(),
                                ccRowStats<1>)(logits, targets, g.e, g.c, g.s, vocabOffset, stats);
  else CARVE_KERNEL(blocksFor(g.e), kThreads, 0, stream(), ccRowStats<2>)(logits, targets, g.e, g.c,
                                                                          g.s, vocabOffset, stats);
  checkLaunch(op);
  if (c)
    allReduceDevice(*c, stats, 2 * g.e, CommType::F32, ReduceOp::Max);
  cudaMemsetAsync(dev, 0, 2 * sizeof(double), stream());
  CARVE_KERNEL(blocksFor(g.e), kThreads, 0, stream(), ccCount)
  (stats, targets, g.e, hasIgnore, ignoreIndex, dev);
  checkLaunch(op);
  double host[2];
  readScalars(dev, host, 2);
  counts[0] += host[0];
  counts[1] += host[1];
}
} // namespace

void count_correct(Communicator *c, const float *logits, Dims ls, int64_t vocabOffset,
                   const int64_t *targets, bool hasIgnore, int64_t ignoreIndex, double *counts) {
  countCorrectAs(0, "count_correct", c, logits, ls, vocabOffset, targets, hasIgnore, ignoreIndex,
                 counts);
}

void count_correct16(Communicator *c, const void *logits, Dims ls, int64_t vocabOffset,
                     const int64_t *targets, bool hasIgnore, int64_t ignoreIndex, double *counts) {
  const char *op = "count_correct16";
  countCorrectAs(format16(op), op, c, logits, ls, vocabOffset, targets, hasIgnore, ignoreIndex,
                 counts);
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
    CARVE_KERNEL(blocksFor(g.e), kThreads, 0, stream(), vpGradStrided)
    (logits, targets, g.e, g.c, g.s, vocabOffset, hasIgnore, ignoreIndex, reduction, dy, s.ce.count,
     s.mx, s.acc, deviceError(), dlogits);
  checkLaunch(op);
}

} // namespace carve::gpu
