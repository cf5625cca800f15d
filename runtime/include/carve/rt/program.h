//===- program.h - the contract between generated code and the runtime ----===//
//
// `carve compile` writes one C++ source per distinct rank program. Each
// defines a `Program` (tables of inputs and parameters with their arena
// offsets, and the `step` function) and the generated `programs.cpp` defines
// `carve_program_for_rank`. The runtime's `main` (train_main.cpp) owns
// everything else: argument parsing, MPI start-up, the arena, initial
// weights, data, checkpoints, metrics.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_PROGRAM_H
#define CARVE_RT_PROGRAM_H

#include "carve/rt/comm.h"
#include "carve/rt/kernels.h"
#include "carve/rt/optim.h"

#include <cstdint>
#include <memory>
#include <string>

// A generated CPU program's step, evaluate, layer and pipeline-stage
// functions are a sequence of kernel calls and pointer arithmetic, compiled
// between CARVE_GLUE_BEGIN and CARVE_GLUE_END at GCC's -O0 instead of the
// build's -O3: optimizing them spent most of a program's compile time for no
// measurable gain, the time being in the kernels (a ResNet-18 step: 21 s at
// -O3, 11 s at -O1; a Mixtral-style MoE program 1.8 s at -O1, 1.0 s at -O0,
// with the layers outlined; docs/performance.md). The cost of -O0 is stack:
// every temporary keeps its own slot (a ResNet-18 step's frame: 169 KiB, 16
// KiB at -O1), well inside a thread's 8 MiB. The fused chains' functors and
// loops (fused.h) and the runtime's inline functions are defined before
// CARVE_GLUE_BEGIN and keep -O3 and their vectorized loops, so the programs
// compute the same bits. Other compilers build it all as the flags say.
#if defined(__GNUC__) && !defined(__clang__)
#define CARVE_GLUE_BEGIN _Pragma("GCC push_options") _Pragma("GCC optimize(\"O0\")")
#define CARVE_GLUE_END _Pragma("GCC pop_options")
#else
#define CARVE_GLUE_BEGIN
#define CARVE_GLUE_END
#endif

namespace carve::rt {

/// BF16 and F16: 16-bit copies of fp32 master weights (TensorSpec::copyType).
enum class DType : int { F32 = 0, F64 = 1, I64 = 2, I32 = 3, Bool = 4, BF16 = 5, F16 = 6 };

/// Size in bytes of one element.
int dtypeSize(DType t);
/// "F32", "F64", "I64", "I32", "BOOL", "BF16", "F16" (the safetensors spelling).
const char *dtypeName(DType t);

/// One tensor that lives for the whole run (a graph input, a parameter, a
/// buffer), with its place in the arena. Shapes are this rank's (local) shapes.
///
/// Tensor parallelism: a tensor split over the tp mesh axis holds piece
/// `tpRank` of Split{tpDim, tpGroups, tp} (dist.h) of the model's tensor of
/// shape globalDims; dims is that piece's shape (the "tp-local" tensor).
/// ZeRO: the tp-local tensor, flattened and zero-padded to dp * zeroChunk
/// elements, is cut into dp chunks of zeroChunk; dp rank d owns chunk d.
/// With paramZero the arena slot at `offset` holds only that chunk (ZeRO-3);
/// with stateZero each optimizer state slot does (ZeRO-1 and up). The
/// runtime loads and saves full tensors, and shards them on the way in.
struct TensorSpec {
  const char *name; // the model's name: graph input name or parameter name
  DType dtype;
  int rank;
  int64_t dims[kMaxRank];
  int64_t numel;
  int64_t offset;                    // byte offset in the arena
  bool trainable;                    // parameters only
  int64_t gradOffset;                // byte offset of the gradient (gradType), -1 if not trainable
  int64_t stateOffset[2];            // optimizer state (float): SGD momentum buffer in [0];
                                     // AdamW exp_avg in [0], exp_avg_sq in [1]; -1 if none
  int64_t globalDims[kMaxRank] = {}; // the model's full shape; all zero: same as dims
  int tpDim = -1;                    // dimension split over the tp axis, -1 if replicated
  int64_t tpGroups = 1;              // Split::groups of that split
  int64_t zeroChunk = 0;             // elements per dp rank of the ZeRO partition; 0: none
  bool paramZero = false;            // the arena slot holds only this rank's chunk (ZeRO-3)
  bool stateZero = false;            // each optimizer state slot holds only the chunk
  // Mixed-precision storage (a bf16/fp16 plan, carve-store-params16): `offset`
  // holds the 16-bit copy (copyType) that the step reads, masterOffset the
  // fp32 master that the optimizer updates and checkpoints hold; the master
  // is chunked as the optimizer state is (stateZero), the copy as the
  // parameter is (paramZero). `dtype` is the master's (the model's).
  int64_t masterOffset = -1; // -1: none (`offset` holds the parameter itself)
  DType copyType = DType::F32;
  // The gradient at gradOffset (docs/training.md#16-bit-gradients): F32, or
  // BF16/F16 where a bf16/fp16 plan keeps it in 16 bits.
  DType gradType = DType::F32;
  // An integer input that is a cross-entropy's targets: the classes a target
  // may name, [0, classes), and ignoreIndex where hasIgnore; 0: not a target.
  // The data loader checks the data against it (docs/data.md).
  int64_t classes = 0;
  bool hasIgnore = false;
  int64_t ignoreIndex = 0;
};

enum class DataKind : int {
  /// Two int64 [B, T] inputs (token ids, targets) read from a flat token file.
  Tokens = 0,
  /// One tensor per graph input read from a safetensors file with a leading
  /// step dimension.
  Tensors = 1,
};

struct StepContext;

/// Runtime callbacks inside a step (train --on-nan). The step calls
/// `gradientsReady` once its gradients are synchronized, before it computes
/// the gradient norm, and `updateAllowed` with that (global) norm before the
/// optimizer: when it returns false the step returns without clipping or
/// updating anything. Every rank gets the same answer.
class StepHooks {
public:
  virtual ~StepHooks() = default;
  virtual void gradientsReady(StepContext &ctx) = 0;
  virtual bool updateAllowed(StepContext &ctx, double gradNorm) = 0;
  /// Whether `ok` holds on every rank of the run, each rank calling it at the
  /// same point of the same step (gpu::graphStep: every rank replays its
  /// captured step, or none does). Without a world to ask: `ok`.
  virtual bool everyRank(bool ok) { return ok; }
};

/// What one step hands to the generated code, and what it hands back.
struct StepContext {
  char *arena = nullptr;          // Program::arenaBytes bytes, 64-byte aligned
  Communicator *dpComm = nullptr; // the data-parallel group (size 1 without dp)
  int64_t step = 0;               // optimizer steps done before this one (0-based)
  uint64_t seed = 0; // the dropout masks' seed (train --seed; docs/training.md#dropout)
  // Out:
  float loss = 0;                 // the global loss (reduced over the dp group)
  float lr = 0;                   // learning rate applied in this step
  float gradNorm = -1;            // global gradient norm before clipping (-1: not computed)
  Communicator *tpComm = nullptr; // the tensor-parallel group (size 1 without tp)
  int tpRank = 0;                 // this rank's place on the tp axis (tpComm->rank())
  int dpRank = 0;                 // this rank's place on the dp axis (dpComm->rank())
  Communicator *ppComm = nullptr; // the pipeline group (size 1 without pp)
  int ppRank = 0;                 // this rank's place on the pp axis (ppComm->rank())
  class Tracer *tracer = nullptr; // records the schedule's steps (train --trace), or null
  StepHooks *hooks = nullptr;     // --on-nan's check before the optimizer, or null
  /// The loss seed's factor (dynamic loss scaling of fp16 plans): gradients
  /// come out scaled by it and the step divides them by it before the norm.
  float lossScale = 1;
  /// CUDA programs (train's default; --no-cuda-graph turns it off): run the
  /// forward and backward once, then capture them in a CUDA graph and replay
  /// it (gpu::graphStep).
  bool cudaGraph = false;
  /// Out: the nodes of the captured graph (0 until it is captured).
  int64_t graphNodes = 0;
  /// Out, at the step whose capture failed (that step and every later one
  /// run eagerly): 1 when this rank's capture failed, `graphFallbackWhy`
  /// saying where; 2 when another rank's did. 0 otherwise.
  int graphFallback = 0;
  const char *graphFallbackWhy = nullptr;
  /// The run's learning rate, schedule, weight decay, AdamW's betas and eps
  /// and clipping (Program::hyper, overridden by train --lr ...); the step
  /// reads them.
  const Hyperparameters *hyper = nullptr;
  /// Set by the runtime around `Program::evaluate`: the forward also counts,
  /// after each cross-entropy, into `counts` {elements whose target's logit
  /// is the largest of their row, elements counted (not ignore_index)};
  /// evaluate sums them over the pipeline stages and dp replicas (tp ranks
  /// count the same rows and agree).
  bool evaluating = false;
  double counts[2] = {0, 0};
  /// Expert parallelism (Program::ep): the ranks of this rank's expert group
  /// (the ep consecutive dp ranks that split the experts; all-to-all of the
  /// routed tokens), and those that hold the same experts (the other groups'
  /// rank at this epRank; the expert gradients' sum). Both size 1 without ep.
  Communicator *epComm = nullptr;
  Communicator *edpComm = nullptr;
  int epRank = 0;
};

/// A device the step runs on (the CUDA target), driven by the runtime's main
/// through these functions so that the main needs no device headers. The
/// step's arena (`StepContext::arena`) is then device memory; the main keeps
/// a host copy of it for weights, data and checkpoints and moves the parts it
/// needs. Every function that can fail returns false (or null) with one line
/// in `error` naming the device and the cause.
struct DeviceTarget {
  const char *name; // "cuda"
  /// Picks this rank's device (`localRank` among the `localRanks` ranks on
  /// this host) and checks that it exists and has room for `arenaBytes`.
  bool (*open)(int worldRank, int localRank, int localRanks, int64_t arenaBytes,
               std::string &error);
  char *(*allocArena)(int64_t bytes, std::string &error);
  void (*freeArena)(char *p);
  bool (*toDevice)(char *dev, const char *host, int64_t bytes, std::string &error);
  bool (*toHost)(char *host, const char *dev, int64_t bytes, std::string &error);
  /// Waits for the device's work; false if it failed (a kernel fault, an
  /// NCCL error), with the cause.
  bool (*synchronize)(std::string &error);
  /// The device communicator of the ranks of `bootstrap` (NCCL over the
  /// host group), or null with `error` set.
  std::unique_ptr<Communicator> (*makeComm)(Communicator &bootstrap, std::string &error);
  void (*close)();
  /// Training step `step` ended (its work synchronized): CARVE_GPU_PROFILE
  /// leaves the first step a run trains out of its table.
  void (*stepEnded)(int64_t step);
};

/// The optimizer a program was compiled with (for checkpoints and messages).
enum class OptimizerKind : int { SGD = 0, AdamW = 1 };

struct Program {
  const char *name;    // e.g. "program0" (the source file's stem)
  const char *model;   // the model file the program came from
  int worldSize;       // ranks the plan needs
  int dp;              // data-parallel degree
  int64_t globalBatch; // the exported (or --set-dim) batch
  int64_t localBatch;  // globalBatch / dp
  int64_t seqLen;      // T for DataKind::Tokens, 0 otherwise
  DataKind dataKind;
  int numInputs;
  const TensorSpec *inputs; // graph inputs, local shapes (dim 0 = localBatch)
  int numParams;
  const TensorSpec *params; // parameters and buffers, in the model's order
  int64_t arenaBytes;
  OptimizerKind optimizer;
  int numStateSlots;       // 0 (SGD without momentum), 1 (SGD momentum), 2 (AdamW)
  const char *description; // optimizer, schedule, plan: one line for the log
  /// Runs one training step on the inputs already placed in the arena:
  /// forward, backward, gradient synchronization, optimizer update.
  void (*step)(StepContext &ctx);
  int tp = 1;        // tensor-parallel degree: worldSize = dp * tp
  int zeroStage = 0; // ZeRO stage 0-3 (for messages; the specs say what is sharded)
  // This rank's persistent bytes (parameters and buffers, gradients,
  // optimizer state), for the start-up report; all 0: not reported.
  int64_t paramBytes = 0, gradBytes = 0, stateBytes = 0;
  // Pipeline parallelism: worldSize = pp * dp * tp with pp outermost
  // (rank = (ppRank * dp + dpRank) * tp + tpRank); this program is pipeline
  // rank ppRank's. Each dp replica's share of the batch runs as
  // numMicroBatches micro-batches (inputs hold all of them, one after another).
  int pp = 1;
  int ppRank = 0;
  int numMicroBatches = 1;
  int64_t activationBytes = 0; // this rank's activation memory (all slots), for the report
  /// The device the step runs on; null: the CPU (the arena is host memory).
  const DeviceTarget *device = nullptr;
  /// The plan's precision: "fp32", "bf16" or "fp16" (matmul and attention
  /// inputs rounded to it; 16-bit weight copies of fp32 master weights,
  /// TensorSpec::masterOffset; 16-bit gradients where TensorSpec::gradType
  /// says so).
  const char *precision = "fp32";
  /// The compiled hyperparameters: the defaults a run's train --lr ...
  /// override (null: a program that reads none).
  const Hyperparameters *hyper = nullptr;
  /// Token models: the rows of the embedding the token ids index; the data
  /// loader refuses an id outside [0, vocab). 0: not checked (this rank's
  /// stages hold no embedding, or not a token model).
  int64_t vocab = 0;
  /// Forward only (train --eval-data): the global loss of the inputs already
  /// placed in the arena, into ctx.loss, reduced as the step reduces it. No
  /// gradient is computed and nothing persistent changes (parameters,
  /// gradients, optimizer state); activations and inputs are overwritten.
  /// Every rank of the plan calls it together. Null: a program compiled
  /// before carve had it (recompile).
  void (*evaluate)(StepContext &ctx) = nullptr;
  /// Expert parallelism (docs/moe.md): the dp ranks form groups of `ep`
  /// consecutive ones (epRank = dpRank % ep); each group holds one copy of
  /// every mixture-of-experts layer's experts, split among its ranks, and
  /// this program is ep rank epRank's (its experts). 1: no expert parallelism.
  int ep = 1;
  int epRank = 0;
  /// Dropout nodes whose masks this rank's step draws (docs/training.md#dropout):
  /// from StepContext::seed and step. 0: it draws no random numbers.
  int dropoutNodes = 0;
};

} // namespace carve::rt

/// Defined by the generated programs.cpp: the program rank `rank` runs, or
/// null if the compiled plan has no such rank.
extern "C" const carve::rt::Program *carve_program_for_rank(int rank);
/// Defined by the generated programs.cpp: the ranks the plan needs.
extern "C" int carve_world_size();

#endif // CARVE_RT_PROGRAM_H
