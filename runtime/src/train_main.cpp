//===- train_main.cpp - main() of every generated training executable -----===//
//
// OUT/bin/train runs the rank program that `carve_program_for_rank` gives
// this rank:
//
// 1. Start MPI when launched by mpirun/srun, else run as one rank. Check the
//    arguments and the rank count.
// 2. Validate everything else before any work (the data, the initial
//    weights or the checkpoint to load, the --save folder, the --log file).
//    After 1 and after 2 all ranks agree on the outcome with an all-reduce
//    over the world, so that they stop together (MPI_Finalize, exit 1) and
//    only the lowest failing rank prints its error.
// 3. Fill the arena (still in step 2, so that a bad checkpoint stops every
//    rank cleanly): weights from --load PATH or OUT/init.safetensors,
//    gradients and optimizer state zero unless loaded. A sharded checkpoint
//    (saved under any plan) is reassembled tensor by tensor from its shards;
//    each rank keeps its tensor-parallel piece and, for ZeRO, its dp chunk.
// 4. Run the steps, printing progress and writing metrics on rank 0, and
//    save every --save-every steps.
// 5. Save the final checkpoint: every rank writes its own shards, world rank
//    0 the manifest (checkpoint.h, docs/checkpoints.md). --save-every saves
//    inside step 4 the same way.
//
// The mesh is dp x tp with dp outermost: world rank = dpRank * tp + tpRank.
//
// An error after step 2 (a kernel's `fatal`, an I/O failure) calls abortAll,
// which brings every rank down; so does a collective that does not complete
// within --collective-timeout (a dead or stopped rank). docs/failures.md.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/checkpoint.h"
#include "carve/rt/comm.h"
#include "carve/rt/data.h"
#include "carve/rt/dist.h"
#include "carve/rt/metrics.h"
#include "carve/rt/pipeline.h"
#include "carve/rt/program.h"
#include "carve/rt/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <map>
#include <cmath>
#include <set>
#include <string>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

using namespace carve::rt;

namespace {

const char *const kUsage =
    R"(usage: train --steps S --data FILE [options]

Trains the compiled model for S steps. Launch it with `carve run OUT -n N -- ARGS`,
or with mpirun/srun and the number of ranks it was compiled for, or from any launcher
that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT per process (docs/nccl.md).

  --steps S                   optimizer steps to run (required)
  --data FILE                 training data (required): a flat little-endian token file for
                              token models, else a safetensors file with one [S, B, ...]
                              tensor per model input (see runtime/README.md)
  --data-dtype int32|uint16   element type of a token file (default int32)
  --log FILE.jsonl            write one JSON object per step (replaces FILE)
  --save DIR                  after the last step write a sharded checkpoint (every rank
                              its own shards) to DIR/step-NNNNNNNN and point DIR/latest at it
  --save-every K              also save into the --save DIR after every step that is a
                              multiple of K
  --keep N                    keep only the newest N step folders in DIR (default 0: all)
  --load PATH                 start from a checkpoint saved under any plan: a --save
                              folder (its latest step), one step folder, or the older full
                              format; weights, optimizer state, step, data position
  --trace FILE.json           record when every rank ran each micro-batch's forward and
                              backward (and the rest of the step) as a Chrome trace
                              (opens in Perfetto); written by rank 0 at the end
  --on-nan stop|skip          when the loss or a gradient is NaN or infinite: stop with
                              an error naming the step and the first such tensor (default),
                              or skip that step's update on every rank and go on
  --collective-timeout SECS   a collective or message that does not complete within SECS
                              seconds (a rank died or stopped) ends the job with an error
                              naming the operation (default 300; 0 waits forever)
  --progress auto|bar|lines|none
                              progress display: a line rewritten in place (bar), plain lines
                              (the first 10 steps, then every 10 s or --progress-every
                              steps), or none; auto (default) is bar on a terminal
  --progress-every N          with lines: a line every N steps after the first 10
  --loss-scale S              fp16 plans: the initial dynamic loss scale (default: the
                              one --load's checkpoint saved, else 65536); a step whose
                              gradients overflow is skipped and the scale halved; 2000
                              good steps in a row double it
  --cuda-graph                CUDA programs: run the first step as it is, capture the
                              forward and backward (kernels and collectives) in a CUDA graph
                              on the second and replay it from then on (one launch instead of
                              one per kernel); pipeline-parallel programs run as they are
  --quiet                     print nothing but errors (--progress none)
  --help                      print this text
)";

int worldRank = 0;
int worldSize = 1;

void printError(const std::string &message) {
  std::fflush(stdout);
  if (worldSize > 1)
    std::fprintf(stderr, "[rank %d] carve: error: %s\n", worldRank, message.c_str());
  else
    std::fprintf(stderr, "carve: error: %s\n", message.c_str());
  std::fflush(stderr);
}

/// An error once work has started: no agreement is possible any more.
[[noreturn]] void die(const std::string &message) {
  printError(message);
  abortAll(1);
}

struct Options {
  int64_t steps = -1;
  std::string data;
  TokenFileType dataType = TokenFileType::Int32;
  std::string log;
  std::string save;
  std::string load;
  int64_t saveEvery = 0;
  int64_t keep = 0;
  std::string trace;
  bool quiet = false;
  bool skipNonFinite = false; // --on-nan skip
  double collectiveTimeout = kDefaultCollectiveTimeout;
  std::string progress = "auto";
  int64_t progressEvery = 0;
  double lossScale = 65536; // fp16 plans: the initial dynamic loss scale
  bool lossScaleSet = false; // --loss-scale given: it wins over a checkpoint's
  bool cudaGraph = false;    // --cuda-graph
};

bool parseInt(const std::string &text, int64_t &out) {
  if (text.empty())
    return false;
  char *end = nullptr;
  errno = 0;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || *end != '\0')
    return false;
  out = v;
  return true;
}

bool parseArgs(int argc, char **argv, Options &opts, std::string &error) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool inlineValue = false;
    if (arg.rfind("--", 0) == 0) {
      size_t eq = arg.find('=');
      if (eq != std::string::npos) {
        value = arg.substr(eq + 1);
        arg = arg.substr(0, eq);
        inlineValue = true;
      }
    }
    auto takeValue = [&]() {
      if (inlineValue)
        return true;
      if (i + 1 >= argc) {
        error = arg + " needs a value";
        return false;
      }
      value = argv[++i];
      return true;
    };
    if ((arg == "--cuda-graph" || arg == "--quiet") && inlineValue) {
      error = arg + " takes no value";
      return false;
    } else if (arg == "--cuda-graph") {
      opts.cudaGraph = true;
    } else if (arg == "--quiet") {
      opts.quiet = true;
    } else if (arg == "--steps") {
      if (!takeValue())
        return false;
      if (!parseInt(value, opts.steps) || opts.steps < 1) {
        error = "--steps needs a positive integer, not '" + value + "'";
        return false;
      }
    } else if (arg == "--data" || arg == "--log" || arg == "--save" || arg == "--load" ||
               arg == "--trace") {
      if (!takeValue())
        return false;
      if (value.empty()) {
        error = arg + " needs a non-empty path";
        return false;
      }
      (arg == "--data"    ? opts.data
       : arg == "--log"   ? opts.log
       : arg == "--save"  ? opts.save
       : arg == "--trace" ? opts.trace
                          : opts.load) = value;
    } else if (arg == "--save-every" || arg == "--keep") {
      if (!takeValue())
        return false;
      int64_t &field = arg == "--keep" ? opts.keep : opts.saveEvery;
      if (!parseInt(value, field) || field < (arg == "--keep" ? 0 : 1)) {
        error = arg + " needs a " + (arg == "--keep" ? "non-negative" : "positive") +
                " integer, not '" + value + "'";
        return false;
      }
    } else if (arg == "--on-nan") {
      if (!takeValue())
        return false;
      if (value != "stop" && value != "skip") {
        error = "--on-nan is stop or skip, not '" + value + "'";
        return false;
      }
      opts.skipNonFinite = value == "skip";
    } else if (arg == "--loss-scale") {
      if (!takeValue())
        return false;
      char *end = nullptr;
      double v = value.empty() ? -1 : std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(v >= 1) || !(v <= 1e30)) {
        error = "--loss-scale needs a number in [1, 1e30], not '" + value + "'";
        return false;
      }
      opts.lossScale = v;
      opts.lossScaleSet = true;
    } else if (arg == "--collective-timeout") {
      if (!takeValue())
        return false;
      char *end = nullptr;
      double v = value.empty() ? -1 : std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(v >= 0) || !std::isfinite(v)) {
        error = "--collective-timeout needs a number of seconds >= 0, not '" + value + "'";
        return false;
      }
      opts.collectiveTimeout = v;
    } else if (arg == "--progress") {
      if (!takeValue())
        return false;
      if (value != "auto" && value != "bar" && value != "lines" && value != "none") {
        error = "--progress is auto, bar, lines or none, not '" + value + "'";
        return false;
      }
      opts.progress = value;
    } else if (arg == "--progress-every") {
      if (!takeValue())
        return false;
      if (!parseInt(value, opts.progressEvery) || opts.progressEvery < 1) {
        error = "--progress-every needs a positive integer, not '" + value + "'";
        return false;
      }
    } else if (arg == "--data-dtype") {
      if (!takeValue())
        return false;
      if (value == "int32") {
        opts.dataType = TokenFileType::Int32;
      } else if (value == "uint16") {
        opts.dataType = TokenFileType::UInt16;
      } else {
        error = "--data-dtype is int32 or uint16, not '" + value + "'";
        return false;
      }
    } else {
      error = "unknown argument '" + std::string(argv[i]) + "' (see --help)";
      return false;
    }
  }
  if (opts.steps < 0) {
    error = "--steps is required (see --help)";
    return false;
  }
  if (opts.data.empty()) {
    error = "--data is required (see --help)";
    return false;
  }
  if ((opts.saveEvery > 0 || opts.keep > 0) && opts.save.empty()) {
    error = std::string(opts.saveEvery > 0 ? "--save-every" : "--keep") +
            " needs --save DIR (the folder to save into)";
    return false;
  }
  return true;
}

/// The executable's output folder: OUT for OUT/bin/train.
std::string outputDir() {
  std::vector<char> buf(4096);
  ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0)
    return ".";
  std::string exe(buf.data(), static_cast<size_t>(n));
  std::string bin = exe.substr(0, exe.rfind('/'));
  size_t slash = bin.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : bin.substr(0, slash);
}

std::vector<int64_t> shapeOf(const TensorSpec &s) {
  return std::vector<int64_t>(s.dims, s.dims + s.rank);
}

/// The model's shape of a tensor: what files hold.
std::vector<int64_t> globalShapeOf(const TensorSpec &s) {
  for (int i = 0; i < s.rank; ++i)
    if (s.globalDims[i] != 0)
      return std::vector<int64_t>(s.globalDims, s.globalDims + s.rank);
  return shapeOf(s);
}

int64_t numelOf(const std::vector<int64_t> &shape) {
  int64_t n = 1;
  for (int64_t d : shape)
    n *= d;
  return n;
}

/// This rank's place on the pp x dp x tp mesh.
struct Mesh {
  int dp = 1, tp = 1, pp = 1;
  int dpRank = 0, tpRank = 0, ppRank = 0;
};

/// Checks the tensor-parallel and ZeRO fields of every parameter against the
/// mesh, so that loading and saving can rely on them.
bool checkShardedSpecs(const Program &p, const Mesh &m, std::string &error) {
  for (int i = 0; i < p.numParams; ++i) {
    const TensorSpec &s = p.params[i];
    std::vector<int64_t> local = shapeOf(s), global = globalShapeOf(s);
    std::string what = std::string("program '") + p.name + "': tensor '" + s.name + "' ";
    std::vector<int64_t> expected = global;
    if (s.tpDim >= 0) {
      if (s.tpDim >= s.rank || s.tpGroups < 1 || global[s.tpDim] % (s.tpGroups * m.tp) != 0) {
        error = what + "of global shape " + formatShape(global) +
                " cannot be split over tp=" + std::to_string(m.tp) + " on dimension " +
                std::to_string(s.tpDim) + " in " + std::to_string(s.tpGroups) + " group(s)";
        return false;
      }
      expected[s.tpDim] /= m.tp;
    }
    if (local != expected) {
      error = what + "has local shape " + formatShape(local) + ", expected " +
              formatShape(expected) + " for global shape " + formatShape(global) +
              (s.tpDim >= 0 ? " split over tp=" + std::to_string(m.tp) : "");
      return false;
    }
    bool zero = s.paramZero || (s.stateZero && s.trainable);
    if (s.zeroChunk < 0 || (zero && (s.zeroChunk == 0 || s.zeroChunk * m.dp < s.numel))) {
      error = what + "has a ZeRO chunk of " + std::to_string(s.zeroChunk) +
              " elements, which over dp=" + std::to_string(m.dp) + " does not cover its " +
              std::to_string(s.numel) + " elements";
      return false;
    }
  }
  return true;
}

/// Checkpoint name of optimizer state slot `slot` of a parameter.
std::string stateName(const Program &p, const char *param, int slot) {
  if (p.optimizer == OptimizerKind::AdamW)
    return std::string(param) + (slot == 0 ? ".exp_avg" : ".exp_avg_sq");
  return std::string(param) + ".momentum_buffer";
}

/// One tensor of the program that a checkpoint file holds.
struct Slot {
  std::string name;
  const TensorSpec *spec;
  int64_t offset; // in the arena
};

std::vector<Slot> modelSlots(const Program &p) {
  std::vector<Slot> slots;
  for (int i = 0; i < p.numParams; ++i)
    slots.push_back({p.params[i].name, &p.params[i], p.params[i].offset});
  return slots;
}

std::vector<Slot> optimizerSlots(const Program &p) {
  std::vector<Slot> slots;
  for (int i = 0; i < p.numParams; ++i)
    for (int s = 0; s < 2; ++s)
      if (p.params[i].trainable && p.params[i].stateOffset[s] >= 0)
        slots.push_back(
            {stateName(p, p.params[i].name, s), &p.params[i], p.params[i].stateOffset[s]});
  return slots;
}

/// Checks that `file` holds every slot with its dtype (F32 for optimizer
/// state) and shape; with `known`, also that it holds nothing else.
bool checkTensors(const SafetensorsReader &file, const std::vector<Slot> &slots, bool stateF32,
                  const std::set<std::string> *known, std::string &error) {
  for (const Slot &s : slots) {
    std::string dtype = stateF32 ? "F32" : dtypeName(s.spec->dtype);
    std::vector<int64_t> shape = globalShapeOf(*s.spec);
    std::string expected = dtype + " " + formatShape(shape);
    const SafetensorsTensor *t = file.find(s.name);
    if (!t) {
      error = file.path() + ": no tensor '" + s.name + "' (expected " + expected + ")";
      return false;
    }
    if (t->dtype != dtype || t->shape != shape) {
      error = file.path() + ": tensor '" + s.name + "' is " + t->dtype + " " +
              formatShape(t->shape) + ", expected " + expected;
      return false;
    }
  }
  if (known)
    for (const SafetensorsTensor &t : file.tensors())
      if (!known->count(t.name)) {
        error = file.path() + ": tensor '" + t.name + "' is not in the compiled model";
        return false;
      }
  return true;
}

/// How one slot of the arena relates to the full tensor in a file.
struct SlotLayout {
  int elemBytes;
  bool split; // a tensor-parallel piece
  bool zero;  // only this dp rank's ZeRO chunk of the piece
};

SlotLayout layoutOf(const TensorSpec &s, bool state, const Mesh &m) {
  return {state ? 4 : dtypeSize(s.dtype), s.tpDim >= 0 && m.tp > 1,
          (state ? s.stateZero : s.paramZero) && s.zeroChunk > 0};
}

/// Keeps this rank's part of the full tensor `full` (the model's shape) in
/// `dst`: its tensor-parallel piece and, for ZeRO, its dp chunk of that piece.
void keepPart(const char *full, const TensorSpec &spec, const SlotLayout &l, const Mesh &m,
              char *dst, std::vector<char> &piece) {
  if (!l.split && !l.zero) {
    std::memcpy(dst, full, static_cast<size_t>(spec.numel * l.elemBytes));
    return;
  }
  const char *local = full;
  if (l.split) {
    std::vector<int64_t> global = globalShapeOf(spec);
    piece.resize(static_cast<size_t>(spec.numel * l.elemBytes));
    char *to = l.zero ? piece.data() : dst;
    takeShard(full, Dims(global.data(), spec.rank), Split{spec.tpDim, spec.tpGroups, m.tp},
              m.tpRank, to, l.elemBytes);
    local = to;
  }
  if (l.zero) {
    // Chunk dpRank of the flattened piece; past its end, zero padding.
    const int64_t begin = std::min<int64_t>(m.dpRank * spec.zeroChunk, spec.numel);
    const int64_t n = std::min(spec.zeroChunk, spec.numel - begin);
    std::memcpy(dst, local + begin * l.elemBytes, static_cast<size_t>(n * l.elemBytes));
    std::memset(dst + n * l.elemBytes, 0, static_cast<size_t>((spec.zeroChunk - n) * l.elemBytes));
  }
}

/// Reads the full tensors of `slots` from a full-format file and keeps this
/// rank's part of each.
bool readTensors(const SafetensorsReader &file, const std::vector<Slot> &slots, char *arena,
                 bool stateF32, const Mesh &m, std::string &error) {
  std::vector<char> full, piece;
  for (const Slot &s : slots) {
    const SlotLayout l = layoutOf(*s.spec, stateF32, m);
    const SafetensorsTensor &t = *file.find(s.name);
    full.resize(static_cast<size_t>(t.end - t.begin));
    if (!file.read(t, 0, t.end - t.begin, full.data(), error))
      return false;
    keepPart(full.data(), *s.spec, l, m, arena + s.offset, piece);
  }
  return true;
}

/// Reassembles the full tensors of `slots` from a sharded checkpoint (saved
/// under any plan) and keeps this rank's part of each.
bool readShardedTensors(ShardFiles &files, const CheckpointManifest &manifest,
                        const std::vector<Slot> &slots, char *arena, bool state, const Mesh &m,
                        std::string &error) {
  std::map<std::string, const CheckpointTensor *> byName;
  for (const CheckpointTensor &t : manifest.tensors)
    byName[t.name] = &t;
  std::vector<char> full, piece;
  for (const Slot &s : slots) {
    const SlotLayout l = layoutOf(*s.spec, state, m);
    full.assign(static_cast<size_t>(numelOf(globalShapeOf(*s.spec)) * l.elemBytes), 0);
    if (!files.readTensor(*byName.at(s.name), full.data(), error))
      return false;
    keepPart(full.data(), *s.spec, l, m, arena + s.offset, piece);
  }
  return true;
}

/// Where the initial weights come from, validated.
struct WeightSource {
  SafetensorsReader model;
  SafetensorsReader optimizer;
  bool hasOptimizer = false;
  int64_t step = 0;
  bool sharded = false;
  std::string folder; // the step folder or full-format folder --load led to
  CheckpointManifest manifest;
};

const char *optimizerKindName(OptimizerKind k) {
  return k == OptimizerKind::AdamW ? "adamw" : "sgd";
}

/// Checks a sharded checkpoint's manifest against the compiled model: every
/// tensor of this rank's program (parameters, buffers, optimizer state) with
/// its dtype and full shape, and nothing the compiled model lacks.
bool checkManifest(const Program &p, const WeightSource &src, const std::set<std::string> &known,
                   std::string &error) {
  const CheckpointManifest &m = src.manifest;
  const std::string where = src.folder + "/manifest.json: ";
  std::map<std::string, const CheckpointTensor *> byName;
  bool hasState = false;
  for (const CheckpointTensor &t : m.tensors) {
    byName[t.name] = &t;
    hasState |= t.role == "optimizer_state";
    if (!known.count(t.name)) {
      error = where + "tensor '" + t.name +
              "' is not in the compiled model (a checkpoint of another model?)";
      return false;
    }
  }
  if (m.optimizerStep != m.step || m.lrStep != m.step || m.dataStep != m.step) {
    error = where + "the optimizer, lr-schedule and data positions (" +
            std::to_string(m.optimizerStep) + ", " + std::to_string(m.lrStep) + ", " +
            std::to_string(m.dataStep) + ") differ from the step " + std::to_string(m.step) +
            "; this program continues all of them from the step count";
    return false;
  }
  std::vector<Slot> state = optimizerSlots(p);
  if (!state.empty() && hasState && m.optimizer != optimizerKindName(p.optimizer)) {
    error = where + "saved with optimizer " + m.optimizer + ", this program uses " +
            optimizerKindName(p.optimizer);
    return false;
  }
  for (bool isState : {false, true})
    for (const Slot &s : isState ? state : modelSlots(p)) {
      std::string dtype = isState ? "F32" : dtypeName(s.spec->dtype);
      std::vector<int64_t> shape = globalShapeOf(*s.spec);
      std::string expected = dtype + " " + formatShape(shape);
      auto it = byName.find(s.name);
      if (it == byName.end()) {
        error = where + "no tensor '" + s.name + "' (expected " + expected + ")";
        return false;
      }
      if (it->second->dtype != dtype || it->second->shape != shape) {
        error = where + "tensor '" + s.name + "' is " + it->second->dtype + " " +
                formatShape(it->second->shape) + ", expected " + expected;
        return false;
      }
    }
  return true;
}

bool openWeightFiles(const Program &p, const Options &opts, WeightSource &src, std::string &error) {
  std::vector<Slot> params = modelSlots(p);
  if (opts.load.empty()) {
    // carve compile writes every rank's parameters here; extra tensors belong
    // to other ranks' programs.
    std::string init = outputDir() + "/init.safetensors";
    struct stat st;
    bool exists = ::stat(init.c_str(), &st) == 0;
    if (!src.model.open(init, error) || !checkTensors(src.model, params, false, nullptr, error)) {
      error = "initial weights " + error +
              (exists ? "" : " (`carve compile` writes them beside bin/; or pass --load DIR)");
      return false;
    }
    return true;
  }

  // A checkpoint must match the compiled model exactly: the parameters and
  // optimizer state of every rank's program, nothing else.
  std::set<std::string> paramNames, stateNames;
  for (int r = 0; r < carve_world_size(); ++r)
    if (const Program *other = carve_program_for_rank(r)) {
      for (const Slot &s : modelSlots(*other))
        paramNames.insert(s.name);
      for (const Slot &s : optimizerSlots(*other))
        stateNames.insert(s.name);
    }
  CheckpointLocation loc;
  if (!locateCheckpoint(opts.load, loc, error))
    return false;
  src.folder = loc.folder;
  if (loc.sharded) {
    std::set<std::string> known = paramNames;
    known.insert(stateNames.begin(), stateNames.end());
    if (!readManifest(loc.folder, src.manifest, error) || !checkManifest(p, src, known, error))
      return false;
    src.sharded = true;
    src.step = src.manifest.step;
    src.hasOptimizer = !optimizerSlots(p).empty();
    return true;
  }
  std::string modelPath = loc.folder + "/model.safetensors";
  if (!src.model.open(modelPath, error) ||
      !checkTensors(src.model, params, false, &paramNames, error))
    return false;
  auto stepIt = src.model.metadata().find("step");
  if (stepIt == src.model.metadata().end() || !parseInt(stepIt->second, src.step) || src.step < 0) {
    error = modelPath + ": no valid \"step\" in its __metadata__ (is it a checkpoint written "
                        "by --save?)";
    return false;
  }
  std::vector<Slot> state = optimizerSlots(p);
  std::string optPath = loc.folder + "/optimizer.safetensors";
  struct stat st;
  if (state.empty() && ::stat(optPath.c_str(), &st) != 0)
    return true;
  if (!src.optimizer.open(optPath, error) ||
      !checkTensors(src.optimizer, state, true, &stateNames, error))
    return false;
  auto optStep = src.optimizer.metadata().find("step");
  if (optStep != src.optimizer.metadata().end() && optStep->second != stepIt->second) {
    error = optPath + ": step " + optStep->second + " does not match model.safetensors' step " +
            stepIt->second;
    return false;
  }
  src.hasOptimizer = true;
  return true;
}

bool openWeights(const Program &p, const Options &opts, WeightSource &src, std::string &error) {
  if (openWeightFiles(p, opts, src, error))
    return true;
  if (!opts.load.empty())
    error = "checkpoint " + error;
  return false;
}

/// Fills this rank's parameters (and loaded optimizer state) in the arena.
bool fillArena(const Program &p, WeightSource &src, char *arena, const Mesh &m,
               std::string &error) {
  bool ok;
  if (src.sharded) {
    ShardFiles files(src.folder);
    ok = readShardedTensors(files, src.manifest, modelSlots(p), arena, false, m, error) &&
         (!src.hasOptimizer ||
          readShardedTensors(files, src.manifest, optimizerSlots(p), arena, true, m, error));
  } else {
    ok =
        readTensors(src.model, modelSlots(p), arena, false, m, error) &&
        (!src.hasOptimizer || readTensors(src.optimizer, optimizerSlots(p), arena, true, m, error));
  }
  if (!ok && !src.folder.empty())
    error = "checkpoint " + error;
  return ok;
}

/// Checks that `dir` exists as a writable folder or could be created, without
/// changing anything on disk.
bool checkSaveDir(const std::string &dir, std::string &error) {
  struct stat st;
  if (::stat(dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      error = dir + ": --save needs a folder, this is a file";
      return false;
    }
    for (const char *f : {"/latest"})
      if (::stat((dir + f).c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
        error = dir + f + ": exists and is not a regular file";
        return false;
      }
    std::string probe = dir + "/.carve-probe-XXXXXX";
    int fd = ::mkstemp(probe.data());
    if (fd < 0) {
      error = dir + ": cannot write checkpoints here: " + std::strerror(errno);
      return false;
    }
    ::close(fd);
    ::unlink(probe.c_str());
    return true;
  }
  // Walk up to the nearest existing ancestor, which must be a writable folder.
  std::string parent = dir;
  do {
    if (parent == "." || parent == "/") {
      error = dir + ": cannot create the --save folder: " + parent + " is not accessible";
      return false;
    }
    while (parent.size() > 1 && parent.back() == '/')
      parent.pop_back();
    size_t slash = parent.rfind('/');
    parent = slash == std::string::npos ? "." : slash == 0 ? "/" : parent.substr(0, slash);
  } while (::stat(parent.c_str(), &st) != 0);
  if (!S_ISDIR(st.st_mode) || ::access(parent.c_str(), W_OK | X_OK) != 0) {
    error = dir + ": cannot create the --save folder: " + parent + " is not a writable folder";
    return false;
  }
  return true;
}

bool makeDirs(const std::string &dir, std::string &error) {
  for (size_t at = 1; at <= dir.size(); ++at) {
    if (at < dir.size() && dir[at] != '/')
      continue;
    std::string prefix = dir.substr(0, at);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      error = prefix + ": cannot create the folder: " + std::strerror(errno);
      return false;
    }
  }
  return true;
}

/// Test-only fault injection (runtime/README.md, docs/failures.md).
struct Faults {
  int64_t rank = -1, step = -1; // CARVE_FAULT_RANK / _STEP: this rank raises...
  int signal = SIGKILL;         // ...CARVE_FAULT_SIGNAL (KILL, STOP, SEGV) at step's start
  int64_t nanStep = -1;         // CARVE_FAULT_NAN_STEP: poison...
  std::string nanTensor;        // ...CARVE_FAULT_NAN_TENSOR ("loss" or a parameter's gradient)
  int64_t nanRank = -1;         // ...on CARVE_FAULT_NAN_RANK only (default: every holder)
};

bool parseNanFaultEnv(Faults &f, std::string &error) {
  const char *s = std::getenv("CARVE_FAULT_NAN_STEP");
  const char *t = std::getenv("CARVE_FAULT_NAN_TENSOR");
  const char *r = std::getenv("CARVE_FAULT_NAN_RANK");
  if (!s && !t && !r)
    return true;
  if (!s || !t || !*t || !parseInt(s, f.nanStep) || f.nanStep < 0 ||
      (r && (!parseInt(r, f.nanRank) || f.nanRank < 0))) {
    error = "NaN injection needs CARVE_FAULT_NAN_STEP (a step >= 0) and CARVE_FAULT_NAN_TENSOR "
            "(loss or a parameter name); CARVE_FAULT_NAN_RANK is optional";
    return false;
  }
  f.nanTensor = t;
  return true;
}

/// CARVE_FAULT_NAN_TENSOR must be "loss" or a trainable parameter of some
/// rank's program, CARVE_FAULT_NAN_RANK a rank of the plan.
bool checkNanFault(const Faults &f, std::string &error) {
  if (f.nanRank >= carve_world_size()) {
    error = "CARVE_FAULT_NAN_RANK=" + std::to_string(f.nanRank) + " is not a rank of the plan";
    return false;
  }
  if (f.nanTensor.empty() || f.nanTensor == "loss")
    return true;
  for (int r = 0; r < carve_world_size(); ++r)
    if (const Program *q = carve_program_for_rank(r))
      for (int i = 0; i < q->numParams; ++i)
        if (q->params[i].trainable && f.nanTensor == q->params[i].name)
          return true;
  error = "CARVE_FAULT_NAN_TENSOR: '" + f.nanTensor +
          "' is neither loss nor a trainable parameter of the compiled model";
  return false;
}

bool parseFaultSignal(Faults &f, std::string &error) {
  const char *s = std::getenv("CARVE_FAULT_SIGNAL");
  if (!s)
    return true;
  std::string v = s;
  f.signal = v == "KILL" ? SIGKILL : v == "STOP" ? SIGSTOP : v == "SEGV" ? SIGSEGV : 0;
  if (f.signal == 0) {
    error = "CARVE_FAULT_SIGNAL is KILL, STOP or SEGV, not '" + v + "'";
    return false;
  }
  return true;
}

bool parseFaultEnv(int64_t &rank, int64_t &step, std::string &error) {
  const char *r = std::getenv("CARVE_FAULT_RANK");
  const char *s = std::getenv("CARVE_FAULT_STEP");
  if (!r && !s)
    return true;
  if (!r || !s || !parseInt(r, rank) || !parseInt(s, step) || rank < 0 || step < 0) {
    error = "fault injection needs both CARVE_FAULT_RANK and CARVE_FAULT_STEP as non-negative "
            "integers";
    return false;
  }
  return true;
}

/// All ranks call this once with their own validation result; true when all
/// passed. Only the lowest failing rank prints, so a problem every rank has
/// is reported once.
bool agree(Communicator &world, const std::string &error) {
  int64_t flag = error.empty() ? 0 : world.size() - world.rank();
  world.allReduce(&flag, 1, CommType::I64, ReduceOp::Max);
  if (flag != 0 && world.size() - flag == world.rank())
    printError(error);
  return flag == 0;
}

bool launchedByMpi() {
  for (const char *v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(v))
      return true;
  return false;
}

double secondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

/// A block of a tensor: its corner and its extent.
struct Block {
  std::vector<int64_t> offsets, shape;
};

/// Cuts the flat range [begin, end) of a row-major tensor of shape `dims`
/// into blocks, in flat order (at most 2 * rank - 1 of them).
std::vector<Block> flatRangeBlocks(int64_t begin, int64_t end, const std::vector<int64_t> &dims) {
  std::vector<Block> out;
  const size_t rank = dims.size();
  if (rank == 0) {
    if (begin < end)
      out.push_back({});
    return out;
  }
  std::vector<int64_t> stride(rank, 1);
  for (size_t d = rank - 1; d > 0; --d)
    stride[d - 1] = stride[d] * dims[d];
  while (begin < end) {
    // The outermost dimension at whose boundary `begin` lies and of which at
    // least one whole slice fits.
    for (size_t d = 0; d < rank; ++d) {
      if (begin % stride[d] != 0)
        continue;
      int64_t at = begin / stride[d] % dims[d];
      int64_t count = std::min((end - begin) / stride[d], dims[d] - at);
      if (count == 0)
        continue;
      Block b;
      b.offsets.assign(rank, 0);
      b.shape.assign(rank, 1);
      for (size_t e = 0; e <= d; ++e)
        b.offsets[e] = begin / stride[e] % dims[e];
      b.shape[d] = count;
      for (size_t e = d + 1; e < rank; ++e)
        b.shape[e] = dims[e];
      out.push_back(std::move(b));
      begin += count * stride[d];
      break;
    }
  }
  return out;
}

/// Copies block `b` of a row-major tensor of shape `dims`, whose flat
/// elements from `base` on are at `src`, to `dst` (row-major).
void copyBlockOut(const char *src, int64_t base, const std::vector<int64_t> &dims, const Block &b,
                  int elemBytes, char *dst) {
  const size_t rank = dims.size();
  if (rank == 0) {
    std::memcpy(dst, src, static_cast<size_t>(elemBytes));
    return;
  }
  std::vector<int64_t> stride(rank, 1);
  for (size_t d = rank - 1; d > 0; --d)
    stride[d - 1] = stride[d] * dims[d];
  const int64_t inner = b.shape[rank - 1];
  const int64_t rows = inner == 0 ? 0 : numelOf(b.shape) / inner;
  std::vector<int64_t> idx(rank, 0);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t at = 0;
    for (size_t d = 0; d < rank; ++d)
      at += (b.offsets[d] + idx[d]) * stride[d];
    std::memcpy(dst + r * inner * elemBytes, src + (at - base) * elemBytes,
                static_cast<size_t>(inner * elemBytes));
    for (size_t d = rank - 1; d-- > 0;) {
      if (++idx[d] < b.shape[d])
        break;
      idx[d] = 0;
    }
  }
}

/// One shard a rank writes: a block of the full tensor, and the same
/// elements as a block of the rank's tensor-parallel piece.
struct PlannedShard {
  std::string tensor, role, dtype, key;
  std::vector<int64_t> fullShape;
  Block global, local;
  std::vector<int64_t> localDims;
  int64_t arenaOffset = 0;
  int64_t base = 0; // the first element of the piece the arena slot holds
  int elemBytes = 4;
};

/// World rank `rank`'s place on the mesh of program `p`.
Mesh meshOf(const Program &p, int rank) {
  Mesh m;
  m.dp = p.dp, m.tp = p.tp, m.pp = p.pp;
  m.ppRank = rank / (m.dp * m.tp);
  m.dpRank = rank / m.tp % m.dp;
  m.tpRank = rank % m.tp;
  return m;
}

/// The shards world rank `rank` writes. Every element of every tensor is
/// written once: a replicated tensor by dp rank 0 (tp rank 0 unless it is
/// tp-split), a ZeRO-sharded one by every dp rank (its chunk), a parameter
/// that several pipeline stages hold by the lowest of them. Any rank can
/// compute any rank's shards: every program is linked into every executable.
std::vector<PlannedShard> planShards(int rank) {
  std::vector<PlannedShard> out;
  const Program *p = carve_program_for_rank(rank);
  if (!p)
    return out;
  const Mesh m = meshOf(*p, rank);
  std::set<std::string> earlierStages;
  for (int s = 0; s < m.ppRank; ++s)
    if (const Program *q = carve_program_for_rank((s * m.dp + m.dpRank) * m.tp + m.tpRank))
      for (int i = 0; i < q->numParams; ++i)
        earlierStages.insert(q->params[i].name);
  for (bool state : {false, true})
    for (const Slot &s : state ? optimizerSlots(*p) : modelSlots(*p)) {
      const TensorSpec &spec = *s.spec;
      const SlotLayout l = layoutOf(spec, state, m);
      if (earlierStages.count(spec.name) || (!l.zero && m.dpRank != 0) ||
          (spec.tpDim < 0 && m.tpRank != 0))
        continue;
      PlannedShard base;
      base.tensor = s.name;
      base.role = state ? "optimizer_state" : spec.trainable ? "parameter" : "buffer";
      base.dtype = state ? "F32" : dtypeName(spec.dtype);
      base.fullShape = globalShapeOf(spec);
      base.localDims = shapeOf(spec);
      base.arenaOffset = s.offset;
      base.elemBytes = l.elemBytes;
      int64_t begin = 0, end = spec.numel;
      if (l.zero) {
        begin = std::min<int64_t>(m.dpRank * spec.zeroChunk, spec.numel);
        end = std::min<int64_t>(begin + spec.zeroChunk, spec.numel);
        base.base = begin;
      }
      for (Block &b : flatRangeBlocks(begin, end, base.localDims)) {
        // A tp piece is one run of every group along tpDim: cut the block at
        // group boundaries and move each part to its place in the full tensor.
        std::vector<Block> parts;
        if (spec.tpDim < 0 || m.tp == 1) {
          parts.push_back(b);
        } else {
          const int d = spec.tpDim;
          const int64_t run = base.localDims[d] / spec.tpGroups;
          for (int64_t i = b.offsets[d]; i < b.offsets[d] + b.shape[d];) {
            int64_t stop = std::min(b.offsets[d] + b.shape[d], (i / run + 1) * run);
            Block part = b;
            part.offsets[d] = i;
            part.shape[d] = stop - i;
            parts.push_back(part);
            i = stop;
          }
        }
        for (Block &local : parts) {
          PlannedShard sh = base;
          sh.local = local;
          sh.global = local;
          if (spec.tpDim >= 0 && m.tp > 1) {
            const int d = spec.tpDim;
            const int64_t run = base.localDims[d] / spec.tpGroups;
            const int64_t group = local.offsets[d] / run;
            sh.global.offsets[d] = group * (base.fullShape[d] / spec.tpGroups) + m.tpRank * run +
                                   local.offsets[d] % run;
          }
          sh.key = s.name;
          if (sh.global.shape != sh.fullShape) {
            sh.key += "@";
            for (size_t i = 0; i < sh.global.offsets.size(); ++i)
              sh.key += (i ? "," : "") + std::to_string(sh.global.offsets[i]);
          }
          out.push_back(std::move(sh));
        }
      }
    }
  return out;
}

/// The manifest of a checkpoint of the whole world at `step` (`lossScale` 0:
/// not an fp16 program, nothing recorded).
CheckpointManifest buildManifest(const Program &p, int64_t step, double lossScale,
                                 int64_t lossScaleGoodSteps) {
  CheckpointManifest m;
  m.model = p.model ? p.model : p.name;
  m.description = p.description ? p.description : "";
  m.worldSize = carve_world_size();
  m.dp = p.dp, m.tp = p.tp, m.pp = p.pp, m.zeroStage = p.zeroStage;
  m.microBatches = p.numMicroBatches;
  m.step = step;
  m.optimizer = optimizerKindName(p.optimizer);
  // The generated step derives all three from the step count: AdamW's
  // state['step'] is step + 1 after update `step`, the schedule's t and the
  // batch index are the 0-based step.
  m.optimizerStep = step;
  m.lrStep = step;
  m.dataStep = step;
  m.globalBatch = p.globalBatch;
  m.seqLen = p.seqLen;
  m.lossScale = lossScale;
  m.lossScaleGoodSteps = lossScaleGoodSteps;
  std::map<std::string, size_t> index;
  for (int r = 0; r < m.worldSize; ++r)
    for (PlannedShard &s : planShards(r)) {
      auto it = index.find(s.tensor);
      if (it == index.end()) {
        it = index.emplace(s.tensor, m.tensors.size()).first;
        m.tensors.push_back({s.tensor, s.role, s.dtype, s.fullShape, {}});
      }
      m.tensors[it->second].shards.push_back(
          {checkpointRankFile(r), s.key, r, s.global.offsets, s.global.shape});
    }
  return m;
}

/// Removes `path` and everything below it; false (errno set) on a failure.
bool removeTree(const std::string &path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0)
    return errno == ENOENT;
  if (S_ISDIR(st.st_mode)) {
    DIR *d = ::opendir(path.c_str());
    if (!d)
      return false;
    std::vector<std::string> names;
    while (struct dirent *e = ::readdir(d))
      if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, ".."))
        names.push_back(e->d_name);
    ::closedir(d);
    for (const std::string &n : names)
      if (!removeTree(path + "/" + n))
        return false;
    return ::rmdir(path.c_str()) == 0;
  }
  return ::unlink(path.c_str()) == 0;
}

/// Removes a step folder so that no reader ever sees it half-deleted: it is
/// renamed to a hidden name first (readers skip it), then deleted.
bool removeStepFolder(const std::string &dir, const std::string &name, std::string &error) {
  std::string hidden = dir + "/.del-" + name;
  if (std::rename((dir + "/" + name).c_str(), hidden.c_str()) != 0 || !removeTree(hidden)) {
    error = dir + "/" + name + ": cannot remove: " + std::strerror(errno);
    return false;
  }
  return true;
}

/// Milliseconds to sleep at each stage of a save (CARVE_TEST_SAVE_DELAY_MS):
/// a test-only hook that widens the window in which a test kills a saving run.
int64_t testSaveDelayMs() {
  const char *v = std::getenv("CARVE_TEST_SAVE_DELAY_MS");
  int64_t ms = 0;
  return v && parseInt(v, ms) && ms > 0 ? ms : 0;
}

/// Writes checkpoint `step` of the whole world into `dir` (see checkpoint.h):
/// every rank writes its shards into DIR/.tmp-step-N, world rank 0 writes the
/// manifest, renames the folder to DIR/step-N, then rewrites DIR/latest and
/// removes the oldest step folders beyond `keep` (0: none). Every rank joins.
void saveCheckpoint(Communicator &world, const Program &p, const char *arena,
                    const std::string &dir, int64_t step, int64_t keep, double lossScale,
                    int64_t lossScaleGoodSteps) {
  std::string error;
  const std::string name = checkpointFolderName(step);
  const std::string tmp = dir + "/.tmp-" + name;
  const int64_t delay = testSaveDelayMs();
  auto pause = [&] {
    if (delay)
      ::usleep(static_cast<useconds_t>(delay * 1000));
  };
  if (worldRank == 0) {
    if (!makeDirs(dir, error))
      die(error);
    // Left over by a run killed while saving: never complete, safe to drop.
    if (DIR *d = ::opendir(dir.c_str())) {
      std::vector<std::string> stale;
      while (struct dirent *e = ::readdir(d))
        if (!std::strncmp(e->d_name, ".tmp-step-", 10) ||
            !std::strncmp(e->d_name, ".del-step-", 10))
          stale.push_back(dir + "/" + e->d_name);
      ::closedir(d);
      for (const std::string &s : stale)
        removeTree(s);
    }
    if (::mkdir(tmp.c_str(), 0755) != 0)
      die(tmp + ": cannot create the folder: " + std::strerror(errno));
  }
  world.barrier();

  std::vector<PlannedShard> shards = planShards(worldRank);
  std::vector<std::vector<char>> storage;
  std::vector<SafetensorsEntry> entries;
  storage.reserve(shards.size());
  for (const PlannedShard &s : shards) {
    storage.emplace_back(static_cast<size_t>(numelOf(s.global.shape) * s.elemBytes));
    copyBlockOut(arena + s.arenaOffset, s.base, s.localDims, s.local, s.elemBytes,
                 storage.back().data());
    entries.push_back({s.key, s.dtype, s.global.shape, storage.back().data()});
  }
  const std::vector<std::pair<std::string, std::string>> meta = {
      {"format", "carve-checkpoint-2"},
      {"step", std::to_string(step)},
      {"rank", std::to_string(worldRank)},
      {"program", p.name}};
  pause();
  if (!writeSafetensors(tmp + "/" + checkpointRankFile(worldRank), entries, meta, error))
    die(error);
  storage.clear();
  world.barrier(); // every rank's file is written and fsynced

  if (worldRank == 0) {
    pause();
    const std::string final = dir + "/" + name;
    struct stat st;
    bool ok =
        writeFileAtomic(tmp + "/manifest.json",
                        manifestToJson(buildManifest(p, step, lossScale, lossScaleGoodSteps)),
                        error) &&
        syncFolder(tmp, error);
    if (ok && ::stat(final.c_str(), &st) == 0) {
      // Replacing a step folder of an earlier run: swap it out in one rename
      // so that a complete folder of that name exists at every moment.
      if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final.c_str(), RENAME_EXCHANGE) != 0 ||
          !removeTree(tmp)) {
        error = final + ": cannot replace: " + std::strerror(errno);
        ok = false;
      }
    } else if (ok && std::rename(tmp.c_str(), final.c_str()) != 0) {
      error = final + ": cannot rename the finished checkpoint into place: " + std::strerror(errno);
      ok = false;
    }
    ok = ok && syncFolder(dir, error);
    pause();
    ok = ok && writeFileAtomic(dir + "/latest", name + "\n", error);
    if (ok && keep > 0) {
      auto all = listCheckpoints(dir);
      for (size_t i = 0; ok && i + keep < all.size(); ++i) {
        std::string old = all[i].second.substr(all[i].second.rfind('/') + 1);
        if (old != name)
          ok = removeStepFolder(dir, old, error);
      }
    }
    if (!ok)
      die(error);
  }
  world.barrier();
}

/// Every rank's trace events, on world rank 0 (`all[r]` from rank r).
void gatherTraces(Communicator &world, const Tracer &tracer,
                  std::vector<std::vector<Tracer::Event>> &all) {
  const int fields = 6;
  std::vector<double> mine;
  for (const Tracer::Event &e : tracer.events())
    mine.insert(mine.end(), {(double)e.kind, (double)e.microBatch, (double)e.stage, (double)e.step,
                             e.begin, e.end});
  if (world.rank() != 0) {
    int64_t n = (int64_t)mine.size();
    world.send(&n, sizeof n, 0, 5);
    world.send(mine.data(), n * sizeof(double), 0, 6);
    return;
  }
  all.assign(world.size(), {});
  for (int r = 0; r < world.size(); ++r) {
    std::vector<double> v = mine;
    if (r > 0) {
      int64_t n = 0;
      world.recv(&n, sizeof n, r, 5);
      v.resize(n);
      world.recv(v.data(), n * sizeof(double), r, 6);
    }
    for (size_t i = 0; i + fields <= v.size(); i += fields)
      all[r].push_back(
          {(char)v[i], (int)v[i + 1], (int)v[i + 2], (int64_t)v[i + 3], v[i + 4], v[i + 5]});
  }
}

/// Writes `text` to `path` through a temporary file and a rename.
bool writeTextFile(const std::string &path, const std::string &text, std::string &error) {
  std::string tmp = path + ".tmp";
  FILE *f = std::fopen(tmp.c_str(), "wb");
  if (!f) {
    error = path + ": cannot write: " + std::strerror(errno);
    return false;
  }
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  ok = std::fclose(f) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    error = path + ": cannot write: " + std::strerror(errno);
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

/// Whether a person watches stdout (--progress auto). Under mpirun a rank's
/// stdout is a pseudo-terminal of the launcher whatever mpirun's own output
/// is, so there only `carve run`'s answer (CARVE_STDOUT_TTY=1) counts.
bool stdoutIsTerminal() {
  if (!::isatty(STDOUT_FILENO))
    return false;
  if (!launchedByMpi())
    return true;
  const char *v = std::getenv("CARVE_STDOUT_TTY");
  return v && std::strcmp(v, "1") == 0;
}

/// --on-nan: the check between the gradients and the optimizer. Every rank
/// flags a non-finite loss or gradient norm (the norm sums every gradient
/// element's square, so it is non-finite exactly when some gradient element
/// is, or overflows); an all-reduce over the world makes every rank take the
/// same decision, and on a non-finite step a second one finds the first
/// tensor at fault: the loss, else the first gradient in model order.
class NanGuard : public StepHooks {
public:
  NanGuard(Communicator &world, const Program &p, const Mesh &m, const Faults &f, char *hostArena)
      : world(world), program(p), mesh(m), faults(f), host(hostArena) {
    // Model order: every program's trainable parameters, lowest rank first
    // (pipeline stages in order), each name once.
    std::set<std::string> seen;
    for (int r = 0; r < carve_world_size(); ++r)
      if (const Program *q = carve_program_for_rank(r))
        for (int i = 0; i < q->numParams; ++i)
          if (q->params[i].trainable && seen.insert(q->params[i].name).second)
            order.push_back(q->params[i].name);
  }

  /// Whether `name` is something CARVE_FAULT_NAN_TENSOR may poison.
  bool knows(const std::string &name) const {
    return name == "loss" || std::find(order.begin(), order.end(), name) != order.end();
  }

  void beginStep() {
    asked = false;
    nonFinite = false;
    culprit.clear();
  }

  void gradientsReady(StepContext &ctx) override {
    if (ctx.step != faults.nanStep || (faults.nanRank >= 0 && faults.nanRank != world.rank()))
      return;
    if (faults.nanTensor == "loss") {
      ctx.loss = std::nanf("");
      return;
    }
    for (int i = 0; i < program.numParams; ++i)
      if (program.params[i].trainable && faults.nanTensor == program.params[i].name &&
          gradCount(program.params[i]) > 0) {
        float nan = std::nanf("");
        std::string error;
        char *at = ctx.arena + program.params[i].gradOffset;
        if (!program.device)
          std::memcpy(at, &nan, sizeof nan);
        else if (!program.device->toDevice(at, reinterpret_cast<const char *>(&nan), sizeof nan,
                                           error))
          die(error);
      }
  }

  bool updateAllowed(StepContext &ctx, double gradNorm) override {
    asked = true;
    return check(ctx, std::isfinite(gradNorm));
  }

  /// For a program whose step does not call the hooks: the loss after the
  /// update (which cannot be skipped any more).
  void checkAfterStep(StepContext &ctx) { check(ctx, true); }

  bool asked = false;     // the step called updateAllowed
  bool nonFinite = false; // this step had a non-finite loss or gradient
  std::string culprit;    // "loss" or the first gradient's parameter name
  std::string weightHint; // the first non-finite parameter (weights), if any

private:
  bool check(StepContext &ctx, bool normFinite) {
    int64_t flag = std::isfinite(ctx.loss) && normFinite ? 0 : 1;
    world.allReduce(&flag, 1, CommType::I64, ReduceOp::Max);
    if (flag == 0)
      return true;
    nonFinite = true;
    // The first tensor at fault, as (count - position): the largest wins.
    const int64_t count = static_cast<int64_t>(order.size()) + 1;
    int64_t first[2] = {0, 0}; // gradients (loss = position 0), then weights
    if (!std::isfinite(ctx.loss))
      first[0] = count;
    // On a device the tensors are looked at in the host copy of the arena
    // (only now, when something is known to be wrong).
    const char *arena = ctx.arena;
    if (program.device) {
      std::string error;
      if (!program.device->toHost(host, ctx.arena, program.arenaBytes, error))
        die(error);
      arena = host;
    }
    for (int pass = 0; pass < 2; ++pass)
      for (int i = 0; i < program.numParams && first[pass] == 0; ++i) {
        const TensorSpec &s = program.params[i];
        if (!s.trainable)
          continue;
        const float *v =
            reinterpret_cast<const float *>(arena + (pass == 0 ? s.gradOffset : s.offset));
        const int64_t n = pass == 0 ? gradCount(s) : s.paramZero ? s.zeroChunk : s.numel;
        if (pass == 1 && s.dtype != DType::F32)
          continue;
        for (int64_t j = 0; j < n; ++j)
          if (!std::isfinite(v[j])) {
            first[pass] = count - 1 - positionOf(s.name);
            break;
          }
      }
    world.allReduce(first, 2, CommType::I64, ReduceOp::Max);
    culprit = first[0] == count ? "loss" : first[0] > 0 ? order[count - 1 - first[0]] : "";
    weightHint = first[1] > 0 ? order[count - 1 - first[1]] : "";
    if (culprit.empty()) // the norm overflowed with finite elements
      culprit = "the gradient norm";
    return false;
  }

  int64_t positionOf(const char *name) const {
    return std::find(order.begin(), order.end(), name) - order.begin();
  }

  /// The synchronized gradient elements this rank holds: its ZeRO-2/3 chunk
  /// (the last ones may be short or empty), else the whole (tp-local) tensor.
  int64_t gradCount(const TensorSpec &s) const {
    if (program.zeroStage < 2 || s.zeroChunk <= 0)
      return s.numel;
    return std::max<int64_t>(0,
                             std::min<int64_t>(s.zeroChunk, s.numel - mesh.dpRank * s.zeroChunk));
  }

  Communicator &world;
  const Program &program;
  const Mesh &mesh;
  const Faults &faults;
  char *host; // the host copy of a device arena (unused on the CPU)
  std::vector<std::string> order;
};

/// "non-finite gradient of 'fc1.weight' (the first in model order; loss 2.3)"
/// or "the loss is nan (first non-finite parameter: 'fc1.weight')".
std::string describeNonFinite(const NanGuard &g, const StepContext &ctx) {
  char loss[32];
  std::snprintf(loss, sizeof loss, "%.9g", static_cast<double>(ctx.loss));
  std::string text;
  if (g.culprit == "loss")
    text = std::isfinite(ctx.loss) ? std::string("the loss is not finite on another rank")
                                   : std::string("the loss is ") + loss;
  else if (g.culprit == "the gradient norm")
    text = "the gradient norm overflowed (loss " + std::string(loss) + ")";
  else
    text =
        "non-finite gradient of '" + g.culprit + "' (the first in model order; loss " + loss + ")";
  if (!g.weightHint.empty())
    text += "; the first non-finite parameter is '" + g.weightHint + "'";
  return text;
}

int finish(int code) {
  finalizeComm();
  return code;
}

} // namespace

int main(int argc, char **argv) {
  // mpirun/srun with MPI, or a plain launcher's RANK/WORLD_SIZE/MASTER_ADDR/
  // MASTER_PORT (a TCP world), or one rank alone.
  std::unique_ptr<Communicator> world;
  if (launchedByMpi()) {
    world = makeMpiWorld(&argc, &argv);
  } else {
    // Joining a TCP world waits for the other ranks: bound it by
    // --collective-timeout already (the arguments are checked properly below).
    for (int i = 1; i + 1 < argc; ++i)
      if (!std::strcmp(argv[i], "--collective-timeout")) {
        char *end = nullptr;
        double v = std::strtod(argv[i + 1], &end);
        if (end && *end == '\0' && v >= 0 && std::isfinite(v))
          setCollectiveTimeout(v);
      }
    std::string error;
    world = makeEnvWorld(error);
    if (!world && !error.empty()) {
      std::fprintf(stderr, "carve: error: %s\n", error.c_str());
      return 1;
    }
    if (!world)
      world = makeSelfCommunicator();
  }
  worldRank = world->rank();
  worldSize = world->size();

  // Step 1: --help, the arguments and the rank count. Every launched process
  // joins these all-reduces over the world, whatever the rank count, so they
  // cannot hang; the lowest failing rank (rank 0 when all fail) reports.
  int64_t help = 0;
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h"))
      help = 1;
  world->allReduce(&help, 1, CommType::I64, ReduceOp::Max);
  if (help) {
    if (worldRank == 0)
      std::fputs(kUsage, stdout);
    return finish(0);
  }
  Options opts;
  std::string error;
  Faults faults;
  int64_t &faultRank = faults.rank, &faultStep = faults.step;
  bool argsOk = parseArgs(argc, argv, opts, error) &&
                parseFaultEnv(faultRank, faultStep, error) &&
                parseFaultSignal(faults, error) && parseNanFaultEnv(faults, error) &&
                checkNanFault(faults, error);
  if (argsOk)
    setCollectiveTimeout(opts.collectiveTimeout);
  int planRanks = carve_world_size();
  if (argsOk && planRanks != worldSize) {
    const Program *p0 = carve_program_for_rank(0);
    std::string plan = p0 ? "plan dp=" + std::to_string(p0->dp) : "plan unknown";
    if (p0 && p0->tp > 1)
      plan += ", tp=" + std::to_string(p0->tp);
    if (p0 && p0->pp > 1)
      plan += ", pp=" + std::to_string(p0->pp);
    else if (p0 && p0->tp == 1 && p0->dp != planRanks)
      plan += " with " + std::to_string(planRanks / std::max(p0->dp, 1)) + " ranks per replica";
    error = "this program was compiled for " + std::to_string(planRanks) +
            (planRanks == 1 ? " rank (" : " ranks (") + plan + "), launched on " +
            std::to_string(worldSize) + (launchedByMpi() ? "" : " (not under mpirun)") +
            "; use `carve run " + outputDir() + " -n " + std::to_string(planRanks) + "`";
    argsOk = false;
  }
  if (!agree(*world, argsOk ? std::string() : error))
    return finish(1);

  // Which ranks share this host (a device per rank on it): from the host
  // names, so that mpirun, srun and plain launchers need no variables of their own.
  int localRank = 0, localRanks = 0;
  {
    char name[64] = {};
    ::gethostname(name, sizeof name - 1);
    std::vector<char> all(64 * static_cast<size_t>(worldSize));
    world->allGather(name, all.data(), 64, CommType::U8);
    for (int r = 0; r < worldSize; ++r)
      if (!std::strncmp(all.data() + 64 * static_cast<size_t>(r), name, 64)) {
        localRank += r < worldRank;
        ++localRanks;
      }
  }

  // Step 2: everything else, before any work.
  const Program *program = carve_program_for_rank(worldRank);
  const DeviceTarget *device = program ? program->device : nullptr;
  char *deviceArena = nullptr; // the step's arena on the device; `arena` is then its host copy
  std::unique_ptr<DataLoader> loader;
  WeightSource weights;
  char *arena = nullptr;
  Mesh mesh;
  if (!program) {
    error = "the compiled plan has no program for rank " + std::to_string(worldRank);
  } else if (!program->step || (program->numInputs > 0 && !program->inputs) ||
             (program->numParams > 0 && !program->params)) {
    error = std::string("program '") + program->name +
            "' is incomplete (no step function or tensor tables)";
  } else if (program->worldSize != planRanks || program->dp < 1 || planRanks % program->dp != 0) {
    error = std::string("program '") + program->name + "' is for " +
            std::to_string(program->worldSize) + " ranks with dp=" + std::to_string(program->dp) +
            ", the plan has " + std::to_string(planRanks) + " ranks";
  } else if (program->pp < 1 || program->tp < 1 ||
             (int64_t)program->tp * program->pp * program->dp != planRanks) {
    error = std::string("program '") + program->name + "' has dp=" + std::to_string(program->dp) +
            ", tp=" + std::to_string(program->tp) + ", pp=" + std::to_string(program->pp) +
            ", which does not make its plan's " + std::to_string(planRanks) + " ranks";
  } else if (program->ppRank != worldRank / (program->dp * program->tp)) {
    error = std::string("program '") + program->name + "' is for pipeline rank " +
            std::to_string(program->ppRank) + ", but rank " + std::to_string(worldRank) +
            " is on pipeline rank " + std::to_string(worldRank / (program->dp * program->tp));
  } else {
    // pp is the outermost mesh axis, then dp: rank = (ppRank * dp + dpRank) * tp + tpRank.
    mesh.dp = program->dp;
    mesh.tp = program->tp;
    mesh.pp = program->pp;
    mesh.ppRank = worldRank / (mesh.dp * mesh.tp);
    mesh.dpRank = worldRank / mesh.tp % mesh.dp;
    mesh.tpRank = worldRank % mesh.tp;
    if (opts.cudaGraph && !device)
      error = std::string("--cuda-graph needs a program compiled with --target cuda; '") +
              program->name + "' is for the CPU";
    else if (checkShardedSpecs(*program, mesh, error))
      loader = openDataLoader(*program, mesh.dpRank, opts.data, opts.dataType, error);
    if (loader)
      openWeights(*program, opts, weights, error);
    if (error.empty() && worldRank == 0 && !opts.save.empty())
      checkSaveDir(opts.save, error);
    if (error.empty() && worldRank == 0 && !opts.log.empty())
      MetricsLog::checkWritable(opts.log, error);
    if (error.empty() && worldRank == 0 && !opts.trace.empty())
      MetricsLog::checkWritable(opts.trace, error);
    // The CUDA target: this rank's device first, so that a plan too large for
    // it is reported as such (not as a failed host allocation).
    if (error.empty() && device)
      device->open(worldRank, localRank, localRanks, program->arenaBytes, error);
    if (error.empty()) {
      size_t bytes =
          (static_cast<size_t>(std::max<int64_t>(program->arenaBytes, 1)) + 63) / 64 * 64;
      arena = static_cast<char *>(std::aligned_alloc(64, bytes));
      if (!arena)
        error = "cannot allocate the " + std::to_string(program->arenaBytes) +
                "-byte arena of program '" + program->name + "'";
      else
        std::memset(arena, 0, bytes);
    }
    // The arena's initial contents: read here, so that a truncated or
    // corrupt checkpoint file stops every rank cleanly.
    if (error.empty())
      fillArena(*program, weights, arena, mesh, error);
    // The device arena and its initial contents.
    if (error.empty() && device) {
      deviceArena = device->allocArena(std::max<int64_t>(program->arenaBytes, 1), error);
      if (deviceArena)
        device->toDevice(deviceArena, arena, program->arenaBytes, error);
    }
  }
  if (!agree(*world, error))
    return finish(1);

  // Step 3: the communicators.
  MetricsLog log;
  if (worldRank == 0 && !opts.log.empty() && !log.open(opts.log, error))
    die(error);
  // One group per mesh axis: the ranks that differ only in that axis. An
  // axis of size 1 is a one-rank group; an axis as large as the world is it.
  std::unique_ptr<Communicator> dpGroup, tpGroup, ppGroup;
  // An axis as large as the world is split off too, so that timeout messages
  // name the axis.
  auto axisGroup = [&](int size, int color, int key,
                       const char *name) -> std::unique_ptr<Communicator> {
    std::unique_ptr<Communicator> c = size == 1 ? makeSelfCommunicator() : world->split(color, key);
    c->setName(name);
    return c;
  };
  tpGroup = axisGroup(mesh.tp, mesh.ppRank * mesh.dp + mesh.dpRank, mesh.tpRank, "tp");
  dpGroup = axisGroup(mesh.dp, mesh.ppRank * mesh.tp + mesh.tpRank, mesh.dpRank, "dp");
  ppGroup = axisGroup(mesh.pp, mesh.dpRank * mesh.tp + mesh.tpRank, mesh.ppRank, "pp");
  Communicator *dpComm = dpGroup ? dpGroup.get() : world.get();
  Communicator *tpComm = tpGroup ? tpGroup.get() : world.get();
  Communicator *ppComm = ppGroup ? ppGroup.get() : world.get();
  // On a device the step's collectives run on device communicators (NCCL),
  // one per mesh axis, bootstrapped over the host groups.
  std::unique_ptr<Communicator> dpDevice, tpDevice, ppDevice;
  if (device) {
    auto deviceGroup = [&](Communicator &host) {
      std::string why;
      std::unique_ptr<Communicator> c = device->makeComm(host, why);
      if (!c)
        die("cannot create the " + host.name() + " device communicator: " + why);
      c->setName(host.name());
      return c;
    };
    tpDevice = deviceGroup(*tpComm);
    dpDevice = deviceGroup(*dpComm);
    ppDevice = deviceGroup(*ppComm);
  }

  // Every rank's persistent bytes, for rank 0's report (gathered even when
  // quiet: ranks may disagree on --quiet, never on a collective).
  // Parameter elements this rank holds: its tp piece of each parameter and
  // buffer, or its ZeRO-3 chunk.
  int64_t elements = 0;
  for (int i = 0; i < program->numParams; ++i)
    elements +=
        program->params[i].paramZero ? program->params[i].zeroChunk : program->params[i].numel;
  const int64_t mine[5] = {program->paramBytes, program->gradBytes, program->stateBytes, elements,
                           program->activationBytes};
  std::vector<int64_t> memory(5 * static_cast<size_t>(worldSize));
  world->allGather(mine, memory.data(), 5, CommType::I64);

  int64_t start = weights.step;
  int64_t end = start + opts.steps;
  bool tokens = program->dataKind == DataKind::Tokens;
  double itemsPerStep = static_cast<double>(program->globalBatch) *
                        (tokens ? static_cast<double>(program->seqLen) : 1.0);
  const char *unit = tokens ? "tokens" : "samples";
  bool talk = worldRank == 0 && !opts.quiet;
  if (talk) {
    std::printf("carve: %s on %d rank%s: %s\n", program->model ? program->model : program->name,
                worldSize, worldSize == 1 ? "" : "s",
                program->description ? program->description : "");
    std::printf("carve: data %s; weights from %s; steps %lld to %lld\n", loader->describe().c_str(),
                opts.load.empty() ? weights.model.path().c_str() : opts.load.c_str(),
                static_cast<long long>(start), static_cast<long long>(end - 1));
    bool reported = false;
    for (int r = 0; r < worldSize; ++r)
      reported |= memory[5 * r] != 0 || memory[5 * r + 1] != 0 || memory[5 * r + 2] != 0;
    if (reported)
      for (int r = 0; r < worldSize; ++r) {
        std::string where =
            "dp " + std::to_string(r / mesh.tp % mesh.dp) + ", tp " + std::to_string(r % mesh.tp);
        if (mesh.pp > 1)
          where += ", pp " + std::to_string(r / (mesh.dp * mesh.tp));
        std::printf("carve: memory rank %d (%s): parameters %lld bytes (%lld "
                    "elements), gradients %lld bytes, optimizer state %lld bytes",
                    r, where.c_str(), static_cast<long long>(memory[5 * r]),
                    static_cast<long long>(memory[5 * r + 3]),
                    static_cast<long long>(memory[5 * r + 1]),
                    static_cast<long long>(memory[5 * r + 2]));
        if (memory[5 * r + 4] > 0)
          std::printf(", activations %lld bytes", static_cast<long long>(memory[5 * r + 4]));
        std::printf("\n");
      }
    std::fflush(stdout);
  }

  // fp16: dynamic loss scaling (GradScaler's defaults: halve on overflow,
  // double after 2000 good steps in a row), from --loss-scale, else from the
  // checkpoint resumed, else 65536.
  StepContext ctx;
  const bool fp16 = program->precision && !std::strcmp(program->precision, "fp16");
  ctx.lossScale = fp16 ? static_cast<float>(opts.lossScale) : 1.0f;
  int64_t goodSteps = 0, overflowSteps = 0;
  if (fp16 && !opts.lossScaleSet && weights.sharded && weights.manifest.lossScale > 0) {
    ctx.lossScale = static_cast<float>(weights.manifest.lossScale);
    goodSteps = weights.manifest.lossScaleGoodSteps;
    if (talk) {
      std::printf("carve: fp16 loss scale %g (%lld good steps) from the checkpoint\n",
                  static_cast<double>(ctx.lossScale), static_cast<long long>(goodSteps));
      std::fflush(stdout);
    }
  }

  // Checkpoints at every multiple of --save-every and after the last step,
  // never the same step twice.
  int64_t lastSaved = -1;
  auto saveAt = [&](int64_t step) {
    if (opts.save.empty() || step == lastSaved)
      return;
    std::string why;
    if (device && !device->toHost(arena, deviceArena, program->arenaBytes, why))
      die(why);
    saveCheckpoint(*world, *program, arena, opts.save, step, opts.keep,
                   fp16 ? ctx.lossScale : 0.0, goodSteps);
    lastSaved = step;
    if (talk) {
      std::printf("carve: saved %s/%s\n", opts.save.c_str(), checkpointFolderName(step).c_str());
      std::fflush(stdout);
    }
  };

  // Step 4: training.
  ctx.arena = device ? deviceArena : arena;
  ctx.dpComm = device ? dpDevice.get() : dpComm;
  ctx.tpComm = device ? tpDevice.get() : tpComm;
  ctx.tpRank = mesh.tpRank;
  ctx.dpRank = mesh.dpRank;
  ctx.ppComm = device ? ppDevice.get() : ppComm;
  ctx.ppRank = mesh.ppRank;
  Tracer tracer;
  if (!opts.trace.empty()) {
    world->barrier(); // a common time origin, to a barrier's precision
    tracer = Tracer();
    ctx.tracer = &tracer;
  }
  NanGuard guard(*world, *program, mesh, faults, arena);
  ctx.hooks = &guard;
  ctx.cudaGraph = opts.cudaGraph && program->pp == 1;
  if (opts.cudaGraph && program->pp > 1 && talk) {
    std::printf("carve: --cuda-graph: pipeline-parallel programs are not captured (their "
                "schedule runs the micro-batches from the host); running as they are\n");
    std::fflush(stdout);
  }
  bool graphReported = false;
  ProgressMode mode = opts.quiet || worldRank != 0 ? ProgressMode::None
                      : opts.progress == "bar"     ? ProgressMode::Bar
                      : opts.progress == "lines"   ? ProgressMode::Lines
                      : opts.progress == "none"    ? ProgressMode::None
                      : stdoutIsTerminal()         ? ProgressMode::Bar
                                                   : ProgressMode::Lines;
  ProgressDisplay progress(mode, start, end, unit, itemsPerStep, opts.progressEvery);
  int64_t skippedSteps = 0;
  auto begin = std::chrono::steady_clock::now();
  for (int64_t k = start; k < end; ++k) {
    setCommStep(k);
    if (worldRank == faultRank && k == faultStep) {
      std::fflush(stdout);
      std::raise(faults.signal);
    }
    auto stepBegin = std::chrono::steady_clock::now();
    if (!loader->load(k, arena, error))
      die(error);
    if (device)
      for (int i = 0; i < program->numInputs; ++i) {
        const TensorSpec &in = program->inputs[i];
        if (!device->toDevice(deviceArena + in.offset, arena + in.offset,
                              in.numel * dtypeSize(in.dtype), error))
          die(error);
      }
    ctx.step = k;
    ctx.loss = 0;
    ctx.lr = 0;
    ctx.gradNorm = -1;
    double traceBegin = tracer.now();
    guard.beginStep();
    program->step(ctx);
    if (device && !device->synchronize(error))
      die("step " + std::to_string(k) + ": " + error);
    if (!guard.asked)
      guard.checkAfterStep(ctx);
    if (ctx.graphNodes > 0 && !graphReported) {
      graphReported = true;
      if (talk) {
        progress.interrupt();
        std::printf("carve: step %lld: forward and backward captured in a CUDA graph of %lld "
                    "nodes, replayed from now on\n",
                    static_cast<long long>(k), static_cast<long long>(ctx.graphNodes));
        std::fflush(stdout);
      }
    }
    // fp16: gradients that overflowed at this scale are expected now and then.
    const bool overflow = fp16 && guard.nonFinite && guard.asked && guard.culprit != "loss";
    const bool stop = guard.nonFinite && !overflow && (!opts.skipNonFinite || !guard.asked);
    if (guard.nonFinite && !stop && !overflow)
      ++skippedSteps;
    const float usedScale = ctx.lossScale;
    if (overflow) {
      ++overflowSteps;
      goodSteps = 0;
      ctx.lossScale = std::max(1.0f, ctx.lossScale * 0.5f);
    } else if (fp16 && !guard.nonFinite && ++goodSteps == 2000) {
      goodSteps = 0;
      ctx.lossScale = std::min(1e30f, ctx.lossScale * 2.0f);
    }
    if (ctx.tracer) {
      // The step's time outside the instruction list: synchronization, optimizer.
      double inside = 0;
      for (const Tracer::Event &e : tracer.events())
        if (e.step == k && e.kind != 'O')
          inside = std::max(inside, e.end);
      if (program->pp == 1 && program->numMicroBatches == 1)
        tracer.add({'S', -1, 0, k, traceBegin, tracer.now()}); // one whole step
      else
        tracer.add({'O', -1, program->ppRank, k, std::max(inside, traceBegin), tracer.now()});
    }
    double seconds = secondsSince(stepBegin);
    double rate = seconds > 0 ? itemsPerStep / seconds : 0;
    if (overflow && talk) {
      progress.interrupt();
      std::printf("carve: step %lld: fp16 gradients overflowed at loss scale %g (%s); update "
                  "skipped on every rank, loss scale now %g\n",
                  static_cast<long long>(k), usedScale, describeNonFinite(guard, ctx).c_str(),
                  ctx.lossScale);
    } else if (guard.nonFinite && !stop && talk) {
      progress.interrupt();
      std::printf("carve: step %lld: %s; update skipped on every rank (--on-nan skip)\n",
                  static_cast<long long>(k), describeNonFinite(guard, ctx).c_str());
    }
    progress.step(k, ctx.loss, seconds,
                  !guard.nonFinite ? "" : stop ? "non-finite: stopping" : "update skipped");
    if (log.isOpen()) {
      JsonLine line;
      line.add("step", k).add("loss", static_cast<double>(ctx.loss));
      line.add("lr", static_cast<double>(ctx.lr));
      if (ctx.gradNorm >= 0 || !std::isfinite(ctx.gradNorm))
        line.add("grad_norm", static_cast<double>(ctx.gradNorm));
      line.add("time_s", seconds).add(tokens ? "tokens_per_s" : "samples_per_s", rate);
      if (guard.nonFinite)
        line.add("skipped", !stop).add("nonfinite", guard.culprit);
      if (opts.skipNonFinite)
        line.add("skipped_steps", skippedSteps);
      if (fp16)
        line.add("loss_scale", static_cast<double>(usedScale))
            .add("overflow_steps", overflowSteps);
      if (!log.write(line, error))
        die(error);
    }
    if (stop) {
      // Every rank knows (the guard's all-reduce): all stop together.
      progress.interrupt();
      if (worldRank == 0)
        printError("step " + std::to_string(k) + ": " + describeNonFinite(guard, ctx) +
                   (guard.asked ? "; stopped before the update (--on-nan stop; --on-nan skip "
                                  "skips such steps)"
                                : "; stopped (this program applies its update before the "
                                  "check: recompile it for --on-nan skip)"));
      std::free(arena);
      return finish(1);
    }
    if (opts.saveEvery > 0 && (k + 1) % opts.saveEvery == 0)
      saveAt(k + 1);
  }

  setCommStep(-2);
  if (talk) {
    double total = secondsSince(begin);
    std::printf("carve: trained steps %lld to %lld in %s (%.0f %s/s on average)",
                static_cast<long long>(start), static_cast<long long>(end - 1),
                formatDuration(total).c_str(),
                total > 0 ? itemsPerStep * static_cast<double>(end - start) / total : 0.0, unit);
    if (opts.skipNonFinite)
      std::printf("; %lld update%s skipped for non-finite values",
                  static_cast<long long>(skippedSteps), skippedSteps == 1 ? "" : "s");
    if (fp16)
      std::printf("; %lld update%s skipped for fp16 overflow (loss scale now %g)",
                  static_cast<long long>(overflowSteps), overflowSteps == 1 ? "" : "s",
                  ctx.lossScale);
    std::printf("; peak rss %s (rank 0)\n", formatBytes(peakRssBytes()).c_str());
    std::fflush(stdout);
  }

  if (!opts.trace.empty()) {
    std::vector<std::vector<Tracer::Event>> all;
    gatherTraces(*world, tracer, all);
    if (worldRank == 0) {
      std::string title = std::string(program->model ? program->model : program->name) +
                          " (measured, " + std::to_string(worldSize) + " ranks)";
      if (!writeTextFile(opts.trace, chromeTrace(all, title), error))
        die(error);
      if (talk)
        std::printf("carve: wrote the measured schedule to %s\n", opts.trace.c_str());
    }
  }

  // Step 5: the final checkpoint: every rank writes its own shards.
  saveAt(end);
  dpDevice.reset();
  tpDevice.reset();
  ppDevice.reset();
  dpGroup.reset();
  tpGroup.reset();
  ppGroup.reset();
  if (device) {
    device->freeArena(deviceArena);
    device->close();
  }
  std::free(arena);
  std::fflush(stdout);
  return finish(0);
}
