//===- Compile.cpp - `carve compile` and `carve run` -----------------------===//
//
// compile: plan -> import (global batch, then one rank's share) -> autodiff ->
// codegen -> OUT/src, OUT/init.safetensors, OUT/plan.json -> the system C++
// compiler links OUT/bin/train against the runtime. Everything is written in a
// temporary directory next to OUT and renamed into place at the end, so a
// failure leaves a previous OUT untouched.
//
//===----------------------------------------------------------------------===//

#include "tools/carve/Compile.h"

#include "carve/rt/safetensors.h"
#include "compiler/autodiff/Autodiff.h"
#include "compiler/frontend/Builtin.h"
#include "compiler/partition/Partitioner.h"
#include "compiler/partition/Pipeline.h"
#include "compiler/pipeline/Schedule.h"
#include "compiler/pipeline/Timeline.h"
#include "compiler/plan/Plan.h"
#include "compiler/rules/Rules.h"
#include "dialects/dist/DistDialect.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/raw_ostream.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <csignal>
#include <fstream>
#include <sstream>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#ifndef CARVE_RUNTIME_CONFIG
#error "CARVE_RUNTIME_CONFIG must name build/lib/carve-runtime.txt"
#endif

using namespace llvm;

namespace carve {

namespace {
/// A progress line is open on stdout (its stage has started, not finished).
bool progressLineOpen = false;
} // namespace

[[noreturn]] void die(const std::string &msg) {
  if (progressLineOpen) {
    outs() << "\n";
    outs().flush();
    progressLineOpen = false;
  }
  errs() << "carve: error: " << msg << "\n";
  errs().flush();
  std::exit(1);
}

namespace {

std::string readFileOrDie(const std::string &path, const std::string &what) {
  if (sys::fs::is_directory(path))
    die(path + ": is a directory, expected " + what);
  auto buf = MemoryBuffer::getFile(path);
  if (!buf)
    die(path + ": cannot read " + what + ": " + buf.getError().message());
  return (*buf)->getBuffer().str();
}

void writeFileOrDie(const std::string &path, const std::string &text) {
  std::error_code ec;
  raw_fd_ostream os(path, ec);
  if (ec)
    die(path + ": cannot write: " + ec.message());
  os << text;
  os.close();
  if (os.has_error())
    die(path + ": cannot write: " + os.error().message());
}

/// One line per compile stage on stdout: its name when it starts, its time
/// (and a note) when it ends, so a slow stage shows which one it is.
class Progress {
public:
  explicit Progress(bool quiet) : quiet(quiet) {}
  void start(const std::string &stage) {
    t0 = std::chrono::steady_clock::now();
    if (quiet)
      return;
    outs() << "carve: " << left_justify(stage, 26);
    outs().flush();
    progressLineOpen = true;
  }
  void done(const std::string &note = "") {
    if (quiet)
      return;
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    outs() << format("%6.2f s", s) << (note.empty() ? "" : "  " + note) << "\n";
    outs().flush();
    progressLineOpen = false;
  }

private:
  bool quiet;
  std::chrono::steady_clock::time_point t0;
};

/// Removes a temporary output directory on every exit path.
struct TempDir {
  std::string path;
  bool keep = false;
  ~TempDir() {
    if (!keep && !path.empty() && !getenv("CARVE_KEEP_TEMP"))
      sys::fs::remove_directories(path);
  }
};
TempDir *activeTemp = nullptr;

[[noreturn]] void fail(const std::string &msg) {
  if (activeTemp && !activeTemp->path.empty() && !getenv("CARVE_KEEP_TEMP"))
    sys::fs::remove_directories(activeTemp->path);
  die(msg);
}

/// The runtime's build settings (written by runtime/CMakeLists.txt).
std::map<std::string, std::string> runtimeConfig() {
  std::string path = CARVE_RUNTIME_CONFIG;
  if (const char *env = getenv("CARVE_RUNTIME_CONFIG"))
    path = env;
  auto buf = MemoryBuffer::getFile(path);
  if (!buf)
    fail(path + ": cannot read the runtime's build settings (" + buf.getError().message() +
         "); build the runtime (ninja carve_rt) or set CARVE_RUNTIME_CONFIG");
  std::map<std::string, std::string> cfg;
  std::istringstream in((*buf)->getBuffer().str());
  std::string line;
  while (std::getline(in, line)) {
    size_t eq = line.find('=');
    if (eq != std::string::npos)
      cfg[line.substr(0, eq)] = line.substr(eq + 1);
  }
  for (const char *k : {"cxx", "cxxflags", "include", "libs"})
    if (!cfg.count(k))
      fail(path + ": missing '" + k + "'");
  return cfg;
}

std::vector<std::string> splitWords(const std::string &s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  std::string w;
  while (in >> w)
    out.push_back(w);
  return out;
}

/// Writes the parameters' initial values as safetensors (F32, or I64 for
/// integer buffers), in argument order, with the runtime's writer.
void writeInitialValues(const std::string &path,
                        const std::vector<ImportOptions::InitialValue> &values,
                        const std::map<std::string, bool> &isInt, const std::string &model) {
  std::vector<std::vector<int64_t>> ints; // integer buffers, converted
  std::vector<carve::rt::SafetensorsEntry> entries;
  for (const auto &v : values) {
    carve::rt::SafetensorsEntry e;
    e.name = v.name;
    e.shape = v.shape;
    if (isInt.count(v.name) && isInt.at(v.name)) {
      ints.emplace_back(v.data.begin(), v.data.end());
      e.dtype = "I64";
      e.data = ints.back().data();
    } else {
      e.dtype = "F32";
      e.data = v.data.data();
    }
    entries.push_back(e);
  }
  std::string error;
  if (!carve::rt::writeSafetensors(path, entries, {{"format", "carve-init"}, {"model", model}},
                                   error))
    fail(error);
}

/// Runs the C++ compiler with `argv`; on failure keeps its log beside OUT
/// and fails naming `what` and the first error.
void runCompiler(const std::string &cxxName, const std::vector<std::string> &argv,
                 const std::string &log, const std::string &out, const std::string &what,
                 const std::string &linkHint) {
  std::vector<StringRef> refs(argv.begin(), argv.end());
  std::optional<StringRef> redirects[] = {std::nullopt, StringRef(log), StringRef(log)};
  std::string execError;
  auto cxx = sys::findProgramByName(cxxName);
  if (!cxx)
    fail("the C++ compiler '" + cxxName + "' was not found");
  int rc = sys::ExecuteAndWait(*cxx, refs, std::nullopt, redirects, 0, 0, &execError);
  if (rc == 0)
    return;
  std::string text;
  if (auto buf = MemoryBuffer::getFile(log))
    text = (*buf)->getBuffer().str();
  // The compiler's "error:" line, or the linker's line naming a missing
  // symbol ("collect2: error" does not).
  std::string first, undefined;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (undefined.empty() && line.find("undefined reference") != std::string::npos)
      undefined = line;
    if (first.empty() && line.find("error:") != std::string::npos)
      first = line;
  }
  // Keep the log where the user can read it.
  std::string kept = out + ".build.log";
  sys::fs::copy_file(log, kept);
  fail(std::string(StringRef(cxxName).contains("nvcc") ? "the CUDA compiler (nvcc)"
                                                       : "the C++ compiler") +
       " failed on " + what + " (" +
       (!execError.empty()   ? execError
        : !undefined.empty() ? undefined
                             : first) +
       ")" + (undefined.empty() ? "" : linkHint) + "; full log: " + kept);
}

} // namespace

int runCompile(CompileArgs &args) {
  // The plan.
  Plan plan;
  std::string error;
  if (!args.planText.empty()) {
    // --auto: the planner's choice.
    if (!parsePlan(args.planText, args.planPath, plan, error))
      die(error);
  } else if (!args.planPath.empty()) {
    std::string text = readFileOrDie(args.planPath, "a plan (JSON)");
    if (!parsePlan(text, args.planPath, plan, error))
      die(error);
  } else {
    parsePlan("{\"dp\": 1}", "default plan", plan, error);
  }
  if (args.target != "cpu" && args.target != "cuda")
    die("--target " + args.target + ": unknown target (cpu or cuda)");
  const bool cuda = args.target == "cuda";
  // The CUDA toolchain, checked before any work.
  std::vector<std::string> archs;
  if (cuda) {
    auto cfg = runtimeConfig();
    if (cfg.count("cuda_missing"))
      die("--target cuda: this carve was built without the CUDA target (" + cfg["cuda_missing"] +
          "); install a CUDA toolkit with cuBLAS and NCCL and rebuild carve");
    std::string list = args.cudaArchs.empty() ? cfg["cuda_archs"] : args.cudaArchs;
    std::istringstream in(list);
    std::string a;
    while (std::getline(in, a, ',')) {
      if (a.empty() || a.size() > 3 || a.find_first_not_of("0123456789") != std::string::npos ||
          std::stoi(a) < 50)
        die("--cuda-arch " + list + ": '" + a +
            "' is not a GPU architecture number (e.g. 80 for sm_80, 90 for sm_90)");
      archs.push_back(a);
    }
    if (archs.empty())
      die("--cuda-arch: no architecture given (e.g. --cuda-arch 80,90)");
  } else if (!args.cudaArchs.empty()) {
    die("--cuda-arch applies to --target cuda only");
  }

  // The optimizer: defaults, then the plan, then the command line.
  OptimizerConfig opt;
  if (!applyPlanOptimizer(plan, opt, error))
    die((args.planPath.empty() ? "plan" : args.planPath) + ": " + error);
  for (const std::string &k : args.setOnCommandLine) {
    const OptimizerConfig &c = args.optimizer;
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
  if (!validateOptimizer(opt, error))
    die(error);

  // The output directory must be ours to replace.
  std::string out = args.output;
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

  // The rules file: custom ops for the importer, overrides for the partitioner.
  RuleSet rules;
  if (!args.rulesPath.empty()) {
    if (!loadRules(args.rulesPath, rules, error))
      die(error);
    args.import.customOps = rules.customOps;
  }

  // Import with the global batch: the parameters' initial values, the batch.
  Progress progress(args.quiet);
  progress.start("import");
  mlir::MLIRContext context;
  context.loadDialect<dist::DistDialect>();
  std::vector<ImportOptions::InitialValue> initial;
  ImportOptions globalOpts = args.import;
  globalOpts.initialValues = &initial;
  auto global = loadModel(context, args.model, globalOpts, error);
  if (!global)
    die(args.model + ": " + error);
  auto fwd = global->lookupSymbol<mlir::func::FuncOp>("forward");
  int64_t batch = -1;
  std::string batchInput;
  std::map<std::string, bool> isInt;
  for (mlir::BlockArgument a : fwd.getArguments()) {
    auto t = cast<mlir::RankedTensorType>(a.getType());
    unsigned i = a.getArgNumber();
    if (auto in = fwd.getArgAttrOfType<mlir::StringAttr>(i, kInputAttr)) {
      if (t.getRank() == 0)
        die(args.model + ": input '" + in.getValue().str() +
            "' is a scalar; every graph input needs a leading batch dimension");
      if (batch < 0)
        batch = t.getDimSize(0), batchInput = in.getValue().str();
      else if (t.getDimSize(0) != batch)
        die(args.model + ": inputs '" + batchInput + "' and '" + in.getValue().str() +
            "' disagree on the batch dimension (" + std::to_string(batch) + " vs " +
            std::to_string(t.getDimSize(0)) + ")");
    }
    for (const char *k : {kParamAttr, kBufferAttr})
      if (auto p = fwd.getArgAttrOfType<mlir::StringAttr>(i, k))
        isInt[p.getValue().str()] = isa<mlir::IntegerType>(t.getElementType());
  }
  if (batch < 0)
    die(args.model + ": the model has no graph inputs to split into batches");
  if (batch % plan.dp != 0)
    die((args.planPath.empty() ? std::string("plan") : args.planPath) +
        ": dp=" + std::to_string(plan.dp) + " does not divide the global batch of " +
        std::to_string(batch) + " (input '" + batchInput + "'); choose dp dividing " +
        std::to_string(batch) + " or export (or --set-dim) another batch");

  // Micro-batches: each replica's share of the batch runs as m of them.
  const std::string where = args.planPath.empty() ? std::string("plan") : args.planPath;
  const int64_t share = batch / plan.dp;
  int m = 1;
  if (plan.microBatchSize > 0) {
    if (share % plan.microBatchSize != 0)
      die(where + ": micro_batch_size=" + std::to_string(plan.microBatchSize) +
          " does not divide each data-parallel replica's " + std::to_string(share) +
          " samples (global batch " + std::to_string(batch) + " / dp " + std::to_string(plan.dp) +
          ")");
    m = (int)(share / plan.microBatchSize);
    if (plan.numMicroBatches > 0 && plan.numMicroBatches != m)
      die(where + ": num_micro_batches=" + std::to_string(plan.numMicroBatches) +
          " and micro_batch_size=" + std::to_string(plan.microBatchSize) + " disagree (" +
          std::to_string(share) + " samples per replica make " + std::to_string(m) +
          " micro-batches of that size); give one of them");
  } else if (plan.numMicroBatches > 0) {
    m = plan.numMicroBatches;
  }
  if (share % m != 0)
    die(where + ": num_micro_batches=" + std::to_string(m) +
        " does not divide each data-parallel replica's " + std::to_string(share) +
        " samples (global batch " + std::to_string(batch) + " / dp " + std::to_string(plan.dp) +
        ")");
  const bool pipelined = plan.pp > 1 || m > 1;
  pipeline::Schedule schedule;
  if (pipelined) {
    pipeline::ScheduleKind kind;
    if (!pipeline::parseScheduleKind(plan.scheduleName(), kind, error) ||
        !pipeline::buildSchedule(kind, plan.pp, m, plan.virtualStages, schedule, error))
      die(where + ": " + error);
  } else if (!args.timelineJson.empty() || !args.timelineSvg.empty()) {
    die(std::string(args.timelineJson.empty() ? "--timeline-svg" : "--timeline") +
        ": the plan has no pipeline schedule (pp=1 and one micro-batch); set \"pp\" or "
        "\"num_micro_batches\"");
  }

  // One rank's program: the same model with batch / (dp * m).
  mlir::OwningOpRef<mlir::ModuleOp> local;
  const int64_t micro = share / m;
  if (micro == batch) {
    local = std::move(global);
  } else {
    ImportOptions localOpts = args.import;
    localOpts.batch = micro;
    localOpts.globalBatch = batch;
    local = loadModel(context, args.model, localOpts, error);
    if (!local)
      die(args.model + ": importing one " + std::string(m > 1 ? "micro-batch" : "rank's share") +
          " of the batch (" + std::to_string(micro) + " of " + std::to_string(batch) +
          ") failed: " + error +
          " (the model may hard-code its batch size in a reshape; export it with a "
          "dynamic batch)");
  }

  progress.done(
      std::to_string(initial.size()) + " parameters, global batch " + std::to_string(batch) +
      (micro == batch ? std::string()
                      : ", " + std::to_string(micro) + " per " + (m > 1 ? "micro-batch" : "rank")));

  progress.start("training step");
  if (!prepareCustomOps(*local, rules, error))
    die(args.model + ": " + error);
  AutodiffOptions ad;
  ad.loss = args.loss;
  {
    // A gradient rule says why it failed in a diagnostic (a custom op without
    // a backward kernel): fold it into the one error line.
    std::string why;
    mlir::ScopedDiagnosticHandler handler(&context, [&](mlir::Diagnostic &d) {
      if (why.empty())
        why = d.str();
      return mlir::success();
    });
    if (!buildTrainingStep(*local, ad, error))
      die(args.model + ": " + error + (why.empty() ? "" : ": " + why));
  }
  if (!checkOverridesMatch(*local, rules, error))
    die(error);
  progress.done("forward, backward and " + opt.kind + " update");
  PartitionReport partition;
  if (plan.tp > 1 || plan.zero > 0) {
    progress.start("partition (" + std::string(plan.tp > 1 ? "tp=" + std::to_string(plan.tp) : "") +
                   (plan.tp > 1 && plan.zero > 0 ? ", " : "") +
                   (plan.zero > 0 ? "zero=" + std::to_string(plan.zero) : "") + ")");
    PartitionOptions po;
    po.dp = plan.dp;
    po.tp = plan.tp;
    po.zero = plan.zero;
    po.sequenceParallel = plan.sequenceParallel;
    for (const auto &[glob, dim] : plan.ops)
      po.overrides.push_back({glob, dim});
    po.annotations = rules.overrides;
    std::string where = args.planPath.empty() ? std::string("plan") : args.planPath;
    if (!partitionTrainStep(*local, po, partition, error))
      die(error.rfind("plan: ", 0) == 0 ? where + error.substr(4) : args.model + ": " + error);
    progress.done(plan.tp > 1 ? std::to_string(partition.choices.size()) + " ops split"
                              : std::string());
  } else if (!plan.ops.empty()) {
    die((args.planPath.empty() ? std::string("plan") : args.planPath) +
        ": \"ops\" overrides choose splits over tp; the plan has no \"tp\" > 1");
  }
  PipelineReport stages;
  std::vector<PipelineCodegenOptions::Shared> shared;
  if (pipelined) {
    progress.start("pipeline split (pp=" + std::to_string(plan.pp) + ", m=" + std::to_string(m) +
                   ")");
    PipelineOptions po;
    po.pp = plan.pp;
    po.virtualStages = plan.virtualStages;
    po.dp = plan.dp;
    po.tp = plan.tp;
    po.cuts = plan.cuts;
    if (!splitPipelineStages(*local, po, stages, error))
      die(error.rfind("plan: ", 0) == 0 ? where + error.substr(4) : args.model + ": " + error);
    // Gradients summed over stages, in one order for every rank.
    std::map<std::string, PipelineCodegenOptions::Shared> byName;
    for (int s = 0; s < plan.pp * plan.virtualStages; ++s) {
      auto fn = local->lookupSymbol<mlir::func::FuncOp>("stage" + std::to_string(s));
      for (unsigned k = 0; k < fn.getNumResults(); ++k)
        if (fn.getResultAttr(k, "carve.shared_grad")) {
          std::string name = fn.getResultAttrOfType<mlir::StringAttr>(k, "carve.grad_of").str();
          auto t = cast<mlir::RankedTensorType>(fn.getResultTypes()[k]);
          if (!byName.count(name))
            byName[name] = {name, t.getNumElements(), s};
        }
    }
    for (auto &[n, sh] : byName)
      shared.push_back(sh);
    progress.done(std::to_string(stages.stages.size()) + " stages, " + plan.scheduleName() +
                  " schedule");
  }
  progress.start("codegen");
  if (!args.emitMlir.empty()) {
    std::string text;
    raw_string_ostream os(text);
    local->print(os);
    writeFileOrDie(args.emitMlir, text);
  }

  std::string modelName = sys::path::filename(args.model).str();
  CodegenOptions cg;
  cg.modelName = modelName;
  cg.dp = plan.dp;
  cg.tp = plan.tp;
  cg.zero = plan.zero;
  cg.globalBatch = batch;
  cg.optimizer = opt;
  cg.planJson = plan.json;
  cg.pp = plan.pp;
  cg.numMicroBatches = m;
  cg.target = args.target;
  cg.precision = plan.precision;
  cg.fuse = args.fuse;
  std::vector<GeneratedProgram> progs(pipelined ? plan.pp : 1);
  std::vector<std::string> programNames;
  if (!pipelined) {
    if (!generateCpuProgram(*local, cg, progs[0], error))
      die(args.model + ": " + error);
    programNames.push_back("program0");
  } else {
    for (int r = 0; r < plan.pp; ++r) {
      PipelineCodegenOptions pc;
      pc.pp = plan.pp;
      pc.virtualStages = plan.virtualStages;
      pc.schedule = plan.scheduleName();
      pc.rank = r;
      for (const pipeline::Instr &in : schedule.ranks[r])
        pc.steps.push_back({in.kind == pipeline::Instr::Forward, in.microBatch, in.chunk, in.slot});
      pc.slots = schedule.slots[r];
      pc.shared = shared;
      cg.programName = "program" + std::to_string(r);
      if (!generatePipelineProgram(*local, cg, pc, progs[r], error))
        die(args.model + ": " + error);
      programNames.push_back(cg.programName);
    }
  }
  const GeneratedProgram &prog = progs[0];
  int64_t kernelCalls = 0, maxArena = 0;
  for (const GeneratedProgram &g : progs)
    kernelCalls += g.numKernelCalls, maxArena = std::max(maxArena, g.arenaBytes);

  // The planned timeline: stage times from FLOPs at a nominal rate (only the
  // ratios matter for the picture and the bubble).
  pipeline::Timeline timeline;
  if (pipelined) {
    const double rate = 1e12;
    std::vector<pipeline::StageCost> costs;
    for (const StageSummary &st : stages.stages)
      costs.push_back(
          {std::max(st.forwardFlops, 1.0) / rate, std::max(st.backwardFlops, 1.0) / rate});
    if (!pipeline::simulate(schedule, costs, 0, timeline, error))
      die(args.model + ": " + error);
    std::string title = modelName + " " + plan.json;
    if (!args.timelineJson.empty())
      writeFileOrDie(args.timelineJson, pipeline::chromeTraceJson(schedule, timeline, title));
    if (!args.timelineSvg.empty())
      writeFileOrDie(args.timelineSvg, pipeline::timelineSvg(schedule, timeline, title));
  }

  // Write everything into a temporary directory beside OUT.
  SmallString<256> parent(out);
  sys::path::remove_filename(parent);
  if (parent.empty())
    parent = ".";
  if (std::error_code ec = sys::fs::create_directories(parent))
    die(out + ": cannot create the parent directory: " + ec.message());
  // createUniqueDirectory puts a relative prefix under the system's temporary
  // directory; the temporary output must be beside OUT.
  sys::fs::make_absolute(parent);
  TempDir tmp;
  activeTemp = &tmp;
  {
    SmallString<256> t;
    if (std::error_code ec =
            sys::fs::createUniqueDirectory(parent + "/." + sys::path::filename(out) + ".tmp", t))
      die(out + ": cannot create a temporary directory: " + ec.message());
    tmp.path = t.str().str();
  }
  std::string dir = tmp.path;
  const std::string ext = cuda ? ".cu" : ".cpp";
  for (const char *sub : {"/src", "/bin"})
    if (std::error_code ec = sys::fs::create_directories(dir + sub))
      fail(dir + sub + ": " + ec.message());
  for (size_t r = 0; r < progs.size(); ++r)
    writeFileOrDie(dir + "/src/" + programNames[r] + ext, progs[r].source);
  std::vector<int> rankToProgram(plan.worldSize(), 0);
  for (int r = 0; r < plan.worldSize(); ++r)
    rankToProgram[r] = pipelined ? r / (plan.dp * plan.tp) : 0;
  writeFileOrDie(dir + "/src/programs.cpp", generateProgramTable(programNames, rankToProgram));
  {
    std::string readme;
    raw_string_ostream os(readme);
    os << "# Generated sources for " << modelName << "\n\n"
       << "Plan: `" << plan.json << "` (" << plan.worldSize() << " rank"
       << (plan.worldSize() > 1 ? "s" : "") << ").\n\n"
       << "| ranks | source | what it does |\n|---|---|---|\n";
    if (!pipelined) {
      os << "| 0";
      if (plan.worldSize() > 1)
        os << "–" << plan.worldSize() - 1;
      os << " | program0" << ext << " | the whole training step on " << batch / plan.dp << " of the "
         << batch << " samples of each global batch";
      if (plan.dp > 1)
        os << "; gradients summed over the " << plan.dp << " data-parallel replicas";
      os << " |\n";
    } else {
      int group = plan.dp * plan.tp;
      for (int r = 0; r < plan.pp; ++r) {
        os << "| " << r * group;
        if (group > 1)
          os << "–" << (r + 1) * group - 1;
        os << " | " << programNames[r] << ext << " | pipeline stage";
        std::string list;
        for (int c = 0; c < plan.virtualStages; ++c)
          list += (c ? ", " : "") + std::to_string(c * plan.pp + r);
        os << (plan.virtualStages > 1 ? "s " : " ") << list << " (" << plan.scheduleName()
           << " schedule, " << m << " micro-batch" << (m > 1 ? "es" : "") << " of " << micro
           << " samples per step) |\n";
      }
    }
    os << "\n"
       << "`programs.cpp` maps each rank to its program. The runtime's `main` "
          "(runtime/src/train_main.cpp) reads the data, runs the steps and writes "
          "checkpoints.\n\n"
       << "Optimizer: " << opt.describe() << ".\n\n";
    if (!(cuda ? rules.cudaSources : rules.sources).empty()) {
      os << "Custom ops: `custom/` holds copies of the " << (cuda ? "CUDA" : "C++")
         << " kernel sources that " << args.rulesPath
         << " names; they are compiled from their original paths and linked into bin/train.\n\n";
    }
    if (!pipelined)
      os << "Memory: arena of " << prog.arenaBytes << " bytes per rank; activations take "
         << prog.activationBytes << " bytes with reuse by liveness (" << prog.unplannedBytes
         << " without).\n";
    else
      for (size_t r = 0; r < progs.size(); ++r)
        os << "Memory of pipeline rank " << r << ": arena of " << progs[r].arenaBytes
           << " bytes; activations " << progs[r].activationBytes << " bytes (all slots).\n";
    writeFileOrDie(dir + "/src/README.md", readme);
  }
  {
    nlohmann::ordered_json p = nlohmann::ordered_json::parse(plan.json);
    nlohmann::ordered_json meta;
    meta["plan"] = p;
    meta["world_size"] = plan.worldSize();
    meta["model"] = modelName;
    meta["global_batch"] = batch;
    meta["optimizer"] = opt.describe();
    meta["target"] = args.target;
    meta["precision"] = plan.precision;
    if (pipelined) {
      nlohmann::ordered_json pj;
      pj["pp"] = plan.pp;
      pj["num_micro_batches"] = m;
      pj["micro_batch_size"] = micro;
      pj["schedule"] = plan.scheduleName();
      pj["virtual_stages"] = plan.virtualStages;
      pj["planned_bubble"] = timeline.bubble;
      nlohmann::ordered_json list = nlohmann::ordered_json::array();
      for (size_t s = 0; s < stages.stages.size(); ++s) {
        const StageSummary &st = stages.stages[s];
        nlohmann::ordered_json e;
        e["stage"] = s;
        e["rank"] = (int)s % plan.pp;
        e["first"] = st.first;
        e["last"] = st.last;
        e["layers"] = st.layers;
        e["flops"] = st.flops;
        e["param_bytes"] = st.paramBytes;
        e["send_bytes"] = st.sendBytes;
        list.push_back(e);
      }
      pj["stages"] = list;
      nlohmann::ordered_json sh = nlohmann::ordered_json::array();
      for (const auto &x : shared)
        sh.push_back(x.name);
      pj["shared_parameters"] = sh;
      meta["pipeline"] = pj;
    }
    writeFileOrDie(dir + "/plan.json", meta.dump(2) + "\n");
  }
  writeInitialValues(dir + "/init.safetensors", initial, isInt, modelName);
  progress.done(std::to_string(progs.size()) + " program" + (progs.size() > 1 ? "s" : "") + ", " +
                std::to_string(kernelCalls) + " kernel calls");

  // Compile the custom ops' kernels of the target (from their own paths, so
  // that their includes resolve and errors name the user's files; OUT/src/custom/
  // keeps copies), then compile the program and link.
  auto cfg = runtimeConfig();
  std::vector<std::string> flags;
  for (auto &w : splitWords(cfg["cxxflags"]))
    flags.push_back(w);
  flags.push_back("-I" + cfg["include"]);
  // nvcc's command for a CUDA source, device code for every architecture asked for.
  auto nvccArgs = [&]() {
    std::vector<std::string> argv = {cfg["nvcc"],
                                     "-std=c++17",
                                     "-O3",
                                     "--expt-relaxed-constexpr",
                                     "-Xcompiler=-fPIC",
                                     "-I" + cfg["include"]};
    for (auto &w : splitWords(cfg["cuda_include"]))
      argv.push_back("-I" + w);
    for (const std::string &a : archs)
      argv.push_back("-gencode=arch=compute_" + a + ",code=sm_" + a);
    return argv;
  };
  std::string log = dir + "/build.log";
  std::vector<std::string> objects;
  if (std::error_code ec = sys::fs::create_directories(dir + "/obj"))
    fail(dir + "/obj: " + ec.message());
  const std::vector<std::string> &kernelSources = cuda ? rules.cudaSources : rules.sources;
  if (!kernelSources.empty())
    if (std::error_code ec = sys::fs::create_directories(dir + "/src/custom"))
      fail(dir + "/src/custom: " + ec.message());
  for (const std::string &src : kernelSources) {
    std::string name = sys::path::filename(src).str();
    progress.start((cuda ? "CUDA build " : "C++ build ") + name);
    if (std::error_code ec = sys::fs::copy_file(src, dir + "/src/custom/" + name))
      fail(src + ": cannot copy into " + out + "/src/custom: " + ec.message());
    std::vector<std::string> argv;
    if (cuda) {
      argv = nvccArgs();
      argv.push_back("-x");
      argv.push_back("cu"); // whatever the file's extension
    } else {
      argv = {cfg["cxx"]};
      argv.insert(argv.end(), flags.begin(), flags.end());
    }
    objects.push_back(dir + "/obj/" + name + ".o");
    for (const std::string &a : {std::string("-c"), src, std::string("-o"), objects.back()})
      argv.push_back(a);
    runCompiler(argv[0], argv, log, out,
                src + std::string(cuda ? ", a CUDA" : ", a") + " kernel source of the rules file " +
                    args.rulesPath,
                "");
    progress.done("custom op kernels");
  }
  // One object per program, so that the progress names the rank being built.
  for (size_t r = 0; r < programNames.size(); ++r) {
    const std::string &n = programNames[r];
    progress.start((cuda ? "CUDA build " : "C++ build ") + n);
    std::vector<std::string> argv;
    if (cuda) {
      argv = nvccArgs();
    } else {
      argv = {cfg["cxx"]};
      argv.insert(argv.end(), flags.begin(), flags.end());
    }
    objects.push_back(dir + "/obj/" + n + ".o");
    for (const std::string &a :
         {std::string("-c"), dir + "/src/" + n + ext, std::string("-o"), objects.back()})
      argv.push_back(a);
    runCompiler(argv[0], argv, log, out, "the generated program (src/" + n + ext + ")", "");
    int group = plan.dp * plan.tp;
    progress.done(!pipelined  ? std::string(plan.worldSize() > 1 ? "every rank" : "rank 0")
                  : group > 1 ? "ranks " + std::to_string(r * group) + "-" +
                                    std::to_string((r + 1) * group - 1) + " (pipeline rank " +
                                    std::to_string(r) + ")"
                              : "rank " + std::to_string(r) + " (pipeline rank)");
  }
  progress.start("C++ link");
  std::vector<std::string> argv = {cfg["cxx"]};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(dir + "/src/programs.cpp");
  argv.insert(argv.end(), objects.begin(), objects.end());
  if (cuda)
    for (auto &w : splitWords(cfg["cuda_libs"]))
      argv.push_back(w);
  for (auto &w : splitWords(cfg["libs"]))
    argv.push_back(w);
  argv.push_back("-o");
  argv.push_back(dir + "/bin/train");
  runCompiler(cfg["cxx"], argv, log, out, "the generated program",
              kernelSources.empty()
                  ? ""
                  : "; do the " + std::string(cuda ? "\"cuda\"" : "\"cpu\"") +
                        " sources of " + args.rulesPath +
                        " define every kernel it names, as extern \"C\"?");
  sys::fs::remove_directories(dir + "/obj");
  progress.done("bin/train");

  // Move into place.
  if (sys::fs::exists(out))
    if (std::error_code ec = sys::fs::remove_directories(out))
      fail(out + ": cannot replace the previous output: " + ec.message());
  if (std::error_code ec = sys::fs::rename(dir, out))
    fail(out + ": cannot move the output into place: " + ec.message());
  tmp.keep = true;
  activeTemp = nullptr;
  if (!args.quiet)
    outs() << "carve: compiled " << modelName << " for " << plan.worldSize() << " rank"
           << (plan.worldSize() > 1 ? "s" : "") << " (" << plan.json << "): " << out
           << "/bin/train\n"
           << "       " << kernelCalls << " kernel calls per "
           << (pipelined ? "micro-batch" : "step") << ", " << prog.numBuckets
           << " gradient bucket(s), arena " << format("%.1f", maxArena / 1048576.0)
           << " MiB per rank" << (pipelined ? " (largest)" : "") << "; sources in " << out
           << "/src\n";
  if (!args.quiet && pipelined) {
    outs() << "       pipeline: " << stages.stages.size() << " stage(s) on pp=" << plan.pp << ", "
           << plan.scheduleName() << " schedule, " << m << " micro-batch" << (m > 1 ? "es" : "")
           << " of " << micro << "; planned bubble " << format("%.1f", timeline.bubble * 100)
           << "% of compute\n";
    for (size_t s = 0; s < stages.stages.size(); ++s) {
      const StageSummary &st = stages.stages[s];
      outs() << "         stage " << s << " (rank " << s % plan.pp << "): ";
      if (st.layers > 0 && stages.numLayers > 0)
        outs() << st.layers << " layer" << (st.layers > 1 ? "s" : "") << ", ";
      outs() << format("%.3g", st.flops) << " FLOP per micro-batch, parameters "
             << format("%.2f", st.paramBytes / 1048576.0) << " MiB, sends "
             << format("%.2f", st.sendBytes / 1048576.0) << " MiB ['" << st.first << "' .. '"
             << st.last << "']\n";
    }
    if (!shared.empty()) {
      outs() << "         gradients summed over stages:";
      for (const auto &x : shared)
        outs() << " " << x.name;
      outs() << "\n";
    }
  }
  if (!args.quiet && plan.tp > 1)
    outs() << "       tp=" << plan.tp << (plan.sequenceParallel ? " with sequence parallelism" : "")
           << ": " << partition.choices.size() << " ops split; per step " << partition.allReduce
           << " all-reduce, " << partition.allGather << " all-gather, " << partition.reduceScatter
           << " reduce-scatter, " << partition.allToAll << " all-to-all over tp\n";
  return 0;
}

int runRun(const std::string &outDir, int ranks, const std::vector<std::string> &trainArgs) {
  std::string out = outDir;
  std::string planPath = out + "/plan.json";
  std::string train = out + "/bin/train";
  if (!sys::fs::exists(planPath) || !sys::fs::exists(train))
    die(out +
        ": not a carve output directory (expected plan.json and bin/train; create it "
        "with `carve compile MODEL -o " +
        out + "`)");
  int world = 0;
  std::string planText;
  try {
    auto j = nlohmann::json::parse(readFileOrDie(planPath, "plan.json"));
    world = j.at("world_size").get<int>();
    planText = j.at("plan").dump();
  } catch (const std::exception &) {
    die(planPath + ": unreadable (recompile with `carve compile`)");
  }
  if (ranks <= 0)
    die("-n must be a positive number of ranks");
  if (ranks != world)
    die(out + " was compiled for " + std::to_string(world) + " rank" + (world > 1 ? "s" : "") +
        " (plan " + planText + "), not " + std::to_string(ranks) + "; run it with -n " +
        std::to_string(world) + " or recompile with another plan");

  unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  std::string threads = getenv("OMP_NUM_THREADS")
                            ? std::string(getenv("OMP_NUM_THREADS"))
                            : std::to_string(std::max(1u, cores / (unsigned)ranks));
  setenv("OMP_NUM_THREADS", threads.c_str(), 1);
  setenv("OPENBLAS_NUM_THREADS", threads.c_str(), 1);
  // Under mpirun a rank's stdout is a pseudo-terminal whatever ours is; tell
  // the ranks whether a person watches (train --progress auto).
  setenv("CARVE_STDOUT_TTY", isatty(STDOUT_FILENO) ? "1" : "0", 1);

  std::vector<std::string> argv;
  if (ranks == 1) {
    argv.push_back(train);
  } else {
    auto mpirun = sys::findProgramByName("mpirun");
    if (!mpirun)
      die("mpirun was not found on PATH (Debian package openmpi-bin)");
    argv = {*mpirun, "-n", std::to_string(ranks)};
    if (geteuid() == 0)
      argv.push_back("--allow-run-as-root");
    for (const char *a :
         {"--oversubscribe", "--bind-to", "none", "--mca", "btl_vader_single_copy_mechanism",
          "none", "-x", "OMP_NUM_THREADS", "-x", "OPENBLAS_NUM_THREADS", "-x", "CARVE_STDOUT_TTY"})
      argv.push_back(a);
    argv.push_back(train);
  }
  for (const std::string &a : trainArgs)
    argv.push_back(a);
  std::vector<char *> cargv;
  for (std::string &a : argv)
    cargv.push_back(a.data());
  cargv.push_back(nullptr);
  fflush(stdout);

  // Run mpirun (or, for one rank, the program itself) as a child, pass its
  // stderr through, and when the job fails say which rank took it down and how
  // (mpirun's notice names it).
  int fds[2];
  if (pipe(fds) != 0)
    die("cannot create a pipe: " + std::string(strerror(errno)));
  pid_t child = fork();
  if (child < 0)
    die("cannot fork: " + std::string(strerror(errno)));
  if (child == 0) {
    dup2(fds[1], 2);
    close(fds[0]);
    close(fds[1]);
    execv(cargv[0], cargv.data());
    fprintf(stderr, "carve: error: cannot start %s: %s\n", cargv[0], strerror(errno));
    _exit(127);
  }
  close(fds[1]);
  static pid_t runningChild;
  runningChild = child;
  auto forward = [](int sig) { kill(runningChild, sig); };
  signal(SIGINT, forward);
  signal(SIGTERM, forward);
  std::string captured;
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR)) {
    if (n <= 0)
      continue;
    fwrite(buf, 1, n, stderr);
    fflush(stderr);
    captured.append(buf, n);
    if (captured.size() > (1 << 20))
      captured.erase(0, captured.size() - (1 << 19));
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (rc == 0)
    return 0;
  if (ranks == 1) {
    if (WIFSIGNALED(status)) {
      const int sig = WTERMSIG(status);
      const char *abbrev = sigabbrev_np(sig);
      errs() << "carve: error: rank 0 (the only one, pid " << child << ") was killed by signal "
             << sig << " (SIG" << (abbrev ? abbrev : "?") << ": " << strsignal(sig) << ")\n";
    }
    return rc;
  }
  // A rank that gave up waiting (--collective-timeout) printed what it waited
  // for: "carve: rank 0: all-reduce over dp (...) did not complete in 30 s; ...".
  size_t timedOut = captured.find(" did not complete in ");
  size_t at = captured.find("process rank ");
  int deadRank = -1, pid = 0, sig = 0;
  char node[256] = "";
  if (at != std::string::npos)
    std::sscanf(captured.c_str() + at, "process rank %d with PID %d on node %255s exited on signal %d",
                &deadRank, &pid, node, &sig);
  if (timedOut != std::string::npos) {
    size_t begin = captured.rfind("carve: rank ", timedOut);
    std::string what = begin == std::string::npos
                           ? std::string("a collective")
                           : captured.substr(begin + 7, timedOut - begin - 7);
    errs() << "carve: error: " << what
           << " timed out (--collective-timeout); the job was aborted and every rank stopped\n";
  } else if (sig > 0) {
    const char *abbrev = sigabbrev_np(sig);
    errs() << "carve: error: rank " << deadRank;
    if (pid > 0)
      errs() << " (pid " << pid << " on " << node << ")";
    errs() << " was killed by signal " << sig << " (SIG" << (abbrev ? abbrev : "?") << ": "
           << strsignal(sig) << "); mpirun stopped every other rank\n";
  } else if (at != std::string::npos) {
    // "process rank 1 with PID 123 on node x exiting improperly" and the like.
    size_t end = captured.find('\n', at);
    std::string what =
        captured.substr(at + 8, end == std::string::npos ? std::string::npos : end - at - 8);
    while (!what.empty() && (what.back() == '.' || what.back() == ' '))
      what.pop_back();
    errs() << "carve: error: " << what << "; every rank of the job was stopped\n";
  } else if (captured.find("carve: error") == std::string::npos) {
    errs() << "carve: error: the job failed (mpirun exit status " << rc << ")\n";
  }
  return rc;
}

} // namespace carve
