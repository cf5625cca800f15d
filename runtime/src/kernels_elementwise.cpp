//===- kernels_elementwise.cpp - elementwise, comparison and cast kernels -===//
//
// unary, binary, compare, logic, where, cast, fill and copy of kernels.h: maps
// over contiguous or broadcast operands that call the scalar functions of
// elementwise.h, as fused generated code does. The habits every kernel file
// keeps: kernels_loops.h.
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
#include "carve/rt/fused.h"
#include "carve/rt/philox.h"
#include "kernels_loops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

namespace carve::rt {

namespace {

/// Elementwise work with a transcendental function per element pays for the
/// team sooner.
constexpr int64_t kParallelMinHeavy = 4096;

using ew::broadcastNest;
using ew::forRange;
using ew::Nest;

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

namespace {
/// y[i] = f(x[i]) over the threads (y may be x).
template <class In, class Out, class F> void mapElements(const In *x, Out *y, int64_t n, F f) {
  parallelRange(n, kParallelMin, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      y[i] = f(x[i]);
  });
}
} // namespace

void roundBf16(float *x, int64_t n) {
  mapElements(x, x, n, [](float v) { return ew::roundBf16(v); });
}
void roundF16(float *x, int64_t n) {
  mapElements(x, x, n, [](float v) { return ew::roundF16(v); });
}
void toBf16(const float *x, uint16_t *y, int64_t n) {
  mapElements(x, y, n, [](float v) { return ew::bf16Bits(v); });
}
void fromBf16(const uint16_t *x, float *y, int64_t n) {
  mapElements(x, y, n, [](uint16_t v) { return ew::bf16Float(v); });
}
void toF16(const float *x, uint16_t *y, int64_t n) {
  mapElements(x, y, n, [](float v) { return ew::f16Bits(v); });
}
void fromF16(const uint16_t *x, float *y, int64_t n) {
  mapElements(x, y, n, [](uint16_t v) { return ew::f16Float(v); });
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

template <class T>
void dropout(const T *x, const philox::DropoutPiece &piece, double p, uint64_t seed, int64_t step,
             int64_t node, T *y) {
  const int64_t n = piece.dims.numel();
  if (p <= 0)
    return copy(x, y, n);
  if (!(p < 1))
    fatal("dropout: p = %g is outside [0, 1)", p);
  const int last = piece.dims.rank - 1;
  const int64_t cols = last >= 0 ? piece.dims.d[last] : 1, rows = cols ? n / cols : 0;
  // Along the last dimension the full index runs on by one, unless the
  // dimension is split (tp) or holds the batch.
  const bool contiguous = last < 0 || (last != piece.tpDim && last != piece.batchDim);
  const T scale = (T)philox::dropoutScale(p);
  const float pf = (float)p;
  const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  parallelRange(rows, std::max<int64_t>(1, kParallelMinHeavy / std::max<int64_t>(1, cols)),
                [&](int64_t b, int64_t e) {
                  uint64_t block = ~0ull;
                  philox::Words4 words{};
                  for (int64_t r = b; r < e; ++r) {
                    const uint64_t base = contiguous ? philox::fullIndex(piece, r * cols) : 0;
                    for (int64_t c = 0; c < cols; ++c) {
                      const int64_t i = r * cols + c;
                      const uint64_t g = contiguous ? base + c : philox::fullIndex(piece, i);
                      // Four elements share one draw (dropoutKeep's words).
                      if ((g >> 2) != block) {
                        block = g >> 2;
                        words = philox::philox4x32_10(
                            philox::Words4{{(uint32_t)block, (uint32_t)(block >> 32),
                                            (uint32_t)node, (uint32_t)step}},
                            k0, k1);
                      }
                      y[i] = philox::uniform01(words.w[g & 3]) >= pf ? x[i] * scale : T(0);
                    }
                  }
                });
}

//===--- Instantiations ---------------------------------------------------===//

#define CARVE_FLOATING(T)                                                                          \
  template void unary<T>(Unary, const T *, T *, int64_t);                                          \
  template void unary_grad<T>(Unary, const T *, const T *, T *, int64_t);                          \
  template void dropout<T>(const T *, const philox::DropoutPiece &, double, uint64_t, int64_t,     \
                           int64_t, T *);
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
  template void copy<T>(const T *, T *, int64_t);
CARVE_MOVE(float)
CARVE_MOVE(double)
CARVE_MOVE(int64_t)
CARVE_MOVE(int32_t)
CARVE_MOVE(uint8_t)
#undef CARVE_MOVE
// 16-bit floats' bits (a 16-bit gradient into its slot).
template void copy<uint16_t>(const uint16_t *, uint16_t *, int64_t);

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

//===--- Fused chains (fused.h) -------------------------------------------===//

void fusedRun(const char *what, int ni, int no, const float *const *in, const Dims *shapes,
              float *const *out, const Dims &ys, const void *f, FusedRun contiguous,
              FusedRun strided) {
  if (ni < 1 || ni > kMaxFusedInputs || no < 1 || no > kMaxFusedOutputs)
    fatal("%s: %d inputs and %d outputs (a fused chain has 1 to %d and 1 to %d)", what, ni, no,
          kMaxFusedInputs, kMaxFusedOutputs);
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  // The slots past ni as scalars: stride 0 everywhere, so they neither move
  // nor keep dimensions from merging.
  Dims padded[kMaxFusedInputs];
  for (int k = 0; k < ni; ++k)
    padded[k] = shapes[k];
  const Nest<kMaxFusedInputs> n = broadcastNest<kMaxFusedInputs>(what, padded, ys);
  bool allContiguous = true;
  for (int k = 0; k < ni; ++k)
    allContiguous = allContiguous && n.inner(k) == 1;
  const FusedRun body = allContiguous ? contiguous : strided;
  int64_t inner[kMaxFusedInputs];
  for (int k = 0; k < ni; ++k)
    inner[k] = n.inner(k);
  const int64_t traffic = total * (ni + no);
  parallelRange(total, traffic < 2 * kParallelMin ? total + 1 : 2, [&](int64_t e0, int64_t e1) {
    forRange(n, e0, e1, [&](const int64_t *off, int64_t e, int64_t len) {
      const float *p[kMaxFusedInputs];
      float *q[kMaxFusedOutputs];
      for (int k = 0; k < ni; ++k)
        p[k] = in[k] + off[k];
      for (int j = 0; j < no; ++j)
        q[j] = out[j] + e;
      body(f, p, inner, q, len);
    });
  });
}

} // namespace carve::rt
