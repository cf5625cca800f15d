//===- CarveOps.td - the carve dialect and its tensor ops --*- tablegen -*-===//
//
// Value-semantics tensor ops over builtin ranked tensors with static shapes. The
// ONNX importer produces them; autodiff, the partitioner and codegen consume them.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_OPS_TD
#define CARVE_OPS_TD

include "mlir/IR/OpBase.td"
include "mlir/IR/AttrTypeBase.td"
include "mlir/IR/BuiltinAttributeInterfaces.td"
include "mlir/Interfaces/SideEffectInterfaces.td"
include "dialects/carve/CarveInterfaces.td"

//===----------------------------------------------------------------------===//
// Dialect
//===----------------------------------------------------------------------===//

def Carve_Dialect : Dialect {
  let name = "carve";
  let cppNamespace = "::carve";
  let summary = "Value-semantics tensor ops for training-step compilation.";
  let description = [{
    The `carve` dialect holds a model as a function of builtin ranked tensors with
    static shapes. Every op is free of side effects and works on whole tensors;
    there are no in-place updates and no dynamic shapes, with one exception:
    the optimizer's ops that carve-optimizer appends after backward
    (`carve.grad_norm`, `carve.adamw`, ...: CarveOptimizerOps.td) update the
    rank's persistent tensors in place and stay in program order. Parameters, buffers and
    graph inputs are function arguments tagged with `carve.param`,
    `carve.buffer` or `carve.input` (the names they had in the exported model),
    so the names survive into checkpoints.

    Elementwise ops broadcast their operands the NumPy/ONNX way (align trailing
    dimensions; a dimension of size 1 stretches). Higher-level ops
    (`carve.layer_norm`, `carve.rms_norm`, `carve.gelu`, `carve.silu`,
    `carve.attention`, `carve.cross_entropy`) are kept whole because later stages
    (autodiff, partitioning, fused kernels) need them whole.
  }];
  let useDefaultAttributePrinterParser = 0;
  let useDefaultTypePrinterParser = 0;
  let hasConstantMaterializer = 1;
}

class Carve_Op<string mnemonic, list<Trait> traits = []>
    : Op<Carve_Dialect, mnemonic,
         !listconcat(traits, [Pure, DeclareOpInterfaceMethods<Carve_PartitionableOpInterface>])> {
  let hasVerifier = 1;
}

def Carve_Tensor : RankedTensorOf<[AnyType]>;

// An op with a gradient rule (defined in Gradients.cpp).
defvar Carve_Differentiable = DeclareOpInterfaceMethods<Carve_DifferentiableOpInterface>;

//===----------------------------------------------------------------------===//
// Constants and casts
//===----------------------------------------------------------------------===//

def Carve_ConstantOp : Carve_Op<"constant", [ConstantLike, AllTypesMatch<["value", "result"]>]> {
  let summary = "A tensor constant.";
  let description = [{
    Materializes a constant tensor. Splats print as one value; large constants
    folded at import (a causal mask, a rotary table slice) are stored as
    `dense_resource` blobs named after the ONNX value they came from.

    ```mlir
    %eps = carve.constant dense<9.99999974E-6> : tensor<f32>
    ```
  }];
  let arguments = (ins ElementsAttr:$value);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$value attr-dict";
  let builders = [OpBuilder<(ins "::mlir::ElementsAttr":$value), [{
    build($_builder, $_state, value.getType(), value);
  }]>];
  let hasFolder = 1;
}

def Carve_CastOp : Carve_Op<"cast", [Carve_Differentiable]> {
  let summary = "Element type conversion.";
  let description = [{
    Converts every element to the result's element type with the semantics of
    ONNX `Cast` (floats round to nearest even, floats to integers truncate toward
    zero, anything non-zero becomes `true` in `i1`). Shapes are equal.

    ```mlir
    %f = carve.cast %mask : tensor<4x16xi64> -> tensor<4x16xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
}

//===----------------------------------------------------------------------===//
// Elementwise ops
//===----------------------------------------------------------------------===//

class Carve_BinaryOp<string mnemonic, string formula, string kind = "numeric",
                     list<Trait> traits = []>
    : Carve_Op<mnemonic, traits> {
  let summary = "Elementwise `" # formula # "` with broadcasting.";
  let description = [{
    Computes `}] # formula # [{` element by element. Operands broadcast the
    NumPy way to the result shape; both have the same element type.

    ```mlir
    %r = carve.}] # mnemonic # [{ %a, %b : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$lhs, Carve_Tensor:$rhs);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$lhs `,` $rhs attr-dict `:` functional-type(operands, results)";
  string operandKind = kind;
}

def Carve_AddOp : Carve_BinaryOp<"add", "lhs + rhs", "numeric", [Carve_Differentiable]>;
def Carve_SubOp : Carve_BinaryOp<"sub", "lhs - rhs", "numeric", [Carve_Differentiable]>;
def Carve_MulOp : Carve_BinaryOp<"mul", "lhs * rhs", "numeric", [Carve_Differentiable]>;
def Carve_DivOp : Carve_BinaryOp<"div", "lhs / rhs", "numeric", [Carve_Differentiable]>;
def Carve_PowOp : Carve_BinaryOp<"pow", "lhs ^ rhs", "numeric", [Carve_Differentiable]>;
def Carve_MaximumOp : Carve_BinaryOp<"maximum", "max(lhs, rhs)", "numeric", [Carve_Differentiable]>;
def Carve_MinimumOp : Carve_BinaryOp<"minimum", "min(lhs, rhs)", "numeric", [Carve_Differentiable]>;
def Carve_EqualOp : Carve_BinaryOp<"equal", "lhs == rhs (result i1)">;
def Carve_LessOp : Carve_BinaryOp<"less", "lhs < rhs (result i1)">;
def Carve_GreaterOp : Carve_BinaryOp<"greater", "lhs > rhs (result i1)">;
def Carve_AndOp : Carve_BinaryOp<"and", "lhs and rhs (i1)">;
def Carve_OrOp : Carve_BinaryOp<"or", "lhs or rhs (i1)">;

class Carve_UnaryOp<string mnemonic, string formula, list<Trait> traits = [Carve_Differentiable]>
    : Carve_Op<mnemonic, !listconcat([AllTypesMatch<["input", "result"]>], traits)> {
  let summary = "Elementwise `" # formula # "`.";
  let description = [{
    Computes `}] # formula # [{` element by element; the result has the
    operand's type.

    ```mlir
    %r = carve.}] # mnemonic # [{ %x : tensor<4x8xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
}

def Carve_NegOp : Carve_UnaryOp<"neg", "-x">;
def Carve_AbsOp : Carve_UnaryOp<"abs", "|x|">;
def Carve_ExpOp : Carve_UnaryOp<"exp", "e^x">;
def Carve_LogOp : Carve_UnaryOp<"log", "ln(x)">;
def Carve_SqrtOp : Carve_UnaryOp<"sqrt", "sqrt(x)">;
def Carve_RsqrtOp : Carve_UnaryOp<"rsqrt", "1 / sqrt(x)">;
def Carve_ReciprocalOp : Carve_UnaryOp<"reciprocal", "1 / x">;
def Carve_TanhOp : Carve_UnaryOp<"tanh", "tanh(x)">;
def Carve_ErfOp : Carve_UnaryOp<"erf", "erf(x)">;
def Carve_SigmoidOp : Carve_UnaryOp<"sigmoid", "1 / (1 + e^-x)">;
def Carve_ReluOp : Carve_UnaryOp<"relu", "max(x, 0)">;
def Carve_SinOp : Carve_UnaryOp<"sin", "sin(x)">;
def Carve_CosOp : Carve_UnaryOp<"cos", "cos(x)">;
def Carve_NotOp : Carve_UnaryOp<"not", "not x (i1)", []>;
def Carve_SiluOp : Carve_UnaryOp<"silu", "x * sigmoid(x)">;

def Carve_GeluOp : Carve_Op<"gelu", [Carve_Differentiable, AllTypesMatch<["input", "result"]>]> {
  let summary = "Gaussian error linear unit.";
  let description = [{
    `approximate = "none"`: `0.5 x (1 + erf(x / sqrt(2)))`;
    `approximate = "tanh"`: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`,
    PyTorch's `F.gelu(x, approximate=...)`.

    ```mlir
    %y = carve.gelu %x {approximate = "none"} : tensor<4x16x128xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input,
                       DefaultValuedStrAttr<StrAttr, "none">:$approximate);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
}

def Carve_DropoutOp : Carve_Op<"dropout", [Carve_Differentiable, AllTypesMatch<["input", "result"]>]> {
  let summary = "Dropout in training mode, its mask drawn per element of the full tensor.";
  let description = [{
    `input / (1 - p)` where the element is kept, `0` where it is dropped; an
    element is kept with probability `1 - p`. Its decision is a function of
    (the run's seed, the optimizer step, `node`, the element's index in the
    full tensor) only: Philox-4x32-10 (runtime/include/carve/rt/philox.h).
    The full tensor is the 1-rank program's, with the whole batch and no
    tensor-parallel split, so every plan draws the same masks; codegen says
    where each rank's piece lies in it (its tp layout, and its samples of the
    batch). `node` numbers the model's dropout nodes in import order.
    `batch_dim` is the dimension that holds the batch when the program was
    imported for a share of it (-1: none, or the whole batch), the batch
    being the factor after `batch_outer` outer ones of that dimension.

    The gradient is the same op on the output's gradient (the same mask);
    recomputation redraws the same mask. In `carve train --eval-data`'s
    forward it is the identity, as in PyTorch's eval mode.

    ```mlir
    %y = carve.dropout %x {p = 1.000000e-01 : f64, node = 0 : i64} : tensor<4x16x128xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, F64Attr:$p, I64Attr:$node,
                       DefaultValuedAttr<I64Attr, "-1">:$batch_dim,
                       DefaultValuedAttr<I64Attr, "1">:$batch_outer);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
  let extraClassDeclaration = [{
    /// The attributes as signed numbers (-1: no batch dimension).
    int64_t nodeIndex() { return static_cast<int64_t>(getNode()); }
    int64_t batchDim() { return static_cast<int64_t>(getBatchDim()); }
    int64_t batchOuter() { return static_cast<int64_t>(getBatchOuter()); }
  }];
}

def Carve_WhereOp : Carve_Op<"where", [Carve_Differentiable]> {
  let summary = "Elementwise select with broadcasting.";
  let description = [{
    `result = condition ? on_true : on_false`, all three broadcast to the result
    shape; `condition` is `i1`.

    ```mlir
    %r = carve.where %mask, %ninf, %s : (tensor<16x16xi1>, tensor<f32>, tensor<4x2x16x16xf32>) -> tensor<4x2x16x16xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$condition, Carve_Tensor:$on_true,
                       Carve_Tensor:$on_false);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = [{
    $condition `,` $on_true `,` $on_false attr-dict `:` functional-type(operands, results)
  }];
}

//===----------------------------------------------------------------------===//
// Contractions, reductions and normalizations
//===----------------------------------------------------------------------===//

def Carve_MatmulOp : Carve_Op<"matmul", [Carve_Differentiable]> {
  let summary = "Batched matrix product with NumPy semantics.";
  let description = [{
    `[..., m, k] x [..., k, n] -> [..., m, n]`; batch dimensions broadcast. A
    rank-1 operand is a vector (its dimension is dropped from the result), as in
    `numpy.matmul` and ONNX `MatMul`. Partition rule (later): `m k+, k+ n -> m n`.

    ```mlir
    %y = carve.matmul %x, %w : (tensor<4x16x32xf32>, tensor<32x96xf32>) -> tensor<4x16x96xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$lhs, Carve_Tensor:$rhs);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$lhs `,` $rhs attr-dict `:` functional-type(operands, results)";
}

class Carve_ReduceOp<string mnemonic, string what> : Carve_Op<mnemonic, [Carve_Differentiable]> {
  let summary = "Reduction (" # what # ") over the given axes.";
  let description = [{
    Reduces `input` over `axes` (sorted, non-negative, unique) by }] # what # [{.
    With `keep_dims` the reduced dimensions stay with size 1.

    ```mlir
    %m = carve.}] # mnemonic # [{ %x {axes = array<i64: 2>, keep_dims = true} : tensor<4x16x32xf32> -> tensor<4x16x1xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, DenseI64ArrayAttr:$axes,
                       DefaultValuedAttr<BoolAttr, "true">:$keep_dims);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
}

def Carve_ReduceSumOp : Carve_ReduceOp<"reduce_sum", "sum">;
def Carve_ReduceMeanOp : Carve_ReduceOp<"reduce_mean", "arithmetic mean">;
def Carve_ReduceMaxOp : Carve_ReduceOp<"reduce_max", "maximum">;

def Carve_SoftmaxOp : Carve_Op<"softmax", [Carve_Differentiable, AllTypesMatch<["input", "result"]>]> {
  let summary = "Softmax along one axis.";
  let description = [{
    `exp(x - max(x)) / sum(exp(x - max(x)))` along `axis` (non-negative).

    ```mlir
    %p = carve.softmax %s {axis = 3 : i64} : tensor<4x2x16x16xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, I64Attr:$axis);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
}

def Carve_LogSoftmaxOp : Carve_Op<"log_softmax", [Carve_Differentiable, AllTypesMatch<["input", "result"]>]> {
  let summary = "Log-softmax along one axis.";
  let description = [{
    `x - max(x) - log(sum(exp(x - max(x))))` along `axis` (non-negative).

    ```mlir
    %p = carve.log_softmax %logits {axis = 1 : i64} : tensor<64x10xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, I64Attr:$axis);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
}

def Carve_LayerNormOp : Carve_Op<"layer_norm", [Carve_Differentiable, AttrSizedOperandSegments]> {
  let summary = "Layer normalization over the trailing dimensions.";
  let description = [{
    Normalizes `input` over dimensions `[axis, rank)` to zero mean and unit
    (biased) variance, `(x - mean) / sqrt(var + epsilon)`, then multiplies by
    `scale` and adds `bias` when present (both shaped like those dimensions).
    This is `torch.nn.LayerNorm` and ONNX `LayerNormalization`; the carve-raise
    pass also recognizes the decomposed form older opsets export.

    ```mlir
    %y = carve.layer_norm %x scale %g bias %b {axis = 2 : i64, epsilon = 9.99999974E-6 : f32}
           : (tensor<4x16x32xf32>, tensor<32xf32>, tensor<32xf32>) -> tensor<4x16x32xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, Optional<Carve_Tensor>:$scale,
                       Optional<Carve_Tensor>:$bias, I64Attr:$axis, F32Attr:$epsilon);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = [{
    $input (`scale` $scale^)? (`bias` $bias^)? attr-dict `:` functional-type(operands, results)
  }];
}

def Carve_RmsNormOp : Carve_Op<"rms_norm", [Carve_Differentiable]> {
  let summary = "Root-mean-square normalization over the trailing dimensions.";
  let description = [{
    `x / sqrt(mean(x^2 over [axis, rank)) + epsilon) * scale` (Llama's RMSNorm),
    recognized by the carve-raise pass from the written-out form
    `x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight`.

    ```mlir
    %y = carve.rms_norm %x scale %w {axis = 2 : i64, epsilon = 9.99999997E-7 : f32}
           : (tensor<4x16x32xf32>, tensor<32xf32>) -> tensor<4x16x32xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, Optional<Carve_Tensor>:$scale,
                       I64Attr:$axis, F32Attr:$epsilon);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = [{
    $input (`scale` $scale^)? attr-dict `:` functional-type(operands, results)
  }];
}

def Carve_RotaryOp : Carve_Op<"rotary", [Carve_Differentiable]> {
  let summary = "Rotary position embedding: x * cos + rotate_half(x) * sin.";
  let description = [{
    `rotate_half(x)` is `concat(-x[..., d/2:], x[..., :d/2])` over the last
    dimension `d` (even): Llama's, Mistral's, Qwen2's and Gemma's
    `apply_rotary_pos_emb`. `cos` and `sin` broadcast to `x` (numpy rules);
    they get no gradient (the tables of positions, never trained). The
    carve-raise pass recognizes this op from the Mul / Slice / Neg / Concat /
    Mul / Add chain PyTorch exports; each element is computed as that chain
    computes it: `(x * cos) + (rotate_half(x) * sin)`, two products and a sum
    in the element type, none contracted.

    ```mlir
    %y = carve.rotary %x, %cos, %sin
           : (tensor<4x8x16x64xf32>, tensor<16x64xf32>, tensor<16x64xf32>) -> tensor<4x8x16x64xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, Carve_Tensor:$cos, Carve_Tensor:$sin);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = [{
    $input `,` $cos `,` $sin attr-dict `:` functional-type(operands, results)
  }];
}

def Carve_RotaryGradOp : Carve_Op<"rotary_grad"> {
  let summary = "The input gradient of rotary: (rotate_half^T(dy * sin)) + (dy * cos).";
  let description = [{
    `rotate_half^T(z)` is `concat(z[..., d/2:], -z[..., :d/2])`, the
    transpose of rotate_half's signed permutation; each element is computed as
    the gradient carve-autodiff builds from the unraised chain sums it (the
    two slices' gradients, each zero where the other is not, then the
    product with cos), so both give the same bits.

    ```mlir
    %dx = carve.rotary_grad %dy, %cos, %sin
           : (tensor<4x8x16x64xf32>, tensor<16x64xf32>, tensor<16x64xf32>) -> tensor<4x8x16x64xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$grad, Carve_Tensor:$cos, Carve_Tensor:$sin);
  let results = (outs Carve_Tensor:$input_grad);
  let assemblyFormat = [{
    $grad `,` $cos `,` $sin attr-dict `:` functional-type(operands, results)
  }];
}

def Carve_AttentionOp : Carve_Op<"attention", [Carve_Differentiable]> {
  let summary = "Scaled dot-product attention core.";
  let description = [{
    `softmax(q k^T * scale + mask) v` over the last two dimensions:
    `q: [..., Tq, d]`, `k: [..., Tk, d]`, `v: [..., Tk, dv]` give `[..., Tq, dv]`.
    Batch dimensions (batch, heads) must be equal. `causal` hides key `j > i`
    from query `i` (the upper triangle gets `-inf`); the optional `mask` is an
    additive float tensor broadcastable to `[..., Tq, Tk]` (BERT's padding mask).
    The carve-raise pass recognizes this op from the MatMul / Mul / Where / Softmax /
    MatMul chain that PyTorch exports for attention written out by hand.

    ```mlir
    %o = carve.attention %q, %k, %v {causal = true, scale = 0.25 : f32}
           : (tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>) -> tensor<4x2x16x16xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$query, Carve_Tensor:$key, Carve_Tensor:$value,
                       Optional<Carve_Tensor>:$mask, F32Attr:$scale,
                       DefaultValuedAttr<BoolAttr, "false">:$causal);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = [{
    $query `,` $key `,` $value (`mask` $mask^)? attr-dict `:` functional-type(operands, results)
  }];
}

//===----------------------------------------------------------------------===//
// Data movement
//===----------------------------------------------------------------------===//

def Carve_ReshapeOp : Carve_Op<"reshape", [Carve_Differentiable]> {
  let summary = "Reinterprets a tensor's shape; element count is unchanged.";
  let description = [{
    Row-major reshape to the static result type.

    ```mlir
    %r = carve.reshape %x : tensor<4x16x32xf32> -> tensor<4x16x2x16xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasFolder = 1;
}

def Carve_TransposeOp : Carve_Op<"transpose", [Carve_Differentiable]> {
  let summary = "Permutes dimensions.";
  let description = [{
    `result.shape[i] = input.shape[perm[i]]`.

    ```mlir
    %t = carve.transpose %x {perm = array<i64: 0, 2, 1, 3>} : tensor<4x16x2x16xf32> -> tensor<4x2x16x16xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, DenseI64ArrayAttr:$perm);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  // transpose(transpose(x, p), q) = transpose(x, p[q[i]]); the identity folds away.
  let hasFolder = 1;
}

def Carve_SliceOp : Carve_Op<"slice", [Carve_Differentiable]> {
  let summary = "Strided slice with static bounds.";
  let description = [{
    Takes `input[starts[i] : ends[i] : steps[i]]` on every dimension `i`;
    bounds are normalized (`0 <= start <= end <= dim`, `step >= 1`).

    ```mlir
    %q = carve.slice %qkv {starts = array<i64: 0, 0, 0>, ends = array<i64: 4, 16, 32>,
                          steps = array<i64: 1, 1, 1>} : tensor<4x16x96xf32> -> tensor<4x16x32xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, DenseI64ArrayAttr:$starts,
                       DenseI64ArrayAttr:$ends, DenseI64ArrayAttr:$steps);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
}

def Carve_ConcatOp : Carve_Op<"concat", [Carve_Differentiable]> {
  let summary = "Concatenates tensors along one axis.";
  let description = [{
    All operands have the result's rank and element type and agree on every
    dimension except `axis`.

    ```mlir
    %r = carve.concat %a, %b {axis = 3 : i64} : (tensor<4x2x16x4xf32>, tensor<4x2x16x4xf32>) -> tensor<4x2x16x8xf32>
    ```
  }];
  let arguments = (ins Variadic<Carve_Tensor>:$inputs, I64Attr:$axis);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$inputs attr-dict `:` functional-type(operands, results)";
}

def Carve_GatherOp : Carve_Op<"gather", [Carve_Differentiable]> {
  let summary = "Gathers slices along an axis (embedding lookup).";
  let description = [{
    ONNX `Gather`: `result.shape = data.shape[:axis] + indices.shape +
    data.shape[axis+1:]`; integer indices, negative ones count from the end.
    An embedding lookup is `gather` on axis 0 of the table.

    ```mlir
    %e = carve.gather %wte, %ids {axis = 0 : i64} : (tensor<64x32xf32>, tensor<4x16xi64>) -> tensor<4x16x32xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$data, Carve_Tensor:$indices, I64Attr:$axis);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$data `,` $indices attr-dict `:` functional-type(operands, results)";
}

def Carve_ExpertAllToAllOp : Carve_Op<"expert_all_to_all", [Carve_Differentiable]> {
  let summary = "Expert parallelism's exchange of routed tokens over the ep ranks.";
  let description = [{
    The all-to-all of expert parallelism (carve-expert-parallel): the ranks
    of one expert-parallel group (`ranks` consecutive data-parallel ranks)
    each hold `input`, their piece along `src_dim` of a tensor that the op
    re-splits along `dst_dim`: piece r along `dst_dim` of every rank's input
    goes to rank r, and the result stacks what each rank sent along
    `src_dim`, in rank order. Dispatch sends each expert's rows to the rank
    that holds the expert (`[1, E, N, H] -> [ranks, E/ranks, N, H]`, src 0,
    dst 1); combine sends the results back (src 1, dst 0). The gradient of
    one is the other.

    ```mlir
    %r = carve.expert_all_to_all %slabs {src_dim = 0 : i64, dst_dim = 1 : i64, ranks = 2 : i64}
           : (tensor<1x4x16x32xf32>) -> tensor<2x2x16x32xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, I64Attr:$src_dim, I64Attr:$dst_dim, I64Attr:$ranks);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input attr-dict `:` functional-type(operands, results)";
}

def Carve_NonzeroOp : Carve_Op<"nonzero"> {
  let summary = "Positions of the non-zero elements, at a static bound (ONNX NonZero).";
  let description = [{
    ONNX `NonZero` has a result size that depends on the data. carve keeps
    shapes static: the result is `rank(input) x numel(input)` -- the bound,
    every element non-zero -- and holds the positions of the non-zero
    elements in row-major order in its leading columns, then zeros. How many
    columns hold positions (the count) is computed beside it by the importer
    (a sum of `input != 0`), and the ops that would read past it see those
    rows masked (docs/moe.md). Not differentiable: the result is integers.

    ```mlir
    %p = carve.nonzero %m : (tensor<2x8xi1>) -> tensor<2x16xi64>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input attr-dict `:` functional-type(operands, results)";
}

def Carve_ExpandOp : Carve_Op<"expand", [Carve_Differentiable]> {
  let summary = "Broadcasts a tensor to a larger static shape.";
  let description = [{
    NumPy broadcasting of `input` to the result shape (ONNX `Expand`).

    ```mlir
    %k = carve.expand %kv : tensor<4x2x1x16x8xf32> -> tensor<4x2x2x16x8xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
}

//===----------------------------------------------------------------------===//
// Convolutional networks
//===----------------------------------------------------------------------===//

def Carve_Conv2dOp : Carve_Op<"conv2d", [Carve_Differentiable]> {
  let summary = "2-D convolution, NCHW, weights OIHW.";
  let description = [{
    ONNX `Conv` on 4-D tensors. `pads` is `[top, left, bottom, right]`; `group`
    divides the input channels. The optional `bias` has one value per output
    channel. carve-lower-convolutions writes it as gathers and GEMMs (im2col)
    except on the CUDA target with `convolution = "cudnn"` (the default),
    where it stays one op through autodiff (conv2d_grad_input,
    conv2d_grad_weight) and runs as cuDNN's convolution.

    ```mlir
    %y = carve.conv2d %x, %w {dilations = array<i64: 1, 1>, group = 1 : i64,
                              pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>}
           : (tensor<4x8x32x32xf32>, tensor<8x8x3x3xf32>) -> tensor<4x8x32x32xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, Carve_Tensor:$weight,
                       Optional<Carve_Tensor>:$bias, DenseI64ArrayAttr:$strides,
                       DenseI64ArrayAttr:$pads, DenseI64ArrayAttr:$dilations,
                       I64Attr:$group);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = [{
    $input `,` $weight (`bias` $bias^)? attr-dict `:` functional-type(operands, results)
  }];
}

def Carve_Conv2dGradInputOp : Carve_Op<"conv2d_grad_input"> {
  let summary = "conv2d's input gradient (the transposed convolution of dy by the weight).";
  let description = [{
    `input_grad[n, c, y, x]` sums `grad[n, o, i, j] * weight[o, c', a, b]` over
    the output pixels `(i, j)` and taps `(a, b)` that read `(y, x)`
    (`y = i * stride + a * dilation - pad_top`), `o` over c's group. The
    result's shape is the convolution's input's (a strided convolution's
    input size is not a function of its output's).

    ```mlir
    %dx = carve.conv2d_grad_input %dy, %w {dilations = array<i64: 1, 1>, group = 1 : i64,
                                           pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>}
           : (tensor<4x8x32x32xf32>, tensor<8x8x3x3xf32>) -> tensor<4x8x32x32xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$grad, Carve_Tensor:$weight, DenseI64ArrayAttr:$strides,
                       DenseI64ArrayAttr:$pads, DenseI64ArrayAttr:$dilations, I64Attr:$group);
  let results = (outs Carve_Tensor:$input_grad);
  let assemblyFormat = [{
    $grad `,` $weight attr-dict `:` functional-type(operands, results)
  }];
}

def Carve_Conv2dGradWeightOp : Carve_Op<"conv2d_grad_weight"> {
  let summary = "conv2d's weight gradient (the correlation of the input with dy).";
  let description = [{
    `weight_grad[o, c', a, b]` sums `grad[n, o, i, j] * input[n, c, y, x]` over
    the samples and output pixels, `(y, x)` the position tap `(a, b)` of
    pixel `(i, j)` reads (zero in the padding), `c` channel `c'` of o's group.

    ```mlir
    %dw = carve.conv2d_grad_weight %x, %dy {dilations = array<i64: 1, 1>, group = 1 : i64,
                                            pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>}
           : (tensor<4x8x32x32xf32>, tensor<4x8x32x32xf32>) -> tensor<8x8x3x3xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, Carve_Tensor:$grad, DenseI64ArrayAttr:$strides,
                       DenseI64ArrayAttr:$pads, DenseI64ArrayAttr:$dilations, I64Attr:$group);
  let results = (outs Carve_Tensor:$weight_grad);
  let assemblyFormat = [{
    $input `,` $grad attr-dict `:` functional-type(operands, results)
  }];
}

def Carve_MaxPool2dOp : Carve_Op<"max_pool2d"> {
  let summary = "2-D max pooling, NCHW.";
  let description = [{
    ONNX `MaxPool` (floor mode) on 4-D tensors; padding counts as `-inf`.

    ```mlir
    %y = carve.max_pool2d %x {kernel = array<i64: 3, 3>, pads = array<i64: 1, 1, 1, 1>,
                              strides = array<i64: 2, 2>} : tensor<4x8x32x32xf32> -> tensor<4x8x16x16xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, DenseI64ArrayAttr:$kernel,
                       DenseI64ArrayAttr:$strides, DenseI64ArrayAttr:$pads);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
}

def Carve_BatchNormOp : Carve_Op<"batch_norm"> {
  let summary = "Batch normalization over the channel dimension (dim 1).";
  let description = [{
    With `training = true`: normalizes with the batch's mean and biased variance
    over all dimensions but 1, and returns the updated running statistics
    `running = running * momentum + batch * (1 - momentum)` (ONNX's convention;
    PyTorch's `momentum=0.1` is ONNX's `0.9`; the running variance uses the
    unbiased batch variance, as PyTorch does). With `training = false`: uses
    `running_mean` / `running_var` and returns them unchanged.

    ```mlir
    %y, %mean, %var = carve.batch_norm %x, %g, %b, %rm, %rv {epsilon = 9.99999974E-6 : f32,
                        momentum = 0.899999976 : f32, training = true}
           : (tensor<4x8x32x32xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>)
           -> (tensor<4x8x32x32xf32>, tensor<8xf32>, tensor<8xf32>)
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, Carve_Tensor:$scale, Carve_Tensor:$bias,
                       Carve_Tensor:$running_mean, Carve_Tensor:$running_var,
                       F32Attr:$epsilon, F32Attr:$momentum, BoolAttr:$training);
  let results = (outs Carve_Tensor:$result, Carve_Tensor:$new_running_mean,
                      Carve_Tensor:$new_running_var);
  let assemblyFormat = [{
    $input `,` $scale `,` $bias `,` $running_mean `,` $running_var attr-dict `:`
    functional-type(operands, results)
  }];
}

def Carve_EvalSelectOp : Carve_Op<"eval_select", [Carve_Differentiable,
                                                   AllTypesMatch<["train", "eval", "result"]>]> {
  let summary = "`train` in a training step, `eval` in an evaluation's forward.";
  let description = [{
    What PyTorch's `module.eval()` changes, inside one program: `train --eval-data`
    runs the step's forward with `eval` in place of `train` (batch norm's running
    statistics instead of the batch's). The gradient goes to `train`.

    ```mlir
    %m = carve.eval_select %batch_mean, %running_mean : tensor<1x8x1x1xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$train, Carve_Tensor:$eval);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$train `,` $eval attr-dict `:` type($result)";
}

def Carve_ReplicaSumOp : Carve_Op<"replica_sum", [Carve_Differentiable,
                                                   AllTypesMatch<["input", "result"]>]> {
  let summary = "The sum over the data-parallel replicas (SyncBatchNorm's statistics).";
  let description = [{
    Each data-parallel replica computes `input` from its share of the batch;
    the result, on every replica, is their sum (an all-reduce on the
    data-parallel communicator; the ranks of one tp and pipeline position).
    A one-rank program's result is its input. The gradient is the same op on
    the result's gradient: every replica's input feeds every replica's
    result. carve-lower-convolutions builds it for batch norm under
    `sync_batch_norm` (the batch's per-channel sums and sums of squares).

    ```mlir
    %s = carve.replica_sum %sums : tensor<1x8x1x1xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
}

def Carve_AssignOp : Op<Carve_Dialect, "assign", [
    DeclareOpInterfaceMethods<Carve_PartitionableOpInterface>, MemoryEffects<[MemWrite]>,
    AllTypesMatch<["value", "buffer", "result"]>]> {
  let summary = "Writes a new value into a buffer of the model (batch norm's running statistics).";
  let description = [{
    `buffer` is a function argument that holds a model buffer (`carve.buffer`);
    where the op runs in a training step, the buffer takes `value` (each
    micro-batch's forward in turn, as PyTorch updates running statistics on
    every forward). An evaluation's forward leaves the buffer alone. The
    result is `value` (for the partitioner's annotation; nothing reads it).
    Every read of `buffer` must come before the op.

    ```mlir
    %u = carve.assign %new_mean, %running_mean : tensor<8xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$value, Carve_Tensor:$buffer);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$value `,` $buffer attr-dict `:` type($result)";
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Losses
//===----------------------------------------------------------------------===//

def Carve_CrossEntropyOp : Carve_Op<"cross_entropy", [Carve_Differentiable]> {
  let summary = "Softmax cross-entropy between logits and class indices.";
  let description = [{
    `logits: [N, C, d...]`, `targets: [N, d...]` (integer class indices).
    Per element `loss = -log_softmax(logits)[target]` along dim 1; elements whose
    target is `ignore_index` contribute 0 and do not count. `reduction` is
    `mean` (over counted elements), `sum` or `none` (result shaped like
    `targets`). This is `F.cross_entropy` and ONNX `SoftmaxCrossEntropyLoss`.

    ```mlir
    %loss = carve.cross_entropy %logits, %targets {ignore_index = -100 : i64, reduction = "mean"}
              : (tensor<64x64xf32>, tensor<64xi64>) -> tensor<f32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$logits, Carve_Tensor:$targets,
                       DefaultValuedStrAttr<StrAttr, "mean">:$reduction,
                       OptionalAttr<I64Attr>:$ignore_index);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$logits `,` $targets attr-dict `:` functional-type(operands, results)";
}

//===----------------------------------------------------------------------===//
// Backward ops
//
// The gradient rules (Gradients.cpp) write most gradients with the forward
// ops above; these ops are the backward computations that have no cheaper or
// clearer spelling in them. None of them is differentiable again.
//===----------------------------------------------------------------------===//

def Carve_UnaryGradOp : Carve_Op<"unary_grad", [AllTypesMatch<["input", "grad", "result"]>]> {
  let summary = "Gradient of an elementwise function: `grad * f'(input)`.";
  let description = [{
    `fn` names the forward op: `abs`, `exp`, `log`, `sqrt`, `rsqrt`,
    `reciprocal`, `tanh`, `erf`, `sigmoid`, `relu`, `sin`, `cos`, `silu`,
    `gelu` or `gelu_tanh`. At kinks PyTorch's choices hold: `relu'(0) = 0`,
    `abs'(0) = 0`.

    ```mlir
    %dx = carve.unary_grad %x, %dy {fn = "gelu"} : tensor<4x16x128xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, Carve_Tensor:$grad, StrAttr:$fn);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$input `,` $grad attr-dict `:` type($result)";
}

def Carve_SoftmaxGradOp : Carve_Op<"softmax_grad", [AllTypesMatch<["output", "grad", "result"]>]> {
  let summary = "Gradient of softmax or log-softmax from its output.";
  let description = [{
    With `y` the forward output: `y * (dy - sum(dy * y))` for softmax,
    `dy - exp(y) * sum(dy)` for log-softmax (`log = true`); sums along `axis`.

    ```mlir
    %dx = carve.softmax_grad %y, %dy {axis = 1 : i64, log = false} : tensor<64x10xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$output, Carve_Tensor:$grad, I64Attr:$axis, BoolAttr:$log);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$output `,` $grad attr-dict `:` type($result)";
}

def Carve_LayerNormGradOp : Carve_Op<"layer_norm_grad"> {
  let summary = "Gradients of layer_norm (input, scale, bias).";
  let description = [{
    Recomputes the statistics of `input` over `[axis, rank)` and returns the
    gradients of the input, the scale and the bias (the last two shaped like
    the normalized dimensions; unused when the forward op had none).

    ```mlir
    %dx, %dg, %db = carve.layer_norm_grad %x, %dy scale %g {axis = 2 : i64, epsilon = 9.99999974E-6 : f32}
           : (tensor<4x16x32xf32>, tensor<4x16x32xf32>, tensor<32xf32>) -> (tensor<4x16x32xf32>, tensor<32xf32>, tensor<32xf32>)
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, Carve_Tensor:$grad, Optional<Carve_Tensor>:$scale,
                       I64Attr:$axis, F32Attr:$epsilon);
  let results = (outs Carve_Tensor:$input_grad, Carve_Tensor:$scale_grad,
                      Carve_Tensor:$bias_grad);
  let assemblyFormat = [{
    $input `,` $grad (`scale` $scale^)? attr-dict `:` functional-type(operands, results)
  }];
}

def Carve_RmsNormGradOp : Carve_Op<"rms_norm_grad"> {
  let summary = "Gradients of rms_norm (input, scale).";
  let description = [{
    ```mlir
    %dx, %dw = carve.rms_norm_grad %x, %dy scale %w {axis = 2 : i64, epsilon = 9.99999997E-7 : f32}
           : (tensor<4x16x32xf32>, tensor<4x16x32xf32>, tensor<32xf32>) -> (tensor<4x16x32xf32>, tensor<32xf32>)
    ```
  }];
  let arguments = (ins Carve_Tensor:$input, Carve_Tensor:$grad, Optional<Carve_Tensor>:$scale,
                       I64Attr:$axis, F32Attr:$epsilon);
  let results = (outs Carve_Tensor:$input_grad, Carve_Tensor:$scale_grad);
  let assemblyFormat = [{
    $input `,` $grad (`scale` $scale^)? attr-dict `:` functional-type(operands, results)
  }];
}

def Carve_AttentionGradOp : Carve_Op<"attention_grad"> {
  let summary = "Gradients of attention (query, key, value).";
  let description = [{
    Recomputes the attention probabilities from `query`, `key` and the
    optional additive `mask`, and returns the gradients of query, key and
    value. The mask gets no gradient.

    ```mlir
    %dq, %dk, %dv = carve.attention_grad %q, %k, %v, %dy {causal = true, scale = 2.500000e-01 : f32}
           : (tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>)
             -> (tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>)
    ```
  }];
  let arguments = (ins Carve_Tensor:$query, Carve_Tensor:$key, Carve_Tensor:$value,
                       Carve_Tensor:$grad, Optional<Carve_Tensor>:$mask, F32Attr:$scale,
                       DefaultValuedAttr<BoolAttr, "false">:$causal);
  let results = (outs Carve_Tensor:$query_grad, Carve_Tensor:$key_grad,
                      Carve_Tensor:$value_grad);
  let assemblyFormat = [{
    $query `,` $key `,` $value `,` $grad (`mask` $mask^)? attr-dict `:` functional-type(operands, results)
  }];
}

def Carve_AttentionStatsOp : Carve_Op<"attention_stats"> {
  let summary = "Attention that also keeps each query row's log-sum-exp.";
  let description = [{
    `carve.attention`, and `lse`: each query row's `log(sum_j exp(s_ij))` of the
    scaled, masked scores (`-inf` for a row with no visible key), shaped like the
    result without its last dimension. carve-save-attention-stats writes it in
    place of an attention whose gradient `carve.attention_grad_stats` then reads
    the result and `lse` instead of running the forward again (CUDA target).

    ```mlir
    %o, %lse = carve.attention_stats %q, %k, %v {causal = true, scale = 0.25 : f32}
           : (tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>)
             -> (tensor<4x2x16x16xf32>, tensor<4x2x16xf32>)
    ```
  }];
  let arguments = (ins Carve_Tensor:$query, Carve_Tensor:$key, Carve_Tensor:$value,
                       Optional<Carve_Tensor>:$mask, F32Attr:$scale,
                       DefaultValuedAttr<BoolAttr, "false">:$causal);
  let results = (outs Carve_Tensor:$result, Carve_Tensor:$lse);
  let assemblyFormat = [{
    $query `,` $key `,` $value (`mask` $mask^)? attr-dict `:` functional-type(operands, results)
  }];
}

def Carve_AttentionGradStatsOp : Carve_Op<"attention_grad_stats"> {
  let summary = "Gradients of attention from its saved result and row statistics.";
  let description = [{
    `carve.attention_grad` given the forward's `output` and row log-sum-exp
    `lse` (`carve.attention_stats`): the probabilities come from `lse`, and
    `D_i = dY_i . O_i` from `output`, so the forward is not run again.

    ```mlir
    %dq, %dk, %dv = carve.attention_grad_stats %q, %k, %v, %o, %lse, %dy {causal = true, scale = 2.500000e-01 : f32}
           : (tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>,
              tensor<4x2x16xf32>, tensor<4x2x16x16xf32>)
             -> (tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>)
    ```
  }];
  let arguments = (ins Carve_Tensor:$query, Carve_Tensor:$key, Carve_Tensor:$value,
                       Carve_Tensor:$output, Carve_Tensor:$lse, Carve_Tensor:$grad,
                       Optional<Carve_Tensor>:$mask, F32Attr:$scale,
                       DefaultValuedAttr<BoolAttr, "false">:$causal);
  let results = (outs Carve_Tensor:$query_grad, Carve_Tensor:$key_grad,
                      Carve_Tensor:$value_grad);
  let assemblyFormat = [{
    $query `,` $key `,` $value `,` $output `,` $lse `,` $grad (`mask` $mask^)? attr-dict `:` functional-type(operands, results)
  }];
}

def Carve_CrossEntropyGradOp : Carve_Op<"cross_entropy_grad"> {
  let summary = "Gradient of cross_entropy with respect to the logits.";
  let description = [{
    `(softmax(logits) - onehot(targets)) * dy`, scaled by `1 / count` for the
    mean reduction; ignored elements get 0.

    ```mlir
    %dl = carve.cross_entropy_grad %logits, %targets, %dy {ignore_index = -100 : i64, reduction = "mean"}
           : (tensor<64x64xf32>, tensor<64xi64>, tensor<f32>) -> tensor<64x64xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$logits, Carve_Tensor:$targets, Carve_Tensor:$grad,
                       DefaultValuedStrAttr<StrAttr, "mean">:$reduction,
                       OptionalAttr<I64Attr>:$ignore_index);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$logits `,` $targets `,` $grad attr-dict `:` functional-type(operands, results)";
}

def Carve_GatherGradOp : Carve_Op<"gather_grad", [Carve_Differentiable]> {
  let summary = "Gradient of gather: scatter-add into a zero table.";
  let description = [{
    The result (shaped like the gathered table) is zero except where `indices`
    picked slices, which receive the sum of their `grad` slices. Also the
    import of ScatterElements (index_add_), so its gradient with respect to
    `grad` is the gather by the same indices.

    ```mlir
    %dwte = carve.gather_grad %dy, %ids {axis = 0 : i64} : (tensor<4x16x32xf32>, tensor<4x16xi64>) -> tensor<64x32xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$grad, Carve_Tensor:$indices, I64Attr:$axis);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$grad `,` $indices attr-dict `:` functional-type(operands, results)";
}

def Carve_SliceGradOp : Carve_Op<"slice_grad"> {
  let summary = "Gradient of slice: the slice's gradient placed in zeros.";
  let description = [{
    The result (shaped like the sliced input) is zero outside
    `[starts : ends : steps]` and `grad` inside it.

    ```mlir
    %dx = carve.slice_grad %dq {starts = array<i64: 0, 0, 0>, ends = array<i64: 4, 16, 32>,
                               steps = array<i64: 1, 1, 1>} : tensor<4x16x32xf32> -> tensor<4x16x96xf32>
    ```
  }];
  let arguments = (ins Carve_Tensor:$grad, DenseI64ArrayAttr:$starts,
                       DenseI64ArrayAttr:$ends, DenseI64ArrayAttr:$steps);
  let results = (outs Carve_Tensor:$result);
  let assemblyFormat = "$grad attr-dict `:` type($grad) `->` type($result)";
}

//===----------------------------------------------------------------------===//
// User-defined ops
//
// Ops of a custom ONNX domain that a rules file (`carve compile --rules`,
// docs/custom-ops.md) describes: the user's C++ kernels compute them, the
// rules give their annotation and result shapes.
//===----------------------------------------------------------------------===//

def Carve_CustomOp : Carve_Op<"custom", [Carve_Differentiable]> {
  let summary = "An op computed by the user's `extern \"C\"` kernel.";
  let description = [{
    A node `domain::op_type` of the ONNX model that the rules file describes.
    `forward` names the kernel that computes the results from the inputs,
    `backward` (empty: the op has no gradient) the one that computes the
    inputs' gradients (`carve.custom_grad`). Both see the local (per-rank)
    shapes, so a kernel written for any shape computes its piece of a split
    that `annotation` allows. `backward_annotation` is the gradient op's,
    derived from `annotation` when the rules file is read. `cuda_forward` and
    `cuda_backward` name the CUDA target's kernels (empty: the rules file gives
    none, and `--target cuda` refuses the op).

    ```mlir
    %y = carve.custom %a, %b {annotation = "a b c, a b c -> a b c",
                              backward = "swiglu_backward",
                              backward_annotation = "a b c, a b c, a b c -> a b c, a b c",
                              domain = "carve.example", forward = "swiglu_forward",
                              op_type = "SwiGLU"}
           : (tensor<4x16x64xf32>, tensor<4x16x64xf32>) -> tensor<4x16x64xf32>
    ```
  }];
  let arguments = (ins Variadic<Carve_Tensor>:$inputs, StrAttr:$domain, StrAttr:$op_type,
                       StrAttr:$annotation, StrAttr:$backward_annotation, StrAttr:$forward,
                       DefaultValuedStrAttr<StrAttr, "">:$backward,
                       DefaultValuedStrAttr<StrAttr, "">:$cuda_forward,
                       DefaultValuedStrAttr<StrAttr, "">:$cuda_backward);
  let results = (outs Variadic<Carve_Tensor>:$outputs);
  let assemblyFormat = "$inputs attr-dict `:` functional-type($inputs, $outputs)";
}

def Carve_CustomGradOp : Carve_Op<"custom_grad"> {
  let summary = "Gradients of a custom op's inputs, from the user's backward kernel.";
  let description = [{
    Operands: the forward op's inputs, then the gradients of its results (a
    zero constant where none flows). Results: one gradient per forward input,
    each of that input's type. `annotation` is the forward op's
    `backward_annotation`; `cuda_backward` the forward op's CUDA backward
    kernel (empty when it has none).

    ```mlir
    %da, %db = carve.custom_grad %a, %b, %dy {annotation = "a b c, a b c, a b c -> a b c, a b c",
                                              backward = "swiglu_backward",
                                              domain = "carve.example", op_type = "SwiGLU"}
           : (tensor<4x16x64xf32>, tensor<4x16x64xf32>, tensor<4x16x64xf32>)
             -> (tensor<4x16x64xf32>, tensor<4x16x64xf32>)
    ```
  }];
  let arguments = (ins Variadic<Carve_Tensor>:$inputs, StrAttr:$domain, StrAttr:$op_type,
                       StrAttr:$annotation, StrAttr:$backward,
                       DefaultValuedStrAttr<StrAttr, "">:$cuda_backward);
  let results = (outs Variadic<Carve_Tensor>:$input_grads);
  let assemblyFormat = "$inputs attr-dict `:` functional-type($inputs, $input_grads)";
}

include "dialects/carve/CarveOptimizerOps.td"

#endif // CARVE_OPS_TD
