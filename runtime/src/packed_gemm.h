//===- packed_gemm.h - a GEMM whose right operand is packed from a gather -===//
//
// carve's own float32 GEMM for a convolution's three products on the CPU:
// y = A x B (the forward; the input gradient) and y = A x B^T (the weight
// gradient), with B = gather(table, idx) (the windows, or the output
// gradient's windows, or a plain matrix) packed from the table straight into
// the panels the microkernel reads, so the windows are never written out and
// no BLAS packs them again. matmul_gathered and matmul_gather_grad
// (kernels_linalg.cpp) call it where it applies; docs/fusion.md says when.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_PACKED_GEMM_H
#define CARVE_RT_PACKED_GEMM_H

#include <cstddef>
#include <cstdint>
#include <vector>

namespace carve::rt::packed {

/// Whether this build has the microkernel: AVX-512F, or AVX2 with FMA (the
/// runtime is built for the machine it runs on, -march=native). Without it
/// matmul_gathered keeps its BLAS path.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool kBuilt = true;
#else
constexpr bool kBuilt = false;
#endif
/// Whether the microkernel is the AVX-512 one (12 x 32 tiles).
#if defined(__AVX512F__)
constexpr bool kWide = true;
#else
constexpr bool kWide = false;
#endif

/// Where B's elements come from: B is [k x n], row kk = table row kk / taps
/// (of the operand matrix's first row `rows`, each `size` long) read at
/// idx[(kk % taps) * n + p] for column p. An im2col convolution's windows:
/// taps = the kernel's taps, n = the output pixels.
class Windows {
public:
  /// `idx` as gather's indices, in [-size, size) (negative: from the end);
  /// with `minusOneIsZero` an index of -1 reads 0 instead (and the others
  /// are in [0, size)): a convolution's input gradient's windows of dY,
  /// where a position takes no pixel of a tap.
  Windows(const int64_t *idx, int64_t taps, int64_t n, int64_t size, bool minusOneIsZero = false);
  /// A plain [k x n] matrix, row kk at rows + kk * ld (ld < 0: n).
  static Windows matrix(int64_t n, int64_t ld = -1);
  int64_t taps() const { return taps_; }
  int64_t n() const { return n_; }

  /// Rows [k0, k0 + kc) of B, columns [p0, p0 + panels * NR) in panels of NR
  /// columns (NR = the microkernel's width), each panel [kc][NR]; columns at
  /// or past n are zero.
  void pack(const float *rows, int64_t k0, int64_t kc, int64_t p0, int64_t panels,
            float *dst) const;

  /// Columns [p0, p0 + kc) of B^T's rows, i.e. B's rows [r0, r0 + panels
  /// * NR) read at pixels p0 .. p0 + kc - 1, in panels of NR rows of B, each
  /// [kc][NR]; rows at or past `k` (B's row count) are zero. p0 is a
  /// multiple of NR.
  void packTransposed(const float *rows, int64_t k, int64_t p0, int64_t kc, int64_t r0,
                      int64_t panels, float *dst) const;

private:
  Windows(int64_t n, int64_t ld); // matrix()

  /// Panel q of tap t's NR lanes (lanes at or past n are zero) of the B row
  /// whose table row is `src`, into o.
  void fillRow(const float *src, int64_t t, int64_t q, float *o) const;

  /// A panel's columns of one tap: one element in every lane (`same`, the
  /// padding element of a window row off the image), a copy of NR
  /// consecutive table elements from `base` with the lanes of `fix`
  /// patched, or (neither) one element per lane.
  struct Panel {
    int64_t base;
    int32_t fix0, fixN;
    int64_t same;
  };
  static constexpr int64_t kNotSame = INT64_MIN;
  static float read(const float *src, int64_t i) { return i < 0 ? 0.f : src[i]; }
  int64_t taps_, n_, size_, panels_;
  bool plain_ = false;       // matrix(): row kk's column p at rows + kk * size_ + p
  std::vector<int64_t> idx_; // in [0, size), or -1 (reads 0) with minusOneIsZero
  std::vector<Panel> panel_; // [taps][panels]
  std::vector<std::pair<int32_t, int64_t>> fix_;
};

/// Floats packA writes for an [m x k] A.
size_t packedASize(int64_t m, int64_t k);
/// A [m x k] (row-major, leading dimension lda; stored transposed, [k x m],
/// with `trans`) into the blocks gemm reads.
void packA(const float *a, int64_t lda, int64_t m, int64_t k, float *dst, bool trans = false);

/// Floats of the per-thread buffer gemm needs for columns [j0, j1).
size_t bufferSize(int64_t k, int64_t j0, int64_t j1);

/// Columns [j0, j1) of y [m x n] (row-major, leading dimension n) = A x B,
/// A packed by packA, B the windows of the operand matrix whose first table
/// row is `rows`. Each element sums its k products in order, in blocks of
/// kKc, whatever m, j0 and j1 are: so the bits of an element do not depend
/// on how many output channels or samples a rank holds.
/// With `accumulate`, y += A x B.
void gemm(const float *pa, int64_t m, int64_t k, const float *rows, const Windows &w, int64_t j0,
          int64_t j1, float *y, float *buf, bool accumulate = false);

/// Floats of the per-thread buffer gemmTransposed needs for columns
/// [j0, j1) of an [m x k] result.
size_t bufferSizeTransposed(int64_t m, int64_t n, int64_t j0, int64_t j1);

/// Columns [j0, j1) of y [m x k] (row-major, leading dimension k) = A x B^T:
/// a convolution's weight gradient of one sample, A = dY [m x n] (row-major,
/// n = the windows' columns, the pixels), B the windows of the operand
/// matrix whose first table row is `rows`, [k x n]. As gemm, each element
/// sums its n products in order, in blocks of kKc, whatever m, j0 and j1.
/// A's rows are lda apart (lda < 0: n); with `transA` A is stored
/// transposed ([n x m], rows lda apart). With `accumulate`, y += A x B^T.
void gemmTransposed(const float *a, int64_t m, int64_t k, const float *rows, const Windows &w,
                    int64_t j0, int64_t j1, float *y, float *buf, int64_t lda = -1,
                    bool transA = false, bool accumulate = false);

/// The k rows packed at a time (the microkernel's inner loop).
constexpr int64_t kKc = 256;
/// Columns of one call of gemm that the threads share out (a unit of work).
constexpr int64_t kNc = 256;

} // namespace carve::rt::packed

#endif // CARVE_RT_PACKED_GEMM_H
