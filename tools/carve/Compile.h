//===- Compile.h - `carve compile` and `carve run` -------------------------===//

#ifndef CARVE_TOOLS_CARVE_COMPILE_H
#define CARVE_TOOLS_CARVE_COMPILE_H

#include "compiler/codegen/CpuCodegen.h"
#include "compiler/frontend/OnnxImporter.h"
#include "compiler/lower/GpuCost.h"
#include "tools/carve/Driver.h"

#include <string>
#include <vector>

namespace carve {

struct CompileArgs {
  std::string model;
  std::string planPath; // empty: {"dp": 1}
  std::string planText; // --auto: the planner's plan (planPath names it in errors)
  std::string target = "cpu";
  /// --attention: "cudnn" or "carve" (PlanAttrs::attention).
  std::string attention = "cudnn";
  /// --convolution: "cudnn" or "carve" (PlanAttrs::convolution).
  std::string convolution = "cudnn";
  /// --cuda-arch: GPU architectures (sm numbers, "80,90"); empty: the runtime's.
  std::string cudaArchs;
  bool fuse = true; // --no-fuse turns elementwise fusion off
  /// --bucket-bytes: the largest gradient bucket (carve-data-parallel's bucket-bytes).
  int64_t bucketBytes = 4194304;
  /// --no-weights: no initial values are generated or written.
  bool noWeights = false;
  /// --no-build: the sources are written, bin/train is not built.
  bool noBuild = false;
  std::string output;
  std::string loss;
  std::string emitMlir;                  // write the training step's IR here
  std::string emitMlirAfter;             // ...as it is after this pass instead
  std::string timelineJson, timelineSvg; // the planned pipeline schedule
  std::string gpuModel;                  // --gpu-model: the GPU cost model's report (JSON)
  std::string rulesPath;                 // --rules: custom ops and annotation overrides
  ImportOptions import;
  OptimizerConfig optimizer;
  /// Which optimizer fields the command line set (they win over the plan).
  std::vector<std::string> setOnCommandLine;
  bool quiet = false;
  /// compiledMemory: no output directory is checked or written.
  bool memoryOnly = false;
};

/// Runs `carve compile`; exits with a one-line error on failure.
int runCompile(CompileArgs &args);

/// One pipeline rank's bytes as compiled (every dp and tp rank of it alike).
struct CompiledRankMemory {
  int64_t params = 0, grads = 0, optimizer = 0, activations = 0, arena = 0;
};
/// What `carve compile` would build for the plan, without building it: the
/// import, the pass pipeline and the emitter, whose memory plan gives each
/// pipeline rank's regions (the start-up report's numbers). Exits with
/// `carve compile`'s one-line error when the plan does not compile.
/// With `gpu` set (a CUDA target), also the GPU cost model of the compiled
/// step (compiler/lower/GpuCost.h); false in `gpuOk` with `gpuError` set when
/// the model cannot price it.
std::vector<CompiledRankMemory> compiledMemory(CompileArgs &args, GpuStep *gpu = nullptr,
                                               bool *gpuOk = nullptr,
                                               std::string *gpuError = nullptr);

/// The chosen plan's bytes as compiledMemory gives them, from compiles of
/// the same model with fewer layers where that is exact: a builtin model
/// (its layers are alike) under a plan without pipeline stages or experts,
/// with more than kLayerPoints + kLayerFloor layers, where no pinned op,
/// recomputed layer or frozen parameter is named by its layer's number and
/// no rules file is given. Each pipeline rank's
/// regions are compiled at kLayerPoints consecutive layer counts from
/// kLayerFloor; when every region is affine in the layer count over all of
/// them (zero second differences) the model's own count is extrapolated,
/// else the whole model is compiled. `layers` receives the counts compiled
/// (empty: the whole model). The as-compiled check of carve plan: a 1T GPT
/// compiles in milliseconds instead of seconds (docs/planner.md).
constexpr int64_t kLayerFloor = 4, kLayerPoints = 4;
std::vector<CompiledRankMemory> compiledMemoryByLayers(const CompileArgs &args,
                                                       std::vector<int64_t> &layers);

/// Runs `carve run OUT -n N -- ARGS`: execs mpirun (never returns on success).
int runRun(const std::string &out, int ranks, const std::vector<std::string> &trainArgs);

} // namespace carve

#endif // CARVE_TOOLS_CARVE_COMPILE_H
