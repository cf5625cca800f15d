//===- attention_cudnn.cpp - attention through cuDNN's fused flash attention -===//
//
// gpu.h's attention_stats_cudnn and attention_grad_stats_cudnn: the
// attention_stats / attention_grad_stats calls of a bf16 or fp16 plan run as
// one cuDNN graph each, the graphs cuDNN 9's backend pattern-matches to its
// fused flash-attention engines. There is no cudnn-frontend header on these
// machines, so the graphs are built through the backend API (cudnn_graph.h),
// op by op as the frontend's CompositeSDPANode (forward) and
// CompositeSDPABackwardNode (backward, the non-deterministic dQ-accumulator
// variant of cuDNN >= 9) build them for a causal top-left mask, an additive
// bias and a scalar scale (docs/cuda.md, "Attention through cuDNN"):
//
//   forward   S = Q K^T (f32) ; S *= scale ; bias: S += B ;
//             causal: row >= col ? S : -inf ;
//             M = max_row S ; E = exp(S - M) ; Z = sum_row E ;
//             Stats = M + log Z (f32, kept) ; P = E / Z (16-bit) ; O = P V
//   backward  D = sum_row(dO * O) (f32, workspace) ; S = Q K^T * scale ;
//             bias: S += B ; P = exp(S - Stats) (masked) ; dV = P^T dO ;
//             dS = P * (dO V^T - D) * scale ; dK = dS^T Q ;
//             dQacc = dS K (f32, workspace) ; dQ = dQacc
//
// Inputs and outputs stay those of carve's own kernels (f32 tensors, the f32
// row log-sum-exp): the call converts q, k, v (o, dy) to the plan's 16-bit
// format in scratch, runs the graph, and widens O (dQ, dK, dV) again. The
// statistics are the same quantity either way, so a forward of one kind and
// a backward of the other agree. A mask tensor (the op's additive `mask`,
// broadcast to the scores) becomes the bias B: [1 or b, 1 or h, Tq, Tk] in
// the 16-bit format, written to scratch by each call (attentionMaskBias16),
// as the frontend's SDPA bias and PyTorch's cuDNN attention take it.
//
// A graph is built once per shape (the warm-up step, before any CUDA-graph
// capture) and cached. Where cuDNN cannot take a call -- an f32 plan, a mask
// that does not broadcast, a head dimension it lacks, no engine for the graph on this GPU, or
// CARVE_CUDNN_ATTENTION=off -- carve's own kernel runs (attention_fallback.cpp),
// and the first such call of each shape says so on stderr, once.
//
//===----------------------------------------------------------------------===//

#include "attention_fallback.h"
#include "internal.h"

#if CARVE_HAVE_CUDNN
#include "cudnn_graph.h"
#endif

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace carve::gpu {

#if !CARVE_HAVE_CUDNN
// Built without cuDNN: carve's kernels, said once.
namespace {
void sayNoCudnn() {
  static bool said = false;
  if (!said)
    std::fprintf(stderr, "carve: this runtime was built without cuDNN; attention runs carve's "
                         "own kernels\n");
  said = true;
}
} // namespace

void cudnnAttentionCalls(int64_t &forward, int64_t &backward) { forward = backward = 0; }
bool cudnnAttentionBuilt() { return false; }

void attention_stats_cudnn(const float *q, const void *q16, Dims qs, const float *k,
                           const void *k16, Dims ks, const float *v, const void *v16, Dims vs,
                           const float *mask, Dims ms, float scale, bool causal, float *y,
                           float *lse, uint16_t *y16, int64_t inRowStride16) {
  sayNoCudnn();
  checkBthd(y16 != nullptr, qs, ks, vs, "attention_stats_cudnn");
  const bool given[3] = {q16 && !q, k16 && !k, v16 && !v};
  checkInStrided(inRowStride16, given, qs, ks, vs, "attention_stats_cudnn");
  statsByCarve(q, q16, qs, k, k16, ks, v, v16, vs, mask, ms, scale, causal, y, lse, y16,
               inRowStride16);
}

void attention_grad_stats_cudnn(const void *q, bool q16, Dims qs, const void *k, bool k16, Dims ks,
                                const void *v, bool v16, Dims vs, const float *mask, Dims ms,
                                float scale, bool causal, const float *o, const float *lse,
                                const float *dy, float *dq, float *dk, float *dv, bool bthd,
                                bool dyBthd, uint16_t *dq16, uint16_t *dk16, uint16_t *dv16,
                                int64_t rowStride16, const uint16_t *o16, const uint16_t *dy16,
                                int64_t inRowStride16) {
  sayNoCudnn();
  uint16_t *const g16[3] = {dq16, dk16, dv16};
  const bool out16 = checkOutputs(bthd, dyBthd || o16, qs, ks, vs, g16, rowStride16);
  const bool given[3] = {q16, k16, v16};
  checkInStrided(inRowStride16, given, qs, ks, vs, "attention_grad_stats_cudnn");
  gradByCarve(q, q16, qs, k, k16, ks, v, v16, vs, mask, ms, scale, causal, o, lse, dy, dq, dk, dv,
              bthd, dyBthd, out16 ? g16 : nullptr, rowStride16, o16, dy16, inRowStride16);
}

#else

namespace {

using namespace dnn;

// The unique ids of the tensors the caller binds.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kScale,
  kNegInf,
  kDO,
  kDQ,
  kDK,
  kDV,
  kSoftmaxSum,
  kDQAccum,
  kOne,
  kBias
};

/// An attention call's shape as cuDNN sees it: [b, h, s, d] row-major, the
/// batch dimensions folded into b and h.
struct Shape {
  int64_t b = 1, h = 1, sq = 0, skv = 0, d = 0, dv = 0;
  bool causal = false;
  bool backward = false;
  bool bthd = false;   // the backward writes dQ, dK, dV as [b, s, h, d]
  bool dyBthd = false; // and reads dO as [b, s, h, d]
  int64_t rowStride16 = 0; // bthd: rows of this many elements (0: h * d)
  bool oBthd = false;      // O written (forward) or read (backward) as [b, s, h, d]
  int64_t inRowStride = 0; // Q, K, V read as [b, s, h, d] rows this far apart (0: [b, h, s, d])
  int64_t biasB = 0, biasH = 0; // an additive bias [biasB, biasH, sq, skv] (0: none)
  int prec = 0;
  auto key() const {
    return std::make_tuple(b, h, sq, skv, d, dv, causal, backward, bthd, dyBthd, rowStride16, oBthd,
                           inRowStride, biasB, biasH, prec);
  }
  bool operator<(const Shape &o) const { return key() < o.key(); }
  std::string text() const {
    char buf[224], bias[64] = "";
    if (biasB)
      std::snprintf(bias, sizeof bias, ", a mask as bias [%lld, %lld, %lld, %lld]",
                    (long long)biasB, (long long)biasH, (long long)sq, (long long)skv);
    std::snprintf(buf, sizeof buf, "[b %lld, h %lld, Tq %lld, Tk %lld, d %lld, dv %lld%s%s]",
                  (long long)b, (long long)h, (long long)sq, (long long)skv, (long long)d,
                  (long long)dv, causal ? ", causal" : "", bias);
    return buf;
  }
};

Dims4 rowMajor(int64_t a, int64_t b, int64_t c, int64_t d) { return {b * c * d, c * d, d, 1}; }

/// O's [b, h, sq, dv] strides where it is stored as [b, sq, h, dv].
Dims4 bthdStrides(const Shape &s) { return {s.sq * s.h * s.dv, s.dv, s.h * s.dv, 1}; }

/// An input's [b, h, t, d] strides: row-major, or (inRowStride) [b, t, h, d]
/// rows that far apart.
Dims4 inputStrides(const Shape &s, int64_t t, int64_t d) {
  const int64_t r = s.inRowStride;
  return r ? Dims4{t * r, d, r, 1} : rowMajor(s.b, s.h, t, d);
}

/// scaled + B where the call has a bias (the frontend's SDPA bias: a
/// pointwise add of the 16-bit [1 or b, 1 or h, sq, skv] tensor), else scaled.
const Desc &addBias(Graph &g, const Desc &scaled, const Shape &s) {
  if (!s.biasB)
    return scaled;
  const Dims4 bd{s.biasB, s.biasH, s.sq, s.skv};
  const Desc &bias = g.input(kBias, g.io, bd, rowMajor(bd[0], bd[1], bd[2], bd[3]));
  const Desc &out = g.virt(CUDNN_DATA_FLOAT, {s.b, s.h, s.sq, s.skv});
  g.pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, scaled, &bias, nullptr, out);
  return out;
}

/// The forward graph (CompositeSDPANode, training: Stats kept).
void buildForward(Graph &g, const Shape &s) {
  const Dims4 sd{s.b, s.h, s.sq, s.skv}, rd{s.b, s.h, s.sq, 1};
  const Desc &q = g.input(kQ, g.io, {s.b, s.h, s.sq, s.d}, inputStrides(s, s.sq, s.d));
  // K^T: K's memory with the last two dims and strides exchanged.
  Dims4 ks = inputStrides(s, s.skv, s.d);
  const Desc &kt = g.input(kK, g.io, {s.b, s.h, s.d, s.skv}, {ks[0], ks[1], ks[3], ks[2]});
  const Desc &v = g.input(kV, g.io, {s.b, s.h, s.skv, s.dv}, inputStrides(s, s.skv, s.dv));
  // O as [b, h, s, dv], or (oBthd) with heads and tokens exchanged in memory.
  const Desc &o = g.input(kO, g.io, {s.b, s.h, s.sq, s.dv},
                          s.oBthd ? bthdStrides(s) : rowMajor(s.b, s.h, s.sq, s.dv));
  const Desc &stats = g.input(kStats, CUDNN_DATA_FLOAT, rd, rowMajor(s.b, s.h, s.sq, 1));
  const Desc &sc = g.virt(CUDNN_DATA_FLOAT, sd);
  g.matmul(q, kt, sc);
  const Desc &scaled = g.virt(CUDNN_DATA_FLOAT, sd);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, sc, &g.scalar(kScale), nullptr, scaled);
  const Desc &biased = addBias(g, scaled, s);
  const Desc &masked = s.causal ? g.causalMask(biased, sd, kNegInf) : biased;
  const Desc &m = g.virt(CUDNN_DATA_FLOAT, rd);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, masked, m);
  const Desc &sub = g.virt(CUDNN_DATA_FLOAT, sd);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, masked, &m, nullptr, sub);
  const Desc &e = g.virt(CUDNN_DATA_FLOAT, sd);
  g.pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, sub, nullptr, nullptr, e);
  const Desc &z = g.virt(CUDNN_DATA_FLOAT, rd);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, z);
  const Desc &logZ = g.virt(CUDNN_DATA_FLOAT, rd);
  g.pointwise(CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, z, nullptr, nullptr, logZ);
  g.pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, m, &logZ, nullptr, stats);
  // The probabilities in the inputs' 16-bit type: the second GEMM's A.
  const Desc &p = g.virt(g.io, sd);
  g.pointwise(CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, e, &z, nullptr, p);
  g.matmul(p, v, o);
}

/// The backward graph (CompositeSDPABackwardNode without dropout or padding,
/// with the bias where the call has one (no dBias), dQ accumulated in f32 in
/// the workspace).
void buildBackward(Graph &g, const Shape &s) {
  const Dims4 sd{s.b, s.h, s.sq, s.skv}, rd{s.b, s.h, s.sq, 1};
  const Dims4 sdT{s.b, s.h, s.skv, s.sq};
  const Dims4 sdTStride{s.h * s.sq * s.skv, s.sq * s.skv, 1, s.skv};
  const Desc &q = g.input(kQ, g.io, {s.b, s.h, s.sq, s.d}, inputStrides(s, s.sq, s.d));
  Dims4 ks = inputStrides(s, s.skv, s.d), vs = inputStrides(s, s.skv, s.dv);
  const Desc &kt = g.input(kK, g.io, {s.b, s.h, s.d, s.skv}, {ks[0], ks[1], ks[3], ks[2]});
  const Desc &vt = g.input(kV, g.io, {s.b, s.h, s.dv, s.skv}, {vs[0], vs[1], vs[3], vs[2]});
  const Desc &o = g.input(kO, g.io, {s.b, s.h, s.sq, s.dv},
                          s.oBthd ? bthdStrides(s) : rowMajor(s.b, s.h, s.sq, s.dv));
  // dO as given, or (dyBthd) with heads and tokens exchanged in memory.
  const Desc &dO = g.input(kDO, g.io, {s.b, s.h, s.sq, s.dv},
                           s.dyBthd ? Dims4{s.sq * s.h * s.dv, s.dv, s.h * s.dv, 1}
                                    : rowMajor(s.b, s.h, s.sq, s.dv));
  const Desc &stats = g.input(kStats, CUDNN_DATA_FLOAT, rd, rowMajor(s.b, s.h, s.sq, 1));
  // The gradients in [b, h, s, d] order, or (bthd) with heads and tokens
  // exchanged in memory: the transposes after the call done by cuDNN.
  auto out = [&](int64_t t, int64_t d) {
    const int64_t row = s.rowStride16 ? s.rowStride16 : s.h * d;
    return s.bthd ? Dims4{t * row, d, row, 1} : rowMajor(s.b, s.h, t, d);
  };
  const Desc &dQ = g.input(kDQ, g.io, {s.b, s.h, s.sq, s.d}, out(s.sq, s.d));
  const Desc &dK = g.input(kDK, g.io, {s.b, s.h, s.skv, s.d}, out(s.skv, s.d));
  const Desc &dV = g.input(kDV, g.io, {s.b, s.h, s.skv, s.dv}, out(s.skv, s.dv));
  const Desc &softmaxSum = g.input(kSoftmaxSum, CUDNN_DATA_FLOAT, rd, rowMajor(s.b, s.h, s.sq, 1));
  const Desc &dQAccum =
      g.input(kDQAccum, CUDNN_DATA_FLOAT, {s.b, s.h, s.sq, s.d}, rowMajor(s.b, s.h, s.sq, s.d));
  const Desc &scale = g.scalar(kScale); // one descriptor per id, read twice
  // D = sum_row(dO * O), times 1 (the dropout scale's place).
  const Desc &dOO = g.virt(CUDNN_DATA_FLOAT, {s.b, s.h, s.sq, s.dv});
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dO, &o, nullptr, dOO);
  const Desc &rowDot = g.virt(CUDNN_DATA_FLOAT, rd);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, dOO, rowDot);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, rowDot, &g.scalar(kOne), nullptr, softmaxSum);
  // P = exp(S * scale - Stats), masked.
  const Desc &sc = g.virt(CUDNN_DATA_FLOAT, sd);
  g.matmul(q, kt, sc);
  const Desc &scaled = g.virt(CUDNN_DATA_FLOAT, sd);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, sc, &scale, nullptr, scaled);
  const Desc &biased = addBias(g, scaled, s);
  const Desc &sub = g.virt(CUDNN_DATA_FLOAT, sd);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, biased, &stats, nullptr, sub);
  const Desc &masked = s.causal ? g.causalMask(sub, sd, kNegInf) : sub;
  const Desc &p = g.virt(CUDNN_DATA_FLOAT, sd);
  g.pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, masked, nullptr, nullptr, p);
  // dV = P^T dO.
  // P^T: the same elements read with the last two dims exchanged.
  const Desc &pT = g.virt(g.io, sdT, sdTStride);
  g.reshape(p, pT);
  g.matmul(pT, dO, dV);
  // dS = P * (dO V^T - D) * scale.
  const Desc &dP = g.virt(CUDNN_DATA_FLOAT, sd);
  g.matmul(dO, vt, dP);
  const Desc &dPSub = g.virt(CUDNN_DATA_FLOAT, sd);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, dP, &softmaxSum, nullptr, dPSub);
  const Desc &dSRaw = g.virt(CUDNN_DATA_FLOAT, sd);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dPSub, &p, nullptr, dSRaw);
  const Desc &dS = g.virt(CUDNN_DATA_FLOAT, sd);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dSRaw, &scale, nullptr, dS);
  // dK = dS^T Q.
  const Desc &dST = g.virt(g.io, sdT, sdTStride);
  g.reshape(dS, dST);
  g.matmul(dST, q, dK);
  // dQ = dS K, accumulated in f32, then written in the 16-bit type.
  // (K as a transpose of K^T: the same memory, K's own strides.)
  const Desc &k = g.virt(g.io, {s.b, s.h, s.skv, s.d}, inputStrides(s, s.skv, s.d));
  g.reshape(kt, k);
  g.matmul(dS, k, dQAccum);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, dQAccum, nullptr, nullptr, dQ);
}

/// A built graph, or why there is none.
struct Entry {
  std::unique_ptr<Graph> graph;
  std::string refused;
};

struct CudnnState {
  cudnnHandle_t handle = nullptr;
  std::string handleError;
  std::map<Shape, Entry> graphs;
  int64_t forwardCalls = 0, backwardCalls = 0;
};

/// Never destroyed: the handle and plans live as long as the process (a
/// destructor at exit would run after the CUDA context is gone).
CudnnState &cudnnState() {
  static CudnnState *s = new CudnnState;
  return *s;
}

bool disabledByEnvironment() {
  static const bool off = [] {
    const char *e = std::getenv("CARVE_CUDNN_ATTENTION");
    return e && std::strcmp(e, "off") == 0;
  }();
  return off;
}

/// Why this call cannot go to cuDNN at all (empty: it can).
std::string ineligible(const Dims &qs, const Dims &ks, const Dims &vs, const float *mask,
                       const Dims &ms, Shape &s) {
  const Precision p = precision();
  if (p != Precision::BF16 && p != Precision::F16)
    return "the plan computes attention in fp32";
  const int r = qs.rank;
  if (r < 2 || ks.rank != r || vs.rank != r)
    return "q, k and v of different ranks";
  for (int i = 0; i + 2 < r; ++i) {
    if (ks.d[i] != qs.d[i] || vs.d[i] != qs.d[i])
      return "batch dimensions that differ between q, k and v";
    (i + 3 == r ? s.h : s.b) *= qs.d[i];
  }
  s.sq = qs.d[r - 2];
  s.d = qs.d[r - 1];
  s.skv = ks.d[r - 2];
  s.dv = vs.d[r - 1];
  s.prec = static_cast<int>(p);
  if (ks.d[r - 1] != s.d || vs.d[r - 2] != s.skv)
    return "k and v that do not match q";
  if (s.b * s.h == 0 || s.sq == 0 || s.skv == 0 || s.dv == 0)
    return "an empty tensor";
  if (s.d % 8 || s.dv % 8 || s.d > 256 || s.dv > 256)
    return "head dimensions " + std::to_string(s.d) + " and " + std::to_string(s.dv) +
           " (cuDNN takes multiples of 8 up to 256)";
  if (mask) {
    // The bias: [1 or b, 1 or h, sq, skv], whatever of the batch dims before
    // the heads (b) or the heads (h) the mask does not broadcast over.
    if (ms.rank > r)
      return "a mask of rank " + std::to_string(ms.rank) + " above the scores' " +
             std::to_string(r);
    const int off = r - ms.rank;
    bool overB = false, overH = false;
    for (int i = 0; i < r; ++i) {
      const int64_t dim = i >= off ? ms.d[i - off] : 1;
      const int64_t want = i == r - 1 ? s.skv : qs.d[i];
      if (dim != 1 && dim != want)
        return "a mask that does not broadcast to the scores";
      if (dim != 1 && i + 3 < r)
        overB = true;
      if (dim != 1 && i + 3 == r)
        overH = true;
    }
    s.biasB = overB ? s.b : 1;
    s.biasH = overH ? s.h : 1;
  }
  if (disabledByEnvironment())
    return "CARVE_CUDNN_ATTENTION=off";
  return "";
}

/// The cached graph for `s`, built on first use; null (with the reason said
/// once on stderr) where cuDNN refuses it.
Graph *graphFor(const Shape &s, const char *op) {
  CudnnState &st = cudnnState();
  auto it = st.graphs.find(s);
  if (it != st.graphs.end())
    return it->second.graph.get();
  Entry &e = st.graphs[s];
  try {
    if (capturing())
      throw Refused{"its graph would be built while the step is captured (the warm-up step did "
                    "not run this shape)"};
    if (!st.handle && st.handleError.empty()) {
      cudnnStatus_t c = cudnnCreate(&st.handle);
      if (c != CUDNN_STATUS_SUCCESS) {
        st.handle = nullptr;
        st.handleError = std::string("cudnnCreate: ") + cudnnGetErrorString(c);
      }
    }
    if (!st.handle)
      throw Refused{st.handleError};
    cudaDeviceProp prop{};
    CARVE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const int sm = prop.major * 10 + prop.minor;
    if (sm < 80)
      throw Refused{"sm_" + std::to_string(sm) + " (cuDNN's flash attention needs sm_80 or newer)"};
    if (s.backward && (s.d > 128 || s.dv > 128) && sm < 90)
      throw Refused{"a head dimension above 128 in the backward before sm_90"};
    auto g = std::make_unique<Graph>(
        s.prec == static_cast<int>(Precision::BF16) ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF);
    if (s.backward)
      buildBackward(*g, s);
    else
      buildForward(*g, s);
    g->plan(st.handle);
    e.graph = std::move(g);
  } catch (const Refused &r) {
    e.refused = r.why;
    std::fprintf(stderr, "carve: %s %s: cuDNN flash attention refused (%s); carve's kernel runs\n",
                 op, s.text().c_str(), r.why.c_str());
  }
  return e.graph.get();
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

/// Whether cuDNN can write the 16-bit gradients where they go: 16-byte
/// aligned, rows a multiple of 8 elements apart.
bool aligned16(uint16_t *const g16[3], int64_t rowStride16) {
  for (int i = 0; i < 3; ++i)
    if (reinterpret_cast<uintptr_t>(g16[i]) % 16)
      return false;
  return rowStride16 % 8 == 0;
}

/// Whether cuDNN can read q, k and v in place: 16-byte aligned, rows a
/// multiple of 8 elements apart.
bool alignedIn(const void *q, const void *k, const void *v, int64_t rowStride) {
  for (const void *p : {q, k, v})
    if (reinterpret_cast<uintptr_t>(p) % 16)
      return false;
  return rowStride % 8 == 0;
}

/// A call that carve's kernel takes for `why`, said once per shape.
void sayOnce(const char *op, const Shape &s, const std::string &why) {
  static std::set<Shape> said;
  if (said.insert(s).second)
    std::fprintf(stderr, "carve: %s %s: %s; carve's kernel runs\n", op, s.text().c_str(),
                 why.c_str());
}

void to16(const float *x, uint16_t *y, int64_t n) {
  precision() == Precision::BF16 ? toBf16(x, y, n) : toF16(x, y, n);
}
void from16(const uint16_t *x, float *y, int64_t n) {
  precision() == Precision::BF16 ? fromBf16(x, y, n) : fromF16(x, y, n);
}

/// Carves `sizes` 256-byte-aligned pieces, then the plan's workspace, out of
/// the attention scratch slot.
std::vector<char *> scratch(std::initializer_list<size_t> sizes, int64_t planBytes,
                            char *&planWorkspace) {
  size_t total = 0;
  for (size_t n : sizes)
    total += align256(n);
  char *base = static_cast<char *>(workspace(total + align256(planBytes), kWsAttn));
  std::vector<char *> out;
  size_t off = 0;
  for (size_t n : sizes) {
    out.push_back(base + off);
    off += align256(n);
  }
  planWorkspace = planBytes ? base + off : nullptr;
  return out;
}

} // namespace

bool cudnnAttentionBuilt() { return true; }

void cudnnAttentionCalls(int64_t &forward, int64_t &backward) {
  forward = cudnnState().forwardCalls;
  backward = cudnnState().backwardCalls;
}

void attention_stats_cudnn(const float *q, const void *q16, Dims qs, const float *k,
                           const void *k16, Dims ks, const float *v, const void *v16, Dims vs,
                           const float *mask, Dims ms, float scale, bool causal, float *y,
                           float *lse, uint16_t *y16, int64_t inRowStride16) {
  const char *op = "attention_stats_cudnn";
  checkBthd(y16 != nullptr, qs, ks, vs, op);
  const bool given[3] = {q16 != nullptr, k16 != nullptr, v16 != nullptr};
  checkInStrided(inRowStride16, given, qs, ks, vs, op);
  Shape s;
  s.causal = causal;
  s.oBthd = y16 != nullptr;
  s.inRowStride = inRowStride16;
  std::string why = ineligible(qs, ks, vs, mask, ms, s);
  if (why.empty() && y16 && reinterpret_cast<uintptr_t>(y16) % 16)
    why = "a 16-bit output not 16-byte aligned";
  if (why.empty() && inRowStride16 && !alignedIn(q16, k16, v16, inRowStride16))
    why = "q, k and v read in place at addresses or a row stride not 16-byte aligned";
  if (!why.empty() && (y16 || inRowStride16))
    sayOnce(op, s, why);
  Graph *g = why.empty() ? graphFor(s, op) : nullptr;
  if (!g)
    return statsByCarve(q, q16, qs, k, k16, ks, v, v16, vs, mask, ms, scale, causal, y, lse, y16,
                        inRowStride16);
  const int64_t nq = s.b * s.h * s.sq * s.d, nk = s.b * s.h * s.skv * s.d;
  const int64_t nv = s.b * s.h * s.skv * s.dv, no = s.b * s.h * s.sq * s.dv;
  char *ws = nullptr;
  const int64_t nb = s.biasB * s.biasH * s.sq * s.skv;
  std::vector<char *> p =
      scratch({q16 ? 0 : size_t(nq) * 2, k16 ? 0 : size_t(nk) * 2, v16 ? 0 : size_t(nv) * 2,
               y16 ? 0 : size_t(no) * 2, size_t(nb) * 2},
              g->workspaceBytes, ws);
  // q, k, v: their 16-bit copies where the program has them, else converted.
  void *in16[3] = {const_cast<void *>(q16), const_cast<void *>(k16), const_cast<void *>(v16)};
  const float *in[3] = {q, k, v};
  const int64_t counts[3] = {nq, nk, nv};
  for (int i = 0; i < 3; ++i)
    if (!in16[i]) {
      in16[i] = p[i];
      to16(in[i], static_cast<uint16_t *>(in16[i]), counts[i]);
    }
  // O written in 16 bits as [b, t, h, d] where y16 is given, else in
  // scratch and widened.
  auto *o16 = y16 ? y16 : reinterpret_cast<uint16_t *>(p[3]);
  float negInf = -std::numeric_limits<float>::infinity();
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale};
  std::vector<void *> ptrs{in16[0], in16[1], in16[2], o16, lse, &scale};
  if (causal) {
    uids.push_back(kNegInf);
    ptrs.push_back(&negInf);
  }
  if (nb) {
    auto *bias = reinterpret_cast<uint16_t *>(p[4]);
    attentionMaskBias16(qs, ks, vs, mask, ms, s.biasB, s.biasH, bias);
    uids.push_back(kBias);
    ptrs.push_back(bias);
  }
  execute(cudnnState().handle, *g, uids, ptrs, ws, "cuDNN flash attention forward");
  ++cudnnState().forwardCalls;
  if (!y16)
    from16(o16, y, no);
}

void attention_grad_stats_cudnn(const void *q, bool q16, Dims qs, const void *k, bool k16, Dims ks,
                                const void *v, bool v16, Dims vs, const float *mask, Dims ms,
                                float scale, bool causal, const float *o, const float *lse,
                                const float *dy, float *dq, float *dk, float *dv, bool bthd,
                                bool dyBthd, uint16_t *dq16, uint16_t *dk16, uint16_t *dv16,
                                int64_t rowStride16, const uint16_t *o16, const uint16_t *dy16,
                                int64_t inRowStride16) {
  const char *op = "attention_grad_stats_cudnn";
  uint16_t *const g16[3] = {dq16, dk16, dv16};
  const bool out16 = checkOutputs(bthd, dyBthd || o16, qs, ks, vs, g16, rowStride16);
  const bool given[3] = {q16, k16, v16};
  checkInStrided(inRowStride16, given, qs, ks, vs, op);
  Shape s;
  s.inRowStride = inRowStride16;
  s.causal = causal;
  s.backward = true;
  s.bthd = bthd;
  s.dyBthd = dyBthd;
  s.rowStride16 = out16 ? rowStride16 : 0;
  s.oBthd = o16 != nullptr;
  std::string why = ineligible(qs, ks, vs, mask, ms, s);
  if (why.empty() && out16 && !aligned16(g16, rowStride16))
    why = "16-bit gradients at addresses or a row stride not 16-byte aligned";
  if (why.empty() && o16 && reinterpret_cast<uintptr_t>(o16) % 16)
    why = "a 16-bit output O not 16-byte aligned";
  if (why.empty() && dy16 && reinterpret_cast<uintptr_t>(dy16) % 16)
    why = "a 16-bit dy not 16-byte aligned";
  if (why.empty() && inRowStride16 && !alignedIn(q, k, v, inRowStride16))
    why = "q, k and v read in place at addresses or a row stride not 16-byte aligned";
  if (!why.empty() && (out16 || o16 || dy16 || inRowStride16))
    sayOnce(op, s, why);
  Graph *g = why.empty() ? graphFor(s, op) : nullptr;
  if (!g)
    return gradByCarve(q, q16, qs, k, k16, ks, v, v16, vs, mask, ms, scale, causal, o, lse, dy, dq,
                       dk, dv, bthd, dyBthd, out16 ? g16 : nullptr, rowStride16, o16, dy16,
                       inRowStride16);
  const int64_t nq = s.b * s.h * s.sq * s.d, nk = s.b * s.h * s.skv * s.d;
  const int64_t nv = s.b * s.h * s.skv * s.dv, no = s.b * s.h * s.sq * s.dv;
  const int64_t rows = s.b * s.h * s.sq;
  char *ws = nullptr;
  // The gradients in 16-bit scratch, widened after (none: written in place).
  const size_t gq = out16 ? 0 : size_t(nq) * 2, gk = out16 ? 0 : size_t(nk) * 2,
               gv = out16 ? 0 : size_t(nv) * 2;
  const int64_t nb = s.biasB * s.biasH * s.sq * s.skv;
  std::vector<char *> p =
      scratch({q16 ? 0 : size_t(nq) * 2, k16 ? 0 : size_t(nk) * 2, v16 ? 0 : size_t(nv) * 2,
               o16 ? 0 : size_t(no) * 2, dy16 ? 0 : size_t(no) * 2, gq, gk, gv, size_t(rows) * 4,
               size_t(nq) * 4, size_t(nb) * 2},
              g->workspaceBytes, ws);
  auto u16 = [&](int i) { return reinterpret_cast<uint16_t *>(p[i]); };
  // q, k, v: as given where they are 16-bit already, else converted.
  void *in16[3] = {q16 ? const_cast<void *>(q) : u16(0), k16 ? const_cast<void *>(k) : u16(1),
                   v16 ? const_cast<void *>(v) : u16(2)};
  if (!q16)
    to16(static_cast<const float *>(q), u16(0), nq);
  if (!k16)
    to16(static_cast<const float *>(k), u16(1), nk);
  if (!v16)
    to16(static_cast<const float *>(v), u16(2), nv);
  // O as the forward wrote it in 16 bits ([b, t, h, d]) where given.
  void *o16p = o16 ? const_cast<uint16_t *>(o16) : static_cast<void *>(u16(3));
  if (!o16)
    to16(o, u16(3), no);
  // dy as its writer wrote it in 16 bits where given.
  void *dy16p = dy16 ? const_cast<uint16_t *>(dy16) : static_cast<void *>(u16(4));
  if (!dy16)
    to16(dy, u16(4), no);
  float negInf = -std::numeric_limits<float>::infinity();
  float one = 1.0f;
  std::vector<int64_t> uids{kQ,  kK,  kV,          kO,       kDO,    kStats, kDQ,
                            kDK, kDV, kSoftmaxSum, kDQAccum, kScale, kOne};
  void *grads[3] = {out16 ? static_cast<void *>(dq16) : u16(5),
                    out16 ? static_cast<void *>(dk16) : u16(6),
                    out16 ? static_cast<void *>(dv16) : u16(7)};
  std::vector<void *> ptrs{in16[0],  in16[1],  in16[2],  o16p, dy16p, const_cast<float *>(lse),
                           grads[0], grads[1], grads[2], p[8], p[9],  &scale,
                           &one};
  if (causal) {
    uids.push_back(kNegInf);
    ptrs.push_back(&negInf);
  }
  if (nb) {
    attentionMaskBias16(qs, ks, vs, mask, ms, s.biasB, s.biasH, u16(10));
    uids.push_back(kBias);
    ptrs.push_back(u16(10));
  }
  execute(cudnnState().handle, *g, uids, ptrs, ws, "cuDNN flash attention backward");
  ++cudnnState().backwardCalls;
  if (out16) {
    // Written in place, in 16 bits; without bthd, widened where the step
    // keeps the f32 gradients too.
    if (!bthd) {
      if (dq)
        from16(dq16, dq, nq);
      if (dk)
        from16(dk16, dk, nk);
      if (dv)
        from16(dv16, dv, nv);
    }
    return;
  }
  from16(u16(5), dq, nq);
  from16(u16(6), dk, nk);
  from16(u16(7), dv, nv);
}

#endif // CARVE_HAVE_CUDNN

} // namespace carve::gpu
