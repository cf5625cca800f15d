//===- cudnn_emu.h - what the cuDNN emulation tells tests -------------------===//
//
// Tests only (tests/gpu-emu/README.md, "cuDNN"): the emulated build links
// cudnn_emu.cpp instead of libcudnn. A test includes this header to learn
// whether the cuDNN path it meant to exercise actually ran.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_TESTS_GPU_EMU_CUDNN_EMU_H
#define CARVE_TESTS_GPU_EMU_CUDNN_EMU_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/// How many execution plans this process has run: one for every
/// cudnnBackendExecute when its stream runs it (a call captured into a CUDA
/// graph counts at every launch of the graph, and not before).
int64_t carve_emu_cudnn_executions(void);

#ifdef __cplusplus
}
#endif

#endif // CARVE_TESTS_GPU_EMU_CUDNN_EMU_H
