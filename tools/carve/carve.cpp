//===- carve.cpp - the carve command-line driver --------------------------===//
//
// `carve import MODEL.onnx` reads an exported model and prints its carve IR
// (or a summary). Later subcommands (compile, run, plan) string the compiler's
// passes together the same way: every error is one line on stderr, exit 1.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/OnnxImporter.h"
#include "tools/carve/Summary.h"

#include "mlir/IR/AsmState.h"
#include "mlir/IR/MLIRContext.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

using namespace llvm;

namespace {

cl::OptionCategory carveCat("carve options");

cl::SubCommand importCmd("import",
                         "Import an ONNX model into the carve dialect and print it");

cl::opt<std::string> importInput(cl::Positional, cl::Required, cl::desc("MODEL.onnx"),
                                 cl::sub(importCmd), cl::cat(carveCat));
cl::opt<std::string> importOutput("o", cl::desc("Write the IR to FILE (default: stdout)"),
                                  cl::value_desc("FILE"), cl::init("-"),
                                  cl::sub(importCmd), cl::cat(carveCat));
cl::list<std::string> setDims(
    "set-dim",
    cl::desc("Bind a symbolic dimension (from dynamic_axes) to a size; repeatable"),
    cl::value_desc("NAME=VALUE"), cl::sub(importCmd), cl::cat(carveCat));
cl::list<std::string> frozen(
    "frozen",
    cl::desc("Do not train parameters whose names match GLOB (e.g. 'wte.*'); repeatable"),
    cl::value_desc("GLOB"), cl::sub(importCmd), cl::cat(carveCat));
cl::opt<bool> summary("summary",
                      cl::desc("Print a summary (inputs, outputs, parameters, op counts) "
                               "instead of the IR"),
                      cl::sub(importCmd), cl::cat(carveCat));
cl::opt<bool> noRaise("no-raise",
                      cl::desc("Keep the exporter's elementwise chains instead of "
                               "recognizing layer_norm, rms_norm, gelu, silu, attention"),
                      cl::sub(importCmd), cl::cat(carveCat));

[[noreturn]] void die(const Twine &msg) {
  errs() << "carve: error: " << msg << "\n";
  errs().flush();
  std::exit(1);
}

/// Writes `text` to `path` through a temporary file and a rename, so a
/// failure never leaves a half-written output behind.
void writeAtomically(StringRef path, StringRef text) {
  if (path == "-") {
    outs() << text;
    outs().flush();
    return;
  }
  SmallString<256> dir(path);
  sys::path::remove_filename(dir);
  if (dir.empty())
    dir = ".";
  SmallString<256> tmp;
  int fd;
  if (std::error_code ec = sys::fs::createUniqueFile(
          dir + "/" + sys::path::filename(path) + ".tmp-%%%%%%", fd, tmp))
    die(path + ": cannot write: " + ec.message());
  {
    raw_fd_ostream os(fd, /*shouldClose=*/true);
    os << text;
    os.close();
    if (os.has_error()) {
      sys::fs::remove(tmp);
      die(path + ": cannot write: " + os.error().message());
    }
  }
  if (std::error_code ec = sys::fs::rename(tmp, path)) {
    sys::fs::remove(tmp);
    die(path + ": cannot write: " + ec.message());
  }
}

int runImport() {
  carve::ImportOptions opts;
  std::string error;
  for (const std::string &d : setDims)
    if (!carve::parseSetDim(d, opts, error))
      die(importInput + ": " + error);
  opts.frozen.assign(frozen.begin(), frozen.end());
  opts.raise = !noRaise;
  mlir::MLIRContext context;
  auto module = carve::importOnnxFile(context, importInput, opts, error);
  if (!module)
    die(importInput + ": " + error);
  std::string text;
  raw_string_ostream os(text);
  if (summary)
    carve::printSummary(*module, os);
  else
    module->print(os), os << "\n";
  writeAtomically(importOutput, text);
  return 0;
}

} // namespace

int main(int argc, char **argv) {
  InitLLVM init(argc, argv);
  cl::HideUnrelatedOptions(carveCat, importCmd);
  cl::HideUnrelatedOptions(carveCat);
  cl::SetVersionPrinter([](raw_ostream &os) { os << "carve 0.1 (MLIR 22)\n"; });
  cl::ParseCommandLineOptions(
      argc, argv,
      "carve: an ahead-of-time parallelization compiler for models exported from "
      "PyTorch\n\n"
      "  carve import MODEL.onnx [--set-dim NAME=N] [--frozen GLOB] [--summary] [-o OUT]\n\n"
      "Run `carve SUBCOMMAND --help` for the flags of one subcommand.\n");
  if (importCmd)
    return runImport();
  errs() << "carve: error: no subcommand given; try `carve --help`\n";
  return 1;
}
