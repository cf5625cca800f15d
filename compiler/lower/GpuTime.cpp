//===- GpuTime.cpp - the predicted time of a lowered CUDA program's launches -===//
//
// Per launch: a fixed cost plus the larger of its FLOPs at the class's rate
// and its bytes at the class's share of the measured memory bandwidth. The
// figures are carve's own kernels as profiled on the GPUs
// (docs/gpu-model.md says where each comes from).
//
//===----------------------------------------------------------------------===//

#include "compiler/lower/GpuCost.h"

#include "llvm/Support/Format.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <cmath>

using namespace mlir;

namespace carve {

namespace {

struct ClassFigures {
  double fixedUs; // per launch
  double tflops;  // for FLOPs (0: bandwidth only)
  double bwShare; // of the measured memory bandwidth
};

/// carve's small kernels (everything but GEMMs and attention): a fixed cost
/// per launch and a share of the measured bandwidth, the pair that fits the
/// recorded steps best (bench/gpu_step_model.py; docs/gpu-model.md).
constexpr double kSmallFixedUs = 5.75;
constexpr double kSmallBwShare = 0.44;

/// The figures of kernel class c (and, for GEMMs and attention, the kernel).
ClassFigures figures(const GpuLaunch &l) {
  switch (l.cls) {
  case GpuClass::Convolution: // not measured through carve: as carve's GEMMs
  case GpuClass::Gemm:
    // cuBLAS through carve's matmul (fp32 output): GPT-2 small's GEMMs
    // 253 TFLOP/s on their shapes (bf16), ResNet-18's fp32 ones. TF32 is not
    // measured through carve yet: cuBLAS's own TF32 roofline (259-404
    // TFLOP/s on the H100 and H200) at the share of its bf16 roofline that
    // carve's bf16 GEMMs reach (270 of about 740).
    return l.half   ? ClassFigures{8.0, 270.0, 1.0}
           : l.tf32 ? ClassFigures{10.0, 140.0, 1.0}
                    : ClassFigures{12.0, 40.0, 1.0};
  case GpuClass::Attention:
    // CUDA-core fp32 dot products (kernels_attention.cu), per kernel.
    if (l.kernel == "attnForward")
      return {5.0, 7.5, 1.0};
    if (l.kernel == "attnGradQ")
      return {5.0, 7.6, 1.0};
    if (l.kernel == "attnGradKV")
      return {5.0, 5.9, 1.0};
    // cuDNN's fused flash attention: published rates, not yet measured
    // through carve (docs/gpu-model.md): causal d = 64, T = 1k on an H100,
    // about 288 TFLOP/s forward and 200-260 backward (FlashAttention-3's
    // figure, cuDNN 9.19's benchmark on an H200); the low ends here.
    if (l.kernel == "cuDNN flash attention forward")
      return {10.0, 250.0, 1.0};
    if (l.kernel == "cuDNN flash attention backward")
      return {15.0, 200.0, 1.0};
    return {kSmallFixedUs, 0, kSmallBwShare};
  default:
    return {kSmallFixedUs, 0, kSmallBwShare};
  }
}

} // namespace

const std::vector<GpuSpec> &gpuSpecs() {
  static const std::vector<GpuSpec> specs = {
      {"h100", "NVIDIA H100 80GB HBM3", 3032.0},
      {"h200", "NVIDIA H200 141GB HBM3e", 4290.0},
  };
  return specs;
}

const GpuSpec *findGpu(llvm::StringRef name) {
  for (const GpuSpec &g : gpuSpecs())
    if (name.equals_insensitive(g.name))
      return &g;
  return nullptr;
}

double GpuPrediction::totalMs() const {
  double t = 0;
  for (double x : ms)
    t += x;
  return t;
}

int64_t GpuPrediction::totalLaunches() const {
  int64_t t = 0;
  for (int64_t x : launches)
    t += x;
  return t;
}

double predictLaunchUs(const GpuLaunch &l, const GpuSpec &gpu) {
  const ClassFigures f = figures(l);
  const double computeUs = f.tflops > 0 ? l.flops / (f.tflops * 1e6) : 0;
  const double memoryUs = l.bytes / (gpu.memoryGBs * f.bwShare * 1e3);
  return (l.count ? f.fixedUs : 0) + std::max(computeUs, memoryUs);
}

GpuPrediction predictGpuStep(const GpuStep &step, const GpuSpec &gpu) {
  GpuPrediction p;
  for (const GpuLaunch &l : step.launches) {
    const double us = predictLaunchUs(l, gpu);
    const int c = static_cast<int>(l.cls);
    const int64_t n = std::max<int64_t>(l.count, 1);
    p.ms[c] += n * us / 1e3;
    p.launches[c] += l.count;
    p.flops[c] += n * l.flops;
    p.bytes[c] += n * l.bytes;
  }
  return p;
}

std::map<std::string, int64_t> launchesByKernel(const GpuStep &step) {
  std::map<std::string, int64_t> by;
  for (const GpuLaunch &l : step.launches)
    if (l.count)
      by[l.kernel] += l.count;
  return by;
}

double gemmFlops(const GpuStep &step) {
  double f = 0;
  for (const GpuLaunch &l : step.launches)
    if (l.cls == GpuClass::Gemm)
      f += l.count * l.flops;
  return f;
}

std::string gpuStepJson(const GpuStep &step) {
  std::string s;
  llvm::raw_string_ostream os(s);
  auto str = [](llvm::StringRef t) {
    std::string q = "\"";
    for (char c : t)
      q += c == '"' || c == '\\' ? std::string("\\") + c : std::string(1, c);
    return q + "\"";
  };
  os << "{\n  \"precision\": " << str(step.precision) << ",\n  \"launches_by_kernel\": {";
  bool first = true;
  for (auto &[k, n] : launchesByKernel(step)) {
    os << (first ? "\n" : ",\n") << "    " << str(k) << ": " << n;
    first = false;
  }
  os << "\n  },\n  \"gemm_flops\": " << llvm::format("%.0f", gemmFlops(step))
     << ",\n  \"unpriced\": [";
  for (size_t i = 0; i < step.unpriced.size(); ++i)
    os << (i ? ", " : "") << str(step.unpriced[i]);
  os << "],\n  \"predictions\": {";
  first = true;
  for (const GpuSpec &g : gpuSpecs()) {
    GpuPrediction p = predictGpuStep(step, g);
    os << (first ? "\n" : ",\n") << "    " << str(g.name) << ": {\"device\": " << str(g.device)
       << ", \"ms\": " << llvm::format("%.3f", p.totalMs())
       << ", \"launches\": " << p.totalLaunches() << ", \"classes\": {";
    for (int c = 0; c < kGpuClasses; ++c)
      os << (c ? ", " : "") << str(gpuClassName(static_cast<GpuClass>(c)))
         << ": {\"ms\": " << llvm::format("%.3f", p.ms[c]) << ", \"launches\": " << p.launches[c]
         << ", \"gflop\": " << llvm::format("%.3f", p.flops[c] / 1e9)
         << ", \"mb\": " << llvm::format("%.3f", p.bytes[c] / 1e6) << "}";
    os << "}}";
    first = false;
  }
  os << "\n  },\n  \"calls\": [";
  first = true;
  for (const GpuLaunch &l : step.launches) {
    if (!l.count)
      continue;
    os << (first ? "\n" : ",\n") << "    {\"op\": " << str(l.op) << ", \"node\": " << str(l.node)
       << ", \"kernel\": " << str(l.kernel) << ", \"class\": " << str(gpuClassName(l.cls))
       << (l.tf32 ? ", \"tf32\": true" : "") << ", \"launches\": " << l.count
       << ", \"gflop\": " << llvm::format("%.4f", l.count * l.flops / 1e9)
       << ", \"mb\": " << llvm::format("%.4f", l.count * l.bytes / 1e6) << ", \"us\": {";
    bool firstGpu = true;
    for (const GpuSpec &g : gpuSpecs()) {
      os << (firstGpu ? "" : ", ") << str(g.name) << ": "
         << llvm::format("%.3f", l.count * predictLaunchUs(l, g));
      firstGpu = false;
    }
    os << "}}";
    first = false;
  }
  os << "\n  ]\n}\n";
  return s;
}

} // namespace carve
