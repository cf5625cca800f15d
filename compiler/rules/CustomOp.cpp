//===- CustomOp.cpp - shape expressions of custom ops ---------------------===//
//
//   expr   := term (('+' | '-') term)*
//   term   := unary (('*' | '/') unary)*
//   unary  := '-' unary | atom
//   atom   := INTEGER | 'in' INTEGER '[' '-'? INTEGER ']' | '(' expr ')'
//
// One recursive-descent pass both checks and, given input shapes, evaluates.
//
//===----------------------------------------------------------------------===//

#include "compiler/rules/CustomOp.h"

#include <cctype>

using namespace carve;

namespace {

struct Parser {
  const std::string &s;
  int numInputs;
  llvm::ArrayRef<std::vector<int64_t>> inputs; // empty: check only
  bool evaluate;
  size_t i = 0;
  std::string error;

  bool fail(const std::string &why) {
    if (error.empty())
      error = "\"" + s + "\": " + why;
    return false;
  }
  std::string here() const {
    return i < s.size() ? "'" + std::string(1, s[i]) + "' at column " + std::to_string(i + 1)
                        : std::string("the end");
  }
  void skip() {
    while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i])))
      ++i;
  }
  bool integer(int64_t &v) {
    skip();
    size_t start = i;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])))
      ++i;
    if (i == start)
      return fail("expected a number, found " + here());
    if (i - start > 12)
      return fail("the number " + s.substr(start, i - start) + " is too large");
    v = std::stoll(s.substr(start, i - start));
    return true;
  }

  bool atom(int64_t &v) {
    skip();
    if (i >= s.size())
      return fail("unexpected end; expected a number, inK[d] or '('");
    if (s[i] == '(') {
      ++i;
      if (!expr(v))
        return false;
      skip();
      if (i >= s.size() || s[i] != ')')
        return fail("expected ')', found " + here());
      ++i;
      return true;
    }
    if (std::isdigit(static_cast<unsigned char>(s[i])))
      return integer(v);
    if (s.compare(i, 2, "in") == 0) {
      i += 2;
      int64_t k, d;
      if (i >= s.size() || !std::isdigit(static_cast<unsigned char>(s[i])))
        return fail("expected an input number after 'in' (in0, in1, ...), found " + here());
      if (!integer(k))
        return false;
      if (k >= numInputs)
        return fail("in" + std::to_string(k) + " names input " + std::to_string(k) +
                    ", but the op has " + std::to_string(numInputs) +
                    " (as many as its annotation has operands)");
      skip();
      if (i >= s.size() || s[i] != '[')
        return fail("expected '[' after in" + std::to_string(k) + ", found " + here());
      ++i;
      skip();
      bool negative = i < s.size() && s[i] == '-';
      if (negative)
        ++i;
      if (!integer(d))
        return false;
      skip();
      if (i >= s.size() || s[i] != ']')
        return fail("expected ']', found " + here());
      ++i;
      if (!evaluate) {
        v = 1;
        return true;
      }
      const std::vector<int64_t> &shape = inputs[k];
      int64_t rank = static_cast<int64_t>(shape.size());
      int64_t at = negative ? rank - d : d;
      if (at < 0 || at >= rank)
        return fail("in" + std::to_string(k) + "[" + (negative ? "-" : "") + std::to_string(d) +
                    "] is outside input " + std::to_string(k) + "'s rank of " +
                    std::to_string(rank));
      v = shape[at];
      return true;
    }
    return fail("unexpected " + here() + "; expected a number, inK[d] or '('");
  }

  bool unary(int64_t &v) {
    skip();
    if (i < s.size() && s[i] == '-') {
      ++i;
      if (!unary(v))
        return false;
      v = -v;
      return true;
    }
    return atom(v);
  }

  bool term(int64_t &v) {
    if (!unary(v))
      return false;
    while (true) {
      skip();
      if (i >= s.size() || (s[i] != '*' && s[i] != '/'))
        return true;
      char op = s[i++];
      int64_t r;
      if (!unary(r))
        return false;
      if (!evaluate)
        continue;
      if (op == '*') {
        v *= r;
      } else if (r == 0) {
        return fail("division by zero");
      } else if (v % r != 0) {
        return fail(std::to_string(v) + " / " + std::to_string(r) +
                    " is not exact (shapes must divide evenly)");
      } else {
        v /= r;
      }
    }
  }

  bool expr(int64_t &v) {
    if (!term(v))
      return false;
    while (true) {
      skip();
      if (i >= s.size() || (s[i] != '+' && s[i] != '-'))
        return true;
      char op = s[i++];
      int64_t r;
      if (!term(r))
        return false;
      v = op == '+' ? v + r : v - r;
    }
  }

  bool whole(int64_t &v) {
    if (!expr(v))
      return false;
    skip();
    if (i < s.size())
      return fail("unexpected " + here());
    return true;
  }
};

} // namespace

bool carve::checkShapeExpr(const std::string &text, int numInputs, std::string &error) {
  Parser p{text, numInputs, {}, false};
  int64_t v;
  if (!p.whole(v)) {
    error = p.error;
    return false;
  }
  return true;
}

bool carve::evalShapeExpr(const std::string &text, llvm::ArrayRef<std::vector<int64_t>> inputs,
                          int64_t &value, std::string &error) {
  Parser p{text, static_cast<int>(inputs.size()), inputs, true};
  if (!p.whole(value)) {
    error = p.error;
    return false;
  }
  return true;
}
