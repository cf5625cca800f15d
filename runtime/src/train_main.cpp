//===- train_main.cpp - main() of every generated training executable -----===//
//
// OUT/bin/train runs the rank program that `carve_program_for_rank` gives
// this rank:
//
// 1. Start MPI when launched by mpirun/srun, else run as one rank. Check the
//    arguments (train_args.h), the fault injection's variables (faults.h)
//    and the rank count.
// 2. Validate everything else before any work (the data, the initial
//    weights or the checkpoint to load, the --save folder, the --log file).
//    After 1 and after 2 all ranks agree on the outcome with an all-reduce
//    over the world, so that they stop together (MPI_Finalize, exit 1) and
//    only the lowest failing rank prints its error (rank_errors.h).
// 3. Fill the arena (still in step 2, so that a bad checkpoint stops every
//    rank cleanly): weights from --load PATH or OUT/init.safetensors,
//    gradients and optimizer state zero unless loaded. A sharded checkpoint
//    (saved under any plan) is reassembled tensor by tensor from its shards;
//    each rank keeps its tensor-parallel piece and, for ZeRO, its dp chunk
//    (reshard.h).
// 4. Run the steps, printing progress and writing metrics on rank 0, and
//    save every --save-every steps. The NaN guard (nan_guard.h) decides
//    whether each step's update goes on.
// 5. Save the final checkpoint: every rank writes its own shards, world rank
//    0 the manifest (checkpoint_save.h, checkpoint.h, docs/checkpoints.md).
//    --save-every saves inside step 4 the same way.
//
// The mesh is pp x dp x tp with pp outermost (carve/rt/mesh.h).
//
// An error after step 2 (a kernel's `fatal`, an I/O failure) calls abortAll,
// which brings every rank down; so does a collective that does not complete
// within --collective-timeout (a dead or stopped rank). docs/failures.md.
//
//===----------------------------------------------------------------------===//

#include "checkpoint_save.h"
#include "faults.h"
#include "nan_guard.h"
#include "rank_errors.h"
#include "reshard.h"
#include "train_args.h"

#include "carve/rt/checkpoint.h"
#include "carve/rt/comm.h"
#include "carve/rt/data.h"
#include "carve/rt/mesh.h"
#include "carve/rt/metrics.h"
#include "carve/rt/pipeline.h"
#include "carve/rt/program.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <unistd.h>
#include <vector>

using namespace carve::rt;

namespace {

/// Whether mpirun or srun started this process.
bool launchedByMpi() {
  for (const char *v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(v))
      return true;
  return false;
}

/// Seconds since `t`.
double secondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
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

/// Finalizes the communication layer; returns the exit status `code`.
int finish(int code) {
  finalizeComm();
  return code;
}

/// The world: MPI under mpirun/srun, a TCP world from a plain launcher's
/// RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, or one rank alone. Null after
/// printing the error of a TCP world that could not be joined.
std::unique_ptr<Communicator> startWorld(int *argc, char ***argv) {
  if (launchedByMpi())
    return makeMpiWorld(argc, argv);
  // Joining a TCP world waits for the other ranks: bound it by
  // --collective-timeout already (the arguments are checked properly later).
  applyEarlyCollectiveTimeout(*argc, *argv);
  std::string error;
  std::unique_ptr<Communicator> world = makeEnvWorld(error);
  if (!world && !error.empty()) {
    std::fprintf(stderr, "carve: error: %s\n", error.c_str());
    return nullptr;
  }
  if (!world)
    world = makeSelfCommunicator();
  return world;
}

/// Step 1 on this rank: the arguments, the fault injection's variables and
/// the rank count. Returns the error, or empty.
std::string checkArguments(int argc, char **argv, int worldSize, Options &opts,
                           FaultInjection &faults) {
  std::string error;
  bool argsOk = parseArgs(argc, argv, opts, error) && faults.readEnvironment(error);
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
  return argsOk ? std::string() : error;
}

/// Which ranks share this host (a device per rank on it): from the host
/// names, so that mpirun, srun and plain launchers need no variables of their
/// own. Every rank joins.
void findHostRanks(Communicator &world, int &localRank, int &localRanks) {
  localRank = 0, localRanks = 0;
  char name[64] = {};
  ::gethostname(name, sizeof name - 1);
  std::vector<char> all(64 * static_cast<size_t>(world.size()));
  world.allGather(name, all.data(), 64, CommType::U8);
  for (int r = 0; r < world.size(); ++r)
    if (!std::strncmp(all.data() + 64 * static_cast<size_t>(r), name, 64)) {
      localRank += r < world.rank();
      ++localRanks;
    }
}

/// What step 2 validated and prepared on this rank.
struct RankSetup {
  const Program *program = nullptr;
  const DeviceTarget *device = nullptr;
  Mesh mesh;
  std::unique_ptr<DataLoader> loader;
  std::unique_ptr<DataLoader> evalLoader; // --eval-data, or null
  int64_t evalBatches = 0;                // global batches per evaluation
  WeightSource weights;
  char *arena = nullptr;       // the arena; on a device, the host copy of the step's arena
  char *deviceArena = nullptr; // the step's arena on the device
  Hyperparameters hyper;       // this run's (the program's, overridden by train --lr ...)
};

/// Checks that the program of world rank `worldRank` exists, is complete and
/// belongs to this plan and to this rank's place on the mesh.
bool checkProgram(const Program *program, int worldRank, int planRanks, std::string &error) {
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
  } else {
    const Mesh m = Mesh::ofRank(worldRank, program->dp, program->tp, program->pp);
    if (program->ep < 1 || program->dp % program->ep != 0) {
      error = std::string("program '") + program->name + "' has ep=" + std::to_string(program->ep) +
              ", which does not divide its dp=" + std::to_string(program->dp);
      return false;
    }
    if (program->ppRank == m.ppRank && program->epRank == m.epRank(program->ep))
      return true;
    error = std::string("program '") + program->name + "' is for pipeline rank " +
            std::to_string(program->ppRank) + " and expert rank " +
            std::to_string(program->epRank) + ", but rank " + std::to_string(worldRank) +
            " is on pipeline rank " + std::to_string(m.ppRank) + " and expert rank " +
            std::to_string(m.epRank(program->ep));
  }
  return false;
}

/// --eval-data: the held-out set, in order, and the batches per evaluation.
void openEvalData(const Options &opts, const Program &program, RankSetup &s, std::string &error) {
  if (!program.evaluate) {
    error = std::string("program '") + program.name +
            "' has no forward-only function for --eval-data (it was compiled by an older "
            "carve): compile it again";
    return;
  }
  s.evalLoader = openDataLoader(program, s.mesh.dpRank, dataOptions(opts, true), error);
  if (!s.evalLoader)
    return;
  const int64_t whole = s.evalLoader->stepsPerEpoch();
  if (opts.evalBatches > whole) {
    error = "--eval-batches " + std::to_string(opts.evalBatches) + ": the evaluation set (" +
            s.evalLoader->describe() + ") holds " + std::to_string(whole) + " global batch" +
            (whole == 1 ? "" : "es") + " of " + std::to_string(program.globalBatch);
    return;
  }
  s.evalBatches = opts.evalBatches > 0 ? opts.evalBatches : whole;
}

/// Step 2 on this rank: the program, the data, the weights or the checkpoint,
/// the --save folder, the --log and --trace files, the device and the
/// arena's initial contents. Sets `error` on the first failure.
void prepareRank(const Options &opts, int worldRank, int localRank, int localRanks, RankSetup &s,
                 std::string &error) {
  s.program = carve_program_for_rank(worldRank);
  s.device = s.program ? s.program->device : nullptr;
  if (!checkProgram(s.program, worldRank, carve_world_size(), error))
    return;
  const Program &program = *s.program;
  const DeviceTarget *device = s.device;
  s.mesh = Mesh::ofRank(worldRank, program.dp, program.tp, program.pp);
  if (opts.cudaGraph == 1 && !device)
    error = std::string("--cuda-graph needs a program compiled with --target cuda; '") +
            program.name + "' is for the CPU";
  else if (checkShardedSpecs(program, s.mesh, error))
    s.loader = openDataLoader(program, s.mesh.dpRank, dataOptions(opts, false), error);
  if (s.loader && !opts.evalData.empty())
    openEvalData(opts, program, s, error);
  if (error.empty() && s.loader)
    openWeights(program, opts.load, s.weights, error);
  if (error.empty() && s.loader)
    applyHyperparameters(opts, program.hyper ? *program.hyper : Hyperparameters{},
                         program.optimizer == OptimizerKind::AdamW, s.weights.step + opts.steps,
                         s.hyper, error);
  if (error.empty() && worldRank == 0 && !opts.save.empty())
    checkSaveDir(opts.save, error);
  if (error.empty() && worldRank == 0 && !opts.log.empty())
    MetricsLog::checkWritable(opts.log, error);
  if (error.empty() && worldRank == 0 && !opts.trace.empty())
    MetricsLog::checkWritable(opts.trace, error);
  if (error.empty() && worldRank == 0 && !opts.tensorboard.empty())
    TensorBoardLog::checkWritable(opts.tensorboard, error);
  // The CUDA target: this rank's device first, so that a plan too large for
  // it is reported as such (not as a failed host allocation).
  if (error.empty() && device)
    device->open(worldRank, localRank, localRanks, program.arenaBytes, error);
  if (error.empty()) {
    size_t bytes = (static_cast<size_t>(std::max<int64_t>(program.arenaBytes, 1)) + 63) / 64 * 64;
    s.arena = static_cast<char *>(std::aligned_alloc(64, bytes));
    if (!s.arena)
      error = "cannot allocate the " + std::to_string(program.arenaBytes) +
              "-byte arena of program '" + program.name + "'";
    else
      std::memset(s.arena, 0, bytes);
  }
  // The arena's initial contents: read here, so that a truncated or
  // corrupt checkpoint file stops every rank cleanly.
  if (error.empty())
    fillArena(program, s.weights, s.arena, s.mesh, error);
  // The device arena and its initial contents.
  if (error.empty() && device) {
    s.deviceArena = device->allocArena(std::max<int64_t>(program.arenaBytes, 1), error);
    if (s.deviceArena)
      device->toDevice(s.deviceArena, s.arena, program.arenaBytes, error);
  }
}

/// One communicator per mesh axis: the ranks that differ only in that axis.
/// On a device the step's collectives run on device communicators (NCCL),
/// one per axis, bootstrapped over the host groups.
struct AxisGroups {
  std::unique_ptr<Communicator> dp, tp, pp, ep, edp;
  std::unique_ptr<Communicator> dpDevice, tpDevice, ppDevice, epDevice, edpDevice;
};

/// Step 3: the groups of every mesh axis. Every rank joins.
void makeAxisGroups(Communicator &world, const Mesh &mesh, int ep, const DeviceTarget *device,
                    AxisGroups &g) {
  // An axis of size 1 is a one-rank group; an axis as large as the world is
  // split off too, so that timeout messages name the axis.
  auto axisGroup = [&](int size, int color, int key,
                       const char *name) -> std::unique_ptr<Communicator> {
    std::unique_ptr<Communicator> c = size == 1 ? makeSelfCommunicator() : world.split(color, key);
    c->setName(name);
    return c;
  };
  g.tp = axisGroup(mesh.tp, mesh.tpGroupIndex(), mesh.tpRank, "tp");
  g.dp = axisGroup(mesh.dp, mesh.dpGroupIndex(), mesh.dpRank, "dp");
  g.pp = axisGroup(mesh.pp, mesh.ppGroupIndex(), mesh.ppRank, "pp");
  // Expert parallelism: split in every run (every rank joins each split),
  // one-rank groups without it.
  g.ep = axisGroup(ep, mesh.epGroupIndex(ep), mesh.epRank(ep), "ep");
  g.edp = axisGroup(mesh.dp / ep, mesh.edpGroupIndex(ep), mesh.dpRank / ep, "edp");
  if (!device)
    return;
  auto deviceGroup = [&](Communicator &host) {
    std::string why;
    std::unique_ptr<Communicator> c = device->makeComm(host, why);
    if (!c)
      die("cannot create the " + host.name() + " device communicator: " + why);
    c->setName(host.name());
    return c;
  };
  g.tpDevice = deviceGroup(g.tp ? *g.tp : world);
  g.dpDevice = deviceGroup(g.dp ? *g.dp : world);
  g.ppDevice = deviceGroup(g.pp ? *g.pp : world);
  if (ep > 1) {
    g.epDevice = deviceGroup(*g.ep);
    g.edpDevice = deviceGroup(*g.edp);
  }
}

/// Rank 0's start-up lines (with `talk`): the model, the data and the weights,
/// then every rank's persistent bytes when the programs give them. The bytes
/// are gathered even when quiet: ranks may disagree on --quiet, never on a
/// collective.
void reportStart(Communicator &world, const Options &opts, const RankSetup &s, int64_t start,
                 int64_t end, bool talk) {
  const Program &program = *s.program;
  // Parameter elements this rank holds: its tp piece of each parameter and
  // buffer, or its ZeRO-3 chunk.
  int64_t elements = 0;
  for (int i = 0; i < program.numParams; ++i)
    elements += program.params[i].paramZero ? program.params[i].zeroChunk : program.params[i].numel;
  const int64_t mine[5] = {program.paramBytes, program.gradBytes, program.stateBytes, elements,
                           program.activationBytes};
  const int worldSize = world.size();
  std::vector<int64_t> memory(5 * static_cast<size_t>(worldSize));
  world.allGather(mine, memory.data(), 5, CommType::I64);
  if (!talk)
    return;
  std::printf("carve: %s on %d rank%s: %s\n", program.model ? program.model : program.name,
              worldSize, worldSize == 1 ? "" : "s", program.description ? program.description : "");
  std::printf("carve: data %s; weights from %s; steps %lld to %lld\n", s.loader->describe().c_str(),
              opts.load.empty() ? s.weights.model.path().c_str() : opts.load.c_str(),
              static_cast<long long>(start + 1), static_cast<long long>(end));
  if (s.evalLoader)
    std::printf(
        "carve: evaluation data %s; %lld global batch%s %s\n", s.evalLoader->describe().c_str(),
        static_cast<long long>(s.evalBatches), s.evalBatches == 1 ? "" : "es",
        opts.evalEvery > 0
            ? ("after every " + std::to_string(opts.evalEvery) + " steps and the last").c_str()
            : "after the last step");
  if (program.hyper) {
    Hyperparameters compiled = *program.hyper;
    compiled.endStep = s.hyper.endStep;
    const std::string changed = hyperparameterChanges(s.hyper, compiled, "compiled");
    if (!changed.empty())
      std::printf("carve: hyperparameters of this run: %s\n", changed.c_str());
  }
  // A checkpoint records the values its run used; resuming with others says so.
  const CheckpointManifest &m = s.weights.manifest;
  if (s.weights.sharded && !m.hyperparameters.empty()) {
    Hyperparameters saved = s.hyper;
    double minLr = 0;
    for (const auto &[k, v] : m.hyperparameters) {
      if (k == "lr")
        saved.lr = v;
      else if (k == "min_lr")
        minLr = v;
      else if (k == "warmup_steps")
        saved.warmupSteps = static_cast<int64_t>(v);
      else if (k == "decay_steps")
        saved.decaySteps = static_cast<int64_t>(v);
      else if (k == "weight_decay")
        saved.weightDecay = v;
      else if (k == "beta1")
        saved.beta1 = v;
      else if (k == "beta2")
        saved.beta2 = v;
      else if (k == "eps")
        saved.eps = v;
      else if (k == "clip")
        saved.clip = v;
    }
    saved.minLrRatio = saved.lr > 0 ? minLr / saved.lr : 0;
    Schedule sched;
    if (parseSchedule(m.schedule.c_str(), sched))
      saved.schedule = sched;
    const std::string changed = hyperparameterChanges(s.hyper, saved, "the checkpoint's run used");
    if (!changed.empty())
      std::printf("carve: resuming step %lld with other hyperparameters than the checkpoint's: "
                  "%s\n",
                  static_cast<long long>(start + 1), changed.c_str());
  }
  bool reported = false;
  for (int r = 0; r < worldSize; ++r)
    reported |= memory[5 * r] != 0 || memory[5 * r + 1] != 0 || memory[5 * r + 2] != 0;
  if (reported)
    for (int r = 0; r < worldSize; ++r) {
      const Mesh at = Mesh::ofRank(r, s.mesh.dp, s.mesh.tp, s.mesh.pp);
      std::string where = "dp " + std::to_string(at.dpRank) + ", tp " + std::to_string(at.tpRank);
      if (at.pp > 1)
        where += ", pp " + std::to_string(at.ppRank);
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

/// Steps 4 and 5: the training loop with what it prints, logs, traces and
/// saves, and the final checkpoint.
class Trainer {
public:
  Trainer(Communicator &world, const Options &opts, const FaultInjection &faults, RankSetup &s,
          const AxisGroups &groups, MetricsLog &log, TensorBoardLog &board);

  /// Runs the steps; false when a non-finite loss or gradient stopped the run
  /// (rank 0 has reported it).
  bool run();

  /// After the last step: the summary, the trace and the final checkpoint.
  void wrapUp();

private:
  /// Runs step `k`; false when it must stop the run.
  bool runStep(int64_t k);
  /// Step `k`'s inputs from `loader` into the arena (and the device's).
  void loadInputs(DataLoader &loader, int64_t k);
  /// fp16: halves the loss scale after an overflow, doubles it after 2000
  /// good steps in a row.
  void updateLossScale(bool overflow);
  /// Records the time of step `k` outside the instruction list
  /// (synchronization, optimizer) in the trace.
  void traceRest(int64_t k, double traceBegin);
  /// Step `k`'s notes, progress line and --log record.
  void reportStep(int64_t k, double seconds, bool overflow, bool stop, float usedScale);
  /// Saves a checkpoint of step `step` with --save, never the same step twice.
  void saveAt(int64_t step);
  /// --eval-data: the mean loss over the evaluation batches of the weights
  /// after step `k`, reported and logged.
  void evaluate(int64_t k);

  Communicator &world;
  const Options &opts;
  const FaultInjection &faults;
  RankSetup &s;
  const Program &program;
  const DeviceTarget *device;
  MetricsLog &log;
  TensorBoardLog &board;
  const int worldRank;
  const int64_t start, end;
  const bool tokens;
  const double itemsPerStep;
  const char *const unit;
  const bool talk; // rank 0 prints progress and notes
  const bool fp16;
  StepContext ctx;
  Tracer tracer;
  NanGuard guard;
  std::optional<ProgressDisplay> progress;
  int64_t goodSteps = 0, overflowSteps = 0; // fp16 dynamic loss scaling
  int64_t skippedSteps = 0;                 // --on-nan skip
  int64_t lastSaved = -1;
  bool graphReported = false;
  std::chrono::steady_clock::time_point begin;
};

Trainer::Trainer(Communicator &world, const Options &opts, const FaultInjection &faults,
                 RankSetup &s, const AxisGroups &groups, MetricsLog &log, TensorBoardLog &board)
    : world(world), opts(opts), faults(faults), s(s), program(*s.program), device(s.device),
      log(log), board(board), worldRank(world.rank()), start(s.weights.step),
      end(start + opts.steps), tokens(program.dataKind == DataKind::Tokens),
      itemsPerStep(static_cast<double>(program.globalBatch) *
                   (tokens ? static_cast<double>(program.seqLen) : 1.0)),
      unit(tokens ? "tokens" : "samples"), talk(worldRank == 0 && !opts.quiet),
      fp16(program.precision && !std::strcmp(program.precision, "fp16")),
      guard(world, program, s.mesh, faults, s.arena) {
  // fp16: dynamic loss scaling (GradScaler's defaults), from --loss-scale,
  // else from the checkpoint resumed, else 65536.
  ctx.lossScale = fp16 ? static_cast<float>(opts.lossScale) : 1.0f;
  if (fp16 && !opts.lossScaleSet && s.weights.sharded && s.weights.manifest.lossScale > 0) {
    ctx.lossScale = static_cast<float>(s.weights.manifest.lossScale);
    goodSteps = s.weights.manifest.lossScaleGoodSteps;
    if (talk) {
      std::printf("carve: fp16 loss scale %g (%lld good steps) from the checkpoint\n",
                  static_cast<double>(ctx.lossScale), static_cast<long long>(goodSteps));
      std::fflush(stdout);
    }
  }
  Communicator *dpComm = groups.dp ? groups.dp.get() : &world;
  Communicator *tpComm = groups.tp ? groups.tp.get() : &world;
  Communicator *ppComm = groups.pp ? groups.pp.get() : &world;
  ctx.hyper = &s.hyper;
  // Dropout: the masks' seed from --seed, else from the checkpoint resumed.
  const CheckpointManifest *resumed = s.weights.sharded ? &s.weights.manifest : nullptr;
  ctx.seed = opts.seed;
  if (!opts.seedSet && resumed && resumed->rng != "none")
    ctx.seed = resumed->rngSeed;
  if (talk && program.dropoutNodes > 0) {
    std::printf("carve: dropout masks from seed %llu%s\n",
                static_cast<unsigned long long>(ctx.seed),
                opts.seedSet && resumed && resumed->rng != "none" && resumed->rngSeed != ctx.seed
                    ? " (--seed; the checkpoint's was another)"
                : !opts.seedSet && resumed && resumed->rng != "none" ? " (the checkpoint's)"
                                                                     : "");
    std::fflush(stdout);
  }
  ctx.arena = device ? s.deviceArena : s.arena;
  ctx.dpComm = device ? groups.dpDevice.get() : dpComm;
  ctx.tpComm = device ? groups.tpDevice.get() : tpComm;
  ctx.tpRank = s.mesh.tpRank;
  ctx.dpRank = s.mesh.dpRank;
  ctx.ppComm = device ? groups.ppDevice.get() : ppComm;
  ctx.ppRank = s.mesh.ppRank;
  ctx.epComm = device && groups.epDevice ? groups.epDevice.get() : groups.ep.get();
  ctx.edpComm = device && groups.edpDevice ? groups.edpDevice.get() : groups.edp.get();
  ctx.epRank = s.mesh.epRank(s.program->ep);
}

bool Trainer::run() {
  if (!opts.trace.empty()) {
    world.barrier(); // a common time origin, to a barrier's precision
    tracer = Tracer();
    ctx.tracer = &tracer;
  }
  ctx.hooks = &guard;
  // CUDA graphs: on by default where the plan allows; a profile times each
  // kernel, which a graph's replays would hide.
  const bool profiling = std::getenv("CARVE_GPU_PROFILE") && *std::getenv("CARVE_GPU_PROFILE") &&
                         std::string(std::getenv("CARVE_GPU_PROFILE")) != "0";
  ctx.cudaGraph =
      device && program.pp == 1 && (opts.cudaGraph == 1 || (opts.cudaGraph == -1 && !profiling));
  if (device && opts.cudaGraph == 1 && program.pp > 1 && talk) {
    std::printf("carve: --cuda-graph: pipeline-parallel programs are not captured (their "
                "schedule runs the micro-batches from the host); running as they are\n");
    std::fflush(stdout);
  } else if (device && opts.cudaGraph == -1 && program.pp == 1 && profiling && talk) {
    std::printf("carve: CARVE_GPU_PROFILE: the steps run eagerly, each kernel timed (--cuda-graph "
                "captures them anyway, untimed)\n");
    std::fflush(stdout);
  }
  ProgressMode mode = opts.quiet || worldRank != 0 ? ProgressMode::None
                      : opts.progress == "bar"     ? ProgressMode::Bar
                      : opts.progress == "lines"   ? ProgressMode::Lines
                      : opts.progress == "none"    ? ProgressMode::None
                      : stdoutIsTerminal()         ? ProgressMode::Bar
                                                   : ProgressMode::Lines;
  progress.emplace(mode, start, end, unit, itemsPerStep, opts.progressEvery);
  begin = std::chrono::steady_clock::now();
  for (int64_t k = start; k < end; ++k) {
    if (!runStep(k))
      return false;
    // Checkpoints at every multiple of --save-every and after the last step.
    if (opts.saveEvery > 0 && (k + 1) % opts.saveEvery == 0)
      saveAt(k + 1);
    if (s.evalLoader && ((opts.evalEvery > 0 && (k + 1) % opts.evalEvery == 0) || k == end - 1))
      evaluate(k);
  }
  return true;
}

void Trainer::loadInputs(DataLoader &loader, int64_t k) {
  std::string error;
  if (!loader.load(k, s.arena, error))
    die(error);
  if (device)
    for (int i = 0; i < program.numInputs; ++i) {
      const TensorSpec &in = program.inputs[i];
      if (!device->toDevice(s.deviceArena + in.offset, s.arena + in.offset,
                            in.numel * dtypeSize(in.dtype), error))
        die(error);
    }
}

bool Trainer::runStep(int64_t k) {
  std::string error;
  setCommStep(k + 1);
  faults.atStepStart(worldRank, k);
  auto stepBegin = std::chrono::steady_clock::now();
  loadInputs(*s.loader, k);
  ctx.step = k;
  ctx.loss = 0;
  ctx.lr = 0;
  ctx.gradNorm = -1;
  double traceBegin = tracer.now();
  guard.beginStep();
  program.step(ctx);
  if (device && !device->synchronize(error))
    die("step " + std::to_string(k + 1) + ": " + error);
  if (device && device->stepEnded)
    device->stepEnded(k);
  if (!guard.asked)
    guard.checkAfterStep(ctx);
  if (ctx.graphFallback && !graphReported) {
    graphReported = true;
    // The rank whose capture failed says why; rank 0 says what happens.
    const bool mine = ctx.graphFallback == 1 && !opts.quiet;
    if (mine || talk)
      progress->interrupt();
    if (mine)
      std::printf("carve: rank %d: step %lld: the forward and backward cannot be captured in a "
                  "CUDA graph: %s\n",
                  worldRank, static_cast<long long>(k + 1),
                  ctx.graphFallbackWhy ? ctx.graphFallbackWhy : "(no cause given)");
    if (talk)
      std::printf("carve: step %lld: %s; every step runs eagerly from now on (train "
                  "--no-cuda-graph does not try)\n",
                  static_cast<long long>(k + 1),
                  ctx.graphFallback == 1 ? "no CUDA graph"
                                         : "no CUDA graph: another rank's "
                                           "capture failed (its line says why)");
    std::fflush(stdout);
  }
  if (ctx.graphNodes > 0 && !graphReported) {
    graphReported = true;
    if (talk) {
      progress->interrupt();
      std::printf("carve: step %lld: forward and backward captured in a CUDA graph of %lld "
                  "nodes, replayed from now on\n",
                  static_cast<long long>(k + 1), static_cast<long long>(ctx.graphNodes));
      std::fflush(stdout);
    }
  }
  // fp16: gradients that overflowed at this scale are expected now and then.
  const bool overflow = fp16 && guard.nonFinite && guard.asked && guard.culprit != "loss";
  const bool stop = guard.nonFinite && !overflow && (!opts.skipNonFinite || !guard.asked);
  if (guard.nonFinite && !stop && !overflow)
    ++skippedSteps;
  const float usedScale = ctx.lossScale;
  updateLossScale(overflow);
  if (ctx.tracer)
    traceRest(k, traceBegin);
  reportStep(k, secondsSince(stepBegin), overflow, stop, usedScale);
  if (!stop)
    return true;
  // Every rank knows (the guard's all-reduce): all stop together.
  progress->interrupt();
  if (worldRank == 0)
    printError("step " + std::to_string(k + 1) + ": " + describeNonFinite(guard, ctx) +
               (guard.asked ? "; stopped before the update (--on-nan stop; --on-nan skip "
                              "skips such steps)"
                            : "; stopped (this program applies its update before the "
                              "check: recompile it for --on-nan skip)"));
  return false;
}

void Trainer::updateLossScale(bool overflow) {
  if (overflow) {
    ++overflowSteps;
    goodSteps = 0;
    ctx.lossScale = std::max(1.0f, ctx.lossScale * 0.5f);
  } else if (fp16 && !guard.nonFinite && ++goodSteps == 2000) {
    goodSteps = 0;
    ctx.lossScale = std::min(1e30f, ctx.lossScale * 2.0f);
  }
}

void Trainer::traceRest(int64_t k, double traceBegin) {
  double inside = 0;
  for (const Tracer::Event &e : tracer.events())
    if (e.step == k && e.kind != 'O')
      inside = std::max(inside, e.end);
  if (program.pp == 1 && program.numMicroBatches == 1)
    tracer.add({'S', -1, 0, k, traceBegin, tracer.now()}); // one whole step
  else
    tracer.add({'O', -1, program.ppRank, k, std::max(inside, traceBegin), tracer.now()});
}

void Trainer::reportStep(int64_t k, double seconds, bool overflow, bool stop, float usedScale) {
  double rate = seconds > 0 ? itemsPerStep / seconds : 0;
  if (overflow && talk) {
    progress->interrupt();
    std::printf("carve: step %lld: fp16 gradients overflowed at loss scale %g (%s); update "
                "skipped on every rank, loss scale now %g\n",
                static_cast<long long>(k + 1), usedScale, describeNonFinite(guard, ctx).c_str(),
                ctx.lossScale);
  } else if (guard.nonFinite && !stop && talk) {
    progress->interrupt();
    std::printf("carve: step %lld: %s; update skipped on every rank (--on-nan skip)\n",
                static_cast<long long>(k + 1), describeNonFinite(guard, ctx).c_str());
  }
  progress->step(k, ctx.loss, seconds,
                 !guard.nonFinite ? ""
                 : stop           ? "non-finite: stopping"
                                  : "update skipped");
  if (board.isOpen()) {
    std::vector<std::pair<std::string, float>> scalars = {{"loss", ctx.loss}, {"lr", ctx.lr}};
    if (ctx.gradNorm >= 0 || !std::isfinite(ctx.gradNorm))
      scalars.push_back({"grad_norm", ctx.gradNorm});
    scalars.push_back({tokens ? "tokens_per_s" : "samples_per_s", static_cast<float>(rate)});
    if (fp16)
      scalars.push_back({"loss_scale", usedScale});
    std::string error;
    if (!board.write(k + 1, scalars, error))
      die(error);
  }
  if (!log.isOpen())
    return;
  JsonLine line;
  line.add("step", k + 1).add("loss", static_cast<double>(ctx.loss));
  line.add("lr", static_cast<double>(ctx.lr));
  if (ctx.gradNorm >= 0 || !std::isfinite(ctx.gradNorm))
    line.add("grad_norm", static_cast<double>(ctx.gradNorm));
  line.add("time_s", seconds).add(tokens ? "tokens_per_s" : "samples_per_s", rate);
  if (s.loader->stepsPerEpoch() > 0)
    line.add("epoch", k / s.loader->stepsPerEpoch());
  if (guard.nonFinite)
    line.add("skipped", !stop).add("nonfinite", guard.culprit);
  if (opts.skipNonFinite)
    line.add("skipped_steps", skippedSteps);
  if (fp16)
    line.add("loss_scale", static_cast<double>(usedScale)).add("overflow_steps", overflowSteps);
  std::string error;
  if (!log.write(line, error))
    die(error);
}

void Trainer::evaluate(int64_t k) {
  const auto evalBegin = std::chrono::steady_clock::now();
  const StepContext saved = ctx;
  ctx.tracer = nullptr;
  ctx.hooks = nullptr;
  ctx.evaluating = true;
  std::string error;
  double sum = 0, correct = 0, counted = 0;
  for (int64_t b = 0; b < s.evalBatches; ++b) {
    loadInputs(*s.evalLoader, b);
    ctx.loss = 0;
    ctx.counts[0] = ctx.counts[1] = 0;
    program.evaluate(ctx);
    if (device && !device->synchronize(error))
      die("evaluation after step " + std::to_string(k + 1) + ": " + error);
    sum += static_cast<double>(ctx.loss);
    correct += ctx.counts[0];
    counted += ctx.counts[1];
  }
  // The share of predictions right, where the loss is a cross-entropy.
  const double accuracy = counted > 0 ? correct / counted : -1;
  ctx = saved;
  const double loss = sum / static_cast<double>(s.evalBatches);
  const double seconds = secondsSince(evalBegin);
  if (talk) {
    progress->interrupt();
    std::printf("carve: step %lld: eval loss %.4f", static_cast<long long>(k + 1), loss);
    if (tokens)
      std::printf(" (perplexity %.4g)", std::exp(loss));
    if (accuracy >= 0)
      std::printf(", accuracy %.2f%%", 100 * accuracy);
    std::printf(" over %lld batch%s of held-out data, %s\n", static_cast<long long>(s.evalBatches),
                s.evalBatches == 1 ? "" : "es", formatDuration(seconds).c_str());
    std::fflush(stdout);
  }
  if (board.isOpen()) {
    std::vector<std::pair<std::string, float>> scalars = {{"eval_loss", static_cast<float>(loss)}};
    if (tokens)
      scalars.push_back({"eval_ppl", static_cast<float>(std::exp(loss))});
    if (accuracy >= 0)
      scalars.push_back({"eval_accuracy", static_cast<float>(accuracy)});
    if (!board.write(k + 1, scalars, error))
      die(error);
  }
  if (!log.isOpen())
    return;
  JsonLine line;
  line.add("step", k + 1).add("eval_loss", loss);
  if (tokens)
    line.add("eval_ppl", std::exp(loss));
  if (accuracy >= 0)
    line.add("eval_accuracy", accuracy);
  line.add("eval_batches", s.evalBatches)
      .add(tokens ? "eval_tokens" : "eval_samples",
           s.evalBatches * program.globalBatch * (tokens ? program.seqLen : 1))
      .add("eval_time_s", seconds);
  if (!log.write(line, error))
    die(error);
}

void Trainer::saveAt(int64_t step) {
  if (opts.save.empty() || step == lastSaved)
    return;
  std::string why;
  if (device && !device->toHost(s.arena, s.deviceArena, program.arenaBytes, why))
    die(why);
  saveCheckpoint(world, program, s.arena, opts.save, step, opts.keep, fp16 ? ctx.lossScale : 0.0,
                 goodSteps, &s.hyper, ctx.seed);
  lastSaved = step;
  if (talk) {
    std::printf("carve: saved %s/%s\n", opts.save.c_str(), checkpointFolderName(step).c_str());
    std::fflush(stdout);
  }
}

void Trainer::wrapUp() {
  setCommStep(-2);
  if (talk) {
    double total = secondsSince(begin);
    std::printf("carve: trained steps %lld to %lld in %s (%.0f %s/s on average)",
                static_cast<long long>(start + 1), static_cast<long long>(end),
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
    gatherTraces(world, tracer, all);
    if (worldRank == 0) {
      std::string title = std::string(program.model ? program.model : program.name) +
                          " (measured, " + std::to_string(world.size()) + " ranks)";
      std::string error;
      if (!writeTextFile(opts.trace, chromeTrace(all, title), error))
        die(error);
      if (talk)
        std::printf("carve: wrote the measured schedule to %s\n", opts.trace.c_str());
    }
  }

  // Step 5: the final checkpoint: every rank writes its own shards.
  saveAt(end);
}

} // namespace

int main(int argc, char **argv) {
  std::unique_ptr<Communicator> world = startWorld(&argc, &argv);
  if (!world)
    return 1;
  const int worldRank = world->rank();
  setErrorRank(worldRank, world->size());

  // Step 1: --help, the arguments and the rank count. Every launched process
  // joins these all-reduces over the world, whatever the rank count, so they
  // cannot hang; the lowest failing rank (rank 0 when all fail) reports.
  int64_t help = wantsHelp(argc, argv) ? 1 : 0;
  world->allReduce(&help, 1, CommType::I64, ReduceOp::Max);
  if (help) {
    if (worldRank == 0) {
      std::fputs(kTrainUsage, stdout);
      const Program *p0 = carve_program_for_rank(0);
      if (p0 && p0->hyper)
        std::fputs(hyperparameterHelp(*p0->hyper, p0->optimizer == OptimizerKind::AdamW).c_str(),
                   stdout);
    }
    return finish(0);
  }
  Options opts;
  FaultInjection faults;
  if (!agree(*world, checkArguments(argc, argv, world->size(), opts, faults)))
    return finish(1);

  // Step 2: everything else, before any work.
  int localRank = 0, localRanks = 0;
  findHostRanks(*world, localRank, localRanks);
  RankSetup setup;
  std::string error;
  prepareRank(opts, worldRank, localRank, localRanks, setup, error);
  if (!agree(*world, error))
    return finish(1);
  if (opts.checkData) {
    // Every rank opened (and checked) its share; nothing is trained or written.
    if (worldRank == 0) {
      const Program &p = *setup.program;
      std::printf(
          "carve: --check-data: %s fits program '%s'%s\n", setup.loader->describe().c_str(), p.name,
          p.vocab > 0
              ? (": every token id is below the vocabulary of " + std::to_string(p.vocab)).c_str()
              : "");
      if (setup.evalLoader)
        std::printf("carve: --check-data: evaluation data %s fits too (%lld global batch%s per "
                    "evaluation)\n",
                    setup.evalLoader->describe().c_str(), static_cast<long long>(setup.evalBatches),
                    setup.evalBatches == 1 ? "" : "es");
      for (int64_t k = 0; k < opts.showBatches; ++k)
        for (int64_t j = 0; j < p.globalBatch; ++j)
          std::printf("carve: step %lld row %lld: %s\n", static_cast<long long>(k + 1),
                      static_cast<long long>(j), setup.loader->source(k, j).c_str());
      std::fflush(stdout);
    }
    if (setup.device) {
      setup.device->freeArena(setup.deviceArena);
      setup.device->close();
    }
    std::free(setup.arena);
    return finish(0);
  }

  // Step 3: the metrics log and the communicators.
  MetricsLog log;
  if (worldRank == 0 && !opts.log.empty() && !log.open(opts.log, error))
    die(error);
  TensorBoardLog board;
  if (worldRank == 0 && !opts.tensorboard.empty() && !board.open(opts.tensorboard, error))
    die(error);
  AxisGroups groups;
  makeAxisGroups(*world, setup.mesh, setup.program->ep, setup.device, groups);

  reportStart(*world, opts, setup, setup.weights.step, setup.weights.step + opts.steps,
              worldRank == 0 && !opts.quiet);

  // Step 4: training; step 5: the final checkpoint.
  Trainer trainer(*world, opts, faults, setup, groups, log, board);
  if (!trainer.run()) {
    std::free(setup.arena);
    return finish(1);
  }
  trainer.wrapUp();
  groups.dpDevice.reset();
  groups.tpDevice.reset();
  groups.ppDevice.reset();
  groups.dp.reset();
  groups.tp.reset();
  groups.pp.reset();
  if (setup.device) {
    setup.device->freeArena(setup.deviceArena);
    setup.device->close();
  }
  std::free(setup.arena);
  std::fflush(stdout);
  return finish(0);
}
