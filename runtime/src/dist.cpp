//===- dist.cpp - layouts of tensors split over a mesh axis ---------------===//
//
// A tensor of shape [..., F, ...] split as Split{dim, groups, parts} is viewed
// as [outer, groups, parts, chunk * inner] (outer: the dimensions before dim,
// inner: those after, chunk = F / (groups * parts)); piece i is
// [outer, groups, chunk * inner] taken at index i of the `parts` axis. Moving
// a piece is therefore outer * groups contiguous copies of chunk * inner
// elements. The collectives pack or unpack the pieces of every rank in rank
// order in a scratch buffer around one Communicator call; when a piece is one
// contiguous block of the full tensor (outer * groups = 1) they run on the
// caller's buffers directly.
//
// The vocab-parallel kernels declared in dist.h live in kernels_gather_loss.cpp,
// beside the serial kernels whose arithmetic they share.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/dist.h"

#include <omp.h>

#include <cstring>
#include <vector>

namespace carve::rt {

namespace {

/// Bytes copied before a shard copy is worth an OpenMP team.
constexpr int64_t kParallelBytes = int64_t(1) << 20;

int64_t product(const Dims &d, int lo, int hi) {
  int64_t n = 1;
  for (int i = lo; i < hi; ++i)
    n *= d.d[i];
  return n;
}

/// Copies piece `index`: rows of rowBytes between the full layout (row
/// (o * groups + g) * parts + index) and the local one (row o * groups + g).
void copyPiece(const SplitRows &g, int index, const char *from, char *to, bool toLocal) {
  const int64_t rows = g.outer * g.groups;
  if (rows == 0 || g.rowBytes == 0)
    return;
  const size_t n = static_cast<size_t>(g.rowBytes);
  const bool parallel = rows > 1 && rows * g.rowBytes >= kParallelBytes && !omp_in_parallel();
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t fullRow = r * g.parts + index;
    if (toLocal)
      std::memcpy(to + r * g.rowBytes, from + fullRow * g.rowBytes, n);
    else
      std::memcpy(to + fullRow * g.rowBytes, from + r * g.rowBytes, n);
  }
}

/// A per-thread byte buffer of at least n bytes, reused across calls. Slot 0
/// and slot 1 may be live at the same time.
char *scratchBytes(int slot, int64_t n) {
  thread_local std::vector<char> bufs[2];
  if (static_cast<int64_t>(bufs[slot].size()) < n)
    bufs[slot].resize(static_cast<size_t>(n));
  return bufs[slot].data();
}

} // namespace

void checkSplit(const char *op, const Dims &shape, Split s) {
  if (s.dim < 0 || s.dim >= shape.rank || s.groups < 1 || s.parts < 1)
    fatal("%s: split of dimension %d in %lld group(s) over %d part(s) of a rank-%d tensor", op,
          s.dim, static_cast<long long>(s.groups), s.parts, shape.rank);
}

SplitRows splitRows(const char *op, const Dims &full, Split s, int elemBytes) {
  checkSplit(op, full, s);
  const int64_t f = full.d[s.dim];
  if (f % (s.groups * s.parts) != 0)
    fatal("%s: dimension %d of size %lld does not split into %lld group(s) of %d part(s)", op,
          s.dim, static_cast<long long>(f), static_cast<long long>(s.groups), s.parts);
  SplitRows g;
  g.outer = product(full, 0, s.dim);
  g.groups = s.groups;
  g.parts = s.parts;
  g.rowBytes = f / (s.groups * s.parts) * product(full, s.dim + 1, full.rank) * elemBytes;
  return g;
}

void checkSplitIndex(const char *op, Split s, int index) {
  if (index < 0 || index >= s.parts)
    fatal("%s: piece %d of a split over %d part(s)", op, index, s.parts);
}

void checkSplitParts(const char *op, const Communicator &c, Split s) {
  if (s.parts != c.size())
    fatal("%s: a split over %d part(s) on a group of %d rank(s)", op, s.parts, c.size());
}

Dims shardShape(Dims full, Split s) {
  splitRows("shardShape", full, s, 1);
  Dims local = full;
  local.d[s.dim] /= s.parts;
  return local;
}

Dims fullShape(Dims local, Split s) {
  checkSplit("fullShape", local, s);
  if (local.d[s.dim] % s.groups != 0)
    fatal("fullShape: local dimension %d of size %lld does not split into %lld group(s)", s.dim,
          static_cast<long long>(local.d[s.dim]), static_cast<long long>(s.groups));
  Dims full = local;
  full.d[s.dim] *= s.parts;
  return full;
}

void takeShard(const void *full, Dims fullShape, Split s, int index, void *local, int elemBytes) {
  const SplitRows g = splitRows("takeShard", fullShape, s, elemBytes);
  checkSplitIndex("takeShard", s, index);
  copyPiece(g, index, static_cast<const char *>(full), static_cast<char *>(local), true);
}

void placeShard(const void *local, Dims localShape, Split s, int index, void *full, int elemBytes) {
  const SplitRows g = splitRows("placeShard", fullShape(localShape, s), s, elemBytes);
  checkSplitIndex("placeShard", s, index);
  copyPiece(g, index, static_cast<const char *>(local), static_cast<char *>(full), false);
}

void allGatherSplit(Communicator &c, const void *local, Dims localShape, Split s, void *full,
                    CommType t) {
  checkSplitParts("allGatherSplit", c, s);
  const int es = commTypeBytes(t);
  const Dims fs = fullShape(localShape, s);
  const SplitRows g = splitRows("allGatherSplit", fs, s, es);
  const int64_t n = localShape.numel();
  if (g.outer * g.groups == 1) {
    c.allGather(local, full, n, t);
    return;
  }
  char *gathered = scratchBytes(0, n * es * c.size());
  c.allGather(local, gathered, n, t);
  for (int r = 0; r < c.size(); ++r)
    copyPiece(g, r, gathered + r * n * es, static_cast<char *>(full), false);
}

void reduceScatterSplit(Communicator &c, const void *full, Dims fullShape, Split s, void *local,
                        CommType t, ReduceOp op) {
  checkSplitParts("reduceScatterSplit", c, s);
  const int es = commTypeBytes(t);
  const SplitRows g = splitRows("reduceScatterSplit", fullShape, s, es);
  const int64_t n = fullShape.numel() / s.parts;
  thread_local std::vector<int64_t> counts;
  counts.assign(static_cast<size_t>(c.size()), n);
  if (g.outer * g.groups == 1) {
    c.reduceScatter(full, local, counts.data(), t, op);
    return;
  }
  char *packed = scratchBytes(0, n * es * c.size());
  for (int r = 0; r < c.size(); ++r)
    copyPiece(g, r, static_cast<const char *>(full), packed + r * n * es, true);
  c.reduceScatter(packed, local, counts.data(), t, op);
}

void allToAllSplit(Communicator &c, const void *in, Dims inLocalShape, Split from, Split to,
                   void *out, CommType t) {
  checkSplitParts("allToAllSplit", c, from);
  checkSplitParts("allToAllSplit", c, to);
  checkSplit("allToAllSplit", inLocalShape, to);
  if (from.dim == to.dim)
    fatal("allToAllSplit: from and to split the same dimension %d", from.dim);
  // Splits of different dimensions commute: the block this rank sends to
  // rank r is piece r (split `to`) of its input, and the block it receives
  // from rank i is piece i (split `from`) of its output.
  const int es = commTypeBytes(t);
  const Dims outShape = shardShape(fullShape(inLocalShape, from), to);
  const SplitRows send = splitRows("allToAllSplit", inLocalShape, to, es);
  const SplitRows recv = splitRows("allToAllSplit", outShape, from, es);
  const int64_t n = inLocalShape.numel() / c.size();
  char *packed = scratchBytes(0, n * es * c.size());
  char *received = scratchBytes(1, n * es * c.size());
  for (int r = 0; r < c.size(); ++r)
    copyPiece(send, r, static_cast<const char *>(in), packed + r * n * es, true);
  c.allToAll(packed, received, n, t);
  for (int r = 0; r < c.size(); ++r)
    copyPiece(recv, r, received + r * n * es, static_cast<char *>(out), false);
}

} // namespace carve::rt
