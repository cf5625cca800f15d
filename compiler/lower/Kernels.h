//===- Kernels.h - the runtime entries generated code may call ------------===//
//
// The compiler's view of runtime/include/carve/rt/kernels.def, the one list
// of the runtime's entry points: the names carve-select-kernels writes into
// `carve.kernel` and the emitter prints, and the targets that have each.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_LOWER_KERNELS_H
#define CARVE_COMPILER_LOWER_KERNELS_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"

#include <optional>

namespace carve {

/// One runtime entry (kernels.def): a function of carve::rt and/or
/// carve::gpu, or a Communicator method.
struct RuntimeEntry {
  const char *name;
  bool cpu;  // carve::rt declares it
  bool cuda; // carve::gpu declares it (a CUDA program calls it as gpu::name)
  bool host; // a host function of carve::rt both targets call
  bool comm; // a Communicator method, on both targets
  const char *summary;
};

/// The entry named `name`, if kernels.def lists it.
std::optional<RuntimeEntry> lookupRuntimeEntry(llvm::StringRef name);

/// Whether a program for `target` ("cpu" or "cuda") can call `e`.
bool runsOn(const RuntimeEntry &e, llvm::StringRef target);

/// Every entry, in kernels.def's order.
llvm::ArrayRef<RuntimeEntry> runtimeEntries();

/// The `carve.kernel` of an op that becomes no call of its own: a view
/// (reshape), a constant's static array, a transpose folded into its
/// matmul's flags, a product or gather computed by the kernel that reads it.
constexpr const char *kNoKernel = "none";
/// The `carve.kernel` of every member of a fused chain (carve.fusion_group):
/// the chain runs as one `fused` call at its root.
constexpr const char *kFusedKernel = "fused";

} // namespace carve

#endif // CARVE_COMPILER_LOWER_KERNELS_H
