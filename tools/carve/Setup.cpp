//===- Setup.cpp - `carve compile`'s command line against the plan --------===//

#include "tools/carve/CompileSteps.h"

#include "tools/carve/Build.h"

#include "llvm/Support/FileSystem.h"

#include <nlohmann/json.hpp>

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

/// The global batch `carve plan` planned for (the plan's "planner" record),
/// or 0.
int64_t plannedGlobalBatch(const std::string &planText) {
  try {
    auto j = nlohmann::json::parse(planText);
    auto p = j.find("planner");
    if (p == j.end() || !p->is_object())
      return 0;
    auto b = p->find("global_batch");
    return b != p->end() && b->is_number_integer() ? b->get<int64_t>() : 0;
  } catch (const nlohmann::json::exception &) {
    return 0; // parsePlan reports what is wrong with the file
  }
}

/// A builtin model spec without `batch=` compiles at the global batch the
/// plan was planned for (`carve plan builtin:... -o PLAN.json` then
/// `carve compile builtin:... --plan PLAN.json`), as the report said.
void takePlannedBatch(CompileArgs &args, const std::string &planText) {
  if (args.model.rfind("builtin:", 0) != 0)
    return;
  if (args.model.find(",batch=") != std::string::npos ||
      args.model.find(":batch=") != std::string::npos)
    return;
  if (int64_t b = plannedGlobalBatch(planText); b > 0)
    args.model += ",batch=" + std::to_string(b);
}

} // namespace

Setup resolve(CompileArgs &args) {
  Setup s;
  std::string error;
  if (!args.planText.empty()) { // --auto: the planner's choice
    if (!parsePlan(args.planText, args.planPath, s.plan, error))
      die(error);
    takePlannedBatch(args, args.planText);
  } else if (!args.planPath.empty()) {
    std::string text = readFileOrDie(args.planPath, "a plan (JSON)");
    if (!parsePlan(text, args.planPath, s.plan, error))
      die(error);
    takePlannedBatch(args, text);
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
  if (!args.memoryOnly)
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
