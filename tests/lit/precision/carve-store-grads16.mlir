// Tests carve-store-grads16: under a bf16/fp16 plan whose gradients are
// 16-bit, each returned gradient becomes a carve.cast to the format right
// after the op that makes it final, and the function's result types follow;
// carve-plan-memory then gives each gradient slot 2 bytes per element, and
// the tail reads the 16-bit gradients.
//
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16" --carve-store-params16 --carve-store-grads16 --mlir-print-debuginfo --mlir-print-local-scope | FileCheck %s --check-prefix=BF16
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=fp16" --carve-store-params16 --carve-store-grads16 --mlir-print-debuginfo --mlir-print-local-scope | FileCheck %s --check-prefix=F16
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16" --carve-store-params16 --carve-store-grads16 --carve-data-parallel --carve-plan-memory --carve-optimizer | FileCheck %s --check-prefix=TAIL
// Micro-batches accumulating in fp32 (the default) under ZeRO-0: f32 gradients.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16 micro-batches=2" --carve-store-params16 --carve-store-grads16 --mlir-print-debuginfo --mlir-print-local-scope | FileCheck %s --check-prefix=FP32ACC
// ... in 16 bits: cast.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16 micro-batches=2 grad-accumulation=16bit" --carve-store-params16 --carve-store-grads16 --mlir-print-debuginfo --mlir-print-local-scope | FileCheck %s --check-prefix=BF16
// ZeRO-2 with fp32 accumulation: 16-bit gradients (reduce-scattered in 16 bits).
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16 dp=2 zero=2 micro-batches=2" --carve-store-params16 --carve-store-grads16 --mlir-print-debuginfo --mlir-print-local-scope | FileCheck %s --check-prefix=BF16
// fp32: nothing changes.
// RUN: carve-opt %s --carve-autodiff --carve-store-params16 --carve-store-grads16 --mlir-print-debuginfo --mlir-print-local-scope | FileCheck %s --check-prefix=FP32ACC
// 16bit accumulation under fp32 is refused.
// RUN: not carve-opt %s --carve-set-plan="grad-accumulation=16bit" 2>&1 | FileCheck %s --check-prefix=BAD

// BF16-LABEL: func.func @train_step(
// BF16-SAME: -> (tensor<f32> {carve.output = "loss"}, tensor<8x8xbf16> {carve.grad_of = "h.0.w"}, tensor<8xbf16> {carve.grad_of = "h.0.b"})
// The bias's gradient is final after its reduce_sum (and reshape); the cast
// follows it at once.
// BF16: %[[DB:.+]] = carve.reshape %{{.+}} : tensor<1x8xf32> -> tensor<8xf32>
// BF16-NEXT: %[[DB16:.+]] = carve.cast %[[DB]] : tensor<8xf32> -> tensor<8xbf16> loc("gradient of h.0.b (16-bit)")
// BF16: %[[DW:.+]] = carve.matmul
// BF16-NEXT: %[[DW16:.+]] = carve.cast %[[DW]] : tensor<8x8xf32> -> tensor<8x8xbf16> loc("gradient of h.0.w (16-bit)")
// BF16: return %{{.+}}, %[[DW16]], %[[DB16]]

// F16-LABEL: func.func @train_step(
// F16-SAME: tensor<8x8xf16> {carve.grad_of = "h.0.w"}, tensor<8xf16> {carve.grad_of = "h.0.b"}
// F16: carve.cast %{{.+}} : tensor<8x8xf32> -> tensor<8x8xf16>

// The gradient slots take 2 bytes per element (128 + 16, aligned to 64
// bytes: [448, 576) and [576, 640) after the parameters and the frozen
// weight); norm, clipping and the update read them as they are.
// TAIL-LABEL: func.func @train_step(
// TAIL-SAME: grads = array<i64: {{[0-9]+}}, {{[0-9]+}}>, grads_end = [[GE:[0-9]+]] : i64
// TAIL: carve.grad_norm {{.*}} : (tensor<{{8xbf16|8x8xbf16}}>, tensor<{{8xbf16|8x8xbf16}}>) -> f64
// TAIL: carve.adamw %arg{{[0-9]}}, %{{.+}}, %{{.+}} {{.*}} : tensor<{{.+}}xbf16>, tensor<{{.+}}xbf16>

// FP32ACC-LABEL: func.func @train_step(
// FP32ACC-SAME: tensor<8x8xf32> {carve.grad_of = "h.0.w"}
// FP32ACC-NOT: loc("gradient of

// BAD: field 'grad_accumulation' = "16bit" needs precision bf16 or fp16

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
