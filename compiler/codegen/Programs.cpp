//===- Programs.cpp - every program of a lowered module -------------------===//
//
// What `carve compile` and `carve-translate --carve-to-cpp` print: the
// module's programs, from the module alone. The plan (carve.plan) says
// whether the step is pipelined; then the stage functions, the gradients
// they share (carve-split-stages' records) and the schedule the plan names
// (compiler/schedule, built here from the plan's pp, micro-batches, virtual
// stages and schedule) make one program per pipeline rank.
//
//===----------------------------------------------------------------------===//

#include "compiler/codegen/CpuCodegen.h"

#include "compiler/schedule/Schedule.h"
#include "compiler/stages/StageSplit.h"
#include "dialects/carve/Contract.h"

#include "mlir/IR/Diagnostics.h"

using namespace mlir;

namespace carve {

bool generatePrograms(ModuleOp module, const CodegenOptions &given, ModulePrograms &out,
                      std::string &error) {
  std::string why;
  FailureOr<PlanAttrs> plan;
  {
    ScopedDiagnosticHandler handler(module.getContext(), [&](Diagnostic &d) {
      why = d.str();
      return success();
    });
    plan = readPlan(module);
  }
  if (failed(plan)) {
    error = why;
    return false;
  }
  int64_t epRank = 0;
  if (auto r = module->getAttrOfType<IntegerAttr>(kEpRankAttr))
    epRank = r.getInt();
  CodegenOptions cg = given;
  out = ModulePrograms();
  out.pipelined = plan->pipelined();
  if (!out.pipelined) {
    // One program; under expert parallelism the ep rank's (its experts).
    cg.programName = "program" + std::to_string(epRank);
    out.programs.resize(1);
    if (!generateCpuProgram(module, cg, out.programs[0], error))
      return false;
    out.names.push_back(cg.programName);
    return true;
  }
  pipeline::ScheduleKind kind;
  pipeline::Schedule schedule;
  if (!pipeline::parseScheduleKind(plan->schedule, kind, error) ||
      !pipeline::buildSchedule(kind, (int)plan->pp, (int)plan->microBatches,
                               (int)plan->virtualStages, schedule, error))
    return false;
  std::vector<SharedGradient> shared = sharedGradients(module);
  const int64_t maxTag = maxMessageTag(module);
  out.programs.resize(plan->pp);
  for (int r = 0; r < plan->pp; ++r) {
    PipelineCodegenOptions pc;
    pc.pp = (int)plan->pp;
    pc.virtualStages = (int)plan->virtualStages;
    pc.schedule = plan->schedule;
    pc.rank = r;
    pc.maxMessageTag = maxTag;
    for (const pipeline::Instr &in : schedule.ranks[r])
      pc.steps.push_back({in.kind == pipeline::Instr::Forward, in.microBatch, in.chunk, in.slot});
    pc.slots = schedule.slots[r];
    for (const SharedGradient &g : shared)
      pc.shared.push_back({g.name, g.numel, g.owner});
    // Under expert parallelism the programs are numbered epRank * pp + ppRank.
    cg.programName = "program" + std::to_string(epRank * plan->pp + r);
    if (!generatePipelineProgram(module, cg, pc, out.programs[r], error))
      return false;
    out.names.push_back(cg.programName);
  }
  return true;
}

} // namespace carve
