//===- CkptCmd.cpp - `carve ckpt inspect|merge` ---------------------------===//

#include "tools/carve/CkptCmd.h"

#include "compiler/frontend/OnnxImporter.h"

#include "carve/rt/checkpoint.h"
#include "carve/rt/safetensors.h"

#include "mlir/IR/MLIRContext.h"
#include "llvm/ADT/APFloat.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/raw_ostream.h"

#include <cstring>
#include <list>
#include <map>
#include <set>
#include <sys/stat.h>

using namespace llvm;
using mlir::MLIRContext;

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

/// A float rounded to bf16 or fp16 (round to nearest even), as bits.
uint16_t toBits16(float x, bool bf16) {
  if (bf16) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) // NaN: keep it a quiet NaN
      return static_cast<uint16_t>((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1);
    return static_cast<uint16_t>(u >> 16);
  }
  APFloat f(x);
  bool lost;
  f.convert(APFloat::IEEEhalf(), APFloat::rmNearestTiesToEven, &lost);
  return static_cast<uint16_t>(f.bitcastToAPInt().getZExtValue());
}

/// One tensor of the merged file: a name and float data (converted to the
/// output dtype when written).
struct Out {
  std::string name;
  std::vector<int64_t> shape;
  const std::vector<float> *data;
  bool state; // optimizer state: always F32
};

int merge(const CkptArgs &args) {
  const std::string &path = args.positional[1], &output = args.output;
  if (output.empty())
    return fail("ckpt merge needs -o FILE.safetensors (where to write the full model)");
  if (args.dtype != "fp32" && args.dtype != "bf16" && args.dtype != "fp16")
    return fail("--dtype is fp32, bf16 or fp16, not '" + args.dtype + "'");
  struct stat st;
  if (::stat(output.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    return fail(output + ": -o names a folder, merge writes one .safetensors file");
  std::vector<rt::FullTensor> tensors;
  std::string error;
  if (!rt::readFullCheckpoint(path, tensors, error, args.withOptimizer))
    return fail(error);
  std::map<std::string, const rt::FullTensor *> byName;
  for (const rt::FullTensor &t : tensors)
    byName[t.name] = &t;

  // The names and order of the file: the module's state_dict() when the
  // model says it (--model: the export's carve.state_dict metadata), with the
  // tensors the checkpoint lacks (buffers the program folded) from the
  // model's initializers; else the checkpoint's own.
  std::vector<Out> outs;
  std::list<std::vector<float>> transposed; // tied copies' values (stable addresses)
  std::vector<std::string> notes;
  OnnxStateFacts facts;
  std::set<std::string> written;
  std::map<std::string, const std::vector<float> *> tiedCopies;
  std::map<std::string, std::vector<int64_t>> tiedShapes;
  if (!args.model.empty()) {
    MLIRContext ctx;
    if (!readOnnxStateFacts(ctx, args.model, {}, facts, error))
      return fail(error);
    std::string stateDict, buffers;
    for (auto &[k, v] : facts.metadata)
      (k == "carve.state_dict" ? stateDict : k == "carve.buffers" ? buffers : error) = v;
    error.clear();
    std::set<std::string> inits(facts.initializerNames.begin(), facts.initializerNames.end());
    std::vector<std::pair<std::string, std::string>> order; // key, source
    auto listOf = [&](const std::string &text, const char *key,
                      std::vector<json::Value> &items) -> bool {
      Expected<json::Value> v = json::parse(text);
      if (!v || !v->getAsArray()) {
        if (!v)
          consumeError(v.takeError());
        error = args.model + ": metadata \"" + key + "\" is not a JSON list";
        return false;
      }
      items.assign(v->getAsArray()->begin(), v->getAsArray()->end());
      return true;
    };
    if (!stateDict.empty()) {
      std::vector<json::Value> items;
      if (!listOf(stateDict, "carve.state_dict", items))
        return fail(error);
      for (const json::Value &it : items) {
        const json::Array *pair = it.getAsArray();
        if (!pair || pair->size() != 2 || !(*pair)[0].getAsString() || !(*pair)[1].getAsString())
          return fail(args.model +
                      ": metadata \"carve.state_dict\" entries must be [key, tensor] pairs");
        order.push_back({(*pair)[0].getAsString()->str(), (*pair)[1].getAsString()->str()});
      }
    } else {
      for (const rt::FullTensor &t : tensors)
        order.push_back({t.name, t.name});
      if (!buffers.empty()) {
        std::vector<json::Value> items;
        if (!listOf(buffers, "carve.buffers", items))
          return fail(error);
        for (const json::Value &it : items)
          if (auto n = it.getAsString(); n && !byName.count(n->str()) && inits.count(n->str()))
            order.push_back({n->str(), n->str()});
      }
      // A plain export's transposed copy of a tied weight, which carve
      // trained as the weight itself: written under its own name too.
      for (auto &[copy, original] : facts.transposedTies) {
        auto it = byName.find(original);
        if (byName.count(copy) || it == byName.end() || it->second->shape.size() != 2)
          continue;
        const int64_t m = it->second->shape[0], n = it->second->shape[1];
        std::vector<float> &t = transposed.emplace_back(m * n);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t q = 0; q < n; ++q)
            t[q * m + r] = it->second->data[r * n + q];
        order.push_back({copy, copy});
        tiedCopies[copy] = &t;
        tiedShapes[copy] = {n, m};
      }
      notes.push_back(args.model +
                      " has no carve.state_dict metadata (models/export.py's export_for_carve "
                      "records it): tied aliases are not written" +
                      (tiedCopies.empty() ? std::string()
                                          : " (the transposed copies of tied weights are)"));
    }
    std::vector<std::string> wanted;
    for (auto &[key, src] : order)
      if (!byName.count(src) && !tiedCopies.count(src)) {
        if (!inits.count(src))
          return fail("the model's state_dict key '" + key + "' (tensor '" + src +
                      "') is neither in the checkpoint nor an initializer of " + args.model);
        wanted.push_back(src);
      }
    if (!wanted.empty()) {
      MLIRContext ctx;
      OnnxStateFacts values;
      if (!readOnnxStateFacts(ctx, args.model, wanted, values, error))
        return fail(error);
      facts.values = std::move(values.values);
    }
    std::map<std::string, const ImportOptions::InitialValue *> fromModel;
    for (const ImportOptions::InitialValue &v : facts.values)
      fromModel[v.name] = &v;
    for (auto &[key, src] : order) {
      if (!written.insert(key).second)
        return fail(args.model + ": the state_dict key '" + key + "' is listed twice");
      if (auto it = tiedCopies.find(src); it != tiedCopies.end())
        outs.push_back({key, tiedShapes[src], it->second, false});
      else if (auto it = byName.find(src); it != byName.end())
        outs.push_back({key, it->second->shape, &it->second->data, false});
      else
        outs.push_back({key, fromModel[src]->shape, &fromModel[src]->data, false});
    }
  } else {
    notes.push_back("without --model MODEL.onnx the file holds the checkpoint's tensors only: "
                    "no tied aliases, no buffers the program folded");
  }
  for (const rt::FullTensor &t : tensors) {
    const bool state = t.name.find(".exp_avg") != std::string::npos ||
                       t.name.find(".momentum_buffer") != std::string::npos;
    if (args.model.empty() || (state && !written.count(t.name)))
      outs.push_back({t.name, t.shape, &t.data, state});
  }

  const bool half = args.dtype != "fp32", bf16 = args.dtype == "bf16";
  const std::string dtype = !half ? "F32" : bf16 ? "BF16" : "F16";
  std::vector<std::vector<uint16_t>> converted;
  converted.reserve(outs.size());
  std::vector<rt::SafetensorsEntry> entries;
  for (const Out &o : outs) {
    if (!half || o.state) {
      entries.push_back({o.name, "F32", o.shape, o.data->data()});
      continue;
    }
    converted.emplace_back(o.data->size());
    for (size_t i = 0; i < o.data->size(); ++i)
      converted.back()[i] = toBits16((*o.data)[i], bf16);
    entries.push_back({o.name, dtype, o.shape, converted.back().data()});
  }
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
  for (const Out &o : outs)
    elements += static_cast<int64_t>(o.data->size());
  llvm::outs() << "carve: wrote " << output << ": " << outs.size() << " tensors, " << elements
               << " elements (" << dtype << ") from " << loc.folder << "\n";
  for (const std::string &n : notes)
    llvm::outs() << "carve: note: " << n << "\n";
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
    if (!args.output.empty() || args.withOptimizer || !args.model.empty() || args.dtype != "fp32")
      return fail("-o, --with-optimizer, --model and --dtype apply to `carve ckpt merge`");
    return inspect(p[1]);
  }
  return merge(args);
}

} // namespace carve
