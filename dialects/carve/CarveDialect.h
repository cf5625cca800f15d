//===- CarveDialect.h - the carve dialect ---------------------------------===//

#ifndef CARVE_DIALECTS_CARVE_CARVEDIALECT_H
#define CARVE_DIALECTS_CARVE_CARVEDIALECT_H

#include "mlir/IR/Dialect.h"

#include "dialects/carve/CarveDialect.h.inc"

#include <string>

namespace carve {
/// The model node an op came from: the name of the innermost NameLoc in
/// `loc` (the importer names every op after its ONNX node; autodiff names
/// backward ops "backward of NODE"), or "" when there is none.
std::string nodeName(mlir::Location loc);
/// `x` in its shortest form that reads back, as Python prints a float's
/// repr ("0.9", "1e-08", "inf"): for messages and comments.
std::string shortestNumber(double x);
} // namespace carve

#endif // CARVE_DIALECTS_CARVE_CARVEDIALECT_H
