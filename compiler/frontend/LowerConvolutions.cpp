//===- LowerConvolutions.cpp - convolution and pooling as gathers and GEMMs -===//
//
// The builders of the pass carve-lower-convolutions (compiler/lower, which
// reads the plan) and of the importer (AveragePool, Resize).
// carve.conv2d and carve.max_pool2d become ops that every later stage already
// knows (im2col written in the dialect):
//
//   windows = gather(reshape(x, [N, C, H*W]), idx, axis 2)   [N, C, K, P]
//
// with idx a constant [K, P] of positions in the image (K = kh*kw kernel
// taps, P = Ho*Wo output pixels: strides, padding and dilation are all in
// it); where a window reaches into the padding, the image is concatenated
// with one element of the padding value (0 for convolution, -inf for max
// pooling), [N, C, H*W + 1], and those taps read it. The pixels are the
// windows' last axis, as they are the image's: each tap's row is a run of
// the image (stride 1), and the GEMM writes NCHW with no transpose. Then
//
//   conv2d:     matmul(weight as [O, C*K], windows as [N, C*K, P]) -> [N, O, P],
//               one GEMM per sample with the weight shared, where the pixels
//               are at least the output channels (P >= O); in the deep layers
//               (P < O) one GEMM over every sample's pixels instead, the
//               windows gathered [N, C, P, K] and transposed to [N*P, C*K],
//               times the weight as [C*K, O], the result transposed back
//               (each GEMM per sample would read the whole weight, and the
//               weight's gradient would sum N products its size); with G > 1 groups
//               [G, Og, Cg*K] x [N, G, Cg*K, P]; with one output channel per
//               group (depthwise) a product summed over the group's channels
//               and taps: [N, G, Cg, K, P] * [G, Cg, K, 1] -> [N, G, P]
//               (elementwise, so tp splits the groups as it splits channels)
//               (+ bias)
//   max_pool2d: reduce_max over K
//   avg_pool2d: reduce_sum over K, divided by the window's count
//
// So autodiff (gather_grad sums the overlapping windows' gradients back),
// the partitioner (channels split column- or row-parallel through the
// matmul, the batch for dp), both targets and the memory plan handle them
// with no kernel of their own. The cost is im2col's: the windows tensor is
// K times the image. (On the CPU target neither the windows nor their
// gradient is ever whole in memory:
// carve-fold-transposes marks the windows' gather, and the runtime's
// matmul_gathered gathers one sample's windows at a time for the forward's
// and the weight gradient's GEMMs; it marks their gather_grad, and the
// runtime's matmul_gather_grad computes the input gradient's windows a
// block at a time.)
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/LowerConvolutions.h"

#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"
#include "dialects/carve/Shapes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"

#include <cmath>
#include <limits>

using namespace mlir;

namespace carve {

namespace {

RankedTensorType typeOf(Value v) { return cast<RankedTensorType>(v.getType()); }

RankedTensorType like(Value v, ArrayRef<int64_t> shape) {
  return RankedTensorType::get(shape, typeOf(v).getElementType());
}

Value reshape(OpBuilder &b, Location loc, Value v, ArrayRef<int64_t> shape) {
  if (typeOf(v).getShape() == shape)
    return v;
  return ReshapeOp::create(b, loc, like(v, shape), v);
}

Value transpose(OpBuilder &b, Location loc, Value v, ArrayRef<int64_t> perm) {
  SmallVector<int64_t> shape;
  for (int64_t p : perm)
    shape.push_back(typeOf(v).getShape()[p]);
  return TransposeOp::create(b, loc, like(v, shape), v, b.getDenseI64ArrayAttr(perm));
}

/// A float scalar constant of `v`'s element type.
Value scalar(OpBuilder &b, Location loc, Value v, double x) {
  auto t = like(v, {});
  return ConstantOp::create(
      b, loc, DenseElementsAttr::get(t, b.getFloatAttr(cast<FloatType>(t.getElementType()), x)));
}

} // namespace

Window::Window(ArrayRef<int64_t> image, ArrayRef<int64_t> kernel, ArrayRef<int64_t> strides,
               ArrayRef<int64_t> pads, ArrayRef<int64_t> dilations)
    : h(image[0]), w(image[1]), kh(kernel[0]), kw(kernel[1]), sh(strides[0]), sw(strides[1]),
      dh(dilations[0]), dw(dilations[1]), top(pads[0]), left(pads[1]) {
  ho = (h + pads[0] + pads[2] - dh * (kh - 1) - 1) / sh + 1;
  wo = (w + pads[1] + pads[3] - dw * (kw - 1) - 1) / sw + 1;
  for (int64_t oy = 0; oy < ho; ++oy)
    for (int64_t ox = 0; ox < wo; ++ox)
      for (int64_t ky = 0; ky < kh; ++ky)
        for (int64_t kx = 0; kx < kw; ++kx) {
          int64_t y = oy * sh - top + ky * dh, x = ox * sw - left + kx * dw;
          bool in = y >= 0 && y < h && x >= 0 && x < w;
          index.push_back(in ? y * w + x : 0);
          inside.push_back(in);
          padded |= !in;
        }
}

int64_t Window::count(int64_t pixel) const {
  int64_t n = 0;
  for (int64_t k = 0; k < kh * kw; ++k)
    n += inside[pixel * kh * kw + k];
  return n;
}

Value gatherWindows(OpBuilder &b, Location loc, Value x, const Window &win, double padValue,
                    bool byTap) {
  ArrayRef<int64_t> s = typeOf(x).getShape();
  const int64_t n = s[0], c = s[1], p = win.pixels(), k = win.taps(), hw = win.h * win.w;
  Value flat = reshape(b, loc, x, {n, c, hw});
  std::vector<int64_t> index = win.index;
  if (win.padded) {
    // The taps in the padding read one element of `padValue` placed after
    // each image: a copy of the image, not a pass over the k-times larger
    // windows (and its gradient a slice).
    auto et = cast<FloatType>(typeOf(x).getElementType());
    auto padType = like(x, {n, c, 1});
    Value pad =
        ConstantOp::create(b, loc, DenseElementsAttr::get(padType, b.getFloatAttr(et, padValue)));
    flat = ConcatOp::create(b, loc, like(x, {n, c, hw + 1}), ValueRange{flat, pad},
                            b.getI64IntegerAttr(2));
    for (size_t q = 0; q < index.size(); ++q)
      if (!win.inside[q])
        index[q] = hw;
  }
  if (!byTap) {
    auto idxType = RankedTensorType::get({p, k}, b.getI64Type());
    Value idx = ConstantOp::create(b, loc, DenseElementsAttr::get(idxType, ArrayRef(index)));
    return GatherOp::create(b, loc, like(x, {n, c, p, k}), flat, idx, b.getI64IntegerAttr(2));
  }
  // Window's order is [P, K]; the windows' is [K, P].
  std::vector<int64_t> tapMajor(index.size());
  for (int64_t q = 0; q < p; ++q)
    for (int64_t t = 0; t < k; ++t)
      tapMajor[t * p + q] = index[q * k + t];
  auto idxType = RankedTensorType::get({k, p}, b.getI64Type());
  Value idx = ConstantOp::create(b, loc, DenseElementsAttr::get(idxType, ArrayRef(tapMajor)));
  return GatherOp::create(b, loc, like(x, {n, c, k, p}), flat, idx, b.getI64IntegerAttr(2));
}

Value lowerConv2d(OpBuilder &b, Conv2dOp conv) {
  Location loc = conv.getLoc();
  Value x = conv.getInput(), w = conv.getWeight();
  ArrayRef<int64_t> xs = typeOf(x).getShape(), ws = typeOf(w).getShape();
  const int64_t n = xs[0], c = xs[1], o = ws[0], g = conv.getGroup();
  const int64_t cg = c / g, og = o / g;
  Window win(xs.drop_front(2), ws.drop_front(2), conv.getStrides(), conv.getPads(),
             conv.getDilations());
  const int64_t p = win.pixels(), k = win.taps();
  Value y;
  if (g == 1 && p < o) {
    // Fewer pixels than output channels (the deep layers): one GEMM over
    // every sample's pixels, [N*P, C*K] x [C*K, O] -> [N, P, O] -> [N, O, P].
    // Its transposes cost the windows and the output once more; one GEMM
    // per sample would read the weight once per sample, and its gradient
    // sum N products of the weight's size.
    Value cols = gatherWindows(b, loc, x, win, 0.0, /*byTap=*/false); // [N, C, P, K]
    Value a = reshape(b, loc, transpose(b, loc, cols, {0, 2, 1, 3}), {n * p, c * k});
    Value wm = transpose(b, loc, reshape(b, loc, w, {o, c * k}), {1, 0});
    y = MatmulOp::create(b, loc, like(x, {n * p, o}), a, wm);
    y = transpose(b, loc, reshape(b, loc, y, {n, p, o}), {0, 2, 1});
  } else {
    Value cols = gatherWindows(b, loc, x, win, 0.0); // [N, C, K, P]
    if (g == 1) {
      // [O, C*K] x [N, C*K, P] -> [N, O, P]: the weight as stored, the
      // windows as gathered, the result NCHW, one GEMM per sample (the
      // weight's gradient sums N products of its size, no more than the
      // windows' size while P >= O).
      Value wm = reshape(b, loc, w, {o, c * k});
      y = MatmulOp::create(b, loc, like(x, {n, o, p}), wm, reshape(b, loc, cols, {n, c * k, p}));
    } else if (og == 1) {
      // One output channel per group (depthwise): each group's windows times
      // its weights, summed over the group's channels and the taps.
      Value a = reshape(b, loc, cols, {n, g, cg, k, p});
      Value wb = reshape(b, loc, w, {g, cg, k, 1});
      Value prod = MulOp::create(b, loc, a.getType(), a, wb);
      y = ReduceSumOp::create(b, loc, like(x, {n, g, p}), prod, b.getDenseI64ArrayAttr({2, 3}),
                              b.getBoolAttr(false));
    } else {
      // Per group: [G, Og, Cg*K] x [N, G, Cg*K, P] -> [N, G, Og, P] = [N, O, P]
      Value a = reshape(b, loc, cols, {n, g, cg * k, p});
      Value wm = reshape(b, loc, w, {g, og, cg * k});
      y = MatmulOp::create(b, loc, like(x, {n, g, og, p}), wm, a);
      y = reshape(b, loc, y, {n, o, p});
    }
  }
  y = reshape(b, loc, y, {n, o, win.ho, win.wo});
  if (Value bias = conv.getBias())
    y = AddOp::create(b, loc, y.getType(), y, reshape(b, loc, bias, {o, 1, 1}));
  return y;
}

Value lowerMaxPool2d(OpBuilder &b, MaxPool2dOp pool) {
  Location loc = pool.getLoc();
  Value x = pool.getInput();
  ArrayRef<int64_t> xs = typeOf(x).getShape();
  Window win(xs.drop_front(2), pool.getKernel(), pool.getStrides(), pool.getPads(), {1, 1});
  Value cols =
      gatherWindows(b, loc, x, win, -std::numeric_limits<double>::infinity()); // [N, C, K, P]
  Value m = ReduceMaxOp::create(b, loc, like(x, {xs[0], xs[1], win.pixels()}), cols,
                                b.getDenseI64ArrayAttr({2}), b.getBoolAttr(false));
  return reshape(b, loc, m, {xs[0], xs[1], win.ho, win.wo});
}

Value buildAvgPool2d(OpBuilder &b, Location loc, Value x, ArrayRef<int64_t> kernel,
                     ArrayRef<int64_t> strides, ArrayRef<int64_t> pads, bool countIncludePad) {
  if (!typeOf(x).getElementType().isF32())
    return Value(); // (the importer's types are f32; it says so before calling)
  ArrayRef<int64_t> xs = typeOf(x).getShape();
  Window win(xs.drop_front(2), kernel, strides, pads, {1, 1});
  const int64_t p = win.pixels();
  Value cols = gatherWindows(b, loc, x, win, 0.0); // [N, C, K, P]
  Value sum = ReduceSumOp::create(b, loc, like(x, {xs[0], xs[1], p}), cols,
                                  b.getDenseI64ArrayAttr({2}), b.getBoolAttr(false));
  // PyTorch divides each window's sum by its count: the kernel's size, or
  // (count_include_pad=False) the taps inside the image.
  Value count;
  if (countIncludePad || !win.padded) {
    count = scalar(b, loc, x, (double)win.taps());
  } else {
    std::vector<float> counts;
    for (int64_t q = 0; q < p; ++q)
      counts.push_back((float)win.count(q));
    auto t = like(x, {p});
    count = ConstantOp::create(b, loc, DenseElementsAttr::get(t, ArrayRef(counts)));
  }
  Value avg = DivOp::create(b, loc, sum.getType(), sum, count);
  return reshape(b, loc, avg, {xs[0], xs[1], win.ho, win.wo});
}

Value buildResize2d(OpBuilder &b, Location loc, Value x, const ResizeSpec &spec,
                    std::string &error) {
  ArrayRef<int64_t> xs = typeOf(x).getShape();
  const bool linear = spec.mode == "linear";
  if (!linear && spec.mode != "nearest") {
    error = "mode '" + spec.mode + "' is not supported (nearest and linear are)";
    return Value();
  }
  // Per axis: the one (nearest) or two (linear) source positions of each
  // output position and the second one's weight, as ONNX defines them.
  struct Axis {
    std::vector<int64_t> at0, at1;
    std::vector<double> w1;
  } axes[2];
  for (int d = 0; d < 2; ++d) {
    const int64_t in = xs[2 + d], out = spec.out[d];
    const double scale = spec.scale[d];
    for (int64_t o = 0; o < out; ++o) {
      double src;
      if (spec.transform == "half_pixel")
        src = (o + 0.5) / scale - 0.5;
      else if (spec.transform == "pytorch_half_pixel")
        src = out > 1 ? (o + 0.5) / scale - 0.5 : 0.0;
      else if (spec.transform == "align_corners")
        src = out > 1 ? (double)o * (double)(in - 1) / (double)(out - 1) : 0.0;
      else if (spec.transform == "asymmetric")
        src = o / scale;
      else {
        error = "coordinate_transformation_mode '" + spec.transform +
                "' is not supported (half_pixel, pytorch_half_pixel, align_corners and "
                "asymmetric are)";
        return Value();
      }
      auto clamp = [&](int64_t i) { return std::clamp<int64_t>(i, 0, in - 1); };
      if (linear) {
        const double f = std::floor(src);
        axes[d].at0.push_back(clamp((int64_t)f));
        axes[d].at1.push_back(clamp((int64_t)f + 1));
        axes[d].w1.push_back(src - f);
        continue;
      }
      double r;
      if (spec.nearestMode == "floor")
        r = std::floor(src);
      else if (spec.nearestMode == "ceil")
        r = std::ceil(src);
      else if (spec.nearestMode == "round_prefer_floor")
        r = src == std::floor(src) + 0.5 ? std::floor(src) : std::round(src);
      else if (spec.nearestMode == "round_prefer_ceil")
        r = std::round(src); // halves away from zero: up for the positive ones
      else {
        error = "nearest_mode '" + spec.nearestMode + "' is not supported";
        return Value();
      }
      if (spec.nearestMode == "round_prefer_ceil" && src < 0 && src == std::floor(src) + 0.5)
        r = std::ceil(src);
      axes[d].at0.push_back(clamp((int64_t)r));
    }
  }
  const int64_t n = xs[0], c = xs[1], h = xs[2], w = xs[3], ho = spec.out[0], wo = spec.out[1];
  const int64_t taps = linear ? 4 : 1, p = ho * wo;
  std::vector<int64_t> index;
  std::vector<float> weights;
  for (int64_t oy = 0; oy < ho; ++oy)
    for (int64_t ox = 0; ox < wo; ++ox) {
      if (!linear) {
        index.push_back(axes[0].at0[oy] * w + axes[1].at0[ox]);
        continue;
      }
      const double wy = axes[0].w1[oy], wx = axes[1].w1[ox];
      for (int ty = 0; ty < 2; ++ty)
        for (int tx = 0; tx < 2; ++tx) {
          const int64_t y = ty ? axes[0].at1[oy] : axes[0].at0[oy];
          const int64_t xi = tx ? axes[1].at1[ox] : axes[1].at0[ox];
          index.push_back(y * w + xi);
          weights.push_back((float)((ty ? wy : 1.0 - wy) * (tx ? wx : 1.0 - wx)));
        }
    }
  Value flat = reshape(b, loc, x, {n, c, h * w});
  auto idxType = RankedTensorType::get({p, taps}, b.getI64Type());
  Value idx = ConstantOp::create(b, loc, DenseElementsAttr::get(idxType, ArrayRef(index)));
  Value src = GatherOp::create(b, loc, like(x, {n, c, p, taps}), flat, idx, b.getI64IntegerAttr(2));
  Value y;
  if (!linear) {
    y = src;
  } else {
    auto wt = like(x, {p, taps});
    Value wv = ConstantOp::create(b, loc, DenseElementsAttr::get(wt, ArrayRef(weights)));
    Value prod = MulOp::create(b, loc, src.getType(), src, wv);
    y = ReduceSumOp::create(b, loc, like(x, {n, c, p}), prod, b.getDenseI64ArrayAttr({3}),
                            b.getBoolAttr(false));
  }
  return reshape(b, loc, y, {n, c, ho, wo});
}

LogicalResult lowerBatchNorm(OpBuilder &b, BatchNormOp bn, int64_t syncReplicas, bool planning,
                             std::string &error) {
  Location loc = bn.getLoc();
  Value x = bn.getInput();
  ArrayRef<int64_t> xs = typeOf(x).getShape();
  const int64_t rank = xs.size(), c = xs[1];
  SmallVector<int64_t> axes = {0}, stat(rank, 1), param(rank - 1, 1);
  for (int64_t d = 2; d < rank; ++d)
    axes.push_back(d);
  stat[1] = c;  // [1, C, 1, ...]
  param[0] = c; // [C, 1, ...]
  int64_t n = 1;
  for (int64_t a : axes)
    n *= xs[a];
  Value rm = bn.getRunningMean(), rv = bn.getRunningVar();
  Value rm4 = reshape(b, loc, rm, stat), rv4 = reshape(b, loc, rv, stat);
  auto statType = like(x, stat);
  Value mean = rm4, var = rv4, xc, batchMean, batchVar;
  // The values per channel the statistics are over (the unbiased
  // variance's count): this replica's, or every replica's under sync.
  const int64_t total = n * std::max<int64_t>(syncReplicas, 1);
  if (bn.getTraining()) {
    if (total < 2 && !planning) {
      error = "batch norm in training mode over one value per channel (the batch times the "
              "image is 1 on this rank): its variance is undefined (PyTorch refuses it too)";
      return failure();
    }
    for (Value s : {rm, rv}) {
      auto arg = dyn_cast<BlockArgument>(s);
      auto fn = arg ? dyn_cast<func::FuncOp>(arg.getOwner()->getParentOp()) : func::FuncOp();
      if (!fn || !fn.getArgAttr(arg.getArgNumber(), kBufferAttr)) {
        error = "its running statistics are not buffers of the model (export with "
                "models/export.py so that they are), so training could not update them";
        return failure();
      }
    }
    // The batch's statistics (a training step) or the running ones (an
    // evaluation's forward, PyTorch's eval mode). Under sync_batch_norm the
    // batch is every data-parallel replica's: the sums over this replica's
    // share are summed over the replicas, the mean first and then the
    // squares about it, as one rank computes them (two all-reduces of C
    // values; one pass of sums and squares would cancel where the mean is
    // large against the spread).
    auto batchMoment = [&](Value v) -> Value {
      if (syncReplicas == 0)
        return ReduceMeanOp::create(b, loc, statType, v, b.getDenseI64ArrayAttr(axes),
                                    b.getBoolAttr(true));
      Value s = ReduceSumOp::create(b, loc, statType, v, b.getDenseI64ArrayAttr(axes),
                                    b.getBoolAttr(true));
      s = ReplicaSumOp::create(b, loc, statType, s);
      return DivOp::create(b, loc, statType, s, scalar(b, loc, x, (double)total));
    };
    batchMean = batchMoment(x);
    mean = EvalSelectOp::create(b, loc, statType, batchMean, rm4);
    xc = SubOp::create(b, loc, x.getType(), x, mean);
    Value sq = MulOp::create(b, loc, x.getType(), xc, xc);
    batchVar = batchMoment(sq);
    var = EvalSelectOp::create(b, loc, statType, batchVar, rv4);

  } else {
    xc = SubOp::create(b, loc, x.getType(), x, mean);
  }
  Value eps = scalar(b, loc, x, (double)bn.getEpsilon().convertToFloat());
  Value inv = RsqrtOp::create(b, loc, statType, AddOp::create(b, loc, statType, var, eps));
  Value y = MulOp::create(b, loc, x.getType(), xc, inv);
  y = MulOp::create(b, loc, x.getType(), y, reshape(b, loc, bn.getScale(), param));
  y = AddOp::create(b, loc, x.getType(), y, reshape(b, loc, bn.getBias(), param));
  bn.getResult().replaceAllUsesWith(y);
  if (!bn.getTraining()) {
    bn.getNewRunningMean().replaceAllUsesWith(rm);
    bn.getNewRunningVar().replaceAllUsesWith(rv);
    return success();
  }
  // Running statistics, as PyTorch updates them: (1 - m) * running + m *
  // batch, the variance unbiased (n / (n - 1)), m PyTorch's momentum. ONNX
  // keeps 1 - m as a float (0.9f for 0.1): m is taken back to 6 digits.
  const double m = std::round((1.0 - (double)bn.getMomentum().convertToFloat()) * 1e6) / 1e6;
  auto chan = cast<RankedTensorType>(rm.getType());
  auto update = [&](Value running, Value batch, double factor) {
    Value keep = MulOp::create(b, loc, chan, running, scalar(b, loc, running, 1.0 - m));
    Value add = MulOp::create(b, loc, chan, reshape(b, loc, batch, {c}),
                              scalar(b, loc, running, m * factor));
    Value next = AddOp::create(b, loc, chan, keep, add);
    AssignOp::create(b, loc, chan, next, running);
    return next;
  };
  Value newMean = update(rm, batchMean, 1.0);
  Value newVar = update(rv, batchVar, (double)total / (double)std::max<int64_t>(total - 1, 1));
  bn.getNewRunningMean().replaceAllUsesWith(newMean);
  bn.getNewRunningVar().replaceAllUsesWith(newVar);
  return success();
}

} // namespace carve
