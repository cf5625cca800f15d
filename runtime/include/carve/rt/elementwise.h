//===- elementwise.h - scalar functions and broadcast nests, host and device -===//
//
// The one definition of every elementwise function (unary, its gradient,
// binary) and of the broadcast loop nests, shared by
//  - the CPU kernels (runtime/src/kernels_*.cpp),
//  - the CUDA kernels (runtime/cuda/kernels_basic.cu, kernels_data.cu),
//  - the fused elementwise kernels that generated programs define (fused.h
//    and gpu_fused.cuh): a chain such as bias-add + GELU runs as one pass over
//    memory, calling these same functions, so a fused CPU program computes
//    bit for bit what the unfused one does.
//
// Host code (any compiler) uses branch-free float approximations of exp,
// tanh and erf that vectorize (within a few ulp, like the SIMD functions
// PyTorch calls) and the C library for double; device code (nvcc compiling
// for the GPU) uses CUDA's float functions.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_ELEMENTWISE_H
#define CARVE_RT_ELEMENTWISE_H

#include "carve/rt/kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__CUDACC__)
#define CARVE_HD __host__ __device__ __forceinline__
#else
#define CARVE_HD [[gnu::always_inline]] inline
#endif

namespace carve::rt::ew {

//===--- Host float math that vectorizes ----------------------------------===//

#if !defined(__CUDA_ARCH__)
/// e^x (Cephes expf: 2^n e^r with |r| <= ln2/2 and a degree-6 polynomial,
/// about 1 ulp, subnormal results included); 0 and inf where the result
/// underflows and overflows. Branch-free so that loops calling it vectorize.
[[gnu::always_inline]] inline float vexp(float x) {
  constexpr float kLo = -103.972076f, kHi = 88.72283905f;
  // NaN takes the path of 0 (float-to-int of NaN is undefined) and is put
  // back at the end.
  float xc = x < kLo ? kLo : x;
  xc = xc > kHi ? kHi : xc;
  xc = x != x ? 0.0f : xc;
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // Scale by 2^n in two halves: n spans [-150, 128], past the exponent
  // range of one float at either end.
  const int32_t ni = static_cast<int32_t>(n), n1 = ni >> 1, n2 = ni - n1;
  const uint32_t b1 = static_cast<uint32_t>(n1 + 127) << 23;
  const uint32_t b2 = static_cast<uint32_t>(n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, sizeof s1);
  std::memcpy(&s2, &b2, sizeof s2);
  float res = p * s1 * s2;
  res = x < kLo ? 0.0f : res;
  res = x > kHi ? std::numeric_limits<float>::infinity() : res;
  return x != x ? x : res;
}

/// tanh(x) (Cephes tanhf: an odd polynomial below |x| = 0.625, 1 - 2/(e^2|x| + 1)
/// above; a few ulp).
[[gnu::always_inline]] inline float vtanh(float x) {
  const float ax = std::fabs(x);
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = p * z * x + x;
  const float axc = ax > 44.0f ? 44.0f : ax;
  float big = 1.0f - 2.0f / (vexp(2.0f * axc) + 1.0f);
  big = x < 0 ? -big : big;
  return ax < 0.625f ? small : big;
}

/// erf(x): x P(x^2) / Q(x^2) on [-4, 4] (odd degree 13 over even degree 8),
/// +-1 beyond; a few ulp.
[[gnu::always_inline]] inline float verf(float x) {
  float xc = x < -4.0f ? -4.0f : x;
  xc = xc > 4.0f ? 4.0f : xc;
  const float z = xc * xc;
  float p = -2.72614225801306e-10f;
  p = p * z + 2.77068142495902e-08f;
  p = p * z - 2.10102402082508e-06f;
  p = p * z - 5.69250639462346e-05f;
  p = p * z - 7.34990630326855e-04f;
  p = p * z - 2.95459980854025e-03f;
  p = p * z - 1.60960333262415e-02f;
  float q = -1.45660718464996e-05f;
  q = q * z - 2.13374055278905e-04f;
  q = q * z - 1.68282697438203e-03f;
  q = q * z - 7.37332916720468e-03f;
  q = q * z - 1.42647390514189e-02f;
  return xc * p / q;
}
#endif

//===--- 16-bit formats, host or device -----------------------------------===//
//
// The bits of bf16 and fp16 (IEEE binary16) values and the rounding of a
// float to them: round to nearest even, NaN stays NaN, fp16 overflows to
// infinity from 65520 on and has subnormals down to 2^-24. Integer code, so
// the CPU and the GPU compute the same bits. Used by matmul's input rounding
// (kernels.h roundToBf16/roundToF16), by the values a bf16/fp16 plan rounds
// as it writes them (carve.round16) and by their 16-bit copies.

CARVE_HD uint32_t floatBits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
CARVE_HD float bitsFloat(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
CARVE_HD uint16_t bf16Bits(float x) {
  uint32_t u = floatBits(x);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) // NaN: keep it quiet
    return (uint16_t)((u >> 16) | 0x0040u);
  u += 0x7FFFu + ((u >> 16) & 1u); // round to nearest even; carries into the exponent
  return (uint16_t)(u >> 16);
}
CARVE_HD float bf16Float(uint16_t h) { return bitsFloat((uint32_t)h << 16); }
CARVE_HD uint16_t f16Bits(float x) {
  const uint32_t u = floatBits(x), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) // infinity, or NaN kept quiet
    return (uint16_t)(sign | 0x7C00u | (a > 0x7F800000u ? 0x0200u | ((a >> 13) & 0x3FFu) : 0u));
  if (a >= 0x477FF000u) // 65520 and up round to infinity
    return (uint16_t)(sign | 0x7C00u);
  if (a >= 0x38800000u) { // a normal fp16 (2^-14 and up): rebias the exponent 127 -> 15
    uint32_t r = a - 0x38000000u;
    r += 0xFFFu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
  }
  if (a <= 0x33000000u) // 2^-25 and below: zero (2^-25 is the tie, to the even zero)
    return (uint16_t)sign;
  // Subnormal: the value is m * 2^(e - 150) = h * 2^-24, so h = m >> (126 - e).
  const uint32_t e = a >> 23, m = (a & 0x7FFFFFu) | 0x800000u, s = 126u - e;
  uint32_t h = m >> s;
  const uint32_t rest = m & ((1u << s) - 1u), half = 1u << (s - 1u);
  if (rest > half || (rest == half && (h & 1u)))
    ++h; // 1024 is the smallest normal's bits: correct
  return (uint16_t)(sign | h);
}
CARVE_HD float f16Float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu;
  uint32_t m = h & 0x3FFu;
  if (e == 0x1Fu)
    return bitsFloat(sign | 0x7F800000u | (m << 13));
  if (e)
    return bitsFloat(sign | ((e + 112u) << 23) | (m << 13));
  if (!m)
    return bitsFloat(sign);
  uint32_t k = 0; // subnormal: normalize
  while (!(m & 0x400u))
    m <<= 1, ++k;
  return bitsFloat(sign | ((113u - k) << 23) | ((m & 0x3FFu) << 13));
}
CARVE_HD float roundBf16(float x) { return bf16Float(bf16Bits(x)); }
CARVE_HD float roundF16(float x) { return f16Float(f16Bits(x)); }

//===--- Math, host or device ---------------------------------------------===//

#if defined(__CUDA_ARCH__)
#define CARVE_EW_MATH(NAME, F32, F64)                                                              \
  template <class T> CARVE_HD T NAME(T x) {                                                        \
    if constexpr (std::is_same_v<T, float>)                                                        \
      return F32(x);                                                                               \
    else                                                                                           \
      return F64(x);                                                                               \
  }
CARVE_EW_MATH(fexp, expf, exp)
CARVE_EW_MATH(ftanh, tanhf, tanh)
CARVE_EW_MATH(ferf, erff, erf)
CARVE_EW_MATH(flog, logf, log)
CARVE_EW_MATH(fsqrt, sqrtf, sqrt)
CARVE_EW_MATH(fabs_, fabsf, fabs)
CARVE_EW_MATH(fsin, sinf, sin)
CARVE_EW_MATH(fcos, cosf, cos)
#undef CARVE_EW_MATH
#else
template <class T> CARVE_HD T fexp(T x) {
  if constexpr (std::is_same_v<T, float>)
    return vexp(x);
  else
    return std::exp(x);
}
template <class T> CARVE_HD T ftanh(T x) {
  if constexpr (std::is_same_v<T, float>)
    return vtanh(x);
  else
    return std::tanh(x);
}
template <class T> CARVE_HD T ferf(T x) {
  if constexpr (std::is_same_v<T, float>)
    return verf(x);
  else
    return std::erf(x);
}
template <class T> CARVE_HD T flog(T x) { return std::log(x); }
template <class T> CARVE_HD T fsqrt(T x) { return std::sqrt(x); }
template <class T> CARVE_HD T fabs_(T x) { return std::fabs(x); }
template <class T> CARVE_HD T fsin(T x) { return std::sin(x); }
template <class T> CARVE_HD T fcos(T x) { return std::cos(x); }
#endif

/// max/min that propagate NaN like torch.maximum / torch.minimum.
template <class T> CARVE_HD T maxNan(T a, T b) { return (a != a || a > b) ? a : b; }
template <class T> CARVE_HD T minNan(T a, T b) { return (a != a || a < b) ? a : b; }

/// sqrt(2/pi) and 0.044715 of PyTorch's tanh approximation of GELU.
template <class T> constexpr T kGeluBeta = static_cast<T>(0.79788456080286535588);
template <class T> constexpr T kGeluKappa = static_cast<T>(0.044715);
/// 1/sqrt(2), 2/sqrt(pi), and 1/sqrt(2 pi) (the normal density's constant,
/// computed in double).
template <class T> constexpr T kSqrt1_2 = static_cast<T>(0.70710678118654752440);
template <class T> constexpr T kTwoOverSqrtPi = static_cast<T>(1.12837916709551257390);
template <class T>
constexpr T kNormalPdf = static_cast<T>(1.12837916709551257390 * 0.70710678118654752440 * 0.5);

//===--- The functions ----------------------------------------------------===//

/// f(v).
template <Unary F, class T> CARVE_HD T unary(T v) {
  if constexpr (F == Unary::Neg)
    return -v;
  else if constexpr (F == Unary::Abs)
    return fabs_(v);
  else if constexpr (F == Unary::Exp)
    return fexp(v);
  else if constexpr (F == Unary::Log)
    return flog(v);
  else if constexpr (F == Unary::Sqrt)
    return fsqrt(v);
  else if constexpr (F == Unary::Rsqrt)
    return T(1) / fsqrt(v);
  else if constexpr (F == Unary::Reciprocal)
    return T(1) / v;
  else if constexpr (F == Unary::Tanh)
    return ftanh(v);
  else if constexpr (F == Unary::Erf)
    return ferf(v);
  else if constexpr (F == Unary::Sigmoid)
    return T(1) / (T(1) + fexp(-v));
  else if constexpr (F == Unary::Relu)
    return v < T(0) ? T(0) : v;
  else if constexpr (F == Unary::Sin)
    return fsin(v);
  else if constexpr (F == Unary::Cos)
    return fcos(v);
  else if constexpr (F == Unary::Silu)
    return v / (T(1) + fexp(-v));
  else if constexpr (F == Unary::Gelu)
    return v * T(0.5) * (T(1) + ferf(v * kSqrt1_2<T>));
  else
    return T(0.5) * v * (T(1) + ftanh(kGeluBeta<T> * (v + kGeluKappa<T> * v * v * v)));
}

/// g * f'(v). For Relu and Abs f'(0) = 0 (PyTorch's choices).
template <Unary F, class T> CARVE_HD T unaryGrad(T v, T g) {
  if constexpr (F == Unary::Neg) {
    return -g;
  } else if constexpr (F == Unary::Abs) {
    return v > T(0) ? g : (v < T(0) ? -g : T(0));
  } else if constexpr (F == Unary::Exp) {
    return g * fexp(v);
  } else if constexpr (F == Unary::Log) {
    return g / v;
  } else if constexpr (F == Unary::Sqrt) {
    return g / (T(2) * fsqrt(v));
  } else if constexpr (F == Unary::Rsqrt) {
    const T r = T(1) / fsqrt(v);
    return T(-0.5) * g * r * r * r;
  } else if constexpr (F == Unary::Reciprocal) {
    const T r = T(1) / v;
    return -g * (r * r);
  } else if constexpr (F == Unary::Tanh) {
    const T t = ftanh(v);
    return g * (T(1) - t * t);
  } else if constexpr (F == Unary::Erf) {
    return g * kTwoOverSqrtPi<T> * fexp(-v * v);
  } else if constexpr (F == Unary::Sigmoid) {
    const T s = T(1) / (T(1) + fexp(-v));
    return g * (T(1) - s) * s;
  } else if constexpr (F == Unary::Relu) {
    return v > T(0) ? g : T(0);
  } else if constexpr (F == Unary::Sin) {
    return g * fcos(v);
  } else if constexpr (F == Unary::Cos) {
    return g * -fsin(v);
  } else if constexpr (F == Unary::Silu) {
    const T s = T(1) / (T(1) + fexp(-v));
    return g * s * (T(1) + v * (T(1) - s));
  } else if constexpr (F == Unary::Gelu) {
    const T cdf = T(0.5) * (T(1) + ferf(v * kSqrt1_2<T>));
    const T pdf = kNormalPdf<T> * fexp(v * v * T(-0.5));
    return g * (cdf + v * pdf);
  } else {
    const T x2 = v * v;
    const T inner = kGeluBeta<T> * (v + kGeluKappa<T> * x2 * v);
    const T t = ftanh(inner);
    const T left = T(0.5) * v, right = T(1) + t;
    const T dLeft = T(0.5) * right;
    const T dRight = left * (T(1) - t * t) * kGeluBeta<T> * (T(1) + T(3) * kGeluKappa<T> * x2);
    return g * (dLeft + dRight);
  }
}

/// f(u, v) for every Binary but Pow (whose scalar exponents take special
/// cases; the CPU kernels and kernels_basic.cu handle it).
template <Binary F, class T> CARVE_HD T binary(T u, T v) {
  static_assert(F != Binary::Pow, "pow is not a plain elementwise function here");
  if constexpr (F == Binary::Add)
    return u + v;
  else if constexpr (F == Binary::Sub)
    return u - v;
  else if constexpr (F == Binary::Mul)
    return u * v;
  else if constexpr (F == Binary::Div)
    return u / v;
  else if constexpr (F == Binary::Max)
    return maxNan(u, v);
  else
    return minNan(u, v);
}

//===--- Broadcast loop nests ---------------------------------------------===//

/// A loop nest over a contiguous output whose N operands are read through
/// strides (0 on broadcast dimensions), with size-1 dimensions dropped and
/// neighbours that are contiguous for every operand merged: equal shapes and
/// scalars become one dimension. Passed to CUDA kernels by value.
template <int N> struct Nest {
  int rank = 0;
  int64_t d[kMaxRank] = {};
  int64_t st[N][kMaxRank] = {};
  /// The stride of operand k along the innermost dimension (0 or the
  /// operand's own inner stride).
  CARVE_HD int64_t inner(int k) const { return rank ? st[k][rank - 1] : 0; }
};

template <int N> Nest<N> coalesce(const Dims &out, const int64_t (&st)[N][kMaxRank]) {
  Nest<N> n;
  for (int i = 0; i < out.rank; ++i) {
    if (out.d[i] == 1)
      continue;
    bool merge = n.rank > 0;
    for (int k = 0; merge && k < N; ++k)
      merge = n.st[k][n.rank - 1] == st[k][i] * out.d[i];
    if (merge) {
      n.d[n.rank - 1] *= out.d[i];
      for (int k = 0; k < N; ++k)
        n.st[k][n.rank - 1] = st[k][i];
    } else {
      n.d[n.rank] = out.d[i];
      for (int k = 0; k < N; ++k)
        n.st[k][n.rank] = st[k][i];
      ++n.rank;
    }
  }
  return n;
}

/// Operand strides of NumPy broadcasting of `in` to `out`; a fatal error
/// naming `op` where a shape does not broadcast.
template <int N> Nest<N> broadcastNest(const char *op, const Dims (&in)[N], const Dims &out) {
  int64_t st[N][kMaxRank] = {};
  for (int k = 0; k < N; ++k) {
    const Dims &s = in[k];
    if (s.rank > out.rank)
      fatal("%s: an operand of rank %d does not broadcast to rank %d", op, s.rank, out.rank);
    const int off = out.rank - s.rank;
    int64_t stride = 1;
    for (int i = out.rank - 1; i >= 0; --i) {
      const int64_t dim = i >= off ? s.d[i - off] : 1;
      if (dim != 1 && dim != out.d[i])
        fatal("%s: dimension %d of size %lld does not broadcast to size %lld", op, i,
              (long long)dim, (long long)out.d[i]);
      st[k][i] = dim == 1 ? 0 : stride;
      stride *= dim;
    }
  }
  return coalesce<N>(out, st);
}

/// Contiguous (row-major) strides of s.
inline void stridesOf(const Dims &s, int64_t *st) {
  int64_t acc = 1;
  for (int i = s.rank - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= s.d[i];
  }
}

/// The nest that reads x (shape xs) in the order of its transpose by `perm`:
/// y's dimensions with the x stride of each, size-1 ones dropped and
/// neighbours that stay neighbours in x merged. A fatal error unless perm is a
/// permutation of xs's axes.
/// `xst`: x's strides where x is a strided view (transpose_view; null:
/// contiguous).
inline Nest<1> transposeNest(const Dims &xs, const Dims &perm, const int64_t *strides = nullptr) {
  const int r = xs.rank;
  if (perm.rank != r)
    fatal("transpose: a permutation of rank %d for a tensor of rank %d", perm.rank, r);
  uint32_t seen = 0;
  for (int i = 0; i < r; ++i) {
    const int64_t p = perm.d[i];
    if (p < 0 || p >= r || (seen >> p) & 1u)
      fatal("transpose: the axes are not a permutation of 0..%d", r - 1);
    seen |= 1u << p;
  }
  int64_t xst[kMaxRank];
  stridesOf(xs, xst);
  if (strides)
    for (int i = 0; i < r; ++i)
      xst[i] = strides[i];
  Nest<1> n;
  for (int i = 0; i < r; ++i) {
    const int p = static_cast<int>(perm.d[i]);
    const int64_t dim = xs.d[p];
    if (dim == 1)
      continue;
    if (n.rank && n.st[0][n.rank - 1] == xst[p] * dim) {
      n.d[n.rank - 1] *= dim;
      n.st[0][n.rank - 1] = xst[p];
    } else {
      n.d[n.rank] = dim;
      n.st[0][n.rank] = xst[p];
      ++n.rank;
    }
  }
  return n;
}

/// The nest that reads the strided slice of x (shape xs) from `starts` by
/// `steps` into the contiguous ys; `base` gets the offset of its first
/// element. A fatal error naming `op` where the slice leaves x.
inline Nest<1> sliceNest(const char *op, const Dims &xs, const Dims &starts, const Dims &steps,
                         const Dims &ys, int64_t &base) {
  const int r = xs.rank;
  if (starts.rank != r || steps.rank != r || ys.rank != r)
    fatal("%s: starts, steps and the result must have the input's rank %d", op, r);
  int64_t xst[kMaxRank];
  stridesOf(xs, xst);
  int64_t st[1][kMaxRank] = {};
  base = 0;
  for (int i = 0; i < r; ++i) {
    const int64_t s0 = starts.d[i], step = steps.d[i], n = ys.d[i];
    if (step <= 0)
      fatal("%s: step %lld on axis %d (must be positive)", op, (long long)step, i);
    if (n > 0 && (s0 < 0 || s0 + (n - 1) * step >= xs.d[i]))
      fatal("%s: %lld elements from %lld by %lld exceed axis %d of size %lld", op, (long long)n,
            (long long)s0, (long long)step, i, (long long)xs.d[i]);
    base += s0 * xst[i];
    st[0][i] = step * xst[i];
  }
  return coalesce<1>(ys, st);
}

/// A reduction's geometry, the same on both targets: x's dimensions (size-1
/// ones dropped) grouped into alternating runs of kept and reduced ones.
/// `ori` when the runs are [kept][reduced][kept], each possibly absent: x is
/// then O x R x I with R reduced (the fast paths). Always: the kept runs (od,
/// os: sizes and strides in x) and the reduced ones (rd, rs), for a strided
/// walk per output element.
struct ReduceGeom {
  int64_t outCount = 1, redCount = 1;
  bool ori = false;
  int64_t O = 1, R = 1, I = 1;
  int no = 0, nr = 0;
  int64_t od[kMaxRank] = {}, os[kMaxRank] = {}, rd[kMaxRank] = {}, rs[kMaxRank] = {};
};

/// The geometry of reducing x (shape xs) over the axes set in `axesMask`.
inline ReduceGeom reduceGeom(const Dims &xs, uint32_t axesMask) {
  ReduceGeom g;
  int ng = 0;
  int64_t gs[kMaxRank];
  bool gr[kMaxRank];
  for (int i = 0; i < xs.rank; ++i) {
    const bool red = (axesMask >> i) & 1u;
    (red ? g.redCount : g.outCount) *= xs.d[i];
    if (xs.d[i] == 1)
      continue;
    if (ng && gr[ng - 1] == red) {
      gs[ng - 1] *= xs.d[i];
    } else {
      gs[ng] = xs.d[i];
      gr[ng] = red;
      ++ng;
    }
  }
  int k = 0;
  if (k < ng && !gr[k])
    g.O = gs[k++];
  if (k < ng && gr[k])
    g.R = gs[k++];
  if (k < ng && !gr[k])
    g.I = gs[k++];
  g.ori = k == ng;
  int64_t gst[kMaxRank];
  int64_t acc = 1;
  for (int i = ng - 1; i >= 0; --i) {
    gst[i] = acc;
    acc *= gs[i];
  }
  for (int i = 0; i < ng; ++i) {
    if (gr[i]) {
      g.rd[g.nr] = gs[i];
      g.rs[g.nr++] = gst[i];
    } else {
      g.od[g.no] = gs[i];
      g.os[g.no++] = gst[i];
    }
  }
  return g;
}

/// q = a / b and r = a - q * b for a >= 0 and b > 0, in 32 bits where a fits:
/// a 64-bit division is a long software routine on a GPU, a 32-bit one a
/// short sequence. (Measured on an H200, ResNet-18's elementwise kernels
/// gained under 5% from it: their index arithmetic is not what bounds them.)
CARVE_HD void divMod(int64_t a, int64_t b, int64_t &q, int64_t &r) {
  if (a < b) {
    q = 0;
    r = a;
  } else if (a <= int64_t(0xffffffff)) { // then b <= a fits too
    const uint32_t ua = static_cast<uint32_t>(a), ub = static_cast<uint32_t>(b);
    const uint32_t uq = ua / ub;
    q = uq;
    r = ua - uq * ub;
  } else {
    q = a / b;
    r = a - q * b;
  }
}

/// The operand offsets of output element e (one division per dimension; none
/// when the nest is one dimension).
template <int N> CARVE_HD void offsetsOf(const Nest<N> &n, int64_t e, int64_t (&off)[N]) {
  for (int k = 0; k < N; ++k)
    off[k] = 0;
  if (n.rank == 1) {
    for (int k = 0; k < N; ++k)
      off[k] = e * n.st[k][0];
    return;
  }
  for (int i = n.rank - 1; i >= 0; --i) {
    int64_t q, r;
    divMod(e, n.d[i], q, r);
    e = q;
    for (int k = 0; k < N; ++k)
      off[k] += r * n.st[k][i];
  }
}

/// Host: calls seg(off, e, len) for the output elements [e0, e1), in runs
/// along the innermost dimension: len elements from output element e,
/// operand k from offset off[k] with stride Nest::inner(k).
template <int N, class Seg> void forRange(const Nest<N> &n, int64_t e0, int64_t e1, Seg &&seg) {
  int64_t off[N] = {};
  const int r = n.rank;
  if (r == 0) {
    seg(static_cast<const int64_t *>(off), e0, e1 - e0);
    return;
  }
  int64_t idx[kMaxRank];
  int64_t rem = e0;
  for (int i = r - 1; i >= 0; --i) {
    idx[i] = rem % n.d[i];
    rem /= n.d[i];
    for (int k = 0; k < N; ++k)
      off[k] += idx[i] * n.st[k][i];
  }
  const int64_t len0 = n.d[r - 1];
  for (int64_t e = e0; e < e1;) {
    const int64_t len = std::min(len0 - idx[r - 1], e1 - e);
    seg(static_cast<const int64_t *>(off), e, len);
    e += len;
    idx[r - 1] += len;
    for (int k = 0; k < N; ++k)
      off[k] += len * n.st[k][r - 1];
    if (idx[r - 1] < len0)
      continue;
    idx[r - 1] = 0;
    for (int k = 0; k < N; ++k)
      off[k] -= len0 * n.st[k][r - 1];
    for (int i = r - 2; i >= 0; --i) {
      for (int k = 0; k < N; ++k)
        off[k] += n.st[k][i];
      if (++idx[i] < n.d[i])
        break;
      idx[i] = 0;
      for (int k = 0; k < N; ++k)
        off[k] -= n.d[i] * n.st[k][i];
    }
  }
}

} // namespace carve::rt::ew

#endif // CARVE_RT_ELEMENTWISE_H
