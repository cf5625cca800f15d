//===- comm.h - collective communication ----------------------------------===//
//
// A `Communicator` is a group of ranks (a mesh axis). Collectives are
// asynchronous: they return a `CommHandle` that `wait` completes, so the
// generated code starts a gradient bucket's all-reduce as soon as the bucket
// is complete and waits only before the optimizer. The MPI backend (comm_mpi.cpp)
// is the CPU one; an NCCL backend (streams, ncclCommSplit per mesh axis) will
// implement the same interface.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_COMM_H
#define CARVE_RT_COMM_H

#include <cstdint>
#include <memory>

namespace carve::rt {

enum class ReduceOp : int { Sum = 0, Max = 1 };
enum class CommType : int { F32 = 0, F64 = 1, I64 = 2 };

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
  /// Completes an operation; fatal error (all ranks brought down) on failure.
  virtual void wait(CommHandle h) = 0;
  /// Blocking broadcast of `bytes` bytes from `root`.
  virtual void broadcast(void *buf, int64_t bytes, int root) = 0;
  virtual void barrier() = 0;
  /// A sub-communicator of the ranks that pass the same color, ordered by key
  /// (for mesh axes: dp, tp, pp groups).
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  void allReduce(void *buf, int64_t n, CommType t, ReduceOp op) {
    wait(allReduceAsync(buf, n, t, op));
  }
};

/// Initializes MPI (once per process) and returns the world communicator.
/// A failing rank calls MPI_Abort, which brings every rank down.
std::unique_ptr<Communicator> makeMpiWorld(int *argc, char ***argv);
/// A one-rank communicator with no MPI (collectives are no-ops).
std::unique_ptr<Communicator> makeSelfCommunicator();
/// Finalizes MPI if it was initialized.
void finalizeComm();
/// Brings every rank down (MPI_Abort when MPI is up, exit otherwise).
[[noreturn]] void abortAll(int code);

} // namespace carve::rt

#endif // CARVE_RT_COMM_H
