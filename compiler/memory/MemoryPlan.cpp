//===- MemoryPlan.cpp - carve-plan-memory ---------------------------------===//
//
// The rules are in Passes.td; the records' format in dialects/carve/
// Contract.h. The emitter (compiler/codegen) reads the offsets back with the
// readers at the end of this file and checks them against its own live
// ranges before it prints a pointer.
//
//===----------------------------------------------------------------------===//

#include "compiler/memory/MemoryPlan.h"
#include "compiler/precision/Precision.h"

#include "compiler/dataparallel/DataParallel.h"
#include "compiler/fusion/Fusion.h"

#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"
#include "dialects/dist/DistDialect.h"

#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/DenseSet.h"

#include <algorithm>
#include <queue>

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVEPLANMEMORY
#include "compiler/memory/Passes.h.inc"
} // namespace carve

namespace carve {

/// A block's bytes rounded up to `align` (at least one unit).
static int64_t roundedTo(int64_t bytes, int64_t align) {
  return (std::max<int64_t>(bytes, 1) + align - 1) / align * align;
}

int64_t placeFirstFit(std::vector<ArenaBlock> &blocks, int64_t align, int64_t &unplanned) {
  auto rounded = [&](int64_t bytes) { return roundedTo(bytes, align); };
  std::vector<size_t> order(blocks.size());
  for (size_t i = 0; i < order.size(); ++i)
    order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return blocks[a].def < blocks[b].def; });
  // The placed blocks that may still be read, by offset (they never
  // overlap), and the same blocks by last use, to drop them once dead:
  // definitions only grow, so a block dead now stays dead.
  std::multimap<int64_t, int64_t> live; // offset -> end
  std::vector<std::multimap<int64_t, int64_t>::iterator> where(blocks.size());
  using Expiry = std::pair<int64_t, size_t>; // last use, block
  std::priority_queue<Expiry, std::vector<Expiry>, std::greater<Expiry>> expiry;
  int64_t peak = 0;
  unplanned = 0;
  for (size_t i : order) {
    ArenaBlock &b = blocks[i];
    const int64_t size = rounded(b.bytes);
    unplanned += size;
    while (!expiry.empty() && expiry.top().first < b.def) {
      live.erase(where[expiry.top().second]);
      expiry.pop();
    }
    // The lowest offset where `size` bytes overlap no live block.
    int64_t at = 0;
    for (auto &[lo, hi] : live) {
      if (at + size <= lo)
        break;
      at = std::max(at, hi);
    }
    b.offset = at;
    peak = std::max(peak, at + size);
    where[i] = live.emplace(at, at + size);
    expiry.push({b.lastUse, i});
  }
  return peak;
}

int64_t placeBySize(std::vector<ArenaBlock> &blocks, int64_t align, int64_t &unplanned) {
  auto rounded = [&](int64_t bytes) { return roundedTo(bytes, align); };
  std::vector<size_t> order(blocks.size());
  for (size_t i = 0; i < order.size(); ++i)
    order[i] = i;
  // Largest first; among equals, in order of definition (stable).
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const int64_t sa = rounded(blocks[a].bytes), sb = rounded(blocks[b].bytes);
    return sa != sb ? sa > sb : blocks[a].def < blocks[b].def;
  });
  struct Placed {
    int64_t lo, hi, def, lastUse;
  };
  std::vector<Placed> placed; // by offset
  int64_t peak = 0;
  unplanned = 0;
  for (size_t i : order) {
    ArenaBlock &b = blocks[i];
    const int64_t size = rounded(b.bytes);
    unplanned += size;
    // The lowest offset where `size` bytes overlap no placed block live at
    // the same time (one is dead for the other when its last use comes
    // before the other's definition).
    int64_t at = 0;
    for (const Placed &p : placed) {
      if (p.lastUse < b.def || b.lastUse < p.def)
        continue;
      if (at + size <= p.lo)
        break;
      at = std::max(at, p.hi);
    }
    b.offset = at;
    peak = std::max(peak, at + size);
    Placed me{at, at + size, b.def, b.lastUse};
    placed.insert(std::upper_bound(placed.begin(), placed.end(), me,
                                   [](const Placed &x, const Placed &y) { return x.lo < y.lo; }),
                  me);
  }
  return peak;
}

int64_t placeBlocks(std::vector<ArenaBlock> &blocks, int64_t align, int64_t &unplanned,
                    const std::string &placement) {
  if (placement == "first-fit")
    return placeFirstFit(blocks, align, unplanned);
  if (placement == "largest-first")
    return placeBySize(blocks, align, unplanned);
  std::vector<ArenaBlock> bySize = blocks;
  int64_t unused = 0;
  const int64_t sized = placeBySize(bySize, align, unused);
  const int64_t first = placeFirstFit(blocks, align, unplanned);
  if (sized < first) {
    blocks = std::move(bySize);
    return sized;
  }
  return first;
}

} // namespace carve

namespace {

using namespace carve;

int64_t bytesOf(Value v) {
  auto t = dyn_cast<RankedTensorType>(v.getType());
  if (!t || !t.hasStaticShape() || !t.getElementType().isIntOrFloat())
    return 0; // the emitter refuses such a type
  unsigned bits = t.getElementType().getIntOrFloatBitWidth();
  return t.getNumElements() * (bits == 1 ? 1 : (int64_t)(bits + 7) / 8);
}

/// The bytes of one element of `v` (a 16-bit parameter copy: 2).
int64_t elementBytes(Value v) {
  auto t = cast<RankedTensorType>(v.getType());
  return std::max<int64_t>(1, t.getElementType().getIntOrFloatBitWidth() / 8);
}

bool isF32(Value v) { return cast<ShapedType>(v.getType()).getElementType().isF32(); }

/// The buffers of one function and their live ranges, as the emitter
/// declares them (the same rules, in the same order).
class Model {
public:
  Model(func::FuncOp fn, int64_t dp, int64_t zero, bool fp32Accumulators, const PlanAttrs &plan,
        std::string placement)
      : fn(fn), dp(dp), zero(zero), fp32Accumulators(fp32Accumulators),
        cuda16(plan.target == "cuda" && plan.precision != "fp32"), plan16(cuda16 ? &plan : nullptr),
        order(fn), placement(std::move(placement)), ops(order.ops), index(order.index),
        interior(order.interior) {
    stage = fn->hasAttr(kStageAttr);
  }

  /// The bytes per element of the ZeRO-2/3 chunk that accumulates gradient
  /// `g`: fp32 accumulators of 16-bit gradients (PlanAttrs::
  /// fp32ChunkAccumulators) 4, else the gradient's own.
  int64_t accumulatorBytes(Value g) const { return fp32Accumulators ? 4 : elementBytes(g); }

  LogicalResult build() {
    const int64_t end = (int64_t)ops.size();
    declareResults();
    countReads();
    auto ret = cast<func::ReturnOp>(fn.getBody().front().getTerminator());
    std::string error;
    std::vector<GradientSlot> order;
    std::vector<GradientBucket> buckets;
    if (!readGradients(fn, order, error) || !readBuckets(fn, buckets, error))
      return fn.emitError() << error;
    if (stage) {
      const int64_t bb = this->order.backwardBegin(true);
      for (Operation *op : ops)
        if (auto snd = dyn_cast<dist::SendOp>(op)) {
          extend(snd.getInput(), end); // read until the send has completed
          if (bufferOf(snd.getInput()) >= 0)
            (index.lookup(op) < bb ? sendBlocks : backwardSendBlocks)
                .insert(bufferOf(snd.getInput()));
        }
      if (ret.getNumOperands() > 0 && fn.getResultAttr(0, kLossAttr))
        extend(ret.getOperand(0), end);
      if (zero < 2) {
        for (const GradientSlot &s : order)
          extend(ret.getOperand(s.result), s.ready); // accumulated when final
      } else {
        // ZeRO-2 and 3: each micro-batch's gradient is read by its bucket's
        // reduce-scatter until the bucket is waited for; the reduced chunk
        // lands in a staging buffer (carve.activation_plan's copies), added
        // to the fp32 chunk accumulator at that wait.
        for (const GradientBucket &k : buckets)
          for (int64_t i = k.first; i <= k.last; ++i) {
            const GradientSlot &s = order[i];
            extend(ret.getOperand(s.result), k.waitAt);
            int b = add(true, zeroChunkOf(fn, s.param) * elementBytes(ret.getOperand(s.result)),
                        k.ready);
            blocks[b].lastUse = k.waitAt;
            copyBlock[s.result] = b;
          }
      }
      addGathers(order);
      return success();
    }
    if (ret.getNumOperands() > 0)
      extend(ret.getOperand(0), end); // the loss, read by the tail
    overwriteLogits();
    // Gradient slots, in result order (as the emitter creates them).
    std::vector<GradientSlot> byResult = order;
    std::stable_sort(
        byResult.begin(), byResult.end(),
        [](const GradientSlot &a, const GradientSlot &b) { return a.result < b.result; });
    std::map<unsigned, int> gradBlock; // result -> its block
    for (const GradientSlot &s : byResult) {
      Value g = ret.getOperand(s.result);
      int b = bufferOf(g);
      if (s.copy) {
        extend(g, end);
        gradBlock[s.result] = add(false, bytesOf(g), end);
        copyBlock[s.result] = gradBlock[s.result];
      } else if (b >= 0) {
        activation[b] = false; // the gradient region
        gradBlock[s.result] = b;
      }
    }
    addGathers(order);
    // ZeRO-2 and 3: the whole gradients are activations until their bucket
    // is waited for.
    if (zero >= 2) {
      for (auto &[result, b] : gradBlock)
        activation[b] = true;
      for (const GradientBucket &k : buckets)
        for (int64_t i = k.first; i <= k.last; ++i) {
          ArenaBlock &b = blocks[gradBlock[order[i].result]];
          b.lastUse = std::max(b.lastUse, k.waitAt);
        }
    }
    return success();
  }

  /// Places the activations and writes the records.
  int64_t placeAndRecord() {
    std::vector<ArenaBlock> act;
    std::vector<int> which;
    for (size_t b = 0; b < blocks.size(); ++b)
      if (activation[b]) {
        act.push_back(blocks[b]);
        which.push_back((int)b);
      }
    int64_t unplanned = 0, slot = -1, sends = 0, peak = 0;
    if (!stage) {
      peak = placeBlocks(act, kArenaAlign, unplanned, placement);
      for (size_t i = 0; i < act.size(); ++i)
        blocks[which[i]].offset = act[i].offset;
    } else {
      // A stage's regions are placed in parts below; the sum without reuse
      // is the same.
      for (const ArenaBlock &blk : act)
        unplanned +=
            (std::max<int64_t>(blk.bytes, 1) + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
      // A stage's slot holds what one micro-batch keeps between its forward
      // and its backward, and what its forward sends; then what its backward
      // sends (read until the send has completed, which may be after the
      // backward); the rest is scratch, which every call on the rank reuses.
      const int64_t bb = order.backwardBegin(true);
      std::vector<ArenaBlock> part[3];
      std::vector<int> of[3];
      for (size_t i = 0; i < act.size(); ++i) {
        const ArenaBlock &blk = blocks[which[i]];
        const int k = (blk.def < bb && blk.lastUse >= bb) || sendBlocks.count(which[i]) ? 0
                      : backwardSendBlocks.count(which[i])                              ? 1
                                                                                        : 2;
        part[k].push_back(blk);
        of[k].push_back(which[i]);
      }
      int64_t unused = 0, bytes[3];
      for (int k = 0; k < 3; ++k)
        bytes[k] = (placeBlocks(part[k], kArenaAlign, unused, placement) + kArenaAlign - 1) /
                   kArenaAlign * kArenaAlign;
      const int64_t base[3] = {0, bytes[0], bytes[0] + bytes[1]};
      for (int k = 0; k < 3; ++k)
        for (size_t i = 0; i < part[k].size(); ++i)
          blocks[of[k][i]].offset = part[k][i].offset + base[k];
      slot = bytes[0];
      sends = bytes[1];
      peak = bytes[0] + bytes[1] + bytes[2];
    }

    Builder b(fn.getContext());
    for (Operation *op : ops) {
      SmallVector<int64_t> offsets;
      bool any = false;
      for (Value r : op->getResults()) {
        auto it = owned.find(r);
        int64_t off = it != owned.end() && activation[it->second] ? blocks[it->second].offset : -1;
        any |= off >= 0;
        offsets.push_back(off);
      }
      if (any)
        op->setAttr(kArenaOffsetAttr, b.getDenseI64ArrayAttr(offsets));
    }
    std::map<unsigned, std::array<int64_t, 2>> gathers;
    for (auto &[key, blk] : gathered) {
      auto it = gathers.try_emplace(key.first, std::array<int64_t, 2>{-1, -1}).first;
      it->second[key.second] = blocks[blk].offset;
    }
    {
      ArgAttrEdits edits(fn);
      for (auto &[arg, offs] : gathers)
        edits.set(arg, kZero3GatherOffsetsAttr, b.getDenseI64ArrayAttr(offs));
    }
    std::vector<GradientSlot> order;
    std::string error;
    readGradients(fn, order, error);
    SmallVector<int64_t> copies;
    for (const GradientSlot &s : order) {
      auto it = copyBlock.find(s.result);
      copies.push_back(it != copyBlock.end() && activation[it->second] ? blocks[it->second].offset
                                                                       : -1);
    }
    SmallVector<NamedAttribute> fields = {
        b.getNamedAttr("bytes", b.getI64IntegerAttr(peak)),
        b.getNamedAttr("copies", b.getDenseI64ArrayAttr(copies)),
        b.getNamedAttr("unplanned", b.getI64IntegerAttr(unplanned))};
    if (stage) {
      fields.push_back(b.getNamedAttr("sends", b.getI64IntegerAttr(sends)));
      fields.push_back(b.getNamedAttr("slot", b.getI64IntegerAttr(slot)));
    }
    fn->setAttr(kActivationPlanAttr, b.getDictionaryAttr(fields));
    return (int64_t)act.size();
  }

  /// The persistent tensors from byte `base`: parameters and buffers,
  /// gradient slots (ZeRO >= 2: chunks) in carve.gradients' order,
  /// `stateTensors` optimizer tensors per gradient; then @train_step's
  /// inputs and loss seed, or a stage's loss seed (its inputs are where
  /// `inputs` says: the rank's program puts them first). Records them;
  /// returns the end (a stage: rounded up to the alignment).
  int64_t layoutPersistent(int64_t base, int64_t stateTensors,
                           const std::map<std::string, int64_t> &inputs) {
    auto align = [](int64_t x) { return (x + kArenaAlign - 1) / kArenaAlign * kArenaAlign; };
    std::vector<GradientSlot> order;
    std::string error;
    readGradients(fn, order, error);
    auto ret = fn.getBody().front().getTerminator();
    std::map<unsigned, int64_t> chunk; // parameter argument -> ZeRO chunk
    if (zero)
      for (const GradientSlot &s : order)
        chunk[s.param] = zeroChunkOf(fn, s.param);
    Builder b(fn.getContext());
    ArgAttrEdits offsets(fn); // applied before the plan is recorded below
    auto placeArg = [&](unsigned a, int64_t bytes, int64_t &at) {
      offsets.set(a, kPersistentOffsetAttr, b.getI64IntegerAttr(at));
      at += align(std::max<int64_t>(bytes, 1));
    };
    int64_t at = base;
    for (BlockArgument a : fn.getArguments()) {
      unsigned i = a.getArgNumber();
      if (!fn.getArgAttr(i, kParamAttr) && !fn.getArgAttr(i, kBufferAttr))
        continue;
      int64_t bytes = bytesOf(a);
      if (chunk.count(i) && (zero == 1 || zero == 2))
        bytes = dp * chunk[i] * elementBytes(a); // gathered in place: dp whole chunks
      else if (chunk.count(i) && zero == 3 && fn.getArgAttr(i, kZero3GatherAttr))
        bytes = chunk[i] * elementBytes(a); // this rank's chunk only
      placeArg(i, bytes, at);
    }
    const int64_t paramsEnd = at;
    SmallVector<int64_t> grads, states, masters;
    for (const GradientSlot &s : order) {
      grads.push_back(at);
      at += align(
          std::max<int64_t>(zero >= 2 ? chunk[s.param] * accumulatorBytes(ret->getOperand(s.result))
                                      : bytesOf(ret->getOperand(s.result)),
                            1));
    }
    const int64_t gradsEnd = at;
    for (const GradientSlot &s : order)
      for (int k = 0; k < 2; ++k) {
        states.push_back(k < stateTensors ? at : -1);
        if (k < stateTensors)
          at += align((zero ? chunk[s.param] : numelOf(ret->getOperand(s.result))) * 4);
      }
    // The fp32 masters of 16-bit parameter copies (carve-store-params16),
    // chunked as the optimizer state is.
    for (const GradientSlot &s : order) {
      masters.push_back(fn.getArgAttr(s.param, kMasterAttr) ? at : -1);
      if (fn.getArgAttr(s.param, kMasterAttr))
        at += align((zero ? chunk[s.param] : numelOf(ret->getOperand(s.result))) * 4);
    }
    const int64_t stateEnd = at;
    for (BlockArgument a : fn.getArguments()) {
      unsigned i = a.getArgNumber();
      if (fn.getArgAttr(i, kLossSeedAttr) || (!stage && fn.getArgAttr(i, kInputAttr)))
        placeArg(i, bytesOf(a), at);
      else if (auto in = fn.getArgAttrOfType<StringAttr>(i, kInputAttr)) {
        auto it = inputs.find(in.getValue().str());
        offsets.set(i, kPersistentOffsetAttr,
                    b.getI64IntegerAttr(it == inputs.end() ? -1 : it->second));
      }
    }
    offsets.apply();
    const int64_t end = stage ? align(at) : at;
    auto i64 = [&](int64_t x) { return b.getI64IntegerAttr(x); };
    fn->setAttr(
        kPersistentPlanAttr,
        b.getDictionaryAttr({b.getNamedAttr("begin", i64(base)), b.getNamedAttr("end", i64(end)),
                             b.getNamedAttr("grads", b.getDenseI64ArrayAttr(grads)),
                             b.getNamedAttr("grads_end", i64(gradsEnd)),
                             b.getNamedAttr("masters", b.getDenseI64ArrayAttr(masters)),
                             b.getNamedAttr("params_end", i64(paramsEnd)),
                             b.getNamedAttr("state_end", i64(stateEnd)),
                             b.getNamedAttr("states", b.getDenseI64ArrayAttr(states))}));
    return end;
  }

private:
  /// ZeRO-3: a gathered buffer per parameter and pass, in argument order.
  void addGathers(const std::vector<GradientSlot> &order) {
    if (zero != 3)
      return;
    for (const GradientSlot &s : sortedByParam(order)) {
      std::array<int64_t, 4> r;
      if (!zero3GatherOf(fn, s.param, r))
        continue;
      const int64_t chunk = zeroChunkOf(fn, s.param);
      const std::array<int64_t, 2> issue = zero3IssueOf(fn, s.param);
      for (int pass = 0; pass < 2; ++pass)
        if (r[2 * pass] >= 0) {
          // Written from where its gather starts (a prefetch: earlier).
          int b = add(true, dp * chunk * elementBytes(fn.getArgument(s.param)), issue[pass] - 1);
          blocks[b].lastUse = r[2 * pass + 1];
          gathered[{s.param, pass}] = b;
        }
    }
  }

  /// A cross-entropy gradient's 16-bit copy takes the bytes of the logits'
  /// 16-bit tensor it reads (logitsOverwrittenBy) where the gradient is the
  /// logits' last reader: one block from the logits' writer to the
  /// gradient's last reader (GPT-2 small at batch 8: 823 MB less at the
  /// peak, where the backward starts).
  void overwriteLogits() {
    if (!plan16)
      return;
    for (Operation *op : ops) {
      auto c = dyn_cast<CastOp>(op);
      Value l16 = c ? logitsOverwrittenBy(c.getResult(), *plan16) : Value();
      if (!l16)
        continue;
      const int bl = bufferOf(l16), bc = bufferOf(c.getResult());
      Operation *grad = c.getInput().getDefiningOp();
      if (bl < 0 || bc < 0 || bl == bc || !activation[bl] || !activation[bc] ||
          blocks[bl].bytes != blocks[bc].bytes || blocks[bl].lastUse > index.lookup(grad))
        continue;
      blocks[bl].lastUse = std::max(blocks[bl].lastUse, blocks[bc].lastUse);
      for (auto &[v, b] : buffer)
        if (b == bc)
          b = bl;
      owned[c.getResult()] = bl;
      activation[bc] = false; // no block of its own
      ++overwritten;
    }
  }

  static int64_t numelOf(Value v) { return cast<RankedTensorType>(v.getType()).getNumElements(); }
  int add(bool isActivation, int64_t bytes, int64_t def) {
    ArenaBlock blk;
    blk.bytes = bytes;
    blk.def = def;
    blocks.push_back(blk);
    activation.push_back(isActivation);
    return (int)blocks.size() - 1;
  }
  int bufferOf(Value v) {
    auto it = buffer.find(v);
    return it == buffer.end() ? -1 : it->second;
  }
  void extend(Value v, int64_t at) {
    // A piece read in place in its source's 16-bit copy (carve-fold-views'
    // "strided"): the copy lives until then.
    if (std::optional<StridedPiece> piece = stridedPieceOf(v.getDefiningOp()))
      v = piece->source16;
    int b = bufferOf(v);
    if (b >= 0)
      blocks[b].lastUse = std::max(blocks[b].lastUse, at);
  }
  static std::vector<GradientSlot> sortedByParam(std::vector<GradientSlot> v) {
    std::stable_sort(v.begin(), v.end(), [](const GradientSlot &a, const GradientSlot &b) {
      return a.param < b.param;
    });
    return v;
  }

  void declareResults() {
    for (BlockArgument a : fn.getArguments())
      buffer[a] = add(false, bytesOf(a), -1);
    for (Operation *op : ops) {
      const int64_t k = index.lookup(op);
      for (Value r : op->getResults()) {
        if (isa<ReshapeOp>(op)) {
          int b = bufferOf(op->getOperand(0));
          if (b >= 0)
            buffer[r] = b;
          continue;
        }
        if (foldOf(op) == kFoldOperand || foldOf(op) == kFoldView || isProductMatmul(op) ||
            isScatteredProduct(op) || isGatheredOperand(op) || interior.count(r) ||
            producedInto(r) || foldOf(op) == kFoldConsumer || foldOf(op) == kFoldStrided ||
            foldOf(op) == kFoldEpilogue || epilogueAddOf(op))
          continue; // never materialized (the last five: carve-fold-views)
        if (plan16 && neverStoredF32(r, *plan16))
          continue; // read as its 16-bit tensor by every reader (CUDA)
        // On the CUDA target under bf16/fp16, a 16-bit copy right after the
        // op that writes its input (after other such copies) may be written
        // by that op (carve-select-kernels' rule 3e, carve.write16): it lives
        // from there.
        // Likewise the copies right after a fused chain's root, which the
        // chain's kernel may write (rule 3f): from the root.
        // (Through reshapes: a reduction writes the cast of its reshaped
        // result, rule 3h.)
        int64_t born = k;
        if (Operation *p = producerOf(op); p && index.count(p))
          born = index.lookup(p); // written by its input's op, transposed
        if (cuda16 && isa<CastOp>(op) && !isF32(r))
          if (Operation *w = aliasRoot(op->getOperand(0)).getDefiningOp(); w && index.count(w)) {
            Operation *at = order.rootOf.lookup(w);
            if (!at)
              at = w;
            for (Operation *n = at->getNextNode(); n && isa<CastOp, ReshapeOp>(n);
                 n = n->getNextNode())
              if (n == op && index.count(at)) {
                born = index.lookup(at);
                // An add a norm gradient computes, or an attention output's
                // transpose its forward writes: the copy is written there.
                if (Operation *p = producerOf(at); p && index.count(p))
                  born = index.lookup(p);
                // An assembled concat: cuDNN's attention gradient writes
                // the pieces into the copy.
                if (Operation *g = assemblerOf(at); g && index.count(g))
                  born = index.lookup(g);
                // A bias add its matmul computes: written by the matmul.
                if (Operation *m = epilogueMatmulOf(at); m && index.count(m))
                  born = index.lookup(m);
              }
          }
        buffer[r] = add(!isa<ConstantOp>(op), bytesOf(r), born);
        // Written there: live at least until then, read or not (an unread
        // result must not share bytes with what its op, or another op
        // writing from the same point, writes beside it).
        blocks[buffer[r]].lastUse = born;
        owned[r] = buffer[r];
      }
    }
  }

  void countReads() {
    for (Operation *op : ops) {
      if (foldOf(op) == kFoldOperand || foldOf(op) == kFoldView || foldOf(op) == kFoldProducer ||
          foldOf(op) == kFoldConsumer || foldOf(op) == kFoldAssemble ||
          foldOf(op) == kFoldStrided || foldOf(op) == kFoldEpilogue || isProductMatmul(op) ||
          isScatteredProduct(op) || isGatheredOperand(op) || isa<ReshapeOp>(op))
        continue;
      if (foldOf(op) == kFoldAccumulate) {
        // Computed by its norm gradient, which reads the residual there.
        if (Operation *g = producerOf(op); g && index.count(g))
          extend(accumulatedResidual(g), index.lookup(g));
        continue;
      }
      if (isa<TransposeOp>(op))
        if (std::optional<StridedView> view = foldedViewOf(op->getOperand(0))) {
          // Reads the folded slice's source in place (carve-fold-views).
          extend(view->base, order.readAt(op));
          continue;
        }
      if (Operation *g = gatheredOperand(op)) { // gathers its right operand: the gather's reads
        extend(readOperand(op, 0), index.lookup(op));
        extend(g->getOperand(0), index.lookup(op));
        extend(g->getOperand(1), index.lookup(op));
        continue;
      }
      if (foldOf(op) == kFoldProduct) { // runs as its matmul, reading the matmul's operands
        Operation *m = op->getOperand(0).getDefiningOp();
        for (unsigned i = 0; i < 2; ++i) {
          extend(readOperand(m, i), index.lookup(op));
          extendCopy16(readOperand(m, i), op);
        }
        continue;
      }
      if (Operation *m = scatteredMatmul(op)) { // computes its matmul: its operands, the indices
        for (unsigned i = 0; i < 2; ++i)
          extend(readOperand(m, i), index.lookup(op));
        extend(op->getOperand(1), index.lookup(op));
        continue;
      }
      if (Operation *e = epilogueAddOf(op)) { // adds its add's bias (cuBLASLt's epilogue)
        Value bias;
        epilogueMatmulOf(e, &bias);
        extend(bias, index.lookup(op));
        extendCopy16(bias, op);
      }
      for (unsigned i = 0; i < op->getNumOperands(); ++i) {
        Value v = readOperand(op, i);
        if (Value in = consumedFrom(v))
          v = in; // read in place, transposed (carve-fold-views)
        if (Value c = outputCopy16(v))
          v = c; // an attention output read as its transpose's 16-bit copy
        if (!interior.count(v))
          extend(v, order.readAt(op));
        // (A cross-entropy and its gradient, not vocab-parallel, read the
        // logits' 16-bit tensor, through an f32 view or as the copy made
        // before them.)
        if ((isa<MatmulOp>(op) && i < 2) || (isa<AttentionGradStatsOp>(op) && (i < 3 || i == 5)) ||
            (isa<Conv2dOp, Conv2dGradInputOp, Conv2dGradWeightOp>(op) && i < 2) ||
            (plan16 && readsExact16(op, i, *plan16)) ||
            (plan16 && isa<CrossEntropyOp, CrossEntropyGradOp>(op) && i == 0 &&
             !op->getAttrOfType<IntegerAttr>(kShardedRowsAttr)))
          extendCopy16(v, op);
      }
    }
  }

  /// A matmul (or cuDNN's attention gradient or convolution, or a kernel of
  /// readsExact16)
  /// on the CUDA target reads the 16-bit tensor of an f32 operand's bits
  /// instead of the operand (carve-select-kernels' carve.read16, stored16,
  /// exact16): the tensor the operand is a view of (through reshapes), or
  /// its 16-bit copy made before it (carve-round-operands16). That tensor
  /// lives until the reader (a fused chain's: its root).
  void extendCopy16(Value v, Operation *reader) {
    const int64_t at = order.readAt(reader);
    v = aliasRoot(v);
    if (auto c = v.getDefiningOp<CastOp>()) {
      Type from = cast<ShapedType>(c.getInput().getType()).getElementType();
      if (from.isBF16() || from.isF16())
        extend(c.getInput(), at);
    }
    for (Operation *u : v.getUsers()) {
      auto c = dyn_cast<CastOp>(u);
      if (!c || c->getBlock() != reader->getBlock() || !c->isBeforeInBlock(reader))
        continue;
      Type t = cast<ShapedType>(c.getType()).getElementType();
      if (t.isBF16() || t.isF16())
        extend(c.getResult(), at);
    }
  }

  func::FuncOp fn;
  int64_t dp, zero;
  bool fp32Accumulators;
  bool cuda16;             // the CUDA target under a bf16/fp16 plan
  const PlanAttrs *plan16; // its plan (null otherwise)
  bool stage = false;
  ProgramOrder order;
  std::string placement; // the pass option
  const std::vector<Operation *> &ops;
  const llvm::DenseMap<Operation *, int64_t> &index;
  const llvm::DenseSet<Value> &interior;
  std::vector<ArenaBlock> blocks;
  std::vector<bool> activation;
  llvm::DenseMap<Value, int> buffer, owned;
  std::map<unsigned, int> copyBlock;                // gradient result -> its copy's block
  std::set<int> sendBlocks, backwardSendBlocks;     // a stage's blocks that sends read
  std::map<std::pair<unsigned, int>, int> gathered; // (argument, pass) -> block
  int64_t overwritten = 0;                          // gradients over their logits (overwriteLogits)
};

struct PlanMemoryPass : carve::impl::CarvePlanMemoryBase<PlanMemoryPass> {
  using CarvePlanMemoryBase::CarvePlanMemoryBase;
  void runOnOperation() override {
    ModuleOp module = getOperation();
    if (placement != "best" && placement != "first-fit" && placement != "largest-first") {
      module.emitError() << "carve-plan-memory: placement '" << placement
                         << "' is not best, first-fit or largest-first";
      return signalPassFailure();
    }
    FailureOr<PlanAttrs> plan = readPlan(module);
    if (failed(plan))
      return signalPassFailure();
    const int64_t zero = plan->dp > 1 ? plan->zero : 0;
    std::map<int64_t, func::FuncOp> stages;
    for (auto fn : module.getOps<func::FuncOp>()) {
      if (!isEmittedFunction(fn))
        continue;
      Model m(fn, plan->dp, zero, plan->fp32ChunkAccumulators(), *plan, placement);
      if (failed(m.build()))
        return signalPassFailure();
      numBuffers += m.placeAndRecord();
      if (auto s = fn->getAttrOfType<IntegerAttr>(kStageAttr))
        stages[s.getInt()] = fn;
      else
        m.layoutPersistent(0, plan->optimizerState, {});
    }
    if (stages.empty())
      return;
    // Pipeline rank r runs stages r, r + pp, ...: its graph inputs first (every
    // micro-batch, as its first stage lists them), then each chunk's
    // persistent tensors one after another.
    const int64_t pp = plan->pp, v = (int64_t)stages.size() / std::max<int64_t>(pp, 1);
    for (int64_t r = 0; r < pp; ++r) {
      if (!stages.count(r)) {
        module.emitError() << "carve-plan-memory: pipeline rank " << r << " has no @stage" << r;
        return signalPassFailure();
      }
      func::FuncOp first = stages[r];
      std::map<std::string, int64_t> inputs;
      int64_t at = 0;
      for (BlockArgument a : first.getArguments())
        if (auto in = first.getArgAttrOfType<StringAttr>(a.getArgNumber(), kInputAttr)) {
          inputs[in.getValue().str()] = at;
          at += (bytesOf(a) * plan->microBatches + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
        }
      for (int64_t c = 0; c < v; ++c) {
        auto it = stages.find(c * pp + r);
        if (it == stages.end())
          continue;
        Model m(it->second, plan->dp, zero, plan->fp32ChunkAccumulators(), *plan, placement);
        at = m.layoutPersistent(at, plan->optimizerState, inputs);
      }
    }
  }
};

} // namespace

namespace carve {

bool readActivationPlan(func::FuncOp fn, ActivationPlan &plan, std::string &error) {
  auto d = fn->getAttrOfType<DictionaryAttr>(kActivationPlanAttr);
  auto bytes = d ? d.getAs<IntegerAttr>("bytes") : IntegerAttr();
  auto unplanned = d ? d.getAs<IntegerAttr>("unplanned") : IntegerAttr();
  auto copies = d ? d.getAs<DenseI64ArrayAttr>("copies") : DenseI64ArrayAttr();
  if (!bytes || !unplanned || !copies) {
    error = "@" + fn.getSymName().str() + " has no valid " + std::string(kActivationPlanAttr) +
            " (run carve-plan-memory first)";
    return false;
  }
  plan.bytes = bytes.getInt();
  plan.unplanned = unplanned.getInt();
  auto slot = d.getAs<IntegerAttr>("slot");
  auto sends = d.getAs<IntegerAttr>("sends");
  plan.slot = slot ? slot.getInt() : -1;
  plan.sends = sends ? sends.getInt() : 0;
  if (plan.slot + plan.sends > plan.bytes || plan.sends < 0) {
    error = "@" + fn.getSymName().str() + " " + std::string(kActivationPlanAttr) + ": slot " +
            std::to_string(plan.slot) + " and sends " + std::to_string(plan.sends) +
            " are larger than the region (" + std::to_string(plan.bytes) + " bytes)";
    return false;
  }
  plan.copies.assign(copies.asArrayRef().begin(), copies.asArrayRef().end());
  return true;
}

bool readPersistentPlan(func::FuncOp fn, PersistentPlan &plan, std::string &error) {
  auto d = fn->getAttrOfType<DictionaryAttr>(kPersistentPlanAttr);
  auto get = [&](StringRef k, int64_t &x) {
    auto a = d ? d.getAs<IntegerAttr>(k) : IntegerAttr();
    if (a)
      x = a.getInt();
    return (bool)a;
  };
  auto grads = d ? d.getAs<DenseI64ArrayAttr>("grads") : DenseI64ArrayAttr();
  auto states = d ? d.getAs<DenseI64ArrayAttr>("states") : DenseI64ArrayAttr();
  auto masters = d ? d.getAs<DenseI64ArrayAttr>("masters") : DenseI64ArrayAttr();
  if (!get("begin", plan.begin) || !get("params_end", plan.paramsEnd) ||
      !get("grads_end", plan.gradsEnd) || !get("state_end", plan.stateEnd) ||
      !get("end", plan.end) || !grads || !states || states.size() != 2 * grads.size() || !masters ||
      masters.size() != grads.size() ||
      !(plan.begin <= plan.paramsEnd && plan.paramsEnd <= plan.gradsEnd &&
        plan.gradsEnd <= plan.stateEnd && plan.stateEnd <= plan.end)) {
    error = "@" + fn.getSymName().str() + " has no valid " + std::string(kPersistentPlanAttr) +
            " (run carve-plan-memory first)";
    return false;
  }
  plan.grads.assign(grads.asArrayRef().begin(), grads.asArrayRef().end());
  plan.states.assign(states.asArrayRef().begin(), states.asArrayRef().end());
  plan.masters.assign(masters.asArrayRef().begin(), masters.asArrayRef().end());
  return true;
}

int64_t persistentOffsetOf(func::FuncOp fn, unsigned arg) {
  auto a = fn.getArgAttrOfType<IntegerAttr>(arg, kPersistentOffsetAttr);
  return a ? a.getInt() : -1;
}

int64_t activationOffsetOf(Operation *op, unsigned result) {
  auto a = op->getAttrOfType<DenseI64ArrayAttr>(kArenaOffsetAttr);
  if (!a || (unsigned)a.size() != op->getNumResults())
    return -2;
  return a[result];
}

std::array<int64_t, 2> gatherOffsetsOf(func::FuncOp fn, unsigned arg) {
  auto a = fn.getArgAttrOfType<DenseI64ArrayAttr>(arg, kZero3GatherOffsetsAttr);
  if (!a || a.size() != 2)
    return {-1, -1};
  return {a[0], a[1]};
}

} // namespace carve
