//===- CheckOverrides.cpp - carve-bind-custom-ops, carve-check-overrides --===//

#include "compiler/rules/Rules.h"

#include "mlir/Pass/Pass.h"

using namespace mlir;

namespace carve {
#define GEN_PASS_DEF_CARVEBINDCUSTOMOPS
#define GEN_PASS_DEF_CARVECHECKOVERRIDES
#include "compiler/rules/Passes.h.inc"
} // namespace carve

namespace {

/// The rules file of a pass: given by the driver, or read from the `rules`
/// option when run from carve-opt. False (with an error on the op) when it
/// cannot be read.
bool loadOnce(Operation *op, const std::string &path, carve::RuleSet &rules, bool &loaded) {
  if (loaded || path.empty())
    return true;
  std::string error;
  if (!carve::loadRules(path, rules, error)) {
    op->emitError(error);
    return false;
  }
  loaded = true;
  return true;
}

struct BindCustomOpsPass : carve::impl::CarveBindCustomOpsBase<BindCustomOpsPass> {
  using CarveBindCustomOpsBase::CarveBindCustomOpsBase;
  explicit BindCustomOpsPass(const carve::RuleSet &rules) : rules(rules), loaded(true) {}

  void runOnOperation() override {
    if (!loadOnce(getOperation(), rulesPath, rules, loaded))
      return signalPassFailure();
    std::string error;
    if (!carve::prepareCustomOps(getOperation(), rules, error)) {
      getOperation().emitError(error);
      signalPassFailure();
    }
  }

  carve::RuleSet rules;
  bool loaded = false;
};

struct CheckOverridesPass : carve::impl::CarveCheckOverridesBase<CheckOverridesPass> {
  using CarveCheckOverridesBase::CarveCheckOverridesBase;
  explicit CheckOverridesPass(const carve::RuleSet &rules) : rules(rules), loaded(true) {}

  void runOnOperation() override {
    if (!loadOnce(getOperation(), rulesPath, rules, loaded))
      return signalPassFailure();
    std::string error;
    if (!carve::checkOverridesMatch(getOperation(), rules, error)) {
      getOperation().emitError(error);
      signalPassFailure();
    }
  }

  carve::RuleSet rules;
  bool loaded = false;
};

} // namespace

std::unique_ptr<Pass> carve::createBindCustomOpsPass(const RuleSet &rules) {
  return std::make_unique<BindCustomOpsPass>(rules);
}

std::unique_ptr<Pass> carve::createCheckOverridesPass(const RuleSet &rules) {
  return std::make_unique<CheckOverridesPass>(rules);
}
