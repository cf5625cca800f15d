//===- Cluster.cpp - cluster presets, files and the measured local CPU ----===//
//
// Preset numbers are vendor datasheet figures; docs/cluster.md cites each one.
// The `cpu` preset is measured once per process: a register-blocked FMA loop
// for the per-core peak, a triad and a copy over arrays larger than the last
// level cache for memory bandwidth.
//
//===----------------------------------------------------------------------===//

#include "compiler/planner/Cluster.h"
#include "compiler/plan/JsonRead.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <sys/stat.h>
#include <unistd.h>

namespace carve::planner {
namespace {

using json = nlohmann::json;

constexpr int64_t kMaxDevices = 1000000;

//===----------------------------------------------------------------------===//
// GPU presets
//===----------------------------------------------------------------------===//

struct GpuPreset {
  const char *key;
  const char *deviceName;
  double fp32, tf32, bf16, fp16; // dense peak FLOP/s; 0 = no such fast path
  double memoryBytes;            // marketed capacity, GB = 1e9 bytes
  double memoryBandwidth;        // bytes/s
  double nvlink;                 // bytes/s per GPU, one direction
  double nic;                    // bytes/s per GPU, one direction
};

// Latencies are per-message estimates at the collective-library level, not
// datasheet figures: a few microseconds through NVLink/NVSwitch, about five
// through one InfiniBand switch hop.
constexpr double kNvlinkLatency = 3e-6;
constexpr double kInfinibandLatency = 5e-6;
constexpr int kGpusPerNode = 8;

const GpuPreset kGpuPresets[] = {
    {"a100-40gb", "NVIDIA A100 40GB SXM4", 19.5e12, 156e12, 312e12, 312e12, 40e9, 1555e9, 300e9,
     25e9},
    {"a100-80gb", "NVIDIA A100 80GB SXM4", 19.5e12, 156e12, 312e12, 312e12, 80e9, 2039e9, 300e9,
     25e9},
    {"h100-80gb", "NVIDIA H100 80GB SXM5", 67e12, 494.7e12, 989.4e12, 989.4e12, 80e9, 3.35e12,
     450e9, 50e9},
    {"h200-141gb", "NVIDIA H200 141GB SXM5", 67e12, 494.7e12, 989.4e12, 989.4e12, 141e9, 4.8e12,
     450e9, 50e9},
    {"v100-32gb", "NVIDIA V100 32GB SXM2", 15.7e12, 0, 0, 125e12, 32e9, 900e9, 150e9, 12.5e9},
};

const char *const kCpuKey = "cpu";

Cluster gpuCluster(const GpuPreset &p) {
  Cluster c;
  c.device.name = p.deviceName;
  c.device.target = "cuda";
  c.device.peakFlops["fp32"] = p.fp32;
  if (p.tf32 > 0)
    c.device.peakFlops["tf32"] = p.tf32;
  if (p.bf16 > 0)
    c.device.peakFlops["bf16"] = p.bf16;
  if (p.fp16 > 0)
    c.device.peakFlops["fp16"] = p.fp16;
  c.device.memoryBytes = p.memoryBytes;
  c.device.memoryBandwidth = p.memoryBandwidth;
  c.nodes = 1;
  c.devicesPerNode = kGpusPerNode;
  c.intraNode = {p.nvlink, kNvlinkLatency};
  c.interNode = {p.nic, kInfinibandLatency};
  return c;
}

//===----------------------------------------------------------------------===//
// The local CPU, measured
//===----------------------------------------------------------------------===//

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The FMA loop keeps kRows x kCols vector accumulators in registers and streams a
// kDepth x kRows panel of A and a kDepth x kCols panel of B from L1, as a GEMM
// micro-kernel does: every B vector is reused kRows times and every broadcast of
// A kCols times, so loads never limit the FMA ports. Twelve independent
// accumulators cover the FMA latency times the number of FMA ports of current
// cores.
constexpr int kRows = 6;
constexpr int kCols = 2;
constexpr int kDepth = 64;

template <typename V>
[[gnu::always_inline]] inline float fmaLoop(const float *a, const float *b, long reps) {
  constexpr int lanes = sizeof(V) / sizeof(float);
  V acc[kRows][kCols] = {};
  for (long r = 0; r < reps; ++r) {
    for (int k = 0; k < kDepth; ++k) {
      V bv[kCols];
      for (int j = 0; j < kCols; ++j)
        std::memcpy(&bv[j], b + (k * kCols + j) * lanes, sizeof(V));
      for (int i = 0; i < kRows; ++i) {
        // x - 0 is x for every x (x + 0 is not, for -0): a plain broadcast.
        V av = a[k * kRows + i] - V{};
        for (int j = 0; j < kCols; ++j)
          acc[i][j] += av * bv[j];
      }
    }
  }
  float sum = 0;
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kCols; ++j)
      for (int l = 0; l < lanes; ++l)
        sum += acc[i][j][l];
  return sum;
}

using V4 = float __attribute__((vector_size(16)));
float fmaLoopBase(const float *a, const float *b, long reps) { return fmaLoop<V4>(a, b, reps); }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The compiler builds for baseline x86-64; the generated programs (and the
// BLAS they call) use the machine's widest vectors, so the kernel is compiled
// for each ISA and picked at run time.
using V8 = float __attribute__((vector_size(32)));
using V16 = float __attribute__((vector_size(64)));
__attribute__((target("avx2,fma"))) float fmaLoopAvx2(const float *a, const float *b, long reps) {
  return fmaLoop<V8>(a, b, reps);
}
__attribute__((target("avx512f"))) float fmaLoopAvx512(const float *a, const float *b, long reps) {
  return fmaLoop<V16>(a, b, reps);
}
#endif

struct FmaKernel {
  float (*run)(const float *, const float *, long);
  int lanes;
  const char *isa;
};

FmaKernel pickFmaKernel() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f"))
    return {fmaLoopAvx512, 16, "avx512f"};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return {fmaLoopAvx2, 8, "avx2+fma"};
  return {fmaLoopBase, 4, "sse2"};
#else
  return {fmaLoopBase, 4, "128-bit vectors"};
#endif
}

/// Peak single-core fp32 FLOP/s: the best of short timed runs within `budget`
/// seconds (the best run is the one the frequency ramp and the scheduler
/// disturbed least).
double measureCoreFlops(const FmaKernel &kernel, double budget) {
  std::vector<float> a(kDepth * kRows, 1e-3f);
  std::vector<float> b(kDepth * kCols * kernel.lanes, 1e-3f);
  const double flopsPerRep = 2.0 * kDepth * kRows * kCols * kernel.lanes;
  volatile float sink = 0;
  long reps = 64;
  double best = 0;
  Clock::time_point start = Clock::now();
  while (secondsSince(start) < budget) {
    Clock::time_point t0 = Clock::now();
    sink = sink + kernel.run(a.data(), b.data(), reps);
    double t = secondsSince(t0);
    if (t < 2e-3) {
      reps *= 2;
      continue;
    }
    best = std::max(best, flopsPerRep * reps / t);
  }
  return best;
}

struct MemoryRates {
  double triad = 0; // bytes/s, 3 arrays touched per element
  double copy = 0;  // bytes/s, read + write
};

/// Single-core memory bandwidth over arrays well past the caches one core
/// reaches. Filling the arrays first keeps the page faults out of the timing.
MemoryRates measureMemory(double budget) {
  const size_t bytes = 32u << 20;
  const size_t n = bytes / sizeof(float);
  std::unique_ptr<float[]> x(new float[n]), y(new float[n]), z(new float[n]);
  std::fill_n(y.get(), n, 1.0f);
  std::fill_n(z.get(), n, 2.0f);
  std::fill_n(x.get(), n, 0.0f);
  MemoryRates rates;
  const float scale = 0.5f;
  Clock::time_point start = Clock::now();
  while (secondsSince(start) < budget * 0.6) {
    Clock::time_point t0 = Clock::now();
    float *__restrict xp = x.get();
    const float *__restrict yp = y.get();
    const float *__restrict zp = z.get();
    for (size_t i = 0; i < n; ++i)
      xp[i] = yp[i] + scale * zp[i];
    rates.triad = std::max(rates.triad, 3.0 * bytes / secondsSince(t0));
  }
  while (secondsSince(start) < budget) {
    Clock::time_point t0 = Clock::now();
    std::memcpy(y.get(), x.get(), bytes);
    rates.copy = std::max(rates.copy, 2.0 * bytes / secondsSince(t0));
  }
  volatile float sink = x[n / 2] + y[n / 3];
  (void)sink;
  return rates;
}

struct CpuMeasurement {
  double coreFlops;
  MemoryRates memory;
  const char *isa;
};

/// Measured once per process (about 0.15 s) and never written to disk: the
/// machine a plan is made on may change between runs.
const CpuMeasurement &measureCpu() {
  static const CpuMeasurement m = [] {
    FmaKernel kernel = pickFmaKernel();
    CpuMeasurement r;
    r.coreFlops = measureCoreFlops(kernel, 0.07);
    r.memory = measureMemory(0.06);
    r.isa = kernel.isa;
    return r;
  }();
  return m;
}

int onlineCores() {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)std::min<long>(n, kMaxDevices) : 1;
}

double physicalMemory() {
  long pages = sysconf(_SC_PHYS_PAGES);
  long pageSize = sysconf(_SC_PAGESIZE);
  return pages > 0 && pageSize > 0 ? (double)pages * (double)pageSize : 0;
}

/// The local machine as `devicesPerNode` single-core ranks per node.
Cluster cpuCluster(int devicesPerNode) {
  const CpuMeasurement &m = measureCpu();
  int cores = onlineCores();
  Cluster c;
  c.device.name = "local CPU (" + std::to_string(cores) + (cores == 1 ? " core" : " cores") + ", " +
                  m.isa + ")";
  c.device.peakFlops["fp32"] = m.coreFlops;
  c.device.memoryBandwidth = m.memory.triad;
  c.nodes = 1;
  c.devicesPerNode = devicesPerNode > 0 ? devicesPerNode : cores;
  c.device.memoryBytes = physicalMemory() / c.devicesPerNode;
  // Shared-memory MPI moves a message through a shared buffer: two copies.
  c.intraNode = {m.memory.copy / 2, 2e-6};
  // 10 Gb/s Ethernet with a kernel TCP stack.
  c.interNode = {1.25e9, 50e-6};
  return c;
}

//===----------------------------------------------------------------------===//
// Spec parsing
//===----------------------------------------------------------------------===//

std::string knownPresets() {
  std::string s;
  for (const std::string &p : clusterPresets())
    s += (s.empty() ? "" : ", ") + p;
  return s;
}

bool isPreset(const std::string &name) {
  if (name == kCpuKey)
    return true;
  for (const GpuPreset &p : kGpuPresets)
    if (name == p.key)
      return true;
  return false;
}

/// Parses a decimal count; anything past nine digits reads as too many.
bool parseCount(const std::string &s, int64_t &value) {
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos)
    return false;
  value = s.size() > 9 ? kMaxDevices + 1 : std::strtoll(s.c_str(), nullptr, 10);
  return true;
}

/// `size` is the size as written, for the message.
bool checkSize(const std::string &what, int64_t nodes, int64_t perNode, const std::string &size,
               std::string &error) {
  if (nodes < 1 || perNode < 1) {
    error = what + ": nodes and devices per node must be at least 1, got " + size;
    return false;
  }
  if (nodes > kMaxDevices || perNode > kMaxDevices || nodes * perNode > kMaxDevices) {
    error = what + ": " + size + " is more than " + std::to_string(kMaxDevices) + " devices";
    return false;
  }
  return true;
}

/// `PRESET[:NODESxDEVICES]`. `nodes`/`perNode` of 0 mean the preset's default.
bool parsePresetSpec(const std::string &spec, const std::string &what, Cluster &cluster,
                     std::string &error) {
  size_t colon = spec.find(':');
  std::string key = spec.substr(0, colon);
  if (!isPreset(key)) {
    error = what + ": unknown preset '" + key + "' (known: " + knownPresets() +
            "; a JSON file path also works)";
    return false;
  }
  int64_t nodes = 0, perNode = 0;
  if (colon != std::string::npos) {
    std::string size = spec.substr(colon + 1);
    size_t x = size.find('x');
    if (x == std::string::npos || !parseCount(size.substr(0, x), nodes) ||
        !parseCount(size.substr(x + 1), perNode)) {
      error = what + ": size '" + size + "' is not NODESxDEVICES with positive integers (e.g. " +
              key + ":4x8)";
      return false;
    }
    if (!checkSize(what, nodes, perNode, size, error))
      return false;
  }
  if (key == kCpuKey) {
    cluster = cpuCluster((int)perNode);
  } else {
    for (const GpuPreset &p : kGpuPresets)
      if (key == p.key)
        cluster = gpuCluster(p);
  }
  if (nodes > 0) {
    cluster.nodes = (int)nodes;
    cluster.devicesPerNode = (int)perNode;
  }
  cluster.name = spec;
  return true;
}

//===----------------------------------------------------------------------===//
// JSON files
//===----------------------------------------------------------------------===//

const char *const kDtypes[] = {"fp32", "tf32", "bf16", "fp16"};

/// Reads one JSON object field by field; every error names the file and the
/// dotted field path.
class FileReader {
public:
  FileReader(std::string file, std::string &error) : file(std::move(file)), error(error) {}

  bool fail(const std::string &msg) {
    error = "cluster " + file + ": " + msg;
    return false;
  }

  bool checkKeys(const json &obj, const std::string &path,
                 std::initializer_list<const char *> known) {
    if (!obj.is_object())
      return fail("\"" + path + "\" must be an object, got " + obj.dump());
    for (auto it = obj.begin(); it != obj.end(); ++it) {
      bool ok = false;
      for (const char *k : known)
        ok |= it.key() == k;
      if (!ok) {
        std::string list;
        for (const char *k : known)
          list += (list.empty() ? "" : ", ") + std::string(k);
        return fail("unknown field \"" + join(path, it.key()) + "\" (known: " + list + ")");
      }
    }
    return true;
  }

  /// A positive number at obj[key]; `required` fails when it is absent.
  bool number(const json &obj, const std::string &path, const char *key, bool required, double &out,
              const char *unit) {
    auto it = obj.find(key);
    if (it == obj.end())
      return required ? fail("missing \"" + join(path, key) + "\" (" + unit + ")") : true;
    if (!it->is_number() || !(it->get<double>() > 0))
      return fail("\"" + join(path, key) + "\" must be a positive number (" + unit + "), got " +
                  it->dump());
    out = it->get<double>();
    return true;
  }

  bool count(const json &obj, const char *key, bool required, int64_t &out) {
    auto it = obj.find(key);
    if (it == obj.end())
      return required ? fail(std::string("missing \"") + key + "\"") : true;
    if (!it->is_number_integer() || it->get<int64_t>() < 1 || it->get<int64_t>() > kMaxDevices)
      return fail(std::string("\"") + key + "\" must be an integer from 1 to " +
                  std::to_string(kMaxDevices) + ", got " + it->dump());
    out = it->get<int64_t>();
    return true;
  }

  bool string(const json &obj, const std::string &path, const char *key, std::string &out) {
    auto it = obj.find(key);
    if (it == obj.end())
      return true;
    if (!it->is_string() || it->get<std::string>().empty())
      return fail("\"" + join(path, key) + "\" must be a non-empty string, got " + it->dump());
    out = it->get<std::string>();
    return true;
  }

  /// A link object: required fields only when there is no preset underneath.
  bool link(const json &root, const char *key, bool required, LinkSpec &out) {
    auto it = root.find(key);
    if (it == root.end())
      return required ? fail(std::string("missing \"") + key + "\"") : true;
    return checkKeys(*it, key, {"bandwidth", "latency"}) &&
           number(*it, key, "bandwidth", required, out.bandwidth, "bytes/s per device") &&
           number(*it, key, "latency", required, out.latency, "seconds");
  }

  bool device(const json &root, bool required, DeviceSpec &out) {
    auto it = root.find("device");
    if (it == root.end())
      return required ? fail("missing \"device\"") : true;
    const json &d = *it;
    if (!checkKeys(d, "device",
                   {"name", "peak_flops", "memory_bytes", "memory_bandwidth", "target"}) ||
        !string(d, "device", "name", out.name) ||
        !number(d, "device", "memory_bytes", required, out.memoryBytes, "bytes") ||
        !number(d, "device", "memory_bandwidth", required, out.memoryBandwidth, "bytes/s"))
      return false;
    if (d.contains("target")) {
      if (!string(d, "device", "target", out.target))
        return false;
      if (out.target != "cpu" && out.target != "cuda")
        return fail("\"device.target\" is '" + out.target + "'; it must be \"cpu\" or \"cuda\"");
    }
    auto peaks = d.find("peak_flops");
    if (peaks == d.end())
      return required ? fail("missing \"device.peak_flops\"") : true;
    if (!checkKeys(*peaks, "device.peak_flops", {"fp32", "tf32", "bf16", "fp16"}))
      return false;
    for (const char *dtype : kDtypes) {
      double v = 0;
      if (!number(*peaks, "device.peak_flops", dtype, false, v, "FLOP/s"))
        return false;
      if (v > 0)
        out.peakFlops[dtype] = v;
    }
    if (!out.peakFlops.count("fp32"))
      return fail("missing \"device.peak_flops.fp32\" (FLOP/s)");
    return true;
  }

private:
  static std::string join(const std::string &path, const std::string &key) {
    return path.empty() ? key : path + "." + key;
  }

  std::string file;
  std::string &error;
};

bool parseClusterFile(const std::string &file, Cluster &cluster, std::string &error) {
  std::ifstream in(file);
  if (!in) {
    error = "cluster " + file + ": cannot be read";
    return false;
  }
  std::stringstream text;
  text << in.rdbuf();
  FileReader r(file, error);
  json root;
  std::string cause;
  if (!parseBoundedJson(text.str(), root, cause))
    return r.fail(cause);
  if (!root.is_object())
    return r.fail("a cluster file is a JSON object (docs/cluster.md), got " + root.dump());
  if (!r.checkKeys(
          root, "",
          {"name", "preset", "nodes", "devices_per_node", "device", "intra_node", "inter_node"}))
    return false;

  int64_t nodes = 0, perNode = 0;
  std::string preset;
  if (!r.string(root, "", "preset", preset))
    return false;
  bool base = !preset.empty();
  if (!r.count(root, "nodes", !base, nodes) || !r.count(root, "devices_per_node", !base, perNode))
    return false;

  Cluster c;
  if (base) {
    if (preset.find(':') != std::string::npos)
      return r.fail("\"preset\" is a preset name without a size (the size is \"nodes\" and "
                    "\"devices_per_node\"), got \"" +
                    preset + "\"");
    // The file's size applies before the preset is built: `cpu` divides the
    // machine's memory among the devices of a node.
    std::string presetError;
    std::string spec = preset;
    if (perNode > 0 && preset == kCpuKey)
      spec += ":1x" + std::to_string(perNode);
    if (!parsePresetSpec(spec, "\"preset\"", c, presetError))
      return r.fail(presetError);
  }
  if (nodes > 0)
    c.nodes = (int)nodes;
  if (perNode > 0)
    c.devicesPerNode = (int)perNode;
  if (!checkSize("cluster " + file, c.nodes, c.devicesPerNode,
                 std::to_string(c.nodes) + "x" + std::to_string(c.devicesPerNode), error))
    return false;
  c.name = file;
  if (!r.string(root, "", "name", c.name) || !r.device(root, !base, c.device) ||
      !r.link(root, "intra_node", !base, c.intraNode) ||
      !r.link(root, "inter_node", !base, c.interNode))
    return false;
  if (c.device.name.empty())
    c.device.name = c.name;
  cluster = std::move(c);
  return true;
}

bool isRegularFile(const std::string &path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool endsWith(const std::string &s, const std::string &suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

} // namespace

double Cluster::peak(const std::string &dtype) const {
  auto it = device.peakFlops.find(dtype);
  if (it != device.peakFlops.end())
    return it->second;
  it = device.peakFlops.find("fp32");
  return it != device.peakFlops.end() ? it->second : 0;
}

std::vector<std::string> clusterPresets() {
  std::vector<std::string> names{kCpuKey};
  for (const GpuPreset &p : kGpuPresets)
    names.push_back(p.key);
  std::sort(names.begin(), names.end());
  return names;
}

bool parseCluster(const std::string &spec, Cluster &cluster, std::string &error) {
  const std::string what = "cluster " + spec;
  if (spec.empty()) {
    error = "cluster: empty spec (a preset such as a100-80gb:4x8, or a JSON file)";
    return false;
  }
  // A preset name wins over a file of the same name; `./cpu` names the file.
  if (isPreset(spec.substr(0, spec.find(':'))))
    return parsePresetSpec(spec, what, cluster, error);
  if (isRegularFile(spec))
    return parseClusterFile(spec, cluster, error);
  if (endsWith(spec, ".json") || spec.find('/') != std::string::npos) {
    error = what + ": no such file (and not a preset: " + knownPresets() + ")";
    return false;
  }
  return parsePresetSpec(spec, what, cluster, error);
}

std::string clusterToJson(const Cluster &cluster) {
  json peaks = json::object();
  for (const auto &[dtype, flops] : cluster.device.peakFlops)
    peaks[dtype] = flops;
  json j = json::object();
  j["name"] = cluster.name;
  j["nodes"] = cluster.nodes;
  j["devices_per_node"] = cluster.devicesPerNode;
  j["device"] = {{"name", cluster.device.name},
                 {"peak_flops", peaks},
                 {"memory_bytes", cluster.device.memoryBytes},
                 {"memory_bandwidth", cluster.device.memoryBandwidth},
                 {"target", cluster.device.target}};
  j["intra_node"] = {{"bandwidth", cluster.intraNode.bandwidth},
                     {"latency", cluster.intraNode.latency}};
  j["inter_node"] = {{"bandwidth", cluster.interNode.bandwidth},
                     {"latency", cluster.interNode.latency}};
  return j.dump(2) + "\n";
}

} // namespace carve::planner
