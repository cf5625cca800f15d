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

void Importer::rescaleBatch(std::vector<int64_t> &req, ArrayRef<int64_t> in) const {
  if (opts.batch <= 0 || opts.globalBatch <= opts.batch || opts.globalBatch % opts.batch ||
      req.empty() || in.empty())
    return;
  int64_t ratio = opts.globalBatch / opts.batch;
  bool hasInfer = llvm::is_contained(req, -1);
  if (hasInfer) {
    // view(B, ...): the leading entry is the global batch and so is the input's.
    if (req[0] == opts.globalBatch && in[0] == opts.batch)
      req[0] = opts.batch;
    return;
  }
  // A fully given shape that is exactly `ratio` times too large: the batch is
  // folded into its leading entry (view(B, T, h, d), view(B * T, C)).
  int64_t known = 1;
  for (size_t k = 0; k < req.size(); ++k) {
    int64_t d = req[k] == 0 && k < in.size() ? in[k] : req[k];
    if (d <= 0)
      return;
    known *= d;
  }
  if (known == numElements(in) * ratio && req[0] % ratio == 0)
    req[0] /= ratio;
}

void Importer::buildReshape(const onnx::NodeProto &n) {
  const std::string &op = n.op_type();

  if (op == "Reshape" || op == "Unsqueeze" || op == "Squeeze" || op == "Flatten") {
    SmallVector<int64_t> in = shapeOf(0), out;
    int64_t rank = in.size();
    if (op == "Reshape") {
      std::vector<int64_t> req = needConst(1, "shape").toInts();
      bool allowZero = attrInt("allowzero", 0) != 0;
      rescaleBatch(req, in);
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
      for (int64_t d = 0, k = 0; d < outRank; ++d)
        out.push_back(ones[d] ? 1 : in[k++]);
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
        if (!drop[d])
          out.push_back(in[d]);
    }
    if (numElements(out) != numElements(in))
      fail("cannot reshape " + formatShape(in) + " to " + formatShape(out));
    if (const HostTensor *c = cst(0))
      return defineConst(0, hostReshape(*c, out));
    return define(0, reshape(val(0), out));
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
    return define(0, SliceOp::create(b, loc, tensorType(s.shape, eltOf(x)), x,
                                     b.getDenseI64ArrayAttr(st), b.getDenseI64ArrayAttr(en),
                                     b.getDenseI64ArrayAttr(sp)));
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
  if (op == "Expand") {
    Value x = val(0);
    std::vector<int64_t> shape = needConst(1, "shape").toInts();
    if (opts.batch > 0 && opts.globalBatch > opts.batch && !shape.empty() &&
        shape[0] == opts.globalBatch && shp(x).size() == shape.size() && shp(x)[0] == opts.batch)
      shape[0] = opts.batch;
    ShapeOrError s = broadcastShapes(shp(x), shape);
    expect(s);
    if (ArrayRef<int64_t>(s.shape) == shp(x))
      return define(0, x);
    return define(0, ExpandOp::create(b, loc, tensorType(s.shape, eltOf(x)), x));
  }
  failUnsupported();
}

} // namespace carve::frontend
