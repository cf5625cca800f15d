// Tests carve-select-kernels' rule 3e and 16-bit cross-entropy (CUDA target,
// bf16) on a training step: the classifier's matmul writes its logits' 16-bit
// copy itself (matmul16_to16, carve.write16; the copy is no call), the loss
// and its gradient read that copy (carve.read16; the gradient's f32 view of
// it is no call) in one call (rule 3j: cross_entropy_with_grad, the loss's
// own call marked carve.loss_in_grad, run only when evaluating), the gradient
// writes its own 16-bit copy (the one carve-round-operands16 made for the two
// matmuls that read it), which both matmuls read, and each weight-gradient
// matmul writes the 16-bit gradient carve-store-grads16 casts it to. The
// 16-bit copies a writer writes live from it (carve-plan-memory): the copy's
// buffer does not overlap the writer's inputs.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16 target=cuda" --carve-round-activations --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-plan-memory --carve-select-kernels | FileCheck %s
// fp32 on the CUDA target: the loss computed with its gradient too
// (cross_entropy_with_grad reading and writing f32); and the printed calls.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="target=cuda" --carve-fold-transposes --carve-data-parallel --carve-plan-memory --carve-select-kernels | FileCheck %s --check-prefix=F32
// RUN: carve-opt %s --mlir-print-debuginfo --carve-autodiff --carve-set-plan="precision=bf16 target=cuda" --carve-round-activations --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-plan-memory --carve-optimizer --carve-select-kernels | carve-translate --carve-to-cpp | FileCheck %s --check-prefix=CPP
// On the CPU target none of it.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16" --carve-round-activations --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-plan-memory --carve-select-kernels | FileCheck %s --check-prefix=CPU

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[L:.+]] = carve.matmul {{.*}}carve.kernel = "matmul16_to16", carve.read16 = array<i1: false, true>, carve.round16, carve.write16}
// CHECK-NEXT: %[[L16:.+]] = carve.cast %[[L]] {{{.*}}carve.kernel = "none"} : tensor<8x10xf32> -> tensor<8x10xbf16>
// CHECK-NEXT: carve.cross_entropy %[[L]], %arg1 {{{.*}}carve.kernel = "cross_entropy16", carve.loss_in_grad, carve.read16 = array<i1: true>
// CHECK-NEXT: %[[LV:.+]] = carve.cast %[[L16]] {{{.*}}carve.kernel = "none"} : tensor<8x10xbf16> -> tensor<8x10xf32>
// CHECK-NEXT: %[[G:.+]] = carve.cross_entropy_grad %[[LV]], {{.*}}carve.kernel = "cross_entropy_with_grad", carve.read16 = array<i1: true>, carve.write16
// CHECK-NEXT: carve.cast %[[G]] {{{.*}}carve.kernel = "none"} : tensor<8x10xf32> -> tensor<8x10xbf16>
// CHECK: carve.matmul %[[G]], {{.*}}carve.kernel = "matmul16", carve.read16 = array<i1: true, true>}
// CHECK: %[[DW:.+]] = carve.matmul {{.*}}, %[[G]] {{.*}}carve.kernel = "matmul16_to16", carve.read16 = array<i1: false, true>, carve.write16}
// CHECK-NEXT: carve.cast %[[DW]] {carve.kernel = "none"} : tensor<32x10xf32> -> tensor<32x10xbf16>
// CHECK: return

// F32-LABEL: func.func @train_step(
// F32: carve.cross_entropy {{.*}}carve.kernel = "cross_entropy", carve.loss_in_grad
// F32: carve.cross_entropy_grad {{.*}}carve.kernel = "cross_entropy_with_grad", carve.read16 = array<i1: false>,

// CPP: if (ctx.evaluating)  // the step's loss: computed with its gradient (cross_entropy_with_grad)
// CPP-NEXT: gpu::cross_entropy16(head_MatMul_16_bit_copy, {8, 10}, t, 0 /*mean*/, /*hasIgnore=*/true, -100LL, [[LOSS:[a-z_0-9]+]]);
// CPP: gpu::cross_entropy_with_grad(head_MatMul_16_bit_copy, /*l16=*/true, {8, 10}, t, 0 /*mean*/, /*hasIgnore=*/true, -100LL, loss_seed, d_head_MatMul_16_bit_operand, /*d16=*/true, [[LOSS]]);  // and the loss (one pass over the logits)

// CPU-LABEL: func.func @train_step(
// CPU-NOT: write16
// CPU-NOT: cross_entropy16
// CPU-NOT: cross_entropy_grad16
// CPU-NOT: with_grad
// CPU-NOT: loss_in_grad
// CPU: return

func.func @forward(%x: tensor<8x16xf32> {carve.input = "x"},
                   %t: tensor<8xi64> {carve.input = "t"},
                   %w: tensor<16x32xf32> {carve.param = "w", carve.trainable},
                   %head: tensor<32x10xf32> {carve.param = "head", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %h = carve.matmul %x, %w : (tensor<8x16xf32>, tensor<16x32xf32>) -> tensor<8x32xf32> loc("/fc/MatMul")
  %a = carve.tanh %h : tensor<8x32xf32> loc("/act/Tanh")
  %logits = carve.matmul %a, %head : (tensor<8x32xf32>, tensor<32x10xf32>) -> tensor<8x10xf32> loc("/head/MatMul")
  %loss = carve.cross_entropy %logits, %t {ignore_index = -100 : i64} : (tensor<8x10xf32>, tensor<8xi64>) -> tensor<f32> loc("/loss")
  return %loss : tensor<f32>
}
