//===- Passes.h - passes of the pipeline stage split ---------------------------===//
//
// carve-split-stages (StageSplit.cpp); its description is in Passes.td.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_STAGES_PASSES_H
#define CARVE_COMPILER_STAGES_PASSES_H

#include "compiler/stages/StageSplit.h"
#include "dialects/dist/DistDialect.h"
#include "mlir/Pass/Pass.h"

namespace carve {

#define GEN_PASS_DECL
#include "compiler/stages/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/stages/Passes.h.inc"

} // namespace carve

#endif // CARVE_COMPILER_STAGES_PASSES_H
