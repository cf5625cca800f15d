// Tests that every carve op parses, verifies and prints back identically.
// RUN: carve-opt %s | carve-opt | FileCheck %s

// CHECK-LABEL: func.func @elementwise
func.func @elementwise(%a: tensor<4x8xf32>, %b: tensor<8xf32>, %m: tensor<4x8xi1>) -> tensor<4x8xf32> {
  // CHECK: carve.add %{{.*}}, %{{.*}} : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32>
  %0 = carve.add %a, %b : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32>
  %1 = carve.sub %0, %b : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32>
  %2 = carve.mul %1, %a : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %3 = carve.div %2, %a : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %4 = carve.pow %3, %b : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32>
  %5 = carve.maximum %4, %a : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %6 = carve.minimum %5, %a : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  // CHECK: carve.less {{.*}} -> tensor<4x8xi1>
  %c = carve.less %6, %a : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xi1>
  %e = carve.equal %6, %a : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xi1>
  %g = carve.greater %6, %a : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xi1>
  %and = carve.and %c, %e : (tensor<4x8xi1>, tensor<4x8xi1>) -> tensor<4x8xi1>
  %or = carve.or %and, %g : (tensor<4x8xi1>, tensor<4x8xi1>) -> tensor<4x8xi1>
  %not = carve.not %or : tensor<4x8xi1>
  // CHECK: carve.where
  %7 = carve.where %not, %6, %a : (tensor<4x8xi1>, tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %8 = carve.neg %7 : tensor<4x8xf32>
  %9 = carve.abs %8 : tensor<4x8xf32>
  %10 = carve.exp %9 : tensor<4x8xf32>
  %11 = carve.log %10 : tensor<4x8xf32>
  %12 = carve.sqrt %11 : tensor<4x8xf32>
  %13 = carve.rsqrt %12 : tensor<4x8xf32>
  %14 = carve.reciprocal %13 : tensor<4x8xf32>
  %15 = carve.tanh %14 : tensor<4x8xf32>
  %16 = carve.erf %15 : tensor<4x8xf32>
  %17 = carve.sigmoid %16 : tensor<4x8xf32>
  %18 = carve.relu %17 : tensor<4x8xf32>
  %19 = carve.sin %18 : tensor<4x8xf32>
  %20 = carve.cos %19 : tensor<4x8xf32>
  %21 = carve.silu %20 : tensor<4x8xf32>
  // CHECK: carve.gelu %{{.*}} {approximate = "tanh"} : tensor<4x8xf32>
  %22 = carve.gelu %21 {approximate = "tanh"} : tensor<4x8xf32>
  // CHECK: carve.cast %{{.*}} : tensor<4x8xf32> -> tensor<4x8xbf16>
  %23 = carve.cast %22 : tensor<4x8xf32> -> tensor<4x8xbf16>
  %24 = carve.cast %23 : tensor<4x8xbf16> -> tensor<4x8xf32>
  return %24 : tensor<4x8xf32>
}

// CHECK-LABEL: func.func @transformer_pieces
func.func @transformer_pieces(%ids: tensor<4x16xi64>, %wte: tensor<64x32xf32>, %g: tensor<32xf32>,
                              %w: tensor<32x96xf32>, %mask: tensor<4x1x1x16xf32>) -> tensor<f32> {
  %eps = carve.constant dense<1.000000e-05> : tensor<f32>
  // CHECK: carve.gather {{.*}} {axis = 0 : i64} : (tensor<64x32xf32>, tensor<4x16xi64>) -> tensor<4x16x32xf32>
  %x = carve.gather %wte, %ids {axis = 0 : i64} : (tensor<64x32xf32>, tensor<4x16xi64>) -> tensor<4x16x32xf32>
  // CHECK: carve.layer_norm %{{.*}} scale %{{.*}} bias %{{.*}} {axis = 2 : i64
  %ln = carve.layer_norm %x scale %g bias %g {axis = 2 : i64, epsilon = 1.000000e-05 : f32} : (tensor<4x16x32xf32>, tensor<32xf32>, tensor<32xf32>) -> tensor<4x16x32xf32>
  // CHECK: carve.rms_norm %{{.*}} scale %{{.*}} {axis = 2 : i64
  %rms = carve.rms_norm %ln scale %g {axis = 2 : i64, epsilon = 1.000000e-06 : f32} : (tensor<4x16x32xf32>, tensor<32xf32>) -> tensor<4x16x32xf32>
  %nobias = carve.layer_norm %rms {axis = 1 : i64, epsilon = 1.000000e-05 : f32} : (tensor<4x16x32xf32>) -> tensor<4x16x32xf32>
  %qkv = carve.matmul %nobias, %w : (tensor<4x16x32xf32>, tensor<32x96xf32>) -> tensor<4x16x96xf32>
  // CHECK: carve.slice %{{.*}} {ends = array<i64: 4, 16, 32>, starts = array<i64: 0, 0, 0>, steps = array<i64: 1, 1, 1>}
  %q = carve.slice %qkv {starts = array<i64: 0, 0, 0>, ends = array<i64: 4, 16, 32>, steps = array<i64: 1, 1, 1>} : tensor<4x16x96xf32> -> tensor<4x16x32xf32>
  %q4 = carve.reshape %q : tensor<4x16x32xf32> -> tensor<4x16x2x16xf32>
  %qh = carve.transpose %q4 {perm = array<i64: 0, 2, 1, 3>} : tensor<4x16x2x16xf32> -> tensor<4x2x16x16xf32>
  // CHECK: carve.attention %{{.*}}, %{{.*}}, %{{.*}} mask %{{.*}} {causal = true, scale = 2.500000e-01 : f32}
  %o = carve.attention %qh, %qh, %qh mask %mask {causal = true, scale = 0.25 : f32} : (tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>, tensor<4x1x1x16xf32>) -> tensor<4x2x16x16xf32>
  %sm = carve.softmax %o {axis = 3 : i64} : tensor<4x2x16x16xf32>
  %lsm = carve.log_softmax %sm {axis = 3 : i64} : tensor<4x2x16x16xf32>
  %cat = carve.concat %lsm, %sm {axis = 3 : i64} : (tensor<4x2x16x16xf32>, tensor<4x2x16x16xf32>) -> tensor<4x2x16x32xf32>
  // CHECK: carve.reduce_sum %{{.*}} {axes = array<i64: 1>, keep_dims = false}
  %sum = carve.reduce_sum %cat {axes = array<i64: 1>, keep_dims = false} : tensor<4x2x16x32xf32> -> tensor<4x16x32xf32>
  %mean = carve.reduce_mean %sum {axes = array<i64: 2>} : tensor<4x16x32xf32> -> tensor<4x16x1xf32>
  %max = carve.reduce_max %mean {axes = array<i64: 2>} : tensor<4x16x1xf32> -> tensor<4x16x1xf32>
  %ex = carve.expand %max : tensor<4x16x1xf32> -> tensor<4x16x64xf32>
  %logits = carve.reshape %ex : tensor<4x16x64xf32> -> tensor<64x64xf32>
  %t = carve.reshape %ids : tensor<4x16xi64> -> tensor<64xi64>
  // CHECK: carve.cross_entropy %{{.*}}, %{{.*}} {ignore_index = -100 : i64} : (tensor<64x64xf32>, tensor<64xi64>) -> tensor<f32>
  %loss = carve.cross_entropy %logits, %t {ignore_index = -100 : i64} : (tensor<64x64xf32>, tensor<64xi64>) -> tensor<f32>
  %r = carve.add %loss, %eps : (tensor<f32>, tensor<f32>) -> tensor<f32>
  return %r : tensor<f32>
}

// CHECK-LABEL: func.func @convnet
func.func @convnet(%x: tensor<4x3x32x32xf32>, %w: tensor<8x3x7x7xf32>, %c: tensor<8xf32>) -> (tensor<4x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>) {
  // CHECK: carve.conv2d %{{.*}}, %{{.*}} {dilations = array<i64: 1, 1>, group = 1 : i64, pads = array<i64: 3, 3, 3, 3>, strides = array<i64: 2, 2>}
  %y = carve.conv2d %x, %w {strides = array<i64: 2, 2>, pads = array<i64: 3, 3, 3, 3>, dilations = array<i64: 1, 1>, group = 1 : i64} : (tensor<4x3x32x32xf32>, tensor<8x3x7x7xf32>) -> tensor<4x8x16x16xf32>
  // CHECK: carve.batch_norm
  %bn, %m, %v = carve.batch_norm %y, %c, %c, %c, %c {epsilon = 1.000000e-05 : f32, momentum = 0.899999976 : f32, training = true} : (tensor<4x8x16x16xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) -> (tensor<4x8x16x16xf32>, tensor<8xf32>, tensor<8xf32>)
  // CHECK: carve.max_pool2d
  %p = carve.max_pool2d %bn {kernel = array<i64: 3, 3>, strides = array<i64: 2, 2>, pads = array<i64: 1, 1, 1, 1>} : tensor<4x8x16x16xf32> -> tensor<4x8x8x8xf32>
  return %p, %m, %v : tensor<4x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>
}
