#include "backend/cpu/cpu_backend.h"

#include <cblas.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/checks.h"
#include "backend/cpu/bf16_gemm.h"
#include "backend/cpu/quant_dot.h"
#include "backend/moe_routing.h"
#include "linear/gated_delta.h"
#include "linear/recurrence.h"
#include "tensor/quant.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HYPIC_AVX2 1
#endif

namespace hypic::cpu {

// ================================================================================================
// Argument validation. Every op checks dtypes, ranks and shapes before touching memory and throws
// std::invalid_argument("<op>: <what>") naming the tensors involved.
// ================================================================================================
namespace {
using namespace checks;

// ================================================================================================
// Element loads (f32 / bf16 / f16) and small vector helpers.
// ================================================================================================
inline float ld(const float* p) {
  return *p;
}
inline float ld(const uint16_t* p, DType dt) {
  return dt == DType::BF16 ? bf16_to_f32(*p) : f16_to_f32(*p);
}

// Converts n elements of a float dtype to f32 (vectorised for bf16/f16).
void to_f32_row(const void* src, DType dt, float* dst, int64_t n) {
  if (dtype_is_quantized(dt)) {
    quant::dequantize(dt, src, n, dst);
    return;
  }
  if (dt == DType::F32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
    return;
  }
  auto s = static_cast<const uint16_t*>(src);
  int64_t i = 0;
#ifdef HYPIC_AVX2
  if (dt == DType::BF16) {
    for (; i + 8 <= n; i += 8) {
      __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
  }
#ifdef __F16C__
  else {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  }
#endif
#endif
  if (dt == DType::BF16)
    for (; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  else
    for (; i < n; ++i) dst[i] = f16_to_f32(s[i]);
}

// Weight element access by dtype tag, for the fused GEMV.
struct WF32 {
  using T = float;
  static float one(const T* p) { return *p; }
#ifdef __AVX512F__
  static __m512 sixteen(const T* p) {
    return _mm512_loadu_ps(p);
  }
#endif
#ifdef HYPIC_AVX2
  static __m256 eight(const T* p) {
    return _mm256_loadu_ps(p);
  }
#endif
};
struct WBF16 {
  using T = uint16_t;
  static float one(const T* p) { return bf16_to_f32(*p); }
#ifdef __AVX512F__
  static __m512 sixteen(const T* p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
#endif
#ifdef HYPIC_AVX2
  static __m256 eight(const T* p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
#endif
};
struct WF16 {
  using T = uint16_t;
  static float one(const T* p) { return f16_to_f32(*p); }
#ifdef __AVX512F__
  static __m512 sixteen(const T* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
#endif
#ifdef HYPIC_AVX2
  static __m256 eight(const T* p) {
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    alignas(32) float t[8];
    for (int i = 0; i < 8; ++i) t[i] = f16_to_f32(p[i]);
    return _mm256_load_ps(t);
#endif
  }
#endif
};

#ifdef HYPIC_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for f32 lanes (Cephes-style range reduction + degree-6 polynomial, ~1-2 ulp).
inline __m256 exp256(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  __m256 x2 = _mm256_mul_ps(x, x);
  y = _mm256_fmadd_ps(y, x2, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef HYPIC_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
  s = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out[i] = sum_j p[j] * rows[j][i]: y += a * x over n lanes.
inline void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// exp256's arithmetic on one value: the same operations in the same order (std::fma is one
// rounding, as a lane's FMA), so an element gets the same bits whether a vector loop or its scalar
// tail computes it; a row's activations then do not depend on where a chunk of rows starts
// (row-independent products, composed prefixes continuing bit for bit).
inline float exp1(float x) {
  x = x < 88.3762626647949f ? x : 88.3762626647949f;  // minps / maxps, operand order included
  x = x > -87.3365478515625f ? x : -87.3365478515625f;
  const float fx = std::nearbyint(x * 1.44269504088896341f);
  x = std::fma(-fx, 0.693359375f, x);
  x = std::fma(-fx, -2.12194440e-4f, x);
  float y = 1.9875691500E-4f;
  y = std::fma(y, x, 1.3981999507E-3f);
  y = std::fma(y, x, 8.3334519073E-3f);
  y = std::fma(y, x, 4.1665795894E-2f);
  y = std::fma(y, x, 1.6666665459E-1f);
  y = std::fma(y, x, 5.0000001201E-1f);
  const float x2 = x * x;
  y = std::fma(y, x2, x + 1.0f);
  return y * std::bit_cast<float>((static_cast<int32_t>(fx) + 127) << 23);
}

// SiLU and the sigmoid on exp1 (scalar) and exp256 (AVX2 lanes): the same bits either way, and
// 10-20x fewer cycles than libm's expf in the vector loops (activations were ~10% of a prefill
// of the default model; docs/perf-notes.md).
inline float silu(float x) {
  return x / (1.0f + exp1(-x));
}
inline float sigmoid(float x) {
  return 1.0f / (1.0f + exp1(-x));
}
#ifdef HYPIC_AVX2
inline __m256 neg256(__m256 x) {
  return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f));
}
inline __m256 silu256(__m256 x) {
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(neg256(x))));
}
inline __m256 sigmoid256(__m256 x) {
  return _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(neg256(x))));
}
#endif

// The largest of init and p[0..n) (exact in any order).
float max_of(const float* p, int64_t n, float init) {
  int64_t i = 0;
  float mx = init;
#ifdef HYPIC_AVX2
  if (n >= 8) {
    __m256 v = _mm256_set1_ps(init);
    for (; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(p + i));
    alignas(32) float l[8];
    _mm256_store_ps(l, v);
    for (float x : l) mx = x > mx ? x : mx;
  }
#endif
  for (; i < n; ++i) mx = p[i] > mx ? p[i] : mx;
  return mx;
}

// p[i] = exp(p[i] - mx) for i < n, and their sum (eight partial sums on AVX2): one pass where the
// softmax made three. The tail takes exp1, so a score's bits do not depend on its lane.
float exp_shifted_sum(float* p, int64_t n, float mx) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef HYPIC_AVX2
  if (n >= 8) {
    const __m256 m = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + i), m));
      _mm256_storeu_ps(p + i, e);
      acc = _mm256_add_ps(acc, e);
    }
    alignas(32) float l[8];
    _mm256_store_ps(l, acc);
    sum = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
  }
#endif
  for (; i < n; ++i) sum += (p[i] = exp1(p[i] - mx));
  return sum;
}

// A per-thread scratch vector (grows, never shrinks): kernels allocate nothing in steady state.
float* scratch(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// ================================================================================================
// Fused convert + dot GEMV for decode (M < 8): each output row of W is read once, converted in
// registers and dotted with all M input rows; W (bf16/f16) is never materialised as f32.
// ================================================================================================
// Fixed: one accumulation order whatever MM is (row-independent products); otherwise blocks of
// one or two rows use more accumulators to cover FMA latency.
template <typename W, int MM, bool Fixed = false>
void gemv_rows(const float* x, int64_t K, const typename W::T* w, int64_t N, int64_t n0, int64_t n1, float* y,
               bool acc) {
  for (int64_t n = n0; n < n1; ++n) {
    const typename W::T* wr = w + n * K;
    float s[MM];
    int64_t k = 0;
#ifdef __AVX512F__
    // 16 lanes first (two accumulators per row for short row blocks, to cover FMA latency); the
    // AVX2 loop below takes the remainder.
    constexpr int U5 = MM <= 2 && !Fixed ? 2 : 1;
    __m512 z[MM][U5];
    for (int m = 0; m < MM; ++m)
      for (int u = 0; u < U5; ++u) z[m][u] = _mm512_setzero_ps();
    for (; k + 16 * U5 <= K; k += 16 * U5) {
      __m512 wv[U5];
      for (int u = 0; u < U5; ++u) wv[u] = W::sixteen(wr + k + 16 * u);
      for (int m = 0; m < MM; ++m)
        for (int u = 0; u < U5; ++u) z[m][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16 * u), wv[u], z[m][u]);
    }
#endif
#ifdef HYPIC_AVX2
    constexpr int U = MM <= 2 && !Fixed ? 4 : 2;
    __m256 a[MM][U];
    for (int m = 0; m < MM; ++m)
      for (int u = 0; u < U; ++u) a[m][u] = _mm256_setzero_ps();
    for (; k + 8 * U <= K; k += 8 * U) {
      __m256 wv[U];
      for (int u = 0; u < U; ++u) wv[u] = W::eight(wr + k + 8 * u);
      for (int m = 0; m < MM; ++m)
        for (int u = 0; u < U; ++u) a[m][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8 * u), wv[u], a[m][u]);
    }
    for (; k + 8 <= K; k += 8) {
      __m256 wv = W::eight(wr + k);
      for (int m = 0; m < MM; ++m) a[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wv, a[m][0]);
    }
    for (int m = 0; m < MM; ++m) {
      __m256 t = a[m][0];
      for (int u = 1; u < U; ++u) t = _mm256_add_ps(t, a[m][u]);
      s[m] = hsum(t);
#ifdef __AVX512F__
      for (int u = 0; u < U5; ++u) s[m] += _mm512_reduce_add_ps(z[m][u]);
#endif
    }
#else
    for (int m = 0; m < MM; ++m) s[m] = 0.f;
#endif
    // std::fma, not `s += x * w`: the compiler contracts that into an FMA in some instantiations
    // and not in others (f16 weights), and a row's bits must not depend on MM (row-independent
    // products; CpuOps.RowIndependentProducts).
    for (; k < K; ++k) {
      float wk = W::one(wr + k);
      for (int m = 0; m < MM; ++m) s[m] = std::fma(x[m * K + k], wk, s[m]);
    }
    for (int m = 0; m < MM; ++m) y[m * N + n] = acc ? y[m * N + n] + s[m] : s[m];
  }
}

template <typename W>
void gemv_dispatch(int64_t M, const float* x, int64_t K, const typename W::T* w, int64_t N, int64_t n0, int64_t n1,
                   float* y, bool acc, bool fixed) {
  if (fixed) switch (M) {
      case 1:
        return gemv_rows<W, 1, true>(x, K, w, N, n0, n1, y, acc);
      case 2:
        return gemv_rows<W, 2, true>(x, K, w, N, n0, n1, y, acc);
      default:
        break;  // three rows and more: the same order either way
    }
  switch (M) {
    case 1:
      return gemv_rows<W, 1>(x, K, w, N, n0, n1, y, acc);
    case 2:
      return gemv_rows<W, 2>(x, K, w, N, n0, n1, y, acc);
    case 3:
      return gemv_rows<W, 3>(x, K, w, N, n0, n1, y, acc);
    case 4:
      return gemv_rows<W, 4>(x, K, w, N, n0, n1, y, acc);
    case 5:
      return gemv_rows<W, 5>(x, K, w, N, n0, n1, y, acc);
    case 6:
      return gemv_rows<W, 6>(x, K, w, N, n0, n1, y, acc);
    default:
      return gemv_rows<W, 7>(x, K, w, N, n0, n1, y, acc);
  }
}

#if defined(HYPIC_AVX2) && !defined(__AVX512F__)
// Few-row products blocked over rows and weight rows (AVX2): MR rows of x against NR rows of W,
// one 8-lane accumulator per output, so each x vector serves NR FMAs while it is in L1 and x
// streams from L2 once per NR weight rows (the one-weight-row kernel above streams its seven rows
// of x once per weight row, from L2 once they leave L1 beyond K = 1024). Every output
// sums its products in the same order whatever MR and NR are (8-lane chunks in k order, a
// horizontal sum, then the scalar tail), so a row's bits do not depend on the rows beside it: this
// is the row-independent product at every M (CpuOps.RowIndependentProducts).
#define HYPIC_BLOCKED_GEMM 1
template <typename W, int MR, int NR>
void gemm_block(const float* x, int64_t K, const typename W::T* w, int64_t N, int64_t n, float* y, bool acc) {
  __m256 a[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) a[m][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = W::eight(w + (n + j) * K + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int j = 0; j < NR; ++j) a[m][j] = _mm256_fmadd_ps(xv, wv[j], a[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) {
      float s = hsum(a[m][j]);
      for (int64_t kk = k; kk < K; ++kk) s = std::fma(x[m * K + kk], W::one(w + (n + j) * K + kk), s);
      float& o = y[m * N + n + j];
      o = acc ? o + s : s;
    }
}

// Weight rows [n0, n1) for MR rows: blocks of NR (12 accumulators at most), the rest one by one.
template <typename W, int MR>
void gemm_rows(const float* x, int64_t K, const typename W::T* w, int64_t N, int64_t n0, int64_t n1, float* y,
               bool acc) {
  constexpr int NR = MR == 4 ? 3 : MR == 3 ? 4 : MR == 2 ? 5 : 7;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) gemm_block<W, MR, NR>(x, K, w, N, n, y, acc);
  for (; n < n1; ++n) gemm_block<W, MR, 1>(x, K, w, N, n, y, acc);
}

// y[0:M, n0:n1] of x W^T: weight tiles of 24 rows (in L1 at small K) against blocks of 4 rows.
template <typename W>
void gemm_few_rows(int64_t M, const float* x, int64_t K, const typename W::T* w, int64_t N, int64_t n0, int64_t n1,
                   float* y, bool acc) {
  for (int64_t t0 = n0; t0 < n1; t0 += 24) {
    const int64_t t1 = std::min(n1, t0 + 24);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) gemm_rows<W, 4>(x + m * K, K, w, N, t0, t1, y + m * N, acc);
    switch (M - m) {
      case 3:
        gemm_rows<W, 3>(x + m * K, K, w, N, t0, t1, y + m * N, acc);
        break;
      case 2:
        gemm_rows<W, 2>(x + m * K, K, w, N, t0, t1, y + m * N, acc);
        break;
      case 1:
        gemm_rows<W, 1>(x + m * K, K, w, N, t0, t1, y + m * N, acc);
        break;
      default:
        break;
    }
  }
}
#endif

#ifdef __AVX512F__
// Few-row products blocked over rows and weight rows (AVX-512; the AVX2 twin is above): MR rows of
// x against NR weight rows, one 16-lane accumulator per output, so each weight vector (converted
// once) serves MR FMAs and each x vector NR (the seven-row GEMV converts a weight vector and loads
// x per 7 FMAs, and from K = 2048 on its seven rows of x leave L1). Every output sums in one order
// whatever MR and NR are (16-lane chunks in k order, _mm512_reduce_add_ps, then the scalar tail).
#define HYPIC_BLOCKED_GEMM16 1
template <typename W, int MR, int NR>
void gemm_block16(const float* x, int64_t K, const typename W::T* w, int64_t N, int64_t n, float* y, bool acc) {
  __m512 a[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) a[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = W::sixteen(w + (n + j) * K + k);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int j = 0; j < NR; ++j) a[m][j] = _mm512_fmadd_ps(xv, wv[j], a[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) {
      float s = _mm512_reduce_add_ps(a[m][j]);
      for (int64_t kk = k; kk < K; ++kk) s = std::fma(x[m * K + kk], W::one(w + (n + j) * K + kk), s);
      float& o = y[m * N + n + j];
      o = acc ? o + s : s;
    }
}

template <typename W, int MR>
void gemm_rows16(const float* x, int64_t K, const typename W::T* w, int64_t N, int64_t n0, int64_t n1, float* y,
                 bool acc) {
  constexpr int NR = MR >= 6 ? 4 : MR >= 4 ? 6 : 8;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) gemm_block16<W, MR, NR>(x, K, w, N, n, y, acc);
  for (; n < n1; ++n) gemm_block16<W, MR, 1>(x, K, w, N, n, y, acc);
}

// y[0:M, n0:n1] of x W^T: tiles of weight rows that stay in L1 (~16 KiB, 24 rows at least)
// against blocks of 6 rows of x.
template <typename W>
void gemm_few_rows16(int64_t M, const float* x, int64_t K, const typename W::T* w, int64_t N, int64_t n0, int64_t n1,
                     float* y, bool acc) {
  constexpr int MR = 6;
  const int64_t tile = std::max<int64_t>(24, (16384 / (K * int64_t{sizeof(typename W::T)})) / 24 * 24);
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    int64_t m = 0;
    for (; m + MR <= M; m += MR) gemm_rows16<W, MR>(x + m * K, K, w, N, t0, t1, y + m * N, acc);
    switch (M - m) {
      case 5:
        gemm_rows16<W, 5>(x + m * K, K, w, N, t0, t1, y + m * N, acc);
        break;
      case 4:
        gemm_rows16<W, 4>(x + m * K, K, w, N, t0, t1, y + m * N, acc);
        break;
      case 3:
        gemm_rows16<W, 3>(x + m * K, K, w, N, t0, t1, y + m * N, acc);
        break;
      case 2:
        gemm_rows16<W, 2>(x + m * K, K, w, N, t0, t1, y + m * N, acc);
        break;
      case 1:
        gemm_rows16<W, 1>(x + m * K, K, w, N, t0, t1, y + m * N, acc);
        break;
      default:
        break;
    }
  }
}

// Row-independent products as one FMA chain per output: y[m][n] = fma(x[m][K-1], w[n][K-1], ...
// fma(x[m][0], w[n][0], 0)), k in order, whichever rows are computed together. Two layouts give
// those same bits: from 16 rows, the rows of x in the lanes (x transposed once per call, each
// weight element broadcast to 16 rows); below, the weight rows in the lanes (16 weight rows
// converted and transposed to k-major, each element of x broadcast). Nothing is reduced across
// lanes, so no horizontal sums: at the default model's K = 256-512 and ~80 seam rows this runs at
// ~1.35x the seven-row GEMV (98-105 against 72-75 GFLOP/s on one core here); a lone row is ~3x
// slower than the GEMV (its 16 weight rows are transposed for it), but composing never computes
// one (docs/perf-notes.md). CpuOps.RowIndependentProducts checks the bits.

// r[j] = row j of a 16 x 16 block -> r[c] = its column c (unpack pairs, then 4-wide and 128-bit
// lane shuffles).
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + c]: columns c, c + 4, c + 8, c + 12 of rows 4g..4g+3
    u[4 * g + 0] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88),
                 w1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    r[c + 8] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    r[c + 4] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    r[c + 12] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
}

// dst[k][0:16] = src row j's element k for the rows j < cnt (zero for the others), k < K: 16 rows
// of W (stride K) or of x, transposed to k-major in 16 x 16 blocks.
template <typename W>
void pack16_kmajor(const typename W::T* src, int64_t ld, int cnt, int64_t K, float* dst, int64_t ldd) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 r[16];
    for (int j = 0; j < 16; ++j) r[j] = j < cnt ? W::sixteen(src + j * ld + k) : _mm512_setzero_ps();
    transpose16(r);
    for (int c = 0; c < 16; ++c) _mm512_storeu_ps(dst + (k + c) * ldd, r[c]);
  }
  for (; k < K; ++k)
    for (int j = 0; j < 16; ++j) dst[k * ldd + j] = j < cnt ? W::one(src + j * ld + k) : 0.f;
}

// Rows of x in the lanes: MI vectors of 16 rows against NR weight rows; yt is [NR][Mp].
template <int MI, int NR>
void chain_rows_block(const float* xt, int64_t Mp, int64_t K, const float* wt, float* yt) {
  __m512 a[MI][NR];
  for (int i = 0; i < MI; ++i)
    for (int j = 0; j < NR; ++j) a[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 xv[MI];
    for (int i = 0; i < MI; ++i) xv[i] = _mm512_loadu_ps(xt + k * Mp + 16 * i);
    for (int j = 0; j < NR; ++j) {
      const __m512 b = _mm512_set1_ps(wt[j * K + k]);
      for (int i = 0; i < MI; ++i) a[i][j] = _mm512_fmadd_ps(xv[i], b, a[i][j]);
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int i = 0; i < MI; ++i) _mm512_storeu_ps(yt + j * Mp + 16 * i, a[i][j]);
}

template <int NR>
void chain_rows_tile(const float* xt, int64_t Mp, int64_t K, const float* wt, float* yt) {
  int64_t m0 = 0;
  for (; m0 + 64 <= Mp; m0 += 64) chain_rows_block<4, NR>(xt + m0, Mp, K, wt, yt + m0);
  switch ((Mp - m0) / 16) {
    case 3:
      chain_rows_block<3, NR>(xt + m0, Mp, K, wt, yt + m0);
      break;
    case 2:
      chain_rows_block<2, NR>(xt + m0, Mp, K, wt, yt + m0);
      break;
    case 1:
      chain_rows_block<1, NR>(xt + m0, Mp, K, wt, yt + m0);
      break;
    default:
      break;
  }
}

// y[0:M, n0:n1] from xt = x transposed ([K][Mp], Mp = M rounded up to 16, zero rows below M):
// weight rows converted to f32 six at a time, results gathered in [n][Mp] and written out once
// (writing y column by column would touch M lines per column, 4 KiB apart at N = 1024).
template <typename W>
void chain_rows(const float* xt, int64_t M, int64_t Mp, int64_t K, const typename W::T* w, DType wd, int64_t N,
                int64_t n0, int64_t n1, float* y, bool acc) {
  constexpr int NR = 6;
  thread_local std::vector<float> wt_buf, yt_buf;
  float* wt = scratch(wt_buf, static_cast<size_t>(NR * K));
  float* yt = scratch(yt_buf, static_cast<size_t>((n1 - n0) * Mp));
  for (int64_t n = n0; n < n1; n += NR) {
    const int nr = static_cast<int>(std::min<int64_t>(NR, n1 - n));
    for (int j = 0; j < nr; ++j) to_f32_row(w + (n + j) * K, wd, wt + j * K, K);
    float* yn = yt + (n - n0) * Mp;
    switch (nr) {
      case 6:
        chain_rows_tile<6>(xt, Mp, K, wt, yn);
        break;
      case 5:
        chain_rows_tile<5>(xt, Mp, K, wt, yn);
        break;
      case 4:
        chain_rows_tile<4>(xt, Mp, K, wt, yn);
        break;
      case 3:
        chain_rows_tile<3>(xt, Mp, K, wt, yn);
        break;
      case 2:
        chain_rows_tile<2>(xt, Mp, K, wt, yn);
        break;
      default:
        chain_rows_tile<1>(xt, Mp, K, wt, yn);
        break;
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    float* ym = y + m * N;
    for (int64_t n = n0; n < n1; ++n) ym[n] = acc ? ym[n] + yt[(n - n0) * Mp + m] : yt[(n - n0) * Mp + m];
  }
}

// Weight rows in the lanes (fewer than 16 rows of x): MR rows of x against 16 weight rows held
// k-major in wk ([K][16]); cnt of the 16 are real.
template <int MR>
void chain_cols_block(const float* x, int64_t K, const float* wk, float* y, int64_t N, int64_t n, int cnt, bool acc) {
  __m512 a[MR];
  for (int m = 0; m < MR; ++m) a[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 wv = _mm512_loadu_ps(wk + k * 16);
    for (int m = 0; m < MR; ++m) a[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), wv, a[m]);
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << cnt) - 1u);
  for (int m = 0; m < MR; ++m) {
    float* o = y + m * N + n;
    __m512 r = a[m];
    if (acc) r = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, o), r);
    _mm512_mask_storeu_ps(o, mask, r);
  }
}

template <typename W>
void chain_cols(int64_t M, const float* x, int64_t K, const typename W::T* w, int64_t N, int64_t n0, int64_t n1,
                float* y, bool acc) {
  thread_local std::vector<float> wk_buf;
  float* wk = scratch(wk_buf, static_cast<size_t>(K * 16));
  for (int64_t n = n0; n < n1; n += 16) {
    const int cnt = static_cast<int>(std::min<int64_t>(16, n1 - n));
    pack16_kmajor<W>(w + n * K, K, cnt, K, wk, 16);
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) chain_cols_block<8>(x + m * K, K, wk, y + m * N, N, n, cnt, acc);
    switch (M - m) {
      case 7:
        chain_cols_block<7>(x + m * K, K, wk, y + m * N, N, n, cnt, acc);
        break;
      case 6:
        chain_cols_block<6>(x + m * K, K, wk, y + m * N, N, n, cnt, acc);
        break;
      case 5:
        chain_cols_block<5>(x + m * K, K, wk, y + m * N, N, n, cnt, acc);
        break;
      case 4:
        chain_cols_block<4>(x + m * K, K, wk, y + m * N, N, n, cnt, acc);
        break;
      case 3:
        chain_cols_block<3>(x + m * K, K, wk, y + m * N, N, n, cnt, acc);
        break;
      case 2:
        chain_cols_block<2>(x + m * K, K, wk, y + m * N, N, n, cnt, acc);
        break;
      case 1:
        chain_cols_block<1>(x + m * K, K, wk, y + m * N, N, n, cnt, acc);
        break;
      default:
        break;
    }
  }
}
#endif

thread_local std::vector<float> t_panel, t_buf0, t_buf1, t_buf2, t_buf3, t_xt;

}  // namespace

// ================================================================================================
// Construction and memory.
// ================================================================================================
CpuBackend::CpuBackend(int threads) : pool_(threads) {
  // All parallelism is ours: OpenBLAS runs single-threaded inside pool chunks. Its own pthread
  // workers would otherwise spin after each call and compete with the pool for the same cores.
  openblas_set_num_threads(1);
#ifdef __GLIBC__
  // Every forward allocates activations of up to tens of MiB and frees them again. With glibc's
  // dynamic mmap threshold those came from fresh mmaps whose pages were faulted in and zeroed by the
  // kernel on every call: half of a 2k-token prefill of the default model (perf: page faults and
  // memset). Fixed thresholds keep them in the heap and reuse its pages (prefill 0.91 -> 0.47 s,
  // full-recompute TTFT 0.95 -> 0.41 s; docs/perf-notes.md). Process-wide, set once.
  static const bool tuned = [] {
    mallopt(M_MMAP_THRESHOLD, 64 << 20);
    mallopt(M_TRIM_THRESHOLD, 512 << 20);
    return true;
  }();
  (void)tuned;
#endif
}

CpuBackend::~CpuBackend() = default;

Tensor CpuBackend::alloc(DType dt, Shape shape) {
  return Tensor::empty(dt, std::move(shape));
}

Tensor CpuBackend::alloc_uninit(DType dt, Shape shape) {
  return Tensor::uninitialized(dt, std::move(shape));
}

Tensor CpuBackend::to_device(const Tensor& host) {
  need_def("to_device", "host", host);
  return host;
}

Tensor CpuBackend::to_host(const Tensor& t) {
  need_def("to_host", "t", t);
  return t;
}

void CpuBackend::copy(const Tensor& src, Tensor& dst) {
  need_def("copy", "src", src);
  need_def("copy", "dst", dst);
  if (src.dtype() != dst.dtype() || src.numel() != dst.numel())
    fail("copy", "src " + src.str() + " and dst " + dst.str() + ": dtype or element count differ");
  if (src.raw() != dst.raw()) std::memmove(dst.raw(), src.raw(), src.nbytes());
}

void CpuBackend::fill(Tensor& t, float value) {
  need_f32("fill", "t", t);
  float* p = t.data<float>();
  pool_.parallel_for(
      t.numel(), [&](int64_t b, int64_t e) { std::fill(p + b, p + e, value); }, 1 << 16);
}

// ================================================================================================
// matmul: y[M,N] = x[M,K] W[N,K]^T.
//
// Weights are used in place in their stored dtype: bf16/f16 checkpoints stay bf16/f16 in memory
// (often memory-mapped), so memory is never doubled by an f32 copy of the model.
//  * M < 8 (decode): a fused convert+dot GEMV over output rows, parallel over rows. It is
//    memory-bound, and reading 2-byte weights halves the traffic compared with f32.
//  * M >= 8, bf16/f16 (and quantized weights from kQuantGemvRows rows): W is converted panel by
//    panel (64-256 rows) into a per-thread f32 scratch, and each panel is one single-threaded
//    sgemm; panels are spread over the pool. The conversion costs O(N K) against the product's
//    O(M N K). Fewer rows of quantized weights: matmul_quantized_gemv.
//  * M >= 8, f32: sgemm directly on W, its columns split over the pool (one sgemm per thread).
//  * Below those (bf16/f16 under 48 rows): from three rows of long rows (K > 1024) the few-row
//    kernel blocked over rows and weight rows (gemm_few_rows on AVX2, gemm_few_rows16 on
//    AVX-512), otherwise the seven-row GEMV.
//  * Row-independent products (PIC's seam rows), at every M: on AVX-512 one FMA chain per output
//    (chain_rows from 16 rows, chain_cols below); on AVX2 the seven-row GEMV, and the blocked
//    kernel for K > 1024.
//  * Not precise (`--activations bf16`), bf16 weights from kBf16Rows rows, quantized ones from
//    kQuantGemvRows: matmul_bf16.
// OpenBLAS is set to one thread (constructor): the pool is the only source of parallelism.
// ================================================================================================
void CpuBackend::matmul(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate) {
  check_matmul(x, w, y, DeviceKind::CPU);
  const int64_t M = x.dim(0), K = x.dim(1), N = w.dim(0);
  if (M == 0 || N == 0) return;
  float* yp = y.data<float>();
  if (K == 0) {
    if (!accumulate) std::fill(yp, yp + M * N, 0.f);
    return;
  }
  const float* xp = x.data<float>();
  const DType wd = w.dtype();
  if (!precise_ && !row_independent_ &&
      ((wd == DType::BF16 && M >= kBf16Rows) || (dtype_is_quantized(wd) && M >= kQuantGemvRows))) {
    matmul_bf16(x, w, y, accumulate);
    return;
  }
  if (dtype_is_quantized(wd) && (row_independent_ || M < kQuantGemvRows)) {
    matmul_quantized_gemv(x, w, y, accumulate);
    return;
  }

  // Few rows: the fused kernel, looping over row blocks of up to 7 inside 16-row tiles of W so a
  // tile stays in L1 while every block of x passes over it. For half-precision weights this
  // beats converting whole panels up to a few dozen rows (seams, questions, batched decode),
  // because the panel path converts all of W whatever M is.
  // Row-independent mode: this kernel at every M (rows in blocks of at most 7, each row with its
  // own accumulators in one order), so no row's bits depend on the rows beside it.
  if (!dtype_is_quantized(wd) && (row_independent_ || M < 8 || (wd != DType::F32 && M < 48))) {
    const bool fixed = row_independent_;
    // ~16 KiB of weights per chunk at least, so tiny products are not split.
    int64_t grain = std::max<int64_t>(1, 8192 / K);
#ifdef HYPIC_BLOCKED_GEMM16
    // AVX-512: one FMA chain per output (chain_rows / chain_cols) for row-independent products
    // and for 16-47 rows up to K = 1024 (chain_applies); from three rows of long rows (K > 1024)
    // the blocked kernel (~2x the GEMV, e.g. 40 x 3584 x 1024 at 48 -> 94 GFLOP/s on one thread;
    // docs/perf-notes.md).
    if (chain_applies(M, K, wd)) {
      const Tensor* ws[1] = {&w};
      Tensor* ys[1] = {&y};
      chain_products(x, ws, ys, accumulate);
      return;
    }
    if (M >= 3 && K > 1024) {
      pool_.parallel_for(
          N,
          [&](int64_t n0, int64_t n1) {
            if (wd == DType::F32)
              gemm_few_rows16<WF32>(M, xp, K, w.data<float>(), N, n0, n1, yp, accumulate);
            else if (wd == DType::BF16)
              gemm_few_rows16<WBF16>(M, xp, K, w.data<uint16_t>(), N, n0, n1, yp, accumulate);
            else
              gemm_few_rows16<WF16>(M, xp, K, w.data<uint16_t>(), N, n0, n1, yp, accumulate);
          },
          grain);
      return;
    }
#endif
#ifdef HYPIC_BLOCKED_GEMM
    // Long rows (K > 1024): the blocked kernel for row-independent products at every M, and for
    // three rows and more otherwise (one and two rows stay on the GEMV, which covers FMA latency
    // for decode). Shorter rows stay below: there seven rows of x stay in L1 and that kernel is
    // 5-20% faster; from K = 1536 on it falls to 83-105 GFLOP/s at 2 threads here against ~135
    // for the blocked one (docs/perf-notes.md). K is the weight's, so a row's bits still do not
    // depend on M.
    if ((fixed || M >= 3) && K > 1024) {
      pool_.parallel_for(
          N,
          [&](int64_t n0, int64_t n1) {
            if (wd == DType::F32)
              gemm_few_rows<WF32>(M, xp, K, w.data<float>(), N, n0, n1, yp, accumulate);
            else if (wd == DType::BF16)
              gemm_few_rows<WBF16>(M, xp, K, w.data<uint16_t>(), N, n0, n1, yp, accumulate);
            else
              gemm_few_rows<WF16>(M, xp, K, w.data<uint16_t>(), N, n0, n1, yp, accumulate);
          },
          grain);
      return;
    }
#endif
    pool_.parallel_for(
        N,
        [&](int64_t n0, int64_t n1) {
          for (int64_t t0 = n0; t0 < n1; t0 += 16) {
            const int64_t t1 = std::min(n1, t0 + 16);
            for (int64_t m0 = 0; m0 < M; m0 += 7) {
              const int64_t mm = std::min<int64_t>(7, M - m0);
              const float* xm = xp + m0 * K;
              float* ym = yp + m0 * N;
              if (wd == DType::F32)
                gemv_dispatch<WF32>(mm, xm, K, w.data<float>(), N, t0, t1, ym, accumulate, fixed);
              else if (wd == DType::BF16)
                gemv_dispatch<WBF16>(mm, xm, K, w.data<uint16_t>(), N, t0, t1, ym, accumulate, fixed);
              else
                gemv_dispatch<WF16>(mm, xm, K, w.data<uint16_t>(), N, t0, t1, ym, accumulate, fixed);
            }
          }
        },
        grain);
    return;
  }

  const float beta = accumulate ? 1.f : 0.f;
  if (wd == DType::F32) {
    const float* wp = w.data<float>();
    int64_t blocks = (N + 15) / 16;
    int64_t grain = std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, M * K * 16));  // tiny: one thread
    pool_.parallel_for(
        blocks,
        [&](int64_t b0, int64_t b1) {
          int64_t n0 = b0 * 16, n1 = std::min(N, b1 * 16);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(n1 - n0),
                      static_cast<int>(K), 1.f, xp, static_cast<int>(K), wp + n0 * K, static_cast<int>(K), beta,
                      yp + n0, static_cast<int>(N));
        },
        grain);
    return;
  }

  // Panel rows: sgemm re-packs x for every panel, so panels must be tall enough to amortise that
  // (M K copies per panel against 2 M K nb flops); 256 rows keeps it to a few percent. Smaller
  // panels (>= 64 rows) only when needed to give every thread two panels.
  const int64_t per_thread = (N + 2 * pool_.size() - 1) / (2 * pool_.size());
  const int64_t nb = std::clamp<int64_t>((per_thread + 15) / 16 * 16, 64, 256);
  const int64_t panels = (N + nb - 1) / nb;
  const auto* wp = static_cast<const char*>(w.raw());
  const size_t rb = dtype_bytes(wd, K);
  std::atomic<int64_t> next{0};
  // Dynamic panel scheduling inside one chunk per thread: panels finish at uneven rates.
  pool_.parallel_for(pool_.size(), [&](int64_t, int64_t) {
    float* buf = scratch(t_panel, static_cast<size_t>(nb * K));
    for (;;) {
      int64_t p = next.fetch_add(1);
      if (p >= panels) break;
      int64_t n0 = p * nb, n1 = std::min(N, n0 + nb);
      to_f32_row(wp + static_cast<size_t>(n0) * rb, wd, buf, (n1 - n0) * K);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(n1 - n0),
                  static_cast<int>(K), 1.f, xp, static_cast<int>(K), buf, static_cast<int>(K), beta, yp + n0,
                  static_cast<int>(N));
    }
  });
}

void CpuBackend::set_precise(bool exact) {
  precise_ = exact || !bf16_gemm::unavailable_reason().empty();
}

std::string CpuBackend::imprecise_unavailable() const {
  return bf16_gemm::unavailable_reason();
}

// bf16 activations: x rounded to bf16 once (round to nearest even, over the pool), then oneDNN's
// bf16 x bf16 -> f32 product on its OpenMP threads, as many as the pool's, while the pool idles.
// bf16 weights are read in place. Quantized weights are dequantized to bf16 in slices of W of at
// most ~4 MiB (over the pool), each multiplied as it is made, so no bf16 copy of the whole matrix
// is ever held (an output head is hundreds of MiB).
#ifdef HYPIC_BLOCKED_GEMM16
// Which products take the chain kernels: row-independent ones at every M, and otherwise 16-47 rows
// of half-precision weights with rows up to 1024 long (a question's rows under PIC; ~96 GFLOP/s on
// one thread against 65-75 for the seven-row GEMV at K = 256, docs/perf-notes.md). matmul's
// earlier branches (oneDNN when not precise, quantized weights) come first.
bool CpuBackend::chain_applies(int64_t M, int64_t K, DType wd) const {
  if (dtype_is_quantized(wd)) return false;
  if (row_independent_) return true;
  if (!precise_ && wd == DType::BF16 && M >= kBf16Rows) return false;
  return wd != DType::F32 && M >= 16 && M < 48 && K <= 1024;
}

// y_i = x W_i^T for every i as one parallel region over the weights' rows laid end to end, with x
// transposed once for all of them (from 16 rows): the projections that share an input (q/k/v and
// the gates, gate/up) cost one hand-off to the pool instead of one each, and the gates' four-row
// products no longer run on one thread while the other waits. Each output is its own FMA chain,
// so the bits do not depend on how the rows are split.
void CpuBackend::chain_products(const Tensor& x, std::span<const Tensor* const> w, std::span<Tensor* const> y,
                                bool accumulate) {
  const int64_t M = x.dim(0), K = x.dim(1);
  const float* xp = x.data<float>();
  constexpr size_t kMax = 8;
  if (w.size() != y.size() || w.size() > kMax)
    throw std::logic_error("chain_products: at most 8 weights, one output each");
  int64_t off[kMax + 1] = {0};
  for (size_t i = 0; i < w.size(); ++i) off[i + 1] = off[i] + w[i]->dim(0);
  const int64_t total = off[w.size()];
  const int64_t Mp = (M + 15) / 16 * 16;
  float* xt = nullptr;
  if (M >= 16) {
    // x transposed once (M K elements against the products' M N K), split over the pool by
    // columns: on one thread it was ~8% of a warm pic request at two threads.
    xt = scratch(t_xt, static_cast<size_t>(K * Mp));
    pool_.parallel_for((K + 15) / 16,
                       [&](int64_t b0, int64_t b1) {
                         const int64_t k0 = b0 * 16, k1 = std::min(K, b1 * 16);
                         for (int64_t m = 0; m < M; m += 16)
                           pack16_kmajor<WF32>(xp + m * K + k0, K, static_cast<int>(std::min<int64_t>(16, M - m)),
                                               k1 - k0, xt + k0 * Mp + m, Mp);
                       },
                       std::max<int64_t>(1, 4096 / (16 * Mp)));
  }
  // ~16 KiB of weights per chunk at least, so tiny products are not split.
  const int64_t grain = std::max<int64_t>(std::max<int64_t>(1, 8192 / K), M >= 16 ? 6 : 16);
  pool_.parallel_for(
      total,
      [&](int64_t g0, int64_t g1) {
        for (size_t i = 0; i < w.size(); ++i) {
          const int64_t n0 = std::max(g0, off[i]) - off[i], n1 = std::min(g1, off[i + 1]) - off[i];
          if (n0 >= n1) continue;
          const Tensor& wi = *w[i];
          const DType wd = wi.dtype();
          const int64_t N = wi.dim(0);
          float* yp = y[i]->data<float>();
          if (M >= 16) {
            if (wd == DType::F32)
              chain_rows<WF32>(xt, M, Mp, K, wi.data<float>(), wd, N, n0, n1, yp, accumulate);
            else if (wd == DType::BF16)
              chain_rows<WBF16>(xt, M, Mp, K, wi.data<uint16_t>(), wd, N, n0, n1, yp, accumulate);
            else
              chain_rows<WF16>(xt, M, Mp, K, wi.data<uint16_t>(), wd, N, n0, n1, yp, accumulate);
          } else if (wd == DType::F32) {
            chain_cols<WF32>(M, xp, K, wi.data<float>(), N, n0, n1, yp, accumulate);
          } else if (wd == DType::BF16) {
            chain_cols<WBF16>(M, xp, K, wi.data<uint16_t>(), N, n0, n1, yp, accumulate);
          } else {
            chain_cols<WF16>(M, xp, K, wi.data<uint16_t>(), N, n0, n1, yp, accumulate);
          }
        }
      },
      grain);
}
#endif

void CpuBackend::matmul_many(const Tensor& x, std::initializer_list<Tensor> w, std::initializer_list<Tensor> y) {
#ifdef HYPIC_BLOCKED_GEMM16
  // One region for products that all take the chain kernels; anything else one call each.
  // Decided from shapes and dtypes first, so prefill and decode (which take other kernels) pay
  // nothing here beyond these tests.
  bool fused = w.size() == y.size() && w.size() >= 2 && w.size() <= 8 && x.ndim() == 2 && x.dim(0) > 0 && x.dim(1) > 0;
  for (auto wi = w.begin(); fused && wi != w.end(); ++wi)
    fused = wi->defined() && wi->ndim() == 2 && wi->dim(0) > 0 && chain_applies(x.dim(0), x.dim(1), wi->dtype());
  if (fused) {
    const Tensor* ws[8];
    Tensor outs[8];  // views sharing y's storage
    Tensor* ys[8];
    size_t i = 0;
    auto yi = y.begin();
    for (auto wi = w.begin(); wi != w.end(); ++wi, ++yi, ++i) {
      outs[i] = *yi;
      check_matmul(x, *wi, outs[i], DeviceKind::CPU);
      ws[i] = &*wi;
      ys[i] = &outs[i];
    }
    chain_products(x, std::span<const Tensor* const>(ws, w.size()), std::span<Tensor* const>(ys, w.size()), false);
    return;
  }
#endif
  Backend::matmul_many(x, w, y);
}

void CpuBackend::matmul_bf16(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate) {
  const int64_t M = x.dim(0), K = x.dim(1), N = w.dim(0);
  const DType wd = w.dtype();
  const float* xp = x.data<float>();
  float* yp = y.data<float>();
  thread_local std::vector<uint16_t> xb, wb;
  if (xb.size() < static_cast<size_t>(M * K)) xb.resize(static_cast<size_t>(M * K));
  uint16_t* xbp = xb.data();
  pool_.parallel_for(
      M * K, [&](int64_t b, int64_t e) { convert_from_f32(xp + b, DType::BF16, xbp + b, static_cast<size_t>(e - b)); },
      1 << 15);
  if (wd == DType::BF16) {
    bf16_gemm::matmul(M, N, K, xbp, K, w.data<uint16_t>(), K, yp, N, accumulate, pool_.size());
    return;
  }
  const int64_t nb = std::min(N, std::max<int64_t>(16, (int64_t{2} << 20) / K / 16 * 16));
  if (wb.size() < static_cast<size_t>(nb * K)) wb.resize(static_cast<size_t>(nb * K));
  uint16_t* wbp = wb.data();
  const auto* wp = static_cast<const char*>(w.raw());
  const size_t rb = dtype_bytes(wd, K);
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    const int64_t n1 = std::min(N, n0 + nb);
    pool_.parallel_for(n1 - n0, [&](int64_t r0, int64_t r1) {
      float* row = scratch(t_panel, static_cast<size_t>(K));
      for (int64_t r = r0; r < r1; ++r) {
        to_f32_row(wp + static_cast<size_t>(n0 + r) * rb, wd, row, K);
        convert_from_f32(row, DType::BF16, wbp + r * K, static_cast<size_t>(K));
      }
    });
    bf16_gemm::matmul(M, n1 - n0, K, xbp, K, wbp, K, yp + n0, N, accumulate, pool_.size());
  }
}

// Quantized weights (Q8_0, Q4_K, Q6_K) at fewer than kQuantGemvRows rows, and in row-independent
// mode: each row of x is quantized per block (Q8_0 or Q8_K, as llama.cpp does) and dotted with W's
// rows in integers (quant_dot.h); W is read in tiles of 16 rows while every row of x passes over
// them. More rows take matmul's panel path (blocks dequantized to f32 panels, then sgemm; the
// activations stay f32). The cut-over is measured by bench/gemm_bench.cpp (docs/perf-notes.md).
void CpuBackend::matmul_quantized_gemv(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate) {
  const int64_t M = x.dim(0), K = x.dim(1), N = w.dim(0);
  const DType wd = w.dtype();
  const float* xp = x.data<float>();
  float* yp = y.data<float>();
  const size_t ab = quant::act_bytes(wd, K), rb = dtype_bytes(wd, K);
  thread_local std::vector<char> xq;
  if (xq.size() < ab * static_cast<size_t>(M)) xq.resize(ab * static_cast<size_t>(M));
  char* xqp = xq.data();  // the caller's buffer: pool threads read it while this thread waits
  pool_.parallel_for(M, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quant::quantize_act(wd, xp + m * K, K, xqp + static_cast<size_t>(m) * ab);
  });
  const char* wp = static_cast<const char*>(w.raw());
  pool_.parallel_for(
      N,
      [&](int64_t n0, int64_t n1) {
        float tmp[16];
        for (int64_t t0 = n0; t0 < n1; t0 += 16) {
          const int64_t t1 = std::min(n1, t0 + 16);
          for (int64_t m = 0; m < M; ++m) {
            const char* xm = xqp + static_cast<size_t>(m) * ab;
            if (!accumulate) {
              quant::gemv_rows(wd, wp, xm, K, t0, t1, yp + m * N);
            } else {
              quant::gemv_rows(wd, wp + static_cast<size_t>(t0) * rb, xm, K, 0, t1 - t0, tmp);
              for (int64_t n = t0; n < t1; ++n) yp[m * N + n] += tmp[n - t0];
            }
          }
        }
      },
      std::max<int64_t>(1, 4096 / std::max<int64_t>(1, K)));
}

void CpuBackend::embedding(const Tensor& table, std::span<const int32_t> ids, Tensor& out) {
  check_embedding(table, ids, out, DeviceKind::CPU);
  const int64_t H = table.dim(1), n = static_cast<int64_t>(ids.size());
  const char* tp = static_cast<const char*>(table.raw());
  const size_t row = dtype_bytes(table.dtype(), H);
  float* op_ = out.data<float>();
  pool_.parallel_for(n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) to_f32_row(tp + static_cast<size_t>(ids[i]) * row, table.dtype(), op_ + i * H, H);
  });
}

// ================================================================================================
// Norms and elementwise ops (f32 activations).
// ================================================================================================
namespace {
float sumsq(const float* x, int64_t n) {
  return dot_f32(x, x, n);
}

// Loads w (any float dtype, length D) as f32 into a per-thread buffer.
const float* weight_f32(const Tensor& w, std::vector<float>& buf) {
  if (w.dtype() == DType::F32) return w.data<float>();
  float* p = scratch(buf, static_cast<size_t>(w.numel()));
  to_f32_row(w.raw(), w.dtype(), p, w.numel());
  return p;
}
}  // namespace

void CpuBackend::rms_norm(const Tensor& x, const Tensor& w, float eps, bool one_plus_w, Tensor& out) {
  check_rms_norm(x, nullptr, w, out, DeviceKind::CPU);
  const int64_t D = last_dim(x), R = rows_of(x);
  const float* wf = weight_f32(w, t_buf0);
  std::vector<float> wl;  // one_plus_w: 1 + w computed once, in f32 (as torch: (1.0 + w.float()))
  if (one_plus_w) {
    wl.resize(static_cast<size_t>(D));
    for (int64_t i = 0; i < D; ++i) wl[i] = 1.0f + wf[i];
    wf = wl.data();
  }
  const float* xp = x.data<float>();
  float* o = out.data<float>();
  pool_.parallel_for(
      R,
      [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          const float* xr = xp + r * D;
          float* orow = o + r * D;
          float inv = 1.0f / std::sqrt(sumsq(xr, D) / static_cast<float>(D) + eps);
          for (int64_t i = 0; i < D; ++i) orow[i] = (xr[i] * inv) * wf[i];
        }
      },
      std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)));
}

void CpuBackend::rms_norm_gated(const Tensor& x, const Tensor& z, const Tensor& w, float eps, Tensor& out) {
  check_rms_norm(x, &z, w, out, DeviceKind::CPU);
  const int64_t D = last_dim(x), R = rows_of(x);
  const float* wf = weight_f32(w, t_buf0);
  const float *xp = x.data<float>(), *zp = z.data<float>();
  float* o = out.data<float>();
  pool_.parallel_for(
      R,
      [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          const float *xr = xp + r * D, *zr = zp + r * D;
          float* orow = o + r * D;
          float inv = 1.0f / std::sqrt(sumsq(xr, D) / static_cast<float>(D) + eps);
          int64_t i = 0;
#ifdef HYPIC_AVX2
          const __m256 iv = _mm256_set1_ps(inv);
          for (; i + 8 <= D; i += 8) {
            const __m256 n = _mm256_mul_ps(_mm256_loadu_ps(wf + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), iv));
            _mm256_storeu_ps(orow + i, _mm256_mul_ps(n, silu256(_mm256_loadu_ps(zr + i))));
          }
#endif
          for (; i < D; ++i) orow[i] = wf[i] * (xr[i] * inv) * silu(zr[i]);
        }
      },
      std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)));
}

namespace {
struct NoLanes {};
// out[i] = f(a[i], b[i]); with fv (AVX2), eight lanes at a time: fv must give each lane the bits f
// gives that element, since where a chunk's tail falls depends on the thread split.
template <typename F, typename FV = NoLanes>
void binary(ThreadPool& pool, const char* op, const char* an, const Tensor& a, const char* bn, const Tensor& b,
            Tensor& out, F f, [[maybe_unused]] FV fv = {}) {
  check_binary(op, an, a, bn, b, out, DeviceKind::CPU);
  const float *ap = a.data<float>(), *bp = b.data<float>();
  float* o = out.data<float>();
  pool.parallel_for(
      a.numel(),
      [&](int64_t s, int64_t e) {
        int64_t i = s;
#ifdef HYPIC_AVX2
        if constexpr (!std::is_same_v<FV, NoLanes>)
          for (; i + 8 <= e; i += 8) _mm256_storeu_ps(o + i, fv(_mm256_loadu_ps(ap + i), _mm256_loadu_ps(bp + i)));
#endif
        for (; i < e; ++i) o[i] = f(ap[i], bp[i]);
      },
      1 << 14);
}
}  // namespace

void CpuBackend::add(const Tensor& a, const Tensor& b, Tensor& out) {
  binary(pool_, "add", "a", a, "b", b, out, [](float u, float v) { return u + v; });
}
void CpuBackend::silu_mul(const Tensor& gate, const Tensor& up, Tensor& out) {
  const auto f = [](float g, float u) { return silu(g) * u; };
#ifdef HYPIC_AVX2
  binary(pool_, "silu_mul", "gate", gate, "up", up, out, f,
         [](__m256 g, __m256 u) { return _mm256_mul_ps(silu256(g), u); });
#else
  binary(pool_, "silu_mul", "gate", gate, "up", up, out, f);
#endif
}
void CpuBackend::sigmoid_mul(const Tensor& x, const Tensor& gate, Tensor& out) {
  if (check_sigmoid_mul(x, gate, out, DeviceKind::CPU)) {
    // One gate per row (MoE shared-expert gate), broadcast over the row.
    const int64_t R = rows_of(x), C = last_dim(x);
    const float* xs = x.data<float>();
    const float* gs = gate.data<float>();
    float* os = out.data<float>();
    pool_.parallel_for(R, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const float g = sigmoid(gs[r]);
        for (int64_t c = 0; c < C; ++c) os[r * C + c] = xs[r * C + c] * g;
      }
    });
    return;
  }
  const auto f = [](float v, float g) { return v * sigmoid(g); };
#ifdef HYPIC_AVX2
  binary(pool_, "sigmoid_mul", "x", x, "gate", gate, out, f,
         [](__m256 v, __m256 g) { return _mm256_mul_ps(v, sigmoid256(g)); });
#else
  binary(pool_, "sigmoid_mul", "x", x, "gate", gate, out, f);
#endif
}

void CpuBackend::copy_cols(const Tensor& src, int64_t col, Tensor& dst) {
  check_cols("copy_cols", src, dst, col, "src", "dst", DeviceKind::CPU);
  const int64_t R = rows_of(dst), C = last_dim(src), W = last_dim(dst);
  const size_t es = dtype_size(src.dtype());
  const char* s = static_cast<const char*>(src.raw());
  char* d = static_cast<char*>(dst.raw());
  pool_.parallel_for(
      R,
      [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) std::memcpy(d + r * W * es, s + (r * C + col) * es, W * es);
      },
      std::max<int64_t>(1, 8192 / std::max<int64_t>(W, 1)));
}

void CpuBackend::set_cols(const Tensor& src, int64_t col, Tensor& dst) {
  check_cols("set_cols", dst, src, col, "dst", "src", DeviceKind::CPU);
  const int64_t R = rows_of(src), C = last_dim(dst), W = last_dim(src);
  const size_t es = dtype_size(src.dtype());
  const char* s = static_cast<const char*>(src.raw());
  char* d = static_cast<char*>(dst.raw());
  pool_.parallel_for(
      R,
      [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) std::memcpy(d + (r * C + col) * es, s + r * W * es, W * es);
      },
      std::max<int64_t>(1, 8192 / std::max<int64_t>(W, 1)));
}

void CpuBackend::gather_col_blocks(const Tensor& src, std::span<const int64_t> order, Tensor& dst) {
  check_gather_col_blocks(src, order, dst, DeviceKind::CPU);
  const int64_t R = rows_of(src), C = last_dim(src), n = static_cast<int64_t>(order.size());
  const size_t wb = dtype_size(src.dtype()) * static_cast<size_t>(C / n), rb = wb * static_cast<size_t>(n);
  const char* s = static_cast<const char*>(src.raw());
  char* d = static_cast<char*>(dst.raw());
  pool_.parallel_for(
      R,
      [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r)
          for (int64_t p = 0; p < n; ++p)
            std::memcpy(d + r * rb + p * wb, s + r * rb + order[static_cast<size_t>(p)] * wb, wb);
      },
      std::max<int64_t>(1, 8192 / std::max<int64_t>(C, 1)));
}

// ================================================================================================
// Rotary embedding (NeoX half split, partial). inv_freq and angles follow transformers' fp32
// arithmetic: inv_freq = 1 / theta ** (arange(0, rot, 2) / rot) in f32, angle = f32(pos) * inv_freq.
// ================================================================================================
namespace {
std::vector<float> rope_inv_freq(int rot_dim, double theta) {
  const int half = rot_dim / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  const float th = static_cast<float>(theta);
  for (int i = 0; i < half; ++i) {
    float e = static_cast<float>(2 * i) / static_cast<float>(rot_dim);
    float p = static_cast<float>(std::pow(static_cast<double>(th), static_cast<double>(e)));
    inv_freq[i] = 1.0f / p;
  }
  return inv_freq;
}

void rope_angles(int64_t position, const std::vector<float>& inv_freq, float* c, float* s) {
  const float pos = static_cast<float>(position);
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    float ang = pos * inv_freq[i];
    c[i] = static_cast<float>(std::cos(static_cast<double>(ang)));
    s[i] = static_cast<float>(std::sin(static_cast<double>(ang)));
  }
}

// One token's H heads of D values, the first 2 * half of each rotated.
void rope_token(float* x, int64_t H, int64_t D, int half, const float* c, const float* s) {
  for (int64_t h = 0; h < H; ++h) {
    float* r = x + h * D;
    for (int i = 0; i < half; ++i) {
      float x1 = r[i], x2 = r[i + half];
      float a = x1 * c[i], bb = x2 * s[i], cc = x2 * c[i], dd = x1 * s[i];
      r[i] = a - bb;
      r[i + half] = cc + dd;
    }
  }
}
}  // namespace

void CpuBackend::rope_neox(Tensor& x, std::span<const int64_t> positions, int rot_dim, double theta) {
  check_rope(x, positions.size(), rot_dim, theta, DeviceKind::CPU);
  const int64_t T = x.dim(0), H = x.dim(1), D = x.dim(2);
  const int half = rot_dim / 2;
  const std::vector<float> inv_freq = rope_inv_freq(rot_dim, theta);
  float* xp = x.data<float>();
  pool_.parallel_for(T, [&](int64_t b, int64_t e) {
    float* cs = scratch(t_buf1, static_cast<size_t>(rot_dim));
    float *c = cs, *s = cs + half;
    for (int64_t t = b; t < e; ++t) {
      // Runs of one position (a spliced segment's keys all move by its start) reuse the angles:
      // the sines and cosines were ~4% of a warm pic request's fixed cost (perf).
      if (t == b || positions[t] != positions[t - 1]) rope_angles(positions[t], inv_freq, c, s);
      rope_token(xp + t * H * D, H, D, half, c, s);
    }
  });
}

// The pieces' rows as one parallel region, each row rotated right after it is copied (the same
// arithmetic as rope_neox): composing a warm request splices every document's K/V here, a few MB
// per full-attention layer that one thread copied and then the pool rotated in a second pass.
void CpuBackend::copy_rows(std::span<const RowCopy> pieces, int rot_dim, double theta) {
  check_copy_rows(pieces, rot_dim, theta, DeviceKind::CPU);
  std::vector<int64_t> first(pieces.size() + 1, 0);  // row of the region where piece i starts
  size_t widest = 1;
  bool rotates = false;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const RowCopy& p = pieces[i];
    first[i + 1] = first[i] + p.rows;
    if (p.rows > 0) widest = std::max(widest, p.src->nbytes() / static_cast<size_t>(p.src->dim(0)));
    rotates = rotates || (p.rows > 0 && p.rope_shift != 0);
  }
  const int64_t total = first.back();
  if (total == 0) return;
  const std::vector<float> inv_freq = rotates ? rope_inv_freq(rot_dim, theta) : std::vector<float>{};
  const int half = rot_dim / 2;
  pool_.parallel_for(
      total,
      [&](int64_t g0, int64_t g1) {
        float* cs = rotates ? scratch(t_buf1, static_cast<size_t>(rot_dim)) : nullptr;
        for (size_t i = 0; i < pieces.size(); ++i) {
          const int64_t r0 = std::max(g0, first[i]) - first[i], r1 = std::min(g1, first[i + 1]) - first[i];
          if (r0 >= r1) continue;
          const RowCopy& p = pieces[i];
          const size_t rb = p.src->nbytes() / static_cast<size_t>(p.src->dim(0));
          const char* src = static_cast<const char*>(p.src->raw()) + rb * static_cast<size_t>(p.src_row + r0);
          char* dst = static_cast<char*>(p.dst->raw()) + rb * static_cast<size_t>(p.dst_row + r0);
          if (p.rope_shift == 0) {
            std::memcpy(dst, src, rb * static_cast<size_t>(r1 - r0));
            continue;
          }
          const int64_t H = p.dst->dim(1), D = p.dst->dim(2);
          rope_angles(p.rope_shift, inv_freq, cs, cs + half);
          for (int64_t r = r0; r < r1; ++r) {
            float* d = reinterpret_cast<float*>(dst + rb * static_cast<size_t>(r - r0));
            std::memcpy(d, src + rb * static_cast<size_t>(r - r0), rb);
            rope_token(d, H, D, half, cs, cs + half);
          }
        }
      },
      std::max<int64_t>(1, static_cast<int64_t>(32768 / widest)));
}

// ================================================================================================
// Attention (causal GQA). Scores and softmax in f32.
// ================================================================================================
void CpuBackend::attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t kv_len, int64_t q_offset,
                           float scale, Tensor& out) {
  check_attention(q, k, v, kv_len, q_offset, out, DeviceKind::CPU);
  const int64_t T = q.dim(0), Hq = q.dim(1), D = q.dim(2), Hkv = k.dim(1), Dv = v.dim(2);
  if (T == 0) return;
  if (T < 4)
    attention_decode(q.data<float>(), k.data<float>(), v.data<float>(), T, Hq, Hkv, D, Dv, kv_len, q_offset, scale,
                     out.data<float>());
  else
    attention_tiled(q.data<float>(), k.data<float>(), v.data<float>(), T, Hq, Hkv, D, Dv, kv_len, q_offset, scale,
                    out.data<float>());
}

// Few queries: per (token, head) dot products over the visible keys, softmax, weighted sum of V.
void CpuBackend::attention_decode(const float* q, const float* k, const float* v, int64_t T, int64_t Hq, int64_t Hkv,
                                  int64_t D, int64_t Dv, int64_t kv_len, int64_t q_offset, float scale, float* out) {
  const int64_t G = Hq / Hkv;
  pool_.parallel_for(T * Hq, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const int64_t t = it / Hq, h = it % Hq, g = h / G;
      const int64_t n = std::min(kv_len, q_offset + t + 1);
      float* s = scratch(t_buf2, static_cast<size_t>(n));
      const float* qr = q + (t * Hq + h) * D;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        s[j] = dot_f32(qr, k + (j * Hkv + g) * D, D) * scale;
        mx = std::max(mx, s[j]);
      }
      const float sum = exp_shifted_sum(s, n, mx);
      float* o = out + (t * Hq + h) * Dv;
      std::fill(o, o + Dv, 0.f);
      for (int64_t j = 0; j < n; ++j) axpy(s[j], v + (j * Hkv + g) * Dv, o, Dv);
      const float inv = 1.0f / sum;
      for (int64_t i = 0; i < Dv; ++i) o[i] *= inv;
    }
  });
}

// Many queries: flash-style tiles. For one kv head, a block of BQ tokens x G query heads is packed
// into [BQ*G, D] rows (so K/V tiles are shared by the whole GQA group), and for each key tile of
// BK keys: S = Qp K^T (sgemm), online softmax update, O += P V (sgemm). Work items (span, kv head,
// query block) are taken dynamically, those that see the most keys first.
namespace {
constexpr int64_t kAttentionKeyBlock = 256;  // keys per block of scores

// One block of queries against one KV head: rows t0..t1 of q (all G query heads of KV head g),
// online softmax over key blocks of BK. Qp, Sb, O, m, l: the caller's scratch.
void attend_block(const float* q, const float* k, const float* v, int64_t t0, int64_t t1, int64_t g, int64_t Hq,
                  int64_t Hkv, int64_t D, int64_t Dv, int64_t kv_len, int64_t q_offset, float scale, float* out,
                  float* Qp, float* Sb, float* O, float* m, float* l) {
  constexpr int64_t BK = kAttentionKeyBlock;
  const int64_t G = Hq / Hkv, rows = (t1 - t0) * G;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t hh = 0; hh < G; ++hh) {
      const float* src = q + (t * Hq + g * G + hh) * D;
      float* dst = Qp + ((t - t0) * G + hh) * D;
      for (int64_t i = 0; i < D; ++i) dst[i] = src[i] * scale;
    }
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.f);
  std::fill(O, O + rows * Dv, 0.f);
  const int64_t kend = std::min(kv_len, q_offset + t1);
  for (int64_t kb = 0; kb < kend; kb += BK) {
    const int64_t nk = std::min(BK, kend - kb);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows), static_cast<int>(nk),
                static_cast<int>(D), 1.f, Qp, static_cast<int>(D), k + (kb * Hkv + g) * D, static_cast<int>(Hkv * D),
                0.f, Sb, static_cast<int>(BK));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = t0 + r / G;
      float* sr = Sb + r * BK;
      const int64_t lim = std::clamp<int64_t>(std::min(kv_len, q_offset + t + 1) - kb, 0, nk);
      if (lim == 0) {
        std::fill(sr, sr + nk, 0.f);
        continue;
      }
      const float mx = max_of(sr, lim, m[r]);
      const float alpha = std::exp(m[r] - mx);  // 0 when m[r] = -inf
      const float sum = exp_shifted_sum(sr, lim, mx);
      std::fill(sr + lim, sr + nk, 0.f);
      l[r] = l[r] * alpha + sum;
      m[r] = mx;
      if (alpha != 1.f) {
        float* orow = O + r * Dv;
        for (int64_t i = 0; i < Dv; ++i) orow[i] *= alpha;
      }
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), static_cast<int>(Dv),
                static_cast<int>(nk), 1.f, Sb, static_cast<int>(BK), v + (kb * Hkv + g) * Dv,
                static_cast<int>(Hkv * Dv), 1.f, O, static_cast<int>(Dv));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / G, h = g * G + r % G;
    const float inv = 1.0f / l[r];
    const float* orow = O + r * Dv;
    float* dst = out + (t * Hq + h) * Dv;
    for (int64_t i = 0; i < Dv; ++i) dst[i] = orow[i] * inv;
  }
}

// Query rows per block: 64 rows of scores (all query heads of a KV head) per block.
int64_t attention_block_tokens(int64_t Hq, int64_t Hkv) {
  return std::max<int64_t>(1, 64 / (Hq / Hkv));
}
}  // namespace

void CpuBackend::attention_tiled(const float* q, const float* k, const float* v, int64_t T, int64_t Hq, int64_t Hkv,
                                 int64_t D, int64_t Dv, int64_t kv_len, int64_t q_offset, float scale, float* out) {
  const TiledSpan one{0, q_offset, T, kv_len};
  attention_tiled_spans(q, k, v, std::span<const TiledSpan>(&one, 1), Hq, Hkv, D, Dv, scale, out);
}

// Every span's blocks (span, query block, KV head) as one pool of work, the blocks that see the
// most keys first, each taken by whichever thread is free: a warm request's seams are ten spans of
// eight rows per full-attention layer, which ten regions in a row ran each waiting for its slowest
// block. A block's numbers do not depend on the thread or the other spans.
void CpuBackend::attention_tiled_spans(const float* q, const float* k, const float* v, std::span<const TiledSpan> spans,
                                       int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, float scale, float* out) {
  const int64_t G = Hq / Hkv, BQ = attention_block_tokens(Hq, Hkv);
  struct Item {
    const TiledSpan* sp;
    int64_t t0, t1, g;
  };
  std::vector<Item> items;
  for (const auto& sp : spans)
    for (int64_t t0 = 0; t0 < sp.rows; t0 += BQ)
      for (int64_t g = 0; g < Hkv; ++g) items.push_back({&sp, t0, std::min(sp.rows, t0 + BQ), g});
  auto keys = [](const Item& it) { return std::min(it.sp->kv_len, it.sp->pos0 + it.t1); };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return keys(a) > keys(b); });
  std::atomic<size_t> next{0};
  pool_.parallel_for(std::min<int64_t>(pool_.size(), static_cast<int64_t>(items.size())), [&](int64_t, int64_t) {
    const int64_t R = BQ * G;
    float* Qp = scratch(t_buf0, static_cast<size_t>(R * D));
    float* Sb = scratch(t_buf1, static_cast<size_t>(R * kAttentionKeyBlock));
    float* O = scratch(t_buf2, static_cast<size_t>(R * Dv));
    float* ml = scratch(t_buf3, static_cast<size_t>(2 * R));
    for (;;) {
      const size_t i = next.fetch_add(1);
      if (i >= items.size()) break;
      const Item& it = items[i];
      attend_block(q + it.sp->row0 * Hq * D, k, v, it.t0, it.t1, it.g, Hq, Hkv, D, Dv, it.sp->kv_len, it.sp->pos0,
                   scale, out + it.sp->row0 * Hq * Dv, Qp, Sb, O, ml, ml + R);
    }
  });
}

void CpuBackend::attention_spans(const Tensor& q, const Tensor& k, const Tensor& v, std::span<const RowSpan> spans,
                                 float scale, Tensor& out) {
  // Spans of fewer than 4 rows take attention()'s per-token path, as they would alone; the others
  // share one region. Every span's rows get the bits attention() gives them alone.
  std::vector<TiledSpan> tiled;
  int64_t r0 = 0;
  for (const auto& sp : spans) {
    if (sp.rows < 0 || sp.pos0 < 0)
      fail("attention_spans", "span at " + std::to_string(sp.pos0) + " of " + std::to_string(sp.rows) + " rows");
    if (sp.rows == 0) continue;
    if (r0 + sp.rows > q.dim(0)) fail("attention_spans", "spans cover more rows than q " + q.str() + " has");
    const Tensor qs = q.slice_rows(r0, r0 + sp.rows);
    Tensor os = out.slice_rows(r0, r0 + sp.rows);
    if (sp.rows < 4) {
      attention(qs, k, v, sp.pos0 + sp.rows, sp.pos0, scale, os);
    } else {
      check_attention(qs, k, v, sp.pos0 + sp.rows, sp.pos0, os, DeviceKind::CPU);
      tiled.push_back({r0, sp.pos0, sp.rows, sp.pos0 + sp.rows});
    }
    r0 += sp.rows;
  }
  if (r0 != q.dim(0))
    fail("attention_spans", "spans cover " + std::to_string(r0) + " rows, q " + q.str() + " has more");
  if (!tiled.empty())
    attention_tiled_spans(q.data<float>(), k.data<float>(), v.data<float>(), tiled, q.dim(1), k.dim(1), q.dim(2),
                          v.dim(2), scale, out.data<float>());
}

// ================================================================================================
// Linear-attention pieces.
// ================================================================================================
namespace {
// The weights of columns [c0, c0 + nc) as f32, k-major: wt [K][nc].
void conv_weights(const Tensor& w, int64_t K, int64_t c0, int64_t nc, float* wt) {
  const size_t es = dtype_size(w.dtype());
  for (int64_t c = c0; c < c0 + nc; ++c) {
    float tmp[64];
    if (K <= 64) {
      to_f32_row(static_cast<const char*>(w.raw()) + c * K * es, w.dtype(), tmp, K);
      for (int64_t j = 0; j < K; ++j) wt[j * nc + (c - c0)] = tmp[j];
    } else {
      for (int64_t j = 0; j < K; ++j) {
        float f;
        to_f32_row(static_cast<const char*>(w.raw()) + (c * K + j) * es, w.dtype(), &f, 1);
        wt[j * nc + (c - c0)] = f;
      }
    }
  }
}

// T rows of the conv for columns [a, b): x rows from xp (row stride C), the P = K - 1 rows before
// them in the state sp ([P, C]); weights wt of the columns from a (row stride ldw); the SiLU of
// each sum to o (column a of row 0, row stride ldo). row: nc >= b - a floats of scratch.
void conv_cols(const float* xp, const float* sp, int64_t C, int64_t T, int64_t K, const float* wt, int64_t ldw,
               int64_t a, int64_t b, float* row, float* o, int64_t ldo) {
  const int64_t P = K - 1, nc = b - a;
  auto xx = [&](int64_t r) -> const float* { return r < P ? sp + r * C + a : xp + (r - P) * C + a; };
  for (int64_t t = 0; t < T; ++t) {
    std::fill(row, row + nc, 0.f);
    for (int64_t j = 0; j < K; ++j) {
      const float* __restrict src = xx(t + j);
      const float* __restrict wj = wt + j * ldw;
      for (int64_t c = 0; c < nc; ++c) row[c] += wj[c] * src[c];
    }
    float* ot = o + t * ldo;
    int64_t c = 0;
#ifdef HYPIC_AVX2
    for (; c + 8 <= nc; c += 8) _mm256_storeu_ps(ot + c, silu256(_mm256_loadu_ps(row + c)));
#endif
    for (; c < nc; ++c) ot[c] = silu(row[c]);
  }
}

// The state's columns [c0, c1) past T rows of x: rows T .. T+P-1 of (state ++ x). Forward order is
// safe in place because row T + r >= r.
void conv_advance(const float* xp, float* sp, int64_t C, int64_t T, int64_t P, int64_t c0, int64_t c1) {
  for (int64_t r = 0; r < P; ++r) {
    const int64_t k = T + r;
    const float* src = k < P ? sp + k * C + c0 : xp + (k - P) * C + c0;
    float* dst = sp + r * C + c0;
    if (src != dst) std::memmove(dst, src, static_cast<size_t>(c1 - c0) * 4);
  }
}
}  // namespace

void CpuBackend::causal_conv1d_silu(const Tensor& x, const Tensor& w, Tensor& state, Tensor& out) {
  check_conv1d(x, w, state, out, DeviceKind::CPU);
  const int64_t T = x.dim(0), C = x.dim(1), K = w.dim(-1);
  if (T == 0 || C == 0) return;
  const float* xp = x.data<float>();
  float* sp = state.data<float>();
  float* op_ = out.data<float>();
  pool_.parallel_for(
      C,
      [&](int64_t c0, int64_t c1) {
        const int64_t nc = c1 - c0;
        float* wt = scratch(t_buf0, static_cast<size_t>(K * nc));  // [K][nc], f32
        float* row = scratch(t_buf1, static_cast<size_t>(nc));
        conv_weights(w, K, c0, nc, wt);
        conv_cols(xp, sp, C, T, K, wt, nc, c0, c1, row, op_ + c0, C);
        conv_advance(xp, sp, C, T, K - 1, c0, c1);
      },
      std::max<int64_t>(8, 4096 / std::max<int64_t>(1, T * K)));
}

// Every span in one region over columns: a column's conv depends only on that column of the
// inputs, the state and the spans' cached tails (after), so a thread runs its columns through all
// spans, writing each output block's columns in place, where the base class ran a region per span
// and copied the result into the blocks. The same arithmetic per column as causal_conv1d_silu.
void CpuBackend::causal_conv1d_silu_spans(const Tensor& x, const Tensor& w, std::span<const ConvSpan> spans,
                                          Tensor& state, std::span<Tensor> out_cols) {
  check_conv1d_spans(x, w, spans, state, out_cols, DeviceKind::CPU);
  const int64_t T = x.dim(0), C = x.dim(1), K = w.dim(-1), P = K - 1;
  if (C == 0) return;
  std::vector<int64_t> first(out_cols.size() + 1, 0);  // the blocks' first columns
  for (size_t i = 0; i < out_cols.size(); ++i) first[i + 1] = first[i] + out_cols[i].dim(1);
  const float* xp = x.data<float>();
  float* sp = state.data<float>();
  pool_.parallel_for(
      C,
      [&](int64_t c0, int64_t c1) {
        const int64_t nc = c1 - c0;
        float* wt = scratch(t_buf0, static_cast<size_t>(K * nc));
        float* row = scratch(t_buf1, static_cast<size_t>(nc));
        conv_weights(w, K, c0, nc, wt);
        int64_t r0 = 0;
        for (const auto& s : spans) {
          if (s.rows > 0) {
            for (size_t i = 0; i < out_cols.size(); ++i) {
              const int64_t a = std::max(c0, first[i]), b = std::min(c1, first[i + 1]);
              if (a >= b) continue;
              const int64_t ldo = out_cols[i].dim(1);
              conv_cols(xp + r0 * C, sp, C, s.rows, K, wt + (a - c0), nc, a, b, row,
                        out_cols[i].data<float>() + r0 * ldo + (a - first[i]), ldo);
            }
            conv_advance(xp + r0 * C, sp, C, s.rows, P, c0, c1);
            r0 += s.rows;
          }
          if (s.after) {
            const float* src = s.after->data<float>();
            for (int64_t r = 0; r < P; ++r) std::memcpy(sp + r * C + c0, src + r * C + c0, static_cast<size_t>(nc) * 4);
          }
        }
      },
      std::max<int64_t>(8, 4096 / std::max<int64_t>(1, T * K)));
}

void CpuBackend::gdn_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, Tensor& g,
                           Tensor& beta) {
  check_gdn_gates(a, b, A_log, dt_bias, g, beta, DeviceKind::CPU);
  const int64_t T = a.dim(0), H = a.dim(1);
  std::vector<float> al(static_cast<size_t>(H)), db(static_cast<size_t>(H));
  to_f32_row(A_log.raw(), A_log.dtype(), al.data(), H);
  to_f32_row(dt_bias.raw(), dt_bias.dtype(), db.data(), H);
  for (auto& v : al) v = -std::exp(v);
  const float *ap = a.data<float>(), *bp = b.data<float>();
  float *gp = g.data<float>(), *bt = beta.data<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t i = t * H + h;
      const float u = ap[i] + db[h];
      const float sp = u > 20.f ? u : std::log1p(std::exp(u));  // torch softplus, threshold 20
      const float bv = bp[i];
      gp[i] = al[h] * sp;
      bt[i] = sigmoid(bv);
    }
}

void CpuBackend::gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                  const Tensor& beta, bool l2norm_qk, Tensor& state, Tensor& out, Tensor* transition) {
  check_gated_delta_rule(q, k, v, g, beta, state, out, transition, DeviceKind::CPU);
  const int64_t T = q.dim(0), Hk = q.dim(1), dk = q.dim(2), Hv = v.dim(1), dv = v.dim(2);
  float* tr = transition && transition->defined() ? transition->data<float>() : nullptr;
  linear::GdnShape s{T, Hk, Hv, dk, dv};
  // Heads run on this backend's pool rather than on threads created per call.
  const linear::Runner runner = [this](int64_t workers, const std::function<void(int64_t)>& body) {
    pool_.parallel_for(workers, [&](int64_t b, int64_t e) {
      for (int64_t w = b; w < e; ++w) body(w);
    });
  };
  linear::ScopedRunner use_pool(&runner);
  linear::gated_delta_forward(s, q.data<float>(), k.data<float>(), v.data<float>(), g.data<float>(), beta.data<float>(),
                              l2norm_qk, state.data<float>(), out.data<float>(), tr, pool_.size());
}

// A composition's chain, head by head in one region: each value head's recurrence over a link's
// rows and its composition (S <- T S + B) depend only on that head, so a thread runs a head's
// whole chain where the base class ran two regions per document (a warm request composes ~10
// documents per linear layer, each with a few seam rows). The head's rows take the kernels
// gated_delta_rule would (gated_delta_forward_head) and its composition compose_state's sgemm, so
// the bits are those of the separate calls; a compact body is replayed the same way. Chains with
// a bf16 or scalar T, or without a body (the state then advances in place), take the base class.
void CpuBackend::gated_delta_chain(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                   const Tensor& beta, bool l2norm_qk, Tensor& state, Tensor& out,
                                   std::span<const GdnLink> links) {
  bool body = false, per_head = true;
  for (const auto& L : links) {
    per_head = per_head && L.rows >= 0 && (!L.rk || (L.rv && L.rg && L.rbeta));
    body = body || L.rk || L.B;
    if (L.B && L.T) per_head = per_head && L.T->dtype() == DType::F32 && L.T->ndim() == 3 && L.T->dim(1) != 1;
  }
  if (!body || !per_head) {
    Backend::gated_delta_chain(q, k, v, g, beta, l2norm_qk, state, out, links);
    return;
  }
  check_gated_delta_rule(q, k, v, g, beta, state, out, nullptr, DeviceKind::CPU);
  Tensor own = alloc_uninit(DType::F32, state.shape());  // the caller's state is not written
  std::vector<Tensor> dropped(links.size());             // a replayed body's outputs
  int64_t rows = 0;
  for (size_t i = 0; i < links.size(); ++i) {
    const GdnLink& L = links[i];
    rows += L.rows;
    if (L.rk) {
      dropped[i] = alloc_uninit(DType::F32, {L.rk->dim(0), state.dim(0), state.dim(2)});
      check_gated_delta_rule(*L.rk, *L.rk, *L.rv, *L.rg, *L.rbeta, state, dropped[i], nullptr, DeviceKind::CPU);
    }
    if (L.B) {
      if (L.T)
        check_compose_state(*L.T, state, *L.B, own, DeviceKind::CPU);
      else if (L.B->dtype() != DType::F32 || L.B->shape() != state.shape())
        fail("gated_delta_chain", "body state " + L.B->str() + " does not match the state " + state.str());
    }
  }
  if (rows != q.dim(0))
    fail("gated_delta_chain",
         "links cover " + std::to_string(rows) + " rows, q " + q.str() + " has " + std::to_string(q.dim(0)));
  const int64_t Hk = q.dim(1), dk = q.dim(2), Hv = v.dim(1), dv = v.dim(2);
  const float *qp = q.data<float>(), *kp = k.data<float>(), *vp = v.data<float>(), *gp = g.data<float>(),
              *bp = beta.data<float>(), *s0 = state.data<float>();
  float *sp = own.data<float>(), *op = out.data<float>();
  const int64_t hs = dk * dv;
  pool_.parallel_for(Hv, [&](int64_t h0, int64_t h1) {
    float* tmp = scratch(t_panel, static_cast<size_t>(hs));
    for (int64_t h = h0; h < h1; ++h) {
      float* S = sp + h * hs;
      std::memcpy(S, s0 + h * hs, static_cast<size_t>(hs) * 4);
      int64_t r0 = 0;
      for (size_t i = 0; i < links.size(); ++i) {
        const GdnLink& L = links[i];
        if (L.rows > 0) {
          linear::gated_delta_forward_head({L.rows, Hk, Hv, dk, dv}, qp + r0 * Hk * dk, kp + r0 * Hk * dk,
                                           vp + r0 * Hv * dv, gp + r0 * Hv, bp + r0 * Hv, l2norm_qk, h, S,
                                           op + r0 * Hv * dv);
          r0 += L.rows;
        }
        if (L.rk)  // a compact body: its recurrence replayed from the state reached, rk as the queries
          linear::gated_delta_forward_head({L.rk->dim(0), Hk, Hv, dk, dv}, L.rk->data<float>(), L.rk->data<float>(),
                                           L.rv->data<float>(), L.rg->data<float>(), L.rbeta->data<float>(), l2norm_qk,
                                           h, S, dropped[i].data<float>());
        if (!L.B) continue;
        const float* B = L.B->data<float>() + h * hs;
        if (!L.T) {
          for (int64_t i = 0; i < hs; ++i) S[i] = S[i] + B[i];
          continue;
        }
        std::memcpy(tmp, B, static_cast<size_t>(hs) * 4);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(dk), static_cast<int>(dv),
                    static_cast<int>(dk), 1.f, L.T->data<float>() + h * dk * dk, static_cast<int>(dk), S,
                    static_cast<int>(dv), 1.f, tmp, static_cast<int>(dv));
        std::memcpy(S, tmp, static_cast<size_t>(hs) * 4);
      }
    }
  });
  state = own;
}

// ================================================================================================
// The other families' recurrences (linear/recurrence.h's chunked kernels) and the layer pieces of
// Nemotron-H and MiniMax.
// ================================================================================================
void CpuBackend::linear_recurrence(const Recurrence& r, const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& g, const Tensor& beta, const Tensor& log_gamma, Tensor& state,
                                   Tensor& out, Tensor* transition) {
  check_linear_recurrence(r, q, k, v, g, beta, log_gamma, state, out, transition, DeviceKind::CPU);
  const int64_t T = q.dim(0), Hk = q.dim(1), dk = q.dim(2), Hv = v.dim(1), dv = v.dim(2);
  const bool want_t = transition && transition->defined();
  const bool scaled = want_t && transition->dim(1) == 1 && dk != 1;
  linear::RecInputs in;
  in.q = q.data<float>();
  in.k = k.data<float>();
  in.v = v.data<float>();
  in.g = g.defined() ? g.data<float>() : nullptr;
  in.beta = beta.defined() ? beta.data<float>() : nullptr;
  in.log_gamma = log_gamma.defined() ? log_gamma.data<float>() : nullptr;
  in.l2norm_qk = r.l2norm_qk;
  in.q_scale = r.q_scale;
  std::vector<float> compact(want_t ? static_cast<size_t>(linear::transition_floats(r.family, Hv, dk)) : 0);
  const linear::Runner runner = [this](int64_t workers, const std::function<void(int64_t)>& body) {
    pool_.parallel_for(workers, [&](int64_t b, int64_t e) {
      for (int64_t w = b; w < e; ++w) body(w);
    });
  };
  linear::ScopedRunner use_pool(&runner);
  if (T > 0)
    linear::chunked_forward(r.family, {T, Hk, Hv, dk, dv}, in, state.data<float>(), out.data<float>(),
                            want_t ? compact.data() : nullptr, pool_.size());
  if (!want_t) return;
  float* tp = transition->data<float>();
  if (scaled) {  // the factor of T_C = c I per head
    const linear::TStorage st = linear::traits(r.family).storage;
    for (int64_t h = 0; h < Hv; ++h)
      tp[h] = st == linear::TStorage::LogScalar    ? std::exp(T > 0 ? compact[static_cast<size_t>(h)] : 0.f)
              : st == linear::TStorage::FromLength ? std::exp(static_cast<float>(T) * in.log_gamma[h])
                                                   : 1.f;
  } else if (T == 0) {
    set_identity(*transition);
  } else {
    const std::vector<float> dense = linear::expand_transition(r.family, Hv, dk, compact.data(), T, in.log_gamma);
    std::copy(dense.begin(), dense.end(), tp);
  }
}

void CpuBackend::causal_conv1d_bias_silu(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& state,
                                         Tensor& out) {
  check_conv_bias(x, w, bias, state, out, DeviceKind::CPU);
  const int64_t n = x.dim(0), C = x.dim(1), K = w.dim(1);
  const float *in = x.data<float>(), *wp = w.data<float>(), *bp = bias.data<float>();
  float *st = state.data<float>(), *o = out.data<float>();
  // Rows in parallel (each output is its own sum: the same bits on any thread count).
  pool_.parallel_for(n, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < C; ++c) {
        float acc = bp[c];
        for (int64_t j = 0; j < K; ++j) {
          const int64_t src = t - (K - 1) + j;
          acc += wp[c * K + j] * (src < 0 ? st[(K - 1 + src) * C + c] : in[src * C + c]);
        }
        o[t * C + c] = acc / (1.0f + std::exp(-acc));
      }
  });
  if (n == 0 || K < 2) return;
  // The new state: the last K-1 inputs of (old state, rows).
  std::vector<float> hist(static_cast<size_t>((K - 1 + n) * C));
  std::copy(st, st + (K - 1) * C, hist.begin());
  std::copy(in, in + n * C, hist.begin() + (K - 1) * C);
  std::copy(hist.end() - (K - 1) * C, hist.end(), st);
}

void CpuBackend::mamba2_gates(const Tensor& dt_raw, const Tensor& x, const Tensor& A, const Tensor& dt_bias,
                              float dt_min, Tensor& g, Tensor& v) {
  check_mamba2_gates(dt_raw, x, A, dt_bias, g, v, DeviceKind::CPU);
  const int64_t T = x.dim(0), H = x.dim(1), P = x.dim(2);
  const float *dr = dt_raw.data<float>(), *xp = x.data<float>(), *ap = A.data<float>(), *bp = dt_bias.data<float>();
  float *gp = g.data<float>(), *vp = v.data<float>();
  pool_.parallel_for(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const float u = dr[t * H + h] + bp[h];
        const float dt = std::max(u > 20.0f ? u : std::log1p(std::exp(u)), dt_min);  // torch softplus, threshold 20
        gp[t * H + h] = dt * ap[h];
        for (int64_t p = 0; p < P; ++p) vp[(t * H + h) * P + p] = dt * xp[(t * H + h) * P + p];
      }
  });
}

void CpuBackend::mamba2_gated_norm(const Tensor& y, const Tensor& x, const Tensor& z, const Tensor& D, const Tensor& w,
                                   int64_t groups, float eps, Tensor& out) {
  check_mamba2_gated_norm(y, x, z, D, w, groups, out, DeviceKind::CPU);
  const int64_t T = y.dim(0), C = y.dim(1), P = C / D.dim(0), gs = C / groups;
  const float *yp = y.data<float>(), *xp = x.data<float>(), *zp = z.data<float>(), *dp = D.data<float>(),
              *wp = w.data<float>();
  float* op = out.data<float>();
  pool_.parallel_for(T, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* o = op + t * C;
      for (int64_t i = 0; i < C; ++i) {
        const float zi = zp[t * C + i];
        o[i] = (yp[t * C + i] + dp[i / P] * xp[t * C + i]) * (zi / (1.0f + std::exp(-zi)));
      }
      for (int64_t gi = 0; gi < groups; ++gi) {
        double ss = 0;
        for (int64_t i = gi * gs; i < (gi + 1) * gs; ++i) ss += double(o[i]) * o[i];
        const float r = 1.0f / std::sqrt(static_cast<float>(ss / gs) + eps);
        for (int64_t i = gi * gs; i < (gi + 1) * gs; ++i) o[i] = wp[i] * (o[i] * r);
      }
    }
  });
}

void CpuBackend::kda_gates(const Tensor& a, const Tensor& b, const Tensor& A, const Tensor& dt_bias, Tensor& g,
                           Tensor& beta) {
  check_kda_gates(a, b, A, dt_bias, g, beta, DeviceKind::CPU);
  const int64_t T = a.dim(0), H = a.dim(1), dk = a.dim(2), C = H * dk;
  const float *ap = a.data<float>(), *bp = b.data<float>(), *Ap = A.data<float>(), *db = dt_bias.data<float>();
  float *gp = g.data<float>(), *bt = beta.data<float>();
  pool_.parallel_for(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = 0; i < C; ++i) {
        const float z = ap[t * C + i] + db[i];
        const float sp = z > 20.0f ? z : std::log(1.0f + std::exp(z));  // as transformers writes it
        gp[t * C + i] = -Ap[i / dk] * sp;
      }
      for (int64_t h = 0; h < H; ++h) bt[t * H + h] = 1.0f / (1.0f + std::exp(-bp[t * H + h]));
    }
  });
}

void CpuBackend::scale_add(const Tensor& x, float a, const Tensor& y, float b, Tensor& out) {
  binary(pool_, "scale_add", "x", x, "y", y, out, [a, b](float u, float w) { return a * u + b * w; });
}

void CpuBackend::activate(Activation act, Tensor& x) {
  need_f32("activate", "x", x, DeviceKind::CPU);
  float* p = x.data<float>();
  const int64_t n = x.numel();
  pool_.parallel_for(n, [&](int64_t b, int64_t e) {
    if (act == Activation::Silu)
      for (int64_t i = b; i < e; ++i) p[i] = p[i] / (1.0f + std::exp(-p[i]));
    else
      for (int64_t i = b; i < e; ++i) p[i] = p[i] > 0 ? p[i] * p[i] : 0.0f;
  });
}

// ================================================================================================
// Segment summaries: out[h] = alpha * T[h] S[h] + B[h] (one sgemm per head), identity fill.
// ================================================================================================
void CpuBackend::compose_state(const Tensor& T, const Tensor& S, const Tensor& B, float alpha, Tensor& out) {
  check_compose_state(T, S, B, out, DeviceKind::CPU);
  if (T.dtype() != DType::F32) {  // a bf16 T (an entry from a GPU): composed in f32
    compose_state(T.to_f32(), S, B, alpha, out);
    return;
  }
  const int64_t H = T.dim(0), dk = S.dim(1), dv = S.dim(2);
  const float *tp = T.data<float>(), *sp = S.data<float>(), *bp = B.data<float>();
  float* o = out.data<float>();
  if (T.dim(1) == 1 && dk != 1) {  // scaled identity
    for (int64_t h = 0; h < H; ++h) {
      const float a = alpha * tp[h];
      for (int64_t i = h * dk * dv; i < (h + 1) * dk * dv; ++i) o[i] = a * sp[i] + bp[i];
    }
    return;
  }
  pool_.parallel_for(H, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      float* oh = o + h * dk * dv;
      if (oh != bp + h * dk * dv) std::memcpy(oh, bp + h * dk * dv, static_cast<size_t>(dk * dv) * 4);
      if (dk == 0 || dv == 0) continue;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(dk), static_cast<int>(dv),
                  static_cast<int>(dk), alpha, tp + h * dk * dk, static_cast<int>(dk), sp + h * dk * dv,
                  static_cast<int>(dv), 1.f, oh, static_cast<int>(dv));
    }
  });
}

void CpuBackend::set_identity(Tensor& t) {
  check_set_identity(t, DeviceKind::CPU);
  const int64_t H = t.dim(0), n = t.dim(1);
  float* p = t.data<float>();
  std::fill(p, p + t.numel(), 0.f);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i) p[(h * n + i) * n + i] = 1.f;
}

// ================================================================================================
// Mixture of experts: the router's routing on the host forms of moe_routing.h; tokens grouped by
// expert, each expert (SwiGLU or ReLU^2) run as matmuls on its gathered rows, then a weighted
// scatter-add into out.
// ================================================================================================
void CpuBackend::moe_experts(const Tensor& x, const Tensor& router_logits, const MoeRouter& router,
                             const ExpertWeights& experts, Tensor& out) {
  const int64_t I = check_moe(x, router_logits, router, experts, out, DeviceKind::CPU);
  const int64_t T = x.dim(0), H = x.dim(1), E = router_logits.dim(1);
  const int top_k = router.top_k;
  const bool relu2 = experts.gate.empty();
  float* o = out.data<float>();
  std::fill(o, o + T * H, 0.f);
  if (T == 0) return;
  const MoeRouting rt =
      router.sigmoid ? route_sigmoid_grouped(router_logits.data<float>(),
                                             router.bias.defined() ? router.bias.data<float>() : nullptr, T, E, top_k,
                                             router.n_group, router.topk_group, router.norm_topk, router.scaling)
                     : route_topk(router_logits.data<float>(), T, E, top_k, router.norm_topk);
  int64_t maxn = 0;
  for (int64_t e = 0; e < E; ++e) maxn = std::max(maxn, rt.start[e + 1] - rt.start[e]);
  std::vector<float> xs(static_cast<size_t>(maxn * H)), gs(static_cast<size_t>(maxn * I)),
      us(static_cast<size_t>(maxn * I)), ds(static_cast<size_t>(maxn * H));
  const float* xp = x.data<float>();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = rt.start[e + 1] - rt.start[e];
    if (n == 0) continue;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t t = rt.order[rt.start[e] + r] / top_k;
      std::memcpy(xs.data() + r * H, xp + t * H, static_cast<size_t>(H) * 4);
    }
    Tensor xt = Tensor::borrow(xs.data(), DType::F32, {n, H});
    Tensor gt = Tensor::borrow(gs.data(), DType::F32, {n, I});
    Tensor ut = Tensor::borrow(us.data(), DType::F32, {n, I});
    Tensor dt = Tensor::borrow(ds.data(), DType::F32, {n, H});
    if (relu2) {
      matmul(xt, experts.up[e], gt);
      activate(Activation::ReluSquared, gt);
    } else {
      matmul(xt, experts.gate[e], gt);
      matmul(xt, experts.up[e], ut);
      silu_mul(gt, ut, gt);
    }
    matmul(gt, experts.down[e], dt);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t i = rt.order[rt.start[e] + r], t = i / top_k;
      axpy(rt.weight[i], ds.data() + r * H, o + t * H, H);
    }
  }
}

}  // namespace hypic::cpu
