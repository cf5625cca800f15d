//===- Schedule.cpp - GPipe, 1F1B and interleaved 1F1B instruction lists --===//

#include "compiler/schedule/Schedule.h"

#include <algorithm>
#include <functional>
#include <queue>

namespace carve::pipeline {
namespace {

Instr forward(int microBatch, int chunk) { return {Instr::Forward, microBatch, chunk, -1}; }
Instr backward(int microBatch, int chunk) { return {Instr::Backward, microBatch, chunk, -1}; }

/// GPipe: every forward, then every backward, both in micro-batch order.
std::vector<Instr> gpipeRank(int m) {
  std::vector<Instr> list;
  list.reserve(2 * (size_t)m);
  for (int mb = 0; mb < m; ++mb)
    list.push_back(forward(mb, 0));
  for (int mb = 0; mb < m; ++mb)
    list.push_back(backward(mb, 0));
  return list;
}

/// 1F1B (PipeDream-flush): rank r runs min(p-r-1, m) warm-up forwards, so
/// that its first backward arrives just as the warm-up ends, then alternates
/// one forward and one backward, then drains the remaining backwards. Rank r
/// never holds more than p-r micro-batches.
std::vector<Instr> oneFOneBRank(int p, int m, int rank) {
  int warmup = std::min(p - rank - 1, m);
  std::vector<Instr> list;
  list.reserve(2 * (size_t)m);
  for (int mb = 0; mb < warmup; ++mb)
    list.push_back(forward(mb, 0));
  for (int k = 0; k < m - warmup; ++k) {
    list.push_back(forward(warmup + k, 0));
    list.push_back(backward(k, 0));
  }
  for (int k = m - warmup; k < m; ++k)
    list.push_back(backward(k, 0));
  return list;
}

/// Interleaved 1F1B (*Efficient Large-Scale Language Model Training on GPU
/// Clusters*, 2021, as in Megatron-LM): each rank holds v chunks, stage
/// chunk*p + rank, and the m*v forwards of a rank are numbered k = 0 .. m*v-1:
///   1. Forward k runs chunk (k / p) % v on micro-batch (k / (p*v)) * p + k % p:
///      groups of p micro-batches pass through chunk 0, then chunk 1, ...
///   2. Backward k runs chunk v-1 - (k / p) % v on the same micro-batch: the
///      groups come back through the chunks in reverse.
///   3. Warm-up: min(2*(p-r-1) + (v-1)*p, m*v) forwards. The (v-1)*p covers
///      the forwards of the earlier chunks every rank must run before the last
///      stage can start a backward; 2*(p-r-1) covers the round trip to the last
///      rank and back.
///   4. Steady state: forward warmup+k, then backward k.
///   5. Cool-down: the remaining backwards.
std::vector<Instr> interleavedRank(int p, int m, int v, int rank) {
  int total = m * v;
  auto microBatch = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto fwd = [&](int k) { return forward(microBatch(k), (k / p) % v); };
  auto bwd = [&](int k) { return backward(microBatch(k), v - 1 - (k / p) % v); };
  int warmup = std::min(2 * (p - rank - 1) + (v - 1) * p, total);
  std::vector<Instr> list;
  list.reserve(2 * (size_t)total);
  for (int k = 0; k < warmup; ++k)
    list.push_back(fwd(k));
  for (int k = 0; k < total - warmup; ++k) {
    list.push_back(fwd(warmup + k));
    list.push_back(bwd(k));
  }
  for (int k = total - warmup; k < total; ++k)
    list.push_back(bwd(k));
  return list;
}

/// Gives each Forward the smallest slot of its chunk that no earlier
/// micro-batch still holds, and its Backward the same slot; returns the
/// number of slots each chunk needs.
std::vector<int> assignSlots(std::vector<Instr> &list, int m, int v) {
  // Per chunk, the slots freed by a Backward (smallest first) and the first
  // slot never used: the smallest slot not held is the heap's top, else that.
  using MinHeap = std::priority_queue<int, std::vector<int>, std::greater<int>>;
  std::vector<MinHeap> freed(v);
  std::vector<std::vector<int>> slotOf(v, std::vector<int>(m, -1));
  std::vector<int> needed(v, 0);
  for (Instr &in : list) {
    if (in.kind == Instr::Forward) {
      MinHeap &f = freed[in.chunk];
      int slot;
      if (!f.empty()) {
        slot = f.top();
        f.pop();
      } else {
        slot = needed[in.chunk]++;
      }
      slotOf[in.chunk][in.microBatch] = slot;
      in.slot = slot;
    } else {
      in.slot = slotOf[in.chunk][in.microBatch];
      freed[in.chunk].push(in.slot);
    }
  }
  return needed;
}

} // namespace

bool parseScheduleKind(const std::string &name, ScheduleKind &kind, std::string &error) {
  for (ScheduleKind k : {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved}) {
    if (name == scheduleName(k)) {
      kind = k;
      return true;
    }
  }
  error = "unknown pipeline schedule '" + name + "' (known: gpipe, 1f1b, interleaved)";
  return false;
}

const char *scheduleName(ScheduleKind kind) {
  switch (kind) {
  case ScheduleKind::GPipe:
    return "gpipe";
  case ScheduleKind::OneFOneB:
    return "1f1b";
  case ScheduleKind::Interleaved:
    return "interleaved";
  }
  return "unknown";
}

int Schedule::maxInFlight(int rank) const {
  int inFlight = 0, peak = 0;
  for (const Instr &in : ranks[rank]) {
    inFlight += in.kind == Instr::Forward ? 1 : -1;
    peak = std::max(peak, inFlight);
  }
  return peak;
}

bool buildSchedule(ScheduleKind kind, int p, int m, int v, Schedule &out, std::string &error) {
  if (p < 1 || m < 1 || v < 1) {
    error = "pipeline schedule needs pp, num_micro_batches and virtual_stages of at least 1 (pp=" +
            std::to_string(p) + ", m=" + std::to_string(m) + ", v=" + std::to_string(v) + ")";
    return false;
  }
  if (v != 1 && kind != ScheduleKind::Interleaved) {
    error = "virtual_stages applies to the interleaved schedule only (schedule " +
            std::string(scheduleName(kind)) + ", virtual_stages " + std::to_string(v) + ")";
    return false;
  }
  if (kind == ScheduleKind::Interleaved && m % p != 0) {
    error = "interleaved needs num_micro_batches (m=" + std::to_string(m) +
            ") to be a multiple of pp (" + std::to_string(p) + ")";
    return false;
  }
  Schedule s;
  s.kind = kind;
  s.p = p;
  s.m = m;
  s.v = v;
  for (int r = 0; r < p; ++r) {
    std::vector<Instr> list;
    // With one chunk the interleaved warm-up's extra round trip buys nothing
    // and only holds more activations, so it runs the plain 1F1B lists.
    if (kind == ScheduleKind::GPipe)
      list = gpipeRank(m);
    else if (kind == ScheduleKind::OneFOneB || v == 1)
      list = oneFOneBRank(p, m, r);
    else
      list = interleavedRank(p, m, v, r);
    s.slots.push_back(assignSlots(list, m, v));
    s.ranks.push_back(std::move(list));
  }
  out = std::move(s);
  return true;
}

} // namespace carve::pipeline
