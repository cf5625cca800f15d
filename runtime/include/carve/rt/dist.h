//===- dist.h - layouts of tensors split over a mesh axis -----------------===//
//
// Tensor parallelism splits one dimension of a tensor over the ranks of a
// mesh axis (a `Communicator`). `Split` names the layout; `takeShard` and
// `placeShard` move one rank's piece out of and into a full tensor, and the
// collectives below change layouts: all-gather (split -> full),
// reduce-scatter (partial full values -> reduced split), all-to-all (split on
// one dimension -> split on another). Shapes are `Dims` (kernels.h),
// row-major and contiguous; element types are opaque bytes.
//
// The collectives use thread-local scratch buffers (grown as needed, never
// shrunk) and block until done. They need only the `Communicator` interface,
// not MPI, so they live in carve_rt_kernels beside the kernels.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_DIST_H
#define CARVE_RT_DIST_H

#include "carve/rt/comm.h"
#include "carve/rt/kernels.h"

#include <cstdint>

namespace carve::rt {

/// A split of tensor dimension `dim` over `parts` ranks: the full dimension,
/// seen as [groups, parts * chunk], is cut into `parts` contiguous pieces
/// inside every group (groups = 1: a plain split; groups = 3: e.g. a fused
/// QKV projection split per section). Rank i holds piece i of every group,
/// so its local dimension is full / parts.
///
/// Example: full dimension 12, groups 3, parts 2 (chunk 2): rank 0 holds full
/// indices {0,1, 4,5, 8,9}, rank 1 holds {2,3, 6,7, 10,11}.
struct Split {
  int dim;
  int64_t groups;
  int parts;
};

/// How a split lays out rows: the full tensor is outer * groups * parts rows
/// of rowBytes bytes, row (o * groups + g) * parts + p belonging to piece p;
/// a piece is its outer * groups rows, one after another. Fatal, naming `op`,
/// when `s` does not split `full` evenly. (Shared by the CPU and CUDA shard
/// copies.)
struct SplitRows {
  int64_t outer = 1;    // product of the dimensions before s.dim
  int64_t groups = 1;   // s.groups
  int64_t parts = 1;    // s.parts
  int64_t rowBytes = 0; // one contiguous copy
};
SplitRows splitRows(const char *op, const Dims &full, Split s, int elemBytes);
/// Fatal, naming `op`, unless `s` is a split of some dimension of `shape`.
void checkSplit(const char *op, const Dims &shape, Split s);
/// Fatal unless 0 <= index < s.parts.
void checkSplitIndex(const char *op, Split s, int index);
/// Fatal unless the split has one part per rank of `c`.
void checkSplitParts(const char *op, const Communicator &c, Split s);

/// The local shape of piece `s` of a tensor of shape `full`: full[dim] / parts.
/// Fatal error unless full[dim] is a multiple of groups * parts.
Dims shardShape(Dims full, Split s);
/// The full shape of a tensor whose pieces have shape `local`: local[dim] * parts.
/// Fatal error unless local[dim] is a multiple of groups.
Dims fullShape(Dims local, Split s);

/// Copies piece `index` of the tensor `full` (shape fullShape) to `local`
/// (shape shardShape(fullShape, s)).
void takeShard(const void *full, Dims fullShape, Split s, int index, void *local, int elemBytes);
/// Copies `local` (shape localShape) into piece `index` of `full` (shape
/// fullShape(localShape, s)); the other pieces of `full` are left as they are.
void placeShard(const void *local, Dims localShape, Split s, int index, void *full, int elemBytes);

/// `full` = the tensor whose piece c.rank() is `local` on every rank of c.
/// s.parts must be c.size().
void allGatherSplit(Communicator &c, const void *local, Dims localShape, Split s, void *full,
                    CommType t);
/// `full` is this rank's partial value of the whole tensor (shape fullShape);
/// `local` gets piece c.rank() of the reduction of `full` over the ranks of c.
/// s.parts must be c.size().
void reduceScatterSplit(Communicator &c, const void *full, Dims fullShape, Split s, void *local,
                        CommType t, ReduceOp op);
/// `in` (shape inLocalShape) is piece c.rank() of a tensor split as `from`;
/// `out` gets piece c.rank() of the same tensor split as `to`, of shape
/// shardShape(fullShape(inLocalShape, from), to). to.dim != from.dim, and
/// from.parts = to.parts = c.size().
void allToAllSplit(Communicator &c, const void *in, Dims inLocalShape, Split from, Split to,
                   void *out, CommType t);

//===--- Vocab-parallel kernels (float, double) ---------------------------===//
//
// A table (embedding) or a logits tensor split by rows / vocabulary over the
// tensor-parallel ranks: rank i holds global rows [rowOffset, rowOffset + Vl).
// The results equal the serial kernels of kernels.h on the concatenated
// table or logits.

/// gather(table, idx, axis 0) for a table whose local rows [Vl, ...] are
/// global rows [rowOffset, rowOffset + Vl) of a table of globalRows rows: y
/// rows of ids outside the local range are zero, so the sum of y over the
/// ranks is the full lookup. Negative ids count from globalRows; ids outside
/// [-globalRows, globalRows) are a fatal error on every rank.
template <class T>
void gather_sharded(const T *table, Dims ts, int64_t rowOffset, int64_t globalRows,
                    const int64_t *idx, Dims is, T *y);
/// dtable = zeros(ts) with the rows of dy whose ids fall in this rank's range
/// added in (the gradient of gather_sharded). Ids as in gather_sharded.
template <class T>
void gather_sharded_grad(const T *dy, const int64_t *idx, Dims is, int64_t rowOffset,
                         int64_t globalRows, T *dtable, Dims ts);

/// cross_entropy (kernels.h) of logits [N, V, d...] split over the ranks of
/// c by class: this rank holds classes [vocabOffset, vocabOffset + Vl) as
/// local logits [N, Vl, d...]; targets [N, d...] are the same on every rank.
/// One all-reduce(max) of the class maxima and one all-reduce(sum) of the
/// sums of exponentials and of the target logits (from the rank that holds
/// each): no rank materializes the full logits. V is the sum of Vl over c;
/// y (equal on every rank) is the serial kernel's on the concatenated logits.
template <class T>
void cross_entropy_vocab_parallel(Communicator &c, const T *logits, Dims ls, int64_t vocabOffset,
                                  const int64_t *targets, int reduction, bool hasIgnore,
                                  int64_t ignoreIndex, T *y);
/// This rank's part [N, Vl, d...] of cross_entropy_grad on the concatenated
/// logits, given dy (a scalar for mean/sum, targets' shape for none).
template <class T>
void cross_entropy_vocab_parallel_grad(Communicator &c, const T *logits, Dims ls,
                                       int64_t vocabOffset, const int64_t *targets, int reduction,
                                       bool hasIgnore, int64_t ignoreIndex, const T *dy,
                                       T *dlogits);

/// Evaluation's accuracy (train --eval-data) after a cross_entropy of logits
/// [N, C, d...] against targets [N, d...]: adds to counts[0] the elements
/// whose target's logit is the largest of its row (a tie counts as correct;
/// PyTorch's argmax takes the first of equal values) and to counts[1] the
/// elements counted (not ignore_index). With `c`, the classes are split over
/// its ranks as in cross_entropy_vocab_parallel (this rank holds [vocabOffset,
/// vocabOffset + C)) and one all-reduce(max) of the row maxima and target
/// logits makes the counts equal on every rank; null: all classes are here.
template <class T>
void count_correct(Communicator *c, const T *logits, Dims ls, int64_t vocabOffset,
                   const int64_t *targets, bool hasIgnore, int64_t ignoreIndex, double *counts);

} // namespace carve::rt

#endif // CARVE_RT_DIST_H
