//===- fake_program.cpp - a hand-written rank program for testing main() --===//
//
// Stands in for the sources `carve compile` generates, so that train_main,
// the data loaders, checkpoints and the MPI backend can be tested end to end
// (run_fake.py) before and independently of the compiler. Three variants,
// chosen at start-up by CARVE_FAKE_MODEL:
//
//   linreg (default)  DataKind::Tensors. Inputs x: F32 [B/D, 3], y: F32 [B/D];
//                     parameters linear.weight [3], linear.bias [1]; buffer
//                     steps_seen (I64 [1], counts steps). B = 8.
//                     loss = mean over the global batch of (x.w + b - y)^2,
//                     SGD with momentum 0.9, lr 0.05.
//   tokens            DataKind::Tokens. Inputs idx, targets: I64 [B/D, T];
//                     parameter table.weight [64]. B = 4, T = 8.
//                     loss = mean over the global batch of (w[idx] - targets/64)^2,
//                     AdamW (lr 0.1, betas 0.9/0.999, eps 1e-8, weight decay 0.01).
//                     A token outside [0, 64) is a kernel error (`fatal`).
//   comm              linreg, with a check of every Communicator operation on the
//                     dp group before each step.
//   shard             A dp x tp plan (CARVE_FAKE_DP=D, tp = N / D) whose tensors
//                     are split over tp and partitioned by ZeRO; linreg's inputs.
//                     Its step changes nothing and checks that every rank holds
//                     exactly its piece of each parameter and optimizer state
//                     (see kShardTensors), so a run must save back what it loaded.
//
// CARVE_FAKE_WORLD=N makes it a plan of N ranks (default 1), all data-parallel
// except for shard. Each rank computes its rows' share of the loss and
// gradients and sums them over the dp group with one all-reduce, as generated
// code does.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/comm.h"
#include "carve/rt/program.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

using namespace carve::rt;

namespace {

constexpr int64_t kFeatures = 3;
constexpr int64_t kVocab = 64;

/// A bump allocator for the arena, 64-byte aligned like the compiler's.
struct ArenaLayout {
  int64_t next = 0;
  int64_t take(int64_t bytes) {
    int64_t at = next;
    next += (bytes + 63) / 64 * 64;
    return at;
  }
};

TensorSpec makeSpec(const char *name, DType dtype, std::initializer_list<int64_t> dims,
                    ArenaLayout &arena, bool trainable = false, int stateSlots = 0) {
  TensorSpec s{};
  s.name = name;
  s.dtype = dtype;
  s.rank = 0;
  s.numel = 1;
  for (int64_t d : dims) {
    s.dims[s.rank++] = d;
    s.numel *= d;
  }
  int64_t bytes = s.numel * (dtype == DType::I64 || dtype == DType::F64 ? 8 : 4);
  s.offset = arena.take(bytes);
  s.trainable = trainable;
  s.gradOffset = trainable ? arena.take(bytes) : -1;
  s.stateOffset[0] = trainable && stateSlots > 0 ? arena.take(bytes) : -1;
  s.stateOffset[1] = trainable && stateSlots > 1 ? arena.take(bytes) : -1;
  return s;
}

Program program;
TensorSpec inputs[2];
TensorSpec params[4];
int64_t reduceOffset = 0; // scratch: [loss, gradients...] for the all-reduce

template <class T> T *at(StepContext &ctx, int64_t offset) {
  return reinterpret_cast<T *>(ctx.arena + offset);
}

/// Sums the packed loss and gradients over the dp group and returns the norm
/// of the gradient part.
float reduce(StepContext &ctx, float *buf, int64_t n) {
  CommHandle h = ctx.dpComm->allReduceAsync(buf, n, CommType::F32, ReduceOp::Sum);
  ctx.dpComm->wait(h);
  double sq = 0;
  for (int64_t i = 1; i < n; ++i)
    sq += double(buf[i]) * buf[i];
  return static_cast<float>(std::sqrt(sq));
}

void linregStep(StepContext &ctx) {
  const float *x = at<float>(ctx, inputs[0].offset);
  const float *y = at<float>(ctx, inputs[1].offset);
  float *w = at<float>(ctx, params[0].offset);
  float *b = at<float>(ctx, params[1].offset);
  float *red = at<float>(ctx, reduceOffset);
  std::memset(red, 0, sizeof(float) * (kFeatures + 2));
  float inv = 1.0f / static_cast<float>(program.globalBatch);
  for (int64_t i = 0; i < program.localBatch; ++i) {
    float r = b[0] - y[i];
    for (int64_t f = 0; f < kFeatures; ++f)
      r += x[i * kFeatures + f] * w[f];
    red[0] += r * r * inv;
    for (int64_t f = 0; f < kFeatures; ++f)
      red[1 + f] += 2 * r * inv * x[i * kFeatures + f];
    red[1 + kFeatures] += 2 * r * inv;
  }
  // The all-reduce sums each rank's share of the global mean.
  ctx.gradNorm = reduce(ctx, red, kFeatures + 2);
  ctx.loss = red[0];
  ctx.lr = 0.05f;
  for (int p = 0; p < 2; ++p) {
    float *param = at<float>(ctx, params[p].offset);
    float *grad = at<float>(ctx, params[p].gradOffset);
    float *buf = at<float>(ctx, params[p].stateOffset[0]);
    for (int64_t i = 0; i < params[p].numel; ++i) {
      grad[i] = red[1 + (p == 0 ? i : kFeatures)];
      buf[i] = 0.9f * buf[i] + grad[i];
      param[i] -= ctx.lr * buf[i];
    }
  }
  at<int64_t>(ctx, params[2].offset)[0] += 1;
}

/// CARVE_FAKE_MODEL=comm: before each linreg step, exercises every
/// Communicator operation on the dp group and fails (`fatal`) on a wrong value.
void commCheckStep(StepContext &ctx) {
  Communicator &c = *ctx.dpComm;
  const int r = c.rank(), n = c.size();
  int wrong = 0;
  // Three all-reduces in flight at once, completed out of order.
  static float f[1000];
  double d[3];
  int64_t i[5];
  for (int j = 0; j < 1000; ++j)
    f[j] = static_cast<float>(r + j);
  for (double &v : d)
    v = (r + 1) * 0.5;
  for (int j = 0; j < 5; ++j)
    i[j] = 10 * r + j;
  CommHandle hf = c.allReduceAsync(f, 1000, CommType::F32, ReduceOp::Sum);
  CommHandle hd = c.allReduceAsync(d, 3, CommType::F64, ReduceOp::Max);
  CommHandle hi = c.allReduceAsync(i, 5, CommType::I64, ReduceOp::Sum);
  c.wait(hi);
  c.wait(hf);
  c.wait(hd);
  c.wait(CommHandle{});
  for (int j = 0; j < 1000; ++j)
    wrong += f[j] != static_cast<float>(n * j + n * (n - 1) / 2);
  for (double v : d)
    wrong += v != n * 0.5;
  for (int j = 0; j < 5; ++j)
    wrong += i[j] != 10 * n * (n - 1) / 2 + n * j;
  // Broadcast from the last rank.
  char b[16];
  std::memset(b, r, sizeof b);
  c.broadcast(b, sizeof b, n - 1);
  for (char v : b)
    wrong += v != static_cast<char>(n - 1);
  // An uneven split, ordered by a reversed key: {0} and {n-1, ..., 1}.
  std::unique_ptr<Communicator> sub = c.split(r == 0 ? 0 : 1, -r);
  wrong += sub->size() != (r == 0 ? 1 : n - 1);
  wrong += sub->rank() != (r == 0 ? 0 : n - 1 - r);
  int64_t one = 1;
  sub->allReduce(&one, 1, CommType::I64, ReduceOp::Sum);
  wrong += one != sub->size();
  c.barrier();
  if (wrong)
    fatal("communicator check: %d wrong values on rank %d of %d", wrong, r, n);
  linregStep(ctx);
}

void tokensStep(StepContext &ctx) {
  const int64_t *idx = at<int64_t>(ctx, inputs[0].offset);
  const int64_t *tgt = at<int64_t>(ctx, inputs[1].offset);
  float *w = at<float>(ctx, params[0].offset);
  float *red = at<float>(ctx, reduceOffset);
  std::memset(red, 0, sizeof(float) * (kVocab + 1));
  int64_t n = program.localBatch * program.seqLen;
  float inv = 1.0f / static_cast<float>(program.globalBatch * program.seqLen);
  for (int64_t i = 0; i < n; ++i) {
    if (idx[i] < 0 || idx[i] >= kVocab)
      fatal("fake tokens model: token %lld outside the vocabulary of %lld",
            static_cast<long long>(idx[i]), static_cast<long long>(kVocab));
    float r = w[idx[i]] - static_cast<float>(tgt[i]) / kVocab;
    red[0] += r * r * inv;
    red[1 + idx[i]] += 2 * r * inv;
  }
  ctx.gradNorm = reduce(ctx, red, kVocab + 1);
  ctx.loss = red[0];
  ctx.lr = 0.1f;
  // torch.optim.AdamW, with its scalar coefficients in double.
  const double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, wd = 0.01;
  int64_t t = ctx.step + 1;
  double bc1 = 1 - std::pow(beta1, double(t)), bc2 = 1 - std::pow(beta2, double(t));
  float *g = at<float>(ctx, params[0].gradOffset);
  float *m = at<float>(ctx, params[0].stateOffset[0]);
  float *v = at<float>(ctx, params[0].stateOffset[1]);
  for (int64_t i = 0; i < kVocab; ++i) {
    g[i] = red[1 + i];
    w[i] *= static_cast<float>(1 - ctx.lr * wd);
    m[i] += (g[i] - m[i]) * static_cast<float>(1 - beta1);
    v[i] = v[i] * static_cast<float>(beta2) + static_cast<float>(1 - beta2) * g[i] * g[i];
    float denom = std::sqrt(v[i]) / static_cast<float>(std::sqrt(bc2)) + static_cast<float>(eps);
    w[i] -= static_cast<float>(ctx.lr / bc1) * m[i] / denom;
  }
}

//===--- shard: tensor parallelism and ZeRO --------------------------------===//

/// One tensor of the shard model. The files hold element G (flat index in
/// the global shape) of tensor `id` as 1000 * id + G, and of its optimizer
/// state slot k as that plus 0.25 * (k + 1); run_fake.py writes the same.
struct ShardTensor {
  const char *name;
  DType dtype;
  std::vector<int64_t> global;
  int tpDim;
  int64_t tpGroups;
  bool trainable, paramZero, stateZero;
};

const ShardTensor kShardTensors[] = {
    // A fused projection split per section (groups 3) on dim 0, ZeRO-3.
    {"attn.qkv.weight", DType::F32, {12, 5}, 0, 3, true, true, true},
    // A column split (dim 1), ZeRO-1: the parameter whole, the state partitioned.
    {"mlp.fc.weight", DType::F32, {3, 8}, 1, 1, true, false, true},
    // Replicated, not partitioned.
    {"ln.bias", DType::F32, {5}, -1, 1, true, false, false},
    // An integer buffer split over tp and partitioned over dp.
    {"pos.count", DType::I64, {8}, 0, 1, false, true, false},
};
constexpr int kNumShard = 4;

int fakeDp() {
  const char *env = std::getenv("CARVE_FAKE_DP");
  int n = env ? std::atoi(env) : 1;
  return n > 0 ? n : 1;
}

TensorSpec makeShardSpec(const ShardTensor &t, int dp, int tp, ArenaLayout &arena) {
  TensorSpec s{};
  s.name = t.name;
  s.dtype = t.dtype;
  s.rank = static_cast<int>(t.global.size());
  s.numel = 1;
  for (int i = 0; i < s.rank; ++i) {
    s.globalDims[i] = t.global[i];
    s.dims[i] = i == t.tpDim ? t.global[i] / tp : t.global[i];
    s.numel *= s.dims[i];
  }
  s.tpDim = t.tpDim;
  s.tpGroups = t.tpGroups;
  s.paramZero = t.paramZero;
  s.stateZero = t.stateZero;
  // As a compiler might: chunks rounded up to 4 elements, so that some end
  // in padding.
  if (t.paramZero || t.stateZero)
    s.zeroChunk = ((s.numel + dp - 1) / dp + 3) / 4 * 4;
  const int es = dtypeSize(t.dtype);
  s.offset = arena.take((t.paramZero ? s.zeroChunk : s.numel) * es);
  s.trainable = t.trainable;
  s.gradOffset = t.trainable ? arena.take(s.numel * 4) : -1;
  for (int k = 0; k < 2; ++k)
    s.stateOffset[k] = t.trainable ? arena.take((t.stateZero ? s.zeroChunk : s.numel) * 4) : -1;
  return s;
}

/// The global flat index of element `f` of this rank's tp piece of `s`.
int64_t globalIndex(const TensorSpec &s, int tp, int tpRank, int64_t f) {
  int64_t coord[kMaxRank];
  for (int i = s.rank - 1; i >= 0; --i) {
    coord[i] = f % s.dims[i];
    f /= s.dims[i];
  }
  if (s.tpDim >= 0) {
    const int64_t chunk = s.globalDims[s.tpDim] / (s.tpGroups * tp), l = coord[s.tpDim];
    coord[s.tpDim] = l / chunk * tp * chunk + tpRank * chunk + l % chunk;
  }
  int64_t g = 0;
  for (int i = 0; i < s.rank; ++i)
    g = g * s.globalDims[i] + coord[i];
  return g;
}

/// Checks one arena slot of `count` elements: element j is element
/// `first + j` of the tp piece (beyond its end: padding, 0), whose value is
/// base + global index, or 0 everywhere when `zero`.
int64_t checkSlot(StepContext &ctx, const TensorSpec &s, int64_t offset, bool isI64,
                  int64_t count, int64_t first, double base, bool zero) {
  int64_t wrong = 0;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t f = first + j;
    double want = 0;
    if (f < s.numel && !zero)
      want = base + static_cast<double>(globalIndex(s, program.tp, ctx.tpRank, f));
    const double got = isI64 ? static_cast<double>(at<int64_t>(ctx, offset)[j])
                             : static_cast<double>(at<float>(ctx, offset)[j]);
    wrong += got != want;
  }
  return wrong;
}

void shardStep(StepContext &ctx) {
  Communicator &tp = *ctx.tpComm, &dp = *ctx.dpComm;
  int64_t wrong = 0;
  wrong += tp.size() != program.tp || dp.size() != program.dp;
  wrong += tp.rank() != ctx.tpRank || dp.rank() != ctx.dpRank;
  // The mesh: world rank = dpRank * tp + tpRank; a tp group shares its dp
  // rank, a dp group its tp rank.
  const char *worldRank = std::getenv("OMPI_COMM_WORLD_RANK");
  wrong += (worldRank ? std::atoi(worldRank) : 0) != ctx.dpRank * program.tp + ctx.tpRank;
  int64_t ranks[2] = {ctx.dpRank, -ctx.dpRank};
  tp.allReduce(ranks, 2, CommType::I64, ReduceOp::Max);
  wrong += ranks[0] != ctx.dpRank || -ranks[1] != ctx.dpRank;
  int64_t tpRanks[2] = {ctx.tpRank, -ctx.tpRank};
  dp.allReduce(tpRanks, 2, CommType::I64, ReduceOp::Max);
  wrong += tpRanks[0] != ctx.tpRank || -tpRanks[1] != ctx.tpRank;

  const bool stateLoaded = std::getenv("CARVE_FAKE_EXPECT_STATE") != nullptr;
  for (int i = 0; i < kNumShard; ++i) {
    const TensorSpec &s = params[i];
    const bool isI64 = s.dtype == DType::I64;
    const int64_t chunkStart = ctx.dpRank * s.zeroChunk;
    int64_t bad = s.paramZero
                      ? checkSlot(ctx, s, s.offset, isI64, s.zeroChunk, chunkStart, 1000.0 * (i + 1),
                                  false)
                      : checkSlot(ctx, s, s.offset, isI64, s.numel, 0, 1000.0 * (i + 1), false);
    for (int k = 0; k < 2 && s.trainable; ++k)
      bad += s.stateZero ? checkSlot(ctx, s, s.stateOffset[k], false, s.zeroChunk, chunkStart,
                                     1000.0 * (i + 1) + 0.25 * (k + 1), !stateLoaded)
                         : checkSlot(ctx, s, s.stateOffset[k], false, s.numel, 0,
                                     1000.0 * (i + 1) + 0.25 * (k + 1), !stateLoaded);
    if (bad)
      fatal("shard check: %lld wrong elements of '%s' on dp rank %d, tp rank %d",
            static_cast<long long>(bad), s.name, ctx.dpRank, ctx.tpRank);
  }
  if (wrong)
    fatal("shard check: %lld wrong mesh facts on dp rank %d, tp rank %d",
          static_cast<long long>(wrong), ctx.dpRank, ctx.tpRank);
  ctx.loss = 0;
  ctx.lr = 0;
}

int fakeWorld() {
  const char *env = std::getenv("CARVE_FAKE_WORLD");
  int n = env ? std::atoi(env) : 1;
  return n > 0 ? n : 1;
}

const Program *build() {
  std::string model = std::getenv("CARVE_FAKE_MODEL") ? std::getenv("CARVE_FAKE_MODEL") : "";
  bool tokens = model == "tokens";
  int world = fakeWorld();
  ArenaLayout arena;
  program.name = "program0";
  program.worldSize = world;
  program.dp = world;
  if (model == "shard") {
    program.dp = fakeDp();
    program.tp = world / program.dp;
    if (const char *tp = std::getenv("CARVE_FAKE_TP"))
      program.tp = std::atoi(tp);
    program.zeroStage = 3;
    program.model = "fake-shard.onnx";
    program.globalBatch = 8;
    program.seqLen = 0;
    program.localBatch = program.globalBatch / program.dp;
    program.dataKind = DataKind::Tensors;
    inputs[0] = makeSpec("x", DType::F32, {program.localBatch, kFeatures}, arena);
    inputs[1] = makeSpec("y", DType::F32, {program.localBatch}, arena);
    for (int i = 0; i < kNumShard; ++i)
      params[i] = makeShardSpec(kShardTensors[i], program.dp, std::max(program.tp, 1), arena);
    program.numParams = kNumShard;
    program.optimizer = OptimizerKind::AdamW;
    program.numStateSlots = 2;
    program.description = "AdamW, dp x tp, ZeRO";
    program.step = shardStep;
  } else if (tokens) {
    program.model = "fake-tokens.onnx";
    program.globalBatch = 4;
    program.seqLen = 8;
    program.localBatch = program.globalBatch / world;
    program.dataKind = DataKind::Tokens;
    inputs[0] = makeSpec("idx", DType::I64, {program.localBatch, program.seqLen}, arena);
    inputs[1] = makeSpec("targets", DType::I64, {program.localBatch, program.seqLen}, arena);
    params[0] = makeSpec("table.weight", DType::F32, {kVocab}, arena, true, 2);
    program.numParams = 1;
    program.optimizer = OptimizerKind::AdamW;
    program.numStateSlots = 2;
    program.description = "AdamW lr 0.1, dp";
    program.step = tokensStep;
    reduceOffset = arena.take(4 * (kVocab + 1));
  } else {
    program.model = "fake-linreg.onnx";
    program.globalBatch = 8;
    program.seqLen = 0;
    program.localBatch = program.globalBatch / world;
    program.dataKind = DataKind::Tensors;
    inputs[0] = makeSpec("x", DType::F32, {program.localBatch, kFeatures}, arena);
    inputs[1] = makeSpec("y", DType::F32, {program.localBatch}, arena);
    params[0] = makeSpec("linear.weight", DType::F32, {kFeatures}, arena, true, 1);
    params[1] = makeSpec("linear.bias", DType::F32, {1}, arena, true, 1);
    params[2] = makeSpec("steps_seen", DType::I64, {1}, arena);
    program.numParams = 3;
    program.optimizer = OptimizerKind::SGD;
    program.numStateSlots = 1;
    program.description = "SGD lr 0.05 momentum 0.9, dp";
    program.step = model == "comm" ? commCheckStep : linregStep;
    reduceOffset = arena.take(4 * (kFeatures + 2));
  }
  program.numInputs = 2;
  program.inputs = inputs;
  program.params = params;
  program.arenaBytes = arena.next;
  return &program;
}

} // namespace

extern "C" int carve_world_size() { return fakeWorld(); }

extern "C" const Program *carve_program_for_rank(int rank) {
  static const Program *p = build();
  if (rank < 0 || rank >= p->worldSize)
    return nullptr;
  if (std::string(p->model) != "fake-shard.onnx")
    return p;
  // Distinct memory figures per rank, for the start-up report.
  static std::vector<Program> perRank(static_cast<size_t>(p->worldSize), *p);
  Program &r = perRank[static_cast<size_t>(rank)];
  r.paramBytes = 1000 + rank;
  r.gradBytes = 2000 + rank;
  r.stateBytes = 3000 + rank;
  return &r;
}
