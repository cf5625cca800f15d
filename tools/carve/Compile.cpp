//===- Compile.cpp - `carve compile` ---------------------------------------===//
//
// The plan and the command line -> import (global batch, then one rank's or
// micro-batch's share) -> the plan on the module -> the pass pipeline
// (compiler/driver/CompilePipeline.h) -> the emitter -> OUT/src,
// OUT/init.safetensors, OUT/plan.json -> the system C++ compiler (or nvcc)
// links OUT/bin/train against the runtime. Everything is written in a
// temporary directory next to OUT and renamed into place at the end, so a
// failure leaves a previous OUT untouched.
//
//===----------------------------------------------------------------------===//

#include "tools/carve/Compile.h"
#include "tools/carve/CompileSteps.h"

#include "compiler/driver/CompilePipeline.h"
#include "compiler/frontend/Builtin.h"
#include "compiler/fusion/Fusion.h"
#include "compiler/lower/GpuCost.h"
#include "compiler/plan/Plan.h"
#include "compiler/rules/Rules.h"
#include "compiler/schedule/Schedule.h"
#include "compiler/schedule/Timeline.h"
#include "compiler/stages/StageSplit.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"
#include "dialects/dist/DistDialect.h"
#include "tools/carve/Build.h"
#include "tools/carve/Driver.h"
#include "tools/carve/Outputs.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Pass/PassInstrumentation.h"
#include "mlir/Pass/PassManager.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>

using namespace llvm;

namespace carve {

namespace {

/// The plan as the passes read it (dialects/carve/Contract.h).
PlanAttrs planAttrs(const Plan &plan, const Imported &im) {
  PlanAttrs p;
  p.dp = plan.dp;
  p.tp = plan.tp;
  p.pp = plan.pp;
  p.ep = plan.ep;
  p.zero = plan.zero;
  p.zero3PrefetchLayers = plan.zero3PrefetchLayers;
  p.sequenceParallel = plan.sequenceParallel;
  p.syncBatchNorm = plan.syncBatchNorm;
  p.microBatches = im.m;
  p.virtualStages = plan.virtualStages;
  p.schedule = plan.scheduleName();
  p.precision = plan.precision;
  p.tf32 = plan.tf32;
  p.gradAccumulation = plan.gradAccumulation;
  p.globalBatch = im.batch;
  p.recompute = plan.recompute;
  p.recomputeLayers = plan.recomputeLayers;
  p.cuts = plan.cuts;
  p.ops = plan.ops;
  return p;
}

/// What the partitioner did, read off the module.
void readPartitionSummary(mlir::ModuleOp module, PartitionSummary &p) {
  auto d = module->getAttrOfType<mlir::DictionaryAttr>(kPartitionSummaryAttr);
  if (!d)
    return;
  auto get = [&](const char *k) {
    auto a = d.getAs<mlir::IntegerAttr>(k);
    return a ? a.getInt() : 0;
  };
  p = {get("ops_split"), get("all_reduce"), get("all_gather"), get("reduce_scatter"),
       get("all_to_all")};
}

/// The progress line of each pass, with a note read off the IR it produced.
struct PassProgress : mlir::PassInstrumentation {
  PassProgress(Progress &progress, const Setup &s, const Imported &im)
      : progress(progress), s(s), im(im) {}

  void runBeforePass(mlir::Pass *pass, mlir::Operation *) override {
    current = pass->getArgument().str();
    const Plan &plan = s.plan;
    if (current == "carve-partition")
      progress.start("partition (" +
                     std::string(plan.tp > 1 ? "tp=" + std::to_string(plan.tp) : "") +
                     (plan.tp > 1 && plan.zero > 0 ? ", " : "") +
                     (plan.zero > 0 ? "zero=" + std::to_string(plan.zero) : "") + ")");
    else if (current == "carve-split-stages")
      progress.start("pipeline split (pp=" + std::to_string(plan.pp) +
                     ", m=" + std::to_string(im.m) + ")");
    else if (current == "carve-recompute")
      progress.start("recompute (" + plan.recompute + ")");
  }

  void runAfterPass(mlir::Pass *pass, mlir::Operation *op) override {
    auto module = cast<mlir::ModuleOp>(op);
    StringRef arg = pass->getArgument();
    if (arg == "carve-check-overrides") {
      progress.done("forward, backward and " + s.opt.kind + " update");
    } else if (arg == "carve-partition") {
      readPartitionSummary(module, summary);
      progress.done(s.plan.tp > 1 ? std::to_string(summary.opsSplit) + " ops split"
                                  : std::string());
      if (auto notes = module->getAttrOfType<mlir::ArrayAttr>(kReplicatedProjectionsAttr))
        for (mlir::Attribute n : notes)
          llvm::errs() << "carve: note: tp=" << s.plan.tp << ": "
                       << cast<mlir::StringAttr>(n).getValue() << "\n";
    } else if (arg == "carve-split-stages") {
      progress.done(std::to_string(stageFunctions(module).size()) + " stages, " +
                    s.plan.scheduleName() + " schedule");
    } else if (arg == "carve-recompute") {
      int64_t n = 0;
      module.walk([&](mlir::Operation *o) { n += o->hasAttr(kRecomputedAttr) ? 1 : 0; });
      progress.done(std::to_string(n) + " forward ops run again in backward");
    }
  }

  Progress &progress;
  const Setup &s;
  const Imported &im;
  std::string current; // the pass running (or that failed)
  PartitionSummary summary;
};

/// Runs the pass pipeline on the imported model; dies with one line naming
/// the model or the plan when a pass fails.
PartitionSummary runPipeline(Imported &im, const Setup &s, const CompileArgs &args,
                             Progress &progress, int64_t epRank = 0) {
  mlir::ModuleOp module = *im.module;
  mlir::MLIRContext *context = module.getContext();
  PlanAttrs plan = planAttrs(s.plan, im);
  plan.optimizerState = s.opt.stateTensors();
  plan.target = args.target;
  plan.attention = args.attention;
  plan.convolution = args.convolution;
  writePlan(module, plan);
  progress.start("training step");
  mlir::PassManager pm(context);
  // The as-compiled check of carve plan sizes the program; carve compile,
  // which builds it, verifies the IR after every pass.
  pm.enableVerifier(!args.memoryOnly);
  std::vector<std::string> passes = buildCompilePipeline(pm, plan, s.rules, args.loss, args.fuse,
                                                         s.opt, args.bucketBytes, epRank);
  auto instrumentation = std::make_unique<PassProgress>(progress, s, im);
  PassProgress *counts = instrumentation.get();
  pm.addInstrumentation(std::move(instrumentation));
  std::unique_ptr<raw_fd_ostream> irOut;
  if (!args.emitMlirAfter.empty()) {
    if (std::find(passes.begin(), passes.end(), args.emitMlirAfter) == passes.end()) {
      std::string list;
      for (const std::string &p : passes)
        list += (list.empty() ? "" : ", ") + p;
      die("--emit-mlir-after " + args.emitMlirAfter + ": this plan's pipeline has no such pass (" +
          list + ")");
    }
    std::error_code ec;
    std::string path = args.emitMlir.empty() ? "-" : args.emitMlir;
    irOut = std::make_unique<raw_fd_ostream>(path, ec);
    if (ec)
      die(path + ": cannot write: " + ec.message());
    context->disableMultithreading();
    pm.enableIRPrinting(
        [](mlir::Pass *, mlir::Operation *) { return false; },
        [&](mlir::Pass *p, mlir::Operation *) { return p->getArgument() == args.emitMlirAfter; },
        /*printModuleScope=*/true, /*printAfterOnlyOnChange=*/false,
        /*printAfterOnlyOnFailure=*/false, *irOut);
  }
  // A pass reports its failure as a diagnostic; a gradient rule's own
  // diagnostic comes before autodiff's. Fold them into the one error line.
  std::vector<std::string> messages;
  mlir::ScopedDiagnosticHandler handler(context, [&](mlir::Diagnostic &d) {
    messages.push_back(d.str());
    return mlir::success();
  });
  if (succeeded(pm.run(module)))
    return counts->summary;
  const std::string &pass = counts->current;
  std::string last = messages.empty() ? "the pass " + pass + " failed" : messages.back();
  if (pass == "carve-bind-custom-ops" || pass == "carve-autodiff")
    die(args.model + ": " + last + (messages.size() > 1 ? ": " + messages.front() : ""));
  if (pass == "carve-check-overrides")
    die(last);
  die(last.rfind("plan: ", 0) == 0 ? s.where + last.substr(4) : args.model + ": " + last);
}

/// The emitter: one program, or one per pipeline rank.
CompiledModel generate(mlir::ModuleOp module, const CompileArgs &args, const Setup &s,
                       const Imported &im) {
  const Plan &plan = s.plan;
  CompiledModel cm;
  cm.modelName = sys::path::filename(args.model).str();
  cm.plan = &plan;
  cm.optimizer = &s.opt;
  cm.target = args.target;
  cm.globalBatch = im.batch;
  cm.microBatch = im.micro;
  cm.microBatches = im.m;
  cm.pipelined = plan.pp > 1 || im.m > 1;
  cm.rulesPath = args.rulesPath;
  cm.hasCustomKernels = !(cm.cuda() ? s.rules.cudaSources : s.rules.sources).empty();
  CodegenOptions cg;
  cg.modelName = cm.modelName;
  cg.planJson = plan.json;
  cg.memoryOnly = args.memoryOnly;
  ModulePrograms mp;
  std::string error;
  if (!generatePrograms(module, cg, mp, error))
    die(args.model + ": " + error);
  cm.programs = std::move(mp.programs);
  cm.programNames = std::move(mp.names);
  if (cm.pipelined) {
    for (mlir::func::FuncOp stage : stageFunctions(module))
      cm.stages.push_back(readStageSummary(stage).value_or(StageSummary()));
    cm.shared = sharedGradients(module);
  }
  return cm;
}

/// The planned timeline: stage times from FLOPs at a nominal rate (only the
/// ratios matter for the picture and the bubble).
void planTimeline(CompiledModel &cm, const CompileArgs &args, const pipeline::Schedule &schedule) {
  const double rate = 1e12;
  std::vector<pipeline::StageCost> costs;
  for (const StageSummary &st : cm.stages)
    costs.push_back(
        {std::max(st.forwardFlops, 1.0) / rate, std::max(st.backwardFlops, 1.0) / rate});
  pipeline::Timeline timeline;
  std::string error;
  if (!pipeline::simulate(schedule, costs, 0, timeline, error))
    die(args.model + ": " + error);
  cm.plannedBubble = timeline.bubble;
  std::string title = cm.modelName + " " + cm.plan->json;
  if (!args.timelineJson.empty())
    writeFileOrDie(args.timelineJson, pipeline::chromeTraceJson(schedule, timeline, title));
  if (!args.timelineSvg.empty())
    writeFileOrDie(args.timelineSvg, pipeline::timelineSvg(schedule, timeline, title));
}

} // namespace

std::vector<CompiledRankMemory> compiledMemory(CompileArgs &args, GpuStep *gpu, bool *gpuOk,
                                               std::string *gpuError) {
  args.memoryOnly = true;
  args.quiet = true;
  args.noWeights = true;
  Setup s = resolve(args);
  Progress progress(true);
  mlir::MLIRContext context;
  context.loadDialect<dist::DistDialect>();
  pipeline::Schedule schedule;
  Imported im = importModel(context, args, s, schedule, progress);
  runPipeline(im, s, args, progress);
  if (gpu)
    *gpuOk = modelGpuStep(*im.module, *gpu, *gpuError);
  CompiledModel cm = generate(*im.module, args, s, im);
  std::vector<CompiledRankMemory> ranks;
  for (const GeneratedProgram &g : cm.programs)
    ranks.push_back({g.paramBytes, g.gradBytes, g.stateBytes, g.activationBytes, g.arenaBytes});
  return ranks;
}

namespace {

/// `model`, a builtin spec, with `layers` layers (its other keys as written).
std::string withLayers(const std::string &model, int64_t layers) {
  // "builtin:FAMILY:" then comma-separated keys.
  size_t keys = model.find(':', model.find(':') + 1);
  std::string out = model.substr(0, keys + 1);
  StringRef rest = StringRef(model).drop_front(keys + 1);
  bool first = true;
  while (!rest.empty()) {
    auto [kv, tail] = rest.split(',');
    rest = tail;
    out += first ? "" : ",";
    first = false;
    out += kv.starts_with("layers=") ? "layers=" + std::to_string(layers) : kv.str();
  }
  return out;
}

} // namespace

std::vector<CompiledRankMemory> compiledMemoryByLayers(const CompileArgs &args,
                                                       std::vector<int64_t> &layers) {
  layers.clear();
  CompileArgs whole = args;
  BuiltinSpec spec;
  Plan plan;
  std::string error;
  if (!isBuiltinModel(args.model) || !parseBuiltinSpec(args.model, spec, error) ||
      args.planText.empty() || !parsePlan(args.planText, args.planPath, plan, error) ||
      plan.pp * plan.virtualStages != 1 || plan.ep != 1 ||
      spec.get("layers") <= kLayerFloor + kLayerPoints || !args.rulesPath.empty())
    return compiledMemory(whole);
  // Layers stay alike only if nothing singles some of them out: a pinned
  // op, a recomputed layer or a frozen parameter named by its number.
  bool alike = plan.recomputeLayers.empty();
  for (const auto &[glob, dim] : plan.ops)
    alike &= !globNamesSomeLayers(glob);
  for (const std::string &glob : args.import.frozen)
    alike &= !globNamesSomeLayers(glob);
  if (!alike)
    return compiledMemory(whole);
  const int64_t full = spec.get("layers");
  std::vector<std::vector<CompiledRankMemory>> at;
  for (int64_t j = 0; j < kLayerPoints; ++j) {
    CompileArgs fewer = args;
    fewer.model = withLayers(args.model, kLayerFloor + j);
    at.push_back(compiledMemory(fewer));
    if (at.back().size() != at.front().size())
      return compiledMemory(whole);
  }
  // Each region of each rank: affine over the points, then extrapolated.
  using Field = int64_t CompiledRankMemory::*;
  const Field fields[] = {&CompiledRankMemory::params, &CompiledRankMemory::grads,
                          &CompiledRankMemory::optimizer, &CompiledRankMemory::activations,
                          &CompiledRankMemory::arena};
  std::vector<CompiledRankMemory> out(at.front().size());
  for (size_t r = 0; r < out.size(); ++r)
    for (Field f : fields) {
      const int64_t step = at[1][r].*f - at[0][r].*f;
      for (int64_t j = 2; j < kLayerPoints; ++j)
        if (at[j][r].*f - at[j - 1][r].*f != step)
          return compiledMemory(whole);
      out[r].*f = at[0][r].*f + (full - kLayerFloor) * step;
    }
  for (int64_t j = 0; j < kLayerPoints; ++j)
    layers.push_back(kLayerFloor + j);
  return out;
}

/// Parameters no gradient reaches are not trained (as PyTorch's optimizers
/// skip a parameter whose .grad stays None); say which, since a plain export
/// makes a float buffer (a causal mask) a parameter.
void noteUntrained(mlir::ModuleOp module) {
  std::string names;
  int n = 0;
  module.walk([&](mlir::func::FuncOp fn) {
    auto unused = fn->getAttrOfType<mlir::ArrayAttr>(kUnusedParamsAttr);
    if (!unused || n)
      return;
    for (mlir::Attribute a : unused)
      if (auto name = dyn_cast<mlir::StringAttr>(a)) {
        names += std::string(n ? ", " : "") + name.getValue().str();
        ++n;
      }
  });
  if (n)
    llvm::errs() << "carve: note: " << n << " parameter" << (n > 1 ? "s get" : " gets")
                 << " no gradient, so " << (n > 1 ? "they are" : "it is")
                 << " not trained (a buffer, such as a mask, exported as a parameter): " << names
                 << "\n";
}

/// On the CUDA target: which attention calls run as cuDNN's fused flash
/// attention and which as carve's kernel, and why (carve-select-kernels'
/// carve.kernel_why), once per reason.
void noteAttention(mlir::ModuleOp module) {
  int64_t cudnn = 0;
  std::map<std::string, int64_t> own;
  module.walk([&](mlir::Operation *op) {
    auto k = op->getAttrOfType<mlir::StringAttr>(kKernelAttr);
    if (!k || !k.getValue().starts_with("attention"))
      return;
    if (k.getValue().ends_with("_cudnn"))
      ++cudnn;
    else if (auto why = op->getAttrOfType<mlir::StringAttr>(kKernelWhyAttr))
      ++own[why.getValue().str()];
  });
  if (cudnn)
    llvm::errs() << "carve: note: " << cudnn << " attention call" << (cudnn > 1 ? "s" : "")
                 << " (forward and backward) run as cuDNN's fused flash attention (carve's "
                    "kernel where cuDNN refuses a shape on the GPU; it says so when it runs)\n";
  for (const auto &[why, n] : own)
    llvm::errs() << "carve: note: " << n << " attention call" << (n > 1 ? "s" : "")
                 << " run as carve's own kernel: " << why << "\n";
}

/// On the CUDA target: how many convolution calls run as cuDNN's (forward,
/// data and filter gradients) and, where the model has convolutions that
/// were lowered to im2col GEMMs instead, why.
void noteConvolutions(mlir::ModuleOp module, const PlanAttrs &plan, bool lowered) {
  int64_t cudnn = 0;
  module.walk([&](mlir::Operation *op) {
    auto k = op->getAttrOfType<mlir::StringAttr>(kKernelAttr);
    if (k && k.getValue().starts_with("conv2d"))
      ++cudnn;
  });
  if (cudnn)
    llvm::errs() << "carve: note: " << cudnn << " convolution call" << (cudnn > 1 ? "s" : "")
                 << " (forward and gradients) run as cuDNN's convolutions (carve's direct kernel "
                    "where cuDNN refuses a shape on the GPU; it says so when it runs)\n";
  else if (lowered)
    llvm::errs() << "carve: note: the convolutions run as im2col GEMMs, not cuDNN's: "
                 << (plan.convolution == "carve" ? std::string("--convolution carve")
                                                 : "tp=" + std::to_string(plan.tp) +
                                                       " splits their channels through the GEMMs")
                 << "\n";
}

/// On the CUDA target under bf16/fp16: which GELUs and GELU gradients their
/// GEMMs compute in cuBLASLt's epilogue (carve-fold-views' "epilogue"), what
/// that does to the numbers, and why the others run as carve's kernels.
void noteGelu(mlir::ModuleOp module) {
  int64_t forward = 0, backward = 0, erf = 0, tanhOwn = 0;
  module.walk([&](mlir::Operation *op) {
    auto k = op->getAttrOfType<mlir::StringAttr>(kKernelAttr);
    if (k && k.getValue() == "matmul16_bias_gelu")
      ++forward;
    if (k && k.getValue() == "matmul16_dgelu")
      ++backward;
    if (auto g = mlir::dyn_cast<GeluOp>(op); g && k) { // in a program the emitter prints
      if (g.getApproximate() != "tanh")
        ++erf;
      else if (foldOf(op) != kFoldEpilogue)
        ++tanhOwn;
    }
  });
  if (forward)
    llvm::errs() << "carve: note: " << forward << " GELU" << (forward > 1 ? "s" : "")
                 << " (the tanh form) applied by their GEMM's cuBLASLt epilogue (GELU_AUX_BIAS): "
                    "GELU of the fp32 sum, one 16-bit rounding fewer than the CPU target\n";
  if (backward)
    llvm::errs() << "carve: note: " << backward << " GELU gradient" << (backward > 1 ? "s" : "")
                 << " computed by their incoming gradient's GEMM (cuBLASLt's DGELU epilogue; the "
                    "same values as the kernel)\n";
  if (erf)
    llvm::errs() << "carve: note: " << erf << " GELU" << (erf > 1 ? "s" : "")
                 << " of the erf form run as carve's kernels (cuBLASLt's GELU epilogues compute "
                    "the tanh form, F.gelu(x, approximate=\"tanh\"))\n";
  if (tanhOwn)
    llvm::errs() << "carve: note: " << tanhOwn << " tanh GELU" << (tanhOwn > 1 ? "s" : "")
                 << " run as carve's kernels (not alone after a GEMM's bias add, rows not a "
                    "multiple of 8, or read in f32)\n";
}

/// --gpu-model: the step's launches and predicted GPU time (docs/gpu-model.md);
/// dies naming the cause when the program is not one the model prices.
std::string gpuModelReport(mlir::ModuleOp module, const CompileArgs &args, Progress &progress) {
  GpuStep step;
  std::string error;
  if (!modelGpuStep(module, step, error))
    die("--gpu-model: " + error);
  std::string line;
  for (const GpuSpec &g : gpuSpecs()) {
    GpuPrediction p = predictGpuStep(step, g);
    line += (line.empty() ? "" : ", ") + std::string(g.name) + " " +
            llvm::formatv("{0:f1}", p.totalMs()).str() + " ms";
    if (&g == &gpuSpecs().back())
      line += " (" + std::to_string(p.totalLaunches()) + " launches)";
  }
  if (!step.unpriced.empty())
    line += "; " + std::to_string(step.unpriced.size()) + " calls not priced";
  progress.done("predicted GPU step: " + line + " -> " + args.gpuModel);
  return gpuStepJson(step);
}

int runCompile(CompileArgs &args) {
  if (!args.gpuModel.empty() && args.target != "cuda")
    die("--gpu-model prices CUDA programs: compile with --target cuda");
  Setup s = resolve(args);
  Progress progress(args.quiet);
  mlir::MLIRContext context;
  context.loadDialect<dist::DistDialect>();
  pipeline::Schedule schedule;
  Imported im = importModel(context, args, s, schedule, progress);
  // Expert parallelism: the ep ranks hold different experts, so each gets a
  // program of its own, compiled from a copy of the imported module.
  std::vector<mlir::OwningOpRef<mlir::ModuleOp>> epModules;
  std::vector<CompiledModel> epPrograms;
  for (int r = 1; r < s.plan.ep; ++r) {
    Imported copy;
    copy.module = im.module->clone();
    copy.batch = im.batch, copy.micro = im.micro, copy.m = im.m;
    runPipeline(copy, s, args, progress, r);
    epModules.push_back(std::move(copy.module));
  }
  bool hasConvolutions = false;
  im.module->walk([&](mlir::Operation *op) { hasConvolutions |= mlir::isa<Conv2dOp>(op); });
  PartitionSummary partition = runPipeline(im, s, args, progress);
  noteUntrained(*im.module);
  if (args.target == "cuda" && !args.quiet) {
    noteAttention(*im.module);
    noteConvolutions(*im.module, readPlan(*im.module).value_or(PlanAttrs()), hasConvolutions);
  }
  if (args.target == "cuda" && s.plan.precision != "fp32" && !args.quiet)
    noteGelu(*im.module);
  if (args.target != "cuda" && s.plan.tf32 && !args.quiet)
    llvm::errs() << "carve: note: \"tf32\": the CPU target has no TF32; its matmuls compute "
                    "in fp32 as without it (the field takes effect with --target cuda)\n";
  std::string gpuReport;
  if (!args.gpuModel.empty()) {
    progress.start("GPU model");
    gpuReport = gpuModelReport(*im.module, args, progress);
  }

  progress.start("codegen");
  if (!args.emitMlir.empty() && args.emitMlirAfter.empty()) {
    std::string text;
    raw_string_ostream os(text);
    im.module->print(os);
    writeFileOrDie(args.emitMlir, text);
  }
  CompiledModel cm = generate(*im.module, args, s, im);
  for (size_t r = 0; r < epModules.size(); ++r) {
    CompiledModel other = generate(*epModules[r], args, s, im);
    for (size_t k = 0; k < other.programs.size(); ++k) {
      cm.programs.push_back(std::move(other.programs[k]));
      cm.programNames.push_back(other.programNames[k]);
    }
  }
  if (cm.pipelined)
    planTimeline(cm, args, schedule);

  TempDir tmp(s.out);
  const std::string &dir = tmp.path;
  for (const char *sub : {"/src", "/bin"})
    if (std::error_code ec = sys::fs::create_directories(dir + sub))
      fail(dir + sub + ": " + ec.message());
  writeSources(dir, cm);
  writePlanJson(dir, cm);
  if (!args.noWeights)
    writeInitialValues(dir + "/init.safetensors", im.initial, im.isInt, cm.modelName);
  int64_t kernelCalls = 0;
  for (const GeneratedProgram &g : cm.programs)
    kernelCalls += g.numKernelCalls;
  progress.done(std::to_string(cm.programs.size()) + " program" +
                (cm.programs.size() > 1 ? "s" : "") + ", " + std::to_string(kernelCalls) +
                " kernel calls");

  BuildInputs build;
  build.dir = dir;
  build.out = s.out;
  build.cuda = cm.cuda();
  build.archs = s.archs;
  build.programs = cm.programNames;
  build.kernelSources = cm.cuda() ? s.rules.cudaSources : s.rules.sources;
  build.rulesPath = args.rulesPath;
  build.programNote = [&](size_t r) { return ranksOf(cm, r); };
  if (!args.noBuild)
    buildExecutable(build, progress);
  tmp.moveInto(s.out);
  if (!gpuReport.empty())
    writeFileOrDie(args.gpuModel, gpuReport);
  if (!args.quiet)
    printSummary(cm, s.out, partition, !args.noBuild);
  return 0;
}

} // namespace carve
