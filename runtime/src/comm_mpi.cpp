//===- comm_mpi.cpp - the MPI backend of Communicator ---------------------===//
//
// Collectives map one to one onto MPI's non-blocking ones. A handle is an
// index into a table of in-flight requests owned by the communicator that
// started them. Every MPI call runs on the main thread (MPI_THREAD_FUNNELED):
// generated code calls collectives between kernels, never from inside an
// OpenMP region. Errors are fatal (MPI_ERRORS_ARE_FATAL): a failing rank
// takes the whole job down instead of leaving the others blocked.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/comm.h"
#include "carve/rt/kernels.h"

// The C API only: the deprecated C++ bindings would need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace carve::rt {

/// Set by the kernels' `fatal` owner; called with the exit code after the
/// message is printed, so that a kernel error on one rank ends every rank.
extern void (*fatalHook)(int);

namespace {

/// MPI counts are int; larger operations go in pieces of this many elements.
constexpr int64_t kMaxCount = int64_t(1) << 30;

bool mpiUp() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  if (!initialized)
    return false;
  MPI_Finalized(&finalized);
  return !finalized;
}

MPI_Datatype mpiType(CommType t) {
  switch (t) {
  case CommType::F32:
    return MPI_FLOAT;
  case CommType::F64:
    return MPI_DOUBLE;
  case CommType::I64:
    return MPI_INT64_T;
  }
  fatal("all-reduce: unknown element type %d", static_cast<int>(t));
}

int elemBytes(CommType t) { return t == CommType::F32 ? 4 : 8; }

class MpiCommunicator : public Communicator {
public:
  MpiCommunicator(MPI_Comm c, bool owns) : comm(c), owned(owns) {
    MPI_Comm_rank(comm, &myRank);
    MPI_Comm_size(comm, &mySize);
  }
  ~MpiCommunicator() override {
    if (owned && mpiUp())
      MPI_Comm_free(&comm);
  }

  int rank() const override { return myRank; }
  int size() const override { return mySize; }

  CommHandle allReduceAsync(void *buf, int64_t n, CommType t, ReduceOp op) override {
    if (n < 0)
      fatal("all-reduce of %lld elements", static_cast<long long>(n));
    if (n == 0)
      return {};
    MPI_Op mop = op == ReduceOp::Max ? MPI_MAX : MPI_SUM;
    MPI_Datatype type = mpiType(t);
    int64_t id = allocSlot();
    std::vector<MPI_Request> &reqs = slots[id];
    char *p = static_cast<char *>(buf);
    for (int64_t done = 0; done < n; done += kMaxCount) {
      int count = static_cast<int>(std::min(n - done, kMaxCount));
      reqs.emplace_back();
      MPI_Iallreduce(MPI_IN_PLACE, p + done * elemBytes(t), count, type, mop, comm, &reqs.back());
    }
    return CommHandle{id};
  }

  void wait(CommHandle h) override {
    if (h.id < 0)
      return;
    if (h.id >= static_cast<int64_t>(slots.size()) || slots[h.id].empty())
      fatal("wait on unknown or already completed communication handle %lld",
            static_cast<long long>(h.id));
    std::vector<MPI_Request> &reqs = slots[h.id];
    MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
    reqs.clear();
    freeSlots.push_back(h.id);
  }

  void broadcast(void *buf, int64_t bytes, int root) override {
    char *p = static_cast<char *>(buf);
    for (int64_t done = 0; done < bytes; done += kMaxCount)
      MPI_Bcast(p + done, static_cast<int>(std::min(bytes - done, kMaxCount)), MPI_BYTE, root,
                comm);
  }

  void barrier() override { MPI_Barrier(comm); }

  std::unique_ptr<Communicator> split(int color, int key) override {
    MPI_Comm sub;
    MPI_Comm_split(comm, color, key, &sub);
    return std::make_unique<MpiCommunicator>(sub, true);
  }

private:
  int64_t allocSlot() {
    if (!freeSlots.empty()) {
      int64_t id = freeSlots.back();
      freeSlots.pop_back();
      return id;
    }
    slots.emplace_back();
    return static_cast<int64_t>(slots.size()) - 1;
  }

  MPI_Comm comm;
  bool owned;
  int myRank = 0, mySize = 1;
  std::vector<std::vector<MPI_Request>> slots;
  std::vector<int64_t> freeSlots;
};

/// One rank and no MPI: every collective is already complete.
class SelfCommunicator : public Communicator {
public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  CommHandle allReduceAsync(void *, int64_t, CommType, ReduceOp) override { return {}; }
  void wait(CommHandle) override {}
  void broadcast(void *, int64_t, int root) override {
    if (root != 0)
      fatal("broadcast from rank %d in a one-rank group", root);
  }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int, int) override {
    return std::make_unique<SelfCommunicator>();
  }
};

void abortAllHook(int code) { abortAll(code); }

} // namespace

std::unique_ptr<Communicator> makeMpiWorld(int *argc, char ***argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    if (provided < MPI_THREAD_FUNNELED) {
      std::fprintf(stderr, "carve: error: the MPI library provides no MPI_THREAD_FUNNELED "
                           "support\n");
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_ARE_FATAL);
  }
  fatalHook = abortAllHook;
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, false);
}

std::unique_ptr<Communicator> makeSelfCommunicator() {
  return std::make_unique<SelfCommunicator>();
}

void finalizeComm() {
  if (mpiUp())
    MPI_Finalize();
}

void abortAll(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  if (mpiUp())
    MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

} // namespace carve::rt
