//===- kernels_data.cu - data movement on the GPU --------------------------===//
//
// The gpu.h functions that move data without computing on it (transpose,
// slice and its gradient, concat, gather and its gradient, expand); the
// shard layouts of dist.h and the gather from a table sharded by rows are in
// kernels_shard.cu. Each mirrors the CPU function of the same name in
// runtime/src/kernels_*.cpp, with the same shape checks and messages.
//
// Views (transpose, slice, expand) are read through the loop nests of
// elementwise.h; a transpose that moves the contiguous dimension goes
// through 32 x 32 tiles in shared memory so that reads and writes are both
// coalesced. An index out of range is recorded in the device error record
// (internal.h) and reported at the next synchronize.
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

//===--- Data movement -----------------------------------------------------===//

/// y[e] = x[offset of e in the view].
/// Y: `T *`, or Out16 (floats with their 16-bit copy: transpose16).
template <class T, class Y> __global__ void viewKernel(const T *x, Nest<1> n, Y y, int64_t total) {
  CARVE_GRID_LOOP(e, total) {
    int64_t off[1];
    offsetsOf(n, e, off);
    store(y, e, x[off[0]]);
  }
}

/// x[offset of e in the view] = y[e].
template <class T> __global__ void scatterViewKernel(const T *y, Nest<1> n, T *x, int64_t total) {
  CARVE_GRID_LOOP(e, total) {
    int64_t off[1];
    offsetsOf(n, e, off);
    x[off[0]] = y[e];
  }
}

template <class T, class Y>
void gatherView(const char *op, const T *x, const Nest<1> &n, Y y, int64_t total) {
  CARVE_KERNEL(blocksFor(total), kThreads, 0, stream(), viewKernel)(x, n, y, total);
  checkLaunch(op);
}

/// The outer dimensions of a tiled transpose and their strides in x and y.
struct TileOuter {
  int no = 0;
  int64_t od[kMaxRank] = {}, xs[kMaxRank] = {}, ys[kMaxRank] = {};
};

constexpr int kTile = 32;
constexpr int kTileRows = 8;

/// Transposes 32 x 32 tiles between dimension k (contiguous in x, stride yk
/// in y) and dimension l (stride xl in x, contiguous in y) through shared
/// memory, so that both the reads and the writes are coalesced.
template <class T, class Y>
__global__ void transposeTilesKernel(const T *x, Y y, TileOuter g, int64_t dk, int64_t dl,
                                     int64_t xl, int64_t yk, int64_t tk, int64_t tl,
                                     int64_t tiles) {
  __shared__ T tile[kTile][kTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    int64_t o = t / (tk * tl);
    const int64_t rem = t - o * (tk * tl);
    const int64_t k0 = (rem / tl) * kTile, l0 = (rem % tl) * kTile;
    int64_t xo = 0, yo = 0;
    for (int i = g.no - 1; i >= 0; --i) {
      const int64_t ii = o % g.od[i];
      o /= g.od[i];
      xo += ii * g.xs[i];
      yo += ii * g.ys[i];
    }
    for (int j = ty; j < kTile; j += kTileRows) {
      const int64_t k = k0 + tx, l = l0 + j;
      if (k < dk && l < dl)
        tile[j][tx] = x[xo + k + l * xl];
    }
    __syncthreads();
    for (int j = ty; j < kTile; j += kTileRows) {
      const int64_t k = k0 + j, l = l0 + tx;
      if (k < dk && l < dl)
        store(y, yo + k * yk + l, tile[tx][j]);
    }
    __syncthreads();
  }
}

/// Up to kConcatParts parts of a concatenation, one launch: part i holds
/// columns [col[i], col[i] + len[i]) of each of the `outer` rows of y.
constexpr int kConcatParts = 8;
template <class T> struct ConcatParts {
  int n = 0;
  const T *x[kConcatParts] = {};
  int64_t len[kConcatParts] = {}, col[kConcatParts] = {};
};

/// Writes columns [first, first + width) of every row of y from the parts
/// that hold them (coalesced writes; each element read from its part).
/// Y: `T *`, or Out16 (floats with the result's 16-bit copy: concat16).
template <class T, class Y>
__global__ void concatKernel(ConcatParts<T> p, Y y, int64_t outer, int64_t row, int64_t first,
                             int64_t width) {
  CARVE_GRID_LOOP(e, outer * width) {
    int64_t o, j;
    divMod(e, width, o, j);
    j += first;
    int i = 0;
    while (i + 1 < p.n && j >= p.col[i] + p.len[i])
      ++i;
    store(y, o * row + j, p.x[i][o * p.len[i] + (j - p.col[i])]);
  }
}

/// Tab: `const T *`, or In16 (a float table read as its 16-bit tensor: gather16).
template <class Tab, class T>
__global__ void gatherKernel(Tab table, const int64_t *idx, T *y, int64_t ni, int64_t size,
                             int64_t inner, int64_t total, DeviceError *err) {
  CARVE_GRID_LOOP(e, total) {
    int64_t t, c, o, k;
    divMod(e, inner, t, c);
    divMod(t, ni, o, k);
    const int64_t v = checkedIndex(idx, k, size, err);
    y[e] = v < 0 ? T(0) : table[(o * size + v) * inner + c];
  }
}

/// The scatter-add of a gather's gradient into the zeroed dtable, in the
/// CPU target's order: each element of dtable sums its dy rows by increasing
/// index position k, so the result is the same on every run and on both
/// targets (atomics would add in the order threads happen to arrive, a
/// different float sum each run). A thread owns column c of outer index o for
/// the table rows [v0, v0 + rows) and walks every index, adding the rows of
/// the indices that fall in its range; the rows are split into `parts` ranges
/// so that a small outer * inner (an embedding's one table) still fills the
/// GPU. Indices out of range are recorded once, by the part that owns row 0.
/// With `dtable16` (gather_grad16, float tables): each thread then writes
/// its rows' 16-bit copies (format `fmt`: 1 bf16, 2 fp16, rounded to nearest
/// even as toBf16 / toF16 round) from the sums it finished.
template <class T>
__global__ void gatherGradOwnedKernel(const T *dy, const int64_t *idx, T *dtable, int64_t ni,
                                      int64_t size, int64_t inner, int64_t outer, int64_t parts,
                                      int64_t rows, DeviceError *err, uint16_t *dtable16, int fmt) {
  CARVE_GRID_LOOP(e, outer * inner * parts) {
    const int64_t part = e / (outer * inner), oc = e - part * (outer * inner);
    const int64_t o = oc / inner, c = oc - o * inner;
    const int64_t v0 = part * rows, v1 = v0 + rows < size ? v0 + rows : size;
    T *col = dtable + o * size * inner + c;
    const T *src = dy + o * ni * inner + c;
    for (int64_t k = 0; k < ni; ++k) {
      int64_t v = idx[k];
      if (v < 0)
        v += size; // ONNX Gather's negative indices, as checkedIndex
      if (v >= v0 && v < v1)
        col[v * inner] += src[k * inner];
      else if ((v < 0 || v >= size) && part == 0)
        checkedIndex(idx, k, size, err);
    }
    if constexpr (std::is_same_v<T, float>)
      if (dtable16)
        for (int64_t v = v0; v < v1; ++v) {
          const float x = col[v * inner];
          dtable16[o * size * inner + v * inner + c] =
              fmt == 1 ? carve::rt::ew::bf16Bits(x) : carve::rt::ew::f16Bits(x);
        }
  }
}

//===--- gather_grad with one element per index (im2col's windows) -------===//
//
// With inner == 1 (a convolution's windows gathered from an image, or a plain
// gather of scalars) gatherGradOwnedKernel's lanes read dy and write dtable a
// row apart, and each walks all ni indices for its 1/parts of the table: on an
// H200, VGG's 3x3 input gradients took 0.6 ms each, 40% of the step. Instead
// the indices are inverted first: counted per table row, placed in per-row
// lists (CSR) and each list sorted by position, so a thread per (outer, row)
// then adds its row's dy elements in increasing index position, coalesced
// across rows. That is the CPU target's order: the same floats, bitwise.

/// Thread t's exclusive prefix of the block's `mine` values in thread order
/// (the sum over threads 0 to t - 1), through `scratch` (blockDim.x + 1
/// entries of shared memory), and the block's total. Every thread of the block calls
/// it.
__device__ int64_t blockExclusiveScan(int64_t mine, int64_t *scratch, int64_t &total) {
  scratch[threadIdx.x] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t sum = 0;
    for (unsigned t = 0; t < blockDim.x; ++t) {
      const int64_t c = scratch[t];
      scratch[t] = sum;
      sum += c;
    }
    scratch[blockDim.x] = sum;
  }
  __syncthreads();
  total = scratch[blockDim.x];
  return scratch[threadIdx.x];
}

__global__ void gatherInvCountKernel(const int64_t *idx, int64_t ni, int64_t size, int *count,
                                     DeviceError *err) {
  CARVE_GRID_LOOP(k, ni) {
    const int64_t v = checkedIndex(idx, k, size, err);
    if (v >= 0)
      atomicAdd(&count[v], 1);
  }
}

/// One block: offsets[v] = the counts of the rows before v (offsets[size] the
/// total), and count[v] becomes row v's placing cursor, offsets[v].
__global__ void gatherInvScanKernel(int *count, int64_t size, int *offsets) {
  __shared__ int64_t partial[kThreads + 1];
  const int64_t chunk = (size + blockDim.x - 1) / blockDim.x;
  const int64_t lo = threadIdx.x * chunk, hi = lo + chunk < size ? lo + chunk : size;
  int64_t mine = 0;
  for (int64_t v = lo; v < hi; ++v)
    mine += count[v];
  int64_t total = 0;
  int64_t at = blockExclusiveScan(mine, partial, total);
  if (threadIdx.x == 0)
    offsets[size] = static_cast<int>(total);
  for (int64_t v = lo; v < hi; ++v) {
    const int c = count[v];
    offsets[v] = static_cast<int>(at);
    count[v] = static_cast<int>(at);
    at += c;
  }
}

__global__ void gatherInvPlaceKernel(const int64_t *idx, int64_t ni, int64_t size, int *cursor,
                                     int *list) {
  CARVE_GRID_LOOP(k, ni) {
    int64_t v = idx[k];
    if (v < 0)
      v += size;
    if (v >= 0 && v < size) // out of range: recorded by the count
      list[atomicAdd(&cursor[v], 1)] = static_cast<int>(k);
  }
}

/// Rows of at most kShortRow positions (a 3x3 window's pixel is in at most 9)
/// sort by insertion, a thread each; the longer ones (the padding element's:
/// 372 positions for a 3x3 convolution on 32x32 images) a block each.
constexpr int kShortRow = 32;

__global__ void gatherInvSortShortKernel(const int *offsets, int64_t size, int *list) {
  CARVE_GRID_LOOP(v, size) {
    int *a = list + offsets[v];
    const int n = offsets[v + 1] - offsets[v];
    if (n > kShortRow)
      continue;
    for (int i = 1; i < n; ++i) {
      const int x = a[i];
      int j = i - 1;
      for (; j >= 0 && a[j] > x; --j)
        a[j + 1] = a[j];
      a[j + 1] = x;
    }
  }
}

/// Block v sorts row v's positions when there are more than kShortRow: a
/// bitonic network over the next power of two N >= n, every comparator
/// ascending (each merge starts by comparing mirrored pairs), so the
/// positions past n act as +infinity and their comparators are skipped.
__global__ void gatherInvSortLongKernel(const int *offsets, int *list) {
  const int v = blockIdx.x;
  int *a = list + offsets[v];
  const int n = offsets[v + 1] - offsets[v];
  if (n <= kShortRow)
    return;
  int N = 1;
  while (N < n)
    N <<= 1;
  auto order = [a, n](int i, int j) {
    if (j < n && a[i] > a[j]) {
      const int t = a[i];
      a[i] = a[j];
      a[j] = t;
    }
  };
  for (int width = 2; width <= N; width <<= 1) {
    const int half = width / 2;
    for (int t = threadIdx.x; t < N / 2; t += blockDim.x) {
      const int base = (t / half) * width, off = t % half;
      order(base + off, base + width - 1 - off);
    }
    __syncthreads();
    for (int stride = half / 2; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < N / 2; t += blockDim.x) {
        const int i = (t / stride) * 2 * stride + t % stride;
        order(i, i + stride);
      }
      __syncthreads();
    }
  }
}

/// dtable[o, v] = the sum of dy[o, k] over row v's positions k, in order,
/// from 0 (every element written: no zeroing before).
template <class T>
__global__ void gatherGradRowsKernel(const T *dy, const int *offsets, const int *list, T *dtable,
                                     int64_t ni, int64_t size, int64_t outer, uint16_t *dtable16,
                                     int fmt) {
  CARVE_GRID_LOOP(e, outer * size) {
    int64_t o, v;
    divMod(e, size, o, v);
    const T *src = dy + o * ni;
    T acc = T(0);
    for (int j = offsets[v], end = offsets[v + 1]; j < end; ++j)
      acc += src[list[j]];
    dtable[e] = acc;
    if constexpr (std::is_same_v<T, float>)
      if (dtable16)
        dtable16[e] = fmt == 1 ? carve::rt::ew::bf16Bits(acc) : carve::rt::ew::f16Bits(acc);
  }
}

} // namespace

//===--- Data movement -----------------------------------------------------===//

namespace {

/// `xst`: x's strides (a strided view), or null (contiguous).
template <class T, class Y>
void transposeAs(const T *x, Dims xs, Dims perm, Y y, const int64_t *xst = nullptr) {
  if (xst)
    for (int i = 0; i < xs.rank; ++i)
      if (xst[i] < 0)
        fatal("transpose_view: stride %lld of dimension %d is negative", (long long)xst[i], i);
  const Nest<1> n = transposeNest(xs, perm, xst);
  const int64_t total = xs.numel();
  if (total == 0)
    return;
  bool unit = false; // a dimension contiguous in x: what the tiles need
  for (int i = 0; i < n.rank; ++i)
    unit |= n.st[0][i] == 1;
  if (n.rank == 0 || n.inner(0) == 1 || !unit)
    return gatherView("transpose", x, n, y, total);

  // The last y dimension is strided in x: tiles between it and the y
  // dimension that is contiguous in x.
  const int last = n.rank - 1;
  int kx = 0;
  while (n.st[0][kx] != 1)
    ++kx;
  int64_t yst[kMaxRank];
  yst[last] = 1;
  for (int i = last - 1; i >= 0; --i)
    yst[i] = yst[i + 1] * n.d[i + 1];
  TileOuter g;
  for (int i = 0; i < n.rank; ++i) {
    if (i == kx || i == last)
      continue;
    g.od[g.no] = n.d[i];
    g.xs[g.no] = n.st[0][i];
    g.ys[g.no++] = yst[i];
  }
  const int64_t dk = n.d[kx], dl = n.d[last], xl = n.st[0][last], yk = yst[kx];
  const int64_t tk = (dk + kTile - 1) / kTile, tl = (dl + kTile - 1) / kTile;
  const int64_t tiles = total / (dk * dl) * tk * tl;
  const int blocks = static_cast<int>(std::min<int64_t>(tiles, 65535 * 8));
  CARVE_KERNEL(blocks, dim3(kTile, kTileRows), 0, stream(), transposeTilesKernel)
  (x, y, g, dk, dl, xl, yk, tk, tl, tiles);
  checkLaunch("transpose");
}

} // namespace

template <class T> void transpose(const T *x, Dims xs, Dims perm, T *y) {
  transposeAs(x, xs, perm, y);
}

void transpose16(const float *x, Dims xs, Dims perm, float *y, uint16_t *y16, bool round) {
  transposeAs(x, xs, perm, Out16{y, y16, format16For("transpose16"), round});
}

template <class T> void transpose_view(const T *x, Dims xs, Dims xst, Dims perm, T *y) {
  if (xst.rank != xs.rank)
    fatal("transpose_view: %d strides for a view of rank %d", xst.rank, xs.rank);
  transposeAs(x, xs, perm, y, xst.d);
}

void transpose16_view(const float *x, Dims xs, Dims xst, Dims perm, float *y, uint16_t *y16,
                      bool round) {
  if (xst.rank != xs.rank)
    fatal("transpose16_view: %d strides for a view of rank %d", xst.rank, xs.rank);
  transposeAs(x, xs, perm, Out16{y, y16, format16For("transpose16_view"), round}, xst.d);
}

template <class T> void slice(const T *x, Dims xs, Dims starts, Dims steps, T *y, Dims ys) {
  int64_t base;
  const Nest<1> n = sliceNest("slice", xs, starts, steps, ys, base);
  const int64_t total = ys.numel();
  if (total)
    gatherView("slice", x + base, n, y, total);
}

template <class T> void slice_grad(const T *dy, Dims ys, Dims starts, Dims steps, T *dx, Dims xs) {
  int64_t base;
  const Nest<1> n = sliceNest("slice_grad", xs, starts, steps, ys, base);
  fill(dx, xs.numel(), T(0));
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  CARVE_KERNEL(blocksFor(total), kThreads, 0, stream(), scatterViewKernel)(dy, n, dx + base, total);
  checkLaunch("slice_grad");
}

namespace {

template <class T, class Y>
void concatAs(int n, const T *const *xs, const Dims *shapes, int axis, Y y) {
  if (n < 1)
    fatal("concat: no inputs");
  const Dims &s0 = shapes[0];
  axis = normAxis(axis, s0.rank, "concat");
  const int64_t outer = prod(s0, 0, axis);
  int64_t row = 0;
  for (int i = 0; i < n; ++i) {
    const Dims &s = shapes[i];
    if (s.rank != s0.rank)
      fatal("concat: input %d has rank %d, input 0 rank %d", i, s.rank, s0.rank);
    for (int j = 0; j < s.rank; ++j)
      if (j != axis && s.d[j] != s0.d[j])
        fatal("concat: input %d has size %lld on axis %d, input 0 %lld", i, (long long)s.d[j], j,
              (long long)s0.d[j]);
    row += prod(s, axis, s.rank);
  }
  if (outer == 0 || row == 0)
    return;
  // The non-empty parts, kConcatParts to a launch.
  ConcatParts<T> g;
  auto launch = [&] {
    if (g.n == 0)
      return;
    const int64_t first = g.col[0], width = g.col[g.n - 1] + g.len[g.n - 1] - first;
    CARVE_KERNEL(blocksFor(outer * width), kThreads, 0, stream(), concatKernel)
    (g, y, outer, row, first, width);
    checkLaunch("concat");
    g = ConcatParts<T>();
  };
  int64_t col = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t len = prod(shapes[i], axis, shapes[i].rank);
    if (len > 0) {
      g.x[g.n] = xs[i];
      g.len[g.n] = len;
      g.col[g.n++] = col;
      if (g.n == kConcatParts)
        launch();
    }
    col += len;
  }
  launch();
}

} // namespace

template <class T> void concat(int n, const T *const *xs, const Dims *shapes, int axis, T *y) {
  concatAs(n, xs, shapes, axis, y);
}

void concat16(int n, const float *const *xs, const Dims *shapes, int axis, float *y, uint16_t *y16,
              bool round) {
  concatAs(n, xs, shapes, axis, Out16{y, y16, format16For("concat16"), round});
}

namespace {
__global__ void store16RowsKernel(const float *x, int64_t rows, int64_t cols, uint16_t *y,
                                  int64_t ldy, int fmt) {
  CARVE_GRID_LOOP(i, rows * cols) {
    const int64_t r = i / cols, c = i - r * cols;
    store(Out16{nullptr, y, fmt, false}, r * ldy + c, x[i]);
  }
}
} // namespace

void store16Rows(const float *x, int64_t rows, int64_t cols, uint16_t *y, int64_t ldy) {
  if (rows <= 0 || cols <= 0)
    return;
  if (ldy < cols)
    fatal("store16Rows: a row stride of %lld for rows of %lld", (long long)ldy, (long long)cols);
  CARVE_KERNEL(blocksFor(rows * cols), kThreads, 0, stream(), store16RowsKernel)
  (x, rows, cols, y, ldy, format16For("store16Rows"));
  checkLaunch("store16Rows");
}

__global__ void load16BthdKernel(In16 x, int64_t b, int64_t t, int64_t h, int64_t d, int64_t ldx,
                                 float *y) {
  CARVE_GRID_LOOP(i, b * h * t * d) {
    int64_t r = i;
    const int64_t di = r % d;
    r /= d;
    const int64_t ti = r % t;
    r /= t;
    const int64_t hi = r % h;
    const int64_t bi = r / h;
    y[i] = x[(bi * t + ti) * ldx + hi * d + di];
  }
}
void load16Bthd(const uint16_t *x, int64_t b, int64_t t, int64_t h, int64_t d, int64_t ldx,
                float *y) {
  const int64_t n = b * t * h * d;
  if (n <= 0)
    return;
  if (ldx < h * d)
    fatal("load16Bthd: a row stride of %lld for rows of %lld heads x %lld", (long long)ldx,
          (long long)h, (long long)d);
  CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), load16BthdKernel)
  (in16("load16Bthd", x, true), b, t, h, d, ldx, y);
  checkLaunch("load16Bthd");
}

namespace {

/// Whether gather_grad of scalars (inner == 1) goes through the inverted
/// indices: ni positions into `size` rows, both within int.
bool byInverse(int64_t ni, int64_t size) {
  return ni > 0 && ni < INT_MAX && size > 0 && size < INT_MAX;
}

/// Bytes of the inverted indices: offsets[size + 1], cursors[size], list[ni]
/// (ints), rounded up to 256 so that what follows them stays aligned.
size_t inverseBytes(int64_t ni, int64_t size) {
  const size_t b = sizeof(int) * static_cast<size_t>(2 * size + 1 + ni);
  return (b + 255) & ~size_t(255);
}

/// Inverts `idx` into `inv` (inverseBytes): each row's positions, counted,
/// placed and sorted (the list starts at inv + 2 * size + 1). An index out of
/// range is recorded in the device error record.
void invertIndices(const int64_t *idx, int64_t ni, int64_t size, int *inv) {
  int *offsets = inv, *cursor = offsets + size + 1, *list = cursor + size;
  CARVE_CUDA_CHECK(cudaMemsetAsync(cursor, 0, sizeof(int) * size, stream()));
  CARVE_KERNEL(blocksFor(ni), kThreads, 0, stream(), gatherInvCountKernel)
  (idx, ni, size, cursor, deviceError());
  CARVE_KERNEL(1, kThreads, 0, stream(), gatherInvScanKernel)(cursor, size, offsets);
  CARVE_KERNEL(blocksFor(ni), kThreads, 0, stream(), gatherInvPlaceKernel)
  (idx, ni, size, cursor, list);
  CARVE_KERNEL(blocksFor(size), kThreads, 0, stream(), gatherInvSortShortKernel)
  (offsets, size, list);
  CARVE_KERNEL(static_cast<unsigned>(size), 128, 0, stream(), gatherInvSortLongKernel)
  (offsets, list);
  checkLaunch("gather_grad (inverting the indices)");
}

} // namespace

namespace {

template <class Tab, class T>
void gatherAs(Tab table, Dims ts, const int64_t *idx, Dims is, int axis, T *y) {
  axis = normAxis(axis, ts.rank, "gather");
  const int64_t outer = prod(ts, 0, axis), size = ts.d[axis], inner = prod(ts, axis + 1, ts.rank);
  const int64_t total = outer * is.numel() * inner;
  if (total == 0)
    return;
  CARVE_KERNEL(blocksFor(total), kThreads, 0, stream(), gatherKernel)
  (table, idx, y, is.numel(), size, inner, total, deviceError());
  checkLaunch("gather");
}

} // namespace

template <class T>
void gather(const T *table, Dims ts, const int64_t *idx, Dims is, int axis, T *y) {
  gatherAs(table, ts, idx, is, axis, y);
}

void gather16(const void *table, Dims ts, const int64_t *idx, Dims is, int axis, float *y) {
  gatherAs(in16("gather16", table, true), ts, idx, is, axis, y);
}

namespace {

template <class T>
void gatherGradAs(const T *dy, const int64_t *idx, Dims is, int axis, T *dtable, Dims ts,
                  uint16_t *dtable16, int fmt) {
  axis = normAxis(axis, ts.rank, "gather_grad");
  const int64_t outer = prod(ts, 0, axis), size = ts.d[axis], inner = prod(ts, axis + 1, ts.rank);
  const int64_t ni = is.numel();
  if (inner == 1 && byInverse(ni, size) && outer > 0) {
    int *inv = static_cast<int *>(workspace(inverseBytes(ni, size), kWsBasic0));
    invertIndices(idx, ni, size, inv);
    CARVE_KERNEL(blocksFor(outer * size), kThreads, 0, stream(), gatherGradRowsKernel)
    (dy, inv, inv + size + 1 + size, dtable, ni, size, outer, dtable16, fmt);
    checkLaunch("gather_grad");
    return;
  }
  fill(dtable, ts.numel(), T(0));
  const int64_t total = outer * ni * inner;
  if (total == 0) {
    if (dtable16 && ts.numel() > 0) // all zeros: zero bits in both formats
      CARVE_CUDA_CHECK(cudaMemsetAsync(dtable16, 0, sizeof(uint16_t) * ts.numel(), stream()));
    return;
  }
  const int64_t parts = gatherGradParts(outer * inner, size);
  const int64_t rows = (size + parts - 1) / parts;
  CARVE_KERNEL(blocksFor(outer * inner * parts), kThreads, 0, stream(), gatherGradOwnedKernel)
  (dy, idx, dtable, ni, size, inner, outer, parts, rows, deviceError(), dtable16, fmt);
  checkLaunch("gather_grad");
}

} // namespace

template <class T>
void gather_grad(const T *dy, const int64_t *idx, Dims is, int axis, T *dtable, Dims ts) {
  gatherGradAs<T>(dy, idx, is, axis, dtable, ts, nullptr, 0);
}

void gather_grad16(const float *dy, const int64_t *idx, Dims is, int axis, float *dtable, Dims ts,
                   uint16_t *dtable16) {
  gatherGradAs<float>(dy, idx, is, axis, dtable, ts, dtable16,
                      dtable16 ? format16For("gather_grad16") : 0);
}

//===--- A convolution's windows, a piece at a time ------------------------===//

namespace {

/// A piece of an operand along the result's first dimension (the samples):
/// pieced when the operand has that dimension too, else shared by every
/// piece (matmul broadcasts it).
struct PieceOperand {
  const float *p;
  Dims d;       // as stored
  int64_t unit; // elements per index of the first dimension; 0 when shared
  const float *at(int64_t j0) const { return p + j0 * unit; }
  Dims dims(int64_t c) const {
    Dims r = d;
    if (unit > 0)
      r.d[0] = c;
    return r;
  }
};

PieceOperand pieceOperand(const float *p, const Dims &d, const Dims &ys) {
  const bool pieced = d.rank == ys.rank && d.d[0] == ys.d[0] && ys.d[0] > 0;
  return {p, d, pieced ? d.numel() / ys.d[0] : 0};
}

/// Indices of the first dimension per piece: as many units of `unitBytes`
/// as fit in `budget`, at least one.
int64_t perPiece(int64_t unitBytes, int64_t count, int64_t budget) {
  return std::clamp<int64_t>(unitBytes > 0 ? budget / unitBytes : count, 1, count);
}

/// The shapes both kernels need: operands of rank >= 2 and a result of
/// their rank; a table whose rows, `is.numel()` indices each, are the
/// matrices of `rows` (the gathered operand, or the product) whole rows
/// each. Returns the elements of one such matrix.
int64_t checkShapes(const char *op, const Dims &as, const Dims &bs, const Dims &ys, const Dims &ts,
                    const Dims &is, const Dims &rows, const char *what) {
  if (as.rank < 2 || bs.rank < 2 || ys.rank < 2 || ys.rank != std::max(as.rank, bs.rank))
    fatal("%s: operands of rank %d and %d with a result of rank %d (both ranks must be >= 2 and "
          "the result's their maximum)",
          op, as.rank, bs.rank, ys.rank);
  if (ts.rank < 1)
    fatal("%s: a table of rank 0", op);
  const int64_t ni = is.numel(), outer = prod(ts, 0, ts.rank - 1);
  const int64_t mat = rows.d[rows.rank - 2] * rows.d[rows.rank - 1];
  if (outer * ni != rows.numel() || (mat > 0 && (ni == 0 || mat % ni != 0)))
    fatal("%s: %lld table rows of %lld indices do not make %s's matrices [%lld x %lld] of whole "
          "rows",
          op, (long long)outer, (long long)ni, what, (long long)rows.d[rows.rank - 2],
          (long long)rows.d[rows.rank - 1]);
  return mat;
}

} // namespace

void matmul_gathered(const float *a, Dims as, bool transA, const float *table, Dims ts,
                     const int64_t *idx, Dims is, Dims bs, bool transB, float *y, Dims ys,
                     int64_t pieceBytes) {
  const int64_t bMat =
      checkShapes("matmul_gathered", as, bs, ys, ts, is, bs, "the gathered operand");
  const int64_t size = ts.d[ts.rank - 1], ni = is.numel();
  const PieceOperand pa = pieceOperand(a, as, ys), pb = pieceOperand(table, bs, ys);
  const int64_t n0 = ys.rank > 2 ? ys.d[0] : 1;
  if (n0 <= 1 || pb.unit == 0 || bMat == 0 || ys.numel() == 0) {
    // No batch to go through, or an operand shared by every sample:
    // gathered whole, then matmul (which checks the shapes).
    float *w = static_cast<float *>(workspace(
        sizeof(float) * static_cast<size_t>(std::max<int64_t>(bs.numel(), 1)), kWsBasic2));
    carve::gpu::gather<float>(table, ts, idx, is, ts.rank - 1, w);
    matmul(a, as, transA, w, bs, transB, y, ys);
    return;
  }
  // Each piece of samples' windows (whole table rows) is gathered into
  // scratch and multiplied by matmul's strided batch.
  const int64_t rowsPer = pb.unit / ni, yUnit = ys.numel() / n0;
  const int64_t per = perPiece(pb.unit * 4, n0, pieceBytes);
  float *w = static_cast<float *>(workspace(sizeof(float) * per * pb.unit, kWsBasic2));
  for (int64_t j0 = 0; j0 < n0; j0 += per) {
    const int64_t c = std::min(per, n0 - j0);
    carve::gpu::gather<float>(table + j0 * rowsPer * size, Dims{c * rowsPer, size}, idx, is, 1, w);
    Dims yc = ys;
    yc.d[0] = c;
    matmul(pa.at(j0), pa.dims(c), transA, w, pb.dims(c), transB, y + j0 * yUnit, yc);
  }
}

void matmul_gather_grad(const float *a, Dims as, bool transA, const float *b, Dims bs, bool transB,
                        Dims ys, const int64_t *idx, Dims is, float *dtable, Dims ts,
                        int64_t pieceBytes) {
  const int64_t yMat = checkShapes("matmul_gather_grad", as, bs, ys, ts, is, ys, "the product");
  const int64_t size = ts.d[ts.rank - 1], ni = is.numel();
  const PieceOperand pa = pieceOperand(a, as, ys), pb = pieceOperand(b, bs, ys);
  const int64_t n0 = ys.rank > 2 ? ys.d[0] : 1;
  if (n0 <= 1 || (pa.unit == 0 && pb.unit == 0) || yMat == 0 || !byInverse(ni, size)) {
    // The product whole, then gather_grad.
    float *w = static_cast<float *>(workspace(
        sizeof(float) * static_cast<size_t>(std::max<int64_t>(ys.numel(), 1)), kWsBasic2));
    matmul(a, as, transA, b, bs, transB, w, ys);
    carve::gpu::gather_grad<float>(w, idx, is, ts.rank - 1, dtable, ts);
    return;
  }
  // The indices inverted once; each piece's product into scratch, then its
  // table rows summed from it as gather_grad sums them (the same order).
  const int64_t yUnit = ys.numel() / n0, rowsPer = yUnit / ni;
  const int64_t per = perPiece(yUnit * 4, n0, pieceBytes);
  const size_t invBytes = inverseBytes(ni, size);
  char *buf = static_cast<char *>(workspace(invBytes + sizeof(float) * per * yUnit, kWsBasic2));
  int *inv = reinterpret_cast<int *>(buf);
  float *w = reinterpret_cast<float *>(buf + invBytes);
  invertIndices(idx, ni, size, inv);
  for (int64_t j0 = 0; j0 < n0; j0 += per) {
    const int64_t c = std::min(per, n0 - j0);
    Dims yc = ys;
    yc.d[0] = c;
    matmul(pa.at(j0), pa.dims(c), transA, pb.at(j0), pb.dims(c), transB, w, yc);
    CARVE_KERNEL(blocksFor(c * rowsPer * size), kThreads, 0, stream(), gatherGradRowsKernel)
    (static_cast<const float *>(w), inv, inv + size + 1 + size, dtable + j0 * rowsPer * size, ni,
     size, c * rowsPer, nullptr, 0);
    checkLaunch("matmul_gather_grad");
  }
}

/// NonZero in one block: each thread counts the non-zeros of its slice of
/// x, thread 0 turns the counts into offsets, and each thread writes its
/// positions from its offset, so the order is row-major as on the CPU.
template <class T> __global__ void nonzeroKernel(const T *x, Dims xs, int64_t n, int64_t *y) {
  __shared__ int64_t offsets[kThreads + 1];
  const int64_t chunk = (n + blockDim.x - 1) / blockDim.x;
  const int64_t lo = threadIdx.x * chunk, hi = lo + chunk < n ? lo + chunk : n;
  int64_t mine = 0;
  for (int64_t e = lo; e < hi; ++e)
    mine += x[e] != T(0);
  int64_t total = 0;
  int64_t j = blockExclusiveScan(mine, offsets, total);
  for (int64_t e = lo; e < hi; ++e) {
    if (x[e] == T(0))
      continue;
    for (int64_t d = xs.rank - 1, rest = e; d >= 0; --d) {
      y[d * n + j] = rest % xs.d[d];
      rest /= xs.d[d];
    }
    ++j;
  }
}

template <class T> void nonzero(const T *x, Dims xs, int64_t *y) {
  const int64_t n = xs.numel();
  fill(y, xs.rank * n, int64_t(0));
  if (n == 0)
    return;
  CARVE_KERNEL(1, kThreads, 0, stream(), nonzeroKernel)(x, xs, n, y);
  checkLaunch("nonzero");
}

template <class T> void expand(const T *x, Dims xs, T *y, Dims ys) {
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  const Dims in[1] = {xs};
  gatherView("expand", x, broadcastNest<1>("expand", in, ys), y, total);
}

void expand16(const float *x, Dims xs, Dims ys, float *y, uint16_t *y16, bool round) {
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  const Dims in[1] = {xs};
  gatherView("expand16", x, broadcastNest<1>("expand16", in, ys),
             Out16{y, y16, format16For("expand16"), round}, total);
}

#define CARVE_DATA_MOVEMENT(T)                                                                     \
  template void transpose<T>(const T *, Dims, Dims, T *);                                          \
  template void transpose_view<T>(const T *, Dims, Dims, Dims, T *);                               \
  template void slice<T>(const T *, Dims, Dims, Dims, T *, Dims);                                  \
  template void slice_grad<T>(const T *, Dims, Dims, Dims, T *, Dims);                             \
  template void concat<T>(int, const T *const *, const Dims *, int, T *);                          \
  template void gather<T>(const T *, Dims, const int64_t *, Dims, int, T *);                       \
  template void gather_grad<T>(const T *, const int64_t *, Dims, int, T *, Dims);                  \
  template void expand<T>(const T *, Dims, T *, Dims);                                             \
  template void nonzero<T>(const T *, Dims, int64_t *);
CARVE_DATA_MOVEMENT(float)
CARVE_DATA_MOVEMENT(double)
CARVE_DATA_MOVEMENT(int64_t)
CARVE_DATA_MOVEMENT(int32_t)
CARVE_DATA_MOVEMENT(uint8_t)
#undef CARVE_DATA_MOVEMENT

} // namespace carve::gpu
