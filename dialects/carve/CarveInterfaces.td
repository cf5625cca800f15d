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

def Carve_PartitionableOpInterface : OpInterface<"PartitionableOpInterface"> {
  let cppNamespace = "::carve";
  let description = [{
    How an op may be split over a mesh axis, as one string in the spirit of
    einsum: one space-separated list of dimension names per operand, `->`, one
    list per result (`()` for a scalar). A plain name splits, and every operand
    and result that has it splits alike; a result without a split name holds
    partial sums when the name is marked `+` (partial maxima with `+max`); `^`
    means the dimension is never split; `~` means the op's kernel handles the
    split itself by communicating over the axis (vocab-parallel cross-entropy);
    `(h d)` is one dimension made of sub-dimensions, so a split of `h` or `d`
    passes through reshapes and transposes, and `(3 c)` one made of three
    sections of `c` (a fused projection). A name that appears only in results
    splits the results while the operands stay whole. Matmul is
    `m k+, k+ n -> m n`. compiler/partition reads these strings; docs/partition.md
    describes them in full. Backward ops use their forward op's names, so a
    split chosen for a forward op carries over.
  }];
  let methods = [
    InterfaceMethod<
      "Returns the op's partition annotation for its operand and result shapes.",
      "std::string", "getPartitionAnnotation", (ins)>,
  ];
}

#endif // CARVE_INTERFACES_TD
