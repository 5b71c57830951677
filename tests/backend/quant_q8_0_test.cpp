// Q8_0 on the CPU: the f16 scale conversions against the CPU's own F16C instructions, quantization
// against gguf-py (llama.cpp's Python quantizer, through the GGUF fixture), and the fast integer
// dot product and GEMV against the plain reference and against f64 sums of the dequantized values.
#include "backend/cpu/quant_q8_0.h"

#include <gtest/gtest.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "io/gguf.h"
#include "tensor/dtype.h"

namespace hypic {
namespace {

using q8_0::Block;
using q8_0::kBlock;

#ifdef __F16C__
TEST(Q8_0, HalfConversionsMatchTheCpu) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float mine = f16_to_f32(static_cast<uint16_t>(h)), cpu = _cvtsh_ss(static_cast<uint16_t>(h));
    if (std::isnan(cpu))
      EXPECT_TRUE(std::isnan(mine)) << h;
    else
      EXPECT_EQ(mine, cpu) << h;
  }
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> mant(1.f, 2.f);
  std::uniform_int_distribution<int> ex(-30, 20);
  for (int i = 0; i < 200000; ++i) {
    const float x = (i % 2 ? -1.f : 1.f) * std::ldexp(mant(rng), ex(rng));
    EXPECT_EQ(f32_to_f16(x), _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)) << x;
  }
  for (float x : {0.f, -0.f, 65504.f, 65520.f, 1e9f, 5.96e-8f, 2.98e-8f, 2.99e-8f})
    EXPECT_EQ(f32_to_f16(x), _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)) << x;
}
#endif

// The fixture's t.q8_0 is gguf-py's quantization of np.linspace(-1, 1, 128).
TEST(Q8_0, QuantizationMatchesGgufPy) {
  GgufFile f(std::string(HYPIC_TEST_DATA) + "/gguf/small.gguf");
  const GgufTensorInfo* t = f.find("t.q8_0");
  ASSERT_NE(t, nullptr);
  std::vector<float> x(128);
  for (int i = 0; i < 128; ++i) x[static_cast<size_t>(i)] = static_cast<float>(-1.0 + 2.0 * i / 127.0);
  std::vector<Block> mine(4);
  q8_0::quantize(x.data(), 128, mine.data());
  ASSERT_EQ(t->bytes, sizeof(Block) * 4);
  EXPECT_EQ(std::memcmp(mine.data(), f.data(*t), t->bytes), 0);
}

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

TEST(Q8_0, RoundTripErrorIsHalfAStep) {
  const int64_t n = 32 * 64;
  auto x = randn(static_cast<size_t>(n), 1, 3.f);
  x[5] = 0.f;
  for (int i = 32; i < 64; ++i) x[static_cast<size_t>(i)] = 0.f;  // an all-zero block: d = 0
  std::vector<Block> b(static_cast<size_t>(n / kBlock));
  std::vector<float> y(static_cast<size_t>(n));
  q8_0::quantize(x.data(), n, b.data());
  q8_0::dequantize(b.data(), n, y.data());
  for (int64_t k = 0; k < n / kBlock; ++k) {
    const float d = f16_to_f32(b[static_cast<size_t>(k)].d);
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[static_cast<size_t>(k * kBlock + i)]));
    for (int i = 0; i < kBlock; ++i) {
      const size_t j = static_cast<size_t>(k * kBlock + i);
      // half a step, plus what the f16 rounding of the scale moves the largest value
      EXPECT_LE(std::fabs(y[j] - x[j]), 0.5f * d + amax * 1e-3f) << j;
    }
  }
  for (int i = 32; i < 64; ++i) EXPECT_EQ(y[static_cast<size_t>(i)], 0.f);
}

TEST(Q8_0, FastDotAndGemvMatchTheReferences) {
  const int64_t N = 37, K = 32 * 96;
  const auto w = randn(static_cast<size_t>(N * K), 2, 0.05f), x = randn(static_cast<size_t>(K), 3);
  std::vector<Block> wq(static_cast<size_t>(N * K / kBlock)), xq(static_cast<size_t>(K / kBlock));
  q8_0::quantize(w.data(), N * K, wq.data());
  q8_0::quantize(x.data(), K, xq.data());
  for (int64_t nb : {int64_t{1}, int64_t{3}, K / kBlock}) {
    const float ref = q8_0::dot_ref(wq.data(), xq.data(), nb), fast = q8_0::dot(wq.data(), xq.data(), nb);
    EXPECT_NEAR(fast, ref, 1e-5f * (std::fabs(ref) + 1.f)) << nb << " blocks, kernel " << q8_0::dot_kernel();
  }
  std::vector<float> y(static_cast<size_t>(N), NAN), wd(static_cast<size_t>(N * K)), xd(static_cast<size_t>(K));
  q8_0::gemv_rows(wq.data(), xq.data(), K, 0, N, y.data());
  q8_0::dequantize(wq.data(), N * K, wd.data());
  q8_0::dequantize(xq.data(), K, xd.data());
  for (int64_t n = 0; n < N; ++n) {
    double s = 0, mag = 0;
    for (int64_t k = 0; k < K; ++k) {
      s += static_cast<double>(wd[static_cast<size_t>(n * K + k)]) * xd[static_cast<size_t>(k)];
      mag += std::fabs(static_cast<double>(wd[static_cast<size_t>(n * K + k)]) * xd[static_cast<size_t>(k)]);
    }
    EXPECT_NEAR(y[static_cast<size_t>(n)], s, 1e-5 * mag + 1e-6) << "row " << n;
  }
}

}  // namespace
}  // namespace hypic
