//===- emu.cpp - the CUDA runtime and cuBLAS subset carve uses, on the CPU -===//
//
// Tests only (tests/gpu-emu/README.md): the emulated build of runtime/cuda
// and tests/gpu links this instead of libcudart and libcublas.
//
// - Kernels: every block of the grid in turn, every thread of a block a fiber
//   (carve_emu_switch on x86-64, ucontext elsewhere), scheduled until each
//   returns, parked at __syncthreads or at a warp exchange (cuda_emu.h).
//   Launch configurations are checked against an sm_90 device's limits.
// - Memory: cudaMalloc is one heap block per allocation (AddressSanitizer
//   puts redzones around each and quarantines freed ones, so an access out
//   of bounds or after free is reported); a kernel argument or a copy
//   endpoint that should be device memory and is not fails naming it.
// - Streams and events: each stream is a queue. Work runs as soon as it
//   heads its queue and can run: everything but a receive (NCCL, whose
//   message from another rank may not have arrived) and a wait for an event
//   can at once, so on one rank work runs when it is issued, in issue order.
//   An event is complete once its stream has run what was issued before it
//   was recorded; cudaStreamWaitEvent holds a stream until then. The legacy
//   stream (0) and blocking streams wait for each other as CUDA's do. The
//   host blocks only where CUDA's does (synchronize, a synchronous copy,
//   cudaFree), running queued work until what it waits for is done, and ends
//   the run with a report of every stuck queue after CARVE_EMU_HANG_S
//   seconds (300). Only the thread that started the program runs work:
//   other threads (NCCL watchdogs) may query events.
// - Graphs: while a stream captures, launches, copies and fills issued to it
//   (or to a stream that joined the capture through an event) are recorded,
//   and cudaGraphLaunch queues them on its stream in order. Calls capture
//   forbids (a synchronous copy, a device or stream synchronize, a query of
//   the capturing stream's event) fail the capture as CUDA does.
// - cuBLAS GEMMs: inputs converted to float from their type (fp32, bf16,
//   fp16: exact), OpenBLAS sgemm (fp32 accumulation).
//
//===----------------------------------------------------------------------===//

#include "cuda_emu.h"

#include "emu_internal.h"

#include "carve/rt/elementwise.h"

// The builtins' macros name ThreadCoords' fields here.
#undef threadIdx
#undef blockIdx
#undef blockDim
#undef gridDim
#undef warpSize

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <sys/mman.h>
#include <thread>
#include <ucontext.h>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define CARVE_EMU_ASAN 1
#endif

// The opaque handle types of the runtime API, completed here.
struct CUstream_st {
  unsigned flags = 0;
  struct CUgraph_st *capture = nullptr; // the graph this stream records into
  int id = 0;                           // in creation order; 0 is the legacy stream
  std::deque<carve_emu::Work> queue;    // issued, not yet run
  uint64_t issued = 0;
  std::atomic<uint64_t> done{0}; // run; read by other threads' event queries
  bool destroyed = false;
};
struct CUevent_st {
  struct CUgraph_st *capture = nullptr; // recorded on a capturing stream
  // Complete once `stream` has run `seq` operations (no stream: never
  // recorded, complete).
  CUstream_st *stream = nullptr;
  uint64_t seq = 0;
  bool timing = true; // not created with cudaEventDisableTiming
};
struct CUgraph_st {
  std::vector<carve_emu::Work> ops;
  bool invalid = false;
  std::string why;
  // Streams that joined the capture through an event, events recorded in it:
  // both leave it when it ends.
  std::set<cudaStream_t> joined;
  std::set<cudaEvent_t> events;
};
struct CUgraphExec_st {
  std::vector<carve_emu::Work> ops;
};
struct cublasContext {
  cudaStream_t stream = nullptr;
};

namespace carve_emu {

namespace {

// ---- Device limits (an sm_90 device) ------------------------------------------

constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxBlockDim[3] = {1024, 1024, 64};
constexpr unsigned kMaxGridDim[3] = {2147483647u, 65535, 65535};
constexpr size_t kMaxSharedPerBlock = 48 * 1024; // without an opt-in attribute
// The emulated device's memory: host memory, so modest (a test that needs more says so
// and skips that check; softmax past 2^31 elements is one).
constexpr size_t kDeviceMemory = size_t(4) << 30;

// ---- State ----------------------------------------------------------------------

/// Live device allocations: start -> bytes.
std::map<uintptr_t, size_t> &allocations() {
  static auto *m = new std::map<uintptr_t, size_t>;
  return *m;
}
std::set<uintptr_t> &pinned() {
  static auto *s = new std::set<uintptr_t>;
  return *s;
}
size_t gAllocated = 0;
cudaError_t gLastError = cudaSuccess;
int gDevice = 0;
/// The thread that runs queued work: the one that started the program.
const std::thread::id gMainThread = std::this_thread::get_id();
/// The graph the legacy stream (stream 0) captures into, when it does.
CUgraph_st *gLegacyCapture = nullptr;

cudaError_t fail(cudaError_t e) {
  gLastError = e;
  return e;
}

[[noreturn]] void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "carve-emu: ");
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
  std::fflush(stderr);
  std::_Exit(1);
}

} // namespace
} // namespace carve_emu

// The __managed__ variables' section (cuda_emu.h), from the linker.
extern "C" char __start_carve_emu_managed[] __attribute__((weak));
extern "C" char __stop_carve_emu_managed[] __attribute__((weak));

namespace carve_emu {
namespace {

/// How many devices the emulation shows: CARVE_EMU_GPUS (1 to 64), or 1.
/// Each process is one of them (ranks on one host use distinct ones).
int deviceCount() {
  static const int n = [] {
    const char *v = std::getenv("CARVE_EMU_GPUS");
    if (!v || !*v)
      return 1;
    char *end = nullptr;
    const long k = std::strtol(v, &end, 10);
    if (*end || k < 1 || k > 64)
      die("CARVE_EMU_GPUS=%s: expected a device count from 1 to 64", v);
    return static_cast<int>(k);
  }();
  return n;
}

bool isManaged(const void *p, size_t bytes) {
  const char *c = static_cast<const char *>(p);
  return __start_carve_emu_managed && c >= __start_carve_emu_managed &&
         c + bytes <= __stop_carve_emu_managed;
}

/// The live allocation holding [p, p + bytes), or allocations().end().
std::map<uintptr_t, size_t>::iterator findAllocation(const void *p, size_t bytes) {
  auto &m = allocations();
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = m.upper_bound(a);
  if (it == m.begin())
    return m.end();
  --it;
  if (a >= it->first && a + bytes <= it->first + it->second)
    return it;
  return m.end();
}

bool isDevice(const void *p, size_t bytes) {
  return findAllocation(p, bytes) != allocations().end() || isManaged(p, bytes);
}

CUgraph_st *captureOf(cudaStream_t s) { return s ? s->capture : gLegacyCapture; }

// ---- Stream queues ---------------------------------------------------------------

/// Every stream not yet destroyed or not yet drained, the legacy one first.
std::vector<CUstream_st *> &streams() {
  // Never destroyed: a rank that fails may exit from another thread while
  // this one still runs work (as every container here).
  static auto *v = new std::vector<CUstream_st *>;
  return *v;
}
CUstream_st *legacyStream() {
  static CUstream_st *legacy = [] {
    auto *s = new CUstream_st;
    streams().push_back(s);
    return s;
  }();
  return legacy;
}
CUstream_st *streamOf(cudaStream_t s) { return s ? s : legacyStream(); }

bool isBlocking(const CUstream_st *s) {
  return s != legacyStream() && !(s->flags & cudaStreamNonBlocking);
}
bool idle(const CUstream_st *s) { return s->done.load() == s->issued; }
bool eventDone(const CUevent_st *e) { return !e->stream || e->stream->done.load() >= e->seq; }

bool gRunning = false; // progress() is running work (it does not nest)

/// Runs queued work, stream by stream, until nothing more can run now. Only
/// on the thread that started the program.
void progress() {
  if (gRunning || std::this_thread::get_id() != gMainThread)
    return;
  gRunning = true;
  for (bool moved = true; moved;) {
    moved = false;
    std::vector<CUstream_st *> &all = streams();
    for (size_t i = 0; i < all.size(); ++i) {
      CUstream_st *s = all[i];
      while (!s->queue.empty()) {
        if (s->queue.front().ready && !s->queue.front().ready())
          break;
        Work w = std::move(s->queue.front());
        s->queue.pop_front();
        w.run();
        s->done.fetch_add(1);
        moved = true;
      }
    }
    // Destroyed streams leave once drained (events keep their object).
    all.erase(std::remove_if(all.begin(), all.end(),
                             [](CUstream_st *s) { return s->destroyed && s->queue.empty(); }),
              all.end());
  }
  gRunning = false;
}

/// Queues `w` on `s` behind what CUDA orders it after (the legacy stream
/// and blocking streams wait for each other), then runs what can run.
void push(CUstream_st *s, Work w) {
  std::vector<std::pair<CUstream_st *, uint64_t>> after;
  if (s == legacyStream()) {
    for (CUstream_st *o : streams())
      if (isBlocking(o) && !idle(o))
        after.emplace_back(o, o->issued);
  } else if (isBlocking(s) && !idle(legacyStream())) {
    after.emplace_back(legacyStream(), legacyStream()->issued);
  }
  if (!after.empty()) {
    auto inner = std::move(w.ready);
    w.ready = [after, inner]() {
      for (const auto &a : after)
        if (a.first->done.load() < a.second)
          return false;
      return !inner || inner();
    };
  }
  s->queue.push_back(std::move(w));
  ++s->issued;
  progress();
}

/// Queues `w`, or records it when `s` captures.
void issueWork(cudaStream_t s, Work w) {
  if (CUgraph_st *g = captureOf(s)) {
    g->ops.push_back(std::move(w));
    return;
  }
  push(streamOf(s), std::move(w));
}

void issue(cudaStream_t s, std::function<void()> op) { issueWork(s, Work{std::move(op), {}, {}}); }

double hangLimit() {
  const char *v = std::getenv("CARVE_EMU_HANG_S");
  return v && *v ? std::atof(v) : 300.0;
}

/// Blocks until `done()`, running work; the report names every stuck queue.
void waitUntil(const std::function<bool()> &done, const char *what) {
  const auto start = std::chrono::steady_clock::now();
  const double limit = hangLimit();
  double faultSeen = -1; // when a communication fault was first seen
  for (;;) {
    progress();
    if (done())
      return;
    if (std::this_thread::get_id() != gMainThread) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    const std::string fault = communicationFault();
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!fault.empty() && faultSeen < 0)
      faultSeen = waited;
    // A fault ends the wait after 2 s: the runtime's own watchdog (which
    // reports it in the runtime's words) goes first when it can.
    if ((faultSeen >= 0 && waited > faultSeen + 2) || waited > limit) {
      std::string stuck;
      for (CUstream_st *s : streams())
        if (!s->queue.empty()) {
          const Work &w = s->queue.front();
          stuck += "\n  stream " + std::to_string(s->id) + " (" +
                   std::to_string(s->queue.size()) + " queued) waits for " +
                   (w.waitingFor ? w.waitingFor() : std::string("an event of another stream"));
        }
      if (!fault.empty())
        die("%s cannot complete: %s%s", what, fault.c_str(), stuck.c_str());
      die("%s waited %.0f s (CARVE_EMU_HANG_S) and the work it needs never became ready%s", what,
          waited, stuck.c_str());
    }
    awaitMessages(std::chrono::milliseconds(20));
  }
}

bool allIdle() {
  for (CUstream_st *s : streams())
    if (!s->queue.empty())
      return false;
  return true;
}

/// Whether any stream captures (synchronous work is then illegal in CUDA's
/// default (global) capture mode).
std::set<CUgraph_st *> &capturing() {
  static auto *g = new std::set<CUgraph_st *>;
  return *g;
}
cudaError_t forbiddenInCapture(const char *what) {
  for (CUgraph_st *g : capturing()) {
    g->invalid = true;
    g->why = std::string(what) + " while a stream was being captured";
  }
  return fail(capturing().empty() ? cudaSuccess : cudaErrorStreamCaptureUnsupported);
}

// ---- Fibers ----------------------------------------------------------------------

// A fiber's stack, with a page below it that faults: an overflow is a crash
// at the guard, not a write into the next fiber's stack. 64 KiB: the deepest
// kernel (the attention's, with its per-thread arrays) needs well under that.
constexpr size_t kStackBytes = size_t(64) << 10;
constexpr size_t kGuardBytes = size_t(4) << 10;

// The switch between fibers. On x86-64: carve_emu_switch, which saves what
// a function call must preserve and nothing more (the
// callee-saved registers and the SSE and x87 control words). glibc's
// swapcontext also saves and restores the signal mask, a system call on each
// switch, and AddressSanitizer's interceptor of it cleared the shadow of the
// whole stack it switched to (64 KiB: an 8 KiB memset) on each switch; the
// two were three quarters of an emulated training step's time. The shadow
// needs no clearing: every frame on a fiber's stack returns before the fiber
// ends except the first, fiberMain's, which the next fiber on that stack
// lays out the same way. Elsewhere, ucontext.
#if defined(__x86_64__)
#define CARVE_EMU_FAST_SWITCH 1
extern "C" void carve_emu_switch(void **save, void *to);
asm(".text\n"
    ".globl carve_emu_switch\n"
    ".type carve_emu_switch, @function\n"
    "carve_emu_switch:\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  subq $8, %rsp\n"
    "  stmxcsr (%rsp)\n"
    "  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n"
    "  fldcw 4(%rsp)\n"
    "  addq $8, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".size carve_emu_switch, .-carve_emu_switch\n");

/// A new fiber's saved stack pointer: carve_emu_switch to it starts `entry`
/// on `stack` (the control words the caller's; `entry` never returns).
void *fiberStart(char *stack, size_t bytes, void (*entry)()) {
  auto *sp =
      reinterpret_cast<uint64_t *>((reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t(15));
  *--sp = 0;                                  // entry's return address
  *--sp = reinterpret_cast<uintptr_t>(entry); // where the switch returns to
  for (int i = 0; i < 6; ++i)
    *--sp = 0; // rbp, rbx, r12-r15
  struct {
    uint32_t mxcsr;
    uint16_t fcw, pad;
  } csr{};
  asm volatile("stmxcsr %0" : "=m"(csr.mxcsr));
  asm volatile("fnstcw %0" : "=m"(csr.fcw));
  --sp;
  std::memcpy(sp, &csr, sizeof csr);
  return sp;
}
#endif

enum class State { Ready, AtBarrier, AtWarp, Done };

struct Fiber {
#ifdef CARVE_EMU_FAST_SWITCH
  void *sp = nullptr;
#else
  ucontext_t ctx;
#endif
  char *stack = nullptr;
  State state = State::Ready;
  const char *site = nullptr; // where it is parked
  ThreadCoords coords;
  unsigned warpMask = 0;
  uint64_t warpValue = 0;
  int warpFrom = 0;
  uint64_t warpResult = 0;
};

struct Block {
  const LaunchInfo *info = nullptr;
  void (*body)(void *) = nullptr;
  void *ctx = nullptr;
  std::vector<Fiber> *fibers = nullptr;
  int current = -1;
#ifdef CARVE_EMU_FAST_SWITCH
  void *scheduler = nullptr;
#else
  ucontext_t scheduler;
#endif
#ifdef CARVE_EMU_ASAN
  const void *schedulerStack = nullptr;
  size_t schedulerStackSize = 0;
#endif
};

Block *gBlock = nullptr;

[[noreturn]] void kernelFaultAt(Block &b, int t, const char *fmt, ...);
ThreadCoords gHostCoords{};

std::vector<Fiber> &fiberPool(size_t n) {
  static std::vector<Fiber> &pool = *new std::vector<Fiber>;
  if (pool.size() < n) {
    const size_t old = pool.size();
    pool.resize(n);
    for (size_t i = old; i < n; ++i) {
      void *m = mmap(nullptr, kGuardBytes + kStackBytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (m == MAP_FAILED || mprotect(m, kGuardBytes, PROT_NONE) != 0)
        die("cannot map a fiber stack");
      pool[i].stack = static_cast<char *>(m) + kGuardBytes;
    }
  }
  return pool;
}

void switchToScheduler(Fiber &f) {
#ifdef CARVE_EMU_ASAN
  void *fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, gBlock->schedulerStack, gBlock->schedulerStackSize);
#endif
#ifdef CARVE_EMU_FAST_SWITCH
  carve_emu_switch(&f.sp, gBlock->scheduler);
#else
  swapcontext(&f.ctx, &gBlock->scheduler);
#endif
#ifdef CARVE_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

void fiberMain() {
#ifdef CARVE_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &gBlock->schedulerStack, &gBlock->schedulerStackSize);
#endif
  Block &b = *gBlock;
  b.body(b.ctx);
  Fiber &f = (*b.fibers)[b.current];
  f.state = State::Done;
#ifdef CARVE_EMU_ASAN
  __sanitizer_start_switch_fiber(nullptr, b.schedulerStack, b.schedulerStackSize);
#endif
#ifdef CARVE_EMU_FAST_SWITCH
  carve_emu_switch(&f.sp, b.scheduler); // never resumed
#else
  setcontext(&b.scheduler);
#endif
}

void resume(Block &b, int t) {
  Fiber &f = (*b.fibers)[t];
  b.current = t;
  f.state = State::Ready;
#ifdef CARVE_EMU_ASAN
  void *fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kStackBytes);
#endif
#ifdef CARVE_EMU_FAST_SWITCH
  carve_emu_switch(&b.scheduler, f.sp);
#else
  swapcontext(&b.scheduler, &f.ctx);
#endif
#ifdef CARVE_EMU_ASAN
  // Not the old stack's bounds (the fiber's): schedulerStack keeps the
  // scheduler's, which fiberMain took when the fiber started. Overwritten
  // with the fiber's, the next fiber's switch back announced the wrong
  // stack, the thread kept a fiber's bounds after the launch, and ASan
  // ignored the next exception's __asan_handle_no_return, leaving the
  // unwound frames' redzones poisoned (false stack-buffer-overflows).
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  b.current = -1;
}

std::string dimText(const dim3 &d) {
  return "(" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) + ")";
}
std::string coordText(const uint3 &d) {
  return "(" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) + ")";
}

/// Runs the block at `blockIdx` to completion.
void runBlock(Block &b, const uint3 &blockIdx) {
  const LaunchInfo &info = *b.info;
  const unsigned n = info.block.x * info.block.y * info.block.z;
  std::vector<Fiber> &fs = *b.fibers;
  for (unsigned t = 0; t < n; ++t) {
    Fiber &f = fs[t];
    f.state = State::Ready;
    f.site = nullptr;
    f.coords.threadIdx = {t % info.block.x, (t / info.block.x) % info.block.y,
                          t / (info.block.x * info.block.y)};
    f.coords.blockIdx = blockIdx;
    f.coords.blockDim = info.block;
    f.coords.gridDim = info.grid;
#ifdef CARVE_EMU_FAST_SWITCH
    f.sp = fiberStart(f.stack, kStackBytes, fiberMain);
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiberMain, 0);
#endif
  }
  for (;;) {
    for (unsigned t = 0; t < n; ++t)
      if (fs[t].state == State::Ready)
        resume(b, static_cast<int>(t));
    // Every thread is done or parked: release what can be released.
    unsigned done = 0, barrier = 0, warp = 0;
    for (unsigned t = 0; t < n; ++t)
      done += fs[t].state == State::Done, barrier += fs[t].state == State::AtBarrier,
          warp += fs[t].state == State::AtWarp;
    if (done == n)
      return;
    bool released = false;
    // Warps whose lanes in the mask all wait at the same exchange.
    for (unsigned w = 0; w * 32 < n; ++w) {
      const unsigned first = w * 32, last = std::min(n, first + 32);
      int leader = -1;
      for (unsigned t = first; t < last; ++t)
        if (fs[t].state == State::AtWarp) {
          leader = static_cast<int>(t);
          break;
        }
      if (leader < 0)
        continue;
      const Fiber &lf = fs[leader];
      bool ready = true;
      for (unsigned l = 0; l < 32; ++l) {
        if (!(lf.warpMask >> l & 1u))
          continue;
        const unsigned t = first + l;
        if (t >= n)
          kernelFaultAt(b, leader,
                        "%s: the mask 0x%08x names lane %u, which does not exist in a "
                        "block of %u threads",
                        lf.site, lf.warpMask, l, n);
        if (fs[t].state == State::Done || fs[t].state == State::AtBarrier)
          kernelFaultAt(b, leader,
                        "%s: lane %u of the mask 0x%08x %s instead of joining the "
                        "exchange",
                        lf.site, l, lf.warpMask,
                        fs[t].state == State::Done ? "returned" : "waits at a __syncthreads");
        if (fs[t].state != State::AtWarp) {
          ready = false;
          continue;
        }
        if (fs[t].site != lf.site || fs[t].warpMask != lf.warpMask)
          kernelFaultAt(b, static_cast<int>(t),
                        "lane %u waits at %s (mask 0x%08x), lane %d at "
                        "%s (mask 0x%08x): a warp exchange the lanes do "
                        "not share",
                        l, fs[t].site, fs[t].warpMask, leader - static_cast<int>(first), lf.site,
                        lf.warpMask);
      }
      if (!ready)
        continue;
      for (unsigned l = 0; l < 32; ++l)
        if (lf.warpMask >> l & 1u) {
          Fiber &f = fs[first + l];
          const int from = f.warpFrom;
          if (from < 0 || from >= 32 || !(lf.warpMask >> from & 1u))
            kernelFaultAt(b, static_cast<int>(first + l),
                          "%s: lane %u reads lane %d, which is not in the mask 0x%08x", f.site, l,
                          from, lf.warpMask);
          f.warpResult = fs[first + from].warpValue;
        }
      for (unsigned l = 0; l < 32; ++l)
        if (lf.warpMask >> l & 1u)
          fs[first + l].state = State::Ready;
      released = true;
    }
    if (released)
      continue;
    if (barrier > 0 && warp == 0) {
      int firstAt = -1;
      for (unsigned t = 0; t < n; ++t)
        if (fs[t].state == State::AtBarrier) {
          firstAt = static_cast<int>(t);
          break;
        }
      for (unsigned t = 0; t < n; ++t) {
        if (fs[t].state == State::Done)
          kernelFaultAt(b, firstAt,
                        "__syncthreads at %s is not reached by every thread of the "
                        "block: thread %s returned without it",
                        fs[firstAt].site, coordText(fs[t].coords.threadIdx).c_str());
        if (fs[t].site != fs[firstAt].site)
          kernelFaultAt(b, static_cast<int>(t),
                        "threads of one block wait at different "
                        "__syncthreads: this one at %s, thread %s at %s",
                        fs[t].site, coordText(fs[firstAt].coords.threadIdx).c_str(),
                        fs[firstAt].site);
      }
      for (unsigned t = 0; t < n; ++t)
        fs[t].state = State::Ready;
      continue;
    }
    // Parked at a warp exchange and a barrier at once, nothing releasable.
    for (unsigned t = 0; t < n; ++t)
      if (fs[t].state == State::AtWarp)
        kernelFaultAt(b, static_cast<int>(t),
                      "%s: the warp exchange never completes (other "
                      "threads wait at __syncthreads)",
                      fs[t].site);
    die("kernel %s: the block's threads can make no progress", info.kernel);
  }
}

} // namespace

// ---- What cuda_emu.h calls ---------------------------------------------------

ThreadCoords &coords() {
  if (gBlock && gBlock->current >= 0)
    return (*gBlock->fibers)[gBlock->current].coords;
  return gHostCoords;
}

void syncThreads(const char *site) {
  if (!gBlock || gBlock->current < 0)
    die("__syncthreads at %s called outside a kernel", site);
  Fiber &f = (*gBlock->fibers)[gBlock->current];
  f.state = State::AtBarrier;
  f.site = site;
  switchToScheduler(f);
}

uint64_t warpExchange(unsigned mask, uint64_t value, int from, const char *site) {
  if (!gBlock || gBlock->current < 0)
    die("a warp exchange at %s called outside a kernel", site);
  Fiber &f = (*gBlock->fibers)[gBlock->current];
  const unsigned lane = static_cast<unsigned>(gBlock->current) % 32;
  if (!(mask >> lane & 1u))
    kernelFault("%s: lane %u calls a warp exchange whose mask 0x%08x leaves it out", site, lane,
                mask);
  f.state = State::AtWarp;
  f.site = site;
  f.warpMask = mask;
  f.warpValue = value;
  f.warpFrom = from;
  switchToScheduler(f);
  return f.warpResult;
}

void kernelFault(const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (gBlock && gBlock->current >= 0) {
    const Fiber &f = (*gBlock->fibers)[gBlock->current];
    die("kernel %s, block %s, thread %s: %s", gBlock->info->kernel,
        coordText(f.coords.blockIdx).c_str(), coordText(f.coords.threadIdx).c_str(), buf);
  }
  die("%s", buf);
}

namespace {
void kernelFaultAt(Block &b, int t, const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  const Fiber &f = (*b.fibers)[t];
  die("kernel %s, block %s, thread %s: %s", b.info->kernel, coordText(f.coords.blockIdx).c_str(),
      coordText(f.coords.threadIdx).c_str(), buf);
}
} // namespace

void checkDevicePointer(const char *kernel, int argument, const void *p) {
  if (!p || isDevice(p, 0))
    return;
  die("kernel %s: argument %d (%p) is not device memory (%s)", kernel, argument, p,
      pinned().count(reinterpret_cast<uintptr_t>(p)) ? "pinned host memory" : "a host address");
}

void runGridNow(const LaunchInfo &info, void (*body)(void *), void *ctx);

/// Whether work issued to `s` now would run at once (nothing queued before
/// it that it must wait for).
bool runsNow(CUstream_st *s) {
  if (gRunning || std::this_thread::get_id() != gMainThread || !s->queue.empty())
    return false;
  if (s == legacyStream()) {
    for (CUstream_st *o : streams())
      if (isBlocking(o) && !idle(o))
        return false;
    return true;
  }
  return !isBlocking(s) || idle(legacyStream());
}

int (*launchTimerStart)(const char *kernel, void *stream) = nullptr;
void (*launchTimerStop)(int slot) = nullptr;

void runGrid(const LaunchInfo &info, void (*body)(void *), void *ctx, void (*copy)(void *, void **),
             void (*destroy)(void *)) {
  const unsigned bd[3] = {info.block.x, info.block.y, info.block.z};
  const unsigned gd[3] = {info.grid.x, info.grid.y, info.grid.z};
  const unsigned long long threads = 1ull * bd[0] * bd[1] * bd[2];
  for (int i = 0; i < 3; ++i) {
    if (bd[i] == 0 || bd[i] > kMaxBlockDim[i] || gd[i] == 0 || gd[i] > kMaxGridDim[i])
      die("kernel %s: launch with grid %s and block %s is outside the device's limits (block "
          "at most (1024, 1024, 64), grid at most (2^31-1, 65535, 65535), none 0)",
          info.kernel, dimText(info.grid).c_str(), dimText(info.block).c_str());
  }
  if (threads > kMaxThreadsPerBlock)
    die("kernel %s: a block of %s = %llu threads, over the device's %u", info.kernel,
        dimText(info.block).c_str(), threads, kMaxThreadsPerBlock);
  if (info.sharedBytes > kMaxSharedPerBlock)
    die("kernel %s: %zu bytes of dynamic shared memory, over the %zu a block may have", info.kernel,
        info.sharedBytes, kMaxSharedPerBlock);
  if (CUgraph_st *g = captureOf(info.stream)) {
    void *mine = nullptr;
    copy(ctx, &mine);
    destroy(ctx);
    auto held = std::shared_ptr<void>(mine, destroy);
    LaunchInfo kept = info;
    g->ops.push_back(Work{[kept, body, held]() { runGridNow(kept, body, held.get()); }, {}, {}});
    return;
  }
  if (gBlock)
    die("kernel %s launched from inside kernel %s", info.kernel, gBlock->info->kernel);
  struct Timed {
    int slot;
    ~Timed() {
      if (slot >= 0 && launchTimerStop)
        launchTimerStop(slot);
    }
  } timed{launchTimerStart ? launchTimerStart(info.kernel, info.stream) : -1};
  CUstream_st *s = streamOf(info.stream);
  if (runsNow(s)) {
    // Nothing it must wait for: run it now, on the caller's copy.
    ++s->issued;
    runGridNow(info, body, ctx);
    destroy(ctx);
    s->done.fetch_add(1);
    progress();
    return;
  }
  void *mine = nullptr;
  copy(ctx, &mine);
  destroy(ctx);
  auto held = std::shared_ptr<void>(mine, destroy);
  LaunchInfo kept = info;
  push(s, Work{[kept, body, held]() { runGridNow(kept, body, held.get()); }, {}, {}});
}

void runGridNow(const LaunchInfo &info, void (*body)(void *), void *ctx) {
  const unsigned gd[3] = {info.grid.x, info.grid.y, info.grid.z};
  const unsigned long long threads = 1ull * info.block.x * info.block.y * info.block.z;
  Block b;
  b.info = &info;
  b.body = body;
  b.ctx = ctx;
  b.fibers = &fiberPool(threads);
  gBlock = &b;
  // Last block first: a GPU runs blocks in no promised order, and a kernel
  // that leans on the launch order (atomics placing items "in order") gets
  // the reverse of it here.
  for (unsigned z = gd[2]; z-- > 0;)
    for (unsigned y = gd[1]; y-- > 0;)
      for (unsigned x = gd[0]; x-- > 0;)
        runBlock(b, uint3{x, y, z});
  gBlock = nullptr;
}

void enqueue(cudaStream_t s, std::function<void()> op) { issue(s, std::move(op)); }
void enqueueWork(cudaStream_t s, Work w) { issueWork(s, std::move(w)); }
void hostWaitUntil(const std::function<bool()> &done, const char *what) { waitUntil(done, what); }
int currentDevice() { return gDevice; }

bool isDeviceMemory(const void *p, size_t bytes) { return isDevice(p, bytes); }

[[noreturn]] void fatalCall(const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  die("%s", buf);
}

} // namespace carve_emu

using namespace carve_emu;

// ---- The CUDA runtime API ------------------------------------------------------

extern "C" {

cudaError_t cudaGetDeviceCount(int *count) {
  *count = deviceCount();
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= deviceCount())
    return fail(cudaErrorInvalidDevice);
  gDevice = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
  *device = gDevice;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int device) {
  if (device < 0 || device >= deviceCount())
    return fail(cudaErrorInvalidDevice);
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof p->name, "carve CPU emulation of an sm_90 device");
  p->major = 9;
  p->minor = 0;
  p->totalGlobalMem = kDeviceMemory;
  p->sharedMemPerBlock = kMaxSharedPerBlock;
  p->warpSize = 32;
  p->maxThreadsPerBlock = static_cast<int>(kMaxThreadsPerBlock);
  for (int i = 0; i < 3; ++i) {
    p->maxThreadsDim[i] = static_cast<int>(kMaxBlockDim[i]);
    p->maxGridSize[i] = static_cast<int>(kMaxGridDim[i]);
  }
  p->multiProcessorCount = 132;
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free, size_t *total) {
  *total = kDeviceMemory;
  *free = kDeviceMemory - std::min(kDeviceMemory, gAllocated);
  return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t bytes) {
  if (gAllocated + bytes > kDeviceMemory)
    return fail(cudaErrorMemoryAllocation);
  *p = std::malloc(std::max<size_t>(bytes, 1));
  if (!*p)
    return fail(cudaErrorMemoryAllocation);
  allocations()[reinterpret_cast<uintptr_t>(*p)] = bytes;
  gAllocated += bytes;
  return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
  if (!p)
    return cudaSuccess;
  // cudaFree waits for the device, as CUDA's does.
  if (capturing().empty())
    waitUntil(allIdle, "cudaFree");
  auto it = allocations().find(reinterpret_cast<uintptr_t>(p));
  if (it == allocations().end())
    die("cudaFree(%p): not the start of a live device allocation (a double free, or host "
        "memory)",
        p);
  gAllocated -= it->second;
  allocations().erase(it);
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t bytes) {
  *p = std::malloc(std::max<size_t>(bytes, 1));
  if (!*p)
    return fail(cudaErrorMemoryAllocation);
  pinned().insert(reinterpret_cast<uintptr_t>(*p));
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void *p) {
  if (!p)
    return cudaSuccess;
  if (!pinned().erase(reinterpret_cast<uintptr_t>(p)))
    die("cudaFreeHost(%p): not pinned host memory from cudaMallocHost", p);
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *a, const void *p) {
  *a = cudaPointerAttributes{};
  if (isDevice(p, 0)) {
    a->type = cudaMemoryTypeDevice;
    a->device = gDevice;
    a->devicePointer = const_cast<void *>(p);
  } else if (pinned().count(reinterpret_cast<uintptr_t>(p))) {
    a->type = cudaMemoryTypeHost;
    a->hostPointer = const_cast<void *>(p);
  } else {
    a->type = cudaMemoryTypeUnregistered;
  }
  return cudaSuccess;
}

} // extern "C"

namespace {

/// Checks a copy's endpoints against its kind (cudaMemcpyDefault: either).
void checkCopy(const char *call, void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
  const bool dDev = isDevice(dst, bytes), sDev = isDevice(src, bytes);
  const bool wantDDev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool wantSDev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (bytes == 0)
    return;
  if (kind == cudaMemcpyDefault)
    return;
  if (wantDDev && !dDev)
    die("%s: the destination %p (%zu bytes) is not inside one device allocation", call, dst, bytes);
  if (wantSDev && !sDev)
    die("%s: the source %p (%zu bytes) is not inside one device allocation", call, src, bytes);
  if (!wantDDev && dDev)
    die("%s: the destination %p is device memory, the copy's kind says host", call, dst);
  if (!wantSDev && sDev)
    die("%s: the source %p is device memory, the copy's kind says host", call, src);
}

} // namespace

extern "C" {

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
  if (!capturing().empty())
    return forbiddenInCapture("cudaMemcpy");
  checkCopy("cudaMemcpy", dst, src, bytes, kind);
  // On the legacy stream, after what it holds; the host waits for it.
  issue(nullptr, [=]() { std::memmove(dst, src, bytes); });
  waitUntil([] { return idle(legacyStream()); }, "cudaMemcpy");
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s) {
  checkCopy("cudaMemcpyAsync", dst, src, bytes, kind);
  issue(s, [=]() { std::memmove(dst, src, bytes); });
  return cudaSuccess;
}

cudaError_t cudaMemset(void *p, int v, size_t bytes) {
  if (!capturing().empty())
    return forbiddenInCapture("cudaMemset");
  if (bytes && !isDevice(p, bytes))
    die("cudaMemset: %p (%zu bytes) is not inside one device allocation", p, bytes);
  issue(nullptr, [=]() { std::memset(p, v, bytes); });
  waitUntil([] { return idle(legacyStream()); }, "cudaMemset");
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int v, size_t bytes, cudaStream_t s) {
  if (bytes && !isDevice(p, bytes))
    die("cudaMemsetAsync: %p (%zu bytes) is not inside one device allocation", p, bytes);
  issue(s, [=]() { std::memset(p, v, bytes); });
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  if (!capturing().empty())
    return forbiddenInCapture("cudaDeviceSynchronize");
  waitUntil(allIdle, "cudaDeviceSynchronize");
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  cudaError_t e = gLastError;
  gLastError = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return gLastError; }

const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
  case cudaSuccess:
    return "no error";
  case cudaErrorMemoryAllocation:
    return "out of memory";
  case cudaErrorInvalidDevice:
    return "invalid device ordinal";
  case cudaErrorStreamCaptureUnsupported:
    return "operation not permitted when stream is capturing";
  case cudaErrorStreamCaptureInvalidated:
    return "operation failed due to a previous error during capture";
  case cudaErrorNotReady:
    return "device not ready";
  default:
    return "an error of the CPU emulation";
  }
}

const char *cudaGetErrorName(cudaError_t e) { return cudaGetErrorString(e); }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
  static int next = 1;
  legacyStream();
  *s = new CUstream_st;
  (*s)->flags = flags;
  (*s)->id = next++;
  streams().push_back(*s);
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithFlags(s, 0); }

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (!s)
    return fail(cudaErrorInvalidResourceHandle);
  if (s->capture)
    s->capture->joined.erase(s);
  // Its queued work still runs (CUDA's does); the object stays for the
  // events recorded on it.
  s->destroyed = true;
  progress();
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (captureOf(s))
    return forbiddenInCapture("cudaStreamSynchronize");
  CUstream_st *q = streamOf(s);
  waitUntil([q] { return idle(q); }, "cudaStreamSynchronize");
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t s) {
  if (captureOf(s))
    return forbiddenInCapture("cudaStreamQuery");
  progress();
  return idle(streamOf(s)) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
  *e = new CUevent_st;
  (*e)->timing = !(flags & cudaEventDisableTiming);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  if (e->capture)
    e->capture->events.erase(e);
  delete e;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  if (e->capture)
    e->capture->events.erase(e);
  e->capture = captureOf(s);
  if (e->capture) {
    e->capture->events.insert(e);
    return cudaSuccess;
  }
  e->stream = streamOf(s);
  e->seq = e->stream->issued;
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (e->capture)
    return forbiddenInCapture("cudaEventQuery of an event recorded during capture");
  progress();
  return eventDone(e) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (e->capture)
    return forbiddenInCapture("cudaEventSynchronize of an event recorded during capture");
  const CUstream_st *q = e->stream;
  const uint64_t seq = e->seq;
  waitUntil([q, seq] { return !q || q->done.load() >= seq; }, "cudaEventSynchronize");
  return cudaSuccess;
}

// The emulation keeps no device clock: the time between two completed,
// recorded timing events is 0 ms. What a device refuses is refused here.
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
  if (start->capture || end->capture)
    return forbiddenInCapture("cudaEventElapsedTime of an event recorded during capture");
  if (!start->timing || !end->timing)
    return cudaErrorInvalidResourceHandle;
  if (!start->stream || !end->stream)
    return cudaErrorInvalidResourceHandle; // never recorded
  progress();
  if (!eventDone(start) || !eventDone(end))
    return cudaErrorNotReady;
  *ms = 0.0f;
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  // A stream that waits for an event of a capture joins that capture.
  if (e->capture) {
    if (s && !s->capture) {
      s->capture = e->capture;
      e->capture->joined.insert(s);
    }
    return cudaSuccess;
  }
  if (eventDone(e))
    return cudaSuccess;
  // The most recent record at the time of the call, as CUDA's.
  const CUstream_st *q = e->stream;
  const uint64_t seq = e->seq;
  const int id = q->id;
  issueWork(s, Work{[] {}, [q, seq] { return q->done.load() >= seq; },
                    [id] { return "an event of stream " + std::to_string(id); }});
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  if (!s)
    return fail(cudaErrorStreamCaptureUnsupported);
  if (s->capture)
    return fail(cudaErrorIllegalState);
  s->capture = new CUgraph_st;
  capturing().insert(s->capture);
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph) {
  if (!s || !s->capture)
    return fail(cudaErrorIllegalState);
  CUgraph_st *g = s->capture;
  capturing().erase(g);
  // Streams that joined through events leave it too (they rejoin the origin
  // stream on a real device before the capture may end), and the events
  // recorded in it are complete from now on.
  s->capture = nullptr;
  for (cudaStream_t j : g->joined)
    if (j->capture == g)
      j->capture = nullptr;
  for (cudaEvent_t e : g->events)
    e->capture = nullptr;
  g->joined.clear();
  g->events.clear();
  if (g->invalid) {
    std::fprintf(stderr, "carve-emu: capture invalidated: %s\n", g->why.c_str());
    delete g;
    *graph = nullptr;
    return fail(cudaErrorStreamCaptureInvalidated);
  }
  *graph = g;
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status) {
  *status = captureOf(s) ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t g, unsigned long long) {
  *exec = new CUgraphExec_st{g->ops};
  return cudaSuccess;
}

cudaError_t cudaGraphGetNodes(cudaGraph_t g, cudaGraphNode_t *nodes, size_t *count) {
  if (!nodes) {
    *count = g->ops.size();
    return cudaSuccess;
  }
  return fail(cudaErrorNotSupported);
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  if (captureOf(s))
    return fail(cudaErrorStreamCaptureUnsupported);
  for (const Work &w : exec->ops)
    push(streamOf(s), w);
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  delete g;
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) {
  delete e;
  return cudaSuccess;
}

} // extern "C"

// ---- cuBLAS ----------------------------------------------------------------------

namespace {

/// Element (r, c) of a column-major matrix of `type` with leading dimension ld.
float elementOf(const void *p, cudaDataType t, int64_t r, int64_t c, int64_t ld) {
  const int64_t i = r + c * ld;
  switch (t) {
  case CUDA_R_32F:
    return static_cast<const float *>(p)[i];
  case CUDA_R_16BF:
    return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
  case CUDA_R_16F:
    return __half2float(static_cast<const __half *>(p)[i]);
  default:
    die("cublasGemmEx: input type %d is not one carve uses", static_cast<int>(t));
  }
}

/// op(X) of an m x n result's operand, as a dense column-major float matrix.
std::vector<float> operand(const void *p, cudaDataType t, cublasOperation_t op, int rows, int cols,
                           int ld) {
  std::vector<float> out(static_cast<size_t>(rows) * cols);
  for (int c = 0; c < cols; ++c)
    for (int r = 0; r < rows; ++r)
      out[r + static_cast<size_t>(c) * rows] =
          op == CUBLAS_OP_N ? elementOf(p, t, r, c, ld) : elementOf(p, t, c, r, ld);
  return out;
}

/// x rounded to TF32 (8 exponent bits, 10 mantissa bits) to nearest, ties
/// away from zero (PTX's cvt.rna.tf32.f32), kept in a float; infinities and
/// NaN as they are. Where cuBLAS's tensor cores round otherwise (e.g.
/// truncate), they differ from this by at most one TF32 unit in the last
/// place, inside the bound the tests derive (2^-10 relative per input).
float roundTf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) != 0x7f800000u)
    u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&x, &u, 4);
  return x;
}

/// The compute types carve asks for: CUBLAS_COMPUTE_32F (any input type),
/// CUBLAS_COMPUTE_32F_FAST_TF32 (fp32 inputs: plan field tf32). Anything else
/// is fatal. Returns whether the inputs round to TF32.
bool tf32Compute(const char *call, cublasComputeType_t compute, cudaDataType at, cudaDataType bt) {
  if (compute == CUBLAS_COMPUTE_32F)
    return false;
  if (compute != CUBLAS_COMPUTE_32F_FAST_TF32)
    die("%s: compute type %d is not one carve uses (CUBLAS_COMPUTE_32F, or "
        "CUBLAS_COMPUTE_32F_FAST_TF32 on fp32 inputs)",
        call, static_cast<int>(compute));
  if (at != CUDA_R_32F || bt != CUDA_R_32F)
    die("%s: CUBLAS_COMPUTE_32F_FAST_TF32 with inputs of types %d and %d (carve asks for TF32 "
        "only on fp32 inputs)",
        call, static_cast<int>(at), static_cast<int>(bt));
  return true;
}

cublasStatus_t gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                    const float *alpha, const void *A, cudaDataType at, int lda, const void *B,
                    cudaDataType bt, int ldb, const float *beta, void *C, cudaDataType ct, int ldc,
                    bool tf32) {
  if (ct != CUDA_R_32F && ct != CUDA_R_16BF && ct != CUDA_R_16F)
    die("cublasGemmEx: output type %d is not one carve uses", static_cast<int>(ct));
  if (ct != CUDA_R_32F && ct != at)
    die("cublasGemmEx: a 16-bit output (type %d) of inputs of type %d", static_cast<int>(ct),
        static_cast<int>(at));
  const size_t cSize = ct == CUDA_R_32F ? 4 : 2;
  const int64_t aCols = ta == CUBLAS_OP_N ? k : m, bCols = tb == CUBLAS_OP_N ? n : k;
  const size_t aSize = at == CUDA_R_32F ? 4 : 2, bSize = bt == CUDA_R_32F ? 4 : 2;
  if (m > 0 && n > 0 && k > 0) {
    if (!isDevice(A, static_cast<size_t>((aCols - 1) * lda + (ta == CUBLAS_OP_N ? m : k)) * aSize))
      die("cublasGemmEx: A (%p) is not inside one device allocation", A);
    if (!isDevice(B, static_cast<size_t>((bCols - 1) * ldb + (tb == CUBLAS_OP_N ? k : n)) * bSize))
      die("cublasGemmEx: B (%p) is not inside one device allocation", B);
  }
  if (!isDevice(C, static_cast<size_t>(std::max(0, (n - 1) * ldc + m)) * cSize))
    die("cublasGemmEx: C (%p) is not inside one device allocation", C);
  std::vector<float> a = operand(A, at, ta, m, k, lda), b = operand(B, bt, tb, k, n, ldb);
  if (tf32) {
    for (float &x : a)
      x = roundTf32(x);
    for (float &x : b)
      x = roundTf32(x);
  }
  if (ct != CUDA_R_32F) {
    // A 16-bit C: the fp32 accumulators rounded to nearest even, as cuBLAS
    // writes them (beta 0 only: carve never accumulates into 16 bits).
    if (*beta != 0)
      die("cublasGemmEx: beta %g with a 16-bit output", static_cast<double>(*beta));
    std::vector<float> acc(static_cast<size_t>(m) * n, 0.0f);
    if (k > 0 && m > 0 && n > 0)
      cblas_sgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, m, n, k, *alpha, a.data(), m, b.data(),
                  k, 0.0f, acc.data(), m);
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        const float v = acc[i + static_cast<size_t>(j) * m];
        const size_t o = i + static_cast<size_t>(j) * ldc;
        if (ct == CUDA_R_16BF)
          static_cast<__nv_bfloat16 *>(C)[o] = __float2bfloat16_rn(v);
        else
          static_cast<__half *>(C)[o] = __float2half_rn(v);
      }
    return CUBLAS_STATUS_SUCCESS;
  }
  float *c = static_cast<float *>(C);
  if (k == 0 || m == 0 || n == 0) {
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i)
        c[i + static_cast<size_t>(j) * ldc] =
            *beta == 0 ? 0.0f : *beta * c[i + static_cast<size_t>(j) * ldc];
    return CUBLAS_STATUS_SUCCESS;
  }
  if (*beta == 0) // beta 0: C is not read (it may hold NaN)
    for (int j = 0; j < n; ++j)
      std::fill_n(c + static_cast<size_t>(j) * ldc, m, 0.0f);
  cblas_sgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, m, n, k, *alpha, a.data(), m, b.data(), k,
              *beta, c, ldc);
  return CUBLAS_STATUS_SUCCESS;
}

} // namespace

extern "C" {

cublasStatus_t cublasCreate(cublasHandle_t *h) {
  *h = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
  h->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t, void *, size_t) { return CUBLAS_STATUS_SUCCESS; }

cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t) { return CUBLAS_STATUS_SUCCESS; }

const char *cublasGetStatusString(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" : "a cuBLAS error (CPU emulation)";
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void *alpha, const void *A, cudaDataType at,
                            int lda, const void *B, cudaDataType bt, int ldb, const void *beta,
                            void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t) {
  const float al = *static_cast<const float *>(alpha), be = *static_cast<const float *>(beta);
  const bool tf32 = tf32Compute("cublasGemmEx", compute, at, bt);
  issue(h->stream,
        [=]() { gemm(ta, tb, m, n, k, &al, A, at, lda, B, bt, ldb, &be, C, ct, ldc, tf32); });
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta,
                                          cublasOperation_t tb, int m, int n, int k,
                                          const void *alpha, const void *A, cudaDataType at,
                                          int lda, long long sa, const void *B, cudaDataType bt,
                                          int ldb, long long sb, const void *beta, void *C,
                                          cudaDataType ct, int ldc, long long sc, int count,
                                          cublasComputeType_t compute, cublasGemmAlgo_t) {
  const float al = *static_cast<const float *>(alpha), be = *static_cast<const float *>(beta);
  const bool tf32 = tf32Compute("cublasGemmStridedBatchedEx", compute, at, bt);
  issue(h->stream, [=]() {
    const size_t aSize = at == CUDA_R_32F ? 4 : 2, bSize = bt == CUDA_R_32F ? 4 : 2,
                 cSize = ct == CUDA_R_32F ? 4 : 2;
    for (int i = 0; i < count; ++i)
      gemm(ta, tb, m, n, k, &al, static_cast<const char *>(A) + i * sa * aSize, at, lda,
           static_cast<const char *>(B) + i * sb * bSize, bt, ldb, &be,
           static_cast<char *>(C) + i * sc * cSize, ct, ldc, tf32);
  });
  return CUBLAS_STATUS_SUCCESS;
}

} // extern "C"

// ---- cuBLASLt (the matmuls carve runs with an epilogue) ---------------------------

namespace {

/// What the emulation keeps behind cuBLASLt's opaque descriptors (created
/// by its Create calls only; anything else passed as one is fatal).
struct LtDesc {
  cublasComputeType_t compute;
  cudaDataType scale;
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void *bias = nullptr;
  int32_t biasType = -1;
  const void *aux = nullptr; // DGELU's input: GELU's pre-activation, D's type and layout
  int64_t auxLd = 0;
};
struct LtLayout {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
};
struct LtPref {
  uint64_t maxWorkspace = 0;
};
struct LtContext {};

std::mutex &ltMutex() {
  static std::mutex m;
  return m;
}
template <class T> std::set<const void *> &ltLive() {
  static std::set<const void *> live;
  return live;
}
template <class T> T *ltGet(const void *p, const char *call, const char *what) {
  std::lock_guard<std::mutex> lock(ltMutex());
  if (!p || !ltLive<T>().count(p))
    die("%s: %s %p was not made by its cuBLASLt Create call (or was destroyed)", call, what, p);
  return static_cast<T *>(const_cast<void *>(p));
}
template <class T, class H> cublasStatus_t ltCreate(H *out, T *made) {
  std::lock_guard<std::mutex> lock(ltMutex());
  ltLive<T>().insert(made);
  *out = reinterpret_cast<H>(made);
  return CUBLAS_STATUS_SUCCESS;
}
template <class T> cublasStatus_t ltDestroy(const void *p, const char *call) {
  T *t = ltGet<T>(p, call, "descriptor");
  {
    std::lock_guard<std::mutex> lock(ltMutex());
    ltLive<T>().erase(p);
  }
  delete t;
  return CUBLAS_STATUS_SUCCESS;
}
template <class V> V ltValue(const void *buf, size_t bytes, const char *call, const char *what) {
  if (!buf || bytes != sizeof(V))
    die("%s: %s given %zu bytes (it takes %zu)", call, what, bytes, sizeof(V));
  V v;
  std::memcpy(&v, buf, sizeof v);
  return v;
}
size_t typeBytes(cudaDataType t, const char *call) {
  switch (t) {
  case CUDA_R_32F:
    return 4;
  case CUDA_R_16BF:
  case CUDA_R_16F:
    return 2;
  default:
    die("%s: data type %d is not one carve uses", call, static_cast<int>(t));
  }
}

/// D = op(A) op(B) (+ bias per row of D, CUBLASLT_EPILOGUE_BIAS) in fp32,
/// written as D's type (16-bit: rounded to nearest even), column-major: the
/// product as cublasGemmEx computes it, the bias added to the fp32
/// accumulator before the one rounding. CUBLASLT_EPILOGUE_BGRADA / BGRADB:
/// the bias pointer receives the sums over k of op(A)'s rows (one per row of
/// D) / op(B)'s columns (one per column of D), the values multiplied, summed
/// in fp32 in k's order and rounded once to the bias type.
/// CUBLASLT_EPILOGUE_GELU_AUX_BIAS: the bias added as BIAS does, the fp32
/// sum rounded into the auxiliary matrix (D's type, its own leading
/// dimension) and the tanh GELU of the fp32 sum rounded into D.
/// CUBLASLT_EPILOGUE_DGELU: the fp32 product times the tanh GELU's
/// derivative at the auxiliary matrix's element (D's type, its own leading
/// dimension), rounded once (carve/rt/elementwise.h's formula, the one
/// unary_grad16 evaluates).
void ltMatmul(const LtDesc d, const void *A, const LtLayout la, const void *B, const LtLayout lb,
              void *D, const LtLayout ldd) {
  const int m = static_cast<int>(d.ta == CUBLAS_OP_N ? la.rows : la.cols);
  const int k = static_cast<int>(d.ta == CUBLAS_OP_N ? la.cols : la.rows);
  const int n = static_cast<int>(d.tb == CUBLAS_OP_N ? lb.cols : lb.rows);
  std::vector<float> a = operand(A, la.type, d.ta, m, k, static_cast<int>(la.ld));
  std::vector<float> b = operand(B, lb.type, d.tb, k, n, static_cast<int>(lb.ld));
  std::vector<float> acc(static_cast<size_t>(m) * n, 0.0f);
  if (k > 0 && m > 0 && n > 0)
    cblas_sgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a.data(), m, b.data(), k,
                0.0f, acc.data(), m);
  auto write = [](void *p, cudaDataType t, size_t o, float v) {
    if (t == CUDA_R_32F)
      static_cast<float *>(p)[o] = v;
    else if (t == CUDA_R_16BF)
      static_cast<__nv_bfloat16 *>(p)[o] = __float2bfloat16_rn(v);
    else
      static_cast<__half *>(p)[o] = __float2half_rn(v);
  };
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      float v = acc[i + static_cast<size_t>(j) * m];
      if (d.epilogue == CUBLASLT_EPILOGUE_BIAS || d.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS)
        v += elementOf(d.bias, static_cast<cudaDataType>(d.biasType), i, 0, 1);
      if (d.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) {
        write(const_cast<void *>(d.aux), ldd.type, i + static_cast<size_t>(j) * d.auxLd, v);
        v = carve::rt::ew::unary<carve::rt::Unary::GeluTanh>(v);
      }
      if (d.epilogue == CUBLASLT_EPILOGUE_DGELU)
        v = carve::rt::ew::unaryGrad<carve::rt::Unary::GeluTanh>(
            elementOf(d.aux, ldd.type, i, j, static_cast<int>(d.auxLd)), v);
      write(D, ldd.type, i + static_cast<size_t>(j) * ldd.ld, v);
    }
  const auto biasType = static_cast<cudaDataType>(d.biasType);
  if (d.epilogue == CUBLASLT_EPILOGUE_BGRADA)
    for (int i = 0; i < m; ++i) {
      float sum = 0;
      for (int kk = 0; kk < k; ++kk)
        sum += a[i + static_cast<size_t>(kk) * m];
      write(const_cast<void *>(d.bias), biasType, i, sum);
    }
  if (d.epilogue == CUBLASLT_EPILOGUE_BGRADB)
    for (int j = 0; j < n; ++j) {
      float sum = 0;
      for (int kk = 0; kk < k; ++kk)
        sum += b[kk + static_cast<size_t>(j) * k];
      write(const_cast<void *>(d.bias), biasType, j, sum);
    }
}

} // namespace

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) { return ltCreate<LtContext>(h, new LtContext); }
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  return ltDestroy<LtContext>(h, "cublasLtDestroy");
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  if (compute != CUBLAS_COMPUTE_32F || scale != CUDA_R_32F)
    die("cublasLtMatmulDescCreate: compute type %d with scale type %d (carve computes in "
        "CUBLAS_COMPUTE_32F with CUDA_R_32F scales)",
        static_cast<int>(compute), static_cast<int>(scale));
  return ltCreate<LtDesc>(d, new LtDesc{compute, scale});
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  return ltDestroy<LtDesc>(d, "cublasLtMatmulDescDestroy");
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t attr, const void *buf,
                                              size_t bytes) {
  const char *call = "cublasLtMatmulDescSetAttribute";
  LtDesc *x = ltGet<LtDesc>(d, call, "matmul descriptor");
  switch (attr) {
  case CUBLASLT_MATMUL_DESC_TRANSA:
    x->ta = static_cast<cublasOperation_t>(ltValue<int32_t>(buf, bytes, call, "TRANSA"));
    break;
  case CUBLASLT_MATMUL_DESC_TRANSB:
    x->tb = static_cast<cublasOperation_t>(ltValue<int32_t>(buf, bytes, call, "TRANSB"));
    break;
  case CUBLASLT_MATMUL_DESC_EPILOGUE: {
    const uint32_t e = ltValue<uint32_t>(buf, bytes, call, "EPILOGUE");
    if (e != CUBLASLT_EPILOGUE_DEFAULT && e != CUBLASLT_EPILOGUE_BIAS &&
        e != CUBLASLT_EPILOGUE_BGRADA && e != CUBLASLT_EPILOGUE_BGRADB &&
        e != CUBLASLT_EPILOGUE_DGELU && e != CUBLASLT_EPILOGUE_GELU_AUX_BIAS)
      die("%s: epilogue %u is not emulated (DEFAULT, BIAS, BGRADA, BGRADB, GELU_AUX_BIAS and "
          "DGELU are)",
          call, e);
    x->epilogue = static_cast<cublasLtEpilogue_t>(e);
    break;
  }
  case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
    x->bias = ltValue<const void *>(buf, bytes, call, "BIAS_POINTER");
    break;
  case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
    x->biasType = ltValue<int32_t>(buf, bytes, call, "BIAS_DATA_TYPE");
    break;
  case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
    x->aux = ltValue<const void *>(buf, bytes, call, "EPILOGUE_AUX_POINTER");
    break;
  case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
    x->auxLd = ltValue<int64_t>(buf, bytes, call, "EPILOGUE_AUX_LD");
    break;
  default:
    die("%s: attribute %d is not emulated", call, static_cast<int>(attr));
  }
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  typeBytes(type, "cublasLtMatrixLayoutCreate");
  if (ld < static_cast<int64_t>(std::max<uint64_t>(rows, 1)))
    die("cublasLtMatrixLayoutCreate: a leading dimension of %lld for %llu rows (column-major)",
        static_cast<long long>(ld), static_cast<unsigned long long>(rows));
  return ltCreate<LtLayout>(l, new LtLayout{type, rows, cols, ld});
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  return ltDestroy<LtLayout>(l, "cublasLtMatrixLayoutDestroy");
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
  return ltCreate<LtPref>(p, new LtPref);
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  return ltDestroy<LtPref>(p, "cublasLtMatmulPreferenceDestroy");
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void *buf, size_t bytes) {
  const char *call = "cublasLtMatmulPreferenceSetAttribute";
  LtPref *x = ltGet<LtPref>(p, call, "preference");
  if (attr != CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES)
    die("%s: attribute %d is not emulated", call, static_cast<int>(attr));
  x->maxWorkspace = ltValue<uint64_t>(buf, bytes, call, "MAX_WORKSPACE_BYTES");
  return CUBLAS_STATUS_SUCCESS;
}

/// The emulation's one algorithm, marked so that cublasLtMatmul knows it
/// came from here; it needs no workspace.
constexpr uint64_t kLtAlgo = 0x63617276654c7431ull;

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dd,
                                              cublasLtMatmulPreference_t p, int requested,
                                              cublasLtMatmulHeuristicResult_t results[],
                                              int *returned) {
  const char *call = "cublasLtMatmulAlgoGetHeuristic";
  ltGet<LtContext>(h, call, "handle");
  ltGet<LtDesc>(d, call, "matmul descriptor");
  ltGet<LtLayout>(a, call, "A layout");
  ltGet<LtLayout>(b, call, "B layout");
  ltGet<LtLayout>(c, call, "C layout");
  ltGet<LtLayout>(dd, call, "D layout");
  ltGet<LtPref>(p, call, "preference");
  if (requested <= 0 || !results || !returned)
    return CUBLAS_STATUS_INVALID_VALUE;
  std::memset(&results[0], 0, sizeof results[0]);
  results[0].algo.data[0] = kLtAlgo;
  results[0].workspaceSize = 0;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha,
                              const void *A, cublasLtMatrixLayout_t a, const void *B,
                              cublasLtMatrixLayout_t b, const void *beta, const void *C,
                              cublasLtMatrixLayout_t c, void *D, cublasLtMatrixLayout_t dd,
                              const cublasLtMatmulAlgo_t *algo, void *workspace,
                              size_t workspaceBytes, cudaStream_t stream) {
  const char *call = "cublasLtMatmul";
  ltGet<LtContext>(h, call, "handle");
  // The descriptors as they are now (cuBLASLt reads them at the call).
  const LtDesc desc = *ltGet<LtDesc>(d, call, "matmul descriptor");
  const LtLayout la = *ltGet<LtLayout>(a, call, "A layout"),
                 lb = *ltGet<LtLayout>(b, call, "B layout"),
                 lc = *ltGet<LtLayout>(c, call, "C layout"),
                 ld = *ltGet<LtLayout>(dd, call, "D layout");
  if (!algo || algo->data[0] != kLtAlgo)
    die("%s: an algorithm not returned by cublasLtMatmulAlgoGetHeuristic", call);
  if (workspaceBytes && !isDevice(workspace, workspaceBytes))
    die("%s: workspace %p (%zu bytes) is not inside one device allocation", call, workspace,
        workspaceBytes);
  const float al = *static_cast<const float *>(alpha), be = *static_cast<const float *>(beta);
  if (al != 1.0f || be != 0.0f)
    die("%s: alpha %g and beta %g (carve's calls use 1 and 0)", call, static_cast<double>(al),
        static_cast<double>(be));
  if (C != D || lc.type != ld.type || lc.rows != ld.rows || lc.cols != ld.cols || lc.ld != ld.ld)
    die("%s: C is not D with D's layout (beta 0: carve passes D as C)", call);
  if (la.type != lb.type || la.type == CUDA_R_32F)
    die("%s: A of type %d and B of type %d (carve multiplies two 16-bit matrices of one type)",
        call, static_cast<int>(la.type), static_cast<int>(lb.type));
  if (ld.type != CUDA_R_32F && ld.type != la.type)
    die("%s: D of type %d from inputs of type %d", call, static_cast<int>(ld.type),
        static_cast<int>(la.type));
  const uint64_t m = desc.ta == CUBLAS_OP_N ? la.rows : la.cols;
  const uint64_t k = desc.ta == CUBLAS_OP_N ? la.cols : la.rows;
  const uint64_t kb = desc.tb == CUBLAS_OP_N ? lb.rows : lb.cols;
  const uint64_t n = desc.tb == CUBLAS_OP_N ? lb.cols : lb.rows;
  if (k != kb || ld.rows != m || ld.cols != n)
    die("%s: op(A) %llu x %llu times op(B) %llu x %llu into D %llu x %llu", call,
        (unsigned long long)m, (unsigned long long)k, (unsigned long long)kb, (unsigned long long)n,
        (unsigned long long)ld.rows, (unsigned long long)ld.cols);
  LtDesc run = desc;
  if (desc.epilogue == CUBLASLT_EPILOGUE_DGELU ||
      desc.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) {
    // GELU's input (read by DGELU, written by GELU_AUX_BIAS): D's type,
    // rows of D, a leading dimension divisible by 8 and at least D's rows
    // (cublasLt.h, EPILOGUE_AUX_LD).
    const char *e = desc.epilogue == CUBLASLT_EPILOGUE_DGELU ? "DGELU" : "GELU_AUX_BIAS";
    if (ld.type == CUDA_R_32F)
      die("%s: %s with an fp32 D (carve's GELU inputs are 16-bit)", call, e);
    if (desc.auxLd < static_cast<int64_t>(std::max<uint64_t>(m, 1)) || desc.auxLd % 8)
      die("%s: %s's EPILOGUE_AUX_LD %lld for D of %llu rows (at least the rows, divisible by 8)",
          call, e, static_cast<long long>(desc.auxLd), (unsigned long long)m);
    const uint64_t auxBytes = n ? ((n - 1) * desc.auxLd + m) * typeBytes(ld.type, call) : 0;
    if (!desc.aux || !isDevice(desc.aux, auxBytes))
      die("%s: %s's auxiliary matrix (%p, %llu x %llu, ld %lld) is not inside one device "
          "allocation",
          call, e, desc.aux, (unsigned long long)m, (unsigned long long)n,
          static_cast<long long>(desc.auxLd));
    if (reinterpret_cast<uintptr_t>(desc.aux) % 16)
      die("%s: %s's auxiliary matrix %p is not 16-byte aligned", call, e, desc.aux);
  }
  if (desc.epilogue != CUBLASLT_EPILOGUE_DEFAULT && desc.epilogue != CUBLASLT_EPILOGUE_DGELU) {
    // BIAS reads a bias per row of D; BGRADA writes one per row, BGRADB one
    // per column.
    const uint64_t count = desc.epilogue == CUBLASLT_EPILOGUE_BGRADB ? n : m;
    const bool adds =
        desc.epilogue == CUBLASLT_EPILOGUE_BIAS || desc.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    const char *what = adds ? "bias" : "bias gradient";
    if (run.biasType == -1)
      run.biasType = ld.type;
    if (run.biasType != ld.type)
      die("%s: a %s of type %d for D of type %d (cuBLASLt takes D's type)", call, what,
          run.biasType, static_cast<int>(ld.type));
    if (!desc.bias || !isDevice(desc.bias, count * typeBytes(ld.type, call)))
      die("%s: the %s (%p, %llu elements) is not inside one device allocation", call, what,
          desc.bias, (unsigned long long)count);
    if (reinterpret_cast<uintptr_t>(desc.bias) % 16)
      die("%s: the %s %p is not 16-byte aligned", call, what, desc.bias);
    if (!adds && k == 0)
      die("%s: a bias gradient over k = 0", call);
  }
  auto extent = [&](const LtLayout &l) {
    return l.cols ? ((l.cols - 1) * l.ld + l.rows) * typeBytes(l.type, call) : 0;
  };
  if (m && n && k) {
    if (!isDevice(A, extent(la)))
      die("%s: A (%p) is not inside one device allocation", call, A);
    if (!isDevice(B, extent(lb)))
      die("%s: B (%p) is not inside one device allocation", call, B);
  }
  if (!isDevice(D, extent(ld)))
    die("%s: D (%p) is not inside one device allocation", call, D);
  issue(stream, [=]() { ltMatmul(run, A, la, B, lb, D, ld); });
  return CUBLAS_STATUS_SUCCESS;
}

} // extern "C"
