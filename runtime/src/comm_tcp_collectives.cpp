//===- comm_tcp_collectives.cpp - the Communicator of the TCP world -------===//
//
// TcpCommunicator: every Communicator operation over the messages of the TCP
// world (comm_tcp_world.h). Collectives go through the group's rank 0, which
// reduces in group rank order; a wait that times out or finds its peer gone
// prints one line in the MPI backend's words and takes the job down.
//
//===----------------------------------------------------------------------===//

#include "comm_tcp_world.h"

#include "carve/rt/elementwise.h"
#include "carve/rt/kernels.h"
#include "carve/rt/metrics.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace carve::rt {

namespace {

std::string stepText() {
  const int64_t step = commStep();
  if (step == -1)
    return "at start-up";
  if (step == -2)
    return "after the last step";
  return "step " + std::to_string(step);
}

//===--- Collectives over the world's messages ---------------------------===//

template <class T> void reduceInto(T *acc, const T *x, int64_t n, ReduceOp op) {
  if (op == ReduceOp::Max) {
    for (int64_t i = 0; i < n; ++i)
      acc[i] = std::max(acc[i], x[i]);
  } else {
    for (int64_t i = 0; i < n; ++i)
      acc[i] = static_cast<T>(acc[i] + x[i]);
  }
}

/// acc[i] = acc[i] op x[i] for `n` elements of type `t`; `x` may be unaligned
/// (a received message), so it is copied out first where that matters.
void reduceBytes(void *acc, const char *x, int64_t n, CommType t, ReduceOp op) {
  std::vector<char> aligned(x, x + n * commTypeBytes(t));
  const void *src = aligned.data();
  switch (t) {
  case CommType::F32:
    return reduceInto(static_cast<float *>(acc), static_cast<const float *>(src), n, op);
  case CommType::F64:
    return reduceInto(static_cast<double *>(acc), static_cast<const double *>(src), n, op);
  case CommType::I64:
    return reduceInto(static_cast<int64_t *>(acc), static_cast<const int64_t *>(src), n, op);
  case CommType::I32:
    return reduceInto(static_cast<int32_t *>(acc), static_cast<const int32_t *>(src), n, op);
  case CommType::U8:
    return reduceInto(static_cast<uint8_t *>(acc), static_cast<const uint8_t *>(src), n, op);
  case CommType::BF16:
  case CommType::F16: {
    // Read as floats, combined in float, rounded to nearest even per step
    // (NCCL's 16-bit sums); the root combines in rank order.
    const bool f16 = t == CommType::F16;
    uint16_t *a = static_cast<uint16_t *>(acc);
    const uint16_t *b = static_cast<const uint16_t *>(src);
    for (int64_t i = 0; i < n; ++i) {
      const float x = f16 ? ew::f16Float(a[i]) : ew::bf16Float(a[i]);
      const float y = f16 ? ew::f16Float(b[i]) : ew::bf16Float(b[i]);
      const float r = op == ReduceOp::Max ? std::max(x, y) : x + y;
      a[i] = f16 ? ew::f16Bits(r) : ew::bf16Bits(r);
    }
    return;
  }
  }
  fatal("collective: unknown element type %d", static_cast<int>(t));
}

void checkCount(const char *op, int64_t n) {
  if (n < 0)
    fatal("%s of %lld elements", op, static_cast<long long>(n));
}

void checkType(CommType t) {
  if (static_cast<int>(t) < 0 || static_cast<int>(t) > static_cast<int>(CommType::F16))
    fatal("collective: unknown element type %d", static_cast<int>(t));
}

class TcpCommunicator : public Communicator {
public:
  TcpCommunicator(std::shared_ptr<TcpWorld> world, uint64_t id, std::vector<int> members)
      : world(std::move(world)), groupId(id), members(std::move(members)) {
    me = static_cast<int>(
        std::find(this->members.begin(), this->members.end(), this->world->rank()) -
        this->members.begin());
  }

  int rank() const override { return me; }
  int size() const override { return static_cast<int>(members.size()); }
  std::vector<int> worldRanks() const override { return members; }

  CommHandle allReduceAsync(void *buf, int64_t n, CommType t, ReduceOp op) override {
    checkCount("all-reduce", n);
    checkType(t);
    if (n == 0)
      return {};
    Pending p = start(Kind::AllReduce, "all-reduce", n * commTypeBytes(t));
    p.buf = buf;
    p.n = n;
    p.type = t;
    p.op = op;
    if (me != 0)
      sendOrDie(p, 0, kTagAllReduce, buf, p.bytes);
    return keep(std::move(p));
  }

  CommHandle allGatherAsync(const void *send, void *recv, int64_t nPerRank, CommType t) override {
    checkCount("all-gather", nPerRank);
    checkType(t);
    if (nPerRank == 0)
      return {};
    const int64_t block = nPerRank * commTypeBytes(t);
    Pending p = start(Kind::AllGather, "all-gather", block * size());
    p.send = send;
    p.buf = recv;
    p.n = nPerRank;
    p.type = t;
    if (me != 0)
      sendOrDie(p, 0, kTagAllGather, send, block);
    return keep(std::move(p));
  }

  CommHandle reduceScatterAsync(const void *send, void *recv, const int64_t *counts, CommType t,
                                ReduceOp op) override {
    checkType(t);
    int64_t total = 0;
    for (int r = 0; r < size(); ++r) {
      checkCount("reduce-scatter", counts[r]);
      total += counts[r];
    }
    if (total == 0)
      return {};
    Pending p = start(Kind::ReduceScatter, "reduce-scatter", total * commTypeBytes(t));
    p.send = send;
    p.buf = recv;
    p.counts.assign(counts, counts + size());
    p.type = t;
    p.op = op;
    if (me != 0)
      sendOrDie(p, 0, kTagReduceScatter, send, p.bytes);
    return keep(std::move(p));
  }

  CommHandle allToAllAsync(const void *send, void *recv, int64_t nPerRank, CommType t) override {
    checkCount("all-to-all", nPerRank);
    checkType(t);
    if (nPerRank == 0)
      return {};
    const int64_t block = nPerRank * commTypeBytes(t);
    Pending p = start(Kind::AllToAll, "all-to-all", block * size());
    p.send = send;
    p.buf = recv;
    p.n = nPerRank;
    p.type = t;
    const char *s = static_cast<const char *>(send);
    for (int r = 0; r < size(); ++r)
      if (r != me)
        sendOrDie(p, r, kTagAllToAll, s + r * block, block);
    return keep(std::move(p));
  }

  CommHandle sendAsync(const void *buf, int64_t bytes, int peer, int tag) override {
    checkPeer("send", bytes, peer, tag);
    if (bytes == 0)
      return {};
    // Complete at once: the receiving rank's reader files the message
    // whether or not it has posted the receive yet.
    Pending p{};
    p.what = "send";
    p.bytes = bytes;
    p.peer = peer;
    sendOrDie(p, peer, tag, buf, bytes, 0);
    return {};
  }

  CommHandle recvAsync(void *buf, int64_t bytes, int peer, int tag) override {
    checkPeer("receive", bytes, peer, tag);
    if (bytes == 0)
      return {};
    Pending p{};
    p.kind = Kind::Recv;
    p.what = "receive";
    p.bytes = bytes;
    p.peer = peer;
    p.tag = tag;
    p.buf = buf;
    return keep(std::move(p));
  }

  void wait(CommHandle h) override {
    if (h.id < 0)
      return;
    auto it = pending.find(h.id);
    if (it == pending.end())
      fatal("wait on unknown or already completed communication handle %lld",
            static_cast<long long>(h.id));
    if (it->second.kind == Kind::Recv) {
      // Receives match messages in the order they were posted (MPI's rule):
      // earlier receives from the same rank with the same tag take theirs first.
      const int peer = it->second.peer, tag = it->second.tag;
      for (auto e = pending.begin(); e != it; ++e)
        if (e->second.kind == Kind::Recv && !e->second.done && e->second.peer == peer &&
            e->second.tag == tag) {
          finish(e->second);
          e->second.done = true;
        }
    }
    if (it->second.done) {
      pending.erase(it);
      return;
    }
    Pending p = std::move(it->second);
    pending.erase(it);
    finish(p);
  }

  void broadcast(void *buf, int64_t bytes, int root) override {
    if (bytes < 0 || root < 0 || root >= size())
      fatal("broadcast of %lld bytes from rank %d in a group of %d ranks",
            static_cast<long long>(bytes), root, size());
    Pending p = start(Kind::Broadcast, "broadcast", bytes);
    if (bytes == 0)
      return;
    if (me == root) {
      for (int r = 0; r < size(); ++r)
        if (r != me)
          sendOrDie(p, r, kTagBroadcast, buf, bytes);
    } else {
      receiveInto(p, root, kTagBroadcast, buf, bytes);
    }
  }

  void barrier() override {
    Pending p = start(Kind::Barrier, "barrier", 0);
    gatherThenRelease(p, kTagBarrier, nullptr, 0);
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    if (color < 0)
      fatal("split with color %d: colors are non-negative", color);
    Pending p = start(Kind::Split, "split", 2 * sizeof(int32_t));
    const int32_t mine[2] = {color, key};
    std::vector<int64_t> answer; // the new group's id, then its members' world ranks
    if (me != 0) {
      sendOrDie(p, 0, kTagSplit, mine, sizeof mine);
      std::vector<char> msg = takeOrDie(p, 0, kTagSplit);
      answer.resize(msg.size() / sizeof(int64_t));
      std::memcpy(answer.data(), msg.data(), answer.size() * sizeof(int64_t));
    } else {
      // Groups by color, members by (key, rank in this group): MPI's order.
      std::map<int32_t, std::vector<std::pair<int32_t, int>>> groups;
      groups[color].push_back({key, 0});
      for (int r = 1; r < size(); ++r) {
        std::vector<char> msg = takeOrDie(p, r, kTagSplit);
        int32_t theirs[2];
        if (msg.size() != sizeof theirs)
          fatal("split: rank %d sent %zu bytes instead of its color and key", members[r],
                msg.size());
        std::memcpy(theirs, msg.data(), sizeof theirs);
        groups[theirs[0]].push_back({theirs[1], r});
      }
      for (auto &[c, who] : groups) {
        std::sort(who.begin(), who.end());
        std::vector<int64_t> reply{static_cast<int64_t>(world->newGroupId())};
        for (auto &[k, r] : who)
          reply.push_back(members[r]);
        for (auto &[k, r] : who) {
          if (r == 0)
            answer = reply;
          else
            sendOrDie(p, r, kTagSplit, reply.data(),
                      static_cast<int64_t>(reply.size() * sizeof(int64_t)));
        }
      }
    }
    if (answer.size() < 2)
      fatal("split: rank %d answered with no group", members[0]);
    std::vector<int> sub(answer.begin() + 1, answer.end());
    return std::make_unique<TcpCommunicator>(world, static_cast<uint64_t>(answer[0]),
                                             std::move(sub));
  }

private:
  enum class Kind {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Recv,
    Broadcast,
    Barrier,
    Split
  };

  /// An operation started and not yet waited for.
  struct Pending {
    Kind kind = Kind::Recv;
    const char *what = "";
    int64_t bytes = 0;
    uint64_t seq = 0;
    int peer = -1; // point-to-point: the group rank of the other side
    int tag = 0;
    const void *send = nullptr;
    void *buf = nullptr;
    int64_t n = 0;
    std::vector<int64_t> counts;
    CommType type = CommType::U8;
    ReduceOp op = ReduceOp::Sum;
    bool done = false; // a receive completed early (a later one was waited for first)
  };

  /// A collective: every member numbers its collectives alike.
  Pending start(Kind kind, const char *what, int64_t bytes) {
    Pending p;
    p.kind = kind;
    p.what = what;
    p.bytes = bytes;
    p.seq = ++collectives;
    return p;
  }

  CommHandle keep(Pending p) {
    const int64_t id = nextId++;
    pending.emplace(id, std::move(p));
    return CommHandle{id};
  }

  void finish(Pending &p) {
    const int es = commTypeBytes(p.type);
    switch (p.kind) {
    case Kind::Recv: {
      std::vector<char> msg = takeOrDie(p, p.peer, p.tag, 0);
      if (static_cast<int64_t>(msg.size()) != p.bytes)
        fatal("a message of %zu bytes from rank %d (tag %d) met a receive of %lld bytes over %s",
              msg.size(), members[p.peer], p.tag, static_cast<long long>(p.bytes), name().c_str());
      std::memcpy(p.buf, msg.data(), msg.size());
      return;
    }
    case Kind::AllReduce:
      if (me == 0) {
        for (int r = 1; r < size(); ++r) {
          std::vector<char> msg = takeSized(p, r, kTagAllReduce, p.bytes);
          reduceBytes(p.buf, msg.data(), p.n, p.type, p.op);
        }
        for (int r = 1; r < size(); ++r)
          sendOrDie(p, r, kTagAllReduce, p.buf, p.bytes);
      } else {
        std::vector<char> msg = takeSized(p, 0, kTagAllReduce, p.bytes);
        std::memcpy(p.buf, msg.data(), msg.size());
      }
      return;
    case Kind::AllGather: {
      const int64_t block = p.n * es;
      char *recv = static_cast<char *>(p.buf);
      if (me == 0) {
        if (p.send != recv)
          std::memmove(recv, p.send, static_cast<size_t>(block));
        for (int r = 1; r < size(); ++r) {
          std::vector<char> msg = takeSized(p, r, kTagAllGather, block);
          std::memcpy(recv + r * block, msg.data(), msg.size());
        }
        for (int r = 1; r < size(); ++r)
          sendOrDie(p, r, kTagAllGather, recv, p.bytes);
      } else {
        std::vector<char> msg = takeSized(p, 0, kTagAllGather, p.bytes);
        std::memcpy(recv, msg.data(), msg.size());
      }
      return;
    }
    case Kind::ReduceScatter: {
      std::vector<int64_t> offset(static_cast<size_t>(size()) + 1, 0);
      for (int r = 0; r < size(); ++r)
        offset[r + 1] = offset[r] + p.counts[r];
      if (me == 0) {
        const char *s = static_cast<const char *>(p.send);
        std::vector<char> acc(s, s + p.bytes);
        // The accumulator is reduced in place: give it the element type's
        // alignment by copying into a vector of the widest type.
        std::vector<int64_t> wide((acc.size() + 7) / 8);
        std::memcpy(wide.data(), acc.data(), acc.size());
        for (int r = 1; r < size(); ++r) {
          std::vector<char> msg = takeSized(p, r, kTagReduceScatter, p.bytes);
          reduceBytes(wide.data(), msg.data(), offset[size()], p.type, p.op);
        }
        const char *w = reinterpret_cast<const char *>(wide.data());
        for (int r = 1; r < size(); ++r)
          sendOrDie(p, r, kTagReduceScatter, w + offset[r] * es, p.counts[r] * es);
        std::memcpy(p.buf, w, static_cast<size_t>(p.counts[0] * es));
      } else {
        std::vector<char> msg = takeSized(p, 0, kTagReduceScatter, p.counts[me] * es);
        std::memcpy(p.buf, msg.data(), msg.size());
      }
      return;
    }
    case Kind::AllToAll: {
      const int64_t block = p.n * es;
      char *recv = static_cast<char *>(p.buf);
      std::memmove(recv + me * block, static_cast<const char *>(p.send) + me * block,
                   static_cast<size_t>(block));
      for (int r = 0; r < size(); ++r)
        if (r != me) {
          std::vector<char> msg = takeSized(p, r, kTagAllToAll, block);
          std::memcpy(recv + r * block, msg.data(), msg.size());
        }
      return;
    }
    case Kind::Broadcast:
    case Kind::Barrier:
    case Kind::Split:
      return;
    }
  }

  /// Everyone reports to the hub, which answers everyone (a barrier).
  void gatherThenRelease(Pending &p, int32_t tag, const void *data, int64_t bytes) {
    if (me != 0) {
      sendOrDie(p, 0, tag, data, bytes);
      takeOrDie(p, 0, tag);
      return;
    }
    for (int r = 1; r < size(); ++r)
      takeOrDie(p, r, tag);
    for (int r = 1; r < size(); ++r)
      sendOrDie(p, r, tag, data, bytes);
  }

  void receiveInto(Pending &p, int from, int32_t tag, void *buf, int64_t bytes) {
    std::vector<char> msg = takeSized(p, from, tag, bytes);
    std::memcpy(buf, msg.data(), msg.size());
  }

  void sendOrDie(Pending &p, int to, int32_t tag, const void *data, int64_t bytes) {
    sendOrDie(p, to, tag, data, bytes, p.seq);
  }

  void sendOrDie(Pending &p, int to, int32_t tag, const void *data, int64_t bytes, uint64_t seq) {
    std::string why;
    const double limit = collectiveTimeout();
    Outcome o =
        world->send(members[to], groupId, tag, seq, data, bytes, Deadline::after(limit), why);
    if (o != Outcome::Ok)
      failed(p, o, why, limit, tag < 32768 ? to : -1);
  }

  std::vector<char> takeOrDie(Pending &p, int from, int32_t tag) {
    return takeOrDie(p, from, tag, p.seq);
  }

  std::vector<char> takeOrDie(Pending &p, int from, int32_t tag, uint64_t seq) {
    std::string why;
    std::vector<char> msg;
    const double limit = collectiveTimeout();
    Outcome o =
        world->take(Key{groupId, members[from], tag, seq}, msg, Deadline::after(limit), why);
    if (o != Outcome::Ok)
      failed(p, o, why, limit, tag < 32768 ? from : -1);
    return msg;
  }

  std::vector<char> takeSized(Pending &p, int from, int32_t tag, int64_t bytes) {
    std::vector<char> msg = takeOrDie(p, from, tag);
    if (static_cast<int64_t>(msg.size()) != bytes)
      fatal("%s over %s: rank %d sent %zu bytes where this rank expected %lld (the ranks "
            "called different collectives or sizes)",
            p.what, name().c_str(), members[from], msg.size(), static_cast<long long>(bytes));
    return msg;
  }

  /// One line in the MPI backend's words, then the job goes down.
  /// `peer`: the group rank of a point-to-point operation's other side, or
  /// -1 for a collective.
  [[noreturn]] void failed(const Pending &p, Outcome o, const std::string &why, double limit,
                           int peer) {
    const int worldMe = world->rank();
    std::string what = p.what;
    if (peer >= 0)
      what += std::string(std::strcmp(p.what, "send") == 0 ? " to" : " from") + " rank " +
              std::to_string(members[peer]);
    std::fflush(stdout);
    if (o == Outcome::TimedOut) {
      std::string suspects;
      if (peer >= 0) {
        suspects = "rank " + std::to_string(members[peer]) + " may be dead or stuck";
      } else {
        for (int r : members)
          if (r != worldMe)
            suspects += (suspects.empty() ? "" : ", ") + std::to_string(r);
        suspects = "rank(s) " + suspects + " of that group may be dead or stuck";
      }
      std::fprintf(stderr, "carve: rank %d: %s over %s (%s, %s) did not complete in %g s; %s\n",
                   worldMe, what.c_str(), name().c_str(), formatBytes(p.bytes).c_str(),
                   stepText().c_str(), limit, suspects.c_str());
    } else {
      std::fprintf(stderr, "carve: rank %d: %s over %s (%s, %s) failed: %s\n", worldMe,
                   what.c_str(), name().c_str(), formatBytes(p.bytes).c_str(), stepText().c_str(),
                   why.c_str());
    }
    std::fflush(stderr);
    abortAll(1);
  }

  void checkPeer(const char *op, int64_t bytes, int peer, int tag) const {
    if (bytes < 0 || peer < 0 || peer >= size() || tag < 0 || tag > 32767)
      fatal("%s of %lld bytes with peer %d, tag %d, in a group of %d ranks", op,
            static_cast<long long>(bytes), peer, tag, size());
  }

  std::shared_ptr<TcpWorld> world;
  uint64_t groupId;
  std::vector<int> members; // world ranks, in group rank order
  int me = 0;
  uint64_t collectives = 0;
  std::map<int64_t, Pending> pending;
  int64_t nextId = 0;
};

} // namespace

std::unique_ptr<Communicator> makeTcpCommunicator(std::shared_ptr<TcpWorld> world, uint64_t id,
                                                  std::vector<int> members) {
  return std::make_unique<TcpCommunicator>(std::move(world), id, std::move(members));
}

} // namespace carve::rt
