//===- LowerConvolutions.h - convolution and pooling as gathers and GEMMs --===//
//
// The pass carve-lower-convolutions (Passes.td) and the builders it shares
// with the importer (AveragePool imports straight to them).
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_FRONTEND_LOWERCONVOLUTIONS_H
#define CARVE_COMPILER_FRONTEND_LOWERCONVOLUTIONS_H

#include "dialects/carve/CarveOps.h"

#include "mlir/IR/Builders.h"

#include <string>
#include <vector>

namespace carve {

/// The sliding windows of a 2-D convolution or pooling over an h x w image:
/// for output pixel (oy, ox) and kernel tap (ky, kx), the image position it
/// reads (row-major, `index`) and whether that lies inside the image
/// (`inside`; outside: padding).
struct Window {
  Window(llvm::ArrayRef<int64_t> image, llvm::ArrayRef<int64_t> kernel,
         llvm::ArrayRef<int64_t> strides, llvm::ArrayRef<int64_t> pads,
         llvm::ArrayRef<int64_t> dilations);
  int64_t pixels() const { return ho * wo; }
  int64_t taps() const { return kh * kw; }
  /// Taps of output pixel `pixel` inside the image.
  int64_t count(int64_t pixel) const;

  int64_t h, w, kh, kw, sh, sw, dh, dw, top, left, ho = 0, wo = 0;
  std::vector<int64_t> index; // [pixels, taps]
  std::vector<bool> inside;   // [pixels, taps]
  bool padded = false;        // some tap lies in the padding
};

/// [N, C, taps, pixels] (or with !byTap [N, C, pixels, taps]): the windows
/// of x [N, C, H, W], `padValue` where a tap lies in the padding.
mlir::Value gatherWindows(mlir::OpBuilder &b, mlir::Location loc, mlir::Value x, const Window &win,
                          double padValue, bool byTap = true);
/// The ops that compute `conv` (or `pool`), built before it.
mlir::Value lowerConv2d(mlir::OpBuilder &b, Conv2dOp conv);
mlir::Value lowerMaxPool2d(mlir::OpBuilder &b, MaxPool2dOp pool);
/// Batch norm as reductions and elementwise ops; in training mode the
/// batch's statistics (carve.eval_select: the running ones in an
/// evaluation) and carve.assign of the updated running statistics to their
/// buffers. With `syncReplicas` > 0 the statistics are over that many
/// data-parallel replicas' shares (carve.replica_sum; sync_batch_norm).
/// Replaces `bn`'s uses (the caller erases it); failure with `error` when
/// the statistics are not buffers or are over one value (unless `planning`:
/// the planner's one-sample import, priced and never run).
mlir::LogicalResult lowerBatchNorm(mlir::OpBuilder &b, BatchNormOp bn, int64_t syncReplicas,
                                   bool planning, std::string &error);
/// ONNX Resize of the two trailing dimensions of x [N, C, H, W] to
/// `out` = {ho, wo}: `mode` "nearest" (with `nearestMode`: floor, ceil,
/// round_prefer_floor, round_prefer_ceil) or "linear" (bilinear), each
/// output coordinate taken back to the input by `transform` (half_pixel,
/// pytorch_half_pixel, align_corners, asymmetric) with `scale` {sh, sw}.
/// Built as a gather of each output pixel's source pixels with a constant
/// index (and, linear, a product with constant weights summed over the
/// four), so the gradient follows. Empty with `error` set on what it lacks.
struct ResizeSpec {
  std::string mode, transform, nearestMode;
  double scale[2];
  int64_t out[2];
};
mlir::Value buildResize2d(mlir::OpBuilder &b, mlir::Location loc, mlir::Value x,
                          const ResizeSpec &spec, std::string &error);
/// ONNX AveragePool (floor mode) of x [N, C, H, W]: each window's sum over
/// the kernel's size or, without `countIncludePad`, over its taps inside the
/// image. Null for a non-f32 x.
mlir::Value buildAvgPool2d(mlir::OpBuilder &b, mlir::Location loc, mlir::Value x,
                           llvm::ArrayRef<int64_t> kernel, llvm::ArrayRef<int64_t> strides,
                           llvm::ArrayRef<int64_t> pads, bool countIncludePad);

} // namespace carve

#endif // CARVE_COMPILER_FRONTEND_LOWERCONVOLUTIONS_H
