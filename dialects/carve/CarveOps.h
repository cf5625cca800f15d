//===- CarveOps.h - ops of the carve dialect ------------------------------===//

#ifndef CARVE_DIALECTS_CARVE_CARVEOPS_H
#define CARVE_DIALECTS_CARVE_CARVEOPS_H

#include "dialects/carve/CarveDialect.h"
#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/IR/OpImplementation.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

#include "dialects/carve/CarveInterfaces.h.inc"

#define GET_OP_CLASSES
#include "dialects/carve/CarveOps.h.inc"

#endif // CARVE_DIALECTS_CARVE_CARVEOPS_H
