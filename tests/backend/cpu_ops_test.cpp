// CPU backend ops against plain double-precision references written here.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/bf16_gemm.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/thread_pool.h"
#include "engine/loader.h"
#include "tensor/quant.h"

using namespace hypic;

namespace {

using Vec = std::vector<double>;

Tensor randn(Shape s, uint32_t seed, float scale = 1.0f) {
  Tensor t = Tensor::empty(DType::F32, std::move(s));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, scale);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = nd(rng);
  return t;
}

// f32 tensor converted (rounded) to dt.
Tensor as(const Tensor& f, DType dt) {
  Tensor t = Tensor::empty(dt, f.shape());
  convert_from_f32(f.data<float>(), dt, t.raw(), static_cast<size_t>(f.numel()));
  return t;
}

Vec vals(const Tensor& t) {
  Tensor f = t.to_f32();
  return Vec(f.data<float>(), f.data<float>() + f.numel());
}

double rel_l2(const Tensor& got, const Vec& ref) {
  Vec g = vals(got);
  EXPECT_EQ(g.size(), ref.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size() && i < g.size(); ++i) {
    num += (g[i] - ref[i]) * (g[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
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

double sig(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
double dsilu(double x) {
  return x * sig(x);
}

struct CpuOps : ::testing::Test {
  std::unique_ptr<Backend> be = make_backend("cpu", 2);
};

}  // namespace

// ---- thread pool ------------------------------------------------------------------------------
TEST(ThreadPool, CoversEveryIndexOnceAndPropagatesErrors) {
  for (int threads : {1, 2, 3, 5}) {
    cpu::ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int64_t n : {1, 2, 3, 7, 64, 1001}) {
      std::vector<std::atomic<int>> hit(static_cast<size_t>(n));
      std::atomic<int> calls{0};
      pool.parallel_for(n, [&](int64_t b, int64_t e) {
        ++calls;
        EXPECT_LT(b, e);
        for (int64_t i = b; i < e; ++i) hit[i]++;
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hit[i].load(), 1) << "n=" << n << " i=" << i;
      EXPECT_LE(calls.load(), std::min<int64_t>(n, threads));
    }
    // grain: small ranges run inline as one chunk
    std::atomic<int> calls{0};
    pool.parallel_for(
        10, [&](int64_t, int64_t) { ++calls; }, 100);
    EXPECT_EQ(calls.load(), 1);
    // nested calls run inline, exceptions reach the caller
    std::atomic<int64_t> total{0};
    pool.parallel_for(
        8, [&](int64_t b, int64_t e) { pool.parallel_for(e - b, [&](int64_t b2, int64_t e2) { total += e2 - b2; }); });
    EXPECT_EQ(total.load(), 8);
    EXPECT_THROW(pool.parallel_for(100,
                                   [&](int64_t b, int64_t) {
                                     if (b > 0 || threads == 1) throw std::runtime_error("boom");
                                   }),
                 std::runtime_error);
    // still usable afterwards
    std::atomic<int64_t> s{0};
    pool.parallel_for(1000, [&](int64_t b, int64_t e) { s += e - b; });
    EXPECT_EQ(s.load(), 1000);
  }
}

TEST(MakeBackend, NamesAndErrors) {
  auto be = make_backend("cpu", 3);
  EXPECT_EQ(be->name(), "cpu");
  EXPECT_EQ(be->num_threads(), 3);
  EXPECT_GE(make_backend("cpu")->num_threads(), 1);
  EXPECT_EQ(error_of([] { make_backend("tpu"); }), "unknown backend 'tpu' (available: cpu, cuda, cuda:N)");
  EXPECT_EQ(error_of([] { make_backend("cuda:x"); }), "unknown backend 'cuda:x' (available: cpu, cuda, cuda:N)");
  EXPECT_EQ(backend_unavailable("cpu"), "");
  EXPECT_NE(backend_unavailable("tpu"), "");
  // Where no GPU is usable, asking for one fails with a reason rather than crashing.
  if (!backend_unavailable("cuda").empty()) {
    try {
      make_backend("cuda");
      ADD_FAILURE() << "make_backend(cuda) succeeded although backend_unavailable says it cannot";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos) << e.what();
    }
  }
}

// ---- memory -----------------------------------------------------------------------------------
TEST_F(CpuOps, MemoryOps) {
  Tensor a = be->alloc(DType::BF16, {3, 5});
  for (int i = 0; i < 15; ++i) EXPECT_EQ(a.data<uint16_t>()[i], 0);
  Tensor h = randn({4, 3}, 1);
  EXPECT_EQ(be->to_device(h).raw(), h.raw());
  EXPECT_EQ(be->to_host(h).raw(), h.raw());
  Tensor d = be->alloc(DType::F32, {12});
  be->copy(h, d);
  EXPECT_EQ(vals(d), vals(h));
  Tensor bad = be->alloc(DType::F32, {11});
  EXPECT_NE(error_of([&] { be->copy(h, bad); }).find("copy: src f32[4, 3] and dst f32[11]"), std::string::npos);
  be->fill(d, 2.5f);
  for (double v : vals(d)) EXPECT_EQ(v, 2.5);
  EXPECT_NE(error_of([&] { be->fill(a, 1.f); }).find("fill: t bf16[3, 5]: must be f32"), std::string::npos);
  // convert: to bf16 rounds to nearest even (1 + 2^-8 is a tie: down to 1; 1 + 3 * 2^-8 up to
  // 1 + 2^-6), back to f32 exactly; two 16-bit dtypes or sizes that differ are refused.
  Tensor f = Tensor::empty(DType::F32, {3});
  f.data<float>()[0] = 1.f + 1.f / 256, f.data<float>()[1] = 1.f + 3.f / 256, f.data<float>()[2] = -2.5f;
  Tensor b16 = be->alloc(DType::BF16, {3}), back = be->alloc(DType::F32, {3});
  be->convert(f, b16);
  be->convert(b16, back);
  EXPECT_EQ(vals(back), (Vec{1.0, 1.0 + 1.0 / 64, -2.5}));
  Tensor f16 = be->alloc(DType::F16, {3});
  EXPECT_NE(error_of([&] { be->convert(b16, f16); }).find("convert: src bf16[3] to dst f16[3]: one side must be f32"),
            std::string::npos);
  EXPECT_NE(error_of([&] { be->convert(f, d); }).find("differ in size"), std::string::npos);
}

// ---- matmul -----------------------------------------------------------------------------------
namespace {
Vec ref_matmul(const Tensor& x, const Tensor& w) {
  Vec xv = vals(x), wv = vals(w);
  int64_t M = x.dim(0), K = x.dim(1), N = w.dim(0);
  Vec y(static_cast<size_t>(M * N));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += xv[m * K + k] * wv[n * K + k];
      y[m * N + n] = s;
    }
  return y;
}
}  // namespace

TEST_F(CpuOps, MatmulAllDtypesAndShapes) {
  struct C {
    int64_t M, K, N;
  };
  for (C c : {C{1, 67, 45}, C{2, 129, 33}, C{3, 35, 71}, C{5, 1001, 19}, C{7, 9, 13}, C{8, 67, 45}, C{13, 257, 517},
              C{70, 300, 37}, C{1, 3, 5}, C{16, 33, 20}, C{40, 300, 37},
              // decode shapes: K of whole 32-value blocks (the GEMVs' vector loops), with and without a tail
              C{1, 1024, 67}, C{2, 1024 + 37, 35}, C{1, 32, 4}}) {
    Tensor x = randn({c.M, c.K}, 11 + c.M);
    Tensor w32 = randn({c.N, c.K}, 23 + c.N, 0.5f);
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
      Tensor w = as(w32, dt);  // reference uses the same rounded weights
      Vec ref = ref_matmul(x, w);
      Tensor y = be->alloc(DType::F32, {c.M, c.N});
      be->matmul(x, w, y);
      EXPECT_LE(rel_l2(y, ref), 1e-5) << dtype_name(dt) << " M=" << c.M << " K=" << c.K << " N=" << c.N;
      // accumulate: y += x W^T
      Vec ref2 = ref;
      for (auto& v : ref2) v *= 2;
      be->matmul(x, w, y, true);
      EXPECT_LE(rel_l2(y, ref2), 1e-5) << "accumulate " << dtype_name(dt) << " M=" << c.M;
    }
  }
}

// Row-independent products (PIC's compositions): a row's bits are the same alone, in any batch
// and at any place in a block, with any thread count; with and without accumulate; still exact.
TEST_F(CpuOps, RowIndependentProducts) {
  // K = 301: the seven-row GEMV; K = 1201: the blocked kernel for long rows (both with a k tail).
  for (const int64_t K : {int64_t{301}, int64_t{1201}}) {
    const int64_t N = 150;  // N: two whole panels and a narrower one
    Tensor w32 = randn({N, K}, 31, 0.5f);
    auto one = make_backend("cpu", 1);
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
      SCOPED_TRACE("K " + std::to_string(K));
      Tensor w = as(w32, dt);
      be->set_row_independent(true);
      one->set_row_independent(true);
      const int64_t M = 40;  // two whole blocks and a partial one
      Tensor x = randn({M, K}, 5), y = be->alloc(DType::F32, {M, N});
      be->matmul(x, w, y);
      EXPECT_LE(rel_l2(y, ref_matmul(x, w)), 1e-5) << dtype_name(dt);
      const float* yp = y.data<float>();
      // Each row alone (its block padded), and rows 3..21 as a batch of their own (other offsets
      // in the blocks), on this backend and on a one-thread one.
      for (int64_t r : {int64_t{0}, int64_t{15}, int64_t{16}, int64_t{21}, int64_t{39}}) {
        Tensor y1 = be->alloc(DType::F32, {1, N});
        be->matmul(x.slice_rows(r, r + 1), w, y1);
        EXPECT_EQ(0, std::memcmp(y1.data<float>(), yp + r * N, N * sizeof(float))) << dtype_name(dt) << " row " << r;
      }
      Tensor ys = one->alloc(DType::F32, {19, N});
      one->matmul(x.slice_rows(3, 22), w, ys);
      EXPECT_EQ(0, std::memcmp(ys.data<float>(), yp + 3 * N, 19 * N * sizeof(float))) << dtype_name(dt);
      // accumulate: y + x W^T, row by row the same as in the batch
      Tensor ya = y.clone();
      be->matmul(x, w, ya, /*accumulate=*/true);
      Tensor y2 = be->alloc(DType::F32, {2, N});
      std::memcpy(y2.data<float>(), yp + 38 * N, 2 * N * sizeof(float));
      be->matmul(x.slice_rows(38, 40), w, y2, /*accumulate=*/true);
      EXPECT_EQ(0, std::memcmp(y2.data<float>(), ya.data<float>() + 38 * N, 2 * N * sizeof(float))) << dtype_name(dt);
      Vec twice = ref_matmul(x, w);
      for (auto& v : twice) v *= 2;
      EXPECT_LE(rel_l2(ya, twice), 1e-5) << dtype_name(dt);
      be->set_row_independent(false);
    }
  }
}

// Products that share an input (matmul_many: q/k/v and the gates, gate/up) give each output the
// bits of its own matmul call, whichever kernel takes them (on AVX-512 one region over every
// weight), for row-independent and ordinary products, with weights of other dtypes and of a few
// rows beside long ones, on one and two threads; and they are still the exact products.
TEST_F(CpuOps, MatmulManyEqualsOneCallEach) {
  const int64_t K = 257;
  const std::vector<std::pair<DType, int64_t>> specs = {
      {DType::BF16, 96}, {DType::BF16, 4}, {DType::F16, 37}, {DType::F32, 4}};
  std::vector<Tensor> ws;
  for (size_t i = 0; i < specs.size(); ++i)
    ws.push_back(as(randn({specs[i].second, K}, 61 + static_cast<uint32_t>(i), 0.5f), specs[i].first));
  for (int threads : {1, 2}) {
    auto b = make_backend("cpu", threads);
    for (bool ri : {false, true}) {
      for (int64_t M : {int64_t{5}, int64_t{40}, int64_t{80}}) {
        SCOPED_TRACE("threads " + std::to_string(threads) + " row-independent " + std::to_string(ri) + " M " +
                     std::to_string(M));
        b->set_row_independent(ri);
        Tensor x = randn({M, K}, 71 + static_cast<uint32_t>(M));
        std::vector<Tensor> many, each;
        for (const auto& w : ws) {
          many.push_back(b->alloc(DType::F32, {M, w.dim(0)}));
          each.push_back(b->alloc(DType::F32, {M, w.dim(0)}));
          b->matmul(x, w, each.back());
        }
        b->matmul_many(x, {ws[0], ws[1], ws[2], ws[3]}, {many[0], many[1], many[2], many[3]});
        for (size_t i = 0; i < ws.size(); ++i) {
          EXPECT_EQ(0, std::memcmp(many[i].data<float>(), each[i].data<float>(), static_cast<size_t>(many[i].nbytes())))
              << "weight " << i << " (" << dtype_name(ws[i].dtype()) << ")";
          EXPECT_LE(rel_l2(many[i], ref_matmul(x, ws[i])), 1e-5) << "weight " << i;
        }
        b->set_row_independent(false);
      }
    }
  }
}

// f32-exact activations by default; `--activations bf16` switches to oneDNN's bf16 products where
// this build and CPU have them, and otherwise is refused with the reason.
TEST_F(CpuOps, ActivationsOption) {
  EXPECT_TRUE(be->precise());
  EXPECT_NO_THROW(apply_activations_option(*be, ""));
  EXPECT_NO_THROW(apply_activations_option(*be, "f32"));
  EXPECT_TRUE(be->precise());
  const std::string why = cpu::bf16_gemm::unavailable_reason();
  if (why.empty()) {
    EXPECT_NO_THROW(apply_activations_option(*be, "bf16"));
    EXPECT_FALSE(be->precise());
    apply_activations_option(*be, "f32");
    EXPECT_TRUE(be->precise());
  } else {
    EXPECT_EQ(error_of([&] { apply_activations_option(*be, "bf16"); }),
              "--activations bf16: the cpu backend cannot run bf16 products: " + why);
    EXPECT_TRUE(be->precise());
  }
  EXPECT_EQ(error_of([&] { apply_activations_option(*be, "fp8"); }), "--activations 'fp8': must be f32 or bf16");
}

// bf16 products: x rounded to bf16 (nearest even) times W (bf16, or quantized and dequantized to
// bf16), summed in f32: against an fp64 product of those rounded operands, at row counts that take
// the 256-row blocks, a padded tail, both, and the other kernels below the cut-over; with accumulate;
// and measurably farther from the f32-exact product (the activations really were rounded).
TEST_F(CpuOps, Bf16ProductsAreRoundedOperandsSummedInF32) {
  if (!cpu::bf16_gemm::unavailable_reason().empty()) GTEST_SKIP() << cpu::bf16_gemm::unavailable_reason();
  be->set_precise(false);
  ASSERT_FALSE(be->precise());
  const int64_t K = 512, N = 75;  // K: whole Q4_K blocks
  Tensor w32 = randn({N, K}, 41, 0.5f);
  for (DType dt : {DType::BF16, DType::Q8_0, DType::Q4_K}) {
    Tensor w = Tensor::empty(dt, {N, K});
    if (dtype_is_quantized(dt))
      quant::quantize(dt, w32.data<float>(), N * K, w.raw());
    else
      w = as(w32, DType::BF16);
    Tensor wr = as(w.to_f32(), DType::BF16).to_f32();  // W as the product sees it
    for (int64_t M : {int64_t{5}, int64_t{16}, int64_t{33}, int64_t{256}, int64_t{300}, int64_t{512}}) {
      Tensor x = randn({M, K}, 7 + static_cast<uint32_t>(M));
      Tensor xr = as(x, DType::BF16).to_f32();
      Tensor y = be->alloc(DType::F32, {M, N});
      be->matmul(x, w, y);
      const Vec exact = ref_matmul(x, wr), rounded = ref_matmul(xr, wr);
      if (M < (dt == DType::BF16 ? cpu::CpuBackend::kBf16Rows : cpu::CpuBackend::kQuantGemvRows)) {
        // the f32 kernels (quantized: the integer GEMVs on Q8 activations, as before)
        EXPECT_LE(rel_l2(y, exact), dt == DType::BF16 ? 1e-5 : 2e-2) << dtype_name(dt) << " M=" << M;
        continue;
      }
      const double e_rounded = rel_l2(y, rounded), e_exact = rel_l2(y, exact);
      EXPECT_LE(e_rounded, 1e-5) << dtype_name(dt) << " M=" << M;
      EXPECT_GE(e_exact, 10 * e_rounded) << dtype_name(dt) << " M=" << M;
      Vec twice = rounded;
      for (auto& v : twice) v *= 2;
      be->matmul(x, w, y, /*accumulate=*/true);
      EXPECT_LE(rel_l2(y, twice), 1e-5) << "accumulate " << dtype_name(dt) << " M=" << M;
    }
  }
  // Row-independent mode keeps the f32 kernel: a row alone equals the same row in a batch.
  be->set_row_independent(true);
  Tensor w = as(w32, DType::BF16);
  Tensor x = randn({40, K}, 3), y = be->alloc(DType::F32, {40, N});
  be->matmul(x, w, y);
  EXPECT_LE(rel_l2(y, ref_matmul(x, w)), 1e-5);
  Tensor x1 = x.slice_rows(21, 22), y1 = be->alloc(DType::F32, {1, N});
  be->matmul(x1, w, y1);
  for (int64_t n = 0; n < N; ++n) EXPECT_EQ(y1.data<float>()[n], y.data<float>()[21 * N + n]) << n;
  be->set_row_independent(false);
  be->set_precise(true);
  EXPECT_TRUE(be->precise());
}

TEST_F(CpuOps, MatmulValidation) {
  Tensor x = be->alloc(DType::F32, {3, 64});
  Tensor w = be->alloc(DType::BF16, {32, 48});
  Tensor y = be->alloc(DType::F32, {3, 32});
  EXPECT_EQ(error_of([&] { be->matmul(x, w, y); }), "matmul: x f32[3, 64] and w bf16[32, 48]: inner dims differ");
  Tensor w2 = be->alloc(DType::BF16, {32, 64});
  Tensor y2 = be->alloc(DType::F32, {3, 31});
  EXPECT_EQ(error_of([&] { be->matmul(x, w2, y2); }),
            "matmul: y f32[3, 31]: expected shape [3, 32] for x f32[3, 64] and w bf16[32, 64]");
  Tensor xi = be->alloc(DType::I32, {3, 64});
  EXPECT_EQ(error_of([&] { be->matmul(xi, w2, y); }), "matmul: x i32[3, 64]: must be f32");
  Tensor x3 = be->alloc(DType::F32, {3, 1, 64});
  EXPECT_EQ(error_of([&] { be->matmul(x3, w2, y); }), "matmul: x f32[3, 1, 64]: expected 2 dims, got 3");
  EXPECT_NE(error_of([&] { be->matmul(x, w2, x); }).find("matmul: y f32[3, 64]"), std::string::npos);
}

// ---- embedding --------------------------------------------------------------------------------
TEST_F(CpuOps, Embedding) {
  Tensor t32 = randn({29, 13}, 3);
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    Tensor table = as(t32, dt);
    std::vector<int32_t> ids = {5, 0, 28, 5, 17};
    Tensor out = be->alloc(DType::F32, {5, 13});
    be->embedding(table, ids, out);
    Vec tv = vals(table), ref;
    for (int32_t id : ids)
      for (int i = 0; i < 13; ++i) ref.push_back(tv[id * 13 + i]);
    EXPECT_EQ(vals(out), ref);
    std::vector<int32_t> bad = {1, 29};
    Tensor o2 = be->alloc(DType::F32, {2, 13});
    EXPECT_NE(error_of([&] { be->embedding(table, bad, o2); }).find("embedding: id 29 at 1 out of range"),
              std::string::npos);
    EXPECT_NE(
        error_of([&] { be->embedding(table, ids, o2); }).find("embedding: out f32[2, 13]: expected shape [5, 13]"),
        std::string::npos);
  }
}

// ---- norms and elementwise ----------------------------------------------------------------------
TEST_F(CpuOps, RmsNorm) {
  const int64_t R = 7, D = 45;
  Tensor x = randn({R, 1, D}, 5, 3.0f);
  Tensor w32 = randn({D}, 6, 0.3f);
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (bool one_plus : {false, true}) {
      Tensor w = as(w32, dt);
      Tensor out = be->alloc(DType::F32, {R, 1, D});
      be->rms_norm(x, w, 1e-6f, one_plus, out);
      Vec xv = vals(x), wv = vals(w), ref(static_cast<size_t>(R * D));
      for (int64_t r = 0; r < R; ++r) {
        double ss = 0;
        for (int64_t i = 0; i < D; ++i) ss += xv[r * D + i] * xv[r * D + i];
        double inv = 1.0 / std::sqrt(ss / D + 1e-6);
        for (int64_t i = 0; i < D; ++i) ref[r * D + i] = xv[r * D + i] * inv * (one_plus ? 1.0 + wv[i] : wv[i]);
      }
      EXPECT_LE(rel_l2(out, ref), 1e-6) << dtype_name(dt) << " one_plus=" << one_plus;
    }
  Tensor wbad = be->alloc(DType::F32, {D + 1});
  Tensor out = be->alloc(DType::F32, {R, 1, D});
  EXPECT_EQ(error_of([&] { be->rms_norm(x, wbad, 1e-6f, false, out); }),
            "rms_norm: w f32[46] does not match the last dim of x f32[7, 1, 45]");
}

TEST_F(CpuOps, RmsNormGated) {
  const int64_t R = 9, D = 37;
  Tensor x = randn({R, D}, 7, 2.0f), z = randn({R, D}, 8, 2.0f);
  Tensor w = as(randn({D}, 9), DType::BF16);
  Tensor out = be->alloc(DType::F32, {R, D});
  be->rms_norm_gated(x, z, w, 1e-6f, out);
  Vec xv = vals(x), zv = vals(z), wv = vals(w), ref(static_cast<size_t>(R * D));
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += xv[r * D + i] * xv[r * D + i];
    double inv = 1.0 / std::sqrt(ss / D + 1e-6);
    for (int64_t i = 0; i < D; ++i) ref[r * D + i] = xv[r * D + i] * inv * wv[i] * dsilu(zv[r * D + i]);
  }
  EXPECT_LE(rel_l2(out, ref), 1e-6);
  Tensor zbad = be->alloc(DType::F32, {R, D + 2});
  EXPECT_EQ(error_of([&] { be->rms_norm_gated(x, zbad, w, 1e-6f, out); }),
            "rms_norm_gated: z f32[9, 39]: expected shape [9, 37]");
}

TEST_F(CpuOps, Elementwise) {
  const int64_t n = 40000 + 7;  // large enough to be split over threads
  Tensor a = randn({n}, 10, 3.f), b = randn({n}, 11, 3.f), out = be->alloc(DType::F32, {n});
  Vec av = vals(a), bv = vals(b), r1(n), r2(n), r3(n);
  for (int64_t i = 0; i < n; ++i) {
    r1[i] = av[i] + bv[i];
    r2[i] = dsilu(av[i]) * bv[i];
    r3[i] = av[i] * sig(bv[i]);
  }
  be->add(a, b, out);
  EXPECT_LE(rel_l2(out, r1), 1e-7);
  be->silu_mul(a, b, out);
  EXPECT_LE(rel_l2(out, r2), 1e-6);
  be->sigmoid_mul(a, b, out);
  EXPECT_LE(rel_l2(out, r3), 1e-6);
  be->add(a, b, a);  // in place
  EXPECT_LE(rel_l2(a, r1), 1e-7);
  Tensor c = be->alloc(DType::F32, {n - 1});
  EXPECT_EQ(error_of([&] { be->add(a, c, out); }), "add: a f32[40007] and b f32[40006]: shapes differ");
  EXPECT_EQ(error_of([&] { be->silu_mul(a, b, c); }), "silu_mul: out f32[40006]: expected shape [40007]");
}

// The activations run eight lanes at a time with a scalar tail; an element must get the same bits
// wherever it falls (a row's result may not depend on the rows beside it: row-independent mode and
// composed prefixes rely on it), and stay accurate and finite at the ends of exp's range.
TEST_F(CpuOps, ActivationsGiveEachElementTheSameBitsInAnyLane) {
  const int64_t n = 61;
  Tensor a = randn({n}, 21, 4.f), b = randn({n}, 22, 4.f);
  float* ap = a.data<float>();
  const float edge[] = {0.f, -0.f, 88.f, -88.f, 100.f, -100.f, 1e-30f, -1e-30f, 20.f, -20.f};
  for (size_t i = 0; i < std::size(edge); ++i) ap[3 + i] = edge[i];
  Tensor whole = be->alloc(DType::F32, {n}), whole_sig = be->alloc(DType::F32, {n});
  be->silu_mul(a, b, whole);
  be->sigmoid_mul(b, a, whole_sig);
  Vec av = vals(a), bv = vals(b), ref(n), ref_sig(n);
  for (int64_t i = 0; i < n; ++i) ref[i] = dsilu(av[i]) * bv[i], ref_sig[i] = bv[i] * sig(av[i]);
  EXPECT_LE(rel_l2(whole, ref), 1e-6);
  EXPECT_LE(rel_l2(whole_sig, ref_sig), 1e-6);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_TRUE(std::isfinite(whole.data<float>()[i]) && std::isfinite(whole_sig.data<float>()[i])) << av[i];
    EXPECT_NEAR(whole.data<float>()[i], ref[i], 1e-6 * std::abs(ref[i]) + 1e-30) << "silu at " << av[i];
  }
  for (int64_t off = 1; off < 9; ++off) {  // every element moved to another lane, or into the tail
    Tensor as = a.slice_rows(off, n), bs = b.slice_rows(off, n);
    Tensor o = be->alloc(DType::F32, {n - off}), os = be->alloc(DType::F32, {n - off});
    be->silu_mul(as, bs, o);
    be->sigmoid_mul(bs, as, os);
    for (int64_t i = 0; i < n - off; ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(o.data<float>()[i]), std::bit_cast<uint32_t>(whole.data<float>()[i + off]))
          << "silu_mul, element " << i + off << " at offset " << off;
      ASSERT_EQ(std::bit_cast<uint32_t>(os.data<float>()[i]), std::bit_cast<uint32_t>(whole_sig.data<float>()[i + off]))
          << "sigmoid_mul, element " << i + off << " at offset " << off;
    }
  }
  // The conv splits channels over threads by the row count: its first row's bits may not change.
  const int64_t C = 203, K = 4;
  Tensor w = randn({C, K}, 23), x = randn({16, C}, 24, 3.f);
  Tensor s1 = be->alloc(DType::F32, {K - 1, C}), s2 = be->alloc(DType::F32, {K - 1, C});
  Tensor o1 = be->alloc(DType::F32, {1, C}), o16 = be->alloc(DType::F32, {16, C});
  Tensor x1 = x.slice_rows(0, 1);
  be->causal_conv1d_silu(x1, w, s1, o1);
  be->causal_conv1d_silu(x, w, s2, o16);
  for (int64_t c = 0; c < C; ++c)
    ASSERT_EQ(std::bit_cast<uint32_t>(o1.data<float>()[c]), std::bit_cast<uint32_t>(o16.data<float>()[c])) << c;
}

TEST_F(CpuOps, CopyAndSetCols) {
  Tensor src = randn({5, 3, 11}, 12);  // rows = 15, cols = 11
  Tensor dst = be->alloc(DType::F32, {15, 4});
  be->copy_cols(src, 6, dst);
  Vec sv = vals(src), dv = vals(dst);
  for (int r = 0; r < 15; ++r)
    for (int c = 0; c < 4; ++c) EXPECT_EQ(dv[r * 4 + c], sv[r * 11 + 6 + c]);
  Tensor big = randn({15, 11}, 13);
  Vec before = vals(big);
  be->set_cols(dst, 2, big);
  Vec after = vals(big);
  for (int r = 0; r < 15; ++r)
    for (int c = 0; c < 11; ++c)
      EXPECT_EQ(after[r * 11 + c], (c >= 2 && c < 6) ? dv[r * 4 + c - 2] : before[r * 11 + c]);
  EXPECT_EQ(error_of([&] { be->copy_cols(src, 8, dst); }),
            "copy_cols: columns [8, 12) out of range of src f32[5, 3, 11]");
  Tensor d2 = be->alloc(DType::F32, {14, 4});
  EXPECT_EQ(error_of([&] { be->set_cols(d2, 0, big); }),
            "set_cols: dst f32[15, 11] and src f32[14, 4]: row counts differ");
  Tensor hb = be->alloc(DType::BF16, {15, 4});
  EXPECT_EQ(error_of([&] { be->copy_cols(src, 0, hb); }),
            "copy_cols: src f32[5, 3, 11] and dst bf16[15, 4]: dtypes differ");
}

// Column blocks in another order (a weight's input columns in a file's order of heads): CpuBackend's
// kernel and Backend's generic one (copy_cols / set_cols, what the GPU runs) give the same bits.
TEST_F(CpuOps, GatherColBlocks) {
  Tensor src = randn({3, 5, 24}, 15);  // rows = 15, 4 blocks of 6 columns
  const std::vector<int64_t> order = {2, 0, 3, 1};
  Tensor dst = be->alloc(DType::F32, {15, 24}), dst2 = be->alloc(DType::F32, {15, 24});
  be->gather_col_blocks(src, order, dst);
  be->Backend::gather_col_blocks(src, order, dst2);
  Vec sv = vals(src), dv = vals(dst), dv2 = vals(dst2);
  for (int r = 0; r < 15; ++r)
    for (int p = 0; p < 4; ++p)
      for (int j = 0; j < 6; ++j) EXPECT_EQ(dv[r * 24 + p * 6 + j], sv[r * 24 + order[p] * 6 + j]);
  EXPECT_EQ(dv, dv2);
  const std::vector<int64_t> twice = {0, 1, 1, 3}, five = {0, 2, 1, 3, 4};
  EXPECT_EQ(error_of([&] { be->gather_col_blocks(src, twice, dst); }),
            "gather_col_blocks: the block order is not a permutation of 4 blocks");
  EXPECT_EQ(error_of([&] { be->gather_col_blocks(src, five, dst); }),
            "gather_col_blocks: 5 blocks do not divide the 24 columns of src f32[3, 5, 24]");
  Tensor narrow = be->alloc(DType::F32, {15, 12});
  EXPECT_EQ(error_of([&] { be->gather_col_blocks(src, order, narrow); }),
            "gather_col_blocks: src f32[3, 5, 24] and dst f32[15, 12] differ in rows or columns");
}

// ---- rope ---------------------------------------------------------------------------------------
TEST_F(CpuOps, RopeNeoxPartial) {
  const int64_t T = 6, H = 3, D = 42;
  const int rot = 10;  // partial: only the first 10 dims rotate
  const double theta = 10000000.0;
  std::vector<int64_t> pos = {0, 1, 7, 123, 4099, 70001};
  Tensor x = randn({T, H, D}, 14);
  Vec xv = vals(x);
  be->rope_neox(x, pos, rot, theta);
  // Reference: transformers' fp32 inv_freq and angle, then exact (double) trig and rotation.
  Vec ref = xv;
  for (int64_t t = 0; t < T; ++t)
    for (int i = 0; i < rot / 2; ++i) {
      float e = static_cast<float>(2 * i) / static_cast<float>(rot);
      float inv = 1.0f / static_cast<float>(std::pow(static_cast<double>(static_cast<float>(theta)), double(e)));
      float ang = static_cast<float>(pos[t]) * inv;
      double c = std::cos(double(ang)), s = std::sin(double(ang));
      for (int64_t h = 0; h < H; ++h) {
        size_t b = static_cast<size_t>((t * H + h) * D);
        double x1 = xv[b + i], x2 = xv[b + i + rot / 2];
        ref[b + i] = x1 * c - x2 * s;
        ref[b + i + rot / 2] = x2 * c + x1 * s;
      }
    }
  EXPECT_LE(rel_l2(x, ref), 1e-6);
  Vec got = vals(x);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = rot; d < D; ++d) ASSERT_EQ(got[(t * H + h) * D + d], xv[(t * H + h) * D + d]);
  // position 0 is the identity
  for (int64_t d = 0; d < D; ++d) EXPECT_FLOAT_EQ(got[d], xv[d]);
  EXPECT_EQ(error_of([&] { be->rope_neox(x, pos, 43, theta); }),
            "rope_neox: rot_dim 43 must be even, positive and <= head dim of x f32[6, 3, 42]");
  std::vector<int64_t> p2 = {1, 2};
  EXPECT_EQ(error_of([&] { be->rope_neox(x, p2, rot, theta); }),
            "rope_neox: x f32[6, 3, 42] has 6 rows but 2 positions");
}

// ---- attention ---------------------------------------------------------------------------------
namespace {
Vec ref_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t kv_len, int64_t q_offset, double scale) {
  Vec qv = vals(q), kv = vals(k), vv = vals(v);
  int64_t T = q.dim(0), Hq = q.dim(1), D = q.dim(2), Hkv = k.dim(1), Dv = v.dim(2), G = Hq / Hkv;
  Vec out(static_cast<size_t>(T * Hq * Dv), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hq; ++h) {
      int64_t g = h / G, n = std::min(kv_len, q_offset + t + 1);
      Vec s(static_cast<size_t>(n));
      double mx = -1e300;
      for (int64_t j = 0; j < n; ++j) {
        double d = 0;
        for (int64_t i = 0; i < D; ++i) d += qv[(t * Hq + h) * D + i] * kv[(j * Hkv + g) * D + i];
        s[j] = d * scale;
        mx = std::max(mx, s[j]);
      }
      double sum = 0;
      for (auto& x : s) sum += (x = std::exp(x - mx));
      for (int64_t j = 0; j < n; ++j)
        for (int64_t i = 0; i < Dv; ++i) out[(t * Hq + h) * Dv + i] += s[j] / sum * vv[(j * Hkv + g) * Dv + i];
    }
  return out;
}
}  // namespace

TEST_F(CpuOps, AttentionGqaOffsetsAndMasks) {
  struct C {
    int64_t T, Hq, Hkv, D, Dv, S, kv_len, q_offset;
  };
  for (C c : {
           C{1, 4, 4, 19, 23, 50, 33, 32},       // decode, MHA, cache larger than kv_len
           C{1, 6, 2, 16, 16, 40, 40, 39},       // decode, G=3
           C{3, 8, 1, 21, 13, 20, 17, 14},       // few queries, MQA
           C{37, 4, 2, 19, 23, 90, 37, 0},       // prefill from scratch, G=2
           C{37, 6, 2, 19, 23, 100, 87, 50},     // prefill continuing a cache (q_offset > 0), G=3
           C{37, 4, 1, 19, 23, 100, 70, 50},     // kv_len < q_offset + T: later keys masked by kv_len
           C{301, 8, 2, 33, 17, 700, 600, 299},  // several key tiles (BK=256), G=4
           C{130, 3, 3, 8, 8, 130, 130, 0},      // many query blocks, MHA
       }) {
    float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
    Tensor q = randn({c.T, c.Hq, c.D}, 100 + c.T, 1.5f), k = randn({c.S, c.Hkv, c.D}, 200 + c.S, 1.5f),
           v = randn({c.S, c.Hkv, c.Dv}, 300 + c.S);
    Tensor out = be->alloc(DType::F32, {c.T, c.Hq, c.Dv});
    be->attention(q, k, v, c.kv_len, c.q_offset, scale, out);
    EXPECT_LE(rel_l2(out, ref_attention(q, k, v, c.kv_len, c.q_offset, scale)), 1e-5)
        << "T=" << c.T << " Hq=" << c.Hq << " Hkv=" << c.Hkv << " kv_len=" << c.kv_len << " off=" << c.q_offset;
  }
}

// Spans of rows, each attending up to its own last row (a warm request's seams and question):
// every span's rows get the bits attention() gives them alone, whether the spans run in one
// region or the short ones (under 4 rows) take the per-token path; on one and two threads.
TEST_F(CpuOps, AttentionSpansEqualEachSpanAlone) {
  const int64_t Hq = 4, Hkv = 2, D = 24, Dv = 20, S = 700;
  const float scale = 0.2f;
  Tensor k = randn({S, Hkv, D}, 81, 1.5f), v = randn({S, Hkv, Dv}, 82);
  const std::vector<Backend::RowSpan> spans = {{0, 8}, {250, 8}, {300, 2}, {420, 0}, {520, 40}, {600, 70}};
  int64_t rows = 0;
  for (const auto& sp : spans) rows += sp.rows;
  Tensor q = randn({rows, Hq, D}, 83, 1.5f);
  for (int threads : {1, 2}) {
    auto b = make_backend("cpu", threads);
    Tensor out = b->alloc(DType::F32, {rows, Hq, Dv});
    b->attention_spans(q, k, v, spans, scale, out);
    int64_t r0 = 0;
    for (const auto& sp : spans) {
      if (sp.rows == 0) continue;
      Tensor alone = b->alloc(DType::F32, {sp.rows, Hq, Dv});
      const Tensor qs = q.slice_rows(r0, r0 + sp.rows);
      b->attention(qs, k, v, sp.pos0 + sp.rows, sp.pos0, scale, alone);
      EXPECT_EQ(0, std::memcmp(alone.raw(), out.slice_rows(r0, r0 + sp.rows).raw(), alone.nbytes()))
          << "threads " << threads << " span at " << sp.pos0;
      EXPECT_LE(rel_l2(alone, ref_attention(qs, k, v, sp.pos0 + sp.rows, sp.pos0, scale)), 1e-5);
      r0 += sp.rows;
    }
  }
  Tensor out = be->alloc(DType::F32, {rows, Hq, Dv});
  const std::vector<Backend::RowSpan> over = {{0, rows + 1}};
  EXPECT_EQ(error_of([&] { be->attention_spans(q, k, v, over, scale, out); }),
            "attention_spans: spans cover more rows than q f32[128, 4, 24] has");
  const std::vector<Backend::RowSpan> short_of = {{0, 8}};
  EXPECT_EQ(error_of([&] { be->attention_spans(q, k, v, short_of, scale, out); }),
            "attention_spans: spans cover 8 rows, q f32[128, 4, 24] has more");
}

TEST_F(CpuOps, AttentionValidation) {
  Tensor q = be->alloc(DType::F32, {2, 6, 8}), k = be->alloc(DType::F32, {10, 4, 8}),
         v = be->alloc(DType::F32, {10, 4, 8}), out = be->alloc(DType::F32, {2, 6, 8});
  EXPECT_EQ(error_of([&] { be->attention(q, k, v, 5, 3, 1.f, out); }),
            "attention: q f32[2, 6, 8] and k f32[10, 4, 8]: query heads not a multiple of kv heads");
  Tensor k2 = be->alloc(DType::F32, {10, 2, 8}), v2 = be->alloc(DType::F32, {10, 2, 8});
  EXPECT_EQ(error_of([&] { be->attention(q, k2, v2, 11, 3, 1.f, out); }),
            "attention: kv_len 11 out of range for k f32[10, 2, 8]");
  Tensor v3 = be->alloc(DType::F32, {9, 2, 8});
  EXPECT_EQ(error_of([&] { be->attention(q, k2, v3, 5, 3, 1.f, out); }),
            "attention: k f32[10, 2, 8] and v f32[9, 2, 8]: rows or heads differ");
}

// ---- causal conv1d ------------------------------------------------------------------------------
TEST_F(CpuOps, CausalConvMatchesReferenceAndSpansCompose) {
  for (int64_t K : {4, 1, 3}) {
    const int64_t T = 9, C = 37;
    Tensor x = randn({T, C}, 20), w32 = randn({C, K}, 21, 0.5f), st0 = randn({std::max<int64_t>(K - 1, 0), C}, 22);
    for (DType dt : {DType::F32, DType::BF16}) {
      Tensor w = as(w32, dt);
      Vec xv = vals(x), wv = vals(w), sv = vals(st0);
      // xx = state ++ x
      Vec xx = sv;
      xx.insert(xx.end(), xv.begin(), xv.end());
      Vec ref(static_cast<size_t>(T * C));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < C; ++c) {
          double s = 0;
          for (int64_t j = 0; j < K; ++j) s += wv[c * K + j] * xx[(t + j) * C + c];
          ref[t * C + c] = dsilu(s);
        }
      Vec ref_state(xx.end() - (K - 1) * C, xx.end());

      Tensor state = st0.clone(), out = be->alloc(DType::F32, {T, C});
      be->causal_conv1d_silu(x, w, state, out);
      EXPECT_LE(rel_l2(out, ref), 1e-6) << "K=" << K << " " << dtype_name(dt);
      EXPECT_EQ(vals(state), ref_state);

      // The same tokens in two spans (the first shorter than K-1, so the state mixes) agree.
      for (int64_t split : {2, 5}) {
        Tensor s2 = st0.clone(), o1 = be->alloc(DType::F32, {split, C}), o2 = be->alloc(DType::F32, {T - split, C});
        Tensor x1 = x.slice_rows(0, split).clone(), x2 = x.slice_rows(split, T).clone();
        be->causal_conv1d_silu(x1, w, s2, o1);
        be->causal_conv1d_silu(x2, w, s2, o2);
        Vec both = vals(o1), v2 = vals(o2);
        both.insert(both.end(), v2.begin(), v2.end());
        EXPECT_EQ(both, vals(out)) << "split " << split;
        EXPECT_EQ(vals(s2), ref_state);
      }
    }
  }
  Tensor x = randn({3, 5}, 1), w = randn({5, 4}, 2), st = be->alloc(DType::F32, {2, 5}),
         out = be->alloc(DType::F32, {3, 5});
  EXPECT_EQ(error_of([&] { be->causal_conv1d_silu(x, w, st, out); }),
            "causal_conv1d_silu: state f32[2, 5]: expected shape [3, 5]");
  Tensor st3 = be->alloc(DType::F32, {3, 5});
  EXPECT_EQ(error_of([&] { be->causal_conv1d_silu(x, w, st3, x); }),
            "causal_conv1d_silu: out, x and state must not overlap");
}

// Spans of one conv call: each span's rows continue the state, a span's `after` replaces it (a
// cached body's conv tail after a PIC seam); checked against the plain recurrence written here.
TEST_F(CpuOps, CausalConvSpansRestartFromEachTail) {
  const int64_t C = 11, K = 4, P = K - 1;
  Tensor x = randn({7, C}, 30), w = randn({C, K}, 31, 0.5f), st0 = randn({P, C}, 32);
  Tensor tail1 = randn({P, C}, 33), tail2 = randn({P, C}, 34);
  const std::vector<Backend::ConvSpan> spans = {{2, &tail1}, {0, &tail2}, {4, nullptr}, {1, nullptr}};
  Tensor state = st0.clone(), out = be->alloc(DType::F32, {7, C});
  be->causal_conv1d_silu_spans(x, w, spans, state, out);
  // Reference: rows 0-1 after st0; rows 2-6 after tail2 (tail1 is replaced before any row uses it).
  Vec xv = vals(x), wv = vals(w), ref(static_cast<size_t>(7 * C));
  auto run = [&](const Tensor& start, int64_t r0, int64_t r1) {
    Vec xx = vals(start);
    xx.insert(xx.end(), xv.begin() + r0 * C, xv.begin() + r1 * C);
    for (int64_t t = r0; t < r1; ++t)
      for (int64_t c = 0; c < C; ++c) {
        double s = 0;
        for (int64_t j = 0; j < K; ++j) s += wv[c * K + j] * xx[(t - r0 + j) * C + c];
        ref[t * C + c] = dsilu(s);
      }
    return Vec(xx.end() - P * C, xx.end());
  };
  run(st0, 0, 2);
  const Vec end_state = run(tail2, 2, 7);
  EXPECT_LE(rel_l2(out, ref), 1e-6);
  EXPECT_EQ(vals(state), end_state);
  // Ending on a body: the state is its tail.
  const std::vector<Backend::ConvSpan> closed = {{7, &tail1}};
  be->causal_conv1d_silu_spans(x, w, closed, state, out);
  EXPECT_EQ(vals(state), vals(tail1));
  const std::vector<Backend::ConvSpan> short_spans = {{3, nullptr}};
  EXPECT_EQ(error_of([&] { be->causal_conv1d_silu_spans(x, w, short_spans, state, out); }),
            "causal_conv1d_silu_spans: spans cover 3 rows, x f32[7, 11] has 7");
  // The result in column blocks (q, k and v of a GDN conv): the same columns, each in its tensor.
  Tensor state2 = st0.clone();
  std::vector<Tensor> blocks = {be->alloc(DType::F32, {7, 3}), be->alloc(DType::F32, {7, 6}),
                                be->alloc(DType::F32, {7, 2})};
  be->causal_conv1d_silu_spans(x, w, spans, state2, blocks);
  EXPECT_EQ(vals(state2), end_state);
  Tensor again = be->alloc(DType::F32, {7, C});
  Tensor st_again = st0.clone();
  be->causal_conv1d_silu_spans(x, w, spans, st_again, again);
  const Vec av = vals(again);
  int64_t c0 = 0;
  for (const Tensor& b : blocks) {
    const Vec bv = vals(b);
    for (int64_t t = 0; t < 7; ++t)
      for (int64_t c = 0; c < b.dim(1); ++c) ASSERT_EQ(bv[t * b.dim(1) + c], av[t * C + c0 + c]) << t << "," << c0 + c;
    c0 += b.dim(1);
  }
  std::vector<Tensor> narrow = {be->alloc(DType::F32, {7, 3}), be->alloc(DType::F32, {7, 6})};
  EXPECT_EQ(error_of([&] { be->causal_conv1d_silu_spans(x, w, spans, state2, narrow); }),
            "causal_conv1d_silu_spans: out covers 9 columns, x f32[7, 11] has 11");
  std::vector<Tensor> aliased = {blocks[0], blocks[0], blocks[2]};
  EXPECT_EQ(error_of([&] { be->causal_conv1d_silu_spans(x, w, spans, state2, aliased); }),
            "causal_conv1d_silu_spans: out block 1 overlaps block 0");
  // A GDN conv's width over two threads (a thread's columns cross the blocks' edges), bf16
  // weights, seams of 8 rows between cached tails: the bits of a conv call per span (the base
  // class, into one tensor).
  {
    const int64_t Cw = 520, R = 8 * 5 + 13;
    auto two = make_backend("cpu", 2);
    Tensor xw = randn({R, Cw}, 35), ww = as(randn({Cw, K}, 36, 0.5f), DType::BF16), sw = randn({P, Cw}, 37);
    std::vector<Tensor> tails;
    for (uint32_t i = 0; i < 4; ++i) tails.push_back(randn({P, Cw}, 38 + i));
    std::vector<Backend::ConvSpan> seams;
    for (size_t i = 0; i < tails.size(); ++i) seams.push_back({i == 1 ? 2 : 8, &tails[i]});
    seams.push_back({R - 8 * 3 - 2, nullptr});
    std::vector<Tensor> ba = {two->alloc(DType::F32, {R, 128}), two->alloc(DType::F32, {R, 136}),
                              two->alloc(DType::F32, {R, 256})};
    Tensor whole = two->alloc(DType::F32, {R, Cw});
    Tensor sa = sw.clone(), sb = sw.clone();
    two->causal_conv1d_silu_spans(xw, ww, seams, sa, ba);
    two->Backend::causal_conv1d_silu_spans(xw, ww, seams, sb, std::span<Tensor>(&whole, 1));
    const float* wp = whole.data<float>();
    int64_t col = 0;
    for (const Tensor& b : ba) {
      for (int64_t t = 0; t < R; ++t)
        EXPECT_EQ(0, std::memcmp(b.data<float>() + t * b.dim(1), wp + t * Cw + col, b.dim(1) * sizeof(float)))
            << "row " << t << " block at column " << col;
      col += b.dim(1);
    }
    EXPECT_EQ(0, std::memcmp(sa.raw(), sb.raw(), sa.nbytes()));
  }
}

// Row copies: plain pieces land where they belong, rotated pieces are rope_neox by the shift.
TEST_F(CpuOps, CopyRowsPlacesAndRotatesPieces) {
  const int64_t H = 2, D = 12;
  const int rot = 8;
  Tensor src = randn({10, H, D}, 40), dst = be->alloc(DType::F32, {20, H, D});
  const std::vector<Backend::RowCopy> pieces = {{&src, 0, &dst, 10, 3, 0}, {&src, 3, &dst, 2, 4, 777}};
  be->copy_rows(pieces, rot, 1e6);
  Vec s = vals(src), got = vals(dst);
  const int64_t row = H * D;
  for (int64_t i = 0; i < 3 * row; ++i) ASSERT_EQ(got[10 * row + i], s[i]);
  Tensor rotated = src.slice_rows(3, 7).clone();
  const std::vector<int64_t> shift(4, 777);
  be->rope_neox(rotated, shift, rot, 1e6);
  Vec r = vals(rotated);
  for (int64_t i = 0; i < 4 * row; ++i) ASSERT_EQ(got[2 * row + i], r[i]);
  for (int64_t i = 0; i < 2 * row; ++i) ASSERT_EQ(got[i], 0.0);  // untouched rows
  // Many rows in pieces split over two threads (a warm request's K/V splice): the bits of the
  // generic copy-then-rope_neox, piece by piece.
  {
    auto two = make_backend("cpu", 2);
    Tensor big = randn({900, H, D}, 41);
    Tensor a = two->alloc(DType::F32, {1000, H, D}), b = two->alloc(DType::F32, {1000, H, D});
    const std::vector<Backend::RowCopy> splice = {
        {&big, 0, &a, 0, 300, 0}, {&big, 300, &a, 350, 450, 12345}, {&big, 750, &a, 820, 150, 3}};
    std::vector<Backend::RowCopy> same = splice;
    for (auto& p : same) p.dst = &b;
    two->copy_rows(splice, rot, 1e7);
    two->Backend::copy_rows(same, rot, 1e7);
    EXPECT_EQ(0, std::memcmp(a.raw(), b.raw(), a.nbytes()));
    EXPECT_NE(0, std::memcmp(static_cast<const char*>(a.raw()) + 350 * row * 4,
                             static_cast<const char*>(big.raw()) + 300 * row * 4, 450 * row * 4));  // rotated
  }
  const std::vector<Backend::RowCopy> overlap = {{&src, 0, &dst, 0, 4}, {&src, 0, &dst, 2, 4}};
  EXPECT_EQ(error_of([&] { be->copy_rows(overlap); }), "copy_rows: piece 0 writes where piece 1 reads or writes");
  const std::vector<Backend::RowCopy> rotate_without_dims = {{&src, 0, &dst, 0, 2, 5}};
  EXPECT_EQ(error_of([&] { be->copy_rows(rotate_without_dims); }),
            "copy_rows: rot_dim 0 must be even, positive and <= the head dim of f32[20, 2, 12]");
}

// ---- gdn gates ------------------------------------------------------------------------------------
TEST_F(CpuOps, GdnGates) {
  const int64_t T = 5, H = 7;
  Tensor a = randn({T, H}, 30, 8.f), b = randn({T, H}, 31, 3.f);
  a.data<float>()[3] = 25.f;  // above softplus threshold
  a.data<float>()[4] = -30.f;
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor A_log = as(randn({H}, 32), dt), dt_bias = as(randn({H}, 33), dt);
    Tensor g = be->alloc(DType::F32, {T, H}), beta = be->alloc(DType::F32, {T, H});
    be->gdn_gates(a, b, A_log, dt_bias, g, beta);
    Vec av = vals(a), bv = vals(b), al = vals(A_log), db = vals(dt_bias), rg, rb;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        double u = av[t * H + h] + db[h];
        double sp = u > 20 ? u : std::log1p(std::exp(u));
        rg.push_back(-std::exp(al[h]) * sp);
        rb.push_back(sig(bv[t * H + h]));
      }
    EXPECT_LE(rel_l2(g, rg), 1e-6);
    EXPECT_LE(rel_l2(beta, rb), 1e-6);
    Tensor bad = be->alloc(DType::F32, {H + 1});
    EXPECT_EQ(error_of([&] { be->gdn_gates(a, b, bad, dt_bias, g, beta); }),
              "gdn_gates: A_log f32[8]: expected shape [7]");
  }
}

// ---- gated delta rule ------------------------------------------------------------------------------
namespace {
// Token-by-token recurrence of src/linear/gated_delta.h in double, with the transition product.
void ref_gdn(int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, Vec q, Vec k, const Vec& v, const Vec& g,
             const Vec& beta, bool l2, Vec& state, Vec& out, Vec& trans) {
  const int64_t R = Hv / Hk;
  out.assign(static_cast<size_t>(T * Hv * dv), 0.0);
  trans.assign(static_cast<size_t>(Hv * dk * dk), 0.0);
  for (int64_t h = 0; h < Hv; ++h)
    for (int64_t i = 0; i < dk; ++i) trans[(h * dk + i) * dk + i] = 1;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t hk = 0; hk < Hk; ++hk) {
      double* qq = &q[(t * Hk + hk) * dk];
      double* kk = &k[(t * Hk + hk) * dk];
      if (l2) {
        double nq = 0, nk = 0;
        for (int64_t i = 0; i < dk; ++i) nq += qq[i] * qq[i], nk += kk[i] * kk[i];
        for (int64_t i = 0; i < dk; ++i) qq[i] /= std::sqrt(nq + 1e-6), kk[i] /= std::sqrt(nk + 1e-6);
      }
      for (int64_t i = 0; i < dk; ++i) qq[i] /= std::sqrt(double(dk));
    }
    for (int64_t h = 0; h < Hv; ++h) {
      const double* qq = &q[(t * Hk + h / R) * dk];
      const double* kk = &k[(t * Hk + h / R) * dk];
      double a = std::exp(g[t * Hv + h]), b = beta[t * Hv + h];
      double* S = &state[h * dk * dv];
      // S = a (I - b k k^T) S + b k v^T
      std::vector<double> kS(static_cast<size_t>(dv), 0.0);
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dv; ++j) kS[j] += kk[i] * S[i * dv + j];
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dv; ++j)
          S[i * dv + j] = a * (S[i * dv + j] - b * kk[i] * kS[j]) + b * kk[i] * v[(t * Hv + h) * dv + j];
      for (int64_t j = 0; j < dv; ++j) {
        double o = 0;
        for (int64_t i = 0; i < dk; ++i) o += S[i * dv + j] * qq[i];
        out[(t * Hv + h) * dv + j] = o;
      }
      // Tr = A_t Tr
      double* Tr = &trans[h * dk * dk];
      std::vector<double> kT(static_cast<size_t>(dk), 0.0);
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dk; ++j) kT[j] += kk[i] * Tr[i * dk + j];
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dk; ++j) Tr[i * dk + j] = a * (Tr[i * dk + j] - b * kk[i] * kT[j]);
    }
  }
}
}  // namespace

TEST_F(CpuOps, GatedDeltaRuleMatchesRecurrence) {
  const int64_t T = 21, Hk = 2, Hv = 4, dk = 12, dv = 9;
  for (bool l2 : {true, false}) {
    Tensor q = randn({T, Hk, dk}, 40, l2 ? 1.f : 0.3f), k = randn({T, Hk, dk}, 41, l2 ? 1.f : 0.3f),
           v = randn({T, Hv, dv}, 42);
    Tensor g = randn({T, Hv}, 43, 0.2f), beta = randn({T, Hv}, 44);
    for (int64_t i = 0; i < T * Hv; ++i) {
      g.data<float>()[i] = -std::abs(g.data<float>()[i]);
      beta.data<float>()[i] = 1.f / (1.f + std::exp(-beta.data<float>()[i]));
    }
    Tensor state = randn({Hv, dk, dv}, 45, 0.5f), out = be->alloc(DType::F32, {T, Hv, dv}),
           tr = be->alloc(DType::F32, {Hv, dk, dk});
    Vec rs = vals(state), ro, rt;
    ref_gdn(T, Hk, Hv, dk, dv, vals(q), vals(k), vals(v), vals(g), vals(beta), l2, rs, ro, rt);
    be->gated_delta_rule(q, k, v, g, beta, l2, state, out, &tr);
    EXPECT_LE(rel_l2(out, ro), 1e-4) << "l2=" << l2;
    EXPECT_LE(rel_l2(state, rs), 1e-4) << "l2=" << l2;
    EXPECT_LE(rel_l2(tr, rt), 1e-4) << "l2=" << l2;
  }
  Tensor q = be->alloc(DType::F32, {3, 2, 4}), k = be->alloc(DType::F32, {3, 2, 4}),
         v = be->alloc(DType::F32, {3, 3, 5});
  Tensor g = be->alloc(DType::F32, {3, 3}), beta = be->alloc(DType::F32, {3, 3}), st = be->alloc(DType::F32, {3, 4, 5}),
         out = be->alloc(DType::F32, {3, 3, 5});
  EXPECT_EQ(error_of([&] { be->gated_delta_rule(q, k, v, g, beta, true, st, out); }),
            "gated_delta_rule: v f32[3, 3, 5] and k f32[3, 2, 4]: value heads not a multiple of key heads");
}

// ---- the other families' recurrences --------------------------------------------------------------
// Largest absolute difference over the largest reference magnitude.
double rel_max(const Tensor& got, const Vec& ref) {
  Vec g = vals(got);
  EXPECT_EQ(g.size(), ref.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size() && i < g.size(); ++i) {
    if (!std::isfinite(g[i])) return std::numeric_limits<double>::infinity();
    num = std::max(num, std::abs(g[i] - ref[i]));
    den = std::max(den, std::abs(ref[i]));
  }
  return num / std::max(den, 1e-30);
}

// CpuBackend::linear_recurrence (the chunked kernels, chunks of 32) against the fp64 token-by-token
// reference for every family, from a nonzero state: outputs, the state reached, and T_C dense
// (the reference's product from the identity) and, where the family allows, as a scaled identity.
TEST_F(CpuOps, LinearRecurrenceMatchesReferenceForEveryFamily) {
  struct Case {
    int64_t T, Hk, Hv, dk, dv;
  };
  uint32_t seed = 500;
  for (linear::Family f : linear::kAllFamilies) {
    const linear::FamilyTraits tr = linear::traits(f);
    const bool scaled_ok = !tr.delta && tr.decay != linear::Decay::Channel;
    for (Case c : {Case{45, 1, 2, 12, 9}, Case{5, 2, 4, 7, 6}, Case{70, 2, 2, 16, 20}, Case{1, 1, 3, 8, 5}})
      for (bool l2 : {false, true}) {
        SCOPED_TRACE(std::string(tr.name) + " T=" + std::to_string(c.T) + " dk=" + std::to_string(c.dk) +
                     " l2=" + std::to_string(l2));
        const int64_t T = c.T, Hk = c.Hk, Hv = c.Hv, dk = c.dk, dv = c.dv;
        // Without the norm, |k| ~ 0.8 keeps I - beta k k^T from amplifying.
        const float qk = l2 ? 1.f : 0.8f / std::sqrt(static_cast<float>(dk));
        Tensor q = randn({T, Hk, dk}, ++seed, qk), k = randn({T, Hk, dk}, ++seed, qk), v = randn({T, Hv, dv}, ++seed);
        Tensor g, beta, lg;
        auto neg_softplus = [](Tensor t, float scale) {
          for (int64_t i = 0; i < t.numel(); ++i)
            t.data<float>()[i] = -scale * std::log1p(std::exp(t.data<float>()[i]));
          return t;
        };
        if (tr.decay == linear::Decay::Scalar) g = neg_softplus(randn({T, Hv}, ++seed), 0.3f);
        if (tr.decay == linear::Decay::Channel) g = neg_softplus(randn({T, Hv, dk}, ++seed), 0.3f);
        if (tr.delta) {
          beta = randn({T, Hv}, ++seed);
          for (int64_t i = 0; i < beta.numel(); ++i)
            beta.data<float>()[i] = static_cast<float>(sig(beta.data<float>()[i]));
        }
        if (tr.decay == linear::Decay::FixedScalar) {
          lg = Tensor::empty(DType::F32, {Hv});
          for (int64_t h = 0; h < Hv; ++h)
            lg.data<float>()[h] = std::log(1.f - std::exp2(-2.f - static_cast<float>(h)));
        }
        const Backend::Recurrence r{f, l2, l2 ? 0.6f : 1.3f};
        const Tensor s0 = randn({Hv, dk, dv}, ++seed, 0.5f);

        linear::RecInputs in;
        in.q = q.data<float>();
        in.k = k.data<float>();
        in.v = v.data<float>();
        in.g = g.defined() ? g.data<float>() : nullptr;
        in.beta = beta.defined() ? beta.data<float>() : nullptr;
        in.log_gamma = lg.defined() ? lg.data<float>() : nullptr;
        in.l2norm_qk = l2;
        in.q_scale = r.q_scale;
        Vec rs = vals(s0), ro(static_cast<size_t>(T * Hv * dv)), rt(static_cast<size_t>(Hv * dk * dk), 0.0);
        for (int64_t h = 0; h < Hv; ++h)
          for (int64_t i = 0; i < dk; ++i) rt[static_cast<size_t>((h * dk + i) * dk + i)] = 1.0;
        linear::reference_forward(f, {T, Hk, Hv, dk, dv}, in, rs.data(), ro.data(), rt.data());

        Tensor st = s0.clone(), out = be->alloc(DType::F32, {T, Hv, dv}), td = be->alloc(DType::F32, {Hv, dk, dk});
        be->linear_recurrence(r, q, k, v, g, beta, lg, st, out, &td);
        EXPECT_LE(rel_max(out, ro), 1e-4);
        EXPECT_LE(rel_max(st, rs), 1e-4);
        EXPECT_LE(rel_max(td, rt), 1e-4);
        if (!scaled_ok) continue;
        Tensor st2 = s0.clone(), out2 = be->alloc(DType::F32, {T, Hv, dv}), ts = be->alloc(DType::F32, {Hv, 1, 1});
        be->linear_recurrence(r, q, k, v, g, beta, lg, st2, out2, &ts);
        Vec diag(static_cast<size_t>(Hv));  // T_C = c I: the factor is any diagonal entry
        for (int64_t h = 0; h < Hv; ++h) diag[static_cast<size_t>(h)] = rt[static_cast<size_t>(h * dk * dk)];
        EXPECT_LE(rel_max(ts, diag), 1e-4);
        EXPECT_LE(rel_max(st2, rs), 1e-4);
        EXPECT_LE(rel_max(out2, ro), 1e-4);
      }
  }
  // An empty span: the state stays, T_C is the identity (factor 1).
  {
    Tensor q = be->alloc(DType::F32, {0, 1, 4}), v = be->alloc(DType::F32, {0, 2, 3}),
           g = be->alloc(DType::F32, {0, 2});
    Tensor st = randn({2, 4, 3}, 7), st0 = st.clone(), out = be->alloc(DType::F32, {0, 2, 3});
    Tensor ts = randn({2, 1, 1}, 8), td = randn({2, 4, 4}, 9);
    be->linear_recurrence({linear::Family::Mamba2}, q, q, v, g, Tensor(), Tensor(), st, out, &ts);
    be->linear_recurrence({linear::Family::Mamba2}, q, q, v, g, Tensor(), Tensor(), st, out, &td);
    EXPECT_EQ(rel_max(st, vals(st0)), 0.0);
    EXPECT_EQ(vals(ts), Vec({1.0, 1.0}));
    for (int64_t i = 0; i < td.numel(); ++i) EXPECT_EQ(td.data<float>()[i], i % 16 % 5 == 0 ? 1.f : 0.f) << i;
  }
  // Bad calls name the tensor and the problem.
  const int64_t T = 3, Hv = 2, dk = 4, dv = 5;
  Tensor q = be->alloc(DType::F32, {T, 1, dk}), v = be->alloc(DType::F32, {T, Hv, dv});
  Tensor g = be->alloc(DType::F32, {T, Hv}), gc = be->alloc(DType::F32, {T, Hv, dk}),
         beta = be->alloc(DType::F32, {T, Hv});
  Tensor lg = be->alloc(DType::F32, {Hv}), st = be->alloc(DType::F32, {Hv, dk, dv}),
         out = be->alloc(DType::F32, {T, Hv, dv});
  Tensor ts = be->alloc(DType::F32, {Hv, 1, 1});
  EXPECT_EQ(error_of([&] { be->linear_recurrence({linear::Family::Retention}, q, q, v, g, Tensor(), lg, st, out); }),
            "linear_recurrence: g f32[3, 2]: the retention family takes none");
  EXPECT_EQ(error_of([&] { be->linear_recurrence({linear::Family::KDA}, q, q, v, gc, beta, Tensor(), st, out, &ts); }),
            "linear_recurrence: transition f32[2, 1, 1]: the kda family's T_C is not a scaled identity");
  EXPECT_EQ(error_of([&] {
              be->linear_recurrence({linear::Family::DeltaNet}, q, q, v, Tensor(), Tensor(), Tensor(), st, out);
            }),
            "linear_recurrence: beta is undefined");
  EXPECT_EQ(error_of([&] { be->linear_recurrence({linear::Family::GLA}, q, q, v, g, Tensor(), Tensor(), st, out); }),
            "linear_recurrence: g f32[3, 2]: expected shape [3, 2, 4]");
}

// ---- segment summaries ---------------------------------------------------------------------------
// A composition's chain (seam rows, then state <- T state + B, document after document): the CPU
// runs each head's chain on one thread; the outputs and the final state are those of the separate
// calls (the base class), bit for bit, on one and two threads, with a link of one row (the token
// step), a link without rows, a body without T, and more rows than a chunk; the caller's state
// is not written. A chain with a compact body to replay takes the base class itself.
TEST_F(CpuOps, GatedDeltaChainPerHeadEqualsSeparateCalls) {
  const int64_t Hk = 2, Hv = 4, dk = 16, dv = 12;
  const std::vector<int64_t> rows = {8, 1, 0, 40, 8, 3};
  int64_t R = 0;
  for (int64_t r : rows) R += r;
  Tensor q = randn({R, Hk, dk}, 140), k = randn({R, Hk, dk}, 141), v = randn({R, Hv, dv}, 142);
  Tensor g = randn({R, Hv}, 143, 0.2f), beta = randn({R, Hv}, 144);
  for (int64_t i = 0; i < R * Hv; ++i) {
    g.data<float>()[i] = -std::abs(g.data<float>()[i]);
    beta.data<float>()[i] = 1.f / (1.f + std::exp(-beta.data<float>()[i]));
  }
  std::vector<Tensor> Ts, Bs;
  for (uint32_t i = 0; i < 5; ++i) {
    Ts.push_back(randn({Hv, dk, dk}, 150 + i, 0.25f));
    Bs.push_back(randn({Hv, dk, dv}, 160 + i, 0.5f));
  }
  std::vector<Backend::GdnLink> links(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    links[i].rows = rows[i];
    links[i].B = &Bs[i % Bs.size()];
    links[i].T = i == 3 ? nullptr : &Ts[i % Ts.size()];  // link 3: S + B
  }
  links.back().T = links.back().B = nullptr;  // the question: rows only
  // A compact body (recurrence inputs replayed, rk standing in for the queries): with T and B on
  // link 0 here, and alone in a second chain without any T.
  const int64_t n = 20;
  Tensor rk = randn({n, Hk, dk}, 146), rv = randn({n, Hv, dv}, 147), rg = randn({n, Hv}, 148, 0.2f),
         rb = randn({n, Hv}, 149);
  for (int64_t i = 0; i < n * Hv; ++i) {
    rg.data<float>()[i] = -std::abs(rg.data<float>()[i]);
    rb.data<float>()[i] = 1.f / (1.f + std::exp(-rb.data<float>()[i]));
  }
  links[0].rk = &rk, links[0].rv = &rv, links[0].rg = &rg, links[0].rbeta = &rb;
  std::vector<Backend::GdnLink> replay_only = {links[1], links[0], links.back()};
  replay_only[0].T = replay_only[0].B = replay_only[1].T = replay_only[1].B = nullptr;
  replay_only[1].rows = R - 1 - rows.back();
  const Tensor s0 = randn({Hv, dk, dv}, 145, 0.5f);
  for (const auto* chain : {&links, &replay_only})
    for (int threads : {1, 2}) {
      SCOPED_TRACE(std::string(chain == &links ? "chain" : "replay only") + ", threads " + std::to_string(threads));
      auto b = make_backend("cpu", threads);
      Tensor sa = s0.clone(), sb = s0.clone();
      const Tensor keep = sa;  // the storage the caller passed in
      Tensor oa = b->alloc(DType::F32, {R, Hv, dv}), ob = b->alloc(DType::F32, {R, Hv, dv});
      b->gated_delta_chain(q, k, v, g, beta, true, sa, oa, *chain);
      b->Backend::gated_delta_chain(q, k, v, g, beta, true, sb, ob, *chain);
      EXPECT_EQ(0, std::memcmp(oa.raw(), ob.raw(), oa.nbytes()));
      EXPECT_EQ(0, std::memcmp(sa.raw(), sb.raw(), sa.nbytes()));
      EXPECT_NE(sa.raw(), keep.raw());
      EXPECT_EQ(0, std::memcmp(keep.raw(), s0.raw(), s0.nbytes())) << "the caller's state was written";
    }
  std::vector<Backend::GdnLink> short_links = links;
  short_links.back().rows = 2;
  Tensor st = s0.clone(), o = be->alloc(DType::F32, {R, Hv, dv});
  EXPECT_EQ(error_of([&] { be->gated_delta_chain(q, k, v, g, beta, true, st, o, short_links); }),
            "gated_delta_chain: links cover " + std::to_string(R - 1) + " rows, q f32[" + std::to_string(R) +
                ", 2, 16] has " + std::to_string(R));
}

TEST_F(CpuOps, ComposeStateAndIdentity) {
  const int64_t H = 3, dk = 13, dv = 7;
  Tensor T = randn({H, dk, dk}, 90), S = randn({H, dk, dv}, 91), B = randn({H, dk, dv}, 92);
  Vec tv = vals(T), sv = vals(S), bv = vals(B);
  for (float alpha : {1.f, -1.f, 0.5f}) {
    Vec ref(static_cast<size_t>(H * dk * dv));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dv; ++j) {
          double s = 0;
          for (int64_t l = 0; l < dk; ++l) s += tv[(h * dk + i) * dk + l] * sv[(h * dk + l) * dv + j];
          ref[(h * dk + i) * dv + j] = alpha * s + bv[(h * dk + i) * dv + j];
        }
    Tensor out = be->alloc(DType::F32, {H, dk, dv});
    be->compose_state(T, S, B, alpha, out);
    EXPECT_LE(rel_l2(out, ref), 1e-6) << alpha;
    Tensor b2 = B.clone();  // out may be B itself
    be->compose_state(T, S, b2, alpha, b2);
    EXPECT_LE(rel_l2(b2, ref), 1e-6) << alpha;
  }
  // A [H, 1, 1] transition is a scaled identity per head: the same as its dense form.
  Tensor Ts = randn({H, 1, 1}, 94), Td = be->alloc(DType::F32, {H, dk, dk});
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < dk; ++i) Td.data<float>()[(h * dk + i) * dk + i] = Ts.data<float>()[h];
  Tensor os = be->alloc(DType::F32, {H, dk, dv}), od = be->alloc(DType::F32, {H, dk, dv});
  be->compose_state(Ts, S, B, -1.f, os);
  be->compose_state(Td, S, B, -1.f, od);
  EXPECT_LE(rel_l2(os, vals(od)), 1e-6);
  EXPECT_GT(rel_l2(os, vals(B)), 1e-3);  // the transition did something
  EXPECT_EQ(error_of([&] { be->compose_state(T, S, B, 1.f, S); }), "compose_state: out must not overlap T or S");
  Tensor Sbad = be->alloc(DType::F32, {H, dk + 1, dv});
  Tensor out = be->alloc(DType::F32, {H, dk + 1, dv});
  EXPECT_EQ(error_of([&] { be->compose_state(T, Sbad, out, 1.f, out); }),
            "compose_state: T f32[3, 13, 13] and S f32[3, 14, 7]: shapes do not chain");
  Tensor I = randn({2, 5, 5}, 93);
  be->set_identity(I);
  Vec iv = vals(I);
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 5; ++i)
      for (int j = 0; j < 5; ++j) EXPECT_EQ(iv[(h * 5 + i) * 5 + j], i == j ? 1.0 : 0.0);
  EXPECT_EQ(error_of([&] { be->set_identity(S); }), "set_identity: t f32[3, 13, 7]: matrices must be square");
}

// ---- moe ---------------------------------------------------------------------------------------------
// DeepSeek-V3's routing (Nemotron-H, Kimi-Linear) against its definition in double: sigmoid scores,
// groups ranked by the sum of their two best score + bias, experts chosen within the best groups,
// weights the chosen scores (over their sum when norm_topk) times the scaling; SwiGLU and ReLU^2
// experts. Token 0 is built so that the groups decide: its best single expert lies in a losing group.
TEST_F(CpuOps, MoeExpertsSigmoidGroupedRouting) {
  const int64_t T = 11, H = 16, I = 8, E = 8;
  Tensor x = randn({T, H}, 150), logits = randn({T, E}, 151, 2.f), bias = randn({E}, 152, 0.5f);
  float* lg = logits.data<float>();
  float* bs = bias.data<float>();
  for (int e = 0; e < E; ++e) lg[e] = -1.f, bs[e] = 0.f;
  lg[0] = 4.f;           // expert 0 alone: group 0 (experts 0, 1) scores 0.98 + 0.27
  lg[4] = lg[5] = 2.f;   // group 2: 0.88 + 0.88, the best group
  lg[6] = lg[7] = 1.5f;  // group 3: 0.82 + 0.82, the second
  for (bool relu2 : {false, true})
    for (bool norm : {true, false}) {
      MoeRouter r;
      r.top_k = 3;
      r.norm_topk = norm;
      r.sigmoid = true;
      r.bias = bias;
      r.n_group = 4;
      r.topk_group = 2;
      r.scaling = 2.5f;
      ExpertWeights ex;
      for (int e = 0; e < E; ++e) {
        if (!relu2) ex.gate.push_back(randn({I, H}, 160 + e, 0.4f));
        ex.up.push_back(randn({I, H}, 170 + e, 0.4f));
        ex.down.push_back(randn({H, I}, 180 + e, 0.4f));
      }
      Tensor out = be->alloc(DType::F32, {T, H});
      be->fill(out, 7.f);  // overwritten
      be->moe_experts(x, logits, r, ex, out);
      Vec xv = vals(x), lv = vals(logits), bv = vals(bias), ref(static_cast<size_t>(T * H), 0.0);
      for (int64_t t = 0; t < T; ++t) {
        Vec s(E), c(E);
        for (int e = 0; e < E; ++e) s[e] = 1 / (1 + std::exp(-lv[t * E + e])), c[e] = s[e] + bv[e];
        Vec gs(4);
        for (int g = 0; g < 4; ++g) gs[g] = c[2 * g] + c[2 * g + 1];  // two experts a group: both are its best two
        std::vector<int> gi{0, 1, 2, 3};
        std::stable_sort(gi.begin(), gi.end(), [&](int a, int b) { return gs[a] > gs[b]; });
        std::vector<int> idx;
        for (int e = 0; e < E; ++e)
          if (e / 2 == gi[0] || e / 2 == gi[1]) idx.push_back(e);
        std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return c[a] > c[b]; });
        if (t == 0) {
          EXPECT_EQ(std::vector<int>(idx.begin(), idx.begin() + 3), (std::vector<int>{4, 5, 6}));
        }
        double ws = 0;
        for (int j = 0; j < 3; ++j) ws += s[idx[j]];
        for (int j = 0; j < 3; ++j) {
          const int e = idx[j];
          const double wgt = (norm ? s[e] / ws : s[e]) * 2.5;
          Vec uv = vals(ex.up[e]), dv = vals(ex.down[e]), hmid(I);
          Vec gv = relu2 ? Vec() : vals(ex.gate[e]);
          for (int64_t i = 0; i < I; ++i) {
            double a = 0, b = 0;
            for (int64_t k = 0; k < H; ++k) {
              b += uv[i * H + k] * xv[t * H + k];
              if (!relu2) a += gv[i * H + k] * xv[t * H + k];
            }
            hmid[i] = relu2 ? std::max(b, 0.0) * std::max(b, 0.0) : dsilu(a) * b;
          }
          for (int64_t k = 0; k < H; ++k) {
            double o = 0;
            for (int64_t i = 0; i < I; ++i) o += dv[k * I + i] * hmid[i];
            ref[t * H + k] += wgt * o;
          }
        }
      }
      EXPECT_LE(rel_l2(out, ref), 1e-5) << "relu2=" << relu2 << " norm=" << norm;
    }
  // Bad routers are named.
  ExpertWeights ex;
  for (int e = 0; e < E; ++e) ex.up.push_back(randn({I, H}, 190, 0.4f)), ex.down.push_back(randn({H, I}, 191, 0.4f));
  Tensor out = be->alloc(DType::F32, {T, H});
  MoeRouter r;
  r.top_k = 2;
  r.bias = bias;
  EXPECT_EQ(error_of([&] { be->moe_experts(x, logits, r, ex, out); }),
            "moe_experts: a bias is for sigmoid routing only");
  r.sigmoid = true;
  r.n_group = 3;
  EXPECT_EQ(error_of([&] { be->moe_experts(x, logits, r, ex, out); }),
            "moe_experts: groups: 1 of 3 must divide the 8 experts");
  r.n_group = 4;
  r.top_k = 3;
  EXPECT_EQ(error_of([&] { be->moe_experts(x, logits, r, ex, out); }),
            "moe_experts: top_k 3 exceeds the 2 experts of the chosen groups");
  r.top_k = 2;
  r.bias = randn({E + 1}, 153);
  EXPECT_EQ(error_of([&] { be->moe_experts(x, logits, r, ex, out); }), "moe_experts: bias f32[9]: expected shape [8]");
}

TEST_F(CpuOps, MoeExpertsWithTies) {
  const int64_t T = 13, H = 19, I = 11, E = 7;
  const int top_k = 3;
  Tensor x = randn({T, H}, 50), logits = randn({T, E}, 51, 2.f);
  float* lg = logits.data<float>();
  for (int e = 0; e < E; ++e) lg[0 * E + e] = 0.5f;  // token 0: all tied -> experts 0, 1, 2
  lg[1 * E + 6] = 3.f, lg[1 * E + 2] = 2.f, lg[1 * E + 4] = 2.f, lg[1 * E + 5] = 2.f;  // tie at the boundary -> 6, 2, 4
  for (int e : {0, 1, 3}) lg[1 * E + e] = -1.f;
  for (DType dt : {DType::F32, DType::BF16})
    for (bool norm : {true, false}) {
      ExpertWeights ex;
      for (int e = 0; e < E; ++e) {
        ex.gate.push_back(as(randn({I, H}, 60 + e, 0.4f), dt));
        ex.up.push_back(as(randn({I, H}, 70 + e, 0.4f), dt));
        ex.down.push_back(as(randn({H, I}, 80 + e, 0.4f), dt));
      }
      Tensor out = be->alloc(DType::F32, {T, H});
      be->fill(out, 7.f);  // overwritten
      be->moe_experts(x, logits, top_k, norm, ex, out);
      Vec xv = vals(x), lv = vals(logits), ref(static_cast<size_t>(T * H), 0.0);
      for (int64_t t = 0; t < T; ++t) {
        Vec p(E);
        double mx = *std::max_element(lv.begin() + t * E, lv.begin() + (t + 1) * E), s = 0;
        for (int e = 0; e < E; ++e) s += (p[e] = std::exp(lv[t * E + e] - mx));
        for (auto& v : p) v /= s;
        std::vector<int> idx(E);
        std::iota(idx.begin(), idx.end(), 0);
        std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return p[a] > p[b]; });
        if (t == 0) {
          EXPECT_EQ(std::vector<int>(idx.begin(), idx.begin() + 3), (std::vector<int>{0, 1, 2}));
        }
        if (t == 1) {
          EXPECT_EQ(std::vector<int>(idx.begin(), idx.begin() + 3), (std::vector<int>{6, 2, 4}));
        }
        double ws = 0;
        for (int j = 0; j < top_k; ++j) ws += p[idx[j]];
        for (int j = 0; j < top_k; ++j) {
          int e = idx[j];
          double wgt = norm ? p[e] / ws : p[e];
          Vec gv = vals(ex.gate[e]), uv = vals(ex.up[e]), dv = vals(ex.down[e]), hmid(I);
          for (int64_t i = 0; i < I; ++i) {
            double a = 0, b = 0;
            for (int64_t c = 0; c < H; ++c) a += gv[i * H + c] * xv[t * H + c], b += uv[i * H + c] * xv[t * H + c];
            hmid[i] = dsilu(a) * b;
          }
          for (int64_t c = 0; c < H; ++c) {
            double o = 0;
            for (int64_t i = 0; i < I; ++i) o += dv[c * I + i] * hmid[i];
            ref[t * H + c] += wgt * o;
          }
        }
      }
      EXPECT_LE(rel_l2(out, ref), 1e-5) << dtype_name(dt) << " norm=" << norm;
      // Decode-size call (one token) agrees with the batched one.
      Tensor x0 = x.slice_rows(1, 2).clone(), l0 = logits.slice_rows(1, 2).clone(), o0 = be->alloc(DType::F32, {1, H});
      be->moe_experts(x0, l0, top_k, norm, ex, o0);
      Vec o0v = vals(o0), ov = vals(out);
      for (int64_t c = 0; c < H; ++c) EXPECT_NEAR(o0v[c], ov[H + c], 1e-5);
      // The block's end in one op: x += routed + sigmoid(gate) * shared.
      Tensor sh = randn({T, H}, 90), sg = randn({T, 1}, 91), xr = randn({T, H}, 92);
      const Vec xr0 = vals(xr), shv = vals(sh), sgv = vals(sg);
      be->moe_experts_add(x, logits, top_k, norm, ex, sh, sg, xr);
      Vec want(static_cast<size_t>(T * H));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < H; ++c)
          want[t * H + c] = xr0[t * H + c] + ov[t * H + c] + shv[t * H + c] / (1 + std::exp(-sgv[t]));
      EXPECT_LE(rel_l2(xr, want), 1e-6) << dtype_name(dt) << " norm=" << norm;
    }
  ExpertWeights few;
  few.gate.resize(2), few.up.resize(2), few.down.resize(2);
  Tensor out = be->alloc(DType::F32, {T, H});
  EXPECT_EQ(error_of([&] { be->moe_experts(x, logits, 2, true, few, out); }),
            "moe_experts: expected 7 experts in gate (or none)/up/down, got 2/2/2");
  EXPECT_EQ(error_of([&] { be->moe_experts(x, logits, 8, true, few, out); }),
            "moe_experts: top_k 8 out of range for 7 experts");
  Tensor sh = randn({T, H}, 93), sg_bad = randn({T, 2}, 94);
  EXPECT_EQ(error_of([&] { be->moe_experts_add(x, logits, 2, true, few, sh, Tensor(), out); }),
            "moe_experts_add: shared and shared_gate must be given together");
  EXPECT_EQ(error_of([&] { be->moe_experts_add(x, logits, 2, true, few, sh, sg_bad, out); }),
            "moe_experts_add: shared_gate f32[13, 2]: expected shape [13, 1]");
}

// ---- decode-step tables and token selection ------------------------------------------------------
// The step ops' reference implementations read per-sequence state addresses from a table: each
// sequence's state advances as its own span call would advance it, in table order.
TEST_F(CpuOps, StepOpsFollowTheTable) {
  const int64_t C = 6, K = 3;
  Tensor w = randn({C, K}, 3), x = randn({2, C}, 4);
  Tensor s0 = randn({K - 1, C}, 5), s1 = randn({K - 1, C}, 6);
  Tensor r0 = s0.clone(), r1 = s1.clone();
  Tensor tab = Tensor::empty(DType::I64, {2});
  tab.data<int64_t>()[0] = static_cast<int64_t>(reinterpret_cast<intptr_t>(s1.raw()));  // row 0 -> s1
  tab.data<int64_t>()[1] = static_cast<int64_t>(reinterpret_cast<intptr_t>(s0.raw()));
  Tensor out = be->alloc(DType::F32, {2, C}), want0 = be->alloc(DType::F32, {1, C}),
         want1 = be->alloc(DType::F32, {1, C});
  be->causal_conv1d_silu_step(x, w, tab, out);
  be->causal_conv1d_silu(x.slice_rows(0, 1), w, r1, want0);
  be->causal_conv1d_silu(x.slice_rows(1, 2), w, r0, want1);
  EXPECT_EQ(vals(out.slice_rows(0, 1)), vals(want0));
  EXPECT_EQ(vals(out.slice_rows(1, 2)), vals(want1));
  EXPECT_EQ(vals(s0), vals(r0));
  EXPECT_EQ(vals(s1), vals(r1));
  Tensor short_tab = Tensor::empty(DType::I64, {1});
  EXPECT_NE(error_of([&] {
              be->causal_conv1d_silu_step(x, w, short_tab, out);
            }).find("causal_conv1d_silu_step: states i64[1]: expected i64[2]"),
            std::string::npos);
}

TEST_F(CpuOps, ArgmaxRowsTiesToTheLowestId) {
  Tensor x = Tensor::empty(DType::F32, {3, 4});
  const float v[12] = {1, 5, 5, 2, -3, -1, -2, -1, 0, 0, 0, 7};
  std::copy(v, v + 12, x.data<float>());
  Tensor ids = be->alloc(DType::I32, {3});
  be->argmax_rows(x, ids);
  EXPECT_EQ(ids.data<int32_t>()[0], 1);
  EXPECT_EQ(ids.data<int32_t>()[1], 1);
  EXPECT_EQ(ids.data<int32_t>()[2], 3);
  Tensor wrong = be->alloc(DType::I32, {2});
  EXPECT_NE(error_of([&] { be->argmax_rows(x, wrong); }).find("argmax_rows: ids i32[2]: expected i32[3]"),
            std::string::npos);
}
