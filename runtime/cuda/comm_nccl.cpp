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
//===----------------------------------------------------------------------===//

#include "internal.h"

#include "carve/rt/comm.h"
#include "carve/rt/kernels.h"
#include "carve/rt/metrics.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
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
using carve::rt::commTypeBytes;
using carve::rt::formatBytes;
using Clock = std::chrono::steady_clock;

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

ncclDataType_t ncclType(CommType t) {
  switch (t) {
  case CommType::F32:
    return ncclFloat;
  case CommType::F64:
    return ncclDouble;
  case CommType::I64:
    return ncclInt64;
  case CommType::I32:
    return ncclInt32;
  case CommType::U8:
    return ncclUint8;
  }
  fatal("collective: unknown element type %d", static_cast<int>(t));
}

ncclRedOp_t ncclOp(ReduceOp op) { return op == ReduceOp::Max ? ncclMax : ncclSum; }

void checkCount(const char *op, int64_t n) {
  if (n < 0)
    fatal("%s of %lld elements", op, static_cast<long long>(n));
}

/// Memory NCCL cannot use directly: pageable or pinned host memory (device
/// and managed memory it can).
bool isHost(const void *p) {
  if (!p)
    return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    // Older drivers fail on unregistered host memory; clear the error.
    cudaGetLastError();
    return true;
  }
  return a.type == cudaMemoryTypeHost || a.type == cudaMemoryTypeUnregistered;
}

/// NCCL's error and, when it has one, its last message (which names the
/// failing peer or transport).
std::string ncclCause(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  const char *last = comm ? ncclGetLastError(comm) : nullptr;
  if (last && *last)
    s += std::string(" (") + last + ")";
  return s;
}

//===--- Live communicators: all aborted when one fails -------------------===//

std::mutex &liveMutex() {
  static std::mutex m;
  return m;
}
std::set<ncclComm_t> &liveComms() {
  static std::set<ncclComm_t> s;
  return s;
}
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
  for (ncclComm_t c : liveComms())
    ncclCommAbort(c);
  liveComms().clear();
}

} // namespace

void abortCommunicators() { abortLive(); }

namespace {

/// The first thread to fail reports; any other waits for the process to end.
std::atomic<bool> &reporting() {
  static std::atomic<bool> r{false};
  return r;
}

//===--- The communicator --------------------------------------------------===//

/// What messages say about an operation.
struct OpInfo {
  const char *op = "";
  int64_t bytes = 0;
  int peer = -1; // point-to-point: the group rank of the other side
};

class NcclCommunicator : public Communicator {
public:
  /// Takes ownership of `comm` (already initialized); `members` are the
  /// world ranks of the group in group rank order.
  NcclCommunicator(ncclComm_t handle, int rank, std::vector<int> worldRanksOfGroup)
      : comm(handle), myRank(rank), members(std::move(worldRanksOfGroup)) {
    addLive(comm);
  }

  /// Streams, events and staging buffers; false with `error` set.
  bool setUp(bool sharedStream, std::string &error) {
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

  ~NcclCommunicator() override {
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

  int rank() const override { return myRank; }
  int size() const override { return static_cast<int>(members.size()); }
  std::vector<int> worldRanks() const override { return members; }

  CommHandle allReduceAsync(void *buf, int64_t n, CommType t, ReduceOp op) override {
    checkCount("all-reduce", n);
    if (n == 0)
      return {};
    const int64_t bytes = n * commTypeBytes(t);
    Op o = begin(OpInfo{"all-reduce", bytes});
    int b = o.stage.add(buf, bytes, true, true);
    stageIn(o);
    void *d = o.stage.dev(b, buf);
    settle(ncclAllReduce(d, d, static_cast<size_t>(n), ncclType(t), ncclOp(op), comm, groupStream),
           o.info);
    return end(o);
  }

  CommHandle allGatherAsync(const void *send, void *recv, int64_t nPerRank, CommType t) override {
    checkCount("all-gather", nPerRank);
    if (nPerRank == 0)
      return {};
    const int64_t block = nPerRank * commTypeBytes(t);
    Op o = begin(OpInfo{"all-gather", block * size()});
    // The receive buffer first: an in-place send lies inside it.
    int r = o.stage.add(recv, block * size(), true, true);
    int s = o.stage.add(send, block, true, false);
    stageIn(o);
    settle(ncclAllGather(o.stage.dev(s, send), o.stage.dev(r, recv), static_cast<size_t>(nPerRank),
                         ncclType(t), comm, groupStream),
           o.info);
    return end(o);
  }

  CommHandle reduceScatterAsync(const void *send, void *recv, const int64_t *counts, CommType t,
                                ReduceOp op) override {
    const int n = size();
    int64_t total = 0;
    bool equal = true;
    for (int r = 0; r < n; ++r) {
      checkCount("reduce-scatter", counts[r]);
      total += counts[r];
      equal = equal && counts[r] == counts[0];
    }
    if (total == 0)
      return {};
    const int es = commTypeBytes(t);
    Op o = begin(OpInfo{"reduce-scatter", total * es});
    int s = o.stage.add(send, total * es, true, false);
    int r = counts[myRank] > 0 ? o.stage.add(recv, counts[myRank] * es, false, true) : -1;
    stageIn(o);
    const char *dSend = static_cast<const char *>(o.stage.dev(s, send));
    void *dRecv = o.stage.dev(r, recv);
    if (equal) {
      settle(ncclReduceScatter(dSend, dRecv, static_cast<size_t>(counts[0]), ncclType(t),
                               ncclOp(op), comm, groupStream),
             o.info);
    } else {
      // One reduction to each rank, grouped into one launch. Non-root ranks
      // never write their receive pointer; they get a valid one anyway.
      settle(ncclGroupStart(), o.info);
      int64_t offset = 0;
      for (int root = 0; root < n; ++root) {
        if (counts[root] > 0) {
          const char *part = dSend + offset * es;
          void *out = root == myRank ? dRecv : const_cast<char *>(part);
          ncclResult_t res = ncclReduce(part, out, static_cast<size_t>(counts[root]), ncclType(t),
                                        ncclOp(op), root, comm, groupStream);
          if (res != ncclSuccess && res != ncclInProgress) {
            ncclGroupEnd();
            fail(o.info, ncclCause(res, comm));
          }
        }
        offset += counts[root];
      }
      settle(ncclGroupEnd(), o.info);
    }
    return end(o);
  }

  CommHandle allToAllAsync(const void *send, void *recv, int64_t nPerRank, CommType t) override {
    checkCount("all-to-all", nPerRank);
    if (nPerRank == 0)
      return {};
    const int n = size();
    const int64_t block = nPerRank * commTypeBytes(t);
    Op o = begin(OpInfo{"all-to-all", block * n});
    int s = o.stage.add(send, block * n, true, false);
    int r = o.stage.add(recv, block * n, false, true);
    stageIn(o);
    const char *dSend = static_cast<const char *>(o.stage.dev(s, send));
    char *dRecv = static_cast<char *>(o.stage.dev(r, recv));
    if (n > 1) {
      settle(ncclGroupStart(), o.info);
      for (int peer = 0; peer < n; ++peer) {
        if (peer == myRank)
          continue;
        ncclResult_t a = ncclSend(dSend + peer * block, static_cast<size_t>(nPerRank), ncclType(t),
                                  peer, comm, groupStream);
        ncclResult_t b = ncclRecv(dRecv + peer * block, static_cast<size_t>(nPerRank), ncclType(t),
                                  peer, comm, groupStream);
        for (ncclResult_t res : {a, b})
          if (res != ncclSuccess && res != ncclInProgress) {
            ncclGroupEnd();
            fail(o.info, ncclCause(res, comm));
          }
      }
      settle(ncclGroupEnd(), o.info);
    }
    cudaCheck(cudaMemcpyAsync(dRecv + myRank * block, dSend + myRank * block,
                              static_cast<size_t>(block), cudaMemcpyDefault, groupStream),
              o.info);
    return end(o);
  }

  CommHandle sendAsync(const void *buf, int64_t bytes, int peer, int tag) override {
    checkPeer("send", bytes, peer, tag);
    if (bytes == 0)
      return {};
    if (peer == myRank)
      return postSelf(true, const_cast<void *>(buf), bytes, tag);
    Op o = begin(OpInfo{"send", bytes, peer});
    int b = o.stage.add(buf, bytes, true, false);
    stageIn(o);
    settle(ncclSend(o.stage.dev(b, buf), static_cast<size_t>(bytes), ncclUint8, peer, comm,
                    groupStream),
           o.info);
    return end(o);
  }

  CommHandle recvAsync(void *buf, int64_t bytes, int peer, int tag) override {
    checkPeer("receive", bytes, peer, tag);
    if (bytes == 0)
      return {};
    if (peer == myRank)
      return postSelf(false, buf, bytes, tag);
    Op o = begin(OpInfo{"receive", bytes, peer});
    int b = o.stage.add(buf, bytes, false, true);
    stageIn(o);
    settle(ncclRecv(o.stage.dev(b, buf), static_cast<size_t>(bytes), ncclUint8, peer, comm,
                    groupStream),
           o.info);
    return end(o);
  }

  void wait(CommHandle h) override {
    if (h.id < 0)
      return;
    if (h.id >= static_cast<int64_t>(slots.size()) || !slots[h.id].active)
      fatal("wait on unknown or already completed communication handle %lld",
            static_cast<long long>(h.id));
    Slot &s = slots[h.id];
    if (s.selfPending)
      fatal("wait on a %s with tag %d to this same rank that no %s matches: it would never "
            "complete",
            s.info.op, s.selfTag, std::strcmp(s.info.op, "send") == 0 ? "receive" : "send");
    if (s.staging >= 0) {
      hostWait(s.done, s.info);
      Staging &st = staging[s.staging];
      for (const Copy &c : s.outs)
        std::memcpy(c.host, static_cast<char *>(st.pinned) + c.offset,
                    static_cast<size_t>(c.bytes));
      st.busy = false;
    }
    cudaCheck(cudaStreamWaitEvent(compute(), s.done, 0), s.info);
    freeSlot(h.id);
  }

  void broadcast(void *buf, int64_t bytes, int root) override {
    if (bytes < 0 || root < 0 || root >= size())
      fatal("broadcast of %lld bytes from rank %d in a group of %d ranks",
            static_cast<long long>(bytes), root, size());
    if (bytes == 0)
      return;
    Op o = begin(OpInfo{"broadcast", bytes});
    int b = o.stage.add(buf, bytes, myRank == root, myRank != root);
    stageIn(o);
    void *d = o.stage.dev(b, buf);
    settle(ncclBroadcast(d, d, static_cast<size_t>(bytes), ncclUint8, root, comm, groupStream),
           o.info);
    CommHandle h = end(o);
    const OpInfo info = slots[h.id].info;
    cudaEvent_t done = slots[h.id].done;
    hostWait(done, info);
    wait(h);
  }

  void barrier() override {
    OpInfo info{"barrier", 0};
    // No compute-stream dependency: a barrier orders hosts, not kernels.
    settle(ncclAllReduce(barrierBuf, barrierBuf, 1, ncclFloat, ncclSum, comm, groupStream), info);
    cudaEvent_t ev = takeEvent();
    cudaCheck(cudaEventRecord(ev, groupStream), info);
    watchOp(info);
    hostWait(ev, info);
    freeEvents.push_back(ev);
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    if (color < 0)
      fatal("split with color %d: colors are non-negative", color);
    OpInfo info{"split", 0};
    ncclComm_t sub = nullptr;
    ncclResult_t r = ncclCommSplit(comm, color, key, &sub, nullptr);
    if (r != ncclSuccess && r != ncclInProgress)
      fail(info, ncclCause(r, comm));
    if (!sub)
      fail(info, "NCCL returned no communicator");
    // A non-blocking split completes in the background: wait (bounded) until
    // both communicators are ready.
    poll(comm, info);
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

private:
  /// A pinned host buffer and a device buffer of the same size.
  struct Staging {
    void *dev = nullptr;
    void *pinned = nullptr;
    size_t cap = 0;
    bool busy = false;
  };

  /// A host region's bytes going back from pinned memory at the wait.
  struct Copy {
    void *host;
    int64_t offset;
    int64_t bytes;
  };

  /// The host pointers of one operation and where they live on the device.
  class Stager {
  public:
    struct Region {
      const char *host;
      int64_t bytes;
      int64_t offset;
      bool in, out;
    };

    /// Registers `bytes` at `p`; -1 when `p` is device memory (used as is),
    /// else a token for `dev`. A pointer inside a region already added
    /// shares it (an in-place all-gather).
    int add(const void *p, int64_t bytes, bool in, bool out) {
      if (bytes <= 0 || !isHost(p))
        return -1;
      const char *c = static_cast<const char *>(p);
      for (size_t i = 0; i < regions.size(); ++i) {
        Region &r = regions[i];
        if (c >= r.host && c + bytes <= r.host + r.bytes) {
          r.in = r.in || in;
          r.out = r.out || out;
          refs.push_back({static_cast<int>(i), c - r.host});
          return static_cast<int>(refs.size()) - 1;
        }
      }
      regions.push_back({c, bytes, total, in, out});
      total += (bytes + 255) & ~int64_t(255);
      refs.push_back({static_cast<int>(regions.size()) - 1, 0});
      return static_cast<int>(refs.size()) - 1;
    }
    bool empty() const { return regions.empty(); }
    /// The device pointer of token `t`, or `original` for device memory.
    void *dev(int t, const void *original) const {
      if (t < 0)
        return const_cast<void *>(original);
      const Ref &r = refs[t];
      return base + regions[r.region].offset + r.within;
    }

    std::vector<Region> regions;
    int64_t total = 0;
    char *base = nullptr;

  private:
    struct Ref {
      int region;
      int64_t within;
    };
    std::vector<Ref> refs;
  };

  /// An operation being started.
  struct Op {
    OpInfo info;
    Stager stage;
    int staging = -1;
  };

  /// A started operation until its wait.
  struct Slot {
    bool active = false;
    cudaEvent_t done = nullptr;
    OpInfo info;
    int staging = -1;
    std::vector<Copy> outs;
    bool selfPending = false;
    int selfTag = 0;
  };

  /// An operation the watchdog follows until its event completes.
  struct Watch {
    cudaEvent_t ev;
    Clock::time_point start;
    OpInfo info;
  };

  /// A send to itself or a receive from itself not yet matched.
  struct SelfOp {
    int64_t slot;
    bool isSend;
    void *buf;
    int64_t bytes;
    int tag;
  };

  static cudaStream_t compute() { return carve::gpu::stream(); }

  int64_t worldRank() const { return members[myRank]; }

  //===--- Starting and ending operations ---------------------------------===//

  Op begin(OpInfo info) {
    Op o;
    o.info = info;
    // The operation reads what the compute stream has written so far.
    cudaCheck(cudaEventRecord(ready, compute()), info);
    cudaCheck(cudaStreamWaitEvent(groupStream, ready, 0), info);
    return o;
  }

  /// Copies the operation's host inputs to the device, on the group's stream.
  void stageIn(Op &o) {
    if (o.stage.empty())
      return;
    if (carve::gpu::capturing())
      fail(o.info, "host memory cannot take part in a collective captured in a CUDA graph (the "
                   "copy to the device would not be repeated); run without --cuda-graph");
    o.staging = takeStaging(static_cast<size_t>(o.stage.total), o.info);
    Staging &st = staging[o.staging];
    o.stage.base = static_cast<char *>(st.dev);
    for (const Stager::Region &r : o.stage.regions)
      if (r.in)
        std::memcpy(static_cast<char *>(st.pinned) + r.offset, r.host,
                    static_cast<size_t>(r.bytes));
    cudaCheck(cudaMemcpyAsync(st.dev, st.pinned, static_cast<size_t>(o.stage.total),
                              cudaMemcpyHostToDevice, groupStream),
              o.info);
  }

  CommHandle end(Op &o) {
    const int64_t id = takeSlot();
    Slot &s = slots[id];
    s.info = o.info;
    s.staging = o.staging;
    s.outs.clear();
    if (o.staging >= 0) {
      Staging &st = staging[o.staging];
      cudaCheck(cudaMemcpyAsync(st.pinned, st.dev, static_cast<size_t>(o.stage.total),
                                cudaMemcpyDeviceToHost, groupStream),
                o.info);
      for (const Stager::Region &r : o.stage.regions)
        if (r.out)
          s.outs.push_back(Copy{const_cast<char *>(r.host), r.offset, r.bytes});
    }
    cudaCheck(cudaEventRecord(s.done, groupStream), o.info);
    watchOp(o.info);
    return CommHandle{id};
  }

  /// Matches a send to itself with the oldest pending receive of the same
  /// tag (or the other way round), copying on the group's stream.
  CommHandle postSelf(bool isSend, void *buf, int64_t bytes, int tag) {
    OpInfo info{isSend ? "send" : "receive", bytes, myRank};
    const int64_t id = takeSlot();
    slots[id].info = info;
    slots[id].staging = -1;
    slots[id].outs.clear();
    for (auto it = selfOps.begin(); it != selfOps.end(); ++it) {
      if (it->isSend == isSend || it->tag != tag)
        continue;
      const SelfOp other = *it;
      selfOps.erase(it);
      const SelfOp &send = isSend ? SelfOp{id, true, buf, bytes, tag} : other;
      const SelfOp &recv = isSend ? other : SelfOp{id, false, buf, bytes, tag};
      if (send.bytes != recv.bytes)
        fatal("a send of %lld bytes to this same rank meets a receive of %lld bytes (tag %d)",
              static_cast<long long>(send.bytes), static_cast<long long>(recv.bytes), tag);
      begin(info);
      cudaCheck(cudaMemcpyAsync(recv.buf, send.buf, static_cast<size_t>(bytes), cudaMemcpyDefault,
                                groupStream),
                info);
      for (int64_t s : {id, other.slot}) {
        slots[s].selfPending = false;
        cudaCheck(cudaEventRecord(slots[s].done, groupStream), info);
      }
      return CommHandle{id};
    }
    slots[id].selfPending = true;
    slots[id].selfTag = tag;
    selfOps.push_back(SelfOp{id, isSend, buf, bytes, tag});
    return CommHandle{id};
  }

  //===--- Resources -------------------------------------------------------===//

  cudaError_t addStaging(size_t bytes) {
    Staging s;
    s.cap = bytes;
    cudaError_t e = cudaMalloc(&s.dev, bytes);
    if (e != cudaSuccess)
      return e;
    e = cudaMallocHost(&s.pinned, bytes);
    if (e != cudaSuccess) {
      cudaFree(s.dev);
      return e;
    }
    staging.push_back(s);
    return cudaSuccess;
  }

  int takeStaging(size_t bytes, const OpInfo &info) {
    for (size_t i = 0; i < staging.size(); ++i)
      if (!staging[i].busy && staging[i].cap >= bytes) {
        staging[i].busy = true;
        return static_cast<int>(i);
      }
    cudaError_t e = addStaging(std::max<size_t>(bytes, 64 << 10));
    if (e != cudaSuccess)
      fail(info, "staging " + formatBytes(static_cast<int64_t>(bytes)) +
                     " of host memory for the device: " + cudaGetErrorString(e));
    staging.back().busy = true;
    return static_cast<int>(staging.size()) - 1;
  }

  cudaEvent_t takeEvent() {
    if (!freeEvents.empty()) {
      cudaEvent_t ev = freeEvents.back();
      freeEvents.pop_back();
      return ev;
    }
    cudaEvent_t ev = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e != cudaSuccess)
      fatal("CUDA: cudaEventCreateWithFlags failed: %s", cudaGetErrorString(e));
    return ev;
  }

  int64_t takeSlot() {
    int64_t id;
    if (!freeSlots.empty()) {
      id = freeSlots.back();
      freeSlots.pop_back();
    } else {
      slots.emplace_back();
      id = static_cast<int64_t>(slots.size()) - 1;
    }
    Slot &s = slots[id];
    s.active = true;
    s.selfPending = false;
    if (!s.done)
      s.done = takeEvent();
    return id;
  }

  void freeSlot(int64_t id) {
    slots[id].active = false;
    slots[id].outs.clear();
    slots[id].staging = -1;
    freeSlots.push_back(id);
  }

  //===--- Errors, polling and the watchdog -------------------------------===//

  void cudaCheck(cudaError_t e, const OpInfo &info) {
    if (e != cudaSuccess)
      fail(info, std::string("CUDA: ") + cudaGetErrorString(e));
  }

  /// After an NCCL call: in progress (non-blocking communicators) is polled
  /// to completion, anything else but success is fatal.
  void settle(ncclResult_t r, const OpInfo &info) {
    if (r == ncclSuccess)
      return;
    if (r == ncclInProgress) {
      poll(comm, info);
      return;
    }
    fail(info, ncclCause(r, comm));
  }

  /// Waits until `c` is no longer in progress; fatal on an error or at the
  /// collective timeout.
  void poll(ncclComm_t c, const OpInfo &info) {
    const double limit = collectiveTimeout();
    const Clock::time_point start = Clock::now();
    for (unsigned spin = 1;; ++spin) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(c, &state);
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

  /// Blocks the host until `ev` completes, watching for NCCL errors and the
  /// collective timeout.
  void hostWait(cudaEvent_t ev, const OpInfo &info) {
    if (carve::gpu::capturing())
      fail(info, "the host cannot wait for a collective while the step is captured in a CUDA "
                 "graph; run without --cuda-graph");
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
        ncclResult_t r = ncclCommGetAsyncError(comm, &state);
        if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress))
          fail(info, ncclCause(r != ncclSuccess ? r : state, comm));
        if (limit > 0 && secondsSince(start) > limit)
          timedOut(info, limit);
      }
      pause(spin);
    }
  }

  /// Yields the core at first (a scalar all-reduce takes microseconds), then
  /// sleeps briefly so that a long wait does not burn it.
  static void pause(unsigned spin) {
    if (spin < 2000)
      sched_yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  }

  /// Hands the operation just enqueued to the watchdog.
  void watchOp(const OpInfo &info) {
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

  /// The watchdog: operations of one stream complete in order, so only the
  /// oldest one can be late.
  void watch(int device) {
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
      if (ncclCommGetAsyncError(comm, &state) == ncclSuccess && state != ncclSuccess &&
          state != ncclInProgress) {
        OpInfo info = watches.empty() ? OpInfo{"collective", 0} : watches.front().info;
        lock.unlock();
        fail(info, ncclCause(state, comm));
      }
    }
  }

  [[noreturn]] void timedOut(const OpInfo &info, double limit) {
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

  /// One line, every NCCL communicator of the process aborted, the job down.
  [[noreturn]] void fail(const OpInfo &info, const std::string &cause) {
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

  /// Finalizes the communicator (bounded), or aborts it when that fails.
  void release() {
    const double limit = std::min(collectiveTimeout() > 0 ? collectiveTimeout() : 60.0, 60.0);
    const Clock::time_point start = Clock::now();
    const ncclResult_t r = ncclCommFinalize(comm);
    bool clean = r == ncclSuccess || r == ncclInProgress;
    for (unsigned spin = 1; clean; ++spin) {
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm, &state) != ncclSuccess ||
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

  void checkPeer(const char *op, int64_t bytes, int peer, int tag) const {
    if (bytes < 0 || peer < 0 || peer >= size() || tag < 0 || tag > 32767)
      fatal("%s of %lld bytes with peer %d, tag %d, in a group of %d ranks", op,
            static_cast<long long>(bytes), peer, tag, size());
  }

  ncclComm_t comm;
  int myRank;
  std::vector<int> members; // world ranks in group rank order
  cudaStream_t groupStream = nullptr;
  bool ownsStream = false;
  cudaEvent_t ready = nullptr;
  void *barrierBuf = nullptr;
  std::vector<Staging> staging;
  std::vector<Slot> slots;
  std::vector<int64_t> freeSlots;
  std::vector<cudaEvent_t> freeEvents;
  std::deque<SelfOp> selfOps;

  std::thread watchdog;
  std::mutex watchMutex; // guards everything below
  std::condition_variable watchCv;
  bool stopping = false;
  std::deque<Watch> watches;
  std::vector<cudaEvent_t> freeWatchEvents;
};

} // namespace

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
      r = ncclCommGetAsyncError(comm, &state);
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
