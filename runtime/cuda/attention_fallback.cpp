//===- attention_fallback.cpp - the cuDNN attention entries as carve's kernel ===//
//
// attention_stats_cudnn and attention_grad_stats_cudnn where cuDNN cannot
// take the call (attention_cudnn.cpp says why, once per shape): the 16-bit
// operands widened into scratch, carve's own attention kernels
// (kernels_attention.cu), and the results written where the cuDNN graph
// would have written them; and the entries' argument checks, which both
// paths share.
//
//===----------------------------------------------------------------------===//

#include "attention_fallback.h"
#include "internal.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>

namespace carve::gpu {

namespace {

/// carve's kernel takes f32: the operands given as 16-bit tensors (the
/// precision's format) widened into the attention scratch slot.
/// `extra`: bytes more of the slot after them, returned (256-byte aligned;
/// null when none). `rowStride` > 0: the 16-bit ones are [b, t, h, d] rows
/// that far apart, read as their `shapes` [b, h, t, d].
char *widenOperands(std::initializer_list<const void *> ps, std::initializer_list<bool> is16,
                    std::initializer_list<int64_t> ns, const float *out[3], size_t extra = 0,
                    const Dims *shapes = nullptr, int64_t rowStride = 0) {
  const void *p[3];
  bool f[3];
  int64_t n[3];
  std::copy(ps.begin(), ps.end(), p);
  std::copy(is16.begin(), is16.end(), f);
  std::copy(ns.begin(), ns.end(), n);
  size_t total = 0;
  for (int i = 0; i < 3; ++i)
    if (f[i])
      total += (static_cast<size_t>(n[i]) * sizeof(float) + 255) / 256 * 256;
  char *w = total + extra ? static_cast<char *>(workspace(total + extra, kWsAttn)) : nullptr;
  for (int i = 0; i < 3; ++i) {
    if (!f[i]) {
      out[i] = static_cast<const float *>(p[i]);
      continue;
    }
    auto *dst = reinterpret_cast<float *>(w);
    const auto *src = static_cast<const uint16_t *>(p[i]);
    if (rowStride > 0) {
      const Dims &s = shapes[i];
      load16Bthd(src, s.d[0], s.d[2], s.d[1], s.d[3], rowStride, dst);
    } else {
      precision() == Precision::F16 ? fromF16(src, dst, n[i]) : fromBf16(src, dst, n[i]);
    }
    out[i] = dst;
    w += (static_cast<size_t>(n[i]) * sizeof(float) + 255) / 256 * 256;
  }
  return extra ? w : nullptr;
}

} // namespace

/// attention_grad_stats_cudnn as carve's kernel: q, k, v widened where they
/// are 16-bit; with `bthd`, dq, dk and dv computed in [b, h, t, d] scratch
/// and transposed into their [b, t, h, d] places, or with `g16` rounded
/// into those of the 16-bit tensors g16[0..2] (rows of rowStride16); without
/// `bthd`, g16 holds them as q, k and v are shaped ([b, h, t, d]).
void gradByCarve(const void *q, bool q16, Dims qs, const void *k, bool k16, Dims ks, const void *v,
                 bool v16, Dims vs, const float *mask, Dims ms, float scale, bool causal,
                 const float *o, const float *lse, const float *dy, float *dq, float *dk, float *dv,
                 bool bthd, bool dyBthd, uint16_t *const g16[3], int64_t rowStride16,
                 const uint16_t *o16, const uint16_t *dy16, int64_t inRowStride16) {
  const float *w[3];
  const int64_t n[3] = {qs.numel(), ks.numel(), vs.numel()};
  const Dims perm{0, 2, 1, 3};
  auto bytes = [](int64_t x) { return (static_cast<size_t>(x) * sizeof(float) + 255) / 256 * 256; };
  size_t gradBytes = 0;
  if (bthd)
    for (int64_t x : n)
      gradBytes += (g16 ? 2 : 1) * bytes(x); // (16-bit: [b, t, h, d] f32 in scratch too)
  // 16-bit [b, h, t, d] gradients: f32 scratch for those the step keeps only in 16 bits.
  size_t plain16Bytes = 0;
  if (!bthd && g16) {
    const float *f32[3] = {dq, dk, dv};
    for (int i = 0; i < 3; ++i)
      plain16Bytes += f32[i] ? 0 : bytes(n[i]);
  }
  // dy and o: [b, h, tq, dv]; dy given as [b, tq, h, dv] where dyBthd, o as
  // its 16-bit [b, tq, h, dv] tensor where o16.
  Dims ys = qs;
  if (ys.rank)
    ys.d[ys.rank - 1] = vs.rank ? vs.d[vs.rank - 1] : 0;
  Dims ts = ys; // [b, tq, h, dv]
  if (ts.rank == 4)
    std::swap(ts.d[1], ts.d[2]);
  const size_t dyBytes = dyBthd ? bytes(ys.numel()) : 0;
  const size_t oBytes = o16 ? 2 * bytes(ys.numel()) : 0;
  const size_t dy16Bytes = dy16 ? bytes(ys.numel()) : 0;
  const Dims in[3] = {qs, ks, vs};
  char *t =
      widenOperands({q, k, v}, {q16, k16, v16}, {n[0], n[1], n[2]}, w,
                    gradBytes + dyBytes + oBytes + dy16Bytes + plain16Bytes, in, inRowStride16);
  if (dy16) { // dy widened, after o's scratch
    auto *wide = reinterpret_cast<float *>(t + gradBytes + dyBytes + oBytes);
    precision() == Precision::F16 ? fromF16(dy16, wide, ys.numel())
                                  : fromBf16(dy16, wide, ys.numel());
    dy = wide;
  }
  if (dyBthd) { // dy transposed to [b, h, tq, dv] after the gradients' scratch
    auto *dyt = reinterpret_cast<float *>(t + gradBytes);
    carve::gpu::transpose<float>(dy, ts, perm, dyt);
    dy = dyt;
  }
  if (o16) { // o widened and transposed to [b, h, tq, dv] after dy's
    auto *wide = reinterpret_cast<float *>(t + gradBytes + dyBytes);
    auto *ot = reinterpret_cast<float *>(t + gradBytes + dyBytes + bytes(ys.numel()));
    precision() == Precision::F16 ? fromF16(o16, wide, ys.numel())
                                  : fromBf16(o16, wide, ys.numel());
    carve::gpu::transpose<float>(wide, ts, perm, ot);
    o = ot;
  }
  if (!bthd && g16) {
    // In f32 (where the step keeps them, else in scratch after the rest),
    // then rounded to nearest even into the 16-bit tensors, row-major.
    char *after = t + gradBytes + dyBytes + oBytes + dy16Bytes;
    float *out[3] = {dq, dk, dv};
    for (int i = 0; i < 3; ++i)
      if (!out[i]) {
        out[i] = reinterpret_cast<float *>(after);
        after += bytes(n[i]);
      }
    attention_grad_stats(w[0], qs, w[1], ks, w[2], vs, mask, ms, scale, causal, o, lse, dy, out[0],
                         out[1], out[2]);
    for (int i = 0; i < 3; ++i)
      precision() == Precision::F16 ? toF16(out[i], g16[i], n[i]) : toBf16(out[i], g16[i], n[i]);
    return;
  }
  if (!bthd)
    return attention_grad_stats(w[0], qs, w[1], ks, w[2], vs, mask, ms, scale, causal, o, lse, dy,
                                dq, dk, dv);
  float *g[3];
  for (int i = 0; i < 3; ++i) {
    g[i] = reinterpret_cast<float *>(t);
    t += (static_cast<size_t>(n[i]) * sizeof(float) + 255) / 256 * 256;
  }
  attention_grad_stats(w[0], qs, w[1], ks, w[2], vs, mask, ms, scale, causal, o, lse, dy, g[0],
                       g[1], g[2]);
  float *dst[3] = {dq, dk, dv};
  const Dims shapes[3] = {qs, ks, vs};
  for (int i = 0; i < 3; ++i) {
    if (!g16) {
      carve::gpu::transpose<float>(g[i], shapes[i], perm, dst[i]);
      continue;
    }
    // [b, t, h, d] in f32 scratch after the gradients' (where dy's and o's
    // were, read by now), then its rows of h * d into the 16-bit tensor's
    // rows of rowStride16 elements.
    auto *t32 = reinterpret_cast<float *>(t);
    carve::gpu::transpose<float>(g[i], shapes[i], perm, t32);
    const Dims &sh = shapes[i];
    store16Rows(t32, sh.d[0] * sh.d[2], sh.d[1] * sh.d[3], g16[i], rowStride16);
    t += bytes(n[i]);
  }
}

/// attention_stats_cudnn as carve's kernel: q, k, v given only as their
/// 16-bit copies (a null f32 pointer: the program keeps only the copy)
/// widened.
void statsByCarve(const float *q, const void *q16, Dims qs, const float *k, const void *k16,
                  Dims ks, const float *v, const void *v16, Dims vs, const float *mask, Dims ms,
                  float scale, bool causal, float *y, float *lse, uint16_t *y16,
                  int64_t inRowStride16) {
  const float *in[3] = {q, k, v};
  const void *c16[3] = {q16, k16, v16};
  for (int i = 0; i < 3; ++i)
    if (!in[i] && !c16[i])
      fatal("attention_stats_cudnn: operand %d given neither as f32 nor as its 16-bit copy", i);
  const float *w[3];
  const Dims shapes[3] = {qs, ks, vs};
  Dims ys = qs; // [b, h, tq, dv]
  if (ys.rank)
    ys.d[ys.rank - 1] = vs.rank ? vs.d[vs.rank - 1] : 0;
  auto bytes = [](int64_t x) { return (static_cast<size_t>(x) * sizeof(float) + 255) / 256 * 256; };
  char *t = widenOperands({in[0] ? static_cast<const void *>(in[0]) : c16[0],
                           in[1] ? static_cast<const void *>(in[1]) : c16[1],
                           in[2] ? static_cast<const void *>(in[2]) : c16[2]},
                          {!in[0], !in[1], !in[2]}, {qs.numel(), ks.numel(), vs.numel()}, w,
                          y16 ? 2 * bytes(ys.numel()) : 0, shapes, inRowStride16);
  if (!y16)
    return attention_stats(w[0], qs, w[1], ks, w[2], vs, mask, ms, scale, causal, y, lse);
  // O in f32 scratch, transposed to [b, tq, h, dv], rounded into y16.
  auto *y32 = reinterpret_cast<float *>(t), *yt = reinterpret_cast<float *>(t + bytes(ys.numel()));
  attention_stats(w[0], qs, w[1], ks, w[2], vs, mask, ms, scale, causal, y32, lse);
  carve::gpu::transpose<float>(y32, ys, Dims{0, 2, 1, 3}, yt);
  precision() == Precision::F16 ? toF16(yt, y16, ys.numel()) : toBf16(yt, y16, ys.numel());
}

/// bthd's and dyBthd's precondition: rank-4 [b, h, t, d] operands.
void checkBthd(bool bthd, const Dims &qs, const Dims &ks, const Dims &vs, const char *op) {
  if (bthd && (qs.rank != 4 || ks.rank != 4 || vs.rank != 4))
    fatal("%s: gradients written as [b, t, h, d] need rank-4 q, k and v (ranks %d, %d, %d)", op,
          qs.rank, ks.rank, vs.rank);
}

/// attention_grad_stats_cudnn's outputs checked: whether the gradients go to
/// the 16-bit tensors g16 (all three given, [b, t, h, d] rows of rowStride16
/// elements) rather than to dq, dk, dv.
bool checkOutputs(bool bthd, bool dyBthd, const Dims &qs, const Dims &ks, const Dims &vs,
                  uint16_t *const g16[3], int64_t rowStride16) {
  const char *op = "attention_grad_stats_cudnn";
  checkBthd(bthd || dyBthd, qs, ks, vs, op);
  const int given = (g16[0] != nullptr) + (g16[1] != nullptr) + (g16[2] != nullptr);
  if (given == 0)
    return false;
  if (given != 3)
    fatal("%s: 16-bit gradients need all three of dq16, dk16, dv16", op);
  if (!bthd) {
    // [b, h, t, d] as q, k, v are shaped, row-major.
    if (rowStride16 != 0)
      fatal("%s: a 16-bit row stride (%lld) without bthd", op, (long long)rowStride16);
    return true;
  }
  const Dims *sh[3] = {&qs, &ks, &vs};
  for (const Dims *d : sh)
    if (rowStride16 < d->d[1] * d->d[3])
      fatal("%s: a 16-bit row stride of %lld for rows of %lld heads x %lld", op,
            (long long)rowStride16, (long long)d->d[1], (long long)d->d[3]);
  return true;
}

/// inRowStride16's precondition: rank-4 operands, all three given in 16
/// bits (`given`), rows of at least h * d.
void checkInStrided(int64_t inRowStride16, const bool given[3], const Dims &qs, const Dims &ks,
                    const Dims &vs, const char *op) {
  if (inRowStride16 == 0)
    return;
  if (inRowStride16 < 0 || !given[0] || !given[1] || !given[2])
    fatal("%s: q, k and v read in place (a row stride of %lld) need all three in 16 bits", op,
          (long long)inRowStride16);
  checkBthd(true, qs, ks, vs, op);
  for (const Dims *d : {&qs, &ks, &vs})
    if (inRowStride16 < d->d[1] * d->d[3])
      fatal("%s: an input row stride of %lld for rows of %lld heads x %lld", op,
            (long long)inRowStride16, (long long)d->d[1], (long long)d->d[3]);
}

} // namespace carve::gpu
