//===- mesh.h - a rank's place on the pp x dp x tp mesh -------------------===//
//
// Ranks form a pp x dp x tp mesh with the pipeline axis outermost, then data
// parallelism, then tensor parallelism:
//
//   world rank = (ppRank * dp + dpRank) * tp + tpRank
//
// Every conversion between a world rank and its places on the axes is here.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_MESH_H
#define CARVE_RT_MESH_H

namespace carve::rt {

/// A rank's place on the pp x dp x tp mesh: the degrees of the three axes and
/// the rank's index on each.
struct Mesh {
  int dp = 1, tp = 1, pp = 1;
  int dpRank = 0, tpRank = 0, ppRank = 0;

  /// World rank `rank`'s place on the mesh of degrees `dp`, `tp` and `pp`.
  static Mesh ofRank(int rank, int dp, int tp, int pp) {
    Mesh m;
    m.dp = dp, m.tp = tp, m.pp = pp;
    m.ppRank = rank / (dp * tp);
    m.dpRank = rank / tp % dp;
    m.tpRank = rank % tp;
    return m;
  }

  /// The world rank at pipeline rank `ppIndex`, dp rank `dpIndex` and tp rank
  /// `tpIndex` of this mesh.
  int rankAt(int ppIndex, int dpIndex, int tpIndex) const {
    return (ppIndex * dp + dpIndex) * tp + tpIndex;
  }

  /// This rank's world rank.
  int worldRank() const { return rankAt(ppRank, dpRank, tpRank); }

  /// Which group of each axis this rank is in: the groups of an axis are the
  /// ranks that differ only in that axis, numbered by the other two places.
  int tpGroupIndex() const { return ppRank * dp + dpRank; }
  /// Expert parallelism over groups of `ep` consecutive dp ranks: this rank's
  /// place in its group, the group (of the ranks that differ only in
  /// epRank), and the group of the ranks that hold the same experts (differ
  /// only in dpRank / ep).
  int epRank(int ep) const { return dpRank % ep; }
  int epGroupIndex(int ep) const { return (ppRank * tp + tpRank) * (dp / ep) + dpRank / ep; }
  int edpGroupIndex(int ep) const { return (ppRank * tp + tpRank) * ep + dpRank % ep; }
  int dpGroupIndex() const { return ppRank * tp + tpRank; }
  int ppGroupIndex() const { return dpRank * tp + tpRank; }
};

} // namespace carve::rt

#endif // CARVE_RT_MESH_H
