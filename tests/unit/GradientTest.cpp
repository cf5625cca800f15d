//===- GradientTest.cpp - every gradient rule against finite differences --===//
//
// Each test writes a tiny @forward in MLIR with f64 tensors whose loss is
// `reduce_sum(y * W)`, where y is the result of the op under test and W a
// fixed pseudo-random input with no zero element (so every element of y
// reaches the loss with its own weight). It builds @train_step with the
// autodiff, evaluates it with the reference interpreter (seed 1.0) and
// compares every parameter gradient with central finite differences of
// @forward.
//
//===----------------------------------------------------------------------===//

#include "compiler/autodiff/Autodiff.h"
#include "compiler/frontend/Passes.h"
#include "compiler/interp/Interpreter.h"
#include "compiler/lower/Passes.h"
#include "dialects/carve/CarveOps.h"

#include "mlir/AsmParser/AsmParser.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/Verifier.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Pass/PassManager.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <set>

using namespace mlir;
using namespace carve;

namespace {

/// The declaration of a trainable f64 (or other) parameter argument.
std::string param(const std::string &name, const std::string &type) {
  return "%" + name + ": tensor<" + type + "> {carve.param = \"" + name + "\", carve.trainable}";
}

/// The declaration of a graph input argument (not differentiated).
std::string input(const std::string &name, const std::string &type) {
  return "%" + name + ": tensor<" + type + "> {carve.input = \"" + name + "\"}";
}

/// Deterministic uniform numbers (splitmix64), the same on every platform.
struct Random {
  uint64_t state;
  explicit Random(uint64_t seed) : state(seed) {}
  double uniform(double lo, double hi) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return lo + (hi - lo) * (double)(z >> 11) * 0x1.0p-53;
  }
  /// |x| in [lo, hi] with a random sign.
  double awayFromZero(double lo, double hi) {
    double x = uniform(lo, hi);
    return uniform(0, 1) < 0.5 ? -x : x;
  }
};

uint64_t hashName(const std::string &s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s)
    h = (h ^ (uint8_t)c) * 1099511628211ull;
  return h;
}

/// The context every test parses into.
std::unique_ptr<MLIRContext> makeContext() {
  auto ctx = std::make_unique<MLIRContext>();
  ctx->loadDialect<CarveDialect, func::FuncDialect>();
  return ctx;
}

/// A gradient check of one @forward. Float arguments default to uniform
/// values in [-1, 1]; integer and i1 arguments need explicit values.
class GradCheck {
public:
  /// `args`: @forward's arguments; `body`: its ops; `out` (of type `outType`,
  /// an f64 tensor) is the value whose weighted sum is the loss.
  GradCheck(std::vector<std::string> args, std::string body, std::string out, std::string outType)
      : args(std::move(args)), body(std::move(body)), out(std::move(out)),
        outType(std::move(outType)),
        rng(hashName(::testing::UnitTest::GetInstance()->current_test_info()->name())) {}

  GradCheck &uniform(const std::string &name, double lo, double hi) {
    gens[name] = [=](Random &r) { return r.uniform(lo, hi); };
    return *this;
  }
  GradCheck &awayFromZero(const std::string &name, double lo, double hi) {
    gens[name] = [=](Random &r) { return r.awayFromZero(lo, hi); };
    return *this;
  }
  GradCheck &values(const std::string &name, std::vector<double> v) {
    fixed[name] = std::move(v);
    return *this;
  }
  /// A fixed absolute finite-difference step instead of 1e-6 * max(1, |x|).
  GradCheck &step(double h) {
    fixedStep = h;
    return *this;
  }

  /// Runs carve-lower-convolutions on @forward before autodiff (conv2d and
  /// max_pool2d train as the ops it writes).
  GradCheck &lowered() {
    lower = true;
    return *this;
  }
  /// The module's carve.plan dictionary (e.g. "{sync_batch_norm}").
  GradCheck &plan(std::string dict) {
    planDict = std::move(dict);
    return *this;
  }

  /// The module text the check parses.
  std::string text() const {
    std::string sig;
    for (const std::string &a : args)
      sig += a + ", ";
    sig += input("loss_weights", outType);
    std::string fn = "func.func @forward(" + sig +
                     ") -> (tensor<f64> {carve.output = \"loss\"}) {\n" + body + "\n" + lossTail +
                     "}\n";
    return planDict.empty() ? fn
                            : "module attributes {carve.plan = " + planDict + "} {\n" + fn + "}\n";
  }

  void run() {
    auto ctx = makeContext();
    Type ot = parseType("tensor<" + outType + ">", ctx.get());
    ASSERT_TRUE(ot) << "bad output type " << outType;
    buildLossTail(cast<RankedTensorType>(ot));
    std::string src = text();
    OwningOpRef<ModuleOp> module = parseSourceString<ModuleOp>(src, ctx.get());
    ASSERT_TRUE(module) << "cannot parse:\n" << src;
    if (lower) {
      PassManager pm(ctx.get());
      pm.addNestedPass<func::FuncOp>(createCarveLowerConvolutions());
      ASSERT_TRUE(succeeded(pm.run(*module))) << "carve-lower-convolutions failed";
    }
    auto fwd = module->lookupSymbol<func::FuncOp>("forward");

    // Argument values by their carve.param / carve.input name.
    std::vector<HostValue> fargs;
    std::vector<std::string> names;
    for (BlockArgument a : fwd.getArguments()) {
      unsigned i = a.getArgNumber();
      auto name = fwd.getArgAttrOfType<StringAttr>(i, "carve.param");
      if (!name)
        name = fwd.getArgAttrOfType<StringAttr>(i, "carve.input");
      ASSERT_TRUE(name) << "argument " << i << " has no name";
      auto type = cast<RankedTensorType>(a.getType());
      std::vector<double> v;
      if (fixed.count(name.str())) {
        v = fixed[name.str()];
        ASSERT_EQ((int64_t)v.size(), type.getNumElements()) << "values of " << name.str();
      } else {
        ASSERT_TRUE(isa<FloatType>(type.getElementType()))
            << "integer argument " << name.str() << " needs explicit values";
        auto gen =
            gens.count(name.str()) ? gens[name.str()] : [](Random &r) { return r.uniform(-1, 1); };
        if (name.str() == "loss_weights")
          gen = [](Random &r) { return r.awayFromZero(0.5, 1.5); };
        for (int64_t k = 0; k < type.getNumElements(); ++k)
          v.push_back(gen(rng));
      }
      fargs.push_back(HostValue::fromDoubles(type, v));
      names.push_back(name.str());
    }

    std::string error;
    ASSERT_TRUE(buildTrainingStep(*module, AutodiffOptions(), error)) << error << "\n" << src;
    auto step = module->lookupSymbol<func::FuncOp>("train_step");
    ASSERT_TRUE(succeeded(verify(*module))) << "the training step does not verify";

    std::vector<HostValue> sargs = fargs;
    sargs.push_back(
        HostValue::fromDoubles(RankedTensorType::get({}, Float64Type::get(ctx.get())), {1.0}));
    std::vector<HostValue> sres;
    ASSERT_TRUE(interpret(step, sargs, sres, error)) << error;
    double loss0 = forwardLoss(fwd, fargs);
    ASSERT_FALSE(::testing::Test::HasFailure());
    EXPECT_EQ(sres[0].toDoubles()[0], loss0) << "train_step's loss differs from @forward's";

    std::map<std::string, std::vector<double>> grads;
    for (unsigned r = 1; r < step.getNumResults(); ++r) {
      auto of = step.getResultAttrOfType<StringAttr>(r, kGradOfAttr);
      ASSERT_TRUE(of) << "result " << r << " has no " << kGradOfAttr;
      grads[of.str()] = sres[r].toDoubles();
    }
    auto unusedAttr = step->getAttrOfType<ArrayAttr>(kUnusedParamsAttr);
    std::set<std::string> unused;
    for (Attribute a : unusedAttr)
      unused.insert(cast<StringAttr>(a).str());

    int64_t checked = 0;
    double worst = 0;
    for (BlockArgument a : fwd.getArguments()) {
      unsigned i = a.getArgNumber();
      if (!fwd.getArgAttr(i, "carve.trainable"))
        continue;
      const std::string &name = names[i];
      std::vector<double> g;
      if (grads.count(name)) {
        g = grads[name];
      } else {
        EXPECT_TRUE(unused.count(name)) << "no gradient for '" << name << "'";
        g.assign(fargs[i].numElements(), 0.0);
      }
      std::vector<double> fd = finiteDifferences(fwd, fargs, i);
      ASSERT_FALSE(::testing::Test::HasFailure());
      ASSERT_EQ(g.size(), fd.size());
      double maxErr = 0, maxGrad = 0;
      size_t at = 0;
      for (size_t k = 0; k < g.size(); ++k) {
        maxGrad = std::max(maxGrad, std::fabs(g[k]));
        double e = std::fabs(g[k] - fd[k]);
        if (!(e <= maxErr)) { // NaN counts as the worst
          maxErr = e;
          at = k;
        }
      }
      // Central differences in float64 err by O(h^2 f''') from truncation
      // (h = 1e-6: ~1e-12) plus O(eps |f| / h) from rounding (~1e-10 for
      // these losses of magnitude ~1-10). A wrong rule errs by O(|grad|), so
      // 1e-6 relative to the largest gradient separates the two by orders of
      // magnitude on both sides.
      double tol = 1e-6 * std::max(1.0, maxGrad);
      EXPECT_LE(maxErr, tol) << "gradient of '" << name << "' element " << at << ": analytic "
                             << g[at] << ", finite differences " << fd[at] << "\n"
                             << src;
      checked += (int64_t)g.size();
      worst = std::max(worst, maxErr);
    }
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3g", worst);
    ::testing::Test::RecordProperty("checked_elements", (int)checked);
    ::testing::Test::RecordProperty("max_abs_error", buf);
    trainStep = std::move(module);
    context = std::move(ctx);
  }

  /// After run(): the module holding @forward and @train_step.
  ModuleOp module() { return *trainStep; }

private:
  std::vector<std::string> args;
  std::string body, out, outType, lossTail;
  Random rng;
  std::map<std::string, std::function<double(Random &)>> gens;
  std::map<std::string, std::vector<double>> fixed;
  double fixedStep = 0;
  bool lower = false;
  std::string planDict;
  std::unique_ptr<MLIRContext> context;
  OwningOpRef<ModuleOp> trainStep;

  void buildLossTail(RankedTensorType t) {
    std::string ty = "tensor<" + outType + ">";
    lossTail = "  %weighted = carve.mul " + out + ", %loss_weights : (" + ty + ", " + ty + ") -> " +
               ty + "\n";
    if (t.getRank() == 0) {
      lossTail += "  return %weighted : tensor<f64>\n";
      return;
    }
    std::string axes;
    for (int64_t k = 0; k < t.getRank(); ++k)
      axes += (k ? ", " : "") + std::to_string(k);
    lossTail += "  %loss = carve.reduce_sum %weighted {axes = array<i64: " + axes +
                ">, keep_dims = false} : " + ty + " -> tensor<f64>\n" +
                "  return %loss : tensor<f64>\n";
  }

  double forwardLoss(func::FuncOp fwd, const std::vector<HostValue> &fargs) {
    std::vector<HostValue> res;
    std::string error;
    bool ok = interpret(fwd, fargs, res, error);
    EXPECT_TRUE(ok) << error;
    return ok ? res[0].toDoubles()[0] : NAN;
  }

  /// d loss / d argument `i`, element by element, by central differences.
  /// The step actually taken is read back from the argument's storage, so
  /// f32 parameters are differenced correctly too.
  std::vector<double> finiteDifferences(func::FuncOp fwd, std::vector<HostValue> fargs,
                                        unsigned i) {
    HostValue base = fargs[i];
    std::vector<double> x = base.toDoubles(), fd(x.size());
    for (size_t k = 0; k < x.size(); ++k) {
      double h = fixedStep ? fixedStep : 1e-6 * std::max(1.0, std::fabs(x[k]));
      std::vector<double> xp = x, xm = x;
      xp[k] += h;
      xm[k] -= h;
      fargs[i] = HostValue::fromDoubles(base.type, xp);
      double up = fargs[i].toDoubles()[k], fp = forwardLoss(fwd, fargs);
      fargs[i] = HostValue::fromDoubles(base.type, xm);
      double down = fargs[i].toDoubles()[k], fm = forwardLoss(fwd, fargs);
      fd[k] = (fp - fm) / (up - down);
    }
    return fd;
  }
};

//===--- Elementwise binary ops (with broadcasting) ------------------------===//

TEST(Gradient, Add) {
  GradCheck({param("a", "3x4xf64"), param("b", "4xf64")},
            "%y = carve.add %a, %b : (tensor<3x4xf64>, tensor<4xf64>) -> tensor<3x4xf64>", "%y",
            "3x4xf64")
      .run();
}

TEST(Gradient, Sub) {
  GradCheck({param("a", "3x1xf64"), param("b", "1x4xf64")},
            "%y = carve.sub %a, %b : (tensor<3x1xf64>, tensor<1x4xf64>) -> tensor<3x4xf64>", "%y",
            "3x4xf64")
      .run();
}

TEST(Gradient, Mul) {
  GradCheck({param("a", "2x3x4xf64"), param("b", "3x1xf64")},
            "%y = carve.mul %a, %b : (tensor<2x3x4xf64>, tensor<3x1xf64>) -> tensor<2x3x4xf64>",
            "%y", "2x3x4xf64")
      .run();
}

TEST(Gradient, MulSameValueTwice) {
  GradCheck({param("a", "3x4xf64")},
            "%y = carve.mul %a, %a : (tensor<3x4xf64>, tensor<3x4xf64>) -> tensor<3x4xf64>", "%y",
            "3x4xf64")
      .run();
}

TEST(Gradient, Div) {
  GradCheck({param("a", "3x4xf64"), param("b", "4xf64")},
            "%y = carve.div %a, %b : (tensor<3x4xf64>, tensor<4xf64>) -> tensor<3x4xf64>", "%y",
            "3x4xf64")
      .awayFromZero("b", 0.5, 1.5)
      .run();
}

TEST(Gradient, Pow) {
  GradCheck({param("a", "3x4xf64"), param("b", "3x4xf64")},
            "%y = carve.pow %a, %b : (tensor<3x4xf64>, tensor<3x4xf64>) -> tensor<3x4xf64>", "%y",
            "3x4xf64")
      .uniform("a", 0.5, 2.0)
      .uniform("b", -1.5, 1.5)
      .run();
}

// A constant integral exponent with negative bases: the exponent's gradient
// (log of a negative base, NaN) is built but must not reach anything.
TEST(Gradient, PowConstantExponent) {
  GradCheck({param("a", "3x4xf64")},
            "%e = carve.constant dense<3.0> : tensor<f64>\n"
            "%y = carve.pow %a, %e : (tensor<3x4xf64>, tensor<f64>) -> tensor<3x4xf64>",
            "%y", "3x4xf64")
      .run();
}

TEST(Gradient, Maximum) {
  GradCheck({param("a", "3x4xf64"), param("b", "4xf64")},
            "%y = carve.maximum %a, %b : (tensor<3x4xf64>, tensor<4xf64>) -> tensor<3x4xf64>", "%y",
            "3x4xf64")
      .run();
}

TEST(Gradient, Minimum) {
  GradCheck({param("a", "3x4xf64"), param("b", "4xf64")},
            "%y = carve.minimum %a, %b : (tensor<3x4xf64>, tensor<4xf64>) -> tensor<3x4xf64>", "%y",
            "3x4xf64")
      .run();
}

// At a tie the central difference of max(a, b) in a is exactly 1/2, which is
// PyTorch's even split that the rule implements.
TEST(Gradient, MaximumAndMinimumTies) {
  std::vector<double> a = {0.5, -0.25, 1.0, 0.75, -1.0, 0.125};
  std::vector<double> b = {0.5, 0.3, 1.0, -0.6, -1.0, 0.9};
  GradCheck({param("a", "6xf64"), param("b", "6xf64")},
            "%mx = carve.maximum %a, %b : (tensor<6xf64>, tensor<6xf64>) -> tensor<6xf64>\n"
            "%mn = carve.minimum %a, %b : (tensor<6xf64>, tensor<6xf64>) -> tensor<6xf64>\n"
            "%two = carve.constant dense<2.0> : tensor<f64>\n"
            "%mn2 = carve.mul %mn, %two : (tensor<6xf64>, tensor<f64>) -> tensor<6xf64>\n"
            "%y = carve.add %mx, %mn2 : (tensor<6xf64>, tensor<6xf64>) -> tensor<6xf64>",
            "%y", "6xf64")
      .values("a", a)
      .values("b", b)
      .run();
}

//===--- Elementwise unary ops ---------------------------------------------===//

/// `%y = carve.OP %x` on a [3, 4] parameter with values drawn by `range`.
void checkUnary(const std::string &op, const std::string &attrs,
                std::function<void(GradCheck &)> range = nullptr) {
  GradCheck c({param("x", "3x4xf64")}, "%y = carve." + op + " %x " + attrs + ": tensor<3x4xf64>",
              "%y", "3x4xf64");
  c.uniform("x", -2, 2);
  if (range)
    range(c);
  c.run();
}

TEST(Gradient, Neg) { checkUnary("neg", ""); }
TEST(Gradient, Abs) {
  checkUnary("abs", "", [](GradCheck &c) { c.awayFromZero("x", 0.1, 2); });
}
TEST(Gradient, Exp) { checkUnary("exp", ""); }
TEST(Gradient, Log) {
  checkUnary("log", "", [](GradCheck &c) { c.uniform("x", 0.2, 3); });
}
TEST(Gradient, Sqrt) {
  checkUnary("sqrt", "", [](GradCheck &c) { c.uniform("x", 0.2, 3); });
}
TEST(Gradient, Rsqrt) {
  checkUnary("rsqrt", "", [](GradCheck &c) { c.uniform("x", 0.2, 3); });
}
TEST(Gradient, Reciprocal) {
  checkUnary("reciprocal", "", [](GradCheck &c) { c.awayFromZero("x", 0.3, 2); });
}
TEST(Gradient, Tanh) { checkUnary("tanh", ""); }
TEST(Gradient, Erf) { checkUnary("erf", ""); }
TEST(Gradient, Sigmoid) { checkUnary("sigmoid", ""); }
TEST(Gradient, Relu) {
  checkUnary("relu", "", [](GradCheck &c) { c.awayFromZero("x", 0.1, 2); });
}
TEST(Gradient, Sin) { checkUnary("sin", ""); }
TEST(Gradient, Cos) { checkUnary("cos", ""); }
TEST(Gradient, Silu) { checkUnary("silu", ""); }
TEST(Gradient, Gelu) { checkUnary("gelu", ""); }
TEST(Gradient, GeluErfExplicit) { checkUnary("gelu", "{approximate = \"none\"} "); }
TEST(Gradient, GeluTanh) { checkUnary("gelu", "{approximate = \"tanh\"} "); }
// The mask is fixed for a step (seed 0, step 0 in the interpreter), so the
// gradient is the same mask and scale on dy. Both branches are checked: node
// 3's mask keeps 8 of the 12 elements at p = 0.5, node 7's 22 of 32 at p = 0.25
// (tests/e2e/philox.py computes them).
TEST(Gradient, Dropout) { checkUnary("dropout", "{p = 0.5 : f64, node = 3 : i64} "); }
TEST(Gradient, DropoutThenTanh) {
  GradCheck c({param("x", "4x8xf64")},
              "%d = carve.dropout %x {p = 0.25 : f64, node = 7 : i64} : tensor<4x8xf64>\n"
              "%y = carve.tanh %d : tensor<4x8xf64>",
              "%y", "4x8xf64");
  c.uniform("x", -2, 2);
  c.run();
}

//===--- Select and cast ---------------------------------------------------===//

TEST(Gradient, Where) {
  GradCheck({input("c", "3x4xi1"), param("a", "3x4xf64"), param("b", "4xf64")},
            "%y = carve.where %c, %a, %b : (tensor<3x4xi1>, tensor<3x4xf64>, tensor<4xf64>) "
            "-> tensor<3x4xf64>",
            "%y", "3x4xf64")
      .values("c", {1, 0, 0, 1, 0, 1, 1, 0, 1, 1, 0, 0})
      .run();
}

TEST(Gradient, WhereOnComputedCondition) {
  GradCheck({param("a", "3x4xf64"), param("b", "3x4xf64")},
            "%c = carve.less %a, %b : (tensor<3x4xf64>, tensor<3x4xf64>) -> tensor<3x4xi1>\n"
            "%e = carve.exp %a : tensor<3x4xf64>\n"
            "%y = carve.where %c, %e, %b : (tensor<3x4xi1>, tensor<3x4xf64>, tensor<3x4xf64>) "
            "-> tensor<3x4xf64>",
            "%y", "3x4xf64")
      .run();
}

TEST(Gradient, CastF64ToF64) {
  GradCheck({param("x", "3x4xf64")},
            "%c = carve.cast %x : tensor<3x4xf64> -> tensor<3x4xf64>\n"
            "%y = carve.mul %c, %c : (tensor<3x4xf64>, tensor<3x4xf64>) -> tensor<3x4xf64>",
            "%y", "3x4xf64")
      .run();
}

// An f32 parameter: the finite differences use the f32-rounded steps; the
// rule's gradient is rounded to f32 (relative error 6e-8, inside the bound).
TEST(Gradient, CastF32ToF64) {
  GradCheck({param("x", "3x4xf32")},
            "%c = carve.cast %x : tensor<3x4xf32> -> tensor<3x4xf64>\n"
            "%y = carve.mul %c, %c : (tensor<3x4xf64>, tensor<3x4xf64>) -> tensor<3x4xf64>",
            "%y", "3x4xf64")
      .step(0x1p-10)
      .run();
}

// f64 -> f32 -> f64 on multiples of 2^-6 with the step 2^-10: every
// perturbed value is exact in f32, and the loss is quadratic, so the central
// difference is exact up to rounding.
TEST(Gradient, CastF64ToF32AndBack) {
  std::vector<double> x;
  Random r(7);
  for (int k = 0; k < 12; ++k)
    x.push_back(std::round(r.uniform(-64, 64)) / 64);
  GradCheck({param("x", "3x4xf64")},
            "%s = carve.cast %x : tensor<3x4xf64> -> tensor<3x4xf32>\n"
            "%c = carve.cast %s : tensor<3x4xf32> -> tensor<3x4xf64>\n"
            "%y = carve.mul %c, %c : (tensor<3x4xf64>, tensor<3x4xf64>) -> tensor<3x4xf64>",
            "%y", "3x4xf64")
      .values("x", x)
      .step(0x1p-10)
      .run();
}

//===--- Matmul ------------------------------------------------------------===//

TEST(Gradient, Matmul2D) {
  GradCheck({param("a", "3x4xf64"), param("b", "4x5xf64")},
            "%y = carve.matmul %a, %b : (tensor<3x4xf64>, tensor<4x5xf64>) -> tensor<3x5xf64>",
            "%y", "3x5xf64")
      .run();
}

TEST(Gradient, MatmulBatched) {
  GradCheck({param("a", "2x3x4xf64"), param("b", "2x4x5xf64")},
            "%y = carve.matmul %a, %b : (tensor<2x3x4xf64>, tensor<2x4x5xf64>) "
            "-> tensor<2x3x5xf64>",
            "%y", "2x3x5xf64")
      .run();
}

// [B, T, K] @ [K, N]: the weight gradient folds the batch into one GEMM.
TEST(Gradient, MatmulSharedWeight) {
  GradCheck({param("a", "2x3x4xf64"), param("b", "4x5xf64")},
            "%y = carve.matmul %a, %b : (tensor<2x3x4xf64>, tensor<4x5xf64>) "
            "-> tensor<2x3x5xf64>",
            "%y", "2x3x5xf64")
      .run();
}

TEST(Gradient, MatmulBroadcastBatchBothSides) {
  GradCheck({param("a", "2x1x3x4xf64"), param("b", "3x4x5xf64")},
            "%y = carve.matmul %a, %b : (tensor<2x1x3x4xf64>, tensor<3x4x5xf64>) "
            "-> tensor<2x3x3x5xf64>",
            "%y", "2x3x3x5xf64")
      .run();
}

TEST(Gradient, MatmulMatrixTimesBatch) {
  GradCheck({param("a", "3x4xf64"), param("b", "2x4x5xf64")},
            "%y = carve.matmul %a, %b : (tensor<3x4xf64>, tensor<2x4x5xf64>) "
            "-> tensor<2x3x5xf64>",
            "%y", "2x3x5xf64")
      .run();
}

//===--- Reductions --------------------------------------------------------===//

TEST(Gradient, ReduceSumKeepDims) {
  GradCheck({param("x", "2x3x4xf64")},
            "%y = carve.reduce_sum %x {axes = array<i64: 1>, keep_dims = true} "
            ": tensor<2x3x4xf64> -> tensor<2x1x4xf64>",
            "%y", "2x1x4xf64")
      .run();
}

TEST(Gradient, ReduceSumDropDims) {
  GradCheck({param("x", "2x3x4xf64")},
            "%y = carve.reduce_sum %x {axes = array<i64: 0, 2>, keep_dims = false} "
            ": tensor<2x3x4xf64> -> tensor<3xf64>",
            "%y", "3xf64")
      .run();
}

TEST(Gradient, ReduceMean) {
  GradCheck({param("x", "2x3x4xf64")},
            "%y = carve.reduce_mean %x {axes = array<i64: 2>, keep_dims = false} "
            ": tensor<2x3x4xf64> -> tensor<2x3xf64>",
            "%y", "2x3xf64")
      .run();
}

TEST(Gradient, ReduceMeanToScalar) {
  GradCheck({param("x", "2x3x4xf64")},
            "%y = carve.reduce_mean %x {axes = array<i64: 0, 1, 2>, keep_dims = false} "
            ": tensor<2x3x4xf64> -> tensor<f64>",
            "%y", "f64")
      .run();
}

TEST(Gradient, ReduceMax) {
  GradCheck({param("x", "2x3x4xf64")},
            "%y = carve.reduce_max %x {axes = array<i64: 1>, keep_dims = true} "
            ": tensor<2x3x4xf64> -> tensor<2x1x4xf64>",
            "%y", "2x1x4xf64")
      .run();
}

// Two equal maxima share the gradient; the central difference at the tie is 1/2.
TEST(Gradient, ReduceMaxTies) {
  GradCheck({param("x", "2x3xf64")},
            "%y = carve.reduce_max %x {axes = array<i64: 1>, keep_dims = false} "
            ": tensor<2x3xf64> -> tensor<2xf64>",
            "%y", "2xf64")
      .values("x", {0.5, 0.5, -0.25, 0.1, 0.9, 0.3})
      .run();
}

//===--- Softmax and normalizations ----------------------------------------===//

TEST(Gradient, SoftmaxLastAxis) {
  GradCheck({param("x", "2x3x4xf64")}, "%y = carve.softmax %x {axis = 2 : i64} : tensor<2x3x4xf64>",
            "%y", "2x3x4xf64")
      .run();
}

TEST(Gradient, SoftmaxMiddleAxis) {
  GradCheck({param("x", "2x3x4xf64")}, "%y = carve.softmax %x {axis = 1 : i64} : tensor<2x3x4xf64>",
            "%y", "2x3x4xf64")
      .run();
}

TEST(Gradient, LogSoftmaxLastAxis) {
  GradCheck({param("x", "2x3x4xf64")},
            "%y = carve.log_softmax %x {axis = 2 : i64} : tensor<2x3x4xf64>", "%y", "2x3x4xf64")
      .run();
}

TEST(Gradient, LogSoftmaxFirstAxis) {
  GradCheck({param("x", "2x3x4xf64")},
            "%y = carve.log_softmax %x {axis = 0 : i64} : tensor<2x3x4xf64>", "%y", "2x3x4xf64")
      .run();
}

TEST(Gradient, LayerNormScaleBias) {
  GradCheck({param("x", "2x3x4xf64"), param("g", "4xf64"), param("b", "4xf64")},
            "%y = carve.layer_norm %x scale %g bias %b {axis = 2 : i64, epsilon = 9.99999974E-6 "
            ": f32} : (tensor<2x3x4xf64>, tensor<4xf64>, tensor<4xf64>) -> tensor<2x3x4xf64>",
            "%y", "2x3x4xf64")
      .run();
}

TEST(Gradient, LayerNormPlain) {
  GradCheck({param("x", "2x3x4xf64")},
            "%y = carve.layer_norm %x {axis = 2 : i64, epsilon = 9.99999974E-6 : f32} "
            ": (tensor<2x3x4xf64>) -> tensor<2x3x4xf64>",
            "%y", "2x3x4xf64")
      .run();
}

TEST(Gradient, LayerNormTwoAxesScaleOnly) {
  GradCheck({param("x", "2x3x4xf64"), param("g", "3x4xf64")},
            "%y = carve.layer_norm %x scale %g {axis = 1 : i64, epsilon = 9.99999974E-6 : f32} "
            ": (tensor<2x3x4xf64>, tensor<3x4xf64>) -> tensor<2x3x4xf64>",
            "%y", "2x3x4xf64")
      .run();
}

TEST(Gradient, LayerNormBiasOnly) {
  GradCheck({param("x", "2x3x4xf64"), param("b", "4xf64")},
            "%y = carve.layer_norm %x bias %b {axis = 2 : i64, epsilon = 9.99999974E-6 : f32} "
            ": (tensor<2x3x4xf64>, tensor<4xf64>) -> tensor<2x3x4xf64>",
            "%y", "2x3x4xf64")
      .run();
}

TEST(Gradient, RmsNormScale) {
  GradCheck({param("x", "2x3x4xf64"), param("g", "4xf64")},
            "%y = carve.rms_norm %x scale %g {axis = 2 : i64, epsilon = 9.99999997E-7 : f32} "
            ": (tensor<2x3x4xf64>, tensor<4xf64>) -> tensor<2x3x4xf64>",
            "%y", "2x3x4xf64")
      .run();
}

TEST(Gradient, RmsNormPlain) {
  GradCheck({param("x", "2x3x4xf64")},
            "%y = carve.rms_norm %x {axis = 1 : i64, epsilon = 9.99999997E-7 : f32} "
            ": (tensor<2x3x4xf64>) -> tensor<2x3x4xf64>",
            "%y", "2x3x4xf64")
      .run();
}

//===--- Attention ---------------------------------------------------------===//

const char *kQkv = "tensor<2x2x3x4xf64>";

std::string attentionBody(const std::string &extra, const std::string &attrs,
                          const std::string &maskType) {
  std::string t = kQkv;
  return "%y = carve.attention %q, %k, %v" + extra + " {" + attrs + "} : (" + t + ", " + t + ", " +
         t + (maskType.empty() ? "" : ", " + maskType) + ") -> " + t;
}

TEST(Gradient, AttentionCausal) {
  GradCheck({param("q", "2x2x3x4xf64"), param("k", "2x2x3x4xf64"), param("v", "2x2x3x4xf64")},
            attentionBody("", "causal = true, scale = 5.000000e-01 : f32", ""), "%y", "2x2x3x4xf64")
      .run();
}

TEST(Gradient, AttentionAdditiveMask) {
  GradCheck({param("q", "2x2x3x4xf64"), param("k", "2x2x3x4xf64"), param("v", "2x2x3x4xf64"),
             input("m", "2x1x1x3xf64")},
            attentionBody(" mask %m", "scale = 5.000000e-01 : f32", "tensor<2x1x1x3xf64>"), "%y",
            "2x2x3x4xf64")
      .values("m", {0, -1.5, 0, -3, 0, 0})
      .run();
}

TEST(Gradient, AttentionCausalWithMask) {
  GradCheck(
      {param("q", "2x2x3x4xf64"), param("k", "2x2x3x4xf64"), param("v", "2x2x3x4xf64"),
       input("m", "3x3xf64")},
      attentionBody(" mask %m", "causal = true, scale = 5.000000e-01 : f32", "tensor<3x3xf64>"),
      "%y", "2x2x3x4xf64")
      .uniform("m", -1, 0)
      .run();
}

TEST(Gradient, AttentionNonCausalCrossLengths) {
  GradCheck({param("q", "2x3x4xf64"), param("k", "2x5x4xf64"), param("v", "2x5x6xf64")},
            "%y = carve.attention %q, %k, %v {scale = 7.500000e-01 : f32} : (tensor<2x3x4xf64>, "
            "tensor<2x5x4xf64>, tensor<2x5x6xf64>) -> tensor<2x3x6xf64>",
            "%y", "2x3x6xf64")
      .run();
}

//===--- Cross-entropy -----------------------------------------------------===//

void checkCrossEntropy(const std::string &attrs, const std::string &outType,
                       std::vector<double> targets) {
  GradCheck({param("l", "4x5xf64"), input("t", "4xi64")},
            "%y = carve.cross_entropy %l, %t {" + attrs +
                "} : (tensor<4x5xf64>, tensor<4xi64>) -> tensor<" + outType + ">",
            "%y", outType)
      .uniform("l", -2, 2)
      .values("t", std::move(targets))
      .run();
}

TEST(Gradient, CrossEntropyMean) { checkCrossEntropy("reduction = \"mean\"", "f64", {1, 0, 4, 1}); }
TEST(Gradient, CrossEntropySum) { checkCrossEntropy("reduction = \"sum\"", "f64", {1, 0, 4, 1}); }
TEST(Gradient, CrossEntropyNone) {
  checkCrossEntropy("reduction = \"none\"", "4xf64", {1, 0, 4, 1});
}
TEST(Gradient, CrossEntropyMeanIgnoreIndex) {
  checkCrossEntropy("ignore_index = -100 : i64, reduction = \"mean\"", "f64", {1, -100, 4, -100});
}
TEST(Gradient, CrossEntropySumIgnoreIndex) {
  checkCrossEntropy("ignore_index = 3 : i64, reduction = \"sum\"", "f64", {3, 2, 4, 3});
}
TEST(Gradient, CrossEntropyNoneIgnoreIndex) {
  checkCrossEntropy("ignore_index = -1 : i64, reduction = \"none\"", "4xf64", {0, -1, 2, 2});
}

// Logits [N, C, d]: the class is dimension 1.
TEST(Gradient, CrossEntropySpatial) {
  GradCheck({param("l", "2x3x4xf64"), input("t", "2x4xi64")},
            "%y = carve.cross_entropy %l, %t {ignore_index = -100 : i64, reduction = \"mean\"} "
            ": (tensor<2x3x4xf64>, tensor<2x4xi64>) -> tensor<f64>",
            "%y", "f64")
      .values("t", {0, 2, 1, -100, 2, 2, 0, 1})
      .run();
}

//===--- Data movement -----------------------------------------------------===//

TEST(Gradient, Reshape) {
  GradCheck({param("x", "3x4xf64")},
            "%r = carve.reshape %x : tensor<3x4xf64> -> tensor<2x6xf64>\n"
            "%y = carve.tanh %r : tensor<2x6xf64>",
            "%y", "2x6xf64")
      .run();
}

TEST(Gradient, Transpose) {
  GradCheck({param("x", "2x3x4xf64")},
            "%y = carve.transpose %x {perm = array<i64: 2, 0, 1>} : tensor<2x3x4xf64> "
            "-> tensor<4x2x3xf64>",
            "%y", "4x2x3xf64")
      .run();
}

TEST(Gradient, SliceWithSteps) {
  GradCheck({param("x", "5x6xf64")},
            "%y = carve.slice %x {ends = array<i64: 5, 6>, starts = array<i64: 1, 0>, "
            "steps = array<i64: 2, 3>} : tensor<5x6xf64> -> tensor<2x2xf64>",
            "%y", "2x2xf64")
      .run();
}

TEST(Gradient, SliceContiguous) {
  GradCheck({param("x", "2x4x6xf64")},
            "%y = carve.slice %x {ends = array<i64: 2, 3, 5>, starts = array<i64: 0, 1, 2>, "
            "steps = array<i64: 1, 1, 1>} : tensor<2x4x6xf64> -> tensor<2x2x3xf64>",
            "%y", "2x2x3xf64")
      .run();
}

TEST(Gradient, Concat) {
  GradCheck({param("a", "2x1x3xf64"), param("b", "2x2x3xf64"), param("c", "2x3x3xf64")},
            "%y = carve.concat %a, %b, %c {axis = 1 : i64} : (tensor<2x1x3xf64>, "
            "tensor<2x2x3xf64>, tensor<2x3x3xf64>) -> tensor<2x6x3xf64>",
            "%y", "2x6x3xf64")
      .run();
}

// An embedding lookup with repeated rows (0 twice; -1 and 5 are the same row).
TEST(Gradient, GatherEmbedding) {
  GradCheck({param("wte", "6x3xf64"), input("ids", "2x3xi64")},
            "%y = carve.gather %wte, %ids {axis = 0 : i64} : (tensor<6x3xf64>, tensor<2x3xi64>) "
            "-> tensor<2x3x3xf64>",
            "%y", "2x3x3xf64")
      .values("ids", {0, 5, -1, 2, 0, 3})
      .run();
}

TEST(Gradient, GatherAxis1) {
  GradCheck({param("x", "3x5xf64"), input("i", "4xi64")},
            "%y = carve.gather %x, %i {axis = 1 : i64} : (tensor<3x5xf64>, tensor<4xi64>) "
            "-> tensor<3x4xf64>",
            "%y", "3x4xf64")
      .values("i", {4, -2, 0, 4})
      .run();
}

TEST(Gradient, GatherScalarIndex) {
  GradCheck({param("x", "3x5xf64"), input("i", "i64")},
            "%y = carve.gather %x, %i {axis = 1 : i64} : (tensor<3x5xf64>, tensor<i64>) "
            "-> tensor<3xf64>",
            "%y", "3xf64")
      .values("i", {-4})
      .run();
}

// gather_grad is also ScatterElements' import (index_add_): its gradient with
// respect to the scattered rows is the gather by the same indices, repeated
// positions included.
TEST(Gradient, GatherGradScatterAdd) {
  GradCheck({param("u", "4x3xf64"), input("i", "4xi64")},
            "%y = carve.gather_grad %u, %i {axis = 0 : i64} : (tensor<4x3xf64>, tensor<4xi64>) "
            "-> tensor<5x3xf64>",
            "%y", "5x3xf64")
      .values("i", {3, 0, 3, -1})
      .run();
}

// The routed rows of a mixture of experts as the importer builds them
// (compiler/frontend/Bounded.cpp): NonZero at its bound, the rows gathered
// (the padding gathers row 0), an expert's work on every row, the padding
// masked by the count, and the scatter back. The gradients of the table and
// of the expert's weight must be those of the real rows only.
TEST(Gradient, NonzeroRoutedRows) {
  GradCheck({param("x", "6x3xf64"), param("w", "3xf64"), input("m", "6xi1")},
            "%p = carve.nonzero %m : (tensor<6xi1>) -> tensor<1x6xi64>\n"
            "%i = carve.reshape %p : tensor<1x6xi64> -> tensor<6xi64>\n"
            "%rows = carve.gather %x, %i {axis = 0 : i64} : (tensor<6x3xf64>, tensor<6xi64>) "
            "-> tensor<6x3xf64>\n"
            "%h = carve.mul %rows, %w : (tensor<6x3xf64>, tensor<3xf64>) -> tensor<6x3xf64>\n"
            "%t = carve.tanh %h : tensor<6x3xf64>\n"
            "%f = carve.cast %m : tensor<6xi1> -> tensor<6xf64>\n"
            "%c = carve.reduce_sum %f {axes = array<i64: 0>, keep_dims = false} : "
            "tensor<6xf64> -> tensor<f64>\n"
            "%iota = carve.constant dense<[[0.0], [1.0], [2.0], [3.0], [4.0], [5.0]]> : "
            "tensor<6x1xf64>\n"
            "%keep = carve.less %iota, %c : (tensor<6x1xf64>, tensor<f64>) -> tensor<6x1xi1>\n"
            "%z = carve.constant dense<0.0> : tensor<f64>\n"
            "%k = carve.where %keep, %t, %z : (tensor<6x1xi1>, tensor<6x3xf64>, tensor<f64>) "
            "-> tensor<6x3xf64>\n"
            "%y = carve.gather_grad %k, %i {axis = 0 : i64} : (tensor<6x3xf64>, tensor<6xi64>) "
            "-> tensor<6x3xf64>",
            "%y", "6x3xf64")
      .values("m", {0, 1, 1, 0, 0, 1})
      .run();
}

TEST(Gradient, Expand) {
  GradCheck({param("x", "3x1xf64")}, "%y = carve.expand %x : tensor<3x1xf64> -> tensor<2x3x4xf64>",
            "%y", "2x3x4xf64")
      .run();
}

//===--- Whole-function behaviour ------------------------------------------===//

// GPT's tied embedding: the table is gathered and multiplied; its gradient is
// the sum of both contributions.
TEST(Gradient, TiedWeightGetsTheSum) {
  GradCheck({param("wte", "6x3xf64"), input("ids", "4xi64")},
            "%h = carve.gather %wte, %ids {axis = 0 : i64} : (tensor<6x3xf64>, tensor<4xi64>) "
            "-> tensor<4x3xf64>\n"
            "%wt = carve.transpose %wte {perm = array<i64: 1, 0>} : tensor<6x3xf64> "
            "-> tensor<3x6xf64>\n"
            "%y = carve.matmul %h, %wt : (tensor<4x3xf64>, tensor<3x6xf64>) -> tensor<4x6xf64>",
            "%y", "4x6xf64")
      .values("ids", {1, 4, 1, 0})
      .run();
}

TEST(Gradient, UnusedParameterIsListed) {
  GradCheck check({param("x", "3xf64"), param("u", "2xf64")}, "%y = carve.exp %x : tensor<3xf64>",
                  "%y", "3xf64");
  check.run();
  auto step = check.module().lookupSymbol<func::FuncOp>("train_step");
  ASSERT_TRUE(step);
  auto unused = step->getAttrOfType<ArrayAttr>(kUnusedParamsAttr);
  ASSERT_TRUE(unused);
  ASSERT_EQ(unused.size(), 1u);
  EXPECT_EQ(cast<StringAttr>(unused[0]).getValue(), "u");
  ASSERT_EQ(step.getNumResults(), 2u);
  EXPECT_EQ(step.getResultAttrOfType<StringAttr>(1, kGradOfAttr).getValue(), "x");
}

// A GPT block in miniature: layer_norm, MLP with gelu, residual, cross-entropy.
TEST(Gradient, MlpBlockWithCrossEntropy) {
  GradCheck(
      {param("x", "2x3x4xf64"), param("g", "4xf64"), param("b", "4xf64"), param("w1", "4x6xf64"),
       param("b1", "6xf64"), param("w2", "6x4xf64"), input("t", "2x3xi64")},
      "%n = carve.layer_norm %x scale %g bias %b {axis = 2 : i64, epsilon = 9.99999974E-6 : f32}"
      " : (tensor<2x3x4xf64>, tensor<4xf64>, tensor<4xf64>) -> tensor<2x3x4xf64>\n"
      "%h = carve.matmul %n, %w1 : (tensor<2x3x4xf64>, tensor<4x6xf64>) -> tensor<2x3x6xf64>\n"
      "%hb = carve.add %b1, %h : (tensor<6xf64>, tensor<2x3x6xf64>) -> tensor<2x3x6xf64>\n"
      "%a = carve.gelu %hb {approximate = \"tanh\"} : tensor<2x3x6xf64>\n"
      "%o = carve.matmul %a, %w2 : (tensor<2x3x6xf64>, tensor<6x4xf64>) -> tensor<2x3x4xf64>\n"
      "%r = carve.add %x, %o : (tensor<2x3x4xf64>, tensor<2x3x4xf64>) -> tensor<2x3x4xf64>\n"
      "%p = carve.transpose %r {perm = array<i64: 0, 2, 1>} : tensor<2x3x4xf64> "
      "-> tensor<2x4x3xf64>\n"
      "%y = carve.cross_entropy %p, %t {ignore_index = -100 : i64, reduction = \"mean\"} "
      ": (tensor<2x4x3xf64>, tensor<2x3xi64>) -> tensor<f64>",
      "%y", "f64")
      .values("t", {0, 3, 1, 2, -100, 3})
      .run();
}

//===--- Convolution and pooling (carve-lower-convolutions) ----------------===//

// The ops the lowering writes (gather of the windows, where for the padding,
// matmul, reduce_max) against finite differences of the lowered @forward:
// with respect to the image, the weight and the bias.
TEST(Gradient, Conv2dStridedPaddedBias) {
  GradCheck({param("x", "2x3x5x5xf64"), param("w", "4x3x3x3xf64"), param("b", "4xf64")},
            "%y = carve.conv2d %x, %w bias %b {dilations = array<i64: 1, 1>, group = 1 : i64, "
            "pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 2, 2>} : (tensor<2x3x5x5xf64>, "
            "tensor<4x3x3x3xf64>, tensor<4xf64>) -> tensor<2x4x3x3xf64>",
            "%y", "2x4x3x3xf64")
      .lowered()
      .run();
}

TEST(Gradient, Conv2dGroupedDilatedAsymmetricPads) {
  GradCheck({param("x", "1x4x6x6xf64"), param("w", "4x2x3x3xf64")},
            "%y = carve.conv2d %x, %w {dilations = array<i64: 2, 2>, group = 2 : i64, "
            "pads = array<i64: 2, 1, 0, 1>, strides = array<i64: 1, 1>} : (tensor<1x4x6x6xf64>, "
            "tensor<4x2x3x3xf64>) -> tensor<1x4x4x4xf64>",
            "%y", "1x4x4x4xf64")
      .lowered()
      .run();
}

// conv2d kept whole (the CUDA target's cuDNN path): its own gradient rule,
// conv2d_grad_input and conv2d_grad_weight, against finite differences of
// the unlowered @forward, in the interpreter's reference kernels.
TEST(Gradient, Conv2dWholeStridedPadded) {
  GradCheck({param("x", "2x3x5x5xf64"), param("w", "4x3x3x3xf64")},
            "%y = carve.conv2d %x, %w {dilations = array<i64: 1, 1>, group = 1 : i64, "
            "pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 2, 2>} : (tensor<2x3x5x5xf64>, "
            "tensor<4x3x3x3xf64>) -> tensor<2x4x3x3xf64>",
            "%y", "2x4x3x3xf64")
      .run();
}

TEST(Gradient, Conv2dWholeGroupedDilatedAsymmetricPads) {
  GradCheck({param("x", "1x4x6x6xf64"), param("w", "4x2x3x3xf64")},
            "%y = carve.conv2d %x, %w {dilations = array<i64: 2, 2>, group = 2 : i64, "
            "pads = array<i64: 2, 1, 0, 1>, strides = array<i64: 1, 1>} : (tensor<1x4x6x6xf64>, "
            "tensor<4x2x3x3xf64>) -> tensor<1x4x4x4xf64>",
            "%y", "1x4x4x4xf64")
      .run();
}

TEST(Gradient, Conv2dWholeDepthwiseStride2) {
  GradCheck({param("x", "2x3x5x6xf64"), param("w", "3x1x3x3xf64")},
            "%y = carve.conv2d %x, %w {dilations = array<i64: 1, 1>, group = 3 : i64, "
            "pads = array<i64: 1, 0, 0, 1>, strides = array<i64: 2, 2>} : (tensor<2x3x5x6xf64>, "
            "tensor<3x1x3x3xf64>) -> tensor<2x3x2x3xf64>",
            "%y", "2x3x2x3xf64")
      .run();
}

TEST(Gradient, Conv2dDepthwise) {
  GradCheck({param("x", "1x3x4x4xf64"), param("w", "3x1x3x3xf64")},
            "%y = carve.conv2d %x, %w {dilations = array<i64: 1, 1>, group = 3 : i64, "
            "pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>} : (tensor<1x3x4x4xf64>, "
            "tensor<3x1x3x3xf64>) -> tensor<1x3x4x4xf64>",
            "%y", "1x3x4x4xf64")
      .lowered()
      .run();
}

// Max pooling's gradient goes to each window's maximum (random inputs have no
// ties); padding is -inf and never the maximum.
TEST(Gradient, MaxPool2dPadded) {
  GradCheck({param("x", "1x2x5x5xf64")},
            "%y = carve.max_pool2d %x {kernel = array<i64: 3, 3>, pads = array<i64: 1, 1, 1, 1>, "
            "strides = array<i64: 2, 2>} : tensor<1x2x5x5xf64> -> tensor<1x2x3x3xf64>",
            "%y", "1x2x3x3xf64")
      .lowered()
      .run();
}

// Batch norm in training mode over [3, 2, 2, 2]: with respect to the input,
// the scale and the bias; the running statistics' buffers only read.
GradCheck batchNormTraining() {
  GradCheck check({param("x", "3x2x2x2xf64"), param("g", "2xf64"), param("b", "2xf64"),
                   "%rm: tensor<2xf64> {carve.param = \"rm\", carve.buffer = \"rm\"}",
                   "%rv: tensor<2xf64> {carve.param = \"rv\", carve.buffer = \"rv\"}"},
                  "%y, %m, %v = carve.batch_norm %x, %g, %b, %rm, %rv {epsilon = 1.0e-5 : f32, "
                  "momentum = 0.9 : f32, training = true} : (tensor<3x2x2x2xf64>, "
                  "tensor<2xf64>, tensor<2xf64>, tensor<2xf64>, tensor<2xf64>) -> "
                  "(tensor<3x2x2x2xf64>, tensor<2xf64>, tensor<2xf64>)",
                  "%y", "3x2x2x2xf64");
  check.uniform("rv", 0.5, 1.5).lowered();
  return check;
}

// The batch's statistics over N, H, W (the gradient through the mean and
// variance included).
TEST(Gradient, BatchNormTraining) { batchNormTraining().run(); }

// sync_batch_norm: the statistics as sums through carve.replica_sum (one
// replica here, so the sums are this batch's), the mean and then the squares
// about it; the gradient goes back through both sums.
TEST(Gradient, BatchNormTrainingSyncReplicas) {
  batchNormTraining().plan("{sync_batch_norm}").run();
}

// Eval mode (an eval-mode export): the running statistics, fixed.
TEST(Gradient, BatchNormEval) {
  GradCheck({param("x", "2x3x4xf64"), param("g", "3xf64"), param("b", "3xf64"),
             "%rm: tensor<3xf64> {carve.param = \"rm\", carve.buffer = \"rm\"}",
             "%rv: tensor<3xf64> {carve.param = \"rv\", carve.buffer = \"rv\"}"},
            "%y, %m, %v = carve.batch_norm %x, %g, %b, %rm, %rv {epsilon = 1.0e-5 : f32, "
            "momentum = 0.9 : f32, training = false} : (tensor<2x3x4xf64>, tensor<3xf64>, "
            "tensor<3xf64>, tensor<3xf64>, tensor<3xf64>) -> (tensor<2x3x4xf64>, tensor<3xf64>, "
            "tensor<3xf64>)",
            "%y", "2x3x4xf64")
      .uniform("rv", 0.5, 1.5)
      .lowered()
      .run();
}

TEST(Gradient, OpWithoutRuleOnThePath) {
  auto ctx = makeContext();
  const char *src = R"mlir(
    func.func @forward(%x: tensor<1x1x4x4xf64> {carve.input = "x"},
                       %w: tensor<1x1x4x4xf64> {carve.param = "w", carve.trainable})
        -> (tensor<f64> {carve.output = "loss"}) {
      %h = carve.mul %x, %w : (tensor<1x1x4x4xf64>, tensor<1x1x4x4xf64>) -> tensor<1x1x4x4xf64>
      %y = carve.max_pool2d %h {kernel = array<i64: 2, 2>, pads = array<i64: 0, 0, 0, 0>,
                                strides = array<i64: 2, 2>}
             : tensor<1x1x4x4xf64> -> tensor<1x1x2x2xf64>
      %l = carve.reduce_sum %y {axes = array<i64: 0, 1, 2, 3>, keep_dims = false}
             : tensor<1x1x2x2xf64> -> tensor<f64>
      return %l : tensor<f64>
    })mlir";
  OwningOpRef<ModuleOp> module = parseSourceString<ModuleOp>(src, ctx.get());
  ASSERT_TRUE(module);
  std::string error;
  EXPECT_FALSE(buildTrainingStep(*module, AutodiffOptions(), error));
  EXPECT_NE(error.find("no gradient rule for 'carve.max_pool2d'"), std::string::npos) << error;
  EXPECT_FALSE(module->lookupSymbol("train_step"));

  // The interpreter has no kernel for it either, and says so.
  auto fwd = module->lookupSymbol<func::FuncOp>("forward");
  std::vector<HostValue> args, res;
  for (BlockArgument a : fwd.getArguments())
    args.push_back(HostValue::zeros(cast<RankedTensorType>(a.getType())));
  EXPECT_FALSE(interpret(fwd, args, res, error));
  EXPECT_EQ(error,
            "no reference kernel for carve.max_pool2d (carve-lower-convolutions rewrites it)");
}

//===--- The interpreter on its own ----------------------------------------===//

/// Runs @f of `src` on `args` (doubles converted to each argument's type).
/// Returns its results as doubles, or sets `error` when the interpreter fails.
std::vector<std::vector<double>>
evaluate(const std::string &src, std::vector<std::vector<double>> args, std::string &error) {
  auto ctx = makeContext();
  OwningOpRef<ModuleOp> module = parseSourceString<ModuleOp>(src, ctx.get());
  EXPECT_TRUE(module) << src;
  if (!module)
    return {};
  auto fn = module->lookupSymbol<func::FuncOp>("f");
  std::vector<HostValue> in, out;
  for (BlockArgument a : fn.getArguments())
    in.push_back(
        HostValue::fromDoubles(cast<RankedTensorType>(a.getType()), args[a.getArgNumber()]));
  if (!interpret(fn, in, out, error))
    return {};
  std::vector<std::vector<double>> r;
  for (const HostValue &v : out)
    r.push_back(v.toDoubles());
  return r;
}

std::vector<std::vector<double>> evaluate(const std::string &src,
                                          std::vector<std::vector<double>> args) {
  std::string error;
  auto r = evaluate(src, std::move(args), error);
  EXPECT_EQ(error, "");
  return r;
}

TEST(GradientInterpreter, MatmulWithVectors) {
  auto r = evaluate(R"mlir(
    func.func @f(%v: tensor<2xf64>, %m: tensor<2x3xf64>, %u: tensor<3xf64>)
        -> (tensor<3xf64>, tensor<2xf64>, tensor<f64>) {
      %a = carve.matmul %v, %m : (tensor<2xf64>, tensor<2x3xf64>) -> tensor<3xf64>
      %b = carve.matmul %m, %u : (tensor<2x3xf64>, tensor<3xf64>) -> tensor<2xf64>
      %c = carve.matmul %a, %u : (tensor<3xf64>, tensor<3xf64>) -> tensor<f64>
      return %a, %b, %c : tensor<3xf64>, tensor<2xf64>, tensor<f64>
    })mlir",
                    {{1, 2}, {1, 2, 3, 4, 5, 6}, {1, 0, -1}});
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0], (std::vector<double>{9, 12, 15}));
  EXPECT_EQ(r[1], (std::vector<double>{-2, -2}));
  EXPECT_EQ(r[2], (std::vector<double>{-6}));
}

TEST(GradientInterpreter, Constants) {
  auto r = evaluate(R"mlir(
    func.func @f() -> (tensor<2xf64>, tensor<3xi1>, tensor<2x2xf32>, tensor<2xi64>) {
      %a = carve.constant dense_resource<blob> : tensor<2xf64>
      %b = carve.constant dense<[true, false, true]> : tensor<3xi1>
      %c = carve.constant dense<2.5> : tensor<2x2xf32>
      %d = carve.constant dense<[-3, 7]> : tensor<2xi64>
      return %a, %b, %c, %d : tensor<2xf64>, tensor<3xi1>, tensor<2x2xf32>, tensor<2xi64>
    }
    {-#
      dialect_resources: {
        builtin: {
          blob: "0x08000000000000000000F03F0000000000000040"
        }
      }
    #-})mlir",
                    {});
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0], (std::vector<double>{1, 2}));
  EXPECT_EQ(r[1], (std::vector<double>{1, 0, 1}));
  EXPECT_EQ(r[2], (std::vector<double>{2.5, 2.5, 2.5, 2.5}));
  EXPECT_EQ(r[3], (std::vector<double>{-3, 7}));
}

TEST(GradientInterpreter, IntegerAndLogicOps) {
  auto r = evaluate(R"mlir(
    func.func @f(%a: tensor<3xi64>, %b: tensor<3xi64>) -> (tensor<3xi64>, tensor<3xi1>, tensor<3xf32>) {
      %q = carve.div %a, %b : (tensor<3xi64>, tensor<3xi64>) -> tensor<3xi64>
      %lt = carve.less %a, %b : (tensor<3xi64>, tensor<3xi64>) -> tensor<3xi1>
      %eq = carve.equal %a, %b : (tensor<3xi64>, tensor<3xi64>) -> tensor<3xi1>
      %ne = carve.not %eq : tensor<3xi1>
      %both = carve.and %lt, %ne : (tensor<3xi1>, tensor<3xi1>) -> tensor<3xi1>
      %f = carve.cast %q : tensor<3xi64> -> tensor<3xf32>
      return %q, %both, %f : tensor<3xi64>, tensor<3xi1>, tensor<3xf32>
    })mlir",
                    {{7, -7, 2}, {2, 2, 2}});
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0], (std::vector<double>{3, -3, 1}));
  EXPECT_EQ(r[1], (std::vector<double>{0, 1, 0}));
  EXPECT_EQ(r[2], (std::vector<double>{3, -3, 1}));
}

// The kernels abort on these; the interpreter reports them instead.
TEST(GradientInterpreter, BadInputsAreErrors) {
  std::string error;
  evaluate(R"mlir(
    func.func @f(%x: tensor<3x2xf64>, %i: tensor<2xi64>) -> tensor<2x2xf64> {
      %y = carve.gather %x, %i {axis = 0 : i64} : (tensor<3x2xf64>, tensor<2xi64>) -> tensor<2x2xf64>
      return %y : tensor<2x2xf64>
    })mlir",
           {{0, 0, 0, 0, 0, 0}, {0, 3}}, error);
  EXPECT_EQ(error, "carve.gather: index 3 at position 1 is outside [-3, 3) for dimension 0");

  evaluate(R"mlir(
    func.func @f(%l: tensor<2x3xf64>, %t: tensor<2xi64>) -> tensor<f64> {
      %y = carve.cross_entropy %l, %t : (tensor<2x3xf64>, tensor<2xi64>) -> tensor<f64>
      return %y : tensor<f64>
    })mlir",
           {{0, 0, 0, 0, 0, 0}, {2, -1}}, error);
  EXPECT_EQ(error, "carve.cross_entropy: target -1 at position 1 is outside [0, 3)");

  evaluate(R"mlir(
    func.func @f(%a: tensor<2xi32>, %b: tensor<2xi32>) -> tensor<2xi32> {
      %y = carve.div %a, %b : (tensor<2xi32>, tensor<2xi32>) -> tensor<2xi32>
      return %y : tensor<2xi32>
    })mlir",
           {{1, 2}, {1, 0}}, error);
  EXPECT_EQ(error, "carve.div: integer division by zero");
}

} // namespace
