//===- fuzz_checkpoint.cpp - libFuzzer target: the checkpoint manifest ----===//
//
// Bytes -> STEP/manifest.json -> readManifest, and when it is accepted,
// readFullCheckpoint on the step folder (runtime/src/checkpoint.cpp): the
// manifest's shards are looked up in a fixed rank-00000.safetensors written
// once per process and reassembled into full tensors. A manifest is read
// from disk after a crash or from another plan, so no content of it may
// crash the reader or make it allocate what the files cannot hold.
//
// The rank file holds w.0 and w.1 (F32 [1, 3], the rows of a [2, 3] `w`),
// b (F32 [3]) and w.exp_avg (F32 [2, 3]); seeds/checkpoint/ has a manifest
// that matches it.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/checkpoint.h"
#include "carve/rt/safetensors.h"
#include "tests/fuzz/FuzzSupport.h"

namespace {

std::string stepFolder() {
  auto &scratch = carve::fuzz::ScratchDir::get();
  std::string dir = scratch.subdir("step-00000001");
  static const float w[6] = {1, 2, 3, 4, 5, 6}, b[3] = {7, 8, 9};
  std::vector<carve::rt::SafetensorsEntry> tensors = {{"w.0", "F32", {1, 3}, w},
                                                      {"w.1", "F32", {1, 3}, w + 3},
                                                      {"b", "F32", {3}, b},
                                                      {"w.exp_avg", "F32", {2, 3}, w}};
  std::string file = dir + "/rank-00000.safetensors", error;
  if (!carve::rt::writeSafetensors(file, tensors, {}, error)) {
    std::fprintf(stderr, "carve-fuzz: %s\n", error.c_str());
    std::abort();
  }
  scratch.track(file);
  return dir;
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static const std::string dir = stepFolder();
  carve::fuzz::ScratchDir::get().write("step-00000001/manifest.json", data, size);
  carve::rt::CheckpointManifest manifest;
  std::string error;
  if (!carve::rt::readManifest(dir, manifest, error)) {
    carve::fuzz::checkFailure("readManifest", error);
    return 0;
  }
  std::vector<carve::rt::FullTensor> tensors;
  error.clear();
  if (!carve::rt::readFullCheckpoint(dir, tensors, error, /*withOptimizer=*/true)) {
    carve::fuzz::checkFailure("readFullCheckpoint", error);
    return 0;
  }
  for (const carve::rt::FullTensor &t : tensors) {
    size_t n = 1;
    for (int64_t d : t.shape)
      n *= static_cast<size_t>(d);
    if (n != t.data.size())
      std::abort(); // a full tensor must hold exactly its shape's elements
  }
  return 0;
}
