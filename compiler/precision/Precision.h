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

struct PlanAttrs;

/// On the CUDA target under a bf16/fp16 `plan`: whether the f32 value `v` is
/// never stored, because every reader reads a 16-bit tensor of its bits
/// instead (carve-select-kernels' carve.read16):
///   - an f32 view of a 16-bit tensor (a carve.cast from the plan's format)
///     whose every use, through reshapes and folded transposes, is such a
///     read;
///   - the f32 result of a cuBLAS matmul (or the transpose of a product it
///     computes) or of a cross_entropy_grad (not vocab-parallel) whose next
///     op is its 16-bit copy
///     (a cast to the plan's format), whose every other use is such a read:
///     the op writes the copy itself (carve.write16);
///   - the f32 result of a binary op, a unary gradient, a layer or RMS norm,
///     a concat or a transpose (not fused, not folded) whose first 16-bit
///     copy among the casts right after it is the only reader that does not
///     read it as 16 bits: the op writes that copy (rule 3h) and no f32 value;
///   - a fused chain's output that the chain rounds (a member marked
///     carve.round16), read outside the chain only by 16-bit copies right
///     after the chain's root: the chain's kernel writes the copies
///     (carve.copy_in_fused) and no f32 value.
/// A read as 16 bits: a matmul operand cuBLAS reads (not a fused chain's, a
/// gathered or a scattered product's), the logits of a cross-entropy or its
/// gradient (not vocab-parallel), the q, k or v of an attention gradient
/// that runs on cuDNN, and the operands readsExact16 names. carve-plan-memory gives such values no
/// memory, and carve-select-kernels and the emitter print no call and no pointer for them.
bool neverStoredF32(mlir::Value v, const PlanAttrs &plan);

/// On the CUDA target under a bf16/fp16 `plan`: for a parameter gradient's
/// sum (a reduction's result: a bias gradient; a layer or RMS norm
/// gradient's scale or bias gradient) read only by its 16-bit cast (through
/// reshapes), among the ops right after its writer: that cast, which the
/// writer writes itself (reduce16, layer_norm_grad16, rms_norm_grad16;
/// carve-select-kernels' rule 3h) and no f32 value (neverStoredF32); else
/// null.
mlir::Value paramGradCopy16(mlir::Value v, const PlanAttrs &plan);

/// On the CUDA target under a bf16/fp16 `plan`: for the 16-bit copy `copy`
/// of a cross-entropy gradient (not vocab-parallel; classes along the last
/// axis of 2-D logits) that the gradient writes alone (the cast right after
/// it; neverStoredF32), the 16-bit tensor of the logits it reads (stored16),
/// of as many elements and the same type: the kernel reads each row of the
/// logits before it writes that row of the gradient at the same elements
/// (cross_entropy_with_grad, cross_entropy_grad16), so carve-plan-memory may
/// give the copy the logits' bytes where nothing reads the logits after the
/// gradient. Null otherwise.
mlir::Value logitsOverwrittenBy(mlir::Value copy, const PlanAttrs &plan);

/// On the CUDA target under a bf16/fp16 `plan`: whether operand `k` of `u`
/// is read as the 16-bit tensor that holds exactly its f32 values (exact16:
/// the tensor it is a view of, or a copy of a value rounded as written),
/// widened in registers by a kernel that computes in f32: the input, scale
/// and bias of a layer or RMS norm, the input and scale of their gradients,
/// the input of a unary gradient, either operand of a binary op, a gather's
/// table (not vocab-parallel), and an input of a fused elementwise chain.
/// carve-select-kernels marks them carve.read16 (layer_norm16, ...,
/// binary16, gather16, a chain's members); the values are the same bits.
bool readsExact16(mlir::Operation *u, unsigned k, const PlanAttrs &plan);

#define GEN_PASS_DECL
#include "compiler/precision/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/precision/Passes.h.inc"

} // namespace carve

#endif // CARVE_COMPILER_PRECISION_PRECISION_H
