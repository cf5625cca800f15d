//===- Summary.cpp - a human-readable summary of an imported model --------===//

#include "tools/carve/Summary.h"
#include "compiler/frontend/OnnxImporter.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/Support/Format.h"

#include <algorithm>
#include <vector>

using namespace mlir;

namespace carve {

static std::string typeString(Type t) {
  std::string s;
  llvm::raw_string_ostream os(s);
  auto rt = cast<RankedTensorType>(t);
  os << "[";
  llvm::interleave(rt.getShape(), os, ", ");
  os << "] " << rt.getElementType();
  return s;
}

void printSummary(ModuleOp module, llvm::raw_ostream &os) {
  auto func = module.lookupSymbol<func::FuncOp>("forward");
  if (!func)
    return;
  struct Arg {
    std::string name, type;
    int64_t elements;
    bool trainable;
  };
  std::vector<Arg> inputs, params, buffers;
  int64_t trainableCount = 0, trainableElems = 0, frozenElems = 0;
  for (unsigned k = 0; k < func.getNumArguments(); ++k) {
    auto type = cast<RankedTensorType>(func.getArgument(k).getType());
    auto name = [&](const char *attr) -> std::string {
      auto s = func.getArgAttrOfType<StringAttr>(k, attr);
      return s ? s.str() : "";
    };
    Arg a{"", typeString(type), type.getNumElements(),
          (bool)func.getArgAttr(k, kTrainableAttr)};
    if (!(a.name = name(kInputAttr)).empty()) {
      inputs.push_back(a);
    } else if (!(a.name = name(kParamAttr)).empty()) {
      params.push_back(a);
      if (a.trainable) {
        ++trainableCount;
        trainableElems += a.elements;
      } else {
        frozenElems += a.elements;
      }
    } else if (!(a.name = name(kBufferAttr)).empty()) {
      buffers.push_back(a);
    }
  }
  os << "model " << (module.getSymName() ? *module.getSymName() : "(unnamed)") << "\n";
  os << "inputs:\n";
  for (const Arg &a : inputs)
    os << "  " << a.name << "  " << a.type << "\n";
  os << "outputs:\n";
  for (unsigned k = 0; k < func.getNumResults(); ++k) {
    auto s = func.getResultAttrOfType<StringAttr>(k, kOutputAttr);
    os << "  " << (s ? s.str() : "?") << "  " << typeString(func.getResultTypes()[k]) << "\n";
  }
  size_t width = 0;
  for (const Arg &a : params)
    width = std::max(width, a.name.size());
  os << "parameters: " << trainableCount << " trainable, " << trainableElems
     << " elements";
  if (frozenElems)
    os << " (+" << frozenElems << " frozen elements)";
  os << "\n";
  for (const Arg &a : params)
    os << "  " << llvm::left_justify(a.name, width) << "  "
       << llvm::left_justify(a.type, 20) << (a.trainable ? "" : "  frozen") << "\n";
  if (!buffers.empty()) {
    os << "buffers:\n";
    for (const Arg &a : buffers)
      os << "  " << a.name << "  " << a.type << "\n";
  }
  llvm::StringMap<int64_t> hist;
  int64_t total = 0;
  func.walk([&](Operation *op) {
    if (op == func.getOperation() || isa<func::ReturnOp>(op))
      return;
    ++hist[op->getName().getStringRef()];
    ++total;
  });
  std::vector<std::pair<std::string, int64_t>> ops;
  for (const auto &e : hist)
    ops.emplace_back(e.getKey().str(), e.getValue());
  std::sort(ops.begin(), ops.end(), [](const auto &a, const auto &b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  os << "ops: " << total << "\n";
  for (const auto &[name, count] : ops)
    os << "  " << llvm::format("%6lld", (long long)count) << "  " << name << "\n";
}

} // namespace carve
