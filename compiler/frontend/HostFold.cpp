//===- HostFold.cpp - evaluate nodes on the host at import ----------------===//
//
// A node whose inputs are all known (constants, non-parameter initializers,
// Constant nodes, earlier folded results) is evaluated with HostTensor and
// never becomes an op: this is how the shape sub-graphs PyTorch exports
// disappear. Shape and Size are always evaluated, from the static type.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Importer.h"

#include <set>

using namespace mlir;
using llvm::ArrayRef;
using llvm::SmallVector;

namespace carve::frontend {

/// Constant folding stops at results this large (elements).
constexpr int64_t kFoldLimit = int64_t(1) << 24;

bool Importer::foldWithoutData(const onnx::NodeProto &n) {
  const std::string &op = n.op_type();
  // Shape and Size need only the input's static type.
  if (op == "Shape" || op == "Size") {
    SmallVector<int64_t> s = shapeOf(0);
    // Under a rank's share of a static batch the sizes are the share's: the
    // entry of the batch is marked local, so that a Reshape or Expand whose
    // target is built from it is not rescaled a second time.
    const int64_t batchDim =
        localBatch() && slot(0).value ? batchAt(slot(0).value).dim : (int64_t)-1;
    if (op == "Size") {
      HostTensor t = HostTensor::ints(ElemKind::I64, {}, {numElements(s)});
      if (batchDim >= 0)
        t.local = {1};
      defineConst(0, std::move(t));
      return true;
    }
    int64_t rank = s.size();
    int64_t start = attrInt("start", 0), end = attrInt("end", rank);
    start = std::clamp<int64_t>(start < 0 ? start + rank : start, 0, rank);
    end = std::clamp<int64_t>(end < 0 ? end + rank : end, 0, rank);
    HostTensor t =
        HostTensor::vec(ArrayRef<int64_t>(s).slice(start, std::max<int64_t>(end - start, 0)));
    if (batchDim >= start && batchDim < end) {
      t.local.assign(t.size(), 0);
      t.local[batchDim - start] = 1;
    }
    defineConst(0, std::move(t));
    return true;
  }
  if (op == "Constant") {
    const auto *a = n.attribute_size() == 1 ? &n.attribute(0) : nullptr;
    if (!a)
      fail("a Constant node needs exactly one attribute");
    if (a->name() == "value")
      defineConst(
          0, loadTensor(a->t(), "constant '" + (n.output_size() ? n.output(0) : nodeLabel) + "'"));
    else if (a->name() == "value_float")
      defineConst(0, HostTensor::floats(ElemKind::F32, {}, {a->f()}));
    else if (a->name() == "value_floats")
      defineConst(0,
                  HostTensor::floats(ElemKind::F32, {(int64_t)a->floats_size()},
                                     std::vector<double>(a->floats().begin(), a->floats().end())));
    else if (a->name() == "value_int")
      defineConst(0, HostTensor::ints(ElemKind::I64, {}, {a->i()}));
    else if (a->name() == "value_ints")
      defineConst(0, HostTensor::vec(std::vector<int64_t>(a->ints().begin(), a->ints().end())));
    else
      fail("Constant attribute '" + a->name() + "' is not supported");
    return true;
  }
  if (op == "ConstantOfShape") {
    std::vector<int64_t> shape = needConst(0, "shape").toInts();
    HostTensor value = HostTensor::floats(ElemKind::F32, {}, {0.0});
    if (const auto *a = attr("value"))
      value = loadTensor(a->t(), "ConstantOfShape value");
    for (int64_t d : shape)
      if (d < 0)
        fail("shape " + formatShape(shape) + " has a negative dimension");
    if (numElements(shape) > kFoldLimit)
      fail("ConstantOfShape of " + formatShape(shape) + " is too large to build at import");
    defineConst(0, hostExpand(hostReshape(value, {}), shape));
    return true;
  }
  return false;
}

/// Evaluates `n` on the host if all its inputs are constants; returns true if
/// it did.
bool Importer::tryFold(const onnx::NodeProto &n) {
  const std::string &op = n.op_type();
  if (foldWithoutData(n))
    return true;
  // CastLike of a constant (the dynamo exporter's scalars cast to the type
  // of the tensor they meet): its second input gives only the type.
  if (op == "CastLike" && n.input_size() == 2 && cst(0)) {
    const int to = (int)kindOf(1);
    if (!isSupportedKind(to))
      fail("cast to " + elemKindName(to) + " is not supported");
    defineConst(0, hostCast(*cst(0), (ElemKind)to));
    return true;
  }

  SmallVector<const HostTensor *> in;
  for (int k = 0; k < n.input_size(); ++k) {
    if (n.input(k).empty()) {
      in.push_back(nullptr);
      continue;
    }
    const HostTensor *t = cst(k);
    if (!t)
      return false;
    in.push_back(t);
  }
  if (in.empty() || !in[0])
    return false;
  const HostTensor &x = *in[0];
  static const std::set<std::string> binaryOps = {"Add",
                                                  "Sub",
                                                  "Mul",
                                                  "Div",
                                                  "Pow",
                                                  "Max",
                                                  "Min",
                                                  "Mod",
                                                  "Equal",
                                                  "Less",
                                                  "Greater",
                                                  "LessOrEqual",
                                                  "GreaterOrEqual",
                                                  "And",
                                                  "Or"};
  static const std::set<std::string> unaryOps = {"Neg",     "Abs",   "Sqrt", "Reciprocal", "Exp",
                                                 "Log",     "Floor", "Ceil", "Not",        "Relu",
                                                 "Sigmoid", "Tanh",  "Erf",  "Sin",        "Cos"};
  if (x.size() > kFoldLimit)
    return false;
  if (binaryOps.count(op) && in.size() == 2) {
    ShapeOrError s = broadcastShapes(x.shape, in[1]->shape);
    if (s.ok() && numElements(s.shape) > kFoldLimit)
      return false;
    defineConst(0, hostBinary(op, x, *in[1]));
  } else if (unaryOps.count(op)) {
    defineConst(0, hostUnary(op, x));
  } else if (op == "Identity") {
    defineConst(0, x);
  } else if (op == "Cast") {
    int to = attrInt("to", 0);
    if (!isSupportedKind(to))
      fail("cast to " + elemKindName(to) + " is not supported");
    defineConst(0, hostCast(x, (ElemKind)to));
  } else if (op == "Where") {
    defineConst(0, hostWhere(x, *in[1], *in[2]));
  } else if (op == "Reshape") {
    // Shares the shape rule with the non-constant path below.
    return false;
  } else if (op == "Unsqueeze" || op == "Squeeze" || op == "Flatten") {
    return false;
  } else if (op == "Transpose") {
    std::vector<int64_t> perm;
    if (auto p = attrInts("perm"))
      perm = *p;
    else
      for (int64_t d = (int64_t)x.shape.size() - 1; d >= 0; --d)
        perm.push_back(d);
    defineConst(0, hostTranspose(x, perm));
  } else if (op == "Slice") {
    SmallVector<int64_t> st, en, sp;
    normalizeSlice(x.shape, st, en, sp);
    defineConst(0, hostSlice(x, st, en, sp));
  } else if (op == "Concat") {
    SmallVector<const HostTensor *> parts;
    for (const HostTensor *t : in)
      if (t)
        parts.push_back(t);
    defineConst(0, hostConcat(parts, normAxis(attrInt("axis", 0), x.shape.size())));
  } else if (op == "Gather") {
    defineConst(0, hostGather(x, *in[1], normAxis(attrInt("axis", 0), x.shape.size())));
  } else if (op == "Expand") {
    std::vector<int64_t> shape = in[1]->toInts();
    ShapeOrError s = broadcastShapes(x.shape, shape);
    if (s.ok() && numElements(s.shape) > kFoldLimit)
      return false;
    defineConst(0, hostExpand(x, shape));
  } else if (op == "Tile") {
    std::vector<int64_t> repeats = in[1]->toInts();
    int64_t total = 1;
    for (size_t d = 0; d < repeats.size() && d < x.shape.size(); ++d)
      total *= x.shape[d] * std::max<int64_t>(repeats[d], 0);
    if (total > kFoldLimit)
      return false;
    defineConst(0, hostTile(x, repeats));
  } else if (op == "ScatterND") {
    if (n.input_size() != 3 || !in[1] || !in[2])
      fail("ScatterND needs data, indices and updates");
    defineConst(0, hostScatterND(x, *in[1], *in[2], attrString("reduction", "none")));
  } else if (op == "GatherElements") {
    defineConst(0, hostGatherElements(x, *in[1], normAxis(attrInt("axis", 0), x.shape.size())));
  } else if (op == "Trilu") {
    int64_t k = in.size() > 1 && in[1] ? in[1]->asInt(0) : 0;
    defineConst(0, hostTrilu(x, k, attrInt("upper", 1) != 0));
  } else if (op == "Range") {
    double count = (in[1]->asDouble(0) - x.asDouble(0)) / in[2]->asDouble(0);
    if (in[2]->asDouble(0) != 0 && count > (double)kFoldLimit)
      fail("Range of " + std::to_string((int64_t)count) +
           " elements is too large to build at import");
    defineConst(0, hostRange(x, *in[1], *in[2]));
  } else if (op == "ReduceSum" || op == "ReduceMean" || op == "ReduceMax" || op == "ReduceMin" ||
             op == "ReduceProd") {
    SmallVector<int64_t> axes = reduceAxes(n, x.shape.size());
    defineConst(0, axes.empty() ? x : hostReduce(op, x, axes, attrInt("keepdims", 1)));
  } else {
    return false;
  }
  return true;
}

} // namespace carve::frontend
