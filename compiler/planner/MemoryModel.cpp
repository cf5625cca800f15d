//===- MemoryModel.cpp - what each pipeline rank of a plan holds ----------===//
//
// The bytes a plan keeps per rank, as carve's compiled programs store them:
// the element sizes of each precision (storageFor), the activations a layer
// keeps for backward and the micro-batches a schedule keeps in flight, a
// part's scratch, and per rank the parameters, gradients and optimizer state
// under ZeRO, the communication buffers and the workspace. CostModel.cpp
// walks the chunks and calls these. docs/planner.md, "Memory per rank".
//
//===----------------------------------------------------------------------===//

#include "compiler/planner/PlannerImpl.h"
#include "compiler/schedule/Schedule.h"
#include "dialects/carve/Contract.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>

namespace carve::planner {

Storage storageFor(const std::string &precision, bool published, int64_t m, int zero,
                   const std::string &gradAccumulation, bool cuda) {
  Storage st;        // fp32 throughout
  st.scores = false; // carve.attention
  st.attentionStats = cuda && !published;
  if (precision != "fp32") {
    st.kept = 2;       // carve-pack-activations
    st.param = 2;      // carve-store-params16: the 16-bit copy the step reads
    st.optimizer = 12; // ... its fp32 master with m and v
    // carve-store-grads16, by the rule the compiler reads.
    PlanAttrs plan;
    plan.precision = precision;
    plan.microBatches = m;
    plan.zero = zero;
    plan.gradAccumulation = gradAccumulation;
    st.grad = plan.gradients16() ? 2 : 4;
    st.accumulator = plan.fp32ChunkAccumulators() ? 4 : st.grad;
  }
  st.weightViews = precision != "fp32" && !cuda;
  st.convolutionResults16 = cuda && precision != "fp32" && m == 1;
  st.gradientTransients = m > 1 || st.grad == 2;
  if (published && precision != "fp32") {
    st = Storage{2, 2, 12, 2, 2};
    st.accumulator = 2;
  }
  return st;
}

const std::vector<std::vector<int>> &pipelineSlots(const std::string &schedule, int p, int v,
                                                   int64_t m) {
  static std::mutex mu;
  static std::map<std::tuple<std::string, int, int, int64_t>, std::vector<std::vector<int>>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(schedule, p, v, m);
  if (auto it = cache.find(key); it != cache.end())
    return it->second;
  pipeline::ScheduleKind kind;
  pipeline::Schedule sched;
  std::string error;
  std::vector<std::vector<int>> slots(p, std::vector<int>(v, 1));
  // buildSchedule's slots (PlannerTest checks they agree) without building
  // its m * v * p instructions: a chunk's slot is reused once its backward
  // ran, so a chunk needs as many as it has micro-batches in flight at most.
  if (v == 1 &&
      (schedule == "1f1b" || schedule == "gpipe" || (schedule == "interleaved" && m % p == 0))) {
    for (int r = 0; r < p; ++r)
      slots[r][0] = (int)inFlight(schedule, p, v, m, r);
  } else if (schedule == "interleaved" && m % p == 0) {
    // The forwards and backwards of interleavedRank (compiler/schedule).
    const int64_t total = m * v;
    for (int r = 0; r < p; ++r) {
      const int64_t warmup = std::min<int64_t>(2 * (p - r - 1) + (int64_t)(v - 1) * p, total);
      std::vector<int> live(v, 0), &peak = slots[r];
      peak.assign(v, 0);
      auto forward = [&](int64_t k) {
        int c = (int)((k / p) % v);
        peak[c] = std::max(peak[c], ++live[c]);
      };
      auto backward = [&](int64_t k) { --live[v - 1 - (k / p) % v]; };
      for (int64_t k = 0; k < warmup; ++k)
        forward(k);
      for (int64_t k = 0; k < total - warmup; ++k) {
        forward(warmup + k);
        backward(k);
      }
    }
  }
  return cache[key] = slots;
}

int64_t inFlight(const std::string &schedule, int p, int v, int64_t m, int r) {
  if (schedule == "gpipe")
    return m;
  if (schedule == "interleaved" && v > 1) {
    // Chunk-micro-batches begun and not finished: the warm-up forwards plus one.
    int64_t warm = (int64_t)(p - r - 1) * 2 + (int64_t)(v - 1) * p;
    return std::min<int64_t>(warm + 1, m * v);
  }
  return std::min<int64_t>(p - r, m);
}

double layerActivationBytes(const Segment &s, const Candidate &c, double bytesPerElement,
                            bool scores) {
  const double a = bytesPerElement, b = (double)c.microBatch;
  if (c.recompute == "full")
    return s.input * b * a;
  double bytes =
      (s.saved - s.savedFixed) * b * a + s.savedFixed * a + s.hiddenMasks * b + s.savedWide * b * 4;
  if (c.recompute != "selective" && scores)
    bytes += (s.core * a + s.coreMasks + s.coreDropped * a) * b;
  return bytes;
}

PartMemory partMemory(const Segment &seg, bool isLayer, const Candidate &c, const Storage &st) {
  const double b = (double)c.microBatch;
  const double aBytes = st.activation, keptBytes = st.kept;
  const double core = st.scores ? seg.core : 0;
  PartMemory pm;
  pm.kept = isLayer ? layerActivationBytes(seg, c, keptBytes, st.scores)
                    : ((seg.saved - seg.savedFixed) * b + seg.savedFixed) * keptBytes +
                          core * b * keptBytes + seg.hiddenMasks * b + seg.savedWide * b * 4;
  if (st.attentionStats && c.recompute == "none")
    pm.kept += seg.attentionStats * b * 4;
  // Under 16-bit storage on the CPU each op reads its parameters through
  // fp32 views of their 16-bit copies, alive while it runs
  // (carve-store-params16); placed among the part's other transients they
  // fragment its scratch, so the part's views are charged as if all were
  // alive at once.
  pm.work = seg.transient(b, st.gradientTransients, st.convolutionResults16) * aBytes +
            (st.weightViews ? seg.params * 4 : 0);
  if (c.recompute == "full" && isLayer)
    pm.work += (seg.saved * b + core * b) * aBytes + seg.savedWide * b * 4;
  else if (c.recompute == "selective" && isLayer)
    pm.work += core * b * aBytes;
  return pm;
}

double chunkScratch(double chunkKept, const std::vector<PartMemory> &parts) {
  // A part's transients are alive with what the parts before it keep
  // (and its own), not with what later parts keep: in forward those are
  // not written yet, in backward they are freed (a value is charged to
  // the part whose backward reads it last). So the peak above what the
  // micro-batch keeps is the most, over its parts in order, of the kept
  // so far plus the part's transients, less all it keeps; the sent copy
  // of the chunk's output counts from the start. (The other micro-batches
  // in flight keep all of theirs meanwhile.) On a CNN whose first layers'
  // windows' transients dwarf what they keep, the sum of the whole
  // chunk's kept activations and its largest transients was 5x the arena.
  double sent = chunkKept, prefix = 0, peak = chunkKept;
  for (const PartMemory &p : parts)
    sent -= p.kept;
  for (const PartMemory &p : parts) {
    prefix += p.kept;
    peak = std::max(peak, sent + prefix + p.work);
  }
  return peak - chunkKept;
}

void holdWholeModel(const Candidate &c, std::vector<RankHoldings> &ranks) {
  // Any rank may hold any part: each is charged every part's parameters
  // and, at the most micro-batches in flight, every part's kept
  // activations, the largest scratch and send buffers.
  double ps = 0, frozen = 0, perMb = 0, most = 0, work = 0, buffers = 0;
  for (int r = 0; r < c.pp; ++r) {
    const double held = (double)inFlight(c.schedule, c.pp, c.v, c.m, r);
    const double f = c.v > 1 ? held / c.v : held;
    ps += ranks[r].params;
    frozen += ranks[r].frozen;
    perMb += f > 0 ? ranks[r].activations / f : 0;
    most = std::max(most, f);
    work = std::max(work, ranks[r].workspace);
    buffers = std::max(buffers, ranks[r].buffers);
  }
  for (int r = 0; r < c.pp; ++r) {
    ranks[r].params = ps;
    ranks[r].frozen = frozen;
    ranks[r].activations = perMb * most;
    ranks[r].workspace = work;
    ranks[r].buffers = buffers;
  }
}

void chargeMemory(const Profile &prof, const Cluster &cl, const Candidate &c, const Storage &st,
                  const PlannerOptions &opts, const std::vector<RankHoldings> &ranks, Estimate &e) {
  const Calibration &cal = opts.calibration;
  const double pB = st.param, gB = st.grad, oB = st.optimizer;
  double maxPartParams = std::max(prof.embedding.params, prof.head.params);
  for (const Segment &s : prof.layers)
    maxPartParams = std::max(maxPartParams, s.params);
  double best = -1;
  for (int r = 0; r < c.pp; ++r) {
    double ps = ranks[r].params;
    Memory m;
    double shard = std::ceil(ps / c.dp);
    // Frozen parameters: whole on every rank that uses them, in fp32 (the
    // published layout: in 16 bits), never sharded by ZeRO.
    m.params =
        (c.zero >= 3 ? shard : ps) * pB + ranks[r].frozen * (opts.publishedStorage ? pB : 4.0);
    m.grads = c.zero >= 2 ? shard * st.accumulator : ps * gB;
    m.optimizer = (c.zero >= 1 ? shard : ps) * oB;
    m.activations = ranks[r].activations;
    // carve's programs reduce gradients in place (the gradient region is
    // laid out in bucket order); ZeRO-2/3 with micro-batches reduce-scatter
    // a bucket into a staging copy of this rank's chunk. The published
    // layout keeps a separate bucket.
    double bucket = 0;
    if (c.dp > 1 && opts.publishedStorage)
      bucket = std::min(ps * gB, cal.bucketBytes);
    else if (c.dp > 1 && c.zero >= 2) // the bucket's whole gradients, before their reduce-scatter
      bucket = std::min(ps * gB, cal.bucketBytes) * (c.m > 1 ? 1 + 1.0 / c.dp : 1);
    m.buffers = bucket + ranks[r].buffers;
    m.workspace = ranks[r].workspace;
    if (c.zero == 3) // one part's parameters gathered at a time, the next prefetched
      m.workspace += 2 * maxPartParams * pB;
    e.memPerRank.push_back(m);
    if (m.total() > best) {
      best = m.total();
      e.mem = m;
      e.memRank = r;
    }
  }
  e.capacity = cl.device.memoryBytes * (1 - opts.constraints.headroomFraction) -
               opts.constraints.headroomBytes;
  e.fits = e.mem.total() <= e.capacity;
}

} // namespace carve::planner
