//===- StageSplit.h - cutting the training step into pipeline stages ------===//
//
// After autodiff (and the tensor-parallel partitioner), @train_step holds the
// whole forward and backward pass of one micro-batch. splitPipelineStages
// cuts it into pp * v stage functions @stage0 .. @stage{S-1}:
//
//   - forward ops that depend on the batch are cut into S contiguous pieces at
//     layer boundaries (the `/<name>.<k>/` component of ONNX node names; a
//     model without numbered layers is cut where a single tensor crosses),
//     balanced by FLOPs (forward + backward) or at the user's cut points;
//   - a backward op runs on the stage of the forward op it differentiates;
//   - ops that compute only from weights and constants follow their
//     consumers (cloned into each consumer stage when nothing trains them);
//   - a value used on another stage travels by `dist.send` / `dist.recv` over
//     the mesh axis "pp" (forward activations up, gradients down);
//   - a parameter used on several stages (GPT's tied embedding) is an argument
//     of each; each stage returns its own part of the gradient, marked
//     `carve.shared_grad`, and the generated code sums the parts over pp.
//
// Each stage function keeps @train_step's conventions (argument attributes,
// `carve.grad_of` results) plus: `carve.stage`, `carve.num_stages`, result 0
// `carve.loss` on the last stage, `carve.phase = "backward"` on the receives
// that open its backward part.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_STAGES_STAGESPLIT_H
#define CARVE_COMPILER_STAGES_STAGESPLIT_H

#include "dialects/carve/Contract.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinOps.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace carve {

struct PipelineOptions {
  int pp = 1;            // pipeline ranks
  int virtualStages = 1; // chunks per rank (interleaved schedule)
  int dp = 1, tp = 1;    // the rest of the mesh (for @mesh)
  /// Explicit cut points: stage k+1 starts at the first forward op whose ONNX
  /// node name matches cuts[k]. Empty: balanced automatically.
  std::vector<std::string> cuts;
};

struct StageSummary {
  std::string first, last; // first and last forward node (or layer) of the stage
  int layers = 0;          // numbered layers in the stage
  double flops = 0;        // forward + backward, one micro-batch
  double forwardFlops = 0, backwardFlops = 0;
  int64_t paramBytes = 0; // parameters and buffers it holds (local shapes)
  int64_t sendBytes = 0;  // bytes it sends per micro-batch (forward + backward)
  int ops = 0;
};

struct PipelineReport {
  std::vector<StageSummary> stages;
  int numLayers = 0;                     // numbered layers found (0: none)
  std::vector<std::string> sharedParams; // parameters whose gradient is summed over stages
  int transfers = 0;                     // send/recv pairs per micro-batch
};

/// Cuts @train_step into @stage0..@stage{S-1} (S = pp * virtualStages) and
/// erases it. Errors (one line, prefixed "plan: " when the plan is at fault):
/// more stages than layers, a cut glob that names no forward op, cut points
/// out of order or too many / too few.
/// Autodiff names each backward op's location "backward of NODE".
constexpr const char *kBackwardPrefix = "backward of ";

/// An op's floating-point work: multiply-adds count 2 (matmul, attention and
/// its gradient); everything else one operation per result element.
double opFlops(mlir::Operation *op);

/// "h.3" in "/h.3/attn/c_attn/MatMul": the numbered layer a node belongs to
/// (prefix "h", number 3). False for nodes outside numbered layers.
bool layerOfNode(llvm::StringRef node, std::string &prefix, int &number);
/// The same as one name: "h.3", or "" outside numbered layers.
std::string layerName(llvm::StringRef node);
/// Whether `glob`, an op or parameter name pattern, could single out some
/// numbered layers ("/h.11/mlp/*", "h.1*", "h.[0-3].*"): a word after a dot
/// with a digit or a bracket in it. "/h.*/mlp/*" and "wte.*" name every
/// layer alike. Where such a glob applies, a builtin model's layers differ.
bool globNamesSomeLayers(llvm::StringRef glob);

/// The units of a model without numbered layers, per forward op on the
/// batch (in program order): a new unit starts where exactly one value
/// written before is read from there on. What carve-split-stages cuts such
/// a model between, and the planner with it.
std::vector<int> crossingUnits(const std::vector<mlir::Operation *> &fwd);

/// The contiguous partition of units of the given costs into S stages that
/// minimizes the largest stage's cost (ties to the earliest split): units
/// per stage; all zero when S exceeds the units. What carve-split-stages
/// cuts a model's layers by, and the planner with it.
std::vector<int> balancedPartition(const std::vector<double> &unitCost, int S);

bool splitPipelineStages(mlir::ModuleOp module, const PipelineOptions &opts, PipelineReport &report,
                         std::string &error);

/// Records `st` on stage function `stage` (kStageSummaryAttr).
void writeStageSummary(mlir::func::FuncOp stage, const StageSummary &st);
/// The summary carve-split-stages recorded on `stage`, if any.
std::optional<StageSummary> readStageSummary(mlir::func::FuncOp stage);
/// @stage0, @stage1, ... in order.
std::vector<mlir::func::FuncOp> stageFunctions(mlir::ModuleOp module);

/// A gradient summed over pp: the parameter, its (tp-local) elements and the
/// lowest stage holding it (which counts it in the gradient norm).
struct SharedGradient {
  std::string name;
  int64_t numel;
  int owner;
};
/// Every gradient some stage marks `carve.shared_grad`, by parameter name
/// (one order for every rank).
std::vector<SharedGradient> sharedGradients(mlir::ModuleOp module);

} // namespace carve

#endif // CARVE_COMPILER_STAGES_STAGESPLIT_H
