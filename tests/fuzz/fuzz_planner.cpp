//===- fuzz_planner.cpp - libFuzzer target: the planner's text inputs -----===//
//
// Each input goes through every parser of `carve plan`'s user inputs
// (compiler/planner/): the constraints file, `--fixed`, the calibration file
// and the cluster description (as a file, and as a `PRESET:NxM` spec when the
// input has no '/'). One corpus serves them all: they share the JSON object
// reader, and a constraints seed is a fine start for the others.
//
//===----------------------------------------------------------------------===//

#include "compiler/planner/Planner.h"
#include "tests/fuzz/FuzzSupport.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  std::string text(reinterpret_cast<const char *>(data), size);
  std::string error;
  carve::planner::Constraints constraints;
  if (!carve::planner::parseConstraints(text, "constraints.json", constraints, error))
    carve::fuzz::checkFailure("parseConstraints", error);
  carve::planner::Constraints fixed;
  error.clear();
  if (!carve::planner::parseFixed(text, fixed, error))
    carve::fuzz::checkFailure("parseFixed", error);
  carve::planner::Calibration cal;
  error.clear();
  if (!carve::planner::parseCalibration(text, "calibration.json", cal, error))
    carve::fuzz::checkFailure("parseCalibration", error);
  carve::planner::Cluster cluster;
  error.clear();
  std::string file = carve::fuzz::ScratchDir::get().write("cluster.json", data, size);
  if (!carve::planner::parseCluster(file, cluster, error))
    carve::fuzz::checkFailure("parseCluster(file)", error);
  if (text.find('/') == std::string::npos && text.find('\0') == std::string::npos) {
    carve::planner::Cluster preset;
    error.clear();
    if (!carve::planner::parseCluster(text, preset, error))
      carve::fuzz::checkFailure("parseCluster(spec)", error);
  }
  return 0;
}
