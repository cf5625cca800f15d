//===- VerifyCmd.cpp - `carve verify`: a plan against the 1-rank program --===//
//
// 1. Read the plan; the reference plan keeps only its "optimizer" (one rank,
//    the same optimizer settings).
// 2. Compile both with `carve compile` (this executable, as a child process,
//    so a compile error is reported here and not by exiting).
// 3. Without --data, write a seeded Markov-chain token file for the model's
//    vocabulary (the token format `train --data` reads; tests/e2e/data_gen.py
//    makes the same kind of data).
// 4. Train both K steps with `carve run`, saving a checkpoint after every
//    step, from the same OUT/init.safetensors values.
// 5. Per step: both losses, their relative difference, and the largest
//    per-tensor weight difference relative to the tensor's largest entry.
//    PASS when every step is within both tolerances.
//
//===----------------------------------------------------------------------===//

#include "tools/carve/VerifyCmd.h"

#include "carve/rt/checkpoint.h"
#include "carve/rt/safetensors.h"
#include "compiler/frontend/Builtin.h"
#include "compiler/plan/Plan.h"
#include "compiler/rules/Rules.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/MLIRContext.h"
#include "llvm/Support/Chrono.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/raw_ostream.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

using namespace llvm;

namespace carve {
namespace {

/// Exit statuses: the plan disagrees with one rank / the request cannot be
/// carried out.
constexpr int kFail = 1;
constexpr int kBadInput = 2;

/// The relative change CARVE_VERIFY_PERTURB applies to one tensor of the
/// planned program's initial weights (fault injection for tests).
constexpr double kPerturbation = 1e-2;

/// The optimizer both programs are compiled with for the comparison, unless
/// --planned-optimizer: SGD with momentum, and clipping that is active on
/// every step so that the global norm over shards is checked too. AdamW
/// divides each gradient by its own RMS, so a parameter whose exact gradient
/// is zero (the key third of a fused QKV bias: softmax ignores a per-row
/// constant) moves by +-lr on float32 rounding noise, and any two summation
/// orders then differ by ~lr there. SGD keeps weight differences proportional
/// to gradient differences, so the check measures the plan.
const std::vector<std::string> kComparisonOptimizer = {
    "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--clip-grad-norm", "0.5"};

struct BadInput {
  std::string message;
};

[[noreturn]] void bad(const std::string &msg) { throw BadInput{msg}; }

double secondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Removes the temporary work folder on every exit path.
struct WorkDir {
  std::string path;
  bool temporary = false;
  ~WorkDir() {
    if (temporary && !path.empty() && !getenv("CARVE_KEEP_TEMP"))
      sys::fs::remove_directories(path);
  }
};

std::string readFile(const std::string &path) {
  auto buf = MemoryBuffer::getFile(path);
  if (!buf)
    return "";
  return (*buf)->getBuffer().str();
}

/// The first line of a child's output that reports an error, without the
/// "carve: error: " prefix; else its last non-empty line.
std::string errorLine(const std::string &logPath) {
  std::istringstream in(readFile(logPath));
  std::string line, last;
  while (std::getline(in, line)) {
    size_t at = line.find("error: ");
    if (at != std::string::npos)
      return line.substr(at + 7);
    if (!line.empty())
      last = line;
  }
  return last.empty() ? "no output; see " + logPath : last;
}

/// Runs this executable (`carve compile`, `carve run`) with `args`, stdout
/// and stderr into `logPath`.
int runSelf(const std::vector<std::string> &args, const std::string &logPath) {
  static std::string self = sys::fs::getMainExecutable(nullptr, nullptr);
  std::vector<StringRef> argv = {self};
  argv.insert(argv.end(), args.begin(), args.end());
  std::optional<StringRef> redirects[] = {std::nullopt, StringRef(logPath), StringRef(logPath)};
  std::string execError;
  int rc = sys::ExecuteAndWait(self, argv, std::nullopt, redirects, 0, 0, &execError);
  if (rc < 0)
    bad("cannot start " + self + ": " + execError);
  return rc;
}

/// What the generated data needs to know: token model or not, its batch,
/// sequence length and vocabulary (the rows of the table `input_ids` indexes).
struct ModelShape {
  bool tokens = false;
  int64_t batch = 0, seq = 0, vocab = 0;
  std::string why; // why no token data can be generated
};

ModelShape inspectModel(const std::string &model, const std::vector<std::string> &flags) {
  ImportOptions opts;
  std::string error;
  for (size_t i = 0; i + 1 < flags.size(); i += 2) {
    if (flags[i] == "--set-dim" && !parseSetDim(flags[i + 1], opts, error))
      bad(model + ": " + error);
    if (flags[i] == "--frozen")
      opts.frozen.push_back(flags[i + 1]);
    if (flags[i] == "--rules") {
      // Custom ops (and kernels for standard ops carve lacks) import by their rules.
      RuleSet rules;
      if (!loadRules(flags[i + 1], rules, error))
        bad(error);
      opts.customOps = rules.customOps;
    }
  }
  mlir::MLIRContext context;
  auto module = loadModel(context, model, opts, error);
  if (!module)
    bad(model + ": " + error);
  ModelShape s;
  auto fwd = module->lookupSymbol<mlir::func::FuncOp>("forward");
  std::vector<mlir::BlockArgument> inputs;
  for (mlir::BlockArgument a : fwd.getArguments())
    if (fwd.getArgAttrOfType<mlir::StringAttr>(a.getArgNumber(), kInputAttr))
      inputs.push_back(a);
  // The codegen's rule for token data (compiler/codegen/Tables.cpp).
  auto isIds = [](mlir::BlockArgument a) {
    auto t = cast<mlir::RankedTensorType>(a.getType());
    return t.getRank() == 2 && t.getElementType().isInteger(64);
  };
  if (inputs.size() != 2 || !isIds(inputs[0]) || !isIds(inputs[1]) ||
      inputs[0].getType() != inputs[1].getType()) {
    s.why = "its inputs are not token ids and targets (two int64 [batch, seq] tensors)";
    return s;
  }
  auto t = cast<mlir::RankedTensorType>(inputs[0].getType());
  s.batch = t.getDimSize(0);
  s.seq = t.getDimSize(1);
  for (mlir::Operation *user : inputs[0].getUsers())
    if (user->getName().getStringRef() == "carve.gather" && user->getNumOperands() == 2 &&
        user->getOperand(1) == inputs[0])
      if (auto table = dyn_cast<mlir::RankedTensorType>(user->getOperand(0).getType()))
        s.vocab = std::max(s.vocab, table.getDimSize(0));
  if (s.vocab <= 0) {
    s.why = "no embedding table reads its token ids, so the vocabulary is unknown";
    return s;
  }
  s.tokens = true;
  return s;
}

/// A seeded Markov chain over `vocab` tokens: each token has four likely
/// successors (probabilities .5, .25, .15, .1) and 5% of steps jump uniformly,
/// so the loss has something to learn. The same recipe as
/// tests/e2e/data_gen.py make_tokens, on a generator fixed by the C++ standard.
void writeTokens(const std::string &path, int64_t n, int64_t vocab) {
  std::mt19937_64 rng(0);
  auto uniform = [&](int64_t k) { return (int64_t)(rng() % (uint64_t)k); };
  auto unit = [&] { return (double)(rng() >> 11) * 0x1.0p-53; };
  std::vector<int64_t> successors(vocab * 4);
  for (int64_t &x : successors)
    x = uniform(vocab);
  std::vector<int32_t> tokens(n);
  int64_t t = uniform(vocab);
  for (int64_t i = 0; i < n; ++i) {
    tokens[i] = (int32_t)t;
    if (unit() < 0.05) {
      t = uniform(vocab);
      continue;
    }
    double u = unit();
    int pick = u < 0.5 ? 0 : u < 0.75 ? 1 : u < 0.9 ? 2 : 3;
    t = successors[t * 4 + pick];
  }
  std::error_code ec;
  raw_fd_ostream os(path, ec);
  if (ec)
    bad(path + ": cannot write: " + ec.message());
  os.write(reinterpret_cast<const char *>(tokens.data()), tokens.size() * sizeof(int32_t));
  os.close();
  if (os.has_error())
    bad(path + ": cannot write: " + os.error().message());
}

/// Fault injection: scales tensor `name` of OUT/init.safetensors by
/// 1 + kPerturbation, so that the planned run starts from other weights.
void perturbInitialWeights(const std::string &out, const std::string &name) {
  std::string path = out + "/init.safetensors", error;
  std::vector<std::vector<char>> bytes;
  std::vector<rt::SafetensorsEntry> entries;
  std::vector<std::pair<std::string, std::string>> meta;
  bool found = false;
  {
    rt::SafetensorsReader reader;
    if (!reader.open(path, error))
      bad(error);
    for (const auto &[k, v] : reader.metadata())
      meta.push_back({k, v});
    bytes.resize(reader.tensors().size());
    for (size_t i = 0; i < reader.tensors().size(); ++i) {
      const rt::SafetensorsTensor &t = reader.tensors()[i];
      bytes[i].resize(t.end - t.begin);
      if (!reader.read(t, 0, t.end - t.begin, bytes[i].data(), error))
        bad(error);
      if (t.name == name) {
        if (t.dtype != "F32")
          bad("CARVE_VERIFY_PERTURB: '" + name + "' is " + t.dtype + ", not F32");
        float *f = reinterpret_cast<float *>(bytes[i].data());
        for (int64_t j = 0; j < t.numel; ++j)
          f[j] = (float)(f[j] * (1 + kPerturbation));
        found = true;
      }
      entries.push_back({t.name, t.dtype, t.shape, bytes[i].data()});
    }
  }
  if (!found)
    bad("CARVE_VERIFY_PERTURB: the model has no parameter '" + name + "'");
  if (!rt::writeSafetensors(path, entries, meta, error))
    bad(error);
}

/// The losses of a `--log` file, by step.
std::vector<double> readLosses(const std::string &path, std::string &error) {
  std::vector<double> out;
  std::ifstream in(path);
  if (!in) {
    error = path + ": missing";
    return out;
  }
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty())
      continue;
    try {
      auto j = nlohmann::json::parse(line);
      out.push_back(j.at("loss").get<double>());
    } catch (const std::exception &) {
      error = path + ": unreadable line '" + line.substr(0, 80) + "'";
      return {};
    }
  }
  return out;
}

/// One step of the comparison.
struct StepResult {
  double lossA = 0, lossB = 0, lossRel = 0;
  double weightRel = 0;
  std::string worstTensor;
  std::string problem; // a tensor missing or of another shape
};

/// A tensor's scale is its largest entry, but never less than this: a
/// parameter whose exact gradient is zero (the bias of a batch norm that feeds
/// only a convolution and another batch norm, which subtracts any shift)
/// stays at zero plus float32 rounding noise in both programs, so it is held
/// to kWeightFloor * tolerance absolute, like every entry below the floor.
constexpr double kWeightFloor = 1e-3;

/// max |a - b| / max(max |a|, kWeightFloor) over each tensor; the largest
/// over all tensors.
void compareWeights(const std::vector<rt::FullTensor> &ref,
                    const std::vector<rt::FullTensor> &planned, StepResult &r) {
  std::map<std::string, const rt::FullTensor *> byName;
  for (const rt::FullTensor &t : planned)
    byName[t.name] = &t;
  r.weightRel = 0;
  for (const rt::FullTensor &a : ref) {
    auto it = byName.find(a.name);
    if (it == byName.end()) {
      r.problem = "the planned checkpoint has no tensor '" + a.name + "'";
      return;
    }
    const rt::FullTensor &b = *it->second;
    if (a.shape != b.shape || a.data.size() != b.data.size()) {
      r.problem = "tensor '" + a.name + "' is " + rt::formatShape(b.shape) +
                  " in the planned checkpoint, " + rt::formatShape(a.shape) + " in the reference";
      return;
    }
    double scale = 0, diff = 0;
    for (size_t i = 0; i < a.data.size(); ++i) {
      scale = std::max(scale, (double)std::fabs(a.data[i]));
      double d = std::fabs((double)a.data[i] - (double)b.data[i]);
      diff = std::isnan(d) ? INFINITY : std::max(diff, d);
    }
    double rel = diff / std::max(scale, kWeightFloor);
    if (rel > r.weightRel || r.worstTensor.empty()) {
      r.weightRel = rel;
      r.worstTensor = a.name;
    }
  }
}

std::string sci(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1e", x);
  return buf;
}

/// One `carve verify` run: the steps of verify(), in order.
class Verifier {
public:
  explicit Verifier(const VerifyArgs &args) : args(args) {}

  int run() {
    checkInputs();
    prepareWorkFolder();
    compileBoth();
    makeData();
    if (!trainBoth())
      return kFail;
    return compare();
  }

private:
  const VerifyArgs &args;
  std::string planText;
  Plan plan;
  nlohmann::ordered_json refPlan;
  double lossTol = 1e-5, weightTol = 1e-4; // resolved by checkInputs
  WorkDir work;
  int ranks = 1;
  std::string data;

  std::string at(const std::string &name) const { return work.path + "/" + name; }

  /// 1. The inputs: the model, the plan, the options, the data file.
  void checkInputs() {
    if (args.model.rfind("builtin:", 0) != 0) {
      if (!sys::fs::exists(args.model))
        bad(args.model + ": no such model file");
      if (sys::fs::is_directory(args.model))
        bad(args.model + ": is a directory, expected a model (.onnx)");
    }
    if (args.planPath.empty())
      bad("--plan PLAN.json is required: the plan to verify against one rank");
    if (!sys::fs::exists(args.planPath))
      bad(args.planPath + ": no such plan file");
    planText = readFile(args.planPath);
    std::string error;
    if (!parsePlan(planText, args.planPath, plan, error))
      bad(error);
    if (args.steps < 1)
      bad("--steps must be at least 1");
    // Tolerances not given: by the plan's precision. A 16-bit plan's ranks
    // sum 16-bit-rounded partial results in another order than one rank
    // (precision.py's 1e-4 for the losses); its fp32 master weights move by
    // lr times gradients rounded to the format (each rank's part, their sum)
    // where one rank rounds once: four roundings of at most half a unit in
    // the format's last place (2^-8 bf16, 2^-11 fp16) of a tensor's largest
    // step, which a tensor that starts at zero (a bias) is all of.
    const bool half = plan.precision == "bf16" || plan.precision == "fp16";
    lossTol = args.lossTolerance ? *args.lossTolerance : half ? 1e-4 : 1e-5;
    weightTol = args.weightTolerance       ? *args.weightTolerance
                : plan.precision == "bf16" ? std::ldexp(1.0, -6)
                : plan.precision == "fp16" ? std::ldexp(1.0, -9)
                                           : 1e-4;
    if (!(lossTol >= 0) || !(weightTol >= 0))
      bad("--tolerance-loss and --tolerance-weights must be non-negative numbers");
    if (!args.data.empty() && !sys::fs::is_regular_file(args.data))
      bad(args.data + ": no such data file");
    // The reference: one rank computing what the plan computes, so its
    // numerics fields too (a bf16 plan against an fp32 program would differ
    // by bf16's rounding, not by the plan's parallelism).
    refPlan = nlohmann::ordered_json::object();
    {
      auto given = nlohmann::ordered_json::parse(planText);
      for (const char *field : {"optimizer", "precision", "tf32"})
        if (given.contains(field))
          refPlan[field] = given[field];
    }
    ranks = plan.worldSize();
  }

  /// The work folder: ours to fill, never someone else's; what is verified.
  void prepareWorkFolder() {
    if (args.workdir.empty()) {
      SmallString<256> tmp;
      if (std::error_code ec = sys::fs::createUniqueDirectory("carve-verify", tmp))
        bad("cannot create a temporary folder: " + ec.message());
      work.path = tmp.str().str();
      work.temporary = true;
    } else {
      work.path = args.workdir;
      if (sys::fs::exists(work.path)) {
        if (!sys::fs::is_directory(work.path))
          bad(work.path + ": exists and is not a folder");
        std::error_code ec;
        bool empty = sys::fs::directory_iterator(work.path, ec) == sys::fs::directory_iterator();
        if (!empty && !sys::fs::exists(work.path + "/verify.json"))
          bad(work.path + ": exists and is not a carve verify folder (no verify.json); refusing "
                          "to write into it");
      } else if (std::error_code ec = sys::fs::create_directories(work.path)) {
        bad(work.path + ": cannot create: " + ec.message());
      }
    }
    {
      nlohmann::ordered_json v;
      v["model"] = args.model;
      v["plan"] = nlohmann::ordered_json::parse(planText);
      v["steps"] = args.steps;
      std::ofstream(at("verify.json")) << v.dump(2) << "\n";
      std::ofstream(at("reference-plan.json")) << refPlan.dump() << "\n";
    }
    outs() << "carve verify: " << args.model << "\n"
           << "  plan " << args.planPath << " " << plan.json << " on " << ranks << " rank"
           << (ranks > 1 ? "s" : "") << ", against 1 rank; " << args.steps << " step"
           << (args.steps > 1 ? "s" : "") << " from the same initial weights\n"
           << "  optimizer: "
           << (args.plannedOptimizer ? "the plan's"
                                     : "SGD lr 0.05, momentum 0.9, gradient norm clipped at 0.5 "
                                       "(--planned-optimizer: the plan's)")
           << "\n";
    outs().flush();
  }

  /// 2. Compile both: the plan and its one-rank reference.
  void compileBoth() {
    auto compile = [&](const std::string &what, const std::string &planFile,
                       const std::string &out) {
      auto t0 = std::chrono::steady_clock::now();
      std::vector<std::string> a = {"compile", args.model, "--plan", planFile,
                                    "-o",      out,        "--quiet"};
      a.insert(a.end(), args.compileFlags.begin(), args.compileFlags.end());
      if (!args.plannedOptimizer)
        a.insert(a.end(), kComparisonOptimizer.begin(), kComparisonOptimizer.end());
      std::string log = out + ".compile.log";
      if (runSelf(a, log) != 0)
        bad("compiling the " + what + " failed: " + errorLine(log));
      return secondsSince(t0);
    };
    double tRef = compile("reference (1 rank)", at("reference-plan.json"), at("reference"));
    double tPlan = compile("planned program", args.planPath, at("planned"));
    outs() << "  compiled: 1 rank in " << format("%.1f", tRef) << " s, the plan in "
           << format("%.1f", tPlan) << " s (" << work.path << ")\n";
    if (const char *name = getenv("CARVE_VERIFY_PERTURB")) {
      perturbInitialWeights(at("planned"), name);
      outs() << "  fault injection (CARVE_VERIFY_PERTURB): '" << name
             << "' of the planned program's initial weights scaled by "
             << format("%g", 1 + kPerturbation) << "\n";
    }
  }

  /// 3. The data: the user's, or tokens generated for the model.
  void makeData() {
    data = args.data;
    if (data.empty()) {
      ModelShape shape = inspectModel(args.model, args.compileFlags);
      if (!shape.tokens)
        bad(args.model + ": cannot generate training data: " + shape.why +
            "; give --data FILE (a tensor file, runtime/README.md)");
      data = at("tokens.bin");
      int64_t n = std::max<int64_t>(4096, args.steps * shape.batch * shape.seq + shape.seq + 2);
      writeTokens(data, n, shape.vocab);
      outs() << "  data: " << n << " generated tokens (vocabulary " << shape.vocab << ")\n";
    }
  }

  /// 4. Train both, a checkpoint after every step; false when the planned
  /// program failed (the reference failing is an error).
  bool trainBoth() {
    auto train = [&](const std::string &out, int n, const std::string &tag) {
      std::string save = at(tag + "-ckpt");
      sys::fs::remove_directories(save);
      std::vector<std::string> a = {"run",
                                    out,
                                    "-n",
                                    std::to_string(n),
                                    "--",
                                    "--steps",
                                    std::to_string(args.steps),
                                    "--data",
                                    data,
                                    "--log",
                                    at(tag + ".jsonl"),
                                    "--save",
                                    save,
                                    "--save-every",
                                    "1",
                                    "--keep",
                                    "0",
                                    "--quiet"};
      return runSelf(a, at(tag + ".log"));
    };
    auto t0 = std::chrono::steady_clock::now();
    if (train(at("reference"), 1, "reference") != 0)
      bad("training the reference (1 rank) failed: " + errorLine(at("reference.log")));
    if (train(at("planned"), ranks, "planned") != 0) {
      errs() << "carve verify: FAIL: the planned program failed: " << errorLine(at("planned.log"))
             << "\n";
      return false;
    }
    outs() << "  trained both in " << format("%.1f", secondsSince(t0)) << " s\n";
    return true;
  }

  /// 5. Compare the losses and every weight, step by step.
  int compare() {
    std::string error;
    std::vector<double> lossRef = readLosses(at("reference.jsonl"), error);
    if (!error.empty())
      bad("the reference run's log: " + error);
    std::vector<double> lossPlan = readLosses(at("planned.jsonl"), error);
    if (!error.empty() || (int64_t)lossPlan.size() != args.steps) {
      errs() << "carve verify: FAIL: the planned run's log: "
             << (error.empty() ? std::to_string(lossPlan.size()) + " steps logged, expected " +
                                     std::to_string(args.steps)
                               : error)
             << "\n";
      return kFail;
    }
    if ((int64_t)lossRef.size() != args.steps)
      bad("the reference run logged " + std::to_string(lossRef.size()) + " steps, expected " +
          std::to_string(args.steps));
    auto refSteps = rt::listCheckpoints(at("reference-ckpt"));
    auto planSteps = rt::listCheckpoints(at("planned-ckpt"));

    outs() << "  step  loss (1 rank)   loss (plan)  rel. diff  weights rel. diff  in tensor\n";
    std::string firstFailure;
    double worstLoss = 0, worstWeight = 0;
    std::string worstTensor;
    for (int64_t k = 1; k <= args.steps; ++k) {
      StepResult r;
      r.lossA = lossRef[k - 1];
      r.lossB = lossPlan[k - 1];
      double d = std::fabs(r.lossA - r.lossB);
      r.lossRel = std::isnan(d) ? INFINITY : r.lossA != 0 ? d / std::fabs(r.lossA) : d;
      auto find = [&](const std::vector<std::pair<int64_t, std::string>> &list) {
        for (const auto &[s, path] : list)
          if (s == k)
            return path;
        return std::string();
      };
      std::string refDir = find(refSteps), planDir = find(planSteps);
      if (refDir.empty())
        bad(at("reference-ckpt") + ": no checkpoint of step " + std::to_string(k));
      std::vector<rt::FullTensor> a, b;
      if (!rt::readFullCheckpoint(refDir, a, error))
        bad(error);
      if (planDir.empty())
        r.problem = "no checkpoint of step " + std::to_string(k) + " in " + at("planned-ckpt");
      else if (!rt::readFullCheckpoint(planDir, b, error))
        r.problem = error;
      else
        compareWeights(a, b, r);
      bool ok = r.problem.empty() && r.lossRel <= lossTol && r.weightRel <= weightTol;
      outs() << format("  %4lld  %13.8f  %12.8f  %9s  %17s  ", (long long)k, r.lossA, r.lossB,
                       sci(r.lossRel).c_str(), sci(r.weightRel).c_str())
             << (r.problem.empty() ? r.worstTensor : r.problem) << (ok ? "" : "  <- over") << "\n";
      if (!ok && firstFailure.empty()) {
        if (!r.problem.empty())
          firstFailure = "step " + std::to_string(k) + ": " + r.problem;
        else if (!(r.lossRel <= lossTol))
          firstFailure = "step " + std::to_string(k) + ": the losses differ by " + sci(r.lossRel) +
                         " (relative; tolerance " + sci(lossTol) + ")" +
                         (r.weightRel > weightTol
                              ? "; weights of '" + r.worstTensor + "' by " + sci(r.weightRel)
                              : "");
        else
          firstFailure = "step " + std::to_string(k) + ": the weights of '" + r.worstTensor +
                         "' differ by " + sci(r.weightRel) +
                         " of the tensor's largest entry (tolerance " + sci(weightTol) + ")";
      }
      worstLoss = std::max(worstLoss, r.lossRel);
      if (r.weightRel >= worstWeight)
        worstWeight = r.weightRel, worstTensor = r.worstTensor;
    }
    outs().flush();
    if (!firstFailure.empty()) {
      outs() << "FAIL: " << firstFailure << "\n";
      return kFail;
    }
    outs() << "PASS: losses within " << sci(lossTol) << " (worst " << sci(worstLoss)
           << "), weights within " << sci(weightTol) << " (worst " << sci(worstWeight) << ", "
           << worstTensor << ") over " << args.steps << " step" << (args.steps > 1 ? "s" : "")
           << "\n";
    return 0;
  }
};

int verify(const VerifyArgs &args) { return Verifier(args).run(); }

} // namespace

int runVerify(const VerifyArgs &args) {
  try {
    return verify(args);
  } catch (const BadInput &e) {
    outs().flush();
    errs() << "carve: error: " << e.message << "\n";
    return kBadInput;
  }
}

} // namespace carve
