// Tests carve-bind-custom-ops with models/custom/swiglu.json plus an
// override: the custom op that the override's glob matches takes the
// override's annotation (and the gradient annotation derived from it), the
// other keeps its rule's; an annotation that does not fit the op's shapes is
// one error naming the node and the rules entry.
// RUN: rm -rf %t && mkdir -p %t && cp %carve_src/models/custom/swiglu.json %carve_src/models/custom/swiglu.cpp %carve_src/models/custom/swiglu.cu %t/
// RUN: python3 -c "import json,sys; r=json.load(open('%t/swiglu.json')); r['ops'].append({'match': '/layers.0/*', 'annotation': 'a b c^, a b c^ -> a b c^'}); json.dump(r, open('%t/override.json','w'))"
// RUN: python3 -c "import json,sys; r=json.load(open('%t/swiglu.json')); r['ops'].append({'match': '/layers.1/*', 'annotation': 'a b, a b -> a b'}); json.dump(r, open('%t/misfit.json','w'))"
// RUN: carve-opt %s --carve-bind-custom-ops="rules=%t/override.json" | FileCheck %s
// RUN: not carve-opt %s --carve-bind-custom-ops="rules=%t/misfit.json" 2>&1 | FileCheck %s --check-prefix=MISFIT

// CHECK: carve.custom {{.*}}{annotation = "a b c^, a b c^ -> a b c^", backward = "swiglu_backward", backward_annotation = "a b c^, a b c^, a b c^ -> a b c^, a b c^"
// CHECK: carve.custom {{.*}}{annotation = "a b c, a b c -> a b c", backward = "swiglu_backward", backward_annotation = "a b c, a b c, a b c -> a b c, a b c"

// MISFIT: error: node '/layers.1/SwiGLU' (carve.example::SwiGLU): {{.*}}misfit.json: ops[1]: "annotation":

func.func @forward(%a: tensor<2x4x8xf32> {carve.input = "a"}, %b: tensor<2x4x8xf32> {carve.input = "b"})
    -> (tensor<2x4x8xf32> {carve.output = "y0"}, tensor<2x4x8xf32> {carve.output = "y1"}) {
  %0 = carve.custom %a, %b {annotation = "a b c, a b c -> a b c", backward = "swiglu_backward",
                            backward_annotation = "a b c, a b c, a b c -> a b c, a b c",
                            domain = "carve.example", forward = "swiglu_forward", op_type = "SwiGLU"}
         : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32> loc("/layers.0/SwiGLU")
  %1 = carve.custom %a, %b {annotation = "a b c, a b c -> a b c", backward = "swiglu_backward",
                            backward_annotation = "a b c, a b c, a b c -> a b c, a b c",
                            domain = "carve.example", forward = "swiglu_forward", op_type = "SwiGLU"}
         : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32> loc("/layers.1/SwiGLU")
  return %0, %1 : tensor<2x4x8xf32>, tensor<2x4x8xf32>
}
