//===- Constraints.cpp - what the user fixes, bounds, pins or forbids -----===//
//
// Reads `--fixed FIELD=VALUE,...` and constraints files (docs/planner.md,
// "Constraints") into Constraints: each value is checked against its plan
// field here, so the search only compares. Also the JSON object reader the
// calibration table shares (parseObject, PlannerImpl.h).
//
//===----------------------------------------------------------------------===//

#include "compiler/plan/JsonRead.h"
#include "compiler/planner/PlannerImpl.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <sstream>

namespace carve::planner {

using json = nlohmann::json;

const std::vector<std::string> &constraintFields() {
  static const std::vector<std::string> f = {"dp",
                                             "tp",
                                             "pp",
                                             "ep",
                                             "zero",
                                             "sequence_parallel",
                                             "num_micro_batches",
                                             "micro_batch_size",
                                             "schedule",
                                             "virtual_stages",
                                             "recompute",
                                             "precision",
                                             "grad_accumulation",
                                             "sync_batch_norm",
                                             "tf32"};
  return f;
}

namespace {

bool isNumericField(const std::string &f) {
  return f != "schedule" && f != "recompute" && f != "precision" && f != "sequence_parallel" &&
         f != "grad_accumulation" && f != "sync_batch_norm" && f != "tf32";
}

bool checkValue(const std::string &field, const std::string &value, std::string &error) {
  auto in = [&](std::initializer_list<const char *> ok) {
    for (const char *o : ok)
      if (value == o)
        return true;
    return false;
  };
  if (field == "schedule") {
    if (!in({"gpipe", "1f1b", "interleaved"})) {
      error = "schedule must be gpipe, 1f1b or interleaved, got '" + value + "'";
      return false;
    }
    return true;
  }
  if (field == "recompute") {
    if (!in({"none", "selective", "full"})) {
      error = "recompute must be none, selective or full, got '" + value + "'";
      return false;
    }
    return true;
  }
  if (field == "precision") {
    if (!in({"fp32", "bf16", "fp16"})) {
      error = "precision must be fp32, bf16 or fp16, got '" + value + "'";
      return false;
    }
    return true;
  }
  if (field == "grad_accumulation") {
    if (!in({"fp32", "16bit"})) {
      error = "grad_accumulation must be fp32 or 16bit, got '" + value + "'";
      return false;
    }
    return true;
  }
  if (field == "sequence_parallel" || field == "sync_batch_norm" || field == "tf32") {
    if (!in({"true", "false", "1", "0"})) {
      error = field + " must be true or false, got '" + value + "'";
      return false;
    }
    return true;
  }
  char *end = nullptr;
  long long n = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end || n < (field == "zero" ? 0 : 1) || n > (1 << 24) ||
      (field == "zero" && n > 3)) {
    error = field + " must be " +
            (field == "zero" ? std::string("0, 1, 2 or 3") : std::string("a positive integer")) +
            ", got '" + value + "'";
    return false;
  }
  return true;
}

bool addFixed(Constraints &c, const std::string &field, std::string value, const std::string &what,
              std::string &error) {
  const auto &fields = constraintFields();
  if (std::find(fields.begin(), fields.end(), field) == fields.end()) {
    std::string names;
    for (const auto &f : fields)
      names += (names.empty() ? "" : ", ") + f;
    error = what + ": unknown plan field '" + field + "' (fields: " + names + ")";
    return false;
  }
  if (value == "1" &&
      (field == "sequence_parallel" || field == "sync_batch_norm" || field == "tf32"))
    value = "true";
  if (value == "0" &&
      (field == "sequence_parallel" || field == "sync_batch_norm" || field == "tf32"))
    value = "false";
  if (!checkValue(field, value, error)) {
    error = what + ": " + error;
    return false;
  }
  auto it = c.fixed.find(field);
  if (it != c.fixed.end() && it->second != value) {
    error = what + ": " + field + " is fixed twice, to " + it->second + " and to " + value;
    return false;
  }
  c.fixed[field] = value;
  return true;
}

bool parseBytes(const json &v, double &out) {
  if (v.is_number()) {
    out = v.get<double>();
    return out >= 0;
  }
  if (!v.is_string())
    return false;
  std::string s = v.get<std::string>();
  char *end = nullptr;
  double n = std::strtod(s.c_str(), &end);
  std::string unit(end);
  double mul = unit.empty() || unit == "B" ? 1
               : unit == "KiB"             ? 1024.0
               : unit == "MiB"             ? 1048576.0
               : unit == "GiB"             ? 1073741824.0
               : unit == "GB"              ? 1e9
               : unit == "MB"              ? 1e6
                                           : -1;
  if (end == s.c_str() || mul < 0 || n < 0)
    return false;
  out = n * mul;
  return true;
}

// The keys of a constraints file, one reader each; `what` names the file.

bool readFixed(const json &v, const std::string &what, Constraints &c, std::string &error) {
  if (!v.is_object()) {
    error = what + ": \"fixed\" must be an object of plan fields";
    return false;
  }
  for (auto f = v.begin(); f != v.end(); ++f) {
    std::string val = f.value().is_string()    ? f.value().get<std::string>()
                      : f.value().is_boolean() ? (f.value().get<bool>() ? "true" : "false")
                                               : f.value().dump();
    if (!addFixed(c, f.key(), val, what + ": fixed", error))
      return false;
  }
  return true;
}

bool readBounds(const json &v, const std::string &what, Constraints &c, std::string &error) {
  if (!v.is_object()) {
    error = what + ": \"bounds\" must map fields to {\"min\": N, \"max\": N}";
    return false;
  }
  for (auto f = v.begin(); f != v.end(); ++f) {
    const auto &fields = constraintFields();
    if (std::find(fields.begin(), fields.end(), f.key()) == fields.end() ||
        !isNumericField(f.key())) {
      error = what + ": bounds: '" + f.key() +
              "' is not a numeric plan field (dp, tp, pp, zero, num_micro_batches, "
              "micro_batch_size, virtual_stages)";
      return false;
    }
    const json &b = f.value();
    if (!b.is_object() || b.empty()) {
      error = what + ": bounds: '" + f.key() + "' must be {\"min\": N, \"max\": N}";
      return false;
    }
    double lo = 0, hi = 1e18;
    for (auto x = b.begin(); x != b.end(); ++x) {
      if ((x.key() != "min" && x.key() != "max") || !x.value().is_number_integer()) {
        error = what + ": bounds: '" + f.key() + "': only integer \"min\" and \"max\", got \"" +
                x.key() + "\": " + x.value().dump();
        return false;
      }
      (x.key() == "min" ? lo : hi) = x.value().get<double>();
    }
    if (lo > hi) {
      error = what + ": bounds: '" + f.key() + "' has min " + std::to_string((long long)lo) +
              " above max " + std::to_string((long long)hi);
      return false;
    }
    c.bounds[f.key()] = {lo, hi};
  }
  return true;
}

bool readPins(const json &v, const std::string &what, Constraints &c, std::string &error) {
  if (!v.is_object()) {
    error = what + ": \"pin\" must map op-name globs to a dimension or \"replicate\"";
    return false;
  }
  for (auto f = v.begin(); f != v.end(); ++f) {
    if (!f.value().is_string() || f.value().get<std::string>().empty()) {
      error = what + ": pin: '" + f.key() + "' must name a dimension or \"replicate\"";
      return false;
    }
    c.pins.push_back({f.key(), f.value().get<std::string>()});
  }
  return true;
}

bool readNoSplit(const json &v, const std::string &what, Constraints &c, std::string &error) {
  if (!v.is_array()) {
    error = what + ": \"no_split\" must be a list of dimensions (batch, sequence, layers, "
                   "hidden)";
    return false;
  }
  for (const json &d : v) {
    std::string s = d.is_string() ? d.get<std::string>() : "";
    if (s != "batch" && s != "sequence" && s != "layers" && s != "hidden") {
      error = what + ": no_split: " + d.dump() +
              " is not a dimension the planner splits (batch, sequence, layers, hidden)";
      return false;
    }
    c.noSplit.insert(s);
  }
  return true;
}

bool readHeadroom(const json &v, const std::string &what, Constraints &c, std::string &error) {
  double x = 0;
  if (v.is_number_float() && v.get<double>() >= 0 && v.get<double>() < 1) {
    c.headroomFraction = v.get<double>();
  } else if (v.is_string() && parseBytes(v, x)) {
    c.headroomBytes = x;
  } else {
    error = what +
            ": memory_headroom must be a fraction in [0, 1) or bytes like \"4GiB\", "
            "got " +
            v.dump();
    return false;
  }
  return true;
}

} // namespace

bool parseObject(const std::string &text, const std::string &what, const char *example, json &j,
                 std::string &error) {
  std::string cause;
  if (!parseBoundedJson(text, j, cause, /*rawMessage=*/true)) {
    error = what + ": " + cause;
    return false;
  }
  if (!j.is_object()) {
    error = what + ": " + example;
    return false;
  }
  return true;
}

bool parseFixed(const std::string &text, Constraints &c, std::string &error) {
  std::stringstream ss(text);
  std::string item;
  bool any = false;
  while (std::getline(ss, item, ',')) {
    if (item.empty())
      continue;
    size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
      error = "--fixed: '" + item + "' is not FIELD=VALUE (e.g. --fixed tp=8,pp=16)";
      return false;
    }
    if (!addFixed(c, item.substr(0, eq), item.substr(eq + 1), "--fixed", error))
      return false;
    any = true;
  }
  if (!any) {
    error = "--fixed: nothing given (e.g. --fixed tp=8,pp=16)";
    return false;
  }
  return true;
}

bool parseConstraints(const std::string &text, const std::string &what, Constraints &c,
                      std::string &error) {
  json j;
  if (!parseObject(text, what, "constraints are a JSON object, e.g. {\"fixed\": {\"tp\": 8}}", j,
                   error))
    return false;
  using Reader = bool (*)(const json &, const std::string &, Constraints &, std::string &);
  static const std::map<std::string, Reader> readers = {{"fixed", readFixed},
                                                        {"bounds", readBounds},
                                                        {"pin", readPins},
                                                        {"no_split", readNoSplit},
                                                        {"memory_headroom", readHeadroom}};
  for (auto it = j.begin(); it != j.end(); ++it) {
    auto r = readers.find(it.key());
    if (r == readers.end()) {
      error = what + ": unknown key \"" + it.key() +
              "\" (keys: fixed, bounds, pin, no_split, memory_headroom)";
      return false;
    }
    if (!r->second(it.value(), what, c, error))
      return false;
  }
  return true;
}

} // namespace carve::planner
