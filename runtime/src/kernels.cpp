//===- kernels.cpp - CPU kernels called by generated programs -------------===//
//
// The implementations behind kernels.h. Habits that hold throughout:
//  - shapes are coalesced first (size-1 dimensions dropped, neighbours that are
//    contiguous for every operand merged), so inner loops run over long
//    contiguous rows that the compiler vectorizes;
//  - work is split statically over the OpenMP team only above kParallelMin
//    elements, and never inside an enclosing parallel region;
//  - statistics, reductions and losses accumulate in double;
//  - GEMMs go to OpenBLAS; inside a parallel region a call is kept below
//    OpenBLAS's own threading threshold so it runs on the calling thread and
//    the two thread pools never nest;
//  - float uses vectorizable approximations of exp, tanh and erf (within a
//    few ulp, as the SIMD functions PyTorch calls); double uses the C library.
//
//===----------------------------------------------------------------------===//

// Nothing here reads floating-point exception flags. Without this, GCC keeps
// every select of the branch-free math below (clamps, NaN handling) as a
// branch, because the arithmetic it would then run unconditionally "may
// trap", and no loop that calls exp, tanh or erf vectorizes. Before the
// includes, so that inline functions of the headers get the same options and
// still inline.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include "carve/rt/kernels.h"
#include "carve/rt/dist.h"
#include "carve/rt/elementwise.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>
#include <type_traits>
#include <vector>

namespace carve::rt {

void (*fatalHook)(int code) = nullptr;

void fatal(const char *fmt, ...) {
  // Several threads of one parallel loop may fail at once: the first reports,
  // the others wait for the process to go down.
  static std::atomic<bool> reported{false};
  if (reported.exchange(true))
    for (;;)
      std::this_thread::sleep_for(std::chrono::seconds(1));
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  const char *rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (!rank)
    rank = std::getenv("PMI_RANK");
  if (rank)
    std::fprintf(stderr, "carve: error: rank %s: %s\n", rank, msg);
  else
    std::fprintf(stderr, "carve: error: %s\n", msg);
  std::fflush(stderr);
  if (fatalHook)
    fatalHook(1);
  std::exit(1);
}

namespace {

//===--- Parallel loops and scratch ---------------------------------------===//

/// Below this many elements of work a kernel stays on the calling thread:
/// starting the OpenMP team costs more than the loop.
constexpr int64_t kParallelMin = 32768;
/// Elementwise work with a transcendental function per element pays for the
/// team sooner.
constexpr int64_t kParallelMinHeavy = 4096;
/// OpenBLAS runs a GEMM on the calling thread when m*n*k is at most this
/// (SMP_THRESHOLD_MIN * GEMM_MULTITHREAD_THRESHOLD); GEMMs issued from inside
/// an OpenMP region stay below it.
constexpr int64_t kGemmSerialMnk = 65536 * 4;

/// Runs body(begin, end, thread) over [0, n), split statically across the
/// OpenMP team when there are at least `minUnits` units, on the calling thread
/// (thread 0) otherwise. `thread` < omp_get_max_threads().
template <class F> void parallelRangeT(int64_t n, int64_t minUnits, F &&body) {
  if (n <= 0)
    return;
  if (n < 2 || n < minUnits || omp_in_parallel() || omp_get_max_threads() < 2) {
    body(int64_t(0), n, 0);
    return;
  }
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t b = n * t / nt, e = n * (t + 1) / nt;
    if (b < e)
      body(b, e, static_cast<int>(t));
  }
}

template <class F> void parallelRange(int64_t n, int64_t minUnits, F &&body) {
  parallelRangeT(n, minUnits, [&](int64_t b, int64_t e, int) { body(b, e); });
}

/// How many units of `work` elements each make a parallel loop worth it.
int64_t unitsFor(int64_t work) {
  return std::max<int64_t>(2, kParallelMin / std::max<int64_t>(work, 1));
}

/// A per-thread buffer of at least n elements, reused across calls (no heap
/// traffic once warm). Slots 0 and 1 are for bodies of parallel loops; slots
/// 2 and 3 for buffers the calling thread shares with its team.
template <class T> T *scratch(int slot, size_t n) {
  thread_local std::vector<T> bufs[4];
  if (bufs[slot].size() < n)
    bufs[slot].resize(n);
  return bufs[slot].data();
}

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

//===--- Broadcast loop nests (elementwise.h) -----------------------------===//

using ew::broadcastNest;
using ew::coalesce;
using ew::forRange;
using ew::Nest;
using ew::sliceNest;
using ew::stridesOf;
using ew::transposeNest;

/// y = f(a, b) over the broadcast of as and bs to ys.
template <class Y, class A, class B, class F>
void broadcast2(const char *op, const A *a, const Dims &as, const B *b, const Dims &bs, Y *y,
                const Dims &ys, int64_t minUnits, F f) {
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  const Dims in[2] = {as, bs};
  const Nest<2> n = broadcastNest<2>(op, in, ys);
  const int64_t sa = n.inner(0), sb = n.inner(1);
  parallelRange(total, minUnits, [&](int64_t e0, int64_t e1) {
    forRange(n, e0, e1, [&](const int64_t *off, int64_t e, int64_t len) {
      const A *pa = a + off[0];
      const B *pb = b + off[1];
      Y *py = y + e;
      if (sa && sb) {
        for (int64_t i = 0; i < len; ++i)
          py[i] = f(pa[i], pb[i]);
      } else if (sa) {
        const B vb = *pb;
        for (int64_t i = 0; i < len; ++i)
          py[i] = f(pa[i], vb);
      } else if (sb) {
        const A va = *pa;
        for (int64_t i = 0; i < len; ++i)
          py[i] = f(va, pb[i]);
      } else {
        std::fill_n(py, len, static_cast<Y>(f(*pa, *pb)));
      }
    });
  });
}

/// Copies the strided view (nest operand 0 over x) into the contiguous y.
template <class T> void gatherView(const T *x, const Nest<1> &n, T *y, int64_t total) {
  const int64_t s = n.inner(0);
  parallelRange(total, kParallelMin, [&](int64_t e0, int64_t e1) {
    forRange(n, e0, e1, [&](const int64_t *off, int64_t e, int64_t len) {
      const T *src = x + off[0];
      if (s == 1)
        std::memcpy(y + e, src, len * sizeof(T));
      else if (s == 0)
        std::fill_n(y + e, len, *src);
      else
        for (int64_t i = 0; i < len; ++i)
          y[e + i] = src[i * s];
    });
  });
}

//===--- Float math (elementwise.h) --------------------------------------===//

using ew::fexp;
using ew::maxNan;
using ew::minNan;

//===--- GEMM -------------------------------------------------------------===//

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
          int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a,
              static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double *a,
          int64_t lda, const double *b, int64_t ldb, double beta, double *c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a,
              static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

//===--- Row helpers ------------------------------------------------------===//

/// Max of a row. A NaN entry may be skipped; its exp(x - max) is NaN anyway in
/// every caller.
template <class T> T rowMax(const T *x, int64_t n) {
  T m = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i)
    m = std::max(m, x[i]);
  return m;
}

/// Mean and 1/sqrt(biased variance + eps) of a row, two-pass in double.
template <class T> void rowStats(const T *x, int64_t n, T eps, double &mean, double &rstd) {
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i)
    s += x[i];
  mean = s / n;
  double v = 0;
  const double m = mean;
#pragma omp simd reduction(+ : v)
  for (int64_t i = 0; i < n; ++i) {
    const double d = x[i] - m;
    v += d * d;
  }
  rstd = 1.0 / std::sqrt(v / n + static_cast<double>(eps));
}

/// Softmax of a contiguous row in place; a row whose entries are all -inf
/// becomes 0 (attention's convention).
template <class T> void softmaxRowInPlace(T *s, int64_t n) {
  const T m = rowMax(s, n);
  if (m == -std::numeric_limits<T>::infinity()) {
    std::fill_n(s, n, T(0));
    return;
  }
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const T e = fexp(s[j] - m);
    s[j] = e;
    sum += e;
  }
  const T inv = static_cast<T>(1.0 / sum);
  for (int64_t j = 0; j < n; ++j)
    s[j] *= inv;
}

} // namespace

//===--- Elementwise ------------------------------------------------------===//

namespace {

// The loops call a local copy of the functor: state reached through a
// reference could alias y, which would keep the loop from vectorizing.
template <class T, class F> void map1(const T *x, T *y, int64_t n, int64_t minUnits, F f) {
  parallelRange(n, minUnits, [&](int64_t b, int64_t e) {
    const F g = f;
    for (int64_t i = b; i < e; ++i)
      y[i] = g(x[i]);
  });
}

template <class T, class F>
void map2(const T *x, const T *dy, T *dx, int64_t n, int64_t minUnits, F f) {
  parallelRange(n, minUnits, [&](int64_t b, int64_t e) {
    const F g = f;
    for (int64_t i = b; i < e; ++i)
      dx[i] = g(x[i], dy[i]);
  });
}

} // namespace

template <class T> void unary(Unary f, const T *x, T *y, int64_t n) {
  constexpr int64_t L = kParallelMin, H = kParallelMinHeavy;
  switch (f) {
#define CARVE_UNARY(F, MIN)                                                                        \
  case Unary::F:                                                                                   \
    return map1(x, y, n, MIN, [](T v) { return ew::unary<Unary::F>(v); });
    CARVE_UNARY(Neg, L)
    CARVE_UNARY(Abs, L)
    CARVE_UNARY(Exp, H)
    CARVE_UNARY(Log, H)
    CARVE_UNARY(Sqrt, L)
    CARVE_UNARY(Rsqrt, L)
    CARVE_UNARY(Reciprocal, L)
    CARVE_UNARY(Tanh, H)
    CARVE_UNARY(Erf, H)
    CARVE_UNARY(Sigmoid, H)
    CARVE_UNARY(Relu, L)
    CARVE_UNARY(Sin, H)
    CARVE_UNARY(Cos, H)
    CARVE_UNARY(Silu, H)
    CARVE_UNARY(Gelu, H)
    CARVE_UNARY(GeluTanh, H)
#undef CARVE_UNARY
  }
  fatal("unary: unknown function %d", static_cast<int>(f));
}

template <class T> void unary_grad(Unary f, const T *x, const T *dy, T *dx, int64_t n) {
  constexpr int64_t L = kParallelMin, H = kParallelMinHeavy;
  switch (f) {
#define CARVE_UNARY_GRAD(F, MIN)                                                                   \
  case Unary::F:                                                                                   \
    return map2(x, dy, dx, n, MIN, [](T v, T g) { return ew::unaryGrad<Unary::F>(v, g); });
    CARVE_UNARY_GRAD(Neg, L)
    CARVE_UNARY_GRAD(Abs, L)
    CARVE_UNARY_GRAD(Exp, H)
    CARVE_UNARY_GRAD(Log, L)
    CARVE_UNARY_GRAD(Sqrt, L)
    CARVE_UNARY_GRAD(Rsqrt, L)
    CARVE_UNARY_GRAD(Reciprocal, L)
    CARVE_UNARY_GRAD(Tanh, H)
    CARVE_UNARY_GRAD(Erf, H)
    CARVE_UNARY_GRAD(Sigmoid, H)
    CARVE_UNARY_GRAD(Relu, L)
    CARVE_UNARY_GRAD(Sin, H)
    CARVE_UNARY_GRAD(Cos, H)
    CARVE_UNARY_GRAD(Silu, H)
    CARVE_UNARY_GRAD(Gelu, H)
    CARVE_UNARY_GRAD(GeluTanh, H)
#undef CARVE_UNARY_GRAD
  }
  fatal("unary_grad: unknown function %d", static_cast<int>(f));
}

template <class T> void binary(Binary f, const T *a, Dims as, const T *b, Dims bs, T *y, Dims ys) {
  constexpr int64_t L = kParallelMin;
  switch (f) {
#define CARVE_BINARY(F, NAME)                                                                      \
  case Binary::F:                                                                                  \
    return broadcast2(NAME, a, as, b, bs, y, ys, L,                                                \
                      [](T u, T v) { return ew::binary<Binary::F>(u, v); });
    CARVE_BINARY(Add, "add")
    CARVE_BINARY(Sub, "sub")
    CARVE_BINARY(Mul, "mul")
    CARVE_BINARY(Div, "div")
    CARVE_BINARY(Max, "max")
    CARVE_BINARY(Min, "min")
#undef CARVE_BINARY
  case Binary::Pow:
    break;
  }
  if constexpr (std::is_floating_point_v<T>) {
    // A scalar exponent takes PyTorch's special cases (exact and much faster
    // than pow).
    if (bs.numel() == 1) {
      const T e = *b;
      const Dims one;
      auto run = [&](auto g) { broadcast2("pow", a, as, b, one, y, ys, L, g); };
      if (e == T(2))
        return run([](T u, T) { return u * u; });
      if (e == T(3))
        return run([](T u, T) { return u * u * u; });
      if (e == T(0.5))
        return run([](T u, T) { return std::sqrt(u); });
      if (e == T(-0.5))
        return run([](T u, T) { return T(1) / std::sqrt(u); });
      if (e == T(-1))
        return run([](T u, T) { return T(1) / u; });
      if (e == T(-2))
        return run([](T u, T) { return T(1) / (u * u); });
    }
  }
  broadcast2("pow", a, as, b, bs, y, ys, kParallelMinHeavy,
             [](T u, T v) { return static_cast<T>(std::pow(u, v)); });
}

template <class T>
void compare(Compare f, const T *a, Dims as, const T *b, Dims bs, uint8_t *y, Dims ys) {
  constexpr int64_t L = kParallelMin;
  switch (f) {
  case Compare::Eq:
    return broadcast2("equal", a, as, b, bs, y, ys, L,
                      [](T u, T v) { return static_cast<uint8_t>(u == v); });
  case Compare::Lt:
    return broadcast2("less", a, as, b, bs, y, ys, L,
                      [](T u, T v) { return static_cast<uint8_t>(u < v); });
  case Compare::Gt:
    return broadcast2("greater", a, as, b, bs, y, ys, L,
                      [](T u, T v) { return static_cast<uint8_t>(u > v); });
  }
  fatal("compare: unknown comparison %d", static_cast<int>(f));
}

void logic(Logic f, const uint8_t *a, Dims as, const uint8_t *b, Dims bs, uint8_t *y, Dims ys) {
  constexpr int64_t L = kParallelMin;
  switch (f) {
  case Logic::And:
    return broadcast2("and", a, as, b, bs, y, ys, L,
                      [](uint8_t u, uint8_t v) { return static_cast<uint8_t>(u && v); });
  case Logic::Or:
    return broadcast2("or", a, as, b, bs, y, ys, L,
                      [](uint8_t u, uint8_t v) { return static_cast<uint8_t>(u || v); });
  case Logic::Not:
    // b is ignored: broadcast a against itself.
    return broadcast2("not", a, as, a, as, y, ys, L,
                      [](uint8_t u, uint8_t) { return static_cast<uint8_t>(!u); });
  }
  fatal("logic: unknown operation %d", static_cast<int>(f));
}

template <class T>
void where(const uint8_t *c, Dims cs, const T *a, Dims as, const T *b, Dims bs, T *y, Dims ys) {
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  const Dims in[3] = {cs, as, bs};
  const Nest<3> n = broadcastNest<3>("where", in, ys);
  const int64_t sc = n.inner(0), sa = n.inner(1), sb = n.inner(2);
  parallelRange(total, kParallelMin, [&](int64_t e0, int64_t e1) {
    forRange(n, e0, e1, [&](const int64_t *off, int64_t e, int64_t len) {
      const uint8_t *pc = c + off[0];
      const T *pa = a + off[1];
      const T *pb = b + off[2];
      T *py = y + e;
      if (sc && sa && sb) {
        for (int64_t i = 0; i < len; ++i)
          py[i] = pc[i] ? pa[i] : pb[i];
      } else {
        for (int64_t i = 0; i < len; ++i)
          py[i] = pc[i * sc] ? pa[i * sa] : pb[i * sb];
      }
    });
  });
}

template <class From, class To> void cast(const From *x, To *y, int64_t n) {
  parallelRange(n, kParallelMin, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      // uint8_t holds bool: any non-zero value is true, as ONNX Cast to bool.
      if constexpr (std::is_same_v<To, uint8_t> && !std::is_same_v<From, uint8_t>)
        y[i] = x[i] != From(0);
      else
        y[i] = static_cast<To>(x[i]);
    }
  });
}

template <class T> void fill(T *y, int64_t n, T v) {
  parallelRange(n, 8 * kParallelMin, [&](int64_t b, int64_t e) { std::fill(y + b, y + e, v); });
}

template <class T> void copy(const T *x, T *y, int64_t n) {
  if (x == y)
    return;
  parallelRange(n, 8 * kParallelMin,
                [&](int64_t b, int64_t e) { std::memcpy(y + b, x + b, (e - b) * sizeof(T)); });
}

//===--- Linear algebra ---------------------------------------------------===//

namespace {

Precision gPrecision = Precision::F32;

/// Copies of a matmul's or attention's inputs rounded to the precision, one
/// buffer per operand slot, reused from call to call (the generated step is
/// single-threaded at this level).
const float *roundedInput(const float *x, int64_t n, int slot) {
  static thread_local std::vector<float> buffers[4];
  std::vector<float> &b = buffers[slot];
  if ((int64_t)b.size() < n)
    b.resize(n);
  if (gPrecision == Precision::BF16) {
#pragma omp parallel for if (n > (1 << 16))
    for (int64_t i = 0; i < n; ++i)
      b[i] = roundToBf16(x[i]);
  } else {
#pragma omp parallel for if (n > (1 << 16))
    for (int64_t i = 0; i < n; ++i)
      b[i] = roundToF16(x[i]);
  }
  return b.data();
}

/// Rounds `x` in place of its pointer when the precision asks for it (float
/// only: the float64 reference interpreter computes exactly).
template <class T> void roundInput(const T *&x, int64_t n, int slot) {
  if constexpr (std::is_same_v<T, float>)
    if (gPrecision != Precision::F32 && x)
      x = roundedInput(x, n, slot);
}

} // namespace

void setPrecision(Precision p) { gPrecision = p; }
Precision precision() { return gPrecision; }

float roundToBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) // NaN: keep it quiet
    u |= 0x00400000u;
  else
    u += 0x7FFFu + ((u >> 16) & 1u); // round to nearest even; carries into the exponent
  u &= 0xFFFF0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

float roundToF16(float x) { return static_cast<float>(static_cast<_Float16>(x)); }

template <class T>
void matmul(const T *a, Dims as, bool transA, const T *b, Dims bs, bool transB, T *y, Dims ys,
            bool accumulate) {
  roundInput(a, as.numel(), 0);
  roundInput(b, bs.numel(), 1);
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
  const int64_t nb = batch.numel();
  if (m == 0 || n == 0 || nb == 0)
    return;
  if (k == 0) {
    if (!accumulate)
      fill(y, nb * m * n, T(0));
    return;
  }
  const T beta = accumulate ? T(1) : T(0);
  const int64_t lda = as.d[ar - 1], ldb = bs.d[br - 1];
  const Dims in[2] = {aBatch, bBatch};
  const Nest<2> nest = broadcastNest<2>("matmul", in, batch);
  // One GEMM when B is shared by every batch matrix and A's batch rows are
  // contiguous: the batch folds into M.
  if (bBatch.numel() == 1 && !transA && aBatch.numel() == nb) {
    gemm(false, transB, nb * m, n, k, T(1), a, lda, b, ldb, beta, y, n);
    return;
  }
  const int64_t sa = nest.inner(0), sb = nest.inner(1);
  const int64_t aMat = m * k, bMat = k * n, yMat = m * n;
  auto run = [&](int64_t e0, int64_t e1) {
    forRange(nest, e0, e1, [&](const int64_t *off, int64_t e, int64_t len) {
      for (int64_t i = 0; i < len; ++i)
        gemm(transA, transB, m, n, k, T(1), a + (off[0] + i * sa) * aMat, lda,
             b + (off[1] + i * sb) * bMat, ldb, beta, y + (e + i) * yMat, n);
    });
  };
  // Small matrices: one thread per batch matrix (each GEMM then runs on its
  // calling thread). Large ones: one at a time, threaded by OpenBLAS.
  if (m * n * k <= kGemmSerialMnk)
    parallelRange(nb, unitsFor(m * n * k), run);
  else
    run(0, nb);
}

//===--- Reductions and normalization -------------------------------------===//

namespace {

template <class T> double reduceSpan(Reduce f, const T *x, int64_t n) {
  if (f == Reduce::Max) {
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t i = 0; i < n; ++i)
      m = maxNan<double>(x[i], m);
    return m;
  }
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i)
    s += x[i];
  return s;
}

/// acc[c] (op)= x[r * ld + c] for rows [r0, r1), columns [0, w).
template <class T>
void reduceColumns(Reduce f, const T *x, int64_t ld, int64_t r0, int64_t r1, int64_t w,
                   double *acc) {
  if (f == Reduce::Max) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < w; ++c)
        acc[c] = maxNan<double>(x[r * ld + c], acc[c]);
  } else {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < w; ++c)
        acc[c] += x[r * ld + c];
  }
}

double combine(Reduce f, double a, double b) { return f == Reduce::Max ? maxNan(a, b) : a + b; }
double identity(Reduce f) {
  return f == Reduce::Max ? -std::numeric_limits<double>::infinity() : 0.0;
}

/// y[o, i] = reduce over r of x[o, r, i] (x of shape [O, R, I]).
template <class T> void reduceORI(Reduce f, const T *x, int64_t O, int64_t R, int64_t I, T *y) {
  const double div = f == Reduce::Mean ? static_cast<double>(R) : 1.0;
  const int64_t threads = omp_get_max_threads();
  if (I == 1 && O >= threads) {
    parallelRange(O, unitsFor(R), [&](int64_t b, int64_t e) {
      for (int64_t o = b; o < e; ++o)
        y[o] = static_cast<T>(reduceSpan(f, x + o * R, R) / div);
    });
    return;
  }
  constexpr int64_t kBlock = 128;
  const int64_t nb = (I + kBlock - 1) / kBlock;
  if (O * nb >= threads || O * R * I < kParallelMin || R < 2 * threads) {
    // Tasks of (outer index, column block), each over all R rows.
    parallelRange(O * nb, unitsFor(R * std::min(I, kBlock)), [&](int64_t b, int64_t e) {
      double acc[kBlock];
      for (int64_t t = b; t < e; ++t) {
        const int64_t o = t / nb, c0 = (t % nb) * kBlock, w = std::min(kBlock, I - c0);
        std::fill_n(acc, w, identity(f));
        reduceColumns(f, x + o * R * I + c0, I, 0, R, w, acc);
        for (int64_t c = 0; c < w; ++c)
          y[o * I + c0 + c] = static_cast<T>(acc[c] / div);
      }
    });
    return;
  }
  // Few outputs, many rows (a full reduction, a bias gradient of a narrow
  // layer): each thread reduces a slice of the rows, then the partials combine.
  const int64_t width = O * I;
  double *part = scratch<double>(2, threads * width);
  std::fill_n(part, threads * width, identity(f));
  parallelRangeT(R, 2, [&](int64_t r0, int64_t r1, int t) {
    double *acc = part + t * width;
    for (int64_t o = 0; o < O; ++o) {
      if (I == 1) {
        acc[o] = combine(f, acc[o], reduceSpan(f, x + o * R + r0, r1 - r0));
      } else {
        reduceColumns(f, x + o * R * I, I, r0, r1, I, acc + o * I);
      }
    }
  });
  for (int64_t j = 0; j < width; ++j) {
    double v = part[j];
    for (int64_t t = 1; t < threads; ++t)
      v = combine(f, v, part[t * width + j]);
    y[j] = static_cast<T>(v / div);
  }
}

} // namespace

template <class T> void reduce(Reduce f, const T *x, Dims xs, uint32_t axesMask, T *y) {
  const ew::ReduceGeom g = ew::reduceGeom(xs, axesMask);
  const int64_t outCount = g.outCount, redCount = g.redCount;
  if (outCount == 0)
    return;
  if (redCount == 0) {
    if (f == Reduce::Max)
      fatal("reduce: max over an empty dimension");
    fill(y, outCount, f == Reduce::Sum ? T(0) : std::numeric_limits<T>::quiet_NaN());
    return;
  }
  // [kept] [reduced] [kept], each part possibly absent: the fast paths.
  if (g.ori)
    return reduceORI(f, x, g.O, g.R, g.I, y);

  // General strided fallback: per output element, walk the reduced
  // dimensions with an odometer.
  const int no = g.no, nr = g.nr;
  const int64_t *od = g.od, *os = g.os, *rd = g.rd, *rs = g.rs;
  const double div = f == Reduce::Mean ? static_cast<double>(redCount) : 1.0;
  parallelRange(outCount, unitsFor(redCount), [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o) {
      int64_t base = 0, rem = o;
      for (int i = no - 1; i >= 0; --i) {
        base += (rem % od[i]) * os[i];
        rem /= od[i];
      }
      // The innermost reduced run is one strided span; the outer reduced
      // runs step through an odometer.
      int64_t idx[kMaxRank] = {};
      const int64_t inLen = rd[nr - 1], inStride = rs[nr - 1];
      double acc = identity(f);
      for (;;) {
        int64_t off = base;
        for (int i = 0; i < nr - 1; ++i)
          off += idx[i] * rs[i];
        const T *p = x + off;
        if (f == Reduce::Max) {
          for (int64_t j = 0; j < inLen; ++j)
            acc = maxNan<double>(p[j * inStride], acc);
        } else {
          for (int64_t j = 0; j < inLen; ++j)
            acc += p[j * inStride];
        }
        int i = nr - 2;
        for (; i >= 0; --i) {
          if (++idx[i] < rd[i])
            break;
          idx[i] = 0;
        }
        if (i < 0)
          break;
      }
      y[o] = static_cast<T>(acc / div);
    }
  });
}

template <class T> void softmax(const T *x, Dims xs, int axis, bool log, T *y) {
  axis = normAxis(axis, xs.rank, "softmax");
  const int64_t O = prod(xs, 0, axis), A = xs.d[axis], I = prod(xs, axis + 1, xs.rank);
  if (O * A * I == 0)
    return;
  parallelRange(O * I, unitsFor(A), [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const int64_t o = row / I, i = row % I;
      const T *xr = x + o * A * I + i;
      T *yr = y + o * A * I + i;
      if (I == 1) {
        const T m = rowMax(xr, A);
        double sum = 0;
        if (log) {
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < A; ++j)
            sum += fexp(xr[j] - m);
          const T ls = static_cast<T>(std::log(sum));
          for (int64_t j = 0; j < A; ++j)
            yr[j] = xr[j] - m - ls;
        } else {
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < A; ++j) {
            const T v = fexp(xr[j] - m);
            yr[j] = v;
            sum += v;
          }
          const T inv = static_cast<T>(1.0 / sum);
          for (int64_t j = 0; j < A; ++j)
            yr[j] *= inv;
        }
        continue;
      }
      T m = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < A; ++j)
        m = std::max(m, xr[j * I]);
      double sum = 0;
      for (int64_t j = 0; j < A; ++j)
        sum += fexp(xr[j * I] - m);
      if (log) {
        const T ls = static_cast<T>(std::log(sum));
        for (int64_t j = 0; j < A; ++j)
          yr[j * I] = xr[j * I] - m - ls;
      } else {
        const T inv = static_cast<T>(1.0 / sum);
        for (int64_t j = 0; j < A; ++j)
          yr[j * I] = fexp(xr[j * I] - m) * inv;
      }
    }
  });
}

template <class T> void softmax_grad(const T *y, const T *dy, Dims s, int axis, bool log, T *dx) {
  axis = normAxis(axis, s.rank, "softmax_grad");
  const int64_t O = prod(s, 0, axis), A = s.d[axis], I = prod(s, axis + 1, s.rank);
  if (O * A * I == 0)
    return;
  parallelRange(O * I, unitsFor(A), [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const int64_t o = row / I, i = row % I, base = o * A * I + i;
      const T *yr = y + base, *gr = dy + base;
      T *dr = dx + base;
      double sum = 0;
      if (log) {
        for (int64_t j = 0; j < A; ++j)
          sum += gr[j * I];
        const T sv = static_cast<T>(sum);
        for (int64_t j = 0; j < A; ++j)
          dr[j * I] = gr[j * I] - fexp(yr[j * I]) * sv;
      } else {
        for (int64_t j = 0; j < A; ++j)
          sum += static_cast<double>(gr[j * I]) * yr[j * I];
        const T sv = static_cast<T>(sum);
        for (int64_t j = 0; j < A; ++j)
          dr[j * I] = yr[j * I] * (gr[j * I] - sv);
      }
    }
  });
}

template <class T>
void layer_norm(const T *x, Dims xs, int axis, const T *scale, const T *bias, T eps, T *y) {
  axis = normAxis(axis, xs.rank, "layer_norm");
  const int64_t R = prod(xs, 0, axis), N = prod(xs, axis, xs.rank);
  if (R * N == 0)
    return;
  parallelRange(R, unitsFor(N), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T *xr = x + r * N;
      T *yr = y + r * N;
      double mean, rstd;
      rowStats(xr, N, eps, mean, rstd);
      const T mu = static_cast<T>(mean), rs = static_cast<T>(rstd);
      for (int64_t i = 0; i < N; ++i) {
        T v = (xr[i] - mu) * rs;
        if (scale)
          v *= scale[i];
        if (bias)
          v += bias[i];
        yr[i] = v;
      }
    }
  });
}

template <class T>
void layer_norm_grad(const T *x, Dims xs, int axis, const T *scale, T eps, const T *dy, T *dx,
                     T *dscale, T *dbias) {
  axis = normAxis(axis, xs.rank, "layer_norm_grad");
  const int64_t R = prod(xs, 0, axis), N = prod(xs, axis, xs.rank);
  if (N == 0)
    return;
  const bool params = dscale || dbias;
  // Per-thread partial sums of dscale and dbias over each thread's rows.
  const int64_t threads = omp_get_max_threads();
  double *part = params ? scratch<double>(2, threads * 2 * N) : nullptr;
  if (params)
    std::fill_n(part, threads * 2 * N, 0.0);
  parallelRangeT(R, unitsFor(N), [&](int64_t b, int64_t e, int t) {
    double *ps = params ? part + t * 2 * N : nullptr;
    double *pb = params ? ps + N : nullptr;
    for (int64_t r = b; r < e; ++r) {
      const T *xr = x + r * N, *gr = dy + r * N;
      T *dr = dx + r * N;
      double mean, rstd;
      rowStats(xr, N, eps, mean, rstd);
      // With g = dy * scale and xhat = (x - mean) * rstd:
      // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
      double sg = 0, sgx = 0;
      for (int64_t i = 0; i < N; ++i) {
        const double xh = (xr[i] - mean) * rstd;
        const double g = scale ? static_cast<double>(gr[i]) * scale[i] : gr[i];
        sg += g;
        sgx += g * xh;
      }
      const double mg = sg / N, mgx = sgx / N;
      for (int64_t i = 0; i < N; ++i) {
        const double xh = (xr[i] - mean) * rstd;
        const double g = scale ? static_cast<double>(gr[i]) * scale[i] : gr[i];
        dr[i] = static_cast<T>(rstd * (g - mg - xh * mgx));
      }
      if (params)
        for (int64_t i = 0; i < N; ++i) {
          ps[i] += gr[i] * ((xr[i] - mean) * rstd);
          pb[i] += gr[i];
        }
    }
  });
  if (!params)
    return;
  for (int64_t i = 0; i < N; ++i) {
    double s = 0, bsum = 0;
    for (int64_t t = 0; t < threads; ++t) {
      s += part[t * 2 * N + i];
      bsum += part[t * 2 * N + N + i];
    }
    if (dscale)
      dscale[i] = static_cast<T>(s);
    if (dbias)
      dbias[i] = static_cast<T>(bsum);
  }
}

template <class T> void rms_norm(const T *x, Dims xs, int axis, const T *scale, T eps, T *y) {
  axis = normAxis(axis, xs.rank, "rms_norm");
  const int64_t R = prod(xs, 0, axis), N = prod(xs, axis, xs.rank);
  if (R * N == 0)
    return;
  parallelRange(R, unitsFor(N), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T *xr = x + r * N;
      T *yr = y + r * N;
      double ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < N; ++i)
        ss += static_cast<double>(xr[i]) * xr[i];
      const T rs = static_cast<T>(1.0 / std::sqrt(ss / N + static_cast<double>(eps)));
      for (int64_t i = 0; i < N; ++i)
        yr[i] = scale ? xr[i] * rs * scale[i] : xr[i] * rs;
    }
  });
}

template <class T>
void rms_norm_grad(const T *x, Dims xs, int axis, const T *scale, T eps, const T *dy, T *dx,
                   T *dscale) {
  axis = normAxis(axis, xs.rank, "rms_norm_grad");
  const int64_t R = prod(xs, 0, axis), N = prod(xs, axis, xs.rank);
  if (N == 0)
    return;
  const int64_t threads = omp_get_max_threads();
  double *part = dscale ? scratch<double>(2, threads * N) : nullptr;
  if (dscale)
    std::fill_n(part, threads * N, 0.0);
  parallelRangeT(R, unitsFor(N), [&](int64_t b, int64_t e, int t) {
    double *ps = dscale ? part + t * N : nullptr;
    for (int64_t r = b; r < e; ++r) {
      const T *xr = x + r * N, *gr = dy + r * N;
      T *dr = dx + r * N;
      double ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < N; ++i)
        ss += static_cast<double>(xr[i]) * xr[i];
      const double rs = 1.0 / std::sqrt(ss / N + static_cast<double>(eps));
      // With g = dy * scale and xhat = x * rs: dx = rs * (g - xhat * mean(g * xhat)).
      double sgx = 0;
      for (int64_t i = 0; i < N; ++i) {
        const double g = scale ? static_cast<double>(gr[i]) * scale[i] : gr[i];
        sgx += g * (xr[i] * rs);
      }
      const double mgx = sgx / N;
      for (int64_t i = 0; i < N; ++i) {
        const double g = scale ? static_cast<double>(gr[i]) * scale[i] : gr[i];
        dr[i] = static_cast<T>(rs * (g - xr[i] * rs * mgx));
      }
      if (dscale)
        for (int64_t i = 0; i < N; ++i)
          ps[i] += gr[i] * (xr[i] * rs);
    }
  });
  if (!dscale)
    return;
  for (int64_t i = 0; i < N; ++i) {
    double s = 0;
    for (int64_t t = 0; t < threads; ++t)
      s += part[t * N + i];
    dscale[i] = static_cast<T>(s);
  }
}

//===--- Attention --------------------------------------------------------===//

namespace {

/// Shapes of one attention call: `items` batch matrices of Tq queries and Tk
/// keys, and where the additive mask of each lives.
struct AttnGeom {
  int64_t items = 1, tq = 0, tk = 0, d = 0, dv = 0;
  int nb = 0;                 // batch dims
  int64_t bd[kMaxRank] = {};  // their sizes
  int64_t mbs[kMaxRank] = {}; // the mask's stride along each (0: broadcast)
  int64_t mRow = 0, mCol = 0; // the mask's query and key strides
  int64_t bq = 1;             // query rows per block
  int64_t kc = 1;             // keys per GEMM chunk

  int64_t maskOffset(int64_t item) const {
    int64_t off = 0;
    for (int i = nb - 1; i >= 0; --i) {
      off += (item % bd[i]) * mbs[i];
      item /= bd[i];
    }
    return off;
  }
};

AttnGeom attnGeom(const char *op, const Dims &qs, const Dims &ks, const Dims &vs, bool hasMask,
                  const Dims &ms) {
  const int r = qs.rank;
  if (r < 2 || ks.rank != r || vs.rank != r)
    fatal("%s: q, k and v must have one rank >= 2 (got %d, %d, %d)", op, qs.rank, ks.rank, vs.rank);
  AttnGeom g;
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
  if (hasMask) {
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
  g.bq = std::max<int64_t>(1, std::min<int64_t>(g.tq, 32));
  const int64_t width = std::max<int64_t>(1, std::max(g.d, g.dv));
  g.kc = std::max<int64_t>(16, kGemmSerialMnk / (g.bq * width));
  return g;
}

/// Probabilities of query rows [i0, i0 + nq) of batch item `item` against keys
/// [0, nk) into p (leading dimension nk): softmax(scale q k^T + mask) with
/// causally hidden keys at 0; rows whose scores are all -inf are 0.
template <class T>
void attnProbs(const AttnGeom &g, int64_t item, int64_t i0, int64_t nq, int64_t nk, const T *q,
               const T *k, const T *mask, T scale, bool causal, T *p) {
  const T *qb = q + (item * g.tq + i0) * g.d;
  const T *kb = k + item * g.tk * g.d;
  for (int64_t c0 = 0; c0 < nk; c0 += g.kc)
    gemm(false, true, nq, std::min(g.kc, nk - c0), g.d, scale, qb, g.d, kb + c0 * g.d, g.d, T(0),
         p + c0, nk);
  const T *mi = mask ? mask + g.maskOffset(item) : nullptr;
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t i = i0 + r;
    T *s = p + r * nk;
    if (mi) {
      const T *m = mi + i * g.mRow;
      if (g.mCol) {
        for (int64_t j = 0; j < nk; ++j)
          s[j] += m[j];
      } else {
        const T mv = *m;
        for (int64_t j = 0; j < nk; ++j)
          s[j] += mv;
      }
    }
    const int64_t valid = causal ? std::min(nk, i + 1) : nk;
    softmaxRowInPlace(s, valid);
    std::fill(s + valid, s + nk, T(0));
  }
}

} // namespace

template <class T>
void attention(const T *q, Dims qs, const T *k, Dims ks, const T *v, Dims vs, const T *mask,
               Dims ms, T scale, bool causal, T *y) {
  const AttnGeom g = attnGeom("attention", qs, ks, vs, mask != nullptr, ms);
  roundInput(q, qs.numel(), 0);
  roundInput(k, ks.numel(), 1);
  roundInput(v, vs.numel(), 2);
  if (g.items == 0 || g.tq == 0 || g.dv == 0)
    return;
  const int64_t nqb = (g.tq + g.bq - 1) / g.bq;
  parallelRange(g.items * nqb, unitsFor(g.bq * g.tk * (g.d + g.dv)), [&](int64_t b, int64_t e) {
    T *p = scratch<T>(0, g.bq * g.tk);
    for (int64_t t = b; t < e; ++t) {
      const int64_t item = t / nqb, i0 = (t % nqb) * g.bq;
      const int64_t nq = std::min(g.bq, g.tq - i0);
      const int64_t nk = causal ? std::min(g.tk, i0 + nq) : g.tk;
      T *yb = y + (item * g.tq + i0) * g.dv;
      if (nk == 0) {
        std::fill_n(yb, nq * g.dv, T(0));
        continue;
      }
      attnProbs(g, item, i0, nq, nk, q, k, mask, scale, causal, p);
      const T *vb = v + item * g.tk * g.dv;
      for (int64_t c0 = 0; c0 < nk; c0 += g.kc)
        gemm(false, false, nq, g.dv, std::min(g.kc, nk - c0), T(1), p + c0, nk, vb + c0 * g.dv,
             g.dv, c0 ? T(1) : T(0), yb, g.dv);
    }
  });
}

template <class T>
void attention_grad(const T *q, Dims qs, const T *k, Dims ks, const T *v, Dims vs, const T *mask,
                    Dims ms, T scale, bool causal, const T *dy, T *dq, T *dk, T *dv) {
  const AttnGeom g = attnGeom("attention_grad", qs, ks, vs, mask != nullptr, ms);
  roundInput(q, qs.numel(), 0);
  roundInput(k, ks.numel(), 1);
  roundInput(v, vs.numel(), 2);
  roundInput(dy, Dims(qs.d, qs.rank - 1).numel() * vs.d[vs.rank - 1], 3);
  if (g.items == 0)
    return;
  const int64_t nqb = (g.tq + g.bq - 1) / g.bq;
  // dK and dV of a batch item sum over all its query rows: one thread owns an item.
  parallelRange(g.items, unitsFor(g.tq * g.tk * (g.d + g.dv)), [&](int64_t b, int64_t e) {
    T *p = scratch<T>(0, g.bq * g.tk);
    T *dp = scratch<T>(1, g.bq * g.tk);
    for (int64_t item = b; item < e; ++item) {
      const T *kb = k + item * g.tk * g.d, *vb = v + item * g.tk * g.dv;
      T *dkb = dk + item * g.tk * g.d, *dvb = dv + item * g.tk * g.dv;
      std::fill_n(dkb, g.tk * g.d, T(0));
      std::fill_n(dvb, g.tk * g.dv, T(0));
      for (int64_t qi = 0; qi < nqb; ++qi) {
        const int64_t i0 = qi * g.bq, nq = std::min(g.bq, g.tq - i0);
        const int64_t nk = causal ? std::min(g.tk, i0 + nq) : g.tk;
        const T *qb = q + (item * g.tq + i0) * g.d;
        const T *dyb = dy + (item * g.tq + i0) * g.dv;
        T *dqb = dq + (item * g.tq + i0) * g.d;
        if (nk == 0) {
          std::fill_n(dqb, nq * g.d, T(0));
          continue;
        }
        attnProbs(g, item, i0, nq, nk, q, k, mask, scale, causal, p);
        // dP = dY V^T; dS = P * (dP - rowsum(dP * P)), times scale for q k^T.
        for (int64_t c0 = 0; c0 < nk; c0 += g.kc)
          gemm(false, true, nq, std::min(g.kc, nk - c0), g.dv, T(1), dyb, g.dv, vb + c0 * g.dv,
               g.dv, T(0), dp + c0, nk);
        for (int64_t r = 0; r < nq; ++r) {
          const T *pr = p + r * nk;
          T *dr = dp + r * nk;
          double dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < nk; ++j)
            dot += static_cast<double>(dr[j]) * pr[j];
          const T dt = static_cast<T>(dot);
          for (int64_t j = 0; j < nk; ++j)
            dr[j] = pr[j] * (dr[j] - dt) * scale;
        }
        for (int64_t c0 = 0; c0 < nk; c0 += g.kc) {
          const int64_t cc = std::min(g.kc, nk - c0);
          gemm(false, false, nq, g.d, cc, T(1), dp + c0, nk, kb + c0 * g.d, g.d, c0 ? T(1) : T(0),
               dqb, g.d);
          gemm(true, false, cc, g.d, nq, T(1), dp + c0, nk, qb, g.d, T(1), dkb + c0 * g.d, g.d);
          gemm(true, false, cc, g.dv, nq, T(1), p + c0, nk, dyb, g.dv, T(1), dvb + c0 * g.dv, g.dv);
        }
      }
    }
  });
}

//===--- Cross entropy ----------------------------------------------------===//

namespace {

/// Logits [N, C, S...] against targets [N, S...]: N*S elements, class stride S.
struct CeGeom {
  int64_t n = 0, c = 0, s = 1;
  int64_t count = 0; // elements not ignored
};

CeGeom ceGeom(const char *op, const Dims &ls, const int64_t *targets, bool hasIgnore,
              int64_t ignoreIndex) {
  if (ls.rank < 2)
    fatal("%s: logits of rank %d (need [N, C, ...])", op, ls.rank);
  CeGeom g;
  g.n = ls.d[0];
  g.c = ls.d[1];
  g.s = prod(ls, 2, ls.rank);
  const int64_t e = g.n * g.s;
  for (int64_t i = 0; i < e; ++i) {
    const int64_t t = targets[i];
    if (hasIgnore && t == ignoreIndex)
      continue;
    if (t < 0 || t >= g.c)
      fatal("%s: target %lld at element %lld is outside [0, %lld)", op, (long long)t, (long long)i,
            (long long)g.c);
    ++g.count;
  }
  return g;
}

/// Max and sum of exp(x - max) over classes, for `w` consecutive spatial
/// positions starting at `base` (class stride s): mx[u], sum[u] for u < w.
template <class T>
void classStats(const T *base, int64_t c, int64_t s, int64_t w, T *mx, double *sum) {
  if (s == 1) {
    const T m = rowMax(base, c);
    double acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < c; ++j)
      acc += fexp(base[j] - m);
    mx[0] = m;
    sum[0] = acc;
    return;
  }
  std::fill_n(mx, w, -std::numeric_limits<T>::infinity());
  std::fill_n(sum, w, 0.0);
  for (int64_t j = 0; j < c; ++j)
    for (int64_t u = 0; u < w; ++u)
      mx[u] = std::max(mx[u], base[j * s + u]);
  for (int64_t j = 0; j < c; ++j)
    for (int64_t u = 0; u < w; ++u)
      sum[u] += fexp(base[j * s + u] - mx[u]);
}

/// Spatial positions handled together when the class stride is not 1: their
/// logits of one class are adjacent in memory.
constexpr int64_t kCeLanes = 16;

/// Calls body(n, s0, w, thread) for blocks of spatial positions, in parallel:
/// one position per block when the classes are contiguous, up to kCeLanes
/// adjacent positions otherwise.
template <class F> void ceBlocks(const CeGeom &g, F &&body) {
  const int64_t lanes = g.s == 1 ? 1 : kCeLanes;
  const int64_t per = (g.s + lanes - 1) / lanes;
  parallelRangeT(g.n * per, unitsFor(g.c * lanes), [&](int64_t b, int64_t e, int t) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t n = i / per, s0 = (i % per) * lanes;
      body(n, s0, std::min(lanes, g.s - s0), t);
    }
  });
}

} // namespace

template <class T>
void cross_entropy(const T *logits, Dims ls, const int64_t *targets, int reduction, bool hasIgnore,
                   int64_t ignoreIndex, T *y) {
  if (reduction < 0 || reduction > 2)
    fatal("cross_entropy: unknown reduction %d", reduction);
  const CeGeom g = ceGeom("cross_entropy", ls, targets, hasIgnore, ignoreIndex);
  const int64_t threads = omp_get_max_threads();
  double *part = scratch<double>(2, threads);
  std::fill_n(part, threads, 0.0);
  ceBlocks(g, [&](int64_t n, int64_t s0, int64_t w, int t) {
    const T *base = logits + n * g.c * g.s + s0;
    T mx[kCeLanes] = {};
    double sum[kCeLanes] = {};
    classStats(base, g.c, g.s, w, mx, sum);
    for (int64_t u = 0; u < w; ++u) {
      const int64_t e = n * g.s + s0 + u, tg = targets[e];
      double loss = 0;
      // -log_softmax at the target: -(x_t - max - log(sum)).
      if (!(hasIgnore && tg == ignoreIndex))
        loss = -((static_cast<double>(base[tg * g.s + u]) - mx[u]) - std::log(sum[u]));
      if (reduction == 2)
        y[e] = static_cast<T>(loss);
      else
        part[t] += loss;
    }
  });
  if (reduction == 2)
    return;
  double total = 0;
  for (int64_t t = 0; t < threads; ++t)
    total += part[t];
  // Mean over no counted element is 0/0, NaN, as in PyTorch.
  y[0] = static_cast<T>(reduction == 0 ? total / static_cast<double>(g.count) : total);
}

template <class T>
void cross_entropy_grad(const T *logits, Dims ls, const int64_t *targets, int reduction,
                        bool hasIgnore, int64_t ignoreIndex, const T *dy, T *dlogits) {
  if (reduction < 0 || reduction > 2)
    fatal("cross_entropy_grad: unknown reduction %d", reduction);
  const CeGeom g = ceGeom("cross_entropy_grad", ls, targets, hasIgnore, ignoreIndex);
  const double scalarW =
      reduction == 0 ? dy[0] / static_cast<double>(g.count) : (reduction == 1 ? dy[0] : 0.0);
  // dlogits = w * (softmax - onehot(target)), w = 0 for ignored elements.
  ceBlocks(g, [&](int64_t n, int64_t s0, int64_t w, int) {
    const int64_t off = n * g.c * g.s + s0;
    const T *base = logits + off;
    T *dbase = dlogits + off;
    auto weight = [&](int64_t u) -> double {
      const int64_t e = n * g.s + s0 + u, tg = targets[e];
      if (hasIgnore && tg == ignoreIndex)
        return 0.0;
      return reduction == 2 ? static_cast<double>(dy[e]) : scalarW;
    };
    if (g.s == 1) {
      // One exp per logit: store exp(x - max), then scale by w / sum.
      const T m = rowMax(base, g.c);
      double sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < g.c; ++j) {
        const T e = fexp(base[j] - m);
        dbase[j] = e;
        sum += e;
      }
      const double wu = weight(0);
      const T ws = static_cast<T>(wu / sum);
      for (int64_t j = 0; j < g.c; ++j)
        dbase[j] *= ws;
      if (wu != 0.0)
        dbase[targets[n]] -= static_cast<T>(wu);
      return;
    }
    T mx[kCeLanes] = {}, ws[kCeLanes] = {};
    double sum[kCeLanes] = {}, wt[kCeLanes] = {};
    classStats(base, g.c, g.s, w, mx, sum);
    for (int64_t u = 0; u < w; ++u) {
      wt[u] = weight(u);
      ws[u] = static_cast<T>(wt[u] / sum[u]);
    }
    for (int64_t j = 0; j < g.c; ++j)
      for (int64_t u = 0; u < w; ++u)
        dbase[j * g.s + u] = ws[u] * fexp(base[j * g.s + u] - mx[u]);
    for (int64_t u = 0; u < w; ++u)
      if (wt[u] != 0.0)
        dbase[targets[n * g.s + s0 + u] * g.s + u] -= static_cast<T>(wt[u]);
  });
}

//===--- Data movement ----------------------------------------------------===//

template <class T> void transpose(const T *x, Dims xs, Dims perm, T *y) {
  const Nest<1> n = transposeNest(xs, perm);
  const int64_t total = xs.numel();
  if (total == 0)
    return;
  if (n.rank == 0 || n.inner(0) == 1)
    return gatherView(x, n, y, total);

  // The last y dimension is strided in x: transpose tiles between it and the
  // y dimension that is contiguous in x.
  const int last = n.rank - 1;
  int kx = 0;
  while (n.st[0][kx] != 1)
    ++kx;
  int64_t yst[kMaxRank];
  yst[last] = 1;
  for (int i = last - 1; i >= 0; --i)
    yst[i] = yst[i + 1] * n.d[i + 1];
  int no = 0;
  int64_t od[kMaxRank], oxs[kMaxRank], oys[kMaxRank];
  for (int i = 0; i < n.rank; ++i) {
    if (i == kx || i == last)
      continue;
    od[no] = n.d[i];
    oxs[no] = n.st[0][i];
    oys[no++] = yst[i];
  }
  const int64_t dk = n.d[kx], dl = n.d[last], xl = n.st[0][last], yk = yst[kx];
  constexpr int64_t kTile = 32;
  const int64_t tk = (dk + kTile - 1) / kTile, tl = (dl + kTile - 1) / kTile;
  const int64_t outer = total / (dk * dl);
  parallelRange(outer * tk * tl, unitsFor(kTile * kTile), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      int64_t o = t / (tk * tl);
      const int64_t rem = t % (tk * tl);
      const int64_t k0 = (rem / tl) * kTile, l0 = (rem % tl) * kTile;
      int64_t xo = 0, yo = 0;
      for (int i = no - 1; i >= 0; --i) {
        const int64_t ii = o % od[i];
        o /= od[i];
        xo += ii * oxs[i];
        yo += ii * oys[i];
      }
      const int64_t k1 = std::min(dk, k0 + kTile), l1 = std::min(dl, l0 + kTile);
      for (int64_t kk = k0; kk < k1; ++kk) {
        const T *src = x + xo + kk;
        T *dst = y + yo + kk * yk;
        for (int64_t l = l0; l < l1; ++l)
          dst[l] = src[l * xl];
      }
    }
  });
}

namespace {

/// The strided view x[starts :: steps] of shape ys as a nest, and its base offset.

} // namespace

template <class T> void slice(const T *x, Dims xs, Dims starts, Dims steps, T *y, Dims ys) {
  int64_t base;
  const Nest<1> n = sliceNest("slice", xs, starts, steps, ys, base);
  const int64_t total = ys.numel();
  if (total)
    gatherView(x + base, n, y, total);
}

template <class T> void slice_grad(const T *dy, Dims ys, Dims starts, Dims steps, T *dx, Dims xs) {
  int64_t base;
  const Nest<1> n = sliceNest("slice_grad", xs, starts, steps, ys, base);
  fill(dx, xs.numel(), T(0));
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  const int64_t s = n.inner(0);
  T *dst0 = dx + base;
  parallelRange(total, kParallelMin, [&](int64_t e0, int64_t e1) {
    forRange(n, e0, e1, [&](const int64_t *off, int64_t e, int64_t len) {
      T *dst = dst0 + off[0];
      if (s == 1)
        std::memcpy(dst, dy + e, len * sizeof(T));
      else
        for (int64_t i = 0; i < len; ++i)
          dst[i * s] = dy[e + i];
    });
  });
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
  parallelRange(outer, unitsFor(row), [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o) {
      T *dst = y + o * row;
      for (int i = 0; i < n; ++i) {
        const int64_t len = prod(shapes[i], axis, shapes[i].rank);
        std::memcpy(dst, xs[i] + o * len, len * sizeof(T));
        dst += len;
      }
    }
  });
}

namespace {

/// Checks the indices of a gather along an axis of size `size`.
void checkIndices(const char *op, const int64_t *idx, int64_t n, int axis, int64_t size) {
  for (int64_t i = 0; i < n; ++i)
    if (idx[i] < -size || idx[i] >= size)
      fatal("%s: index %lld is out of range for axis %d of size %lld", op, (long long)idx[i], axis,
            (long long)size);
}

} // namespace

template <class T>
void gather(const T *table, Dims ts, const int64_t *idx, Dims is, int axis, T *y) {
  axis = normAxis(axis, ts.rank, "gather");
  const int64_t outer = prod(ts, 0, axis), size = ts.d[axis], inner = prod(ts, axis + 1, ts.rank);
  const int64_t ni = is.numel();
  checkIndices("gather", idx, ni, axis, size);
  if (outer * ni * inner == 0)
    return;
  parallelRange(outer * ni, unitsFor(inner), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t o = t / ni, k = t % ni;
      const int64_t v = idx[k] < 0 ? idx[k] + size : idx[k];
      const T *src = table + (o * size + v) * inner;
      if (inner == 1)
        y[t] = *src;
      else
        std::memcpy(y + t * inner, src, inner * sizeof(T));
    }
  });
}

template <class T>
void gather_grad(const T *dy, const int64_t *idx, Dims is, int axis, T *dtable, Dims ts) {
  axis = normAxis(axis, ts.rank, "gather_grad");
  const int64_t outer = prod(ts, 0, axis), size = ts.d[axis], inner = prod(ts, axis + 1, ts.rank);
  const int64_t ni = is.numel();
  checkIndices("gather_grad", idx, ni, axis, size);
  fill(dtable, ts.numel(), T(0));
  if (outer * ni * inner == 0)
    return;
  // Repeated indices add into one row: a task owns a column block of one
  // outer index and walks every index, so the sums are race-free and
  // deterministic.
  constexpr int64_t kCols = 256;
  const int64_t nb = (inner + kCols - 1) / kCols;
  parallelRange(outer * nb, unitsFor(ni * std::min(inner, kCols)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t o = t / nb, c0 = (t % nb) * kCols, w = std::min(kCols, inner - c0);
      for (int64_t k = 0; k < ni; ++k) {
        const int64_t v = idx[k] < 0 ? idx[k] + size : idx[k];
        T *dst = dtable + (o * size + v) * inner + c0;
        const T *src = dy + (o * ni + k) * inner + c0;
        for (int64_t c = 0; c < w; ++c)
          dst[c] += src[c];
      }
    }
  });
}

template <class T> void expand(const T *x, Dims xs, T *y, Dims ys) {
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  const Dims in[1] = {xs};
  gatherView(x, broadcastNest<1>("expand", in, ys), y, total);
}

//===--- Vocab-parallel kernels (dist.h) ----------------------------------===//
//
// Declared in dist.h, defined here to share the serial kernels' arithmetic
// (rowMax, fexp, sums in double), so that a tensor-parallel run computes the
// same values as a one-rank run. They reach other ranks only through the
// Communicator interface.

namespace {

void checkShardRows(const char *op, const Dims &ts, int64_t rowOffset, int64_t globalRows) {
  if (ts.rank < 1)
    fatal("%s: a table of rank 0", op);
  if (rowOffset < 0 || rowOffset + ts.d[0] > globalRows)
    fatal("%s: local rows [%lld, %lld) are outside the table's %lld rows", op,
          (long long)rowOffset, (long long)(rowOffset + ts.d[0]), (long long)globalRows);
}

/// Logits [N, Vl, S...] of one rank against targets [N, S...]; count is the
/// number of elements not ignored. Targets are checked against the global
/// vocabulary only once it is known (after the first all-reduce).
CeGeom vpGeom(const char *op, const Dims &ls, const int64_t *targets, bool hasIgnore,
              int64_t ignoreIndex) {
  if (ls.rank < 2)
    fatal("%s: logits of rank %d (need [N, C, ...])", op, ls.rank);
  CeGeom g;
  g.n = ls.d[0];
  g.c = ls.d[1];
  g.s = prod(ls, 2, ls.rank);
  const int64_t e = g.n * g.s;
  for (int64_t i = 0; i < e; ++i)
    g.count += !(hasIgnore && targets[i] == ignoreIndex);
  return g;
}

void vpCheckTargets(const char *op, const CeGeom &g, const int64_t *targets, bool hasIgnore,
                    int64_t ignoreIndex, int64_t vocabOffset, int64_t vocab) {
  if (vocabOffset < 0 || vocabOffset + g.c > vocab)
    fatal("%s: local classes [%lld, %lld) are outside the vocabulary of %lld", op,
          (long long)vocabOffset, (long long)(vocabOffset + g.c), (long long)vocab);
  const int64_t e = g.n * g.s;
  for (int64_t i = 0; i < e; ++i) {
    const int64_t t = targets[i];
    if (!(hasIgnore && t == ignoreIndex) && (t < 0 || t >= vocab))
      fatal("%s: target %lld at element %lld is outside [0, %lld)", op, (long long)t, (long long)i,
            (long long)vocab);
  }
}

template <class T> constexpr CommType commTypeOf() {
  return std::is_same<T, float>::value ? CommType::F32 : CommType::F64;
}

/// mx[e] = the max over this rank's classes of element e.
template <class T> void vpLocalMax(const CeGeom &g, const T *logits, T *mx) {
  ceBlocks(g, [&](int64_t n, int64_t s0, int64_t w, int) {
    const T *base = logits + n * g.c * g.s + s0;
    T *m = mx + n * g.s + s0;
    if (g.s == 1) {
      m[0] = rowMax(base, g.c);
      return;
    }
    std::fill_n(m, w, -std::numeric_limits<T>::infinity());
    for (int64_t j = 0; j < g.c; ++j)
      for (int64_t u = 0; u < w; ++u)
        m[u] = std::max(m[u], base[j * g.s + u]);
  });
}

/// sum[e] = the sum over this rank's classes of exp(x - mx[e]) for element e;
/// with `exps` (contiguous classes only), also stores each exp(x - mx) there.
template <class T>
void vpLocalSumExp(const CeGeom &g, const T *logits, const T *mx, double *sum, T *exps) {
  ceBlocks(g, [&](int64_t n, int64_t s0, int64_t w, int) {
    const int64_t off = n * g.c * g.s + s0, e0 = n * g.s + s0;
    const T *base = logits + off;
    if (g.s == 1) {
      const T m = mx[e0];
      double acc = 0;
      if (exps) {
        T *out = exps + off;
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < g.c; ++j) {
          const T x = fexp(base[j] - m);
          out[j] = x;
          acc += x;
        }
      } else {
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < g.c; ++j)
          acc += fexp(base[j] - m);
      }
      sum[e0] = acc;
      return;
    }
    std::fill_n(sum + e0, w, 0.0);
    for (int64_t j = 0; j < g.c; ++j)
      for (int64_t u = 0; u < w; ++u)
        sum[e0 + u] += fexp(base[j * g.s + u] - mx[e0 + u]);
  });
}

} // namespace

template <class T>
void gather_sharded(const T *table, Dims ts, int64_t rowOffset, int64_t globalRows,
                    const int64_t *idx, Dims is, T *y) {
  checkShardRows("gather_sharded", ts, rowOffset, globalRows);
  const int64_t rows = ts.d[0], inner = prod(ts, 1, ts.rank), ni = is.numel();
  checkIndices("gather_sharded", idx, ni, 0, globalRows);
  if (ni * inner == 0)
    return;
  parallelRange(ni, unitsFor(inner), [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const int64_t v = (idx[k] < 0 ? idx[k] + globalRows : idx[k]) - rowOffset;
      if (v >= 0 && v < rows)
        std::memcpy(y + k * inner, table + v * inner, inner * sizeof(T));
      else
        std::fill_n(y + k * inner, inner, T(0));
    }
  });
}

template <class T>
void gather_sharded_grad(const T *dy, const int64_t *idx, Dims is, int64_t rowOffset,
                         int64_t globalRows, T *dtable, Dims ts) {
  checkShardRows("gather_sharded_grad", ts, rowOffset, globalRows);
  const int64_t rows = ts.d[0], inner = prod(ts, 1, ts.rank), ni = is.numel();
  checkIndices("gather_sharded_grad", idx, ni, 0, globalRows);
  fill(dtable, ts.numel(), T(0));
  if (ni * inner == 0)
    return;
  // As gather_grad: a task owns a column block and walks every index, so
  // repeated ids add race-free and in a fixed order.
  constexpr int64_t kCols = 256;
  const int64_t nb = (inner + kCols - 1) / kCols;
  parallelRange(nb, unitsFor(ni * std::min(inner, kCols)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t c0 = t * kCols, w = std::min(kCols, inner - c0);
      for (int64_t k = 0; k < ni; ++k) {
        const int64_t v = (idx[k] < 0 ? idx[k] + globalRows : idx[k]) - rowOffset;
        if (v < 0 || v >= rows)
          continue;
        T *dst = dtable + v * inner + c0;
        const T *src = dy + k * inner + c0;
        for (int64_t c = 0; c < w; ++c)
          dst[c] += src[c];
      }
    }
  });
}

template <class T>
void cross_entropy_vocab_parallel(Communicator &c, const T *logits, Dims ls, int64_t vocabOffset,
                                  const int64_t *targets, int reduction, bool hasIgnore,
                                  int64_t ignoreIndex, T *y) {
  const char *op = "cross_entropy_vocab_parallel";
  if (reduction < 0 || reduction > 2)
    fatal("%s: unknown reduction %d", op, reduction);
  const CeGeom g = vpGeom(op, ls, targets, hasIgnore, ignoreIndex);
  const int64_t e = g.n * g.s;
  // acc: [sum of exp (e) | target logit (e) | local classes (1)], summed at once.
  T *mx = scratch<T>(2, e);
  double *acc = scratch<double>(3, 2 * e + 1);
  vpLocalMax(g, logits, mx);
  c.allReduce(mx, e, commTypeOf<T>(), ReduceOp::Max);
  vpLocalSumExp(g, logits, mx, acc, static_cast<T *>(nullptr));
  for (int64_t i = 0; i < e; ++i) {
    const int64_t k = targets[i] - vocabOffset;
    const bool mine = !(hasIgnore && targets[i] == ignoreIndex) && k >= 0 && k < g.c;
    const int64_t n = i / g.s, u = i % g.s;
    acc[e + i] = mine ? static_cast<double>(logits[(n * g.c + k) * g.s + u]) : 0.0;
  }
  acc[2 * e] = static_cast<double>(g.c);
  c.allReduce(acc, 2 * e + 1, CommType::F64, ReduceOp::Sum);
  vpCheckTargets(op, g, targets, hasIgnore, ignoreIndex, vocabOffset,
                 static_cast<int64_t>(acc[2 * e]));
  double total = 0;
  for (int64_t i = 0; i < e; ++i) {
    double loss = 0;
    // -log_softmax at the target: -(x_t - max - log(sum)), as cross_entropy.
    if (!(hasIgnore && targets[i] == ignoreIndex))
      loss = -((acc[e + i] - mx[i]) - std::log(acc[i]));
    if (reduction == 2)
      y[i] = static_cast<T>(loss);
    else
      total += loss;
  }
  if (reduction != 2)
    y[0] = static_cast<T>(reduction == 0 ? total / static_cast<double>(g.count) : total);
}

template <class T>
void cross_entropy_vocab_parallel_grad(Communicator &c, const T *logits, Dims ls,
                                       int64_t vocabOffset, const int64_t *targets, int reduction,
                                       bool hasIgnore, int64_t ignoreIndex, const T *dy,
                                       T *dlogits) {
  const char *op = "cross_entropy_vocab_parallel_grad";
  if (reduction < 0 || reduction > 2)
    fatal("%s: unknown reduction %d", op, reduction);
  const CeGeom g = vpGeom(op, ls, targets, hasIgnore, ignoreIndex);
  const int64_t e = g.n * g.s;
  // acc: [sum of exp (e) | local classes (1)].
  T *mx = scratch<T>(2, e);
  double *acc = scratch<double>(3, e + 1);
  vpLocalMax(g, logits, mx);
  c.allReduce(mx, e, commTypeOf<T>(), ReduceOp::Max);
  // Contiguous classes: one exp per logit, stored in dlogits and scaled below.
  vpLocalSumExp(g, logits, mx, acc, g.s == 1 ? dlogits : static_cast<T *>(nullptr));
  acc[e] = static_cast<double>(g.c);
  c.allReduce(acc, e + 1, CommType::F64, ReduceOp::Sum);
  vpCheckTargets(op, g, targets, hasIgnore, ignoreIndex, vocabOffset,
                 static_cast<int64_t>(acc[e]));
  const double scalarW =
      reduction == 0 ? dy[0] / static_cast<double>(g.count) : (reduction == 1 ? dy[0] : 0.0);
  // dlogits = w * (softmax - onehot(target)), w = 0 for ignored elements; the
  // onehot term only on the rank that holds the target class.
  ceBlocks(g, [&](int64_t n, int64_t s0, int64_t w, int) {
    const int64_t off = n * g.c * g.s + s0;
    const T *base = logits + off;
    T *dbase = dlogits + off;
    const int64_t e0 = n * g.s + s0;
    double wt[kCeLanes] = {};
    T ws[kCeLanes] = {};
    for (int64_t u = 0; u < w; ++u) {
      const int64_t tg = targets[e0 + u];
      wt[u] = hasIgnore && tg == ignoreIndex ? 0.0
              : reduction == 2              ? static_cast<double>(dy[e0 + u])
                                            : scalarW;
      ws[u] = static_cast<T>(wt[u] / acc[e0 + u]);
    }
    if (g.s == 1) {
      const T w0 = ws[0];
      for (int64_t j = 0; j < g.c; ++j)
        dbase[j] *= w0;
    } else {
      for (int64_t j = 0; j < g.c; ++j)
        for (int64_t u = 0; u < w; ++u)
          dbase[j * g.s + u] = ws[u] * fexp(base[j * g.s + u] - mx[e0 + u]);
    }
    for (int64_t u = 0; u < w; ++u) {
      const int64_t k = targets[e0 + u] - vocabOffset;
      if (wt[u] != 0.0 && k >= 0 && k < g.c)
        dbase[k * g.s + u] -= static_cast<T>(wt[u]);
    }
  });
}

//===--- Instantiations ---------------------------------------------------===//

#define CARVE_FLOATING(T)                                                                          \
  template void unary<T>(Unary, const T *, T *, int64_t);                                          \
  template void unary_grad<T>(Unary, const T *, const T *, T *, int64_t);                          \
  template void matmul<T>(const T *, Dims, bool, const T *, Dims, bool, T *, Dims, bool);          \
  template void reduce<T>(Reduce, const T *, Dims, uint32_t, T *);                                 \
  template void softmax<T>(const T *, Dims, int, bool, T *);                                       \
  template void softmax_grad<T>(const T *, const T *, Dims, int, bool, T *);                       \
  template void layer_norm<T>(const T *, Dims, int, const T *, const T *, T, T *);                 \
  template void layer_norm_grad<T>(const T *, Dims, int, const T *, T, const T *, T *, T *, T *);  \
  template void rms_norm<T>(const T *, Dims, int, const T *, T, T *);                              \
  template void rms_norm_grad<T>(const T *, Dims, int, const T *, T, const T *, T *, T *);         \
  template void attention<T>(const T *, Dims, const T *, Dims, const T *, Dims, const T *, Dims,   \
                             T, bool, T *);                                                        \
  template void attention_grad<T>(const T *, Dims, const T *, Dims, const T *, Dims, const T *,    \
                                  Dims, T, bool, const T *, T *, T *, T *);                        \
  template void cross_entropy<T>(const T *, Dims, const int64_t *, int, bool, int64_t, T *);       \
  template void cross_entropy_grad<T>(const T *, Dims, const int64_t *, int, bool, int64_t,        \
                                      const T *, T *);                                             \
  template void gather_sharded<T>(const T *, Dims, int64_t, int64_t, const int64_t *, Dims, T *);  \
  template void gather_sharded_grad<T>(const T *, const int64_t *, Dims, int64_t, int64_t, T *,    \
                                       Dims);                                                      \
  template void cross_entropy_vocab_parallel<T>(Communicator &, const T *, Dims, int64_t,          \
                                                const int64_t *, int, bool, int64_t, T *);         \
  template void cross_entropy_vocab_parallel_grad<T>(Communicator &, const T *, Dims, int64_t,     \
                                                     const int64_t *, int, bool, int64_t,          \
                                                     const T *, T *);
CARVE_FLOATING(float)
CARVE_FLOATING(double)
#undef CARVE_FLOATING

// binary is also instantiated for the integer types (C++ semantics: integer
// division truncates toward zero, as ONNX Div).
#define CARVE_ARITH(T) template void binary<T>(Binary, const T *, Dims, const T *, Dims, T *, Dims);
CARVE_ARITH(float)
CARVE_ARITH(double)
CARVE_ARITH(int64_t)
CARVE_ARITH(int32_t)
#undef CARVE_ARITH

#define CARVE_COMPARE(T)                                                                           \
  template void compare<T>(Compare, const T *, Dims, const T *, Dims, uint8_t *, Dims);
CARVE_COMPARE(float)
CARVE_COMPARE(double)
CARVE_COMPARE(int64_t)
CARVE_COMPARE(int32_t)
CARVE_COMPARE(uint8_t)
#undef CARVE_COMPARE

#define CARVE_MOVE(T)                                                                              \
  template void where<T>(const uint8_t *, Dims, const T *, Dims, const T *, Dims, T *, Dims);      \
  template void fill<T>(T *, int64_t, T);                                                          \
  template void copy<T>(const T *, T *, int64_t);                                                  \
  template void transpose<T>(const T *, Dims, Dims, T *);                                          \
  template void slice<T>(const T *, Dims, Dims, Dims, T *, Dims);                                  \
  template void slice_grad<T>(const T *, Dims, Dims, Dims, T *, Dims);                             \
  template void concat<T>(int, const T *const *, const Dims *, int, T *);                          \
  template void gather<T>(const T *, Dims, const int64_t *, Dims, int, T *);                       \
  template void gather_grad<T>(const T *, const int64_t *, Dims, int, T *, Dims);                  \
  template void expand<T>(const T *, Dims, T *, Dims);
CARVE_MOVE(float)
CARVE_MOVE(double)
CARVE_MOVE(int64_t)
CARVE_MOVE(int32_t)
CARVE_MOVE(uint8_t)
#undef CARVE_MOVE

#define CARVE_CAST_FROM(F)                                                                         \
  template void cast<F, float>(const F *, float *, int64_t);                                       \
  template void cast<F, double>(const F *, double *, int64_t);                                     \
  template void cast<F, int64_t>(const F *, int64_t *, int64_t);                                   \
  template void cast<F, int32_t>(const F *, int32_t *, int64_t);                                   \
  template void cast<F, uint8_t>(const F *, uint8_t *, int64_t);
CARVE_CAST_FROM(float)
CARVE_CAST_FROM(double)
CARVE_CAST_FROM(int64_t)
CARVE_CAST_FROM(int32_t)
CARVE_CAST_FROM(uint8_t)
#undef CARVE_CAST_FROM

} // namespace carve::rt
