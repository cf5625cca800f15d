//===- GpuCost.h - what a lowered CUDA program launches, and its time -----===//
//
// A cost model of carve's own CUDA programs that runs on the CPU: from the
// lowered IR (after carve-select-kernels, static shapes, nothing executed)
// each call's kernel launches as runtime/cuda issues them (the same names
// CARVE_GPU_PROFILE prints), their floating-point operations and the bytes
// they move; then a predicted time per kernel class on an H100 or an H200
// from figures measured on those GPUs (docs/performance.md, docs/gpu-model.md).
//
// The launch structure mirrors runtime/cuda's host code entry by entry; the
// emulated GPU checks it (tests/e2e/gpu_model.py: the launches per kernel and
// the GEMMs' FLOPs of a step equal what the emulation executed).
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_LOWER_GPUCOST_H
#define CARVE_COMPILER_LOWER_GPUCOST_H

#include "mlir/IR/BuiltinOps.h"
#include "llvm/ADT/StringRef.h"

#include <map>
#include <string>
#include <vector>

namespace carve {

/// Kernel classes, in the order reports list them.
enum class GpuClass {
  Gemm,          // cuBLAS GEMMs
  Attention,     // carve's attention kernels
  Conversion,    // 16-bit rounding and conversion
  Layout,        // views, transposes, broadcasts, concatenation
  Elementwise,   // fused chains, unary, binary-free elementwise, fills
  Normalization, // layer and RMS norm, softmax
  Reduction,     // sums and maxima over axes
  Gather,        // embedding gathers and their gradients
  Loss,          // cross-entropy
  Optimizer,     // the update, the gradient norm
  Convolution,   // cuDNN's convolutions (priced as GEMMs of their FLOPs)
};
constexpr int kGpuClasses = 11;
const char *gpuClassName(GpuClass c);

/// One kernel (or cuBLAS call) of a step, `count` times.
struct GpuLaunch {
  std::string kernel; // as CARVE_GPU_PROFILE names it, template arguments left out
  GpuClass cls = GpuClass::Elementwise;
  int64_t count = 1;
  double flops = 0;  // per launch
  double bytes = 0;  // per launch: device memory read and written
  bool half = false; // a GEMM on 16-bit inputs (bf16 / fp16 tensor cores)
  bool tf32 = false; // a GEMM on fp32 inputs through TF32 tensor cores (plan field tf32)
  std::string op;    // the op that launches it ("carve.matmul"), empty for the step's own
  std::string node;  // that op's model node, where it has one
};

/// What one training step of a lowered single-stage CUDA program launches.
struct GpuStep {
  std::vector<GpuLaunch> launches;
  /// Work the model does not price: "entry: why" (collectives, unknown
  /// entries). Empty for the programs the emulation checks.
  std::vector<std::string> unpriced;
  std::string precision; // the plan's
};

/// The step of `module` (lowered for the CUDA target by carve-select-kernels):
/// false with `error` set when it is no such program (another target, not
/// lowered, a pipeline stage).
bool modelGpuStep(mlir::ModuleOp module, GpuStep &out, std::string &error);

/// A GPU the time model knows, with the figures measured on it.
struct GpuSpec {
  const char *name;   // "h100", "h200"
  const char *device; // in words
  double memoryGBs;   // device memory, read + write, measured (carve-bench-roofline)
};
/// The GPUs the model has figures for.
const std::vector<GpuSpec> &gpuSpecs();
const GpuSpec *findGpu(llvm::StringRef name);

/// The predicted time of a step on `gpu`, per class.
struct GpuPrediction {
  double ms[kGpuClasses] = {};
  int64_t launches[kGpuClasses] = {};
  double flops[kGpuClasses] = {};
  double bytes[kGpuClasses] = {};
  double totalMs() const;
  int64_t totalLaunches() const;
};
GpuPrediction predictGpuStep(const GpuStep &step, const GpuSpec &gpu);
/// The predicted time of one launch of `l` on `gpu`, in microseconds.
double predictLaunchUs(const GpuLaunch &l, const GpuSpec &gpu);

/// Launches per kernel name, and the GEMMs' FLOPs (what the emulation's
/// CARVE_GPU_PROFILE table can be compared with).
std::map<std::string, int64_t> launchesByKernel(const GpuStep &step);
double gemmFlops(const GpuStep &step);

/// The whole report as JSON: the launches by kernel, a prediction for every
/// GPU of gpuSpecs(), and every call (op, model node, kernel, launches,
/// FLOPs, bytes, predicted microseconds per GPU).
std::string gpuStepJson(const GpuStep &step);

} // namespace carve

#endif // CARVE_COMPILER_LOWER_GPUCOST_H
