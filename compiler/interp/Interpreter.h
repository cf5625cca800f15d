//===- Interpreter.h - reference evaluation of carve functions on the host ===//
//
// Evaluates a `func.func` of carve ops op by op on host buffers by calling
// the runtime's kernels (runtime/include/carve/rt/kernels.h): double for f64
// tensors, float for f32, and the data-movement kernels for integer and i1
// tensors. It is the reference that the gradient rules are checked against
// (tests/unit/GradientTest.cpp) and is not meant to be fast.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_INTERP_INTERPRETER_H
#define CARVE_COMPILER_INTERP_INTERPRETER_H

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinTypes.h"

#include <string>
#include <vector>

namespace carve {

/// One tensor on the host: the element type and shape, and the elements in
/// row-major order. Storage per element type: f64 as double, f32 as float,
/// i64 as int64_t, i32 as int32_t, i1 as one byte holding 0 or 1.
struct HostValue {
  mlir::RankedTensorType type;
  std::vector<char> bytes;

  /// A value of `type` with every element zero (no bytes for an element type
  /// the interpreter does not support).
  static HostValue zeros(mlir::RankedTensorType type);
  /// A value of `type` from doubles, converted with the semantics of
  /// `carve.cast` (integers truncate toward zero, i1 is `x != 0`). Elements
  /// past the end of `values` stay zero; extra values are ignored.
  static HostValue fromDoubles(mlir::RankedTensorType type, llvm::ArrayRef<double> values);
  /// The elements converted to double (empty for an unsupported type).
  std::vector<double> toDoubles() const;

  int64_t numElements() const { return type.getNumElements(); }
  template <class T> T *data() { return reinterpret_cast<T *>(bytes.data()); }
  template <class T> const T *data() const { return reinterpret_cast<const T *>(bytes.data()); }
};

/// Bytes per element that HostValue stores for `elementType`; 0 when the
/// interpreter does not support the type.
int64_t hostElementBytes(mlir::Type elementType);

/// Evaluates `fn` (one block of carve ops ending in `func.return`) on `args`,
/// which must match the function's argument types. On success fills
/// `results` with one value per returned operand. On failure returns false
/// with one line in `error` naming the op (for example "no reference kernel
/// for carve.conv2d").
bool interpret(mlir::func::FuncOp fn, llvm::ArrayRef<HostValue> args,
               std::vector<HostValue> &results, std::string &error);

} // namespace carve

#endif // CARVE_COMPILER_INTERP_INTERPRETER_H
