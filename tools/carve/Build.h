//===- Build.h - compiling and linking the generated programs -------------===//

#ifndef CARVE_TOOLS_CARVE_BUILD_H
#define CARVE_TOOLS_CARVE_BUILD_H

#include "tools/carve/Driver.h"

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace carve {

/// The runtime's build settings (written by runtime/CMakeLists.txt; the
/// CARVE_RUNTIME_CONFIG environment variable overrides where they are read).
std::map<std::string, std::string> runtimeConfig();

/// The CUDA architectures to build for: `list` ("80,90"), else the
/// runtime's; dies when this carve has no CUDA target or a number is bad.
std::vector<std::string> cudaArchitectures(const std::string &list);

/// What buildExecutable compiles: OUT/src/<program><ext> for every program,
/// the custom ops' kernel sources, OUT/src/programs.cpp; into dir/bin/train.
struct BuildInputs {
  std::string dir; // the temporary output folder
  std::string out; // OUT, as the user named it (errors, the kept log)
  bool cuda = false;
  std::vector<std::string> archs; // --target cuda: sm numbers
  std::vector<std::string> programs;
  std::vector<std::string> kernelSources; // the rules file's, for this target
  std::string rulesPath;
  /// The progress note of program r ("every rank", "ranks 0-1 (pipeline rank 0)").
  std::function<std::string(size_t)> programNote;
};

/// Compiles and links; fails with the compiler's first error line and
/// keeps its full log beside OUT.
void buildExecutable(const BuildInputs &in, Progress &progress);

} // namespace carve

#endif // CARVE_TOOLS_CARVE_BUILD_H
