#include "backend/cpu/quant_q8_0.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace hypic::q8_0 {

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((man & 0x400u) == 0) {
        man <<= 1;
        --exp;
      }
      u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int32_t exp = static_cast<int32_t>((u >> 23) & 0xffu) - 127 + 15;
  uint32_t man = u & 0x7fffffu;
  if (((u >> 23) & 0xffu) == 0xffu) return static_cast<uint16_t>(sign | 0x7c00u | (man ? 0x200u : 0));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow: inf
  if (exp <= 0) {                                               // subnormal or zero
    if (exp < -10) return static_cast<uint16_t>(sign);
    man |= 0x800000u;
    const int shift = 14 - exp;
    uint32_t h = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = (static_cast<uint32_t>(exp) << 10) | (man >> 13);
  const uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: correct
  return static_cast<uint16_t>(sign | h);
}

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

#if defined(__AVX2__) && defined(__FMA__)
namespace {
// q_a . q_b of one block as 8 int32 partial sums: |a| (unsigned) times b carrying a's sign.
inline __m256i block_dot(const int8_t* a, const int8_t* b) {
  const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i vb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  const __m256i ua = _mm256_sign_epi8(va, va), sb = _mm256_sign_epi8(vb, va);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ua, sb);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ua, sb);
#else
  // u8 x s8 pairs to s16 (|q| <= 127, so no saturation), then pairs to s32.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(ua, sb), _mm256_set1_epi16(1));
#endif
}
}  // namespace

float dot(const Block* a, const Block* b, int64_t nblocks) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < nblocks; ++k) {
#ifdef __F16C__
    const __m256 s = _mm256_set1_ps(_cvtsh_ss(a[k].d) * _cvtsh_ss(b[k].d));
#else
    const __m256 s = _mm256_set1_ps(f16_to_f32(a[k].d) * f16_to_f32(b[k].d));
#endif
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(a[k].q, b[k].q)), s, acc);
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
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
#else
float dot(const Block* a, const Block* b, int64_t nblocks) {
  return dot_ref(a, b, nblocks);
}
const char* dot_kernel() {
  return "plain";
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
namespace {
inline float hsum(__m256 acc) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
inline __m256i dot_signed(__m256i ux, __m256i sw) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ux, sw);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ux, sw);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(ux, sw), _mm256_set1_epi16(1));
#endif
}
}  // namespace

// Four rows at a time: each activation block is loaded and made unsigned once (|x|, with x's
// signs moved onto the weights) for four rows' weight blocks; scales through F16C.
void gemv_rows(const Block* w, const Block* xq, int64_t K, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / kBlock;
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const Block* r[4] = {w + n * nb, w + (n + 1) * nb, w + (n + 2) * nb, w + (n + 3) * nb};
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t k = 0; k < nb; ++k) {
      const __m256i vx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[k].q));
      const __m256i ux = _mm256_sign_epi8(vx, vx);
      const float dx = _cvtsh_ss(xq[k].d);
      for (int i = 0; i < 4; ++i) {
        const __m256i vw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[i][k].q));
        const __m256 s = _mm256_set1_ps(dx * _cvtsh_ss(r[i][k].d));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_signed(ux, _mm256_sign_epi8(vw, vx))), s, acc[i]);
      }
    }
    for (int i = 0; i < 4; ++i) y[n + i] = hsum(acc[i]);
  }
  for (; n < n1; ++n) y[n] = dot(w + n * nb, xq, nb);
}
#else
void gemv_rows(const Block* w, const Block* xq, int64_t K, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) y[n] = dot(w + n * nb, xq, nb);
}
#endif

}  // namespace hypic::q8_0
