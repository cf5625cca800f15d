//===- comm.h - collective communication ----------------------------------===//
//
// A `Communicator` is a group of ranks (a mesh axis). Collectives are
// asynchronous: they return a `CommHandle` that `wait` completes, so the
// generated code starts a gradient bucket's all-reduce as soon as the bucket
// is complete and waits only before the optimizer. The MPI backend (comm_mpi.cpp)
// is the CPU one; an NCCL backend (streams, ncclCommSplit per mesh axis) will
// implement the same interface.
//
// Every wait is bounded by the collective timeout (setCollectiveTimeout): an
// operation that does not complete in time means a rank of the group died or
// stopped answering, and the waiting rank names the operation, the group and
// its other members, then brings the whole job down (docs/failures.md).
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_COMM_H
#define CARVE_RT_COMM_H

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace carve::rt {

enum class ReduceOp : int { Sum = 0, Max = 1 };
/// BF16 and F16: 16-bit floats (mixed-precision parameter copies and
/// gradients). Every communicator reduces them as NCCL does: each element
/// read as the float it represents, combined in float, rounded to nearest
/// even after each step, in rank order, so every rank gets the same bits.
enum class CommType : int { F32 = 0, F64 = 1, I64 = 2, I32 = 3, U8 = 4, BF16 = 5, F16 = 6 };

/// Size in bytes of one element of `t`.
inline int commTypeBytes(CommType t) {
  return t == CommType::U8                           ? 1
         : t == CommType::BF16 || t == CommType::F16 ? 2
         : t == CommType::F32 || t == CommType::I32  ? 4
                                                     : 8;
}

/// An operation in flight. Default-constructed handles are complete.
struct CommHandle {
  int64_t id = -1;
};

class Communicator {
public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Starts an in-place all-reduce of n elements.
  virtual CommHandle allReduceAsync(void *buf, int64_t n, CommType t, ReduceOp op) = 0;
  /// Starts an all-gather: `recv` gets size() * nPerRank elements, rank r's
  /// `send` at element r * nPerRank. In place when `send` is recv's own block
  /// (recv + rank() * nPerRank elements).
  virtual CommHandle allGatherAsync(const void *send, void *recv, int64_t nPerRank,
                                    CommType t) = 0;
  /// Starts a reduce-scatter: `send` holds sum(counts) elements, rank r's part
  /// from the prefix sum of counts[0..r); `recv` gets the reduction of this
  /// rank's part, counts[rank()] elements (zeros allowed). `counts` (size()
  /// entries, equal on every rank) is copied; `send` and `recv` must not overlap.
  virtual CommHandle reduceScatterAsync(const void *send, void *recv, const int64_t *counts,
                                        CommType t, ReduceOp op) = 0;
  /// Starts an all-to-all: block r of `send` (nPerRank elements at r * nPerRank)
  /// goes to rank r, which receives it as block rank() of its `recv`.
  virtual CommHandle allToAllAsync(const void *send, void *recv, int64_t nPerRank,
                                   CommType t) = 0;
  /// Starts a point-to-point send of `bytes` bytes to `peer`; messages with
  /// the same peer and tag arrive in order. 0 <= tag < 32768.
  virtual CommHandle sendAsync(const void *buf, int64_t bytes, int peer, int tag) = 0;
  /// Starts the receive matching `sendAsync(.., bytes, rank(), tag)` on `peer`.
  virtual CommHandle recvAsync(void *buf, int64_t bytes, int peer, int tag) = 0;
  /// Completes an operation; fatal error (all ranks brought down) on failure.
  virtual void wait(CommHandle h) = 0;
  /// Blocking broadcast of `bytes` bytes from `root`.
  virtual void broadcast(void *buf, int64_t bytes, int root) = 0;
  virtual void barrier() = 0;
  /// A sub-communicator of the ranks that pass the same color, ordered by key
  /// (for mesh axes: dp, tp, pp groups).
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
  /// The world ranks of this group's members, in group rank order.
  virtual std::vector<int> worldRanks() const = 0;

  /// The group's name in messages: "world", "dp", "tp", "pp".
  const std::string &name() const { return groupName; }
  void setName(std::string n) { groupName = std::move(n); }

  void allReduce(void *buf, int64_t n, CommType t, ReduceOp op) {
    wait(allReduceAsync(buf, n, t, op));
  }
  void allGather(const void *send, void *recv, int64_t nPerRank, CommType t) {
    wait(allGatherAsync(send, recv, nPerRank, t));
  }
  void reduceScatter(const void *send, void *recv, const int64_t *counts, CommType t,
                     ReduceOp op) {
    wait(reduceScatterAsync(send, recv, counts, t, op));
  }
  void allToAll(const void *send, void *recv, int64_t nPerRank, CommType t) {
    wait(allToAllAsync(send, recv, nPerRank, t));
  }
  void send(const void *buf, int64_t bytes, int peer, int tag) {
    wait(sendAsync(buf, bytes, peer, tag));
  }
  void recv(void *buf, int64_t bytes, int peer, int tag) {
    wait(recvAsync(buf, bytes, peer, tag));
  }

private:
  std::string groupName = "world";
};

/// Initializes MPI (once per process) and returns the world communicator.
/// A failing rank calls MPI_Abort, which brings every rank down.
std::unique_ptr<Communicator> makeMpiWorld(int *argc, char ***argv);
/// A one-rank communicator with no MPI: collectives copy (or do nothing in
/// place); a send to itself completes with the matching receive.
std::unique_ptr<Communicator> makeSelfCommunicator();
/// Finalizes MPI if it was initialized.
void finalizeComm();
/// Brings every rank down (MPI_Abort when MPI is up, exit otherwise).
[[noreturn]] void abortAll(int code);

/// Seconds any wait (collective, send, receive, broadcast, barrier) may take
/// before the rank reports the operation and aborts the job; 0 waits forever.
/// Default kDefaultCollectiveTimeout.
void setCollectiveTimeout(double seconds);
double collectiveTimeout();
constexpr double kDefaultCollectiveTimeout = 300;
/// The training step that timeout messages name; -1 before the first step
/// (start-up), -2 after the last (saving, tracing).
void setCommStep(int64_t step);
/// The step setCommStep last set (for the backends' messages).
int64_t commStep();

/// The world of a plain launcher (torchrun's convention, or srun with the
/// variables exported): RANK and WORLD_SIZE, with MASTER_ADDR and MASTER_PORT
/// where rank 0 listens, give a host Communicator over TCP sockets
/// (runtime/src/comm_tcp_*.cpp). It bootstraps NCCL without MPI and runs CPU programs.
/// Null with `error` empty when RANK and WORLD_SIZE are both unset; null with
/// `error` set (one line) when they are malformed or the ranks cannot connect
/// within the collective timeout.
std::unique_ptr<Communicator> makeEnvWorld(std::string &error);

} // namespace carve::rt

#endif // CARVE_RT_COMM_H
