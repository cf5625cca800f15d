//===- safetensors.h - reading and writing safetensors files --------------===//
//
// The checkpoint and tensor-data format: 8 bytes of little-endian header
// length N, N bytes of JSON header
//   {"NAME": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value", ...}}
// then the data section (offsets are relative to its start). Reading validates
// the whole header before anything is used and never trusts a number from the
// file; writing goes through a temporary file, fsync and rename, so a reader
// sees either the old file or the complete new one.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_SAFETENSORS_H
#define CARVE_RT_SAFETENSORS_H

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace carve::rt {

/// Size in bytes of one element of a safetensors dtype ("F32", "BF16", "I64",
/// "BOOL", ...), or 0 if the spelling is not a safetensors dtype.
int safetensorsDtypeSize(const std::string &dtype);

/// "[2, 3]": a shape as error messages print it.
std::string formatShape(const std::vector<int64_t> &shape);

/// One tensor as the header of a file describes it.
struct SafetensorsTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t begin = 0; // byte range [begin, end) in the data section
  int64_t end = 0;
};

/// A safetensors file opened for reading. `open` validates the header; the
/// data is read on demand with pread, so a large file is never loaded whole.
class SafetensorsReader {
public:
  SafetensorsReader() = default;
  SafetensorsReader(const SafetensorsReader &) = delete;
  SafetensorsReader &operator=(const SafetensorsReader &) = delete;
  ~SafetensorsReader();

  /// Opens and validates `path`: the file size, the header length, the JSON,
  /// every entry's dtype, shape and data offsets (inside the data section,
  /// matching numel * element size, not overlapping another tensor). On
  /// failure returns false and sets `error` to "PATH: cause".
  bool open(const std::string &path, std::string &error);

  const std::string &path() const { return filePath; }
  /// The tensors in header order.
  const std::vector<SafetensorsTensor> &tensors() const { return entries; }
  /// The tensor called `name`, or null.
  const SafetensorsTensor *find(const std::string &name) const;
  /// The "__metadata__" object (empty when the file has none).
  const std::map<std::string, std::string> &metadata() const { return meta; }

  /// Copies `bytes` bytes of `t`'s data, starting `offset` bytes into it, to
  /// `dst`. The range must lie inside the tensor. Fails (with "PATH: cause")
  /// only on an I/O error or a file that shrank since `open`.
  bool read(const SafetensorsTensor &t, int64_t offset, int64_t bytes, void *dst,
            std::string &error) const;

private:
  std::string filePath;
  int fd = -1;
  int64_t dataStart = 0;
  std::vector<SafetensorsTensor> entries;
  std::map<std::string, size_t> byName;
  std::map<std::string, std::string> meta;
};

/// One tensor to write: `data` holds numel(shape) * element size bytes.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  const void *data = nullptr;
};

/// Writes a safetensors file with `tensors` in the given order (header padded
/// with spaces to a multiple of 8) and `metadata` as "__metadata__" (omitted
/// when empty). Atomic: writes PATH.tmp-XXXXXX in the same folder, fsyncs it
/// and renames it over `path`; on failure `path` is untouched, no temporary
/// file is left, and `error` says why ("PATH: cause").
bool writeSafetensors(const std::string &path, const std::vector<SafetensorsEntry> &tensors,
                      const std::vector<std::pair<std::string, std::string>> &metadata,
                      std::string &error);

} // namespace carve::rt

#endif // CARVE_RT_SAFETENSORS_H
