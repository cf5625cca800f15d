// A fused projection cut into three sections (GPT's c_attn followed by
// q, k, v slices): the default rules split the weight per section
// (S(1 x 3): each rank holds its piece of every section) so that each slice
// keeps its split with no communication; the slices take the same sections of
// each rank's piece.
// RUN: carve-opt %s --carve-set-plan="tp=2" --carve-partition | FileCheck %s

// CHECK-LABEL: func.func @train_step
// CHECK-SAME: %arg1: tensor<6x12xf32> {carve.param = "w", carve.trainable, dist.layout = {dp = #dist.sbp<R>, tp = #dist.sbp<S 1 x 3>}}
// CHECK: %[[QKV:.*]] = carve.matmul %arg0, %arg1 {dist.annotation = "a b+, b+ c -> a c", dist.choice = "tp: c x 3", dist.layout = [#dist.sbp<S 1 x 3>]} : (tensor<4x6xf32>, tensor<6x12xf32>) -> tensor<4x12xf32>
// CHECK: carve.slice %[[QKV]] {dist.annotation = "a (3 b) -> a b", dist.choice = "tp: b", dist.layout = [#dist.sbp<S 1>], ends = array<i64: 4, 4>, starts = array<i64: 0, 0>
// CHECK: carve.slice %[[QKV]] {{.*}}ends = array<i64: 4, 8>, starts = array<i64: 0, 4>
// CHECK: carve.slice %[[QKV]] {{.*}}ends = array<i64: 4, 12>, starts = array<i64: 0, 8>
// CHECK-NOT: dist.all_to_all
// CHECK-NOT: dist.local_split
// CHECK-COUNT-3: dist.all_gather {{.*}}dim = 1 : i64
// CHECK: return
func.func @train_step(%x: tensor<4x6xf32> {carve.input = "x"},
                      %w: tensor<6x24xf32> {carve.param = "w", carve.trainable})
    -> (tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>) {
  %qkv = carve.matmul %x, %w : (tensor<4x6xf32>, tensor<6x24xf32>) -> tensor<4x24xf32> loc("qkv")
  %q = carve.slice %qkv {starts = array<i64: 0, 0>, ends = array<i64: 4, 8>, steps = array<i64: 1, 1>} : tensor<4x24xf32> -> tensor<4x8xf32>
  %k = carve.slice %qkv {starts = array<i64: 0, 8>, ends = array<i64: 4, 16>, steps = array<i64: 1, 1>} : tensor<4x24xf32> -> tensor<4x8xf32>
  %v = carve.slice %qkv {starts = array<i64: 0, 16>, ends = array<i64: 4, 24>, steps = array<i64: 1, 1>} : tensor<4x24xf32> -> tensor<4x8xf32>
  return %q, %k, %v : tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>
}
