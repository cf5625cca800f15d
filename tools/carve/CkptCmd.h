//===- CkptCmd.h - `carve ckpt inspect|merge` -----------------------------===//
//
// Reads checkpoints written by `train --save` (runtime/include/carve/rt/
// checkpoint.h, docs/checkpoints.md) without running anything:
//
//   carve ckpt inspect PATH                  the plan, step, positions and every
//                                            tensor with its shards per rank
//   carve ckpt merge PATH -o FULL.safetensors [--model MODEL.onnx] [--dtype bf16]
//                                            the full model by original name; with
//                                            --model every state_dict() key (tied
//                                            aliases, buffers the program folded)
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_TOOLS_CARVE_CKPTCMD_H
#define CARVE_TOOLS_CARVE_CKPTCMD_H

#include <string>
#include <vector>

namespace carve {

struct CkptArgs {
  std::vector<std::string> positional; // "inspect" or "merge", then PATH
  std::string output;                  // merge: -o FILE
  bool withOptimizer = false;          // merge: also the optimizer state
  std::string model;                   // merge: --model MODEL.onnx (state_dict names, buffers)
  std::string dtype = "fp32";          // merge: --dtype fp32|bf16|fp16
};

/// Runs `carve ckpt ...`; returns the exit status (errors: one line, 1).
int runCkpt(const CkptArgs &args);

} // namespace carve

#endif // CARVE_TOOLS_CARVE_CKPTCMD_H
