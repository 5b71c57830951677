// Flash attention (prefill) on Hopper's warpgroup MMA: the FlashAttention-2 schedule of
// flash_attention.cu with its products as wgmma. A block owns 128 query rows of one head, two
// warpgroups of 64 rows each; Q (rounded to bf16) and two stages of 64-key K/V tiles sit in
// 128B-swizzled shared memory (wgmma.cuh), S = Q K^T is D / 16 k16 steps of m64n64 read from
// shared memory, the online softmax runs on S's accumulators in registers, and O += P V takes P
// from registers (the accumulator layout is the A-operand layout) and V as an MN-major operand, so
// neither K nor V is ever transposed. The next tile streams in with cp.async while this one
// computes. Masking is the mma.sync kernel's (q_offset + row or the row's own position, kv_len).
// Serves D = Dv in {128, 256} with bf16 k/v, in one-head or packed blocks, with or without a key
// split; the mma.sync kernel serves the rest and is this kernel's reference in the tests.
#include <cuda_bf16.h>

#include <cfloat>
#include <cstdint>
#include <cstdlib>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/wgmma.cuh"

namespace hypic::cuda {

namespace {

constexpr int kBQ = 128, kBK = 64, kThreads = 256;

__global__ void k_wgmma_probe(int* out) {
  *out = HYPIC_WGMMA;
}

template <int DP>
constexpr size_t smem_bytes() {
  // Q: DP/64 atom columns of 128 rows; per stage K and V: DP/64 atom columns of 64 rows; and
  // 1 KiB to align the atoms.
  return static_cast<size_t>(DP / 64) * 128 * (kBQ + 2 * 2 * kBK) + 1024;
}

#if HYPIC_WGMMA  // the helpers of the kernel body, which only the sm_90a image has
// S (keys k0 .. k0 + 63 of rows A and B, raw products) -> P for P V: scaled to the log2 domain,
// masked past each row's limit (mask: the tile reaches some row's limit), the running max and sum
// updated, the probabilities left in s, and the factor the accumulators must be rescaled by
// before P V in cA, cB.
__device__ __forceinline__ void softmax_tile(float (&s)[32], int64_t k0, bool mask, int64_t limA, int64_t limB, int t4,
                                             float scale_log2, float& mA, float& mB, float& lA, float& lB, float& cA,
                                             float& cB) {
  // s[4j + e]: row A (g) for e < 2, row B (g + 8) else; key k0 + 8j + 2 t4 + (e & 1).
  if (mask) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t key = k0 + 8 * j + 2 * t4 + (e & 1);
        s[4 * j + e] = key < (e < 2 ? limA : limB) ? s[4 * j + e] * scale_log2 : -FLT_MAX;
      }
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] *= scale_log2;
  }
  float mxA = -FLT_MAX, mxB = -FLT_MAX;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    mxA = fmaxf(mxA, fmaxf(s[4 * j], s[4 * j + 1]));
    mxB = fmaxf(mxB, fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, off));
    mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, off));
  }
  const float nA = fmaxf(mA, mxA), nB = fmaxf(mB, mxB);
  // A row that has seen no key yet keeps max -FLT_MAX; its probabilities stay 0.
  cA = nA == -FLT_MAX ? 1.f : exp2f(mA - nA);
  cB = nB == -FLT_MAX ? 1.f : exp2f(mB - nB);
  mA = nA;
  mB = nB;
  float sumA = 0.f, sumB = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    s[4 * j] = s[4 * j] == -FLT_MAX ? 0.f : exp2f(s[4 * j] - nA);
    s[4 * j + 1] = s[4 * j + 1] == -FLT_MAX ? 0.f : exp2f(s[4 * j + 1] - nA);
    s[4 * j + 2] = s[4 * j + 2] == -FLT_MAX ? 0.f : exp2f(s[4 * j + 2] - nB);
    s[4 * j + 3] = s[4 * j + 3] == -FLT_MAX ? 0.f : exp2f(s[4 * j + 3] - nB);
    sumA += s[4 * j] + s[4 * j + 1];
    sumB += s[4 * j + 2] + s[4 * j + 3];
  }
  lA = lA * cA + sumA;
  lB = lB * cB + sumB;
}

// P as the A operand of P V (p[4 ks ..]: keys 16 ks ..): two 8-key column groups of S's
// accumulators in bf16.
__device__ __forceinline__ void pack_p(const float (&s)[32], uint32_t (&p)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) p[i] = pack2(s[2 * i], s[2 * i + 1]);
}
#endif

// Tried: FlashAttention-3's schedule inside a warpgroup (S of the next key tile issued before P V
// of this one, its softmax overlapping P V; K a tile ahead of V): 293 against 243 ms of attention
// a 35B-A3B 32k forward, slower; the two warpgroups of a block already overlap each other's
// softmax with their products.
// PACK and key splits as in flash_attention.cu: a block's 128 rows are 128 / G query rows times
// the G query heads of one kv head; blockIdx.z takes the keys [z chunk, (z + 1) chunk) and writes
// partial (max, sum, accumulator) triples for the merge kernel.
template <int DP, bool PACK>
__global__ void __launch_bounds__(kThreads, 1)
    k_flash_wg(const float* __restrict__ q, const __nv_bfloat16* __restrict__ kh, const __nv_bfloat16* __restrict__ vh,
               int64_t T, int64_t Hq, int64_t Hkv, int64_t kv_len, int64_t q_offset, const int64_t* __restrict__ qpos,
               int64_t chunk, float scale_log2, float* __restrict__ out, float* __restrict__ part_ml,
               float* __restrict__ part_acc) {
#if HYPIC_WGMMA
  constexpr int NA = DP / 64;                         // atom columns along the head dim
  constexpr uint32_t QA = kBQ * 128, KA = kBK * 128;  // bytes of one atom column of Q, of K or V
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const base =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* const Qs = base;
  unsigned char* const KV0 = base + NA * QA;  // stage st: K at KV0 + st * 2 * NA * KA, V after it
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int wgi = warp / 4;  // warpgroup: rows 64 * wgi ..
  const int G = static_cast<int>(Hq / Hkv);
  const int64_t rows = PACK ? kBQ / G : kBQ;  // query rows of this block
  // Heavy (late, causal) row blocks first, so the short ones fill the tail.
  const int64_t q0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * rows;
  const int64_t hk = PACK ? blockIdx.y : blockIdx.y / G;
  // Tensor-core row p of the block: its query row and head.
  auto row_of = [&](int p) -> int64_t { return PACK ? q0 + p / G : q0 + p; };
  auto head_of = [&](int p) -> int64_t { return PACK ? hk * G + p % G : blockIdx.y; };

  auto lim = [&](int64_t row) -> int64_t {  // one past the last key `row` sees
    if (row >= T) return qpos ? 0 : min(kv_len, q_offset + row + 1);
    return min(kv_len, (qpos ? qpos[row] : q_offset + row) + 1);
  };
  // This block's split of the keys: [k_lo, blk_hi).
  const int64_t k_lo = static_cast<int64_t>(blockIdx.z) * chunk;
  const int64_t blk_hi = min(lim(min(T, q0 + rows) - 1), k_lo + chunk);
  const int64_t wg_first = row_of(64 * wgi), wg_end = row_of(64 * wgi + 63);
  const int64_t wg_hi = wg_first < T ? lim(min(T - 1, wg_end)) : 0;
  // Keys below every row's limit need no mask (positions are nondecreasing; rows past T of a
  // positioned call see nothing, so their warpgroup always masks).
  const int64_t wg_lo = wg_first < T ? (qpos && wg_end >= T ? 0 : lim(wg_first)) : 0;
  const int pA = 64 * wgi + 16 * (warp % 4) + g;
  const int64_t rowA = row_of(pA), rowB = row_of(pA + 8), hA = head_of(pA), hB = head_of(pA + 8);
  const int64_t limA = lim(rowA), limB = lim(rowB);

  // K/V tile at k0 into stage st (rows past kv_len zero-filled).
  auto load = [&](int64_t k0, int st) {
    unsigned char* Kt = KV0 + st * 2 * NA * KA;
    unsigned char* Vt = Kt + NA * KA;
    for (int e = tid; e < kBK * DP / 8; e += kThreads) {
      const int j = e / (DP / 8), c = e % (DP / 8);
      const int64_t key = k0 + j;
      const bool ok = key < kv_len;
      const uint32_t off = (c / 8) * KA + wg::swz(j, c % 8);
      const int64_t src = (key * Hkv + hk) * DP + c * 8;
      cp_async16(Kt + off, ok ? kh + src : kh, ok);
      cp_async16(Vt + off, ok ? vh + src : vh, ok);
    }
    cp_async_commit();
  };
  if (blk_hi > k_lo) load(k_lo, 0);
  // Q's tile, f32 -> bf16, 8 elements (one swizzled chunk) per step.
  for (int e = tid; e < kBQ * DP / 8; e += kThreads) {
    const int r = e / (DP / 8), c = e % (DP / 8);
    const int64_t row = row_of(r);
    uint4 pk = make_uint4(0, 0, 0, 0);
    if (row < T) {
      const float4* src = reinterpret_cast<const float4*>(q + (row * Hq + head_of(r)) * DP + c * 8);
      const float4 x0 = src[0], x1 = src[1];
      pk = make_uint4(pack2(x0.x, x0.y), pack2(x0.z, x0.w), pack2(x1.x, x1.y), pack2(x1.z, x1.w));
    }
    *reinterpret_cast<uint4*>(Qs + (c / 8) * QA + wg::swz(r, c % 8)) = pk;
  }

  constexpr int NH = DP / 128;  // m64n128 products per k16 step of P V
  float o[NH][64];
#pragma unroll
  for (int n = 0; n < NH; ++n)
#pragma unroll
    for (int i = 0; i < 64; ++i) o[n][i] = 0.f;
  float mA = -FLT_MAX, mB = -FLT_MAX, lA = 0.f, lB = 0.f, cA = 1.f, cB = 1.f;
  float s[32];
  uint32_t p[16];

  int it = 0;
  for (int64_t k0 = k_lo; k0 < blk_hi; k0 += kBK, ++it) {
    cp_async_wait_all();
    wg::fence_proxy_async();
    __syncthreads();  // tile k0 (and Q) landed; every warpgroup is done with the other stage
    if (k0 + kBK < blk_hi) load(k0 + kBK, (it + 1) & 1);
    if (k0 >= wg_hi) continue;  // every row of this warpgroup is done
    const unsigned char* Ks = KV0 + (it & 1) * 2 * NA * KA;
    const unsigned char* Vs = Ks + NA * KA;
    // S = Q K^T: k16 steps walk 32 bytes inside an atom column, then the next atom column.
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      const uint32_t off = (kk % 4) * 32;
      wg::ss_m64n64k16(s, wg::desc(Qs + (kk / 4) * QA + wgi * 64 * 128 + off, 16, 1024),
                       wg::desc(Ks + (kk / 4) * KA + off, 16, 1024), kk > 0);
    }
    wg::commit();
    wg::wait<0>();
    wg::fence_operand(s);
    softmax_tile(s, k0, k0 + kBK > wg_lo, limA, limB, t4, scale_log2, mA, mB, lA, lB, cA, cB);
#pragma unroll
    for (int n = 0; n < NH; ++n)
#pragma unroll
      for (int i = 0; i < 64; i += 4) {
        o[n][i] *= cA;
        o[n][i + 1] *= cA;
        o[n][i + 2] *= cB;
        o[n][i + 3] *= cB;
      }
    pack_p(s, p);
    // O += P V, 16 keys a step; V's tile is the MN-major operand (LBO: the next 64 columns).
#pragma unroll
    for (int n = 0; n < NH; ++n) wg::fence_operand(o[n]);
    wg::fence();
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks)
#pragma unroll
      for (int n = 0; n < NH; ++n)
        wg::rs_m64n128k16_tb(o[n], p[4 * ks], p[4 * ks + 1], p[4 * ks + 2], p[4 * ks + 3],
                             wg::desc(Vs + 2 * n * KA + ks * 16 * 128, KA, 1024), 1);
    wg::commit();
    wg::wait<0>();
#pragma unroll
    for (int n = 0; n < NH; ++n) wg::fence_operand(o[n]);
  }
  cp_async_wait_all();

#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    lA += __shfl_xor_sync(0xffffffffu, lA, off);
    lB += __shfl_xor_sync(0xffffffffu, lB, off);
  }
  if (part_ml) {
    // A split's share, unnormalised; the max in natural-log units as the merge kernel takes it.
    const float ln2 = 0.6931471805599453f;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = half ? rowB : rowA;
      if (row >= T) continue;
      const int64_t slot = (row * Hq + (half ? hB : hA)) * gridDim.z + blockIdx.z;
      const float l = half ? lB : lA;
      if (t4 == 0) {
        part_ml[2 * slot] = l > 0.f ? (half ? mB : mA) * ln2 : -FLT_MAX;
        part_ml[2 * slot + 1] = l;
      }
      if (l == 0.f) continue;  // no key of this split: the merge reads no accumulator
      float* pa = part_acc + slot * DP;
#pragma unroll
      for (int n = 0; n < NH; ++n)
#pragma unroll
        for (int j = 0; j < 16; ++j)
          *reinterpret_cast<float2*>(pa + n * 128 + 8 * j + 2 * t4) =
              make_float2(o[n][4 * j + 2 * half], o[n][4 * j + 2 * half + 1]);
    }
    return;
  }
  const float iA = lA > 0.f ? 1.f / lA : 0.f, iB = lB > 0.f ? 1.f / lB : 0.f;
#pragma unroll
  for (int n = 0; n < NH; ++n)
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int c = n * 128 + 8 * j + 2 * t4;
      if (rowA < T)
        *reinterpret_cast<float2*>(out + (rowA * Hq + hA) * DP + c) =
            make_float2(o[n][4 * j] * iA, o[n][4 * j + 1] * iA);
      if (rowB < T)
        *reinterpret_cast<float2*>(out + (rowB * Hq + hB) * DP + c) =
            make_float2(o[n][4 * j + 2] * iB, o[n][4 * j + 3] * iB);
    }
#endif
}

template <int DP, bool PACK>
void run(cudaStream_t s, const float* q, const void* k, const void* v, int64_t T, int64_t Hq, int64_t Hkv,
         int64_t kv_len, int64_t q_offset, const int64_t* qpos, int splits, float scale, float* out, float* part) {
  constexpr size_t smem = smem_bytes<DP>();
  static const bool sized = [] {
    CUDA_CHECK(cudaFuncSetAttribute(k_flash_wg<DP, PACK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
    return true;
  }();
  (void)sized;
  static_assert(kBQ == 128 && kBK == 64, "the launch shape is flash_attention.cu's");
  const FlashLaunch L = flash_launch_shape(PACK, T, Hq, Hkv, kv_len, splits, part);
  launch(s, L.grid, kThreads, smem, k_flash_wg<DP, PACK>, q, static_cast<const __nv_bfloat16*>(k),
         static_cast<const __nv_bfloat16*>(v), T, Hq, Hkv, kv_len, q_offset, qpos, L.chunk, scale * 1.4426950408889634f,
         out, L.part_ml, L.part_acc);
  CUDA_LAUNCH_CHECK("k_flash_wg");
  if (splits > 1) launch_attention_merge(s, part, T, Hq, DP, splits, out);
}

int64_t launches = 0;  // flash_wgmma_launches
int wg_set = -1;       // set_flash_wgmma: -1 the default (HYPIC_FLASH_WGMMA, else on), 0 off, 1 on

}  // namespace

bool wgmma_available() {
  static const bool yes = [] {
    int* d = nullptr;
    int h = 0;
    CUDA_CHECK(cudaMalloc(&d, sizeof(int)));
    k_wgmma_probe<<<1, 1>>>(d);
    CUDA_LAUNCH_CHECK("k_wgmma_probe");
    CUDA_CHECK(cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaFree(d));
    return h == 1;
  }();
  return yes;
}

void set_flash_wgmma(int mode) {
  wg_set = mode;
}

int64_t flash_wgmma_launches() {
  return launches;
}

bool flash_attention_wgmma_serves(const FlashPlan& plan, bool kv16, int64_t D, int64_t Dv, const float* q) {
  static const int env = [] {
    const char* e = std::getenv("HYPIC_FLASH_WGMMA");
    return e ? std::atoi(e) : -1;
  }();
  const int mode = wg_set != -1 ? wg_set : env;
  (void)plan;  // every plan: packed blocks and key splits as the mma.sync kernel runs them
  if (mode == 0 || !kv16 || D != Dv || (D != 128 && D != 256)) return false;
  return reinterpret_cast<uintptr_t>(q) % 16 == 0 && wgmma_available();
}

void launch_flash_attention_wgmma(cudaStream_t s, const FlashPlan& plan, const float* q, const void* k, const void* v,
                                  int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t kv_len, int64_t q_offset,
                                  const int64_t* qpos, float scale, float* out, float* part) {
  if (T == 0) return;
  ++launches;
  const int sp = plan.splits;
  if (D == 256 && plan.pack)
    run<256, true>(s, q, k, v, T, Hq, Hkv, kv_len, q_offset, qpos, sp, scale, out, part);
  else if (D == 256)
    run<256, false>(s, q, k, v, T, Hq, Hkv, kv_len, q_offset, qpos, sp, scale, out, part);
  else if (plan.pack)
    run<128, true>(s, q, k, v, T, Hq, Hkv, kv_len, q_offset, qpos, sp, scale, out, part);
  else
    run<128, false>(s, q, k, v, T, Hq, Hkv, kv_len, q_offset, qpos, sp, scale, out, part);
}

}  // namespace hypic::cuda
