//===- ImporterTest.cpp - the ONNX importer on hand-built graphs ----------===//

#include "compiler/frontend/HostTensor.h"
#include "compiler/frontend/OnnxImporter.h"
#include "compiler/interp/Interpreter.h"
#include "dialects/carve/CarveOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/MLIRContext.h"

#include "onnx/onnx_pb.h"

#include <gtest/gtest.h>

#include <cmath>

using namespace mlir;

namespace {

/// Builds a small ONNX model in memory.
struct ModelBuilder {
  onnx::ModelProto model;
  onnx::GraphProto *graph;

  explicit ModelBuilder(int opset = 17) {
    model.set_ir_version(8);
    auto *op = model.add_opset_import();
    op->set_domain("");
    op->set_version(opset);
    graph = model.mutable_graph();
    graph->set_name("test");
  }
  void input(const std::string &name, std::vector<int64_t> shape, int type = 1,
             std::vector<std::string> symbols = {}) {
    auto *v = graph->add_input();
    v->set_name(name);
    auto *tt = v->mutable_type()->mutable_tensor_type();
    tt->set_elem_type(type);
    for (size_t k = 0; k < shape.size(); ++k) {
      auto *d = tt->mutable_shape()->add_dim();
      if (k < symbols.size() && !symbols[k].empty())
        d->set_dim_param(symbols[k]);
      else
        d->set_dim_value(shape[k]);
    }
  }
  void output(const std::string &name) { graph->add_output()->set_name(name); }
  onnx::NodeProto *node(const std::string &type, std::vector<std::string> ins,
                        std::vector<std::string> outs, const std::string &name = "") {
    auto *n = graph->add_node();
    n->set_op_type(type);
    n->set_name(name.empty() ? type + std::to_string(graph->node_size()) : name);
    for (auto &i : ins)
      n->add_input(i);
    for (auto &o : outs)
      n->add_output(o);
    return n;
  }
  void floatInit(const std::string &name, std::vector<int64_t> dims) {
    auto *t = graph->add_initializer();
    t->set_name(name);
    t->set_data_type(1);
    int64_t n = 1;
    for (int64_t d : dims) {
      t->add_dims(d);
      n *= d;
    }
    for (int64_t k = 0; k < n; ++k)
      t->add_float_data(0.5f);
  }
  void intInit(const std::string &name, std::vector<int64_t> values) {
    auto *t = graph->add_initializer();
    t->set_name(name);
    t->set_data_type(7);
    t->add_dims(values.size());
    for (int64_t v : values)
      t->add_int64_data(v);
  }
  void intInitShaped(const std::string &name, std::vector<int64_t> dims,
                     std::vector<int64_t> values) {
    auto *t = graph->add_initializer();
    t->set_name(name);
    t->set_data_type(7);
    for (int64_t d : dims)
      t->add_dims(d);
    for (int64_t v : values)
      t->add_int64_data(v);
  }
  static void stringAttr(onnx::NodeProto *n, const std::string &name, const std::string &value) {
    auto *a = n->add_attribute();
    a->set_name(name);
    a->set_type(onnx::AttributeProto::STRING);
    a->set_s(value);
  }
  static void intAttr(onnx::NodeProto *n, const std::string &name, int64_t value) {
    auto *a = n->add_attribute();
    a->set_name(name);
    a->set_type(onnx::AttributeProto::INT);
    a->set_i(value);
  }
  void meta(const std::string &key, const std::string &value) {
    auto *p = model.add_metadata_props();
    p->set_key(key);
    p->set_value(value);
  }
  std::string bytes() const { return model.SerializeAsString(); }
};

struct Imported {
  MLIRContext ctx;
  OwningOpRef<ModuleOp> module;
  std::string error;
  func::FuncOp forward() { return module->lookupSymbol<func::FuncOp>("forward"); }
  int count(StringRef opName) {
    int n = 0;
    forward().walk([&](Operation *op) { n += op->getName().getStringRef() == opName; });
    return n;
  }
};

std::unique_ptr<Imported> import(const ModelBuilder &m, carve::ImportOptions opts = {}) {
  auto r = std::make_unique<Imported>();
  r->module = carve::importOnnxBytes(r->ctx, m.bytes(), "test.onnx", ".", opts, r->error);
  return r;
}

TEST(Importer, ShapeSubgraphFoldsAway) {
  // y = Reshape(x, Concat(Unsqueeze(Gather(Shape(x), 0)), [-1])): [2, 3, 4] -> [2, 12]
  ModelBuilder m;
  m.input("x", {2, 3, 4});
  m.intInit("zero", {0});
  m.intInit("minus_one", {-1});
  m.node("Shape", {"x"}, {"s"});
  m.node("Gather", {"s", "zero"}, {"b"});
  ModelBuilder::intAttr(m.node("Concat", {"b", "minus_one"}, {"shape"}), "axis", 0);
  m.node("Reshape", {"x", "shape"}, {"y"});
  m.output("y");
  auto r = import(m);
  ASSERT_TRUE(r->module) << r->error;
  EXPECT_EQ(r->count("carve.reshape"), 1);
  EXPECT_EQ(r->count("carve.constant"), 0);
  auto type = cast<RankedTensorType>(r->forward().getResultTypes()[0]);
  EXPECT_EQ(type.getShape(), (ArrayRef<int64_t>{2, 12}));
  // Integer initializers are constants, not parameters.
  EXPECT_EQ(r->forward().getNumArguments(), 1u);
}

TEST(Importer, ShapeOfABatchShareIsNotRescaledAgain) {
  // A rank's share (2) of a static batch of 8: Shape(x) folds to the share's
  // sizes, so shapes built from it are the share's already. x.flatten(2) as
  // PyTorch exports it: Reshape(x, Concat(Slice(Shape(x), 0, 2), [-1]));
  // cls.expand(B, -1, -1): Expand(cls, Concat(Shape(x)[0], [1, 16]))
  // -- and B * 3 rows: Reshape(x, Concat(Shape(x)[0] * 3, [-1])).
  ModelBuilder m;
  m.input("x", {8, 3, 4, 4});
  m.floatInit("cls", {1, 1, 16});
  m.intInit("zero", {0});
  m.intInit("two", {2});
  m.intInit("three", {3});
  m.intInit("minus_one", {-1});
  m.intInit("rest", {1, 16});
  m.node("Shape", {"x"}, {"s"});
  m.node("Slice", {"s", "zero", "two"}, {"s2"});
  ModelBuilder::intAttr(m.node("Concat", {"s2", "minus_one"}, {"flat_shape"}), "axis", 0);
  m.node("Reshape", {"x", "flat_shape"}, {"flat"});
  m.node("Gather", {"s", "zero"}, {"b"});
  ModelBuilder::intAttr(m.node("Concat", {"b", "rest"}, {"cls_shape"}), "axis", 0);
  m.node("Expand", {"cls", "cls_shape"}, {"cls_b"});
  m.node("Mul", {"b", "three"}, {"b3"});
  ModelBuilder::intAttr(m.node("Concat", {"b3", "minus_one"}, {"rows_shape"}), "axis", 0);
  m.node("Reshape", {"x", "rows_shape"}, {"rows"});
  m.output("flat");
  m.output("cls_b");
  m.output("rows");
  carve::ImportOptions opts;
  opts.batch = 2;
  opts.globalBatch = 8;
  auto r = import(m, opts);
  ASSERT_TRUE(r->module) << r->error;
  auto shape = [&](unsigned k) {
    auto t = cast<RankedTensorType>(r->forward().getResultTypes()[k]).getShape();
    return std::vector<int64_t>(t.begin(), t.end());
  };
  EXPECT_EQ(shape(0), (std::vector<int64_t>{2, 3, 16}));
  EXPECT_EQ(shape(1), (std::vector<int64_t>{2, 1, 16}));
  EXPECT_EQ(shape(2), (std::vector<int64_t>{6, 16}));
}

/// Resize (linear) of [1, 2, 3, 4] by scales [1, 1, 2, 1.5]: [1, 2, 6, 6].
TEST(Importer, ResizeIsAGather) {
  ModelBuilder m;
  m.input("x", {1, 2, 3, 4});
  // A Constant node: a float initializer is a parameter.
  auto *c = m.node("Constant", {}, {"scales"})->add_attribute();
  c->set_name("value");
  c->set_type(onnx::AttributeProto::TENSOR);
  auto *t = c->mutable_t();
  t->set_data_type(1);
  t->add_dims(4);
  for (float v : {1.0f, 1.0f, 2.0f, 1.5f})
    t->add_float_data(v);
  auto *a = m.node("Resize", {"x", "", "scales"}, {"y"}, "/up/Resize")->add_attribute();
  a->set_name("mode");
  a->set_type(onnx::AttributeProto::STRING);
  a->set_s("linear");
  m.output("y");
  auto r = import(m);
  ASSERT_TRUE(r->module) << r->error;
  EXPECT_EQ(cast<RankedTensorType>(r->forward().getResultTypes()[0]).getShape(),
            (ArrayRef<int64_t>{1, 2, 6, 6}));
  EXPECT_EQ(r->count("carve.gather"), 1);
  // cubic is refused, naming the node and the mode.
  a->set_s("cubic");
  auto cubic = import(m);
  EXPECT_FALSE(cubic->module);
  EXPECT_NE(cubic->error.find("'/up/Resize' (Resize): mode 'cubic' is not supported"),
            std::string::npos)
      << cubic->error;
}

TEST(Importer, ParametersWithoutMetadataAreFloatInitializers) {
  ModelBuilder m;
  m.input("x", {2, 3});
  m.floatInit("w", {3, 4});
  m.node("MatMul", {"x", "w"}, {"y"});
  m.output("y");
  auto r = import(m);
  ASSERT_TRUE(r->module) << r->error;
  func::FuncOp f = r->forward();
  ASSERT_EQ(f.getNumArguments(), 2u);
  EXPECT_EQ(f.getArgAttrOfType<StringAttr>(0, carve::kInputAttr).str(), "x");
  EXPECT_EQ(f.getArgAttrOfType<StringAttr>(1, carve::kParamAttr).str(), "w");
  EXPECT_TRUE(f.getArgAttr(1, carve::kTrainableAttr));
}

TEST(Importer, MetadataSeparatesBuffersAndFrozenGlobs) {
  ModelBuilder m;
  m.input("x", {2, 3});
  m.floatInit("layer.weight", {3});
  m.floatInit("layer.bias", {3});
  m.floatInit("stats", {3});
  m.meta("carve.parameters", "[\"layer.weight\", \"layer.bias\"]");
  m.meta("carve.buffers", "[\"stats\"]");
  m.node("Mul", {"x", "layer.weight"}, {"a"});
  m.node("Add", {"a", "layer.bias"}, {"b"});
  m.node("Add", {"b", "stats"}, {"y"});
  m.output("y");
  carve::ImportOptions opts;
  opts.frozen = {"*.bias"};
  auto r = import(m, opts);
  ASSERT_TRUE(r->module) << r->error;
  func::FuncOp f = r->forward();
  ASSERT_EQ(f.getNumArguments(), 4u);
  EXPECT_TRUE(f.getArgAttr(1, carve::kTrainableAttr));
  EXPECT_EQ(f.getArgAttrOfType<StringAttr>(2, carve::kParamAttr).str(), "layer.bias");
  EXPECT_FALSE(f.getArgAttr(2, carve::kTrainableAttr));
  EXPECT_EQ(f.getArgAttrOfType<StringAttr>(3, carve::kBufferAttr).str(), "stats");
}

TEST(Importer, SymbolicDimsNeedBinding) {
  ModelBuilder m;
  m.input("x", {0, 3}, 1, {"batch"});
  m.node("Relu", {"x"}, {"y"});
  m.output("y");
  auto r = import(m);
  EXPECT_FALSE(r->module);
  EXPECT_NE(r->error.find("--set-dim batch=N"), std::string::npos) << r->error;

  carve::ImportOptions opts;
  std::string err;
  ASSERT_TRUE(carve::parseSetDim("batch=5", opts, err));
  auto ok = import(m, opts);
  ASSERT_TRUE(ok->module) << ok->error;
  EXPECT_EQ(cast<RankedTensorType>(ok->forward().getArgumentTypes()[0]).getShape(),
            (ArrayRef<int64_t>{5, 3}));
  EXPECT_FALSE(carve::parseSetDim("batch=x", opts, err));
  EXPECT_FALSE(carve::parseSetDim("=3", opts, err));
}

TEST(Importer, ErrorsNameTheNode) {
  ModelBuilder m;
  m.input("a", {2, 3});
  m.input("b", {4, 5});
  m.node("Add", {"a", "b"}, {"y"}, "/blocks.0/Add");
  m.output("y");
  auto r = import(m);
  EXPECT_FALSE(r->module);
  EXPECT_EQ(r->error, "node '/blocks.0/Add' (Add): shapes [2, 3] and [4, 5] do not broadcast");

  ModelBuilder u(15);
  u.input("a", {2, 3});
  u.node("Softsign", {"a"}, {"y"}, "nz");
  u.output("y");
  auto ru = import(u);
  EXPECT_FALSE(ru->module);
  EXPECT_NE(ru->error.find("unsupported op 'Softsign' at opset 15"), std::string::npos);
  EXPECT_NE(ru->error.find("'nz'"), std::string::npos);
  EXPECT_NE(ru->error.find("docs/onnx-ops.md"), std::string::npos);
}

TEST(Importer, RaisesSiluAndKeepsItWithoutRaise) {
  ModelBuilder m;
  m.input("x", {2, 8});
  m.node("Sigmoid", {"x"}, {"s"});
  m.node("Mul", {"x", "s"}, {"y"});
  m.output("y");
  auto r = import(m);
  ASSERT_TRUE(r->module) << r->error;
  EXPECT_EQ(r->count("carve.silu"), 1);
  EXPECT_EQ(r->count("carve.sigmoid"), 0);
  carve::ImportOptions opts;
  opts.raise = false;
  auto raw = import(m, opts);
  ASSERT_TRUE(raw->module) << raw->error;
  EXPECT_EQ(raw->count("carve.silu"), 0);
  EXPECT_EQ(raw->count("carve.sigmoid"), 1);
}

TEST(Importer, Opset18TakesReduceAxesAsInputAndSplitsByCount) {
  ModelBuilder m(18);
  m.input("x", {4, 6});
  m.intInit("axes", {1});
  m.node("ReduceMean", {"x", "axes"}, {"mean"});
  auto *split = m.node("Split", {"x"}, {"a", "b", "c"});
  ModelBuilder::intAttr(split, "num_outputs", 3);
  ModelBuilder::intAttr(split, "axis", 1);
  m.output("mean");
  m.output("c");
  auto r = import(m);
  ASSERT_TRUE(r->module) << r->error;
  auto types = r->forward().getResultTypes();
  EXPECT_EQ(cast<RankedTensorType>(types[0]).getShape(), (ArrayRef<int64_t>{4, 1}));
  EXPECT_EQ(cast<RankedTensorType>(types[1]).getShape(), (ArrayRef<int64_t>{4, 2}));

  // Before opset 18, ReduceMean's axes are an attribute; an input is refused.
  ModelBuilder old(17);
  old.input("x", {4, 6});
  old.intInit("axes", {1});
  old.node("ReduceMean", {"x", "axes"}, {"mean"}, "rm");
  old.output("mean");
  auto ro = import(old);
  EXPECT_FALSE(ro->module);
  EXPECT_NE(ro->error.find("axes is an attribute, not an input, before opset 18"),
            std::string::npos)
      << ro->error;
}

// ScatterND with constant indices on computed data and updates: each
// reduction, evaluated by the reference interpreter, equals the host kernel
// that folds it on constants; index tuples that repeat a slice, and some
// slices written by none.
TEST(Importer, ScatterNDOnComputedValuesEqualsTheHostKernel) {
  // data [2, 3, 2]; tuples (i, j) address slices of 2 elements.
  const std::vector<int64_t> unique = {0, 1, 1, 2, 0, 0};     // 3 slices of 6
  const std::vector<int64_t> repeated = {1, 0, 0, 2, 1, 0, 1, 0}; // (1, 0) three times
  struct Case {
    const char *reduction;
    std::vector<int64_t> tuples;
    const char *expectOp;
  };
  for (const Case &c : {Case{"none", unique, "carve.where"}, Case{"add", repeated, "carve.gather_grad"},
                        Case{"mul", repeated, "carve.where"}, Case{"max", repeated, "carve.where"},
                        Case{"min", repeated, "carve.where"}}) {
    const int64_t rows = (int64_t)c.tuples.size() / 2;
    ModelBuilder m(18);
    m.input("x", {2, 3, 2});
    m.input("u", {rows, 2});
    m.intInitShaped("idx", {rows, 2}, c.tuples);
    m.node("Tanh", {"x"}, {"data"});
    auto *s = m.node("ScatterND", {"data", "idx", "u"}, {"y"}, "/scatter");
    ModelBuilder::stringAttr(s, "reduction", c.reduction);
    m.output("y");
    auto r = import(m);
    ASSERT_TRUE(r->module) << c.reduction << ": " << r->error;
    EXPECT_GE(r->count(c.expectOp), 1) << c.reduction;
    EXPECT_EQ(r->count("carve.scatter_nd"), 0);

    std::vector<double> xs, us;
    for (int k = 0; k < 12; ++k)
      xs.push_back(0.37 * k - 2.0);
    for (int k = 0; k < rows * 2; ++k)
      us.push_back(1.5 - 0.61 * k);
    auto argTypes = r->forward().getArgumentTypes();
    std::vector<carve::HostValue> args = {
        carve::HostValue::fromDoubles(cast<RankedTensorType>(argTypes[0]), xs),
        carve::HostValue::fromDoubles(cast<RankedTensorType>(argTypes[1]), us)};
    std::vector<carve::HostValue> results;
    std::string error;
    ASSERT_TRUE(carve::interpret(r->forward(), args, results, error)) << error;
    ASSERT_EQ(results.size(), 1u);
    std::vector<double> tanhX;
    for (double v : xs)
      tanhX.push_back((double)std::tanh((float)v));
    carve::HostTensor want = carve::hostScatterND(
        carve::HostTensor::floats(carve::ElemKind::F32, {2, 3, 2}, tanhX),
        carve::HostTensor::ints(carve::ElemKind::I64, {rows, 2}, c.tuples),
        carve::HostTensor::floats(carve::ElemKind::F32, {rows, 2}, us), c.reduction);
    std::vector<double> got = results[0].toDoubles();
    ASSERT_EQ(got.size(), want.f.size());
    for (size_t k = 0; k < got.size(); ++k)
      EXPECT_NEAR(got[k], want.f[k], 1e-6 * (1 + std::fabs(want.f[k])))
          << c.reduction << " element " << k;
  }
}

TEST(Importer, LessOrEqualOnComputedValues) {
  ModelBuilder m(17);
  m.input("a", {4});
  m.input("b", {4});
  m.node("LessOrEqual", {"a", "b"}, {"le"});
  m.node("GreaterOrEqual", {"a", "b"}, {"ge"});
  m.output("le");
  m.output("ge");
  auto r = import(m);
  ASSERT_TRUE(r->module) << r->error;
  auto types = r->forward().getArgumentTypes();
  std::vector<carve::HostValue> args = {
      carve::HostValue::fromDoubles(cast<RankedTensorType>(types[0]), {1, 2, 3, NAN}),
      carve::HostValue::fromDoubles(cast<RankedTensorType>(types[1]), {2, 2, 1, 0})};
  std::vector<carve::HostValue> results;
  std::string error;
  ASSERT_TRUE(carve::interpret(r->forward(), args, results, error)) << error;
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].toDoubles(), (std::vector<double>{1, 1, 0, 0}));
  EXPECT_EQ(results[1].toDoubles(), (std::vector<double>{0, 1, 1, 0}));
}

// Tile and GatherElements on a computed value (constant repeats and indices),
// through the interpreter, equal the host kernels that fold them on constants.
TEST(Importer, TileAndGatherElementsOnComputedValues) {
  ModelBuilder m(17);
  m.input("x", {2, 3});
  m.intInitShaped("reps", {2}, {2, 3});
  m.intInitShaped("idx", {2, 2}, {2, 0, -1, 1});
  m.node("Tanh", {"x"}, {"t"});
  m.node("Tile", {"t", "reps"}, {"tiled"});
  ModelBuilder::intAttr(m.node("GatherElements", {"t", "idx"}, {"picked"}), "axis", 1);
  m.output("tiled");
  m.output("picked");
  auto r = import(m);
  ASSERT_TRUE(r->module) << r->error;
  std::vector<double> xs = {0.1, -0.2, 0.3, 0.4, -0.5, 0.6};
  auto types = r->forward().getArgumentTypes();
  std::vector<carve::HostValue> results;
  std::string error;
  ASSERT_TRUE(carve::interpret(
      r->forward(), {carve::HostValue::fromDoubles(cast<RankedTensorType>(types[0]), xs)},
      results, error))
      << error;
  std::vector<double> t;
  for (double v : xs)
    t.push_back((double)std::tanh((float)v));
  carve::HostTensor ht = carve::HostTensor::floats(carve::ElemKind::F32, {2, 3}, t);
  carve::HostTensor tiled = carve::hostTile(ht, {2, 3});
  carve::HostTensor picked = carve::hostGatherElements(
      ht, carve::HostTensor::ints(carve::ElemKind::I64, {2, 2}, {2, 0, -1, 1}), 1);
  ASSERT_EQ(results.size(), 2u);
  std::vector<double> gotTiled = results[0].toDoubles(), gotPicked = results[1].toDoubles();
  ASSERT_EQ(gotTiled.size(), tiled.f.size());
  for (size_t k = 0; k < tiled.f.size(); ++k)
    EXPECT_NEAR(gotTiled[k], tiled.f[k], 1e-6) << "tile " << k;
  ASSERT_EQ(gotPicked.size(), picked.f.size());
  for (size_t k = 0; k < picked.f.size(); ++k)
    EXPECT_NEAR(gotPicked[k], picked.f[k], 1e-6) << "gather " << k;
}

TEST(Importer, ScatterNDRefusesWhatItCannotCompute) {
  // Indices computed from a graph input.
  ModelBuilder m(18);
  m.input("x", {4});
  m.input("i", {1, 1}, 7);
  m.input("u", {1});
  m.node("ScatterND", {"x", "i", "u"}, {"y"}, "/dyn");
  m.output("y");
  auto r = import(m);
  EXPECT_FALSE(r->module);
  EXPECT_NE(r->error.find("node '/dyn' (ScatterND): the indices ('i') are computed from graph "
                          "inputs"),
            std::string::npos)
      << r->error;
  // Reduction none writing one slice twice: undefined in ONNX.
  ModelBuilder d(18);
  d.input("x", {4});
  d.input("u", {2});
  d.intInitShaped("idx", {2, 1}, {3, -1});
  d.node("ScatterND", {"x", "idx", "u"}, {"y"}, "/dup");
  d.output("y");
  auto rd = import(d);
  EXPECT_FALSE(rd->module);
  EXPECT_NE(rd->error.find("node '/dup' (ScatterND): reduction 'none' writes one slice twice"),
            std::string::npos)
      << rd->error;
  // An index outside the data.
  ModelBuilder o(18);
  o.input("x", {4});
  o.input("u", {1});
  o.intInitShaped("idx", {1, 1}, {4});
  o.node("ScatterND", {"x", "idx", "u"}, {"y"}, "/out");
  o.output("y");
  auto ro = import(o);
  EXPECT_FALSE(ro->module);
  EXPECT_NE(ro->error.find("ScatterND index 4 (tuple 0, entry 0) is outside [-4, 4)"),
            std::string::npos)
      << ro->error;
}

TEST(Importer, OpsetsOutsideTheSupportedRangeAreRefused) {
  for (int opset : {12, 22}) {
    ModelBuilder m(opset);
    m.input("x", {2});
    m.node("Relu", {"x"}, {"y"});
    m.output("y");
    auto r = import(m);
    EXPECT_FALSE(r->module);
    EXPECT_NE(r->error.find("opset " + std::to_string(opset) + " is not supported"),
              std::string::npos)
        << r->error;
  }
}

} // namespace
