//===- packed_gemm.cpp - a GEMM whose right operand is packed from a gather ===//
//
// The blocking is the usual one for a register-tiled GEMM: A (a convolution's
// weight) packed once per call into panels of MR rows per block of kKc terms;
// B (one sample's windows) packed per block of kKc rows and a thread's
// columns into panels of NR columns straight from the image; an MR x NR
// microkernel of FMAs whose accumulators stay in registers over the block,
// stored once per block (the first block's sums overwrite y: no pass zeroes
// it). The microkernel is AVX-512 (12 x 32) or AVX2 (6 x 16).
//
//===----------------------------------------------------------------------===//

#include "packed_gemm.h"

#include <algorithm>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace carve::rt::packed {

namespace {

#if defined(__AVX512F__)
using V = __m512;
constexpr int64_t kW = 16, kMr = 12;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float *p) { return _mm512_loadu_ps(p); }
inline void vstore(float *p, V v) { _mm512_storeu_ps(p, v); }
inline V vbroadcast(const float *p) { return _mm512_set1_ps(*p); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
using V = __m256;
constexpr int64_t kW = 8, kMr = 6;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float *p) { return _mm256_loadu_ps(p); }
inline void vstore(float *p, V v) { _mm256_storeu_ps(p, v); }
inline V vbroadcast(const float *p) { return _mm256_broadcast_ss(p); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
#else
constexpr int64_t kW = 8, kMr = 6; // sizes only: nothing calls gemm (kBuilt)
#endif
constexpr int64_t kNr = 2 * kW;

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/// y[rows x cols] (leading dimension ldy) = (first ? 0 : y) + a x b over kc
/// terms: a [kc][kMr], b [kc][kNr]. Each element's kc products are summed in
/// order by one chain of FMAs, then added to y.
void micro(int64_t kc, const float *a, const float *b, float *y, int64_t ldy, int64_t rows,
           int64_t cols, bool first) {
  V c[kMr][2];
#pragma GCC unroll 16
  for (int i = 0; i < kMr; ++i)
    c[i][0] = c[i][1] = vzero();
  for (int64_t kk = 0; kk < kc; ++kk) {
    const V b0 = vload(b + kk * kNr), b1 = vload(b + kk * kNr + kW);
    const float *ak = a + kk * kMr;
#pragma GCC unroll 16
    for (int i = 0; i < kMr; ++i) {
      const V ai = vbroadcast(ak + i);
      c[i][0] = vfma(ai, b0, c[i][0]);
      c[i][1] = vfma(ai, b1, c[i][1]);
    }
  }
  if (rows == kMr && cols == kNr) {
#pragma GCC unroll 16
    for (int i = 0; i < kMr; ++i) {
      float *yi = y + i * ldy;
      if (first) {
        vstore(yi, c[i][0]);
        vstore(yi + kW, c[i][1]);
      } else {
        vstore(yi, vadd(vload(yi), c[i][0]));
        vstore(yi + kW, vadd(vload(yi + kW), c[i][1]));
      }
    }
    return;
  }
  // Every index of c a constant (unrolled), or GCC keeps c in memory and
  // stores the accumulators on every step of the loop above.
  alignas(64) float tile[kMr][kNr];
#pragma GCC unroll 16
  for (int i = 0; i < kMr; ++i) {
    vstore(tile[i], c[i][0]);
    vstore(tile[i] + kW, c[i][1]);
  }
  for (int64_t i = 0; i < rows; ++i) {
    float *yi = y + i * ldy;
    for (int64_t j = 0; j < cols; ++j)
      yi[j] = first ? tile[i][j] : yi[j] + tile[i][j];
  }
}
#endif

} // namespace

Windows::Windows(const int64_t *idx, int64_t taps, int64_t n, int64_t size, bool minusOneIsZero)
    : taps_(taps), n_(n), size_(size), panels_((n + kNr - 1) / kNr), idx_(taps * n) {
  for (int64_t i = 0; i < taps * n; ++i)
    idx_[i] = idx[i] < 0 && !minusOneIsZero ? idx[i] + size : idx[i];
  // A panel whose lanes read consecutive elements but for at most half (the
  // padding element at the image's edges) is a copy and a patch; the base is
  // the one of its first, middle or last lane that needs the fewest.
  panel_.resize(taps * panels_);
  for (int64_t t = 0; t < taps; ++t)
    for (int64_t q = 0; q < panels_; ++q) {
      Panel &pn = panel_[t * panels_ + q];
      pn = {-1, 0, 0, kNotSame};
      const int64_t p0 = q * kNr;
      if (p0 + kNr > n)
        continue;
      const int64_t *ix = idx_.data() + t * n + p0;
      if (std::all_of(ix, ix + kNr, [&](int64_t v) { return v == ix[0]; })) {
        pn.same = ix[0];
        continue;
      }
      int64_t base = -1, fixes = kNr / 2 + 1;
      for (const int64_t lane : {int64_t(0), kNr / 2, kNr - 1}) {
        const int64_t b = ix[lane] - lane;
        if (ix[lane] < 0 || b < 0 || b + kNr > size)
          continue;
        int64_t f = 0;
        for (int64_t i = 0; i < kNr; ++i)
          f += ix[i] != b + i;
        if (f < fixes) {
          base = b;
          fixes = f;
        }
      }
      if (base < 0)
        continue;
      pn.base = base;
      pn.fix0 = static_cast<int32_t>(fix_.size());
      pn.fixN = static_cast<int32_t>(fixes);
      for (int64_t i = 0; i < kNr; ++i)
        if (ix[i] != base + i)
          fix_.push_back({static_cast<int32_t>(i), ix[i]});
    }
}

Windows::Windows(int64_t n, int64_t ld)
    : taps_(1), n_(n), size_(ld), panels_((n + kNr - 1) / kNr), plain_(true) {}

Windows Windows::matrix(int64_t n, int64_t ld) { return Windows(n, ld < 0 ? n : ld); }

void Windows::fillRow(const float *src, int64_t t, int64_t q, float *o) const {
  const int64_t p0 = q * kNr;
  if (plain_) {
    const int64_t len = std::min(kNr, n_ - p0);
    std::memcpy(o, src + p0, len * sizeof(float));
    std::fill(o + len, o + kNr, 0.f);
    return;
  }
  const Panel &pn = panel_[t * panels_ + q];
  if (pn.same != kNotSame) {
    std::fill_n(o, kNr, read(src, pn.same));
  } else if (pn.base >= 0) {
    std::memcpy(o, src + pn.base, kNr * sizeof(float));
    for (int32_t f = pn.fix0; f < pn.fix0 + pn.fixN; ++f)
      o[fix_[f].first] = read(src, fix_[f].second);
  } else {
    const int64_t *ix = idx_.data() + t * n_;
    for (int64_t i = 0; i < kNr; ++i)
      o[i] = p0 + i < n_ ? read(src, ix[p0 + i]) : 0.f;
  }
}

void Windows::pack(const float *rows, int64_t k0, int64_t kc, int64_t p0, int64_t panels,
                   float *dst) const {
  // Row by row of B (its table row and tap counted, not divided out), its
  // panels' NR columns each.
  int64_t t = k0 % taps_;
  const float *src = rows + (k0 / taps_) * size_;
  for (int64_t kk = 0; kk < kc; ++kk) {
    for (int64_t jr = 0; jr < panels; ++jr)
      fillRow(src, t, p0 / kNr + jr, dst + (jr * kc + kk) * kNr);
    if (++t == taps_) {
      t = 0;
      src += size_;
    }
  }
}

#if defined(__AVX2__)
namespace {

/// out[j][i] = in[i][j] for an 8 x 8 block (rows ldi and ldo apart).
inline void transpose8(const float *in, int64_t ldi, float *out, int64_t ldo) {
  __m256 r[8], t[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    r[i] = _mm256_loadu_ps(in + i * ldi);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  const __m256 u0 = _mm256_shuffle_ps(t[0], t[2], _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u1 = _mm256_shuffle_ps(t[0], t[2], _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u2 = _mm256_shuffle_ps(t[1], t[3], _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u3 = _mm256_shuffle_ps(t[1], t[3], _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u4 = _mm256_shuffle_ps(t[4], t[6], _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u5 = _mm256_shuffle_ps(t[4], t[6], _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u6 = _mm256_shuffle_ps(t[5], t[7], _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u7 = _mm256_shuffle_ps(t[5], t[7], _MM_SHUFFLE(3, 2, 3, 2));
  _mm256_storeu_ps(out + 0 * ldo, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(out + 1 * ldo, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(out + 2 * ldo, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(out + 3 * ldo, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(out + 4 * ldo, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(out + 5 * ldo, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(out + 6 * ldo, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(out + 7 * ldo, _mm256_permute2f128_ps(u3, u7, 0x31));
}

} // namespace
#endif

void Windows::packTransposed(const float *rows, int64_t k, int64_t p0, int64_t kc, int64_t r0,
                             int64_t panels, float *dst) const {
  // A square block: the panel's NR rows of B, NR pixels each (fillRow), then
  // transposed into the panel, 8 x 8 at a time in registers; the last pixels
  // of a block of kc that is not whole panels one lane at a time.
  alignas(64) float sq[kNr * kNr];
  for (int64_t jr = 0; jr < panels; ++jr) {
    float *d = dst + jr * kc * kNr;
    // The panel's rows of B: table row and tap, counted once.
    const float *srcs[kNr];
    int64_t tapOf[kNr];
    const int64_t rb = r0 + jr * kNr;
    int64_t t = rb % taps_;
    const float *src = rows + (rb / taps_) * size_;
    for (int64_t c = 0; c < kNr; ++c) {
      srcs[c] = rb + c < k ? src : nullptr; // rows past B's are zero
      if (!srcs[c])
        continue;
      tapOf[c] = t;
      if (++t == taps_) {
        t = 0;
        src += size_;
      }
    }
    for (int64_t q0 = p0; q0 < p0 + kc; q0 += kNr) {
      for (int64_t c = 0; c < kNr; ++c) {
        if (srcs[c])
          fillRow(srcs[c], tapOf[c], q0 / kNr, sq + c * kNr);
        else
          std::fill_n(sq + c * kNr, kNr, 0.f);
      }
      float *o = d + (q0 - p0) * kNr;
      const int64_t len = std::min(kNr, p0 + kc - q0);
#if defined(__AVX2__)
      if (len == kNr) {
        for (int64_t c0 = 0; c0 < kNr; c0 += 8)
          for (int64_t i0 = 0; i0 < kNr; i0 += 8)
            transpose8(sq + c0 * kNr + i0, kNr, o + i0 * kNr + c0, kNr);
        continue;
      }
#endif
      for (int64_t i = 0; i < len; ++i)
        for (int64_t c = 0; c < kNr; ++c)
          o[i * kNr + c] = sq[c * kNr + i];
    }
  }
}

size_t packedASize(int64_t m, int64_t k) {
  return static_cast<size_t>((m + kMr - 1) / kMr * kMr * k);
}

void packA(const float *a, int64_t lda, int64_t m, int64_t k, float *dst, bool trans) {
  const int64_t mp = (m + kMr - 1) / kMr;
  for (int64_t pc = 0; pc < k; pc += kKc) {
    const int64_t kc = std::min(kKc, k - pc);
    for (int64_t i = 0; i < mp; ++i) {
      float *d = dst + pc * mp * kMr + i * kc * kMr;
      const int64_t rows = std::min(kMr, m - i * kMr);
      if (trans) { // A's rows are its columns as stored: read along them
        for (int64_t kk = 0; kk < kc; ++kk) {
          const float *src = a + (pc + kk) * lda + i * kMr;
          if (rows == kMr) {
            std::memcpy(d + kk * kMr, src, kMr * sizeof(float));
            continue;
          }
          for (int64_t r = 0; r < kMr; ++r)
            d[kk * kMr + r] = r < rows ? src[r] : 0.f;
        }
        continue;
      }
      int64_t r = 0;
#if defined(__AVX2__)
      // Four rows at a time, transposed 4 x 4 in registers.
      for (; r + 4 <= rows; r += 4) {
        const float *src = a + (i * kMr + r) * lda + pc;
        int64_t kk = 0;
        for (; kk + 4 <= kc; kk += 4) {
          __m128 r0 = _mm_loadu_ps(src + kk), r1 = _mm_loadu_ps(src + lda + kk);
          __m128 r2 = _mm_loadu_ps(src + 2 * lda + kk), r3 = _mm_loadu_ps(src + 3 * lda + kk);
          _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
          _mm_storeu_ps(d + kk * kMr + r, r0);
          _mm_storeu_ps(d + (kk + 1) * kMr + r, r1);
          _mm_storeu_ps(d + (kk + 2) * kMr + r, r2);
          _mm_storeu_ps(d + (kk + 3) * kMr + r, r3);
        }
        for (; kk < kc; ++kk)
          for (int64_t q = 0; q < 4; ++q)
            d[kk * kMr + r + q] = src[q * lda + kk];
      }
#endif
      for (; r < kMr; ++r) {
        if (r >= rows) {
          for (int64_t kk = 0; kk < kc; ++kk)
            d[kk * kMr + r] = 0.f;
          continue;
        }
        const float *src = a + (i * kMr + r) * lda + pc;
        for (int64_t kk = 0; kk < kc; ++kk)
          d[kk * kMr + r] = src[kk];
      }
    }
  }
}

size_t bufferSize(int64_t k, int64_t j0, int64_t j1) {
  return static_cast<size_t>(std::min(kKc, k) * ((j1 - j0 + kNr - 1) / kNr) * kNr);
}

void gemm(const float *pa, int64_t m, int64_t k, const float *rows, const Windows &w, int64_t j0,
          int64_t j1, float *y, float *buf, bool accumulate) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const int64_t n = w.n(), mp = (m + kMr - 1) / kMr, panels = (j1 - j0 + kNr - 1) / kNr;
  for (int64_t pc = 0; pc < k; pc += kKc) {
    const int64_t kc = std::min(kKc, k - pc);
    w.pack(rows, pc, kc, j0, panels, buf);
    for (int64_t jr = 0; jr < panels; ++jr) {
      const int64_t p0 = j0 + jr * kNr, cols = std::min(kNr, j1 - p0);
      const float *b = buf + jr * kc * kNr;
      for (int64_t i = 0; i < mp; ++i)
        micro(kc, pa + pc * mp * kMr + i * kc * kMr, b, y + i * kMr * n + p0, n,
              std::min(kMr, m - i * kMr), cols, pc == 0 && !accumulate);
    }
  }
#else
  (void)pa, (void)m, (void)k, (void)rows, (void)w, (void)j0, (void)j1, (void)y, (void)buf,
      (void)accumulate;
#endif
}

size_t bufferSizeTransposed(int64_t m, int64_t n, int64_t j0, int64_t j1) {
  return packedASize(m, std::min(kKc, n)) + bufferSize(n, j0, std::min(j1, j0 + kNc));
}

void gemmTransposed(const float *a, int64_t m, int64_t k, const float *rows, const Windows &w,
                    int64_t j0, int64_t j1, float *y, float *buf, int64_t lda, bool transA,
                    bool accumulate) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  // A block of dY packed once for all the columns, B a chunk of kNc of
  // them at a time (its block stays in cache).
  const int64_t n = w.n(), mp = (m + kMr - 1) / kMr;
  float *pa = buf, *pb = buf + packedASize(m, std::min(kKc, n));
  if (lda < 0)
    lda = n;
  for (int64_t pc = 0; pc < n; pc += kKc) {
    const int64_t kc = std::min(kKc, n - pc);
    packA(transA ? a + pc * lda : a + pc, lda, m, kc, pa, transA);
    for (int64_t jc = j0; jc < j1; jc += kNc) {
      const int64_t jn = std::min(j1, jc + kNc), panels = (jn - jc + kNr - 1) / kNr;
      w.packTransposed(rows, k, pc, kc, jc, panels, pb);
      for (int64_t jr = 0; jr < panels; ++jr) {
        const int64_t c0 = jc + jr * kNr, cols = std::min(kNr, jn - c0);
        const float *b = pb + jr * kc * kNr;
        for (int64_t i = 0; i < mp; ++i)
          micro(kc, pa + i * kc * kMr, b, y + i * kMr * k + c0, k, std::min(kMr, m - i * kMr), cols,
                pc == 0 && !accumulate);
      }
    }
  }
#else
  (void)a, (void)m, (void)k, (void)rows, (void)w, (void)j0, (void)j1, (void)y, (void)buf, (void)lda,
      (void)transA, (void)accumulate;
#endif
}

} // namespace carve::rt::packed
