//===- ProfileModel.cpp - the model the planner profiles, at one sample ---===//
//
// loadProfileModel (Profile.h): the model imported (or built) at one sample,
// its convolutions lowered as carve compile runs them, and its training step
// built by autodiff; buildProfile partitions copies of it.
//
//===----------------------------------------------------------------------===//

#include "compiler/planner/Profile.h"

#include "compiler/autodiff/Autodiff.h"
#include "compiler/frontend/Builtin.h"
#include "compiler/frontend/Passes.h"
#include "compiler/lower/Passes.h"
#include "compiler/stages/StageSplit.h"
#include "dialects/carve/Contract.h"
#include "dialects/dist/DistDialect.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/Pass/PassManager.h"

#include <algorithm>

using namespace mlir;

namespace carve::planner {

bool loadProfileModel(MLIRContext &context, const ProfileRequest &req, ProfileModel &model,
                      std::string &error) {
  context.getOrLoadDialect<dist::DistDialect>();
  context.getOrLoadDialect<func::FuncDialect>();
  ImportOptions opts = req.import;
  std::string modelName = req.model;
  if (isBuiltinModel(req.model)) {
    BuiltinSpec spec;
    if (!parseBuiltinSpec(req.model, spec, error))
      return false;
    model.builtinLayers = (int)spec.get("layers");
    model.modelBatch = spec.values.count("batch") ? spec.get("batch") : 1;
    // Three layers stand for all (the first, a middle one, the last) unless
    // a frozen parameter or a pinned op names some layers by number: then
    // the layers differ, and each is profiled.
    bool alike = true;
    for (const std::string &g : opts.frozen)
      alike &= !globNamesSomeLayers(g);
    for (const OpOverride &o : req.pins)
      alike &= !globNamesSomeLayers(o.glob);
    if (alike)
      spec.values["layers"] = std::min<double>(spec.values["layers"], 3);
    else
      model.builtinLayers = 0; // profiled whole: no layer stands for another
    opts.batch = 1;
    model.module = buildBuiltinModel(context, spec, opts, error);
    if (!model.module)
      return false;
  } else {
    // The model's own batch, then the model at one sample.
    auto global = importOnnxFile(context, req.model, opts, error);
    if (!global)
      return false;
    auto fwd = global->lookupSymbol<func::FuncOp>("forward");
    model.modelBatch = -1;
    for (unsigned i = 0; i < fwd.getNumArguments(); ++i)
      if (fwd.getArgAttr(i, kInputAttr)) {
        auto t = cast<RankedTensorType>(fwd.getArgument(i).getType());
        if (t.getRank() >= 1) {
          model.modelBatch = t.getDimSize(0);
          break;
        }
      }
    if (model.modelBatch < 1) {
      error = req.model + ": no graph input has a leading batch dimension";
      return false;
    }
    opts.batch = 1;
    opts.globalBatch = model.modelBatch;
    model.module = importOnnxFile(context, req.model, opts, error);
    if (!model.module) {
      error = req.model + ": importing one sample of the batch failed: " + error +
              (llvm::StringRef(error).contains("dynamic batch")
                   ? std::string()
                   : std::string(" (the model may hard-code its batch size where carve cannot "
                                 "place it; export it with a dynamic batch)"));
      return false;
    }
  }
  auto fwd = model.module->lookupSymbol<func::FuncOp>("forward");
  // Tokens per sample: the second dimension of the first input of token ids
  // (integers); none for a model of images or other float inputs.
  for (unsigned i = 0; i < fwd.getNumArguments(); ++i)
    if (fwd.getArgAttr(i, kInputAttr)) {
      auto t = cast<RankedTensorType>(fwd.getArgument(i).getType());
      if (t.getRank() >= 2 && isa<IntegerType>(t.getElementType())) {
        model.seq = t.getDimSize(1);
        break;
      }
    }
  AutodiffOptions ad;
  ad.loss = req.loss;
  std::string why;
  ScopedDiagnosticHandler handler(&context, [&](Diagnostic &d) {
    if (why.empty())
      why = d.str();
    return success();
  });
  // Convolutions, pooling and batch norm as the ops `carve compile` runs
  // (im2col, or the convolutions whole where the request says the program
  // runs them as cuDNN's), so that they have gradients and are priced as
  // they run.
  PassManager lower(&context);
  CarveLowerConvolutionsOptions lowering;
  lowering.planning = true;
  lowering.keepWhole = req.convolutionsWhole;
  lower.addNestedPass<func::FuncOp>(createCarveLowerConvolutions(lowering));
  if (failed(lower.run(*model.module))) {
    error = modelName + ": " + (why.empty() ? "carve-lower-convolutions failed" : why);
    return false;
  }
  if (!buildTrainingStep(*model.module, ad, error)) {
    error = modelName + ": " + error + (why.empty() ? "" : ": " + why);
    return false;
  }
  return true;
}

} // namespace carve::planner
