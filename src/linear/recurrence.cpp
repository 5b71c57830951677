// Fast fp32 kernels for every linear-recurrence family (see recurrence.h and docs/linear.md):
// a token-step forward and a chunked UT/WY forward that chains the per-chunk transition
//   M_chunk = Gamma_C - Kd^T W       (T <- M_chunk T)
// in the same pass as the outputs and the state.
//
// Chunk math, per head, chunk rows t = 0..C-1 from state S0 (G = within-chunk cumulative log
// decay, Gamma_t = exp(G_t) per key channel, scalar decays broadcast):
//   S_t = Gamma_t S0 + sum_{i<=t} diag(Gamma_t / Gamma_i) k_i u_i^T
//   delta:  u_t = beta_t (v_t - (D_t S_{t-1})^T k_t)  =>  (I + L) U = beta V - (beta Gamma K) S0,
//           L[t][i] = beta_t k_t^T diag(Gamma_t / Gamma_i) k_i (i < t),
//           W = (I + L)^-1 (beta Gamma K),  Uv = (I + L)^-1 (beta V),  U = Uv - W S0
//   plain:  u_t = v_t
//   o_t   = S0^T (Gamma_t q_t) + sum_{i<=t} q_t^T diag(Gamma_t / Gamma_i) k_i u_i
//   S_C   = Gamma_C S0 + Kd^T U,   Kd_i = (Gamma_C / Gamma_i) k_i
//   T_C   : T <- Gamma_C T - Kd^T (W T)     (the state update with zero values)
#include "linear/recurrence.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

namespace hypic::linear {

namespace {

// ---- small dense kernels ---------------------------------------------------------------------
// C[M,N] = (acc ? C : 0) + alpha * A[M,K] B[K,N]; row-major with leading dimensions.
#if defined(__AVX2__) && defined(__FMA__)
// Register-blocked micro-kernels (explicit accumulators: GCC spills arrays of __m256).
inline void store8(float* dst, __m256 x, __m256 al, bool acc) {
  x = _mm256_mul_ps(al, x);
  if (acc) x = _mm256_add_ps(x, _mm256_loadu_ps(dst));
  _mm256_storeu_ps(dst, x);
}

// MR (1..6) rows x 16 columns; named accumulators, unused ones compiled away.
template <int MR>
inline void micro_x16(int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                      int64_t ldc, bool acc) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t p = 0; p < K; ++p) {
    const __m256 b0 = _mm256_loadu_ps(B + p * ldb), b1 = _mm256_loadu_ps(B + p * ldb + 8);
    __m256 a = _mm256_broadcast_ss(A + p);
    c00 = _mm256_fmadd_ps(a, b0, c00), c01 = _mm256_fmadd_ps(a, b1, c01);
    if constexpr (MR > 1) {
      a = _mm256_broadcast_ss(A + lda + p);
      c10 = _mm256_fmadd_ps(a, b0, c10), c11 = _mm256_fmadd_ps(a, b1, c11);
    }
    if constexpr (MR > 2) {
      a = _mm256_broadcast_ss(A + 2 * lda + p);
      c20 = _mm256_fmadd_ps(a, b0, c20), c21 = _mm256_fmadd_ps(a, b1, c21);
    }
    if constexpr (MR > 3) {
      a = _mm256_broadcast_ss(A + 3 * lda + p);
      c30 = _mm256_fmadd_ps(a, b0, c30), c31 = _mm256_fmadd_ps(a, b1, c31);
    }
    if constexpr (MR > 4) {
      a = _mm256_broadcast_ss(A + 4 * lda + p);
      c40 = _mm256_fmadd_ps(a, b0, c40), c41 = _mm256_fmadd_ps(a, b1, c41);
    }
    if constexpr (MR > 5) {
      a = _mm256_broadcast_ss(A + 5 * lda + p);
      c50 = _mm256_fmadd_ps(a, b0, c50), c51 = _mm256_fmadd_ps(a, b1, c51);
    }
  }
  const __m256 al = _mm256_set1_ps(alpha);
  store8(C, c00, al, acc), store8(C + 8, c01, al, acc);
  if constexpr (MR > 1) store8(C + ldc, c10, al, acc), store8(C + ldc + 8, c11, al, acc);
  if constexpr (MR > 2) store8(C + 2 * ldc, c20, al, acc), store8(C + 2 * ldc + 8, c21, al, acc);
  if constexpr (MR > 3) store8(C + 3 * ldc, c30, al, acc), store8(C + 3 * ldc + 8, c31, al, acc);
  if constexpr (MR > 4) store8(C + 4 * ldc, c40, al, acc), store8(C + 4 * ldc + 8, c41, al, acc);
  if constexpr (MR > 5) store8(C + 5 * ldc, c50, al, acc), store8(C + 5 * ldc + 8, c51, al, acc);
}

// 1 row x 8 columns (edges).
inline void micro1x8(int64_t K, float alpha, const float* A, const float* B, int64_t ldb, float* C, bool acc) {
  __m256 c0 = _mm256_setzero_ps(), c1 = c0;
  int64_t p = 0;
  for (; p + 2 <= K; p += 2) {
    c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(A + p), _mm256_loadu_ps(B + p * ldb), c0);
    c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(A + p + 1), _mm256_loadu_ps(B + (p + 1) * ldb), c1);
  }
  if (p < K) c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(A + p), _mm256_loadu_ps(B + p * ldb), c0);
  store8(C, _mm256_add_ps(c0, c1), _mm256_set1_ps(alpha), acc);
}

#if defined(__AVX512F__)
// MR (1..12) rows x 32 columns in zmm registers: 24 accumulators at MR = 12 hide the FMA latency at
// two FMAs a cycle (the 6 x 16 ymm kernel below reaches half of that); the array stays in
// registers because every index is a constant after unrolling.
template <int MR>
void micro_x32(int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
               bool acc) {
  __m512 c[MR][2];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K; ++p) {
    const __m512 b0 = _mm512_loadu_ps(B + p * ldb), b1 = _mm512_loadu_ps(B + p * ldb + 16);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(A[r * lda + p]);
      c[r][0] = _mm512_fmadd_ps(a, b0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(a, b1, c[r][1]);
    }
  }
  const __m512 al = _mm512_set1_ps(alpha);
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) {
      float* d = C + r * ldc + 16 * h;
      __m512 x = _mm512_mul_ps(al, c[r][h]);
      if (acc) x = _mm512_add_ps(x, _mm512_loadu_ps(d));
      _mm512_storeu_ps(d, x);
    }
}

template <int... I>
void micro_x32_rows(int rows, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
                    float* C, int64_t ldc, bool acc, std::integer_sequence<int, I...>) {
  using Fn = void (*)(int64_t, float, const float*, int64_t, const float*, int64_t, float*, int64_t, bool);
  static constexpr Fn table[] = {&micro_x32<I + 1>...};
  table[rows - 1](K, alpha, A, lda, B, ldb, C, ldc, acc);
}
#endif

void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
          float* C, int64_t ldc, bool acc) {
  int64_t j0 = 0;
#if defined(__AVX512F__)
  // Column strips outermost: a K x 32 strip of B stays in L1 across all row blocks.
  for (; j0 + 32 <= N; j0 += 32)
    for (int64_t i = 0; i < M; i += 12)
      micro_x32_rows(static_cast<int>(std::min<int64_t>(12, M - i)), K, alpha, A + i * lda, lda, B + j0, ldb,
                     C + i * ldc + j0, ldc, acc, std::make_integer_sequence<int, 12>{});
#endif
  const int64_t N16 = j0 + (N - j0) / 16 * 16, N8 = N / 8 * 8, M6 = M / 6 * 6;
  // Column strips outermost: a K x 16 strip of B stays in L1 across all row blocks.
  for (int64_t j = j0; j < N16; j += 16) {
    for (int64_t i = 0; i < M6; i += 6) micro_x16<6>(K, alpha, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, acc);
    const float* Ar = A + M6 * lda;
    float* Cr = C + M6 * ldc + j;
    switch (M - M6) {
      case 1:
        micro_x16<1>(K, alpha, Ar, lda, B + j, ldb, Cr, ldc, acc);
        break;
      case 2:
        micro_x16<2>(K, alpha, Ar, lda, B + j, ldb, Cr, ldc, acc);
        break;
      case 3:
        micro_x16<3>(K, alpha, Ar, lda, B + j, ldb, Cr, ldc, acc);
        break;
      case 4:
        micro_x16<4>(K, alpha, Ar, lda, B + j, ldb, Cr, ldc, acc);
        break;
      case 5:
        micro_x16<5>(K, alpha, Ar, lda, B + j, ldb, Cr, ldc, acc);
        break;
      default:
        break;
    }
  }
  for (int64_t j = std::max(N16, j0); j < N8; j += 8)
    for (int64_t i = 0; i < M; ++i) micro1x8(K, alpha, A + i * lda, B + j, ldb, C + i * ldc + j, acc);
  for (int64_t j = std::max(N8, j0); j < N; ++j)
    for (int64_t i = 0; i < M; ++i) {
      float sum = 0;
      for (int64_t p = 0; p < K; ++p) sum += A[i * lda + p] * B[p * ldb + j];
      C[i * ldc + j] = (acc ? C[i * ldc + j] : 0.f) + alpha * sum;
    }
}
#else
void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
          float* C, int64_t ldc, bool acc) {
  std::vector<float> row(N);
  for (int64_t i = 0; i < M; ++i) {
    std::fill(row.begin(), row.end(), 0.f);
    for (int64_t p = 0; p < K; ++p) {
      const float a = A[i * lda + p];
      const float* b = B + p * ldb;
      for (int64_t j = 0; j < N; ++j) row[j] += a * b[j];
    }
    float* c = C + i * ldc;
    for (int64_t j = 0; j < N; ++j) c[j] = (acc ? c[j] : 0.f) + alpha * row[j];
  }
}
#endif

inline void axpy(int64_t n, float a, const float* __restrict x, float* __restrict y) {
  for (int64_t j = 0; j < n; ++j) y[j] += a * x[j];
}
// Sum of squares with 8 independent partial sums (vectorisable without -ffast-math).
inline float sumsq(int64_t n, const float* x) {
  float p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) p[l] += x[i + l] * x[i + l];
  float s = ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}
inline void scal(int64_t n, float a, float* __restrict y) {
  for (int64_t j = 0; j < n; ++j) y[j] *= a;
}

thread_local const Runner* t_runner = nullptr;

// Runs fn(h, worker) for h in [0, n) on up to `threads` threads.
template <class Fn>
void parallel_heads(int64_t n, int threads, Fn&& fn) {
  int nt = std::max(1, threads);
  if (nt > n) nt = int(n);
  if (nt <= 1) {
    for (int64_t h = 0; h < n; ++h) fn(h, 0);
    return;
  }
  if (t_runner) {
    (*t_runner)(nt, [&](int64_t w) {
      for (int64_t h = w; h < n; h += nt) fn(h, int(w));
    });
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(nt - 1);
  for (int w = 1; w < nt; ++w)
    pool.emplace_back([&, w] {
      for (int64_t h = w; h < n; h += nt) fn(h, w);
    });
  for (int64_t h = 0; h < n; h += nt) fn(h, 0);
  for (auto& th : pool) th.join();
}

// cos/sin table [T, rot_dim/2] for positions start + t.
struct RopeTable {
  int half = 0;
  std::vector<float> cs, sn;
  RopeTable(const RopeSpec& r, int64_t T) {
    if (r.rot_dim <= 0) return;
    half = r.rot_dim / 2;
    cs.resize(T * half);
    sn.resize(T * half);
    for (int i = 0; i < half; ++i) {
      const double inv = std::pow(r.theta, -2.0 * i / r.rot_dim);
      for (int64_t t = 0; t < T; ++t) {
        const double a = double(r.start + t) * inv;
        cs[t * half + i] = float(std::cos(a));
        sn[t * half + i] = float(std::sin(a));
      }
    }
  }
  void rotate(float* x, int64_t t) const {
    const float* c = cs.data() + t * half;
    const float* s = sn.data() + t * half;
    for (int i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = a * c[i] - b * s[i];
      x[i + half] = b * c[i] + a * s[i];
    }
  }
};

struct Prep {
  const RecShape& s;
  const RecInputs& in;
  const RopeTable& rope;
  int64_t rep;
  // Normalised / scaled / rotated q and k of token t for value head h.
  void qk(int64_t t, int64_t h, float* q, float* k) const {
    const int64_t dk = s.dk, kh = h / rep;
    const float* qi = in.q + (t * s.Hk + kh) * dk;
    const float* ki = in.k + (t * s.Hk + kh) * dk;
    float qs = in.q_scale, ks = 1.f;
    if (in.l2norm_qk) {
      qs /= std::sqrt(sumsq(dk, qi) + 1e-6f);
      ks /= std::sqrt(sumsq(dk, ki) + 1e-6f);
    }
    for (int64_t i = 0; i < dk; ++i) q[i] = qi[i] * qs, k[i] = ki[i] * ks;
    if (rope.half) rope.rotate(q, t), rope.rotate(k, t);
  }
  // Log decay of token t, head h (scalar decays); channel decays read in.g directly.
  float gs(const FamilyTraits& tr, int64_t t, int64_t h) const {
    switch (tr.decay) {
      case Decay::FixedScalar:
        return in.log_gamma[h];
      case Decay::Scalar:
        return in.g[t * s.Hv + h];
      default:
        return 0.f;
    }
  }
};

void validate(Family f, const RecShape& s, const RecInputs& in) {
  const FamilyTraits tr = traits(f);
  if (s.Hk <= 0 || s.Hv % s.Hk != 0) throw std::invalid_argument("linear: Hv must be a multiple of Hk");
  if (!in.q || !in.k || !in.v) throw std::invalid_argument("linear: q, k, v required");
  if ((tr.decay == Decay::Scalar || tr.decay == Decay::Channel) && !in.g)
    throw std::invalid_argument("linear: g required");
  if (tr.decay == Decay::FixedScalar && !in.log_gamma) throw std::invalid_argument("linear: log_gamma required");
  if (tr.delta && !in.beta) throw std::invalid_argument("linear: beta required");
  if (in.rope.rot_dim % 2 || in.rope.rot_dim > s.dk) throw std::invalid_argument("linear: bad rot_dim");
}

void init_transition(Family f, int64_t Hv, int64_t dk, float* T) {
  if (!T) return;
  const int64_t n = transition_floats(f, Hv, dk);
  std::fill(T, T + n, 0.f);
  if (traits(f).storage == TStorage::Dense)
    for (int64_t h = 0; h < Hv; ++h)
      for (int64_t i = 0; i < dk; ++i) T[(h * dk + i) * dk + i] = 1.f;
}

// ---- chunked kernel --------------------------------------------------------------------------
struct Scratch {
  std::vector<float> KQ, KT, R, X, KdT, UT, G, gam, beta;
  void ensure(int64_t C, int64_t dk, int64_t dv) {
    KQ.resize(2 * C * dk);
    KT.resize(dk * C);
    R.resize(2 * C * C);
    X.resize(C * (dk + dv));
    KdT.resize(dk * C);
    UT.resize(C * dk);
    G.resize(C * dk);
    gam.resize(dk);
    beta.resize(C);
  }
};

constexpr float kFactorRange = 60.f;  // max |G| for the factorised channel-decay products

void chunk_head(const FamilyTraits& tr, const Prep& P, int64_t h, int64_t t0, int64_t Cn, int64_t Cmax, Scratch& w,
                float* S, float* out, float* Tr) {
  const RecShape& s = P.s;
  const RecInputs& in = P.in;
  const int64_t dk = s.dk, dv = s.dv, Hv = s.Hv, ldx = dk + dv;
  const bool delta = tr.delta, chan = tr.decay == Decay::Channel, decay = tr.decay != Decay::None;
  float *KQ = w.KQ.data(), *KT = w.KT.data(), *R = w.R.data(), *X = w.X.data(), *KdT = w.KdT.data();
  float *G = w.G.data(), *gam = w.gam.data(), *bet = w.beta.data();
  float* K = KQ;            // rows [0, Cn)
  float* Q = KQ + Cn * dk;  // rows [Cn, 2Cn)
  const int64_t ldr = Cn;   // R is [2Cn, Cn]

  for (int64_t t = 0; t < Cn; ++t) {
    P.qk(t0 + t, h, Q + t * dk, K + t * dk);
    bet[t] = delta ? in.beta[(t0 + t) * Hv + h] : 1.f;
  }
  // Within-chunk cumulative log decay.
  if (chan) {
    const float* g = in.g + (t0 * Hv + h) * dk;
    for (int64_t c = 0; c < dk; ++c) G[c] = g[c];
    for (int64_t t = 1; t < Cn; ++t) {
      const float* gt = g + t * Hv * dk;
      for (int64_t c = 0; c < dk; ++c) G[t * dk + c] = G[(t - 1) * dk + c] + gt[c];
    }
    for (int64_t c = 0; c < dk; ++c) {
      double acc = 0.0;
      for (int64_t t = 0; t < Cn; ++t) acc += g[t * Hv * dk + c];
      gam[c] = float(acc);
    }
  } else {
    double acc = 0.0;  // double: the chunk total feeds the compact log transition
    for (int64_t t = 0; t < Cn; ++t) G[t] = float(acc += P.gs(tr, t0 + t, h));
    gam[0] = float(acc);
  }

  // KdT [dk, Cn] = ((Gamma_C / Gamma_t) k_t)^T;  X = [beta Gamma_t k_t | beta v_t].
  for (int64_t t = 0; t < Cn; ++t) {
    const float* kt = K + t * dk;
    if (chan) {
      const float* Gt = G + t * dk;
      for (int64_t c = 0; c < dk; ++c) KdT[c * Cn + t] = std::exp(gam[c] - Gt[c]) * kt[c];
      if (delta)
        for (int64_t c = 0; c < dk; ++c) X[t * ldx + c] = bet[t] * std::exp(Gt[c]) * kt[c];
    } else {
      const float e = decay ? std::exp(gam[0] - G[t]) : 1.f;
      for (int64_t c = 0; c < dk; ++c) KdT[c * Cn + t] = e * kt[c];
      if (delta) {
        const float b = bet[t] * (decay ? std::exp(G[t]) : 1.f);
        for (int64_t c = 0; c < dk; ++c) X[t * ldx + c] = b * kt[c];
      }
    }
    if (delta) {
      const float* vt = in.v + ((t0 + t) * Hv + h) * dv;
      for (int64_t j = 0; j < dv; ++j) X[t * ldx + dk + j] = bet[t] * vt[j];
    }
  }

  // Pairwise matrices: L (rows [0,Cn), strictly lower) and P (rows [Cn,2Cn), lower incl. diag),
  // both in R. Queries in Q are then replaced by Gamma_t q_t for the inter-chunk term.
  bool exact = false;
  if (chan) {
    float range = 0.f;
    for (int64_t i = 0; i < Cn * dk; ++i) range = std::max(range, std::fabs(G[i]));
    exact = range > kFactorRange;
  }
  if (!chan || !exact) {
    // KT [dk, Cn] = (k_i exp(-G_i))^T (channel) or k_i^T (scalar, decay applied after).
    for (int64_t t = 0; t < Cn; ++t)
      for (int64_t c = 0; c < dk; ++c) KT[c * Cn + t] = chan ? K[t * dk + c] * std::exp(-G[t * dk + c]) : K[t * dk + c];
    if (chan) {
      for (int64_t t = 0; t < Cn; ++t)
        for (int64_t c = 0; c < dk; ++c) {
          const float e = std::exp(G[t * dk + c]);
          K[t * dk + c] *= e;
          Q[t * dk + c] *= e;
        }
    }
    const int64_t rows = delta ? 2 * Cn : Cn;  // no L for plain families
    float* A0 = delta ? KQ : Q;
    float* R0 = delta ? R : R + Cn * ldr;
    gemm(rows, Cn, dk, 1.f, A0, dk, KT, Cn, R0, ldr, false);
    for (int64_t t = 0; t < Cn; ++t) {
      float* Lr = R + t * ldr;
      float* Pr = R + (Cn + t) * ldr;
      for (int64_t i = 0; i <= t; ++i) {
        const float e = (!chan && decay) ? std::exp(G[t] - G[i]) : 1.f;
        if (delta) Lr[i] = i < t ? bet[t] * e * Lr[i] : 0.f;
        Pr[i] *= e;
      }
      for (int64_t i = t + 1; i < Cn; ++i) Pr[i] = 0.f;
    }
  } else {
    for (int64_t t = 0; t < Cn; ++t) {
      float* Lr = R + t * ldr;
      float* Pr = R + (Cn + t) * ldr;
      const float *kt = K + t * dk, *qt = Q + t * dk, *Gt = G + t * dk;
      for (int64_t i = 0; i <= t; ++i) {
        const float *ki = K + i * dk, *Gi = G + i * dk;
        float l = 0.f, p = 0.f;
        for (int64_t c = 0; c < dk; ++c) {
          const float e = std::exp(Gt[c] - Gi[c]) * ki[c];
          l += kt[c] * e;
          p += qt[c] * e;
        }
        if (delta) Lr[i] = i < t ? bet[t] * l : 0.f;
        Pr[i] = p;
      }
      for (int64_t i = t + 1; i < Cn; ++i) Pr[i] = 0.f;
    }
    for (int64_t t = 0; t < Cn; ++t)
      for (int64_t c = 0; c < dk; ++c) Q[t * dk + c] *= std::exp(G[t * dk + c]);
  }
  if (!chan && decay)
    for (int64_t t = 0; t < Cn; ++t) scal(dk, std::exp(G[t]), Q + t * dk);

  // U.
  const float* U;
  int64_t ldu;
  if (delta) {
    // Forward substitution (I + L) X = X in blocks of 16 rows: the rows solved so far enter a
    // block through one GEMM, the block itself row by row.
    constexpr int64_t kB = 16;
    for (int64_t b0 = 0; b0 < Cn; b0 += kB) {
      const int64_t nb = std::min(kB, Cn - b0);
      if (b0) gemm(nb, ldx, b0, -1.f, R + b0 * ldr, ldr, X, ldx, X + b0 * ldx, ldx, true);
      for (int64_t t = b0 + 1; t < b0 + nb; ++t) {
        const float* Lr = R + t * ldr;
        float* xt = X + t * ldx;
        for (int64_t i = b0; i < t; ++i) axpy(ldx, -Lr[i], X + i * ldx, xt);
      }
    }
    gemm(Cn, dv, dk, -1.f, X, ldx, S, dv, X + dk, ldx, true);  // U = Uv - W S0
    U = X + dk;
    ldu = ldx;
  } else {
    U = in.v + (t0 * Hv + h) * dv;
    ldu = Hv * dv;
  }

  // Outputs.
  if (out) {
    float* O = out + (t0 * Hv + h) * dv;
    gemm(Cn, dv, dk, 1.f, Q, dk, S, dv, O, Hv * dv, false);
    gemm(Cn, dv, Cn, 1.f, R + Cn * ldr, ldr, U, ldu, O, Hv * dv, true);
  }

  // State and transition.
  auto decay_rows = [&](float* M, int64_t n) {
    if (!decay) return;
    if (chan)
      for (int64_t c = 0; c < dk; ++c) scal(n, std::exp(gam[c]), M + c * n);
    else
      scal(dk * n, std::exp(gam[0]), M);
  };
  if (Tr && tr.storage == TStorage::Dense) {
    float* UT = w.UT.data();
    gemm(Cn, dk, dk, -1.f, X, ldx, Tr, dk, UT, dk, false);  // -W T
    decay_rows(Tr, dk);
    gemm(dk, dk, Cn, 1.f, KdT, Cn, UT, dk, Tr, dk, true);
  } else if (Tr && tr.storage == TStorage::LogScalar) {
    Tr[0] += gam[0];
  } else if (Tr && tr.storage == TStorage::LogVector) {
    for (int64_t c = 0; c < dk; ++c) Tr[c] += gam[c];
  }
  decay_rows(S, dv);
  gemm(dk, dv, Cn, 1.f, KdT, Cn, U, ldu, S, dv, true);
  (void)Cmax;
}

// ---- token step ------------------------------------------------------------------------------
void step_head(const FamilyTraits& tr, const Prep& P, int64_t h, float* S, float* out, float* Tr) {
  const RecShape& s = P.s;
  const RecInputs& in = P.in;
  const int64_t dk = s.dk, dv = s.dv, Hv = s.Hv;
  std::vector<float> q(dk), k(dk), d(dk), e(dk, 1.f), u(std::max(dk, dv));
  std::vector<double> logT(dk, 0.0);  // compact log transitions accumulate in double
  for (int64_t t = 0; t < s.T; ++t) {
    P.qk(t, h, q.data(), k.data());
    if (tr.decay == Decay::Channel)
      for (int64_t c = 0; c < dk; ++c) d[c] = in.g[(t * Hv + h) * dk + c];
    else
      std::fill(d.begin(), d.end(), P.gs(tr, t, h));
    const float b = tr.delta ? in.beta[t * Hv + h] : 1.f;
    const float* vt = in.v + (t * Hv + h) * dv;
    if (tr.decay != Decay::None)
      for (int64_t c = 0; c < dk; ++c) e[c] = tr.decay == Decay::Channel || c == 0 ? std::exp(d[c]) : e[0];
    // A_t applied to X [dk, n] (X <- D X, then (delta) X <- X - b k (k^T X)), plus b k val^T, in two
    // sweeps over X; the second also accumulates o = X^T q when o is given.
    auto apply_A = [&](float* Xm, int64_t n, const float* val, float* o) {
      std::fill(u.begin(), u.begin() + n, 0.f);
      for (int64_t c = 0; c < dk; ++c) {
        if (tr.decay != Decay::None) scal(n, e[c], Xm + c * n);
        if (tr.delta) axpy(n, k[c], Xm + c * n, u.data());
      }
      if (tr.delta)
        for (int64_t j = 0; j < n; ++j) u[j] = b * ((val ? val[j] : 0.f) - u[j]);
      else if (val)
        std::copy(val, val + n, u.begin());
      if (o) std::fill(o, o + n, 0.f);
      for (int64_t c = 0; c < dk; ++c) {
        if (tr.delta || val) axpy(n, k[c], u.data(), Xm + c * n);
        if (o) axpy(n, q[c], Xm + c * n, o);
      }
    };
    apply_A(S, dv, vt, out ? out + (t * Hv + h) * dv : nullptr);
    if (!Tr) continue;
    switch (tr.storage) {
      case TStorage::Dense:
        apply_A(Tr, dk, nullptr, nullptr);
        break;
      case TStorage::LogScalar:
        logT[0] += d[0];
        break;
      case TStorage::LogVector:
        for (int64_t c = 0; c < dk; ++c) logT[c] += d[c];
        break;
      default:
        break;
    }
  }
  if (Tr && tr.storage == TStorage::LogScalar) Tr[0] += float(logT[0]);
  if (Tr && tr.storage == TStorage::LogVector)
    for (int64_t c = 0; c < dk; ++c) Tr[c] += float(logT[c]);
}

int64_t t_stride(Family f, int64_t dk) {
  switch (traits(f).storage) {
    case TStorage::Dense:
      return dk * dk;
    case TStorage::LogVector:
      return dk;
    case TStorage::LogScalar:
      return 1;
    default:
      return 0;
  }
}

}  // namespace

ScopedRunner::ScopedRunner(const Runner* r) : prev_(t_runner) {
  t_runner = r;
}
ScopedRunner::~ScopedRunner() {
  t_runner = prev_;
}

int64_t transition_floats(Family f, int64_t Hv, int64_t dk) {
  return Hv * t_stride(f, dk);
}

void recurrent_forward(Family f, const RecShape& s, const RecInputs& in, float* state, float* out, float* transition,
                       int threads) {
  validate(f, s, in);
  const FamilyTraits tr = traits(f);
  init_transition(f, s.Hv, s.dk, transition);
  const RopeTable rope(in.rope, s.T);
  const Prep P{s, in, rope, s.Hv / s.Hk};
  const int64_t ts = t_stride(f, s.dk);
  const int nt = s.Hv * s.dk * s.dv * s.T < (1 << 18) ? 1 : threads;  // tiny decode: no threads
  parallel_heads(s.Hv, nt, [&](int64_t h, int) {
    step_head(tr, P, h, state + h * s.dk * s.dv, out, transition && ts ? transition + h * ts : nullptr);
  });
}

void chunked_forward(Family f, const RecShape& s, const RecInputs& in, float* state, float* out, float* transition,
                     int threads, int chunk) {
  if (s.T <= 1) return recurrent_forward(f, s, in, state, out, transition, threads);
  validate(f, s, in);
  const FamilyTraits tr = traits(f);
  const int64_t C = chunk > 0 ? chunk : 32;  // 32 measured fastest on AVX2/AVX-512 CPUs
  init_transition(f, s.Hv, s.dk, transition);
  const RopeTable rope(in.rope, s.T);
  const Prep P{s, in, rope, s.Hv / s.Hk};
  const int64_t ts = t_stride(f, s.dk);
  const int nt = std::max(1, std::min<int>(threads, int(s.Hv)));
  std::vector<Scratch> scratch(nt);
  for (auto& w : scratch) w.ensure(C, s.dk, s.dv);
  parallel_heads(s.Hv, nt, [&](int64_t h, int wk) {
    float* S = state + h * s.dk * s.dv;
    float* Tr = transition && ts ? transition + h * ts : nullptr;
    for (int64_t t0 = 0; t0 < s.T; t0 += C) chunk_head(tr, P, h, t0, std::min(C, s.T - t0), C, scratch[wk], S, out, Tr);
  });
}

void chunked_forward_head(Family f, const RecShape& s, const RecInputs& in, int64_t h, float* state_h, float* out,
                          int chunk) {
  if (h < 0 || h >= s.Hv) throw std::invalid_argument("linear: head out of range");
  validate(f, s, in);
  const FamilyTraits tr = traits(f);
  const RopeTable rope(in.rope, s.T);
  const Prep P{s, in, rope, s.Hv / s.Hk};
  if (s.T <= 1) {
    step_head(tr, P, h, state_h, out, nullptr);
    return;
  }
  const int64_t C = chunk > 0 ? chunk : 32;
  thread_local Scratch w;
  w.ensure(C, s.dk, s.dv);
  for (int64_t t0 = 0; t0 < s.T; t0 += C) chunk_head(tr, P, h, t0, std::min(C, s.T - t0), C, w, state_h, out, nullptr);
}

Summary summarize(Family f, const RecShape& s, const RecInputs& in, float* out, int threads, int chunk) {
  Summary r;
  r.family = f;
  r.Hv = s.Hv, r.dk = s.dk, r.dv = s.dv, r.length = s.T;
  r.S.assign(s.Hv * s.dk * s.dv, 0.f);
  r.T.assign(transition_floats(f, s.Hv, s.dk), 0.f);
  chunked_forward(f, s, in, r.S.data(), out, r.T.empty() ? nullptr : r.T.data(), threads, chunk);
  return r;
}

void apply_transition(Family f, int64_t Hv, int64_t dk, int64_t n, const float* T, int64_t length,
                      const float* log_gamma, float* X) {
  std::vector<float> tmp;
  for (int64_t h = 0; h < Hv; ++h) {
    float* Xh = X + h * dk * n;
    switch (traits(f).storage) {
      case TStorage::Identity:
        break;
      case TStorage::FromLength:
        scal(dk * n, std::exp(double(length) * double(log_gamma[h])), Xh);
        break;
      case TStorage::LogScalar:
        scal(dk * n, std::exp(T[h]), Xh);
        break;
      case TStorage::LogVector:
        for (int64_t c = 0; c < dk; ++c) scal(n, std::exp(T[h * dk + c]), Xh + c * n);
        break;
      case TStorage::Dense:
        tmp.assign(Xh, Xh + dk * n);
        gemm(dk, n, dk, 1.f, T + h * dk * dk, dk, tmp.data(), n, Xh, n, false);
        break;
    }
  }
}

void compose(const Summary& seg, const float* log_gamma, const float* S_prefix, float* S_out) {
  const int64_t n = seg.Hv * seg.dk * seg.dv;
  if (S_out != S_prefix) std::memcpy(S_out, S_prefix, n * sizeof(float));
  apply_transition(seg.family, seg.Hv, seg.dk, seg.dv, seg.T.data(), seg.length, log_gamma, S_out);
  for (int64_t i = 0; i < n; ++i) S_out[i] += seg.S[i];
}

Summary compose(const Summary& a, const Summary& b, const float* log_gamma) {
  if (a.family != b.family || a.Hv != b.Hv || a.dk != b.dk || a.dv != b.dv)
    throw std::invalid_argument("linear::compose: mismatched summaries");
  Summary r = a;
  r.length = a.length + b.length;
  compose(b, log_gamma, a.S.data(), r.S.data());
  switch (traits(a.family).storage) {
    case TStorage::LogScalar:
    case TStorage::LogVector:
      for (size_t i = 0; i < r.T.size(); ++i) r.T[i] = a.T[i] + b.T[i];
      break;
    case TStorage::Dense:
      apply_transition(a.family, a.Hv, a.dk, a.dk, b.T.data(), b.length, log_gamma, r.T.data());
      break;
    default:
      break;
  }
  return r;
}

std::vector<float> expand_transition(Family f, int64_t Hv, int64_t dk, const float* T, int64_t length,
                                     const float* log_gamma) {
  std::vector<float> D(Hv * dk * dk, 0.f);
  if (traits(f).storage == TStorage::Dense) {
    std::memcpy(D.data(), T, D.size() * sizeof(float));
    return D;
  }
  for (int64_t h = 0; h < Hv; ++h)
    for (int64_t i = 0; i < dk; ++i) D[(h * dk + i) * dk + i] = 1.f;
  apply_transition(f, Hv, dk, dk, T, length, log_gamma, D.data());
  return D;
}

void rerotate_state(float* X, int64_t H, int64_t dk, int64_t n, int64_t start, int rot_dim, double theta) {
  const int half = rot_dim / 2;
  for (int i = 0; i < half; ++i) {
    const double a = double(start) * std::pow(theta, -2.0 * i / rot_dim);
    const float c = float(std::cos(a)), sn = float(std::sin(a));
    for (int64_t h = 0; h < H; ++h) {
      float* x0 = X + (h * dk + i) * n;
      float* x1 = X + (h * dk + i + half) * n;
      for (int64_t j = 0; j < n; ++j) {
        const float u = x0[j], w = x1[j];
        x0[j] = u * c - w * sn;
        x1[j] = w * c + u * sn;
      }
    }
  }
}

}  // namespace hypic::linear
