//===- nccl_emu.cpp - NCCL between processes, on the CPU ------------------===//
//
// The emulated build links this instead of libnccl, so that comm_nccl.cpp
// (the NCCL communicator carve ships) runs as it is, one process per rank.
//
// - Start-up: ncclGetUniqueId opens a listening socket on 127.0.0.1 and
//   names it in the id (so every rank runs on this host); rank 0 accepts the
//   others there, checks that they agree on the size and use distinct
//   devices, and sends each the table of every rank's own listening port;
//   the ranks then connect pairwise. A reader thread per connection files
//   every message it receives under (communicator, sender). A split is one
//   exchange of (color, key) over its parent's connections; communicators
//   share their world's connections.
// - Operations are queued on their stream as two pieces of work: the post
//   sends this rank's contributions at once (sends complete without their
//   receive, as NCCL's do for messages its buffers hold), and the
//   completion waits, at the head of its stream, until every message it
//   needs has arrived, then receives and reduces. Everything queued behind
//   it on that stream waits with it, as on a device. Inside
//   ncclGroupStart/End every post goes before any completion.
// - Reductions run in rank order, each step rounded to the element type, so
//   every rank gets bitwise the same result.
// - Strict: every buffer must be device memory; the messages carry their
//   operation, element type, count, reduction and root, and a rank whose
//   matching call disagrees ends the run naming both calls; a message never
//   received is reported when its communicator is finalized; a rank that
//   is needed but has gone sets the communicator's asynchronous error
//   (ncclRemoteError), which comm_nccl.cpp reports in its own words.
//
//===----------------------------------------------------------------------===//

#include "cuda_emu.h"

#include "emu_internal.h"

#include <nccl.h>

#include <algorithm>
#include <arpa/inet.h>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <random>
#include <string>
#include <sys/socket.h>
#include <thread>
#include <tuple>
#include <unistd.h>
#include <vector>

namespace {

constexpr uint64_t kMagic = 0x63617276656e6363ull; // "carvencc"
constexpr char kIdTag[] = "carve-emu-nccl";

enum Kind : uint32_t {
  kAllReduce = 1,
  kAllGather,
  kReduceScatter,
  kReduce,
  kBroadcast,
  kSend,
  kRecv,
  kSplit, // on the control channel
  kBye,   // the sender destroyed its last communicator
};

const char *kindName(uint32_t k) {
  switch (k) {
  case kAllReduce:
    return "ncclAllReduce";
  case kAllGather:
    return "ncclAllGather";
  case kReduceScatter:
    return "ncclReduceScatter";
  case kReduce:
    return "ncclReduce";
  case kBroadcast:
    return "ncclBroadcast";
  case kSend:
    return "ncclSend";
  case kRecv:
    return "ncclRecv";
  case kSplit:
    return "ncclCommSplit";
  default:
    return "an unknown operation";
  }
}

const char *typeName(ncclDataType_t t) {
  switch (t) {
  case ncclInt8:
    return "int8";
  case ncclUint8:
    return "uint8";
  case ncclInt32:
    return "int32";
  case ncclUint32:
    return "uint32";
  case ncclInt64:
    return "int64";
  case ncclUint64:
    return "uint64";
  case ncclFloat16:
    return "float16";
  case ncclFloat32:
    return "float32";
  case ncclFloat64:
    return "float64";
  case ncclBfloat16:
    return "bfloat16";
  default:
    return "an unknown type";
  }
}

size_t typeBytes(ncclDataType_t t) {
  switch (t) {
  case ncclInt8:
  case ncclUint8:
    return 1;
  case ncclFloat16:
  case ncclBfloat16:
    return 2;
  case ncclInt32:
  case ncclUint32:
  case ncclFloat32:
    return 4;
  case ncclInt64:
  case ncclUint64:
  case ncclFloat64:
    return 8;
  default:
    carve_emu::fatalCall("NCCL: data type %d is not one carve uses", static_cast<int>(t));
  }
}

/// What a message says about the call that sent it.
struct Header {
  uint64_t magic;
  uint64_t comm;    // the communicator's id
  uint32_t channel; // 0: operations on streams; 1: start-up and splits
  uint32_t kind;
  int32_t type;
  int32_t op;
  int32_t root;
  int32_t spare;
  uint64_t count;
  uint64_t bytes; // of the payload that follows
};

struct Message {
  Header h;
  std::vector<char> data;
};

//===--- The connections of one world -------------------------------------===//

struct Net {
  int rank = 0, size = 1;
  std::vector<int> fds; // by rank; -1 for this rank
  std::vector<std::unique_ptr<std::mutex>> writing;
  std::vector<char> left;   // sent kBye (under gMutex)
  std::vector<char> closed; // its connection ended (under gMutex)
  int users = 0;            // communicators on it (the host thread's)
};

// Never destroyed: the reader threads use them until the process ends, and
// a rank that fails exits from whichever thread found the failure.
std::mutex &gMutex = *new std::mutex; // the inboxes, the nets' left/closed, gFault
std::condition_variable &gArrived = *new std::condition_variable;
using InboxKey = std::tuple<uint64_t, uint32_t, const Net *, int>; // comm, channel, net, sender
std::map<InboxKey, std::deque<Message>> &gInbox = *new std::map<InboxKey, std::deque<Message>>;
std::string &gFault = *new std::string;

double hangLimit() {
  const char *v = std::getenv("CARVE_EMU_HANG_S");
  return v && *v ? std::atof(v) : 300.0;
}

bool writeAll(int fd, const void *p, size_t n) {
  const char *c = static_cast<const char *>(p);
  while (n > 0) {
    const ssize_t k = ::send(fd, c, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR)
      continue;
    if (k <= 0)
      return false;
    c += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool readAll(int fd, void *p, size_t n) {
  char *c = static_cast<char *>(p);
  while (n > 0) {
    const ssize_t k = ::recv(fd, c, n, 0);
    if (k < 0 && errno == EINTR)
      continue;
    if (k <= 0)
      return false;
    c += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

/// Files every message from `peer` until its connection ends.
void readLoop(std::shared_ptr<Net> net, int peer) {
  for (;;) {
    Message m;
    bool ok = readAll(net->fds[peer], &m.h, sizeof m.h) && m.h.magic == kMagic;
    if (ok) {
      m.data.resize(m.h.bytes);
      ok = readAll(net->fds[peer], m.data.data(), m.h.bytes);
    }
    std::lock_guard<std::mutex> lock(gMutex);
    if (!ok) {
      net->closed[peer] = 1;
      gArrived.notify_all();
      return;
    }
    if (m.h.kind == kBye)
      net->left[peer] = 1;
    else
      gInbox[InboxKey{m.h.comm, m.h.channel, net.get(), peer}].push_back(std::move(m));
    gArrived.notify_all();
  }
}

/// Sends `h` and `bytes` of `data` to rank `dst` of `net` (to itself: filed
/// at once). False when the connection is gone.
bool deliver(Net &net, int dst, Header h, const void *data, size_t bytes) {
  h.magic = kMagic;
  h.bytes = bytes;
  if (dst == net.rank) {
    Message m{h, std::vector<char>(static_cast<const char *>(data),
                                   static_cast<const char *>(data) + bytes)};
    std::lock_guard<std::mutex> lock(gMutex);
    gInbox[InboxKey{h.comm, h.channel, &net, dst}].push_back(std::move(m));
    gArrived.notify_all();
    return true;
  }
  std::lock_guard<std::mutex> lock(*net.writing[dst]);
  return writeAll(net.fds[dst], &h, sizeof h) && writeAll(net.fds[dst], data, bytes);
}

//===--- Sockets for start-up ---------------------------------------------===//

int listenLocal(uint16_t &port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0)
    return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0 || ::listen(fd, 128) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr *>(&a), &len) != 0) {
    ::close(fd);
    return -1;
  }
  port = ntohs(a.sin_port);
  return fd;
}

void tune(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

int connectLocal(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0)
    return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (::connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  tune(fd);
  return fd;
}

/// Accepts one connection within the hang limit, or -1.
int acceptWithin(int listener) {
  pollfd p{listener, POLLIN, 0};
  const int ms = static_cast<int>(hangLimit() * 1000);
  if (::poll(&p, 1, ms) != 1)
    return -1;
  const int fd = ::accept(listener, nullptr, nullptr);
  if (fd >= 0)
    tune(fd);
  return fd;
}

/// The unique id: the tag, rank 0's port and a nonce.
struct IdFields {
  char tag[sizeof kIdTag];
  uint16_t port;
  uint64_t nonce;
};
static_assert(sizeof(IdFields) <= sizeof(ncclUniqueId), "the id holds its fields");

/// Listening sockets of the ids this process made, by nonce.
std::map<uint64_t, int> &idListeners() {
  static std::map<uint64_t, int> m;
  return m;
}

struct Hello {
  uint64_t magic, nonce;
  int32_t rank, nranks, device;
  uint16_t port;
  char host[64];
};
struct Table {
  int32_t ok;
  char why[256];
  uint16_t ports[256];
};

} // namespace

//===--- Communicators -------------------------------------------------------===//

struct ncclComm {
  std::shared_ptr<Net> net;
  uint64_t id = 0;
  int rank = 0, nranks = 1;
  std::vector<int> members; // comm rank -> net rank
  uint64_t splits = 0;
  int64_t pending = 0; // operations posted and not yet completed
  std::atomic<int> asyncError{ncclSuccess};
  std::string lastError;
  // NCCL's non-blocking kind (config.blocking = 0): a split returns
  // ncclInProgress and writes the new communicator to the caller's pointer
  // only when it completes, which here is the parent's next
  // ncclCommGetAsyncError (real NCCL writes it from a thread in between).
  bool nonBlocking = false;
  std::mutex splitMutex; // the watchdog thread polls too
  ncclComm_t *splitTo = nullptr;
  ncclComm *splitResult = nullptr;
};

namespace {

std::string gLastError; // of a failed start-up (no communicator to hold it)

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  return x ^ (x >> 29);
}

void startReaders(const std::shared_ptr<Net> &net) {
  for (int r = 0; r < net->size; ++r)
    if (r != net->rank)
      std::thread(readLoop, net, r).detach();
}

std::shared_ptr<Net> makeNet(int rank, int size) {
  auto net = std::make_shared<Net>();
  net->rank = rank;
  net->size = size;
  net->fds.assign(static_cast<size_t>(size), -1);
  net->left.assign(static_cast<size_t>(size), 0);
  net->closed.assign(static_cast<size_t>(size), 0);
  for (int r = 0; r < size; ++r)
    net->writing.push_back(std::make_unique<std::mutex>());
  return net;
}

/// Rank `rank` of `nranks` joins the world of `id`; "" or why not.
std::string joinWorld(const IdFields &id, int rank, int nranks, std::shared_ptr<Net> &out) {
  auto net = makeNet(rank, nranks);
  char host[64] = {};
  ::gethostname(host, sizeof host - 1);
  if (rank == 0) {
    auto it = idListeners().find(id.nonce);
    if (it == idListeners().end())
      return "rank 0 must be the process that made the unique id (ncclGetUniqueId)";
    const int listener = it->second;
    idListeners().erase(it);
    std::vector<uint16_t> ports(static_cast<size_t>(nranks), id.port);
    std::vector<int> devices(static_cast<size_t>(nranks), carve_emu::currentDevice());
    std::string why;
    for (int k = 1; k < nranks; ++k) {
      const int fd = acceptWithin(listener);
      Hello h{};
      if (fd < 0 || !readAll(fd, &h, sizeof h) || h.magic != kMagic || h.nonce != id.nonce) {
        if (fd >= 0)
          ::close(fd);
        why = std::to_string(nranks - k) + " rank(s) did not join within CARVE_EMU_HANG_S";
        break;
      }
      if (h.nranks != nranks && why.empty())
        why = "rank " + std::to_string(h.rank) + " starts a communicator of " +
              std::to_string(h.nranks) + " ranks, rank 0 one of " + std::to_string(nranks);
      if ((h.rank <= 0 || h.rank >= nranks || net->fds[h.rank] >= 0) && why.empty())
        why = "two ranks joined as rank " + std::to_string(h.rank);
      if (h.rank > 0 && h.rank < nranks && net->fds[h.rank] < 0) {
        net->fds[h.rank] = fd;
        ports[h.rank] = h.port;
        devices[h.rank] = h.device;
        if (std::strcmp(h.host, host) != 0 && why.empty())
          why = "rank " + std::to_string(h.rank) + " runs on another host (" + h.host +
                "): the emulation's ranks share one";
      } else {
        ::close(fd);
      }
    }
    ::close(listener);
    for (int a = 0; a < nranks && why.empty(); ++a)
      for (int b = a + 1; b < nranks && why.empty(); ++b)
        if (devices[a] == devices[b])
          why = "ranks " + std::to_string(a) + " and " + std::to_string(b) + " both use GPU " +
                std::to_string(devices[a]) + " (each rank of a communicator needs its own)";
    Table t{};
    t.ok = why.empty();
    std::snprintf(t.why, sizeof t.why, "%s", why.c_str());
    for (int r = 0; r < nranks; ++r)
      t.ports[r] = ports[r];
    for (int r = 1; r < nranks; ++r)
      if (net->fds[r] >= 0)
        writeAll(net->fds[r], &t, sizeof t);
    if (!why.empty())
      return why;
  } else {
    uint16_t myPort = 0;
    const int listener = listenLocal(myPort);
    if (listener < 0)
      return std::string("cannot listen on 127.0.0.1: ") + std::strerror(errno);
    const int root = connectLocal(id.port);
    if (root < 0) {
      ::close(listener);
      return "cannot reach rank 0 at 127.0.0.1:" + std::to_string(id.port) + ": " +
             std::strerror(errno);
    }
    Hello h{kMagic, id.nonce, rank, nranks, carve_emu::currentDevice(), myPort, {}};
    std::memcpy(h.host, host, sizeof h.host);
    Table t{};
    if (!writeAll(root, &h, sizeof h) || !readAll(root, &t, sizeof t)) {
      ::close(listener);
      return "rank 0 closed the connection during start-up";
    }
    if (!t.ok) {
      ::close(listener);
      t.why[sizeof t.why - 1] = '\0';
      return t.why;
    }
    net->fds[0] = root;
    for (int j = 1; j < rank; ++j) {
      const int fd = connectLocal(t.ports[j]);
      Hello p{kMagic, id.nonce, rank, nranks, 0, 0, {}};
      if (fd < 0 || !writeAll(fd, &p, sizeof p)) {
        ::close(listener);
        return "cannot reach rank " + std::to_string(j);
      }
      net->fds[j] = fd;
    }
    for (int k = rank + 1; k < nranks; ++k) {
      const int fd = acceptWithin(listener);
      Hello p{};
      if (fd < 0 || !readAll(fd, &p, sizeof p) || p.magic != kMagic || p.nonce != id.nonce ||
          p.rank <= rank || p.rank >= nranks || net->fds[p.rank] >= 0) {
        ::close(listener);
        return "rank(s) above " + std::to_string(rank) + " did not connect within CARVE_EMU_HANG_S";
      }
      net->fds[p.rank] = fd;
    }
    ::close(listener);
  }
  startReaders(net);
  out = net;
  return "";
}

void release(ncclComm_t comm) {
  Net &net = *comm->net;
  if (--net.users > 0)
    return;
  Header bye{};
  bye.kind = kBye;
  for (int r = 0; r < net.size; ++r)
    if (r != net.rank && net.fds[r] >= 0) {
      deliver(net, r, bye, nullptr, 0);
      ::shutdown(net.fds[r], SHUT_WR);
    }
}

//===--- Operations ------------------------------------------------------------===//

void needDevice(const char *call, const void *p, size_t bytes) {
  if (bytes && !carve_emu::isDeviceMemory(p, bytes))
    carve_emu::fatalCall("%s: %p (%zu bytes) is not inside one device allocation", call, p, bytes);
}

struct Op {
  Kind kind;
  const void *send;
  void *recv;
  size_t count; // NCCL's count: per rank for all-gather and reduce-scatter
  ncclDataType_t type;
  ncclRedOp_t op;
  int root; // or the peer of a send or receive
  ncclComm_t comm;
  cudaStream_t stream;
};

std::string describe(uint32_t kind, uint64_t count, int type, int root) {
  std::string s = std::string(kindName(kind)) + "(" + std::to_string(count) + " x " +
                  typeName(static_cast<ncclDataType_t>(type));
  if (kind == kReduce || kind == kBroadcast)
    s += ", root " + std::to_string(root);
  return s + ")";
}

/// The ranks whose messages the completion of `o` needs.
std::vector<int> sources(const Op &o) {
  std::vector<int> v;
  const int me = o.comm->rank, n = o.comm->nranks;
  switch (o.kind) {
  case kAllReduce:
  case kAllGather:
  case kReduceScatter:
    for (int r = 0; r < n; ++r)
      if (r != me)
        v.push_back(r);
    break;
  case kReduce:
    if (me == o.root)
      for (int r = 0; r < n; ++r)
        if (r != me)
          v.push_back(r);
    break;
  case kBroadcast:
    if (me != o.root)
      v.push_back(o.root);
    break;
  case kRecv:
    v.push_back(o.root);
    break;
  default:
    break;
  }
  return v;
}

Header headerOf(const Op &o) {
  Header h{};
  h.comm = o.comm->id;
  h.kind = o.kind == kRecv ? kSend : o.kind; // a receive matches a send
  h.type = o.type;
  h.op = o.op;
  h.root = o.kind == kSend || o.kind == kRecv ? 0 : o.root;
  h.count = o.count;
  return h;
}

void post(const Op &o) {
  ncclComm_t c = o.comm;
  const int me = c->rank, n = c->nranks;
  const size_t bytes = o.count * typeBytes(o.type);
  const Header h = headerOf(o);
  auto to = [&](int r, const void *p, size_t b) {
    if (!deliver(*c->net, c->members[r], h, p, b) && c->asyncError == ncclSuccess) {
      std::lock_guard<std::mutex> lock(gMutex);
      c->lastError = describe(o.kind, o.count, o.type, o.root) + ": the connection to rank " +
                     std::to_string(r) + " of the communicator is gone (it ended or crashed)";
      gFault = c->lastError;
      c->asyncError = ncclRemoteError;
    }
  };
  const char *s = static_cast<const char *>(o.send);
  switch (o.kind) {
  case kAllReduce:
  case kAllGather:
    for (int r = 0; r < n; ++r)
      if (r != me)
        to(r, s, bytes);
    break;
  case kReduceScatter:
    for (int r = 0; r < n; ++r)
      if (r != me)
        to(r, s + r * bytes, bytes);
    break;
  case kReduce:
    if (me != o.root)
      to(o.root, s, bytes);
    break;
  case kBroadcast:
    if (me == o.root)
      for (int r = 0; r < n; ++r)
        if (r != me)
          to(r, s, bytes);
    break;
  case kSend:
    to(o.root, s, bytes);
    break;
  default:
    break;
  }
}

/// Whether every message `o` needs has arrived. A message of another call
/// at the head of a sender's queue ends the run; a needed rank that is gone
/// sets the communicator's error.
bool arrived(const Op &o) {
  ncclComm_t c = o.comm;
  const Header want = headerOf(o);
  std::lock_guard<std::mutex> lock(gMutex);
  bool all = true;
  for (int r : sources(o)) {
    const int src = c->members[r];
    auto it = gInbox.find(InboxKey{c->id, 0, c->net.get(), src});
    if (it == gInbox.end() || it->second.empty()) {
      all = false;
      if ((c->net->left[src] || c->net->closed[src]) && c->asyncError == ncclSuccess) {
        // Written once, before the error that other threads read is set.
        c->lastError = "rank " + std::to_string(r) + " of the communicator " +
                       (c->net->left[src] ? "destroyed it" : "ended or crashed") +
                       " before sending its part of " + describe(o.kind, o.count, o.type, o.root);
        gFault = c->lastError;
        c->asyncError = ncclRemoteError;
      }
      continue;
    }
    const Header &h = it->second.front().h;
    if (h.kind != want.kind || h.type != want.type || h.count != want.count ||
        h.root != want.root || h.op != want.op)
      carve_emu::fatalCall("rank %d of a communicator of %d calls %s; rank %d's matching call "
                           "(its next message to this rank) was %s: the ranks disagree",
                           c->rank, c->nranks, describe(o.kind, o.count, o.type, o.root).c_str(),
                           r, describe(h.kind, h.count, h.type, h.root).c_str());
  }
  return all;
}

Message take(ncclComm_t c, int r) {
  std::lock_guard<std::mutex> lock(gMutex);
  auto &q = gInbox[InboxKey{c->id, 0, c->net.get(), c->members[r]}];
  Message m = std::move(q.front());
  q.pop_front();
  return m;
}

template <class T> T reduce1(T a, T b, ncclRedOp_t op) {
  switch (op) {
  case ncclSum:
    return static_cast<T>(a + b);
  case ncclProd:
    return static_cast<T>(a * b);
  case ncclMax:
    return std::max(a, b);
  case ncclMin:
    return std::min(a, b);
  default:
    carve_emu::fatalCall("NCCL reduction %d is not one carve uses", static_cast<int>(op));
  }
}

template <class T> void reduceTyped(char *acc, const char *x, size_t n, ncclRedOp_t op) {
  for (size_t i = 0; i < n; ++i) {
    T a, b;
    std::memcpy(&a, acc + i * sizeof(T), sizeof(T));
    std::memcpy(&b, x + i * sizeof(T), sizeof(T));
    a = reduce1(a, b, op);
    std::memcpy(acc + i * sizeof(T), &a, sizeof(T));
  }
}

/// 16-bit types: each step in float, rounded to nearest even.
template <class T, class FromF, class ToF>
void reduce16(char *acc, const char *x, size_t n, ncclRedOp_t op, FromF from, ToF to) {
  for (size_t i = 0; i < n; ++i) {
    T a, b;
    std::memcpy(&a, acc + i * 2, 2);
    std::memcpy(&b, x + i * 2, 2);
    a = from(reduce1(to(a), to(b), op));
    std::memcpy(acc + i * 2, &a, 2);
  }
}

/// acc = acc op x, elementwise.
void reduceInto(char *acc, const char *x, size_t n, ncclDataType_t t, ncclRedOp_t op) {
  switch (t) {
  case ncclInt8:
    return reduceTyped<int8_t>(acc, x, n, op);
  case ncclUint8:
    return reduceTyped<uint8_t>(acc, x, n, op);
  case ncclInt32:
    return reduceTyped<int32_t>(acc, x, n, op);
  case ncclUint32:
    return reduceTyped<uint32_t>(acc, x, n, op);
  case ncclInt64:
    return reduceTyped<int64_t>(acc, x, n, op);
  case ncclUint64:
    return reduceTyped<uint64_t>(acc, x, n, op);
  case ncclFloat32:
    return reduceTyped<float>(acc, x, n, op);
  case ncclFloat64:
    return reduceTyped<double>(acc, x, n, op);
  case ncclFloat16:
    return reduce16<__half>(
        acc, x, n, op, [](float f) { return __float2half_rn(f); },
        [](__half h) { return __half2float(h); });
  case ncclBfloat16:
    return reduce16<__nv_bfloat16>(
        acc, x, n, op, [](float f) { return __float2bfloat16_rn(f); },
        [](__nv_bfloat16 h) { return __bfloat162float(h); });
  default:
    carve_emu::fatalCall("NCCL: data type %d is not one carve uses", static_cast<int>(t));
  }
}

/// Receives what `o` needs and writes its result.
void complete(const Op &o) {
  ncclComm_t c = o.comm;
  const int me = c->rank, n = c->nranks;
  const size_t bytes = o.count * typeBytes(o.type);
  const char *s = static_cast<const char *>(o.send);
  char *d = static_cast<char *>(o.recv);
  // Contributions in rank order, this rank's own read from its buffer.
  auto reduceFrom = [&](const char *mine) {
    std::vector<char> acc;
    for (int r = 0; r < n; ++r) {
      std::vector<char> x = r == me ? std::vector<char>(mine, mine + bytes) : take(c, r).data;
      if (r == 0)
        acc = std::move(x);
      else
        reduceInto(acc.data(), x.data(), o.count, o.type, o.op);
    }
    return acc;
  };
  switch (o.kind) {
  case kAllReduce: {
    std::vector<char> acc = reduceFrom(s);
    std::memcpy(d, acc.data(), bytes);
    break;
  }
  case kReduceScatter: {
    std::vector<char> acc = reduceFrom(s + me * bytes);
    std::memcpy(d, acc.data(), bytes);
    break;
  }
  case kReduce:
    if (me == o.root) {
      std::vector<char> acc = reduceFrom(s);
      std::memcpy(d, acc.data(), bytes);
    }
    break;
  case kAllGather: {
    std::memmove(d + me * bytes, s, bytes);
    for (int r = 0; r < n; ++r)
      if (r != me)
        std::memcpy(d + r * bytes, take(c, r).data.data(), bytes);
    break;
  }
  case kBroadcast:
    if (me == o.root) {
      if (d != s)
        std::memmove(d, s, bytes);
    } else {
      std::memcpy(d, take(c, o.root).data.data(), bytes);
    }
    break;
  case kRecv:
    std::memcpy(d, take(c, o.root).data.data(), bytes);
    break;
  default:
    break;
  }
}

/// The posts and completions of a group, or of one call outside a group.
thread_local int gGroupDepth = 0;
thread_local std::vector<Op> gGroup;

void enqueueOps(const std::vector<Op> &ops) {
  if (ops.empty())
    return;
  const cudaStream_t s = ops.front().stream;
  for (const Op &o : ops)
    if (o.stream != s)
      carve_emu::fatalCall("ncclGroupEnd: the group's operations are on different streams (the "
                           "emulation runs a group on one stream)");
  carve_emu::enqueue(s, [ops]() {
    for (const Op &o : ops) {
      post(o);
      if (o.kind != kSend) // a send has nothing to complete
        ++o.comm->pending;
    }
  });
  for (const Op &o : ops) {
    if (o.kind == kSend)
      continue;
    carve_emu::enqueueWork(
        s, carve_emu::Work{[o]() {
                             complete(o);
                             --o.comm->pending;
                           },
                           [o]() { return arrived(o); }, [o]() {
                             return describe(o.kind, o.count, o.type, o.root) +
                                    " on rank " + std::to_string(o.comm->rank) + " of " +
                                    std::to_string(o.comm->nranks) +
                                    " (messages from other ranks)";
                           }});
  }
}

ncclResult_t issue(const char *call, Op o, size_t sendBytes, size_t recvBytes) {
  if (!o.comm)
    return ncclInvalidArgument;
  const bool peerOp = o.kind == kSend || o.kind == kRecv;
  if (o.root < 0 || o.root >= o.comm->nranks) {
    o.comm->lastError = std::string(call) + ": " + (peerOp ? "peer " : "root ") +
                        std::to_string(o.root) + " is not a rank of a communicator of " +
                        std::to_string(o.comm->nranks);
    return ncclInvalidArgument;
  }
  if (o.kind != kRecv && !(o.kind == kBroadcast && o.comm->rank != o.root))
    needDevice(call, o.send, sendBytes);
  if (o.kind != kSend && !(o.kind == kReduce && o.comm->rank != o.root))
    needDevice(call, o.recv, recvBytes);
  if (gGroupDepth > 0)
    gGroup.push_back(o);
  else
    enqueueOps({o});
  return ncclSuccess;
}

} // namespace

namespace carve_emu {

void awaitMessages(std::chrono::milliseconds limit) {
  std::unique_lock<std::mutex> lock(gMutex);
  gArrived.wait_for(lock, limit);
}

std::string communicationFault() {
  std::lock_guard<std::mutex> lock(gMutex);
  return gFault;
}

} // namespace carve_emu

extern "C" {

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  std::memset(id, 0, sizeof *id);
  IdFields f{};
  std::memcpy(f.tag, kIdTag, sizeof kIdTag);
  const int fd = listenLocal(f.port);
  if (fd < 0) {
    gLastError = std::string("cannot listen on 127.0.0.1: ") + std::strerror(errno);
    return ncclSystemError;
  }
  std::random_device rd;
  f.nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
  idListeners()[f.nonce] = fd;
  std::memcpy(id->internal, &f, sizeof f);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config) {
  *comm = nullptr;
  IdFields f{};
  std::memcpy(&f, id.internal, sizeof f);
  if (std::memcmp(f.tag, kIdTag, sizeof kIdTag) != 0) {
    gLastError = "the unique id was not made by ncclGetUniqueId";
    return ncclInvalidArgument;
  }
  if (nranks < 1 || nranks > 256 || rank < 0 || rank >= nranks) {
    gLastError = "rank " + std::to_string(rank) + " of " + std::to_string(nranks) +
                 ": the emulation runs communicators of 1 to 256 ranks";
    return ncclInvalidArgument;
  }
  std::shared_ptr<Net> net;
  if (nranks == 1) {
    auto it = idListeners().find(f.nonce);
    if (it != idListeners().end()) {
      ::close(it->second);
      idListeners().erase(it);
    }
    net = makeNet(0, 1);
  } else {
    const std::string why = joinWorld(f, rank, nranks, net);
    if (!why.empty()) {
      gLastError = why;
      return ncclSystemError;
    }
  }
  auto *c = new ncclComm;
  c->net = net;
  c->id = mix(f.nonce, 0);
  c->rank = rank;
  c->nranks = nranks;
  for (int r = 0; r < nranks; ++r)
    c->members.push_back(r);
  c->nonBlocking = config && config->blocking == 0;
  ++net->users;
  *comm = c;
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *) {
  *newcomm = nullptr;
  if (!comm)
    return ncclInvalidArgument;
  // Every member's (color, key) over the control channel.
  const uint64_t round = comm->splits++;
  Header h{};
  h.comm = comm->id;
  h.channel = 1;
  h.kind = kSplit;
  h.count = round;
  const int32_t mine[2] = {color, key};
  for (int r = 0; r < comm->nranks; ++r)
    if (r != comm->rank && !deliver(*comm->net, comm->members[r], h, mine, sizeof mine)) {
      comm->lastError = "ncclCommSplit: rank " + std::to_string(r) + " is gone";
      return ncclRemoteError;
    }
  std::vector<std::pair<int, int>> all(static_cast<size_t>(comm->nranks)); // (color, key)
  all[comm->rank] = {color, key};
  for (int r = 0; r < comm->nranks; ++r) {
    if (r == comm->rank)
      continue;
    const InboxKey k{comm->id, 1, comm->net.get(), comm->members[r]};
    carve_emu::hostWaitUntil(
        [&] {
          std::lock_guard<std::mutex> lock(gMutex);
          auto it = gInbox.find(k);
          if (it != gInbox.end() && !it->second.empty())
            return true;
          if (comm->net->left[comm->members[r]] || comm->net->closed[comm->members[r]])
            carve_emu::fatalCall("ncclCommSplit: rank %d of the communicator is gone", r);
          return false;
        },
        "ncclCommSplit");
    Message m;
    {
      std::lock_guard<std::mutex> lock(gMutex);
      auto &q = gInbox[k];
      m = std::move(q.front());
      q.pop_front();
    }
    if (m.h.kind != kSplit || m.h.count != round)
      carve_emu::fatalCall("ncclCommSplit on rank %d: rank %d's matching call was not a split",
                           comm->rank, r);
    int32_t theirs[2];
    std::memcpy(theirs, m.data.data(), sizeof theirs);
    all[r] = {theirs[0], theirs[1]};
  }
  if (color == NCCL_SPLIT_NOCOLOR)
    return ncclSuccess;
  std::vector<std::tuple<int, int>> group; // (key, parent rank)
  for (int r = 0; r < comm->nranks; ++r)
    if (all[r].first == color)
      group.emplace_back(all[r].second, r);
  std::sort(group.begin(), group.end());
  auto *c = new ncclComm;
  c->net = comm->net;
  c->id = mix(mix(comm->id, round + 1), static_cast<uint64_t>(color));
  c->nranks = static_cast<int>(group.size());
  for (size_t i = 0; i < group.size(); ++i) {
    const int parentRank = std::get<1>(group[i]);
    if (parentRank == comm->rank)
      c->rank = static_cast<int>(i);
    c->members.push_back(comm->members[parentRank]);
  }
  ++c->net->users;
  c->nonBlocking = comm->nonBlocking;
  if (comm->nonBlocking) {
    std::lock_guard<std::mutex> lock(comm->splitMutex);
    if (comm->splitTo)
      carve_emu::fatalCall("ncclCommSplit on rank %d: a split of this communicator is still in "
                           "progress (poll ncclCommGetAsyncError until it completes)",
                           comm->rank);
    comm->splitTo = newcomm;
    comm->splitResult = c;
    comm->asyncError = ncclInProgress;
    return ncclInProgress;
  }
  *newcomm = c;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  *count = comm->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  if (!comm)
    return ncclInvalidArgument;
  std::lock_guard<std::mutex> lock(comm->splitMutex);
  if (comm->splitTo) {
    // The split completes: the new communicator appears where the caller
    // asked for it, and the parent is ready again.
    *comm->splitTo = comm->splitResult;
    comm->splitTo = nullptr;
    comm->splitResult = nullptr;
    if (comm->asyncError == ncclInProgress)
      comm->asyncError = ncclSuccess;
    *asyncError = ncclInProgress;
    return ncclSuccess;
  }
  *asyncError = static_cast<ncclResult_t>(comm->asyncError.load());
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (!comm)
    return ncclInvalidArgument;
  // Messages sent to this rank on this communicator that no call received.
  // NCCL's finalize completes the communicator's outstanding operations.
  carve_emu::hostWaitUntil([comm] { return comm->pending == 0; }, "ncclCommFinalize");
  std::lock_guard<std::mutex> lock(gMutex);
  for (int r = 0; r < comm->nranks; ++r) {
    auto it = gInbox.find(InboxKey{comm->id, 0, comm->net.get(), comm->members[r]});
    if (it != gInbox.end() && !it->second.empty()) {
      const Header &h = it->second.front().h;
      carve_emu::fatalCall("ncclCommFinalize on rank %d of %d: %zu message(s) from rank %d were "
                           "never received, the first from %s",
                           comm->rank, comm->nranks, it->second.size(), r,
                           describe(h.kind, h.count, h.type, h.root).c_str());
    }
  }
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm) {
    release(comm);
    delete comm;
  }
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) { return ncclCommDestroy(comm); }

const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
  case ncclSuccess:
    return "no error";
  case ncclSystemError:
    return "system error (the CPU emulation's start-up failed)";
  case ncclInvalidUsage:
    return "invalid usage";
  case ncclInvalidArgument:
    return "invalid argument";
  case ncclRemoteError:
    return "remote process exited or there was a network error";
  default:
    return "an NCCL error of the CPU emulation";
  }
}

const char *ncclGetLastError(ncclComm_t comm) {
  return comm ? comm->lastError.c_str() : gLastError.c_str();
}

ncclResult_t ncclGroupStart() {
  ++gGroupDepth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (gGroupDepth == 0)
    return ncclInvalidUsage;
  if (--gGroupDepth == 0) {
    std::vector<Op> ops;
    ops.swap(gGroup);
    enqueueOps(ops);
  }
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t s) {
  const size_t b = count * typeBytes(t);
  return issue("ncclAllReduce", Op{kAllReduce, send, recv, count, t, op, 0, comm, s}, b, b);
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t,
                           ncclComm_t comm, cudaStream_t s) {
  const size_t b = count * typeBytes(t);
  return issue("ncclAllGather", Op{kAllGather, send, recv, count, t, ncclSum, 0, comm, s}, b,
               comm ? b * comm->nranks : 0);
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t t,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t s) {
  const size_t b = count * typeBytes(t);
  return issue("ncclReduceScatter", Op{kReduceScatter, send, recv, count, t, op, 0, comm, s},
               comm ? b * comm->nranks : 0, b);
}

ncclResult_t ncclReduce(const void *send, void *recv, size_t count, ncclDataType_t t,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t s) {
  const size_t b = count * typeBytes(t);
  return issue("ncclReduce", Op{kReduce, send, recv, count, t, op, root, comm, s}, b, b);
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t t, int root,
                           ncclComm_t comm, cudaStream_t s) {
  const size_t b = count * typeBytes(t);
  return issue("ncclBroadcast", Op{kBroadcast, send, recv, count, t, ncclSum, root, comm, s}, b,
               b);
}

ncclResult_t ncclSend(const void *send, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t s) {
  const size_t b = count * typeBytes(t);
  return issue("ncclSend", Op{kSend, send, nullptr, count, t, ncclSum, peer, comm, s}, b, 0);
}

ncclResult_t ncclRecv(void *recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t s) {
  const size_t b = count * typeBytes(t);
  return issue("ncclRecv", Op{kRecv, nullptr, recv, count, t, ncclSum, peer, comm, s}, 0, b);
}

} // extern "C"
