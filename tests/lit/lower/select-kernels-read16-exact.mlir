// Tests carve-select-kernels' rule 3g (CUDA target, bf16 plans): a kernel
// that computes in f32 reads an operand whose exact 16-bit tensor exists as
// that tensor, widened in registers. A view of a bf16 parameter or saved
// activation read by a layer norm (input, scale, bias), its gradient (input,
// scale), a unary gradient (input), a binary op, a gather's table or a fused
// chain's member marks carve.read16 (one flag per operand) and runs as the
// `16` entry (a chain's member stays `fused`); a view every reader reads so
// is no call. A value rounded as written (carve.round16) with a 16-bit copy
// before its reader is read as the copy; a value not rounded is not (the
// copy would lose bits), and a view another op reads in f32 (a forward
// unary) stays a conversion. On an fp16 plan (views of bf16 tensors) and on
// the CPU target nothing changes.
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda precision=bf16}, carve-select-kernels)' | FileCheck %s
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda precision=fp16}, carve-select-kernels)' | FileCheck %s --check-prefix=KEEP
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cpu precision=bf16}, carve-select-kernels)' | FileCheck %s --check-prefix=KEEP

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[GV:.+]] = carve.cast %arg1 {carve.kernel = "none"} : tensor<8xbf16> -> tensor<8xf32>
// CHECK: %[[BV:.+]] = carve.cast %arg2 {carve.kernel = "none"} : tensor<8xbf16> -> tensor<8xf32>
// CHECK: carve.layer_norm %arg0 scale %[[GV]] bias %[[BV]] {axis = 1 : i64, carve.kernel = "layer_norm16", carve.read16 = array<i1: false, true, true>
// CHECK: %[[SV:.+]] = carve.cast %arg3 {carve.kernel = "none"} : tensor<4x8xbf16> -> tensor<4x8xf32>
// CHECK: carve.layer_norm_grad %[[SV]], %arg4 scale %[[GV]] {axis = 1 : i64, carve.kernel = "layer_norm_grad16", carve.read16 = array<i1: true, false, true>
// CHECK: %[[HV:.+]] = carve.cast %arg5 {carve.kernel = "none"} : tensor<4x8xbf16> -> tensor<4x8xf32>
// CHECK: carve.unary_grad %[[HV]], %arg4 {carve.kernel = "unary_grad16", carve.read16 = array<i1: true, false>, fn = "gelu"}
// CHECK: carve.add %[[BV]], %arg0 {carve.kernel = "binary16", carve.read16 = array<i1: true, false>}
// CHECK: %[[TV:.+]] = carve.cast %arg6 {carve.kernel = "none"} : tensor<16x8xbf16> -> tensor<16x8xf32>
// CHECK: carve.gather %[[TV]], %arg7 {axis = 0 : i64, carve.kernel = "gather16", carve.read16 = array<i1: true, false>}
// CHECK: %[[R:.+]] = carve.exp %arg0 {carve.kernel = "unary", carve.round16, carve.round16_in_copy}
// CHECK-NEXT: carve.cast %[[R]] {carve.kernel = "roundCopyBf16"} : tensor<4x8xf32> -> tensor<4x8xbf16>
// CHECK-NEXT: carve.mul %[[R]], %arg0 {carve.kernel = "binary16", carve.read16 = array<i1: true, false>}
// CHECK: %[[U:.+]] = carve.tanh %arg0 {carve.kernel = "unary"}
// CHECK-NEXT: carve.cast %[[U]] {carve.kernel = "toBf16"}
// CHECK-NEXT: carve.mul %[[U]], %arg0 {carve.kernel = "binary"}
// CHECK: %[[FV:.+]] = carve.cast %arg8 {carve.kernel = "fromBf16"} : tensor<4x8xbf16> -> tensor<4x8xf32>
// CHECK-NEXT: carve.sin %[[FV]] {carve.kernel = "unary"}
// CHECK-NEXT: carve.sub %[[FV]], %arg0 {carve.kernel = "binary16", carve.read16 = array<i1: true, false>}
// CHECK: %[[CV:.+]] = carve.cast %arg9 {carve.kernel = "none"} : tensor<8xbf16> -> tensor<8xf32>
// CHECK-NEXT: %[[C1:.+]] = carve.add %[[CV]], %arg0 {carve.fusion_group = 0 : i64, carve.kernel = "fused", carve.read16 = array<i1: true, false>}
// CHECK-NEXT: carve.gelu %[[C1]] {carve.fusion_group = 0 : i64, carve.kernel = "fused"}
// CHECK: return

// KEEP-LABEL: func.func @train_step(
// KEEP-NOT: read16
// KEEP-NOT: {{norm16|grad16|binary16|gather16}}
// KEEP: return

func.func @train_step(%x: tensor<4x8xf32> {carve.input = "x"},
                      %g: tensor<8xbf16> {carve.param = "g", carve.trainable},
                      %b: tensor<8xbf16> {carve.param = "b", carve.trainable},
                      %saved: tensor<4x8xbf16> {carve.input = "saved"},
                      %dy: tensor<4x8xf32> {carve.input = "dy"},
                      %pre: tensor<4x8xbf16> {carve.input = "pre"},
                      %wte: tensor<16x8xbf16> {carve.param = "wte", carve.trainable},
                      %ids: tensor<2x3xi64> {carve.input = "ids"},
                      %other: tensor<4x8xbf16> {carve.input = "other"},
                      %c: tensor<8xbf16> {carve.param = "c", carve.trainable})
    -> (tensor<4x8xf32>, tensor<4x8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<4x8xf32>,
        tensor<4x8xf32>, tensor<2x3x8xf32>, tensor<4x8xf32>, tensor<4x8xbf16>, tensor<4x8xf32>,
        tensor<4x8xbf16>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>) {
  %gv = carve.cast %g : tensor<8xbf16> -> tensor<8xf32>
  %bv = carve.cast %b : tensor<8xbf16> -> tensor<8xf32>
  %y = carve.layer_norm %x scale %gv bias %bv {axis = 1 : i64, epsilon = 1.0E-5 : f32} : (tensor<4x8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<4x8xf32>
  %sv = carve.cast %saved : tensor<4x8xbf16> -> tensor<4x8xf32>
  %dx, %dg, %db = carve.layer_norm_grad %sv, %dy scale %gv {axis = 1 : i64, epsilon = 1.0E-5 : f32} : (tensor<4x8xf32>, tensor<4x8xf32>, tensor<8xf32>) -> (tensor<4x8xf32>, tensor<8xf32>, tensor<8xf32>)
  %hv = carve.cast %pre : tensor<4x8xbf16> -> tensor<4x8xf32>
  %dh = carve.unary_grad %hv, %dy {fn = "gelu"} : tensor<4x8xf32>
  %ab = carve.add %bv, %x : (tensor<8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %tv = carve.cast %wte : tensor<16x8xbf16> -> tensor<16x8xf32>
  %e = carve.gather %tv, %ids {axis = 0 : i64} : (tensor<16x8xf32>, tensor<2x3xi64>) -> tensor<2x3x8xf32>
  %r = carve.exp %x {carve.round16} : tensor<4x8xf32>
  %r16 = carve.cast %r : tensor<4x8xf32> -> tensor<4x8xbf16>
  %rm = carve.mul %r, %x : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %u = carve.tanh %x : tensor<4x8xf32>
  %u16 = carve.cast %u : tensor<4x8xf32> -> tensor<4x8xbf16>
  %um = carve.mul %u, %x : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %fv = carve.cast %other : tensor<4x8xbf16> -> tensor<4x8xf32>
  %fs = carve.sin %fv : tensor<4x8xf32>
  %fd = carve.sub %fv, %x : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %cv = carve.cast %c : tensor<8xbf16> -> tensor<8xf32>
  %c1 = carve.add %cv, %x {carve.fusion_group = 0 : i64} : (tensor<8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %c2 = carve.gelu %c1 {carve.fusion_group = 0 : i64} : tensor<4x8xf32>
  return %y, %dx, %dg, %db, %dh, %ab, %e, %rm, %r16, %um, %u16, %fs, %fd, %c2 : tensor<4x8xf32>, tensor<4x8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<2x3x8xf32>, tensor<4x8xf32>, tensor<4x8xbf16>, tensor<4x8xf32>, tensor<4x8xbf16>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>
}
