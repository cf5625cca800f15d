//===- MemoryPlan.cpp - buffers, live ranges and the arena's regions ------===//
//
// Every value gets a buffer (a reshape shares its input's, a folded transpose
// and a fused chain's interior get none) and a live range; the activations
// take the offsets carve-plan-memory (compiler/memory) recorded, checked
// against those live ranges; the persistent regions (parameters, gradients
// in the order backward finishes them, optimizer state) are laid out one
// after another, ZeRO chunks where the plan shards over dp.
//
//===----------------------------------------------------------------------===//

#include "compiler/codegen/Generator.h"
#include "compiler/precision/Precision.h"

#include <algorithm>

using namespace mlir;

namespace carve::codegen {

int Generator::newBuffer(Region r, int64_t bytes, int def, std::string name) {
  Buffer b;
  b.region = r;
  b.bytes = bytes;
  b.def = def;
  b.lastUse = def; // written there, read or not
  b.name = std::move(name);
  buffers.push_back(b);
  return (int)buffers.size() - 1;
}

bool Generator::assignBuffers() {
  // The generated functions' own names: a model value called `loss` or `in`
  // must not hide the tail's loss or a fused call's inputs.
  for (const char *own : {"A", "at", "ctx", "loss", "lr", "clip", "norm", "h", "unscale",
                          "sqSplit", "sqWhole", "sqDevice", "sqExpertSplit", "sqExpertWhole",
                          "in", "shapes", "out", "parts", "counts", "mb", "slot", "S", "Q", "W",
                          "last", "forward", "backward", "step", "evaluate", "forwardBackward",
                          "tail", "sumOf", "handles", "TailRow"})
    usedNames.insert(own);
  // Arguments: parameters, buffers, inputs and the loss seed live all step.
  for (BlockArgument a : fn.getArguments()) {
    unsigned i = a.getArgNumber();
    Region r = Region::Param;
    std::string name;
    if (auto p = fn.getArgAttrOfType<StringAttr>(i, kParamAttr))
      name = p.getValue().str();
    else if (auto p = fn.getArgAttrOfType<StringAttr>(i, kBufferAttr))
      name = p.getValue().str();
    else if (auto p = fn.getArgAttrOfType<StringAttr>(i, kInputAttr))
      name = p.getValue().str(), r = Region::Input;
    else if (fn.getArgAttr(i, kLossSeedAttr))
      name = "loss_seed", r = Region::Seed;
    else
      return fail("argument " + std::to_string(i) +
                  " is neither an input, a parameter, a buffer nor the loss seed");
    std::string v = uniqueName(identifier(name));
    var[a] = v;
    bufferOf[a] = newBuffer(r, bytesOf(a), -1, v);
  }
  // Op results.
  for (Operation *op : ops) {
    int k = index[op];
    std::string node = nodeName(op->getLoc());
    std::string base;
    if (StringRef(node).starts_with("backward of "))
      base = "d_" + identifier(StringRef(node).drop_front(12));
    else if (!node.empty())
      base = identifier(node);
    else
      base = identifier(op->getName().stripDialect());
    if (isa<ConstantOp>(op))
      base = "const_" + base;
    for (Value r : op->getResults()) {
      unsigned resultNumber = cast<OpResult>(r).getResultNumber();
      std::string name =
          uniqueName(op->getNumResults() > 1 ? base + "_" + std::to_string(resultNumber) : base);
      var[r] = name;
      if (scatteredProducts.count(op))
        continue; // computed inside the gather_grad that reads it
      if (gatheredOperands.count(op))
        continue; // gathered by each matmul that reads it
      if (foldedViews.count(op))
        continue; // read in place by the transposes that read it
      if (producedInto(r))
        continue; // written transposed, in its transpose's buffer
      if (consumedTransposes.count(op))
        continue; // its reader reads its input, transposed
      if (stridedOps.count(op))
        continue; // read in place in its source's 16-bit copy
      if (epilogueAdds.count(op) || epilogueAddOf(op))
        continue; // a bias add its matmul computes, and that matmul's product
      if (isa<ReshapeOp>(op)) {
        auto in = bufferOf.find(op->getOperand(0));
        if (in != bufferOf.end())
          bufferOf[r] = in->second;
        continue;
      }
      if (foldedTransposes.count(op) || fusedMatmuls.count(op) || interior.count(r))
        continue; // never materialized
      if (neverStoredF32(r, opts.plan))
        continue; // every reader reads its 16-bit tensor (carve-plan-memory gave it no memory)
      Region reg = isa<ConstantOp>(op) ? Region::Constant : Region::Activation;
      int def = k;
      if (producedTransposes.count(op) || accumulatedAdds.count(op))
        def = index[producerOf(op)]; // written by it
      if (isa<CastOp>(op) && op->hasAttr(kCopyByWriterAttr)) {
        if (Operation *a = op->getOperand(0).getDefiningOp(); a && accumulatedAdds.count(a))
          def = index[producerOf(a)]; // the add's copy, written by its norm gradient
        if (Operation *c = op->getOperand(0).getDefiningOp(); c && assembledConcats.count(c))
          def = index[assemblerOf(c)]; // the pieces written into it by the attention gradient
        if (Operation *t = op->getOperand(0).getDefiningOp(); t && producedTransposes.count(t))
          def = index[producerOf(t)]; // O written into it by the attention forward
        if (Operation *e = op->getOperand(0).getDefiningOp(); e && epilogueAdds.count(e))
          def = index[epilogueMatmulOf(e)]; // written by the matmul that adds the bias
      }
      bufferOf[r] = newBuffer(reg, bytesOf(r), def, name);
      buffers.back().owner = r;
    }
  }
  // Reads.
  for (Operation *op : ops) {
    if (foldedTransposes.count(op) || fusedMatmuls.count(op) || scatteredProducts.count(op) ||
        gatheredOperands.count(op) || foldedViews.count(op) || producedTransposes.count(op) ||
        consumedTransposes.count(op) || assembledConcats.count(op) || stridedOps.count(op) ||
        epilogueAdds.count(op) || isa<ReshapeOp>(op))
      continue;
    if (accumulatedAdds.count(op)) {
      // Its norm gradient reads the residual, where it runs.
      Operation *g = producerOf(op);
      auto it = bufferOf.find(accumulatedResidual(g));
      if (it != bufferOf.end())
        buffers[it->second].lastUse = std::max(buffers[it->second].lastUse, index[g]);
      continue;
    }
    if (isa<TransposeOp>(op))
      if (std::optional<StridedView> view = foldedViewOf(op->getOperand(0))) {
        // The folded slice's source, read in place (transpose_view).
        Buffer &b = buffers[bufferOf.lookup(view->base)];
        b.lastUse = std::max(b.lastUse, readAt(op));
        continue;
      }
    if (Operation *g = gatheredOperand(op)) {
      // The left operand, and the gather's table and indices, where the
      // matmul gathers its right operand.
      for (Value v : {operandOf(op, 0), g->getOperand(0), g->getOperand(1)}) {
        Buffer &b = buffers[bufferOf.lookup(v)];
        b.lastUse = std::max(b.lastUse, index[op]);
      }
      continue;
    }
    if (Operation *m = transposedMatmul.lookup(op)) {
      for (unsigned i = 0; i < 2; ++i) {
        Buffer &b = buffers[bufferOf.lookup(operandOf(m, i))];
        b.lastUse = std::max(b.lastUse, index[op]);
      }
      continue;
    }
    if (Operation *m = scatterMatmul.lookup(op)) {
      // The matmul's operands and the indices, where the gather_grad runs.
      for (Value v : {operandOf(m, 0), operandOf(m, 1), op->getOperand(1)}) {
        Buffer &b = buffers[bufferOf.lookup(v)];
        b.lastUse = std::max(b.lastUse, index[op]);
      }
      continue;
    }
    // A matmul that computes an op marked "epilogue" reads that op's bias
    // or GELU input (as its 16-bit tensor) where it runs.
    if (Operation *e = epilogueAddOf(op); e && epilogueAdds.count(e)) {
      Value in;
      epilogueMatmulOf(e, &in);
      for (Value v : {in, exact16(in, op, opts.precision)}) {
        auto it = v ? bufferOf.find(v) : bufferOf.end();
        if (it != bufferOf.end())
          buffers[it->second].lastUse = std::max(buffers[it->second].lastUse, readAt(op));
      }
    }
    for (unsigned i = 0; i < op->getNumOperands(); ++i) {
      if (interior.count(operandOf(op, i)))
        continue; // computed in registers by the group's kernel
      Value in = consumedFrom(operandOf(op, i)); // read in place, transposed
      if (Value c = outputCopy16(operandOf(op, i)))
        in = c; // an attention output read as its transpose's 16-bit copy
      // q, k or v read in place in its source's 16-bit copy (directly, or
      // through an f32 view of its copy).
      Operation *d = operandOf(op, i).getDefiningOp();
      if (d && isa<CastOp>(d) && !stridedOps.count(d))
        d = d->getOperand(0).getDefiningOp();
      if (d && stridedOps.count(d))
        in = stridedPieceOf(d)->source16;
      auto it = bufferOf.find(in ? in : operandOf(op, i));
      if (it == bufferOf.end()) {
        // Never stored (neverStoredF32): the reader reads its 16-bit tensor,
        // which lives until then: the tensor an f32 view (through reshapes)
        // is of, or the value's 16-bit copy made before the reader.
        Value v = operandOf(op, i);
        while (auto r = v.getDefiningOp<ReshapeOp>())
          v = r.getInput();
        auto f32 = [](Value x) { return cast<ShapedType>(x.getType()).getElementType().isF32(); };
        Value t16;
        if (auto c = v.getDefiningOp<CastOp>(); c && !f32(c.getInput()))
          t16 = c.getInput();
        else if (f32(v))
          t16 = copy16Before(v, op, opts.plan.precision);
        if (auto s = t16 ? bufferOf.find(t16) : bufferOf.end(); s != bufferOf.end())
          buffers[s->second].lastUse = std::max(buffers[s->second].lastUse, readAt(op));
        continue;
      }
      Buffer &b = buffers[it->second];
      b.lastUse = std::max(b.lastUse, readAt(op));
    }
  }
  return true;
}

bool Generator::readActivations() {
  ActivationPlan plan;
  if (!readActivationPlan(fn, plan, error))
    return false;
  const std::string where = "@" + fn.getSymName().str() + " ";
  if (actBase == "S") {
    if (plan.slot < 0)
      return fail(where + kActivationPlanAttr +
                  " has no slot (a stage's per-micro-batch part; run carve-plan-memory)");
    slotLimit = plan.slot;
    sendLimit = plan.sends;
  }
  if (plan.copies.size() != grads.size())
    return fail(where + kActivationPlanAttr + " lists " + std::to_string(plan.copies.size()) +
                " gradient copies for " + std::to_string(grads.size()) + " gradients");
  std::map<int, int64_t> copyOffset;
  for (size_t i = 0; i < grads.size(); ++i)
    if (grads[i].copy)
      copyOffset[grads[i].buffer] = plan.copies[i];
  std::vector<int> act;
  for (int i = 0; i < (int)buffers.size(); ++i) {
    Buffer &b = buffers[i];
    if (b.region != Region::Activation)
      continue;
    int64_t off = -1;
    if (b.owner)
      off = activationOffsetOf(b.owner.getDefiningOp(), cast<OpResult>(b.owner).getResultNumber());
    else if (b.gatherArg >= 0)
      off = gatherOffsetsOf(fn, b.gatherArg)[b.gatherPass];
    else if (copyOffset.count(i))
      off = copyOffset[i];
    if (off < 0 || off + alignUp(std::max<int64_t>(b.bytes, 1)) > plan.bytes)
      return fail(where + "activation '" + b.name +
                  "' has no place in the activation region carve-plan-memory recorded (" +
                  kArenaOffsetAttr + " " + std::to_string(off) + ", region " +
                  std::to_string(plan.bytes) + " bytes)");
    b.offset = off;
    act.push_back(i);
  }
  // A stage: what one micro-batch keeps from its forward to its backward,
  // and what its forward sends read, must lie in its slot; what its
  // backward sends, in its send part (scratch is reused by the rank's next
  // call, before a send may have completed).
  if (slotLimit >= 0) {
    const int bb = firstBackwardOp(true);
    std::set<int> sentForward, sentBackward;
    for (Operation *op : ops)
      if (auto snd = dyn_cast<dist::SendOp>(op))
        (index[op] < bb ? sentForward : sentBackward).insert(bufferOf.lookup(snd.getInput()));
    for (int i : act) {
      const Buffer &b = buffers[i];
      const int64_t end = b.offset + std::max<int64_t>(b.bytes, 1);
      const bool kept = (b.def < bb && b.lastUse >= bb) || sentForward.count(i);
      if (kept && end > slotLimit)
        return fail(where + "activation '" + b.name +
                    (sentForward.count(i) ? "' is sent to another stage"
                                          : "' is kept from forward to backward") +
                    " but carve-plan-memory put it outside the slot (" + std::to_string(b.offset) +
                    "; the slot ends at " + std::to_string(slotLimit) + ")");
      if (sentBackward.count(i) && !kept && (b.offset < slotLimit || end > slotLimit + sendLimit))
        return fail(where + "activation '" + b.name +
                    "' is sent to another stage by backward but carve-plan-memory put it "
                    "outside the send part [" +
                    std::to_string(slotLimit) + ", " + std::to_string(slotLimit + sendLimit) +
                    ") (" + std::to_string(b.offset) + ")");
    }
  }
  // No two buffers that are live at once may share a byte.
  std::stable_sort(act.begin(), act.end(),
                   [&](int x, int y) { return buffers[x].def < buffers[y].def; });
  std::vector<int> live;
  for (int i : act) {
    const Buffer &b = buffers[i];
    std::vector<int> still;
    for (int j : live) {
      const Buffer &o = buffers[j];
      if (o.lastUse < b.def)
        continue;
      still.push_back(j);
      if (b.offset < o.offset + alignUp(std::max<int64_t>(o.bytes, 1)) &&
          o.offset < b.offset + alignUp(std::max<int64_t>(b.bytes, 1)))
        return fail(where + "the memory plan puts '" + b.name + "' over '" + o.name +
                    "', which is still read (op " + std::to_string(o.lastUse) + ")");
    }
    still.push_back(i);
    live = std::move(still);
  }
  out.activationBytes = plan.bytes;
  out.unplannedBytes = plan.unplanned;
  return true;
}

bool Generator::readBucketsOffIr(std::vector<Bucket> &buckets) {
  std::vector<GradientBucket> ir;
  if (!readBuckets(fn, ir, error))
    return false;
  for (const GradientBucket &b : ir)
    buckets.push_back(
        {(size_t)b.first, (size_t)b.last, b.bytes, (int)b.ready, (int)b.waitAt, b.axis == "edp"});
  return true;
}

bool Generator::collectGradients(
    func::ReturnOp ret, unsigned first, const std::string &what, bool computedHere,
    const std::function<void(unsigned result, unsigned param, Value grad)> &addSlot) {
  std::vector<GradientSlot> order;
  if (!readGradients(fn, order, error))
    return false;
  std::map<unsigned, size_t> position;
  for (size_t i = 0; i < order.size(); ++i) {
    position[order[i].result] = i;
    irGrad[order[i].result] = order[i];
  }
  const std::vector<std::optional<unsigned>> paramArgs = paramArgsOfGrads(fn);
  for (unsigned k = first; k < ret.getNumOperands(); ++k) {
    StringAttr of = gradOf(fn, k);
    if (!of)
      return fail(what + " result " + std::to_string(k) + " is not a gradient");
    std::optional<unsigned> param = paramArgs[k];
    Value g = ret.getOperand(k);
    if (!param || (computedHere && !g.getDefiningOp()))
      return fail("gradient of unknown parameter '" + of.getValue().str() + "'");
    Type e = typeOf(g).getElementType();
    if (!e.isF32() && !((e.isBF16() || e.isF16()) && fn.getArgAttr(*param, kMasterAttr)))
      return fail("the gradient of parameter '" + of.getValue().str() +
                  "' is neither float32 nor the 16-bit format of its copy (carve-store-grads16)");
    if (!position.count(k) || irGrad[k].param != *param)
      return fail(what + " " + kGradientsAttr + " does not list result " + std::to_string(k) +
                  " as the gradient of '" + of.getValue().str() + "'");
    addSlot(k, *param, g);
    if (!contractError.empty())
      return fail(contractError);
    grads.back().result = k;
  }
  if (grads.size() != order.size())
    return fail(what + " " + kGradientsAttr + " lists " + std::to_string(order.size()) +
                " gradients; the function returns " + std::to_string(grads.size()));
  // In the order carve-data-parallel gave them (backward finishes them so).
  std::stable_sort(grads.begin(), grads.end(), [&](const GradSlot &a, const GradSlot &b) {
    return position[a.result] < position[b.result];
  });
  return true;
}

/// ZeRO over dp (docs/partition.md, "ZeRO"): every trainable parameter's (tp-local)
/// elements are cut into dp chunks (carve.zero_chunk, the last padded); dp
/// rank d owns chunk d.
bool Generator::shardOverDp() {
  zero = opts.dp > 1 ? opts.zero : 0;
  const int64_t dp = opts.dp;
  for (GradSlot &g : grads) {
    int64_t n = typeOf(g.value).getNumElements();
    numelOf[g.param] = n;
    chunkOf[g.param] = zero ? zeroChunkOf(fn, g.param) : n;
    if (zero && chunkOf[g.param] * dp < n)
      return fail("parameter '" + paramName(g.param) + "' has no ZeRO chunk of its " +
                  std::to_string(n) + " elements over dp=" + std::to_string(dp) + " (" +
                  kZeroChunkAttr + "; run carve-data-parallel first)");
  }
  // Stage 1 and 2 gather parameters in place: pad them to dp * chunk.
  if (zero == 1 || zero == 2)
    for (auto &[arg, c] : chunkOf)
      buffers[bufferOf.lookup(fn.getArgument(arg))].bytes = dp * c * elementBytes(arg);
  return true;
}

bool Generator::readPersistent(int64_t base, PersistentLayout &l) {
  PersistentPlan plan;
  if (!readPersistentPlan(fn, plan, error))
    return false;
  const std::string where = "@" + fn.getSymName().str() + " " + kPersistentPlanAttr;
  if (plan.begin != base)
    return fail(where + " begins at byte " + std::to_string(plan.begin) +
                "; the program places it at " + std::to_string(base));
  if (plan.grads.size() != grads.size())
    return fail(where + " places " + std::to_string(plan.grads.size()) + " gradients of " +
                std::to_string(grads.size()));
  const int slots = opts.optimizer.stateTensors();
  // Every tensor placed, with the region it must lie in: [lo, hi).
  struct Placed {
    int64_t offset, size, lo, hi; // size: its bytes rounded up (an empty state takes none)
    std::string what;
  };
  auto rounded = [](int64_t bytes) { return alignUp(std::max<int64_t>(bytes, 1)); };
  std::vector<Placed> placed;
  for (BlockArgument a : fn.getArguments()) {
    Buffer &b = buffers[bufferOf.lookup(a)];
    if (b.region != Region::Param && (b.region != Region::Input || actBase == "S") &&
        b.region != Region::Seed)
      continue;
    b.offset = persistentOffsetOf(fn, a.getArgNumber());
    if (b.region == Region::Param)
      placed.push_back({b.offset, rounded(b.bytes), plan.begin, plan.paramsEnd, b.name});
    else
      placed.push_back({b.offset, rounded(b.bytes), plan.stateEnd, plan.end, b.name});
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    GradSlot &g = grads[i];
    Buffer &b = buffers[zero >= 2 ? shardOf[g.param] : g.buffer];
    b.offset = plan.grads[i];
    placed.push_back({b.offset, rounded(b.bytes), plan.paramsEnd, plan.gradsEnd,
                      "the gradient of " + paramName(g.param)});
    std::array<int64_t, 2> st = {plan.states[2 * i], plan.states[2 * i + 1]};
    for (int k = 0; k < 2; ++k) {
      if ((st[k] >= 0) != (k < slots))
        return fail(where + " keeps " + std::to_string(st[0] >= 0) + "+" +
                    std::to_string(st[1] >= 0) + " optimizer state tensors for " +
                    paramName(g.param) + "; " + opts.optimizer.describe() + " keeps " +
                    std::to_string(slots) + " (carve.plan's optimizer_state)");
      if (st[k] >= 0)
        placed.push_back({st[k], alignUp((zero ? chunkOf[g.param] : numelOf[g.param]) * 4),
                          plan.gradsEnd, plan.stateEnd,
                          "optimizer state " + std::to_string(k) + " of " + paramName(g.param)});
    }
    stateOf[g.param] = st;
    const int64_t master = i < plan.masters.size() ? plan.masters[i] : -1;
    if ((master >= 0) != (bool)fn.getArgAttr(g.param, kMasterAttr))
      return fail(where +
                  (master >= 0 ? " gives an fp32 master to " : " gives no fp32 master to ") +
                  paramName(g.param) +
                  (master >= 0 ? ", which is no 16-bit copy" : ", a 16-bit copy (carve.master)"));
    if (master >= 0) {
      placed.push_back({master, alignUp((zero ? chunkOf[g.param] : numelOf[g.param]) * 4),
                        plan.gradsEnd, plan.stateEnd, "the fp32 master of " + paramName(g.param)});
      masterOf[g.param] = master;
    }
  }
  // Each in its region, none over another.
  std::sort(placed.begin(), placed.end(),
            [](const Placed &x, const Placed &y) { return x.offset < y.offset; });
  int64_t prevEnd = plan.begin;
  std::string prev = "the region's start";
  for (const Placed &p : placed) {
    const int64_t end = p.offset + p.size;
    if (p.offset < p.lo || end > p.hi || p.offset < prevEnd)
      return fail(where + " places " + p.what + " at byte " + std::to_string(p.offset) +
                  (p.offset < prevEnd ? ", over " + prev
                                      : ", outside its region [" + std::to_string(p.lo) + ", " +
                                            std::to_string(p.hi) + ")"));
    prevEnd = end;
    prev = p.what;
  }
  l.begin = plan.begin;
  l.paramEnd = plan.paramsEnd;
  l.gradEnd = plan.gradsEnd;
  l.stateEnd = plan.stateEnd;
  l.end = plan.end;
  return true;
}

std::pair<int64_t, int64_t> Generator::bucketRange(const Bucket &bk) {
  const Buffer &first = buffers[grads[bk.first].buffer];
  const Buffer &last = buffers[grads[bk.last].buffer];
  return {first.offset, last.offset + alignUp(last.bytes)};
}

} // namespace carve::codegen
