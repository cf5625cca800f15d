//===- EmitterRecordsTest.cpp - the emitter refuses records that lie ------===//
//
// The emitter prints what the passes recorded on the IR (carve.fold,
// carve.gradients, carve.buckets, carve.arena_offset, carve.persistent_plan,
// the optimizer's tail ops ...). A record that does not describe the function, such as an IR file
// edited by hand and run through carve-opt, must be an error naming it,
// never a program that writes one tensor over another. Each test runs the
// passes on a small training step, checks the emitter accepts the result,
// then breaks one record.
//
//===----------------------------------------------------------------------===//

#include "compiler/lower/Passes.h"
#include "compiler/autodiff/Autodiff.h"
#include "compiler/codegen/CpuCodegen.h"
#include "compiler/dataparallel/DataParallel.h"
#include "compiler/fusion/Fusion.h"
#include "compiler/memory/MemoryPlan.h"
#include "compiler/optimizer/Optimizer.h"
#include "dialects/carve/CarveDialect.h"
#include "dialects/carve/CarveOps.h"
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
    pm.addPass(createCarveOptimizer(OptimizerConfig()));
    pm.addPass(createCarveSelectKernels());
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

TEST_F(EmitterRecords, AnOpWithoutItsKernelIsRefused) {
  // The emitter prints the entry carve-select-kernels chose; it chooses none.
  Operation *op = firstWith(kKernelAttr);
  ASSERT_TRUE(op);
  op->removeAttr(kKernelAttr);
  std::string e = emit();
  EXPECT_NE(e.find("no carve.kernel: the IR is not lowered (the pass carve-select-kernels"),
            std::string::npos)
      << e;
}

TEST_F(EmitterRecords, TheChosenEntryIsTheCallPrinted) {
  // The first matmul told to run as its gathered form, which needs a gathered
  // operand: the emitter does not fall back to a choice of its own.
  Operation *mm = nullptr;
  fn.walk([&](MatmulOp m) {
    if (!mm)
      mm = m;
  });
  ASSERT_TRUE(mm);
  mm->setAttr(kKernelAttr, StringAttr::get(&context, "matmul_gathered"));
  std::string e = emit();
  EXPECT_NE(e.find("carve.kernel = \"matmul_gathered\" on a matmul whose right operand is no "
                   "gather"),
            std::string::npos)
      << e;
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

TEST_F(EmitterRecords, AnUpdateWithoutItsStateIsRefused) {
  // The tail updates with AdamW (two state tensors); the layout keeps one.
  auto d = fn->getAttrOfType<DictionaryAttr>(kPersistentPlanAttr);
  ASSERT_TRUE(d);
  Builder b(&context);
  SmallVector<NamedAttribute> f(d.begin(), d.end());
  for (NamedAttribute &x : f)
    if (x.getName() == "states") {
      SmallVector<int64_t> st(cast<DenseI64ArrayAttr>(x.getValue()).asArrayRef());
      st[1] = -1;
      x.setValue(b.getDenseI64ArrayAttr(st));
    }
  fn->setAttr(kPersistentPlanAttr, b.getDictionaryAttr(f));
  std::string e = emit();
  EXPECT_NE(e.find("optimizer state tensors"), std::string::npos) << e;
}

TEST_F(EmitterRecords, AParameterWithoutAnUpdateIsRefused) {
  Operation *update = nullptr;
  fn.walk([&](AdamWOp op) { update = update ? update : op.getOperation(); });
  ASSERT_TRUE(update);
  update->erase();
  std::string e = emit();
  EXPECT_NE(e.find("the parameter of gradient slot"), std::string::npos) << e;
  EXPECT_NE(e.find("has 0 updates; it needs one"), std::string::npos) << e;
}

TEST_F(EmitterRecords, AnUpdateFromAnotherGradientIsRefused) {
  SmallVector<AdamWOp> updates;
  fn.walk([&](AdamWOp op) { updates.push_back(op); });
  ASSERT_EQ(updates.size(), 2u);
  updates[0]->setOperand(1, updates[1].getGrad());
  std::string e = emit();
  EXPECT_NE(e.find("with a value that is not its gradient in carve.gradients"), std::string::npos)
      << e;
}

TEST_F(EmitterRecords, ZeroWithoutItsGatherIsRefused) {
  // ZeRO-2 over dp = 2: without the gather each rank keeps a stale copy of
  // the chunks other ranks updated.
  Operation *gather = nullptr;
  fn.walk([&](ZeroGatherOp op) { gather = op; });
  ASSERT_TRUE(gather);
  gather->erase();
  std::string e = emit();
  EXPECT_NE(e.find("carve.zero_gather gathers 0 parameter(s); ZeRO-2 over dp = 2 needs 2"),
            std::string::npos)
      << e;
}

TEST_F(EmitterRecords, AModuleWithoutTheTailIsRefused) {
  SmallVector<Operation *> tail;
  fn.walk([&](Operation *op) {
    if (isOptimizerOp(op))
      tail.push_back(op);
  });
  ASSERT_FALSE(tail.empty());
  for (auto it = tail.rbegin(); it != tail.rend(); ++it)
    (*it)->erase();
  std::string e = emit();
  EXPECT_NE(e.find("no optimizer update"), std::string::npos) << e;
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

TEST_F(EmitterRecords, AGatherFoldOnAnOpThatIsNoGatherIsRefused) {
  Operation *exp = nullptr;
  fn.walk([&](ExpOp op) { exp = op; });
  ASSERT_TRUE(exp);
  exp->setAttr(kFoldAttr, Builder(&context).getStringAttr(kFoldGather));
  std::string e = emit();
  EXPECT_NE(e.find("carve.fold = \"gather\" on an op that is no gather"), std::string::npos) << e;
}

} // namespace
