//===- Annotation.cpp - the partition annotation grammar ------------------===//

#include "dialects/carve/Annotation.h"

#include <cctype>
#include <mutex>
#include <set>
#include <unordered_map>

using namespace carve;

namespace {

std::string trim(const std::string &s) {
  size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

std::vector<std::string> splitTop(const std::string &s) {
  std::vector<std::string> parts;
  std::string cur;
  for (char c : s) {
    if (c == ',') {
      parts.push_back(trim(cur));
      cur.clear();
    } else {
      cur += c;
    }
  }
  parts.push_back(trim(cur));
  return parts;
}

struct Lexer {
  const std::string &s;
  size_t i = 0;
  void skip() {
    while (i < s.size() && s[i] == ' ')
      ++i;
  }
};

bool setMark(Annotation &a, const std::string &name, Mark m, std::string &error) {
  if (m == Mark::Plain)
    return true;
  auto [it, fresh] = a.marks.emplace(name, m);
  if (!fresh && it->second != m) {
    error = "dimension '" + name + "' has two different marks";
    return false;
  }
  return true;
}

/// name[+|+max|^|~] or a count (inside groups).
bool parseFactor(Annotation &a, Lexer &lx, bool inGroup, Factor &f, std::string &error) {
  const std::string &s = lx.s;
  size_t start = lx.i;
  if (std::isdigit(static_cast<unsigned char>(s[lx.i]))) {
    while (lx.i < s.size() && std::isdigit(static_cast<unsigned char>(s[lx.i])))
      ++lx.i;
    if (!inGroup) {
      error = "a count (" + s.substr(start, lx.i - start) + ") must be inside a group like (3 c)";
      return false;
    }
    if (lx.i - start > 12) {
      error = "the count " + s.substr(start, lx.i - start) + " is too large";
      return false;
    }
    f.count = std::stoll(s.substr(start, lx.i - start));
    if (f.count < 1) {
      error = "a count must be >= 1";
      return false;
    }
    return true;
  }
  if (!std::isalpha(static_cast<unsigned char>(s[lx.i])) && s[lx.i] != '_') {
    error = std::string("unexpected '") + s[lx.i] + "' at column " + std::to_string(lx.i + 1);
    return false;
  }
  while (lx.i < s.size() && (std::isalnum(static_cast<unsigned char>(s[lx.i])) || s[lx.i] == '_'))
    ++lx.i;
  f.name = s.substr(start, lx.i - start);
  Mark m = Mark::Plain;
  if (lx.i < s.size() && s[lx.i] == '+') {
    ++lx.i;
    m = Mark::Sum;
    if (s.compare(lx.i, 3, "max") == 0) {
      lx.i += 3;
      m = Mark::Max;
    }
  } else if (lx.i < s.size() && s[lx.i] == '^') {
    ++lx.i;
    m = Mark::Never;
  } else if (lx.i < s.size() && s[lx.i] == '~') {
    ++lx.i;
    m = Mark::Internal;
  }
  return setMark(a, f.name, m, error);
}

bool parseTensor(Annotation &a, const std::string &text, TensorFactors &t, std::string &error) {
  if (text == "()")
    return true;
  if (text.empty()) {
    error = "an empty operand or result (write () for a scalar)";
    return false;
  }
  Lexer lx{text};
  while (true) {
    lx.skip();
    if (lx.i >= text.size())
      return true;
    DimFactors dim;
    if (text[lx.i] == '(') {
      ++lx.i;
      while (true) {
        lx.skip();
        if (lx.i >= text.size()) {
          error = "unclosed '(' in '" + text + "'";
          return false;
        }
        if (text[lx.i] == ')') {
          ++lx.i;
          break;
        }
        Factor f;
        if (!parseFactor(a, lx, true, f, error))
          return false;
        dim.push_back(f);
      }
      if (dim.empty()) {
        error = "an empty group () inside '" + text + "'";
        return false;
      }
    } else {
      Factor f;
      if (!parseFactor(a, lx, false, f, error))
        return false;
      dim.push_back(f);
    }
    t.push_back(dim);
  }
}

} // namespace

bool Annotation::parse(const std::string &text, Annotation &out, std::string &error) {
  // Remembered by text for the process: a model has a few dozen distinct
  // annotations over thousands of ops, and the planner partitions it many
  // times. Only successful parses are kept.
  static std::mutex lock;
  static std::unordered_map<std::string, Annotation> parsed;
  {
    std::lock_guard<std::mutex> hold(lock);
    auto it = parsed.find(text);
    if (it != parsed.end()) {
      out = it->second;
      return true;
    }
  }
  if (!parseText(text, out, error))
    return false;
  std::lock_guard<std::mutex> hold(lock);
  parsed.emplace(text, out);
  return true;
}

bool Annotation::parseText(const std::string &text, Annotation &out, std::string &error) {
  out = Annotation();
  out.text = text;
  size_t arrow = text.find("->");
  if (arrow == std::string::npos || text.find("->", arrow + 2) != std::string::npos) {
    error = "annotation '" + text + "' must have exactly one '->'";
    return false;
  }
  std::string lhs = trim(text.substr(0, arrow)), rhs = trim(text.substr(arrow + 2));
  auto side = [&](const std::string &s, std::vector<TensorFactors> &list) {
    if (s.empty())
      return true;
    for (const std::string &part : splitTop(s)) {
      TensorFactors t;
      if (!parseTensor(out, part, t, error))
        return false;
      list.push_back(t);
    }
    return true;
  };
  if (!side(lhs, out.operands) || !side(rhs, out.results)) {
    error = "annotation '" + text + "': " + error;
    return false;
  }
  if (out.results.empty()) {
    error = "annotation '" + text + "' has no results";
    return false;
  }
  // A name may appear once per tensor.
  for (const auto *list : {&out.operands, &out.results})
    for (const TensorFactors &t : *list) {
      std::set<std::string> seen;
      for (const DimFactors &d : t)
        for (const Factor &f : d)
          if (!f.name.empty() && !seen.insert(f.name).second) {
            error = "annotation '" + text + "' names '" + f.name + "' twice in one tensor";
            return false;
          }
    }
  return true;
}

bool Annotation::bind(llvm::ArrayRef<std::vector<int64_t>> operandShapes,
                      llvm::ArrayRef<std::vector<int64_t>> resultShapes, std::string &error) {
  if (operandShapes.size() != operands.size() || resultShapes.size() != results.size()) {
    error = "annotation '" + text + "' describes " + std::to_string(operands.size()) +
            " operand(s) and " + std::to_string(results.size()) + " result(s), the op has " +
            std::to_string(operandShapes.size()) + " and " + std::to_string(resultShapes.size());
    return false;
  }
  std::vector<std::pair<const TensorFactors *, const std::vector<int64_t> *>> all;
  for (size_t i = 0; i < operands.size(); ++i)
    all.push_back({&operands[i], &operandShapes[i]});
  for (size_t i = 0; i < results.size(); ++i)
    all.push_back({&results[i], &resultShapes[i]});
  for (auto [t, shape] : all)
    if (t->size() != shape->size()) {
      error = "annotation '" + text + "' gives a tensor " + std::to_string(t->size()) +
              " dimension(s), the op's has " + std::to_string(shape->size());
      return false;
    }
  // Single names first, then groups with one unknown name, until nothing changes.
  sizes.clear();
  bool changed = true;
  while (changed) {
    changed = false;
    for (auto [t, shape] : all)
      for (size_t d = 0; d < t->size(); ++d) {
        const DimFactors &dim = (*t)[d];
        int64_t known = 1;
        const Factor *unknown = nullptr;
        int unknowns = 0;
        for (const Factor &f : dim) {
          if (f.name.empty())
            known *= f.count;
          else if (sizes.count(f.name))
            known *= sizes[f.name];
          else
            ++unknowns, unknown = &f;
        }
        int64_t n = (*shape)[d];
        if (unknowns == 1) {
          if (known == 0 || n % known != 0) {
            error = "annotation '" + text + "': dimension of size " + std::to_string(n) +
                    " is not a multiple of " + std::to_string(known);
            return false;
          }
          sizes[unknown->name] = n / known;
          changed = true;
        } else if (unknowns == 0 && known != n) {
          error = "annotation '" + text + "' does not match the op's shapes (a dimension of " +
                  "size " + std::to_string(n) + " is described as " + std::to_string(known) + ")";
          return false;
        }
      }
  }
  for (const std::string &name : names())
    if (!sizes.count(name)) {
      error = "annotation '" + text + "': the size of '" + name + "' cannot be determined";
      return false;
    }
  for (auto *list : {&operands, &results})
    for (TensorFactors &t : *list)
      for (DimFactors &d : t)
        for (Factor &f : d)
          if (!f.name.empty())
            f.count = sizes[f.name];
  return true;
}

bool Annotation::find(const TensorFactors &t, const std::string &name, int64_t &dim,
                      int64_t &outer) {
  for (size_t d = 0; d < t.size(); ++d) {
    int64_t before = 1;
    for (const Factor &f : t[d]) {
      if (f.name == name) {
        dim = static_cast<int64_t>(d);
        outer = before;
        return true;
      }
      before *= f.count;
    }
  }
  return false;
}

std::vector<std::string> Annotation::names() const {
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const auto *list : {&operands, &results})
    for (const TensorFactors &t : *list)
      for (const DimFactors &d : t)
        for (const Factor &f : d)
          if (!f.name.empty() && seen.insert(f.name).second)
            out.push_back(f.name);
  return out;
}
