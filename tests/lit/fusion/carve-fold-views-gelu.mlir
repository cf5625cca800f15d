// Tests carve-fold-views' "epilogue" on GELU and on GELU's gradient (CUDA
// target, bf16 and fp16), cuBLASLt's GELU form being the tanh one.
// Forward: the tanh GELU of a bias add marked "epilogue", alone in its fused
// chain, leaves the chain and is marked "epilogue" too: the matmul adds the
// bias, writes the sum's 16-bit copy (the pre-activation) and the GELU's
// (matmul16_bias_gelu, cuBLASLt's GELU_AUX_BIAS); neither op is a call.
// Backward: the unary_grad of the tanh GELU whose gradient is the product
// of the output projection's data-gradient matmul is computed by that
// matmul (matmul16_dgelu, cuBLASLt's DGELU epilogue, reading the 16-bit
// pre-activation as its auxiliary input): the unary_grad is no call, marked
// carve.round16 (its value is its 16-bit copy's), and neither it nor the
// product is in f32 memory; its copy is written by the matmul
// (carve.copy_by_writer) and the bias gradient's sum is still done by the
// weight gradient's GEMM. Neither for the erf GELU (a fused chain and
// unary_grad16 as before), nor where the rows (the last dimension) are not
// a multiple of 8 (cuBLASLt's EPILOGUE_AUX_LD), nor in fp32, nor on the CPU
// target.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16 target=cuda" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=fp16 target=cuda" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s
// The printed call: the product's operands, the pre-activation's copy and
// the gradient's copy.
// RUN: carve-opt %s --mlir-print-debuginfo --carve-autodiff --carve-set-plan="precision=bf16 target=cuda" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-optimizer --carve-select-kernels | carve-translate --carve-to-cpp | FileCheck %s --check-prefix=CPP
// The erf GELU, rows of 36, fp32, the CPU target: unary_grad calls of their own.
// RUN: sed 's/approximate = "tanh"/approximate = "none"/' %s | carve-opt --carve-autodiff --carve-set-plan="precision=bf16 target=cuda" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s --check-prefix=NONE -DFN=gelu
// RUN: sed 's/32x/36x/g' %s | carve-opt --carve-autodiff --carve-set-plan="precision=bf16 target=cuda" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s --check-prefix=NONE -DFN=gelu_tanh
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="target=cuda" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory --carve-select-kernels | FileCheck %s --check-prefix=F32
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16" --carve-round-activations --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s --check-prefix=F32

// CHECK-LABEL: func.func @train_step(
// The forward: the fc GEMM adds the bias and applies GELU as it writes both copies.
// CHECK: carve.matmul {{.*}}carve.kernel = "matmul16_bias_gelu"
// CHECK: %[[PRE:.+]] = carve.add {{.*}}carve.fold = "epilogue"
// CHECK-NEXT: %[[PRE16:.+]] = carve.cast %[[PRE]] {{.*}}carve.copy_by_writer
// CHECK-NEXT: %[[G:.+]] = carve.gelu %[[PRE]] {approximate = "tanh", carve.fold = "epilogue", carve.kernel = "none", carve.round16}
// CHECK-NEXT: carve.cast %[[G]] {carve.arena_offset = array<i64: {{[0-9]+}}>, carve.copy_by_writer, carve.kernel = "none"}
// The output projection's data gradient: no f32 memory (no arena offset).
// CHECK: %[[DY:.+]] = carve.matmul %{{[^ ]+}}, %{{[^ ]+}} {carve.kernel = "matmul16_dgelu", carve.read16 = array<i1: true, true>} : (tensor<2x8x16xf32>, tensor<16x32xf32>) -> tensor<2x8x32xf32>
// CHECK: %[[X:.+]] = carve.cast %[[PRE16]] {carve.kernel = "none"} : tensor<2x8x32x{{bf16|f16}}> -> tensor<2x8x32xf32>
// CHECK-NEXT: %[[DX:.+]] = carve.unary_grad %[[X]], %[[DY]] {carve.fold = "epilogue", carve.kernel = "none", carve.round16, fn = "gelu_tanh"} : tensor<2x8x32xf32>
// CHECK-NEXT: carve.cast %[[DX]] {carve.arena_offset = array<i64: {{[0-9]+}}>, carve.copy_by_writer, carve.kernel = "none"} : tensor<2x8x32xf32> -> tensor<2x8x32x{{bf16|f16}}>
// CHECK-NEXT: carve.reduce_sum %[[DX]] {axes = array<i64: 0, 1>, carve.bias_grad_in_gemm, carve.kernel = "none"}
// CHECK: return

// CPP: gpu::matmul16_bias_gelu(in_Tanh_16_bit_copy, /*a16=*/true, {2, 8, 16}, /*transA=*/false, fc_weight, /*b16=*/true, {32, 16}, /*transB=*/true, fc_bias, fc_Add_16_bit_copy, act_Gelu_16_bit_copy, {2, 8, 32});  // + the bias of /fc/Add, then /act/Gelu (tanh GELU)
// CPP: // applied by the matmul above as it wrote act_Gelu_16_bit_copy (cuBLASLt's GELU_AUX_BIAS epilogue)
// CPP-NOT: gpu::fused(
// CPP: gpu::matmul16_dgelu(d_proj_MatMul_16_bit_operand, /*a16=*/true, {2, 8, 16}, /*transA=*/false, proj_weight, /*b16=*/true, {16, 32}, /*transB=*/false, fc_Add_16_bit_copy, d_fc_MatMul_16_bit_operand, {2, 8, 32});  // times GELU's derivative: backward of /act/Gelu
// CPP: // multiplied in by the matmul above as it wrote d_fc_MatMul_16_bit_operand (cuBLASLt's DGELU epilogue)
// CPP-NOT: gpu::unary_grad16(Unary::GeluTanh

// NONE-LABEL: func.func @train_step(
// NONE-NOT: matmul16_dgelu
// NONE-NOT: matmul16_bias_gelu
// NONE: carve.matmul {{.*}}carve.kernel = "matmul16_bias"
// NONE: carve.gelu {{.*}}carve.fusion_group = {{[0-9]+}} : i64, carve.kernel = "fused"
// NONE: carve.unary_grad {{.*}}carve.kernel = "unary_grad16"{{.*}}fn = "[[FN]]"
// NONE-NOT: matmul16_dgelu
// NONE: return

// F32-LABEL: func.func @train_step(
// F32-NOT: matmul16_bias_gelu
// F32-NOT: matmul16_dgelu
// F32: carve.unary_grad {{.*}}carve.kernel = "unary_grad"{{.*}}fn = "gelu_tanh"
// F32-NOT: matmul16_dgelu
// F32: return

func.func @forward(%x: tensor<2x8x16xf32> {carve.input = "x"},
                   %t: tensor<16xi64> {carve.input = "t"},
                   %w0: tensor<16x16xf32> {carve.param = "in.weight", carve.trainable},
                   %w1: tensor<32x16xf32> {carve.param = "fc.weight", carve.trainable},
                   %b1: tensor<32xf32> {carve.param = "fc.bias", carve.trainable},
                   %w2: tensor<16x32xf32> {carve.param = "proj.weight", carve.trainable},
                   %b2: tensor<16xf32> {carve.param = "proj.bias", carve.trainable},
                   %head: tensor<16x10xf32> {carve.param = "head.weight", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %h0 = carve.matmul %x, %w0 : (tensor<2x8x16xf32>, tensor<16x16xf32>) -> tensor<2x8x16xf32> loc("/in/MatMul")
  %a0 = carve.tanh %h0 : tensor<2x8x16xf32> loc("/in/Tanh")
  %w1t = carve.transpose %w1 {perm = array<i64: 1, 0>} : tensor<32x16xf32> -> tensor<16x32xf32> loc("/fc/Transpose")
  %h = carve.matmul %a0, %w1t : (tensor<2x8x16xf32>, tensor<16x32xf32>) -> tensor<2x8x32xf32> loc("/fc/MatMul")
  %hb = carve.add %h, %b1 : (tensor<2x8x32xf32>, tensor<32xf32>) -> tensor<2x8x32xf32> loc("/fc/Add")
  %g = carve.gelu %hb {approximate = "tanh"} : tensor<2x8x32xf32> loc("/act/Gelu")
  %w2t = carve.transpose %w2 {perm = array<i64: 1, 0>} : tensor<16x32xf32> -> tensor<32x16xf32> loc("/proj/Transpose")
  %p = carve.matmul %g, %w2t : (tensor<2x8x32xf32>, tensor<32x16xf32>) -> tensor<2x8x16xf32> loc("/proj/MatMul")
  %pb = carve.add %p, %b2 : (tensor<2x8x16xf32>, tensor<16xf32>) -> tensor<2x8x16xf32> loc("/proj/Add")
  %l = carve.matmul %pb, %head : (tensor<2x8x16xf32>, tensor<16x10xf32>) -> tensor<2x8x10xf32> loc("/head/MatMul")
  %lr = carve.reshape %l : tensor<2x8x10xf32> -> tensor<16x10xf32> loc("/head/Reshape")
  %loss = carve.cross_entropy %lr, %t {ignore_index = -100 : i64} : (tensor<16x10xf32>, tensor<16xi64>) -> tensor<f32> loc("/loss")
  return %loss : tensor<f32>
}
