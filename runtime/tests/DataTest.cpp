//===- DataTest.cpp - token and tensor data loading -----------------------===//

#include "carve/rt/data.h"
#include "carve/rt/safetensors.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <unistd.h>
#include <vector>

using namespace carve::rt;

namespace {

TensorSpec spec(const char *name, DType dtype, std::vector<int64_t> dims, int64_t offset) {
  TensorSpec s{};
  s.name = name;
  s.dtype = dtype;
  s.rank = static_cast<int>(dims.size());
  s.numel = 1;
  for (size_t i = 0; i < dims.size(); ++i) {
    s.dims[i] = dims[i];
    s.numel *= dims[i];
  }
  s.offset = offset;
  s.gradOffset = -1;
  s.stateOffset[0] = s.stateOffset[1] = -1;
  return s;
}

/// A program with just the fields the loaders read.
struct TestProgram {
  Program p{};
  std::vector<TensorSpec> inputs;
  TestProgram(DataKind kind, int64_t globalBatch, int dp, int64_t seqLen,
              std::vector<TensorSpec> ins)
      : inputs(std::move(ins)) {
    p.name = "program0";
    p.dp = dp;
    p.worldSize = dp;
    p.globalBatch = globalBatch;
    p.localBatch = globalBatch / dp;
    p.seqLen = seqLen;
    p.dataKind = kind;
    p.numInputs = static_cast<int>(inputs.size());
    p.inputs = inputs.data();
  }
};

class DataTest : public ::testing::Test {
protected:
  void TearDown() override {
    for (const std::string &f : created)
      std::remove(f.c_str());
  }
  std::string file(const std::string &name, const void *bytes, size_t n) {
    std::string p = "/tmp/carve-data-" + std::to_string(::getpid()) + "-" + name;
    std::ofstream f(p, std::ios::binary);
    f.write(static_cast<const char *>(bytes), static_cast<std::streamsize>(n));
    created.push_back(p);
    return p;
  }
  std::string int32Tokens(const std::string &name, int64_t n) {
    std::vector<int32_t> t(n);
    for (int64_t i = 0; i < n; ++i)
      t[i] = static_cast<int32_t>(3 * i + 1);
    return file(name, t.data(), t.size() * 4);
  }
  /// Loading through `program` fails with an error containing `cause`.
  void expectError(const Program &program, int dpRank, const std::string &path, TokenFileType type,
                   const std::string &cause) {
    std::string error;
    EXPECT_EQ(openDataLoader(program, dpRank, path, type, error), nullptr);
    EXPECT_NE(error.find(cause), std::string::npos) << "error: " << error;
  }
  std::vector<std::string> created;
};

TEST_F(DataTest, TokenOffsetFormula) {
  // o = ((k*B + j) * T) mod (N - T - 1), worked by hand for N = 100, T = 10
  // (modulus 89), B = 4.
  EXPECT_EQ(tokenOffset(0, 0, 4, 10, 100), 0);
  EXPECT_EQ(tokenOffset(0, 3, 4, 10, 100), 30);
  EXPECT_EQ(tokenOffset(2, 1, 4, 10, 100), 1);  // 90 mod 89
  EXPECT_EQ(tokenOffset(5, 3, 4, 10, 100), 52); // 230 mod 89
  // The smallest file: N = T + 2 leaves offsets 0 only.
  EXPECT_EQ(tokenOffset(7, 3, 4, 10, 12), 0);
  // No overflow: (2^40 * 2^10) * 2^12 = 2^62, and 2^62 mod 1000003 = 837674.
  EXPECT_EQ(tokenOffset(int64_t(1) << 40, 0, 1024, 4096, 1000003 + 4096 + 1), 837674);
}

TEST_F(DataTest, TokensGoToInputsAndShiftedTargets) {
  const int64_t batch = 4, seq = 5, numTokens = 60;
  std::string path = int32Tokens("tok32", numTokens);
  // dp = 2: rank 1 takes global sequences 2 and 3.
  TestProgram tp(
      DataKind::Tokens, batch, 2, seq,
      {spec("idx", DType::I64, {2, seq}, 0), spec("targets", DType::I64, {2, seq}, 128)});
  std::string error;
  auto loader = openDataLoader(tp.p, 1, path, TokenFileType::Int32, error);
  ASSERT_NE(loader, nullptr) << error;
  EXPECT_NE(loader->describe().find("60 int32 tokens"), std::string::npos);

  std::vector<char> arena(256, 0);
  const auto *ids = reinterpret_cast<const int64_t *>(arena.data());
  const auto *targets = reinterpret_cast<const int64_t *>(arena.data() + 128);
  for (int64_t k : {0, 3, 11}) {
    ASSERT_TRUE(loader->load(k, arena.data(), error)) << error;
    for (int64_t i = 0; i < 2; ++i) {
      int64_t j = 2 + i;
      int64_t o = ((k * batch + j) * seq) % (numTokens - seq - 1); // modulus 54
      for (int64_t t = 0; t < seq; ++t) {
        EXPECT_EQ(ids[i * seq + t], 3 * (o + t) + 1) << "k=" << k << " j=" << j;
        EXPECT_EQ(targets[i * seq + t], 3 * (o + t + 1) + 1) << "k=" << k << " j=" << j;
      }
    }
  }
  // By hand: step 3, j = 3: o = (15 * 5) mod 54 = 21, ids start at 3*21+1 = 64.
  ASSERT_TRUE(loader->load(3, arena.data(), error));
  EXPECT_EQ(ids[seq], 64);
  EXPECT_EQ(targets[seq], 67);
}

TEST_F(DataTest, RanksTogetherSeeTheGlobalBatch) {
  const int64_t batch = 4, seq = 3, numTokens = 40;
  std::string path = int32Tokens("tokdp", numTokens);
  TestProgram one(
      DataKind::Tokens, batch, 1, seq,
      {spec("idx", DType::I64, {batch, seq}, 0), spec("targets", DType::I64, {batch, seq}, 128)});
  TestProgram four(
      DataKind::Tokens, batch, 4, seq,
      {spec("idx", DType::I64, {1, seq}, 0), spec("targets", DType::I64, {1, seq}, 64)});
  std::string error;
  auto whole = openDataLoader(one.p, 0, path, TokenFileType::Int32, error);
  ASSERT_NE(whole, nullptr) << error;
  std::vector<char> all(256);
  ASSERT_TRUE(whole->load(6, all.data(), error));
  for (int r = 0; r < 4; ++r) {
    auto part = openDataLoader(four.p, r, path, TokenFileType::Int32, error);
    ASSERT_NE(part, nullptr) << error;
    std::vector<char> mine(128);
    ASSERT_TRUE(part->load(6, mine.data(), error));
    EXPECT_EQ(std::memcmp(mine.data(), all.data() + r * seq * 8, seq * 8), 0) << "rank " << r;
    EXPECT_EQ(std::memcmp(mine.data() + 64, all.data() + 128 + r * seq * 8, seq * 8), 0);
  }
}

TEST_F(DataTest, Uint16AndInt32Values) {
  uint16_t u[6] = {0, 1, 32768, 65535, 7, 9};
  int32_t s[6] = {-5, 1, 70000, 3, 4, 5};
  std::string p16 = file("u16", u, sizeof u), p32 = file("i32", s, sizeof s);
  TestProgram tp(DataKind::Tokens, 1, 1, 4,
                 {spec("idx", DType::I64, {1, 4}, 0), spec("targets", DType::I64, {1, 4}, 64)});
  std::string error;
  std::vector<char> arena(128);
  const auto *ids = reinterpret_cast<const int64_t *>(arena.data());
  auto l16 = openDataLoader(tp.p, 0, p16, TokenFileType::UInt16, error);
  ASSERT_NE(l16, nullptr) << error;
  ASSERT_TRUE(l16->load(0, arena.data(), error));
  EXPECT_EQ(ids[2], 32768);
  EXPECT_EQ(ids[3], 65535);
  auto l32 = openDataLoader(tp.p, 0, p32, TokenFileType::Int32, error);
  ASSERT_NE(l32, nullptr) << error;
  ASSERT_TRUE(l32->load(0, arena.data(), error));
  EXPECT_EQ(ids[0], -5);
  EXPECT_EQ(ids[2], 70000);
}

TEST_F(DataTest, Int64TokensAndTheirWidth) {
  // What np.array(ids).tofile() writes: int64. Read as int64 they are the ids;
  // read as int32 (every second token 0) the file is refused naming the dtype.
  int64_t wide[20];
  int32_t narrow[20];
  for (int k = 0; k < 20; ++k)
    wide[k] = narrow[k] = (k * 7) % 50 + 1;
  wide[3] = narrow[3] = 70000; // above uint16, below int32
  std::string p64 = file("i64", wide, sizeof wide), p32 = file("i32w", narrow, sizeof narrow);
  TestProgram tp(DataKind::Tokens, 1, 1, 4,
                 {spec("idx", DType::I64, {1, 4}, 0), spec("targets", DType::I64, {1, 4}, 64)});
  std::string error;
  std::vector<char> arena(128);
  const auto *ids = reinterpret_cast<const int64_t *>(arena.data());
  auto l64 = openDataLoader(tp.p, 0, p64, TokenFileType::Int64, error);
  ASSERT_NE(l64, nullptr) << error;
  ASSERT_TRUE(l64->load(0, arena.data(), error));
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 8);
  EXPECT_EQ(ids[3], 70000);
  expectError(tp.p, 0, p64, TokenFileType::Int32,
              p64 + ": every second int32 token is 0, as when int64 ids are read as int32");
  expectError(tp.p, 0, p64, TokenFileType::Int32, "pass --data-dtype int64");
  // int32 ids read as uint16: the ids below 2^16 leave every second token 0.
  int32_t small[20];
  for (int k = 0; k < 20; ++k)
    small[k] = k + 1;
  expectError(tp.p, 0, file("i32s", small, sizeof small), TokenFileType::UInt16,
              "every second uint16 token is 0, as when int32 ids are read as uint16; pass "
              "--data-dtype int32");
  // A safetensors file given as tokens is named as the wrong format.
  std::string header = "{\"x\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[0,16]}}";
  std::string st;
  for (int j = 0; j < 8; ++j)
    st += (char)((header.size() >> (8 * j)) & 0xff);
  st += header + std::string(16, '\0');
  expectError(tp.p, 0, file("st", st.data(), st.size()), TokenFileType::Int32,
              "this is a safetensors file (tensor data), but the model reads flat token files");
  // An int32 file with 70000 among its ids is not mistaken for anything else.
  auto l32 = openDataLoader(tp.p, 0, p32, TokenFileType::Int32, error);
  ASSERT_NE(l32, nullptr) << error;
}

TEST_F(DataTest, TokenFileErrors) {
  TestProgram tp(DataKind::Tokens, 2, 1, 8,
                 {spec("idx", DType::I64, {2, 8}, 0), spec("targets", DType::I64, {2, 8}, 128)});
  expectError(tp.p, 0, "/tmp/carve-no-such-file", TokenFileType::Int32,
              "token file /tmp/carve-no-such-file: cannot open");
  std::string empty = file("empty", "", 0);
  expectError(tp.p, 0, empty, TokenFileType::Int32, empty + ": empty file");
  std::string odd = file("odd", "abcdef", 6);
  expectError(tp.p, 0, odd, TokenFileType::Int32,
              "6 bytes is not a whole number of int32 tokens (4 bytes each)");
  std::string odd16 = file("odd16", "abc", 3);
  expectError(tp.p, 0, odd16, TokenFileType::UInt16, "not a whole number of uint16 tokens");
  std::string shortFile = int32Tokens("short", 9);
  expectError(tp.p, 0, shortFile, TokenFileType::Int32,
              "9 int32 tokens is too short for sequence length 8 (needs at least 10 tokens)");
  std::string error;
  EXPECT_NE(openDataLoader(tp.p, 0, int32Tokens("ten", 10), TokenFileType::Int32, error), nullptr)
      << error;
}

TEST_F(DataTest, ProgramsThatDoNotFitTheData) {
  std::string path = int32Tokens("prog", 100);
  TestProgram three(DataKind::Tokens, 2, 1, 4,
                    {spec("idx", DType::I64, {2, 4}, 0), spec("targets", DType::I64, {2, 4}, 64),
                     spec("extra", DType::I64, {2, 4}, 128)});
  expectError(three.p, 0, path, TokenFileType::Int32, "needs exactly two inputs");
  TestProgram f32(DataKind::Tokens, 2, 1, 4,
                  {spec("idx", DType::F32, {2, 4}, 0), spec("targets", DType::I64, {2, 4}, 64)});
  expectError(f32.p, 0, path, TokenFileType::Int32, "token input 'idx' must be I64 [2, 4]");
  TestProgram batch(DataKind::Tokens, 4, 2, 4,
                    {spec("idx", DType::I64, {4, 4}, 0), spec("targets", DType::I64, {4, 4}, 64)});
  expectError(batch.p, 0, path, TokenFileType::Int32, "first dimension should be the local batch");
  expectError(batch.p, 2, path, TokenFileType::Int32, "dp rank 2 outside a dp group of 2");
}

TEST_F(DataTest, TensorsSliceStepsAndRows) {
  // x: F32 [S=3, B=4, 2], y: I64 [3, 4]; value encodes (step, row, col).
  std::vector<float> x(3 * 4 * 2);
  std::vector<int64_t> y(3 * 4);
  for (int s = 0; s < 3; ++s)
    for (int b = 0; b < 4; ++b) {
      y[s * 4 + b] = 100 * s + 10 * b;
      for (int c = 0; c < 2; ++c)
        x[(s * 4 + b) * 2 + c] = 100.0f * s + 10.0f * b + c;
    }
  std::string path = "/tmp/carve-data-" + std::to_string(::getpid()) + "-t.safetensors";
  created.push_back(path);
  std::string error;
  ASSERT_TRUE(writeSafetensors(
      path, {{"x", "F32", {3, 4, 2}, x.data()}, {"y", "I64", {3, 4}, y.data()}}, {}, error))
      << error;

  TestProgram tp(DataKind::Tensors, 4, 2, 0,
                 {spec("x", DType::F32, {2, 2}, 0), spec("y", DType::I64, {2}, 64)});
  auto loader = openDataLoader(tp.p, 1, path, TokenFileType::Int32, error);
  ASSERT_NE(loader, nullptr) << error;
  std::vector<char> arena(128);
  const auto *xs = reinterpret_cast<const float *>(arena.data());
  const auto *ys = reinterpret_cast<const int64_t *>(arena.data() + 64);
  // Step 4 uses index 4 mod 3 = 1; dp rank 1 of 2 takes rows 2 and 3.
  ASSERT_TRUE(loader->load(4, arena.data(), error)) << error;
  EXPECT_EQ(xs[0], 120.0f);
  EXPECT_EQ(xs[1], 121.0f);
  EXPECT_EQ(xs[2], 130.0f);
  EXPECT_EQ(xs[3], 131.0f);
  EXPECT_EQ(ys[0], 120);
  EXPECT_EQ(ys[1], 130);
  ASSERT_TRUE(loader->load(2, arena.data(), error)) << error;
  EXPECT_EQ(xs[0], 220.0f);
  EXPECT_EQ(ys[1], 230);
}

TEST_F(DataTest, TensorErrorsNameTheTensor) {
  float v[24] = {};
  int64_t w[24] = {};
  std::string path = "/tmp/carve-data-" + std::to_string(::getpid()) + "-e.safetensors";
  created.push_back(path);
  TestProgram tp(DataKind::Tensors, 4, 1, 0,
                 {spec("x", DType::F32, {4, 2}, 0), spec("y", DType::I64, {4}, 64)});
  auto write = [&](std::vector<SafetensorsEntry> t) {
    std::string error;
    ASSERT_TRUE(writeSafetensors(path, t, {}, error)) << error;
  };
  write({{"x", "F32", {3, 4, 2}, v}});
  expectError(tp.p, 0, path, TokenFileType::Int32,
              "no tensor 'y' for the model input of that name (the file has: x)");
  write({{"x", "F32", {3, 4, 2}, v}, {"y", "F32", {3, 4}, v}});
  expectError(tp.p, 0, path, TokenFileType::Int32, "tensor 'y' is F32, the model input needs I64");
  write({{"x", "F32", {3, 2, 4}, v}, {"y", "I64", {3, 4}, w}});
  expectError(tp.p, 0, path, TokenFileType::Int32,
              "tensor 'x' has shape [3, 2, 4], expected [S, 4, 2]");
  // x sample-major ([N, 2]) makes the file sample-major: y must be [N] too.
  write({{"x", "F32", {4, 2}, v}, {"y", "I64", {3, 4}, w}});
  expectError(tp.p, 0, path, TokenFileType::Int32,
              "tensor 'y' has shape [3, 4], expected [N] (sample-major: N samples of shape [])");
  write({{"x", "F32", {3, 4, 2}, v}, {"y", "I64", {2, 4}, w}});
  expectError(tp.p, 0, path, TokenFileType::Int32,
              "tensor 'y' holds 2 batches, tensor 'x' holds 3");
  write({{"x", "F32", {3, 2}, v}, {"y", "I64", {3}, w}});
  expectError(tp.p, 0, path, TokenFileType::Int32, "3 samples is fewer than one global batch of 4");
  expectError(tp.p, 0, "/tmp/carve-no-such-file", TokenFileType::Int32,
              "data file /tmp/carve-no-such-file: cannot open");
}

TEST_F(DataTest, TargetsOutsideTheClassesAreRefusedAtStartUp) {
  float v[32] = {};
  int64_t y[8] = {0, 3, 1, 2, -100, 2, 1, 0};
  std::string path = "/tmp/carve-data-" + std::to_string(::getpid()) + "-t.safetensors";
  created.push_back(path);
  TensorSpec target = spec("y", DType::I64, {4}, 64);
  target.classes = 4;
  target.hasIgnore = true;
  target.ignoreIndex = -100;
  TestProgram tp(DataKind::Tensors, 4, 1, 0, {spec("x", DType::F32, {4, 2}, 0), target});
  auto write = [&](std::vector<int64_t> dims) {
    std::string error;
    ASSERT_TRUE(writeSafetensors(path, {{"x", "F32", {8, 2}, v}, {"y", "I64", dims, y}}, {}, error))
        << error;
  };
  // In range, or the ignore index: opens.
  write({8});
  std::string error;
  EXPECT_NE(openDataLoader(tp.p, 0, path, TokenFileType::Int32, error), nullptr) << error;
  // Sample 5 names class 4 of 4; one line names the file, the tensor and the sample.
  y[5] = 4;
  write({8});
  expectError(tp.p, 0, path, TokenFileType::Int32,
              "data file " + path +
                  ": tensor 'y' sample 5: target 4 is outside the model's 4 classes (0 to 3, or "
                  "the ignore index -100)");
  // Without an ignore index, -100 is outside too.
  y[5] = 2;
  tp.inputs[1].hasIgnore = false;
  write({8});
  expectError(tp.p, 0, path, TokenFileType::Int32,
              "tensor 'y' sample 4: target -100 is outside the model's 4 classes (0 to 3)");
  // Batch-major [S, B]: the batch and the element.
  tp.inputs[1].hasIgnore = true;
  y[6] = -1;
  {
    std::string e;
    ASSERT_TRUE(writeSafetensors(path, {{"x", "F32", {2, 4, 2}, v}, {"y", "I64", {2, 4}, y}}, {},
                                 e))
        << e;
  }
  expectError(tp.p, 0, path, TokenFileType::Int32,
              "tensor 'y' batch 1, element 2: target -1 is outside the model's 4 classes");
}

TEST(ShuffleTest, EveryEpochIsAPermutation) {
  for (uint64_t n : {1ull, 2ull, 3ull, 5ull, 16ull, 17ull, 100ull, 1000ull, 4097ull}) {
    std::vector<uint64_t> e0(n), e1(n);
    for (uint64_t i = 0; i < n; ++i) {
      e0[i] = shuffleIndex(i, n, 7, 0);
      e1[i] = shuffleIndex(i, n, 7, 1);
    }
    std::vector<uint64_t> s0 = e0, s1 = e1;
    std::sort(s0.begin(), s0.end());
    std::sort(s1.begin(), s1.end());
    for (uint64_t i = 0; i < n; ++i) {
      ASSERT_EQ(s0[i], i) << "n=" << n;
      ASSERT_EQ(s1[i], i) << "n=" << n;
    }
    if (n >= 16) {
      EXPECT_NE(e0, e1) << "epochs 0 and 1 of " << n << " items in the same order";
      std::vector<uint64_t> other(n);
      for (uint64_t i = 0; i < n; ++i)
        other[i] = shuffleIndex(i, n, 8, 0);
      EXPECT_NE(e0, other) << "seeds 7 and 8 give the same order of " << n << " items";
    }
  }
  // The values docs/data.md's Python function gives.
  const uint64_t epoch0[10] = {1, 0, 2, 6, 7, 4, 9, 8, 3, 5};
  const uint64_t epoch5[10] = {7, 4, 3, 8, 6, 1, 9, 2, 0, 5};
  for (uint64_t i = 0; i < 10; ++i) {
    EXPECT_EQ(shuffleIndex(i, 10, 1234, 0), epoch0[i]);
    EXPECT_EQ(shuffleIndex(i, 10, 1234, 5), epoch5[i]);
  }
  EXPECT_EQ(shuffleIndex(123456, 1000003, 42, 7), 269695u);
}

TEST_F(DataTest, TokenWindowsFollowDocumentsAndFiles) {
  // Two files: a = 0..20 with an end-of-text id 99 after token 9 (documents
  // [0, 10] and [11, 20]), b = 200..208 (9 tokens). T = 4: windows of 5.
  std::vector<int32_t> a, b;
  for (int i = 0; i < 21; ++i)
    a.push_back(i == 10 ? 99 : i);
  for (int i = 0; i < 9; ++i)
    b.push_back(200 + i);
  std::string pa = file("wa.bin", a.data(), a.size() * 4);
  std::string pb = file("wb.bin", b.data(), b.size() * 4);
  TestProgram tp(DataKind::Tokens, 2, 1, 4,
                 {spec("idx", DType::I64, {2, 4}, 0), spec("targets", DType::I64, {2, 4}, 64)});
  DataOptions o;
  o.paths = pa + "," + pb;
  o.eotId = 99;
  std::string error;
  auto loader = openDataLoader(tp.p, 0, o, error);
  ASSERT_NE(loader, nullptr) << error;
  // Documents: [0,11) 11 tokens -> 2 windows (0, 4); [11,21) 10 tokens -> 2
  // windows (11, 15); file b: 9 tokens -> 2 windows (0, 4). W = 6, 3 steps.
  EXPECT_EQ(loader->stepsPerEpoch(), 3);
  EXPECT_EQ(loader->source(0, 0), pa + " token 0");
  EXPECT_EQ(loader->source(0, 1), pa + " token 4");
  EXPECT_EQ(loader->source(1, 0), pa + " token 11");
  EXPECT_EQ(loader->source(1, 1), pa + " token 15");
  EXPECT_EQ(loader->source(2, 0), pb + " token 0");
  EXPECT_EQ(loader->source(2, 1), pb + " token 4");
  EXPECT_EQ(loader->source(3, 0), pa + " token 0"); // epoch 1, in order
  std::vector<char> arena(128);
  const auto *ids = reinterpret_cast<const int64_t *>(arena.data());
  const auto *next = reinterpret_cast<const int64_t *>(arena.data() + 64);
  ASSERT_TRUE(loader->load(1, arena.data(), error)) << error;
  EXPECT_EQ(ids[0], 11);
  EXPECT_EQ(next[3], 15);
  EXPECT_EQ(ids[4], 15);
  EXPECT_EQ(next[7], 19);
  // Shuffled: each epoch reads every window once.
  o.shuffle = true;
  o.seed = 3;
  loader = openDataLoader(tp.p, 0, o, error);
  ASSERT_NE(loader, nullptr) << error;
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<std::string> seen;
    for (int k = 0; k < 3; ++k)
      for (int j = 0; j < 2; ++j)
        seen.push_back(loader->source(epoch * 3 + k, j));
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(std::unique(seen.begin(), seen.end()), seen.end()) << "a window read twice";
  }
  // Globs, sorted; a glob that matches nothing.
  o = DataOptions();
  o.paths = "/tmp/carve-data-" + std::to_string(::getpid()) + "-w?.bin";
  loader = openDataLoader(tp.p, 0, o, error);
  ASSERT_NE(loader, nullptr) << error;
  EXPECT_NE(loader->describe().find(pa + ", " + pb + ": 30 int32 tokens"), std::string::npos)
      << loader->describe();
  o.paths = "/tmp/carve-data-none-*.bin";
  EXPECT_EQ(openDataLoader(tp.p, 0, o, error), nullptr);
  EXPECT_NE(error.find("--data: no file matches '/tmp/carve-data-none-*.bin'"), std::string::npos)
      << error;
  // The wrapped cut reads across the files' boundary.
  o.paths = pa + "," + pb;
  loader = openDataLoader(tp.p, 0, o, error);
  ASSERT_NE(loader, nullptr) << error;
  ASSERT_TRUE(loader->load(2, arena.data(), error)) << error; // o = 16 and 20 mod 25
  EXPECT_EQ(ids[4], 20);
  EXPECT_EQ(ids[5], 200);
  EXPECT_EQ(next[7], 203);
  // Too few windows for one batch.
  o.paths = pb;
  o.eotId = 203; // documents of 4 and 5 tokens: one window
  EXPECT_EQ(openDataLoader(tp.p, 0, o, error), nullptr);
  EXPECT_NE(error.find("1 window of 5 tokens (9 tokens in 2 documents) is fewer than one "
                       "global batch of 2 sequences"),
            std::string::npos)
      << error;
}

TEST_F(DataTest, SamplesAreShuffledPerEpoch) {
  // x: F32 [N=6, 2], y: I64 [6]; sample i holds 10*i.
  std::vector<float> x(12);
  std::vector<int64_t> y(6);
  for (int i = 0; i < 6; ++i) {
    y[i] = 10 * i;
    x[2 * i] = 10.0f * i;
    x[2 * i + 1] = 10.0f * i + 1;
  }
  std::string path = "/tmp/carve-data-" + std::to_string(::getpid()) + "-s.safetensors";
  created.push_back(path);
  std::string error;
  ASSERT_TRUE(writeSafetensors(path, {{"x", "F32", {6, 2}, x.data()}, {"y", "I64", {6}, y.data()}},
                               {}, error))
      << error;
  TestProgram tp(DataKind::Tensors, 4, 2, 0,
                 {spec("x", DType::F32, {2, 2}, 0), spec("y", DType::I64, {2}, 64)});
  DataOptions o;
  o.paths = path;
  o.shuffle = true;
  o.seed = 11;
  auto loader = openDataLoader(tp.p, 1, o, error);
  ASSERT_NE(loader, nullptr) << error;
  EXPECT_EQ(loader->stepsPerEpoch(), 1); // 6 samples, batches of 4
  std::vector<char> arena(128);
  const auto *xs = reinterpret_cast<const float *>(arena.data());
  const auto *ys = reinterpret_cast<const int64_t *>(arena.data() + 64);
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(loader->load(step, arena.data(), error)) << error;
    for (int r = 0; r < 2; ++r) {
      const int64_t want = static_cast<int64_t>(shuffleIndex(2 + r, 6, 11, step));
      EXPECT_EQ(ys[r], 10 * want);
      EXPECT_EQ(xs[2 * r + 1], 10.0f * want + 1);
      EXPECT_EQ(loader->source(step, 2 + r), path + " sample " + std::to_string(want));
    }
  }
  // Batch-major files are never shuffled.
  std::vector<float> bx(16);
  std::vector<int64_t> by(8);
  ASSERT_TRUE(writeSafetensors(
      path, {{"x", "F32", {2, 4, 2}, bx.data()}, {"y", "I64", {2, 4}, by.data()}}, {}, error))
      << error;
  EXPECT_EQ(openDataLoader(tp.p, 0, o, error), nullptr);
  EXPECT_NE(error.find("batch-major tensors [S, B, ...] are never shuffled"), std::string::npos)
      << error;
}

} // namespace
