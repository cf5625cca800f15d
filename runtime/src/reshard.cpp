//===- reshard.cpp - this rank's part of weights saved under any plan -----===//

#include "reshard.h"

#include "train_args.h"

#include "carve/rt/dist.h"
#include "carve/rt/kernels.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <sys/stat.h>
#include <unistd.h>

namespace carve::rt {

namespace {

/// Checkpoint name of optimizer state slot `slot` of a parameter.
std::string stateName(const Program &p, const char *param, int slot) {
  if (p.optimizer == OptimizerKind::AdamW)
    return std::string(param) + (slot == 0 ? ".exp_avg" : ".exp_avg_sq");
  return std::string(param) + ".momentum_buffer";
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

/// A 16-bit parameter copy (TensorSpec::masterOffset): after its master was
/// loaded from the full tensor `full`, writes the copy's part of it (the
/// parameter's tp piece, ZeRO-3: its chunk), rounded to nearest even, so the
/// copy is exactly what an update would have rounded the master to.
void keepCopy(const char *full, const TensorSpec &spec, const Mesh &m, char *arena,
              std::vector<char> &piece) {
  if (spec.masterOffset < 0)
    return;
  const SlotLayout l{4, spec.tpDim >= 0 && m.tp > 1, spec.paramZero && spec.zeroChunk > 0};
  std::vector<float> part(static_cast<size_t>(l.zero ? spec.zeroChunk : spec.numel));
  keepPart(full, spec, l, m, reinterpret_cast<char *>(part.data()), piece);
  uint16_t *copy = reinterpret_cast<uint16_t *>(arena + spec.offset);
  if (spec.copyType == DType::BF16)
    toBf16(part.data(), copy, static_cast<int64_t>(part.size()));
  else if (spec.copyType == DType::F16)
    toF16(part.data(), copy, static_cast<int64_t>(part.size()));
  else
    fatal("tensor '%s': a master weight's copy must be BF16 or F16, not %s", spec.name,
          dtypeName(spec.copyType));
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
    if (!stateF32)
      keepCopy(full.data(), *s.spec, m, arena, piece);
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
    if (!state)
      keepCopy(full.data(), *s.spec, m, arena, piece);
  }
  return true;
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

bool openWeightFiles(const Program &p, const std::string &load, WeightSource &src,
                     std::string &error) {
  std::vector<Slot> params = modelSlots(p);
  if (load.empty()) {
    // carve compile writes every rank's parameters here; extra tensors belong
    // to other ranks' programs.
    std::string init = outputDir() + "/init.safetensors";
    struct stat st;
    bool exists = ::stat(init.c_str(), &st) == 0;
    if (!src.model.open(init, error) || !checkTensors(src.model, params, false, nullptr, error)) {
      error = "initial weights " + error +
              (exists ? ""
                      : " (`carve compile` writes them beside bin/ unless given --no-weights; "
                        "or pass --load DIR)");
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
  if (!locateCheckpoint(load, loc, error))
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

} // namespace

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

std::vector<Slot> modelSlots(const Program &p) {
  std::vector<Slot> slots;
  for (int i = 0; i < p.numParams; ++i)
    slots.push_back(
        {p.params[i].name, &p.params[i],
         p.params[i].masterOffset >= 0 ? p.params[i].masterOffset : p.params[i].offset});
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

SlotLayout layoutOf(const TensorSpec &s, bool state, const Mesh &m) {
  // A master weight is chunked as the optimizer state is.
  const bool asState = state || s.masterOffset >= 0;
  return {state ? 4 : dtypeSize(s.dtype), s.tpDim >= 0 && m.tp > 1,
          (asState ? s.stateZero : s.paramZero) && s.zeroChunk > 0};
}

const char *optimizerKindName(OptimizerKind k) {
  return k == OptimizerKind::AdamW ? "adamw" : "sgd";
}

bool openWeights(const Program &p, const std::string &load, WeightSource &src, std::string &error) {
  if (openWeightFiles(p, load, src, error))
    return true;
  if (!load.empty())
    error = "checkpoint " + error;
  return false;
}

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

} // namespace carve::rt
