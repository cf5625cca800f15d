//===- Planner.h - cost and memory model, constraints, plan search --------===//
//
// `carve plan` in a library. A Candidate is one point of the plan space
// (dp, tp, pp, virtual stages, schedule, micro-batch size and count, ZeRO
// stage, recomputation, sequence parallelism, precision). `estimate` prices
// it on a cluster from the model's Profile: per-rank memory (parameters,
// gradients, optimizer state under ZeRO, activations kept for backward under
// tp / sequence parallelism / recomputation and the schedule's in-flight
// micro-batches, communication buffers, workspace) and step time (roofline
// compute, alpha-beta collectives on the links they cross, the pipeline
// bubble, gradient all-reduce overlapped with backward, recomputation).
// `searchPlans` enumerates the space the constraints leave, keeps the plans
// that fit, and ranks them. docs/planner.md.
//
// The time model is CostModel.cpp, the memory model MemoryModel.cpp, the
// search PlanSearch.cpp; Constraints.cpp and Calibration.cpp read the user's
// files. What they share and users do not is in PlannerImpl.h.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_PLANNER_PLANNER_H
#define CARVE_COMPILER_PLANNER_PLANNER_H

#include "compiler/planner/Cluster.h"
#include "compiler/planner/Profile.h"

#include <array>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace carve::planner {

struct Candidate {
  int dp = 1, tp = 1, pp = 1, v = 1;
  int ep = 1;                    // expert parallelism (divides dp; models with routed experts)
  int64_t microBatch = 1;        // samples per micro-batch
  int64_t m = 1;                 // micro-batches per step
  std::string schedule = "1f1b"; // gpipe, 1f1b, interleaved
  int zero = 0;
  std::string recompute = "none"; // none, selective, full
  bool sp = false;
  std::string precision = "bf16"; // fp32, bf16, fp16
  /// Under bf16/fp16: "fp32" or "16bit", where micro-batches accumulate
  /// gradients (the plan field grad_accumulation).
  std::string gradAccumulation = "fp32";
  /// The plan field sync_batch_norm, as the constraints fix it (not priced).
  bool syncBatchNorm = false;
  /// The plan field tf32, as the constraints fix it (never chosen by the
  /// search: it changes the numerics): fp32 GEMMs priced at the device's
  /// TF32 peak (its fp32 peak where the cluster gives none).
  bool tf32 = false;
  /// The peak-FLOPs entry of the cluster the GEMMs run at: the precision,
  /// or "tf32" for an fp32 plan with tf32.
  std::string gemmPeak() const { return precision == "fp32" && tf32 ? "tf32" : precision; }
  std::string key() const; // "dp=2 tp=4 pp=8 ..." for messages
};

struct Memory {
  double params = 0, grads = 0, optimizer = 0, activations = 0, buffers = 0, workspace = 0;
  double total() const { return params + grads + optimizer + activations + buffers + workspace; }
};

struct StepTime {
  double compute = 0;   // forward + backward of the busiest rank, all micro-batches
  double recompute = 0; // of which recomputation
  double tpComm = 0;    // tensor-parallel collectives (not overlapped)
  double epComm = 0;    // expert parallelism's all-to-alls (not overlapped)
  double p2p = 0;       // pipeline sends and receives
  double bubble = 0;    // pipeline fill and drain
  double dpComm = 0;    // gradient reduction (and ZeRO gathers), in full
  double dpExposed = 0; // of which not hidden behind backward
  double optimizer = 0;
  double total = 0;
};

/// Bytes moved per step per rank, by kind.
struct Volume {
  std::array<double, kNumCommKinds> tp{}; // tp collectives by kind
  double dp = 0;                          // gradient reduction (+ ZeRO gathers)
  double pp = 0;                          // pipeline sends
  double ep = 0;                          // expert parallelism's all-to-alls
};

struct Estimate {
  Candidate c;
  Memory mem;                     // the rank with the most memory
  int memRank = 0;                // which pipeline rank that is
  std::vector<Memory> memPerRank; // every pipeline rank's
  StepTime time;
  Volume volume;
  double bubbleFraction = 0; // bubble / total pipeline time
  double tokensPerSecond = 0, tflopsPerDevice = 0, mfu = 0;
  double capacity = 0; // usable bytes per device (after headroom)
  bool fits = false;
  std::vector<int> layersPerStage; // per stage (pp * v)
};

/// Efficiency factors of the time model; a measured table (JSON,
/// `--calibration`) can replace them.
struct Calibration {
  /// Fraction of the peak FLOP/s a GEMM (matmul, attention) reaches, by its
  /// smallest dimension (M, N or K; OpWork::gemmSmallest): points
  /// (dimension, fraction) with increasing dimensions, interpolated linearly
  /// in log2 of the dimension and flat beyond the first and last point.
  /// The default is an A100's (docs/planner.md, "Step time").
  std::vector<std::pair<double, double>> gemmEfficiency = defaultGemmEfficiency();
  double memoryEfficiency = 0.80;      // fraction of peak memory bandwidth
  double linkEfficiency = 0.85;        // fraction of link bandwidth a collective reaches
  double kernelOverhead = 4e-6;        // seconds per kernel launch
  double bucketBytes = 25 * 1048576.0; // gradient bucket size
  /// Whether the data-parallel gradient reduction overlaps the backward pass,
  /// bucket by bucket, as carve's programs do; false: it starts after the
  /// backward (Megatron-LM's "local" DDP of 2021, DeepSpeed's default
  /// overlap_comm false), wholly exposed.
  bool gradientOverlap = true;

  static std::vector<std::pair<double, double>> defaultGemmEfficiency();
  /// The table at a GEMM whose smallest dimension is `dim`.
  double gemmEfficiencyAt(double dim) const;
  /// The table's last point: what a large GEMM reaches (and the compute
  /// bound of the non-GEMM ops, against the fp32 peak).
  double largeGemmEfficiency() const { return gemmEfficiency.back().second; }
};
bool parseCalibration(const std::string &text, const std::string &what, Calibration &cal,
                      std::string &error);

/// What the user fixes, bounds, pins or forbids (docs/planner.md).
struct Constraints {
  std::map<std::string, std::string> fixed;                // field -> value
  std::map<std::string, std::pair<double, double>> bounds; // field -> [min, max]
  std::vector<OpOverride> pins;                            // op-name glob -> dim
  std::set<std::string> noSplit;                           // batch, sequence, layers, hidden
  double headroomFraction = 0;                             // of device memory kept free
  double headroomBytes = 0;
};
/// The plan fields a constraint may name.
const std::vector<std::string> &constraintFields();
/// `--fixed tp=8,pp=16` (adds to `c`; a field fixed twice differently is an error).
bool parseFixed(const std::string &text, Constraints &c, std::string &error);
/// A constraints file: {"fixed": {...}, "bounds": {"tp": {"min": 2, "max": 8}},
/// "pin": {"GLOB": "DIM" | "replicate"}, "no_split": ["sequence"],
/// "memory_headroom": 0.1 | "4GiB"}.
bool parseConstraints(const std::string &text, const std::string &what, Constraints &c,
                      std::string &error);

struct PlannerOptions {
  int64_t globalBatch = 0; // samples per step
  Calibration calibration;
  Constraints constraints;
  int alternatives = 5;
  /// Price bf16/fp16 plans with the published mixed-precision layout instead
  /// of what carve's programs store (storageFor); for tests of the counting.
  bool publishedStorage = false;
};

/// The profiles the search needs, built on demand: (tp, sequence parallel) -> profile.
using ProfileSource = std::function<const Profile *(int tp, bool sp, std::string &error)>;

struct SearchResult {
  std::vector<Estimate> ranked;     // feasible plans, fastest first (best + alternatives)
  std::vector<std::string> lostWhy; // per alternative: why it lost to the best
  Estimate closest;                 // when nothing fits: the plan that misses by the least
  bool anyFits = false;
  bool fullyFixed = false; // the user fixed every field that matters
  long evaluated = 0;
  std::vector<std::string> skipped; // "tp=8: heads 12 not divisible by 8" ...
  std::string contradiction;        // constraints that cannot all hold
};

/// Prices one candidate.
Estimate estimate(const Profile &profile, const Profile &base, const Cluster &cluster,
                  const Candidate &c, const PlannerOptions &opts);

/// Searches the plan space. `base` is the tp = 1 profile (model totals).
SearchResult searchPlans(const Profile &base, const ProfileSource &profiles, const Cluster &cluster,
                         const PlannerOptions &opts);

/// Bytes per element of what a plan keeps in memory and sends: `activation`
/// for the values kernels read and write (scratch, tp collectives, the
/// memory traffic the time model prices), `kept` for the activations kept
/// from forward to backward and sent between pipeline stages.
struct Storage {
  double param = 4, grad = 4, optimizer = 8, activation = 4, kept = 4;
  /// ZeRO-2/3: bytes per element of the chunk that keeps the reduced
  /// gradient (an fp32 accumulator of 16-bit gradients: 4).
  double accumulator = 4;
  /// Whether attention keeps its probabilities (b·a·s² per layer, and with
  /// dropout its mask) for backward, as an unfused attention does (the
  /// published accounting). carve.attention keeps none: its gradient
  /// recomputes them.
  bool scores = true;
  /// Whether attention keeps its f32 output and row statistics for its
  /// gradient (carve-save-attention-stats: CUDA programs without recompute).
  bool attentionStats = false;
  /// Whether each op reads its weights through fp32 views of their 16-bit
  /// copies (a bf16/fp16 program on the CPU target; CUDA kernels read the
  /// copies as stored).
  bool weightViews = false;
  /// Whether a weight's gradient is computed apart from where the step keeps
  /// it (a 16-bit gradient's fp32 product, rounded into it; micro-batches
  /// adding theirs into an accumulator): a transient of the op that writes
  /// it (Segment::transientPeaksGrads).
  bool gradientTransients = false;
  /// Whether a whole convolution's result is written as its 16-bit copy (a
  /// bf16/fp16 CUDA program: cuDNN computes it in 16 bits), so that it is
  /// half an f32 element among the transients, and its weight gradient is
  /// written into the 16-bit gradient directly, no f32 product
  /// (Segment::transientPeaks16). One micro-batch only: a pipelined
  /// program's (micro-batches adding their gradients) is priced as f32.
  bool convolutionResults16 = false;
};

/// What carve's compiled programs store under `precision`: fp32 weights,
/// gradients, AdamW's m and v, fp32 collectives and kernels; under bf16 and
/// fp16 the kept activations and the pipeline's sends are 16-bit
/// (carve-pack-activations), the weights the step reads are 16-bit copies
/// of fp32 masters kept with m and v (carve-store-params16; gathered in 16
/// bits), gradients are 16-bit and reduced in 16 bits (carve-store-grads16:
/// 2 + 2 + 12 bytes per parameter) unless `m` > 1 micro-batches accumulate
/// them in fp32 (`gradAccumulation` "fp32": under ZeRO-0/1 fp32 gradients,
/// 2 + 4 + 12; under ZeRO-2/3 fp32 chunk accumulators of 4 bytes per element
/// of the chunk, with 16-bit reductions: Storage::accumulator), and matmul and attention round
/// their inputs (docs/training.md, "16-bit activations"). With `published`: the mixed-precision
/// layout the published memory formulas assume (16-bit weights, gradients and activations, an fp32
/// master copy with m and v: 2 + 2 + 12 bytes per parameter), which the unit tests use to check the
/// planner's counting against those formulas to the byte. `cuda`: a CUDA program, whose
/// attention keeps its output and row statistics for its gradient (Storage::attentionStats) and
/// whose kernels read 16-bit weights as stored (Storage::weightViews).
Storage storageFor(const std::string &precision, bool published = false, int64_t m = 1,
                   int zero = 0, const std::string &gradAccumulation = "fp32", bool cuda = false);

/// The activation bytes of one layer, one micro-batch, under `c`, with
/// `bytesPerElement` per stored element (Storage::kept): what the
/// memory model charges per layer.
double layerActivationBytes(const Segment &layer, const Candidate &c, double bytesPerElement,
                            bool scores = true);

/// "1.234 s", "12.34 ms", "5.6 us": durations in reports.
std::string formatSeconds(double t);

/// The activation slots of each chunk of each pipeline rank under a schedule
/// (compiler/schedule: slots[r][c]), as the compiled programs allocate them;
/// one slot each when the schedule cannot be built. Remembered for the
/// process (the reference stays valid).
const std::vector<std::vector<int>> &pipelineSlots(const std::string &schedule, int p, int v,
                                                   int64_t m);

/// In-flight micro-batches (chunk activations held) on pipeline rank r.
int64_t inFlight(const std::string &schedule, int p, int v, int64_t m, int r);

} // namespace carve::planner

#endif // CARVE_COMPILER_PLANNER_PLANNER_H
