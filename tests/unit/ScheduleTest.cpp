//===- ScheduleTest.cpp - pipeline schedules, their simulation and pictures ===//

#include "compiler/schedule/Schedule.h"
#include "compiler/schedule/Timeline.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

using namespace carve::pipeline;

namespace {

/// One configuration of the sweep the tests run over.
struct Config {
  ScheduleKind kind;
  int p, m, v;
};

std::string describe(const Config &c) {
  return std::string(scheduleName(c.kind)) + " p=" + std::to_string(c.p) +
         " m=" + std::to_string(c.m) + " v=" + std::to_string(c.v);
}

/// p in {1, 2, 4}, m in {1, 2, 4, 8}; interleaved with v in {1, 2, 3} where
/// m % p == 0.
std::vector<Config> sweep() {
  std::vector<Config> configs;
  for (int p : {1, 2, 4}) {
    for (int m : {1, 2, 4, 8}) {
      configs.push_back({ScheduleKind::GPipe, p, m, 1});
      configs.push_back({ScheduleKind::OneFOneB, p, m, 1});
      if (m % p == 0)
        for (int v : {1, 2, 3})
          configs.push_back({ScheduleKind::Interleaved, p, m, v});
    }
  }
  return configs;
}

Schedule built(const Config &c) {
  Schedule s;
  std::string error;
  EXPECT_TRUE(buildSchedule(c.kind, c.p, c.m, c.v, s, error)) << describe(c) << ": " << error;
  return s;
}

std::string buildError(ScheduleKind kind, int p, int m, int v) {
  Schedule s;
  std::string error;
  EXPECT_FALSE(buildSchedule(kind, p, m, v, s, error));
  return error;
}

/// "F0 F1 B0 ...", with ".c<chunk>" when chunks > 1.
std::string render(const std::vector<Instr> &list, int chunks) {
  std::string text;
  for (const Instr &in : list) {
    text += text.empty() ? "" : " ";
    text += (in.kind == Instr::Forward ? "F" : "B") + std::to_string(in.microBatch);
    if (chunks > 1)
      text += ".c" + std::to_string(in.chunk);
  }
  return text;
}

std::vector<StageCost> equalCosts(int stages, double forward, double backward) {
  StageCost c;
  c.forward = forward;
  c.backward = backward;
  return std::vector<StageCost>(stages, c);
}

Timeline simulated(const Schedule &s, const std::vector<StageCost> &costs, double latency) {
  Timeline t;
  std::string error;
  EXPECT_TRUE(simulate(s, costs, latency, t, error)) << error;
  return t;
}

size_t occurrences(const std::string &text, const std::string &needle) {
  size_t count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1))
    ++count;
  return count;
}

Instr fwd(int mb) { return {Instr::Forward, mb, 0, 0}; }
Instr bwd(int mb) { return {Instr::Backward, mb, 0, 0}; }

TEST(ScheduleKindNames, RoundTripAndUnknown) {
  for (ScheduleKind k : {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved}) {
    ScheduleKind parsed = ScheduleKind::GPipe;
    std::string error;
    ASSERT_TRUE(parseScheduleKind(scheduleName(k), parsed, error)) << error;
    EXPECT_EQ(parsed, k);
  }
  EXPECT_STREQ(scheduleName(ScheduleKind::OneFOneB), "1f1b");
  ScheduleKind kind;
  std::string error;
  EXPECT_FALSE(parseScheduleKind("foo", kind, error));
  EXPECT_EQ(error, "unknown pipeline schedule 'foo' (known: gpipe, 1f1b, interleaved)");
}

TEST(ScheduleBuild, Errors) {
  EXPECT_EQ(buildError(ScheduleKind::Interleaved, 4, 6, 2),
            "interleaved needs num_micro_batches (m=6) to be a multiple of pp (4)");
  EXPECT_NE(buildError(ScheduleKind::GPipe, 2, 4, 2)
                .find("virtual_stages applies to the interleaved schedule only"),
            std::string::npos);
  EXPECT_NE(buildError(ScheduleKind::OneFOneB, 2, 4, 3)
                .find("virtual_stages applies to the interleaved schedule only"),
            std::string::npos);
  for (auto [p, m, v] : {std::tuple{0, 1, 1}, std::tuple{1, 0, 1}, std::tuple{1, 1, 0}})
    EXPECT_NE(buildError(ScheduleKind::Interleaved, p, m, v).find("at least 1"), std::string::npos);
}

// Tests that each rank runs each (micro-batch, chunk) forward and backward once,
// its forward before its backward, and each chunk's backwards in micro-batch
// order (gradient accumulation relies on it).
// Forwards and backwards of every chunk visit micro-batches in order: gradient
// accumulation relies on it, and so do pipeline messages that share a tag over
// several micro-batches (PipelineStage.cpp, messageTag): equal tags match in
// the order they are posted.
TEST(ScheduleBuild, EveryStepOnceInOrder) {
  for (const Config &c : sweep()) {
    SCOPED_TRACE(describe(c));
    Schedule s = built(c);
    ASSERT_EQ(s.ranks.size(), static_cast<size_t>(c.p));
    EXPECT_EQ(s.numStages(), c.p * c.v);
    for (int r = 0; r < c.p; ++r) {
      ASSERT_EQ(s.ranks[r].size(), static_cast<size_t>(2 * c.m * c.v));
      std::map<std::pair<int, int>, int> forwards, backwards;
      std::vector<int> nextForward(c.v, 0), nextBackward(c.v, 0);
      for (const Instr &in : s.ranks[r]) {
        ASSERT_GE(in.chunk, 0);
        ASSERT_LT(in.chunk, c.v);
        ASSERT_GE(in.microBatch, 0);
        ASSERT_LT(in.microBatch, c.m);
        auto key = std::make_pair(in.microBatch, in.chunk);
        if (in.kind == Instr::Forward) {
          ++forwards[key];
          EXPECT_EQ(in.microBatch, nextForward[in.chunk]++) << "rank " << r;
        } else {
          EXPECT_EQ(forwards[key], 1) << "backward before forward, rank " << r;
          ++backwards[key];
          EXPECT_EQ(in.microBatch, nextBackward[in.chunk]++) << "rank " << r;
        }
      }
      EXPECT_EQ(forwards.size(), static_cast<size_t>(c.m * c.v));
      EXPECT_EQ(backwards.size(), static_cast<size_t>(c.m * c.v));
      for (auto &[key, n] : forwards)
        EXPECT_EQ(n, 1);
      for (auto &[key, n] : backwards)
        EXPECT_EQ(n, 1);
    }
  }
}

// Tests that slots pair each forward with its backward, never hand one slot to
// two live micro-batches of a chunk, and that their count is the chunk's peak
// number of live micro-batches.
TEST(ScheduleBuild, SlotsMatchInFlight) {
  for (const Config &c : sweep()) {
    SCOPED_TRACE(describe(c));
    Schedule s = built(c);
    ASSERT_EQ(s.slots.size(), static_cast<size_t>(c.p));
    for (int r = 0; r < c.p; ++r) {
      ASSERT_EQ(s.slots[r].size(), static_cast<size_t>(c.v));
      std::vector<std::map<int, int>> live(c.v); // slot -> micro-batch
      std::vector<int> peak(c.v, 0);
      for (const Instr &in : s.ranks[r]) {
        std::map<int, int> &chunkLive = live[in.chunk];
        if (in.kind == Instr::Forward) {
          EXPECT_EQ(chunkLive.count(in.slot), 0u) << "slot " << in.slot << " reused while live";
          // Smallest free slot.
          for (int lower = 0; lower < in.slot; ++lower)
            EXPECT_EQ(chunkLive.count(lower), 1u) << "slot " << lower << " was free";
          chunkLive[in.slot] = in.microBatch;
          peak[in.chunk] = std::max(peak[in.chunk], static_cast<int>(chunkLive.size()));
        } else {
          ASSERT_EQ(chunkLive.count(in.slot), 1u);
          EXPECT_EQ(chunkLive[in.slot], in.microBatch);
          chunkLive.erase(in.slot);
        }
        EXPECT_LT(in.slot, s.slots[r][in.chunk]);
      }
      for (int ch = 0; ch < c.v; ++ch)
        EXPECT_EQ(s.slots[r][ch], peak[ch]) << "rank " << r << " chunk " << ch;
    }
  }
}

TEST(ScheduleBuild, InFlightGPipeAnd1F1B) {
  for (int p : {1, 2, 4}) {
    for (int m : {1, 2, 4, 8}) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      Schedule g = built({ScheduleKind::GPipe, p, m, 1});
      Schedule f = built({ScheduleKind::OneFOneB, p, m, 1});
      EXPECT_EQ(g.maxInFlight(0), m);
      EXPECT_LE(f.maxInFlight(0), p);
      EXPECT_EQ(f.maxInFlight(0), std::min(p, m));
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(g.maxInFlight(r), m);
        // Warm-up p-r-1 forwards plus the first steady-state forward.
        EXPECT_EQ(f.maxInFlight(r), std::min(p - r, m)) << "rank " << r;
      }
    }
  }
}

TEST(ScheduleBuild, ListsWrittenOut) {
  EXPECT_EQ(render(built({ScheduleKind::GPipe, 4, 3, 1}).ranks[2], 1), "F0 F1 F2 B0 B1 B2");
  Schedule f = built({ScheduleKind::OneFOneB, 4, 8, 1});
  EXPECT_EQ(render(f.ranks[0], 1), "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  EXPECT_EQ(render(f.ranks[1], 1), "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7");
  EXPECT_EQ(render(f.ranks[3], 1), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
  // Fewer micro-batches than ranks: the warm-up is all of them.
  EXPECT_EQ(render(built({ScheduleKind::OneFOneB, 4, 2, 1}).ranks[0], 1), "F0 F1 B0 B1");

  // p=2, m=4, v=2: rank 0 holds stages 0 and 2, warm-up 2*(2-0-1) + (2-1)*2 = 4.
  Schedule i = built({ScheduleKind::Interleaved, 2, 4, 2});
  EXPECT_EQ(render(i.ranks[0], 2), "F0.c0 F1.c0 F0.c1 F1.c1 F2.c0 B0.c1 F3.c0 B1.c1 "
                                   "F2.c1 B0.c0 F3.c1 B1.c0 B2.c1 B3.c1 B2.c0 B3.c0");
  // Rank 1 holds stages 1 and 3, warm-up (2-1)*2 = 2.
  EXPECT_EQ(render(i.ranks[1], 2), "F0.c0 F1.c0 F0.c1 B0.c1 F1.c1 B1.c1 F2.c0 B0.c0 "
                                   "F3.c0 B1.c0 F2.c1 B2.c1 F3.c1 B3.c1 B2.c0 B3.c0");
  EXPECT_EQ(i.stageOf(1, 1), 3);
}

TEST(ScheduleBuild, InterleavedOneChunkIs1F1B) {
  for (int p : {1, 2, 4}) {
    for (int m : {4, 8}) {
      Schedule i = built({ScheduleKind::Interleaved, p, m, 1});
      Schedule f = built({ScheduleKind::OneFOneB, p, m, 1});
      for (int r = 0; r < p; ++r)
        EXPECT_EQ(render(i.ranks[r], 1), render(f.ranks[r], 1)) << "p=" << p << " m=" << m;
      EXPECT_EQ(i.slots, f.slots);
    }
  }
}

// Tests that no built schedule deadlocks and that the bubble is the textbook
// (p-1)/m, or (p-1)/(m*v) for interleaved where a chunk costs 1/v of a stage.
TEST(ScheduleSimulate, BubbleMatchesFormula) {
  for (const Config &c : sweep()) {
    SCOPED_TRACE(describe(c));
    Schedule s = built(c);
    Timeline t = simulated(s, equalCosts(s.numStages(), 1.0 / c.v, 2.0 / c.v), 0);
    ASSERT_EQ(t.items.size(), static_cast<size_t>(2 * c.p * c.m * c.v));
    EXPECT_NEAR(t.compute, 3.0 * c.m, 1e-12);
    EXPECT_NEAR(t.bubble, static_cast<double>(c.p - 1) / (c.m * c.v), 1e-12);
    EXPECT_NEAR(t.makespan, t.compute * (1 + t.bubble), 1e-9);
    for (int r = 0; r < c.p; ++r)
      EXPECT_EQ(t.peakInFlight[r], s.maxInFlight(r));
  }
}

// Tests the rules themselves on every timed step: a rank runs one step at a
// time in list order, and no step starts before what it depends on has ended
// plus the latency across ranks.
TEST(ScheduleSimulate, RespectsDependenciesAndLatency) {
  const double latency = 0.25;
  for (const Config &c : sweep()) {
    SCOPED_TRACE(describe(c));
    Schedule s = built(c);
    std::vector<StageCost> costs;
    for (int st = 0; st < s.numStages(); ++st)
      costs.push_back({1.0 + 0.1 * st, 1.5 + 0.2 * st});
    Timeline t = simulated(s, costs, latency);
    std::map<std::tuple<int, int, int>, TimedInstr> byStep; // kind, mb, stage
    std::vector<double> lastEnd(c.p, 0);
    std::vector<size_t> position(c.p, 0);
    for (const TimedInstr &ti : t.items) {
      EXPECT_EQ(ti.stage, s.stageOf(ti.rank, ti.instr.chunk));
      ASSERT_LT(position[ti.rank], s.ranks[ti.rank].size());
      const Instr &expected = s.ranks[ti.rank][position[ti.rank]++];
      EXPECT_EQ(ti.instr.kind, expected.kind);
      EXPECT_EQ(ti.instr.microBatch, expected.microBatch);
      EXPECT_EQ(ti.instr.chunk, expected.chunk);
      EXPECT_GE(ti.start, lastEnd[ti.rank] - 1e-12);
      lastEnd[ti.rank] = ti.end;
      const StageCost &cost = costs[ti.stage];
      EXPECT_NEAR(ti.end - ti.start, ti.instr.kind == Instr::Forward ? cost.forward : cost.backward,
                  1e-12);
      byStep[{ti.instr.kind, ti.instr.microBatch, ti.stage}] = ti;
    }
    for (const auto &[key, ti] : byStep) {
      auto [kind, mb, stage] = key;
      std::vector<std::tuple<int, int, int>> deps;
      if (kind == Instr::Forward && stage > 0)
        deps.push_back({Instr::Forward, mb, stage - 1});
      if (kind == Instr::Backward) {
        deps.push_back({Instr::Forward, mb, stage});
        if (stage + 1 < s.numStages())
          deps.push_back({Instr::Backward, mb, stage + 1});
      }
      for (const auto &d : deps) {
        const TimedInstr &dep = byStep.at(d);
        double ready = dep.end + (dep.rank == ti.rank ? 0 : latency);
        EXPECT_GE(ti.start, ready - 1e-12);
      }
    }
  }
}

TEST(ScheduleSimulate, GPipeTimesByHand) {
  // Two ranks, one micro-batch, latency 0.5: F on rank 0 [0, 1], F on rank 1
  // [1.5, 2.5], B on rank 1 [2.5, 4.5], B on rank 0 [5, 7].
  Schedule s = built({ScheduleKind::GPipe, 2, 1, 1});
  Timeline t = simulated(s, equalCosts(2, 1, 2), 0.5);
  EXPECT_DOUBLE_EQ(t.makespan, 7);
  EXPECT_DOUBLE_EQ(t.compute, 3);
  EXPECT_DOUBLE_EQ(t.bubble, 4.0 / 3);
  ASSERT_EQ(t.items.size(), 4u);
  EXPECT_EQ(t.items[0].rank, 0);
  EXPECT_DOUBLE_EQ(t.items[1].start, 5); // rank 0's backward
  EXPECT_DOUBLE_EQ(t.items[2].start, 1.5);
  EXPECT_DOUBLE_EQ(t.items[3].end, 4.5);

  // p=4, m=8: (m + p - 1) forward-plus-backward times.
  Timeline g = simulated(built({ScheduleKind::GPipe, 4, 8, 1}), equalCosts(4, 1, 2), 0);
  EXPECT_DOUBLE_EQ(g.makespan, 33);
  EXPECT_DOUBLE_EQ(g.compute, 24);
}

TEST(ScheduleSimulate, BackwardBeforeForwardDeadlocks) {
  Schedule s = built({ScheduleKind::GPipe, 1, 1, 1});
  s.ranks[0] = {bwd(0), fwd(0)};
  Timeline t;
  std::string error;
  EXPECT_FALSE(simulate(s, equalCosts(1, 1, 2), 0, t, error));
  EXPECT_EQ(error, "pipeline schedule deadlocks: rank 0 waits for F0 of stage 0 (rank 0) before "
                   "B0 of stage 0");
}

TEST(ScheduleSimulate, TwoRanksWaitingOnEachOtherDeadlock) {
  // Rank 1 starts with F1, which rank 0 runs only after B0, which needs rank
  // 1's B0, which comes after its F1.
  Schedule s = built({ScheduleKind::GPipe, 2, 2, 1});
  s.ranks[0] = {fwd(0), bwd(0), fwd(1), bwd(1)};
  s.ranks[1] = {fwd(1), fwd(0), bwd(0), bwd(1)};
  Timeline t;
  std::string error;
  EXPECT_FALSE(simulate(s, equalCosts(2, 1, 2), 0, t, error));
  EXPECT_NE(error.find("pipeline schedule deadlocks: "), std::string::npos) << error;
  EXPECT_NE(error.find("rank 0 waits for B0 of stage 1 (rank 1) before B0 of stage 0"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("rank 1 waits for F1 of stage 0 (rank 0) before F1 of stage 1"),
            std::string::npos)
      << error;
}

TEST(ScheduleSimulate, MissingStepAndBadInput) {
  Schedule s = built({ScheduleKind::GPipe, 2, 1, 1});
  s.ranks[0] = {bwd(0)};
  Timeline t;
  std::string error;
  EXPECT_FALSE(simulate(s, equalCosts(2, 1, 2), 0, t, error));
  EXPECT_NE(error.find("rank 0 waits for F0 of stage 0, which no rank runs,"), std::string::npos)
      << error;

  Schedule ok = built({ScheduleKind::GPipe, 2, 1, 1});
  EXPECT_FALSE(simulate(ok, equalCosts(3, 1, 2), 0, t, error));
  EXPECT_NE(error.find("one cost per stage (2)"), std::string::npos) << error;
  ok.ranks[1].push_back(fwd(0));
  EXPECT_FALSE(simulate(ok, equalCosts(2, 1, 2), 0, t, error));
  EXPECT_NE(error.find("rank 1 runs F0 of stage 1 twice"), std::string::npos) << error;
}

/// Checks that braces and brackets outside strings balance, the first thing
/// a JSON reader would trip over.
bool jsonBalanced(const std::string &text) {
  std::vector<char> open;
  bool inString = false;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (inString) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        inString = false;
      continue;
    }
    if (c == '"')
      inString = true;
    else if (c == '{' || c == '[')
      open.push_back(c);
    else if (c == '}' || c == ']') {
      if (open.empty() || open.back() != (c == '}' ? '{' : '['))
        return false;
      open.pop_back();
    }
  }
  return open.empty() && !inString;
}

TEST(ScheduleOutput, ChromeTrace) {
  for (const Config &c :
       {Config{ScheduleKind::OneFOneB, 4, 8, 1}, Config{ScheduleKind::Interleaved, 2, 4, 3}}) {
    SCOPED_TRACE(describe(c));
    Schedule s = built(c);
    Timeline t = simulated(s, equalCosts(s.numStages(), 1, 2), 0);
    std::string json = chromeTraceJson(s, t, "demo \"run\" {1}");
    ASSERT_FALSE(json.empty());
    EXPECT_EQ(json.front(), '{');
    EXPECT_TRUE(jsonBalanced(json)) << json;
    EXPECT_EQ(occurrences(json, "\"ph\":\"X\""), static_cast<size_t>(2 * c.m * c.v * c.p));
    EXPECT_EQ(occurrences(json, "\"ph\":\"M\""), static_cast<size_t>(c.p + 1));
    EXPECT_EQ(occurrences(json, "\"cat\":\"backward\""), static_cast<size_t>(c.m * c.v * c.p));
    EXPECT_NE(json.find("\"displayTimeUnit\":\"ms\""), std::string::npos);
    EXPECT_NE(json.find("demo \\\"run\\\" {1}"), std::string::npos);
    EXPECT_NE(json.find(std::string("\"schedule\":\"") + scheduleName(c.kind) + "\""),
              std::string::npos);
    if (c.v == 1) {
      EXPECT_NE(json.find("\"name\":\"rank 3 (stage 3)\""), std::string::npos);
      // Rank 0's first backward waits for micro-batch 0 to pass four forwards
      // and three backwards: 4 * 1 s + 3 * 2 s.
      EXPECT_NE(json.find("\"name\":\"B0\",\"cat\":\"backward\",\"ph\":\"X\",\"ts\":10000000,"
                          "\"dur\":2000000,\"pid\":0,\"tid\":0"),
                std::string::npos)
          << json;
    } else {
      EXPECT_NE(json.find("\"name\":\"rank 1 (stages 1, 3, 5)\""), std::string::npos);
      EXPECT_NE(json.find("\"name\":\"F0.c2\""), std::string::npos);
    }
  }
}

TEST(ScheduleOutput, Svg) {
  for (const Config &c :
       {Config{ScheduleKind::GPipe, 4, 8, 1}, Config{ScheduleKind::Interleaved, 4, 8, 2}}) {
    SCOPED_TRACE(describe(c));
    Schedule s = built(c);
    Timeline t = simulated(s, equalCosts(s.numStages(), 1, 2), 0.1);
    std::string svg = timelineSvg(s, t, "a<b & c");
    EXPECT_NE(svg.find("<svg"), std::string::npos);
    EXPECT_NE(svg.find("</svg>"), std::string::npos);
    EXPECT_EQ(occurrences(svg, "<rect"), static_cast<size_t>(2 * c.m * c.v * c.p));
    EXPECT_NE(svg.find("a&lt;b &amp; c"), std::string::npos);
    EXPECT_EQ(svg.find("a<b"), std::string::npos);
    EXPECT_NE(svg.find(std::string(scheduleName(c.kind)) + ", p=4, m=8, v=" + std::to_string(c.v) +
                       ", bubble "),
              std::string::npos);
    EXPECT_EQ(occurrences(svg, "<text"), occurrences(svg, "</text>"));
  }
}

} // namespace
