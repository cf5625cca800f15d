//===- PipelineStage.cpp - one pipeline chunk's forward and backward ------===//
//
// A pipeline rank runs one or more chunks (@stageN functions). Each becomes
// a `forward` and a `backward` function over one micro-batch, whose
// activations live in a slot (S) the schedule picks; transfers to and from
// the neighbouring stages are asynchronous sends and receives, gradients
// accumulate over the micro-batches, and the optimizer's pieces are handed
// to generatePipelineProgram (PipelineProgram.cpp) to assemble the step.
//
//===----------------------------------------------------------------------===//

#include "compiler/codegen/Generator.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>

using namespace mlir;

namespace carve {

int64_t maxMessageTag(ModuleOp module) {
  int64_t maxTag = -1;
  module.walk([&](Operation *op) {
    if (auto snd = dyn_cast<dist::SendOp>(op))
      maxTag = std::max(maxTag, (int64_t)snd.getTag());
    if (auto r = dyn_cast<dist::RecvOp>(op))
      maxTag = std::max(maxTag, (int64_t)r.getTag());
  });
  return maxTag;
}

} // namespace carve

namespace carve::codegen {

namespace {
/// The pp rank `offset` stages away, as C++.
std::string peer(int64_t offset) {
  return offset >= 0 ? "ctx.ppRank + " + std::to_string(offset)
                     : "ctx.ppRank - " + std::to_string(-offset);
}
} // namespace

bool Generator::runStage(const PipelineCodegenOptions &pipe, int chunk, int64_t base,
                         const std::map<std::string, int64_t> &inputOffsets, StageOut &so) {
  auto ret = cast<func::ReturnOp>(fn.getBody().front().getTerminator());
  const int m = opts.numMicroBatches;
  const int stage = (int)fn->getAttrOfType<IntegerAttr>(kStageAttr).getInt();
  if (!prepare())
    return false;
  const int end = (int)ops.size();
  actBase = "S";
  const int backwardBegin = firstBackwardOp(true);
  if (!checkMessageTags(end, pipe.maxMessageTag))
    return false;

  so.hasLoss = ret.getNumOperands() > 0 && fn.getResultAttr(0, kLossAttr);
  Value loss = so.hasLoss ? ret.getOperand(0) : Value();
  if (so.hasLoss)
    buffers[bufferOf.lookup(loss)].lastUse = end;
  if (!collectStageGradients(ret, stage))
    return false;
  if (!shardOverDp())
    return false;
  GatherPlan gathered = planZero3Gathers();
  std::vector<Bucket> buckets;
  if (!readStepTail())
    return false;
  if (opts.dp > 1 && !readBucketsOffIr(buckets))
    return false;
  if (zero >= 2 && !stageGradientChunks(buckets, stage))
    return false;
  so.numBuckets = (int)buckets.size();

  // Persistent layout from `base`: parameters, gradients, optimizer state,
  // the loss seed; graph inputs where the program put them.
  PersistentLayout layout;
  if (!readPersistent(base, layout) || !placeStageInputs(inputOffsets, stage))
    return false;
  so.persistentEnd = layout.end;
  if (!readActivations()) // offsets relative to the slot
    return false;
  so.activationBytes = slotLimit;
  so.sendBytes = sendLimit;
  so.scratchBytes = out.activationBytes - slotLimit - sendLimit;
  so.unplannedBytes = out.unplannedBytes;
  so.paramBytes = layout.paramEnd - base;
  so.gradBytes = layout.gradEnd - layout.paramEnd;
  so.stateBytes = layout.stateEnd - layout.gradEnd;

  so.lossReduction = lossReduction();
  if ((opts.dp > 1 || m > 1) && so.lossReduction == "unknown")
    return fail("cannot tell how the loss reduces over the batch (a mean or a sum of "
                "cross_entropy, reduce_mean or reduce_sum); data parallelism and micro-batches "
                "need to know");
  if (opts.memoryOnly)
    return true;
  so.init += stageSeed(so.lossReduction);

  std::string forwardBody, backwardBody;
  if (!emitStageBodies(chunk, backwardBegin, loss, buckets, gathered, so, forwardBody,
                       backwardBody))
    return false;
  // Both functions start from the arguments' pointers; the backward part
  // also declares again the forward values it reads, at the same slot offsets.
  std::string argPreamble = "  char *const A = ctx.arena;\n";
  for (BlockArgument a : fn.getArguments())
    argPreamble += argumentPointer(a, true);
  std::string sig = "(StepContext &ctx, int mb, int slot, char *S, char *Q, char *W";
  so.forward = "/// Forward of micro-batch `mb` (slot `slot`): what it keeps for backward and "
               "sends at S,\n/// its transients in the rank's scratch (at W).\nvoid forward" +
               sig + ") {\n" + argPreamble + "  (void)slot;\n  (void)Q;\n  (void)W;\n\n" +
               forwardBody + "}\n";
  so.backward =
      "/// Backward of micro-batch `mb` (slot `slot`): what it sends at Q, its transients at W;\n"
      "/// `last`: the step's last micro-batch.\n"
      "void backward" +
      sig + ", bool last) {\n" + argPreamble + stashDeclarations(backwardBegin) +
      "  (void)slot;\n  (void)Q;\n  (void)W;\n  (void)last;\n\n" + backwardBody + "}\n";
  so.constants = constants + fusedDefs;
  so.constants += "std::vector<CommHandle> fsends[" + std::to_string(pipe.slots[chunk]) +
                  "], bsends[" + std::to_string(pipe.slots[chunk]) +
                  "]; // forward and backward sends in flight, per slot\n";
  if (!buckets.empty() && zero < 2)
    so.constants += "CommHandle buckets[" + std::to_string(buckets.size()) + "];\n";
  so.customKernels = customKernels;
  so.kernelCalls = kernelCalls;

  stageTail(pipe, chunk, so);
  buildTables(m);
  so.params = paramRows;
  so.inputs = inputRows;
  so.plan = "  //   stage " + std::to_string(stage) + ": parameters [" + std::to_string(base) +
            ", " + std::to_string(layout.paramEnd) + "), gradients [" +
            std::to_string(layout.paramEnd) + ", " + std::to_string(layout.gradEnd) +
            "), optimizer state [" + std::to_string(layout.gradEnd) + ", " +
            std::to_string(layout.stateEnd) + "); activations " + bytesText(so.activationBytes) +
            " kept per micro-batch, " + bytesText(so.sendBytes) + " sent by its backward, " +
            bytesText(so.scratchBytes) + " scratch (" + bytesText(so.unplannedBytes) +
            " without reuse)\n";
  return true;
}

/// A send reads its tensor until the slot is taken by another micro-batch;
/// the micro-batches of every transfer share the runtime's tags.
bool Generator::checkMessageTags(int end, int64_t maxTag) {
  const int m = opts.numMicroBatches;
  for (Operation *op : ops)
    if (auto snd = dyn_cast<dist::SendOp>(op))
      buffers[bufferOf.lookup(snd.getInput())].lastUse = end;
  // Every stage must agree on the tags: count the module's transfers.
  if (maxTag < 0)
    maxTag = maxMessageTag(fn->getParentOfType<ModuleOp>());
  // The CPU runtime's transports (MPI, TCP) take tags 0 to 32767, the
  // guaranteed MPI_TAG_UB; NCCL has no tags (docs/nccl.md), only an int.
  // Where every transfer's tags for all micro-batches do not fit, the
  // micro-batches share them k at a time (tag * k + mb % k): a transfer's
  // messages between its two ranks are sent and received in micro-batch
  // order, and equal tags from one sender match in the order posted.
  const int64_t limit = opts.cuda() ? INT32_MAX : 32767;
  const int64_t transfers = maxTag + 1;
  tagWindow = m;
  if (transfers > 0 && transfers * m > limit)
    tagWindow = (int)(limit / transfers);
  if (const char *force = std::getenv("CARVE_TEST_TAG_WINDOW"))
    tagWindow = std::max(1, std::min(m, std::atoi(force)));
  if (tagWindow < 1)
    return fail("pipeline: " + std::to_string(transfers) + " transfers exceed the " +
                std::to_string(limit) + " message tags of the " +
                (opts.cuda() ? "CUDA" : "CPU (MPI and TCP)") + " runtime");
  return true;
}

/// The tag of this micro-batch's message of transfer `tag` (checkMessageTags).
std::string Generator::messageTag(int64_t tag) const {
  if (tagWindow >= opts.numMicroBatches)
    return std::to_string(tag) + " * " + std::to_string(opts.numMicroBatches) + " + mb";
  if (tagWindow == 1)
    return std::to_string(tag);
  return std::to_string(tag) + " * " + std::to_string(tagWindow) + " + mb % " +
         std::to_string(tagWindow);
}

/// Every returned gradient accumulates over the micro-batches into its own
/// slot in the gradient region, final after its last writer (carve.gradients).
bool Generator::collectStageGradients(func::ReturnOp ret, int stage) {
  const bool hasLoss = ret.getNumOperands() > 0 && fn.getResultAttr(0, kLossAttr);
  const std::string what = "@stage" + std::to_string(stage);
  return collectGradients(
      ret, hasLoss ? 1 : 0, what, true, [&](unsigned k, unsigned param, Value g) {
        const GradientSlot &ir = irGrad[k];
        int vb = bufferOf.lookup(g);
        int ready = (int)ir.ready;
        if (!ir.copy || ready < index[g.getDefiningOp()]) {
          contractError = what + " carve.gradients: result " + std::to_string(k) +
                          " must accumulate into its slot (copy) after its defining op";
          return;
        }
        buffers[vb].lastUse = std::max(buffers[vb].lastUse, ready);
        GradSlot slot{param,
                      g,
                      newBuffer(Region::Grad, bytesOf(g), -1, "grad_" + var[fn.getArgument(param)]),
                      true,
                      ready,
                      (bool)fn.getResultAttr(k, kSharedGradAttr)};
        grads.push_back(slot);
      });
}

/// ZeRO-2 and 3 (docs/partition.md, "ZeRO with micro-batches and
/// pipelines"): each micro-batch's gradients are reduce-scattered per bucket
/// into staging buffers of this rank's chunk (activations in the slot, from
/// the bucket's ready to its wait, where carve-plan-memory put them: its
/// copies), then added to the fp32 chunk accumulator in the gradient region;
/// the full gradients live until the wait.
bool Generator::stageGradientChunks(const std::vector<Bucket> &buckets, int stage) {
  for (size_t k = 0; k < buckets.size(); ++k) {
    const Bucket &bk = buckets[k];
    if (bk.waitAt < 0)
      return fail("@stage" + std::to_string(stage) + " carve.buckets: bucket " + std::to_string(k) +
                  " has no wait_at under ZeRO-" + std::to_string(zero));
    for (size_t i = bk.first; i <= bk.last; ++i) {
      const GradSlot &g = grads[i];
      const int full = bufferOf.lookup(g.value);
      buffers[full].lastUse = std::max(buffers[full].lastUse, bk.waitAt);
      Buffer &st = buffers[g.buffer];
      st.region = Region::Activation;
      st.bytes = chunkOf[g.param] * gradElementBytes(g);
      st.def = bk.ready;
      st.lastUse = bk.waitAt;
      st.name = "staging_" + var[fn.getArgument(g.param)];
      shardOf[g.param] = newBuffer(Region::Grad, chunkOf[g.param] * chunkElementBytes(g), -1,
                                   "grad_chunk_" + var[fn.getArgument(g.param)]);
    }
  }
  if (buckets.empty() && !grads.empty())
    return fail("@stage" + std::to_string(stage) + " has no carve.buckets under ZeRO-" +
                std::to_string(zero) + " (run carve-data-parallel first)");
  return true;
}

/// Graph inputs where the program put them (all micro-batches, one after
/// another), which is where carve-plan-memory recorded them.
bool Generator::placeStageInputs(const std::map<std::string, int64_t> &inputOffsets, int stage) {
  for (BlockArgument a : fn.getArguments()) {
    Buffer &b = buffers[bufferOf.lookup(a)];
    if (b.region != Region::Input)
      continue;
    auto name = fn.getArgAttrOfType<StringAttr>(a.getArgNumber(), kInputAttr).getValue();
    auto it = inputOffsets.find(name.str());
    if (it == inputOffsets.end())
      return fail("pipeline: stage " + std::to_string(stage) + " has input '" + name.str() +
                  "' that stage 0 does not have");
    if (persistentOffsetOf(fn, a.getArgNumber()) != it->second)
      return fail("pipeline: stage " + std::to_string(stage) + " input '" + name.str() +
                  "': " + kPersistentOffsetAttr + " " +
                  std::to_string(persistentOffsetOf(fn, a.getArgNumber())) +
                  " is not where the program puts it (" + std::to_string(it->second) + ")");
    b.offset = it->second;
  }
  return true;
}

/// d(loss)/d(loss) of one micro-batch, stored at the start of the step.
std::string Generator::stageSeed(const std::string &reduction) {
  std::string init;
  for (BlockArgument a : fn.getArguments())
    if (fn.getArgAttr(a.getArgNumber(), kLossSeedAttr)) {
      int64_t replicas = (int64_t)opts.dp * opts.numMicroBatches;
      bool mean = reduction == "mean" && replicas > 1;
      init += "  // d(loss)/d(loss) of one micro-batch: " +
              std::string(mean ? "the loss is a mean over the batch and each micro-batch is 1/" +
                                     std::to_string(replicas) +
                                     " of the global batch, so the summed gradients equal "
                                     "the global mean's."
                               : "1.") +
              "\n" +
              seedStore("(float *)(A + " + std::to_string(buffers[bufferOf.lookup(a)].offset) + ")",
                        mean ? "1.0f / " + std::to_string(replicas) : std::string("1.0f"));
    }
  return init;
}

/// The pointers backward declares again for the forward values it reads
/// (sorted by name, so the order does not depend on pointers).
std::vector<Value> Generator::stashedValues(int backwardBegin) {
  const int end = (int)ops.size();
  std::set<Value, std::function<bool(Value, Value)>> stash(
      [&](Value x, Value y) { return var[x] < var[y]; });
  for (int i = backwardBegin; i < end; ++i) {
    Operation *op = ops[i];
    std::vector<Operation *> readers{op};
    if (Operation *fused = transposedMatmul.lookup(op))
      readers.push_back(fused);
    if (Operation *g = gatheredOperand(op)) // reads the gather's table and indices
      readers.push_back(g);
    for (Operation *r : readers)
      for (unsigned k = 0; k < r->getNumOperands(); ++k) {
        Value v = operandOf(r, k);
        Operation *d = v.getDefiningOp();
        // q, k or v read in place in its source's 16-bit copy (through an
        // f32 view of its copy): that copy (carve-fold-views' "strided").
        Operation *s =
            d && isa<CastOp>(d) && !stridedOps.count(d) ? d->getOperand(0).getDefiningOp() : d;
        if (s && stridedOps.count(s)) {
          v = stridedPieceOf(s)->source16;
          d = v.getDefiningOp();
        }
        if (d && index.count(d) && index[d] < backwardBegin && !gatheredOperands.count(d) &&
            hasMemory(v))
          stash.insert(v);
      }
  }
  return std::vector<Value>(stash.begin(), stash.end());
}

/// Whether `v` (through reshapes) has a buffer: a value never in memory (an
/// f32 value its readers read as its 16-bit tensor, a folded piece) needs
/// no pointer.
bool Generator::hasMemory(Value v) {
  while (v.getDefiningOp() && isa<ReshapeOp>(v.getDefiningOp()))
    v = v.getDefiningOp()->getOperand(0);
  return bufferOf.count(v);
}

std::string Generator::stashDeclarations(int backwardBegin) {
  auto declare = [&](Value v) -> std::string {
    Value root = v;
    while (root.getDefiningOp() && isa<ReshapeOp>(root.getDefiningOp()))
      root = root.getDefiningOp()->getOperand(0);
    const Buffer &b = buffers[bufferOf.lookup(root)];
    if (b.region == Region::Constant && root == v)
      return "";
    std::string target = b.region == Region::Activation
                             ? "(" + ctypeOf(v) + " *)(" + activationAt(b.offset) + ")"
                             : "(" + ctypeOf(v) + " *)" + var[root];
    return "  " + ctypeOf(v) + " *" + var[v] + " = " + target + ";\n";
  };
  std::string decl;
  for (Value v : stashedValues(backwardBegin))
    decl += declare(v);
  return decl;
}

/// A receive: its buffer in the slot and the asynchronous receive, waited
/// for just before the next op that is not a receive.
std::string Generator::recvStatements(Operation *op, bool backward) {
  auto r = cast<dist::RecvOp>(op);
  Value res = r.getResult();
  const Buffer &b = buffers[bufferOf.lookup(res)];
  int64_t from = r->getAttrOfType<IntegerAttr>(kFromStageAttr).getInt();
  std::string h = "recv_" + var[res];
  std::string node = nodeName(op->getLoc());
  return "  // " + std::string(backward ? "gradient" : "activation") + " " +
         shapeText(typeOf(res).getShape()) + " from stage " + std::to_string(from) +
         (node.empty() ? "" : " [" + node + "]") + "\n" + "  " + ctypeOf(res) + " *" + var[res] +
         " = (" + ctypeOf(res) + " *)(" + activationAt(b.offset) + ");\n" + "  CommHandle " + h +
         " = ctx.ppComm->recvAsync(" + var[res] + ", " + std::to_string(bytesOf(res)) + ", " +
         peer((int64_t)r.getOffset()) + ", " + messageTag((int64_t)r.getTag()) + ");\n";
}

/// A send, left in flight on the slot's list until the slot is reused.
std::string Generator::sendStatements(Operation *op, bool backward) {
  auto snd = cast<dist::SendOp>(op);
  Value v = snd.getInput();
  int64_t to = snd->getAttrOfType<IntegerAttr>(kToStageAttr).getInt();
  return "  // send " + std::string(backward ? "the gradient " : "") + var[v] + " to stage " +
         std::to_string(to) + "; its memory is kept until the send completes\n" + "  " +
         (backward ? "bsends" : "fsends") + "[slot].push_back(ctx.ppComm->sendAsync(" + var[v] +
         ", " + std::to_string(bytesOf(v)) + ", " + peer((int64_t)snd.getOffset()) + ", " +
         messageTag((int64_t)snd.getTag()) + "));\n";
}

/// The ops split at the first backward op into the two functions' bodies:
/// transfers, kernel calls, the loss summed over micro-batches, gradients
/// accumulated, and each bucket's all-reduce after the last micro-batch.
bool Generator::emitStageBodies(int chunk, int backwardBegin, Value loss,
                                const std::vector<Bucket> &buckets, const GatherPlan &gathered,
                                StageOut &so, std::string &forwardBody, std::string &backwardBody) {
  const int end = (int)ops.size();
  size_t nextBucket = 0;
  std::map<unsigned, std::string> shardVar;
  for (auto &[arg, pair] : gathered)
    shardVar[arg] = var[fn.getArgument(arg)];
  indexGatherEvents(gathered);
  size_t nextWait = 0;
  auto bucketsAfter = [&](int i) {
    while (nextBucket < buckets.size() && buckets[nextBucket].ready <= i) {
      body += stageBucketStart(buckets[nextBucket], nextBucket, chunk, so);
      ++nextBucket;
    }
    while (zero >= 2 && nextWait < nextBucket && buckets[nextWait].waitAt <= i) {
      body += stageBucketWait(buckets[nextWait], nextWait);
      ++nextWait;
    }
  };
  // A value's gradient is accumulated (or reduce-scattered) once it is
  // final: after its op, or, for a gradient received from another stage,
  // after the receive is waited for.
  auto gradientsAfter = [&](int i) {
    for (GradSlot &g : grads)
      if (g.ready == i && zero < 2) {
        std::string n = std::to_string(typeOf(g.value).getNumElements());
        const bool h = grad16(g); // 16-bit accumulation (grad_accumulation "16bit")
        body += "  // accumulate the gradient of " + paramName(g.param) +
                (g.shared ? " (this stage's part)" : "") +
                (h ? ", in 16 bits (each add rounded)" : "") + "\n  if (mb == 0)\n    " +
                callee(opts, "copy") + "(" + var[g.value] + ", " + gradPtr(g) + ", " + n +
                ");\n  else\n    " + callee(opts, "addInPlace") + "(" +
                (h ? asGrad16(gradPtr(g)) : gradPtr(g)) + ", " +
                (h ? asGrad16(var[g.value]) : var[g.value]) + ", " + n + ");\n";
      }
    bucketsAfter(i);
  };
  std::vector<std::string> pendingRecv;
  std::vector<int> pendingRecvAt;
  auto flushRecvs = [&]() {
    for (const std::string &h : pendingRecv)
      body += "  ctx.ppComm->wait(" + h + ");\n";
    if (!pendingRecv.empty())
      body += "\n";
    pendingRecv.clear();
    for (int at : pendingRecvAt)
      gradientsAfter(at);
    pendingRecvAt.clear();
  };
  viewsInScope.clear(); // forward() declares its own
  for (Operation *op : ops) {
    const int i = index[op];
    if (i == backwardBegin) {
      flushRecvs();
      forwardBody = body;
      body.clear();
      // backward() declares again the forward values it reads.
      viewsInScope.clear();
      for (Value v : stashedValues(backwardBegin))
        if (v.getDefiningOp() && isa<ReshapeOp>(v.getDefiningOp()))
          viewsInScope.push_back(v);
    }
    if (auto r = dyn_cast<dist::RecvOp>(op)) {
      body += recvStatements(op, i >= backwardBegin);
      pendingRecv.push_back("recv_" + var[r.getResult()]);
      pendingRecvAt.push_back(i);
      continue;
    }
    flushRecvs();
    if (isa<dist::SendOp>(op)) {
      body += sendStatements(op, i >= backwardBegin);
      continue;
    }
    body += gatherStatements(op, i >= backwardBegin, gathered, shardVar);
    if (!emitOp(op))
      return false;
    if (so.hasLoss && loss.getDefiningOp() == op)
      body += "  pipeLoss += (double)" + scalarRead(var[loss]) + ";  // this micro-batch's loss\n";
    gradientsAfter(i);
  }
  flushRecvs();
  bucketsAfter(end);
  for (auto &[arg, v] : shardVar)
    var[fn.getArgument(arg)] = v;
  if (backwardBegin == end) {
    forwardBody = body;
    body.clear();
  }
  backwardBody = body;
  return true;
}

/// Bucket `k` complete in this micro-batch. ZeRO-0/1: after the last
/// micro-batch, the all-reduce of its accumulated range (waited for in the
/// step's tail). ZeRO-2/3: every micro-batch, a reduce-scatter of each of
/// its gradients into the chunk's staging buffer.
std::string Generator::stageBucketStart(const Bucket &bk, size_t k, int chunk, StageOut &so) {
  const std::string key = std::to_string(k), dp = std::to_string(opts.dp);
  if (zero < 2) {
    auto [begin, stop] = bucketRange(bk);
    // Expert parallelism: the experts' gradients over the ranks that hold
    // the same experts (edp), the rest over dp.
    const std::string comm = bk.experts ? "ctx.edpComm" : "ctx.dpComm";
    so.bucketWaits +=
        "  " + comm + "->wait(c" + std::to_string(chunk) + "::buckets[" + key + "]);\n";
    return "  // Gradient bucket " + key + " is complete (" + bytesText(bk.bytes) +
           "): after the last micro-batch, sum it over the " +
           (bk.experts ? std::to_string(opts.dp / opts.ep) + " ranks that hold these experts"
                       : dp + " data-parallel replicas") +
           ".\n  if (last)\n    buckets[" + key + "] = " + comm + "->allReduceAsync(A + " +
           std::to_string(begin) + ", " +
           std::to_string((stop - begin) / gradElementBytes(grads[bk.first])) + ", " +
           gradCommType(grads[bk.first]) + ", ReduceOp::Sum);\n";
  }
  std::string s = "  // Gradient bucket " + key + " is complete (" + bytesText(bk.bytes) +
                  "): ZeRO-" + std::to_string(zero) +
                  " reduce-scatters this micro-batch's part; each replica receives the sum of\n"
                  "  // its chunk in a staging buffer, added to its fp32 chunk when the bucket "
                  "is waited for.\n  CommHandle bucket" +
                  key + "[" + std::to_string(bk.last - bk.first + 1) + "];\n";
  for (size_t i = bk.first; i <= bk.last; ++i) {
    const GradSlot &g = grads[i];
    s += "  {\n    int64_t counts[" + dp + "];\n    for (int r = 0; r < " + dp +
         "; ++r) counts[r] = " + chunkCount(g.param, "r") + ";\n    bucket" + key + "[" +
         std::to_string(i - bk.first) + "] = ctx.dpComm->reduceScatterAsync(" + var[g.value] +
         ", (" + (grad16(g) ? "uint16_t" : "float") + " *)(" +
         activationAt(buffers[g.buffer].offset) + "), counts, " + gradCommType(g) +
         ", ReduceOp::Sum);  // " + paramName(g.param) + "\n  }\n";
  }
  return s;
}

/// ZeRO-2/3: bucket `k`'s reduce-scatters finished; its gradients' chunks
/// accumulate over the micro-batches in fp32 (the first one copied).
std::string Generator::stageBucketWait(const Bucket &bk, size_t k) {
  std::string s = "  for (CommHandle &h : bucket" + std::to_string(k) +
                  ") ctx.dpComm->wait(h);  // its full gradients are dead from here\n";
  for (size_t i = bk.first; i <= bk.last; ++i) {
    const GradSlot &g = grads[i];
    const bool h = grad16(g), widen = h && !chunk16(g);
    const std::string staging = std::string(h ? "(uint16_t *)(" : "(float *)(") +
                                activationAt(buffers[g.buffer].offset) + ")";
    const std::string n = chunkCount(g.param, "ctx.dpRank");
    const std::string src = h ? asGrad16(staging) : staging;
    s += "  // accumulate this replica's chunk of the gradient of " + paramName(g.param) +
         (g.shared ? " (this stage's part)" : "") +
         (widen ? ", 16 bits into its fp32 accumulator"
          : h   ? ", in 16 bits (each add rounded)"
                : "") +
         "\n  if (mb == 0)\n    " +
         (widen ? callee(opts, "widen") + "(" + src : callee(opts, "copy") + "(" + staging) + ", " +
         chunkPtr(g) + ", " + n + ");\n  else\n    " + callee(opts, "addInPlace") + "(" +
         (h && !widen ? asGrad16(chunkPtr(g)) : chunkPtr(g)) + ", " + src + ", " + n + ");\n";
  }
  return s;
}

/// The chunk's pieces of the step's tail (a gradient shared over pp is in
/// the norm of its owner stage only: carve.grad_norm lists it there).
void Generator::stageTail(const PipelineCodegenOptions &pipe, int chunk, StageOut &so) {
  so.pointers = tailPointers(pipe.virtualStages > 1 ? "c" + std::to_string(chunk) + "_" : "");
  llvm::raw_string_ostream ns(so.norm), cs(so.clip), us(so.updates), ss(so.unscale);
  emitUnscale(ss);
  emitNormTerms(ns);
  emitClip(cs);
  emitUpdates(us);
  for (GradSlot &g : grads)
    if (g.shared)
      so.sharedGrads.push_back({paramName(g.param), tailNames[g.param].grad});
}

} // namespace carve::codegen
