//===- VerifyCmd.h - `carve verify`: a plan against the 1-rank program ----===//

#ifndef CARVE_TOOLS_CARVE_VERIFYCMD_H
#define CARVE_TOOLS_CARVE_VERIFYCMD_H

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace carve {

struct VerifyArgs {
  std::string model;    // ONNX file or builtin spec
  std::string planPath; // --plan (required)
  std::string data;     // --data; empty: generated tokens
  std::string workdir;  // --workdir; empty: a temporary folder, removed at the end
  int64_t steps = 5;
  /// Relative to the 1-rank loss; not given: by the plan's precision (fp32
  /// 1e-5, bf16/fp16 1e-4; docs/verify.md).
  std::optional<double> lossTolerance;
  /// |a - b| relative to max |a| over each tensor; not given: fp32 1e-4,
  /// bf16 2^-6, fp16 2^-9 (four roundings to the gradients' format, each
  /// at most half a unit in its last place; docs/verify.md).
  std::optional<double> weightTolerance;
  std::vector<std::string> compileFlags; // --set-dim, --frozen, --rules, --loss for both compiles
  /// Compare under the plan's own optimizer instead of SGD with momentum
  /// (AdamW turns rounding noise into +-lr steps; docs/verify.md).
  bool plannedOptimizer = false;
};

/// Runs `carve verify` (docs/verify.md). Returns 0 on PASS, 1 on FAIL, 2 on
/// bad input (missing model, bad plan, a compile or reference-run failure),
/// each with one line on stderr.
int runVerify(const VerifyArgs &args);

} // namespace carve

#endif // CARVE_TOOLS_CARVE_VERIFYCMD_H
