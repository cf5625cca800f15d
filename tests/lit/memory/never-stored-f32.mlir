// Tests the f32 values a bf16 CUDA program never stores (neverStoredF32, the
// rule carve-plan-memory gives memory by): a transpose that writes q, k or v
// rounded with its 16-bit copy, read by cuDNN's attention forward as that
// copy (carve.read16), and a fused chain's rounded output (GELU's) that a
// matmul reads as the copy the chain writes (carve.copy_in_fused): their
// kernels write the copies alone, and the f32 values get no memory (no
// carve.arena_offset). Under fp32 they are stored. (The QKV projection is
// summed into the loss too, so that cuDNN cannot read q, k and v in place
// there: carve-fold-views' "strided", tested in fusion/.)
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=1 target=cuda precision=bf16" --carve-round-activations --carve-concat-slice-grads --carve-fuse-elementwise --carve-fold-transposes --carve-save-attention-stats --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=1 target=cuda" --carve-fuse-elementwise --carve-fold-transposes --carve-save-attention-stats --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s --check-prefix=F32

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[Q:.+]] = carve.transpose %{{.+}} {carve.kernel = "transpose16_view", carve.round16, perm
// CHECK-NEXT: %[[Q16:.+]] = carve.cast %[[Q]] {carve.arena_offset = array<i64: {{[0-9]+}}>, carve.copy_by_writer
// CHECK: %[[K:.+]] = carve.transpose %{{.+}} {carve.kernel = "transpose16_view", carve.round16, perm
// CHECK: %[[V:.+]] = carve.transpose %{{.+}} {carve.kernel = "transpose16_view", carve.round16, perm
// CHECK: carve.attention_stats %[[Q]], %[[K]], %[[V]] {{{.*}}carve.kernel = "attention_stats_cudnn", carve.read16 = array<i1: true, true, true>
// CHECK: %[[G:.+]] = carve.gelu %{{.+}} {carve.fusion_group = {{[0-9]+}} : i64, carve.kernel = "fused", carve.read16 = array<i1: true>, carve.round16}
// CHECK-NEXT: carve.cast %[[G]] {carve.arena_offset = array<i64: {{[0-9]+}}>, carve.copy_in_fused
// CHECK: carve.matmul %[[G]], %{{.+}} {carve.arena_offset = array<i64: {{[0-9]+}}>, carve.kernel = "matmul16", carve.read16 = array<i1: true, true>}
// CHECK: return

// F32-LABEL: func.func @train_step(
// F32: carve.transpose %{{.+}} {carve.arena_offset = array<i64: {{[0-9]+}}>, carve.kernel = "transpose_view", perm
// F32: carve.gelu %{{.+}} {carve.arena_offset = array<i64: {{[0-9]+}}>, carve.fusion_group
// F32: return

func.func @forward(%x: tensor<2x16x64xf32> {carve.input = "x"},
                   %w1: tensor<64x192xf32> {carve.param = "attn.weight", carve.trainable},
                   %b1: tensor<256xf32> {carve.param = "fc.bias", carve.trainable},
                   %w2: tensor<64x256xf32> {carve.param = "fc.weight", carve.trainable},
                   %w3: tensor<256x64xf32> {carve.param = "proj.weight", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %qkv = carve.matmul %x, %w1 : (tensor<2x16x64xf32>, tensor<64x192xf32>) -> tensor<2x16x192xf32> loc("/attn/MatMul")
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
