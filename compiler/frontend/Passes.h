//===- Passes.h - passes of the frontend ----------------------------------===//

#ifndef CARVE_COMPILER_FRONTEND_PASSES_H
#define CARVE_COMPILER_FRONTEND_PASSES_H

#include "dialects/carve/CarveDialect.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Pass/Pass.h"

namespace carve {

#define GEN_PASS_DECL
#include "compiler/frontend/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/frontend/Passes.h.inc"

} // namespace carve

#endif // CARVE_COMPILER_FRONTEND_PASSES_H
