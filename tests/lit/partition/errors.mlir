// Plans the partitioner refuses, each with one message naming the op or field;
// an op's error is a diagnostic at the op (its ONNX node and position).
// RUN: not carve-opt %s --carve-set-plan="tp=2 ops=nothing*=a" --carve-partition 2>&1 | FileCheck %s --check-prefix=NOOP
// RUN: not carve-opt %s --carve-set-plan="tp=3" --carve-partition 2>&1 | FileCheck %s --check-prefix=DIVIDE
// RUN: not carve-opt %s --carve-set-plan="tp=2 ops=mm=z" --carve-partition 2>&1 | FileCheck %s --check-prefix=NONAME
// RUN: not carve-opt %s --carve-set-plan="tp=2 ops=act=b" --carve-partition 2>&1 | FileCheck %s --check-prefix=NEVER
// RUN: not carve-opt %s --carve-set-plan="tp=2 ops=m?=a,?m=b" --carve-partition 2>&1 | FileCheck %s --check-prefix=TIE
// RUN: not carve-opt %s --carve-set-plan="tp=2 ops=m*=a,mm=b" --carve-partition 2>&1 | FileCheck %s --check-prefix=SHADOWED

// NOOP: error: plan: "ops" entry "nothing*" matches no op of the model
// DIVIDE: model.onnx:3:0: error: carve.matmul (node mm): tensor parallelism (tp=3) cannot split this projection's output: tp=3 does not divide dimension 'c' (8)
// NONAME: model.onnx:3:0: error: carve.matmul (node mm): the plan's "ops" entry "mm" splits dimension 'z', which its annotation 'a b+, b+ c -> a c' does not have
// TIE: model.onnx:3:0: error: carve.matmul (node mm): the plan's "ops" entries "m?" and "?m" both match node mm, are equally specific and split it differently; make one of them more specific
// SHADOWED: error: plan: "ops" entry "m*" decides no op: a more specific entry decides every op it matches (e.g. mm, which "mm" decides; of the entries that match a node, the one with the most characters that are not wildcards decides it)
// NEVER: model.onnx:4:0: error: carve.softmax (node act): the plan's "ops" entry "act" cannot split 'b': dimension 'b' of 'a b^ -> a b^' is never split
func.func @train_step(%x: tensor<4x6xf32> {carve.input = "x"},
                      %w: tensor<6x8xf32> {carve.param = "w", carve.trainable}) -> tensor<4x8xf32> {
  %p = carve.matmul %x, %w : (tensor<4x6xf32>, tensor<6x8xf32>) -> tensor<4x8xf32> loc("mm"("model.onnx":3:0))
  %y = carve.softmax %p {axis = 1 : i64} : tensor<4x8xf32> loc("act"("model.onnx":4:0))
  return %y : tensor<4x8xf32>
}
