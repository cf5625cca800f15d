//===- kernel_list.cu - kernels.def's CUDA entries exist in carve::gpu ----===//
//
// A compile-time check, no code: every entry runtime/include/carve/rt/
// kernels.def marks `cuda` is declared in carve::gpu (gpu.h, gpu_fused.cuh),
// since a using-declaration of a name carve::gpu lacks does not compile. The emitter qualifies exactly these
// names with `gpu::` in CUDA sources.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/gpu.h"
#include "carve/rt/gpu_fused.cuh"

namespace carve::gpu::kernel_list {

#define CARVE_RT_ON_CUDA_1(name) using carve::gpu::name;
#define CARVE_RT_ON_CUDA_0(name)
#define CARVE_RT_KERNEL(name, cpu, cuda, summary) CARVE_RT_ON_CUDA_##cuda(name)
#include "carve/rt/kernels.def"

} // namespace carve::gpu::kernel_list
