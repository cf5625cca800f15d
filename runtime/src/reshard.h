//===- reshard.h - this rank's part of weights saved under any plan -------===//
//
// Train reads its initial weights from OUT/init.safetensors (full tensors) or
// from a checkpoint saved under any plan (--load: full tensors, or shards
// reassembled tensor by tensor), and keeps this rank's part of each tensor:
// its tensor-parallel piece and, for ZeRO, its dp chunk of that piece. The
// checkpoint writer (checkpoint_save.h) sees the program's tensors through
// the same slots. The file formats: carve/rt/checkpoint.h, docs/checkpoints.md.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_SRC_RESHARD_H
#define CARVE_RT_SRC_RESHARD_H

#include "carve/rt/checkpoint.h"
#include "carve/rt/mesh.h"
#include "carve/rt/program.h"
#include "carve/rt/safetensors.h"

#include <cstdint>
#include <string>
#include <vector>

namespace carve::rt {

/// The executable's output folder: OUT for OUT/bin/train.
std::string outputDir();

/// This rank's shape of a tensor.
std::vector<int64_t> shapeOf(const TensorSpec &s);
/// The model's shape of a tensor: what files hold.
std::vector<int64_t> globalShapeOf(const TensorSpec &s);
/// The number of elements of a tensor of shape `shape`.
int64_t numelOf(const std::vector<int64_t> &shape);

/// Checks the tensor-parallel and ZeRO fields of every parameter against the
/// mesh, so that loading and saving can rely on them.
bool checkShardedSpecs(const Program &p, const Mesh &m, std::string &error);

/// One tensor of the program that a checkpoint file holds.
struct Slot {
  std::string name;
  const TensorSpec *spec;
  int64_t offset; // in the arena
};

/// The parameters and buffers of `p`, by model name; a parameter with a
/// 16-bit copy is its fp32 master (TensorSpec::masterOffset), which loading
/// also rounds into the copy.
std::vector<Slot> modelSlots(const Program &p);
/// The optimizer state of the trainable parameters of `p`, by checkpoint name
/// ("PARAM.exp_avg", "PARAM.exp_avg_sq" or "PARAM.momentum_buffer").
std::vector<Slot> optimizerSlots(const Program &p);

/// How one slot of the arena relates to the full tensor in a file.
struct SlotLayout {
  int elemBytes;
  bool split; // a tensor-parallel piece
  bool zero;  // only this dp rank's ZeRO chunk of the piece
};

/// How the arena slot of `s` (its optimizer state with `state`; its master
/// weight, when it has one) relates to the full tensor on mesh `m`.
SlotLayout layoutOf(const TensorSpec &s, bool state, const Mesh &m);

/// The optimizer as a manifest names it: "adamw" or "sgd".
const char *optimizerKindName(OptimizerKind k);

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

/// Opens and validates where the initial weights of `p` come from: the
/// checkpoint `load` (a --save folder, a step folder or the full format),
/// or with an empty `load` OUT/init.safetensors. A checkpoint must match the
/// compiled model exactly. Reads no tensor data yet.
bool openWeights(const Program &p, const std::string &load, WeightSource &src, std::string &error);

/// Fills this rank's parameters (and loaded optimizer state) in the arena.
bool fillArena(const Program &p, WeightSource &src, char *arena, const Mesh &m, std::string &error);

} // namespace carve::rt

#endif // CARVE_RT_SRC_RESHARD_H
