//===- CompileSteps.h - the steps of `carve compile` ----------------------===//
//
// Compile.cpp runs them in order: resolve the command line against the plan
// (Setup.cpp), import the model for one rank's share of the batch
// (ImportBatch.cpp), run the pass pipeline and the emitter (Compile.cpp),
// write and build OUT (Outputs.cpp, Build.cpp).
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_TOOLS_CARVE_COMPILESTEPS_H
#define CARVE_TOOLS_CARVE_COMPILESTEPS_H

#include "compiler/codegen/CpuCodegen.h"
#include "compiler/frontend/OnnxImporter.h"
#include "compiler/plan/Plan.h"
#include "compiler/rules/Rules.h"
#include "compiler/schedule/Schedule.h"
#include "tools/carve/Compile.h"
#include "tools/carve/Driver.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/OwningOpRef.h"

#include <map>
#include <string>
#include <vector>

namespace carve {

/// The command line resolved against the plan, before any work.
struct Setup {
  Plan plan;
  std::string where; // the plan's name in errors
  OptimizerConfig opt;
  std::vector<std::string> archs; // --target cuda
  std::string out;
  RuleSet rules;
};

/// Parses the plan, checks the target, the optimizer, the output folder and
/// the rules file; dies with one line on the first problem.
Setup resolve(CompileArgs &args);

/// The imported model: one rank's (or micro-batch's) program and the
/// model's initial values.
struct Imported {
  mlir::OwningOpRef<mlir::ModuleOp> module;
  std::vector<ImportOptions::InitialValue> initial;
  std::map<std::string, bool> isInt; // parameters and buffers of integer type
  int64_t batch = -1, micro = -1;
  std::string batchInput;
  int m = 1; // micro-batches per step of each replica
};

/// Imports the model with its global batch (the initial values, the batch),
/// then for one rank's share (or one micro-batch) of it; builds the pipeline
/// schedule when the plan has one. Dies with one line naming the cause.
Imported importModel(mlir::MLIRContext &context, const CompileArgs &args, const Setup &s,
                     pipeline::Schedule &schedule, Progress &progress);

} // namespace carve

#endif // CARVE_TOOLS_CARVE_COMPILESTEPS_H
