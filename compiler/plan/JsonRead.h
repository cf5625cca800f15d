//===- JsonRead.h - JSON text parsed with bounded nesting -----------------===//
//
// Plan files, rules files, constraints, calibration and cluster files are
// read through this one parser: it refuses nesting beyond kMaxJsonDepth
// while parsing (nlohmann::json's dump() and copies recurse once per level,
// so 200000 levels overflow the stack) and turns every JSON error, a number
// beyond a double (1e999) included, into a message instead of an exception.
// docs/fuzzing.md.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_PLAN_JSONREAD_H
#define CARVE_COMPILER_PLAN_JSONREAD_H

#include <nlohmann/json.hpp>

#include <string>

namespace carve {

constexpr int kMaxJsonDepth = 64;

/// Parses `text` into `out`. On failure returns false with `cause`:
/// "not valid JSON (MESSAGE)" or "nested deeper than 64 levels". MESSAGE is
/// the parser's, without its "[json.exception...]" prefix unless `rawMessage`.
inline bool parseBoundedJson(const std::string &text, nlohmann::json &out, std::string &cause,
                             bool rawMessage = false) {
  bool deep = false;
  try {
    out = nlohmann::json::parse(text, [&](int depth, nlohmann::json::parse_event_t,
                                          nlohmann::json &) {
      deep = deep || depth > kMaxJsonDepth;
      return !deep;
    });
  } catch (const nlohmann::json::exception &e) {
    // parse_error, or out_of_range for a number beyond a double.
    std::string msg = e.what();
    size_t colon = msg.find(": ");
    if (colon == std::string::npos)
      colon = msg.find("] ");
    cause = "not valid JSON (" +
            (rawMessage || colon == std::string::npos ? msg : msg.substr(colon + 2)) + ")";
    return false;
  }
  if (deep) {
    cause = "nested deeper than " + std::to_string(kMaxJsonDepth) + " levels";
    return false;
  }
  return true;
}

} // namespace carve

#endif // CARVE_COMPILER_PLAN_JSONREAD_H
