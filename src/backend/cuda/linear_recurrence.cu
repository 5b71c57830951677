// Every linear-attention family (linear/recurrence.h) on the GPU: the token-sequential recurrence
// (correctness-first version; it serves decode steps and short spans, and is the reference a
// chunked kernel will be tested against).
//
// Per value head h (key head h / (Hv/Hk)), with S [dk, dv] and left multiplication:
//   S_t = (I - beta_t k_t k_t^T)^[delta] D_t S_{t-1} + b_t k_t v_t^T,  o_t = S_t^T q_t.
// Columns of S are independent given k_t, D_t and beta_t, so a block owns 32 columns of one head
// and each column lives in the registers of P = DK/32 adjacent threads, 32 rows each (DK: dk padded
// to 32, 64 or 128; padded rows of q and k are zero, so they stay zero; dot products over a column
// are reduced with shuffles). One thread per column at DK = 128 spilled registers. Tokens are staged
// in shared memory a tile at a time (q and k normalised and scaled once per block), so the token
// loop itself has no barrier. The dense transition T_C = A_L ... A_1 obeys the same update with
// v = 0 from T = I: its dk columns ride along as extra columns of the same pass.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"
#include "linear/recurrence.h"

namespace hypic::cuda {

static_assert(static_cast<int>(linear::Decay::None) == 0 && static_cast<int>(linear::Decay::FixedScalar) == 1 &&
                  static_cast<int>(linear::Decay::Scalar) == 2 && static_cast<int>(linear::Decay::Channel) == 3,
              "LinearRecurrenceArgs::decay codes follow linear::Decay");

namespace {

constexpr int kCols = 32;  // columns of S per block
constexpr int kRows = 32;  // rows of a column per thread

// Tokens per shared-memory tile: q, k and the channel decays of a tile stay within 24 KB, so
// several blocks fit on an SM and hide each other's staging loads.
template <int DK>
constexpr int tile_tokens() {
  return DK >= 128 ? 16 : 32;
}

// This thread's share (rows i * P + p) of sum_r x[r] y[r], summed over the column's P threads.
template <int P>
__device__ __forceinline__ float col_dot(const float* __restrict__ x, const float (&y)[kRows], int p) {
  float a[4] = {0.f, 0.f, 0.f, 0.f};  // independent chains: one accumulator would set the latency
#pragma unroll
  for (int i = 0; i < kRows; ++i) a[i % 4] = fmaf(x[i * P + p], y[i], a[i % 4]);
  float r = (a[0] + a[1]) + (a[2] + a[3]);
#pragma unroll
  for (int o = P / 2; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
  return r;
}

template <int DK, bool CHANNEL, bool DELTA>
__global__ void __launch_bounds__(kCols* DK / kRows) k_linear_recurrence(LinearRecurrenceArgs a) {
  pdl_entry();
  constexpr int P = DK / kRows, kThreads = kCols * P, kTile = tile_tokens<DK>();
  __shared__ float qs[kTile][DK];
  __shared__ float ks[kTile][DK];
  __shared__ float ds[CHANNEL ? kTile : 1][DK];  // exp(g) per key channel
  __shared__ float gs[kTile];                    // log decay per token (scalar decays)
  __shared__ float bs[kTile];                    // beta
  __shared__ float vs[kTile][kCols];             // this block's columns of v (0 for transition columns)

  const int tid = threadIdx.x, p = tid % P, h = blockIdx.y;
  const int dk = static_cast<int>(a.dk), dv = static_cast<int>(a.dv);
  // One sequence's run of rows [tb, tb + T) (a.runs: one run per blockIdx.z, its own state).
  const int64_t tb = a.run_rows ? a.run_rows[blockIdx.z] : 0;
  const int64_t T = a.run_rows ? a.run_rows[blockIdx.z + 1] - tb : a.T, Hk = a.Hk, Hv = a.Hv, hk = h / (Hv / Hk);
  float* const state = a.run_states ? a.run_states[blockIdx.z] : a.state;
  const int col0 = blockIdx.x * kCols, col = col0 + tid / P;
  const int ncols = dv + (a.transition ? dk : 0);
  const bool valid = col < ncols, is_T = col >= dv;
  const int c = is_T ? col - dv : col;
  float* base = is_T ? a.transition + static_cast<int64_t>(h) * dk * dk : state + static_cast<int64_t>(h) * dk * dv;
  const int ld = is_T ? dk : dv;

  float s[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = i * P + p;
    s[i] = (valid && r < dk) ? (is_T ? (r == c ? 1.f : 0.f) : base[static_cast<int64_t>(r) * ld + c]) : 0.f;
  }

  const float lg = a.decay == 1 ? a.log_gamma[h] : 0.f;
  double gsum = 0.0;  // sum of g over the span (the scaled transition of Decay::Scalar)
  for (int64_t t0 = 0; t0 < T; t0 += kTile) {
    const int nt = static_cast<int>(T - t0 < kTile ? T - t0 : kTile);
    __syncthreads();  // the previous tile is consumed
    for (int e = tid; e < nt * DK; e += kThreads) {
      const int tt = e / DK, i = e % DK;
      const int64_t src = ((tb + t0 + tt) * Hk + hk) * dk + i;
      qs[tt][i] = i < dk ? a.q[src] : 0.f;
      ks[tt][i] = i < dk ? a.k[src] : 0.f;
      if constexpr (CHANNEL) ds[tt][i] = i < dk ? expf(a.g[((tb + t0 + tt) * Hv + h) * dk + i]) : 1.f;
    }
    for (int tt = tid; tt < nt; tt += kThreads) {
      gs[tt] = a.decay == 2 ? a.g[(tb + t0 + tt) * Hv + h] : lg;
      if constexpr (DELTA) bs[tt] = a.beta[(tb + t0 + tt) * Hv + h];
    }
    for (int e = tid; e < nt * kCols; e += kThreads) {
      const int tt = e / kCols, cc = col0 + e % kCols;
      vs[tt][e % kCols] = cc < dv ? a.v[((tb + t0 + tt) * Hv + h) * dv + cc] : 0.f;
    }
    __syncthreads();
    // q and k as the CPU backend scales them: x / sqrt(sum x^2 + 1e-6), then q times q_scale; a
    // warp per token.
    if (a.l2norm || a.q_scale != 1.f) {
      const int lane = tid % 32, warp = tid / 32;
      for (int tt = warp; tt < nt; tt += kThreads / 32) {
        float sq = 0.f, sk = 0.f;
        for (int i = lane; i < DK; i += 32) sq += qs[tt][i] * qs[tt][i], sk += ks[tt][i] * ks[tt][i];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          sq += __shfl_xor_sync(0xffffffffu, sq, o);
          sk += __shfl_xor_sync(0xffffffffu, sk, o);
        }
        const float fq = a.l2norm ? a.q_scale / sqrtf(sq + 1e-6f) : a.q_scale;
        const float fk = a.l2norm ? 1.f / sqrtf(sk + 1e-6f) : 1.f;
        for (int i = lane; i < DK; i += 32) qs[tt][i] *= fq, ks[tt][i] *= fk;
      }
      __syncthreads();
    }
    if (a.t_factor && a.decay == 2 && blockIdx.x == 0 && tid == 0)
      for (int tt = 0; tt < nt; ++tt) gsum += gs[tt];

    for (int tt = 0; tt < nt; ++tt) {
      const float* kt = ks[tt];
      const float vc = is_T ? 0.f : vs[tt][tid / P];
      if constexpr (DELTA) {
        // Decay first, then the delta step on the decayed state (the KDA order).
        if constexpr (CHANNEL) {
#pragma unroll
          for (int i = 0; i < kRows; ++i) s[i] *= ds[tt][i * P + p];
        } else {
          const float d = expf(gs[tt]);
#pragma unroll
          for (int i = 0; i < kRows; ++i) s[i] *= d;
        }
        const float u = bs[tt] * (vc - col_dot<P>(kt, s, p));
#pragma unroll
        for (int i = 0; i < kRows; ++i) s[i] = fmaf(kt[i * P + p], u, s[i]);
      } else if constexpr (CHANNEL) {
#pragma unroll
        for (int i = 0; i < kRows; ++i) s[i] = fmaf(s[i], ds[tt][i * P + p], kt[i * P + p] * vc);
      } else {
        const float d = expf(gs[tt]);
#pragma unroll
        for (int i = 0; i < kRows; ++i) s[i] = fmaf(s[i], d, kt[i * P + p] * vc);
      }
      const float o = col_dot<P>(qs[tt], s, p);
      if (valid && !is_T && p == 0) a.out[((tb + t0 + tt) * Hv + h) * dv + c] = o;
    }
  }

  if (valid) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = i * P + p;
      if (r < dk) base[static_cast<int64_t>(r) * ld + c] = s[i];
    }
  }
  if (a.t_factor && blockIdx.x == 0 && tid == 0)
    a.t_factor[h] = a.decay == 2   ? expf(static_cast<float>(gsum))
                    : a.decay == 1 ? expf(static_cast<float>(T) * lg)
                                   : 1.f;
}

template <int DK, bool CHANNEL, bool DELTA>
void run(cudaStream_t st, const LinearRecurrenceArgs& a) {
  const int64_t ncols = a.dv + (a.transition ? a.dk : 0);
  // At least one block per head: the block at x = 0 also writes the scaled transition.
  const int64_t bx = std::max<int64_t>(1, (ncols + kCols - 1) / kCols);
  dim3 grid(static_cast<unsigned>(bx), static_cast<unsigned>(a.Hv), static_cast<unsigned>(a.run_rows ? a.runs : 1));
  launch(st, grid, kCols * DK / kRows, 0, k_linear_recurrence<DK, CHANNEL, DELTA>, a);
  CUDA_LAUNCH_CHECK("k_linear_recurrence");
}

template <int DK>
void run_dk(cudaStream_t st, const LinearRecurrenceArgs& a) {
  const bool channel = a.decay == 3;
  if (channel && a.delta)
    run<DK, true, true>(st, a);
  else if (channel)
    run<DK, true, false>(st, a);
  else if (a.delta)
    run<DK, false, true>(st, a);
  else
    run<DK, false, false>(st, a);
}

// out = alpha t[h] S + B per head, n floats a head.
__global__ void k_compose_scaled(const float* __restrict__ t, const float* S, const float* B, float alpha, float* out,
                                 int64_t H, int64_t n) {
  pdl_entry();
  const int64_t total = H * n, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride)
    out[i] = fmaf(alpha * t[i / n], S[i], B[i]);
}

}  // namespace

void launch_linear_recurrence(cudaStream_t s, const LinearRecurrenceArgs& a) {
  if (a.Hv == 0 || (a.run_rows && (a.runs == 0 || a.max_run == 0))) return;
  if (a.run_rows && (a.transition || a.t_factor))
    throw std::invalid_argument("linear_recurrence_runs: runs take no transitions");
  if (!a.run_rows && a.T == 0) {  // an empty span: state unchanged, T_C = I
    if (a.transition) launch_set_identity(s, a.transition, a.Hv, a.dk);
    if (a.t_factor) launch_fill(s, a.t_factor, a.Hv, 1.f);
    return;
  }
  if (a.dk <= 32)
    run_dk<32>(s, a);
  else if (a.dk <= 64)
    run_dk<64>(s, a);
  else if (a.dk <= kLinearRecurrenceMaxDk)
    run_dk<128>(s, a);
  else
    throw std::invalid_argument("linear_recurrence: key head dim " + std::to_string(a.dk) +
                                " above 128 is not supported on cuda");
}

void launch_compose_scaled(cudaStream_t s, const float* t, const float* S, const float* B, float alpha, float* out,
                           int64_t H, int64_t n) {
  const int64_t total = H * n;
  if (total == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, 4096);
  launch(s, dim3(static_cast<unsigned>(blocks)), threads, 0, k_compose_scaled, t, S, B, alpha, out, H, n);
  CUDA_LAUNCH_CHECK("k_compose_scaled");
}

}  // namespace hypic::cuda
