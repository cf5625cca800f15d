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

#include "compiler/driver/CompilePipeline.h"
#include "compiler/frontend/Builtin.h"
#include "compiler/plan/Plan.h"
#include "compiler/rules/Rules.h"
#include "compiler/schedule/Schedule.h"
#include "compiler/schedule/Timeline.h"
#include "compiler/stages/StageSplit.h"
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
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>

using namespace llvm;

namespace carve {

namespace {

/// The command line resolved against the plan, before any work.
struct Setup {
  Plan plan;
  std::string where; // the plan's name in errors
  OptimizerConfig opt;
  std::vector<std::string> archs; // --target cuda
  std::string out;
  RuleSet rules;
};

void applyCommandLineOptimizer(const CompileArgs &args, OptimizerConfig &opt) {
  const OptimizerConfig &c = args.optimizer;
  for (const std::string &k : args.setOnCommandLine) {
    if (k == "optimizer")
      opt.kind = c.kind;
    else if (k == "lr")
      opt.lr = c.lr;
    else if (k == "momentum")
      opt.momentum = c.momentum;
    else if (k == "dampening")
      opt.dampening = c.dampening;
    else if (k == "nesterov")
      opt.nesterov = c.nesterov;
    else if (k == "weight-decay")
      opt.weightDecay = c.weightDecay;
    else if (k == "beta1")
      opt.beta1 = c.beta1;
    else if (k == "beta2")
      opt.beta2 = c.beta2;
    else if (k == "eps")
      opt.eps = c.eps;
    else if (k == "clip-grad-norm")
      opt.clipGradNorm = c.clipGradNorm;
    else if (k == "warmup-steps")
      opt.warmupSteps = c.warmupSteps;
    else if (k == "decay-steps")
      opt.decaySteps = c.decaySteps;
    else if (k == "min-lr-ratio")
      opt.minLrRatio = c.minLrRatio;
  }
}

/// The output directory must be ours to replace.
std::string checkOutput(std::string out) {
  if (out.empty())
    die("no output directory; give -o OUT");
  while (out.size() > 1 && out.back() == '/')
    out.pop_back();
  if (sys::fs::exists(out)) {
    if (!sys::fs::is_directory(out))
      die(out + ": exists and is not a directory; refusing to overwrite it");
    std::error_code ec;
    bool empty = sys::fs::directory_iterator(out, ec) == sys::fs::directory_iterator();
    if (!empty && !sys::fs::exists(out + "/plan.json"))
      die(out + ": exists and is not a carve output directory (no plan.json); refusing to "
                "overwrite it");
  }
  return out;
}

Setup resolve(CompileArgs &args) {
  Setup s;
  std::string error;
  if (!args.planText.empty()) { // --auto: the planner's choice
    if (!parsePlan(args.planText, args.planPath, s.plan, error))
      die(error);
  } else if (!args.planPath.empty()) {
    std::string text = readFileOrDie(args.planPath, "a plan (JSON)");
    if (!parsePlan(text, args.planPath, s.plan, error))
      die(error);
  } else {
    parsePlan("{\"dp\": 1}", "default plan", s.plan, error);
  }
  s.where = args.planPath.empty() ? std::string("plan") : args.planPath;
  if (args.target != "cpu" && args.target != "cuda")
    die("--target " + args.target + ": unknown target (cpu or cuda)");
  if (args.target == "cuda")
    s.archs = cudaArchitectures(args.cudaArchs);
  else if (!args.cudaArchs.empty())
    die("--cuda-arch applies to --target cuda only");
  // The optimizer: defaults, then the plan, then the command line.
  if (!applyPlanOptimizer(s.plan, s.opt, error))
    die(s.where + ": " + error);
  applyCommandLineOptimizer(args, s.opt);
  if (!validateOptimizer(s.opt, error))
    die(error);
  s.out = checkOutput(args.output);
  // The rules file: custom ops for the importer, overrides for the partitioner.
  if (!args.rulesPath.empty()) {
    if (!loadRules(args.rulesPath, s.rules, error))
      die(error);
    args.import.customOps = s.rules.customOps;
  }
  if (s.plan.tp == 1 && s.plan.zero == 0 && !s.plan.ops.empty())
    die(s.where + ": \"ops\" overrides choose splits over tp; the plan has no \"tp\" > 1");
  return s;
}

/// The imported model: one rank's (or micro-batch's) program and the
/// model's initial values.
struct Imported {
  mlir::OwningOpRef<mlir::ModuleOp> module;
  std::vector<ImportOptions::InitialValue> initial;
  std::map<std::string, bool> isInt; // parameters and buffers of integer type
  int64_t batch = -1, micro = -1;
  std::string batchInput;
  int m = 1; // micro-batches per step of each replica
};

/// The global batch from the graph inputs; which parameters are integers.
void readInputs(mlir::ModuleOp global, const std::string &model, const Setup &s, Imported &im) {
  auto fwd = global.lookupSymbol<mlir::func::FuncOp>("forward");
  for (mlir::BlockArgument a : fwd.getArguments()) {
    auto t = cast<mlir::RankedTensorType>(a.getType());
    unsigned i = a.getArgNumber();
    if (mlir::StringAttr in = inputNameOf(fwd, i)) {
      if (t.getRank() == 0)
        die(model + ": input '" + in.getValue().str() +
            "' is a scalar; every graph input needs a leading batch dimension");
      if (im.batch < 0)
        im.batch = t.getDimSize(0), im.batchInput = in.getValue().str();
      else if (t.getDimSize(0) != im.batch)
        die(model + ": inputs '" + im.batchInput + "' and '" + in.getValue().str() +
            "' disagree on the batch dimension (" + std::to_string(im.batch) + " vs " +
            std::to_string(t.getDimSize(0)) + ")");
    }
    for (const char *k : {kParamAttr, kBufferAttr})
      if (auto p = fwd.getArgAttrOfType<mlir::StringAttr>(i, k))
        im.isInt[p.getValue().str()] = isa<mlir::IntegerType>(t.getElementType());
  }
  if (im.batch < 0)
    die(model + ": the model has no graph inputs to split into batches");
  if (im.batch % s.plan.dp != 0)
    die(s.where + ": dp=" + std::to_string(s.plan.dp) + " does not divide the global batch of " +
        std::to_string(im.batch) + " (input '" + im.batchInput + "'); choose dp dividing " +
        std::to_string(im.batch) + " or export (or --set-dim) another batch");
}

/// Micro-batches: each replica's share of the batch runs as m of them.
int countMicroBatches(const Setup &s, int64_t batch) {
  const Plan &plan = s.plan;
  const int64_t share = batch / plan.dp;
  auto ofShare = [&]() {
    return " samples (global batch " + std::to_string(batch) + " / dp " + std::to_string(plan.dp) +
           ")";
  };
  int m = 1;
  if (plan.microBatchSize > 0) {
    if (share % plan.microBatchSize != 0)
      die(s.where + ": micro_batch_size=" + std::to_string(plan.microBatchSize) +
          " does not divide each data-parallel replica's " + std::to_string(share) + ofShare());
    m = (int)(share / plan.microBatchSize);
    if (plan.numMicroBatches > 0 && plan.numMicroBatches != m)
      die(s.where + ": num_micro_batches=" + std::to_string(plan.numMicroBatches) +
          " and micro_batch_size=" + std::to_string(plan.microBatchSize) + " disagree (" +
          std::to_string(share) + " samples per replica make " + std::to_string(m) +
          " micro-batches of that size); give one of them");
  } else if (plan.numMicroBatches > 0) {
    m = plan.numMicroBatches;
  }
  if (share % m != 0)
    die(s.where + ": num_micro_batches=" + std::to_string(m) +
        " does not divide each data-parallel replica's " + std::to_string(share) + ofShare());
  return m;
}

Imported importModel(mlir::MLIRContext &context, const CompileArgs &args, const Setup &s,
                     pipeline::Schedule &schedule, Progress &progress) {
  progress.start("import");
  Imported im;
  std::string error;
  ImportOptions globalOpts = args.import;
  globalOpts.initialValues = &im.initial;
  auto global = loadModel(context, args.model, globalOpts, error);
  if (!global)
    die(args.model + ": " + error);
  readInputs(*global, args.model, s, im);
  im.m = countMicroBatches(s, im.batch);
  const Plan &plan = s.plan;
  if (plan.pp > 1 || im.m > 1) {
    pipeline::ScheduleKind kind;
    if (!pipeline::parseScheduleKind(plan.scheduleName(), kind, error) ||
        !pipeline::buildSchedule(kind, plan.pp, im.m, plan.virtualStages, schedule, error))
      die(s.where + ": " + error);
  } else if (!args.timelineJson.empty() || !args.timelineSvg.empty()) {
    die(std::string(args.timelineJson.empty() ? "--timeline-svg" : "--timeline") +
        ": the plan has no pipeline schedule (pp=1 and one micro-batch); set \"pp\" or "
        "\"num_micro_batches\"");
  }
  // One rank's program: the same model with batch / (dp * m).
  im.micro = im.batch / plan.dp / im.m;
  const std::string per = im.m > 1 ? "micro-batch" : "rank";
  if (im.micro == im.batch) {
    im.module = std::move(global);
  } else {
    ImportOptions localOpts = args.import;
    localOpts.batch = im.micro;
    localOpts.globalBatch = im.batch;
    im.module = loadModel(context, args.model, localOpts, error);
    if (!im.module)
      die(args.model + ": importing one " + (im.m > 1 ? "micro-batch" : "rank's share") +
          " of the batch (" + std::to_string(im.micro) + " of " + std::to_string(im.batch) +
          ") failed: " + error +
          " (the model may hard-code its batch size in a reshape; export it with a "
          "dynamic batch)");
  }
  progress.done(
      std::to_string(im.initial.size()) + " parameters, global batch " + std::to_string(im.batch) +
      (im.micro == im.batch ? std::string() : ", " + std::to_string(im.micro) + " per " + per));
  return im;
}

/// The plan as the passes read it (dialects/carve/Contract.h).
PlanAttrs planAttrs(const Plan &plan, const Imported &im) {
  PlanAttrs p;
  p.dp = plan.dp;
  p.tp = plan.tp;
  p.pp = plan.pp;
  p.zero = plan.zero;
  p.sequenceParallel = plan.sequenceParallel;
  p.microBatches = im.m;
  p.virtualStages = plan.virtualStages;
  p.schedule = plan.scheduleName();
  p.precision = plan.precision;
  p.globalBatch = im.batch;
  p.cuts = plan.cuts;
  p.ops = plan.ops;
  return p;
}

/// What the partitioner did (its dist.partition_summary on the module).
struct PartitionSummary {
  int64_t opsSplit = 0, allReduce = 0, allGather = 0, reduceScatter = 0, allToAll = 0;
};

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
    } else if (arg == "carve-split-stages") {
      progress.done(std::to_string(stageFunctions(module).size()) + " stages, " +
                    s.plan.scheduleName() + " schedule");
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
                             Progress &progress) {
  mlir::ModuleOp module = *im.module;
  mlir::MLIRContext *context = module.getContext();
  PlanAttrs plan = planAttrs(s.plan, im);
  writePlan(module, plan);
  progress.start("training step");
  mlir::PassManager pm(context);
  buildCompilePipeline(pm, plan, s.rules, args.loss);
  auto instrumentation = std::make_unique<PassProgress>(progress, s, im);
  PassProgress *counts = instrumentation.get();
  pm.addInstrumentation(std::move(instrumentation));
  std::vector<std::string> passes = compilePipelinePasses(plan);
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
                       const Imported &im, const pipeline::Schedule &schedule) {
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
  cg.dp = plan.dp;
  cg.tp = plan.tp;
  cg.zero = plan.zero;
  cg.globalBatch = im.batch;
  cg.optimizer = s.opt;
  cg.planJson = plan.json;
  cg.pp = plan.pp;
  cg.numMicroBatches = im.m;
  cg.target = args.target;
  cg.precision = plan.precision;
  cg.fuse = args.fuse;
  std::string error;
  if (!cm.pipelined) {
    cm.programs.resize(1);
    if (!generateCpuProgram(module, cg, cm.programs[0], error))
      die(args.model + ": " + error);
    cm.programNames.push_back("program0");
    return cm;
  }
  for (mlir::func::FuncOp stage : stageFunctions(module))
    cm.stages.push_back(readStageSummary(stage).value_or(StageSummary()));
  cm.shared = sharedGradients(module);
  cm.programs.resize(plan.pp);
  for (int r = 0; r < plan.pp; ++r) {
    PipelineCodegenOptions pc;
    pc.pp = plan.pp;
    pc.virtualStages = plan.virtualStages;
    pc.schedule = plan.scheduleName();
    pc.rank = r;
    for (const pipeline::Instr &in : schedule.ranks[r])
      pc.steps.push_back({in.kind == pipeline::Instr::Forward, in.microBatch, in.chunk, in.slot});
    pc.slots = schedule.slots[r];
    for (const SharedGradient &g : cm.shared)
      pc.shared.push_back({g.name, g.numel, g.owner});
    cg.programName = "program" + std::to_string(r);
    if (!generatePipelineProgram(module, cg, pc, cm.programs[r], error))
      die(args.model + ": " + error);
    cm.programNames.push_back(cg.programName);
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

/// The closing lines: what was built, and the pipeline and tensor-parallel
/// summaries.
void printSummary(const CompiledModel &cm, const std::string &out, const PartitionSummary &counts) {
  const Plan &plan = *cm.plan;
  int64_t kernelCalls = 0, maxArena = 0;
  for (const GeneratedProgram &g : cm.programs)
    kernelCalls += g.numKernelCalls, maxArena = std::max(maxArena, g.arenaBytes);
  outs() << "carve: compiled " << cm.modelName << " for " << plan.worldSize() << " rank"
         << (plan.worldSize() > 1 ? "s" : "") << " (" << plan.json << "): " << out << "/bin/train\n"
         << "       " << kernelCalls << " kernel calls per "
         << (cm.pipelined ? "micro-batch" : "step") << ", " << cm.programs[0].numBuckets
         << " gradient bucket(s), arena " << format("%.1f", maxArena / 1048576.0) << " MiB per rank"
         << (cm.pipelined ? " (largest)" : "") << "; sources in " << out << "/src\n";
  if (cm.pipelined) {
    outs() << "       pipeline: " << cm.stages.size() << " stage(s) on pp=" << plan.pp << ", "
           << plan.scheduleName() << " schedule, " << cm.microBatches << " micro-batch"
           << (cm.microBatches > 1 ? "es" : "") << " of " << cm.microBatch << "; planned bubble "
           << format("%.1f", cm.plannedBubble * 100) << "% of compute\n";
    for (size_t s = 0; s < cm.stages.size(); ++s) {
      const StageSummary &st = cm.stages[s];
      outs() << "         stage " << s << " (rank " << s % plan.pp << "): ";
      if (st.layers > 0)
        outs() << st.layers << " layer" << (st.layers > 1 ? "s" : "") << ", ";
      outs() << format("%.3g", st.flops) << " FLOP per micro-batch, parameters "
             << format("%.2f", st.paramBytes / 1048576.0) << " MiB, sends "
             << format("%.2f", st.sendBytes / 1048576.0) << " MiB ['" << st.first << "' .. '"
             << st.last << "']\n";
    }
    if (!cm.shared.empty()) {
      outs() << "         gradients summed over stages:";
      for (const auto &x : cm.shared)
        outs() << " " << x.name;
      outs() << "\n";
    }
  }
  if (plan.tp > 1)
    outs() << "       tp=" << plan.tp << (plan.sequenceParallel ? " with sequence parallelism" : "")
           << ": " << counts.opsSplit << " ops split; per step " << counts.allReduce
           << " all-reduce, " << counts.allGather << " all-gather, " << counts.reduceScatter
           << " reduce-scatter, " << counts.allToAll << " all-to-all over tp\n";
}

/// The progress note of program r's build: the ranks that run it.
std::string ranksOf(const CompiledModel &cm, size_t r) {
  const Plan &plan = *cm.plan;
  int group = plan.dp * plan.tp;
  if (!cm.pipelined)
    return plan.worldSize() > 1 ? "every rank" : "rank 0";
  if (group > 1)
    return "ranks " + std::to_string(r * group) + "-" + std::to_string((r + 1) * group - 1) +
           " (pipeline rank " + std::to_string(r) + ")";
  return "rank " + std::to_string(r) + " (pipeline rank)";
}

} // namespace

int runCompile(CompileArgs &args) {
  Setup s = resolve(args);
  Progress progress(args.quiet);
  mlir::MLIRContext context;
  context.loadDialect<dist::DistDialect>();
  pipeline::Schedule schedule;
  Imported im = importModel(context, args, s, schedule, progress);
  PartitionSummary partition = runPipeline(im, s, args, progress);

  progress.start("codegen");
  if (!args.emitMlir.empty() && args.emitMlirAfter.empty()) {
    std::string text;
    raw_string_ostream os(text);
    im.module->print(os);
    writeFileOrDie(args.emitMlir, text);
  }
  CompiledModel cm = generate(*im.module, args, s, im, schedule);
  if (cm.pipelined)
    planTimeline(cm, args, schedule);

  TempDir tmp(s.out);
  const std::string &dir = tmp.path;
  for (const char *sub : {"/src", "/bin"})
    if (std::error_code ec = sys::fs::create_directories(dir + sub))
      fail(dir + sub + ": " + ec.message());
  writeSources(dir, cm);
  writePlanJson(dir, cm);
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
  buildExecutable(build, progress);
  tmp.moveInto(s.out);
  if (!args.quiet)
    printSummary(cm, s.out, partition);
  return 0;
}

} // namespace carve
