//===- attention_fallback.h - carve's kernel behind the cuDNN entries -----===//
//
// attention_fallback.cpp, for attention_cudnn.cpp: the calls carve's own
// kernels run where cuDNN cannot, and the argument checks both share.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RUNTIME_CUDA_ATTENTION_FALLBACK_H
#define CARVE_RUNTIME_CUDA_ATTENTION_FALLBACK_H

#include "carve/rt/gpu.h"

#include <cstdint>

namespace carve::gpu {

/// attention_grad_stats_cudnn as carve's kernel: q, k, v widened where they
/// are 16-bit; with `bthd`, dq, dk and dv computed in [b, h, t, d] scratch
/// and transposed into their [b, t, h, d] places, or with `g16` rounded
/// into those of the 16-bit tensors g16[0..2] (rows of rowStride16).
void gradByCarve(const void *q, bool q16, Dims qs, const void *k, bool k16, Dims ks, const void *v,
                 bool v16, Dims vs, const float *mask, Dims ms, float scale, bool causal,
                 const float *o, const float *lse, const float *dy, float *dq, float *dk, float *dv,
                 bool bthd, bool dyBthd, uint16_t *const g16[3], int64_t rowStride16,
                 const uint16_t *o16, const uint16_t *dy16, int64_t inRowStride16);

/// attention_stats_cudnn as carve's kernel: q, k, v given only as their
/// 16-bit copies (a null f32 pointer: the program keeps only the copy)
/// widened.
void statsByCarve(const float *q, const void *q16, Dims qs, const float *k, const void *k16,
                  Dims ks, const float *v, const void *v16, Dims vs, const float *mask, Dims ms,
                  float scale, bool causal, float *y, float *lse, uint16_t *y16,
                  int64_t inRowStride16);

/// bthd's and dyBthd's precondition: rank-4 [b, h, t, d] operands.
void checkBthd(bool bthd, const Dims &qs, const Dims &ks, const Dims &vs, const char *op);

/// attention_grad_stats_cudnn's outputs checked: whether the gradients go to
/// the 16-bit tensors g16 (all three given: with bthd, [b, t, h, d] rows of
/// rowStride16 elements; without, shaped as q, k, v, rowStride16 0) rather
/// than to dq, dk, dv.
bool checkOutputs(bool bthd, bool dyBthd, const Dims &qs, const Dims &ks, const Dims &vs,
                  uint16_t *const g16[3], int64_t rowStride16);

/// inRowStride16's precondition: rank-4 operands, all three given in 16
/// bits (`given`), rows of at least h * d.
void checkInStrided(int64_t inRowStride16, const bool given[3], const Dims &qs, const Dims &ks,
                    const Dims &vs, const char *op);

/// The additive mask of an attention call (broadcastable to its scores
/// [..., tq, tk], as attention_stats takes it) as cuDNN's bias: out is
/// [bb, hh, tq, tk] in the plan's 16-bit format, bb 1 or the batch items
/// before the heads, hh 1 or the heads (1 only where the mask broadcasts
/// there), rounded to nearest even, a finite value clamped to the format's
/// finite range first (a -FLT_MAX mask, as Hugging Face's, stays finite:
/// a row whose every key it masks weighs them alike, as carve's kernel does;
/// -inf stays -inf, and such a row is NaN, where carve's kernel writes 0).
void attentionMaskBias16(const Dims &qs, const Dims &ks, const Dims &vs, const float *mask,
                         const Dims &ms, int64_t bb, int64_t hh, uint16_t *out);

} // namespace carve::gpu

#endif // CARVE_RUNTIME_CUDA_ATTENTION_FALLBACK_H
