// Tests carve-fold-views' "strided" rule (CUDA target, bf16): q, k and v of
// cuDNN's attention forward are column slices of one tensor, the QKV
// projection, each reshaped to heads and transposed to [b, h, t, d].
// carve-round-operands16 rounds that tensor as written (carve.round16) and
// makes its 16-bit copy right after its writer; carve-fold-views marks the
// three transposes and their copies carve.fold = "strided": cuDNN's forward
// and gradient read q, k and v in place in the rows of the tensor's copy.
// Neither the transposes, their copies nor the f32 tensor get memory (no
// carve.arena_offset); the copy does, written by the tensor's writer: the
// bias add is marked carve.fold = "epilogue" and its matmul adds the bias as
// it writes the copy (matmul16_bias, cuBLASLt's bias epilogue; the bias's f32
// view is no call: the matmul reads the 16-bit parameter), the add and the
// product get no memory; after a matmul with no bias, matmul16_to16 writes
// the copy (carve.write16). The MLP's bias add, which headed the GELU's fused
// chain, is taken out of the chain by carve-round-operands16 and marked
// "epilogue" too: its matmul writes the add's 16-bit copy, which the chain
// (GELU alone) reads (carve.read16). The third case's tensor is
// also read by a sum in f32: nothing is marked, and the transposes copy
// (transpose16_view). Under fp32 nothing is marked.
// RUN: carve-opt %s --split-input-file --carve-autodiff --carve-set-plan="dp=1 target=cuda precision=bf16" --carve-round-activations --carve-concat-slice-grads --carve-fuse-elementwise --carve-fold-transposes --carve-save-attention-stats --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s
// RUN: carve-opt %s --split-input-file --carve-autodiff --carve-set-plan="dp=1 target=cuda" --carve-concat-slice-grads --carve-fuse-elementwise --carve-fold-transposes --carve-save-attention-stats --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s --check-prefix=F32

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[MM:.+]] = carve.matmul %{{.+}}, %{{.+}} {carve.kernel = "matmul16_bias", carve.read16 = array<i1: false, true>} : (tensor<2x16x64xf32>, tensor<64x192xf32>) -> tensor<2x16x192xf32>
// CHECK-NEXT: %[[B:.+]] = carve.cast %{{.+}} {carve.kernel = "none"} : tensor<192xbf16> -> tensor<192xf32>
// CHECK-NEXT: %[[QKV:.+]] = carve.add %[[B]], %[[MM]] {carve.fold = "epilogue", carve.kernel = "none", carve.round16} : (tensor<192xf32>, tensor<2x16x192xf32>) -> tensor<2x16x192xf32>
// CHECK-NEXT: %[[QKV16:.+]] = carve.cast %[[QKV]] {carve.arena_offset = array<i64: {{[0-9]+}}>, carve.copy_by_writer, carve.kernel = "none"} : tensor<2x16x192xf32> -> tensor<2x16x192xbf16>
// CHECK: carve.transpose %{{.+}} {carve.fold = "strided", carve.kernel = "none", carve.round16, perm = array<i64: 0, 2, 1, 3>}
// CHECK-NEXT: carve.cast %{{.+}} {carve.fold = "strided", carve.kernel = "none"} : tensor<2x4x16x16xf32> -> tensor<2x4x16x16xbf16>
// CHECK: carve.transpose %{{.+}} {carve.fold = "strided", carve.kernel = "none", carve.round16, perm = array<i64: 0, 2, 1, 3>}
// CHECK-NEXT: carve.cast %{{.+}} {carve.fold = "strided", carve.kernel = "none"} : tensor<2x4x16x16xf32> -> tensor<2x4x16x16xbf16>
// CHECK: carve.transpose %{{.+}} {carve.fold = "strided", carve.kernel = "none", carve.round16, perm = array<i64: 0, 2, 1, 3>}
// CHECK-NEXT: carve.cast %{{.+}} {carve.fold = "strided", carve.kernel = "none"} : tensor<2x4x16x16xf32> -> tensor<2x4x16x16xbf16>
// CHECK-NEXT: %result, %lse = carve.attention_stats {{.*}}carve.kernel = "attention_stats_cudnn", carve.read16 = array<i1: true, true, true>
// CHECK: %[[FC:.+]] = carve.matmul %{{.+}}, %{{.+}} {carve.kernel = "matmul16_bias", carve.read16 = array<i1: true, true>} : (tensor<2x16x64xf32>, tensor<64x256xf32>) -> tensor<2x16x256xf32>
// CHECK: %[[H:.+]] = carve.add %{{.+}}, %[[FC]] {carve.fold = "epilogue", carve.kernel = "none", carve.round16}
// CHECK-NEXT: carve.cast %[[H]] {carve.arena_offset = array<i64: {{[0-9]+}}>, carve.copy_by_writer, carve.kernel = "none"} : tensor<2x16x256xf32> -> tensor<2x16x256xbf16>
// CHECK: carve.gelu %[[H]] {carve.fusion_group = {{[0-9]+}} : i64, carve.kernel = "fused", carve.read16 = array<i1: true>, carve.round16}
// CHECK: carve.attention_grad_stats {{.*}}carve.kernel = "attention_grad_stats_cudnn", carve.read16 = array<i1: true, true, true>
// CHECK: return

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[M:.+]] = carve.matmul %{{.+}}, %{{.+}} {carve.kernel = "matmul16_to16", carve.read16 = array<i1: false, true>, carve.round16, carve.write16} : (tensor<2x16x64xf32>, tensor<64x192xf32>) -> tensor<2x16x192xf32>
// CHECK-NEXT: carve.cast %[[M]] {carve.arena_offset = array<i64: {{[0-9]+}}>, carve.kernel = "none"} : tensor<2x16x192xf32> -> tensor<2x16x192xbf16>
// CHECK-COUNT-3: carve.fold = "strided", carve.kernel = "none", carve.round16
// CHECK: return

// CHECK-LABEL: func.func @train_step(
// CHECK-NOT: strided
// CHECK: carve.transpose {{.*}}carve.kernel = "transpose16_view"
// CHECK-NOT: strided
// CHECK: return

// F32-NOT: strided
// F32-NOT: epilogue

func.func @forward(%x: tensor<2x16x64xf32> {carve.input = "x"},
                   %w1: tensor<64x192xf32> {carve.param = "attn.weight", carve.trainable},
                   %b0: tensor<192xf32> {carve.param = "attn.bias", carve.trainable},
                   %b1: tensor<256xf32> {carve.param = "fc.bias", carve.trainable},
                   %w2: tensor<64x256xf32> {carve.param = "fc.weight", carve.trainable},
                   %w3: tensor<256x64xf32> {carve.param = "proj.weight", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %qkv0 = carve.matmul %x, %w1 : (tensor<2x16x64xf32>, tensor<64x192xf32>) -> tensor<2x16x192xf32> loc("/attn/MatMul")
  %qkv = carve.add %b0, %qkv0 : (tensor<192xf32>, tensor<2x16x192xf32>) -> tensor<2x16x192xf32> loc("/attn/Add")
  %s0 = carve.slice %qkv {ends = array<i64: 2, 16, 64>, starts = array<i64: 0, 0, 0>, steps = array<i64: 1, 1, 1>} : tensor<2x16x192xf32> -> tensor<2x16x64xf32>
  %s1 = carve.slice %qkv {ends = array<i64: 2, 16, 128>, starts = array<i64: 0, 0, 64>, steps = array<i64: 1, 1, 1>} : tensor<2x16x192xf32> -> tensor<2x16x64xf32>
  %s2 = carve.slice %qkv {ends = array<i64: 2, 16, 192>, starts = array<i64: 0, 0, 128>, steps = array<i64: 1, 1, 1>} : tensor<2x16x192xf32> -> tensor<2x16x64xf32>
  %r0 = carve.reshape %s0 : tensor<2x16x64xf32> -> tensor<2x16x4x16xf32>
  %r1 = carve.reshape %s1 : tensor<2x16x64xf32> -> tensor<2x16x4x16xf32>
  %r2 = carve.reshape %s2 : tensor<2x16x64xf32> -> tensor<2x16x4x16xf32>
  %q = carve.transpose %r0 {perm = array<i64: 0, 2, 1, 3>} : tensor<2x16x4x16xf32> -> tensor<2x4x16x16xf32> loc("/attn/q")
  %k = carve.transpose %r1 {perm = array<i64: 0, 2, 1, 3>} : tensor<2x16x4x16xf32> -> tensor<2x4x16x16xf32> loc("/attn/k")
  %v = carve.transpose %r2 {perm = array<i64: 0, 2, 1, 3>} : tensor<2x16x4x16xf32> -> tensor<2x4x16x16xf32> loc("/attn/v")
  %o = carve.attention %q, %k, %v {causal = true, scale = 2.500000e-01 : f32} : (tensor<2x4x16x16xf32>, tensor<2x4x16x16xf32>, tensor<2x4x16x16xf32>) -> tensor<2x4x16x16xf32> loc("/attn/sdpa")
  %ot = carve.transpose %o {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x16x16xf32> -> tensor<2x16x4x16xf32>
  %y = carve.reshape %ot : tensor<2x16x4x16xf32> -> tensor<2x16x64xf32>
  %h = carve.matmul %y, %w2 : (tensor<2x16x64xf32>, tensor<64x256xf32>) -> tensor<2x16x256xf32> loc("/fc/MatMul")
  %hb = carve.add %b1, %h : (tensor<256xf32>, tensor<2x16x256xf32>) -> tensor<2x16x256xf32> loc("/fc/Add")
  %g = carve.gelu %hb : tensor<2x16x256xf32> loc("/act/Gelu")
  %p = carve.matmul %g, %w3 : (tensor<2x16x256xf32>, tensor<256x64xf32>) -> tensor<2x16x64xf32> loc("/proj/MatMul")
  %l = carve.reduce_sum %p {axes = array<i64: 0, 1, 2>, keep_dims = false} : tensor<2x16x64xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
// -----
func.func @forward(%x: tensor<2x16x64xf32> {carve.input = "x"},
                   %w1: tensor<64x192xf32> {carve.param = "attn.weight", carve.trainable},
                   %b1: tensor<256xf32> {carve.param = "fc.bias", carve.trainable},
                   %w2: tensor<64x256xf32> {carve.param = "fc.weight", carve.trainable},
                   %w3: tensor<256x64xf32> {carve.param = "proj.weight", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %qkv0 = carve.matmul %x, %w1 : (tensor<2x16x64xf32>, tensor<64x192xf32>) -> tensor<2x16x192xf32> loc("/attn/MatMul")
  %s0 = carve.slice %qkv0 {ends = array<i64: 2, 16, 64>, starts = array<i64: 0, 0, 0>, steps = array<i64: 1, 1, 1>} : tensor<2x16x192xf32> -> tensor<2x16x64xf32>
  %s1 = carve.slice %qkv0 {ends = array<i64: 2, 16, 128>, starts = array<i64: 0, 0, 64>, steps = array<i64: 1, 1, 1>} : tensor<2x16x192xf32> -> tensor<2x16x64xf32>
  %s2 = carve.slice %qkv0 {ends = array<i64: 2, 16, 192>, starts = array<i64: 0, 0, 128>, steps = array<i64: 1, 1, 1>} : tensor<2x16x192xf32> -> tensor<2x16x64xf32>
  %r0 = carve.reshape %s0 : tensor<2x16x64xf32> -> tensor<2x16x4x16xf32>
  %r1 = carve.reshape %s1 : tensor<2x16x64xf32> -> tensor<2x16x4x16xf32>
  %r2 = carve.reshape %s2 : tensor<2x16x64xf32> -> tensor<2x16x4x16xf32>
  %q = carve.transpose %r0 {perm = array<i64: 0, 2, 1, 3>} : tensor<2x16x4x16xf32> -> tensor<2x4x16x16xf32> loc("/attn/q")
  %k = carve.transpose %r1 {perm = array<i64: 0, 2, 1, 3>} : tensor<2x16x4x16xf32> -> tensor<2x4x16x16xf32> loc("/attn/k")
  %v = carve.transpose %r2 {perm = array<i64: 0, 2, 1, 3>} : tensor<2x16x4x16xf32> -> tensor<2x4x16x16xf32> loc("/attn/v")
  %o = carve.attention %q, %k, %v {causal = true, scale = 2.500000e-01 : f32} : (tensor<2x4x16x16xf32>, tensor<2x4x16x16xf32>, tensor<2x4x16x16xf32>) -> tensor<2x4x16x16xf32> loc("/attn/sdpa")
  %ot = carve.transpose %o {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x16x16xf32> -> tensor<2x16x4x16xf32>
  %y = carve.reshape %ot : tensor<2x16x4x16xf32> -> tensor<2x16x64xf32>
  %h = carve.matmul %y, %w2 : (tensor<2x16x64xf32>, tensor<64x256xf32>) -> tensor<2x16x256xf32> loc("/fc/MatMul")
  %hb = carve.add %b1, %h : (tensor<256xf32>, tensor<2x16x256xf32>) -> tensor<2x16x256xf32> loc("/fc/Add")
  %g = carve.gelu %hb : tensor<2x16x256xf32> loc("/act/Gelu")
  %p = carve.matmul %g, %w3 : (tensor<2x16x256xf32>, tensor<256x64xf32>) -> tensor<2x16x64xf32> loc("/proj/MatMul")
  %l = carve.reduce_sum %p {axes = array<i64: 0, 1, 2>, keep_dims = false} : tensor<2x16x64xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
// -----
func.func @forward(%x: tensor<2x16x64xf32> {carve.input = "x"},
                   %w1: tensor<64x192xf32> {carve.param = "attn.weight", carve.trainable},
                   %b0: tensor<192xf32> {carve.param = "attn.bias", carve.trainable},
                   %b1: tensor<256xf32> {carve.param = "fc.bias", carve.trainable},
                   %w2: tensor<64x256xf32> {carve.param = "fc.weight", carve.trainable},
                   %w3: tensor<256x64xf32> {carve.param = "proj.weight", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %qkv0 = carve.matmul %x, %w1 : (tensor<2x16x64xf32>, tensor<64x192xf32>) -> tensor<2x16x192xf32> loc("/attn/MatMul")
  %qkv = carve.add %b0, %qkv0 : (tensor<192xf32>, tensor<2x16x192xf32>) -> tensor<2x16x192xf32> loc("/attn/Add")
  %s0 = carve.slice %qkv {ends = array<i64: 2, 16, 64>, starts = array<i64: 0, 0, 0>, steps = array<i64: 1, 1, 1>} : tensor<2x16x192xf32> -> tensor<2x16x64xf32>
  %s1 = carve.slice %qkv {ends = array<i64: 2, 16, 128>, starts = array<i64: 0, 0, 64>, steps = array<i64: 1, 1, 1>} : tensor<2x16x192xf32> -> tensor<2x16x64xf32>
  %s2 = carve.slice %qkv {ends = array<i64: 2, 16, 192>, starts = array<i64: 0, 0, 128>, steps = array<i64: 1, 1, 1>} : tensor<2x16x192xf32> -> tensor<2x16x64xf32>
  %r0 = carve.reshape %s0 : tensor<2x16x64xf32> -> tensor<2x16x4x16xf32>
  %r1 = carve.reshape %s1 : tensor<2x16x64xf32> -> tensor<2x16x4x16xf32>
  %r2 = carve.reshape %s2 : tensor<2x16x64xf32> -> tensor<2x16x4x16xf32>
  %q = carve.transpose %r0 {perm = array<i64: 0, 2, 1, 3>} : tensor<2x16x4x16xf32> -> tensor<2x4x16x16xf32> loc("/attn/q")
  %k = carve.transpose %r1 {perm = array<i64: 0, 2, 1, 3>} : tensor<2x16x4x16xf32> -> tensor<2x4x16x16xf32> loc("/attn/k")
  %v = carve.transpose %r2 {perm = array<i64: 0, 2, 1, 3>} : tensor<2x16x4x16xf32> -> tensor<2x4x16x16xf32> loc("/attn/v")
  %o = carve.attention %q, %k, %v {causal = true, scale = 2.500000e-01 : f32} : (tensor<2x4x16x16xf32>, tensor<2x4x16x16xf32>, tensor<2x4x16x16xf32>) -> tensor<2x4x16x16xf32> loc("/attn/sdpa")
  %ot = carve.transpose %o {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x16x16xf32> -> tensor<2x16x4x16xf32>
  %y = carve.reshape %ot : tensor<2x16x4x16xf32> -> tensor<2x16x64xf32>
  %h = carve.matmul %y, %w2 : (tensor<2x16x64xf32>, tensor<64x256xf32>) -> tensor<2x16x256xf32> loc("/fc/MatMul")
  %hb = carve.add %b1, %h : (tensor<256xf32>, tensor<2x16x256xf32>) -> tensor<2x16x256xf32> loc("/fc/Add")
  %g = carve.gelu %hb : tensor<2x16x256xf32> loc("/act/Gelu")
  %p = carve.matmul %g, %w3 : (tensor<2x16x256xf32>, tensor<256x64xf32>) -> tensor<2x16x64xf32> loc("/proj/MatMul")
  %l0 = carve.reduce_sum %p {axes = array<i64: 0, 1, 2>, keep_dims = false} : tensor<2x16x64xf32> -> tensor<f32> loc("/loss")
  %l1 = carve.reduce_sum %qkv {axes = array<i64: 0, 1, 2>, keep_dims = false} : tensor<2x16x192xf32> -> tensor<f32> loc("/loss2")
  %l = carve.add %l0, %l1 : (tensor<f32>, tensor<f32>) -> tensor<f32>
  return %l : tensor<f32>
}
