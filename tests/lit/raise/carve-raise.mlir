// Tests each carve-raise pattern on the exact chain PyTorch exports, and that
// near-misses are left alone.
// RUN: carve-opt %s -split-input-file -pass-pipeline='builtin.module(func.func(carve-raise))' | FileCheck %s

// CHECK-LABEL: func.func @silu
// CHECK-SAME: (%[[X:.+]]: tensor<4x8xf32>)
// CHECK-NEXT: %[[S:.+]] = carve.silu %[[X]]
// CHECK-NEXT: return %[[S]]
func.func @silu(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %s = carve.sigmoid %x : tensor<4x8xf32>
  %y = carve.mul %x, %s : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  return %y : tensor<4x8xf32>
}

// -----

// Tests that sigmoid(x) * y with y != x is not SiLU.
// CHECK-LABEL: func.func @not_silu
// CHECK: carve.sigmoid
// CHECK-NOT: carve.silu
func.func @not_silu(%x: tensor<4x8xf32>, %z: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %s = carve.sigmoid %x : tensor<4x8xf32>
  %y = carve.mul %z, %s : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  return %y : tensor<4x8xf32>
}

// -----

// x * (erf(x / sqrt 2) + 1) * 0.5, as F.gelu exports before opset 20.
// CHECK-LABEL: func.func @gelu_erf
// CHECK-SAME: (%[[X:.+]]: tensor<4x8xf32>)
// CHECK-NEXT: %[[G:.+]] = carve.gelu %[[X]] : tensor<4x8xf32>
// CHECK-NEXT: return %[[G]]
func.func @gelu_erf(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %sqrt2 = carve.constant dense<1.41421354> : tensor<f32>
  %one = carve.constant dense<1.0> : tensor<f32>
  %half = carve.constant dense<5.0e-01> : tensor<f32>
  %d = carve.div %x, %sqrt2 : (tensor<4x8xf32>, tensor<f32>) -> tensor<4x8xf32>
  %e = carve.erf %d : tensor<4x8xf32>
  %a = carve.add %e, %one : (tensor<4x8xf32>, tensor<f32>) -> tensor<4x8xf32>
  %m = carve.mul %x, %a : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %y = carve.mul %m, %half : (tensor<4x8xf32>, tensor<f32>) -> tensor<4x8xf32>
  return %y : tensor<4x8xf32>
}

// -----

// Tests that a wrong constant (0.6 instead of 0.5) is not GELU.
// CHECK-LABEL: func.func @not_gelu
// CHECK-NOT: carve.gelu
func.func @not_gelu(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %sqrt2 = carve.constant dense<1.41421354> : tensor<f32>
  %one = carve.constant dense<1.0> : tensor<f32>
  %c = carve.constant dense<6.0e-01> : tensor<f32>
  %d = carve.div %x, %sqrt2 : (tensor<4x8xf32>, tensor<f32>) -> tensor<4x8xf32>
  %e = carve.erf %d : tensor<4x8xf32>
  %a = carve.add %e, %one : (tensor<4x8xf32>, tensor<f32>) -> tensor<4x8xf32>
  %m = carve.mul %x, %a : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %y = carve.mul %m, %c : (tensor<4x8xf32>, tensor<f32>) -> tensor<4x8xf32>
  return %y : tensor<4x8xf32>
}

// -----

// 0.5 * (x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x * x * x)))).
// CHECK-LABEL: func.func @gelu_tanh
// CHECK: carve.gelu %{{.*}} {approximate = "tanh"}
// CHECK-NOT: carve.tanh
func.func @gelu_tanh(%x: tensor<8xf32>) -> tensor<8xf32> {
  %beta = carve.constant dense<0.797884583> : tensor<f32>
  %kappa = carve.constant dense<4.471500e-02> : tensor<f32>
  %one = carve.constant dense<1.0> : tensor<f32>
  %half = carve.constant dense<5.0e-01> : tensor<f32>
  %xx = carve.mul %x, %x : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
  %x3 = carve.mul %x, %xx : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
  %k = carve.mul %kappa, %x3 : (tensor<f32>, tensor<8xf32>) -> tensor<8xf32>
  %s = carve.add %x, %k : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
  %i = carve.mul %beta, %s : (tensor<f32>, tensor<8xf32>) -> tensor<8xf32>
  %t = carve.tanh %i : tensor<8xf32>
  %a = carve.add %one, %t : (tensor<f32>, tensor<8xf32>) -> tensor<8xf32>
  %m = carve.mul %x, %a : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
  %y = carve.mul %half, %m : (tensor<f32>, tensor<8xf32>) -> tensor<8xf32>
  return %y : tensor<8xf32>
}

// -----

// LayerNorm as exported before opset 17, then weight and bias.
// CHECK-LABEL: func.func @layer_norm
// CHECK-SAME: (%[[X:.+]]: tensor<4x16x32xf32>, %[[G:.+]]: tensor<32xf32>, %[[B:.+]]: tensor<32xf32>)
// CHECK-NEXT: %[[LN:.+]] = carve.layer_norm %[[X]] scale %[[G]] bias %[[B]] {axis = 2 : i64, epsilon = 9.99999974E-6 : f32}
// CHECK-NEXT: return %[[LN]]
func.func @layer_norm(%x: tensor<4x16x32xf32>, %g: tensor<32xf32>, %b: tensor<32xf32>) -> tensor<4x16x32xf32> {
  %two = carve.constant dense<2.0> : tensor<f32>
  %eps = carve.constant dense<9.99999974E-6> : tensor<f32>
  %mean = carve.reduce_mean %x {axes = array<i64: 2>} : tensor<4x16x32xf32> -> tensor<4x16x1xf32>
  %c = carve.sub %x, %mean : (tensor<4x16x32xf32>, tensor<4x16x1xf32>) -> tensor<4x16x32xf32>
  %sq = carve.pow %c, %two : (tensor<4x16x32xf32>, tensor<f32>) -> tensor<4x16x32xf32>
  %var = carve.reduce_mean %sq {axes = array<i64: 2>} : tensor<4x16x32xf32> -> tensor<4x16x1xf32>
  %ve = carve.add %var, %eps : (tensor<4x16x1xf32>, tensor<f32>) -> tensor<4x16x1xf32>
  %sd = carve.sqrt %ve : tensor<4x16x1xf32>
  %n = carve.div %c, %sd : (tensor<4x16x32xf32>, tensor<4x16x1xf32>) -> tensor<4x16x32xf32>
  %s = carve.mul %n, %g : (tensor<4x16x32xf32>, tensor<32xf32>) -> tensor<4x16x32xf32>
  %y = carve.add %s, %b : (tensor<4x16x32xf32>, tensor<32xf32>) -> tensor<4x16x32xf32>
  return %y : tensor<4x16x32xf32>
}

// -----

// Tests that a normalization over a leading axis is left alone.
// CHECK-LABEL: func.func @not_layer_norm
// CHECK-NOT: carve.layer_norm
func.func @not_layer_norm(%x: tensor<4x32xf32>) -> tensor<4x32xf32> {
  %two = carve.constant dense<2.0> : tensor<f32>
  %eps = carve.constant dense<9.99999974E-6> : tensor<f32>
  %mean = carve.reduce_mean %x {axes = array<i64: 0>} : tensor<4x32xf32> -> tensor<1x32xf32>
  %c = carve.sub %x, %mean : (tensor<4x32xf32>, tensor<1x32xf32>) -> tensor<4x32xf32>
  %sq = carve.pow %c, %two : (tensor<4x32xf32>, tensor<f32>) -> tensor<4x32xf32>
  %var = carve.reduce_mean %sq {axes = array<i64: 0>} : tensor<4x32xf32> -> tensor<1x32xf32>
  %ve = carve.add %var, %eps : (tensor<1x32xf32>, tensor<f32>) -> tensor<1x32xf32>
  %sd = carve.sqrt %ve : tensor<1x32xf32>
  %n = carve.div %c, %sd : (tensor<4x32xf32>, tensor<1x32xf32>) -> tensor<4x32xf32>
  return %n : tensor<4x32xf32>
}

// -----

// Llama's RMSNorm: weight * (x * (1 / sqrt(mean(x^2) + eps))).
// CHECK-LABEL: func.func @rms_norm
// CHECK-SAME: (%[[X:.+]]: tensor<4x16x32xf32>, %[[W:.+]]: tensor<32xf32>)
// CHECK-NEXT: %[[R:.+]] = carve.rms_norm %[[X]] scale %[[W]] {axis = 2 : i64, epsilon = 9.99999997E-7 : f32}
// CHECK-NEXT: return %[[R]]
func.func @rms_norm(%x: tensor<4x16x32xf32>, %w: tensor<32xf32>) -> tensor<4x16x32xf32> {
  %two = carve.constant dense<2.0> : tensor<f32>
  %eps = carve.constant dense<9.99999997E-7> : tensor<f32>
  %one = carve.constant dense<1.0> : tensor<1xf32>
  %sq = carve.pow %x, %two : (tensor<4x16x32xf32>, tensor<f32>) -> tensor<4x16x32xf32>
  %m = carve.reduce_mean %sq {axes = array<i64: 2>} : tensor<4x16x32xf32> -> tensor<4x16x1xf32>
  %a = carve.add %m, %eps : (tensor<4x16x1xf32>, tensor<f32>) -> tensor<4x16x1xf32>
  %s = carve.sqrt %a : tensor<4x16x1xf32>
  %r = carve.div %one, %s : (tensor<1xf32>, tensor<4x16x1xf32>) -> tensor<4x16x1xf32>
  %n = carve.mul %x, %r : (tensor<4x16x32xf32>, tensor<4x16x1xf32>) -> tensor<4x16x32xf32>
  %y = carve.mul %w, %n : (tensor<32xf32>, tensor<4x16x32xf32>) -> tensor<4x16x32xf32>
  return %y : tensor<4x16x32xf32>
}

// -----

// Causal attention: softmax(where(future, -inf, q k^T * 0.5)) v.
// CHECK-LABEL: func.func @causal_attention
// CHECK-SAME: (%[[Q:.+]]: tensor<2x3x4xf32>, %[[K:.+]]: tensor<2x3x4xf32>, %[[V:.+]]: tensor<2x3x4xf32>)
// CHECK-NEXT: %[[O:.+]] = carve.attention %[[Q]], %[[K]], %[[V]] {causal = true, scale = 5.000000e-01 : f32}
// CHECK-NEXT: return %[[O]]
func.func @causal_attention(%q: tensor<2x3x4xf32>, %k: tensor<2x3x4xf32>, %v: tensor<2x3x4xf32>) -> tensor<2x3x4xf32> {
  %future = carve.constant dense<[[false, true, true], [false, false, true], [false, false, false]]> : tensor<3x3xi1>
  %ninf = carve.constant dense<0xFF800000> : tensor<f32>
  %c = carve.constant dense<5.0e-01> : tensor<f32>
  %kt = carve.transpose %k {perm = array<i64: 0, 2, 1>} : tensor<2x3x4xf32> -> tensor<2x4x3xf32>
  %s = carve.matmul %q, %kt : (tensor<2x3x4xf32>, tensor<2x4x3xf32>) -> tensor<2x3x3xf32>
  %ss = carve.mul %s, %c : (tensor<2x3x3xf32>, tensor<f32>) -> tensor<2x3x3xf32>
  %m = carve.where %future, %ninf, %ss : (tensor<3x3xi1>, tensor<f32>, tensor<2x3x3xf32>) -> tensor<2x3x3xf32>
  %p = carve.softmax %m {axis = 2 : i64} : tensor<2x3x3xf32>
  %o = carve.matmul %p, %v : (tensor<2x3x3xf32>, tensor<2x3x4xf32>) -> tensor<2x3x4xf32>
  return %o : tensor<2x3x4xf32>
}

// -----

// Tests that a mask that is not causal (here: the diagonal is masked too) stays.
// CHECK-LABEL: func.func @not_causal
// CHECK-NOT: carve.attention
func.func @not_causal(%q: tensor<2x3x4xf32>, %kt: tensor<2x4x3xf32>, %v: tensor<2x3x4xf32>) -> tensor<2x3x4xf32> {
  %future = carve.constant dense<[[true, true, true], [false, true, true], [false, false, true]]> : tensor<3x3xi1>
  %ninf = carve.constant dense<0xFF800000> : tensor<f32>
  %s = carve.matmul %q, %kt : (tensor<2x3x4xf32>, tensor<2x4x3xf32>) -> tensor<2x3x3xf32>
  %m = carve.where %future, %ninf, %s : (tensor<3x3xi1>, tensor<f32>, tensor<2x3x3xf32>) -> tensor<2x3x3xf32>
  %p = carve.softmax %m {axis = 2 : i64} : tensor<2x3x3xf32>
  %o = carve.matmul %p, %v : (tensor<2x3x3xf32>, tensor<2x3x4xf32>) -> tensor<2x3x4xf32>
  return %o : tensor<2x3x4xf32>
}

// -----

// BERT: scores / sqrt(d) + additive padding mask.
// CHECK-LABEL: func.func @masked_attention
// CHECK-SAME: (%[[Q:.+]]: tensor<2x2x5x8xf32>, %[[KT:.+]]: tensor<2x2x8x5xf32>, %[[V:.+]]: tensor<2x2x5x8xf32>, %[[M:.+]]: tensor<2x1x1x5xf32>)
// CHECK: %[[K:.+]] = carve.transpose %[[KT]] {perm = array<i64: 0, 1, 3, 2>}
// CHECK: carve.attention %[[Q]], %[[K]], %[[V]] mask %[[M]] {scale = 0.353553385 : f32}
func.func @masked_attention(%q: tensor<2x2x5x8xf32>, %kt: tensor<2x2x8x5xf32>, %v: tensor<2x2x5x8xf32>, %mask: tensor<2x1x1x5xf32>) -> tensor<2x2x5x8xf32> {
  %c = carve.constant dense<2.82842708> : tensor<f32>
  %s = carve.matmul %q, %kt : (tensor<2x2x5x8xf32>, tensor<2x2x8x5xf32>) -> tensor<2x2x5x5xf32>
  %ss = carve.div %s, %c : (tensor<2x2x5x5xf32>, tensor<f32>) -> tensor<2x2x5x5xf32>
  %sm = carve.add %ss, %mask : (tensor<2x2x5x5xf32>, tensor<2x1x1x5xf32>) -> tensor<2x2x5x5xf32>
  %p = carve.softmax %sm {axis = 3 : i64} : tensor<2x2x5x5xf32>
  %o = carve.matmul %p, %v : (tensor<2x2x5x5xf32>, tensor<2x2x5x8xf32>) -> tensor<2x2x5x8xf32>
  return %o : tensor<2x2x5x8xf32>
}

// -----

// Tests that the mask may come first and be a product itself.
// CHECK-LABEL: func.func @mask_first
// CHECK: carve.attention {{.*}} mask
func.func @mask_first(%q: tensor<2x5x8xf32>, %kt: tensor<2x8x5xf32>, %v: tensor<2x5x8xf32>, %m: tensor<2x1x5xf32>) -> tensor<2x5x8xf32> {
  %big = carve.constant dense<-1.000000e+04> : tensor<f32>
  %c = carve.constant dense<2.82842708> : tensor<f32>
  %mask = carve.mul %m, %big : (tensor<2x1x5xf32>, tensor<f32>) -> tensor<2x1x5xf32>
  %s = carve.matmul %q, %kt : (tensor<2x5x8xf32>, tensor<2x8x5xf32>) -> tensor<2x5x5xf32>
  %ss = carve.div %s, %c : (tensor<2x5x5xf32>, tensor<f32>) -> tensor<2x5x5xf32>
  %sm = carve.add %mask, %ss : (tensor<2x1x5xf32>, tensor<2x5x5xf32>) -> tensor<2x5x5xf32>
  %p = carve.softmax %sm {axis = 2 : i64} : tensor<2x5x5xf32>
  %o = carve.matmul %p, %v : (tensor<2x5x5xf32>, tensor<2x5x8xf32>) -> tensor<2x5x8xf32>
  return %o : tensor<2x5x8xf32>
}

// -----

// Hugging Face's additive causal mask: a constant of 0 on and below the
// diagonal and finfo(float32).min above it is the causal flag (the same
// softmax exactly), and so is -inf; the constant is gone.
// CHECK-LABEL: func.func @additive_causal
// CHECK-SAME: (%[[Q:.+]]: tensor<2x3x4xf32>, %[[KT:.+]]: tensor<2x4x3xf32>, %[[V:.+]]: tensor<2x3x4xf32>)
// CHECK-NOT: carve.constant
// CHECK: %[[K:.+]] = carve.transpose %[[KT]]
// CHECK-NEXT: carve.attention %[[Q]], %[[K]], %[[V]] {causal = true, scale = 5.000000e-01 : f32}
// CHECK-NEXT: %[[K2:.+]] = carve.transpose %[[KT]]
// CHECK-NEXT: carve.attention %[[Q]], %[[K2]], %[[V]] {causal = true, scale = 1.000000e+00 : f32}
func.func @additive_causal(%q: tensor<2x3x4xf32>, %kt: tensor<2x4x3xf32>, %v: tensor<2x3x4xf32>) -> (tensor<2x3x4xf32>, tensor<2x3x4xf32>) {
  %mask = carve.constant dense<[[[0.0, -3.40282347E+38, -3.40282347E+38], [0.0, 0.0, -3.40282347E+38], [0.0, 0.0, 0.0]]]> : tensor<1x3x3xf32>
  %ninf = carve.constant dense<[[0.0, 0xFF800000, 0xFF800000], [0.0, 0.0, 0xFF800000], [0.0, 0.0, 0.0]]> : tensor<3x3xf32>
  %c = carve.constant dense<5.0e-01> : tensor<f32>
  %s = carve.matmul %q, %kt : (tensor<2x3x4xf32>, tensor<2x4x3xf32>) -> tensor<2x3x3xf32>
  %ss = carve.mul %s, %c : (tensor<2x3x3xf32>, tensor<f32>) -> tensor<2x3x3xf32>
  %sm = carve.add %ss, %mask : (tensor<2x3x3xf32>, tensor<1x3x3xf32>) -> tensor<2x3x3xf32>
  %p = carve.softmax %sm {axis = 2 : i64} : tensor<2x3x3xf32>
  %o = carve.matmul %p, %v : (tensor<2x3x3xf32>, tensor<2x3x4xf32>) -> tensor<2x3x4xf32>
  %s2 = carve.matmul %q, %kt : (tensor<2x3x4xf32>, tensor<2x4x3xf32>) -> tensor<2x3x3xf32>
  %sm2 = carve.add %ninf, %s2 : (tensor<3x3xf32>, tensor<2x3x3xf32>) -> tensor<2x3x3xf32>
  %p2 = carve.softmax %sm2 {axis = 2 : i64} : tensor<2x3x3xf32>
  %o2 = carve.matmul %p2, %v : (tensor<2x3x3xf32>, tensor<2x3x4xf32>) -> tensor<2x3x4xf32>
  return %o, %o2 : tensor<2x3x4xf32>, tensor<2x3x4xf32>
}

// -----

// Tests that near misses keep their mask: -10000 above the diagonal (an
// exponential that is 0 only for moderate scores), and a masked diagonal.
// CHECK-LABEL: func.func @additive_not_causal
// CHECK: carve.attention {{.*}} mask
// CHECK-NOT: causal = true
// CHECK: carve.attention {{.*}} mask
// CHECK-NOT: causal = true
func.func @additive_not_causal(%q: tensor<2x3x4xf32>, %kt: tensor<2x4x3xf32>, %v: tensor<2x3x4xf32>) -> (tensor<2x3x4xf32>, tensor<2x3x4xf32>) {
  %m1 = carve.constant dense<[[0.0, -1.0E+4, -1.0E+4], [0.0, 0.0, -1.0E+4], [0.0, 0.0, 0.0]]> : tensor<3x3xf32>
  %m2 = carve.constant dense<[[0xFF800000, 0xFF800000, 0xFF800000], [0.0, 0xFF800000, 0xFF800000], [0.0, 0.0, 0xFF800000]]> : tensor<3x3xf32>
  %s = carve.matmul %q, %kt : (tensor<2x3x4xf32>, tensor<2x4x3xf32>) -> tensor<2x3x3xf32>
  %sm = carve.add %s, %m1 : (tensor<2x3x3xf32>, tensor<3x3xf32>) -> tensor<2x3x3xf32>
  %p = carve.softmax %sm {axis = 2 : i64} : tensor<2x3x3xf32>
  %o = carve.matmul %p, %v : (tensor<2x3x3xf32>, tensor<2x3x4xf32>) -> tensor<2x3x4xf32>
  %s2 = carve.matmul %q, %kt : (tensor<2x3x4xf32>, tensor<2x4x3xf32>) -> tensor<2x3x3xf32>
  %sm2 = carve.add %s2, %m2 : (tensor<2x3x3xf32>, tensor<3x3xf32>) -> tensor<2x3x3xf32>
  %p2 = carve.softmax %sm2 {axis = 2 : i64} : tensor<2x3x3xf32>
  %o2 = carve.matmul %p2, %v : (tensor<2x3x3xf32>, tensor<2x3x4xf32>) -> tensor<2x3x4xf32>
  return %o, %o2 : tensor<2x3x4xf32>, tensor<2x3x4xf32>
}

// -----

// Rotary position embedding, as Hugging Face's apply_rotary_pos_emb exports
// it: q * cos + cat(-q[..., 4:], q[..., :4]) * sin, and with every operand
// order swapped (k).
// CHECK-LABEL: func.func @rotary
// CHECK-SAME: (%[[Q:.+]]: tensor<2x3x5x8xf32>, %[[COS:.+]]: tensor<5x8xf32>, %[[SIN:.+]]: tensor<5x8xf32>)
// CHECK-NEXT: %[[RQ:.+]] = carve.rotary %[[Q]], %[[COS]], %[[SIN]] : (tensor<2x3x5x8xf32>, tensor<5x8xf32>, tensor<5x8xf32>) -> tensor<2x3x5x8xf32>
// CHECK-NEXT: %[[RK:.+]] = carve.rotary %[[Q]], %[[COS]], %[[SIN]]
// CHECK-NEXT: return %[[RQ]], %[[RK]]
func.func @rotary(%q: tensor<2x3x5x8xf32>, %cos: tensor<5x8xf32>, %sin: tensor<5x8xf32>) -> (tensor<2x3x5x8xf32>, tensor<2x3x5x8xf32>) {
  %c = carve.mul %q, %cos : (tensor<2x3x5x8xf32>, tensor<5x8xf32>) -> tensor<2x3x5x8xf32>
  %x1 = carve.slice %q {starts = array<i64: 0, 0, 0, 0>, ends = array<i64: 2, 3, 5, 4>, steps = array<i64: 1, 1, 1, 1>} : tensor<2x3x5x8xf32> -> tensor<2x3x5x4xf32>
  %x2 = carve.slice %q {starts = array<i64: 0, 0, 0, 4>, ends = array<i64: 2, 3, 5, 8>, steps = array<i64: 1, 1, 1, 1>} : tensor<2x3x5x8xf32> -> tensor<2x3x5x4xf32>
  %n = carve.neg %x2 : tensor<2x3x5x4xf32>
  %r = carve.concat %n, %x1 {axis = 3 : i64} : (tensor<2x3x5x4xf32>, tensor<2x3x5x4xf32>) -> tensor<2x3x5x8xf32>
  %s = carve.mul %r, %sin : (tensor<2x3x5x8xf32>, tensor<5x8xf32>) -> tensor<2x3x5x8xf32>
  %y = carve.add %c, %s : (tensor<2x3x5x8xf32>, tensor<2x3x5x8xf32>) -> tensor<2x3x5x8xf32>
  %c2 = carve.mul %cos, %q : (tensor<5x8xf32>, tensor<2x3x5x8xf32>) -> tensor<2x3x5x8xf32>
  %y1 = carve.slice %q {starts = array<i64: 0, 0, 0, 0>, ends = array<i64: 2, 3, 5, 4>, steps = array<i64: 1, 1, 1, 1>} : tensor<2x3x5x8xf32> -> tensor<2x3x5x4xf32>
  %y2 = carve.slice %q {starts = array<i64: 0, 0, 0, 4>, ends = array<i64: 2, 3, 5, 8>, steps = array<i64: 1, 1, 1, 1>} : tensor<2x3x5x8xf32> -> tensor<2x3x5x4xf32>
  %m = carve.neg %y2 : tensor<2x3x5x4xf32>
  %r2 = carve.concat %m, %y1 {axis = 3 : i64} : (tensor<2x3x5x4xf32>, tensor<2x3x5x4xf32>) -> tensor<2x3x5x8xf32>
  %s2 = carve.mul %sin, %r2 : (tensor<5x8xf32>, tensor<2x3x5x8xf32>) -> tensor<2x3x5x8xf32>
  %z = carve.add %s2, %c2 : (tensor<2x3x5x8xf32>, tensor<2x3x5x8xf32>) -> tensor<2x3x5x8xf32>
  return %y, %z : tensor<2x3x5x8xf32>, tensor<2x3x5x8xf32>
}

// -----

// Tests that near misses stay: the halves swapped the other way (cat(x1, -x2)),
// and tables that depend on a trained value (they would need a gradient).
// CHECK-LABEL: func.func @not_rotary
// CHECK-NOT: carve.rotary
// CHECK: return
func.func @not_rotary(%q: tensor<2x5x8xf32>, %cos: tensor<5x8xf32>, %sin: tensor<5x8xf32>, %w: tensor<5x8xf32> {carve.trainable}) -> (tensor<2x5x8xf32>, tensor<2x5x8xf32>) {
  %c = carve.mul %q, %cos : (tensor<2x5x8xf32>, tensor<5x8xf32>) -> tensor<2x5x8xf32>
  %x1 = carve.slice %q {starts = array<i64: 0, 0, 0>, ends = array<i64: 2, 5, 4>, steps = array<i64: 1, 1, 1>} : tensor<2x5x8xf32> -> tensor<2x5x4xf32>
  %x2 = carve.slice %q {starts = array<i64: 0, 0, 4>, ends = array<i64: 2, 5, 8>, steps = array<i64: 1, 1, 1>} : tensor<2x5x8xf32> -> tensor<2x5x4xf32>
  %n = carve.neg %x2 : tensor<2x5x4xf32>
  %r = carve.concat %x1, %n {axis = 2 : i64} : (tensor<2x5x4xf32>, tensor<2x5x4xf32>) -> tensor<2x5x8xf32>
  %s = carve.mul %r, %sin : (tensor<2x5x8xf32>, tensor<5x8xf32>) -> tensor<2x5x8xf32>
  %y = carve.add %c, %s : (tensor<2x5x8xf32>, tensor<2x5x8xf32>) -> tensor<2x5x8xf32>
  %tc = carve.mul %cos, %w : (tensor<5x8xf32>, tensor<5x8xf32>) -> tensor<5x8xf32>
  %c2 = carve.mul %q, %tc : (tensor<2x5x8xf32>, tensor<5x8xf32>) -> tensor<2x5x8xf32>
  %y1 = carve.slice %q {starts = array<i64: 0, 0, 0>, ends = array<i64: 2, 5, 4>, steps = array<i64: 1, 1, 1>} : tensor<2x5x8xf32> -> tensor<2x5x4xf32>
  %y2 = carve.slice %q {starts = array<i64: 0, 0, 4>, ends = array<i64: 2, 5, 8>, steps = array<i64: 1, 1, 1>} : tensor<2x5x8xf32> -> tensor<2x5x4xf32>
  %m = carve.neg %y2 : tensor<2x5x4xf32>
  %r2 = carve.concat %m, %y1 {axis = 2 : i64} : (tensor<2x5x4xf32>, tensor<2x5x4xf32>) -> tensor<2x5x8xf32>
  %s2 = carve.mul %r2, %sin : (tensor<2x5x8xf32>, tensor<5x8xf32>) -> tensor<2x5x8xf32>
  %z = carve.add %c2, %s2 : (tensor<2x5x8xf32>, tensor<2x5x8xf32>) -> tensor<2x5x8xf32>
  return %y, %z : tensor<2x5x8xf32>, tensor<2x5x8xf32>
}
