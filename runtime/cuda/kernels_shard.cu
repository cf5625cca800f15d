//===- kernels_shard.cu - shard layouts and tensor parallelism on the GPU -===//
//
// The shard layouts of dist.h (takeShard, placeShard and the split
// collectives built on them) and the gather from a table sharded by rows
// (vocab-parallel embeddings) and its gradient. Each mirrors the CPU function
// of the same name in runtime/src, with the same shape checks and messages.
// An index out of range is recorded in the device error record (internal.h)
// and reported at the next synchronize.
//
//===----------------------------------------------------------------------===//

#include "kernel_util.cuh"

#include <algorithm>
#include <climits>
#include <type_traits>
#include <vector>

namespace carve::gpu {

using carve::rt::kMaxRank;

namespace {

__global__ void gatherShardedKernel(const float *table, const int64_t *idx, float *y, int64_t rows,
                                    int64_t rowOffset, int64_t globalRows, int64_t inner,
                                    int64_t total, DeviceError *err) {
  CARVE_GRID_LOOP(e, total) {
    const int64_t k = e / inner, c = e - k * inner;
    const int64_t v = checkedIndex(idx, k, globalRows, err) - rowOffset;
    y[e] = v >= 0 && v < rows ? table[v * inner + c] : 0.0f;
  }
}

/// gatherGradOwnedKernel for a table that holds the global rows [rowOffset,
/// rowOffset + rows): the same order, the same ranges of local rows.
__global__ void gatherShardedGradKernel(const float *dy, const int64_t *idx, float *dtable,
                                        int64_t ni, int64_t rows, int64_t rowOffset,
                                        int64_t globalRows, int64_t inner, int64_t parts,
                                        int64_t partRows, DeviceError *err) {
  CARVE_GRID_LOOP(e, inner * parts) {
    const int64_t part = e / inner, c = e - part * inner;
    const int64_t v0 = part * partRows, v1 = v0 + partRows < rows ? v0 + partRows : rows;
    for (int64_t k = 0; k < ni; ++k) {
      int64_t g = idx[k];
      if (g < 0)
        g += globalRows;
      const int64_t v = g - rowOffset;
      if (g >= 0 && g < globalRows) {
        if (v >= v0 && v < v1)
          dtable[v * inner + c] += dy[k * inner + c];
      } else if (part == 0) {
        checkedIndex(idx, k, globalRows, err);
      }
    }
  }
}

void checkShardRows(const char *op, const Dims &ts, int64_t rowOffset, int64_t globalRows) {
  if (ts.rank < 1)
    fatal("%s: a table of rank 0", op);
  if (rowOffset < 0 || rowOffset + ts.d[0] > globalRows)
    fatal("%s: local rows [%lld, %lld) are outside the table's %lld rows", op, (long long)rowOffset,
          (long long)(rowOffset + ts.d[0]), (long long)globalRows);
}

//===--- Shard layouts (dist.h SplitRows) ----------------------------------===//

using carve::rt::checkSplit;
using carve::rt::checkSplitIndex;
using carve::rt::checkSplitParts;
using carve::rt::SplitRows;
using carve::rt::splitRows;

template <class U>
__global__ void copyRowsKernel(const U *from, U *to, int64_t rows, int64_t rowUnits, int64_t parts,
                               int64_t index, bool toLocal) {
  CARVE_GRID_LOOP(e, rows * rowUnits) {
    const int64_t r = e / rowUnits, c = e - r * rowUnits;
    const int64_t fullRow = r * parts + index;
    if (toLocal)
      to[r * rowUnits + c] = from[fullRow * rowUnits + c];
    else
      to[fullRow * rowUnits + c] = from[r * rowUnits + c];
  }
}

template <class U>
void copyRows(const SplitRows &g, int index, const char *from, char *to, bool toLocal) {
  const int64_t rows = g.outer * g.groups, units = g.rowBytes / static_cast<int64_t>(sizeof(U));
  CARVE_KERNEL(blocksFor(rows * units), kThreads, 0, stream(), copyRowsKernel)
  (reinterpret_cast<const U *>(from), reinterpret_cast<U *>(to), rows, units, g.parts, index,
   toLocal);
  checkLaunch("shard copy");
}

/// Copies piece `index` between the full layout (row (o * groups + g) *
/// parts + index) and the local one (row o * groups + g), in the widest
/// units that the addresses and the row length allow.
void copyPiece(const SplitRows &g, int index, const char *from, char *to, bool toLocal) {
  const int64_t rows = g.outer * g.groups;
  if (rows == 0 || g.rowBytes == 0)
    return;
  if (rows == 1) {
    const int64_t off = static_cast<int64_t>(index) * g.rowBytes;
    CARVE_CUDA_CHECK(cudaMemcpyAsync(toLocal ? to : to + off, toLocal ? from + off : from,
                                     static_cast<size_t>(g.rowBytes), cudaMemcpyDeviceToDevice,
                                     stream()));
    return;
  }
  const uintptr_t bits = reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to) |
                         static_cast<uintptr_t>(g.rowBytes);
  if (bits % 16 == 0)
    copyRows<uint4>(g, index, from, to, toLocal);
  else if (bits % 8 == 0)
    copyRows<uint2>(g, index, from, to, toLocal);
  else if (bits % 4 == 0)
    copyRows<uint32_t>(g, index, from, to, toLocal);
  else if (bits % 2 == 0)
    copyRows<uint16_t>(g, index, from, to, toLocal);
  else
    copyRows<uint8_t>(g, index, from, to, toLocal);
}

} // namespace

//===--- Tensor parallelism ------------------------------------------------===//

void takeShard(const void *full, Dims fullShape, Split s, int index, void *local, int elemBytes) {
  const SplitRows g = splitRows("takeShard", fullShape, s, elemBytes);
  checkSplitIndex("takeShard", s, index);
  copyPiece(g, index, static_cast<const char *>(full), static_cast<char *>(local), true);
}

void placeShard(const void *local, Dims localShape, Split s, int index, void *full, int elemBytes) {
  const SplitRows g = splitRows("placeShard", carve::rt::fullShape(localShape, s), s, elemBytes);
  checkSplitIndex("placeShard", s, index);
  copyPiece(g, index, static_cast<const char *>(local), static_cast<char *>(full), false);
}

void allGatherSplit(Communicator &c, const void *local, Dims localShape, Split s, void *full,
                    CommType t) {
  checkSplitParts("allGatherSplit", c, s);
  const int es = commTypeBytes(t);
  const Dims fs = carve::rt::fullShape(localShape, s);
  const SplitRows g = splitRows("allGatherSplit", fs, s, es);
  const int64_t n = localShape.numel();
  if (g.outer * g.groups == 1) {
    c.wait(c.allGatherAsync(local, full, n, t));
    return;
  }
  char *gathered = static_cast<char *>(workspace(n * es * c.size(), kWsBasic0));
  c.wait(c.allGatherAsync(local, gathered, n, t));
  for (int r = 0; r < c.size(); ++r)
    copyPiece(g, r, gathered + r * n * es, static_cast<char *>(full), false);
}

void reduceScatterSplit(Communicator &c, const void *full, Dims fullShape, Split s, void *local,
                        CommType t, ReduceOp op) {
  checkSplitParts("reduceScatterSplit", c, s);
  const int es = commTypeBytes(t);
  const SplitRows g = splitRows("reduceScatterSplit", fullShape, s, es);
  const int64_t n = fullShape.numel() / s.parts;
  const std::vector<int64_t> counts(static_cast<size_t>(c.size()), n);
  if (g.outer * g.groups == 1) {
    c.wait(c.reduceScatterAsync(full, local, counts.data(), t, op));
    return;
  }
  char *packed = static_cast<char *>(workspace(n * es * c.size(), kWsBasic0));
  for (int r = 0; r < c.size(); ++r)
    copyPiece(g, r, static_cast<const char *>(full), packed + r * n * es, true);
  c.wait(c.reduceScatterAsync(packed, local, counts.data(), t, op));
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
  const Dims outShape = carve::rt::shardShape(carve::rt::fullShape(inLocalShape, from), to);
  const SplitRows send = splitRows("allToAllSplit", inLocalShape, to, es);
  const SplitRows recv = splitRows("allToAllSplit", outShape, from, es);
  const int64_t n = inLocalShape.numel() / c.size();
  char *packed = static_cast<char *>(workspace(n * es * c.size(), kWsBasic0));
  char *received = static_cast<char *>(workspace(n * es * c.size(), kWsBasic1));
  for (int r = 0; r < c.size(); ++r)
    copyPiece(send, r, static_cast<const char *>(in), packed + r * n * es, true);
  c.wait(c.allToAllAsync(packed, received, n, t));
  for (int r = 0; r < c.size(); ++r)
    copyPiece(recv, r, received + r * n * es, static_cast<char *>(out), false);
}

void gather_sharded(const float *table, Dims ts, int64_t rowOffset, int64_t globalRows,
                    const int64_t *idx, Dims is, float *y) {
  checkShardRows("gather_sharded", ts, rowOffset, globalRows);
  const int64_t rows = ts.d[0], inner = prod(ts, 1, ts.rank), total = is.numel() * inner;
  if (total == 0)
    return;
  CARVE_KERNEL(blocksFor(total), kThreads, 0, stream(), gatherShardedKernel)
  (table, idx, y, rows, rowOffset, globalRows, inner, total, deviceError());
  checkLaunch("gather_sharded");
}

void gather_sharded_grad(const float *dy, const int64_t *idx, Dims is, int64_t rowOffset,
                         int64_t globalRows, float *dtable, Dims ts) {
  checkShardRows("gather_sharded_grad", ts, rowOffset, globalRows);
  const int64_t rows = ts.d[0], inner = prod(ts, 1, ts.rank), total = is.numel() * inner;
  fill(dtable, ts.numel(), 0.0f);
  if (total == 0 || rows == 0)
    return;
  const int64_t parts = gatherGradParts(inner, rows);
  const int64_t partRows = (rows + parts - 1) / parts;
  CARVE_KERNEL(blocksFor(inner * parts), kThreads, 0, stream(), gatherShardedGradKernel)
  (dy, idx, dtable, is.numel(), rows, rowOffset, globalRows, inner, parts, partRows, deviceError());
  checkLaunch("gather_sharded_grad");
}

} // namespace carve::gpu
