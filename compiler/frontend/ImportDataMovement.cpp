//===- ImportDataMovement.cpp - reshapes, slices, concats -----------------===//
//
// The data-movement family of the import table: the reshape family (Reshape,
// Unsqueeze, Squeeze, Flatten, with a batch override rescaling constant
// shapes), Transpose, Slice, Split, Concat, Gather and Expand.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Importer.h"

#include "dialects/carve/CarveOps.h"

using namespace mlir;
using llvm::ArrayRef;
using llvm::SmallVector;

namespace carve::frontend {

Importer::BatchAt Importer::rescaleBatch(std::vector<int64_t> &req, ArrayRef<uint8_t> local,
                                         ArrayRef<int64_t> in, Value input, bool allowZero) {
  if (!localBatch() || req.empty() || in.empty() || !input)
    return {};
  const BatchAt at = batchAt(input);
  if (at.dim < 0 || at.dim >= (int64_t)in.size())
    return {}; // the input does not carry the batch: its shape has none to rescale
  const int64_t ratio = opts.globalBatch / opts.batch, B = opts.globalBatch;
  if (std::find(local.begin(), local.end(), 1) != local.end()) {
    // Built from the share's own Shape (`x.flatten(2)` exports as
    // Reshape(x, Concat(Shape(x)[:2], -1))): already the share's sizes. The
    // batch lands in the marked entry when that entry holds it whole.
    int64_t total = 1, known = 1, infer = -1;
    for (int64_t d : in)
      total *= d;
    std::vector<int64_t> reqL(req.size());
    for (size_t k = 0; k < req.size(); ++k) {
      reqL[k] = req[k] == 0 && !allowZero && k < in.size() ? in[k] : req[k];
      if (reqL[k] == -1)
        infer = (int64_t)k;
      else if (reqL[k] <= 0)
        return {};
      else
        known *= reqL[k];
    }
    if (infer >= 0) {
      if (total % known)
        return {};
      reqL[infer] = total / known;
    }
    int64_t P = at.outer, pre = 1;
    for (int64_t k = 0; k < at.dim; ++k)
      P *= in[k];
    const int64_t b = opts.batch;
    for (size_t j = 0; j < reqL.size() && P % pre == 0; ++j) {
      if (j < local.size() && local[j] && (pre * reqL[j]) % (P * b) == 0)
        return BatchAt{(int64_t)j, P / pre};
      pre *= reqL[j];
    }
    return {};
  }
  // The reshape in the model's own (global) sizes.
  std::vector<int64_t> inG(in.begin(), in.end());
  inG[at.dim] *= ratio;
  int64_t total = 1;
  for (int64_t d : inG)
    total *= d;
  std::vector<int64_t> reqG(req.size());
  int64_t known = 1, infer = -1;
  for (size_t k = 0; k < req.size(); ++k) {
    int64_t d = req[k] == 0 && !allowZero && k < inG.size() ? inG[k] : req[k];
    if (d == -1) {
      infer = (int64_t)k;
      continue;
    }
    if (d <= 0)
      return {}; // the reshape itself reports it
    reqG[k] = d;
    known *= d;
  }
  if (infer >= 0) {
    if (total % known != 0)
      return {};
    reqG[infer] = total / known;
  } else if (known != total) {
    return {};
  }
  // The batch spans elements [P, P * B) of each outer index's block: the
  // target dimension whose span holds it is where the batch lands.
  int64_t P = at.outer;
  for (int64_t k = 0; k < at.dim; ++k)
    P *= inG[k];
  int64_t pre = 1;
  for (size_t j = 0; j < reqG.size() && P % pre == 0; ++j) {
    if ((pre * reqG[j]) % (P * B) == 0) {
      if (req[j] > 0)
        req[j] /= ratio; // -1 and 0 take the local size by themselves
      return BatchAt{(int64_t)j, P / pre};
    }
    pre *= reqG[j];
  }
  std::string shape;
  for (size_t k = 0; k < req.size(); ++k)
    shape += (k ? ", " : "") + std::to_string(req[k]);
  fail("the constant target shape [" + shape + "] hard-codes the model's batch of " +
       std::to_string(B) + " in a way that cannot be placed (the batch is dimension " +
       std::to_string(at.dim) + " of the input [" + std::to_string(in.size()) +
       "-d], and no target dimension holds it whole), so one rank's share of " +
       std::to_string(opts.batch) +
       " cannot be imported; export the model with a dynamic "
       "batch (dynamic_axes) and bind it with --set-dim");
}

void Importer::buildReshape(const onnx::NodeProto &n) {
  const std::string &op = n.op_type();

  if (op == "Reshape" || op == "Unsqueeze" || op == "Squeeze" || op == "Flatten") {
    SmallVector<int64_t> in = shapeOf(0), out;
    int64_t rank = in.size();
    // Where the result holds the batch (BatchTracking.cpp), worked out from
    // the node's own meaning: a local batch of 1 is a size-1 dimension that
    // an annotation cannot tell from the others.
    BatchAt res, at = slot(0).value ? batchAt(slot(0).value) : BatchAt{};
    if (op == "Reshape") {
      const HostTensor &target = needConst(1, "shape");
      std::vector<int64_t> req = target.toInts();
      bool allowZero = attrInt("allowzero", 0) != 0;
      res = rescaleBatch(req, target.local, in, slot(0).value, allowZero);
      int64_t infer = -1, known = 1;
      for (size_t k = 0; k < req.size(); ++k) {
        int64_t d = req[k];
        if (d == 0 && !allowZero) {
          if ((int64_t)k >= rank)
            fail("shape entry 0 at position " + std::to_string(k) + " has no input dim");
          d = in[k];
        }
        if (d == -1) {
          if (infer >= 0)
            fail("shape " + formatShape(req) + " has more than one -1");
          infer = k;
          out.push_back(1);
          continue;
        }
        if (d < 0)
          fail("shape " + formatShape(req) + " has a negative entry");
        if (__builtin_mul_overflow(known, d, &known))
          fail("shape " + formatShape(req) + " has more elements than fit in 64 bits");
        out.push_back(d);
      }
      if (infer >= 0) {
        if (known == 0 || numElements(in) % known)
          fail("cannot reshape " + formatShape(in) + " to " + formatShape(req));
        out[infer] = numElements(in) / known;
      }
    } else if (op == "Flatten") {
      int64_t axis = attrInt("axis", 1);
      if (axis < 0)
        axis += rank;
      if (axis < 0 || axis > rank)
        fail("axis is out of range");
      out = {numElements(ArrayRef<int64_t>(in).take_front(axis)),
             numElements(ArrayRef<int64_t>(in).drop_front(axis))};
      if (at.dim >= 0)
        res = at.dim < axis
                  ? BatchAt{0, numElements(ArrayRef<int64_t>(in).take_front(at.dim)) * at.outer}
                  : BatchAt{1, numElements(ArrayRef<int64_t>(in).slice(axis, at.dim - axis)) *
                                   at.outer};
    } else if (op == "Unsqueeze") {
      std::vector<int64_t> axes = needConst(1, "axes").toInts();
      int64_t outRank = rank + axes.size();
      SmallVector<bool> ones(outRank, false);
      for (int64_t a : axes) {
        int64_t na = normAxis(a, outRank);
        if (ones[na])
          fail("axes repeat " + std::to_string(a));
        ones[na] = true;
      }
      for (int64_t d = 0, k = 0; d < outRank; ++d) {
        if (!ones[d] && k == at.dim)
          res = BatchAt{d, at.outer};
        out.push_back(ones[d] ? 1 : in[k++]);
      }
    } else {
      SmallVector<bool> drop(rank, false);
      if (hasInput(1)) {
        for (int64_t a : needConst(1, "axes").toInts()) {
          int64_t na = normAxis(a, rank);
          if (in[na] != 1)
            fail("cannot squeeze dimension " + std::to_string(a) + " of size " +
                 std::to_string(in[na]));
          drop[na] = true;
        }
      } else {
        for (int64_t d = 0; d < rank; ++d)
          drop[d] = in[d] == 1;
      }
      for (int64_t d = 0; d < rank; ++d)
        if (!drop[d]) {
          if (d == at.dim)
            res = BatchAt{(int64_t)out.size(), at.outer};
          out.push_back(in[d]);
        }
    }
    if (numElements(out) != numElements(in))
      fail("cannot reshape " + formatShape(in) + " to " + formatShape(out));
    if (const HostTensor *c = cst(0))
      return defineConst(0, hostReshape(*c, out));
    Value r = reshape(val(0), out);
    if (localBatch() && res.dim >= 0 && r != val(0))
      batchDims[r] = res;
    return define(0, r);
  }
  failUnsupported();
}

void Importer::buildDataMovement(const onnx::NodeProto &n) {
  const std::string &op = n.op_type();

  if (op == "Transpose") {
    Value x = val(0);
    std::vector<int64_t> perm;
    if (auto p = attrInts("perm"))
      perm = *p;
    else
      for (int64_t d = (int64_t)shp(x).size() - 1; d >= 0; --d)
        perm.push_back(d);
    ShapeOrError s = transposeShape(shp(x), perm);
    expect(s);
    bool identity = true;
    for (size_t d = 0; d < perm.size(); ++d)
      identity &= perm[d] == (int64_t)d;
    if (identity)
      return define(0, x);
    return define(0, TransposeOp::create(b, loc, tensorType(s.shape, eltOf(x)), x,
                                         b.getDenseI64ArrayAttr(perm)));
  }
  if (op == "Slice") {
    Value x = val(0);
    SmallVector<int64_t> st, en, sp;
    normalizeSlice(shp(x), st, en, sp);
    for (int64_t s : sp)
      if (s < 0)
        fail("negative slice steps (flips) are supported on constants only");
    ShapeOrError s = sliceShape(shp(x), st, en, sp);
    expect(s);
    if (ArrayRef<int64_t>(s.shape) == shp(x))
      return define(0, x);
    Value y = SliceOp::create(b, loc, tensorType(s.shape, eltOf(x)), x,
                              b.getDenseI64ArrayAttr(st), b.getDenseI64ArrayAttr(en),
                              b.getDenseI64ArrayAttr(sp));
    // Part of the batch (`y[:-1]`, `x[:4]`): each rank would take part of its
    // own share, not the part the model takes of the whole batch. Fine for
    // its shape alone (Shape folds it); any op that reads it is refused.
    if (BatchAt at = localBatch() ? batchAt(x) : BatchAt{};
        at.dim >= 0 && s.shape[at.dim] != shp(x)[at.dim])
      partialBatch[y] = "slice '" + nodeLabel + "' takes part of the batch dimension (" +
                        std::to_string(s.shape[at.dim]) + " of " +
                        std::to_string(shp(x)[at.dim]) + "), so it mixes or drops samples";
    return define(0, y);
  }
  if (op == "Pad") {
    // Constant mode: blocks of the value concatenated before and after along
    // each padded axis (an expanded scalar, so a split passes through), a
    // slice where a pad is negative (cropping). Reflect and edge: a gather
    // along the axis with a constant index of the positions each padded one
    // copies (nn.ReflectionPad2d, nn.ReplicationPad2d); the gradient sums
    // them back. (PyTorch exports circular padding as slices and a concat.)
    Value x = val(0);
    const int64_t rank = shp(x).size();
    std::string mode = attrString("mode", "constant");
    if (mode != "constant" && mode != "reflect" && mode != "edge")
      fail("mode '" + mode + "' is not supported (constant, reflect and edge are)");
    std::vector<int64_t> pads;
    if (opset >= 11)
      pads = needConst(1, "pads").toInts();
    else if (auto p = attrInts("pads"))
      pads = *p;
    std::vector<int64_t> axes;
    if (opset >= 18 && hasInput(3)) {
      for (int64_t a : needConst(3, "axes").toInts())
        axes.push_back(normAxis(a, rank));
    } else {
      for (int64_t a = 0; a < rank; ++a)
        axes.push_back(a);
    }
    if (pads.size() != 2 * axes.size())
      fail("pads has " + std::to_string(pads.size()) + " entries for " +
           std::to_string(axes.size()) + " axes (two per axis)");
    double value = opset >= 11 ? (hasInput(2) ? needConst(2, "constant_value").asDouble(0) : 0.0)
                               : attrFloat("value", 0.0f);
    Type elt = eltOf(x);
    Value y = x;
    for (size_t i = 0; i < axes.size(); ++i) {
      const int64_t a = axes[i], before = pads[i], after = pads[i + axes.size()];
      if (before < 0 || after < 0) {
        SmallVector<int64_t> st(rank, 0), en(shp(y)), sp(rank, 1);
        st[a] = std::max<int64_t>(0, -before);
        en[a] = shp(y)[a] - std::max<int64_t>(0, -after);
        if (st[a] >= en[a])
          fail("the pads crop all of dimension " + std::to_string(a));
        SmallVector<int64_t> cut(shp(y));
        cut[a] = en[a] - st[a];
        y = SliceOp::create(b, loc, tensorType(cut, elt), y, b.getDenseI64ArrayAttr(st),
                            b.getDenseI64ArrayAttr(en), b.getDenseI64ArrayAttr(sp));
      }
      if (mode != "constant" && (before > 0 || after > 0)) {
        const int64_t len = shp(y)[a],
                      out = len + std::max<int64_t>(0, before) + std::max<int64_t>(0, after);
        if (localBatch() && batchAt(x).dim == a)
          fail("padding the batch dimension is not supported");
        if (mode == "reflect" && (std::max(before, after) >= len))
          fail("reflect pads of " + std::to_string(std::max(before, after)) +
               " need a dimension longer than that, got " + std::to_string(len) + " (axis " +
               std::to_string(a) + ")");
        std::vector<int64_t> idx;
        for (int64_t i = -std::max<int64_t>(0, before); (int64_t)idx.size() < out; ++i) {
          int64_t j = i;
          if (mode == "edge")
            j = std::clamp<int64_t>(i, 0, len - 1);
          else // reflect, the edge element not repeated
            j = i < 0 ? -i : i >= len ? 2 * (len - 1) - i : i;
          idx.push_back(j);
        }
        auto it = RankedTensorType::get({out}, b.getI64Type());
        Value iv = ConstantOp::create(b, loc, DenseElementsAttr::get(it, ArrayRef(idx)));
        SmallVector<int64_t> shape(shp(y));
        shape[a] = out;
        y = GatherOp::create(b, loc, tensorType(shape, elt), y, iv, b.getI64IntegerAttr(a));
        if (BatchAt at = localBatch() ? batchAt(x) : BatchAt{}; at.dim >= 0)
          batchDims[y] = at; // along another axis: the batch stays where it is
        continue;
      }
      auto block = [&](int64_t n) {
        SmallVector<int64_t> ones(rank, 1), shape(shp(y));
        shape[a] = n;
        auto t = tensorType(ones, elt);
        Attribute v = isa<FloatType>(elt) ? Attribute(b.getFloatAttr(elt, value))
                                          : Attribute(b.getIntegerAttr(elt, (int64_t)value));
        Value c = ConstantOp::create(b, loc, DenseElementsAttr::get(t, v));
        return ExpandOp::create(b, loc, tensorType(shape, elt), c).getResult();
      };
      SmallVector<Value> parts;
      if (before > 0)
        parts.push_back(block(before));
      parts.push_back(y);
      if (after > 0)
        parts.push_back(block(after));
      if (parts.size() > 1) {
        SmallVector<int64_t> shape(shp(y));
        shape[a] += std::max<int64_t>(0, before) + std::max<int64_t>(0, after);
        y = ConcatOp::create(b, loc, tensorType(shape, elt), parts, b.getI64IntegerAttr(a));
      }
    }
    return define(0, y);
  }
  if (op == "Split") {
    Value x = val(0);
    int64_t rank = shp(x).size(), axis = normAxis(attrInt("axis", 0), rank);
    int64_t dim = shp(x)[axis], outs = n.output_size();
    if (outs < 1)
      fail("Split needs at least one output");
    std::vector<int64_t> sizes;
    if (hasInput(1)) {
      sizes = needConst(1, "split").toInts();
    } else if (auto s = attrInts("split")) {
      sizes = *s;
    } else {
      int64_t parts = attrInt("num_outputs", outs);
      if (parts < 1)
        fail("Split needs at least one output");
      int64_t chunk = (dim + parts - 1) / parts;
      if (opset < 18 && dim % parts)
        fail("dimension " + std::to_string(dim) + " does not split evenly into " +
             std::to_string(parts));
      for (int64_t k = 0; k < parts; ++k)
        sizes.push_back(std::min(chunk, dim - k * chunk));
    }
    if ((int64_t)sizes.size() != outs)
      fail("split sizes " + formatShape(sizes) + " do not match " + std::to_string(outs) +
           " outputs");
    int64_t total = 0;
    for (int64_t s : sizes)
      total += s;
    if (total != dim)
      fail("split sizes " + formatShape(sizes) + " do not add up to " + std::to_string(dim));
    int64_t offset = 0;
    for (int64_t k = 0; k < outs; ++k) {
      SmallVector<int64_t> st(rank, 0), en(shp(x)), sp(rank, 1);
      st[axis] = offset;
      en[axis] = offset + sizes[k];
      offset += sizes[k];
      SmallVector<int64_t> shape(shp(x));
      shape[axis] = sizes[k];
      define(k, SliceOp::create(b, loc, tensorType(shape, eltOf(x)), x, b.getDenseI64ArrayAttr(st),
                                b.getDenseI64ArrayAttr(en), b.getDenseI64ArrayAttr(sp)));
    }
    return;
  }
  if (op == "SplitToSequence") {
    // torch.split under the dynamo exporter: the pieces as a sequence, which
    // SequenceAt reads at constant positions; a Split, in effect.
    Value x = val(0);
    int64_t rank = shp(x).size(), axis = normAxis(attrInt("axis", 0), rank);
    int64_t dim = shp(x)[axis];
    std::vector<int64_t> sizes;
    bool squeeze = false;
    if (hasInput(1)) {
      const HostTensor &split = needConst(1, "split");
      std::vector<int64_t> given = split.toInts();
      if (split.shape.empty()) { // one size: chunks of it, the last the rest
        if (given.empty() || given[0] < 1)
          fail("split size must be positive");
        for (int64_t at = 0; at < dim; at += given[0])
          sizes.push_back(std::min(given[0], dim - at));
      } else {
        sizes = given;
      }
    } else {
      sizes.assign(dim, 1);
      squeeze = attrInt("keepdims", 1) == 0;
    }
    int64_t total = 0;
    for (int64_t sz : sizes) {
      if (sz < 0)
        fail("split sizes " + formatShape(sizes) + " have a negative size");
      total += sz;
    }
    if (total != dim)
      fail("split sizes " + formatShape(sizes) + " do not add up to " + std::to_string(dim));
    std::vector<Value> pieces;
    int64_t offset = 0;
    for (int64_t sz : sizes) {
      SmallVector<int64_t> st(rank, 0), en(shp(x)), sp(rank, 1);
      st[axis] = offset;
      en[axis] = offset + sz;
      offset += sz;
      SmallVector<int64_t> shape(shp(x));
      shape[axis] = sz;
      Value piece = SliceOp::create(b, loc, tensorType(shape, eltOf(x)), x,
                                    b.getDenseI64ArrayAttr(st), b.getDenseI64ArrayAttr(en),
                                    b.getDenseI64ArrayAttr(sp));
      if (squeeze) {
        shape.erase(shape.begin() + axis);
        piece = ReshapeOp::create(b, loc, tensorType(shape, eltOf(x)), piece);
      }
      pieces.push_back(piece);
    }
    if (n.output_size() > 0 && !n.output(0).empty()) {
      Slot s;
      s.sequence = std::move(pieces);
      env[n.output(0)] = s;
    }
    return;
  }
  if (op == "SequenceAt") {
    const Slot &seq = slot(0);
    if (!seq.sequence)
      fail("input '" + n.input(0) + "' is not a sequence carve knows (only SplitToSequence's)");
    std::vector<int64_t> at = needConst(1, "position").toInts();
    if (at.size() != 1)
      fail("position must be one integer");
    int64_t k = at[0], count = (int64_t)seq.sequence->size();
    if (k < -count || k >= count)
      fail("position " + std::to_string(k) + " is outside the sequence of " +
           std::to_string(count));
    return define(0, (*seq.sequence)[k < 0 ? k + count : k]);
  }
  if (op == "Concat") {
    SmallVector<Value> parts;
    SmallVector<SmallVector<int64_t>> shapes;
    for (int k = 0; k < n.input_size(); ++k) {
      if (!hasInput(k))
        continue;
      Value v = val(k);
      if (!parts.empty() && eltOf(v) != eltOf(parts.front()))
        fail("inputs have different element types");
      parts.push_back(v);
      shapes.emplace_back(shp(v));
    }
    if (parts.empty())
      fail("Concat has no inputs");
    int64_t axis = normAxis(attrInt("axis", 0), shp(parts.front()).size());
    ShapeOrError s = concatShape(shapes, axis);
    expect(s);
    if (parts.size() == 1)
      return define(0, parts.front());
    return define(0, ConcatOp::create(b, loc, tensorType(s.shape, eltOf(parts.front())), parts,
                                      b.getI64IntegerAttr(axis)));
  }
  if (op == "Gather") {
    Value data = val(0), idx = val(1);
    if (!eltOf(idx).isInteger(64) && !eltOf(idx).isInteger(32))
      fail("indices must be INT32 or INT64");
    int64_t axis = normAxis(attrInt("axis", 0), shp(data).size());
    ShapeOrError s = gatherShape(shp(data), shp(idx), axis);
    expect(s);
    return define(0, GatherOp::create(b, loc, tensorType(s.shape, eltOf(data)), data, idx,
                                      b.getI64IntegerAttr(axis)));
  }
  if (op == "Tile") {
    // On a computed value (`x.repeat(1, 2)`): [n0, n1, ...] viewed as
    // [1, n0, 1, n1, ...], expanded to [r0, n0, r1, n1, ...] and merged to
    // [r0 n0, r1 n1, ...], which is Tile's order; the gradient sums the copies.
    Value x = val(0);
    std::vector<int64_t> reps = needConst(1, "repeats").toInts();
    ArrayRef<int64_t> xs = shp(x);
    if (reps.size() != xs.size())
      fail("repeats has " + std::to_string(reps.size()) + " entries for an input of rank " +
           std::to_string(xs.size()));
    SmallVector<int64_t> inter, expanded, out;
    for (size_t d = 0; d < xs.size(); ++d) {
      if (reps[d] < 0)
        fail("repeats must not be negative");
      inter.append({1, xs[d]});
      expanded.append({reps[d], xs[d]});
      out.push_back(reps[d] * xs[d]);
    }
    if (ArrayRef<int64_t>(out) == xs)
      return define(0, x);
    BatchAt at = localBatch() ? batchAt(x) : BatchAt{};
    if (at.dim >= 0 && reps[at.dim] != 1)
      fail("Tile repeats the batch dimension, which a rank's share of the batch cannot "
           "compute; plans that split the batch need a model whose samples are independent "
           "here");
    Value y = ExpandOp::create(b, loc, tensorType(expanded, eltOf(x)), reshape(x, inter));
    y = reshape(y, out);
    if (at.dim >= 0)
      batchDims[y] = at;
    return define(0, y);
  }
  if (op == "GatherElements") {
    // Constant indices into a computed value: one gather from the value
    // flattened, at the flat positions the indices address (computed here).
    Value data = val(0);
    const HostTensor *idx = cst(1);
    if (!idx)
      fail("the indices ('" + node->input(1) +
           "') are computed from graph inputs; carve supports GatherElements whose indices "
           "are constants known at import");
    ArrayRef<int64_t> ds = shp(data);
    const int64_t rank = (int64_t)ds.size(), axis = normAxis(attrInt("axis", 0), rank);
    HostTensor at = *idx;
    BatchAt batch = localBatch() ? batchAt(data) : BatchAt{};
    if (batch.dim >= 0) {
      if (batch.dim == axis || batch.outer != 1)
        fail("GatherElements picks along the batch dimension, which a rank's share of the "
             "batch cannot compute");
      if (at.shape.size() == ds.size() && at.shape[batch.dim] == opts.globalBatch) {
        // A static export's indices for the whole batch: the same for every
        // sample, so the first share is every rank's.
        at.shape[batch.dim] = opts.batch;
        int64_t inner = 1, outer = 1;
        for (int64_t d = batch.dim + 1; d < (int64_t)idx->shape.size(); ++d)
          inner *= idx->shape[d];
        for (int64_t d = 0; d < batch.dim; ++d)
          outer *= idx->shape[d];
        at.i.clear();
        for (int64_t o = 0; o < outer; ++o)
          for (int64_t p = 0; p < opts.globalBatch; ++p)
            for (int64_t r = 0; r < inner; ++r) {
              const int64_t v = idx->i[(o * opts.globalBatch + p) * inner + r];
              if (v != idx->i[o * opts.globalBatch * inner + r])
                fail("constant '" + node->input(1) + "' holds the model's batch with values "
                     "that differ between samples; export the model with a dynamic batch "
                     "(dynamic_axes) and bind it with --set-dim");
              if (p < opts.batch)
                at.i.push_back(v);
            }
        at.local.clear();
      }
    }
    std::vector<int64_t> flat;
    try {
      std::vector<int64_t> seq(numElements(ds));
      for (int64_t k = 0; k < (int64_t)seq.size(); ++k)
        seq[k] = k;
      flat = hostGatherElements(HostTensor::ints(ElemKind::I64, ds, std::move(seq)), at, axis).i;
    } catch (const HostError &e) {
      fail(e.what());
    }
    Value src = reshape(data, {numElements(ds)});
    Value pos = materialize(HostTensor::ints(ElemKind::I64, at.shape, flat), "");
    Value y = GatherOp::create(b, loc, tensorType(at.shape, eltOf(data)), src, pos,
                               b.getI64IntegerAttr(0));
    if (batch.dim >= 0)
      batchDims[y] = batch;
    return define(0, y);
  }
  if (op == "Expand") {
    Value x = val(0);
    const HostTensor &target = needConst(1, "shape");
    std::vector<int64_t> shape = target.toInts();
    // A rank's share of a static batch (BatchTracking.cpp): the entry over
    // the operand's batch, or the one that creates the batch where the
    // operand broadcasts (`cls.expand(B, -1, -1)`), is the rank's share.
    // An entry folded from the share's own Shape already is.
    int64_t created = -1;
    const auto marked = std::find(target.local.begin(), target.local.end(), 1);
    if (localBatch() && marked != target.local.end()) {
      if (batchAt(x).dim < 0)
        created = marked - target.local.begin();
    } else if (localBatch()) {
      ArrayRef<int64_t> xs = shp(x);
      const int64_t lead = (int64_t)shape.size() - (int64_t)xs.size();
      const int64_t ratio = opts.globalBatch / opts.batch;
      if (BatchAt at = batchAt(x); at.dim >= 0) {
        int64_t p = at.dim + lead;
        if (p >= 0 && p < (int64_t)shape.size() && shape[p] == xs[at.dim] * ratio)
          shape[p] = xs[at.dim];
      } else if ((created = createdBatchEntry(shape, xs)) >= 0) {
        shape[created] = opts.batch;
      }
    }
    ShapeOrError s = broadcastShapes(shp(x), shape);
    expect(s);
    if (ArrayRef<int64_t>(s.shape) == shp(x))
      return define(0, x);
    Value y = ExpandOp::create(b, loc, tensorType(s.shape, eltOf(x)), x);
    if (created >= 0)
      batchDims[y] = BatchAt{created, 1};
    return define(0, y);
  }
  failUnsupported();
}

} // namespace carve::frontend
