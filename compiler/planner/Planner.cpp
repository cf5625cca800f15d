//===- Planner.cpp - cost and memory model, constraints, plan search ------===//

#include "compiler/planner/Planner.h"
#include "compiler/plan/JsonRead.h"
#include "compiler/schedule/Schedule.h"
#include "dialects/carve/Contract.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

namespace carve::planner {

using json = nlohmann::json;

//===----------------------------------------------------------------------===//
// Small pieces
//===----------------------------------------------------------------------===//

std::string Candidate::key() const {
  std::ostringstream os;
  os << "dp=" << dp << " tp=" << tp << " pp=" << pp;
  if (ep > 1)
    os << " ep=" << ep;
  if (pp > 1 || m > 1) {
    os << " " << schedule;
    if (v > 1)
      os << " v=" << v;
    os << " m=" << m;
  }
  os << " mbs=" << microBatch;
  if (zero)
    os << " zero=" << zero;
  if (sp)
    os << " sp";
  if (recompute != "none")
    os << " recompute=" << recompute;
  os << " " << precision;
  if (gradAccumulation != "fp32")
    os << " grad_accumulation=" << gradAccumulation;
  if (syncBatchNorm)
    os << " sync_batch_norm";
  return os.str();
}

Storage storageFor(const std::string &precision, bool published, int64_t m, int zero,
                   const std::string &gradAccumulation) {
  Storage st;        // fp32 throughout
  st.scores = false; // carve.attention
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
  if (published && precision != "fp32") {
    st = Storage{2, 2, 12, 2, 2};
    st.accumulator = 2;
  }
  return st;
}

std::vector<std::vector<int>> pipelineSlots(const std::string &schedule, int p, int v, int64_t m) {
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
  if (pipeline::parseScheduleKind(schedule, kind, error) &&
      pipeline::buildSchedule(kind, p, (int)m, v, sched, error))
    slots = sched.slots;
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

namespace {

struct Link {
  double bw, lat;
};

/// Alpha-beta models; `bytes` is the full tensor.
double allReduceTime(int n, double bytes, const Link &l) {
  if (n <= 1 || bytes <= 0)
    return 0;
  double ring = 2.0 * (n - 1) / n * bytes / l.bw + 2.0 * (n - 1) * l.lat;
  double tree = 2.0 * bytes / l.bw + 2.0 * std::ceil(std::log2((double)n)) * l.lat;
  return std::min(ring, tree);
}
double gatherTime(int n, double bytes, const Link &l) {
  if (n <= 1 || bytes <= 0)
    return 0;
  return (double)(n - 1) / n * bytes / l.bw + (double)(n - 1) * l.lat;
}
double commTime(int kind, int n, double bytes, int calls, const Link &l) {
  if (n <= 1 || calls == 0)
    return 0;
  // Latency per call; bandwidth over the total.
  double per = bytes / calls;
  double t = kind == kAllReduce ? allReduceTime(n, per, l) : gatherTime(n, per, l);
  return t * calls;
}

/// Per-sample and fixed seconds of a list of ops on the device.
struct Secs {
  double perSample = 0, fixed = 0, coreSample = 0;
};
/// A GEMM runs at the fraction of peak the calibration table gives for its
/// smallest dimension at micro-batch `mb`, and an op reads its weights once
/// per micro-batch (a per-sample op's seconds are its seconds at `mb`
/// divided by `mb`, so the caller still scales them by `mb`).
Secs opSeconds(const std::vector<OpWork> &ops, const Cluster &cl, const Calibration &cal,
               const std::string &precision, double bytes, double mb) {
  Secs s;
  const double peak = cl.peak(precision == "fp32" ? "fp32" : precision);
  const double peakVec = cl.peak("fp32") * cal.largeGemmEfficiency();
  const double bw = cl.device.memoryBandwidth * cal.memoryEfficiency;
  for (const OpWork &w : ops) {
    const double elems = w.perSample ? w.elems - w.fixedElems + w.fixedElems / mb : w.elems;
    double t =
        w.matmul ? std::max(w.flops /
                                (peak * cal.gemmEfficiencyAt(w.gemmSmallest(w.perSample ? mb : 1))),
                            elems * bytes / bw)
                 : std::max(w.flops / peakVec, elems * bytes / bw);
    (w.perSample ? s.perSample : s.fixed) += t;
    s.fixed += cal.kernelOverhead;
    if (w.attentionCore)
      s.coreSample += t;
  }
  return s;
}

/// A segment priced on the device for one (tp, sp) profile.
struct Priced {
  Secs fwd, bwd;
  std::array<double, kNumCommKinds> fwdComm{}, bwdComm{}; // elements per sample
  std::array<int, kNumCommKinds> fwdCalls{}, bwdCalls{};
};
Priced price(const Segment &s, const Cluster &cl, const Calibration &cal,
             const std::string &precision, double bytes, double mb) {
  Priced p;
  p.fwd = opSeconds(s.forward, cl, cal, precision, bytes, mb);
  p.bwd = opSeconds(s.backward, cl, cal, precision, bytes, mb);
  p.fwdComm = s.forwardComm.elems;
  p.bwdComm = s.backwardComm.elems;
  p.fwdCalls = s.forwardComm.calls;
  p.bwdCalls = s.backwardComm.calls;
  return p;
}

/// Every part of a profile priced once per micro-batch size (the search
/// reuses it for every candidate of the profile's tp layout and that size).
struct PricedModel {
  Priced embedding, head;
  std::vector<Priced> layers;
};
/// `bytes`: per stored element (Storage::activation), for memory-bound ops.
PricedModel priceModel(const Profile &prof, const Cluster &cl, const Calibration &cal,
                       const std::string &precision, double bytes, double mb) {
  PricedModel m;
  m.embedding = price(prof.embedding, cl, cal, precision, bytes, mb);
  m.head = price(prof.head, cl, cal, precision, bytes, mb);
  m.layers.reserve(prof.layers.size());
  for (const Segment &s : prof.layers)
    m.layers.push_back(price(s, cl, cal, precision, bytes, mb));
  return m;
}

/// Chunk sizes: L layers into S chunks, the first also holding the
/// embedding and the last the head, balanced by cost (what the pipeline
/// splitter does with FLOPs).
std::vector<int> balanceChunks(int L, int S, double layer, double first, double last) {
  std::vector<int> n(S, L / S);
  for (int i = 0; i < L % S; ++i)
    n[S == 1 ? 0 : 1 + i % std::max(1, S - 2)] += 1;
  if (S == 1)
    return n;
  auto cost = [&](int k) { return n[k] * layer + (k == 0 ? first : 0) + (k == S - 1 ? last : 0); };
  for (int iter = 0; iter < 4 * S; ++iter) {
    int hi = 0, lo = 0;
    for (int k = 0; k < S; ++k) {
      if (cost(k) > cost(hi))
        hi = k;
      if (cost(k) < cost(lo) || (cost(k) == cost(lo) && n[k] < n[lo]))
        lo = k;
    }
    if (n[hi] <= 1 || hi == lo)
      break;
    double before = cost(hi);
    n[hi] -= 1;
    n[lo] += 1;
    if (std::max(cost(hi), cost(lo)) >= before) {
      n[hi] += 1;
      n[lo] -= 1;
      break;
    }
  }
  return n;
}

} // namespace

//===----------------------------------------------------------------------===//
// The estimate
//===----------------------------------------------------------------------===//

namespace {

Estimate estimatePriced(const Profile &prof, const PricedModel &priced, const Profile &base,
                        const Cluster &cl, const Candidate &c, const PlannerOptions &opts) {
  const Calibration &cal = opts.calibration;
  Estimate e;
  e.c = c;
  const int L = std::max<int>(1, (int)prof.layers.size());
  const bool hasLayers = !prof.layers.empty();
  const int S = c.pp * c.v;
  const double b = (double)c.microBatch;
  const Storage st =
      storageFor(c.precision, opts.publishedStorage, c.m, c.zero, c.gradAccumulation);
  const double aBytes = st.activation, keptBytes = st.kept;
  const int dev = cl.devicesPerNode;

  Link intra{cl.intraNode.bandwidth * cal.linkEfficiency, cl.intraNode.latency};
  Link inter{cl.interNode.bandwidth * cal.linkEfficiency, cl.interNode.latency};
  Link tpLink = c.tp <= dev ? intra : inter;
  Link dpLink = c.tp * c.dp <= dev ? intra : inter;
  Link ppLink = c.tp * c.dp >= dev || c.tp * c.dp * c.pp > dev ? inter : intra;
  // An expert group: ep consecutive dp ranks, tp apart.
  Link epLink = c.tp * c.ep <= dev ? intra : inter;

  const Priced &emb = priced.embedding, &head = priced.head;
  const std::vector<Priced> &lay = priced.layers;

  auto tpSecs = [&](const std::array<double, kNumCommKinds> &el,
                    const std::array<int, kNumCommKinds> &calls) {
    double t = 0;
    for (int k = 0; k < kNumCommKinds; ++k)
      t += commTime(k, c.tp, el[k] * b * aBytes, calls[k], tpLink);
    return t;
  };
  // One micro-batch of a part: forward, backward (+ recompute) seconds.
  struct PartTime {
    double fwd = 0, bwd = 0, rec = 0, comm = 0, ep = 0;
  };
  // Expert parallelism: each routed layer's dispatch and combine in forward,
  // the same two in backward; f32 rows, (ep-1)/ep of them leave the rank.
  auto epSecs = [&](const Segment &s) {
    if (c.ep <= 1 || s.expertExchange <= 0)
      return 0.0;
    return commTime(kAllToAll, c.ep, s.expertExchange * b * 4.0, 2, epLink);
  };
  auto partTime = [&](const Priced &p, const Segment &s) {
    PartTime t;
    const double x = epSecs(s);
    double fc = tpSecs(p.fwdComm, p.fwdCalls) + x, bc = tpSecs(p.bwdComm, p.bwdCalls) + x;
    t.ep = (c.recompute == "full" ? 3 : 2) * x;
    t.fwd = p.fwd.perSample * b + p.fwd.fixed + fc;
    t.bwd = p.bwd.perSample * b + p.bwd.fixed + bc;
    t.comm = fc + bc;
    if (c.recompute == "full") {
      t.rec = t.fwd;
      t.comm += fc;
    } else if (c.recompute == "selective") {
      t.rec = p.fwd.coreSample * b;
    }
    return t;
  };

  double layerCost = 0;
  if (hasLayers) {
    PartTime t = partTime(lay[lay.size() / 2], prof.layers[lay.size() / 2]);
    layerCost = t.fwd + t.bwd + t.rec;
  }
  PartTime et = partTime(emb, prof.embedding), ht = partTime(head, prof.head);
  std::vector<int> chunk;
  if (hasLayers)
    chunk = balanceChunks(L, S, layerCost, et.fwd + et.bwd + et.rec, ht.fwd + ht.bwd + ht.rec);
  else
    chunk.assign(S, 0);
  e.layersPerStage = chunk;

  // Per pipeline rank: time per micro-batch, parameters, activations.
  std::vector<double> rankTime(c.pp, 0), rankBwdLast(c.pp, 0), rankRec(c.pp, 0), rankComm(c.pp, 0),
      rankParams(c.pp, 0), rankAct(c.pp, 0), rankP2p(c.pp, 0);
  std::vector<double> rankWork(c.pp, 0), rankBuffers(c.pp, 0), rankParts(c.pp, 0);
  std::vector<double> rankExperts(c.pp, 0), rankEp(c.pp, 0); // expert params held, ep seconds
  int first = 0;
  double sendBytes = 0, inputBoundary = 0;
  // Backward sends: each chunk's gradient of its input, fp32, in a buffer
  // per activation slot, kept until the slot is reused (as compiled).
  const std::vector<std::vector<int>> slots =
      S > 1 ? pipelineSlots(c.schedule, c.pp, c.v, c.m) : std::vector<std::vector<int>>();
  for (int k = 0; k < S; ++k) {
    int r = k % c.pp;
    double t = 0, bw = 0, rec = 0, comm = 0, params = 0, act = 0, work = 0, experts = 0, epT = 0;
    // Per part in order: its kept activations and its transients' peak.
    std::vector<std::pair<double, double>> keptAndWork;
    auto addPart = [&](const Segment &seg, const Priced &pr, bool isLayer) {
      PartTime pt = partTime(pr, seg);
      t += pt.fwd + pt.bwd + pt.rec;
      bw += pt.bwd + pt.rec;
      rec += pt.rec;
      comm += pt.comm;
      epT += pt.ep;
      // Expert parallelism: a rank holds 1/ep of the routed experts.
      params += seg.params - seg.expertParams * (1.0 - 1.0 / c.ep);
      experts += seg.expertParams / c.ep;
      const double core = st.scores ? seg.core : 0;
      const double kept =
          isLayer ? layerActivationBytes(seg, c, keptBytes, st.scores)
                  : ((seg.saved - seg.savedFixed) * b + seg.savedFixed) * keptBytes +
                        core * b * keptBytes + seg.hiddenMasks * b + seg.savedWide * b * 4;
      act += kept;
      // Under 16-bit storage each op reads its parameters through fp32 views
      // of their 16-bit copies, alive while it runs (carve-store-params16);
      // placed among the part's other transients they fragment its scratch,
      // so the part's views are charged as if all were alive at once.
      double w = seg.transientPeak * b * aBytes + (st.param < 4 ? seg.params * 4 : 0);
      if (c.recompute == "full" && isLayer)
        w += (seg.saved * b + core * b) * aBytes + seg.savedWide * b * 4;
      else if (c.recompute == "selective" && isLayer)
        w += core * b * aBytes;
      work = std::max(work, w);
      keptAndWork.push_back({kept, w});
    };
    rankParts[r] += chunk[k] + (k == 0) + (k == S - 1);
    if (k == 0)
      addPart(prof.embedding, emb, false);
    for (int i = 0; i < chunk[k]; ++i)
      addPart(prof.layers[first + i], lay[first + i], true);
    double boundary =
        chunk[k] > 0 ? prof.layers[first + chunk[k] - 1].boundary : prof.embedding.boundary;
    first += chunk[k];
    if (k == S - 1)
      addPart(prof.head, head, false);
    if (k > 0 && S > 1)
      rankBuffers[r] += slots[r][k / c.pp] * inputBoundary * b * aBytes;
    if (k < S - 1 && S > 1) {
      // Activations forward in 16 bits under bf16/fp16, gradients back in fp32.
      double bytes = boundary * b * keptBytes, grad = boundary * b * aBytes;
      // The sent copy is kept until this micro-batch's backward (its buffer
      // is the sender's; the receiver keeps its own as the next layer's input).
      act += bytes;
      double p2p = (bytes + grad) / ppLink.bw + 2 * ppLink.lat;
      t += p2p;
      rankP2p[r] += p2p;
      sendBytes += bytes + grad;
    }
    inputBoundary = boundary;
    rankTime[r] += t;
    rankBwdLast[r] += bw;
    rankRec[r] += rec;
    rankComm[r] += comm;
    rankParams[r] += params;
    rankExperts[r] += experts;
    rankEp[r] += epT;
    if (c.v == 1) {
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
      double sent = act, prefix = 0, peak = act;
      for (const auto &[kept, w] : keptAndWork)
        sent -= kept;
      for (const auto &[kept, w] : keptAndWork) {
        prefix += kept;
        peak = std::max(peak, sent + prefix + w);
      }
      rankWork[r] = std::max(rankWork[r], peak - act);
    } else {
      rankWork[r] = std::max(rankWork[r], work);
    }
    // In flight: this chunk's activations times the micro-batches it holds.
    int64_t held = inFlight(c.schedule, c.pp, c.v, c.m, r);
    rankAct[r] += act * (c.v > 1 ? (double)held / c.v : (double)held);
  }
  if (c.pp == 1)
    rankParams[0] -= prof.sharedParams;
  if (c.pp > 1 && prof.stagesUnmodelled) {
    // Any rank may hold any part (Profile::stagesUnmodelled): each is charged
    // every part's parameters and, at the most micro-batches in flight, every
    // part's kept activations, the largest scratch and send buffers.
    double ps = 0, perMb = 0, most = 0, work = 0, buffers = 0;
    for (int r = 0; r < c.pp; ++r) {
      const double held = (double)inFlight(c.schedule, c.pp, c.v, c.m, r);
      const double f = c.v > 1 ? held / c.v : held;
      ps += rankParams[r];
      perMb += f > 0 ? rankAct[r] / f : 0;
      most = std::max(most, f);
      work = std::max(work, rankWork[r]);
      buffers = std::max(buffers, rankBuffers[r]);
    }
    for (int r = 0; r < c.pp; ++r) {
      rankParams[r] = ps;
      rankAct[r] = perMb * most;
      rankWork[r] = work;
      rankBuffers[r] = buffers;
    }
  }

  int slow = (int)(std::max_element(rankTime.begin(), rankTime.end()) - rankTime.begin());
  double tMb = rankTime[slow];
  double pipeline = (double)c.m * tMb + (double)(c.pp - 1) / c.v * tMb;
  e.time.bubble = (double)(c.pp - 1) / c.v * tMb;
  e.time.compute = (double)c.m * (tMb - rankComm[slow] - rankP2p[slow]);
  e.time.recompute = (double)c.m * rankRec[slow];
  e.time.tpComm = (double)c.m * (rankComm[slow] - rankEp[slow]);
  e.time.epComm = (double)c.m * rankEp[slow];
  e.time.p2p = (double)c.m * rankP2p[slow];
  e.bubbleFraction = pipeline > 0 ? e.time.bubble / pipeline : 0;

  // Data parallel: gradients (and ZeRO gathers) of the rank with most parameters.
  const double pB = st.param, gB = st.grad, oB = st.optimizer;
  double psi = *std::max_element(rankParams.begin(), rankParams.end());
  double dpT = 0;
  if (c.dp > 1) {
    double g = psi * gB;
    const double f = (double)(c.dp - 1) / c.dp;
    const double ag = gatherTime(c.dp, psi * pB, dpLink); // updated parameters, after the step
    // As compiled (compiler/codegen/Step.cpp): without ZeRO and under ZeRO-1
    // the gradients are all-reduced per bucket during backward, ZeRO-1 then
    // all-gathers the updated parameters; ZeRO-2/3 reduce-scatter per bucket,
    // every micro-batch, into fp32 chunk accumulators (docs/partition.md,
    // "ZeRO with micro-batches and pipelines"), ZeRO-2 then all-gathers the
    // updated parameters once and ZeRO-3 gathers each layer's for every
    // micro-batch's forward and backward.
    double reduce = 0, after = 0;
    if (c.ep > 1) {
      // Expert parallelism (ZeRO 0): the experts' gradients are summed over
      // the dp/ep ranks that hold the same experts, the rest over dp.
      const double ge = rankExperts[slow] * gB, gd = g - ge;
      const int edp = c.dp / c.ep;
      reduce = allReduceTime(c.dp, gd, dpLink) + allReduceTime(edp, ge, dpLink);
      e.volume.dp = 2 * f * gd + (edp > 1 ? 2.0 * (edp - 1) / edp * ge : 0);
    } else if (c.zero <= 1) {
      reduce = allReduceTime(c.dp, g, dpLink);
      e.volume.dp = 2 * f * g;
    } else {
      reduce = (double)c.m * gatherTime(c.dp, g, dpLink);
      e.volume.dp = f * (double)c.m * g;
    }
    if (c.zero == 1 || c.zero == 2) {
      after = ag;
      e.volume.dp += f * psi * pB;
    }
    dpT = reduce + after;
    if (c.zero == 3) {
      dpT += 2.0 * (double)c.m * ag;
      e.volume.dp += 2.0 * c.m * f * psi * pB;
    }
    const double buckets = std::max(1.0, std::ceil(g / cal.bucketBytes));
    // The reduction hides behind backward (the last micro-batch's, or with
    // per-micro-batch reduce-scatters the whole step's compute) except its
    // last bucket; the all-gather after the update does not hide.
    if (c.zero <= 1 || c.m == 1)
      e.time.dpExposed = std::max(reduce / buckets, reduce - rankBwdLast[slow]) + after;
    else
      e.time.dpExposed = std::max(reduce / c.m / buckets, reduce - e.time.compute) + after;
    if (c.zero == 3) {
      // Plans carve plan writes prefetch one layer (zero3_prefetch_layers =
      // 1): a part's gathers run while the part before it computes, and its
      // gradients' reduce-scatter while the parts after it in backward do.
      // Per micro-batch, forward exposes the first part's gather or what
      // the gathers take beyond forward's compute; backward likewise with
      // its gathers and reduce-scatters.
      const double parts = std::max(1.0, rankParts[slow]);
      const double G = gatherTime(c.dp, psi * pB, dpLink), R = gatherTime(c.dp, g, dpLink);
      const double fwd = tMb - rankBwdLast[slow] - rankP2p[slow], bwd = rankBwdLast[slow];
      e.time.dpExposed =
          (double)c.m * (std::max(G / parts, G - fwd) + std::max((G + R) / parts, G + R - bwd));
    }
  }
  e.time.dpComm = dpT;
  double updated = c.zero >= 1 ? std::ceil(psi / c.dp) : psi;
  e.time.optimizer =
      updated * 32.0 / (cl.device.memoryBandwidth * cal.memoryEfficiency) + 20 * cal.kernelOverhead;
  e.time.total = pipeline + e.time.dpExposed + e.time.optimizer;

  // Memory per rank; report the largest.
  double maxPartParams = std::max(prof.embedding.params, prof.head.params);
  for (const Segment &s : prof.layers)
    maxPartParams = std::max(maxPartParams, s.params);
  double best = -1;
  for (int r = 0; r < c.pp; ++r) {
    double ps = rankParams[r];
    Memory m;
    double shard = std::ceil(ps / c.dp);
    m.params = (c.zero >= 3 ? shard : ps) * pB;
    m.grads = c.zero >= 2 ? shard * st.accumulator : ps * gB;
    m.optimizer = (c.zero >= 1 ? shard : ps) * oB;
    m.activations = rankAct[r];
    // carve's programs reduce gradients in place (the gradient region is
    // laid out in bucket order); ZeRO-2/3 with micro-batches reduce-scatter
    // a bucket into a staging copy of this rank's chunk. The published
    // layout keeps a separate bucket.
    double bucket = 0;
    if (c.dp > 1 && opts.publishedStorage)
      bucket = std::min(ps * gB, cal.bucketBytes);
    else if (c.dp > 1 && c.zero == 2) // the bucket's whole gradients, before their reduce-scatter
      bucket = std::min(ps * gB, cal.bucketBytes) * (c.m > 1 ? 1 + 1.0 / c.dp : 1);
    m.buffers = bucket + rankBuffers[r];
    m.workspace = rankWork[r];
    if (c.zero == 3) // one part's parameters gathered at a time, the next prefetched
      m.workspace += 2 * maxPartParams * pB;
    e.memPerRank.push_back(m);
    if (m.total() > best) {
      best = m.total();
      e.mem = m;
      e.memRank = r;
    }
  }
  // Volume per step (busiest rank).
  for (int k = 0; k < kNumCommKinds; ++k) {
    double el = 0;
    auto add = [&](const Segment &s) {
      el += s.forwardComm.elems[k] * (c.recompute == "full" ? 2 : 1) + s.backwardComm.elems[k];
    };
    add(prof.embedding);
    for (const Segment &s : prof.layers)
      add(s);
    add(prof.head);
    e.volume.tp[k] = c.tp > 1 ? el * b * aBytes * (double)c.m / c.pp : 0;
  }
  e.volume.pp = sendBytes * (double)c.m / std::max(1, c.pp);
  if (c.ep > 1) {
    double x = 0;
    for (const Segment &s : prof.layers)
      x += s.expertExchange;
    x += prof.embedding.expertExchange + prof.head.expertExchange;
    // Dispatch and combine, forward and backward (and forward again under
    // full recomputation); what leaves the rank.
    e.volume.ep = (c.recompute == "full" ? 3 : 2) * x * b * 4.0 * (double)(c.ep - 1) / c.ep *
                  (double)c.m / c.pp;
  }

  e.capacity = cl.device.memoryBytes * (1 - opts.constraints.headroomFraction) -
               opts.constraints.headroomBytes;
  e.fits = e.mem.total() <= e.capacity;
  const double samples = b * (double)c.m * c.dp;
  const double tokens = samples * (double)std::max<int64_t>(1, base.seq);
  e.tokensPerSecond = tokens / e.time.total;
  const double flops = base.modelFlops * samples;
  e.tflopsPerDevice = flops / e.time.total / cl.worldSize() / 1e12;
  e.mfu = flops / e.time.total / cl.worldSize() / cl.peak(c.precision);
  return e;
}

} // namespace

Estimate estimate(const Profile &prof, const Profile &base, const Cluster &cl, const Candidate &c,
                  const PlannerOptions &opts) {
  return estimatePriced(prof,
                        priceModel(prof, cl, opts.calibration, c.precision,
                                   storageFor(c.precision, opts.publishedStorage).activation,
                                   (double)c.microBatch),
                        base, cl, c, opts);
}

//===----------------------------------------------------------------------===//
// Constraints
//===----------------------------------------------------------------------===//

const std::vector<std::string> &constraintFields() {
  static const std::vector<std::string> f = {"dp",
                                             "tp",
                                             "pp",
                                             "ep",
                                             "zero",
                                             "sequence_parallel",
                                             "num_micro_batches",
                                             "micro_batch_size",
                                             "schedule",
                                             "virtual_stages",
                                             "recompute",
                                             "precision",
                                             "grad_accumulation",
                                             "sync_batch_norm"};
  return f;
}

namespace {

bool isNumericField(const std::string &f) {
  return f != "schedule" && f != "recompute" && f != "precision" && f != "sequence_parallel" &&
         f != "grad_accumulation" && f != "sync_batch_norm";
}

bool checkValue(const std::string &field, const std::string &value, std::string &error) {
  auto in = [&](std::initializer_list<const char *> ok) {
    for (const char *o : ok)
      if (value == o)
        return true;
    return false;
  };
  if (field == "schedule") {
    if (!in({"gpipe", "1f1b", "interleaved"})) {
      error = "schedule must be gpipe, 1f1b or interleaved, got '" + value + "'";
      return false;
    }
    return true;
  }
  if (field == "recompute") {
    if (!in({"none", "selective", "full"})) {
      error = "recompute must be none, selective or full, got '" + value + "'";
      return false;
    }
    return true;
  }
  if (field == "precision") {
    if (!in({"fp32", "bf16", "fp16"})) {
      error = "precision must be fp32, bf16 or fp16, got '" + value + "'";
      return false;
    }
    return true;
  }
  if (field == "grad_accumulation") {
    if (!in({"fp32", "16bit"})) {
      error = "grad_accumulation must be fp32 or 16bit, got '" + value + "'";
      return false;
    }
    return true;
  }
  if (field == "sequence_parallel" || field == "sync_batch_norm") {
    if (!in({"true", "false", "1", "0"})) {
      error = field + " must be true or false, got '" + value + "'";
      return false;
    }
    return true;
  }
  char *end = nullptr;
  long long n = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end || n < (field == "zero" ? 0 : 1) || n > (1 << 24) ||
      (field == "zero" && n > 3)) {
    error = field + " must be " +
            (field == "zero" ? std::string("0, 1, 2 or 3") : std::string("a positive integer")) +
            ", got '" + value + "'";
    return false;
  }
  return true;
}

bool addFixed(Constraints &c, const std::string &field, std::string value, const std::string &what,
              std::string &error) {
  const auto &fields = constraintFields();
  if (std::find(fields.begin(), fields.end(), field) == fields.end()) {
    std::string names;
    for (const auto &f : fields)
      names += (names.empty() ? "" : ", ") + f;
    error = what + ": unknown plan field '" + field + "' (fields: " + names + ")";
    return false;
  }
  if (value == "1" && (field == "sequence_parallel" || field == "sync_batch_norm"))
    value = "true";
  if (value == "0" && (field == "sequence_parallel" || field == "sync_batch_norm"))
    value = "false";
  if (!checkValue(field, value, error)) {
    error = what + ": " + error;
    return false;
  }
  auto it = c.fixed.find(field);
  if (it != c.fixed.end() && it->second != value) {
    error = what + ": " + field + " is fixed twice, to " + it->second + " and to " + value;
    return false;
  }
  c.fixed[field] = value;
  return true;
}

bool parseBytes(const json &v, double &out) {
  if (v.is_number()) {
    out = v.get<double>();
    return out >= 0;
  }
  if (!v.is_string())
    return false;
  std::string s = v.get<std::string>();
  char *end = nullptr;
  double n = std::strtod(s.c_str(), &end);
  std::string unit(end);
  double mul = unit.empty() || unit == "B" ? 1
               : unit == "KiB"             ? 1024.0
               : unit == "MiB"             ? 1048576.0
               : unit == "GiB"             ? 1073741824.0
               : unit == "GB"              ? 1e9
               : unit == "MB"              ? 1e6
                                           : -1;
  if (end == s.c_str() || mul < 0 || n < 0)
    return false;
  out = n * mul;
  return true;
}

/// Parses `text` as a JSON object; `what` names it in errors, `example` shows one.
bool parseObject(const std::string &text, const std::string &what, const char *example, json &j,
                 std::string &error) {
  std::string cause;
  if (!parseBoundedJson(text, j, cause, /*rawMessage=*/true)) {
    error = what + ": " + cause;
    return false;
  }
  if (!j.is_object()) {
    error = what + ": " + example;
    return false;
  }
  return true;
}

} // namespace

std::string formatSeconds(double t) {
  char s[32];
  if (t >= 1)
    snprintf(s, sizeof s, "%.3f s", t);
  else if (t >= 1e-3)
    snprintf(s, sizeof s, "%.2f ms", t * 1e3);
  else
    snprintf(s, sizeof s, "%.1f us", t * 1e6);
  return s;
}

bool parseFixed(const std::string &text, Constraints &c, std::string &error) {
  std::stringstream ss(text);
  std::string item;
  bool any = false;
  while (std::getline(ss, item, ',')) {
    if (item.empty())
      continue;
    size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
      error = "--fixed: '" + item + "' is not FIELD=VALUE (e.g. --fixed tp=8,pp=16)";
      return false;
    }
    if (!addFixed(c, item.substr(0, eq), item.substr(eq + 1), "--fixed", error))
      return false;
    any = true;
  }
  if (!any) {
    error = "--fixed: nothing given (e.g. --fixed tp=8,pp=16)";
    return false;
  }
  return true;
}

bool parseConstraints(const std::string &text, const std::string &what, Constraints &c,
                      std::string &error) {
  json j;
  if (!parseObject(text, what, "constraints are a JSON object, e.g. {\"fixed\": {\"tp\": 8}}", j,
                   error))
    return false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string &key = it.key();
    const json &v = it.value();
    if (key == "fixed") {
      if (!v.is_object()) {
        error = what + ": \"fixed\" must be an object of plan fields";
        return false;
      }
      for (auto f = v.begin(); f != v.end(); ++f) {
        std::string val = f.value().is_string()    ? f.value().get<std::string>()
                          : f.value().is_boolean() ? (f.value().get<bool>() ? "true" : "false")
                                                   : f.value().dump();
        if (!addFixed(c, f.key(), val, what + ": fixed", error))
          return false;
      }
    } else if (key == "bounds") {
      if (!v.is_object()) {
        error = what + ": \"bounds\" must map fields to {\"min\": N, \"max\": N}";
        return false;
      }
      for (auto f = v.begin(); f != v.end(); ++f) {
        const auto &fields = constraintFields();
        if (std::find(fields.begin(), fields.end(), f.key()) == fields.end() ||
            !isNumericField(f.key())) {
          error = what + ": bounds: '" + f.key() +
                  "' is not a numeric plan field (dp, tp, pp, zero, num_micro_batches, "
                  "micro_batch_size, virtual_stages)";
          return false;
        }
        const json &b = f.value();
        if (!b.is_object() || b.empty()) {
          error = what + ": bounds: '" + f.key() + "' must be {\"min\": N, \"max\": N}";
          return false;
        }
        double lo = 0, hi = 1e18;
        for (auto x = b.begin(); x != b.end(); ++x) {
          if ((x.key() != "min" && x.key() != "max") || !x.value().is_number_integer()) {
            error = what + ": bounds: '" + f.key() + "': only integer \"min\" and \"max\", got \"" +
                    x.key() + "\": " + x.value().dump();
            return false;
          }
          (x.key() == "min" ? lo : hi) = x.value().get<double>();
        }
        if (lo > hi) {
          error = what + ": bounds: '" + f.key() + "' has min " + std::to_string((long long)lo) +
                  " above max " + std::to_string((long long)hi);
          return false;
        }
        c.bounds[f.key()] = {lo, hi};
      }
    } else if (key == "pin") {
      if (!v.is_object()) {
        error = what + ": \"pin\" must map op-name globs to a dimension or \"replicate\"";
        return false;
      }
      for (auto f = v.begin(); f != v.end(); ++f) {
        if (!f.value().is_string() || f.value().get<std::string>().empty()) {
          error = what + ": pin: '" + f.key() + "' must name a dimension or \"replicate\"";
          return false;
        }
        c.pins.push_back({f.key(), f.value().get<std::string>()});
      }
    } else if (key == "no_split") {
      if (!v.is_array()) {
        error = what + ": \"no_split\" must be a list of dimensions (batch, sequence, layers, "
                       "hidden)";
        return false;
      }
      for (const json &d : v) {
        std::string s = d.is_string() ? d.get<std::string>() : "";
        if (s != "batch" && s != "sequence" && s != "layers" && s != "hidden") {
          error = what + ": no_split: " + d.dump() +
                  " is not a dimension the planner splits (batch, sequence, layers, hidden)";
          return false;
        }
        c.noSplit.insert(s);
      }
    } else if (key == "memory_headroom") {
      double x = 0;
      if (v.is_number_float() && v.get<double>() >= 0 && v.get<double>() < 1) {
        c.headroomFraction = v.get<double>();
      } else if (v.is_string() && parseBytes(v, x)) {
        c.headroomBytes = x;
      } else {
        error = what +
                ": memory_headroom must be a fraction in [0, 1) or bytes like \"4GiB\", "
                "got " +
                v.dump();
        return false;
      }
    } else {
      error = what + ": unknown key \"" + key +
              "\" (keys: fixed, bounds, pin, no_split, memory_headroom)";
      return false;
    }
  }
  return true;
}

std::vector<std::pair<double, double>> Calibration::defaultGemmEfficiency() {
  // An A100's bf16 GEMMs (docs/planner.md, "GEMM efficiency by shape"): the
  // best measured shapes reach 0.87 of peak; a GEMM with a small dimension
  // runs short K loops and partial tiles and waves, and falls further.
  return {{64, 0.30},   {128, 0.45},  {256, 0.60},  {512, 0.70},
          {1024, 0.77}, {2048, 0.81}, {4096, 0.84}, {8192, 0.86}};
}

double Calibration::gemmEfficiencyAt(double dim) const {
  const auto &t = gemmEfficiency;
  if (dim <= t.front().first)
    return t.front().second;
  for (size_t i = 1; i < t.size(); ++i)
    if (dim <= t[i].first) {
      double f = std::log2(dim / t[i - 1].first) / std::log2(t[i].first / t[i - 1].first);
      return t[i - 1].second + f * (t[i].second - t[i - 1].second);
    }
  return t.back().second;
}

namespace {

bool fraction(const json &v, const std::string &what, const std::string &key, std::string &error) {
  if (v.is_number() && v.get<double>() > 0 && v.get<double>() <= 1)
    return true;
  error = what + ": \"" + key + "\" must be a positive number at most 1, got " + v.dump();
  return false;
}

/// `"gemm_efficiency": [[dimension, fraction], ...]`, dimensions increasing.
bool parseGemmTable(const json &v, const std::string &what,
                    std::vector<std::pair<double, double>> &table, std::string &error) {
  const std::string shape = what + ": \"gemm_efficiency\" must be a list of [dimension, "
                                   "fraction of peak] pairs with increasing dimensions, got ";
  if (!v.is_array() || v.empty()) {
    error = shape + v.dump();
    return false;
  }
  table.clear();
  for (const json &p : v) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number() || p[0].get<double>() < 1 ||
        (!table.empty() && p[0].get<double>() <= table.back().first)) {
      error = shape + p.dump();
      return false;
    }
    if (!fraction(p[1], what, "gemm_efficiency", error))
      return false;
    table.push_back({p[0].get<double>(), p[1].get<double>()});
  }
  return true;
}

} // namespace

bool parseCalibration(const std::string &text, const std::string &what, Calibration &cal,
                      std::string &error) {
  json j;
  if (!parseObject(text, what, "a calibration table is a JSON object", j, error))
    return false;
  if (j.contains("matmul_efficiency") && j.contains("gemm_efficiency")) {
    error = what + ": give \"gemm_efficiency\" (a table by GEMM shape) or "
                   "\"matmul_efficiency\" (one fraction for every GEMM), not both";
    return false;
  }
  std::map<std::string, double *> fields = {{"memory_efficiency", &cal.memoryEfficiency},
                                            {"link_efficiency", &cal.linkEfficiency},
                                            {"kernel_overhead_s", &cal.kernelOverhead},
                                            {"bucket_bytes", &cal.bucketBytes}};
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "gemm_efficiency") {
      if (!parseGemmTable(it.value(), what, cal.gemmEfficiency, error))
        return false;
      continue;
    }
    if (it.key() == "matmul_efficiency") {
      if (!fraction(it.value(), what, it.key(), error))
        return false;
      cal.gemmEfficiency = {{1, it.value().get<double>()}};
      continue;
    }
    auto f = fields.find(it.key());
    if (f == fields.end()) {
      error = what + ": unknown key \"" + it.key() +
              "\" (keys: gemm_efficiency, matmul_efficiency, memory_efficiency, "
              "link_efficiency, kernel_overhead_s, bucket_bytes)";
      return false;
    }
    if (it.key().find("efficiency") != std::string::npos) {
      if (!fraction(it.value(), what, it.key(), error))
        return false;
    } else if (!it.value().is_number() || it.value().get<double>() <= 0) {
      error = what + ": \"" + it.key() + "\" must be a positive number, got " + it.value().dump();
      return false;
    }
    *f->second = it.value().get<double>();
  }
  return true;
}

//===----------------------------------------------------------------------===//
// Search
//===----------------------------------------------------------------------===//

namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i * i <= n; ++i)
    if (n % i == 0) {
      d.push_back(i);
      if (i != n / i)
        d.push_back(n / i);
    }
  std::sort(d.begin(), d.end());
  return d;
}

struct Space {
  const Constraints &cons;
  bool fixedHas(const std::string &f) const { return cons.fixed.count(f) > 0; }
  bool allows(const std::string &f, double v) const {
    auto it = cons.fixed.find(f);
    if (it != cons.fixed.end() && std::to_string((long long)v) != it->second)
      return false;
    auto b = cons.bounds.find(f);
    if (b != cons.bounds.end() && (v < b->second.first || v > b->second.second))
      return false;
    return true;
  }
  bool allowsText(const std::string &f, const std::string &v) const {
    auto it = cons.fixed.find(f);
    return it == cons.fixed.end() || it->second == v;
  }
};

/// Why `e` lost to `best`, in one phrase: the largest difference.
std::string whyLost(const Estimate &e, const Estimate &best) {
  struct Part {
    const char *name;
    double a, b;
  };
  Part parts[] = {
      {"compute", e.time.compute - e.time.recompute, best.time.compute - best.time.recompute},
      {"recomputation", e.time.recompute, best.time.recompute},
      {"tp communication", e.time.tpComm, best.time.tpComm},
      {"expert all-to-alls", e.time.epComm, best.time.epComm},
      {"pipeline bubble", e.time.bubble, best.time.bubble},
      {"pipeline sends", e.time.p2p, best.time.p2p},
      {"exposed gradient reduction", e.time.dpExposed, best.time.dpExposed},
      {"optimizer step", e.time.optimizer, best.time.optimizer},
  };
  const Part *worst = &parts[0];
  for (const Part &p : parts)
    if (p.a - p.b > worst->a - worst->b)
      worst = &p;
  char pct[32];
  snprintf(pct, sizeof pct, "+%.1f%%", (e.time.total / best.time.total - 1) * 100);
  return std::string(pct) + " step time: more " + worst->name + " (" + formatSeconds(worst->a) +
         " vs " + formatSeconds(worst->b) + ")";
}

} // namespace

SearchResult searchPlans(const Profile &base, const ProfileSource &profiles, const Cluster &cl,
                         const PlannerOptions &opts) {
  SearchResult res;
  const Constraints &cons = opts.constraints;
  Space sp{cons};
  const int N = cl.worldSize();
  const int64_t B = opts.globalBatch;
  const int L = (int)base.layers.size();
  auto fixedStr = [&](const std::string &f, const std::string &dflt) {
    auto it = cons.fixed.find(f);
    return it == cons.fixed.end() ? dflt : it->second;
  };

  // Contradictions the constraints carry on their own.
  for (const auto &[f, b] : cons.bounds) {
    auto it = cons.fixed.find(f);
    if (it != cons.fixed.end()) {
      double v = std::atof(it->second.c_str());
      if (v < b.first || v > b.second) {
        res.contradiction =
            f + " is fixed to " + it->second + " but bounded to [" +
            std::to_string((long long)b.first) + ", " +
            (b.second >= 1e17 ? std::string("inf") : std::to_string((long long)b.second)) + "]";
        return res;
      }
    }
  }
  auto contra = [&](const std::string &f, const char *dim, const char *what) {
    auto it = cons.fixed.find(f);
    if (cons.noSplit.count(dim) && it != cons.fixed.end() && it->second != "1" &&
        it->second != "false")
      res.contradiction = f + " is fixed to " + it->second + " but no_split forbids splitting " +
                          dim + " (" + what + ")";
  };
  contra("dp", "batch", "data parallelism splits the batch");
  contra("tp", "hidden", "tensor parallelism splits the hidden dimension");
  contra("pp", "layers", "pipeline parallelism splits the layers");
  contra("sequence_parallel", "sequence", "sequence parallelism splits the sequence");
  if (!res.contradiction.empty())
    return res;
  if (std::atoi(fixedStr("ep", "1").c_str()) > 1 && base.experts == 0) {
    res.contradiction = "ep is fixed to " + fixedStr("ep", "1") +
                        " but the model has no routed mixture-of-experts layer to split "
                        "(docs/moe.md)";
    return res;
  }
  if (std::atoi(fixedStr("ep", "1").c_str()) > 1 &&
      base.experts % std::atoi(fixedStr("ep", "1").c_str()) != 0) {
    res.contradiction = "ep is fixed to " + fixedStr("ep", "1") +
                        " but it does not divide the experts of the model's routed layers (" +
                        std::to_string(base.experts) + ")";
    return res;
  }
  if (fixedStr("sequence_parallel", "false") == "true" && fixedStr("tp", "0") == "1") {
    res.contradiction = "sequence_parallel is fixed on but tp is fixed to 1 (it splits along tp)";
    return res;
  }
  if (cons.fixed.count("dp") && cons.fixed.count("tp") && cons.fixed.count("pp")) {
    long long w = std::atoll(cons.fixed.at("dp").c_str()) *
                  std::atoll(cons.fixed.at("tp").c_str()) * std::atoll(cons.fixed.at("pp").c_str());
    if (w != N) {
      res.contradiction = "dp x tp x pp is fixed to " + std::to_string(w) +
                          " ranks but the cluster has " + std::to_string(N) + " devices";
      return res;
    }
  }

  const std::string precision =
      fixedStr("precision", cl.device.peakFlops.count("bf16") == 0 ? "fp32" : "bf16");
  const std::string gradAccumulation = fixedStr("grad_accumulation", "fp32");
  // Carried into the plan, not priced: two all-reduces of C values per batch
  // norm and direction.
  const bool syncBatchNorm = fixedStr("sync_batch_norm", "false") == "true";
  if (gradAccumulation == "16bit" && precision == "fp32") {
    res.contradiction = "grad_accumulation 16bit keeps gradients in 16 bits and needs precision "
                        "bf16 or fp16";
    return res;
  }
  const int maxTp = std::min(N, cl.devicesPerNode);
  std::vector<std::string> recomputes = {"none", "selective", "full"};
  bool hasAttention = false;
  for (const Segment &s : base.layers)
    hasAttention |= s.core > 0;
  for (const OpWork &w : base.embedding.forward)
    hasAttention |= w.attentionCore;

  bool haveBest = false;
  std::vector<Estimate> all;
  double closestShort = 1e300;
  res.fullyFixed = cons.fixed.count("dp") && cons.fixed.count("tp") && cons.fixed.count("pp");

  for (int64_t tp : divisors(N)) {
    if (tp > maxTp && !cons.fixed.count("tp"))
      continue;
    if (!sp.allows("tp", (double)tp) || (tp > 1 && cons.noSplit.count("hidden")))
      continue;
    for (int spi = 0; spi < 2; ++spi) {
      bool seqPar = spi == 1;
      if (seqPar && tp == 1)
        continue;
      if (!sp.allowsText("sequence_parallel", seqPar ? "true" : "false"))
        continue;
      if (seqPar && cons.noSplit.count("sequence"))
        continue;
      std::string why;
      const Profile *prof = profiles((int)tp, seqPar, why);
      if (!prof) {
        res.skipped.push_back("tp=" + std::to_string(tp) + (seqPar ? " with sp" : "") + ": " + why);
        continue;
      }
      std::map<int64_t, PricedModel> pricedBySize;
      auto pricedAt = [&](int64_t mbs) -> const PricedModel & {
        auto it = pricedBySize.find(mbs);
        if (it == pricedBySize.end())
          it = pricedBySize
                   .emplace(mbs, priceModel(*prof, cl, opts.calibration, precision,
                                            storageFor(precision, opts.publishedStorage).activation,
                                            (double)mbs))
                   .first;
        return it->second;
      };
      for (int64_t pp : divisors(N / tp)) {
        if (!sp.allows("pp", (double)pp) || (pp > 1 && cons.noSplit.count("layers")))
          continue;
        if (pp > std::max(1, L) && !(L == 0 && pp <= 2))
          continue;
        int64_t dp = N / tp / pp;
        if (!sp.allows("dp", (double)dp) || (dp > 1 && cons.noSplit.count("batch")))
          continue;
        if (B % dp != 0) {
          if (res.skipped.size() < 64 && cons.fixed.count("dp"))
            res.skipped.push_back("dp=" + std::to_string(dp) +
                                  " does not divide the global batch " + std::to_string(B));
          continue;
        }
        const int64_t share = B / dp;
        for (int64_t mbs : divisors(share)) {
          int64_t m = share / mbs;
          if (!sp.allows("micro_batch_size", (double)mbs) ||
              !sp.allows("num_micro_batches", (double)m))
            continue;
          std::vector<std::pair<std::string, int>> scheds;
          if (pp == 1) {
            scheds.push_back({"1f1b", 1});
          } else {
            scheds.push_back({"1f1b", 1});
            if (cons.fixed.count("schedule") && cons.fixed.at("schedule") == "gpipe")
              scheds.push_back({"gpipe", 1});
            if (m % pp == 0)
              for (int v = 2; v <= 8 && pp * v <= std::max(1, L); ++v)
                scheds.push_back({"interleaved", v});
          }
          for (auto &[sched, v] : scheds) {
            if (pp > 1 && !sp.allowsText("schedule", sched))
              continue;
            if (!sp.allows("virtual_stages", (double)v))
              continue;
            for (int zero = 0; zero <= 3; ++zero) {
              if (!sp.allows("zero", (double)zero))
                continue;
              if (zero > 0 && dp == 1)
                continue;
              for (const std::string &rc : recomputes) {
                if (!sp.allowsText("recompute", rc))
                  continue;
                if (rc == "selective" && !hasAttention)
                  continue;
                // Expert parallelism: ep dividing dp and every routed layer's
                // experts; compiled without ZeRO.
                for (int64_t ep : divisors(dp)) {
                  if (!sp.allows("ep", (double)ep))
                    continue;
                  if (ep > 1 && (prof->experts == 0 || prof->experts % ep != 0 || zero > 0))
                    continue;
                  Candidate c;
                  c.ep = (int)ep;
                  c.dp = (int)dp;
                  c.tp = (int)tp;
                  c.pp = (int)pp;
                  c.v = v;
                  c.microBatch = mbs;
                  c.m = m;
                  c.schedule = sched;
                  c.zero = zero;
                  c.recompute = rc;
                  c.sp = seqPar;
                  c.precision = precision;
                  c.gradAccumulation = gradAccumulation;
                  c.syncBatchNorm = syncBatchNorm;
                  Estimate e = estimatePriced(*prof, pricedAt(mbs), base, cl, c, opts);
                  ++res.evaluated;
                  if (e.fits) {
                    all.push_back(e);
                    haveBest = true;
                  } else {
                    double shortBy = e.mem.total() - e.capacity;
                    if (shortBy < closestShort) {
                      closestShort = shortBy;
                      res.closest = e;
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  res.anyFits = haveBest;
  // Fastest first (to the nanosecond); at the same time the smaller (to the
  // byte), then the one that recomputes less (recomputation that only hides communication
  // behind a longer backward buys nothing).
  auto recomputeRank = [](const Candidate &c) {
    return c.recompute == "none" ? 0 : c.recompute == "selective" ? 1 : 2;
  };
  auto key = [&](const Estimate &e) {
    return std::make_tuple(std::llround(e.time.total * 1e9), std::llround(e.mem.total()),
                           recomputeRank(e.c));
  };
  std::stable_sort(all.begin(), all.end(),
                   [&](const Estimate &a, const Estimate &b) { return key(a) < key(b); });
  if (all.empty())
    return res;
  // The best, then alternatives: first one per distinct (dp, tp, pp), then the rest.
  res.ranked.push_back(all[0]);
  std::set<std::tuple<int, int, int>> shapes = {{all[0].c.dp, all[0].c.tp, all[0].c.pp}};
  for (size_t i = 1; i < all.size() && (int)res.ranked.size() <= opts.alternatives; ++i)
    if (shapes.insert({all[i].c.dp, all[i].c.tp, all[i].c.pp}).second)
      res.ranked.push_back(all[i]);
  for (size_t i = 1; i < all.size() && (int)res.ranked.size() <= opts.alternatives; ++i) {
    bool dup = false;
    for (const Estimate &r : res.ranked)
      dup |= r.c.key() == all[i].c.key();
    if (!dup)
      res.ranked.push_back(all[i]);
  }
  std::stable_sort(
      res.ranked.begin() + 1, res.ranked.end(),
      [](const Estimate &a, const Estimate &b) { return a.time.total < b.time.total; });
  for (size_t i = 1; i < res.ranked.size(); ++i)
    res.lostWhy.push_back(whyLost(res.ranked[i], res.ranked[0]));
  return res;
}

} // namespace carve::planner
