//===- HostTensorTest.cpp - constant folding kernels used at import -------===//

#include "compiler/frontend/HostTensor.h"

#include <gtest/gtest.h>

using namespace carve;

static HostTensor ints(llvm::ArrayRef<int64_t> shape, std::vector<int64_t> v) {
  return HostTensor::ints(ElemKind::I64, shape, std::move(v));
}

TEST(HostTensor, ShapeArithmetic) {
  // The exporter's `view(B, T, H, -1)` chain: gather dims, concat with constants.
  HostTensor shape = HostTensor::vec({4, 16, 32});
  HostTensor b = hostGather(shape, ints({}, {0}), 0);
  EXPECT_EQ(b.shape.size(), 0u);
  EXPECT_EQ(b.i[0], 4);
  HostTensor t = hostGather(shape, ints({}, {-2}), 0);
  EXPECT_EQ(t.i[0], 16);
  HostTensor cat = hostConcat({&shape, &shape}, 0);
  EXPECT_EQ(cat.toInts(), (std::vector<int64_t>{4, 16, 32, 4, 16, 32}));
  EXPECT_EQ(hostBinary("Div", ints({}, {7}), ints({}, {2})).i[0], 3);
  EXPECT_EQ(hostBinary("Div", ints({}, {-7}), ints({}, {2})).i[0], -3);
  EXPECT_THROW(hostBinary("Div", ints({}, {1}), ints({}, {0})), HostError);
  EXPECT_THROW(hostGather(shape, ints({}, {3}), 0), HostError);
}

TEST(HostTensor, CausalMaskFromTrilu) {
  HostTensor ones = HostTensor::floats(ElemKind::F32, {3, 3}, std::vector<double>(9, 1.0));
  HostTensor lower = hostTrilu(ones, 0, /*upper=*/false);
  EXPECT_EQ(lower.f, (std::vector<double>{1, 0, 0, 1, 1, 0, 1, 1, 1}));
  HostTensor masked = hostBinary("Equal", lower, HostTensor::floats(ElemKind::F32, {}, {0}));
  EXPECT_EQ(masked.kind, ElemKind::Bool);
  EXPECT_EQ(masked.i, (std::vector<int64_t>{0, 1, 1, 0, 0, 1, 0, 0, 0}));
}

TEST(HostTensor, SliceTransposeExpand) {
  HostTensor x = ints({2, 3}, {0, 1, 2, 3, 4, 5});
  EXPECT_EQ(hostTranspose(x, {1, 0}).i, (std::vector<int64_t>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(hostSlice(x, {0, 1}, {2, 3}, {1, 1}).i, (std::vector<int64_t>{1, 2, 4, 5}));
  // A negative step flips (start 2, end -1 means "through index 0").
  EXPECT_EQ(hostSlice(x, {0, 2}, {2, -1}, {1, -1}).i,
            (std::vector<int64_t>{2, 1, 0, 5, 4, 3}));
  HostTensor e = hostExpand(ints({3}, {7, 8, 9}), {2, 3});
  EXPECT_EQ(e.i, (std::vector<int64_t>{7, 8, 9, 7, 8, 9}));
  EXPECT_EQ(hostWhere(HostTensor::ints(ElemKind::Bool, {3}, {1, 0, 1}), ints({3}, {1, 2, 3}),
                      ints({}, {0}))
                .i,
            (std::vector<int64_t>{1, 0, 3}));
}

TEST(HostTensor, RangeReduceCast) {
  HostTensor r = hostRange(ints({}, {0}), ints({}, {10}), ints({}, {3}));
  EXPECT_EQ(r.i, (std::vector<int64_t>{0, 3, 6, 9}));
  HostTensor x = ints({2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(hostReduce("ReduceSum", x, {1}, false).i, (std::vector<int64_t>{6, 15}));
  EXPECT_EQ(hostReduce("ReduceProd", x, {0, 1}, true).shape,
            (llvm::SmallVector<int64_t>{1, 1}));
  HostTensor f = HostTensor::floats(ElemKind::F32, {3}, {1.7, -1.7, 0.0});
  EXPECT_EQ(hostCast(f, ElemKind::I64).i, (std::vector<int64_t>{1, -1, 0}));
  EXPECT_EQ(hostCast(f, ElemKind::Bool).i, (std::vector<int64_t>{1, 1, 0}));
}

// T5's causal mask (LessOrEqual of two ranges), GPT-J's rotary tables (Tile,
// GatherElements): import-time evaluation on constants.
TEST(HostTensor, CausalMaskFromLessOrEqual) {
  HostTensor row = ints({1, 3}, {0, 1, 2}), col = ints({3, 1}, {0, 1, 2});
  HostTensor le = hostBinary("LessOrEqual", row, col);
  EXPECT_EQ(le.kind, ElemKind::Bool);
  EXPECT_EQ(le.i, (std::vector<int64_t>{1, 0, 0, 1, 1, 0, 1, 1, 1}));
  HostTensor ge = hostBinary("GreaterOrEqual", HostTensor::floats(ElemKind::F32, {2}, {1.0, 2.0}),
                             HostTensor::floats(ElemKind::F32, {}, {2.0}));
  EXPECT_EQ(ge.i, (std::vector<int64_t>{0, 1}));
}

// ScatterND: T5's shift of the targets (a slice assignment), each reduction
// with a repeated slice, the checks.
TEST(HostTensor, ScatterND) {
  HostTensor data = ints({2, 3}, {1, 2, 3, 4, 5, 6});
  // y[:, 1:] = data[:, :-1]; y[:, 0] = 9 as tuples (b, t) into zeros.
  HostTensor zeros = ints({2, 3}, {0, 0, 0, 0, 0, 0});
  HostTensor shifted = hostScatterND(zeros, ints({2, 2, 2}, {0, 1, 0, 2, 1, 1, 1, 2}),
                                     ints({2, 2}, {1, 2, 4, 5}), "none");
  EXPECT_EQ(shifted.i, (std::vector<int64_t>{0, 1, 2, 0, 4, 5}));
  // Whole rows (k = 1), a negative index.
  EXPECT_EQ(hostScatterND(data, ints({1, 1}, {-1}), ints({1, 3}, {7, 8, 9}), "none").i,
            (std::vector<int64_t>{1, 2, 3, 7, 8, 9}));
  // Row 0 twice: add, mul, max and min combine both in order.
  HostTensor twice = ints({2, 1}, {0, 0});
  HostTensor upd = ints({2, 3}, {10, 0, -5, 1, 7, 2});
  EXPECT_EQ(hostScatterND(data, twice, upd, "add").i,
            (std::vector<int64_t>{12, 9, 0, 4, 5, 6}));
  EXPECT_EQ(hostScatterND(data, twice, upd, "mul").i,
            (std::vector<int64_t>{10, 0, -30, 4, 5, 6}));
  EXPECT_EQ(hostScatterND(data, twice, upd, "max").i, (std::vector<int64_t>{10, 7, 3, 4, 5, 6}));
  EXPECT_EQ(hostScatterND(data, twice, upd, "min").i,
            (std::vector<int64_t>{1, 0, -5, 4, 5, 6}));
  // Undefined in ONNX, and malformed.
  EXPECT_THROW(hostScatterND(data, twice, upd, "none"), HostError);
  EXPECT_THROW(hostScatterND(data, ints({1, 1}, {2}), ints({1, 3}, {0, 0, 0}), "none"),
               HostError);
  EXPECT_THROW(hostScatterND(data, ints({1, 1}, {0}), ints({1, 2}, {0, 0}), "none"), HostError);
  EXPECT_THROW(hostScatterND(data, ints({1, 3}, {0, 0, 0}), ints({1}, {0}), "none"), HostError);
  EXPECT_THROW(hostScatterND(data, ints({1, 1}, {0}), ints({1, 3}, {0, 0, 0}), "xor"), HostError);
  HostTensor f = HostTensor::floats(ElemKind::F32, {2}, {1.5, 2.5});
  EXPECT_EQ(hostScatterND(f, ints({1, 1}, {1}), HostTensor::floats(ElemKind::F32, {1}, {4.0}),
                          "mul")
                .f,
            (std::vector<double>{1.5, 10.0}));
}

TEST(HostTensor, TileAndGatherElements) {
  HostTensor x = ints({2, 2}, {1, 2, 3, 4});
  HostTensor t = hostTile(x, {2, 3});
  EXPECT_EQ(t.shape, (llvm::SmallVector<int64_t>{4, 6}));
  EXPECT_EQ(t.i, (std::vector<int64_t>{1, 2, 1, 2, 1, 2, 3, 4, 3, 4, 3, 4,
                                       1, 2, 1, 2, 1, 2, 3, 4, 3, 4, 3, 4}));
  EXPECT_EQ(hostTile(x, {1, 0}).size(), 0);
  EXPECT_THROW(hostTile(x, {2}), HostError);
  // torch.gather(x, 1, [[1, 0], [0, 0]]) and along dimension 0, a negative index.
  EXPECT_EQ(hostGatherElements(x, ints({2, 2}, {1, 0, 0, 0}), 1).i,
            (std::vector<int64_t>{2, 1, 3, 3}));
  EXPECT_EQ(hostGatherElements(x, ints({1, 2}, {-1, 0}), 0).i, (std::vector<int64_t>{3, 2}));
  EXPECT_THROW(hostGatherElements(x, ints({2, 2}, {2, 0, 0, 0}), 1), HostError);
  EXPECT_THROW(hostGatherElements(x, ints({2}, {0, 0}), 1), HostError);
}
