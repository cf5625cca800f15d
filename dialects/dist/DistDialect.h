//===- DistDialect.h - the dist dialect: meshes, layouts, collectives -----===//

#ifndef CARVE_DIALECTS_DIST_DISTDIALECT_H
#define CARVE_DIALECTS_DIST_DISTDIALECT_H

#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/Attributes.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/IR/SymbolTable.h"

#include <string>

namespace dist {
/// The kinds of layout a tensor has along one mesh axis.
enum class SbpKind : int64_t { Replicated = 0, Split = 1, PartialSum = 2, PartialMax = 3 };
} // namespace dist

#include "dialects/dist/DistDialect.h.inc"

#define GET_ATTRDEF_CLASSES
#include "dialects/dist/DistAttrs.h.inc"

#define GET_OP_CLASSES
#include "dialects/dist/DistOps.h.inc"

#endif // CARVE_DIALECTS_DIST_DISTDIALECT_H
