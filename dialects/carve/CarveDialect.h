//===- CarveDialect.h - the carve dialect ---------------------------------===//

#ifndef CARVE_DIALECTS_CARVE_CARVEDIALECT_H
#define CARVE_DIALECTS_CARVE_CARVEDIALECT_H

#include "mlir/IR/Dialect.h"

#include "dialects/carve/CarveDialect.h.inc"

#endif // CARVE_DIALECTS_CARVE_CARVEDIALECT_H
