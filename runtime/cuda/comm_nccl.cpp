//===- comm_nccl.cpp - the NCCL backend of Communicator -------------------===//
//
// Collectives on device memory through NCCL, ordered against the compute
// stream with events and never blocking the host unless the caller needs a
// value on the host:
//
//   start:  record an event on the compute stream, make this group's stream
//           wait for it, enqueue the NCCL call, record a done event;
//   wait:   make the compute stream wait for the done event (the host goes
//           on), so a gradient bucket's all-reduce overlaps the rest of the
//           backward pass.
//
// Each group (the world, and every split: dp, tp, pp) has its own stream,
// as PyTorch's process groups do, so that a long data-parallel all-reduce
// does not hold up the pipeline's sends (CARVE_NCCL_ONE_STREAM=1 puts every
// group on the runtime's one collective stream instead). NCCL has no tags:
// the messages between two ranks must be posted in the same order on both
// sides, which the generated pipeline schedules do; the tag is checked and
// otherwise ignored.
//
// Host pointers (the loss, the gradient norm's partial sums) are staged:
// copied into pinned memory and on to a device buffer on the group's stream,
// reduced there, copied back into pinned memory, and the wait, on the host,
// copies them out once the done event has completed.
//
// Communicators are NCCL's non-blocking kind (CARVE_NCCL_BLOCKING=1 for the
// blocking one): start-up, splits and the first connection to a peer return
// at once and are polled against the collective timeout, so a rank that never
// joins cannot hang the others. Every wait on the host polls the done event
// and ncclCommGetAsyncError against the timeout; a watchdog thread per group
// does the same for operations the host does not wait for (those whose wait
// only made the compute stream wait), which would otherwise hang in the next
// device synchronization. On an error or a timeout the rank prints one line
// in the MPI backend's words, aborts its NCCL communicators and brings the
// job down (abortAll).
//
// This file holds start-up (makeNcclCommunicator), the communicator's
// construction, splits and teardown, the registry of live communicators, and
// the errors, polling and watchdog above; comm_nccl_collectives.cpp holds the
// operations and their staging. The class is declared in comm_nccl.h.
//
//===----------------------------------------------------------------------===//

#include "comm_nccl.h"

#include "carve/rt/kernels.h"
#include "carve/rt/metrics.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sched.h>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace carve::gpu {
namespace {

using carve::rt::abortAll;
using carve::rt::collectiveTimeout;
using carve::rt::formatBytes;

std::string stepText() {
  const int64_t step = carve::rt::commStep();
  if (step == -1)
    return "at start-up";
  if (step == -2)
    return "after the last step";
  return "step " + std::to_string(step);
}

bool envFlag(const char *name, bool fallback) {
  const char *v = std::getenv(name);
  if (!v || !*v)
    return fallback;
  return std::strcmp(v, "0") != 0;
}

double secondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

//===--- Live communicators: all aborted when one fails -------------------===//

// Never destroyed: a failing rank exits while other threads may use them.
std::mutex &liveMutex() {
  static auto *m = new std::mutex;
  return *m;
}
std::set<ncclComm_t> &liveComms() {
  static auto *s = new std::set<ncclComm_t>;
  return *s;
}
/// The communicator objects (under liveMutex), for discardCapturedCollectives.
std::set<NcclCommunicator *> &liveObjects() {
  static auto *s = new std::set<NcclCommunicator *>;
  return *s;
}
/// Set (under liveMutex) once abortLive has aborted every communicator.
bool gAborted = false;
void addLive(ncclComm_t c) {
  std::lock_guard<std::mutex> lock(liveMutex());
  liveComms().insert(c);
}
/// False when the communicator was already aborted (it must not be destroyed).
bool removeLive(ncclComm_t c) {
  std::lock_guard<std::mutex> lock(liveMutex());
  return liveComms().erase(c) > 0;
}
/// Aborts every NCCL communicator of this process, so that no NCCL kernel is
/// left spinning while the process goes down.
void abortLive() {
  std::lock_guard<std::mutex> lock(liveMutex());
  gAborted = true;
  for (ncclComm_t c : liveComms())
    ncclCommAbort(c);
  liveComms().clear();
}

/// ncclCommGetAsyncError, safe against abortLive on another thread (which
/// frees the communicators): once they are aborted the process is going
/// down, and the thread that aborted them reports why, so the caller waits
/// for the end instead of touching a freed communicator.
ncclResult_t asyncError(ncclComm_t c, ncclResult_t *state) {
  {
    std::lock_guard<std::mutex> lock(liveMutex());
    if (!gAborted)
      return ncclCommGetAsyncError(c, state);
  }
  for (;;)
    std::this_thread::sleep_for(std::chrono::seconds(1));
}

} // namespace

void abortCommunicators() { abortLive(); }

void discardCapturedCollectives() {
  std::vector<NcclCommunicator *> all;
  {
    std::lock_guard<std::mutex> lock(liveMutex());
    all.assign(liveObjects().begin(), liveObjects().end());
  }
  for (NcclCommunicator *c : all)
    c->discardCaptured();
}

namespace {

/// The first thread to fail reports; any other waits for the process to end.
std::atomic<bool> &reporting() {
  static std::atomic<bool> r{false};
  return r;
}

} // namespace

//===--- Construction, splits and teardown --------------------------------===//

NcclCommunicator::NcclCommunicator(ncclComm_t handle, int rank, std::vector<int> worldRanksOfGroup)
    : comm(handle), myRank(rank), members(std::move(worldRanksOfGroup)) {
  addLive(comm);
  std::lock_guard<std::mutex> lock(liveMutex());
  liveObjects().insert(this);
}

bool NcclCommunicator::setUp(bool sharedStream, std::string &error) {
  cudaStream_t shared = commStreamHandle();
  if (sharedStream && shared) {
    groupStream = shared;
  } else {
    cudaError_t e = cudaStreamCreateWithFlags(&groupStream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      error =
          "cudaStreamCreateWithFlags for the collectives: " + std::string(cudaGetErrorString(e));
      return false;
    }
    ownsStream = true;
  }
  cudaError_t e = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
  if (e == cudaSuccess)
    e = cudaMalloc(&barrierBuf, 256);
  if (e == cudaSuccess)
    e = cudaMemsetAsync(barrierBuf, 0, 256, groupStream);
  // Four staging buffers up front: scalars never allocate (which could
  // synchronize the device) in the middle of a step.
  for (int i = 0; i < 4 && e == cudaSuccess; ++i)
    e = addStaging(64 << 10);
  if (e != cudaSuccess) {
    error = "allocating the collectives' buffers: " + std::string(cudaGetErrorString(e));
    return false;
  }
  // The watchdog thread must use this device: a new thread's current
  // device is 0, and touching it would create a context on another GPU.
  int device = 0;
  e = cudaGetDevice(&device);
  if (e != cudaSuccess) {
    error = "cudaGetDevice: " + std::string(cudaGetErrorString(e));
    return false;
  }
  if (envFlag("CARVE_NCCL_WATCHDOG", true))
    watchdog = std::thread([this, device] { watch(device); });
  return true;
}

NcclCommunicator::~NcclCommunicator() {
  {
    std::lock_guard<std::mutex> lock(liveMutex());
    liveObjects().erase(this);
  }
  if (watchdog.joinable()) {
    {
      std::lock_guard<std::mutex> lock(watchMutex);
      stopping = true;
    }
    watchCv.notify_all();
    watchdog.join();
  }
  if (removeLive(comm))
    release();
  // Everything below is local; errors at exit have nobody to report to.
  for (Staging &s : staging) {
    cudaFree(s.dev);
    cudaFreeHost(s.pinned);
  }
  cudaFree(barrierBuf);
  for (cudaEvent_t ev : freeEvents)
    cudaEventDestroy(ev);
  for (Slot &s : slots)
    if (s.done)
      cudaEventDestroy(s.done);
  for (Watch &w : watches)
    cudaEventDestroy(w.ev);
  for (cudaEvent_t ev : freeWatchEvents)
    cudaEventDestroy(ev);
  if (ready)
    cudaEventDestroy(ready);
  if (ownsStream)
    cudaStreamDestroy(groupStream);
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) {
  if (color < 0)
    fatal("split with color %d: colors are non-negative", color);
  OpInfo info{"split", 0};
  ncclComm_t sub = nullptr;
  ncclResult_t r = ncclCommSplit(comm, color, key, &sub, nullptr);
  if (r != ncclSuccess && r != ncclInProgress)
    fail(info, ncclCause(r, comm));
  // A non-blocking split completes in the background and only then writes
  // `sub` (NULL until; NCCL's ncclCommSplit says so): wait (bounded) until
  // the parent is ready, then for the new communicator.
  const double limit = collectiveTimeout();
  const Clock::time_point start = Clock::now();
  for (unsigned spin = 1;; ++spin) {
    poll(comm, info);
    if (__atomic_load_n(&sub, __ATOMIC_ACQUIRE))
      break;
    if (r == ncclSuccess)
      fail(info, "NCCL returned no communicator");
    pause(spin);
    if (limit > 0 && secondsSince(start) > limit)
      timedOut(info, limit);
  }
  poll(sub, info);
  int subRank = 0, subSize = 0;
  if (ncclCommUserRank(sub, &subRank) != ncclSuccess ||
      ncclCommCount(sub, &subSize) != ncclSuccess || subSize < 1)
    fail(info, "the new communicator has no rank or size");
  auto child = std::make_unique<NcclCommunicator>(sub, subRank, std::vector<int>(subSize, -1));
  std::string error;
  if (!child->setUp(envFlag("CARVE_NCCL_ONE_STREAM", false), error))
    fail(info, error);
  // The members' world ranks, gathered over the new group (bounded like
  // every host wait); messages until then name the parent group.
  child->members[subRank] = static_cast<int>(worldRank());
  child->setName(name());
  std::vector<int64_t> mine{worldRank()}, all(static_cast<size_t>(subSize));
  child->allGather(mine.data(), all.data(), 1, CommType::I64);
  for (int i = 0; i < subSize; ++i)
    child->members[i] = static_cast<int>(all[i]);
  child->setName("world");
  return child;
}

//===--- Errors, polling and the watchdog ---------------------------------===//

void NcclCommunicator::cudaCheck(cudaError_t e, const OpInfo &info) {
  if (e != cudaSuccess)
    fail(info, std::string("CUDA: ") + cudaGetErrorString(e));
}

void NcclCommunicator::settle(ncclResult_t r, const OpInfo &info) {
  if (r == ncclSuccess)
    return;
  if (r == ncclInProgress) {
    poll(comm, info);
    return;
  }
  fail(info, ncclCause(r, comm));
}

void NcclCommunicator::poll(ncclComm_t c, const OpInfo &info) {
  const double limit = collectiveTimeout();
  const Clock::time_point start = Clock::now();
  for (unsigned spin = 1;; ++spin) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = asyncError(c, &state);
    if (r != ncclSuccess)
      fail(info, ncclCause(r, c));
    if (state == ncclSuccess)
      return;
    if (state != ncclInProgress)
      fail(info, ncclCause(state, c));
    pause(spin);
    if (limit > 0 && secondsSince(start) > limit)
      timedOut(info, limit);
  }
}

void NcclCommunicator::hostWait(cudaEvent_t ev, const OpInfo &info) {
  if (carve::gpu::capturing())
    fail(info, "the host cannot wait for a collective while the step is captured in a CUDA "
               "graph");
  const double limit = collectiveTimeout();
  const Clock::time_point start = Clock::now();
  for (unsigned spin = 1;; ++spin) {
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess)
      return;
    if (e != cudaErrorNotReady)
      fail(info, std::string("CUDA: ") + cudaGetErrorString(e));
    if (spin % 64 == 0) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = asyncError(comm, &state);
      if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress))
        fail(info, ncclCause(r != ncclSuccess ? r : state, comm));
      if (limit > 0 && secondsSince(start) > limit)
        timedOut(info, limit);
    }
    pause(spin);
  }
}

void NcclCommunicator::pause(unsigned spin) {
  if (spin < 2000)
    sched_yield();
  else
    std::this_thread::sleep_for(std::chrono::microseconds(100));
}

void NcclCommunicator::watchOp(const OpInfo &info) {
  // Events recorded while capturing cannot be queried; the captured graph's
  // launch is waited for with the same timeout instead (graphStep).
  if (!watchdog.joinable() || carve::gpu::capturing())
    return;
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> lock(watchMutex);
    if (!freeWatchEvents.empty()) {
      ev = freeWatchEvents.back();
      freeWatchEvents.pop_back();
    }
  }
  if (!ev && cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess)
    fail(info, "CUDA: cannot create an event for the watchdog");
  cudaCheck(cudaEventRecord(ev, groupStream), info);
  std::lock_guard<std::mutex> lock(watchMutex);
  watches.push_back(Watch{ev, Clock::now(), info});
}

void NcclCommunicator::watch(int device) {
  if (cudaSetDevice(device) != cudaSuccess)
    return; // the host's own waits still bound every operation it waits for
  std::unique_lock<std::mutex> lock(watchMutex);
  while (!stopping) {
    watchCv.wait_for(lock, std::chrono::milliseconds(200), [this] { return stopping; });
    if (stopping)
      break;
    while (!watches.empty()) {
      cudaError_t e = cudaEventQuery(watches.front().ev);
      if (e == cudaErrorNotReady) {
        const double limit = collectiveTimeout();
        if (limit > 0 && secondsSince(watches.front().start) > limit) {
          const OpInfo info = watches.front().info;
          lock.unlock();
          timedOut(info, limit);
        }
        break;
      }
      // Completed, or a CUDA error the host will meet at its next call.
      freeWatchEvents.push_back(watches.front().ev);
      watches.pop_front();
      if (e != cudaSuccess)
        break;
    }
    ncclResult_t state = ncclSuccess;
    if (asyncError(comm, &state) == ncclSuccess && state != ncclSuccess &&
        state != ncclInProgress) {
      OpInfo info = watches.empty() ? OpInfo{"collective", 0} : watches.front().info;
      lock.unlock();
      fail(info, ncclCause(state, comm));
    }
  }
}

void NcclCommunicator::timedOut(const OpInfo &info, double limit) {
  std::string suspects;
  if (info.peer >= 0) {
    suspects = "rank " + std::to_string(members[info.peer]) + " may be dead or stuck";
  } else {
    for (int i = 0; i < size(); ++i)
      if (i != myRank)
        suspects += (suspects.empty() ? "" : ", ") + std::to_string(members[i]);
    suspects = suspects.empty() ? "this rank's device may be stuck"
                                : "rank(s) " + suspects + " of that group may be dead or stuck";
  }
  char limitText[32];
  std::snprintf(limitText, sizeof limitText, "%g", limit);
  fail(info, std::string("did not complete in ") + limitText + " s; " + suspects);
}

void NcclCommunicator::fail(const OpInfo &info, const std::string &cause) {
  if (carve::rt::fatalTrapped()) {
    // A CUDA graph capture (graphStep): nothing ran, the communicator is
    // intact, and the step runs eagerly instead.
    carve::rt::FatalTrapped t;
    std::snprintf(t.message, sizeof t.message, "NCCL %s over %s: %s", info.op, name().c_str(),
                  cause.c_str());
    throw t;
  }
  if (reporting().exchange(true))
    for (;;)
      std::this_thread::sleep_for(std::chrono::seconds(1));
  std::string what = info.op;
  if (info.peer >= 0 && info.peer < size())
    what += std::string(std::strcmp(info.op, "send") == 0 ? " to" : " from") + " rank " +
            std::to_string(members[info.peer]);
  std::fflush(stdout);
  std::fprintf(stderr, "carve: rank %lld: NCCL %s over %s (%s, %s): %s\n",
               static_cast<long long>(worldRank()), what.c_str(), name().c_str(),
               formatBytes(info.bytes).c_str(), stepText().c_str(), cause.c_str());
  std::fflush(stderr);
  abortLive();
  abortAll(1);
}

void NcclCommunicator::release() {
  const double limit = std::min(collectiveTimeout() > 0 ? collectiveTimeout() : 60.0, 60.0);
  const Clock::time_point start = Clock::now();
  const ncclResult_t r = ncclCommFinalize(comm);
  bool clean = r == ncclSuccess || r == ncclInProgress;
  for (unsigned spin = 1; clean; ++spin) {
    ncclResult_t state = ncclSuccess;
    if (asyncError(comm, &state) != ncclSuccess ||
        (state != ncclSuccess && state != ncclInProgress)) {
      clean = false;
      break;
    }
    if (state == ncclSuccess)
      break;
    if (secondsSince(start) > limit) {
      clean = false;
      break;
    }
    pause(spin);
  }
  if (!clean || ncclCommDestroy(comm) != ncclSuccess)
    ncclCommAbort(comm);
}

void NcclCommunicator::checkPeer(const char *op, int64_t bytes, int peer, int tag) const {
  // Any tag >= 0: NCCL matches by order; only sends to this rank itself are
  // matched by tag (the generated pipelines use transfer * micro-batches + mb).
  if (bytes < 0 || peer < 0 || peer >= size() || tag < 0)
    fatal("%s of %lld bytes with peer %d, tag %d, in a group of %d ranks", op,
          static_cast<long long>(bytes), peer, tag, size());
}

//===--- Start-up ----------------------------------------------------------===//

std::unique_ptr<Communicator> makeNcclCommunicator(Communicator &bootstrap, std::string &error) {
  const int rank = bootstrap.rank(), size = bootstrap.size();
  const std::vector<int> members = bootstrap.worldRanks();
  const std::string who = "rank " + std::to_string(members.at(static_cast<size_t>(rank)));

  // Rank 0's unique id, or why it has none: every rank learns either.
  struct IdMessage {
    int32_t ok;
    char why[252];
    ncclUniqueId id;
  } msg{};
  if (rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&msg.id);
    msg.ok = r == ncclSuccess;
    if (!msg.ok)
      std::snprintf(msg.why, sizeof msg.why, "%s", ncclGetErrorString(r));
  }
  bootstrap.broadcast(&msg, sizeof msg, 0);
  if (!msg.ok) {
    msg.why[sizeof msg.why - 1] = '\0';
    error = who + ": NCCL could not start: rank " + std::to_string(members[0]) +
            " could not make NCCL's unique id (" + msg.why + ")";
    return nullptr;
  }

  int device = -1;
  cudaError_t ce = cudaGetDevice(&device);
  if (ce != cudaSuccess) {
    error = who + ": NCCL could not start: no current CUDA device (" + cudaGetErrorString(ce) + ")";
    return nullptr;
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = envFlag("CARVE_NCCL_BLOCKING", false) ? 1 : 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, msg.id, rank, &config);
  const std::string where = who + ": NCCL start-up over " + bootstrap.name() + " (" +
                            std::to_string(size) + " ranks, GPU " + std::to_string(device) + ")";
  if (r == ncclInProgress && comm) {
    const double limit = collectiveTimeout();
    const Clock::time_point start = Clock::now();
    for (unsigned spin = 1;; ++spin) {
      ncclResult_t state = ncclSuccess;
      r = asyncError(comm, &state);
      if (r != ncclSuccess)
        break;
      if (state != ncclInProgress) {
        r = state;
        break;
      }
      if (limit > 0 && secondsSince(start) > limit) {
        char limitText[32];
        std::snprintf(limitText, sizeof limitText, "%g", limit);
        error = where + " did not complete in " + limitText +
                " s; another rank may have failed to start or be stuck";
        ncclCommAbort(comm);
        return nullptr;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  if (r != ncclSuccess) {
    error = where + " failed: " + ncclCause(r, comm);
    if (comm)
      ncclCommAbort(comm);
    return nullptr;
  }

  auto c = std::make_unique<NcclCommunicator>(comm, rank, members);
  c->setName(bootstrap.name());
  if (!c->setUp(true, error)) {
    error = who + ": NCCL start-up: " + error;
    return nullptr;
  }
  return c;
}

} // namespace carve::gpu
