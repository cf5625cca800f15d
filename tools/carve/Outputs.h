//===- Outputs.h - what `carve compile` writes into OUT -------------------===//
//
// OUT/src (the programs, programs.cpp, README.md), OUT/plan.json and
// OUT/init.safetensors, from the compiled programs and the plan.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_TOOLS_CARVE_OUTPUTS_H
#define CARVE_TOOLS_CARVE_OUTPUTS_H

#include "compiler/codegen/CpuCodegen.h"
#include "compiler/frontend/OnnxImporter.h"
#include "compiler/plan/Plan.h"
#include "compiler/stages/StageSplit.h"

#include <map>
#include <string>
#include <vector>

namespace carve {

/// The compiled model: what OUT describes.
struct CompiledModel {
  std::string modelName;
  const Plan *plan = nullptr;
  const OptimizerConfig *optimizer = nullptr;
  std::string target = "cpu";
  int64_t globalBatch = 0, microBatch = 0;
  int microBatches = 1;
  bool pipelined = false;
  std::vector<std::string> programNames;
  std::vector<GeneratedProgram> programs;
  std::vector<StageSummary> stages; // pipelined: one per stage
  std::vector<SharedGradient> shared;
  double plannedBubble = 0;
  std::string rulesPath;         // --rules, for the README
  bool hasCustomKernels = false; // the rules file has kernel sources for this target

  bool cuda() const { return target == "cuda"; }
  std::string sourceExtension() const { return cuda() ? ".cu" : ".cpp"; }
};

/// What the partitioner did (its dist.partition_summary on the module).
struct PartitionSummary {
  int64_t opsSplit = 0, allReduce = 0, allGather = 0, reduceScatter = 0, allToAll = 0;
};

/// The closing lines of `carve compile`: what was built, and the pipeline
/// and tensor-parallel summaries.
/// `built`: OUT/bin/train exists (false under --no-build).
void printSummary(const CompiledModel &m, const std::string &out, const PartitionSummary &counts,
                  bool built);
/// The progress note of program r's build: the ranks that run it.
std::string ranksOf(const CompiledModel &m, size_t r);

/// Writes OUT/src: each program, programs.cpp and README.md.
void writeSources(const std::string &dir, const CompiledModel &m);
/// Writes OUT/plan.json: the plan as given, the world size, the model, the
/// optimizer, target and precision, and the pipeline's stages.
void writePlanJson(const std::string &dir, const CompiledModel &m);
/// Writes the parameters' initial values as safetensors (F32, or I64 for
/// integer buffers), in argument order.
void writeInitialValues(const std::string &path,
                        const std::vector<ImportOptions::InitialValue> &values,
                        const std::map<std::string, bool> &isInt, const std::string &model);

} // namespace carve

#endif // CARVE_TOOLS_CARVE_OUTPUTS_H
