//===- Profile.h - what one micro-batch of a model costs, by layer --------===//
//
// The planner's view of a model. buildProfile imports the model (ONNX or
// builtin) with a batch of one sample, builds the training step (autodiff),
// partitions it over a tp axis of size t (with or without sequence
// parallelism, with the user's pinned ops) exactly as `carve compile` would,
// and reads off, per part of the model (the embedding, each numbered layer,
// the head and loss):
//
//   - every op's FLOPs and the elements it reads and writes, forward and
//     backward, per rank (local shapes);
//   - the tensor-parallel collectives, by kind and size;
//   - the activations kept for backward: forward values that a backward op
//     reads, counted once per storage (a reshape, transpose or slice is a view
//     of its input; a value all-gathered over tp is kept sharded and gathered
//     again in backward, as Megatron-LM does), plus the attention core's
//     probabilities that an unfused implementation keeps (and, when the graph
//     carries `carve.dropout`, the dropout masks and dropped probabilities);
//   - the layer's input (what full recomputation keeps) and the tensors that
//     cross to the next part (what a pipeline stage boundary sends);
//   - the parameters each part holds.
//
// Everything that depends on the batch is per sample; the planner scales it
// by the micro-batch size. Sizes are element counts: the plan's precision
// decides the bytes. docs/planner.md.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_PLANNER_PROFILE_H
#define CARVE_COMPILER_PLANNER_PROFILE_H

#include "compiler/frontend/OnnxImporter.h"
#include "compiler/partition/Partitioner.h"

#include "mlir/IR/MLIRContext.h"
#include "llvm/ADT/STLExtras.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace carve::planner {

enum CommKind { kAllReduce = 0, kAllGather, kReduceScatter, kAllToAll, kNumCommKinds };
const char *commKindName(int kind);

/// One op's work, per rank.
struct OpWork {
  double flops = 0; // opFlops
  double elems = 0; // elements read and written
  /// Of which read or written once per micro-batch whatever its size (a
  /// weight, a weight's gradient): a per-sample op's memory traffic is
  /// (elems - fixedElems) * b + fixedElems at micro-batch b.
  double fixedElems = 0;
  bool matmul = false;        // matmul / attention (compute-bound); else memory-bound
  bool perSample = false;     // depends on the batch (scales with the micro-batch)
  bool attentionCore = false; // carve.attention: what selective recompute redoes
  /// A matmul's (or attention's) dimensions for the GEMM efficiency table:
  /// the smallest of M, N, K that do not grow with the micro-batch, and the
  /// one that does, per sample (0: none; a batched product of per-sample
  /// operands grows in count, not in size). gemmSmallest() combines them.
  double gemmFixed = 0, gemmPerSample = 0;
  double gemmSmallest(double microBatch) const {
    return gemmPerSample > 0 ? std::min(gemmFixed, gemmPerSample * microBatch) : gemmFixed;
  }
};

/// Collectives over tp, per sample: elements of the full tensor and calls.
struct CommWork {
  std::array<double, kNumCommKinds> elems{};
  std::array<int, kNumCommKinds> calls{};
  void add(int kind, double e) {
    elems[kind] += e;
    calls[kind] += 1;
  }
};

struct Segment {
  std::string name; // "embedding", "h.3", "head"
  std::vector<OpWork> forward, backward;
  CommWork forwardComm, backwardComm;
  /// Activations kept for backward, per sample (elements of the activation dtype).
  double saved = 0;
  /// Of which batch-independent (not scaled by the micro-batch).
  double savedFixed = 0;
  /// Kept in fp32 whatever the precision, per sample: the tables of the
  /// gathers that matmuls gather themselves (a convolution's image, kept in
  /// place of its windows; carve.fold = "gather"). Not in `saved`, unless
  /// backward also reads the value directly (then a bf16/fp16 plan keeps a
  /// 16-bit copy besides).
  double savedWide = 0;
  /// Attention probabilities kept by an unfused attention core (per sample).
  double core = 0;
  /// f32 elements a CUDA program keeps per sample for carve.attention's
  /// gradient (its output and row log-sum-exp; carve-save-attention-stats).
  double attentionStats = 0;
  /// With dropout: 1-byte masks of hidden dropout, of attention dropout, and
  /// the dropped probabilities (activation dtype).
  double hiddenMasks = 0, coreMasks = 0, coreDropped = 0;
  /// The inputs its forward part reads from earlier parts (full recompute keeps these).
  double input = 0;
  /// What it sends to later parts per sample (a pipeline boundary after it).
  double boundary = 0;
  /// Transient working memory: the most elements of batch-dependent values
  /// that are alive at once while its forward or its backward runs, not
  /// counting what forward keeps for backward (`saved`), the gradients the
  /// step returns (and the values they are views of), and views. Some of
  /// them scale with the micro-batch and some do not (a weight's gradient
  /// summed over the batch), so the peak is kept as the points (per-sample
  /// elements, fixed elements) that may be the most at some micro-batch
  /// size: transient(b) is the largest of per-sample * b + fixed over them.
  /// transientPeaksGrads: the same where a plan computes each returned
  /// gradient apart from where it is kept and adds it there at once (micro-
  /// batches accumulating their gradients): the gradient is a transient of
  /// the op that writes it.
  std::vector<std::pair<double, double>> transientPeaks, transientPeaksGrads;
  /// The same with a whole convolution's result counted as half an element
  /// (its 16-bit copy, which a bf16/fp16 CUDA program's convolutions write
  /// instead of the f32 result: Storage::convolutionResults16), and with
  /// gradients, its weight gradient not at all (written into the 16-bit
  /// gradient directly).
  std::vector<std::pair<double, double>> transientPeaks16, transientPeaksGrads16;
  double transient(double microBatch, bool gradients, bool convolutionResults16 = false) const {
    const auto &peaks = convolutionResults16
                            ? (gradients ? transientPeaksGrads16 : transientPeaks16)
                            : (gradients ? transientPeaksGrads : transientPeaks);
    double most = 0;
    for (auto [perSample, fixed] : peaks)
      most = std::max(most, perSample * microBatch + fixed);
    return most;
  }
  /// Adds an alive set to a list of peaks, keeping only the points no
  /// other point dominates.
  static void notePeak(std::vector<std::pair<double, double>> &peaks, double perSample,
                       double fixed) {
    for (auto [p, f] : peaks)
      if (p >= perSample && f >= fixed)
        return;
    llvm::erase_if(peaks, [&](const std::pair<double, double> &x) {
      return x.first <= perSample && x.second <= fixed;
    });
    peaks.push_back({perSample, fixed});
  }
  /// Forward FLOPs of its attention cores (selective recompute redoes them), per sample.
  double coreFlops = 0;
  /// Trainable parameters it holds (local elements), and frozen ones (a
  /// --frozen glob names them: kept in fp32 on every rank that uses them,
  /// with no gradient and no optimizer state, as carve compile holds them).
  double params = 0, frozen = 0;
  /// Of `params`, those of routed experts (split over ep), and the elements
  /// one expert-parallel forward pass exchanges per sample (dispatch and
  /// combine of every routed layer in it, before the (ep-1)/ep that leaves).
  double expertParams = 0, expertExchange = 0;
  /// The most trainable-parameter elements one of its ops reads (forward or
  /// backward): under 16-bit storage their fp32 views live while it runs.
  double paramRead = 0;
  int ops = 0;
  /// What carve-split-stages counts for this part when it balances stages
  /// (its unitCosts): the FLOPs of every op, forward and backward, of each
  /// node whose first forward op on the batch is in this part: per sample,
  /// and of the ops whose size does not grow with the batch.
  double splitFlops = 0, splitFlopsFixed = 0;
};

/// A forward op whose split over tp the partitioner chose: what the
/// planner's per-op search (OpSearch.h) varies. Only under tp > 1.
struct ChoiceSite {
  std::string node;              // model node name
  std::string annotation;        // its partition annotation
  std::string chosen;            // "replicate", "n", "n x 3", "partial"
  std::vector<std::string> dims; // the annotated names it could split instead
  std::vector<int> producers;    // sites whose results reach it (through views, collectives)
};

struct Profile {
  int tp = 1;
  bool sequenceParallel = false;
  Segment embedding, head;
  std::vector<Segment> layers; // in model order, one per numbered layer
  /// layers[i] is a copy of layers[layerOrigin[i]] (a builtin model's middle
  /// layers stand for each other), so a price of one is the price of all;
  /// empty when every layer was profiled on its own.
  std::vector<int> layerOrigin;
  /// The model has no layers the planner can cut pipeline stages between
  /// (no forward op on the batch). The planner then charges every pipeline
  /// rank the whole model (never less than it holds). A model without
  /// numbered layers is profiled by the pieces carve-split-stages cuts it
  /// into (crossingUnits), as layers that differ.
  bool stagesUnmodelled = false;
  /// The layers are those of several numbered prefixes (ResNet's layer1 ..
  /// layer4), or the pieces of a model without numbered layers, and differ
  /// from each other: pipeline chunks are balanced by
  /// each layer's Segment::splitFlops, as carve-split-stages balances its
  /// units, not by one layer's time.
  bool layersDiffer = false;
  /// Trainable parameters used by more than one part (GPT's tied embedding):
  /// local elements, counted in each part that uses it.
  double sharedParams = 0;
  /// The same for frozen parameters (Segment::frozen).
  double sharedFrozen = 0;
  /// Whole-model totals at tp = 1 and one sample: parameters and training FLOPs.
  double totalParams = 0;
  double modelFlops = 0;         // forward + backward, one sample, whole model
  int64_t modelBatch = 1;        // the batch the model was written with
  int64_t seq = 0; // tokens per sample: dimension 1 of the first token-id input; 0: none
  /// Routed mixture-of-experts layers: the experts every layer's count
  /// divides by (their gcd); 0 when the model has none (ep stays 1).
  int experts = 0;
  std::string pinsUsed;          // for messages
  std::vector<ChoiceSite> sites; // forward ops with a tp choice, in program order
};

struct ProfileRequest {
  std::string model;    // ONNX path or builtin spec
  ImportOptions import; // --set-dim, --frozen, rules' custom ops
  std::string loss;
  int tp = 1;
  bool sequenceParallel = false;
  std::vector<OpOverride> pins; // plan "ops" entries
  std::vector<AnnotationOverride> annotations;
  /// loadProfileModel: keep the convolutions whole (a CUDA program at tp = 1,
  /// whose convolutions run as cuDNN's) instead of lowering them to im2col.
  bool convolutionsWhole = false;
};

/// The model at one sample with its training step built, ready to be
/// profiled under any tp (buildProfile works on a copy).
struct ProfileModel {
  mlir::OwningOpRef<mlir::ModuleOp> module;
  int64_t modelBatch = 1;
  int64_t seq = 0;
  /// A builtin model is profiled with at most three layers (all its layers
  /// are alike): its real layer count; 0 for an ONNX model, or a builtin
  /// model profiled whole (a frozen or pinned glob names some layers).
  int builtinLayers = 0;
};

/// Imports (or builds) the model with one sample and runs autodiff. On
/// failure returns false with one line in `error` naming the model.
bool loadProfileModel(mlir::MLIRContext &context, const ProfileRequest &req, ProfileModel &model,
                      std::string &error);

/// Partitions a copy of `model` over `req.tp` and measures it. On failure
/// (tp does not divide what it must, a pin matches nothing) returns false
/// with one line in `error`.
bool buildProfile(const ProfileModel &model, const ProfileRequest &req, Profile &profile,
                  std::string &error);

} // namespace carve::planner

#endif // CARVE_COMPILER_PLANNER_PROFILE_H
