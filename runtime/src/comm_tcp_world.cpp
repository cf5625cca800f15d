//===- comm_tcp_world.cpp - TcpWorld: connections, reader thread, mailbox -===//
//
// The members of TcpWorld (comm_tcp_world.h): sends straight to a peer's
// connection, and the thread that reads every connection as data arrives and
// files each complete message under (group, sender, tag, sequence); a closed
// or reset connection marks its rank gone, which ends every wait for it.
//
//===----------------------------------------------------------------------===//

#include "comm_tcp_world.h"

#include "carve/rt/kernels.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

namespace carve::rt {

TcpWorld::TcpWorld(int rank, int size, std::vector<int> connections)
    : myRank(rank), mySize(size), fds(std::move(connections)), incoming(static_cast<size_t>(size)),
      gone(static_cast<size_t>(size)) {
  if (::pipe2(wake, O_NONBLOCK | O_CLOEXEC) != 0)
    fatal("rank %d: cannot create a pipe: %s", myRank, errnoText(errno).c_str());
  reader = std::thread([this] { receiveLoop(); });
}

TcpWorld::~TcpWorld() {
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

Outcome TcpWorld::send(int dst, uint64_t group, int32_t tag, uint64_t seq, const void *data,
                       int64_t bytes, const Deadline &d, std::string &why) {
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

Outcome TcpWorld::take(const Key &k, std::vector<char> &out, const Deadline &d, std::string &why) {
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

int TcpWorld::openPeers() const {
  int n = 0;
  for (int r = 0; r < mySize; ++r)
    n += r != myRank && gone[r].empty();
  return n;
}

void TcpWorld::markGone(int r, std::string reason) {
  std::lock_guard<std::mutex> lock(mutex);
  if (gone[r].empty())
    gone[r] = std::move(reason);
  cv.notify_all();
}

void TcpWorld::receiveLoop() {
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

void TcpWorld::readFrom(int r) {
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

} // namespace carve::rt
