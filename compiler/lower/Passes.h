//===- Passes.h - lowering the step to runtime calls ----------------------===//

#ifndef CARVE_COMPILER_LOWER_PASSES_H
#define CARVE_COMPILER_LOWER_PASSES_H

#include "mlir/Pass/Pass.h"

namespace carve {

#define GEN_PASS_DECL
#include "compiler/lower/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/lower/Passes.h.inc"

} // namespace carve

#endif // CARVE_COMPILER_LOWER_PASSES_H
