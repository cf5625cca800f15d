// RUN: carve-opt %s -split-input-file -verify-diagnostics

dist.mesh @mesh {axes = ["dp", "tp"], shape = array<i64: 2, 4>}
func.func @f(%x: tensor<4x8xf32>) -> tensor<4x32xf32> {
  // expected-error @+1 {{refers to axis 'pp', which mesh @mesh does not have}}
  %0 = dist.all_gather %x {mesh = @mesh, axis = "pp", dim = 1 : i64, groups = 1 : i64} : tensor<4x8xf32> -> tensor<4x32xf32>
  return %0 : tensor<4x32xf32>
}

// -----

func.func @f(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  // expected-error @+1 {{refers to mesh @nomesh, which is not defined}}
  %0 = dist.all_reduce %x {mesh = @nomesh, axis = "tp", reduction = "sum"} : tensor<4x8xf32> -> tensor<4x8xf32>
  return %0 : tensor<4x8xf32>
}

// -----

dist.mesh @mesh {axes = ["dp", "tp"], shape = array<i64: 2, 4>}
func.func @f(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  // expected-error @+1 {{reduction must be "sum" or "max", got "mean"}}
  %0 = dist.all_reduce %x {mesh = @mesh, axis = "tp", reduction = "mean"} : tensor<4x8xf32> -> tensor<4x8xf32>
  return %0 : tensor<4x8xf32>
}

// -----

dist.mesh @mesh {axes = ["dp", "tp"], shape = array<i64: 2, 4>}
func.func @f(%x: tensor<4x6xf32>) -> tensor<4x2xf32> {
  // expected-error @+1 {{dimension 1 of 'tensor<4x6xf32>' does not divide among 4 ranks}}
  %0 = dist.local_split %x {mesh = @mesh, axis = "tp", dim = 1 : i64, groups = 1 : i64} : tensor<4x6xf32> -> tensor<4x2xf32>
  return %0 : tensor<4x2xf32>
}

// -----

dist.mesh @mesh {axes = ["dp", "tp"], shape = array<i64: 2, 4>}
func.func @f(%x: tensor<4x8xf32>) -> tensor<4x16xf32> {
  // expected-error @+1 {{does not match 'tensor<4x8xf32>' gathered along dimension 1 over 4 ranks}}
  %0 = dist.all_gather %x {mesh = @mesh, axis = "tp", dim = 1 : i64, groups = 1 : i64} : tensor<4x8xf32> -> tensor<4x16xf32>
  return %0 : tensor<4x16xf32>
}

// -----

// expected-error @+1 {{names axis 'tp' twice}}
dist.mesh @mesh {axes = ["tp", "tp"], shape = array<i64: 2, 4>}

// -----

dist.mesh @mesh {axes = ["dp", "tp"], shape = array<i64: 2, 4>}
func.func @f(%x: tensor<4x8xf32>) {
  // expected-error @+1 {{offset 4 names no other rank on axis 'tp' (size 4)}}
  dist.send %x {mesh = @mesh, axis = "tp", offset = 4 : i64, tag = 0 : i64} : tensor<4x8xf32>
  return
}

// -----

// expected-error @+1 {{layout must be R, S or P, got 'Q'}}
func.func @f(%x: tensor<4x8xf32> {dist.layout = {tp = #dist.sbp<Q>}}) {
  return
}
