//===- kernels_fatal.cpp - fatal(), the error exit of the kernels ---------===//
//
// Declared in kernels.h: every kernel (and the optimizer, dist.h and the
// runtime) reports an invalid argument through it, on one line naming the rank.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/kernels.h"

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <thread>

namespace carve::rt {

void (*fatalHook)(int code) = nullptr;

namespace {
thread_local int tTraps = 0; // FatalTraps alive on this thread
} // namespace

FatalTrap::FatalTrap() { ++tTraps; }
FatalTrap::~FatalTrap() { --tTraps; }
bool fatalTrapped() { return tTraps > 0; }

void fatal(const char *fmt, ...) {
  if (tTraps > 0) {
    FatalTrapped t;
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(t.message, sizeof t.message, fmt, ap);
    va_end(ap);
    throw t;
  }
  // Several threads of one parallel loop may fail at once: the first reports,
  // the others wait for the process to go down.
  static std::atomic<bool> reported{false};
  if (reported.exchange(true))
    for (;;)
      std::this_thread::sleep_for(std::chrono::seconds(1));
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  const char *rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (!rank)
    rank = std::getenv("PMI_RANK");
  if (rank)
    std::fprintf(stderr, "carve: error: rank %s: %s\n", rank, msg);
  else
    std::fprintf(stderr, "carve: error: %s\n", msg);
  std::fflush(stderr);
  if (fatalHook)
    fatalHook(1);
  std::exit(1);
}

} // namespace carve::rt
