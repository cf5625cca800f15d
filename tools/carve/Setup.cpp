//===- Setup.cpp - `carve compile`'s command line against the plan --------===//

#include "tools/carve/CompileSteps.h"

#include "tools/carve/Build.h"

#include "llvm/Support/FileSystem.h"

using namespace llvm;

namespace carve {

namespace {

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

} // namespace

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

} // namespace carve
