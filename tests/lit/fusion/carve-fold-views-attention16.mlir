// Tests carve-fold-views on cuDNN attention's 16-bit inputs and outputs (CUDA
// target, bf16). The forward's output O, read by its transpose to
// [b, t, h, d] (whose 16-bit copy the projection's matmul reads) and by the
// attention gradient, has that transpose marked carve.fold = "producer":
// neither O nor the transpose gets memory (-1, no carve.arena_offset), and the
// copy is carve.copy_by_writer (attention_stats_cudnn writes O into it, the
// gradient reads o there). The output gradient dy, read only by the
// gradient (which rounds it to 16 bits) through its transpose to heads
// ("consumer"), gets a 16-bit copy right after the matmul that computes it
// (carve-round-operands16), which the matmul writes instead of an f32 dy
// (matmul16_to16, carve.write16; no f32 memory).
// And "assemble": the QKV
// projection's gradient, a concat of cuDNN's dq, dk and dv transposed back to
// [b, t, h, d], whose 16-bit copy its readers read (the data- and
// weight-gradient matmuls, and the bias gradient's sum through rule 3g), is
// marked carve.fold = "assemble" and carve.round16: cuDNN writes the pieces
// into the copy in 16 bits. carve-plan-memory gives neither the concat nor
// the transposes memory (no carve.arena_offset) and the copy memory of its
// own; carve-select-kernels makes the concat no call and its copy
// carve.copy_by_writer, and the sum is done by the weight gradient's GEMM
// as it reads the copy (rule 3i: matmul16_to16_bgrad, the sum no call).
// The second case's concat has no 16-bit copy (its one matmul reader rounds
// it itself) and is not marked; under fp32 nothing is.
// RUN: carve-opt %s --split-input-file --carve-autodiff --carve-set-plan="dp=1 target=cuda precision=bf16" --carve-round-activations --carve-concat-slice-grads --carve-fuse-elementwise --carve-fold-transposes --carve-save-attention-stats --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s
// RUN: carve-opt %s --split-input-file --carve-autodiff --carve-set-plan="dp=1 target=cuda" --carve-concat-slice-grads --carve-fuse-elementwise --carve-fold-transposes --carve-save-attention-stats --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s --check-prefix=F32

// CHECK-LABEL: func.func @train_step(
// CHECK: %result, %lse = carve.attention_stats {{.*}}{carve.arena_offset = array<i64: -1, {{[0-9]+}}>, carve.kernel = "attention_stats_cudnn"
// CHECK-NEXT: %[[OT:.+]] = carve.transpose %result {carve.fold = "producer", carve.kernel = "none", carve.round16, perm = array<i64: 0, 2, 1, 3>}
// CHECK-NEXT: carve.cast %[[OT]] {carve.arena_offset = array<i64: {{[0-9]+}}>, carve.copy_by_writer, carve.kernel = "none"} : tensor<2x16x4x16xf32> -> tensor<2x16x4x16xbf16>
// CHECK-NEXT: %[[OR:.+]] = carve.reshape %[[OT]]
// CHECK: carve.matmul %[[OR]], %{{.+}} {carve.kernel = "matmul16_bias", carve.read16 = array<i1: true, true>}
// CHECK: %[[DY:.+]] = carve.matmul %{{.+}}, %{{.+}} {carve.kernel = "matmul16_to16", carve.read16 = array<i1: true, true>, carve.write16} : (tensor<2x16x256xf32>, tensor<256x64xf32>) -> tensor<2x16x64xf32>
// CHECK-NEXT: carve.cast %[[DY]] {carve.arena_offset = array<i64: {{[0-9]+}}>, carve.kernel = "none"} : tensor<2x16x64xf32> -> tensor<2x16x64xbf16>
// CHECK: %[[DYR:.+]] = carve.reshape %[[DY]]
// CHECK-NEXT: %[[DYT:.+]] = carve.transpose %[[DYR]] {carve.fold = "consumer", carve.kernel = "none"
// CHECK: %query_grad, %key_grad, %value_grad = carve.attention_grad_stats %{{.+}}, %{{.+}}, %{{.+}}, %result, %lse, %[[DYT]] {carve.kernel = "attention_grad_stats_cudnn"
// CHECK-NEXT: %[[TV:.+]] = carve.transpose %value_grad {carve.fold = "producer", carve.kernel = "none"
// CHECK-NEXT: %[[TK:.+]] = carve.transpose %key_grad {carve.fold = "producer", carve.kernel = "none"
// CHECK-NEXT: %[[TQ:.+]] = carve.transpose %query_grad {carve.fold = "producer", carve.kernel = "none"
// CHECK-NEXT: %[[RV:.+]] = carve.reshape %[[TV]]
// CHECK-NEXT: %[[RK:.+]] = carve.reshape %[[TK]]
// CHECK-NEXT: %[[RQ:.+]] = carve.reshape %[[TQ]]
// CHECK-NEXT: %[[C:.+]] = carve.concat %[[RQ]], %[[RK]], %[[RV]] {axis = 2 : i64, carve.fold = "assemble", carve.kernel = "none", carve.round16}
// CHECK-NEXT: carve.cast %[[C]] {carve.arena_offset = array<i64: {{[0-9]+}}>, carve.copy_by_writer, carve.kernel = "none"} : tensor<2x16x192xf32> -> tensor<2x16x192xbf16>
// CHECK-NEXT: carve.reduce_sum %[[C]] {axes = array<i64: 0, 1>, carve.bias_grad_in_gemm, carve.kernel = "none"}
// CHECK: carve.matmul %[[C]], %{{.+}} {carve.arena_offset = array<i64: {{[0-9]+}}>, carve.kernel = "matmul16", carve.read16 = array<i1: true, true>}
// CHECK: %[[CR:.+]] = carve.reshape %[[C]] {carve.kernel = "none"} : tensor<2x16x192xf32> -> tensor<32x192xf32>
// CHECK: carve.matmul %{{.+}}, %[[CR]] {carve.bias_grad_of = 1 : i64, carve.kernel = "matmul16_to16_bgrad", carve.read16 = array<i1: true, true>, carve.write16}
// CHECK: return

// CHECK-LABEL: func.func @train_step(
// CHECK: carve.concat {{.*}}{axis = 2 : i64, carve.arena_offset = array<i64: {{[0-9]+}}>, carve.kernel = "concat"}
// CHECK: return

// F32-NOT: assemble
// F32-NOT: producer
// F32-NOT: reduce16

func.func @forward(%x: tensor<2x16x64xf32> {carve.input = "x"},
                   %w1: tensor<64x192xf32> {carve.param = "attn.weight", carve.trainable},
                   %b0: tensor<192xf32> {carve.param = "attn.bias", carve.trainable},
                   %b1: tensor<256xf32> {carve.param = "fc.bias", carve.trainable},
                   %w2: tensor<64x256xf32> {carve.param = "fc.weight", carve.trainable},
                   %w3: tensor<256x64xf32> {carve.param = "proj.weight", carve.trainable},
                   %w0: tensor<64x64xf32> {carve.param = "in.weight", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %x1 = carve.matmul %x, %w0 : (tensor<2x16x64xf32>, tensor<64x64xf32>) -> tensor<2x16x64xf32> loc("/in/MatMul")
  %qkv0 = carve.matmul %x1, %w1 : (tensor<2x16x64xf32>, tensor<64x192xf32>) -> tensor<2x16x192xf32> loc("/attn/MatMul")
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
