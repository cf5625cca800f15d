//===- emu_internal.h - what emu.cpp lends the NCCL emulation -------------===//

#ifndef CARVE_TESTS_GPU_EMU_EMU_INTERNAL_H
#define CARVE_TESTS_GPU_EMU_EMU_INTERNAL_H

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>

namespace carve_emu {

/// Runs `op` now, or records it when `s` is being captured into a graph.
void enqueue(cudaStream_t s, std::function<void()> op);
/// Whether [p, p + bytes) lies inside one live device allocation.
bool isDeviceMemory(const void *p, size_t bytes);
/// One line naming the call and the cause, then the process ends.
[[noreturn]] void fatalCall(const char *fmt, ...);

} // namespace carve_emu

#endif // CARVE_TESTS_GPU_EMU_EMU_INTERNAL_H
