//===- kernels_movement.cpp - transpose, slice, concat and expand ---------===//
//
// The data-movement kernels of kernels.h: strided views copied into
// contiguous results (tiled for transposes) and back for slice_grad. The
// habits every kernel file keeps: kernels_loops.h.
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
#include <cstring>

namespace carve::rt {

namespace {

using ew::broadcastNest;
using ew::forRange;
using ew::Nest;
using ew::sliceNest;
using ew::transposeNest;

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

} // namespace

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

template <class T> void expand(const T *x, Dims xs, T *y, Dims ys) {
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  const Dims in[1] = {xs};
  gatherView(x, broadcastNest<1>("expand", in, ys), y, total);
}

//===--- Instantiations ---------------------------------------------------===//

#define CARVE_MOVE(T)                                                                              \
  template void transpose<T>(const T *, Dims, Dims, T *);                                          \
  template void slice<T>(const T *, Dims, Dims, Dims, T *, Dims);                                  \
  template void slice_grad<T>(const T *, Dims, Dims, Dims, T *, Dims);                             \
  template void concat<T>(int, const T *const *, const Dims *, int, T *);                          \
  template void expand<T>(const T *, Dims, T *, Dims);
CARVE_MOVE(float)
CARVE_MOVE(double)
CARVE_MOVE(int64_t)
CARVE_MOVE(int32_t)
CARVE_MOVE(uint8_t)
#undef CARVE_MOVE

} // namespace carve::rt
