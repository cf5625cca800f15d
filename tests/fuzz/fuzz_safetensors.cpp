//===- fuzz_safetensors.cpp - libFuzzer target: the safetensors reader ----===//
//
// Bytes -> a file -> SafetensorsReader::open, then every tensor it accepted is
// read back whole (runtime/src/safetensors.cpp). The reader promises to check
// the header before using any number from it; reading each accepted tensor
// checks that promise with AddressSanitizer watching the destination buffer.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/safetensors.h"
#include "tests/fuzz/FuzzSupport.h"

#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  std::string path = carve::fuzz::ScratchDir::get().write("model.safetensors", data, size);
  carve::rt::SafetensorsReader reader;
  std::string error;
  if (!reader.open(path, error)) {
    carve::fuzz::checkFailure("SafetensorsReader::open", error);
    return 0;
  }
  std::vector<char> buf;
  for (const carve::rt::SafetensorsTensor &t : reader.tensors()) {
    int64_t bytes = t.end - t.begin;
    // An accepted header cannot promise more data than the file holds.
    if (bytes < 0 || static_cast<uint64_t>(bytes) > size)
      std::abort();
    if (t.numel * carve::rt::safetensorsDtypeSize(t.dtype) != bytes)
      std::abort();
    buf.assign(static_cast<size_t>(bytes), 0);
    if (!reader.read(t, 0, bytes, buf.data(), error))
      std::abort(); // the file did not change since open: a read must succeed
    if (reader.find(t.name) != &t)
      std::abort();
  }
  (void)reader.metadata();
  return 0;
}
