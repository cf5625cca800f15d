//===- device.cu - the CUDA device: streams, memory, errors, kCudaTarget ---===//
//
// One device per process (rank): `open` picks it, checks that the arena fits
// and creates the compute and collective streams, the cuBLAS handle and the
// device error record. Everything else in runtime/cuda/ reaches them through
// internal.h. Failures the runtime's main can report (no device, not enough
// memory, a faulting kernel) come back as one line naming the rank and the
// GPU; failures inside a step are fatal (carve::rt::fatal).
//
//===----------------------------------------------------------------------===//

#include "internal.h"

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sched.h>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace carve::gpu {

void printKernelProfile();

namespace {

/// cuBLAS's workspace: NVIDIA's recommendation for Hopper (32 MiB) covers
/// every architecture we build for.
constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;
/// Device memory beyond the arena that cuBLAS, NCCL and the scratch buffers need.
constexpr int64_t kReserveBytes = int64_t(256) << 20;

struct DeviceState {
  bool open = false;
  int worldRank = 0;
  int device = -1;
  cudaStream_t compute = nullptr;
  cudaStream_t comm = nullptr;
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t blasLt = nullptr; // the matmuls with an epilogue
  void *blasWorkspace = nullptr;     // cuBLAS's and cuBLASLt's (one stream)
  DeviceError *error = nullptr;
  void *scratch[kNumWorkspaceSlots] = {};
  size_t scratchBytes[kNumWorkspaceSlots] = {};
  // graphStep: the body and arena it captured, how often it ran, the graph.
  void (*graphBody)(StepContext &) = nullptr;
  char *graphArena = nullptr;
  int64_t graphCalls = 0;
  cudaGraphExec_t graph = nullptr;
  int64_t graphNodes = 0;
  cudaEvent_t graphDone = nullptr;
  bool capturing = false;
  bool graphOff = false; // a capture failed: eager from then on
  std::string graphWhy;  // what broke it
};

DeviceState &state() {
  static DeviceState s;
  return s;
}

Precision gPrecision = Precision::F32;
bool gTf32 = false;

std::string format(const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

double gib(int64_t bytes) { return static_cast<double>(bytes) / double(int64_t(1) << 30); }

/// "rank R: GPU D: " for messages about this rank's device.
std::string where() {
  const DeviceState &s = state();
  return format("rank %d: GPU %d: ", s.worldRank, s.device);
}

/// Sets `error` when `e` is a failure of `what`; true when it is.
bool failed(cudaError_t e, const char *what, std::string &error) {
  if (e == cudaSuccess)
    return false;
  error = where() + what + " failed: " + cudaGetErrorString(e);
  return true;
}

void requireOpen(const char *what) {
  if (!state().open)
    fatal("CUDA: %s before the device was opened (DeviceTarget::open)", what);
}

void closeDevice() {
  DeviceState &s = state();
  if (!s.open)
    return;
  printKernelProfile(); // while the device and its events are alive
  // Teardown: a device that already failed may refuse; nothing to do about it.
  cudaDeviceSynchronize();
  if (s.graph)
    cudaGraphExecDestroy(s.graph);
  if (s.graphDone)
    cudaEventDestroy(s.graphDone);
  if (s.blas)
    cublasDestroy(s.blas);
  if (s.blasLt)
    cublasLtDestroy(s.blasLt);
  cudaFree(s.blasWorkspace);
  cudaFree(s.error);
  for (int i = 0; i < kNumWorkspaceSlots; ++i)
    cudaFree(s.scratch[i]);
  if (s.compute)
    cudaStreamDestroy(s.compute);
  if (s.comm)
    cudaStreamDestroy(s.comm);
  const int rank = s.worldRank;
  s = DeviceState();
  s.worldRank = rank;
}

bool openDevice(int worldRank, int localRank, int localRanks, int64_t arenaBytes,
                std::string &error) {
  DeviceState &s = state();
  if (s.open)
    closeDevice();
  s.worldRank = worldRank;
  KernelTimer::profiling(); // reads CARVE_GPU_PROFILE before the first launch
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    const char *visible = std::getenv("CUDA_VISIBLE_DEVICES");
    error = format("rank %d: no CUDA device is visible (CUDA_VISIBLE_DEVICES=%s): %s", worldRank,
                   visible ? visible : "unset",
                   e != cudaSuccess ? cudaGetErrorString(e) : "the driver reports 0 devices");
    return false;
  }
  if (localRanks > count) {
    error = format("rank %d: %d ranks run on this host but only %d GPU(s) are visible; start at "
                   "most %d ranks per host or make more GPUs visible",
                   worldRank, localRanks, count, count);
    return false;
  }
  if (localRank < 0 || localRank >= count) {
    error = format("rank %d: local rank %d has no GPU (%d visible)", worldRank, localRank, count);
    return false;
  }
  s.device = localRank;
  if (failed(cudaSetDevice(localRank), "cudaSetDevice", error))
    return false;
  cudaDeviceProp prop{};
  if (failed(cudaGetDeviceProperties(&prop, localRank), "cudaGetDeviceProperties", error))
    return false;
  size_t freeBytes = 0, totalBytes = 0;
  if (failed(cudaMemGetInfo(&freeBytes, &totalBytes), "cudaMemGetInfo", error))
    return false;
  if (static_cast<int64_t>(freeBytes) < arenaBytes + kReserveBytes) {
    error = format("rank %d: GPU %d (%s) has %.2f GiB free, the plan needs %.2f GiB (arena) + "
                   "%.2f GiB; use more ranks (tp, pp, ZeRO) or a smaller batch",
                   worldRank, localRank, prop.name, gib(static_cast<int64_t>(freeBytes)),
                   gib(arenaBytes), gib(kReserveBytes));
    return false;
  }
  if (failed(cudaStreamCreateWithFlags(&s.compute, cudaStreamNonBlocking),
             "cudaStreamCreateWithFlags (compute)", error) ||
      failed(cudaStreamCreateWithFlags(&s.comm, cudaStreamNonBlocking),
             "cudaStreamCreateWithFlags (collectives)", error) ||
      failed(cudaMalloc(reinterpret_cast<void **>(&s.error), sizeof(DeviceError)),
             "cudaMalloc (error record)", error) ||
      failed(cudaMemset(s.error, 0, sizeof(DeviceError)), "cudaMemset (error record)", error) ||
      failed(cudaMalloc(&s.blasWorkspace, kCublasWorkspaceBytes), "cudaMalloc (cuBLAS workspace)",
             error)) {
    s.open = true;
    closeDevice();
    return false;
  }
  cublasStatus_t b = cublasCreate(&s.blas);
  if (b == CUBLAS_STATUS_SUCCESS)
    b = cublasSetStream(s.blas, s.compute);
  if (b == CUBLAS_STATUS_SUCCESS)
    b = cublasSetWorkspace(s.blas, s.blasWorkspace, kCublasWorkspaceBytes);
  if (b == CUBLAS_STATUS_SUCCESS)
    b = cublasSetMathMode(s.blas, CUBLAS_DEFAULT_MATH);
  if (b == CUBLAS_STATUS_SUCCESS)
    b = cublasLtCreate(&s.blasLt);
  if (b != CUBLAS_STATUS_SUCCESS) {
    error = where() + "cuBLAS set-up failed: " + cublasGetStatusString(b);
    s.open = true;
    closeDevice();
    return false;
  }
  // The record's clearing ran on the legacy stream, which the compute stream
  // does not wait for.
  if (failed(cudaDeviceSynchronize(), "device set-up", error)) {
    s.open = true;
    closeDevice();
    return false;
  }
  s.open = true;
  return true;
}

char *allocArena(int64_t bytes, std::string &error) {
  void *p = nullptr;
  const size_t n = static_cast<size_t>(bytes > 0 ? bytes : 1);
  cudaError_t e = cudaMalloc(&p, n);
  if (e != cudaSuccess) {
    error = where() + format("cudaMalloc of %.2f GiB for the arena failed: %s", gib(bytes),
                             cudaGetErrorString(e));
    return nullptr;
  }
  e = cudaMemset(p, 0, n);
  if (e == cudaSuccess)
    e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    error = where() + "clearing the arena failed: " + cudaGetErrorString(e);
    cudaFree(p);
    return nullptr;
  }
  return static_cast<char *>(p);
}

void freeArena(char *p) {
  // The arena goes away at exit or after a failure: nothing to report.
  cudaFree(p);
}

bool copyBytes(void *dst, const void *src, int64_t bytes, cudaMemcpyKind kind, const char *what,
               std::string &error) {
  if (bytes <= 0)
    return true;
  if (failed(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), kind, stream()), what, error))
    return false;
  return !failed(cudaStreamSynchronize(stream()), what, error);
}

bool toDevice(char *dev, const char *host, int64_t bytes, std::string &error) {
  return copyBytes(dev, host, bytes, cudaMemcpyHostToDevice, "copy to the device", error);
}

bool toHost(char *host, const char *dev, int64_t bytes, std::string &error) {
  return copyBytes(host, dev, bytes, cudaMemcpyDeviceToHost, "copy from the device", error);
}

bool synchronizeDevice(std::string &error) {
  if (failed(cudaDeviceSynchronize(), "a kernel or collective", error))
    return false;
  if (failed(cudaGetLastError(), "a kernel launch", error))
    return false;
  std::string message;
  if (state().error && takeDeviceError(message)) {
    error = where() + message;
    return false;
  }
  return true;
}

std::unique_ptr<Communicator> makeComm(Communicator &bootstrap, std::string &error) {
  return makeNcclCommunicator(bootstrap, error);
}

} // namespace

//===--- internal.h ---------------------------------------------------------===//

cublasHandle_t cublas() {
  requireOpen("cublas");
  return state().blas;
}

cublasLtHandle_t cublasLt() {
  requireOpen("cublasLt");
  return state().blasLt;
}

void *blasWorkspace(size_t &bytes) {
  requireOpen("blasWorkspace");
  bytes = kCublasWorkspaceBytes;
  return state().blasWorkspace;
}

DeviceError *deviceError() {
  requireOpen("a kernel that checks its data");
  return state().error;
}

int *deviceErrorFlag() { return &deviceError()->code; }

bool takeDeviceError(std::string &message) {
  DeviceError e{};
  CARVE_CUDA_CHECK(cudaMemcpy(&e, deviceError(), sizeof e, cudaMemcpyDeviceToHost));
  if (e.code == kNoDeviceError)
    return false;
  // On the compute stream, and waited for: a kernel enqueued next may record
  // a new error, which a reset still in flight on another stream would erase.
  CARVE_CUDA_CHECK(cudaMemsetAsync(deviceError(), 0, sizeof e, stream()));
  CARVE_CUDA_CHECK(cudaStreamSynchronize(stream()));
  switch (e.code) {
  case kBadTarget:
    message =
        format("cross_entropy: target %lld at element %lld is outside [0, %lld)", e.a, e.b, e.c);
    break;
  case kBadIndex:
    message =
        format("gather: index %lld at element %lld is outside [-%lld, %lld)", e.a, e.b, e.c, e.c);
    break;
  default:
    message = format("a kernel reported error %d (%lld, %lld, %lld)", e.code, e.a, e.b, e.c);
  }
  return true;
}

void *workspace(size_t bytes, int slot) {
  requireOpen("workspace");
  if (slot < 0 || slot >= kNumWorkspaceSlots)
    fatal("CUDA: workspace slot %d (there are %d)", slot, static_cast<int>(kNumWorkspaceSlots));
  DeviceState &s = state();
  if (bytes <= s.scratchBytes[slot])
    return s.scratch[slot];
  // Growing moves the buffer: a captured graph would go on using the old one.
  if (s.capturing || s.graph)
    fatal("CUDA graph: scratch slot %d must grow from %zu to %zu bytes %s (the warm-up step "
          "asked for less); run with --no-cuda-graph",
          slot, s.scratchBytes[slot], bytes,
          s.capturing ? "while the step is captured" : "after the step was captured");
  // Work already enqueued may still read the old buffer.
  CARVE_CUDA_CHECK(cudaDeviceSynchronize());
  CARVE_CUDA_CHECK(cudaFree(s.scratch[slot]));
  s.scratch[slot] = nullptr;
  s.scratchBytes[slot] = 0;
  // Grow by a quarter at least, so that slowly growing requests reallocate rarely.
  size_t n = bytes + bytes / 4;
  n = (n + (size_t(1) << 20) - 1) & ~((size_t(1) << 20) - 1);
  cudaError_t e = cudaMalloc(&s.scratch[slot], n);
  if (e != cudaSuccess)
    fatal("CUDA: scratch buffer of %.3f GiB (slot %d) could not be allocated: %s",
          gib(static_cast<int64_t>(n)), slot, cudaGetErrorString(e));
  s.scratchBytes[slot] = n;
  if (slot == kWsCounters) // counters start at zero (kernels leave them so)
    CARVE_CUDA_CHECK(cudaMemset(s.scratch[slot], 0, n));
  return s.scratch[slot];
}

bool capturing() { return state().capturing; }

//===--- gpu.h: CUDA graphs --------------------------------------------------===//

namespace {

/// Captures `body` into `s.graph` (nothing runs). False, with what broke it
/// in `why`, when the step cannot be captured: whatever would have ended the
/// process inside the body (fatal, a failed NCCL call) is trapped, the
/// collectives it started are forgotten, the capture ended and dropped.
bool captureGraph(DeviceState &s, StepContext &ctx, void (*body)(StepContext &), std::string &why) {
  cudaError_t e = cudaStreamBeginCapture(s.compute, cudaStreamCaptureModeThreadLocal);
  if (e != cudaSuccess) {
    why = format("starting the capture failed: %s", cudaGetErrorString(e));
    (void)cudaGetLastError();
    return false;
  }
  s.capturing = true;
  try {
    carve::rt::FatalTrap trap;
    body(ctx);
  } catch (const carve::rt::FatalTrapped &t) {
    why = t.message;
  }
  s.capturing = false;
  if (!why.empty())
    discardCapturedCollectives();
  cudaGraph_t g = nullptr;
  e = cudaStreamEndCapture(s.compute, &g);
  if (why.empty() && (e != cudaSuccess || !g))
    why = format("ending the capture failed: %s (an operation in the forward and backward cannot "
                 "be captured, and did not say so when called)",
                 e != cudaSuccess ? cudaGetErrorString(e) : "no graph");
  if (!why.empty()) {
    if (g)
      cudaGraphDestroy(g);
    (void)cudaGetLastError(); // capture errors are not sticky: nothing is lost
    return false;
  }
  size_t nodes = 0;
  e = cudaGraphGetNodes(g, nullptr, &nodes);
  if (e == cudaSuccess)
    e = cudaGraphInstantiate(&s.graph, g, 0);
  cudaGraphDestroy(g);
  if (e != cudaSuccess) {
    s.graph = nullptr;
    why = format("instantiating the captured graph (%zu nodes) failed: %s", nodes,
                 cudaGetErrorString(e));
    (void)cudaGetLastError();
    return false;
  }
  s.graphNodes = static_cast<int64_t>(nodes);
  return true;
}

/// Waits for the graph just launched, polling so that a collective inside it
/// that never completes (a peer died or stopped) ends the job after
/// --collective-timeout seconds; NCCL's own errors are reported by the
/// communicators' watchdogs meanwhile.
void waitForGraph(DeviceState &s, int64_t step) {
  CARVE_CUDA_CHECK(cudaEventRecord(s.graphDone, s.compute));
  const double limit = carve::rt::collectiveTimeout();
  const auto start = std::chrono::steady_clock::now();
  for (unsigned spin = 1;; ++spin) {
    cudaError_t e = cudaEventQuery(s.graphDone);
    if (e == cudaSuccess)
      return;
    if (e != cudaErrorNotReady) {
      abortCommunicators();
      fatal("%sstep %lld: the CUDA graph of the forward and backward failed: %s",
            where().c_str(), static_cast<long long>(step + 1), cudaGetErrorString(e));
    }
    if (spin % 64 == 0 && limit > 0 &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > limit) {
      // Abort the communicators first, as comm_nccl.cpp does on its own
      // failures: the graph's NCCL kernels stop spinning and the peers' NCCL
      // calls fail promptly instead of waiting out their own timeouts.
      abortCommunicators();
      fatal("%sstep %lld: the CUDA graph of the forward and backward did not complete in %g s; "
            "a rank it exchanges data with may be dead or stuck (--collective-timeout)",
            where().c_str(), static_cast<long long>(step + 1), limit);
    }
    if (spin < 2000)
      sched_yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

} // namespace

void graphStep(StepContext &ctx, void (*body)(StepContext &)) {
  requireOpen("graphStep");
  if (!ctx.cudaGraph) {
    body(ctx);
    return;
  }
  DeviceState &s = state();
  if (s.capturing)
    fatal("CUDA graph: graphStep called while a step is being captured");
  if (s.graphBody && (s.graphBody != body || s.graphArena != ctx.arena))
    fatal("CUDA graph: the step's %s changed after the first step (one program and one arena "
          "per process)",
          s.graphBody != body ? "forward and backward" : "arena");
  s.graphBody = body;
  s.graphArena = ctx.arena;
  if (s.graphCalls++ == 0) {
    body(ctx); // the warm-up
    return;
  }
  if (s.graphOff) {
    body(ctx);
    return;
  }
  if (!s.graphDone)
    CARVE_CUDA_CHECK(cudaEventCreateWithFlags(&s.graphDone, cudaEventDisableTiming));
  if (!s.graph) {
    // Every rank replays its graph or none does: NCCL's collectives must be
    // captured on all ranks alike.
    const bool ok = captureGraph(s, ctx, body, s.graphWhy);
    const bool all = ctx.hooks ? ctx.hooks->everyRank(ok) : ok;
    if (!all) {
      if (s.graph)
        cudaGraphExecDestroy(s.graph);
      s.graph = nullptr;
      s.graphNodes = 0;
      s.graphOff = true;
      ctx.graphFallback = ok ? 2 : 1;
      ctx.graphFallbackWhy = ok ? nullptr : s.graphWhy.c_str();
      body(ctx);
      return;
    }
  }
  CARVE_CUDA_CHECK(cudaGraphLaunch(s.graph, s.compute));
  waitForGraph(s, ctx.step);
  ctx.graphNodes = s.graphNodes;
}

//===--- gpu.h: device, streams, memory -------------------------------------===//

void *computeStream() { return state().compute; }
void *commStream() { return state().comm; }

void synchronize() {
  std::string error;
  if (!synchronizeDevice(error))
    fatal("%s", error.c_str());
}

void checkLaunch(const char *what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    fatal("CUDA: launch of %s failed: %s", what, cudaGetErrorString(e));
}

void setPrecision(Precision p) { gPrecision = p; }
Precision precision() { return gPrecision; }
void setTf32(bool on) { gTf32 = on; }
bool tf32() { return gTf32; }

float readScalar(const float *p) {
  float v = 0;
  CARVE_CUDA_CHECK(cudaMemcpyAsync(&v, p, sizeof v, cudaMemcpyDeviceToHost, stream()));
  CARVE_CUDA_CHECK(cudaStreamSynchronize(stream()));
  return v;
}

double readScalar(const double *p) {
  double v = 0;
  CARVE_CUDA_CHECK(cudaMemcpyAsync(&v, p, sizeof v, cudaMemcpyDeviceToHost, stream()));
  CARVE_CUDA_CHECK(cudaStreamSynchronize(stream()));
  return v;
}

void readScalars(const double *p, double *host, int n) {
  if (n <= 0)
    return;
  CARVE_CUDA_CHECK(
      cudaMemcpyAsync(host, p, sizeof(double) * n, cudaMemcpyDeviceToHost, stream()));
  CARVE_CUDA_CHECK(cudaStreamSynchronize(stream()));
}

//===--- CARVE_GPU_PROFILE: GPU time by kernel ------------------------------===//

namespace {

/// Event pairs of the launches timed since the last harvest; harvested (the
/// device synchronized, the times added by name) when the pool is full and
/// at exit, where the table is printed to stderr.
struct Profile {
  struct Pending {
    const char *name;
    cudaStream_t stream;
    cudaEvent_t start, stop;
  };
  std::vector<Pending> pending;
  std::vector<cudaEvent_t> spare;
  std::map<std::string, std::pair<int64_t, double>> byName; // calls, milliseconds
  // The first training step's table, kept aside: its first calls load
  // cuBLAS's kernels and pick its algorithms (a 7x7 convolution's GEMM took
  // 110 ms there, 0.1 ms after), which would swamp a short profile.
  std::map<std::string, std::pair<int64_t, double>> firstStep;
  int64_t firstStepIndex = -1, steps = 0;
  bool printed = false;
  int open = 0; // timers started and not stopped: no harvest under them

  cudaEvent_t event() {
    cudaEvent_t e = nullptr;
    if (!spare.empty()) {
      e = spare.back();
      spare.pop_back();
    } else {
      CARVE_CUDA_CHECK(cudaEventCreate(&e));
    }
    return e;
  }
  void harvest() {
    if (pending.empty())
      return;
    CARVE_CUDA_CHECK(cudaDeviceSynchronize());
    for (Pending &p : pending) {
      float ms = 0;
      if (p.stop && cudaEventElapsedTime(&ms, p.start, p.stop) == cudaSuccess) {
        auto &entry = byName[p.name];
        entry.first += 1;
        entry.second += ms;
      }
      spare.push_back(p.start);
      if (p.stop)
        spare.push_back(p.stop);
    }
    pending.clear();
  }
  void stepEnded(int64_t step) {
    if (steps++ == 0) {
      harvest();
      firstStep.swap(byName);
      byName.clear();
      firstStepIndex = step;
    }
  }
  static double sum(const std::map<std::string, std::pair<int64_t, double>> &table) {
    double total = 0;
    for (auto &r : table)
      total += r.second.second;
    return total;
  }
  void print() {
    if (printed)
      return;
    printed = true;
    harvest();
    std::string scope = "";
    if (steps > 1) {
      scope = format(" over %lld step%s from step %lld (step %lld, %.3f ms, left out: its first "
                     "calls load and tune the kernels)",
                     static_cast<long long>(steps - 1), steps > 2 ? "s" : "",
                     static_cast<long long>(firstStepIndex + 2),
                     static_cast<long long>(firstStepIndex + 1), sum(firstStep));
    } else if (steps == 1) {
      // One step only: its table, warm-up and all.
      for (auto &r : firstStep) {
        auto &e = byName[r.first];
        e.first += r.second.first;
        e.second += r.second.second;
      }
      scope = " (one step, its first calls' loading and tuning included)";
    }
    const double total = sum(byName);
    std::vector<std::pair<std::string, std::pair<int64_t, double>>> rows(byName.begin(),
                                                                         byName.end());
    std::sort(rows.begin(), rows.end(),
              [](auto &a, auto &b) { return a.second.second > b.second.second; });
    std::fprintf(stderr, "carve: GPU time by kernel (CARVE_GPU_PROFILE): %.3f ms in all%s\n", total,
                 scope.c_str());
    std::fprintf(stderr, "%10s %6s %8s %12s  %s\n", "ms", "%", "calls", "us/call", "kernel");
    for (auto &r : rows)
      std::fprintf(stderr, "%10.3f %6.2f %8lld %12.2f  %s\n", r.second.second,
                   total > 0 ? 100.0 * r.second.second / total : 0.0, (long long)r.second.first,
                   1e3 * r.second.second / r.second.first, r.first.c_str());
  }
};

Profile &profile() {
  static Profile p;
  return p;
}

} // namespace

bool KernelTimer::profiling() {
  static const bool on = [] {
    const char *v = std::getenv("CARVE_GPU_PROFILE");
    const bool yes = v && *v && std::string(v) != "0";
#ifdef CARVE_TESTS_GPU_EMU_CUDA_EMU_H
    // The CPU emulation's CARVE_KERNEL is its own launcher: it calls the
    // timer around each launch instead.
    if (yes) {
      carve_emu::launchTimerStart = &KernelTimer::startTiming;
      carve_emu::launchTimerStop = &KernelTimer::stopTiming;
    }
#endif
    return yes;
  }();
  return on;
}

bool KernelTimer::byShape() {
  static const bool on = [] {
    const char *v = std::getenv("CARVE_GPU_PROFILE");
    return v && std::string(v) == "shapes";
  }();
  return on;
}

const char *KernelTimer::intern(const std::string &name) {
  static std::set<std::string> names;
  return names.insert(name).first->c_str();
}

/// The table, once: when the device closes (train's end, or a fatal error
/// that closes it).
void printKernelProfile() {
  if (KernelTimer::profiling())
    profile().print();
}

void profileStepEnded(int64_t step) {
  if (KernelTimer::profiling())
    profile().stepEnded(step);
}

int KernelTimer::startTiming(const char *name, void *stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &capturing) != cudaSuccess ||
      capturing != cudaStreamCaptureStatusNone)
    return -1;
  Profile &p = profile();
  if (p.pending.size() >= 4096 && p.open == 0)
    p.harvest();
  p.pending.push_back({name, s, p.event(), nullptr});
  CARVE_CUDA_CHECK(cudaEventRecord(p.pending.back().start, s));
  ++p.open;
  return static_cast<int>(p.pending.size() - 1);
}

void KernelTimer::stopTiming(int slot) {
  Profile &p = profile();
  --p.open;
  Profile::Pending &e = p.pending[slot];
  e.stop = p.event();
  CARVE_CUDA_CHECK(cudaEventRecord(e.stop, e.stream));
}

const DeviceTarget kCudaTarget = {
    "cuda",  &openDevice,        &allocArena, &freeArena,   &toDevice,
    &toHost, &synchronizeDevice, &makeComm,   &closeDevice, &profileStepEnded,
};

} // namespace carve::gpu
