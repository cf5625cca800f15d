//===- gpu.h - the CUDA target's kernels, device and communicator ---------===//
//
// What programs compiled with `carve compile --target cuda` call. The
// functions mirror the CPU ones (kernels.h, dist.h, optim.h) name for name and
// argument for argument, so that the generated step reads the same on both
// targets; here every pointer is a device pointer (into the device arena, or
// a `__managed__` constant) and every call is enqueued on the compute stream
// (`computeStream()`) without waiting for it, unless it says otherwise.
//
// Generated CUDA sources say `using namespace carve::gpu;` (not
// carve::rt): the types they need are re-exported below, so an unqualified
// `matmul(...)` finds exactly one function.
//
// This header needs no CUDA header: the runtime's main (train_main.cpp,
// compiled by the C++ compiler) reaches the device only through
// `DeviceTarget` (program.h), which the CUDA library fills in.
//
// Precision (plan field `precision`): the arena holds fp32 (master weights,
// gradients, optimizer state and activations alike); `setPrecision` makes
// matmul and attention round their inputs to bf16 or fp16 and accumulate in
// fp32, on tensor cores. The CPU target does the same rounding in software
// (kernels.h `setPrecision`), so both targets compute the same thing.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_GPU_H
#define CARVE_RT_GPU_H

#include "carve/rt/comm.h"
#include "carve/rt/dist.h"
#include "carve/rt/kernels.h"
#include "carve/rt/optim.h"
#include "carve/rt/pipeline.h"
#include "carve/rt/program.h"

#include <cstdint>
#include <memory>
#include <string>

/// A kernel launch: CARVE_KERNEL(grid, block, sharedBytes, stream, kernel)(args...)
/// is `kernel<<<grid, block, sharedBytes, stream>>>(args...)`. carve's tests
/// run runtime/cuda on a CPU emulation (tests/gpu-emu), whose force-included
/// cuda_emu.h defines it first as a launch that runs every thread of the grid
/// there, checked as a device checks it.
///
/// With CARVE_GPU_PROFILE=1 in the environment, each launch is bracketed by
/// CUDA events (KernelTimer) and the program prints, at exit, the GPU time of
/// every kernel by name (launches during a CUDA graph capture are not timed).
#ifndef CARVE_KERNEL
#define CARVE_KERNEL(grid, block, shared, strm, ...)                                               \
  for (::carve::gpu::KernelTimer carveKernelTimer_(#__VA_ARGS__, strm); carveKernelTimer_.once();) \
  __VA_ARGS__<<<grid, block, shared, strm>>>
#endif

namespace carve::gpu {

/// Times the GPU work enqueued on a stream between its construction and its
/// destruction under the name `name` when CARVE_GPU_PROFILE is set (once()
/// is true the first time only, for CARVE_KERNEL's loop); otherwise it costs
/// a test of a flag. `name` must outlive the program (a string literal).
class KernelTimer {
public:
  KernelTimer(const char *name, void *stream)
      : slot(profiling() ? startTiming(name, stream) : -1) {}
  template <class S>
  KernelTimer(const char *name, S *stream) : KernelTimer(name, static_cast<void *>(stream)) {}
  ~KernelTimer() {
    if (slot >= 0)
      stopTiming(slot);
  }
  KernelTimer(const KernelTimer &) = delete;
  KernelTimer &operator=(const KernelTimer &) = delete;
  bool once() {
    if (done)
      return false;
    done = true;
    return true;
  }
  static bool profiling();
  /// CARVE_GPU_PROFILE=shapes: cuBLAS GEMMs get a row per shape.
  static bool byShape();
  /// `name` kept for the program's life (for names built at run time).
  static const char *intern(const std::string &name);
  /// The event pair's slot (-1: not timed, the stream is capturing).
  static int startTiming(const char *name, void *stream);
  static void stopTiming(int slot);

private:
  int slot;
  bool done = false;
};

// The types a generated program names.
using carve::rt::Binary;
using carve::rt::CommHandle;
using carve::rt::CommType;
using carve::rt::Communicator;
using carve::rt::Compare;
using carve::rt::DataKind;
using carve::rt::DeviceTarget;
using carve::rt::Dims;
using carve::rt::DType;
using carve::rt::Hyperparameters;
using carve::rt::Logic;
using carve::rt::OptimizerKind;
using carve::rt::Precision;
using carve::rt::Program;
using carve::rt::Reduce;
using carve::rt::ReduceOp;
using carve::rt::Schedule;
using carve::rt::Split;
using carve::rt::StepContext;
using carve::rt::TensorSpec;
using carve::rt::TraceSpan;
using carve::rt::Unary;
using carve::rt::waitAll;
// Host-side helpers that touch no tensor memory.
using carve::rt::clipCoefficient;
using carve::rt::fatal;
using carve::rt::fullShape;
using carve::rt::scheduledLr;
using carve::rt::shardShape;

//===--- Device, streams, memory -------------------------------------------===//

/// The stream every kernel below runs on (the current device's; created by
/// `openDevice`). An opaque cudaStream_t.
void *computeStream();
/// The stream collectives run on (comm_nccl_collectives.cpp orders it against
/// the compute stream with events).
void *commStream();
/// Waits for everything enqueued on this device.
void synchronize();
/// After a launch: a fatal error naming `what` and CUDA's message if the
/// launch failed (asynchronous faults surface at the next synchronize).
void checkLaunch(const char *what);

/// fp32 (default), bf16 or fp16 for matmul and attention inputs.
void setPrecision(Precision p);
Precision precision();
/// Plan field `tf32`: matmuls of fp32 inputs (the cuBLAS GEMMs of matmul,
/// batched matmul and the convolutions' GEMMs) through TF32 tensor cores
/// (CUBLAS_COMPUTE_32F_FAST_TF32: inputs rounded to 10 mantissa bits, fp32
/// accumulation and output). Off by default, as PyTorch's matmul default.
void setTf32(bool on);
bool tf32();

/// Reads one float (or double) from device memory, waiting for the compute stream.
float readScalar(const float *p);
double readScalar(const double *p);

//===--- Elementwise (float unless a type is given) ------------------------===//

void unary(Unary f, const float *x, float *y, int64_t n);
void unary_grad(Unary f, const float *x, const float *dy, float *dx, int64_t n);
/// unary_grad reading x as the 16-bit tensor (the precision's format) of its
/// f32 values where `x16` (carve-select-kernels' carve.read16; widened in
/// registers, so the same bits as unary_grad of the f32 view); `dx16` (not
/// null): dx's 16-bit copy written too, the bits toBf16 / toF16 would write
/// (rule 3h), and with `round` dx itself rounded to the format as written
/// (carve.round16, as roundBf16 / roundF16 after it would); a null dx with a
/// copy writes the copy only. The other entries' `y16, round` say the same.
void unary_grad16(Unary f, const void *x, bool x16, const float *dy, float *dx, uint16_t *dx16,
                  bool round, int64_t n);
/// The seed and optimizer step the dropout kernels draw with, written to
/// device memory on the compute stream (outside a captured graph, so that
/// each replay draws its step's masks).
void setDropoutState(uint64_t seed, int64_t step);
/// Dropout: carve::rt::dropout's masks and values, bitwise, with the seed
/// and step that setDropoutState last wrote.
void dropout(const float *x, const carve::rt::philox::DropoutPiece &piece, double p, int64_t node,
             float *y);
void binary(Binary f, const float *a, Dims as, const float *b, Dims bs, float *y, Dims ys);
/// binary with `a` and/or `b` read as their 16-bit tensors (a16, b16) and/or
/// the result's 16-bit copy written too (y16; as unary_grad16).
void binary16(Binary f, const void *a, bool a16, Dims as, const void *b, bool b16, Dims bs,
              float *y, uint16_t *y16, bool round, Dims ys);
/// int64 arithmetic (index computations); Pow has no integer kernel.
void binary(Binary f, const int64_t *a, Dims as, const int64_t *b, Dims bs, int64_t *y, Dims ys);
void compare(Compare f, const float *a, Dims as, const float *b, Dims bs, uint8_t *y, Dims ys);
void compare(Compare f, const int64_t *a, Dims as, const int64_t *b, Dims bs, uint8_t *y, Dims ys);
void logic(Logic f, const uint8_t *a, Dims as, const uint8_t *b, Dims bs, uint8_t *y, Dims ys);
void where(const uint8_t *c, Dims cs, const float *a, Dims as, const float *b, Dims bs, float *y,
           Dims ys);
void where(const uint8_t *c, Dims cs, const int64_t *a, Dims as, const int64_t *b, Dims bs,
           int64_t *y, Dims ys);
/// Instantiated for every pair of {float, double, int64_t, int32_t, uint8_t}.
template <class From, class To> void cast(const From *x, To *y, int64_t n);
/// (float, double, int64_t, int32_t, uint8_t)
template <class T> void fill(T *y, int64_t n, T v);
template <class T> void copy(const T *x, T *y, int64_t n);
/// As kernels.h: carve.round16 in place, and 16-bit copies (same bits as the CPU).
void roundBf16(float *x, int64_t n);
void roundF16(float *x, int64_t n);
void toBf16(const float *x, uint16_t *y, int64_t n);
void fromBf16(const uint16_t *x, float *y, int64_t n);
void toF16(const float *x, uint16_t *y, int64_t n);
void fromF16(const uint16_t *x, float *y, int64_t n);
/// roundBf16(x) then toBf16(x, copy) (roundF16, toF16) in one kernel: the same
/// bits in both (carve-select-kernels' carve.round16_in_copy).
void roundCopyBf16(float *x, uint16_t *copy, int64_t n);
void roundCopyF16(float *x, uint16_t *copy, int64_t n);

//===--- Linear algebra ----------------------------------------------------===//

/// As carve::rt::matmul (NumPy semantics, broadcast batch dims, transA/transB,
/// accumulate), through cuBLAS (strided-batched when the batch folds; fp32
/// with TF32 off, or bf16/fp16 inputs with fp32 accumulation per `precision()`).
void matmul(const float *a, Dims as, bool transA, const float *b, Dims bs, bool transB, float *y,
            Dims ys, bool accumulate = false);
/// matmul where an operand may be stored in the plan's 16-bit format (`a16`,
/// `b16`: a points to bf16/fp16 under a bf16/fp16 precision()): cuBLAS reads it
/// as it is, where matmul would round its f32 view into scratch first; the
/// product is the same, bit for bit (carve-select-kernels' `matmul16`).
void matmul16(const void *a, bool a16, Dims as, bool transA, const void *b, bool b16, Dims bs,
              bool transB, float *y, Dims ys);
/// matmul16 writing the product in the precision's 16-bit format: cuBLAS
/// rounds its fp32 accumulators to nearest even (carve-select-kernels'
/// carve.write16: the 16-bit copy of the product is all the program keeps).
void matmul16_to16(const void *a, bool a16, Dims as, bool transA, const void *b, bool b16, Dims bs,
                   bool transB, void *y, Dims ys);
/// matmul16_to16 with `bias16` (a 16-bit vector of the product's last
/// dimension, the precision's format) added to each row of the fp32
/// product before its one rounding: cuBLASLt's CUBLASLT_EPILOGUE_BIAS, where
/// the batch folds into one GEMM (A not transposed, B shared); otherwise
/// matmul16 into f32 scratch, then the bias added and rounded. The same
/// bits as matmul16 then binary16's add of the bias, rounded
/// (carve-fold-views' "epilogue": the QKV projection's bias add).
void matmul16_bias(const void *a, bool a16, Dims as, bool transA, const void *b, bool b16, Dims bs,
                   bool transB, const void *bias16, uint16_t *y16, Dims ys);
/// How many matmul16_bias calls of this process ran as cuBLASLt matmuls with
/// the bias epilogue (what tests read to know the library path was taken).
int64_t matmulBiasEpilogueCalls();
/// matmul16_bias followed by the tanh GELU in one call: pre16 = the product
/// plus bias16 and y16 = gelu_tanh of that fp32 sum, each rounded once
/// (the product's shape, rows a multiple of 8 for the library path):
/// cuBLASLt's CUBLASLT_EPILOGUE_GELU_AUX_BIAS (pre16 its auxiliary output),
/// where the batch folds into one GEMM; otherwise matmul16 into f32 scratch,
/// then one kernel (the same values). GELU reads the unrounded sum
/// (carve-fold-views' "epilogue" on a GELU: the MLP's input projection).
void matmul16_bias_gelu(const void *a, bool a16, Dims as, bool transA, const void *b, bool b16,
                        Dims bs, bool transB, const void *bias16, uint16_t *pre16, uint16_t *y16,
                        Dims ys);
/// How many matmul16_bias_gelu calls ran as cuBLASLt matmuls with
/// GELU_AUX_BIAS.
int64_t matmulBiasGeluEpilogueCalls();
/// GELU's gradient computed by the matmul of its incoming gradient:
/// y16 = round(gelu_tanh'(x16) * (op(a) op(b))), x16 the 16-bit
/// pre-activation (the product's shape, rows a multiple of 8 for the
/// library path): cuBLASLt's CUBLASLT_EPILOGUE_DGELU with x16 as its
/// auxiliary input, where the batch folds into one GEMM (as matmul16_bias);
/// otherwise matmul16 into f32 scratch, then unary_grad16. The same bits
/// as matmul16 then unary_grad16 (carve-fold-views' "epilogue" on a GELU
/// gradient: the MLP's output projection's data gradient).
void matmul16_dgelu(const void *a, bool a16, Dims as, bool transA, const void *b, bool b16, Dims bs,
                    bool transB, const void *x16, uint16_t *y16, Dims ys);
/// How many matmul16_dgelu calls ran as cuBLASLt matmuls with DGELU.
int64_t matmulDgeluEpilogueCalls();
/// A weight's gradient and its bias's gradient in one GEMM: y16 = a^T b
/// (a [K, R] and b [K, C], both 16-bit in the precision's format; y16
/// [R, C] rounded to it once), and bgrad16 the sums over K of a's columns
/// (`biasOfA`, R of them) or of b's (C), rounded to the format once:
/// cuBLASLt's BGRADB / BGRADA epilogue, which sums the 16-bit values it
/// multiplies (carve-select-kernels' rule 3i: the bias gradient's
/// reduction, which read the same values or their f32 originals, runs
/// inside the weight gradient's GEMM). Where cuBLASLt offers no algorithm
/// (or a pointer is not 16-byte aligned): matmul16_to16, then reduce16 of the
/// 16-bit operand's columns. Not for accumulation (both are overwritten).
void matmul16_to16_bgrad(const void *a, Dims as, const void *b, Dims bs, bool biasOfA,
                         uint16_t *y16, Dims ys, uint16_t *bgrad16);
/// How many matmul16_to16_bgrad calls ran with cuBLASLt's epilogue.
int64_t matmulBiasGradEpilogueCalls();

//===--- Reductions, normalization, attention, loss (float) ----------------===//

void reduce(Reduce f, const float *x, Dims xs, uint32_t axesMask, float *y);
/// reduce reading x as stored in the precision's 16-bit format where `x16`
/// (carve-select-kernels' rule 3g: an exact 16-bit tensor, widened as read),
/// and writing the f32 result `y` and/or its 16-bit copy `y16` (the f32
/// result rounded to nearest even, the bits toBf16 / toF16 write: rule 3h, a
/// bias gradient kept in 16 bits); null: not written.
void reduce16(Reduce f, const void *x, bool x16, Dims xs, uint32_t axesMask, float *y,
              uint16_t *y16);
void softmax(const float *x, Dims xs, int axis, bool log, float *y);
void softmax_grad(const float *y, const float *dy, Dims s, int axis, bool log, float *dx);
void layer_norm(const float *x, Dims xs, int axis, const float *scale, const float *bias, float eps,
                float *y);
void layer_norm_grad(const float *x, Dims xs, int axis, const float *scale, float eps,
                     const float *dy, float *dx, float *dscale, float *dbias);
/// Rotary position embedding and its input gradient (kernels.h's, the same
/// arithmetic: products and sums rounded as written, never contracted).
void rotary(const float *x, Dims xs, const float *cos, Dims cs, const float *sin, Dims ss,
            float *y);
void rotary_grad(const float *dy, Dims xs, const float *cos, Dims cs, const float *sin, Dims ss,
                 float *dx);
/// With x (dy) read as the 16-bit tensor of its values where `x16`
/// (carve.read16), and the result's 16-bit copy `y16` written with it (rule
/// 3h; `round`: the result itself rounded as written, carve.round16; a null
/// y writes the copy only). The same bits as rotary then toBf16 / toF16.
void rotary16(const void *x, bool x16, Dims xs, const float *cos, Dims cs, const float *sin,
              Dims ss, float *y, uint16_t *y16, bool round);
void rotary_grad16(const void *dy, bool dy16, Dims xs, const float *cos, Dims cs, const float *sin,
                   Dims ss, float *dx, uint16_t *dx16, bool round);
void rms_norm(const float *x, Dims xs, int axis, const float *scale, float eps, float *y);
void rms_norm_grad(const float *x, Dims xs, int axis, const float *scale, float eps,
                   const float *dy, float *dx, float *dscale);
/// The norms with the input and/or the scale and bias read as the 16-bit
/// tensors (the precision's format) of their f32 values where flagged
/// (carve.read16: a saved activation, a parameter's 16-bit copy): widened in
/// registers, so the same bits as the f32 entries on the f32 views. The
/// gradients' dscale16, dbias16 (not null): the parameter gradients' 16-bit
/// copies written too (rule 3h; a null dscale with its copy writes the copy
/// only).
void layer_norm16(const void *x, bool x16, Dims xs, int axis, const void *scale, bool scale16,
                  const void *bias, bool bias16, float eps, float *y, uint16_t *y16, bool round);
/// `dx16` (not null): the input gradient's 16-bit copy in the precision's
/// format, written with it (rounded to nearest even: the bits toBf16 / toF16
/// write; carve-select-kernels' rule 3h); `dx` null: only the copy.
void layer_norm_grad16(const void *x, bool x16, Dims xs, int axis, const void *scale, bool scale16,
                       float eps, const float *dy, float *dx, uint16_t *dx16, float *dscale,
                       float *dbias, uint16_t *dscale16, uint16_t *dbias16);
void rms_norm16(const void *x, bool x16, Dims xs, int axis, const void *scale, bool scale16,
                float eps, float *y, uint16_t *y16, bool round);
void rms_norm_grad16(const void *x, bool x16, Dims xs, int axis, const void *scale, bool scale16,
                     float eps, const float *dy, float *dx, uint16_t *dx16, float *dscale,
                     uint16_t *dscale16);
/// The norm gradients with the add after them computed in the same pass
/// (carve-select-kernels' rule 4c, the backward's residual connection): the
/// input gradient is added to `residual` and the sum written to `dx` and
/// its 16-bit copy `dx16` (the precision's format, rounded to nearest even;
/// either may be null) instead of the input gradient. The same bits as the
/// gradient followed by binary(Add) (and its copy).
void layer_norm_grad_add(const float *x, Dims xs, int axis, const float *scale, float eps,
                         const float *dy, const float *residual, float *dx, float *dscale,
                         float *dbias);
void layer_norm_grad_add16(const void *x, bool x16, Dims xs, int axis, const void *scale,
                           bool scale16, float eps, const float *dy, const float *residual,
                           float *dx, uint16_t *dx16, float *dscale, float *dbias,
                           uint16_t *dscale16, uint16_t *dbias16);
void rms_norm_grad_add(const float *x, Dims xs, int axis, const float *scale, float eps,
                       const float *dy, const float *residual, float *dx, float *dscale);
void rms_norm_grad_add16(const void *x, bool x16, Dims xs, int axis, const void *scale,
                         bool scale16, float eps, const float *dy, const float *residual, float *dx,
                         uint16_t *dx16, float *dscale, uint16_t *dscale16);
/// Fused, tiled attention (online softmax): never writes the [Tq, Tk] score
/// matrix. Same semantics as carve::rt::attention.
void attention(const float *q, Dims qs, const float *k, Dims ks, const float *v, Dims vs,
               const float *mask, Dims ms, float scale, bool causal, float *y);
void attention_grad(const float *q, Dims qs, const float *k, Dims ks, const float *v, Dims vs,
                    const float *mask, Dims ms, float scale, bool causal, const float *dy,
                    float *dq, float *dk, float *dv);
/// attention, and each query row's log-sum-exp of its scaled, masked scores
/// into lse ([..., Tq], -inf for a row that sees no key): what
/// attention_grad_stats reads instead of running the forward again.
void attention_stats(const float *q, Dims qs, const float *k, Dims ks, const float *v, Dims vs,
                     const float *mask, Dims ms, float scale, bool causal, float *y, float *lse);
/// attention_grad from attention_stats' output `o` and `lse`: bit for bit
/// what attention_grad computes, without its forward.
void attention_grad_stats(const float *q, Dims qs, const float *k, Dims ks, const float *v, Dims vs,
                          const float *mask, Dims ms, float scale, bool causal, const float *o,
                          const float *lse, const float *dy, float *dq, float *dk, float *dv);
/// attention_stats and attention_grad_stats through cuDNN's fused flash
/// attention (runtime/cuda/attention_cudnn.cpp): under a bf16 or fp16
/// precision, one cuDNN graph each, built once per shape; the same inputs
/// and outputs. Where cuDNN cannot take the call (fp32, a mask tensor, a
/// head dimension it lacks, no engine on this GPU, CARVE_CUDNN_ATTENTION=off)
/// carve's kernel runs, and the first such call of a shape says why on stderr.
/// The forward's q16, k16, v16: the 16-bit copies (the precision's format)
/// of q, k, v where the program made them before the call (carve.read16;
/// null: the call converts); q, k, v themselves null where the program keeps
/// only the copy (the fallback widens it). `y16` (rank-4 operands): O written
/// there in the precision's 16-bit format as [b, t, h, d] instead of `y`
/// (carve-fold-views' "producer" on O's transpose: its 16-bit copy).
/// `inRowStride16` > 0 (rank-4 operands, all three copies given, q, k, v
/// null): the copies are read as [b, t, h, d] whose rows of h * d are that
/// many elements apart, columns of one wider tensor (carve-fold-views'
/// "strided": q, k and v read in place from the QKV projection's copy).
void attention_stats_cudnn(const float *q, const void *q16, Dims qs, const float *k,
                           const void *k16, Dims ks, const float *v, const void *v16, Dims vs,
                           const float *mask, Dims ms, float scale, bool causal, float *y,
                           float *lse, uint16_t *y16 = nullptr, int64_t inRowStride16 = 0);
/// The gradient's q, k and v may be the 16-bit tensors (bf16 or fp16, the
/// precision's) that the f32 operands would be views of (`q16` ...:
/// carve-select-kernels' carve.read16): the graph reads them as stored.
/// `dyBthd`: dy is given as [b, t, h, d] (its transpose to [b, h, t, d],
/// carve-fold-views' "consumer", done by cuDNN's strided input).
/// `bthd`: dq, dk and dv are written as [b, t, h, d], their dimensions 1 and
/// 2 exchanged (rank-4 operands; carve-fold-views' "producer" transposes,
/// done by cuDNN's strided outputs). `dq16`, `dk16`, `dv16` (all three, with
/// `bthd`; dq, dk, dv then unused): the gradients written in the precision's
/// 16-bit format there instead, as [b, t, h, d] whose rows of h * d are
/// `rowStride16` elements apart (carve-fold-views' "assemble": the pieces of
/// the QKV gradient's 16-bit copy); without `bthd` (rowStride16 0), shaped
/// as q, k and v (carve-round-operands16's copies of the gradients, which
/// their readers read in 16 bits; dq, dk, dv, where not null, written in f32
/// too). `o16`: o read there instead, in the
/// precision's 16-bit format as [b, t, h, d] (where attention_stats_cudnn
/// wrote it as y16). `dy16`: dy read there instead, in the precision's
/// 16-bit format, laid out as `dyBthd` says (its matmul wrote it so:
/// carve.write16). `inRowStride16` > 0 (q16, k16 and v16 all set): q, k and
/// v are read as attention_stats_cudnn reads them with it.
void attention_grad_stats_cudnn(const void *q, bool q16, Dims qs, const void *k, bool k16, Dims ks,
                                const void *v, bool v16, Dims vs, const float *mask, Dims ms,
                                float scale, bool causal, const float *o, const float *lse,
                                const float *dy, float *dq, float *dk, float *dv, bool bthd = false,
                                bool dyBthd = false, uint16_t *dq16 = nullptr,
                                uint16_t *dk16 = nullptr, uint16_t *dv16 = nullptr,
                                int64_t rowStride16 = 0, const uint16_t *o16 = nullptr,
                                const uint16_t *dy16 = nullptr, int64_t inRowStride16 = 0);
/// How many attention calls of this process ran as cuDNN graphs (forward,
/// backward): what tests read to know the library path was taken.
void cudnnAttentionCalls(int64_t &forward, int64_t &backward);
/// Whether this runtime was built with cuDNN (otherwise the _cudnn entries
/// are carve's kernels).
bool cudnnAttentionBuilt();
/// A 2-D convolution's geometry: carve.conv2d's attributes (pads are
/// [top, left, bottom, right]).
struct Conv2dGeometry {
  int64_t strides[2];
  int64_t pads[4];
  int64_t dilations[2];
  int64_t group;
};
/// carve.conv2d (no bias: the compiler adds it after) and its gradients on
/// the CUDA target (runtime/cuda/conv_cudnn.cpp): x [N, C, H, W], w
/// [O, C / group, kh, kw], y [N, O, Ho, Wo], all f32 as the program stores
/// them. Each runs as one cuDNN convolution graph, built once per shape and
/// cached, on an engine cuDNN's heuristics rank first among those that are
/// deterministic (and, under fp32 without the plan field tf32, neither
/// tensor-core nor Winograd nor FFT: fp32 arithmetic, as the CPU target's
/// GEMMs). Under bf16/fp16 the operands are read in the 16-bit format
/// (rounded as the CPU target's matmul rounds its operands), the sums kept in
/// f32 and the result written in 16 bits, then widened. Where cuDNN cannot
/// take the call (no engine, a misaligned tensor, CARVE_CUDNN_CONVOLUTION=off,
/// a runtime built without cuDNN) carve's direct kernel computes the same
/// thing, and the first such call of a shape says why on stderr. An operand
/// whose flag (x16, w16, dy16) is set is given as the 16-bit tensor (the
/// precision's format) of its values (carve.read16: a weight's copy, a saved
/// activation, a copy its writer made) and read as stored; the others are
/// f32. `y16` (bf16/fp16 plans, may be null): the result also written there
/// in the precision's 16-bit format, the bits the graph computes (rule 3h:
/// its 16-bit copy); `y` then may be null (no f32 result stored).
void conv2d(const void *x, bool x16, Dims xs, const void *w, bool w16, Dims ws, Conv2dGeometry g,
            float *y, uint16_t *y16, Dims ys);
/// dx from dy [N, O, Ho, Wo] and w; dx's shape is the convolution's input's.
void conv2d_grad_input(const void *dy, bool dy16, Dims ys, const void *w, bool w16, Dims ws,
                       Conv2dGeometry g, float *dx, uint16_t *dx16, Dims xs);
/// dw from the convolution's input x and dy.
void conv2d_grad_weight(const void *x, bool x16, Dims xs, const void *dy, bool dy16, Dims ys,
                        Conv2dGeometry g, float *dw, uint16_t *dw16, Dims ws);
/// How many convolution calls of this process ran as cuDNN graphs (forward,
/// data gradient, filter gradient): what tests read to know the library path
/// was taken.
void cudnnConvolutionCalls(int64_t &forward, int64_t &data, int64_t &filter);

/// Targets outside [0, C) (and not ignored) are a fatal error naming the value
/// (checked on the device, reported at the next synchronize).
void cross_entropy(const float *logits, Dims ls, const int64_t *targets, int reduction,
                   bool hasIgnore, int64_t ignoreIndex, float *y);
void cross_entropy_grad(const float *logits, Dims ls, const int64_t *targets, int reduction,
                        bool hasIgnore, int64_t ignoreIndex, const float *dy, float *dlogits);
/// cross_entropy reading logits stored in the precision's 16-bit format (the
/// same loss as cross_entropy of their f32 values; carve.read16).
void cross_entropy16(const void *logits, Dims ls, const int64_t *targets, int reduction,
                     bool hasIgnore, int64_t ignoreIndex, float *y);
/// cross_entropy_grad with the logits (`l16`) and/or the gradient (`d16`,
/// rounded to nearest even as written: carve.write16) in the precision's
/// 16-bit format: the values cross_entropy_grad computes from the logits'
/// f32 values, then rounded.
void cross_entropy_grad16(const void *logits, bool l16, Dims ls, const int64_t *targets,
                          int reduction, bool hasIgnore, int64_t ignoreIndex, const float *dy,
                          void *dlogits, bool d16);
/// cross_entropy16 (or cross_entropy, without `l16`) and cross_entropy_grad16
/// in one pass over the logits (carve-select-kernels' rule 3j: the loss
/// computed where its gradient is, the forward's call left to train
/// --eval-data): y as the one writes it and dlogits as the other does, bit
/// for bit (the same row statistics, the same partial sums); dlogits may be
/// the logits themselves (each element read before it is written). Logits
/// with a class stride (classes not on the last axis): the two calls.
void cross_entropy_with_grad(const void *logits, bool l16, Dims ls, const int64_t *targets,
                             int reduction, bool hasIgnore, int64_t ignoreIndex, const float *dy,
                             void *dlogits, bool d16, float *y);

//===--- Data movement (float, int64_t, int32_t, uint8_t) ------------------===//

template <class T> void transpose(const T *x, Dims xs, Dims perm, T *y);
/// transpose<float> writing the result's 16-bit copy too (as concat16).
void transpose16(const float *x, Dims xs, Dims perm, float *y, uint16_t *y16, bool round);
/// expand writing the result's 16-bit copy y16 too (rule 3h: grouped-query
/// attention's repeated keys and values; `round`: y rounded as written, a
/// null y: the copy only).
void expand16(const float *x, Dims xs, Dims ys, float *y, uint16_t *y16, bool round);
/// transpose (transpose16) of a strided view of a tensor: x points at the
/// view's first element, xs is the view's shape and xst its strides in
/// elements (carve-fold-views: a slice read in place by its transposes,
/// through reshapes). The same values as materializing the view first.
template <class T> void transpose_view(const T *x, Dims xs, Dims xst, Dims perm, T *y);
void transpose16_view(const float *x, Dims xs, Dims xst, Dims perm, float *y, uint16_t *y16,
                      bool round);
template <class T> void slice(const T *x, Dims xs, Dims starts, Dims steps, T *y, Dims ys);
template <class T> void slice_grad(const T *dy, Dims ys, Dims starts, Dims steps, T *dx, Dims xs);
template <class T> void concat(int n, const T *const *xs, const Dims *shapes, int axis, T *y);
/// concat<float> writing the result's 16-bit copy (the precision's format,
/// the bits toBf16 / toF16 would write) as well (carve-select-kernels' rule 3h).
void concat16(int n, const float *const *xs, const Dims *shapes, int axis, float *y, uint16_t *y16,
              bool round);
template <class T>
void gather(const T *table, Dims ts, const int64_t *idx, Dims is, int axis, T *y);
/// gather<float> from the 16-bit tensor (the precision's format) of a float
/// table (carve.read16: a parameter's 16-bit copy), widened as it is read.
void gather16(const void *table, Dims ts, const int64_t *idx, Dims is, int axis, float *y);
template <class T>
void gather_grad(const T *dy, const int64_t *idx, Dims is, int axis, T *dtable, Dims ts);
/// gather_grad of floats that also writes the sums' 16-bit copies (the
/// precision's format, rounded to nearest even: toBf16 / toF16's bits) in
/// the same kernel (carve-select-kernels' rule 3h: an embedding's 16-bit
/// gradient); `dtable` holds the f32 sums as they are added.
void gather_grad16(const float *dy, const int64_t *idx, Dims is, int axis, float *dtable, Dims ts,
                   uint16_t *dtable16);
template <class T> void expand(const T *x, Dims xs, T *y, Dims ys);
template <class T> void nonzero(const T *x, Dims xs, int64_t *y);

/// The budget of matmul_gathered's and matmul_gather_grad's scratch: the
/// gathered operand (the product) goes a piece of samples at a time, at most
/// this many bytes (at least one sample).
constexpr int64_t kGatheredPieceBytes = int64_t(256) << 20;

/// As carve::rt::matmul_gathered: matmul(a, b) with b = gather(table, idx,
/// last axis) viewed as `bs`, without b whole in memory (an im2col
/// convolution's windows, kernel-size times the image). b is gathered a
/// piece of its first dimension (the samples; whole table rows each) at a
/// time into scratch (`pieceBytes`), and multiplied by matmul's
/// strided-batched GEMM: an implicit GEMM through cuBLAS. `a` is pieced with
/// it when it has that dimension, else shared (a weight, grouped or not).
/// With one sample, or a b without the result's first dimension, b is
/// gathered whole first.
void matmul_gathered(const float *a, Dims as, bool transA, const float *table, Dims ts,
                     const int64_t *idx, Dims is, Dims bs, bool transB, float *y, Dims ys,
                     int64_t pieceBytes = kGatheredPieceBytes);
/// As carve::rt::matmul_gather_grad: gather_grad(op(a) @ op(b) viewed as
/// the table's rows, idx, last axis) without the product whole in memory
/// (an im2col convolution's input gradient). The indices are inverted once;
/// each piece of samples' product goes to scratch and its table rows are
/// summed from it in gather_grad's order, so the result is gather_grad's of
/// matmul's product, bitwise where the GEMMs are.
void matmul_gather_grad(const float *a, Dims as, bool transA, const float *b, Dims bs, bool transB,
                        Dims ys, const int64_t *idx, Dims is, float *dtable, Dims ts,
                        int64_t pieceBytes = kGatheredPieceBytes);

//===--- Tensor parallelism (dist.h on device pointers) --------------------===//

void takeShard(const void *full, Dims fullShape, Split s, int index, void *local, int elemBytes);
void placeShard(const void *local, Dims localShape, Split s, int index, void *full, int elemBytes);
void allGatherSplit(Communicator &c, const void *local, Dims localShape, Split s, void *full,
                    CommType t);
void reduceScatterSplit(Communicator &c, const void *full, Dims fullShape, Split s, void *local,
                        CommType t, ReduceOp op);
void allToAllSplit(Communicator &c, const void *in, Dims inLocalShape, Split from, Split to,
                   void *out, CommType t);
void gather_sharded(const float *table, Dims ts, int64_t rowOffset, int64_t globalRows,
                    const int64_t *idx, Dims is, float *y);
void gather_sharded_grad(const float *dy, const int64_t *idx, Dims is, int64_t rowOffset,
                         int64_t globalRows, float *dtable, Dims ts);
void cross_entropy_vocab_parallel(Communicator &c, const float *logits, Dims ls,
                                  int64_t vocabOffset, const int64_t *targets, int reduction,
                                  bool hasIgnore, int64_t ignoreIndex, float *y);
/// carve::rt::count_correct on device logits and targets; `counts` is host
/// memory (it waits for the device).
void count_correct(Communicator *c, const float *logits, Dims ls, int64_t vocabOffset,
                   const int64_t *targets, bool hasIgnore, int64_t ignoreIndex, double *counts);
/// count_correct of logits stored in the precision's 16-bit format.
void count_correct16(Communicator *c, const void *logits, Dims ls, int64_t vocabOffset,
                     const int64_t *targets, bool hasIgnore, int64_t ignoreIndex, double *counts);
void cross_entropy_vocab_parallel_grad(Communicator &c, const float *logits, Dims ls,
                                       int64_t vocabOffset, const int64_t *targets, int reduction,
                                       bool hasIgnore, int64_t ignoreIndex, const float *dy,
                                       float *dlogits);

//===--- Optimizer (optim.h on device pointers) ----------------------------===//

void sgdUpdate(float *p, const float *g, float *buf, int64_t n, double lr, double momentum,
               double dampening, double weightDecay, bool nesterov, bool firstStep);
void adamwUpdate(float *p, const float *g, float *m, float *v, int64_t n, double lr, double beta1,
                 double beta2, double eps, double weightDecay, int64_t step);
/// Sum of squares in double; waits for the result.
double sumSquares(const float *g, int64_t n);
/// The gradient norm's accumulators: two device doubles, zeroed on the
/// compute stream (valid until the next call).
double *normAccumulators();
/// *acc += the sum of squares of g (in double, as sumSquares computes it),
/// enqueued without waiting: the generated step adds every gradient this way
/// and reads the two sums once (readScalars), so they equal the host's
/// `sq += sumSquares(g)` in the same order, bit for bit.
void sumSquaresAdd(const float *g, int64_t n, double *acc);
/// Copies n doubles from the device to `host`, waiting for the compute stream.
void readScalars(const double *p, double *host, int n);
void addInPlace(float *dst, const float *src, int64_t n);
void scaleInPlace(float *g, int64_t n, float s);
/// A 16-bit gradient in device memory: optim.h's Grad16, a type of this
/// namespace so that a call finds these functions only (not, through the
/// argument's namespace, carve::rt's host ones).
struct Grad16 {
  uint16_t *p = nullptr;
  bool f16 = false;
  Grad16 operator+(int64_t k) const { return {p + k, f16}; }
};
// The same on 16-bit gradients.
void sgdUpdate(float *p, Grad16 g, float *buf, int64_t n, double lr, double momentum,
               double dampening, double weightDecay, bool nesterov, bool firstStep);
void adamwUpdate(float *p, Grad16 g, float *m, float *v, int64_t n, double lr, double beta1,
                 double beta2, double eps, double weightDecay, int64_t step);
/// adamwUpdate of an fp32 master `p` that also writes its 16-bit copy (bf16,
/// or fp16 with `copyF16`) in the same kernel: the bits toBf16 / toF16 of the
/// updated master would write, without reading it again.
void adamwUpdateCopy16(float *p, const float *g, float *m, float *v, int64_t n, double lr,
                       double beta1, double beta2, double eps, double weightDecay, int64_t step,
                       uint16_t *copy, bool copyF16);
void adamwUpdateCopy16(float *p, Grad16 g, float *m, float *v, int64_t n, double lr, double beta1,
                       double beta2, double eps, double weightDecay, int64_t step, uint16_t *copy,
                       bool copyF16);
double sumSquares(Grad16 g, int64_t n);
void sumSquaresAdd(Grad16 g, int64_t n, double *acc);

/// The multi-tensor optimizer (carve-select-kernels' `adamwMulti` and
/// `sumSquaresMulti` on the CUDA target): every parameter of the step in one
/// launch, bit for bit the per-tensor calls above.
///
/// One tensor of adamwMulti: the fp32 parameter (or its master), its
/// gradient (f32, or 16-bit: gradKind 1 bf16, 2 fp16), its moments, the
/// 16-bit copy the update writes (null: none) and its elements.
struct AdamwTensor {
  float *p = nullptr;
  const void *g = nullptr;
  float *m = nullptr, *v = nullptr;
  uint16_t *copy = nullptr;
  int64_t n = 0;
  int gradKind = 0;
};
AdamwTensor adamwTensor(float *p, const float *g, float *m, float *v, int64_t n,
                        uint16_t *copy = nullptr);
AdamwTensor adamwTensor(float *p, Grad16 g, float *m, float *v, int64_t n,
                        uint16_t *copy = nullptr);
/// adamwUpdate (adamwUpdateCopy16 where a copy is given, in `copyF16`'s
/// format) of every tensor, in one launch. `site` names the call: the table
/// goes to the device when its contents change (the first step), not every
/// step; a change while a CUDA graph is captured is fatal.
void adamwMulti(int site, const AdamwTensor *t, int count, bool copyF16, double lr, double beta1,
                double beta2, double eps, double weightDecay, int64_t step);
/// One tensor of sgdMulti: the fp32 parameter (or master), its gradient,
/// its momentum buffer (null: none), the 16-bit copy to write (null: none).
struct SgdTensor {
  float *p = nullptr;
  const void *g = nullptr;
  float *buf = nullptr;
  uint16_t *copy = nullptr;
  int64_t n = 0;
  int gradKind = 0;
};
SgdTensor sgdTensor(float *p, const float *g, float *buf, int64_t n, uint16_t *copy = nullptr);
SgdTensor sgdTensor(float *p, Grad16 g, float *buf, int64_t n, uint16_t *copy = nullptr);
/// sgdUpdate of every tensor (then, where a copy is given, toBf16 / toF16 of
/// the update into it), in one launch; `site` as adamwMulti's.
void sgdMulti(int site, const SgdTensor *t, int count, bool copyF16, double lr, double momentum,
              double dampening, double weightDecay, bool nesterov, bool firstStep);
/// One term of sumSquaresMulti: a gradient, its elements, the accumulator.
struct SquaresTerm {
  const void *g = nullptr;
  int64_t n = 0;
  int gradKind = 0;
  int acc = 0;
};
SquaresTerm squaresTerm(const float *g, int64_t n, int acc);
SquaresTerm squaresTerm(Grad16 g, int64_t n, int acc);
/// acc[t.acc] += the sum of squares of each term's gradient, in the terms'
/// order, in two launches: bit for bit sumSquaresAdd per term.
void sumSquaresMulti(int site, const SquaresTerm *t, int count, double *acc);
void scaleInPlace(Grad16 g, int64_t n, float s);
void addInPlace(Grad16 dst, Grad16 src, int64_t n);
void addInPlace(float *dst, Grad16 src, int64_t n);
void widen(Grad16 src, float *dst, int64_t n);

//===--- CUDA graphs (train --cuda-graph) -----------------------------------===//

/// Runs `body`, the generated step's forward and backward with their
/// collectives. Without `ctx.cudaGraph`, simply calls it. With it: calls it
/// on the first step (the warm-up: scratch buffers reach their sizes, NCCL
/// connects to its peers), captures it into a CUDA graph on the second
/// (nothing runs while capturing) and from then on launches the graph, one
/// launch for every kernel and collective of the forward and backward; then
/// waits for the graph, bounded by --collective-timeout (a rank that died or
/// stopped inside a captured collective ends the job with one line instead
/// of a hang). Sets `ctx.graphNodes` once captured. Every rank must capture
/// at the same step (NCCL's rule for captured collectives), which the same
/// flag on every rank gives. Fatal, naming the cause, when the capture fails
/// or the body or arena changes after it.
void graphStep(StepContext &ctx, void (*body)(StepContext &));

//===--- The target the runtime's main drives -------------------------------===//

/// Filled in by the CUDA library (device.cu); generated CUDA programs point
/// Program::device at it.
extern const DeviceTarget kCudaTarget;

/// The NCCL communicator over the ranks of `bootstrap` (an MPI group, or the
/// world made from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT): rank 0 makes the
/// unique id and broadcasts it through `bootstrap`. Null with `error` set on
/// failure. Sub-communicators come from `split` (ncclCommSplit).
std::unique_ptr<Communicator> makeNcclCommunicator(Communicator &bootstrap, std::string &error);

} // namespace carve::gpu

#endif // CARVE_RT_GPU_H
