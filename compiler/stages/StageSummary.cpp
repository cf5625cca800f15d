//===- StageSummary.cpp - what carve-split-stages records on its stages --===//
//
// The stage functions' summaries (carve.stage_summary), the stages in order,
// and the gradients several stages share (StageSplit.h): read by the
// emitter, the driver and carve plan's as-compiled check.
//
//===----------------------------------------------------------------------===//

#include "compiler/stages/StageSplit.h"

#include "dialects/carve/CarveOps.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"

#include <map>

using namespace mlir;

namespace carve {

void writeStageSummary(func::FuncOp stage, const StageSummary &st) {
  Builder b(stage.getContext());
  auto f64 = [&](double x) { return b.getF64FloatAttr(x); };
  stage->setAttr(kStageSummaryAttr,
                 b.getDictionaryAttr({
                     b.getNamedAttr("first", b.getStringAttr(st.first)),
                     b.getNamedAttr("last", b.getStringAttr(st.last)),
                     b.getNamedAttr("layers", b.getI64IntegerAttr(st.layers)),
                     b.getNamedAttr("forward_flops", f64(st.forwardFlops)),
                     b.getNamedAttr("backward_flops", f64(st.backwardFlops)),
                     b.getNamedAttr("flops", f64(st.flops)),
                     b.getNamedAttr("param_bytes", b.getI64IntegerAttr(st.paramBytes)),
                     b.getNamedAttr("send_bytes", b.getI64IntegerAttr(st.sendBytes)),
                     b.getNamedAttr("ops", b.getI64IntegerAttr(st.ops)),
                 }));
}

std::optional<StageSummary> readStageSummary(func::FuncOp stage) {
  auto d = stage->getAttrOfType<DictionaryAttr>(kStageSummaryAttr);
  if (!d)
    return std::nullopt;
  StageSummary st;
  auto str = [&](const char *k) {
    auto a = d.getAs<StringAttr>(k);
    return a ? a.getValue().str() : std::string();
  };
  auto i64 = [&](const char *k) -> int64_t {
    auto a = d.getAs<IntegerAttr>(k);
    return a ? a.getInt() : 0;
  };
  auto f64 = [&](const char *k) {
    auto a = d.getAs<FloatAttr>(k);
    return a ? a.getValueAsDouble() : 0.0;
  };
  st.first = str("first");
  st.last = str("last");
  st.layers = (int)i64("layers");
  st.forwardFlops = f64("forward_flops");
  st.backwardFlops = f64("backward_flops");
  st.flops = f64("flops");
  st.paramBytes = i64("param_bytes");
  st.sendBytes = i64("send_bytes");
  st.ops = (int)i64("ops");
  return st;
}

bool globNamesSomeLayers(llvm::StringRef glob) {
  for (size_t dot = glob.find('.'); dot != llvm::StringRef::npos; dot = glob.find('.', dot + 1)) {
    llvm::StringRef after = glob.drop_front(dot + 1);
    after = after.take_until([](char c) { return c == '/' || c == '.'; });
    if (after != "*" && llvm::any_of(after, [](char c) { return llvm::isDigit(c) || c == '['; }))
      return true;
  }
  return false;
}

std::vector<func::FuncOp> stageFunctions(ModuleOp module) {
  std::vector<func::FuncOp> stages;
  for (int s = 0;; ++s) {
    auto fn = module.lookupSymbol<func::FuncOp>("stage" + std::to_string(s));
    if (!fn)
      return stages;
    stages.push_back(fn);
  }
}

std::vector<SharedGradient> sharedGradients(ModuleOp module) {
  // Summed over stages in one order for every rank: by name.
  std::map<std::string, SharedGradient> byName;
  std::vector<func::FuncOp> stages = stageFunctions(module);
  for (size_t s = 0; s < stages.size(); ++s) {
    func::FuncOp fn = stages[s];
    for (unsigned k = 0; k < fn.getNumResults(); ++k)
      if (fn.getResultAttr(k, kSharedGradAttr)) {
        std::string name = gradOf(fn, k).str();
        auto t = cast<RankedTensorType>(fn.getResultTypes()[k]);
        if (!byName.count(name))
          byName[name] = {name, t.getNumElements(), (int)s};
      }
  }
  std::vector<SharedGradient> out;
  for (auto &[n, sh] : byName)
    out.push_back(sh);
  return out;
}

} // namespace carve
