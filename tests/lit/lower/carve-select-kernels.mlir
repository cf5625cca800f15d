// Tests carve-select-kernels: each op's runtime entry (kernels.def) on the
// plan's target, from the marks of the passes before it: fused chains run as
// `fused`, views, constants and folded transposes as `none`, a transposed
// product as `matmul` (its matmul `none`), vocab-parallel gathers and
// cross-entropy as their sharded entries, casts as the conversion they name.
// The same function on the CUDA target chooses the same entries
// (select-kernels-errors.mlir: what a target has no entry for).
// RUN: carve-opt %s -carve-select-kernels | FileCheck %s
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda}, carve-select-kernels)' | FileCheck %s --check-prefixes=CHECK,CUDA
// A convolution's windows (carve-fold-transposes' gather-operands and
// scatter-products): the gathers and the products are `none`, their GEMMs
// `matmul_gathered` and `matmul_gather_grad`.
// RUN: carve-opt %S/../fusion/gather-operands.mlir -pass-pipeline='builtin.module(func.func(carve-lower-convolutions), carve-autodiff, carve-fold-transposes{gather-operands=true scatter-products=true}, carve-select-kernels)' | FileCheck %s --check-prefix=CONV

// CUDA: module attributes {carve.plan = {{.*}}target = "cuda"
// CHECK-LABEL: func.func @train_step(
// CHECK: %[[C:.+]] = carve.constant {{.*}}carve.kernel = "none"
// CHECK: %[[E:.+]] = carve.gather %{{.+}}, %{{.+}} {axis = 0 : i64, carve.kernel = "gather_sharded", dist.sharded_rows = 64 : i64}
// CHECK: %[[B:.+]] = carve.add %[[E]], %{{.+}} {carve.fusion_group = 0 : i64, carve.kernel = "fused"}
// CHECK: %[[G:.+]] = carve.gelu %[[B]] {carve.fusion_group = 0 : i64, carve.kernel = "fused"}
// CHECK: %[[WT:.+]] = carve.transpose %{{.+}} {carve.fold = "operand", carve.kernel = "none", perm = array<i64: 1, 0>}
// CHECK: %[[M:.+]] = carve.matmul %[[G]], %[[WT]] {carve.kernel = "matmul"}
// CHECK: %[[P:.+]] = carve.matmul %{{.+}}, %{{.+}} {carve.kernel = "none"}
// CHECK: carve.transpose %[[P]] {carve.fold = "product", carve.kernel = "matmul", perm = array<i64: 1, 0>}
// CHECK: %[[R:.+]] = carve.reshape %[[M]] {carve.kernel = "none"}
// CHECK: %[[H:.+]] = carve.cast %[[R]] {carve.kernel = "toBf16"}
// CHECK: carve.cast %[[H]] {carve.kernel = "fromBf16"}
// CHECK: carve.layer_norm {{.*}}carve.kernel = "layer_norm"
// CHECK: carve.cross_entropy {{.*}}carve.kernel = "cross_entropy_vocab_parallel"
// CHECK: carve.add %{{.+}}, %[[C]] {carve.kernel = "binary"}
// CHECK: return

func.func @train_step(%ids: tensor<4x16xi64> {carve.input = "ids"},
                %wte: tensor<32x8xf32> {carve.param = "wte", carve.trainable},
                %b: tensor<8xf32> {carve.param = "b", carve.trainable},
                %w: tensor<8x8xf32> {carve.param = "w", carve.trainable},
                %t: tensor<64xi64> {carve.input = "t"}) -> (tensor<f32>, tensor<8x8xf32>) {
  %eps = carve.constant dense<1.000000e-05> : tensor<f32>
  %e = carve.gather %wte, %ids {axis = 0 : i64, dist.sharded_rows = 64 : i64} : (tensor<32x8xf32>, tensor<4x16xi64>) -> tensor<4x16x8xf32>
  %x = carve.add %e, %b {carve.fusion_group = 0 : i64} : (tensor<4x16x8xf32>, tensor<8xf32>) -> tensor<4x16x8xf32>
  %g = carve.gelu %x {carve.fusion_group = 0 : i64} : tensor<4x16x8xf32>
  %wt = carve.transpose %w {carve.fold = "operand", perm = array<i64: 1, 0>} : tensor<8x8xf32> -> tensor<8x8xf32>
  %m = carve.matmul %g, %wt : (tensor<4x16x8xf32>, tensor<8x8xf32>) -> tensor<4x16x8xf32>
  %p = carve.matmul %w, %w : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
  %pt = carve.transpose %p {carve.fold = "product", perm = array<i64: 1, 0>} : tensor<8x8xf32> -> tensor<8x8xf32>
  %r = carve.reshape %m : tensor<4x16x8xf32> -> tensor<64x8xf32>
  %h = carve.cast %r : tensor<64x8xf32> -> tensor<64x8xbf16>
  %f = carve.cast %h : tensor<64x8xbf16> -> tensor<64x8xf32>
  %n = carve.layer_norm %f scale %b bias %b {axis = 1 : i64, epsilon = 1.000000e-05 : f32} : (tensor<64x8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<64x8xf32>
  %l = carve.cross_entropy %n, %t {dist.sharded_rows = 16 : i64} : (tensor<64x8xf32>, tensor<64xi64>) -> tensor<f32>
  %s = carve.add %l, %eps : (tensor<f32>, tensor<f32>) -> tensor<f32>
  return %s, %pt : tensor<f32>, tensor<8x8xf32>
}

// CONV-LABEL: func.func @train_step(
// CONV: carve.gather {{.*}}carve.fold = "gather", carve.kernel = "none"
// CONV: carve.matmul {{.*}}carve.kernel = "matmul_gathered"
// CONV: carve.gather_grad {{.*}}carve.fold = "scatter", carve.kernel = "matmul_gather_grad"
