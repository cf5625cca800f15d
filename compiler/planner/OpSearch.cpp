//===- OpSearch.cpp - per-op partition choices: prices, DP, ILP -----------===//

#include "compiler/planner/OpSearch.h"

#include "compiler/stages/StageSplit.h"

#include "llvm/Support/GlobPattern.h"

#include <Cbc_C_Interface.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <system_error>
#include <thread>

namespace carve::planner {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

/// The pair's cost with variable g at option og and its other variable at oh.
double pairCost(const ChoiceProblem::Pair &q, int g, int og, int oh) {
  return q.a == g ? q.cost[og][oh] : q.cost[oh][og];
}

double totalCost(const ChoiceProblem &p, const std::vector<int> &opt) {
  double t = 0;
  for (size_t g = 0; g < p.unary.size(); ++g)
    t += p.unary[g][opt[g]];
  for (const auto &q : p.pairs)
    t += q.cost[opt[q.a]][opt[q.b]];
  return t;
}

/// Union-find root.
int root(std::vector<int> &parent, int x) {
  while (parent[x] != x)
    x = parent[x] = parent[parent[x]];
  return x;
}

std::string escapeGlob(const std::string &s) {
  std::string r;
  for (char c : s) {
    if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\' || c == '{' || c == '}')
      r += '\\';
    r += c;
  }
  return r;
}

} // namespace

bool isChainProblem(const ChoiceProblem &p) {
  const int n = (int)p.unary.size();
  std::vector<int> degree(n, 0), parent(n);
  std::iota(parent.begin(), parent.end(), 0);
  std::set<std::pair<int, int>> seen;
  for (const auto &q : p.pairs) {
    if (q.a == q.b || q.a < 0 || q.b < 0 || q.a >= n || q.b >= n)
      return false;
    if (!seen.insert({std::min(q.a, q.b), std::max(q.a, q.b)}).second)
      return false;
    if (++degree[q.a] > 2 || ++degree[q.b] > 2)
      return false;
    int ra = root(parent, q.a), rb = root(parent, q.b);
    if (ra == rb)
      return false; // a cycle
    parent[ra] = rb;
  }
  return true;
}

ChoiceSolution solveChainDP(const ChoiceProblem &p) {
  ChoiceSolution s;
  s.method = "dp";
  if (!isChainProblem(p)) {
    s.error = "the pairwise terms do not form chains";
    return s;
  }
  const int n = (int)p.unary.size();
  std::vector<std::vector<int>> adj(n); // pair indices
  for (size_t k = 0; k < p.pairs.size(); ++k) {
    adj[p.pairs[k].a].push_back((int)k);
    adj[p.pairs[k].b].push_back((int)k);
  }
  s.option.assign(n, 0);
  std::vector<bool> done(n, false);
  for (int start = 0; start < n; ++start) {
    if (done[start] || adj[start].size() > 1)
      continue; // walk each path from an end (a lone variable is a path of one)
    // The path: variables in order and the pair joining each to the next.
    std::vector<int> path{start}, link;
    int prev = -1, cur = start;
    while (true) {
      int next = -1, via = -1;
      for (int k : adj[cur]) {
        int other = p.pairs[k].a == cur ? p.pairs[k].b : p.pairs[k].a;
        if (other != prev) {
          next = other;
          via = k;
        }
      }
      if (next < 0)
        break;
      link.push_back(via);
      path.push_back(next);
      prev = cur;
      cur = next;
    }
    // Viterbi: best[i][o] = unary + min over the previous option.
    std::vector<std::vector<double>> best(path.size());
    std::vector<std::vector<int>> from(path.size());
    for (size_t i = 0; i < path.size(); ++i) {
      const auto &u = p.unary[path[i]];
      best[i].assign(u.size(), kInf);
      from[i].assign(u.size(), 0);
      for (size_t o = 0; o < u.size(); ++o) {
        if (i == 0) {
          best[i][o] = u[o];
          continue;
        }
        const auto &q = p.pairs[link[i - 1]];
        for (size_t po = 0; po < best[i - 1].size(); ++po) {
          double c = best[i - 1][po] + pairCost(q, path[i - 1], (int)po, (int)o) + u[o];
          if (c < best[i][o]) {
            best[i][o] = c;
            from[i][o] = (int)po;
          }
        }
      }
    }
    size_t last = path.size() - 1;
    int o = (int)(std::min_element(best[last].begin(), best[last].end()) - best[last].begin());
    for (size_t i = path.size(); i-- > 0;) {
      s.option[path[i]] = o;
      done[path[i]] = true;
      o = from[i][o];
    }
  }
  s.cost = totalCost(p, s.option);
  s.ok = std::isfinite(s.cost);
  s.optimal = s.ok;
  if (!s.ok)
    s.error = "every assignment is forbidden";
  return s;
}

ChoiceSolution solveILP(const ChoiceProblem &p) {
  ChoiceSolution s;
  s.method = "ilp";
  const int n = (int)p.unary.size();
  Cbc_Model *m = Cbc_newModel();
  Cbc_setLogLevel(m, 0);
  std::vector<std::vector<int>> x(n);
  int cols = 0;
  for (int g = 0; g < n; ++g)
    for (double u : p.unary[g]) {
      bool ok = std::isfinite(u);
      Cbc_addCol(m, "", 0.0, ok ? 1.0 : 0.0, ok ? u : 0.0, 1, 0, nullptr, nullptr);
      x[g].push_back(cols++);
    }
  // One option per variable.
  for (int g = 0; g < n; ++g) {
    std::vector<double> ones(x[g].size(), 1.0);
    Cbc_addRow(m, "", (int)x[g].size(), x[g].data(), ones.data(), 'E', 1.0);
  }
  // Pairwise terms: y = x_a * x_b, linearized in the direction the objective pushes.
  for (const auto &q : p.pairs)
    for (size_t oa = 0; oa < q.cost.size(); ++oa)
      for (size_t ob = 0; ob < q.cost[oa].size(); ++ob) {
        double c = q.cost[oa][ob];
        int xa = x[q.a][oa], xb = x[q.b][ob];
        if (c == 0)
          continue;
        if (!std::isfinite(c)) {
          int idx[2] = {xa, xb};
          double val[2] = {1, 1};
          Cbc_addRow(m, "", 2, idx, val, 'L', 1.0);
          continue;
        }
        int y = cols++;
        Cbc_addCol(m, "", 0.0, 1.0, c, 0, 0, nullptr, nullptr);
        if (c > 0) { // y >= xa + xb - 1
          int idx[3] = {xa, xb, y};
          double val[3] = {1, 1, -1};
          Cbc_addRow(m, "", 3, idx, val, 'L', 1.0);
        } else { // y <= xa, y <= xb
          int i1[2] = {y, xa}, i2[2] = {y, xb};
          double v[2] = {1, -1};
          Cbc_addRow(m, "", 2, i1, v, 'L', 0.0);
          Cbc_addRow(m, "", 2, i2, v, 'L', 0.0);
        }
      }
  Cbc_setObjSense(m, 1);
  Cbc_solve(m);
  if (Cbc_isProvenOptimal(m)) {
    const double *sol = Cbc_getColSolution(m);
    s.option.assign(n, 0);
    for (int g = 0; g < n; ++g)
      for (size_t o = 0; o < x[g].size(); ++o)
        if (sol[x[g][o]] > 0.5)
          s.option[g] = (int)o;
    s.cost = totalCost(p, s.option);
    s.ok = std::isfinite(s.cost);
    s.optimal = s.ok;
    if (!s.ok)
      s.error = "the solver's assignment is forbidden";
  } else {
    s.error = Cbc_isProvenInfeasible(m) ? "every assignment is forbidden"
                                        : "the integer program was not solved to optimality";
  }
  Cbc_deleteModel(m);
  return s;
}

ChoiceSolution solveChoices(const ChoiceProblem &p) {
  return isChainProblem(p) ? solveChainDP(p) : solveILP(p);
}

std::string layerGlob(const std::string &node) {
  std::string prefix;
  int number;
  if (!layerOfNode(node, prefix, number))
    return escapeGlob(node);
  std::string seg = prefix + "." + std::to_string(number);
  // The path component that is exactly "prefix.number".
  size_t at = 0;
  while ((at = node.find(seg, at)) != std::string::npos) {
    bool startOk = at == 0 || node[at - 1] == '/';
    size_t end = at + seg.size();
    bool endOk = end == node.size() || node[end] == '/';
    if (startOk && endOk)
      return escapeGlob(node.substr(0, at + prefix.size() + 1)) + "*" +
             escapeGlob(node.substr(end));
    at = end;
  }
  return escapeGlob(node);
}

OpSearchResult searchOpChoices(const Profile &profile, const Profile &base, const Cluster &cluster,
                               const Candidate &c, const PlannerOptions &opts,
                               const PinnedProfile &build, const OpSearchOptions &so) {
  OpSearchResult r;
  r.before = r.after = estimate(profile, base, cluster, c, opts);
  if (c.tp <= 1) {
    r.skippedWhy = "tp=1: every op is whole on its rank";
    return r;
  }
  if (!r.before.fits) {
    r.skippedWhy = "the plan does not fit";
    return r;
  }
  const double f0 = r.before.time.total;

  // Groups by layer-independent glob, in program order; the user's pins stay.
  std::vector<llvm::GlobPattern> userPins;
  for (const OpOverride &o : opts.constraints.pins)
    if (auto g = llvm::GlobPattern::create(o.glob))
      userPins.push_back(std::move(*g));
  struct Group {
    std::string glob;
    std::string chosen;               // the partitioner's choice ("mixed" when layers differ)
    std::vector<std::string> options; // other than the default
    std::vector<double> delta;        // unary price change per option
    std::vector<int> kept;            // indices into options worth pairing
  };
  std::vector<Group> groups;
  std::map<std::string, int> groupOf;
  std::vector<int> siteGroup(profile.sites.size(), -1);
  for (size_t i = 0; i < profile.sites.size(); ++i) {
    const ChoiceSite &s = profile.sites[i];
    bool pinned = false;
    for (const auto &g : userPins)
      pinned |= g.match(s.node);
    if (pinned || s.chosen == "partial")
      continue;
    // Under pp, a parameter used on two stages (GPT's tied embedding, read by
    // the gather on the first stage and the head on the last) keeps the
    // layouts the partitioner gives the ops outside the numbered layers: the
    // pipeline split cannot yet join that parameter's two gradients when the
    // gather is split another way (a 175B plan on 64 A100s pinned
    // /wte/Gather to its hidden dimension and carve compile refused it).
    if (c.pp > 1 && profile.sharedParams > 0 && layerName(s.node).empty())
      continue;
    std::string glob = layerGlob(s.node);
    auto [it, fresh] = groupOf.emplace(glob, (int)groups.size());
    if (fresh) {
      Group g;
      g.glob = glob;
      g.chosen = s.chosen;
      for (const std::string &d : s.dims)
        if (d != s.chosen)
          g.options.push_back(d);
      if (s.chosen != "replicate")
        g.options.push_back("replicate");
      groups.push_back(std::move(g));
    } else if (groups[it->second].chosen != s.chosen) {
      groups[it->second].chosen = "mixed";
    }
    siteGroup[i] = it->second;
  }

  std::optional<Estimate> bestSingle;
  std::vector<OpOverride> bestSinglePins;
  auto priceOn = [&](int worker, const std::vector<OpOverride> &extra, Estimate &out) {
    Profile pr;
    std::string why;
    if (!build(worker, extra, pr, why))
      return kInf;
    out = estimate(pr, base, cluster, c, opts);
    return out.fits ? out.time.total : kInf;
  };
  auto price = [&](const std::vector<OpOverride> &extra, Estimate *out) {
    ++r.priced;
    Estimate e;
    double f = priceOn(0, extra, e);
    if (out)
      *out = e;
    return f;
  };
  // A batch of prices, side by side on the workers; results in job order.
  struct Priced {
    double f = kInf;
    Estimate e;
  };
  auto priceAll = [&](const std::vector<std::vector<OpOverride>> &jobs) {
    std::vector<Priced> out(jobs.size());
    r.priced += (int)jobs.size();
    std::atomic<size_t> next{0};
    auto work = [&](int worker) {
      for (size_t k; (k = next++) < jobs.size();)
        out[k].f = priceOn(worker, jobs[k], out[k].e);
    };
    const int n = (int)std::min<size_t>(std::max(1, so.workers), jobs.size());
    std::vector<std::thread> threads;
    for (int w = 1; w < n; ++w) {
      try {
        threads.emplace_back(work, w);
      } catch (const std::system_error &) {
        break; // no thread to be had: the workers started (and this one) take every job
      }
    }
    work(0);
    for (std::thread &t : threads)
      t.join();
    return out;
  };

  // Unary prices: every group's options, the first `budget` of them.
  std::vector<std::vector<OpOverride>> unaryJobs;
  for (const Group &g : groups)
    for (const std::string &o : g.options)
      if ((int)unaryJobs.size() < so.budget)
        unaryJobs.push_back({{g.glob, o}});
  const std::vector<Priced> unaryPrices = priceAll(unaryJobs);
  size_t nextUnary = 0;
  for (Group &g : groups) {
    for (const std::string &o : g.options) {
      double f = kInf;
      if (nextUnary < unaryPrices.size()) {
        const Priced &p = unaryPrices[nextUnary++];
        f = p.f;
        if (std::isfinite(f) && (!bestSingle || f < bestSingle->time.total)) {
          bestSingle = p.e;
          bestSinglePins = {{g.glob, o}};
        }
      } else {
        r.budgetHit = true;
      }
      g.delta.push_back(f - f0);
      if (std::isfinite(f) && f - f0 < so.keepFraction * f0)
        g.kept.push_back((int)g.delta.size() - 1);
    }
    if (!g.options.empty())
      ++r.groups;
  }

  // The problem over groups with options worth considering.
  ChoiceProblem prob;
  std::vector<int> var(groups.size(), -1), groupOfVar;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    if (groups[gi].kept.empty())
      continue;
    var[gi] = (int)groupOfVar.size();
    groupOfVar.push_back((int)gi);
    std::vector<double> u{0.0};
    for (int k : groups[gi].kept)
      u.push_back(groups[gi].delta[k]);
    prob.unary.push_back(u);
  }
  std::set<std::pair<int, int>> edges;
  for (size_t i = 0; i < profile.sites.size(); ++i)
    for (int pi : profile.sites[i].producers) {
      int a = siteGroup[pi], b = siteGroup[i];
      if (a < 0 || b < 0 || a == b || var[a] < 0 || var[b] < 0)
        continue;
      edges.insert({std::min(a, b), std::max(a, b)});
    }
  // Pairwise prices, in edge order, as many as the budget leaves.
  std::vector<std::vector<OpOverride>> pairJobs;
  for (auto [a, b] : edges) {
    const Group &ga = groups[a], &gb = groups[b];
    for (size_t i = 0; i < ga.kept.size(); ++i)
      for (size_t j = 0; j < gb.kept.size(); ++j)
        if (r.priced + (int)pairJobs.size() < so.budget)
          pairJobs.push_back(
              {{ga.glob, ga.options[ga.kept[i]]}, {gb.glob, gb.options[gb.kept[j]]}});
  }
  const std::vector<Priced> pairPrices = priceAll(pairJobs);
  size_t nextPair = 0;
  for (auto [a, b] : edges) {
    const Group &ga = groups[a], &gb = groups[b];
    ChoiceProblem::Pair q;
    q.a = var[a];
    q.b = var[b];
    q.cost.assign(ga.kept.size() + 1, std::vector<double>(gb.kept.size() + 1, 0.0));
    bool any = false;
    for (size_t i = 0; i < ga.kept.size(); ++i)
      for (size_t j = 0; j < gb.kept.size(); ++j) {
        if (nextPair >= pairPrices.size()) {
          r.budgetHit = true;
          continue;
        }
        double f = pairPrices[nextPair++].f;
        double d = std::isfinite(f) ? f - f0 - ga.delta[ga.kept[i]] - gb.delta[gb.kept[j]] : kInf;
        if (std::fabs(d) > 1e-12 * f0) {
          q.cost[i + 1][j + 1] = d;
          any = true;
        }
      }
    if (any)
      prob.pairs.push_back(std::move(q));
  }

  // Solve, then price the answer exactly; keep the best of the answer, the
  // best single change and the partitioner's own choices.
  std::vector<OpOverride> pins;
  Estimate best = r.before;
  if (!prob.unary.empty()) {
    ChoiceSolution sol = solveChoices(prob);
    r.method = sol.method;
    if (sol.ok) {
      std::vector<OpOverride> solPins;
      for (size_t v = 0; v < sol.option.size(); ++v)
        if (sol.option[v] > 0) {
          const Group &g = groups[groupOfVar[v]];
          solPins.push_back({g.glob, g.options[g.kept[sol.option[v] - 1]]});
        }
      if (!solPins.empty()) {
        bool sameAsSingle = solPins.size() == 1 && bestSinglePins.size() == 1 &&
                            solPins[0].glob == bestSinglePins[0].glob &&
                            solPins[0].dim == bestSinglePins[0].dim;
        Estimate e;
        double f;
        if (sameAsSingle) {
          e = *bestSingle;
          f = e.time.total;
        } else {
          f = price(solPins, &e);
        }
        if (std::isfinite(f) && f < best.time.total) {
          best = e;
          pins = solPins;
        }
      }
    }
  }
  if (bestSingle && bestSingle->time.total < best.time.total) {
    best = *bestSingle;
    pins = bestSinglePins;
  }
  r.ran = true;
  // A change must be worth more than rounding to be proposed.
  if (best.time.total < f0 * (1 - 1e-6)) {
    r.pins = pins;
    r.after = best;
    for (const OpOverride &o : pins) {
      std::string from = groups[groupOf[o.glob]].chosen;
      r.changes.push_back(o.glob + ": " + from + " -> " + o.dim);
    }
  }
  return r;
}

} // namespace carve::planner
