//===- PlanCmd.cpp - `carve plan` and `carve compile --auto` --------------===//
//
// Loads the model once at one sample, profiles it under each tp (and
// sequence parallelism) the search asks for, searches, and prints a report a
// person reads in a minute. docs/planner.md.
//
//===----------------------------------------------------------------------===//

#include "tools/carve/PlanCmd.h"

#include "compiler/frontend/Builtin.h"
#include "compiler/planner/OpSearch.h"
#include "compiler/planner/Planner.h"
#include "dialects/carve/CarveOps.h"
#include "tools/carve/Compile.h"

#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <sstream>
#include <thread>

namespace carve {

using json = nlohmann::json;
using namespace planner;

namespace {

std::string readFile(const std::string &path, const char *what) {
  auto buf = llvm::MemoryBuffer::getFile(path);
  if (!buf)
    die(std::string(what) + " " + path + ": " + buf.getError().message());
  return (*buf)->getBuffer().str();
}

/// `v` in the first unit it reaches: {threshold, printf format}, largest first.
std::string scaled(double v, std::initializer_list<std::pair<double, const char *>> units) {
  const auto *u = units.begin();
  while (u + 1 != units.end() && v < u->first)
    ++u;
  char s[32];
  snprintf(s, sizeof s, u->second, v / u->first);
  return s;
}

std::string gb(double bytes) {
  return scaled(bytes, {{1e12, "%.2f TB"}, {1e9, "%.2f GB"}, {1e6, "%.1f MB"}, {1e3, "%.0f kB"}});
}

std::string count(double n) {
  return scaled(n, {{1e12, "%.2fT"}, {1e9, "%.1fB"}, {1e6, "%.1fM"}, {1e3, "%.1fk"}, {1, "%.0f"}});
}

std::string secs(double t) { return formatSeconds(t); }

/// The plan-file fields of a candidate (what `carve compile` reads).
json planFields(const Candidate &c, const std::vector<OpOverride> &pins = {}) {
  json p = json::object();
  p["dp"] = c.dp;
  p["tp"] = c.tp;
  p["pp"] = c.pp;
  if (c.ep > 1)
    p["ep"] = c.ep;
  if (c.zero)
    p["zero"] = c.zero;
  if (c.zero == 3) // the planner prices ZeRO-3 with one layer's gathers prefetched
    p["zero3_prefetch_layers"] = 1;
  if (c.sp)
    p["sequence_parallel"] = true;
  if (c.m > 1)
    p["num_micro_batches"] = c.m;
  if (c.pp > 1) {
    p["schedule"] = c.schedule;
    if (c.v > 1)
      p["virtual_stages"] = c.v;
  }
  if (c.recompute != "none")
    p["recompute"] = c.recompute;
  if (c.precision != "fp32")
    p["precision"] = c.precision;
  if (c.gradAccumulation != "fp32")
    p["grad_accumulation"] = c.gradAccumulation;
  if (c.syncBatchNorm)
    p["sync_batch_norm"] = true;
  if (c.tf32)
    p["tf32"] = true;
  if (c.tp > 1 && !pins.empty()) {
    json ops = json::object();
    for (const OpOverride &o : pins)
      ops[o.glob] = o.dim == "replicate" ? json("replicate") : json{{"tp", o.dim}};
    p["ops"] = ops;
  }
  return p;
}

json predicted(const Estimate &e) {
  json p;
  p["step_time_s"] = e.time.total;
  p["tokens_per_s"] = e.tokensPerSecond;
  p["tflops_per_device"] = e.tflopsPerDevice;
  p["mfu"] = e.mfu;
  p["bubble_fraction"] = e.bubbleFraction;
  p["micro_batch_size"] = e.c.microBatch;
  p["fits"] = e.fits;
  p["memory_per_device"] = {{"params", e.mem.params},       {"grads", e.mem.grads},
                            {"optimizer", e.mem.optimizer}, {"activations", e.mem.activations},
                            {"buffers", e.mem.buffers},     {"workspace", e.mem.workspace},
                            {"total", e.mem.total()},       {"capacity", e.capacity},
                            {"pipeline_rank", e.memRank}};
  json ranks = json::array();
  for (const Memory &m : e.memPerRank)
    ranks.push_back({{"params", m.params},
                     {"grads", m.grads},
                     {"optimizer", m.optimizer},
                     {"activations", m.activations},
                     {"buffers", m.buffers},
                     {"workspace", m.workspace},
                     {"total", m.total()}});
  p["memory_per_pipeline_rank"] = ranks;
  p["time_s"] = {{"compute", e.time.compute},      {"recompute", e.time.recompute},
                 {"tp_comm", e.time.tpComm},       {"p2p", e.time.p2p},
                 {"bubble", e.time.bubble},        {"dp_comm", e.time.dpComm},
                 {"dp_exposed", e.time.dpExposed}, {"optimizer", e.time.optimizer}};
  if (e.c.ep > 1)
    p["time_s"]["ep_comm"] = e.time.epComm;
  json vol;
  for (int k = 0; k < kNumCommKinds; ++k)
    vol[std::string("tp_") + commKindName(k)] = e.volume.tp[k];
  vol["dp_gradients"] = e.volume.dp;
  vol["pp_sends"] = e.volume.pp;
  if (e.c.ep > 1)
    vol["ep_all_to_all"] = e.volume.ep;
  p["communication_bytes_per_device"] = vol;
  p["layers_per_stage"] = e.layersPerStage;
  return p;
}

/// Everything a search needs, loaded once.
struct Session {
  /// One thread: the profiles' IR is small (a builtin model's three layers),
  /// and worker threads cost more than they save on it.
  mlir::MLIRContext context{mlir::MLIRContext::Threading::DISABLED};
  ProfileRequest req;
  ProfileModel model;
  /// A CUDA cluster's model with its convolutions whole (cuDNN's, at tp =
  /// 1: what carve compile runs there); null where it has none or the
  /// cluster is not CUDA's.
  std::unique_ptr<ProfileModel> whole;
  std::map<std::pair<int, bool>, std::unique_ptr<Profile>> cache;
  std::map<std::pair<int, bool>, std::string> errors;
  int built = 0;

  const Profile *get(int tp, bool sp, std::string &error) {
    auto key = std::make_pair(tp, sp);
    auto it = cache.find(key);
    if (it != cache.end()) {
      if (!it->second)
        error = errors[key];
      return it->second.get();
    }
    ProfileRequest r = req;
    r.tp = tp;
    r.sequenceParallel = sp;
    auto p = std::make_unique<Profile>();
    std::string why;
    ++built;
    const ProfileModel &m = tp == 1 && whole ? *whole : model;
    if (!buildProfile(m, r, *p, why)) {
      errors[key] = why;
      error = why;
      cache[key] = nullptr;
      return nullptr;
    }
    return (cache[key] = std::move(p)).get();
  }
};

struct Outcome {
  Cluster cluster;
  PlannerOptions opts;
  SearchResult result;
  const Profile *base = nullptr;
  double seconds = 0;
  OpSearchResult ops; // per-op choices for the best plan
  double opSeconds = 0;
  /// Loading the model and its 1-rank profile; the as-compiled check.
  double setupSeconds = 0, compileSeconds = 0;
  /// The chosen plan as compiled, per pipeline rank (empty: not checked,
  /// and why in `compiledWhy`), and a note when the model's first choice
  /// did not fit as compiled.
  std::vector<CompiledRankMemory> compiled;
  std::string compiledWhy, compiledNote;
  /// The layer counts the check compiled and extrapolated from
  /// (compiledMemoryByLayers); empty: the whole model.
  std::vector<int64_t> compiledLayers;
  /// --calibration carve: the GPU the chosen plan's CUDA program is priced
  /// on, and that program's cost model (docs/gpu-model.md).
  const GpuSpec *gpu = nullptr;
  GpuStep gpuStep;
  bool gpuPriced = false;
  std::string gpuWhy; // why the program was not priced
  /// The best plan's pins: the user's, then those the per-op search chose.
  std::vector<OpOverride> bestPins() const {
    std::vector<OpOverride> p = opts.constraints.pins;
    p.insert(p.end(), ops.pins.begin(), ops.pins.end());
    return p;
  }
};

/// --calibration carve: carve's own CUDA programs, priced by the GPU cost model
/// from the figures measured on carve's GPU runs. Those were one H100 or one
/// H200; the model prices one GPU's kernels, not collectives.
const GpuSpec *carveCalibrationGpu(const PlanArgs &args, const Cluster &c) {
  const std::string why = "--calibration carve prices carve's own CUDA program on one H100 or "
                          "H200 (docs/gpu-model.md): ";
  const GpuSpec *g = nullptr;
  for (const GpuSpec &spec : gpuSpecs())
    if (llvm::StringRef(c.device.name).contains_insensitive(spec.name))
      g = &spec;
  if (!g || c.device.target != "cuda")
    die(why + "this cluster's devices are " + c.device.name);
  if (c.worldSize() != 1)
    die(why + "this cluster has " + std::to_string(c.worldSize()) +
        " devices, and the model does not price collectives yet (use --cluster " +
        std::string(g->name == std::string("h100") ? "h100-80gb" : "h200-141gb") + ":1x1)");
  if (!args.compileCheck)
    die(why + "it prices the compiled program, which --no-compile-check skips");
  if (args.publishedStorage)
    die(why + "--storage published is not what carve compiles");
  return g;
}

void setup(const PlanArgs &args, Session &s, Outcome &o) {
  auto t0 = std::chrono::steady_clock::now();
  std::string error;
  if (args.cluster.empty())
    die("carve plan: --cluster is required (a preset like a100-80gb:16x8, a JSON file, or "
        "cpu)");
  if (!parseCluster(args.cluster, o.cluster, error))
    die(error);
  for (const std::string &f : args.fixed)
    if (!parseFixed(f, o.opts.constraints, error))
      die(error);
  if (!args.constraintsPath.empty() &&
      !parseConstraints(readFile(args.constraintsPath, "constraints"), args.constraintsPath,
                        o.opts.constraints, error))
    die(error);
  if (args.calibrationPath == "carve")
    o.gpu = carveCalibrationGpu(args, o.cluster);
  else if (!args.calibrationPath.empty() &&
           !parseCalibration(readFile(args.calibrationPath, "calibration"), args.calibrationPath,
                             o.opts.calibration, error))
    die(error);
  o.opts.publishedStorage = args.publishedStorage;
  s.req.model = args.model;
  s.req.import = args.import;
  s.req.loss = args.loss;
  s.req.pins = o.opts.constraints.pins;
  if (!loadProfileModel(s.context, s.req, s.model, error))
    die(error.rfind(args.model, 0) == 0 ? error : args.model + ": " + error);
  // On a CUDA cluster carve compile runs the convolutions whole, as cuDNN's,
  // where tp = 1 (--convolution cudnn, the default): the profile of those
  // plans is of that program.
  if (o.cluster.device.target == "cuda" && args.convolution == "cudnn") {
    ProfileRequest whole = s.req;
    whole.convolutionsWhole = true;
    auto m = std::make_unique<ProfileModel>();
    if (!loadProfileModel(s.context, whole, *m, error))
      die(error.rfind(args.model, 0) == 0 ? error : args.model + ": " + error);
    bool any = false;
    m->module->walk([&](Conv2dOp) { any = true; });
    if (any)
      s.whole = std::move(m);
  }
  o.base = s.get(1, false, error);
  if (!o.base)
    die(args.model + ": " + error);
  o.opts.globalBatch = args.globalBatch > 0 ? args.globalBatch : s.model.modelBatch;
  o.setupSeconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void search(Session &s, Outcome &o) {
  auto t0 = std::chrono::steady_clock::now();
  o.result = searchPlans(
      *o.base, [&](int tp, bool sp, std::string &e) { return s.get(tp, sp, e); }, o.cluster,
      o.opts);
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Revisits the best plan's per-op choices (OpSearch.h); a faster result
/// replaces the best plan's estimate and adds its pins to the plan.
void searchOps(Session &s, Outcome &o) {
  auto t0 = std::chrono::steady_clock::now();
  Estimate &best = o.result.ranked[0];
  std::string error;
  const Profile *prof = s.get(best.c.tp, best.c.sp, error);
  if (!prof)
    return;
  // Worker 0 prices on the session's model; each other worker on its own
  // copy in a context of its own (the op search runs under tp > 1 only).
  OpSearchOptions so;
  struct Worker {
    std::unique_ptr<mlir::MLIRContext> context;
    ProfileModel model;
  };
  std::vector<Worker> workers(1);
  const int cores = (int)std::clamp(std::thread::hardware_concurrency(), 1u, 4u);
  for (int w = 1; w < cores && best.c.tp > 1; ++w) {
    Worker k;
    k.context = std::make_unique<mlir::MLIRContext>(mlir::MLIRContext::Threading::DISABLED);
    if (!loadProfileModel(*k.context, s.req, k.model, error))
      break; // (loaded once already: not expected) fewer workers, same result
    workers.push_back(std::move(k));
  }
  so.workers = (int)workers.size();
  PinnedProfile build = [&](int w, const std::vector<OpOverride> &extra, Profile &out,
                            std::string &why) {
    mlir::MLIRContext *context = w > 0 ? workers[w].context.get() : &s.context;
    const ProfileModel *model = w > 0 ? &workers[w].model : &s.model;
    ProfileRequest r = s.req;
    r.tp = best.c.tp;
    r.sequenceParallel = best.c.sp;
    r.pins.insert(r.pins.end(), extra.begin(), extra.end());
    // A choice the partitioner cannot carry out is priced out, not printed.
    std::string diag;
    mlir::ScopedDiagnosticHandler quiet(context, [&](mlir::Diagnostic &d) {
      if (diag.empty())
        diag = d.str();
      return mlir::success();
    });
    bool ok = buildProfile(*model, r, out, why);
    if (!ok && why.empty())
      why = diag;
    return ok;
  };
  o.ops = searchOpChoices(*prof, *o.base, o.cluster, best.c, o.opts, build, so);
  if (!o.ops.pins.empty())
    best = o.ops.after;
  o.opSeconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// When nothing fits: the smallest cluster (more nodes of the same kind) that would.
std::string wouldFit(Session &s, const Outcome &o) {
  for (int k = 2; k <= 1024; k *= 2) {
    Outcome bigger;
    bigger.cluster = o.cluster;
    bigger.cluster.nodes = o.cluster.nodes * k;
    bigger.opts = o.opts;
    bigger.base = o.base;
    search(s, bigger);
    if (bigger.result.anyFits) {
      const Estimate &e = bigger.result.ranked[0];
      return "it would fit on " + std::to_string(bigger.cluster.nodes) + " nodes (" +
             std::to_string(bigger.cluster.worldSize()) + " devices): " + e.c.key() + ", " +
             gb(e.mem.total()) + " per device";
    }
  }
  return "";
}

void bar(std::ostream &os, const char *name, double bytes, double capacity) {
  const int width = 40;
  int n = capacity > 0 ? (int)std::lround(std::min(1.0, bytes / capacity) * width) : 0;
  if (bytes > 0 && n == 0)
    n = 1;
  char line[128];
  snprintf(line, sizeof line, "  %-12s %-40s %10s", name, std::string(n, '#').c_str(),
           gb(bytes).c_str());
  os << line << "\n";
}

/// `tokens`: the model reads token ids (throughput in tokens), else samples.
void printEstimate(std::ostream &os, const Estimate &e, const Cluster &cl, bool tokens) {
  const StepTime &t = e.time;
  char line[256];
  os << "  step time       " << secs(t.total) << "\n";
  os << "    compute " << secs(t.compute - t.recompute) << ", recompute " << secs(t.recompute)
     << ", tp communication " << secs(t.tpComm) << ", pipeline sends " << secs(t.p2p) << ", bubble "
     << secs(t.bubble) << ",\n    gradient reduction " << secs(t.dpExposed) << " exposed of "
     << secs(t.dpComm) << ", optimizer " << secs(t.optimizer) << "\n";
  if (e.c.ep > 1)
    os << "    expert all-to-alls " << secs(t.epComm) << " (ep=" << e.c.ep << ")\n";
  snprintf(line, sizeof line, "  throughput      %s %s/s\n", count(e.tokensPerSecond).c_str(),
           tokens ? "tokens" : "samples");
  os << line;
  const double peak = cl.peak(e.c.precision);
  const bool tera = peak >= 1e12;
  snprintf(line, sizeof line, "  per device      %.1f %s, MFU %.1f%% of %.1f %s %s\n",
           tera ? e.tflopsPerDevice : e.tflopsPerDevice * 1e3, tera ? "TFLOP/s" : "GFLOP/s",
           e.mfu * 100, tera ? peak / 1e12 : peak / 1e9, tera ? "TFLOP/s" : "GFLOP/s",
           e.c.precision.c_str());
  os << line;
  if (e.c.pp > 1 || e.c.m > 1) {
    snprintf(line, sizeof line, "  bubble          %.1f%% (pp=%d, v=%d, m=%lld)\n",
             e.bubbleFraction * 100, e.c.pp, e.c.v, (long long)e.c.m);
    os << line;
    os << "  layers/stage    ";
    for (size_t i = 0; i < e.layersPerStage.size() && i < 16; ++i)
      os << (i ? " " : "") << e.layersPerStage[i];
    if (e.layersPerStage.size() > 16)
      os << " ...";
    os << "\n";
  }
  os << "\nMemory per device (pipeline rank " << e.memRank << " of " << e.c.pp << ", "
     << gb(e.capacity) << " usable)\n";
  bar(os, "parameters", e.mem.params, e.capacity);
  bar(os, "gradients", e.mem.grads, e.capacity);
  bar(os, "optimizer", e.mem.optimizer, e.capacity);
  bar(os, "activations", e.mem.activations, e.capacity);
  bar(os, "buffers", e.mem.buffers, e.capacity);
  bar(os, "workspace", e.mem.workspace, e.capacity);
  if (e.fits)
    bar(os, "free", e.capacity - e.mem.total(), e.capacity);
  snprintf(line, sizeof line, "  %-53s %10s of %s%s\n", "total", gb(e.mem.total()).c_str(),
           gb(e.capacity).c_str(), e.fits ? "" : "  DOES NOT FIT");
  os << line;
  os << "\nCommunication per device per step\n";
  for (int k = 0; k < kNumCommKinds; ++k)
    if (e.volume.tp[k] > 0)
      os << "  tp " << commKindName(k) << ": " << gb(e.volume.tp[k]) << "\n";
  if (e.volume.dp > 0)
    os << "  dp gradient reduction" << (e.c.zero ? " (ZeRO: reduce-scatter + all-gather)" : "")
       << ": " << gb(e.volume.dp) << "\n";
  if (e.volume.pp > 0)
    os << "  pipeline sends: " << gb(e.volume.pp) << "\n";
  if (e.c.dp == 1 && e.c.tp == 1 && e.c.pp == 1)
    os << "  none (one device)\n";
}

std::string modelLine(const PlanArgs &args, const Outcome &o, const Session &s) {
  std::ostringstream os;
  os << (isBuiltinModel(args.model) ? args.model : llvm::sys::path::filename(args.model).str())
     << ": " << count(o.base->totalParams) << " parameters, "
     << (s.model.builtinLayers ? s.model.builtinLayers : (int)o.base->layers.size()) << " layers";
  if (o.base->seq > 0)
    os << ", " << o.base->seq << " tokens per sample";
  return os.str();
}

json opChoicesJson(const Outcome &o) {
  const OpSearchResult &r = o.ops;
  json j = {{"searched", r.ran}, {"seconds", o.opSeconds}};
  if (!r.ran) {
    j["why_not"] = r.skippedWhy;
    return j;
  }
  j["groups"] = r.groups;
  j["partitions_priced"] = r.priced;
  j["budget_hit"] = r.budgetHit;
  j["method"] = r.method.empty() ? "none" : r.method;
  j["changes"] = r.changes;
  j["step_time_before_s"] = r.before.time.total;
  j["step_time_after_s"] = r.after.time.total;
  return j;
}

/// The per-op search's lines of the report.
void printOpChoices(std::ostream &os, const Outcome &o) {
  const OpSearchResult &r = o.ops;
  if (!r.ran) {
    if (!r.skippedWhy.empty())
      os << "\nPer-op choices: not searched (" << r.skippedWhy << ")\n";
    return;
  }
  os << "\nPer-op choices: " << r.groups << " op groups, " << r.priced << " partitions priced"
     << (r.method == "dp"    ? ", chains solved by dynamic programming"
         : r.method == "ilp" ? ", solved as an integer program (CBC)"
                             : "")
     << (r.budgetHit ? ", budget reached" : "") << " (" << secs(o.opSeconds) << ")\n";
  if (r.changes.empty()) {
    os << "  the partitioner's choices are the fastest found\n";
    return;
  }
  for (const std::string &c : r.changes)
    os << "  pinned " << c << "\n";
  char line[160];
  snprintf(line, sizeof line, "  step time %s -> %s (%.1f%% faster)\n",
           secs(r.before.time.total).c_str(), secs(r.after.time.total).c_str(),
           100.0 * (1 - r.after.time.total / r.before.time.total));
  os << line;
}

json compiledJson(const Outcome &o);

/// Which calibration priced the step times: the default is built from
/// published kernels' efficiencies, not from carve's own measured programs.
std::string calibrationLine(const PlanArgs &args) {
  if (args.calibrationPath == "carve")
    return "times priced with carve's own programs: the search ranks plans with the default "
           "calibration, then the chosen plan's compiled CUDA step is priced by the GPU cost "
           "model, from carve's measured GPU runs (below; docs/gpu-model.md)";
  if (!args.calibrationPath.empty())
    return "times priced with the calibration " + args.calibrationPath;
  return "times priced with the default calibration: published kernels' efficiencies (an "
         "A100's GEMMs by shape, 80% of memory bandwidth, 85% of link bandwidth), not carve's "
         "own measured programs";
}

json reportJson(const PlanArgs &args, const Outcome &o, const Session &s) {
  json j;
  j["model"] = args.model;
  j["parameters"] = o.base->totalParams;
  j["cluster"] = {{"spec", args.cluster},
                  {"devices", o.cluster.worldSize()},
                  {"device", o.cluster.device.name}};
  j["global_batch"] = o.opts.globalBatch;
  j["storage"] = args.publishedStorage ? "published" : "carve";
  j["calibration"] = args.calibrationPath.empty() ? "default" : args.calibrationPath;
  if (o.gpu) {
    json c = {{"gpu", o.gpu->name}, {"device", o.gpu->device}};
    if (o.gpuPriced) {
      GpuPrediction p = predictGpuStep(o.gpuStep, *o.gpu);
      c["step_ms"] = p.totalMs();
      c["launches"] = p.totalLaunches();
      json classes = json::object();
      for (int k = 0; k < kGpuClasses; ++k)
        classes[gpuClassName(static_cast<GpuClass>(k))] = {{"ms", p.ms[k]},
                                                           {"launches", p.launches[k]}};
      c["classes"] = classes;
    } else {
      c["not_priced"] = o.gpuWhy.empty() ? o.compiledWhy : o.gpuWhy;
    }
    j["carve_program"] = c;
  }
  j["searched"] = o.result.evaluated;
  j["search_seconds"] = o.seconds;
  j["phase_seconds"] = {{"setup", o.setupSeconds},
                        {"search", o.seconds},
                        {"op_search", o.opSeconds},
                        {"compile_check", o.compileSeconds}};
  j["profiles_built"] = s.built;
  j["fits"] = o.result.anyFits;
  if (o.result.anyFits) {
    j["plan"] = planFields(o.result.ranked[0].c, o.bestPins());
    j["predicted"] = predicted(o.result.ranked[0]);
    if (!o.compiled.empty())
      j["predicted"]["memory_compiled_per_pipeline_rank"] = compiledJson(o);
    if (!o.compiled.empty())
      j["compiled_from_layers"] = o.compiledLayers;
    else
      j["compiled_not_checked"] = o.compiledWhy;
    if (!o.compiledNote.empty())
      j["compiled_note"] = o.compiledNote;
    j["op_choices"] = opChoicesJson(o);
    json alts = json::array();
    for (size_t i = 1; i < o.result.ranked.size(); ++i)
      alts.push_back({{"plan", planFields(o.result.ranked[i].c, o.opts.constraints.pins)},
                      {"predicted", predicted(o.result.ranked[i])},
                      {"why_not", o.result.lostWhy[i - 1]}});
    j["alternatives"] = alts;
  } else if (o.result.evaluated > 0) {
    j["closest"] = {{"plan", planFields(o.result.closest.c, o.opts.constraints.pins)},
                    {"predicted", predicted(o.result.closest)}};
  }
  if (!o.result.skipped.empty())
    j["skipped"] = o.result.skipped;
  return j;
}

json planFile(const Estimate &e, const PlanArgs &args, const Outcome &o,
              const std::vector<OpOverride> &pins) {
  json p = planFields(e.c, pins);
  p["predicted"] = predicted(e);
  if (!o.compiled.empty())
    p["predicted"]["memory_compiled_per_pipeline_rank"] = compiledJson(o);
  p["planner"] = {{"model", args.model},
                  {"cluster", args.cluster},
                  {"global_batch", o.opts.globalBatch},
                  {"micro_batch_size", e.c.microBatch}};
  if (args.publishedStorage)
    p["planner"]["storage"] = "published";
  return p;
}

void writeFile(const std::string &path, const std::string &text) {
  std::string tmp = path + ".tmp";
  {
    std::error_code ec;
    llvm::raw_fd_ostream os(tmp, ec);
    if (ec)
      die(path + ": cannot write: " + ec.message());
    os << text;
    os.close();
    if (os.has_error()) {
      llvm::sys::fs::remove(tmp);
      die(path + ": cannot write: " + os.error().message());
    }
  }
  if (std::error_code ec = llvm::sys::fs::rename(tmp, path)) {
    llvm::sys::fs::remove(tmp);
    die(path + ": cannot write: " + ec.message());
  }
}

/// Why no plan was even tried: the device count cannot be used.
std::string unusable(const Outcome &o) {
  std::string s = "no plan uses the " + std::to_string(o.cluster.worldSize()) + " devices of " +
                  o.cluster.name + " with a global batch of " + std::to_string(o.opts.globalBatch) +
                  ": dp x tp x pp must equal the device count, dp must divide the batch, tp must "
                  "stay inside a node (" +
                  std::to_string(o.cluster.devicesPerNode) +
                  " devices) and divide what it splits, and pp at most the layers";
  if (!o.result.skipped.empty()) {
    s += " (";
    for (size_t i = 0; i < o.result.skipped.size() && i < 3; ++i)
      s += (i ? "; " : "") + o.result.skipped[i];
    s += ")";
  }
  return s;
}

/// Loads, profiles and searches; dies (naming `who`) on contradicting
/// constraints or a device count no plan can use.
double largestArena(const std::vector<CompiledRankMemory> &ranks) {
  int64_t a = 0;
  for (const CompiledRankMemory &r : ranks)
    a = std::max(a, r.arena);
  return (double)a;
}

/// The plan compiled to its memory plan (carve compile without the build).
std::vector<CompiledRankMemory> compilePlan(const PlanArgs &args, Outcome &o, const Estimate &e,
                                            const std::vector<OpOverride> &pins,
                                            std::vector<int64_t> &layers) {
  CompileArgs ca;
  ca.model = args.model;
  ca.planText = planFile(e, args, o, pins).dump();
  ca.planPath = "the plan carve plan chose (" + e.c.key() + ")";
  ca.target = o.cluster.device.target; // the program that runs there
  ca.attention = args.attention;
  ca.convolution = args.convolution;
  ca.loss = args.loss;
  ca.import = args.import;
  if (!o.gpu)
    return args.fullCompileCheck ? compiledMemory(ca) : compiledMemoryByLayers(ca, layers);
  std::vector<CompiledRankMemory> m = compiledMemory(ca, &o.gpuStep, &o.gpuPriced, &o.gpuWhy);
  if (o.gpuPriced && !o.gpuStep.unpriced.empty()) {
    o.gpuPriced = false;
    o.gpuWhy = "the GPU model does not price " + o.gpuStep.unpriced.front();
  }
  return m;
}

/// The chosen plan as compiled: each pipeline rank's bytes from the
/// compiler's own memory plan. When the model's choice does not fit as
/// compiled (the model is an upper bound, so rarely), the next alternative
/// that does is chosen and the report says so.
void checkCompiled(const PlanArgs &args, const Session &s, Outcome &o) {
  if (!args.compileCheck) {
    o.compiledWhy = "--no-compile-check";
    return;
  }
  if (args.publishedStorage) {
    o.compiledWhy = "priced with --storage published, which carve does not compile";
    return;
  }
  if (!isBuiltinModel(args.model) && o.opts.globalBatch != s.model.modelBatch) {
    o.compiledWhy = "the global batch differs from the model's, which carve compile uses";
    return;
  }
  SearchResult &r = o.result;
  o.compiled = compilePlan(args, o, r.ranked[0], o.bestPins(), o.compiledLayers);
  if (largestArena(o.compiled) <= r.ranked[0].capacity)
    return;
  const Estimate first = r.ranked[0];
  const double firstArena = largestArena(o.compiled);
  o.compiledNote = "as compiled, " + first.c.key() + " needs " + gb(firstArena) + " per device, " +
                   gb(first.capacity) + " usable";
  if (r.fullyFixed)
    return;
  for (size_t i = 1; i < r.ranked.size(); ++i) {
    std::vector<int64_t> layers;
    std::vector<CompiledRankMemory> c =
        compilePlan(args, o, r.ranked[i], o.opts.constraints.pins, layers);
    if (largestArena(c) > r.ranked[i].capacity)
      continue;
    o.compiledNote = "the model's first choice, " + first.c.key() + ", needs " + gb(firstArena) +
                     " per device as compiled (" + gb(first.capacity) +
                     " usable): this is the fastest alternative that fits as compiled";
    Estimate chosen = r.ranked[i];
    r.ranked = {chosen};
    r.lostWhy.clear();
    o.ops = OpSearchResult();
    o.ops.skippedWhy = "the first choice did not fit as compiled";
    o.compiled = std::move(c);
    o.compiledLayers = std::move(layers);
    return;
  }
  o.compiledNote += ", and no alternative fits as compiled either";
}

void planOrDie(const PlanArgs &args, Session &s, Outcome &o, const std::string &who) {
  setup(args, s, o);
  search(s, o);
  if (!o.result.contradiction.empty())
    die(who + ": the constraints contradict each other: " + o.result.contradiction);
  if (o.result.evaluated == 0)
    die(who + ": " + unusable(o));
  if (o.result.anyFits && args.opSearch)
    searchOps(s, o);
  if (o.result.anyFits) {
    auto t0 = std::chrono::steady_clock::now();
    checkCompiled(args, s, o);
    o.compileSeconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
}

json compiledJson(const Outcome &o) {
  json ranks = json::array();
  for (const CompiledRankMemory &m : o.compiled)
    ranks.push_back({{"params", m.params},
                     {"grads", m.grads},
                     {"optimizer", m.optimizer},
                     {"activations", m.activations},
                     {"arena", m.arena}});
  return ranks;
}

/// The chosen plan's memory as compiled: the largest pipeline rank.
void printCompiled(std::ostream &os, const Outcome &o) {
  if (o.compiled.empty()) {
    os << "\nAs compiled: not checked (" << o.compiledWhy << ")\n";
    return;
  }
  size_t big = 0;
  for (size_t i = 0; i < o.compiled.size(); ++i)
    if (o.compiled[i].arena > o.compiled[big].arena)
      big = i;
  const CompiledRankMemory &m = o.compiled[big];
  const Estimate &e = o.result.ranked[0];
  os << "\nAs compiled (carve compile's memory plan, pipeline rank " << big << " of "
     << o.compiled.size() << ")\n  parameters " << gb((double)m.params) << ", gradients "
     << gb((double)m.grads) << ", optimizer " << gb((double)m.optimizer) << ", activations "
     << gb((double)m.activations) << ": " << gb((double)m.arena) << " of " << gb(e.capacity)
     << (m.arena <= e.capacity ? "" : ", DOES NOT FIT") << " ("
     << scaled((double)m.arena / e.mem.total(), {{1, "%.3fx"}}) << " the prediction)\n";
  if (!o.compiledLayers.empty())
    os << "  (compiled at " << o.compiledLayers.front() << " to " << o.compiledLayers.back()
       << " layers, where every region grows by the same bytes per layer, and extrapolated to "
          "the model's; --full-compile-check compiles it whole)\n";
  if (!o.compiledNote.empty())
    os << "  note: " << o.compiledNote << "\n";
}

/// --calibration carve: the chosen plan's CUDA program, priced by the GPU
/// cost model of its lowered step.
void printCarveProgram(std::ostream &os, const Outcome &o) {
  if (!o.gpu)
    return;
  os << "\ncarve's CUDA program on one " << o.gpu->device
     << " (the GPU cost model of the compiled step; docs/gpu-model.md)\n";
  if (!o.gpuPriced) {
    os << "  not priced: " << (o.gpuWhy.empty() ? o.compiledWhy : o.gpuWhy) << "\n";
    return;
  }
  GpuPrediction p = predictGpuStep(o.gpuStep, *o.gpu);
  char line[256];
  snprintf(line, sizeof line, "  step %.1f ms, %lld kernel launches (the search's estimate: %s)\n",
           p.totalMs(), (long long)p.totalLaunches(), secs(o.result.ranked[0].time.total).c_str());
  os << line << "  ";
  std::vector<int> order(kGpuClasses);
  for (int k = 0; k < kGpuClasses; ++k)
    order[k] = k;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return p.ms[a] > p.ms[b]; });
  int shown = 0;
  for (int k : order) {
    if (p.ms[k] <= 0 || shown == 5)
      continue;
    snprintf(line, sizeof line, "%s%s %.1f ms", shown ? ", " : "",
             gpuClassName(static_cast<GpuClass>(k)), p.ms[k]);
    os << line;
    ++shown;
  }
  os << "\n";
}

} // namespace

int runPlan(const PlanArgs &args) {
  Session s;
  Outcome o;
  planOrDie(args, s, o, "carve plan");
  const SearchResult &r = o.result;

  if (args.json) {
    json j = reportJson(args, o, s);
    if (!r.anyFits)
      j["explanation"] =
          r.fullyFixed ? "the fixed plan does not fit" : "no plan fits; see \"closest\"";
    llvm::outs() << j.dump(2) << "\n";
    llvm::outs().flush();
  }
  std::ostringstream os;
  os << "carve plan: " << modelLine(args, o, s) << "\n";
  os << "  on " << o.cluster.name << " (" << o.cluster.worldSize() << " x " << o.cluster.device.name
     << "), global batch " << o.opts.globalBatch << "\n";
  if (args.publishedStorage)
    os << "  priced with the published mixed-precision storage (--storage published: 16-bit "
          "weights, gradients and collectives), not what carve compiles\n";
  os << "  " << calibrationLine(args) << "\n";
  os << "  searched " << r.evaluated << " plans over " << s.built << " tp layouts in "
     << secs(o.seconds) << "\n\n";
  if (!r.anyFits) {
    const Estimate &e = r.closest;
    if (r.fullyFixed) {
      os << "The fixed plan does not fit: " << e.c.key() << "\n";
      printEstimate(os, e, o.cluster, o.base->seq > 0);
      if (!args.json)
        llvm::errs() << os.str();
      die("carve plan: the fixed plan needs " + gb(e.mem.total()) + " per device, " +
          gb(e.capacity) + " usable: short by " + gb(e.mem.total() - e.capacity));
    }
    std::string more = wouldFit(s, o);
    if (!args.json) {
      os << "Closest plan (does not fit): " << e.c.key() << "\n";
      printEstimate(os, e, o.cluster, o.base->seq > 0);
      llvm::errs() << os.str();
    }
    die("carve plan: no plan fits: the closest (" + e.c.key() + ") needs " + gb(e.mem.total()) +
        " per device, " + gb(e.capacity) + " usable: short by " + gb(e.mem.total() - e.capacity) +
        (more.empty() ? std::string("; it does not fit on 1024 times the nodes either")
                      : "; " + more));
  }
  const Estimate &best = r.ranked[0];
  if (!args.json) {
    os << "Plan: " << best.c.key() << "\n";
    printEstimate(os, best, o.cluster, o.base->seq > 0);
    printOpChoices(os, o);
    printCompiled(os, o);
    printCarveProgram(os, o);
    if (r.ranked.size() > 1) {
      os << "\nAlternatives\n";
      for (size_t i = 1; i < r.ranked.size(); ++i) {
        char line[512];
        snprintf(line, sizeof line, "  %zu. %-58s %10s  %s\n", i + 1, r.ranked[i].c.key().c_str(),
                 secs(r.ranked[i].time.total).c_str(), r.lostWhy[i - 1].c_str());
        os << line;
      }
    }
    if (isBuiltinModel(args.model) == false && o.opts.globalBatch != s.model.modelBatch)
      os << "note: the model was exported with batch " << s.model.modelBatch
         << "; compile it with that batch or re-export it with " << o.opts.globalBatch << "\n";
  }
  if (!args.output.empty()) {
    writeFile(args.output, planFile(best, args, o, o.bestPins()).dump(2) + "\n");
    if (!args.json)
      os << "\nwrote " << args.output << "\n";
  }
  if (!args.json) {
    llvm::outs() << os.str();
    llvm::outs().flush();
  }
  if (!o.compiled.empty() && largestArena(o.compiled) > best.capacity)
    die("carve plan: " + o.compiledNote);
  return 0;
}

std::string autoPlan(const PlanArgs &args, std::string &summary) {
  Session s;
  Outcome o;
  planOrDie(args, s, o, "--auto");
  const SearchResult &r = o.result;
  if (!r.anyFits)
    die("--auto: no plan fits " + o.cluster.name + ": the closest (" + r.closest.c.key() +
        ") needs " + gb(r.closest.mem.total()) + " per device, " + gb(r.closest.capacity) +
        " usable");
  const Estimate &best = r.ranked[0];
  summary =
      best.c.key() + ", predicted " + secs(best.time.total) + " per step, " + gb(best.mem.total()) +
      " per device" +
      (o.compiled.empty() ? std::string() : ", " + gb(largestArena(o.compiled)) + " as compiled") +
      " (searched " + std::to_string(r.evaluated) + " plans in " + secs(o.seconds) + ")";
  if (!o.compiled.empty() && largestArena(o.compiled) > best.capacity)
    die("--auto: " + o.compiledNote);
  return planFile(best, args, o, o.bestPins()).dump(2);
}

} // namespace carve
