//===- Contract.cpp - accessors of the attributes stages hand each other --===//

#include "dialects/carve/Contract.h"

#include "llvm/ADT/DenseMap.h"
#include "dialects/carve/CarveOps.h"

using namespace mlir;

namespace carve {

StringAttr paramNameOf(func::FuncOp fn, unsigned arg) {
  return fn.getArgAttrOfType<StringAttr>(arg, kParamAttr);
}

StringAttr inputNameOf(func::FuncOp fn, unsigned arg) {
  return fn.getArgAttrOfType<StringAttr>(arg, kInputAttr);
}

StringAttr gradOf(func::FuncOp fn, unsigned result) {
  return fn.getResultAttrOfType<StringAttr>(result, kGradOfAttr);
}

std::optional<unsigned> paramArgOfGrad(func::FuncOp fn, unsigned result) {
  StringAttr of = gradOf(fn, result);
  if (!of)
    return std::nullopt;
  for (unsigned a = 0; a < fn.getNumArguments(); ++a)
    if (paramNameOf(fn, a) == of)
      return a;
  return std::nullopt;
}

std::vector<std::optional<unsigned>> paramArgsOfGrads(func::FuncOp fn) {
  llvm::DenseMap<StringAttr, unsigned> argOf;
  for (unsigned a = 0; a < fn.getNumArguments(); ++a)
    if (StringAttr name = paramNameOf(fn, a))
      argOf.try_emplace(name, a); // the first, as paramArgOfGrad
  std::vector<std::optional<unsigned>> out(fn.getNumResults());
  for (unsigned k = 0; k < fn.getNumResults(); ++k)
    if (StringAttr of = gradOf(fn, k)) {
      auto it = argOf.find(of);
      if (it != argOf.end())
        out[k] = it->second;
    }
  return out;
}

void ArgAttrEdits::set(unsigned index, llvm::StringRef name, Attribute value) {
  if (lists.empty()) {
    const unsigned n = results ? fn.getNumResults() : fn.getNumArguments();
    lists.reserve(n);
    for (unsigned i = 0; i < n; ++i)
      lists.emplace_back(results ? fn.getResultAttrDict(i) : fn.getArgAttrDict(i));
  }
  lists[index].set(name, value);
}

void ArgAttrEdits::apply() {
  if (lists.empty())
    return;
  MLIRContext *ctx = fn.getContext();
  SmallVector<DictionaryAttr> dicts;
  dicts.reserve(lists.size());
  for (NamedAttrList &l : lists)
    dicts.push_back(l.getDictionary(ctx));
  if (results)
    fn.setAllResultAttrs(dicts);
  else
    fn.setAllArgAttrs(dicts);
  lists.clear();
}

bool isTrainable(func::FuncOp fn, unsigned arg) {
  return static_cast<bool>(fn.getArgAttr(arg, kTrainableAttr));
}

bool isEmittedFunction(func::FuncOp fn) {
  return fn.getSymName() == "train_step" || fn->hasAttr(kStageAttr);
}

bool isRounded16(Value v) {
  Operation *def = v.getDefiningOp();
  while (def && isa<ReshapeOp>(def))
    def = def->getOperand(0).getDefiningOp();
  return def && def->hasAttr(kRound16Attr);
}

} // namespace carve

namespace carve {

void writePlan(ModuleOp module, const PlanAttrs &plan) {
  Builder b(module.getContext());
  SmallVector<NamedAttribute> fields;
  auto i64 = [&](const char *name, int64_t v) {
    fields.push_back(b.getNamedAttr(name, b.getI64IntegerAttr(v)));
  };
  i64("dp", plan.dp);
  i64("tp", plan.tp);
  i64("pp", plan.pp);
  if (plan.ep != 1)
    i64("ep", plan.ep);
  i64("zero", plan.zero);
  if (plan.zero3PrefetchLayers != 0)
    i64("zero3_prefetch_layers", plan.zero3PrefetchLayers);
  if (plan.sequenceParallel)
    fields.push_back(b.getNamedAttr("sequence_parallel", b.getUnitAttr()));
  if (plan.syncBatchNorm)
    fields.push_back(b.getNamedAttr("sync_batch_norm", b.getUnitAttr()));
  i64("micro_batches", plan.microBatches);
  i64("virtual_stages", plan.virtualStages);
  fields.push_back(b.getNamedAttr("schedule", b.getStringAttr(plan.schedule)));
  fields.push_back(b.getNamedAttr("precision", b.getStringAttr(plan.precision)));
  if (plan.tf32)
    fields.push_back(b.getNamedAttr("tf32", b.getUnitAttr()));
  if (plan.target != "cpu")
    fields.push_back(b.getNamedAttr("target", b.getStringAttr(plan.target)));
  if (plan.attention != "cudnn")
    fields.push_back(b.getNamedAttr("attention", b.getStringAttr(plan.attention)));
  if (plan.convolution != "cudnn")
    fields.push_back(b.getNamedAttr("convolution", b.getStringAttr(plan.convolution)));
  if (plan.gradAccumulation != "fp32")
    fields.push_back(b.getNamedAttr("grad_accumulation", b.getStringAttr(plan.gradAccumulation)));
  if (plan.globalBatch > 0)
    i64("global_batch", plan.globalBatch);
  i64("optimizer_state", plan.optimizerState);
  if (plan.recompute != "none")
    fields.push_back(b.getNamedAttr("recompute", b.getStringAttr(plan.recompute)));
  if (!plan.recomputeLayers.empty()) {
    SmallVector<StringRef> layers(plan.recomputeLayers.begin(), plan.recomputeLayers.end());
    fields.push_back(b.getNamedAttr("recompute_layers", b.getStrArrayAttr(layers)));
  }
  if (!plan.cuts.empty()) {
    SmallVector<StringRef> cuts(plan.cuts.begin(), plan.cuts.end());
    fields.push_back(b.getNamedAttr("cuts", b.getStrArrayAttr(cuts)));
  }
  if (!plan.ops.empty()) {
    SmallVector<Attribute> ops;
    for (const auto &[glob, dim] : plan.ops)
      ops.push_back(b.getStrArrayAttr({glob, dim}));
    fields.push_back(b.getNamedAttr("ops", b.getArrayAttr(ops)));
  }
  module->setAttr(kPlanAttr, b.getDictionaryAttr(fields));
}

FailureOr<PlanAttrs> readPlan(ModuleOp module) {
  PlanAttrs plan;
  auto dict = module->getAttrOfType<DictionaryAttr>(kPlanAttr);
  if (!dict) {
    if (module->hasAttr(kPlanAttr))
      return module.emitError() << "'" << kPlanAttr << "' must be a dictionary";
    return plan;
  }
  auto bad = [&](StringRef field, StringRef want) {
    return module.emitError() << "'" << kPlanAttr << "' field '" << field << "' must be " << want;
  };
  for (NamedAttribute f : dict) {
    StringRef name = f.getName().getValue();
    Attribute v = f.getValue();
    std::pair<const char *, int64_t *> ints[] = {
        {"dp", &plan.dp},
        {"tp", &plan.tp},
        {"pp", &plan.pp},
        {"ep", &plan.ep},
        {"zero", &plan.zero},
        {"zero3_prefetch_layers", &plan.zero3PrefetchLayers},
        {"micro_batches", &plan.microBatches},
        {"virtual_stages", &plan.virtualStages},
        {"global_batch", &plan.globalBatch},
        {"optimizer_state", &plan.optimizerState}};
    bool known = false;
    for (auto &[key, dst] : ints) {
      if (name != key)
        continue;
      known = true;
      auto i = dyn_cast<IntegerAttr>(v);
      const bool fromZero = name == "zero" || name == "global_batch" || name == "optimizer_state" ||
                            name == "zero3_prefetch_layers";
      if (!i || i.getInt() < (fromZero ? 0 : 1))
        return bad(name, fromZero ? "an integer >= 0" : "an integer >= 1");
      if (name == "optimizer_state" && i.getInt() > 2)
        return bad(name, "0, 1 or 2");
      *dst = i.getInt();
    }
    if (known)
      continue;
    if (name == "sequence_parallel" || name == "sync_batch_norm" || name == "tf32") {
      bool &dst = name == "sequence_parallel" ? plan.sequenceParallel
                  : name == "tf32"            ? plan.tf32
                                              : plan.syncBatchNorm;
      if (isa<UnitAttr>(v))
        dst = true;
      else if (auto bv = dyn_cast<BoolAttr>(v))
        dst = bv.getValue();
      else
        return bad(name, "a unit or bool attribute");
    } else if (name == "schedule" || name == "precision") {
      auto s = dyn_cast<StringAttr>(v);
      if (!s)
        return bad(name, "a string");
      (name == "schedule" ? plan.schedule : plan.precision) = s.getValue().str();
    } else if (name == "target") {
      auto s = dyn_cast<StringAttr>(v);
      if (!s || !llvm::is_contained({"cpu", "cuda"}, s.getValue()))
        return bad(name, "\"cpu\" or \"cuda\"");
      plan.target = s.getValue().str();
    } else if (name == "attention") {
      auto s = dyn_cast<StringAttr>(v);
      if (!s || !llvm::is_contained({"cudnn", "carve"}, s.getValue()))
        return bad(name, "\"cudnn\" or \"carve\"");
      plan.attention = s.getValue().str();
    } else if (name == "convolution") {
      auto s = dyn_cast<StringAttr>(v);
      if (!s || !llvm::is_contained({"cudnn", "carve"}, s.getValue()))
        return bad(name, "\"cudnn\" or \"carve\"");
      plan.convolution = s.getValue().str();
    } else if (name == "grad_accumulation") {
      auto s = dyn_cast<StringAttr>(v);
      if (!s || !llvm::is_contained({"fp32", "16bit"}, s.getValue()))
        return bad(name, "\"fp32\" or \"16bit\"");
      plan.gradAccumulation = s.getValue().str();
    } else if (name == "recompute") {
      auto s = dyn_cast<StringAttr>(v);
      if (!s || !llvm::is_contained({"none", "selective", "full"}, s.getValue()))
        return bad(name, "\"none\", \"selective\" or \"full\"");
      plan.recompute = s.getValue().str();
    } else if (name == "cuts" || name == "recompute_layers") {
      auto a = dyn_cast<ArrayAttr>(v);
      if (!a || !llvm::all_of(a, [](Attribute e) { return isa<StringAttr>(e); }))
        return bad(name, "an array of strings");
      for (Attribute e : a)
        (name == "cuts" ? plan.cuts : plan.recomputeLayers)
            .push_back(cast<StringAttr>(e).getValue().str());
    } else if (name == "ops") {
      auto a = dyn_cast<ArrayAttr>(v);
      if (!a)
        return bad(name, "an array of [glob, dim] string pairs");
      for (Attribute e : a) {
        auto pair = dyn_cast<ArrayAttr>(e);
        if (!pair || pair.size() != 2 || !isa<StringAttr>(pair[0]) || !isa<StringAttr>(pair[1]))
          return bad(name, "an array of [glob, dim] string pairs");
        plan.ops.push_back({cast<StringAttr>(pair[0]).getValue().str(),
                            cast<StringAttr>(pair[1]).getValue().str()});
      }
    } else {
      return module.emitError() << "'" << kPlanAttr << "' has an unknown field '" << name << "'";
    }
  }
  if (plan.zero3PrefetchLayers > 0 && plan.zero != 3)
    return module.emitError() << "'" << kPlanAttr
                              << "' field 'zero3_prefetch_layers' needs zero = 3";
  if (plan.dp % plan.ep != 0)
    return module.emitError() << "'" << kPlanAttr << "' field 'ep' (" << plan.ep
                              << ") must divide dp (" << plan.dp << ")";
  if (plan.gradAccumulation == "16bit" && plan.precision == "fp32")
    return module.emitError() << "'" << kPlanAttr
                              << "' field 'grad_accumulation' = \"16bit\" needs precision bf16 "
                                 "or fp16";
  if (!plan.recomputeLayers.empty() && plan.recompute != "full")
    return module.emitError() << "'" << kPlanAttr
                              << "' field 'recompute_layers' needs recompute = \"full\"";
  return plan;
}

// The runtime checks again, and runs carve's kernel where cuDNN's engines
// refuse a shape on the GPU at hand (runtime/cuda/attention_cudnn.cpp).
std::string cudnnAttentionRefusal(mlir::Operation *op, const PlanAttrs &plan) {
  if (plan.target != "cuda")
    return "the " + plan.target + " target";
  if (plan.precision != "bf16" && plan.precision != "fp16")
    return "the plan computes attention in fp32";
  if (plan.attention == "carve")
    return "--attention carve";
  mlir::Value q = op->getOperand(0), k = op->getOperand(1), v = op->getOperand(2);
  mlir::Value mask;
  if (auto a = mlir::dyn_cast<AttentionStatsOp>(op))
    mask = a.getMask();
  else if (auto g = mlir::dyn_cast<AttentionGradStatsOp>(op))
    mask = g.getMask();
  else
    return "not carve.attention_stats or carve.attention_grad_stats";
  auto qt = mlir::dyn_cast<mlir::RankedTensorType>(q.getType());
  auto kt = mlir::dyn_cast<mlir::RankedTensorType>(k.getType());
  auto vt = mlir::dyn_cast<mlir::RankedTensorType>(v.getType());
  if (!qt || !kt || !vt || !qt.hasStaticShape() || !kt.hasStaticShape() || !vt.hasStaticShape() ||
      qt.getRank() < 2)
    return "shapes not static";
  if (mask) {
    // An additive mask becomes cuDNN's bias (runtime/cuda/attention_cudnn.cpp):
    // an f32 tensor that broadcasts to the scores [..., Tq, Tk].
    auto mt = mlir::dyn_cast<mlir::RankedTensorType>(mask.getType());
    if (!mt || !mt.hasStaticShape() || !mt.getElementType().isF32())
      return "an attention mask that is not a static f32 tensor";
    const int64_t r = qt.getRank(), mr = mt.getRank();
    if (mr > r)
      return "an attention mask of higher rank than the scores";
    for (int64_t i = 0; i < mr; ++i) {
      const int64_t at = r - mr + i;
      const int64_t want = at == r - 1 ? kt.getShape()[r - 2] : qt.getShape()[at];
      if (mt.getShape()[i] != 1 && mt.getShape()[i] != want)
        return "an attention mask that does not broadcast to the scores";
    }
  }
  int64_t d = qt.getShape().back(), dv = vt.getShape().back();
  if (d % 8 || dv % 8 || d > 256 || dv > 256)
    return "head dimensions " + std::to_string(d) + " and " + std::to_string(dv) +
           " (cuDNN takes multiples of 8 up to 256)";
  for (int64_t x : qt.getShape())
    if (x == 0)
      return "an empty tensor";
  return "";
}

mlir::Value copy16Before(mlir::Value x, mlir::Operation *op, llvm::StringRef precision) {
  for (mlir::Operation *u : x.getUsers()) {
    auto c = mlir::dyn_cast<CastOp>(u);
    if (!c || c->getBlock() != op->getBlock() || !c->isBeforeInBlock(op))
      continue;
    mlir::Type t = mlir::cast<mlir::ShapedType>(c.getType()).getElementType();
    if ((precision == "bf16" && t.isBF16()) || (precision == "fp16" && t.isF16()))
      return c.getResult();
  }
  return mlir::Value();
}

mlir::Value copy16BeforeView(mlir::Value x, mlir::Operation *op, llvm::StringRef precision) {
  for (mlir::Value v = x;;) {
    if (mlir::Value c = copy16Before(v, op, precision))
      return c;
    auto r = v.getDefiningOp<ReshapeOp>();
    if (!r)
      return mlir::Value();
    v = r.getInput();
  }
}

namespace {

/// `v` through reshapes (what stored16 and exact16 look at), and the 16-bit
/// tensor of the plan's format it is an f32 view of; `f32`: whether `v` is
/// f32 at all.
mlir::Value viewSource16(mlir::Value &v, llvm::StringRef precision, bool &f32) {
  while (auto r = v.getDefiningOp<ReshapeOp>())
    v = r.getInput();
  f32 = mlir::cast<mlir::ShapedType>(v.getType()).getElementType().isF32();
  auto c = v.getDefiningOp<CastOp>();
  if (!f32 || !c)
    return mlir::Value();
  mlir::Type t = mlir::cast<mlir::ShapedType>(c.getInput().getType()).getElementType();
  if ((precision == "bf16" && t.isBF16()) || (precision == "fp16" && t.isF16()))
    return c.getInput();
  return mlir::Value();
}

} // namespace

mlir::Value stored16(mlir::Value v, mlir::Operation *reader, llvm::StringRef precision) {
  bool f32;
  if (mlir::Value s = viewSource16(v, precision, f32))
    return s;
  return f32 ? copy16Before(v, reader, precision) : mlir::Value();
}

mlir::Value exact16(mlir::Value v, mlir::Operation *reader, llvm::StringRef precision) {
  bool f32;
  if (mlir::Value s = viewSource16(v, precision, f32))
    return s;
  mlir::Operation *w = v.getDefiningOp();
  if (!f32 || !w || w->getNumResults() != 1 || !w->hasAttr(kRound16Attr))
    return mlir::Value();
  return copy16Before(v, reader, precision);
}

} // namespace carve
