//===- comm_tcp_world.h - the TCP world: sockets, frames, the mailbox -----===//
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
// Private to the files of the TCP backend: comm_tcp_sockets.cpp (socket I/O
// bounded by a deadline), comm_tcp_world.cpp (TcpWorld: the connections, the
// receiving thread, the mailbox), comm_tcp_collectives.cpp (the Communicator
// and its failure reports) and comm_tcp_rendezvous.cpp (start-up: makeEnvWorld).
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_SRC_COMM_TCP_WORLD_H
#define CARVE_RT_SRC_COMM_TCP_WORLD_H

#include "carve/rt/comm.h"

#include <netinet/in.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace carve::rt {

using Clock = std::chrono::steady_clock;

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

//===--- Sockets (comm_tcp_sockets.cpp) -----------------------------------===//

/// strerror(e) as a string.
std::string errnoText(int e);

/// Closes `fd` if it is open and sets it to -1.
void closeFd(int &fd);

/// Writes all of `data` to a non-blocking socket. False with `why` set on an
/// error, or with `timedOut` at the deadline.
bool writeAll(int fd, const void *data, size_t n, const Deadline &d, std::string &why,
              bool &timedOut);

/// Reads exactly `n` bytes from a non-blocking socket (start-up only: later
/// reads belong to the receiving thread).
bool readAll(int fd, void *data, size_t n, const Deadline &d, std::string &why);

/// A non-blocking TCP socket listening on `port` (0: any free port) on every
/// interface; -1 with `why` set on failure.
int listenOn(uint16_t port, std::string &why);

/// The port a socket is bound to (0 if unknown).
uint16_t localPort(int fd);

/// Accepts one connection before the deadline; -1 at the deadline.
int acceptOne(int listener, const Deadline &d, sockaddr_in *peer);

/// Connects to `to`, retrying while nobody listens there yet (the rank may
/// not have started), until the deadline. -1 with `why` (the last error).
int connectTo(const sockaddr_in &to, const Deadline &d, std::string &why);

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

/// This process's connections to every other rank, the thread that reads them
/// and the mailbox it files their messages in (comm_tcp_world.cpp).
class TcpWorld {
public:
  /// `fds[r]`: the connection to world rank r (-1 for this rank).
  TcpWorld(int rank, int size, std::vector<int> connections);
  /// Half-closes every connection, gives the peers up to 2 s to do the same,
  /// then stops the receiving thread and closes everything.
  ~TcpWorld();

  int rank() const { return myRank; }
  int size() const { return mySize; }

  /// A group id unique in the job: this rank's number and a counter.
  uint64_t newGroupId() { return (static_cast<uint64_t>(myRank) + 1) << 32 | ++groupCounter; }

  /// Sends one message to world rank `dst` (to itself: straight into the
  /// mailbox). False with `why`/`timedOut` when it cannot be delivered.
  Outcome send(int dst, uint64_t group, int32_t tag, uint64_t seq, const void *data, int64_t bytes,
               const Deadline &d, std::string &why);

  /// Takes the oldest message filed under `k`, waiting for it until the
  /// deadline or until its sender is known to be gone.
  Outcome take(const Key &k, std::vector<char> &out, const Deadline &d, std::string &why);

private:
  /// A message being read from one connection.
  struct Incoming {
    FrameHeader header{};
    size_t headerGot = 0;
    std::vector<char> payload;
    size_t payloadGot = 0;
  };

  /// The ranks not yet gone, other than this one (mutex held).
  int openPeers() const;
  /// Records why rank r can no longer be heard from (the first reason stays)
  /// and wakes every waiter.
  void markGone(int r, std::string reason);
  /// The receiving thread: polls every open connection and the wake pipe.
  void receiveLoop();
  /// Reads what `r` has sent so far and files every complete message.
  void readFrom(int r);

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

/// A Communicator over world ranks `members` (in group rank order) with group
/// id `id`: every member creates it with the same id and members
/// (comm_tcp_collectives.cpp).
std::unique_ptr<Communicator> makeTcpCommunicator(std::shared_ptr<TcpWorld> world, uint64_t id,
                                                  std::vector<int> members);

} // namespace carve::rt

#endif // CARVE_RT_SRC_COMM_TCP_WORLD_H
