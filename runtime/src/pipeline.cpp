//===- pipeline.cpp - the measured schedule as a Chrome trace -------------===//

#include "carve/rt/pipeline.h"

#include <cstdio>
#include <sstream>

namespace carve::rt {
namespace {

std::string jsonString(const std::string &text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f", x);
  return buf;
}

} // namespace

std::string chromeTrace(const std::vector<std::vector<Tracer::Event>> &perRank,
                        const std::string &title) {
  std::ostringstream os;
  os << "{\"traceEvents\":[\n";
  os << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"tid\":0,\"args\":{\"name\":"
     << jsonString(title) << "}}";
  for (size_t r = 0; r < perRank.size(); ++r)
    os << ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":" << r
       << ",\"args\":{\"name\":\"rank " << r << "\"}}";
  for (size_t r = 0; r < perRank.size(); ++r)
    for (const Tracer::Event &e : perRank[r]) {
      std::string name = e.kind == 'O'   ? std::string("sync+optimizer")
                         : e.kind == 'S' ? "step " + std::to_string(e.step + 1)
                                         : std::string(1, e.kind) + std::to_string(e.microBatch);
      const char *cat = e.kind == 'F'   ? "forward"
                        : e.kind == 'B' ? "backward"
                        : e.kind == 'S' ? "step"
                                        : "optimizer";
      os << ",\n{\"name\":" << jsonString(name) << ",\"cat\":\"" << cat << "\",\"ph\":\"X\""
         << ",\"ts\":" << num(e.begin * 1e6) << ",\"dur\":" << num((e.end - e.begin) * 1e6)
         << ",\"pid\":0,\"tid\":" << r << ",\"args\":{\"micro_batch\":" << e.microBatch
         << ",\"stage\":" << e.stage << ",\"step\":" << e.step + 1 << "}}";
    }
  os << "\n],\n\"displayTimeUnit\":\"ms\",\n\"metadata\":{\"title\":" << jsonString(title)
     << ",\"measured\":true}}\n";
  return os.str();
}

} // namespace carve::rt
