//===- kernels_optim.cu - optimizer updates and the gradient norm ---------===//
//
// The gpu.h functions of the optimizer step: the SGD and AdamW updates, the
// sum of squares behind the gradient norm (to the host, or accumulated on the
// device in stream order), and the in-place add and scale of gradient
// buffers. They mirror runtime/src/optim.cpp; the updates are bit-identical
// to the CPU's.
//
//===----------------------------------------------------------------------===//

#include "kernel_util.cuh"

#include <algorithm>
#include <map>
#include <vector>

namespace carve::gpu {
namespace {

//===--- Optimizer (optim.cpp, with its rounding spelled out) ---------------===//
//
// optim.cpp compiles with contraction off and explicit std::fma where
// PyTorch's kernels fuse; the _rn intrinsics keep nvcc from contracting
// anything else, so the updates are bit-identical to the CPU's.

// A gradient's elements as floats: fp32 as they are, 16-bit ones widened
// (exact), as optim.cpp reads them.
struct F32Elems {
  const float *g;
  __device__ float operator[](int64_t i) const { return g[i]; }
};
struct Bf16Elems {
  const uint16_t *g;
  __device__ float operator[](int64_t i) const { return carve::rt::ew::bf16Float(g[i]); }
};
struct F16Elems {
  const uint16_t *g;
  __device__ float operator[](int64_t i) const { return carve::rt::ew::f16Float(g[i]); }
};

__device__ uint16_t round16(float x, bool f16) {
  return f16 ? carve::rt::ew::f16Bits(x) : carve::rt::ew::bf16Bits(x);
}

/// SGD's scalars as the kernels take them.
struct SgdK {
  float wd, mom, keep, negLr;
  bool decay, useMomentum, nesterov, firstStep;
};

/// One element of the SGD update (sgdKernel's and sgdMultiKernel's).
__device__ __forceinline__ float sgdElement(float *p, float gi, float *buf, int64_t i,
                                            const SgdK &k) {
  float d = k.decay ? __fmaf_rn(p[i], k.wd, gi) : gi;
  if (k.useMomentum) {
    const float b = k.firstStep ? d : __fmaf_rn(d, k.keep, __fmul_rn(buf[i], k.mom));
    buf[i] = b;
    d = k.nesterov ? __fmaf_rn(b, k.mom, d) : b;
  }
  const float pn = __fmaf_rn(d, k.negLr, p[i]);
  p[i] = pn;
  return pn;
}

template <class G>
__global__ void sgdKernel(float *p, G g, float *buf, int64_t n, float wd, float mom, float keep,
                          float negLr, bool decay, bool useMomentum, bool nesterov,
                          bool firstStep) {
  const SgdK k{wd, mom, keep, negLr, decay, useMomentum, nesterov, firstStep};
  CARVE_GRID_LOOP(i, n) sgdElement(p, g[i], buf, i, k);
}

/// AdamW's scalar coefficients as the kernels take them (optim.h's).
struct AdamwK {
  float decay, b1, b2, c1, c2, bc2Sqrt, eps, negStep;
};

/// One element of the AdamW update (adamwKernel's and adamwMultiKernel's).
__device__ __forceinline__ void adamwElement(float *p, float gi, float *m, float *v, int64_t i,
                                             const AdamwK &k, uint16_t *copy, bool copyF16) {
  const float pi = __fmul_rn(p[i], k.decay);
  const float mi = __fmaf_rn(gi, k.c1, __fmul_rn(m[i], k.b1));
  const float vi = __fadd_rn(__fmul_rn(v[i], k.b2), __fmul_rn(__fmul_rn(k.c2, gi), gi));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), k.bc2Sqrt), k.eps);
  const float pn = __fadd_rn(pi, __fdiv_rn(__fmul_rn(k.negStep, mi), denom));
  p[i] = pn;
  m[i] = mi;
  v[i] = vi;
  if (copy)
    copy[i] = copyF16 ? carve::rt::ew::f16Bits(pn) : carve::rt::ew::bf16Bits(pn);
}

/// The tensor a block of a multi-tensor launch works on: first[t] is the
/// first block of tensor t (first[count] the grid), by binary search.
__device__ __forceinline__ int blockTensor(const int64_t *first, int count) {
  int lo = 0, hi = count - 1;
  const int64_t b = blockIdx.x;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first[mid] <= b)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

/// Element i of a multi-tensor table's gradient, widened (exact).
__device__ __forceinline__ float gradAt(const void *g, int kind, int64_t i) {
  if (kind == 1)
    return carve::rt::ew::bf16Float(static_cast<const uint16_t *>(g)[i]);
  if (kind == 2)
    return carve::rt::ew::f16Float(static_cast<const uint16_t *>(g)[i]);
  return static_cast<const float *>(g)[i];
}

/// sgdKernel over many tensors (adamwMultiKernel's layout, below), each
/// update's 16-bit copy written where one is given (toBf16 / toF16's
/// rounding).
__global__ void sgdMultiKernel(const SgdTensor *t, const int64_t *first, int count, SgdK k,
                               bool copyF16) {
  const int r = blockTensor(first, count);
  const SgdTensor x = t[r];
  const int64_t stride = (first[r + 1] - first[r]) * blockDim.x;
  const int64_t start = (static_cast<int64_t>(blockIdx.x) - first[r]) * blockDim.x + threadIdx.x;
  for (int64_t i = start; i < x.n; i += stride) {
    const float pn = sgdElement(x.p, gradAt(x.g, x.gradKind, i), x.buf, i, k);
    if (x.copy)
      x.copy[i] = copyF16 ? carve::rt::ew::f16Bits(pn) : carve::rt::ew::bf16Bits(pn);
  }
}

/// adamwKernel over many tensors: tensor t gets blocks first[t] ..
/// first[t + 1] - 1 and loops over its elements as a grid of that many
/// blocks would (any partition gives the same elements: the update is
/// elementwise).
__global__ void adamwMultiKernel(const AdamwTensor *t, const int64_t *first, int count, AdamwK k,
                                 bool copyF16) {
  const int r = blockTensor(first, count);
  const AdamwTensor x = t[r];
  const int64_t blocks = first[r + 1] - first[r];
  const int64_t stride = blocks * blockDim.x;
  const int64_t start = (static_cast<int64_t>(blockIdx.x) - first[r]) * blockDim.x + threadIdx.x;
  for (int64_t i = start; i < x.n; i += stride)
    adamwElement(x.p, gradAt(x.g, x.gradKind, i), x.m, x.v, i, k, x.copy, copyF16);
}

template <class G>
__global__ void adamwKernel(float *p, G g, float *m, float *v, int64_t n, float decay, float b1,
                            float b2, float c1, float c2, float bc2Sqrt, float eps, float negStep,
                            uint16_t *copy, bool copyF16) {
  // The parameter's 16-bit copy (when given) is rounded to nearest even as
  // toBf16 / toF16 round.
  const AdamwK k{decay, b1, b2, c1, c2, bc2Sqrt, eps, negStep};
  CARVE_GRID_LOOP(i, n) adamwElement(p, g[i], m, v, i, k, copy, copyF16);
}

__global__ void addKernel(float *dst, const float *src, int64_t n) {
  CARVE_GRID_LOOP(i, n) dst[i] = __fadd_rn(dst[i], src[i]);
}

__global__ void scaleKernel(float *g, int64_t n, float s) {
  CARVE_GRID_LOOP(i, n) g[i] = __fmul_rn(g[i], s);
}

template <class G> __global__ void scale16Kernel(uint16_t *g, G e, int64_t n, float s, bool f16) {
  CARVE_GRID_LOOP(i, n) g[i] = round16(__fmul_rn(e[i], s), f16);
}

template <class G> __global__ void add16Kernel(uint16_t *dst, G d, G s, int64_t n, bool f16) {
  CARVE_GRID_LOOP(i, n) dst[i] = round16(__fadd_rn(d[i], s[i]), f16);
}

template <class G> __global__ void addWideKernel(float *dst, G s, int64_t n) {
  CARVE_GRID_LOOP(i, n) dst[i] = __fadd_rn(dst[i], s[i]);
}

template <class G> __global__ void widenKernel(G s, float *dst, int64_t n) {
  CARVE_GRID_LOOP(i, n) dst[i] = s[i];
}

/// The block's total of every thread's `acc`: the warps' sums, then thread
/// 0's sum of them in warp order (the value is thread 0's; the shared
/// scratch is free again when it returns).
__device__ double blockTotal(double acc) {
  __shared__ double warpSums[kThreads / 32];
  acc = warpCombine(false, acc);
  if ((threadIdx.x & 31) == 0)
    warpSums[threadIdx.x >> 5] = acc;
  __syncthreads();
  double s = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / 32; ++w)
      s += warpSums[w];
  __syncthreads();
  return s;
}

/// Block `lb` of `blocks` over g: partial[lb] = its share of the sum of g^2
/// in double (a grid-stride loop as that many blocks run it).
template <class G>
__device__ void squaresOfTerm(G g, int64_t n, int64_t lb, int64_t blocks, double *partial) {
  double acc = 0;
  for (int64_t i = lb * blockDim.x + threadIdx.x; i < n; i += blocks * blockDim.x) {
    const double x = (float)g[i];
    acc += x * x;
  }
  const double s = blockTotal(acc);
  if (threadIdx.x == 0)
    partial[lb] = s;
}

/// partial[block] = the block's sum of g^2 in double.
template <class G> __global__ void sumSquaresKernel(G g, int64_t n, double *partial) {
  squaresOfTerm(g, n, blockIdx.x, gridDim.x, partial);
}

/// The sum of n partials in one block (thread 0's value).
__device__ double sumOfPartials(const double *partial, int n) {
  double acc = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    acc += partial[i];
  return blockTotal(acc);
}

/// out = the sum of the n partials (one block); with Add, *out += it (the
/// gradient norm's accumulators, in stream order).
template <bool Add> __global__ void sumPartialsKernel(const double *partial, int n, double *out) {
  const double s = sumOfPartials(partial, n);
  if (threadIdx.x == 0)
    *out = Add ? *out + s : s;
}

/// sumSquaresKernel of every term: term t's blocks are first[t] ..
/// first[t + 1] - 1, its partials at partial + first[t].
__global__ void sumSquaresMultiKernel(const SquaresTerm *t, const int64_t *first, int count,
                                      double *partial) {
  const int r = blockTensor(first, count);
  const SquaresTerm x = t[r];
  const int64_t blocks = first[r + 1] - first[r], lb = blockIdx.x - first[r];
  if (x.gradKind == 1)
    squaresOfTerm(Bf16Elems{static_cast<const uint16_t *>(x.g)}, x.n, lb, blocks,
                  partial + first[r]);
  else if (x.gradKind == 2)
    squaresOfTerm(F16Elems{static_cast<const uint16_t *>(x.g)}, x.n, lb, blocks,
                  partial + first[r]);
  else
    squaresOfTerm(F32Elems{static_cast<const float *>(x.g)}, x.n, lb, blocks, partial + first[r]);
}

/// sumPartialsKernel<true> of every term in order, in one block: acc[t.acc]
/// += the sum of the term's partials, as the per-term launches add them.
__global__ void sumPartialsMultiKernel(const SquaresTerm *t, const int64_t *first, int count,
                                       const double *partial, double *out) {
  for (int r = 0; r < count; ++r) {
    const double s = sumOfPartials(partial + first[r], static_cast<int>(first[r + 1] - first[r]));
    if (threadIdx.x == 0)
      out[t[r].acc] = out[t[r].acc] + s;
  }
}

} // namespace

//===--- Optimizer ---------------------------------------------------------===//

namespace {

/// Calls f with the accessor of `g`'s format.
template <class F> void withElems(Grad16 g, F &&f) {
  if (g.f16)
    f(F16Elems{g.p});
  else
    f(Bf16Elems{g.p});
}

template <class G>
void sgdLaunch(float *p, G g, float *buf, int64_t n, double lr, double momentum, double dampening,
               double weightDecay, bool nesterov, bool firstStep) {
  if (n <= 0)
    return;
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), sgdKernel<G>)
  (p, g, buf, n, static_cast<float>(weightDecay), static_cast<float>(momentum),
   static_cast<float>(1.0 - dampening), static_cast<float>(-lr), weightDecay != 0, momentum != 0,
   nesterov, firstStep);
  checkLaunch("sgdUpdate");
}

template <class G>
void adamwLaunch(float *p, G g, float *m, float *v, int64_t n, double lr, double beta1,
                 double beta2, double eps, double weightDecay, int64_t step,
                 uint16_t *copy = nullptr, bool copyF16 = false) {
  if (n <= 0)
    return;
  // The scalar coefficients of the CPU update (optim.h).
  const carve::rt::AdamwCoefficients k =
      carve::rt::adamwCoefficients(lr, beta1, beta2, eps, weightDecay, step);
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), adamwKernel<G>)
  (p, g, m, v, n, k.decay, k.b1, k.b2, k.c1, k.c2, k.bc2Sqrt, k.eps, k.negStep, copy, copyF16);
  checkLaunch("adamwUpdate");
}

constexpr int kMaxPartials = 1024;

template <class G> double sumSquaresOf(G g, int64_t n) {
  if (n <= 0)
    return 0;
  const int blocks = std::min(blocksFor(n), kMaxPartials);
  double *partial =
      static_cast<double *>(workspace(sizeof(double) * (kMaxPartials + 1), kWsBasic2));
  CARVE_KERNEL(blocks, kThreads, 0, stream(), sumSquaresKernel<G>)(g, n, partial);
  checkLaunch("sumSquares");
  CARVE_KERNEL(1, kThreads, 0, stream(), sumPartialsKernel<false>)
  (partial, blocks, partial + kMaxPartials);
  checkLaunch("sumSquares");
  return readScalar(partial + kMaxPartials);
}

template <class G> void sumSquaresAddOf(G g, int64_t n, double *acc) {
  if (n <= 0)
    return;
  // The partials' slot is reused by the next call only after this call's
  // kernels have run: one stream orders them.
  const int blocks = std::min(blocksFor(n), kMaxPartials);
  double *partial = static_cast<double *>(workspace(sizeof(double) * kMaxPartials, kWsBasic2));
  CARVE_KERNEL(blocks, kThreads, 0, stream(), sumSquaresKernel<G>)(g, n, partial);
  checkLaunch("sumSquaresAdd");
  CARVE_KERNEL(1, kThreads, 0, stream(), sumPartialsKernel<true>)(partial, blocks, acc);
  checkLaunch("sumSquaresAdd");
}

} // namespace

void sgdUpdate(float *p, const float *g, float *buf, int64_t n, double lr, double momentum,
               double dampening, double weightDecay, bool nesterov, bool firstStep) {
  sgdLaunch(p, F32Elems{g}, buf, n, lr, momentum, dampening, weightDecay, nesterov, firstStep);
}

void sgdUpdate(float *p, Grad16 g, float *buf, int64_t n, double lr, double momentum,
               double dampening, double weightDecay, bool nesterov, bool firstStep) {
  withElems(g, [&](auto e) {
    sgdLaunch(p, e, buf, n, lr, momentum, dampening, weightDecay, nesterov, firstStep);
  });
}

void adamwUpdate(float *p, const float *g, float *m, float *v, int64_t n, double lr, double beta1,
                 double beta2, double eps, double weightDecay, int64_t step) {
  adamwLaunch(p, F32Elems{g}, m, v, n, lr, beta1, beta2, eps, weightDecay, step);
}

void adamwUpdate(float *p, Grad16 g, float *m, float *v, int64_t n, double lr, double beta1,
                 double beta2, double eps, double weightDecay, int64_t step) {
  withElems(g,
            [&](auto e) { adamwLaunch(p, e, m, v, n, lr, beta1, beta2, eps, weightDecay, step); });
}

void adamwUpdateCopy16(float *p, const float *g, float *m, float *v, int64_t n, double lr,
                       double beta1, double beta2, double eps, double weightDecay, int64_t step,
                       uint16_t *copy, bool copyF16) {
  adamwLaunch(p, F32Elems{g}, m, v, n, lr, beta1, beta2, eps, weightDecay, step, copy, copyF16);
}

void adamwUpdateCopy16(float *p, Grad16 g, float *m, float *v, int64_t n, double lr, double beta1,
                       double beta2, double eps, double weightDecay, int64_t step, uint16_t *copy,
                       bool copyF16) {
  withElems(g, [&](auto e) {
    adamwLaunch(p, e, m, v, n, lr, beta1, beta2, eps, weightDecay, step, copy, copyF16);
  });
}

double sumSquares(const float *g, int64_t n) { return sumSquaresOf(F32Elems{g}, n); }

double sumSquares(Grad16 g, int64_t n) {
  double s = 0;
  withElems(g, [&](auto e) { s = sumSquaresOf(e, n); });
  return s;
}

double *normAccumulators() {
  // [0], [1]: tp-split and other gradients; [2], [3]: the same of this
  // rank's experts under expert parallelism.
  double *acc = static_cast<double *>(workspace(4 * sizeof(double), kWsNorm));
  CARVE_CUDA_CHECK(cudaMemsetAsync(acc, 0, 4 * sizeof(double), stream()));
  return acc;
}

void sumSquaresAdd(const float *g, int64_t n, double *acc) { sumSquaresAddOf(F32Elems{g}, n, acc); }

void sumSquaresAdd(Grad16 g, int64_t n, double *acc) {
  withElems(g, [&](auto e) { sumSquaresAddOf(e, n, acc); });
}

//===--- The multi-tensor optimizer ----------------------------------------===//

AdamwTensor adamwTensor(float *p, const float *g, float *m, float *v, int64_t n, uint16_t *copy) {
  return AdamwTensor{p, g, m, v, copy, n, 0};
}

AdamwTensor adamwTensor(float *p, Grad16 g, float *m, float *v, int64_t n, uint16_t *copy) {
  return AdamwTensor{p, g.p, m, v, copy, n, g.f16 ? 2 : 1};
}

SgdTensor sgdTensor(float *p, const float *g, float *buf, int64_t n, uint16_t *copy) {
  return SgdTensor{p, g, buf, copy, n, 0};
}

SgdTensor sgdTensor(float *p, Grad16 g, float *buf, int64_t n, uint16_t *copy) {
  return SgdTensor{p, g.p, buf, copy, n, g.f16 ? 2 : 1};
}

SquaresTerm squaresTerm(const float *g, int64_t n, int acc) { return SquaresTerm{g, n, 0, acc}; }

SquaresTerm squaresTerm(Grad16 g, int64_t n, int acc) {
  return SquaresTerm{g.p, n, g.f16 ? 2 : 1, acc};
}

namespace {

bool same(const AdamwTensor &a, const AdamwTensor &b) {
  return a.p == b.p && a.g == b.g && a.m == b.m && a.v == b.v && a.copy == b.copy && a.n == b.n &&
         a.gradKind == b.gradKind;
}
bool same(const SgdTensor &a, const SgdTensor &b) {
  return a.p == b.p && a.g == b.g && a.buf == b.buf && a.copy == b.copy && a.n == b.n &&
         a.gradKind == b.gradKind;
}
bool same(const SquaresTerm &a, const SquaresTerm &b) {
  return a.g == b.g && a.n == b.n && a.gradKind == b.gradKind && a.acc == b.acc;
}

/// A multi-tensor call's table on the device: the tensors (those with
/// elements), then first[count + 1], each tensor's first block. Uploaded
/// when the call's tensors change (the first step), reused after.
template <class T> struct DeviceTable {
  std::vector<T> rows;
  std::vector<int64_t> first;
  void *dev = nullptr;
  size_t devBytes = 0;

  /// The device copies of rows and first for `t` (blocks per tensor from
  /// `blocksOf`), uploading them if they changed.
  void update(const T *t, int count, int64_t (*blocksOf)(int64_t), const char *what) {
    std::vector<T> now;
    for (int i = 0; i < count; ++i)
      if (t[i].n > 0)
        now.push_back(t[i]);
    bool changed = now.size() != rows.size() || !dev;
    for (size_t i = 0; !changed && i < now.size(); ++i)
      changed = !same(now[i], rows[i]);
    if (!changed)
      return;
    if (capturing())
      fatal("CUDA graph: %s's tensors changed while the step is captured (the warm-up step had "
            "other ones)",
            what);
    rows = std::move(now);
    first.assign(rows.size() + 1, 0);
    for (size_t i = 0; i < rows.size(); ++i)
      first[i + 1] = first[i] + blocksOf(rows[i].n);
    const size_t rowBytes = (rows.size() * sizeof(T) + 255) / 256 * 256;
    const size_t bytes = rowBytes + first.size() * sizeof(int64_t);
    if (bytes > devBytes) {
      if (dev)
        CARVE_CUDA_CHECK(cudaFree(dev));
      CARVE_CUDA_CHECK(cudaMalloc(&dev, bytes));
      devBytes = bytes;
    }
    // Work already enqueued may read the old table.
    CARVE_CUDA_CHECK(cudaStreamSynchronize(stream()));
    CARVE_CUDA_CHECK(cudaMemcpy(dev, rows.data(), rows.size() * sizeof(T), cudaMemcpyHostToDevice));
    CARVE_CUDA_CHECK(cudaMemcpy(static_cast<char *>(dev) + rowBytes, first.data(),
                                first.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
  }
  const T *devRows() const { return static_cast<const T *>(dev); }
  const int64_t *devFirst() const {
    return reinterpret_cast<const int64_t *>(static_cast<const char *>(dev) +
                                             (rows.size() * sizeof(T) + 255) / 256 * 256);
  }
};

int64_t adamwBlocks(int64_t n) { return blocksFor(n); }
int64_t squaresBlocks(int64_t n) { return std::min(blocksFor(n), kMaxPartials); }

} // namespace

void adamwMulti(int site, const AdamwTensor *t, int count, bool copyF16, double lr, double beta1,
                double beta2, double eps, double weightDecay, int64_t step) {
  static std::map<int, DeviceTable<AdamwTensor>> tables;
  DeviceTable<AdamwTensor> &d = tables[site];
  d.update(t, count, adamwBlocks, "adamwMulti");
  if (d.rows.empty())
    return;
  const int64_t grid = d.first.back();
  if (grid > 0x7fffffff)
    fatal("adamwMulti: %lld blocks exceed the grid", (long long)grid);
  const carve::rt::AdamwCoefficients k =
      carve::rt::adamwCoefficients(lr, beta1, beta2, eps, weightDecay, step);
  CARVE_KERNEL(static_cast<unsigned>(grid), kThreads, 0, stream(), adamwMultiKernel)
  (d.devRows(), d.devFirst(), static_cast<int>(d.rows.size()),
   AdamwK{k.decay, k.b1, k.b2, k.c1, k.c2, k.bc2Sqrt, k.eps, k.negStep}, copyF16);
  checkLaunch("adamwMulti");
}

void sgdMulti(int site, const SgdTensor *t, int count, bool copyF16, double lr, double momentum,
              double dampening, double weightDecay, bool nesterov, bool firstStep) {
  static std::map<int, DeviceTable<SgdTensor>> tables;
  DeviceTable<SgdTensor> &d = tables[site];
  d.update(t, count, adamwBlocks, "sgdMulti");
  if (d.rows.empty())
    return;
  const int64_t grid = d.first.back();
  if (grid > 0x7fffffff)
    fatal("sgdMulti: %lld blocks exceed the grid", (long long)grid);
  const SgdK k{static_cast<float>(weightDecay),
               static_cast<float>(momentum),
               static_cast<float>(1.0 - dampening),
               static_cast<float>(-lr),
               weightDecay != 0,
               momentum != 0,
               nesterov,
               firstStep};
  CARVE_KERNEL(static_cast<unsigned>(grid), kThreads, 0, stream(), sgdMultiKernel)
  (d.devRows(), d.devFirst(), static_cast<int>(d.rows.size()), k, copyF16);
  checkLaunch("sgdMulti");
}

void sumSquaresMulti(int site, const SquaresTerm *t, int count, double *acc) {
  static std::map<int, DeviceTable<SquaresTerm>> tables;
  DeviceTable<SquaresTerm> &d = tables[site];
  d.update(t, count, squaresBlocks, "sumSquaresMulti");
  if (d.rows.empty())
    return;
  const int64_t grid = d.first.back();
  double *partial = static_cast<double *>(workspace(sizeof(double) * grid, kWsBasic2));
  CARVE_KERNEL(static_cast<unsigned>(grid), kThreads, 0, stream(), sumSquaresMultiKernel)
  (d.devRows(), d.devFirst(), static_cast<int>(d.rows.size()), partial);
  checkLaunch("sumSquaresMulti");
  CARVE_KERNEL(1, kThreads, 0, stream(), sumPartialsMultiKernel)
  (d.devRows(), d.devFirst(), static_cast<int>(d.rows.size()), partial, acc);
  checkLaunch("sumSquaresMulti");
}

void addInPlace(float *dst, const float *src, int64_t n) {
  if (n <= 0)
    return;
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), addKernel)(dst, src, n);
  checkLaunch("addInPlace");
}

void scaleInPlace(float *g, int64_t n, float s) {
  if (n <= 0)
    return;
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), scaleKernel)(g, n, s);
  checkLaunch("scaleInPlace");
}

void scaleInPlace(Grad16 g, int64_t n, float s) {
  if (n <= 0)
    return;
  withElems(g, [&](auto e) {
    CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), scale16Kernel<decltype(e)>)
    (g.p, e, n, s, g.f16);
  });
  checkLaunch("scaleInPlace");
}

void addInPlace(Grad16 dst, Grad16 src, int64_t n) {
  if (n <= 0)
    return;
  // One format (the generator pairs gradients of one plan); read both as dst's.
  withElems(dst, [&](auto d) {
    using G = decltype(d);
    CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), add16Kernel<G>)
    (dst.p, d, G{src.p}, n, dst.f16);
  });
  checkLaunch("addInPlace");
}

void addInPlace(float *dst, Grad16 src, int64_t n) {
  if (n <= 0)
    return;
  withElems(src, [&](auto e) {
    CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), addWideKernel<decltype(e)>)(dst, e, n);
  });
  checkLaunch("addInPlace");
}

void widen(Grad16 src, float *dst, int64_t n) {
  if (n <= 0)
    return;
  withElems(src, [&](auto e) {
    CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), widenKernel<decltype(e)>)(e, dst, n);
  });
  checkLaunch("widen");
}

} // namespace carve::gpu
