//===- comm_tcp.cpp - a Communicator over TCP sockets (plain launchers) ---===//
//
// The world of a launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and
// MASTER_PORT instead of starting MPI: it bootstraps NCCL without MPI and runs
// CPU programs. Rank 0 listens on MASTER_PORT; every other rank connects to
// it, says who it is and where it listens itself, and gets the others'
// addresses back; then each pair of ranks connects directly (the higher rank
// dials the lower), so the job is a full mesh of connections.
//
// A thread per process reads every connection as soon as data arrives and
// files each message in a mailbox under (group, sender, tag, sequence):
// sends never wait for the receiver to post its receive (the MPI semantics
// the generated schedules rely on), and a peer that dies is noticed at once
// (its connection closes). Collectives go through the group's rank 0, the
// hub: the others send their part when the operation starts, and the hub
// reduces (in group rank order, so results are deterministic) and sends the
// result back when it waits. Every collective of a group carries the group's
// sequence number, so several in flight never mix up. All-to-all, broadcast
// and point-to-point messages go directly between the two ranks.
//
// Every wait is bounded by the collective timeout. A rank that times out,
// or finds that a rank it waits for has closed its connection, prints one
// line in the MPI backend's words and exits (abortAll); the other ranks then
// see its connection close and report in turn.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/comm.h"
#include "carve/rt/kernels.h"
#include "carve/rt/metrics.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

namespace carve::rt {
namespace {

using Clock = std::chrono::steady_clock;

std::string stepText() {
  const int64_t step = commStep();
  if (step == -1)
    return "at start-up";
  if (step == -2)
    return "after the last step";
  return "step " + std::to_string(step);
}

std::string errnoText(int e) { return std::strerror(e); }

/// A point in time bounded by the collective timeout, or never (timeout 0).
struct Deadline {
  Clock::time_point at;
  bool never = false;

  static Deadline after(double seconds) {
    Deadline d;
    d.never = seconds <= 0;
    if (!d.never)
      d.at = Clock::now() +
             std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    return d;
  }
  bool passed() const { return !never && Clock::now() >= at; }
  /// Milliseconds to the deadline for poll(), at most one second so that the
  /// callers' loops look at the clock again.
  int pollMs() const {
    if (never)
      return 1000;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at - Clock::now()).count();
    return static_cast<int>(std::clamp<long long>(left, 0, 1000));
  }
};

//===--- Sockets -----------------------------------------------------------===//

constexpr uint32_t kMagic = 0x63727674; // "crvt"

/// What a connecting rank tells the rank it dials.
struct Hello {
  uint32_t magic;
  int32_t rank;
  int32_t size;
  uint16_t port; // where this rank listens for the ranks above it
  uint16_t pad;
};

/// Where a rank listens (network byte order), as rank 0 saw it.
struct Address {
  uint32_t ip;
  uint16_t port;
  uint16_t pad;
};

void closeFd(int &fd) {
  if (fd >= 0)
    ::close(fd);
  fd = -1;
}

bool setNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  return flags >= 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

void tuneSocket(int fd) {
  int one = 1;
  // Collectives are mostly small (a loss, a norm): no Nagle delay.
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/// Waits until `fd` is ready for `events`; false at the deadline.
bool waitFd(int fd, short events, const Deadline &d) {
  for (;;) {
    pollfd p{fd, events, 0};
    int k = ::poll(&p, 1, d.pollMs());
    if (k > 0)
      return true;
    if (k < 0 && errno != EINTR)
      return true; // the next call on fd reports the error
    if (d.passed())
      return false;
  }
}

/// Writes all of `data` to a non-blocking socket. False with `why` set on an
/// error, or with `timedOut` at the deadline.
bool writeAll(int fd, const void *data, size_t n, const Deadline &d, std::string &why,
              bool &timedOut) {
  const char *p = static_cast<const char *>(data);
  timedOut = false;
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR)
      continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!waitFd(fd, POLLOUT, d)) {
        timedOut = true;
        return false;
      }
      continue;
    }
    why = k < 0 ? errnoText(errno) : "connection closed";
    return false;
  }
  return true;
}

/// Reads exactly `n` bytes from a non-blocking socket (start-up only: later
/// reads belong to the receiving thread).
bool readAll(int fd, void *data, size_t n, const Deadline &d, std::string &why) {
  char *p = static_cast<char *>(data);
  while (n > 0) {
    ssize_t k = ::recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k == 0) {
      why = "the connection was closed";
      return false;
    }
    if (errno == EINTR)
      continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!waitFd(fd, POLLIN, d)) {
        why = "no answer in time";
        return false;
      }
      continue;
    }
    why = errnoText(errno);
    return false;
  }
  return true;
}

/// A non-blocking TCP socket listening on `port` (0: any free port) on every
/// interface; -1 with `why` set on failure.
int listenOn(uint16_t port, std::string &why) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    why = errnoText(errno);
    return -1;
  }
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(port);
  if (::bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0 || ::listen(fd, SOMAXCONN) != 0 ||
      !setNonBlocking(fd)) {
    why = errnoText(errno);
    closeFd(fd);
    return -1;
  }
  return fd;
}

uint16_t localPort(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof a;
  if (getsockname(fd, reinterpret_cast<sockaddr *>(&a), &len) != 0)
    return 0;
  return ntohs(a.sin_port);
}

/// Accepts one connection before the deadline; -1 at the deadline.
int acceptOne(int listener, const Deadline &d, sockaddr_in *peer) {
  for (;;) {
    sockaddr_in a{};
    socklen_t len = sizeof a;
    int fd =
        ::accept4(listener, reinterpret_cast<sockaddr *>(&a), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      tuneSocket(fd);
      if (peer)
        *peer = a;
      return fd;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
      return -1;
    if (!waitFd(listener, POLLIN, d))
      return -1;
  }
}

/// Connects to `to`, retrying while nobody listens there yet (the rank may
/// not have started), until the deadline. -1 with `why` (the last error).
int connectTo(const sockaddr_in &to, const Deadline &d, std::string &why) {
  why = "no attempt";
  for (;;) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      why = errnoText(errno);
      return -1;
    }
    int rc = ::connect(fd, reinterpret_cast<const sockaddr *>(&to), sizeof to);
    int err = rc == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      if (waitFd(fd, POLLOUT, d)) {
        socklen_t len = sizeof err;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
          err = errno;
      } else {
        err = ETIMEDOUT;
      }
    }
    if (err == 0) {
      tuneSocket(fd);
      return fd;
    }
    closeFd(fd);
    why = errnoText(err);
    if (d.passed())
      return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(100, d.pollMs())));
    if (d.passed())
      return -1;
  }
}

//===--- The world: connections, the receiving thread, the mailbox ---------===//

/// The frame before every message's bytes.
struct FrameHeader {
  uint64_t group;
  uint64_t seq;
  int32_t tag;
  int32_t pad;
  int64_t bytes;
};
static_assert(sizeof(FrameHeader) == 32, "the frame header is sent as is");

/// No message is larger than this (a corrupt header otherwise allocates
/// without bound).
constexpr int64_t kMaxMessage = int64_t(1) << 42;

/// User tags are 0..32767; collectives use the tags above.
enum InternalTag : int32_t {
  kTagAllReduce = 32768,
  kTagAllGather,
  kTagReduceScatter,
  kTagAllToAll,
  kTagBroadcast,
  kTagBarrier,
  kTagSplit,
};

struct Key {
  uint64_t group;
  int src; // world rank
  int32_t tag;
  uint64_t seq;
  bool operator<(const Key &o) const {
    return std::tie(group, src, tag, seq) < std::tie(o.group, o.src, o.tag, o.seq);
  }
};

/// How a wait for a message ended.
enum class Outcome { Ok, TimedOut, PeerGone };

class TcpWorld {
public:
  /// `fds[r]`: the connection to world rank r (-1 for this rank).
  TcpWorld(int rank, int size, std::vector<int> connections)
      : myRank(rank), mySize(size), fds(std::move(connections)),
        incoming(static_cast<size_t>(size)), gone(static_cast<size_t>(size)) {
    if (::pipe2(wake, O_NONBLOCK | O_CLOEXEC) != 0)
      fatal("rank %d: cannot create a pipe: %s", myRank, errnoText(errno).c_str());
    reader = std::thread([this] { receiveLoop(); });
  }

  ~TcpWorld() {
    // Half-close first and give the peers a moment to do the same, so that
    // no connection is reset while a peer still has our last messages to read.
    for (int r = 0; r < mySize; ++r)
      if (fds[r] >= 0)
        ::shutdown(fds[r], SHUT_WR);
    {
      std::unique_lock<std::mutex> lock(mutex);
      cv.wait_for(lock, std::chrono::seconds(2), [this] { return openPeers() == 0; });
    }
    char c = 1;
    ssize_t ignored = ::write(wake[1], &c, 1);
    (void)ignored;
    reader.join();
    for (int &fd : fds)
      closeFd(fd);
    closeFd(wake[0]);
    closeFd(wake[1]);
  }

  int rank() const { return myRank; }
  int size() const { return mySize; }

  /// A group id unique in the job: this rank's number and a counter.
  uint64_t newGroupId() { return (static_cast<uint64_t>(myRank) + 1) << 32 | ++groupCounter; }

  /// Sends one message to world rank `dst` (to itself: straight into the
  /// mailbox). False with `why`/`timedOut` when it cannot be delivered.
  Outcome send(int dst, uint64_t group, int32_t tag, uint64_t seq, const void *data, int64_t bytes,
               const Deadline &d, std::string &why) {
    if (dst == myRank) {
      const char *p = static_cast<const char *>(data);
      std::lock_guard<std::mutex> lock(mutex);
      mailbox[Key{group, myRank, tag, seq}].emplace_back(p, p + bytes);
      cv.notify_all();
      return Outcome::Ok;
    }
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!gone[dst].empty()) {
        why = "rank " + std::to_string(dst) + " " + gone[dst];
        return Outcome::PeerGone;
      }
    }
    FrameHeader h{group, seq, tag, 0, bytes};
    bool timedOut = false;
    if (writeAll(fds[dst], &h, sizeof h, d, why, timedOut) &&
        (bytes == 0 || writeAll(fds[dst], data, static_cast<size_t>(bytes), d, why, timedOut)))
      return Outcome::Ok;
    if (timedOut)
      return Outcome::TimedOut;
    why = "rank " + std::to_string(dst) + " reset its connection (" + why + "): it died or exited";
    return Outcome::PeerGone;
  }

  /// Takes the oldest message filed under `k`, waiting for it until the
  /// deadline or until its sender is known to be gone.
  Outcome take(const Key &k, std::vector<char> &out, const Deadline &d, std::string &why) {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      auto it = mailbox.find(k);
      if (it != mailbox.end() && !it->second.empty()) {
        out = std::move(it->second.front());
        it->second.pop_front();
        if (it->second.empty())
          mailbox.erase(it);
        return Outcome::Ok;
      }
      if (!gone[k.src].empty()) {
        why = "rank " + std::to_string(k.src) + " " + gone[k.src];
        return Outcome::PeerGone;
      }
      if (d.never)
        cv.wait_for(lock, std::chrono::seconds(1));
      else if (cv.wait_until(lock, d.at) == std::cv_status::timeout && d.passed()) {
        it = mailbox.find(k);
        if (it == mailbox.end() || it->second.empty())
          return Outcome::TimedOut;
      }
    }
  }

private:
  /// A message being read from one connection.
  struct Incoming {
    FrameHeader header{};
    size_t headerGot = 0;
    std::vector<char> payload;
    size_t payloadGot = 0;
  };

  int openPeers() const {
    int n = 0;
    for (int r = 0; r < mySize; ++r)
      n += r != myRank && gone[r].empty();
    return n;
  }

  void markGone(int r, std::string reason) {
    std::lock_guard<std::mutex> lock(mutex);
    if (gone[r].empty())
      gone[r] = std::move(reason);
    cv.notify_all();
  }

  void receiveLoop() {
    std::vector<pollfd> pfds;
    std::vector<int> who;
    for (;;) {
      pfds.assign(1, pollfd{wake[0], POLLIN, 0});
      who.assign(1, -1);
      {
        std::lock_guard<std::mutex> lock(mutex);
        for (int r = 0; r < mySize; ++r)
          if (r != myRank && gone[r].empty() && fds[r] >= 0) {
            pfds.push_back(pollfd{fds[r], POLLIN, 0});
            who.push_back(r);
          }
      }
      int k = ::poll(pfds.data(), pfds.size(), -1);
      if (k < 0) {
        if (errno == EINTR)
          continue;
        for (size_t i = 1; i < who.size(); ++i)
          markGone(who[i], "is unreachable (poll: " + errnoText(errno) + ")");
        return;
      }
      if (pfds[0].revents)
        return;
      for (size_t i = 1; i < pfds.size(); ++i)
        if (pfds[i].revents)
          readFrom(who[i]);
    }
  }

  /// Reads what `r` has sent so far and files every complete message.
  void readFrom(int r) {
    Incoming &in = incoming[r];
    for (;;) {
      if (in.headerGot == sizeof(FrameHeader) && in.payloadGot == in.payload.size()) {
        std::lock_guard<std::mutex> lock(mutex);
        mailbox[Key{in.header.group, r, in.header.tag, in.header.seq}].push_back(
            std::move(in.payload));
        cv.notify_all();
        in = Incoming();
      }
      char *dst;
      size_t want;
      if (in.headerGot < sizeof(FrameHeader)) {
        dst = reinterpret_cast<char *>(&in.header) + in.headerGot;
        want = sizeof(FrameHeader) - in.headerGot;
      } else {
        dst = in.payload.data() + in.payloadGot;
        want = in.payload.size() - in.payloadGot;
      }
      ssize_t got = ::recv(fds[r], dst, want, 0);
      if (got < 0 && errno == EINTR)
        continue;
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return;
      if (got == 0) {
        markGone(r, in.headerGot == 0 ? "closed its connection: it died or exited"
                                      : "closed its connection in the middle of a message: "
                                        "it died");
        return;
      }
      if (got < 0) {
        markGone(r, "reset its connection (" + errnoText(errno) + "): it died or exited");
        return;
      }
      if (in.headerGot < sizeof(FrameHeader)) {
        in.headerGot += static_cast<size_t>(got);
        if (in.headerGot == sizeof(FrameHeader)) {
          if (in.header.bytes < 0 || in.header.bytes > kMaxMessage) {
            markGone(r, "sent a malformed message (is another program on this port?)");
            return;
          }
          in.payload.resize(static_cast<size_t>(in.header.bytes));
        }
      } else {
        in.payloadGot += static_cast<size_t>(got);
      }
    }
  }

  const int myRank, mySize;
  std::vector<int> fds;
  std::vector<Incoming> incoming; // used by the receiving thread only
  int wake[2] = {-1, -1};
  uint32_t groupCounter = 0;

  std::mutex mutex; // guards mailbox and gone
  std::condition_variable cv;
  std::map<Key, std::deque<std::vector<char>>> mailbox;
  std::vector<std::string> gone; // why rank r can no longer be heard from; empty: it can
  std::thread reader;
};

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
  }
  fatal("collective: unknown element type %d", static_cast<int>(t));
}

void checkCount(const char *op, int64_t n) {
  if (n < 0)
    fatal("%s of %lld elements", op, static_cast<long long>(n));
}

void checkType(CommType t) {
  if (static_cast<int>(t) < 0 || static_cast<int>(t) > static_cast<int>(CommType::U8))
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

//===--- Start-up ----------------------------------------------------------===//

bool parseInt(const char *s, long long lo, long long hi, long long &out) {
  if (!s || !*s)
    return false;
  errno = 0;
  char *end = nullptr;
  long long v = std::strtoll(s, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi)
    return false;
  out = v;
  return true;
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

/// Rank 0: accepts every other rank on `port`, then sends each the table of
/// where the others listen. fds[r] gets the connection to rank r.
bool hubRendezvous(int size, uint16_t port, const Deadline &d, double limit, std::vector<int> &fds,
                   std::string &error) {
  std::string why;
  int listener = listenOn(port, why);
  if (listener < 0) {
    error = "rank 0 cannot listen on port " + std::to_string(port) + ": " + why +
            (why.find("in use") != std::string::npos
                 ? " (under torchrun its agent holds MASTER_PORT: set CARVE_MASTER_PORT to "
                   "another free port)"
                 : "");
    return false;
  }
  std::vector<Address> table(static_cast<size_t>(size), Address{0, 0, 0});
  int joined = 0;
  while (joined < size - 1) {
    sockaddr_in peer{};
    int fd = acceptOne(listener, d, &peer);
    if (fd < 0) {
      std::string missing;
      for (int r = 1; r < size; ++r)
        if (fds[r] < 0)
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      error = "rank 0: rank(s) " + missing + " did not connect to port " + std::to_string(port) +
              " within " + seconds(limit) +
              " (not started, or a different MASTER_ADDR/MASTER_PORT)";
      closeFd(listener);
      return false;
    }
    Hello h{};
    // A stray connection (a port scanner, a health check) says nothing
    // sensible: drop it and keep waiting for the ranks.
    if (!readAll(fd, &h, sizeof h, Deadline::after(std::min(limit > 0 ? limit : 10.0, 10.0)),
                 why) ||
        h.magic != kMagic) {
      closeFd(fd);
      continue;
    }
    if (h.size != size || h.rank <= 0 || h.rank >= size || fds[h.rank] >= 0) {
      error =
          h.size != size
              ? "rank " + std::to_string(h.rank) + " has WORLD_SIZE=" + std::to_string(h.size) +
                    " but rank 0 has " + std::to_string(size)
              : "two processes have RANK=" + std::to_string(h.rank) + " (or it is out of range)";
      closeFd(fd);
      closeFd(listener);
      return false;
    }
    fds[h.rank] = fd;
    table[h.rank] = Address{peer.sin_addr.s_addr, htons(h.port), 0};
    ++joined;
  }
  closeFd(listener);
  for (int r = 1; r < size; ++r) {
    bool timedOut = false;
    if (!writeAll(fds[r], table.data(), table.size() * sizeof(Address), d, why, timedOut)) {
      error = "rank 0: rank " + std::to_string(r) + " went away during start-up (" +
              (timedOut ? "no answer" : why) + ")";
      return false;
    }
  }
  return true;
}

/// Rank r > 0: joins rank 0, then connects to every rank below it and
/// accepts every rank above it.
bool workerRendezvous(int rank, int size, const std::string &addr, uint16_t port, const Deadline &d,
                      double limit, std::vector<int> &fds, std::string &error) {
  const std::string who = "rank " + std::to_string(rank);
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo *res = nullptr;
  int gai = getaddrinfo(addr.c_str(), nullptr, &hints, &res);
  if (gai != 0 || !res) {
    error = who + ": MASTER_ADDR=" + addr + " does not resolve to an IPv4 address: " +
            (gai != 0 ? gai_strerror(gai) : "no address");
    return false;
  }
  sockaddr_in hub = *reinterpret_cast<sockaddr_in *>(res->ai_addr);
  freeaddrinfo(res);
  hub.sin_port = htons(port);

  std::string why;
  int listener = listenOn(0, why);
  if (listener < 0) {
    error = who + " cannot listen for its peers: " + why;
    return false;
  }
  fds[0] = connectTo(hub, d, why);
  if (fds[0] < 0) {
    error = who + " could not connect to rank 0 at " + addr + ":" + std::to_string(port) +
            " within " + seconds(limit) + " (" + why + ")";
    closeFd(listener);
    return false;
  }
  Hello mine{kMagic, rank, size, localPort(listener), 0};
  std::vector<Address> table(static_cast<size_t>(size));
  bool timedOut = false;
  if (!writeAll(fds[0], &mine, sizeof mine, d, why, timedOut) ||
      !readAll(fds[0], table.data(), table.size() * sizeof(Address), d, why)) {
    error = who + ": rank 0 at " + addr + ":" + std::to_string(port) +
            " did not complete the start-up (" + (timedOut ? "no answer" : why) +
            "); see rank 0's error";
    closeFd(listener);
    return false;
  }
  for (int r = 1; r < rank; ++r) {
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_addr.s_addr = table[r].ip;
    to.sin_port = table[r].port;
    fds[r] = connectTo(to, d, why);
    Hello h{kMagic, rank, size, 0, 0};
    if (fds[r] < 0 || !writeAll(fds[r], &h, sizeof h, d, why, timedOut)) {
      error = who + " could not connect to rank " + std::to_string(r) + " (" +
              (timedOut ? "no answer" : why) + ")";
      closeFd(listener);
      return false;
    }
  }
  for (int joined = rank + 1; joined < size; ++joined) {
    int fd = acceptOne(listener, d, nullptr);
    Hello h{};
    if (fd < 0 || !readAll(fd, &h, sizeof h, d, why) || h.magic != kMagic || h.rank <= rank ||
        h.rank >= size || fds[h.rank] >= 0) {
      std::string missing;
      for (int r = rank + 1; r < size; ++r)
        if (fds[r] < 0)
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      error = fd < 0 ? who + ": rank(s) " + missing + " did not connect within " + seconds(limit)
                     : who + ": a bad connection attempt while waiting for rank(s) " + missing;
      closeFd(fd);
      closeFd(listener);
      return false;
    }
    fds[h.rank] = fd;
  }
  closeFd(listener);
  return true;
}

} // namespace

std::unique_ptr<Communicator> makeEnvWorld(std::string &error) {
  error.clear();
  const char *rankText = std::getenv("RANK");
  const char *sizeText = std::getenv("WORLD_SIZE");
  if (!rankText && !sizeText)
    return nullptr;
  long long rank = 0, size = 0;
  if (!parseInt(sizeText, 1, 1 << 20, size)) {
    error = std::string("WORLD_SIZE=") + (sizeText ? sizeText : "(unset)") +
            " is not a positive number of ranks (RANK=" + (rankText ? rankText : "(unset)") + ")";
    return nullptr;
  }
  if (!parseInt(rankText, 0, size - 1, rank)) {
    error = std::string("RANK=") + (rankText ? rankText : "(unset)") + " is not a rank in 0.." +
            std::to_string(size - 1) + " (WORLD_SIZE=" + sizeText + ")";
    return nullptr;
  }
  std::vector<int> fds(static_cast<size_t>(size), -1);
  if (size > 1) {
    const char *addr = std::getenv("MASTER_ADDR");
    // Under torchrun, its agent's store already listens on MASTER_PORT.
    const char *portVar = std::getenv("CARVE_MASTER_PORT") ? "CARVE_MASTER_PORT" : "MASTER_PORT";
    const char *portText = std::getenv(portVar);
    long long port = 0;
    if (!addr || !*addr) {
      error = "rank " + std::to_string(rank) + ": WORLD_SIZE=" + std::to_string(size) +
              " needs MASTER_ADDR (the host of rank 0)";
      return nullptr;
    }
    if (!parseInt(portText, 1, 65535, port)) {
      error = "rank " + std::to_string(rank) + ": " + portVar + "=" +
              (portText ? portText : "(unset)") + " is not a port number (1..65535)";
      return nullptr;
    }
    const double limit = collectiveTimeout();
    const Deadline d = Deadline::after(limit);
    bool ok = rank == 0 ? hubRendezvous(static_cast<int>(size), static_cast<uint16_t>(port), d,
                                        limit, fds, error)
                        : workerRendezvous(static_cast<int>(rank), static_cast<int>(size), addr,
                                           static_cast<uint16_t>(port), d, limit, fds, error);
    if (!ok) {
      for (int &fd : fds)
        closeFd(fd);
      return nullptr;
    }
  }
  auto world =
      std::make_shared<TcpWorld>(static_cast<int>(rank), static_cast<int>(size), std::move(fds));
  std::vector<int> members(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r)
    members[r] = r;
  return std::make_unique<TcpCommunicator>(std::move(world), 0, std::move(members));
}

} // namespace carve::rt
