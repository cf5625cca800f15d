//===- Tables.cpp - the runtime's tensor tables and Program records -------===//
//
// The end of every generated source: the TensorSpec tables of inputs and
// parameters (tp pieces, ZeRO chunks, arena offsets) and the `Program` that
// the runtime looks up (runtime/include/carve/rt/program.h); and programs.cpp,
// which maps ranks to programs.
//
//===----------------------------------------------------------------------===//

#include "compiler/codegen/Generator.h"

#include <algorithm>

using namespace mlir;

namespace carve {
namespace codegen {

namespace {
/// The runtime's table `name` (TensorSpec rows, program.h).
void emitTensorRows(llvm::raw_ostream &os, const char *name, const std::vector<TensorRow> &rs) {
  os << "const TensorSpec " << name << "[] = {\n";
  for (const TensorRow &r : rs) {
    os << "    {\"" << r.name << "\", DType::" << r.dtype << ", " << r.shape.size() << ", "
       << dims(r.shape) << ", " << r.numel << ", " << r.offset << ", "
       << (r.trainable ? "true" : "false") << ", " << r.gradOffset << ", {" << r.state[0] << ", "
       << r.state[1] << "}, " << dims(r.global) << ", " << r.tpDim << ", " << r.tpGroups << ", "
       << r.zeroChunk << ", " << (r.paramZero ? "true" : "false") << ", "
       << (r.stateZero ? "true" : "false");
    if (r.masterOffset >= 0 || r.gradDtype != "F32" || r.classes > 0)
      os << ", " << r.masterOffset << ", DType::" << r.copyDtype;
    if (r.gradDtype != "F32" || r.classes > 0)
      os << ", DType::" << r.gradDtype;
    if (r.classes > 0)
      os << ", " << r.classes << ", " << (r.hasIgnore ? "true" : "false") << ", "
         << r.ignoreIndex;
    os << "},\n";
  }
  if (rs.empty())
    os << "    {\"\", DType::F32, 0, {}, 0, 0, false, -1, {-1, -1}},\n";
  os << "};\n";
}
} // namespace

int64_t tokenVocab(func::FuncOp fn, const std::string &input, int tp) {
  int64_t vocab = 0;
  fn.walk([&](GatherOp g) {
    auto idx = dyn_cast<BlockArgument>(g->getOperand(1));
    auto table = dyn_cast<BlockArgument>(g->getOperand(0));
    if (!idx || !table || idx.getOwner() != &fn.getBody().front())
      return;
    auto name = fn.getArgAttrOfType<StringAttr>(idx.getArgNumber(), kInputAttr);
    if (!name || name.getValue() != input)
      return;
    int64_t rows = cast<RankedTensorType>(table.getType()).getDimSize(0);
    if (auto d = fn.getArgAttrOfType<DictionaryAttr>(table.getArgNumber(), kLayoutAttr))
      if (auto l = d.getAs<dist::SbpAttr>("tp"); l && l.isSplit() && l.getDim() == 0)
        rows *= tp;
    vocab = std::max(vocab, rows);
  });
  return vocab;
}

int dropoutNodes(func::FuncOp fn) {
  std::set<int64_t> nodes;
  fn.walk([&](DropoutOp d) { nodes.insert(d.nodeIndex()); });
  return (int)nodes.size();
}

/// The tensor tables and the `Program` of a rank's source (program.h); with
/// `pipe`, the pipeline fields too. Closes the anonymous namespace.
void emitProgramTables(llvm::raw_ostream &os, const EmitOptions &opts, const GeneratedProgram &out,
                       const std::vector<TensorRow> &inputs, const std::vector<TensorRow> &params,
                       const PipelineCodegenOptions *pipe) {
  os << "// One row per tensor (TensorSpec, carve/rt/program.h): name, dtype, rank, dims,\n"
        "// elements, arena byte offset, trainable, gradient offset, optimizer state offsets\n"
        "// {exp_avg or momentum, exp_avg_sq}, the model's full dims, the dimension split over\n"
        "// tp (-1: none), its groups, ZeRO chunk (elements per dp rank; 0: none), the arena\n"
        "// holds only this rank's chunk of the parameter (ZeRO-3), of the optimizer state;\n"
        "// under bf16/fp16 a trainable parameter's row ends with its fp32 master's offset and\n"
        "// the dtype of the 16-bit copy at the arena offset; a classifier's targets end with\n"
        "// the number of classes, whether an ignore index applies, and which.\n";
  emitTensorRows(os, "kInputs", inputs);
  emitTensorRows(os, "kParams", params);
  int64_t seq = 0;
  bool tokens = inputs.size() == 2 && inputs[0].dtype == "I64" && inputs[1].dtype == "I64" &&
                inputs[0].shape.size() == 2 && inputs[0].shape == inputs[1].shape;
  if (tokens)
    seq = inputs[0].shape[1];
  const OptimizerConfig &o = opts.optimizer;
  bool adam = o.kind == "adamw";
  int slots = adam ? 2 : o.momentum != 0 ? 1 : 0;
  auto escape = [](const std::string &x) {
    std::string e;
    for (char c : x)
      e += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
    return e;
  };
  const std::string &P = opts.programName;
  const int p = pipe ? pipe->pp : 1;
  // The compiled hyperparameters: a run's train --lr ... override them.
  os << "\n// The compiled hyperparameters (optim.h): lr, min lr ratio, warm-up and decay steps,\n"
        "// schedule, weight decay, beta1, beta2, eps, clip (0: none); train --lr ... override.\n"
     << "const Hyperparameters kHyper = {" << number(o.lr, false) << ", "
     << number(o.minLrRatio, false) << ", " << o.warmupSteps << ", " << o.decaySteps
     << ", Schedule::Cosine, " << number(o.effectiveWeightDecay(), false) << ", "
     << number(o.beta1, false) << ", " << number(o.beta2, false) << ", " << number(o.eps, false)
     << ", " << number(std::max(0.0, o.clipGradNorm), false) << ", 0};\n";
  os << "\n} // namespace\n\nextern const Program " << P << " = {\n"
     << "    \"" << P << "\", \"" << escape(opts.modelName) << "\",\n"
     << "    /*worldSize=*/" << opts.dp * opts.tp * p << ", /*dp=*/" << opts.dp << ",\n"
     << "    /*globalBatch=*/" << opts.globalBatch << ", /*localBatch=*/"
     << opts.globalBatch / std::max(1, opts.dp) << ", /*seqLen=*/" << seq << ",\n"
     << "    DataKind::" << (tokens ? "Tokens" : "Tensors") << ",\n"
     << "    " << inputs.size() << ", kInputs, " << params.size() << ", kParams,\n"
     << "    /*arenaBytes=*/" << out.arenaBytes << ",\n"
     << "    OptimizerKind::" << (adam ? "AdamW" : "SGD") << ", /*numStateSlots=*/" << slots
     << ",\n"
     << "    \"" << escape(o.describe()) << "\",\n"
     << "    step,\n"
     << "    /*tp=*/" << opts.tp << ", /*zeroStage=*/" << (opts.dp > 1 ? opts.zero : 0) << ",\n"
     << "    /*paramBytes=*/" << out.paramBytes << ", /*gradBytes=*/" << out.gradBytes
     << ", /*stateBytes=*/" << out.stateBytes << ",\n";
  os << "    /*pp=*/" << p << ", /*ppRank=*/" << (pipe ? pipe->rank : 0) << ", /*numMicroBatches=*/"
     << (pipe ? opts.numMicroBatches : 1) << ", /*activationBytes=*/" << out.activationBytes
     << ",\n";
  os << "    /*device=*/" << (opts.cuda() ? "&kCudaTarget" : "nullptr") << ", /*precision=*/\""
     << opts.precision << "\",\n";
  os << "    /*hyper=*/&kHyper, /*vocab=*/" << (tokens ? out.vocab : 0) << ",\n";
  os << "    /*evaluate=*/evaluate,\n";
  os << "    /*ep=*/" << opts.ep << ", /*epRank=*/" << opts.epRank << ",\n";
  os << "    /*dropoutNodes=*/" << out.dropoutNodes << ",\n";
  os << "};\n";
}

/// The runtime's tables of inputs and parameters (tp pieces, ZeRO chunks,
/// offsets). `microBatches` inputs lie one after another in the arena.
/// An integer input that a cross-entropy reads as its targets (itself or a
/// view of it): the classes it may name, the smallest over its readers, and
/// the ignore index where every reader has the same one.
void Generator::targetClasses(BlockArgument a, TensorRow &row) {
  if (!typeOf(a).getElementType().isInteger(64) && !typeOf(a).getElementType().isInteger(32))
    return;
  bool first = true;
  fn.walk([&](CrossEntropyOp ce) {
    if (aliasRoot(ce.getOperand(1)) != a)
      return;
    auto logits = typeOf(ce.getOperand(0));
    int64_t classes = logits.getDimSize(logits.getRank() - 1);
    if (ce->hasAttr(kShardedRowsAttr))
      classes *= opts.tp; // vocab-parallel: this rank holds 1/tp of the classes
    auto ig = ce->getAttrOfType<IntegerAttr>("ignore_index");
    if (first) {
      row.classes = classes;
      row.hasIgnore = (bool)ig;
      row.ignoreIndex = ig ? ig.getInt() : 0;
      first = false;
      return;
    }
    row.classes = std::min(row.classes, classes);
    if (!ig || !row.hasIgnore || ig.getInt() != row.ignoreIndex)
      row.hasIgnore = false, row.ignoreIndex = 0;
  });
}

void Generator::buildTables(int64_t microBatches) {
  for (BlockArgument a : fn.getArguments()) {
    unsigned i = a.getArgNumber();
    const Buffer &b = buffers[bufferOf.lookup(a)];
    if (b.region != Region::Param && b.region != Region::Input)
      continue;
    TensorRow row;
    auto nameAttr = fn.getArgAttrOfType<StringAttr>(i, kParamAttr);
    if (!nameAttr)
      nameAttr = fn.getArgAttrOfType<StringAttr>(i, kBufferAttr);
    if (!nameAttr)
      nameAttr = fn.getArgAttrOfType<StringAttr>(i, kInputAttr);
    row.name = nameAttr.getValue().str();
    std::string c;
    int sz;
    elementInfo(typeOf(a).getElementType(), c, row.dtype, sz);
    row.shape.assign(typeOf(a).getShape().begin(), typeOf(a).getShape().end());
    row.global = row.shape;
    if (auto d = fn.getArgAttrOfType<DictionaryAttr>(i, kLayoutAttr))
      if (auto l = d.getAs<dist::SbpAttr>("tp"); l && l.isSplit()) {
        row.tpDim = (int)l.getDim();
        row.tpGroups = l.getGroups();
        row.global[l.getDim()] *= opts.tp;
      }
    row.numel = typeOf(a).getNumElements();
    if (b.region == Region::Input && microBatches > 1) {
      // The arena holds all micro-batches of this rank's share, one after another.
      row.shape[0] *= microBatches;
      row.global[0] *= microBatches;
      row.numel *= microBatches;
    }
    row.offset = b.offset;
    if (b.region == Region::Input)
      targetClasses(a, row);
    for (GradSlot &g : grads)
      if (g.param == i) {
        row.trainable = true;
        row.gradOffset = zero >= 2 ? buffers[shardOf[i]].offset : buffers[g.buffer].offset;
        if (tailGrad16(g))
          row.gradDtype = opts.precision == "fp16" ? "F16" : "BF16";
        row.state[0] = stateOf[i][0];
        row.state[1] = stateOf[i][1];
        if (auto m = masterOf.find(i); m != masterOf.end()) {
          row.masterOffset = m->second;
          row.copyDtype = row.dtype;
          row.dtype = "F32";
        }
        if (zero) {
          row.zeroChunk = chunkOf[i];
          row.paramZero = zero == 3;
          row.stateZero = true;
        }
      }
    (b.region == Region::Param ? paramRows : inputRows).push_back(row);
  }
}

} // namespace codegen

std::string generateProgramTable(const std::vector<std::string> &programNames,
                                 const std::vector<int> &rankToProgram) {
  std::string s;
  llvm::raw_string_ostream os(s);
  os << "// programs.cpp: which program each rank runs (generated by `carve compile`).\n\n"
     << "#include \"carve/rt/program.h\"\n\nusing carve::rt::Program;\n\n";
  for (const std::string &p : programNames)
    os << "extern const Program " << p << ";\n";
  os << "\nextern \"C\" int carve_world_size() { return " << rankToProgram.size() << "; }\n\n"
     << "extern \"C\" const Program *carve_program_for_rank(int rank) {\n"
     << "  static const Program *const table[] = {";
  for (size_t r = 0; r < rankToProgram.size(); ++r)
    os << (r ? ", " : "") << "&" << programNames[rankToProgram[r]];
  os << "};\n  if (rank < 0 || rank >= " << rankToProgram.size()
     << ")\n    return nullptr;\n  return table[rank];\n}\n";
  return s;
}

} // namespace carve
