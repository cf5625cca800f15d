//===- Passes.h - the plan on the module (carve-set-plan) -----------------===//

#ifndef CARVE_COMPILER_PLAN_PASSES_H
#define CARVE_COMPILER_PLAN_PASSES_H

#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"

#include <cstdint>
#include <string>

namespace carve {

#define GEN_PASS_DECL
#include "compiler/plan/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/plan/Passes.h.inc"

} // namespace carve

#endif // CARVE_COMPILER_PLAN_PASSES_H
