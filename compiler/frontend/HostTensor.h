//===- HostTensor.h - constant tensors evaluated on the host at import ----===//
//
// PyTorch exports shape arithmetic (Shape, Gather, Concat, Range, Trilu, ...)
// as graph nodes. The importer evaluates every node whose inputs are all
// constant with these small kernels, so that none of that arithmetic reaches
// the carve IR and every shape is static.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_FRONTEND_HOSTTENSOR_H
#define CARVE_COMPILER_FRONTEND_HOSTTENSOR_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/ADT/StringRef.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace carve {

/// Element kinds, numbered as ONNX's TensorProto.DataType.
enum class ElemKind : int {
  F32 = 1, U8 = 2, I8 = 3, I32 = 6, I64 = 7, Bool = 9, F16 = 10, F64 = 11, BF16 = 16
};

bool isFloatKind(ElemKind k);
/// The ONNX name of a data type number (`FLOAT`, `INT64`, ...), for messages.
std::string elemKindName(int onnxType);
/// True if carve can hold tensors of this ONNX data type.
bool isSupportedKind(int onnxType);

/// Thrown by the kernels below on inputs they cannot evaluate; the importer
/// turns it into a diagnostic naming the node.
struct HostError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A dense constant: floats are held as double, integers and booleans as int64.
struct HostTensor {
  ElemKind kind = ElemKind::F32;
  llvm::SmallVector<int64_t> shape;
  std::vector<double> f;
  std::vector<int64_t> i;
  /// Which elements hold a size of one rank's share of a static batch
  /// (BatchTracking.cpp): 1 where the element was folded from the local
  /// batch dimension of a Shape (or scales with it, as `B * heads`); empty
  /// when none does. The data-movement kernels below carry it along.
  std::vector<uint8_t> local;

  static HostTensor ints(ElemKind kind, llvm::ArrayRef<int64_t> shape,
                         std::vector<int64_t> values);
  static HostTensor floats(ElemKind kind, llvm::ArrayRef<int64_t> shape,
                           std::vector<double> values);
  /// A rank-1 int64 tensor.
  static HostTensor vec(llvm::ArrayRef<int64_t> values);

  bool isFloat() const { return isFloatKind(kind); }
  int64_t size() const;
  double asDouble(int64_t k) const { return isFloat() ? f[k] : (double)i[k]; }
  int64_t asInt(int64_t k) const { return isFloat() ? (int64_t)f[k] : i[k]; }
  /// All values as int64 (for shapes, axes and indices).
  std::vector<int64_t> toInts() const;
  /// Whether element `k` holds a size of the local batch share (above).
  bool isLocal(int64_t k) const { return !local.empty() && local[k]; }
};

/// Elementwise binary ops with NumPy broadcasting; `op` is the ONNX op type
/// (Add, Sub, Mul, Div, Pow, Max, Min, Mod, Equal, Less, Greater, LessOrEqual,
/// GreaterOrEqual, And, Or).
HostTensor hostBinary(llvm::StringRef op, const HostTensor &a, const HostTensor &b);
/// Elementwise unary ops (Neg, Abs, Sqrt, Reciprocal, Exp, Log, Floor, Ceil,
/// Not, Relu, Sigmoid, Tanh, Erf, Sin, Cos).
HostTensor hostUnary(llvm::StringRef op, const HostTensor &a);
HostTensor hostCast(const HostTensor &a, ElemKind to);
HostTensor hostWhere(const HostTensor &c, const HostTensor &a, const HostTensor &b);
HostTensor hostReshape(const HostTensor &a, llvm::ArrayRef<int64_t> shape);
HostTensor hostTranspose(const HostTensor &a, llvm::ArrayRef<int64_t> perm);
/// Normalized slice: one start/end/step per dimension, steps may be negative.
HostTensor hostSlice(const HostTensor &a, llvm::ArrayRef<int64_t> starts,
                     llvm::ArrayRef<int64_t> ends, llvm::ArrayRef<int64_t> steps);
HostTensor hostConcat(llvm::ArrayRef<const HostTensor *> parts, int64_t axis);
HostTensor hostGather(const HostTensor &data, const HostTensor &indices, int64_t axis);
HostTensor hostExpand(const HostTensor &a, llvm::ArrayRef<int64_t> shape);
HostTensor hostTrilu(const HostTensor &a, int64_t k, bool upper);
/// ONNX Tile: `a` repeated `repeats[d]` times along each dimension d.
HostTensor hostTile(const HostTensor &a, llvm::ArrayRef<int64_t> repeats);
/// ONNX GatherElements: out[idx] = data[idx with dimension `axis` replaced
/// by indices[idx]] (negative indices count from the end).
HostTensor hostGatherElements(const HostTensor &data, const HostTensor &indices, int64_t axis);
/// ONNX ScatterND's index tuples, checked: for each row of `indices` (all but
/// its last dimension, k = its last size), the position of the slice it
/// addresses in the data viewed as [P, S] (P the product of the data's first k
/// dimensions, S of the rest). Negative entries count from the end.
/// `updatesShape` must be indices.shape[:-1] + dataShape[k:].
std::vector<int64_t> scatterNDRows(llvm::ArrayRef<int64_t> dataShape, const HostTensor &indices,
                                   llvm::ArrayRef<int64_t> updatesShape);
/// ONNX ScatterND: `data` with `updates` written (reduction "none") or
/// combined ("add", "mul", "max", "min") at the slices `indices` address, in
/// the indices' order. Duplicate tuples under "none" are refused: ONNX leaves
/// their result undefined.
HostTensor hostScatterND(const HostTensor &data, const HostTensor &indices,
                         const HostTensor &updates, llvm::StringRef reduction);
HostTensor hostRange(const HostTensor &start, const HostTensor &limit,
                     const HostTensor &delta);
/// Sum/Prod/Max/Min/Mean over sorted axes.
HostTensor hostReduce(llvm::StringRef op, const HostTensor &a,
                      llvm::ArrayRef<int64_t> axes, bool keepDims);

} // namespace carve

#endif // CARVE_COMPILER_FRONTEND_HOSTTENSOR_H
