// Tests the folders of carve ops under -canonicalize.
// RUN: carve-opt %s -canonicalize | FileCheck %s

// CHECK-LABEL: func.func @transpose_pair
// CHECK-SAME: (%[[X:.+]]: tensor<4x16x2x8xf32>)
// CHECK-NEXT: %[[T:.+]] = carve.transpose %[[X]] {perm = array<i64: 0, 2, 1, 3>}
// CHECK-NEXT: return %[[T]]
func.func @transpose_pair(%x: tensor<4x16x2x8xf32>) -> tensor<4x2x16x8xf32> {
  %0 = carve.transpose %x {perm = array<i64: 0, 2, 3, 1>} : tensor<4x16x2x8xf32> -> tensor<4x2x8x16xf32>
  %1 = carve.transpose %0 {perm = array<i64: 0, 1, 3, 2>} : tensor<4x2x8x16xf32> -> tensor<4x2x16x8xf32>
  return %1 : tensor<4x2x16x8xf32>
}

// CHECK-LABEL: func.func @transpose_inverse
// CHECK-SAME: (%[[X:.+]]: tensor<3x5xf32>)
// CHECK-NEXT: return %[[X]]
func.func @transpose_inverse(%x: tensor<3x5xf32>) -> tensor<3x5xf32> {
  %0 = carve.transpose %x {perm = array<i64: 1, 0>} : tensor<3x5xf32> -> tensor<5x3xf32>
  %1 = carve.transpose %0 {perm = array<i64: 1, 0>} : tensor<5x3xf32> -> tensor<3x5xf32>
  return %1 : tensor<3x5xf32>
}

// CHECK-LABEL: func.func @reshape_chain
// CHECK-SAME: (%[[X:.+]]: tensor<4x16xf32>)
// CHECK-NEXT: %[[R:.+]] = carve.reshape %[[X]] : tensor<4x16xf32> -> tensor<64xf32>
// CHECK-NEXT: return %[[R]]
func.func @reshape_chain(%x: tensor<4x16xf32>) -> tensor<64xf32> {
  %0 = carve.reshape %x : tensor<4x16xf32> -> tensor<4x4x4xf32>
  %1 = carve.reshape %0 : tensor<4x4x4xf32> -> tensor<64xf32>
  return %1 : tensor<64xf32>
}

// CHECK-LABEL: func.func @dead_ops
// CHECK-NEXT: return
func.func @dead_ops(%x: tensor<4xf32>) -> tensor<4xf32> {
  %0 = carve.exp %x : tensor<4xf32>
  return %x : tensor<4xf32>
}
