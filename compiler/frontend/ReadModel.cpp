//===- ReadModel.cpp - read and validate an ONNX model --------------------===//
//
// The first step of the import: the protobuf, its opset and graph, and every
// initializer (element type, dims, data size, external data inside the
// model's folder) are checked before use; tensors are read into HostTensor.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Importer.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

#include <cmath>
#include <cstring>
#include <map>

using namespace mlir;
using llvm::SmallVector;
using llvm::StringRef;

namespace carve::frontend {

namespace {

int64_t elemBytes(int t) {
  switch ((ElemKind)t) {
  case ElemKind::F64:
  case ElemKind::I64:
    return 8;
  case ElemKind::F32:
  case ElemKind::I32:
    return 4;
  case ElemKind::F16:
  case ElemKind::BF16:
    return 2;
  case ElemKind::U8:
  case ElemKind::I8:
  case ElemKind::Bool:
    return 1;
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

} // namespace

void Importer::readStateFacts(StringRef bytes, const std::vector<std::string> &wanted,
                              OnnxStateFacts &out) {
  parse(bytes);
  for (const auto &p : model.metadata_props())
    out.metadata.push_back({p.key(), p.value()});
  std::map<std::string, const onnx::TensorProto *> byName;
  for (const onnx::TensorProto &t : model.graph().initializer()) {
    out.initializerNames.push_back(t.name());
    byName[t.name()] = &t;
  }
  bool metadata = false;
  for (const auto &p : model.metadata_props())
    metadata |= p.key() == "carve.parameters";
  if (!metadata)
    out.transposedTies = transposedTies();
  for (const std::string &name : wanted) {
    auto it = byName.find(name);
    if (it == byName.end())
      fail("no initializer '" + name + "'");
    checkInitializer(*it->second);
    HostTensor h = loadTensor(*it->second, "initializer '" + name + "'");
    ImportOptions::InitialValue v;
    v.name = name;
    v.shape.assign(it->second->dims().begin(), it->second->dims().end());
    v.data.resize(h.size());
    for (int64_t k = 0; k < h.size(); ++k)
      v.data[k] = (float)h.asDouble(k);
    out.values.push_back(std::move(v));
  }
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
  case ElemKind::F32:
    return b.getF32Type();
  case ElemKind::F64:
    return b.getF64Type();
  case ElemKind::F16:
    return b.getF16Type();
  case ElemKind::BF16:
    return b.getBF16Type();
  case ElemKind::I64:
    return b.getI64Type();
  case ElemKind::I32:
    return b.getI32Type();
  case ElemKind::I8:
    return b.getIntegerType(8);
  case ElemKind::U8:
    return b.getIntegerType(8, /*isSigned=*/false);
  case ElemKind::Bool:
    return b.getI1Type();
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
  if (offset < 0)
    fail(what + ": external data offset " + std::to_string(offset) + " is negative");
  // offset + bytes may not fit in 64 bits: compare against what is left after the offset.
  if ((uint64_t)offset > fileSize || (uint64_t)bytes > fileSize - (uint64_t)offset)
    fail(what + ": external data file '" + path + "' is too short (" + std::to_string(fileSize) +
         " bytes, need " + std::to_string(bytes) + " from offset " + std::to_string(offset) + ")");
  return path;
}

std::string Importer::readExternal(const onnx::TensorProto &t, int64_t bytes,
                                   const std::string &what) {
  int64_t offset;
  std::string path = externalPath(t, bytes, what, offset);
  auto buf = llvm::MemoryBuffer::getFileSlice(path, bytes, offset);
  if (!buf)
    fail(what + ": cannot read external data file '" + path + "': " + buf.getError().message());
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
    have = t.float_data_size() + t.int32_data_size() + t.int64_data_size() + t.double_data_size();
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
            v[k] = k < t.int32_data_size() ? (kind == ElemKind::F16 ? halfToFloat(t.int32_data(k))
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
      case ElemKind::I64:
        std::memcpy(&v[k], p + 8 * k, 8);
        break;
      case ElemKind::I32: {
        int32_t x;
        std::memcpy(&x, p + 4 * k, 4);
        v[k] = x;
        break;
      }
      case ElemKind::I8:
        v[k] = (int8_t)p[k];
        break;
      case ElemKind::U8:
        v[k] = (uint8_t)p[k];
        break;
      case ElemKind::Bool:
        v[k] = p[k] != 0;
        break;
      default:
        break;
      }
    }
    return HostTensor::ints(kind, shape, std::move(v));
  } catch (const HostError &e) {
    fail(what + ": " + e.what());
  }
}

} // namespace carve::frontend
