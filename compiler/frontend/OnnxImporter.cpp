//===- OnnxImporter.cpp - ONNX model -> carve dialect ---------------------===//
//
// The importer walks the graph once, in its (required) topological order:
//   1. read and validate the model (protobuf, opset, graph, initializers);
//   2. make the function's arguments: graph inputs (symbolic dims bound from
//      --set-dim), then parameters; buffers are added when first used;
//   3. for each node: if every input is a known constant (initializers that are
//      not parameters, Constant nodes, shapes of static tensors), evaluate it on
//      the host (HostTensor) -- this is how shape sub-graphs disappear;
//      otherwise build the carve op, typed by the shape rules in Shapes.h;
//   4. return the graph outputs, verify, and run carve-raise.
// Every error is one sentence naming the node; nothing is printed here.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/OnnxImporter.h"
#include "compiler/frontend/HostTensor.h"
#include "compiler/frontend/Passes.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Shapes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/DialectResourceBlobManager.h"
#include "mlir/IR/BuiltinDialect.h"
#include "mlir/IR/Verifier.h"
#include "mlir/Pass/PassManager.h"
#include "mlir/Transforms/Passes.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"
#include "llvm/ADT/StringSet.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/GlobPattern.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include "onnx/onnx_pb.h"

#include <cmath>
#include <cstring>
#include <optional>
#include <set>

using namespace mlir;
using llvm::ArrayRef;
using llvm::SmallVector;
using llvm::StringRef;

namespace carve {

namespace {

/// An import error: the message is the whole one-line cause.
struct ImportFailure {
  std::string message;
};

/// Constants with more elements than this print as named resource blobs at
/// the end of the module instead of inline, so the IR stays readable.
constexpr int64_t kInlineConstantLimit = 64;
/// Constant folding stops at results this large (elements).
constexpr int64_t kFoldLimit = int64_t(1) << 24;

/// The supported default-domain ops, for error messages and docs.
const std::set<std::string> &opTable() {
  static const std::set<std::string> ops = {
      "Abs", "Add", "And", "BatchNormalization", "Cast", "Ceil", "Concat", "Constant",
      "ConstantOfShape", "Conv", "Cos", "Div", "Dropout", "Equal", "Erf", "Exp", "Expand",
      "Flatten", "Floor", "Gather", "Gelu", "Gemm", "GlobalAveragePool", "Greater",
      "Identity", "LayerNormalization", "Less", "Log", "LogSoftmax", "MatMul", "Max",
      "MaxPool", "Min", "Mod", "Mul", "Neg", "NegativeLogLikelihoodLoss", "Not", "Or",
      "Pow", "Range", "Reciprocal", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd",
      "ReduceSum", "Relu", "Reshape", "Shape", "Sigmoid", "Sin", "Size", "Slice",
      "Softmax", "SoftmaxCrossEntropyLoss", "Split", "Sqrt", "Squeeze", "Sub", "Tanh",
      "Transpose", "Trilu", "Unsqueeze", "Where"};
  return ops;
}

/// Ops that only ever run on constants (shape arithmetic): no carve op exists.
const std::set<std::string> &foldOnlyOps() {
  static const std::set<std::string> ops = {"Ceil", "ConstantOfShape", "Floor", "Mod",
                                            "Range", "ReduceMin", "ReduceProd", "Trilu"};
  return ops;
}

int64_t elemBytes(int t) {
  switch ((ElemKind)t) {
  case ElemKind::F64: case ElemKind::I64: return 8;
  case ElemKind::F32: case ElemKind::I32: return 4;
  case ElemKind::F16: case ElemKind::BF16: return 2;
  case ElemKind::U8: case ElemKind::I8: case ElemKind::Bool: return 1;
  }
  return 0;
}

float halfToFloat(uint16_t h) {
  llvm::APFloat f(llvm::APFloat::IEEEhalf(), llvm::APInt(16, h));
  bool lost;
  f.convert(llvm::APFloat::IEEEsingle(), llvm::APFloat::rmNearestTiesToEven, &lost);
  return f.convertToFloat();
}

float bf16ToFloat(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

/// One value of the graph as the importer knows it: an SSA value, a constant,
/// or both (a constant that has been materialized).
struct Slot {
  Value value;
  std::optional<HostTensor> constant;
  const onnx::TensorProto *init = nullptr; ///< a not-yet-used initializer
  bool isParam = false;
};

class Importer {
public:
  Importer(MLIRContext &ctx, const ImportOptions &opts, std::string displayName,
           std::string baseDir)
      : ctx(ctx), b(&ctx), opts(opts), file(std::move(displayName)),
        baseDir(std::move(baseDir)) {}

  OwningOpRef<ModuleOp> run(StringRef bytes);

private:
  // Reading and validation.
  void parse(StringRef bytes);
  void checkInitializer(const onnx::TensorProto &t);
  HostTensor loadTensor(const onnx::TensorProto &t, const std::string &what);
  /// With a batch override, adjusts a Reshape's constant target shape that
  /// hard-codes the model's own batch (ImportOptions::globalBatch).
  void rescaleBatch(std::vector<int64_t> &req, ArrayRef<int64_t> in) const;
  /// Appends the initializer to ImportOptions::initialValues when asked.
  void recordInitialValue(const onnx::TensorProto &t, const std::string &what);
  std::string readExternal(const onnx::TensorProto &t, int64_t bytes,
                           const std::string &what);
  /// Validates an initializer's external data entry; returns the file path.
  std::string externalPath(const onnx::TensorProto &t, int64_t bytes,
                           const std::string &what, int64_t &offset);
  Type mlirType(int onnxType, const std::string &what);
  void classifyInitializers();
  void makeArguments();

  // Nodes.
  void importNode(const onnx::NodeProto &n, int index);
  bool tryFold(const onnx::NodeProto &n);
  void build(const onnx::NodeProto &n);
  void buildCustom(const onnx::NodeProto &n, const CustomOpRule &rule);

  // Input access.
  bool hasInput(int k) const;
  Slot &slot(int k);
  Value val(int k);
  const HostTensor *cst(int k);
  const HostTensor &needConst(int k, StringRef what);
  SmallVector<int64_t> shapeOf(int k);
  ElemKind kindOf(int k);
  Value materialize(const HostTensor &t, StringRef name);
  void define(int outIdx, Value v);
  void defineConst(int outIdx, HostTensor t);

  // Attributes.
  const onnx::AttributeProto *attr(StringRef name) const;
  int64_t attrInt(StringRef name, int64_t dflt) const;
  float attrFloat(StringRef name, float dflt) const;
  std::string attrString(StringRef name, StringRef dflt) const;
  std::optional<std::vector<int64_t>> attrInts(StringRef name) const;

  // Helpers.
  [[noreturn]] void fail(const std::string &msg) const;
  int64_t normAxis(int64_t axis, int64_t rank) const;
  RankedTensorType tensorType(ArrayRef<int64_t> shape, Type elt) {
    for (int64_t d : shape)
      if (d < 0)
        fail("shape " + formatShape(shape) + " has a negative dimension");
    return RankedTensorType::get(shape, elt);
  }
  Type eltOf(Value v) { return cast<RankedTensorType>(v.getType()).getElementType(); }
  ArrayRef<int64_t> shp(Value v) { return cast<RankedTensorType>(v.getType()).getShape(); }
  void expect(const ShapeOrError &s) const {
    if (!s.ok())
      fail(s.error);
  }
  template <typename OpTy> Value binary(Value l, Value r, bool boolResult = false);
  Value reshape(Value v, ArrayRef<int64_t> shape);
  SmallVector<int64_t> reduceAxes(const onnx::NodeProto &n, int64_t rank);
  void normalizeSlice(ArrayRef<int64_t> shape, SmallVectorImpl<int64_t> &starts,
                      SmallVectorImpl<int64_t> &ends, SmallVectorImpl<int64_t> &steps);
  bool outputUsed(int k) const;

  MLIRContext &ctx;
  OpBuilder b;
  const ImportOptions &opts;
  std::string file, baseDir;
  onnx::ModelProto model;
  int64_t opset = 0;
  llvm::StringMap<Slot> env;
  llvm::StringSet<> paramNames, bufferNames, frozenNames;
  bool haveParamMetadata = false;
  llvm::StringMap<unsigned> useCount;
  func::FuncOp func;
  Block *entry = nullptr;
  SmallVector<DictionaryAttr> argAttrs;
  const onnx::NodeProto *node = nullptr;
  std::string nodeLabel; ///< the node's name, or OpType_index when it has none
  Location loc = UnknownLoc::get(&ctx);
};

void Importer::fail(const std::string &msg) const {
  if (node) {
    bool standard = node->domain().empty() || node->domain() == "ai.onnx";
    std::string what = standard ? node->op_type() : node->domain() + "::" + node->op_type();
    throw ImportFailure{"node '" + nodeLabel + "' (" + what + "): " + msg};
  }
  throw ImportFailure{msg};
}

//===----------------------------------------------------------------------===//
// Reading and validation
//===----------------------------------------------------------------------===//

/// Whether the JSON `text` nests arrays and objects at most `limit` deep.
static bool nestsAtMost(StringRef text, int limit) {
  int depth = 0;
  bool inString = false;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (inString) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        inString = false;
    } else if (c == '"') {
      inString = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit)
        return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

void Importer::parse(StringRef bytes) {
  if (bytes.empty())
    fail("the file is empty");
  if (bytes.size() > (size_t)INT32_MAX)
    fail("the file is larger than 2 GiB; store the weights as external data");
  if (!model.ParseFromArray(bytes.data(), (int)bytes.size()))
    fail("not an ONNX model: the protobuf data is truncated or corrupt");
  if (!model.has_ir_version() || model.ir_version() <= 0)
    fail("not an ONNX model: it has no ir_version (random or foreign protobuf data?)");
  if (!model.has_graph())
    fail("the model has no graph");
  for (const auto &op : model.opset_import())
    if (op.domain().empty() || op.domain() == "ai.onnx")
      opset = op.version();
  if (opset == 0)
    fail("the model imports no opset of the default ONNX domain");
  if (opset < 13 || opset > 21)
    fail("opset " + std::to_string(opset) +
         " is not supported (carve reads opsets 13 to 21; re-export with "
         "opset_version=17)");
  const onnx::GraphProto &g = model.graph();
  if (g.output_size() == 0)
    fail("the graph has no outputs");
}

Type Importer::mlirType(int t, const std::string &what) {
  switch ((ElemKind)t) {
  case ElemKind::F32: return b.getF32Type();
  case ElemKind::F64: return b.getF64Type();
  case ElemKind::F16: return b.getF16Type();
  case ElemKind::BF16: return b.getBF16Type();
  case ElemKind::I64: return b.getI64Type();
  case ElemKind::I32: return b.getI32Type();
  case ElemKind::I8: return b.getIntegerType(8);
  case ElemKind::U8: return b.getIntegerType(8, /*isSigned=*/false);
  case ElemKind::Bool: return b.getI1Type();
  }
  fail(what + " has element type " + elemKindName(t) + ", which carve does not support");
}

std::string Importer::externalPath(const onnx::TensorProto &t, int64_t bytes,
                                   const std::string &what, int64_t &offset) {
  std::string location;
  int64_t length = -1;
  offset = 0;
  for (const auto &kv : t.external_data()) {
    StringRef value = kv.value();
    if (kv.key() == "location")
      location = kv.value();
    else if ((kv.key() == "offset" && value.getAsInteger(10, offset)) ||
             (kv.key() == "length" && value.getAsInteger(10, length)))
      fail(what + ": external data " + kv.key() + " '" + kv.value() + "' is not a number");
  }
  if (location.empty())
    fail(what + " is stored externally but names no location");
  if (llvm::sys::path::is_absolute(location) || StringRef(location).contains(".."))
    fail(what + ": external data location '" + location +
         "' must be a relative path inside the model's folder");
  SmallVector<char> full(baseDir.begin(), baseDir.end());
  llvm::sys::path::append(full, location);
  std::string path(full.begin(), full.end());
  uint64_t fileSize = 0;
  if (llvm::sys::fs::file_size(path, fileSize))
    fail(what + ": external data file '" + path + "' does not exist");
  if (length >= 0 && length != bytes)
    fail(what + ": external data length " + std::to_string(length) + " should be " +
         std::to_string(bytes) + " bytes for its shape");
  if (offset < 0 || (uint64_t)(offset + bytes) > fileSize)
    fail(what + ": external data file '" + path + "' is too short (" +
         std::to_string(fileSize) + " bytes, need " + std::to_string(offset + bytes) + ")");
  return path;
}

std::string Importer::readExternal(const onnx::TensorProto &t, int64_t bytes,
                                   const std::string &what) {
  int64_t offset;
  std::string path = externalPath(t, bytes, what, offset);
  auto buf = llvm::MemoryBuffer::getFileSlice(path, bytes, offset);
  if (!buf)
    fail(what + ": cannot read external data file '" + path + "': " +
         buf.getError().message());
  return (*buf)->getBuffer().str();
}

/// Checks that an initializer's data matches its declared type and shape
/// without reading external data.
void Importer::checkInitializer(const onnx::TensorProto &t) {
  std::string what = "initializer '" + t.name() + "'";
  if (t.name().empty())
    fail("an initializer has no name");
  if (!isSupportedKind(t.data_type()))
    fail(what + " has element type " + elemKindName(t.data_type()) +
         ", which carve does not support");
  int64_t n = 1;
  for (int64_t d : t.dims()) {
    if (d < 0)
      fail(what + " has a negative dimension");
    if (__builtin_mul_overflow(n, d, &n) || n > (int64_t(1) << 40))
      fail(what + " has too many elements");
  }
  int64_t bytes = n * elemBytes(t.data_type());
  if (t.data_location() == onnx::TensorProto::EXTERNAL) {
    int64_t offset;
    (void)externalPath(t, bytes, what, offset);
    return;
  }
  int64_t have;
  if (t.has_raw_data())
    have = t.raw_data().size() / std::max<int64_t>(elemBytes(t.data_type()), 1);
  else
    have = t.float_data_size() + t.int32_data_size() + t.int64_data_size() +
           t.double_data_size();
  if (t.has_raw_data() && (int64_t)t.raw_data().size() != bytes)
    fail(what + " holds " + std::to_string(t.raw_data().size()) + " bytes, but shape " +
         formatShape(SmallVector<int64_t>(t.dims().begin(), t.dims().end())) + " of " +
         elemKindName(t.data_type()) + " needs " + std::to_string(bytes));
  if (!t.has_raw_data() && have != n)
    fail(what + " holds " + std::to_string(have) + " values, but its shape needs " +
         std::to_string(n));
}

HostTensor Importer::loadTensor(const onnx::TensorProto &t, const std::string &what) {
  SmallVector<int64_t> shape(t.dims().begin(), t.dims().end());
  int64_t n = numElements(shape);
  int type = t.data_type();
  if (!isSupportedKind(type))
    fail(what + " has element type " + elemKindName(type) + ", which carve does not support");
  ElemKind kind = (ElemKind)type;
  std::string raw;
  bool isRaw = t.has_raw_data() || t.data_location() == onnx::TensorProto::EXTERNAL;
  if (t.data_location() == onnx::TensorProto::EXTERNAL)
    raw = readExternal(t, n * elemBytes(type), what);
  else if (t.has_raw_data())
    raw = t.raw_data();
  if (isRaw && (int64_t)raw.size() != n * elemBytes(type))
    fail(what + " holds " + std::to_string(raw.size()) + " bytes, but its shape needs " +
         std::to_string(n * elemBytes(type)));
  const char *p = raw.data();
  try {
    if (isFloatKind(kind)) {
      std::vector<double> v(n);
      for (int64_t k = 0; k < n; ++k) {
        if (!isRaw) {
          if (kind == ElemKind::F64)
            v[k] = k < t.double_data_size() ? t.double_data(k) : NAN;
          else if (kind == ElemKind::F32)
            v[k] = k < t.float_data_size() ? t.float_data(k) : NAN;
          else // f16 / bf16 bits in int32_data
            v[k] = k < t.int32_data_size()
                       ? (kind == ElemKind::F16 ? halfToFloat(t.int32_data(k))
                                                : bf16ToFloat(t.int32_data(k)))
                       : NAN;
          continue;
        }
        if (kind == ElemKind::F32) {
          float f;
          std::memcpy(&f, p + 4 * k, 4);
          v[k] = f;
        } else if (kind == ElemKind::F64) {
          std::memcpy(&v[k], p + 8 * k, 8);
        } else {
          uint16_t h;
          std::memcpy(&h, p + 2 * k, 2);
          v[k] = kind == ElemKind::F16 ? halfToFloat(h) : bf16ToFloat(h);
        }
      }
      return HostTensor::floats(kind, shape, std::move(v));
    }
    std::vector<int64_t> v(n);
    for (int64_t k = 0; k < n; ++k) {
      if (!isRaw) {
        if (kind == ElemKind::I64)
          v[k] = k < t.int64_data_size() ? t.int64_data(k) : 0;
        else
          v[k] = k < t.int32_data_size() ? t.int32_data(k) : 0;
        continue;
      }
      switch (kind) {
      case ElemKind::I64: std::memcpy(&v[k], p + 8 * k, 8); break;
      case ElemKind::I32: { int32_t x; std::memcpy(&x, p + 4 * k, 4); v[k] = x; break; }
      case ElemKind::I8: v[k] = (int8_t)p[k]; break;
      case ElemKind::U8: v[k] = (uint8_t)p[k]; break;
      case ElemKind::Bool: v[k] = p[k] != 0; break;
      default: break;
      }
    }
    return HostTensor::ints(kind, shape, std::move(v));
  } catch (const HostError &e) {
    fail(what + ": " + e.what());
  }
}

void Importer::classifyInitializers() {
  const onnx::GraphProto &g = model.graph();
  llvm::StringSet<> initNames;
  for (const auto &t : g.initializer()) {
    checkInitializer(t);
    if (!initNames.insert(t.name()).second)
      fail("initializer '" + t.name() + "' is defined twice");
  }
  // The export helper in models/ records named_parameters() / named_buffers().
  for (const auto &prop : model.metadata_props()) {
    bool params = prop.key() == "carve.parameters", buffers = prop.key() == "carve.buffers";
    if (!params && !buffers)
      continue;
    // llvm::json's parser recurses once per level: a flat list needs two.
    if (!nestsAtMost(prop.value(), 2))
      fail("metadata '" + prop.key() + "' is not a JSON list of names");
    auto parsed = llvm::json::parse(prop.value());
    const llvm::json::Array *list = parsed ? parsed->getAsArray() : nullptr;
    if (!parsed)
      llvm::consumeError(parsed.takeError());
    if (!list)
      fail("metadata '" + prop.key() + "' is not a JSON list of names");
    for (const llvm::json::Value &v : *list) {
      auto name = v.getAsString();
      if (!name)
        fail("metadata '" + prop.key() + "' holds a non-string entry");
      if (params) {
        if (!initNames.count(*name))
          fail("metadata names parameter '" + name->str() +
               "' but the graph has no initializer of that name (was the model exported "
               "with do_constant_folding=True? see models/README.md)");
        paramNames.insert(*name);
      } else {
        bufferNames.insert(*name);
      }
    }
    haveParamMetadata |= params;
  }
  if (!haveParamMetadata)
    for (const auto &t : g.initializer())
      if (isFloatKind((ElemKind)t.data_type()))
        paramNames.insert(t.name());

  for (const std::string &glob : opts.frozen) {
    auto pattern = llvm::GlobPattern::create(glob);
    if (!pattern) {
      std::string why = llvm::toString(pattern.takeError());
      fail("--frozen '" + glob + "' is not a valid glob: " + why);
    }
    bool matched = false;
    for (const auto &name : paramNames)
      if (pattern->match(name.getKey())) {
        frozenNames.insert(name.getKey());
        matched = true;
      }
    if (!matched)
      fail("--frozen '" + glob + "' matches no parameter of the model");
  }

  for (const auto &t : g.initializer()) {
    Slot s;
    s.init = &t;
    s.isParam = paramNames.count(t.name());
    env[t.name()] = s;
  }
}

void Importer::makeArguments() {
  const onnx::GraphProto &g = model.graph();
  std::set<std::string> symbols;
  loc = FileLineColLoc::get(&ctx, file, 0, 0);
  func = func::FuncOp::create(b, loc, "forward", b.getFunctionType({}, {}));
  entry = func.addEntryBlock();

  for (const auto &in : g.input()) {
    if (env.count(in.name()))
      continue; // an initializer listed as an input (IR version < 4)
    std::string what = "input '" + in.name() + "'";
    if (!in.type().has_tensor_type())
      fail(what + " is not a tensor");
    const auto &tt = in.type().tensor_type();
    Type elt = mlirType(tt.elem_type(), what);
    if (!tt.has_shape())
      fail(what + " has no shape; export with fixed or named (dynamic_axes) dimensions");
    SmallVector<int64_t> shape;
    for (int d = 0; d < tt.shape().dim_size(); ++d) {
      const auto &dim = tt.shape().dim(d);
      if (d == 0 && opts.batch > 0) {
        // One rank's share of the batch; a symbolic batch counts as bound.
        if (dim.has_dim_param())
          symbols.insert(dim.dim_param());
        shape.push_back(opts.batch);
        continue;
      }
      if (dim.has_dim_value()) {
        if (dim.dim_value() <= 0)
          fail(what + " dimension " + std::to_string(d) + " has size " +
               std::to_string(dim.dim_value()));
        shape.push_back(dim.dim_value());
        continue;
      }
      std::string sym = dim.has_dim_param() ? dim.dim_param() : "";
      if (sym.empty())
        fail(what + " dimension " + std::to_string(d) +
             " has no size and no name; export it with dynamic_axes and bind it with "
             "--set-dim");
      symbols.insert(sym);
      auto it = opts.dims.find(sym);
      if (it == opts.dims.end())
        fail(what + " dimension " + std::to_string(d) + " is symbolic ('" + sym +
             "'); bind it with --set-dim " + sym + "=N");
      shape.push_back(it->second);
    }
    Value arg = entry->addArgument(tensorType(shape, elt), loc);
    argAttrs.push_back(b.getDictionaryAttr(
        {b.getNamedAttr(kInputAttr, b.getStringAttr(in.name()))}));
    Slot s;
    s.value = arg;
    env[in.name()] = s;
  }
  for (const auto &entryDim : opts.dims)
    if (!symbols.count(entryDim.getKey().str())) {
      std::string known;
      for (const auto &s : symbols)
        known += (known.empty() ? "" : ", ") + s;
      fail("--set-dim " + entryDim.getKey().str() +
           ": the model has no symbolic dimension of that name (" +
           (known.empty() ? std::string("it has none") : "it has: " + known) + ")");
    }

  for (const auto &t : g.initializer()) {
    if (!paramNames.count(t.name()))
      continue;
    std::string what = "parameter '" + t.name() + "'";
    SmallVector<int64_t> shape(t.dims().begin(), t.dims().end());
    Value arg = entry->addArgument(tensorType(shape, mlirType(t.data_type(), what)), loc);
    SmallVector<NamedAttribute> attrs = {
        b.getNamedAttr(kParamAttr, b.getStringAttr(t.name()))};
    if (!frozenNames.count(t.name()))
      attrs.push_back(b.getNamedAttr(kTrainableAttr, b.getUnitAttr()));
    argAttrs.push_back(b.getDictionaryAttr(attrs));
    Slot &s = env[t.name()];
    s.value = arg;
    s.init = nullptr;
    s.isParam = true;
    recordInitialValue(t, what);
  }
}

void Importer::rescaleBatch(std::vector<int64_t> &req, ArrayRef<int64_t> in) const {
  if (opts.batch <= 0 || opts.globalBatch <= opts.batch || opts.globalBatch % opts.batch ||
      req.empty() || in.empty())
    return;
  int64_t ratio = opts.globalBatch / opts.batch;
  bool hasInfer = llvm::is_contained(req, -1);
  if (hasInfer) {
    // view(B, ...): the leading entry is the global batch and so is the input's.
    if (req[0] == opts.globalBatch && in[0] == opts.batch)
      req[0] = opts.batch;
    return;
  }
  // A fully given shape that is exactly `ratio` times too large: the batch is
  // folded into its leading entry (view(B, T, h, d), view(B * T, C)).
  int64_t known = 1;
  for (size_t k = 0; k < req.size(); ++k) {
    int64_t d = req[k] == 0 && k < in.size() ? in[k] : req[k];
    if (d <= 0)
      return;
    known *= d;
  }
  if (known == numElements(in) * ratio && req[0] % ratio == 0)
    req[0] /= ratio;
}

void Importer::recordInitialValue(const onnx::TensorProto &t, const std::string &what) {
  if (!opts.initialValues)
    return;
  HostTensor h = loadTensor(t, what);
  ImportOptions::InitialValue v;
  v.name = t.name();
  v.shape.assign(t.dims().begin(), t.dims().end());
  v.data.resize(h.size());
  for (int64_t k = 0; k < h.size(); ++k)
    v.data[k] = (float)h.asDouble(k);
  opts.initialValues->push_back(std::move(v));
}

//===----------------------------------------------------------------------===//
// Input access
//===----------------------------------------------------------------------===//

bool Importer::hasInput(int k) const {
  return k < node->input_size() && !node->input(k).empty();
}

Slot &Importer::slot(int k) {
  if (!hasInput(k))
    fail("input " + std::to_string(k) + " is missing (the node has " +
         std::to_string(node->input_size()) + ")");
  const std::string &name = node->input(k);
  auto it = env.find(name);
  if (it == env.end())
    fail("input '" + name +
         "' is not produced by any earlier node, graph input or initializer (a missing "
         "initializer, or nodes out of topological order)");
  return it->second;
}

const HostTensor *Importer::cst(int k) {
  Slot &s = slot(k);
  if (s.constant)
    return &*s.constant;
  if (s.isParam)
    return nullptr;
  if (s.init) {
    s.constant = loadTensor(*s.init, "initializer '" + s.init->name() + "'");
    return &*s.constant;
  }
  return nullptr;
}

const HostTensor &Importer::needConst(int k, StringRef what) {
  if (!hasInput(k))
    fail(what.str() + " (input " + std::to_string(k) + ") is missing");
  const HostTensor *t = cst(k);
  if (!t)
    fail(what.str() + " ('" + node->input(k) +
         "') must be a constant known at import; carve compiles static shapes only");
  return *t;
}

Value Importer::val(int k) {
  Slot &s = slot(k);
  if (s.value)
    return s.value;
  const std::string &name = node->input(k);
  if (s.init && bufferNames.count(name)) {
    // A buffer (BatchNorm statistics, ...) used by real computation: an argument.
    const onnx::TensorProto &t = *s.init;
    SmallVector<int64_t> shape(t.dims().begin(), t.dims().end());
    Value arg = entry->addArgument(
        tensorType(shape, mlirType(t.data_type(), "buffer '" + name + "'")), loc);
    argAttrs.push_back(
        b.getDictionaryAttr({b.getNamedAttr(kBufferAttr, b.getStringAttr(name))}));
    s.value = arg;
    recordInitialValue(t, "buffer '" + name + "'");
    return arg;
  }
  const HostTensor *t = cst(k);
  s.value = materialize(*t, name);
  return s.value;
}

SmallVector<int64_t> Importer::shapeOf(int k) {
  Slot &s = slot(k);
  if (s.value)
    return SmallVector<int64_t>(shp(s.value));
  if (s.constant)
    return s.constant->shape;
  return SmallVector<int64_t>(s.init->dims().begin(), s.init->dims().end());
}

ElemKind Importer::kindOf(int k) {
  Slot &s = slot(k);
  if (s.constant)
    return s.constant->kind;
  if (s.init)
    return (ElemKind)s.init->data_type();
  Type t = eltOf(s.value);
  if (t.isF32()) return ElemKind::F32;
  if (t.isF64()) return ElemKind::F64;
  if (t.isF16()) return ElemKind::F16;
  if (t.isBF16()) return ElemKind::BF16;
  if (t.isInteger(64)) return ElemKind::I64;
  if (t.isInteger(32)) return ElemKind::I32;
  if (t.isInteger(1)) return ElemKind::Bool;
  if (t.isUnsignedInteger(8)) return ElemKind::U8;
  return ElemKind::I8;
}

Value Importer::materialize(const HostTensor &t, StringRef name) {
  Type elt = mlirType((int)t.kind, "constant '" + name.str() + "'");
  auto type = tensorType(t.shape, elt);
  ElementsAttr attr;
  bool splat = t.size() > 0;
  for (int64_t k = 1; k < t.size() && splat; ++k)
    splat = t.isFloat() ? t.f[k] == t.f[0] : t.i[k] == t.i[0];
  // Large non-splat f32/i64 constants print as named blobs at the end of the module.
  bool asBlob = !splat && t.size() > kInlineConstantLimit;
  StringRef blobName = name.empty() ? StringRef("constant") : name;
  if (t.kind == ElemKind::Bool) {
    SmallVector<bool> v;
    for (int64_t x : t.i)
      v.push_back(x != 0);
    attr = DenseElementsAttr::get(type, ArrayRef<bool>(v));
  } else if (asBlob && t.kind == ElemKind::F32) {
    std::vector<float> raw(t.f.begin(), t.f.end());
    attr = DenseResourceElementsAttr::get(
        type, blobName, HeapAsmResourceBlob::allocateAndCopyInferAlign(ArrayRef<float>(raw)));
  } else if (asBlob && t.kind == ElemKind::I64) {
    attr = DenseResourceElementsAttr::get(
        type, blobName, HeapAsmResourceBlob::allocateAndCopyInferAlign(ArrayRef<int64_t>(t.i)));
  } else if (t.isFloat()) {
    const llvm::fltSemantics &sem = cast<FloatType>(elt).getFloatSemantics();
    SmallVector<llvm::APFloat> v;
    for (double x : t.f) {
      llvm::APFloat f(x);
      bool lost;
      f.convert(sem, llvm::APFloat::rmNearestTiesToEven, &lost);
      v.push_back(f);
    }
    attr = DenseElementsAttr::get(type, v);
  } else {
    unsigned width = elt.getIntOrFloatBitWidth();
    SmallVector<llvm::APInt> v;
    for (int64_t x : t.i)
      v.push_back(llvm::APInt(width, (uint64_t)x, /*isSigned=*/true, /*implicitTrunc=*/true));
    attr = DenseElementsAttr::get(type, v);
  }
  return ConstantOp::create(b, loc, attr);
}

void Importer::define(int k, Value v) {
  if (k >= node->output_size() || node->output(k).empty())
    return;
  Slot s;
  s.value = v;
  env[node->output(k)] = s;
}

void Importer::defineConst(int k, HostTensor t) {
  if (k >= node->output_size() || node->output(k).empty())
    return;
  Slot s;
  s.constant = std::move(t);
  env[node->output(k)] = s;
}

bool Importer::outputUsed(int k) const {
  if (k >= node->output_size() || node->output(k).empty())
    return false;
  return useCount.lookup(node->output(k)) > 0;
}

//===----------------------------------------------------------------------===//
// Attributes
//===----------------------------------------------------------------------===//

const onnx::AttributeProto *Importer::attr(StringRef name) const {
  for (const auto &a : node->attribute())
    if (a.name() == name)
      return &a;
  return nullptr;
}

int64_t Importer::attrInt(StringRef name, int64_t dflt) const {
  const auto *a = attr(name);
  return a ? a->i() : dflt;
}

float Importer::attrFloat(StringRef name, float dflt) const {
  const auto *a = attr(name);
  return a ? a->f() : dflt;
}

std::string Importer::attrString(StringRef name, StringRef dflt) const {
  const auto *a = attr(name);
  return a ? a->s() : dflt.str();
}

std::optional<std::vector<int64_t>> Importer::attrInts(StringRef name) const {
  const auto *a = attr(name);
  if (!a)
    return std::nullopt;
  return std::vector<int64_t>(a->ints().begin(), a->ints().end());
}

int64_t Importer::normAxis(int64_t axis, int64_t rank) const {
  int64_t a = axis < 0 ? axis + rank : axis;
  if (a < 0 || a >= rank)
    fail("axis " + std::to_string(axis) + " is out of range for rank " +
         std::to_string(rank));
  return a;
}

//===----------------------------------------------------------------------===//
// Nodes
//===----------------------------------------------------------------------===//

template <typename OpTy> Value Importer::binary(Value l, Value r, bool boolResult) {
  if (eltOf(l) != eltOf(r)) {
    std::string a, c;
    llvm::raw_string_ostream(a) << eltOf(l);
    llvm::raw_string_ostream(c) << eltOf(r);
    fail("operand element types differ (" + a + " vs " + c + ")");
  }
  ShapeOrError s = broadcastShapes(shp(l), shp(r));
  expect(s);
  bool logical = std::is_same_v<OpTy, AndOp> || std::is_same_v<OpTy, OrOp>;
  if (logical != eltOf(l).isInteger(1))
    fail(logical ? "the inputs must be BOOL" : "arithmetic on BOOL is not supported");
  Type elt = boolResult ? b.getI1Type() : eltOf(l);
  return OpTy::create(b, loc, tensorType(s.shape, elt), l, r);
}

Value Importer::reshape(Value v, ArrayRef<int64_t> shape) {
  if (shp(v) == shape)
    return v;
  if (numElements(shp(v)) != numElements(shape))
    fail("cannot reshape " + formatShape(shp(v)) + " to " + formatShape(shape));
  return ReshapeOp::create(b, loc, tensorType(shape, eltOf(v)), v);
}

SmallVector<int64_t> Importer::reduceAxes(const onnx::NodeProto &n, int64_t rank) {
  std::vector<int64_t> axes;
  bool axesAsInput = n.op_type() == "ReduceSum" || opset >= 18;
  if (axesAsInput) {
    if (attr("axes"))
      fail("the axes attribute was replaced by an input at this opset");
    if (hasInput(1))
      axes = needConst(1, "axes").toInts();
  } else {
    if (hasInput(1))
      fail("axes is an attribute, not an input, before opset 18");
    if (auto a = attrInts("axes"))
      axes = *a;
  }
  if (axes.empty() && attrInt("noop_with_empty_axes", 0))
    return {};
  SmallVector<int64_t> out;
  if (axes.empty())
    for (int64_t d = 0; d < rank; ++d)
      out.push_back(d);
  for (int64_t a : axes)
    out.push_back(normAxis(a, rank));
  llvm::sort(out);
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

void Importer::normalizeSlice(ArrayRef<int64_t> shape, SmallVectorImpl<int64_t> &starts,
                              SmallVectorImpl<int64_t> &ends,
                              SmallVectorImpl<int64_t> &steps) {
  int64_t rank = shape.size();
  starts.assign(rank, 0);
  ends.assign(shape.begin(), shape.end());
  steps.assign(rank, 1);
  std::vector<int64_t> st = needConst(1, "starts").toInts();
  std::vector<int64_t> en = needConst(2, "ends").toInts();
  std::vector<int64_t> ax, sp;
  if (hasInput(3))
    ax = needConst(3, "axes").toInts();
  else
    for (size_t k = 0; k < st.size(); ++k)
      ax.push_back(k);
  if (hasInput(4))
    sp = needConst(4, "steps").toInts();
  else
    sp.assign(st.size(), 1);
  if (en.size() != st.size() || ax.size() != st.size() || sp.size() != st.size())
    fail("starts, ends, axes and steps have different lengths");
  for (size_t k = 0; k < st.size(); ++k) {
    int64_t a = normAxis(ax[k], rank), dim = shape[a], step = sp[k];
    if (step == 0)
      fail("slice step is 0");
    auto clampIdx = [&](int64_t v, int64_t lo, int64_t hi) {
      if (v < 0)
        v = v < -dim ? lo : v + dim;
      return std::max(lo, std::min(hi, v));
    };
    if (step > 0) {
      starts[a] = clampIdx(st[k], 0, dim);
      ends[a] = std::max(starts[a], clampIdx(en[k], 0, dim));
    } else {
      starts[a] = clampIdx(st[k], -1, dim - 1);
      ends[a] = clampIdx(en[k], -1, dim - 1);
      if (en[k] < -dim)
        ends[a] = -1;
    }
    steps[a] = step;
  }
}

/// Evaluates `n` on the host if all its inputs are constants; returns true if
/// it did.
bool Importer::tryFold(const onnx::NodeProto &n) {
  const std::string &op = n.op_type();
  // Shape and Size need only the input's static type.
  if (op == "Shape" || op == "Size") {
    SmallVector<int64_t> s = shapeOf(0);
    if (op == "Size") {
      defineConst(0, HostTensor::ints(ElemKind::I64, {}, {numElements(s)}));
      return true;
    }
    int64_t rank = s.size();
    int64_t start = attrInt("start", 0), end = attrInt("end", rank);
    start = std::clamp<int64_t>(start < 0 ? start + rank : start, 0, rank);
    end = std::clamp<int64_t>(end < 0 ? end + rank : end, 0, rank);
    defineConst(0, HostTensor::vec(ArrayRef<int64_t>(s).slice(start, std::max<int64_t>(
                                                                        end - start, 0))));
    return true;
  }
  if (op == "Constant") {
    const auto *a = n.attribute_size() == 1 ? &n.attribute(0) : nullptr;
    if (!a)
      fail("a Constant node needs exactly one attribute");
    if (a->name() == "value")
      defineConst(0, loadTensor(a->t(), "constant '" +
                                            (n.output_size() ? n.output(0) : nodeLabel) + "'"));
    else if (a->name() == "value_float")
      defineConst(0, HostTensor::floats(ElemKind::F32, {}, {a->f()}));
    else if (a->name() == "value_floats")
      defineConst(0, HostTensor::floats(ElemKind::F32, {(int64_t)a->floats_size()},
                                        std::vector<double>(a->floats().begin(),
                                                            a->floats().end())));
    else if (a->name() == "value_int")
      defineConst(0, HostTensor::ints(ElemKind::I64, {}, {a->i()}));
    else if (a->name() == "value_ints")
      defineConst(0, HostTensor::vec(std::vector<int64_t>(a->ints().begin(),
                                                           a->ints().end())));
    else
      fail("Constant attribute '" + a->name() + "' is not supported");
    return true;
  }
  if (op == "ConstantOfShape") {
    std::vector<int64_t> shape = needConst(0, "shape").toInts();
    HostTensor value = HostTensor::floats(ElemKind::F32, {}, {0.0});
    if (const auto *a = attr("value"))
      value = loadTensor(a->t(), "ConstantOfShape value");
    for (int64_t d : shape)
      if (d < 0)
        fail("shape " + formatShape(shape) + " has a negative dimension");
    if (numElements(shape) > kFoldLimit)
      fail("ConstantOfShape of " + formatShape(shape) + " is too large to build at import");
    defineConst(0, hostExpand(hostReshape(value, {}), shape));
    return true;
  }

  SmallVector<const HostTensor *> in;
  for (int k = 0; k < n.input_size(); ++k) {
    if (n.input(k).empty()) {
      in.push_back(nullptr);
      continue;
    }
    const HostTensor *t = cst(k);
    if (!t)
      return false;
    in.push_back(t);
  }
  if (in.empty() || !in[0])
    return false;
  const HostTensor &x = *in[0];
  static const std::set<std::string> binaryOps = {"Add", "Sub", "Mul", "Div", "Pow",
                                                  "Max", "Min", "Mod", "Equal", "Less",
                                                  "Greater", "And", "Or"};
  static const std::set<std::string> unaryOps = {"Neg", "Abs", "Sqrt", "Reciprocal",
                                                 "Exp", "Log", "Floor", "Ceil", "Not",
                                                 "Relu", "Sigmoid", "Tanh", "Erf", "Sin",
                                                 "Cos"};
  if (x.size() > kFoldLimit)
    return false;
  if (binaryOps.count(op) && in.size() == 2) {
    ShapeOrError s = broadcastShapes(x.shape, in[1]->shape);
    if (s.ok() && numElements(s.shape) > kFoldLimit)
      return false;
    defineConst(0, hostBinary(op, x, *in[1]));
  } else if (unaryOps.count(op)) {
    defineConst(0, hostUnary(op, x));
  } else if (op == "Identity") {
    defineConst(0, x);
  } else if (op == "Cast") {
    int to = attrInt("to", 0);
    if (!isSupportedKind(to))
      fail("cast to " + elemKindName(to) + " is not supported");
    defineConst(0, hostCast(x, (ElemKind)to));
  } else if (op == "Where") {
    defineConst(0, hostWhere(x, *in[1], *in[2]));
  } else if (op == "Reshape") {
    // Shares the shape rule with the non-constant path below.
    return false;
  } else if (op == "Unsqueeze" || op == "Squeeze" || op == "Flatten") {
    return false;
  } else if (op == "Transpose") {
    std::vector<int64_t> perm;
    if (auto p = attrInts("perm"))
      perm = *p;
    else
      for (int64_t d = (int64_t)x.shape.size() - 1; d >= 0; --d)
        perm.push_back(d);
    defineConst(0, hostTranspose(x, perm));
  } else if (op == "Slice") {
    SmallVector<int64_t> st, en, sp;
    normalizeSlice(x.shape, st, en, sp);
    defineConst(0, hostSlice(x, st, en, sp));
  } else if (op == "Concat") {
    SmallVector<const HostTensor *> parts;
    for (const HostTensor *t : in)
      if (t)
        parts.push_back(t);
    defineConst(0, hostConcat(parts, normAxis(attrInt("axis", 0), x.shape.size())));
  } else if (op == "Gather") {
    defineConst(0, hostGather(x, *in[1], normAxis(attrInt("axis", 0), x.shape.size())));
  } else if (op == "Expand") {
    std::vector<int64_t> shape = in[1]->toInts();
    ShapeOrError s = broadcastShapes(x.shape, shape);
    if (s.ok() && numElements(s.shape) > kFoldLimit)
      return false;
    defineConst(0, hostExpand(x, shape));
  } else if (op == "Trilu") {
    int64_t k = in.size() > 1 && in[1] ? in[1]->asInt(0) : 0;
    defineConst(0, hostTrilu(x, k, attrInt("upper", 1) != 0));
  } else if (op == "Range") {
    double count = (in[1]->asDouble(0) - x.asDouble(0)) / in[2]->asDouble(0);
    if (in[2]->asDouble(0) != 0 && count > (double)kFoldLimit)
      fail("Range of " + std::to_string((int64_t)count) +
           " elements is too large to build at import");
    defineConst(0, hostRange(x, *in[1], *in[2]));
  } else if (op == "ReduceSum" || op == "ReduceMean" || op == "ReduceMax" ||
             op == "ReduceMin" || op == "ReduceProd") {
    SmallVector<int64_t> axes = reduceAxes(n, x.shape.size());
    defineConst(0, axes.empty() ? x : hostReduce(op, x, axes, attrInt("keepdims", 1)));
  } else {
    return false;
  }
  return true;
}

void Importer::importNode(const onnx::NodeProto &n, int index) {
  node = &n;
  nodeLabel = n.name().empty() ? n.op_type() + "_" + std::to_string(index) : n.name();
  loc = NameLoc::get(b.getStringAttr(nodeLabel), FileLineColLoc::get(&ctx, file, index + 1, 0));
  if (!n.domain().empty() && n.domain() != "ai.onnx") {
    for (const CustomOpRule &rule : opts.customOps)
      if (rule.domain == n.domain() && rule.type == n.op_type())
        return buildCustom(n, rule);
    fail("an op of the custom domain '" + n.domain() +
         "' needs a rule; describe it in a rules file and pass that with --rules RULES.json "
         "(docs/custom-ops.md)");
  }
  if (!opTable().count(n.op_type()))
    fail("unsupported op '" + n.op_type() + "' at opset " + std::to_string(opset) +
         "; the supported ops are listed in docs/onnx-ops.md");
  for (int k = 0; k < n.input_size(); ++k)
    if (!n.input(k).empty())
      (void)slot(k);
  try {
    if (tryFold(n))
      return;
  } catch (const HostError &e) {
    fail(e.what());
  }
  if (foldOnlyOps().count(n.op_type()))
    fail("carve evaluates " + n.op_type() +
         " only on constants known at import, but an input is computed from graph inputs "
         "(or is a constant too large to fold)");
  build(n);
}

void Importer::build(const onnx::NodeProto &n) {
  const std::string &op = n.op_type();

  // Elementwise binary ops.
  if (op == "Add") return define(0, binary<AddOp>(val(0), val(1)));
  if (op == "Sub") return define(0, binary<SubOp>(val(0), val(1)));
  if (op == "Mul") return define(0, binary<MulOp>(val(0), val(1)));
  if (op == "Div") return define(0, binary<DivOp>(val(0), val(1)));
  if (op == "Max" || op == "Min") {
    if (n.input_size() != 2)
      fail(op + " with " + std::to_string(n.input_size()) +
           " inputs is not supported (two are)");
    return define(0, op == "Max" ? binary<MaximumOp>(val(0), val(1))
                                 : binary<MinimumOp>(val(0), val(1)));
  }
  if (op == "Pow") {
    Value base = val(0), exponent = val(1);
    if (eltOf(exponent) != eltOf(base))
      exponent = CastOp::create(b, loc, tensorType(shp(exponent), eltOf(base)), exponent);
    return define(0, binary<PowOp>(base, exponent));
  }
  if (op == "Equal") return define(0, binary<EqualOp>(val(0), val(1), true));
  if (op == "Less") return define(0, binary<LessOp>(val(0), val(1), true));
  if (op == "Greater") return define(0, binary<GreaterOp>(val(0), val(1), true));
  if (op == "And") return define(0, binary<AndOp>(val(0), val(1), true));
  if (op == "Or") return define(0, binary<OrOp>(val(0), val(1), true));

  // Elementwise unary ops.
  static const std::set<std::string> anyNumeric = {"Neg", "Abs", "Relu"};
  auto unary = [&](auto tag) {
    using OpTy = decltype(tag);
    Value x = val(0);
    Type elt = eltOf(x);
    if (op == "Not" ? !elt.isInteger(1)
                    : anyNumeric.count(op) ? elt.isInteger(1) : !isa<FloatType>(elt))
      fail(op == "Not" ? std::string("the input must be BOOL")
                       : anyNumeric.count(op) ? std::string("the input must be numeric")
                                              : std::string("the input must be floating-point"));
    return define(0, OpTy::create(b, loc, x.getType(), x));
  };
  if (op == "Neg") return unary(NegOp());
  if (op == "Abs") return unary(AbsOp());
  if (op == "Exp") return unary(ExpOp());
  if (op == "Log") return unary(LogOp());
  if (op == "Sqrt") return unary(SqrtOp());
  if (op == "Reciprocal") return unary(ReciprocalOp());
  if (op == "Tanh") return unary(TanhOp());
  if (op == "Erf") return unary(ErfOp());
  if (op == "Sigmoid") return unary(SigmoidOp());
  if (op == "Relu") return unary(ReluOp());
  if (op == "Sin") return unary(SinOp());
  if (op == "Cos") return unary(CosOp());
  if (op == "Not") return unary(NotOp());
  if (op == "Gelu") {
    std::string approx = attrString("approximate", "none");
    if (approx != "none" && approx != "tanh")
      fail("approximate must be 'none' or 'tanh', got '" + approx + "'");
    Value x = val(0);
    if (!isa<FloatType>(eltOf(x)))
      fail("the input must be floating-point");
    return define(0, GeluOp::create(b, loc, x.getType(), x, b.getStringAttr(approx)));
  }
  if (op == "Identity") return define(0, val(0));
  if (op == "Dropout") {
    if (outputUsed(1))
      fail("the Dropout mask output is not supported");
    bool training = hasInput(2) && needConst(2, "training_mode").asInt(0) != 0;
    double ratio = hasInput(1) ? needConst(1, "ratio").asDouble(0) : 0.5;
    if (training && ratio > 0)
      fail("dropout in training mode is not supported yet; export with p=0 or in eval "
           "mode");
    return define(0, val(0));
  }
  if (op == "Cast") {
    int to = attrInt("to", 0);
    Value x = val(0);
    Type elt = mlirType(to, "Cast target");
    if (elt == eltOf(x))
      return define(0, x);
    return define(0, CastOp::create(b, loc, tensorType(shp(x), elt), x));
  }
  if (op == "Where") {
    Value c = val(0), x = val(1), y = val(2);
    if (!eltOf(c).isInteger(1))
      fail("the condition must be BOOL");
    if (eltOf(x) != eltOf(y))
      fail("the two branches have different element types");
    ShapeOrError s = broadcastShapes(shp(x), shp(y));
    expect(s);
    s = broadcastShapes(shp(c), s.shape);
    expect(s);
    return define(0, WhereOp::create(b, loc, tensorType(s.shape, eltOf(x)), c, x, y));
  }

  // Contractions.
  if (op == "MatMul") {
    Value l = val(0), r = val(1);
    if (eltOf(l) != eltOf(r))
      fail("operand element types differ");
    ShapeOrError s = matmulShape(shp(l), shp(r));
    expect(s);
    return define(0, MatmulOp::create(b, loc, tensorType(s.shape, eltOf(l)), l, r));
  }
  if (op == "Gemm") {
    Value a = val(0), w = val(1);
    if (shp(a).size() != 2 || shp(w).size() != 2)
      fail("Gemm needs 2-D A and B");
    auto transpose2d = [&](Value v) {
      SmallVector<int64_t> s = {shp(v)[1], shp(v)[0]};
      return TransposeOp::create(b, loc, tensorType(s, eltOf(v)), v,
                                 b.getDenseI64ArrayAttr({1, 0}))
          .getResult();
    };
    if (attrInt("transA", 0))
      a = transpose2d(a);
    if (attrInt("transB", 0))
      w = transpose2d(w);
    ShapeOrError s = matmulShape(shp(a), shp(w));
    expect(s);
    Value y = MatmulOp::create(b, loc, tensorType(s.shape, eltOf(a)), a, w);
    auto scalar = [&](float v) {
      return materialize(HostTensor::floats((ElemKind)kindOf(0), {}, {v}), "");
    };
    float alpha = attrFloat("alpha", 1.0f), beta = attrFloat("beta", 1.0f);
    if (alpha != 1.0f)
      y = binary<MulOp>(y, scalar(alpha));
    if (hasInput(2) && beta != 0.0f) {
      Value c = val(2);
      if (beta != 1.0f)
        c = binary<MulOp>(c, scalar(beta));
      y = binary<AddOp>(y, c);
    }
    return define(0, y);
  }

  // Reductions and normalizations.
  if (op == "ReduceSum" || op == "ReduceMean" || op == "ReduceMax") {
    Value x = val(0);
    SmallVector<int64_t> axes = reduceAxes(n, shp(x).size());
    if (axes.empty())
      return define(0, x);
    bool keep = attrInt("keepdims", 1) != 0;
    ShapeOrError s = reduceShape(shp(x), axes, keep);
    expect(s);
    auto type = tensorType(s.shape, eltOf(x));
    auto axesAttr = b.getDenseI64ArrayAttr(axes);
    auto keepAttr = b.getBoolAttr(keep);
    if (op == "ReduceSum")
      return define(0, ReduceSumOp::create(b, loc, type, x, axesAttr, keepAttr));
    if (op == "ReduceMean") {
      if (!isa<FloatType>(eltOf(x)))
        fail("ReduceMean of integers is not supported");
      return define(0, ReduceMeanOp::create(b, loc, type, x, axesAttr, keepAttr));
    }
    return define(0, ReduceMaxOp::create(b, loc, type, x, axesAttr, keepAttr));
  }
  if (op == "Softmax" || op == "LogSoftmax") {
    Value x = val(0);
    if (!isa<FloatType>(eltOf(x)))
      fail("the input must be floating-point");
    int64_t axis = normAxis(attrInt("axis", -1), shp(x).size());
    if (op == "Softmax")
      return define(0, SoftmaxOp::create(b, loc, x.getType(), x, b.getI64IntegerAttr(axis)));
    return define(0, LogSoftmaxOp::create(b, loc, x.getType(), x, b.getI64IntegerAttr(axis)));
  }
  if (op == "LayerNormalization") {
    if (outputUsed(1) || outputUsed(2))
      fail("the Mean and InvStdDev outputs are not supported");
    Value x = val(0);
    if (!isa<FloatType>(eltOf(x)))
      fail("the input must be floating-point");
    int64_t axis = normAxis(attrInt("axis", -1), shp(x).size());
    Value scale = hasInput(1) ? val(1) : Value();
    Value bias = hasInput(2) ? val(2) : Value();
    ArrayRef<int64_t> norm = shp(x).drop_front(axis);
    for (Value p : {scale, bias})
      if (p && !broadcastsTo(shp(p), norm))
        fail("scale/bias shape " + formatShape(shp(p)) +
             " does not match the normalized dimensions " + formatShape(norm));
    if (scale && shp(scale) != norm)
      scale = ExpandOp::create(b, loc, tensorType(norm, eltOf(scale)), scale);
    if (bias && shp(bias) != norm)
      bias = ExpandOp::create(b, loc, tensorType(norm, eltOf(bias)), bias);
    return define(0, LayerNormOp::create(b, loc, x.getType(), x, scale, bias,
                                         b.getI64IntegerAttr(axis),
                                         b.getF32FloatAttr(attrFloat("epsilon", 1e-5f))));
  }
  if (op == "BatchNormalization") {
    Value x = val(0);
    if (shp(x).size() < 2)
      fail("the input needs rank >= 2");
    // Opset 13 has no training_mode: the optional statistics outputs mark it.
    int present = 0;
    for (const auto &o : n.output())
      present += !o.empty();
    bool training = opset >= 14 ? attrInt("training_mode", 0) != 0 : present > 1;
    if (outputUsed(3) || outputUsed(4))
      fail("the saved_mean / saved_var outputs are not supported");
    if (!training && (outputUsed(1) || outputUsed(2)))
      fail("running statistics outputs need training_mode=1");
    SmallVector<Value> ops = {x, val(1), val(2), val(3), val(4)};
    for (int k = 1; k < 5; ++k)
      if (shp(ops[k]) != ArrayRef<int64_t>{shp(x)[1]})
        fail("input " + std::to_string(k) + " must have shape [" +
             std::to_string(shp(x)[1]) + "]");
    auto chan = ops[3].getType();
    auto bn = BatchNormOp::create(b, loc, TypeRange{x.getType(), chan, chan}, ops[0], ops[1],
                                  ops[2], ops[3], ops[4],
                                  b.getF32FloatAttr(attrFloat("epsilon", 1e-5f)),
                                  b.getF32FloatAttr(attrFloat("momentum", 0.9f)),
                                  b.getBoolAttr(training));
    define(0, bn.getResult());
    define(1, bn.getNewRunningMean());
    define(2, bn.getNewRunningVar());
    return;
  }

  // Data movement.
  if (op == "Reshape" || op == "Unsqueeze" || op == "Squeeze" || op == "Flatten") {
    SmallVector<int64_t> in = shapeOf(0), out;
    int64_t rank = in.size();
    if (op == "Reshape") {
      std::vector<int64_t> req = needConst(1, "shape").toInts();
      bool allowZero = attrInt("allowzero", 0) != 0;
      rescaleBatch(req, in);
      int64_t infer = -1, known = 1;
      for (size_t k = 0; k < req.size(); ++k) {
        int64_t d = req[k];
        if (d == 0 && !allowZero) {
          if ((int64_t)k >= rank)
            fail("shape entry 0 at position " + std::to_string(k) + " has no input dim");
          d = in[k];
        }
        if (d == -1) {
          if (infer >= 0)
            fail("shape " + formatShape(req) + " has more than one -1");
          infer = k;
          out.push_back(1);
          continue;
        }
        if (d < 0)
          fail("shape " + formatShape(req) + " has a negative entry");
        if (__builtin_mul_overflow(known, d, &known))
          fail("shape " + formatShape(req) + " has more elements than fit in 64 bits");
        out.push_back(d);
      }
      if (infer >= 0) {
        if (known == 0 || numElements(in) % known)
          fail("cannot reshape " + formatShape(in) + " to " + formatShape(req));
        out[infer] = numElements(in) / known;
      }
    } else if (op == "Flatten") {
      int64_t axis = attrInt("axis", 1);
      if (axis < 0)
        axis += rank;
      if (axis < 0 || axis > rank)
        fail("axis is out of range");
      out = {numElements(ArrayRef<int64_t>(in).take_front(axis)),
             numElements(ArrayRef<int64_t>(in).drop_front(axis))};
    } else if (op == "Unsqueeze") {
      std::vector<int64_t> axes = needConst(1, "axes").toInts();
      int64_t outRank = rank + axes.size();
      SmallVector<bool> ones(outRank, false);
      for (int64_t a : axes) {
        int64_t na = normAxis(a, outRank);
        if (ones[na])
          fail("axes repeat " + std::to_string(a));
        ones[na] = true;
      }
      for (int64_t d = 0, k = 0; d < outRank; ++d)
        out.push_back(ones[d] ? 1 : in[k++]);
    } else {
      SmallVector<bool> drop(rank, false);
      if (hasInput(1)) {
        for (int64_t a : needConst(1, "axes").toInts()) {
          int64_t na = normAxis(a, rank);
          if (in[na] != 1)
            fail("cannot squeeze dimension " + std::to_string(a) + " of size " +
                 std::to_string(in[na]));
          drop[na] = true;
        }
      } else {
        for (int64_t d = 0; d < rank; ++d)
          drop[d] = in[d] == 1;
      }
      for (int64_t d = 0; d < rank; ++d)
        if (!drop[d])
          out.push_back(in[d]);
    }
    if (numElements(out) != numElements(in))
      fail("cannot reshape " + formatShape(in) + " to " + formatShape(out));
    if (const HostTensor *c = cst(0))
      return defineConst(0, hostReshape(*c, out));
    return define(0, reshape(val(0), out));
  }
  if (op == "Transpose") {
    Value x = val(0);
    std::vector<int64_t> perm;
    if (auto p = attrInts("perm"))
      perm = *p;
    else
      for (int64_t d = (int64_t)shp(x).size() - 1; d >= 0; --d)
        perm.push_back(d);
    ShapeOrError s = transposeShape(shp(x), perm);
    expect(s);
    bool identity = true;
    for (size_t d = 0; d < perm.size(); ++d)
      identity &= perm[d] == (int64_t)d;
    if (identity)
      return define(0, x);
    return define(0, TransposeOp::create(b, loc, tensorType(s.shape, eltOf(x)), x,
                                         b.getDenseI64ArrayAttr(perm)));
  }
  if (op == "Slice") {
    Value x = val(0);
    SmallVector<int64_t> st, en, sp;
    normalizeSlice(shp(x), st, en, sp);
    for (int64_t s : sp)
      if (s < 0)
        fail("negative slice steps (flips) are supported on constants only");
    ShapeOrError s = sliceShape(shp(x), st, en, sp);
    expect(s);
    if (ArrayRef<int64_t>(s.shape) == shp(x))
      return define(0, x);
    return define(0, SliceOp::create(b, loc, tensorType(s.shape, eltOf(x)), x,
                                     b.getDenseI64ArrayAttr(st), b.getDenseI64ArrayAttr(en),
                                     b.getDenseI64ArrayAttr(sp)));
  }
  if (op == "Split") {
    Value x = val(0);
    int64_t rank = shp(x).size(), axis = normAxis(attrInt("axis", 0), rank);
    int64_t dim = shp(x)[axis], outs = n.output_size();
    if (outs < 1)
      fail("Split needs at least one output");
    std::vector<int64_t> sizes;
    if (hasInput(1)) {
      sizes = needConst(1, "split").toInts();
    } else if (auto s = attrInts("split")) {
      sizes = *s;
    } else {
      int64_t parts = attrInt("num_outputs", outs);
      if (parts < 1)
        fail("Split needs at least one output");
      int64_t chunk = (dim + parts - 1) / parts;
      if (opset < 18 && dim % parts)
        fail("dimension " + std::to_string(dim) + " does not split evenly into " +
             std::to_string(parts));
      for (int64_t k = 0; k < parts; ++k)
        sizes.push_back(std::min(chunk, dim - k * chunk));
    }
    if ((int64_t)sizes.size() != outs)
      fail("split sizes " + formatShape(sizes) + " do not match " + std::to_string(outs) +
           " outputs");
    int64_t total = 0;
    for (int64_t s : sizes)
      total += s;
    if (total != dim)
      fail("split sizes " + formatShape(sizes) + " do not add up to " + std::to_string(dim));
    int64_t offset = 0;
    for (int64_t k = 0; k < outs; ++k) {
      SmallVector<int64_t> st(rank, 0), en(shp(x)), sp(rank, 1);
      st[axis] = offset;
      en[axis] = offset + sizes[k];
      offset += sizes[k];
      SmallVector<int64_t> shape(shp(x));
      shape[axis] = sizes[k];
      define(k, SliceOp::create(b, loc, tensorType(shape, eltOf(x)), x,
                                b.getDenseI64ArrayAttr(st), b.getDenseI64ArrayAttr(en),
                                b.getDenseI64ArrayAttr(sp)));
    }
    return;
  }
  if (op == "Concat") {
    SmallVector<Value> parts;
    SmallVector<SmallVector<int64_t>> shapes;
    for (int k = 0; k < n.input_size(); ++k) {
      if (!hasInput(k))
        continue;
      Value v = val(k);
      if (!parts.empty() && eltOf(v) != eltOf(parts.front()))
        fail("inputs have different element types");
      parts.push_back(v);
      shapes.emplace_back(shp(v));
    }
    if (parts.empty())
      fail("Concat has no inputs");
    int64_t axis = normAxis(attrInt("axis", 0), shp(parts.front()).size());
    ShapeOrError s = concatShape(shapes, axis);
    expect(s);
    if (parts.size() == 1)
      return define(0, parts.front());
    return define(0, ConcatOp::create(b, loc, tensorType(s.shape, eltOf(parts.front())),
                                      parts, b.getI64IntegerAttr(axis)));
  }
  if (op == "Gather") {
    Value data = val(0), idx = val(1);
    if (!eltOf(idx).isInteger(64) && !eltOf(idx).isInteger(32))
      fail("indices must be INT32 or INT64");
    int64_t axis = normAxis(attrInt("axis", 0), shp(data).size());
    ShapeOrError s = gatherShape(shp(data), shp(idx), axis);
    expect(s);
    return define(0, GatherOp::create(b, loc, tensorType(s.shape, eltOf(data)), data, idx,
                                      b.getI64IntegerAttr(axis)));
  }
  if (op == "Expand") {
    Value x = val(0);
    std::vector<int64_t> shape = needConst(1, "shape").toInts();
    if (opts.batch > 0 && opts.globalBatch > opts.batch && !shape.empty() &&
        shape[0] == opts.globalBatch && shp(x).size() == shape.size() &&
        shp(x)[0] == opts.batch)
      shape[0] = opts.batch;
    ShapeOrError s = broadcastShapes(shp(x), shape);
    expect(s);
    if (ArrayRef<int64_t>(s.shape) == shp(x))
      return define(0, x);
    return define(0, ExpandOp::create(b, loc, tensorType(s.shape, eltOf(x)), x));
  }

  // Convolutional networks.
  if (op == "Conv" || op == "MaxPool") {
    Value x = val(0);
    if (shp(x).size() != 4)
      fail("only 2-D " + op + " on 4-D NCHW tensors is supported, got rank " +
           std::to_string(shp(x).size()));
    SmallVector<int64_t> kernel;
    if (auto k = attrInts("kernel_shape"))
      kernel.assign(k->begin(), k->end());
    else if (op == "Conv")
      kernel = {shapeOf(1)[2], shapeOf(1)[3]};
    else
      fail("kernel_shape is required");
    auto ints = [&](StringRef name, SmallVector<int64_t> dflt) {
      auto v = attrInts(name);
      return v ? SmallVector<int64_t>(v->begin(), v->end()) : dflt;
    };
    SmallVector<int64_t> strides = ints("strides", {1, 1});
    SmallVector<int64_t> dil = ints("dilations", {1, 1});
    SmallVector<int64_t> pads = ints("pads", {0, 0, 0, 0});
    std::string autoPad = attrString("auto_pad", "NOTSET");
    if (autoPad == "VALID") {
      pads = {0, 0, 0, 0};
    } else if (autoPad == "SAME_UPPER" || autoPad == "SAME_LOWER") {
      for (int i = 0; i < 2; ++i) {
        int64_t in = shp(x)[2 + i], out = (in + strides[i] - 1) / strides[i];
        int64_t total = std::max<int64_t>(
            0, (out - 1) * strides[i] + dil[i] * (kernel[i] - 1) + 1 - in);
        pads[i] = autoPad == "SAME_UPPER" ? total / 2 : total - total / 2;
        pads[i + 2] = total - pads[i];
      }
    } else if (autoPad != "NOTSET") {
      fail("auto_pad '" + autoPad + "' is not supported");
    }
    if (op == "MaxPool") {
      if (attrInt("ceil_mode", 0))
        fail("ceil_mode=1 is not supported");
      if (dil != SmallVector<int64_t>{1, 1})
        fail("dilated pooling is not supported");
      if (outputUsed(1))
        fail("the Indices output is not supported");
      ShapeOrError s = pool2dShape(shp(x), kernel, strides, pads);
      expect(s);
      return define(0, MaxPool2dOp::create(b, loc, tensorType(s.shape, eltOf(x)), x,
                                           b.getDenseI64ArrayAttr(kernel),
                                           b.getDenseI64ArrayAttr(strides),
                                           b.getDenseI64ArrayAttr(pads)));
    }
    Value w = val(1);
    Value bias = hasInput(2) ? val(2) : Value();
    int64_t group = attrInt("group", 1);
    ShapeOrError s = conv2dShape(shp(x), shp(w), strides, pads, dil, group);
    expect(s);
    if (ArrayRef<int64_t>(kernel) != shp(w).drop_front(2))
      fail("kernel_shape does not match the weight");
    return define(0, Conv2dOp::create(b, loc, tensorType(s.shape, eltOf(x)), x, w, bias,
                                      b.getDenseI64ArrayAttr(strides),
                                      b.getDenseI64ArrayAttr(pads),
                                      b.getDenseI64ArrayAttr(dil),
                                      b.getI64IntegerAttr(group)));
  }
  if (op == "GlobalAveragePool") {
    Value x = val(0);
    int64_t rank = shp(x).size();
    if (rank < 3)
      fail("the input needs rank >= 3");
    SmallVector<int64_t> axes;
    for (int64_t d = 2; d < rank; ++d)
      axes.push_back(d);
    ShapeOrError s = reduceShape(shp(x), axes, true);
    return define(0, ReduceMeanOp::create(b, loc, tensorType(s.shape, eltOf(x)), x,
                                          b.getDenseI64ArrayAttr(axes), b.getBoolAttr(true)));
  }

  // Losses.
  if (op == "SoftmaxCrossEntropyLoss" || op == "NegativeLogLikelihoodLoss") {
    if (hasInput(2))
      fail("class weights are not supported");
    if (outputUsed(1))
      fail("the log_prob output is not supported");
    Value logits = val(0), targets = val(1);
    if (op == "NegativeLogLikelihoodLoss") {
      // NLL(log_softmax(x)) is cross-entropy of x; carve keeps it whole.
      auto ls = logits.getDefiningOp<LogSoftmaxOp>();
      if (!ls || ls.getAxis() != 1)
        fail("NegativeLogLikelihoodLoss is supported on the output of LogSoftmax over "
             "axis 1 only");
      logits = ls.getInput();
    }
    if (!isa<FloatType>(eltOf(logits)))
      fail("the scores must be floating-point");
    if (!eltOf(targets).isInteger(64) && !eltOf(targets).isInteger(32))
      fail("the labels must be INT32 or INT64");
    std::string red = attrString("reduction", "mean");
    if (red != "mean" && red != "sum" && red != "none")
      fail("reduction '" + red + "' is not one of mean, sum, none");
    ShapeOrError s = crossEntropyShape(shp(logits), shp(targets), red != "none");
    expect(s);
    IntegerAttr ignore;
    if (attr("ignore_index"))
      ignore = b.getI64IntegerAttr(attrInt("ignore_index", -100));
    return define(0, CrossEntropyOp::create(b, loc, tensorType(s.shape, eltOf(logits)),
                                            logits, targets, b.getStringAttr(red), ignore));
  }
  fail("unsupported op '" + op + "' at opset " + std::to_string(opset) +
       "; the supported ops are listed in docs/onnx-ops.md");
}

/// A node of a custom domain that the rules file describes: `carve.custom`,
/// typed by the rule's shape expressions evaluated on the input shapes.
void Importer::buildCustom(const onnx::NodeProto &n, const CustomOpRule &rule) {
  const std::string &from = rule.origin;
  if (n.attribute_size() > 0)
    fail("has attribute '" + n.attribute(0).name() +
         "', but a custom op's kernels receive tensors only (" + from + ")");
  size_t numInputs = rule.operandRanks.size();
  if ((size_t)n.input_size() != numInputs)
    fail(from + ": \"annotation\" '" + rule.annotation + "' describes " +
         std::to_string(numInputs) + " operand(s), the node has " + std::to_string(n.input_size()) +
         " input(s)");
  SmallVector<Value> inputs;
  std::vector<std::vector<int64_t>> shapes;
  for (size_t k = 0; k < numInputs; ++k) {
    if (!hasInput((int)k))
      fail("input " + std::to_string(k) + " is empty; a custom op's inputs are all required");
    Value v = val((int)k);
    if (shp(v).size() != (size_t)rule.operandRanks[k])
      fail(from + ": \"annotation\" '" + rule.annotation + "' gives operand " + std::to_string(k) +
           " " + std::to_string(rule.operandRanks[k]) + " dimension(s), but input '" + n.input(k) +
           "' is " + formatShape(shp(v)));
    inputs.push_back(v);
    shapes.emplace_back(shp(v).begin(), shp(v).end());
  }
  if ((size_t)n.output_size() != rule.outputs.size())
    fail(from + ": \"outputs\" lists " + std::to_string(rule.outputs.size()) +
         " output(s), the node has " + std::to_string(n.output_size()));
  std::string inputShapes;
  for (const std::vector<int64_t> &in : shapes)
    inputShapes += (inputShapes.empty() ? "" : ", ") + formatShape(in);
  SmallVector<Type> types;
  for (size_t k = 0; k < rule.outputs.size(); ++k) {
    const CustomOutput &o = rule.outputs[k];
    SmallVector<int64_t> shape;
    for (size_t d = 0; d < o.shape.size(); ++d) {
      std::string field = "outputs[" + std::to_string(k) + "].shape[" + std::to_string(d) + "]";
      int64_t size;
      std::string error;
      if (!evalShapeExpr(o.shape[d], shapes, size, error))
        fail(from + ": \"" + field + "\": " + error);
      if (size <= 0)
        fail(from + ": \"" + field + "\": \"" + o.shape[d] + "\" is " + std::to_string(size) +
             " for inputs " + inputShapes + "; dimensions must be positive");
      shape.push_back(size);
    }
    Type elt;
    if (o.dtype.compare(0, 2, "in") == 0)
      elt = eltOf(inputs[std::stoi(o.dtype.substr(2))]);
    else if (o.dtype == "f32")
      elt = b.getF32Type();
    else if (o.dtype == "f64")
      elt = b.getF64Type();
    else if (o.dtype == "i64")
      elt = b.getI64Type();
    else if (o.dtype == "i32")
      elt = b.getI32Type();
    else
      elt = b.getI1Type();
    types.push_back(tensorType(shape, elt));
  }
  auto op = CustomOp::create(b, loc, types, inputs, b.getStringAttr(rule.domain),
                             b.getStringAttr(rule.type), b.getStringAttr(rule.annotation),
                             b.getStringAttr(rule.backwardAnnotation),
                             b.getStringAttr(rule.cpu.forward), b.getStringAttr(rule.cpu.backward),
                             b.getStringAttr(rule.cuda.forward),
                             b.getStringAttr(rule.cuda.backward));
  for (unsigned k = 0; k < op->getNumResults(); ++k)
    define((int)k, op->getResult(k));
}

OwningOpRef<ModuleOp> Importer::run(StringRef bytes) {
  parse(bytes);
  const onnx::GraphProto &g = model.graph();
  auto module = ModuleOp::create(FileLineColLoc::get(&ctx, file, 0, 0));
  OwningOpRef<ModuleOp> owned(module);
  if (!g.name().empty())
    module.setSymName(g.name());
  b.setInsertionPointToEnd(module.getBody());
  classifyInitializers();
  for (const auto &n : g.node())
    for (const auto &in : n.input())
      if (!in.empty())
        ++useCount[in];
  for (const auto &out : g.output())
    ++useCount[out.name()];
  makeArguments();

  b.setInsertionPointToEnd(entry);
  for (int k = 0; k < g.node_size(); ++k)
    importNode(g.node(k), k);
  node = nullptr;

  SmallVector<Value> results;
  SmallVector<DictionaryAttr> resultAttrs;
  loc = FileLineColLoc::get(&ctx, file, 0, 0);
  for (const auto &out : g.output()) {
    auto it = env.find(out.name());
    if (it == env.end())
      fail("graph output '" + out.name() + "' is not produced by any node");
    Slot &s = it->second;
    if (!s.value) {
      if (s.isParam)
        fail("graph output '" + out.name() + "' is a parameter");
      if (!s.constant && s.init)
        s.constant = loadTensor(*s.init, "initializer '" + out.name() + "'");
      s.value = materialize(*s.constant, out.name());
    }
    results.push_back(s.value);
    resultAttrs.push_back(
        b.getDictionaryAttr({b.getNamedAttr(kOutputAttr, b.getStringAttr(out.name()))}));
  }
  func::ReturnOp::create(b, loc, results);
  // Drop ops that lost their users at import (a LogSoftmax folded into
  // cross-entropy); everything carve builds is side-effect free.
  for (Operation &op : llvm::make_early_inc_range(llvm::reverse(*entry)))
    if (isOpTriviallyDead(&op))
      op.erase();
  func.setFunctionType(b.getFunctionType(entry->getArgumentTypes(), TypeRange(results)));
  func.setAllArgAttrs(argAttrs);
  func.setAllResultAttrs(resultAttrs);
  return owned;
}

} // namespace

bool parseSetDim(StringRef entry, ImportOptions &opts, std::string &error) {
  auto [name, value] = entry.split('=');
  int64_t v;
  if (name.empty() || value.empty() || value.getAsInteger(10, v) || v <= 0) {
    error = "--set-dim expects NAME=VALUE with a positive integer VALUE, got '" +
            entry.str() + "'";
    return false;
  }
  opts.dims[name] = v;
  return true;
}

std::vector<std::string> supportedOnnxOps() {
  return std::vector<std::string>(opTable().begin(), opTable().end());
}

OwningOpRef<ModuleOp> importOnnxBytes(MLIRContext &context, StringRef bytes,
                                      StringRef displayName, StringRef baseDir,
                                      const ImportOptions &opts, std::string &error) {
  context.loadDialect<CarveDialect, func::FuncDialect>();
  OwningOpRef<ModuleOp> module;
  try {
    Importer importer(context, opts, displayName.str(), baseDir.str());
    module = importer.run(bytes);
  } catch (const ImportFailure &f) {
    error = f.message;
    return nullptr;
  }
  // The importer types every op by the same rules the verifiers check, so a
  // verifier failure here is an importer bug; report it rather than crash.
  std::string diag;
  {
    ScopedDiagnosticHandler handler(&context, [&](Diagnostic &d) {
      if (diag.empty()) {
        llvm::raw_string_ostream os(diag);
        os << d.getLocation() << ": " << d.str();
      }
      return success();
    });
    if (failed(verify(*module))) {
      error = "internal error: the imported IR does not verify: " + diag;
      return nullptr;
    }
    if (opts.raise) {
      PassManager pm(&context);
      pm.addNestedPass<func::FuncOp>(createCarveRaise());
      pm.addPass(createCanonicalizerPass());
      pm.addPass(createCSEPass());
      if (failed(pm.run(*module))) {
        error = "internal error: carve-raise failed: " + diag;
        return nullptr;
      }
    }
  }
  return module;
}

OwningOpRef<ModuleOp> importOnnxFile(MLIRContext &context, StringRef path,
                                     const ImportOptions &opts, std::string &error) {
  if (llvm::sys::fs::is_directory(path)) {
    error = "is a directory, not an ONNX file";
    return nullptr;
  }
  auto buf = llvm::MemoryBuffer::getFile(path, /*IsText=*/false,
                                         /*RequiresNullTerminator=*/false);
  if (!buf) {
    error = "cannot read the file: " + buf.getError().message();
    return nullptr;
  }
  SmallVector<char> dir(path.begin(), path.end());
  llvm::sys::path::remove_filename(dir);
  std::string base = dir.empty() ? "." : std::string(dir.begin(), dir.end());
  return importOnnxBytes(context, (*buf)->getBuffer(), llvm::sys::path::filename(path),
                         base, opts, error);
}

} // namespace carve
