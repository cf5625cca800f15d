//===- ImportArguments.cpp - @forward's arguments -------------------------===//
//
// Initializers become parameters, buffers or constants (the carve.parameters
// and carve.buffers metadata, --frozen); graph inputs (dims bound by
// --set-dim) and parameters become the arguments of @forward.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Importer.h"

#include "llvm/Support/GlobPattern.h"
#include "llvm/Support/JSON.h"

#include <map>
#include <set>

using namespace mlir;
using llvm::SmallVector;
using llvm::StringRef;

namespace carve::frontend {

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
  if (!haveParamMetadata) {
    for (const auto &t : g.initializer())
      if (isFloatKind((ElemKind)t.data_type()))
        paramNames.insert(t.name());
    // In eval mode PyTorch's exporter keeps one of several initializers of
    // equal value (all zero biases, all unit norm weights at initialization)
    // and reaches the others through Identity nodes named after them. They
    // are separate parameters of the module: keep them apart.
    std::string list;
    for (const auto &n : g.node()) {
      if (n.op_type() != "Identity" || n.input_size() != 1 || n.output_size() != 1 ||
          !paramNames.count(n.input(0)) || initNames.count(n.output(0)) ||
          unmergedNames.count(n.output(0)))
        continue;
      for (const auto &t : g.initializer())
        if (t.name() == n.input(0))
          unmerged.push_back({n.output(0), &t});
      unmergedNames.insert(n.output(0));
      list += (list.empty() ? "" : ", ") + n.output(0) + " (= " + n.input(0) + ")";
    }
    for (auto &[name, t] : unmerged)
      paramNames.insert(name);
    // A tied weight's transposed copy is the same parameter, as in the module.
    std::string tiedList;
    int64_t tiedCount = 0;
    for (auto &[copy, original] : transposedTies()) {
      paramNames.erase(copy);
      tiedCopies[copy] = original;
      if (tiedCount++ < 3)
        tiedList += (tiedList.empty() ? "" : ", ") + copy + " (= " + original + " transposed)";
    }
    if (tiedCount > 0 && opts.notes)
      opts.notes->push_back(
          std::to_string(tiedCount) +
          " initializer(s) are exactly another's transpose, the copy a plain export's constant "
          "folding keeps of a tied weight: trained as one tensor, as PyTorch trains the tie: " +
          tiedList + (tiedCount > 3 ? ", ..." : "") +
          "; carve cannot tell a tie from a coincidence, so export with "
          "do_constant_folding=False (or models/export.py's export_for_carve) to be sure");
    // Say once what was guessed, and what an exporter renamed.
    int64_t floats = 0, others = 0;
    std::string renamed;
    int64_t renamedCount = 0;
    for (const auto &t : g.initializer()) {
      if (!isFloatKind((ElemKind)t.data_type())) {
        ++others;
        continue;
      }
      ++floats;
      if (StringRef(t.name()).starts_with("onnx::")) {
        if (renamedCount < 3)
          renamed += (renamed.empty() ? "" : ", ") + t.name();
        ++renamedCount;
      }
    }
    if (opts.notes && floats + others > 0)
      opts.notes->push_back(
          "no carve.parameters metadata: " + std::to_string(floats) +
          " float initializer(s) taken as parameters, " + std::to_string(others) +
          " other(s) as constants; export with models/export.py's export_for_carve to say "
          "which are buffers (models/README.md)");
    if (opts.notes && renamedCount > 0)
      opts.notes->push_back(
          std::to_string(renamedCount) + " parameter(s) have names the exporter made (" + renamed +
          (renamedCount > 3 ? ", ..." : "") +
          "): constant folding replaced weights by transposed copies, so checkpoints use "
          "these names; export with do_constant_folding=False to keep the module's");
    if (!unmerged.empty() && opts.notes)
      opts.notes->push_back(
          std::to_string(unmerged.size()) +
          " parameter(s) the exporter merged into another of equal value (an eval-mode "
          "export) are kept apart, as in the module: " +
          list);
  }

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
    if (auto it = tiedCopies.find(t.name()); it != tiedCopies.end()) {
      s.isParam = true; // never a constant
      s.transposeOf = it->second;
    }
    env[t.name()] = s;
  }
}

std::vector<std::pair<std::string, std::string>> Importer::transposedTies() {
  // Candidates: 2-D float initializers of at most kLimit elements, paired by
  // transposed shapes; equal when every element is (cheap to rule out: the
  // first differing element ends the comparison).
  constexpr int64_t kLimit = int64_t(1) << 26;
  std::vector<const onnx::TensorProto *> mats;
  for (const auto &t : model.graph().initializer())
    if (isFloatKind((ElemKind)t.data_type()) && t.dims_size() == 2 &&
        t.dims(0) * t.dims(1) <= kLimit && t.dims(0) * t.dims(1) > 1)
      mats.push_back(&t);
  std::map<const onnx::TensorProto *, HostTensor> loaded;
  auto values = [&](const onnx::TensorProto *t) -> const HostTensor & {
    auto it = loaded.find(t);
    if (it == loaded.end())
      it = loaded.emplace(t, loadTensor(*t, "initializer '" + t->name() + "'")).first;
    return it->second;
  };
  std::vector<std::pair<std::string, std::string>> ties;
  std::set<const onnx::TensorProto *> used;
  for (size_t i = 0; i < mats.size(); ++i)
    for (size_t j = 0; j < mats.size(); ++j) {
      const onnx::TensorProto *a = mats[i], *c = mats[j];
      if (i == j || used.count(a) || used.count(c) || a->dims(0) != c->dims(1) ||
          a->dims(1) != c->dims(0))
        continue;
      // The original is the one the module named; the copy the exporter's.
      const bool aMade = StringRef(a->name()).starts_with("onnx::"),
                 cMade = StringRef(c->name()).starts_with("onnx::");
      if (aMade && !cMade)
        continue;
      if (aMade == cMade && i > j)
        continue;
      const HostTensor &x = values(a), &y = values(c);
      const int64_t m = a->dims(0), n = a->dims(1);
      bool same = true, varied = false, symmetric = m == n;
      for (int64_t r = 0; r < m && same; ++r)
        for (int64_t q = 0; q < n && same; ++q) {
          same = x.asDouble(r * n + q) == y.asDouble(q * m + r);
          varied |= x.asDouble(r * n + q) != x.asDouble(0);
          if (symmetric)
            symmetric = x.asDouble(r * n + q) == x.asDouble(q * n + r);
        }
      // Constant and symmetric tensors equal their transposes by themselves.
      if (same && varied && !symmetric) {
        ties.push_back({c->name(), a->name()});
        used.insert(a);
        used.insert(c);
      }
    }
  return ties;
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
    argAttrs.push_back(
        b.getDictionaryAttr({b.getNamedAttr(kInputAttr, b.getStringAttr(in.name()))}));
    Slot s;
    s.value = arg;
    env[in.name()] = s;
    batchDims[arg] = BatchAt{0, 1};
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
    SmallVector<NamedAttribute> attrs = {b.getNamedAttr(kParamAttr, b.getStringAttr(t.name()))};
    if (!frozenNames.count(t.name()))
      attrs.push_back(b.getNamedAttr(kTrainableAttr, b.getUnitAttr()));
    argAttrs.push_back(b.getDictionaryAttr(attrs));
    Slot &s = env[t.name()];
    s.value = arg;
    s.init = nullptr;
    s.isParam = true;
    recordInitialValue(t, what);
  }
  for (auto &[name, t] : unmerged) {
    std::string what = "parameter '" + name + "'";
    SmallVector<int64_t> shape(t->dims().begin(), t->dims().end());
    Value arg = entry->addArgument(tensorType(shape, mlirType(t->data_type(), what)), loc);
    SmallVector<NamedAttribute> attrs = {b.getNamedAttr(kParamAttr, b.getStringAttr(name))};
    if (!frozenNames.count(name))
      attrs.push_back(b.getNamedAttr(kTrainableAttr, b.getUnitAttr()));
    argAttrs.push_back(b.getDictionaryAttr(attrs));
    Slot &s = env[name];
    s.value = arg;
    s.isParam = true;
    recordInitialValue(*t, what, name);
  }
}

void Importer::recordInitialValue(const onnx::TensorProto &t, const std::string &what,
                                  const std::string &name) {
  if (!opts.initialValues)
    return;
  HostTensor h = loadTensor(t, what);
  ImportOptions::InitialValue v;
  v.name = name.empty() ? t.name() : name;
  v.shape.assign(t.dims().begin(), t.dims().end());
  v.data.resize(h.size());
  for (int64_t k = 0; k < h.size(); ++k)
    v.data[k] = (float)h.asDouble(k);
  opts.initialValues->push_back(std::move(v));
}

} // namespace carve::frontend
