// MoE expert products for prefill-sized batches (thousands to hundreds of thousands of slots): a
// grouped GEMM on the tensor cores over the slots sorted by expert, written here because cuBLAS's
// grouped GEMMs take their sizes from the host (a sync per layer) and its batched products pad
// every expert to the busiest one's rows. Each block owns one expert's tile of 128 slots x 128
// output columns; the tiles of all experts form one grid, mapped to (expert, M tile) by a prefix
// over the experts' tile counts (k_moe_tiles), on the device. Operands are 16-bit (the slots'
// rows gathered by index straight from a 16-bit copy of x, so no gathered copy is made), with f32
// accumulation in m16n8k16 mma.sync, three cp.async stages of 64 columns of K in flight.
// GATE_UP: a block's columns are 64 of gate then the same 64 of up and it writes
// silu(gate) * up in 16 bits (the down product's operand); else 128 columns of down, f32, for
// launch_moe_combine. On Hopper, bf16 weights go to k_moe_gemm_wg (the same tiles on wgmma); this
// kernel serves f16 weights and other GPUs and is its reference. moe.cu's few-slot kernels and
// cuBLAS's batched products stay as the reference (MoeExperts in cuda_ops_test runs every path
// against the CPU).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <stdexcept>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/wgmma.cuh"

namespace hypic::cuda {

namespace {

// 128-slot M tiles, 8 warps of 64 x 32. Tried: 64-slot tiles with 4 warps (less of a partial last
// tile wasted at ~256 slots an expert): gate+up 455 -> 554 ms per two 32k forwards, slower.
constexpr int kBM = 128, kBN = 128, kBK = 64, kStages = 3, kThreads = 256;
constexpr int kLd = kBK + 8;  // padded 16-bit row stride of a stage's tiles: conflict-free ldmatrix
constexpr size_t kStageBytes = static_cast<size_t>(kBM + kBN) * kLd * 2;
constexpr size_t kSmem = kStages * kStageBytes;
constexpr int kLdy = kBN + 4;  // f32 row stride of the gate/up epilogue's staging
static_assert(static_cast<size_t>(kBM) * kLdy * 4 <= kSmem, "epilogue staging fits in the stages");

// tile_start[e] = sum over e' < e of ceil(counts[e'] / kBM); tile_start[E] = the total.
__global__ void k_moe_tiles(const int32_t* counts, int E, int32_t* tile_start) {
  pdl_entry();
  if (threadIdx.x != 0) return;
  int32_t acc = 0;
  for (int e = 0; e < E; ++e) {
    tile_start[e] = acc;
    acc += (counts[e] + kBM - 1) / kBM;
  }
  tile_start[E] = acc;
}

template <typename Wt, bool GATE_UP>
__global__ void __launch_bounds__(kThreads, 2)
    k_moe_gemm(const Wt* __restrict__ a, const int32_t* __restrict__ order, const int32_t* __restrict__ offsets,
               const int32_t* __restrict__ counts, const int32_t* __restrict__ tile_start, int E,
               const void* const* __restrict__ w0, const void* const* __restrict__ w1, int top_k, int64_t K, int64_t N,
               void* __restrict__ yp) {
  pdl_entry();
  constexpr bool F16 = std::is_same_v<Wt, __half>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ int32_t arow[kBM];  // the A row of each tile row, -1 past the expert's slots
  __shared__ int s_e;
  const int b = blockIdx.x, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4, mi = lane / 8, mr = lane % 8;
  if (tid == 0) {  // the expert of tile b: the last e with tile_start[e] <= b (empty experts share starts)
    int e = -1;
    if (b < tile_start[E]) {
      int lo = 0, hi = E - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tile_start[mid] <= b)
          lo = mid;
        else
          hi = mid - 1;
      }
      e = lo;
    }
    s_e = e;
  }
  __syncthreads();
  const int e = s_e;
  if (e < 0) return;
  const int m0 = (b - tile_start[e]) * kBM, off = offsets[e];
  const int mrows = min(kBM, counts[e] - m0);
  if (tid < kBM) arow[tid] = tid < mrows ? (GATE_UP ? order[off + m0 + tid] / top_k : off + m0 + tid) : -1;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * (GATE_UP ? kBN / 2 : kBN);
  const Wt* W0 = static_cast<const Wt*>(w0[e]);
  const Wt* W1 = GATE_UP ? static_cast<const Wt*>(w1[e]) : W0;
  const int nk = static_cast<int>((K + kBK - 1) / kBK);
  __syncthreads();

  // Stage st <- columns [it * kBK, +kBK) of the tile's A rows and weight rows (zeros past the
  // slots, N and K); a commit group either way, so the group count stays in step.
  auto load = [&](int it, int st) {
    if (it < nk) {
      const int64_t kc = static_cast<int64_t>(it) * kBK;
      Wt* As = reinterpret_cast<Wt*>(smem_raw + st * kStageBytes);
      Wt* Bs = As + kBM * kLd;
#pragma unroll
      for (int c = tid; c < kBM * (kBK / 8); c += kThreads) {
        const int r = c / (kBK / 8), kk = 8 * (c % (kBK / 8));
        const int row = arow[r];
        const bool ok = row >= 0 && kc + kk < K;
        cp_async16(As + r * kLd + kk, ok ? a + row * K + kc + kk : a, ok);
      }
#pragma unroll
      for (int c = tid; c < kBN * (kBK / 8); c += kThreads) {
        const int r = c / (kBK / 8), kk = 8 * (c % (kBK / 8));
        const int64_t n = n0 + (GATE_UP ? r % (kBN / 2) : r);
        const Wt* src = GATE_UP && r >= kBN / 2 ? W1 : W0;
        const bool ok = n < N && kc + kk < K;
        cp_async16(Bs + r * kLd + kk, ok ? src + n * K + kc + kk : src, ok);
      }
    }
    cp_async_commit();
  };

  // Warp tile: 64 rows (wm) x 32 columns (wn): 4 x 4 m16n8 accumulators.
  const int wm = warp / 4, wn = warp % 4;
  float acc[4][4][4] = {};
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) load(st, st);
  for (int it = 0; it < nk; ++it) {
    cp_async_wait_group<kStages - 2>();
    __syncthreads();  // stage it landed; every warp is done with the stage the next load refills
    load(it + kStages - 1, (it + kStages - 1) % kStages);
    const Wt* As = reinterpret_cast<const Wt*>(smem_raw + (it % kStages) * kStageBytes);
    const Wt* Bs = As + kBM * kLd;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t af[4][4], bf[4][2];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
        ldmatrix_x4(af[mt][0], af[mt][1], af[mt][2], af[mt][3],
                    As + (wm * 64 + mt * 16 + (mi & 1) * 8 + mr) * kLd + kk + (mi >> 1) * 8);
#pragma unroll
      for (int nt = 0; nt < 4; nt += 2)
        ldmatrix_x4(bf[nt][0], bf[nt][1], bf[nt + 1][0], bf[nt + 1][1],
                    Bs + (wn * 32 + (nt + (mi >> 1)) * 8 + mr) * kLd + kk + (mi & 1) * 8);
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          mma16816<F16>(acc[mt][nt], af[mt][0], af[mt][1], af[mt][2], af[mt][3], bf[nt][0], bf[nt][1]);
    }
  }
  cp_async_wait_group<0>();
  if constexpr (GATE_UP) {
    __syncthreads();                                 // every warp is done with the stages: they stage the outputs now
    float* Ys = reinterpret_cast<float*>(smem_raw);  // [kBM][kLdy]: gate columns, then up
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int r = wm * 64 + mt * 16 + g, c = wn * 32 + nt * 8 + 2 * t4;
        *reinterpret_cast<float2*>(Ys + r * kLdy + c) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
        *reinterpret_cast<float2*>(Ys + (r + 8) * kLdy + c) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
      }
    __syncthreads();
    Wt* h = static_cast<Wt*>(yp);
    constexpr int half = kBN / 2;
    for (int c = tid; c < mrows * (half / 2); c += kThreads) {
      const int m = c / (half / 2), j = 2 * (c % (half / 2));
      if (n0 + j >= N) continue;  // N % 8 == 0: a pair is all in or all out
      const float v0 = silu(Ys[m * kLdy + j]) * Ys[m * kLdy + half + j];
      const float v1 = silu(Ys[m * kLdy + j + 1]) * Ys[m * kLdy + half + j + 1];
      *reinterpret_cast<uint32_t*>(h + static_cast<int64_t>(off + m0 + m) * N + n0 + j) = pack2<F16>(v0, v1);
    }
  } else {
    float* y = static_cast<float*>(yp);
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int r = wm * 64 + mt * 16 + g;
        const int64_t c = n0 + wn * 32 + nt * 8 + 2 * t4;
        if (c >= N) continue;
        if (r < mrows)
          *reinterpret_cast<float2*>(y + static_cast<int64_t>(off + m0 + r) * N + c) =
              make_float2(acc[mt][nt][0], acc[mt][nt][1]);
        if (r + 8 < mrows)
          *reinterpret_cast<float2*>(y + static_cast<int64_t>(off + m0 + r + 8) * N + c) =
              make_float2(acc[mt][nt][2], acc[mt][nt][3]);
      }
  }
}

// The same on Hopper's warpgroup MMA (bf16 weights): a stage is one 128B-swizzled atom column
// (64 of K) of the 128 A rows and of the 128 weight rows (wgmma.cuh), each warpgroup multiplies
// its 64 rows by all 128 columns (m64n128k16, both operands K-major in shared memory, nothing
// through registers but the accumulators), S stages of K tiles with S - 2 loading ahead. The
// gate/up epilogue needs no staging: a thread's gate column c and up column c + 64 are in its own
// accumulators.
constexpr uint32_t kWgTile = kBM * 128;  // bytes of 128 rows x 64 bf16
// Three stages, two blocks a multiprocessor. Tried: six stages (four tiles ahead), one block a
// multiprocessor: gate+up 188 -> 215 ms a 35B-A3B 32k forward, slower.
constexpr int kWgStages = 3;
template <int S>
constexpr size_t wg_smem() {
  return S * 2 * kWgTile + 1024;
}
static_assert(kBM == kBN && kBK == 64, "a stage's A and B tiles are one atom column each");

template <bool GATE_UP, int S>
__global__ void __launch_bounds__(kThreads, S <= 3 ? 2 : 1)
    k_moe_gemm_wg(const __nv_bfloat16* __restrict__ a, const int32_t* __restrict__ order,
                  const int32_t* __restrict__ offsets, const int32_t* __restrict__ counts,
                  const int32_t* __restrict__ tile_start, int E, const void* const* __restrict__ w0,
                  const void* const* __restrict__ w1, int top_k, int64_t K, int64_t N, void* __restrict__ yp) {
#if HYPIC_WGMMA
  pdl_entry();
  using Wt = __nv_bfloat16;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const base =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  __shared__ int32_t arow[kBM];
  __shared__ int s_e;
  const int b = blockIdx.x, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4, wgi = warp / 4;
  if (tid == 0) {
    int e = -1;
    if (b < tile_start[E]) {
      int lo = 0, hi = E - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tile_start[mid] <= b)
          lo = mid;
        else
          hi = mid - 1;
      }
      e = lo;
    }
    s_e = e;
  }
  __syncthreads();
  const int e = s_e;
  if (e < 0) return;
  const int m0 = (b - tile_start[e]) * kBM, off = offsets[e];
  const int mrows = min(kBM, counts[e] - m0);
  if (tid < kBM) arow[tid] = tid < mrows ? (GATE_UP ? order[off + m0 + tid] / top_k : off + m0 + tid) : -1;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * (GATE_UP ? kBN / 2 : kBN);
  const Wt* W0 = static_cast<const Wt*>(w0[e]);
  const Wt* W1 = GATE_UP ? static_cast<const Wt*>(w1[e]) : W0;
  const int nk = static_cast<int>((K + kBK - 1) / kBK);
  __syncthreads();

  auto load = [&](int it, int st) {
    if (it < nk) {
      const int64_t kc = static_cast<int64_t>(it) * kBK;
      unsigned char* As = base + st * 2 * kWgTile;
      unsigned char* Bs = As + kWgTile;
#pragma unroll
      for (int c = tid; c < kBM * 8; c += kThreads) {
        const int r = c / 8, ch = c % 8;
        const int row = arow[r];
        const bool ok = row >= 0 && kc + 8 * ch < K;
        cp_async16(As + wg::swz(r, ch), ok ? a + row * K + kc + 8 * ch : a, ok);
      }
#pragma unroll
      for (int c = tid; c < kBN * 8; c += kThreads) {
        const int r = c / 8, ch = c % 8;
        const int64_t n = n0 + (GATE_UP ? r % (kBN / 2) : r);
        const Wt* src = GATE_UP && r >= kBN / 2 ? W1 : W0;
        const bool ok = n < N && kc + 8 * ch < K;
        cp_async16(Bs + wg::swz(r, ch), ok ? src + n * K + kc + 8 * ch : src, ok);
      }
    }
    cp_async_commit();
  };

  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    // S - 2 tiles ahead: the stage refilled at iteration it held tile it - 2, whose products every
    // warpgroup has waited for (wait<1> below) before this iteration's barrier.
#pragma unroll
  for (int st = 0; st < S - 2; ++st) load(st, st);
  for (int it = 0; it < nk; ++it) {
    cp_async_wait_group<S - 3>();
    wg::fence_proxy_async();
    __syncthreads();  // tile it landed; every warpgroup is done with the products of tile it - 2
    load(it + S - 2, (it + S - 2) % S);
    const unsigned char* As = base + (it % S) * 2 * kWgTile;
    const unsigned char* Bs = As + kWgTile;
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk)
      wg::ss_m64n128k16(acc, wg::desc(As + wgi * 64 * 128 + kk * 32, 16, 1024), wg::desc(Bs + kk * 32, 16, 1024), 1);
    wg::commit();
    wg::wait<1>();  // the products of tile it - 1 are done: its stage may be refilled after the next barrier
  }
  wg::wait<0>();
  wg::fence_operand(acc);
  // acc[4j + e]: row 64 wgi + 16 (warp % 4) + g (+8 for e >= 2), column 8j + 2 t4 + (e & 1).
  const int r0 = wgi * 64 + (warp % 4) * 16 + g;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r0 + 8 * half;
    if (r >= mrows) continue;
    if constexpr (GATE_UP) {
      Wt* h = static_cast<Wt*>(yp) + static_cast<int64_t>(off + m0 + r) * N;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int64_t c = n0 + 8 * j + 2 * t4;
        if (c >= N) continue;  // N % 8 == 0: a pair is all in or all out
        const float v0 = silu(acc[4 * j + 2 * half]) * acc[4 * (j + 8) + 2 * half];
        const float v1 = silu(acc[4 * j + 2 * half + 1]) * acc[4 * (j + 8) + 2 * half + 1];
        *reinterpret_cast<uint32_t*>(h + c) = pack2(v0, v1);
      }
    } else {
      float* y = static_cast<float*>(yp) + static_cast<int64_t>(off + m0 + r) * N;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int64_t c = n0 + 8 * j + 2 * t4;
        if (c < N) *reinterpret_cast<float2*>(y + c) = make_float2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
      }
    }
  }
#endif
}

int64_t wg_launches = 0;  // moe_wgmma_launches
int wg_set = -1;          // set_moe_wgmma: -1 default (HYPIC_MOE_WGMMA, else on), 0 off, 1 on
bool use_wgmma() {
  static const int env = [] {
    const char* v = std::getenv("HYPIC_MOE_WGMMA");
    return v ? std::atoi(v) : -1;
  }();
  const int mode = wg_set != -1 ? wg_set : env;
  return mode != 0 && wgmma_available();
}

template <bool GATE_UP, int S>
void run_wg(cudaStream_t s, dim3 grid, const __nv_bfloat16* a, const int32_t* order, const int32_t* offsets,
            const int32_t* counts, const int32_t* tile_start, int E, const void* const* w0, const void* const* w1,
            int top_k, int64_t K, int64_t N, void* y) {
  static const bool sized = [] {
    CUDA_CHECK(cudaFuncSetAttribute(k_moe_gemm_wg<GATE_UP, S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(wg_smem<S>())));
    return true;
  }();
  (void)sized;
  launch(s, grid, kThreads, wg_smem<S>(), k_moe_gemm_wg<GATE_UP, S>, a, order, offsets, counts, tile_start, E, w0, w1,
         top_k, K, N, y);
  CUDA_LAUNCH_CHECK("k_moe_gemm_wg");
}

template <typename Wt, bool GATE_UP>
void run(cudaStream_t s, dim3 grid, const void* a, const int32_t* order, const int32_t* offsets, const int32_t* counts,
         const int32_t* tile_start, int E, const void* const* w0, const void* const* w1, int top_k, int64_t K,
         int64_t N, void* y) {
  if constexpr (std::is_same_v<Wt, __nv_bfloat16>) {
    if (use_wgmma()) {
      ++wg_launches;
      run_wg<GATE_UP, kWgStages>(s, grid, static_cast<const Wt*>(a), order, offsets, counts, tile_start, E, w0, w1,
                                 top_k, K, N, y);
      return;
    }
  }
  static const bool sized = [] {
    CUDA_CHECK(cudaFuncSetAttribute(k_moe_gemm<Wt, GATE_UP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kSmem)));
    return true;
  }();
  (void)sized;
  launch(s, grid, kThreads, kSmem, k_moe_gemm<Wt, GATE_UP>, static_cast<const Wt*>(a), order, offsets, counts,
         tile_start, E, w0, w1, top_k, K, N, y);
  CUDA_LAUNCH_CHECK("k_moe_gemm");
}

}  // namespace

void set_moe_wgmma(int mode) {
  wg_set = mode;
}

int64_t moe_wgmma_launches() {
  return wg_launches;
}

int64_t moe_gemm_max_tiles(int64_t slots, int64_t E) {
  return (slots + kBM - 1) / kBM + E;
}

void launch_moe_tiles(cudaStream_t s, const int32_t* counts, int64_t E, int32_t* tile_start) {
  launch(s, 1, 32, 0, k_moe_tiles, counts, static_cast<int>(E), tile_start);
  CUDA_LAUNCH_CHECK("k_moe_tiles");
}

void launch_moe_gemm(cudaStream_t s, DType wdt, bool gate_up, const void* a, const int32_t* order,
                     const int32_t* offsets, const int32_t* counts, const int32_t* tile_start, int64_t E, int64_t slots,
                     const void* const* w0, const void* const* w1, int top_k, int64_t K, int64_t N, void* y) {
  if (slots == 0) return;
  const dim3 grid(static_cast<unsigned>(moe_gemm_max_tiles(slots, E)),
                  static_cast<unsigned>((N + (gate_up ? kBN / 2 : kBN) - 1) / (gate_up ? kBN / 2 : kBN)));
  const int e = static_cast<int>(E);
  if (wdt == DType::BF16) {
    if (gate_up)
      run<__nv_bfloat16, true>(s, grid, a, order, offsets, counts, tile_start, e, w0, w1, top_k, K, N, y);
    else
      run<__nv_bfloat16, false>(s, grid, a, order, offsets, counts, tile_start, e, w0, w1, top_k, K, N, y);
  } else if (wdt == DType::F16) {
    if (gate_up)
      run<__half, true>(s, grid, a, order, offsets, counts, tile_start, e, w0, w1, top_k, K, N, y);
    else
      run<__half, false>(s, grid, a, order, offsets, counts, tile_start, e, w0, w1, top_k, K, N, y);
  } else {
    throw std::logic_error("moe_gemm: bf16 or f16 weights only");
  }
}

}  // namespace hypic::cuda
