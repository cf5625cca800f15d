//===- EmitterRecordsTest.cpp - the emitter refuses records that lie ------===//
//
// The emitter prints what the passes recorded on the IR (carve.fold,
// carve.gradients, carve.buckets, carve.arena_offset, carve.persistent_plan,
// ...). A record that does not describe the function, such as an IR file
// edited by hand and run through carve-opt, must be an error naming it,
// never a program that writes one tensor over another. Each test runs the
// passes on a small training step, checks the emitter accepts the result,
// then breaks one record.
//
//===----------------------------------------------------------------------===//

#include "compiler/autodiff/Autodiff.h"
#include "compiler/codegen/CpuCodegen.h"
#include "compiler/dataparallel/DataParallel.h"
#include "compiler/fusion/Fusion.h"
#include "compiler/memory/MemoryPlan.h"
#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/Contract.h"
#include "dialects/dist/DistDialect.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Pass/PassManager.h"

#include <gtest/gtest.h>

using namespace carve;
using namespace mlir;

namespace {

const char *kModel = R"(
func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %w1: tensor<8x8xf32> {carve.param = "fc1.weight", carve.trainable},
                   %w2: tensor<8x8xf32> {carve.param = "fc2.weight", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %h = carve.matmul %x, %w1 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/fc1/MatMul")
  %a = carve.exp %h : tensor<4x8xf32> loc("/act/Exp")
  %y = carve.matmul %a, %w2 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/fc2/MatMul")
  %l = carve.reduce_sum %y {axes = array<i64: 0, 1>, keep_dims = false} : tensor<4x8xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
)";

struct EmitterRecords : ::testing::Test {
  void SetUp() override {
    context.loadDialect<CarveDialect, dist::DistDialect, func::FuncDialect>();
    module = parseSourceString<ModuleOp>(kModel, &context);
    ASSERT_TRUE(module);
    PlanAttrs plan;
    plan.dp = 2;
    plan.zero = 2;
    plan.globalBatch = 8;
    writePlan(*module, plan);
    PassManager pm(&context);
    pm.addPass(createCarveAutodiff());
    pm.addPass(createCarveFuseElementwise());
    pm.addPass(createCarveFoldTransposes());
    pm.addPass(createCarveDataParallel());
    pm.addPass(createCarvePlanMemory());
    ASSERT_TRUE(succeeded(pm.run(*module)));
    fn = module->lookupSymbol<func::FuncOp>("train_step");
    ASSERT_TRUE(fn);
  }
  /// The emitter's error, or "" when it generated the program.
  std::string emit() {
    CodegenOptions opts;
    opts.modelName = "test";
    GeneratedProgram out;
    std::string error;
    return generateCpuProgram(*module, opts, out, error) ? "" : error;
  }
  /// The first op that carries `attr`.
  Operation *firstWith(StringRef attr) {
    Operation *found = nullptr;
    fn.walk([&](Operation *op) {
      if (!found && op->hasAttr(attr))
        found = op;
    });
    return found;
  }

  MLIRContext context;
  OwningOpRef<ModuleOp> module;
  func::FuncOp fn;
};

TEST_F(EmitterRecords, TheRecordsAsThePassesWroteThemAreAccepted) { EXPECT_EQ(emit(), ""); }

TEST_F(EmitterRecords, TwoLiveActivationsInOneByteAreRefused) {
  // Every activation at offset 0: the matmul's result is still read by the exp.
  fn.walk([&](Operation *op) {
    if (auto a = op->getAttrOfType<DenseI64ArrayAttr>(kArenaOffsetAttr)) {
      SmallVector<int64_t> zeros(a.size(), 0);
      op->setAttr(kArenaOffsetAttr, Builder(&context).getDenseI64ArrayAttr(zeros));
    }
  });
  std::string e = emit();
  EXPECT_NE(e.find("the memory plan puts 'act_Exp' over 'fc1_MatMul', which is still read"),
            std::string::npos)
      << e;
}

TEST_F(EmitterRecords, AnActivationOutsideItsRegionIsRefused) {
  Operation *op = firstWith(kArenaOffsetAttr);
  ASSERT_TRUE(op);
  op->setAttr(kArenaOffsetAttr, Builder(&context).getDenseI64ArrayAttr({1 << 30}));
  std::string e = emit();
  EXPECT_NE(e.find("has no place in the activation region"), std::string::npos) << e;
}

TEST_F(EmitterRecords, AMissingMemoryPlanIsRefused) {
  fn->removeAttr(kActivationPlanAttr);
  std::string e = emit();
  EXPECT_NE(e.find("run carve-plan-memory first"), std::string::npos) << e;
}

TEST_F(EmitterRecords, APersistentTensorOverAnotherIsRefused) {
  // The second parameter placed over the first.
  fn.setArgAttr(2, kPersistentOffsetAttr, Builder(&context).getI64IntegerAttr(0));
  std::string e = emit();
  EXPECT_NE(e.find("carve.persistent_plan places fc2_weight at byte 0, over fc1_weight"),
            std::string::npos)
      << e;
}

TEST_F(EmitterRecords, OptimizerStateForAnotherOptimizerIsRefused) {
  // The plan's records keep AdamW's two tensors; the emitter is asked for SGD.
  CodegenOptions opts;
  opts.modelName = "test";
  opts.optimizer.kind = "sgd";
  GeneratedProgram out;
  std::string error;
  EXPECT_FALSE(generateCpuProgram(*module, opts, out, error));
  EXPECT_NE(error.find("optimizer state tensors"), std::string::npos) << error;
}

TEST_F(EmitterRecords, BucketsThatSkipAGradientAreRefused) {
  auto buckets = fn->getAttrOfType<ArrayAttr>(kBucketsAttr);
  ASSERT_TRUE(buckets && buckets.size() == 1);
  auto d = cast<DictionaryAttr>(buckets[0]);
  Builder b(&context);
  SmallVector<NamedAttribute> f(d.begin(), d.end());
  for (NamedAttribute &x : f)
    if (x.getName() == "last")
      x.setValue(b.getI64IntegerAttr(0));
  fn->setAttr(kBucketsAttr, b.getArrayAttr({b.getDictionaryAttr(f)}));
  std::string e = emit();
  EXPECT_NE(e.find("do not cover every gradient"), std::string::npos) << e;
}

TEST_F(EmitterRecords, AFoldOnAnOpThatIsNoTransposeIsRefused) {
  Operation *exp = nullptr;
  fn.walk([&](ExpOp op) { exp = op; });
  ASSERT_TRUE(exp);
  exp->setAttr(kFoldAttr, Builder(&context).getStringAttr(kFoldOperand));
  std::string e = emit();
  EXPECT_NE(e.find("carve.fold marks an op that is no transpose"), std::string::npos) << e;
}

} // namespace
