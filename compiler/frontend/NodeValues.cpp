//===- NodeValues.cpp - a node's inputs, outputs, attributes --------------===//
//
// The importer's view of the node at hand: its inputs as SSA values or
// constants (buffers become arguments on first use, constants are
// materialized), its outputs, its attributes, and the axis, reduce and slice
// arguments that host folding and building read alike.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Importer.h"

#include "dialects/carve/CarveOps.h"

#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/DialectResourceBlobManager.h"

using namespace mlir;
using llvm::ArrayRef;
using llvm::SmallVector;
using llvm::StringRef;

namespace carve::frontend {

/// Constants with more elements than this print as named resource blobs at
/// the end of the module instead of inline, so the IR stays readable.
constexpr int64_t kInlineConstantLimit = 64;

//===----------------------------------------------------------------------===//
// Input access
//===----------------------------------------------------------------------===//

bool Importer::hasInput(int k) const { return k < node->input_size() && !node->input(k).empty(); }

Slot &Importer::slot(int k) {
  if (!hasInput(k))
    fail("input " + std::to_string(k) + " is missing (the node has " +
         std::to_string(node->input_size()) + ")");
  const std::string &name = node->input(k);
  auto it = env.find(name);
  if (it == env.end())
    fail("input '" + name +
         "' is not produced by any earlier node, graph input or initializer (a missing "
         "initializer, or nodes out of topological order)");
  return it->second;
}

const HostTensor *Importer::cst(int k) {
  Slot &s = slot(k);
  if (s.constant)
    return &*s.constant;
  if (s.isParam)
    return nullptr;
  if (s.init) {
    s.constant = loadTensor(*s.init, "initializer '" + s.init->name() + "'");
    return &*s.constant;
  }
  return nullptr;
}

const HostTensor &Importer::needConst(int k, StringRef what) {
  if (!hasInput(k))
    fail(what.str() + " (input " + std::to_string(k) + ") is missing");
  const HostTensor *t = cst(k);
  if (!t)
    fail(what.str() + " ('" + node->input(k) +
         "') must be a constant known at import; carve compiles static shapes only");
  return *t;
}

Value Importer::val(int k) {
  Slot &s = slot(k);
  if (s.value)
    return s.value;
  const std::string &name = node->input(k);
  if (s.init && bufferNames.count(name)) {
    // A buffer (BatchNorm statistics, ...) used by real computation: an argument.
    const onnx::TensorProto &t = *s.init;
    SmallVector<int64_t> shape(t.dims().begin(), t.dims().end());
    Value arg = entry->addArgument(
        tensorType(shape, mlirType(t.data_type(), "buffer '" + name + "'")), loc);
    argAttrs.push_back(b.getDictionaryAttr({b.getNamedAttr(kBufferAttr, b.getStringAttr(name))}));
    s.value = arg;
    recordInitialValue(t, "buffer '" + name + "'");
    return arg;
  }
  if (!s.transposeOf.empty()) {
    // A tied weight's transposed copy: the parameter itself, transposed, so
    // that both uses train one tensor.
    Value a = env[s.transposeOf].value;
    ArrayRef<int64_t> as = shp(a);
    s.value = TransposeOp::create(b, loc, tensorType({as[1], as[0]}, eltOf(a)), a,
                                  b.getDenseI64ArrayAttr({1, 0}));
    return s.value;
  }
  const HostTensor *t = cst(k);
  s.value = materialize(*t, name);
  if (localBatch())
    markWhole(s.value, *t);
  return s.value;
}

SmallVector<int64_t> Importer::shapeOf(int k) {
  Slot &s = slot(k);
  if (s.value)
    return SmallVector<int64_t>(shp(s.value));
  if (s.constant)
    return s.constant->shape;
  return SmallVector<int64_t>(s.init->dims().begin(), s.init->dims().end());
}

ElemKind Importer::kindOf(int k) {
  Slot &s = slot(k);
  if (s.constant)
    return s.constant->kind;
  if (s.init)
    return (ElemKind)s.init->data_type();
  Type t = eltOf(s.value);
  if (t.isF32())
    return ElemKind::F32;
  if (t.isF64())
    return ElemKind::F64;
  if (t.isF16())
    return ElemKind::F16;
  if (t.isBF16())
    return ElemKind::BF16;
  if (t.isInteger(64))
    return ElemKind::I64;
  if (t.isInteger(32))
    return ElemKind::I32;
  if (t.isInteger(1))
    return ElemKind::Bool;
  if (t.isUnsignedInteger(8))
    return ElemKind::U8;
  return ElemKind::I8;
}

Value Importer::materialize(const HostTensor &t, StringRef name) {
  Type elt = mlirType((int)t.kind, "constant '" + name.str() + "'");
  auto type = tensorType(t.shape, elt);
  ElementsAttr attr;
  bool splat = t.size() > 0;
  for (int64_t k = 1; k < t.size() && splat; ++k)
    splat = t.isFloat() ? t.f[k] == t.f[0] : t.i[k] == t.i[0];
  // Large non-splat f32/i64 constants print as named blobs at the end of the module.
  bool asBlob = !splat && t.size() > kInlineConstantLimit;
  StringRef blobName = name.empty() ? StringRef("constant") : name;
  if (t.kind == ElemKind::Bool) {
    SmallVector<bool> v;
    for (int64_t x : t.i)
      v.push_back(x != 0);
    attr = DenseElementsAttr::get(type, ArrayRef<bool>(v));
  } else if (asBlob && t.kind == ElemKind::F32) {
    std::vector<float> raw(t.f.begin(), t.f.end());
    attr = DenseResourceElementsAttr::get(
        type, blobName, HeapAsmResourceBlob::allocateAndCopyInferAlign(ArrayRef<float>(raw)));
  } else if (asBlob && t.kind == ElemKind::I64) {
    attr = DenseResourceElementsAttr::get(
        type, blobName, HeapAsmResourceBlob::allocateAndCopyInferAlign(ArrayRef<int64_t>(t.i)));
  } else if (t.isFloat()) {
    const llvm::fltSemantics &sem = cast<FloatType>(elt).getFloatSemantics();
    SmallVector<llvm::APFloat> v;
    for (double x : t.f) {
      llvm::APFloat f(x);
      bool lost;
      f.convert(sem, llvm::APFloat::rmNearestTiesToEven, &lost);
      v.push_back(f);
    }
    attr = DenseElementsAttr::get(type, v);
  } else {
    unsigned width = elt.getIntOrFloatBitWidth();
    SmallVector<llvm::APInt> v;
    for (int64_t x : t.i)
      v.push_back(llvm::APInt(width, (uint64_t)x, /*isSigned=*/true, /*implicitTrunc=*/true));
    attr = DenseElementsAttr::get(type, v);
  }
  return ConstantOp::create(b, loc, attr);
}

void Importer::define(int k, Value v) {
  if (k >= node->output_size() || node->output(k).empty())
    return;
  Slot s;
  s.value = v;
  env[node->output(k)] = s;
}

void Importer::defineConst(int k, HostTensor t) {
  if (k >= node->output_size() || node->output(k).empty())
    return;
  Slot s;
  s.constant = std::move(t);
  env[node->output(k)] = s;
}

bool Importer::outputUsed(int k) const {
  if (k >= node->output_size() || node->output(k).empty())
    return false;
  return useCount.lookup(node->output(k)) > 0;
}

//===----------------------------------------------------------------------===//
// Attributes
//===----------------------------------------------------------------------===//

const onnx::AttributeProto *Importer::attr(StringRef name) const {
  for (const auto &a : node->attribute())
    if (a.name() == name)
      return &a;
  return nullptr;
}

int64_t Importer::attrInt(StringRef name, int64_t dflt) const {
  const auto *a = attr(name);
  return a ? a->i() : dflt;
}

float Importer::attrFloat(StringRef name, float dflt) const {
  const auto *a = attr(name);
  return a ? a->f() : dflt;
}

std::string Importer::attrString(StringRef name, StringRef dflt) const {
  const auto *a = attr(name);
  return a ? a->s() : dflt.str();
}

std::optional<std::vector<int64_t>> Importer::attrInts(StringRef name) const {
  const auto *a = attr(name);
  if (!a)
    return std::nullopt;
  return std::vector<int64_t>(a->ints().begin(), a->ints().end());
}

int64_t Importer::normAxis(int64_t axis, int64_t rank) const {
  int64_t a = axis < 0 ? axis + rank : axis;
  if (a < 0 || a >= rank)
    fail("axis " + std::to_string(axis) + " is out of range for rank " + std::to_string(rank));
  return a;
}

Value Importer::reshape(Value v, ArrayRef<int64_t> shape) {
  if (shp(v) == shape)
    return v;
  if (numElements(shp(v)) != numElements(shape))
    fail("cannot reshape " + formatShape(shp(v)) + " to " + formatShape(shape));
  return ReshapeOp::create(b, loc, tensorType(shape, eltOf(v)), v);
}

SmallVector<int64_t> Importer::reduceAxes(const onnx::NodeProto &n, int64_t rank) {
  std::vector<int64_t> axes;
  bool axesAsInput = n.op_type() == "ReduceSum" || opset >= 18;
  if (axesAsInput) {
    if (attr("axes"))
      fail("the axes attribute was replaced by an input at this opset");
    if (hasInput(1))
      axes = needConst(1, "axes").toInts();
  } else {
    if (hasInput(1))
      fail("axes is an attribute, not an input, before opset 18");
    if (auto a = attrInts("axes"))
      axes = *a;
  }
  if (axes.empty() && attrInt("noop_with_empty_axes", 0))
    return {};
  SmallVector<int64_t> out;
  if (axes.empty())
    for (int64_t d = 0; d < rank; ++d)
      out.push_back(d);
  for (int64_t a : axes)
    out.push_back(normAxis(a, rank));
  llvm::sort(out);
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

void Importer::normalizeSlice(ArrayRef<int64_t> shape, SmallVectorImpl<int64_t> &starts,
                              SmallVectorImpl<int64_t> &ends, SmallVectorImpl<int64_t> &steps) {
  int64_t rank = shape.size();
  starts.assign(rank, 0);
  ends.assign(shape.begin(), shape.end());
  steps.assign(rank, 1);
  std::vector<int64_t> st = needConst(1, "starts").toInts();
  std::vector<int64_t> en = needConst(2, "ends").toInts();
  std::vector<int64_t> ax, sp;
  if (hasInput(3))
    ax = needConst(3, "axes").toInts();
  else
    for (size_t k = 0; k < st.size(); ++k)
      ax.push_back(k);
  if (hasInput(4))
    sp = needConst(4, "steps").toInts();
  else
    sp.assign(st.size(), 1);
  if (en.size() != st.size() || ax.size() != st.size() || sp.size() != st.size())
    fail("starts, ends, axes and steps have different lengths");
  for (size_t k = 0; k < st.size(); ++k) {
    int64_t a = normAxis(ax[k], rank), dim = shape[a], step = sp[k];
    if (step == 0)
      fail("slice step is 0");
    auto clampIdx = [&](int64_t v, int64_t lo, int64_t hi) {
      if (v < 0)
        v = v < -dim ? lo : v + dim;
      return std::max(lo, std::min(hi, v));
    };
    if (step > 0) {
      starts[a] = clampIdx(st[k], 0, dim);
      ends[a] = std::max(starts[a], clampIdx(en[k], 0, dim));
    } else {
      starts[a] = clampIdx(st[k], -1, dim - 1);
      ends[a] = clampIdx(en[k], -1, dim - 1);
      if (en[k] < -dim)
        ends[a] = -1;
    }
    steps[a] = step;
  }
}

} // namespace carve::frontend
