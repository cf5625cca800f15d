//===- comm_mpi.cpp - the MPI backend of Communicator ---------------------===//
//
// Collectives and point-to-point messages map one to one onto MPI's
// non-blocking calls. A handle is an index into a table of in-flight requests
// owned by the communicator that started them. MPI counts are int: larger
// operations go in several calls, one per piece of at most 2^30 elements
// (a rank-blocked buffer's pieces described by strided datatypes; a large
// reduce-scatter as one reduction per rank). Every MPI call runs on the main thread (MPI_THREAD_FUNNELED):
// generated code calls collectives between kernels, never from inside an
// OpenMP region. Errors are fatal (MPI_ERRORS_ARE_FATAL): a failing rank
// takes the whole job down instead of leaving the others blocked.
//
// Waits poll (MPI_Testall, yielding the core in between) against a deadline,
// the collective timeout: a peer that was killed or stopped leaves its group
// waiting forever otherwise. The rank that times out prints one line naming
// the operation, its size, the group, the step and the group's other members,
// and calls MPI_Abort, which ends every rank (a stopped one included: the
// launcher kills it). The polling runs on the main thread like every other
// MPI call, so no watchdog thread is needed and MPI_THREAD_FUNNELED suffices.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/comm.h"
#include "carve/rt/elementwise.h"
#include "carve/rt/kernels.h"
#include "carve/rt/metrics.h"

// The C API only: the deprecated C++ bindings would need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sched.h>
#include <string>
#include <vector>

namespace carve::rt {

/// Set by the kernels' `fatal` owner; called with the exit code after the
/// message is printed, so that a kernel error on one rank ends every rank.
extern void (*fatalHook)(int);

namespace {

double timeoutSeconds = kDefaultCollectiveTimeout;
int64_t currentStep = -1;

std::string stepText() {
  if (currentStep == -1)
    return "at start-up";
  if (currentStep == -2)
    return "after the last step";
  return "step " + std::to_string(currentStep);
}

/// MPI counts are int; larger operations go in pieces of at most this many
/// elements. CARVE_COMM_PIECE overrides it (tests cover the piece paths with
/// small buffers that way).
int64_t maxCount() {
  static const int64_t n = [] {
    const char *env = std::getenv("CARVE_COMM_PIECE");
    long long v = env ? std::atoll(env) : 0;
    return v > 0 && v <= (int64_t(1) << 30) ? static_cast<int64_t>(v) : int64_t(1) << 30;
  }();
  return n;
}

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
  case CommType::I32:
    return MPI_INT32_T;
  case CommType::U8:
    return MPI_UINT8_T;
  case CommType::BF16: // as bits; reductions use mpiOp's user operations
  case CommType::F16:
    return MPI_UINT16_T;
  }
  fatal("collective: unknown element type %d", static_cast<int>(t));
}

/// 16-bit float reductions as MPI user operations: each element read as the
/// float it represents, combined in float and rounded to nearest even after
/// every step, as NCCL's 16-bit sums do. Not commutative for MPI, so ranks
/// combine in rank order and every rank gets the same bits.
template <bool F16, bool Max> void reduce16(void *in, void *inout, int *len, MPI_Datatype *) {
  const uint16_t *a = static_cast<const uint16_t *>(in);
  uint16_t *b = static_cast<uint16_t *>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = F16 ? ew::f16Float(a[i]) : ew::bf16Float(a[i]);
    const float y = F16 ? ew::f16Float(b[i]) : ew::bf16Float(b[i]);
    const float r = Max ? std::max(x, y) : x + y;
    b[i] = F16 ? ew::f16Bits(r) : ew::bf16Bits(r);
  }
}

MPI_Op mpiOp(ReduceOp op, CommType t) {
  if (t != CommType::BF16 && t != CommType::F16)
    return op == ReduceOp::Max ? MPI_MAX : MPI_SUM;
  static MPI_Op ops[2][2] = {{MPI_OP_NULL, MPI_OP_NULL}, {MPI_OP_NULL, MPI_OP_NULL}};
  const int f = t == CommType::F16, m = op == ReduceOp::Max;
  if (ops[f][m] == MPI_OP_NULL) {
    MPI_User_function *fn = f ? (m ? reduce16<true, true> : reduce16<true, false>)
                              : (m ? reduce16<false, true> : reduce16<false, false>);
    MPI_Op_create(fn, /*commute=*/0, &ops[f][m]);
  }
  return ops[f][m];
}

/// `count` elements of `base` whose extent is `stride` bytes: block r of a
/// piece of a rank-blocked buffer is then element r of this type. Freed by the
/// caller right after starting the operation (MPI keeps it alive until then).
MPI_Datatype strided(MPI_Datatype base, int count, int64_t stride) {
  MPI_Datatype contig, resized;
  MPI_Type_contiguous(count, base, &contig);
  MPI_Type_create_resized(contig, 0, static_cast<MPI_Aint>(stride), &resized);
  MPI_Type_commit(&resized);
  MPI_Type_free(&contig);
  return resized;
}

void checkCount(const char *op, int64_t n) {
  if (n < 0)
    fatal("%s of %lld elements", op, static_cast<long long>(n));
}

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
    checkCount("all-reduce", n);
    if (n == 0)
      return {};
    MPI_Datatype type = mpiType(t);
    int64_t id = allocSlot("all-reduce", n * commTypeBytes(t));
    std::vector<MPI_Request> &reqs = slots[id].reqs;
    char *p = static_cast<char *>(buf);
    const int64_t piece = maxCount();
    for (int64_t done = 0; done < n; done += piece) {
      int count = static_cast<int>(std::min(n - done, piece));
      reqs.emplace_back();
      MPI_Iallreduce(MPI_IN_PLACE, p + done * commTypeBytes(t), count, type, mpiOp(op, t), comm,
                     &reqs.back());
    }
    return CommHandle{id};
  }

  CommHandle allGatherAsync(const void *send, void *recv, int64_t nPerRank,
                            CommType t) override {
    checkCount("all-gather", nPerRank);
    if (nPerRank == 0)
      return {};
    const int es = commTypeBytes(t);
    MPI_Datatype type = mpiType(t);
    char *r = static_cast<char *>(recv);
    const bool inPlace = send == r + myRank * nPerRank * es;
    const char *s = static_cast<const char *>(send);
    int64_t id = allocSlot("all-gather", nPerRank * mySize * es);
    std::vector<MPI_Request> &reqs = slots[id].reqs;
    const int64_t piece = maxCount();
    if (nPerRank <= piece) {
      int count = static_cast<int>(nPerRank);
      reqs.emplace_back();
      MPI_Iallgather(inPlace ? MPI_IN_PLACE : send, count, type, r, count, type, comm,
                     &reqs.back());
      return CommHandle{id};
    }
    // Piece k of every rank's block: block r of the piece starts at
    // r * nPerRank elements from the piece's start in recv.
    for (int64_t done = 0; done < nPerRank; done += piece) {
      int count = static_cast<int>(std::min(nPerRank - done, piece));
      MPI_Datatype block = strided(type, count, nPerRank * es);
      reqs.emplace_back();
      MPI_Iallgather(inPlace ? MPI_IN_PLACE : s + done * es, count, type, r + done * es, 1, block,
                     comm, &reqs.back());
      MPI_Type_free(&block);
    }
    return CommHandle{id};
  }

  CommHandle reduceScatterAsync(const void *send, void *recv, const int64_t *counts, CommType t,
                                ReduceOp op) override {
    int64_t total = 0;
    for (int r = 0; r < mySize; ++r) {
      checkCount("reduce-scatter", counts[r]);
      total += counts[r];
    }
    if (total == 0)
      return {};
    const int es = commTypeBytes(t);
    MPI_Datatype type = mpiType(t);
    int64_t id = allocSlot("reduce-scatter", total * es);
    Slot &slot = slots[id];
    const int64_t piece = maxCount();
    if (total <= piece) {
      // Non-blocking collectives read their count arrays until they complete.
      slot.counts.resize(static_cast<size_t>(mySize));
      for (int r = 0; r < mySize; ++r)
        slot.counts[r] = static_cast<int>(counts[r]);
      slot.reqs.emplace_back();
      MPI_Ireduce_scatter(send, recv, slot.counts.data(), type, mpiOp(op, t), comm,
                          &slot.reqs.back());
      return CommHandle{id};
    }
    // Too large for int counts: one reduction to each rank, in pieces.
    const char *s = static_cast<const char *>(send);
    char *out = static_cast<char *>(recv);
    int64_t begin = 0;
    for (int root = 0; root < mySize; ++root) {
      for (int64_t done = 0; done < counts[root]; done += piece) {
        int count = static_cast<int>(std::min(counts[root] - done, piece));
        slot.reqs.emplace_back();
        MPI_Ireduce(s + (begin + done) * es, root == myRank ? out + done * es : nullptr, count,
                    type, mpiOp(op, t), root, comm, &slot.reqs.back());
      }
      begin += counts[root];
    }
    return CommHandle{id};
  }

  CommHandle allToAllAsync(const void *send, void *recv, int64_t nPerRank,
                           CommType t) override {
    checkCount("all-to-all", nPerRank);
    if (nPerRank == 0)
      return {};
    const int es = commTypeBytes(t);
    MPI_Datatype type = mpiType(t);
    const char *s = static_cast<const char *>(send);
    char *r = static_cast<char *>(recv);
    int64_t id = allocSlot("all-to-all", nPerRank * mySize * es);
    std::vector<MPI_Request> &reqs = slots[id].reqs;
    const int64_t piece = maxCount();
    if (nPerRank <= piece) {
      int count = static_cast<int>(nPerRank);
      reqs.emplace_back();
      MPI_Ialltoall(send, count, type, recv, count, type, comm, &reqs.back());
      return CommHandle{id};
    }
    for (int64_t done = 0; done < nPerRank; done += piece) {
      int count = static_cast<int>(std::min(nPerRank - done, piece));
      MPI_Datatype block = strided(type, count, nPerRank * es);
      reqs.emplace_back();
      MPI_Ialltoall(s + done * es, 1, block, r + done * es, 1, block, comm, &reqs.back());
      MPI_Type_free(&block);
    }
    return CommHandle{id};
  }

  CommHandle sendAsync(const void *buf, int64_t bytes, int peer, int tag) override {
    checkPeer("send", bytes, peer, tag);
    if (bytes == 0)
      return {};
    const char *p = static_cast<const char *>(buf);
    int64_t id = allocSlot("send", bytes, peer);
    std::vector<MPI_Request> &reqs = slots[id].reqs;
    const int64_t piece = maxCount();
    for (int64_t done = 0; done < bytes; done += piece) {
      reqs.emplace_back();
      MPI_Isend(p + done, static_cast<int>(std::min(bytes - done, piece)), MPI_BYTE, peer, tag,
                comm, &reqs.back());
    }
    return CommHandle{id};
  }

  CommHandle recvAsync(void *buf, int64_t bytes, int peer, int tag) override {
    checkPeer("receive", bytes, peer, tag);
    if (bytes == 0)
      return {};
    char *p = static_cast<char *>(buf);
    int64_t id = allocSlot("receive", bytes, peer);
    std::vector<MPI_Request> &reqs = slots[id].reqs;
    const int64_t piece = maxCount();
    for (int64_t done = 0; done < bytes; done += piece) {
      reqs.emplace_back();
      MPI_Irecv(p + done, static_cast<int>(std::min(bytes - done, piece)), MPI_BYTE, peer, tag,
                comm, &reqs.back());
    }
    return CommHandle{id};
  }

  void wait(CommHandle h) override {
    if (h.id < 0)
      return;
    if (h.id >= static_cast<int64_t>(slots.size()) || slots[h.id].reqs.empty())
      fatal("wait on unknown or already completed communication handle %lld",
            static_cast<long long>(h.id));
    Slot &slot = slots[h.id];
    waitBounded(static_cast<int>(slot.reqs.size()), slot.reqs.data(), slot.op, slot.bytes,
                slot.peer);
    slot.reqs.clear();
    slot.counts.clear();
    freeSlots.push_back(h.id);
  }

  void broadcast(void *buf, int64_t bytes, int root) override {
    char *p = static_cast<char *>(buf);
    const int64_t piece = maxCount();
    for (int64_t done = 0; done < bytes; done += piece) {
      MPI_Request req;
      MPI_Ibcast(p + done, static_cast<int>(std::min(bytes - done, piece)), MPI_BYTE, root, comm,
                 &req);
      waitBounded(1, &req, "broadcast", bytes, -1);
    }
  }

  void barrier() override {
    MPI_Request req;
    MPI_Ibarrier(comm, &req);
    waitBounded(1, &req, "barrier", 0, -1);
  }

  /// MPI_Comm_split has no non-blocking form: a barrier first, which is
  /// bounded, makes a dead or stopped member show up there instead.
  std::unique_ptr<Communicator> split(int color, int key) override {
    barrier();
    MPI_Comm sub;
    MPI_Comm_split(comm, color, key, &sub);
    return std::make_unique<MpiCommunicator>(sub, true);
  }

  std::vector<int> worldRanks() const override {
    std::vector<int> mine(static_cast<size_t>(mySize)), world(static_cast<size_t>(mySize));
    for (int r = 0; r < mySize; ++r)
      mine[r] = r;
    MPI_Group g, w;
    MPI_Comm_group(comm, &g);
    MPI_Comm_group(MPI_COMM_WORLD, &w);
    MPI_Group_translate_ranks(g, mySize, mine.data(), w, world.data());
    MPI_Group_free(&g);
    MPI_Group_free(&w);
    return world;
  }

private:
  /// The requests of one operation (several when it goes in pieces) and the
  /// count array MPI reads until they complete.
  struct Slot {
    std::vector<MPI_Request> reqs;
    std::vector<int> counts;
    const char *op = "";
    int64_t bytes = 0;
    int peer = -1; // point-to-point only
  };

  void checkPeer(const char *op, int64_t bytes, int peer, int tag) const {
    if (bytes < 0 || peer < 0 || peer >= mySize || tag < 0 || tag > 32767)
      fatal("%s of %lld bytes with peer %d, tag %d, in a group of %d ranks", op,
            static_cast<long long>(bytes), peer, tag, mySize);
  }

  int64_t allocSlot(const char *op, int64_t bytes, int peer = -1) {
    int64_t id;
    if (!freeSlots.empty()) {
      id = freeSlots.back();
      freeSlots.pop_back();
    } else {
      slots.emplace_back();
      id = static_cast<int64_t>(slots.size()) - 1;
    }
    slots[id].op = op;
    slots[id].bytes = bytes;
    slots[id].peer = peer;
    return id;
  }

  /// Completes `reqs` or, past the collective timeout, reports the operation
  /// and aborts the job.
  void waitBounded(int n, MPI_Request *reqs, const char *op, int64_t bytes, int peer) {
    using Clock = std::chrono::steady_clock;
    int done = 0;
    MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE);
    if (done)
      return;
    const double limit = timeoutSeconds;
    const Clock::time_point start = Clock::now();
    for (unsigned spin = 1;; ++spin) {
      MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE);
      if (done)
        return;
      // Yield so that a peer sharing this core (oversubscribed runs) gets to run.
      sched_yield();
      if (limit > 0 && spin % 256 == 0 &&
          std::chrono::duration<double>(Clock::now() - start).count() > limit)
        timedOut(op, bytes, peer, limit);
    }
  }

  [[noreturn]] void timedOut(const char *op, int64_t bytes, int peer, double limit) {
    std::vector<int> members = worldRanks();
    int me = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    std::string suspects;
    if (peer >= 0) {
      suspects = "rank " + std::to_string(members[peer]) + " may be dead or stuck";
    } else {
      for (int r : members)
        if (r != me)
          suspects += (suspects.empty() ? "" : ", ") + std::to_string(r);
      suspects = "rank(s) " + suspects + " of that group may be dead or stuck";
    }
    std::string what = op;
    if (peer >= 0)
      what += std::string(std::strcmp(op, "send") == 0 ? " to" : " from") + " rank " +
              std::to_string(members[peer]);
    std::fflush(stdout);
    std::fprintf(stderr, "carve: rank %d: %s over %s (%s, %s) did not complete in %g s; %s\n", me,
                 what.c_str(), name().c_str(), formatBytes(bytes).c_str(), stepText().c_str(),
                 limit, suspects.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::exit(1);
  }

  MPI_Comm comm;
  bool owned;
  int myRank = 0, mySize = 1;
  std::vector<Slot> slots;
  std::vector<int64_t> freeSlots;
};

/// One rank and no MPI: every collective is complete when it returns (a copy,
/// or nothing in place). A send to itself completes when the matching receive
/// is posted, and the other way round.
class SelfCommunicator : public Communicator {
public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  CommHandle allReduceAsync(void *, int64_t n, CommType, ReduceOp) override {
    checkCount("all-reduce", n);
    return {};
  }
  CommHandle allGatherAsync(const void *send, void *recv, int64_t nPerRank,
                            CommType t) override {
    checkCount("all-gather", nPerRank);
    move(send, recv, nPerRank * commTypeBytes(t));
    return {};
  }
  CommHandle reduceScatterAsync(const void *send, void *recv, const int64_t *counts, CommType t,
                                ReduceOp) override {
    checkCount("reduce-scatter", counts[0]);
    move(send, recv, counts[0] * commTypeBytes(t));
    return {};
  }
  CommHandle allToAllAsync(const void *send, void *recv, int64_t nPerRank,
                           CommType t) override {
    checkCount("all-to-all", nPerRank);
    move(send, recv, nPerRank * commTypeBytes(t));
    return {};
  }
  CommHandle sendAsync(const void *buf, int64_t bytes, int peer, int tag) override {
    return post(true, const_cast<void *>(buf), bytes, peer, tag);
  }
  CommHandle recvAsync(void *buf, int64_t bytes, int peer, int tag) override {
    return post(false, buf, bytes, peer, tag);
  }
  void wait(CommHandle h) override {
    if (h.id < 0)
      return;
    auto it = ops.find(h.id);
    if (it == ops.end())
      fatal("wait on unknown or already completed communication handle %lld",
            static_cast<long long>(h.id));
    if (!it->second.done)
      fatal("wait on a %s with tag %d to this same rank that no %s matches: it would never "
            "complete",
            it->second.isSend ? "send" : "receive", it->second.tag,
            it->second.isSend ? "receive" : "send");
    ops.erase(it);
  }
  void broadcast(void *, int64_t, int root) override {
    if (root != 0)
      fatal("broadcast from rank %d in a one-rank group", root);
  }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int, int) override {
    return std::make_unique<SelfCommunicator>();
  }
  std::vector<int> worldRanks() const override {
    int me = 0;
    if (mpiUp())
      MPI_Comm_rank(MPI_COMM_WORLD, &me);
    return {me};
  }

private:
  /// A point-to-point operation with itself.
  struct Op {
    bool isSend;
    void *buf;
    int64_t bytes;
    int tag;
    bool done;
  };

  static void move(const void *from, void *to, int64_t bytes) {
    if (from != to && bytes > 0)
      std::memmove(to, from, static_cast<size_t>(bytes));
  }

  /// Matches the oldest pending operation of the other kind with the same
  /// tag (MPI's order), or leaves this one pending.
  CommHandle post(bool isSend, void *buf, int64_t bytes, int peer, int tag) {
    if (bytes < 0 || peer != 0 || tag < 0 || tag > 32767)
      fatal("%s of %lld bytes with peer %d, tag %d, in a one-rank group",
            isSend ? "send" : "receive", static_cast<long long>(bytes), peer, tag);
    const int64_t id = nextId++;
    Op op{isSend, buf, bytes, tag, false};
    for (auto &[otherId, other] : ops) {
      if (other.done || other.isSend == isSend || other.tag != tag)
        continue;
      Op &send = isSend ? op : other;
      Op &recv = isSend ? other : op;
      if (send.bytes != recv.bytes)
        fatal("a send of %lld bytes to this same rank meets a receive of %lld bytes (tag %d)",
              static_cast<long long>(send.bytes), static_cast<long long>(recv.bytes), tag);
      move(send.buf, recv.buf, send.bytes);
      send.done = recv.done = true;
      break;
    }
    ops.emplace(id, op);
    return CommHandle{id};
  }

  std::map<int64_t, Op> ops; // by id, so the oldest pending operation comes first
  int64_t nextId = 0;
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

void setCollectiveTimeout(double seconds) { timeoutSeconds = seconds; }
double collectiveTimeout() { return timeoutSeconds; }
void setCommStep(int64_t step) { currentStep = step; }
int64_t commStep() { return currentStep; }

void abortAll(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  if (mpiUp())
    MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

} // namespace carve::rt
