//===- PlannerImpl.h - what the planner's own files share, not its users --===//
//
// Private to compiler/planner: the priced model the search reuses across
// candidates (CostModel.cpp), the per-rank pieces the time model hands the
// memory model (MemoryModel.cpp), and the JSON object reader the constraints
// and the calibration table share (Constraints.cpp). The public API is
// Planner.h.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_PLANNER_PLANNERIMPL_H
#define CARVE_COMPILER_PLANNER_PLANNERIMPL_H

#include "compiler/planner/Planner.h"

#include <nlohmann/json_fwd.hpp>

#include <array>
#include <string>
#include <utility>
#include <vector>

namespace carve::planner {

//===----------------------------------------------------------------------===//
// The priced model (CostModel.cpp)
//===----------------------------------------------------------------------===//

/// Per-sample and fixed seconds of a list of ops on the device.
struct Secs {
  double perSample = 0, fixed = 0, coreSample = 0;
};

/// A segment priced on the device for one (tp, sp) profile.
struct Priced {
  Secs fwd, bwd;
  std::array<double, kNumCommKinds> fwdComm{}, bwdComm{}; // elements per sample
  std::array<int, kNumCommKinds> fwdCalls{}, bwdCalls{};
};

/// Every part of a profile priced once per micro-batch size (the search
/// reuses it for every candidate of the profile's tp layout and that size).
struct PricedModel {
  Priced embedding, head;
  std::vector<Priced> layers;
};

/// Prices every part of `prof` at micro-batch `mb`. `bytes`: per stored
/// element (Storage::activation), for memory-bound ops.
PricedModel priceModel(const Profile &prof, const Cluster &cl, const Calibration &cal,
                       const std::string &precision, double bytes, double mb);

/// `estimate` on a model already priced at the candidate's micro-batch size.
Estimate estimatePriced(const Profile &prof, const PricedModel &priced, const Profile &base,
                        const Cluster &cl, const Candidate &c, const PlannerOptions &opts);

//===----------------------------------------------------------------------===//
// The memory model's pieces (MemoryModel.cpp)
//===----------------------------------------------------------------------===//

/// What one pipeline rank holds, summed over its chunks.
struct RankHoldings {
  double params = 0;      // parameter elements (its share of the routed experts)
  double frozen = 0;      // frozen parameter elements (Segment::frozen)
  double activations = 0; // bytes kept for backward, all micro-batches in flight
  double buffers = 0;     // bytes of the pipeline's gradient receive buffers
  double workspace = 0;   // bytes of scratch at its peak
};

/// One part's memory for one micro-batch: the bytes it keeps for backward,
/// and the peak of its transients (scratch) while it runs.
struct PartMemory {
  double kept = 0, work = 0;
};
PartMemory partMemory(const Segment &seg, bool isLayer, const Candidate &c, const Storage &st);

/// The scratch a chunk's micro-batch needs above what it keeps, `chunkKept`
/// bytes in all (with the sent copy of its output), from its parts in order.
double chunkScratch(double chunkKept, const std::vector<PartMemory> &parts);

/// A model whose pipeline stages the profile does not describe
/// (Profile::stagesUnmodelled): every rank is charged the whole model.
void holdWholeModel(const Candidate &c, std::vector<RankHoldings> &ranks);

/// Fills `e`'s memory per rank, the largest (mem, memRank), the usable
/// capacity and whether the plan fits.
void chargeMemory(const Profile &prof, const Cluster &cl, const Candidate &c, const Storage &st,
                  const PlannerOptions &opts, const std::vector<RankHoldings> &ranks, Estimate &e);

//===----------------------------------------------------------------------===//
// Reading JSON (Constraints.cpp)
//===----------------------------------------------------------------------===//

/// Parses `text` as a JSON object; `what` names it in errors, `example` shows one.
bool parseObject(const std::string &text, const std::string &what, const char *example,
                 nlohmann::json &j, std::string &error);

} // namespace carve::planner

#endif // CARVE_COMPILER_PLANNER_PLANNERIMPL_H
