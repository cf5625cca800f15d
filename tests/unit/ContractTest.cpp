//===- ContractTest.cpp - the plan and the stage summaries on the IR ------===//

#include "dialects/carve/Contract.h"
#include "compiler/stages/StageSplit.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"

#include <gtest/gtest.h>

using namespace carve;
using namespace mlir;

namespace {

struct ContractTest : ::testing::Test {
  ContractTest() {
    context.loadDialect<func::FuncDialect>();
    module = ModuleOp::create(UnknownLoc::get(&context));
  }
  ~ContractTest() override { module->erase(); }
  /// An empty @train_step of three [4] arguments and two results, its first
  /// argument the input "x" and its second the parameter "a.weight".
  func::FuncOp step(OpBuilder &b) {
    b.setInsertionPointToEnd(module.getBody());
    auto t = RankedTensorType::get({4}, b.getF32Type());
    auto fn = func::FuncOp::create(b, b.getUnknownLoc(), "train_step",
                                   b.getFunctionType({t, t, t}, {t, t}));
    fn.setArgAttr(0, kInputAttr, b.getStringAttr("x"));
    fn.setArgAttr(1, kParamAttr, b.getStringAttr("a.weight"));
    return fn;
  }
  MLIRContext context;
  ModuleOp module;
};

TEST_F(ContractTest, PlanRoundTripsEveryField) {
  PlanAttrs p;
  p.dp = 2;
  p.tp = 4;
  p.pp = 3;
  p.zero = 2;
  p.sequenceParallel = true;
  p.microBatches = 6;
  p.virtualStages = 2;
  p.schedule = "interleaved";
  p.precision = "bf16";
  p.tf32 = true;
  p.globalBatch = 96;
  p.optimizerState = 1;
  p.cuts = {"/h.3/*", "/h.7/*"};
  p.ops = {{"/h.*/mlp/*", "replicate"}, {"/wte/*", "b"}};
  writePlan(module, p);
  FailureOr<PlanAttrs> q = readPlan(module);
  ASSERT_TRUE(succeeded(q));
  EXPECT_EQ(q->dp, 2);
  EXPECT_EQ(q->tp, 4);
  EXPECT_EQ(q->pp, 3);
  EXPECT_EQ(q->zero, 2);
  EXPECT_TRUE(q->sequenceParallel);
  EXPECT_EQ(q->microBatches, 6);
  EXPECT_EQ(q->virtualStages, 2);
  EXPECT_EQ(q->schedule, "interleaved");
  EXPECT_EQ(q->precision, "bf16");
  EXPECT_TRUE(q->tf32);
  EXPECT_EQ(q->globalBatch, 96);
  EXPECT_EQ(q->optimizerState, 1);
  EXPECT_EQ(q->cuts, p.cuts);
  EXPECT_EQ(q->ops, p.ops);
  EXPECT_EQ(q->worldSize(), 24);
  EXPECT_TRUE(q->pipelined());
}

TEST_F(ContractTest, AbsentPlanIsOneRank) {
  FailureOr<PlanAttrs> q = readPlan(module);
  ASSERT_TRUE(succeeded(q));
  EXPECT_EQ(q->worldSize(), 1);
  EXPECT_EQ(q->zero, 0);
  EXPECT_FALSE(q->pipelined());
  EXPECT_EQ(q->precision, "fp32");
  EXPECT_EQ(q->optimizerState, 2); // AdamW
}

TEST_F(ContractTest, MalformedPlanIsAnErrorNamingTheField) {
  Builder b(&context);
  std::string message;
  ScopedDiagnosticHandler handler(&context, [&](Diagnostic &d) {
    message = d.str();
    return success();
  });
  module->setAttr(kPlanAttr, b.getDictionaryAttr({b.getNamedAttr("pp", b.getStringAttr("2"))}));
  EXPECT_TRUE(failed(readPlan(module)));
  EXPECT_EQ(message, "'carve.plan' field 'pp' must be an integer >= 1");
  module->setAttr(kPlanAttr,
                  b.getDictionaryAttr({b.getNamedAttr("optimizer_state", b.getI64IntegerAttr(3))}));
  EXPECT_TRUE(failed(readPlan(module)));
  EXPECT_EQ(message, "'carve.plan' field 'optimizer_state' must be 0, 1 or 2");
  module->setAttr(kPlanAttr, b.getDictionaryAttr({b.getNamedAttr("tf32", b.getStringAttr("yes"))}));
  EXPECT_TRUE(failed(readPlan(module)));
  EXPECT_EQ(message, "'carve.plan' field 'tf32' must be a unit or bool attribute");
  module->setAttr(kPlanAttr, b.getI64IntegerAttr(3));
  EXPECT_TRUE(failed(readPlan(module)));
  EXPECT_EQ(message, "'carve.plan' must be a dictionary");
}

TEST_F(ContractTest, GradientFindsItsParameterArgument) {
  OpBuilder b(&context);
  func::FuncOp fn = step(b);
  fn.setArgAttr(1, kTrainableAttr, b.getUnitAttr());
  fn.setArgAttr(2, kParamAttr, b.getStringAttr("b.weight"));
  fn.setResultAttr(0, kOutputAttr, b.getStringAttr("loss"));
  fn.setResultAttr(1, kGradOfAttr, b.getStringAttr("b.weight"));
  EXPECT_EQ(paramArgOfGrad(fn, 1), 2u);
  EXPECT_EQ(paramArgOfGrad(fn, 0), std::nullopt);
  EXPECT_EQ(inputNameOf(fn, 0).getValue(), "x");
  EXPECT_FALSE(paramNameOf(fn, 0));
  EXPECT_TRUE(isTrainable(fn, 1));
  EXPECT_FALSE(isTrainable(fn, 2));
  // All results at once, as paramArgOfGrad one by one.
  std::vector<std::optional<unsigned>> all = paramArgsOfGrads(fn);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0], std::nullopt);
  EXPECT_EQ(all[1], 2u);
}

// Tests that ArgAttrEdits sets what it is given and keeps every other
// attribute of every argument and result, in one write.
TEST_F(ContractTest, ArgAttrEditsKeepTheOtherAttributes) {
  OpBuilder b(&context);
  func::FuncOp fn = step(b);
  fn.setResultAttr(1, kGradOfAttr, b.getStringAttr("a.weight"));
  {
    ArgAttrEdits args(fn), results(fn, /*results=*/true);
    args.set(1, kTrainableAttr, b.getUnitAttr());
    args.set(2, kPersistentOffsetAttr, b.getI64IntegerAttr(64));
    args.set(1, kPersistentOffsetAttr, b.getI64IntegerAttr(0));
    results.set(0, kOutputAttr, b.getStringAttr("loss"));
    EXPECT_FALSE(fn.getArgAttr(1, kTrainableAttr)) << "written on apply";
    args.apply();
  } // results applied by its destructor
  EXPECT_EQ(inputNameOf(fn, 0).getValue(), "x");
  EXPECT_EQ(paramNameOf(fn, 1).getValue(), "a.weight");
  EXPECT_TRUE(isTrainable(fn, 1));
  EXPECT_EQ(fn.getArgAttrOfType<IntegerAttr>(1, kPersistentOffsetAttr).getInt(), 0);
  EXPECT_EQ(fn.getArgAttrOfType<IntegerAttr>(2, kPersistentOffsetAttr).getInt(), 64);
  EXPECT_FALSE(fn.getArgAttr(0, kPersistentOffsetAttr));
  EXPECT_EQ(fn.getResultAttrOfType<StringAttr>(0, kOutputAttr).getValue(), "loss");
  EXPECT_EQ(gradOf(fn, 1).getValue(), "a.weight");
}

TEST_F(ContractTest, StageSummaryRoundTrips) {
  OpBuilder b(&context);
  b.setInsertionPointToEnd(module.getBody());
  auto fn = func::FuncOp::create(b, b.getUnknownLoc(), "stage0", b.getFunctionType({}, {}));
  EXPECT_FALSE(readStageSummary(fn).has_value());
  StageSummary st;
  st.first = "/wte/Gather";
  st.last = "/h.1/Add_1";
  st.layers = 2;
  st.forwardFlops = 1.5e9;
  st.backwardFlops = 3e9;
  st.flops = 4.5e9;
  st.paramBytes = 1 << 20;
  st.sendBytes = 4096;
  st.ops = 77;
  writeStageSummary(fn, st);
  std::optional<StageSummary> r = readStageSummary(fn);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->first, st.first);
  EXPECT_EQ(r->last, st.last);
  EXPECT_EQ(r->layers, 2);
  EXPECT_EQ(r->forwardFlops, st.forwardFlops);
  EXPECT_EQ(r->backwardFlops, st.backwardFlops);
  EXPECT_EQ(r->flops, st.flops);
  EXPECT_EQ(r->paramBytes, st.paramBytes);
  EXPECT_EQ(r->sendBytes, 4096);
  EXPECT_EQ(r->ops, 77);
  EXPECT_EQ(stageFunctions(module).size(), 1u);
}

} // namespace
