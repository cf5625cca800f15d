//===- comm_nccl_ranks_test.cu - the NCCL communicator on 2 or 4 GPUs -----===//
//
// comm_nccl.cpp across ranks, one process and one GPU per rank, started as
// a plain launcher starts them: `carve-gpu-comm_nccl_ranks_test --ranks N`
// forks N children, each of which executes this binary again with `--child`
// and RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
// MASTER_PORT set; each opens GPU LOCAL_RANK (kCudaTarget.open), joins the
// TCP world (makeEnvWorld) and starts NCCL over it. The parent passes when
// every rank exits 0 within 600 s, names each rank that failed or did not
// finish, and exits 77 (ctest: skipped) saying so when there are fewer than
// N GPUs.
//
// Every rank's inputs are a function of its rank, so every rank knows every
// answer: all-reduce of each element type (sums of small integers, exact in
// 16-bit floats too; max), several in flight waited for out of order, host
// scalars staged; all-gather out of place, in place and from host memory;
// reduce-scatter with equal and unequal counts (one of them 0); all-to-all;
// point-to-point messages around a ring, between pairs of ranks with two
// tags, and to the rank itself; broadcast from every root; a barrier that
// no rank leaves before the last one entered; splits (by parity, and for 4
// ranks by pairs with the order reversed by the key) with their own
// collectives; and an all-reduce of non-integer floats whose result must be
// bitwise equal on every rank. All of it on a non-blocking and on a
// blocking (CARVE_NCCL_BLOCKING=1) communicator. And gpu::graphStep where
// one rank cannot capture the step: every rank runs it eagerly instead.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/comm.h"
#include "carve/rt/gpu.h"
#include "harness.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <arpa/inet.h>
#include <csignal>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

extern char **environ;

namespace g = carve::gpu;
using carve::rt::CommType;
using carve::rt::Communicator;
using carve::rt::ReduceOp;
using gputest::checks;
using gputest::failures;

namespace {

constexpr const char *kBinary = "carve-gpu-comm_nccl_ranks_test";
/// Seconds the parent waits for all ranks; a rank's own waits are bounded by
/// kCollectiveTimeout, so a dead peer ends the others long before.
constexpr int kTotalTimeout = 600;
constexpr double kCollectiveTimeout = 120;

int worldRank = 0; // this child's, for messages

cudaStream_t compute() { return static_cast<cudaStream_t>(g::computeStream()); }

void expect(bool ok, const std::string &what) {
  ++checks();
  if (!ok) {
    ++failures();
    std::printf("FAIL rank %d: %s\n", worldRank, what.c_str());
  }
}

/// Device buffers written and read on the compute stream (harness.h).
template <class T> T *deviceCopy(const std::vector<T> &h) {
  return gputest::deviceCopy(h, compute());
}
template <class T> std::vector<T> readBack(const T *p, size_t n) {
  return gputest::readBack(p, n, compute());
}

template <class T> double num(T v) { return static_cast<double>(v); }
double num(__nv_bfloat16 v) { return __bfloat162float(v); }
double num(__half v) { return __half2float(v); }

/// `v` as a T; every value the checks convert is exact in T.
template <class T> T as(double v) { return static_cast<T>(v); }
template <> __nv_bfloat16 as<__nv_bfloat16>(double v) {
  return __float2bfloat16(static_cast<float>(v));
}
template <> __half as<__half>(double v) { return __float2half(static_cast<float>(v)); }

/// Bitwise comparison; a failure names the first wrong element and how many.
template <class T>
void expectSame(const std::vector<T> &got, const std::vector<T> &want, const std::string &what) {
  if (got.size() != want.size()) {
    expect(false, what + ": " + std::to_string(got.size()) + " elements, expected " +
                      std::to_string(want.size()));
    return;
  }
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && bad++ == 0)
      first = i;
  char detail[160] = "";
  if (bad)
    std::snprintf(detail, sizeof detail,
                  ": %zu of %zu elements wrong, first [%zu] = %.17g, expected %.17g", bad,
                  got.size(), first, num(got[first]), num(want[first]));
  expect(bad == 0, what + detail);
}

/// Element i of rank q's input is f(q, i); the answer is their sum or max
/// over the group's ranks, computed in double (exact for every case here).
template <class F> double reduced(int ranks, ReduceOp op, int64_t i, F f) {
  double acc = f(0, i);
  for (int q = 1; q < ranks; ++q)
    acc = op == ReduceOp::Sum ? acc + f(q, i) : std::max(acc, f(q, i));
  return acc;
}

/// An all-reduce of `len` elements of T in device memory.
template <class T, class F>
void allReduceCase(Communicator &c, CommType t, ReduceOp op, int64_t len, F f,
                   const std::string &what) {
  std::vector<T> in(len), want(len);
  for (int64_t i = 0; i < len; ++i) {
    in[i] = as<T>(f(c.rank(), i));
    want[i] = as<T>(reduced(c.size(), op, i, f));
  }
  T *d = deviceCopy(in);
  c.allReduce(d, len, t, op);
  expectSame(readBack(d, len), want, what);
  cudaFree(d);
}

//===--- All-reduce --------------------------------------------------------===//

void checkAllReduce(Communicator &c, const std::string &label) {
  const int n = c.size(), r = c.rank();
  allReduceCase<float>(
      c, CommType::F32, ReduceOp::Sum, 1000, [](int q, int64_t i) { return i % 50 + q + 1.0; },
      label + ": all-reduce f32 sum");
  allReduceCase<float>(
      c, CommType::F32, ReduceOp::Max, 1000,
      [n](int q, int64_t i) { return ((i + q) % n) * 0.5 - 3.0 * (i % 3); },
      label + ": all-reduce f32 max");
  allReduceCase<double>(
      c, CommType::F64, ReduceOp::Sum, 1000, [](int q, int64_t i) { return 0.5 * (i % 9) + q; },
      label + ": all-reduce f64 sum");
  // Half of them negative, and the maximum from a different rank for each i.
  allReduceCase<int64_t>(
      c, CommType::I64, ReduceOp::Max, 1000,
      [n](int q, int64_t i) {
        return (i % 2 ? -1.0 : 1.0) * double(int64_t(1) << 40) + 1000.0 * ((i + q) % n) + i;
      },
      label + ": all-reduce i64 max");
  allReduceCase<int32_t>(
      c, CommType::I32, ReduceOp::Sum, 1000, [](int q, int64_t i) { return i % 7 - 3.0 + 10 * q; },
      label + ": all-reduce i32 sum");
  allReduceCase<uint8_t>(
      c, CommType::U8, ReduceOp::Sum, 1000, [](int q, int64_t i) { return double(i % 20 + q); },
      label + ": all-reduce u8 sum");
  allReduceCase<__nv_bfloat16>(
      c, CommType::BF16, ReduceOp::Sum, 1000, [](int q, int64_t i) { return i % 8 - 4.0 + q; },
      label + ": all-reduce bf16 sum");
  allReduceCase<__nv_bfloat16>(
      c, CommType::BF16, ReduceOp::Max, 1000, [n](int q, int64_t i) { return (i + q) % n - 2.5; },
      label + ": all-reduce bf16 max");
  allReduceCase<__half>(
      c, CommType::F16, ReduceOp::Sum, 1000, [](int q, int64_t i) { return 0.25 * (i % 16) + q; },
      label + ": all-reduce f16 sum");
  // Several chunks and channels: 16 MiB.
  allReduceCase<float>(
      c, CommType::F32, ReduceOp::Sum, int64_t(1) << 22,
      [](int q, int64_t i) { return double(i % 64 + q); }, label + ": all-reduce of 2^22 f32");

  // Three in flight, waited for out of order.
  {
    const int64_t len = 500;
    auto fa = [](int q, int64_t i) { return double(i % 11 + q); };
    auto fb = [n](int q, int64_t i) { return double((i + q) % n - 7); };
    auto fc = [](int q, int64_t i) { return 0.125 * i + q; };
    std::vector<float> a(len), wa(len);
    std::vector<int32_t> b(len), wb(len);
    std::vector<double> h(len), wc(len);
    for (int64_t i = 0; i < len; ++i) {
      a[i] = as<float>(fa(r, i));
      wa[i] = as<float>(reduced(n, ReduceOp::Sum, i, fa));
      b[i] = as<int32_t>(fb(r, i));
      wb[i] = as<int32_t>(reduced(n, ReduceOp::Max, i, fb));
      h[i] = fc(r, i);
      wc[i] = reduced(n, ReduceOp::Sum, i, fc);
    }
    float *da = deviceCopy(a);
    int32_t *db = deviceCopy(b);
    double *dc = deviceCopy(h);
    auto ha = c.allReduceAsync(da, len, CommType::F32, ReduceOp::Sum);
    auto hb = c.allReduceAsync(db, len, CommType::I32, ReduceOp::Max);
    auto hc = c.allReduceAsync(dc, len, CommType::F64, ReduceOp::Sum);
    c.wait(hc);
    c.wait(ha);
    c.wait(hb);
    expectSame(readBack(da, len), wa, label + ": async all-reduce 1 of 3 (f32 sum), waited 2nd");
    expectSame(readBack(db, len), wb, label + ": async all-reduce 2 of 3 (i32 max), waited 3rd");
    expectSame(readBack(dc, len), wc, label + ": async all-reduce 3 of 3 (f64 sum), waited 1st");
    cudaFree(da);
    cudaFree(db);
    cudaFree(dc);
  }

  // Host scalars (the loss, the norm's partial sums) are staged; several in
  // flight, and a host array larger than the staging buffers.
  {
    double loss = 1.5 * (r + 1), norm[2] = {double(r), -2.0 * r};
    float f = 0.25f * r;
    auto h1 = c.allReduceAsync(&loss, 1, CommType::F64, ReduceOp::Sum);
    auto h2 = c.allReduceAsync(norm, 2, CommType::F64, ReduceOp::Sum);
    auto h3 = c.allReduceAsync(&f, 1, CommType::F32, ReduceOp::Max);
    c.wait(h3);
    c.wait(h1);
    c.wait(h2);
    const double ranks = n * (n - 1) / 2.0;
    expect(loss == 1.5 * (ranks + n) && norm[0] == ranks && norm[1] == -2.0 * ranks &&
               f == 0.25f * (n - 1),
           label + ": all-reduce of host scalars: loss " + std::to_string(loss) + ", norm " +
               std::to_string(norm[0]) + " " + std::to_string(norm[1]) + ", max " +
               std::to_string(f));
    const int64_t len = 100000;
    auto fh = [](int q, int64_t i) { return double(i % 100 + q); };
    std::vector<float> big(len), want(len);
    for (int64_t i = 0; i < len; ++i) {
      big[i] = as<float>(fh(r, i));
      want[i] = as<float>(reduced(n, ReduceOp::Sum, i, fh));
    }
    c.allReduce(big.data(), len, CommType::F32, ReduceOp::Sum);
    expectSame(big, want, label + ": all-reduce of a host array larger than the staging buffers");
  }

  {
    float *d = nullptr;
    GT_CUDA(cudaMalloc(&d, 16));
    expect(c.allReduceAsync(d, 0, CommType::F32, ReduceOp::Sum).id < 0 &&
               c.allGatherAsync(d, d, 0, CommType::F32).id < 0 &&
               c.sendAsync(d, 0, (r + 1) % n, 0).id < 0,
           label + ": empty operations are complete at once");
    cudaFree(d);
  }
}

//===--- All-gather, reduce-scatter, all-to-all ----------------------------===//

void checkAllGather(Communicator &c, const std::string &label) {
  const int n = c.size(), r = c.rank();
  const int64_t per = 64;
  std::vector<float> mine(per), want(per * n), poisoned(per * n, -1.0f);
  for (int q = 0; q < n; ++q)
    for (int64_t i = 0; i < per; ++i)
      want[q * per + i] = float(100 * q + i);
  std::copy(want.begin() + r * per, want.begin() + (r + 1) * per, mine.begin());

  float *ds = deviceCopy(mine), *dr = deviceCopy(poisoned);
  c.allGather(ds, dr, per, CommType::F32);
  expectSame(readBack(dr, per * n), want, label + ": all-gather on the device");
  std::vector<float> own = poisoned;
  std::copy(mine.begin(), mine.end(), own.begin() + r * per);
  float *dp = deviceCopy(own);
  c.allGather(dp + r * per, dp, per, CommType::F32);
  expectSame(readBack(dp, per * n), want, label + ": all-gather in place on the device");
  cudaFree(ds);
  cudaFree(dr);
  cudaFree(dp);

  std::vector<int64_t> hs(3), hr(3 * n, -1), hwant(3 * n);
  for (int q = 0; q < n; ++q)
    for (int i = 0; i < 3; ++i)
      hwant[3 * q + i] = (int64_t(q) << 33) + i;
  std::copy(hwant.begin() + 3 * r, hwant.begin() + 3 * r + 3, hs.begin());
  c.allGather(hs.data(), hr.data(), 3, CommType::I64);
  expectSame(hr, hwant, label + ": all-gather of host memory");
  std::vector<int64_t> hp(3 * n, -1);
  std::copy(hs.begin(), hs.end(), hp.begin() + 3 * r);
  c.allGather(hp.data() + 3 * r, hp.data(), 3, CommType::I64);
  expectSame(hp, hwant, label + ": all-gather in place of host memory");

  // 16-bit floats are moved as they are.
  std::vector<__nv_bfloat16> bmine(per), bwant(per * n);
  for (int q = 0; q < n; ++q)
    for (int64_t i = 0; i < per; ++i)
      bwant[q * per + i] = as<__nv_bfloat16>(0.5 * i - q);
  std::copy(bwant.begin() + r * per, bwant.begin() + (r + 1) * per, bmine.begin());
  __nv_bfloat16 *bs = deviceCopy(bmine), *br = deviceCopy(bwant);
  GT_CUDA(cudaMemsetAsync(br, 0xFF, per * n * sizeof(__nv_bfloat16), compute()));
  c.allGather(bs, br, per, CommType::BF16);
  expectSame(readBack(br, per * n), bwant, label + ": all-gather of bf16");
  cudaFree(bs);
  cudaFree(br);
}

/// A reduce-scatter with `counts`, rank q's send element j being f(q, j);
/// the receive buffer has one element more than this rank's count, which
/// must keep its sentinel (as must the whole buffer of a rank with count 0).
template <class T, class F>
void reduceScatterCase(Communicator &c, CommType t, ReduceOp op, const std::vector<int64_t> &counts,
                       bool onHost, F f, const std::string &what) {
  const int r = c.rank();
  int64_t total = 0, offset = 0;
  for (int q = 0; q < c.size(); ++q) {
    if (q == r)
      offset = total;
    total += counts[q];
  }
  const T sentinel = as<T>(-7);
  std::vector<T> send(total), want(counts[r] + 1, sentinel);
  for (int64_t j = 0; j < total; ++j)
    send[j] = as<T>(f(r, j));
  for (int64_t k = 0; k < counts[r]; ++k)
    want[k] = as<T>(reduced(c.size(), op, offset + k, f));
  std::vector<T> recv(counts[r] + 1, sentinel);
  if (onHost) {
    c.reduceScatter(send.data(), recv.data(), counts.data(), t, op);
  } else {
    T *ds = deviceCopy(send), *dr = deviceCopy(recv);
    c.reduceScatter(ds, dr, counts.data(), t, op);
    recv = readBack(dr, recv.size());
    cudaFree(ds);
    cudaFree(dr);
  }
  expectSame(recv, want, what);
}

void checkReduceScatter(Communicator &c, const std::string &label) {
  const int n = c.size();
  auto f = [](int q, int64_t j) { return double(j % 13 + q); };
  const std::vector<int64_t> equal(n, 40);
  // Each rank's count different, rank 1's 0: {3, 0} or {3, 0, 7, 9}.
  std::vector<int64_t> unequal(n);
  for (int q = 0; q < n; ++q)
    unequal[q] = q == 1 ? 0 : 2 * q + 3;
  reduceScatterCase<float>(c, CommType::F32, ReduceOp::Sum, equal, false, f,
                           label + ": reduce-scatter, equal counts");
  reduceScatterCase<float>(c, CommType::F32, ReduceOp::Sum, equal, true, f,
                           label + ": reduce-scatter of host memory, equal counts");
  reduceScatterCase<float>(c, CommType::F32, ReduceOp::Sum, unequal, false, f,
                           label + ": reduce-scatter, unequal counts");
  reduceScatterCase<double>(c, CommType::F64, ReduceOp::Sum, unequal, true, f,
                            label + ": reduce-scatter of host memory, unequal counts");
  reduceScatterCase<int32_t>(
      c, CommType::I32, ReduceOp::Max, equal, false,
      [](int q, int64_t j) { return double((j * 7 + q * 3) % 11 - 5); },
      label + ": reduce-scatter i32 max");
}

void checkAllToAll(Communicator &c, const std::string &label) {
  const int n = c.size(), r = c.rank();
  const int64_t per = 5;
  // Block p of rank q's send is 1000 q + 10 p + i; rank r receives block r
  // of every rank q as its block q.
  std::vector<float> send(per * n), want(per * n), poisoned(per * n, -1.0f);
  for (int p = 0; p < n; ++p)
    for (int64_t i = 0; i < per; ++i) {
      send[p * per + i] = float(1000 * r + 10 * p + i);
      want[p * per + i] = float(1000 * p + 10 * r + i);
    }
  float *ds = deviceCopy(send), *dr = deviceCopy(poisoned);
  c.allToAll(ds, dr, per, CommType::F32);
  expectSame(readBack(dr, per * n), want, label + ": all-to-all on the device");
  cudaFree(ds);
  cudaFree(dr);
  std::vector<int32_t> hs(send.begin(), send.end()), hr(per * n, -1),
      hwant(want.begin(), want.end());
  c.allToAll(hs.data(), hr.data(), per, CommType::I32);
  expectSame(hr, hwant, label + ": all-to-all of host memory");
}

//===--- Point-to-point ----------------------------------------------------===//

/// Each rank sends 1000 w + i (w: its world rank; `members` are the
/// group's) to the next group rank and receives from the previous one. NCCL
/// has no tags, and a group runs its operations on one stream in the order
/// they were posted: a receive holds up everything after it until the
/// peer's send runs, so a ring in which every rank posts its receive first
/// never completes (comm_nccl.cpp's rule, the same order on both sides of
/// each pair, is not enough). Odd ranks post the receive first, even ranks
/// the send.
void checkRing(Communicator &c, const std::vector<int> &members, const std::string &label) {
  const int n = c.size(), r = c.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  const int64_t len = 256, bytes = len * sizeof(int32_t);
  std::vector<int32_t> out(len), want(len), poisoned(len, -1);
  for (int64_t i = 0; i < len; ++i) {
    out[i] = int32_t(1000 * members[r] + i);
    want[i] = int32_t(1000 * members[prev] + i);
  }
  int32_t *ds = deviceCopy(out), *dr = deviceCopy(poisoned);
  carve::rt::CommHandle hs, hr;
  if (r % 2) {
    hr = c.recvAsync(dr, bytes, prev, 7);
    hs = c.sendAsync(ds, bytes, next, 7);
  } else {
    hs = c.sendAsync(ds, bytes, next, 7);
    hr = c.recvAsync(dr, bytes, prev, 7);
  }
  c.wait(hr);
  c.wait(hs);
  expectSame(readBack(dr, len), want,
             label + ": ring, from rank " + std::to_string(members[prev]) + " to rank " +
                 std::to_string(members[r]));
  cudaFree(ds);
  cudaFree(dr);
}

void checkPointToPoint(Communicator &c, const std::vector<int> &members, const std::string &label) {
  const int n = c.size(), r = c.rank();
  checkRing(c, members, label);

  // Pairs (0, 1), (2, 3): two messages of different tags and sizes from the
  // lower rank, device memory, then one back into host memory; posted in
  // the same order on both sides, waited for in another.
  const int peer = r ^ 1;
  if (peer < n) {
    const bool low = r < peer;
    const int lo = std::min(r, peer);
    std::vector<int32_t> a(10), b(1000), back(100);
    for (int i = 0; i < 10; ++i)
      a[i] = 10 * lo + i;
    for (int i = 0; i < 1000; ++i)
      b[i] = -i - lo;
    for (int i = 0; i < 100; ++i)
      back[i] = 7 * i + lo;
    if (low) {
      int32_t *da = deviceCopy(a), *db = deviceCopy(b);
      std::vector<int32_t> got(100, -1);
      auto h1 = c.sendAsync(da, 40, peer, 3);
      auto h2 = c.sendAsync(db, 4000, peer, 4);
      auto h3 = c.recvAsync(got.data(), 400, peer, 5);
      c.wait(h3);
      c.wait(h2);
      c.wait(h1);
      expectSame(got, back,
                 label + ": a reply into host memory from rank " + std::to_string(members[peer]));
      cudaFree(da);
      cudaFree(db);
    } else {
      int32_t *ra = deviceCopy(std::vector<int32_t>(10, -1)),
              *rb = deviceCopy(std::vector<int32_t>(1000, -1));
      auto h1 = c.recvAsync(ra, 40, peer, 3);
      auto h2 = c.recvAsync(rb, 4000, peer, 4);
      auto h3 = c.sendAsync(back.data(), 400, peer, 5);
      c.wait(h2);
      c.wait(h3);
      c.wait(h1);
      expectSame(readBack(ra, 10), a, label + ": pair, message with tag 3");
      expectSame(readBack(rb, 1000), b, label + ": pair, message with tag 4");
      cudaFree(ra);
      cudaFree(rb);
    }
  }

  // Sends to itself, matched by tag, receives posted first and last.
  {
    std::vector<int32_t> a(10), b(10);
    for (int i = 0; i < 10; ++i)
      a[i] = 100 * r + i, b[i] = 100 * r + 50 + i;
    int32_t *da = deviceCopy(a), *db = deviceCopy(b), *ra = nullptr, *rb = nullptr;
    GT_CUDA(cudaMalloc(&ra, 10 * sizeof(int32_t)));
    GT_CUDA(cudaMalloc(&rb, 10 * sizeof(int32_t)));
    auto hrb = c.recvAsync(rb, 40, r, 2);
    auto hsa = c.sendAsync(da, 40, r, 1);
    auto hsb = c.sendAsync(db, 40, r, 2);
    auto hra = c.recvAsync(ra, 40, r, 1);
    c.wait(hsa);
    c.wait(hrb);
    c.wait(hra);
    c.wait(hsb);
    expectSame(readBack(ra, 10), a, label + ": send to itself, tag 1");
    expectSame(readBack(rb, 10), b, label + ": send to itself, tag 2");
    cudaFree(da);
    cudaFree(db);
    cudaFree(ra);
    cudaFree(rb);
  }
}

//===--- Broadcast, barrier ------------------------------------------------===//

void checkBroadcast(Communicator &c, const std::string &label) {
  const int n = c.size(), r = c.rank();
  for (int root = 0; root < n; ++root) {
    std::vector<uint8_t> want(77);
    for (int i = 0; i < 77; ++i)
      want[i] = uint8_t(31 * root + i);
    uint8_t *d = deviceCopy(r == root ? want : std::vector<uint8_t>(77, 0xEE));
    c.broadcast(d, 77, root);
    expectSame(readBack(d, 77), want, label + ": broadcast from rank " + std::to_string(root));
    cudaFree(d);
    char text[16] = {};
    const std::string from = "from " + std::to_string(root);
    if (r == root)
      std::snprintf(text, sizeof text, "%s", from.c_str());
    c.broadcast(text, sizeof text, root);
    expect(from == text, label + ": broadcast of host memory from rank " + std::to_string(root) +
                             ": got \"" + std::string(text, strnlen(text, sizeof text)) + "\"");
  }
}

/// Each rank creates a file in `dir` before the barrier (the last one after
/// a pause), and after it every rank must see all of them.
void checkBarrier(Communicator &c, const std::string &label, const std::string &dir,
                  const std::string &tag) {
  const int n = c.size(), r = c.rank();
  auto path = [&](int q) { return dir + "/" + tag + "." + std::to_string(q); };
  if (r == n - 1)
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::FILE *f = std::fopen(path(r).c_str(), "w");
  expect(f != nullptr, label + ": creating " + path(r) + " for the barrier");
  if (f)
    std::fclose(f);
  c.barrier();
  std::string missing;
  for (int q = 0; q < n; ++q)
    if (access(path(q).c_str(), F_OK) != 0)
      missing += " " + std::to_string(q);
  expect(missing.empty(), label + ": left the barrier before rank(s)" + missing + " entered it");
}

//===--- Splits and agreement ----------------------------------------------===//

/// The collectives of a sub-group whose members are the world ranks `want`
/// in group rank order.
void checkGroup(Communicator &g, const std::vector<int> &want, const std::string &label) {
  const int w = worldRank;
  const int expectedRank = static_cast<int>(std::find(want.begin(), want.end(), w) - want.begin());
  expect(g.size() == static_cast<int>(want.size()) && g.rank() == expectedRank &&
             g.worldRanks() == want,
         label + ": group rank " + std::to_string(g.rank()) + " of " + std::to_string(g.size()) +
             ", expected " + std::to_string(expectedRank) + " of " + std::to_string(want.size()));
  if (g.size() != static_cast<int>(want.size()) || g.rank() != expectedRank)
    return; // the answers below would be computed for the wrong group

  // Sums of the members' world ranks, and the world ranks in group order.
  allReduceCase<int64_t>(
      g, CommType::I64, ReduceOp::Sum, 100,
      [&want](int q, int64_t i) { return 1000.0 * (want[q] + 1) + i; },
      label + ": all-reduce in the group");
  std::vector<int32_t> mine{w}, all(want.size(), -1);
  int32_t *dm = deviceCopy(mine), *da = deviceCopy(all);
  g.allGather(dm, da, 1, CommType::I32);
  expectSame(readBack(da, want.size()), std::vector<int32_t>(want.begin(), want.end()),
             label + ": all-gather of the world ranks in group order");
  cudaFree(dm);
  cudaFree(da);
  int32_t root = g.rank() == 0 ? w : -1;
  g.broadcast(&root, sizeof root, 0);
  expect(root == want[0], label + ": broadcast from group rank 0 gave world rank " +
                              std::to_string(root) + ", expected " + std::to_string(want[0]));
  if (g.size() > 1)
    checkRing(g, want, label);
}

void checkSplits(Communicator &c, const std::string &label) {
  const int n = c.size(), r = c.rank();
  {
    std::unique_ptr<Communicator> sub = c.split(r % 2, r);
    std::vector<int> want;
    for (int q = r % 2; q < n; q += 2)
      want.push_back(q);
    checkGroup(*sub, want, label + ": split(rank % 2, rank)");
  }
  if (n >= 4 && n % 2 == 0) {
    std::unique_ptr<Communicator> sub = c.split(r / 2, -r);
    checkGroup(*sub, {2 * (r / 2) + 1, 2 * (r / 2)}, label + ": split(rank / 2, -rank)");
  }
}

/// Non-integer sums depend on the order of addition: each rank's result is
/// gathered and must equal every other's bit for bit (and the exact sum to
/// within rounding).
void checkAgreement(Communicator &c, const std::string &label) {
  const int n = c.size(), r = c.rank();
  const int64_t len = 1000;
  std::vector<float> x(len);
  for (int64_t i = 0; i < len; ++i)
    x[i] = 0.1f * float(r + 1) * float(i);
  float *d = deviceCopy(x), *all = nullptr;
  GT_CUDA(cudaMalloc(&all, n * len * sizeof(float)));
  c.allReduce(d, len, CommType::F32, ReduceOp::Sum);
  c.allGather(d, all, len, CommType::F32);
  std::vector<float> results = readBack(all, n * len), mine = readBack(d, len);
  for (int q = 0; q < n; ++q)
    expectSame(std::vector<float>(results.begin() + q * len, results.begin() + (q + 1) * len), mine,
               label + ": all-reduce of non-integers, rank " + std::to_string(q) +
                   "'s result bit for bit");
  int far = 0;
  for (int64_t i = 0; i < len; ++i) {
    double exact = 0;
    for (int q = 0; q < n; ++q)
      exact += double(0.1f * float(q + 1) * float(i));
    far += std::fabs(mine[i] - exact) > 1e-6 * n * std::fabs(exact);
  }
  expect(far == 0, label + ": all-reduce of non-integers: " + std::to_string(far) +
                       " elements farther than rounding from the sum");
  cudaFree(d);
  cudaFree(all);
}

//===--- One rank ----------------------------------------------------------===//

void checkOperations(Communicator &c, const std::string &label, const std::string &dir) {
  std::vector<int> world(c.size());
  for (int q = 0; q < c.size(); ++q)
    world[q] = q;
  expect(c.rank() == worldRank && c.worldRanks() == world,
         label + ": rank " + std::to_string(c.rank()) + " of " + std::to_string(c.size()));
  checkAllReduce(c, label);
  checkAllGather(c, label);
  checkReduceScatter(c, label);
  checkAllToAll(c, label);
  checkPointToPoint(c, world, label);
  checkBroadcast(c, label);
  checkBarrier(c, label, dir, label);
  checkSplits(c, label);
  checkAgreement(c, label);
}

bool envInt(const char *name, int lo, int hi, int &value) {
  const char *text = std::getenv(name);
  char *end = nullptr;
  long v = text ? std::strtol(text, &end, 10) : 0;
  if (!text || !*text || *end || v < lo || v > hi) {
    std::printf("FAIL rank ?: %s=%s is not in %d..%d\n", name, text ? text : "(unset)", lo, hi);
    return false;
  }
  value = static_cast<int>(v);
  return true;
}

/// CARVE_NCCL_RANKS_FAULT (tests of the CPU emulation's strictness; the
/// ranks must fail, saying why): `disagree`, rank 0 all-reduces 1000
/// floats and the others 999; `die`, rank 1 exits after NCCL's start-up
/// while the others all-reduce.
int runFault(const std::string &fault, Communicator &world) {
  std::string err;
  std::unique_ptr<Communicator> c = g::makeNcclCommunicator(world, err);
  if (!c) {
    std::printf("FAIL rank %d: makeNcclCommunicator: %s\n", worldRank, err.c_str());
    return 1;
  }
  if (fault == "die" && worldRank == 1) {
    std::printf("rank 1: exits now, telling no one\n");
    std::fflush(stdout);
    _exit(3);
  }
  const int64_t n = fault == "disagree" && worldRank != 0 ? 999 : 1000;
  float *d = deviceCopy(std::vector<float>(static_cast<size_t>(n), 1.0f));
  c->allReduce(d, n, CommType::F32, ReduceOp::Sum);
  readBack(d, static_cast<size_t>(n));
  std::printf("FAIL rank %d: the all-reduce of fault '%s' completed\n", worldRank, fault.c_str());
  return 1;
}

/// A child: one rank, its GPU, the TCP world, then NCCL over it twice.
//===--- A CUDA graph capture that fails on one rank -------------------===//

/// The run's agreement (train's NanGuard does this over its world).
class WorldHooks : public carve::rt::StepHooks {
public:
  explicit WorldHooks(Communicator &w) : world(w) {}
  void gradientsReady(carve::rt::StepContext &) override {}
  bool updateAllowed(carve::rt::StepContext &, double) override { return true; }
  bool everyRank(bool ok) override {
    int64_t failed = ok ? 0 : 1;
    world.allReduce(&failed, 1, CommType::I64, ReduceOp::Max);
    return failed == 0;
  }

private:
  Communicator &world;
};

Communicator *fallbackComm = nullptr;
constexpr int64_t kFallbackN = 1000;

/// What a generated forwardBackward does in small, except that on rank 1
/// it also synchronizes the compute stream while an all-reduce is in flight
/// and checks for an error as the generated code does after a user's
/// kernel: legal when run as it is, the capture's end when captured (with
/// the all-reduce left to forget).
void fallbackBody(carve::rt::StepContext &ctx) {
  float *x = reinterpret_cast<float *>(ctx.arena), *y = x + kFallbackN;
  g::scaleInPlace(x, kFallbackN, 2.0f);
  carve::rt::CommHandle h =
      fallbackComm->allReduceAsync(x, kFallbackN, CommType::F32, ReduceOp::Sum);
  if (worldRank == 1) { // while the all-reduce is in flight
    (void)cudaStreamSynchronize(compute());
    g::checkLaunch("the test's synchronizing op");
  }
  fallbackComm->wait(h);
  g::addInPlace(x, y, kFallbackN);
}

/// graphStep over 4 steps with the graph on: step 0 runs as it is; rank 1
/// cannot capture step 1, so no rank replays a graph: step 1 and every later
/// one run eagerly on every rank, with the all-reduce started in rank 0's
/// capture (and the one rank 1 started before its failure) forgotten and
/// every result 2 (x_0 + x_1) + y. Rank 1 is told why, rank 0 that another
/// rank failed.
void checkGraphFallback(Communicator &c, Communicator &world) {
  const int n = c.size();
  fallbackComm = &c;
  WorldHooks hooks(world);
  float *arena = nullptr;
  GT_CUDA(cudaMalloc(&arena, 2 * kFallbackN * sizeof(float)));
  std::vector<float> y(kFallbackN);
  for (int64_t i = 0; i < kFallbackN; ++i)
    y[i] = 0.25f * static_cast<float>(i % 50);
  GT_CUDA(cudaMemcpyAsync(arena + kFallbackN, y.data(), kFallbackN * sizeof(float),
                          cudaMemcpyHostToDevice, compute()));
  carve::rt::StepContext ctx;
  ctx.arena = reinterpret_cast<char *>(arena);
  ctx.cudaGraph = true;
  ctx.hooks = &hooks;
  for (int step = 0; step < 4; ++step) {
    const std::string at = "graph fallback: step " + std::to_string(step) + ": ";
    auto xOf = [&](int r, int64_t i) { return static_cast<float>(10 * step + r + i % 100); };
    std::vector<float> x(kFallbackN);
    for (int64_t i = 0; i < kFallbackN; ++i)
      x[i] = xOf(worldRank, i);
    GT_CUDA(cudaMemcpyAsync(arena, x.data(), kFallbackN * sizeof(float), cudaMemcpyHostToDevice,
                            compute()));
    GT_CUDA(cudaStreamSynchronize(compute()));
    ctx.step = step;
    g::graphStep(ctx, fallbackBody);
    std::vector<float> got = readBack(arena, kFallbackN);
    int bad = 0;
    for (int64_t i = 0; i < kFallbackN; ++i) {
      float sum = 0;
      for (int r = 0; r < n; ++r)
        sum += 2.0f * xOf(r, i);
      bad += got[i] != sum + y[i];
    }
    expect(bad == 0, at + std::to_string(bad) + " wrong elements of 2 (x_0 + x_1) + y");
    expect(ctx.graphNodes == 0,
           at + "no graph expected, got " + std::to_string(ctx.graphNodes) + " nodes");
    const int wantFallback = step == 0 ? 0 : worldRank == 1 ? 1 : 2;
    expect(ctx.graphFallback == wantFallback, at + "graphFallback " +
                                                  std::to_string(ctx.graphFallback) +
                                                  ", expected " + std::to_string(wantFallback));
    if (step > 0 && worldRank == 1) {
      const std::string why = ctx.graphFallbackWhy ? ctx.graphFallbackWhy : "";
      expect(why.find("the test's synchronizing op") != std::string::npos,
             at + "the cause does not name the op that broke the capture: '" + why + "'");
    }
  }
  cudaFree(arena);
}

int runRank(const std::string &dir) {
  int size = 0, localRank = 0, localSize = 0;
  if (!envInt("WORLD_SIZE", 1, 1024, size) || !envInt("RANK", 0, size - 1, worldRank) ||
      !envInt("LOCAL_WORLD_SIZE", 1, size, localSize) ||
      !envInt("LOCAL_RANK", 0, localSize - 1, localRank))
    return 1;
  carve::rt::setCollectiveTimeout(kCollectiveTimeout);
  std::string err;
  if (!g::kCudaTarget.open(worldRank, localRank, localSize, int64_t(1) << 20, err)) {
    std::printf("FAIL rank %d: kCudaTarget.open: %s\n", worldRank, err.c_str());
    return 1;
  }
  std::unique_ptr<Communicator> world = carve::rt::makeEnvWorld(err);
  expect(world != nullptr, "the TCP world (makeEnvWorld): " + err);
  if (const char *fault = std::getenv("CARVE_NCCL_RANKS_FAULT"); fault && world)
    return runFault(fault, *world);
  for (const char *label : {"world", "blocking"}) {
    if (!world)
      break;
    const bool blocking = std::strcmp(label, "blocking") == 0;
    if (blocking)
      setenv("CARVE_NCCL_BLOCKING", "1", 1);
    std::unique_ptr<Communicator> c = g::makeNcclCommunicator(*world, err);
    expect(c != nullptr, std::string(label) + ": makeNcclCommunicator: " + err);
    if (!c)
      break; // the other ranks could not start either, or wait for this one
    checkOperations(*c, label, dir);
    if (!blocking)
      checkGraphFallback(*c, *world);
    c.reset();
    if (blocking)
      unsetenv("CARVE_NCCL_BLOCKING");
  }
  if (!g::kCudaTarget.synchronize(err))
    expect(false, "device synchronize at the end: " + err);
  g::kCudaTarget.close();
  std::printf("rank %d: %d checks, %d failed\n", worldRank, checks(), failures());
  return failures() == 0 && checks() > 0 ? 0 : 1;
}

//===--- The launcher ------------------------------------------------------===//

/// A TCP port on 127.0.0.1 nobody listened on a moment ago, or 0.
int freePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0)
    return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr *>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  close(fd);
  return port;
}

void removeDir(const std::string &dir) {
  if (DIR *d = opendir(dir.c_str())) {
    while (dirent *e = readdir(d))
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0)
        unlink((dir + "/" + e->d_name).c_str());
    closedir(d);
  }
  rmdir(dir.c_str());
}

/// The parent: forks and executes the N ranks, waits for them (bounded) and
/// reports each one that failed.
int launch(int n, const char *argv0) {
  gputest::requireDevice(kBinary);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess)
    count = 0;
  if (count < n) {
    std::printf("%s: not run: %d ranks need %d GPUs, this machine has %d\n", kBinary, n, n, count);
    return 77;
  }
  const int port = freePort();
  const char *tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/carve-nccl-ranks-XXXXXX";
  if (!port || !mkdtemp(dir.data())) {
    std::printf("FAIL: %s\n", port ? "cannot make a temporary directory" : "no free TCP port");
    return 1;
  }
  std::printf("%s: %d ranks on %d of %d GPUs, MASTER_PORT=%d\n", kBinary, n, n, count, port);
  std::fflush(stdout);

  // Everything the children need is built before the fork: this process
  // has CUDA's threads, so a child may only call execve and _exit.
  static const char *const kOurs[] = {
      "RANK=",        "WORLD_SIZE=",  "LOCAL_RANK=",       "LOCAL_WORLD_SIZE=",
      "MASTER_ADDR=", "MASTER_PORT=", "CARVE_MASTER_PORT="};
  std::vector<std::string> inherited;
  for (char **e = environ; *e; ++e)
    if (std::none_of(std::begin(kOurs), std::end(kOurs),
                     [e](const char *k) { return std::strncmp(*e, k, std::strlen(k)) == 0; }))
      inherited.push_back(*e);
  std::vector<std::vector<std::string>> envs(n, inherited);
  std::vector<std::vector<char *>> envps(n);
  std::vector<std::string> execFailed(n);
  for (int r = 0; r < n; ++r) {
    for (const std::string &kv :
         {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(n),
          "LOCAL_RANK=" + std::to_string(r), "LOCAL_WORLD_SIZE=" + std::to_string(n),
          std::string("MASTER_ADDR=127.0.0.1"), "MASTER_PORT=" + std::to_string(port)})
      envs[r].push_back(kv);
    for (std::string &s : envs[r])
      envps[r].push_back(s.data());
    envps[r].push_back(nullptr);
    execFailed[r] = "FAIL rank " + std::to_string(r) + ": cannot execute /proc/self/exe\n";
  }
  std::string child = "--child", dirFlag = "--dir", self = argv0;
  char *args[] = {self.data(), child.data(), dirFlag.data(), dir.data(), nullptr};

  const pid_t parent = getpid();
  std::vector<pid_t> pids(n, -1);
  for (int r = 0; r < n; ++r) {
    pids[r] = fork();
    if (pids[r] == 0) {
      // A rank outlives no launcher (ctest's timeout kills only this one).
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() == parent)
        execve("/proc/self/exe", args, envps[r].data());
      [[maybe_unused]] const ssize_t written = write(2, execFailed[r].data(), execFailed[r].size());
      _exit(127);
    }
    if (pids[r] < 0) {
      std::printf("FAIL: fork for rank %d: %s\n", r, std::strerror(errno));
      for (int q = 0; q < r; ++q)
        kill(pids[q], SIGKILL);
      for (int q = 0; q < r; ++q)
        waitpid(pids[q], nullptr, 0);
      removeDir(dir);
      return 1;
    }
  }

  std::vector<int> status(n, 0);
  std::vector<bool> done(n, false);
  int left = n;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kTotalTimeout);
  while (left > 0 && std::chrono::steady_clock::now() < deadline) {
    for (int r = 0; r < n; ++r)
      if (!done[r] && waitpid(pids[r], &status[r], WNOHANG) == pids[r])
        done[r] = true, --left;
    if (left > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::string notFinished;
  for (int r = 0; r < n; ++r)
    if (!done[r]) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], nullptr, 0);
      notFinished += " " + std::to_string(r);
    }
  removeDir(dir);

  int failed = 0;
  if (!notFinished.empty()) {
    std::printf("FAIL: rank(s)%s had not finished after %d s; killed\n", notFinished.c_str(),
                kTotalTimeout);
    failed += static_cast<int>(std::count(done.begin(), done.end(), false));
  }
  for (int r = 0; r < n; ++r) {
    if (!done[r])
      continue;
    if (WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0)
      continue;
    ++failed;
    if (WIFEXITED(status[r]))
      std::printf("FAIL: rank %d exited with status %d\n", r, WEXITSTATUS(status[r]));
    else if (WIFSIGNALED(status[r]))
      std::printf("FAIL: rank %d was killed by signal %d (%s)\n", r, WTERMSIG(status[r]),
                  strsignal(WTERMSIG(status[r])));
    else
      std::printf("FAIL: rank %d ended with wait status %d\n", r, status[r]);
  }
  if (failed)
    std::printf("%s: %d of %d ranks failed\n", kBinary, failed, n);
  else
    std::printf("%s: all %d ranks passed\n", kBinary, n);
  return failed ? 1 : 0;
}

int usage() {
  std::printf("usage: %s --ranks N (N >= 2: N processes, one GPU each)\n", kBinary);
  return 2;
}

} // namespace

int main(int argc, char **argv) {
  // The ranks and the launcher share stdout: whole lines.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc == 4 && std::strcmp(argv[1], "--child") == 0 && std::strcmp(argv[2], "--dir") == 0)
    return runRank(argv[3]);
  if (argc != 3 || std::strcmp(argv[1], "--ranks") != 0)
    return usage();
  char *end = nullptr;
  const long n = std::strtol(argv[2], &end, 10);
  if (!*argv[2] || *end || n < 2 || n > 64)
    return usage();
  return launch(static_cast<int>(n), argv[0]);
}
