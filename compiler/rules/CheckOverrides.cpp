//===- CheckOverrides.cpp - carve-check-overrides -------------------------===//

#include "compiler/rules/Rules.h"

#include "mlir/Pass/Pass.h"

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVECHECKOVERRIDES
#include "compiler/rules/Passes.h.inc"
} // namespace carve

namespace {

struct CheckOverridesPass : carve::impl::CarveCheckOverridesBase<CheckOverridesPass> {
  using CarveCheckOverridesBase::CarveCheckOverridesBase;
  explicit CheckOverridesPass(const carve::RuleSet &rules) : rules(rules), loaded(true) {}

  void runOnOperation() override {
    std::string error;
    if (!loaded && !rulesPath.empty()) {
      if (!carve::loadRules(rulesPath, rules, error)) {
        getOperation().emitError(error);
        return signalPassFailure();
      }
      loaded = true;
    }
    if (!carve::checkOverridesMatch(getOperation(), rules, error)) {
      getOperation().emitError(error);
      signalPassFailure();
    }
  }

  carve::RuleSet rules;
  bool loaded = false;
};

} // namespace

std::unique_ptr<Pass> carve::createCheckOverridesPass(const RuleSet &rules) {
  return std::make_unique<CheckOverridesPass>(rules);
}
