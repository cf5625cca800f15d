//===- philox.h - the counter-based generator (Philox-4x32-10) ------------===//
//
// Philox-4x32 with 10 rounds (Salmon et al., "Parallel random numbers: as
// easy as 1, 2, 3", SC 2011), the generator cuRAND and JAX use: four 32-bit
// output words are a pure function of a 128-bit counter and a 64-bit key, so
// any element of a random tensor can be drawn on its own, on any rank, in any
// order, on the host or the device (the same header compiles in both).
//
// This is the foundation of plan-independent dropout (docs/training.md,
// "Dropout"): a mask element is a function of (seed, step, the dropout node,
// the element's index in the full, unsplit tensor) only, with the key the
// seed and the counter (index / 4, node, step); `dropoutKeep` draws it, and
// `DropoutPiece` says where an element of one rank's piece lies in the full
// tensor, so every plan draws the 1-rank program's masks.
//
// Checked against Random123's known-answer vectors (runtime/tests/PhiloxTest.cpp).
//
//===----------------------------------------------------------------------===//
#ifndef CARVE_RT_PHILOX_H
#define CARVE_RT_PHILOX_H

#include "carve/rt/elementwise.h" // CARVE_HD

#include <cstdint>

namespace carve::rt::philox {

struct Words4 {
  uint32_t w[4];
};

/// The high and low 32 bits of a * b.
CARVE_HD void mulHiLo(uint32_t a, uint32_t b, uint32_t &hi, uint32_t &lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

/// Philox-4x32-10 of `counter` under `key` (Random123's philox4x32_10).
CARVE_HD Words4 philox4x32_10(Words4 counter, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t c0 = counter.w[0], c1 = counter.w[1], c2 = counter.w[2], c3 = counter.w[3];
  uint32_t k0 = key0, k1 = key1;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kWeyl0;
      k1 += kWeyl1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulHiLo(kMul0, c0, hi0, lo0);
    mulHiLo(kMul1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
  }
  return Words4{{c0, c1, c2, c3}};
}

/// A word as a float in [0, 1): its top 24 bits times 2^-24 (every value
/// exact in float).
CARVE_HD float uniform01(uint32_t word) {
  return static_cast<float>(word >> 8) * (1.0f / 16777216.0f);
}

/// Whether dropout with probability `p` keeps element `index` of the full
/// tensor of dropout node `node` at optimizer step `step` under `seed`: the
/// word `index % 4` of Philox(counter = (index / 4 low, high, node, step),
/// key = seed) as a uniform number in [0, 1), kept when it is >= p (so the
/// keep probability is 1 - p to within 2^-24).
CARVE_HD bool dropoutKeep(uint64_t seed, uint32_t step, uint32_t node, uint64_t index, float p) {
  const uint64_t block = index >> 2;
  const Words4 r = philox4x32_10(
      Words4{{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), node, step}},
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return uniform01(r.w[index & 3]) >= p;
}

/// Where one rank's piece of a tensor lies in the full tensor whose mask
/// dropout draws: the 1-rank program's tensor, with the whole batch and no
/// tensor-parallel split. The piece (`dims`, the shape the rank computes) is
/// the full tensor
///  - split over tp along `tpDim` (dist.h's Split{tpDim, tpGroups, tpParts},
///    piece `tpRank`; -1: not split), of
///  - this rank's share of the batch: dimension `batchDim` (-1: none) is
///    batchOuter x localBatch x inner of the full batchOuter x globalBatch x
///    inner, the local samples being samples [batchOffset, + localBatch) of
///    the global batch (data-parallel rank and micro-batch).
struct DropoutPiece {
  Dims dims;
  int tpDim = -1;
  int64_t tpGroups = 1;
  int tpParts = 1, tpRank = 0;
  int batchDim = -1;
  int64_t batchOuter = 1, localBatch = 1, globalBatch = 1, batchOffset = 0;
};

/// Coordinate `c` of the piece along dimension `d` as a coordinate of the
/// full tensor, whose extent along `d` it stores in `full`.
CARVE_HD int64_t fullCoordinate(const DropoutPiece &p, int d, int64_t c, int64_t &full) {
  int64_t size = p.dims.d[d];
  if (d == p.tpDim) {
    const int64_t chunk = size / p.tpGroups;
    c = c / chunk * chunk * p.tpParts + (int64_t)p.tpRank * chunk + c % chunk;
    size *= p.tpParts;
  }
  if (d == p.batchDim) {
    const int64_t inner = size / (p.batchOuter * p.localBatch);
    const int64_t o = c / (p.localBatch * inner), s = c / inner % p.localBatch, i = c % inner;
    c = (o * p.globalBatch + p.batchOffset + s) * inner + i;
    size = p.batchOuter * p.globalBatch * inner;
  }
  full = size;
  return c;
}

/// The full tensor's row-major index of the piece's element `local`.
CARVE_HD uint64_t fullIndex(const DropoutPiece &p, int64_t local) {
  uint64_t index = 0, stride = 1;
  for (int d = p.dims.rank - 1; d >= 0; --d) {
    const int64_t c = local % p.dims.d[d];
    local /= p.dims.d[d];
    int64_t full;
    const int64_t g = fullCoordinate(p, d, c, full);
    index += (uint64_t)g * stride;
    stride *= (uint64_t)full;
  }
  return index;
}

/// PyTorch's scale of kept elements, 1 / (1 - p) rounded to float (ATen
/// divides the float mask by 1 - p).
CARVE_HD float dropoutScale(double p) { return 1.0f / (float)(1.0 - p); }

} // namespace carve::rt::philox

#endif // CARVE_RT_PHILOX_H
