//===- Bounded.cpp - NonZero at a static bound, and what it feeds ---------===//
//
// ONNX NonZero returns as many positions as its input has non-zero elements:
// a size the data decides. Mixture-of-experts layers written the way the
// popular libraries write them route tokens with it
// (`idx, top_x = torch.where(expert_mask[e])`, then `x[top_x]`, the expert,
// and `out.index_add_(0, top_x, y)`). carve keeps every shape static:
//
//   - carve.nonzero returns its bound, every element of the input, and holds
//     the positions in the leading columns; the count of them is computed
//     beside it (the sum of `input != 0`, exact in float below 2^24);
//   - every value computed from those positions is *bounded*: one of its
//     dimensions holds the bound, of which the first `count` entries are
//     real and the rest are padding (position 0, so every gather by them is
//     in range). The importer knows which dimension of which value, carried
//     through each op by its partition annotation, as BatchTracking.cpp
//     carries the batch: an op that keeps the dimension as one of its own
//     rows (elementwise ops, matrix products by the rows, gathers by the
//     positions, reshapes that only add or drop size-1 dimensions) keeps it
//     bounded;
//   - the padding must never reach a value that is not bounded. The one way
//     out is ScatterElements (index_add_), imported as a scatter-add of the
//     updates masked to their first `count` rows; any other op that would
//     read the whole dimension (a reduction over it, a product contracting
//     it, a softmax along it, a graph output) is an error naming the node.
//
// Why this is exact, forward and backward: the padding rows are computed on
// real data (position 0) and so are finite, and are zeroed by the mask
// before the scatter; the mask's gradient zeroes their cotangents, and every
// op between carries a row's cotangent only to the same row, so the padding
// adds exactly zero to every gradient, the experts' weights included.
// docs/moe.md has the design and its cost (a routed expert computes all
// `bound` rows).
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Importer.h"

#include "dialects/carve/Annotation.h"
#include "dialects/carve/CarveOps.h"

using namespace mlir;
using llvm::SmallVector;

namespace carve::frontend {

const Importer::Bounded *Importer::boundedOf(Value v) const {
  auto it = bounded.find(v);
  return it == bounded.end() ? nullptr : &it->second;
}

void Importer::buildNonZero(const onnx::NodeProto &) {
  Value x = val(0);
  const int64_t rank = (int64_t)shp(x).size();
  if (rank == 0)
    fail("the input must have at least one dimension");
  if (const Bounded *in = boundedOf(x))
    fail("the input is itself sized by NonZero '" + in->origin +
         "' at run time; carve bounds one NonZero at a time");
  int64_t numel = 1;
  for (int64_t d : shp(x))
    numel *= d;
  if (numel >= (int64_t(1) << 24))
    fail("the input has " + std::to_string(numel) +
         " elements; carve counts the non-zeros in float, exact below 2^24");
  Value positions =
      NonzeroOp::create(b, loc, tensorType({rank, numel}, b.getI64Type()), x).getResult();
  // count = sum(x != 0), in f32.
  Type f32 = b.getF32Type();
  Value nz = x;
  if (!eltOf(x).isInteger(1)) {
    Value asFloat = isa<FloatType>(eltOf(x)) && eltOf(x).isF32()
                        ? x
                        : CastOp::create(b, loc, tensorType(shp(x), f32), x).getResult();
    Value zero = materialize(HostTensor::floats(ElemKind::F32, {}, {0.0}), "");
    nz = NotOp::create(b, loc, tensorType(shp(x), b.getI1Type()),
                       binary<EqualOp>(asFloat, zero, true));
  }
  Value ones = CastOp::create(b, loc, tensorType(shp(x), f32), nz);
  SmallVector<int64_t> all;
  for (int64_t d = 0; d < rank; ++d)
    all.push_back(d);
  Value count = ReduceSumOp::create(b, loc, tensorType({}, f32), ones, b.getDenseI64ArrayAttr(all),
                                    b.getBoolAttr(false));
  Bounded info{1, count, nodeLabel};
  if (localBatch())
    if (BatchAt at = batchAt(x); at.dim >= 0)
      info.batchLen = shp(x)[at.dim], info.batchOuter = at.outer;
  bounded[positions] = info;
  define(0, positions);
}

Value Importer::maskBounded(Value v) {
  const Bounded *bd = boundedOf(v);
  if (!bd)
    return v;
  const Bounded info = *bd; // (the map may grow below)
  const int64_t rank = (int64_t)shp(v).size(), n = shp(v)[info.dim];
  SmallVector<int64_t> iotaShape(rank, 1);
  iotaShape[info.dim] = n;
  std::vector<double> iota(n);
  for (int64_t i = 0; i < n; ++i)
    iota[i] = (double)i;
  Operation *before = entry->empty() ? nullptr : &entry->back();
  Value positions = materialize(HostTensor::floats(ElemKind::F32, iotaShape, iota), "");
  Value keep = binary<LessOp>(positions, info.count, true);
  Value zero = materialize(
      HostTensor::floats(isa<FloatType>(eltOf(v)) ? ElemKind::F32 : ElemKind::I64, {}, {0.0}), "");
  if (eltOf(zero) != eltOf(v))
    zero = CastOp::create(b, loc, tensorType({}, eltOf(v)), zero);
  Value masked = WhereOp::create(b, loc, v.getType(), keep, v, zero);
  // The mask reads the whole bounded dimension by design.
  for (Operation *op = before ? before->getNextNode() : &entry->front(); op; op = op->getNextNode())
    boundedExits.insert(op);
  return masked;
}

void Importer::trackBounded(Operation *before) {
  Operation *op = before ? before->getNextNode() : (entry->empty() ? nullptr : &entry->front());
  for (; op; op = op->getNextNode()) {
    if (boundedExits.count(op) || isa<NonzeroOp>(op))
      continue;
    const Bounded *from = nullptr;
    unsigned fromIdx = 0;
    for (unsigned i = 0; i < op->getNumOperands(); ++i) {
      const Bounded *bd = boundedOf(op->getOperand(i));
      if (!bd)
        continue;
      if (from && bd->origin != from->origin)
        fail("it combines values sized at run time by two different NonZero nodes ('" +
             from->origin + "' and '" + bd->origin + "'); carve bounds one NonZero at a time");
      if (!from)
        from = bd, fromIdx = i;
    }
    if (!from)
      continue;
    const Bounded info = *from;
    auto cannot = [&](const std::string &why) {
      fail(why + ": its operand " + std::to_string(fromIdx) + " has a dimension (" +
           std::to_string(info.dim) + ") whose size NonZero '" + info.origin +
           "' decides at run time, which carve holds at its bound with padding rows past the "
           "count; such a value may go through ops that keep each of those rows apart "
           "(elementwise ops, matrix products by the rows, gathers by the positions) and leave "
           "only through ScatterElements / index_add_ (docs/moe.md)");
    };
    auto iface = dyn_cast<PartitionableOpInterface>(op);
    Annotation a;
    std::string error;
    std::vector<std::vector<int64_t>> ins, outs;
    for (Value v : op->getOperands())
      ins.push_back(cast<RankedTensorType>(v.getType()).getShape().vec());
    for (Value v : op->getResults())
      outs.push_back(cast<RankedTensorType>(v.getType()).getShape().vec());
    if (!iface || !Annotation::parse(iface.getPartitionAnnotation(), a, error) ||
        !a.bind(ins, outs, error))
      cannot("carve cannot tell how this op treats its operands' dimensions");
    // The one factor of the bounded dimension that is not of size 1.
    std::string name;
    for (const Factor &f : a.operands[fromIdx][info.dim])
      if (f.count != 1 || a.operands[fromIdx][info.dim].size() == 1) {
        if (!name.empty() || f.name.empty())
          cannot("it splits that dimension");
        name = f.name;
      }
    if (name.empty())
      cannot("it reads that whole dimension at once");
    if (Mark m = a.markOf(name); m == Mark::Sum || m == Mark::Max)
      cannot("it reduces over that dimension");
    else if (m != Mark::Plain)
      cannot("it reads that whole dimension at once (along it, not row by row)");
    bool found = false;
    for (unsigned r = 0; r < op->getNumResults(); ++r) {
      int64_t rd, outer;
      if (!Annotation::find(a.results[r], name, rd, outer))
        continue;
      int64_t others = 1;
      for (const Factor &f : a.results[r][rd])
        if (f.name != name)
          others *= f.count;
      if (others != 1)
        cannot("its result " + std::to_string(r) + " merges that dimension with others");
      Bounded carried = info;
      carried.dim = rd;
      bounded[op->getResult(r)] = carried;
      found = true;
    }
    if (!found && op->getNumResults())
      cannot("it reduces over that dimension");
  }
}

void Importer::buildScatterElements(const onnx::NodeProto &) {
  // data with updates scattered along `axis` at `indices`, where the indices
  // are the same along every other axis (whole rows: index_add_, the
  // `out[idx] = rows` forms): a scatter-add of the (masked) updates, which
  // is the write itself where the data is zero and no position repeats.
  Value data = val(0), indices = val(1), updates = val(2);
  const int64_t rank = (int64_t)shp(data).size();
  const int64_t axis = normAxis(attrInt("axis", 0), rank);
  const std::string reduction = attrString("reduction", "none");
  if (reduction != "none" && reduction != "add")
    fail("reduction '" + reduction + "' is not supported ('none' and 'add' are)");
  if (shp(indices) != shp(updates))
    fail("indices " + formatShape(shp(indices)) + " and updates " + formatShape(shp(updates)) +
         " differ in shape");
  if ((int64_t)shp(updates).size() != rank)
    fail("updates must have the data's rank");
  for (int64_t d = 0; d < rank; ++d)
    if (d != axis && shp(updates)[d] != shp(data)[d])
      fail("carve scatters whole rows: updates " + formatShape(shp(updates)) +
           " must match the data " + formatShape(shp(data)) + " in every dimension but " +
           std::to_string(axis));
  const HostTensor *dataConst = cst(0);
  bool zeroData = false;
  if (dataConst) {
    zeroData = true;
    for (int64_t k = 0; k < (int64_t)dataConst->size() && zeroData; ++k)
      zeroData = dataConst->asDouble(k) == 0.0;
  }
  // A rank's share of a static batch: the positions index the NonZero
  // input's batch dimension, and a table of the model's whole batch along
  // `axis` is one of the same value everywhere (torch.zeros), so its share
  // is every rank's.
  const Bounded *route = boundedOf(updates) ? boundedOf(updates) : boundedOf(indices);
  BatchAt resultBatch;
  if (localBatch() && route && route->batchLen > 0 && dataConst) {
    const int64_t ratio = opts.globalBatch / opts.batch;
    bool uniform = true;
    for (int64_t k = 1; k < (int64_t)dataConst->size() && uniform; ++k)
      uniform = dataConst->asDouble(k) == dataConst->asDouble(0);
    if (shp(data)[axis] == route->batchLen * ratio) {
      if (!uniform)
        fail("the data holds the model's batch of " + std::to_string(opts.globalBatch) +
             " in dimension " + std::to_string(axis) +
             " with values that differ between samples, so a rank's share of it depends on the "
             "rank; export the model with a dynamic batch (dynamic_axes) and bind it with "
             "--set-dim");
      HostTensor share = *dataConst;
      share.shape[axis] = route->batchLen;
      int64_t total = 1;
      for (int64_t d : share.shape)
        total *= d;
      if (share.isFloat())
        share.f.assign(total, dataConst->size() ? dataConst->f[0] : 0.0);
      else
        share.i.assign(total, dataConst->size() ? dataConst->i[0] : 0);
      data = materialize(share, "");
      resultBatch = BatchAt{axis, route->batchOuter};
    }
  }
  if (reduction == "none" && !zeroData)
    fail("reduction 'none' writes over the data, which carve supports only into zeros (the form "
         "index_add_ exports); use reduction 'add' or scatter into torch.zeros");
  // The positions: the indices' row along `axis`, which every other axis
  // repeats (an Expand of an [n, 1, ...] tensor, or a constant that does).
  Value src = indices;
  while (auto e = src.getDefiningOp<ExpandOp>())
    src = e.getInput();
  ArrayRef<int64_t> ss = shp(src);
  const int64_t lead = rank - (int64_t)ss.size();
  for (int64_t d = 0; d < (int64_t)ss.size(); ++d)
    if (d + lead != axis && ss[d] != 1)
      fail("carve scatters whole rows, so the indices must be the same along every axis but " +
           std::to_string(axis) + " (as index_add_ exports them)");
  const int64_t n = shp(updates)[axis];
  Value rows = reshape(src, {lead <= axis ? ss[axis - lead] : 1});
  if (shp(rows)[0] != n)
    rows = ExpandOp::create(b, loc, tensorType({n}, eltOf(rows)), rows);
  if (!eltOf(rows).isInteger(64))
    rows = CastOp::create(b, loc, tensorType({n}, b.getI64Type()), rows);
  Value masked = maskBounded(updates);
  Operation *before = entry->empty() ? nullptr : &entry->back();
  Value scattered =
      GatherGradOp::create(b, loc, data.getType(), masked, rows, b.getI64IntegerAttr(axis));
  for (Operation *op = before ? before->getNextNode() : &entry->front(); op; op = op->getNextNode())
    boundedExits.insert(op);
  Value result = zeroData ? scattered : binary<AddOp>(data, scattered);
  if (resultBatch.dim >= 0)
    batchDims[result] = resultBatch;
  define(0, result);
}

} // namespace carve::frontend
