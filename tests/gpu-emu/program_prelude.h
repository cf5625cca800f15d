//===- program_prelude.h - what an emulated generated program includes ----===//
//
// The emulation's counterpart of runtime/include/carve/rt/prelude.h: the
// emulation (cuda_emu.h, first, as `-include cuda_emu.h` puts it) and every
// runtime header a generated CUDA program may include, precompiled by this
// folder's CMakeLists.txt with the flags of carve-runtime-emu.txt, so that
// `carve compile --target cuda` under CARVE_CUDA_EMULATION loads them parsed.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_GPU_EMU_PROGRAM_PRELUDE_H
#define CARVE_GPU_EMU_PROGRAM_PRELUDE_H

#include "cuda_emu.h"

#include "carve/rt/custom.h"
#include "carve/rt/gpu.h"
#include "carve/rt/gpu_fused.cuh"
#include "carve/rt/philox.h"

#include <cmath>
#include <cstdint>
#include <vector>

#endif // CARVE_GPU_EMU_PROGRAM_PRELUDE_H
