//===- CkptCmd.cpp - `carve ckpt inspect|merge` ---------------------------===//

#include "tools/carve/CkptCmd.h"

#include "carve/rt/checkpoint.h"
#include "carve/rt/safetensors.h"

#include "llvm/Support/raw_ostream.h"

#include <map>
#include <sys/stat.h>

using namespace llvm;

namespace carve {

namespace {

int fail(const std::string &message) {
  errs() << "carve: error: " << message << "\n";
  return 1;
}

int64_t numelOf(const std::vector<int64_t> &shape) {
  int64_t n = 1;
  for (int64_t d : shape)
    n *= d;
  return n;
}

/// "[0:64, 32:64]": the index ranges of a block.
std::string formatBlock(const std::vector<int64_t> &offsets, const std::vector<int64_t> &shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(offsets[i]) + ":" + std::to_string(offsets[i] + shape[i]);
  return s + "]";
}

int inspectFull(const std::string &path, const std::string &folder) {
  std::vector<rt::FullTensor> tensors;
  std::string error;
  if (!rt::readFullCheckpoint(folder, tensors, error, /*withOptimizer=*/true))
    return fail(error);
  rt::SafetensorsReader model;
  if (!model.open(folder + "/model.safetensors", error))
    return fail(error);
  auto step = model.metadata().find("step");
  outs() << "checkpoint " << path << ": the older full format (model.safetensors"
         << (tensors.size() > model.tensors().size() ? " + optimizer.safetensors" : "")
         << "), step " << (step == model.metadata().end() ? "unknown" : step->second)
         << ", full tensors, no shards\n";
  for (const rt::FullTensor &t : tensors)
    outs() << "  " << t.name << " " << rt::formatShape(t.shape) << "\n";
  return 0;
}

int inspect(const std::string &path) {
  rt::CheckpointLocation loc;
  std::string error;
  if (!rt::locateCheckpoint(path, loc, error))
    return fail(error);
  if (!loc.sharded)
    return inspectFull(path, loc.folder);
  rt::CheckpointManifest m;
  if (!rt::readManifest(loc.folder, m, error))
    return fail(error);
  outs() << "checkpoint " << loc.folder << " (" << m.format << ")\n";
  outs() << "model: " << m.model << "\n";
  outs() << "plan: " << m.worldSize << (m.worldSize == 1 ? " rank" : " ranks") << ", dp=" << m.dp
         << " tp=" << m.tp << " pp=" << m.pp << " zero=" << m.zeroStage
         << " micro_batches=" << m.microBatches << "\n";
  outs() << "step: " << m.step << " (optimizer " << m.optimizer << " step " << m.optimizerStep
         << ", lr schedule at step " << m.lrStep << ", data at batch " << m.dataStep
         << ", global batch " << m.globalBatch;
  if (m.seqLen)
    outs() << ", seq_len " << m.seqLen;
  outs() << ", rng " << m.rng << ")\n";
  if (!m.description.empty())
    outs() << "optimizer: " << m.description << "\n";
  std::string parent = path;
  if (loc.folder != path) {
    auto all = rt::listCheckpoints(path);
    outs() << "steps in " << path << ":";
    for (auto &s : all)
      outs() << " " << s.first;
    outs() << "\n";
  }
  // Per rank: its file's shard count and elements.
  std::map<int, std::pair<int64_t, int64_t>> perRank;
  int64_t params = 0, state = 0;
  for (const rt::CheckpointTensor &t : m.tensors) {
    (t.role == "optimizer_state" ? state : params) += numelOf(t.shape);
    for (const rt::CheckpointShard &s : t.shards) {
      perRank[s.rank].first += 1;
      perRank[s.rank].second += numelOf(s.shape);
    }
  }
  outs() << "tensors: " << m.tensors.size() << " (" << params
         << " elements of parameters and buffers, " << state << " of optimizer state)\n";
  for (auto &[rank, count] : perRank)
    outs() << "  " << rt::checkpointRankFile(rank) << ": " << count.first << " shards, "
           << count.second << " elements\n";
  for (const rt::CheckpointTensor &t : m.tensors) {
    outs() << t.name << " " << t.role << " " << t.dtype << " " << rt::formatShape(t.shape) << "\n";
    for (const rt::CheckpointShard &s : t.shards)
      outs() << "  rank " << s.rank << " " << formatBlock(s.offsets, s.shape) << " " << s.file
             << ":" << s.key << "\n";
  }
  return 0;
}

int merge(const std::string &path, const std::string &output, bool withOptimizer) {
  if (output.empty())
    return fail("ckpt merge needs -o FILE.safetensors (where to write the full model)");
  struct stat st;
  if (::stat(output.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    return fail(output + ": -o names a folder, merge writes one .safetensors file");
  std::vector<rt::FullTensor> tensors;
  std::string error;
  if (!rt::readFullCheckpoint(path, tensors, error, withOptimizer))
    return fail(error);
  std::vector<rt::SafetensorsEntry> entries;
  for (const rt::FullTensor &t : tensors)
    entries.push_back({t.name, "F32", t.shape, t.data.data()});
  rt::CheckpointLocation loc;
  rt::locateCheckpoint(path, loc, error);
  std::vector<std::pair<std::string, std::string>> meta = {{"source", loc.folder},
                                                           {"format", "pt"}};
  if (loc.sharded) {
    rt::CheckpointManifest m;
    if (rt::readManifest(loc.folder, m, error))
      meta.push_back({"step", std::to_string(m.step)});
  }
  if (!rt::writeSafetensors(output, entries, meta, error))
    return fail(error);
  int64_t elements = 0;
  for (const rt::FullTensor &t : tensors)
    elements += static_cast<int64_t>(t.data.size());
  outs() << "carve: wrote " << output << ": " << tensors.size() << " tensors, " << elements
         << " elements (F32) from " << loc.folder << "\n";
  return 0;
}

} // namespace

int runCkpt(const CkptArgs &args) {
  const std::vector<std::string> &p = args.positional;
  if (p.empty() || (p[0] != "inspect" && p[0] != "merge"))
    return fail("usage: carve ckpt inspect PATH | carve ckpt merge PATH -o FILE.safetensors");
  if (p.size() != 2)
    return fail("carve ckpt " + p[0] +
                " takes one checkpoint PATH (a --save folder, a step "
                "folder or a full-format folder), got " +
                std::to_string(p.size() - 1));
  if (p[0] == "inspect") {
    if (!args.output.empty() || args.withOptimizer)
      return fail("-o and --with-optimizer apply to `carve ckpt merge`");
    return inspect(p[1]);
  }
  return merge(p[1], args.output, args.withOptimizer);
}

} // namespace carve
