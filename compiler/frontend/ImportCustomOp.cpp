//===- ImportCustomOp.cpp - custom-domain nodes ---------------------------===//
//
// A node of a custom domain that a --rules file describes becomes
// carve.custom, typed by the rule's shape expressions (docs/custom-ops.md).
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Importer.h"

#include "dialects/carve/CarveOps.h"

using namespace mlir;
using llvm::SmallVector;

namespace carve::frontend {

/// A node of a custom domain that the rules file describes: `carve.custom`,
/// typed by the rule's shape expressions evaluated on the input shapes.
void Importer::buildCustom(const onnx::NodeProto &n, const CustomOpRule &rule) {
  const std::string &from = rule.origin;
  if (n.attribute_size() > 0)
    fail("has attribute '" + n.attribute(0).name() +
         "', but a custom op's kernels receive tensors only (" + from + ")");
  size_t numInputs = rule.operandRanks.size();
  if ((size_t)n.input_size() != numInputs)
    fail(from + ": \"annotation\" '" + rule.annotation + "' describes " +
         std::to_string(numInputs) + " operand(s), the node has " + std::to_string(n.input_size()) +
         " input(s)");
  SmallVector<Value> inputs;
  std::vector<std::vector<int64_t>> shapes;
  for (size_t k = 0; k < numInputs; ++k) {
    if (!hasInput((int)k))
      fail("input " + std::to_string(k) + " is empty; a custom op's inputs are all required");
    Value v = val((int)k);
    if (shp(v).size() != (size_t)rule.operandRanks[k])
      fail(from + ": \"annotation\" '" + rule.annotation + "' gives operand " + std::to_string(k) +
           " " + std::to_string(rule.operandRanks[k]) + " dimension(s), but input '" + n.input(k) +
           "' is " + formatShape(shp(v)));
    inputs.push_back(v);
    shapes.emplace_back(shp(v).begin(), shp(v).end());
  }
  if ((size_t)n.output_size() != rule.outputs.size())
    fail(from + ": \"outputs\" lists " + std::to_string(rule.outputs.size()) +
         " output(s), the node has " + std::to_string(n.output_size()));
  std::string inputShapes;
  for (const std::vector<int64_t> &in : shapes)
    inputShapes += (inputShapes.empty() ? "" : ", ") + formatShape(in);
  SmallVector<Type> types;
  for (size_t k = 0; k < rule.outputs.size(); ++k) {
    const CustomOutput &o = rule.outputs[k];
    SmallVector<int64_t> shape;
    for (size_t d = 0; d < o.shape.size(); ++d) {
      std::string field = "outputs[" + std::to_string(k) + "].shape[" + std::to_string(d) + "]";
      int64_t size;
      std::string error;
      if (!evalShapeExpr(o.shape[d], shapes, size, error))
        fail(from + ": \"" + field + "\": " + error);
      if (size <= 0)
        fail(from + ": \"" + field + "\": \"" + o.shape[d] + "\" is " + std::to_string(size) +
             " for inputs " + inputShapes + "; dimensions must be positive");
      shape.push_back(size);
    }
    Type elt;
    if (o.dtype.compare(0, 2, "in") == 0)
      elt = eltOf(inputs[std::stoi(o.dtype.substr(2))]);
    else if (o.dtype == "f32")
      elt = b.getF32Type();
    else if (o.dtype == "f64")
      elt = b.getF64Type();
    else if (o.dtype == "i64")
      elt = b.getI64Type();
    else if (o.dtype == "i32")
      elt = b.getI32Type();
    else
      elt = b.getI1Type();
    types.push_back(tensorType(shape, elt));
  }
  auto op = CustomOp::create(
      b, loc, types, inputs, b.getStringAttr(rule.domain), b.getStringAttr(rule.type),
      b.getStringAttr(rule.annotation), b.getStringAttr(rule.backwardAnnotation),
      b.getStringAttr(rule.cpu.forward), b.getStringAttr(rule.cpu.backward),
      b.getStringAttr(rule.cuda.forward), b.getStringAttr(rule.cuda.backward));
  for (unsigned k = 0; k < op->getNumResults(); ++k)
    define((int)k, op->getResult(k));
}

} // namespace carve::frontend
