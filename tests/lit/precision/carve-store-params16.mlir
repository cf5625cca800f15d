// Tests carve-store-params16: under bf16/fp16 each trainable parameter becomes
// the 16-bit copy the step reads (a carve.cast to f32 just before each
// reader), marked carve.master; carve-plan-memory gives it an fp32 master with
// the optimizer state; the optimizer's update takes the copy.
//
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16" --carve-store-params16 | FileCheck %s --check-prefix=BF16
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=fp16" --carve-store-params16 | FileCheck %s --check-prefix=F16
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16 dp=2 zero=1" --carve-store-params16 --carve-data-parallel --carve-plan-memory --carve-optimizer | FileCheck %s --check-prefix=ZERO
// fp32: nothing changes.
// RUN: carve-opt %s --carve-autodiff --carve-store-params16 | FileCheck %s --check-prefix=FP32

// The trainable weight and bias become bf16 arguments marked carve.master;
// the frozen one stays f32. Each reader reads its own cast, placed just
// before it (here only forward reads the weights: their gradients read the
// activations).
// BF16-LABEL: func.func @train_step(
// BF16-SAME: %arg2: tensor<8x8xbf16> {carve.master, carve.param = "h.0.w", carve.trainable}
// BF16-SAME: %arg3: tensor<8xbf16> {carve.master, carve.param = "h.0.b", carve.trainable}
// BF16-SAME: %arg4: tensor<8x8xf32> {carve.param = "h.1.w"}
// BF16: %[[W:.+]] = carve.cast %arg2 : tensor<8x8xbf16> -> tensor<8x8xf32>
// BF16-NEXT: carve.matmul %arg0, %[[W]]
// BF16-NEXT: %[[B:.+]] = carve.cast %arg3 : tensor<8xbf16> -> tensor<8xf32>
// BF16-NEXT: carve.add %{{.+}}, %[[B]]
// BF16-NOT: carve.cast %arg4
// BF16: return

// F16-LABEL: func.func @train_step(
// F16-SAME: %arg2: tensor<8x8xf16> {carve.master
// F16: carve.cast %arg2 : tensor<8x8xf16> -> tensor<8x8xf32>

// ZeRO-1 over dp=2: the copies are whole (gathered in place, 2 bytes per
// element: 128 + 64 bytes, then the frozen f32 weight's 256), the masters
// this rank's chunks after the optimizer state; the update and the gather
// take the copies.
// ZERO-LABEL: func.func @train_step(
// ZERO-SAME: carve.persistent_plan = {begin = 0 : i64, end = {{[0-9]+}} : i64, grads = array<i64: {{.+}}>, grads_end = {{[0-9]+}} : i64, masters = array<i64: 1152, 1216>, params_end = 448 : i64, state_end = 1344 : i64, states = array<i64: 768, 832, 896, 1024>}
// ZERO: carve.adamw %arg2, %{{.+}}, %{{.+}} {{.*}} : tensor<8x8xbf16>, tensor<8x8xf32>
// ZERO: carve.zero_gather {{.*}} : tensor<{{.+}}bf16>, tensor<{{.+}}bf16>

// FP32-NOT: carve.master
// FP32-NOT: bf16

func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %y: tensor<4x8xf32> {carve.input = "y"},
                   %w0: tensor<8x8xf32> {carve.param = "h.0.w", carve.trainable},
                   %b0: tensor<8xf32> {carve.param = "h.0.b", carve.trainable},
                   %w1: tensor<8x8xf32> {carve.param = "h.1.w"})
    -> (tensor<f32> {carve.output = "loss"}) {
  %m0 = carve.matmul %x, %w0 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/h.0/MatMul")
  %c0 = carve.add %m0, %b0 : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32> loc("/h.0/Add")
  %a0 = carve.exp %c0 : tensor<4x8xf32> loc("/h.0/Exp")
  %m1 = carve.matmul %a0, %w1 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/h.1/MatMul")
  %d = carve.mul %m1, %y : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32> loc("/h.1/Mul")
  %l = carve.reduce_sum %d {axes = array<i64: 0, 1>, keep_dims = false} : tensor<4x8xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
