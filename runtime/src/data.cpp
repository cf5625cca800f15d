//===- data.cpp - deterministic training data for each rank ---------------===//
//
// The formulas are in carve/rt/data.h; docs/data.md is the user's guide.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/data.h"

#include "carve/rt/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

namespace carve::rt {

namespace {

std::vector<int64_t> specShape(const TensorSpec &s) {
  return std::vector<int64_t>(s.dims, s.dims + s.rank);
}

/// The batch split every loader relies on; a failure here is a compiler bug,
/// so the message names the program rather than the data.
bool checkBatch(const Program &p, int dpRank, std::string &error) {
  std::string where = std::string("program '") + p.name + "': ";
  if (p.dp < 1 || dpRank < 0 || dpRank >= p.dp) {
    error = where + "dp rank " + std::to_string(dpRank) + " outside a dp group of " +
            std::to_string(p.dp);
    return false;
  }
  if (p.localBatch < 1 || p.localBatch * p.dp != p.globalBatch) {
    error = where + "global batch " + std::to_string(p.globalBatch) + " is not local batch " +
            std::to_string(p.localBatch) + " times dp " + std::to_string(p.dp);
    return false;
  }
  for (int i = 0; i < p.numInputs; ++i) {
    const TensorSpec &in = p.inputs[i];
    if (in.rank < 1 || in.dims[0] != p.localBatch) {
      error = where + "input '" + in.name + "' has local shape " + formatShape(specShape(in)) +
              ", whose first dimension should be the local batch " + std::to_string(p.localBatch);
      return false;
    }
  }
  return true;
}

/// pread of exactly `bytes` bytes; errors name the cause only.
bool preadAll(int fd, void *dst, int64_t bytes, int64_t offset, std::string &cause) {
  char *p = static_cast<char *>(dst);
  while (bytes > 0) {
    ssize_t got = ::pread(fd, p, static_cast<size_t>(std::min<int64_t>(bytes, 1 << 30)), offset);
    if (got < 0 && errno == EINTR)
      continue;
    if (got <= 0) {
      cause = got < 0 ? std::string("read failed: ") + std::strerror(errno)
                      : "unexpected end of file (was it truncated while in use?)";
      return false;
    }
    p += got;
    bytes -= got;
    offset += got;
  }
  return true;
}

/// splitmix64's finalizer: a bijective mix of 64 bits.
uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// "a, b and c" for messages (the first few, then a count).
std::string listFiles(const std::vector<std::string> &files) {
  std::string s;
  for (size_t i = 0; i < files.size() && i < 3; ++i)
    s += (i ? ", " : "") + files[i];
  if (files.size() > 3)
    s += " and " + std::to_string(files.size() - 3) + " more";
  return s;
}

/// The epoch order shared by every loader: global row `row` of step `step`
/// reads item P_e(position) of `items` (data.h).
struct EpochOrder {
  int64_t items = 0, globalBatch = 1, steps = 0; // steps: per epoch
  bool shuffle = false;
  uint64_t seed = 0;

  int64_t itemOf(int64_t step, int64_t row) const {
    const int64_t epoch = step / steps;
    const int64_t pos = (step % steps) * globalBatch + row;
    return shuffle ? static_cast<int64_t>(shuffleIndex(static_cast<uint64_t>(pos),
                                                       static_cast<uint64_t>(items), seed,
                                                       static_cast<uint64_t>(epoch)))
                   : pos;
  }
  std::string describe(const char *what) const {
    return std::to_string(items) + " " + what + ", " + std::to_string(steps) + " step" +
           (steps == 1 ? "" : "s") + " per epoch" +
           (shuffle ? ", shuffled with seed " + std::to_string(seed) : ", in order");
  }
};

/// DataKind::Tokens: the files as one stream, read with one pread per
/// sequence (two where a sequence crosses a file's end in the wrapped cut).
class TokenLoader : public DataLoader {
public:
  ~TokenLoader() override {
    for (File &f : files)
      if (f.fd >= 0)
        ::close(f.fd);
  }

  bool open(const Program &p, int dpRank, const DataOptions &o, std::string &error);

  bool load(int64_t step, char *arena, std::string &error) override {
    auto *ids = reinterpret_cast<int64_t *>(arena + idsOffset);
    auto *targets = reinterpret_cast<int64_t *>(arena + targetsOffset);
    for (int64_t i = 0; i < localBatch; ++i) {
      const int64_t o = startOf(step, firstRow + i);
      std::string cause;
      if (!read(o, seqLen + 1, scratch.data(), cause)) {
        error = cause + " (step " + std::to_string(step + 1) + ")";
        return false;
      }
      int64_t *row = ids + i * seqLen;
      int64_t *next = targets + i * seqLen;
      const unsigned char *b = scratch.data();
      for (int64_t t = 0; t <= seqLen; ++t) {
        const int64_t tok = decode(b, t);
        if (vocab > 0 && (tok < 0 || tok >= vocab)) {
          error = position(o + t) + " is " + std::to_string(tok) +
                  ", outside the model's vocabulary of " + std::to_string(vocab) + " (step " +
                  std::to_string(step + 1) + ", sequence " + std::to_string(firstRow + i) + ")";
          return false;
        }
        if (t < seqLen)
          row[t] = tok;
        if (t > 0)
          next[t - 1] = tok;
      }
    }
    return true;
  }

  std::string describe() const override {
    std::string s =
        listFiles(paths) + ": " + std::to_string(numTokens) + " " + typeName() + " tokens";
    if (!windowed)
      return s;
    s += "; " + std::to_string(documents) + " document" + (documents == 1 ? "" : "s") + " (" +
         boundaries + "), " +
         order.describe(("windows of " + std::to_string(seqLen + 1) + " tokens").c_str());
    if (shortDocuments > 0)
      s += "; " + std::to_string(shortDocuments) + " document" + (shortDocuments == 1 ? "" : "s") +
           " shorter than " + std::to_string(seqLen + 1) + " tokens left out";
    return s;
  }

  int64_t stepsPerEpoch() const override { return windowed ? order.steps : 0; }

  std::string source(int64_t step, int64_t row) const override {
    const int64_t at = startOf(step, row);
    const File &f = files[fileOf(at)];
    return f.path + " token " + std::to_string(at - f.begin);
  }

private:
  struct File {
    std::string path;
    int fd = -1;
    int64_t begin = 0, count = 0; // tokens [begin, begin + count) of the stream
  };
  struct Segment {
    int64_t start, firstWindow; // stream offset, index of its first window
  };

  const char *typeName() const { return widthName(tokenType); }
  static const char *widthName(TokenFileType t) {
    return t == TokenFileType::UInt16 ? "uint16" : t == TokenFileType::Int64 ? "int64" : "int32";
  }

  /// Token k of `b` in the files' type.
  int64_t decode(const unsigned char *b, int64_t k) const {
    if (tokenType == TokenFileType::UInt16)
      return static_cast<uint16_t>(b[2 * k] | b[2 * k + 1] << 8);
    if (tokenType == TokenFileType::Int64) {
      uint64_t u = 0;
      for (int j = 7; j >= 0; --j)
        u = u << 8 | b[8 * k + j];
      return static_cast<int64_t>(u);
    }
    uint32_t u = uint32_t(b[4 * k]) | uint32_t(b[4 * k + 1]) << 8 | uint32_t(b[4 * k + 2]) << 16 |
                 uint32_t(b[4 * k + 3]) << 24;
    return static_cast<int32_t>(u);
  }

  /// The file holding stream token `at`.
  size_t fileOf(int64_t at) const {
    size_t f = std::upper_bound(files.begin(), files.end(), at,
                                [](int64_t a, const File &x) { return a < x.begin; }) -
               files.begin();
    return f == 0 ? 0 : f - 1;
  }

  /// "FILE: token K (0-based, in the file)" of stream token `at`.
  std::string position(int64_t at) const {
    const File &f = files[fileOf(at)];
    return "token file " + f.path + ": token " + std::to_string(at - f.begin) +
           " (0-based, in the file)";
  }

  /// Stream offset where global sequence `row` of step `step` starts.
  int64_t startOf(int64_t step, int64_t row) const {
    if (!windowed)
      return tokenOffset(step, row, globalBatch, seqLen, numTokens);
    const int64_t w = order.itemOf(step, row);
    auto s = std::upper_bound(segments.begin(), segments.end(), w,
                              [](int64_t x, const Segment &g) { return x < g.firstWindow; }) -
             1;
    return s->start + (w - s->firstWindow) * seqLen;
  }

  /// Reads `n` tokens of the stream from `at` into `dst`, across files.
  bool read(int64_t at, int64_t n, unsigned char *dst, std::string &cause) const {
    while (n > 0) {
      const File &f = files[fileOf(at)];
      const int64_t here = std::min(n, f.begin + f.count - at);
      std::string why;
      if (!preadAll(f.fd, dst, here * elemSize, (at - f.begin) * elemSize, why)) {
        cause = "token file " + f.path + ": " + why;
        return false;
      }
      dst += here * elemSize;
      at += here;
      n -= here;
    }
    return true;
  }

  /// Every token once: ids against the vocabulary (`checkIds`) and, with
  /// --doc-eot (`eot` >= 0), the documents' starts after each end.
  bool scan(bool checkIds, int64_t eot, std::vector<int64_t> &starts, std::string &error);
  /// Refuses a safetensors file given as tokens.
  bool checkFormat(const File &f, int64_t bytes, std::string &error);
  /// Refuses a file whose first tokens are ids of a wider type read two
  /// halves at a time (every second token 0).
  bool checkWidth(const File &f, int64_t count, std::string &error);
  /// The windows of the documents [starts[i], starts[i+1]).
  void cutWindows(std::vector<int64_t> &starts);

  std::vector<File> files;
  std::vector<std::string> paths;
  TokenFileType tokenType = TokenFileType::Int32;
  int elemSize = 4;
  int64_t numTokens = 0, vocab = 0;
  int64_t globalBatch = 0, localBatch = 0, seqLen = 0, firstRow = 0;
  int64_t idsOffset = 0, targetsOffset = 0;
  bool windowed = false;
  std::vector<Segment> segments;
  int64_t documents = 0, shortDocuments = 0;
  std::string boundaries;
  EpochOrder order;
  std::vector<unsigned char> scratch;
};

bool TokenLoader::open(const Program &p, int dpRank, const DataOptions &o, std::string &error) {
  tokenType = o.tokenType;
  elemSize = tokenType == TokenFileType::UInt16 ? 2 : tokenType == TokenFileType::Int64 ? 8 : 4;
  globalBatch = p.globalBatch;
  localBatch = p.localBatch;
  seqLen = p.seqLen;
  firstRow = dpRank * p.localBatch;
  vocab = p.vocab;
  std::string where = std::string("program '") + p.name + "': ";
  if (p.numInputs != 2) {
    error = where + "token data needs exactly two inputs (token ids, targets), it has " +
            std::to_string(p.numInputs);
    return false;
  }
  for (int i = 0; i < 2; ++i) {
    const TensorSpec &in = p.inputs[i];
    if (in.dtype != DType::I64 || in.rank != 2 || in.dims[0] != p.localBatch ||
        in.dims[1] != p.seqLen || p.seqLen < 1) {
      error = where + "token input '" + in.name + "' must be I64 [" + std::to_string(p.localBatch) +
              ", " + std::to_string(p.seqLen) + "], it is " + dtypeName(in.dtype) + " " +
              formatShape(specShape(in));
      return false;
    }
  }
  idsOffset = p.inputs[0].offset;
  targetsOffset = p.inputs[1].offset;
  if (!expandDataPaths(o.paths, o.flag, paths, error))
    return false;

  int64_t totalBytes = 0;
  for (const std::string &path : paths) {
    File f;
    f.path = path;
    f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (f.fd < 0) {
      error = "token file " + path + ": cannot open: " + std::strerror(errno);
      return false;
    }
    files.push_back(f);
    struct stat st;
    if (::fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      error = "token file " + path + ": not a regular file";
      return false;
    }
    const int64_t bytes = st.st_size;
    if (bytes == 0) {
      error = "token file " + path + ": empty file";
      return false;
    }
    if (!checkFormat(files.back(), bytes, error))
      return false;
    if (bytes % elemSize != 0) {
      error =
          "token file " + path + ": " + std::to_string(bytes) + " bytes is not a whole number of " +
          typeName() + " tokens (" + std::to_string(elemSize) + " bytes each)" +
          (tokenType == TokenFileType::Int32 ? "; for uint16 tokens pass --data-dtype uint16" : "");
      return false;
    }
    if (!checkWidth(files.back(), bytes / elemSize, error))
      return false;
    files.back().begin = numTokens;
    files.back().count = bytes / elemSize;
    numTokens += bytes / elemSize;
    totalBytes += bytes;
  }
  const std::string named =
      paths.size() == 1 ? "token file " + paths[0] : "token files " + listFiles(paths);
  scratch.resize(static_cast<size_t>((seqLen + 1) * elemSize));
  windowed = o.windows || o.shuffle || o.eotId >= 0 || !o.docOffsets.empty();
  if (o.eotId >= 0 && !o.docOffsets.empty()) {
    error = "--doc-eot and --doc-offsets both mark documents: give one of them";
    return false;
  }
  if (!windowed && numTokens < seqLen + 2) {
    error = named + ": " + std::to_string(numTokens) + " " + typeName() +
            " tokens is too short for sequence length " + std::to_string(seqLen) +
            " (needs at least " + std::to_string(seqLen + 2) + " tokens)";
    return false;
  }
  // Every id must index the embedding: files up to 1 GiB are checked whole
  // now, before anything is written, and so are larger ones that are read
  // whole anyway (--doc-eot); else every batch is checked as it is read.
  const bool checkIds = vocab > 0 && (o.checkWhole || totalBytes <= (int64_t(1) << 30));
  std::vector<int64_t> starts;
  if (checkIds || o.eotId >= 0)
    if (!scan(vocab > 0, o.eotId, starts, error))
      return false;
  if (!windowed)
    return true;

  // Document starts: every file's, and --doc-eot's or --doc-offsets'.
  for (const File &f : files)
    starts.push_back(f.begin);
  boundaries = paths.size() == 1 ? "the file" : "one per file";
  if (o.eotId >= 0)
    boundaries = "ended by token " + std::to_string(o.eotId);
  if (!o.docOffsets.empty()) {
    boundaries = "starts from " + o.docOffsets;
    int fd = ::open(o.docOffsets.c_str(), O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || ::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      error = "document offsets file " + o.docOffsets +
              ": cannot open: " + (fd < 0 ? std::strerror(errno) : "not a regular file");
      if (fd >= 0)
        ::close(fd);
      return false;
    }
    if (st.st_size == 0 || st.st_size % 8 != 0) {
      ::close(fd);
      error = "document offsets file " + o.docOffsets + ": " + std::to_string(st.st_size) +
              " bytes is not a whole, non-zero number of int64 offsets (8 bytes each)";
      return false;
    }
    std::vector<int64_t> offs(static_cast<size_t>(st.st_size / 8));
    std::string cause;
    const bool ok = preadAll(fd, offs.data(), st.st_size, 0, cause);
    ::close(fd);
    if (!ok) {
      error = "document offsets file " + o.docOffsets + ": " + cause;
      return false;
    }
    for (size_t i = 0; i < offs.size(); ++i)
      if (offs[i] < 0 || offs[i] >= numTokens || (i > 0 && offs[i] <= offs[i - 1])) {
        error = "document offsets file " + o.docOffsets + ": offset " + std::to_string(i) +
                " (0-based) is " + std::to_string(offs[i]) +
                "; offsets must increase strictly and lie inside the " + std::to_string(numTokens) +
                " tokens of " + listFiles(paths);
        return false;
      }
    starts.insert(starts.end(), offs.begin(), offs.end());
  }
  cutWindows(starts);
  order.globalBatch = globalBatch;
  order.shuffle = o.shuffle;
  order.seed = o.seed;
  order.steps = order.items / globalBatch;
  if (order.steps < 1) {
    error = named + ": " + std::to_string(order.items) + " window" + (order.items == 1 ? "" : "s") +
            " of " + std::to_string(seqLen + 1) + " tokens (" + std::to_string(numTokens) +
            " tokens in " + std::to_string(documents) + " document" + (documents == 1 ? "" : "s") +
            ") is fewer than one global batch of " + std::to_string(globalBatch) + " sequences";
    return false;
  }
  return true;
}

bool TokenLoader::checkFormat(const File &f, int64_t bytes, std::string &error) {
  // A safetensors file: an 8-byte little-endian header size, then the JSON
  // header; read as tokens it would fail as an id out of range, or train.
  unsigned char head[9];
  std::string cause;
  if (bytes < 10 || !preadAll(f.fd, head, 9, 0, cause))
    return true;
  uint64_t n = 0;
  for (int j = 7; j >= 0; --j)
    n = n << 8 | head[j];
  if (head[8] != '{' || n < 2 || n > (uint64_t)bytes - 8)
    return true;
  error = "token file " + f.path +
          ": this is a safetensors file (tensor data), but the model reads flat token files: "
          "write the token ids as one flat little-endian array (docs/data.md)";
  return false;
}

bool TokenLoader::checkWidth(const File &f, int64_t count, std::string &error) {
  // Ids of a wider type read as two narrower tokens each: little-endian, the
  // high half of every non-negative id below 2^31 (2^16) is 0. np.array(ids)
  // .tofile() writes int64 by default, which would otherwise train silently
  // as ids interleaved with zeros. The first 4096 tokens decide.
  if (tokenType == TokenFileType::Int64 || count < 16)
    return true;
  const int64_t n = std::min<int64_t>(count, 4096) / 2 * 2;
  std::vector<unsigned char> head(static_cast<size_t>(n * elemSize));
  std::string cause;
  if (!preadAll(f.fd, head.data(), (int64_t)head.size(), 0, cause)) {
    error = "token file " + f.path + ": " + cause;
    return false;
  }
  bool highZero = true, lowNonZero = false;
  for (int64_t k = 0; k < n; k += 2) {
    highZero &= decode(head.data(), k + 1) == 0;
    lowNonZero |= decode(head.data(), k) != 0;
  }
  if (!highZero || !lowNonZero)
    return true;
  const TokenFileType wider =
      tokenType == TokenFileType::UInt16 ? TokenFileType::Int32 : TokenFileType::Int64;
  error = "token file " + f.path + ": every second " + typeName() +
          " token is 0, as when " + widthName(wider) + " ids are read as " + typeName() +
          (wider == TokenFileType::Int64 ? " (numpy's tofile() writes int64 unless the array is "
                                           "converted)"
                                         : "") +
          "; pass --data-dtype " + widthName(wider) + ", or write the file as " + typeName();
  return false;
}

bool TokenLoader::scan(bool checkIds, int64_t eot, std::vector<int64_t> &starts,
                       std::string &error) {
  std::vector<unsigned char> chunk(static_cast<size_t>(1) << 22);
  for (const File &f : files)
    for (int64_t at = 0; at < f.count;) {
      const int64_t n = std::min<int64_t>(f.count - at, (int64_t)chunk.size() / elemSize);
      std::string cause;
      if (!preadAll(f.fd, chunk.data(), n * elemSize, at * elemSize, cause)) {
        error = "token file " + f.path + ": " + cause;
        return false;
      }
      for (int64_t k = 0; k < n; ++k) {
        const int64_t tok = decode(chunk.data(), k);
        if (checkIds && vocab > 0 && (tok < 0 || tok >= vocab)) {
          error = "token file " + f.path + ": token " + std::to_string(at + k) +
                  " (0-based, in the file) is " + std::to_string(tok) +
                  ", outside the model's vocabulary of " + std::to_string(vocab) + " (ids 0 to " +
                  std::to_string(vocab - 1) + ")" +
                  (tokenType == TokenFileType::Int32 && tok > 65535
                       ? "; a file of uint16 tokens needs --data-dtype uint16"
                       : "");
          return false;
        }
        if (tok == eot && f.begin + at + k + 1 < numTokens)
          starts.push_back(f.begin + at + k + 1); // the next document starts after it
      }
      at += n;
    }
  return true;
}

void TokenLoader::cutWindows(std::vector<int64_t> &starts) {
  std::sort(starts.begin(), starts.end());
  starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
  starts.push_back(numTokens);
  int64_t windows = 0;
  for (size_t i = 0; i + 1 < starts.size(); ++i) {
    const int64_t length = starts[i + 1] - starts[i];
    ++documents;
    const int64_t w = (length - 1) / seqLen;
    if (w < 1) {
      ++shortDocuments;
      continue;
    }
    segments.push_back({starts[i], windows});
    windows += w;
  }
  order.items = windows;
}

/// DataKind::Tensors: safetensors files, sample-major (one pread per input
/// per sample) or batch-major (one pread per input per step).
class TensorLoader : public DataLoader {
public:
  bool open(const Program &p, int dpRank, const DataOptions &o, std::string &error);

  bool load(int64_t step, char *arena, std::string &error) override {
    if (batchMajor) {
      const Source &src = sources[0];
      for (size_t i = 0; i < slots.size(); ++i) {
        const int64_t index = step % src.items;
        const int64_t at = (index * globalBatch + firstRow) * slots[i].rowBytes;
        if (!src.reader->read(*src.tensors[i], at, localBatch * slots[i].rowBytes,
                              arena + slots[i].arenaOffset, error)) {
          error = "data file " + error;
          return false;
        }
      }
      return true;
    }
    for (int64_t r = 0; r < localBatch; ++r) {
      const int64_t item = order.itemOf(step, firstRow + r);
      const Source &src = sourceOf(item);
      const int64_t k = item - src.begin;
      for (size_t i = 0; i < slots.size(); ++i)
        if (!src.reader->read(*src.tensors[i], k * slots[i].rowBytes, slots[i].rowBytes,
                              arena + slots[i].arenaOffset + r * slots[i].rowBytes, error)) {
          error = "data file " + error;
          return false;
        }
      // Targets the start-up scan did not see (more than 1 GiB of them).
      if (!scanned)
        for (size_t i = 0; i < slots.size(); ++i)
          if (inputs[i]->classes > 0 &&
              !checkTargets(*inputs[i], arena + slots[i].arenaOffset + r * slots[i].rowBytes,
                            slots[i].rowBytes, src.reader->path(), k, error))
            return false;
    }
    return true;
  }

  std::string describe() const override {
    std::vector<std::string> names;
    for (const Source &s : sources)
      names.push_back(s.reader->path());
    if (batchMajor)
      return names[0] + ": " + std::to_string(slots.size()) + " input tensors, " +
             std::to_string(sources[0].items) + " steps (batch-major)";
    return listFiles(names) + ": " + std::to_string(slots.size()) + " input tensors, " +
           order.describe("samples");
  }

  int64_t stepsPerEpoch() const override { return batchMajor ? sources[0].items : order.steps; }

  std::string source(int64_t step, int64_t row) const override {
    if (batchMajor)
      return sources[0].reader->path() + " batch " + std::to_string(step % sources[0].items) +
             " row " + std::to_string(row);
    const int64_t item = order.itemOf(step, row);
    const Source &src = sourceOf(item);
    return src.reader->path() + " sample " + std::to_string(item - src.begin);
  }

private:
  struct Slot {
    int64_t arenaOffset;
    int64_t rowBytes; // one sample of the input
  };
  /// Checks `bytes` of input `in` (a classifier's targets), sample or batch
  /// `item` of `file`, against its classes.
  bool checkTargets(const TensorSpec &in, const char *data, int64_t bytes, const std::string &file,
                    int64_t item, std::string &error) const {
    const int64_t n = bytes / dtypeSize(in.dtype);
    for (int64_t e = 0; e < n; ++e) {
      const int64_t t = in.dtype == DType::I64 ? reinterpret_cast<const int64_t *>(data)[e]
                                               : reinterpret_cast<const int32_t *>(data)[e];
      if ((t >= 0 && t < in.classes) || (in.hasIgnore && t == in.ignoreIndex))
        continue;
      error = "data file " + file + ": tensor '" + in.name + "' " +
              (batchMajor ? "batch " : "sample ") + std::to_string(item) +
              (n > 1 ? ", element " + std::to_string(e) : std::string()) + ": target " +
              std::to_string(t) + " is outside the model's " + std::to_string(in.classes) +
              " classes (0 to " + std::to_string(in.classes - 1) +
              (in.hasIgnore ? ", or the ignore index " + std::to_string(in.ignoreIndex) : "") +
              ")";
      return false;
    }
    return true;
  }
  /// Every target of every file against its classes (the start-up scan).
  bool scanTargets(std::string &error) const {
    for (size_t i = 0; i < slots.size(); ++i) {
      if (inputs[i]->classes <= 0)
        continue;
      for (const Source &src : sources) {
        const int64_t row = slots[i].rowBytes * (batchMajor ? globalBatch : 1);
        const int64_t perRead = std::max<int64_t>(1, (int64_t(1) << 24) / std::max<int64_t>(1, row));
        std::vector<char> buf;
        for (int64_t k = 0; k < src.items; k += perRead) {
          const int64_t count = std::min(perRead, src.items - k);
          buf.resize(static_cast<size_t>(count * row));
          if (!src.reader->read(*src.tensors[i], k * row, count * row, buf.data(), error)) {
            error = "data file " + error;
            return false;
          }
          for (int64_t j = 0; j < count; ++j)
            if (!checkTargets(*inputs[i], buf.data() + j * row, row, src.reader->path(), k + j,
                              error))
              return false;
        }
      }
    }
    return true;
  }
  std::vector<const TensorSpec *> inputs; // per slot
  bool scanned = false;                   // every target checked at start-up
  struct Source {
    std::unique_ptr<SafetensorsReader> reader;
    std::vector<const SafetensorsTensor *> tensors; // per input
    int64_t begin = 0, items = 0;                   // samples [begin, begin + items) of the set
  };

  const Source &sourceOf(int64_t item) const {
    size_t f = std::upper_bound(sources.begin(), sources.end(), item,
                                [](int64_t a, const Source &s) { return a < s.begin; }) -
               sources.begin();
    return sources[f - 1];
  }

  std::vector<Source> sources;
  std::vector<Slot> slots;
  bool batchMajor = false;
  EpochOrder order;
  int64_t globalBatch = 0, localBatch = 0, firstRow = 0;
};

bool TensorLoader::open(const Program &p, int dpRank, const DataOptions &o, std::string &error) {
  globalBatch = p.globalBatch;
  localBatch = p.localBatch;
  firstRow = dpRank * p.localBatch;
  if (p.numInputs < 1) {
    error = std::string("program '") + p.name + "' has no inputs to read data for";
    return false;
  }
  if (o.eotId >= 0 || !o.docOffsets.empty()) {
    error = std::string(o.eotId >= 0 ? "--doc-eot" : "--doc-offsets") +
            " applies to token data; program '" + p.name + "' reads tensors";
    return false;
  }
  std::vector<std::string> paths;
  if (!expandDataPaths(o.paths, o.flag, paths, error))
    return false;
  for (int i = 0; i < p.numInputs; ++i) {
    const TensorSpec &in = p.inputs[i];
    slots.push_back({in.offset, in.numel / in.dims[0] * dtypeSize(in.dtype)});
    inputs.push_back(&in);
    if (in.classes > 0 && in.dtype != DType::I64 && in.dtype != DType::I32) {
      error = std::string("program '") + p.name + "': input '" + in.name +
              "' has classes but is not an integer tensor";
      return false;
    }
  }
  int64_t items = 0;
  for (const std::string &file : paths) {
    Source src;
    src.reader = std::make_unique<SafetensorsReader>();
    if (!src.reader->open(file, error)) {
      error = "data file " + error;
      return false;
    }
    for (int i = 0; i < p.numInputs; ++i) {
      const TensorSpec &in = p.inputs[i];
      const SafetensorsTensor *t = src.reader->find(in.name);
      if (!t) {
        std::string names;
        for (const SafetensorsTensor &e : src.reader->tensors())
          names += (names.empty() ? "" : ", ") + e.name;
        error = "data file " + file + ": no tensor '" + in.name +
                "' for the model input of that name (the file has: " +
                (names.empty() ? "no tensors" : names) + ")";
        return false;
      }
      if (t->dtype != dtypeName(in.dtype)) {
        error = "data file " + file + ": tensor '" + in.name + "' is " + t->dtype +
                ", the model input needs " + dtypeName(in.dtype);
        return false;
      }
      std::vector<int64_t> global = specShape(in);
      global[0] = p.globalBatch;
      const std::vector<int64_t> sample(global.begin() + 1, global.end());
      // The layout follows from the first tensor's rank: one more than the
      // input's is batch-major [S, B, ...], equal is sample-major [N, ...].
      if (sources.empty() && i == 0)
        batchMajor = t->shape.size() == global.size() + 1;
      const bool shapeOk = batchMajor
                               ? t->shape.size() == global.size() + 1 && t->shape[0] >= 1 &&
                                     std::equal(global.begin(), global.end(), t->shape.begin() + 1)
                               : t->shape.size() == global.size() && t->shape[0] >= 1 &&
                                     std::equal(sample.begin(), sample.end(), t->shape.begin() + 1);
      if (!shapeOk) {
        const std::string rest = formatShape(sample).substr(1);
        const std::string want = batchMajor ? "[S, " + formatShape(global).substr(1) +
                                                  " (batch-major: S batches of the input's "
                                                  "global shape " +
                                                  formatShape(global) + ")"
                                            : "[N" + (sample.empty() ? "]" : ", " + rest) +
                                                  " (sample-major: N samples of shape " +
                                                  formatShape(sample) + ")";
        error = "data file " + file + ": tensor '" + in.name + "' has shape " +
                formatShape(t->shape) + ", expected " + want;
        return false;
      }
      if (!src.tensors.empty() && t->shape[0] != src.tensors.front()->shape[0]) {
        error = "data file " + file + ": tensor '" + in.name + "' holds " +
                std::to_string(t->shape[0]) + (batchMajor ? " batches" : " samples") +
                ", tensor '" + src.tensors.front()->name + "' holds " +
                std::to_string(src.tensors.front()->shape[0]) + "; they must agree";
        return false;
      }
      src.tensors.push_back(t);
    }
    src.begin = items;
    src.items = src.tensors.front()->shape[0];
    items += src.items;
    sources.push_back(std::move(src));
  }
  if (batchMajor && (sources.size() > 1 || o.shuffle)) {
    error = "data file " + paths[0] + ": batch-major tensors [S, B, ...] are " +
            (o.shuffle ? "never shuffled" : "read from one file only") +
            "; write one record per sample, [N, ...] (docs/data.md), to " +
            (o.shuffle ? "shuffle" : "read several files");
    return false;
  }
  // A classifier's targets, checked now unless they hold more than 1 GiB
  // (then each batch as it is read).
  int64_t targetBytes = 0;
  for (size_t i = 0; i < slots.size(); ++i)
    if (inputs[i]->classes > 0)
      for (const Source &src : sources)
        targetBytes += src.tensors[i]->end - src.tensors[i]->begin;
  if (targetBytes > 0 && (o.checkWhole || targetBytes <= (int64_t(1) << 30))) {
    if (!scanTargets(error))
      return false;
    scanned = true;
  } else if (targetBytes == 0) {
    scanned = true;
  }
  if (batchMajor)
    return true;
  order.items = items;
  order.globalBatch = globalBatch;
  order.shuffle = o.shuffle;
  order.seed = o.seed;
  order.steps = items / globalBatch;
  if (order.steps < 1) {
    error = "data file" + std::string(paths.size() > 1 ? "s " : " ") + listFiles(paths) + ": " +
            std::to_string(items) + " sample" + (items == 1 ? "" : "s") +
            " is fewer than one global batch of " + std::to_string(globalBatch);
    return false;
  }
  return true;
}

} // namespace

int64_t tokenOffset(int64_t step, int64_t j, int64_t globalBatch, int64_t seqLen,
                    int64_t numTokens) {
  // 128-bit so that long runs on long sequences cannot overflow before the mod.
  __int128 start = (static_cast<__int128>(step) * globalBatch + j) * seqLen;
  return static_cast<int64_t>(start % (numTokens - seqLen - 1));
}

uint64_t shuffleIndex(uint64_t i, uint64_t n, uint64_t seed, uint64_t epoch) {
  if (n <= 1)
    return 0;
  int bits = 64 - __builtin_clzll(n - 1); // the smallest b with 2^b >= n
  bits = std::max(bits + (bits & 1), 2);
  const int half = bits / 2;
  const uint64_t mask = (uint64_t(1) << half) - 1;
  const uint64_t key = mix64(seed ^ mix64(epoch));
  uint64_t x = i;
  do {
    uint64_t left = x >> half, right = x & mask;
    for (uint64_t round = 0; round < 6; ++round) {
      const uint64_t f = mix64(key ^ (round << 56) ^ right) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = left << half | right;
  } while (x >= n);
  return x;
}

bool expandDataPaths(const std::string &spec, const std::string &flag,
                     std::vector<std::string> &files, std::string &error) {
  files.clear();
  size_t from = 0;
  while (from <= spec.size()) {
    size_t comma = spec.find(',', from);
    if (comma == std::string::npos)
      comma = spec.size();
    const std::string part = spec.substr(from, comma - from);
    from = comma + 1;
    if (part.empty()) {
      error = flag + " '" + spec + "': an empty file name in the list";
      return false;
    }
    if (part.find_first_of("*?[") == std::string::npos) {
      files.push_back(part);
      continue;
    }
    glob_t g{};
    const int rc = ::glob(part.c_str(), GLOB_ERR, nullptr, &g);
    if (rc == GLOB_NOMATCH || (rc == 0 && g.gl_pathc == 0)) {
      globfree(&g);
      error = flag + ": no file matches '" + part + "'";
      return false;
    }
    if (rc != 0) {
      globfree(&g);
      error = flag + ": cannot expand '" + part + "': " + std::strerror(errno);
      return false;
    }
    for (size_t k = 0; k < g.gl_pathc; ++k)
      files.push_back(g.gl_pathv[k]); // glob sorts its matches
    globfree(&g);
  }
  return true;
}

std::unique_ptr<DataLoader> openDataLoader(const Program &program, int dpRank,
                                           const DataOptions &options, std::string &error) {
  if (!checkBatch(program, dpRank, error))
    return nullptr;
  if (program.dataKind == DataKind::Tokens) {
    auto loader = std::make_unique<TokenLoader>();
    if (!loader->open(program, dpRank, options, error))
      return nullptr;
    return loader;
  }
  auto loader = std::make_unique<TensorLoader>();
  if (!loader->open(program, dpRank, options, error))
    return nullptr;
  return loader;
}

} // namespace carve::rt
