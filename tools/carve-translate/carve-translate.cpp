//===- carve-translate.cpp - carve's translations (mlir-translate) --------===//
//
// mlir-translate with carve's dialects and translations:
//
//   carve-translate --carve-to-cpp step.mlir [-o programs.txt]
//
// prints a lowered module (the IR `carve compile --emit-mlir-after
// carve-select-kernels` writes, or carve-opt's after that pass) as the
// per-rank programs `carve compile` writes to OUT/src: C++, or CUDA under a
// plan whose target is cuda, each after a line `// ===== NAME =====`. The
// printer decides nothing: every choice is on the IR. IR that is not lowered
// is an error naming the pass that has not run; nothing is written.
//
//===----------------------------------------------------------------------===//

#include "compiler/codegen/CpuCodegen.h"
#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/Contract.h"
#include "dialects/dist/DistDialect.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/Tools/mlir-translate/MlirTranslateMain.h"
#include "mlir/Tools/mlir-translate/Translation.h"

using namespace mlir;

namespace {

LogicalResult toCpp(ModuleOp module, llvm::raw_ostream &os) {
  bool lowered = false;
  module.walk([&](Operation *op) {
    lowered |= op->hasAttr(carve::kKernelAttr);
    return lowered ? WalkResult::interrupt() : WalkResult::advance();
  });
  if (!lowered)
    return module.emitError("the IR is not lowered: no op has carve.kernel (run the compile "
                            "pipeline through its last pass, carve-select-kernels)");
  carve::CodegenOptions cg;
  cg.modelName = module.getSymName() ? module.getSymName()->str() : "model";
  if (Attribute plan = module->getAttr("carve.plan")) {
    llvm::raw_string_ostream ps(cg.planJson);
    plan.print(ps);
  }
  carve::ModulePrograms programs;
  std::string error;
  if (!carve::generatePrograms(module, cg, programs, error))
    return module.emitError(error);
  FailureOr<carve::PlanAttrs> plan = carve::readPlan(module);
  const char *ext = succeeded(plan) && plan->target == "cuda" ? ".cu" : ".cpp";
  for (size_t k = 0; k < programs.programs.size(); ++k)
    os << "// ===== " << programs.names[k] << ext << " =====\n" << programs.programs[k].source;
  return success();
}

} // namespace

int main(int argc, char **argv) {
  TranslateFromMLIRRegistration registration(
      "carve-to-cpp", "a lowered carve module as its per-rank C++ or CUDA programs", toCpp,
      [](DialectRegistry &registry) {
        registry.insert<carve::CarveDialect, dist::DistDialect, func::FuncDialect>();
      });
  return failed(mlirTranslateMain(argc, argv, "carve translation tool"));
}
