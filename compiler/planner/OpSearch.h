//===- OpSearch.h - per-op partition choices the standard rules leave open -===//
//
// The partitioner settles each op's split over tp on its own: Megatron's
// rules for the matmuls with a parameter, then the cheapest local choice for
// the rest. OpSearch revisits those choices for one plan with the planner's
// cost model, which sees what the partitioner does not: the step time on the
// cluster, the memory each choice keeps, and how choices interact.
//
// 1. Groups: the forward ops that take a choice (Profile::sites), merged
//    across layers by node name with the layer number as `*` (all layers of
//    a transformer decide alike). The user's pins are left alone.
// 2. Prices: the plan with each group's other options pinned, one at a
//    time (unary terms), then with pairs of options on groups that exchange
//    data (pairwise terms), each from a real partition of the model and
//    `estimate`. An option that does not fit or does not partition is out.
// 3. Solve: minimize the sum of unary and pairwise terms. When the groups
//    that interact form chains, a dynamic program along each chain (in
//    layer order) is exact; otherwise (residual branches, shared inputs) an
//    integer program, solved with CBC (coinor-libcbc).
// 4. The solution is priced exactly; it is kept only if it beats the
//    partitioner's own choices and every single change. docs/planner.md.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_PLANNER_OPSEARCH_H
#define CARVE_COMPILER_PLANNER_OPSEARCH_H

#include "compiler/planner/Planner.h"

#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace carve::planner {

/// The combinatorial core: variables with a few options each, unary costs,
/// and pairwise costs on some pairs. Infinite costs forbid.
struct ChoiceProblem {
  /// unary[g][o]: the cost of option o of variable g (option 0 is the default).
  std::vector<std::vector<double>> unary;
  struct Pair {
    int a, b;                             // variables, a != b
    std::vector<std::vector<double>> cost; // [option of a][option of b]
  };
  std::vector<Pair> pairs;
};

struct ChoiceSolution {
  std::vector<int> option; // per variable
  double cost = std::numeric_limits<double>::infinity();
  std::string method; // "dp" or "ilp"
  bool optimal = false;
  bool ok = false;
  std::string error;
};

/// True when the pairs form disjoint paths (no variable in more than two
/// pairs, no cycle, no pair listed twice): the dynamic program is exact.
bool isChainProblem(const ChoiceProblem &p);
/// Dynamic program along each path of a chain problem.
ChoiceSolution solveChainDP(const ChoiceProblem &p);
/// Integer program with CBC: binary x[g][o], one option per variable, a
/// linearized product for each pairwise term, forbidden pairs as cuts.
ChoiceSolution solveILP(const ChoiceProblem &p);
/// The chain DP when it is exact, else the integer program.
ChoiceSolution solveChoices(const ChoiceProblem &p);

/// Builds the profile of the plan's (tp, sp) with extra pins (on top of the
/// user's), in worker `worker` (0 .. OpSearchOptions::workers - 1): workers
/// run side by side, each on a model and context of its own.
using PinnedProfile = std::function<bool(int worker, const std::vector<OpOverride> &extra,
                                         Profile &out, std::string &error)>;

struct OpSearchOptions {
  /// Options whose own change costs more than this fraction of the step are
  /// not paired (they stay at their default or their single price).
  double keepFraction = 0.02;
  /// At most this many partitions priced (unary + pairwise).
  int budget = 160;
  /// Threads pricing partitions side by side; the result does not depend on
  /// their number (each price is the same, taken in the same order).
  int workers = 1;
};

struct OpSearchResult {
  bool ran = false;          // a plan with tp > 1 and something to choose
  std::string skippedWhy;    // when it did not run
  int groups = 0;            // groups with another option to try
  int priced = 0;            // partitions priced
  bool budgetHit = false;    // pairwise prices left out for lack of budget
  std::string method;        // "dp", "ilp" or "" (no interacting options)
  std::vector<OpOverride> pins; // the choices that beat the partitioner's (empty: none did)
  Estimate before, after;       // the plan with the partitioner's choices, and with `pins`
  std::vector<std::string> changes; // "GLOB: n x 3 -> replicate" per pin
};

/// Searches per-op choices for plan `c` whose default profile is `profile`.
OpSearchResult searchOpChoices(const Profile &profile, const Profile &base, const Cluster &cluster,
                               const Candidate &c, const PlannerOptions &opts,
                               const PinnedProfile &build, const OpSearchOptions &so = {});

/// The layer-independent glob of a node name ("/h.3/mlp/MatMul" -> "/h.*/mlp/MatMul").
std::string layerGlob(const std::string &node);

} // namespace carve::planner

#endif // CARVE_COMPILER_PLANNER_OPSEARCH_H
