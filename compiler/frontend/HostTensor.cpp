//===- HostTensor.cpp - constant tensors evaluated on the host at import --===//

#include "compiler/frontend/HostTensor.h"
#include "dialects/carve/Shapes.h"

#include "llvm/ADT/APFloat.h"

#include <algorithm>
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

/// `v` rounded to the element type: a constant computed in float32 must get
/// float32's answer at every step (T5's relative position buckets truncate
/// log(x) / log(y) * n to an integer, where double and float32 can land on
/// either side of a bucket boundary).
static double roundTo(ElemKind kind, double v) {
  switch (kind) {
  case ElemKind::F32:
    return (double)(float)v;
  case ElemKind::F16:
  case ElemKind::BF16: {
    llvm::APFloat f(v);
    bool lost;
    f.convert(kind == ElemKind::F16 ? llvm::APFloat::IEEEhalf() : llvm::APFloat::BFloat(),
              llvm::APFloat::rmNearestTiesToEven, &lost);
    f.convert(llvm::APFloat::IEEEdouble(), llvm::APFloat::rmNearestTiesToEven, &lost);
    return f.convertToDouble();
  }
  default:
    return v;
  }
}

static void set(HostTensor &t, int64_t k, double v) {
  if (t.isFloat())
    t.f[k] = roundTo(t.kind, v);
  else
    t.i[k] = (int64_t)v;
}

static void copyElem(HostTensor &dst, int64_t dk, const HostTensor &src, int64_t sk) {
  if (dst.isFloat())
    dst.f[dk] = src.f[sk];
  else
    dst.i[dk] = src.i[sk];
  if (!src.local.empty()) {
    if (dst.local.empty())
      dst.local.assign(dst.size(), 0);
    dst.local[dk] = src.local[sk];
  }
}

/// The float and integer forms of a binary op, resolved once per call so the
/// element loop does no string comparisons (masks can have millions of elements).
struct BinaryFns {
  double (*f)(double, double);
  int64_t (*i)(int64_t, int64_t); ///< null: not defined on integers
};

static BinaryFns binaryFns(StringRef op) {
  using D = double;
  using I = int64_t;
  if (op == "Add") return {[](D x, D y) { return x + y; }, [](I x, I y) { return x + y; }};
  if (op == "Sub") return {[](D x, D y) { return x - y; }, [](I x, I y) { return x - y; }};
  if (op == "Mul") return {[](D x, D y) { return x * y; }, [](I x, I y) { return x * y; }};
  // ONNX integer Div truncates; Mod (fmod=0) takes the divisor's sign.
  if (op == "Div") return {[](D x, D y) { return x / y; }, [](I x, I y) { return x / y; }};
  if (op == "Mod")
    return {[](D x, D y) { return std::fmod(x, y); },
            [](I x, I y) { return ((x % y) + y) % y; }};
  if (op == "Pow")
    return {[](D x, D y) { return std::pow(x, y); },
            [](I x, I y) { return (I)std::pow((D)x, (D)y); }};
  if (op == "Max")
    return {[](D x, D y) { return std::max(x, y); }, [](I x, I y) { return std::max(x, y); }};
  if (op == "Min")
    return {[](D x, D y) { return std::min(x, y); }, [](I x, I y) { return std::min(x, y); }};
  if (op == "Equal")
    return {[](D x, D y) { return (D)(x == y); }, [](I x, I y) { return (I)(x == y); }};
  if (op == "Less")
    return {[](D x, D y) { return (D)(x < y); }, [](I x, I y) { return (I)(x < y); }};
  if (op == "Greater")
    return {[](D x, D y) { return (D)(x > y); }, [](I x, I y) { return (I)(x > y); }};
  if (op == "LessOrEqual")
    return {[](D x, D y) { return (D)(x <= y); }, [](I x, I y) { return (I)(x <= y); }};
  if (op == "GreaterOrEqual")
    return {[](D x, D y) { return (D)(x >= y); }, [](I x, I y) { return (I)(x >= y); }};
  if (op == "And") return {nullptr, [](I x, I y) { return (I)(x && y); }};
  if (op == "Or") return {nullptr, [](I x, I y) { return (I)(x || y); }};
  return {nullptr, nullptr};
}

HostTensor hostBinary(StringRef op, const HostTensor &a, const HostTensor &b) {
  ShapeOrError s = broadcastShapes(a.shape, b.shape);
  if (!s.ok())
    throw HostError(s.error);
  // ONNX gives both operands one type T (Pow alone takes its exponent's
  // type apart): an int64 tensor plus a float one is a malformed model, not
  // a float sum to store in int64.
  if (op != "Pow" && a.kind != b.kind)
    throw HostError("operand element types differ (" + elemKindName((int)a.kind) + " vs " +
                    elemKindName((int)b.kind) + ")");
  bool cmp = op == "Equal" || op == "Less" || op == "Greater" || op == "LessOrEqual" ||
             op == "GreaterOrEqual" || op == "And" || op == "Or";
  bool fl = a.isFloat() || b.isFloat();
  BinaryFns fns = binaryFns(op);
  if (fl ? !fns.f : !fns.i)
    throw HostError("cannot evaluate " + op.str() + (fl ? " on floats" : " on integers"));
  bool intDivision = !fl && (op == "Div" || op == "Mod");
  HostTensor out = like(cmp ? ElemKind::Bool : a.kind, s.shape);
  for (int64_t k = 0; k < out.size(); ++k) {
    int64_t ia = broadcastIndex(k, s.shape, a.shape), ib = broadcastIndex(k, s.shape, b.shape);
    if (fl) {
      set(out, k, fns.f(a.asDouble(ia), b.asDouble(ib)));
      continue;
    }
    if (intDivision && b.i[ib] == 0)
      throw HostError("integer division by zero in a constant expression");
    out.i[k] = fns.i(a.i[ia], b.i[ib]);
  }
  // A local batch size times (or divided by) a constant still scales with
  // the batch: `B * heads` in a [B * heads, T, d] reshape.
  if ((op == "Mul" || op == "Div") && (!a.local.empty() || (op == "Mul" && !b.local.empty())))
    for (int64_t k = 0; k < out.size(); ++k) {
      bool l = a.isLocal(broadcastIndex(k, s.shape, a.shape)) ||
               (op == "Mul" && b.isLocal(broadcastIndex(k, s.shape, b.shape)));
      if (l) {
        if (out.local.empty())
          out.local.assign(out.size(), 0);
        out.local[k] = 1;
      }
    }
  return out;
}

static double (*unaryFn(StringRef op))(double) {
  using D = double;
  if (op == "Neg") return [](D x) { return -x; };
  if (op == "Abs") return [](D x) { return std::fabs(x); };
  if (op == "Sqrt") return [](D x) { return std::sqrt(x); };
  if (op == "Reciprocal") return [](D x) { return 1.0 / x; };
  if (op == "Exp") return [](D x) { return std::exp(x); };
  if (op == "Log") return [](D x) { return std::log(x); };
  if (op == "Floor") return [](D x) { return std::floor(x); };
  if (op == "Ceil") return [](D x) { return std::ceil(x); };
  if (op == "Not") return [](D x) { return (D)(x == 0); };
  if (op == "Relu") return [](D x) { return std::max(x, 0.0); };
  if (op == "Sigmoid") return [](D x) { return 1.0 / (1.0 + std::exp(-x)); };
  if (op == "Tanh") return [](D x) { return std::tanh(x); };
  if (op == "Erf") return [](D x) { return std::erf(x); };
  if (op == "Sin") return [](D x) { return std::sin(x); };
  if (op == "Cos") return [](D x) { return std::cos(x); };
  return nullptr;
}

HostTensor hostUnary(StringRef op, const HostTensor &a) {
  double (*fn)(double) = unaryFn(op);
  if (!fn)
    throw HostError("cannot evaluate " + op.str());
  HostTensor out = like(a.kind, a.shape);
  for (int64_t k = 0; k < a.size(); ++k) {
    double r = fn(a.asDouble(k));
    if (a.isFloat())
      out.f[k] = roundTo(a.kind, r);
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
  for (double &v : out.f)
    v = roundTo(to, v);
  out.local = a.local;
  return out;
}

HostTensor hostWhere(const HostTensor &c, const HostTensor &a, const HostTensor &b) {
  if (a.isFloat() != b.isFloat())
    throw HostError("Where's X and Y have different element types (" +
                    elemKindName((int)a.kind) + " and " + elemKindName((int)b.kind) +
                    "); ONNX requires one type");
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
  for (const HostTensor *p : parts) {
    if (p->kind != parts.front()->kind)
      throw HostError("Concat's inputs have different element types (" +
                      elemKindName((int)parts.front()->kind) + " and " +
                      elemKindName((int)p->kind) + "); ONNX requires one type");
    shapes.push_back(p->shape);
  }
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

HostTensor hostTile(const HostTensor &a, ArrayRef<int64_t> repeats) {
  if (repeats.size() != a.shape.size())
    throw HostError("Tile's repeats have " + std::to_string(repeats.size()) +
                    " entries for an input of rank " + std::to_string(a.shape.size()));
  SmallVector<int64_t> shape;
  for (size_t d = 0; d < repeats.size(); ++d) {
    if (repeats[d] < 0)
      throw HostError("Tile's repeats must not be negative");
    shape.push_back(a.shape[d] * repeats[d]);
  }
  HostTensor out = like(a.kind, shape);
  for (int64_t k = 0; k < out.size(); ++k) {
    // Each output index taken back into the input, dimension by dimension.
    int64_t rest = k, from = 0, stride = 1;
    for (int64_t d = (int64_t)shape.size() - 1; d >= 0; --d) {
      from += (rest % shape[d]) % a.shape[d] * stride;
      rest /= shape[d];
      stride *= a.shape[d];
    }
    copyElem(out, k, a, from);
  }
  return out;
}

HostTensor hostGatherElements(const HostTensor &data, const HostTensor &indices, int64_t axis) {
  if (indices.shape.size() != data.shape.size())
    throw HostError("GatherElements' indices must have the data's rank");
  if (indices.isFloat())
    throw HostError("GatherElements' indices must be integers");
  HostTensor out = like(data.kind, indices.shape);
  const int64_t r = (int64_t)data.shape.size(), n = data.shape[axis];
  for (int64_t k = 0; k < out.size(); ++k) {
    int64_t rest = k, from = 0, stride = 1;
    for (int64_t d = r - 1; d >= 0; --d) {
      int64_t at = rest % indices.shape[d];
      rest /= indices.shape[d];
      if (d == axis) {
        at = indices.i[k] < 0 ? indices.i[k] + n : indices.i[k];
        if (at < 0 || at >= n)
          throw HostError("GatherElements index " + std::to_string(indices.i[k]) +
                          " is outside [" + std::to_string(-n) + ", " + std::to_string(n) + ")");
      } else if (at >= data.shape[d]) {
        throw HostError("GatherElements' indices are larger than the data in dimension " +
                        std::to_string(d));
      }
      from += at * stride;
      stride *= data.shape[d];
    }
    copyElem(out, k, data, from);
  }
  return out;
}

std::vector<int64_t> scatterNDRows(ArrayRef<int64_t> dataShape, const HostTensor &indices,
                                   ArrayRef<int64_t> updatesShape) {
  if (indices.isFloat())
    throw HostError("ScatterND's indices must be integers");
  if (indices.shape.empty())
    throw HostError("ScatterND's indices must have rank >= 1");
  const int64_t k = indices.shape.back(), r = (int64_t)dataShape.size();
  if (k < 1 || k > r)
    throw HostError("ScatterND's index tuples have " + std::to_string(k) +
                    " entries; the data has rank " + std::to_string(r));
  SmallVector<int64_t> want(indices.shape.begin(), indices.shape.end() - 1);
  want.append(dataShape.begin() + k, dataShape.end());
  if (ArrayRef<int64_t>(want) != updatesShape) {
    auto fmt = [](ArrayRef<int64_t> s) {
      std::string t = "[";
      for (size_t d = 0; d < s.size(); ++d)
        t += (d ? ", " : "") + std::to_string(s[d]);
      return t + "]";
    };
    throw HostError("ScatterND's updates are " + fmt(updatesShape) + "; indices " +
                    fmt(indices.shape) + " into data " + fmt(dataShape) + " need " + fmt(want));
  }
  const int64_t rows = k ? indices.size() / k : 0;
  std::vector<int64_t> out(rows);
  for (int64_t u = 0; u < rows; ++u) {
    int64_t p = 0;
    for (int64_t d = 0; d < k; ++d) {
      const int64_t n = dataShape[d], v = indices.i[u * k + d];
      const int64_t at = v < 0 ? v + n : v;
      if (at < 0 || at >= n)
        throw HostError("ScatterND index " + std::to_string(v) + " (tuple " + std::to_string(u) +
                        ", entry " + std::to_string(d) + ") is outside [" + std::to_string(-n) +
                        ", " + std::to_string(n) + ")");
      p = p * n + at;
    }
    out[u] = p;
  }
  return out;
}

HostTensor hostScatterND(const HostTensor &data, const HostTensor &indices,
                         const HostTensor &updates, StringRef reduction) {
  if (data.kind != updates.kind)
    throw HostError("ScatterND's updates must have the data's element type");
  if (reduction != "none" && reduction != "add" && reduction != "mul" && reduction != "max" &&
      reduction != "min")
    throw HostError("ScatterND reduction '" + reduction.str() +
                    "' is not one of none, add, mul, max, min");
  std::vector<int64_t> rows = scatterNDRows(data.shape, indices, updates.shape);
  const int64_t k = indices.shape.back();
  int64_t slice = 1;
  for (size_t d = k; d < data.shape.size(); ++d)
    slice *= data.shape[d];
  if (reduction == "none") {
    std::vector<int64_t> sorted = rows;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      throw HostError("ScatterND with reduction 'none' writes one slice twice (duplicate index "
                      "tuples), which ONNX leaves undefined");
  }
  HostTensor out = data;
  auto combine = [&](auto x, auto y) -> decltype(x) {
    if (reduction == "add")
      return x + y;
    if (reduction == "mul")
      return x * y;
    if (reduction == "max")
      return std::max(x, y);
    if (reduction == "min")
      return std::min(x, y);
    return y;
  };
  for (size_t u = 0; u < rows.size(); ++u)
    for (int64_t e = 0; e < slice; ++e) {
      const int64_t to = rows[u] * slice + e, from = (int64_t)u * slice + e;
      if (out.isFloat())
        out.f[to] = roundTo(out.kind, combine(out.f[to], updates.f[from]));
      else
        out.i[to] = combine(out.i[to], updates.i[from]);
    }
  if (out.kind == ElemKind::Bool)
    for (int64_t &v : out.i)
      v = v != 0;
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
