//===- Passes.h - passes of the partition stage ---------------------------===//
//
// carve-partition (Partitioner.cpp); its description is in Passes.td.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_PARTITION_PASSES_H
#define CARVE_COMPILER_PARTITION_PASSES_H

#include "compiler/partition/Partitioner.h"
#include "dialects/dist/DistDialect.h"
#include "mlir/Pass/Pass.h"

namespace carve {

#define GEN_PASS_DECL
#include "compiler/partition/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/partition/Passes.h.inc"

} // namespace carve

#endif // CARVE_COMPILER_PARTITION_PASSES_H
