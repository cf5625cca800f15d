// The dist dialect prints and parses back; its verifiers name what is wrong.
// RUN: carve-opt %s -split-input-file | carve-opt -split-input-file | FileCheck %s

// CHECK: dist.mesh @mesh {axes = ["dp", "tp"], shape = array<i64: 2, 4>}
// CHECK: dist.layout = {dp = #dist.sbp<P sum>, tp = #dist.sbp<S 1 x 3>}
// CHECK: dist.all_reduce %arg0 {axis = "tp", mesh = @mesh, reduction = "sum"} : tensor<4x8xf32> -> tensor<4x8xf32>
// CHECK: dist.all_gather %arg0 {axis = "tp", dim = 1 : i64, groups = 1 : i64, mesh = @mesh} : tensor<4x8xf32> -> tensor<4x32xf32>
// CHECK: dist.reduce_scatter %arg0 {axis = "tp", dim = 1 : i64, groups = 2 : i64, mesh = @mesh, reduction = "max"} : tensor<4x8xf32> -> tensor<4x2xf32>
// CHECK: dist.all_to_all %arg0 {axis = "tp", dst_dim = 1 : i64, dst_groups = 1 : i64, mesh = @mesh, src_dim = 0 : i64, src_groups = 1 : i64} : tensor<4x8xf32> -> tensor<16x2xf32>
// CHECK: dist.local_split %arg0 {axis = "dp", dim = 0 : i64, groups = 1 : i64, mesh = @mesh} : tensor<4x8xf32> -> tensor<2x8xf32>
// CHECK: dist.broadcast %arg0 {axis = "tp", mesh = @mesh, root = 3 : i64} : tensor<4x8xf32> -> tensor<4x8xf32>
// CHECK: dist.send %arg0 {axis = "tp", mesh = @mesh, offset = 1 : i64, tag = 7 : i64} : tensor<4x8xf32>
// CHECK: dist.recv {axis = "tp", mesh = @mesh, offset = -1 : i64, tag = 7 : i64} : tensor<4x8xf32>
module {
  dist.mesh @mesh {axes = ["dp", "tp"], shape = array<i64: 2, 4>}
  func.func @f(%x: tensor<4x8xf32>) -> (tensor<4x8xf32> {dist.layout = {dp = #dist.sbp<P sum>, tp = #dist.sbp<S 1 x 3>}}) {
    %0 = dist.all_reduce %x {mesh = @mesh, axis = "tp", reduction = "sum"} : tensor<4x8xf32> -> tensor<4x8xf32>
    %1 = dist.all_gather %x {mesh = @mesh, axis = "tp", dim = 1 : i64, groups = 1 : i64} : tensor<4x8xf32> -> tensor<4x32xf32>
    %2 = dist.reduce_scatter %x {mesh = @mesh, axis = "tp", dim = 1 : i64, groups = 2 : i64, reduction = "max"} : tensor<4x8xf32> -> tensor<4x2xf32>
    %3 = dist.all_to_all %x {mesh = @mesh, axis = "tp", src_dim = 0 : i64, src_groups = 1 : i64, dst_dim = 1 : i64, dst_groups = 1 : i64} : tensor<4x8xf32> -> tensor<16x2xf32>
    %4 = dist.local_split %x {mesh = @mesh, axis = "dp", dim = 0 : i64, groups = 1 : i64} : tensor<4x8xf32> -> tensor<2x8xf32>
    %5 = dist.broadcast %x {mesh = @mesh, axis = "tp", root = 3 : i64} : tensor<4x8xf32> -> tensor<4x8xf32>
    dist.send %x {mesh = @mesh, axis = "tp", offset = 1 : i64, tag = 7 : i64} : tensor<4x8xf32>
    %6 = dist.recv {mesh = @mesh, axis = "tp", offset = -1 : i64, tag = 7 : i64} : tensor<4x8xf32>
    return %6 : tensor<4x8xf32>
  }
}
