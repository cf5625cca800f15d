//===- CpuCodegen.h - per-rank C++ and CUDA programs ----------------------===//
//
// The code generator's public entry points, for both targets ("cpu": C++
// against kernels.h, "cuda": a .cu source against gpu.h); Generator.h, private
// to this folder, says which source does what.
//
// Turns `@train_step` (built by autodiff, shaped for one rank's share of the
// batch) into a readable C++ source that implements the runtime's `Program`
// contract (runtime/include/carve/rt/program.h): one kernel call per op with
// a comment naming the op and its model node, a static memory plan (one
// arena; activations share memory by liveness), gradient buckets all-reduced
// over the data-parallel group as soon as they are complete, and the
// optimizer update.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_CODEGEN_CPUCODEGEN_H
#define CARVE_COMPILER_CODEGEN_CPUCODEGEN_H

#include "compiler/optimizer/Optimizer.h"
#include "mlir/IR/BuiltinOps.h"

#include <cstdint>
#include <string>
#include <vector>

namespace carve {

/// What the driver chooses for the emitted programs. The plan (dp, tp, pp,
/// ZeRO, micro-batches, precision, the global batch, the target) and the
/// optimizer are not here: the emitter reads them from the module's
/// `carve.plan` (dialects/carve/Contract.h) and its tail ops (carve-optimizer).
struct CodegenOptions {
  std::string modelName; // shown in comments and in Program::model
  std::string programName = "program0";
  std::string planJson; // shown in the header comment
  /// The memory plan's sizes only (GeneratedProgram's bytes; carve plan's
  /// as-compiled check): every check up to the arena's layout runs, no
  /// source is printed.
  bool memoryOnly = false;
};

struct GeneratedProgram {
  std::string source; // program0.cpp (program0.cu for the CUDA target)
  int64_t arenaBytes = 0;
  int64_t activationBytes = 0; // the activation region after reuse
  int64_t unplannedBytes = 0;  // all activations without reuse
  int numBuckets = 0;
  int64_t paramBytes = 0, gradBytes = 0, stateBytes = 0; // persistent, this rank
  int numKernelCalls = 0;
  /// Token models: the rows of the embedding the token ids index (the
  /// data loader checks every id against it); 0: not known on this rank.
  int64_t vocab = 0;
  /// Dropout nodes this rank's step draws masks for (Program::dropoutNodes).
  int dropoutNodes = 0;
};

/// One pipeline rank's part of a pipelined plan (compiler/schedule/Schedule.h
/// builds the instruction list).
struct PipelineCodegenOptions {
  int pp = 1, virtualStages = 1;
  std::string schedule; // "gpipe", "1f1b", "interleaved" (for comments)
  int rank = 0;         // this program's place on the pp axis
  struct Step {
    bool forward;
    int microBatch, chunk, slot;
  };
  std::vector<Step> steps; // this rank's instruction list, in order
  std::vector<int> slots;  // per chunk: micro-batches of activations it keeps at once
  /// Every gradient summed over pp, in one order for all ranks: parameter
  /// name, its (tp-local) elements, and the lowest stage holding it (which
  /// counts it in the gradient norm).
  struct Shared {
    std::string name;
    int64_t numel;
    int owner;
  };
  std::vector<Shared> shared;
  /// The largest tag of the module's sends and receives (every stage must
  /// agree on the tags), counted once for all ranks; -1: each stage counts.
  int64_t maxMessageTag = -1;
};

/// Generates pipeline rank `pipe.rank`'s program from `@stage{c * pp + rank}`
/// (c < virtualStages), built by splitPipelineStages. Micro-batches run in
/// the order of `pipe.steps`; each chunk's activations have `pipe.slots`
/// copies; gradients accumulate over the micro-batches.
/// The largest tag of `module`'s sends and receives (-1: none).
int64_t maxMessageTag(mlir::ModuleOp module);

bool generatePipelineProgram(mlir::ModuleOp module, const CodegenOptions &opts,
                             const PipelineCodegenOptions &pipe, GeneratedProgram &out,
                             std::string &error);

/// Generates the program for `@train_step` in `module`. On failure returns
/// false with one line in `error` naming the op (and node) that could not be
/// compiled.
bool generateCpuProgram(mlir::ModuleOp module, const CodegenOptions &opts, GeneratedProgram &out,
                        std::string &error);

/// Every program of a lowered module (carve-select-kernels has run), from
/// the module alone: one, named `program{E}` (E the module's ep rank, 0
/// without expert parallelism), or under a pipelined plan one per pp rank,
/// `program{E * pp + r}`, each following the schedule the plan names.
struct ModulePrograms {
  std::vector<GeneratedProgram> programs;
  std::vector<std::string> names;
  bool pipelined = false;
};
bool generatePrograms(mlir::ModuleOp module, const CodegenOptions &opts, ModulePrograms &out,
                      std::string &error);

/// programs.cpp: `carve_program_for_rank` and `carve_world_size` for the
/// given programs (rank r runs programs[rankToProgram[r]]).
std::string generateProgramTable(const std::vector<std::string> &programNames,
                                 const std::vector<int> &rankToProgram);

} // namespace carve

#endif // CARVE_COMPILER_CODEGEN_CPUCODEGEN_H
