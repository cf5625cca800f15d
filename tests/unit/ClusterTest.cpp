//===- ClusterTest.cpp - cluster presets, sizes, JSON files, measured cpu -===//

#include "compiler/planner/Cluster.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <unistd.h>

using namespace carve::planner;

namespace {

Cluster parsed(const std::string &spec) {
  Cluster c;
  std::string error;
  EXPECT_TRUE(parseCluster(spec, c, error)) << spec << ": " << error;
  return c;
}

std::string parseError(const std::string &spec) {
  Cluster c;
  std::string error;
  EXPECT_FALSE(parseCluster(spec, c, error)) << spec << " parsed";
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  return error;
}

/// A JSON file in the temporary directory, removed with the fixture.
class ClusterFileTest : public ::testing::Test {
protected:
  std::string write(const std::string &text) {
    std::string path = ::testing::TempDir() + "cluster_" + std::to_string(getpid()) + "_" +
                       std::to_string(files.size()) + ".json";
    std::ofstream(path) << text;
    files.push_back(path);
    return path;
  }
  void TearDown() override {
    for (const std::string &f : files)
      std::remove(f.c_str());
  }
  std::vector<std::string> files;
};

const char *kFullFile = R"({
  "name": "lab",
  "nodes": 4,
  "devices_per_node": 8,
  "device": {"name": "lab GPU", "peak_flops": {"fp32": 1.95e13, "bf16": 3.12e14},
             "memory_bytes": 8.0e10, "memory_bandwidth": 2.039e12},
  "intra_node": {"bandwidth": 3e11, "latency": 3e-6},
  "inter_node": {"bandwidth": 2.5e10, "latency": 5e-6}
})";

} // namespace

/// Tests that the presets are exactly the documented ones.
TEST(ClusterPresets, Names) {
  std::vector<std::string> expected{"a100-40gb", "a100-80gb",  "cpu",
                                    "h100-80gb", "h200-141gb", "v100-32gb"};
  EXPECT_EQ(clusterPresets(), expected);
}

/// Tests every GPU preset against the table in docs/cluster.md.
TEST(ClusterPresets, DatasheetNumbers) {
  struct Row {
    const char *preset;
    double fp32, tf32, bf16, fp16, memory, bandwidth, nvlink, nic;
  };
  const Row rows[] = {
      {"a100-40gb", 19.5e12, 156e12, 312e12, 312e12, 40e9, 1555e9, 300e9, 25e9},
      {"a100-80gb", 19.5e12, 156e12, 312e12, 312e12, 80e9, 2039e9, 300e9, 25e9},
      {"h100-80gb", 67e12, 494.7e12, 989.4e12, 989.4e12, 80e9, 3.35e12, 450e9, 50e9},
      {"h200-141gb", 67e12, 494.7e12, 989.4e12, 989.4e12, 141e9, 4.8e12, 450e9, 50e9},
      {"v100-32gb", 15.7e12, 0, 0, 125e12, 32e9, 900e9, 150e9, 12.5e9},
  };
  for (const Row &r : rows) {
    SCOPED_TRACE(r.preset);
    Cluster c = parsed(r.preset);
    EXPECT_EQ(c.name, r.preset);
    EXPECT_EQ(c.nodes, 1);
    EXPECT_EQ(c.devicesPerNode, 8);
    EXPECT_EQ(c.worldSize(), 8);
    EXPECT_DOUBLE_EQ(c.device.peakFlops.at("fp32"), r.fp32);
    EXPECT_DOUBLE_EQ(c.peak("fp16"), r.fp16);
    if (r.tf32 > 0) {
      EXPECT_DOUBLE_EQ(c.device.peakFlops.at("tf32"), r.tf32);
      EXPECT_DOUBLE_EQ(c.device.peakFlops.at("bf16"), r.bf16);
    } else {
      EXPECT_EQ(c.device.peakFlops.count("tf32"), 0u);
      EXPECT_EQ(c.device.peakFlops.count("bf16"), 0u);
    }
    EXPECT_DOUBLE_EQ(c.device.memoryBytes, r.memory);
    EXPECT_DOUBLE_EQ(c.device.memoryBandwidth, r.bandwidth);
    EXPECT_DOUBLE_EQ(c.intraNode.bandwidth, r.nvlink);
    EXPECT_DOUBLE_EQ(c.interNode.bandwidth, r.nic);
    EXPECT_GT(c.intraNode.latency, 1e-6);
    EXPECT_LT(c.intraNode.latency, 1e-5);
    EXPECT_DOUBLE_EQ(c.interNode.latency, 5e-6);
    EXPECT_FALSE(c.device.name.empty());
  }
}

/// Tests that a dtype without a fast path falls back to fp32.
TEST(ClusterPresets, PeakFallsBackToFp32) {
  Cluster v100 = parsed("v100-32gb");
  EXPECT_DOUBLE_EQ(v100.peak("bf16"), 15.7e12);
  EXPECT_DOUBLE_EQ(v100.peak("tf32"), 15.7e12);
  EXPECT_DOUBLE_EQ(v100.peak("int8"), 15.7e12);
  EXPECT_DOUBLE_EQ(parsed("h100-80gb").peak("bf16"), 989.4e12);
}

/// Tests `PRESET:NODESxDEVICES`.
TEST(ClusterPresets, Sizes) {
  Cluster big = parsed("a100-80gb:128x8");
  EXPECT_EQ(big.name, "a100-80gb:128x8");
  EXPECT_EQ(big.nodes, 128);
  EXPECT_EQ(big.devicesPerNode, 8);
  EXPECT_EQ(big.worldSize(), 1024);
  Cluster odd = parsed("h100-80gb:3x4");
  EXPECT_EQ(odd.worldSize(), 12);
  EXPECT_EQ(parsed("v100-32gb:1x1").worldSize(), 1);
  EXPECT_EQ(parsed("a100-40gb:1000x1000").worldSize(), 1000000);
}

/// Tests the one-line errors for specs that are not a preset, a size or a file.
TEST(ClusterPresets, BadSpecs) {
  std::string unknown = parseError("b200");
  EXPECT_NE(unknown.find("cluster b200: unknown preset 'b200'"), std::string::npos) << unknown;
  for (const std::string &p : clusterPresets())
    EXPECT_NE(unknown.find(p), std::string::npos) << unknown;
  EXPECT_NE(parseError("b200:4x8").find("unknown preset 'b200'"), std::string::npos);

  EXPECT_NE(parseError("a100-80gb:0x8")
                .find("cluster a100-80gb:0x8: nodes and devices per node "
                      "must be at least 1"),
            std::string::npos);
  EXPECT_NE(parseError("a100-80gb:8x0").find("at least 1"), std::string::npos);
  for (const char *bad : {"a100-80gb:4", "a100-80gb:axb", "a100-80gb:-1x8", "a100-80gb:4x",
                          "a100-80gb:", "a100-80gb:4x8x2", "a100-80gb: 4x8", "a100-80gb:4X8"}) {
    std::string e = parseError(bad);
    EXPECT_NE(e.find(std::string("cluster ") + bad + ": size"), std::string::npos) << e;
    EXPECT_NE(e.find("NODESxDEVICES"), std::string::npos) << e;
  }
  for (const char *huge : {"a100-80gb:1001x1000", "a100-80gb:1x1000001",
                           "a100-80gb:99999999999999999999x8", "cpu:2000000x1"}) {
    std::string e = parseError(huge);
    EXPECT_NE(e.find(std::string("cluster ") + huge), std::string::npos) << e;
    EXPECT_NE(e.find("is more than 1000000 devices"), std::string::npos) << e;
  }
  EXPECT_NE(parseError("").find("empty"), std::string::npos);
}

/// Tests that a missing file names itself and the presets.
TEST(ClusterPresets, MissingFile) {
  std::string e = parseError("/nonexistent/lab.json");
  EXPECT_EQ(
      e.rfind("cluster /nonexistent/lab.json: no such file (and not a preset: a100-40gb, ", 0), 0u)
      << e;
  EXPECT_NE(parseError("lab.json").find("cluster lab.json: no such file"), std::string::npos);
}

/// Tests that `cpu` measures the machine within plausible bounds.
TEST(ClusterCpu, Measured) {
  Cluster c = parsed("cpu");
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  EXPECT_EQ(c.nodes, 1);
  EXPECT_EQ(c.devicesPerNode, cores);
  EXPECT_EQ(c.device.peakFlops.size(), 1u);
  double fp32 = c.device.peakFlops.at("fp32");
  EXPECT_GT(fp32, 1e8);
  EXPECT_LT(fp32, 1e12);
  EXPECT_DOUBLE_EQ(c.peak("bf16"), fp32);
  EXPECT_GT(c.device.memoryBandwidth, 1e8);
  EXPECT_LT(c.device.memoryBandwidth, 1e12);
  EXPECT_GT(c.intraNode.bandwidth, 5e7);
  EXPECT_LT(c.intraNode.bandwidth, 1e12);
  EXPECT_DOUBLE_EQ(c.intraNode.latency, 2e-6);
  EXPECT_DOUBLE_EQ(c.interNode.bandwidth, 1.25e9);
  EXPECT_DOUBLE_EQ(c.interNode.latency, 50e-6);
  double physical = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
  EXPECT_DOUBLE_EQ(c.device.memoryBytes, physical / cores);

  Cluster sized = parsed("cpu:2x4");
  EXPECT_EQ(sized.worldSize(), 8);
  EXPECT_DOUBLE_EQ(sized.device.memoryBytes, physical / 4);
  EXPECT_DOUBLE_EQ(sized.device.peakFlops.at("fp32"), fp32) << "measured once per process";
}

/// Tests that a full file parses and that clusterToJson round-trips it.
TEST_F(ClusterFileTest, RoundTrip) {
  Cluster c = parsed(write(kFullFile));
  EXPECT_EQ(c.name, "lab");
  EXPECT_EQ(c.worldSize(), 32);
  EXPECT_EQ(c.device.name, "lab GPU");
  EXPECT_DOUBLE_EQ(c.peak("bf16"), 3.12e14);
  EXPECT_DOUBLE_EQ(c.peak("fp16"), 1.95e13);
  EXPECT_DOUBLE_EQ(c.device.memoryBytes, 8e10);
  EXPECT_DOUBLE_EQ(c.interNode.latency, 5e-6);

  for (const std::string &spec : {std::string("a100-80gb:128x8"), std::string("v100-32gb"),
                                  std::string("cpu:1x2"), write(kFullFile)}) {
    SCOPED_TRACE(spec);
    Cluster original = parsed(spec);
    std::string text = clusterToJson(original);
    Cluster again = parsed(write(text));
    EXPECT_EQ(again.name, original.name);
    EXPECT_EQ(again.nodes, original.nodes);
    EXPECT_EQ(again.devicesPerNode, original.devicesPerNode);
    EXPECT_EQ(again.device.name, original.device.name);
    EXPECT_EQ(again.device.peakFlops, original.device.peakFlops);
    EXPECT_EQ(again.device.memoryBytes, original.device.memoryBytes);
    EXPECT_EQ(again.device.memoryBandwidth, original.device.memoryBandwidth);
    EXPECT_EQ(again.intraNode.bandwidth, original.intraNode.bandwidth);
    EXPECT_EQ(again.intraNode.latency, original.intraNode.latency);
    EXPECT_EQ(again.interNode.bandwidth, original.interNode.bandwidth);
    EXPECT_EQ(again.interNode.latency, original.interNode.latency);
    EXPECT_EQ(again.device.target, original.device.target);
    EXPECT_EQ(clusterToJson(again), text);
  }
}

/// Tests a preset as the base that the file's fields override.
TEST_F(ClusterFileTest, PresetOverride) {
  Cluster c = parsed(write(R"({"preset": "a100-80gb", "nodes": 16,
    "device": {"memory_bytes": 7.5e10, "peak_flops": {"bf16": 2.5e14}},
    "inter_node": {"bandwidth": 1e11}})"));
  EXPECT_EQ(c.nodes, 16);
  EXPECT_EQ(c.devicesPerNode, 8);
  EXPECT_EQ(c.device.name, "NVIDIA A100 80GB SXM4");
  EXPECT_DOUBLE_EQ(c.device.memoryBytes, 7.5e10);
  EXPECT_DOUBLE_EQ(c.device.memoryBandwidth, 2039e9);
  EXPECT_DOUBLE_EQ(c.peak("bf16"), 2.5e14);
  EXPECT_DOUBLE_EQ(c.peak("tf32"), 156e12);
  EXPECT_DOUBLE_EQ(c.intraNode.bandwidth, 300e9);
  EXPECT_DOUBLE_EQ(c.interNode.bandwidth, 1e11);
  EXPECT_DOUBLE_EQ(c.interNode.latency, 5e-6);

  Cluster named = parsed(write(R"({"preset": "h200-141gb", "name": "cloud"})"));
  EXPECT_EQ(named.name, "cloud");
  EXPECT_EQ(named.worldSize(), 8);

  // The target the as-compiled check compiles for: the preset's, or the file's.
  EXPECT_EQ(c.device.target, "cuda");
  EXPECT_EQ(parsed("cpu:1x2").device.target, "cpu");
  EXPECT_EQ(parsed("a100-80gb:384x8").device.target, "cuda");
  EXPECT_EQ(parsed(write(R"({"preset": "a100-80gb", "device": {"target": "cpu"}})")).device.target,
            "cpu");

  double physical = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
  Cluster cpu = parsed(write(R"({"preset": "cpu", "nodes": 2, "devices_per_node": 2})"));
  EXPECT_EQ(cpu.worldSize(), 4);
  EXPECT_DOUBLE_EQ(cpu.device.memoryBytes, physical / 2);
}

/// Tests the one-line errors a file can earn, each naming the file and field.
TEST_F(ClusterFileTest, Errors) {
  struct Case {
    std::string text, expected;
  };
  const Case cases[] = {
      {"{\"nodes\": 4,", "not valid JSON"},
      {"[1, 2]", "a cluster file is a JSON object"},
      {R"({"devices_per_node": 8})", "missing \"nodes\""},
      {R"({"nodes": 1, "devices_per_node": 8})", "missing \"device\""},
      {R"({"nodes": 1, "devices_per_node": 8, "device": {"memory_bytes": 1, "memory_bandwidth": 1,
          "peak_flops": {"bf16": 1}}})",
       "missing \"device.peak_flops.fp32\""},
      {R"({"nodes": 1, "devices_per_node": 8, "device": {"peak_flops": {"fp32": 1},
          "memory_bandwidth": 1}})",
       "missing \"device.memory_bytes\""},
      {R"({"preset": "a100-80gb", "intra_node": {"bandwidth": -3e11}})",
       "\"intra_node.bandwidth\" must be a positive number (bytes/s per device), got "
       "-300000000000.0"},
      {R"({"preset": "a100-80gb", "inter_node": {"latency": 0}})",
       "\"inter_node.latency\" must be a positive number"},
      {R"({"preset": "a100-80gb", "device": {"memory_bytes": "80GB"}})",
       "\"device.memory_bytes\" must be a positive number"},
      {R"({"preset": "a100-80gb", "nodes": 0})", "\"nodes\" must be an integer from 1"},
      {R"({"preset": "a100-80gb", "nodes": 2.5})", "\"nodes\" must be an integer"},
      {R"({"preset": "a100-80gb", "nodes": 1001, "devices_per_node": 1000})",
       "is more than 1000000 devices"},
      {R"({"preset": "a100-80gb", "gpus": 8})", "unknown field \"gpus\" (known: name, preset,"},
      {R"({"preset": "a100-80gb", "device": {"hbm": 1}})", "unknown field \"device.hbm\""},
      {R"({"preset": "a100-80gb", "device": {"target": "rocm"}})",
       "\"device.target\" is 'rocm'; it must be \"cpu\" or \"cuda\""},
      {R"({"preset": "a100-80gb", "device": {"peak_flops": {"int8": 1e15}}})",
       "unknown field \"device.peak_flops.int8\" (known: fp32, tf32, bf16, fp16)"},
      {R"({"preset": "a100-80gb", "intra_node": 3e11})", "\"intra_node\" must be an object"},
      {R"({"preset": "b200"})", "\"preset\": unknown preset 'b200'"},
      {R"({"preset": "a100-80gb:4x8"})", "\"preset\" is a preset name without a size"},
      {R"({"preset": 7})", "\"preset\" must be a non-empty string"},
  };
  for (const Case &c : cases) {
    std::string path = write(c.text);
    std::string e = parseError(path);
    EXPECT_EQ(e.rfind("cluster " + path + ": ", 0), 0u) << e;
    EXPECT_NE(e.find(c.expected), std::string::npos) << c.text << "\n -> " << e;
  }
}
