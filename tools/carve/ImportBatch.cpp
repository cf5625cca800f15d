//===- ImportBatch.cpp - the model for one rank's share of the batch -------===//

#include "tools/carve/CompileSteps.h"

#include "compiler/frontend/Builtin.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"

using namespace llvm;

namespace carve {

namespace {

/// The global batch from the graph inputs; which parameters are integers.
void readInputs(mlir::ModuleOp global, const std::string &model, const Setup &s, Imported &im) {
  auto fwd = global.lookupSymbol<mlir::func::FuncOp>("forward");
  for (mlir::BlockArgument a : fwd.getArguments()) {
    auto t = cast<mlir::RankedTensorType>(a.getType());
    unsigned i = a.getArgNumber();
    if (mlir::StringAttr in = inputNameOf(fwd, i)) {
      if (t.getRank() == 0)
        die(model + ": input '" + in.getValue().str() +
            "' is a scalar; every graph input needs a leading batch dimension");
      if (im.batch < 0)
        im.batch = t.getDimSize(0), im.batchInput = in.getValue().str();
      else if (t.getDimSize(0) != im.batch)
        die(model + ": inputs '" + im.batchInput + "' and '" + in.getValue().str() +
            "' disagree on the batch dimension (" + std::to_string(im.batch) + " vs " +
            std::to_string(t.getDimSize(0)) + ")");
    }
    for (const char *k : {kParamAttr, kBufferAttr})
      if (auto p = fwd.getArgAttrOfType<mlir::StringAttr>(i, k))
        im.isInt[p.getValue().str()] = isa<mlir::IntegerType>(t.getElementType());
  }
  if (im.batch < 0)
    die(model + ": the model has no graph inputs to split into batches");
  if (im.batch % s.plan.dp != 0)
    die(s.where + ": dp=" + std::to_string(s.plan.dp) + " does not divide the global batch of " +
        std::to_string(im.batch) + " (input '" + im.batchInput + "'); choose dp dividing " +
        std::to_string(im.batch) + " or export (or --set-dim) another batch");
}

/// Micro-batches: each replica's share of the batch runs as m of them.
int countMicroBatches(const Setup &s, int64_t batch) {
  const Plan &plan = s.plan;
  const int64_t share = batch / plan.dp;
  auto ofShare = [&]() {
    return " samples (global batch " + std::to_string(batch) + " / dp " + std::to_string(plan.dp) +
           ")";
  };
  int m = 1;
  if (plan.microBatchSize > 0) {
    if (share % plan.microBatchSize != 0)
      die(s.where + ": micro_batch_size=" + std::to_string(plan.microBatchSize) +
          " does not divide each data-parallel replica's " + std::to_string(share) + ofShare());
    m = (int)(share / plan.microBatchSize);
    if (plan.numMicroBatches > 0 && plan.numMicroBatches != m)
      die(s.where + ": num_micro_batches=" + std::to_string(plan.numMicroBatches) +
          " and micro_batch_size=" + std::to_string(plan.microBatchSize) + " disagree (" +
          std::to_string(share) + " samples per replica make " + std::to_string(m) +
          " micro-batches of that size); give one of them");
  } else if (plan.numMicroBatches > 0) {
    m = plan.numMicroBatches;
  }
  if (share % m != 0)
    die(s.where + ": num_micro_batches=" + std::to_string(m) +
        " does not divide each data-parallel replica's " + std::to_string(share) + ofShare());
  return m;
}

} // namespace

Imported importModel(mlir::MLIRContext &context, const CompileArgs &args, const Setup &s,
                     pipeline::Schedule &schedule, Progress &progress) {
  progress.start("import");
  Imported im;
  std::string error;
  ImportOptions globalOpts = args.import;
  globalOpts.initialValues = args.noWeights ? nullptr : &im.initial;
  std::vector<std::string> notes;
  globalOpts.notes = &notes;
  auto global = loadModel(context, args.model, globalOpts, error);
  if (!global)
    die(args.model + ": " + error);
  for (const std::string &n : notes)
    llvm::errs() << "carve: note: " << args.model << ": " << n << "\n";
  readInputs(*global, args.model, s, im);
  im.m = countMicroBatches(s, im.batch);
  const Plan &plan = s.plan;
  if (plan.pp > 1 || im.m > 1) {
    pipeline::ScheduleKind kind;
    if (!pipeline::parseScheduleKind(plan.scheduleName(), kind, error) ||
        !pipeline::buildSchedule(kind, plan.pp, im.m, plan.virtualStages, schedule, error))
      die(s.where + ": " + error);
  } else if (!args.timelineJson.empty() || !args.timelineSvg.empty()) {
    die(std::string(args.timelineJson.empty() ? "--timeline-svg" : "--timeline") +
        ": the plan has no pipeline schedule (pp=1 and one micro-batch); set \"pp\" or "
        "\"num_micro_batches\"");
  }
  // One rank's program: the same model with batch / (dp * m).
  im.micro = im.batch / plan.dp / im.m;
  const std::string per = im.m > 1 ? "micro-batch" : "rank";
  if (im.micro == im.batch) {
    im.module = std::move(global);
  } else {
    ImportOptions localOpts = args.import;
    localOpts.batch = im.micro;
    localOpts.globalBatch = im.batch;
    im.module = loadModel(context, args.model, localOpts, error);
    if (!im.module)
      die(args.model + ": importing one " + (im.m > 1 ? "micro-batch" : "rank's share") +
          " of the batch (" + std::to_string(im.micro) + " of " + std::to_string(im.batch) +
          ") failed: " + error +
          (StringRef(error).contains("dynamic batch") ||
                   StringRef(error).contains("samples are independent")
               ? std::string()
               : std::string(" (the model may hard-code its batch size where carve cannot "
                             "place it; export it with a dynamic batch)")));
  }
  size_t params = im.initial.size();
  if (args.noWeights)
    params = im.isInt.size();
  progress.done(
      std::to_string(params) + " parameters" + (args.noWeights ? " (no weights)" : "") +
      ", global batch " + std::to_string(im.batch) +
      (im.micro == im.batch ? std::string() : ", " + std::to_string(im.micro) + " per " + per));
  return im;
}

} // namespace carve
