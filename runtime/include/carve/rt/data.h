//===- data.h - deterministic training data for each rank -----------------===//
//
// Which sample a rank sees at which step is a pure function of the step, the
// global batch B, the rank's place in the data-parallel group and the data
// options, so a run on any number of ranks under any plan (and a PyTorch
// script replaying the same formula) sees exactly the same global batches,
// and a run resumed from a checkpoint of step k goes on exactly where the
// unbroken run would (mid-epoch included). docs/data.md is the user's guide.
//
// --data is one or more files, comma-separated, each a path or a glob
// (sorted); they are read as one data set in that order.
//
// DataKind::Tokens: flat little-endian files of token ids (int32 or uint16),
// read as one stream of N tokens. Two ways to cut it into sequences of T:
//
// - Wrapped (the default: no --shuffle, no document boundaries): global
//   sequence j (0 <= j < B) of step k starts at o = ((k*B + j) * T) mod
//   (N - T - 1); inputs = tokens[o, o+T), targets = tokens[o+1, o+T+1).
// - Windows (--shuffle SEED, --doc-eot ID or --doc-offsets FILE, and every
//   evaluation set): the stream is cut into documents (each file is one,
//   unless --doc-eot ends a document after each end-of-text id, or
//   --doc-offsets lists their starts); a document of L tokens holds
//   floor((L-1)/T) windows of T+1 tokens starting at multiples of T, none
//   crossing a document's end (its last partial window, and documents shorter
//   than T+1, are left out). Windows are numbered in stream order, W of them.
//   An epoch is floor(W/B) steps; step k is in epoch e = k div floor(W/B),
//   and its global sequence j is window P_e((k mod floor(W/B)) * B + j),
//   where P_e is the identity, or with --shuffle SEED the permutation
//   shuffleIndex(., W, SEED, e) (a different one each epoch; the W mod B
//   windows P_e leaves at the end are not seen that epoch).
//
// DataKind::Tensors: safetensors files with one tensor per graph input, named
// after it, in one of two layouts:
// - sample-major: [N, ...sample] where [B, ...sample] is the input's global
//   shape: N samples, split into epochs and shuffled as windows are (one
//   sample per row; every file of the set holds the same inputs);
// - batch-major (one file only, never shuffled): [S, B, ...sample]: S
//   distinct global batches, step k uses batch k mod S.
//
// With data parallelism of degree D, dp rank r takes global rows
// [r*B/D, (r+1)*B/D) of each batch.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_DATA_H
#define CARVE_RT_DATA_H

#include "carve/rt/program.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace carve::rt {

/// Element type of a token file.
enum class TokenFileType : int { Int32 = 0, UInt16 = 1, Int64 = 2 };

/// How a run reads a data set (train --data and the flags beside it).
struct DataOptions {
  std::string paths;                              // comma-separated files or globs
  TokenFileType tokenType = TokenFileType::Int32; // token files' element type
  int64_t eotId = -1;                             // --doc-eot: a document ends after this id
  std::string docOffsets;                         // --doc-offsets: int64 document starts
  bool shuffle = false;                           // --shuffle SEED
  uint64_t seed = 0;
  bool checkWhole = false;     // check every token id now, whatever the files' size
  bool windows = false;        // cut tokens into windows even without the flags (evaluation)
  std::string flag = "--data"; // the flag that named the files, for messages
};

/// Start (in tokens) of global sequence `j` of step `step` in a stream of
/// `numTokens` tokens (the wrapped cut); requires numTokens >= seqLen + 2.
int64_t tokenOffset(int64_t step, int64_t j, int64_t globalBatch, int64_t seqLen,
                    int64_t numTokens);

/// Position `i` of epoch `epoch`'s shuffled order of `n` items: a bijection
/// of [0, n) for each (seed, epoch), computed in O(1) memory (a 6-round
/// Feistel network on the smallest even number of bits that holds n, walked
/// until it lands inside [0, n)). docs/data.md gives it in Python.
uint64_t shuffleIndex(uint64_t i, uint64_t n, uint64_t seed, uint64_t epoch);

/// The files `spec` names: comma-separated paths or globs, each glob's
/// matches sorted. False with `error` naming `flag` and the pattern that
/// matched nothing.
bool expandDataPaths(const std::string &spec, const std::string &flag,
                     std::vector<std::string> &files, std::string &error);

/// One rank's view of a data set.
class DataLoader {
public:
  virtual ~DataLoader() = default;
  /// Writes this rank's slice of step `step` into every input's place in
  /// `arena` (TensorSpec::offset). Fails only on an I/O error or a bad id
  /// found while reading, with `error` naming the file and the cause.
  virtual bool load(int64_t step, char *arena, std::string &error) = 0;
  /// One line for the log, e.g. "tokens.bin: 1000000 int32 tokens".
  virtual std::string describe() const = 0;
  /// Steps in one epoch; 0 where the data wraps instead (tokens without
  /// windows).
  virtual int64_t stepsPerEpoch() const = 0;
  /// Where global row `row` of step `step` is read from, e.g. "a.bin token
  /// 4096" or "train.safetensors sample 17".
  virtual std::string source(int64_t step, int64_t row) const = 0;
};

/// Opens and validates the data of `program` for dp rank `dpRank` (of
/// program.dp): the files exist and have the layout above, every input is
/// there with the right dtype and shape, the set holds at least one global
/// batch. On failure returns null with `error` naming the file (and tensor)
/// and the cause. Token ids are checked against Program::vocab, and the
/// tensors of a classifier's targets against their TensorSpec::classes: all of
/// them now when the files hold at most 1 GiB (a classifier's: its targets),
/// or with `checkWhole`, or when document boundaries are read anyway; else
/// each batch as it is read.
std::unique_ptr<DataLoader> openDataLoader(const Program &program, int dpRank,
                                           const DataOptions &options, std::string &error);

/// The same for one file (or spec) with default options.
inline std::unique_ptr<DataLoader> openDataLoader(const Program &program, int dpRank,
                                                  const std::string &paths, TokenFileType tokenType,
                                                  std::string &error) {
  DataOptions o;
  o.paths = paths;
  o.tokenType = tokenType;
  return openDataLoader(program, dpRank, o, error);
}

} // namespace carve::rt

#endif // CARVE_RT_DATA_H
