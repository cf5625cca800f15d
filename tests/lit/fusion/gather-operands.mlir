// Tests carve-fold-transposes' gather-operands (the runtimes'
// matmul_gathered): each convolution's windows, gathered from the padded
// image, are read only by its forward GEMM and, through a reshape and an
// "operand" transpose, by its weight gradient's GEMM, both as the right
// operand: the gather is marked "gather" (it and its reshapes get no
// buffer). Max pooling's windows are read by a reduction: not marked.
// Without the option nothing is marked.
// RUN: carve-opt %s -pass-pipeline='builtin.module(func.func(carve-lower-convolutions), carve-autodiff, carve-fold-transposes{gather-operands=true})' | FileCheck %s
// RUN: carve-opt %s -pass-pipeline='builtin.module(func.func(carve-lower-convolutions), carve-autodiff, carve-fold-transposes)' | FileCheck %s --check-prefix=OFF
// Under a bf16 plan the windows are rounded as written (carve.round16) and
// still folded: the matmuls round their inputs themselves, so no 16-bit copy
// of them is kept (carve-pack-activations leaves folded gathers alone) while
// max pooling's windows get one.
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{precision=bf16}, func.func(carve-lower-convolutions), carve-autodiff, carve-round-activations, carve-fold-transposes{gather-operands=true}, carve-pack-activations)' | FileCheck %s --check-prefix=BF16

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[G1:.+]] = carve.gather %{{.+}}, %{{.+}} {axis = 2 : i64, carve.fold = "gather"} : (tensor<2x3x17xf32>, tensor<9x16xi64>) -> tensor<2x3x9x16xf32>
// CHECK: %[[W1:.+]] = carve.reshape %[[G1]] : tensor<2x3x9x16xf32> -> tensor<2x27x16xf32>
// CHECK: carve.matmul %{{.+}}, %[[W1]] : (tensor<4x27xf32>, tensor<2x27x16xf32>) -> tensor<2x4x16xf32>
// CHECK: carve.gather %{{.+}}, %{{.+}} {axis = 2 : i64} : (tensor<2x4x16xf32>, tensor<4x4xi64>) -> tensor<2x4x4x4xf32>
// CHECK: %[[G2:.+]] = carve.gather %{{.+}}, %{{.+}} {axis = 2 : i64, carve.fold = "gather"} : (tensor<2x4x5xf32>, tensor<9x4xi64>) -> tensor<2x4x9x4xf32>
// CHECK: %[[W2:.+]] = carve.reshape %[[G2]] : tensor<2x4x9x4xf32> -> tensor<2x36x4xf32>
// CHECK: carve.matmul %{{.+}}, %[[W2]] :
// CHECK: %[[T2:.+]] = carve.transpose %[[W2]] {carve.fold = "operand", perm = array<i64: 0, 2, 1>}
// CHECK: carve.matmul %{{.+}}, %[[T2]] : (tensor<2x4x4xf32>, tensor<2x4x36xf32>) -> tensor<2x4x36xf32>
// CHECK: %[[T1:.+]] = carve.transpose %[[W1]] {carve.fold = "operand", perm = array<i64: 0, 2, 1>}
// CHECK: carve.matmul %{{.+}}, %[[T1]] : (tensor<2x4x16xf32>, tensor<2x16x27xf32>) -> tensor<2x4x27xf32>
// CHECK: return
// OFF-NOT: "gather"

// BF16-LABEL: func.func @train_step(
// BF16: %[[G1:.+]] = carve.gather %{{.+}}, %{{.+}} {axis = 2 : i64, carve.fold = "gather", carve.round16} : (tensor<2x3x17xf32>
// BF16-NOT: carve.cast %[[G1]]
// BF16: %[[P:.+]] = carve.gather %{{.+}}, %{{.+}} {axis = 2 : i64, carve.round16} : (tensor<2x4x16xf32>
// BF16: carve.cast %[[P]] : tensor<2x4x4x4xf32> -> tensor<2x4x4x4xbf16>
// BF16: %[[G2:.+]] = carve.gather %{{.+}}, %{{.+}} {axis = 2 : i64, carve.fold = "gather", carve.round16} : (tensor<2x4x5xf32>
// BF16-NOT: carve.cast %[[G2]]
// BF16: return

func.func @forward(%x: tensor<2x3x4x4xf32> {carve.input = "x"},
                   %w1: tensor<4x3x3x3xf32> {carve.param = "w1", carve.trainable},
                   %w2: tensor<4x4x3x3xf32> {carve.param = "w2", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %h = carve.conv2d %x, %w1 {dilations = array<i64: 1, 1>, group = 1 : i64, pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>} : (tensor<2x3x4x4xf32>, tensor<4x3x3x3xf32>) -> tensor<2x4x4x4xf32> loc("/conv1/Conv")
  %p = carve.max_pool2d %h {kernel = array<i64: 2, 2>, strides = array<i64: 2, 2>, pads = array<i64: 0, 0, 0, 0>} : tensor<2x4x4x4xf32> -> tensor<2x4x2x2xf32> loc("/pool/MaxPool")
  %y = carve.conv2d %p, %w2 {dilations = array<i64: 1, 1>, group = 1 : i64, pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>} : (tensor<2x4x2x2xf32>, tensor<4x4x3x3xf32>) -> tensor<2x4x2x2xf32> loc("/conv2/Conv")
  %l = carve.reduce_sum %y {axes = array<i64: 0, 1, 2, 3>, keep_dims = false} : tensor<2x4x2x2xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
