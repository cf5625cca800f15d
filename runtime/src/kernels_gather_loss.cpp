//===- kernels_gather_loss.cpp - gather, embeddings and cross-entropy -----===//
//
// gather and gather_grad (embedding lookups among them) and cross_entropy of
// kernels.h, and their vocab-parallel forms of dist.h, which share the serial
// kernels' arithmetic. The habits every kernel file keeps: kernels_loops.h.
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

#include "carve/rt/dist.h"
#include "carve/rt/elementwise.h"
#include "kernels_loops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace carve::rt {

namespace {

using ew::fexp;

} // namespace

//===--- Gather -----------------------------------------------------------===//

template <class T>
void gather(const T *table, Dims ts, const int64_t *idx, Dims is, int axis, T *y) {
  axis = normAxis(axis, ts.rank, "gather");
  const int64_t outer = prod(ts, 0, axis), size = ts.d[axis], inner = prod(ts, axis + 1, ts.rank);
  const int64_t ni = is.numel();
  checkIndices("gather", idx, ni, axis, size);
  if (outer * ni * inner == 0)
    return;
  if (inner == 1 && outer > 1) {
    const std::vector<Run> runs = runsOf(idx, ni, size);
    if (!runs.empty()) {
      parallelRange(outer, unitsFor(ni), [&](int64_t b, int64_t e) {
        for (int64_t o = b; o < e; ++o) {
          const T *src = table + o * size;
          T *dst = y + o * ni;
          for (const Run &r : runs)
            std::memcpy(dst + r.k, src + r.from, r.len * sizeof(T));
        }
      });
      return;
    }
  }
  parallelRange(outer * ni, unitsFor(inner), [&](int64_t b, int64_t e) {
    // (o, k) walk along with t: no division per element (im2col gathers
    // single elements, inner == 1, by the million).
    int64_t o = b / ni, k = b % ni;
    for (int64_t t = b; t < e; ++t) {
      const int64_t v = idx[k] < 0 ? idx[k] + size : idx[k];
      const T *src = table + (o * size + v) * inner;
      if (inner == 1)
        y[t] = *src;
      else
        std::memcpy(y + t * inner, src, inner * sizeof(T));
      if (++k == ni) {
        k = 0;
        ++o;
      }
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
  if (inner == 1 && outer > 1) {
    const std::vector<Run> runs = runsOf(idx, ni, size);
    if (!runs.empty()) {
      // A task owns whole rows of the table, and adds the runs in index
      // order: the same sums in the same order as the loop below.
      parallelRange(outer, unitsFor(ni), [&](int64_t b, int64_t e) {
        for (int64_t o = b; o < e; ++o)
          addRuns(dtable + o * size, dy + o * ni, runs);
      });
      return;
    }
  }
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
    fatal("%s: local rows [%lld, %lld) are outside the table's %lld rows", op, (long long)rowOffset,
          (long long)(rowOffset + ts.d[0]), (long long)globalRows);
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
  vpCheckTargets(op, g, targets, hasIgnore, ignoreIndex, vocabOffset, static_cast<int64_t>(acc[e]));
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
              : reduction == 2               ? static_cast<double>(dy[e0 + u])
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

template <class T>
void count_correct(Communicator *c, const T *logits, Dims ls, int64_t vocabOffset,
                   const int64_t *targets, bool hasIgnore, int64_t ignoreIndex, double *counts) {
  if (ls.rank < 2)
    fatal("count_correct: logits of rank %d (need [N, C, ...])", ls.rank);
  const int64_t n = ls[0], cl = ls[1], s = ls.numel() / std::max<int64_t>(n * cl, 1);
  const int64_t e = n * s;
  // [row maxima | target logits (-inf where this rank does not hold the target)].
  std::vector<float> stats(static_cast<size_t>(2 * e));
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < e; ++r) {
    const int64_t i = r / s, u = r % s;
    const T *base = logits + i * cl * s + u;
    T mx = -std::numeric_limits<T>::infinity();
    for (int64_t k = 0; k < cl; ++k)
      mx = std::max(mx, base[k * s]);
    const int64_t t = targets[r] - vocabOffset;
    stats[r] = static_cast<float>(mx);
    stats[e + r] = t >= 0 && t < cl ? static_cast<float>(base[t * s])
                                    : -std::numeric_limits<float>::infinity();
  }
  if (c && e > 0)
    c->allReduce(stats.data(), 2 * e, CommType::F32, ReduceOp::Max);
  for (int64_t r = 0; r < e; ++r) {
    if (hasIgnore && targets[r] == ignoreIndex)
      continue;
    counts[1] += 1;
    counts[0] += stats[e + r] >= stats[r] ? 1 : 0;
  }
}

//===--- Instantiations ---------------------------------------------------===//

#define CARVE_FLOATING(T)                                                                          \
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
                                                     const T *, T *);                              \
  template void count_correct<T>(Communicator *, const T *, Dims, int64_t, const int64_t *, bool,  \
                                 int64_t, double *);
CARVE_FLOATING(float)
CARVE_FLOATING(double)
#undef CARVE_FLOATING

//===--- NonZero ----------------------------------------------------------===//

template <class T> void nonzero(const T *x, Dims xs, int64_t *y) {
  const int64_t n = xs.numel();
  std::fill(y, y + xs.rank * n, int64_t(0));
  int64_t j = 0;
  for (int64_t e = 0; e < n; ++e) {
    if (x[e] == T(0))
      continue;
    for (int64_t d = xs.rank - 1, rest = e; d >= 0; --d) {
      y[d * n + j] = rest % xs.d[d];
      rest /= xs.d[d];
    }
    ++j;
  }
}

#define CARVE_GATHER(T)                                                                            \
  template void gather<T>(const T *, Dims, const int64_t *, Dims, int, T *);                       \
  template void gather_grad<T>(const T *, const int64_t *, Dims, int, T *, Dims);                  \
  template void nonzero<T>(const T *, Dims, int64_t *);
CARVE_GATHER(float)
CARVE_GATHER(double)
CARVE_GATHER(int64_t)
CARVE_GATHER(int32_t)
CARVE_GATHER(uint8_t)
#undef CARVE_GATHER

} // namespace carve::rt
