//===- Layers.cpp - one function per repeated layer -------------------------===//
//
// A model's layers (GPT's h.0 ... h.N, a ResNet stage's blocks) compute the
// same thing on other buffers. The step prints every op in program order
// (Step.cpp); this file then finds the runs of ops that are one layer each,
// by the `name.N` component of their model nodes ("/h.3/attn/c_attn/MatMul",
// "backward of /h.3/ln_1/LayerNormalization"), and prints each run again as
// the body of a function in which every arena address is a slot of the
// layer's buffer table, `A + at[k]`, and every value has a name by position.
// Runs whose bodies print the same are twins: one function serves them all,
// each run becomes one call with its own row of the table, and the values a
// run writes that the rest of the step reads are declared after its call.
//
// Twins print the same statements on the same shapes with the same flags and
// constants (equal constants are read through one name): the only thing that
// differs between them is where their buffers are, which is what the table
// says. A run that prints like no other stays inline, as it was.
//
//===----------------------------------------------------------------------===//

#include "compiler/codegen/Generator.h"
#include "compiler/lower/Kernels.h"

#include "mlir/IR/DialectResourceBlobManager.h"

#include <algorithm>

using namespace mlir;

namespace carve::codegen {

namespace {

/// The first `name.N` of a node or a parameter's name, as a word between
/// '/', '.', ' ' or the ends: "h.3" of "backward of /h.3/attn/MatMul", of
/// "h.3.ln_1.weight (16-bit copy as fp32)" and of "/h.3/Add (16-bit copy)";
/// "layers.0" of "/model/layers.0/mlp/Mul". Empty if none.
std::string layerComponent(StringRef node) {
  auto sep = [](char c) { return c == '/' || c == '.' || c == ' '; };
  auto word = [](char c) { return isalnum((unsigned char)c) || c == '_'; };
  for (size_t start = 0; start < node.size(); ++start) {
    if (!(start == 0 || sep(node[start - 1])) || !word(node[start]) ||
        isdigit((unsigned char)node[start]))
      continue;
    size_t dot = start;
    while (dot < node.size() && word(node[dot]))
      ++dot;
    if (dot >= node.size() || node[dot] != '.')
      continue;
    size_t end = dot + 1;
    while (end < node.size() && isdigit((unsigned char)node[end]))
      ++end;
    if (end > dot + 1 && (end == node.size() || sep(node[end])))
      return node.substr(start, end - start).str();
  }
  return "";
}

/// "h.3" -> "h".
std::string componentName(const std::string &component) {
  return component.substr(0, component.rfind('.'));
}

/// `name` without the layer's part: "h_3_attn_MatMul" -> "attn_MatMul" for
/// component identifier "h_3"; empty when it has none.
std::string withoutLayer(const std::string &name, const std::string &ident) {
  const std::string part = ident + "_";
  size_t at = 0;
  while ((at = name.find(part, at)) != std::string::npos) {
    if (at == 0 || name[at - 1] == '_')
      return name.substr(0, at) + name.substr(at + part.size());
    ++at;
  }
  return "";
}

/// Whether a layer function may call a value `n`: a C identifier that hides
/// no runtime entry or type and is not one of the function's own names.
bool usableName(const std::string &n) {
  static const llvm::StringSet<> reserved = {
      "A",      "at",     "ctx",    "auto",   "bool",     "break",  "case",   "char",
      "const",  "double", "do",     "else",   "float",    "for",    "if",     "int",
      "long",   "new",    "delete", "return", "short",    "signed", "sizeof", "static",
      "switch", "this",   "void",   "while",  "unsigned", "default"};
  if (n.empty() || !(isalpha((unsigned char)n[0]) || n[0] == '_'))
    return false;
  return !reserved.count(n) && !isRuntimeType(n) && !lookupRuntimeEntry(n);
}

} // namespace

std::string Generator::layerNode(const std::string &node) {
  // Every component of the layer's family shows as `name.*` (a fused chain
  // may read the layer before's value: its comment says so, its code reads
  // a slot like any other).
  const std::string family = componentName(layer->component) + ".";
  std::string out;
  llvm::SmallVector<StringRef> parts;
  StringRef(node).split(parts, '/');
  for (size_t k = 0; k < parts.size(); ++k) {
    StringRef p = parts[k];
    if (p.starts_with(family) && p.size() > family.size() &&
        llvm::all_of(p.substr(family.size()), [](char c) { return isdigit((unsigned char)c); }))
      out += family + "*";
    else
      out += p.str();
    if (k + 1 < parts.size())
      out += "/";
  }
  return out;
}

std::string &Generator::layerName(Value v) {
  LayerScope &L = *layer;
  auto it = L.names.find(v);
  if (it != L.names.end())
    return it->second;
  const size_t pos = L.order.size();
  L.order.push_back(v);
  auto named = [&](const char *positional) {
    return L.given ? (*L.given)[pos] : positional + std::to_string(pos);
  };
  Value root = aliasRoot(v);
  auto rootConstant = root.getDefiningOp<ConstantOp>();
  std::string n;
  if (L.defined.count(v)) {
    n = named("v");
  } else if (rootConstant && v == root) {
    auto c = constantByValue.find(rootConstant.getOperation());
    if (c == constantByValue.end())
      L.failed = true;
    else
      n = c->second;
  } else if (rootConstant) {
    // A view of a constant made outside the layer.
    auto c = constantByValue.find(rootConstant.getOperation());
    if (c == constantByValue.end())
      L.failed = true;
    else {
      n = named("v");
      L.declarations += "  " + ctypeOf(v) + " *" + n + " = (" + ctypeOf(v) + " *)" + c->second +
                        ";  // a view of a constant\n";
    }
  } else {
    auto b = bufferOf.find(v);
    if (b == bufferOf.end() || buffers[b->second].offset < 0 ||
        buffers[b->second].region == Region::Constant) {
      L.failed = true;
    } else {
      n = named("v");
      L.declarations += "  " + ctypeOf(v) + " *" + n + " = (" + ctypeOf(v) + " *)(A + at[" +
                        std::to_string(L.slots.size()) + "]);\n";
      L.slots.push_back(v);
    }
  }
  return L.names[v] = n;
}

std::string Generator::layerResultPointer(Value r) {
  LayerScope &L = *layer;
  auto b = bufferOf.find(r);
  if (b == bufferOf.end() || buffers[b->second].offset < 0) {
    L.failed = true;
    return "";
  }
  L.defined.insert(r);
  const std::string n = var[r];
  const std::string k = std::to_string(L.slots.size());
  L.slots.push_back(r);
  return "  " + ctypeOf(r) + " *" + n + " = (" + ctypeOf(r) + " *)(A + at[" + k + "]);\n";
}

bool Generator::printLayer(const std::vector<size_t> &members, LayerScope &scope,
                           std::string &text) {
  // Printing again must leave the step as it was: what emitOp adds to.
  std::string savedBody, savedConstants = constants, savedError = error;
  std::swap(savedBody, body);
  const int savedCalls = kernelCalls;
  const std::vector<Value> savedViews = viewsInScope;
  layer = &scope;
  var.scoped = [this](Value v) -> std::string & { return layerName(v); };
  bool ok = true;
  for (size_t i = 0; i < members.size() && ok; ++i)
    ok = emitOp(records[members[i]].op);
  var.scoped = nullptr;
  layer = nullptr;
  text = body;
  std::swap(savedBody, body);
  constants = savedConstants;
  error = savedError;
  kernelCalls = savedCalls;
  viewsInScope = savedViews;
  return ok && !scope.failed;
}

bool Generator::outlineLayers(int backwardBegin) {
  // ZeRO-3 names a parameter by its gathered buffer from its gather on: the
  // names at the end of the step are not those its layers printed with.
  if (zero == 3 || records.empty())
    return true;
  {
    // Equal constants by type and bytes (a dense_resource is not uniqued).
    std::map<std::string, std::string> first;
    for (Operation *op : ops) {
      auto c = dyn_cast<ConstantOp>(op);
      if (!c)
        continue;
      std::string key = typeString(c.getType());
      key += '\0';
      if (auto dense = dyn_cast<DenseElementsAttr>(c.getValue())) {
        ArrayRef<char> raw = dense.getRawData();
        key.append(raw.begin(), raw.end());
        key += dense.isSplat() ? 's' : 'd';
      } else if (auto res = dyn_cast<DenseResourceElementsAttr>(c.getValue())) {
        AsmResourceBlob *blob = res.getRawHandle().getBlob();
        if (!blob)
          continue;
        ArrayRef<char> raw = blob->getData();
        key.append(raw.begin(), raw.end());
        key += 'r';
      } else {
        continue;
      }
      auto [it, isNew] = first.try_emplace(key, var.map.lookup(c.getResult()));
      constantByValue[op] = it->second;
    }
  }

  /// One run of op records [first, last) that is one layer's, and how it printed.
  struct Run {
    size_t first, last;    // the records whose text the run spans
    std::string component; // "h.3"
    bool backward;
    std::string text; // printed with positional names
    LayerScope *scope = nullptr;
    std::vector<size_t> members; // the records it prints
    std::vector<size_t> hoisted; // views of other values, printed before its call
  };
  // The runs: consecutive records of one layer and pass, nothing printed
  // between them. Records that print nothing join whatever run they are in;
  // a view of a value from before the run made in its midst (the scheduler
  // put it there) moves before the run's call.
  llvm::DenseMap<Operation *, size_t> recordOf;
  for (size_t i = 0; i < records.size(); ++i)
    recordOf[records[i].op] = i;
  std::vector<Run> runs;
  {
    Run cur{0, 0, "", false, ""};
    auto close = [&]() {
      // Views hoisted at its end stay where they are: the run ends before them.
      while (!cur.hoisted.empty() && cur.hoisted.back() + 1 == cur.last) {
        cur.hoisted.pop_back();
        cur.last -= 1;
        while (cur.last > cur.first && records[cur.last - 1].begin == records[cur.last - 1].end)
          cur.last -= 1;
      }
      if (!cur.component.empty() && cur.last > cur.first) {
        for (size_t i = cur.first, h = 0; i < cur.last; ++i)
          if (h < cur.hoisted.size() && cur.hoisted[h] == i)
            ++h;
          else
            cur.members.push_back(i);
        runs.push_back(cur);
      }
      cur.component.clear();
    };
    size_t lastEnd = 0;
    for (size_t i = 0; i < records.size(); ++i) {
      const OpRecord &r = records[i];
      // Constants print a comment here and their array above: they belong to
      // no layer (a layer reads them by name).
      if (r.begin == r.end || isa<ConstantOp>(r.op)) {
        if (r.begin == lastEnd)
          lastEnd = r.end;
        continue;
      }
      const std::string component = layerComponent(nodeName(r.op->getLoc()));
      const bool backward = index[r.op] >= backwardBegin;
      const bool glue = i > 0 && r.begin != lastEnd;
      if (!glue && !cur.component.empty() && component != cur.component &&
          isa<ReshapeOp>(r.op)) {
        Operation *from = r.op->getOperand(0).getDefiningOp();
        auto at = from ? recordOf.find(from) : recordOf.end();
        if (!from || (at != recordOf.end() && at->second < cur.first)) {
          cur.hoisted.push_back(i);
          cur.last = i + 1;
          lastEnd = r.end;
          continue;
        }
      }
      if (glue || component != cur.component || backward != cur.backward) {
        close();
        cur = Run{i, i + 1, component, backward, ""};
      } else {
        cur.last = i + 1;
      }
      lastEnd = r.end;
    }
    close();
  }
  if (runs.size() < 2)
    return true;

  // Each run printed with positional names; twins print the same.
  std::vector<std::unique_ptr<LayerScope>> scopes;
  std::map<std::tuple<std::string, bool, std::string>, std::vector<size_t>> twins;
  for (size_t k = 0; k < runs.size(); ++k) {
    Run &run = runs[k];
    scopes.push_back(std::make_unique<LayerScope>());
    run.scope = scopes.back().get();
    run.scope->component = run.component;
    if (!printLayer(run.members, *run.scope, run.text))
      continue;
    twins[{componentName(run.component), run.backward, run.text}].push_back(k);
  }

  // Which records each outlined run covers, and the functions.
  std::vector<int> outlinedBy(records.size(), -1); // record -> run
  struct Call {
    size_t run;
    std::string function;
    size_t row;
  };
  std::vector<Call> calls;
  std::map<std::string, int> functionNames;
  for (auto &[key, members] : twins) {
    if (members.size() < 2)
      continue;
    const Run &r0 = runs[members[0]];
    const LayerScope &s0 = *r0.scope;
    // Readable names: a value's step name without the layer's part, where
    // every twin agrees on it; else its position.
    std::vector<std::string> given(s0.order.size());
    std::set<std::string> taken;
    for (size_t p = 0; p < s0.order.size(); ++p) {
      std::string pick;
      for (size_t m : members) {
        const LayerScope &s = *runs[m].scope;
        std::string n = withoutLayer(var.map.lookup(s.order[p]), identifier(runs[m].component));
        if (m == members[0])
          pick = n;
        else if (n != pick)
          pick.clear();
      }
      if (!usableName(pick) || taken.count(pick))
        pick = (s0.defined.count(s0.order[p]) ? "v" : "in") + std::to_string(p);
      taken.insert(pick);
      given[p] = pick;
    }
    LayerScope named;
    named.component = r0.component;
    named.given = &given;
    std::string text;
    if (!printLayer(r0.members, named, text))
      return fail("the layer " + r0.component + " printed once but not again with its names");

    std::string fname = "layer_" + identifier(std::get<0>(key)) + (r0.backward ? "_backward" : "_forward");
    if (int n = functionNames[fname]++)
      fname += "_" + std::to_string(n + 1);
    const std::string family = componentName(r0.component);
    std::string &d = layerDefs;
    d += "/// " + family + ".*, " + (r0.backward ? "backward" : "forward") + ": the same statements for " +
         std::to_string(members.size()) + " layers (";
    for (size_t i = 0; i < members.size(); ++i)
      d += (i ? ", " : "") + runs[members[i]].component;
    d += "),\n/// each called with its row of " + fname + "_at: where its buffers are in the arena.\n";
    d += "const int64_t " + fname + "_at[" + std::to_string(members.size()) + "][" +
         std::to_string(s0.slots.size()) + "] = {\n";
    for (size_t m : members) {
      const LayerScope &s = *runs[m].scope;
      d += "    {";
      for (size_t k = 0; k < s.slots.size(); ++k)
        d += (k ? ", " : "") + std::to_string(buffers[bufferOf.lookup(s.slots[k])].offset);
      d += "},  // " + runs[m].component + "\n";
    }
    d += "};\n\nvoid " + fname + "(StepContext &ctx, const int64_t *at) {\n";
    d += "  char *const A = ctx.arena;\n";
    d += "  // What it reads from before the layer.\n" + named.declarations + "\n" + text + "}\n\n";
    for (size_t i = 0; i < members.size(); ++i) {
      const Run &r = runs[members[i]];
      for (size_t j : r.members)
        outlinedBy[j] = (int)members[i];
      calls.push_back({members[i], fname, i});
    }
  }
  if (calls.empty())
    return true;
  recordOutlined.assign(records.size(), false);
  for (size_t i = 0; i < records.size(); ++i)
    recordOutlined[i] = outlinedBy[i] >= 0;
  for (BlockArgument a : fn.getArguments()) {
    auto it = var.readers.find(a);
    if (it != var.readers.end() && llvm::all_of(it->second, [&](int reader) {
          return reader >= 0 && outlinedBy[reader] >= 0;
        }))
      onlyInLayers.insert(a);
  }
  std::sort(calls.begin(), calls.end(),
            [&](const Call &a, const Call &b) { return runs[a.run].first < runs[b.run].first; });

  // The body again: each outlined run is its call, then the values it wrote
  // that a statement outside the layers' functions reads.
  std::string rebuilt;
  size_t cursor = 0;
  size_t newForwardEnd = std::string::npos;
  for (const Call &c : calls) {
    const Run &r = runs[c.run];
    const size_t begin = records[r.first].begin, end = records[r.last - 1].end;
    if (newForwardEnd == std::string::npos && forwardEnd != std::string::npos &&
        forwardEnd <= begin)
      newForwardEnd = rebuilt.size() + (forwardEnd - cursor);
    rebuilt += body.substr(cursor, begin - cursor);
    for (size_t h : r.hoisted)
      rebuilt += body.substr(records[h].begin, records[h].end - records[h].begin);
    rebuilt += "  " + c.function + "(ctx, " + c.function + "_at[" + std::to_string(c.row) +
               "]);  // " + r.component + "\n";
    std::vector<Value> escaping;
    for (Value v : r.scope->defined) {
      auto it = var.readers.find(v);
      if (it == var.readers.end())
        continue;
      for (int reader : it->second)
        if (reader < 0 || outlinedBy[reader] < 0) {
          escaping.push_back(v);
          break;
        }
    }
    // In the order the layer wrote them.
    std::sort(escaping.begin(), escaping.end(), [&](Value a, Value b) {
      return std::find(r.scope->order.begin(), r.scope->order.end(), a) <
             std::find(r.scope->order.begin(), r.scope->order.end(), b);
    });
    for (Value v : escaping) {
      const Buffer &b = buffers[bufferOf.lookup(v)];
      rebuilt += "  " + ctypeOf(v) + " *" + var.map.lookup(v) + " = (" + ctypeOf(v) + " *)" +
                 (b.offset >= 0 && b.region != Region::Constant
                      ? "(A + " + std::to_string(b.offset) + ")"
                      : var.map.lookup(aliasRoot(v))) +
                 ";  // written by " + r.component + "\n";
    }
    cursor = end;
  }
  if (newForwardEnd == std::string::npos && forwardEnd != std::string::npos)
    newForwardEnd = rebuilt.size() + (forwardEnd - cursor);
  rebuilt += body.substr(cursor);
  body = std::move(rebuilt);
  forwardEnd = newForwardEnd;
  return true;
}

std::string Generator::argumentPointers() {
  std::string s;
  for (BlockArgument a : fn.getArguments())
    if (!onlyInLayers.count(a))
      s += argumentPointer(a, false);
  if (!onlyInLayers.empty())
    s += "  // (" + std::to_string(onlyInLayers.size()) +
         " more that only the layers' functions read: in their tables)\n";
  return s;
}

} // namespace carve::codegen
