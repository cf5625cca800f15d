//===- CarveInterfaces.td - op interfaces of the carve dialect -*- tablegen -*-===//

#ifndef CARVE_INTERFACES_TD
#define CARVE_INTERFACES_TD

include "mlir/IR/OpBase.td"

def Carve_DifferentiableOpInterface : OpInterface<"DifferentiableOpInterface"> {
  let cppNamespace = "::carve";
  let description = [{
    The gradient rule of an op (reverse mode). Given the gradients of the op's
    results (a null value where no gradient reaches a result), the rule builds
    carve ops at the builder's insertion point that compute the gradients of
    the operands, and stores one value per operand in `operandGrads` (null
    where the operand is not differentiable, such as integer indices). The
    autodiff pass (compiler/autodiff) calls the rules in reverse program order
    and sums the contributions of each value. Each rule is checked against
    central finite differences in float64 by tests/unit/GradientTest.cpp.
  }];
  let methods = [
    InterfaceMethod<
      "Builds the operand gradients from the result gradients.",
      "::llvm::LogicalResult", "buildGradients",
      (ins "::mlir::OpBuilder &":$builder,
           "::llvm::ArrayRef<::mlir::Value>":$resultGrads,
           "::llvm::SmallVectorImpl<::mlir::Value> &":$operandGrads)>,
  ];
}

#endif // CARVE_INTERFACES_TD
