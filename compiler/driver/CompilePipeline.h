//===- CompilePipeline.h - the passes `carve compile` runs ----------------===//
//
// One PassManager carries the imported model to the per-rank programs'
// IR; which passes it holds follows from the plan on the module:
//
//   carve-bind-custom-ops   a rules file's annotations on its custom ops
//   carve-autodiff          @forward -> @train_step (loss, gradients)
//   carve-check-overrides   a rules file's overrides each match some op
//   carve-partition         tp and sequence parallelism (tp > 1 or ZeRO)
//   carve-split-stages      pipeline stages (pp > 1 or micro-batches)
//   carve-concat-slice-grads  a split's gradient as one concat, not a sum
//   carve-fuse-elementwise  elementwise chains grouped into fused kernels
//                           (unless --no-fuse)
//   carve-fold-transposes   transposes folded into their matmuls' flags
//   carve-recompute         forward ops run again in backward (recompute)
//   carve-data-parallel     gradient order, buckets, ZeRO chunks and gathers
//   carve-plan-memory       the arena: persistent tensors, activation offsets
//   carve-optimizer         the step's tail as ops: unscaling, the norm,
//                           clipping, AdamW or SGD, ZeRO-1/2's gathers
//   carve-select-kernels    each op's runtime entry on the plan's target
//
// The emitter (compiler/codegen) then prints what the IR says.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_DRIVER_COMPILEPIPELINE_H
#define CARVE_COMPILER_DRIVER_COMPILEPIPELINE_H

#include "compiler/optimizer/Optimizer.h"
#include "compiler/rules/Rules.h"
#include "dialects/carve/Contract.h"

#include "mlir/Pass/PassManager.h"

#include <string>
#include <vector>

namespace carve {

/// Adds the passes for `plan` to `pm` (a module pass manager). `loss` names
/// the output that is the loss (empty: the only one); `rules` is the rules
/// file's content (empty when none was given); `fuse` adds elementwise fusion;
/// `optimizer` is the update the tail performs; `bucketBytes` the largest
/// gradient bucket.
/// `epRank`: under expert parallelism (plan.ep > 1), the ep rank whose
/// program this is (carve-expert-parallel keeps its experts). With `fuse`,
/// a convolution's windows and their gradient are never whole in memory
/// (carve-fold-transposes' scatter-products and gather-operands; both
/// targets' runtimes have matmul_gather_grad and matmul_gathered).
/// Returns the flags of the passes it added, in order (the only list of
/// them: `carve compile --emit-mlir-after` accepts exactly these).
std::vector<std::string> buildCompilePipeline(mlir::OpPassManager &pm, const PlanAttrs &plan,
                                              const RuleSet &rules, const std::string &loss,
                                              bool fuse, const OptimizerConfig &optimizer,
                                              int64_t bucketBytes, int64_t epRank = 0);

} // namespace carve

#endif // CARVE_COMPILER_DRIVER_COMPILEPIPELINE_H
