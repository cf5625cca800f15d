//===- Annotation.h - parsed partition annotations ------------------------===//
//
// The partition annotation of an op (PartitionableOpInterface, grammar in
// docs/partition.md), parsed and bound to the op's shapes: for every operand
// and result dimension its factors (names or fixed counts), every name's size
// and mark. The parser of the grammar whose strings the ops' interface prints
// (Annotations.cpp); the partitioner, the rules file (--rules), the importer's
// batch tracking and the planner use it.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_DIALECTS_CARVE_ANNOTATION_H
#define CARVE_DIALECTS_CARVE_ANNOTATION_H

#include "llvm/ADT/ArrayRef.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace carve {

/// What a split of a name leaves behind where the name is absent.
enum class Mark { Plain, Sum, Max, Never, Internal };

struct Factor {
  std::string name;  // empty for a fixed count
  int64_t count = 0; // the fixed count, or the bound size of `name`
};

/// One dimension: one factor, or a group `(a b)` (outermost first).
using DimFactors = std::vector<Factor>;
using TensorFactors = std::vector<DimFactors>;

struct Annotation {
  std::vector<TensorFactors> operands, results;
  std::map<std::string, Mark> marks;
  std::map<std::string, int64_t> sizes; // after bind()
  std::string text;

  /// Parses `text`. On failure returns false with the reason in `error`.
  static bool parse(const std::string &text, Annotation &out, std::string &error);

private:
  static bool parseText(const std::string &text, Annotation &out, std::string &error);

public:
  /// Checks arity and ranks against the shapes and solves every name's size.
  bool bind(llvm::ArrayRef<std::vector<int64_t>> operandShapes,
            llvm::ArrayRef<std::vector<int64_t>> resultShapes, std::string &error);

  Mark markOf(const std::string &name) const {
    auto it = marks.find(name);
    return it == marks.end() ? Mark::Plain : it->second;
  }
  /// Where `name` is in `t`: dimension and the product of the factors before it
  /// in its group; false when `t` does not have it.
  static bool find(const TensorFactors &t, const std::string &name, int64_t &dim, int64_t &outer);
  /// Every name, in order of first appearance.
  std::vector<std::string> names() const;
};

} // namespace carve

#endif // CARVE_DIALECTS_CARVE_ANNOTATION_H
