//===- kernels_norm.cpp - layer and RMS normalization ---------------------===//
//
// layer_norm and rms_norm of kernels.h with their gradients; row statistics
// in double, per-thread partial sums of the parameter gradients. And rotary
// (the position embedding, per row of the last dimension) with its gradient. The habits
// every kernel file keeps: kernels_loops.h.
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

#include "kernels_loops.h"

#include <algorithm>
#include <cmath>

namespace carve::rt {

namespace {

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

} // namespace

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

//===--- Rotary position embedding ----------------------------------------===//

namespace {

/// Element strides of a tensor of shape `ts` broadcast to `xs` (0 along its
/// dimensions of 1 and the ones it lacks), right-aligned.
void broadcastStrides(const Dims &ts, const Dims &xs, const char *op, const char *what,
                      int64_t *st) {
  if (ts.rank > xs.rank)
    fatal("%s: %s of rank %d does not broadcast to the input's rank %d", op, what, ts.rank,
          xs.rank);
  int64_t stride = 1;
  for (int i = xs.rank - 1; i >= 0; --i) {
    const int k = i - (xs.rank - ts.rank);
    const int64_t dim = k >= 0 ? ts.d[k] : 1;
    if (dim != 1 && dim != xs.d[i])
      fatal("%s: %s dimension %d of size %lld does not broadcast to %lld", op, what, k,
            (long long)dim, (long long)xs.d[i]);
    st[i] = dim == 1 ? 0 : stride;
    stride *= dim;
  }
}

/// f(row, x row offset, cos row offset, sin row offset, cos and sin strides
/// along the last dimension) for each row of the last dimension.
template <class F>
void forRotaryRows(const char *op, const Dims &xs, const Dims &cs, const Dims &ss, F f) {
  if (xs.rank < 1 || xs.d[xs.rank - 1] % 2 != 0)
    fatal("%s: the input's last dimension must be even", op);
  int64_t cst[kMaxRank], sst[kMaxRank];
  broadcastStrides(cs, xs, op, "cos", cst);
  broadcastStrides(ss, xs, op, "sin", sst);
  const int64_t d = xs.d[xs.rank - 1], rows = d ? xs.numel() / d : 0;
  parallelRange(rows, kParallelMin / std::max<int64_t>(d, 1), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      int64_t co = 0, so = 0, rest = r;
      for (int i = xs.rank - 2; i >= 0; --i) {
        const int64_t at = rest % xs.d[i];
        rest /= xs.d[i];
        co += at * cst[i];
        so += at * sst[i];
      }
      f(r * d, co, so, cst[xs.rank - 1], sst[xs.rank - 1]);
    }
  });
}

} // namespace

template <class T>
void rotary(const T *x, Dims xs, const T *cos, Dims cs, const T *sin, Dims ss, T *y) {
  const int64_t d = xs.rank ? xs.d[xs.rank - 1] : 0, h = d / 2;
  forRotaryRows("rotary", xs, cs, ss,
                [&](int64_t xo, int64_t co, int64_t so, int64_t cj, int64_t sj) {
                  const T *xr = x + xo;
                  T *yr = y + xo;
                  for (int64_t j = 0; j < d; ++j) {
                    const T rh = j < h ? -xr[j + h] : xr[j - h];
                    const T a = xr[j] * cos[co + j * cj], b = rh * sin[so + j * sj];
                    yr[j] = a + b;
                  }
                });
}

template <class T>
void rotary_grad(const T *dy, Dims xs, const T *cos, Dims cs, const T *sin, Dims ss, T *dx) {
  const int64_t d = xs.rank ? xs.d[xs.rank - 1] : 0, h = d / 2;
  forRotaryRows("rotary_grad", xs, cs, ss,
                [&](int64_t xo, int64_t co, int64_t so, int64_t cj, int64_t sj) {
                  const T *g = dy + xo;
                  T *out = dx + xo;
                  for (int64_t j = 0; j < d; ++j) {
                    // (dy * sin) at the element rotate_half moved here.
                    const int64_t k = j < h ? j + h : j - h;
                    const T z = g[k] * sin[so + k * sj];
                    const T t = j < h ? T(0) + z : -z + T(0);
                    const T c = g[j] * cos[co + j * cj];
                    out[j] = t + c;
                  }
                });
}

//===--- Instantiations ---------------------------------------------------===//

#define CARVE_FLOATING(T)                                                                          \
  template void layer_norm<T>(const T *, Dims, int, const T *, const T *, T, T *);                 \
  template void layer_norm_grad<T>(const T *, Dims, int, const T *, T, const T *, T *, T *, T *);  \
  template void rms_norm<T>(const T *, Dims, int, const T *, T, T *);                              \
  template void rms_norm_grad<T>(const T *, Dims, int, const T *, T, const T *, T *, T *);         \
  template void rotary<T>(const T *, Dims, const T *, Dims, const T *, Dims, T *);                 \
  template void rotary_grad<T>(const T *, Dims, const T *, Dims, const T *, Dims, T *);
CARVE_FLOATING(float)
CARVE_FLOATING(double)
#undef CARVE_FLOATING

} // namespace carve::rt
