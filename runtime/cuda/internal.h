//===- internal.h - what the CUDA runtime's sources share -----------------===//
//
// Private to runtime/cuda/: error checking, the compute and collective
// streams as CUDA types, the cuBLAS handle, launch sizes, the device error
// record kernels report bad data through, and grow-only device scratch.
// device.cu defines the functions declared here.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_CUDA_INTERNAL_H
#define CARVE_RT_CUDA_INTERNAL_H

#include "carve/rt/gpu.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

/// Fatal error naming the call and CUDA's message when `call` fails.
#define CARVE_CUDA_CHECK(call)                                                                     \
  do {                                                                                             \
    cudaError_t carveErr_ = (call);                                                                \
    if (carveErr_ != cudaSuccess)                                                                  \
      carve::rt::fatal("CUDA: %s failed: %s (%s:%d)", #call, cudaGetErrorString(carveErr_),        \
                       __FILE__, __LINE__);                                                        \
  } while (0)

/// Fatal error naming the call and cuBLAS's message when `call` fails.
#define CARVE_CUBLAS_CHECK(call)                                                                   \
  do {                                                                                             \
    cublasStatus_t carveStatus_ = (call);                                                          \
    if (carveStatus_ != CUBLAS_STATUS_SUCCESS)                                                     \
      carve::rt::fatal("CUDA: %s failed: %s (%s:%d)", #call, cublasGetStatusString(carveStatus_),  \
                       __FILE__, __LINE__);                                                        \
  } while (0)

namespace carve::gpu {

/// The compute stream (every kernel and GEMM runs on it).
inline cudaStream_t stream() { return static_cast<cudaStream_t>(computeStream()); }
/// The stream NCCL collectives run on.
inline cudaStream_t commStreamHandle() { return static_cast<cudaStream_t>(commStream()); }

/// The process's cuBLAS handle for the current device, bound to the compute
/// stream with a fixed workspace (so GEMMs never allocate, which keeps them
/// capturable in CUDA graphs). Created by the first call.
cublasHandle_t cublas();
/// The process's cuBLASLt handle (matmuls with an epilogue: matmul16_bias),
/// and the workspace it shares with cuBLAS (both run on the compute stream).
cublasLtHandle_t cublasLt();
void *blasWorkspace(size_t &bytes);

/// Threads per block of the elementwise kernels.
constexpr int kThreads = 256;
/// Blocks for a grid-stride loop over n elements: enough to fill the GPU,
/// never more than the loop needs, at least 1 (callers return early on n == 0:
/// a launch of 0 blocks is an error).
inline int blocksFor(int64_t n, int threads = kThreads) {
  constexpr int64_t kMaxBlocks = 65535 * 8;
  int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 1 ? 1 : b > kMaxBlocks ? kMaxBlocks : b);
}

/// True while graphStep captures the step's forward and backward: whatever
/// would wait on the host or copy host memory then is an error (it would not
/// be repeated by the graph's replays).
bool capturing();

/// Aborts every NCCL communicator of this process (comm_nccl.cpp), so that no
/// NCCL kernel is left spinning on the device when a rank gives up on work it
/// enqueued (a CUDA graph that never completes); then the caller exits.
void abortCommunicators();

/// After a CUDA graph capture that failed half-way: every NCCL communicator
/// forgets the operations started while capturing (comm_nccl.cpp), so that
/// the step can run eagerly.
void discardCapturedCollectives();

//===--- Bad data found on the device --------------------------------------===//
//
// A kernel that meets a value the CPU kernel would stop on (a target outside
// [0, C), an index out of range) records it here and carries on; the next
// synchronize turns the record into the CPU kernel's message. Only the first
// error is kept (atomicCAS on `code`).

enum DeviceErrorCode : int {
  kNoDeviceError = 0,
  /// "cross_entropy: target <a> at element <b> is outside [0, <c>)"
  kBadTarget = 1,
  /// "gather: index <a> at element <b> is outside [-<c>, <c>)"
  kBadIndex = 2,
};

struct DeviceError {
  int code;
  long long a, b, c;
};

/// The record in device memory (zeroed by open).
DeviceError *deviceError();
/// Its `code` field.
int *deviceErrorFlag();
/// Reads the record (waiting for the device); if a kernel wrote one, clears
/// it, sets `message` to one line and returns true.
bool takeDeviceError(std::string &message);

#if defined(__CUDACC__) || defined(CARVE_CUDA_EMULATION)
/// Records the first bad value found on the device.
__device__ inline void raiseDeviceError(DeviceError *e, int code, long long a, long long b,
                                        long long c) {
  if (atomicCAS(&e->code, 0, code) == 0) {
    e->a = a;
    e->b = b;
    e->c = c;
  }
}
#endif

//===--- Scratch -----------------------------------------------------------===//

/// Slots of `workspace`: one per user, so that temporaries of one call never
/// alias those of another still in flight.
enum WorkspaceSlot : int {
  kWsBasic0 = 0, // kernels_basic.cu, kernels_matmul.cu, kernels_data.cu, kernels_optim.cu
  kWsBasic1 = 1,
  kWsBasic2 = 2,
  kWsFused0 = 3, // kernels_fused.cu, kernels_loss.cu, kernels_attention.cu
  kWsFused1 = 4,
  kWsFused2 = 5,
  kWsComm0 = 6, // comm_nccl.cpp
  kWsComm1 = 7,
  kWsNorm = 8, // the gradient norm's accumulators (normAccumulators)
  kWsAttn = 9, // attention_cudnn.cpp: 16-bit copies, cuDNN's workspace
  // Arrival counters (kernels_basic.cu's single-launch column reduction):
  // zeroed when the slot grows, and every kernel that counts in it sets its
  // counters back to zero before it ends.
  kWsCounters = 10,
  kWsConv = 11, // conv_cudnn.cpp: 16-bit operands, cuDNN's workspace
  kNumWorkspaceSlots = 12,
};

/// At least `bytes` of device memory (256-byte aligned) for slot `slot`,
/// valid until the next call with the same slot asks for more. Grows by
/// waiting for the device first, so work already enqueued that reads the old
/// buffer finishes before it is freed; never shrinks. Fatal when it would
/// grow while a CUDA graph is captured or after one was (the graph keeps the
/// old address; graphStep's warm-up step sizes every slot first).
void *workspace(size_t bytes, int slot);

/// y[r * ldy + c] = x[r * cols + c] rounded to the precision's 16-bit format
/// (the bits toBf16 / toF16 write) for r < rows, c < cols: f32 rows stored
/// into 16-bit rows of a wider tensor (kernels_data.cu; the fallback of
/// attention_grad_stats_cudnn's 16-bit gradients).
void store16Rows(const float *x, int64_t rows, int64_t cols, uint16_t *y, int64_t ldy);

/// y[bi, hi, ti, di] (f32, [b, h, t, d] row-major) = x[(bi * t + ti) * ldx +
/// hi * d + di] widened from the precision's 16-bit format: a 16-bit
/// [b, t, h, d] tensor whose rows are ldx elements apart read as [b, h, t, d]
/// (kernels_data.cu; the fallback of cuDNN attention's strided inputs).
void load16Bthd(const uint16_t *x, int64_t b, int64_t t, int64_t h, int64_t d, int64_t ldx,
                float *y);

} // namespace carve::gpu

#endif // CARVE_RT_CUDA_INTERNAL_H
