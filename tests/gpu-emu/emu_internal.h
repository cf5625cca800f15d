//===- emu_internal.h - what emu.cpp lends the NCCL emulation -------------===//

#ifndef CARVE_TESTS_GPU_EMU_EMU_INTERNAL_H
#define CARVE_TESTS_GPU_EMU_EMU_INTERNAL_H

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>

namespace carve_emu {

/// One operation of a stream. It runs once it heads its stream's queue and
/// `ready` (when set) says it can: a receive whose message has not arrived
/// waits there, and so does everything issued after it to that stream.
struct Work {
  std::function<void()> run;
  std::function<bool()> ready;
  /// What it waits for, for the report of a host wait that never ends.
  std::function<std::string()> waitingFor;
};

/// Queues `op` on `s` (and runs whatever can run), or records it into the
/// graph `s` captures.
void enqueue(cudaStream_t s, std::function<void()> op);
void enqueueWork(cudaStream_t s, Work w);
/// Blocks the host until `done()` holds, running streams' work meanwhile;
/// ends the process with a report after CARVE_EMU_HANG_S seconds (300).
void hostWaitUntil(const std::function<bool()> &done, const char *what);
/// Whether [p, p + bytes) lies inside one live device allocation.
bool isDeviceMemory(const void *p, size_t bytes);
/// The emulated device this process uses (cudaSetDevice).
int currentDevice();
/// One line naming the call and the cause, then the process ends.
[[noreturn]] void fatalCall(const char *fmt, ...);

// From nccl_emu.cpp:
/// Sleeps until a message arrives from another rank, or `limit` passes.
void awaitMessages(std::chrono::milliseconds limit);
/// Why communication cannot go on (a rank's connection closed), or "".
std::string communicationFault();

} // namespace carve_emu

#endif // CARVE_TESTS_GPU_EMU_EMU_INTERNAL_H
