//===- kernels_reduce.cpp - reductions and softmax ------------------------===//
//
// reduce (sum, mean, max over any axes), softmax and log-softmax and their
// gradients, of kernels.h; sums in double. The habits every kernel file keeps:
// kernels_loops.h.
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

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

namespace carve::rt {

namespace {

using ew::fexp;
using ew::maxNan;

} // namespace

//===--- Reductions -------------------------------------------------------===//

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
  const int64_t inLen = rd[nr - 1], inStride = rs[nr - 1];
  // The innermost reduced run is one strided span; the outer reduced runs
  // step through an odometer. A contiguous run of 32 or more (batch norm's
  // H*W) is summed vectorized, as reduceORI's rows (shorter ones lose more
  // to the call than they gain; a separate instantiation keeps their loop).
  auto walk = [&](auto spans) {
    parallelRange(outCount, unitsFor(redCount), [&](int64_t b, int64_t e) {
      for (int64_t o = b; o < e; ++o) {
        int64_t base = 0, rem = o;
        for (int i = no - 1; i >= 0; --i) {
          base += (rem % od[i]) * os[i];
          rem /= od[i];
        }
        int64_t idx[kMaxRank] = {};
        double acc = identity(f);
        for (;;) {
          int64_t off = base;
          for (int i = 0; i < nr - 1; ++i)
            off += idx[i] * rs[i];
          const T *p = x + off;
          if constexpr (decltype(spans)::value) {
            acc = combine(f, acc, reduceSpan(f, p, inLen));
          } else if (f == Reduce::Max) {
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
  };
  if (inStride == 1 && inLen >= 32)
    walk(std::true_type{});
  else
    walk(std::false_type{});
}

//===--- Softmax ----------------------------------------------------------===//

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

//===--- Instantiations ---------------------------------------------------===//

#define CARVE_FLOATING(T)                                                                          \
  template void reduce<T>(Reduce, const T *, Dims, uint32_t, T *);                                 \
  template void softmax<T>(const T *, Dims, int, bool, T *);                                       \
  template void softmax_grad<T>(const T *, const T *, Dims, int, bool, T *);
CARVE_FLOATING(float)
CARVE_FLOATING(double)
#undef CARVE_FLOATING

} // namespace carve::rt
