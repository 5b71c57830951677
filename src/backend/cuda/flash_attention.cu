// Flash attention (prefill) on the tensor cores: causal GQA over f32 q/k/v rounded to bf16 in
// shared memory, bf16 mma.sync (m16n8k16) with f32 accumulation, online softmax in registers (the
// FlashAttention-2 schedule); all fragments come through ldmatrix (V's row-major tiles with
// .trans). A block owns 128 query rows of one query head (16 per warp) and walks 64-key tiles of
// its kv head up to the last key its rows can see; keys are masked per row by position (q_offset
// + row, and kv_len), so spans that start anywhere in the cache work as they do in the f32 kernel
// (attention.cu), which stays as the reference and the precise path. Head dims are padded with
// zeros to 64, 128 or 256 in shared memory.
// Rows may also carry positions of their own (qpos, nondecreasing: the spans of a PIC composition
// in one call). When the rows are too few to fill the GPU, the keys are split across blocks
// (blockIdx.z, `chunk` keys each) that write partial (max, sum, accumulator) triples for
// attention.cu's merge kernel (flash-decoding).
// PACK (GQA packing): a block's 128 tensor-core rows are 128 / G query rows times the G query
// heads of one kv head, instead of 128 query rows of one head. A composition's rows sit far apart
// (8 seam rows per 2k-token segment): 128 of them span most of the context, and the block walked
// to its last row's keys with most warps idle; 16 rows times 8 heads span two seams, so every warp
// of a block needs about the same keys, and the key split then balances the blocks.
#include <cuda_bf16.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/mma.cuh"

namespace hypic::cuda {

namespace {

constexpr int kBQ = 128, kBK = 64, kWarps = 8;

// PIPE: k and v are bf16 copies (head dims multiples of 8) that stream into two shared-memory
// stages with cp.async, so the next key tile loads while this one computes; otherwise k and v are
// f32, converted tile by tile on the way into shared memory.
template <int DP, bool PIPE, bool PACK>
__global__ void __launch_bounds__(kWarps * 32)
    k_flash(const float* __restrict__ q, const void* __restrict__ kp, const void* __restrict__ vp, int64_t T,
            int64_t Hq, int64_t Hkv, int D, int Dv, int64_t kv_len, int64_t q_offset, const int64_t* __restrict__ qpos,
            int64_t chunk, float scale_log2, bool vec4, float* __restrict__ out, float* __restrict__ part_ml,
            float* __restrict__ part_acc) {
  pdl_entry();
  constexpr int QS = DP + 8;  // padded row stride (bf16 elements): conflict-free fragment loads
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [kBQ][QS]
  // [kBK][QS] each; PIPE: two stages of (K, V)
  __nv_bfloat16* const K0 = Qs + kBQ * QS;
  const float* k = static_cast<const float*>(kp);
  const float* v = static_cast<const float*>(vp);
  const __nv_bfloat16* kh = static_cast<const __nv_bfloat16*>(kp);
  const __nv_bfloat16* vh = static_cast<const __nv_bfloat16*>(vp);
  const int G = static_cast<int>(Hq / Hkv);
  const int64_t rows = PACK ? kBQ / G : kBQ;  // query rows of this block
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * rows;
  const int64_t hk = PACK ? blockIdx.y : blockIdx.y / G;
  // Tensor-core row p of the block: its query row and head.
  auto row_of = [&](int p) -> int64_t { return PACK ? q0 + p / G : q0 + p; };
  auto head_of = [&](int p) -> int64_t { return PACK ? hk * G + p % G : blockIdx.y; };
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int nthreads = kWarps * 32;

  // Q's tile (16-byte loads where head dims allow: a key split's block walks only ~16 key tiles,
  // and one-element loads of the 128 rows took as long as a few of them).
  if (vec4) {
#pragma unroll 4
    for (int e = tid; e < kBQ * DP / 4; e += nthreads) {
      const int r = e / (DP / 4), d = 4 * (e % (DP / 4));
      const int64_t row = row_of(r);
      float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
      if (row < T && d < D) x = *reinterpret_cast<const float4*>(q + (row * Hq + head_of(r)) * D + d);
      __nv_bfloat162* qd = reinterpret_cast<__nv_bfloat162*>(Qs + r * QS + d);
      qd[0] = __floats2bfloat162_rn(x.x, x.y);
      qd[1] = __floats2bfloat162_rn(x.z, x.w);
    }
  } else {
    for (int e = tid; e < kBQ * DP; e += nthreads) {
      const int r = e / DP, d = e % DP;
      const int64_t row = row_of(r);
      Qs[r * QS + d] = __float2bfloat16_rn(row < T && d < D ? q[(row * Hq + head_of(r)) * D + d] : 0.f);
    }
  }
  // Rows of this warp: r0 + g and r0 + g + 8; their positions bound the keys they may see.
  const int r0 = warp * 16;
  const int64_t rowA = row_of(r0 + g), rowB = row_of(r0 + g + 8);
  const int64_t hA = head_of(r0 + g), hB = head_of(r0 + g + 8);
  // One past the last key row `row` sees (0 for rows past T); positions are nondecreasing, so a
  // group's last row bounds the keys of the whole group.
  auto lim = [&](int64_t row) -> int64_t {
    if (row >= T) return qpos ? 0 : min(kv_len, q_offset + row + 1);
    return min(kv_len, (qpos ? qpos[row] : q_offset + row) + 1);
  };
  const int64_t limA = lim(rowA), limB = lim(rowB);
  const int64_t warp_hi = row_of(r0) < T ? lim(min(T - 1, row_of(r0 + 15))) : 0;  // keys any row of the warp sees
  const int64_t blk_hi0 = lim(min(T, q0 + rows) - 1);
  // This block's split of the keys: [k_lo, blk_hi).
  const int64_t k_lo = static_cast<int64_t>(blockIdx.z) * chunk, blk_hi = min(blk_hi0, k_lo + chunk);

  constexpr int NO = DP / 8;  // output n-tiles of 8 columns
  float o[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float mA = -FLT_MAX, mB = -FLT_MAX, lA = 0.f, lB = 0.f;
  const int ksteps = (D + 15) / 16, ntiles = (Dv + 7) / 8;

  // PIPE: the tile at k0 into stage st (zero rows past kv_len, zero columns past D / Dv).
  auto load16 = [&](int64_t k0, int st) {
    __nv_bfloat16* Kt = K0 + st * 2 * kBK * QS;
    __nv_bfloat16* Vt = Kt + kBK * QS;
    for (int e = tid; e < kBK * (DP / 8); e += nthreads) {
      const int j = e / (DP / 8), d = 8 * (e % (DP / 8));
      const int64_t key = k0 + j;
      const bool in = key < kv_len;
      const bool okk = in && d < D, okv = in && d < Dv;
      cp_async16(Kt + j * QS + d, okk ? kh + (key * Hkv + hk) * D + d : kh, okk);
      cp_async16(Vt + j * QS + d, okv ? vh + (key * Hkv + hk) * Dv + d : vh, okv);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  if constexpr (PIPE) {
    if (blk_hi > k_lo) load16(k_lo, 0);
  }
  int it = 0;
  for (int64_t k0 = k_lo; k0 < blk_hi; k0 += kBK, ++it) {
    __nv_bfloat16* Ks = K0;
    __nv_bfloat16* Vs = K0 + kBK * QS;
    if constexpr (PIPE) {
      asm volatile("cp.async.wait_group 0;\n" ::);
      __syncthreads();  // the tile at k0 has landed; every warp is done with the other stage
      if (k0 + kBK < blk_hi) load16(k0 + kBK, (it + 1) & 1);
      Ks = K0 + (it & 1) * 2 * kBK * QS;
      Vs = Ks + kBK * QS;
    } else {
      __syncthreads();
      if (vec4) {
        // Four consecutive dims per thread: 16-byte loads (head dims are multiples of 4 in practice).
        for (int e = tid; e < kBK * DP / 4; e += nthreads) {
          const int j = e / (DP / 4), d = 4 * (e % (DP / 4));
          const int64_t key = k0 + j;
          const bool in = key < kv_len;
          float4 kk4 = make_float4(0.f, 0.f, 0.f, 0.f), vv4 = kk4;
          if (in && d < D) kk4 = *reinterpret_cast<const float4*>(k + (key * Hkv + hk) * D + d);
          if (in && d < Dv) vv4 = *reinterpret_cast<const float4*>(v + (key * Hkv + hk) * Dv + d);
          __nv_bfloat162* kd = reinterpret_cast<__nv_bfloat162*>(Ks + j * QS + d);
          kd[0] = __floats2bfloat162_rn(kk4.x, kk4.y);
          kd[1] = __floats2bfloat162_rn(kk4.z, kk4.w);
          __nv_bfloat162* vd = reinterpret_cast<__nv_bfloat162*>(Vs + j * QS + d);
          vd[0] = __floats2bfloat162_rn(vv4.x, vv4.y);
          vd[1] = __floats2bfloat162_rn(vv4.z, vv4.w);
        }
      } else {
        for (int e = tid; e < kBK * DP; e += nthreads) {
          const int j = e / DP, d = e % DP;
          const int64_t key = k0 + j;
          const bool in = key < kv_len;
          Ks[j * QS + d] = __float2bfloat16_rn(in && d < D ? k[(key * Hkv + hk) * D + d] : 0.f);
          Vs[j * QS + d] = __float2bfloat16_rn(in && d < Dv ? v[(key * Hkv + hk) * Dv + d] : 0.f);
        }
      }
      __syncthreads();
    }
    if (k0 >= warp_hi) continue;  // every row of this warp is done (no barrier below)

    float s[kBK / 8][4];
#pragma unroll
    for (int j = 0; j < kBK / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    // Fragments through ldmatrix: Q's 16x16 A tile in one x4, two key tiles' B fragments per x4
    // (lane l addresses row l % 8 of matrix l / 8).
    const int mi = lane / 8, mr = lane % 8;
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      if (kk >= ksteps) break;
      uint32_t a0, a1, a2, a3;
      ldmatrix_x4(a0, a1, a2, a3, Qs + (r0 + (mi & 1) * 8 + mr) * QS + kk * 16 + (mi >> 1) * 8);
#pragma unroll
      for (int j = 0; j < kBK / 8; j += 2) {
        uint32_t b0, b1, c0, c1;
        ldmatrix_x4(b0, b1, c0, c1, Ks + ((j + (mi >> 1)) * 8 + mr) * QS + kk * 16 + (mi & 1) * 8);
        mma16816(s[j], a0, a1, a2, a3, b0, b1);
        mma16816(s[j + 1], a0, a1, a2, a3, c0, c1);
      }
    }
    // Mask, scale (log2 domain) and the running max of rows A (g) and B (g + 8).
    float mxA = -FLT_MAX, mxB = -FLT_MAX;
#pragma unroll
    for (int j = 0; j < kBK / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t key = k0 + j * 8 + 2 * t4 + (e & 1);
        const bool ok = key < (e < 2 ? limA : limB);
        s[j][e] = ok ? s[j][e] * scale_log2 : -FLT_MAX;
        if (e < 2)
          mxA = fmaxf(mxA, s[j][e]);
        else
          mxB = fmaxf(mxB, s[j][e]);
      }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, off));
      mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, off));
    }
    const float nA = fmaxf(mA, mxA), nB = fmaxf(mB, mxB);
    // A row that has seen no key yet keeps max -FLT_MAX; its probabilities stay 0.
    const float cA = nA == -FLT_MAX ? 1.f : exp2f(mA - nA), cB = nB == -FLT_MAX ? 1.f : exp2f(mB - nB);
    mA = nA;
    mB = nB;
    float sumA = 0.f, sumB = 0.f;
#pragma unroll
    for (int j = 0; j < kBK / 8; ++j) {
      s[j][0] = s[j][0] == -FLT_MAX ? 0.f : exp2f(s[j][0] - nA);
      s[j][1] = s[j][1] == -FLT_MAX ? 0.f : exp2f(s[j][1] - nA);
      s[j][2] = s[j][2] == -FLT_MAX ? 0.f : exp2f(s[j][2] - nB);
      s[j][3] = s[j][3] == -FLT_MAX ? 0.f : exp2f(s[j][3] - nB);
      sumA += s[j][0] + s[j][1];
      sumB += s[j][2] + s[j][3];
    }
    lA = lA * cA + sumA;
    lB = lB * cB + sumB;
#pragma unroll
    for (int n = 0; n < NO; ++n) {
      o[n][0] *= cA;
      o[n][1] *= cA;
      o[n][2] *= cB;
      o[n][3] *= cB;
    }
    // O += P V: P's accumulator layout is the A-operand layout of the next product.
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      const uint32_t a0 = pack2(s[2 * ks][0], s[2 * ks][1]), a1 = pack2(s[2 * ks][2], s[2 * ks][3]);
      const uint32_t a2 = pack2(s[2 * ks + 1][0], s[2 * ks + 1][1]), a3 = pack2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
#pragma unroll
      for (int n = 0; n < NO; n += 2) {  // two dim tiles per x4 (past Dv: zero columns, unused)
        if (n >= ntiles) break;
        uint32_t b0, b1, c0, c1;
        ldmatrix_x4_trans(b0, b1, c0, c1, Vs + (ks * 16 + (mi & 1) * 8 + mr) * QS + (n + (mi >> 1)) * 8);
        mma16816(o[n], a0, a1, a2, a3, b0, b1);
        mma16816(o[n + 1], a0, a1, a2, a3, c0, c1);
      }
    }
  }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    lA += __shfl_xor_sync(0xffffffffu, lA, off);
    lB += __shfl_xor_sync(0xffffffffu, lB, off);
  }
  if (part_ml) {
    // A split's share, unnormalised; the max in natural-log units as the merge kernel takes it.
    const int S = gridDim.z;
    const float ln2 = 0.6931471805599453f;
#pragma unroll
    for (int n = 0; n < NO; ++n) {
      if (n >= ntiles) break;
      const int c = n * 8 + 2 * t4;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t row = half ? rowB : rowA;
        if (row >= T) continue;
        const int64_t slot = (row * Hq + (half ? hB : hA)) * S + blockIdx.z;
        const float l = half ? lB : lA;
        if (n == 0 && t4 == 0) {
          part_ml[2 * slot] = l > 0.f ? (half ? mB : mA) * ln2 : -FLT_MAX;
          part_ml[2 * slot + 1] = l;
        }
        if (l == 0.f) continue;  // no key of this split: the merge reads no accumulator
        float* pa = part_acc + slot * Dv;
        if (c < Dv) pa[c] = o[n][2 * half];
        if (c + 1 < Dv) pa[c + 1] = o[n][2 * half + 1];
      }
    }
    return;
  }
  const float iA = lA > 0.f ? 1.f / lA : 0.f, iB = lB > 0.f ? 1.f / lB : 0.f;
#pragma unroll
  for (int n = 0; n < NO; ++n) {
    if (n >= ntiles) break;
    const int c = n * 8 + 2 * t4;
    if (rowA < T) {
      float* pa = out + (rowA * Hq + hA) * Dv;
      if (c < Dv) pa[c] = o[n][0] * iA;
      if (c + 1 < Dv) pa[c + 1] = o[n][1] * iA;
    }
    if (rowB < T) {
      float* pb = out + (rowB * Hq + hB) * Dv;
      if (c < Dv) pb[c] = o[n][2] * iB;
      if (c + 1 < Dv) pb[c + 1] = o[n][3] * iB;
    }
  }
}

template <int DP, bool PIPE, bool PACK>
void run(cudaStream_t s, const float* q, const void* k, const void* v, int64_t T, int64_t Hq, int64_t Hkv, int D,
         int Dv, int64_t kv_len, int64_t q_offset, const int64_t* qpos, int splits, float scale, float* out,
         float* part) {
  const size_t smem = static_cast<size_t>(kBQ + (PIPE ? 4 : 2) * kBK) * (DP + 8) * 2;
  static const bool sized = [&] {  // per device would be exact; one GPU per process is the norm
    CUDA_CHECK(cudaFuncSetAttribute(k_flash<DP, PIPE, PACK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
    return true;
  }();
  (void)sized;
  const FlashLaunch L = flash_launch_shape(PACK, T, Hq, Hkv, kv_len, splits, part);
  // 16-byte loads of q (and of f32 k, v): head dims multiples of 4 and aligned bases.
  const bool vec4 = D % 4 == 0 && Dv % 4 == 0 && reinterpret_cast<uintptr_t>(q) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(k) % 16 == 0 && reinterpret_cast<uintptr_t>(v) % 16 == 0;
  launch(s, L.grid, kWarps * 32, smem, k_flash<DP, PIPE, PACK>, q, k, v, T, Hq, Hkv, D, Dv, kv_len, q_offset, qpos,
         L.chunk, scale * 1.4426950408889634f, vec4, out, L.part_ml, L.part_acc);
  CUDA_LAUNCH_CHECK("k_flash");
  if (splits > 1) launch_attention_merge(s, part, T, Hq, Dv, splits, out);
}

template <int DP>
void run(const FlashPlan& plan, cudaStream_t s, const float* q, const void* k, const void* v, bool kv16, int64_t T,
         int64_t Hq, int64_t Hkv, int D, int Dv, int64_t kv_len, int64_t q_offset, const int64_t* qpos, float scale,
         float* out, float* part) {
  const int sp = plan.splits;
  if (kv16 && plan.pack)
    run<DP, true, true>(s, q, k, v, T, Hq, Hkv, D, Dv, kv_len, q_offset, qpos, sp, scale, out, part);
  else if (kv16)
    run<DP, true, false>(s, q, k, v, T, Hq, Hkv, D, Dv, kv_len, q_offset, qpos, sp, scale, out, part);
  else if (plan.pack)
    run<DP, false, true>(s, q, k, v, T, Hq, Hkv, D, Dv, kv_len, q_offset, qpos, sp, scale, out, part);
  else
    run<DP, false, false>(s, q, k, v, T, Hq, Hkv, D, Dv, kv_len, q_offset, qpos, sp, scale, out, part);
}

// -1: the rule in flash_attention_plan; 0 never pack; 1 whenever the group divides a block.
int pack_set = -2;  // -2: not set by set_flash_pack, HYPIC_FLASH_PACK decides
int pack_mode() {
  static const int env = [] {
    const char* e = std::getenv("HYPIC_FLASH_PACK");
    return e ? std::atoi(e) : -1;
  }();
  return pack_set != -2 ? pack_set : env;
}

}  // namespace

bool flash_attention_kv16(int64_t D, int64_t Dv) {
  return D % 8 == 0 && Dv % 8 == 0;
}

void set_flash_pack(int mode) {
  pack_set = mode;
}

FlashLaunch flash_launch_shape(bool pack, int64_t T, int64_t Hq, int64_t Hkv, int64_t kv_len, int splits, float* part) {
  FlashLaunch L;
  const int64_t rows = pack ? kBQ / (Hq / Hkv) : kBQ;
  L.grid = dim3(static_cast<unsigned>((T + rows - 1) / rows), static_cast<unsigned>(pack ? Hkv : Hq),
                static_cast<unsigned>(splits));
  // Whole tiles per split, so that no tile is seen by two splits.
  L.chunk = splits > 1 ? ((kv_len + splits - 1) / splits + kBK - 1) / kBK * kBK : kv_len + kBK;
  L.part_ml = splits > 1 ? part : nullptr;
  L.part_acc = splits > 1 ? part + 2 * T * Hq * splits : nullptr;
  return L;
}

FlashPlan flash_attention_plan(int64_t T, int64_t Hq, int64_t Hkv, int64_t kv_len, bool scattered, int sms) {
  FlashPlan p;
  const int64_t G = Hkv > 0 ? Hq / Hkv : 0;
  const bool can_pack = G > 0 && G <= kBQ && kBQ % G == 0;
  const int mode = pack_mode();
  // Packed blocks for rows with positions of their own (scattered: a composition's seams and
  // question), where 128 rows of one head would span most of the keys; prefill spans keep the
  // one-head blocks (the same key tiles per row either way).
  p.pack = can_pack && (mode == 1 || (mode < 0 && scattered));
  const int64_t rows = p.pack ? kBQ / G : kBQ;
  const int64_t blocks = (T + rows - 1) / rows * (p.pack ? Hkv : Hq);
  if (p.pack) {
    // Packed blocks of scattered rows vary in length (a block sees the keys up to its rows'
    // positions, half of them on average): split the keys so that about three chunks per
    // multiprocessor have work and the long blocks spread out; at least 8 key tiles a chunk.
    const int64_t want = (3 * sms * 2 + blocks - 1) / blocks, by_keys = kv_len / (8 * kBK);
    p.splits = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({want, by_keys, 64})));
    return p;
  }
  // Split only when the (row tile, head) blocks leave most of the GPU idle; each split at least
  // 8 key tiles, so that the partial sums and the merge stay small next to the work.
  if (blocks * 2 > sms) return p;
  const int64_t want = (2 * sms + blocks - 1) / blocks, by_keys = kv_len / (8 * kBK);
  p.splits = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({want, by_keys, 64})));
  return p;
}

void launch_flash_attention(cudaStream_t s, const FlashPlan& plan, const float* q, const void* k, const void* v,
                            bool kv16, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, int64_t kv_len,
                            int64_t q_offset, const int64_t* qpos, float scale, float* out, float* part) {
  if (T == 0) return;
  if (plan.splits > 1 && !part)
    throw std::invalid_argument("flash attention: a key split needs its partial-sum buffer");
  if (plan.pack && (Hkv <= 0 || Hq % Hkv != 0 || kBQ % (Hq / Hkv) != 0))
    throw std::invalid_argument("flash attention: packed blocks need the query group to divide " + std::to_string(kBQ) +
                                " rows");
  if (flash_attention_wgmma_serves(plan, kv16, D, Dv, q))
    return launch_flash_attention_wgmma(s, plan, q, k, v, T, Hq, Hkv, D, kv_len, q_offset, qpos, scale, out, part);
  const int64_t m = D > Dv ? D : Dv;
  const int d = static_cast<int>(D), dv = static_cast<int>(Dv);
  if (m <= 64)
    run<64>(plan, s, q, k, v, kv16, T, Hq, Hkv, d, dv, kv_len, q_offset, qpos, scale, out, part);
  else if (m <= 128)
    run<128>(plan, s, q, k, v, kv16, T, Hq, Hkv, d, dv, kv_len, q_offset, qpos, scale, out, part);
  else if (m <= 256)
    run<256>(plan, s, q, k, v, kv16, T, Hq, Hkv, d, dv, kv_len, q_offset, qpos, scale, out, part);
  else
    throw std::invalid_argument("attention: head dims up to 256 on cuda, got " + std::to_string(D) + "/" +
                                std::to_string(Dv));
}

}  // namespace hypic::cuda
