//===- ImportConvolution.cpp - convolutions, pooling and resizing ---------===//
//
// The import table's convolution family (ImportOps.cpp sends Conv, MaxPool,
// AveragePool, GlobalAveragePool and Resize here): carve.conv2d and
// carve.max_pool2d, which carve-lower-convolutions rewrites, and the average
// poolings and resizes built at once with the builders they share
// (LowerConvolutions.h).
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Importer.h"
#include "compiler/frontend/LowerConvolutions.h"

#include "dialects/carve/CarveOps.h"

#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/raw_ostream.h"

#include <cmath>

using namespace mlir;
using llvm::ArrayRef;
using llvm::SmallVector;
using llvm::StringRef;

namespace carve::frontend {

void Importer::buildConvolution(const onnx::NodeProto &n) {
  const std::string &op = n.op_type();

  if (op == "Conv" || op == "MaxPool" || op == "AveragePool") {
    Value x = val(0);
    const int64_t rank = shp(x).size();
    if (rank != 3 && rank != 4)
      fail("only 1-D and 2-D " + op + " (on 3-D NCL or 4-D NCHW tensors) is supported, got rank " +
           std::to_string(rank));
    // 1-D: the 2-D op on [N, C, 1, L], its attributes with a leading 1 (0
    // for the pads).
    const bool oneD = rank == 3;
    auto two = [&](SmallVector<int64_t> v, int64_t lead) {
      if (!oneD)
        return v;
      if (v.size() == 2) // pads [begin, end]
        return SmallVector<int64_t>{lead, v[0], lead, v[1]};
      v.insert(v.begin(), lead);
      return v;
    };
    SmallVector<int64_t> kernel;
    if (auto k = attrInts("kernel_shape"))
      kernel = two(SmallVector<int64_t>(k->begin(), k->end()), 1);
    else if (op == "Conv")
      kernel = oneD ? SmallVector<int64_t>{1, shapeOf(1)[2]}
                    : SmallVector<int64_t>{shapeOf(1)[2], shapeOf(1)[3]};
    else
      fail("kernel_shape is required");
    auto ints = [&](StringRef name, SmallVector<int64_t> dflt) {
      auto v = attrInts(name);
      return v ? two(SmallVector<int64_t>(v->begin(), v->end()), name == "pads" ? 0 : 1) : dflt;
    };
    SmallVector<int64_t> strides = ints("strides", {1, 1});
    SmallVector<int64_t> dil = ints("dilations", {1, 1});
    SmallVector<int64_t> pads = ints("pads", {0, 0, 0, 0});
    if (kernel.size() != 2 || strides.size() != 2 || dil.size() != 2 || pads.size() != 4)
      fail("kernel_shape, strides, dilations and pads must have one entry per spatial "
           "dimension (pads two)");
    SmallVector<int64_t> image =
        oneD ? SmallVector<int64_t>{1, shp(x)[2]} : SmallVector<int64_t>{shp(x)[2], shp(x)[3]};
    std::string autoPad = attrString("auto_pad", "NOTSET");
    if (autoPad == "VALID") {
      pads = {0, 0, 0, 0};
    } else if (autoPad == "SAME_UPPER" || autoPad == "SAME_LOWER") {
      for (int i = 0; i < 2; ++i) {
        int64_t in = image[i], out = (in + strides[i] - 1) / strides[i];
        int64_t total =
            std::max<int64_t>(0, (out - 1) * strides[i] + dil[i] * (kernel[i] - 1) + 1 - in);
        pads[i] = autoPad == "SAME_UPPER" ? total / 2 : total - total / 2;
        pads[i + 2] = total - pads[i];
      }
    } else if (autoPad != "NOTSET") {
      fail("auto_pad '" + autoPad + "' is not supported");
    }
    Value x4 = oneD ? reshape(x, {shp(x)[0], shp(x)[1], 1, shp(x)[2]}) : x;
    // A rank's share of a static batch (BatchTracking.cpp): the batch stays
    // in dimension 0 through the 1-D view and back (a share of 1 sample is
    // one of several size-1 dimensions there, which the reshape's own
    // annotation cannot tell apart).
    const BatchAt at = localBatch() ? batchAt(x) : BatchAt{};
    if (oneD && at.dim == 0)
      batchDims[x4] = at;
    // The 2-D result, back to [N, C, L] for 1-D.
    auto result = [&](Value y) {
      if (!oneD)
        return define(0, y);
      Value r = reshape(y, {shp(y)[0], shp(y)[1], shp(y)[3]});
      if (at.dim == 0)
        batchDims[r] = at;
      return define(0, r);
    };
    if (op == "MaxPool" || op == "AveragePool") {
      if (attrInt("ceil_mode", 0))
        fail("ceil_mode=1 is not supported (export with ceil_mode=False)");
      if (dil != SmallVector<int64_t>{1, 1})
        fail("dilated pooling is not supported");
      if (outputUsed(1))
        fail("the Indices output is not supported");
      ShapeOrError s = pool2dShape(shp(x4), kernel, strides, pads);
      expect(s);
      if (op == "AveragePool") {
        if (!eltOf(x).isF32())
          fail("AveragePool takes f32 tensors");
        return result(buildAvgPool2d(b, loc, x4, kernel, strides, pads,
                                     attrInt("count_include_pad", 0) != 0));
      }
      return result(MaxPool2dOp::create(
          b, loc, tensorType(s.shape, eltOf(x)), x4, b.getDenseI64ArrayAttr(kernel),
          b.getDenseI64ArrayAttr(strides), b.getDenseI64ArrayAttr(pads)));
    }
    Value w = val(1);
    if (shp(w).size() != (size_t)rank)
      fail("the weight must have the input's rank " + std::to_string(rank));
    Value w4 = oneD ? reshape(w, {shp(w)[0], shp(w)[1], 1, shp(w)[2]}) : w;
    Value bias = hasInput(2) ? val(2) : Value();
    int64_t group = attrInt("group", 1);
    ShapeOrError s = conv2dShape(shp(x4), shp(w4), strides, pads, dil, group);
    expect(s);
    if (ArrayRef<int64_t>(kernel) != shp(w4).drop_front(2))
      fail("kernel_shape does not match the weight");
    return result(Conv2dOp::create(b, loc, tensorType(s.shape, eltOf(x)), x4, w4, bias,
                                   b.getDenseI64ArrayAttr(strides), b.getDenseI64ArrayAttr(pads),
                                   b.getDenseI64ArrayAttr(dil), b.getI64IntegerAttr(group)));
  }
  if (op == "Resize") {
    // nn.Upsample / F.interpolate (nearest, bilinear) on [N, C, H, W] or
    // [N, C, L]: the scales or sizes are constants; N and C stay.
    Value x = val(0);
    const int64_t rank = shp(x).size();
    if (rank != 3 && rank != 4)
      fail("only 1-D and 2-D Resize (on 3-D NCL or 4-D NCHW tensors) is supported, got rank " +
           std::to_string(rank));
    if (!eltOf(x).isF32())
      fail("Resize takes f32 tensors");
    if (attrInt("antialias", 0) != 0 || attrInt("exclude_outside", 0) != 0)
      fail("antialias and exclude_outside are not supported");
    if (attr("axes"))
      fail("the axes attribute is not supported (scales or sizes for every dimension)");
    if (attrString("keep_aspect_ratio_policy", "stretch") != "stretch")
      fail("keep_aspect_ratio_policy other than stretch is not supported");
    // (X, roi, scales, sizes): carve reads opsets 13 and later.
    const int scalesAt = 2, sizesAt = 3;
    std::vector<double> scales;
    std::vector<int64_t> sizes;
    if (hasInput(scalesAt) && !n.input(scalesAt).empty() &&
        needConst(scalesAt, "scales").size() > 0) {
      const HostTensor &t = needConst(scalesAt, "scales");
      for (int64_t k = 0; k < t.size(); ++k)
        scales.push_back(t.asDouble(k));
    } else if (hasInput(sizesAt) && !n.input(sizesAt).empty()) {
      sizes = needConst(sizesAt, "sizes").toInts();
    } else {
      fail("needs constant scales or sizes");
    }
    if (!scales.empty() ? (int64_t)scales.size() != rank : (int64_t)sizes.size() != rank)
      fail("scales or sizes must have one entry per dimension (" + std::to_string(rank) + ")");
    ArrayRef<int64_t> xs = shp(x);
    const bool oneD = rank == 3;
    ResizeSpec spec;
    spec.mode = attrString("mode", "nearest");
    spec.transform = attrString("coordinate_transformation_mode", "half_pixel");
    spec.nearestMode = attrString("nearest_mode", "round_prefer_floor");
    for (int d = 0; d < 2; ++d) {
      const int64_t k = oneD ? d + 1 : d + 2; // 1-D: the height is a 1 of our own
      const int64_t in = oneD && d == 0 ? 1 : xs[k];
      if (oneD && d == 0) {
        spec.scale[0] = 1.0;
        spec.out[0] = 1;
        continue;
      }
      if (!scales.empty()) {
        if (scales[k] <= 0)
          fail("scales must be positive");
        spec.scale[d] = scales[k];
        spec.out[d] = (int64_t)std::floor((double)in * scales[k]);
      } else {
        if (sizes[k] <= 0)
          fail("sizes must be positive");
        spec.out[d] = sizes[k];
        spec.scale[d] = (double)sizes[k] / (double)in;
      }
      if (spec.out[d] < 1)
        fail("the output would have no elements");
    }
    // The batch and channels stay (under a rank's share of a static batch,
    // sizes may hold the model's batch).
    for (int64_t k = 0; k < 2; ++k) {
      bool same = !scales.empty() ? scales[k] == 1.0
                                  : sizes[k] == xs[k] ||
                                        (k == 0 && localBatch() && sizes[k] == opts.globalBatch);
      if (!same)
        fail("resizing the batch or channel dimension is not supported");
    }
    Value x4 = oneD ? reshape(x, {xs[0], xs[1], 1, xs[2]}) : x;
    const BatchAt at = localBatch() ? batchAt(x) : BatchAt{};
    if (oneD && at.dim == 0)
      batchDims[x4] = at;
    std::string error;
    Value y = buildResize2d(b, loc, x4, spec, error);
    if (!y)
      fail(error);
    if (oneD)
      y = reshape(y, {xs[0], xs[1], spec.out[1]});
    if (at.dim == 0) // (a share of 1 sample is a size-1 dimension among others)
      batchDims[y] = at;
    return define(0, y);
  }
  if (op == "GlobalAveragePool") {
    Value x = val(0);
    int64_t rank = shp(x).size();
    if (rank < 3)
      fail("the input needs rank >= 3");
    SmallVector<int64_t> axes;
    for (int64_t d = 2; d < rank; ++d)
      axes.push_back(d);
    ShapeOrError s = reduceShape(shp(x), axes, true);
    return define(0, ReduceMeanOp::create(b, loc, tensorType(s.shape, eltOf(x)), x,
                                          b.getDenseI64ArrayAttr(axes), b.getBoolAttr(true)));
  }
  failUnsupported();
}

} // namespace carve::frontend
