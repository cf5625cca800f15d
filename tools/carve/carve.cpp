//===- carve.cpp - the carve command-line driver --------------------------===//
//
// `carve import MODEL.onnx` reads an exported model and prints its carve IR
// (or a summary). Later subcommands (compile, run, plan) string the compiler's
// passes together the same way: every error is one line on stderr, exit 1.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Builtin.h"
#include "compiler/frontend/OnnxImporter.h"
#include "compiler/rules/Rules.h"
#include "tools/carve/CkptCmd.h"
#include "tools/carve/Compile.h"
#include "tools/carve/PlanCmd.h"
#include "tools/carve/PlotCmd.h"
#include "tools/carve/Summary.h"
#include "tools/carve/VerifyCmd.h"

#include "mlir/IR/AsmState.h"
#include "mlir/IR/MLIRContext.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

using namespace llvm;

namespace {

cl::OptionCategory carveCat("carve options");

cl::SubCommand importCmd("import", "Import an ONNX model into the carve dialect and print it");

cl::opt<std::string> importInput(cl::Positional, cl::Required, cl::desc("MODEL.onnx"),
                                 cl::sub(importCmd), cl::cat(carveCat));
cl::opt<std::string> importOutput("o", cl::desc("Write the IR to FILE (default: stdout)"),
                                  cl::value_desc("FILE"), cl::init("-"), cl::sub(importCmd),
                                  cl::cat(carveCat));
cl::SubCommand compileCmd("compile",
                          "Compile an ONNX model into a training executable (OUT/bin/train)");
cl::SubCommand runCmd("run", "Launch a compiled training program on N ranks (mpirun)");
cl::SubCommand ckptCmd("ckpt", "Inspect a checkpoint or merge it into one full safetensors file "
                               "(docs/checkpoints.md)");
cl::list<std::string> ckptArgs(cl::Positional, cl::OneOrMore, cl::desc("inspect|merge PATH"),
                               cl::sub(ckptCmd), cl::cat(carveCat));
cl::opt<std::string> ckptOutput("o", cl::desc("merge: the full model's safetensors file"),
                                cl::value_desc("FILE.safetensors"), cl::sub(ckptCmd),
                                cl::cat(carveCat));
cl::opt<bool> ckptWithOptimizer("with-optimizer",
                                cl::desc("merge: also write the optimizer state tensors"),
                                cl::sub(ckptCmd), cl::cat(carveCat));
cl::opt<std::string> ckptModel(
    "model",
    cl::desc("merge: the ONNX model the checkpoint was trained from: write every key of the "
             "module's state_dict() (tied aliases, buffers the program folded), so that "
             "load_state_dict(strict=True) takes the file"),
    cl::value_desc("MODEL.onnx"), cl::sub(ckptCmd), cl::cat(carveCat));
cl::opt<std::string> ckptDtype("dtype",
                               cl::desc("merge: the weights' dtype in the file: fp32 (default), "
                                        "bf16 or fp16 (rounded to nearest even)"),
                               cl::value_desc("fp32|bf16|fp16"), cl::init("fp32"), cl::sub(ckptCmd),
                               cl::cat(carveCat));
cl::SubCommand plotCmd("plot", "Draw training logs (train --log) as an SVG picture: loss, "
                               "learning rate, gradient norm, throughput against the step");
cl::list<std::string> plotLogs(cl::Positional, cl::OneOrMore, cl::desc("LOG.jsonl..."),
                               cl::sub(plotCmd), cl::cat(carveCat));
cl::opt<std::string> plotOutput("o", cl::desc("The SVG file to write"), cl::value_desc("FILE.svg"),
                                cl::sub(plotCmd), cl::cat(carveCat));
cl::SubCommand planCmd("plan", "Search a parallelization plan for a model on a cluster and "
                               "explain it (docs/planner.md)");
cl::SubCommand verifyCmd("verify", "Train a plan's program and the 1-rank program a few steps "
                                   "and compare losses and weights (docs/verify.md)");

cl::list<std::string>
    setDims("set-dim",
            cl::desc("Bind a symbolic dimension (from dynamic_axes) to a size; repeatable"),
            cl::value_desc("NAME=VALUE"), cl::sub(importCmd), cl::sub(compileCmd), cl::sub(planCmd),
            cl::sub(verifyCmd), cl::cat(carveCat));
cl::opt<std::string>
    rulesFile("rules",
              cl::desc("Rules file (JSON): custom ops (annotation, output shapes, C++ kernels) and "
                       "annotation overrides; docs/custom-ops.md"),
              cl::value_desc("RULES.json"), cl::sub(importCmd), cl::sub(compileCmd),
              cl::sub(verifyCmd), cl::cat(carveCat));
cl::list<std::string>
    frozen("frozen",
           cl::desc("Do not train parameters whose names match GLOB (e.g. 'wte.*'); repeatable"),
           cl::value_desc("GLOB"), cl::sub(importCmd), cl::sub(compileCmd), cl::sub(planCmd),
           cl::sub(verifyCmd), cl::cat(carveCat));

// carve compile
cl::opt<std::string> compileInput(cl::Positional, cl::Required, cl::desc("MODEL.onnx"),
                                  cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<std::string> compileOutput("o", cl::desc("Output directory (src/, bin/train, ...)"),
                                   cl::value_desc("OUT"), cl::sub(compileCmd),
                                   cl::cat(carveCat));
cl::opt<std::string> planFile("plan", cl::desc("Plan file (JSON), e.g. {\"dp\": 4}"),
                              cl::value_desc("PLAN.json"), cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<std::string> target("target",
                            cl::desc("Target: cpu (C++ over MPI) or cuda (C++/CUDA over NCCL; "
                                     "docs/cuda.md)"),
                            cl::init("cpu"), cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<std::string> attentionKernel(
    "attention",
    cl::desc("The CUDA target's attention under bf16/fp16: cudnn (default: cuDNN's fused flash "
             "attention where it can take the call, carve's kernel elsewhere) or carve (carve's "
             "own kernel everywhere; docs/cuda.md)"),
    cl::value_desc("cudnn|carve"), cl::init("cudnn"), cl::sub(compileCmd), cl::sub(planCmd),
    cl::cat(carveCat));
cl::opt<std::string> convolutionKernel(
    "convolution",
    cl::desc("The CUDA target's convolutions: cudnn (default: cuDNN's convolutions, forward "
             "and both gradients) or carve (im2col gathers and GEMMs, as on the CPU; "
             "docs/cuda.md)"),
    cl::value_desc("cudnn|carve"), cl::init("cudnn"), cl::sub(compileCmd), cl::sub(planCmd),
    cl::cat(carveCat));
cl::opt<bool> noFuse("no-fuse",
                     cl::desc("Run every op as its own kernel: no fused elementwise chains, no "
                              "convolution input gradient computed with its GEMM (for "
                              "comparing; docs/fusion.md)"),
                     cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<bool> noWeights(
    "no-weights",
    cl::desc("Compile the programs without their initial weights (no OUT/init.safetensors; "
             "train then needs --load): for builtin models too large to materialize here"),
    cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<bool> noBuild(
    "no-build",
    cl::desc("Write the per-rank sources, plan.json and weights but do not compile and link "
             "OUT/bin/train (to read the generated programs; carve run needs a full compile)"),
    cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<int64_t> bucketBytes(
    "bucket-bytes",
    cl::desc("Largest gradient bucket in bytes, reduced as one piece over dp (default 4194304; "
             "a larger gradient is a bucket of its own)"),
    cl::init(4194304), cl::value_desc("N"), cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<std::string> cudaArch("cuda-arch",
                              cl::desc("GPU architectures for --target cuda, e.g. 80,90 (sm_80 "
                                       "and sm_90; default: those the runtime was built for)"),
                              cl::value_desc("LIST"), cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<std::string> lossName("loss", cl::desc("The output that is the loss"),
                              cl::value_desc("NAME"), cl::sub(compileCmd), cl::sub(planCmd),
                              cl::sub(verifyCmd), cl::cat(carveCat));
cl::opt<std::string> emitMlir("emit-mlir", cl::desc("Also write the training step's IR"),
                              cl::value_desc("FILE"), cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<std::string> emitMlirAfter(
    "emit-mlir-after",
    cl::desc("Write the IR as it is after this pass of the plan's pipeline (any pass it runs, "
             "from carve-bind-custom-ops to carve-select-kernels: docs/architecture.md; another "
             "is refused with the plan's list) to the --emit-mlir FILE, or to stdout"),
    cl::value_desc("PASS"), cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<std::string> gpuModel(
    "gpu-model",
    cl::desc("Write what one training step of this CUDA program launches (kernels, FLOPs, "
             "bytes) and its predicted time per kernel class on an H100 and an H200, as JSON "
             "(--target cuda, one stage; docs/gpu-model.md)"),
    cl::value_desc("FILE.json"), cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<std::string> timelineJson(
    "timeline",
    cl::desc("Write the planned pipeline schedule as a Chrome trace (one track per rank)"),
    cl::value_desc("FILE.json"), cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<std::string> timelineSvg("timeline-svg",
                                 cl::desc("Write the planned pipeline schedule as a picture"),
                                 cl::value_desc("FILE.svg"), cl::sub(compileCmd),
                                 cl::cat(carveCat));
cl::opt<bool> compileQuiet("quiet", cl::desc("Print nothing on success"), cl::sub(compileCmd),
                           cl::cat(carveCat));
cl::opt<bool> compileNoRaise("no-raise", cl::desc("Do not raise fused ops (debugging)"),
                             cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<std::string> optimizer("optimizer", cl::desc("adamw (default) or sgd"), cl::init("adamw"),
                               cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<double> lr("lr", cl::desc("Learning rate (default 1e-3)"), cl::init(1e-3),
                   cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<double> momentum("momentum", cl::desc("SGD momentum (default 0)"), cl::init(0),
                         cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<double> dampening("dampening", cl::desc("SGD dampening (default 0)"), cl::init(0),
                          cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<bool> nesterov("nesterov", cl::desc("SGD with Nesterov momentum"), cl::sub(compileCmd),
                       cl::cat(carveCat));
cl::opt<double> weightDecay("weight-decay", cl::desc("Weight decay (default: AdamW 0.01, SGD 0)"),
                            cl::init(-1), cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<double> beta1("beta1", cl::desc("AdamW beta1 (default 0.9)"), cl::init(0.9),
                      cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<double> beta2("beta2", cl::desc("AdamW beta2 (default 0.999)"), cl::init(0.999),
                      cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<double> eps("eps", cl::desc("AdamW eps (default 1e-8)"), cl::init(1e-8),
                    cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<double> clipGradNorm("clip-grad-norm",
                             cl::desc("Clip the global gradient norm to this (0: off)"),
                             cl::init(0), cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<int64_t> warmupSteps("warmup-steps", cl::desc("Linear learning-rate warm-up steps"),
                             cl::init(0), cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<int64_t> decaySteps("decay-steps",
                            cl::desc("Cosine decay steps after warm-up (0: constant)"), cl::init(0),
                            cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<double> minLrRatio("min-lr-ratio",
                           cl::desc("Final learning rate of the cosine decay, as a ratio"),
                           cl::init(0), cl::sub(compileCmd), cl::cat(carveCat));

// carve plan (and compile --auto)
cl::opt<std::string> planInput(cl::Positional, cl::Required,
                               cl::desc("MODEL.onnx or builtin:gpt:layers=..,hidden=..,..."),
                               cl::sub(planCmd), cl::cat(carveCat));
cl::opt<std::string> clusterSpec(
    "cluster",
    cl::desc("The cluster: PRESET[:NODESxDEVICES] (a100-40gb, a100-80gb, h100-80gb, h200-141gb, "
             "v100-32gb, cpu) or a JSON file; docs/cluster.md"),
    cl::value_desc("C"), cl::sub(planCmd), cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<int64_t> globalBatch("global-batch",
                             cl::desc("Samples per step (default: the model's batch)"),
                             cl::value_desc("B"), cl::init(0), cl::sub(planCmd), cl::cat(carveCat));
cl::opt<std::string> constraintsFile("constraints",
                                     cl::desc("Constraints (JSON): fixed fields, bounds, pinned "
                                              "ops, dimensions not to split, memory headroom"),
                                     cl::value_desc("FILE"), cl::sub(planCmd), cl::sub(compileCmd),
                                     cl::cat(carveCat));
cl::list<std::string> fixedFields("fixed",
                                  cl::desc("Fix plan fields, e.g. --fixed tp=8,pp=16 (repeatable)"),
                                  cl::value_desc("FIELD=VALUE,..."), cl::sub(planCmd),
                                  cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<std::string> calibrationFile(
    "calibration",
    cl::desc("Measured efficiency factors for the time model (JSON), or 'carve': the chosen "
             "plan's compiled CUDA step priced by the GPU cost model (one H100 or H200; "
             "docs/gpu-model.md)"),
    cl::value_desc("FILE"), cl::sub(planCmd), cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<std::string> planOutput("o", cl::desc("Write the best plan (with its predictions) here"),
                                cl::value_desc("PLAN.json"), cl::sub(planCmd), cl::cat(carveCat));
cl::opt<bool> planJson("json", cl::desc("Print the report as JSON"), cl::sub(planCmd),
                       cl::cat(carveCat));
cl::opt<bool> noCompileCheck(
    "no-compile-check",
    cl::desc("Do not compile the chosen plan's memory plan to report its bytes as compiled "
             "(and to fall back to the next plan when it does not fit)"),
    cl::sub(planCmd), cl::cat(carveCat));
cl::opt<bool> fullCompileCheck(
    "full-compile-check",
    cl::desc("Compile the whole model for that check, never fewer layers of a builtin model "
             "(whose bytes are extrapolated from 4 to 7 layers where they are affine in the "
             "layer count; docs/planner.md)"),
    cl::sub(planCmd), cl::cat(carveCat));
cl::opt<std::string> planStorage(
    "storage",
    cl::desc("Price bf16/fp16 plans with what carve's programs store (carve, the default) or "
             "with the published mixed-precision layout: 16-bit weights, gradients and "
             "collectives, fp32 masters (published; to compare with published runs)"),
    cl::value_desc("carve|published"), cl::init("carve"), cl::sub(planCmd), cl::cat(carveCat));
cl::opt<bool> noOpSearch("no-op-search",
                         cl::desc("Keep the partitioner's per-op choices (skip the per-op search)"),
                         cl::sub(planCmd), cl::sub(compileCmd), cl::cat(carveCat));
cl::opt<bool> autoPlanFlag("auto", cl::desc("Plan (for --cluster) and compile with the best plan"),
                           cl::sub(compileCmd), cl::cat(carveCat));

// carve verify
cl::opt<std::string> verifyInput(cl::Positional, cl::Required,
                                 cl::desc("MODEL.onnx or builtin:gpt:layers=..,hidden=..,..."),
                                 cl::sub(verifyCmd), cl::cat(carveCat));
cl::opt<std::string> verifyPlan("plan", cl::desc("The plan to verify against one rank"),
                                cl::value_desc("PLAN.json"), cl::Required, cl::sub(verifyCmd),
                                cl::cat(carveCat));
cl::opt<int64_t> verifySteps("steps", cl::desc("Training steps to compare (default 5)"),
                             cl::init(5), cl::sub(verifyCmd), cl::cat(carveCat));
cl::opt<std::string> verifyData("data", cl::desc("Training data (default: generated tokens)"),
                                cl::value_desc("FILE"), cl::sub(verifyCmd), cl::cat(carveCat));
cl::opt<std::string>
    verifyWorkdir("workdir",
                  cl::desc("Keep the programs, logs and checkpoints here (default: a temporary "
                           "folder, removed)"),
                  cl::value_desc("DIR"), cl::sub(verifyCmd), cl::cat(carveCat));
cl::opt<double> verifyLossTol("tolerance-loss",
                              cl::desc("Largest relative loss difference (default: 1e-5 "
                                       "for fp32 plans, 1e-4 for bf16/fp16)"),
                              cl::init(1e-5), cl::sub(verifyCmd), cl::cat(carveCat));
cl::opt<double> verifyWeightTol(
    "tolerance-weights",
    cl::desc("Largest weight difference relative to each tensor's largest entry (default: 1e-4 "
             "for fp32 plans, 2^-6 for bf16, 2^-9 for fp16)"),
    cl::init(1e-4), cl::sub(verifyCmd), cl::cat(carveCat));
cl::opt<bool> verifyPlannedOptimizer(
    "planned-optimizer",
    cl::desc("Compare under the plan's optimizer (default: SGD with momentum; docs/verify.md)"),
    cl::sub(verifyCmd), cl::cat(carveCat));

// carve run
cl::opt<std::string> runOut(cl::Positional, cl::Required, cl::desc("OUT"), cl::sub(runCmd),
                            cl::cat(carveCat));
cl::list<std::string> runTrainArgs(cl::Positional, cl::desc("-- TRAIN ARGS..."), cl::sub(runCmd),
                                   cl::cat(carveCat));
cl::opt<int> runRanks("n", cl::desc("Number of ranks"), cl::value_desc("N"), cl::Required,
                      cl::sub(runCmd), cl::cat(carveCat));
cl::opt<bool> summary("summary",
                      cl::desc("Print a summary (inputs, outputs, parameters, op counts) "
                               "instead of the IR"),
                      cl::sub(importCmd), cl::cat(carveCat));
cl::opt<bool> noRaise("no-raise",
                      cl::desc("Keep the exporter's elementwise chains instead of "
                               "recognizing layer_norm, rms_norm, gelu, silu, attention"),
                      cl::sub(importCmd), cl::cat(carveCat));

[[noreturn]] void die(const Twine &msg) { carve::die(msg.str()); }

int runImport() {
  carve::ImportOptions opts;
  std::string error;
  for (const std::string &d : setDims)
    if (!carve::parseSetDim(d, opts, error))
      die(importInput + ": " + error);
  opts.frozen.assign(frozen.begin(), frozen.end());
  opts.raise = !noRaise;
  carve::RuleSet rules;
  if (!rulesFile.empty()) {
    if (!carve::loadRules(rulesFile, rules, error))
      die(error);
    opts.customOps = rules.customOps;
  }
  mlir::MLIRContext context;
  std::vector<std::string> notes;
  opts.notes = &notes;
  auto module = carve::loadModel(context, importInput, opts, error);
  if (!module)
    die(importInput + ": " + error);
  for (const std::string &n : notes)
    llvm::errs() << "carve: note: " << importInput << ": " << n << "\n";
  if (!carve::prepareCustomOps(*module, rules, error))
    die(importInput + ": " + error);
  std::string text;
  raw_string_ostream os(text);
  if (summary)
    carve::printSummary(*module, os);
  else
    module->print(os), os << "\n";
  carve::writeAtomically(importOutput, text);
  return 0;
}

int runCompileCommand() {
  if (compileOutput.empty())
    die("carve compile: -o OUT is required: the folder the per-rank sources, plan.json and "
        "bin/train are written to");
  carve::CompileArgs args;
  args.model = compileInput;
  args.output = compileOutput;
  args.planPath = planFile;
  args.target = target;
  if (attentionKernel != "cudnn" && attentionKernel != "carve")
    die("carve compile: --attention must be cudnn or carve, not '" + attentionKernel + "'");
  args.attention = attentionKernel;
  if (convolutionKernel != "cudnn" && convolutionKernel != "carve")
    die("carve compile: --convolution must be cudnn or carve, not '" + convolutionKernel + "'");
  args.convolution = convolutionKernel;
  args.cudaArchs = cudaArch;
  args.fuse = !noFuse;
  args.bucketBytes = bucketBytes;
  args.noWeights = noWeights;
  args.noBuild = noBuild;
  args.loss = lossName;
  args.emitMlir = emitMlir;
  args.emitMlirAfter = emitMlirAfter;
  args.timelineJson = timelineJson;
  args.timelineSvg = timelineSvg;
  args.gpuModel = gpuModel;
  args.rulesPath = rulesFile;
  args.quiet = compileQuiet;
  std::string error;
  for (const std::string &d : setDims)
    if (!carve::parseSetDim(d, args.import, error))
      die(compileInput + ": " + error);
  args.import.frozen.assign(frozen.begin(), frozen.end());
  args.import.raise = !compileNoRaise;
  carve::OptimizerConfig &o = args.optimizer;
  o.kind = optimizer;
  o.lr = lr;
  o.momentum = momentum;
  o.dampening = dampening;
  o.nesterov = nesterov;
  o.weightDecay = weightDecay;
  o.beta1 = beta1;
  o.beta2 = beta2;
  o.eps = eps;
  o.clipGradNorm = clipGradNorm;
  o.warmupSteps = warmupSteps;
  o.decaySteps = decaySteps;
  o.minLrRatio = minLrRatio;
  auto note = [&](cl::Option &opt, const char *name) {
    if (opt.getNumOccurrences())
      args.setOnCommandLine.push_back(name);
  };
  note(optimizer, "optimizer");
  note(lr, "lr");
  note(momentum, "momentum");
  note(dampening, "dampening");
  note(nesterov, "nesterov");
  note(weightDecay, "weight-decay");
  note(beta1, "beta1");
  note(beta2, "beta2");
  note(eps, "eps");
  note(clipGradNorm, "clip-grad-norm");
  note(warmupSteps, "warmup-steps");
  note(decaySteps, "decay-steps");
  note(minLrRatio, "min-lr-ratio");
  if (autoPlanFlag) {
    if (!planFile.empty())
      die("--auto chooses the plan; do not also give --plan");
    if (clusterSpec.empty())
      die("--auto needs --cluster (e.g. --cluster cpu:1x4 for four ranks on this machine)");
    carve::PlanArgs pa;
    pa.model = compileInput;
    pa.cluster = clusterSpec;
    pa.constraintsPath = constraintsFile;
    pa.fixed.assign(fixedFields.begin(), fixedFields.end());
    pa.calibrationPath = calibrationFile;
    pa.loss = lossName;
    pa.import = args.import;
    pa.opSearch = !noOpSearch;
    std::string summary;
    args.planText = carve::autoPlan(pa, summary);
    args.planPath = "--auto plan";
    if (!compileQuiet)
      outs() << "carve: --auto chose " << summary << "\n";
  } else if (!clusterSpec.empty() || !constraintsFile.empty() || !fixedFields.empty() ||
             !calibrationFile.empty()) {
    die("--cluster, --constraints, --fixed and --calibration apply with --auto");
  }
  return carve::runCompile(args);
}

} // namespace

/// `carve run OUT -n 4 --steps 100` without the `--`: the training flag
/// reaches carve run's parser, which would only say "Unknown command line
/// argument". Name the flag and where it goes instead.
void checkRunArgs(int argc, char **argv) {
  if (argc < 2 || StringRef(argv[1]) != "run")
    return;
  for (int i = 2; i < argc; ++i) {
    StringRef a(argv[i]);
    if (a == "--")
      return;
    if (a == "-n" || a == "--n") {
      ++i; // its value
      continue;
    }
    if (!a.starts_with("-") || a.starts_with("-n=") || a.starts_with("--n=") || a == "-h" ||
        a == "-help" || a == "--help" || a == "--help-hidden" || a == "--version")
      continue;
    std::string flag = a.split('=').first.str();
    die("carve run: '" + flag +
        "' is a flag of the training program, not of carve run; put it after --: carve run "
        "OUT -n N -- " +
        flag + " ... (carve run OUT -n 1 -- --help lists them)");
  }
}

int main(int argc, char **argv) {
  InitLLVM init(argc, argv);
  checkRunArgs(argc, argv);
  cl::HideUnrelatedOptions(carveCat, importCmd);
  cl::HideUnrelatedOptions(carveCat, compileCmd);
  cl::HideUnrelatedOptions(carveCat, runCmd);
  cl::HideUnrelatedOptions(carveCat, planCmd);
  cl::HideUnrelatedOptions(carveCat, ckptCmd);
  cl::HideUnrelatedOptions(carveCat, plotCmd);
  cl::HideUnrelatedOptions(carveCat, verifyCmd);
  cl::HideUnrelatedOptions(carveCat);
  cl::SetVersionPrinter([](raw_ostream &os) { os << "carve 0.1 (MLIR 22)\n"; });
  // Each subcommand's usage; `carve SUBCOMMAND --help` shows its own only.
  static const std::vector<std::pair<std::string, std::string>> usages = {
      {"import", "  carve import MODEL.onnx [--set-dim NAME=N] [--frozen GLOB] [--summary] [-o OUT]\n"},
      {"compile",
       "  carve compile MODEL.onnx [--plan PLAN.json] [--rules RULES.json] [--optimizer "
       "adamw|sgd --lr X ...] -o OUT\n"
       "  carve compile MODEL.onnx --auto --cluster cpu:1x4 -o OUT\n"},
      {"plan", "  carve plan MODEL --cluster a100-80gb:16x8 [--global-batch B] [--fixed tp=8] "
               "[--constraints FILE] [-o PLAN.json] [--json]\n"},
      {"ckpt", "  carve ckpt inspect PATH | carve ckpt merge PATH -o FULL.safetensors\n"},
      {"run", "  carve run OUT -n N -- --steps S --data FILE [--log FILE.jsonl] [--save DIR]\n"},
      {"plot", "  carve plot LOG.jsonl [LOG2.jsonl ...] -o curves.svg\n"},
      {"verify",
       "  carve verify MODEL --plan PLAN.json [--steps K] [--data FILE] [--workdir DIR]\n"}};
  std::string overview = "carve: an ahead-of-time parallelization compiler for models exported "
                         "from PyTorch\n\n";
  std::string one;
  for (const auto &[name, usage] : usages) {
    overview += usage;
    if (argc > 1 && name == argv[1])
      one = "carve " + name + " (`carve --help` lists every subcommand)\n\n" + usage;
  }
  overview += "\nRun `carve SUBCOMMAND --help` for the flags of one subcommand.\n";
  if (!one.empty())
    overview = one;
  cl::ParseCommandLineOptions(argc, argv, overview);
  if (importCmd)
    return runImport();
  if (compileCmd)
    return runCompileCommand();
  if (planCmd) {
    carve::PlanArgs pa;
    pa.model = planInput;
    pa.cluster = clusterSpec;
    pa.globalBatch = globalBatch;
    pa.constraintsPath = constraintsFile;
    pa.fixed.assign(fixedFields.begin(), fixedFields.end());
    pa.calibrationPath = calibrationFile;
    pa.output = planOutput;
    pa.json = planJson;
    if (attentionKernel != "cudnn" && attentionKernel != "carve")
      die("carve plan: --attention must be cudnn or carve, not '" + attentionKernel + "'");
    pa.attention = attentionKernel;
    if (convolutionKernel != "cudnn" && convolutionKernel != "carve")
      die("carve plan: --convolution must be cudnn or carve, not '" + convolutionKernel + "'");
    pa.convolution = convolutionKernel;
    pa.opSearch = !noOpSearch;
    pa.loss = lossName;
    if (planStorage != "carve" && planStorage != "published")
      die("carve plan: --storage must be carve or published, got '" + planStorage + "'");
    pa.publishedStorage = planStorage == "published";
    pa.compileCheck = !noCompileCheck;
    pa.fullCompileCheck = fullCompileCheck;
    if (fullCompileCheck && noCompileCheck)
      die("carve plan: --full-compile-check and --no-compile-check contradict each other (the "
          "first asks the as-compiled check to compile the whole model, the second skips it)");
    std::string error;
    for (const std::string &d : setDims)
      if (!carve::parseSetDim(d, pa.import, error))
        die(planInput + ": " + error);
    pa.import.frozen.assign(frozen.begin(), frozen.end());
    if (globalBatch.getNumOccurrences() && globalBatch < 1)
      die("--global-batch must be a positive number of samples");
    return carve::runPlan(pa);
  }
  if (verifyCmd) {
    carve::VerifyArgs va;
    va.model = verifyInput;
    va.planPath = verifyPlan;
    va.steps = verifySteps;
    va.data = verifyData;
    va.workdir = verifyWorkdir;
    if (verifyLossTol.getNumOccurrences())
      va.lossTolerance = verifyLossTol;
    if (verifyWeightTol.getNumOccurrences())
      va.weightTolerance = verifyWeightTol;
    va.plannedOptimizer = verifyPlannedOptimizer;
    for (const std::string &d : setDims)
      va.compileFlags.insert(va.compileFlags.end(), {"--set-dim", d});
    for (const std::string &g : frozen)
      va.compileFlags.insert(va.compileFlags.end(), {"--frozen", g});
    if (!rulesFile.empty())
      va.compileFlags.insert(va.compileFlags.end(), {"--rules", rulesFile});
    if (!lossName.empty())
      va.compileFlags.insert(va.compileFlags.end(), {"--loss", lossName});
    return carve::runVerify(va);
  }
  if (plotCmd)
    return carve::runPlot(std::vector<std::string>(plotLogs.begin(), plotLogs.end()), plotOutput);
  if (ckptCmd)
    return carve::runCkpt({std::vector<std::string>(ckptArgs.begin(), ckptArgs.end()), ckptOutput,
                           ckptWithOptimizer, ckptModel, ckptDtype});
  if (runCmd)
    return carve::runRun(runOut, runRanks,
                         std::vector<std::string>(runTrainArgs.begin(), runTrainArgs.end()));
  errs() << "carve: error: no subcommand given; try `carve --help`\n";
  return 1;
}
