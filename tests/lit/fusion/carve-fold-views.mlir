// Tests carve-fold-views (CUDA target): a slice whose every reader, through
// reshapes, is a transpose that can read it as a strided view of the
// slice's source (q, k and v split from the QKV projection, reshaped to
// heads and transposed) is marked carve.fold = "view"; carve-select-kernels
// then makes it no call and runs its transposes as transpose_view. A slice
// also read by an add, a slice whose reshape merges dimensions the slice
// made non-contiguous (no strides describe it), a slice with a step and a
// transpose of it whose last dimension is strided (still a view), and a
// slice read by a folded transpose are handled as the rules say. On the CPU
// target nothing is marked.
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda}, carve-fold-views)' | FileCheck %s
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda}, carve-fold-views, carve-select-kernels)' | FileCheck %s --check-prefix=SEL
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cpu}, carve-fold-views, carve-select-kernels)' | FileCheck %s --check-prefix=CPU

// CHECK-LABEL: func.func @train_step(
// CHECK: carve.slice %arg0 {carve.fold = "view", ends = array<i64: 2, 4, 8>
// CHECK: carve.slice %arg0 {carve.fold = "view", ends = array<i64: 2, 4, 16>
// CHECK: carve.slice %arg0 {carve.fold = "view", ends = array<i64: 2, 4, 24>
// CHECK: %[[ADDED:.+]] = carve.slice %arg0 {ends = array<i64: 2, 4, 8>, starts = array<i64: 0, 0, 0>
// CHECK-NEXT: carve.add %[[ADDED]]
// CHECK: %[[MERGED:.+]] = carve.slice %arg0 {ends = array<i64: 2, 4, 8>, starts = array<i64: 0, 0, 0>
// CHECK-NEXT: carve.reshape %[[MERGED]] {{.*}} -> tensor<2x32xf32>
// CHECK: carve.slice %arg0 {carve.fold = "view", ends = array<i64: 2, 4, 24>, starts = array<i64: 0, 0, 1>, steps = array<i64: 1, 1, 2>}
// CHECK: %[[OPERAND:.+]] = carve.slice %arg1 {ends = array<i64: 8, 8>
// CHECK: return

// SEL-LABEL: func.func @train_step(
// SEL-COUNT-3: carve.slice %arg0 {carve.fold = "view", carve.kernel = "none"
// SEL-COUNT-3: carve.transpose %{{.+}} {carve.kernel = "transpose_view", perm = array<i64: 0, 2, 1, 3>}
// SEL: carve.slice %arg0 {carve.kernel = "slice"
// SEL: carve.transpose %{{.+}} {carve.kernel = "transpose", perm = array<i64: 1, 0, 2>}
// SEL: carve.slice %arg0 {carve.kernel = "slice"
// SEL: carve.transpose %{{.+}} {carve.kernel = "transpose", perm = array<i64: 1, 0>}
// SEL: carve.slice %arg0 {carve.fold = "view", carve.kernel = "none"
// SEL: carve.transpose %{{.+}} {carve.kernel = "transpose_view", perm = array<i64: 2, 0, 1>}
// SEL: carve.slice %arg1 {carve.kernel = "slice"
// SEL: return

// CPU-LABEL: func.func @train_step(
// CPU-NOT: carve.fold = "view"
// CPU-NOT: transpose_view
// CPU: return

func.func @train_step(%qkv: tensor<2x4x24xf32> {carve.input = "qkv"},
                      %w: tensor<8x8xf32> {carve.input = "w"},
                      %x: tensor<2x4x8xf32> {carve.input = "x"})
    -> (tensor<2x2x4x4xf32>, tensor<2x2x4x4xf32>, tensor<2x2x4x4xf32>, tensor<2x4x8xf32>,
        tensor<4x2x8xf32>, tensor<32x2xf32>, tensor<12x2x4xf32>, tensor<2x4x8xf32>) {
  // q, k, v: each reshaped to 2 heads of 4 and transposed to [b, h, t, d].
  %q = carve.slice %qkv {starts = array<i64: 0, 0, 0>, ends = array<i64: 2, 4, 8>, steps = array<i64: 1, 1, 1>} : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %k = carve.slice %qkv {starts = array<i64: 0, 0, 8>, ends = array<i64: 2, 4, 16>, steps = array<i64: 1, 1, 1>} : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %v = carve.slice %qkv {starts = array<i64: 0, 0, 16>, ends = array<i64: 2, 4, 24>, steps = array<i64: 1, 1, 1>} : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %qr = carve.reshape %q : tensor<2x4x8xf32> -> tensor<2x4x2x4xf32>
  %kr = carve.reshape %k : tensor<2x4x8xf32> -> tensor<2x4x2x4xf32>
  %vr = carve.reshape %v : tensor<2x4x8xf32> -> tensor<2x4x2x4xf32>
  %qt = carve.transpose %qr {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x2x4xf32> -> tensor<2x2x4x4xf32>
  %kt = carve.transpose %kr {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x2x4xf32> -> tensor<2x2x4x4xf32>
  %vt = carve.transpose %vr {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x2x4xf32> -> tensor<2x2x4x4xf32>
  // Read by an add too: copied.
  %a = carve.slice %qkv {starts = array<i64: 0, 0, 0>, ends = array<i64: 2, 4, 8>, steps = array<i64: 1, 1, 1>} : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %s = carve.add %a, %x : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
  %at = carve.transpose %a {perm = array<i64: 1, 0, 2>} : tensor<2x4x8xf32> -> tensor<4x2x8xf32>
  // Tokens and features merged: not a view of the slice's source.
  %m = carve.slice %qkv {starts = array<i64: 0, 0, 0>, ends = array<i64: 2, 4, 8>, steps = array<i64: 1, 1, 1>} : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %mr = carve.reshape %m : tensor<2x4x8xf32> -> tensor<2x32xf32>
  %mt = carve.transpose %mr {perm = array<i64: 1, 0>} : tensor<2x32xf32> -> tensor<32x2xf32>
  // Every other feature: a view with no contiguous dimension.
  %e = carve.slice %qkv {starts = array<i64: 0, 0, 1>, ends = array<i64: 2, 4, 24>, steps = array<i64: 1, 1, 2>} : tensor<2x4x24xf32> -> tensor<2x4x12xf32>
  %et = carve.transpose %e {perm = array<i64: 2, 0, 1>} : tensor<2x4x12xf32> -> tensor<12x2x4xf32>
  // Read by a matmul (through a folded transpose): copied.
  %o = carve.slice %w {starts = array<i64: 0, 0>, ends = array<i64: 8, 8>, steps = array<i64: 1, 1>} : tensor<8x8xf32> -> tensor<8x8xf32>
  %ot = carve.transpose %o {carve.fold = "operand", perm = array<i64: 1, 0>} : tensor<8x8xf32> -> tensor<8x8xf32>
  %p = carve.matmul %x, %ot : (tensor<2x4x8xf32>, tensor<8x8xf32>) -> tensor<2x4x8xf32>
  return %qt, %kt, %vt, %s, %at, %mt, %et, %p
      : tensor<2x2x4x4xf32>, tensor<2x2x4x4xf32>, tensor<2x2x4x4xf32>, tensor<2x4x8xf32>,
        tensor<4x2x8xf32>, tensor<32x2xf32>, tensor<12x2x4xf32>, tensor<2x4x8xf32>
}
