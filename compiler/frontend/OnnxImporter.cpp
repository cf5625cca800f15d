//===- OnnxImporter.cpp - ONNX model -> carve dialect ---------------------===//
//
// The importer walks the graph once, in its (required) topological order:
//   1. read and validate the model (protobuf, opset, graph, initializers);
//   2. make the function's arguments: graph inputs (symbolic dims bound from
//      --set-dim), then parameters; buffers are added when first used;
//   3. for each node: if every input is a known constant (initializers that are
//      not parameters, Constant nodes, shapes of static tensors), evaluate it on
//      the host (HostTensor) -- this is how shape sub-graphs disappear;
//      otherwise build the carve op, typed by the shape rules in Shapes.h;
//   4. return the graph outputs, verify, and run carve-raise.
// Every error is one sentence naming the node; nothing is printed here.
// The steps live in the files Importer.h lists.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/OnnxImporter.h"
#include "compiler/frontend/Importer.h"
#include "compiler/frontend/Passes.h"
#include "dialects/carve/CarveOps.h"

#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/Verifier.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"
#include "mlir/Pass/PassManager.h"
#include "mlir/Transforms/Passes.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <set>

using namespace mlir;
using llvm::SmallVector;
using llvm::StringRef;

namespace carve {

namespace {

/// An import error: the message is the whole one-line cause.
struct ImportFailure {
  std::string message;
};

/// The supported default-domain ops, for error messages and docs.
const std::set<std::string> &opTable() {
  static const std::set<std::string> ops = {"Abs",
                                            "Add",
                                            "And",
                                            "AveragePool",
                                            "BatchNormalization",
                                            "Cast",
                                            "CastLike",
                                            "Clip",
                                            "Ceil",
                                            "Concat",
                                            "Constant",
                                            "ConstantOfShape",
                                            "Conv",
                                            "Cos",
                                            "CumSum",
                                            "Div",
                                            "Dropout",
                                            "Einsum",
                                            "Equal",
                                            "Erf",
                                            "Exp",
                                            "Expand",
                                            "Flatten",
                                            "Floor",
                                            "Gather",
                                            "Gelu",
                                            "Gemm",
                                            "GRU",
                                            "GlobalAveragePool",
                                            "GatherElements",
                                            "Greater",
                                            "GreaterOrEqual",
                                            "HardSigmoid",
                                            "HardSwish",
                                            "Identity",
                                            "LSTM",
                                            "LayerNormalization",
                                            "LeakyRelu",
                                            "Less",
                                            "LessOrEqual",
                                            "Log",
                                            "LogSoftmax",
                                            "MatMul",
                                            "Max",
                                            "MaxPool",
                                            "Min",
                                            "Mod",
                                            "Mul",
                                            "Neg",
                                            "NonZero",
                                            "NegativeLogLikelihoodLoss",
                                            "Not",
                                            "Pad",
                                            "OneHot",
                                            "Or",
                                            "Pow",
                                            "Range",
                                            "Reciprocal",
                                            "ReduceMax",
                                            "ReduceMean",
                                            "ReduceL2",
                                            "ReduceMin",
                                            "ReduceProd",
                                            "ReduceSum",
                                            "Relu",
                                            "Reshape",
                                            "Resize",
                                            "ScatterElements",
                                            "ScatterND",
                                            "Shape",
                                            "Sigmoid",
                                            "Sin",
                                            "Size",
                                            "Slice",
                                            "Softmax",
                                            "SoftmaxCrossEntropyLoss",
                                            "Softplus",
                                            "SequenceAt",
                                            "Split",
                                            "SplitToSequence",
                                            "Sqrt",
                                            "Squeeze",
                                            "Sub",
                                            "Tanh",
                                            "TopK",
                                            "Transpose",
                                            "Tile",
                                            "Trilu",
                                            "Unsqueeze",
                                            "Where"};
  return ops;
}

/// Ops that only ever run on constants (shape arithmetic): no carve op exists.
const std::set<std::string> &foldOnlyOps() {
  static const std::set<std::string> ops = {
      "Ceil", "ConstantOfShape", "Floor", "Mod", "Range", "ReduceMin", "ReduceProd", "Trilu"};
  return ops;
}

} // namespace

namespace frontend {

void Importer::fail(const std::string &msg) const {
  if (node) {
    bool standard = node->domain().empty() || node->domain() == "ai.onnx";
    std::string what = standard ? node->op_type() : node->domain() + "::" + node->op_type();
    throw ImportFailure{"node '" + nodeLabel + "' (" + what + "): " + msg};
  }
  throw ImportFailure{msg};
}

void Importer::failUnsupported() const {
  fail("unsupported op '" + node->op_type() + "' at opset " + std::to_string(opset) +
       "; the supported ops are listed in docs/onnx-ops.md");
}

void Importer::importNode(const onnx::NodeProto &n, int index) {
  node = &n;
  nodeLabel = n.name().empty() ? n.op_type() + "_" + std::to_string(index) : n.name();
  loc = NameLoc::get(b.getStringAttr(nodeLabel), FileLineColLoc::get(&ctx, file, index + 1, 0));
  if (!n.domain().empty() && n.domain() != "ai.onnx") {
    for (const CustomOpRule &rule : opts.customOps)
      if (rule.domain == n.domain() && rule.type == n.op_type())
        return buildCustom(n, rule);
    fail("an op of the custom domain '" + n.domain() +
         "' needs a rule; describe it in a rules file and pass that with --rules RULES.json "
         "(docs/custom-ops.md)");
  }
  if (!opTable().count(n.op_type())) {
    // A rules file may supply kernels for a standard op carve lacks.
    for (const CustomOpRule &rule : opts.customOps)
      if (rule.domain == "ai.onnx" && rule.type == n.op_type())
        return buildCustom(n, rule);
    failUnsupported();
  }
  for (int k = 0; k < n.input_size(); ++k)
    if (!n.input(k).empty())
      (void)slot(k);
  try {
    if (tryFold(n))
      return;
  } catch (const HostError &e) {
    fail(e.what());
  }
  for (int k = 0; k < n.input_size() && !partialBatch.empty(); ++k)
    if (!n.input(k).empty() && slot(k).value)
      if (auto it = partialBatch.find(slot(k).value); it != partialBatch.end())
        fail("input " + std::to_string(k) + " comes from " + it->second +
             "; a rank's share of the batch cannot compute it, so plans that split the batch "
             "(dp, micro-batches) need a model whose samples are independent here");
  if (foldOnlyOps().count(n.op_type()))
    fail("carve evaluates " + n.op_type() +
         " only on constants known at import, but an input is computed from graph inputs "
         "(or is a constant too large to fold)");
  Operation *before = entry->empty() ? nullptr : &entry->back();
  std::optional<onnx::NodeProto> shared;
  if (localBatch())
    shared = shareConstants(n);
  if (shared) {
    node = &*shared;
    build(*shared);
    node = &n;
  } else {
    build(n);
  }
  if (localBatch())
    trackBatch(before);
  if (!bounded.empty())
    trackBounded(before);
  foldBuilt(n, before);
}

OwningOpRef<ModuleOp> Importer::run(StringRef bytes) {
  parse(bytes);
  const onnx::GraphProto &g = model.graph();
  auto module = ModuleOp::create(FileLineColLoc::get(&ctx, file, 0, 0));
  OwningOpRef<ModuleOp> owned(module);
  if (!g.name().empty())
    module.setSymName(g.name());
  b.setInsertionPointToEnd(module.getBody());
  classifyInitializers();
  for (const auto &n : g.node())
    for (const auto &in : n.input())
      if (!in.empty())
        ++useCount[in];
  for (const auto &out : g.output())
    ++useCount[out.name()];
  // A rule for a standard op carve implements would silently never run.
  for (const CustomOpRule &rule : opts.customOps)
    if (rule.domain == "ai.onnx" && opTable().count(rule.type))
      fail(rule.origin + " (ai.onnx::" + rule.type + "): carve implements the standard op '" +
           rule.type +
           "' itself; a rule of domain \"ai.onnx\" supplies kernels only for a standard op "
           "carve lacks (docs/onnx-ops.md lists the ones it has); to change a built-in op's "
           "annotation, write {\"match\": ..., \"annotation\": ...}");
  makeArguments();

  b.setInsertionPointToEnd(entry);
  for (int k = 0; k < g.node_size(); ++k)
    importNode(g.node(k), k);
  node = nullptr;

  SmallVector<Value> results;
  SmallVector<DictionaryAttr> resultAttrs;
  loc = FileLineColLoc::get(&ctx, file, 0, 0);
  for (const auto &out : g.output()) {
    auto it = env.find(out.name());
    if (it == env.end())
      fail("graph output '" + out.name() + "' is not produced by any node");
    Slot &s = it->second;
    if (!s.value) {
      if (s.isParam)
        fail("graph output '" + out.name() + "' is a parameter");
      if (!s.constant && s.init)
        s.constant = loadTensor(*s.init, "initializer '" + out.name() + "'");
      s.value = materialize(*s.constant, out.name());
    }
    if (const Bounded *bd = boundedOf(s.value))
      fail("graph output '" + out.name() + "' has a dimension (" + std::to_string(bd->dim) +
           ") whose size NonZero '" + bd->origin +
           "' decides at run time; carve keeps such values inside the graph (docs/moe.md)");
    results.push_back(s.value);
    resultAttrs.push_back(
        b.getDictionaryAttr({b.getNamedAttr(kOutputAttr, b.getStringAttr(out.name()))}));
  }
  func::ReturnOp::create(b, loc, results);
  // Drop ops that lost their users at import (a LogSoftmax folded into
  // cross-entropy); everything carve builds is side-effect free.
  for (Operation &op : llvm::make_early_inc_range(llvm::reverse(*entry)))
    if (isOpTriviallyDead(&op))
      op.erase();
  func.setFunctionType(b.getFunctionType(entry->getArgumentTypes(), TypeRange(results)));
  func.setAllArgAttrs(argAttrs);
  func.setAllResultAttrs(resultAttrs);
  if (opts.notes && inferenceBatchNorms > 0)
    opts.notes->push_back(
        std::to_string(inferenceBatchNorms) + " BatchNormalization node" +
        (inferenceBatchNorms > 1 ? "s (the first '" : " ('") + firstInferenceBatchNorm +
        "') normalize with their running statistics, as a frozen batch norm does; a module "
        "PyTorch trains in training mode normalizes with the batch's. torch.onnx.export "
        "(dynamo=True) writes every batch norm this way: export with dynamo=False (as "
        "models/export.py's export_for_carve does) to train batch statistics");
  return owned;
}

} // namespace frontend

bool parseSetDim(StringRef entry, ImportOptions &opts, std::string &error) {
  auto [name, value] = entry.split('=');
  int64_t v;
  if (name.empty() || value.empty() || value.getAsInteger(10, v) || v <= 0) {
    error = "--set-dim expects NAME=VALUE with a positive integer VALUE, got '" + entry.str() + "'";
    return false;
  }
  opts.dims[name] = v;
  return true;
}

std::vector<std::string> supportedOnnxOps() {
  return std::vector<std::string>(opTable().begin(), opTable().end());
}

bool readOnnxStateFacts(MLIRContext &context, StringRef path,
                        const std::vector<std::string> &wanted, OnnxStateFacts &out,
                        std::string &error) {
  auto buf = llvm::MemoryBuffer::getFile(path, /*IsText=*/false, /*RequiresNullTerminator=*/false);
  if (!buf) {
    error = path.str() + ": cannot read the model: " + buf.getError().message();
    return false;
  }
  SmallVector<char> dir(path.begin(), path.end());
  llvm::sys::path::remove_filename(dir);
  std::string base = dir.empty() ? "." : std::string(dir.begin(), dir.end());
  ImportOptions opts;
  try {
    frontend::Importer importer(context, opts, path.str(), base);
    importer.readStateFacts((*buf)->getBuffer(), wanted, out);
  } catch (const ImportFailure &f) {
    error = path.str() + ": " + f.message;
    return false;
  }
  return true;
}

OwningOpRef<ModuleOp> importOnnxBytes(MLIRContext &context, StringRef bytes, StringRef displayName,
                                      StringRef baseDir, const ImportOptions &opts,
                                      std::string &error) {
  context.loadDialect<CarveDialect, func::FuncDialect>();
  OwningOpRef<ModuleOp> module;
  bool paramsKnown = true;
  try {
    frontend::Importer importer(context, opts, displayName.str(), baseDir.str());
    module = importer.run(bytes);
    paramsKnown = importer.paramsFromMetadata();
  } catch (const ImportFailure &f) {
    error = f.message;
    return nullptr;
  }
  // The importer types every op by the same rules the verifiers check, so a
  // verifier failure here is an importer bug; report it rather than crash.
  std::string diag;
  {
    ScopedDiagnosticHandler handler(&context, [&](Diagnostic &d) {
      if (diag.empty()) {
        llvm::raw_string_ostream os(diag);
        os << d.getLocation() << ": " << d.str();
      }
      return success();
    });
    if (failed(verify(*module))) {
      error = "internal error: the imported IR does not verify: " + diag;
      return nullptr;
    }
    if (opts.raise) {
      PassManager pm(&context);
      CarveRaiseOptions raise;
      raise.learnedMasks = paramsKnown;
      pm.addNestedPass<func::FuncOp>(createCarveRaise(raise));
      pm.addPass(createCanonicalizerPass());
      pm.addPass(createCSEPass());
      if (failed(pm.run(*module))) {
        error = "internal error: carve-raise failed: " + diag;
        return nullptr;
      }
    }
  }
  return module;
}

OwningOpRef<ModuleOp> importOnnxFile(MLIRContext &context, StringRef path,
                                     const ImportOptions &opts, std::string &error) {
  if (llvm::sys::fs::is_directory(path)) {
    error = "is a directory, not an ONNX file";
    return nullptr;
  }
  auto buf = llvm::MemoryBuffer::getFile(path, /*IsText=*/false,
                                         /*RequiresNullTerminator=*/false);
  if (!buf) {
    error = "cannot read the file: " + buf.getError().message();
    return nullptr;
  }
  SmallVector<char> dir(path.begin(), path.end());
  llvm::sys::path::remove_filename(dir);
  std::string base = dir.empty() ? "." : std::string(dir.begin(), dir.end());
  return importOnnxBytes(context, (*buf)->getBuffer(), llvm::sys::path::filename(path), base, opts,
                         error);
}

} // namespace carve
