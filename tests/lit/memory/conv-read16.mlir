// Tests that a bf16 CUDA program's cuDNN convolutions read their operands'
// 16-bit tensors (carve.read16: the weights' copies, the saved activation's
// copy, and dy's copy carve-round-operands16 makes for the two gradients that
// read it) and that carve-plan-memory keeps each such tensor alive until its
// last reader: no op between dy's 16-bit copy and the weight gradient that
// reads it last, nor the weight gradient itself, gets the copy's memory
// (before the rule, the weight gradient's output was placed over dy's copy).
// The convolutions compute their results in 16 bits (carve.round16) and
// write the 16-bit copies their readers read (carve.copy_by_writer): the
// forward's first result, read by the ReLU's gradient as its copy, and the
// weight gradients, written into the 16-bit gradients directly, with no f32
// value in memory (no carve.arena_offset).
// RUN: carve-opt %s --carve-set-plan="dp=1 target=cuda precision=bf16" --carve-lower-convolutions --carve-autodiff --carve-round-activations --carve-concat-slice-grads --carve-fuse-elementwise --carve-fold-transposes --carve-pack-activations --carve-store-params16 --carve-store-grads16 --carve-round-operands16 --carve-data-parallel --carve-fold-views --carve-plan-memory --carve-select-kernels | FileCheck %s

// CHECK-LABEL: func.func @train_step(
// CHECK: carve.conv2d %{{.+}} {{{.*}}carve.kernel = "conv2d", carve.read16 = array<i1: false, true>, carve.round16
// CHECK-NEXT: carve.cast %{{.+}} {{{.*}}carve.copy_by_writer, carve.kernel = "none"} : tensor<2x8x8x8xf32> -> tensor<2x8x8x8xbf16>
// CHECK: carve.conv2d %{{.+}} {{{.*}}carve.kernel = "conv2d", carve.read16 = array<i1: true, true>
// CHECK: %[[DY:.+]] = carve.unary_grad
// CHECK-NEXT: carve.cast %[[DY]] {carve.arena_offset = array<i64: [[OFF:[0-9]+]]>{{.*}}} : tensor<2x8x8x8xf32> -> tensor<2x8x8x8xbf16>
// CHECK-NOT: carve.arena_offset = array<i64: [[OFF]]>
// CHECK: carve.conv2d_grad_input %{{.+}} {{{.*}}carve.kernel = "conv2d_grad_input", carve.read16 = array<i1: true, true>
// CHECK-NOT: carve.arena_offset = array<i64: [[OFF]]>
// CHECK: = carve.conv2d_grad_weight
// CHECK-NOT: carve.arena_offset = array<i64: [[OFF]]>
// CHECK: carve.kernel = "conv2d_grad_weight", carve.read16 = array<i1: true, true>
// CHECK-NEXT: carve.cast %{{.+}} {carve.copy_by_writer, carve.kernel = "none"} : tensor<8x8x3x3xf32> -> tensor<8x8x3x3xbf16>
// CHECK: = carve.conv2d_grad_weight %arg0, %{{[0-9]+}} {carve.kernel = "conv2d_grad_weight"
// CHECK-NEXT: carve.cast %{{.+}} {carve.copy_by_writer, carve.kernel = "none"} : tensor<8x3x3x3xf32> -> tensor<8x3x3x3xbf16>
// CHECK: return

func.func @forward(%x: tensor<2x3x8x8xf32> {carve.input = "x"},
                   %w1: tensor<8x3x3x3xf32> {carve.param = "conv1.weight", carve.trainable},
                   %w2: tensor<8x8x3x3xf32> {carve.param = "conv2.weight", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %c1 = carve.conv2d %x, %w1 {dilations = array<i64: 1, 1>, group = 1 : i64, pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>} : (tensor<2x3x8x8xf32>, tensor<8x3x3x3xf32>) -> tensor<2x8x8x8xf32> loc("/conv1/Conv")
  %r = carve.relu %c1 : tensor<2x8x8x8xf32> loc("/relu/Relu")
  %c2 = carve.conv2d %r, %w2 {dilations = array<i64: 1, 1>, group = 1 : i64, pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>} : (tensor<2x8x8x8xf32>, tensor<8x8x3x3xf32>) -> tensor<2x8x8x8xf32> loc("/conv2/Conv")
  %t = carve.tanh %c2 : tensor<2x8x8x8xf32> loc("/tanh/Tanh")
  %l = carve.reduce_sum %t {axes = array<i64: 0, 1, 2, 3>, keep_dims = false} : tensor<2x8x8x8xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
