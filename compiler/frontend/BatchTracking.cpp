//===- BatchTracking.cpp - the batch dimension through a static export ----===//
//
// A model exported with a static batch B hard-codes B (or multiples of it) in
// the constant shapes of its Reshape and Expand nodes: `view(B, T, H, D)`,
// nn.MultiheadAttention's `[T, B*H, D]`, `cls.expand(B, -1, -1)`,
// `mask.expand(B, 1, T, T)`. A data-parallel rank imports its share b of the
// batch (ImportOptions::batch); for that, the importer knows where the batch
// is in every value: the graph inputs hold it in dimension 0, and each op
// carries it from an operand to its results as the op's partition annotation
// (dialects/carve/Annotations.cpp) relates their dimensions, the batch being
// the outermost factor of a dimension that merges it with others. A Reshape
// then rescales the entry of its target shape where the batch lands, and an
// Expand the entry over the batch of its operand, or the one entry that
// creates the batch over a broadcast dimension. A constant that holds the
// batch but cannot be placed is an error naming the node and the constant.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Importer.h"

#include "dialects/carve/Annotation.h"
#include "dialects/carve/CarveOps.h"

#include <set>

using namespace mlir;

namespace carve::frontend {

Importer::BatchAt Importer::batchAt(Value v) const {
  auto it = batchDims.find(v);
  return it == batchDims.end() ? BatchAt{} : it->second;
}

void Importer::trackBatch(Operation *before) {
  trackDims(before, batchDims, opts.batch);
  if (!wholeDims.empty())
    trackDims(before, wholeDims, opts.globalBatch);
}

void Importer::markWhole(Value v, const HostTensor &t) {
  const int64_t whole = opts.globalBatch;
  for (int64_t d = 0; d < (int64_t)t.shape.size(); ++d) {
    if (t.shape[d] != whole)
      continue;
    int64_t inner = 1;
    for (int64_t q = d + 1; q < (int64_t)t.shape.size(); ++q)
      inner *= t.shape[q];
    bool uniform = true;
    for (int64_t k = 0; k < t.size() && uniform; ++k)
      uniform = t.asDouble(k) == t.asDouble(k - (k / inner % whole) * inner);
    if (uniform) {
      wholeDims[v] = BatchAt{d, 1};
      return;
    }
  }
}

void Importer::trackDims(Operation *before, llvm::DenseMap<Value, BatchAt> &dims, int64_t size) {
  auto dimOf = [&](Value v) {
    auto it = dims.find(v);
    return it == dims.end() ? BatchAt{} : it->second;
  };
  Operation *op = before ? before->getNextNode() : (entry->empty() ? nullptr : &entry->front());
  for (; op; op = op->getNextNode()) {
    auto iface = dyn_cast<PartitionableOpInterface>(op);
    if (!iface || op->getNumResults() == 0 || dims.count(op->getResult(0)))
      continue; // (the reshape family and Expand record theirs as they build)
    // From the first operand that carries the batch.
    int64_t from = -1;
    BatchAt at;
    for (unsigned i = 0; i < op->getNumOperands() && from < 0; ++i)
      if (BatchAt b = dimOf(op->getOperand(i)); b.dim >= 0)
        from = i, at = b;
    if (from < 0)
      continue;
    Annotation a;
    std::string error;
    if (!Annotation::parse(iface.getPartitionAnnotation(), a, error))
      continue;
    std::vector<std::vector<int64_t>> ins, outs;
    for (Value v : op->getOperands())
      ins.push_back(cast<RankedTensorType>(v.getType()).getShape().vec());
    for (Value v : op->getResults())
      outs.push_back(cast<RankedTensorType>(v.getType()).getShape().vec());
    if (!a.bind(ins, outs, error) || at.dim >= (int64_t)a.operands[from].size())
      continue;
    // The named factor the batch lies in, and its offset inside it.
    std::string name;
    int64_t before = 1, inside = 1;
    for (const Factor &f : a.operands[from][at.dim]) {
      // The factor the batch lies in: the factors outside it end where it
      // starts, and it fits (a local batch of 1 is a factor of size 1, or the
      // last element of a larger one).
      if (at.outer % before == 0) {
        const int64_t span = at.outer / before * size;
        if (span <= f.count && f.count % span == 0) {
          if (!f.name.empty())
            name = f.name, inside = at.outer / before;
          break;
        }
      }
      before *= f.count;
    }
    if (name.empty())
      continue;
    for (unsigned r = 0; r < op->getNumResults(); ++r) {
      int64_t rd, outer;
      if (Annotation::find(a.results[r], name, rd, outer))
        dims[op->getResult(r)] = BatchAt{rd, outer * inside};
    }
  }
}

bool Importer::dependsOnInputs(Value v) {
  if (auto it = fromInputs.find(v); it != fromInputs.end())
    return it->second;
  fromInputs[v] = false; // (no cycles in a block; a guard all the same)
  bool from = false;
  if (auto arg = dyn_cast<BlockArgument>(v)) {
    from = arg.getArgNumber() < argAttrs.size() && argAttrs[arg.getArgNumber()].get(kInputAttr);
  } else if (Operation *op = v.getDefiningOp()) {
    for (Value o : op->getOperands())
      if ((from = dependsOnInputs(o)))
        break;
  }
  return fromInputs[v] = from;
}

int64_t Importer::createdBatchEntry(ArrayRef<int64_t> target, ArrayRef<int64_t> in) const {
  std::vector<int64_t> found;
  const int64_t lead = (int64_t)target.size() - (int64_t)in.size();
  for (int64_t p = 0; p < (int64_t)target.size(); ++p) {
    int64_t k = p - lead;
    if (target[p] == opts.globalBatch && (k < 0 || in[k] == 1))
      found.push_back(p);
  }
  if (found.empty())
    return -1;
  // Several: the batch leads, by the convention of every model carve has met.
  return found[0];
}

std::optional<onnx::NodeProto> Importer::shareConstants(const onnx::NodeProto &n) {
  static const std::set<std::string> broadcasting = {
      "Add", "Sub",   "Mul",   "Div",         "Pow",     "Where",          "Max",
      "Min", "Equal", "Less",  "LessOrEqual", "Greater", "GreaterOrEqual", "And",
      "Or",  "Xor",   "Concat"}; // Concat: operands of one rank, the batch off its axis
  if (!broadcasting.count(n.op_type()))
    return std::nullopt;
  // The operand that carries the batch.
  BatchAt at;
  int64_t rank = 0, local = 0;
  for (int k = 0; k < n.input_size() && at.dim < 0; ++k) {
    if (n.input(k).empty())
      continue;
    Slot &s = slot(k);
    if (s.value && batchAt(s.value).dim >= 0) {
      at = batchAt(s.value);
      rank = (int64_t)shp(s.value).size();
      local = shp(s.value)[at.dim];
    }
  }
  if (at.dim < 0)
    return std::nullopt;
  const int64_t ratio = opts.globalBatch / opts.batch, B = opts.globalBatch;
  std::optional<onnx::NodeProto> copy;
  for (int k = 0; k < n.input_size(); ++k) {
    if (n.input(k).empty())
      continue;
    if (Value v = slot(k).value) {
      // A value computed from a constant of the whole batch, the same for
      // every sample: its first share (a slice) is every rank's.
      auto it = wholeDims.find(v);
      if (it == wholeDims.end() || at.outer != 1)
        continue;
      const int64_t vr = (int64_t)shp(v).size(), d = at.dim - (rank - vr);
      if (d < 0 || d != it->second.dim || it->second.outer != 1 || shp(v)[d] != local * ratio)
        continue;
      if (n.op_type() == "Concat" && normAxis(attrInt("axis", 0), vr) == d)
        continue;
      SmallVector<int64_t> st(vr, 0), en(shp(v)), sp(vr, 1), shape(shp(v));
      en[d] = shape[d] = local;
      Value y = SliceOp::create(b, loc, tensorType(shape, eltOf(v)), v,
                                b.getDenseI64ArrayAttr(st), b.getDenseI64ArrayAttr(en),
                                b.getDenseI64ArrayAttr(sp));
      batchDims[y] = BatchAt{d, 1};
      const std::string name = n.input(k) + "@batch-share-" + std::to_string(local);
      Slot s;
      s.value = y;
      env[name] = std::move(s);
      if (!copy)
        copy = n;
      copy->set_input(k, name);
      continue;
    }
    const HostTensor *t = cst(k);
    if (!t)
      continue;
    const int64_t d = at.dim - (rank - (int64_t)t->shape.size());
    if (d < 0 || t->shape[d] != local * ratio)
      continue;
    if (n.op_type() == "Concat" && normAxis(attrInt("axis", 0), (int64_t)t->shape.size()) == d)
      continue; // concatenated along the batch: not a share of it
    // View the constant as [outer, at.outer, B, rest, inner] around dimension d.
    int64_t outer = 1, inner = 1;
    for (int64_t q = 0; q < d; ++q)
      outer *= t->shape[q];
    for (size_t q = d + 1; q < t->shape.size(); ++q)
      inner *= t->shape[q];
    const int64_t rest = t->shape[d] / (at.outer * B) * inner;
    const int64_t lead = at.outer;
    auto at3 = [&](int64_t o, int64_t l, int64_t bi, int64_t r) {
      return ((o * lead + l) * B + bi) * rest + r;
    };
    bool uniform = t->shape[d] % (at.outer * B) == 0;
    for (int64_t o = 0; o < outer && uniform; ++o)
      for (int64_t l = 0; l < lead && uniform; ++l)
        for (int64_t bi = 1; bi < B && uniform; ++bi)
          for (int64_t r = 0; r < rest && uniform; ++r)
            uniform = t->asDouble(at3(o, l, bi, r)) == t->asDouble(at3(o, l, 0, r));
    if (!uniform)
      fail("constant '" + n.input(k) + "' holds the model's batch of " + std::to_string(B) +
           " in dimension " + std::to_string(d) +
           " with values that differ between samples, so a rank's share of it depends on the "
           "rank; export the model with a dynamic batch (dynamic_axes) and bind it with "
           "--set-dim");
    HostTensor share = *t;
    share.shape[d] /= ratio;
    const int64_t b = B / ratio;
    std::vector<double> f;
    std::vector<int64_t> i;
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t l = 0; l < lead; ++l)
        for (int64_t bi = 0; bi < b; ++bi)
          for (int64_t r = 0; r < rest; ++r) {
            int64_t from = at3(o, l, bi, r);
            if (t->isFloat())
              f.push_back(t->f[from]);
            else
              i.push_back(t->i[from]);
          }
    share.f = std::move(f);
    share.i = std::move(i);
    const std::string name = n.input(k) + "@batch-share-" + std::to_string(b);
    if (!env.count(name)) {
      Slot s;
      s.constant = std::move(share);
      env[name] = std::move(s);
    }
    if (!copy)
      copy = n;
    copy->set_input(k, name);
  }
  return copy;
}

} // namespace carve::frontend
