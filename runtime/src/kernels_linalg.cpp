//===- kernels_linalg.cpp - matmul and attention over OpenBLAS GEMMs ------===//
//
// matmul, attention and attention_grad of kernels.h, and the bf16 / fp16
// rounding of their float inputs that setPrecision selects. The habits every
// kernel file keeps: kernels_loops.h.
//
//===----------------------------------------------------------------------===//

// Nothing here reads floating-point exception flags. Without this, GCC keeps
// every select of branch-free math (clamps, NaN handling) as a branch, because
// the arithmetic it would then run unconditionally "may trap", and no loop that
// calls exp, tanh or erf vectorizes. Before the includes, so that inline
// functions of the headers (kernels_loops.h among them) get the same options in
// every kernels_*.cpp and still inline.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include "carve/rt/elementwise.h"
#include "kernels_loops.h"
#include "packed_gemm.h"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace carve::rt {

namespace {

/// OpenBLAS runs a GEMM on the calling thread when m*n*k is at most this
/// (SMP_THRESHOLD_MIN * GEMM_MULTITHREAD_THRESHOLD); GEMMs issued from inside
/// an OpenMP region stay below it.
constexpr int64_t kGemmSerialMnk = 65536 * 4;

using ew::broadcastNest;
using ew::fexp;
using ew::forRange;
using ew::Nest;

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

namespace {

bool gPackedGemm = true;

/// Output pixels from which a convolution's forward and weight gradient take
/// carve's own packed GEMM (docs/performance.md, "A convolution's GEMMs packed
/// from the image").
constexpr int64_t kDirectMinPixels = 64;

} // namespace

void setPackedGemm(bool on) { gPackedGemm = on; }
bool packedGemm() { return gPackedGemm && packed::kBuilt; }
bool packedMatmuls() { return gPackedGemm && packed::kWide; }

float roundToBf16(float x) { return ew::roundBf16(x); }

float roundToF16(float x) { return ew::roundF16(x); }

namespace {

/// The GEMM sizes of op(a) @ op(b) -> y (shapes as stored); fatal, naming
/// `op`, when the ranks or the sizes do not agree.
struct GemmDims {
  int64_t m, k, n;
};

GemmDims gemmDims(const char *op, Dims as, bool transA, Dims bs, bool transB, Dims ys) {
  const int ar = as.rank, br = bs.rank, yr = ys.rank;
  if (ar < 2 || br < 2 || yr != std::max(ar, br))
    fatal("%s: operands of rank %d and %d with a result of rank %d (both ranks must be "
          ">= 2 and the result's their maximum)",
          op, ar, br, yr);
  const int64_t m = transA ? as.d[ar - 1] : as.d[ar - 2];
  const int64_t k = transA ? as.d[ar - 2] : as.d[ar - 1];
  const int64_t kb = transB ? bs.d[br - 1] : bs.d[br - 2];
  const int64_t n = transB ? bs.d[br - 2] : bs.d[br - 1];
  if (k != kb || ys.d[yr - 2] != m || ys.d[yr - 1] != n)
    fatal("%s: [%lld x %lld] @ [%lld x %lld] does not give [%lld x %lld]", op, (long long)m,
          (long long)k, (long long)kb, (long long)n, (long long)ys.d[yr - 2],
          (long long)ys.d[yr - 1]);
  return {m, k, n};
}

/// How a batch of `nb` GEMMs of m x n x k runs. Small matrices: whole batch
/// matrices per thread where the batch is worth it, each GEMM on its calling
/// thread. Large ones, at least 4 per thread (a convolution's GEMM per
/// sample): the same, one fork and join for the batch. A few large ones: one
/// at a time, threaded by OpenBLAS. `run(e0, e1)` runs batch matrices
/// [e0, e1); it returns whether the matrices ran on the calling thread alone.
template <class F> bool runBatch(int64_t nb, int64_t m, int64_t n, int64_t k, F &&run) {
  if (m * n * k <= kGemmSerialMnk)
    parallelRange(nb, unitsFor(m * n * k), run);
  else if (nb >= 4 * omp_get_max_threads())
    parallelRange(nb, 2, run);
  else
    return true;
  return false;
}

} // namespace

namespace {

/// Rows of A are split in groups of a multiple of this (a multiple of both
/// microkernels' MR, 12 and 6).
constexpr int64_t kPackedRows = 96;

/// y [m x n] (+)= op(A) [m x k] x op(B) [k x n] through carve's packed GEMM.
/// A unit of work is a group of rows by kNc columns: as few row groups as
/// give every thread two units, since each unit packs its columns of B once
/// (and its rows of A). Each element sums its k products in the same order
/// whatever the split.
void packedMatmul(const float *a, int64_t lda, bool transA, const float *b, int64_t ldb,
                  bool transB, float *y, int64_t m, int64_t n, int64_t k, bool accumulate) {
  const int64_t cb = (n + packed::kNc - 1) / packed::kNc,
                blocks = (m + kPackedRows - 1) / kPackedRows;
  const int64_t groups = std::clamp<int64_t>((2 * omp_get_max_threads() + cb - 1) / cb, 1, blocks);
  const int64_t groupRows = (blocks + groups - 1) / groups * kPackedRows;
  const int64_t rb = (m + groupRows - 1) / groupRows, width = std::min(n, packed::kNc);
  if (!transB) {
    const packed::Windows w = packed::Windows::matrix(n, ldb);
    parallelRange(rb * cb, 2, [&](int64_t u0, int64_t u1) {
      float *pa =
          scratch<float>(0, packed::packedASize(groupRows, k) + packed::bufferSize(k, 0, width));
      float *buf = pa + packed::packedASize(groupRows, k);
      int64_t packedGroup = -1;
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t r = u / cb, r0 = r * groupRows, rows = std::min(groupRows, m - r0);
        const int64_t j0 = u % cb * packed::kNc;
        if (r != packedGroup) { // the units of one group of rows share its packed A
          packed::packA(transA ? a + r0 : a + r0 * lda, lda, rows, k, pa, transA);
          packedGroup = r;
        }
        packed::gemm(pa, rows, k, b, w, j0, std::min(n, j0 + packed::kNc), y + r0 * n, buf,
                     accumulate);
      }
    });
    return;
  }
  const packed::Windows w = packed::Windows::matrix(k, ldb);
  parallelRange(rb * cb, 2, [&](int64_t u0, int64_t u1) {
    float *buf = scratch<float>(0, packed::bufferSizeTransposed(groupRows, k, 0, width));
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t r0 = u / cb * groupRows, rows = std::min(groupRows, m - r0);
      const int64_t j0 = u % cb * packed::kNc;
      packed::gemmTransposed(transA ? a + r0 : a + r0 * lda, rows, n, b, w, j0,
                             std::min(n, j0 + packed::kNc), y + r0 * n, buf, lda, transA,
                             accumulate);
    }
  });
}

/// Whether a float GEMM summing k products goes to packedMatmul: with the
/// AVX-512 microkernel (with AVX2, OpenBLAS's own kernels are about as fast
/// on plain matrices), and by k alone, never by m, n or the batch: so a
/// rank's share of the rows or columns (dp, column-parallel tp) takes the
/// way one rank takes and sums each element alike.
bool usePackedMatmul(int64_t k) { return packed::kWide && gPackedGemm && k >= 16; }

} // namespace

template <class T>
void matmul(const T *a, Dims as, bool transA, const T *b, Dims bs, bool transB, T *y, Dims ys,
            bool accumulate) {
  roundInput(a, as.numel(), 0);
  roundInput(b, bs.numel(), 1);
  const auto [m, k, n] = gemmDims("matmul", as, transA, bs, transB, ys);
  const int ar = as.rank, br = bs.rank, yr = ys.rank;
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
  const bool folds = bBatch.numel() == 1 && !transA && aBatch.numel() == nb;
  const int64_t sa = nest.inner(0), sb = nest.inner(1);
  const int64_t aMat = m * k, bMat = k * n, yMat = m * n;
  if constexpr (std::is_same_v<T, float>) {
    if (usePackedMatmul(k)) {
      // Folded or a matrix at a time, each element's sum is the same.
      if (folds) {
        packedMatmul(a, lda, false, b, ldb, transB, y, nb * m, n, k, accumulate);
        return;
      }
      parallelRange(nb, 2, [&](int64_t e0, int64_t e1) {
        forRange(nest, e0, e1, [&](const int64_t *off, int64_t e, int64_t len) {
          for (int64_t i = 0; i < len; ++i)
            packedMatmul(a + (off[0] + i * sa) * aMat, lda, transA, b + (off[1] + i * sb) * bMat,
                         ldb, transB, y + (e + i) * yMat, m, n, k, accumulate);
        });
      });
      return;
    }
  }
  if (folds) {
    gemm(false, transB, nb * m, n, k, T(1), a, lda, b, ldb, beta, y, n);
    return;
  }
  auto run = [&](int64_t e0, int64_t e1) {
    forRange(nest, e0, e1, [&](const int64_t *off, int64_t e, int64_t len) {
      for (int64_t i = 0; i < len; ++i)
        gemm(transA, transB, m, n, k, T(1), a + (off[0] + i * sa) * aMat, lda,
             b + (off[1] + i * sb) * bMat, ldb, beta, y + (e + i) * yMat, n);
    });
  };
  if (runBatch(nb, m, n, k, run))
    run(0, nb);
}

namespace {

/// Rows [r0, r0 + rows) of gather(table [.., size], idx, last axis), each
/// `ni` elements, into dst: whole runs of consecutive positions copied where
/// the indices have them (im2col's taps at stride 1), else one by one.
/// Indices already checked.
template <class T>
void gatherRows(const T *table, int64_t size, const int64_t *idx, int64_t ni,
                const std::vector<Run> &runs, int64_t r0, int64_t rows, T *dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const T *src = table + (r0 + r) * size;
    T *d = dst + r * ni;
    if (!runs.empty()) {
      for (const Run &run : runs)
        std::memcpy(d + run.k, src + run.from, run.len * sizeof(T));
    } else {
      for (int64_t q = 0; q < ni; ++q)
        d[q] = src[idx[q] < 0 ? idx[q] + size : idx[q]];
    }
  }
}

} // namespace

template <class T>
void matmul_gathered(const T *a, Dims as, bool transA, const T *table, Dims ts, const int64_t *idx,
                     Dims is, Dims bs, bool transB, T *y, Dims ys) {
  const auto [m, k, n] = gemmDims("matmul_gathered", as, transA, bs, transB, ys);
  if (ts.rank < 1)
    fatal("matmul_gathered: a table of rank 0");
  const int64_t size = ts.d[ts.rank - 1], ni = is.numel(), outer = prod(ts, 0, ts.rank - 1);
  const int64_t bMat = k * n, nbB = prod(bs, 0, bs.rank - 2);
  if (outer * ni != bs.numel() || (bMat > 0 && (ni == 0 || bMat % ni != 0)))
    fatal("matmul_gathered: %lld table rows of %lld indices do not make the operand's %lld "
          "matrices [%lld x %lld] of whole rows",
          (long long)outer, (long long)ni, (long long)nbB, (long long)k, (long long)n);
  checkIndices("matmul_gathered", idx, ni, ts.rank - 1, size);
  const int64_t rowsPer = bMat == 0 ? 0 : bMat / ni;
  const int ar = as.rank, br = bs.rank, yr = ys.rank;
  const Dims batch(ys.d, yr - 2), aBatch(as.d, ar - 2), bBatch(bs.d, br - 2);
  const int64_t nb = batch.numel();
  if constexpr (std::is_same_v<T, float>) {
    // A convolution's forward: carve's own GEMM packs the windows from the
    // image into its panels (packed_gemm.h). Chosen by the operand's shape
    // alone (never by m or the batch), so every plan's ranks take the same
    // way and sum each element in the same order.
    if (packed::kBuilt && gPackedGemm && !transA && !transB && aBatch.numel() == 1 &&
        bBatch.numel() == nb && m > 0 && n >= kDirectMinPixels && k > 0 && nb > 0 && ni % n == 0) {
      roundInput(a, as.numel(), 0);
      roundInput(table, ts.numel(), 1);
      const packed::Windows w(idx, ni / n, n, size);
      float *pa = scratch<float>(3, packed::packedASize(m, k));
      packed::packA(a, as.d[ar - 1], m, k, pa);
      const int64_t chunks = (n + packed::kNc - 1) / packed::kNc;
      parallelRange(nb * chunks, 2, [&](int64_t u0, int64_t u1) {
        float *buf = scratch<float>(0, packed::bufferSize(k, 0, std::min(n, packed::kNc)));
        for (int64_t u = u0; u < u1; ++u) {
          const int64_t j = u / chunks, j0 = u % chunks * packed::kNc;
          packed::gemm(pa, m, k, table + j * rowsPer * size, w, j0, std::min(n, j0 + packed::kNc),
                       y + j * m * n, buf);
        }
      });
      return;
    }
    // Its weight gradient, dY [N, O, pixels] times each sample's windows
    // transposed: the same GEMM with the windows packed transposed.
    if (packed::kBuilt && gPackedGemm && !transA && transB && aBatch.numel() == nb &&
        bBatch.numel() == nb && m > 0 && n > 0 && k >= kDirectMinPixels && nb > 0 && ni % k == 0) {
      roundInput(a, as.numel(), 0);
      roundInput(table, ts.numel(), 1);
      const packed::Windows w(idx, ni / k, k, size);
      // Whole samples per unit where they keep the threads busy (each
      // sample's dY packed once), else chunks of columns too.
      const int64_t chunks =
          nb >= 2 * omp_get_max_threads() ? 1 : (n + packed::kNc - 1) / packed::kNc;
      const int64_t width = (n + chunks - 1) / chunks;
      parallelRange(nb * chunks, 2, [&](int64_t u0, int64_t u1) {
        float *buf = scratch<float>(0, packed::bufferSizeTransposed(m, k, 0, width));
        for (int64_t u = u0; u < u1; ++u) {
          const int64_t j = u / chunks, j0 = u % chunks * width;
          packed::gemmTransposed(a + j * m * k, m, n, table + j * rowsPer * size, w, j0,
                                 std::min(n, j0 + width), y + j * m * n, buf);
        }
      });
      return;
    }
  }
  const std::vector<Run> runs = runsOf(idx, ni, size); // the gathers' copies
  if (bBatch.numel() == 1 || m == 0 || n == 0 || k == 0 || nb == 0) {
    // One operand matrix (or nothing to multiply): gathered whole, then
    // matmul's own GEMMs.
    T *bw = scratch<T>(2, static_cast<size_t>(bs.numel()));
    parallelRange(outer, unitsFor(ni), [&](int64_t r0, int64_t r1) {
      gatherRows(table, size, idx, ni, runs, r0, r1 - r0, bw + r0 * ni);
    });
    matmul(a, as, transA, bw, bs, transB, y, ys);
    return;
  }
  roundInput(a, as.numel(), 0);
  roundInput(table, ts.numel(), 1); // rounding commutes with the gather
  // Each operand matrix gathered as its GEMM needs it, into the thread's
  // scratch (a convolution's windows of one sample, in cache), then the GEMM
  // matmul would run on it: the same calls on the same values, so the same
  // bits as matmul of the gathered tensor.
  const int64_t lda = as.d[ar - 1], ldb = bs.d[br - 1];
  const Dims in[2] = {aBatch, bBatch};
  const Nest<2> nest = broadcastNest<2>("matmul_gathered", in, batch);
  const int64_t sa = nest.inner(0), sb = nest.inner(1);
  const int64_t aMat = m * k, yMat = m * n;
  bool alone = false;
  auto run = [&](int64_t e0, int64_t e1) {
    T *bw = scratch<T>(alone ? 2 : 0, static_cast<size_t>(bMat));
    forRange(nest, e0, e1, [&](const int64_t *off, int64_t e, int64_t len) {
      for (int64_t i = 0; i < len; ++i) {
        const int64_t j = off[1] + i * sb;
        if (alone)
          parallelRange(rowsPer, unitsFor(ni), [&](int64_t r0, int64_t r1) {
            gatherRows(table, size, idx, ni, runs, j * rowsPer + r0, r1 - r0, bw + r0 * ni);
          });
        else
          gatherRows(table, size, idx, ni, runs, j * rowsPer, rowsPer, bw);
        gemm(transA, transB, m, n, k, T(1), a + (off[0] + i * sa) * aMat, lda, bw, ldb, T(0),
             y + (e + i) * yMat, n);
      }
    });
  };
  if (runBatch(nb, m, n, k, run)) {
    alone = true;
    run(0, nb);
  }
}

namespace {

/// Where each tap's pixels land in a gather_grad's table row: for tap t,
/// the segments of positions [q, q + len) that take pixels from, from + 1,
/// .. (from < 0: no pixel lands there). A position taking a second pixel of
/// the same tap (the padding element every padded tap reads) keeps the
/// first; the others are `extra` (tap, pixel, position), by position.
struct TapInverse {
  struct Segment {
    int64_t q, len, from;
  };
  std::vector<std::vector<Segment>> taps;
  std::vector<std::array<int64_t, 3>> extra;
  int64_t hits = 0; // (tap, position) pairs some pixel lands on
};

TapInverse invertTaps(const int64_t *idx, int64_t taps, int64_t pixels, int64_t size) {
  TapInverse r;
  r.taps.resize(taps);
  std::vector<int64_t> inv(size);
  for (int64_t t = 0; t < taps; ++t) {
    std::fill(inv.begin(), inv.end(), int64_t(-1));
    for (int64_t p = 0; p < pixels; ++p) {
      const int64_t v = idx[t * pixels + p], q = v < 0 ? v + size : v;
      if (inv[q] < 0) {
        inv[q] = p;
        ++r.hits;
      } else {
        r.extra.push_back({t, p, q});
      }
    }
    for (int64_t q = 0; q < size;) {
      int64_t len = 1;
      while (q + len < size && (inv[q] < 0 ? inv[q + len] < 0 : inv[q + len] == inv[q] + len))
        ++len;
      r.taps[t].push_back({q, len, inv[q]});
      q += len;
    }
  }
  std::sort(r.extra.begin(), r.extra.end(),
            [](const auto &x, const auto &y) { return x[2] != y[2] ? x[2] < y[2] : x[0] < y[0]; });
  return r;
}

} // namespace

template <class T>
void matmul_gather_grad(const T *a, Dims as, bool transA, const T *b, Dims bs, bool transB, Dims ys,
                        const int64_t *idx, Dims is, T *dtable, Dims ts) {
  roundInput(a, as.numel(), 0);
  roundInput(b, bs.numel(), 1);
  const auto [m, k, n] = gemmDims("matmul_gather_grad", as, transA, bs, transB, ys);
  const int ar = as.rank, br = bs.rank, yr = ys.rank;
  if (ts.rank < 1)
    fatal("matmul_gather_grad: a table of rank 0");
  const Dims batch(ys.d, yr - 2), aBatch(as.d, ar - 2), bBatch(bs.d, br - 2);
  const int64_t nb = batch.numel(), ni = is.numel(), size = ts.d[ts.rank - 1];
  const int64_t outer = prod(ts, 0, ts.rank - 1);
  // Each row of the table takes `ni` product elements: `taps` whole rows of
  // one product matrix, `perMat` table rows to a matrix.
  if (n == 0 || ni % n != 0 || m % (ni / n) != 0 || nb * (m / (ni / n)) != outer)
    fatal("matmul_gather_grad: a product of %lld matrices [%lld x %lld] is not %lld rows of "
          "%lld indices, each whole rows of one matrix",
          (long long)nb, (long long)m, (long long)n, (long long)outer, (long long)ni);
  checkIndices("matmul_gather_grad", idx, ni, ts.rank - 1, size);
  const int64_t taps = ni / n, perMat = m / taps;
  if (outer == 0 || size == 0)
    return;
  if (k == 0 || ni == 0) {
    fill(dtable, outer * size, T(0));
    return;
  }
  const int64_t lda = as.d[ar - 1], ldb = bs.d[br - 1];
  const Dims in[2] = {aBatch, bBatch};
  const Nest<2> nest = broadcastNest<2>("matmul_gather_grad", in, batch);
  auto offsets = [&](int64_t e, int64_t &offA, int64_t &offB) {
    forRange(nest, e, e + 1, [&](const int64_t *off, int64_t, int64_t) {
      offA = off[0];
      offB = off[1];
    });
  };
  const TapInverse tapInv = invertTaps(idx, taps, n, size);
  if (2 * tapInv.hits >= taps * size && n >= 1024) {
    // Most positions take one pixel of each tap (a stride-1 convolution:
    // the input gradient is the output gradient's windows times the weight
    // transposed), in images of at least 1024 pixels. Then a table row is
    // one GEMM with kd * taps terms, not a scatter of products of kd terms
    // each (measured, bench/conv_grad_probe.cpp: 1.3x at 32x32 images; at
    // 16x16 and 8x8 its GEMM, only C rows long, runs slower than the
    // scatter's):
    //   dtable[c, q] = sum over (o, t) of W'[c, o * taps + t] * G[o * taps + t, q],
    //   W'[c, o * taps + t] = op(A)[c * taps + t, o],
    //   G[o * taps + t, q] = op(B)[o, the pixel of tap t landing on q] (0: none),
    // G packed a block of positions at a time (at most 256K elements),
    // written straight into the table.
    const int64_t kk = k * taps, nA = std::max<int64_t>(aBatch.numel(), 1);
    T *wp = scratch<T>(2, static_cast<size_t>(nA * perMat * kk)); // shared with the team
    for (int64_t am = 0; am < nA; ++am)
      for (int64_t c = 0; c < perMat; ++c)
        for (int64_t o = 0; o < k; ++o)
          for (int64_t t = 0; t < taps; ++t) {
            const int64_t r = c * taps + t;
            wp[(am * perMat + c) * kk + o * taps + t] =
                a[am * m * k + (transA ? o * lda + r : r * lda + o)];
          }
    // With the packed GEMM (float, dY not transposed): G packed from dY
    // straight into its panels, the image's blocks of kNc positions.
    bool direct = false;
    std::vector<float> pw;
    std::optional<packed::Windows> gw;
    if constexpr (std::is_same_v<T, float>) {
      if (packed::kBuilt && gPackedGemm && !transB) {
        direct = true;
        std::vector<int64_t> inv(taps * size, -1);
        for (int64_t t = 0; t < taps; ++t)
          for (const TapInverse::Segment &sg : tapInv.taps[t])
            if (sg.from >= 0)
              for (int64_t j = 0; j < sg.len; ++j)
                inv[t * size + sg.q + j] = sg.from + j;
        gw.emplace(inv.data(), taps, size, n, true);
        pw.resize(nA * packed::packedASize(perMat, kk));
        for (int64_t am = 0; am < nA; ++am)
          packed::packA(wp + am * perMat * kk, kk, perMat, kk,
                        pw.data() + am * packed::packedASize(perMat, kk));
      }
    }
    int64_t qb = std::max<int64_t>(16, (int64_t(1) << 18) / kk / 16 * 16);
    qb = direct ? packed::kNc : std::min(qb, size);
    const int64_t blocks = (size + qb - 1) / qb, tasks = nb * blocks;
    auto run = [&](int64_t t0, int64_t t1) {
      T *g = scratch<T>(0, static_cast<size_t>(direct ? packed::bufferSize(kk, 0, qb) : kk * qb));
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t e = task / blocks, q0 = (task % blocks) * qb, qw = std::min(qb, size - q0);
        int64_t offA = 0, offB = 0;
        offsets(e, offA, offB);
        const T *bm = b + offB * k * n, *w = wp + offA * perMat * kk;
        if constexpr (std::is_same_v<T, float>)
          if (direct)
            packed::gemm(pw.data() + offA * packed::packedASize(perMat, kk), perMat, kk, bm, *gw,
                         q0, q0 + qw, dtable + e * perMat * size, g);
        for (int64_t o = 0; o < k && !direct; ++o)
          for (int64_t t = 0; t < taps; ++t) {
            T *row = g + (o * taps + t) * qw;
            for (const TapInverse::Segment &sg : tapInv.taps[t]) {
              const int64_t lo = std::max(sg.q, q0), hi = std::min(sg.q + sg.len, q0 + qw);
              if (lo >= hi)
                continue;
              T *dst = row + (lo - q0);
              if (sg.from < 0) {
                std::fill_n(dst, hi - lo, T(0));
              } else if (!transB) {
                std::memcpy(dst, bm + o * ldb + sg.from + (lo - sg.q), (hi - lo) * sizeof(T));
              } else {
                for (int64_t j = 0; j < hi - lo; ++j)
                  dst[j] = bm[(sg.from + (lo - sg.q) + j) * ldb + o];
              }
            }
          }
        T *out = dtable + e * perMat * size + q0;
        if (!direct)
          gemm(false, false, perMat, qw, kk, T(1), w, kk, g, qw, T(0), out, size);
        // The second and later pixels of a tap on one position (the
        // padding element): their op(B) columns summed per (position, tap),
        // then one product with the tap's weights.
        auto it =
            std::lower_bound(tapInv.extra.begin(), tapInv.extra.end(), q0,
                             [](const std::array<int64_t, 3> &x, int64_t q) { return x[2] < q; });
        T *col = scratch<T>(1, static_cast<size_t>(k));
        while (it != tapInv.extra.end() && (*it)[2] < q0 + qw) {
          const int64_t t = (*it)[0], q = (*it)[2];
          std::fill_n(col, k, T(0));
          for (; it != tapInv.extra.end() && (*it)[0] == t && (*it)[2] == q; ++it) {
            const int64_t p = (*it)[1];
            for (int64_t o = 0; o < k; ++o)
              col[o] += transB ? bm[p * ldb + o] : bm[o * ldb + p];
          }
          for (int64_t c = 0; c < perMat; ++c) {
            T sum = 0;
            for (int64_t o = 0; o < k; ++o)
              sum += w[c * kk + o * taps + t] * col[o];
            dtable[(e * perMat + c) * size + q] += sum;
          }
        }
      }
    };
    if (tasks >= 2 * omp_get_max_threads() || direct)
      parallelRange(tasks, 2, run);
    else
      run(0, tasks);
    return;
  }
  const std::vector<Run> runs = runsOf(idx, ni, size);
  // A block of table rows per task: their product rows (at most 64K
  // elements, a quarter of a core's L2) go from the GEMM to the table while
  // they are in cache; the product is never whole in memory.
  const int64_t rowsPer =
      std::clamp<int64_t>((int64_t(1) << 16) / std::max<int64_t>(ni, 1), 1, perMat);
  const int64_t blocks = (perMat + rowsPer - 1) / rowsPer, tasks = nb * blocks;
  // With the packed GEMM (float, dY not transposed): dY a plain matrix
  // packed into its panels, the block's rows of op(A) packed per task. Only
  // with AVX-512: with AVX2 its 6 x 16 tiles ran these products at 0.88-0.99x
  // OpenBLAS's (bench/conv_packed_probe.cpp, docs/performance.md).
  bool direct = false;
  std::optional<packed::Windows> plain;
  if constexpr (std::is_same_v<T, float>) {
    if (packed::kWide && gPackedGemm && !transB && ldb == n) {
      direct = true;
      plain.emplace(packed::Windows::matrix(n));
    }
  }
  auto run = [&](int64_t t0, int64_t t1) {
    T *block = scratch<T>(0, static_cast<size_t>(rowsPer * ni));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = t / blocks, r0 = (t % blocks) * rowsPer;
      const int64_t rows = std::min(rowsPer, perMat - r0);
      int64_t offA = 0, offB = 0;
      offsets(e, offA, offB);
      const T *am = a + offA * m * k, *bm = b + offB * k * n;
      // Rows r0 * taps.. of op(A): a row offset, or a column one when A is
      // stored transposed.
      const T *ar0 = transA ? am + r0 * taps : am + r0 * taps * lda;
      if constexpr (std::is_same_v<T, float>) {
        if (direct) {
          float *pa = scratch<float>(1, packed::packedASize(rows * taps, k) +
                                            packed::bufferSize(k, 0, packed::kNc));
          float *buf = pa + packed::packedASize(rows * taps, k);
          packed::packA(ar0, lda, rows * taps, k, pa, transA);
          for (int64_t j0 = 0; j0 < n; j0 += packed::kNc)
            packed::gemm(pa, rows * taps, k, bm, *plain, j0, std::min(n, j0 + packed::kNc), block,
                         buf);
        }
      }
      if (!direct)
        gemm(transA, transB, rows * taps, n, k, T(1), ar0, lda, bm, ldb, T(0), block, n);
      // As gather_grad adds: zeros, then the indices in order.
      for (int64_t r = 0; r < rows; ++r) {
        T *dst = dtable + (e * perMat + r0 + r) * size;
        const T *src = block + r * ni;
        std::fill_n(dst, size, T(0));
        if (!runs.empty()) {
          addRuns(dst, src, runs);
        } else {
          for (int64_t q = 0; q < ni; ++q)
            dst[idx[q] < 0 ? idx[q] + size : idx[q]] += src[q];
        }
      }
    }
  };
  // Tasks across the threads, each GEMM on its calling thread, where there
  // are enough of them (or the GEMM is carve's own, on its calling thread
  // anyway); otherwise one at a time, OpenBLAS threading each.
  if (tasks >= 2 * omp_get_max_threads() || direct)
    parallelRange(tasks, 2, run);
  else
    run(0, tasks);
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

//===--- Instantiations ---------------------------------------------------===//

#define CARVE_FLOATING(T)                                                                          \
  template void matmul<T>(const T *, Dims, bool, const T *, Dims, bool, T *, Dims, bool);          \
  template void matmul_gather_grad<T>(const T *, Dims, bool, const T *, Dims, bool, Dims,          \
                                      const int64_t *, Dims, T *, Dims);                           \
  template void matmul_gathered<T>(const T *, Dims, bool, const T *, Dims, const int64_t *, Dims,  \
                                   Dims, bool, T *, Dims);                                         \
  template void attention<T>(const T *, Dims, const T *, Dims, const T *, Dims, const T *, Dims,   \
                             T, bool, T *);                                                        \
  template void attention_grad<T>(const T *, Dims, const T *, Dims, const T *, Dims, const T *,    \
                                  Dims, T, bool, const T *, T *, T *, T *);
CARVE_FLOATING(float)
CARVE_FLOATING(double)
#undef CARVE_FLOATING

} // namespace carve::rt
