//===- train_args.h - the command line of OUT/bin/train -------------------===//
//
// The options of every generated training executable, their parsing and the
// --help text (runtime/README.md#running, docs/failures.md).
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_SRC_TRAIN_ARGS_H
#define CARVE_RT_SRC_TRAIN_ARGS_H

#include "carve/rt/comm.h"
#include "carve/rt/data.h"
#include "carve/rt/optim.h"

#include <cstdint>
#include <string>

namespace carve::rt {

/// The --help text.
extern const char *const kTrainUsage;

/// What the command line asked for.
struct Options {
  int64_t steps = -1;
  std::string data;
  TokenFileType dataType = TokenFileType::Int32;
  std::string log;
  std::string tensorboard; // --tensorboard DIR: TensorBoard event files
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
  double lossScale = 65536;  // fp16 plans: the initial dynamic loss scale
  bool lossScaleSet = false; // --loss-scale given: it wins over a checkpoint's
  // CUDA graphs: -1 by default (on for CUDA programs without pipeline
  // parallelism, off under CARVE_GPU_PROFILE), 1 with --cuda-graph, 0 with
  // --no-cuda-graph.
  int cudaGraph = -1;
  bool checkData = false;    // --check-data: validate --data against the program, train nothing
  int64_t showBatches = 0;   // --show-batches N (with --check-data): print where rows come from
  // Data sets (carve/rt/data.h): --shuffle SEED, --doc-eot ID, --doc-offsets FILE.
  bool shuffle = false;
  uint64_t shuffleSeed = 0;
  // --seed SEED: the dropout masks' seed (default 0, or the resumed
  // checkpoint's); seedSet: given on the command line.
  uint64_t seed = 0;
  bool seedSet = false;
  int64_t docEot = -1;
  std::string docOffsets;
  // Evaluation: --eval-data FILES, --eval-every N (0: after the last step
  // only), --eval-batches K (0: the whole set).
  std::string evalData;
  int64_t evalEvery = 0, evalBatches = 0;
  // Hyperparameters given on the command line (each set flag overrides the
  // program's compiled value; applyHyperparameters).
  struct {
    bool lr = false, minLr = false, warmupSteps = false, decaySteps = false, schedule = false,
         weightDecay = false, beta1 = false, beta2 = false, eps = false, clip = false;
  } hyperSet;
  double lr = 0, minLr = 0, weightDecay = 0, beta1 = 0, beta2 = 0, eps = 0, clip = 0;
  int64_t warmupSteps = 0, decaySteps = 0;
  Schedule schedule = Schedule::Cosine;
};

/// The run's hyperparameters: the program's compiled `defaults` with the
/// command line's overrides (an absolute --min-lr becomes the ratio to the
/// run's lr), checked against the program's optimizer (`adamw`: AdamW, else
/// SGD, which has no betas or eps) and each other; false with `error` naming
/// the flag. `endStep` is the run's end (wsd decays up to it).
bool applyHyperparameters(const Options &opts, const Hyperparameters &defaults, bool adamw,
                          int64_t endStep, Hyperparameters &out, std::string &error);
/// One line of what differs between `a` (this run) and `b` (`what`), e.g.
/// "lr 0.0003 (compiled 0.001), clip 1 (compiled 0)"; empty when equal.
std::string hyperparameterChanges(const Hyperparameters &a, const Hyperparameters &b,
                                  const char *what);
/// The --help section listing a program's compiled hyperparameters.
std::string hyperparameterHelp(const Hyperparameters &defaults, bool adamw);

/// The options of the training data (`eval`: false) or of the evaluation
/// set (true: in order, from the first window or sample).
DataOptions dataOptions(const Options &opts, bool eval);

/// Parses a whole decimal integer; false for empty text, trailing characters
/// or overflow.
bool parseInt(const std::string &text, int64_t &out);

/// Parses the arguments (all but --help, which the caller looks for first);
/// false with `error` naming the argument at fault.
bool parseArgs(int argc, char **argv, Options &opts, std::string &error);

/// Whether --help or -h is among the arguments.
bool wantsHelp(int argc, char **argv);

/// Applies a valid `--collective-timeout SECONDS` before the arguments are
/// checked: joining a TCP world already waits for the other ranks.
void applyEarlyCollectiveTimeout(int argc, char **argv);

} // namespace carve::rt

#endif // CARVE_RT_SRC_TRAIN_ARGS_H
