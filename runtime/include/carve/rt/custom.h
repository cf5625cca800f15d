/*===- custom.h - the ABI of user-defined kernels (rules files) -----------===*
 *
 * A custom op (`carve compile --rules RULES.json`, docs/custom-ops.md) is
 * computed by two functions the user writes in C++ and names in the rules
 * file. The generated program declares and calls them with C linkage:
 *
 *   extern "C" void FORWARD(const CarveTensor *in, int nin,
 *                           CarveTensor *out, int nout);
 *   extern "C" void BACKWARD(const CarveTensor *in, int nin,
 *                            const CarveTensor *outGrad, int nout,
 *                            CarveTensor *inGrad);
 *
 * FORWARD computes every output from the inputs. BACKWARD gets the same
 * inputs and the gradient of the loss with respect to each output (zeros for
 * an output no gradient reaches) and computes the gradient of each input
 * (inGrad[k] has the shape and type of in[k]; gradients of integer inputs are
 * ignored).
 *
 * - Shapes are the calling rank's local shapes: with tensor parallelism a
 *   split dimension arrives divided by tp, exactly as the op's annotation
 *   allows. A kernel written for any shape therefore works on every rank.
 * - Tensors are dense, row-major (C order), contiguous, 64-byte aligned.
 * - Outputs and input gradients arrive uninitialized: write every element.
 * - Inputs must not be written. Outputs never alias inputs.
 * - Kernels run on the rank's thread; they may use OpenMP (the program is
 *   compiled and linked with the runtime's flags, -fopenmp included).
 *
 * The CUDA target (`--target cuda`, the rules file's "cuda" section) calls
 * kernels of the same shape with one more argument, the rank's compute
 * stream:
 *
 *   extern "C" void FORWARD(const CarveTensor *in, int nin,
 *                           CarveTensor *out, int nout, CarveStream stream);
 *   extern "C" void BACKWARD(const CarveTensor *in, int nin,
 *                            const CarveTensor *outGrad, int nout,
 *                            CarveTensor *inGrad, CarveStream stream);
 *
 * - `data` points into device memory (the CarveTensor array itself is on the
 *   host and lives only for the call).
 * - Enqueue all work on `stream` (a cudaStream_t) and return: do not
 *   synchronize, allocate or free device memory, or use the legacy default
 *   stream. The program checks for a launch error after the call and names
 *   the op; `train --cuda-graph` captures the call into a CUDA graph, which
 *   these rules keep legal.
 *
 * This header is C and C++.
 *===----------------------------------------------------------------------===*/

#ifndef CARVE_RT_CUSTOM_H
#define CARVE_RT_CUSTOM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Element types (CarveTensor::dtype). */
enum CarveDType {
  CARVE_F32 = 0,
  CARVE_F64 = 1,
  CARVE_I64 = 2,
  CARVE_I32 = 3,
  CARVE_BOOL = 4 /* one byte per element, 0 or 1 */
};

/** The most dimensions a tensor passed to a custom kernel has. */
#define CARVE_MAX_RANK 8

typedef struct CarveTensor {
  void *data;                   /* the first element */
  int dtype;                    /* a CarveDType */
  int rank;                     /* 0 for a scalar */
  int64_t dims[CARVE_MAX_RANK]; /* dims[0..rank) */
} CarveTensor;

/** The number of elements of `t`. */
static inline int64_t carve_numel(const CarveTensor *t) {
  int64_t n = 1;
  for (int d = 0; d < t->rank; ++d)
    n *= t->dims[d];
  return n;
}

/** The stream a CUDA kernel enqueues its work on: the same type as
 *  cudaStream_t, declared here without the CUDA headers. */
typedef struct CUstream_st *CarveStream;

typedef void (*CarveForwardKernel)(const CarveTensor *in, int nin, CarveTensor *out, int nout);
typedef void (*CarveBackwardKernel)(const CarveTensor *in, int nin, const CarveTensor *outGrad,
                                    int nout, CarveTensor *inGrad);
typedef void (*CarveCudaForwardKernel)(const CarveTensor *in, int nin, CarveTensor *out,
                                       int nout, CarveStream stream);
typedef void (*CarveCudaBackwardKernel)(const CarveTensor *in, int nin,
                                        const CarveTensor *outGrad, int nout,
                                        CarveTensor *inGrad, CarveStream stream);

#ifdef __cplusplus
}
#endif

#endif /* CARVE_RT_CUSTOM_H */
