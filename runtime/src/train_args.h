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
  bool cudaGraph = false;    // --cuda-graph
};

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
