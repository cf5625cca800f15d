//===- CostModel.cpp - one plan's step time, volumes and throughput -------===//
//
// `estimate`: prices a candidate on a cluster from the model's profile.
// Each op runs at a roofline of the device (a GEMM at the fraction of peak
// the calibration gives its shape); collectives follow alpha-beta models on
// the links they cross. The steps, in order: the layers are balanced over
// the pipeline's chunks; each rank's chunks are walked for their time per
// micro-batch and what they hold (MemoryModel.cpp prices the memory); the
// slowest rank sets the pipeline's time and bubble; the gradients'
// reduction and ZeRO's gathers are priced and what of them backward does
// not hide; then the optimizer, the volumes moved and the throughput.
// docs/planner.md, "Step time".
//
//===----------------------------------------------------------------------===//

#include "compiler/planner/PlannerImpl.h"
#include "compiler/stages/StageSplit.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>

namespace carve::planner {

namespace {

//===----------------------------------------------------------------------===//
// Ops and collectives
//===----------------------------------------------------------------------===//

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

/// `precision`: the peak-FLOPs entry GEMMs run at (Candidate::gemmPeak).
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

//===----------------------------------------------------------------------===//
// One candidate's estimate, step by step
//===----------------------------------------------------------------------===//

/// What every step of one candidate's estimate reads.
struct Setting {
  Setting(const Profile &prof, const PricedModel &priced, const Cluster &cl, const Candidate &c,
          const PlannerOptions &opts)
      : prof(prof), priced(priced), cl(cl), c(c), opts(opts), cal(opts.calibration),
        st(storageFor(c.precision, opts.publishedStorage, c.m, c.zero, c.gradAccumulation,
                      cl.device.target == "cuda")),
        b((double)c.microBatch), S(c.pp * c.v) {
    const int dev = cl.devicesPerNode;
    Link intra{cl.intraNode.bandwidth * cal.linkEfficiency, cl.intraNode.latency};
    Link inter{cl.interNode.bandwidth * cal.linkEfficiency, cl.interNode.latency};
    tpLink = c.tp <= dev ? intra : inter;
    dpLink = c.tp * c.dp <= dev ? intra : inter;
    ppLink = c.tp * c.dp >= dev || c.tp * c.dp * c.pp > dev ? inter : intra;
    // An expert group: ep consecutive dp ranks, tp apart.
    epLink = c.tp * c.ep <= dev ? intra : inter;
  }
  const Profile &prof;
  const PricedModel &priced;
  const Cluster &cl;
  const Candidate &c;
  const PlannerOptions &opts;
  const Calibration &cal;
  const Storage st;
  const double b; // samples per micro-batch
  const int S;    // pipeline chunks, pp * v
  Link tpLink{}, dpLink{}, ppLink{}, epLink{};
};

/// Seconds of a part's tp collectives for one micro-batch.
double tpSecs(const Setting &s, const std::array<double, kNumCommKinds> &el,
              const std::array<int, kNumCommKinds> &calls) {
  double t = 0;
  for (int k = 0; k < kNumCommKinds; ++k)
    t += commTime(k, s.c.tp, el[k] * s.b * s.st.activation, calls[k], s.tpLink);
  return t;
}

/// Expert parallelism: each routed layer's dispatch and combine in forward,
/// the same two in backward; f32 rows, (ep-1)/ep of them leave the rank.
double epSecs(const Setting &s, const Segment &seg) {
  if (s.c.ep <= 1 || seg.expertExchange <= 0)
    return 0.0;
  return commTime(kAllToAll, s.c.ep, seg.expertExchange * s.b * 4.0, 2, s.epLink);
}

/// One micro-batch of a part: forward, backward (+ recompute) seconds.
struct PartTime {
  double fwd = 0, bwd = 0, rec = 0, comm = 0, ep = 0;
};
PartTime partTime(const Setting &s, const Priced &p, const Segment &seg) {
  const Candidate &c = s.c;
  PartTime t;
  const double x = epSecs(s, seg);
  double fc = tpSecs(s, p.fwdComm, p.fwdCalls) + x, bc = tpSecs(s, p.bwdComm, p.bwdCalls) + x;
  t.ep = (c.recompute == "full" ? 3 : 2) * x;
  t.fwd = p.fwd.perSample * s.b + p.fwd.fixed + fc;
  t.bwd = p.bwd.perSample * s.b + p.bwd.fixed + bc;
  t.comm = fc + bc;
  if (c.recompute == "full") {
    t.rec = t.fwd;
    t.comm += fc;
  } else if (c.recompute == "selective") {
    t.rec = p.fwd.coreSample * s.b;
  }
  return t;
}

/// Chunk sizes as carve-split-stages cuts a model whose layers were each
/// profiled (an ONNX model's, alike or not): its balancedPartition, asked
/// once per question (the search asks again for every candidate with the
/// same stages and micro-batch size).
std::vector<int> balanceUnits(const std::vector<double> &unitCost, int S) {
  static std::mutex mu;
  static std::map<std::pair<std::vector<double>, int>, std::vector<int>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(unitCost, S);
  if (auto it = cache.find(key); it != cache.end())
    return it->second;
  if (cache.size() > 4096)
    cache.clear();
  return cache[key] = balancedPartition(unitCost, S);
}

/// The layers of each of the pipeline's chunks, balanced by their time.
std::vector<int> layersPerChunk(const Setting &s) {
  const Profile &prof = s.prof;
  const std::vector<Priced> &lay = s.priced.layers;
  const int L = std::max<int>(1, (int)prof.layers.size());
  const bool hasLayers = !prof.layers.empty();
  double layerCost = 0;
  if (hasLayers) {
    PartTime t = partTime(s, lay[lay.size() / 2], prof.layers[lay.size() / 2]);
    layerCost = t.fwd + t.bwd + t.rec;
  }
  PartTime et = partTime(s, s.priced.embedding, prof.embedding),
           ht = partTime(s, s.priced.head, prof.head);
  std::vector<int> chunk;
  if (hasLayers && (prof.layersDiffer || prof.layerOrigin.empty()) && s.S > 1) {
    // The embedding's ops join the first layer's unit, the head's the last's.
    // At the micro-batch the compiled step has (the splitter's FLOPs).
    auto at = [&](const Segment &g) { return g.splitFlops * s.b + g.splitFlopsFixed; };
    std::vector<double> cost;
    for (const Segment &l : prof.layers)
      cost.push_back(at(l));
    cost.front() += at(prof.embedding);
    cost.back() += at(prof.head);
    return balanceUnits(cost, s.S);
  }
  if (hasLayers)
    chunk = balanceChunks(L, s.S, layerCost, et.fwd + et.bwd + et.rec, ht.fwd + ht.bwd + ht.rec);
  else
    chunk.assign(s.S, 0);
  return chunk;
}

/// One pipeline rank's time, summed over its chunks: seconds per micro-batch.
struct RankLoad {
  double time = 0;    // forward, backward, recomputation and sends
  double bwdLast = 0; // of which backward (with recomputation)
  double rec = 0;     // of which recomputation
  double comm = 0;    // of which tp collectives and ep's all-to-alls
  double ep = 0;      // ep's all-to-alls
  double p2p = 0;     // pipeline sends
  double parts = 0;   // the parts it runs (layers, the embedding, the head)
  double experts = 0; // routed experts' parameter elements it holds
};

/// Every pipeline rank's time and holdings.
struct Ranks {
  std::vector<RankLoad> load;
  std::vector<RankHoldings> hold;
  double sendBytes = 0; // pipeline sends of one micro-batch, every stage
};

/// One chunk's parts, one micro-batch.
struct ChunkSum {
  double time = 0, bwd = 0, rec = 0, comm = 0, ep = 0; // seconds
  double params = 0, experts = 0, frozen = 0;          // elements
  double kept = 0, work = 0;                           // bytes
  std::vector<PartMemory> parts;                       // in order
};

/// A part's time and memory under one candidate, computed once per layer
/// that stands for others (Profile::layerOrigin).
struct PartPrice {
  bool done = false;
  PartTime time;
  PartMemory memory;
};

void addPart(const Setting &s, const Segment &seg, const Priced &pr, bool isLayer, ChunkSum &sum,
             PartPrice *memo = nullptr) {
  PartPrice fresh;
  PartPrice &price = memo ? *memo : fresh;
  if (!price.done)
    price = {true, partTime(s, pr, seg), partMemory(seg, isLayer, s.c, s.st)};
  const PartTime &pt = price.time;
  sum.time += pt.fwd + pt.bwd + pt.rec;
  sum.bwd += pt.bwd + pt.rec;
  sum.rec += pt.rec;
  sum.comm += pt.comm;
  sum.ep += pt.ep;
  // Expert parallelism: a rank holds 1/ep of the routed experts.
  sum.params += seg.params - seg.expertParams * (1.0 - 1.0 / s.c.ep);
  sum.experts += seg.expertParams / s.c.ep;
  sum.frozen += seg.frozen;
  sum.kept += price.memory.kept;
  sum.work = std::max(sum.work, price.memory.work);
  sum.parts.push_back(price.memory);
}

/// Walks the chunks in order, each on its pipeline rank (chunk k on rank
/// k mod pp), charging the rank each chunk's parts and pipeline sends.
Ranks chargeChunks(const Setting &s, const std::vector<int> &chunk) {
  const Candidate &c = s.c;
  const Profile &prof = s.prof;
  const PricedModel &priced = s.priced;
  const int S = s.S;
  Ranks ranks;
  ranks.load.resize(c.pp);
  ranks.hold.resize(c.pp);
  int first = 0;
  double inputBoundary = 0;
  // Backward sends: each chunk's gradient of its input, fp32, in a buffer
  // per activation slot, kept until the slot is reused (as compiled).
  static const std::vector<std::vector<int>> none;
  const std::vector<std::vector<int>> &slots =
      S > 1 ? pipelineSlots(c.schedule, c.pp, c.v, c.m) : none;
  std::vector<PartPrice> memo(prof.layerOrigin.empty() ? 0 : prof.layers.size());
  for (int k = 0; k < S; ++k) {
    int r = k % c.pp;
    RankLoad &load = ranks.load[r];
    RankHoldings &hold = ranks.hold[r];
    ChunkSum sum;
    sum.parts.reserve(chunk[k] + 2);
    load.parts += chunk[k] + (k == 0) + (k == S - 1);
    if (k == 0)
      addPart(s, prof.embedding, priced.embedding, false, sum);
    for (int i = 0; i < chunk[k]; ++i) {
      const int at = first + i;
      addPart(s, prof.layers[at], priced.layers[at], true, sum,
              prof.layerOrigin.empty() ? nullptr : &memo[prof.layerOrigin[at]]);
    }
    double boundary =
        chunk[k] > 0 ? prof.layers[first + chunk[k] - 1].boundary : prof.embedding.boundary;
    first += chunk[k];
    if (k == S - 1)
      addPart(s, prof.head, priced.head, false, sum);
    if (k > 0 && S > 1)
      hold.buffers += slots[r][k / c.pp] * inputBoundary * s.b * s.st.activation;
    if (k < S - 1 && S > 1) {
      // Activations forward in 16 bits under bf16/fp16, gradients back in fp32.
      double bytes = boundary * s.b * s.st.kept, grad = boundary * s.b * s.st.activation;
      // The sent value is kept until this micro-batch's backward (its buffer
      // is the sender's; the receiver keeps its own as the next layer's
      // input), in fp32 unless this stage's backward reads it too (only then
      // is it rounded to 16 bits and sent as a 16-bit copy:
      // carve-pack-activations), which the profile does not tell: fp32.
      sum.kept += boundary * s.b * s.st.activation;
      double p2p = (bytes + grad) / s.ppLink.bw + 2 * s.ppLink.lat;
      sum.time += p2p;
      load.p2p += p2p;
      ranks.sendBytes += bytes + grad;
    }
    inputBoundary = boundary;
    load.time += sum.time;
    load.bwdLast += sum.bwd;
    load.rec += sum.rec;
    load.comm += sum.comm;
    hold.params += sum.params;
    hold.frozen += sum.frozen;
    load.experts += sum.experts;
    load.ep += sum.ep;
    // One program without stages places transients and kept values in one
    // arena by liveness; a pipeline rank keeps its micro-batches' values in
    // a pool and every call's transients in a scratch region apart.
    hold.workspace =
        std::max(hold.workspace, S == 1 ? chunkScratch(sum.kept, sum.parts) : sum.work);
    // In flight: this chunk's activations times the micro-batches it holds.
    int64_t held = inFlight(c.schedule, c.pp, c.v, c.m, r);
    hold.activations += sum.kept * (c.v > 1 ? (double)held / c.v : (double)held);
  }
  return ranks;
}

/// The pipeline's time per step, set by its slowest rank `slow`: fills
/// `e`'s compute, recomputation, tp and ep collectives, sends and bubble.
double pipelineTime(const Setting &s, const RankLoad &slow, Estimate &e) {
  const Candidate &c = s.c;
  double tMb = slow.time;
  double pipeline = (double)c.m * tMb + (double)(c.pp - 1) / c.v * tMb;
  e.time.bubble = (double)(c.pp - 1) / c.v * tMb;
  e.time.compute = (double)c.m * (tMb - slow.comm - slow.p2p);
  e.time.recompute = (double)c.m * slow.rec;
  e.time.tpComm = (double)c.m * (slow.comm - slow.ep);
  e.time.epComm = (double)c.m * slow.ep;
  e.time.p2p = (double)c.m * slow.p2p;
  e.bubbleFraction = pipeline > 0 ? e.time.bubble / pipeline : 0;
  return pipeline;
}

/// A step's data-parallel collectives, in seconds.
struct DpCollectives {
  double reduce = 0; // the gradients' reduction
  double after = 0;  // ZeRO-1/2's all-gather of the updated parameters
  double total = 0;  // all of them, with ZeRO-3's gathers
};

/// The gradients' reduction and ZeRO's gathers of a rank with `psi`
/// parameter elements, `experts` of them routed experts'; adds the bytes
/// they move to `volume`.
DpCollectives dpCollectives(const Setting &s, double psi, double experts, double &volume) {
  const Candidate &c = s.c;
  const double pB = s.st.param, gB = s.st.grad;
  DpCollectives d;
  double g = psi * gB;
  const double f = (double)(c.dp - 1) / c.dp;
  const double ag = gatherTime(c.dp, psi * pB, s.dpLink); // updated parameters, after the step
  // As compiled (compiler/codegen/Step.cpp): without ZeRO and under ZeRO-1
  // the gradients are all-reduced per bucket during backward, ZeRO-1 then
  // all-gathers the updated parameters; ZeRO-2/3 reduce-scatter per bucket,
  // every micro-batch, into fp32 chunk accumulators (docs/partition.md,
  // "ZeRO with micro-batches and pipelines"), ZeRO-2 then all-gathers the
  // updated parameters once and ZeRO-3 gathers each layer's for every
  // micro-batch's forward and backward.
  if (c.ep > 1) {
    // Expert parallelism (ZeRO 0): the experts' gradients are summed over
    // the dp/ep ranks that hold the same experts, the rest over dp.
    const double ge = experts * gB, gd = g - ge;
    const int edp = c.dp / c.ep;
    d.reduce = allReduceTime(c.dp, gd, s.dpLink) + allReduceTime(edp, ge, s.dpLink);
    volume = 2 * f * gd + (edp > 1 ? 2.0 * (edp - 1) / edp * ge : 0);
  } else if (c.zero <= 1) {
    d.reduce = allReduceTime(c.dp, g, s.dpLink);
    volume = 2 * f * g;
  } else {
    d.reduce = (double)c.m * gatherTime(c.dp, g, s.dpLink);
    volume = f * (double)c.m * g;
  }
  if (c.zero == 1 || c.zero == 2) {
    d.after = ag;
    volume += f * psi * pB;
  }
  d.total = d.reduce + d.after;
  if (c.zero == 3) {
    d.total += 2.0 * (double)c.m * ag;
    volume += 2.0 * c.m * f * psi * pB;
  }
  return d;
}

/// What of the collectives `d` does not hide behind compute; `compute` is
/// the step's (e.time.compute).
double dpExposed(const Setting &s, const DpCollectives &d, double psi, const RankLoad &slow,
                 double compute) {
  const Candidate &c = s.c;
  const double pB = s.st.param, g = psi * s.st.grad;
  if (c.zero == 3) {
    // Plans carve plan writes prefetch one layer (zero3_prefetch_layers =
    // 1): a part's gathers run while the part before it computes, and its
    // gradients' reduce-scatter while the parts after it in backward do.
    // Per micro-batch, forward exposes the first part's gather or what
    // the gathers take beyond forward's compute; backward likewise with
    // its gathers and reduce-scatters.
    const double parts = std::max(1.0, slow.parts);
    const double G = gatherTime(c.dp, psi * pB, s.dpLink), R = gatherTime(c.dp, g, s.dpLink);
    const double fwd = slow.time - slow.bwdLast - slow.p2p, bwd = slow.bwdLast;
    return (double)c.m * (std::max(G / parts, G - fwd) + std::max((G + R) / parts, G + R - bwd));
  }
  if (!s.cal.gradientOverlap)
    return d.reduce + d.after; // reduced after the backward, not behind it
  const double buckets = std::max(1.0, std::ceil(g / s.cal.bucketBytes));
  // The reduction hides behind backward (the last micro-batch's, or with
  // per-micro-batch reduce-scatters the whole step's compute) except its
  // last bucket; the all-gather after the update does not hide.
  if (c.zero <= 1 || c.m == 1)
    return std::max(d.reduce / buckets, d.reduce - slow.bwdLast) + d.after;
  return std::max(d.reduce / c.m / buckets, d.reduce - compute) + d.after;
}

/// The bytes the busiest rank moves per step over tp, the pipeline and ep
/// (e.volume; dpCollectives adds the data-parallel ones).
void chargeVolume(const Setting &s, double sendBytes, Estimate &e) {
  const Candidate &c = s.c;
  const Profile &prof = s.prof;
  const double forwards = c.recompute == "full" ? 2 : 1;
  for (int k = 0; k < kNumCommKinds; ++k) {
    double el = 0;
    auto add = [&](const Segment &seg) {
      el += seg.forwardComm.elems[k] * forwards + seg.backwardComm.elems[k];
    };
    add(prof.embedding);
    for (const Segment &seg : prof.layers)
      add(seg);
    add(prof.head);
    e.volume.tp[k] = c.tp > 1 ? el * s.b * s.st.activation * (double)c.m / c.pp : 0;
  }
  e.volume.pp = sendBytes * (double)c.m / std::max(1, c.pp);
  if (c.ep > 1) {
    double x = 0;
    for (const Segment &seg : prof.layers)
      x += seg.expertExchange;
    x += prof.embedding.expertExchange + prof.head.expertExchange;
    // Dispatch and combine, forward and backward (and forward again under
    // full recomputation); what leaves the rank.
    e.volume.ep = (c.recompute == "full" ? 3 : 2) * x * s.b * 4.0 * (double)(c.ep - 1) / c.ep *
                  (double)c.m / c.pp;
  }
}

/// Tokens per second, TFLOP/s per device and MFU of the step `e` prices.
void chargeThroughput(const Setting &s, const Profile &base, Estimate &e) {
  const Candidate &c = s.c;
  const double samples = s.b * (double)c.m * c.dp;
  const double tokens = samples * (double)std::max<int64_t>(1, base.seq);
  e.tokensPerSecond = tokens / e.time.total;
  const double flops = base.modelFlops * samples;
  e.tflopsPerDevice = flops / e.time.total / s.cl.worldSize() / 1e12;
  e.mfu = flops / e.time.total / s.cl.worldSize() / s.cl.peak(c.gemmPeak());
}

} // namespace

PricedModel priceModel(const Profile &prof, const Cluster &cl, const Calibration &cal,
                       const std::string &precision, double bytes, double mb) {
  PricedModel m;
  m.embedding = price(prof.embedding, cl, cal, precision, bytes, mb);
  m.head = price(prof.head, cl, cal, precision, bytes, mb);
  m.layers.reserve(prof.layers.size());
  for (size_t i = 0; i < prof.layers.size(); ++i) {
    const size_t from = prof.layerOrigin.empty() ? i : (size_t)prof.layerOrigin[i];
    if (from < i)
      m.layers.push_back(m.layers[from]); // a copy of that layer: the same price
    else
      m.layers.push_back(price(prof.layers[i], cl, cal, precision, bytes, mb));
  }
  return m;
}

Estimate estimatePriced(const Profile &prof, const PricedModel &priced, const Profile &base,
                        const Cluster &cl, const Candidate &c, const PlannerOptions &opts) {
  const Setting s(prof, priced, cl, c, opts);
  Estimate e;
  e.c = c;
  e.layersPerStage = layersPerChunk(s);
  Ranks ranks = chargeChunks(s, e.layersPerStage);
  if (c.pp == 1) {
    ranks.hold[0].params -= prof.sharedParams;
    ranks.hold[0].frozen -= prof.sharedFrozen;
  }
  if (c.pp > 1 && prof.stagesUnmodelled)
    holdWholeModel(c, ranks.hold);

  const RankLoad &slow =
      *std::max_element(ranks.load.begin(), ranks.load.end(),
                        [](const RankLoad &a, const RankLoad &b) { return a.time < b.time; });
  const double pipeline = pipelineTime(s, slow, e);

  // Data parallel: gradients (and ZeRO gathers) of the rank with most parameters.
  double psi = ranks.hold[0].params;
  for (const RankHoldings &h : ranks.hold)
    psi = std::max(psi, h.params);
  if (c.dp > 1) {
    const DpCollectives d = dpCollectives(s, psi, slow.experts, e.volume.dp);
    e.time.dpComm = d.total;
    e.time.dpExposed = dpExposed(s, d, psi, slow, e.time.compute);
  }
  double updated = c.zero >= 1 ? std::ceil(psi / c.dp) : psi;
  e.time.optimizer = updated * 32.0 / (cl.device.memoryBandwidth * s.cal.memoryEfficiency) +
                     20 * s.cal.kernelOverhead;
  e.time.total = pipeline + e.time.dpExposed + e.time.optimizer;

  chargeMemory(prof, cl, c, s.st, opts, ranks.hold, e);
  chargeVolume(s, ranks.sendBytes, e);
  chargeThroughput(s, base, e);
  return e;
}

Estimate estimate(const Profile &prof, const Profile &base, const Cluster &cl, const Candidate &c,
                  const PlannerOptions &opts) {
  return estimatePriced(prof,
                        priceModel(prof, cl, opts.calibration, c.gemmPeak(),
                                   storageFor(c.precision, opts.publishedStorage).activation,
                                   (double)c.microBatch),
                        base, cl, c, opts);
}

} // namespace carve::planner
