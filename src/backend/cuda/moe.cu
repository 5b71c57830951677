// MoE routing on the GPU: softmax over the router logits, top-k (ties: lower expert index first,
// as the CPU backend), optional renormalisation, then each slot's rank within its expert in token
// order (a deterministic counting sort) and the padded row table of the batched expert products.
#include <cfloat>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace hypic::cuda {

namespace {

constexpr int kMaxPer = 32;  // experts per lane: E <= 1024

// One warp per token.
__global__ void k_route(const float* logits, int64_t T, int E, int top_k, bool norm, int32_t* sel, float* wsel) {
  pdl_entry();
  const int64_t t = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= T) return;
  const float* row = logits + t * E;
  float p[kMaxPer];
  float mx = -FLT_MAX;
#pragma unroll
  for (int i = 0; i < kMaxPer; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? row[e] : -FLT_MAX;
    mx = fmaxf(mx, p[i]);
  }
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxPer; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? expf(p[i] - mx) : -1.f;
    if (e < E) sum += p[i];
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
#pragma unroll
  for (int i = 0; i < kMaxPer; ++i)
    if (lane + 32 * i < E) p[i] /= sum;
  float picked = 0.f;
  for (int j = 0; j < top_k; ++j) {
    float bv = -2.f;
    int be = 1 << 30;
#pragma unroll
    for (int i = 0; i < kMaxPer; ++i) {
      const int e = lane + 32 * i;
      if (p[i] > bv) bv = p[i], be = e;  // ascending e per lane: the first of equal values wins
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (ov > bv || (ov == bv && oe < be)) bv = ov, be = oe;
    }
#pragma unroll
    for (int i = 0; i < kMaxPer; ++i)
      if (lane + 32 * i == be) p[i] = -1.f;
    if (lane == 0) {
      sel[t * top_k + j] = be;
      wsel[t * top_k + j] = bv;
    }
    picked += bv;
  }
  if (norm && lane == 0)
    for (int j = 0; j < top_k; ++j) wsel[t * top_k + j] /= picked;
}

// One block per expert: ranks of its slots in slot (token) order, and its count.
__global__ void k_rank(const int32_t* sel, int64_t n, int32_t* rank, int32_t* counts) {
  pdl_entry();
  const int e = blockIdx.x;
  __shared__ int warp_tot[32];
  __shared__ int base;
  if (threadIdx.x == 0) base = 0;
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = blockDim.x / 32;
  for (int64_t i0 = 0; i0 < n; i0 += blockDim.x) {
    __syncthreads();
    const int64_t i = i0 + threadIdx.x;
    const bool f = i < n && sel[i] == e;
    const unsigned m = __ballot_sync(0xffffffffu, f);
    if (lane == 0) warp_tot[w] = __popc(m);
    __syncthreads();
    int before = base;
    for (int k = 0; k < w; ++k) before += warp_tot[k];
    if (f) rank[i] = before + __popc(m & ((1u << lane) - 1));
    __syncthreads();
    if (threadIdx.x == 0)
      for (int k = 0; k < nw; ++k) base += warp_tot[k];
  }
  __syncthreads();
  if (threadIdx.x == 0) counts[e] = base;
}

__global__ void k_moe_index(const int32_t* sel, const int32_t* rank, const int32_t* batch_of, int64_t n, int top_k,
                            int64_t maxn, int32_t* rows, int32_t* pos) {
  pdl_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = batch_of[sel[i]] * maxn + rank[i];
    rows[p] = static_cast<int32_t>(i / top_k);
    pos[i] = static_cast<int32_t>(p);
  }
}

}  // namespace

void launch_moe_route(cudaStream_t s, const float* logits, int64_t T, int64_t E, int top_k, bool norm, int32_t* sel,
                      float* wsel, int32_t* rank, int32_t* counts) {
  if (E > 32 * kMaxPer)
    throw std::invalid_argument("moe_experts: at most 1024 experts on cuda, got " + std::to_string(E));
  if (T == 0) return;
  launch(s, static_cast<unsigned>((T + 7) / 8), 256, 0, k_route, logits, T, static_cast<int>(E), top_k, norm, sel,
         wsel);
  CUDA_LAUNCH_CHECK("k_route");
  launch(s, static_cast<unsigned>(E), 256, 0, k_rank, sel, T * top_k, rank, counts);
  CUDA_LAUNCH_CHECK("k_rank");
}

void launch_moe_index(cudaStream_t s, const int32_t* sel, const int32_t* rank, const int32_t* batch_of, int64_t T,
                      int top_k, int64_t maxn, int32_t* rows, int32_t* pos) {
  const int64_t n = T * top_k;
  if (n == 0) return;
  launch(s, static_cast<unsigned>((n + 255) / 256), 256, 0, k_moe_index, sel, rank, batch_of, n, top_k, maxn, rows,
         pos);
  CUDA_LAUNCH_CHECK("k_moe_index");
}

}  // namespace hypic::cuda
