//===- optim.h - optimizer updates, clipping and learning-rate schedule ---===//
//
// PyTorch's formulas (torch.optim.SGD / AdamW, single-tensor path;
// torch.nn.utils.clip_grad_norm_), element for element, in float with the
// scalar coefficients computed in double as Python does.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_OPTIM_H
#define CARVE_RT_OPTIM_H

#include <cstdint>

namespace carve::rt {

/// torch.optim.SGD for one tensor. `buf` is the momentum buffer (may be null
/// when momentum == 0). `firstStep`: the buffer is initialized to the
/// (weight-decayed) gradient, as PyTorch does when it has no buffer yet.
void sgdUpdate(float *p, const float *g, float *buf, int64_t n, double lr, double momentum,
               double dampening, double weightDecay, bool nesterov, bool firstStep);

/// AdamW's per-step scalars in float, computed in double as PyTorch does: the
/// CPU loop and the CUDA kernel both take them from here, so the two targets
/// update with the same numbers.
struct AdamwCoefficients {
  float decay;   // 1 - lr * weight_decay
  float b1, b2;  // beta1, beta2
  float c1, c2;  // 1 - beta1, 1 - beta2
  float bc2Sqrt; // sqrt(1 - beta2^step)
  float eps;
  float negStep; // -lr / (1 - beta1^step)
};
AdamwCoefficients adamwCoefficients(double lr, double beta1, double beta2, double eps,
                                    double weightDecay, int64_t step);

/// torch.optim.AdamW for one tensor; `step` is the 1-based step count after
/// increment (PyTorch's state['step']).
void adamwUpdate(float *p, const float *g, float *m, float *v, int64_t n, double lr, double beta1,
                 double beta2, double eps, double weightDecay, int64_t step);

/// Sum of squares of g (accumulated in double).
double sumSquares(const float *g, int64_t n);
/// dst[i] += src[i] (gradient accumulation over micro-batches).
void addInPlace(float *dst, const float *src, int64_t n);
/// g *= s.
void scaleInPlace(float *g, int64_t n, float s);
/// clip_grad_norm_'s coefficient: min(1, maxNorm / (totalNorm + 1e-6)).
float clipCoefficient(double totalNorm, double maxNorm);

/// Learning rate for 0-based step t: linear warm-up over `warmup` steps
/// (lr * (t + 1) / warmup), then cosine decay over `decaySteps` steps (counted
/// after warm-up) from lr to lr * minRatio, then lr * minRatio. decaySteps == 0:
/// constant after warm-up. Equals torch.optim.lr_scheduler.LambdaLR with the same
/// function of t.
double scheduledLr(int64_t t, double lr, int64_t warmup, int64_t decaySteps, double minRatio);

} // namespace carve::rt

#endif // CARVE_RT_OPTIM_H
