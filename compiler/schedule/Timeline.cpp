//===- Timeline.cpp - simulating pipeline schedules, trace and SVG output -===//

#include "compiler/schedule/Timeline.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace carve::pipeline {
namespace {

/// "F3" / "B3", with ".c1" for chunk 1 when the ranks hold several chunks.
std::string shortName(const Schedule &s, const Instr &in) {
  std::string name = (in.kind == Instr::Forward ? "F" : "B") + std::to_string(in.microBatch);
  if (s.v > 1)
    name += ".c" + std::to_string(in.chunk);
  return name;
}

/// "F3 of stage 2", for error messages.
std::string stepName(Instr::Kind kind, int microBatch, int stage) {
  return (kind == Instr::Forward ? "F" : "B") + std::to_string(microBatch) + " of stage " +
         std::to_string(stage);
}

/// A number for JSON and SVG: no exponent for ordinary values, never "nan".
std::string num(double x) {
  if (!std::isfinite(x))
    return "0";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.12g", x);
  return buf;
}

std::string jsonString(const std::string &text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
    case '"':
      out += "\\\"";
      break;
    case '\\':
      out += "\\\\";
      break;
    case '\n':
      out += "\\n";
      break;
    case '\t':
      out += "\\t";
      break;
    default:
      if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof(buf), "\\u%04x", c);
        out += buf;
      } else {
        out += c;
      }
    }
  }
  return out + "\"";
}

std::string xmlEscape(const std::string &text) {
  std::string out;
  for (char c : text) {
    switch (c) {
    case '&':
      out += "&amp;";
      break;
    case '<':
      out += "&lt;";
      break;
    case '>':
      out += "&gt;";
      break;
    case '"':
      out += "&quot;";
      break;
    case '\'':
      out += "&apos;";
      break;
    default:
      out += c;
    }
  }
  return out;
}

/// "stage 2" or "stages 1, 5": the stages rank `rank` runs.
std::string stagesOf(const Schedule &s, int rank) {
  std::string text = s.v == 1 ? "stage " : "stages ";
  for (int c = 0; c < s.v; ++c)
    text += (c ? ", " : "") + std::to_string(s.stageOf(rank, c));
  return text;
}

/// `rgb` moved towards white by `f` in [0, 1], as "#rrggbb".
std::string lighten(int rgb, double f) {
  char buf[8];
  int parts[3] = {(rgb >> 16) & 0xff, (rgb >> 8) & 0xff, rgb & 0xff};
  for (int &c : parts)
    c = static_cast<int>(std::lround(c + (255 - c) * f));
  std::snprintf(buf, sizeof(buf), "#%02x%02x%02x", parts[0], parts[1], parts[2]);
  return buf;
}

/// A round step (1, 2 or 5 times a power of ten) giving about ten ticks.
double tickStep(double span) {
  double raw = span / 10;
  double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double norm = raw / mag;
  return (norm < 1.5 ? 1 : norm < 3.5 ? 2 : norm < 7.5 ? 5 : 10) * mag;
}

} // namespace

bool simulate(const Schedule &s, const std::vector<StageCost> &costs, double sendLatency,
              Timeline &out, std::string &error) {
  const int stages = s.numStages();
  if (static_cast<int>(s.ranks.size()) != s.p) {
    error = "pipeline schedule has " + std::to_string(s.ranks.size()) + " rank lists for pp " +
            std::to_string(s.p);
    return false;
  }
  if (static_cast<int>(costs.size()) != stages) {
    error = "pipeline simulation needs one cost per stage (" + std::to_string(stages) + "), got " +
            std::to_string(costs.size());
    return false;
  }
  if (!(sendLatency >= 0) || !std::isfinite(sendLatency)) {
    error = "pipeline simulation needs a finite send latency of at least 0";
    return false;
  }
  for (int st = 0; st < stages; ++st) {
    const StageCost &c = costs[st];
    if (!(c.forward >= 0 && c.backward >= 0 && std::isfinite(c.forward) &&
          std::isfinite(c.backward))) {
      error =
          "pipeline simulation needs finite costs of at least 0 (stage " + std::to_string(st) + ")";
      return false;
    }
  }

  // Each (kind, micro-batch, stage) step has one index; owner says which rank
  // runs it, so a dependency nobody runs is reported as such.
  auto index = [&](Instr::Kind kind, int mb, int stage) {
    return (kind == Instr::Forward ? 0 : s.m * stages) + mb * stages + stage;
  };
  std::vector<int> owner(2 * s.m * stages, -1);
  std::vector<double> endAt(owner.size(), 0);
  std::vector<bool> done(owner.size(), false);
  size_t total = 0;
  for (int r = 0; r < s.p; ++r) {
    for (const Instr &in : s.ranks[r]) {
      if (in.microBatch < 0 || in.microBatch >= s.m || in.chunk < 0 || in.chunk >= s.v) {
        error = "pipeline schedule: rank " + std::to_string(r) + " has " +
                std::string(in.kind == Instr::Forward ? "F" : "B") + std::to_string(in.microBatch) +
                " of chunk " + std::to_string(in.chunk) + ", outside m=" + std::to_string(s.m) +
                ", v=" + std::to_string(s.v);
        return false;
      }
      int stage = s.stageOf(r, in.chunk);
      int i = index(in.kind, in.microBatch, stage);
      if (owner[i] != -1) {
        error = "pipeline schedule: rank " + std::to_string(r) + " runs " +
                stepName(in.kind, in.microBatch, stage) + " twice";
        return false;
      }
      owner[i] = r;
      ++total;
    }
  }

  Timeline t;
  std::vector<size_t> next(s.p, 0);
  std::vector<double> freeAt(s.p, 0), busy(s.p, 0);
  struct Dep {
    Instr::Kind kind;
    int mb, stage;
  };
  auto depsOf = [&](const Instr &in, int stage) {
    std::vector<Dep> deps;
    if (in.kind == Instr::Forward) {
      if (stage > 0)
        deps.push_back({Instr::Forward, in.microBatch, stage - 1});
    } else {
      deps.push_back({Instr::Forward, in.microBatch, stage});
      if (stage < stages - 1)
        deps.push_back({Instr::Backward, in.microBatch, stage + 1});
    }
    return deps;
  };

  // Start times depend only on finish times of earlier steps, so running each
  // rank as far as it can go, round after round, gives the same timeline as
  // any event order; a round without progress is a deadlock.
  while (t.items.size() < total) {
    bool progress = false;
    for (int r = 0; r < s.p; ++r) {
      while (next[r] < s.ranks[r].size()) {
        const Instr &in = s.ranks[r][next[r]];
        int stage = s.stageOf(r, in.chunk);
        double start = freeAt[r];
        bool ready = true;
        for (const Dep &d : depsOf(in, stage)) {
          int i = index(d.kind, d.mb, d.stage);
          if (!done[i]) {
            ready = false;
            break;
          }
          start = std::max(start, endAt[i] + (owner[i] == r ? 0 : sendLatency));
        }
        if (!ready)
          break;
        double cost = in.kind == Instr::Forward ? costs[stage].forward : costs[stage].backward;
        int self = index(in.kind, in.microBatch, stage);
        endAt[self] = start + cost;
        done[self] = true;
        freeAt[r] = start + cost;
        busy[r] += cost;
        t.items.push_back({r, in, stage, start, start + cost});
        ++next[r];
        progress = true;
      }
    }
    if (progress)
      continue;
    std::string why;
    for (int r = 0; r < s.p; ++r) {
      if (next[r] >= s.ranks[r].size())
        continue;
      const Instr &in = s.ranks[r][next[r]];
      int stage = s.stageOf(r, in.chunk);
      for (const Dep &d : depsOf(in, stage)) {
        int i = index(d.kind, d.mb, d.stage);
        if (done[i])
          continue;
        why += why.empty() ? "" : "; ";
        why += "rank " + std::to_string(r) + " waits for " + stepName(d.kind, d.mb, d.stage) +
               (owner[i] == -1 ? ", which no rank runs,"
                               : " (rank " + std::to_string(owner[i]) + ")") +
               " before " + stepName(in.kind, in.microBatch, stage);
        break;
      }
    }
    error = "pipeline schedule deadlocks: " + why;
    return false;
  }

  // Items were produced round by round; list them rank by rank.
  std::stable_sort(t.items.begin(), t.items.end(),
                   [](const TimedInstr &a, const TimedInstr &b) { return a.rank < b.rank; });
  for (int r = 0; r < s.p; ++r) {
    t.makespan = std::max(t.makespan, freeAt[r]);
    t.compute = std::max(t.compute, busy[r]);
    t.peakInFlight.push_back(s.maxInFlight(r));
  }
  t.bubble = t.compute > 0 ? (t.makespan - t.compute) / t.compute : 0;
  out = std::move(t);
  return true;
}

std::string chromeTraceJson(const Schedule &s, const Timeline &t, const std::string &title) {
  std::ostringstream os;
  os << "{\"traceEvents\":[\n";
  os << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"tid\":0,\"args\":{\"name\":"
     << jsonString(title) << "}}";
  for (int r = 0; r < s.p; ++r) {
    os << ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":" << r
       << ",\"args\":{\"name\":"
       << jsonString("rank " + std::to_string(r) + " (" + stagesOf(s, r) + ")") << "}}";
  }
  for (const TimedInstr &ti : t.items) {
    bool fwd = ti.instr.kind == Instr::Forward;
    os << ",\n{\"name\":" << jsonString(shortName(s, ti.instr))
       << ",\"cat\":" << (fwd ? "\"forward\"" : "\"backward\"") << ",\"ph\":\"X\""
       << ",\"ts\":" << num(ti.start * 1e6) << ",\"dur\":" << num((ti.end - ti.start) * 1e6)
       << ",\"pid\":0,\"tid\":" << ti.rank << ",\"args\":{\"micro_batch\":" << ti.instr.microBatch
       << ",\"chunk\":" << ti.instr.chunk << ",\"stage\":" << ti.stage
       << ",\"slot\":" << ti.instr.slot << "}}";
  }
  os << "\n],\n\"displayTimeUnit\":\"ms\",\n\"metadata\":{\"title\":" << jsonString(title)
     << ",\"schedule\":" << jsonString(scheduleName(s.kind)) << ",\"p\":" << s.p << ",\"m\":" << s.m
     << ",\"v\":" << s.v << ",\"bubble\":" << num(t.bubble) << ",\"makespan\":" << num(t.makespan)
     << "}}\n";
  return os.str();
}

std::string timelineSvg(const Schedule &s, const Timeline &t, const std::string &title) {
  const int forwardRgb = 0x4c78a8, backwardRgb = 0xe45756;
  const double left = 110, right = 30, top = 64, rowHeight = 30, boxHeight = 22, axisHeight = 44;

  // Wide enough for the shortest box to hold its label, within reason.
  double shortest = 0;
  for (const TimedInstr &ti : t.items) {
    double d = ti.end - ti.start;
    if (d > 0 && (shortest == 0 || d < shortest))
      shortest = d;
  }
  double scale = 1;
  if (t.makespan > 0) {
    scale = 900 / t.makespan;
    if (shortest > 0)
      scale = std::max(scale, 26 / shortest);
    scale = std::min(scale, 8000 / t.makespan);
  }
  double plotWidth = t.makespan * scale;
  double width = left + plotWidth + right;
  double axisY = top + s.p * rowHeight + 4;
  double height = axisY + axisHeight;
  auto chunkShade = [&](int chunk) { return s.v > 1 ? 0.55 * chunk / (s.v - 1) : 0.0; };

  std::ostringstream os;
  os << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
     << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << num(width) << "\" height=\""
     << num(height) << "\" viewBox=\"0 0 " << num(width) << " " << num(height)
     << "\" font-family=\"sans-serif\" font-size=\"11\">\n";

  char bubble[32];
  std::snprintf(bubble, sizeof(bubble), "%.1f%%", t.bubble * 100);
  os << "<text x=\"10\" y=\"20\" font-size=\"14\" font-weight=\"bold\">"
     << xmlEscape(title + (title.empty() ? "" : ": ") + scheduleName(s.kind) +
                  ", p=" + std::to_string(s.p) + ", m=" + std::to_string(s.m) +
                  ", v=" + std::to_string(s.v) + ", bubble " + bubble)
     << "</text>\n";

  // Legend swatches are polygons so that every rect is an instruction.
  double lx = 10;
  auto swatch = [&](const std::string &fill, const std::string &label) {
    os << "<polygon points=\"" << num(lx) << ",32 " << num(lx + 12) << ",32 " << num(lx + 12)
       << ",44 " << num(lx) << ",44\" fill=\"" << fill << "\"/>"
       << "<text x=\"" << num(lx + 16) << "\" y=\"43\">" << xmlEscape(label) << "</text>\n";
    lx += 24 + 7 * label.size();
  };
  for (int c = 0; c < s.v; ++c) {
    std::string suffix = s.v > 1 ? " (chunk " + std::to_string(c) + ")" : "";
    swatch(lighten(forwardRgb, chunkShade(c)), "forward" + suffix);
    swatch(lighten(backwardRgb, chunkShade(c)), "backward" + suffix);
  }

  for (int r = 0; r < s.p; ++r) {
    double y = top + r * rowHeight;
    os << "<text x=\"10\" y=\"" << num(y + boxHeight / 2 + 4) << "\">rank " << r << "</text>\n";
    os << "<line x1=\"" << num(left) << "\" y1=\"" << num(y + rowHeight - 2) << "\" x2=\""
       << num(left + plotWidth) << "\" y2=\"" << num(y + rowHeight - 2)
       << "\" stroke=\"#e0e0e0\"/>\n";
  }

  for (const TimedInstr &ti : t.items) {
    bool fwd = ti.instr.kind == Instr::Forward;
    double shade = chunkShade(ti.instr.chunk);
    double x = left + ti.start * scale, w = (ti.end - ti.start) * scale;
    double y = top + ti.rank * rowHeight;
    std::string tip = shortName(s, ti.instr) + ": " + (fwd ? "forward" : "backward") +
                      " of micro-batch " + std::to_string(ti.instr.microBatch) + ", stage " +
                      std::to_string(ti.stage) + ", slot " + std::to_string(ti.instr.slot) + ", " +
                      num(ti.start) + " s to " + num(ti.end) + " s";
    os << "<rect x=\"" << num(x) << "\" y=\"" << num(y) << "\" width=\"" << num(w) << "\" height=\""
       << num(boxHeight) << "\" fill=\"" << lighten(fwd ? forwardRgb : backwardRgb, shade)
       << "\" stroke=\"#ffffff\" stroke-width=\"1\"><title>" << xmlEscape(tip)
       << "</title></rect>\n";
    os << "<text x=\"" << num(x + w / 2) << "\" y=\"" << num(y + boxHeight / 2 + 4)
       << "\" text-anchor=\"middle\" fill=\"" << (shade > 0.3 ? "#222222" : "#ffffff") << "\">"
       << ti.instr.microBatch << "</text>\n";
  }

  os << "<line x1=\"" << num(left) << "\" y1=\"" << num(axisY) << "\" x2=\""
     << num(left + plotWidth) << "\" y2=\"" << num(axisY) << "\" stroke=\"#000000\"/>\n";
  if (t.makespan > 0) {
    double step = tickStep(t.makespan);
    for (int i = 0; i * step <= t.makespan * (1 + 1e-9); ++i) {
      double x = left + i * step * scale;
      char label[32];
      std::snprintf(label, sizeof(label), "%g", i * step);
      os << "<line x1=\"" << num(x) << "\" y1=\"" << num(axisY) << "\" x2=\"" << num(x)
         << "\" y2=\"" << num(axisY + 5) << "\" stroke=\"#000000\"/>"
         << "<text x=\"" << num(x) << "\" y=\"" << num(axisY + 18) << "\" text-anchor=\"middle\">"
         << label << "</text>\n";
    }
  }
  os << "<text x=\"" << num(left + plotWidth) << "\" y=\"" << num(axisY + 36)
     << "\" text-anchor=\"end\">time (s)</text>\n";
  os << "</svg>\n";
  return os.str();
}

} // namespace carve::pipeline
