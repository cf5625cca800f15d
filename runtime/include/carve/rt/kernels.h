//===- kernels.h - CPU kernels called by generated programs ----------------===//
//
// Every operation of a compiled training step is one call into this header.
// Kernels take raw pointers into the program's arena plus static shapes
// (`Dims`, row-major, contiguous). They never allocate on the heap in the
// hot path, are OpenMP-parallel where the work is large enough, and GEMMs go
// to OpenBLAS. Every floating-point kernel is instantiated for float (the
// generated programs) and double (the compiler's reference interpreter, which
// checks gradient rules against finite differences).
//
// Broadcasting follows NumPy: shapes are right-aligned, size-1 dimensions
// repeat. `Dims` of rank 0 is a scalar (one element).
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_KERNELS_H
#define CARVE_RT_KERNELS_H

#include <cstdint>
#include <initializer_list>

namespace carve::rt {

constexpr int kMaxRank = 8;

/// A static shape (row-major, contiguous).
struct Dims {
  int rank = 0;
  int64_t d[kMaxRank] = {};
  Dims() = default;
  Dims(std::initializer_list<int64_t> l) {
    for (int64_t v : l)
      d[rank++] = v;
  }
  Dims(const int64_t *p, int r) : rank(r) {
    for (int i = 0; i < r; ++i)
      d[i] = p[i];
  }
  int64_t operator[](int i) const { return d[i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank; ++i)
      n *= d[i];
    return n;
  }
};

//===--- Elementwise ------------------------------------------------------===//

enum class Unary {
  Neg,
  Abs,
  Exp,
  Log,
  Sqrt,
  Rsqrt,
  Reciprocal,
  Tanh,
  Erf,
  Sigmoid,
  Relu,
  Sin,
  Cos,
  Silu,
  Gelu,     // x * 0.5 * (1 + erf(x / sqrt(2)))
  GeluTanh, // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
};

/// y[i] = f(x[i]).
template <class T> void unary(Unary f, const T *x, T *y, int64_t n);
/// dx[i] = dy[i] * f'(x[i]). For Relu f'(0) = 0; for Abs f'(0) = 0 (PyTorch's choices).
template <class T> void unary_grad(Unary f, const T *x, const T *dy, T *dx, int64_t n);

enum class Binary { Add, Sub, Mul, Div, Pow, Max, Min };
/// y = f(a, b) with broadcasting of a and b to ys.
template <class T> void binary(Binary f, const T *a, Dims as, const T *b, Dims bs, T *y, Dims ys);

enum class Compare { Eq, Lt, Gt };
/// y = (a OP b) as 0/1 bytes, with broadcasting.
template <class T>
void compare(Compare f, const T *a, Dims as, const T *b, Dims bs, uint8_t *y, Dims ys);
/// Logical and/or/not on 0/1 bytes (b ignored for not), with broadcasting.
enum class Logic { And, Or, Not };
void logic(Logic f, const uint8_t *a, Dims as, const uint8_t *b, Dims bs, uint8_t *y, Dims ys);

/// y = c ? a : b with broadcasting of all three.
template <class T>
void where(const uint8_t *c, Dims cs, const T *a, Dims as, const T *b, Dims bs, T *y, Dims ys);

namespace philox {
struct DropoutPiece;
}
/// Dropout in training mode (docs/training.md#dropout): y = x / (1 - p)
/// (PyTorch's float scale, philox::dropoutScale) where
/// philox::dropoutKeep(seed, step, node, the element's index in the full
/// tensor, p) keeps the element, 0 where it drops it. `piece` is x's shape
/// and where it lies in the full tensor. p = 0: y = x. The gradient is the
/// same call on dy (the same mask).
template <class T>
void dropout(const T *x, const philox::DropoutPiece &piece, double p, uint64_t seed, int64_t step,
             int64_t node, T *y);

/// y[i] = To(x[i]). Instantiated for every pair of {float, double, int64_t, int32_t, uint8_t}.
template <class From, class To> void cast(const From *x, To *y, int64_t n);

/// y[i] = v. (float, double, int64_t, int32_t, uint8_t)
template <class T> void fill(T *y, int64_t n, T v);
/// memcpy of n elements. (float, double, int64_t, int32_t, uint8_t; uint16_t: 16-bit floats)
template <class T> void copy(const T *x, T *y, int64_t n);

//===--- Linear algebra ---------------------------------------------------===//

/// The precision of matmul and attention inputs (the plan's `precision`):
/// F32 leaves them alone; BF16 and F16 round each input element to that
/// format (round to nearest even; F16 overflows to infinity past 65504) and
/// the products accumulate in fp32, as tensor cores do. Per process; the
/// generated step sets it. The float64 instantiations ignore it.
enum class Precision : int { F32 = 0, BF16 = 1, F16 = 2 };
void setPrecision(Precision p);
Precision precision();
/// Whether float32 GEMMs may run carve's own packed GEMM (on by default where
/// the runtime was built with AVX2 and FMA or AVX-512; docs/fusion.md): a
/// convolution's products (matmul_gathered, matmul_gather_grad), and with
/// AVX-512 matmul's plain ones; off, OpenBLAS runs them all. For tests and
/// benchmarks that compare the two.
void setPackedGemm(bool on);
bool packedGemm();
/// Whether matmul's plain float32 products go to the packed GEMM (packedGemm()
/// with the AVX-512 microkernel).
bool packedMatmuls();
/// x rounded to bf16 / fp16 and back (round to nearest even).
float roundToBf16(float x);
float roundToF16(float x);
/// The values a bf16/fp16 plan stores in 16 bits (carve.round16, docs/training.md
/// "16-bit activations"): x rounded in place to the format, and 16-bit
/// copies of float values and back (to16 rounds to nearest even; from16 is
/// exact). uint16_t holds the bits.
void roundBf16(float *x, int64_t n);
void roundF16(float *x, int64_t n);
void toBf16(const float *x, uint16_t *y, int64_t n);
void fromBf16(const uint16_t *x, float *y, int64_t n);
void toF16(const float *x, uint16_t *y, int64_t n);
void fromF16(const uint16_t *x, float *y, int64_t n);

/// y = op(a) @ op(b), NumPy matmul semantics on the last two dimensions with
/// broadcasting of the leading (batch) dimensions; both ranks >= 2.
/// `as`/`bs` are the shapes as stored; transA/transB swap the last two
/// dimensions of the stored operand before multiplying. ys is the result
/// shape. If accumulate, y += product instead of y = product.
/// Uses cblas_sgemm / cblas_dgemm (one call per batch matrix, or a single call
/// when the batch folds into M); in float32, with the AVX-512 packed GEMM
/// (packedMatmuls()), every product of at least 16 terms goes to it
/// instead, each element's sum in the same order however the rows, columns
/// and batch are split.
template <class T>
void matmul(const T *a, Dims as, bool transA, const T *b, Dims bs, bool transB, T *y, Dims ys,
            bool accumulate = false);
/// gather_grad(op(a) @ op(b) viewed as the table's rows, idx, last axis)
/// without the product in memory: an im2col convolution's input gradient,
/// whose product (the windows' gradient, kernel-size times the image) goes
/// to the table a block of rows at a time while it is in cache. `ys` is the
/// product's shape; row r of `dtable` ([..., size]) takes product elements
/// r * is.numel() .. (r + 1) * is.numel() - 1, whole rows of one product
/// matrix. The table's sums run in gather_grad's order; the product's own
/// may round differently than matmul's whole GEMM (summation order only).
template <class T>
void matmul_gather_grad(const T *a, Dims as, bool transA, const T *b, Dims bs, bool transB, Dims ys,
                        const int64_t *idx, Dims is, T *dtable, Dims ts);
/// matmul(a, b) with b = gather(table, idx, last axis) viewed as `bs`,
/// without b in memory: an im2col convolution's forward and weight gradient
/// read its windows (kernel-size times the image) this way (whole table
/// rows: row r of the table gives elements r * is.numel() .. of b's flat
/// layout).
///
/// In float32, where the runtime has the packed GEMM (packedGemm())
/// and each batch matrix of b has at least 64 columns (output pixels), the
/// forward (one weight a times each sample's windows) and the weight
/// gradient (each sample's dY times its windows transposed) pack the windows
/// from the table straight into the GEMM's panels (packed_gemm.h): the sums
/// run in carve's order, not BLAS's, the same for every batch size and
/// number of rows of a (every plan's ranks). Otherwise each batch matrix of
/// b is gathered as its GEMM needs it into a per-thread buffer and
/// multiplied by the GEMM matmul would run on it, so the result is bitwise
/// matmul's of the gathered tensor. That buffer holds one batch matrix per
/// thread and is kept for later calls: one sample's windows, C * taps *
/// pixels elements (7.2 MB for 64 channels, 3x3, 56x56 in float32), where
/// the gathered tensor held N of them.
template <class T>
void matmul_gathered(const T *a, Dims as, bool transA, const T *table, Dims ts, const int64_t *idx,
                     Dims is, Dims bs, bool transB, T *y, Dims ys);

//===--- Reductions and normalization -------------------------------------===//

enum class Reduce { Sum, Mean, Max };
/// Reduces the axes set in `axesMask` (bit i = axis i) of x; y holds
/// x's shape with those axes of size 1 (keep-dims layout; same memory either way).
template <class T> void reduce(Reduce f, const T *x, Dims xs, uint32_t axesMask, T *y);

/// Softmax (or log-softmax if `log`) along `axis`.
template <class T> void softmax(const T *x, Dims xs, int axis, bool log, T *y);
/// Given y = softmax(x) (or log_softmax) and dy, dx = y*(dy - sum(dy*y)) for
/// softmax; dx = dy - exp(y)*sum(dy) for log-softmax; sums along `axis`.
template <class T> void softmax_grad(const T *y, const T *dy, Dims s, int axis, bool log, T *dx);

/// Layer normalization over dimensions [axis, rank): mean and biased variance;
/// y = (x - mean) / sqrt(var + eps) * scale + bias. scale/bias have the shape of
/// the normalized dimensions, or are null.
template <class T>
void layer_norm(const T *x, Dims xs, int axis, const T *scale, const T *bias, T eps, T *y);
/// Backward of layer_norm (statistics recomputed from x). dscale/dbias may be
/// null (not needed) and are overwritten (not accumulated) otherwise.
template <class T>
void layer_norm_grad(const T *x, Dims xs, int axis, const T *scale, T eps, const T *dy, T *dx,
                     T *dscale, T *dbias);

/// RMS normalization over [axis, rank): y = x / sqrt(mean(x^2) + eps) * scale.
template <class T> void rms_norm(const T *x, Dims xs, int axis, const T *scale, T eps, T *y);
template <class T>
void rms_norm_grad(const T *x, Dims xs, int axis, const T *scale, T eps, const T *dy, T *dx,
                   T *dscale);

/// Rotary position embedding over the last dimension d (even) of x:
/// y = (x * cos) + (rotate_half(x) * sin), rotate_half(x)[j] = -x[j + d/2]
/// for j < d/2, x[j - d/2] after; cos (shape cs) and sin (ss) broadcast to
/// xs. Each element as the unfused Mul / Neg / Concat / Mul / Add chain
/// computes it (two products and a sum, none contracted).
template <class T>
void rotary(const T *x, Dims xs, const T *cos, Dims cs, const T *sin, Dims ss, T *y);
/// Its input gradient: dx = (rotate_half^T(dy * sin)) + (dy * cos), with
/// rotate_half^T(z)[j] = 0 + z[j + d/2] for j < d/2, -z[j - d/2] + 0 after:
/// the sums of the unraised chain's gradient (each slice's gradient zero
/// where the other's is not), so the same bits, signed zeros included.
template <class T>
void rotary_grad(const T *dy, Dims xs, const T *cos, Dims cs, const T *sin, Dims ss, T *dx);

/// Attention core: y = softmax(q k^T * scale + mask [+ causal]) v over the last
/// two dims. q: [..., Tq, D], k: [..., Tk, D], v: [..., Tk, Dv], y: [..., Tq, Dv];
/// the batch dims (all but the last two) of q, k, v are equal. `mask` is
/// additive and broadcastable to [..., Tq, Tk], or null. `causal` gives -inf to
/// key j > query i. Rows whose scores are all -inf produce 0.
template <class T>
void attention(const T *q, Dims qs, const T *k, Dims ks, const T *v, Dims vs, const T *mask,
               Dims ms, T scale, bool causal, T *y);
/// Backward of attention (probabilities recomputed). Writes dq, dk, dv
/// (overwritten). No gradient for the mask.
template <class T>
void attention_grad(const T *q, Dims qs, const T *k, Dims ks, const T *v, Dims vs, const T *mask,
                    Dims ms, T scale, bool causal, const T *dy, T *dq, T *dk, T *dv);

/// Cross-entropy of logits [N, C, d...] against int64 targets [N, d...]
/// (class along dim 1), elements with target == ignore_index (when
/// hasIgnore) skipped. reduction: 0 = mean over counted elements, 1 = sum,
/// 2 = none (y has the targets' shape). Targets outside [0, C) (and not
/// ignored) are a fatal error naming the value.
template <class T>
void cross_entropy(const T *logits, Dims ls, const int64_t *targets, int reduction, bool hasIgnore,
                   int64_t ignoreIndex, T *y);
/// dlogits for the same arguments given dy (a scalar for mean/sum, targets'
/// shape for none).
template <class T>
void cross_entropy_grad(const T *logits, Dims ls, const int64_t *targets, int reduction,
                        bool hasIgnore, int64_t ignoreIndex, const T *dy, T *dlogits);

//===--- Data movement (float, double, int64_t, int32_t, uint8_t) ---------===//

/// y = x permuted: y.shape[i] = x.shape[perm[i]].
template <class T> void transpose(const T *x, Dims xs, Dims perm, T *y);
/// y = x[starts : : steps] with y's shape ys (steps > 0).
template <class T> void slice(const T *x, Dims xs, Dims starts, Dims steps, T *y, Dims ys);
/// dx = zeros(xs); dx[starts : : steps] = dy (the gradient of slice).
template <class T> void slice_grad(const T *dy, Dims ys, Dims starts, Dims steps, T *dx, Dims xs);
/// y = concatenation of n inputs along axis.
template <class T> void concat(int n, const T *const *xs, const Dims *shapes, int axis, T *y);
/// y = take(table, idx, axis): y.shape = ts[:axis] + is + ts[axis+1:].
/// Negative indices count from the end; out of range is a fatal error.
template <class T>
void gather(const T *table, Dims ts, const int64_t *idx, Dims is, int axis, T *y);
/// dtable = zeros(ts); scatter-add dy into it (the gradient of gather).
template <class T>
void gather_grad(const T *dy, const int64_t *idx, Dims is, int axis, T *dtable, Dims ts);
/// y = broadcast of x to ys.
template <class T> void expand(const T *x, Dims xs, T *y, Dims ys);
/// ONNX NonZero at its static bound: y is rank(xs) x numel(xs); column j holds
/// the coordinates of the j-th non-zero element of x (row-major order), and
/// the columns past the last one are zeros.
template <class T> void nonzero(const T *x, Dims xs, int64_t *y);

/// Aborts the process with "carve: error: MSG" (rank prefix when known), or,
/// on a thread inside a FatalTrap, throws FatalTrapped{MSG} instead.
[[noreturn]] void fatal(const char *fmt, ...);

/// What `fatal` throws inside a FatalTrap: the message it would have printed.
struct FatalTrapped {
  char message[1024];
};

/// While one lives, `fatal` on this thread throws FatalTrapped instead of
/// ending the process. For work whose failure has a way out: gpu::graphStep
/// captures a step in a CUDA graph inside one, and a step that cannot be
/// captured (a user's kernel that synchronizes, say) runs eagerly instead of
/// ending the run. Nests; not for code that may fail half-way through a
/// change of shared state.
class FatalTrap {
public:
  FatalTrap();
  ~FatalTrap();
  FatalTrap(const FatalTrap &) = delete;
  FatalTrap &operator=(const FatalTrap &) = delete;
};
/// Whether this thread is inside a FatalTrap (error paths that end the
/// process without `fatal` check it and throw FatalTrapped themselves).
bool fatalTrapped();
/// Called by `fatal` with exit code 1 after the message is printed, when set:
/// the MPI runtime points it at MPI_Abort so that one failing rank brings every
/// rank down. Null by default; if it returns, `fatal` calls std::exit.
extern void (*fatalHook)(int code);

} // namespace carve::rt

#endif // CARVE_RT_KERNELS_H
