//===- comm_nccl.h - the NCCL communicator, shared by its two files -------===//
//
// NcclCommunicator, the NCCL backend of Communicator (the design is described
// at the top of comm_nccl.cpp). Private to its two files:
//  - comm_nccl.cpp: start-up (makeNcclCommunicator), construction, splits and
//    teardown, the registry of live communicators that are aborted together,
//    and errors, polling, the watchdog and the failure report;
//  - comm_nccl_collectives.cpp: the operations (collectives, point-to-point
//    messages, wait, broadcast, barrier), the staging of host memory, and the
//    streams' events, slots and buffers they take.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_CUDA_COMM_NCCL_H
#define CARVE_RT_CUDA_COMM_NCCL_H

#include "internal.h"

#include "carve/rt/comm.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace carve::gpu {

using Clock = std::chrono::steady_clock;

namespace {

/// NCCL's error and, when it has one, its last message (which names the
/// failing peer or transport).
inline std::string ncclCause(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  const char *last = comm ? ncclGetLastError(comm) : nullptr;
  if (last && *last)
    s += std::string(" (") + last + ")";
  return s;
}

} // namespace

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
  NcclCommunicator(ncclComm_t handle, int rank, std::vector<int> worldRanksOfGroup);

  /// Streams, events and staging buffers; false with `error` set.
  bool setUp(bool sharedStream, std::string &error);

  ~NcclCommunicator() override;

  int rank() const override { return myRank; }
  int size() const override { return static_cast<int>(members.size()); }
  std::vector<int> worldRanks() const override { return members; }

  CommHandle allReduceAsync(void *buf, int64_t n, CommType t, ReduceOp op) override;
  CommHandle allGatherAsync(const void *send, void *recv, int64_t nPerRank, CommType t) override;
  CommHandle reduceScatterAsync(const void *send, void *recv, const int64_t *counts, CommType t,
                                ReduceOp op) override;
  CommHandle allToAllAsync(const void *send, void *recv, int64_t nPerRank, CommType t) override;
  CommHandle sendAsync(const void *buf, int64_t bytes, int peer, int tag) override;
  CommHandle recvAsync(void *buf, int64_t bytes, int peer, int tag) override;
  void wait(CommHandle h) override;
  void broadcast(void *buf, int64_t bytes, int root) override;
  void barrier() override;
  std::unique_ptr<Communicator> split(int color, int key) override;

  /// After a CUDA graph capture that failed half-way (graphStep): forgets the
  /// operations started in it and not yet waited for, joining their stream
  /// back to the compute stream so that the capture can end. Nothing of them
  /// ran: a capture only records.
  void discardCaptured();

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
    int add(const void *p, int64_t bytes, bool in, bool out);
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
    bool captured = false; // started while a CUDA graph was being captured
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

  //===--- Starting and ending operations (comm_nccl_collectives.cpp) -----===//

  Op begin(OpInfo info);
  /// Copies the operation's host inputs to the device, on the group's stream.
  void stageIn(Op &o);
  CommHandle end(Op &o);
  /// Matches a send to itself with the oldest pending receive of the same
  /// tag (or the other way round), copying on the group's stream.
  CommHandle postSelf(bool isSend, void *buf, int64_t bytes, int tag);

  //===--- Resources (comm_nccl_collectives.cpp) ---------------------------===//

  cudaError_t addStaging(size_t bytes);
  int takeStaging(size_t bytes, const OpInfo &info);
  cudaEvent_t takeEvent();
  int64_t takeSlot();
  void freeSlot(int64_t id);

  //===--- Errors, polling and the watchdog (comm_nccl.cpp) ---------------===//

  void cudaCheck(cudaError_t e, const OpInfo &info);
  /// After an NCCL call: in progress (non-blocking communicators) is polled
  /// to completion, anything else but success is fatal.
  void settle(ncclResult_t r, const OpInfo &info);
  /// Waits until `c` is no longer in progress; fatal on an error or at the
  /// collective timeout.
  void poll(ncclComm_t c, const OpInfo &info);
  /// Blocks the host until `ev` completes, watching for NCCL errors and the
  /// collective timeout.
  void hostWait(cudaEvent_t ev, const OpInfo &info);
  /// Yields the core at first (a scalar all-reduce takes microseconds), then
  /// sleeps briefly so that a long wait does not burn it.
  static void pause(unsigned spin);
  /// Hands the operation just enqueued to the watchdog.
  void watchOp(const OpInfo &info);
  /// The watchdog: operations of one stream complete in order, so only the
  /// oldest one can be late.
  void watch(int device);
  [[noreturn]] void timedOut(const OpInfo &info, double limit);
  /// One line, every NCCL communicator of the process aborted, the job down.
  [[noreturn]] void fail(const OpInfo &info, const std::string &cause);
  /// Finalizes the communicator (bounded), or aborts it when that fails.
  void release();
  void checkPeer(const char *op, int64_t bytes, int peer, int tag) const;

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

} // namespace carve::gpu

#endif // CARVE_RT_CUDA_COMM_NCCL_H
