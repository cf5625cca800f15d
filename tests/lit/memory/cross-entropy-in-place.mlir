// Tests carve-plan-memory on the CUDA target under bf16/fp16: the cross-entropy
// gradient's 16-bit copy, which the gradient writes alone, takes the bytes of
// the logits' 16-bit copy it reads (logitsOverwrittenBy: the kernel reads
// each row before writing it), the logits' copy living until the gradient
// reads it (through its f32 view) and nothing else placed over it before;
// the loss, born between the two, lies elsewhere.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16 target=cuda" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory="placement=first-fit" | FileCheck %s
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=fp16 target=cuda" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory="placement=largest-first" | FileCheck %s

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[L:.+]] = carve.matmul {{.*}} -> tensor<2x8x64xf32>
// CHECK-NEXT: %[[L16:.+]] = carve.cast %[[L]] {carve.arena_offset = array<i64: [[OFF:[0-9]+]]>} : tensor<2x8x64xf32> -> tensor<2x8x64x{{bf16|f16}}>
// CHECK: carve.cross_entropy %{{[^ ]+}}, %{{[^ ]+}} {carve.arena_offset = array<i64: [[LOSS:[0-9]+]]>
// CHECK-NOT: array<i64: [[OFF]]>
// CHECK: %[[G:.+]] = carve.cross_entropy_grad
// CHECK-NEXT: carve.cast %[[G]] {carve.arena_offset = array<i64: [[OFF]]>}
// CHECK: return

func.func @forward(%x: tensor<2x8x16xf32> {carve.input = "x"},
                   %t: tensor<16xi64> {carve.input = "t"},
                   %w0: tensor<16x16xf32> {carve.param = "in.weight", carve.trainable},
                   %head: tensor<16x64xf32> {carve.param = "head.weight", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %h0 = carve.matmul %x, %w0 : (tensor<2x8x16xf32>, tensor<16x16xf32>) -> tensor<2x8x16xf32> loc("/in/MatMul")
  %a0 = carve.tanh %h0 : tensor<2x8x16xf32> loc("/in/Tanh")
  %l = carve.matmul %a0, %head : (tensor<2x8x16xf32>, tensor<16x64xf32>) -> tensor<2x8x64xf32> loc("/head/MatMul")
  %lr = carve.reshape %l : tensor<2x8x64xf32> -> tensor<16x64xf32> loc("/head/Reshape")
  %loss = carve.cross_entropy %lr, %t {ignore_index = -100 : i64} : (tensor<16x64xf32>, tensor<16xi64>) -> tensor<f32> loc("/loss")
  return %loss : tensor<f32>
}
