//===- TcpTest.cpp - one rank of the TCP world's test (run_tcp.py) --------===//
//
// run_tcp.py starts this binary as every rank of a job, with RANK,
// WORLD_SIZE, MASTER_ADDR and MASTER_PORT set as a plain launcher would, and
// checks exit codes and messages. The mode (argv[1]) says what the rank does:
//
//   all       every collective, split and point-to-point message against
//             answers computed here from the inputs' formulas; exit 0
//   die       a barrier, then the last rank kills itself and the others start
//             an all-reduce: they must fail with one line and a non-zero exit
//   die-p2p   the same with a receive from the killed rank
//   stall     the last rank sleeps instead: the others time out
//   init      only makeEnvWorld: prints the world or its error
//
// CARVE_TEST_TIMEOUT sets the collective timeout (seconds).
//
//===----------------------------------------------------------------------===//

#include "carve/rt/comm.h"
#include "carve/rt/elementwise.h"

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

using namespace carve::rt;

namespace {

int worldRank = -1;
int checks = 0;
int failures = 0;

void check(bool ok, const std::string &what) {
  ++checks;
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "rank %d: FAILED: %s\n", worldRank, what.c_str());
  }
}

template <class T> bool equal(const std::vector<T> &got, const std::vector<T> &want) {
  return got == want;
}

std::string where(const Communicator &c, const char *what) {
  return std::string(what) + " over " + c.name() + " (rank " + std::to_string(c.rank()) + " of " +
         std::to_string(c.size()) + ")";
}

void checkCollectives(Communicator &c) {
  const int n = c.size(), me = c.rank();

  // All-reduce, every type and both operations.
  {
    std::vector<float> f(5), want(5);
    for (int i = 0; i < 5; ++i) {
      f[i] = static_cast<float>(me + 1 + i);
      want[i] = static_cast<float>(n * (n + 1) / 2 + n * i);
    }
    c.allReduce(f.data(), 5, CommType::F32, ReduceOp::Sum);
    check(equal(f, want), where(c, "all-reduce f32 sum"));

    std::vector<double> d{static_cast<double>(me), -static_cast<double>(me), 0.5};
    c.allReduce(d.data(), 3, CommType::F64, ReduceOp::Max);
    check(equal(d, std::vector<double>{double(n - 1), 0.0, 0.5}), where(c, "all-reduce f64 max"));

    std::vector<int64_t> l{int64_t(1) << 40, me};
    c.allReduce(l.data(), 2, CommType::I64, ReduceOp::Sum);
    check(equal(l, std::vector<int64_t>{n * (int64_t(1) << 40), int64_t(n) * (n - 1) / 2}),
          where(c, "all-reduce i64 sum"));

    std::vector<int32_t> i32{-me, 7};
    c.allReduce(i32.data(), 2, CommType::I32, ReduceOp::Max);
    check(equal(i32, std::vector<int32_t>{0, 7}), where(c, "all-reduce i32 max"));

    std::vector<uint8_t> u8{1, static_cast<uint8_t>(me)};
    c.allReduce(u8.data(), 2, CommType::U8, ReduceOp::Sum);
    check(equal(u8, std::vector<uint8_t>{uint8_t(n), uint8_t(n * (n - 1) / 2)}),
          where(c, "all-reduce u8 sum"));

    // 16-bit floats summed as floats (exact partial sums: any order agrees),
    // and rounded per step in rank order: 1 + 2^-8 (rank 1's) is a tie that
    // rounds to 1 (even), and each later rank's 2^-8 again, where the exact
    // sum would be 1 + (n - 1) 2^-8.
    for (bool f16 : {false, true}) {
      const CommType t = f16 ? CommType::F16 : CommType::BF16;
      auto bits = [&](float x) { return f16 ? ew::f16Bits(x) : ew::bf16Bits(x); };
      auto value = [&](uint16_t h) { return f16 ? ew::f16Float(h) : ew::bf16Float(h); };
      const float tie = f16 ? 1.0f / 2048 : 1.0f / 256; // half an ulp of 1
      std::vector<uint16_t> h{bits(1.5f * (me + 1)), bits(me == 0 ? 1.0f : tie)};
      c.allReduce(h.data(), 2, t, ReduceOp::Sum);
      check(value(h[0]) == 1.5f * n * (n + 1) / 2 && value(h[1]) == 1.0f,
            where(c, f16 ? "all-reduce f16 sum, rounded in rank order"
                         : "all-reduce bf16 sum, rounded in rank order"));
    }

    CommHandle h = c.allReduceAsync(nullptr, 0, CommType::F32, ReduceOp::Sum);
    check(h.id < 0, where(c, "an empty all-reduce is complete at once"));
  }

  // Two all-reduces in flight, waited for in the opposite order.
  {
    double a = me, b = 10.0 * me;
    CommHandle ha = c.allReduceAsync(&a, 1, CommType::F64, ReduceOp::Sum);
    CommHandle hb = c.allReduceAsync(&b, 1, CommType::F64, ReduceOp::Sum);
    c.wait(hb);
    c.wait(ha);
    const double s = n * (n - 1) / 2.0;
    check(a == s && b == 10 * s, where(c, "two all-reduces in flight, waited in reverse"));
  }

  // All-gather, out of place and in place.
  {
    std::vector<int32_t> send{me, 100 + me}, recv(2 * n, -1), want(2 * n);
    for (int r = 0; r < n; ++r) {
      want[2 * r] = r;
      want[2 * r + 1] = 100 + r;
    }
    c.allGather(send.data(), recv.data(), 2, CommType::I32);
    check(equal(recv, want), where(c, "all-gather"));
    std::vector<int32_t> inPlace(2 * n, -1);
    inPlace[2 * me] = me;
    inPlace[2 * me + 1] = 100 + me;
    c.allGather(inPlace.data() + 2 * me, inPlace.data(), 2, CommType::I32);
    check(equal(inPlace, want), where(c, "all-gather in place"));
  }

  // Reduce-scatter with equal counts, then with unequal ones (a zero among them).
  for (int unequal = 0; unequal < 2; ++unequal) {
    std::vector<int64_t> counts(n);
    int64_t total = 0;
    for (int r = 0; r < n; ++r) {
      counts[r] = unequal ? (r == 1 ? 0 : r + 2) : 3;
      total += counts[r];
    }
    std::vector<float> send(total), recv(counts[me], -1), want(counts[me]);
    for (int64_t j = 0; j < total; ++j)
      send[j] = static_cast<float>(me * 100 + j);
    int64_t begin = 0;
    for (int r = 0; r < me; ++r)
      begin += counts[r];
    for (int64_t j = 0; j < counts[me]; ++j)
      want[j] = static_cast<float>(100 * n * (n - 1) / 2 + n * (begin + j));
    c.reduceScatter(send.data(), recv.data(), counts.data(), CommType::F32, ReduceOp::Sum);
    check(equal(recv, want),
          where(c, unequal ? "reduce-scatter, unequal counts" : "reduce-scatter, equal counts"));
  }

  // All-to-all.
  {
    std::vector<int64_t> send(3 * n), recv(3 * n, -1), want(3 * n);
    for (int r = 0; r < n; ++r)
      for (int k = 0; k < 3; ++k) {
        send[3 * r + k] = me * 1000 + r * 10 + k;
        want[3 * r + k] = r * 1000 + me * 10 + k;
      }
    c.allToAll(send.data(), recv.data(), 3, CommType::I64);
    check(equal(recv, want), where(c, "all-to-all"));
  }

  // Broadcast from the last rank, and a barrier.
  {
    char text[8] = "no";
    if (me == n - 1)
      std::strcpy(text, "root");
    c.broadcast(text, sizeof text, n - 1);
    check(std::strcmp(text, "root") == 0, where(c, "broadcast"));
    c.barrier();
  }

  // Point-to-point around the ring: order per tag, receives posted in
  // another order than the sends, and a message to itself.
  {
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    int a = 1000 + me, b = 2000 + me, z = 3000 + me;
    c.send(&a, sizeof a, next, 5);
    c.send(&b, sizeof b, next, 5);
    c.send(&z, sizeof z, next, 7);
    int ra = -1, rb = -1, rz = -1;
    CommHandle hz = c.recvAsync(&rz, sizeof rz, prev, 7);
    CommHandle ha = c.recvAsync(&ra, sizeof ra, prev, 5);
    CommHandle hb = c.recvAsync(&rb, sizeof rb, prev, 5);
    c.wait(hb);
    c.wait(hz);
    c.wait(ha);
    check(ra == 1000 + prev && rb == 2000 + prev && rz == 3000 + prev,
          where(c, "send/receive around the ring"));
    double self = 2.5, back = 0;
    CommHandle hr = c.recvAsync(&back, sizeof back, me, 9);
    c.send(&self, sizeof self, me, 9);
    c.wait(hr);
    check(back == 2.5, where(c, "send to itself"));
  }
}

double envTimeout() {
  const char *t = std::getenv("CARVE_TEST_TIMEOUT");
  return t ? std::atof(t) : 20;
}

} // namespace

int main(int argc, char **argv) {
  const std::string mode = argc > 1 ? argv[1] : "all";
  setCollectiveTimeout(envTimeout());
  std::string error;
  std::unique_ptr<Communicator> world = makeEnvWorld(error);
  if (mode == "init") {
    if (world) {
      std::printf("world: rank %d of %d\n", world->rank(), world->size());
      return 0;
    }
    if (error.empty()) {
      std::printf("world: none\n");
      return 3;
    }
    std::printf("world: error: %s\n", error.c_str());
    return 2;
  }
  if (!world) {
    std::fprintf(stderr, "carve: error: %s\n", error.empty() ? "RANK is not set" : error.c_str());
    return 2;
  }
  worldRank = world->rank();
  const int n = world->size();
  setCommStep(0);

  if (mode == "all") {
    checkCollectives(*world);
    // Odd and even ranks, each group in reverse rank order (keys descend).
    std::unique_ptr<Communicator> sub = world->split(worldRank % 2, -worldRank);
    sub->setName("parity");
    std::vector<int> want;
    for (int r = n - 1; r >= 0; --r)
      if (r % 2 == worldRank % 2)
        want.push_back(r);
    check(sub->worldRanks() == want, "split: members in key order");
    check(sub->size() == static_cast<int>(want.size()) && want[sub->rank()] == worldRank,
          "split: this rank's place");
    checkCollectives(*sub);
    std::unique_ptr<Communicator> again = sub->split(0, 0);
    again->setName("parity2");
    check(again->worldRanks() == sub->worldRanks(), "split of a split, one color");
    checkCollectives(*again);
    // The world still works after the splits, with messages of every group
    // interleaved.
    checkCollectives(*world);
    world->barrier();
    std::printf("rank %d: %d checks, %d failed\n", worldRank, checks, failures);
    return failures == 0 ? 0 : 1;
  }

  world->barrier();
  if (mode == "die" || mode == "die-p2p" || mode == "stall") {
    if (worldRank == n - 1) {
      if (mode == "stall")
        std::this_thread::sleep_for(std::chrono::seconds(120));
      std::raise(SIGKILL);
    }
    setCommStep(7);
    if (mode == "die-p2p") {
      int x = 0;
      world->recv(&x, sizeof x, n - 1, 3);
    } else {
      float x = 1;
      world->allReduce(&x, 1, CommType::F32, ReduceOp::Sum);
    }
    std::printf("rank %d: the operation completed although a rank is gone\n", worldRank);
    return 0;
  }
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}
