//===- Materialize.cpp - the partitioned step in local shapes -------------===//
//
// Step 4 of the partitioner (Partitioner.cpp): every value retyped to its
// local shape, the collective sequences the decisions call for inserted,
// and the layout attributes written.
//
//===----------------------------------------------------------------------===//

#include "compiler/partition/PartitionerImpl.h"

namespace carve::partition {

//===----------------------------------------------------------------------===//
// Rewriting: collectives, local types, attributes
//===----------------------------------------------------------------------===//

RankedTensorType Partitioner::localType(RankedTensorType global, Layout l) {
  if (!l.isSplit())
    return global;
  SmallVector<int64_t> s(global.getShape());
  s[l.dim] /= t;
  return RankedTensorType::get(s, global.getElementType());
}

/// Builds the collectives that turn `v` (global type known from its layout
/// `from`; `v` already has its local type) into layout `to`.
Value Partitioner::convert(OpBuilder &b, Location loc, Value v, Layout from, Layout to) {
  // `v` is local; recover the global type to type each step.
  RankedTensorType local = typeOf(v);
  SmallVector<int64_t> full(local.getShape());
  if (from.isSplit())
    full[from.dim] *= t;
  auto global = RankedTensorType::get(full, local.getElementType());
  auto mesh = FlatSymbolRefAttr::get(ctx, kMeshName);
  auto axis = b.getStringAttr("tp");
  Layout cur = from;
  for (Layout next : path(v, from, to, nullptr)) {
    RankedTensorType ty = localType(global, next);
    auto red = b.getStringAttr(cur.kind == SbpKind::PartialMax ? "max" : "sum");
    if (cur.isPartial() && next.kind == SbpKind::Replicated) {
      v = dist::AllReduceOp::create(b, loc, ty, v, mesh, axis, red);
      ++report.allReduce;
      report.commBytes += bytesOf(v);
    } else if (cur.isPartial()) {
      v = dist::ReduceScatterOp::create(b, loc, ty, v, mesh, axis, b.getI64IntegerAttr(next.dim),
                                        b.getI64IntegerAttr(next.groups), red);
      ++report.reduceScatter;
      report.commBytes += bytesOf(v) * t;
    } else if (cur.isSplit() && next.kind == SbpKind::Replicated) {
      v = dist::AllGatherOp::create(b, loc, ty, v, mesh, axis, b.getI64IntegerAttr(cur.dim),
                                    b.getI64IntegerAttr(cur.groups));
      ++report.allGather;
      report.commBytes += bytesOf(v);
    } else if (cur.isSplit()) {
      v = dist::AllToAllOp::create(b, loc, ty, v, mesh, axis, b.getI64IntegerAttr(cur.dim),
                                   b.getI64IntegerAttr(cur.groups), b.getI64IntegerAttr(next.dim),
                                   b.getI64IntegerAttr(next.groups));
      ++report.allToAll;
      report.commBytes += bytesOf(v) * t;
    } else {
      v = dist::LocalSplitOp::create(b, loc, ty, v, mesh, axis, b.getI64IntegerAttr(next.dim),
                                     b.getI64IntegerAttr(next.groups));
      ++report.localSplit;
    }
    v.getDefiningOp()->setAttr(kLayoutAttr, b.getArrayAttr({next.attr(ctx)}));
    cur = next;
  }
  return v;
}

bool Partitioner::materialize() {
  Block &block = fn.getBody().front();
  // 0. Every annotation is bound to the global shapes before anything is retyped.
  for (Operation &op : block.without_terminator())
    if (!annotationOf(&op))
      return false;
  // 1. Local types for arguments and op results (before any conversion, so
  //    `convert` sees local inputs).
  for (BlockArgument arg : block.getArguments())
    arg.setType(localType(typeOf(arg), layout.lookup(arg)));
  for (Operation &op : block.without_terminator()) {
    Choice c = choices.lookup(&op);
    if (const Annotation *a = annotationOf(&op)) {
      op.setAttr(kAnnotationAttr, StringAttr::get(ctx, a->text));
      op.setAttr(kChoiceAttr, StringAttr::get(ctx, "tp: " + c.str()));
    }
    SmallVector<Attribute> ls;
    for (Value r : op.getResults()) {
      auto global = typeOf(r);
      Layout l = layout.lookup(r);
      r.setType(localType(global, l));
      ls.push_back(l.attr(ctx));
    }
    op.setAttr(kLayoutAttr, ArrayAttr::get(ctx, ls));
    if (c.replicate() || c.partial)
      continue;
    const Annotation &a = annotations.at(&op);
    // Rank-dependent pieces of work, marked for codegen.
    if (auto g = dyn_cast<GatherOp>(op)) {
      if (layout.lookup(g.getData()).isSplit() &&
          layout.lookup(g.getData()).dim == static_cast<int64_t>(g.getAxis()))
        op.setAttr(kShardedRowsAttr,
                   IntegerAttr::get(IntegerType::get(ctx, 64), a.sizes.at(c.name)));
    } else if (auto g = dyn_cast<GatherGradOp>(op)) {
      Layout l = layout.lookup(g.getResult());
      if (l.isSplit() && l.dim == static_cast<int64_t>(g.getAxis()))
        op.setAttr(kShardedRowsAttr,
                   IntegerAttr::get(IntegerType::get(ctx, 64), a.sizes.at(c.name)));
    } else if (isa<CrossEntropyOp, CrossEntropyGradOp>(op) && a.markOf(c.name) == Mark::Internal) {
      op.setAttr(kShardedRowsAttr, IntegerAttr::get(IntegerType::get(ctx, 64), a.sizes.at(c.name)));
    }
    // Slices of split dimensions take the same sections of each rank's piece.
    auto localBounds = [&](ArrayRef<int64_t> bounds, Value whole) {
      Layout l = layout.lookup(whole);
      SmallVector<int64_t> out(bounds);
      if (l.isSplit())
        out[l.dim] /= t;
      return out;
    };
    if (auto s = dyn_cast<SliceOp>(op)) {
      s.setStarts(localBounds(s.getStarts(), s.getInput()));
      s.setEnds(localBounds(s.getEnds(), s.getInput()));
    } else if (auto s = dyn_cast<SliceGradOp>(op)) {
      s.setStarts(localBounds(s.getStarts(), s.getResult()));
      s.setEnds(localBounds(s.getEnds(), s.getResult()));
    }
  }
  // 2. Collectives before each consumer, shared between consumers of the same
  //    value and layout.
  std::map<std::pair<void *, Layout>, Value> converted;
  for (const Need &n : needs) {
    Value v = n.op->getOperand(n.operand);
    auto key = std::make_pair(v.getAsOpaquePointer(), n.target);
    auto it = converted.find(key);
    Value nv;
    if (it != converted.end() && it->second.getParentBlock() == n.op->getBlock() &&
        (isa<BlockArgument>(it->second) || it->second.getDefiningOp()->isBeforeInBlock(n.op))) {
      nv = it->second;
    } else {
      OpBuilder b(n.op);
      nv = convert(b, n.op->getLoc(), v, layout.lookup(v), n.target);
      if (!nv)
        return fail(n.op, "no collective sequence turns " + layout.lookup(v).str() + " into " +
                              n.target.str());
      converted[key] = nv;
    }
    n.op->setOperand(n.operand, nv);
  }
  // 3. The signature and its layouts.
  auto ret = cast<func::ReturnOp>(block.getTerminator());
  fn.setType(FunctionType::get(ctx, block.getArgumentTypes(), ret.getOperandTypes()));
  Layout dpBatch = Layout::S(0, 1);
  ArgAttrEdits argEdits(fn), resultEdits(fn, /*results=*/true);
  for (BlockArgument arg : block.getArguments()) {
    unsigned k = arg.getArgNumber();
    bool input = static_cast<bool>(fn.getArgAttr(k, kInputAttr));
    NamedAttrList d;
    d.set("dp", (input && opts.dp > 1 ? dpBatch : Layout::R()).attr(ctx));
    d.set("tp", layout.lookup(arg).attr(ctx));
    argEdits.set(k, kLayoutAttr, d.getDictionary(ctx));
  }
  for (unsigned k = 0; k < ret.getNumOperands(); ++k) {
    // Gradients and the loss are partial over dp until codegen's bucketed
    // all-reduce (or ZeRO reduce-scatter) and the loss reduction.
    NamedAttrList d;
    d.set("dp", (opts.dp > 1 ? Layout::P(false) : Layout::R()).attr(ctx));
    d.set("tp", returnLayouts[k].attr(ctx));
    resultEdits.set(k, kLayoutAttr, d.getDictionary(ctx));
  }
  argEdits.apply();
  resultEdits.apply();
  return true;
}

} // namespace carve::partition
