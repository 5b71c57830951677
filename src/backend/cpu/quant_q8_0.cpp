#include "backend/cpu/quant_q8_0.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "tensor/dtype.h"

namespace hypic::q8_0 {

void quantize(const float* x, int64_t n, Block* out) {
  for (int64_t b = 0; b < n / kBlock; ++b) {
    const float* v = x + b * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    out[b].d = f32_to_f16(d);
    for (int i = 0; i < kBlock; ++i) out[b].q[i] = static_cast<int8_t>(std::lround(v[i] * id));
  }
}

void dequantize(const Block* b, int64_t n, float* out) {
  for (int64_t k = 0; k < n / kBlock; ++k) {
    const float d = f16_to_f32(b[k].d);
    for (int i = 0; i < kBlock; ++i) out[k * kBlock + i] = d * static_cast<float>(b[k].q[i]);
  }
}

float dot_ref(const Block* a, const Block* b, int64_t nblocks) {
  float s = 0.f;
  for (int64_t k = 0; k < nblocks; ++k) {
    int32_t isum = 0;
    for (int i = 0; i < kBlock; ++i) isum += static_cast<int32_t>(a[k].q[i]) * static_cast<int32_t>(b[k].q[i]);
    s += f16_to_f32(a[k].d) * f16_to_f32(b[k].d) * static_cast<float>(isum);
  }
  return s;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
namespace {
inline float hsum(__m256 acc) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
// 8 int32 partial sums of ux . sw: ux unsigned (|x|), sw the other operand carrying x's signs.
inline __m256i dot_signed(__m256i ux, __m256i sw) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ux, sw);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ux, sw);
#else
  // u8 x s8 pairs to s16 (|q| <= 127, so no saturation), then pairs to s32.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(ux, sw), _mm256_set1_epi16(1));
#endif
}
inline __m256i load(const int8_t* q) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
}
}  // namespace

float dot(const Block* a, const Block* b, int64_t nblocks) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < nblocks; ++k) {
    const __m256i va = load(a[k].q), vb = load(b[k].q);
    const __m256 s = _mm256_set1_ps(_cvtsh_ss(a[k].d) * _cvtsh_ss(b[k].d));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_signed(_mm256_sign_epi8(va, va), _mm256_sign_epi8(vb, va))), s, acc);
  }
  return hsum(acc);
}

const char* dot_kernel() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512-vnni";
#elif defined(__AVXVNNI__)
  return "avx-vnni";
#else
  return "avx2";
#endif
}

// Four rows at a time: each activation block is loaded and made unsigned once (|x|, with x's
// signs moved onto the weights) for four rows' weight blocks; scales through F16C.
void gemv_rows(const Block* w, const Block* xq, int64_t K, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / kBlock;
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const Block* r[4] = {w + n * nb, w + (n + 1) * nb, w + (n + 2) * nb, w + (n + 3) * nb};
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t k = 0; k < nb; ++k) {
      const __m256i vx = load(xq[k].q);
      const __m256i ux = _mm256_sign_epi8(vx, vx);
      const float dx = _cvtsh_ss(xq[k].d);
      for (int i = 0; i < 4; ++i) {
        const __m256 s = _mm256_set1_ps(dx * _cvtsh_ss(r[i][k].d));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_signed(ux, _mm256_sign_epi8(load(r[i][k].q), vx))), s, acc[i]);
      }
    }
    for (int i = 0; i < 4; ++i) y[n + i] = hsum(acc[i]);
  }
  for (; n < n1; ++n) y[n] = dot(w + n * nb, xq, nb);
}
#else
float dot(const Block* a, const Block* b, int64_t nblocks) {
  return dot_ref(a, b, nblocks);
}
const char* dot_kernel() {
  return "plain";
}
void gemv_rows(const Block* w, const Block* xq, int64_t K, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) y[n] = dot(w + n * nb, xq, nb);
}
#endif

}  // namespace hypic::q8_0
