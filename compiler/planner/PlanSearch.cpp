//===- PlanSearch.cpp - the plan space, searched and ranked ---------------===//
//
// `searchPlans`: first the contradictions the constraints carry on their
// own (or against the model and the cluster); then every (dp, tp, pp)
// factoring of the devices, every micro-batch size dividing a replica's
// share of the batch, the pipeline schedules, ZeRO stages, recomputation
// and expert parallelism the constraints allow, each priced by
// `estimatePriced` (CostModel.cpp) on a profile priced once per (tp,
// sequence parallel, micro-batch size). The plans that fit are ranked,
// fastest first, and each alternative says why it lost. docs/planner.md,
// "The search".
//
//===----------------------------------------------------------------------===//

#include "compiler/planner/PlannerImpl.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

namespace carve::planner {

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
  if (tf32)
    os << " tf32";
  return os.str();
}

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

/// The values the constraints allow a plan field.
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
  /// The value `f` is fixed to, or `dflt`.
  std::string fixedOr(const std::string &f, const std::string &dflt) const {
    auto it = cons.fixed.find(f);
    return it == cons.fixed.end() ? dflt : it->second;
  }
};

/// The precision every plan of a search has: fixed, or bf16 where the
/// device has a bf16 peak.
std::string searchPrecision(const Space &sp, const Cluster &cl) {
  return sp.fixedOr("precision", cl.device.peakFlops.count("bf16") == 0 ? "fp32" : "bf16");
}

/// A fixed field no plan of this cluster, model and batch can have, named
/// with the bound it breaks; empty when every fixed value is reachable.
/// (Checked field by field, then the fixed parallel degrees together, so
/// that the message names the field at fault rather than every rule.)
std::string fieldOutOfReach(const Space &sp, const Profile &base, const Cluster &cl, int64_t B) {
  const Constraints &cons = sp.cons;
  const int64_t N = cl.worldSize();
  const int64_t L = std::max<int64_t>(1, (int64_t)base.layers.size());
  auto fixedInt = [&](const std::string &f, int64_t &v) {
    auto it = cons.fixed.find(f);
    if (it == cons.fixed.end())
      return false;
    v = std::atoll(it->second.c_str());
    return true;
  };
  const std::string devices =
      std::to_string(N) + " devices of " + cl.name + " (" + std::to_string(cl.nodes) + " x " +
      std::to_string(cl.devicesPerNode) + ")";
  int64_t dp = 0, tp = 0, pp = 0;
  const bool hasDp = fixedInt("dp", dp), hasTp = fixedInt("tp", tp), hasPp = fixedInt("pp", pp);
  for (auto [f, v, has] : {std::tuple<const char *, int64_t, bool>{"dp", dp, hasDp},
                           {"tp", tp, hasTp},
                           {"pp", pp, hasPp}})
    if (has && (v < 1 || N % v != 0))
      return std::string(f) + " is fixed to " + std::to_string(v) + " but it must divide the " +
             devices;
  if (hasPp && pp > L && !(base.layers.empty() && pp <= 2))
    return "pp is fixed to " + std::to_string(pp) + " but the model has " + std::to_string(L) +
           " layers (at most one stage per layer)";
  if (hasDp && B % dp != 0)
    return "dp is fixed to " + std::to_string(dp) + " but it must divide the global batch " +
           std::to_string(B);
  if (hasDp && hasTp && N % (dp * tp) != 0)
    return "dp x tp is fixed to " + std::to_string(dp * tp) + " but it must divide the " + devices;
  if (hasDp && hasPp && N % (dp * pp) != 0)
    return "dp x pp is fixed to " + std::to_string(dp * pp) + " but it must divide the " + devices;
  if (hasTp && hasPp && N % (tp * pp) != 0)
    return "tp x pp is fixed to " + std::to_string(tp * pp) + " but it must divide the " + devices;
  // The replicas' shares of the batch the fixed degrees leave possible.
  std::vector<int64_t> shares;
  for (int64_t d : divisors(N))
    if (B % d == 0 && sp.allows("dp", (double)d) && (!hasTp || (N / d) % tp == 0) &&
        (!hasPp || (N / d) % pp == 0) && (!hasTp || !hasPp || (N / d) % (tp * pp) == 0))
      shares.push_back(B / d);
  std::string shareText;
  for (size_t i = 0; i < shares.size() && i < 6; ++i)
    shareText += (i ? ", " : "") + std::to_string(shares[i]);
  if (shares.size() > 6)
    shareText += ", ...";
  // micro_batch_size and num_micro_batches must each divide some share.
  for (const char *f : {"micro_batch_size", "num_micro_batches"}) {
    int64_t k = 0;
    if (!fixedInt(f, k))
      continue;
    bool ok = false;
    for (int64_t share : shares)
      ok |= k >= 1 && share % k == 0;
    if (!ok && !shares.empty())
      return std::string(f) + " is fixed to " + std::to_string(k) +
             " but it must divide a replica's share of the global batch " + std::to_string(B) +
             " (" + shareText + " samples for the dp this cluster allows)";
  }
  int64_t v = 0;
  if (fixedInt("virtual_stages", v) && v > 1) {
    const std::string sched = sp.fixedOr("schedule", "interleaved");
    if (sched != "interleaved")
      return "virtual_stages is fixed to " + std::to_string(v) + " but schedule is fixed to " +
             sched + " (virtual stages need the interleaved schedule)";
    if (v > 8)
      return "virtual_stages is fixed to " + std::to_string(v) + " but the planner tries 2 to 8";
    if (hasPp && pp == 1)
      return "virtual_stages is fixed to " + std::to_string(v) +
             " but pp is fixed to 1 (virtual stages split a pipeline)";
    if (hasPp && pp * v > L)
      return "virtual_stages is fixed to " + std::to_string(v) + " but pp x virtual_stages (" +
             std::to_string(pp * v) + ") exceeds the model's " + std::to_string(L) + " layers";
  }
  if (sp.fixedOr("schedule", "") == "interleaved" && hasPp && pp == 1)
    return "schedule is fixed to interleaved but pp is fixed to 1 (it schedules a pipeline)";
  return "";
}

/// Constraints that cannot all hold, on their own or on this model and
/// cluster, in a sentence; empty when they can.
std::string findContradiction(const Space &sp, const Profile &base, const Cluster &cl,
                              int64_t B) {
  const Constraints &cons = sp.cons;
  const int N = cl.worldSize();
  for (const auto &[f, b] : cons.bounds) {
    auto it = cons.fixed.find(f);
    if (it != cons.fixed.end()) {
      double v = std::atof(it->second.c_str());
      if (v < b.first || v > b.second)
        return f + " is fixed to " + it->second + " but bounded to [" +
               std::to_string((long long)b.first) + ", " +
               (b.second >= 1e17 ? std::string("inf") : std::to_string((long long)b.second)) + "]";
    }
  }
  // Of several fields no_split forbids, the last one checked is named.
  std::string noSplit;
  auto contra = [&](const std::string &f, const char *dim, const char *what) {
    auto it = cons.fixed.find(f);
    if (cons.noSplit.count(dim) && it != cons.fixed.end() && it->second != "1" &&
        it->second != "false")
      noSplit = f + " is fixed to " + it->second + " but no_split forbids splitting " + dim + " (" +
                what + ")";
  };
  contra("dp", "batch", "data parallelism splits the batch");
  contra("tp", "hidden", "tensor parallelism splits the hidden dimension");
  contra("pp", "layers", "pipeline parallelism splits the layers");
  contra("sequence_parallel", "sequence", "sequence parallelism splits the sequence");
  if (!noSplit.empty())
    return noSplit;
  const std::string ep = sp.fixedOr("ep", "1");
  if (std::atoi(ep.c_str()) > 1 && base.experts == 0)
    return "ep is fixed to " + ep +
           " but the model has no routed mixture-of-experts layer to split "
           "(docs/moe.md)";
  if (std::atoi(ep.c_str()) > 1 && base.experts % std::atoi(ep.c_str()) != 0)
    return "ep is fixed to " + ep +
           " but it does not divide the experts of the model's routed layers (" +
           std::to_string(base.experts) + ")";
  if (sp.fixedOr("sequence_parallel", "false") == "true" && sp.fixedOr("tp", "0") == "1")
    return "sequence_parallel is fixed on but tp is fixed to 1 (it splits along tp)";
  if (cons.fixed.count("dp") && cons.fixed.count("tp") && cons.fixed.count("pp")) {
    long long w = std::atoll(cons.fixed.at("dp").c_str()) *
                  std::atoll(cons.fixed.at("tp").c_str()) * std::atoll(cons.fixed.at("pp").c_str());
    if (w != N)
      return "dp x tp x pp is fixed to " + std::to_string(w) + " ranks but the cluster has " +
             std::to_string(N) + " devices";
  }
  if (sp.fixedOr("grad_accumulation", "fp32") == "16bit" && searchPrecision(sp, cl) == "fp32")
    return "grad_accumulation 16bit keeps gradients in 16 bits and needs precision "
           "bf16 or fp16";
  return fieldOutOfReach(sp, base, cl, B);
}

/// The pipeline schedules (name, virtual stages) worth pricing for `pp`
/// stages of `L` layers and `m` micro-batches.
std::vector<std::pair<std::string, int>> schedulesFor(const Space &sp, int64_t pp, int64_t m,
                                                      int L) {
  std::vector<std::pair<std::string, int>> scheds;
  if (pp == 1) {
    scheds.push_back({"1f1b", 1});
  } else {
    scheds.push_back({"1f1b", 1});
    if (sp.fixedHas("schedule") && sp.cons.fixed.at("schedule") == "gpipe")
      scheds.push_back({"gpipe", 1});
    if (m % pp == 0)
      for (int v = 2; v <= 8 && pp * v <= std::max(1, L); ++v)
        scheds.push_back({"interleaved", v});
  }
  return scheds;
}

/// The walk over the plan space: every candidate the constraints allow,
/// priced, the ones that fit kept and the closest miss remembered.
class Walk {
public:
  Walk(const Profile &base, const Cluster &cl, const PlannerOptions &opts, SearchResult &res)
      : base(base), cl(cl), opts(opts), cons(opts.constraints), sp{cons}, res(res),
        precision(searchPrecision(sp, cl)),
        gradAccumulation(sp.fixedOr("grad_accumulation", "fp32")),
        syncBatchNorm(sp.fixedOr("sync_batch_norm", "false") == "true"),
        tf32(sp.fixedOr("tf32", "false") == "true") {
    for (const Segment &s : base.layers)
      hasAttention |= s.core > 0;
    for (const OpWork &w : base.embedding.forward)
      hasAttention |= w.attentionCore;
  }

  /// Every tp layout (with and without sequence parallelism) the
  /// constraints and `profiles` allow.
  void run(const ProfileSource &profiles) {
    const int N = cl.worldSize();
    const int maxTp = std::min(N, cl.devicesPerNode);
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
          res.skipped.push_back("tp=" + std::to_string(tp) + (seqPar ? " with sp" : "") + ": " +
                                why);
          continue;
        }
        searchLayout(tp, seqPar, *prof);
      }
    }
  }

  /// The plans that fit, in the order they were priced.
  std::vector<Estimate> fitting;

private:
  /// Every (dp, pp), micro-batch size and schedule of one tp layout.
  void searchLayout(int64_t tp, bool seqPar, const Profile &layoutProfile) {
    prof = &layoutProfile;
    pricedBySize.clear();
    const int N = cl.worldSize();
    const int64_t B = opts.globalBatch;
    const int L = (int)base.layers.size();
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
          res.skipped.push_back("dp=" + std::to_string(dp) + " does not divide the global batch " +
                                std::to_string(B));
        continue;
      }
      const int64_t share = B / dp;
      for (int64_t mbs : divisors(share)) {
        int64_t m = share / mbs;
        if (!sp.allows("micro_batch_size", (double)mbs) ||
            !sp.allows("num_micro_batches", (double)m))
          continue;
        for (auto &[sched, v] : schedulesFor(sp, pp, m, L)) {
          if (pp > 1 && !sp.allowsText("schedule", sched))
            continue;
          if (!sp.allows("virtual_stages", (double)v))
            continue;
          Candidate c;
          c.dp = (int)dp;
          c.tp = (int)tp;
          c.pp = (int)pp;
          c.v = v;
          c.microBatch = mbs;
          c.m = m;
          c.schedule = sched;
          c.sp = seqPar;
          c.precision = precision;
          c.gradAccumulation = gradAccumulation;
          c.syncBatchNorm = syncBatchNorm;
          c.tf32 = tf32;
          searchMemoryChoices(c);
        }
      }
    }
  }

  /// The ZeRO stages, recomputation and expert parallelism of a candidate
  /// whose other fields are chosen.
  void searchMemoryChoices(Candidate c) {
    static const std::vector<std::string> recomputes = {"none", "selective", "full"};
    for (int zero = 0; zero <= 3; ++zero) {
      if (!sp.allows("zero", (double)zero))
        continue;
      // One replica: ZeRO shards nothing, so its stages are ZeRO-0's plan;
      // tried only where the constraints leave no other (--fixed zero=2).
      if (zero > 0 && c.dp == 1 && sp.allows("zero", 0.0))
        continue;
      for (const std::string &rc : recomputes) {
        if (!sp.allowsText("recompute", rc))
          continue;
        if (rc == "selective" && !hasAttention)
          continue;
        // Expert parallelism: ep dividing dp and every routed layer's
        // experts; compiled without ZeRO.
        for (int64_t ep : divisors(c.dp)) {
          if (!sp.allows("ep", (double)ep))
            continue;
          if (ep > 1 && (prof->experts == 0 || prof->experts % ep != 0 || zero > 0))
            continue;
          c.ep = (int)ep;
          c.zero = zero;
          c.recompute = rc;
          keep(estimatePriced(*prof, pricedAt(c.microBatch), base, cl, c, opts));
        }
      }
    }
  }

  /// The layout's profile priced at micro-batch size `mbs`, once.
  const PricedModel &pricedAt(int64_t mbs) {
    auto it = pricedBySize.find(mbs);
    if (it == pricedBySize.end())
      it = pricedBySize
               .emplace(mbs, priceModel(*prof, cl, opts.calibration,
                                        precision == "fp32" && tf32 ? "tf32" : precision,
                                        storageFor(precision, opts.publishedStorage).activation,
                                        (double)mbs))
               .first;
    return it->second;
  }

  /// Counts `e`; keeps it if it fits, else remembers it if it misses by the least so far.
  void keep(const Estimate &e) {
    ++res.evaluated;
    if (e.fits) {
      fitting.push_back(e);
      return;
    }
    double shortBy = e.mem.total() - e.capacity;
    if (shortBy < closestShort) {
      closestShort = shortBy;
      res.closest = e;
    }
  }

  const Profile &base;
  const Cluster &cl;
  const PlannerOptions &opts;
  const Constraints &cons;
  const Space sp;
  SearchResult &res;
  const std::string precision, gradAccumulation;
  // Carried into the plan, not priced: two all-reduces of C values per batch
  // norm and direction.
  const bool syncBatchNorm;
  // Priced (fp32 GEMMs at the TF32 peak), never chosen by the search.
  const bool tf32;
  bool hasAttention = false;
  const Profile *prof = nullptr;               // the layout's
  std::map<int64_t, PricedModel> pricedBySize; // the layout's
  double closestShort = 1e300;
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

/// The best of `all` (the plans that fit), then up to `alternatives` more:
/// first one per distinct (dp, tp, pp), then the rest; each with why it lost.
void rank(std::vector<Estimate> &all, int alternatives, SearchResult &res) {
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
    return;
  res.ranked.push_back(all[0]);
  std::set<std::tuple<int, int, int>> shapes = {{all[0].c.dp, all[0].c.tp, all[0].c.pp}};
  for (size_t i = 1; i < all.size() && (int)res.ranked.size() <= alternatives; ++i)
    if (shapes.insert({all[i].c.dp, all[i].c.tp, all[i].c.pp}).second)
      res.ranked.push_back(all[i]);
  for (size_t i = 1; i < all.size() && (int)res.ranked.size() <= alternatives; ++i) {
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
}

} // namespace

SearchResult searchPlans(const Profile &base, const ProfileSource &profiles, const Cluster &cl,
                         const PlannerOptions &opts) {
  SearchResult res;
  const Constraints &cons = opts.constraints;
  res.contradiction = findContradiction(Space{cons}, base, cl, opts.globalBatch);
  if (!res.contradiction.empty())
    return res;
  res.fullyFixed = cons.fixed.count("dp") && cons.fixed.count("tp") && cons.fixed.count("pp");
  Walk walk(base, cl, opts, res);
  walk.run(profiles);
  res.anyFits = !walk.fitting.empty();
  rank(walk.fitting, opts.alternatives, res);
  return res;
}

} // namespace carve::planner
