// Products with few activation rows (decode steps): y[M,N] = x[M,K] W[N,K]^T for M <= 8, and the
// MoE experts of a decode batch. Here the weights are read once and every other cost is small, so
// what matters is streaming W at the memory's bandwidth: a warp per output row, 16-byte loads, the
// activations in f32 from L1/L2, f32 accumulation. cuBLAS picks tensor-core tiles for these shapes
// and pays the activation conversion on top; the MoE path also needs no host round trip (no expert
// counts read back), which is what lets a decode step run without a synchronisation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace hypic::cuda {

namespace {

constexpr int kThreads = 256;  // 8 warps, a row each
constexpr int kWarps = kThreads / 32;

// Eight consecutive weights as f32 (one 16-byte load for 16-bit types, two for f32).
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float* o) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    o[2 * i] = __uint_as_float(w[i] << 16);
    o[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void load8(const __half* p, float* o) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    o[2 * i] = f.x;
    o[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float* o) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p + 4));
  o[0] = a.x, o[1] = a.y, o[2] = a.z, o[3] = a.w, o[4] = b.x, o[5] = b.y, o[6] = b.z, o[7] = b.w;
}
__device__ __forceinline__ float dot8(const float* w, const float* x) {
  const float4 a = *reinterpret_cast<const float4*>(x), b = *reinterpret_cast<const float4*>(x + 4);
  return w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The kSplit warps of a row add their partial sums through shared memory; lane m of the row's first
// warp gets row m's total (all lanes of the block reach the barrier, live rows or not).
template <int M, int kSplit>
__device__ __forceinline__ void split_sum(float (&acc)[M], int warp, int lane) {
  if constexpr (kSplit > 1) {
    __shared__ float red[kWarps][M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float v = warp_sum(acc[m]);
      if (lane == m) red[warp][m] = v;
    }
    __syncthreads();
    if (lane < M) {
      float v = 0.f;
#pragma unroll
      for (int s = 0; s < kSplit; ++s) v += red[warp - warp % kSplit + s][lane];
#pragma unroll
      for (int m = 0; m < M; ++m)
        if (m == lane) acc[m] = v;
    }
  } else {
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = warp_sum(acc[m]);
  }
}

// kSplit warps per output row, each taking every kSplit-th run of 256 weights along K: a product
// with few rows (4096) would otherwise be a single wave of long warps whose ramp-up and drain are
// a third of its time (docs/perf-notes.md, v10 profile).
template <typename WT, int M, int kSplit>
__global__ void __launch_bounds__(kThreads)
    k_gemv(GemvOutputs o, const float* __restrict__ x, int64_t K, bool accumulate, int prefetch) {
  constexpr int kRows = kWarps / kSplit;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, part = warp % kSplit;
  int64_t n = static_cast<int64_t>(blockIdx.x) * kRows + warp / kSplit;
  int64_t total = o.end[0];
#pragma unroll
  for (int i = 1; i < kGemvMaxOutputs; ++i)
    if (i < o.count) total = o.end[i];
  const bool live = n < total;
  if (!live && kSplit == 1) return;
  // The product this row belongs to (several products of one x share the launch).
  // (Constant indices only: a runtime index into the parameter struct would copy it to local memory.)
  const void* wp = o.w[0];
  float* y = o.y[0];
  int64_t start = 0, stop = o.end[0];
#pragma unroll
  for (int i = 1; i < kGemvMaxOutputs; ++i)
    if (i < o.count && n >= o.end[i - 1]) wp = o.w[i], y = o.y[i], start = o.end[i - 1], stop = o.end[i];
  const int64_t N = stop - start;
  n -= start;
  const WT* wr = static_cast<const WT*>(wp) + n * K;
  // The weights do not depend on the kernel before (launch.cuh): the row's first `prefetch` lines
  // of 128 bytes may head for L2 while that kernel finishes, then wait for x.
  if (live && part == 0 && lane < prefetch && lane * 128 < K * static_cast<int64_t>(sizeof(WT)))
    asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(wr) + lane * 128));
  pdl_entry();
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  if (live) {
#pragma unroll 4
    for (int64_t k = (part * 32 + lane) * 8; k < K; k += 256 * kSplit) {
      float wv[8];
      load8(wr + k, wv);
#pragma unroll
      for (int m = 0; m < M; ++m) acc[m] += dot8(wv, x + m * K + k);
    }
  }
  split_sum<M, kSplit>(acc, warp, lane);
  if (!live || part != 0) return;
#pragma unroll
  for (int m = 0; m < M; ++m)
    if (lane == m) y[m * N + n] = accumulate ? y[m * N + n] + acc[m] : acc[m];
}

// h[m, n] = silu(gate[n] . x_m) * (up[n] . x_m): the two rows of n in one warp, so neither product
// is written out and the SiLU-mul is no kernel of its own.
template <typename WT, int M, int kSplit>
__global__ void __launch_bounds__(kThreads)
    k_gemv_swiglu(const WT* __restrict__ gate, const WT* __restrict__ up, const float* __restrict__ x, int64_t N,
                  int64_t K, float* __restrict__ h, int prefetch) {
  constexpr int kRows = kWarps / kSplit;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, part = warp % kSplit;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kRows + warp / kSplit;
  const bool live = n < N;
  if (!live && kSplit == 1) return;
  const WT* wg = gate + n * K;
  const WT* wu = up + n * K;
  if (live && part == 0 && lane < prefetch && lane * 128 < K * static_cast<int64_t>(sizeof(WT))) {  // as in k_gemv
    asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(wg) + lane * 128));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(wu) + lane * 128));
  }
  pdl_entry();
  float ag[M], au[M];
#pragma unroll
  for (int m = 0; m < M; ++m) ag[m] = au[m] = 0.f;
  if (live) {
#pragma unroll 2
    for (int64_t k = (part * 32 + lane) * 8; k < K; k += 256 * kSplit) {
      float a[8], b[8];
      load8(wg + k, a);
      load8(wu + k, b);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        ag[m] += dot8(a, x + m * K + k);
        au[m] += dot8(b, x + m * K + k);
      }
    }
  }
  split_sum<M, kSplit>(ag, warp, lane);
  if constexpr (kSplit > 1) __syncthreads();  // the shared partial sums are reused for up
  split_sum<M, kSplit>(au, warp, lane);
  if (!live || part != 0) return;
#pragma unroll
  for (int m = 0; m < M; ++m)
    if (lane == m) h[m * N + n] = silu(ag[m]) * au[m];
}

// h[slot, n] = silu(gate_e[n] . x_t) * (up_e[n] . x_t) (RELU2: relu(up_e[n] . x_t)^2) for slot =
// order[blockIdx.x] (slots grouped by expert, so blocks running together read the same expert's
// rows: L2 serves the repeats).
template <typename WT, bool RELU2>
__global__ void __launch_bounds__(kThreads)
    k_moe_gate_up(const WT* const* __restrict__ gate, const WT* const* __restrict__ up, const float* __restrict__ x,
                  const int32_t* __restrict__ sel, const int32_t* __restrict__ order, int top_k, int64_t H, int64_t I,
                  float* __restrict__ h) {
  pdl_entry();
  const int32_t slot = order[blockIdx.x];
  const int e = sel[slot];
  const int64_t n = static_cast<int64_t>(blockIdx.y) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= I) return;
  const WT* wu = up[e] + n * H;
  const float* xr = x + static_cast<int64_t>(slot / top_k) * H;
  if constexpr (RELU2) {
    float au = 0.f;
#pragma unroll 2
    for (int64_t k = lane * 8; k < H; k += 256) {
      float b[8];
      load8(wu + k, b);
      au += dot8(b, xr + k);
    }
    au = fmaxf(warp_sum(au), 0.f);
    if (lane == 0) h[static_cast<int64_t>(slot) * I + n] = au * au;
    return;
  } else {
    const WT* wg = gate[e] + n * H;
    float ag = 0.f, au = 0.f;
#pragma unroll 2
    for (int64_t k = lane * 8; k < H; k += 256) {
      float a[8], b[8];
      load8(wg + k, a);
      load8(wu + k, b);
      ag += dot8(a, xr + k);
      au += dot8(b, xr + k);
    }
    ag = warp_sum(ag);
    au = warp_sum(au);
    if (lane == 0) h[static_cast<int64_t>(slot) * I + n] = silu(ag) * au;
  }
}

// ys[slot, n] = down_e[n] . h[slot]
template <typename WT>
__global__ void __launch_bounds__(kThreads)
    k_moe_down(const WT* const* __restrict__ down, const float* __restrict__ h, const int32_t* __restrict__ sel,
               const int32_t* __restrict__ order, int64_t H, int64_t I, float* __restrict__ ys) {
  pdl_entry();
  const int32_t slot = order[blockIdx.x];
  const int e = sel[slot];
  const int64_t n = static_cast<int64_t>(blockIdx.y) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= H) return;
  const WT* wd = down[e] + n * I;
  const float* hr = h + static_cast<int64_t>(slot) * I;
  float acc = 0.f;
#pragma unroll 2
  for (int64_t k = lane * 8; k < I; k += 256) {
    float a[8];
    load8(wd + k, a);
    acc += dot8(a, hr + k);
  }
  acc = warp_sum(acc);
  if (lane == 0) ys[static_cast<int64_t>(slot) * H + n] = acc;
}

// order[offset of expert e + rank] = slot: each block scans the counts (E <= 1024) and places its
// share of the slots (a prefill call's 65k slots took ~0.12 ms on one block).
__global__ void k_moe_order(const int32_t* sel, const int32_t* rank, const int32_t* counts, int E, int64_t n,
                            int32_t* order, int32_t* offsets, int32_t* pos) {
  pdl_entry();
  __shared__ int32_t off[1024];
  if (threadIdx.x == 0) {
    int32_t acc = 0;
    for (int e = 0; e < E; ++e) {
      off[e] = acc;
      acc += counts[e];
    }
  }
  __syncthreads();
  if (offsets && blockIdx.x == 0)
    for (int e = threadIdx.x; e < E; e += blockDim.x) offsets[e] = off[e];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t p = off[sel[i]] + rank[i];
    order[p] = static_cast<int32_t>(i);
    if (pos) pos[i] = p;
  }
}

// Lines of 128 bytes per weight row sent to L2 before a GEMV waits for its input (launch.cuh):
// none by default, HYPIC_GEMV_PREFETCH=N (0..32) to measure. On the 9B decode step 2 KB per row
// measured no faster than none (5.88 vs 5.82 ms, one run each, docs/perf-notes.md v10).
int prefetch_lines() {
  static const int n = [] {
    const char* e = std::getenv("HYPIC_GEMV_PREFETCH");
    return e && *e ? std::clamp(std::atoi(e), 0, 32) : 0;
  }();
  return n;
}

// f(std::integral_constant<int, M>) for the row counts the few-row kernels are instantiated for.
template <typename F>
void with_rows(int64_t M, const char* what, F&& f) {
  switch (M) {
#define HYPIC_GEMV_CASE(m)               \
  case m:                                \
    f(std::integral_constant<int, m>{}); \
    break;
    HYPIC_GEMV_CASE(1)
    HYPIC_GEMV_CASE(2)
    HYPIC_GEMV_CASE(3)
    HYPIC_GEMV_CASE(4)
    HYPIC_GEMV_CASE(5)
    HYPIC_GEMV_CASE(6)
    HYPIC_GEMV_CASE(7)
    HYPIC_GEMV_CASE(8)
#undef HYPIC_GEMV_CASE
    default:
      throw std::logic_error(std::string(what) + ": at most 8 rows");
  }
}

// f(std::integral_constant<int, S>) for the split factors the kernels are instantiated for.
template <typename F>
void with_split(int split, F&& f) {
  switch (split) {
    case 1:
      f(std::integral_constant<int, 1>{});
      break;
    case 2:
      f(std::integral_constant<int, 2>{});
      break;
    case 4:
      f(std::integral_constant<int, 4>{});
      break;
    default:
      f(std::integral_constant<int, 8>{});
      break;
  }
}

int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return std::max(v, 1);
  }();
  return n;
}

int forced_split = 0;  // set_gemv_split(); 0: HYPIC_GEMV_SPLIT or the rule below

// Warps per output row: enough warps for about two waves of a full SM (64 warps each) however few
// the rows, while every warp keeps at least four runs of 256 weights (one unrolled round).
int split_for(int64_t rows, int64_t K) {
  static const int env = [] {
    const char* e = std::getenv("HYPIC_GEMV_SPLIT");
    return e && *e ? std::atoi(e) : 0;
  }();
  int s = forced_split ? forced_split : env;
  if (s <= 0) {
    const int64_t target = static_cast<int64_t>(sm_count()) * 128;
    s = 1;
    while (s < kWarps && rows * s * 2 <= target && K >= 256 * 4 * s * 2) s *= 2;
  }
  return s >= 8 ? 8 : s >= 4 ? 4 : s >= 2 ? 2 : 1;
}

template <typename WT>
void gemv_t(cudaStream_t s, const GemvOutputs& o, const float* x, int64_t M, int64_t K, bool acc) {
  const int64_t rows = o.end[o.count - 1];
  const int split = split_for(rows, K);
  const unsigned blocks = static_cast<unsigned>((rows * split + kWarps - 1) / kWarps);
  with_rows(M, "gemv", [&](auto m) {
    with_split(split, [&](auto sp) {
      launch(s, blocks, kThreads, 0, k_gemv<WT, decltype(m)::value, decltype(sp)::value>, o, x, K, acc,
             prefetch_lines());
    });
  });
  CUDA_LAUNCH_CHECK("k_gemv");
}

template <typename WT>
void gemv_swiglu_t(cudaStream_t s, const void* gate, const void* up, const float* x, float* h, int64_t M, int64_t N,
                   int64_t K) {
  const int split = split_for(N, K);
  const unsigned blocks = static_cast<unsigned>((N * split + kWarps - 1) / kWarps);
  const auto* g = static_cast<const WT*>(gate);
  const auto* u = static_cast<const WT*>(up);
  with_rows(M, "gemv_swiglu", [&](auto m) {
    with_split(split, [&](auto sp) {
      launch(s, blocks, kThreads, 0, k_gemv_swiglu<WT, decltype(m)::value, decltype(sp)::value>, g, u, x, N, K, h,
             prefetch_lines());
    });
  });
  CUDA_LAUNCH_CHECK("k_gemv_swiglu");
}

template <typename WT>
void moe_t(cudaStream_t s, const void* const* gate, const void* const* up, const void* const* down, const float* x,
           const int32_t* sel, const int32_t* order, int64_t slots, int top_k, int64_t H, int64_t I, float* h,
           float* ys) {
  const auto* g = reinterpret_cast<const WT* const*>(gate);
  const auto* u = reinterpret_cast<const WT* const*>(up);
  const auto* d = reinterpret_cast<const WT* const*>(down);
  const dim3 grid(static_cast<unsigned>(slots), static_cast<unsigned>((I + kWarps - 1) / kWarps));
  if (g)
    launch(s, grid, kThreads, 0, k_moe_gate_up<WT, false>, g, u, x, sel, order, top_k, H, I, h);
  else
    launch(s, grid, kThreads, 0, k_moe_gate_up<WT, true>, g, u, x, sel, order, top_k, H, I, h);
  CUDA_LAUNCH_CHECK("k_moe_gate_up");
  launch(s, dim3(static_cast<unsigned>(slots), static_cast<unsigned>((H + kWarps - 1) / kWarps)), kThreads, 0,
         k_moe_down<WT>, d, h, sel, order, H, I, ys);
  CUDA_LAUNCH_CHECK("k_moe_down");
}

}  // namespace

void set_gemv_split(int split) {
  forced_split = split;
}

bool gemv_supported(DType wdt, int64_t M, int64_t K, const void* w, const float* x) {
  const bool type_ok = wdt == DType::BF16 || wdt == DType::F16 || wdt == DType::F32;
  return type_ok && M >= 1 && M <= kGemvMaxRows && K % 8 == 0 && (reinterpret_cast<uintptr_t>(w) & 15u) == 0 &&
         (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
}

void launch_gemv(cudaStream_t s, const void* w, DType wdt, const float* x, float* y, int64_t M, int64_t N, int64_t K,
                 bool accumulate) {
  GemvOutputs o;
  o.w[0] = w;
  o.y[0] = y;
  o.end[0] = N;
  o.count = 1;
  launch_gemv_many(s, o, wdt, x, M, K, accumulate);
}

void launch_gemv_many(cudaStream_t s, const GemvOutputs& o, DType wdt, const float* x, int64_t M, int64_t K,
                      bool accumulate) {
  if (M == 0 || o.count == 0 || o.end[o.count - 1] == 0) return;
  if (wdt == DType::BF16)
    gemv_t<__nv_bfloat16>(s, o, x, M, K, accumulate);
  else if (wdt == DType::F16)
    gemv_t<__half>(s, o, x, M, K, accumulate);
  else
    gemv_t<float>(s, o, x, M, K, accumulate);
}

void launch_gemv_swiglu(cudaStream_t s, const void* gate, const void* up, DType wdt, const float* x, float* h,
                        int64_t M, int64_t N, int64_t K) {
  if (M == 0 || N == 0) return;
  if (wdt == DType::BF16)
    gemv_swiglu_t<__nv_bfloat16>(s, gate, up, x, h, M, N, K);
  else if (wdt == DType::F16)
    gemv_swiglu_t<__half>(s, gate, up, x, h, M, N, K);
  else
    gemv_swiglu_t<float>(s, gate, up, x, h, M, N, K);
}

void launch_moe_order(cudaStream_t s, const int32_t* sel, const int32_t* rank, const int32_t* counts, int64_t E,
                      int64_t n, int32_t* order, int32_t* offsets, int32_t* pos) {
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 1023) / 1024, 132));
  launch(s, blocks, 1024, 0, k_moe_order, sel, rank, counts, static_cast<int>(E), n, order, offsets, pos);
  CUDA_LAUNCH_CHECK("k_moe_order");
}

void launch_moe_gemv(cudaStream_t s, DType wdt, const void* const* gate, const void* const* up, const void* const* down,
                     const float* x, const int32_t* sel, const int32_t* order, int64_t slots, int top_k, int64_t H,
                     int64_t I, float* h, float* ys) {
  if (slots == 0) return;
  if (wdt == DType::BF16)
    moe_t<__nv_bfloat16>(s, gate, up, down, x, sel, order, slots, top_k, H, I, h, ys);
  else if (wdt == DType::F16)
    moe_t<__half>(s, gate, up, down, x, sel, order, slots, top_k, H, I, h, ys);
  else
    moe_t<float>(s, gate, up, down, x, sel, order, slots, top_k, H, I, h, ys);
}

}  // namespace hypic::cuda
