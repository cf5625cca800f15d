//===- safetensors.cpp - reading and writing safetensors files ------------===//

#include "carve/rt/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <set>
#include <sys/stat.h>
#include <unistd.h>

namespace carve::rt {

namespace {

using Json = nlohmann::ordered_json;

/// The safetensors library refuses headers above 100 MB; so do we, before
/// allocating anything for one.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

std::string errnoText() { return std::strerror(errno); }

/// pread until `bytes` are read; false on an error or end of file.
bool preadAll(int fd, void *dst, int64_t bytes, int64_t offset, std::string &cause) {
  char *p = static_cast<char *>(dst);
  while (bytes > 0) {
    size_t chunk = static_cast<size_t>(std::min<int64_t>(bytes, int64_t(1) << 30));
    ssize_t got = ::pread(fd, p, chunk, offset);
    if (got < 0) {
      if (errno == EINTR)
        continue;
      cause = "read failed: " + errnoText();
      return false;
    }
    if (got == 0) {
      cause = "unexpected end of file (was it truncated while in use?)";
      return false;
    }
    p += got;
    bytes -= got;
    offset += got;
  }
  return true;
}

bool writeAll(int fd, const void *src, int64_t bytes, std::string &cause) {
  const char *p = static_cast<const char *>(src);
  while (bytes > 0) {
    size_t chunk = static_cast<size_t>(std::min<int64_t>(bytes, int64_t(1) << 30));
    ssize_t put = ::write(fd, p, chunk);
    if (put < 0) {
      if (errno == EINTR)
        continue;
      cause = "write failed: " + errnoText();
      return false;
    }
    p += put;
    bytes -= put;
  }
  return true;
}

/// numel of `shape`, or -1 if it exceeds `limit` (which keeps every later
/// multiplication by an element size far from overflow).
int64_t checkedNumel(const std::vector<int64_t> &shape, int64_t limit) {
  int64_t n = 1;
  for (int64_t d : shape)
    if (d == 0)
      return 0;
  for (int64_t d : shape) {
    if (d > limit || n > limit / d)
      return -1;
    n *= d;
  }
  return n;
}

/// Reads a non-negative JSON integer; false for floats, negatives, others.
bool readIndex(const Json &v, int64_t &out) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX))
      return false;
    out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    out = v.get<int64_t>();
    return out >= 0;
  }
  return false;
}

/// Validates one header entry against a data section of `dataBytes` bytes.
bool parseEntry(const std::string &name, const Json &v, int64_t dataBytes, SafetensorsTensor &t,
                std::string &cause) {
  std::string where = "tensor '" + name + "': ";
  if (!v.is_object()) {
    cause = where + "header entry is not a JSON object";
    return false;
  }
  t.name = name;
  auto dtype = v.find("dtype");
  if (dtype == v.end() || !dtype->is_string()) {
    cause = where + "missing or non-string \"dtype\"";
    return false;
  }
  t.dtype = dtype->get<std::string>();
  int elemSize = safetensorsDtypeSize(t.dtype);
  if (elemSize == 0) {
    cause = where + "unknown dtype \"" + t.dtype + "\"";
    return false;
  }
  auto shape = v.find("shape");
  if (shape == v.end() || !shape->is_array()) {
    cause = where + "missing or non-array \"shape\"";
    return false;
  }
  for (const Json &d : *shape) {
    int64_t dim;
    if (!readIndex(d, dim)) {
      cause = where + "\"shape\" holds " + d.dump() + ", not a non-negative integer";
      return false;
    }
    t.shape.push_back(dim);
  }
  auto offsets = v.find("data_offsets");
  if (offsets == v.end() || !offsets->is_array() || offsets->size() != 2 ||
      !readIndex((*offsets)[0], t.begin) || !readIndex((*offsets)[1], t.end)) {
    cause = where + "\"data_offsets\" must be [begin, end] with non-negative integers";
    return false;
  }
  if (t.begin > t.end || t.end > dataBytes) {
    cause = where + "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
            "] lie outside the data section of " + std::to_string(dataBytes) + " bytes";
    return false;
  }
  t.numel = checkedNumel(t.shape, dataBytes + 1);
  int64_t expected = t.numel < 0 ? -1 : t.numel * elemSize;
  if (expected != t.end - t.begin) {
    cause = where + "shape " + formatShape(t.shape) + " of " + t.dtype + " needs " +
            (expected < 0 ? std::string("more bytes than the file has")
                          : std::to_string(expected) + " bytes") +
            ", data_offsets give " + std::to_string(t.end - t.begin);
    return false;
  }
  return true;
}

} // namespace

int safetensorsDtypeSize(const std::string &dtype) {
  static const std::map<std::string, int> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

std::string formatShape(const std::vector<int64_t> &shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

SafetensorsReader::~SafetensorsReader() {
  if (fd >= 0)
    ::close(fd);
}

const SafetensorsTensor *SafetensorsReader::find(const std::string &name) const {
  auto it = byName.find(name);
  return it == byName.end() ? nullptr : &entries[it->second];
}

bool SafetensorsReader::open(const std::string &path, std::string &error) {
  if (fd >= 0)
    ::close(fd);
  fd = -1;
  entries.clear();
  byName.clear();
  meta.clear();
  filePath = path;
  auto fail = [&](const std::string &cause) {
    error = path + ": " + cause;
    if (fd >= 0)
      ::close(fd);
    fd = -1;
    entries.clear();
    byName.clear();
    meta.clear();
    return false;
  };

  fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return fail("cannot open: " + errnoText());
  struct stat st;
  if (::fstat(fd, &st) != 0)
    return fail("cannot stat: " + errnoText());
  if (!S_ISREG(st.st_mode))
    return fail("not a regular file");
  int64_t fileBytes = st.st_size;
  if (fileBytes < 8)
    return fail("not a safetensors file: " + std::to_string(fileBytes) +
                " bytes, too short for the 8-byte header length");

  unsigned char lenBytes[8];
  std::string cause;
  if (!preadAll(fd, lenBytes, 8, 0, cause))
    return fail(cause);
  uint64_t headerLen = 0;
  for (int i = 7; i >= 0; --i)
    headerLen = headerLen << 8 | lenBytes[i];
  if (headerLen < 2 || headerLen > kMaxHeaderBytes)
    return fail("not a safetensors file: header length " + std::to_string(headerLen) +
                " is not between 2 and " + std::to_string(kMaxHeaderBytes));
  if (headerLen > static_cast<uint64_t>(fileBytes - 8))
    return fail("header length " + std::to_string(headerLen) + " exceeds the file size " +
                std::to_string(fileBytes) + " (truncated file?)");

  std::string header(headerLen, '\0');
  if (!preadAll(fd, header.data(), static_cast<int64_t>(headerLen), 8, cause))
    return fail(cause);
  if (header[0] != '{')
    return fail("not a safetensors file: the header does not start with '{'");

  // ordered_json keeps the file's order; duplicate names would silently keep
  // the last one, so the parser callback refuses them.
  std::set<std::string> seen;
  std::string duplicate;
  bool deep = false;
  Json root;
  try {
    root = Json::parse(header, [&](int depth, Json::parse_event_t event, Json &parsed) {
      // dump() and copies recurse once per level: refuse absurd nesting here.
      if (depth > 64)
        deep = true;
      if (deep)
        return false;
      if (depth == 1 && event == Json::parse_event_t::key &&
          !seen.insert(parsed.get<std::string>()).second && duplicate.empty())
        duplicate = parsed.get<std::string>();
      return true;
    });
  } catch (const Json::exception &e) {
    std::string what = e.what();
    size_t close = what.find("] ");
    return fail("header is not valid JSON: " +
                (close == std::string::npos ? what : what.substr(close + 2)));
  }
  if (deep)
    return fail("header nests deeper than 64 levels");
  if (!duplicate.empty())
    return fail("header names '" + duplicate + "' twice");
  if (!root.is_object())
    return fail("header is not a JSON object");

  dataStart = 8 + static_cast<int64_t>(headerLen);
  int64_t dataBytes = fileBytes - dataStart;
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object())
        return fail("\"__metadata__\" is not a JSON object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string())
          return fail("\"__metadata__\" value of '" + m.key() + "' is not a string");
        meta[m.key()] = m->get<std::string>();
      }
      continue;
    }
    SafetensorsTensor t;
    if (!parseEntry(it.key(), *it, dataBytes, t, cause))
      return fail(cause);
    byName[t.name] = entries.size();
    entries.push_back(std::move(t));
  }

  std::vector<const SafetensorsTensor *> order;
  for (const SafetensorsTensor &t : entries)
    if (t.end > t.begin)
      order.push_back(&t);
  std::sort(order.begin(), order.end(), [](auto *a, auto *b) { return a->begin < b->begin; });
  for (size_t i = 1; i < order.size(); ++i)
    if (order[i]->begin < order[i - 1]->end)
      return fail("tensors '" + order[i - 1]->name + "' and '" + order[i]->name +
                  "' overlap in the data section");
  return true;
}

bool SafetensorsReader::read(const SafetensorsTensor &t, int64_t offset, int64_t bytes, void *dst,
                             std::string &error) const {
  if (fd < 0 || offset < 0 || bytes < 0 || offset + bytes > t.end - t.begin) {
    error = filePath + ": tensor '" + t.name + "': read of bytes [" + std::to_string(offset) +
            ", " + std::to_string(offset + bytes) + ") outside its data";
    return false;
  }
  std::string cause;
  if (!preadAll(fd, dst, bytes, dataStart + t.begin + offset, cause)) {
    error = filePath + ": tensor '" + t.name + "': " + cause;
    return false;
  }
  return true;
}

bool writeSafetensors(const std::string &path, const std::vector<SafetensorsEntry> &tensors,
                      const std::vector<std::pair<std::string, std::string>> &metadata,
                      std::string &error) {
  auto fail = [&](const std::string &cause) {
    error = path + ": " + cause;
    return false;
  };

  Json header = Json::object();
  if (!metadata.empty()) {
    Json m = Json::object();
    for (const auto &[k, v] : metadata)
      m[k] = v;
    header["__metadata__"] = m;
  }
  std::set<std::string> names;
  std::vector<int64_t> sizes;
  int64_t offset = 0;
  for (const SafetensorsEntry &t : tensors) {
    if (t.name.empty() || t.name == "__metadata__")
      return fail("invalid tensor name '" + t.name + "'");
    if (!names.insert(t.name).second)
      return fail("tensor '" + t.name + "' given twice");
    int elemSize = safetensorsDtypeSize(t.dtype);
    if (elemSize == 0)
      return fail("tensor '" + t.name + "': unknown dtype \"" + t.dtype + "\"");
    for (int64_t d : t.shape)
      if (d < 0)
        return fail("tensor '" + t.name + "': negative dimension in " + formatShape(t.shape));
    int64_t numel = checkedNumel(t.shape, INT64_MAX / 16);
    if (numel < 0)
      return fail("tensor '" + t.name + "': shape " + formatShape(t.shape) + " is too large");
    int64_t bytes = numel * elemSize;
    if (bytes > 0 && !t.data)
      return fail("tensor '" + t.name + "': no data");
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    sizes.push_back(bytes);
    offset += bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception &e) {
    return fail(std::string("cannot encode the header: ") + e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char lenBytes[8];
  for (int i = 0; i < 8; ++i)
    lenBytes[i] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >> (8 * i));

  std::string tmp = path + ".tmp-XXXXXX";
  int fd = ::mkstemp(tmp.data());
  if (fd < 0)
    return fail("cannot create a temporary file beside it: " + errnoText());
  std::string cause;
  bool ok = ::fchmod(fd, 0644) == 0 || (cause = "chmod failed: " + errnoText(), false);
  ok = ok && writeAll(fd, lenBytes, 8, cause) &&
       writeAll(fd, text.data(), static_cast<int64_t>(text.size()), cause);
  for (size_t i = 0; ok && i < tensors.size(); ++i)
    ok = writeAll(fd, tensors[i].data, sizes[i], cause);
  if (ok && ::fsync(fd) != 0) {
    cause = "fsync failed: " + errnoText();
    ok = false;
  }
  if (::close(fd) != 0 && ok) {
    cause = "close failed: " + errnoText();
    ok = false;
  }
  if (ok && ::rename(tmp.c_str(), path.c_str()) != 0) {
    cause = "cannot rename the temporary file into place: " + errnoText();
    ok = false;
  }
  if (!ok) {
    ::unlink(tmp.c_str());
    return fail(cause);
  }
  // Make the rename itself durable.
  size_t slash = path.rfind('/');
  std::string dir = slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash);
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return true;
}

} // namespace carve::rt
