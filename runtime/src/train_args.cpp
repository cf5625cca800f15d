//===- train_args.cpp - the command line of OUT/bin/train -----------------===//

#include "train_args.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace carve::rt {

namespace {
/// A number in the fewest digits (up to 15) that read back the same: values
/// one rounding apart (a ratio times the lr it was divided by) print alike.
std::string formatNumber(double x) {
  char buf[32];
  for (int p = 1; p <= 15; ++p) {
    std::snprintf(buf, sizeof buf, "%.*g", p, x);
    if (std::strtod(buf, nullptr) == x)
      break;
  }
  return buf;
}
} // namespace

const char *const kTrainUsage =
    R"(usage: train --steps S --data FILE [options]

Trains the compiled model for S steps. Launch it with `carve run OUT -n N -- ARGS`,
or with mpirun/srun and the number of ranks it was compiled for, or from any launcher
that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT per process (docs/nccl.md).

  --steps S                   optimizer steps to run (required)
  --data FILES                training data (required): files or globs, comma-separated,
                              read as one set: flat little-endian token files for token
                              models, else safetensors files with one tensor per model
                              input, [N, ...] (N samples) or [S, B, ...] (S batches)
                              (docs/data.md)
  --data-dtype TYPE           element type of token files: int32 (default), uint16
                              or int64 (a file of another width is refused by name)
  --shuffle SEED              read the data in epochs, shuffled anew each epoch from SEED:
                              token files as windows of T+1 tokens, tensors by sample; the
                              same batches under every plan and world size, and on resume
  --seed SEED                 the dropout masks' seed (default 0; a resumed run keeps its
                              checkpoint's): each mask element is a function of the seed,
                              the step, the dropout node and the element's place in the
                              full tensor, so every plan draws the same masks
  --doc-eot ID                token files: a document ends after each token ID; no window
                              crosses a document's end
  --doc-offsets FILE          token files: the documents' starts, int64 little-endian token
                              offsets into the files read as one stream
  --check-data                check --data (and --eval-data) against this program and
                              train nothing: the files' layout, every input's dtype and
                              shape, their length, and every token id inside the model's
                              vocabulary (all of it; a training run checks files over
                              1 GiB batch by batch)
  --show-batches N            with --check-data: print where each row of the first N
                              steps is read from
  --eval-data FILES           held-out data in --data's format: evaluated in order (never
                              shuffled), forward only, without updating anything; the mean
                              loss (and perplexity for token models) goes to the progress
                              line, --log and --tensorboard
  --eval-every N              evaluate after every N-th step (default: after the last only)
  --eval-batches K            global batches per evaluation (default: the whole set)
  --log FILE.jsonl            write one JSON object per step (replaces FILE)
  --tensorboard DIR           also write the step's loss, learning rate, gradient norm and
                              throughput as TensorBoard scalars (an event file in DIR;
                              tensorboard --logdir DIR shows them)
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
  --lr X                      peak learning rate (after warm-up)
  --min-lr X                  the lowest learning rate the schedule decays to
  --warmup-steps N            linear warm-up from lr/N to lr over the first N steps
  --decay-steps N             steps of the decay (after warm-up; wsd: the last N of the run)
  --schedule cosine|linear|constant|wsd
                              the learning rate after warm-up: cosine or linear decay to
                              --min-lr over --decay-steps; constant; wsd (warm-up, stable,
                              then a linear decay over the run's last --decay-steps steps)
  --weight-decay X            decoupled weight decay (AdamW) or L2 (SGD)
  --beta1 X, --beta2 X, --eps X
                              AdamW's coefficients
  --clip X                    clip the global gradient norm to X (0: no clipping)
                              Each of these overrides the value compiled into the program
                              (listed below) for this run, without recompiling; checkpoints
                              record the values used
  --cuda-graph, --no-cuda-graph
                              CUDA programs, on by default: run the first step as it is,
                              capture the forward and backward (kernels and collectives) in a
                              CUDA graph on the second and replay it from then on (one launch
                              instead of one per kernel). A step that cannot be captured runs
                              eagerly, and the run says which call broke the capture.
                              Pipeline-parallel programs run eagerly; so do runs with
                              CARVE_GPU_PROFILE=1 unless --cuda-graph is given
  --quiet                     print nothing but errors (--progress none)
  --help                      print this text
)";
DataOptions dataOptions(const Options &opts, bool eval) {
  DataOptions d;
  d.paths = eval ? opts.evalData : opts.data;
  d.tokenType = opts.dataType;
  d.eotId = opts.docEot;
  d.docOffsets = eval ? std::string() : opts.docOffsets;
  d.shuffle = !eval && opts.shuffle;
  d.seed = opts.shuffleSeed;
  d.checkWhole = opts.checkData;
  d.windows = eval;
  d.flag = eval ? "--eval-data" : "--data";
  return d;
}

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
    if ((arg == "--cuda-graph" || arg == "--no-cuda-graph" || arg == "--quiet" ||
         arg == "--check-data") &&
        inlineValue) {
      error = arg + " takes no value";
      return false;
    } else if (arg == "--seed") {
      if (!takeValue())
        return false;
      int64_t v = 0;
      if (!parseInt(value, v) || v < 0) {
        error = "--seed needs a seed, an integer >= 0, not '" + value + "'";
        return false;
      }
      opts.seed = static_cast<uint64_t>(v), opts.seedSet = true;
    } else if (arg == "--shuffle" || arg == "--doc-eot" || arg == "--eval-every" ||
               arg == "--eval-batches" || arg == "--show-batches") {
      if (!takeValue())
        return false;
      int64_t v = 0;
      const bool positive = arg == "--eval-every" || arg == "--eval-batches";
      if (!parseInt(value, v) || v < (positive ? 1 : 0)) {
        error = arg + " needs " +
                (arg == "--shuffle"   ? "a seed, an integer >= 0"
                 : arg == "--doc-eot" ? "a token id, an integer >= 0"
                 : positive           ? "a positive integer"
                                      : "an integer >= 0") +
                ", not '" + value + "'";
        return false;
      }
      if (arg == "--shuffle")
        opts.shuffle = true, opts.shuffleSeed = static_cast<uint64_t>(v);
      else if (arg == "--doc-eot")
        opts.docEot = v;
      else if (arg == "--eval-every")
        opts.evalEvery = v;
      else if (arg == "--eval-batches")
        opts.evalBatches = v;
      else
        opts.showBatches = v;
    } else if (arg == "--cuda-graph" || arg == "--no-cuda-graph") {
      const int want = arg == "--cuda-graph" ? 1 : 0;
      if (opts.cudaGraph >= 0 && opts.cudaGraph != want) {
        error = "--cuda-graph and --no-cuda-graph contradict each other";
        return false;
      }
      opts.cudaGraph = want;
    } else if (arg == "--check-data") {
      opts.checkData = true;
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
               arg == "--trace" || arg == "--tensorboard" || arg == "--eval-data" ||
               arg == "--doc-offsets") {
      if (!takeValue())
        return false;
      if (value.empty()) {
        error = arg + " needs a non-empty path";
        return false;
      }
      (arg == "--data"          ? opts.data
       : arg == "--log"         ? opts.log
       : arg == "--save"        ? opts.save
       : arg == "--trace"       ? opts.trace
       : arg == "--tensorboard" ? opts.tensorboard
       : arg == "--eval-data"   ? opts.evalData
       : arg == "--doc-offsets" ? opts.docOffsets
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
    } else if (arg == "--lr" || arg == "--min-lr" || arg == "--weight-decay" || arg == "--beta1" ||
               arg == "--beta2" || arg == "--eps" || arg == "--clip") {
      if (!takeValue())
        return false;
      char *end = nullptr;
      double v = value.empty() ? NAN : std::strtod(value.c_str(), &end);
      const bool positive = arg == "--lr" || arg == "--eps";
      const bool below1 = arg == "--beta1" || arg == "--beta2";
      if (value.empty() || *end != '\0' || !std::isfinite(v) || v < 0 || (positive && v == 0) ||
          (below1 && v >= 1)) {
        error = arg + " needs a number " +
                (positive ? "> 0"
                 : below1 ? "in [0, 1)"
                          : ">= 0") +
                ", not '" + value + "'";
        return false;
      }
      auto &set = opts.hyperSet;
      if (arg == "--lr")
        opts.lr = v, set.lr = true;
      else if (arg == "--min-lr")
        opts.minLr = v, set.minLr = true;
      else if (arg == "--weight-decay")
        opts.weightDecay = v, set.weightDecay = true;
      else if (arg == "--beta1")
        opts.beta1 = v, set.beta1 = true;
      else if (arg == "--beta2")
        opts.beta2 = v, set.beta2 = true;
      else if (arg == "--eps")
        opts.eps = v, set.eps = true;
      else
        opts.clip = v, set.clip = true;
    } else if (arg == "--warmup-steps" || arg == "--decay-steps") {
      if (!takeValue())
        return false;
      int64_t &field = arg == "--warmup-steps" ? opts.warmupSteps : opts.decaySteps;
      if (!parseInt(value, field) || field < 0) {
        error = arg + " needs an integer >= 0, not '" + value + "'";
        return false;
      }
      (arg == "--warmup-steps" ? opts.hyperSet.warmupSteps : opts.hyperSet.decaySteps) = true;
    } else if (arg == "--schedule") {
      if (!takeValue())
        return false;
      if (!parseSchedule(value.c_str(), opts.schedule)) {
        error = "--schedule is cosine, linear, constant or wsd, not '" + value + "'";
        return false;
      }
      opts.hyperSet.schedule = true;
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
      } else if (value == "int64") {
        opts.dataType = TokenFileType::Int64;
      } else {
        error = "--data-dtype is int32, uint16 or int64, not '" + value + "'";
        return false;
      }
    } else {
      error = "unknown argument '" + std::string(argv[i]) + "' (see --help)";
      return false;
    }
  }
  if (opts.steps < 0 && !opts.checkData) {
    error = "--steps is required (see --help)";
    return false;
  }
  if (opts.checkData && opts.steps < 0)
    opts.steps = 1;
  if (opts.data.empty()) {
    error = "--data is required (see --help)";
    return false;
  }
  if ((opts.evalEvery > 0 || opts.evalBatches > 0) && opts.evalData.empty()) {
    error = std::string(opts.evalEvery > 0 ? "--eval-every" : "--eval-batches") +
            " needs --eval-data FILES (the held-out set)";
    return false;
  }
  if (opts.showBatches > 0 && !opts.checkData) {
    error = "--show-batches needs --check-data";
    return false;
  }
  if (opts.docEot >= 0 && !opts.docOffsets.empty()) {
    error = "--doc-eot and --doc-offsets both mark documents: give one of them";
    return false;
  }
  if ((opts.saveEvery > 0 || opts.keep > 0) && opts.save.empty()) {
    error = std::string(opts.saveEvery > 0 ? "--save-every" : "--keep") +
            " needs --save DIR (the folder to save into)";
    return false;
  }
  return true;
}

bool applyHyperparameters(const Options &opts, const Hyperparameters &defaults, bool adamw,
                          int64_t endStep, Hyperparameters &h, std::string &error) {
  const auto &set = opts.hyperSet;
  if (!adamw && (set.beta1 || set.beta2 || set.eps)) {
    error = std::string(set.beta1   ? "--beta1"
                        : set.beta2 ? "--beta2"
                                    : "--eps") +
            ": this program's optimizer is SGD, which has no betas or eps (they are AdamW's)";
    return false;
  }
  h = defaults;
  if (set.lr)
    h.lr = opts.lr;
  if (set.minLr) {
    if (opts.minLr > h.lr) {
      error = "--min-lr " + formatNumber(opts.minLr) + " is above the learning rate " +
              formatNumber(h.lr);
      return false;
    }
    h.minLrRatio = opts.minLr / h.lr;
  }
  if (set.warmupSteps)
    h.warmupSteps = opts.warmupSteps;
  if (set.decaySteps)
    h.decaySteps = opts.decaySteps;
  if (set.schedule)
    h.schedule = opts.schedule;
  if (set.weightDecay)
    h.weightDecay = opts.weightDecay;
  if (set.beta1)
    h.beta1 = opts.beta1;
  if (set.beta2)
    h.beta2 = opts.beta2;
  if (set.eps)
    h.eps = opts.eps;
  if (set.clip)
    h.clip = opts.clip;
  h.endStep = endStep;
  return true;
}

std::string hyperparameterChanges(const Hyperparameters &a, const Hyperparameters &b,
                                  const char *what) {
  std::string s;
  auto add = [&](const char *name, const std::string &x, const std::string &y) {
    if (x != y)
      s += (s.empty() ? "" : ", ") + std::string(name) + " " + x + " (" + what + " " + y + ")";
  };
  add("lr", formatNumber(a.lr), formatNumber(b.lr));
  add("min-lr", formatNumber(a.lr * a.minLrRatio), formatNumber(b.lr * b.minLrRatio));
  add("warmup-steps", std::to_string(a.warmupSteps), std::to_string(b.warmupSteps));
  add("decay-steps", std::to_string(a.decaySteps), std::to_string(b.decaySteps));
  add("schedule", scheduleName(a.schedule), scheduleName(b.schedule));
  add("weight-decay", formatNumber(a.weightDecay), formatNumber(b.weightDecay));
  add("beta1", formatNumber(a.beta1), formatNumber(b.beta1));
  add("beta2", formatNumber(a.beta2), formatNumber(b.beta2));
  add("eps", formatNumber(a.eps), formatNumber(b.eps));
  add("clip", formatNumber(a.clip), formatNumber(b.clip));
  return s;
}

std::string hyperparameterHelp(const Hyperparameters &d, bool adamw) {
  std::string s = "\nThis program's compiled hyperparameters (the defaults of the flags above):\n";
  s += "  --lr " + formatNumber(d.lr) + "  --min-lr " + formatNumber(d.lr * d.minLrRatio) +
       "  --warmup-steps " + std::to_string(d.warmupSteps) + "  --decay-steps " +
       std::to_string(d.decaySteps) + "  --schedule " + scheduleName(d.schedule) + "\n";
  s += "  --weight-decay " + formatNumber(d.weightDecay);
  if (adamw)
    s += "  --beta1 " + formatNumber(d.beta1) + "  --beta2 " + formatNumber(d.beta2) + "  --eps " +
         formatNumber(d.eps);
  s += "  --clip " + formatNumber(d.clip) + (d.clip > 0 ? "" : " (no clipping)") + "\n";
  return s;
}

bool wantsHelp(int argc, char **argv) {
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h"))
      return true;
  return false;
}

void applyEarlyCollectiveTimeout(int argc, char **argv) {
  for (int i = 1; i + 1 < argc; ++i)
    if (!std::strcmp(argv[i], "--collective-timeout")) {
      char *end = nullptr;
      double v = std::strtod(argv[i + 1], &end);
      if (end && *end == '\0' && v >= 0 && std::isfinite(v))
        setCollectiveTimeout(v);
    }
}

} // namespace carve::rt
