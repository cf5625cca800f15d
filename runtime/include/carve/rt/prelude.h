//===- prelude.h - every runtime header a generated C++ program includes --===//
//
// The runtime's build precompiles this header (build/lib/pch, GCC's
// precompiled headers, with exactly the flags `carve compile` builds
// programs with), and `carve compile` puts it ahead of each generated C++
// source (`-include`), so that the compiler loads the parsed headers instead
// of parsing them again: about 0.4 s of a program's compile and most of
// programs.cpp's on a 2-core machine (docs/performance.md). The generated
// sources still include what they use; where the precompiled header is
// missing or older than a header it holds, carve builds without it.
//
// Every header a generated CPU program (or programs.cpp) may include belongs
// here: one left out is parsed as before, only slower.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_PRELUDE_H
#define CARVE_RT_PRELUDE_H

#include "carve/rt/custom.h"
#include "carve/rt/dist.h"
#include "carve/rt/fused.h"
#include "carve/rt/kernels.h"
#include "carve/rt/optim.h"
#include "carve/rt/philox.h"
#include "carve/rt/pipeline.h"
#include "carve/rt/program.h"

#include <cmath>
#include <cstdint>
#include <vector>

#endif // CARVE_RT_PRELUDE_H
