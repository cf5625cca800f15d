// Tests carve-select-kernels' rule 3i (CUDA target, bf16 and fp16): a bias
// gradient's sum over every axis but the last is done by the weight
// gradient's GEMM that reads the same [K, N] gradient as its 16-bit operand
// (cuBLASLt's bias-gradient epilogue). The GEMM runs as
// matmul16_to16_bgrad with carve.bias_grad_of naming its call's operand
// whose columns are summed: 0 (a, BGRADB) for a layer stored as PyTorch's
// Linear stores it (fc.weight [out, in]: the weight gradient is the
// transpose of a product, printed b^T a^T), 1 (b, BGRADA) for a weight
// stored [in, out] (the head); the reduction is no call
// (carve.bias_grad_in_gemm) and its 16-bit copy, the parameter's gradient,
// stays carve.copy_by_writer (the GEMM writes it). Not where the GEMM
// rounds an operand itself (the first layer, whose input x has no 16-bit
// tensor), nor in fp32, nor on the CPU target.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16 target=cuda" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=fp16 target=cuda" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s
// Under dp = 2 the gradients' all-reduce reads them after the GEMMs: the same.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=2 precision=bf16 target=cuda" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s
// The printed calls: the bias gradient's 16-bit slot passed to the GEMM.
// RUN: carve-opt %s --mlir-print-debuginfo --carve-autodiff --carve-set-plan="precision=bf16 target=cuda" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-optimizer --carve-select-kernels | carve-translate --carve-to-cpp | FileCheck %s --check-prefix=CPP
// fp32 on the CUDA target, and bf16 on the CPU target: the sums stay
// reductions of their own.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="target=cuda" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory --carve-select-kernels | FileCheck %s --check-prefix=NONE
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s --check-prefix=NONE

// CHECK-LABEL: func.func @train_step(
// The head's bias gradient: summed by the head's weight gradient (BGRADA).
// CHECK: carve.reduce_sum %[[DL:[^ ]+]] {axes = array<i64: 0, 1>, carve.bias_grad_in_gemm, carve.kernel = "none"} : tensor<2x4x10xf32> -> tensor<1x1x10xf32>
// CHECK-NEXT: carve.reshape
// CHECK-NEXT: carve.cast {{.*}}carve.copy_by_writer, carve.kernel = "none"} : tensor<10xf32> -> tensor<10x{{bf16|f16}}>
// CHECK: %[[DLR:.+]] = carve.reshape %[[DL]] {{.*}} -> tensor<8x10xf32>
// CHECK: carve.matmul %{{.+}}, %[[DLR]] {carve.bias_grad_of = 1 : i64, carve.kernel = "matmul16_to16_bgrad", carve.read16 = array<i1: true, true>, carve.write16} : (tensor<32x8xf32>, tensor<8x10xf32>) -> tensor<32x10xf32>
// The fc layer's: by the transpose of the product (BGRADB).
// CHECK: carve.reduce_sum %[[DH:[^ ]+]] {axes = array<i64: 0, 1>, carve.bias_grad_in_gemm, carve.kernel = "none"} : tensor<2x4x32xf32> -> tensor<1x1x32xf32>
// CHECK: carve.transpose %{{.+}} {carve.bias_grad_of = 0 : i64, carve.fold = "product", carve.kernel = "matmul16_to16_bgrad", carve.read16 = array<i1: true, true>, carve.write16, perm = array<i64: 1, 0>} : tensor<16x32xf32> -> tensor<32x16xf32>
// The first layer's weight gradient reads the input x, which has no 16-bit
// tensor (its GEMM rounds it): its bias gradient stays a reduction.
// CHECK: carve.reduce_sum {{.*}}carve.kernel = "reduce16"{{.*}} : tensor<2x4x16xf32> -> tensor<1x1x16xf32>
// CHECK: carve.kernel = "matmul16_to16", carve.read16 = array<i1: false, {{true|false}}>
// CHECK: return

// CPP: // summed by the weight gradient's GEMM below (cuBLASLt's bias-gradient epilogue)
// CPP: uint16_t *gradient_of_head_bias_16_bit = (uint16_t *)(A + {{[0-9]+}});
// CPP-NEXT: gpu::matmul16_to16_bgrad(act_Tanh_16_bit_copy, {8, 32}, d_head_MatMul_16_bit_operand, {8, 10}, /*biasOfA=*/false, gradient_of_head_weight_16_bit, {32, 10}, gradient_of_head_bias_16_bit);  // a^T b, and the bias gradient (cuBLASLt's BGRADA epilogue)
// CPP: // summed by the weight gradient's GEMM below (cuBLASLt's bias-gradient epilogue)
// CPP: uint16_t *gradient_of_fc_bias_16_bit = (uint16_t *)(A + {{[0-9]+}});
// CPP-NEXT: gpu::matmul16_to16_bgrad(d_fc_MatMul_16_bit_operand, {8, 32}, in_Tanh_16_bit_copy, {8, 16}, /*biasOfA=*/true, gradient_of_fc_weight_16_bit, {32, 16}, gradient_of_fc_bias_16_bit);  // (a b)^T as b^T a^T, and the bias gradient (cuBLASLt's BGRADB epilogue)
// CPP: gpu::reduce16(Reduce::Sum,

// NONE-LABEL: func.func @train_step(
// NONE-NOT: bgrad
// NONE-NOT: bias_grad_in_gemm
// NONE: carve.reduce_sum
// NONE-NOT: bgrad
// NONE: return

func.func @forward(%x: tensor<2x4x16xf32> {carve.input = "x"},
                   %t: tensor<8xi64> {carve.input = "t"},
                   %w0: tensor<16x16xf32> {carve.param = "in.weight", carve.trainable},
                   %b0: tensor<16xf32> {carve.param = "in.bias", carve.trainable},
                   %w: tensor<32x16xf32> {carve.param = "fc.weight", carve.trainable},
                   %b: tensor<32xf32> {carve.param = "fc.bias", carve.trainable},
                   %head: tensor<32x10xf32> {carve.param = "head.weight", carve.trainable},
                   %hb: tensor<10xf32> {carve.param = "head.bias", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %h0 = carve.matmul %x, %w0 : (tensor<2x4x16xf32>, tensor<16x16xf32>) -> tensor<2x4x16xf32> loc("/in/MatMul")
  %h0b = carve.add %h0, %b0 : (tensor<2x4x16xf32>, tensor<16xf32>) -> tensor<2x4x16xf32> loc("/in/Add")
  %a0 = carve.tanh %h0b : tensor<2x4x16xf32> loc("/in/Tanh")
  %wt = carve.transpose %w {perm = array<i64: 1, 0>} : tensor<32x16xf32> -> tensor<16x32xf32> loc("/fc/Transpose")
  %h = carve.matmul %a0, %wt : (tensor<2x4x16xf32>, tensor<16x32xf32>) -> tensor<2x4x32xf32> loc("/fc/MatMul")
  %hb1 = carve.add %h, %b : (tensor<2x4x32xf32>, tensor<32xf32>) -> tensor<2x4x32xf32> loc("/fc/Add")
  %a = carve.tanh %hb1 : tensor<2x4x32xf32> loc("/act/Tanh")
  %l = carve.matmul %a, %head : (tensor<2x4x32xf32>, tensor<32x10xf32>) -> tensor<2x4x10xf32> loc("/head/MatMul")
  %l2 = carve.add %l, %hb : (tensor<2x4x10xf32>, tensor<10xf32>) -> tensor<2x4x10xf32> loc("/head/Add")
  %lr = carve.reshape %l2 : tensor<2x4x10xf32> -> tensor<8x10xf32> loc("/head/Reshape")
  %loss = carve.cross_entropy %lr, %t {ignore_index = -100 : i64} : (tensor<8x10xf32>, tensor<8xi64>) -> tensor<f32> loc("/loss")
  return %loss : tensor<f32>
}
