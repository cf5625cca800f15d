// Tests carve-round-operands16 in a training step (CUDA target, bf16): the
// gradient of fc2's output, which the data-gradient and the weight-gradient
// matmuls both read, is rounded once before the first (a cast to bf16), and
// carve-plan-memory keeps that cast's result until the second: no op in
// between writes where it lies. The tanh's output, read in the forward by
// fc2 and in the backward (through a folded transpose) by fc2's weight
// gradient, gets no copy (it would be kept from forward to backward beside
// the f32 value): that matmul rounds it as before. Its product, the weight
// gradient, is read only by its 16-bit cast (carve-store-grads16): the
// matmul writes the cast's result itself (carve-select-kernels' rule 3e),
// and the exp's gradient writes its own copy (rule 3h).
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16 target=cuda" --carve-round-activations --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-plan-memory --carve-select-kernels | FileCheck %s

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[T:.+]] = carve.tanh
// CHECK: %[[G:.+]] = carve.unary_grad {{.*}}carve.kernel = "unary_grad16"{{.*}}fn = "exp"
// CHECK: %[[G16:.+]] = carve.cast %[[G]] {carve.arena_offset = array<i64: [[OFF:[0-9]+]]>, carve.copy_by_writer, carve.kernel = "none"} : tensor<4x8xf32> -> tensor<4x8xbf16>
// CHECK-NOT: carve.arena_offset = array<i64: [[OFF]]>
// CHECK: carve.matmul %[[G]], %{{.+}} {{.*}}carve.kernel = "matmul16", carve.read16 = array<i1: true, true>}
// CHECK-NOT: carve.arena_offset = array<i64: [[OFF]]>
// CHECK: %[[TT:.+]] = carve.transpose %[[T]] {carve.fold = "operand"
// CHECK-NOT: carve.arena_offset = array<i64: [[OFF]]>
// CHECK: %[[DW:.+]] = carve.matmul %[[TT]], %[[G]] {{.*}}carve.kernel = "matmul16_to16", carve.read16 = array<i1: false, true>, carve.write16}
// CHECK-NEXT: carve.cast %[[DW]] {carve.kernel = "none"} : tensor<8x8xf32> -> tensor<8x8xbf16>
// CHECK: return

func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %w1: tensor<8x8xf32> {carve.param = "w1", carve.trainable},
                   %w2: tensor<8x8xf32> {carve.param = "w2", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %h = carve.matmul %x, %w1 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/fc1/MatMul")
  %a = carve.tanh %h : tensor<4x8xf32> loc("/act/Tanh")
  %y = carve.matmul %a, %w2 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/fc2/MatMul")
  %e = carve.exp %y : tensor<4x8xf32> loc("/exp")
  %l = carve.reduce_sum %e {axes = array<i64: 0, 1>, keep_dims = false} : tensor<4x8xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
