// Tests carve-fold-views' "accumulate" mark (CUDA target): an add of a layer
// or RMS norm gradient's input gradient, read by the add alone, and a tensor
// defined before the gradient (the residual branch's gradient) is marked
// carve.fold = "accumulate"; carve-select-kernels then makes the add no call
// and runs the gradient as layer_norm_grad_add / rms_norm_grad_add, under
// bf16 their 16-bit forms writing the add's copy (the cast right after the
// add: no call, carve.copy_by_writer). Not marked: a residual defined after
// the gradient, an input gradient with another reader, an add rounded as
// written, an add that broadcasts; nothing on the CPU target.
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda}, carve-fold-views)' | FileCheck %s
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda}, carve-fold-views, carve-select-kernels)' | FileCheck %s --check-prefix=F32
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda precision=bf16}, carve-fold-views, carve-select-kernels)' | FileCheck %s --check-prefix=BF16
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cpu}, carve-fold-views)' | FileCheck %s --check-prefix=CPU

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[DX:.+]], %{{.+}}, %{{.+}} = carve.layer_norm_grad %arg0, %arg1 scale %arg2
// CHECK: carve.add %arg3, %[[DX]] {carve.fold = "accumulate"}
// CHECK: %[[RX:.+]], %{{.+}} = carve.rms_norm_grad %arg0, %arg1 scale %arg2
// CHECK: carve.add %[[RX]], %arg3 {carve.fold = "accumulate"}
// CHECK: %[[LX:.+]], %{{.+}}, %{{.+}} = carve.layer_norm_grad %arg0, %arg1 scale %arg2
// CHECK: %[[LATE:.+]] = carve.exp %arg3
// CHECK-NEXT: carve.add %[[LATE]], %[[LX]] :
// CHECK: %[[TX:.+]], %{{.+}}, %{{.+}} = carve.layer_norm_grad %arg0, %arg1 scale %arg2
// CHECK-NEXT: carve.add %arg3, %[[TX]] :
// CHECK-NEXT: carve.mul %[[TX]], %arg3
// CHECK: %[[UX:.+]], %{{.+}}, %{{.+}} = carve.layer_norm_grad %arg0, %arg1 scale %arg2
// CHECK-NEXT: carve.add %arg3, %[[UX]] {carve.round16}
// CHECK: %[[BX:.+]], %{{.+}}, %{{.+}} = carve.layer_norm_grad %arg0, %arg1 scale %arg2
// CHECK-NEXT: carve.add %arg4, %[[BX]] :
// CHECK: return

// F32-LABEL: func.func @train_step(
// F32: carve.layer_norm_grad %arg0, %arg1 scale %arg2 {axis = 2 : i64, carve.kernel = "layer_norm_grad_add"
// F32-NEXT: carve.add %arg3, %{{.+}} {carve.fold = "accumulate", carve.kernel = "none"}
// F32-NEXT: carve.cast %{{.+}} {carve.kernel = "toBf16"}
// F32-NEXT: carve.rms_norm_grad %arg0, %arg1 scale %arg2 {axis = 2 : i64, carve.kernel = "rms_norm_grad_add"
// F32-NEXT: carve.add %{{.+}}, %arg3 {carve.fold = "accumulate", carve.kernel = "none"}
// F32-NEXT: carve.layer_norm_grad %arg0, %arg1 scale %arg2 {axis = 2 : i64, carve.kernel = "layer_norm_grad"
// F32: return

// BF16-LABEL: func.func @train_step(
// BF16: carve.layer_norm_grad %arg0, %arg1 scale %arg2 {axis = 2 : i64, carve.kernel = "layer_norm_grad_add16", carve.read16 = array<i1: false, false, false>
// BF16-NEXT: %[[SUM:.+]] = carve.add %arg3, %{{.+}} {carve.fold = "accumulate", carve.kernel = "none"}
// BF16-NEXT: carve.cast %[[SUM]] {carve.copy_by_writer, carve.kernel = "none"}
// BF16-NEXT: carve.rms_norm_grad %arg0, %arg1 scale %arg2 {axis = 2 : i64, carve.kernel = "rms_norm_grad_add"
// BF16-NEXT: carve.add %{{.+}}, %arg3 {carve.fold = "accumulate", carve.kernel = "none"}
// BF16: return

// CPU-LABEL: func.func @train_step(
// CPU-NOT: accumulate
// CPU-NOT: norm_grad_add
// CPU: return

func.func @train_step(%x: tensor<2x4x8xf32> {carve.input = "x"},
                      %dy: tensor<2x4x8xf32> {carve.input = "dy"},
                      %g: tensor<8xf32> {carve.input = "g"},
                      %res: tensor<2x4x8xf32> {carve.input = "res"},
                      %row: tensor<8xf32> {carve.input = "row"})
    -> (tensor<2x4x8xbf16>, tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<2x4x8xf32>,
        tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<2x4x8xf32>) {
  // The residual an argument, the input gradient its first reader's second
  // operand; the sum's 16-bit copy right after it.
  %dx, %dg, %db = carve.layer_norm_grad %x, %dy scale %g {axis = 2 : i64, epsilon = 9.99999974E-6 : f32} : (tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<8xf32>) -> (tensor<2x4x8xf32>, tensor<8xf32>, tensor<8xf32>)
  %s = carve.add %res, %dx : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
  %s16 = carve.cast %s : tensor<2x4x8xf32> -> tensor<2x4x8xbf16>
  // RMS, the input gradient the first operand.
  %rx, %rg = carve.rms_norm_grad %x, %dy scale %g {axis = 2 : i64, epsilon = 9.99999997E-7 : f32} : (tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<8xf32>) -> (tensor<2x4x8xf32>, tensor<8xf32>)
  %r = carve.add %rx, %res : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
  // The other operand computed after the gradient: not marked.
  %lx, %lg, %lb = carve.layer_norm_grad %x, %dy scale %g {axis = 2 : i64, epsilon = 9.99999974E-6 : f32} : (tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<8xf32>) -> (tensor<2x4x8xf32>, tensor<8xf32>, tensor<8xf32>)
  %late = carve.exp %res : tensor<2x4x8xf32>
  %l = carve.add %late, %lx : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
  // The input gradient read by a mul too: not marked.
  %tx, %tg, %tb = carve.layer_norm_grad %x, %dy scale %g {axis = 2 : i64, epsilon = 9.99999974E-6 : f32} : (tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<8xf32>) -> (tensor<2x4x8xf32>, tensor<8xf32>, tensor<8xf32>)
  %t = carve.add %res, %tx : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
  %tm = carve.mul %tx, %res : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
  // The add rounded as written: not marked.
  %ux, %ug, %ub = carve.layer_norm_grad %x, %dy scale %g {axis = 2 : i64, epsilon = 9.99999974E-6 : f32} : (tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<8xf32>) -> (tensor<2x4x8xf32>, tensor<8xf32>, tensor<8xf32>)
  %u = carve.add %res, %ux {carve.round16} : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
  // A broadcast row: not marked.
  %bx, %bg, %bb = carve.layer_norm_grad %x, %dy scale %g {axis = 2 : i64, epsilon = 9.99999974E-6 : f32} : (tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<8xf32>) -> (tensor<2x4x8xf32>, tensor<8xf32>, tensor<8xf32>)
  %b = carve.add %row, %bx : (tensor<8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
  return %s16, %r, %l, %t, %tm, %u, %b : tensor<2x4x8xbf16>, tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<2x4x8xf32>
}
