//===- OpSearchTest.cpp - the per-op choice solvers against brute force ---===//
//
// The dynamic program (chains) and the integer program (CBC, any graph)
// must find the minimum that trying every assignment finds, with forbidden
// (infinite) options and pairs; the chain test must recognise exactly the
// problems the DP solves; layer globs must name every layer and nothing else.

#include "compiler/planner/OpSearch.h"
#include "compiler/partition/Partitioner.h"
#include "compiler/stages/StageSplit.h"

#include "llvm/Support/GlobPattern.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

using namespace carve::planner;
using carve::decidingOverride;
using carve::globSpecificity;
using carve::OpOverride;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double costOf(const ChoiceProblem &p, const std::vector<int> &o) {
  double t = 0;
  for (size_t g = 0; g < p.unary.size(); ++g)
    t += p.unary[g][o[g]];
  for (const auto &q : p.pairs)
    t += q.cost[o[q.a]][o[q.b]];
  return t;
}

/// The minimum over every assignment.
double bruteForce(const ChoiceProblem &p) {
  std::vector<int> o(p.unary.size(), 0);
  double best = kInf;
  while (true) {
    best = std::min(best, costOf(p, o));
    size_t g = 0;
    while (g < o.size() && ++o[g] == (int)p.unary[g].size())
      o[g++] = 0;
    if (g == o.size())
      return best;
  }
}

/// Random problem: n variables with 1..4 options, pairs on `edges`.
ChoiceProblem randomProblem(std::mt19937 &rng, int n, const std::vector<std::pair<int, int>> &edges,
                            double forbidP) {
  std::uniform_real_distribution<double> u(-1.0, 1.0), coin(0.0, 1.0);
  std::uniform_int_distribution<int> k(1, 4);
  ChoiceProblem p;
  for (int g = 0; g < n; ++g) {
    std::vector<double> c(k(rng));
    for (size_t o = 0; o < c.size(); ++o)
      c[o] = o == 0 ? 0.0 : (coin(rng) < forbidP ? kInf : u(rng));
    p.unary.push_back(c);
  }
  for (auto [a, b] : edges) {
    ChoiceProblem::Pair q{a, b, {}};
    q.cost.assign(p.unary[a].size(), std::vector<double>(p.unary[b].size(), 0.0));
    for (size_t i = 0; i < q.cost.size(); ++i)
      for (size_t j = 0; j < q.cost[i].size(); ++j)
        if (i > 0 || j > 0) // the all-default pair stays feasible
          q.cost[i][j] = coin(rng) < forbidP ? kInf : 2 * u(rng);
    p.pairs.push_back(q);
  }
  return p;
}

} // namespace

TEST(OpSearch, ChainRecognition) {
  ChoiceProblem p;
  p.unary.assign(5, {0.0, 1.0});
  auto pair = [](int a, int b) { return ChoiceProblem::Pair{a, b, {{0, 0}, {0, 0}}}; };
  p.pairs = {pair(0, 1), pair(1, 2), pair(3, 4)};
  EXPECT_TRUE(isChainProblem(p)); // two paths
  p.pairs.push_back(pair(2, 0));
  EXPECT_FALSE(isChainProblem(p)); // a cycle
  p.pairs = {pair(0, 1), pair(0, 2), pair(0, 3)};
  EXPECT_FALSE(isChainProblem(p)); // a star: degree 3
  p.pairs = {pair(0, 1), pair(1, 0)};
  EXPECT_FALSE(isChainProblem(p)); // the same pair twice
  p.pairs = {};
  EXPECT_TRUE(isChainProblem(p));
}

TEST(OpSearch, DynamicProgramIsExactOnChains) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    int n = 1 + trial % 7;
    std::vector<std::pair<int, int>> edges;
    // Paths in a shuffled order and with both orientations.
    std::vector<int> perm(n);
    for (int i = 0; i < n; ++i)
      perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int i = 0; i + 1 < n; ++i)
      if (rng() % 4 != 0) // sometimes break the path in two
        edges.push_back(rng() % 2 ? std::make_pair(perm[i], perm[i + 1])
                                  : std::make_pair(perm[i + 1], perm[i]));
    ChoiceProblem p = randomProblem(rng, n, edges, 0.15);
    ASSERT_TRUE(isChainProblem(p));
    ChoiceSolution s = solveChainDP(p);
    double want = bruteForce(p);
    ASSERT_TRUE(s.ok) << s.error;
    EXPECT_NEAR(s.cost, want, 1e-9) << "trial " << trial;
    EXPECT_NEAR(costOf(p, s.option), s.cost, 1e-12);
    EXPECT_EQ(s.method, "dp");
  }
}

TEST(OpSearch, IntegerProgramIsExactOnAnyGraph) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 60; ++trial) {
    int n = 3 + trial % 5;
    std::vector<std::pair<int, int>> edges;
    for (int a = 0; a < n; ++a)
      for (int b = a + 1; b < n; ++b)
        if (rng() % 2)
          edges.push_back({a, b});
    ChoiceProblem p = randomProblem(rng, n, edges, 0.15);
    ChoiceSolution s = solveILP(p);
    double want = bruteForce(p);
    ASSERT_TRUE(s.ok) << s.error;
    EXPECT_NEAR(s.cost, want, 1e-6) << "trial " << trial;
    EXPECT_EQ(s.method, "ilp");
  }
  // solveChoices picks the DP for a chain and the ILP otherwise.
  ChoiceProblem chain = randomProblem(rng, 3, {{0, 1}, {1, 2}}, 0);
  EXPECT_EQ(solveChoices(chain).method, "dp");
  ChoiceProblem cycle = randomProblem(rng, 3, {{0, 1}, {1, 2}, {2, 0}}, 0);
  EXPECT_EQ(solveChoices(cycle).method, "ilp");
  EXPECT_NEAR(solveChoices(cycle).cost, bruteForce(cycle), 1e-6);
}

TEST(OpSearch, ForbiddenEverywhereIsReported) {
  ChoiceProblem p;
  p.unary = {{kInf, kInf}, {0.0}};
  EXPECT_FALSE(solveChainDP(p).ok);
  EXPECT_FALSE(solveILP(p).ok);
}

TEST(OpSearch, LayerGlobs) {
  EXPECT_EQ(layerGlob("/transformer/h.3/attn/c_attn/MatMul"),
            "/transformer/h.*/attn/c_attn/MatMul");
  EXPECT_EQ(layerGlob("/model/layers.12/mlp/gate_proj/MatMul"),
            "/model/layers.*/mlp/gate_proj/MatMul");
  EXPECT_EQ(layerGlob("/transformer/wte/Gather"), "/transformer/wte/Gather");
  // A GlobPattern refers to its pattern's characters: keep them alive.
  std::string pattern = layerGlob("/h.0/mlp/c_fc/MatMul");
  auto g = llvm::GlobPattern::create(pattern);
  ASSERT_TRUE((bool)g);
  EXPECT_TRUE(g->match("/h.0/mlp/c_fc/MatMul"));
  EXPECT_TRUE(g->match("/h.17/mlp/c_fc/MatMul"));
  EXPECT_FALSE(g->match("/h.17/mlp/c_proj/MatMul"));
  EXPECT_FALSE(g->match("/h.17/mlp/c_fc/MatMul_1"));
  // Glob characters in a node name are escaped.
  std::string odd = layerGlob("/odd[1]/Add");
  auto lit = llvm::GlobPattern::create(odd);
  ASSERT_TRUE((bool)lit);
  EXPECT_TRUE(lit->match("/odd[1]/Add"));
  EXPECT_FALSE(lit->match("/odd1/Add"));
}

// The search pins layer globs that overlap ("/h.*/Add" matches c_attn's bias
// too); the most specific entry decides each node, whatever the entries'
// order (a plan's "ops" is a JSON object, read back in key order).
TEST(OpSearch, TheMostSpecificLayerGlobDecides) {
  EXPECT_EQ(globSpecificity("/h.*/Add"), 7u);
  EXPECT_EQ(globSpecificity("/h.?/Add"), 7u);
  EXPECT_EQ(globSpecificity("/h.[0-9]/Add"), 8u);
  EXPECT_EQ(globSpecificity("/odd\\[1\\]/Add"), 11u);
  const std::string bias = layerGlob("/h.0/attn/c_attn/Add"), add = layerGlob("/h.0/Add");
  for (bool biasFirst : {true, false}) {
    std::vector<OpOverride> entries =
        biasFirst ? std::vector<OpOverride>{{bias, "b"}, {add, "replicate"}}
                  : std::vector<OpOverride>{{add, "replicate"}, {bias, "b"}};
    std::vector<std::optional<llvm::GlobPattern>> globs;
    for (const OpOverride &o : entries)
      globs.push_back(std::move(*llvm::GlobPattern::create(o.glob)));
    std::string conflict;
    int k = decidingOverride(entries, globs, "/h.3/attn/c_attn/Add", conflict);
    ASSERT_GE(k, 0);
    EXPECT_EQ(entries[k].glob, bias);
    k = decidingOverride(entries, globs, "/h.3/Add", conflict);
    ASSERT_GE(k, 0);
    EXPECT_EQ(entries[k].glob, add);
    EXPECT_EQ(decidingOverride(entries, globs, "/wte/Gather", conflict), -1);
  }
  // Equally specific entries that disagree on a node are a conflict.
  std::vector<OpOverride> tie{{"/h.?/Add", "a"}, {"/h.0/*dd", "replicate"}};
  std::vector<std::optional<llvm::GlobPattern>> globs;
  for (const OpOverride &o : tie)
    globs.push_back(std::move(*llvm::GlobPattern::create(o.glob)));
  std::string conflict;
  EXPECT_EQ(decidingOverride(tie, globs, "/h.0/Add", conflict), -2);
  // A tie below the most specific entry is no conflict, in either order.
  for (bool specificLast : {true, false}) {
    std::vector<OpOverride> three = tie;
    three.insert(specificLast ? three.end() : three.begin(), {"/h.0/Add", "b"});
    std::vector<std::optional<llvm::GlobPattern>> g3;
    for (const OpOverride &o : three)
      g3.push_back(std::move(*llvm::GlobPattern::create(o.glob)));
    const int k = decidingOverride(three, g3, "/h.0/Add", conflict);
    ASSERT_GE(k, 0);
    EXPECT_EQ(three[k].glob, "/h.0/Add");
  }
  EXPECT_NE(conflict.find("\"/h.?/Add\" and \"/h.0/*dd\" both match node /h.0/Add"),
            std::string::npos)
      << conflict;
}

// Tests which globs single out numbered layers (globNamesSomeLayers): where
// one applies, a builtin model's layers differ, so carve plan profiles every
// layer and its as-compiled check compiles the whole model. The per-op
// search's own globs (layerGlob) name every layer alike.
TEST(OpSearch, GlobsThatNameSomeLayers) {
  for (const char *g : {"/h.11/mlp/*", "h.1*", "h.[0-3].*", "/blocks.0/attn/MatMul", "h.9.*",
                        "/model/layers.12/mlp/gate_proj/MatMul"})
    EXPECT_TRUE(carve::globNamesSomeLayers(g)) << g;
  for (const char *g : {"/h.*/attn/c_attn/MatMul", "wte.*", "h.*.mlp.*", "*", "lm_head.weight",
                        "/transformer/wte/Gather", "/ln_f/LayerNormalization"})
    EXPECT_FALSE(carve::globNamesSomeLayers(g)) << g;
  for (const char *node :
       {"/transformer/h.3/attn/c_attn/MatMul", "/model/layers.12/mlp/Mul", "/wte/Gather"})
    EXPECT_FALSE(carve::globNamesSomeLayers(layerGlob(node))) << layerGlob(node);
}
