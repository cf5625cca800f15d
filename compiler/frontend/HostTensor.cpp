//===- HostTensor.cpp - constant tensors evaluated on the host at import --===//

#include "compiler/frontend/HostTensor.h"
#include "dialects/carve/Shapes.h"

#include <cmath>
#include <numeric>

using llvm::ArrayRef;
using llvm::SmallVector;
using llvm::StringRef;

namespace carve {

bool isFloatKind(ElemKind k) {
  return k == ElemKind::F32 || k == ElemKind::F16 || k == ElemKind::F64 ||
         k == ElemKind::BF16;
}

std::string elemKindName(int t) {
  static const char *names[] = {"UNDEFINED", "FLOAT",  "UINT8",     "INT8",      "UINT16",
                                "INT16",     "INT32",  "INT64",     "STRING",    "BOOL",
                                "FLOAT16",   "DOUBLE", "UINT32",    "UINT64",    "COMPLEX64",
                                "COMPLEX128", "BFLOAT16"};
  if (t >= 0 && t < (int)(sizeof(names) / sizeof(names[0])))
    return names[t];
  return "type " + std::to_string(t);
}

bool isSupportedKind(int t) {
  switch ((ElemKind)t) {
  case ElemKind::F32: case ElemKind::U8: case ElemKind::I8: case ElemKind::I32:
  case ElemKind::I64: case ElemKind::Bool: case ElemKind::F16: case ElemKind::F64:
  case ElemKind::BF16:
    return true;
  }
  return false;
}

int64_t HostTensor::size() const { return numElements(shape); }

HostTensor HostTensor::ints(ElemKind kind, ArrayRef<int64_t> shape,
                            std::vector<int64_t> values) {
  HostTensor t;
  t.kind = kind;
  t.shape.assign(shape.begin(), shape.end());
  t.i = std::move(values);
  if ((int64_t)t.i.size() != t.size())
    throw HostError("constant holds " + std::to_string(t.i.size()) +
                    " values for shape " + formatShape(shape));
  return t;
}

HostTensor HostTensor::floats(ElemKind kind, ArrayRef<int64_t> shape,
                              std::vector<double> values) {
  HostTensor t;
  t.kind = kind;
  t.shape.assign(shape.begin(), shape.end());
  t.f = std::move(values);
  if ((int64_t)t.f.size() != t.size())
    throw HostError("constant holds " + std::to_string(t.f.size()) +
                    " values for shape " + formatShape(shape));
  return t;
}

HostTensor HostTensor::vec(ArrayRef<int64_t> values) {
  return ints(ElemKind::I64, {(int64_t)values.size()},
              std::vector<int64_t>(values.begin(), values.end()));
}

std::vector<int64_t> HostTensor::toInts() const {
  std::vector<int64_t> out(size());
  for (int64_t k = 0; k < size(); ++k)
    out[k] = asInt(k);
  return out;
}

/// Row-major strides of a shape.
static SmallVector<int64_t> stridesOf(ArrayRef<int64_t> shape) {
  SmallVector<int64_t> s(shape.size(), 1);
  for (int64_t d = (int64_t)shape.size() - 2; d >= 0; --d)
    s[d] = s[d + 1] * shape[d + 1];
  return s;
}

/// Maps a flat index of `outShape` to the flat index of a tensor of `inShape`
/// broadcast to it.
static int64_t broadcastIndex(int64_t flat, ArrayRef<int64_t> outShape,
                              ArrayRef<int64_t> inShape) {
  int64_t idx = 0, stride = 1;
  for (int64_t d = (int64_t)outShape.size() - 1, e = (int64_t)inShape.size() - 1; e >= 0;
       --d, --e) {
    int64_t coord = flat % outShape[d];
    flat /= outShape[d];
    if (inShape[e] != 1)
      idx += coord * stride;
    stride *= inShape[e];
  }
  return idx;
}

static HostTensor like(ElemKind kind, ArrayRef<int64_t> shape) {
  HostTensor t;
  t.kind = kind;
  t.shape.assign(shape.begin(), shape.end());
  if (isFloatKind(kind))
    t.f.assign(t.size(), 0.0);
  else
    t.i.assign(t.size(), 0);
  return t;
}

static void set(HostTensor &t, int64_t k, double v) {
  if (t.isFloat())
    t.f[k] = v;
  else
    t.i[k] = (int64_t)v;
}

static void copyElem(HostTensor &dst, int64_t dk, const HostTensor &src, int64_t sk) {
  if (dst.isFloat())
    dst.f[dk] = src.f[sk];
  else
    dst.i[dk] = src.i[sk];
}

HostTensor hostBinary(StringRef op, const HostTensor &a, const HostTensor &b) {
  ShapeOrError s = broadcastShapes(a.shape, b.shape);
  if (!s.ok())
    throw HostError(s.error);
  bool cmp = op == "Equal" || op == "Less" || op == "Greater" || op == "And" || op == "Or";
  HostTensor out = like(cmp ? ElemKind::Bool : a.kind, s.shape);
  bool fl = a.isFloat() || b.isFloat();
  for (int64_t k = 0; k < out.size(); ++k) {
    int64_t ia = broadcastIndex(k, s.shape, a.shape), ib = broadcastIndex(k, s.shape, b.shape);
    if (fl) {
      double x = a.asDouble(ia), y = b.asDouble(ib), r;
      if (op == "Add") r = x + y;
      else if (op == "Sub") r = x - y;
      else if (op == "Mul") r = x * y;
      else if (op == "Div") r = x / y;
      else if (op == "Pow") r = std::pow(x, y);
      else if (op == "Max") r = std::max(x, y);
      else if (op == "Min") r = std::min(x, y);
      else if (op == "Mod") r = std::fmod(x, y);
      else if (op == "Equal") r = x == y;
      else if (op == "Less") r = x < y;
      else if (op == "Greater") r = x > y;
      else throw HostError("cannot evaluate " + op.str() + " on floats");
      set(out, k, r);
      continue;
    }
    int64_t x = a.i[ia], y = b.i[ib], r;
    if (op == "Add") r = x + y;
    else if (op == "Sub") r = x - y;
    else if (op == "Mul") r = x * y;
    else if (op == "Div" || op == "Mod") {
      if (y == 0)
        throw HostError("integer division by zero in a constant expression");
      // ONNX integer Div truncates; Mod (fmod=0) takes the divisor's sign.
      r = op == "Div" ? x / y : ((x % y) + y) % y;
    } else if (op == "Pow") r = (int64_t)std::pow((double)x, (double)y);
    else if (op == "Max") r = std::max(x, y);
    else if (op == "Min") r = std::min(x, y);
    else if (op == "Equal") r = x == y;
    else if (op == "Less") r = x < y;
    else if (op == "Greater") r = x > y;
    else if (op == "And") r = x && y;
    else if (op == "Or") r = x || y;
    else throw HostError("cannot evaluate " + op.str() + " on integers");
    out.i[k] = r;
  }
  return out;
}

HostTensor hostUnary(StringRef op, const HostTensor &a) {
  HostTensor out = like(a.kind, a.shape);
  for (int64_t k = 0; k < a.size(); ++k) {
    double x = a.asDouble(k), r;
    if (op == "Neg") r = -x;
    else if (op == "Abs") r = std::fabs(x);
    else if (op == "Sqrt") r = std::sqrt(x);
    else if (op == "Reciprocal") r = 1.0 / x;
    else if (op == "Exp") r = std::exp(x);
    else if (op == "Log") r = std::log(x);
    else if (op == "Floor") r = std::floor(x);
    else if (op == "Ceil") r = std::ceil(x);
    else if (op == "Not") r = x == 0;
    else if (op == "Relu") r = std::max(x, 0.0);
    else if (op == "Sigmoid") r = 1.0 / (1.0 + std::exp(-x));
    else if (op == "Tanh") r = std::tanh(x);
    else if (op == "Erf") r = std::erf(x);
    else if (op == "Sin") r = std::sin(x);
    else if (op == "Cos") r = std::cos(x);
    else throw HostError("cannot evaluate " + op.str());
    if (a.isFloat())
      out.f[k] = r;
    else
      out.i[k] = a.kind == ElemKind::Bool ? (int64_t)(r != 0) : (int64_t)r;
  }
  return out;
}

HostTensor hostCast(const HostTensor &a, ElemKind to) {
  HostTensor out = like(to, a.shape);
  for (int64_t k = 0; k < a.size(); ++k) {
    if (out.isFloat())
      out.f[k] = a.asDouble(k);
    else if (to == ElemKind::Bool)
      out.i[k] = a.asDouble(k) != 0;
    else
      out.i[k] = a.isFloat() ? (int64_t)std::trunc(a.f[k]) : a.i[k];
  }
  if (to == ElemKind::F32)
    for (double &v : out.f)
      v = (float)v;
  return out;
}

HostTensor hostWhere(const HostTensor &c, const HostTensor &a, const HostTensor &b) {
  ShapeOrError s = broadcastShapes(a.shape, b.shape);
  if (s.ok())
    s = broadcastShapes(c.shape, s.shape);
  if (!s.ok())
    throw HostError(s.error);
  HostTensor out = like(a.kind, s.shape);
  for (int64_t k = 0; k < out.size(); ++k) {
    bool take = c.asInt(broadcastIndex(k, s.shape, c.shape)) != 0;
    const HostTensor &src = take ? a : b;
    copyElem(out, k, src, broadcastIndex(k, s.shape, src.shape));
  }
  return out;
}

HostTensor hostReshape(const HostTensor &a, ArrayRef<int64_t> shape) {
  if (numElements(shape) != a.size())
    throw HostError("cannot reshape " + formatShape(a.shape) + " to " + formatShape(shape));
  HostTensor out = a;
  out.shape.assign(shape.begin(), shape.end());
  return out;
}

HostTensor hostTranspose(const HostTensor &a, ArrayRef<int64_t> perm) {
  ShapeOrError s = transposeShape(a.shape, perm);
  if (!s.ok())
    throw HostError(s.error);
  HostTensor out = like(a.kind, s.shape);
  SmallVector<int64_t> inStrides = stridesOf(a.shape);
  for (int64_t k = 0; k < out.size(); ++k) {
    int64_t rem = k, src = 0;
    for (int64_t d = (int64_t)perm.size() - 1; d >= 0; --d) {
      src += (rem % s.shape[d]) * inStrides[perm[d]];
      rem /= s.shape[d];
    }
    copyElem(out, k, a, src);
  }
  return out;
}

HostTensor hostSlice(const HostTensor &a, ArrayRef<int64_t> starts, ArrayRef<int64_t> ends,
                     ArrayRef<int64_t> steps) {
  size_t rank = a.shape.size();
  SmallVector<int64_t> outShape(rank);
  for (size_t d = 0; d < rank; ++d) {
    if (steps[d] == 0)
      throw HostError("slice step is 0");
    int64_t n = steps[d] > 0 ? (ends[d] - starts[d] + steps[d] - 1) / steps[d]
                             : (starts[d] - ends[d] - steps[d] - 1) / -steps[d];
    outShape[d] = std::max<int64_t>(n, 0);
  }
  HostTensor out = like(a.kind, outShape);
  SmallVector<int64_t> inStrides = stridesOf(a.shape);
  for (int64_t k = 0; k < out.size(); ++k) {
    int64_t rem = k, src = 0;
    for (int64_t d = (int64_t)rank - 1; d >= 0; --d) {
      src += (starts[d] + (rem % outShape[d]) * steps[d]) * inStrides[d];
      rem /= outShape[d];
    }
    copyElem(out, k, a, src);
  }
  return out;
}

HostTensor hostConcat(ArrayRef<const HostTensor *> parts, int64_t axis) {
  SmallVector<SmallVector<int64_t>> shapes;
  for (const HostTensor *p : parts)
    shapes.push_back(p->shape);
  ShapeOrError s = concatShape(shapes, axis);
  if (!s.ok())
    throw HostError(s.error);
  HostTensor out = like(parts.front()->kind, s.shape);
  int64_t outer = numElements(ArrayRef<int64_t>(s.shape).take_front(axis));
  int64_t k = 0;
  for (int64_t o = 0; o < outer; ++o)
    for (const HostTensor *p : parts) {
      int64_t inner = numElements(ArrayRef<int64_t>(p->shape).drop_front(axis));
      for (int64_t j = 0; j < inner; ++j)
        copyElem(out, k++, *p, o * inner + j);
    }
  return out;
}

HostTensor hostGather(const HostTensor &data, const HostTensor &indices, int64_t axis) {
  ShapeOrError s = gatherShape(data.shape, indices.shape, axis);
  if (!s.ok())
    throw HostError(s.error);
  HostTensor out = like(data.kind, s.shape);
  int64_t outer = numElements(ArrayRef<int64_t>(data.shape).take_front(axis));
  int64_t inner = numElements(ArrayRef<int64_t>(data.shape).drop_front(axis + 1));
  int64_t dim = data.shape[axis], k = 0;
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t n = 0; n < indices.size(); ++n) {
      int64_t idx = indices.asInt(n);
      if (idx < 0)
        idx += dim;
      if (idx < 0 || idx >= dim)
        throw HostError("gather index " + std::to_string(indices.asInt(n)) +
                        " is out of range for a dimension of " + std::to_string(dim));
      for (int64_t j = 0; j < inner; ++j)
        copyElem(out, k++, data, (o * dim + idx) * inner + j);
    }
  return out;
}

HostTensor hostExpand(const HostTensor &a, ArrayRef<int64_t> shape) {
  ShapeOrError s = broadcastShapes(a.shape, shape);
  if (!s.ok())
    throw HostError(s.error);
  HostTensor out = like(a.kind, s.shape);
  for (int64_t k = 0; k < out.size(); ++k)
    copyElem(out, k, a, broadcastIndex(k, s.shape, a.shape));
  return out;
}

HostTensor hostTrilu(const HostTensor &a, int64_t k, bool upper) {
  if (a.shape.size() < 2)
    throw HostError("Trilu needs rank >= 2");
  HostTensor out = a;
  int64_t rows = a.shape[a.shape.size() - 2], cols = a.shape.back();
  for (int64_t n = 0; n < a.size(); ++n) {
    int64_t c = n % cols, r = (n / cols) % rows;
    bool keep = upper ? c - r >= k : c - r <= k;
    if (!keep)
      set(out, n, 0);
  }
  return out;
}

HostTensor hostRange(const HostTensor &start, const HostTensor &limit,
                     const HostTensor &delta) {
  double s = start.asDouble(0), l = limit.asDouble(0), d = delta.asDouble(0);
  if (d == 0)
    throw HostError("Range delta is 0");
  int64_t n = std::max<int64_t>((int64_t)std::ceil((l - s) / d), 0);
  HostTensor out = like(start.kind, {n});
  for (int64_t k = 0; k < n; ++k)
    set(out, k, s + k * d);
  return out;
}

HostTensor hostReduce(StringRef op, const HostTensor &a, ArrayRef<int64_t> axes,
                      bool keepDims) {
  ShapeOrError s = reduceShape(a.shape, axes, true);
  if (!s.ok())
    throw HostError(s.error);
  HostTensor out = like(a.kind, s.shape);
  std::vector<double> acc(out.size(), op == "ReduceProd" ? 1.0
                                      : op == "ReduceMax" ? -INFINITY
                                      : op == "ReduceMin" ? INFINITY
                                                          : 0.0);
  for (int64_t k = 0; k < a.size(); ++k) {
    int64_t rem = k, dst = 0, stride = 1;
    for (int64_t d = (int64_t)a.shape.size() - 1; d >= 0; --d) {
      int64_t c = rem % a.shape[d];
      rem /= a.shape[d];
      if (s.shape[d] != 1)
        dst += c * stride;
      stride *= s.shape[d];
    }
    double x = a.asDouble(k);
    if (op == "ReduceProd") acc[dst] *= x;
    else if (op == "ReduceMax") acc[dst] = std::max(acc[dst], x);
    else if (op == "ReduceMin") acc[dst] = std::min(acc[dst], x);
    else acc[dst] += x;
  }
  int64_t count = a.size() / std::max<int64_t>(out.size(), 1);
  for (int64_t k = 0; k < out.size(); ++k)
    set(out, k, op == "ReduceMean" ? acc[k] / count : acc[k]);
  if (!keepDims)
    out.shape = reduceShape(a.shape, axes, false).shape;
  return out;
}

} // namespace carve
