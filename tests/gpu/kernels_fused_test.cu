//===- kernels_fused_test.cu - fused, loss and attention kernels vs the CPU ===//
//
// Every function of runtime/cuda/kernels_fused.cu, kernels_loss.cu and
// kernels_attention.cu on random inputs against
// the CPU kernels' float64 instantiations: softmax along every axis kind,
// layer and RMS norm with and without scale and bias, attention with and
// without causality and masks (Tq != Tk both ways, D = 64 and odd D, D past
// 256, fully masked rows), cross-entropy over contiguous and strided classes
// with every reduction and an ignore index, and the vocabulary-parallel
// cross-entropy on a one-rank NCCL communicator. bf16 and fp16 attention are
// checked against the CPU target's float emulation of the same rounding.
// Tolerances are stated at each check with the reason. The last checks make
// a bad target fire through the device error record and kCudaTarget.
//
//===----------------------------------------------------------------------===//

#include "harness.h"

#include "carve/rt/comm.h"
#include "carve/rt/dist.h"
#include "carve/rt/gpu.h"
#include "carve/rt/gpu_fused.cuh"
#include "carve/rt/kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

using namespace gputest;
namespace g = carve::gpu;
namespace rt = carve::rt;
using rt::Dims;

namespace {

const char *kBinary = "carve-gpu-kernels_fused_test";
constexpr float kInf = std::numeric_limits<float>::infinity();

/// A failed check unless the device finished the work without an error.
bool deviceOk(const std::string &what) {
  std::string err;
  if (g::kCudaTarget.synchronize(err))
    return true;
  ++checks();
  ++failures();
  std::printf("FAIL %s: the device reported: %s\n", what.c_str(), err.c_str());
  return false;
}

std::vector<double> toD(const std::vector<float> &v) { return toDouble(v); }

//===--- Softmax ----------------------------------------------------------===//

// Tolerances: each output is exp(x - max) / sum in fp32; the sum of A <= 3000
// terms carries about log2(A) + A / 512 roundings of 6e-8 (per-thread serial
// sums, then a tree), so 2e-5 relative. Log-softmax values are x - max -
// log(sum) with |x| up to about 10: 2e-5 absolute. Gradients subtract a sum
// of A products from dy: 2e-5 absolute, 1e-4 relative.
void testSoftmax(Dims s, int axis) {
  const int64_t n = s.numel();
  const std::vector<float> x = randn(n, 2.5f), gy = randn(n);
  for (bool log : {false, true}) {
    const std::string what =
        std::string(log ? "log_softmax " : "softmax ") + str(s) + " axis " + std::to_string(axis);
    auto dx = up(x);
    auto dy = poisoned<float>(n);
    g::softmax(dx->p, s, axis, log, dy->p);
    std::vector<double> ref(n);
    rt::softmax<double>(toD(x).data(), s, axis, log, ref.data());
    if (deviceOk(what))
      expectClose(what, dy->download(), ref, 2e-5, log ? 2e-5 : 1e-8);

    // The gradient at the reference output (as float, the GPU's input too).
    std::vector<float> yf(ref.begin(), ref.end());
    auto y = up(yf);
    auto g_ = up(gy);
    auto ddx = poisoned<float>(n);
    g::softmax_grad(y->p, g_->p, s, axis, log, ddx->p);
    std::vector<double> dref(n);
    rt::softmax_grad<double>(toD(yf).data(), toD(gy).data(), s, axis, log, dref.data());
    if (deviceOk(what + " grad"))
      expectClose(what + " grad", ddx->download(), dref, 1e-4, 2e-5);
  }
}

/// Rows past 2^31 elements: a zero input gives 1/A everywhere; only the last
/// rows are read back. Checks the 64-bit row offsets.
void testSoftmaxHuge() {
  size_t freeB = 0, totalB = 0;
  GT_CUDA(cudaMemGetInfo(&freeB, &totalB));
  const int64_t A = 520, rows = (int64_t(1) << 31) / A + 4096, n = rows * A;
  if (freeB < static_cast<size_t>(2 * n * sizeof(float)) + (size_t(1) << 30)) {
    std::printf("note softmax past 2^31 elements not run: %.1f GiB free\n", freeB / 1073741824.0);
    return;
  }
  float *x = nullptr, *y = nullptr;
  GT_CUDA(cudaMalloc(&x, n * sizeof(float)));
  GT_CUDA(cudaMalloc(&y, n * sizeof(float)));
  GT_CUDA(cudaMemset(x, 0, n * sizeof(float)));
  GT_CUDA(cudaMemset(y, 0xFF, n * sizeof(float)));
  sync();
  g::softmax(x, Dims{rows, A}, 1, false, y);
  const int64_t tail = 4096 * A;
  std::vector<float> got(tail);
  if (deviceOk("softmax past 2^31 elements")) {
    GT_CUDA(cudaMemcpy(got.data(), y + (n - tail), tail * sizeof(float), cudaMemcpyDeviceToHost));
    // 1/520 from a sum of 520 ones: exact sum, one rounding of the division.
    expectClose("softmax [" + std::to_string(rows) + ",520] last 4096 rows (past 2^31)", got,
                std::vector<double>(tail, 1.0 / A), 1e-6, 0);
  }
  GT_CUDA(cudaFree(x));
  GT_CUDA(cudaFree(y));
}

//===--- Layer and RMS norm -----------------------------------------------===//

// Tolerances: outputs are (x - mean) * rstd of unit-variance rows, with fp32
// sums over N <= 4096: 2e-5 absolute; rows offset by 1000 hold the mean in
// fp32 (ulp 6e-5, as the CPU float kernel does), so 2e-4 there. dx: 5e-5
// absolute. dscale/dbias sum R <= 3000 rows of O(1) terms in fp32 per block
// and in double across blocks: 1e-4 relative plus 1e-4 absolute.
void testLayerNorm(Dims s, int axis, bool withScale, bool withBias, float offset) {
  int a = axis < 0 ? axis + s.rank : axis;
  int64_t N = 1;
  for (int i = a; i < s.rank; ++i)
    N *= s.d[i];
  const int64_t n = s.numel();
  std::vector<float> x = randn(n);
  for (float &v : x)
    v += offset;
  const std::vector<float> sc = uniform(N, 0.5f, 1.5f), bi = randn(N), gy = randn(n);
  const float eps = 1e-5f;
  const std::string what = "layer_norm " + str(s) + " axis " + std::to_string(axis) +
                           (withScale ? " scale" : "") + (withBias ? " bias" : "") +
                           (offset != 0 ? " offset " + std::to_string((int)offset) : "");
  const double atol = offset != 0 ? 2e-4 : 2e-5;
  auto dx = up(x);
  auto dsc = up(sc);
  auto dbi = up(bi);
  auto dy = poisoned<float>(n);
  g::layer_norm(dx->p, s, axis, withScale ? dsc->p : nullptr, withBias ? dbi->p : nullptr, eps,
                dy->p);
  const std::vector<double> xd = toD(x), scd = toD(sc), bid = toD(bi), gyd = toD(gy);
  std::vector<double> ref(n);
  rt::layer_norm<double>(xd.data(), s, axis, withScale ? scd.data() : nullptr,
                         withBias ? bid.data() : nullptr, eps, ref.data());
  if (deviceOk(what))
    expectClose(what, dy->download(), ref, 1e-5, atol);

  auto dgy = up(gy);
  auto ddx = poisoned<float>(n);
  auto ddsc = poisoned<float>(N);
  auto ddbi = poisoned<float>(N);
  // Scale and bias gradients both wanted, or neither (dx alone).
  for (bool params : {true, false}) {
    g::layer_norm_grad(dx->p, s, axis, withScale ? dsc->p : nullptr, eps, dgy->p, ddx->p,
                       params ? ddsc->p : nullptr, params ? ddbi->p : nullptr);
    std::vector<double> rdx(n), rds(N), rdb(N);
    rt::layer_norm_grad<double>(xd.data(), s, axis, withScale ? scd.data() : nullptr, eps,
                                gyd.data(), rdx.data(), rds.data(), rdb.data());
    const std::string w = what + (params ? " grad" : " grad (dx only)");
    if (!deviceOk(w))
      continue;
    expectClose(w + " dx", ddx->download(), rdx, 1e-4, offset != 0 ? 5e-4 : 5e-5);
    if (params) {
      expectClose(w + " dscale", ddsc->download(), rds, 1e-4, 1e-4 + (offset != 0 ? 1e-3 : 0));
      expectClose(w + " dbias", ddbi->download(), rdb, 1e-4, 1e-4);
    }
  }
}

/// gpu::rotary and rotary_grad against the CPU kernels, bit for bit: the same
/// products and sums, rounded as written (none contracted into an FMA), so
/// the same values as the unfused Mul / Neg / Concat / Mul / Add chain; cos
/// and sin of shape `ts` broadcast to `xs`, and two signed zeros in x and dy.
void testRotary(Dims xs, Dims ts) {
  std::vector<float> x = randn(xs.numel()), c = randn(ts.numel()), sn = randn(ts.numel()),
                     gy = randn(xs.numel());
  x[1] = -0.0f;
  gy[2] = -0.0f;
  auto dx_ = up(x), dc = up(c), ds = up(sn), dg = up(gy);
  auto y = poisoned<float>(xs.numel()), gx = poisoned<float>(xs.numel());
  g::rotary(dx_->p, xs, dc->p, ts, ds->p, ts, y->p);
  g::rotary_grad(dg->p, xs, dc->p, ts, ds->p, ts, gx->p);
  std::vector<float> wy(x.size()), wg(x.size());
  rt::rotary<float>(x.data(), xs, c.data(), ts, sn.data(), ts, wy.data());
  rt::rotary_grad<float>(gy.data(), xs, c.data(), ts, sn.data(), ts, wg.data());
  const std::string what = "rotary " + str(xs) + " cos, sin " + str(ts);
  if (!deviceOk(what))
    return;
  expectEqual(what, y->download(), wy);
  expectEqual(what + " grad", gx->download(), wg);
}

void testRmsNorm(Dims s, int axis, bool withScale) {
  int a = axis < 0 ? axis + s.rank : axis;
  int64_t N = 1;
  for (int i = a; i < s.rank; ++i)
    N *= s.d[i];
  const int64_t n = s.numel();
  const std::vector<float> x = randn(n), sc = uniform(N, 0.5f, 1.5f), gy = randn(n);
  const float eps = 1e-6f;
  const std::string what =
      "rms_norm " + str(s) + " axis " + std::to_string(axis) + (withScale ? " scale" : "");
  auto dx = up(x);
  auto dsc = up(sc);
  auto dy = poisoned<float>(n);
  g::rms_norm(dx->p, s, axis, withScale ? dsc->p : nullptr, eps, dy->p);
  const std::vector<double> xd = toD(x), scd = toD(sc), gyd = toD(gy);
  std::vector<double> ref(n);
  rt::rms_norm<double>(xd.data(), s, axis, withScale ? scd.data() : nullptr, eps, ref.data());
  if (deviceOk(what))
    expectClose(what, dy->download(), ref, 1e-5, 2e-5);
  auto dgy = up(gy);
  for (bool params : {true, false}) {
    auto ddx = poisoned<float>(n);
    auto ddsc = poisoned<float>(N);
    g::rms_norm_grad(dx->p, s, axis, withScale ? dsc->p : nullptr, eps, dgy->p, ddx->p,
                     params ? ddsc->p : nullptr);
    std::vector<double> rdx(n), rds(N);
    rt::rms_norm_grad<double>(xd.data(), s, axis, withScale ? scd.data() : nullptr, eps, gyd.data(),
                              rdx.data(), rds.data());
    const std::string w = what + (params ? " grad" : " grad (dx only)");
    if (!deviceOk(w))
      continue;
    expectClose(w + " dx", ddx->download(), rdx, 1e-4, 5e-5);
    if (params)
      expectClose(w + " dscale", ddsc->download(), rds, 1e-4, 1e-4);
  }
}

/// No rows: dscale and dbias are sums over nothing, zeros.
void testNormNoRows() {
  const Dims s{0, 16};
  auto x = poisoned<float>(0);
  auto dsc = poisoned<float>(16);
  auto dbi = poisoned<float>(16);
  g::layer_norm_grad(x->p, s, 1, nullptr, 1e-5f, x->p, x->p, dsc->p, dbi->p);
  if (deviceOk("layer_norm_grad [0,16]")) {
    expectClose("layer_norm_grad [0,16] dscale", dsc->download(), std::vector<double>(16, 0), 0, 0);
    expectClose("layer_norm_grad [0,16] dbias", dbi->download(), std::vector<double>(16, 0), 0, 0);
  }
  auto drs = poisoned<float>(16);
  g::rms_norm_grad(x->p, s, 1, nullptr, 1e-5f, x->p, x->p, drs->p);
  if (deviceOk("rms_norm_grad [0,16]"))
    expectClose("rms_norm_grad [0,16] dscale", drs->download(), std::vector<double>(16, 0), 0, 0);
  // Empty tensors launch nothing and fail nothing.
  g::softmax(x->p, Dims{0, 7}, -1, false, x->p);
  g::layer_norm(x->p, s, 1, nullptr, nullptr, 1e-5f, x->p);
  g::rms_norm(x->p, s, 1, nullptr, 1e-5f, x->p);
  deviceOk("empty softmax and norms");
}

//===--- Attention --------------------------------------------------------===//

enum class Mask {
  None,
  Full,       // [Tq, Tk] random, broadcast over the batch
  KeyPadding, // [B0, 1, 1, Tk]: some keys -inf; every key of batch 0 -inf
  PerRow,     // [Tq, 1]: one value per query, one query row -inf
  Scalar,     // [1]
};

struct AttnCase {
  std::vector<int64_t> batch;
  int64_t tq, tk, d, dv;
  bool causal;
  Mask mask;
};

std::string caseName(const AttnCase &c) {
  std::string s = "attention b[";
  for (size_t i = 0; i < c.batch.size(); ++i)
    s += (i ? "," : "") + std::to_string(c.batch[i]);
  s += "] Tq " + std::to_string(c.tq) + " Tk " + std::to_string(c.tk) + " D " +
       std::to_string(c.d) + " Dv " + std::to_string(c.dv) + (c.causal ? " causal" : "");
  const char *m[] = {"", " mask[Tq,Tk]", " mask[B,1,1,Tk]", " mask[Tq,1]", " mask[1]"};
  return s + m[static_cast<int>(c.mask)];
}

Dims withLast2(const std::vector<int64_t> &batch, int64_t a, int64_t b) {
  Dims s;
  for (int64_t v : batch)
    s.d[s.rank++] = v;
  s.d[s.rank++] = a;
  s.d[s.rank++] = b;
  return s;
}

std::vector<float> makeMask(const AttnCase &c, Dims &ms) {
  std::vector<float> m;
  switch (c.mask) {
  case Mask::None:
    return m;
  case Mask::Full:
    ms = Dims{c.tq, c.tk};
    m = randn(c.tq * c.tk);
    for (size_t i = 0; i < m.size(); i += 7)
      m[i] = -kInf;
    return m;
  case Mask::KeyPadding: {
    ms = Dims{};
    const int64_t b0 = c.batch.empty() ? 1 : c.batch[0];
    if (!c.batch.empty())
      ms.d[ms.rank++] = b0;
    for (size_t i = 1; i < c.batch.size(); ++i)
      ms.d[ms.rank++] = 1;
    ms.d[ms.rank++] = 1;
    ms.d[ms.rank++] = c.tk;
    m.assign(b0 * c.tk, 0.0f);
    for (int64_t b = 0; b < b0; ++b)
      for (int64_t j = 0; j < c.tk; ++j)
        if (b == 0 || j % 5 == 3)
          m[b * c.tk + j] = -kInf;
    return m;
  }
  case Mask::PerRow:
    ms = Dims{c.tq, 1};
    m = randn(c.tq);
    m[c.tq / 2] = -kInf;
    return m;
  case Mask::Scalar:
    ms = Dims{1};
    m = {0.75f};
    return m;
  }
  return m;
}

// Tolerances: scores are dot products of D <= 300 unit-scale terms times
// 1/sqrt(D), O(1); the outputs are convex combinations of v rows, the
// gradients sums over up to ~100 keys or queries of O(1) products, all in
// fp32 (about 1e-6 relative per operation, a few dozen in a chain): 5e-5
// absolute and 5e-4 relative for y, 2e-4 and 1e-3 for the gradients.
void testAttention(const AttnCase &c) {
  const Dims qs = withLast2(c.batch, c.tq, c.d), ks = withLast2(c.batch, c.tk, c.d),
             vs = withLast2(c.batch, c.tk, c.dv), ys = withLast2(c.batch, c.tq, c.dv);
  Dims ms;
  const std::vector<float> mask = makeMask(c, ms);
  const std::vector<float> q = randn(qs.numel()), k = randn(ks.numel()), v = randn(vs.numel()),
                           gy = randn(ys.numel());
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  const std::string what = caseName(c);

  auto dq_ = up(q);
  auto dk_ = up(k);
  auto dv_ = up(v);
  auto dm = up(mask);
  const float *mp = mask.empty() ? nullptr : dm->p;
  auto y = poisoned<float>(ys.numel());
  g::attention(dq_->p, qs, dk_->p, ks, dv_->p, vs, mp, ms, scale, c.causal, y->p);
  const std::vector<double> qd = toD(q), kd = toD(k), vd = toD(v), md = toD(mask), gyd = toD(gy);
  const double *mdp = mask.empty() ? nullptr : md.data();
  std::vector<double> ref(ys.numel());
  rt::attention<double>(qd.data(), qs, kd.data(), ks, vd.data(), vs, mdp, ms, scale, c.causal,
                        ref.data());
  if (deviceOk(what))
    expectClose(what, y->download(), ref, 5e-4, 5e-5);

  auto dgy = up(gy);
  auto gq = poisoned<float>(qs.numel());
  auto gk = poisoned<float>(ks.numel());
  auto gv = poisoned<float>(vs.numel());
  g::attention_grad(dq_->p, qs, dk_->p, ks, dv_->p, vs, mp, ms, scale, c.causal, dgy->p, gq->p,
                    gk->p, gv->p);
  std::vector<double> rq(qs.numel()), rk(ks.numel()), rv(vs.numel());
  rt::attention_grad<double>(qd.data(), qs, kd.data(), ks, vd.data(), vs, mdp, ms, scale, c.causal,
                             gyd.data(), rq.data(), rk.data(), rv.data());
  if (!deviceOk(what + " grad"))
    return;
  expectClose(what + " dq", gq->download(), rq, 1e-3, 2e-4);
  expectClose(what + " dk", gk->download(), rk, 1e-3, 2e-4);
  expectClose(what + " dv", gv->download(), rv, 1e-3, 2e-4);

  // attention_stats and attention_grad_stats (carve-save-attention-stats):
  // the same output, and from it and the saved log-sum-exp the same
  // gradients, bit for bit, without the forward again.
  Dims ls = ys;
  --ls.rank;
  auto y2 = poisoned<float>(ys.numel());
  auto lse = poisoned<float>(ls.numel());
  g::attention_stats(dq_->p, qs, dk_->p, ks, dv_->p, vs, mp, ms, scale, c.causal, y2->p, lse->p);
  auto sq = poisoned<float>(qs.numel());
  auto sk = poisoned<float>(ks.numel());
  auto sv = poisoned<float>(vs.numel());
  g::attention_grad_stats(dq_->p, qs, dk_->p, ks, dv_->p, vs, mp, ms, scale, c.causal, y2->p,
                          lse->p, dgy->p, sq->p, sk->p, sv->p);
  if (!deviceOk(what + " stats"))
    return;
  expectEqual(what + " attention_stats y", y2->download(), y->download());
  expectEqual(what + " attention_grad_stats dq", sq->download(), gq->download());
  expectEqual(what + " attention_grad_stats dk", sk->download(), gk->download());
  expectEqual(what + " attention_grad_stats dv", sv->download(), gv->download());
}

/// bf16 / fp16 attention against the CPU target's float emulation: both
/// round q, k, v (and dy) to the format and compute in fp32, so they differ
/// only by fp32 summation order and exp: 2e-4 relative, 2e-5 absolute
/// (2e-4 for gradients). Also checks that the rounding happened (the result
/// differs from fp32 attention).
void testAttentionPrecision(rt::Precision p, const char *name, bool causal) {
  const std::vector<int64_t> batch{2, 3};
  const int64_t tq = 45, d = 64;
  const Dims qs = withLast2(batch, tq, d), ys = qs;
  const std::vector<float> q = randn(qs.numel()), k = randn(qs.numel()), v = randn(qs.numel()),
                           gy = randn(qs.numel());
  const float scale = 0.125f;
  const std::string what = std::string(name) + " attention" + (causal ? " causal" : "");
  auto dq_ = up(q);
  auto dk_ = up(k);
  auto dv_ = up(v);
  auto dgy = up(gy);
  auto y32 = poisoned<float>(ys.numel());
  g::setPrecision(rt::Precision::F32);
  g::attention(dq_->p, qs, dk_->p, qs, dv_->p, qs, nullptr, Dims{}, scale, causal, y32->p);
  auto y = poisoned<float>(ys.numel());
  auto gq = poisoned<float>(qs.numel());
  auto gk = poisoned<float>(qs.numel());
  auto gv = poisoned<float>(qs.numel());
  g::setPrecision(p);
  g::attention(dq_->p, qs, dk_->p, qs, dv_->p, qs, nullptr, Dims{}, scale, causal, y->p);
  g::attention_grad(dq_->p, qs, dk_->p, qs, dv_->p, qs, nullptr, Dims{}, scale, causal, dgy->p,
                    gq->p, gk->p, gv->p);
  // The saved-statistics pair under the same precision, bit for bit.
  Dims ls = qs;
  --ls.rank;
  auto y2 = poisoned<float>(ys.numel());
  auto lse = poisoned<float>(ls.numel());
  auto sq = poisoned<float>(qs.numel());
  auto sk = poisoned<float>(qs.numel());
  auto sv = poisoned<float>(qs.numel());
  g::attention_stats(dq_->p, qs, dk_->p, qs, dv_->p, qs, nullptr, Dims{}, scale, causal, y2->p,
                     lse->p);
  g::attention_grad_stats(dq_->p, qs, dk_->p, qs, dv_->p, qs, nullptr, Dims{}, scale, causal, y2->p,
                          lse->p, dgy->p, sq->p, sk->p, sv->p);
  g::setPrecision(rt::Precision::F32);

  rt::setPrecision(p);
  std::vector<float> ref(ys.numel()), rq(qs.numel()), rk(qs.numel()), rv(qs.numel());
  rt::attention<float>(q.data(), qs, k.data(), qs, v.data(), qs, nullptr, Dims{}, scale, causal,
                       ref.data());
  rt::attention_grad<float>(q.data(), qs, k.data(), qs, v.data(), qs, nullptr, Dims{}, scale,
                            causal, gy.data(), rq.data(), rk.data(), rv.data());
  rt::setPrecision(rt::Precision::F32);
  if (!deviceOk(what))
    return;
  const std::vector<float> got = y->download(), got32 = y32->download();
  expectClose(what, got, toD(ref), 2e-4, 2e-5);
  expectClose(what + " dq", gq->download(), toD(rq), 2e-4, 2e-4);
  expectClose(what + " dk", gk->download(), toD(rk), 2e-4, 2e-4);
  expectClose(what + " dv", gv->download(), toD(rv), 2e-4, 2e-4);
  expectEqual(what + " attention_stats y", y2->download(), got);
  expectEqual(what + " attention_grad_stats dq", sq->download(), gq->download());
  expectEqual(what + " attention_grad_stats dk", sk->download(), gk->download());
  expectEqual(what + " attention_grad_stats dv", sv->download(), gv->download());
  ++checks();
  int64_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i)
    differ += std::fabs(got[i] - got32[i]) > 1e-4f;
  if (differ == 0) {
    ++failures();
    std::printf("FAIL %s: equals fp32 attention everywhere (inputs not rounded?)\n", what.c_str());
  } else {
    std::printf("ok   %s differs from fp32 in %lld of %zu elements (rounded inputs)\n",
                what.c_str(), (long long)differ, got.size());
  }
}

//===--- Attention through cuDNN ------------------------------------------===//

/// ||got - ref||_2 / ||ref||_2 <= bound.
void expectNormwise(const std::string &what, const std::vector<float> &got,
                    const std::vector<double> &ref, double bound) {
  ++checks();
  double num = 0, den = 0;
  bool finite = got.size() == ref.size();
  for (size_t i = 0; finite && i < got.size(); ++i) {
    finite = std::isfinite(got[i]);
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  const double err = finite && den > 0 ? std::sqrt(num / den) : INFINITY;
  if (err <= bound) {
    std::printf("ok   %s: normwise error %.2e <= %.2e\n", what.c_str(), err, bound);
    return;
  }
  ++failures();
  std::printf("FAIL %s: normwise error %.2e > %.2e%s\n", what.c_str(), err, bound,
              finite ? "" : " (a non-finite value, or a size mismatch)");
}

/// attention_stats_cudnn and attention_grad_stats_cudnn (cuDNN's fused flash
/// attention) against the float64 CPU attention of the same 16-bit-rounded
/// inputs, beside carve's own kernel at the same precision. cuDNN rounds the
/// probabilities P to the 16-bit format before P V, writes O, dQ, dK and dV
/// in it, and reads O and dO rounded: with u the format's unit roundoff
/// (2^-8 bf16, 2^-11 fp16), |O~ - O| <= u (sum_j P_ij |V_j| + |O_i|), whose
/// norm is within 2u of ||O|| for these inputs (|V| and |O| alike: randn
/// values, softmax weights): bound 4u for O. The gradients pass through up to
/// four such roundings (P or P^T, dS or dS^T, the 16-bit O and dO, the
/// output), and dS = P (dP - D) can cancel: bound 16u. The row statistics are
/// f32 in both: 1e-5 absolute. Also: the cuDNN path ran (its call counters
/// moved), and where it must not run -- fp32, a mask tensor -- the calls are
/// carve's kernel, bit for bit.
void testAttentionCudnn(rt::Precision p, const char *name, std::vector<int64_t> batch, int64_t t,
                        int64_t d, bool causal) {
  const Dims qs = withLast2(batch, t, d);
  Dims ls = qs;
  --ls.rank;
  const int64_t n = qs.numel();
  const std::vector<float> q = randn(n), k = randn(n), v = randn(n), gy = randn(n);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::string what = std::string(name) + " cuDNN attention [" + std::to_string(t) + " x " +
                     std::to_string(d) + "]" + (causal ? " causal" : "");
  if (!g::cudnnAttentionBuilt()) {
    std::printf("not run %s: this runtime was built without cuDNN\n", what.c_str());
    return;
  }
  auto dq_ = up(q), dk_ = up(k), dv_ = up(v), dgy = up(gy);
  auto y = poisoned<float>(n), lse = poisoned<float>(ls.numel());
  auto gq = poisoned<float>(n), gk = poisoned<float>(n), gv = poisoned<float>(n);
  auto yc = poisoned<float>(n), lsec = poisoned<float>(ls.numel());
  auto cq = poisoned<float>(n), ck = poisoned<float>(n), cv = poisoned<float>(n);
  int64_t f0 = 0, b0 = 0, f1 = 0, b1 = 0;
  g::cudnnAttentionCalls(f0, b0);
  g::setPrecision(p);
  g::attention_stats(dq_->p, qs, dk_->p, qs, dv_->p, qs, nullptr, Dims{}, scale, causal, y->p,
                     lse->p);
  g::attention_grad_stats(dq_->p, qs, dk_->p, qs, dv_->p, qs, nullptr, Dims{}, scale, causal, y->p,
                          lse->p, dgy->p, gq->p, gk->p, gv->p);
  g::attention_stats_cudnn(dq_->p, nullptr, qs, dk_->p, nullptr, qs, dv_->p, nullptr, qs, nullptr,
                           Dims{}, scale, causal, yc->p, lsec->p);
  g::attention_grad_stats_cudnn(dq_->p, false, qs, dk_->p, false, qs, dv_->p, false, qs, nullptr,
                                Dims{}, scale, causal, yc->p, lsec->p, dgy->p, cq->p, ck->p, cv->p);
  // The gradient again from q, k, v given as their 16-bit tensors (carve.read16).
  auto q16 = poisoned<uint16_t>(n), k16 = poisoned<uint16_t>(n), v16 = poisoned<uint16_t>(n);
  auto to16 = p == rt::Precision::BF16 ? g::toBf16 : g::toF16;
  to16(dq_->p, q16->p, n);
  to16(dk_->p, k16->p, n);
  to16(dv_->p, v16->p, n);
  auto hq = poisoned<float>(n), hk = poisoned<float>(n), hv = poisoned<float>(n);
  g::attention_grad_stats_cudnn(q16->p, true, qs, k16->p, true, qs, v16->p, true, qs, nullptr,
                                Dims{}, scale, causal, yc->p, lsec->p, dgy->p, hq->p, hk->p, hv->p);
  // With rank-4 operands, the gradients written as [b, t, h, d] (bthd:
  // carve-fold-views' "producer" transposes, cuDNN's strided outputs).
  const bool r4 = qs.rank == 4;
  const Dims perm{0, 2, 1, 3};
  auto tq = poisoned<float>(n), tk = poisoned<float>(n), tv = poisoned<float>(n);
  // And dy given as [b, t, h, d] too (dy_bthd: the "consumer" transpose).
  auto sq = poisoned<float>(n), sk = poisoned<float>(n), sv = poisoned<float>(n);
  auto dgyT = poisoned<float>(n);
  if (r4) {
    g::attention_grad_stats_cudnn(q16->p, true, qs, k16->p, true, qs, v16->p, true, qs, nullptr,
                                  Dims{}, scale, causal, yc->p, lsec->p, dgy->p, tq->p, tk->p,
                                  tv->p, /*bthd=*/true);
    g::transpose<float>(dgy->p, qs, perm, dgyT->p);
    g::attention_grad_stats_cudnn(q16->p, true, qs, k16->p, true, qs, v16->p, true, qs, nullptr,
                                  Dims{}, scale, causal, yc->p, lsec->p, dgyT->p, sq->p, sk->p,
                                  sv->p, /*bthd=*/true, /*dyBthd=*/true);
  }
  // And written in 16 bits into the rows of one [b, t, 3 h d] tensor, dq at
  // column 0, dk at h d, dv at 2 h d (carve-fold-views' "assemble": the QKV
  // projection's gradient), widened here for the comparison.
  const int64_t hd = r4 ? qs.d[1] * qs.d[3] : 0, bt = r4 ? qs.d[0] * qs.d[2] : 0;
  auto a16 = poisoned<uint16_t>(3 * n);
  auto a32 = poisoned<float>(3 * n);
  if (r4) {
    g::attention_grad_stats_cudnn(q16->p, true, qs, k16->p, true, qs, v16->p, true, qs, nullptr,
                                  Dims{}, scale, causal, yc->p, lsec->p, dgy->p, nullptr, nullptr,
                                  nullptr, /*bthd=*/true, /*dyBthd=*/false, a16->p, a16->p + hd,
                                  a16->p + 2 * hd, 3 * hd);
    (p == rt::Precision::BF16 ? g::fromBf16 : g::fromF16)(a16->p, a32->p, 3 * n);
  }
  // The forward writing O in 16 bits as [b, t, h, d] (carve-fold-views'
  // "producer" on O's transpose: its copy), and the gradient reading o there.
  auto o16 = poisoned<uint16_t>(n);
  auto o32 = poisoned<float>(n), lseo = poisoned<float>(ls.numel());
  auto oq = poisoned<float>(n), ko = poisoned<float>(n), ov = poisoned<float>(n);
  if (r4) {
    g::attention_stats_cudnn(nullptr, q16->p, qs, nullptr, k16->p, qs, nullptr, v16->p, qs, nullptr,
                             Dims{}, scale, causal, nullptr, lseo->p, o16->p);
    (p == rt::Precision::BF16 ? g::fromBf16 : g::fromF16)(o16->p, o32->p, n);
    g::attention_grad_stats_cudnn(q16->p, true, qs, k16->p, true, qs, v16->p, true, qs, nullptr,
                                  Dims{}, scale, causal, nullptr, lseo->p, dgy->p, oq->p, ko->p,
                                  ov->p, false, false, nullptr, nullptr, nullptr, 0, o16->p);
  }
  // dy given in 16 bits (written so by its matmul: carve.write16).
  auto dy16 = poisoned<uint16_t>(n);
  to16(dgy->p, dy16->p, n);
  auto eq = poisoned<float>(n), ek = poisoned<float>(n), ev = poisoned<float>(n);
  g::attention_grad_stats_cudnn(q16->p, true, qs, k16->p, true, qs, v16->p, true, qs, nullptr,
                                Dims{}, scale, causal, yc->p, lsec->p, nullptr, eq->p, ek->p, ev->p,
                                false, false, nullptr, nullptr, nullptr, 0, nullptr, dy16->p);
  // The gradients written in 16 bits shaped as q, k, v (no bthd:
  // carve-round-operands16's copies of dq, dk, dv, which their readers read
  // in 16 bits), alone and with the f32 values: the bits the call widened.
  auto p16 = poisoned<uint16_t>(3 * n), r16 = poisoned<uint16_t>(3 * n);
  auto fq = poisoned<float>(n), fk = poisoned<float>(n), fv = poisoned<float>(n);
  g::attention_grad_stats_cudnn(q16->p, true, qs, k16->p, true, qs, v16->p, true, qs, nullptr,
                                Dims{}, scale, causal, yc->p, lsec->p, dgy->p, nullptr, nullptr,
                                nullptr, false, false, p16->p, p16->p + n, p16->p + 2 * n, 0);
  g::attention_grad_stats_cudnn(q16->p, true, qs, k16->p, true, qs, v16->p, true, qs, nullptr,
                                Dims{}, scale, causal, yc->p, lsec->p, dgy->p, fq->p, fk->p, fv->p,
                                false, false, r16->p, r16->p + n, r16->p + 2 * n, 0);
  auto p32 = poisoned<float>(3 * n);
  (p == rt::Precision::BF16 ? g::fromBf16 : g::fromF16)(p16->p, p32->p, 3 * n);
  // The forward again from the copies (its f32 operands poisoned: must be unread).
  auto yh = poisoned<float>(n), lseh = poisoned<float>(ls.numel()), nan = poisoned<float>(n);
  g::attention_stats_cudnn(nan->p, q16->p, qs, nan->p, k16->p, qs, nan->p, v16->p, qs, nullptr,
                           Dims{}, scale, causal, yh->p, lseh->p);
  // q, k and v read in place as the columns of one 16-bit [b, t, 3 h d]
  // tensor (carve-fold-views' "strided": the QKV projection's copy), by the
  // forward and the gradient: the same bits as from the copies above.
  auto yi = poisoned<float>(n), lsei = poisoned<float>(ls.numel());
  auto iq = poisoned<float>(n), ik = poisoned<float>(n), iv = poisoned<float>(n);
  if (r4) {
    const std::vector<uint16_t> src[3] = {q16->download(), k16->download(), v16->download()};
    std::vector<uint16_t> packed(3 * n);
    const int64_t B = qs.d[0], H = qs.d[1], T = qs.d[2], D = qs.d[3];
    for (int i = 0; i < 3; ++i)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t t = 0; t < T; ++t)
            for (int64_t d = 0; d < D; ++d)
              packed[(b * T + t) * 3 * hd + i * hd + h * D + d] =
                  src[i][((b * H + h) * T + t) * D + d];
    auto qkv = up(packed);
    g::attention_stats_cudnn(nullptr, qkv->p, qs, nullptr, qkv->p + hd, qs, nullptr,
                             qkv->p + 2 * hd, qs, nullptr, Dims{}, scale, causal, yi->p, lsei->p,
                             nullptr, 3 * hd);
    g::attention_grad_stats_cudnn(qkv->p, true, qs, qkv->p + hd, true, qs, qkv->p + 2 * hd, true,
                                  qs, nullptr, Dims{}, scale, causal, yc->p, lsec->p, dgy->p, iq->p,
                                  ik->p, iv->p, false, false, nullptr, nullptr, nullptr, 0, nullptr,
                                  nullptr, 3 * hd);
  }
  g::setPrecision(rt::Precision::F32);
  if (!deviceOk(what))
    return;
  g::cudnnAttentionCalls(f1, b1);
  ++checks();
  if (f1 != f0 + (r4 ? 4 : 2) || b1 != b0 + (r4 ? 10 : 5)) {
    ++failures();
    std::printf("FAIL %s: cuDNN ran %lld forward and %lld backward graphs of %d and %d (stderr "
                "says why it refused)\n",
                what.c_str(), (long long)(f1 - f0), (long long)(b1 - b0), r4 ? 4 : 2, r4 ? 10 : 5);
    return;
  }
  std::printf("ok   %s ran as cuDNN graphs\n", what.c_str());
  {
    const std::vector<float> all = p32->download();
    const std::vector<float> h[3] = {hq->download(), hk->download(), hv->download()};
    const std::vector<float> f[3] = {fq->download(), fk->download(), fv->download()};
    const char *names[3] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; ++i) {
      expectEqual(what + " " + names[i] + " in 16 bits as [b, h, t, d]",
                  std::vector<float>(all.begin() + i * n, all.begin() + (i + 1) * n), h[i]);
      expectEqual(what + " " + names[i] + " in f32 beside its 16-bit copy", f[i], h[i]);
    }
    expectEqual(what + " the 16-bit gradients with and without the f32 ones", r16->download(),
                p16->download());
  }
  // The reference: float64 attention of the rounded inputs (what both read).
  auto rounded = [&](const std::vector<float> &x) {
    std::vector<double> r(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      r[i] = p == rt::Precision::BF16 ? rt::roundToBf16(x[i]) : rt::roundToF16(x[i]);
    return r;
  };
  const std::vector<double> q64 = rounded(q), k64 = rounded(k), v64 = rounded(v),
                            gy64 = rounded(gy);
  std::vector<double> ref(n), rq(n), rk(n), rv(n);
  rt::attention<double>(q64.data(), qs, k64.data(), qs, v64.data(), qs, nullptr, Dims{}, scale,
                        causal, ref.data());
  rt::attention_grad<double>(q64.data(), qs, k64.data(), qs, v64.data(), qs, nullptr, Dims{}, scale,
                             causal, gy64.data(), rq.data(), rk.data(), rv.data());
  const double u = p == rt::Precision::BF16 ? 1.0 / 256 : 1.0 / 2048;
  expectNormwise(what + " y", yc->download(), ref, 4 * u);
  expectNormwise(what + " dq", cq->download(), rq, 16 * u);
  expectNormwise(what + " dk", ck->download(), rk, 16 * u);
  expectNormwise(what + " dv", cv->download(), rv, 16 * u);
  expectNormwise(what + " dq (16-bit q, k, v)", hq->download(), rq, 16 * u);
  expectNormwise(what + " dk (16-bit q, k, v)", hk->download(), rk, 16 * u);
  expectNormwise(what + " dv (16-bit q, k, v)", hv->download(), rv, 16 * u);
  expectNormwise(what + " dq (16-bit dy)", eq->download(), rq, 16 * u);
  expectNormwise(what + " dk (16-bit dy)", ek->download(), rk, 16 * u);
  expectNormwise(what + " dv (16-bit dy)", ev->download(), rv, 16 * u);
  if (r4) {
    // The reference transposed to [b, t, h, d]: a gradient in the wrong
    // place is off by its whole size.
    auto transposed = [&](const std::vector<double> &x) {
      std::vector<double> y(x.size());
      const int64_t B = qs.d[0], H = qs.d[1], T = qs.d[2], D = qs.d[3];
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t t = 0; t < T; ++t)
            for (int64_t d = 0; d < D; ++d)
              y[((b * T + t) * H + h) * D + d] = x[((b * H + h) * T + t) * D + d];
      return y;
    };
    expectNormwise(what + " dq as [b, t, h, d]", tq->download(), transposed(rq), 16 * u);
    expectNormwise(what + " dk as [b, t, h, d]", tk->download(), transposed(rk), 16 * u);
    expectNormwise(what + " dv as [b, t, h, d]", tv->download(), transposed(rv), 16 * u);
    expectNormwise(what + " dq as [b, t, h, d] from dy as [b, t, h, d]", sq->download(),
                   transposed(rq), 16 * u);
    expectNormwise(what + " dk as [b, t, h, d] from dy as [b, t, h, d]", sk->download(),
                   transposed(rk), 16 * u);
    expectNormwise(what + " dv as [b, t, h, d] from dy as [b, t, h, d]", sv->download(),
                   transposed(rv), 16 * u);
    // Piece i of the [b, t, 3 h d] rows, as [b, t, h, d].
    const std::vector<float> all = a32->download();
    auto piece = [&](int i) {
      std::vector<float> x(n);
      for (int64_t r = 0; r < bt; ++r)
        for (int64_t c = 0; c < hd; ++c)
          x[r * hd + c] = all[r * 3 * hd + i * hd + c];
      return x;
    };
    expectNormwise(what + " y in 16 bits as [b, t, h, d]", o32->download(), transposed(ref), 4 * u);
    expectClose(what + " row log-sum-exp (y in 16 bits)", lseo->download(), toD(lsec->download()),
                1e-5, 1e-5);
    expectNormwise(what + " dq from o in 16 bits as [b, t, h, d]", oq->download(), rq, 16 * u);
    expectNormwise(what + " dk from o in 16 bits as [b, t, h, d]", ko->download(), rk, 16 * u);
    expectNormwise(what + " dv from o in 16 bits as [b, t, h, d]", ov->download(), rv, 16 * u);
    expectNormwise(what + " dq in 16 bits in [b, t, 3 h d]", piece(0), transposed(rq), 16 * u);
    expectNormwise(what + " dk in 16 bits in [b, t, 3 h d]", piece(1), transposed(rk), 16 * u);
    expectNormwise(what + " dv in 16 bits in [b, t, 3 h d]", piece(2), transposed(rv), 16 * u);
    expectEqual(what + " y from q, k, v in place in [b, t, 3 h d]", yi->download(), yh->download());
    expectEqual(what + " row log-sum-exp from q, k, v in place", lsei->download(),
                lseh->download());
    expectEqual(what + " dq from q, k, v in place", iq->download(), hq->download());
    expectEqual(what + " dk from q, k, v in place", ik->download(), hk->download());
    expectEqual(what + " dv from q, k, v in place", iv->download(), hv->download());
  }
  // The forward from the copies: the same call on the same bits.
  expectEqual(what + " y (16-bit q, k, v)", yh->download(), yc->download());
  expectEqual(what + " row log-sum-exp (16-bit q, k, v)", lseh->download(), lsec->download());
  expectClose(what + " row log-sum-exp", lsec->download(), toD(lse->download()), 1e-5, 1e-5);
  // carve's kernel against the same reference, for the record (its P and O
  // stay f32: well inside the bounds above).
  expectNormwise(what + " (carve's kernel) y", y->download(), ref, 4 * u);
  expectNormwise(what + " (carve's kernel) dq", gq->download(), rq, 16 * u);
}

/// An additive mask through cuDNN (its bias: the mask broadcast to [1 or b,
/// 1 or h, tq, tk] and rounded to the 16-bit format by attentionMaskBias16)
/// against the float64 attention of the same rounded inputs and mask, the
/// bounds of testAttentionCudnn; from f32 and from 16-bit q, k, v; and that
/// cuDNN ran every call. `kind`: "padding" (a [b, 1, 1, tk] mask of 0 and
/// -10000, BERT's), "additive" (a [tq, tk] mask of randn values, every one
/// of them rounded), "full" ([b, h, tq, tk] randn values, and -FLT_MAX on
/// one query's every key: a Hugging Face mask, clamped to the format's range
/// and still masking alike).
void testAttentionCudnnMask(rt::Precision p, const char *name, const char *kind, bool causal) {
  // Its own random numbers: the tests after it draw what they drew before
  // it was added.
  const std::mt19937_64 saved = rng();
  struct Restore {
    const std::mt19937_64 &s;
    ~Restore() { rng() = s; }
  } restore{saved};
  rng().seed(std::hash<std::string>()(std::string(kind)) + (causal ? 1 : 0));
  const Dims qs{2, 3, 24, 16};
  Dims ls = qs;
  --ls.rank;
  const int64_t n = qs.numel(), B = 2, H = 3, T = 24;
  const std::string k(kind);
  const Dims ms = k == "padding"    ? Dims{B, 1, 1, T}
                  : k == "additive" ? Dims{T, T}
                                    : Dims{B, H, T, T};
  std::vector<float> mask = randn(ms.numel());
  if (k == "padding")
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < T; ++j)
        mask[b * T + j] = j >= T - 5 * (b + 1) ? -10000.0f : 0.0f;
  if (k == "full")
    for (int64_t j = 0; j < T; ++j)
      mask[((1 * H + 2) * T + 7) * T + j] = -std::numeric_limits<float>::max();
  const std::string what =
      std::string(name) + " cuDNN attention, " + kind + " mask" + (causal ? ", causal" : "");
  if (!g::cudnnAttentionBuilt()) {
    std::printf("not run %s: this runtime was built without cuDNN\n", what.c_str());
    return;
  }
  const std::vector<float> q = randn(n), kk = randn(n), v = randn(n);
  std::vector<float> gy = randn(n);
  // The -FLT_MAX row's output is no loss's input (a padding query's): dy 0
  // there. (Its gradient is not the softmax's: the log-sum-exp the backward
  // subtracts is lost against -FLT_MAX in f32, in any kernel that keeps one.)
  if (k == "full")
    for (int64_t d = 0; d < 16; ++d)
      gy[((1 * H + 2) * T + 7) * 16 + d] = 0.0f;
  const float scale = 0.25f;
  auto dq_ = up(q), dk_ = up(kk), dv_ = up(v), dgy = up(gy), dm = up(mask);
  auto y = poisoned<float>(n), lse = poisoned<float>(ls.numel());
  auto gq = poisoned<float>(n), gk = poisoned<float>(n), gv = poisoned<float>(n);
  auto q16 = poisoned<uint16_t>(n), k16 = poisoned<uint16_t>(n), v16 = poisoned<uint16_t>(n);
  auto y2 = poisoned<float>(n), lse2 = poisoned<float>(ls.numel());
  auto hq = poisoned<float>(n), hk = poisoned<float>(n), hv = poisoned<float>(n);
  int64_t f0 = 0, b0 = 0, f1 = 0, b1 = 0;
  g::cudnnAttentionCalls(f0, b0);
  g::setPrecision(p);
  g::attention_stats_cudnn(dq_->p, nullptr, qs, dk_->p, nullptr, qs, dv_->p, nullptr, qs, dm->p, ms,
                           scale, causal, y->p, lse->p);
  g::attention_grad_stats_cudnn(dq_->p, false, qs, dk_->p, false, qs, dv_->p, false, qs, dm->p, ms,
                                scale, causal, y->p, lse->p, dgy->p, gq->p, gk->p, gv->p);
  auto to16 = p == rt::Precision::BF16 ? g::toBf16 : g::toF16;
  to16(dq_->p, q16->p, n);
  to16(dk_->p, k16->p, n);
  to16(dv_->p, v16->p, n);
  g::attention_stats_cudnn(nullptr, q16->p, qs, nullptr, k16->p, qs, nullptr, v16->p, qs, dm->p, ms,
                           scale, causal, y2->p, lse2->p);
  g::attention_grad_stats_cudnn(q16->p, true, qs, k16->p, true, qs, v16->p, true, qs, dm->p, ms,
                                scale, causal, y2->p, lse2->p, dgy->p, hq->p, hk->p, hv->p);
  g::setPrecision(rt::Precision::F32);
  if (!deviceOk(what))
    return;
  g::cudnnAttentionCalls(f1, b1);
  ++checks();
  if (f1 != f0 + 2 || b1 != b0 + 2) {
    ++failures();
    std::printf("FAIL %s: cuDNN ran %lld forward and %lld backward graphs of 2 and 2 (stderr says "
                "why it refused)\n",
                what.c_str(), (long long)(f1 - f0), (long long)(b1 - b0));
    return;
  }
  std::printf("ok   %s ran as cuDNN graphs\n", what.c_str());
  const bool bf = p == rt::Precision::BF16;
  const double hi = bf ? 3.38953139e38 : 65504.0;
  auto rounded = [&](const std::vector<float> &x, bool clamp) {
    std::vector<double> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      float e = x[i];
      if (clamp)
        e = std::max<float>(-hi, std::min<float>(hi, e));
      r[i] = bf ? rt::roundToBf16(e) : rt::roundToF16(e);
    }
    return r;
  };
  const std::vector<double> q64 = rounded(q, false), k64 = rounded(kk, false),
                            v64 = rounded(v, false), gy64 = rounded(gy, false),
                            m64 = rounded(mask, true);
  std::vector<double> ref(n), rq(n), rk(n), rv(n);
  rt::attention<double>(q64.data(), qs, k64.data(), qs, v64.data(), qs, m64.data(), ms, scale,
                        causal, ref.data());
  rt::attention_grad<double>(q64.data(), qs, k64.data(), qs, v64.data(), qs, m64.data(), ms, scale,
                             causal, gy64.data(), rq.data(), rk.data(), rv.data());
  const double u = bf ? 1.0 / 256 : 1.0 / 2048;
  expectNormwise(what + " y", y->download(), ref, 4 * u);
  expectNormwise(what + " dq", gq->download(), rq, 16 * u);
  expectNormwise(what + " dk", gk->download(), rk, 16 * u);
  expectNormwise(what + " dv", gv->download(), rv, 16 * u);
  expectEqual(what + " y (16-bit q, k, v)", y2->download(), y->download());
  expectEqual(what + " row log-sum-exp (16-bit q, k, v)", lse2->download(), lse->download());
  expectNormwise(what + " dq (16-bit q, k, v)", hq->download(), rq, 16 * u);
  expectNormwise(what + " dk (16-bit q, k, v)", hk->download(), rk, 16 * u);
  expectNormwise(what + " dv (16-bit q, k, v)", hv->download(), rv, 16 * u);
}

/// Where cuDNN must not run, the _cudnn entries are carve's kernels bit for
/// bit and the call counters stay put: an fp32 plan; a bf16 one with a mask
/// and a head dimension cuDNN lacks (12).
void testAttentionCudnnFallback() {
  const Dims qs{2, 3, 24, 12};
  Dims ls = qs;
  --ls.rank;
  const int64_t n = qs.numel();
  const std::vector<float> q = randn(n), k = randn(n), v = randn(n), gy = randn(n);
  const std::vector<float> mask = randn(24 * 24);
  auto dq_ = up(q), dk_ = up(k), dv_ = up(v), dgy = up(gy), dm = up(mask);
  for (int c = 0; c < 2; ++c) {
    const bool masked = c == 1;
    const rt::Precision p = masked ? rt::Precision::BF16 : rt::Precision::F32;
    const std::string what = std::string("cuDNN attention fallback (") +
                             (masked ? "bf16, a mask, head dimension 12" : "fp32") + ")";
    const float *mp = masked ? dm->p : nullptr;
    const Dims ms = masked ? Dims{24, 24} : Dims{};
    auto y = poisoned<float>(n), lse = poisoned<float>(ls.numel());
    auto yc = poisoned<float>(n), lsec = poisoned<float>(ls.numel());
    auto gq = poisoned<float>(n), gk = poisoned<float>(n), gv = poisoned<float>(n);
    auto cq = poisoned<float>(n), ck = poisoned<float>(n), cv = poisoned<float>(n);
    int64_t f0 = 0, b0 = 0, f1 = 0, b1 = 0;
    g::cudnnAttentionCalls(f0, b0);
    g::setPrecision(p);
    g::attention_stats(dq_->p, qs, dk_->p, qs, dv_->p, qs, mp, ms, 0.25f, false, y->p, lse->p);
    g::attention_grad_stats(dq_->p, qs, dk_->p, qs, dv_->p, qs, mp, ms, 0.25f, false, y->p, lse->p,
                            dgy->p, gq->p, gk->p, gv->p);
    g::attention_stats_cudnn(dq_->p, nullptr, qs, dk_->p, nullptr, qs, dv_->p, nullptr, qs, mp, ms,
                             0.25f, false, yc->p, lsec->p);
    g::attention_grad_stats_cudnn(dq_->p, false, qs, dk_->p, false, qs, dv_->p, false, qs, mp, ms,
                                  0.25f, false, y->p, lse->p, dgy->p, cq->p, ck->p, cv->p);
    // bthd: carve's kernel into scratch, transposed into place.
    auto tq = poisoned<float>(n), tk = poisoned<float>(n), tv = poisoned<float>(n);
    g::attention_grad_stats_cudnn(dq_->p, false, qs, dk_->p, false, qs, dv_->p, false, qs, mp, ms,
                                  0.25f, false, y->p, lse->p, dgy->p, tq->p, tk->p, tv->p,
                                  /*bthd=*/true);
    // dy given as [b, t, h, d] too: transposed back for carve's kernel.
    auto dgyT = poisoned<float>(n);
    g::transpose<float>(dgy->p, qs, Dims{0, 2, 1, 3}, dgyT->p);
    auto sq = poisoned<float>(n), sk = poisoned<float>(n), sv = poisoned<float>(n);
    g::attention_grad_stats_cudnn(dq_->p, false, qs, dk_->p, false, qs, dv_->p, false, qs, mp, ms,
                                  0.25f, false, y->p, lse->p, dgyT->p, sq->p, sk->p, sv->p,
                                  /*bthd=*/true, /*dyBthd=*/true);
    auto wq = poisoned<float>(n), wk = poisoned<float>(n), wv = poisoned<float>(n);
    g::transpose<float>(gq->p, qs, Dims{0, 2, 1, 3}, wq->p);
    g::transpose<float>(gk->p, qs, Dims{0, 2, 1, 3}, wk->p);
    g::transpose<float>(gv->p, qs, Dims{0, 2, 1, 3}, wv->p);
    // Under bf16, the same from q, k, v given as bf16 tensors: widened for
    // carve's kernel, which rounds them to the same values on load.
    auto hq = poisoned<float>(n), hk = poisoned<float>(n), hv = poisoned<float>(n);
    if (masked) {
      auto q16 = poisoned<uint16_t>(n), k16 = poisoned<uint16_t>(n), v16 = poisoned<uint16_t>(n);
      g::toBf16(dq_->p, q16->p, n);
      g::toBf16(dk_->p, k16->p, n);
      g::toBf16(dv_->p, v16->p, n);
      g::attention_grad_stats_cudnn(q16->p, true, qs, k16->p, true, qs, v16->p, true, qs, mp, ms,
                                    0.25f, false, y->p, lse->p, dgy->p, hq->p, hk->p, hv->p);
      // q, k, v read in place as the columns of one [b, t, 3 h d] bf16
      // tensor: widened from there, the same values for carve's kernel.
      const int64_t B = qs.d[0], H = qs.d[1], T = qs.d[2], D = qs.d[3], HD = H * D;
      const std::vector<uint16_t> src[3] = {q16->download(), k16->download(), v16->download()};
      std::vector<uint16_t> packed(3 * n);
      for (int i = 0; i < 3; ++i)
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t t = 0; t < T; ++t)
              for (int64_t d = 0; d < D; ++d)
                packed[(b * T + t) * 3 * HD + i * HD + h * D + d] =
                    src[i][((b * H + h) * T + t) * D + d];
      auto qkv = up(packed);
      auto iq = poisoned<float>(n), ik = poisoned<float>(n), iv = poisoned<float>(n);
      g::attention_grad_stats_cudnn(qkv->p, true, qs, qkv->p + HD, true, qs, qkv->p + 2 * HD, true,
                                    qs, mp, ms, 0.25f, false, y->p, lse->p, dgy->p, iq->p, ik->p,
                                    iv->p, false, false, nullptr, nullptr, nullptr, 0, nullptr,
                                    nullptr, 3 * HD);
      auto yc16 = poisoned<float>(n), lc16 = poisoned<float>(ls.numel());
      auto yi = poisoned<float>(n), li = poisoned<float>(ls.numel());
      g::attention_stats_cudnn(nullptr, q16->p, qs, nullptr, k16->p, qs, nullptr, v16->p, qs, mp,
                               ms, 0.25f, false, yc16->p, lc16->p);
      g::attention_stats_cudnn(nullptr, qkv->p, qs, nullptr, qkv->p + HD, qs, nullptr,
                               qkv->p + 2 * HD, qs, mp, ms, 0.25f, false, yi->p, li->p, nullptr,
                               3 * HD);
      // And written in 16 bits into [b, t, 3 h d] rows: carve's kernel's
      // gradients transposed, rounded to nearest even into their columns.
      const int64_t hd = qs.d[1] * qs.d[3], bt = qs.d[0] * qs.d[2];
      auto a16 = poisoned<uint16_t>(3 * n);
      auto a32 = poisoned<float>(3 * n);
      g::attention_grad_stats_cudnn(dq_->p, false, qs, dk_->p, false, qs, dv_->p, false, qs, mp, ms,
                                    0.25f, false, y->p, lse->p, dgy->p, nullptr, nullptr, nullptr,
                                    /*bthd=*/true, /*dyBthd=*/false, a16->p, a16->p + hd,
                                    a16->p + 2 * hd, 3 * hd);
      g::fromBf16(a16->p, a32->p, 3 * n);
      // O written in bf16 as [b, t, h, d] (carve's y rounded, transposed),
      // and the gradient from o there: carve's kernel from o rounded.
      auto o16 = poisoned<uint16_t>(n);
      auto ot32 = poisoned<float>(n), yr = poisoned<float>(n);
      auto lseo = poisoned<float>(ls.numel());
      g::attention_stats_cudnn(dq_->p, nullptr, qs, dk_->p, nullptr, qs, dv_->p, nullptr, qs, mp,
                               ms, 0.25f, false, nullptr, lseo->p, o16->p);
      g::fromBf16(o16->p, ot32->p, n);
      auto y16 = poisoned<uint16_t>(n);
      g::toBf16(y->p, y16->p, n);
      g::fromBf16(y16->p, yr->p, n);
      auto rq = poisoned<float>(n), rk = poisoned<float>(n), rv = poisoned<float>(n);
      auto fq = poisoned<float>(n), fk = poisoned<float>(n), fv = poisoned<float>(n);
      g::attention_grad_stats(dq_->p, qs, dk_->p, qs, dv_->p, qs, mp, ms, 0.25f, false, yr->p,
                              lse->p, dgy->p, rq->p, rk->p, rv->p);
      g::attention_grad_stats_cudnn(dq_->p, false, qs, dk_->p, false, qs, dv_->p, false, qs, mp, ms,
                                    0.25f, false, nullptr, lse->p, dgy->p, fq->p, fk->p, fv->p,
                                    false, false, nullptr, nullptr, nullptr, 0, o16->p);
      auto yT = poisoned<float>(n);
      g::transpose<float>(yr->p, qs, Dims{0, 2, 1, 3}, yT->p);
      // dy given in bf16: carve's kernel from dy rounded.
      auto dy16 = poisoned<uint16_t>(n);
      auto dyr = poisoned<float>(n);
      g::toBf16(dgy->p, dy16->p, n);
      g::fromBf16(dy16->p, dyr->p, n);
      auto sq2 = poisoned<float>(n), sk2 = poisoned<float>(n), sv2 = poisoned<float>(n);
      auto wq2 = poisoned<float>(n), wk2 = poisoned<float>(n), wv2 = poisoned<float>(n);
      g::attention_grad_stats(dq_->p, qs, dk_->p, qs, dv_->p, qs, mp, ms, 0.25f, false, y->p,
                              lse->p, dyr->p, wq2->p, wk2->p, wv2->p);
      g::attention_grad_stats_cudnn(dq_->p, false, qs, dk_->p, false, qs, dv_->p, false, qs, mp, ms,
                                    0.25f, false, y->p, lse->p, nullptr, sq2->p, sk2->p, sv2->p,
                                    false, false, nullptr, nullptr, nullptr, 0, nullptr, dy16->p);
      if (!deviceOk(what))
        continue;
      expectEqual(what + " y in bf16 as [b, t, h, d]", ot32->download(), yT->download());
      expectEqual(what + " lse (y in bf16)", lseo->download(), lse->download());
      expectEqual(what + " dq from o in bf16", fq->download(), rq->download());
      expectEqual(what + " dk from o in bf16", fk->download(), rk->download());
      expectEqual(what + " dv from o in bf16", fv->download(), rv->download());
      expectEqual(what + " y from q, k, v in place", yi->download(), yc16->download());
      expectEqual(what + " lse from q, k, v in place", li->download(), lc16->download());
      expectEqual(what + " dq from q, k, v in place", iq->download(), hq->download());
      expectEqual(what + " dk from q, k, v in place", ik->download(), hk->download());
      expectEqual(what + " dv from q, k, v in place", iv->download(), hv->download());
      expectEqual(what + " dq from dy in bf16", sq2->download(), wq2->download());
      expectEqual(what + " dk from dy in bf16", sk2->download(), wk2->download());
      expectEqual(what + " dv from dy in bf16", sv2->download(), wv2->download());
      // dq, dk, dv written in bf16 shaped as q, k, v (no bthd), alone: carve's
      // kernel's gradients (gq, gk, gv above) rounded to nearest even.
      {
        auto p16 = poisoned<uint16_t>(3 * n);
        g::setPrecision(rt::Precision::BF16);
        g::attention_grad_stats_cudnn(dq_->p, false, qs, dk_->p, false, qs, dv_->p, false, qs, mp,
                                      ms, 0.25f, false, y->p, lse->p, dgy->p, nullptr, nullptr,
                                      nullptr, false, false, p16->p, p16->p + n, p16->p + 2 * n, 0);
        g::setPrecision(rt::Precision::F32);
        if (deviceOk(what)) {
          const std::vector<uint16_t> all = p16->download();
          const std::vector<float> want[3] = {gq->download(), gk->download(), gv->download()};
          const char *names[3] = {"dq", "dk", "dv"};
          for (int i = 0; i < 3; ++i) {
            std::vector<uint16_t> w16(n);
            for (int64_t e = 0; e < n; ++e) {
              const float r = static_cast<float>(rt::roundToBf16(want[i][e]));
              uint32_t bits;
              std::memcpy(&bits, &r, 4);
              w16[e] = static_cast<uint16_t>(bits >> 16);
            }
            expectEqual(what + " " + names[i] + " in bf16 as [b, h, t, d] (carve's kernel)",
                        std::vector<uint16_t>(all.begin() + i * n, all.begin() + (i + 1) * n), w16);
          }
        }
      }
      const std::vector<float> all = a32->download();
      const std::vector<float> want[3] = {wq->download(), wk->download(), wv->download()};
      const char *names[3] = {"dq", "dk", "dv"};
      for (int i = 0; i < 3; ++i) {
        std::vector<float> got(n), rounded(n);
        for (int64_t r = 0; r < bt; ++r)
          for (int64_t c = 0; c < hd; ++c) {
            got[r * hd + c] = all[r * 3 * hd + i * hd + c];
            rounded[r * hd + c] = static_cast<float>(rt::roundToBf16(want[i][r * hd + c]));
          }
        expectEqual(what + " " + names[i] + " in bf16 in [b, t, 3 h d]", got, rounded);
      }
    }
    g::setPrecision(rt::Precision::F32);
    if (!deviceOk(what))
      continue;
    g::cudnnAttentionCalls(f1, b1);
    ++checks();
    if (f1 != f0 || b1 != b0) {
      ++failures();
      std::printf("FAIL %s: cuDNN ran\n", what.c_str());
    } else {
      std::printf("ok   %s: carve's kernel ran\n", what.c_str());
    }
    expectEqual(what + " y", yc->download(), y->download());
    expectEqual(what + " lse", lsec->download(), lse->download());
    expectEqual(what + " dq", cq->download(), gq->download());
    expectEqual(what + " dk", ck->download(), gk->download());
    expectEqual(what + " dv", cv->download(), gv->download());
    expectEqual(what + " dq as [b, t, h, d]", tq->download(), wq->download());
    expectEqual(what + " dk as [b, t, h, d]", tk->download(), wk->download());
    expectEqual(what + " dv as [b, t, h, d]", tv->download(), wv->download());
    expectEqual(what + " dq from dy as [b, t, h, d]", sq->download(), wq->download());
    expectEqual(what + " dk from dy as [b, t, h, d]", sk->download(), wk->download());
    expectEqual(what + " dv from dy as [b, t, h, d]", sv->download(), wv->download());
    if (masked) {
      expectEqual(what + " dq (bf16 q, k, v)", hq->download(), gq->download());
      expectEqual(what + " dk (bf16 q, k, v)", hk->download(), gk->download());
      expectEqual(what + " dv (bf16 q, k, v)", hv->download(), gv->download());
    }
  }
}

//===--- Cross entropy ----------------------------------------------------===//

constexpr int64_t kIgnore = -100;

std::vector<int64_t> makeTargets(int64_t e, int64_t C, bool hasIgnore) {
  std::vector<int64_t> t = randint(e, 0, C);
  if (hasIgnore)
    for (int64_t i = 0; i < e; i += 3)
      t[i] = kIgnore;
  return t;
}

// Tolerances: a loss is -(x_t - max - log(sum of C exps)) with the sum in
// fp32 (C <= 50257: about 1e-5 relative in the sum, so 1e-5 absolute in the
// log), and mean/sum add E <= 4000 losses in double: 2e-5 relative, 2e-5
// absolute. dlogits are w * softmax - w at the target: 2e-5 relative of |w|
// scale plus 1e-7 absolute for the tiny probabilities.
void testCrossEntropy(Dims ls, bool hasIgnore) {
  const int64_t C = ls.d[1], n = ls.numel(), e = C ? n / C : 0;
  Dims ts;
  ts.d[ts.rank++] = ls.d[0];
  for (int i = 2; i < ls.rank; ++i)
    ts.d[ts.rank++] = ls.d[i];
  const std::vector<float> x = randn(n, 3.0f);
  const std::vector<int64_t> t = makeTargets(e, C, hasIgnore);
  auto dx = up(x);
  auto dt = up(t);
  const std::vector<double> xd = toD(x);
  for (int reduction : {0, 1, 2}) {
    const std::string what = "cross_entropy " + str(ls) + " reduction " +
                             std::to_string(reduction) + (hasIgnore ? " ignore" : "");
    const int64_t ny = reduction == 2 ? e : 1;
    auto y = poisoned<float>(ny);
    g::cross_entropy(dx->p, ls, dt->p, reduction, hasIgnore, kIgnore, y->p);
    std::vector<double> ref(ny);
    rt::cross_entropy<double>(xd.data(), ls, t.data(), reduction, hasIgnore, kIgnore, ref.data());
    if (deviceOk(what))
      expectCloseNan(what, y->download(), ref, 2e-5, 2e-5);

    const std::vector<float> gy = reduction == 2 ? randn(e) : std::vector<float>{0.7f};
    auto dgy = up(gy);
    auto dl = poisoned<float>(n);
    g::cross_entropy_grad(dx->p, ls, dt->p, reduction, hasIgnore, kIgnore, dgy->p, dl->p);
    std::vector<double> dref(n);
    rt::cross_entropy_grad<double>(xd.data(), ls, t.data(), reduction, hasIgnore, kIgnore,
                                   toD(gy).data(), dref.data());
    if (deviceOk(what + " grad"))
      expectClose(what + " grad", dl->download(), dref, 2e-5, reduction == 0 ? 1e-8 : 1e-7);
  }
}

/// A fused chain's kernel writing 16-bit copies of its outputs
/// (carve.copy_in_fused, gpu_fused.cuh): an output the chain rounds, copied
/// in the same pass, has the copy's bits toBf16 / toF16 would write; the f32
/// outputs are those of the call without copies; an output without a copy
/// (null) is left alone.
template <int F> struct RoundedSum {
  CARVE_HD void operator()(const float (&x)[2], float (&y)[2]) const {
    const float s = x[0] + x[1];
    y[0] = F == 1 ? carve::rt::ew::roundBf16(s) : carve::rt::ew::roundF16(s);
    y[1] = x[0] * x[1];
  }
};

template <int F> void testFusedCopies16() {
  const rt::Precision p = F == 1 ? rt::Precision::BF16 : rt::Precision::F16;
  const int64_t n = 100003;
  const Dims s{n};
  const std::vector<float> a = randn(n, 5.0f), b = randn(n);
  auto da = up(a), db = up(b);
  auto y0 = poisoned<float>(n), y1 = poisoned<float>(n), z0 = poisoned<float>(n),
       z1 = poisoned<float>(n);
  auto c0 = poisoned<uint16_t>(n), want = poisoned<uint16_t>(n);
  const float *in[2] = {da->p, db->p};
  const Dims shapes[2] = {s, s};
  g::setPrecision(p);
  float *plain[2] = {y0->p, y1->p};
  g::fused("RoundedSum", RoundedSum<F>{}, in, shapes, plain, s);
  float *out[2] = {z0->p, z1->p};
  uint16_t *out16[2] = {c0->p, nullptr};
  g::fused("RoundedSum with a copy", RoundedSum<F>{}, in, shapes, out, out16, s);
  (F == 1 ? g::toBf16 : g::toF16)(y0->p, want->p, n);
  g::setPrecision(rt::Precision::F32);
  const std::string w = std::string("fused 16-bit copies ") + (F == 1 ? "bf16" : "fp16");
  expectEqual(w + " output 0", z0->download(), y0->download());
  expectEqual(w + " output 1", z1->download(), y1->download());
  expectEqual(w + " copy of output 0", c0->download(), want->download());
  // Output 0 kept only as its copy (a null f32 pointer, neverStoredF32).
  auto c1 = poisoned<uint16_t>(n);
  auto z2 = poisoned<float>(n);
  float *only16[2] = {nullptr, z2->p};
  uint16_t *copy16[2] = {c1->p, nullptr};
  g::setPrecision(p);
  g::fused("RoundedSum, output 0 only in 16 bits", RoundedSum<F>{}, in, shapes, only16, copy16, s);
  g::setPrecision(rt::Precision::F32);
  expectEqual(w + " copy of an output not stored", c1->download(), want->download());
  expectEqual(w + " beside it, output 1", z2->download(), y1->download());
}

/// The norm gradients adding the residual's gradient (layer_norm_grad_add,
/// rms_norm_grad_add and their 16-bit forms; carve-select-kernels' rule
/// 4c): bit for bit the gradient followed by binary(Add) and, under bf16 and
/// fp16, that sum's 16-bit copy (toBf16 / toF16); the parameter gradients as
/// the gradient alone gives them; a null f32 sum writes the copy only; many
/// rows per block (the partials' path) and one.
void testNormGradAdd() {
  for (const Dims s : {Dims{6, 768}, Dims{2, 3, 40}, Dims{3000, 64}}) {
    const int64_t n = s.numel(), N = s.d[s.rank - 1];
    auto x = up(randn(n)), dy = up(randn(n)), res = up(randn(n));
    auto sc = up(uniform(N, 0.5f, 1.5f));
    const float eps = 1e-5f;
    auto wdx = poisoned<float>(n), wds = poisoned<float>(N), wdb = poisoned<float>(N);
    auto rwdx = poisoned<float>(n), rwds = poisoned<float>(N);
    auto sum = poisoned<float>(n), rsum = poisoned<float>(n);
    g::layer_norm_grad(x->p, s, -1, sc->p, eps, dy->p, wdx->p, wds->p, wdb->p);
    g::binary(rt::Binary::Add, res->p, s, wdx->p, s, sum->p, s);
    g::rms_norm_grad(x->p, s, -1, sc->p, eps, dy->p, rwdx->p, rwds->p);
    g::binary(rt::Binary::Add, rwdx->p, s, res->p, s, rsum->p, s);
    {
      auto dx = poisoned<float>(n), ds = poisoned<float>(N), db = poisoned<float>(N);
      auto rdx = poisoned<float>(n), rds = poisoned<float>(N);
      g::layer_norm_grad_add(x->p, s, -1, sc->p, eps, dy->p, res->p, dx->p, ds->p, db->p);
      g::rms_norm_grad_add(x->p, s, -1, sc->p, eps, dy->p, res->p, rdx->p, rds->p);
      const std::string w = str(s) + " f32";
      expectEqual("layer_norm_grad_add sum " + w, dx->download(), sum->download());
      expectEqual("layer_norm_grad_add dscale " + w, ds->download(), wds->download());
      expectEqual("layer_norm_grad_add dbias " + w, db->download(), wdb->download());
      expectEqual("rms_norm_grad_add sum " + w, rdx->download(), rsum->download());
      expectEqual("rms_norm_grad_add dscale " + w, rds->download(), rwds->download());
    }
    for (int f16 = 0; f16 < 2; ++f16) {
      const rt::Precision p = f16 ? rt::Precision::F16 : rt::Precision::BF16;
      auto sum16 = poisoned<uint16_t>(n), rsum16 = poisoned<uint16_t>(n);
      auto wds16 = poisoned<uint16_t>(N), wdb16 = poisoned<uint16_t>(N);
      auto rwds16 = poisoned<uint16_t>(N);
      g::setPrecision(p);
      (f16 ? g::toF16 : g::toBf16)(sum->p, sum16->p, n);
      (f16 ? g::toF16 : g::toBf16)(rsum->p, rsum16->p, n);
      (f16 ? g::toF16 : g::toBf16)(wds->p, wds16->p, N);
      (f16 ? g::toF16 : g::toBf16)(wdb->p, wdb16->p, N);
      (f16 ? g::toF16 : g::toBf16)(rwds->p, rwds16->p, N);
      g::setPrecision(rt::Precision::F32);
      for (bool keep32 : {true, false}) {
        auto dx = poisoned<float>(n), rdx = poisoned<float>(n);
        auto dx16 = poisoned<uint16_t>(n), rdx16 = poisoned<uint16_t>(n);
        auto ds16 = poisoned<uint16_t>(N), db16 = poisoned<uint16_t>(N),
             rds16 = poisoned<uint16_t>(N);
        g::setPrecision(p);
        g::layer_norm_grad_add16(x->p, false, s, -1, sc->p, false, eps, dy->p, res->p,
                                 keep32 ? dx->p : nullptr, dx16->p, nullptr, nullptr, ds16->p,
                                 db16->p);
        g::rms_norm_grad_add16(x->p, false, s, -1, sc->p, false, eps, dy->p, res->p,
                               keep32 ? rdx->p : nullptr, rdx16->p, nullptr, rds16->p);
        g::setPrecision(rt::Precision::F32);
        const std::string w =
            str(s) + (f16 ? " fp16" : " bf16") + (keep32 ? " with the f32 sum" : " copy only");
        if (keep32) {
          expectEqual("layer_norm_grad_add16 sum " + w, dx->download(), sum->download());
          expectEqual("rms_norm_grad_add16 sum " + w, rdx->download(), rsum->download());
        }
        expectEqual("layer_norm_grad_add16 copy " + w, dx16->download(), sum16->download());
        expectEqual("layer_norm_grad_add16 dscale16 " + w, ds16->download(), wds16->download());
        expectEqual("layer_norm_grad_add16 dbias16 " + w, db16->download(), wdb16->download());
        expectEqual("rms_norm_grad_add16 copy " + w, rdx16->download(), rsum16->download());
        expectEqual("rms_norm_grad_add16 dscale16 " + w, rds16->download(), rwds16->download());
      }
    }
  }
}

/// The norms and a fused chain reading operands as their 16-bit tensors
/// (layer_norm16, layer_norm_grad16, rms_norm16, rms_norm_grad16, fused with
/// in16; carve.read16, rule 3g) under bf16 and fp16: bit for bit what the
/// f32 entries give on the f32 views (fromBf16 / fromF16), with each
/// operand read so alone and all together (a saved input, a parameter's
/// scale and bias).
template <int F> struct AddMul {
  CARVE_HD void operator()(const float (&x)[3], float (&y)[1]) const {
    y[0] = (x[0] + x[1]) * x[2];
  }
};

void testRead16() {
  for (int f16 = 0; f16 < 2; ++f16) {
    const rt::Precision p = f16 ? rt::Precision::F16 : rt::Precision::BF16;
    const std::string fmt = f16 ? " fp16" : " bf16";
    auto store = [&](const std::vector<float> &x, std::unique_ptr<DevBuf<uint16_t>> &bits,
                     std::unique_ptr<DevBuf<float>> &view) {
      const int64_t n = static_cast<int64_t>(x.size());
      auto f = up(x);
      bits = poisoned<uint16_t>(n);
      view = poisoned<float>(n);
      (f16 ? g::toF16 : g::toBf16)(f->p, bits->p, n);
      (f16 ? g::fromF16 : g::fromBf16)(bits->p, view->p, n);
    };
    for (const Dims s : {Dims{6, 768}, Dims{2, 3, 40}}) {
      const int64_t n = s.numel(), N = s.d[s.rank - 1];
      std::unique_ptr<DevBuf<uint16_t>> x16, sc16, bi16;
      std::unique_ptr<DevBuf<float>> xv, scv, biv;
      store(randn(n), x16, xv);
      store(uniform(N, 0.5f, 1.5f), sc16, scv);
      store(randn(N), bi16, biv);
      auto dy = up(randn(n));
      const float eps = 1e-5f;
      auto want = poisoned<float>(n), wdx = poisoned<float>(n), wds = poisoned<float>(N),
           wdb = poisoned<float>(N);
      auto rwant = poisoned<float>(n), rwdx = poisoned<float>(n), rwds = poisoned<float>(N);
      g::layer_norm(xv->p, s, -1, scv->p, biv->p, eps, want->p);
      g::layer_norm_grad(xv->p, s, -1, scv->p, eps, dy->p, wdx->p, wds->p, wdb->p);
      g::rms_norm(xv->p, s, -1, scv->p, eps, rwant->p);
      g::rms_norm_grad(xv->p, s, -1, scv->p, eps, dy->p, rwdx->p, rwds->p);
      // The outputs' 16-bit copies written too (rule 3h), the f32 outputs
      // rounded as written (carve.round16) and not.
      {
        auto want16 = poisoned<uint16_t>(n), rwant16 = poisoned<uint16_t>(n);
        auto wantR = up(want->download()), rwantR = up(rwant->download());
        g::setPrecision(p);
        (f16 ? g::toF16 : g::toBf16)(want->p, want16->p, n);
        (f16 ? g::toF16 : g::toBf16)(rwant->p, rwant16->p, n);
        (f16 ? g::roundF16 : g::roundBf16)(wantR->p, n);
        (f16 ? g::roundF16 : g::roundBf16)(rwantR->p, n);
        g::setPrecision(rt::Precision::F32);
        for (bool round : {false, true}) {
          auto y = poisoned<float>(n), ry = poisoned<float>(n);
          auto y16 = poisoned<uint16_t>(n), ry16 = poisoned<uint16_t>(n);
          g::setPrecision(p);
          g::layer_norm16(xv->p, false, s, -1, sc16->p, true, bi16->p, true, eps, y->p, y16->p,
                          round);
          g::rms_norm16(xv->p, false, s, -1, sc16->p, true, eps, ry->p, ry16->p, round);
          g::setPrecision(rt::Precision::F32);
          const std::string w = str(s) + " writing its copy" + fmt + (round ? " rounded" : "");
          expectEqual("layer_norm16 " + w, y->download(), (round ? wantR : want)->download());
          expectEqual("layer_norm16 copy " + w, y16->download(), want16->download());
          expectEqual("rms_norm16 " + w, ry->download(), (round ? rwantR : rwant)->download());
          expectEqual("rms_norm16 copy " + w, ry16->download(), rwant16->download());
        }
        // The gradients' scale and bias gradients written in 16 bits (rule
        // 3h), with and without their f32 sums.
        auto wds16 = poisoned<uint16_t>(N), wdb16 = poisoned<uint16_t>(N),
             rwds16 = poisoned<uint16_t>(N);
        g::setPrecision(p);
        (f16 ? g::toF16 : g::toBf16)(wds->p, wds16->p, N);
        (f16 ? g::toF16 : g::toBf16)(wdb->p, wdb16->p, N);
        (f16 ? g::toF16 : g::toBf16)(rwds->p, rwds16->p, N);
        g::setPrecision(rt::Precision::F32);
        for (bool keep32 : {false, true}) {
          auto dx = poisoned<float>(n), ds = poisoned<float>(N), db = poisoned<float>(N),
               rdx = poisoned<float>(n), rds = poisoned<float>(N);
          auto ds16 = poisoned<uint16_t>(N), db16 = poisoned<uint16_t>(N),
               rds16 = poisoned<uint16_t>(N);
          g::setPrecision(p);
          // The input gradients' 16-bit copies too (rule 3h), with and
          // without their f32 values.
          auto dx16 = poisoned<uint16_t>(n), rdx16 = poisoned<uint16_t>(n);
          auto dxKeep = poisoned<float>(n), rdxKeep = poisoned<float>(n);
          g::layer_norm_grad16(xv->p, false, s, -1, scv->p, false, eps, dy->p, dx->p, nullptr,
                               keep32 ? ds->p : nullptr, keep32 ? db->p : nullptr, ds16->p,
                               db16->p);
          g::rms_norm_grad16(xv->p, false, s, -1, scv->p, false, eps, dy->p, rdx->p, nullptr,
                             keep32 ? rds->p : nullptr, rds16->p);
          g::layer_norm_grad16(xv->p, false, s, -1, scv->p, false, eps, dy->p,
                               keep32 ? dxKeep->p : nullptr, dx16->p, nullptr, nullptr, nullptr,
                               nullptr);
          g::rms_norm_grad16(xv->p, false, s, -1, scv->p, false, eps, dy->p,
                             keep32 ? rdxKeep->p : nullptr, rdx16->p, nullptr, nullptr);
          auto wdx16 = poisoned<uint16_t>(n), rwdx16 = poisoned<uint16_t>(n);
          (f16 ? g::toF16 : g::toBf16)(wdx->p, wdx16->p, n);
          (f16 ? g::toF16 : g::toBf16)(rwdx->p, rwdx16->p, n);
          g::setPrecision(rt::Precision::F32);
          const std::string w =
              str(s) + " parameter gradients in 16 bits" + fmt + (keep32 ? " and f32" : "");
          expectEqual("layer_norm_grad16 dx " + w, dx->download(), wdx->download());
          expectEqual("layer_norm_grad16 dscale16 " + w, ds16->download(), wds16->download());
          expectEqual("layer_norm_grad16 dbias16 " + w, db16->download(), wdb16->download());
          expectEqual("rms_norm_grad16 dscale16 " + w, rds16->download(), rwds16->download());
          expectEqual("layer_norm_grad16 dx16 " + w, dx16->download(), wdx16->download());
          expectEqual("rms_norm_grad16 dx16 " + w, rdx16->download(), rwdx16->download());
          if (keep32) {
            expectEqual("layer_norm_grad16 dx with dx16 " + w, dxKeep->download(), wdx->download());
            expectEqual("rms_norm_grad16 dx with dx16 " + w, rdxKeep->download(), rwdx->download());
            expectEqual("layer_norm_grad16 dscale " + w, ds->download(), wds->download());
            expectEqual("layer_norm_grad16 dbias " + w, db->download(), wdb->download());
            expectEqual("rms_norm_grad16 dscale " + w, rds->download(), rwds->download());
          }
        }
      }
      for (int flags : {1, 2, 4, 3, 7}) { // each alone, input and scale (all of RMS), all
        const bool a = flags & 1, b = flags & 2, c = flags & 4;
        const void *x = a ? (const void *)x16->p : xv->p;
        const void *sc = b ? (const void *)sc16->p : scv->p;
        const void *bi = c ? (const void *)bi16->p : biv->p;
        const std::string w =
            str(s) + (a ? " x16" : "") + (b ? " scale16" : "") + (c ? " bias16" : "") + fmt;
        auto y = poisoned<float>(n), dx = poisoned<float>(n), ds = poisoned<float>(N),
             db = poisoned<float>(N);
        g::setPrecision(p);
        g::layer_norm16(x, a, s, -1, sc, b, bi, c, eps, y->p, nullptr, false);
        g::layer_norm_grad16(x, a, s, -1, sc, b, eps, dy->p, dx->p, nullptr, ds->p, db->p, nullptr,
                             nullptr);
        g::setPrecision(rt::Precision::F32);
        expectEqual("layer_norm16 " + w, y->download(), want->download());
        expectEqual("layer_norm_grad16 dx " + w, dx->download(), wdx->download());
        expectEqual("layer_norm_grad16 dscale " + w, ds->download(), wds->download());
        expectEqual("layer_norm_grad16 dbias " + w, db->download(), wdb->download());
        if (c)
          continue; // RMS norm has no bias
        auto ry = poisoned<float>(n), rdx = poisoned<float>(n), rds = poisoned<float>(N);
        g::setPrecision(p);
        g::rms_norm16(x, a, s, -1, sc, b, eps, ry->p, nullptr, false);
        g::rms_norm_grad16(x, a, s, -1, sc, b, eps, dy->p, rdx->p, nullptr, rds->p, nullptr);
        g::setPrecision(rt::Precision::F32);
        expectEqual("rms_norm16 " + w, ry->download(), rwant->download());
        expectEqual("rms_norm_grad16 dx " + w, rdx->download(), rwdx->download());
        expectEqual("rms_norm_grad16 dscale " + w, rds->download(), rwds->download());
      }
    }
    // A fused chain (x0 + x1) * x2 with a broadcast bias x0 and x2 read as
    // stored, x1 as f32.
    const Dims s{2, 16, 768}, sb{768};
    const int64_t n = s.numel();
    std::unique_ptr<DevBuf<uint16_t>> b16, z16;
    std::unique_ptr<DevBuf<float>> bv, zv;
    store(randn(768), b16, bv);
    store(randn(n), z16, zv);
    auto m = up(randn(n));
    auto want = poisoned<float>(n), got = poisoned<float>(n);
    const Dims shapes[3] = {sb, s, s};
    const float *inF[3] = {bv->p, m->p, zv->p};
    float *outW[1] = {want->p};
    g::fused("AddMul", AddMul<0>{}, inF, shapes, outW, s);
    const void *in[3] = {b16->p, m->p, z16->p};
    const bool in16[3] = {true, false, true};
    float *out[1] = {got->p};
    uint16_t *none16[1] = {};
    g::setPrecision(p);
    g::fused("AddMul, inputs 0 and 2 in 16 bits", AddMul<0>{}, in, in16, shapes, out, none16, s);
    g::setPrecision(rt::Precision::F32);
    expectEqual("fused with 16-bit inputs" + fmt, got->download(), want->download());
  }
}

/// cross_entropy16, cross_entropy_grad16, cross_entropy_with_grad and
/// count_correct16 (carve.read16, carve.write16) under bf16 and fp16: logits
/// stored in 16 bits give bit for bit what the f32 entries give for their
/// f32 values, and a 16-bit gradient is the f32 gradient rounded to nearest
/// even (toBf16 / toF16).
void testCrossEntropy16(Dims ls, bool hasIgnore) {
  const int64_t C = ls.d[1], n = ls.numel(), e = C ? n / C : 0;
  const std::vector<int64_t> t = makeTargets(e, C, hasIgnore);
  auto dt = up(t);
  for (rt::Precision p : {rt::Precision::BF16, rt::Precision::F16}) {
    const bool bf = p == rt::Precision::BF16;
    std::vector<float> x = randn(n, 3.0f);
    for (float &v : x)
      v = bf ? rt::roundToBf16(v) : rt::roundToF16(v);
    auto dx = up(x);
    auto x16 = poisoned<uint16_t>(std::max<int64_t>(n, 1));
    (bf ? g::toBf16 : g::toF16)(dx->p, x16->p, n);
    g::setPrecision(p);
    for (int reduction : {0, 1, 2}) {
      const std::string what = std::string("cross_entropy16 ") + (bf ? "bf16 " : "fp16 ") +
                               str(ls) + " reduction " + std::to_string(reduction) +
                               (hasIgnore ? " ignore" : "");
      const int64_t ny = reduction == 2 ? e : 1;
      auto y = poisoned<float>(ny), y16 = poisoned<float>(ny);
      g::cross_entropy(dx->p, ls, dt->p, reduction, hasIgnore, kIgnore, y->p);
      g::cross_entropy16(x16->p, ls, dt->p, reduction, hasIgnore, kIgnore, y16->p);
      if (deviceOk(what))
        expectEqual(what, y16->download(), y->download());
      const std::vector<float> gy = reduction == 2 ? randn(e) : std::vector<float>{0.7f};
      auto dgy = up(gy);
      auto dl = poisoned<float>(std::max<int64_t>(n, 1));
      g::cross_entropy_grad(dx->p, ls, dt->p, reduction, hasIgnore, kIgnore, dgy->p, dl->p);
      auto want16 = poisoned<uint16_t>(std::max<int64_t>(n, 1));
      (bf ? g::toBf16 : g::toF16)(dl->p, want16->p, n);
      for (int mode = 1; mode <= 3; ++mode) {
        const bool l16 = mode & 1, d16 = mode & 2;
        auto got = poisoned<float>(std::max<int64_t>(n, 1));
        auto got16 = poisoned<uint16_t>(std::max<int64_t>(n, 1));
        g::cross_entropy_grad16(l16 ? static_cast<const void *>(x16->p) : dx->p, l16, ls, dt->p,
                                reduction, hasIgnore, kIgnore, dgy->p,
                                d16 ? static_cast<void *>(got16->p) : got->p, d16);
        const std::string w = what + " grad16" + (l16 ? " l16" : "") + (d16 ? " d16" : "");
        if (!deviceOk(w))
          continue;
        if (d16)
          expectEqual(w, got16->download(), want16->download());
        else
          expectEqual(w, got->download(), dl->download());
      }
      // cross_entropy_with_grad (rule 3j): the loss and the gradient of the
      // two calls, bit for bit, from one pass (the class-strided shape: the
      // two calls); mode 0 is fp32 in and out, and with 16-bit logits and
      // gradient the gradient also overwrites the logits in place.
      for (int mode = 0; mode <= 4; ++mode) {
        const bool inPlace = mode == 4, l16 = (mode & 1) || inPlace, d16 = (mode & 2) || inPlace;
        auto got = poisoned<float>(std::max<int64_t>(n, 1));
        auto got16 = poisoned<uint16_t>(std::max<int64_t>(n, 1));
        if (inPlace)
          GT_CUDA(cudaMemcpyAsync(got16->p, x16->p, sizeof(uint16_t) * n, cudaMemcpyDeviceToDevice,
                                  static_cast<cudaStream_t>(g::computeStream())));
        auto yw = poisoned<float>(ny);
        const void *logits = inPlace ? static_cast<const void *>(got16->p)
                             : l16   ? static_cast<const void *>(x16->p)
                                     : dx->p;
        g::cross_entropy_with_grad(logits, l16, ls, dt->p, reduction, hasIgnore, kIgnore, dgy->p,
                                   d16 ? static_cast<void *>(got16->p) : got->p, d16, yw->p);
        const std::string w = what + " with_grad" + (l16 ? " l16" : "") + (d16 ? " d16" : "") +
                              (inPlace ? " in place" : "");
        if (!deviceOk(w))
          continue;
        expectEqual(w + " (loss)", yw->download(), y->download());
        if (d16)
          expectEqual(w + " (gradient)", got16->download(), want16->download());
        else
          expectEqual(w + " (gradient)", got->download(), dl->download());
      }
    }
    // train --eval-data's accuracy from the 16-bit logits.
    double c32[2] = {0, 0}, c16[2] = {0, 0};
    g::count_correct(nullptr, dx->p, ls, 0, dt->p, hasIgnore, kIgnore, c32);
    g::count_correct16(nullptr, x16->p, ls, 0, dt->p, hasIgnore, kIgnore, c16);
    ++checks();
    if (c32[0] != c16[0] || c32[1] != c16[1]) {
      std::printf("FAIL count_correct16 %s: %g of %g, count_correct %g of %g\n", str(ls).c_str(),
                  c16[0], c16[1], c32[0], c32[1]);
      ++failures();
    }
    g::setPrecision(rt::Precision::F32);
  }
}

/// Every element ignored: the mean is 0/0 (NaN, as PyTorch and the CPU), the
/// sum 0, the gradient 0.
void testCrossEntropyAllIgnored() {
  const Dims ls{4, 6};
  const std::vector<float> x = randn(24);
  auto dx = up(x);
  auto dt = up(std::vector<int64_t>(4, kIgnore));
  auto y = poisoned<float>(1);
  // NaN poison would pass a NaN check: start from a number.
  GT_CUDA(cudaMemset(y->p, 0, sizeof(float)));
  sync();
  g::cross_entropy(dx->p, ls, dt->p, 0, true, kIgnore, y->p);
  if (deviceOk("cross_entropy all ignored")) {
    ++checks();
    const float v = y->download()[0];
    if (!std::isnan(v)) {
      ++failures();
      std::printf("FAIL cross_entropy all ignored, mean: %g, expected NaN\n", v);
    } else {
      std::printf("ok   cross_entropy all ignored, mean is NaN\n");
    }
  }
  auto dy = up(std::vector<float>{1.0f});
  auto dl = poisoned<float>(24);
  g::cross_entropy_grad(dx->p, ls, dt->p, 0, true, kIgnore, dy->p, dl->p);
  if (deviceOk("cross_entropy_grad all ignored"))
    expectClose("cross_entropy_grad all ignored", dl->download(), std::vector<double>(24, 0), 0, 0);
}

/// A target outside [0, C): synchronize fails naming it, then the record is
/// cleared (the next synchronize succeeds).
void testBadTarget(bool grad) {
  const std::string what = grad ? "cross_entropy_grad bad target" : "cross_entropy bad target";
  if (!deviceOk(what + " (before)"))
    return;
  const Dims ls{3, 5};
  auto dx = up(randn(15));
  auto dt = up(std::vector<int64_t>{1, grad ? -7 : 8, 2});
  auto dy = up(std::vector<float>{1.0f});
  auto out = poisoned<float>(15);
  if (grad)
    g::cross_entropy_grad(dx->p, ls, dt->p, 0, false, 0, dy->p, out->p);
  else
    g::cross_entropy(dx->p, ls, dt->p, 0, false, 0, out->p);
  std::string err;
  const bool ok = g::kCudaTarget.synchronize(err);
  const std::string want = std::string("target ") + (grad ? "-7" : "8");
  ++checks();
  if (ok || err.find(want) == std::string::npos || err.find("element 1") == std::string::npos) {
    ++failures();
    std::printf("FAIL %s: synchronize returned %s with \"%s\" (expected false naming \"%s\" at "
                "element 1)\n",
                what.c_str(), ok ? "true" : "false", err.c_str(), want.c_str());
  } else {
    std::printf("ok   %s: \"%s\"\n", what.c_str(), err.c_str());
  }
  std::string again;
  ++checks();
  if (!g::kCudaTarget.synchronize(again)) {
    ++failures();
    std::printf("FAIL %s: the record was not cleared: \"%s\"\n", what.c_str(), again.c_str());
  } else {
    std::printf("ok   %s: the next synchronize succeeds\n", what.c_str());
  }
}

//===--- Vocabulary-parallel cross entropy --------------------------------===//

/// On one rank the local classes are the vocabulary (offset 0): the result
/// must be cross_entropy's. Same tolerances as testCrossEntropy.
void testVocabParallel(rt::Communicator &c, Dims ls, bool hasIgnore) {
  const int64_t C = ls.d[1], n = ls.numel(), e = C ? n / C : 0;
  const std::vector<float> x = randn(n, 3.0f);
  const std::vector<int64_t> t = makeTargets(e, C, hasIgnore);
  auto dx = up(x);
  auto dt = up(t);
  const std::vector<double> xd = toD(x);
  for (int reduction : {0, 1, 2}) {
    const std::string what = "cross_entropy_vocab_parallel " + str(ls) + " reduction " +
                             std::to_string(reduction) + (hasIgnore ? " ignore" : "");
    const int64_t ny = reduction == 2 ? e : 1;
    auto y = poisoned<float>(ny);
    g::cross_entropy_vocab_parallel(c, dx->p, ls, 0, dt->p, reduction, hasIgnore, kIgnore, y->p);
    std::vector<double> ref(ny);
    rt::cross_entropy<double>(xd.data(), ls, t.data(), reduction, hasIgnore, kIgnore, ref.data());
    if (deviceOk(what))
      expectCloseNan(what, y->download(), ref, 2e-5, 2e-5);
    const std::vector<float> gy = reduction == 2 ? randn(e) : std::vector<float>{0.7f};
    auto dgy = up(gy);
    auto dl = poisoned<float>(n);
    g::cross_entropy_vocab_parallel_grad(c, dx->p, ls, 0, dt->p, reduction, hasIgnore, kIgnore,
                                         dgy->p, dl->p);
    std::vector<double> dref(n);
    rt::cross_entropy_grad<double>(xd.data(), ls, t.data(), reduction, hasIgnore, kIgnore,
                                   toD(gy).data(), dref.data());
    if (deviceOk(what + " grad"))
      expectClose(what + " grad", dl->download(), dref, 2e-5, reduction == 0 ? 1e-8 : 1e-7);
  }
}

/// A target past the vocabulary fails at synchronize, as cross_entropy's.
void testVocabParallelBadTarget(rt::Communicator &c) {
  const std::string what = "cross_entropy_vocab_parallel bad target";
  if (!deviceOk(what + " (before)"))
    return;
  const Dims ls{2, 4};
  auto dx = up(randn(8));
  auto dt = up(std::vector<int64_t>{9, 0});
  auto y = poisoned<float>(1);
  g::cross_entropy_vocab_parallel(c, dx->p, ls, 0, dt->p, 1, false, 0, y->p);
  std::string err;
  const bool ok = g::kCudaTarget.synchronize(err);
  ++checks();
  if (ok || err.find("target 9") == std::string::npos) {
    ++failures();
    std::printf("FAIL %s: synchronize returned %s with \"%s\"\n", what.c_str(),
                ok ? "true" : "false", err.c_str());
  } else {
    std::printf("ok   %s: \"%s\"\n", what.c_str(), err.c_str());
  }
}

void testVocabParallelAll() {
  std::string err;
  std::unique_ptr<rt::Communicator> self = rt::makeSelfCommunicator();
  std::unique_ptr<rt::Communicator> c =
      g::kCudaTarget.makeComm ? g::kCudaTarget.makeComm(*self, err) : nullptr;
  if (!c) {
    ++checks();
    ++failures();
    std::printf("FAIL cross_entropy_vocab_parallel: NOT RUN: no one-rank NCCL communicator (%s)\n",
                g::kCudaTarget.makeComm ? err.c_str() : "kCudaTarget.makeComm is not set");
    return;
  }
  testVocabParallel(*c, Dims{37, 101}, false);
  testVocabParallel(*c, Dims{37, 101}, true);
  testVocabParallel(*c, Dims{4, 3000}, true);
  testVocabParallel(*c, Dims{3, 11, 2, 5}, true);
  testVocabParallelBadTarget(*c);
}

} // namespace

int main() {
  requireDevice(kBinary);
  std::string err;
  if (!g::kCudaTarget.open(0, 0, 1, int64_t(1) << 20, err)) {
    std::printf("FAIL kCudaTarget.open: %s\n", err.c_str());
    return 1;
  }

  // Softmax: warp rows (A <= 1024), block rows, inner axes, axis 0.
  testSoftmax(Dims{7, 37}, -1);
  testSoftmax(Dims{3, 3000}, 1);
  testSoftmax(Dims{5, 9, 6}, 1);
  testSoftmax(Dims{11, 4, 3}, 0);
  testSoftmax(Dims{2, 1, 1}, 2);
  testSoftmaxHuge();

  // Norms: GPT-2 width, odd widths, normalized trailing dims, many rows
  // (several per block of the parameter-gradient partials), large means.
  testLayerNorm(Dims{6, 768}, 1, true, true, 0);
  testLayerNorm(Dims{2, 3, 40}, 1, false, false, 0);
  testLayerNorm(Dims{2, 3, 40}, -1, true, false, 0);
  testLayerNorm(Dims{3000, 64}, 1, false, true, 0);
  testLayerNorm(Dims{5, 4096}, 1, true, true, 0);
  testLayerNorm(Dims{9, 1000}, 1, true, true, 1000.0f);
  testRotary(Dims{2, 3, 17, 64}, Dims{17, 64});
  testRotary(Dims{4, 2, 9, 8}, Dims{1, 2, 1, 8});
  testRotary(Dims{5, 128}, Dims{128});
  testRmsNorm(Dims{6, 768}, 1, true);
  testRmsNorm(Dims{2, 3, 40}, 1, false);
  testRmsNorm(Dims{2500, 33}, -1, true);
  testNormNoRows();
  testRead16();
  testNormGradAdd();

  // Attention.
  const std::vector<AttnCase> cases = {
      {{2, 3}, 50, 50, 64, 64, false, Mask::None},
      {{2, 3}, 50, 50, 64, 64, true, Mask::None},
      {{2, 2}, 37, 70, 40, 40, true, Mask::None},
      {{2, 2}, 70, 37, 40, 40, true, Mask::None},
      {{2, 2}, 37, 70, 40, 24, false, Mask::Full},
      {{3, 2}, 33, 65, 64, 64, true, Mask::KeyPadding},
      {{2}, 40, 40, 40, 72, true, Mask::PerRow},
      {{}, 31, 17, 16, 8, false, Mask::Scalar},
      {{2, 1}, 20, 33, 128, 256, true, Mask::None},
      {{1, 2}, 19, 21, 300, 260, false, Mask::Full},
      {{1, 2, 2}, 64, 64, 1, 3, true, Mask::None},
      {{2, 2}, 0, 9, 8, 8, false, Mask::None}, // no query: dk, dv zero
      {{2, 2}, 9, 0, 8, 8, false, Mask::None}, // no key: y, dq zero
      {{0, 2}, 9, 9, 8, 8, true, Mask::None},  // no item
      {{2}, 5, 7, 8, 0, false, Mask::None},    // Dv 0
  };
  for (const AttnCase &c : cases)
    testAttention(c);
  testAttentionPrecision(rt::Precision::BF16, "bf16", false);
  testAttentionPrecision(rt::Precision::BF16, "bf16", true);
  testAttentionPrecision(rt::Precision::F16, "fp16", true);
  // cuDNN's fused flash attention: GPT-2's head dimension, causal and not,
  // Tq = Tk not a multiple of the engines' tiles, one batch dimension, d 128.
  testAttentionCudnn(rt::Precision::BF16, "bf16", {2, 3}, 45, 64, true);
  testAttentionCudnn(rt::Precision::BF16, "bf16", {2, 3}, 45, 64, false);
  testAttentionCudnn(rt::Precision::F16, "fp16", {2, 3}, 45, 64, true);
  testAttentionCudnn(rt::Precision::BF16, "bf16", {3}, 20, 128, true);
  testAttentionCudnnMask(rt::Precision::BF16, "bf16", "padding", false);
  testAttentionCudnnMask(rt::Precision::F16, "fp16", "additive", true);
  testAttentionCudnnMask(rt::Precision::BF16, "bf16", "full", false);
  testAttentionCudnnFallback();

  // Cross entropy: contiguous classes on warps (C <= 1024) and blocks,
  // strided classes.
  testCrossEntropy(Dims{64, 10}, false);
  testCrossEntropy(Dims{64, 10}, true);
  testCrossEntropy(Dims{8, 50257}, true);
  testCrossEntropy(Dims{4, 7, 3, 5}, true);
  testCrossEntropy(Dims{2, 1500, 9}, false);
  testCrossEntropy(Dims{0, 5}, false);
  testFusedCopies16<1>();
  testFusedCopies16<2>();
  testCrossEntropy16(Dims{64, 10}, true);
  testCrossEntropy16(Dims{8, 50257}, true);
  testCrossEntropy16(Dims{4, 7, 3, 5}, true);
  testCrossEntropyAllIgnored();
  testBadTarget(false);
  testBadTarget(true);

  testVocabParallelAll();

  if (!g::kCudaTarget.synchronize(err)) {
    std::printf("FAIL final synchronize: %s\n", err.c_str());
    ++failures();
  }
  g::kCudaTarget.close();
  return finish(kBinary);
}
