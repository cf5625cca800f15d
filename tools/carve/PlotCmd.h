//===- PlotCmd.h - `carve plot` -------------------------------------------===//
//
//   carve plot LOG.jsonl [LOG2.jsonl ...] -o curves.svg
//
// Draws the training logs `train --log` writes (runtime/README.md): one panel
// per series (loss, evaluation loss where a log has it, learning rate,
// gradient norm, throughput) against the step, the runs overlaid in one
// colour each, as an SVG file any browser opens (docs/training.md#logs-and-plots).
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_TOOLS_CARVE_PLOTCMD_H
#define CARVE_TOOLS_CARVE_PLOTCMD_H

#include <string>
#include <vector>

namespace carve {

/// Runs `carve plot`; returns the exit status (errors: one line naming the
/// file and the cause, 1, nothing written).
int runPlot(const std::vector<std::string> &logs, const std::string &output);

} // namespace carve

#endif // CARVE_TOOLS_CARVE_PLOTCMD_H
