//===- metrics.cpp - JSONL metrics and the progress line ------------------===//

#include "carve/rt/metrics.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace carve::rt {

namespace {

std::string quote(const std::string &s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

} // namespace

void JsonLine::key(const char *k) {
  if (body.size() > 1)
    body += ", ";
  body += quote(k) + ": ";
}

JsonLine &JsonLine::add(const char *k, int64_t value) {
  key(k);
  body += std::to_string(value);
  return *this;
}

JsonLine &JsonLine::add(const char *k, double value) {
  key(k);
  if (!std::isfinite(value)) {
    body += "null";
    return *this;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", value);
  body += buf;
  return *this;
}

JsonLine &JsonLine::add(const char *k, const std::string &value) {
  key(k);
  body += quote(value);
  return *this;
}

MetricsLog::~MetricsLog() {
  if (fd >= 0)
    ::close(fd);
}

bool MetricsLog::checkWritable(const std::string &path, std::string &error) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) {
      error = path + ": the log path exists and is not a regular file";
      return false;
    }
    int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
    if (fd < 0) {
      error = path + ": cannot write the log: " + std::strerror(errno);
      return false;
    }
    ::close(fd);
    return true;
  }
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    error = path + ": cannot create the log: " + std::strerror(errno);
    return false;
  }
  ::close(fd);
  ::unlink(path.c_str());
  return true;
}

bool MetricsLog::open(const std::string &path, std::string &error) {
  filePath = path;
  fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    error = path + ": cannot open the log: " + std::strerror(errno);
    return false;
  }
  return true;
}

bool MetricsLog::write(const JsonLine &line, std::string &error) {
  std::string text = line.str() + "\n";
  const char *p = text.data();
  size_t left = text.size();
  while (left > 0) {
    ssize_t put = ::write(fd, p, left);
    if (put < 0 && errno == EINTR)
      continue;
    if (put < 0) {
      error = filePath + ": cannot write the log: " + std::strerror(errno);
      return false;
    }
    p += put;
    left -= static_cast<size_t>(put);
  }
  return true;
}

std::string formatProgress(int64_t done, int64_t total, double loss, double rate, const char *unit,
                           double elapsedSeconds) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "step %lld/%lld  loss %.9g  %.0f %s/s  elapsed %.2fs",
                static_cast<long long>(done), static_cast<long long>(total), loss, rate, unit,
                elapsedSeconds);
  return buf;
}

} // namespace carve::rt
