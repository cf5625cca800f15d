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
// 3. Fill the arena: weights from --load DIR or OUT/init.safetensors,
//    gradients and optimizer state zero unless loaded. Files hold the model's
//    full tensors; each rank keeps its tensor-parallel piece and, for ZeRO,
//    its dp chunk of that piece.
// 4. Run the steps, printing progress and writing metrics on rank 0.
// 5. Save a checkpoint: the ranks reassemble full tensors (all-gathers over
//    dp, then over tp), rank 0 writes them while the others wait at a barrier.
//
// The mesh is dp x tp with dp outermost: world rank = dpRank * tp + tpRank.
//
// An error after step 2 (a kernel's `fatal`, an I/O failure) calls abortAll,
// which brings every rank down.
//
//===----------------------------------------------------------------------===//

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
or with mpirun/srun and the number of ranks it was compiled for.

  --steps S                   optimizer steps to run (required)
  --data FILE                 training data (required): a flat little-endian token file for
                              token models, else a safetensors file with one [S, B, ...]
                              tensor per model input (see runtime/README.md)
  --data-dtype int32|uint16   element type of a token file (default int32)
  --log FILE.jsonl            write one JSON object per step (replaces FILE)
  --save DIR                  after the last step write DIR/model.safetensors and
                              DIR/optimizer.safetensors
  --load DIR                  start from a checkpoint written by --save: weights,
                              optimizer state and step count
  --trace FILE.json           record when every rank ran each micro-batch's forward and
                              backward (and the rest of the step) as a Chrome trace
                              (opens in Perfetto); written by rank 0 at the end
  --quiet                     print nothing but errors
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
  std::string trace;
  bool quiet = false;
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
    if (arg == "--quiet") {
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

/// An element type of the same size, for collectives that only move data.
CommType moveType(int elemBytes) {
  return elemBytes == 8 ? CommType::I64 : elemBytes == 4 ? CommType::I32 : CommType::U8;
}

/// Reads the full tensors of `slots` and keeps this rank's part of each.
bool readTensors(const SafetensorsReader &file, const std::vector<Slot> &slots, char *arena,
                 bool stateF32, const Mesh &m, std::string &error) {
  std::vector<char> full, piece;
  for (const Slot &s : slots) {
    const TensorSpec &spec = *s.spec;
    const SlotLayout l = layoutOf(spec, stateF32, m);
    const SafetensorsTensor &t = *file.find(s.name);
    if (!l.split && !l.zero) {
      if (!file.read(t, 0, spec.numel * l.elemBytes, arena + s.offset, error))
        return false;
      continue;
    }
    std::vector<int64_t> global = globalShapeOf(spec);
    full.resize(static_cast<size_t>(numelOf(global) * l.elemBytes));
    if (!file.read(t, 0, static_cast<int64_t>(full.size()), full.data(), error))
      return false;
    const char *local = full.data();
    if (l.split) {
      piece.resize(static_cast<size_t>(spec.numel * l.elemBytes));
      char *dst = l.zero ? piece.data() : arena + s.offset;
      takeShard(full.data(), Dims(global.data(), spec.rank), Split{spec.tpDim, spec.tpGroups, m.tp},
                m.tpRank, dst, l.elemBytes);
      local = dst;
    }
    if (l.zero) {
      // Chunk dpRank of the flattened piece; past its end, zero padding.
      const int64_t begin = std::min<int64_t>(m.dpRank * spec.zeroChunk, spec.numel);
      const int64_t n = std::min(spec.zeroChunk, spec.numel - begin);
      std::memcpy(arena + s.offset, local + begin * l.elemBytes,
                  static_cast<size_t>(n * l.elemBytes));
      std::memset(arena + s.offset + n * l.elemBytes, 0,
                  static_cast<size_t>((spec.zeroChunk - n) * l.elemBytes));
    }
  }
  return true;
}

/// Where the initial weights come from, validated.
struct WeightSource {
  SafetensorsReader model;
  SafetensorsReader optimizer;
  bool hasOptimizer = false;
  int64_t step = 0;
};

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
  std::string modelPath = opts.load + "/model.safetensors";
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
  std::string optPath = opts.load + "/optimizer.safetensors";
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

/// Checks that `dir` exists as a writable folder or could be created, without
/// changing anything on disk.
bool checkSaveDir(const std::string &dir, std::string &error) {
  struct stat st;
  if (::stat(dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      error = dir + ": --save needs a folder, this is a file";
      return false;
    }
    for (const char *f : {"/model.safetensors", "/optimizer.safetensors"})
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

/// The full tensors of a checkpoint, as world rank 0 writes them.
struct FullTensors {
  std::vector<SafetensorsEntry> model, state;
  std::vector<std::vector<char>> storage; // the reassembled ones
};

/// Reassembles the full tensor of every slot: ZeRO chunks with an all-gather
/// over dp, then tensor-parallel pieces with one over tp. Every rank joins
/// (every rank's program lists the same parameters in the same order, with
/// the same splits); only world rank 0 keeps the results.
void gatherSlots(const std::vector<Slot> &slots, bool state, const char *arena, const Mesh &m,
                 Communicator &dpComm, Communicator &tpComm, bool keep, FullTensors &out,
                 std::vector<SafetensorsEntry> &entries) {
  std::vector<char> gathered;
  for (const Slot &s : slots) {
    const TensorSpec &spec = *s.spec;
    const SlotLayout l = layoutOf(spec, state, m);
    std::vector<int64_t> global = globalShapeOf(spec);
    const char *dtype = state ? "F32" : dtypeName(spec.dtype);
    if (!l.split && !l.zero) {
      if (keep)
        entries.push_back({s.name, dtype, global, arena + s.offset});
      continue;
    }
    const char *local = arena + s.offset;
    if (l.zero) {
      gathered.resize(static_cast<size_t>(m.dp * spec.zeroChunk * l.elemBytes));
      dpComm.allGather(arena + s.offset, gathered.data(), spec.zeroChunk * l.elemBytes,
                       CommType::U8);
      local = gathered.data();
    }
    std::vector<char> full(static_cast<size_t>(numelOf(global) * l.elemBytes));
    if (l.split)
      allGatherSplit(tpComm, local, Dims(spec.dims, spec.rank),
                     Split{spec.tpDim, spec.tpGroups, m.tp}, full.data(), moveType(l.elemBytes));
    else
      std::memcpy(full.data(), local, full.size());
    if (!keep)
      continue;
    out.storage.push_back(std::move(full));
    entries.push_back({s.name, dtype, global, out.storage.back().data()});
  }
}

/// Writes DIR/model.safetensors and DIR/optimizer.safetensors.
bool saveCheckpoint(const Program &p, const std::string &dir, const FullTensors &t, int64_t step,
                    std::string &error) {
  if (!makeDirs(dir, error))
    return false;
  std::vector<std::pair<std::string, std::string>> meta = {
      {"step", std::to_string(step)}, {"format", "carve-1"}, {"program", p.name}};
  return writeSafetensors(dir + "/model.safetensors", t.model, meta, error) &&
         writeSafetensors(dir + "/optimizer.safetensors", t.state, meta, error);
}

/// Bytes of one element of a safetensors dtype.
int64_t dtypeBytes(const std::string &d) {
  return d == "F64" || d == "I64" ? 8 : d == "BOOL" || d == "U8" ? 1 : 4;
}

/// Moves the first ranks' full tensors of every pipeline stage to pipeline
/// rank 0 (world rank 0), which appends those it does not have yet (a
/// parameter two stages share is identical on both).
void collectStages(Communicator &pp, std::vector<SafetensorsEntry> &entries, FullTensors &store,
                   int tag) {
  if (pp.rank() != 0) {
    std::vector<char> blob;
    auto put = [&](const void *p, size_t n) {
      blob.insert(blob.end(), static_cast<const char *>(p), static_cast<const char *>(p) + n);
    };
    for (const SafetensorsEntry &e : entries) {
      int64_t header[4] = {(int64_t)e.name.size(), (int64_t)e.dtype.size(), (int64_t)e.shape.size(),
                           0};
      int64_t n = dtypeBytes(e.dtype);
      for (int64_t d : e.shape)
        n *= d;
      header[3] = n;
      put(header, sizeof header);
      put(e.name.data(), e.name.size());
      put(e.dtype.data(), e.dtype.size());
      put(e.shape.data(), e.shape.size() * sizeof(int64_t));
      put(e.data, static_cast<size_t>(n));
    }
    int64_t size = (int64_t)blob.size();
    pp.send(&size, sizeof size, 0, tag);
    pp.send(blob.data(), size, 0, tag + 1);
    return;
  }
  std::set<std::string> have;
  for (const SafetensorsEntry &e : entries)
    have.insert(e.name);
  for (int r = 1; r < pp.size(); ++r) {
    int64_t size = 0;
    pp.recv(&size, sizeof size, r, tag);
    store.storage.emplace_back(static_cast<size_t>(size));
    std::vector<char> &blob = store.storage.back();
    pp.recv(blob.data(), size, r, tag + 1);
    size_t at = 0;
    while (at < blob.size()) {
      int64_t header[4];
      std::memcpy(header, blob.data() + at, sizeof header);
      at += sizeof header;
      SafetensorsEntry e;
      e.name.assign(blob.data() + at, header[0]);
      at += header[0];
      e.dtype.assign(blob.data() + at, header[1]);
      at += header[1];
      e.shape.resize(header[2]);
      std::memcpy(e.shape.data(), blob.data() + at, header[2] * sizeof(int64_t));
      at += header[2] * sizeof(int64_t);
      e.data = blob.data() + at;
      at += header[3];
      if (have.insert(e.name).second)
        entries.push_back(e);
    }
  }
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

int finish(int code) {
  finalizeComm();
  return code;
}

} // namespace

int main(int argc, char **argv) {
  std::unique_ptr<Communicator> world =
      launchedByMpi() ? makeMpiWorld(&argc, &argv) : makeSelfCommunicator();
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
  int64_t faultRank = -1, faultStep = -1;
  bool argsOk = parseArgs(argc, argv, opts, error) && parseFaultEnv(faultRank, faultStep, error);
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

  // Step 2: everything else, before any work.
  const Program *program = carve_program_for_rank(worldRank);
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
    if (checkShardedSpecs(*program, mesh, error))
      loader = openDataLoader(*program, mesh.dpRank, opts.data, opts.dataType, error);
    if (loader)
      openWeights(*program, opts, weights, error);
    if (error.empty() && worldRank == 0 && !opts.save.empty())
      checkSaveDir(opts.save, error);
    if (error.empty() && worldRank == 0 && !opts.log.empty())
      MetricsLog::checkWritable(opts.log, error);
    if (error.empty() && worldRank == 0 && !opts.trace.empty())
      MetricsLog::checkWritable(opts.trace, error);
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
  }
  if (!agree(*world, error))
    return finish(1);

  // Step 3: the arena's initial contents and the communicators.
  if (!readTensors(weights.model, modelSlots(*program), arena, false, mesh, error) ||
      (weights.hasOptimizer &&
       !readTensors(weights.optimizer, optimizerSlots(*program), arena, true, mesh, error)))
    die(error);
  MetricsLog log;
  if (worldRank == 0 && !opts.log.empty() && !log.open(opts.log, error))
    die(error);
  // One group per mesh axis: the ranks that differ only in that axis. An
  // axis of size 1 is a one-rank group; an axis as large as the world is it.
  std::unique_ptr<Communicator> dpGroup, tpGroup, ppGroup;
  auto axisGroup = [&](int size, int color, int key) -> std::unique_ptr<Communicator> {
    if (size == 1)
      return makeSelfCommunicator();
    if (size == worldSize)
      return nullptr;
    return world->split(color, key);
  };
  tpGroup = axisGroup(mesh.tp, mesh.ppRank * mesh.dp + mesh.dpRank, mesh.tpRank);
  dpGroup = axisGroup(mesh.dp, mesh.ppRank * mesh.tp + mesh.tpRank, mesh.dpRank);
  ppGroup = axisGroup(mesh.pp, mesh.dpRank * mesh.tp + mesh.tpRank, mesh.ppRank);
  Communicator *dpComm = dpGroup ? dpGroup.get() : world.get();
  Communicator *tpComm = tpGroup ? tpGroup.get() : world.get();
  Communicator *ppComm = ppGroup ? ppGroup.get() : world.get();

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

  // Step 4: training.
  StepContext ctx;
  ctx.arena = arena;
  ctx.dpComm = dpComm;
  ctx.tpComm = tpComm;
  ctx.tpRank = mesh.tpRank;
  ctx.dpRank = mesh.dpRank;
  ctx.ppComm = ppComm;
  ctx.ppRank = mesh.ppRank;
  Tracer tracer;
  if (!opts.trace.empty()) {
    world->barrier(); // a common time origin, to a barrier's precision
    tracer = Tracer();
    ctx.tracer = &tracer;
  }
  auto begin = std::chrono::steady_clock::now();
  for (int64_t k = start; k < end; ++k) {
    if (worldRank == faultRank && k == faultStep) {
      std::fflush(stdout);
      std::raise(SIGKILL);
    }
    auto stepBegin = std::chrono::steady_clock::now();
    if (!loader->load(k, arena, error))
      die(error);
    ctx.step = k;
    ctx.loss = 0;
    ctx.lr = 0;
    ctx.gradNorm = -1;
    double traceBegin = tracer.now();
    program->step(ctx);
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
    if (talk) {
      std::printf("%s\n",
                  formatProgress(k + 1, end, ctx.loss, rate, unit, secondsSince(begin)).c_str());
      std::fflush(stdout);
    }
    if (log.isOpen()) {
      JsonLine line;
      line.add("step", k).add("loss", static_cast<double>(ctx.loss));
      line.add("lr", static_cast<double>(ctx.lr));
      if (ctx.gradNorm >= 0)
        line.add("grad_norm", static_cast<double>(ctx.gradNorm));
      line.add("time_s", seconds).add(tokens ? "tokens_per_s" : "samples_per_s", rate);
      if (!log.write(line, error))
        die(error);
    }
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

  // Step 5: the checkpoint, reassembled from the ranks' pieces: each pipeline
  // stage's first rank reassembles its parameters, world rank 0 collects them.
  if (!opts.save.empty()) {
    FullTensors full;
    const bool keep = mesh.dpRank == 0 && mesh.tpRank == 0;
    gatherSlots(modelSlots(*program), false, arena, mesh, *dpComm, *tpComm, keep, full, full.model);
    gatherSlots(optimizerSlots(*program), true, arena, mesh, *dpComm, *tpComm, keep, full,
                full.state);
    if (keep && mesh.pp > 1) {
      collectStages(*ppComm, full.model, full, 1);
      collectStages(*ppComm, full.state, full, 3);
    }
    if (worldRank == 0) {
      if (!saveCheckpoint(*program, opts.save, full, end, error))
        die(error);
      if (talk)
        std::printf("carve: saved %s (step %lld)\n", opts.save.c_str(),
                    static_cast<long long>(end));
    }
    world->barrier();
  }
  dpGroup.reset();
  tpGroup.reset();
  ppGroup.reset();
  std::free(arena);
  std::fflush(stdout);
  return finish(0);
}
