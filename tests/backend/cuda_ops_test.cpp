// CUDA backend ops against the CPU backend on fresh random inputs with ragged sizes. Outputs are
// poisoned with NaN before each GPU call, so an element the kernel never wrote fails the check
// (NaN never passes). Tolerances (relative L2): 1e-5 where both backends do the same f32 arithmetic
// in another order; 2e-4 for the gated delta rule (the CPU runs the chunked WY form, the GPU the
// token recurrence below 128 tokens and its own chunked form above); 1e-2 for products with bf16 weights, where the GPU
// rounds activations to bf16 for the tensor cores and the CPU keeps them f32. Skipped where no GPU is visible (ctest -L
// cuda).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/backend.h"
#if HYPIC_HAVE_CUDA
#include <cuda_runtime.h>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/kernels.h"
#endif

using namespace hypic;

namespace {

Tensor randn(Shape s, std::mt19937& rng, float scale = 1.0f) {
  Tensor t = Tensor::empty(DType::F32, std::move(s));
  std::normal_distribution<float> nd(0.f, scale);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = nd(rng);
  return t;
}

Tensor host_i64(const std::vector<int64_t>& v) {
  Tensor t = Tensor::empty(DType::I64, {static_cast<int64_t>(v.size())});
  std::copy(v.begin(), v.end(), t.data<int64_t>());
  return t;
}

Tensor as(const Tensor& f, DType dt) {
  Tensor t = Tensor::empty(dt, f.shape());
  convert_from_f32(f.data<float>(), dt, t.raw(), static_cast<size_t>(f.numel()));
  return t;
}

template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "<no invalid_argument thrown>";
}

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = backend_unavailable("cuda");
    if (!why.empty()) GTEST_SKIP() << "cuda backend unavailable: " << why;
    gpu = make_backend("cuda");
    cpu = make_backend("cpu", 2);
    rng.seed(static_cast<uint32_t>(::testing::UnitTest::GetInstance()->random_seed()) + 7919u * ++calls);
  }
  // A device copy of a host tensor.
  Tensor dev(const Tensor& h) { return gpu->to_device(h); }
  // A device tensor full of NaN: whatever the kernel leaves unwritten fails the comparison.
  Tensor poisoned(DType dt, Shape s) {
    EXPECT_EQ(dt, DType::F32);
    Tensor t = gpu->alloc(dt, std::move(s));
    gpu->fill(t, std::numeric_limits<float>::quiet_NaN());
    return t;
  }
  // Relative L2 distance of a device tensor from a host reference; NaN or Inf anywhere gives +inf.
  double err(const Tensor& got, const Tensor& want) {
    Tensor g = gpu->to_host(got).to_f32(), w = want.to_f32();
    EXPECT_EQ(g.shape(), w.shape());
    double num = 0, den = 0;
    for (int64_t i = 0; i < g.numel() && i < w.numel(); ++i) {
      const double a = g.data<float>()[i], b = w.data<float>()[i];
      if (!std::isfinite(a)) return std::numeric_limits<double>::infinity();
      num += (a - b) * (a - b);
      den += b * b;
    }
    return std::sqrt(num / std::max(den, 1e-300));
  }
  std::unique_ptr<Backend> gpu, cpu;
  std::mt19937 rng;
  static inline uint32_t calls = 0;
};

}  // namespace

TEST_F(CudaOps, AllocIsZeroEvenWhenReusingAFreedBlock) {
  for (int i = 0; i < 3; ++i) {
    {
      Tensor t = gpu->alloc(DType::F32, {1000 + i});
      gpu->fill(t, 7.f);
    }
    Tensor z = gpu->alloc(DType::F32, {1000 + i});
    Tensor h = gpu->to_host(z);
    for (int64_t j = 0; j < h.numel(); ++j) ASSERT_EQ(h.data<float>()[j], 0.f) << j;
  }
  EXPECT_EQ(gpu->device().kind, DeviceKind::CUDA);
}

// Runs f once per split factor of the few-row products (0: the size rule), then restores the rule.
template <typename F>
void for_each_gemv_split(F&& f) {
#if HYPIC_HAVE_CUDA
  for (int split : {0, 1, 2, 4, 8}) {
    SCOPED_TRACE("gemv split " + std::to_string(split));
    cuda::set_gemv_split(split);
    f();
  }
  cuda::set_gemv_split(0);
#endif
}

TEST_F(CudaOps, MatmulF32AndHalfWeights) {
  // M <= 8 with K % 8 == 0 takes the few-row kernel (f32 activations: 1e-5 for every dtype), with
  // each number of warps per row; K = 2056 leaves a partial run of 256 weights.
  for_each_gemv_split([&] {
    for (int64_t M : {1, 3, 8, 37, 130})
      for (int64_t K : {70 + M % 5, 264 + 8 * (M % 3), int64_t{2056}})
        for (DType wd : {DType::F32, DType::BF16, DType::F16})
          for (bool acc : {false, true}) {
            const int64_t N = 93;
            Tensor x = randn({M, K}, rng), w = as(randn({N, K}, rng, 0.2f), wd), y0 = randn({M, N}, rng);
            Tensor yc = y0.clone();
            cpu->matmul(x, w, yc, acc);
            Tensor yg = dev(y0);
            gpu->matmul(dev(x), dev(w), yg, acc);
            const double tol = wd == DType::F32 || (M <= 8 && K % 8 == 0) ? 1e-5 : 1e-2;
            EXPECT_LE(err(yg, yc), tol) << "M=" << M << " K=" << K << " " << dtype_name(wd) << " acc=" << acc;
          }
  });
}

TEST_F(CudaOps, EmbeddingNormsAndElementwise) {
  const int64_t R = 37, D = 200, V = 51;
  Tensor table = as(randn({V, D}, rng), DType::BF16);
  std::vector<int32_t> ids = {0, 50, 7, 7, 3, 49};
  Tensor ec = cpu->alloc(DType::F32, {6, D}), eg = poisoned(DType::F32, {6, D});
  cpu->embedding(table, ids, ec);
  gpu->embedding(dev(table), ids, eg);
  EXPECT_EQ(err(eg, ec), 0.0);

  // Norms: a block per row (D 200), a warp per row (128, 256 and 512: a head's channels).
  for (int64_t Dn : {D, int64_t(128), int64_t(256), int64_t(512), int64_t(2048), int64_t(4096)}) {
    Tensor x = randn({R, Dn}, rng, 3.f), z = randn({R, Dn}, rng), w = as(randn({Dn}, rng, 0.3f), DType::BF16);
    for (bool opw : {false, true}) {
      Tensor oc = cpu->alloc(DType::F32, {R, Dn}), og = poisoned(DType::F32, {R, Dn});
      cpu->rms_norm(x, w, 1e-6f, opw, oc);
      gpu->rms_norm(dev(x), dev(w), 1e-6f, opw, og);
      EXPECT_LE(err(og, oc), 1e-5) << "one_plus_w=" << opw << " D=" << Dn;
    }
    Tensor oc = cpu->alloc(DType::F32, {R, Dn}), og = poisoned(DType::F32, {R, Dn});
    cpu->rms_norm_gated(x, z, w, 1e-6f, oc);
    gpu->rms_norm_gated(dev(x), dev(z), dev(w), 1e-6f, og);
    EXPECT_LE(err(og, oc), 1e-5) << "gated D=" << Dn;
    // In place, as the model calls them.
    Tensor xg = dev(x), xz = dev(x);
    gpu->rms_norm(xg, dev(w), 1e-6f, true, xg);
    gpu->rms_norm_gated(xz, dev(z), dev(w), 1e-6f, xz);
    Tensor oc2 = cpu->alloc(DType::F32, {R, Dn});
    cpu->rms_norm(x, w, 1e-6f, true, oc2);
    EXPECT_LE(err(xg, oc2), 1e-5) << "in place D=" << Dn;
    EXPECT_LE(err(xz, oc), 1e-5) << "gated in place D=" << Dn;
  }
  Tensor x = randn({R, D}, rng, 3.f), z = randn({R, D}, rng);
  Tensor gx = dev(x), gz = dev(z);
  for (int op = 0; op < 3; ++op) {
    Tensor oc = cpu->alloc(DType::F32, {R, D}), og = poisoned(DType::F32, {R, D});
    if (op == 0) cpu->add(x, z, oc), gpu->add(gx, gz, og);
    if (op == 1) cpu->silu_mul(x, z, oc), gpu->silu_mul(gx, gz, og);
    if (op == 2) cpu->sigmoid_mul(x, z, oc), gpu->sigmoid_mul(gx, gz, og);
    EXPECT_LE(err(og, oc), 1e-6) << "op " << op;
  }
  Tensor rg = randn({R, 1}, rng);
  Tensor oc = cpu->alloc(DType::F32, {R, D}), og = poisoned(DType::F32, {R, D});
  cpu->sigmoid_mul(x, rg, oc);
  gpu->sigmoid_mul(gx, dev(rg), og);
  EXPECT_LE(err(og, oc), 1e-6);
}

TEST_F(CudaOps, CopyAndSetColumns) {
  const int64_t R = 29, C = 77;
  Tensor src = randn({R, C}, rng);
  for (auto [col, w] : {std::pair<int64_t, int64_t>{0, 10}, {13, 40}, {70, 7}}) {
    Tensor dc = cpu->alloc(DType::F32, {R, w}), dg = poisoned(DType::F32, {R, w});
    cpu->copy_cols(src, col, dc);
    gpu->copy_cols(dev(src), col, dg);
    EXPECT_EQ(err(dg, dc), 0.0);
    Tensor wide_c = randn({R, C}, rng);
    Tensor wide_g = dev(wide_c);
    cpu->set_cols(dc, col, wide_c);
    gpu->set_cols(dev(dc), col, wide_g);
    EXPECT_EQ(err(wide_g, wide_c), 0.0);
  }
}

TEST_F(CudaOps, RopeAtArbitraryPositions) {
  const int64_t T = 23, H = 3, D = 64;
  std::vector<int64_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = (t * 7919) % 131072 + (t % 3 == 0 ? 5 : 0);
  for (int rot : {16, 64}) {
    Tensor x = randn({T, H, D}, rng);
    Tensor xc = x.clone(), xg = dev(x);
    cpu->rope_neox(xc, pos, rot, 1e7);
    gpu->rope_neox(xg, pos, rot, 1e7);
    EXPECT_LE(err(xg, xc), 1e-6) << "rot " << rot;
  }
}

// Default mode: spans of 16+ rows go to the tensor-core flash kernel (q, k, v, p rounded to bf16:
// 2e-2); precise mode and decode-sized spans use the f32 kernel (1e-5). Cases cross key tiles, start
// in the middle of the cache (q_offset) and stop short of it (kv_len).
TEST_F(CudaOps, AttentionPrefillDecodeAndOffsets) {
  struct Case {
    int64_t T, S, kv_len, q_offset, Hq, Hkv, D, Dv;
  };
  for (Case c :
       {Case{1, 40, 40, 39, 4, 2, 64, 64}, Case{5, 64, 61, 56, 8, 2, 256, 256}, Case{70, 70, 70, 0, 6, 3, 96, 40},
        Case{33, 100, 90, 57, 2, 2, 128, 128}, Case{300, 500, 470, 170, 16, 2, 256, 256},
        Case{129, 129, 129, 0, 4, 2, 32, 32}, Case{200, 1000, 1000, 800, 4, 1, 128, 64},
        Case{50, 60, 55, 5, 4, 2, 36, 20},  // head dims not multiples of 8: the f32-tile kernel
        Case{40, 5000, 5000, 4960, 4, 2, 128, 128}, Case{20, 3000, 2900, 2880, 2, 1, 64, 64},  // keys split
        Case{45, 900, 900, 855, 12, 4, 64, 64}})  // a query group of 3 does not divide a block: not packed
    for (int pack : {-1, 1})
      for (bool precise : {false, true}) {
#if HYPIC_HAVE_CUDA
        cuda::set_flash_pack(pack);
#endif
        gpu->set_precise(precise);
        Tensor q = randn({c.T, c.Hq, c.D}, rng), k = randn({c.S, c.Hkv, c.D}, rng), v = randn({c.S, c.Hkv, c.Dv}, rng);
        const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
        Tensor oc = cpu->alloc(DType::F32, {c.T, c.Hq, c.Dv}), og = poisoned(DType::F32, {c.T, c.Hq, c.Dv});
        cpu->attention(q, k, v, c.kv_len, c.q_offset, scale, oc);
        gpu->attention(dev(q), dev(k), dev(v), c.kv_len, c.q_offset, scale, og);
        const double tol = precise || c.T < 16 ? 1e-5 : 2e-2;
        EXPECT_LE(err(og, oc), tol) << "T=" << c.T << " D=" << c.D << " precise=" << precise << " pack=" << pack;
      }
#if HYPIC_HAVE_CUDA
  cuda::set_flash_pack(-1);
#endif
}

// Several spans of one sequence in one call (a composition's seams and its question): one launch
// with per-row positions and split keys on the GPU (blocks packed by query group, and not), one
// attention() per span on the CPU.
TEST_F(CudaOps, AttentionSpansMatchOneCallPerSpan) {
  struct Case {
    std::vector<Backend::RowSpan> spans;
    int64_t Hq, Hkv, D;
  };
  std::vector<Backend::RowSpan> seams;  // a composition: 8-row seams every 700 keys, then a question
  for (int64_t i = 0; i < 14; ++i) seams.push_back({700 * i, i ? 8 : 30});
  seams.push_back({700 * 14, 50});
  const std::vector<Case> cases = {{seams, 16, 2, 256},
                                   {seams, 8, 2, 128},
                                   {{{0, 8}, {1000, 8}, {2100, 8}, {4000, 64}}, 16, 2, 256},
                                   {{{5, 3}, {50, 1}, {51, 20}, {3000, 2}}, 4, 2, 128},  // adjacent spans, single rows
                                   {{{0, 40}}, 8, 2, 64},                                // one span: attention() itself
                                   {{{100, 4}, {90, 4}, {300, 12}}, 4, 1, 64},           // backwards: one call per span
                                   {{{10, 5}, {20, 5}}, 4, 2, 64}};                      // fewer than 16 rows
  for (const Case& c : cases) {
    int64_t T = 0, S = 0;
    for (const auto& sp : c.spans) T += sp.rows, S = std::max(S, sp.pos0 + sp.rows);
    Tensor q = randn({T, c.Hq, c.D}, rng), k = randn({S + 7, c.Hkv, c.D}, rng), v = randn({S + 7, c.Hkv, c.D}, rng);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
    Tensor oc = cpu->alloc(DType::F32, {T, c.Hq, c.D}), og = poisoned(DType::F32, {T, c.Hq, c.D});
    cpu->attention_spans(q, k, v, c.spans, scale, oc);
    for (int pack : {-1, 0}) {
#if HYPIC_HAVE_CUDA
      cuda::set_flash_pack(pack);
#endif
      gpu->fill(og, std::numeric_limits<float>::quiet_NaN());
      gpu->attention_spans(dev(q), dev(k), dev(v), c.spans, scale, og);
      EXPECT_LE(err(og, oc), T >= 16 ? 2e-2 : 1e-5) << "T=" << T << " D=" << c.D << " pack=" << pack;
    }
  }
#if HYPIC_HAVE_CUDA
  cuda::set_flash_pack(-1);
#endif
  // Spans that do not cover q are refused by name.
  Tensor q = dev(randn({10, 2, 64}, rng)), k = dev(randn({40, 1, 64}, rng)), o = gpu->alloc(DType::F32, {10, 2, 64});
  const std::vector<Backend::RowSpan> short_spans = {{0, 4}, {20, 4}};
  try {
    gpu->attention_spans(q, k, k, short_spans, 0.1f, o);
    ADD_FAILURE() << "spans over 8 of 10 rows were accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("attention_spans"), std::string::npos) << e.what();
  }
}

// The flash kernels' launch shape is host arithmetic: checked without a GPU. Every (row, head)
// belongs to exactly one block, every key to exactly one whole-tile split, and the partial sums
// sit after the (max, sum) pairs.
TEST(FlashLaunchShape, CoversEveryRowHeadAndKeyOnce) {
#if HYPIC_HAVE_CUDA
  float buf[1];
  for (bool pack : {false, true})
    for (int64_t T : {1, 127, 128, 300, 1000})
      for (int64_t G : {1, 4, 8})
        for (int splits : {1, 3, 64}) {
          const int64_t Hkv = 2, Hq = G * Hkv, kv_len = 5000;
          const auto L = cuda::flash_launch_shape(pack, T, Hq, Hkv, kv_len, splits, buf);
          const int64_t rows = pack ? 128 / G : 128;
          EXPECT_EQ(L.grid.x, static_cast<unsigned>((T + rows - 1) / rows));
          EXPECT_GE(static_cast<int64_t>(L.grid.x) * rows, T);
          EXPECT_LT((static_cast<int64_t>(L.grid.x) - 1) * rows, T);
          EXPECT_EQ(L.grid.y, static_cast<unsigned>(pack ? Hkv : Hq));
          EXPECT_EQ(L.grid.z, static_cast<unsigned>(splits));
          EXPECT_GE(L.chunk * splits, kv_len);
          if (splits > 1) {
            EXPECT_EQ(L.chunk % 64, 0);                               // whole tiles: no tile is seen by two splits
            EXPECT_LT(L.chunk * (splits - 1), kv_len + 64 * splits);  // no split is all padding beyond a tile each
            EXPECT_EQ(L.part_ml, buf);
            EXPECT_EQ(L.part_acc, buf + 2 * T * Hq * splits);
          } else {
            EXPECT_EQ(L.part_ml, nullptr);
            EXPECT_EQ(L.part_acc, nullptr);
          }
        }
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

// Hopper's warpgroup-MMA flash kernel (D = Dv in {128, 256}) against the mma.sync kernel on the
// same GPU (both round q, k, v, p to bf16: they differ by the order of f32 sums, ~1e-7) and
// against the CPU (2e-2): ragged row blocks, q_offset, kv_len short of the rows' reach, GQA, rows
// with positions of their own (a composition's spans), blocks of one head and packed by query
// group, and keys split across blocks (few rows over many keys).
TEST_F(CudaOps, FlashAttentionWgmmaMatchesMmaKernel) {
#if HYPIC_HAVE_CUDA
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  if (prop.major != 9) GTEST_SKIP() << "wgmma needs a Hopper GPU (sm_90), this one is sm_" << prop.major << prop.minor;
  ASSERT_TRUE(cuda::wgmma_available()) << "the sm_90a image was not loaded on an sm_90 GPU";
  struct Case {
    int64_t T, S, kv_len, q_offset, Hq, Hkv, D;
    std::vector<Backend::RowSpan> spans;  // non-empty: attention_spans
  };
  std::vector<Backend::RowSpan> seams, sparse;
  for (int64_t i = 0; i < 16; ++i) seams.push_back({500 * i + 3 * i, 64});
  for (int64_t i = 0; i < 14; ++i) sparse.push_back({700 * i, i ? 8 : 30});  // 8-row seams, then a question
  sparse.push_back({700 * 14, 50});
  const std::vector<Case> cases = {{300, 500, 470, 170, 16, 2, 256, {}},    {1000, 1000, 1000, 0, 8, 2, 128, {}},
                                   {777, 2000, 2000, 1223, 16, 4, 256, {}}, {129, 300, 250, 100, 32, 32, 128, {}},
                                   {40, 5000, 5000, 4960, 16, 2, 256, {}},  {20, 3000, 2900, 2880, 8, 1, 128, {}},
                                   {0, 0, 0, 0, 16, 2, 256, seams},         {0, 0, 0, 0, 16, 2, 256, sparse}};
  for (const Case& c : cases) {
    int64_t T = c.T, S = c.S;
    if (!c.spans.empty()) {
      T = 0;
      for (const auto& sp : c.spans) T += sp.rows, S = std::max(S, sp.pos0 + sp.rows);
    }
    Tensor q = randn({T, c.Hq, c.D}, rng), k = randn({S, c.Hkv, c.D}, rng), v = randn({S, c.Hkv, c.D}, rng);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
    Tensor oc = cpu->alloc(DType::F32, {T, c.Hq, c.D});
    if (c.spans.empty())
      cpu->attention(q, k, v, c.kv_len, c.q_offset, scale, oc);
    else
      cpu->attention_spans(q, k, v, c.spans, scale, oc);
    Tensor qd = dev(q), kd = dev(k), vd = dev(v);
    for (int pack : {0, 1}) {
      cuda::set_flash_pack(pack);
      Tensor og[2] = {poisoned(DType::F32, {T, c.Hq, c.D}), poisoned(DType::F32, {T, c.Hq, c.D})};
      for (int on : {0, 1}) {
        cuda::set_flash_wgmma(on);
        const int64_t before = cuda::flash_wgmma_launches();
        if (c.spans.empty())
          gpu->attention(qd, kd, vd, c.kv_len, c.q_offset, scale, og[on]);
        else
          gpu->attention_spans(qd, kd, vd, c.spans, scale, og[on]);
        EXPECT_EQ(cuda::flash_wgmma_launches() - before, on) << "T=" << T << " wgmma " << on;
      }
      Tensor mma = gpu->to_host(og[0]);
      const double to_mma = err(og[1], mma), to_cpu = err(og[1], oc);
      EXPECT_LE(to_mma, 5e-3) << "T=" << T << " D=" << c.D << " pack=" << pack;
      EXPECT_LE(to_cpu, 2e-2) << "T=" << T << " D=" << c.D << " pack=" << pack;
      EXPECT_LE(err(og[0], oc), 2e-2) << "T=" << T << " D=" << c.D << " pack=" << pack;
      std::printf("wgmma flash T=%lld D=%lld Hq=%lld pack=%d: rel. error to mma.sync %.2e, to cpu %.2e\n",
                  static_cast<long long>(T), static_cast<long long>(c.D), static_cast<long long>(c.Hq), pack, to_mma,
                  to_cpu);
    }
  }
  cuda::set_flash_wgmma(-1);
  cuda::set_flash_pack(-1);
#endif
}

TEST_F(CudaOps, CausalConvAndGates) {
  // C = 96: the tiled kernel (4 channels a thread, 16-row tiles: T = 50 ends on a partial tile).
  for (int64_t C : {70, 96})
    for (int64_t T : {1, 2, 3, 50}) {
      const int64_t K = 4, H = 6;
      Tensor x = randn({T, C}, rng), w = as(randn({C, K}, rng, 0.5f), DType::BF16), st = randn({K - 1, C}, rng);
      Tensor sc = st.clone(), sg = dev(st);
      Tensor oc = cpu->alloc(DType::F32, {T, C}), og = poisoned(DType::F32, {T, C});
      cpu->causal_conv1d_silu(x, w, sc, oc);
      gpu->causal_conv1d_silu(dev(x), dev(w), sg, og);
      EXPECT_LE(err(og, oc), 1e-6) << "T=" << T;
      EXPECT_EQ(err(sg, sc), 0.0) << "state T=" << T;

      Tensor a = randn({T, H}, rng, 5.f), b = randn({T, H}, rng), al = randn({H}, rng), db = randn({H}, rng);
      Tensor gc = cpu->alloc(DType::F32, {T, H}), bc = cpu->alloc(DType::F32, {T, H});
      Tensor gg = poisoned(DType::F32, {T, H}), bg = poisoned(DType::F32, {T, H});
      cpu->gdn_gates(a, b, al, db, gc, bc);
      gpu->gdn_gates(dev(a), dev(b), dev(al), dev(db), gg, bg);
      EXPECT_LE(err(gg, gc), 1e-6);
      EXPECT_LE(err(bg, bc), 1e-6);
    }
}

// A composition's convs in one launch: spans of 0-5 rows (fewer than K-1 too), each followed or not
// by a cached body's conv tail (`after`), the last span open or closed.
TEST_F(CudaOps, CausalConvSpansMatchOneCallPerSpan) {
  // C = 96: one continued conv takes the tiled kernel.
  for (const int64_t C : {70, 96}) {
    const int64_t K = 4;
    const std::vector<std::vector<std::pair<int64_t, bool>>> cases = {
        {{3, true}, {2, true}, {0, true}, {5, false}},   // seams, an empty one, then the question
        {{1, false}, {2, true}, {4, false}, {1, true}},  // ends on a body tail
        {{2, false}, {1, false}},                        // no bodies: one continued conv
        {{0, true}}};                                    // no rows: the state is the tail
    for (const auto& cs : cases) {
      int64_t T = 0;
      for (auto [r, a] : cs) T += r;
      Tensor x = randn({std::max<int64_t>(T, 1), C}, rng).slice_rows(0, T),
             w = as(randn({C, K}, rng, 0.5f), DType::BF16);
      Tensor st = randn({K - 1, C}, rng);
      std::vector<Tensor> tails_c, tails_g;
      for (size_t i = 0; i < cs.size(); ++i)
        tails_c.push_back(randn({K - 1, C}, rng)), tails_g.push_back(dev(tails_c.back()));
      std::vector<Backend::ConvSpan> sc, sg;
      for (size_t i = 0; i < cs.size(); ++i) {
        sc.push_back({cs[i].first, cs[i].second ? &tails_c[i] : nullptr});
        sg.push_back({cs[i].first, cs[i].second ? &tails_g[i] : nullptr});
      }
      Tensor stc = st.clone(), stg = dev(st);
      Tensor oc = cpu->alloc(DType::F32, {T, C}),
             og = T ? poisoned(DType::F32, {T, C}) : gpu->alloc(DType::F32, {0, C});
      cpu->causal_conv1d_silu_spans(x, w, sc, stc, oc);
      gpu->causal_conv1d_silu_spans(dev(x), dev(w), sg, stg, og);
      if (T) {
        EXPECT_LE(err(og, oc), 1e-6) << "T=" << T;
      }
      EXPECT_EQ(err(stg, stc), 0.0) << "state, T=" << T;
      // The result in three column blocks (q, k, v of a GDN conv): the same values, each block in
      // its tensor, from the same kernel.
      const int64_t c0 = C / 4 - C / 4 % 4 + 4, c1 = c0;  // C 96: 24 | 24 | 48; C 70: 20 | 20 | 30
      Tensor stb = dev(st);
      auto block = [&](int64_t w) { return T ? poisoned(DType::F32, {T, w}) : gpu->alloc(DType::F32, {0, w}); };
      std::vector<Tensor> blocks = {block(c0), block(c1), block(C - c0 - c1)};
      gpu->causal_conv1d_silu_spans(dev(x), dev(w), sg, stb, blocks);
      EXPECT_EQ(err(stb, stc), 0.0) << "split state, T=" << T;
      if (T) {
        const Tensor whole_h = gpu->to_host(og);
        const float* whole = whole_h.data<float>();
        int64_t b0 = 0;
        for (const Tensor& b : blocks) {
          const Tensor bh = gpu->to_host(b);
          const float* bv = bh.data<float>();
          for (int64_t t = 0; t < T; ++t)
            for (int64_t c = 0; c < b.dim(1); ++c)
              ASSERT_EQ(bv[t * b.dim(1) + c], whole[t * C + b0 + c]) << "C=" << C << " T=" << T << " col " << b0 + c;
          b0 += b.dim(1);
        }
      }
    }
    // Spans that do not cover x are refused by name.
    Tensor x = dev(randn({4, C}, rng)), w = dev(randn({C, K}, rng)), st = gpu->alloc(DType::F32, {K - 1, C});
    Tensor o = gpu->alloc(DType::F32, {4, C});
    const std::vector<Backend::ConvSpan> short_spans = {{1, nullptr}, {2, nullptr}};
    EXPECT_NE(
        error_of([&] { gpu->causal_conv1d_silu_spans(x, w, short_spans, st, o); }).find("causal_conv1d_silu_spans"),
        std::string::npos);
  }
}

// A composition's K/V splice: body rows copied into a cache and the keys re-rotated on the way, the
// snapshot's seam rows copied plainly, all in one launch; the CPU copies and rotates piece by piece.
TEST_F(CudaOps, CopyRowsSplicesAndRotatesKeys) {
  const int64_t H = 2, D = 64, rot = 16, S = 300;
  Tensor body_k = randn({100, H, D}, rng), body_v = randn({100, H, D}, rng), snap = randn({12, H, D}, rng);
  Tensor odd = randn({9, 3}, rng);  // rows of 3 words: not a multiple of 4
  for (int round = 0; round < 2; ++round) {
    Tensor kc = randn({S, H, D}, rng), vc = randn({S, H, D}, rng), oddc = randn({20, 3}, rng);
    Tensor kg = dev(kc), vg = dev(vc), oddg = dev(oddc);
    Tensor bk = dev(body_k), bv = dev(body_v), sn = dev(snap), od = dev(odd);
    auto pieces = [&](const Tensor& bk_, const Tensor& bv_, const Tensor& sn_, const Tensor& od_, Tensor& k, Tensor& v,
                      Tensor& o) {
      return std::vector<Backend::RowCopy>{
          {&bk_, 8, &k, 8, 92, 0},      {&bv_, 8, &v, 8, 92, 0}, {&bk_, 8, &k, 108, 92, 100}, {&bv_, 8, &v, 108, 92, 0},
          {&bk_, 0, &k, 200, 50, 4321}, {&sn_, 0, &k, 0, 8, 0},  {&sn_, 8, &v, 100, 4, 0},    {&od_, 2, &o, 11, 7, 0}};
    };
    auto pc = pieces(body_k, body_v, snap, odd, kc, vc, oddc);
    auto pg = pieces(bk, bv, sn, od, kg, vg, oddg);
    if (round == 1) pc.resize(1), pg.resize(1);
    cpu->copy_rows(pc, rot, 1e7);
    gpu->copy_rows(pg, rot, 1e7);
    EXPECT_LE(err(kg, kc), 1e-6);
    EXPECT_EQ(err(vg, vc), 0.0);
    EXPECT_EQ(err(oddg, oddc), 0.0);
  }
  // Overlapping pieces and rows out of range are refused by name.
  Tensor k = gpu->alloc(DType::F32, {10, H, D}), b = gpu->alloc(DType::F32, {10, H, D});
  const std::vector<Backend::RowCopy> overlap = {{&b, 0, &k, 0, 4}, {&b, 0, &k, 3, 4}};
  EXPECT_NE(error_of([&] { gpu->copy_rows(overlap); }).find("copy_rows"), std::string::npos);
  const std::vector<Backend::RowCopy> far = {{&b, 8, &k, 0, 4}};
  EXPECT_NE(error_of([&] { gpu->copy_rows(far); }).find("out of range"), std::string::npos);
}

TEST_F(CudaOps, GatedDeltaRuleWithTransition) {
  struct Case {
    int64_t T, Hk, Hv, dk, dv;
  };
  // Spans below 128 tokens run the token kernel, longer ones the chunked kernel (ragged last chunk,
  // dk 64/128/256, dv not a multiple of the column blocks). Precise mode: the f32 kernels (the
  // tensor-core chunked form has its own test below).
  gpu->set_precise(true);
  for (Case c :
       {Case{1, 2, 4, 16, 32}, Case{7, 1, 2, 64, 48}, Case{100, 2, 4, 128, 128}, Case{37, 1, 1, 200, 24},
        Case{300, 2, 4, 128, 128}, Case{200, 1, 3, 64, 40}, Case{129, 1, 1, 256, 24}, Case{1000, 1, 2, 128, 72}})
    for (bool with_t : {false, true}) {
      Tensor q = randn({c.T, c.Hk, c.dk}, rng), k = randn({c.T, c.Hk, c.dk}, rng), v = randn({c.T, c.Hv, c.dv}, rng);
      Tensor g = randn({c.T, c.Hv}, rng, 0.3f), beta = randn({c.T, c.Hv}, rng);
      for (int64_t i = 0; i < g.numel(); ++i) g.data<float>()[i] = -std::abs(g.data<float>()[i]);
      for (int64_t i = 0; i < beta.numel(); ++i) beta.data<float>()[i] = 1.f / (1.f + std::exp(-beta.data<float>()[i]));
      Tensor s0 = randn({c.Hv, c.dk, c.dv}, rng, 0.5f);
      Tensor sc = s0.clone(), sg = dev(s0);
      Tensor oc = cpu->alloc(DType::F32, {c.T, c.Hv, c.dv}), og = poisoned(DType::F32, {c.T, c.Hv, c.dv});
      Tensor tc = cpu->alloc(DType::F32, {c.Hv, c.dk, c.dk}), tg = poisoned(DType::F32, {c.Hv, c.dk, c.dk});
      cpu->gated_delta_rule(q, k, v, g, beta, true, sc, oc, with_t ? &tc : nullptr);
      gpu->gated_delta_rule(dev(q), dev(k), dev(v), dev(g), dev(beta), true, sg, og, with_t ? &tg : nullptr);
      EXPECT_LE(err(og, oc), 2e-4) << "T=" << c.T << " dk=" << c.dk;
      EXPECT_LE(err(sg, sc), 2e-4) << "state T=" << c.T << " dk=" << c.dk;
      if (with_t) {
        EXPECT_LE(err(tg, tc), 2e-4) << "transition T=" << c.T << " dk=" << c.dk;
      }
    }
}

// A composition chain in one launch against the span ops one at a time on the CPU: seams with
// dense bodies (T S + B), a compact body replayed, a naive body (S + B), links without rows or
// without a body, dk 64 and 128, dv not a multiple of the column blocks.
TEST_F(CudaOps, GatedDeltaChainMatchesSpanOps) {
  struct Dims {
    int64_t Hk, Hv, dk, dv;
  };
  for (Dims d : {Dims{2, 4, 128, 128}, Dims{1, 3, 64, 40}}) {
    auto gates = [&](int64_t n, Tensor& g, Tensor& beta) {
      g = randn({n, d.Hv}, rng, 0.3f), beta = randn({n, d.Hv}, rng);
      for (int64_t i = 0; i < g.numel(); ++i) g.data<float>()[i] = -std::abs(g.data<float>()[i]);
      for (int64_t i = 0; i < beta.numel(); ++i) beta.data<float>()[i] = 1.f / (1.f + std::exp(-beta.data<float>()[i]));
    };
    const int64_t rows[] = {8, 3, 0, 8, 5, 2};
    int64_t R = 0;
    for (int64_t r : rows) R += r;
    Tensor q = randn({R, d.Hk, d.dk}, rng), k = randn({R, d.Hk, d.dk}, rng), v = randn({R, d.Hv, d.dv}, rng), g, beta;
    gates(R, g, beta);
    // Bodies: T scaled like a product of decays (entries ~ 1/sqrt(dk)), B like a state.
    std::vector<Tensor> Ts, Bs;
    for (int i = 0; i < 3; ++i) {
      Ts.push_back(randn({d.Hv, d.dk, d.dk}, rng, 1.f / std::sqrt(static_cast<float>(d.dk))));
      Bs.push_back(randn({d.Hv, d.dk, d.dv}, rng, 0.5f));
    }
    Tensor rk = randn({20, d.Hk, d.dk}, rng), rv = randn({20, d.Hv, d.dv}, rng), rg, rb;
    gates(20, rg, rb);
    std::vector<Tensor> dev_keep;  // device copies the links point to
    auto links_on = [&](bool gpu_side) {
      auto on = [&](const Tensor& t) -> const Tensor* {
        if (!gpu_side) return &t;
        dev_keep.push_back(dev(t));
        return &dev_keep.back();
      };
      dev_keep.clear();
      dev_keep.reserve(16);
      std::vector<Backend::GdnLink> L(6);
      for (int i = 0; i < 6; ++i) L[i].rows = rows[i];
      L[0].T = on(Ts[0]), L[0].B = on(Bs[0]);                                     // dense body
      L[1].rk = on(rk), L[1].rv = on(rv), L[1].rg = on(rg), L[1].rbeta = on(rb);  // compact body
      L[2].B = on(Bs[1]);                                                         // naive: S + B, no rows
      L[4].T = on(Ts[2]), L[4].B = on(Bs[2]);                                     // L[3], L[5]: no body
      return L;
    };
    Tensor s0 = randn({d.Hv, d.dk, d.dv}, rng, 0.5f);
    Tensor sc = s0.clone(), sg = dev(s0);
    Tensor oc = cpu->alloc(DType::F32, {R, d.Hv, d.dv}), og = poisoned(DType::F32, {R, d.Hv, d.dv});
    const auto lc = links_on(false);
    cpu->gated_delta_chain(q, k, v, g, beta, true, sc, oc, lc);
    const auto lg = links_on(true);
#if HYPIC_HAVE_CUDA
    Tensor whole_t_state;  // rows 8 with T staged whole, against T a panel at a time
    for (bool full_t : {true, false})
      for (int rows : {8, 4, 32}) {  // rows of S per thread: the default, and both alternatives
        SCOPED_TRACE("rows per thread " + std::to_string(rows) + (full_t ? ", whole T" : ", T panels"));
        cuda::set_gdn_chain_rows(rows);
        cuda::set_gdn_chain_full_t(full_t);
        Tensor sg1 = dev(s0), og1 = poisoned(DType::F32, {R, d.Hv, d.dv});
        gpu->gated_delta_chain(dev(q), dev(k), dev(v), dev(g), dev(beta), true, sg1, og1, lg);
        EXPECT_LE(err(og1, oc), 2e-4) << "outputs dk=" << d.dk;
        EXPECT_LE(err(sg1, sc), 2e-4) << "state dk=" << d.dk;
        if (rows == 8 && full_t) whole_t_state = gpu->to_host(sg1);
        if (rows == 8 && !full_t) {
          EXPECT_LE(err(sg1, whole_t_state), 1e-6) << "the two forms of T S";
        }
      }
    cuda::set_gdn_chain_rows(0);
    cuda::set_gdn_chain_full_t(true);
    // Dense T stored in bf16 (entries outside precise mode): exactly the f32 chain over T rounded to
    // bf16 values, staged whole and a panel at a time, and on the CPU (compose_state reads it too).
    {
      std::vector<Tensor> Tb, Tr;  // bf16 (device), and its values in f32 (host)
      for (int i : {0, 2}) {
        Tensor b = as(Ts[i], DType::BF16);
        Tr.push_back(b.to_f32().clone());
        Tb.push_back(dev(b));
      }
      auto with_t = [&](std::vector<Backend::GdnLink> L, const Tensor& t0, const Tensor& t2) {
        L[0].T = &t0, L[4].T = &t2;
        return L;
      };
      Tensor tr0 = dev(Tr[0]), tr2 = dev(Tr[1]);
      const auto lb = with_t(lg, Tb[0], Tb[1]), lr = with_t(lg, tr0, tr2);
      for (bool full_t : {true, false}) {
        cuda::set_gdn_chain_full_t(full_t);
        Tensor sb = dev(s0), sr = dev(s0), ob = poisoned(DType::F32, {R, d.Hv, d.dv}),
               orr = poisoned(DType::F32, {R, d.Hv, d.dv});
        gpu->gated_delta_chain(dev(q), dev(k), dev(v), dev(g), dev(beta), true, sb, ob, lb);
        gpu->gated_delta_chain(dev(q), dev(k), dev(v), dev(g), dev(beta), true, sr, orr, lr);
        EXPECT_EQ(err(sb, gpu->to_host(sr)), 0.0) << "bf16 T, dk=" << d.dk << (full_t ? " whole" : " panels");
        EXPECT_EQ(err(ob, gpu->to_host(orr)), 0.0) << "bf16 T, dk=" << d.dk << (full_t ? " whole" : " panels");
        EXPECT_LE(err(sb, sc), 2e-2) << "bf16 T against the f32 chain, dk=" << d.dk;
      }
      cuda::set_gdn_chain_full_t(true);
      Tensor hb0 = as(Ts[0], DType::BF16), hb2 = as(Ts[2], DType::BF16);
      const auto cb = with_t(lc, hb0, hb2), cr = with_t(lc, Tr[0], Tr[1]);
      Tensor s1 = s0.clone(), s2 = s0.clone(), o1 = cpu->alloc(DType::F32, {R, d.Hv, d.dv}),
             o2 = cpu->alloc(DType::F32, {R, d.Hv, d.dv});
      cpu->gated_delta_chain(q, k, v, g, beta, true, s1, o1, cb);
      cpu->gated_delta_chain(q, k, v, g, beta, true, s2, o2, cr);
      EXPECT_EQ(std::memcmp(s1.raw(), s2.raw(), s1.nbytes()), 0) << "cpu, bf16 T";
    }
#endif
    // Links that do not cover the rows, or a body of the wrong shape, are refused by name.
    auto bad = lg;
    bad[0].rows = 7;
    EXPECT_THROW(gpu->gated_delta_chain(dev(q), dev(k), dev(v), dev(g), dev(beta), true, sg, og, bad),
                 std::invalid_argument);
    bad = lg;
    Tensor wrong = dev(randn({d.Hv, d.dk, d.dk + 1}, rng));
    bad[0].T = &wrong;
    try {
      gpu->gated_delta_chain(dev(q), dev(k), dev(v), dev(g), dev(beta), true, sg, og, bad);
      ADD_FAILURE() << "a T of the wrong shape was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("gated_delta_chain"), std::string::npos) << e.what();
    }
  }
}

// A backend made with HYPIC_CUDA_GDN=mode (token: never chunks; f32: f32 chunks only).
std::unique_ptr<Backend> cuda_with_gdn(const char* mode) {
  ::setenv("HYPIC_CUDA_GDN", mode, 1);
  std::unique_ptr<Backend> b = make_backend("cuda");
  ::unsetenv("HYPIC_CUDA_GDN");
  return b;
}

// The chunked kernel against the token recurrence on the same GPU: the same function computed two
// ways, f32 both (precise mode keeps long spans off the tensor cores).
TEST_F(CudaOps, GatedDeltaChunkedMatchesTokenKernel) {
  std::unique_ptr<Backend> tok = cuda_with_gdn("token");
  gpu->set_precise(true);
  const int64_t T = 777, Hk = 2, Hv = 4, dk = 128, dv = 128;
  Tensor q = randn({T, Hk, dk}, rng), k = randn({T, Hk, dk}, rng), v = randn({T, Hv, dv}, rng);
  Tensor g = randn({T, Hv}, rng, 0.5f), beta = randn({T, Hv}, rng);
  for (int64_t i = 0; i < g.numel(); ++i) g.data<float>()[i] = -std::abs(g.data<float>()[i]);
  for (int64_t i = 0; i < beta.numel(); ++i) beta.data<float>()[i] = 1.f / (1.f + std::exp(-beta.data<float>()[i]));
  Tensor s0 = randn({Hv, dk, dv}, rng, 0.5f);
  // Each backend has its own stream: each one gets its own inputs and outputs.
  Tensor sa = dev(s0), sb = tok->to_device(s0);
  Tensor oa = poisoned(DType::F32, {T, Hv, dv}), ta = poisoned(DType::F32, {Hv, dk, dk});
  Tensor ob = tok->alloc(DType::F32, {T, Hv, dv}), tb = tok->alloc(DType::F32, {Hv, dk, dk});
  gpu->gated_delta_rule(dev(q), dev(k), dev(v), dev(g), dev(beta), true, sa, oa, &ta);
  tok->gated_delta_rule(tok->to_device(q), tok->to_device(k), tok->to_device(v), tok->to_device(g),
                        tok->to_device(beta), true, sb, ob, &tb);
  Tensor ref_o = tok->to_host(ob), ref_s = tok->to_host(sb), ref_t = tok->to_host(tb);
  EXPECT_LE(err(oa, ref_o), 1e-4);
  EXPECT_LE(err(sa, ref_s), 1e-4);
  EXPECT_LE(err(ta, ref_t), 1e-4);
}

// The tensor-core chunked form (bf16 operands, f32 accumulation and state: the default outside
// precise mode for dk 128) against the token recurrence in f32 on the same GPU: ragged last chunks,
// dv 128 and 96 (an output block half past dv), GQA, with and without T_C, and a strong decay.
// bf16 operands give relative errors of a few 1e-3 (METHOD.md: 1e-3 to 1e-2).
TEST_F(CudaOps, GatedDeltaChunkedTensorCoresMatchTokenKernel) {
  std::unique_ptr<Backend> tok = cuda_with_gdn("token");
  struct Case {
    int64_t T, Hk, Hv, dv;
    float gscale;
  };
  for (Case c :
       {Case{128, 1, 1, 128, 0.3f}, Case{777, 2, 4, 128, 0.3f}, Case{1000, 1, 3, 96, 0.05f}, Case{300, 2, 2, 32, 2.f}})
    for (bool with_t : {false, true}) {
      SCOPED_TRACE("T=" + std::to_string(c.T) + " dv=" + std::to_string(c.dv) + (with_t ? " with T_C" : ""));
      const int64_t dk = 128;
      Tensor q = randn({c.T, c.Hk, dk}, rng), k = randn({c.T, c.Hk, dk}, rng), v = randn({c.T, c.Hv, c.dv}, rng);
      Tensor g = randn({c.T, c.Hv}, rng, c.gscale), beta = randn({c.T, c.Hv}, rng);
      for (int64_t i = 0; i < g.numel(); ++i) g.data<float>()[i] = -std::abs(g.data<float>()[i]);
      for (int64_t i = 0; i < beta.numel(); ++i) beta.data<float>()[i] = 1.f / (1.f + std::exp(-beta.data<float>()[i]));
      Tensor s0 = randn({c.Hv, dk, c.dv}, rng, 0.5f);
      Tensor sa = dev(s0), sb = tok->to_device(s0);
      Tensor oa = poisoned(DType::F32, {c.T, c.Hv, c.dv}), ta = poisoned(DType::F32, {c.Hv, dk, dk});
      Tensor ob = tok->alloc(DType::F32, {c.T, c.Hv, c.dv}), tb = tok->alloc(DType::F32, {c.Hv, dk, dk});
      gpu->gated_delta_rule(dev(q), dev(k), dev(v), dev(g), dev(beta), true, sa, oa, with_t ? &ta : nullptr);
      tok->gated_delta_rule(tok->to_device(q), tok->to_device(k), tok->to_device(v), tok->to_device(g),
                            tok->to_device(beta), true, sb, ob, with_t ? &tb : nullptr);
      Tensor ref_o = tok->to_host(ob), ref_s = tok->to_host(sb), ref_t = tok->to_host(tb);
      const double eo = err(oa, ref_o), es = err(sa, ref_s);
      EXPECT_LE(eo, 1e-2);
      EXPECT_LE(es, 1e-2);
      EXPECT_GT(eo, 0.0) << "bit-identical to the f32 kernel: the tensor-core form did not run";
      if (with_t) {
        EXPECT_LE(err(ta, ref_t), 1e-2);
      }
      std::printf("tc vs f32 token kernel, T=%lld dv=%lld%s: out %.2e state %.2e\n", static_cast<long long>(c.T),
                  static_cast<long long>(c.dv), with_t ? " +T_C" : "", eo, es);
    }
}

// The shared entries' payload checksum on the GPU equals the host reference (Backend's loop),
// with pieces of every size mod 4 and a piece large enough to need many blocks; a changed byte
// changes it, and so does a piece moved to another offset.
TEST_F(CudaOps, PayloadChecksumMatchesTheHostLoop) {
  std::mt19937 rng(17);
  std::vector<Tensor> host, devs;
  for (int64_t n : {int64_t{1}, int64_t{3}, int64_t{17}, int64_t{1000003}, int64_t{5}})
    host.push_back(as(randn({n}, rng), n % 2 ? DType::BF16 : DType::F32));
  host.push_back(Tensor::empty(DType::U8, {7}));
  for (auto& h : host) devs.push_back(dev(h));
  std::vector<const Tensor*> hp, dp;
  std::vector<uint64_t> offs;
  uint64_t o = 0;
  for (size_t i = 0; i < host.size(); ++i) {
    hp.push_back(&host[i]);
    dp.push_back(&devs[i]);
    offs.push_back(o);
    o += (host[i].nbytes() + 255) / 256 * 256;
  }
  const uint64_t want = cpu->payload_checksum(hp, offs);
  EXPECT_EQ(gpu->payload_checksum(dp, offs), want);
  std::vector<uint64_t> moved = offs;
  moved[3] += 256;
  EXPECT_NE(gpu->payload_checksum(dp, moved), want);
  static_cast<uint8_t*>(host[3].raw())[123457] ^= 4;
  Tensor changed = dev(host[3]);
  dp[3] = &changed;
  EXPECT_NE(gpu->payload_checksum(dp, offs), want);
  EXPECT_EQ(gpu->payload_checksum(dp, offs), cpu->payload_checksum(hp, offs));
}

TEST_F(CudaOps, ComposeStateAndIdentity) {
  const int64_t H = 3, dk = 40, dv = 56;
  Tensor T = randn({H, dk, dk}, rng, 0.2f), S = randn({H, dk, dv}, rng), B = randn({H, dk, dv}, rng);
  for (float alpha : {1.f, 0.5f}) {
    Tensor oc = cpu->alloc(DType::F32, {H, dk, dv}), og = poisoned(DType::F32, {H, dk, dv});
    cpu->compose_state(T, S, B, alpha, oc);
    gpu->compose_state(dev(T), dev(S), dev(B), alpha, og);
    EXPECT_LE(err(og, oc), 1e-5);
  }
  Tensor ic = cpu->alloc(DType::F32, {H, dk, dk}), ig = poisoned(DType::F32, {H, dk, dk});
  cpu->set_identity(ic);
  gpu->set_identity(ig);
  EXPECT_EQ(err(ig, ic), 0.0);
}

// The other families' recurrences (linear_recurrence.cu, the token kernel) against the CPU's chunked
// kernels: every family, dk 16 / 48 (padded rows) / 128 / 64, dv unlike dk and not a multiple of the
// column blocks, grouped key heads, T 0 / 1 / 37 / 300, the norm on and off, from a nonzero state.
// Each call three times: no transition, dense T_C, and the scaled identity where the family has one.
// Error: the largest difference over the largest reference magnitude.
TEST_F(CudaOps, LinearRecurrenceEveryFamilyMatchesCpu) {
  struct Case {
    int64_t T, Hk, Hv, dk, dv;
  };
  auto rel = [&](const Tensor& got, const Tensor& want) {
    Tensor g = gpu->to_host(got).to_f32(), w = want.to_f32();
    EXPECT_EQ(g.shape(), w.shape());
    double num = 0, den = 0;
    for (int64_t i = 0; i < g.numel() && i < w.numel(); ++i) {
      const double a = g.data<float>()[i], b = w.data<float>()[i];
      if (!std::isfinite(a)) return std::numeric_limits<double>::infinity();
      num = std::max(num, std::abs(a - b));
      den = std::max(den, std::abs(b));
    }
    return num / std::max(den, 1e-30);
  };
  auto dev_or_none = [&](const Tensor& t) { return t.defined() ? dev(t) : Tensor(); };
  auto neg_softplus = [](Tensor t, float scale) {
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = -scale * std::log1p(std::exp(t.data<float>()[i]));
    return t;
  };
  for (linear::Family f : linear::kAllFamilies) {
    const linear::FamilyTraits tr = linear::traits(f);
    const bool scaled_ok = !tr.delta && tr.decay != linear::Decay::Channel;
    for (Case c : {Case{0, 1, 2, 16, 24}, Case{1, 2, 4, 48, 40}, Case{37, 1, 3, 16, 20}, Case{37, 2, 4, 48, 64},
                   Case{37, 1, 2, 128, 72}, Case{300, 1, 2, 48, 24}, Case{300, 2, 4, 16, 33}, Case{300, 1, 1, 64, 8}})
      for (bool l2 : {false, true}) {
        SCOPED_TRACE(std::string(tr.name) + " T=" + std::to_string(c.T) + " dk=" + std::to_string(c.dk) +
                     " dv=" + std::to_string(c.dv) + " l2=" + std::to_string(l2));
        const int64_t T = c.T, Hk = c.Hk, Hv = c.Hv, dk = c.dk, dv = c.dv;
        // Without the norm, |k| ~ 0.8 keeps I - beta k k^T from amplifying. Long spans decay slowly,
        // so T_C stays well inside f32's range.
        const float qk = l2 ? 1.f : 0.8f / std::sqrt(static_cast<float>(dk)), gscale = T > 100 ? 0.05f : 1.f;
        Tensor q = randn({T, Hk, dk}, rng, qk), k = randn({T, Hk, dk}, rng, qk), v = randn({T, Hv, dv}, rng);
        Tensor g, beta, lg;
        if (tr.decay == linear::Decay::Scalar) g = neg_softplus(randn({T, Hv}, rng), gscale);
        if (tr.decay == linear::Decay::Channel) g = neg_softplus(randn({T, Hv, dk}, rng), gscale);
        if (tr.delta) {
          beta = randn({T, Hv}, rng);
          for (int64_t i = 0; i < beta.numel(); ++i)
            beta.data<float>()[i] = 1.f / (1.f + std::exp(-beta.data<float>()[i]));
        }
        if (tr.decay == linear::Decay::FixedScalar) {
          lg = Tensor::empty(DType::F32, {Hv});
          for (int64_t h = 0; h < Hv; ++h)
            lg.data<float>()[h] = std::log(1.f - std::exp2(-3.f - static_cast<float>(h)));
        }
        const Backend::Recurrence r{f, l2, l2 ? 0.6f : 1.3f};
        const Tensor s0 = randn({Hv, dk, dv}, rng, 0.5f);
        const Tensor qd = dev(q), kd = dev(k), vd = dev(v), gd = dev_or_none(g), bd = dev_or_none(beta),
                     ld = dev_or_none(lg);
        for (int form = 0; form < 3; ++form) {  // no transition, dense, scaled identity
          if (form == 2 && !scaled_ok) continue;
          SCOPED_TRACE("transition form " + std::to_string(form));
          const Shape ts = form == 2 ? Shape{Hv, 1, 1} : Shape{Hv, dk, dk};
          Tensor sc = s0.clone(), sg = dev(s0);
          Tensor oc = cpu->alloc(DType::F32, {T, Hv, dv}), og = poisoned(DType::F32, {T, Hv, dv});
          Tensor tc = cpu->alloc(DType::F32, ts), tg = poisoned(DType::F32, ts);
          cpu->linear_recurrence(r, q, k, v, g, beta, lg, sc, oc, form ? &tc : nullptr);
          gpu->linear_recurrence(r, qd, kd, vd, gd, bd, ld, sg, og, form ? &tg : nullptr);
          EXPECT_LE(rel(og, oc), 1e-4);
          EXPECT_LE(rel(sg, sc), 1e-4);
          if (form) {
            EXPECT_LE(rel(tg, tc), 1e-4);
          }
        }
      }
  }
  // Key heads above the token kernel's registers are refused by name.
  Tensor q = gpu->alloc(DType::F32, {2, 1, 256}), v = gpu->alloc(DType::F32, {2, 1, 8});
  Tensor st = gpu->alloc(DType::F32, {1, 256, 8}), out = gpu->alloc(DType::F32, {2, 1, 8});
  EXPECT_NE(error_of([&] {
              gpu->linear_recurrence({linear::Family::LinearAttention}, q, q, v, Tensor(), Tensor(), Tensor(), st, out);
            }).find("linear_recurrence: key head dim 256"),
            std::string::npos);
}

// compose_state with T [H, 1, 1] (a scaled identity per head, the T_C of Mamba2 and lightning),
// f32 and bf16, out a fresh tensor or B itself.
TEST_F(CudaOps, ComposeStateWithScaledIdentity) {
  const int64_t H = 3, dk = 40, dv = 56;
  Tensor T = randn({H, 1, 1}, rng), S = randn({H, dk, dv}, rng), B = randn({H, dk, dv}, rng);
  for (DType dt : {DType::F32, DType::BF16})
    for (float alpha : {1.f, -0.5f}) {
      const Tensor Tt = dt == DType::F32 ? T : as(T, dt);
      Tensor oc = cpu->alloc(DType::F32, {H, dk, dv}), og = poisoned(DType::F32, {H, dk, dv});
      cpu->compose_state(Tt, S, B, alpha, oc);
      gpu->compose_state(dev(Tt), dev(S), dev(B), alpha, og);
      EXPECT_LE(err(og, oc), 1e-6) << dtype_name(dt) << " alpha=" << alpha;
      Tensor bg = dev(B);
      gpu->compose_state(dev(Tt), dev(S), bg, alpha, bg);
      EXPECT_LE(err(bg, oc), 1e-6) << "in place, " << dtype_name(dt) << " alpha=" << alpha;
    }
}

TEST_F(CudaOps, MoeExperts) {
  // Up to 256 slots: the few-slot kernels; 300 (16-bit weights): the grouped tensor-core kernels
  // (several M tiles per expert, K not a multiple of their 64-column stages, fewer output columns
  // than a block's); 2100 and 9000: the grouped GEMM (partial 128-row tiles, ~1100 rows an
  // expert); with grouped off, cuBLAS's batched products; f32 weights: cuBLAS.
  for (DType wd : {DType::F32, DType::BF16, DType::F16})
    for (int64_t T : {1, 9, 40, 100, 700, 3000})
      for (bool grouped : {true, false}) {
#if HYPIC_HAVE_CUDA
        cuda::set_moe_grouped(grouped);
#endif
        const int64_t E = 8, H = 48, I = 32;
        const int top_k = 3;
        Tensor x = randn({T, H}, rng), logits = randn({T, E}, rng, 2.f);
        Tensor gu = as(randn({E * 2 * I, H}, rng, 0.2f), wd), dn = as(randn({E * H, I}, rng, 0.2f), wd);
        ExpertWeights ec, eg;
        Tensor gug = dev(gu), dng = dev(dn);
        for (int64_t e = 0; e < E; ++e) {
          ec.gate.push_back(gu.slice_rows(2 * e * I, 2 * e * I + I));
          ec.up.push_back(gu.slice_rows(2 * e * I + I, 2 * (e + 1) * I));
          ec.down.push_back(dn.slice_rows(e * H, (e + 1) * H));
          eg.gate.push_back(gug.slice_rows(2 * e * I, 2 * e * I + I));
          eg.up.push_back(gug.slice_rows(2 * e * I + I, 2 * (e + 1) * I));
          eg.down.push_back(dng.slice_rows(e * H, (e + 1) * H));
        }
        for (bool norm : {false, true}) {
          Tensor oc = cpu->alloc(DType::F32, {T, H}), og = poisoned(DType::F32, {T, H});
          cpu->moe_experts(x, logits, top_k, norm, ec, oc);
          gpu->moe_experts(dev(x), dev(logits), top_k, norm, eg, og);
          const double tol = wd == DType::F32 || T * top_k <= 256 ? 1e-5 : 1e-2;  // few slots: f32 activations
          EXPECT_LE(err(og, oc), tol) << "T=" << T << " " << dtype_name(wd) << (grouped ? " grouped" : " cublas");
          // The block's end in one op (shared expert and residual folded into the combine): bit for
          // bit the separate ops' result (the base class runs them), and the CPU's within tol.
          Tensor sh = randn({T, H}, rng), sg = randn({T, 1}, rng, 2.f), x0 = randn({T, H}, rng);
          for (bool with_shared : {true, false}) {
            const Tensor shc = with_shared ? sh : Tensor(), sgc = with_shared ? sg : Tensor();
            const Tensor shg = with_shared ? dev(sh) : Tensor(), sgg = with_shared ? dev(sg) : Tensor();
            Tensor xc = x0.clone(), xf = dev(x0), xs = dev(x0);
            cpu->moe_experts_add(x, logits, top_k, norm, ec, shc, sgc, xc);
            gpu->moe_experts_add(dev(x), dev(logits), top_k, norm, eg, shg, sgg, xf);
            gpu->Backend::moe_experts_add(dev(x), dev(logits), top_k, norm, eg, shg, sgg, xs);
            EXPECT_EQ(err(xf, gpu->to_host(xs)), 0.0) << "T=" << T << " shared " << with_shared;
            EXPECT_LE(err(xf, xc), tol) << "T=" << T << " shared " << with_shared;
          }
        }
      }
#if HYPIC_HAVE_CUDA
  cuda::set_moe_grouped(true);
#endif
}

// DeepSeek-V3's routing on the device (k_route_sigmoid) and ReLU^2 experts against the CPU: decode
// sizes (the few-slot kernels), a PIC composition's and a prefill's (grouped kernels for SwiGLU,
// cuBLAS for ReLU^2); groups that decide (8 of 64 experts a group, 3 groups kept) and none (1 group);
// 1000 experts, the widest a warp holds.
TEST_F(CudaOps, MoeExpertsSigmoidGroupedRoutingMatchesCpu) {
  struct Case {
    int64_t E, n_group, topk_group;
    int top_k;
  };
  for (Case c : {Case{64, 8, 3, 6}, Case{16, 1, 1, 4}, Case{1000, 1, 1, 8}})
    for (DType wd : {DType::F32, DType::BF16})
      for (bool relu2 : {false, true})
        for (int64_t T : {1, 9, 40, 700}) {
          if (c.E == 1000 && (T > 9 || wd == DType::F32)) continue;  // its weights are the largest
          const int64_t H = 48, I = 32, E = c.E;
          Tensor x = randn({T, H}, rng), logits = randn({T, E}, rng, 2.f), bias = randn({E}, rng, 0.3f);
          ExpertWeights ec, eg;
          for (int64_t e = 0; e < E; ++e) {
            if (!relu2) ec.gate.push_back(as(randn({I, H}, rng, 0.2f), wd));
            ec.up.push_back(as(randn({I, H}, rng, 0.2f), wd));
            ec.down.push_back(as(randn({H, I}, rng, 0.2f), wd));
          }
          for (const Tensor& t : ec.gate) eg.gate.push_back(dev(t));
          for (const Tensor& t : ec.up) eg.up.push_back(dev(t));
          for (const Tensor& t : ec.down) eg.down.push_back(dev(t));
          for (bool norm : {false, true}) {
            MoeRouter rc;
            rc.top_k = c.top_k;
            rc.norm_topk = norm;
            rc.sigmoid = true;
            rc.bias = bias;
            rc.n_group = c.n_group;
            rc.topk_group = c.topk_group;
            rc.scaling = 1.7f;
            MoeRouter rg = rc;
            rg.bias = dev(bias);
            Tensor oc = cpu->alloc(DType::F32, {T, H}), og = poisoned(DType::F32, {T, H});
            cpu->moe_experts(x, logits, rc, ec, oc);
            gpu->moe_experts(dev(x), dev(logits), rg, eg, og);
            const double tol = wd == DType::F32 || T * c.top_k <= 256 ? 1e-5 : 1e-2;  // few slots: f32 activations
            EXPECT_LE(err(og, oc), tol) << "E=" << E << " T=" << T << " " << dtype_name(wd) << " relu2=" << relu2
                                        << " norm=" << norm;
          }
        }
}

// A decode step's routing in one launch (k_route_few) gives what the three kernels give: the same
// experts, weights, ranks, counts and order, ties included (256 experts, top 8, as Qwen3.5-35B-A3B;
// and expert counts for each width of the per-lane kernels: 8, 100, 512, 1000). Both match a plain
// softmax + top-k on the host.
TEST_F(CudaOps, MoeRouteOrderInOneLaunchMatchesThreeKernels) {
#if HYPIC_HAVE_CUDA
  for (const auto& [E, top_k] : std::vector<std::pair<int64_t, int>>{{256, 8}, {8, 2}, {100, 8}, {512, 10}, {1000, 8}})
    for (int64_t T : {1, 3, 32})
      for (bool norm : {true, false}) {
        Tensor lh = randn({T, E}, rng, 2.f);
        for (int64_t e = 0; e < std::min<int64_t>(12, E / 3); ++e)
          lh.data<float>()[e * 3] = 20.f;  // token 0: a tie across the top-k boundary
        Tensor logits = dev(lh);
        const int64_t n = T * top_k;
        Tensor a[6], b[6];  // sel, w, rank, counts, order, pos
        for (Tensor* t : {a, b}) {
          t[0] = gpu->alloc(DType::I32, {n}), t[1] = gpu->alloc(DType::F32, {n}), t[2] = gpu->alloc(DType::I32, {n});
          t[3] = gpu->alloc(DType::I32, {E}), t[4] = gpu->alloc(DType::I32, {n}), t[5] = gpu->alloc(DType::I32, {n});
        }
        Tensor offs_a = gpu->alloc(DType::I32, {E}), offs_b = gpu->alloc(DType::I32, {E});
        gpu->synchronize();
        cuda::launch_moe_route(nullptr, logits.data<float>(), T, E, top_k, norm, a[0].data<int32_t>(),
                               a[1].data<float>(), a[2].data<int32_t>(), a[3].data<int32_t>());
        cuda::launch_moe_order(nullptr, a[0].data<int32_t>(), a[2].data<int32_t>(), a[3].data<int32_t>(), E, n,
                               a[4].data<int32_t>(), offs_a.data<int32_t>(), a[5].data<int32_t>());
        cuda::launch_moe_route_order(nullptr, logits.data<float>(), T, E, top_k, norm, b[0].data<int32_t>(),
                                     b[1].data<float>(), b[2].data<int32_t>(), b[3].data<int32_t>(),
                                     b[4].data<int32_t>(), offs_b.data<int32_t>(), b[5].data<int32_t>());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const char* names[6] = {"sel", "weights", "rank", "counts", "order", "pos"};
        for (int i = 0; i < 6; ++i) {
          Tensor ha = gpu->to_host(a[i]), hb = gpu->to_host(b[i]);
          ASSERT_EQ(std::memcmp(ha.raw(), hb.raw(), ha.nbytes()), 0) << names[i] << " T=" << T;
        }
        Tensor ho = gpu->to_host(offs_a), hp = gpu->to_host(offs_b);
        EXPECT_EQ(std::memcmp(ho.raw(), hp.raw(), ho.nbytes()), 0) << "offsets T=" << T;
        Tensor sel = gpu->to_host(a[0]), wt = gpu->to_host(a[1]);
        if (E == 256 && T == 1) {  // the tie: the lower expert indices win
          for (int j = 0; j < top_k; ++j) EXPECT_EQ(sel.data<int32_t>()[j], 3 * j) << j;
        }
        for (int64_t t = 0; t < T; ++t) {  // the host's softmax + top-k (stable: lower index first)
          const float* l = lh.data<float>() + t * E;
          const double mx = *std::max_element(l, l + E);
          std::vector<double> pr(E);
          double sum = 0;
          for (int64_t e = 0; e < E; ++e) sum += pr[e] = std::exp(l[e] - mx);
          std::vector<int> idx(E);
          std::iota(idx.begin(), idx.end(), 0);
          std::stable_sort(idx.begin(), idx.end(), [&](int i, int j) { return pr[i] > pr[j]; });
          double picked = 0;
          for (int j = 0; j < top_k; ++j) picked += pr[idx[j]] / sum;
          for (int j = 0; j < top_k; ++j) {
            EXPECT_EQ(sel.data<int32_t>()[t * top_k + j], idx[j])
                << "E=" << E << " T=" << T << " t=" << t << " j=" << j;
            const double want = pr[idx[j]] / sum / (norm ? picked : 1.0);
            EXPECT_NEAR(wt.data<float>()[t * top_k + j], want, 1e-5 * want + 1e-7) << "E=" << E << " j=" << j;
          }
        }
        Tensor cnt = gpu->to_host(a[3]);
        int64_t total = 0;
        for (int64_t e = 0; e < E; ++e) total += cnt.data<int32_t>()[e];
        EXPECT_EQ(total, n) << "E=" << E << " T=" << T;
      }
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

// The grouped MoE GEMM on Hopper's warpgroup MMA against the mma.sync kernel (same bf16 operands,
// another order of f32 sums) and the CPU, at sizes where every expert has several 128-slot tiles
// and a partial one, K a multiple of the 64-column stages and not, N short of a block's columns.
TEST_F(CudaOps, MoeGroupedGemmWgmmaMatchesMmaKernel) {
#if HYPIC_HAVE_CUDA
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  if (prop.major != 9) GTEST_SKIP() << "wgmma needs a Hopper GPU (sm_90), this one is sm_" << prop.major << prop.minor;
  ASSERT_TRUE(cuda::wgmma_available());
  struct Case {
    int64_t T, E, H, I;
    int top_k;
  };
  for (Case c : {Case{3000, 16, 256, 128, 4}, Case{1500, 8, 200, 40, 2}, Case{2500, 32, 512, 96, 8}}) {
    Tensor x = randn({c.T, c.H}, rng), logits = randn({c.T, c.E}, rng, 2.f);
    Tensor gu = as(randn({c.E * 2 * c.I, c.H}, rng, 0.2f), DType::BF16);
    Tensor dn = as(randn({c.E * c.H, c.I}, rng, 0.2f), DType::BF16);
    ExpertWeights ec, eg;
    Tensor gug = dev(gu), dng = dev(dn);
    for (int64_t e = 0; e < c.E; ++e) {
      ec.gate.push_back(gu.slice_rows(2 * e * c.I, 2 * e * c.I + c.I));
      ec.up.push_back(gu.slice_rows(2 * e * c.I + c.I, 2 * (e + 1) * c.I));
      ec.down.push_back(dn.slice_rows(e * c.H, (e + 1) * c.H));
      eg.gate.push_back(gug.slice_rows(2 * e * c.I, 2 * e * c.I + c.I));
      eg.up.push_back(gug.slice_rows(2 * e * c.I + c.I, 2 * (e + 1) * c.I));
      eg.down.push_back(dng.slice_rows(e * c.H, (e + 1) * c.H));
    }
    Tensor oc = cpu->alloc(DType::F32, {c.T, c.H});
    cpu->moe_experts(x, logits, c.top_k, true, ec, oc);
    Tensor xd = dev(x), ld = dev(logits);
    Tensor og[2] = {poisoned(DType::F32, {c.T, c.H}), poisoned(DType::F32, {c.T, c.H})};
    for (int on : {0, 1}) {
      cuda::set_moe_wgmma(on);
      const int64_t before = cuda::moe_wgmma_launches();
      gpu->moe_experts(xd, ld, c.top_k, true, eg, og[on]);
      EXPECT_EQ(cuda::moe_wgmma_launches() - before, 2 * on) << "T=" << c.T << " wgmma " << on;  // gate+up, down
    }
    cuda::set_moe_wgmma(-1);
    Tensor mma = gpu->to_host(og[0]);
    const double to_mma = err(og[1], mma), to_cpu = err(og[1], oc);
    EXPECT_LE(to_mma, 2e-3) << "T=" << c.T << " H=" << c.H << " I=" << c.I;
    EXPECT_LE(to_cpu, 1e-2) << "T=" << c.T;
    std::printf("wgmma moe T=%lld E=%lld H=%lld I=%lld: rel. error to mma.sync %.2e, to cpu %.2e\n",
                static_cast<long long>(c.T), static_cast<long long>(c.E), static_cast<long long>(c.H),
                static_cast<long long>(c.I), to_mma, to_cpu);
  }
#endif
}

// The device draw: greedy rows equal the reference; sampled rows pick an id whose running mass
// brackets u * total (float sums on the device against double ones here), never a masked id.
TEST_F(CudaOps, SampleRowsDrawsByTheRunningMass) {
  const int64_t V = 248320, R = 12;
  Tensor x = randn({R, V}, rng, 3.f);
  for (int64_t i = 0; i < V; ++i) x.data<float>()[11 * V + i] = i % 7 == 0 ? 20.f : -20.f;  // a peaked row
  std::vector<float> par(static_cast<size_t>(3 * R));
  std::uniform_real_distribution<float> uni(0.f, 1.f);
  for (int64_t r = 0; r < R; ++r) {
    par[static_cast<size_t>(3 * r)] = r % 3 == 0 ? 0.f : (r % 3 == 1 ? 0.7f : 1.3f);
    par[static_cast<size_t>(3 * r + 1)] = uni(rng);
    par[static_cast<size_t>(3 * r + 2)] = r % 2 ? 1.f : 0.f;
  }
  Tensor mask = Tensor::empty(DType::U8, {V});  // a padded tail and a few ids inside
  for (int64_t i = 0; i < V; ++i) mask.data<uint8_t>()[i] = i >= 151669 || i % 1000 == 1;
  Tensor p = Tensor::empty(DType::F32, {R, 3});
  std::copy(par.begin(), par.end(), p.data<float>());
  Tensor ref = Tensor::empty(DType::I32, {R}), got = gpu->alloc(DType::I32, {R});
  cpu->sample_rows(x, p, mask, ref);
  gpu->sample_rows(dev(x), dev(p), dev(mask), got);
  Tensor g = gpu->to_host(got);
  for (int64_t r = 0; r < R; ++r) {
    const float t = par[static_cast<size_t>(3 * r)], u = par[static_cast<size_t>(3 * r + 1)];
    const bool masked = r % 2;
    auto on = [&](int64_t i) { return !masked || !mask.data<uint8_t>()[i]; };
    const int32_t id = g.data<int32_t>()[r];
    ASSERT_GE(id, 0);
    ASSERT_LT(id, V);
    ASSERT_TRUE(on(id)) << "row " << r << " drew masked id " << id;
    if (t == 0.f || r == 11) {
      EXPECT_EQ(id, ref.data<int32_t>()[r]) << "row " << r;
      continue;
    }
    const float* row = x.data<float>() + r * V;
    float mx = -INFINITY;
    for (int64_t i = 0; i < V; ++i)
      if (on(i)) mx = std::max(mx, row[i]);
    double total = 0, before = 0;
    for (int64_t i = 0; i < V; ++i) {
      const double w = on(i) ? std::exp((row[i] - mx) / t) : 0.0;
      if (i < id) before += w;
      total += w;
    }
    const double after = before + std::exp((row[id] - mx) / t), target = u * total;
    EXPECT_LE(before, target + 1e-5 * total) << "row " << r;
    EXPECT_GE(after, target - 1e-5 * total) << "row " << r;
  }
}

TEST_F(CudaOps, BadInputIsRejectedWithAClearError) {
  Tensor x = randn({4, 8}, rng);
  Tensor w = gpu->alloc(DType::F32, {5, 8}), y = gpu->alloc(DType::F32, {4, 5});
  EXPECT_NE(error_of([&] { gpu->matmul(x, w, y); }).find("not on the cuda device"), std::string::npos);
  Tensor bad = gpu->alloc(DType::F32, {4, 6});
  EXPECT_NE(error_of([&] { gpu->matmul(dev(x), w, bad); }).find("expected shape [4, 5]"), std::string::npos);
  Tensor q = gpu->alloc(DType::F32, {2, 3, 8}), k = gpu->alloc(DType::F32, {4, 2, 8}),
         o = gpu->alloc(DType::F32, {2, 3, 8});
  EXPECT_NE(error_of([&] { gpu->attention(q, k, k, 4, 0, 1.f, o); }).find("not a multiple"), std::string::npos);
  std::vector<int32_t> ids = {3, 99};
  Tensor tab = gpu->alloc(DType::F32, {10, 8}), e = gpu->alloc(DType::F32, {2, 8});
  EXPECT_NE(error_of([&] { gpu->embedding(tab, ids, e); }).find("out of range"), std::string::npos);
}

// Decode-step ops (one token per sequence, state addresses and positions in device tables) against
// the CPU's span ops per sequence: ragged positions, each sequence its own state, the table order
// not the allocation order.
TEST_F(CudaOps, DecodeStepOpsMatchCpuPerSequence) {
  const std::vector<int64_t> pos = {0, 5, 130, 1000, 77};
  const int64_t B = static_cast<int64_t>(pos.size());
  auto addr = [](const Tensor& t) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(t.raw())); };
  auto table = [&](const std::vector<int64_t>& v) {
    Tensor t = gpu->alloc(DType::I64, {static_cast<int64_t>(v.size())});
    gpu->write(t, v.data(), v.size() * sizeof(int64_t));
    return t;
  };
  Tensor dpos = table(pos);
  {  // conv
    const int64_t C = 72, K = 4;
    Tensor x = randn({B, C}, rng), w = as(randn({C, K}, rng, 0.5f), DType::BF16);
    std::vector<Tensor> sc, sg;
    std::vector<int64_t> tab;
    for (int64_t b = 0; b < B; ++b) {
      sc.push_back(randn({K - 1, C}, rng));
      sg.push_back(dev(sc.back()));
      tab.push_back(addr(sg.back()));
    }
    Tensor oc = cpu->alloc(DType::F32, {B, C}), og = poisoned(DType::F32, {B, C});
    for (int64_t b = 0; b < B; ++b) {
      Tensor o = oc.slice_rows(b, b + 1);
      cpu->causal_conv1d_silu(x.slice_rows(b, b + 1), w, sc[b], o);
    }
    gpu->causal_conv1d_silu_step(dev(x), dev(w), table(tab), og);
    EXPECT_LE(err(og, oc), 1e-6);
    for (int64_t b = 0; b < B; ++b) EXPECT_EQ(err(sg[b], sc[b]), 0.0) << "conv state " << b;
  }
  {  // gated delta rule
    const int64_t Hk = 2, Hv = 4, dk = 128, dv = 96;
    Tensor q = randn({B, Hk, dk}, rng), k = randn({B, Hk, dk}, rng), v = randn({B, Hv, dv}, rng);
    Tensor g = randn({B, Hv}, rng, 0.3f), beta = randn({B, Hv}, rng);
    for (int64_t i = 0; i < g.numel(); ++i) g.data<float>()[i] = -std::abs(g.data<float>()[i]);
    for (int64_t i = 0; i < beta.numel(); ++i) beta.data<float>()[i] = 1.f / (1.f + std::exp(-beta.data<float>()[i]));
    std::vector<Tensor> sc, sg;
    std::vector<int64_t> tab(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      sc.push_back(randn({Hv, dk, dv}, rng, 0.5f));
      sg.push_back(dev(sc.back()));
    }
    for (int64_t b = 0; b < B; ++b) tab[static_cast<size_t>(b)] = addr(sg[static_cast<size_t>(B - 1 - b)]);
    Tensor oc = cpu->alloc(DType::F32, {B, Hv, dv}), og = poisoned(DType::F32, {B, Hv, dv});
    for (int64_t b = 0; b < B; ++b) {
      Tensor o = oc.slice_rows(b, b + 1);
      cpu->gated_delta_rule(q.slice_rows(b, b + 1), k.slice_rows(b, b + 1), v.slice_rows(b, b + 1),
                            g.slice_rows(b, b + 1), beta.slice_rows(b, b + 1), true, sc[B - 1 - b], o);
    }
    gpu->gated_delta_rule_step(dev(q), dev(k), dev(v), dev(g), dev(beta), true, table(tab), og);
    EXPECT_LE(err(og, oc), 2e-5);
    for (int64_t b = 0; b < B; ++b) EXPECT_LE(err(sg[b], sc[b]), 2e-5) << "ssm state " << b;
  }
  {  // rope at per-row positions, then attention over each sequence's cache
    const int64_t Hq = 8, Hkv = 2, D = 128, Dv = 128, cap = 1024;
    Tensor q = randn({B, Hq, D}, rng), k = randn({B, Hkv, D}, rng), v = randn({B, Hkv, Dv}, rng);
    Tensor qc = q.clone(), kc = k.clone(), qg = dev(q), kg = dev(k);
    cpu->rope_neox(qc, std::span<const int64_t>(pos), 64, 1e7);
    cpu->rope_neox(kc, std::span<const int64_t>(pos), 64, 1e7);
    gpu->rope_neox(qg, dpos, 64, 1e7);
    gpu->rope_neox(kg, dpos, 64, 1e7);
    EXPECT_LE(err(qg, qc), 1e-6);
    EXPECT_LE(err(kg, kc), 1e-6);
    std::vector<Tensor> kcache_c, vcache_c, kcache_g, vcache_g;
    std::vector<int64_t> tab(static_cast<size_t>(2 * B));
    for (int64_t b = 0; b < B; ++b) {
      kcache_c.push_back(randn({cap, Hkv, D}, rng));
      vcache_c.push_back(randn({cap, Hkv, Dv}, rng));
      kcache_g.push_back(dev(kcache_c.back()));
      vcache_g.push_back(dev(vcache_c.back()));
      tab[static_cast<size_t>(b)] = addr(kcache_g.back());
      tab[static_cast<size_t>(B + b)] = addr(vcache_g.back());
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    Tensor oc = cpu->alloc(DType::F32, {B, Hq, Dv}), og = poisoned(DType::F32, {B, Hq, Dv});
    std::vector<int64_t> ctab(static_cast<size_t>(2 * B));
    for (int64_t b = 0; b < B; ++b) ctab[b] = addr(kcache_c[b]), ctab[B + b] = addr(vcache_c[b]);
    cpu->attention_step(qc, kc, v, host_i64(ctab), host_i64(pos), scale, oc);
    gpu->attention_step(qg, kg, dev(v), table(tab), dpos, scale, og);
    EXPECT_LE(err(og, oc), 1e-5);
    for (int64_t b = 0; b < B; ++b) {
      EXPECT_LE(err(kcache_g[b], kcache_c[b]), 1e-6) << "key cache " << b;  // rows written after rope
      EXPECT_EQ(err(vcache_g[b], vcache_c[b]), 0.0) << "value cache " << b;
    }
  }
}

// The batched decode attention groups the query heads of one key head in a block (8, 4, 2 or 1
// of them): every grouping, head size and split count (a long cache, a 1-key sequence) against
// the CPU per sequence.
TEST_F(CudaOps, DecodeAttentionGroupsQueryHeadsOfAKeyHead) {
  struct Shape {
    int64_t Hq, Hkv, D;
  };
  auto addr = [](const Tensor& t) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(t.raw())); };
  for (const Shape sh : {Shape{16, 2, 256}, Shape{16, 1, 128}, Shape{6, 3, 64}, Shape{5, 5, 96}, Shape{12, 4, 256}})
    for (const std::vector<int64_t>& pos : {std::vector<int64_t>{0, 4100, 17}, std::vector<int64_t>{2999}}) {
      const int64_t B = static_cast<int64_t>(pos.size()), cap = 4200, D = sh.D;
      Tensor q = randn({B, sh.Hq, D}, rng), k = randn({B, sh.Hkv, D}, rng), v = randn({B, sh.Hkv, D}, rng);
      std::vector<Tensor> kc, vc, kg, vg;
      std::vector<int64_t> ctab(static_cast<size_t>(2 * B)), gtab(static_cast<size_t>(2 * B));
      for (int64_t b = 0; b < B; ++b) {
        kc.push_back(randn({cap, sh.Hkv, D}, rng));
        vc.push_back(randn({cap, sh.Hkv, D}, rng));
        kg.push_back(dev(kc.back()));
        vg.push_back(dev(vc.back()));
        ctab[static_cast<size_t>(b)] = addr(kc.back()), ctab[static_cast<size_t>(B + b)] = addr(vc.back());
        gtab[static_cast<size_t>(b)] = addr(kg.back()), gtab[static_cast<size_t>(B + b)] = addr(vg.back());
      }
      Tensor dtab = gpu->alloc(DType::I64, {2 * B}), dpos = gpu->alloc(DType::I64, {B});
      gpu->write(dtab, gtab.data(), gtab.size() * sizeof(int64_t));
      gpu->write(dpos, pos.data(), pos.size() * sizeof(int64_t));
      const float scale = 1.0f / std::sqrt(static_cast<float>(D));
      Tensor oc = cpu->alloc(DType::F32, {B, sh.Hq, D}), og = poisoned(DType::F32, {B, sh.Hq, D});
      cpu->attention_step(q, k, v, host_i64(ctab), host_i64(pos), scale, oc);
      gpu->attention_step(dev(q), dev(k), dev(v), dtab, dpos, scale, og);
      EXPECT_LE(err(og, oc), 1e-5) << sh.Hq << "/" << sh.Hkv << " heads, D " << D << ", B " << B;
    }
}

// A recorded graph replays the recorded work on new table contents: the step ops read their
// inputs on the device, so a replay after write() equals running the ops again.
TEST_F(CudaOps, CapturedStepReplaysOnNewInputs) {
  const int64_t B = 3, C = 40, K = 4, H = 24, V = 50;
  Tensor w = dev(as(randn({C, K}, rng, 0.5f), DType::BF16)), table_w = dev(randn({V, H}, rng));
  Tensor proj = dev(as(randn({C, H}, rng, 0.2f), DType::BF16));
  std::vector<Tensor> states_a, states_b;
  for (int64_t b = 0; b < B; ++b) {
    Tensor s = randn({K - 1, C}, rng);
    states_a.push_back(dev(s));
    states_b.push_back(dev(s));
  }
  auto addr = [](const Tensor& t) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(t.raw())); };
  Tensor ids = gpu->alloc(DType::I32, {B}), tab = gpu->alloc(DType::I64, {B});
  Tensor out;
  auto body = [&] {
    Tensor x = gpu->alloc_uninit(DType::F32, {B, H});
    gpu->embedding(table_w, ids, x);
    Tensor y = gpu->alloc_uninit(DType::F32, {B, C});
    gpu->matmul(x, proj, y);
    out = gpu->alloc_uninit(DType::F32, {B, C});
    gpu->causal_conv1d_silu_step(y, w, tab, out);
  };
  auto set = [&](const std::vector<Tensor>& st, std::vector<int32_t> id) {
    std::vector<int64_t> t;
    for (const auto& s : st) t.push_back(addr(s));
    gpu->write(tab, t.data(), t.size() * sizeof(int64_t));
    gpu->write(ids, id.data(), id.size() * sizeof(int32_t));
  };
  // A warm-up outside the recording, on both state sets so that they stay equal.
  set(states_a, {1, 2, 3});
  body();
  set(states_b, {1, 2, 3});
  body();
  auto graph = gpu->capture(body);
  ASSERT_NE(graph, nullptr);
  Tensor graph_out = out;
  for (int step = 0; step < 3; ++step) {
    const std::vector<int32_t> id = {int32_t(7 * step % V), int32_t((11 + step) % V), int32_t((40 + 3 * step) % V)};
    set(states_a, id);
    graph->replay();
    Tensor got = gpu->to_host(graph_out);
    set(states_b, id);
    body();
    EXPECT_EQ(err(got, gpu->to_host(out)), 0.0) << "step " << step;
    for (int64_t b = 0; b < B; ++b) EXPECT_EQ(err(states_a[b], gpu->to_host(states_b[b])), 0.0) << step << " " << b;
  }
  // A host round trip cannot be recorded: no graph, and the backend keeps working.
  EXPECT_EQ(gpu->capture([&] { (void)gpu->to_host(out); }), nullptr);
  body();
  EXPECT_TRUE(std::isfinite(gpu->to_host(out).data<float>()[0]));
}

// Several products of one x in one launch (decode-sized x) and in a loop (larger x, mixed dtypes),
// and the fused residual add + norm, against the CPU.
TEST_F(CudaOps, MatmulManyAndAddRmsNorm) {
  for_each_gemv_split([&] {
    for (int64_t rows : {1, 5, 8, 20, -20})  // -20: 20 rows in precise mode (x in three 16-bit parts)
      for (bool mixed : {false, true}) {
        const bool precise = rows < 0;
        const int64_t M = std::abs(rows);
        gpu->set_precise(precise);
        const int64_t K = 264;
        Tensor x = randn({M, K}, rng);
        const std::vector<int64_t> Ns = {40, 7, 1, 300};
        std::vector<Tensor> wh, wd, yc, yg;
        for (size_t i = 0; i < Ns.size(); ++i) {
          wh.push_back(as(randn({Ns[i], K}, rng, 0.1f), mixed && i == 2 ? DType::F32 : DType::BF16));
          wd.push_back(dev(wh.back()));
          yc.push_back(cpu->alloc(DType::F32, {M, Ns[i]}));
          yg.push_back(poisoned(DType::F32, {M, Ns[i]}));
        }
        cpu->matmul_many(x, {wh[0], wh[1], wh[2], wh[3]}, {yc[0], yc[1], yc[2], yc[3]});
        gpu->matmul_many(dev(x), {wd[0], wd[1], wd[2], wd[3]}, {yg[0], yg[1], yg[2], yg[3]});
        for (size_t i = 0; i < Ns.size(); ++i)
          // f32 sums of 264 terms: the CPU reference's order follows the machine's OpenBLAS kernel.
          EXPECT_LE(err(yg[i], yc[i]), M <= 8 || precise ? 5e-5 : 1e-2)
              << "M=" << M << " product " << i << " mixed=" << mixed << " precise=" << precise;
      }
    gpu->set_precise(false);
  });
  // D 1000: the generic kernel; 2048 and 4096 (hidden sizes): a row's values held in registers.
  for (int64_t D : {1000, 2048, 4096})
    for (int64_t R : {1, 3, 17}) {
      Tensor x = randn({R, D}, rng), d = randn({R, D}, rng), w = as(randn({D}, rng, 0.1f), DType::BF16);
      Tensor xc = x.clone(), xg = dev(x), oc = cpu->alloc(DType::F32, {R, D}), og = poisoned(DType::F32, {R, D});
      cpu->add_rms_norm(xc, d, w, 1e-6f, true, oc);
      gpu->add_rms_norm(xg, dev(d), dev(w), 1e-6f, true, og);
      EXPECT_LE(err(xg, xc), 1e-6) << "R=" << R << " D=" << D;
      EXPECT_LE(err(og, oc), 1e-5) << "R=" << R << " D=" << D;
    }
}

// dtype conversion between f32 and bf16/f16 both ways: the CPU's numbers exactly (round to nearest
// even), and a clear error for two 16-bit dtypes or a size mismatch.
TEST_F(CudaOps, ConvertMatchesCpu) {
  for (int64_t n : {1, 7, 4096, 100003}) {
    Tensor x = randn({n}, rng, 3.f);
    for (DType h : {DType::BF16, DType::F16}) {
      Tensor hc = cpu->alloc(h, {n}), hg = gpu->alloc(h, {n});
      cpu->convert(x, hc);
      gpu->convert(dev(x), hg);
      Tensor hb = gpu->to_host(hg);
      EXPECT_EQ(std::memcmp(hb.raw(), hc.raw(), hc.nbytes()), 0) << dtype_name(h) << " n=" << n;
      Tensor fc = cpu->alloc(DType::F32, {n}), fg = poisoned(DType::F32, {n});
      cpu->convert(hc, fc);
      gpu->convert(hg, fg);
      EXPECT_EQ(err(fg, fc), 0.0) << dtype_name(h) << " n=" << n;
    }
  }
  Tensor b = gpu->alloc(DType::BF16, {8}), f = gpu->alloc(DType::F16, {8}), g = gpu->alloc(DType::F32, {9});
  EXPECT_NE(error_of([&] { gpu->convert(b, f); }).find("one side must be f32"), std::string::npos);
  EXPECT_NE(error_of([&] { gpu->convert(b, g); }).find("differ in size"), std::string::npos);
}

// The first half of a SwiGLU MLP in one launch (decode-sized x, each weight dtype, a partial last
// block of rows) and through the products + SiLU-mul for larger x, against the CPU.
TEST_F(CudaOps, MatmulSwigluMatchesCpu) {
  for_each_gemv_split([&] {
    for (DType dt : {DType::BF16, DType::F16, DType::F32})
      for (int64_t M : {1, 4, 8, 12})
        for (int64_t K : {264, 2056}) {
          const int64_t N = 300;
          Tensor x = randn({M, K}, rng);
          Tensor g = as(randn({N, K}, rng, 0.1f), dt), u = as(randn({N, K}, rng, 0.1f), dt);
          Tensor hc = cpu->alloc(DType::F32, {M, N}), hg = poisoned(DType::F32, {M, N});
          cpu->matmul_swiglu(x, g, u, hc);
          gpu->matmul_swiglu(dev(x), dev(g), dev(u), hg);
          EXPECT_LE(err(hg, hc), M <= 8 ? 1e-5 : 1e-2) << "M=" << M << " K=" << K << " " << dtype_name(dt);
        }
  });
}

// Greedy token choice on the device: the CPU's ids, ties to the lowest id, rows of any length.
TEST_F(CudaOps, ArgmaxRowsMatchesCpu) {
  for (int64_t V : {1, 7, 1000, 248320}) {
    const int64_t R = 5;
    Tensor x = randn({R, V}, rng);
    if (V > 10) {  // a tie at two ids of row 1, and the row's maximum at its last id in row 2
      x.data<float>()[V + 3] = 100.f;
      x.data<float>()[V + V - 2] = 100.f;
      x.data<float>()[2 * V + V - 1] = 50.f;
    }
    Tensor ic = cpu->alloc(DType::I32, {R}), ig = gpu->alloc(DType::I32, {R});
    cpu->argmax_rows(x, ic);
    gpu->argmax_rows(dev(x), ig);
    Tensor h = gpu->to_host(ig);
    for (int64_t r = 0; r < R; ++r) EXPECT_EQ(h.data<int32_t>()[r], ic.data<int32_t>()[r]) << "V=" << V << " row " << r;
    if (V > 10) {
      EXPECT_EQ(h.data<int32_t>()[1], 3);
      EXPECT_EQ(h.data<int32_t>()[2], V - 1);
    }
  }
}

// ---- The layer pieces of Nemotron-H (Mamba2), MiniMax and Kimi-Linear against the CPU backend -----
// The conv with bias and its state, Mamba2's gates and gated group norm, scale_add, the
// activations and the weighted row scatter of routed experts. GPU outputs start as NaN.
namespace hybrid_ops {

// Relative L2 distance of two host f32 tensors (NaN anywhere: infinity).
double rel(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.numel(), b.numel());
  double d = 0, n = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.data<float>()[i], y = b.data<float>()[i];
    if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::infinity();
    d += (x - y) * (x - y);
    n += y * y;
  }
  return std::sqrt(d / std::max(n, 1e-30));
}

class CudaHybridOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = backend_unavailable("cuda"); !why.empty())
      GTEST_SKIP() << "cuda backend unavailable: " << why;
    gpu_ = make_backend("cuda");
    cpu_ = make_backend("cpu", 2);
  }
  Tensor up(const Tensor& h) { return gpu_->to_device(h); }
  Tensor nan_like(const Shape& s) {
    Tensor t = gpu_->alloc(DType::F32, s);
    gpu_->fill(t, std::numeric_limits<float>::quiet_NaN());
    return t;
  }
  Tensor down(const Tensor& d) { return gpu_->to_host(d); }
  std::unique_ptr<Backend> gpu_, cpu_;
  std::mt19937 rng_{41};
};

TEST_F(CudaHybridOps, ConvWithBiasAndItsState) {
  for (int64_t K : {1, 2, 4})
    for (int64_t T : {1, 2, 7, 300}) {
      const int64_t C = 37;
      Tensor x = randn({T, C}, rng_), w = randn({C, K}, rng_), b = randn({C}, rng_);
      Tensor st = randn({K - 1, C}, rng_), st_c = Tensor::empty(DType::F32, {K - 1, C});
      std::copy(st.data<float>(), st.data<float>() + st.numel(), st_c.data<float>());
      Tensor out_c = Tensor::empty(DType::F32, {T, C});
      cpu_->causal_conv1d_bias_silu(x, w, b, st_c, out_c);
      Tensor st_g = up(st), out_g = nan_like({T, C});
      gpu_->causal_conv1d_bias_silu(up(x), up(w), up(b), st_g, out_g);
      EXPECT_LE(rel(down(out_g), out_c), 1e-6) << "K " << K << " T " << T;
      if (K > 1) EXPECT_EQ(rel(down(st_g), st_c), 0.0) << "state, K " << K << " T " << T;
    }
}

TEST_F(CudaHybridOps, Mamba2GatesAndGatedNorm) {
  const int64_t T = 19, H = 6, P = 10, groups = 3;
  Tensor dt = randn({T, H}, rng_, 3.f), x = randn({T, H, P}, rng_), A = randn({H}, rng_), bias = randn({H}, rng_);
  Tensor g_c = Tensor::empty(DType::F32, {T, H}), v_c = Tensor::empty(DType::F32, {T, H, P});
  cpu_->mamba2_gates(dt, x, A, bias, 0.05f, g_c, v_c);
  Tensor g_g = nan_like({T, H}), v_g = nan_like({T, H, P});
  gpu_->mamba2_gates(up(dt), up(x), up(A), up(bias), 0.05f, g_g, v_g);
  EXPECT_LE(rel(down(g_g), g_c), 1e-6);
  EXPECT_LE(rel(down(v_g), v_c), 1e-6);

  Tensor y = randn({T, H * P}, rng_), x2 = randn({T, H * P}, rng_), z = randn({T, H * P}, rng_);
  Tensor D = randn({H}, rng_), w = randn({H * P}, rng_);
  Tensor o_c = Tensor::empty(DType::F32, {T, H * P});
  cpu_->mamba2_gated_norm(y, x2, z, D, w, groups, 1e-5f, o_c);
  Tensor o_g = nan_like({T, H * P});
  gpu_->mamba2_gated_norm(up(y), up(x2), up(z), up(D), up(w), groups, 1e-5f, o_g);
  EXPECT_LE(rel(down(o_g), o_c), 1e-5);
}

TEST_F(CudaHybridOps, ScaleAddAndActivations) {
  Tensor x = randn({33, 65}, rng_), y = randn({33, 65}, rng_);
  Tensor o_c = Tensor::empty(DType::F32, {33, 65}), o_g = nan_like({33, 65});
  cpu_->scale_add(x, 1.7f, y, -0.8f, o_c);
  gpu_->scale_add(up(x), 1.7f, up(y), -0.8f, o_g);
  EXPECT_LE(rel(down(o_g), o_c), 1e-6);
  for (auto act : {Backend::Activation::Silu, Backend::Activation::ReluSquared}) {
    Tensor a_c = randn({1000}, rng_), a_g = up(a_c);
    cpu_->activate(act, a_c);
    gpu_->activate(act, a_g);
    EXPECT_LE(rel(down(a_g), a_c), 1e-6);
  }
}

// A batch of runs (decode steps or prompts of several sequences) in one call equals each run
// alone on the CPU, for a scalar-decay family (Mamba2), lightning and KDA (channel decay, delta).
TEST_F(CudaHybridOps, RunsOfSeveralSequencesMatchCpu) {
  const std::vector<int64_t> rows = {1, 5, 0, 1, 40};
  const int64_t T = 47, Hk = 2, Hv = 4, dk = 16, dv = 24, C = 21, K = 4;
  struct Case {
    linear::Family f;
    bool l2;
  };
  for (const Case cs :
       {Case{linear::Family::Mamba2, false}, Case{linear::Family::Retention, false}, Case{linear::Family::KDA, true}}) {
    const linear::FamilyTraits tr = linear::traits(cs.f);
    Tensor q = randn({T, Hk, dk}, rng_, 0.3f), k = randn({T, Hk, dk}, rng_, 0.3f), v = randn({T, Hv, dv}, rng_);
    Tensor g, beta, lg;
    if (tr.decay == linear::Decay::Scalar || tr.decay == linear::Decay::Channel) {
      g = randn(tr.decay == linear::Decay::Scalar ? Shape{T, Hv} : Shape{T, Hv, dk}, rng_);
      for (int64_t i = 0; i < g.numel(); ++i) g.data<float>()[i] = -std::log1p(std::exp(g.data<float>()[i])) * 0.2f;
    }
    if (tr.delta) {
      beta = randn({T, Hv}, rng_);
      for (int64_t i = 0; i < beta.numel(); ++i) beta.data<float>()[i] = 1.f / (1.f + std::exp(-beta.data<float>()[i]));
    }
    if (tr.decay == linear::Decay::FixedScalar) {
      lg = randn({Hv}, rng_);
      for (int64_t i = 0; i < Hv; ++i) lg.data<float>()[i] = -std::abs(lg.data<float>()[i]) * 0.1f;
    }
    const Backend::Recurrence r{cs.f, cs.l2, cs.l2 ? 0.25f : 1.f};
    std::vector<Tensor> st_c, st_g;
    std::vector<Tensor*> pc, pg;
    for (size_t i = 0; i < rows.size(); ++i) {
      st_c.push_back(randn({Hv, dk, dv}, rng_, 0.5f));
      st_g.push_back(up(st_c.back()));
    }
    for (size_t i = 0; i < rows.size(); ++i) pc.push_back(&st_c[i]), pg.push_back(&st_g[i]);
    Tensor out_c = Tensor::empty(DType::F32, {T, Hv, dv}), out_g = nan_like({T, Hv, dv});
    cpu_->linear_recurrence_runs(r, q, k, v, g, beta, lg, pc, rows, out_c);
    auto dev = [&](const Tensor& t) { return t.defined() ? up(t) : Tensor(); };
    gpu_->linear_recurrence_runs(r, up(q), up(k), up(v), dev(g), dev(beta), dev(lg), pg, rows, out_g);
    EXPECT_LE(rel(down(out_g), out_c), 2e-4) << linear::traits(cs.f).name;
    for (size_t i = 0; i < rows.size(); ++i)
      EXPECT_LE(rel(down(st_g[i]), st_c[i]), 2e-4) << linear::traits(cs.f).name << " state " << i;
  }
  // The conv with bias over the same runs.
  Tensor x = randn({T, C}, rng_), w = randn({C, K}, rng_), b = randn({C}, rng_);
  std::vector<Tensor> cc, cg;
  std::vector<Tensor*> pc, pg;
  for (size_t i = 0; i < rows.size(); ++i) {
    cc.push_back(randn({K - 1, C}, rng_));
    cg.push_back(up(cc.back()));
  }
  for (size_t i = 0; i < rows.size(); ++i) pc.push_back(&cc[i]), pg.push_back(&cg[i]);
  Tensor oc = Tensor::empty(DType::F32, {T, C}), og = nan_like({T, C});
  cpu_->causal_conv1d_bias_silu_runs(x, w, b, pc, rows, oc);
  gpu_->causal_conv1d_bias_silu_runs(up(x), up(w), up(b), pg, rows, og);
  EXPECT_LE(rel(down(og), oc), 1e-6);
  for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(rel(down(cg[i]), cc[i]), 0.0) << "conv state " << i;
}

}  // namespace hybrid_ops
