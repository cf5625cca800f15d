// Tests carve-select-kernels' refusals: an op no entry of the plan's target
// implements is an error naming the op, its model node and the target.
// RUN: carve-opt %s -split-input-file -verify-diagnostics -pass-pipeline='builtin.module(carve-set-plan{target=cuda}, carve-select-kernels)'

// An f64 add runs on the CPU target; the CUDA target's Add takes f32 and int64.
func.func @train_step(%a: tensor<4xf64>, %b: tensor<4xf64>) -> tensor<4xf64> {
  // expected-error @+1 {{'carve.add': the CUDA target has no Add kernel for this element type (f32, and int64 but for Pow)}}
  %c = carve.add %a, %b : (tensor<4xf64>, tensor<4xf64>) -> tensor<4xf64>
  return %c : tensor<4xf64>
}

// -----

// A 16-bit cast other than to or from f32.
func.func @train_step(%a: tensor<4xbf16>) -> tensor<4xf16> {
  // expected-error @+1 {{16-bit casts are between f32 and bf16 or f16 only}}
  %c = carve.cast %a : tensor<4xbf16> -> tensor<4xf16>
  return %c : tensor<4xf16>
}
