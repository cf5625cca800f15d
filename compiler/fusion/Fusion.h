//===- Fusion.h - elementwise fusion groups on the IR ---------------------===//
//
// carve-fuse-elementwise (FuseElementwise.cpp) marks the members of each
// fused kernel with `carve.fusion_group`; the emitter reads the groups back
// with fusionGroups. carve-fold-transposes (FoldTransposes.cpp) marks the
// transposes a matmul's flags absorb with `carve.fold`.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_FUSION_FUSION_H
#define CARVE_COMPILER_FUSION_FUSION_H

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"
#include "llvm/ADT/DenseSet.h"

#include "dialects/carve/CarveOps.h"

#include <optional>
#include <vector>

namespace carve {
struct PlanAttrs;

/// The runtime's Unary enum entry for a unary function name ("gelu_tanh" for
/// GELU with the tanh approximation), or null when the runtime has none.
const char *unaryKernel(llvm::StringRef fn);
/// The runtime's Binary enum entry of an arithmetic op (add, sub, mul, div,
/// pow, maximum, minimum), or null for any other op.
const char *binaryKernel(mlir::Operation *op);
/// The Unary function name of a unary op (gelu with approximate = "tanh" is
/// "gelu_tanh").
std::string unaryName(mlir::Operation *op);
/// True for an f32 elementwise op that a fused kernel can compute: add, sub,
/// mul, div, maximum, minimum, a unary op of the Unary enum, or its gradient.
bool isFusible(mlir::Operation *op);

/// True for a transpose that swaps exactly the last two dimensions (the
/// ones a GEMM's transpose flag covers).
bool swapsLastTwo(TransposeOp t);
/// The op's carve.fold mark (carve-fold-transposes): kFoldOperand,
/// kFoldProduct, kFoldScatter, kFoldGather, kFoldView, kFoldProducer,
/// kFoldConsumer, kFoldAccumulate, kFoldAssemble or kFoldStrided
/// (carve-fold-views), or ""
/// when it is not folded.
llvm::StringRef foldOf(mlir::Operation *op);

/// A strided view of a contiguous tensor `base`: element (i0, i1, ...) of
/// the view is base's element offset + i0 * strides[0] + i1 * strides[1] ...
struct StridedView {
  mlir::Value base;
  int64_t offset = 0;
  llvm::SmallVector<int64_t> shape, strides;
};
/// The strides that read `newShape` (same element count) from a view of
/// `shape` with `strides` in row-major order, where strides can (each run of
/// dimensions the new shape splits or merges is contiguous within the view);
/// false where a copy would be needed.
bool reshapeStrides(llvm::ArrayRef<int64_t> shape, llvm::ArrayRef<int64_t> strides,
                    llvm::ArrayRef<int64_t> newShape, llvm::SmallVectorImpl<int64_t> &out);
/// `v`, a slice's result through reshapes, as a strided view of the slice's
/// source (positive steps); nullopt otherwise, or where no strides describe
/// one of the reshapes.
std::optional<StridedView> sliceViewOf(mlir::Value v);
/// sliceViewOf, for a slice carve-fold-views marked (carve.fold = "view")
/// only: what a transpose reading `v` reads in place.
std::optional<StridedView> foldedViewOf(mlir::Value v);

/// Where `v`'s op writes `v` instead of `v`'s own memory: the result of the
/// transpose marked "producer" that reads `v`, its only reader (written
/// transposed), or of the add marked "accumulate" that reads it (written
/// with the add's other operand added: accumulatedResidual); null otherwise.
mlir::Value producedInto(mlir::Value v);
/// For a transpose marked "producer" or an add marked "accumulate"
/// (carve-fold-views): the op that writes its result; null otherwise.
mlir::Operation *producerOf(mlir::Operation *op);
/// For a layer or RMS norm gradient whose input gradient an add marked
/// "accumulate" reads: the add's other operand, which the norm gradient
/// adds as it writes the add's result; null otherwise.
mlir::Value accumulatedResidual(mlir::Operation *normGrad);
/// For a concat marked "assemble" (carve-fold-views): the attention
/// gradient that writes its pieces into its 16-bit copy; null otherwise.
mlir::Operation *assemblerOf(mlir::Operation *concat);
/// For a transpose marked "producer" whose result (through one reshape) is
/// a piece of a concat marked "assemble": that concat, with the piece's
/// first column in `column`; null otherwise.
mlir::Operation *assembledInto(mlir::Operation *transpose, int64_t &column);
/// For `o`, the output of a carve.attention_stats whose transpose to
/// [b, t, h, d] is marked "producer" (carve-fold-views: cuDNN's forward
/// writes O in 16 bits into that transpose's copy): the copy, the first
/// cast to a 16-bit float type right after the transpose; null otherwise.
/// The attention gradient reads o there.
mlir::Value outputCopy16(mlir::Value o);
/// `v` where it is the result of a transpose marked "consumer"
/// (carve-fold-views): that transpose's input, which its reader reads in
/// place; null otherwise.
mlir::Value consumedFrom(mlir::Value v);
/// A piece of a 16-bit tensor read in place (carve-fold-views' "strided"):
/// the tensor, the piece's first column in its rows, and the rows' width.
struct StridedPiece {
  mlir::Value source16;
  int64_t column = 0, rowStride = 0;
};
/// For a transpose marked "strided", or its 16-bit copy (also marked): the
/// 16-bit copy of the sliced tensor that holds its elements, where cuDNN's
/// attention reads it as [b, t, h, d] rows; nullopt otherwise.
std::optional<StridedPiece> stridedPieceOf(mlir::Operation *op);
/// After carve-select-kernels: whether no call reads `r` as f32. Every
/// reader, through reshapes, reads its 16-bit tensor (carve.read16; for a
/// matmul run by the transpose of its product, that transpose's flags), is
/// its 16-bit copy (carve.copy_by_writer, carve.copy_in_fused), or is a bias
/// gradient's sum that the weight gradient's GEMM does from that tensor
/// (carve.bias_grad_in_gemm). The op that writes `r` and its copy then
/// writes only the copy (unary_grad16, a norm gradient's added residual).
bool onlyRead16(mlir::Value r);
/// For a weight gradient's GEMM run as matmul16_to16_bgrad (a matmul, or a
/// product's transpose; carve-select-kernels' rule 3i): the bias gradient's
/// reduction it computes (marked carve.bias_grad_in_gemm), reading the
/// call's operand carve.bias_grad_of names through reshapes; null otherwise.
mlir::Operation *biasGradReduceOf(mlir::Operation *gemm);
/// For a matmul whose product an op marked "epilogue" reads (a bias add, or
/// GELU's gradient): that op; null otherwise.
mlir::Operation *epilogueAddOf(mlir::Operation *matmul);
/// For an op marked "epilogue": the matmul that computes it, and (`bias`)
/// the add's bias operand (for a GELU of such an add too) or the GELU
/// gradient's input (the pre-activation, cuBLASLt's auxiliary input); null
/// otherwise.
mlir::Operation *epilogueMatmulOf(mlir::Operation *add, mlir::Value *bias = nullptr);
/// For a matmul whose bias add is marked "epilogue" and read by a GELU
/// marked "epilogue" too: that GELU (cuBLASLt's GELU_AUX_BIAS); null
/// otherwise.
mlir::Operation *epilogueGeluOf(mlir::Operation *matmul);
/// For a carve.gelu of the tanh form under a bf16/fp16 `precision`, rounded
/// as written (carve.round16), a fused chain of its own or none, not folded
/// but "epilogue", the last dimension a multiple of 8, whose input is a bias
/// add marked "epilogue": that add's matmul; null otherwise. What
/// carve-fold-views' "epilogue" asks of a GELU (matmul16_bias_gelu).
mlir::Operation *biasGeluMatmul(mlir::Operation *gelu, llvm::StringRef precision);
/// For a carve.unary_grad of the tanh GELU under a bf16/fp16 `precision`
/// (not fused, not folded but "epilogue"): the matmul whose product is its
/// gradient (read by it alone; not fused, folded, gathered or scattered; a
/// matrix as its right operand, the product of the gradient's type) where
/// its input has a 16-bit tensor of its bits of the same shape and the last
/// dimension is a multiple of 8; null otherwise. What carve-fold-views'
/// "epilogue" asks of a GELU gradient (matmul16_dgelu, cuBLASLt's DGELU).
mlir::Operation *dgeluMatmul(mlir::Operation *grad, llvm::StringRef precision);
/// For a carve.add under a bf16/fp16 `precision`: the matmul whose product
/// it reads (read by the add alone; not fused, folded, gathered or
/// scattered; a matrix as its right operand, the product of the add's type)
/// and its other operand, a bias that matmul16_bias can add (rank 1, the
/// product's last dimension, an f32 view of a 16-bit tensor); null
/// otherwise. What carve-fold-views' "epilogue" asks of the operands.
mlir::Operation *biasedMatmul(mlir::Operation *add, llvm::StringRef precision,
                              mlir::Value *bias = nullptr);
/// The tensor that cuDNN's attention forward's q, k and v are column
/// slices of, its writer, its 16-bit copy right after the writer where
/// there is one, and each operand's transpose and 16-bit copy.
struct InPlaceInputs {
  mlir::Operation *writer = nullptr;
  mlir::Value source;
  CastOp existingCopy;
  TransposeOp transposes[3];
  CastOp copies[3];
};
/// q, k and v of cuDNN attention forward `a` under a bf16/fp16 `plan` that
/// can be read in place from the 16-bit copy of the one rank-3 f32 tensor
/// they are column slices of (carve-fold-views' "strided" rule, Passes.td);
/// `marked`: after carve-fold-views marked the slices "view" (and the
/// source's copy must be there), else before (carve-round-operands16, which
/// makes the copy). nullopt otherwise.
std::optional<InPlaceInputs> inPlaceInputs(AttentionStatsOp a, const PlanAttrs &plan, bool marked);

/// One fused kernel: its ops, its inputs and outputs.
struct FusionGroup {
  mlir::Operation *root = nullptr;
  std::vector<mlir::Operation *> ops; // members in program order, the root last
  std::vector<mlir::Value> inputs;    // read from memory, in first-use order
  std::vector<mlir::Value> outputs;   // the root's result, then intermediates read later
};

/// The groups carve-fuse-elementwise recorded on `fn`, in program order;
/// `interior` receives the member results nothing outside a group reads
/// (they are never stored).
std::vector<FusionGroup> fusionGroups(mlir::func::FuncOp fn, llvm::DenseSet<mlir::Value> &interior);

/// The ops of an emitted function in program order and where each one's
/// reads run once the fusion groups are taken into account: what the passes
/// after carve-fuse-elementwise and carve-fold-transposes share.
struct ProgramOrder {
  explicit ProgramOrder(mlir::func::FuncOp fn);
  std::vector<mlir::Operation *> ops;
  llvm::DenseMap<mlir::Operation *, int64_t> index;
  llvm::DenseMap<mlir::Operation *, mlir::Operation *> rootOf; // fused member -> its root
  llvm::DenseSet<mlir::Value> interior;                        // member results never stored
  /// Where `op`'s reads happen: its group's root for a fused member.
  int64_t readAt(mlir::Operation *op) const {
    mlir::Operation *r = rootOf.lookup(op);
    return index.lookup(r ? r : op);
  }
  /// The index of the first op that opensBackward (the number of ops when
  /// there is none).
  int64_t backwardBegin(bool phaseMarks = false) const;
};

/// Whether `op` opens a function's backward part: its node is "backward of
/// ...", or (with `phaseMarks`) carve.phase marks it as backward's, as on a
/// stage's first backward receive.
bool opensBackward(mlir::Operation *op, bool phaseMarks);

/// Operand `k` of `op` as it is read: through a transpose folded into a
/// matmul's flag (carve.fold = "operand"), its input.
mlir::Value readOperand(mlir::Operation *op, unsigned k);
/// A matmul whose product the transpose reading it writes (carve.fold =
/// "product"): it runs as that transpose.
bool isProductMatmul(mlir::Operation *op);
/// For a gather_grad marked carve.fold = "scatter": the matmul whose product
/// it reads through reshapes and computes itself; null for any other op.
mlir::Operation *scatteredMatmul(mlir::Operation *op);
/// A matmul, or a reshape of its product, that a "scatter" gather_grad
/// computes: no buffer and no kernel of its own.
bool isScatteredProduct(mlir::Operation *op);
/// For a matmul whose right operand, as read (through an "operand"
/// transpose and reshapes), is the result of a gather marked carve.fold =
/// "gather": that gather, whose values the matmul gathers itself a batch
/// matrix at a time; null for any other op.
mlir::Operation *gatheredOperand(mlir::Operation *op);
/// A gather marked carve.fold = "gather", or a reshape of its result: no
/// buffer and no kernel of its own (its matmuls read its table and indices).
bool isGatheredOperand(mlir::Operation *op);
/// `v` through reshapes: the value whose memory it names.
mlir::Value aliasRoot(mlir::Value v);

#define GEN_PASS_DECL
#include "compiler/fusion/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/fusion/Passes.h.inc"

} // namespace carve

#endif // CARVE_COMPILER_FUSION_FUSION_H
