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

/// A gradient stored in 16 bits (docs/training.md#16-bit-gradients): bf16,
/// or IEEE half when `f16`. The generated tail passes one where an fp32
/// gradient passes a float pointer; `g + k` is its element k on, as for a
/// pointer. Every function below reads each element as the float it
/// represents (exact) and computes as for an fp32 gradient; those that write
/// one round to nearest even.
struct Grad16 {
  uint16_t *p = nullptr;
  bool f16 = false;
  Grad16 operator+(int64_t k) const { return {p + k, f16}; }
};

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

// The same on 16-bit gradients (Grad16): read exactly, computed in float,
// written rounded to the gradient's format.
void sgdUpdate(float *p, Grad16 g, float *buf, int64_t n, double lr, double momentum,
               double dampening, double weightDecay, bool nesterov, bool firstStep);
void adamwUpdate(float *p, Grad16 g, float *m, float *v, int64_t n, double lr, double beta1,
                 double beta2, double eps, double weightDecay, int64_t step);
double sumSquares(Grad16 g, int64_t n);
/// g = round(g * s).
void scaleInPlace(Grad16 g, int64_t n, float s);
/// dst = round(dst + src): 16-bit accumulation over micro-batches (plan
/// field grad_accumulation = "16bit").
void addInPlace(Grad16 dst, Grad16 src, int64_t n);
/// dst += src: a 16-bit gradient into an fp32 accumulator.
void addInPlace(float *dst, Grad16 src, int64_t n);
/// dst = src, 16 bits into n floats (exact): an fp32 accumulator's first
/// micro-batch.
void widen(Grad16 src, float *dst, int64_t n);
/// clip_grad_norm_'s coefficient: min(1, maxNorm / (totalNorm + 1e-6));
/// maxNorm <= 0: 1 (no clipping).
float clipCoefficient(double totalNorm, double maxNorm);

/// The learning-rate schedules after warm-up (train --schedule).
enum class Schedule : int { Cosine = 0, Linear = 1, Constant = 2, Wsd = 3 };
/// "cosine", "linear", "constant", "wsd".
const char *scheduleName(Schedule s);
/// The schedule named `name`; false for a name carve lacks.
bool parseSchedule(const char *name, Schedule &out);

/// The optimizer's and the schedule's hyperparameters: a program's compiled
/// defaults (Program::hyper) or one run's values (StepContext::hyper), which
/// `train --lr ...` set without recompiling (docs/training.md#hyperparameters).
struct Hyperparameters {
  double lr = 1e-3;
  double minLrRatio = 0; // the schedule decays to lr * minLrRatio
  int64_t warmupSteps = 0;
  int64_t decaySteps = 0;
  Schedule schedule = Schedule::Cosine;
  double weightDecay = 0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8; // AdamW
  double clip = 0;                               // clip_grad_norm_'s max_norm; 0: no clipping
  int64_t endStep = 0; // wsd: the run's end (0-based step after its last); set by the run
};

/// Learning rate for 0-based step t: linear warm-up over `warmup` steps
/// (lr * (t + 1) / warmup), then cosine decay over `decaySteps` steps (counted
/// after warm-up) from lr to lr * minRatio, then lr * minRatio. decaySteps == 0:
/// constant after warm-up. Equals torch.optim.lr_scheduler.LambdaLR with the same
/// function of t.
double scheduledLr(int64_t t, double lr, int64_t warmup, int64_t decaySteps, double minRatio);

/// Learning rate for 0-based step t under `h`: linear warm-up over
/// warmupSteps (lr * (t + 1) / warmupSteps), then
///   cosine   - the decay above over decaySteps to lr * minLrRatio, then that;
///   linear   - a straight line over decaySteps to lr * minLrRatio, then that;
///   constant - lr;
///   wsd      - warmup, stable, decay: lr until decaySteps before endStep, then
///              a straight line to lr * minLrRatio at endStep.
/// decaySteps == 0: constant after warm-up, under every schedule.
double scheduledLr(int64_t t, const Hyperparameters &h);

} // namespace carve::rt

#endif // CARVE_RT_OPTIM_H
