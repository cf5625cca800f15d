//===- Plan.cpp - parsing and checking plan files -------------------------===//

#include "compiler/plan/Plan.h"
#include "compiler/plan/JsonRead.h"

#include <nlohmann/json.hpp>

namespace carve {
namespace {

using json = nlohmann::json;

/// Reserved plan fields, their neutral values, and what they will mean.
struct Reserved {
  const char *name;
  json neutral;
  const char *meaning;
};

const std::vector<Reserved> &reserved() {
  static const std::vector<Reserved> r = {};
  return r;
}

const char *optimizerNumberFields[] = {
    "lr",  "momentum",       "dampening",    "weight_decay", "beta1",       "beta2",
    "eps", "clip_grad_norm", "warmup_steps", "decay_steps",  "min_lr_ratio"};

/// "cuts": op-name globs, one per pipeline stage boundary.
bool parseCuts(const json &v, const std::string &what, Plan &plan, std::string &error) {
  if (!v.is_array() || v.empty()) {
    error = what + ": \"cuts\" must be a non-empty list of op-name globs, one per stage "
                   "boundary, e.g. [\"/h.2/*\"]";
    return false;
  }
  for (const json &c : v) {
    if (!c.is_string() || c.get<std::string>().empty()) {
      error =
          what + ": \"cuts\" entries must be op-name globs (non-empty strings), got " + c.dump();
      return false;
    }
    plan.cuts.push_back(c.get<std::string>());
  }
  return true;
}

/// "ops": per-op tp splits by op-name glob.
bool parseOps(const json &v, const std::string &what, Plan &plan, std::string &error) {
  // {"GLOB": {"tp": "DIM"}} or {"GLOB": {"tp": "replicate"}} or {"GLOB": "replicate"}
  if (!v.is_object()) {
    error = what + ": \"ops\" must be an object mapping op-name globs to splits, e.g. "
                   "{\"/lm_head/MatMul\": {\"tp\": \"replicate\"}}";
    return false;
  }
  for (auto o = v.begin(); o != v.end(); ++o) {
    const json &e = o.value();
    std::string dim;
    if (e.is_string() && e.get<std::string>() == "replicate") {
      dim = "replicate";
    } else if (e.is_object() && e.size() == 1 && e.contains("tp") && e["tp"].is_string() &&
               !e["tp"].get<std::string>().empty()) {
      dim = e["tp"].get<std::string>();
    } else {
      error = what + ": \"ops\" entry \"" + o.key() + "\" must be \"replicate\" or " +
              "{\"tp\": \"DIM\"} (a dimension name of the op's annotation), got " + e.dump();
      return false;
    }
    if (o.key().empty()) {
      error = what + ": \"ops\" has an empty op-name glob";
      return false;
    }
    plan.ops.push_back({o.key(), dim});
  }
  return true;
}

/// "optimizer": the fields over the defaults (applyPlanOptimizer applies them).
bool parseOptimizer(const json &v, const std::string &what, Plan &plan, std::string &error) {
  if (!v.is_object()) {
    error = what + ": \"optimizer\" must be an object, e.g. {\"name\": \"adamw\", \"lr\": 3e-4}";
    return false;
  }
  for (auto o = v.begin(); o != v.end(); ++o) {
    const std::string &k = o.key();
    if (k == "name") {
      if (!o.value().is_string()) {
        error = what + ": optimizer \"name\" must be a string";
        return false;
      }
      plan.optimizerStrings["name"] = o.value().get<std::string>();
    } else if (k == "nesterov") {
      if (!o.value().is_boolean()) {
        error = what + ": optimizer \"nesterov\" must be true or false";
        return false;
      }
      plan.optimizerFlags["nesterov"] = o.value().get<bool>();
    } else if (std::find(std::begin(optimizerNumberFields), std::end(optimizerNumberFields), k) !=
               std::end(optimizerNumberFields)) {
      if (!o.value().is_number()) {
        error = what + ": optimizer \"" + k + "\" must be a number, got " + o.value().dump();
        return false;
      }
      const double x = o.value().get<double>();
      // Step counts become integers: whole numbers a step counter can reach.
      if ((k == "warmup_steps" || k == "decay_steps") &&
          !(x >= 0 && x <= 1e15 && x == (double)(int64_t)x)) {
        error = what + ": optimizer \"" + k +
                "\" must be a whole number of steps from 0 to "
                "1e15, got " +
                o.value().dump();
        return false;
      }
      plan.optimizerNumbers[k] = x;
    } else {
      error = what + ": unknown optimizer field \"" + k +
              "\" (known: name, lr, momentum, dampening, nesterov, weight_decay, beta1, "
              "beta2, eps, clip_grad_norm, warmup_steps, decay_steps, min_lr_ratio)";
      return false;
    }
  }
  return true;
}

/// A field this version does not carry out: reserved (refused unless it has
/// its neutral value) or unknown.
bool parseReservedField(const std::string &key, const json &v, const std::string &what,
                        std::string &error) {
  bool known = false;
  for (const Reserved &r : reserved()) {
    if (key != r.name)
      continue;
    known = true;
    if (!r.neutral.is_null() && v == r.neutral)
      break; // the neutral value asks for nothing
    error = what + ": \"" + key + "\": " + r.meaning +
            " is not implemented in this version of carve; remove the "
            "field or set it to " +
            (r.neutral.is_null() ? std::string("nothing") : r.neutral.dump());
    return false;
  }
  if (!known) {
    std::string names =
        "dp, tp, pp, ep, zero, sequence_parallel, sync_batch_norm, num_micro_batches, "
        "micro_batch_size, schedule, virtual_stages, cuts, ops, optimizer, precision, tf32, "
        "recompute, zero3_prefetch_layers, grad_accumulation, predicted, planner";
    for (const Reserved &r : reserved())
      names += std::string(", ") + r.name;
    error = what + ": unknown field \"" + key + "\" (plan fields: " + names + ")";
    return false;
  }
  return true;
}

/// What the fields mean together: each needs the axis it works on.
bool checkCombination(const Plan &plan, const std::string &what, std::string &error) {
  if (plan.sequenceParallel && plan.tp == 1) {
    error = what + ": \"sequence_parallel\" splits along the tp axis and needs \"tp\" > 1";
    return false;
  }
  if (plan.zero3PrefetchLayers > 0 && plan.zero != 3) {
    error = what + ": \"zero3_prefetch_layers\" starts ZeRO-3's parameter gathers early and "
                   "needs \"zero\": 3";
    return false;
  }
  if (plan.gradAccumulation == "16bit" && plan.precision == "fp32") {
    error = what + ": \"grad_accumulation\": \"16bit\" keeps gradients in the 16-bit format and "
                   "needs \"precision\" \"bf16\" or \"fp16\"";
    return false;
  }
  if (plan.ep > 1 && plan.dp % plan.ep != 0) {
    error = what + ": \"ep\" (" + std::to_string(plan.ep) + ") must divide \"dp\" (" +
            std::to_string(plan.dp) +
            "): each group of ep data-parallel ranks holds one copy of the experts, split among "
            "them";
    return false;
  }
  if (plan.ep > 1 && plan.zero > 0) {
    error = what + ": \"ep\" with \"zero\" " + std::to_string(plan.zero) +
            " is not implemented yet (expert parameters would be sharded over the ranks that "
            "hold the same experts); use \"zero\": 0 with ep";
    return false;
  }
  if (plan.schedule == "interleaved" && plan.pp == 1) {
    error = what + ": the interleaved schedule spreads virtual stages over pipeline ranks and "
                   "needs \"pp\" > 1";
    return false;
  }
  if (plan.virtualStages > 1 && !plan.schedule.empty() && plan.schedule != "interleaved") {
    error = what +
            ": \"virtual_stages\" applies to the interleaved schedule only (the plan "
            "asks for \"" +
            plan.schedule + "\")";
    return false;
  }
  if (plan.virtualStages > 1 && plan.pp == 1) {
    error = what + ": \"virtual_stages\" needs \"pp\" > 1";
    return false;
  }
  if (!plan.cuts.empty() && plan.pp == 1) {
    error = what + ": \"cuts\" places pipeline stage boundaries and needs \"pp\" > 1";
    return false;
  }
  return true;
}

/// One field of the plan object.
bool parseField(const std::string &key, const json &v, const std::string &what, Plan &plan,
                std::string &error) {
  if (key == "dp") {
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > 1 << 20) {
      error = what + ": \"dp\" must be a positive integer, got " + v.dump();
      return false;
    }
    plan.dp = (int)v.get<int64_t>();
    return true;
  }
  if (key == "ep") {
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > 1 << 16) {
      error = what +
              ": \"ep\" must be a positive integer (the ranks each mixture-of-experts "
              "layer's experts are split over), got " +
              v.dump();
      return false;
    }
    plan.ep = (int)v.get<int64_t>();
    return true;
  }
  if (key == "tp") {
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > 1 << 16) {
      error = what + ": \"tp\" must be a positive integer, got " + v.dump();
      return false;
    }
    plan.tp = (int)v.get<int64_t>();
    return true;
  }
  if (key == "zero3_prefetch_layers") {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 1 << 16) {
      error = what +
              ": \"zero3_prefetch_layers\" must be an integer >= 0 (the layers whose "
              "ZeRO-3 gathers start ahead of their use), got " +
              v.dump();
      return false;
    }
    plan.zero3PrefetchLayers = (int)v.get<int64_t>();
    return true;
  }
  if (key == "zero") {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 3) {
      error = what + ": \"zero\" must be 0, 1, 2 or 3 (the ZeRO stage), got " + v.dump();
      return false;
    }
    plan.zero = (int)v.get<int64_t>();
    return true;
  }
  if (key == "pp" || key == "num_micro_batches" || key == "virtual_stages" ||
      key == "micro_batch_size") {
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > 1 << 20) {
      error = what + ": \"" + key + "\" must be a positive integer, got " + v.dump();
      return false;
    }
    int64_t n = v.get<int64_t>();
    if (key == "pp")
      plan.pp = (int)n;
    else if (key == "num_micro_batches")
      plan.numMicroBatches = (int)n;
    else if (key == "virtual_stages")
      plan.virtualStages = (int)n;
    else
      plan.microBatchSize = n;
    return true;
  }
  if (key == "schedule") {
    static const char *known[] = {"gpipe", "1f1b", "interleaved"};
    if (!v.is_string() ||
        std::find(std::begin(known), std::end(known), v.get<std::string>()) == std::end(known)) {
      error = what + ": unknown pipeline schedule " + v.dump() +
              " (known: \"gpipe\", \"1f1b\", \"interleaved\")";
      return false;
    }
    plan.schedule = v.get<std::string>();
    return true;
  }
  if (key == "cuts") {
    return parseCuts(v, what, plan, error);
  }
  if (key == "recompute") {
    // "none", "selective", "full", or layer globs for full on those layers.
    if (v.is_string() && (v == "none" || v == "selective" || v == "full")) {
      plan.recompute = v.get<std::string>();
      return true;
    }
    if (v.is_array() && !v.empty() && std::all_of(v.begin(), v.end(), [](const json &e) {
          return e.is_string() && !e.get<std::string>().empty();
        })) {
      plan.recompute = "full";
      for (const json &e : v)
        plan.recomputeLayers.push_back(e.get<std::string>());
      return true;
    }
    error = what +
            ": \"recompute\" must be \"none\", \"selective\", \"full\" or a list of "
            "layer globs (full recomputation of those layers, e.g. [\"h.*\"]), got " +
            v.dump();
    return false;
  }
  if (key == "sequence_parallel") {
    if (!v.is_boolean()) {
      error = what + ": \"sequence_parallel\" must be true or false, got " + v.dump();
      return false;
    }
    plan.sequenceParallel = v.get<bool>();
    return true;
  }
  if (key == "tf32") {
    if (!v.is_boolean()) {
      error = what +
              ": \"tf32\" must be true or false (fp32 matmuls through TF32 tensor cores "
              "on the CUDA target), got " +
              v.dump();
      return false;
    }
    plan.tf32 = v.get<bool>();
    return true;
  }
  if (key == "sync_batch_norm") {
    if (!v.is_boolean()) {
      error = what + ": \"sync_batch_norm\" must be true or false, got " + v.dump();
      return false;
    }
    plan.syncBatchNorm = v.get<bool>();
    return true;
  }
  if (key == "ops") {
    return parseOps(v, what, plan, error);
  }
  if (key == "optimizer") {
    return parseOptimizer(v, what, plan, error);
  }
  if (key == "predicted" || key == "planner") {
    // What `carve plan` predicted and how it chose: informational.
    if (!v.is_object()) {
      error = what + ": \"" + key + "\" must be an object (written by carve plan)";
      return false;
    }
    return true;
  }
  if (key == "grad_accumulation") {
    if (!v.is_string() || (v != "fp32" && v != "16bit")) {
      error = what + ": \"grad_accumulation\" must be \"fp32\" or \"16bit\" (where gradients " +
              "accumulate over micro-batches under bf16/fp16), got " + v.dump();
      return false;
    }
    plan.gradAccumulation = v.get<std::string>();
    return true;
  }
  if (key == "precision") {
    if (!v.is_string() || (v != "fp32" && v != "bf16" && v != "fp16")) {
      error = what + ": \"precision\" must be \"fp32\", \"bf16\" or \"fp16\", got " + v.dump();
      return false;
    }
    plan.precision = v.get<std::string>();
    return true;
  }
  return parseReservedField(key, v, what, error);
}

} // namespace

bool parsePlan(const std::string &text, const std::string &what, Plan &plan, std::string &error) {
  json j;
  std::string cause;
  if (!parseBoundedJson(text, j, cause)) {
    error = what + ": " + cause;
    return false;
  }
  if (!j.is_object()) {
    error = what + ": a plan is a JSON object, e.g. {\"dp\": 4}";
    return false;
  }
  for (auto it = j.begin(); it != j.end(); ++it)
    if (!parseField(it.key(), it.value(), what, plan, error))
      return false;
  if (!checkCombination(plan, what, error))
    return false;
  // ZeRO over one replica shards nothing: the degenerate case (ZeRO's own
  // Table 1 lists N_d = 1), compiled as the plan without ZeRO.
  if (plan.zero > 0 && plan.dp == 1)
    plan.zero = 0;
  plan.json = j.dump();
  return true;
}

bool applyPlanOptimizer(const Plan &plan, OptimizerConfig &opt, std::string &error) {
  auto it = plan.optimizerStrings.find("name");
  if (it != plan.optimizerStrings.end())
    opt.kind = it->second;
  for (const auto &[k, v] : plan.optimizerNumbers) {
    if (k == "lr")
      opt.lr = v;
    else if (k == "momentum")
      opt.momentum = v;
    else if (k == "dampening")
      opt.dampening = v;
    else if (k == "weight_decay")
      opt.weightDecay = v;
    else if (k == "beta1")
      opt.beta1 = v;
    else if (k == "beta2")
      opt.beta2 = v;
    else if (k == "eps")
      opt.eps = v;
    else if (k == "clip_grad_norm")
      opt.clipGradNorm = v;
    else if (k == "warmup_steps")
      opt.warmupSteps = (int64_t)v;
    else if (k == "decay_steps")
      opt.decaySteps = (int64_t)v;
    else if (k == "min_lr_ratio")
      opt.minLrRatio = v;
  }
  auto n = plan.optimizerFlags.find("nesterov");
  if (n != plan.optimizerFlags.end())
    opt.nesterov = n->second;
  return validateOptimizer(opt, error);
}

bool validateOptimizer(const OptimizerConfig &o, std::string &error) {
  auto bad = [&](const std::string &m) {
    error = m;
    return false;
  };
  if (o.kind != "adamw" && o.kind != "sgd")
    return bad("unknown optimizer '" + o.kind + "' (known: adamw, sgd)");
  if (!(o.lr > 0))
    return bad("the learning rate must be positive");
  if (o.kind == "adamw" && !(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1))
    return bad("AdamW betas must be in [0, 1)");
  if (o.kind == "adamw" && !(o.eps > 0))
    return bad("AdamW eps must be positive");
  if (o.momentum < 0 || o.dampening < 0)
    return bad("momentum and dampening must not be negative");
  if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
    return bad("Nesterov momentum requires a momentum and zero dampening (as in PyTorch)");
  if (o.weightDecay < 0 && o.weightDecay != -1)
    return bad("weight decay must not be negative");
  if (o.clipGradNorm < 0)
    return bad("--clip-grad-norm must not be negative");
  if (o.warmupSteps < 0 || o.decaySteps < 0)
    return bad("warm-up and decay steps must not be negative");
  if (o.minLrRatio < 0 || o.minLrRatio > 1)
    return bad("--min-lr-ratio must be in [0, 1]");
  return true;
}

} // namespace carve
