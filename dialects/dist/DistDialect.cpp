//===- DistDialect.cpp - the dist dialect: layouts, mesh, verifiers -------===//

#include "dialects/dist/DistDialect.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/DialectImplementation.h"
#include "llvm/ADT/StringSet.h"
#include "llvm/ADT/TypeSwitch.h"

#include <cstdlib>

using namespace mlir;
using namespace dist;

#include "dialects/dist/DistDialect.cpp.inc"

#define GET_ATTRDEF_CLASSES
#include "dialects/dist/DistAttrs.cpp.inc"

#define GET_OP_CLASSES
#include "dialects/dist/DistOps.cpp.inc"

void DistDialect::initialize() {
  addAttributes<
#define GET_ATTRDEF_LIST
#include "dialects/dist/DistAttrs.cpp.inc"
      >();
  addOperations<
#define GET_OP_LIST
#include "dialects/dist/DistOps.cpp.inc"
      >();
}

//===----------------------------------------------------------------------===//
// #dist.sbp<R> | <S d> | <S d x g> | <P sum> | <P max>
//===----------------------------------------------------------------------===//

Attribute SbpAttr::parse(AsmParser &p, Type) {
  MLIRContext *ctx = p.getContext();
  StringRef kind;
  if (p.parseLess() || p.parseKeyword(&kind))
    return {};
  SbpAttr result;
  if (kind == "R") {
    result = replicated(ctx);
  } else if (kind == "S") {
    int64_t dim = 0, groups = 1;
    if (p.parseInteger(dim))
      return {};
    if (succeeded(p.parseOptionalKeyword("x")) && p.parseInteger(groups))
      return {};
    if (dim < 0 || groups < 1) {
      p.emitError(p.getCurrentLocation(), "split needs a dimension >= 0 and groups >= 1");
      return {};
    }
    result = split(ctx, dim, groups);
  } else if (kind == "P") {
    StringRef red;
    if (p.parseKeyword(&red))
      return {};
    if (red != "sum" && red != "max") {
      p.emitError(p.getCurrentLocation(), "partial reduction must be 'sum' or 'max'");
      return {};
    }
    result = partial(ctx, red == "max");
  } else {
    p.emitError(p.getCurrentLocation(), "layout must be R, S or P, got '") << kind << "'";
    return {};
  }
  if (p.parseGreater())
    return {};
  return result;
}

void SbpAttr::print(AsmPrinter &p) const {
  p << "<";
  switch (getKind()) {
  case SbpKind::Replicated:
    p << "R";
    break;
  case SbpKind::Split:
    p << "S " << static_cast<int64_t>(getDim());
    if (static_cast<int64_t>(getGroups()) != 1)
      p << " x " << static_cast<int64_t>(getGroups());
    break;
  case SbpKind::PartialSum:
    p << "P sum";
    break;
  case SbpKind::PartialMax:
    p << "P max";
    break;
  }
  p << ">";
}

std::string SbpAttr::str() const {
  switch (getKind()) {
  case SbpKind::Replicated:
    return "R";
  case SbpKind::Split:
    return "S(" + std::to_string(static_cast<int64_t>(getDim())) +
           (static_cast<int64_t>(getGroups()) != 1
                ? " x " + std::to_string(static_cast<int64_t>(getGroups()))
                : "") +
           ")";
  case SbpKind::PartialSum:
    return "P(sum)";
  case SbpKind::PartialMax:
    return "P(max)";
  }
  return "?";
}

//===----------------------------------------------------------------------===//
// Mesh
//===----------------------------------------------------------------------===//

int64_t MeshOp::axisSize(StringRef axis) {
  for (auto [name, size] : llvm::zip(getAxes(), getShape()))
    if (cast<StringAttr>(name).getValue() == axis)
      return size;
  return -1;
}

LogicalResult MeshOp::verify() {
  if (getAxes().size() != getShape().size())
    return emitOpError("has ") << getAxes().size() << " axes but " << getShape().size() << " sizes";
  llvm::StringSet<> seen;
  for (auto [name, size] : llvm::zip(getAxes(), getShape())) {
    StringRef n = cast<StringAttr>(name).getValue();
    if (!seen.insert(n).second)
      return emitOpError("names axis '") << n << "' twice";
    if (size < 1)
      return emitOpError("axis '") << n << "' has size " << size << "; sizes must be >= 1";
  }
  return success();
}

//===----------------------------------------------------------------------===//
// Collectives
//===----------------------------------------------------------------------===//

namespace {

/// The size of the op's mesh axis, or a failure reported on the op.
FailureOr<int64_t> axisSizeOf(Operation *op, FlatSymbolRefAttr meshRef, StringRef axis) {
  auto mesh = SymbolTable::lookupNearestSymbolFrom<MeshOp>(op, meshRef.getAttr());
  if (!mesh)
    return op->emitOpError("refers to mesh ") << meshRef << ", which is not defined";
  int64_t n = mesh.axisSize(axis);
  if (n < 0)
    return op->emitOpError("refers to axis '")
           << axis << "', which mesh " << meshRef << " does not have";
  return n;
}

LogicalResult checkReduction(Operation *op, StringRef r) {
  if (r != "sum" && r != "max")
    return op->emitOpError("reduction must be \"sum\" or \"max\", got \"") << r << "\"";
  return success();
}

/// Checks that `to` is `from` with dimension `dim` multiplied by `mul` (or
/// divided when `mul` < 0), the element type kept, and that (groups x parts)
/// divides the full dimension.
LogicalResult checkResize(Operation *op, RankedTensorType from, RankedTensorType to, int64_t dim,
                          int64_t groups, int64_t parts, bool grow) {
  if (from.getElementType() != to.getElementType() || from.getRank() != to.getRank())
    return op->emitOpError("result ")
           << to << " must have the input's rank and element type (" << from << ")";
  if (dim < 0 || dim >= from.getRank())
    return op->emitOpError("dimension ") << dim << " is out of range for " << from;
  if (groups < 1)
    return op->emitOpError("groups must be >= 1");
  for (int64_t d = 0; d < from.getRank(); ++d) {
    int64_t expect = from.getDimSize(d);
    if (d == dim) {
      if (!grow && expect % parts != 0)
        return op->emitOpError("dimension ")
               << dim << " of " << from << " does not divide among " << parts << " ranks";
      expect = grow ? expect * parts : expect / parts;
      int64_t full = grow ? expect : from.getDimSize(d);
      if (full % (groups * parts) != 0)
        return op->emitOpError("dimension ") << dim << " (" << full << ") is not a multiple of "
                                             << groups << " groups x " << parts << " ranks";
    }
    if (to.getDimSize(d) != expect)
      return op->emitOpError("result ")
             << to << " does not match " << from << " " << (grow ? "gathered" : "split")
             << " along dimension " << dim << " over " << parts << " ranks";
  }
  return success();
}

RankedTensorType rtt(Value v) { return cast<RankedTensorType>(v.getType()); }

} // namespace

LogicalResult AllReduceOp::verify() {
  if (failed(axisSizeOf(*this, getMeshAttr(), getAxis())) ||
      failed(checkReduction(*this, getReduction())))
    return failure();
  if (getInput().getType() != getResult().getType())
    return emitOpError("result type must equal the input type");
  return success();
}

LogicalResult AllGatherOp::verify() {
  auto n = axisSizeOf(*this, getMeshAttr(), getAxis());
  if (failed(n))
    return failure();
  return checkResize(*this, rtt(getInput()), rtt(getResult()), static_cast<int64_t>(getDim()),
                     static_cast<int64_t>(getGroups()), *n, true);
}

LogicalResult ReduceScatterOp::verify() {
  auto n = axisSizeOf(*this, getMeshAttr(), getAxis());
  if (failed(n) || failed(checkReduction(*this, getReduction())))
    return failure();
  return checkResize(*this, rtt(getInput()), rtt(getResult()), static_cast<int64_t>(getDim()),
                     static_cast<int64_t>(getGroups()), *n, false);
}

LogicalResult LocalSplitOp::verify() {
  auto n = axisSizeOf(*this, getMeshAttr(), getAxis());
  if (failed(n))
    return failure();
  return checkResize(*this, rtt(getInput()), rtt(getResult()), static_cast<int64_t>(getDim()),
                     static_cast<int64_t>(getGroups()), *n, false);
}

LogicalResult AllToAllOp::verify() {
  auto n = axisSizeOf(*this, getMeshAttr(), getAxis());
  if (failed(n))
    return failure();
  if (static_cast<int64_t>(getSrcDim()) == static_cast<int64_t>(getDstDim()))
    return emitOpError("source and destination dimensions must differ");
  RankedTensorType in = rtt(getInput()), out = rtt(getResult());
  if (static_cast<int64_t>(getSrcDim()) < 0 || static_cast<int64_t>(getSrcDim()) >= in.getRank() ||
      static_cast<int64_t>(getDstDim()) < 0 || static_cast<int64_t>(getDstDim()) >= in.getRank())
    return emitOpError("dimensions out of range for ") << in;
  SmallVector<int64_t> full(in.getShape());
  full[static_cast<int64_t>(getSrcDim())] *= *n;
  auto fullType = RankedTensorType::get(full, in.getElementType());
  if (failed(checkResize(*this, in, fullType, static_cast<int64_t>(getSrcDim()),
                         static_cast<int64_t>(getSrcGroups()), *n, true)))
    return failure();
  return checkResize(*this, fullType, out, static_cast<int64_t>(getDstDim()),
                     static_cast<int64_t>(getDstGroups()), *n, false);
}

LogicalResult BroadcastOp::verify() {
  auto n = axisSizeOf(*this, getMeshAttr(), getAxis());
  if (failed(n))
    return failure();
  if (static_cast<int64_t>(getRoot()) < 0 || static_cast<int64_t>(getRoot()) >= *n)
    return emitOpError("root ") << static_cast<int64_t>(getRoot()) << " is not a rank of axis '"
                                << getAxis() << "' (size " << *n << ")";
  if (getInput().getType() != getResult().getType())
    return emitOpError("result type must equal the input type");
  return success();
}

namespace {

/// Send and receive name a peer `offset` steps along the axis: not this rank,
/// and inside the axis.
LogicalResult verifyPeer(Operation *op, FlatSymbolRefAttr mesh, StringRef axis, int64_t offset) {
  auto n = axisSizeOf(op, mesh, axis);
  if (failed(n))
    return failure();
  if (offset == 0 || std::abs(offset) >= *n)
    return op->emitOpError("offset ")
           << offset << " names no other rank on axis '" << axis << "' (size " << *n << ")";
  return success();
}

} // namespace

LogicalResult SendOp::verify() {
  return verifyPeer(*this, getMeshAttr(), getAxis(), static_cast<int64_t>(getOffset()));
}

LogicalResult RecvOp::verify() {
  return verifyPeer(*this, getMeshAttr(), getAxis(), static_cast<int64_t>(getOffset()));
}
