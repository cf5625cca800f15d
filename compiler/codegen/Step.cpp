//===- Step.cpp - the whole-step program (generateCpuProgram) -------------===//
//
// The generated step function is straight-line code: one runtime kernel call
// per op of @train_step, in program order. Three rewrites keep it lean:
//   - a reshape is a new name for its input's memory (no copy);
//   - a transpose that swaps the last two dimensions and feeds only matmuls
//     becomes the GEMM's transpose flag;
//   - activations share memory: a first-fit plan over their live ranges.
// Gradients are placed contiguously in the order backward produces them, so
// each all-reduce bucket is one contiguous range started as soon as its last
// gradient is written.
//
//===----------------------------------------------------------------------===//

#include "compiler/codegen/Generator.h"

#include <algorithm>

using namespace mlir;

namespace carve {
namespace codegen {

bool Generator::run() {
  auto ret = cast<func::ReturnOp>(fn.getBody().front().getTerminator());
  if (!prepare())
    return false;
  const int end = (int)ops.size();
  if (ret.getNumOperands() < 1)
    return fail("@train_step returns nothing");

  // Results: the loss lives to the end; gradients go to the gradient region.
  Value loss = ret.getOperand(0);
  buffers[bufferOf.lookup(loss)].lastUse = end;
  std::set<int> pinned{bufferOf.lookup(loss)};
  if (!collectStepGradients(ret, pinned))
    return false;

  // ZeRO over dp (docs/partition.md, "ZeRO"): stage 1 keeps optimizer state for this
  // rank's chunk only, stage 2 also only its chunk of the summed gradient
  // (reduce-scattered per bucket; the full gradients become short-lived
  // activations), stage 3 also only its chunk of the parameter (gathered just
  // before use in forward and again in backward, into short-lived buffers).
  if (!shardOverDp())
    return false;
  const int backwardBegin = firstBackwardOp(false);
  GatherPlan gathered = planZero3Gathers();
  if (zero >= 2)
    keepGradientChunks();

  std::vector<Bucket> buckets;
  if (!readStepTail())
    return false;
  if (!readBucketsOffIr(buckets))
    return false;
  out.numBuckets = (int)buckets.size();
  // Stage >= 2: one bucket in flight; bucket k is waited for when bucket k+1
  // starts (the last at the end; carve.buckets' wait_at), so its full
  // gradients can be freed there.
  if (zero >= 2)
    for (size_t k = 0; k < buckets.size(); ++k) {
      if (buckets[k].waitAt < 0)
        return fail("@train_step carve.buckets: bucket " + std::to_string(k) +
                    " has no wait_at under ZeRO-" + std::to_string(zero));
      for (size_t i = buckets[k].first; i <= buckets[k].last; ++i)
        buffers[grads[i].buffer].lastUse =
            std::max(buffers[grads[i].buffer].lastUse, buckets[k].waitAt);
    }

  // Persistent layout: parameters and buffers, gradients, optimizer state,
  // inputs, the seed; then activations.
  PersistentLayout layout;
  if (!readPersistent(0, layout))
    return false;
  const int64_t activationBase = layout.end;
  if (!readActivations())
    return false;
  for (Buffer &b : buffers)
    if (b.region == Region::Activation)
      b.offset += activationBase;
  out.arenaBytes = alignUp(activationBase + out.activationBytes);
  out.paramBytes = layout.paramEnd;
  out.gradBytes = layout.gradEnd - layout.paramEnd;
  out.stateBytes = layout.stateEnd - layout.gradEnd;

  const std::string reduction = lossReduction();
  if (opts.dp > 1 && reduction == "unknown")
    return fail("cannot tell how the loss reduces over the batch (a mean or a sum of "
                "cross_entropy, reduce_mean or reduce_sum); data parallelism needs to know");
  if (opts.memoryOnly)
    return true;
  var.reader = -1; // from here every name the step prints is noted (outlineLayers)
  if (!emitStepSeed(reduction) || !emitStepBody(buckets, gathered, backwardBegin))
    return false;
  std::string t;
  llvm::raw_string_ostream ts(t);
  if (!emitStepTail(loss, buckets, reduction, ts))
    return false;
  {
    // evaluate: the forward's statements, then the loss as the tail reads it.
    llvm::raw_string_ostream es(evalTail);
    es << "\n  // The loss of the whole global batch.\n";
    es << "  float loss = (float)" << scalarRead(var[loss]) << ";\n";
    emitDpLoss(es, opts, reduction);
    es << "  ctx.loss = loss;\n";
    if (opts.dp > 1)
      es << "  // The accuracy counts of every replica's rows.\n"
            "  ctx.dpComm->allReduce(ctx.counts, 2, CommType::F64, ReduceOp::Sum);\n";
  }

  var.reader = -2;
  if (!outlineLayers(backwardBegin))
    return false;

  buildTables(1);
  out.numKernelCalls = kernelCalls;
  std::string header;
  llvm::raw_string_ostream hs(header);
  hs << "  // Memory plan (one arena, " << bytesText(out.arenaBytes) << "):\n"
     << "  //   parameters and buffers   [0, " << layout.paramEnd << ")\n"
     << "  //   gradients                [" << layout.paramEnd << ", " << layout.gradEnd << ")\n"
     << "  //   optimizer state          [" << layout.gradEnd << ", " << layout.stateEnd << ")\n"
     << "  //   inputs and loss seed     [" << layout.stateEnd << ", " << activationBase << ")\n"
     << "  //   activations              [" << activationBase << ", "
     << activationBase + out.activationBytes << "): " << bytesText(out.activationBytes)
     << " reused by liveness (" << bytesText(out.unplannedBytes) << " without reuse)\n";
  out.source = emitProgram(header, t, backwardBegin);
  return true;
}

/// Each returned gradient gets a slot in the gradient region: its own buffer
/// where carve-data-parallel found it an activation nothing else pins, else
/// a copy made at the end (carve.gradients' copy).
bool Generator::collectStepGradients(func::ReturnOp ret, std::set<int> &pinned) {
  const int end = (int)ops.size();
  return collectGradients(ret, 1, "@train_step", false, [&](unsigned k, unsigned param, Value g) {
    const GradientSlot &ir = irGrad[k];
    int b = bufferOf.lookup(g);
    GradSlot slot{param, g, b, false, (int)ir.ready};
    if (ir.copy ? ir.ready != end
                : buffers[b].region != Region::Activation || pinned.count(b) ||
                      ir.ready < buffers[b].def) {
      contractError =
          "@train_step carve.gradients: result " + std::to_string(k) +
          (ir.copy ? " is copied after the last op but ready at " + std::to_string(ir.ready)
                   : " is computed in place but its memory is not its own from op " +
                         std::to_string(ir.ready));
      return;
    }
    if (ir.copy) {
      slot.copy = true;
      slot.buffer = newBuffer(Region::Grad, bytesOf(g), end, "grad_" + var[fn.getArgument(param)]);
      buffers[b].lastUse = end;
    } else {
      buffers[b].region = Region::Grad;
      pinned.insert(b);
    }
    grads.push_back(slot);
  });
}

/// ZeRO-3: the arena keeps the chunk; forward and backward each gather the
/// whole parameter into a buffer that lives from just before its first use
/// to its last use in that pass (carve.zero3_gather). Other stages: nothing
/// to gather.
Generator::GatherPlan Generator::planZero3Gathers() {
  GatherPlan gathered;
  if (zero != 3)
    return gathered;
  const int64_t dp = opts.dp;
  for (auto &[arg, chunk] : chunkOf) {
    std::array<int64_t, 4> range;
    if (!zero3GatherOf(fn, arg, range))
      continue; // never read
    std::string base = var[fn.getArgument(arg)];
    const std::array<int64_t, 2> issue = zero3IssueOf(fn, arg);
    for (int pass = 0; pass < 2; ++pass) {
      Gathered &gg = gathered[arg][pass];
      gg.first = (int)range[2 * pass];
      gg.last = (int)range[2 * pass + 1];
      gg.issue = (int)issue[pass];
      if (gg.first < 0)
        continue;
      gg.var = uniqueName(base + (pass ? "_full_bwd" : "_full_fwd"));
      gg.buffer =
          newBuffer(Region::Activation, dp * chunk * elementBytes(arg), gg.issue - 1, gg.var);
      buffers[gg.buffer].gatherArg = (int)arg;
      buffers[gg.buffer].gatherPass = pass;
      buffers[gg.buffer].lastUse = gg.last;
    }
    buffers[bufferOf.lookup(fn.getArgument(arg))].bytes = chunk * elementBytes(arg);
  }
  return gathered;
}

/// ZeRO-2 and 3: gradients are activations until their bucket's
/// reduce-scatter has finished; each rank keeps its chunk in the gradient region.
void Generator::keepGradientChunks() {
  for (GradSlot &g : grads) {
    buffers[g.buffer].region = Region::Activation;
    shardOf[g.param] = newBuffer(Region::Grad, chunkOf[g.param] * chunkElementBytes(g), -1,
                                 "grad_chunk_" + var[fn.getArgument(g.param)]);
  }
}

/// d(loss)/d(loss): on the CPU the body's first statement; on CUDA outside
/// the captured forward and backward, since under fp16 the seed is the loss
/// scale, which changes between steps.
bool Generator::emitStepSeed(const std::string &reduction) {
  BlockArgument seedArg;
  for (BlockArgument a : fn.getArguments())
    if (fn.getArgAttr(a.getArgNumber(), kLossSeedAttr))
      seedArg = a;
  if (!seedArg)
    return fail("@train_step has no loss-seed argument");
  const bool mean = reduction == "mean" && opts.dp > 1;
  std::string seedValue = mean ? "1.0f / " + std::to_string(opts.dp) : std::string("1.0f");
  std::string seedLines =
      "  // d(loss)/d(loss): " +
      std::string(mean ? "the loss is a mean over the batch and each replica sees 1/" +
                             std::to_string(opts.dp) +
                             " of it, so the summed gradients equal the global mean's."
                       : "1.");
  if (opts.cuda())
    graphBefore =
        seedLines + "\n" +
        seedStore("(float *)(A + " + std::to_string(buffers[bufferOf.lookup(seedArg)].offset) + ")",
                  seedValue);
  else
    body += seedLines + "\n" + seedStore(var[seedArg], seedValue) + "\n";
  return true;
}

/// Starts the reduction of every bucket complete after op `after` (dp > 1):
/// an all-reduce of its range, or under ZeRO >= 2 a reduce-scatter per
/// gradient into this rank's chunk.
void Generator::startBuckets(const std::vector<Bucket> &buckets, size_t &next, int after) {
  if (opts.dp <= 1)
    return;
  std::string &s = body;
  const std::string dp = std::to_string(opts.dp);
  while (next < buckets.size() && buckets[next].ready <= after) {
    const Bucket &bk = buckets[next];
    std::string names;
    for (size_t i = bk.first; i <= bk.last; ++i) {
      names += (i > bk.first ? ", " : "") + paramName(grads[i].param);
      if (i - bk.first >= 3 && i < bk.last) {
        names += ", ... (" + std::to_string(bk.last - i) + " more)";
        break;
      }
    }
    std::string k = std::to_string(next);
    s += "\n  // Gradient bucket " + k + " is complete (" + names + "; " + bytesText(bk.bytes) +
         ").\n";
    if (zero < 2) {
      auto [begin, stop] = bucketRange(bk);
      if (bk.experts)
        s += "  // Expert parallelism: sum it over the " + std::to_string(opts.dp / opts.ep) +
             " ranks that hold these experts (every\n  // expert group's rank " +
             std::to_string(opts.epRank) + "); its own group's tokens are in it already.\n";
      else
        s += "  // Data parallel: sum it over the " + dp +
             " replicas so that every replica applies the same update.\n";
      // One element type per plan: every gradient 16-bit, or none.
      const GradSlot &g0 = grads[bk.first];
      s += "  CommHandle bucket" + k + " = " + (bk.experts ? "ctx.edpComm" : "ctx.dpComm") +
           "->allReduceAsync(A + " + std::to_string(begin) + ", " +
           std::to_string((stop - begin) / gradElementBytes(g0)) + ", " + gradCommType(g0) +
           ", ReduceOp::Sum);\n\n";
    } else {
      s += "  // ZeRO-" + std::to_string(zero) +
           ": reduce-scatter it; each replica keeps the "
           "sum of its chunk of each gradient.\n";
      s += "  CommHandle bucket" + k + "[" + std::to_string(bk.last - bk.first + 1) + "];\n";
      for (size_t i = bk.first; i <= bk.last; ++i) {
        unsigned p = grads[i].param;
        s += "  {\n    int64_t counts[" + dp + "];\n    for (int r = 0; r < " + dp +
             "; ++r) counts[r] = " + chunkCount(p, "r") + ";\n    bucket" + k + "[" +
             std::to_string(i - bk.first) + "] = ctx.dpComm->reduceScatterAsync(" +
             gradPtr(grads[i]) + ", " + chunkPtr(grads[i]) + ", counts, " + gradCommType(grads[i]) +
             ", ReduceOp::Sum);  // " + paramName(p) + "\n  }\n";
      }
      s += "\n";
    }
    ++next;
  }
}

/// The ops in program order, each bucket's reduction started after its last
/// gradient; ZeRO-3 gathers a parameter before its first use in each pass.
bool Generator::emitStepBody(const std::vector<Bucket> &buckets, GatherPlan &gathered,
                             int backwardBegin) {
  const int end = (int)ops.size();
  std::string &s = body;
  size_t nextBucket = 0, nextWait = 0;
  auto waitBuckets = [&](int after) {
    while (zero >= 2 && nextWait < nextBucket && buckets[nextWait].waitAt <= after) {
      s += "  for (CommHandle &h : bucket" + std::to_string(nextWait) +
           ") ctx.dpComm->wait(h);  // its full gradients are dead from here\n";
      ++nextWait;
    }
  };
  bool backward = false;
  std::map<unsigned, std::string> shardVar;
  for (auto &[arg, pair] : gathered)
    shardVar[arg] = var[fn.getArgument(arg)];
  indexGatherEvents(gathered);
  viewsInScope.clear(); // step() holds forward and backward
  for (Operation *op : ops) {
    if (!backward && index[op] >= backwardBegin) {
      backward = true;
      forwardEnd = s.size();
      s += "\n  // ---- Backward ----\n\n";
    }
    s += gatherStatements(op, backward, gathered, shardVar);
    const size_t begin = s.size();
    var.reader = (int)records.size();
    if (!emitOp(op))
      return false;
    var.reader = -1;
    records.push_back({op, begin, s.size()});
    startBuckets(buckets, nextBucket, index[op]);
    waitBuckets(index[op]);
  }
  if (forwardEnd == std::string::npos)
    forwardEnd = s.size();
  for (auto &[arg, v] : shardVar)
    var[fn.getArgument(arg)] = v;
  for (GradSlot &g : grads)
    if (g.copy)
      s += "  " + callee(opts, "copy") + "(" + var[g.value] + ", " + gradPtr(g) + ", " +
           std::to_string(typeOf(g.value).getNumElements()) + ");  // gradient of " +
           paramName(g.param) + "\n";
  startBuckets(buckets, nextBucket, end);
  waitBuckets(end);
  return true;
}

/// Which parameters gatherStatements has something to say for at each op of
/// each pass: its prefetch's start and its first read, in parameter order.
void Generator::indexGatherEvents(const GatherPlan &gathered) {
  gatherEvents.clear();
  for (auto &[arg, pair] : gathered)
    for (int pass = 0; pass < 2; ++pass) {
      const Gathered &gg = pair[pass];
      if (gg.buffer < 0) // not read in this pass (a bias's backward reads only its gradient)
        continue;
      if (gg.issue < gg.first)
        gatherEvents[2 * (int64_t)gg.issue + pass].push_back(arg);
      gatherEvents[2 * (int64_t)gg.first + pass].push_back(arg);
    }
}

/// ZeRO-3, before op `op` of the given pass: the gathers that start there
/// (ahead of their first read: prefetched, asynchronous) and the gathers or
/// waits of the parameters first read there, whose name is from then on
/// their gathered buffer's (`shardVar`: each one's chunk).
std::string Generator::gatherStatements(Operation *op, bool backward, const GatherPlan &gathered,
                                        const std::map<unsigned, std::string> &shardVar) {
  std::string s;
  const int at = index[op];
  auto events = gatherEvents.find(2 * (int64_t)at + (backward ? 1 : 0));
  if (events == gatherEvents.end())
    return s; // nothing is gathered or waited for at this op
  for (unsigned arg : events->second) {
    const Gathered &gg = gathered.at(arg)[backward ? 1 : 0];
    const std::string pass = backward ? "backward" : "forward";
    const std::string uses = " uses (ops " + std::to_string(gg.first) + "-" +
                             std::to_string(gg.last) + "); the buffer is free after the last";
    // A 16-bit copy (carve.master) is gathered in 16 bits.
    std::string ctype, dtype;
    int size;
    elementInfo(typeOf(fn.getArgument(arg)).getElementType(), ctype, dtype, size);
    const std::string pointer = "  " + ctype + " *" + gg.var + " = (" + ctype + " *)(" +
                                activationAt(buffers[gg.buffer].offset) + ");\n";
    const std::string operands = shardVar.at(arg) + ", " + gg.var + ", " +
                                 std::to_string(chunkOf[arg]) + ", " + commTypeOf(arg) + ");\n";
    if (gg.issue == at && gg.issue < gg.first)
      s += "  // ZeRO-3: prefetch " + paramName(arg) + " for its " + pass + uses +
           " (zero3_prefetch_layers).\n" + pointer + "  CommHandle " + gg.var +
           "_gather = ctx.dpComm->allGatherAsync(" + operands;
    if (gg.first != at)
      continue;
    var[fn.getArgument(arg)] = gg.var;
    if (gg.issue < gg.first)
      s += "  ctx.dpComm->wait(" + gg.var + "_gather);  // " + paramName(arg) + ", prefetched\n";
    else
      s += "  // ZeRO-3: gather " + paramName(arg) + " for its " + pass + uses + ".\n" + pointer +
           "  ctx.dpComm->allGather(" + operands;
    // Its views declared before the gather (reshapes are the same memory)
    // read the gathered parameter from here on.
    for (Value v : viewsInScope)
      if (aliasRoot(v) == fn.getArgument(arg))
        s += "  " + var[v] + " = (" + ctypeOf(v) + " *)" + gg.var + ";  // a view of " +
             paramName(arg) + ", gathered\n";
  }
  return s;
}

/// The step's tail: wait for the buckets, the loss, the gradient norm over
/// the whole model (tp-split gradients and ZeRO chunks summed over their
/// axis, replicated ones counted once), clipping, the optimizer.
bool Generator::emitStepTail(Value loss, const std::vector<Bucket> &buckets,
                             const std::string &reduction, llvm::raw_ostream &ts) {
  tailAsTable = planTailTable();
  ts << (tailAsTable ? tailTable() : tailPointers(""));
  if (opts.dp > 1 && zero < 2) {
    // CUDA: inside forwardBackward, so that a captured graph joins the
    // collectives' stream back into the compute stream.
    std::string waits =
        "\n  // Wait for the gradient all-reduces before the optimizer reads them.\n";
    for (size_t b = 0; b < buckets.size(); ++b)
      waits += std::string("  ") + (buckets[b].experts ? "ctx.edpComm" : "ctx.dpComm") +
               "->wait(bucket" + std::to_string(b) + ");\n";
    if (opts.cuda())
      body += waits;
    else
      ts << waits;
  }
  if (opts.cuda()) {
    if (!bufferOf.count(loss))
      return fail("the loss has no buffer the step's tail can read");
    graphAfter = "  " + ctypeOf(loss) + " *" + var[loss] + " = (" + ctypeOf(loss) + " *)(A + " +
                 std::to_string(buffers[bufferOf.lookup(loss)].offset) +
                 ");  // the loss, written by forwardBackward\n";
  }
  ts << "\n  // The loss of the whole global batch.\n";
  ts << "  float loss = (float)" << scalarRead(var[loss]) << ";\n";
  emitDpLoss(ts, opts, reduction);
  ts << "  ctx.loss = loss;\n";
  emitUnscale(ts);

  emitGradientsReadyHook(ts);
  ts << "\n  // Gradient norm: squares summed over this rank's gradient elements";
  if (opts.tp > 1)
    ts << "; tp-split ones\n  // summed over tp, replicated ones counted once";
  if (zero >= 2)
    ts << "; each ZeRO chunk summed over dp";
  ts << ".\n" << normDeclarations(opts);
  emitNormTerms(ts);
  ts << normRead(opts) << expertNormSum(opts);
  if (zero >= 2) {
    ts << "  ctx.dpComm->allReduce(&sqSplit, 1, CommType::F64, ReduceOp::Sum);\n";
    ts << "  ctx.dpComm->allReduce(&sqWhole, 1, CommType::F64, ReduceOp::Sum);\n";
  }
  if (opts.tp > 1)
    ts << "  ctx.tpComm->allReduce(&sqSplit, 1, CommType::F64, ReduceOp::Sum);\n";
  emitUpdateGuard(ts, "sqSplit + sqWhole");
  const OptimizerConfig &o = opts.optimizer;
  emitClipCoefficient(ts, o);
  ts << "  if (clip < 1.0f) {\n";
  emitClip(ts);
  ts << "  }\n";
  emitLearningRate(ts, o);
  emitUpdates(ts);
  return true;
}

std::string Generator::forwardValuesReadAfter(int backwardBegin) {
  std::string s;
  for (size_t i = 0; i < records.size() && index[records[i].op] < backwardBegin; ++i)
    for (Value v : records[i].op->getResults()) {
      auto b = bufferOf.find(v);
      auto readers = var.readers.find(v);
      if (b == bufferOf.end() || readers == var.readers.end())
        continue;
      // A constant's array is global; a view of one is declared again as one.
      const bool constantView = buffers[b->second].region == Region::Constant;
      if (constantView && aliasRoot(v) == v)
        continue;
      if (!constantView && buffers[b->second].offset < 0)
        continue;
      const bool readAfter = llvm::any_of(readers->second, [&](int r) {
        return r < 0 || (index[records[r].op] >= backwardBegin &&
                         !(r < (int)recordOutlined.size() && recordOutlined[r]));
      });
      if (readAfter)
        s += "  " + ctypeOf(v) + " *" + var.map.lookup(v) + " = (" + ctypeOf(v) + " *)" +
             (constantView ? var.map.lookup(aliasRoot(v))
                           : "(A + " + std::to_string(buffers[b->second].offset) + ")") +
             ";\n";
    }
  return s;
}

std::string Generator::emitProgram(const std::string &plan, const std::string &tail,
                                   int backwardBegin) {
  std::string src;
  llvm::raw_string_ostream os(src);
  const std::string &P = opts.programName;
  os << "// " << P << (opts.cuda() ? ".cu" : ".cpp")
     << ": one rank's training step, generated by `carve compile` from " << opts.modelName << ".\n"
     << "// Regenerate it rather than editing it.\n//\n"
     << "// Plan: " << opts.planJson << "\n"
     << "// Data parallel over " << opts.dp << " rank(s): this program sees "
     << opts.globalBatch / std::max(1, opts.dp) << " of the global batch of " << opts.globalBatch
     << ".\n"
     << "// Optimizer: " << opts.optimizer.describe() << "\n"
     << "// " << kernelCalls << " kernel calls, " << out.numBuckets
     << " gradient bucket(s); every call is annotated with the model node it comes from.\n\n"
     << runtimeIncludes(opts, false)
     << (customKernels.empty() ? "" : "#include \"carve/rt/custom.h\"\n")
     << "\n#include <cmath>\n#include <cstdint>\n\n";
  emitCustomKernelDecls(os, customKernels);
  os << usingLine(opts) << "\nnamespace {\n\n";
  if (!constants.empty())
    os << "// ---- Constants ----\n\n" << constants << "\n";
  if (!fusedDefs.empty())
    os << "// ---- Fused elementwise chains (carve/rt/fused.h) ----\n\n" << fusedDefs;
  if (tailAsTable)
    os << "// One parameter of the optimizer's tail (the table `tail` in step): arena byte\n"
          "// offsets of the parameter, its fp32 master (-1: none), its gradient (ZeRO-2/3: this\n"
          "// rank's chunk) and its optimizer state (-1: none); its elements, its ZeRO chunk (0:\n"
          "// none) and which sum of squares its norm term joins.\n"
          "struct TailRow {\n  int64_t param, master, grad, state[2], numel, chunk;\n"
          "  int norm;\n};\n\n";
  if (!opts.cuda())
    os << glueBegin();
  if (!layerDefs.empty())
    os << "// ---- Layers: one function each for the layers that compute the same ----\n\n"
       << layerDefs;
  // The forward is a function that step and evaluate call, where its
  // statements can be printed once: not under ZeRO-3, whose gathers of the
  // backward may start in the forward (prefetch).
  const bool ownForward = zero != 3;
  const std::string forwardCall = "  forward(ctx);\n";
  std::string readAfter;
  if (ownForward) {
    readAfter = forwardValuesReadAfter(backwardBegin);
    if (!readAfter.empty())
      readAfter = "\n  // The forward's values read from here on, where it wrote them.\n" + readAfter;
    os << "/// The forward: every statement up to the loss. step and evaluate (train "
          "--eval-data) call it.\n"
       << "void forward(StepContext &ctx) {\n  char *const A = ctx.arena;\n"
       << "  // ---- Inputs, parameters and buffers ----\n"
       << argumentPointers() << "\n  // ---- Forward ----\n\n"
       << body.substr(0, forwardEnd) << "}\n\n";
  }
  if (opts.cuda()) {
    os << "// The step's forward and backward, with their collectives: what `train --cuda-graph`\n"
       << "// captures in a CUDA graph and replays (graphStep in step below; docs/cuda.md).\n"
       << "void forwardBackward(StepContext &ctx) {\n  char *const A = ctx.arena;\n";
  } else {
    os << "void step(StepContext &ctx) {\n";
    os << plan << "\n  char *const A = ctx.arena;\n" << precisionLine(opts) << "\n";
  }
  if (ownForward)
    os << forwardCall << "\n";
  os << "  // ---- Inputs, parameters and buffers ----\n";
  os << argumentPointers();
  if (ownForward)
    os << readAfter << body.substr(forwardEnd);
  else
    os << "\n  // ---- Forward ----\n\n" << body;
  if (opts.cuda()) {
    os << "}\n\nvoid step(StepContext &ctx) {\n"
       << plan << "\n  char *const A = ctx.arena;\n"
       << precisionLine(opts) << dropoutStateLine(opts, dropoutNodes(fn)) << "\n"
       << graphBefore
       << "\n  // Forward and backward: run as they are, or (train --cuda-graph) run once, then\n"
       << "  // captured in a CUDA graph and replayed.\n"
       << "  " + callee(opts, "graphStep") + "(ctx, forwardBackward);\n"
       << graphAfter;
  }
  os << tail << "}\n\n";

  os << "/// Forward only (train --eval-data): the global loss of the inputs in the arena; no\n"
     << "/// gradient, no update. The same statements as the step's forward.\n"
     << "void evaluate(StepContext &ctx) {\n  char *const A = ctx.arena;\n"
     << precisionLine(opts);
  if (ownForward) {
    os << forwardCall << readAfter;
  } else {
    os << "  // ---- Inputs, parameters and buffers ----\n";
    os << argumentPointers();
    os << "\n  // ---- Forward ----\n\n" << body.substr(0, forwardEnd);
  }
  os << evalTail << "}\n" << (opts.cuda() ? "" : glueEnd()) << "\n";

  if (!inputRows.empty())
    out.vocab = tokenVocab(fn, inputRows[0].name, opts.tp);
  out.dropoutNodes = dropoutNodes(fn);
  emitProgramTables(os, opts, out, inputRows, paramRows, nullptr);
  return src;
}

} // namespace codegen

bool generateCpuProgram(ModuleOp module, const CodegenOptions &given, GeneratedProgram &out,
                        std::string &error) {
  codegen::EmitOptions opts;
  if (!codegen::withPlan(module, given, opts, error))
    return false;
  auto fn = module.lookupSymbol<func::FuncOp>("train_step");
  if (!fn) {
    error = "the module has no @train_step (run autodiff first)";
    return false;
  }
  if (fn.getBody().getBlocks().size() != 1) {
    error = "@train_step must be a single block";
    return false;
  }
  codegen::Generator g(fn, opts, out, error);
  return g.run();
}

} // namespace carve
