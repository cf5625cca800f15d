//===- kernel_list.cpp - kernels.def's CPU entries exist in carve::rt -----===//
//
// A compile-time check, no code: every entry runtime/include/carve/rt/
// kernels.def marks `cpu` (and every host and Communicator entry) is declared
// here, since a using-declaration of a name carve::rt lacks does not compile.
// runtime/cuda/kernel_list.cu checks the `cuda` entries against carve::gpu.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/comm.h"
#include "carve/rt/dist.h"
#include "carve/rt/fused.h"
#include "carve/rt/kernels.h"
#include "carve/rt/optim.h"
#include "carve/rt/pipeline.h"

namespace carve::rt::kernel_list {

#define CARVE_RT_ON_CPU_1(name) using carve::rt::name;
#define CARVE_RT_ON_CPU_0(name)
#define CARVE_RT_KERNEL(name, cpu, cuda, summary) CARVE_RT_ON_CPU_##cpu(name)
#define CARVE_RT_HOST(name, summary) using carve::rt::name;
#define CARVE_RT_COMM(name, summary)                                                               \
  static_assert(sizeof(&carve::rt::Communicator::name) > 0, #name " is no Communicator method");
#include "carve/rt/kernels.def"

} // namespace carve::rt::kernel_list
