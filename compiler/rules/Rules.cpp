//===- Rules.cpp - reading and checking rules files -----------------------===//

#include "compiler/rules/Rules.h"
#include "compiler/plan/JsonRead.h"

#include "dialects/carve/CarveOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/GlobPattern.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <map>
#include <set>

using namespace carve;
using json = nlohmann::json;

namespace {

/// An error in one entry: `where` is `rules.json: ops[0] (carve.example::SwiGLU)`.
struct RuleError {
  std::string message;
};

[[noreturn]] void fail(const std::string &where, const std::string &field, const std::string &why) {
  throw RuleError{where + ": " + (field.empty() ? "" : "\"" + field + "\": ") + why};
}

std::string dumpShort(const json &v) {
  std::string s = v.dump();
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

void onlyKeys(const json &obj, const std::string &where,
              std::initializer_list<const char *> known) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    bool ok = false;
    std::string list;
    for (const char *k : known) {
      ok |= it.key() == k;
      list += std::string(list.empty() ? "" : ", ") + "\"" + k + "\"";
    }
    if (!ok)
      fail(where, "", "unknown field \"" + it.key() + "\" (known: " + list + ")");
  }
}

const json &need(const json &obj, const std::string &where, const char *key) {
  if (!obj.contains(key))
    fail(where, "", "missing field \"" + std::string(key) + "\"");
  return obj.at(key);
}

std::string needString(const json &obj, const std::string &where, const char *key) {
  const json &v = need(obj, where, key);
  if (!v.is_string() || v.get<std::string>().empty())
    fail(where, key, "must be a non-empty string, got " + dumpShort(v));
  return v.get<std::string>();
}

bool isIdentifier(const std::string &s) {
  if (s.empty() || !(std::isalpha(static_cast<unsigned char>(s[0])) || s[0] == '_'))
    return false;
  for (char c : s)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_')
      return false;
  return true;
}

Annotation parseAnnotation(const std::string &text, const std::string &where) {
  Annotation a;
  std::string e;
  if (!Annotation::parse(text, a, e))
    fail(where, "annotation", e + " (grammar: docs/partition.md)");
  return a;
}

std::string markText(Mark m) {
  switch (m) {
  case Mark::Plain:
    return "";
  case Mark::Sum:
    return "+";
  case Mark::Max:
    return "+max";
  case Mark::Never:
    return "^";
  case Mark::Internal:
    return "~";
  }
  return "";
}

std::string tensorText(const TensorFactors &t, const std::map<std::string, Mark> &marks) {
  if (t.empty())
    return "()";
  auto factor = [&](const Factor &f) {
    if (f.name.empty())
      return std::to_string(f.count);
    auto it = marks.find(f.name);
    return f.name + (it == marks.end() ? "" : markText(it->second));
  };
  std::string s;
  for (const DimFactors &d : t) {
    s += s.empty() ? "" : " ";
    if (d.size() == 1 && !d[0].name.empty()) {
      s += factor(d[0]);
      continue;
    }
    s += "(";
    for (size_t k = 0; k < d.size(); ++k)
      s += (k ? " " : "") + factor(d[k]);
    s += ")";
  }
  return s;
}

struct Loader {
  std::string path, dir;
  RuleSet &rules;
  /// Per target ("cpu", "cuda"): kernel name -> "forward"/"backward".
  std::map<std::string, std::map<std::string, std::string>> symbolRole;
  std::map<std::string, std::string> sourceByName; // file name -> absolute path
  std::map<std::string, std::string> seenOps;      // "domain::type" -> where
  std::map<std::string, std::string> seenMatches;  // glob -> where

  void customOp(const json &e, const std::string &at);
  void kernels(const json &e, const std::string &where, const char *target, CustomKernels &k,
               std::vector<std::string> &allSources);
  void override(const json &e, const std::string &at);
  std::string source(const json &v, const std::string &where, const std::string &field,
                     std::vector<std::string> &allSources);
  void load(const json &root);
};

std::string Loader::source(const json &v, const std::string &where, const std::string &field,
                           std::vector<std::string> &allSources) {
  if (!v.is_string() || v.get<std::string>().empty())
    fail(where, field, "every entry must be a file name, got " + dumpShort(v));
  llvm::SmallString<256> p(v.get<std::string>());
  if (!llvm::sys::path::is_absolute(p)) {
    llvm::SmallString<256> full(dir);
    llvm::sys::path::append(full, p);
    p = full;
  }
  llvm::sys::fs::make_absolute(p);
  llvm::sys::path::remove_dots(p, /*remove_dot_dot=*/true);
  std::string abs = p.str().str();
  if (!llvm::sys::fs::exists(abs))
    fail(where, field,
         "'" + v.get<std::string>() + "' does not exist (looked for " + abs +
             "; paths are relative to the rules file)");
  if (llvm::sys::fs::is_directory(abs))
    fail(where, field, "'" + v.get<std::string>() + "' is a directory, not a source file");
  std::string name = llvm::sys::path::filename(abs).str();
  auto [it, fresh] = sourceByName.emplace(name, abs);
  if (!fresh && it->second != abs)
    fail(where, field,
         "two different files are named '" + name + "' (" + it->second + " and " + abs +
             "); they are copied side by side into OUT/src/custom/, so rename one");
  // Once per target: a file both sections name is compiled for each.
  if (std::find(allSources.begin(), allSources.end(), abs) == allSources.end())
    allSources.push_back(abs);
  return abs;
}

/// A target's kernels, `"cpu": {...}` or `"cuda": {...}`: their sources and
/// names.
void Loader::kernels(const json &e, const std::string &where, const char *target,
                     CustomKernels &k, std::vector<std::string> &allSources) {
  const std::string t = target, at = where + ": \"" + t + "\"";
  const char *lang = t == "cuda" ? "CUDA" : "C++";
  const json &sec = need(e, where, target);
  if (!sec.is_object())
    fail(where, t,
         "must be an object {\"sources\": [...], \"forward\": ..., \"backward\": ...}, got " +
             dumpShort(sec));
  onlyKeys(sec, at, {"sources", "forward", "backward"});
  const json &sources = need(sec, at, "sources");
  if (!sources.is_array() || sources.empty())
    fail(where, t + ".sources",
         std::string("must be a non-empty list of ") + lang + " files, got " + dumpShort(sources));
  for (const json &s : sources)
    k.sources.push_back(source(s, where, t + ".sources", allSources));
  for (const char *role : {"forward", "backward"}) {
    if (!sec.contains(role) && std::string(role) == "backward")
      continue;
    std::string name = needString(sec, at, role);
    if (!isIdentifier(name))
      fail(where, t + "." + role,
           "'" + name + "' is not a C identifier (the kernel is declared extern \"C\")");
    auto [it, fresh] = symbolRole[t].emplace(name, role);
    if (!fresh && it->second != role)
      fail(where, t + "." + role,
           "'" + name + "' is also a " + it->second +
               " kernel; forward and backward kernels have different signatures");
    (std::string(role) == "forward" ? k.forward : k.backward) = name;
  }
}

void Loader::customOp(const json &e, const std::string &at) {
  CustomOpRule r;
  r.domain = needString(e, at, "domain");
  r.type = needString(e, at, "type");
  std::string where = at + " (" + r.domain + "::" + r.type + ")";
  r.origin = at;
  onlyKeys(e, where, {"domain", "type", "annotation", "outputs", "cpu", "cuda", "comment"});
  // "ai.onnx": kernels for a standard op carve does not implement (the
  // importer refuses a rule for one it does: docs/custom-ops.md).
  std::string key = r.domain + "::" + r.type;
  if (seenOps.count(key))
    fail(where, "", "a second rule for " + key + " (the first is " + seenOps[key] + ")");
  seenOps[key] = at;

  r.annotation = needString(e, where, "annotation");
  Annotation a = parseAnnotation(r.annotation, where);
  for (const auto &[name, mark] : a.marks)
    if (mark == Mark::Internal)
      fail(where, "annotation",
           "'" + name +
               "~' (the kernel communicates over the split itself) is not available "
               "to custom ops: their kernels see only their own pieces");
  for (const TensorFactors &t : a.operands)
    r.operandRanks.push_back(static_cast<int>(t.size()));
  for (const TensorFactors &t : a.results)
    r.resultRanks.push_back(static_cast<int>(t.size()));
  r.backwardAnnotation = backwardAnnotation(a);
  int numInputs = static_cast<int>(a.operands.size());

  const json &outs = need(e, where, "outputs");
  if (!outs.is_array() || outs.empty())
    fail(where, "outputs",
         "must be a non-empty list of {\"shape\": [...], \"dtype\": ...}, got " + dumpShort(outs));
  if (outs.size() != a.results.size())
    fail(where, "annotation",
         "'" + r.annotation + "' describes " + std::to_string(a.results.size()) +
             " result(s), \"outputs\" lists " + std::to_string(outs.size()));
  for (size_t k = 0; k < outs.size(); ++k) {
    const json &o = outs[k];
    std::string field = "outputs[" + std::to_string(k) + "]";
    if (!o.is_object())
      fail(where, field,
           "must be an object {\"shape\": [...], \"dtype\": ...}, got " + dumpShort(o));
    onlyKeys(o, where + ": " + field, {"shape", "dtype"});
    CustomOutput out;
    const json &shape = need(o, where + ": " + field, "shape");
    if (!shape.is_array())
      fail(where, field + ".shape",
           "must be a list with one expression per dimension, got " + dumpShort(shape));
    for (size_t d = 0; d < shape.size(); ++d) {
      std::string dimField = field + ".shape[" + std::to_string(d) + "]";
      std::string text;
      if (shape[d].is_number_integer() && shape[d].get<int64_t>() > 0)
        text = std::to_string(shape[d].get<int64_t>());
      else if (shape[d].is_string())
        text = shape[d].get<std::string>();
      else
        fail(where, dimField,
             "must be a positive integer or an expression like \"in0[1] * 2\", got " +
                 dumpShort(shape[d]));
      std::string err;
      if (!checkShapeExpr(text, numInputs, err))
        fail(where, dimField, err);
      out.shape.push_back(text);
    }
    if (static_cast<int>(out.shape.size()) != r.resultRanks[k])
      fail(where, field + ".shape",
           "has " + std::to_string(out.shape.size()) + " dimension(s), but result " +
               std::to_string(k) + " of the annotation '" + r.annotation + "' has " +
               std::to_string(r.resultRanks[k]));
    if (o.contains("dtype")) {
      const json &dt = o.at("dtype");
      std::string s = dt.is_string() ? dt.get<std::string>() : "";
      static const std::set<std::string> types = {"f32", "f64", "i64", "i32", "bool"};
      bool input = s.size() > 2 && s.size() <= 8 && s.compare(0, 2, "in") == 0 &&
                   std::all_of(s.begin() + 2, s.end(),
                               [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
      if (input && std::stoi(s.substr(2)) >= numInputs)
        fail(where, field + ".dtype",
             "\"" + s + "\" names input " + s.substr(2) + ", but the annotation has " +
                 std::to_string(numInputs) + " operand(s)");
      if (!input && !types.count(s))
        fail(where, field + ".dtype",
             "must be \"inK\" (the element type of input K) or one of f32, f64, i64, i32, "
             "bool, got " +
                 dumpShort(dt));
      out.dtype = s;
    } else if (numInputs == 0) {
      fail(where, field + ".dtype", "is required for an op without inputs");
    }
    r.outputs.push_back(out);
  }

  kernels(e, where, "cpu", r.cpu, rules.sources);
  if (e.contains("cuda")) {
    kernels(e, where, "cuda", r.cuda, rules.cudaSources);
    // One gradient for both targets: a model that trains on the CPU trains on
    // the GPU, and the CPU target stays the reference the GPU is tested against.
    if (r.cpu.backward.empty() != r.cuda.backward.empty())
      fail(where, r.cpu.backward.empty() ? "cuda.backward" : "cuda",
           r.cpu.backward.empty()
               ? "names a backward kernel, but \"cpu\" has none; give both targets one, or neither"
               : "has no \"backward\" kernel, but \"cpu\" has one; give both targets one, or "
                 "neither");
  }
  rules.customOps.push_back(std::move(r));
}

void Loader::override(const json &e, const std::string &at) {
  const json &m = need(e, at, "match");
  if (!m.is_string() || m.get<std::string>().empty())
    fail(at, "match",
         "must be an op name (\"carve.matmul\") or a glob of model node names "
         "(\"/layers.*/feed_forward/w1/MatMul\"), got " +
             dumpShort(m));
  std::string glob = m.get<std::string>();
  std::string where = at + " (\"match\": \"" + glob + "\")";
  onlyKeys(e, where, {"match", "annotation", "comment"});
  if (auto p = llvm::GlobPattern::create(glob); !p)
    fail(where, "match", "'" + glob + "' is not a valid glob: " + llvm::toString(p.takeError()));
  if (seenMatches.count(glob))
    fail(where, "match",
         "a second entry for '" + glob + "' (the first is " + seenMatches[glob] + ")");
  seenMatches[glob] = at;
  std::string text = needString(e, where, "annotation");
  parseAnnotation(text, where);
  rules.overrides.push_back({glob, text, at});
}

void Loader::load(const json &root) {
  if (!root.is_object())
    fail(path, "", "a rules file is a JSON object {\"ops\": [...]} (docs/custom-ops.md)");
  onlyKeys(root, path, {"ops", "comment"});
  const json &ops = need(root, path, "ops");
  if (!ops.is_array())
    fail(path, "ops", "must be a list of rules, got " + dumpShort(ops));
  for (size_t i = 0; i < ops.size(); ++i) {
    const json &e = ops[i];
    std::string at = path + ": ops[" + std::to_string(i) + "]";
    if (!e.is_object())
      fail(at, "", "must be an object, got " + dumpShort(e));
    bool custom = e.contains("domain") || e.contains("type");
    if (custom && e.contains("match"))
      fail(at, "",
           "has both \"match\" and \"domain\"/\"type\"; an entry either describes a custom op "
           "(domain, type, annotation, outputs, cpu) or overrides built-in ops' annotation "
           "(match, annotation)");
    if (custom)
      customOp(e, at);
    else if (e.contains("match"))
      override(e, at);
    else
      fail(at, "",
           "is neither a custom op (\"domain\", \"type\", ...) nor an override (\"match\", "
           "\"annotation\")");
  }
}

} // namespace

const CustomOpRule *RuleSet::find(const std::string &domain, const std::string &type) const {
  for (const CustomOpRule &r : customOps)
    if (r.domain == domain && r.type == type)
      return &r;
  return nullptr;
}

std::string carve::backwardAnnotation(const Annotation &forward) {
  std::vector<TensorFactors> operands = forward.operands, results = forward.operands;
  operands.insert(operands.end(), forward.results.begin(), forward.results.end());
  std::map<std::string, Mark> marks;
  for (const std::string &name : forward.names()) {
    if (forward.markOf(name) == Mark::Never) {
      marks[name] = Mark::Never;
      continue;
    }
    for (const TensorFactors &t : results) {
      int64_t dim, outer;
      if (!Annotation::find(t, name, dim, outer))
        marks[name] = Mark::Sum;
    }
  }
  std::string s;
  for (size_t k = 0; k < operands.size(); ++k)
    s += (k ? ", " : "") + tensorText(operands[k], marks);
  s += operands.empty() ? "-> " : " -> ";
  for (size_t k = 0; k < results.size(); ++k)
    s += (k ? ", " : "") + tensorText(results[k], marks);
  return s;
}

bool carve::loadRules(const std::string &path, RuleSet &rules, std::string &error) {
  rules = RuleSet();
  rules.path = path;
  if (llvm::sys::fs::is_directory(path)) {
    error = path + ": is a directory, expected a rules file (JSON)";
    return false;
  }
  auto buf = llvm::MemoryBuffer::getFile(path);
  if (!buf) {
    error = path + ": cannot read the rules file: " + buf.getError().message();
    return false;
  }
  json root;
  std::string cause;
  if (!parseBoundedJson((*buf)->getBuffer().str(), root, cause)) {
    error = path + ": " + cause;
    return false;
  }
  llvm::SmallString<256> dir(path);
  llvm::sys::path::remove_filename(dir);
  Loader loader{path, dir.empty() ? "." : dir.str().str(), rules};
  try {
    loader.load(root);
  } catch (const RuleError &e) {
    error = e.message;
    rules = RuleSet();
    return false;
  }
  return true;
}

/// Whether override `o` applies to `op`: the partitioner's rule.
static bool overrideMatches(const AnnotationOverride &o, mlir::Operation *op) {
  if (o.glob == op->getName().getStringRef())
    return true;
  std::string node = nodeName(op->getLoc());
  auto pattern = llvm::GlobPattern::create(o.glob);
  return pattern && !node.empty() && pattern->match(node);
}

bool carve::prepareCustomOps(mlir::ModuleOp module, const RuleSet &rules, std::string &error) {
  bool ok = true;
  module.walk([&](CustomOp op) {
    if (!ok)
      return;
    const CustomOpRule *r = rules.find(op.getDomain().str(), op.getOpType().str());
    std::string origin = r ? r->origin : rules.path;
    std::string text = op.getAnnotation().str();
    for (const AnnotationOverride &o : rules.overrides)
      if (overrideMatches(o, op)) {
        text = o.annotation;
        origin = o.origin;
        break;
      }
    std::vector<std::vector<int64_t>> ins, outs;
    for (mlir::Value v : op.getInputs())
      ins.emplace_back(llvm::cast<mlir::RankedTensorType>(v.getType()).getShape().vec());
    for (mlir::Value v : op.getOutputs())
      outs.emplace_back(llvm::cast<mlir::RankedTensorType>(v.getType()).getShape().vec());
    Annotation a;
    std::string e;
    bool internal = false;
    if (Annotation::parse(text, a, e) && a.bind(ins, outs, e))
      for (const auto &[name, mark] : a.marks)
        internal |= mark == Mark::Internal;
    else
      ok = false;
    if (internal) {
      e = "'~' (the kernel communicates over the split itself) is not available to custom ops";
      ok = false;
    }
    if (!ok) {
      error = "node '" + nodeName(op.getLoc()) + "' (" + op.getDomain().str() +
              "::" + op.getOpType().str() + "): " + origin + ": \"annotation\": " + e;
      return;
    }
    if (text != op.getAnnotation()) {
      op.setAnnotation(text);
      op.setBackwardAnnotation(backwardAnnotation(a));
    }
  });
  return ok;
}

bool carve::checkOverridesMatch(mlir::ModuleOp module, const RuleSet &rules, std::string &error) {
  auto fn = module.lookupSymbol<mlir::func::FuncOp>("train_step");
  if (!fn)
    return true;
  for (const AnnotationOverride &o : rules.overrides) {
    bool used = false;
    fn.walk([&](mlir::Operation *op) { used |= overrideMatches(o, op); });
    if (!used) {
      error = o.origin + ": \"match\": '" + o.glob +
              "' matches no op of the model (give an op name like \"carve.matmul\" or a glob of "
              "ONNX node names like \"/layers.0/feed_forward/w1/MatMul\"; the comments in "
              "OUT/src/program0.cpp name each op's node)";
      return false;
    }
  }
  return true;
}
