// Tests carve-check-overrides: a rules file's annotation override that
// matches an op of @train_step (by op name, or by a node-name glob, backward
// ops included) passes and changes nothing; one that matches nothing is an
// error naming the entry; no rules file checks nothing.
// RUN: rm -rf %t && mkdir -p %t
// RUN: echo '{"ops": [{"match": "carve.matmul", "annotation": "m k^, k^ n -> m n"}, {"match": "/fc/*", "annotation": "m k^, k^ n -> m n"}]}' > %t/match.json
// RUN: echo '{"ops": [{"match": "carve.matmul", "annotation": "m k^, k^ n -> m n"}, {"match": "/nowhere/*", "annotation": "m k^, k^ n -> m n"}]}' > %t/nothing.json
// RUN: carve-opt %s --carve-autodiff --carve-check-overrides="rules=%t/match.json" | FileCheck %s
// RUN: carve-opt %s --carve-autodiff --carve-check-overrides | FileCheck %s
// RUN: not carve-opt %s --carve-autodiff --carve-check-overrides="rules=%t/nothing.json" 2>&1 | FileCheck %s --check-prefix=NOTHING
// RUN: not carve-opt %s --carve-check-overrides="rules=%t/missing.json" 2>&1 | FileCheck %s --check-prefix=MISSING

// CHECK-LABEL: func.func @train_step(
// CHECK: carve.matmul
// CHECK-NOT: dist.annotation

// NOTHING: error: {{.*}}nothing.json: ops[1]: "match": '/nowhere/*' matches no op of the model
// MISSING: error: {{.*}}missing.json

func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %w: tensor<8x8xf32> {carve.param = "w", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %h = carve.matmul %x, %w : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/fc/MatMul")
  %s = carve.reduce_sum %h {axes = array<i64: 0, 1>, keep_dims = false} : tensor<4x8xf32> -> tensor<f32> loc("/loss")
  return %s : tensor<f32>
}
