//===- Calibration.cpp - the time model's efficiency factors --------------===//
//
// The default table of GEMM efficiency by shape (an A100's), its
// interpolation, and `--calibration` files that replace the factors with
// measured ones (docs/planner.md, "GEMM efficiency by shape").
//
//===----------------------------------------------------------------------===//

#include "compiler/planner/PlannerImpl.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <map>

namespace carve::planner {

using json = nlohmann::json;

std::vector<std::pair<double, double>> Calibration::defaultGemmEfficiency() {
  // An A100's bf16 GEMMs (docs/planner.md, "GEMM efficiency by shape"): the
  // best measured shapes reach 0.87 of peak; a GEMM with a small dimension
  // runs short K loops and partial tiles and waves, and falls further.
  return {{64, 0.30},   {128, 0.45},  {256, 0.60},  {512, 0.70},
          {1024, 0.77}, {2048, 0.81}, {4096, 0.84}, {8192, 0.86}};
}

double Calibration::gemmEfficiencyAt(double dim) const {
  const auto &t = gemmEfficiency;
  if (dim <= t.front().first)
    return t.front().second;
  for (size_t i = 1; i < t.size(); ++i)
    if (dim <= t[i].first) {
      double f = std::log2(dim / t[i - 1].first) / std::log2(t[i].first / t[i - 1].first);
      return t[i - 1].second + f * (t[i].second - t[i - 1].second);
    }
  return t.back().second;
}

namespace {

/// Whether `v` is a fraction in (0, 1]; if not, `error` names `key`.
bool fraction(const json &v, const std::string &what, const std::string &key, std::string &error) {
  if (v.is_number() && v.get<double>() > 0 && v.get<double>() <= 1)
    return true;
  error = what + ": \"" + key + "\" must be a positive number at most 1, got " + v.dump();
  return false;
}

/// `"gemm_efficiency": [[dimension, fraction], ...]`, dimensions increasing.
bool parseGemmTable(const json &v, const std::string &what,
                    std::vector<std::pair<double, double>> &table, std::string &error) {
  const std::string shape = what + ": \"gemm_efficiency\" must be a list of [dimension, "
                                   "fraction of peak] pairs with increasing dimensions, got ";
  if (!v.is_array() || v.empty()) {
    error = shape + v.dump();
    return false;
  }
  table.clear();
  for (const json &p : v) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number() || p[0].get<double>() < 1 ||
        (!table.empty() && p[0].get<double>() <= table.back().first)) {
      error = shape + p.dump();
      return false;
    }
    if (!fraction(p[1], what, "gemm_efficiency", error))
      return false;
    table.push_back({p[0].get<double>(), p[1].get<double>()});
  }
  return true;
}

} // namespace

bool parseCalibration(const std::string &text, const std::string &what, Calibration &cal,
                      std::string &error) {
  json j;
  if (!parseObject(text, what, "a calibration table is a JSON object", j, error))
    return false;
  if (j.contains("matmul_efficiency") && j.contains("gemm_efficiency")) {
    error = what + ": give \"gemm_efficiency\" (a table by GEMM shape) or "
                   "\"matmul_efficiency\" (one fraction for every GEMM), not both";
    return false;
  }
  std::map<std::string, double *> fields = {{"memory_efficiency", &cal.memoryEfficiency},
                                            {"link_efficiency", &cal.linkEfficiency},
                                            {"kernel_overhead_s", &cal.kernelOverhead},
                                            {"bucket_bytes", &cal.bucketBytes}};
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "gradient_overlap") {
      if (!it.value().is_boolean()) {
        error = what + ": \"gradient_overlap\" must be true or false, got " + it.value().dump();
        return false;
      }
      cal.gradientOverlap = it.value().get<bool>();
      continue;
    }
    if (it.key() == "gemm_efficiency") {
      if (!parseGemmTable(it.value(), what, cal.gemmEfficiency, error))
        return false;
      continue;
    }
    if (it.key() == "matmul_efficiency") {
      if (!fraction(it.value(), what, it.key(), error))
        return false;
      cal.gemmEfficiency = {{1, it.value().get<double>()}};
      continue;
    }
    auto f = fields.find(it.key());
    if (f == fields.end()) {
      error = what + ": unknown key \"" + it.key() +
              "\" (keys: gemm_efficiency, matmul_efficiency, memory_efficiency, "
              "link_efficiency, kernel_overhead_s, bucket_bytes, gradient_overlap)";
      return false;
    }
    if (it.key().find("efficiency") != std::string::npos) {
      if (!fraction(it.value(), what, it.key(), error))
        return false;
    } else if (!it.value().is_number() || it.value().get<double>() <= 0) {
      error = what + ": \"" + it.key() + "\" must be a positive number, got " + it.value().dump();
      return false;
    }
    *f->second = it.value().get<double>();
  }
  return true;
}

} // namespace carve::planner
