// The layer pieces of Nemotron-H (Mamba2) and MiniMax on the CPU backend against literal loops of
// their definitions (transformers' formulas), and their argument checks. The GPU is held to these
// through cuda_hybrid_ops_test.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/backend.h"

using namespace hypic;

namespace {

Tensor randn(Shape s, std::mt19937& rng, float scale = 1.0f) {
  Tensor t = Tensor::empty(DType::F32, std::move(s));
  std::normal_distribution<float> nd(0.f, scale);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = nd(rng);
  return t;
}

double silu(double x) {
  return x / (1 + std::exp(-x));
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

class HybridOps : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be_ = make_backend("cpu", 2);
  std::mt19937 rng_{7};
};

// Running a conv over rows split in two pieces equals one run over all (the state carries the
// history), and each output is silu(bias + the K-tap dot product) of the concatenated inputs.
TEST_F(HybridOps, ConvWithBiasCarriesItsState) {
  const int64_t C = 5, K = 4, T = 9;
  Tensor x = randn({T, C}, rng_), w = randn({C, K}, rng_), b = randn({C}, rng_), st0 = randn({K - 1, C}, rng_);
  Tensor st = Tensor::empty(DType::F32, {K - 1, C});
  std::copy(st0.data<float>(), st0.data<float>() + st0.numel(), st.data<float>());
  Tensor out = Tensor::empty(DType::F32, {T, C});
  Tensor a = out.slice_rows(0, 2), bb = out.slice_rows(2, T);
  be_->causal_conv1d_bias_silu(x.slice_rows(0, 2), w, b, st, a);
  be_->causal_conv1d_bias_silu(x.slice_rows(2, T), w, b, st, bb);
  auto in = [&](int64_t t, int64_t c) {
    return t < 0 ? st0.data<float>()[(K - 1 + t) * C + c] : x.data<float>()[t * C + c];
  };
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) {
      double acc = b.data<float>()[c];
      for (int64_t j = 0; j < K; ++j) acc += double(w.data<float>()[c * K + j]) * in(t - (K - 1) + j, c);
      EXPECT_NEAR(out.data<float>()[t * C + c], silu(acc), 1e-5) << t << "," << c;
    }
  for (int64_t r = 0; r < K - 1; ++r)
    for (int64_t c = 0; c < C; ++c) EXPECT_EQ(st.data<float>()[r * C + c], in(T - (K - 1) + r, c));
}

TEST_F(HybridOps, Mamba2GatesAndNormFollowTheirDefinitions) {
  const int64_t T = 3, H = 2, P = 4, groups = 2;
  Tensor dt = randn({T, H}, rng_, 4.f), x = randn({T, H, P}, rng_), A = randn({H}, rng_), bias = randn({H}, rng_);
  Tensor g = Tensor::empty(DType::F32, {T, H}), v = Tensor::empty(DType::F32, {T, H, P});
  const float dt_min = 0.3f;
  be_->mamba2_gates(dt, x, A, bias, dt_min, g, v);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const double u = dt.data<float>()[t * H + h] + bias.data<float>()[h];
      const double d = std::max(std::log1p(std::exp(u)), double(dt_min));
      EXPECT_NEAR(g.data<float>()[t * H + h], d * A.data<float>()[h], 1e-5);
      for (int64_t p = 0; p < P; ++p)
        EXPECT_NEAR(v.data<float>()[(t * H + h) * P + p], d * x.data<float>()[(t * H + h) * P + p], 1e-5);
    }
  const int64_t C = H * P, gs = C / groups;
  Tensor y = randn({T, C}, rng_), xx = randn({T, C}, rng_), z = randn({T, C}, rng_), D = randn({H}, rng_),
         w = randn({C}, rng_), out = Tensor::empty(DType::F32, {T, C});
  be_->mamba2_gated_norm(y, xx, z, D, w, groups, 1e-5f, out);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t gi = 0; gi < groups; ++gi) {
      std::vector<double> o;
      double ss = 0;
      for (int64_t i = gi * gs; i < (gi + 1) * gs; ++i) {
        o.push_back((y.data<float>()[t * C + i] + D.data<float>()[i / P] * xx.data<float>()[t * C + i]) *
                    silu(z.data<float>()[t * C + i]));
        ss += o.back() * o.back();
      }
      const double r = 1 / std::sqrt(ss / gs + 1e-5);
      for (int64_t j = 0; j < gs; ++j)
        EXPECT_NEAR(out.data<float>()[t * C + gi * gs + j], w.data<float>()[gi * gs + j] * o[j] * r, 1e-4);
    }
}

TEST_F(HybridOps, ScaleAddAndActivate) {
  Tensor x = randn({3, 4}, rng_), y = randn({3, 4}, rng_), out = Tensor::empty(DType::F32, {3, 4});
  be_->scale_add(x, 2.f, y, -0.5f, out);
  for (int64_t i = 0; i < 12; ++i)
    EXPECT_FLOAT_EQ(out.data<float>()[i], 2.f * x.data<float>()[i] - 0.5f * y.data<float>()[i]);
  Tensor a = randn({50}, rng_), a0 = randn({50}, rng_);
  std::copy(a.data<float>(), a.data<float>() + 50, a0.data<float>());
  be_->activate(Backend::Activation::ReluSquared, a);
  for (int64_t i = 0; i < 50; ++i) {
    const float u = a0.data<float>()[i];
    EXPECT_FLOAT_EQ(a.data<float>()[i], u > 0 ? u * u : 0.f);
  }
}

TEST_F(HybridOps, BadCallsAreNamed) {
  Tensor x = randn({5, 6}, rng_), w = randn({6, 3}, rng_), b = randn({5}, rng_), st = randn({2, 6}, rng_),
         out = Tensor::empty(DType::F32, {5, 6});
  EXPECT_NE(error_of([&] { be_->causal_conv1d_bias_silu(x, w, b, st, out); }).find("bias"), std::string::npos);
  Tensor y = randn({2, 6}, rng_), D = randn({4}, rng_), wn = randn({6}, rng_), o2 = Tensor::empty(DType::F32, {2, 6});
  EXPECT_NE(error_of([&] { be_->mamba2_gated_norm(y, y, y, D, wn, 2, 1e-5f, o2); }).find("heads do not split"),
            std::string::npos);
}

// Runs of rows (a batch of sequences) give each run what it gets alone, and runs that do not cover
// the rows are refused by name.
TEST_F(HybridOps, RunsEqualSeparateCallsAndAreChecked) {
  const int64_t T = 6, H = 2, d = 4;
  Tensor q = randn({T, H, d}, rng_, 0.3f), k = randn({T, H, d}, rng_, 0.3f), v = randn({T, H, d}, rng_);
  Tensor g = randn({T, H}, rng_);
  for (int64_t i = 0; i < g.numel(); ++i) g.data<float>()[i] = -std::abs(g.data<float>()[i]);
  const Backend::Recurrence r{linear::Family::Mamba2};
  Tensor s1 = randn({H, d, d}, rng_), s2 = randn({H, d, d}, rng_);
  Tensor a1 = Tensor::empty(DType::F32, s1.shape()), a2 = Tensor::empty(DType::F32, s2.shape());
  std::copy(s1.data<float>(), s1.data<float>() + s1.numel(), a1.data<float>());
  std::copy(s2.data<float>(), s2.data<float>() + s2.numel(), a2.data<float>());
  Tensor out = Tensor::empty(DType::F32, {T, H, d}), ref = Tensor::empty(DType::F32, {T, H, d});
  std::vector<Tensor*> states = {&s1, &s2};
  be_->linear_recurrence_runs(r, q, k, v, g, Tensor(), Tensor(), states, std::vector<int64_t>{2, 4}, out);
  Tensor o1 = ref.slice_rows(0, 2), o2 = ref.slice_rows(2, 6);
  be_->linear_recurrence(r, q.slice_rows(0, 2), k.slice_rows(0, 2), v.slice_rows(0, 2), g.slice_rows(0, 2), Tensor(),
                         Tensor(), a1, o1);
  be_->linear_recurrence(r, q.slice_rows(2, 6), k.slice_rows(2, 6), v.slice_rows(2, 6), g.slice_rows(2, 6), Tensor(),
                         Tensor(), a2, o2);
  for (int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.data<float>()[i], ref.data<float>()[i]);
  for (int64_t i = 0; i < s2.numel(); ++i) ASSERT_EQ(s2.data<float>()[i], a2.data<float>()[i]);
  EXPECT_NE(error_of([&] {
              be_->linear_recurrence_runs(r, q, k, v, g, Tensor(), Tensor(), states, std::vector<int64_t>{2, 3}, out);
            }).find("runs of 5 rows for 6 rows"),
            std::string::npos);
}

}  // namespace
