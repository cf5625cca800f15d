//===- Precision.h - 16-bit activations, parameters and gradients ---------===//
//
// carve-round-activations and carve-pack-activations (Activations16.cpp):
// under a bf16 or fp16 plan, the activations kept from forward to backward
// are stored in 16 bits; carve-store-params16 (Params16.cpp): so are the
// parameters the step reads, with fp32 masters; carve-store-grads16
// (Grads16.cpp): so are the gradients, unless micro-batches accumulate them
// in fp32. Their rules are in Passes.td.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_PRECISION_PRECISION_H
#define CARVE_COMPILER_PRECISION_PRECISION_H

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Value.h"
#include "mlir/Pass/Pass.h"

namespace carve {

#define GEN_PASS_DECL
#include "compiler/precision/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/precision/Passes.h.inc"

} // namespace carve

#endif // CARVE_COMPILER_PRECISION_PRECISION_H
