//===- HostFold.cpp - evaluate nodes on the host at import ----------------===//
//
// A node whose inputs are all known (constants, non-parameter initializers,
// Constant nodes, earlier folded results) is evaluated with HostTensor and
// never becomes an op: this is how the shape sub-graphs PyTorch exports
// disappear. Shape and Size are always evaluated, from the static type.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Importer.h"
#include "compiler/interp/Interpreter.h"

#include "dialects/carve/CarveOps.h"
#include "mlir/IR/IRMapping.h"

#include <set>

using namespace mlir;
using llvm::ArrayRef;
using llvm::SmallVector;

namespace carve::frontend {

/// Constant folding stops at results this large (elements).
constexpr int64_t kFoldLimit = int64_t(1) << 24;

void Importer::foldBuilt(const onnx::NodeProto &n, Operation *before) {
  // Random or data-dependent ops never fold; nor does anything without an
  // output or an input.
  static const std::set<std::string> never = {"Dropout", "NonZero", "ScatterElements"};
  if (never.count(n.op_type()) || n.input_size() == 0 || n.output_size() == 0)
    return;
  for (int k = 0; k < n.input_size(); ++k)
    if (!n.input(k).empty() && !cst(k))
      return;
  SmallVector<Operation *> built;
  if (!before && entry->empty())
    return; // nothing was built (a node passed its input through)
  for (Operation *op = before ? before->getNextNode() : &entry->front(); op;
       op = op->getNextNode())
    built.push_back(op);
  if (built.empty())
    return;
  SmallVector<Value> outs;
  SmallVector<int> outIndex;
  int64_t elements = 0;
  for (int k = 0; k < n.output_size(); ++k) {
    if (n.output(k).empty() || !env.count(n.output(k)))
      continue;
    Value v = env[n.output(k)].value;
    if (!v)
      return;
    auto type = dyn_cast<RankedTensorType>(v.getType());
    if (!type || !type.hasStaticShape())
      return;
    elements += type.getNumElements();
    outs.push_back(v);
    outIndex.push_back(k);
  }
  if (outs.empty() || elements > kFoldLimit)
    return;
  // A result that holds a rank's share of the batch stays a value: batch
  // tracking needs to know where it is.
  for (Value v : outs)
    if (batchDims.count(v) || wholeDims.count(v))
      return;
  // A detached function of the built ops, with the constants they read from
  // earlier in the body cloned in front.
  OpBuilder tb(&ctx);
  SmallVector<Type> resultTypes;
  for (Value v : outs)
    resultTypes.push_back(v.getType());
  OwningOpRef<func::FuncOp> fn =
      func::FuncOp::create(loc, "fold", FunctionType::get(&ctx, {}, resultTypes));
  Block *body = fn->addEntryBlock();
  tb.setInsertionPointToEnd(body);
  IRMapping map;
  llvm::DenseSet<Operation *> inRange(built.begin(), built.end());
  for (Operation *op : built)
    for (Value o : op->getOperands()) {
      if (map.contains(o) || (o.getDefiningOp() && inRange.count(o.getDefiningOp())))
        continue;
      auto c = o.getDefiningOp<ConstantOp>();
      if (!c)
        return; // reads something that is not a constant
      map.map(o, tb.clone(*c)->getResult(0));
    }
  for (Operation *op : built)
    tb.clone(*op, map);
  SmallVector<Value> results;
  for (Value v : outs)
    results.push_back(map.lookup(v));
  func::ReturnOp::create(tb, loc, results);
  std::vector<HostValue> values;
  std::string error;
  if (!interpret(*fn, {}, values, error) || values.size() != outs.size())
    return; // the interpreter lacks an op: the built ops stay
  for (size_t r = 0; r < outs.size(); ++r) {
    auto type = cast<RankedTensorType>(outs[r].getType());
    Type elt = type.getElementType();
    ElemKind kind = elt.isF32()            ? ElemKind::F32
                    : elt.isF64()          ? ElemKind::F64
                    : elt.isF16()          ? ElemKind::F16
                    : elt.isBF16()         ? ElemKind::BF16
                    : elt.isInteger(64)    ? ElemKind::I64
                    : elt.isInteger(32)    ? ElemKind::I32
                    : elt.isInteger(1)     ? ElemKind::Bool
                    : elt.isUnsignedInteger(8) ? ElemKind::U8
                                               : ElemKind::I8;
    std::vector<double> d = values[r].toDoubles();
    if ((int64_t)d.size() != type.getNumElements())
      return;
    HostTensor t = isFloatKind(kind)
                       ? HostTensor::floats(kind, type.getShape(), d)
                       : HostTensor::ints(kind, type.getShape(),
                                          std::vector<int64_t>(d.begin(), d.end()));
    defineConst(outIndex[r], std::move(t));
  }
  // The built ops are dead now (their results were only the node's outputs).
  for (Operation *op : llvm::reverse(built)) {
    if (!op->use_empty() || isa<ConstantOp>(op))
      continue;
    for (Value v : op->getResults()) { // no stale facts for a reused address
      batchDims.erase(v);
      wholeDims.erase(v);
      partialBatch.erase(v);
      bounded.erase(v);
      fromInputs.erase(v);
    }
    op->erase();
  }
}

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
    // A shape that holds a rank's share of the batch (folded from a Shape):
    // built as an op, so that the result is known to hold the batch
    // (`zeros(x.shape[0])` reshaped with the export's whole batch later).
    if (!in[1]->local.empty())
      return false;
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
