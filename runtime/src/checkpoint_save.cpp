//===- checkpoint_save.cpp - train --save: every rank writes its shards ---===//

#include "checkpoint_save.h"

#include "faults.h"
#include "rank_errors.h"
#include "reshard.h"

#include "carve/rt/checkpoint.h"
#include "carve/rt/mesh.h"
#include "carve/rt/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <map>
#include <set>
#include <sys/stat.h>
#include <unistd.h>

namespace carve::rt {

namespace {

/// Creates `dir` and every missing folder above it.
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

/// The shards world rank `rank` writes. Every element of every tensor is
/// written once: a replicated tensor by the lowest dp rank holding it (tp rank 0 unless it is
/// tp-split), a ZeRO-sharded one by every dp rank (its chunk), a parameter
/// that several pipeline stages hold by the lowest of them. Any rank can
/// compute any rank's shards: every program is linked into every executable.
std::vector<PlannedShard> planShards(int rank) {
  std::vector<PlannedShard> out;
  const Program *p = carve_program_for_rank(rank);
  if (!p)
    return out;
  const Mesh m = Mesh::ofRank(rank, p->dp, p->tp, p->pp);
  std::set<std::string> earlierStages, lowerReplicas;
  for (int s = 0; s < m.ppRank; ++s)
    if (const Program *q = carve_program_for_rank(m.rankAt(s, m.dpRank, m.tpRank)))
      for (int i = 0; i < q->numParams; ++i)
        earlierStages.insert(q->params[i].name);
  // Replicated tensors: the lowest dp rank that holds one writes it (rank 0,
  // but for the experts of expert parallelism, which lower ranks lack).
  for (int d = 0; d < m.dpRank; ++d)
    if (const Program *q = carve_program_for_rank(m.rankAt(m.ppRank, d, m.tpRank)))
      for (int i = 0; i < q->numParams; ++i)
        lowerReplicas.insert(q->params[i].name);
  for (bool state : {false, true})
    for (const Slot &s : state ? optimizerSlots(*p) : modelSlots(*p)) {
      const TensorSpec &spec = *s.spec;
      const SlotLayout l = layoutOf(spec, state, m);
      if (earlierStages.count(spec.name) || (!l.zero && lowerReplicas.count(spec.name)) ||
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
                                 int64_t lossScaleGoodSteps, const Hyperparameters *hyper,
                                 uint64_t seed) {
  CheckpointManifest m;
  // Any rank's program may hold the dropout (pipeline stages).
  for (int r = 0; r < carve_world_size(); ++r)
    if (const Program *q = carve_program_for_rank(r); q && q->dropoutNodes > 0)
      m.rng = "philox4x32-10", m.rngSeed = seed;
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
  if (hyper) {
    const Hyperparameters &h = *hyper;
    m.hyperparameters = {{"lr", h.lr},
                         {"min_lr", h.lr * h.minLrRatio},
                         {"warmup_steps", static_cast<double>(h.warmupSteps)},
                         {"decay_steps", static_cast<double>(h.decaySteps)},
                         {"weight_decay", h.weightDecay},
                         {"beta1", h.beta1},
                         {"beta2", h.beta2},
                         {"eps", h.eps},
                         {"clip", h.clip}};
    m.schedule = scheduleName(h.schedule);
  }
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

} // namespace

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

void saveCheckpoint(Communicator &world, const Program &p, const char *arena,
                    const std::string &dir, int64_t step, int64_t keep, double lossScale,
                    int64_t lossScaleGoodSteps, const Hyperparameters *hyper, uint64_t seed) {
  std::string error;
  const std::string name = checkpointFolderName(step);
  const std::string tmp = dir + "/.tmp-" + name;
  const int64_t delay = FaultInjection::saveDelayMs();
  auto pause = [&] {
    if (delay)
      ::usleep(static_cast<useconds_t>(delay * 1000));
  };
  if (world.rank() == 0) {
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

  std::vector<PlannedShard> shards = planShards(world.rank());
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
      {"rank", std::to_string(world.rank())},
      {"program", p.name}};
  pause();
  if (!writeSafetensors(tmp + "/" + checkpointRankFile(world.rank()), entries, meta, error))
    die(error);
  storage.clear();
  world.barrier(); // every rank's file is written and fsynced

  if (world.rank() == 0) {
    pause();
    const std::string final = dir + "/" + name;
    struct stat st;
    bool ok = writeFileAtomic(tmp + "/manifest.json",
                              manifestToJson(buildManifest(p, step, lossScale, lossScaleGoodSteps,
                                                           hyper, seed)),
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

} // namespace carve::rt
