//===- CarveDialect.cpp - registration of the carve dialect ---------------===//

#include "dialects/carve/CarveDialect.h"

#include "dialects/carve/CarveOps.h"
#include <cstdio>
#include <cstdlib>

using namespace mlir;

#include "dialects/carve/CarveDialect.cpp.inc"
#include "dialects/carve/CarveInterfaces.cpp.inc"

void carve::CarveDialect::initialize() {
  addOperations<
#define GET_OP_LIST
#include "dialects/carve/CarveOps.cpp.inc"
      >();
}

Operation *carve::CarveDialect::materializeConstant(OpBuilder &builder, Attribute value, Type type,
                                                    Location loc) {
  auto elements = dyn_cast<ElementsAttr>(value);
  if (!elements || elements.getType() != type)
    return nullptr;
  return carve::ConstantOp::create(builder, loc, elements);
}

std::string carve::shortestNumber(double x) {
  char buf[64];
  for (int p = 1; p <= 17; ++p) {
    snprintf(buf, sizeof buf, "%.*g", p, x);
    if (strtod(buf, nullptr) == x)
      break;
  }
  return buf;
}

std::string carve::nodeName(Location loc) {
  if (auto n = dyn_cast<NameLoc>(loc))
    return n.getName().str();
  if (auto f = dyn_cast<FusedLoc>(loc))
    for (Location l : f.getLocations())
      if (auto n = dyn_cast<NameLoc>(l))
        return n.getName().str();
  return "";
}
