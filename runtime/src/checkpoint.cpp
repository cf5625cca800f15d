//===- checkpoint.cpp - sharded checkpoints: manifest, folders, reader ----===//

#include "carve/rt/checkpoint.h"

#include "carve/rt/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <sys/stat.h>
#include <unistd.h>

namespace carve::rt {

namespace {

using Json = nlohmann::ordered_json;

bool isDir(const std::string &p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool isFile(const std::string &p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

/// The step of a folder called "step-NNNNNNNN" (at least 8 digits), or -1.
int64_t stepOfFolderName(const std::string &name) {
  if (name.size() < 13 || name.compare(0, 5, "step-") != 0 || name.size() > 5 + 18)
    return -1;
  int64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9')
      return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

/// More elements than any checkpoint tensor holds; keeps `numel * 8` and sums
/// of shard sizes far from int64 overflow.
constexpr int64_t kMaxElements = int64_t(1) << 56;

/// numel of `shape`, or -1 above kMaxElements.
int64_t numelOf(const std::vector<int64_t> &shape) {
  for (int64_t d : shape)
    if (d == 0)
      return 0;
  int64_t n = 1;
  for (int64_t d : shape) {
    if (n > kMaxElements / d)
      return -1;
    n *= d;
  }
  return n;
}

/// Reads an int64 field; false if it is absent or not an integer.
bool getInt(const Json &obj, const char *key, int64_t &out) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_number_integer())
    return false;
  out = it->get<int64_t>();
  return true;
}

bool getShape(const Json &v, std::vector<int64_t> &out) {
  if (!v.is_array())
    return false;
  out.clear();
  for (const Json &d : v) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0)
      return false;
    out.push_back(d.get<int64_t>());
  }
  return true;
}

/// Converts `n` elements of `dtype` at `src` to float.
bool toFloat(const std::string &dtype, const char *src, int64_t n, float *dst) {
  if (dtype == "F32") {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
    return true;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (dtype == "F64") {
      double v;
      std::memcpy(&v, src + 8 * i, 8);
      dst[i] = static_cast<float>(v);
    } else if (dtype == "I64") {
      int64_t v;
      std::memcpy(&v, src + 8 * i, 8);
      dst[i] = static_cast<float>(v);
    } else if (dtype == "I32") {
      int32_t v;
      std::memcpy(&v, src + 4 * i, 4);
      dst[i] = static_cast<float>(v);
    } else if (dtype == "BOOL" || dtype == "U8") {
      dst[i] = static_cast<float>(static_cast<unsigned char>(src[i]));
    } else {
      return false;
    }
  }
  return true;
}

/// Copies the block `shard` (row-major at `src`) into the full tensor `dst`
/// of shape `full`, marking the elements it covers in `covered`. False on an
/// element covered twice.
bool placeBlock(const char *src, const std::vector<int64_t> &full, const CheckpointShard &shard,
                int elemBytes, char *dst, std::vector<bool> &covered) {
  const size_t rank = full.size();
  if (numelOf(shard.shape) == 0)
    return true;
  if (rank == 0) {
    if (covered[0])
      return false;
    covered[0] = true;
    std::memcpy(dst, src, static_cast<size_t>(elemBytes));
    return true;
  }
  std::vector<int64_t> stride(rank, 1);
  for (size_t d = rank - 1; d > 0; --d)
    stride[d - 1] = stride[d] * full[d];
  const int64_t inner = shard.shape[rank - 1];
  std::vector<int64_t> idx(rank, 0); // over the block's outer dimensions
  const int64_t rows = numelOf(shard.shape) / inner;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t at = 0;
    for (size_t d = 0; d < rank; ++d)
      at += (shard.offsets[d] + idx[d]) * stride[d];
    for (int64_t i = 0; i < inner; ++i) {
      if (covered[at + i])
        return false;
      covered[at + i] = true;
    }
    std::memcpy(dst + at * elemBytes, src + r * inner * elemBytes,
                static_cast<size_t>(inner * elemBytes));
    for (size_t d = rank - 1; d-- > 0;) {
      if (++idx[d] < shard.shape[d])
        break;
      idx[d] = 0;
    }
  }
  return true;
}

} // namespace

std::string checkpointFolderName(int64_t step) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::string checkpointRankFile(int rank) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "rank-%05d.safetensors", rank);
  return buf;
}

std::vector<std::pair<int64_t, std::string>> listCheckpoints(const std::string &dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  DIR *d = ::opendir(dir.c_str());
  if (!d)
    return out;
  while (struct dirent *e = ::readdir(d)) {
    std::string name = e->d_name;
    int64_t step = stepOfFolderName(name);
    std::string folder = dir + "/" + name;
    if (step >= 0 && isDir(folder) && isFile(folder + "/manifest.json"))
      out.emplace_back(step, folder);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

std::string manifestToJson(const CheckpointManifest &m) {
  Json j;
  j["format"] = m.format;
  j["model"] = m.model;
  j["description"] = m.description;
  j["plan"] = {{"world_size", m.worldSize},
               {"dp", m.dp},
               {"tp", m.tp},
               {"pp", m.pp},
               {"zero", m.zeroStage},
               {"micro_batches", m.microBatches}};
  j["step"] = m.step;
  j["optimizer"] = {{"kind", m.optimizer}, {"step", m.optimizerStep}};
  j["lr_schedule"] = {{"step", m.lrStep}};
  j["data"] = {{"step", m.dataStep}, {"global_batch", m.globalBatch}, {"seq_len", m.seqLen}};
  if (m.rng == "none")
    j["rng"] = "none";
  else
    j["rng"] = {{"generator", m.rng}, {"seed", m.rngSeed}};
  if (m.lossScale > 0)
    j["loss_scale"] = {{"scale", m.lossScale}, {"good_steps", m.lossScaleGoodSteps}};
  if (!m.hyperparameters.empty()) {
    Json h = Json::object();
    for (const auto &[k, v] : m.hyperparameters)
      h[k] = v;
    h["schedule"] = m.schedule;
    j["hyperparameters"] = h;
  }
  // One line per tensor: readable, and a fraction of the size fully indented.
  std::string text = j.dump(1);
  text.erase(text.rfind('}'));
  while (!text.empty() && text.back() == '\n')
    text.pop_back();
  text += ",\n \"tensors\": [";
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const CheckpointTensor &t = m.tensors[i];
    Json shards = Json::array();
    for (const CheckpointShard &s : t.shards)
      shards.push_back({{"file", s.file},
                        {"key", s.key},
                        {"rank", s.rank},
                        {"offsets", s.offsets},
                        {"shape", s.shape}});
    Json one = {{"name", t.name},
                {"role", t.role},
                {"dtype", t.dtype},
                {"shape", t.shape},
                {"shards", shards}};
    text += (i ? ",\n  " : "\n  ") + one.dump();
  }
  return text + "\n ]\n}\n";
}

bool readManifest(const std::string &stepDir, CheckpointManifest &m, std::string &error) {
  const std::string path = stepDir + "/manifest.json";
  auto fail = [&](const std::string &cause) {
    error = path + ": " + cause;
    return false;
  };
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return fail(isDir(stepDir) ? "missing (not a complete checkpoint step folder)"
                               : "cannot read: " + std::string(std::strerror(errno)));
  std::stringstream text;
  text << in.rdbuf();
  bool deep = false;
  Json j = Json::parse(
      text.str(),
      [&](int depth, Json::parse_event_t, Json &) {
        // dump() and copies recurse once per level: refuse absurd nesting here.
        deep = deep || depth > 64;
        return !deep;
      },
      /*allow_exceptions=*/false);
  if (deep)
    return fail("nested deeper than 64 levels");
  if (j.is_discarded() || !j.is_object())
    return fail("not valid JSON (truncated or corrupt)");
  m = CheckpointManifest();
  if (!j.contains("format") || !j["format"].is_string() ||
      j["format"].get<std::string>() != m.format)
    return fail("\"format\" is not \"" + m.format + "\"");
  auto str = [&](const char *key, std::string &out) {
    auto it = j.find(key);
    if (it != j.end() && it->is_string())
      out = it->get<std::string>();
  };
  str("model", m.model);
  str("description", m.description);
  str("rng", m.rng);
  if (auto it = j.find("rng"); it != j.end() && it->is_object()) {
    auto g = it->find("generator"), s = it->find("seed");
    if (g == it->end() || !g->is_string() || s == it->end() || !s->is_number_unsigned())
      return fail("\"rng\" needs a string \"generator\" and an integer \"seed\" >= 0");
    m.rng = g->get<std::string>();
    m.rngSeed = s->get<uint64_t>();
  }
  if (m.rng != "none" && m.rng != "philox4x32-10")
    return fail("\"rng\": unknown generator '" + m.rng + "' (carve writes \"philox4x32-10\")");
  const Json &plan = j.contains("plan") ? j["plan"] : Json();
  int64_t v[6];
  const char *planKeys[6] = {"world_size", "dp", "tp", "pp", "zero", "micro_batches"};
  for (int i = 0; i < 6; ++i)
    if (!plan.is_object() || !getInt(plan, planKeys[i], v[i]) || v[i] < (i == 4 ? 0 : 1))
      return fail(std::string("\"plan\" lacks a valid \"") + planKeys[i] + "\"");
  m.worldSize = (int)v[0], m.dp = (int)v[1], m.tp = (int)v[2], m.pp = (int)v[3];
  m.zeroStage = (int)v[4], m.microBatches = (int)v[5];
  if (!getInt(j, "step", m.step) || m.step < 0)
    return fail("no valid \"step\"");
  const Json &opt = j.contains("optimizer") ? j["optimizer"] : Json();
  if (!opt.is_object() || !opt.contains("kind") || !opt["kind"].is_string() ||
      !getInt(opt, "step", m.optimizerStep))
    return fail("\"optimizer\" needs \"kind\" and \"step\"");
  m.optimizer = opt["kind"].get<std::string>();
  const Json &lr = j.contains("lr_schedule") ? j["lr_schedule"] : Json();
  if (!lr.is_object() || !getInt(lr, "step", m.lrStep))
    return fail("\"lr_schedule\" needs \"step\"");
  const Json &data = j.contains("data") ? j["data"] : Json();
  if (!data.is_object() || !getInt(data, "step", m.dataStep))
    return fail("\"data\" needs \"step\"");
  getInt(data, "global_batch", m.globalBatch);
  getInt(data, "seq_len", m.seqLen);
  if (j.contains("loss_scale")) {
    const Json &ls = j["loss_scale"];
    if (!ls.is_object() || !ls.contains("scale") || !ls["scale"].is_number() ||
        !getInt(ls, "good_steps", m.lossScaleGoodSteps) || m.lossScaleGoodSteps < 0)
      return fail("\"loss_scale\" needs a number \"scale\" and \"good_steps\" >= 0");
    m.lossScale = ls["scale"].get<double>();
    if (!(m.lossScale >= 1 && m.lossScale <= 1e30))
      return fail("\"loss_scale\": the scale " + std::to_string(m.lossScale) +
                  " is outside [1, 1e30]");
  }
  if (j.contains("hyperparameters")) {
    const Json &h = j["hyperparameters"];
    if (!h.is_object() || !h.contains("schedule") || !h["schedule"].is_string())
      return fail("\"hyperparameters\" needs an object with a \"schedule\" name");
    for (const char *k : {"lr", "min_lr", "warmup_steps", "decay_steps", "weight_decay", "beta1",
                          "beta2", "eps", "clip"}) {
      if (!h.contains(k) || !h[k].is_number())
        return fail(std::string("\"hyperparameters\" needs a number \"") + k + "\"");
      m.hyperparameters.push_back({k, h[k].get<double>()});
    }
    m.schedule = h["schedule"].get<std::string>();
  }
  if (!j.contains("tensors") || !j["tensors"].is_array())
    return fail("no \"tensors\" list");
  for (const Json &t : j["tensors"]) {
    CheckpointTensor ct;
    if (!t.is_object() || !t.contains("name") || !t["name"].is_string())
      return fail("a tensor without a \"name\"");
    ct.name = t["name"].get<std::string>();
    std::string what = "tensor '" + ct.name + "': ";
    if (!t.contains("dtype") || !t["dtype"].is_string() ||
        safetensorsDtypeSize(t["dtype"].get<std::string>()) == 0)
      return fail(what + "no valid \"dtype\"");
    ct.dtype = t["dtype"].get<std::string>();
    if (t.contains("role") && t["role"].is_string())
      ct.role = t["role"].get<std::string>();
    if (ct.role != "parameter" && ct.role != "buffer" && ct.role != "optimizer_state")
      return fail(what + "\"role\" is not parameter, buffer or optimizer_state");
    if (!t.contains("shape") || !getShape(t["shape"], ct.shape) || numelOf(ct.shape) < 0)
      return fail(what + "no valid \"shape\"");
    if (!t.contains("shards") || !t["shards"].is_array())
      return fail(what + "no \"shards\" list");
    int64_t covered = 0;
    for (const Json &s : t["shards"]) {
      CheckpointShard cs;
      int64_t rank = -1;
      if (!s.is_object() || !s.contains("file") || !s["file"].is_string() || !s.contains("key") ||
          !s["key"].is_string() || !getInt(s, "rank", rank) || rank < 0 || !s.contains("offsets") ||
          !getShape(s["offsets"], cs.offsets) || !s.contains("shape") ||
          !getShape(s["shape"], cs.shape))
        return fail(what + "a shard lacks file, key, rank, offsets or shape");
      cs.file = s["file"].get<std::string>();
      cs.key = s["key"].get<std::string>();
      cs.rank = static_cast<int>(rank);
      if (cs.file.empty() || cs.file.find('/') != std::string::npos || cs.file[0] == '.')
        return fail(what + "shard file '" + cs.file + "' is not a file name in the step folder");
      if (cs.offsets.size() != ct.shape.size() || cs.shape.size() != ct.shape.size())
        return fail(what + "a shard's offsets/shape do not have the tensor's rank");
      for (size_t d = 0; d < ct.shape.size(); ++d)
        if (cs.offsets[d] > ct.shape[d] || cs.shape[d] > ct.shape[d] - cs.offsets[d])
          return fail(what + "shard '" + cs.key + "' at " + formatShape(cs.offsets) + " of shape " +
                      formatShape(cs.shape) + " lies outside " + formatShape(ct.shape));
      covered += numelOf(cs.shape);
      ct.shards.push_back(std::move(cs));
    }
    if (covered != numelOf(ct.shape))
      return fail(what + "its shards hold " + std::to_string(covered) + " elements, the tensor " +
                  std::to_string(numelOf(ct.shape)));
    m.tensors.push_back(std::move(ct));
  }
  return true;
}

bool locateCheckpoint(const std::string &path, CheckpointLocation &loc, std::string &error) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    error = path + ": no such checkpoint folder";
    return false;
  }
  if (!S_ISDIR(st.st_mode)) {
    error = path + ": a checkpoint is a folder, this is a file";
    return false;
  }
  if (isFile(path + "/manifest.json")) {
    loc = {path, true};
    return true;
  }
  const std::string latest = path + "/latest";
  if (isFile(latest)) {
    std::ifstream in(latest);
    std::string name;
    std::getline(in, name);
    while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back())))
      name.pop_back();
    if (stepOfFolderName(name) < 0) {
      error = latest + ": does not name a step folder (\"" + name + "\")";
      return false;
    }
    if (!isFile(path + "/" + name + "/manifest.json")) {
      error = latest + ": names " + name + ", which is not a complete step folder (no " + name +
              "/manifest.json)";
      return false;
    }
    loc = {path + "/" + name, true};
    return true;
  }
  // A --save folder may also hold an older full-format checkpoint: its step
  // folders come first.
  auto steps = listCheckpoints(path);
  if (steps.empty() && isFile(path + "/model.safetensors")) {
    loc = {path, false};
    return true;
  }
  if (steps.empty()) {
    error = path + ": not a checkpoint (no manifest.json, no latest, no complete step-* "
                   "folder, no model.safetensors)";
    return false;
  }
  loc = {steps.back().second, true};
  return true;
}

struct ShardFiles::Impl {
  std::string dir;
  std::map<std::string, std::unique_ptr<SafetensorsReader>> files;
};

ShardFiles::ShardFiles(std::string stepDir) : impl(new Impl) { impl->dir = std::move(stepDir); }
ShardFiles::~ShardFiles() = default;

bool ShardFiles::readTensor(const CheckpointTensor &t, void *dst, std::string &error) {
  const int elemBytes = safetensorsDtypeSize(t.dtype);
  std::vector<bool> covered(static_cast<size_t>(numelOf(t.shape)), false);
  std::vector<char> block;
  for (const CheckpointShard &s : t.shards) {
    std::unique_ptr<SafetensorsReader> &file = impl->files[s.file];
    if (!file) {
      auto reader = std::make_unique<SafetensorsReader>();
      if (!reader->open(impl->dir + "/" + s.file, error)) {
        impl->files.erase(s.file);
        return false;
      }
      file = std::move(reader);
    }
    const SafetensorsTensor *st = file->find(s.key);
    if (!st) {
      error =
          file->path() + ": no tensor '" + s.key + "' (shard of '" + t.name + "' in the manifest)";
      return false;
    }
    if (st->dtype != t.dtype || st->shape != s.shape) {
      error = file->path() + ": tensor '" + s.key + "' is " + st->dtype + " " +
              formatShape(st->shape) + ", the manifest says " + t.dtype + " " +
              formatShape(s.shape);
      return false;
    }
    block.resize(static_cast<size_t>(st->end - st->begin));
    if (!file->read(*st, 0, st->end - st->begin, block.data(), error))
      return false;
    if (!placeBlock(block.data(), t.shape, s, elemBytes, static_cast<char *>(dst), covered)) {
      error = impl->dir + "/manifest.json: tensor '" + t.name + "': shards overlap";
      return false;
    }
  }
  return true;
}

bool readFullCheckpoint(const std::string &path, std::vector<FullTensor> &out, std::string &error,
                        bool withOptimizer) {
  out.clear();
  CheckpointLocation loc;
  if (!locateCheckpoint(path, loc, error))
    return false;
  std::vector<char> bytes;
  if (loc.sharded) {
    CheckpointManifest m;
    if (!readManifest(loc.folder, m, error))
      return false;
    ShardFiles files(loc.folder);
    for (const CheckpointTensor &t : m.tensors) {
      if (t.role == "optimizer_state" && !withOptimizer)
        continue;
      const int64_t n = numelOf(t.shape);
      // The shards must hold the tensor's data: a manifest cannot make us
      // allocate more than the files it names hold.
      int64_t held = 0;
      std::set<std::string> named;
      struct stat st;
      for (const CheckpointShard &s : t.shards)
        if (named.insert(s.file).second && ::stat((loc.folder + "/" + s.file).c_str(), &st) == 0)
          held += static_cast<int64_t>(st.st_size);
      if (n * safetensorsDtypeSize(t.dtype) > held) {
        error = loc.folder + "/manifest.json: tensor '" + t.name + "' of shape " +
                formatShape(t.shape) + " is larger than its shard files (" + std::to_string(held) +
                " bytes)";
        return false;
      }
      bytes.assign(static_cast<size_t>(n * safetensorsDtypeSize(t.dtype)), 0);
      if (!files.readTensor(t, bytes.data(), error))
        return false;
      FullTensor ft{t.name, t.shape, std::vector<float>(static_cast<size_t>(n))};
      if (!toFloat(t.dtype, bytes.data(), n, ft.data.data())) {
        error = loc.folder + "/manifest.json: tensor '" + t.name + "' has dtype " + t.dtype +
                ", which cannot be converted to F32";
        return false;
      }
      out.push_back(std::move(ft));
    }
    return true;
  }
  std::vector<std::string> names = {"model.safetensors"};
  if (withOptimizer && isFile(loc.folder + "/optimizer.safetensors"))
    names.push_back("optimizer.safetensors");
  for (const std::string &name : names) {
    SafetensorsReader file;
    if (!file.open(loc.folder + "/" + name, error))
      return false;
    for (const SafetensorsTensor &t : file.tensors()) {
      bytes.resize(static_cast<size_t>(t.end - t.begin));
      if (!file.read(t, 0, t.end - t.begin, bytes.data(), error))
        return false;
      FullTensor ft{t.name, t.shape, std::vector<float>(static_cast<size_t>(t.numel))};
      if (!toFloat(t.dtype, bytes.data(), t.numel, ft.data.data())) {
        error = file.path() + ": tensor '" + t.name + "' has dtype " + t.dtype +
                ", which cannot be converted to F32";
        return false;
      }
      out.push_back(std::move(ft));
    }
  }
  return true;
}

bool syncFolder(const std::string &dir, std::string &error) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0 || ::fsync(fd) != 0) {
    error = dir + ": cannot sync the folder: " + std::strerror(errno);
    if (fd >= 0)
      ::close(fd);
    return false;
  }
  ::close(fd);
  return true;
}

bool writeFileAtomic(const std::string &path, const std::string &text, std::string &error) {
  std::string tmp = path + ".tmp-XXXXXX";
  int fd = ::mkstemp(tmp.data());
  if (fd < 0) {
    error = path + ": cannot write: " + std::strerror(errno);
    return false;
  }
  size_t done = 0;
  bool ok = true;
  while (ok && done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR)
      continue;
    ok = n > 0;
    if (ok)
      done += static_cast<size_t>(n);
  }
  ok = ok && ::fchmod(fd, 0644) == 0 && ::fsync(fd) == 0;
  ok = ::close(fd) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    error = path + ": cannot write: " + std::strerror(errno);
    ::unlink(tmp.c_str());
    return false;
  }
  size_t slash = path.rfind('/');
  return syncFolder(slash == std::string::npos ? "."
                    : slash == 0               ? "/"
                                               : path.substr(0, slash),
                    error);
}

} // namespace carve::rt
