//===- ImportScatter.cpp - ONNX ScatterND with indices known at import ----===//
//
// PyTorch exports a slice assignment (`y[:, 1:] = x[:, :-1]`, T5's shift of
// the targets to the right; `mask[h, w] = k`, Swin's window mask) as ONNX
// ScatterND: `data` with `updates` written at the slices that the index
// tuples of `indices` address. With every input constant the importer
// evaluates it (HostFold.cpp, hostScatterND); otherwise the indices must be
// constant (they are wherever the shapes are static, as carve's always are)
// and the scatter becomes ops with kernels and gradients on both targets:
//
//   data viewed as [P, S] (P slices of S elements), updates as [U, S], and
//   the slice each update row goes to known at import (scatterNDRows):
//
//   - reduction "add": data + gather_grad(updates, rows), the scatter-add
//     (repeated rows add up, as ONNX says);
//   - "none", "mul", "max", "min": in rounds, the r-th update of each slice
//     in the indices' order: gather the round's rows (a slice without an r-th
//     update reads row 0 and is masked out by a where), then write (none) or
//     combine (mul, max, min) them. One round when no slice repeats; "none"
//     with a repeated slice is refused, as ONNX leaves its result undefined.
//
// Gradients follow from the ops: where passes the data's gradient where no
// update wrote, gather_grad sends each written slice's gradient back to its
// update row, mul/max/min as elementwise ops.
//
// A rank's share of the batch (data parallelism, micro-batches): a scatter is
// computed per share only where each sample's slices are written from the
// same sample's updates. Where the index tuples address the batch (entry c),
// one dimension j of the indices must be the batch, with tuple[c] equal to
// the position along j and every other entry the same for every sample
// (`y[:, 1:] = x[:, :-1]`); a scatter that moves values between samples
// (`prev[1:] = y[:-1]`) or writes only some of them (`acc[:4] = ...`) is
// refused naming the node, as a rank could not compute it. A static export's
// indices and zeros, built for the whole batch, are cut to the share when
// they are the same for every sample.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Importer.h"

#include "dialects/carve/CarveOps.h"

#include <optional>

using namespace mlir;
using llvm::SmallVector;

namespace carve::frontend {

void Importer::buildScatterND(const onnx::NodeProto &n) {
  if (n.input_size() != 3)
    fail("ScatterND needs data, indices and updates");
  const std::string reduction = attrString("reduction", "none");
  if (reduction != "none" && reduction != "add" && reduction != "mul" && reduction != "max" &&
      reduction != "min")
    fail("reduction '" + reduction + "' is not one of none, add, mul, max, min");
  const HostTensor *indices = cst(1);
  if (!indices)
    fail("the indices ('" + n.input(1) +
         "') are computed from graph inputs; carve supports ScatterND whose indices are "
         "constants known at import (a slice assignment such as y[:, 1:] = x exports so)");
  HostTensor idx = *indices;
  std::optional<HostTensor> dataShare;
  int64_t batchDim = localBatch() ? shareBatch(idx, dataShare) : -1;
  Value data = dataShare ? materialize(*dataShare, "") : val(0), updates = val(2);
  if (eltOf(data) != eltOf(updates))
    fail("the updates' element type differs from the data's");
  const SmallVector<int64_t> ds(shp(data));
  std::vector<int64_t> rows;
  try {
    rows = scatterNDRows(ds, idx, shp(updates));
  } catch (const HostError &e) {
    fail(e.what());
  }
  indices = &idx;
  const int64_t k = indices->shape.back();
  int64_t P = 1, S = 1;
  for (int64_t d = 0; d < (int64_t)ds.size(); ++d)
    (d < k ? P : S) *= ds[d];
  const int64_t U = (int64_t)rows.size();
  Type elt = eltOf(data);
  Value data2 = reshape(data, {P, S});
  Value updates2 = reshape(updates, {U, S});
  auto axis0 = b.getI64IntegerAttr(0);

  if (reduction == "add") {
    Value at = materialize(HostTensor::ints(ElemKind::I64, {U}, rows), "");
    Value added = GatherGradOp::create(b, loc, tensorType({P, S}, elt), updates2, at, axis0);
    return defineScattered(reshape(binary<AddOp>(data2, added), ds), batchDim);
  }
  // Rounds: round r holds each slice's r-th update (in the indices' order).
  std::vector<std::vector<int64_t>> rounds;
  std::vector<int64_t> seen(P, 0);
  for (int64_t u = 0; u < U; ++u) {
    const int64_t r = seen[rows[u]]++;
    if (r == (int64_t)rounds.size())
      rounds.emplace_back(P, -1);
    rounds[r][rows[u]] = u;
  }
  if (reduction == "none" && rounds.size() > 1)
    fail("reduction 'none' writes one slice twice (duplicate index tuples), which ONNX leaves "
         "undefined");
  Value result = data2;
  for (const std::vector<int64_t> &round : rounds) {
    std::vector<int64_t> pick(P), written(P);
    bool all = true;
    for (int64_t p = 0; p < P; ++p) {
      pick[p] = round[p] < 0 ? 0 : round[p];
      written[p] = round[p] >= 0;
      all &= round[p] >= 0;
    }
    Value at = materialize(HostTensor::ints(ElemKind::I64, {P}, pick), "");
    Value picked = GatherOp::create(b, loc, tensorType({P, S}, elt), updates2, at, axis0);
    Value combined = reduction == "none"  ? picked
                     : reduction == "mul" ? binary<MulOp>(result, picked)
                     : reduction == "max" ? binary<MaximumOp>(result, picked)
                                          : binary<MinimumOp>(result, picked);
    if (all) {
      result = combined;
      continue;
    }
    Value mask = materialize(HostTensor::ints(ElemKind::Bool, {P, 1}, written), "");
    result = WhereOp::create(b, loc, result.getType(), mask, combined, result);
  }
  defineScattered(reshape(result, ds), batchDim);
}

void Importer::defineScattered(Value result, int64_t batchDim) {
  if (batchDim >= 0)
    batchDims[result] = BatchAt{batchDim, 1};
  define(0, result);
}

namespace {

/// `t` cut to its first `keep` entries along `dim`, or nothing when its
/// entries differ between the positions along `dim` (beyond `except`, a last
/// dimension entry that may differ: the tuples' batch entry).
std::optional<HostTensor> firstAlong(const HostTensor &t, int64_t dim, int64_t keep,
                                     int64_t except = -1) {
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d)
    outer *= t.shape[d];
  for (int64_t d = dim + 1; d < (int64_t)t.shape.size(); ++d)
    inner *= t.shape[d];
  const int64_t n = t.shape[dim], last = t.shape.empty() ? 1 : t.shape.back();
  HostTensor out = t;
  out.shape[dim] = keep;
  out.f.clear();
  out.i.clear();
  out.local.clear();
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t p = 0; p < n; ++p)
      for (int64_t r = 0; r < inner; ++r) {
        const int64_t at = (o * n + p) * inner + r, first = o * n * inner + r;
        if (except < 0 || r % last != except)
          if (t.asDouble(at) != t.asDouble(first))
            return std::nullopt;
        if (p < keep) {
          if (t.isFloat())
            out.f.push_back(t.f[at]);
          else
            out.i.push_back(t.i[at]);
        }
      }
  return out;
}

} // namespace

int64_t Importer::shareBatch(HostTensor &idx, std::optional<HostTensor> &dataShare) {
  const int64_t share = opts.batch, whole = opts.globalBatch;
  const int64_t q1 = (int64_t)idx.shape.size() - 1, k = idx.shape.back();
  const HostTensor *dataConst = cst(0);
  const BatchAt dAt = dataConst ? BatchAt{} : batchAt(val(0));
  const BatchAt uAt = cst(2) ? BatchAt{} : batchAt(val(2));
  if (dAt.outer != 1 || uAt.outer != 1)
    fail("the batch is merged with another dimension in the data or the updates; under a plan "
         "that splits the batch carve scatters only where the batch is a dimension of its own");
  // Where the batch is in the data: from the data, or from the updates (the
  // slices part maps directly; the tuples part through the entry that
  // follows the position along that dimension of the indices).
  int64_t bd = dAt.dim, j = -1;
  if (uAt.dim >= q1) {
    if (bd >= 0 && bd != k + uAt.dim - q1)
      fail("the updates hold the batch in another dimension than the data");
    bd = k + uAt.dim - q1;
  } else if (uAt.dim >= 0) {
    j = uAt.dim;
  }
  auto follows = [&](int64_t jj, int64_t c) {
    int64_t inner = 1;
    for (int64_t d = jj + 1; d < q1; ++d)
      inner *= idx.shape[d];
    for (int64_t t = 0; t * k < idx.size(); ++t)
      if (idx.i[t * k + c] != (t / inner) % idx.shape[jj])
        return false;
    return true;
  };
  if (bd < 0 && j >= 0)
    for (int64_t c = 0; c < k && bd < 0; ++c)
      if (follows(j, c))
        bd = c;
  if (bd < 0 && j < 0)
    return -1; // nothing here holds the batch
  auto refuse = [&](const std::string &why) {
    fail(why + "; a rank's share of the batch (" + std::to_string(share) + " of " +
         std::to_string(whole) + ") cannot compute it, so plans that split the batch (dp, "
         "micro-batches) need a model whose samples are independent here");
  };
  if (bd < 0)
    refuse("the indices write the updates' samples to positions that are not those samples");
  if (bd < k) {
    // The tuples address the batch: one dimension of the indices is it.
    if (j < 0)
      for (int64_t d = 0; d < q1 && j < 0; ++d)
        if ((idx.shape[d] == share || idx.shape[d] == whole) && follows(d, bd))
          j = d;
    if (j < 0 || !follows(j, bd))
      refuse("the index tuples move values between samples of the batch (their entry " +
             std::to_string(bd) + " is not the sample the update comes from)");
    if (idx.shape[j] != share && idx.shape[j] != whole)
      refuse("the index tuples write " + std::to_string(idx.shape[j]) +
             " samples of the batch, not every one");
    std::optional<HostTensor> cut = firstAlong(idx, j, share, bd);
    if (!cut)
      refuse("the index tuples differ between samples beyond the batch entry");
    if (idx.shape[j] == whole)
      idx = std::move(*cut); // whose batch entries are 0 .. share-1, the share's own
  }
  if (dataConst && bd < (int64_t)dataConst->shape.size() && dataConst->shape[bd] == whole) {
    dataShare = firstAlong(*dataConst, bd, share);
    if (!dataShare)
      fail("constant '" + node->input(0) + "' holds the model's batch of " +
           std::to_string(whole) + " in dimension " + std::to_string(bd) +
           " with values that differ between samples, so a rank's share of it depends on the "
           "rank; export the model with a dynamic batch (dynamic_axes) and bind it with "
           "--set-dim");
  }
  return bd;
}

} // namespace carve::frontend
