// Tests carve-select-kernels' rule 3h on gradients (CUDA target, bf16): the
// 16-bit copy of a layer norm gradient's input gradient (the operand the
// matmul before it reads) is written by the gradient's kernel
// (layer_norm_grad16, the copy carve.copy_by_writer), and an embedding's
// 16-bit gradient by the gather gradient that sums it (gather_grad16): no
// conversion call is left in the step. The same bits as the conversions.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16 target=cuda" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s
// RUN: carve-opt %s --mlir-print-debuginfo --carve-autodiff --carve-set-plan="precision=bf16 target=cuda" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-optimizer --carve-select-kernels | carve-translate --carve-to-cpp | FileCheck %s --check-prefix=CPP
// The CPU target keeps its casts.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s --check-prefix=CPU

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[DX:[^,]+]], %{{[^,]+}}, %{{[^ ]+}} = carve.layer_norm_grad {{.*}}carve.kernel = "layer_norm_grad16"
// CHECK: carve.cast %[[DX]] {{{.*}}carve.copy_by_writer, carve.kernel = "none"} : tensor<4x16x32xf32> -> tensor<4x16x32xbf16>
// CHECK: %[[G:.+]] = carve.gather_grad {{.*}}carve.kernel = "gather_grad16"
// CHECK-NEXT: carve.cast %[[G]] {carve.copy_by_writer, carve.kernel = "none"} : tensor<64x32xf32> -> tensor<64x32xbf16>
// CHECK-NOT: "toBf16"
// CHECK: return

// The norm gradient's f32 input gradient has no reader left: only its copy.
// CPP: gpu::layer_norm_grad16(proj_MatMul_16_bit_copy, /*x16=*/true, {4, 16, 32}, 2, {{.*}}, d_head_MatMul_2, nullptr, d_proj_MatMul_16_bit_operand, nullptr, nullptr,
// CPP: gpu::gather_grad16(d_proj_MatMul_2, ids, {4, 16}, 0, d_wte_Gather, {64, 32}, gradient_of_wte_16_bit);
// CPP-NOT: gpu::toBf16(

// CPU-LABEL: func.func @train_step(
// CPU-NOT: gather_grad16
// CPU-NOT: copy_by_writer
// CPU: return

func.func @forward(%ids: tensor<4x16xi64> {carve.input = "ids"},
                   %t: tensor<64xi64> {carve.input = "t"},
                   %wte: tensor<64x32xf32> {carve.param = "wte", carve.trainable},
                   %w1: tensor<32x32xf32> {carve.param = "proj", carve.trainable},
                   %g: tensor<32xf32> {carve.param = "ln.weight", carve.trainable},
                   %b: tensor<32xf32> {carve.param = "ln.bias", carve.trainable},
                   %head: tensor<32x10xf32> {carve.param = "head", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %x = carve.gather %wte, %ids {axis = 0 : i64} : (tensor<64x32xf32>, tensor<4x16xi64>) -> tensor<4x16x32xf32> loc("/wte/Gather")
  %p = carve.matmul %x, %w1 : (tensor<4x16x32xf32>, tensor<32x32xf32>) -> tensor<4x16x32xf32> loc("/proj/MatMul")
  %ln = carve.layer_norm %p scale %g bias %b {axis = 2 : i64, epsilon = 1.000000e-05 : f32} : (tensor<4x16x32xf32>, tensor<32xf32>, tensor<32xf32>) -> tensor<4x16x32xf32> loc("/ln/LayerNormalization")
  %l = carve.matmul %ln, %head : (tensor<4x16x32xf32>, tensor<32x10xf32>) -> tensor<4x16x10xf32> loc("/head/MatMul")
  %lr = carve.reshape %l : tensor<4x16x10xf32> -> tensor<64x10xf32> loc("/head/Reshape")
  %loss = carve.cross_entropy %lr, %t {ignore_index = -100 : i64} : (tensor<64x10xf32>, tensor<64xi64>) -> tensor<f32> loc("/loss")
  return %loss : tensor<f32>
}
