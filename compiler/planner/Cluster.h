//===- Cluster.h - the machines a plan runs on ----------------------------===//
//
// A cluster is `nodes` x `devicesPerNode` identical devices. Per device: peak
// FLOP/s by dtype, memory capacity and bandwidth; per link class (inside a
// node, across nodes): bandwidth and latency. It comes from a preset
// (`a100-80gb:128x8`), a JSON file, or the local machine (`cpu`, measured).
// docs/cluster.md lists every preset's numbers and their sources.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_PLANNER_CLUSTER_H
#define CARVE_COMPILER_PLANNER_CLUSTER_H

#include <map>
#include <string>
#include <vector>

namespace carve::planner {

struct DeviceSpec {
  std::string name; // "NVIDIA A100 80GB SXM", "local CPU (2 cores)"
  /// Peak dense FLOP/s by dtype: keys "fp32", "tf32", "bf16", "fp16" (a
  /// device without a key has no fast path for it; fp32 is always present).
  std::map<std::string, double> peakFlops;
  double memoryBytes = 0;     // usable device memory, bytes
  double memoryBandwidth = 0; // bytes/s
  /// What carve compiles for it: "cuda" (the GPU presets) or "cpu"; a
  /// cluster file's "device.target", else its preset's, else "cpu".
  std::string target = "cpu";
};

struct LinkSpec {
  double bandwidth = 0; // bytes/s per device, one direction (what a ring step sees)
  double latency = 0;   // seconds per message
};

struct Cluster {
  std::string name; // preset name or file, as given
  DeviceSpec device;
  int nodes = 1;
  int devicesPerNode = 1;
  LinkSpec intraNode; // between devices of one node (NVLink, shared memory)
  LinkSpec interNode; // between nodes (InfiniBand / Ethernet, per device)
  int worldSize() const { return nodes * devicesPerNode; }
  /// Peak FLOP/s for `dtype`, falling back to fp32 when the device lacks it.
  double peak(const std::string &dtype) const;
};

/// Parses `--cluster`: `PRESET[:NODESxDEVICES]` (`a100-80gb:128x8`;
/// without the size: one node of the preset's usual size) or a JSON file
/// path (docs/cluster.md). On failure returns false with one line in `error`
/// naming the preset or file and the cause (unknown presets list the known ones).
bool parseCluster(const std::string &spec, Cluster &cluster, std::string &error);

/// The preset names, sorted.
std::vector<std::string> clusterPresets();

/// The cluster as the JSON a file would hold (round-trips through parseCluster).
std::string clusterToJson(const Cluster &cluster);

} // namespace carve::planner

#endif // CARVE_COMPILER_PLANNER_CLUSTER_H
