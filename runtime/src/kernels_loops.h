//===- kernels_loops.h - what the CPU kernel files share ------------------===//
//
// The parallel loops, per-thread scratch and shape helpers of the kernels_*.cpp
// files (the implementations behind kernels.h and the vocab-parallel kernels
// of dist.h). Private to them. Habits that hold throughout:
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

#ifndef CARVE_RT_SRC_KERNELS_LOOPS_H
#define CARVE_RT_SRC_KERNELS_LOOPS_H

#include "carve/rt/kernels.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace carve::rt {

//===--- Parallel loops and scratch ---------------------------------------===//

/// Below this many elements of work a kernel stays on the calling thread:
/// starting the OpenMP team costs more than the loop.
constexpr int64_t kParallelMin = 32768;

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
inline int64_t unitsFor(int64_t work) {
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

//===--- Shapes -----------------------------------------------------------===//

/// The product of dimensions [lo, hi) of s.
inline int64_t prod(const Dims &s, int lo, int hi) {
  int64_t n = 1;
  for (int i = lo; i < hi; ++i)
    n *= s.d[i];
  return n;
}

inline int normAxis(int axis, int rank, const char *op) {
  if (axis < 0)
    axis += rank;
  if (axis < 0 || axis >= rank)
    fatal("%s: axis %d is out of range for rank %d", op, axis, rank);
  return axis;
}

//===--- Gathers of single elements --------------------------------------===//

/// Checks the indices of a gather along an axis of size `size`.
inline void checkIndices(const char *op, const int64_t *idx, int64_t n, int axis, int64_t size) {
  for (int64_t i = 0; i < n; ++i)
    if (idx[i] < -size || idx[i] >= size)
      fatal("%s: index %lld is out of range for axis %d of size %lld", op, (long long)idx[i], axis,
            (long long)size);
}

/// Runs of consecutive positions in the indices of a gather of single
/// elements (inner == 1): index k starts a run of `len` with idx[k + j] ==
/// idx[k] + j. im2col's indices are such runs (a window tap's row along the
/// output pixels, stride 1), so its gather copies and its gradient adds
/// whole runs, vectorized, instead of one element per index. Empty when
/// the runs average under 4 (then the loop per element is as good).
struct Run {
  int64_t k, len, from;
};
inline std::vector<Run> runsOf(const int64_t *idx, int64_t ni, int64_t size) {
  std::vector<Run> runs;
  for (int64_t k = 0; k < ni;) {
    const int64_t from = idx[k] < 0 ? idx[k] + size : idx[k];
    int64_t len = 1;
    while (k + len < ni && (idx[k + len] < 0 ? idx[k + len] + size : idx[k + len]) == from + len)
      ++len;
    runs.push_back({k, len, from});
    k += len;
  }
  if ((int64_t)runs.size() * 4 > ni)
    runs.clear();
  return runs;
}

/// dst[r.from + j] += src[r.k + j] for every run, in order (the sums of one
/// table row of gather_grad).
template <class T> void addRuns(T *dst, const T *src, const std::vector<Run> &runs) {
  for (const Run &r : runs) {
    T *d = dst + r.from;
    const T *g = src + r.k;
#pragma omp simd
    for (int64_t j = 0; j < r.len; ++j)
      d[j] += g[j];
  }
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

} // namespace carve::rt

#endif // CARVE_RT_SRC_KERNELS_LOOPS_H
