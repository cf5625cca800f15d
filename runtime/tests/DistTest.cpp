//===- DistTest.cpp - collectives, split layouts, vocab-parallel kernels --===//
//
// Runs on every rank of an MPI job (ctest runtime-dist: mpirun -n 4; alone it
// runs on one rank) and checks, against serial references computed here on
// every rank from the same seeds:
//
//  - every Communicator collective (all-gather, in place too; reduce-scatter
//    with zero counts; all-to-all; send/receive) for each element type;
//  - takeShard / placeShard against an index formula written from the Split
//    definition, and allGatherSplit / reduceScatterSplit / allToAllSplit
//    against takeShard of the full tensor, for groups 1 and 3 on dims 0, 1
//    and 2 of a 3-D tensor;
//  - the vocab-parallel embedding and cross-entropy against the serial
//    kernels on the concatenated table / logits, forward and gradient, in
//    float and double.
//
// ctest runtime-dist-pieces runs it again with CARVE_COMM_PIECE=7, so that
// every MPI operation goes in pieces of at most 7 elements (the path of
// operations larger than MPI's int counts).
//
// Failures on ranks other than 0 are printed with the rank; all ranks exit
// with the same status.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/dist.h"
#include "carve/rt/comm.h"
#include "carve/rt/elementwise.h"
#include "carve/rt/kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace carve::rt;

namespace {

Communicator *gComm = nullptr;

Communicator &comm() { return *gComm; }

/// Values that every element type represents exactly, so that sums do not
/// depend on the order of the ranks.
template <class T> T value(int64_t v) { return static_cast<T>(v); }

template <class T> constexpr CommType commType();
template <> constexpr CommType commType<float>() { return CommType::F32; }
template <> constexpr CommType commType<double>() { return CommType::F64; }
template <> constexpr CommType commType<int64_t>() { return CommType::I64; }
template <> constexpr CommType commType<int32_t>() { return CommType::I32; }
template <> constexpr CommType commType<uint8_t>() { return CommType::U8; }

template <class T> class CollectiveTest : public testing::Test {};
using ElementTypes = testing::Types<float, double, int64_t, int32_t>;
TYPED_TEST_SUITE(CollectiveTest, ElementTypes);

/// Counts the elements of `got` that differ from `want` and reports the first.
template <class T>
int64_t mismatches(const std::vector<T> &got, const std::vector<T> &want, const std::string &what) {
  int64_t wrong = 0;
  if (got.size() != want.size()) {
    ADD_FAILURE() << what << ": " << got.size() << " elements, expected " << want.size();
    return 1;
  }
  for (size_t i = 0; i < got.size(); ++i)
    if (!(got[i] == want[i])) {
      if (wrong == 0)
        ADD_FAILURE() << what << ": element " << i << " is " << +got[i] << ", expected " << +want[i]
                      << " (rank " << comm().rank() << ")";
      ++wrong;
    }
  return wrong;
}

TYPED_TEST(CollectiveTest, AllGather) {
  using T = TypeParam;
  Communicator &c = comm();
  const int n = c.size(), me = c.rank();
  for (int64_t per : {int64_t(0), int64_t(1), int64_t(1000)}) {
    std::vector<T> send(per), recv(per * n, value<T>(-1)), want(per * n);
    for (int64_t j = 0; j < per; ++j)
      send[j] = value<T>(100 * me + j % 97);
    for (int r = 0; r < n; ++r)
      for (int64_t j = 0; j < per; ++j)
        want[r * per + j] = value<T>(100 * r + j % 97);
    c.allGather(send.data(), recv.data(), per, commType<T>());
    EXPECT_EQ(mismatches(recv, want, "all-gather of " + std::to_string(per)), 0);

    // In place: this rank's block already sits in the receive buffer.
    std::vector<T> inPlace(per * n, value<T>(-1));
    std::copy(send.begin(), send.end(), inPlace.begin() + me * per);
    c.allGather(inPlace.data() + me * per, inPlace.data(), per, commType<T>());
    EXPECT_EQ(mismatches(inPlace, want, "in-place all-gather of " + std::to_string(per)), 0);
  }
}

TYPED_TEST(CollectiveTest, ReduceScatterWithZeroCounts) {
  using T = TypeParam;
  Communicator &c = comm();
  const int n = c.size(), me = c.rank();
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) {
    // Rank r receives (r * 5) % 3 * 4 elements: 0, 8, 4, 0, 8, ... (zeros included).
    std::vector<int64_t> counts(n), begin(n + 1, 0);
    for (int r = 0; r < n; ++r) {
      counts[r] = (r * 5) % 3 * 4;
      begin[r + 1] = begin[r] + counts[r];
    }
    if (n == 1)
      counts[0] = begin[1] = 5;
    std::vector<T> send(begin[n]);
    for (int64_t i = 0; i < begin[n]; ++i)
      send[i] = value<T>((i * 7 + me * 3) % 50);
    std::vector<T> recv(counts[me] + 1, value<T>(-1)), want(counts[me] + 1, value<T>(-1));
    for (int64_t j = 0; j < counts[me]; ++j) {
      const int64_t i = begin[me] + j;
      int64_t acc = op == ReduceOp::Sum ? 0 : -1;
      for (int r = 0; r < n; ++r) {
        const int64_t v = (i * 7 + r * 3) % 50;
        acc = op == ReduceOp::Sum ? acc + v : std::max(acc, v);
      }
      want[j] = value<T>(acc);
    }
    // The counts only need to live during the call.
    std::vector<int64_t> *temporary = new std::vector<int64_t>(counts);
    CommHandle h =
        c.reduceScatterAsync(send.data(), recv.data(), temporary->data(), commType<T>(), op);
    std::fill(temporary->begin(), temporary->end(), int64_t(-7));
    delete temporary;
    c.wait(h);
    EXPECT_EQ(
        mismatches(recv, want, op == ReduceOp::Sum ? "reduce-scatter sum" : "reduce-scatter max"),
        0);
  }
}

TYPED_TEST(CollectiveTest, AllToAll) {
  using T = TypeParam;
  Communicator &c = comm();
  const int n = c.size(), me = c.rank();
  for (int64_t per : {int64_t(0), int64_t(1), int64_t(300)}) {
    std::vector<T> send(per * n), recv(per * n, value<T>(-1)), want(per * n);
    for (int r = 0; r < n; ++r)
      for (int64_t j = 0; j < per; ++j) {
        send[r * per + j] = value<T>(1000 * me + 100 * r + j % 100);
        want[r * per + j] = value<T>(1000 * r + 100 * me + j % 100);
      }
    c.allToAll(send.data(), recv.data(), per, commType<T>());
    EXPECT_EQ(mismatches(recv, want, "all-to-all of " + std::to_string(per)), 0);
  }
}

/// 16-bit floats (16-bit gradients, carve-store-grads16) summed and maxed as
/// floats, not as their bits: every partial sum below is exact in both
/// formats, so any order of the ranks gives the same answer, and a sum of
/// the bits as integers would not (0x3FC0 + 0x3FC0 is no bf16 3.0). With
/// more than 2 ranks the reduce-scatter goes through MPI's user operations
/// too (and in pieces under CARVE_COMM_PIECE).
TEST(Collective, SixteenBitFloats) {
  Communicator &c = comm();
  const int n = c.size(), me = c.rank();
  for (bool f16 : {false, true}) {
    const CommType t = f16 ? CommType::F16 : CommType::BF16;
    auto bits = [&](float x) { return f16 ? ew::f16Bits(x) : ew::bf16Bits(x); };
    const int64_t len = 40;
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) {
      // Element i of rank r: (i % 8 + 1) * 0.25 * (r + 1), negated for odd i.
      auto v = [&](int64_t i, int r) {
        return (i % 2 ? -1.0f : 1.0f) * float(i % 8 + 1) * 0.25f * float(r + 1);
      };
      std::vector<uint16_t> buf(len), want(len);
      for (int64_t i = 0; i < len; ++i) {
        buf[i] = bits(v(i, me));
        float acc = op == ReduceOp::Sum ? 0.0f : v(i, 0);
        for (int r = 0; r < n; ++r)
          acc = op == ReduceOp::Sum ? acc + v(i, r) : std::max(acc, v(i, r));
        want[i] = bits(acc);
      }
      std::vector<uint16_t> send = buf;
      c.allReduce(buf.data(), len, t, op);
      std::string what = std::string(f16 ? "f16" : "bf16") + " all-reduce " +
                         (op == ReduceOp::Sum ? "sum" : "max");
      EXPECT_EQ(mismatches(buf, want, what), 0);
      // Reduce-scatter: rank r receives elements [10 r, 10 r + 10) (those past
      // the end: none).
      std::vector<int64_t> counts(n);
      int64_t begin = 0;
      for (int r = 0; r < n; ++r) {
        counts[r] = std::max<int64_t>(0, std::min<int64_t>(10, len - 10 * r));
        if (r < me)
          begin += counts[r];
      }
      std::vector<uint16_t> recv(counts[me]);
      std::vector<uint16_t> wantChunk(want.begin() + begin, want.begin() + begin + counts[me]);
      c.wait(c.reduceScatterAsync(send.data(), recv.data(), counts.data(), t, op));
      EXPECT_EQ(mismatches(recv, wantChunk, what + " reduce-scatter"), 0);
    }
  }
}

TEST(Collective, SeveralInFlightCompletedOutOfOrder) {
  Communicator &c = comm();
  const int n = c.size(), me = c.rank();
  std::vector<double> a(3 * n), b(2 * n), sum(10, 1.0);
  double mine[3] = {me + 0.5, me + 0.25, -double(me)};
  int64_t counts[64];
  for (int r = 0; r < n; ++r)
    counts[r] = r == n - 1 ? 10 : 0;
  std::vector<double> sumOut(10, -1), toAll(2 * n, me);
  CommHandle h1 = c.allGatherAsync(mine, a.data(), 3, CommType::F64);
  CommHandle h2 = c.allToAllAsync(toAll.data(), b.data(), 2, CommType::F64);
  CommHandle h3 =
      c.reduceScatterAsync(sum.data(), sumOut.data(), counts, CommType::F64, ReduceOp::Sum);
  c.wait(h3);
  c.wait(h1);
  c.wait(h2);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(a[3 * r], r + 0.5);
    EXPECT_EQ(a[3 * r + 2], -double(r));
    EXPECT_EQ(b[2 * r + 1], double(r));
  }
  EXPECT_EQ(sumOut[0], me == n - 1 ? double(n) : -1.0);
}

TEST(Collective, SendReceiveRing) {
  Communicator &c = comm();
  const int n = c.size(), me = c.rank();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  // Two messages with the same tag arrive in order; a third with another tag.
  std::vector<int64_t> out1(100), out2(17), out3(5);
  for (int64_t j = 0; j < 100; ++j)
    out1[j] = 1000 * me + j;
  for (int64_t j = 0; j < 17; ++j)
    out2[j] = -1000 * me - j;
  for (int64_t j = 0; j < 5; ++j)
    out3[j] = 7 * me + j;
  std::vector<int64_t> in1(100, -1), in2(17, -1), in3(5, -1);
  CommHandle r3 = c.recvAsync(in3.data(), 5 * 8, prev, 9);
  CommHandle r1 = c.recvAsync(in1.data(), 100 * 8, prev, 4);
  CommHandle r2 = c.recvAsync(in2.data(), 17 * 8, prev, 4);
  CommHandle s1 = c.sendAsync(out1.data(), 100 * 8, next, 4);
  CommHandle s2 = c.sendAsync(out2.data(), 17 * 8, next, 4);
  CommHandle s3 = c.sendAsync(out3.data(), 5 * 8, next, 9);
  for (CommHandle h : {r1, r2, r3, s3, s2, s1})
    c.wait(h);
  int64_t wrong = 0;
  for (int64_t j = 0; j < 100; ++j)
    wrong += in1[j] != 1000 * prev + j;
  for (int64_t j = 0; j < 17; ++j)
    wrong += in2[j] != -1000 * prev - j;
  for (int64_t j = 0; j < 5; ++j)
    wrong += in3[j] != 7 * prev + j;
  EXPECT_EQ(wrong, 0);

  // Blocking, in pairs (0, 1), (2, 3), ...: the even rank sends first, the
  // odd one receives first, so no rank waits on a send nobody receives.
  const int partner = me ^ 1;
  if (partner < n) {
    int64_t token = me, got = -1;
    if (me % 2 == 0) {
      c.send(&token, 8, partner, 1);
      c.recv(&got, 8, partner, 1);
    } else {
      c.recv(&got, 8, partner, 1);
      c.send(&token, 8, partner, 1);
    }
    EXPECT_EQ(got, partner);
  }
}

TEST(Collective, SelfCommunicator) {
  std::unique_ptr<Communicator> self = makeSelfCommunicator();
  EXPECT_EQ(self->size(), 1);
  std::vector<float> a = {1, 2, 3}, b(3, 0);
  self->allGather(a.data(), b.data(), 3, CommType::F32);
  EXPECT_EQ(b, a);
  int64_t counts[1] = {2};
  std::vector<float> c(2, 0);
  self->reduceScatter(a.data(), c.data(), counts, CommType::F32, ReduceOp::Sum);
  EXPECT_EQ(c, (std::vector<float>{1, 2}));
  std::fill(b.begin(), b.end(), 0.0f);
  self->allToAll(a.data(), b.data(), 3, CommType::F32);
  EXPECT_EQ(b, a);
  // A receive posted before its send, and a send before its receive.
  double x = 0, y = 2.5, z = 0, w = -1.5;
  CommHandle r = self->recvAsync(&x, 8, 0, 3);
  CommHandle s = self->sendAsync(&y, 8, 0, 3);
  self->wait(s);
  self->wait(r);
  EXPECT_EQ(x, 2.5);
  CommHandle s2 = self->sendAsync(&w, 8, 0, 5);
  CommHandle r2 = self->recvAsync(&z, 8, 0, 5);
  self->wait(r2);
  self->wait(s2);
  EXPECT_EQ(z, -1.5);
}

//===--- Split layouts ----------------------------------------------------===//

/// A full 3-D tensor of distinct values: element i is i + 1.
std::vector<int64_t> iota(const Dims &s) {
  std::vector<int64_t> v(s.numel());
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<int64_t>(i) + 1;
  return v;
}

/// Piece `index` of `full`, written from the Split definition: local index l
/// along dim is group l / chunk, offset l % chunk, full index
/// group * parts * chunk + index * chunk + offset.
std::vector<int64_t> referencePiece(const std::vector<int64_t> &full, const Dims &fs, Split s,
                                    int index) {
  Dims ls = fs;
  ls.d[s.dim] /= s.parts;
  const int64_t chunk = fs.d[s.dim] / (s.groups * s.parts);
  std::vector<int64_t> out(ls.numel());
  for (int64_t a = 0; a < ls.d[0]; ++a)
    for (int64_t b = 0; b < ls.d[1]; ++b)
      for (int64_t c = 0; c < ls.d[2]; ++c) {
        int64_t at[3] = {a, b, c};
        const int64_t l = at[s.dim];
        at[s.dim] = l / chunk * s.parts * chunk + index * chunk + l % chunk;
        out[(a * ls.d[1] + b) * ls.d[2] + c] = full[(at[0] * fs.d[1] + at[1]) * fs.d[2] + at[2]];
      }
  return out;
}

std::string describe(Split s) {
  return "dim " + std::to_string(s.dim) + ", groups " + std::to_string(s.groups) + ", parts " +
         std::to_string(s.parts);
}

TEST(Split, TakeAndPlaceShardRoundTrip) {
  for (int parts : {1, 2, 3, 4}) {
    const Dims fs{int64_t(3 * parts), int64_t(6 * parts), int64_t(3 * parts)};
    const std::vector<int64_t> full = iota(fs);
    for (int dim = 0; dim < 3; ++dim)
      for (int64_t groups : {1, 3}) {
        const Split s{dim, groups, parts};
        const Dims ls = shardShape(fs, s);
        EXPECT_EQ(ls.numel() * parts, fs.numel());
        std::vector<int64_t> rebuilt(full.size(), 0);
        for (int i = 0; i < parts; ++i) {
          std::vector<int64_t> piece(ls.numel(), -1);
          takeShard(full.data(), fs, s, i, piece.data(), 8);
          EXPECT_EQ(mismatches(piece, referencePiece(full, fs, s, i),
                               "takeShard piece " + std::to_string(i) + " of " + describe(s)),
                    0);
          placeShard(piece.data(), ls, s, i, rebuilt.data(), 8);
        }
        EXPECT_EQ(mismatches(rebuilt, full, "placeShard of every piece, " + describe(s)), 0);
      }
  }
}

TEST(Split, FusedSectionsExample) {
  // The dist.h example: dimension 12, groups 3, parts 2.
  const Dims fs{12};
  Dims fs3{1, 12, 1};
  std::vector<int64_t> full(12), piece(6);
  for (int i = 0; i < 12; ++i)
    full[i] = i;
  takeShard(full.data(), fs3, Split{1, 3, 2}, 1, piece.data(), 8);
  EXPECT_EQ(piece, (std::vector<int64_t>{2, 3, 6, 7, 10, 11}));
  takeShard(full.data(), fs, Split{0, 3, 2}, 0, piece.data(), 8);
  EXPECT_EQ(piece, (std::vector<int64_t>{0, 1, 4, 5, 8, 9}));
}

template <class T> std::vector<T> as(const std::vector<int64_t> &v) {
  return std::vector<T>(v.begin(), v.end());
}

template <class T> void checkSplitCollectives() {
  Communicator &c = comm();
  const int n = c.size(), me = c.rank();
  const Dims fs{int64_t(3 * n), int64_t(6 * n), int64_t(3 * n)};
  const std::vector<T> full = as<T>(iota(fs));
  for (int dim = 0; dim < 3; ++dim)
    for (int64_t groups : {1, 3}) {
      const Split s{dim, groups, n};
      const Dims ls = shardShape(fs, s);
      std::vector<T> mine(ls.numel());
      takeShard(full.data(), fs, s, me, mine.data(), sizeof(T));

      std::vector<T> gathered(full.size(), T(-1));
      allGatherSplit(c, mine.data(), ls, s, gathered.data(), commType<T>());
      EXPECT_EQ(mismatches(gathered, full, "allGatherSplit, " + describe(s)), 0);

      // Rank r's partial value is full * (r + 1): the sum is full * n(n+1)/2.
      std::vector<T> partial(full.size()), reduced(full.size()), want(ls.numel());
      for (size_t i = 0; i < full.size(); ++i) {
        partial[i] = full[i] * T(me + 1);
        reduced[i] = full[i] * T(n * (n + 1) / 2);
      }
      takeShard(reduced.data(), fs, s, me, want.data(), sizeof(T));
      std::vector<T> local(ls.numel(), T(-1));
      reduceScatterSplit(c, partial.data(), fs, s, local.data(), commType<T>(), ReduceOp::Sum);
      EXPECT_EQ(mismatches(local, want, "reduceScatterSplit sum, " + describe(s)), 0);
      std::vector<T> maxWant(ls.numel());
      for (size_t i = 0; i < full.size(); ++i)
        reduced[i] = full[i] * T(n);
      takeShard(reduced.data(), fs, s, me, maxWant.data(), sizeof(T));
      reduceScatterSplit(c, partial.data(), fs, s, local.data(), commType<T>(), ReduceOp::Max);
      EXPECT_EQ(mismatches(local, maxWant, "reduceScatterSplit max, " + describe(s)), 0);

      for (int toDim = 0; toDim < 3; ++toDim)
        for (int64_t toGroups : {1, 3}) {
          if (toDim == dim)
            continue;
          const Split to{toDim, toGroups, n};
          const Dims os = shardShape(fs, to);
          std::vector<T> out(os.numel(), T(-1)), outWant(os.numel());
          takeShard(full.data(), fs, to, me, outWant.data(), sizeof(T));
          allToAllSplit(c, mine.data(), ls, s, to, out.data(), commType<T>());
          EXPECT_EQ(
              mismatches(out, outWant, "allToAllSplit from " + describe(s) + " to " + describe(to)),
              0);
        }
    }
}

TEST(Split, CollectivesF32) { checkSplitCollectives<float>(); }
TEST(Split, CollectivesF64) { checkSplitCollectives<double>(); }
TEST(Split, CollectivesI64) { checkSplitCollectives<int64_t>(); }

//===--- Vocab-parallel kernels -------------------------------------------===//

// Tolerances against the serial kernels on the concatenated tensors. The
// vocab-parallel kernels do the serial kernel's arithmetic element by element
// (the same max, the same exp of x - max, sums in double, the loss in
// double); only the order in which the sums of exponentials add up differs
// (per rank, then across ranks). In double that changes a result by a few
// ulp, far below 1e-12 relative; in float the double sums are rounded to
// float once at the end, which can flip the last of float's 24 bits (6e-8
// relative), far below 1e-5.
template <class T> constexpr double kTol = std::is_same<T, float>::value ? 1e-5 : 1e-12;

template <class T>
int64_t mismatchesNear(const std::vector<T> &got, const std::vector<T> &want,
                       const std::string &what) {
  int64_t wrong = 0;
  if (got.size() != want.size()) {
    ADD_FAILURE() << what << ": " << got.size() << " elements, expected " << want.size();
    return 1;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    const bool ok = (std::isnan(g) && std::isnan(w)) || std::fabs(g - w) <= kTol<T> * std::fabs(w);
    if (!ok) {
      if (wrong == 0)
        ADD_FAILURE() << what << ": element " << i << " is " << g << ", expected " << w
                      << " (relative tolerance " << kTol<T> << ", rank " << comm().rank() << ")";
      ++wrong;
    }
  }
  return wrong;
}

std::vector<double> uniform(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(-3.0, 3.0);
  std::vector<double> v(n);
  for (double &x : v)
    x = dist(rng);
  return v;
}

template <class T> void checkEmbedding() {
  Communicator &c = comm();
  const int n = c.size(), me = c.rank();
  const int64_t rowsPerRank = 5, width = 3, rows = rowsPerRank * n;
  const Dims full{rows, width}, local{rowsPerRank, width};
  const std::vector<double> td = uniform(rows * width, 11);
  const std::vector<T> table(td.begin(), td.end());
  // Ids of every rank's rows, repeated ids, and negative ids (from the end).
  const Dims is{2, 7};
  std::vector<int64_t> idx(14);
  for (int64_t k = 0; k < 14; ++k)
    idx[k] = (k * 3) % rows;
  idx[3] = idx[5];
  idx[6] = -1;
  idx[9] = -rows;
  const int64_t offset = me * rowsPerRank;
  std::vector<T> mine(rowsPerRank * width);
  takeShard(table.data(), full, Split{0, 1, n}, me, mine.data(), sizeof(T));

  // Forward: the sum over ranks of the partial lookups is the lookup.
  std::vector<T> want(14 * width), got(14 * width, T(-1));
  gather(table.data(), full, idx.data(), is, 0, want.data());
  gather_sharded(mine.data(), local, offset, rows, idx.data(), is, got.data());
  for (int64_t k = 0; k < 14; ++k) {
    const int64_t v = idx[k] < 0 ? idx[k] + rows : idx[k];
    if (v >= offset && v < offset + rowsPerRank)
      continue;
    for (int64_t j = 0; j < width; ++j)
      EXPECT_EQ(got[k * width + j], T(0)) << "row of id " << idx[k] << " on rank " << me;
  }
  c.allReduce(got.data(), 14 * width, commType<T>(), ReduceOp::Sum);
  EXPECT_EQ(mismatchesNear(got, want, "gather_sharded"), 0);

  // Gradient: this rank's rows of the serial gradient.
  const std::vector<double> dyd = uniform(14 * width, 12);
  const std::vector<T> dy(dyd.begin(), dyd.end());
  std::vector<T> dfull(rows * width), dwant(rowsPerRank * width), dgot(rowsPerRank * width, T(-1));
  gather_grad(dy.data(), idx.data(), is, 0, dfull.data(), full);
  takeShard(dfull.data(), full, Split{0, 1, n}, me, dwant.data(), sizeof(T));
  gather_sharded_grad(dy.data(), idx.data(), is, offset, rows, dgot.data(), local);
  EXPECT_EQ(mismatchesNear(dgot, dwant, "gather_sharded_grad"), 0);
}

TEST(VocabParallel, EmbeddingFloat) { checkEmbedding<float>(); }
TEST(VocabParallel, EmbeddingDouble) { checkEmbedding<double>(); }

/// Logits [N, V] (spatial 0) or [N, V, 3] (spatial 3), V = 7 per rank.
template <class T> void checkCrossEntropy(int64_t spatial) {
  Communicator &c = comm();
  const int n = c.size(), me = c.rank();
  const int64_t rows = 6, perRank = 7, vocab = perRank * n, s = spatial ? spatial : 1;
  const Dims full = spatial ? Dims{rows, vocab, spatial} : Dims{rows, vocab};
  const Dims local = spatial ? Dims{rows, perRank, spatial} : Dims{rows, perRank};
  const Split split{1, 1, n};
  const std::vector<double> ld = uniform(full.numel(), 21 + spatial);
  const std::vector<T> logits(ld.begin(), ld.end());
  std::vector<T> mine(local.numel());
  takeShard(logits.data(), full, split, me, mine.data(), sizeof(T));
  // Targets on every rank's classes, a few ignored (-100).
  std::vector<int64_t> targets(rows * s);
  for (int64_t i = 0; i < rows * s; ++i)
    targets[i] = (i * 5 + 2) % vocab;
  targets[1] = -100;
  targets[rows * s - 2] = -100;
  const std::vector<double> dyd = uniform(rows * s, 22);
  const std::vector<T> dyNone(dyd.begin(), dyd.end());
  const T dyScalar = T(0.7);

  for (bool hasIgnore : {false, true}) {
    if (!hasIgnore)
      for (int64_t &t : targets)
        if (t < 0)
          t = vocab - 1;
    for (int reduction : {0, 1, 2}) {
      const std::string what = std::string(spatial ? "spatial " : "") + "reduction " +
                               std::to_string(reduction) + (hasIgnore ? ", ignore_index" : "");
      const int64_t outN = reduction == 2 ? rows * s : 1;
      std::vector<T> want(outN), got(outN, T(-1));
      cross_entropy(logits.data(), full, targets.data(), reduction, hasIgnore, -100, want.data());
      cross_entropy_vocab_parallel(c, mine.data(), local, me * perRank, targets.data(), reduction,
                                   hasIgnore, -100, got.data());
      EXPECT_EQ(mismatchesNear(got, want, "cross_entropy_vocab_parallel, " + what), 0);

      const T *dy = reduction == 2 ? dyNone.data() : &dyScalar;
      std::vector<T> dfull(full.numel()), dwant(local.numel()), dgot(local.numel(), T(-1));
      cross_entropy_grad(logits.data(), full, targets.data(), reduction, hasIgnore, -100, dy,
                         dfull.data());
      takeShard(dfull.data(), full, split, me, dwant.data(), sizeof(T));
      cross_entropy_vocab_parallel_grad(c, mine.data(), local, me * perRank, targets.data(),
                                        reduction, hasIgnore, -100, dy, dgot.data());
      EXPECT_EQ(mismatchesNear(dgot, dwant, "cross_entropy_vocab_parallel_grad, " + what), 0);
    }
  }
}

TEST(VocabParallel, CrossEntropyFloat) { checkCrossEntropy<float>(0); }
TEST(VocabParallel, CrossEntropyDouble) { checkCrossEntropy<double>(0); }
TEST(VocabParallel, CrossEntropySpatialFloat) { checkCrossEntropy<float>(3); }
TEST(VocabParallel, CrossEntropySpatialDouble) { checkCrossEntropy<double>(3); }

/// On ranks other than 0: only failures, prefixed with the rank.
class RankFailurePrinter : public testing::EmptyTestEventListener {
public:
  explicit RankFailurePrinter(int rank) : rank(rank) {}
  void OnTestPartResult(const testing::TestPartResult &r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank,
                   r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }

private:
  int rank;
};

bool launchedByMpi() {
  for (const char *v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(v))
      return true;
  return false;
}

} // namespace

int main(int argc, char **argv) {
  std::unique_ptr<Communicator> world =
      launchedByMpi() ? makeMpiWorld(&argc, &argv) : makeSelfCommunicator();
  gComm = world.get();
  testing::InitGoogleTest(&argc, argv);
  if (world->rank() != 0) {
    testing::TestEventListeners &listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(world->rank()));
  } else if (world->size() == 1) {
    std::printf("runtime-dist: one rank (not under mpirun): the multi-rank checks run on a "
                "group of 1\n");
  }
  int64_t failed = RUN_ALL_TESTS() != 0;
  world->allReduce(&failed, 1, CommType::I64, ReduceOp::Max);
  if (world->rank() == 0 && world->size() > 1)
    std::printf("runtime-dist: %d ranks, %s\n", world->size(),
                failed ? "some rank failed" : "all ranks passed");
  world.reset();
  finalizeComm();
  return failed ? 1 : 0;
}
