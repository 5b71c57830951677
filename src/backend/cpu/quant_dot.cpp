#include "backend/cpu/quant_dot.h"

#include <immintrin.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensor/quant.h"

namespace hypic::quant {

namespace {

void need_blocks(DType w, int64_t K) {
  if (!dtype_is_quantized(w))
    throw std::invalid_argument(std::string("quantized product: ") + dtype_name(w) + " is not a quantized dtype");
  if (K % dtype_block(w) != 0)
    throw std::invalid_argument(std::string("quantized product: rows of ") + std::to_string(K) +
                                " values are not whole " + dtype_name(w) + " blocks of " +
                                std::to_string(dtype_block(w)));
}

// ---- plain references -------------------------------------------------------------------------

float dot_q8_0_ref(const BlockQ8_0* a, const BlockQ8_0* b, int64_t nb) {
  float s = 0.f;
  for (int64_t k = 0; k < nb; ++k) {
    int32_t isum = 0;
    for (int i = 0; i < kQ8_0; ++i) isum += static_cast<int32_t>(a[k].q[i]) * static_cast<int32_t>(b[k].q[i]);
    s += f16_to_f32(a[k].d) * f16_to_f32(b[k].d) * static_cast<float>(isum);
  }
  return s;
}

// sum_j d sc_j (q . x)_j - dmin m_j (sum x)_j, times x's scale, per super-block.
float dot_q4_k_ref(const BlockQ4_K* w, const BlockQ8_K* x, int64_t nb) {
  float s = 0.f;
  for (int64_t k = 0; k < nb; ++k) {
    int32_t sumi = 0, summ = 0;
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      q4_k_scale_min(w[k].scales, j, sc, m);
      const uint8_t* qs = w[k].qs + (j / 2) * 32;
      int32_t dot = 0, xs = 0;
      for (int i = 0; i < 32; ++i) {
        const int q = j % 2 ? qs[i] >> 4 : qs[i] & 0xF;
        dot += q * x[k].q[j * 32 + i];
        xs += x[k].q[j * 32 + i];
      }
      sumi += sc * dot;
      summ += m * xs;
    }
    s += x[k].d * (f16_to_f32(w[k].d) * static_cast<float>(sumi) - f16_to_f32(w[k].dmin) * static_cast<float>(summ));
  }
  return s;
}

// sum_s d sc_s ((q - 32) . x)_s, times x's scale, per super-block.
float dot_q6_k_ref(const BlockQ6_K* w, const BlockQ8_K* x, int64_t nb) {
  float s = 0.f;
  for (int64_t k = 0; k < nb; ++k) {
    int32_t sumi = 0;
    for (int sb = 0; sb < 16; ++sb) {
      int32_t dot = 0;
      for (int i = 0; i < 16; ++i) {
        const int e = sb * 16 + i, h = e / 128, r = e % 128, l = r % 32, quarter = r / 32;
        const uint8_t lo = w[k].ql[h * 64 + l + (quarter % 2) * 32];
        const int q = ((quarter < 2 ? lo & 0xF : lo >> 4) | (((w[k].qh[h * 32 + l] >> (2 * quarter)) & 3) << 4)) - 32;
        dot += q * x[k].q[e];
      }
      sumi += w[k].scales[sb] * dot;
    }
    s += x[k].d * f16_to_f32(w[k].d) * static_cast<float>(sumi);
  }
  return s;
}

float dot_ref(DType w, const void* row, const void* xq, int64_t K) {
  switch (w) {
    case DType::Q8_0:
      return dot_q8_0_ref(static_cast<const BlockQ8_0*>(row), static_cast<const BlockQ8_0*>(xq), K / kQ8_0);
    case DType::Q4_K:
      return dot_q4_k_ref(static_cast<const BlockQ4_K*>(row), static_cast<const BlockQ8_K*>(xq), K / kQK);
    default:
      return dot_q6_k_ref(static_cast<const BlockQ6_K*>(row), static_cast<const BlockQ8_K*>(xq), K / kQK);
  }
}

// ---- AVX2 kernels ---------------------------------------------------------------------------------
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HYPIC_QUANT_AVX2 1
inline float hsum(__m256 acc) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
inline int32_t hsum_i32(__m256i v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
  return _mm_cvtsi128_si32(h);
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
inline __m256i load(const void* q) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(q));
}

// One block's products, scaled, into acc: a's bytes made unsigned (|a|) and b's carrying a's signs.
inline __m256 q8_0_block(const BlockQ8_0& a, const BlockQ8_0& b, float bd, __m256 acc) {
  const __m256i va = load(a.q), vb = load(b.q);
  const __m256 s = _mm256_set1_ps(_cvtsh_ss(a.d) * bd);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_signed(_mm256_sign_epi8(va, va), _mm256_sign_epi8(vb, va))), s, acc);
}

// bd: b's scales as f32 (converted once per product, not once per row). Four accumulators (blocks
// k mod 4): one chain of FMAs bound a row to one block per FMA latency (~25 GB/s in cache).
float dot_q8_0(const BlockQ8_0* a, const BlockQ8_0* b, const float* bd, int64_t nb) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = acc0, acc3 = acc0;
  int64_t k = 0;
  for (; k + 4 <= nb; k += 4) {
    acc0 = q8_0_block(a[k], b[k], bd[k], acc0);
    acc1 = q8_0_block(a[k + 1], b[k + 1], bd[k + 1], acc1);
    acc2 = q8_0_block(a[k + 2], b[k + 2], bd[k + 2], acc2);
    acc3 = q8_0_block(a[k + 3], b[k + 3], bd[k + 3], acc3);
  }
  for (; k < nb; ++k) acc0 = q8_0_block(a[k], b[k], bd[k], acc0);
  return hsum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
}

// One row after another: W streams through memory in order. (Four rows at a time, sharing each
// activation block, was as fast in cache but read W from memory at a third of the rate: 15 against
// 50 GB/s on a 248320 x 1024 head, docs/perf-notes.md.)
void gemv_q8_0(const BlockQ8_0* w, const BlockQ8_0* xq, int64_t nb, int64_t n0, int64_t n1, float* y) {
  thread_local std::vector<float> xd;
  xd.resize(static_cast<size_t>(nb));
  for (int64_t k = 0; k < nb; ++k) xd[static_cast<size_t>(k)] = _cvtsh_ss(xq[k].d);
  for (int64_t n = n0; n < n1; ++n) y[n] = dot_q8_0(w + n * nb, xq, xd.data(), nb);
}

// The scales and mins of a Q4_K block as bytes j = sub-block j (layout: q4_k_scale_min).
inline void q4_k_unpack(const uint8_t* scales, uint64_t& sc, uint64_t& mn) {
  uint32_t u[3];
  std::memcpy(u, scales, 12);
  sc = (u[0] & 0x3f3f3f3fu) | static_cast<uint64_t>((u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)) << 32;
  mn = (u[1] & 0x3f3f3f3fu) | static_cast<uint64_t>(((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4))
                                  << 32;
}
// Q4_K's min correction: x's 16 sums of 16 values against the mins (bytes of mn), each min twice
// (a sub-block is 32 values), as 8 int32 partial sums.
inline __m256i q4_k_min_sums(uint64_t mn, const int16_t* bsums) {
  const __m128i m = _mm_cvtsi64_si128(static_cast<int64_t>(mn));
  return _mm256_madd_epi16(load(bsums), _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m)));
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HYPIC_QUANT_ZMM 1
// GCC 12 warns inside its own AVX-512 intrinsics (their _mm512_undefined_* operands) at -O3.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// Index vectors for vpermw: s16 lane i of idx[g] = g * per + i / (32 / per), i.e. `per` scales per
// 64-value maddubs result, each over its 32 / per pairs (Q4_K: 2 sub-blocks of 32 values; Q6_K: 4 of 16).
struct ScaleIdx {
  __m512i idx[4];
  explicit ScaleIdx(int per) {
    for (int g = 0; g < 4; ++g) {
      alignas(64) int16_t t[32];
      for (int i = 0; i < 32; ++i) t[i] = static_cast<int16_t>(g * per + i / (32 / per));
      idx[g] = _mm512_load_si512(t);
    }
  }
};

// Q4_K on 512-bit vectors (AVX-512 BW + VNNI): a chunk's 32 bytes are broadcast to both halves and
// shifted by 0 / 4 per half, so its low nibbles (values 64c..64c+31) sit in the low half and its
// high nibbles (the next 32) in the high half: one zmm of 64 values in x's own order. maddubs gives
// s16 pair sums, and vpdpwssd multiplies them by the sub-block's scale into the int32 sum in one
// instruction. ~46 instructions a block against the 256-bit version's ~75 (perf-notes, v9).
float dot_q4_k(const BlockQ4_K* w, const BlockQ8_K* x, int64_t nb) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const ScaleIdx si(2);
  __m512 acc = _mm512_setzero_ps();
  __m256 accm = _mm256_setzero_ps();
  for (int64_t k = 0; k < nb; ++k) {
    uint64_t sc, mn;
    q4_k_unpack(w[k].scales, sc, mn);
    const __m512i sc16 = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
    __m512i isum = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_broadcast_i64x4(load(w[k].qs + 32 * c));
      const __m512i q = _mm512_and_si512(_mm512_srlv_epi16(v, shift), m4);
      const __m512i p = _mm512_maddubs_epi16(q, _mm512_loadu_si512(x[k].q + 64 * c));
      isum = _mm512_dpwssd_epi32(isum, p, _mm512_permutexvar_epi16(si.idx[c], sc16));
    }
    const __m256i msum = q4_k_min_sums(mn, x[k].bsums);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(x[k].d * _cvtsh_ss(w[k].d)), acc);
    accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(x[k].d * _cvtsh_ss(w[k].dmin)), accm);
  }
  return _mm512_reduce_add_ps(acc) - hsum(accm);
}

// Q6_K on 512-bit vectors: a half-block's 64 ql bytes hold values 0..63 (low nibbles) and 64..127
// (high nibbles) of it, each in x's order; qh's 32 bytes, broadcast to both halves and shifted per
// half by a variable shift, give the top two bits of each. Scales as in dot_q4_k (16 values each).
float dot_q6_k(const BlockQ6_K* w, const BlockQ8_K* x, int64_t nb) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const ScaleIdx si(4);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < nb; ++k) {
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[k].scales));
    const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
    // The -32 offset: sum over the 16 sub-blocks of scale * x's sub-block sum, in one madd.
    const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(load(x[k].bsums), _mm256_cvtepi8_epi16(sc8)), 5);
    __m512i isum = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(off));
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(w[k].ql + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(load(w[k].qh + 32 * h));
      const __m512i v01 = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_sllv_epi16(qh, up), m30));
      const __m512i v23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                          _mm512_and_si512(_mm512_srlv_epi16(qh, down), m30));
      const __m512i p01 = _mm512_maddubs_epi16(v01, _mm512_loadu_si512(x[k].q + 128 * h));
      const __m512i p23 = _mm512_maddubs_epi16(v23, _mm512_loadu_si512(x[k].q + 128 * h + 64));
      isum = _mm512_dpwssd_epi32(isum, p01, _mm512_permutexvar_epi16(si.idx[2 * h], sc16));
      isum = _mm512_dpwssd_epi32(isum, p23, _mm512_permutexvar_epi16(si.idx[2 * h + 1], sc16));
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(x[k].d * _cvtsh_ss(w[k].d)), acc);
  }
  return _mm512_reduce_add_ps(acc);
}
#pragma GCC diagnostic pop
#else
// Q4_K: the nibbles of 32 bytes are 64 values (two sub-blocks); u8 nibbles x s8 activations
// through maddubs (|pair sums| <= 2 * 15 * 127), then times the sub-block's scale into int32.
// The 6-bit scales and mins are unpacked four at a time in 32-bit words, and the mins' correction
// (sum over sub-blocks of min * x's sub-block sum) is one madd of x's 16-value sums against the
// mins, kept in a vector across blocks: unpacking them one by one was about as many instructions
// as the dot products themselves.
float dot_q4_k(const BlockQ4_K* w, const BlockQ8_K* x, int64_t nb) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
  for (int64_t k = 0; k < nb; ++k) {
    uint64_t sc, mn;
    q4_k_unpack(w[k].scales, sc, mn);
    // The eight scales as 16-bit lanes in both halves; each is broadcast by one byte shuffle (a
    // scalar extract and broadcast per scale cost ~4 instructions each, nearly half the block's).
    const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
    __m256i isum = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load(w[k].qs + 32 * c);
      const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      const __m256i plo = _mm256_maddubs_epi16(lo, load(x[k].q + 64 * c));
      const __m256i phi = _mm256_maddubs_epi16(hi, load(x[k].q + 64 * c + 32));
      const __m256i s_lo =
          _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(static_cast<int16_t>(((4 * c + 1) << 8) | (4 * c))));
      const __m256i s_hi =
          _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(static_cast<int16_t>(((4 * c + 3) << 8) | (4 * c + 2))));
      isum = _mm256_add_epi32(isum, _mm256_madd_epi16(plo, s_lo));
      isum = _mm256_add_epi32(isum, _mm256_madd_epi16(phi, s_hi));
    }
    const __m256i msum = q4_k_min_sums(mn, x[k].bsums);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(x[k].d * _cvtsh_ss(w[k].d)), acc);
    accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(x[k].d * _cvtsh_ss(w[k].dmin)), accm);
  }
  return hsum(acc) - hsum(accm);
}

// Q6_K: 6-bit values rebuilt from ql and qh as u8 in [0, 63] (the -32 offset is taken out
// afterwards with the 16-value sums of x); u8 x s8 through maddubs (|pair sums| <= 2 * 63 * 127),
// then times the two 16-value sub-blocks' scales into int32.
float dot_q6_k(const BlockQ6_K* w, const BlockQ8_K* x, int64_t nb) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  // Even scales to the low half's 16-bit lanes, odd ones to the high half's: scales s and s + 1 of
  // a 32-value stretch are then one byte shuffle away (lane s / 2 of each half).
  const __m128i even_odd = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  float acc = 0.f;
  for (int64_t k = 0; k < nb; ++k) {
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[k].scales));
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, even_odd));
    // The -32 offset: sum over the 16 sub-blocks of scale * x's sub-block sum, in one madd.
    __m256i isum = _mm256_slli_epi32(_mm256_madd_epi16(load(x[k].bsums), _mm256_cvtepi8_epi16(sc8)), 5);
    isum = _mm256_sub_epi32(_mm256_setzero_si256(), isum);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = load(w[k].ql + 64 * h), ql1 = load(w[k].ql + 64 * h + 32), qh = load(w[k].qh + 32 * h);
      const __m256i v[4] = {_mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30)),
                            _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30))};
      for (int i = 0; i < 4; ++i) {
        const __m256i p = _mm256_maddubs_epi16(v[i], load(x[k].q + 128 * h + 32 * i));
        const int e = 4 * h + i;  // scales 2e (low half) and 2e + 1 (high half)
        const __m256i scv =
            _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(static_cast<int16_t>(((2 * e + 1) << 8) | (2 * e))));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, scv));
      }
    }
    acc += x[k].d * _cvtsh_ss(w[k].d) * static_cast<float>(hsum_i32(isum));
  }
  return acc;
}
#endif  // HYPIC_QUANT_ZMM
#endif

}  // namespace

size_t act_bytes(DType w, int64_t K) {
  need_blocks(w, K);
  return w == DType::Q8_0 ? static_cast<size_t>(K / kQ8_0) * sizeof(BlockQ8_0)
                          : static_cast<size_t>(K / kQK) * sizeof(BlockQ8_K);
}

void quantize_act(DType w, const float* x, int64_t K, void* xq) {
  need_blocks(w, K);
  if (w == DType::Q8_0)
    quantize_q8_0(x, K, static_cast<BlockQ8_0*>(xq));
  else
    quantize_q8_k(x, K, static_cast<BlockQ8_K*>(xq));
}

void gemv_rows_ref(DType w, const void* W, const void* xq, int64_t K, int64_t n0, int64_t n1, float* y) {
  need_blocks(w, K);
  const size_t rb = dtype_bytes(w, K);
  for (int64_t n = n0; n < n1; ++n) y[n] = dot_ref(w, static_cast<const char*>(W) + static_cast<size_t>(n) * rb, xq, K);
}

void gemv_rows(DType w, const void* W, const void* xq, int64_t K, int64_t n0, int64_t n1, float* y) {
#ifdef HYPIC_QUANT_AVX2
  need_blocks(w, K);
  const size_t rb = dtype_bytes(w, K);
  auto row = [&](int64_t n) { return static_cast<const char*>(W) + static_cast<size_t>(n) * rb; };
  switch (w) {
    case DType::Q8_0:
      gemv_q8_0(static_cast<const BlockQ8_0*>(W), static_cast<const BlockQ8_0*>(xq), K / kQ8_0, n0, n1, y);
      return;
    case DType::Q4_K:
      for (int64_t n = n0; n < n1; ++n)
        y[n] = dot_q4_k(reinterpret_cast<const BlockQ4_K*>(row(n)), static_cast<const BlockQ8_K*>(xq), K / kQK);
      return;
    default:
      for (int64_t n = n0; n < n1; ++n)
        y[n] = dot_q6_k(reinterpret_cast<const BlockQ6_K*>(row(n)), static_cast<const BlockQ8_K*>(xq), K / kQK);
      return;
  }
#else
  gemv_rows_ref(w, W, xq, K, n0, n1, y);
#endif
}

const char* dot_kernel() {
#if !defined(HYPIC_QUANT_AVX2)
  return "plain";
#elif defined(HYPIC_QUANT_ZMM)
  return "avx512-vnni, zmm k-quants";
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512-vnni";
#elif defined(__AVXVNNI__)
  return "avx-vnni";
#else
  return "avx2";
#endif
}

}  // namespace hypic::quant
