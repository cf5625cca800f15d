//===- comm_tcp_rendezvous.cpp - start-up of the TCP world (makeEnvWorld) -===//
//
// makeEnvWorld (comm.h): reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT;
// rank 0 collects every rank's listening address and hands out the table,
// then each pair of ranks connects directly (the higher rank dials the lower),
// all before the collective timeout.
//
//===----------------------------------------------------------------------===//

#include "comm_tcp_world.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace carve::rt {

namespace {

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
  return makeTcpCommunicator(std::move(world), 0, std::move(members));
}

} // namespace carve::rt
