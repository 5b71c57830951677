// Quantized weights on the CPU (Q8_0, Q4_K, Q6_K): the f16 scale conversions against the CPU's
// own F16C instructions, Q8_0 quantization against gguf-py (llama.cpp's Python quantizer, through
// the GGUF fixture), the K-quant layouts against values placed by hand, round-trip errors, the fast
// integer GEMVs against the plain references and against f64 sums of the dequantized values, and
// the CPU backend's quantized matmul (both paths) and embedding against f32 products.
#include "backend/cpu/quant_dot.h"

#include <gtest/gtest.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "io/gguf.h"
#include "tensor/dtype.h"
#include "tensor/quant.h"
#include "tensor/tensor.h"

namespace hypic {
namespace {

using Block = quant::BlockQ8_0;
constexpr int64_t kBlock = quant::kQ8_0;

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
  quant::quantize_q8_0(x.data(), 128, mine.data());
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
  quant::quantize_q8_0(x.data(), n, b.data());
  quant::dequantize(DType::Q8_0, b.data(), n, y.data());
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

// Every quantized type: its bytes per row, and its round trip within a bound on each value.
TEST(Quant, RoundTripErrorIsBoundedPerBlock) {
  const int64_t n = 256 * 6;
  for (DType t : {DType::Q8_0, DType::Q4_K, DType::Q6_K}) {
    auto x = randn(static_cast<size_t>(n), 11, 2.f);
    for (int i = 256; i < 512; ++i) x[static_cast<size_t>(i)] = 0.f;  // an all-zero block
    for (int i = 512; i < 768; ++i)
      x[static_cast<size_t>(i)] = 0.25f + 0.001f * static_cast<float>(i % 7);  // no negatives
    std::vector<char> q(dtype_bytes(t, n));
    std::vector<float> y(static_cast<size_t>(n));
    quant::quantize(t, x.data(), n, q.data());
    quant::dequantize(t, q.data(), n, y.data());
    // Relative to each super-block's range: half a step of 2^bits levels, plus the scales' rounding.
    const double levels = t == DType::Q8_0 ? 254 : t == DType::Q6_K ? 62 : 15;
    for (int64_t b = 0; b < n / 256; ++b) {
      double amax = 0, err = 0;
      for (int i = 0; i < 256; ++i) {
        const size_t j = static_cast<size_t>(b * 256 + i);
        amax = std::max(amax, std::fabs(static_cast<double>(x[j])));
        err = std::max(err, std::fabs(static_cast<double>(y[j]) - x[j]));
      }
      const double bound = t == DType::Q4_K ? 2.0 * amax / levels : 1.3 * amax / levels;
      EXPECT_LE(err, bound + 1e-6) << dtype_name(t) << " block " << b;
      if (b == 1) {
        EXPECT_EQ(err, 0.0) << dtype_name(t) << ": zeros stay zeros";
      }
    }
  }
  EXPECT_EQ(dtype_bytes(DType::Q8_0, 64), 68u);
  EXPECT_EQ(dtype_bytes(DType::Q4_K, 512), 288u);
  EXPECT_EQ(dtype_bytes(DType::Q6_K, 256), 210u);
}

// The K-quant layouts, value by value, from blocks filled by hand as ggml-common.h describes them.
TEST(Quant, KQuantLayoutsPlaceEachValue) {
  quant::BlockQ4_K a{};
  a.d = f32_to_f16(1.f);
  a.dmin = f32_to_f16(0.5f);
  // sub-block j: scale j + 1, min 2 j (6-bit packing: j < 4 low bits, j >= 4 split over 3 bytes)
  const int sc[8] = {1, 2, 3, 4, 5, 6, 7, 60}, mn[8] = {0, 2, 4, 6, 8, 10, 12, 50};
  for (int j = 0; j < 4; ++j) {
    a.scales[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    a.scales[j + 4] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
    a.scales[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
  }
  for (int i = 0; i < 128; ++i) a.qs[i] = static_cast<uint8_t>((i % 16) | (((i + 3) % 16) << 4));
  std::vector<float> y(256);
  quant::dequantize(DType::Q4_K, &a, 256, y.data());
  for (int e = 0; e < 256; ++e) {
    const int j = e / 32, c = e / 64, l = e % 32, byte = c * 32 + l;
    const int q = (e % 64) < 32 ? byte % 16 : (byte + 3) % 16;
    EXPECT_EQ(y[static_cast<size_t>(e)], static_cast<float>(sc[j] * q) - 0.5f * static_cast<float>(mn[j])) << e;
  }

  quant::BlockQ6_K b{};
  b.d = f32_to_f16(0.25f);
  for (int s = 0; s < 16; ++s) b.scales[s] = static_cast<int8_t>(s % 2 ? -(s + 1) : s + 1);
  // value e (in half h, position r = 32 quarter + l): low 4 bits in ql (quarters 0/2 share byte
  // l, 1/3 byte l + 32, high nibble for 2/3), 2 high bits in qh[l] at bit 2 quarter.
  auto q6 = [](int e) { return (e * 7 + 3) % 64; };
  for (int e = 0; e < 256; ++e) {
    const int h = e / 128, r = e % 128, l = r % 32, quarter = r / 32;
    uint8_t& lo = b.ql[h * 64 + l + (quarter % 2) * 32];
    lo = static_cast<uint8_t>(lo | ((q6(e) & 15) << (quarter < 2 ? 0 : 4)));
    b.qh[h * 32 + l] = static_cast<uint8_t>(b.qh[h * 32 + l] | ((q6(e) >> 4) << (2 * quarter)));
  }
  quant::dequantize(DType::Q6_K, &b, 256, y.data());
  for (int e = 0; e < 256; ++e)
    EXPECT_EQ(y[static_cast<size_t>(e)], 0.25f * static_cast<float>(b.scales[e / 16]) * static_cast<float>(q6(e) - 32))
        << e;
}

// Activations' Q8_K blocks round half away from zero (std::lround), also where the vectorised
// quantizer runs: ties, values just below a tie, the extremes, and the 16-value sums.
TEST(Quant, ActivationBlocksRoundHalfAwayFromZero) {
  std::vector<float> x(quant::kQK * 2);
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-126.f, 126.f);
  for (auto& v : x) v = u(rng);
  x[0] = 127.f;  // amax 127: the scale is exactly 1, so each value is its own rounding input
  const float ties[] = {0.5f, -0.5f, 1.5f, -1.5f, 2.5f, -2.5f, 126.5f, -126.5f, 0.49999997f, -0.49999997f, -127.f, 0.f};
  for (size_t i = 0; i < std::size(ties); ++i) x[1 + i] = ties[i];
  x[quant::kQK] = -3.f;  // second block: amax 3, scale 127 / 3
  std::vector<quant::BlockQ8_K> q(2);
  quant::quantize_act(DType::Q4_K, x.data(), static_cast<int64_t>(x.size()), q.data());
  for (int b = 0; b < 2; ++b) {
    float amax = 0.f;
    for (int i = 0; i < quant::kQK; ++i) amax = std::max(amax, std::fabs(x[static_cast<size_t>(b * quant::kQK + i)]));
    const float id = 127.f / amax;
    EXPECT_EQ(q[static_cast<size_t>(b)].d, amax / 127.f);
    for (int i = 0; i < quant::kQK; ++i) {
      const float y = x[static_cast<size_t>(b * quant::kQK + i)] * id;
      EXPECT_EQ(q[static_cast<size_t>(b)].q[i], static_cast<int8_t>(std::clamp<long>(std::lround(y), -127, 127)))
          << "block " << b << " value " << i << " (" << y << ")";
    }
    for (int s = 0; s < quant::kQK / 16; ++s) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += q[static_cast<size_t>(b)].q[s * 16 + i];
      EXPECT_EQ(q[static_cast<size_t>(b)].bsums[s], sum);
    }
  }
  EXPECT_EQ(q[0].q[1], 1);  // 0.5 -> 1, -0.5 -> -1, 2.5 -> 3 (not to even)
  EXPECT_EQ(q[0].q[2], -1);
  EXPECT_EQ(q[0].q[5], 3);
  EXPECT_EQ(q[0].q[9], 0);  // 0.49999997 stays 0
}

// The fast GEMVs against the plain loops, and both against f64 sums of the dequantized operands.
TEST(Quant, FastGemvMatchesTheReferenceAndExactSums) {
  // Q8_0 also with 7 blocks a row: the kernel's four accumulators and its remainder loop.
  for (auto [t, K] : {std::pair{DType::Q8_0, int64_t{256 * 3}}, std::pair{DType::Q8_0, int64_t{32 * 7}},
                      std::pair{DType::Q4_K, int64_t{256 * 3}}, std::pair{DType::Q6_K, int64_t{256 * 3}}}) {
    const int64_t N = 37;
    const auto w = randn(static_cast<size_t>(N * K), 2, 0.05f), x = randn(static_cast<size_t>(K), 3);
    std::vector<char> wq(dtype_bytes(t, N * K)), xq(quant::act_bytes(t, K));
    quant::quantize(t, w.data(), N * K, wq.data());
    quant::quantize_act(t, x.data(), K, xq.data());
    std::vector<float> fast(static_cast<size_t>(N), NAN), ref(static_cast<size_t>(N), NAN);
    quant::gemv_rows(t, wq.data(), xq.data(), K, 0, N, fast.data());
    quant::gemv_rows_ref(t, wq.data(), xq.data(), K, 0, N, ref.data());
    std::vector<float> wd(static_cast<size_t>(N * K)), xd(static_cast<size_t>(K));
    quant::dequantize(t, wq.data(), N * K, wd.data());
    if (t == DType::Q8_0)
      quant::dequantize(t, xq.data(), K, xd.data());
    else
      quant::dequantize_q8_k(reinterpret_cast<const quant::BlockQ8_K*>(xq.data()), K, xd.data());
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = static_cast<double>(wd[static_cast<size_t>(n * K + k)]) * xd[static_cast<size_t>(k)];
        s += p;
        mag += std::fabs(p);
      }
      EXPECT_NEAR(ref[static_cast<size_t>(n)], s, 1e-5 * mag + 1e-6) << dtype_name(t) << " row " << n;
      EXPECT_NEAR(fast[static_cast<size_t>(n)], s, 1e-5 * mag + 1e-6)
          << dtype_name(t) << " row " << n << ", kernel " << quant::dot_kernel();
    }
    // A row count that is not a multiple of the kernels' row groups, from an offset.
    std::vector<float> part(static_cast<size_t>(N), -7.f);
    quant::gemv_rows(t, wq.data(), xq.data(), K, 5, 11, part.data());
    for (int64_t n = 0; n < N; ++n)
      EXPECT_EQ(part[static_cast<size_t>(n)], n >= 5 && n < 11 ? fast[static_cast<size_t>(n)] : -7.f);
  }
  EXPECT_THROW(quant::act_bytes(DType::Q4_K, 300), std::invalid_argument);
  EXPECT_THROW(quant::act_bytes(DType::BF16, 256), std::invalid_argument);
}

// The backend's matmul with quantized weights at decode and prefill row counts (the GEMV and the
// dequantized-panel paths), with accumulate, against f32 products of the dequantized weights; row
// independence (a row's result alone equals the same row in a batch) in row-independent mode;
// and the embedding of a quantized table.
TEST(Quant, CpuMatmulAndEmbedding) {
  cpu::CpuBackend be(2);
  for (DType t : {DType::Q8_0, DType::Q4_K, DType::Q6_K}) {
    const int64_t N = 70, K = 512;
    const auto wv = randn(static_cast<size_t>(N * K), 5, 0.05f);
    Tensor w = Tensor::empty(t, {N, K});
    quant::quantize(t, wv.data(), N * K, w.raw());
    Tensor wf = w.to_f32();
    for (int64_t M : {int64_t{1}, int64_t{3}, int64_t{40}}) {
      const auto xv = randn(static_cast<size_t>(M * K), 6 + static_cast<uint32_t>(M));
      Tensor x = Tensor::empty(DType::F32, {M, K});
      std::copy(xv.begin(), xv.end(), x.data<float>());
      Tensor y = Tensor::empty(DType::F32, {M, N}), yf = Tensor::empty(DType::F32, {M, N});
      be.matmul(x, w, y);
      be.matmul(x, wf, yf);
      for (int64_t i = 0; i < M * N; ++i) {
        // products are ~1.1 in size; quantizing the activations (GEMV path) moves them by ~0.01
        EXPECT_NEAR(y.data<float>()[i], yf.data<float>()[i], 0.05) << dtype_name(t) << " M " << M << " at " << i;
      }
      Tensor y2 = y.clone();
      be.matmul(x, w, y2, /*accumulate=*/true);
      for (int64_t i = 0; i < M * N; ++i)
        EXPECT_NEAR(y2.data<float>()[i], 2.f * y.data<float>()[i], 1e-5f) << dtype_name(t) << " M " << M;
    }
    be.set_row_independent(true);
    const auto xv = randn(static_cast<size_t>(40 * K), 9);
    Tensor x = Tensor::empty(DType::F32, {40, K}), y = Tensor::empty(DType::F32, {40, N});
    std::copy(xv.begin(), xv.end(), x.data<float>());
    be.matmul(x, w, y);
    for (int64_t m : {int64_t{0}, int64_t{17}, int64_t{39}}) {
      Tensor xm = x.slice_rows(m, m + 1), ym = Tensor::empty(DType::F32, {1, N});
      be.matmul(xm, w, ym);
      for (int64_t n = 0; n < N; ++n) EXPECT_EQ(ym.data<float>()[n], y.data<float>()[m * N + n]) << m << "," << n;
    }
    be.set_row_independent(false);

    const int32_t ids[] = {3, 0, 69, 3};
    Tensor e = Tensor::empty(DType::F32, {4, K});
    be.embedding(w, ids, e);
    for (int r = 0; r < 4; ++r)
      for (int64_t k = 0; k < K; ++k) ASSERT_EQ(e.data<float>()[r * K + k], wf.data<float>()[ids[r] * K + k]);
  }
  Tensor bad = Tensor::empty(DType::Q8_0, {4, 64});
  EXPECT_THROW(Tensor::empty(DType::Q4_K, {4, 64}), std::invalid_argument);
  EXPECT_NO_THROW(bad.reshape({8, 32}));
  EXPECT_THROW(bad.reshape({256, 1}), std::invalid_argument);  // rows of less than a block
  Tensor x = Tensor::empty(DType::F32, {1, 32}), y = Tensor::empty(DType::F32, {1, 4});
  EXPECT_THROW(be.matmul(x, bad, y), std::invalid_argument);  // inner dims differ: named, not read past
}

}  // namespace
}  // namespace hypic
