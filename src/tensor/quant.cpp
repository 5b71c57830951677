#include "tensor/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace hypic::quant {

namespace {
int round_clamp(float v, int lo, int hi) {
  return static_cast<int>(std::clamp<long>(std::lround(v), lo, hi));
}
}  // namespace

void quantize_q8_0(const float* x, int64_t n, BlockQ8_0* out) {
  for (int64_t b = 0; b < n / kQ8_0; ++b) {
    const float* v = x + b * kQ8_0;
    float amax = 0.f;
    for (int i = 0; i < kQ8_0; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    out[b].d = f32_to_f16(d);
    for (int i = 0; i < kQ8_0; ++i) out[b].q[i] = static_cast<int8_t>(std::lround(v[i] * id));
  }
}

// GCC 12 warns inside its own AVX-512 intrinsics (their _mm512_undefined_* operands) at -O3.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
void quantize_q8_k(const float* x, int64_t n, BlockQ8_K* out) {
  for (int64_t b = 0; b < n / kQK; ++b) {
    const float* v = x + b * kQK;
    BlockQ8_K& o = out[b];
    float amax = 0.f;
    for (int i = 0; i < kQK; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    o.d = amax / 127.f;
#ifdef __AVX512F__
    // lround (half away from zero) exactly: truncate, then step away from zero where the dropped
    // fraction is at least one half (|v * id| <= 127, so no clamp is needed). Decode quantizes each
    // product's activations once; lroundf one value at a time was ~2% of a one-thread decode step.
    const __m512 vid = _mm512_set1_ps(id), half = _mm512_set1_ps(0.5f);
    for (int i = 0; i < kQK; i += 16) {
      const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(v + i), vid);
      const __m512 t = _mm512_roundscale_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(y, t)), half, _CMP_GE_OQ);
      const __m512i r = _mm512_cvttps_epi32(
          _mm512_mask_add_ps(t, up, t,
                             _mm512_mask_blend_ps(_mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ),
                                                  _mm512_set1_ps(1.f), _mm512_set1_ps(-1.f))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o.q + i), _mm512_cvtsepi32_epi8(r));
    }
#else
    for (int i = 0; i < kQK; ++i) o.q[i] = static_cast<int8_t>(round_clamp(v[i] * id, -127, 127));
#endif
    for (int s = 0; s < kQK / 16; ++s) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += o.q[s * 16 + i];
      o.bsums[s] = static_cast<int16_t>(sum);
    }
  }
}
#pragma GCC diagnostic pop

void quantize_q4_k(const float* x, int64_t n, BlockQ4_K* out) {
  for (int64_t b = 0; b < n / kQK; ++b) {
    const float* v = x + b * kQK;
    BlockQ4_K& o = out[b];
    // Each sub-block spans [lo, hi] with lo <= 0: x = step q - min, step = (hi - lo) / 15, min = -lo.
    float step[8], mn[8], smax = 0.f, mmax = 0.f;
    for (int j = 0; j < 8; ++j) {
      float lo = 0.f, hi = -INFINITY;
      for (int i = 0; i < 32; ++i) lo = std::min(lo, v[j * 32 + i]), hi = std::max(hi, v[j * 32 + i]);
      step[j] = std::max(hi - lo, 0.f) / 15.f;
      mn[j] = -lo;
      smax = std::max(smax, step[j]);
      mmax = std::max(mmax, mn[j]);
    }
    o.d = f32_to_f16(smax / 63.f);
    o.dmin = f32_to_f16(mmax / 63.f);
    const float d = f16_to_f32(o.d), dmin = f16_to_f32(o.dmin);
    int sc[8], m[8];
    for (int j = 0; j < 8; ++j) {
      sc[j] = d > 0.f ? round_clamp(step[j] / d, 0, 63) : 0;
      m[j] = dmin > 0.f ? round_clamp(mn[j] / dmin, 0, 63) : 0;
    }
    for (int j = 0; j < 4; ++j) {
      o.scales[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
      o.scales[j + 4] = static_cast<uint8_t>((m[j] & 63) | ((m[j + 4] >> 4) << 6));
      o.scales[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
    }
    uint8_t q[kQK];
    for (int j = 0; j < 8; ++j) {
      const float s = d * static_cast<float>(sc[j]), off = dmin * static_cast<float>(m[j]);
      for (int i = 0; i < 32; ++i)
        q[j * 32 + i] = static_cast<uint8_t>(s > 0.f ? round_clamp((v[j * 32 + i] + off) / s, 0, 15) : 0);
    }
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) o.qs[c * 32 + l] = static_cast<uint8_t>(q[c * 64 + l] | (q[c * 64 + 32 + l] << 4));
  }
}

void quantize_q6_k(const float* x, int64_t n, BlockQ6_K* out) {
  for (int64_t b = 0; b < n / kQK; ++b) {
    const float* v = x + b * kQK;
    BlockQ6_K& o = out[b];
    float step[16], smax = 0.f;
    for (int s = 0; s < 16; ++s) {
      float amax = 0.f;
      for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(v[s * 16 + i]));
      step[s] = amax / 31.f;
      smax = std::max(smax, step[s]);
    }
    o.d = f32_to_f16(smax / 127.f);
    const float d = f16_to_f32(o.d);
    uint8_t q[kQK];  // biased by 32: [0, 63]
    for (int s = 0; s < 16; ++s) {
      const int sc = d > 0.f ? round_clamp(step[s] / d, 0, 127) : 0;
      o.scales[s] = static_cast<int8_t>(sc);
      const float st = d * static_cast<float>(sc);
      for (int i = 0; i < 16; ++i)
        q[s * 16 + i] = static_cast<uint8_t>((st > 0.f ? round_clamp(v[s * 16 + i] / st, -32, 31) : 0) + 32);
    }
    for (int h = 0; h < 2; ++h) {
      const uint8_t* qq = q + h * 128;
      uint8_t* ql = o.ql + h * 64;
      uint8_t* qh = o.qh + h * 32;
      for (int l = 0; l < 32; ++l) {
        ql[l] = static_cast<uint8_t>((qq[l] & 0xF) | ((qq[l + 64] & 0xF) << 4));
        ql[l + 32] = static_cast<uint8_t>((qq[l + 32] & 0xF) | ((qq[l + 96] & 0xF) << 4));
        qh[l] = static_cast<uint8_t>((qq[l] >> 4) | ((qq[l + 32] >> 4) << 2) | ((qq[l + 64] >> 4) << 4) |
                                     ((qq[l + 96] >> 4) << 6));
      }
    }
  }
}

void dequantize_q8_k(const BlockQ8_K* b, int64_t n, float* dst) {
  for (int64_t k = 0; k < n / kQK; ++k)
    for (int i = 0; i < kQK; ++i) dst[k * kQK + i] = b[k].d * static_cast<float>(b[k].q[i]);
}

void dequantize(DType t, const void* src, int64_t n, float* dst) {
  switch (t) {
    case DType::Q8_0: {
      auto b = static_cast<const BlockQ8_0*>(src);
      for (int64_t k = 0; k < n / kQ8_0; ++k) {
        const float d = f16_to_f32(b[k].d);
        for (int i = 0; i < kQ8_0; ++i) dst[k * kQ8_0 + i] = d * static_cast<float>(b[k].q[i]);
      }
      return;
    }
    case DType::Q4_K: {
      auto b = static_cast<const BlockQ4_K*>(src);
      for (int64_t k = 0; k < n / kQK; ++k) {
        const float d = f16_to_f32(b[k].d), dmin = f16_to_f32(b[k].dmin);
        float* y = dst + k * kQK;
        for (int j = 0; j < 8; ++j) {
          int sc, m;
          q4_k_scale_min(b[k].scales, j, sc, m);
          const float s = d * static_cast<float>(sc), off = dmin * static_cast<float>(m);
          const uint8_t* qs = b[k].qs + (j / 2) * 32;
          for (int i = 0; i < 32; ++i) y[j * 32 + i] = s * static_cast<float>(j % 2 ? qs[i] >> 4 : qs[i] & 0xF) - off;
        }
      }
      return;
    }
    case DType::Q6_K: {
      auto b = static_cast<const BlockQ6_K*>(src);
      for (int64_t k = 0; k < n / kQK; ++k) {
        const float d = f16_to_f32(b[k].d);
        for (int h = 0; h < 2; ++h) {  // each half: 32 positions l give values l, l+32, l+64, l+96
          const uint8_t* ql = b[k].ql + h * 64;
          const uint8_t* qh = b[k].qh + h * 32;
          const int8_t* sc = b[k].scales + h * 8;
          float* y = dst + k * kQK + h * 128;
          for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
            y[l + 32] = d * static_cast<float>(sc[is + 2]) *
                        static_cast<float>(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
            y[l + 64] = d * static_cast<float>(sc[is + 4]) *
                        static_cast<float>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            y[l + 96] = d * static_cast<float>(sc[is + 6]) *
                        static_cast<float>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
          }
        }
      }
      return;
    }
    default:
      throw std::invalid_argument(std::string("quant::dequantize: not a quantized dtype: ") + dtype_name(t));
  }
}

void quantize(DType t, const float* x, int64_t n, void* out) {
  switch (t) {
    case DType::Q8_0:
      return quantize_q8_0(x, n, static_cast<BlockQ8_0*>(out));
    case DType::Q4_K:
      return quantize_q4_k(x, n, static_cast<BlockQ4_K*>(out));
    case DType::Q6_K:
      return quantize_q6_k(x, n, static_cast<BlockQ6_K*>(out));
    default:
      throw std::invalid_argument(std::string("quant::quantize: not a quantized dtype: ") + dtype_name(t));
  }
}

}  // namespace hypic::quant
