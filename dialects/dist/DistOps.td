//===- DistOps.td - the dist dialect: meshes, layouts, collectives -*- tablegen -*-===//
//
// The partitioner (compiler/partition) writes per-rank programs in `carve` ops
// on local shapes plus these ops: the device mesh, the layout of every tensor
// along every mesh axis, and the collectives that move between layouts.
//
//===----------------------------------------------------------------------===//

#ifndef DIST_OPS_TD
#define DIST_OPS_TD

include "mlir/IR/OpBase.td"
include "mlir/IR/AttrTypeBase.td"
include "mlir/IR/SymbolInterfaces.td"
include "mlir/Interfaces/SideEffectInterfaces.td"

def Dist_Dialect : Dialect {
  let name = "dist";
  let cppNamespace = "::dist";
  let summary = "Device meshes, tensor layouts and collectives.";
  let description = [{
    A program after partitioning is SPMD: every rank of a mesh runs the same
    function on its local piece of each tensor. `dist.mesh` names the mesh axes
    and their sizes. Along each axis a tensor is, as in OneFlow's SBP and
    GSPMD's tiling, one of

    - `#dist.sbp<R>`: replicated, every rank holds the whole tensor;
    - `#dist.sbp<S d>` / `#dist.sbp<S d x g>`: split along dimension `d`; with
      `x g` the dimension is seen as `[g, n]` and every one of the `g` groups is
      split alike (a fused QKV projection split per section);
    - `#dist.sbp<P sum>` / `#dist.sbp<P max>`: partial, the full value is the
      sum (maximum) over the axis of the ranks' values.

    The collectives convert between layouts along one axis. Types are the
    local (per-rank) types.
  }];
  let useDefaultAttributePrinterParser = 1;
}

def Dist_SbpAttr : AttrDef<Dist_Dialect, "Sbp"> {
  let mnemonic = "sbp";
  let summary = "The layout of a tensor along one mesh axis.";
  let parameters = (ins "::dist::SbpKind":$kind, "int64_t":$dim, "int64_t":$groups);
  let hasCustomAssemblyFormat = 1;
  let extraClassDeclaration = [{
    static SbpAttr replicated(::mlir::MLIRContext *ctx) { return get(ctx, SbpKind::Replicated, -1, 1); }
    static SbpAttr split(::mlir::MLIRContext *ctx, int64_t dim, int64_t groups = 1) {
      return get(ctx, SbpKind::Split, dim, groups);
    }
    static SbpAttr partial(::mlir::MLIRContext *ctx, bool max = false) {
      return get(ctx, max ? SbpKind::PartialMax : SbpKind::PartialSum, -1, 1);
    }
    bool isReplicated() const { return getKind() == SbpKind::Replicated; }
    bool isSplit() const { return getKind() == SbpKind::Split; }
    bool isPartial() const { return getKind() == SbpKind::PartialSum || getKind() == SbpKind::PartialMax; }
    /// "R", "S(2)", "S(2 x 3)", "P(sum)", "P(max)".
    std::string str() const;
  }];
}

class Dist_Op<string mnemonic, list<Trait> traits = []> : Op<Dist_Dialect, mnemonic, traits> {
  let hasVerifier = 1;
}

def Dist_MeshOp : Dist_Op<"mesh", [Symbol]> {
  let summary = "A device mesh: named axes and their sizes.";
  let description = [{
    Ranks are numbered row-major over the axes, the first axis outermost:
    with `axes = ["dp", "tp"], shape = [2, 4]` rank 6 is dp 1, tp 2.

    ```mlir
    dist.mesh @mesh {axes = ["dp", "tp"], shape = array<i64: 2, 4>}
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name, StrArrayAttr:$axes, DenseI64ArrayAttr:$shape);
  let assemblyFormat = "$sym_name attr-dict";
  let extraClassDeclaration = [{
    /// The size of `axis`, or -1 when the mesh has no such axis.
    int64_t axisSize(::llvm::StringRef axis);
  }];
}

class Dist_CollectiveOp<string mnemonic, list<Trait> traits = []> : Dist_Op<mnemonic, traits> {
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
}

def Dist_AllReduceOp : Dist_CollectiveOp<"all_reduce"> {
  let summary = "P(sum|max) -> R: every rank gets the reduction over the axis.";
  let description = [{
    ```mlir
    %r = dist.all_reduce %p {mesh = @mesh, axis = "tp", reduction = "sum"}
           : tensor<4x16x32xf32> -> tensor<4x16x32xf32>
    ```
  }];
  let arguments = (ins AnyRankedTensor:$input, FlatSymbolRefAttr:$mesh, StrAttr:$axis,
                       StrAttr:$reduction);
}

def Dist_AllGatherOp : Dist_CollectiveOp<"all_gather"> {
  let summary = "S(dim x groups) -> R: the pieces concatenated in rank order.";
  let description = [{
    ```mlir
    %r = dist.all_gather %s {mesh = @mesh, axis = "tp", dim = 1 : i64, groups = 1 : i64}
           : tensor<4x8x32xf32> -> tensor<4x16x32xf32>
    ```
  }];
  let arguments = (ins AnyRankedTensor:$input, FlatSymbolRefAttr:$mesh, StrAttr:$axis,
                       I64Attr:$dim, I64Attr:$groups);
}

def Dist_ReduceScatterOp : Dist_CollectiveOp<"reduce_scatter"> {
  let summary = "P(sum|max) -> S(dim x groups): each rank gets its piece of the reduction.";
  let arguments = (ins AnyRankedTensor:$input, FlatSymbolRefAttr:$mesh, StrAttr:$axis,
                       I64Attr:$dim, I64Attr:$groups, StrAttr:$reduction);
}

def Dist_AllToAllOp : Dist_CollectiveOp<"all_to_all"> {
  let summary = "S(src_dim) -> S(dst_dim): re-split along another dimension.";
  let arguments = (ins AnyRankedTensor:$input, FlatSymbolRefAttr:$mesh, StrAttr:$axis,
                       I64Attr:$src_dim, I64Attr:$src_groups, I64Attr:$dst_dim,
                       I64Attr:$dst_groups);
}

def Dist_LocalSplitOp : Dist_CollectiveOp<"local_split", [Pure]> {
  let summary = "R -> S(dim x groups): each rank keeps its piece; no communication.";
  let arguments = (ins AnyRankedTensor:$input, FlatSymbolRefAttr:$mesh, StrAttr:$axis,
                       I64Attr:$dim, I64Attr:$groups);
}

def Dist_BroadcastOp : Dist_CollectiveOp<"broadcast"> {
  let summary = "Every rank of the axis gets the value of rank `root`.";
  let arguments = (ins AnyRankedTensor:$input, FlatSymbolRefAttr:$mesh, StrAttr:$axis,
                       I64Attr:$root);
}

def Dist_SendOp : Dist_Op<"send"> {
  let summary = "Sends a tensor to the rank `offset` steps further along the axis.";
  let description = [{
    Point-to-point transfer for pipelines: the peer is this rank's position on
    `axis` plus `offset`; `tag` pairs the send with its `dist.recv`.
  }];
  let arguments = (ins AnyRankedTensor:$input, FlatSymbolRefAttr:$mesh, StrAttr:$axis,
                       I64Attr:$offset, I64Attr:$tag);
  let assemblyFormat = "$input attr-dict `:` type($input)";
}

def Dist_RecvOp : Dist_Op<"recv"> {
  let summary = "Receives a tensor from the rank `offset` steps further along the axis.";
  let arguments = (ins FlatSymbolRefAttr:$mesh, StrAttr:$axis, I64Attr:$offset, I64Attr:$tag);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "attr-dict `:` type($result)";
}

#endif // DIST_OPS_TD
