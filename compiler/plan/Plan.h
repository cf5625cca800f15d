//===- Plan.h - the parallelization plan file -----------------------------===//
//
// A plan is a JSON object (docs/plan.md). This version carries out data,
// tensor and pipeline parallelism (`dp`, `tp`, `sequence_parallel`, `ops`,
// `pp`, `num_micro_batches`, `micro_batch_size`, `schedule`, `virtual_stages`,
// `cuts`), ZeRO (`zero`), `precision`, activation recomputation (`recompute`)
// and the optimizer settings. An unknown field is refused with a clear
// message, so a plan written for a later version never silently means
// something else.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_PLAN_PLAN_H
#define CARVE_COMPILER_PLAN_PLAN_H

#include "compiler/optimizer/Optimizer.h"

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace carve {

struct Plan {
  int dp = 1;
  int tp = 1;
  /// Expert parallelism: each mixture-of-experts layer's experts split over
  /// groups of `ep` consecutive dp ranks (ep divides dp; docs/moe.md).
  int ep = 1;
  int zero = 0;
  /// ZeRO-3: the layers ahead whose parameter gathers start while the
  /// current one computes (0: each gather waits where it is first needed).
  int zero3PrefetchLayers = 0;
  bool sequenceParallel = false;
  /// Batch norm's statistics over the whole data-parallel batch (PyTorch's
  /// SyncBatchNorm): one all-reduce per batch norm (docs/training.md).
  bool syncBatchNorm = false;
  int pp = 1;
  int numMicroBatches = 0;    // 0: not given (micro_batch_size decides, else 1)
  int64_t microBatchSize = 0; // 0: not given
  std::string schedule; // "gpipe", "1f1b", "interleaved"; empty: 1f1b (interleaved when v > 1)
  int virtualStages = 1;
  /// "fp32", "bf16" or "fp16": the precision of matmul and attention inputs,
  /// of the weight copies, kept activations and gradients (fp32 master
  /// weights and optimizer state either way; fp16 adds dynamic loss
  /// scaling). The CPU target emulates the rounding.
  std::string precision = "fp32";
  /// `tf32`: the CUDA target's matmuls (and the GEMMs of convolutions) of
  /// fp32 inputs through TF32 tensor cores (inputs rounded to 10 mantissa
  /// bits, fp32 accumulation), as PyTorch's allow_tf32. Off by default; the
  /// CPU target has no TF32 and computes fp32 (carve compile says so).
  bool tf32 = false;
  /// Under bf16/fp16, where gradients accumulate over micro-batches: "fp32"
  /// (fp32 gradients, or fp32 ZeRO-2/3 chunk accumulators) or "16bit"
  /// (docs/training.md#16-bit-gradients).
  std::string gradAccumulation = "fp32";
  /// "none", "selective" or "full"; recomputeLayers (the plan's list form):
  /// full recomputation of the layers those globs name only.
  std::string recompute = "none";
  std::vector<std::string> recomputeLayers;
  /// Pipeline cut points: op-name globs, one per stage boundary, in model order.
  std::vector<std::string> cuts;
  /// The "ops" overrides in file order: op-name glob, dimension ("replicate").
  std::vector<std::pair<std::string, std::string>> ops;
  /// Optimizer fields the plan set (applied over the defaults, under the
  /// command line's).
  std::map<std::string, double> optimizerNumbers;
  std::map<std::string, std::string> optimizerStrings;
  std::map<std::string, bool> optimizerFlags;
  /// The plan as given (canonical JSON), for OUT/plan.json and comments.
  std::string json;

  int worldSize() const { return dp * tp * pp; }
  /// The schedule that runs: the given one, else interleaved for v > 1, else 1f1b.
  std::string scheduleName() const {
    return !schedule.empty() ? schedule : virtualStages > 1 ? "interleaved" : "1f1b";
  }
};

/// Parses plan text; `what` names it in errors (the file name). On failure
/// returns false with one line in `error`.
bool parsePlan(const std::string &text, const std::string &what, Plan &plan, std::string &error);

/// Applies the plan's optimizer fields to `opt`. Returns false with `error`
/// on an invalid value.
bool applyPlanOptimizer(const Plan &plan, OptimizerConfig &opt, std::string &error);

/// Checks optimizer values (positive lr, betas in [0, 1), ...).
bool validateOptimizer(const OptimizerConfig &opt, std::string &error);

} // namespace carve

#endif // CARVE_COMPILER_PLAN_PLAN_H
