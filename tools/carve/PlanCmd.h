//===- PlanCmd.h - `carve plan` and `carve compile --auto` ----------------===//

#ifndef CARVE_TOOLS_CARVE_PLANCMD_H
#define CARVE_TOOLS_CARVE_PLANCMD_H

#include "compiler/frontend/OnnxImporter.h"

#include <string>
#include <vector>

namespace carve {

struct PlanArgs {
  std::string model;       // ONNX file or builtin spec
  std::string cluster;     // --cluster
  int64_t globalBatch = 0; // --global-batch (0: the model's batch)
  std::string constraintsPath;
  std::vector<std::string> fixed; // --fixed (repeatable, comma lists)
  std::string calibrationPath;
  /// --attention: the CUDA program's attention ("cudnn" or "carve") for the
  /// as-compiled check and --calibration carve.
  std::string attention = "cudnn";
  /// --convolution: the CUDA program's convolutions ("cudnn" or "carve").
  std::string convolution = "cudnn";
  std::string output; // -o PLAN.json
  bool json = false;  // --json
  std::string loss;
  ImportOptions import;
  /// Revisit the best plan's per-op choices (--no-op-search turns it off).
  bool opSearch = true;
  /// Compile the chosen plan's memory plan (no build) and report each
  /// pipeline rank's bytes as compiled; fall back to the next plan that fits
  /// as compiled (--no-compile-check turns it off).
  bool compileCheck = true;
  /// Compile the whole model in that check, never fewer layers
  /// (compiledMemoryByLayers; --full-compile-check, to prove the two equal).
  bool fullCompileCheck = false;
  /// --storage published: price bf16/fp16 plans with the published layout
  /// (PlannerOptions::publishedStorage), not what carve compiles.
  bool publishedStorage = false;
};

/// `carve plan`: prints the report (or JSON), writes PLAN.json; exit status.
int runPlan(const PlanArgs &args);

/// `carve compile --auto`: the best plan as plan-file JSON and a one-line
/// summary. Exits with a one-line error when nothing fits.
std::string autoPlan(const PlanArgs &args, std::string &summary);

} // namespace carve

#endif // CARVE_TOOLS_CARVE_PLANCMD_H
