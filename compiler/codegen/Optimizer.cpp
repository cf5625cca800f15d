//===- Optimizer.cpp - the step's tail: norm, clipping, updates -----------===//
//
// Prints the ops carve-optimizer appended after backward (readStepTail reads
// and checks them): fp16's loss-scale removal, the gradients' norm
// (tp-split and ZeRO-chunked terms summed over their axes), clipping, the
// scheduled learning rate and every parameter's AdamW or SGD update (ZeRO:
// this rank's chunk, then the gathers of ZeRO-1 and 2). Both the whole step
// and the pipeline program end with these.
//
//===----------------------------------------------------------------------===//

#include "compiler/codegen/Generator.h"
#include "compiler/optimizer/Optimizer.h"

using namespace mlir;

namespace carve {

namespace codegen {

/// The global loss from this rank's share: summed over the dp replicas, and
/// for a mean divided by their number.
void emitDpLoss(llvm::raw_ostream &os, const EmitOptions &opts, const std::string &reduction) {
  if (opts.dp <= 1)
    return;
  os << "  ctx.dpComm->allReduce(&loss, 1, CommType::F32, ReduceOp::Sum);  // reason: report "
        "the global loss\n";
  if (reduction == "mean")
    os << "  loss /= " << opts.dp << ".0f;  // the mean of " << opts.dp
       << " equal shares is the global mean\n";
}

void emitGradientsReadyHook(llvm::raw_ostream &os) {
  os << "\n  if (ctx.hooks)\n    ctx.hooks->gradientsReady(ctx);  // train --on-nan\n";
}

void emitUpdateGuard(llvm::raw_ostream &os, const char *sumOfSquares) {
  os << "  double norm = std::sqrt(" << sumOfSquares << ");\n  ctx.gradNorm = (float)norm;\n";
  os << "  if (ctx.hooks && !ctx.hooks->updateAllowed(ctx, norm))\n"
        "    return;  // a non-finite loss or gradient: no update (train --on-nan)\n";
}

void emitClipCoefficient(llvm::raw_ostream &os, const OptimizerConfig &o) {
  os << "  // torch.nn.utils.clip_grad_norm_(max_norm=ctx.hyper->clip): compiled "
     << (o.clipGradNorm > 0 ? number(o.clipGradNorm, false) : std::string("0, no clipping"))
     << "; train --clip\n";
  os << "  const float clip = clipCoefficient(norm, ctx.hyper->clip);\n";
}

void emitLearningRate(llvm::raw_ostream &os, const OptimizerConfig &o) {
  os << "\n  // " << o.describe() << " (compiled: the defaults in kHyper;\n"
     << "  // train --lr, --schedule, --weight-decay, ... override them for a run)\n";
  os << "  const Hyperparameters &h = *ctx.hyper;\n";
  os << "  const double lr = scheduledLr(ctx.step, h);\n";
  os << "  ctx.lr = (float)lr;\n";
}

bool Generator::grad16(const GradSlot &g) {
  Type e = typeOf(g.value).getElementType();
  return e.isBF16() || e.isF16();
}

bool Generator::chunk16(const GradSlot &g) { return grad16(g) && !opts.fp32Accumulators; }

std::string Generator::gradPtr(const GradSlot &g) {
  return std::string(grad16(g) ? "(uint16_t *)" : "(float *)") + "(A + " +
         std::to_string(buffers[g.buffer].offset) + ")";
}

std::string Generator::asGrad16(const std::string &ptr) {
  return "Grad16{" + ptr + (opts.precision == "fp16" ? ", true}" : ", false}");
}

std::string Generator::gradCommType(const GradSlot &g) {
  if (!grad16(g))
    return "CommType::F32";
  return opts.precision == "fp16" ? "CommType::F16" : "CommType::BF16";
}

std::string Generator::commTypeOf(unsigned arg) {
  Type e = typeOf(fn.getArgument(arg)).getElementType();
  return e.isBF16() ? "CommType::BF16" : e.isF16() ? "CommType::F16" : "CommType::F32";
}

int64_t Generator::elementBytes(unsigned arg) {
  std::string ctype, dtype;
  int size = 4;
  elementInfo(typeOf(fn.getArgument(arg)).getElementType(), ctype, dtype, size);
  return size;
}

std::string Generator::chunkPtr(const GradSlot &g) {
  return std::string(chunk16(g) ? "(uint16_t *)" : "(float *)") + "(A + " +
         std::to_string(buffers[shardOf[g.param]].offset) + ")";
}

std::string Generator::tailPointers(const std::string &prefix) {
  const OptimizerConfig &o = opts.optimizer;
  const bool adam = o.kind == "adamw";
  const bool momentum = !adam && o.momentum != 0;
  const char *stateName[2] = {adam ? "exp_avg" : "momentum", "exp_avg_sq"};
  const std::string chunk = zero ? " (this rank's ZeRO chunk)" : "";
  std::string s = "\n  // The optimizer's tensors: each parameter, its gradient";
  s += zero >= 2 ? " chunk" : "";
  s += adam ? ", exp_avg and exp_avg_sq" : momentum ? " and momentum buffer" : "";
  s += " (memory plan above).\n";
  auto declare = [&](const std::string &name, int64_t offset, const std::string &what) {
    s +=
        "  float *" + name + " = (float *)(A + " + std::to_string(offset) + ");  // " + what + "\n";
  };
  for (GradSlot &g : grads) {
    const unsigned a = g.param;
    const std::string base = prefix + var.map.lookup(fn.getArgument(a)); // a name, not a read
    TailNames &t = tailNames[a];
    t.param = uniqueName("param_" + base);
    const int64_t at = buffers[bufferOf.lookup(fn.getArgument(a))].offset;
    if (auto m = masterOf.find(a); m != masterOf.end()) {
      // Mixed-precision storage: the step reads the 16-bit copy; the update
      // writes the fp32 master and rounds it into the copy.
      s += "  uint16_t *" + t.param + " = (uint16_t *)(A + " + std::to_string(at) + ");  // " +
           paramName(a) + ", the 16-bit copy" + (zero == 3 ? chunk : "") + "\n";
      t.master = uniqueName("master_" + base);
      declare(t.master, m->second, "the fp32 master of " + paramName(a) + (zero ? chunk : ""));
    } else {
      declare(t.param, at, paramName(a) + (zero == 3 ? chunk : ""));
    }
    t.grad = uniqueName((zero >= 2 ? "grad_chunk_" : "grad_") + base);
    const int64_t gradAt = buffers[zero >= 2 ? shardOf[a] : g.buffer].offset;
    const std::string gradWhat = "gradient of " + paramName(a) + (zero >= 2 ? chunk : "");
    if (tailGrad16(g))
      s += "  const Grad16 " + t.grad + " = " +
           asGrad16("(uint16_t *)(A + " + std::to_string(gradAt) + ")") + ";  // " + gradWhat +
           ", " + (opts.precision == "fp16" ? "fp16" : "bf16") + "\n";
    else
      declare(t.grad, gradAt, gradWhat);
    const int slots = adam ? 2 : momentum ? 1 : 0;
    for (int k = 0; k < slots; ++k) {
      t.state[k] = uniqueName(std::string(stateName[k]) + "_" + base);
      declare(t.state[k], stateOf[a][k], std::string(stateName[k]) + " of " + paramName(a) + chunk);
    }
  }
  return s;
}

std::string Generator::chunkCount(unsigned arg, const std::string &rank) {
  return "std::max<int64_t>(0, std::min<int64_t>(" + std::to_string(chunkOf[arg]) + ", " +
         std::to_string(numelOf[arg]) + " - (int64_t)" + rank + " * " +
         std::to_string(chunkOf[arg]) + "))";
}

bool Generator::readStepTail() {
  if (!readTail(fn, tail, error))
    return false;
  const std::string where = "@" + fn.getSymName().str() + ": ";
  auto everyGradient = [&](const std::vector<int64_t> &slots) {
    return slots.size() == grads.size();
  };
  if (tail.unscale != (opts.precision == "fp16" && !grads.empty()) ||
      (tail.unscale && !everyGradient(tail.unscaled)))
    return fail(where +
                "carve.unscale_gradients must divide every gradient by the loss scale "
                "under fp16 and is not used otherwise (precision " +
                opts.precision + ")");
  if (!tail.clip || !everyGradient(tail.clipped))
    return fail(where + "the tail needs carve.clip_coefficient and carve.scale_gradients of every "
                        "gradient (a run may clip: train --clip)");
  std::set<unsigned> want, got(tail.gathered.begin(), tail.gathered.end());
  if (zero == 1 || zero == 2)
    for (const GradSlot &g : grads)
      want.insert(g.param);
  if (want != got)
    return fail(where + "carve.zero_gather gathers " + std::to_string(got.size()) +
                " parameter(s); ZeRO-" + std::to_string(zero) +
                " over dp = " + std::to_string(opts.dp) + " needs " + std::to_string(want.size()) +
                " (every updated parameter's chunks)");
  return true;
}

bool Generator::tailKernel(llvm::StringRef kernel) {
  bool found = false;
  fn.walk([&](Operation *op) {
    auto k = op->getAttrOfType<StringAttr>(kKernelAttr);
    found |= isOptimizerOp(op) && k && k.getValue() == kernel;
  });
  return found;
}

void Generator::emitNormTerms(llvm::raw_ostream &ts) {
  if (tailAsTable)
    return emitTableNormTerms(ts);
  const bool multi = opts.cuda() && tailKernel("sumSquaresMulti");
  // Each multi-tensor call site has its own number (its table's key in the
  // runtime) and array name: a pipeline rank prints several tails.
  const int site = multiSites;
  if (multi && !tail.normSlots.empty()) {
    ++multiSites;
    ts << "  // sumSquaresMulti: every term in two launches, bit for bit sumSquaresAdd each\n"
       << "  const gpu::SquaresTerm normTerms" << site << "[] = {\n";
  }
  for (size_t k = 0; k < tail.normSlots.size(); ++k) {
    const GradSlot &g = grads[tail.normSlots[k]];
    const bool split = tail.normSplit[k];
    const std::string &ptr = tailNames[g.param].grad;
    std::string count;
    if (zero >= 2)
      count = chunkCount(g.param, "ctx.dpRank");
    else
      count = std::to_string(numelOf[g.param]);
    // Expert parallelism: each ep rank holds other experts, whose squares
    // are summed over the ep group (sqExpert*) before they join the rest.
    const bool expert = opts.ep > 1 && fn.getArgAttr(g.param, kExpertAttr);
    if (multi)
      ts << "      gpu::squaresTerm(" << ptr << ", " << count << ", "
         << (split ? 0 : 1) + (expert ? 2 : 0) << "),  // " << paramName(g.param) << "\n";
    else if (opts.cuda())
      ts << "  " + callee(opts, "sumSquaresAdd") + "(" << ptr << ", " << count << ", sqDevice + "
         << (split ? 0 : 1) + (expert ? 2 : 0) << ");  // " << paramName(g.param) << "\n";
    else
      ts << "  "
         << (expert ? (split ? "sqExpertSplit" : "sqExpertWhole") : (split ? "sqSplit" : "sqWhole"))
         << " += " + callee(opts, "sumSquares") + "(" << ptr << ", " << count << ");  // "
         << paramName(g.param) << "\n";
  }
  if (multi && !tail.normSlots.empty())
    ts << "  };\n  " << callee(opts, "sumSquaresMulti") << "(" << site << ", normTerms" << site
       << ", " << tail.normSlots.size() << ", sqDevice);\n";
}

void Generator::emitClip(llvm::raw_ostream &ts) {
  if (tailAsTable)
    return emitTableScale(ts, "clip");
  for (int64_t slot : tail.clipped) {
    const GradSlot &g = grads[slot];
    ts << "    " + callee(opts, "scaleInPlace") + "(" << tailNames[g.param].grad << ", "
       << (zero >= 2 ? chunkOf[g.param] : numelOf[g.param]) << ", clip);\n";
  }
}

void Generator::emitUnscale(llvm::raw_ostream &ts) {
  if (!tail.unscale)
    return;
  ts << "\n  // fp16: the gradients carry the dynamic loss scale (train_main adjusts it); divide "
        "it\n"
     << "  // out before the norm, the check for overflow and the update.\n"
     << "  if (ctx.lossScale != 1.0f) {\n    const float unscale = 1.0f / ctx.lossScale;\n";
  if (tailAsTable) {
    emitTableScale(ts, "unscale");
    ts << "  }\n";
    return;
  }
  for (int64_t slot : tail.unscaled) {
    const GradSlot &g = grads[slot];
    ts << "    " + callee(opts, "scaleInPlace") + "(" << tailNames[g.param].grad << ", "
       << (zero >= 2 ? chunkOf[g.param] : numelOf[g.param]) << ", unscale);\n";
  }
  ts << "  }\n";
}

void Generator::emitUpdates(llvm::raw_ostream &ts) {
  if (tailAsTable)
    return emitTableUpdates(ts);
  const OptimizerConfig &o = opts.optimizer;
  const bool adam = o.kind == "adamw";
  const bool momentum = !adam && o.momentum != 0;
  if (zero)
    ts << "  // ZeRO-" << zero << ": this replica updates its chunk of each parameter.\n";
  const bool multi =
      opts.cuda() && tailKernel(adam ? "adamwMulti" : "sgdMulti") && !tail.updated.empty();
  const int site = multi ? multiSites++ : -1;
  if (multi && adam)
    ts << "  // adamwMulti: every update in one launch, bit for bit adamwUpdate (with the\n"
       << "  // 16-bit copy: adamwUpdateCopy16) one by one.\n"
       << "  const gpu::AdamwTensor adamTensors" << site << "[] = {\n";
  else if (multi)
    ts << "  // sgdMulti: every update in one launch, bit for bit sgdUpdate (then the\n"
       << "  // 16-bit copy's toBf16 / toF16) one by one.\n"
       << "  const gpu::SgdTensor sgdTensors" << site << "[] = {\n";
  for (int64_t slot : tail.updated) {
    unsigned a = grads[slot].param;
    const TailNames &t = tailNames[a];
    std::string p = t.param, go = t.grad, n = std::to_string(numelOf[a]);
    std::string copy = t.param; // where a master's update is rounded to
    if (zero) {
      std::string c = std::to_string(chunkOf[a]);
      std::string off = "(int64_t)ctx.dpRank * " + c;
      n = chunkCount(a, "ctx.dpRank");
      p = zero == 3 ? t.param : t.param + " + " + off;
      copy = p;
      go = zero >= 2 ? t.grad : t.grad + " + " + off;
    }
    if (!t.master.empty())
      p = t.master; // the whole master, or (ZeRO) this rank's chunk of it
    // On CUDA the update writes the master's 16-bit copy itself.
    const bool fusedCopy = adam && opts.cuda() && !t.master.empty();
    if (multi) {
      const std::string copyOrNull = t.master.empty() ? std::string("nullptr") : copy;
      if (adam)
        ts << "      gpu::adamwTensor(" << p << ", " << go << ", " << t.state[0] << ", "
           << t.state[1] << ", " << n << ", " << copyOrNull << "),  // " << paramName(a) << "\n";
      else
        ts << "      gpu::sgdTensor(" << p << ", " << go << ", "
           << (momentum ? t.state[0] : std::string("nullptr")) << ", " << n << ", " << copyOrNull
           << "),  // " << paramName(a) << "\n";
      continue;
    }
    if (fusedCopy)
      ts << "  " + callee(opts, "adamwUpdateCopy16") + "(" << p << ", " << go << ", " << t.state[0]
         << ", " << t.state[1] << ", " << n
         << ", lr, h.beta1, h.beta2, h.eps, h.weightDecay, ctx.step + 1, " << copy
         << ", /*copyF16=*/" << (opts.precision == "fp16" ? "true" : "false") << ");  // "
         << paramName(a) << " and its " << (opts.precision == "fp16" ? "fp16" : "bf16")
         << " copy, rounded to nearest even\n";
    else if (adam)
      ts << "  " + callee(opts, "adamwUpdate") + "(" << p << ", " << go << ", " << t.state[0]
         << ", " << t.state[1] << ", " << n
         << ", lr, h.beta1, h.beta2, h.eps, h.weightDecay, ctx.step + 1);  // " << paramName(a)
         << "\n";
    else
      ts << "  " + callee(opts, "sgdUpdate") + "(" << p << ", " << go << ", "
         << (momentum ? t.state[0] : std::string("nullptr")) << ", " << n << ", lr, "
         << number(o.momentum, false) << ", " << number(o.dampening, false) << ", h.weightDecay, "
         << "/*nesterov=*/" << (o.nesterov ? "true" : "false")
         << ", /*firstStep=*/ctx.step == 0);  // " << paramName(a) << "\n";
    if (!t.master.empty() && !fusedCopy)
      ts << "  " << callee(opts, opts.precision == "fp16" ? "toF16" : "toBf16") << "(" << t.master
         << ", " << copy << ", " << n << ");  // the "
         << (opts.precision == "fp16" ? "fp16" : "bf16") << " copy of " << paramName(a)
         << ", rounded to nearest even\n";
  }
  if (multi && adam)
    ts << "  };\n  " << callee(opts, "adamwMulti") << "(" << site << ", adamTensors" << site << ", "
       << tail.updated.size() << ", /*copyF16=*/" << (opts.precision == "fp16" ? "true" : "false")
       << ", lr, h.beta1, h.beta2, h.eps, h.weightDecay, ctx.step + 1);\n";
  else if (multi)
    ts << "  };\n  " << callee(opts, "sgdMulti") << "(" << site << ", sgdTensors" << site << ", "
       << tail.updated.size() << ", /*copyF16=*/" << (opts.precision == "fp16" ? "true" : "false")
       << ", lr, " << number(o.momentum, false) << ", " << number(o.dampening, false)
       << ", h.weightDecay, /*nesterov=*/" << (o.nesterov ? "true" : "false")
       << ", /*firstStep=*/ctx.step == 0);\n";
  if (!tail.gathered.empty()) {
    ts << "\n  // ZeRO-" << zero << ": every replica needs every updated parameter: gather the "
       << "chunks in place.\n  {\n    CommHandle h[" << tail.gathered.size() << "];\n";
    for (size_t i = 0; i < tail.gathered.size(); ++i) {
      unsigned a = tail.gathered[i];
      const std::string &p = tailNames[a].param;
      ts << "    h[" << i << "] = ctx.dpComm->allGatherAsync(" << p << " + (int64_t)ctx.dpRank * "
         << chunkOf[a] << ", " << p << ", " << chunkOf[a] << ", " << commTypeOf(a) << ");  // "
         << paramName(a) << "\n";
    }
    ts << "    for (CommHandle &x : h) ctx.dpComm->wait(x);\n  }\n";
  }
}

} // namespace codegen

} // namespace carve

namespace carve::codegen {

// ---- The tail as loops over a table (the whole step) ----
//
// Where every list of the tail (norm terms, clipping, fp16's unscaling, the
// updates, ZeRO-1/2's gathers) names the gradients in the order backward
// finished them, and every row has the same gradient format and master rule,
// the tail is a table with one row per parameter and one loop per list: the
// same calls in the same order as one statement each, so a 48-layer model's
// tail is 48 layers of rows, not of statements.

bool Generator::planTailTable() {
  const size_t n = grads.size();
  if (n == 0)
    return false;
  auto inOrder = [&](const std::vector<int64_t> &slots) {
    if (slots.size() != n)
      return false;
    for (size_t i = 0; i < n; ++i)
      if (slots[i] != (int64_t)i)
        return false;
    return true;
  };
  if (!inOrder(tail.normSlots) || !inOrder(tail.clipped) || !inOrder(tail.updated) ||
      (tail.unscale && !inOrder(tail.unscaled)))
    return false;
  if (!tail.gathered.empty()) {
    if (tail.gathered.size() != n)
      return false;
    for (size_t i = 0; i < n; ++i)
      if (tail.gathered[i] != grads[i].param)
        return false;
  }
  for (const GradSlot &g : grads)
    if (tailGrad16(g) != tailGrad16(grads[0]) ||
        masterOf.count(g.param) != masterOf.count(grads[0].param) ||
        commTypeOf(g.param) != commTypeOf(grads[0].param))
      return false;
  return true;
}

/// The row's pointer expressions.
namespace {
struct RowExprs {
  std::string param, master, grad, state0, state1, off;
};
} // namespace

std::string Generator::tailTable() {
  const OptimizerConfig &o = opts.optimizer;
  const bool adam = o.kind == "adamw";
  const bool momentum = !adam && o.momentum != 0;
  const int slots = adam ? 2 : momentum ? 1 : 0;
  std::string s = "\n  // The optimizer's tensors, one row per parameter (TailRow above) in the "
                  "order\n  // backward finished their gradients.\n";
  s += "  static const TailRow tail[" + std::to_string(grads.size()) + "] = {\n";
  for (size_t i = 0; i < grads.size(); ++i) {
    const GradSlot &g = grads[i];
    const unsigned a = g.param;
    auto m = masterOf.find(a);
    const bool expert = opts.ep > 1 && fn.getArgAttr(a, kExpertAttr);
    s += "      {" + std::to_string(buffers[bufferOf.lookup(fn.getArgument(a))].offset) + ", " +
         std::to_string(m == masterOf.end() ? -1 : m->second) + ", " +
         std::to_string(buffers[zero >= 2 ? shardOf[a] : g.buffer].offset) + ", {" +
         std::to_string(slots > 0 ? stateOf[a][0] : -1) + ", " +
         std::to_string(slots > 1 ? stateOf[a][1] : -1) + "}, " + std::to_string(numelOf[a]) +
         ", " + std::to_string(zero ? chunkOf[a] : 0) + ", " +
         std::to_string((tail.normSplit[i] ? 0 : 1) + (expert ? 2 : 0)) + "},  // " +
         paramName(a) + "\n";
  }
  return s + "  };\n";
}

/// The expressions of row `r` (a `const TailRow &r` in the loop).
static RowExprs rowExprs(bool master, bool grad16, bool fp16, int zero) {
  RowExprs e;
  e.param = master ? "(uint16_t *)(A + r.param)" : "(float *)(A + r.param)";
  e.master = "(float *)(A + r.master)";
  e.grad = grad16 ? std::string("Grad16{(uint16_t *)(A + r.grad), ") + (fp16 ? "true}" : "false}")
                  : "(float *)(A + r.grad)";
  e.state0 = "(float *)(A + r.state[0])";
  e.state1 = "(float *)(A + r.state[1])";
  e.off = zero ? "(int64_t)ctx.dpRank * r.chunk" : "";
  return e;
}

void Generator::emitTableNormTerms(llvm::raw_ostream &ts) {
  const GradSlot &g0 = grads[0];
  RowExprs e = rowExprs(masterOf.count(g0.param), tailGrad16(g0), opts.precision == "fp16", zero);
  const std::string count =
      zero >= 2 ? "std::max<int64_t>(0, std::min<int64_t>(r.chunk, r.numel - " + e.off + "))"
                : std::string("r.numel");
  if (opts.cuda() && tailKernel("sumSquaresMulti")) {
    const size_t n = grads.size();
    const int site = multiSites++;
    const std::string terms = "normTerms" + std::to_string(site);
    ts << "  // sumSquaresMulti: every row's squares in two launches, bit for bit\n"
       << "  // sumSquaresAdd row by row.\n"
       << "  gpu::SquaresTerm " << terms << "[" << n << "];\n"
       << "  for (size_t i = 0; i < " << n << "; ++i) {\n"
       << "    const TailRow &r = tail[i];\n"
       << "    " << terms << "[i] = gpu::squaresTerm(" << e.grad << ", " << count << ", r.norm);\n"
       << "  }\n  " << callee(opts, "sumSquaresMulti") << "(" << site << ", " << terms << ", " << n
       << ", sqDevice);\n";
    return;
  }
  if (opts.cuda()) {
    ts << "  for (const TailRow &r : tail)\n    " << callee(opts, "sumSquaresAdd") << "("
       << e.grad << ", " << count << ", sqDevice + r.norm);\n";
    return;
  }
  ts << "  double *const sumOf[] = {&sqSplit, &sqWhole"
     << (opts.ep > 1 ? ", &sqExpertSplit, &sqExpertWhole" : "") << "};\n";
  ts << "  for (const TailRow &r : tail)\n    *sumOf[r.norm] += " << callee(opts, "sumSquares")
     << "(" << e.grad << ", " << count << ");\n";
}

void Generator::emitTableScale(llvm::raw_ostream &ts, const char *factor) {
  const GradSlot &g0 = grads[0];
  RowExprs e = rowExprs(masterOf.count(g0.param), tailGrad16(g0), opts.precision == "fp16", zero);
  ts << "    for (const TailRow &r : tail)\n      " << callee(opts, "scaleInPlace") << "(" << e.grad
     << ", " << (zero >= 2 ? "r.chunk" : "r.numel") << ", " << factor << ");\n";
}

void Generator::emitTableUpdates(llvm::raw_ostream &ts) {
  const OptimizerConfig &o = opts.optimizer;
  const bool adam = o.kind == "adamw";
  const bool momentum = !adam && o.momentum != 0;
  const GradSlot &g0 = grads[0];
  const bool master = masterOf.count(g0.param);
  RowExprs e = rowExprs(master, tailGrad16(g0), opts.precision == "fp16", zero);
  if (zero)
    ts << "  // ZeRO-" << zero << ": this replica updates its chunk of each parameter.\n";
  std::string p = e.param, go = e.grad, n = "r.numel";
  if (zero) {
    n = "std::max<int64_t>(0, std::min<int64_t>(r.chunk, r.numel - " + e.off + "))";
    p = zero == 3 ? e.param : e.param + " + " + e.off;
    go = zero >= 2 ? e.grad : e.grad + " + " + e.off;
  }
  const std::string copy = p; // where a master's update is rounded to
  if (master)
    p = e.master;
  if (!adam && opts.cuda() && tailKernel("sgdMulti")) {
    const size_t rows = grads.size();
    const int site = multiSites++;
    const std::string tensors = "sgdTensors" + std::to_string(site);
    ts << "  // sgdMulti: every row's update in one launch, bit for bit sgdUpdate"
       << (master ? " and the 16-bit copy" : "") << " row by row.\n"
       << "  gpu::SgdTensor " << tensors << "[" << rows << "];\n"
       << "  for (size_t i = 0; i < " << rows << "; ++i) {\n"
       << "    const TailRow &r = tail[i];\n";
    if (zero)
      ts << "    const int64_t n = " << n << ";\n", n = "n";
    ts << "    " << tensors << "[i] = gpu::sgdTensor(" << p << ", " << go << ", "
       << (momentum ? e.state0 : std::string("nullptr")) << ", " << n << ", "
       << (master ? copy : std::string("nullptr")) << ");\n"
       << "  }\n  " << callee(opts, "sgdMulti") << "(" << site << ", " << tensors << ", " << rows
       << ", /*copyF16=*/" << (opts.precision == "fp16" ? "true" : "false") << ", lr, "
       << number(o.momentum, false) << ", " << number(o.dampening, false)
       << ", h.weightDecay, /*nesterov=*/" << (o.nesterov ? "true" : "false")
       << ", /*firstStep=*/ctx.step == 0);\n";
  } else if (adam && opts.cuda() && tailKernel("adamwMulti")) {
    const size_t rows = grads.size();
    const int site = multiSites++;
    const std::string tensors = "adamTensors" + std::to_string(site);
    ts << "  // adamwMulti: every row's update in one launch, bit for bit "
       << (master ? "adamwUpdateCopy16" : "adamwUpdate") << " row by row.\n"
       << "  gpu::AdamwTensor " << tensors << "[" << rows << "];\n"
       << "  for (size_t i = 0; i < " << rows << "; ++i) {\n"
       << "    const TailRow &r = tail[i];\n";
    if (zero)
      ts << "    const int64_t n = " << n << ";\n", n = "n";
    ts << "    " << tensors << "[i] = gpu::adamwTensor(" << p << ", " << go << ", " << e.state0
       << ", " << e.state1 << ", " << n << ", " << (master ? copy : std::string("nullptr"))
       << ");\n"
       << "  }\n  " << callee(opts, "adamwMulti") << "(" << site << ", " << tensors << ", " << rows
       << ", /*copyF16=*/" << (opts.precision == "fp16" ? "true" : "false")
       << ", lr, h.beta1, h.beta2, h.eps, h.weightDecay, ctx.step + 1);\n";
  } else {
    ts << "  for (const TailRow &r : tail) {\n";
    if (zero)
      ts << "    const int64_t n = " << n << ";\n", n = "n";
    const bool fusedCopy = adam && opts.cuda() && master;
    if (fusedCopy)
      ts << "    " << callee(opts, "adamwUpdateCopy16") << "(" << p << ", " << go << ", "
         << e.state0 << ", " << e.state1 << ", " << n
         << ", lr, h.beta1, h.beta2, h.eps, h.weightDecay, ctx.step + 1, " << copy
         << ", /*copyF16=*/" << (opts.precision == "fp16" ? "true" : "false") << ");  // and the "
         << (opts.precision == "fp16" ? "fp16" : "bf16") << " copy, rounded to nearest even\n";
    else if (adam)
      ts << "    " << callee(opts, "adamwUpdate") << "(" << p << ", " << go << ", " << e.state0
         << ", " << e.state1 << ", " << n
         << ", lr, h.beta1, h.beta2, h.eps, h.weightDecay, ctx.step + 1);\n";
    else
      ts << "    " << callee(opts, "sgdUpdate") << "(" << p << ", " << go << ", "
         << (momentum ? e.state0 : std::string("nullptr")) << ", " << n << ", lr, "
         << number(o.momentum, false) << ", " << number(o.dampening, false) << ", h.weightDecay, "
         << "/*nesterov=*/" << (o.nesterov ? "true" : "false")
         << ", /*firstStep=*/ctx.step == 0);\n";
    if (master && !fusedCopy)
      ts << "    " << callee(opts, opts.precision == "fp16" ? "toF16" : "toBf16") << "(" << e.master
         << ", " << copy << ", " << n << ");  // the "
         << (opts.precision == "fp16" ? "fp16" : "bf16") << " copy, rounded to nearest even\n";
    ts << "  }\n";
  }
  if (!tail.gathered.empty()) {
    ts << "\n  // ZeRO-" << zero << ": every replica needs every updated parameter: gather the "
       << "chunks in place.\n  {\n    CommHandle handles[" << tail.gathered.size() << "];\n"
       << "    for (size_t i = 0; i < " << tail.gathered.size() << "; ++i) {\n"
       << "      const TailRow &r = tail[i];\n"
       << "      handles[i] = ctx.dpComm->allGatherAsync(" << e.param << " + " << e.off << ", "
       << e.param << ", r.chunk, " << commTypeOf(g0.param) << ");\n    }\n"
       << "    for (CommHandle &x : handles) ctx.dpComm->wait(x);\n  }\n";
  }
}

} // namespace carve::codegen
