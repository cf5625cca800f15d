//===- Shapes.h - static shape rules shared by verifiers and the importer -===//
//
// Each rule computes an op's result shape from its operand shapes and
// attributes, or says in one sentence why there is none. The op verifiers and
// the ONNX importer call the same rules, so a model that imports verifies.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_DIALECTS_CARVE_SHAPES_H
#define CARVE_DIALECTS_CARVE_SHAPES_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/SmallVector.h"
#include <string>

namespace carve {

/// A shape, or the reason a rule could not produce one.
struct ShapeOrError {
  llvm::SmallVector<int64_t> shape;
  std::string error;
  bool ok() const { return error.empty(); }
  static ShapeOrError fail(std::string why) {
    ShapeOrError r;
    r.error = std::move(why);
    return r;
  }
};

/// Formats a shape as `[2, 3, 4]` for messages.
std::string formatShape(llvm::ArrayRef<int64_t> shape);

/// NumPy broadcasting of two shapes.
ShapeOrError broadcastShapes(llvm::ArrayRef<int64_t> a, llvm::ArrayRef<int64_t> b);
/// True if `from` broadcasts to exactly `to`.
bool broadcastsTo(llvm::ArrayRef<int64_t> from, llvm::ArrayRef<int64_t> to);
/// numpy.matmul: batch dims broadcast, rank-1 operands are vectors.
ShapeOrError matmulShape(llvm::ArrayRef<int64_t> a, llvm::ArrayRef<int64_t> b);
/// Reduction over sorted, unique, in-range `axes`.
ShapeOrError reduceShape(llvm::ArrayRef<int64_t> in, llvm::ArrayRef<int64_t> axes,
                         bool keepDims);
/// `out[i] = in[perm[i]]`; `perm` must be a permutation of [0, rank).
ShapeOrError transposeShape(llvm::ArrayRef<int64_t> in, llvm::ArrayRef<int64_t> perm);
/// Normalized strided slice (one entry per dimension).
ShapeOrError sliceShape(llvm::ArrayRef<int64_t> in, llvm::ArrayRef<int64_t> starts,
                        llvm::ArrayRef<int64_t> ends, llvm::ArrayRef<int64_t> steps);
/// Concatenation along a non-negative axis.
ShapeOrError concatShape(llvm::ArrayRef<llvm::SmallVector<int64_t>> inputs,
                         int64_t axis);
/// ONNX Gather along a non-negative axis.
ShapeOrError gatherShape(llvm::ArrayRef<int64_t> data, llvm::ArrayRef<int64_t> indices,
                         int64_t axis);
/// NCHW convolution with OIHW weights; pads are [top, left, bottom, right].
ShapeOrError conv2dShape(llvm::ArrayRef<int64_t> in, llvm::ArrayRef<int64_t> weight,
                         llvm::ArrayRef<int64_t> strides, llvm::ArrayRef<int64_t> pads,
                         llvm::ArrayRef<int64_t> dilations, int64_t group);
/// NCHW pooling window, floor mode; pads are [top, left, bottom, right].
ShapeOrError pool2dShape(llvm::ArrayRef<int64_t> in, llvm::ArrayRef<int64_t> kernel,
                         llvm::ArrayRef<int64_t> strides, llvm::ArrayRef<int64_t> pads);
/// Attention core: q [..., Tq, d], k [..., Tk, d], v [..., Tk, dv] -> [..., Tq, dv].
ShapeOrError attentionShape(llvm::ArrayRef<int64_t> q, llvm::ArrayRef<int64_t> k,
                            llvm::ArrayRef<int64_t> v);
/// Cross-entropy: logits [N, C, d...], targets [N, d...].
ShapeOrError crossEntropyShape(llvm::ArrayRef<int64_t> logits,
                               llvm::ArrayRef<int64_t> targets, bool reduce);
/// Number of elements of a static shape; INT64_MAX if it overflows or a
/// dimension is negative.
int64_t numElements(llvm::ArrayRef<int64_t> shape);

} // namespace carve

#endif // CARVE_DIALECTS_CARVE_SHAPES_H
