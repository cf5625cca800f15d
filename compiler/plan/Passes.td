//===- Passes.td - the plan on the module ------------------*- tablegen -*-===//

#ifndef CARVE_PLAN_PASSES_TD
#define CARVE_PLAN_PASSES_TD

include "mlir/Pass/PassBase.td"

def CarveSetPlan : Pass<"carve-set-plan", "mlir::ModuleOp"> {
  let summary = "Record a plan on the module (carve.plan), for running passes alone";
  let description = [{
    Every pass after import reads the plan from the module's `carve.plan`
    attribute (dialects/carve/Contract.h), never from options of its own.
    `carve compile` writes that attribute from the plan file before its
    pipeline runs; this pass writes it from options, so that `carve-opt` and
    the lit tests can run a pass alone under any plan:

      carve-opt step.mlir --carve-set-plan="tp=2 ops=mm=b" --carve-partition

    Before: any module. After: the module's `carve.plan` holds exactly the
    options given (a field left out takes its default); nothing else changes.
  }];
  let options = [
    Option<"dp", "dp", "int64_t", /*default=*/"1", "Data-parallel degree">,
    Option<"tp", "tp", "int64_t", /*default=*/"1", "Tensor-parallel degree">,
    Option<"ep", "ep", "int64_t", /*default=*/"1",
           "Expert-parallel degree (divides dp)">,
    Option<"pp", "pp", "int64_t", /*default=*/"1", "Pipeline-parallel degree">,
    Option<"zero", "zero", "int64_t", /*default=*/"0", "ZeRO stage over dp (0-3)">,
    Option<"zero3PrefetchLayers", "zero3-prefetch-layers", "int64_t", /*default=*/"0",
           "ZeRO-3: layers ahead whose gathers start early">,
    Option<"sequenceParallel", "sequence-parallel", "bool", /*default=*/"false",
           "Sequence parallelism on the tp axis">,
    Option<"syncBatchNorm", "sync-batch-norm", "bool", /*default=*/"false",
           "Batch norm's statistics over all data-parallel replicas">,
    Option<"microBatches", "micro-batches", "int64_t", /*default=*/"1",
           "Micro-batches per step of each data-parallel replica">,
    Option<"virtualStages", "virtual-stages", "int64_t", /*default=*/"1",
           "Pipeline stages per pp rank (interleaved schedule)">,
    Option<"schedule", "schedule", "std::string", /*default=*/"\"1f1b\"",
           "Pipeline schedule: gpipe, 1f1b or interleaved">,
    Option<"precision", "precision", "std::string", /*default=*/"\"fp32\"",
           "fp32, bf16 or fp16">,
    Option<"tf32", "tf32", "bool", /*default=*/"false",
           "The CUDA target's fp32 matmuls through TF32 tensor cores">,
    Option<"target", "target", "std::string", /*default=*/"\"cpu\"",
           "The programs' target: cpu or cuda">,
    Option<"attention", "attention", "std::string", /*default=*/"\"cudnn\"",
           "The CUDA target's attention under bf16/fp16: cudnn or carve">,
    Option<"convolution", "convolution", "std::string", /*default=*/"\"cudnn\"",
           "The CUDA target's convolutions: cudnn or carve (im2col GEMMs)">,
    Option<"gradAccumulation", "grad-accumulation", "std::string", /*default=*/"\"fp32\"",
           "Under bf16/fp16: fp32 or 16bit, where micro-batches accumulate gradients">,
    Option<"optimizerState", "optimizer-state", "int64_t", /*default=*/"2",
           "Optimizer state tensors per parameter (AdamW 2, SGD with momentum 1, SGD 0)">,
    Option<"recompute", "recompute", "std::string", /*default=*/"\"none\"",
           "Activation recomputation: none, selective or full">,
    ListOption<"recomputeLayers", "recompute-layers", "std::string",
               "With recompute=full: the layers to recompute (globs over h.0, layers.3, ...)">,
    ListOption<"cuts", "cuts", "std::string", "Pipeline cut points (op-name globs)">,
    ListOption<"ops", "ops", "std::string",
               "Per-op tp overrides GLOB=DIM (DIM 'replicate' keeps the op whole)">,
  ];
}

#endif // CARVE_PLAN_PASSES_TD
