//===- Kernels.cpp - the runtime entries generated code may call ----------===//

#include "compiler/lower/Kernels.h"

#include "llvm/ADT/ArrayRef.h"

namespace carve {

namespace {
const RuntimeEntry kEntries[] = {
#define CARVE_RT_KERNEL(name, cpu, cuda, summary)                                                  \
  {#name, cpu != 0, cuda != 0, false, false, summary},
#define CARVE_RT_HOST(name, summary) {#name, true, false, true, false, summary},
#define CARVE_RT_COMM(name, summary) {#name, true, false, false, true, summary},
#include "runtime/include/carve/rt/kernels.def"
};
} // namespace

llvm::ArrayRef<RuntimeEntry> runtimeEntries() { return kEntries; }

std::optional<RuntimeEntry> lookupRuntimeEntry(llvm::StringRef name) {
  for (const RuntimeEntry &e : kEntries)
    if (name == e.name)
      return e;
  return std::nullopt;
}

bool runsOn(const RuntimeEntry &e, llvm::StringRef target) {
  if (e.host || e.comm)
    return true;
  return target == "cuda" ? e.cuda : e.cpu;
}

} // namespace carve
