// The token-sequential gated delta rule as a device function, shared by the span kernel
// (gated_delta.cu) and the PIC composition chain (gated_delta_chain.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/launch.cuh"

namespace hypic::cuda {

constexpr int kGdnCols = 32;  // columns of S per block
constexpr int kGdnRows = 32;  // rows per thread at most (dk <= 32 P)
constexpr int kGdnTile = 32;  // tokens staged in shared memory at a time

// Shared memory gdn_tokens needs (floats).
constexpr int gdn_tokens_smem_floats(int dk) {
  return kGdnTile * (2 * dk + 2 + kGdnCols);
}

// No copy of the caller's to issue (gdn_tokens' `issue`).
struct NoIssue {
  __device__ bool operator()() const { return false; }
};

// T tokens of the recurrence for this thread's share of a column of S (s: rows i * P + p, i < R), through
// shared memory a tile of tokens at a time. Column `c` of the block's columns [col0, col0 + kCols):
// value columns (c < dv) take v and write out (when out is set); transition columns (is_T) take
// v = 0. Starts each tile with a barrier, so the caller may have used `smem` before.
// Tiles come with cp.async where rows are 16-byte aligned (one memory latency for q, k and v
// instead of one per loop). `issue` runs once, after the first tile's copies are issued: a copy of
// the caller's that should run under the recurrence (the chain's next T) and returns whether it
// committed a cp.async group, which the tile's wait then leaves in flight.
template <int P, int R = kGdnRows, typename Issue = NoIssue>
__device__ __forceinline__ void gdn_tokens(const float* __restrict__ q, const float* __restrict__ k,
                                           const float* __restrict__ v, const float* __restrict__ g,
                                           const float* __restrict__ beta, bool l2norm, int64_t T, int64_t Hk,
                                           int64_t Hv, int dk, int dv, int h, int64_t hk, int col0, bool valid,
                                           bool is_T, int c, float (&s)[R], float* out, float* smem, Issue issue = {}) {
  float* qs = smem;                // [kGdnTile][dk]
  float* ks = qs + kGdnTile * dk;  // [kGdnTile][dk]
  float* gs = ks + kGdnTile * dk;  // [kGdnTile]
  float* bs = gs + kGdnTile;       // [kGdnTile]
  float* vs = bs + kGdnTile;       // [kGdnTile][kGdnCols]: this block's columns of v (0 for T columns)
  const int p = threadIdx.x % P;
  const float qscale = rsqrtf(static_cast<float>(dk));
  const int nthreads = kGdnCols * P, lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = nthreads / 32;
  constexpr int kTile = kGdnTile, kCols = kGdnCols, kRows = R;
  const bool vec =
      dk % 4 == 0 && dv % 4 == 0 &&
      ((reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(k) | reinterpret_cast<uintptr_t>(v)) & 15) == 0;
  for (int64_t t0 = 0; t0 < T; t0 += kTile) {
    const int nt = static_cast<int>(T - t0 < kTile ? T - t0 : kTile);
    __syncthreads();
    if (vec) {
      for (int e = threadIdx.x; e < nt * dk / 4; e += nthreads) {
        const int tt = e / (dk / 4), d = 4 * (e % (dk / 4));
        const int64_t src = ((t0 + tt) * Hk + hk) * dk + d;
        cp_async16(qs + tt * dk + d, q + src);
        cp_async16(ks + tt * dk + d, k + src);
      }
      // v staged too: a global load per token would sit on the recurrence's critical path.
      for (int e = threadIdx.x; e < nt * kCols / 4; e += nthreads) {
        const int tt = e / (kCols / 4), cc = col0 + 4 * (e % (kCols / 4));
        const bool ok = cc < dv;  // dv % 4 == 0: the 4 columns are all in or all out
        cp_async16(vs + tt * kCols + cc - col0, ok ? v + ((t0 + tt) * Hv + h) * dv + cc : v, ok);
      }
    } else {
      for (int e = threadIdx.x; e < nt * dk; e += nthreads) {
        const int tt = e / dk, d = e % dk;
        const int64_t src = ((t0 + tt) * Hk + hk) * dk + d;
        qs[tt * dk + d] = q[src];
        ks[tt * dk + d] = k[src];
      }
      for (int e = threadIdx.x; e < nt * kCols; e += nthreads) {
        const int tt = e / kCols, cc = col0 + e % kCols;
        vs[e] = cc < dv ? v[((t0 + tt) * Hv + h) * dv + cc] : 0.f;
      }
    }
    cp_async_commit();
    for (int tt = threadIdx.x; tt < nt; tt += nthreads) {
      gs[tt] = g[(t0 + tt) * Hv + h];
      bs[tt] = beta[(t0 + tt) * Hv + h];
    }
    if (t0 == 0 && issue())
      cp_async_wait_group<1>();
    else
      cp_async_wait_all();
    __syncthreads();
    // q and k scales (L2 norms as the CPU backend: x / sqrt(sum x^2 + 1e-6)), one warp per token.
    for (int tt = warp; tt < nt; tt += nwarps) {
      float sq = 0.f, sk = 0.f;
      for (int d = lane; d < dk; d += 32) {
        sq += qs[tt * dk + d] * qs[tt * dk + d];
        sk += ks[tt * dk + d] * ks[tt * dk + d];
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
        sk += __shfl_xor_sync(0xffffffffu, sk, o);
      }
      const float fq = l2norm ? qscale / sqrtf(sq + 1e-6f) : qscale, fk = l2norm ? 1.f / sqrtf(sk + 1e-6f) : 1.f;
      __syncwarp();
      for (int d = lane; d < dk; d += 32) {
        qs[tt * dk + d] *= fq;
        ks[tt * dk + d] *= fk;
      }
    }
    __syncthreads();
    for (int tt = 0; tt < nt; ++tt) {
      const float* kt = ks + tt * dk;
      const float* qt = qs + tt * dk;
      const float decay = expf(gs[tt]), b = bs[tt];
      const int64_t orow = ((t0 + tt) * Hv + h) * dv;
      const float vc = vs[tt * kCols + threadIdx.x / P];
      float kS = 0.f;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int r = i * P + p;
        if (r < dk) kS += kt[r] * s[i];
      }
#pragma unroll
      for (int o = P / 2; o > 0; o >>= 1) kS += __shfl_xor_sync(0xffffffffu, kS, o);
      const float u = b * (vc - decay * kS);
      float o_ = 0.f;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int r = i * P + p;
        if (r < dk) {
          s[i] = decay * s[i] + kt[r] * u;
          o_ += qt[r] * s[i];
        }
      }
#pragma unroll
      for (int o = P / 2; o > 0; o >>= 1) o_ += __shfl_xor_sync(0xffffffffu, o_, o);
      if (out && valid && !is_T && p == 0) out[orow + c] = o_;
    }
  }
}

}  // namespace hypic::cuda
