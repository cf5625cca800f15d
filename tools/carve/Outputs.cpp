//===- Outputs.cpp - what `carve compile` writes into OUT -----------------===//

#include "tools/carve/Outputs.h"

#include "tools/carve/Driver.h"

#include "carve/rt/safetensors.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/raw_ostream.h"

#include <nlohmann/json.hpp>

using namespace llvm;

namespace carve {

namespace {

/// The README's table: which ranks run which program, and what it does.
void describePrograms(raw_ostream &os, const CompiledModel &m) {
  const Plan &plan = *m.plan;
  const std::string ext = m.sourceExtension();
  if (!m.pipelined) {
    os << "| 0";
    if (plan.worldSize() > 1)
      os << "–" << plan.worldSize() - 1;
    os << " | program0" << ext << " | the whole training step on " << m.globalBatch / plan.dp
       << " of the " << m.globalBatch << " samples of each global batch";
    if (plan.dp > 1)
      os << "; gradients summed over the " << plan.dp << " data-parallel replicas";
    os << " |\n";
    return;
  }
  int group = plan.dp * plan.tp;
  for (int r = 0; r < plan.pp; ++r) {
    os << "| " << r * group;
    if (group > 1)
      os << "–" << (r + 1) * group - 1;
    os << " | " << m.programNames[r] << ext << " | pipeline stage";
    std::string list;
    for (int c = 0; c < plan.virtualStages; ++c)
      list += (c ? ", " : "") + std::to_string(c * plan.pp + r);
    os << (plan.virtualStages > 1 ? "s " : " ") << list << " (" << plan.scheduleName()
       << " schedule, " << m.microBatches << " micro-batch" << (m.microBatches > 1 ? "es" : "")
       << " of " << m.microBatch << " samples per step) |\n";
  }
}

std::string readme(const CompiledModel &m) {
  const Plan &plan = *m.plan;
  std::string text;
  raw_string_ostream os(text);
  os << "# Generated sources for " << m.modelName << "\n\n"
     << "Plan: `" << plan.json << "` (" << plan.worldSize() << " rank"
     << (plan.worldSize() > 1 ? "s" : "") << ").\n\n"
     << "| ranks | source | what it does |\n|---|---|---|\n";
  describePrograms(os, m);
  os << "\n"
     << "`programs.cpp` maps each rank to its program. The runtime's `main` "
        "(runtime/src/train_main.cpp) reads the data, runs the steps and writes "
        "checkpoints.\n\n"
     << "Optimizer: " << m.optimizer->describe() << ".\n\n";
  if (m.hasCustomKernels) {
    os << "Custom ops: `custom/` holds copies of the " << (m.cuda() ? "CUDA" : "C++")
       << " kernel sources that " << m.rulesPath
       << " names; they are compiled from their original paths and linked into bin/train.\n\n";
  }
  if (!m.pipelined) {
    const GeneratedProgram &prog = m.programs[0];
    os << "Memory: arena of " << prog.arenaBytes << " bytes per rank; activations take "
       << prog.activationBytes << " bytes with reuse by liveness (" << prog.unplannedBytes
       << " without).\n";
  } else {
    for (size_t r = 0; r < m.programs.size(); ++r)
      os << "Memory of " << m.programNames[r] << ": arena of " << m.programs[r].arenaBytes
         << " bytes; activations " << m.programs[r].activationBytes << " bytes (all slots).\n";
  }
  return text;
}

} // namespace

void writeSources(const std::string &dir, const CompiledModel &m) {
  const Plan &plan = *m.plan;
  for (size_t r = 0; r < m.programs.size(); ++r)
    writeFileOrDie(dir + "/src/" + m.programNames[r] + m.sourceExtension(), m.programs[r].source);
  std::vector<int> rankToProgram(plan.worldSize(), 0);
  // rank = (ppRank * dp + dpRank) * tp + tpRank; expert parallelism splits
  // dp into groups of ep consecutive ranks, epRank = dpRank % ep.
  for (int r = 0; r < plan.worldSize(); ++r)
    rankToProgram[r] = r / plan.tp % plan.dp % plan.ep * (m.pipelined ? plan.pp : 1) +
                       (m.pipelined ? r / (plan.dp * plan.tp) : 0);
  writeFileOrDie(dir + "/src/programs.cpp", generateProgramTable(m.programNames, rankToProgram));
  writeFileOrDie(dir + "/src/README.md", readme(m));
}

void writePlanJson(const std::string &dir, const CompiledModel &m) {
  const Plan &plan = *m.plan;
  nlohmann::ordered_json meta;
  meta["plan"] = nlohmann::ordered_json::parse(plan.json);
  meta["world_size"] = plan.worldSize();
  meta["model"] = m.modelName;
  meta["global_batch"] = m.globalBatch;
  meta["optimizer"] = m.optimizer->describe();
  meta["target"] = m.target;
  meta["precision"] = plan.precision;
  if (m.pipelined) {
    nlohmann::ordered_json pj;
    pj["pp"] = plan.pp;
    pj["num_micro_batches"] = m.microBatches;
    pj["micro_batch_size"] = m.microBatch;
    pj["schedule"] = plan.scheduleName();
    pj["virtual_stages"] = plan.virtualStages;
    pj["planned_bubble"] = m.plannedBubble;
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (size_t s = 0; s < m.stages.size(); ++s) {
      const StageSummary &st = m.stages[s];
      nlohmann::ordered_json e;
      e["stage"] = s;
      e["rank"] = (int)s % plan.pp;
      e["first"] = st.first;
      e["last"] = st.last;
      e["layers"] = st.layers;
      e["flops"] = st.flops;
      e["param_bytes"] = st.paramBytes;
      e["send_bytes"] = st.sendBytes;
      list.push_back(e);
    }
    pj["stages"] = list;
    nlohmann::ordered_json sh = nlohmann::ordered_json::array();
    for (const auto &x : m.shared)
      sh.push_back(x.name);
    pj["shared_parameters"] = sh;
    meta["pipeline"] = pj;
  }
  writeFileOrDie(dir + "/plan.json", meta.dump(2) + "\n");
}

/// The plan's own fields in one line: without what `carve plan` predicted
/// and how it was asked (`predicted`, `planner`), which PLAN.json keeps.
std::string planFieldsLine(const std::string &planJson) {
  try {
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(planJson);
    j.erase("predicted");
    j.erase("planner");
    return j.dump();
  } catch (const nlohmann::json::exception &) {
    return planJson;
  }
}

void printSummary(const CompiledModel &cm, const std::string &out, const PartitionSummary &counts,
                  bool built) {
  const Plan &plan = *cm.plan;
  int64_t kernelCalls = 0, maxArena = 0;
  for (const GeneratedProgram &g : cm.programs)
    kernelCalls += g.numKernelCalls, maxArena = std::max(maxArena, g.arenaBytes);
  outs() << "carve: compiled " << cm.modelName << " for " << plan.worldSize() << " rank"
         << (plan.worldSize() > 1 ? "s" : "") << " (" << planFieldsLine(plan.json)
         << "): " << (built ? out + "/bin/train" : out + "/src (--no-build: bin/train not built)")
         << "\n"
         << "       " << kernelCalls << " kernel calls per "
         << (cm.pipelined ? "micro-batch" : "step") << ", " << cm.programs[0].numBuckets
         << " gradient bucket(s), arena " << format("%.1f", maxArena / 1048576.0) << " MiB per rank"
         << (cm.pipelined ? " (largest)" : "") << "; sources in " << out << "/src\n";
  if (cm.pipelined) {
    outs() << "       pipeline: " << cm.stages.size() << " stage(s) on pp=" << plan.pp << ", "
           << plan.scheduleName() << " schedule, " << cm.microBatches << " micro-batch"
           << (cm.microBatches > 1 ? "es" : "") << " of " << cm.microBatch << "; planned bubble "
           << format("%.1f", cm.plannedBubble * 100) << "% of compute\n";
    for (size_t s = 0; s < cm.stages.size(); ++s) {
      const StageSummary &st = cm.stages[s];
      outs() << "         stage " << s << " (rank " << s % plan.pp << "): ";
      if (st.layers > 0)
        outs() << st.layers << " layer" << (st.layers > 1 ? "s" : "") << ", ";
      outs() << format("%.3g", st.flops) << " FLOP per micro-batch, parameters "
             << format("%.2f", st.paramBytes / 1048576.0) << " MiB, sends "
             << format("%.2f", st.sendBytes / 1048576.0) << " MiB ['" << st.first << "' .. '"
             << st.last << "']\n";
    }
    if (!cm.shared.empty()) {
      outs() << "         gradients summed over stages:";
      for (const auto &x : cm.shared)
        outs() << " " << x.name;
      outs() << "\n";
    }
  }
  if (plan.tp > 1)
    outs() << "       tp=" << plan.tp << (plan.sequenceParallel ? " with sequence parallelism" : "")
           << ": " << counts.opsSplit << " ops split; per step " << counts.allReduce
           << " all-reduce, " << counts.allGather << " all-gather, " << counts.reduceScatter
           << " reduce-scatter, " << counts.allToAll << " all-to-all over tp\n";
}

std::string ranksOf(const CompiledModel &cm, size_t r) {
  const Plan &plan = *cm.plan;
  int group = plan.dp * plan.tp;
  if (plan.ep > 1) {
    // Programs are numbered epRank * pp + ppRank (one pp rank without a pipeline).
    const size_t pp = cm.pipelined ? (size_t)plan.pp : 1, ep = r / pp;
    return (cm.pipelined ? "pipeline rank " + std::to_string(r % pp) + ", " : std::string()) +
           "ep rank " + std::to_string(ep) + " (the ranks whose dp rank is " + std::to_string(ep) +
           " modulo " + std::to_string(plan.ep) + "): its experts";
  }
  if (!cm.pipelined)
    return plan.worldSize() > 1 ? "every rank" : "rank 0";
  if (group > 1)
    return "ranks " + std::to_string(r * group) + "-" + std::to_string((r + 1) * group - 1) +
           " (pipeline rank " + std::to_string(r) + ")";
  return "rank " + std::to_string(r) + " (pipeline rank)";
}

void writeInitialValues(const std::string &path,
                        const std::vector<ImportOptions::InitialValue> &values,
                        const std::map<std::string, bool> &isInt, const std::string &model) {
  std::vector<std::vector<int64_t>> ints; // integer buffers, converted
  ints.reserve(values.size());
  std::vector<carve::rt::SafetensorsEntry> entries;
  for (const auto &v : values) {
    carve::rt::SafetensorsEntry e;
    e.name = v.name;
    e.shape = v.shape;
    if (isInt.count(v.name) && isInt.at(v.name)) {
      ints.emplace_back(v.data.begin(), v.data.end());
      e.dtype = "I64";
      e.data = ints.back().data();
    } else {
      e.dtype = "F32";
      e.data = v.data.data();
    }
    entries.push_back(e);
  }
  std::string error;
  if (!carve::rt::writeSafetensors(path, entries, {{"format", "carve-init"}, {"model", model}},
                                   error))
    fail(error);
}

} // namespace carve
