// Tests carve-select-kernels' rule 3h (CUDA target, bf16 plans): a 16-bit
// copy right after the op that writes its input (after other such copies),
// where that op is a binary op, a unary gradient, a layer norm, or an f32
// concat or transpose, is written by the op as it writes the value
// (binary16, unary_grad16 and layer_norm16 with carve.read16 all false,
// concat16, transpose16; the copy is `none`, marked carve.copy_by_writer),
// also where the op rounds its value as written (carve.round16: the op
// rounds it, no rule 3d). A copy not right after its writer and a copy of
// another op's result (a forward unary) stay conversions, or rule 3d's
// roundCopyBf16 where that op is rounded. A parameter gradient's sum read
// only by its 16-bit cast (a bias gradient's reduce_sum through its reshape,
// a layer norm gradient's scale and bias gradients) is written in 16 bits
// only (reduce16, layer_norm_grad16); a sum read elsewhere too stays f32. On
// the CPU target nothing changes.
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda precision=bf16}, carve-select-kernels)' | FileCheck %s
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cpu precision=bf16}, carve-select-kernels)' | FileCheck %s --check-prefix=CPU

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[S:.+]] = carve.add %arg0, %arg1 {carve.kernel = "binary16", carve.read16 = array<i1: false, false>}
// CHECK-NEXT: carve.cast %[[S]] {carve.copy_by_writer, carve.kernel = "none"} : tensor<4x8xf32> -> tensor<4x8xbf16>
// CHECK-NEXT: %[[G:.+]] = carve.unary_grad %arg0, %arg1 {carve.kernel = "unary_grad16", carve.read16 = array<i1: false, false>, fn = "gelu"}
// CHECK-NEXT: carve.cast %[[G]] {carve.copy_by_writer, carve.kernel = "none"}
// CHECK-NEXT: %[[M:.+]] = carve.mul %arg0, %arg1 {carve.kernel = "binary"}
// CHECK-NEXT: carve.reduce_sum %[[M]]
// CHECK-NEXT: carve.cast %[[M]] {carve.kernel = "toBf16"}
// CHECK-NEXT: %[[C:.+]] = carve.concat %arg0, %arg1 {axis = 1 : i64, carve.kernel = "concat16"}
// CHECK-NEXT: carve.cast %[[C]] {carve.copy_by_writer, carve.kernel = "none"} : tensor<4x16xf32> -> tensor<4x16xbf16>
// CHECK-NEXT: %[[R:.+]] = carve.sub %arg0, %arg1 {carve.kernel = "binary16", carve.read16 = array<i1: false, false>, carve.round16}
// CHECK-NEXT: carve.cast %[[R]] {carve.copy_by_writer, carve.kernel = "none"}
// CHECK-NEXT: %[[T:.+]] = carve.tanh %arg0 {carve.kernel = "unary"}
// CHECK-NEXT: carve.cast %[[T]] {carve.kernel = "toBf16"}
// CHECK-NEXT: %[[L:.+]] = carve.layer_norm %arg0 {axis = 1 : i64, carve.kernel = "layer_norm16", carve.read16 = array<i1: false>, carve.round16
// CHECK-NEXT: carve.cast %[[L]] {carve.copy_by_writer, carve.kernel = "none"}
// CHECK-NEXT: %[[P:.+]] = carve.transpose %arg0 {carve.kernel = "transpose16", carve.round16, perm = array<i64: 1, 0>}
// CHECK-NEXT: carve.cast %[[P]] {carve.copy_by_writer, carve.kernel = "none"}
// CHECK-NEXT: %[[E:.+]] = carve.exp %arg0 {carve.kernel = "unary", carve.round16, carve.round16_in_copy}
// CHECK-NEXT: carve.cast %[[E]] {carve.kernel = "roundCopyBf16"}
// CHECK-NEXT: %[[DB:.+]] = carve.reduce_sum %arg1 {axes = array<i64: 0>, carve.kernel = "reduce16"}
// CHECK-NEXT: %[[DBR:.+]] = carve.reshape %[[DB]] {carve.kernel = "none"}
// CHECK-NEXT: carve.cast %[[DBR]] {carve.copy_by_writer, carve.kernel = "none"} : tensor<8xf32> -> tensor<8xbf16>
// CHECK-NEXT: %[[DX:.+]], %[[DG:.+]], %[[DBB:.+]] = carve.layer_norm_grad %arg0, %arg1 {axis = 1 : i64, carve.kernel = "layer_norm_grad16", carve.read16 = array<i1: false, false>
// CHECK-NEXT: carve.cast %[[DBB]] {carve.copy_by_writer, carve.kernel = "none"}
// CHECK-NEXT: carve.cast %[[DG]] {carve.copy_by_writer, carve.kernel = "none"}
// CHECK-NEXT: %[[KEPT:.+]] = carve.reduce_sum %arg0 {axes = array<i64: 0>, carve.kernel = "reduce"}
// CHECK-NEXT: carve.cast %[[KEPT]] {carve.kernel = "toBf16"}
// CHECK: return

// CPU-LABEL: func.func @train_step(
// CPU-NOT: copy_by_writer
// CPU-NOT: {{binary16|grad16|concat16|norm16|transpose16|reduce16}}
// CPU: return

func.func @train_step(%a: tensor<4x8xf32> {carve.input = "a"}, %b: tensor<4x8xf32> {carve.input = "b"})
    -> (tensor<4x8xbf16>, tensor<1x8xf32>, tensor<4x8xbf16>, tensor<4x16xbf16>, tensor<4x8xbf16>,
        tensor<4x8xbf16>, tensor<4x8xf32>, tensor<4x16xf32>, tensor<4x8xf32>, tensor<4x8xbf16>,
        tensor<4x8xbf16>, tensor<8x4xbf16>, tensor<4x8xbf16>, tensor<4x8xf32>, tensor<8x4xf32>,
        tensor<4x8xf32>, tensor<8xbf16>, tensor<4x8xf32>, tensor<8xbf16>, tensor<8xbf16>,
        tensor<1x8xf32>, tensor<1x8xbf16>) {
  %s = carve.add %a, %b : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %s16 = carve.cast %s : tensor<4x8xf32> -> tensor<4x8xbf16>
  %g = carve.unary_grad %a, %b {fn = "gelu"} : tensor<4x8xf32>
  %g16 = carve.cast %g : tensor<4x8xf32> -> tensor<4x8xbf16>
  %m = carve.mul %a, %b : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %gs = carve.reduce_sum %m {axes = array<i64: 0>} : tensor<4x8xf32> -> tensor<1x8xf32>
  %m16 = carve.cast %m : tensor<4x8xf32> -> tensor<4x8xbf16>
  %c = carve.concat %a, %b {axis = 1 : i64} : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x16xf32>
  %c16 = carve.cast %c : tensor<4x16xf32> -> tensor<4x16xbf16>
  %r = carve.sub %a, %b {carve.round16} : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %r16 = carve.cast %r : tensor<4x8xf32> -> tensor<4x8xbf16>
  %t = carve.tanh %a : tensor<4x8xf32>
  %t16 = carve.cast %t : tensor<4x8xf32> -> tensor<4x8xbf16>
  %l = carve.layer_norm %a {axis = 1 : i64, epsilon = 1.0E-5 : f32, carve.round16} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  %l16 = carve.cast %l : tensor<4x8xf32> -> tensor<4x8xbf16>
  %p = carve.transpose %a {perm = array<i64: 1, 0>, carve.round16} : tensor<4x8xf32> -> tensor<8x4xf32>
  %p16 = carve.cast %p : tensor<8x4xf32> -> tensor<8x4xbf16>
  %e = carve.exp %a {carve.round16} : tensor<4x8xf32>
  %e16 = carve.cast %e : tensor<4x8xf32> -> tensor<4x8xbf16>
  %db = carve.reduce_sum %b {axes = array<i64: 0>} : tensor<4x8xf32> -> tensor<1x8xf32>
  %dbr = carve.reshape %db : tensor<1x8xf32> -> tensor<8xf32>
  %db16 = carve.cast %dbr : tensor<8xf32> -> tensor<8xbf16>
  %dx, %dg, %dbb = carve.layer_norm_grad %a, %b {axis = 1 : i64, epsilon = 1.0E-5 : f32} : (tensor<4x8xf32>, tensor<4x8xf32>) -> (tensor<4x8xf32>, tensor<8xf32>, tensor<8xf32>)
  %dbb16 = carve.cast %dbb : tensor<8xf32> -> tensor<8xbf16>
  %dg16 = carve.cast %dg : tensor<8xf32> -> tensor<8xbf16>
  %kept = carve.reduce_sum %a {axes = array<i64: 0>} : tensor<4x8xf32> -> tensor<1x8xf32>
  %kept16 = carve.cast %kept : tensor<1x8xf32> -> tensor<1x8xbf16>
  return %s16, %gs, %g16, %c16, %r16, %t16, %s, %c, %g, %m16, %l16, %p16, %e16, %l, %p, %e, %db16, %dx, %dbb16, %dg16, %kept, %kept16 : tensor<4x8xbf16>, tensor<1x8xf32>, tensor<4x8xbf16>, tensor<4x16xbf16>, tensor<4x8xbf16>, tensor<4x8xbf16>, tensor<4x8xf32>, tensor<4x16xf32>, tensor<4x8xf32>, tensor<4x8xbf16>, tensor<4x8xbf16>, tensor<8x4xbf16>, tensor<4x8xbf16>, tensor<4x8xf32>, tensor<8x4xf32>, tensor<4x8xf32>, tensor<8xbf16>, tensor<4x8xf32>, tensor<8xbf16>, tensor<8xbf16>, tensor<1x8xf32>, tensor<1x8xbf16>
}
