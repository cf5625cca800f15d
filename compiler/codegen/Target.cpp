//===- Target.cpp - what differs between the cpu and cuda targets ---------===//
//
// The two targets run the same statements: the CUDA source calls carve::gpu
// kernels of the same names on device pointers. What differs is small and
// lives here: the headers and namespace, the `gpu::` qualification of calls,
// how a scalar is stored to or read from device memory, the device-side
// gradient-norm accumulators, and the precision line.
//
//===----------------------------------------------------------------------===//

#include "compiler/codegen/Generator.h"
#include "compiler/lower/Kernels.h"

#include <cctype>

namespace carve::codegen {

/// The runtime headers a generated source includes.
std::string runtimeIncludes(const EmitOptions &opts, bool pipelined) {
  if (opts.cuda())
    return "#include \"carve/rt/gpu.h\"\n#include \"carve/rt/gpu_fused.cuh\"\n#include "
           "\"carve/rt/philox.h\"\n";
  return std::string("#include \"carve/rt/dist.h\"\n#include \"carve/rt/fused.h\"\n"
                     "#include \"carve/rt/kernels.h\"\n#include \"carve/rt/optim.h\"\n"
                     "#include \"carve/rt/philox.h\"\n") +
         (pipelined ? "#include \"carve/rt/pipeline.h\"\n" : "") +
         "#include \"carve/rt/program.h\"\n";
}

std::string callee(const EmitOptions &opts, llvm::StringRef entry) {
  if (opts.cuda())
    if (std::optional<RuntimeEntry> e = lookupRuntimeEntry(entry); e && e->cuda)
      return "gpu::" + entry.str();
  return entry.str();
}

/// Declares the gradient norm's two sums of squares (tp-split gradients, and
/// the rest). On CUDA they accumulate on the device, so the norm costs one
/// read instead of one per gradient.
std::string normDeclarations(const EmitOptions &opts) {
  std::string s = "  double sqSplit = 0, sqWhole = 0;\n";
  if (opts.ep > 1)
    s += "  double sqExpertSplit = 0, sqExpertWhole = 0;  // this rank's experts\n";
  if (opts.cuda())
    s += std::string("  // On the device: [0] the tp-split gradients, [1] the rest") +
         (opts.ep > 1 ? ", [2] and [3] the same of\n  // this rank's experts" : "") +
         "; added in this order, read once below.\n  double *sqDevice = " +
         callee(opts, "normAccumulators") + "();\n";
  return s;
}

std::string expertNormSum(const EmitOptions &opts) {
  if (opts.ep <= 1)
    return "";
  return "  // Expert parallelism: the other ep ranks hold the other experts.\n"
         "  ctx.epComm->allReduce(&sqExpertSplit, 1, CommType::F64, ReduceOp::Sum);\n"
         "  ctx.epComm->allReduce(&sqExpertWhole, 1, CommType::F64, ReduceOp::Sum);\n"
         "  sqSplit += sqExpertSplit;\n  sqWhole += sqExpertWhole;\n";
}

/// CUDA: reads the device sums into sqSplit and sqWhole (nothing on the CPU).
std::string normRead(const EmitOptions &opts) {
  if (!opts.cuda())
    return "";
  if (opts.ep > 1)
    return "  double sqHost[4];\n  " + callee(opts, "readScalars") +
           "(sqDevice, sqHost, 4);  // waits for the step's "
           "kernels\n  sqSplit = sqHost[0], sqWhole = sqHost[1];\n"
           "  sqExpertSplit = sqHost[2], sqExpertWhole = sqHost[3];\n";
  return "  double sqHost[2];\n  " + callee(opts, "readScalars") +
         "(sqDevice, sqHost, 2);  // waits for the step's "
         "kernels\n  sqSplit = sqHost[0], sqWhole = sqHost[1];\n";
}

/// The step's first statement under a bf16/fp16 plan (nothing under fp32).
std::string precisionLine(const EmitOptions &opts) {
  std::string tf32;
  if (opts.cuda() && opts.plan.tf32)
    tf32 = "  // Plan tf32: matmuls of fp32 inputs through TF32 tensor cores (inputs rounded to\n"
           "  // 10 mantissa bits, fp32 accumulation).\n"
           "  gpu::setTf32(true);\n";
  if (opts.precision == "fp32")
    return tf32;
  return std::string("  // Plan precision ") + opts.precision +
         ": matmul and attention round their inputs to it and accumulate in fp32.\n" + "  " +
         callee(opts, "setPrecision") +
         "(Precision::" + (opts.precision == "bf16" ? "BF16" : "F16") + ");\n" + tf32;
}

std::string dropoutStateLine(const EmitOptions &opts, int dropoutNodes) {
  if (!opts.cuda() || dropoutNodes == 0)
    return "";
  return "  // Dropout: this step's seed and number, read by the dropout kernels on the device\n"
         "  // (a CUDA graph replays them with each step's).\n"
         "  " +
         callee(opts, "setDropoutState") + "(ctx.seed, ctx.step);\n";
}

/// The namespace whose kernels the step calls (the same names on both targets).
std::string usingLine(const EmitOptions &opts) {
  return opts.cuda() ? "// The CUDA target: every call below runs on the device's compute stream "
                       "(carve/rt/gpu.h),\n// named gpu:: where a CPU kernel of the same name "
                       "exists.\nnamespace gpu = carve::gpu;\nnamespace ew = carve::rt::ew;\nusing "
                       "namespace carve::gpu;\n"
                     : "using namespace carve::rt;\n";
}

std::string glueBegin() {
  return "// The functions from here to CARVE_GLUE_END are kernel calls in order: built at -O0\n"
         "// (carve/rt/program.h). The fused chains above keep -O3.\n"
         "CARVE_GLUE_BEGIN\n\n";
}

std::string glueEnd() { return "CARVE_GLUE_END\n"; }

std::string Generator::seedStore(const std::string &ptr, const std::string &value) const {
  std::string v = opts.precision == "fp16" ? "(" + value + ") * ctx.lossScale" : value;
  if (opts.cuda())
    return "  " + callee(opts, "fill") + "(" + ptr + ", (int64_t)1, " + v + ");\n";
  return "  *" + ptr + " = " + v + ";\n";
}

std::string Generator::scalarRead(const std::string &ptr) const {
  return opts.cuda() ? callee(opts, "readScalar") + "(" + ptr + ")" : ptr + "[0]";
}

} // namespace carve::codegen
