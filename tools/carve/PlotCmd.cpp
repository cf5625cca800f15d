//===- PlotCmd.cpp - `carve plot`: training curves as SVG -----------------===//

#include "tools/carve/PlotCmd.h"

#include "tools/carve/Driver.h"

#include "llvm/Support/JSON.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

using namespace llvm;

namespace carve {

namespace {

/// One series of the panels, by the JSONL keys that hold it.
struct SeriesKind {
  const char *name, *title;
  std::vector<const char *> keys; // the first a line has
};

const std::vector<SeriesKind> &seriesKinds() {
  static const std::vector<SeriesKind> kinds = {
      {"loss", "training loss", {"loss"}},
      {"eval_loss", "evaluation loss", {"eval_loss"}},
      {"lr", "learning rate", {"lr"}},
      {"grad_norm", "gradient norm (before clipping)", {"grad_norm"}},
      {"throughput",
       "throughput (tokens or samples per second)",
       {"tokens_per_s", "samples_per_s"}},
  };
  return kinds;
}

struct Run {
  std::string path, label;
  // Per series: (step, value) in file order; non-finite values are left out.
  std::map<std::string, std::vector<std::pair<double, double>>> points;
};

/// Reads a --log file; dies with one line naming it on anything else.
Run readLog(const std::string &path) {
  Run run;
  run.path = path;
  run.label = sys::path::filename(path).str();
  const std::string text = readFileOrDie(path, "training log (train --log FILE.jsonl)");
  size_t begin = 0;
  int lineNo = 0, rows = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos)
      end = text.size();
    std::string line = text.substr(begin, end - begin);
    begin = end + 1;
    ++lineNo;
    if (line.find_first_not_of(" \t\r") == std::string::npos)
      continue;
    Expected<json::Value> v = json::parse(line);
    if (!v) {
      std::string why = toString(v.takeError());
      die(path + ": line " + std::to_string(lineNo) + " is not JSON (" + why +
          "); carve plot reads the JSON Lines logs of train --log");
    }
    const json::Object *o = v->getAsObject();
    if (!o)
      die(path + ": line " + std::to_string(lineNo) +
          " is not a JSON object; carve plot reads the JSON Lines logs of train --log");
    std::optional<int64_t> step = o->getInteger("step");
    if (!step)
      die(path + ": line " + std::to_string(lineNo) +
          " has no integer \"step\"; carve plot reads the JSON Lines logs of train --log");
    ++rows;
    for (const SeriesKind &k : seriesKinds())
      for (const char *key : k.keys)
        if (std::optional<double> x = o->getNumber(key)) {
          if (std::isfinite(*x))
            run.points[k.name].push_back({(double)*step, *x});
          break;
        }
  }
  if (rows == 0)
    die(path + ": no steps (an empty log)");
  return run;
}

/// Round numbers for the axis between lo and hi, about `want` of them.
std::vector<double> ticks(double lo, double hi, int want) {
  if (!(hi > lo))
    return {lo};
  const double raw = (hi - lo) / want;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  std::vector<double> t;
  for (double x = std::ceil(lo / step) * step; x <= hi + step * 1e-9; x += step)
    t.push_back(std::fabs(x) < step * 1e-9 ? 0.0 : x);
  return t;
}

std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

/// A coordinate: two decimals.
std::string px(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", x);
  return buf;
}

std::string escape(const std::string &s) {
  std::string out;
  for (char c : s)
    out += c == '<'   ? "&lt;"
           : c == '>' ? "&gt;"
           : c == '&' ? "&amp;"
           : c == '"' ? "&quot;"
                      : std::string(1, c);
  return out;
}

const char *kColours[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                          "#9467bd", "#8c564b", "#e377c2", "#17becf"};

} // namespace

int runPlot(const std::vector<std::string> &logs, const std::string &output) {
  if (logs.empty())
    die("carve plot: give one or more logs of train --log: carve plot LOG.jsonl [...] -o "
        "curves.svg");
  if (output.empty())
    die("carve plot: -o FILE.svg is required (where to write the picture)");
  std::vector<Run> runs;
  for (const std::string &p : logs)
    runs.push_back(readLog(p));

  // The panels: every series some run has.
  std::vector<const SeriesKind *> panels;
  for (const SeriesKind &k : seriesKinds())
    for (const Run &r : runs)
      if (r.points.count(k.name)) {
        panels.push_back(&k);
        break;
      }
  const double W = 860, panelH = 250, left = 80, right = 20, top = 40, legendH = 24 * runs.size();
  const double plotW = W - left - right, plotH = panelH - 70;
  const double H = top + legendH + panelH * panels.size() + 10;
  std::string svg;
  raw_string_ostream os(svg);
  os << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
     << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << px(W) << "\" height=\"" << px(H)
     << "\" viewBox=\"0 0 " << px(W) << " " << px(H)
     << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
     << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
     << "<text x=\"" << px(left) << "\" y=\"24\" font-size=\"16\">Training curves (" << runs.size()
     << (runs.size() == 1 ? " run" : " runs") << ")</text>\n";
  // Legend: one colour per run.
  for (size_t i = 0; i < runs.size(); ++i) {
    const double y = top + 12 + 24 * i;
    os << "<g class=\"legend\"><line x1=\"" << px(left) << "\" y1=\"" << px(y - 4) << "\" x2=\""
       << px(left + 30) << "\" y2=\"" << px(y - 4) << "\" stroke=\"" << kColours[i % 8]
       << "\" stroke-width=\"2\"/><text x=\"" << px(left + 38) << "\" y=\"" << px(y) << "\">"
       << escape(runs[i].label) << "</text></g>\n";
  }
  for (size_t p = 0; p < panels.size(); ++p) {
    const SeriesKind &k = *panels[p];
    const double y0 = top + legendH + panelH * p + 30;
    double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
    for (const Run &r : runs)
      if (auto it = r.points.find(k.name); it != r.points.end())
        for (auto [x, y] : it->second) {
          xlo = std::min(xlo, x), xhi = std::max(xhi, x);
          ylo = std::min(ylo, y), yhi = std::max(yhi, y);
        }
    if (xhi <= xlo)
      xhi = xlo + 1;
    if (yhi <= ylo) {
      const double pad = ylo == 0 ? 1 : std::fabs(ylo) * 0.1;
      ylo -= pad, yhi += pad;
    }
    std::vector<double> yt = ticks(ylo, yhi, 5), xt = ticks(xlo, xhi, 8);
    ylo = std::min(ylo, yt.front()), yhi = std::max(yhi, yt.back());
    auto X = [&](double x) { return left + (x - xlo) / (xhi - xlo) * plotW; };
    auto Y = [&](double y) { return y0 + plotH - (y - ylo) / (yhi - ylo) * plotH; };
    os << "<g class=\"panel\" data-series=\"" << k.name << "\">\n"
       << "<text x=\"" << px(left) << "\" y=\"" << px(y0 - 10) << "\" font-size=\"14\">" << k.title
       << "</text>\n"
       << "<rect x=\"" << px(left) << "\" y=\"" << px(y0) << "\" width=\"" << px(plotW)
       << "\" height=\"" << px(plotH) << "\" fill=\"none\" stroke=\"#444\"/>\n";
    for (double t : yt)
      os << "<line x1=\"" << px(left) << "\" y1=\"" << px(Y(t)) << "\" x2=\"" << px(left + plotW)
         << "\" y2=\"" << px(Y(t)) << "\" stroke=\"#ddd\"/><text x=\"" << px(left - 6) << "\" y=\""
         << px(Y(t) + 4) << "\" text-anchor=\"end\">" << num(t) << "</text>\n";
    for (double t : xt)
      if (t >= xlo && t <= xhi)
        os << "<text x=\"" << px(X(t)) << "\" y=\"" << px(y0 + plotH + 16)
           << "\" text-anchor=\"middle\">" << num(t) << "</text>\n";
    os << "<text x=\"" << px(left + plotW / 2) << "\" y=\"" << px(y0 + plotH + 32)
       << "\" text-anchor=\"middle\">step</text>\n";
    for (size_t i = 0; i < runs.size(); ++i) {
      auto it = runs[i].points.find(k.name);
      if (it == runs[i].points.end())
        continue;
      os << "<polyline class=\"series\" data-series=\"" << k.name << "\" data-run=\""
         << escape(runs[i].label) << "\" fill=\"none\" stroke=\"" << kColours[i % 8]
         << "\" stroke-width=\"1.5\" points=\"";
      const auto &pts = it->second;
      for (size_t j = 0; j < pts.size(); ++j)
        os << (j ? " " : "") << px(X(pts[j].first)) << "," << px(Y(pts[j].second));
      os << "\"/>\n";
      // A sparse series (evaluation every few steps; a single point, which a
      // line alone would not show): a marker at each point.
      const bool sparse =
          pts.size() == 1 ||
          (pts.size() > 1 && (pts.back().first - pts.front().first) / (pts.size() - 1) > 1.5);
      if (sparse)
        for (const auto &[x, y] : pts)
          os << "<circle class=\"marker\" data-series=\"" << k.name << "\" data-run=\""
             << escape(runs[i].label) << "\" cx=\"" << px(X(x)) << "\" cy=\"" << px(Y(y))
             << "\" r=\"2.5\" fill=\"" << kColours[i % 8] << "\"/>\n";
    }
    os << "</g>\n";
  }
  os << "</svg>\n";
  os.flush();

  writeAtomically(output, svg); // never a half-written picture
  outs() << "carve: wrote " << output << " (" << panels.size() << " panels, " << runs.size()
         << (runs.size() == 1 ? " run" : " runs") << ")\n";
  return 0;
}

} // namespace carve
