// Tests that carve-set-plan records exactly the options given (defaults for
// the rest) as the module's carve.plan, and that a pass reading a malformed
// carve.plan reports the field.
// RUN: carve-opt %s -split-input-file --carve-set-plan="dp=2 tp=2 zero=1 sequence-parallel=true ops=/h.0/*=replicate precision=bf16 optimizer-state=1" | FileCheck %s
// RUN: carve-opt %s -split-input-file --carve-set-plan | FileCheck %s --check-prefix=DEFAULT
// RUN: not carve-opt %s -split-input-file --carve-partition 2>&1 | FileCheck %s --check-prefix=READ

// CHECK: module attributes {carve.plan = {dp = 2 : i64, micro_batches = 1 : i64, ops = {{\[}}["/h.0/*", "replicate"]], optimizer_state = 1 : i64, pp = 1 : i64, precision = "bf16", schedule = "1f1b", sequence_parallel, tp = 2 : i64, virtual_stages = 1 : i64, zero = 1 : i64}}
// DEFAULT: module attributes {carve.plan = {dp = 1 : i64, micro_batches = 1 : i64, optimizer_state = 2 : i64, pp = 1 : i64, precision = "fp32", schedule = "1f1b", tp = 1 : i64, virtual_stages = 1 : i64, zero = 0 : i64}}
module {
}

// -----

// Tests that a degree below 1 is refused.
// READ: error: 'carve.plan' field 'tp' must be an integer >= 1
module attributes {carve.plan = {tp = 0 : i64}} {
}

// -----

// Tests that a field the plan does not have is refused, not ignored.
// READ: error: 'carve.plan' has an unknown field 'tensor_parallel'
module attributes {carve.plan = {tensor_parallel = 2 : i64}} {
}

// -----

// Tests that the "ops" overrides must be pairs of strings.
// READ: error: 'carve.plan' field 'ops' must be an array of [glob, dim] string pairs
module attributes {carve.plan = {ops = ["mm=b"]}} {
}
