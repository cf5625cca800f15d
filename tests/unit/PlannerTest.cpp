//===- PlannerTest.cpp - the planner's memory and cost model --------------===//
//
// The memory model against the published formulas, to the byte: per-layer
// activations of a GPT layer with 16-bit activations (*Reducing Activation
// Recomputation in Large Transformer Models*, 2022) under no parallelism, tp, tp + sequence
// parallelism, selective and full recomputation; parameters, gradients and optimizer state under
// every ZeRO stage and precision. Then constraints, infeasible requests and the cost model's basic
// laws.
//
//===----------------------------------------------------------------------===//

#include "compiler/planner/Planner.h"
#include "compiler/schedule/Schedule.h"

#include "mlir/IR/MLIRContext.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>

using namespace carve;
using namespace carve::planner;

namespace {

// s sequence, b micro-batch, h hidden, a heads.
constexpr double s = 64, h = 64, a = 4;

std::string gptSpec(bool dropout, int layers = 3) {
  return "builtin:gpt:layers=" + std::to_string(layers) + ",hidden=64,heads=4,seq=64,vocab=256" +
         (dropout ? ",dropout=0.1" : "");
}

/// Loads a model once and profiles it under any (tp, sp).
struct Fixture {
  mlir::MLIRContext ctx;
  ProfileRequest req;
  ProfileModel model;
  std::map<std::pair<int, bool>, std::unique_ptr<Profile>> cache;

  explicit Fixture(const std::string &spec, std::vector<OpOverride> pins = {}) {
    req.model = spec;
    req.pins = std::move(pins);
    std::string error;
    EXPECT_TRUE(loadProfileModel(ctx, req, model, error)) << error;
  }
  const Profile *get(int tp, bool sp, std::string &error) {
    auto key = std::make_pair(tp, sp);
    if (!cache.count(key)) {
      ProfileRequest r = req;
      r.tp = tp;
      r.sequenceParallel = sp;
      auto p = std::make_unique<Profile>();
      if (!buildProfile(model, r, *p, error))
        p.reset();
      cache[key] = std::move(p);
    }
    if (!cache[key] && error.empty())
      error = "profile failed";
    return cache[key].get();
  }
  const Profile &at(int tp, bool sp = false) {
    std::string error;
    const Profile *p = get(tp, sp, error);
    EXPECT_NE(p, nullptr) << error;
    return *p;
  }
};

Candidate cand(int tp, bool sp, const std::string &recompute, int64_t b,
               const std::string &precision = "bf16") {
  Candidate c;
  c.tp = tp;
  c.sp = sp;
  c.recompute = recompute;
  c.microBatch = b;
  c.precision = precision;
  return c;
}

TEST(PlannerMemory, PublishedActivationsWithDropout) {
  Fixture f(gptSpec(true));
  for (double b : {1.0, 2.0, 4.0}) {
    const double sbh = s * b * h, core = a * s * s * b;
    // sbh(34 + 5as/h): no parallelism.
    EXPECT_EQ(layerActivationBytes(f.at(1).layers[1], cand(1, false, "none", b), 2),
              sbh * 34 + 5 * core);
    for (int t : {2, 4}) {
      // sbh(10 + 24/t + 5as/(ht)): tensor parallel.
      EXPECT_EQ(layerActivationBytes(f.at(t).layers[1], cand(t, false, "none", b), 2),
                sbh * 10 + sbh * 24 / t + 5 * core / t)
          << "t=" << t;
      // sbh(34/t + 5as/(ht)): tensor and sequence parallel.
      EXPECT_EQ(layerActivationBytes(f.at(t, true).layers[1], cand(t, true, "none", b), 2),
                sbh * 34 / t + 5 * core / t)
          << "t=" << t;
      // sbh 34/t: adding selective recomputation.
      EXPECT_EQ(layerActivationBytes(f.at(t, true).layers[1], cand(t, true, "selective", b), 2),
                sbh * 34 / t)
          << "t=" << t;
      // Full recomputation keeps the layer input, sharded by sequence parallelism.
      EXPECT_EQ(layerActivationBytes(f.at(t, true).layers[1], cand(t, true, "full", b), 2),
                2 * sbh / t);
    }
    // 2sbh with full recomputation.
    EXPECT_EQ(layerActivationBytes(f.at(1).layers[1], cand(1, false, "full", b), 2), 2 * sbh);
    EXPECT_EQ(layerActivationBytes(f.at(1).layers[1], cand(1, false, "selective", b), 2), 34 * sbh);
  }
}

TEST(PlannerMemory, ActivationsWithoutDropoutAndInFp32) {
  Fixture f(gptSpec(false));
  const double b = 2, sbh = s * b * h, core = a * s * s * b;
  // No masks, no dropped probabilities: 32sbh + 2as^2b with 16-bit activations.
  EXPECT_EQ(layerActivationBytes(f.at(1).layers[1], cand(1, false, "none", b), 2),
            32 * sbh + 2 * core);
  // fp32 doubles every 16-bit term.
  EXPECT_EQ(layerActivationBytes(f.at(1).layers[1], cand(1, false, "none", b, "fp32"), 4),
            64 * sbh + 4 * core);
  // Every layer of the model is alike, including the first and last.
  for (const Segment &l : f.at(2, true).layers)
    EXPECT_EQ(layerActivationBytes(l, cand(2, true, "none", b), 2), (32 * sbh + 2 * core) / 2);
  // carve's programs keep 16-bit activations from forward to backward under
  // bf16 and fp16 (carve-pack-activations) and compute in fp32 (scratch and
  // tp collectives 4 bytes); the published layout is 16-bit throughout.
  for (const char *prec : {"fp32", "bf16", "fp16"}) {
    const bool p16 = std::string(prec) != "fp32";
    EXPECT_EQ(storageFor(prec).activation, 4) << prec;
    EXPECT_EQ(storageFor(prec).kept, p16 ? 2 : 4) << prec;
    EXPECT_EQ(storageFor(prec, true).activation, p16 ? 2 : 4) << prec;
    EXPECT_EQ(storageFor(prec, true).kept, p16 ? 2 : 4) << prec;
  }
}

TEST(PlannerMemory, ZeroStagesExactToTheByte) {
  Fixture f(gptSpec(false));
  // A cluster with room for everything.
  Cluster cl;
  std::string error;
  ASSERT_TRUE(parseCluster("a100-80gb:1x8", cl, error)) << error;
  const Profile &p = f.at(1);
  // Trainable parameters of the model (the tied embedding once).
  // wte (tied with the head, counted once), wpe, 3 layers of 12h^2 + 13h, ln_f.
  const double psi = 256 * h + s * h + 3 * (12 * h * h + 13 * h) + 2 * h;
  ASSERT_EQ(p.totalParams, psi);
  for (const char *prec : {"fp32", "bf16", "fp16"})
    for (bool published : {false, true})
      for (int64_t m : {1, 2})
        for (const char *accumulation : {"fp32", "16bit"}) {
          // carve's programs: fp32 weights, gradients and AdamW state under
          // fp32; under bf16/fp16 16-bit weight copies, an fp32 master with m
          // and v, and 16-bit gradients (carve-store-grads16) unless m > 1
          // micro-batches accumulate them in fp32: whole fp32 gradients
          // under ZeRO-0/1, fp32 chunk accumulators under ZeRO-2/3. The
          // published mixed-precision layout: 16-bit weights and gradients,
          // an fp32 master copy with m and v.
          const bool mixed = std::string(prec) != "fp32";
          if (!mixed && std::string(accumulation) != "fp32")
            continue;
          const bool fp32Acc = !published && m > 1 && std::string(accumulation) == "fp32";
          const double pB = mixed ? 2 : 4, oB = mixed ? 12 : 8;
          PlannerOptions opts;
          opts.publishedStorage = published;
          for (int dp : {1, 2, 4, 8})
            for (int zero = 0; zero <= 3; ++zero) {
              if (zero && dp == 1)
                continue;
              const double gB = !mixed || (fp32Acc && zero < 2) ? 4 : 2;
              const double accB = !mixed || fp32Acc ? 4 : 2; // a ZeRO-2/3 chunk's
              Candidate c = cand(1, false, "none", 1, prec);
              c.dp = dp;
              c.zero = zero;
              c.m = m;
              c.gradAccumulation = accumulation;
              Estimate e = estimate(p, p, cl, c, opts);
              const double shard = std::ceil(psi / dp);
              const std::string what = std::string(prec) + " zero " + std::to_string(zero) +
                                       " published " + std::to_string(published) + " m " +
                                       std::to_string(m) + " accumulation " + accumulation;
              EXPECT_EQ(e.mem.params, (zero >= 3 ? shard : psi) * pB) << what;
              EXPECT_EQ(e.mem.grads, zero >= 2 ? shard * accB : psi * gB) << what;
              EXPECT_EQ(e.mem.optimizer, (zero >= 1 ? shard : psi) * oB) << what;
              // Mixed precision without accumulation: ZeRO's (2 + 2 + 12) psi
              // / dp under ZeRO-3, and its 2 + 2 + 12 psi at ZeRO-0.
              if (mixed && !fp32Acc && zero == 3)
                EXPECT_EQ(e.mem.params + e.mem.grads + e.mem.optimizer, 16 * shard) << what;
              if (mixed && !fp32Acc && zero == 0)
                EXPECT_EQ(e.mem.params + e.mem.grads + e.mem.optimizer, 16 * psi) << what;
            }
        }
}

TEST(PlannerMemory, InFlightMatchesTheSchedules) {
  using pipeline::ScheduleKind;
  for (int p : {2, 4})
    for (int m : {4, 8, 16})
      for (auto [kind, name, v] : {std::tuple{ScheduleKind::GPipe, "gpipe", 1},
                                   std::tuple{ScheduleKind::OneFOneB, "1f1b", 1},
                                   std::tuple{ScheduleKind::Interleaved, "interleaved", 2}}) {
        pipeline::Schedule sched;
        std::string error;
        ASSERT_TRUE(pipeline::buildSchedule(kind, p, m, v, sched, error)) << error;
        for (int r = 0; r < p; ++r)
          EXPECT_EQ(inFlight(name, p, v, m, r), sched.maxInFlight(r))
              << name << " p=" << p << " m=" << m << " rank " << r;
      }
}

// Tests that the slots the planner charges without building a one-chunk
// schedule (pipelineSlots' closed form) are the built schedule's, rank by
// rank, and that interleaved schedules are built.
TEST(PlannerMemory, SlotsMatchTheBuiltSchedules) {
  using pipeline::ScheduleKind;
  int built = 0;
  for (int p : {1, 2, 3, 4, 8})
    for (int m : {1, 2, 3, 4, 7, 8, 16, 24, 33})
      for (int v : {1, 2, 3, 4})
        for (auto [kind, name] :
             {std::pair{ScheduleKind::GPipe, "gpipe"}, std::pair{ScheduleKind::OneFOneB, "1f1b"},
              std::pair{ScheduleKind::Interleaved, "interleaved"}}) {
          pipeline::Schedule sched;
          std::string error;
          std::vector<std::vector<int>> ones(p, std::vector<int>(v, 1));
          // One slot each where the schedule cannot be built (interleaved
          // needs m a multiple of p; the others one chunk).
          const bool ok = pipeline::buildSchedule(kind, p, m, v, sched, error);
          built += ok;
          EXPECT_EQ(pipelineSlots(name, p, v, m), ok ? sched.slots : ones)
              << name << " p=" << p << " v=" << v << " m=" << m;
        }
  EXPECT_GT(built, 150);
}

Cluster cluster(const std::string &spec) {
  Cluster cl;
  std::string error;
  EXPECT_TRUE(parseCluster(spec, cl, error)) << error;
  return cl;
}

SearchResult search(Fixture &f, const Cluster &cl, PlannerOptions opts) {
  return searchPlans(
      f.at(1), [&](int tp, bool sp, std::string &e) { return f.get(tp, sp, e); }, cl, opts);
}

TEST(PlannerSearch, FixedFieldsNeverChange) {
  Fixture f(gptSpec(false, 8));
  Cluster cl = cluster("a100-80gb:2x8");
  for (const char *fixed :
       {"tp=2", "pp=4", "tp=4,pp=2", "dp=2,zero=1", "recompute=full", "schedule=gpipe,pp=2",
        "num_micro_batches=8", "sequence_parallel=true", "precision=fp32,tf32=true"}) {
    PlannerOptions opts;
    opts.globalBatch = 64;
    std::string error;
    ASSERT_TRUE(parseFixed(fixed, opts.constraints, error)) << error;
    SearchResult r = search(f, cl, opts);
    ASSERT_TRUE(r.anyFits) << fixed;
    for (const Estimate &e : r.ranked) {
      for (auto &[field, value] : opts.constraints.fixed) {
        std::string got = field == "dp"                  ? std::to_string(e.c.dp)
                          : field == "tp"                ? std::to_string(e.c.tp)
                          : field == "pp"                ? std::to_string(e.c.pp)
                          : field == "zero"              ? std::to_string(e.c.zero)
                          : field == "recompute"         ? e.c.recompute
                          : field == "schedule"          ? e.c.schedule
                          : field == "num_micro_batches" ? std::to_string(e.c.m)
                          : field == "sequence_parallel" ? (e.c.sp ? "true" : "false")
                          : field == "precision"         ? e.c.precision
                          : field == "tf32"              ? (e.c.tf32 ? "true" : "false")
                                                         : "?";
        EXPECT_EQ(got, value) << fixed << ": " << e.c.key();
      }
    }
  }
}

TEST(PlannerSearch, BoundsAndNoSplit) {
  Fixture f(gptSpec(false, 8));
  Cluster cl = cluster("a100-80gb:2x8");
  PlannerOptions opts;
  opts.globalBatch = 64;
  std::string error;
  ASSERT_TRUE(parseConstraints(
      R"({"bounds": {"tp": {"max": 2}, "pp": {"min": 2, "max": 4}}, "no_split": ["sequence"]})",
      "c.json", opts.constraints, error))
      << error;
  SearchResult r = search(f, cl, opts);
  ASSERT_TRUE(r.anyFits);
  for (const Estimate &e : r.ranked) {
    EXPECT_LE(e.c.tp, 2);
    EXPECT_GE(e.c.pp, 2);
    EXPECT_LE(e.c.pp, 4);
    EXPECT_FALSE(e.c.sp);
  }
}

TEST(PlannerSearch, PinnedOpKeepsItsPartition) {
  // Replicating the MLP's first linear keeps its output whole on every tp rank:
  // the gelu input and output are no longer split.
  Fixture pinned(gptSpec(false), {{"/h.*/mlp/c_fc/MatMul", "replicate"}});
  Fixture free(gptSpec(false));
  const double b = 1, sbh = s * b * h;
  double withPin = layerActivationBytes(pinned.at(2).layers[1], cand(2, false, "none", 1), 2);
  double without = layerActivationBytes(free.at(2).layers[1], cand(2, false, "none", 1), 2);
  EXPECT_GT(withPin, without);
  // Both 4h-wide tensors of the MLP stay whole: 2 x 8sbh/2 more bytes.
  EXPECT_EQ(withPin - without, 8 * sbh);
  // A pin that matches nothing is an error naming it.
  Fixture bad(gptSpec(false), {{"/nothing/*", "replicate"}});
  std::string error;
  EXPECT_EQ(bad.get(2, false, error), nullptr);
  EXPECT_NE(error.find("/nothing/*"), std::string::npos) << error;
}

TEST(PlannerSearch, InfeasibleIsExplained) {
  // 1T parameters cannot fit eight 80 GB devices.
  Fixture f("builtin:gpt:layers=128,hidden=25600,heads=160,seq=2048,vocab=51200");
  PlannerOptions opts;
  opts.globalBatch = 64;
  SearchResult r = search(f, cluster("a100-80gb:1x8"), opts);
  EXPECT_FALSE(r.anyFits);
  EXPECT_GT(r.evaluated, 0);
  EXPECT_GT(r.closest.mem.total(), r.closest.capacity);
  EXPECT_FALSE(r.closest.fits);
  // Contradictions are caught before searching.
  PlannerOptions bad;
  bad.globalBatch = 64;
  std::string error;
  ASSERT_TRUE(parseConstraints(R"({"fixed": {"tp": 8}, "bounds": {"tp": {"max": 4}}})", "c",
                               bad.constraints, error));
  EXPECT_NE(search(f, cluster("a100-80gb:1x8"), bad).contradiction, "");
  Constraints twice;
  ASSERT_TRUE(parseFixed("tp=2", twice, error));
  EXPECT_FALSE(parseFixed("tp=4", twice, error));
  EXPECT_NE(error.find("fixed twice"), std::string::npos);
  EXPECT_FALSE(parseFixed("tq=4", twice, error));
  EXPECT_FALSE(parseConstraints(R"({"bounds": {"pp": {"min": 8, "max": 2}}})", "c", twice, error));
}

TEST(PlannerCost, MoreBandwidthIsNeverSlower) {
  Fixture f(gptSpec(false, 8));
  PlannerOptions opts;
  Cluster slow = cluster("a100-80gb:2x8");
  Candidate zero3 = cand(1, false, "none", 2);
  zero3.zero = 3;
  for (Candidate c :
       {Candidate{}, cand(2, true, "none", 2), cand(4, false, "selective", 1), zero3}) {
    c.dp = 16 / c.tp / 2;
    c.pp = 2;
    c.m = 4;
    Cluster fast = slow;
    double prev = estimate(f.at(c.tp, c.sp), f.at(1), slow, c, opts).time.total;
    for (int k = 0; k < 3; ++k) {
      fast.intraNode.bandwidth *= 2;
      fast.interNode.bandwidth *= 2;
      fast.device.memoryBandwidth *= 2;
      double t = estimate(f.at(c.tp, c.sp), f.at(1), fast, c, opts).time.total;
      EXPECT_LE(t, prev) << c.key();
      prev = t;
    }
  }
}

// The plan field tf32: an fp32 plan's GEMMs at the device's TF32 peak (156
// TFLOP/s on an A100 against 19.5 fp32), so its step is faster and its MFU
// is against the TF32 peak; a bf16 plan is priced as without it.
TEST(PlannerCost, Tf32PricesFp32GemmsAtTheTf32Peak) {
  Fixture f(gptSpec(false, 8));
  PlannerOptions opts;
  Cluster cl = cluster("a100-80gb:1x8");
  ASSERT_GT(cl.peak("tf32"), cl.peak("fp32"));
  Candidate fp32 = cand(1, false, "none", 2, "fp32");
  fp32.dp = 8;
  Candidate tf32 = fp32;
  tf32.tf32 = true;
  EXPECT_EQ(tf32.gemmPeak(), "tf32");
  const Estimate a = estimate(f.at(1), f.at(1), cl, fp32, opts);
  const Estimate b = estimate(f.at(1), f.at(1), cl, tf32, opts);
  EXPECT_LT(b.time.total, a.time.total);
  EXPECT_NEAR(b.mfu, b.tflopsPerDevice * 1e12 / cl.peak("tf32"), 1e-9);
  EXPECT_NEAR(a.mfu, a.tflopsPerDevice * 1e12 / cl.peak("fp32"), 1e-9);
  Candidate bf16 = fp32;
  bf16.precision = "bf16";
  Candidate bf16tf32 = bf16;
  bf16tf32.tf32 = true;
  EXPECT_EQ(bf16tf32.gemmPeak(), "bf16");
  EXPECT_EQ(estimate(f.at(1), f.at(1), cl, bf16tf32, opts).time.total,
            estimate(f.at(1), f.at(1), cl, bf16, opts).time.total);
}

TEST(PlannerCost, MoreMicroBatchesNeverRaiseTheBubble) {
  Fixture f(gptSpec(false, 8));
  PlannerOptions opts;
  Cluster cl = cluster("a100-80gb:1x8");
  for (const char *sched : {"gpipe", "1f1b", "interleaved"})
    for (int pp : {2, 4}) {
      double prev = 2;
      for (int m : {4, 8, 16, 32}) {
        Candidate c = cand(1, false, "none", 1);
        c.pp = pp;
        c.dp = 8 / pp;
        c.m = m;
        c.schedule = sched;
        c.v = std::string(sched) == "interleaved" ? 2 : 1;
        double frac = estimate(f.at(1), f.at(1), cl, c, opts).bubbleFraction;
        EXPECT_LE(frac, prev) << sched << " pp=" << pp << " m=" << m;
        EXPECT_GT(frac, 0);
        prev = frac;
      }
    }
}

TEST(PlannerCalibration, GemmTableInterpolatesInLog2) {
  Calibration cal;
  cal.gemmEfficiency = {{64, 0.3}, {256, 0.5}};
  EXPECT_DOUBLE_EQ(cal.gemmEfficiencyAt(8), 0.3); // flat below the first point
  EXPECT_DOUBLE_EQ(cal.gemmEfficiencyAt(64), 0.3);
  EXPECT_DOUBLE_EQ(cal.gemmEfficiencyAt(128), 0.4); // halfway in log2
  EXPECT_DOUBLE_EQ(cal.gemmEfficiencyAt(256), 0.5);
  EXPECT_DOUBLE_EQ(cal.gemmEfficiencyAt(1 << 20), 0.5); // and above the last

  // The default rises with the dimension and stays below peak.
  Calibration def;
  double prev = 0;
  for (double d = 16; d <= 65536; d *= 2) {
    EXPECT_GE(def.gemmEfficiencyAt(d), prev) << d;
    EXPECT_LE(def.gemmEfficiencyAt(d), 0.9) << d;
    prev = def.gemmEfficiencyAt(d);
  }

  std::string error;
  Calibration parsed;
  ASSERT_TRUE(
      parseCalibration(R"({"gemm_efficiency": [[128, 0.5], [512, 0.7]]})", "c.json", parsed, error))
      << error;
  EXPECT_DOUBLE_EQ(parsed.gemmEfficiencyAt(256), 0.6);
  ASSERT_TRUE(parseCalibration(R"({"matmul_efficiency": 0.62})", "c.json", parsed, error));
  EXPECT_DOUBLE_EQ(parsed.gemmEfficiencyAt(16), 0.62); // one fraction for every shape
  EXPECT_DOUBLE_EQ(parsed.gemmEfficiencyAt(16384), 0.62);

  for (const char *bad : {R"({"gemm_efficiency": [[512, 0.7], [128, 0.5]]})",
                          R"({"gemm_efficiency": [[128, 1.5]]})", R"({"gemm_efficiency": []})",
                          R"({"gemm_efficiency": [[0, 0.5]]})", R"({"gemm_efficiency": 0.7})",
                          R"({"gemm_efficiency": [[128, 0.5]], "matmul_efficiency": 0.7})"}) {
    Calibration c;
    error.clear();
    EXPECT_FALSE(parseCalibration(bad, "c.json", c, error)) << bad;
    EXPECT_NE(error.find("c.json"), std::string::npos) << error;
    EXPECT_NE(error.find("efficiency"), std::string::npos) << error;
  }
}

TEST(PlannerProfile, GemmDimensionsOfATransformerLayer) {
  // hidden 64, 4 heads (head dim 16), seq 64: every Linear of a layer has
  // its weight's smaller side (64) fixed and the tokens (64 per sample) as
  // the rows that grow with the micro-batch; a weight's gradient contracts
  // over the tokens; the attention core's smallest dimension is the head's.
  Fixture f(gptSpec(false));
  const Segment &layer = f.at(1).layers[1];
  int linears = 0, weightGrads = 0, cores = 0;
  for (const OpWork &w : layer.forward) {
    if (w.attentionCore) {
      ++cores;
      EXPECT_EQ(w.gemmFixed, h / a);
      EXPECT_EQ(w.gemmPerSample, 0);
    } else if (w.matmul && w.gemmPerSample > 0) {
      ++linears;
      EXPECT_EQ(w.gemmFixed, h);
      EXPECT_EQ(w.gemmPerSample, s);
      EXPECT_EQ(w.gemmSmallest(4), h); // 256 rows at micro-batch 4
    }
  }
  for (const OpWork &w : layer.backward)
    if (w.matmul && w.gemmPerSample == s && w.gemmFixed == h)
      ++weightGrads;
  EXPECT_EQ(cores, 1);
  EXPECT_GE(linears, 3); // attention in and out, MLP up and down
  EXPECT_GE(weightGrads, 3);

  // At 16 tokens the rows are the smallest side until the micro-batch grows.
  Fixture short_("builtin:gpt:layers=3,hidden=64,heads=4,seq=16,vocab=256");
  for (const OpWork &w : short_.at(1).layers[1].forward)
    if (w.matmul && w.gemmPerSample > 0) {
      EXPECT_EQ(w.gemmSmallest(1), 16);
      EXPECT_EQ(w.gemmSmallest(8), 64);
    }
}

TEST(PlannerCost, GemmEfficiencyFollowsTheShape) {
  // A larger micro-batch amortizes the weights' reads under any table;
  // under the default table its per-sample work also gets cheaper because
  // the GEMMs' rows grow (128 tokens a sample: the smallest side at b = 1,
  // where the 16-bit GEMMs of a 4096-wide layer are already compute-bound).
  Fixture f("builtin:gpt:layers=3,hidden=4096,heads=32,seq=128,vocab=256");
  Cluster cl = cluster("a100-80gb:1x1");
  auto perSample = [&](const Calibration &cal, int64_t b) {
    PlannerOptions opts;
    opts.publishedStorage = true;
    opts.calibration = cal;
    opts.calibration.kernelOverhead = 1e-15;
    Candidate c = cand(1, false, "none", b);
    return estimate(f.at(1), f.at(1), cl, c, opts).time.compute / (double)b;
  };
  Calibration flat;
  flat.gemmEfficiency = {{1, 0.75}};
  Calibration def;
  EXPECT_LT(perSample(def, 16) / perSample(def, 1), 0.9 * perSample(flat, 16) / perSample(flat, 1));

  // A small model's GEMMs run further from peak than a large one's: the
  // default table costs the small model more relative to a flat 0.86.
  // (Sizes where the GEMMs are compute-bound: below them the roofline's
  // memory term prices small GEMMs already.)
  Calibration peakish;
  peakish.gemmEfficiency = {{1, 0.86}};
  auto ratio = [&](const std::string &spec) {
    Fixture g(spec);
    PlannerOptions a, b;
    b.calibration = peakish;
    Candidate c = cand(1, false, "none", 1);
    return estimate(g.at(1), g.at(1), cl, c, a).time.compute /
           estimate(g.at(1), g.at(1), cl, c, b).time.compute;
  };
  double small = ratio("builtin:gpt:layers=3,hidden=1024,heads=16,seq=4096,vocab=256");
  double large = ratio("builtin:gpt:layers=3,hidden=8192,heads=64,seq=4096,vocab=256");
  EXPECT_GT(small, 1.05);
  EXPECT_LT(large, small);
  EXPECT_GE(large, 1.0);
}

TEST(PlannerCost, GradientReductionAfterTheBackwardIsExposedWhole) {
  // By default part of the data-parallel reduction hides behind the backward;
  // with "gradient_overlap": false (the published runs' DDP) all of it shows.
  Fixture f(gptSpec(false, 8));
  PlannerOptions opts;
  Candidate c = cand(1, false, "none", 8);
  c.dp = 8;
  Cluster cl = cluster("a100-80gb:1x8");
  opts.calibration.bucketBytes = 4096; // many buckets: all but the last can hide
  Estimate hidden = estimate(f.at(1), f.at(1), cl, c, opts);
  std::string error;
  ASSERT_TRUE(parseCalibration(R"({"gradient_overlap": false})", "c.json", opts.calibration,
                               error))
      << error;
  EXPECT_FALSE(opts.calibration.gradientOverlap);
  Estimate exposed = estimate(f.at(1), f.at(1), cl, c, opts);
  EXPECT_GT(hidden.time.dpComm, 0);
  EXPECT_LT(hidden.time.dpExposed, hidden.time.dpComm);
  EXPECT_DOUBLE_EQ(exposed.time.dpExposed, exposed.time.dpComm);
  EXPECT_GT(exposed.time.total, hidden.time.total);
  Calibration bad;
  EXPECT_FALSE(parseCalibration(R"({"gradient_overlap": 1})", "c.json", bad, error));
  EXPECT_NE(error.find("\"gradient_overlap\" must be true or false"), std::string::npos) << error;
}

TEST(PlannerCost, Zero3PrefetchHidesGathersBehindCompute) {
  // ZeRO-3 plans prefetch one layer: with compute to hide behind, less than
  // the gathers' whole time is exposed; with a link so slow that gathers
  // dwarf compute, nearly all of it is.
  Fixture f(gptSpec(false, 8));
  PlannerOptions opts;
  Candidate c = cand(1, false, "none", 8);
  c.dp = 8;
  c.zero = 3;
  c.m = 2;
  Cluster cl = cluster("a100-80gb:1x8");
  Estimate e = estimate(f.at(1), f.at(1), cl, c, opts);
  EXPECT_GT(e.time.dpComm, 0);
  EXPECT_LT(e.time.dpExposed, e.time.dpComm);
  Cluster slow = cl;
  slow.intraNode.bandwidth /= 1e4;
  Estimate es = estimate(f.at(1), f.at(1), slow, c, opts);
  EXPECT_GT(es.time.dpExposed, 0.9 * es.time.dpComm);
  EXPECT_LE(es.time.dpExposed, es.time.dpComm * (1 + 1e-12));
}

} // namespace
