//===- comm_tcp_sockets.cpp - TCP socket I/O bounded by a deadline --------===//
//
// Non-blocking sockets for the TCP world (comm_tcp_world.h): listen, accept,
// connect with retries, and whole reads and writes, each of which gives up at
// its Deadline.
//
//===----------------------------------------------------------------------===//

#include "comm_tcp_world.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace carve::rt {

namespace {

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

} // namespace

std::string errnoText(int e) { return std::strerror(e); }

void closeFd(int &fd) {
  if (fd >= 0)
    ::close(fd);
  fd = -1;
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

} // namespace carve::rt
