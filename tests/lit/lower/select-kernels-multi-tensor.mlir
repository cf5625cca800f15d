// Tests carve-select-kernels' rule 6 on the step's tail: on the CUDA target
// every carve.adamw runs as `adamwMulti` (one launch over every parameter)
// (every carve.sgd as `sgdMulti`) and carve.grad_norm as `sumSquaresMulti`;
// on the CPU target the tail carries no carve.kernel (its printer reads it).
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=1 target=cuda" --carve-data-parallel --carve-plan-memory --carve-optimizer --carve-select-kernels | FileCheck %s --check-prefix=ADAM
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=1 target=cuda optimizer-state=1" --carve-data-parallel --carve-plan-memory --carve-optimizer="kind=sgd momentum=0.9" --carve-select-kernels | FileCheck %s --check-prefix=SGD
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=1" --carve-data-parallel --carve-plan-memory --carve-optimizer --carve-select-kernels | FileCheck %s --check-prefix=CPU

// ADAM-LABEL: func.func @train_step(
// ADAM: carve.grad_norm {{.*}}{carve.kernel = "sumSquaresMulti"
// ADAM-COUNT-2: carve.adamw {{.*}}carve.kernel = "adamwMulti"
// ADAM: return

// SGD-LABEL: func.func @train_step(
// SGD: carve.grad_norm {{.*}}{carve.kernel = "sumSquaresMulti"
// SGD-NOT: carve.kernel = "adamwMulti"
// SGD-COUNT-2: carve.sgd {{.*}}carve.kernel = "sgdMulti"
// SGD: return

// CPU-LABEL: func.func @train_step(
// CPU-NOT: Multi
// CPU: return

func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %w1: tensor<8x8xf32> {carve.param = "fc1.weight", carve.trainable},
                   %b: tensor<8xf32> {carve.param = "fc1.bias", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %h = carve.matmul %x, %w1 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/fc1/MatMul")
  %hb = carve.add %h, %b : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32> loc("/fc1/Add")
  %l = carve.reduce_sum %hb {axes = array<i64: 0, 1>, keep_dims = false} : tensor<4x8xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
