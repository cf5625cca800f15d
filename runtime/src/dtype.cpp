//===- dtype.cpp - element types of the program contract ------------------===//

#include "carve/rt/kernels.h"
#include "carve/rt/program.h"

namespace carve::rt {

int dtypeSize(DType t) {
  switch (t) {
  case DType::F32:
  case DType::I32:
    return 4;
  case DType::F64:
  case DType::I64:
    return 8;
  case DType::Bool:
    return 1;
  case DType::BF16:
  case DType::F16:
    return 2;
  }
  fatal("unknown element type %d", static_cast<int>(t));
}

const char *dtypeName(DType t) {
  switch (t) {
  case DType::F32:
    return "F32";
  case DType::F64:
    return "F64";
  case DType::I64:
    return "I64";
  case DType::I32:
    return "I32";
  case DType::Bool:
    return "BOOL";
  case DType::BF16:
    return "BF16";
  case DType::F16:
    return "F16";
  }
  fatal("unknown element type %d", static_cast<int>(t));
}

} // namespace carve::rt
