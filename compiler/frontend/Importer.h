//===- Importer.h - the ONNX importer's shared state (private) ------------===//
//
// Private to compiler/frontend: the Importer that turns one ONNX model into
// `func.func @forward`, and what its files share. The public entry points are
// in OnnxImporter.h.
//
// Who does what:
//   OnnxImporter.cpp         the public entry points; the walk over the graph
//                            (run, importNode), outputs, verify and raise
//   ReadModel.cpp            protobuf and opset checks, initializer checks,
//                            external data, tensors read into HostTensor
//   ImportArguments.cpp      parameters, buffers and constants (--frozen);
//                            graph inputs and parameters as arguments
//   NodeValues.cpp           a node's inputs, outputs and attributes; constants
//                            materialized as carve.constant
//   HostFold.cpp             nodes whose inputs are all known, evaluated on
//                            the host
//   ImportOps.cpp            the per-op import table: elementwise,
//                            contractions, normalizations, losses
//   ImportConvolution.cpp    convolutions, pooling, resizing
//   ImportDataMovement.cpp   reshapes, transposes, slices, splits, concats,
//                            gathers and expands
//   ImportCustomOp.cpp       custom-domain nodes described by --rules
//   Bounded.cpp              NonZero at a static bound, the values it sizes,
//                            and ScatterElements (index_add_) back out
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_COMPILER_FRONTEND_IMPORTER_H
#define CARVE_COMPILER_FRONTEND_IMPORTER_H

#include "compiler/frontend/HostTensor.h"
#include "compiler/frontend/OnnxImporter.h"
#include "dialects/carve/Shapes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinTypes.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/ADT/StringSet.h"

#include "onnx/onnx_pb.h"

#include <optional>
#include <string>
#include <vector>

namespace carve::frontend {

/// One value of the graph as the importer knows it: an SSA value, a constant,
/// or both (a constant that has been materialized).
struct Slot {
  mlir::Value value;
  std::optional<HostTensor> constant;
  const onnx::TensorProto *init = nullptr; ///< a not-yet-used initializer
  bool isParam = false;
  /// A transposed copy of the parameter of this name (a tied weight the
  /// exporter's constant folding copied): read as its transpose.
  std::string transposeOf;
  /// An ONNX sequence (SplitToSequence's): its tensors, which SequenceAt
  /// picks by a constant position.
  std::optional<std::vector<mlir::Value>> sequence;
};

/// Imports one model; every failure throws from `fail` with a one-line cause.
class Importer {
public:
  Importer(mlir::MLIRContext &ctx, const ImportOptions &opts, std::string displayName,
           std::string baseDir)
      : ctx(ctx), b(&ctx), opts(opts), file(std::move(displayName)), baseDir(std::move(baseDir)) {}

  mlir::OwningOpRef<mlir::ModuleOp> run(llvm::StringRef bytes);
  /// Whether the model's metadata named its parameters (else every float
  /// initializer was taken as one).
  bool paramsFromMetadata() const { return haveParamMetadata; }
  /// Parses `bytes` and reads the facts readOnnxStateFacts returns.
  void readStateFacts(llvm::StringRef bytes, const std::vector<std::string> &wanted,
                      OnnxStateFacts &out);
  /// 2-D float initializers that are exactly another's transpose (the copy a
  /// plain export's constant folding keeps of a tied weight, `h @ wte.T`):
  /// (copy, original) pairs, the original the one the module named.
  std::vector<std::pair<std::string, std::string>> transposedTies();

private:
  // Reading and validation.
  void parse(llvm::StringRef bytes);
  void checkInitializer(const onnx::TensorProto &t);
  HostTensor loadTensor(const onnx::TensorProto &t, const std::string &what);
  /// Appends the initializer to ImportOptions::initialValues when asked.
  void recordInitialValue(const onnx::TensorProto &t, const std::string &what,
                          const std::string &name = "");
  std::string readExternal(const onnx::TensorProto &t, int64_t bytes, const std::string &what);
  /// Validates an initializer's external data entry; returns the file path.
  std::string externalPath(const onnx::TensorProto &t, int64_t bytes, const std::string &what,
                           int64_t &offset);
  mlir::Type mlirType(int onnxType, const std::string &what);
  void classifyInitializers();
  void makeArguments();

  // Nodes.
  void importNode(const onnx::NodeProto &n, int index);
  /// Evaluates the ops that never need their inputs' data (Shape, Size,
  /// Constant, ConstantOfShape); returns true if `n` is one of them.
  bool foldWithoutData(const onnx::NodeProto &n);
  bool tryFold(const onnx::NodeProto &n);
  /// Builds the carve op(s) of `n` through the per-op import table.
  void build(const onnx::NodeProto &n);
  /// One family of the import table each (ImportOps.cpp, ImportDataMovement.cpp).
  void buildElementwise(const onnx::NodeProto &n);
  void buildContraction(const onnx::NodeProto &n);
  mlir::Value einsum(const std::string &equation);
  void buildNormalization(const onnx::NodeProto &n);
  void buildReshape(const onnx::NodeProto &n);
  void buildDataMovement(const onnx::NodeProto &n);
  void buildConvolution(const onnx::NodeProto &n);
  void buildLoss(const onnx::NodeProto &n);
  void buildRecurrent(const onnx::NodeProto &n);
  void buildCustom(const onnx::NodeProto &n, const CustomOpRule &rule);

  // The batch dimension through the graph (BatchTracking.cpp), when a rank
  // imports its share of a static export's batch (ImportOptions::batch <
  // globalBatch): every value that carries the graph inputs' batch knows which
  // of its dimensions holds it, so the constant shapes that hard-code the
  // model's batch are rescaled where the batch is, not by a pattern.
  bool localBatch() const {
    return opts.batch > 0 && opts.globalBatch > opts.batch && opts.globalBatch % opts.batch == 0;
  }
  /// Where `v` holds the batch: its dimension, and the product of the
  /// factors of that dimension outside the batch (1: the batch leads it;
  /// T in a [T*B, E] reshape); dim -1: nowhere.
  struct BatchAt {
    int64_t dim = -1, outer = 1;
  };
  BatchAt batchAt(mlir::Value v) const;
  /// Rescales the entry of a Reshape's constant target shape `req` where the
  /// batch of `input` (shape `in`) lands; returns where the result holds it
  /// (dim -1: the input holds no batch).
  /// Entries marked in `local` (HostTensor::local) already hold the share.
  BatchAt rescaleBatch(std::vector<int64_t> &req, llvm::ArrayRef<uint8_t> local,
                       llvm::ArrayRef<int64_t> in, mlir::Value input, bool allowZero);
  /// Tracks the batch through the ops created after `before` (null: from the
  /// block's start), by their partition annotations.
  void trackBatch(mlir::Operation *before);
  /// trackBatch's walk for the dimensions `dims` records, of size `size`.
  void trackDims(mlir::Operation *before, llvm::DenseMap<mlir::Value, BatchAt> &dims,
                 int64_t size);
  /// Values computed from a constant that holds the export's whole batch with
  /// the same values for every sample (the positions of `torch.ones(B, T)`, a
  /// token-type buffer expanded to B), and where: where such a value meets
  /// this rank's share at a broadcasting op, its share is taken (a slice).
  llvm::DenseMap<mlir::Value, BatchAt> wholeDims;
  /// Records in wholeDims the first dimension of the materialized constant
  /// `t` (value `v`) that has the whole batch's size and the same values
  /// along it.
  void markWhole(mlir::Value v, const HostTensor &t);
  /// The entry of a constant target shape that creates the batch where an
  /// operand without it broadcasts: the one entry equal to the global batch
  /// over a size-1 (or absent) dimension of `in`, the leading one when there
  /// are several; -1 when there is none.
  int64_t createdBatchEntry(llvm::ArrayRef<int64_t> target, llvm::ArrayRef<int64_t> in) const;
  llvm::DenseMap<mlir::Value, BatchAt> batchDims;
  /// Whether `v` is computed from a graph input (not from parameters and
  /// constants alone).
  bool dependsOnInputs(mlir::Value v);
  llvm::DenseMap<mlir::Value, bool> fromInputs;
  /// Dropout nodes imported so far (each one's `node`: its mask's stream).
  int64_t dropoutNodes = 0;
  /// A broadcasting elementwise node with a constant operand that holds the
  /// model's whole batch where another operand holds this rank's share (the
  /// exporter folded `zeros_like(mask)` to a constant): `n` with that input
  /// renamed to the constant's share (the same values for every sample, so
  /// any share is every rank's), or nullopt when there is nothing to share.
  std::optional<onnx::NodeProto> shareConstants(const onnx::NodeProto &n);

  // Values whose size NonZero decides at run time (Bounded.cpp): held at
  // the bound, with the dimension that holds it and the count of real rows.
  struct Bounded {
    int64_t dim = -1;
    mlir::Value count;  ///< f32 scalar: how many leading rows are real
    std::string origin; ///< the NonZero node
    /// A rank's share of a static batch: the length of the NonZero input's
    /// dimension that holds the batch (-1: none) and its BatchAt::outer, so
    /// that a scatter into a table of the model's whole batch is rescaled.
    int64_t batchLen = -1, batchOuter = 1;
  };
  const Bounded *boundedOf(mlir::Value v) const;
  void buildNonZero(const onnx::NodeProto &n);
  void buildScatterElements(const onnx::NodeProto &n);
  /// A node whose inputs are all constants but which has no host kernel
  /// (Einsum, Sin, Softmax, ...): the ops built for it after `before` are
  /// evaluated with the reference interpreter and its outputs become
  /// constants, so that constant subgraphs of any supported op fold at import
  /// (GPT-J's rotary tables: an einsum of ranges, then sin and Tile).
  void foldBuilt(const onnx::NodeProto &n, mlir::Operation *before);
  /// ScatterND with constant indices (ImportScatter.cpp).
  void buildScatterND(const onnx::NodeProto &n);
  /// Under a rank's share of the batch: checks that the scatter keeps each
  /// sample's writes within it, cuts the indices `idx` (and a constant data,
  /// into `dataShare`) of a static export to the share; the data's batch
  /// dimension (-1: none).
  int64_t shareBatch(HostTensor &idx, std::optional<HostTensor> &dataShare);
  void defineScattered(mlir::Value result, int64_t batchDim);
  /// Under a rank's share of the batch: values a Slice cut from part of the
  /// batch dimension, with why; an op other than Shape/Size reading one is
  /// refused (importNode).
  llvm::DenseMap<mlir::Value, std::string> partialBatch;
  /// `v` with the padding rows of its bounded dimension zeroed (v itself
  /// when it is not bounded).
  mlir::Value maskBounded(mlir::Value v);
  /// Carries boundedness through the ops created after `before`, by their
  /// partition annotations; fails for an op that would read the padding.
  void trackBounded(mlir::Operation *before);
  llvm::DenseMap<mlir::Value, Bounded> bounded;
  llvm::DenseSet<mlir::Operation *> boundedExits; ///< made to read the padding safely
  // Input access.
  bool hasInput(int k) const;
  Slot &slot(int k);
  mlir::Value val(int k);
  const HostTensor *cst(int k);
  const HostTensor &needConst(int k, llvm::StringRef what);
  llvm::SmallVector<int64_t> shapeOf(int k);
  ElemKind kindOf(int k);
  mlir::Value materialize(const HostTensor &t, llvm::StringRef name);
  void define(int outIdx, mlir::Value v);
  void defineConst(int outIdx, HostTensor t);

  // Attributes.
  const onnx::AttributeProto *attr(llvm::StringRef name) const;
  int64_t attrInt(llvm::StringRef name, int64_t dflt) const;
  float attrFloat(llvm::StringRef name, float dflt) const;
  std::string attrString(llvm::StringRef name, llvm::StringRef dflt) const;
  std::optional<std::vector<int64_t>> attrInts(llvm::StringRef name) const;

  // Helpers.
  [[noreturn]] void fail(const std::string &msg) const;
  /// Fails for an op outside the import table.
  [[noreturn]] void failUnsupported() const;
  int64_t normAxis(int64_t axis, int64_t rank) const;
  mlir::RankedTensorType tensorType(llvm::ArrayRef<int64_t> shape, mlir::Type elt) {
    for (int64_t d : shape)
      if (d < 0)
        fail("shape " + formatShape(shape) + " has a negative dimension");
    return mlir::RankedTensorType::get(shape, elt);
  }
  mlir::Type eltOf(mlir::Value v) {
    return mlir::cast<mlir::RankedTensorType>(v.getType()).getElementType();
  }
  llvm::ArrayRef<int64_t> shp(mlir::Value v) {
    return mlir::cast<mlir::RankedTensorType>(v.getType()).getShape();
  }
  void expect(const ShapeOrError &s) const {
    if (!s.ok())
      fail(s.error);
  }
  /// Defined in ImportOps.cpp, its only user.
  template <typename OpTy>
  mlir::Value binary(mlir::Value l, mlir::Value r, bool boolResult = false);
  mlir::Value reshape(mlir::Value v, llvm::ArrayRef<int64_t> shape);
  llvm::SmallVector<int64_t> reduceAxes(const onnx::NodeProto &n, int64_t rank);
  void normalizeSlice(llvm::ArrayRef<int64_t> shape, llvm::SmallVectorImpl<int64_t> &starts,
                      llvm::SmallVectorImpl<int64_t> &ends, llvm::SmallVectorImpl<int64_t> &steps);
  bool outputUsed(int k) const;

  mlir::MLIRContext &ctx;
  mlir::OpBuilder b;
  const ImportOptions &opts;
  std::string file, baseDir;
  onnx::ModelProto model;
  int64_t opset = 0;
  llvm::StringMap<Slot> env;
  /// BatchNormalization nodes in inference mode (running statistics): noted.
  int inferenceBatchNorms = 0;
  std::string firstInferenceBatchNorm;
  llvm::StringSet<> paramNames, bufferNames, frozenNames;
  /// Parameters the exporter merged into another of equal value (eval-mode
  /// exports), reached through an Identity node: name -> the kept one.
  std::vector<std::pair<std::string, const onnx::TensorProto *>> unmerged;
  llvm::StringSet<> unmergedNames;
  /// Transposed copies of tied weights: copy -> the parameter it copies.
  llvm::StringMap<std::string> tiedCopies;
  bool haveParamMetadata = false;
  llvm::StringMap<unsigned> useCount;
  mlir::func::FuncOp func;
  mlir::Block *entry = nullptr;
  llvm::SmallVector<mlir::DictionaryAttr> argAttrs;
  const onnx::NodeProto *node = nullptr;
  std::string nodeLabel; ///< the node's name, or OpType_index when it has none
  mlir::Location loc = mlir::UnknownLoc::get(&ctx);
};

} // namespace carve::frontend

#endif // CARVE_COMPILER_FRONTEND_IMPORTER_H
