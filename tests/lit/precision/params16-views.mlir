// Tests carve-store-params16 on a parameter read through a reshape in both
// passes (a convolution's weight as [O, C*K], read by the forward's GEMM and
// by the input gradient's): backward gets a reshape of its own, each after
// its own cast, so that no fp32 view of the weight lives from forward to
// backward.
//
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16" --carve-store-params16 --mlir-print-debuginfo | FileCheck %s

// CHECK-LABEL: func.func @train_step(
// CHECK-SAME: %arg2: tensor<2x4x8xbf16> {carve.master, carve.param = "h.1.w", carve.trainable}
// CHECK: %[[C1:.+]] = carve.cast %arg2 : tensor<2x4x8xbf16> -> tensor<2x4x8xf32>
// CHECK-NEXT: %[[R1:.+]] = carve.reshape %[[C1]] : tensor<2x4x8xf32> -> tensor<8x8xf32> loc(#[[FWD:loc[0-9]+]])
// CHECK-NEXT: carve.matmul %{{.+}}, %[[R1]]
// CHECK-NOT: %[[R1]]
// CHECK: %[[C2:.+]] = carve.cast %arg2 : tensor<2x4x8xbf16> -> tensor<2x4x8xf32>
// CHECK-NEXT: %[[R2:.+]] = carve.reshape %[[C2]] : tensor<2x4x8xf32> -> tensor<8x8xf32> loc(#[[BWD:loc[0-9]+]])
// CHECK-NEXT: carve.transpose %[[R2]]
// CHECK-NOT: %[[R1]]
// CHECK: return
// CHECK-DAG: #[[FWD]] = loc("/h.1/Reshape"
// CHECK-DAG: #[[BWD]] = loc("backward of /h.1/Reshape"

func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %w0: tensor<8x8xf32> {carve.param = "h.0.w", carve.trainable},
                   %w1: tensor<2x4x8xf32> {carve.param = "h.1.w", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %m0 = carve.matmul %x, %w0 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/h.0/MatMul")
  %a0 = carve.exp %m0 : tensor<4x8xf32> loc("/h.0/Exp")
  %wm = carve.reshape %w1 : tensor<2x4x8xf32> -> tensor<8x8xf32> loc("/h.1/Reshape")
  %m1 = carve.matmul %a0, %wm : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/h.1/MatMul")
  %l = carve.reduce_sum %m1 {axes = array<i64: 0, 1>, keep_dims = false} : tensor<4x8xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
