//===- checkpoint.h - sharded checkpoints: layout, manifest, reader -------===//
//
// A training program run with `--save DIR` (and `--save-every K`) writes
//
//   DIR/step-00000010/manifest.json          the plan, the step, the optimizer,
//                                            lr-schedule and data positions, the
//                                            RNG state, and per tensor (original
//                                            name) its full shape, dtype and shards
//   DIR/step-00000010/rank-00000.safetensors one file per rank: its shards
//   DIR/latest                               "step-00000010": the newest complete
//                                            step folder, written last
//
// A shard is a rectangular block of the full tensor: `offsets` is its corner,
// `shape` its extent; its data is stored row-major under `key` in `file`.
// Every element of a tensor lies in exactly one shard. A step folder is
// complete when its manifest.json exists: the ranks' files are written and
// fsynced into a hidden temporary folder first, the manifest last, and the
// folder is then renamed into place (docs/checkpoints.md).
//
// The older full format (a folder with model.safetensors and, optionally,
// optimizer.safetensors holding full tensors, "step" in __metadata__) is
// still read.
//
// This library has no MPI and no kernels: the `carve` tool links it.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_CHECKPOINT_H
#define CARVE_RT_CHECKPOINT_H

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace carve::rt {

/// A full tensor of a checkpoint, converted to fp32.
struct FullTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
};

/// Reads the checkpoint at `path` (a --save folder: its latest step; one step
/// folder; or a folder in the older full format) into full fp32 tensors by
/// original name, reassembling shards. Optimizer state is left out unless
/// `withOptimizer`. On failure returns false with `error` naming the file and
/// the cause.
bool readFullCheckpoint(const std::string &path, std::vector<FullTensor> &out, std::string &error,
                        bool withOptimizer = false);

/// The complete step folders of a --save folder, in increasing step order:
/// (step, path of the folder). Temporary and half-deleted folders are not
/// listed.
std::vector<std::pair<int64_t, std::string>> listCheckpoints(const std::string &dir);

//===--- The manifest -----------------------------------------------------===//

/// One rectangular block of a tensor, stored in one rank's file.
struct CheckpointShard {
  std::string file; // relative to the step folder, e.g. "rank-00003.safetensors"
  std::string key;  // the tensor's name inside that file
  int rank = 0;     // the world rank that wrote it
  std::vector<int64_t> offsets, shape;
};

/// One tensor of a checkpoint: a parameter, a buffer or an optimizer state.
struct CheckpointTensor {
  std::string name;  // original name; optimizer state: "PARAM.exp_avg", ...
  std::string role;  // "parameter", "buffer" or "optimizer_state"
  std::string dtype; // safetensors spelling; optimizer state is "F32"
  std::vector<int64_t> shape;
  std::vector<CheckpointShard> shards;
};

/// Everything manifest.json holds.
struct CheckpointManifest {
  std::string format = "carve-checkpoint-2";
  std::string model;       // the model file the program came from
  std::string description; // the program's optimizer, schedule and plan line
  // The plan it was saved under.
  int worldSize = 1, dp = 1, tp = 1, pp = 1, zeroStage = 0, microBatches = 1;
  int64_t step = 0;          // optimizer steps done; the next step is numbered `step`
  std::string optimizer;     // "sgd" or "adamw"
  int64_t optimizerStep = 0; // PyTorch's state['step'] after the last update
  int64_t lrStep = 0;        // the lr schedule's position (0-based step of the next update)
  int64_t dataStep = 0;      // the data stream's position: the next batch is batch dataStep
  int64_t globalBatch = 0, seqLen = 0;
  /// "none": the training step draws no random numbers; "philox4x32-10":
  /// dropout masks from `rngSeed` and the step (docs/training.md#dropout).
  std::string rng = "none";
  uint64_t rngSeed = 0;
  /// fp16 plans: the dynamic loss scale and the overflow-free steps since it
  /// last changed, so that a resumed run continues with them (0: not recorded).
  double lossScale = 0;
  int64_t lossScaleGoodSteps = 0;
  /// The hyperparameters the run that saved it used ("hyperparameters":
  /// lr, min_lr, warmup_steps, decay_steps, weight_decay, beta1, beta2, eps,
  /// clip as numbers, in this order, and the schedule's name; empty: not
  /// recorded, an older checkpoint).
  std::vector<std::pair<std::string, double>> hyperparameters;
  std::string schedule;
  std::vector<CheckpointTensor> tensors;
};

/// "step-00000010".
std::string checkpointFolderName(int64_t step);
/// "rank-00003.safetensors".
std::string checkpointRankFile(int rank);

/// manifest.json's text.
std::string manifestToJson(const CheckpointManifest &m);
/// Reads and validates `stepDir`/manifest.json (fields, dtypes, shards inside
/// their tensor, shard element counts adding up). `error` names the file.
bool readManifest(const std::string &stepDir, CheckpointManifest &m, std::string &error);

/// Where a checkpoint path leads.
struct CheckpointLocation {
  std::string folder; // the step folder, or the full-format folder
  bool sharded = true;
};

/// Resolves `path` (a --save folder, a step folder, a full-format folder).
/// A --save folder leads to the folder its `latest` names, or without
/// `latest` to its newest complete step folder; only a folder with neither
/// (nor a manifest.json) is read as the older full format.
bool locateCheckpoint(const std::string &path, CheckpointLocation &loc, std::string &error);

/// The rank files of one step folder, opened on first use and validated
/// against the manifest.
class ShardFiles {
public:
  explicit ShardFiles(std::string stepDir);
  ~ShardFiles();
  ShardFiles(const ShardFiles &) = delete;
  ShardFiles &operator=(const ShardFiles &) = delete;

  /// Assembles the full tensor `t` into `dst` (numel * dtype size bytes, the
  /// tensor's own dtype), checking that every shard's key exists with the
  /// manifest's dtype and shape and that the shards cover every element once.
  bool readTensor(const CheckpointTensor &t, void *dst, std::string &error);

private:
  struct Impl;
  std::unique_ptr<Impl> impl;
};

/// Writes `text` to `path` atomically: a temporary file in the same folder,
/// fsync, rename, fsync of the folder.
bool writeFileAtomic(const std::string &path, const std::string &text, std::string &error);
/// fsyncs the folder `dir` (so that renames inside it are durable).
bool syncFolder(const std::string &dir, std::string &error);

} // namespace carve::rt

#endif // CARVE_RT_CHECKPOINT_H
