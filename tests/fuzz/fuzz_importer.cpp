//===- fuzz_importer.cpp - libFuzzer target: the ONNX importer ------------===//
//
// Bytes -> ModelProto -> `func.func @forward` in the carve dialect, then the
// verifier and the carve-raise cleanup (compiler/frontend/OnnxImporter.cpp):
// any bytes must give a module or a one-line error, never a crash. External
// data is resolved against $CARVE_FUZZ_ONNX_DATA (default: an empty scratch
// folder), where run_fuzz.py puts the data files of its seed models.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/OnnxImporter.h"
#include "tests/fuzz/FuzzSupport.h"

#include "mlir/IR/MLIRContext.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static const std::string baseDir = [] {
    const char *d = std::getenv("CARVE_FUZZ_ONNX_DATA");
    return d && *d ? std::string(d) : carve::fuzz::ScratchDir::get().path();
  }();
  // A fresh context per input: nothing an input interns can affect the next.
  mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
  carve::ImportOptions opts;
  std::string error;
  auto module = carve::importOnnxBytes(
      context, llvm::StringRef(reinterpret_cast<const char *>(data), size), "fuzz.onnx",
      baseDir, opts, error);
  if (!module)
    carve::fuzz::checkFailure("importOnnxBytes", error);
  return 0;
}
