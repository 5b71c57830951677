// MoE routing on the GPU: softmax over the router logits, top-k (ties: lower expert index first,
// as the CPU backend), optional renormalisation, then each slot's rank within its expert in token
// order (a deterministic counting sort) and the padded row table of the batched expert products.
// And the grouped expert products for up to a few thousand slots (k_moe_grouped): no expert
// counts go back to the host, so a PIC composition's 200-row forward has no sync per layer.
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/mma.cuh"

namespace hypic::cuda {

namespace {

constexpr int kMaxPer = 32;  // experts per lane: E <= 1024

// Token t's experts by one warp: softmax, top-k, weights (renormalised when norm). PER experts a
// lane (E <= 32 * PER): the top-k passes compare PER values each, so 256 experts take 8, not 32.
template <int PER>
__device__ void route_token(const float* logits, int64_t t, int lane, int E, int top_k, bool norm, int32_t* sel,
                            float* wsel) {
  const float* row = logits + t * E;
  float p[PER];
  float mx = -FLT_MAX;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? row[e] : -FLT_MAX;
    mx = fmaxf(mx, p[i]);
  }
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? expf(p[i] - mx) : -1.f;
    if (e < E) sum += p[i];
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
#pragma unroll
  for (int i = 0; i < PER; ++i)
    if (lane + 32 * i < E) p[i] /= sum;
  float picked = 0.f, mine = 0.f;  // lane j keeps the j-th weight
  for (int j = 0; j < top_k; ++j) {
    float bv = -2.f;
    int be = 1 << 30;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int e = lane + 32 * i;
      if (p[i] > bv) bv = p[i], be = e;  // ascending e per lane: the first of equal values wins
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (ov > bv || (ov == bv && oe < be)) bv = ov, be = oe;
    }
#pragma unroll
    for (int i = 0; i < PER; ++i)
      if (lane + 32 * i == be) p[i] = -1.f;
    if (lane == 0) sel[t * top_k + j] = be;
    if (j < 32) {
      if (lane == j) mine = bv;
    } else if (lane == 0) {
      wsel[t * top_k + j] = bv;  // renormalised below
    }
    picked += bv;
  }
  if (lane < top_k) wsel[t * top_k + lane] = norm ? mine / picked : mine;
  if (top_k > 32 && norm && lane == 0)
    for (int j = 32; j < top_k; ++j) wsel[t * top_k + j] /= picked;
}

// Token t's experts by one warp under DeepSeek-V3's routing, as route_sigmoid_grouped on the host:
// the same comparisons in the same order (groups by the sum of their two best choices, ties to the
// lower group; experts by masked choice, ties to the lower expert), so both pick the same experts.
// A lane holds experts (and groups) lane + 32 i; `taken` bits mark what a round already picked.
template <int PER>
__device__ void route_token_sigmoid(const float* logits, int64_t t, int lane, int E, int top_k, bool norm,
                                    const SigmoidRouter r, int32_t* sel, float* wsel) {
  const float* row = logits + t * E;
  const int per = E / r.n_group;
  float sc[PER], ch[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = lane + 32 * i;
    sc[i] = e < E ? 1.0f / (1.0f + expf(-row[e])) : 0.f;
    ch[i] = e < E ? sc[i] + (r.bias ? r.bias[e] : 0.f) : -INFINITY;
  }
  uint32_t keep = 0;  // bit i: expert lane + 32 i lies in a chosen group
  if (r.topk_group >= r.n_group) {
    keep = ~0u;
  } else {
    float gs[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int g = lane + 32 * j;
      float a = -INFINITY, b = -INFINITY;
      if (g < r.n_group)
        for (int e = g * per; e < (g + 1) * per; ++e) {
          const float c = 1.0f / (1.0f + expf(-row[e])) + (r.bias ? r.bias[e] : 0.f);
          if (c > a)
            b = a, a = c;
          else if (c > b)
            b = c;
        }
      gs[j] = per >= 2 ? a + b : a;
    }
    uint32_t gtaken = 0;
    for (int round = 0; round < r.topk_group; ++round) {
      float bv = -INFINITY;
      int bg = 1 << 30;
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int g = lane + 32 * j;
        if (g < r.n_group && !(gtaken >> j & 1u) && (gs[j] > bv || (gs[j] == bv && g < bg))) bv = gs[j], bg = g;
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int og = __shfl_xor_sync(0xffffffffu, bg, o);
        if (ov > bv || (ov == bv && og < bg)) bv = ov, bg = og;
      }
#pragma unroll
      for (int j = 0; j < PER; ++j)
        if (lane + 32 * j == bg) gtaken |= 1u << j;
#pragma unroll
      for (int i = 0; i < PER; ++i)
        if ((lane + 32 * i) / per == bg) keep |= 1u << i;
    }
  }
  uint32_t taken = 0;
  float picked = 0.f, mine = 0.f;  // lane j keeps the j-th score
  for (int j = 0; j < top_k; ++j) {
    float bv = -INFINITY, bs = 0.f;
    int be = 1 << 30;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int e = lane + 32 * i;
      const float v = keep >> i & 1u ? ch[i] : -INFINITY;
      if (e < E && !(taken >> i & 1u) && (v > bv || (v == bv && e < be))) bv = v, be = e, bs = sc[i];
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      const float os = __shfl_xor_sync(0xffffffffu, bs, o);
      if (ov > bv || (ov == bv && oe < be)) bv = ov, be = oe, bs = os;
    }
#pragma unroll
    for (int i = 0; i < PER; ++i)
      if (lane + 32 * i == be) taken |= 1u << i;
    if (lane == 0) sel[t * top_k + j] = be;
    if (j < 32) {
      if (lane == j) mine = bs;
    } else if (lane == 0) {
      wsel[t * top_k + j] = bs;  // weighted below
    }
    picked += bs;
  }
  const float den = norm ? picked + 1e-20f : 1.f;
  if (lane < top_k) wsel[t * top_k + lane] = (norm ? mine / den : mine) * r.scaling;
  if (top_k > 32 && lane == 0)
    for (int j = 32; j < top_k; ++j)
      wsel[t * top_k + j] = (norm ? wsel[t * top_k + j] / den : wsel[t * top_k + j]) * r.scaling;
}

// f(std::integral_constant<int, PER>) with PER the fewest experts a lane that hold E.
template <typename F>
void with_per(int64_t E, F&& f) {
  if (E <= 128)
    f(std::integral_constant<int, 4>{});
  else if (E <= 256)
    f(std::integral_constant<int, 8>{});
  else if (E <= 512)
    f(std::integral_constant<int, 16>{});
  else
    f(std::integral_constant<int, kMaxPer>{});
}

// One warp per token.
template <int PER>
__global__ void k_route(const float* logits, int64_t T, int E, int top_k, bool norm, int32_t* sel, float* wsel) {
  pdl_entry();
  const int64_t t = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (t >= T) return;
  route_token<PER>(logits, t, threadIdx.x % 32, E, top_k, norm, sel, wsel);
}

template <int PER>
__global__ void k_route_sigmoid(const float* logits, int64_t T, int E, int top_k, bool norm, SigmoidRouter r,
                                int32_t* sel, float* wsel) {
  pdl_entry();
  const int64_t t = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (t >= T) return;
  route_token_sigmoid<PER>(logits, t, threadIdx.x % 32, E, top_k, norm, r, sel, wsel);
}

// Routing, ranks, counts and the slots' order by expert for a few slots (n <= kRouteFewSlots: a
// decode step) in one block instead of three kernels (k_route, k_rank, k_moe_order): the same
// values, since a slot's rank is the number of earlier slots of its expert either way.
constexpr int kRouteFewSlots = 256;
constexpr int kRouteFewThreads = 512;  // route_token<32>'s values need more than 64 registers a thread
template <int PER>
__global__ void __launch_bounds__(kRouteFewThreads)
    k_route_few(const float* logits, int64_t T, int E, int top_k, bool norm, int32_t* sel, float* wsel, int32_t* rank,
                int32_t* counts, int32_t* order, int32_t* offsets, int32_t* pos) {
  pdl_entry();
  __shared__ int32_t s_sel[kRouteFewSlots], s_rank[kRouteFewSlots];
  __shared__ int32_t s_cnt[1024], s_off[1024], s_warp[kRouteFewThreads / 32];
  const int n = static_cast<int>(T) * top_k, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t t = warp; t < T; t += blockDim.x / 32) route_token<PER>(logits, t, lane, E, top_k, norm, sel, wsel);
  for (int e = threadIdx.x; e < E; e += blockDim.x) s_cnt[e] = 0;
  __syncthreads();  // sel is visible to the whole block from here
  for (int i = threadIdx.x; i < n; i += blockDim.x) s_sel[i] = sel[i];
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int e = s_sel[i];
    int r = 0;
    for (int j = 0; j < i; ++j) r += s_sel[j] == e;
    rank[i] = s_rank[i] = r;
    atomicAdd(&s_cnt[e], 1);
  }
  __syncthreads();
  // Exclusive scan of the counts: two experts a thread (E <= 1024), within each warp by shuffles,
  // then over the warps' totals (a serial walk of 256 counts was most of this kernel's time).
  const int e0 = 2 * threadIdx.x;
  const int c0 = e0 < E ? s_cnt[e0] : 0, c1 = e0 + 1 < E ? s_cnt[e0 + 1] : 0;
  int incl = c0 + c1;
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += u;
  }
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  int before = 0;
  for (int w = 0; w < warp; ++w) before += s_warp[w];
  const int ex = before + incl - c0 - c1;
  if (e0 < E) s_off[e0] = ex;
  if (e0 + 1 < E) s_off[e0 + 1] = ex + c0;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    counts[e] = s_cnt[e];
    if (offsets) offsets[e] = s_off[e];
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int32_t p = s_off[s_sel[i]] + s_rank[i];
    order[p] = i;
    if (pos) pos[i] = p;
  }
}

// One block per expert: ranks of its slots in slot (token) order, and its count. The slots go in
// tiles of 8 per thread (8192 a block-wide step, two 16-byte loads a thread): a prefill call's
// 65k slots take 8 steps of two barriers, where one slot a thread took 256 steps of three.
constexpr int kRankThreads = 1024, kRankPer = 8;
__global__ void __launch_bounds__(kRankThreads) k_rank(const int32_t* sel, int64_t n, int32_t* rank, int32_t* counts) {
  pdl_entry();
  const int e = blockIdx.x;
  __shared__ int warp_tot[32];
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  int base = 0;
  for (int64_t t0 = 0; t0 < n; t0 += int64_t(kRankThreads) * kRankPer) {
    const int64_t i0 = t0 + int64_t(threadIdx.x) * kRankPer;
    int v[kRankPer];
    if (i0 + kRankPer <= n && (reinterpret_cast<uintptr_t>(sel) & 15u) == 0) {
      const int4 a = *reinterpret_cast<const int4*>(sel + i0), b = *reinterpret_cast<const int4*>(sel + i0 + 4);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
#pragma unroll
      for (int k = 0; k < kRankPer; ++k) v[k] = i0 + k < n ? sel[i0 + k] : -1;
    }
    int c = 0;
#pragma unroll
    for (int k = 0; k < kRankPer; ++k) c += v[k] == e;
    int incl = c;  // inclusive scan over the block: within the warp, then over the warps' totals
    for (int o = 1; o < 32; o <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += u;
    }
    if (lane == 31) warp_tot[w] = incl;
    __syncthreads();
    if (w == 0) {
      int t = warp_tot[lane];
      for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, t, o);
        if (lane >= o) t += u;
      }
      warp_tot[lane] = t;
    }
    __syncthreads();
    int r = base + (w ? warp_tot[w - 1] : 0) + incl - c;
#pragma unroll
    for (int k = 0; k < kRankPer; ++k)
      if (v[k] == e) rank[i0 + k] = r++;
    base += warp_tot[31];
    __syncthreads();  // warp_tot is rewritten by the next step
  }
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

// Grouped expert products (hand-written: cuBLAS's grouped GEMMs take their sizes from the host,
// which would cost a sync per layer). Block (e, n-tile): expert e's slots (sorted by expert:
// order / offsets), kGN output columns, 16 slots per tensor-core M tile; the weights stream
// through shared memory with cp.async, kStages stages of kGK columns of K in flight (HBM's latency
// needs tens of KB in flight per SM), each weight byte read once per M tile (once for the few
// slots per expert of a short forward). The slots' rows come the same way, f32, and are rounded to
// the weights' dtype as the A fragments are built. GATE_UP: the block's rows are 64 of gate then
// the same 64 of up, and it writes silu(gate) * up; else kGN rows of down.
constexpr int kGM = 16, kGN = 128, kGK = 64, kStages = 4;
constexpr int kGS = kGK + 8;  // padded b16 row stride of a weight tile (ldmatrix: conflict-free)
constexpr int kAS = kGK + 8;  // padded f32 row stride of a slot tile (8-byte loads: conflict-free)
template <typename Wt>
constexpr size_t grouped_smem() {
  return kStages * (kGN * kGS * sizeof(Wt) + kGM * kAS * sizeof(float));
}

template <typename Wt, bool GATE_UP>
__global__ void __launch_bounds__(256)
    k_moe_grouped(const float* __restrict__ a, const int32_t* __restrict__ order, const int32_t* __restrict__ offsets,
                  const int32_t* __restrict__ counts, const void* const* __restrict__ w0,
                  const void* const* __restrict__ w1, int top_k, int64_t K, int64_t N, float* __restrict__ y) {
  pdl_entry();
  constexpr bool F16 = std::is_same_v<Wt, __half>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Wt* Ws = reinterpret_cast<Wt*>(smem_raw);                        // [kStages][kGN * kGS]
  float* As = reinterpret_cast<float*>(Ws + kStages * kGN * kGS);  // [kStages][kGM * kAS]
  const int e = blockIdx.x;
  const int cnt = counts[e];
  if (cnt == 0) return;
  const int off = offsets[e];
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * (GATE_UP ? kGN / 2 : kGN);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int mi = lane / 8, mr = lane % 8;
  const Wt* W0 = static_cast<const Wt*>(w0[e]);
  const Wt* W1 = GATE_UP ? static_cast<const Wt*>(w1[e]) : W0;
  const int nk = static_cast<int>((K + kGK - 1) / kGK);
  for (int m0 = 0; m0 < cnt; m0 += kGM) {
    const int mrows = min(kGM, cnt - m0);
    // Stage st <- columns [it * kGK, +kGK) of the weight rows and of the slots' rows (zeros past
    // N, K and the slots); a commit group either way, so the group count stays in step.
    auto load = [&](int it, int st) {
      if (it < nk) {
        const int64_t kc = static_cast<int64_t>(it) * kGK;
        Wt* wd = Ws + st * kGN * kGS;
        for (int c = tid; c < kGN * (kGK / 8); c += 256) {
          const int r = c / (kGK / 8), kk = 8 * (c % (kGK / 8));
          const int64_t n = n0 + (GATE_UP ? r % (kGN / 2) : r);
          const Wt* src = GATE_UP && r >= kGN / 2 ? W1 : W0;
          const bool ok = n < N && kc + kk < K;
          cp_async16(wd + r * kGS + kk, ok ? src + n * K + kc + kk : src, ok);
        }
        float* ad = As + st * kGM * kAS;
        for (int c = tid; c < kGM * (kGK / 4); c += 256) {
          const int m = c / (kGK / 4), kk = 4 * (c % (kGK / 4));
          const bool ok = m < mrows && kc + kk < K;
          const int64_t row = !ok ? 0 : GATE_UP ? order[off + m0 + m] / top_k : off + m0 + m;
          cp_async16(ad + m * kAS + kk, ok ? a + row * K + kc + kk : a, ok);
        }
      }
      cp_async_commit();
    };
    float acc[2][4] = {};
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) load(st, st);
    for (int it = 0; it < nk; ++it) {
      cp_async_wait_group<kStages - 2>();
      __syncthreads();  // stage it landed; every warp is done with the stage the next load refills
      load(it + kStages - 1, (it + kStages - 1) % kStages);
      const Wt* Wb = Ws + (it % kStages) * kGN * kGS;
      const float* Ab = As + (it % kStages) * kGM * kAS;
#pragma unroll
      for (int kk = 0; kk < kGK; kk += 16) {
        // A fragment (rows g, g + 8; columns 2 t4 + {0, 1} and + 8) from the f32 tile.
        const float2 x0 = *reinterpret_cast<const float2*>(Ab + g * kAS + kk + 2 * t4);
        const float2 x1 = *reinterpret_cast<const float2*>(Ab + (g + 8) * kAS + kk + 2 * t4);
        const float2 x2 = *reinterpret_cast<const float2*>(Ab + g * kAS + kk + 8 + 2 * t4);
        const float2 x3 = *reinterpret_cast<const float2*>(Ab + (g + 8) * kAS + kk + 8 + 2 * t4);
        const uint32_t a0 = pack2<F16>(x0.x, x0.y), a1 = pack2<F16>(x1.x, x1.y), a2 = pack2<F16>(x2.x, x2.y),
                       a3 = pack2<F16>(x3.x, x3.y);
        uint32_t b0, b1, c0, c1;
        ldmatrix_x4(b0, b1, c0, c1, Wb + (warp * 16 + (mi >> 1) * 8 + mr) * kGS + kk + (mi & 1) * 8);
        mma16816<F16>(acc[0], a0, a1, a2, a3, b0, b1);
        mma16816<F16>(acc[1], a0, a1, a2, a3, c0, c1);
      }
    }
    cp_async_wait_group<0>();
    __syncthreads();  // every warp done with the stages: they hold the tile's outputs now
    float* Ys = reinterpret_cast<float*>(smem_raw);  // [kGM][kGN + 4]
    constexpr int ldy = kGN + 4;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = warp * 16 + j * 8 + 2 * t4;
      Ys[g * ldy + col] = acc[j][0];
      Ys[g * ldy + col + 1] = acc[j][1];
      Ys[(g + 8) * ldy + col] = acc[j][2];
      Ys[(g + 8) * ldy + col + 1] = acc[j][3];
    }
    __syncthreads();
    constexpr int ncol = GATE_UP ? kGN / 2 : kGN;
    for (int c = tid; c < mrows * ncol; c += 256) {
      const int m = c / ncol, j = c % ncol;
      if (n0 + j >= N) continue;
      const float v = GATE_UP ? silu(Ys[m * ldy + j]) * Ys[m * ldy + kGN / 2 + j] : Ys[m * ldy + j];
      y[(off + m0 + m) * N + n0 + j] = v;
    }
    __syncthreads();  // before the next M tile's loads overwrite Ys
  }
}

template <typename Wt, bool GATE_UP>
void run_grouped(cudaStream_t s, dim3 grid, const float* a, const int32_t* order, const int32_t* offsets,
                 const int32_t* counts, const void* const* w0, const void* const* w1, int top_k, int64_t K, int64_t N,
                 float* y) {
  constexpr size_t smem = grouped_smem<Wt>();
  static const bool sized = [] {
    CUDA_CHECK(cudaFuncSetAttribute(k_moe_grouped<Wt, GATE_UP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
    return true;
  }();
  (void)sized;
  launch(s, grid, 256, smem, k_moe_grouped<Wt, GATE_UP>, a, order, offsets, counts, w0, w1, top_k, K, N, y);
}

}  // namespace

void launch_moe_grouped(cudaStream_t s, DType wdt, bool gate_up, const float* a, const int32_t* order,
                        const int32_t* offsets, const int32_t* counts, const void* const* w0, const void* const* w1,
                        int64_t E, int top_k, int64_t K, int64_t N, float* y) {
  if (E == 0 || N == 0) return;
  const int64_t cols = gate_up ? kGN / 2 : kGN;
  const dim3 grid(static_cast<unsigned>(E), static_cast<unsigned>((N + cols - 1) / cols));
  if (wdt == DType::BF16) {
    if (gate_up)
      run_grouped<__nv_bfloat16, true>(s, grid, a, order, offsets, counts, w0, w1, top_k, K, N, y);
    else
      run_grouped<__nv_bfloat16, false>(s, grid, a, order, offsets, counts, w0, w1, top_k, K, N, y);
  } else if (wdt == DType::F16) {
    if (gate_up)
      run_grouped<__half, true>(s, grid, a, order, offsets, counts, w0, w1, top_k, K, N, y);
    else
      run_grouped<__half, false>(s, grid, a, order, offsets, counts, w0, w1, top_k, K, N, y);
  } else {
    throw std::logic_error("moe_grouped: bf16 or f16 weights only");
  }
  CUDA_LAUNCH_CHECK("k_moe_grouped");
}

namespace {
bool grouped_on = true;
}
void set_moe_grouped(bool on) {
  grouped_on = on;
}
bool moe_grouped_enabled() {
  static const bool env = [] {
    const char* e = std::getenv("HYPIC_MOE_GROUPED");
    return !(e && std::string(e) == "0");
  }();
  return grouped_on && env;
}

void launch_moe_route(cudaStream_t s, const float* logits, int64_t T, int64_t E, int top_k, bool norm, int32_t* sel,
                      float* wsel, int32_t* rank, int32_t* counts) {
  if (E > 32 * kMaxPer)
    throw std::invalid_argument("moe_experts: at most 1024 experts on cuda, got " + std::to_string(E));
  if (T == 0) return;
  with_per(E, [&](auto per) {
    launch(s, static_cast<unsigned>((T + 7) / 8), 256, 0, k_route<decltype(per)::value>, logits, T, static_cast<int>(E),
           top_k, norm, sel, wsel);
  });
  CUDA_LAUNCH_CHECK("k_route");
  launch(s, static_cast<unsigned>(E), kRankThreads, 0, k_rank, sel, T * top_k, rank, counts);
  CUDA_LAUNCH_CHECK("k_rank");
}

void launch_moe_route_sigmoid(cudaStream_t s, const float* logits, int64_t T, int64_t E, int top_k, bool norm,
                              const SigmoidRouter& r, int32_t* sel, float* wsel, int32_t* rank, int32_t* counts) {
  if (E > 32 * kMaxPer)
    throw std::invalid_argument("moe_experts: at most 1024 experts on cuda, got " + std::to_string(E));
  if (T == 0) return;
  with_per(E, [&](auto per) {
    launch(s, static_cast<unsigned>((T + 7) / 8), 256, 0, k_route_sigmoid<decltype(per)::value>, logits, T,
           static_cast<int>(E), top_k, norm, r, sel, wsel);
  });
  CUDA_LAUNCH_CHECK("k_route_sigmoid");
  launch(s, static_cast<unsigned>(E), kRankThreads, 0, k_rank, sel, T * top_k, rank, counts);
  CUDA_LAUNCH_CHECK("k_rank");
}

void launch_moe_route_order(cudaStream_t s, const float* logits, int64_t T, int64_t E, int top_k, bool norm,
                            int32_t* sel, float* wsel, int32_t* rank, int32_t* counts, int32_t* order, int32_t* offsets,
                            int32_t* pos) {
  if (E > 32 * kMaxPer)
    throw std::invalid_argument("moe_experts: at most 1024 experts on cuda, got " + std::to_string(E));
  if (T == 0) return;
  if (T * top_k > kRouteFewSlots) {
    launch_moe_route(s, logits, T, E, top_k, norm, sel, wsel, rank, counts);
    launch_moe_order(s, sel, rank, counts, E, T * top_k, order, offsets, pos);
    return;
  }
  with_per(E, [&](auto per) {
    launch(s, 1, kRouteFewThreads, 0, k_route_few<decltype(per)::value>, logits, T, static_cast<int>(E), top_k, norm,
           sel, wsel, rank, counts, order, offsets, pos);
  });
  CUDA_LAUNCH_CHECK("k_route_few");
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
