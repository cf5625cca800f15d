//===- AnnotationTest.cpp - the partition annotation grammar and op strings ===//

#include "dialects/carve/Annotation.h"
#include "dialects/carve/CarveOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"

#include <gtest/gtest.h>

using namespace carve;

namespace {

Annotation parsed(const std::string &text) {
  Annotation a;
  std::string error;
  EXPECT_TRUE(Annotation::parse(text, a, error)) << text << ": " << error;
  return a;
}

std::string parseError(const std::string &text) {
  Annotation a;
  std::string error;
  EXPECT_FALSE(Annotation::parse(text, a, error)) << text;
  return error;
}

TEST(Annotation, MatmulMarksAndNames) {
  Annotation a = parsed("m k+, k+ n -> m n");
  ASSERT_EQ(a.operands.size(), 2u);
  ASSERT_EQ(a.results.size(), 1u);
  EXPECT_EQ(a.markOf("k"), Mark::Sum);
  EXPECT_EQ(a.markOf("m"), Mark::Plain);
  EXPECT_EQ(a.names(), (std::vector<std::string>{"m", "k", "n"}));
  std::string error;
  ASSERT_TRUE(a.bind({{4, 6}, {6, 8}}, {{4, 8}}, error)) << error;
  EXPECT_EQ(a.sizes.at("k"), 6);
  EXPECT_EQ(a.sizes.at("n"), 8);
}

TEST(Annotation, MarksOfEveryKind) {
  Annotation a = parsed("a^ b+max c~ d, () -> a^ (2 d)");
  EXPECT_EQ(a.markOf("a"), Mark::Never);
  EXPECT_EQ(a.markOf("b"), Mark::Max);
  EXPECT_EQ(a.markOf("c"), Mark::Internal);
  EXPECT_TRUE(a.operands[1].empty()); // the scalar
  ASSERT_EQ(a.results[0][1].size(), 2u);
  EXPECT_EQ(a.results[0][1][0].count, 2);
}

TEST(Annotation, GroupsBindAndLocate) {
  // A reshape [4, 16, 32] -> [4, 16, 2, 16]: the heads are the outer factor.
  Annotation a = parsed("a b (h d) -> a b h d");
  std::string error;
  ASSERT_TRUE(a.bind({{4, 16, 32}}, {{4, 16, 2, 16}}, error)) << error;
  int64_t dim = -1, outer = -1;
  ASSERT_TRUE(Annotation::find(a.operands[0], "d", dim, outer));
  EXPECT_EQ(dim, 2);
  EXPECT_EQ(outer, 2); // d sits inside 2 heads: S(2 x 2)
  ASSERT_TRUE(Annotation::find(a.operands[0], "h", dim, outer));
  EXPECT_EQ(outer, 1);
  EXPECT_FALSE(Annotation::find(a.operands[0], "z", dim, outer));
  // Three sections of a fused projection.
  Annotation s = parsed("a (3 c) -> a c");
  ASSERT_TRUE(s.bind({{4, 96}}, {{4, 32}}, error)) << error;
  EXPECT_EQ(s.sizes.at("c"), 32);
}

TEST(Annotation, GrammarErrors) {
  EXPECT_NE(parseError("a b").find("exactly one '->'"), std::string::npos);
  EXPECT_NE(parseError("a -> b -> c").find("exactly one '->'"), std::string::npos);
  EXPECT_NE(parseError("(a b -> a").find("unclosed"), std::string::npos);
  EXPECT_NE(parseError("a 3 -> a").find("inside a group"), std::string::npos);
  EXPECT_NE(parseError("a+ b, a^ -> b").find("two different marks"), std::string::npos);
  EXPECT_NE(parseError("a a -> a").find("twice in one tensor"), std::string::npos);
  EXPECT_NE(parseError("a, , b -> a").find("empty operand"), std::string::npos);
  EXPECT_NE(parseError("a -> ").find("no results"), std::string::npos);
  EXPECT_NE(parseError("a# -> a").find("unexpected '#'"), std::string::npos);
  EXPECT_NE(parseError("a () b -> a").find("empty group"), std::string::npos);
}

TEST(Annotation, BindErrors) {
  std::string error;
  Annotation a = parsed("m k+, k+ n -> m n");
  EXPECT_FALSE(a.bind({{4, 6}}, {{4, 8}}, error));
  EXPECT_NE(error.find("the op has 1 and 1"), std::string::npos) << error;
  EXPECT_FALSE(a.bind({{4, 6}, {6, 8, 1}}, {{4, 8}}, error));
  EXPECT_NE(error.find("3"), std::string::npos) << error;
  // k is 6 in one operand and 5 in the other.
  EXPECT_FALSE(a.bind({{4, 6}, {5, 8}}, {{4, 8}}, error));
  EXPECT_NE(error.find("does not match"), std::string::npos) << error;
  Annotation s = parsed("a (3 c) -> a c");
  EXPECT_FALSE(s.bind({{4, 100}}, {{4, 33}}, error));
  EXPECT_NE(error.find("not a multiple of 3"), std::string::npos) << error;
  Annotation u = parsed("a (b c) -> a");
  EXPECT_FALSE(u.bind({{4, 12}}, {{4}}, error));
  EXPECT_NE(error.find("cannot be determined"), std::string::npos) << error;
}

/// The annotation every op of a small module reports, in order.
std::vector<std::string> opAnnotations(const char *source) {
  mlir::MLIRContext ctx;
  ctx.loadDialect<CarveDialect, mlir::func::FuncDialect>();
  auto module = mlir::parseSourceString<mlir::ModuleOp>(source, &ctx);
  EXPECT_TRUE(module);
  std::vector<std::string> out;
  if (!module)
    return out;
  module->walk([&](PartitionableOpInterface op) {
    out.push_back(op.getPartitionAnnotation());
    // Every op's string parses and binds to its own shapes.
    Annotation a;
    std::string error;
    EXPECT_TRUE(Annotation::parse(out.back(), a, error)) << out.back() << ": " << error;
    std::vector<std::vector<int64_t>> ins, outs;
    for (mlir::Value v : op->getOperands()) {
      auto s = mlir::cast<mlir::RankedTensorType>(v.getType()).getShape();
      ins.emplace_back(s.begin(), s.end());
    }
    for (mlir::Value v : op->getResults()) {
      auto s = mlir::cast<mlir::RankedTensorType>(v.getType()).getShape();
      outs.emplace_back(s.begin(), s.end());
    }
    EXPECT_TRUE(a.bind(ins, outs, error)) << out.back() << ": " << error;
  });
  return out;
}

TEST(Annotation, OpStrings) {
  auto got = opAnnotations(R"mlir(
    func.func @f(%x: tensor<4x16x32xf32>, %w: tensor<32x96xf32>, %b: tensor<96xf32>,
                 %g: tensor<32xf32>, %ids: tensor<4x16xi64>, %t: tensor<64x8xf32>,
                 %l: tensor<64x64xf32>, %y: tensor<64xi64>) {
      %0 = carve.matmul %x, %w : (tensor<4x16x32xf32>, tensor<32x96xf32>) -> tensor<4x16x96xf32>
      %1 = carve.add %b, %0 : (tensor<96xf32>, tensor<4x16x96xf32>) -> tensor<4x16x96xf32>
      %2 = carve.slice %1 {starts = array<i64: 0, 0, 32>, ends = array<i64: 4, 16, 64>, steps = array<i64: 1, 1, 1>} : tensor<4x16x96xf32> -> tensor<4x16x32xf32>
      %3 = carve.reshape %2 : tensor<4x16x32xf32> -> tensor<4x16x2x16xf32>
      %4 = carve.transpose %3 {perm = array<i64: 0, 2, 1, 3>} : tensor<4x16x2x16xf32> -> tensor<4x2x16x16xf32>
      %5 = carve.layer_norm %x scale %g bias %g {axis = 2 : i64, epsilon = 1.0e-5 : f32} : (tensor<4x16x32xf32>, tensor<32xf32>, tensor<32xf32>) -> tensor<4x16x32xf32>
      %6 = carve.gather %t, %ids {axis = 0 : i64} : (tensor<64x8xf32>, tensor<4x16xi64>) -> tensor<4x16x8xf32>
      %7 = carve.cross_entropy %l, %y : (tensor<64x64xf32>, tensor<64xi64>) -> tensor<f32>
      %8 = carve.reduce_sum %x {axes = array<i64: 1>, keep_dims = false} : tensor<4x16x32xf32> -> tensor<4x32xf32>
      %9 = carve.softmax %x {axis = 2 : i64} : tensor<4x16x32xf32>
      %10 = carve.slice %x {starts = array<i64: 0, 0, 1>, ends = array<i64: 4, 16, 32>, steps = array<i64: 1, 1, 1>} : tensor<4x16x32xf32> -> tensor<4x16x31xf32>
      return
    })mlir");
  std::vector<std::string> want = {
      "d a b+, b+ c -> d a c",
      "c, a b c -> a b c",
      "a b (3 c) -> a b c",
      "a b (c d) -> a b c d",
      "a b c d -> a c b d",
      "a b c^, c^, c^ -> a b c^",
      "a+ b, c d -> c d b",
      "a^ b~, a^ -> ()",
      "a b+ c -> a c",
      "a b c^ -> a b c^",
      "a b c^ -> a b d^",
  };
  EXPECT_EQ(got, want);
}

} // namespace
