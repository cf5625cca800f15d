// Tests carve-concat-slice-grads: a tree of adds over slice gradients that
// tile their input along one axis (a split's gradient, as autodiff writes
// it) becomes one carve.concat of the parts' gradients in slice order;
// parts with a gap, parts along two axes, a slice gradient read outside the
// tree and an add with an attribute are left alone.
// RUN: carve-opt %s -carve-concat-slice-grads | FileCheck %s

// CHECK-LABEL: func.func @train_step(
// CHECK-SAME: %[[Q:[^:]+]]: tensor<2x4x8xf32>
// CHECK-SAME: %[[K:[^:]+]]: tensor<2x4x8xf32>
// CHECK-SAME: %[[V:[^:]+]]: tensor<2x4x8xf32>
// CHECK-NEXT: %[[CAT:.+]] = carve.concat %[[Q]], %[[K]], %[[V]] {axis = 2 : i64} : (tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x24xf32>
// CHECK-NOT: carve.slice_grad
// CHECK: %[[G1:.+]] = carve.slice_grad %[[Q]] {{.*}}starts = array<i64: 0, 0, 0>
// CHECK: %[[G2:.+]] = carve.slice_grad %[[K]] {{.*}}starts = array<i64: 0, 0, 16>
// CHECK: carve.add %[[G1]], %[[G2]]
// CHECK: carve.slice_grad %[[Q]] {{.*}}starts = array<i64: 0, 0, 0>
// CHECK: carve.slice_grad %{{.*}} {{.*}}starts = array<i64: 0, 4, 0>
// CHECK: carve.add
// CHECK: %[[G5:.+]] = carve.slice_grad %[[Q]] {{.*}}starts = array<i64: 0, 0, 0>
// CHECK: carve.add %[[G5]], %{{.*}} {carve.fusion_group = 0 : i64}
// CHECK: %[[R1:.+]] = carve.slice_grad %[[Q]]
// CHECK: %[[R2:.+]] = carve.slice_grad %[[K]]
// CHECK: carve.add %[[R1]], %[[R2]]
// CHECK: return %[[CAT]]

func.func @train_step(%dq: tensor<2x4x8xf32> {carve.input = "dq"},
                      %dk: tensor<2x4x8xf32> {carve.input = "dk"},
                      %dv: tensor<2x4x8xf32> {carve.input = "dv"},
                      %dh: tensor<2x4x16xf32> {carve.input = "dh"})
    -> (tensor<2x4x24xf32>, tensor<2x4x24xf32>, tensor<2x8x16xf32>, tensor<2x4x16xf32>,
        tensor<2x4x16xf32>, tensor<2x4x16xf32>) {
  // q, k, v of a QKV split, added as autodiff adds them (v last).
  %a = carve.slice_grad %dv {starts = array<i64: 0, 0, 16>, ends = array<i64: 2, 4, 24>, steps = array<i64: 1, 1, 1>} : tensor<2x4x8xf32> -> tensor<2x4x24xf32>
  %b = carve.slice_grad %dk {starts = array<i64: 0, 0, 8>, ends = array<i64: 2, 4, 16>, steps = array<i64: 1, 1, 1>} : tensor<2x4x8xf32> -> tensor<2x4x24xf32>
  %ab = carve.add %a, %b : (tensor<2x4x24xf32>, tensor<2x4x24xf32>) -> tensor<2x4x24xf32>
  %c = carve.slice_grad %dq {starts = array<i64: 0, 0, 0>, ends = array<i64: 2, 4, 8>, steps = array<i64: 1, 1, 1>} : tensor<2x4x8xf32> -> tensor<2x4x24xf32>
  %abc = carve.add %ab, %c : (tensor<2x4x24xf32>, tensor<2x4x24xf32>) -> tensor<2x4x24xf32>
  // A gap: [0, 8) and [16, 24) leave [8, 16) zero.
  %g1 = carve.slice_grad %dq {starts = array<i64: 0, 0, 0>, ends = array<i64: 2, 4, 8>, steps = array<i64: 1, 1, 1>} : tensor<2x4x8xf32> -> tensor<2x4x24xf32>
  %g2 = carve.slice_grad %dk {starts = array<i64: 0, 0, 16>, ends = array<i64: 2, 4, 24>, steps = array<i64: 1, 1, 1>} : tensor<2x4x8xf32> -> tensor<2x4x24xf32>
  %gap = carve.add %g1, %g2 : (tensor<2x4x24xf32>, tensor<2x4x24xf32>) -> tensor<2x4x24xf32>
  // Parts along two axes.
  %h1 = carve.slice_grad %dq {starts = array<i64: 0, 0, 0>, ends = array<i64: 2, 4, 8>, steps = array<i64: 1, 1, 1>} : tensor<2x4x8xf32> -> tensor<2x8x16xf32>
  %h2 = carve.slice_grad %dk {starts = array<i64: 0, 4, 0>, ends = array<i64: 2, 8, 8>, steps = array<i64: 1, 1, 1>} : tensor<2x4x8xf32> -> tensor<2x8x16xf32>
  %two = carve.add %h1, %h2 : (tensor<2x8x16xf32>, tensor<2x8x16xf32>) -> tensor<2x8x16xf32>
  // An add in a fusion group.
  %f1 = carve.slice_grad %dq {starts = array<i64: 0, 0, 0>, ends = array<i64: 2, 4, 8>, steps = array<i64: 1, 1, 1>} : tensor<2x4x8xf32> -> tensor<2x4x16xf32>
  %f2 = carve.slice_grad %dk {starts = array<i64: 0, 0, 8>, ends = array<i64: 2, 4, 16>, steps = array<i64: 1, 1, 1>} : tensor<2x4x8xf32> -> tensor<2x4x16xf32>
  %fa = carve.add %f1, %f2 {carve.fusion_group = 0 : i64} : (tensor<2x4x16xf32>, tensor<2x4x16xf32>) -> tensor<2x4x16xf32>
  // A slice gradient read outside the tree.
  %r1 = carve.slice_grad %dq {starts = array<i64: 0, 0, 0>, ends = array<i64: 2, 4, 8>, steps = array<i64: 1, 1, 1>} : tensor<2x4x8xf32> -> tensor<2x4x16xf32>
  %r2 = carve.slice_grad %dk {starts = array<i64: 0, 0, 8>, ends = array<i64: 2, 4, 16>, steps = array<i64: 1, 1, 1>} : tensor<2x4x8xf32> -> tensor<2x4x16xf32>
  %ra = carve.add %r1, %r2 : (tensor<2x4x16xf32>, tensor<2x4x16xf32>) -> tensor<2x4x16xf32>
  return %abc, %gap, %two, %fa, %ra, %r1 : tensor<2x4x24xf32>, tensor<2x4x24xf32>, tensor<2x8x16xf32>, tensor<2x4x16xf32>, tensor<2x4x16xf32>, tensor<2x4x16xf32>
}
