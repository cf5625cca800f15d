//===- fuzz_rules.cpp - libFuzzer target: the rules file loader -----------===//
//
// Bytes -> a rules file in a scratch folder -> loadRules (compiler/rules/):
// the JSON, every entry and field, the annotation grammar of the partitioner
// and the custom ops' shape expressions. The folder holds an empty
// `swiglu.cpp`, so entries naming that kernel source get past the file checks.
//
//===----------------------------------------------------------------------===//

#include "compiler/rules/Rules.h"
#include "tests/fuzz/FuzzSupport.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  auto &dir = carve::fuzz::ScratchDir::get();
  static const bool kernel =
      (dir.write("swiglu.cpp", "", 0), dir.write("swiglu.cu", "", 0), true);
  (void)kernel;
  std::string path = dir.write("rules.json", data, size);
  carve::RuleSet rules;
  std::string error;
  if (!carve::loadRules(path, rules, error))
    carve::fuzz::checkFailure("loadRules", error);
  return 0;
}
