// Gated delta rule, chunked (WY) form on the tensor cores: the algebra of gated_delta_chunked.cu
// (read its header for U, W, Ut, P and the state update) with bf16 operands and f32 accumulation
// (m16n8k16 mma.sync), for dk = 128 and dv a multiple of 32 (every Qwen3.5 / Qwen3-Next shape).
// The f32 chunked kernel stays the reference and the precise-mode path; the ops test compares the
// two. The state itself stays f32 in registers; it is rounded to bf16 only as an operand (as
// flash-linear-attention does), so rounding does not compound across chunks.
//
// (1) k_tc_prep, per chunk and value head: normalised keys (bf16), the Gram K K^T on the tensor
//     cores, A = strictly lower b_i e^{G_i-G_j} k_i.k_j, (I + A)^{-1} by forward substitution
//     (64 columns, f32), then W = (I+A)^{-1} diag(b e^G) K and Ut = (I+A)^{-1} diag(b) V as
//     products. Writes kn, W, Ut (bf16) and G (f32).
// (2) k_tc_state, per value head and block of 32 state columns (value columns, then T_C's dk
//     columns that start at I and have Ut = 0): over chunks, U = Ut - W S and
//     S <- e^{G_last} S + K^T diag(e^{G_last-G}) U, with the next chunk's operands in flight
//     (cp.async, two stages). Writes each chunk's start state and U (bf16) for (3).
// (3) k_tc_out, per chunk, value head and 64 output columns, all chunks in parallel:
//     O = diag(e^G) Q S0 + P U with P = (Q K^T) masked and decayed in registers, its accumulator
//     layout reused as the A operand of P U (as flash attention does with probabilities).
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/mma.cuh"

namespace hypic::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kC = 64;        // tokens per chunk
constexpr int kDK = 128;      // key head dim (the only one this form takes)
constexpr int kKS = kDK + 8;  // padded bf16 row stride of [token][d] tiles: conflict-free ldmatrix
constexpr int kAS = kC + 8;   // of [token][token] tiles
constexpr int kNC = 32;       // state columns per block of the sequential kernel
constexpr int kNS = kNC + 8;  // its padded stride
constexpr int kOC = 64;       // output columns per block of the output kernel
constexpr int kOS = kOC + 8;  // its padded stride
constexpr int kPrepThreads = 128, kStateThreads = 256, kOutThreads = 128;

struct TcWork {  // workspace views, each [Hv][N][...]
  bf16* kn;      // [kC][kDK] normalised keys
  bf16* w;       // [kC][kDK]
  bf16* ut;      // [kC][dv]
  bf16* u;       // [kC][dv]
  bf16* s0;      // [kDK][dv] state at the chunk's start
  float* G;      // [kC] cumulative log decay
};

TcWork carve(void* ws, int64_t Hv, int64_t N, int64_t dv) {
  const int64_t HN = Hv * N;
  TcWork w{};
  bf16* p = static_cast<bf16*>(ws);
  w.kn = p;
  w.w = w.kn + HN * kC * kDK;
  w.ut = w.w + HN * kC * kDK;
  w.u = w.ut + HN * kC * dv;
  w.s0 = w.u + HN * kC * dv;
  w.G = reinterpret_cast<float*>(w.s0 + HN * kDK * dv);
  return w;
}

__device__ __forceinline__ void store_bf16x2(bf16* dst, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
}

// Four consecutive f32 as bf16 into shared or global memory (8 bytes).
__device__ __forceinline__ void store_bf16x4(bf16* dst, float4 x) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(x.x, x.y), hi = __floats2bfloat162_rn(x.z, x.w);
  uint2 v;
  v.x = *reinterpret_cast<uint32_t*>(&lo);
  v.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(dst) = v;
}

// Rows i = warp, warp + nwarps, ... of a chunk's [kC][kDK] f32 q or k (row stride `ld` floats),
// L2-normalised as the CPU backend does (x / sqrt(sum x^2 + 1e-6)) when asked, times `scale`, into
// dst [kC][kKS] bf16 (and into gdst [kC][kDK] when given). Rows past L are zero.
__device__ __forceinline__ void load_rows_normalised(const float* src, int64_t ld, int L, bool l2norm, float scale,
                                                     bf16* dst, bf16* gdst, int warp, int nwarps, int lane) {
  for (int i = warp; i < kC; i += nwarps) {
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (i < L) x = *reinterpret_cast<const float4*>(src + i * ld + 4 * lane);
    float ss = x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float f = (l2norm ? 1.f / sqrtf(ss + 1e-6f) : 1.f) * scale;
    x.x *= f, x.y *= f, x.z *= f, x.w *= f;
    store_bf16x4(dst + i * kKS + 4 * lane, x);
    if (gdst) store_bf16x4(gdst + i * kDK + 4 * lane, x);
  }
}

// acc[j] (j = 0..7: the 64 columns) += X[r0..r0+16) Y^T over kDK, X and Y [.][kKS] row-major.
__device__ __forceinline__ void gram_rows(const bf16* X, const bf16* Y, int r0, int lane, float (&acc)[8][4]) {
  const int mi = lane / 8, mr = lane % 8;
#pragma unroll
  for (int kk = 0; kk < kDK / 16; ++kk) {
    uint32_t a0, a1, a2, a3;
    ldmatrix_x4(a0, a1, a2, a3, X + (r0 + (mi & 1) * 8 + mr) * kKS + kk * 16 + (mi >> 1) * 8);
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      uint32_t b0, b1, c0, c1;
      ldmatrix_x4(b0, b1, c0, c1, Y + ((j + (mi >> 1)) * 8 + mr) * kKS + kk * 16 + (mi & 1) * 8);
      mma16816(acc[j], a0, a1, a2, a3, b0, b1);
      mma16816(acc[j + 1], a0, a1, a2, a3, c0, c1);
    }
  }
}

// (1) Per chunk c and value head h.
__global__ void __launch_bounds__(kPrepThreads)
    k_tc_prep(const float* __restrict__ k, const float* __restrict__ v, const float* __restrict__ g,
              const float* __restrict__ beta, bool l2norm, int64_t T, int64_t Hk, int64_t Hv, int dv, int64_t N,
              TcWork wk) {
  pdl_entry();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int VS = dv + 8;
  bf16* Ks = reinterpret_cast<bf16*>(smem_raw);         // [kC][kKS]
  bf16* Vs = Ks + kC * kKS;                             // [kC][VS]
  bf16* Aw = Vs + kC * VS;                              // [kC][kAS]: (I+A)^{-1} diag(b e^G)
  bf16* Au = Aw + kC * kAS;                             // [kC][kAS]: (I+A)^{-1} diag(b)
  float* As = reinterpret_cast<float*>(Au + kC * kAS);  // [kC][kC + 1]
  float* Gs = As + kC * (kC + 1);
  float* bs = Gs + kC;
  const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  constexpr int nwarps = kPrepThreads / 32;
  const int64_t hk = h / (Hv / Hk), t0 = static_cast<int64_t>(c) * kC;
  const int L = static_cast<int>(T - t0 < kC ? T - t0 : kC);
  const int64_t base = static_cast<int64_t>(h) * N + c;

  load_rows_normalised(k + (t0 * Hk + hk) * kDK, Hk * kDK, L, l2norm, 1.f, Ks, wk.kn + base * kC * kDK, warp, nwarps,
                       lane);
  for (int e = tid; e < kC * dv / 4; e += kPrepThreads) {
    const int i = e / (dv / 4), d = 4 * (e % (dv / 4));
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (i < L) x = *reinterpret_cast<const float4*>(v + ((t0 + i) * Hv + h) * dv + d);
    store_bf16x4(Vs + i * VS + d, x);
  }
  if (tid < kC) {  // padding: no decay, b = 0, k = 0
    Gs[tid] = tid < L ? g[(t0 + tid) * Hv + h] : 0.f;
    bs[tid] = tid < L ? beta[(t0 + tid) * Hv + h] : 0.f;
  }
  __syncthreads();
  if (tid == 0) {  // cumulative log decay: 64 adds
    float acc = 0.f;
    for (int i = 0; i < kC; ++i) Gs[i] = acc += Gs[i];
  }
  __syncthreads();
  if (tid < kC) wk.G[base * kC + tid] = Gs[tid];

  const int r0 = warp * 16, g4 = lane / 4, t4 = lane % 4, mi = lane / 8, mr = lane % 8;
  {  // A = strictly lower b_i e^{G_i - G_j} k_i.k_j, f32 into shared memory
    float acc[8][4] = {};
    gram_rows(Ks, Ks, r0, lane, acc);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = r0 + g4 + (e >= 2 ? 8 : 0), jj = j * 8 + 2 * t4 + (e & 1);
        As[i * (kC + 1) + jj] = jj < i ? bs[i] * __expf(Gs[i] - Gs[jj]) * acc[j][e] : 0.f;
      }
  }
  __syncthreads();
  // (I + A)^{-1} by forward substitution, a column per thread (A read as a broadcast); its columns
  // scaled by b_t e^{G_t} and b_t are the A operands of W and Ut.
  if (tid < kC) {
    const int t = tid;
    float x[kC];
#pragma unroll
    for (int i = 0; i < kC; ++i) x[i] = i == t ? 1.f : 0.f;
#pragma unroll
    for (int i = 1; i < kC; ++i) {
      float a = x[i];
#pragma unroll
      for (int j = 0; j < i; ++j) a -= As[i * (kC + 1) + j] * x[j];
      x[i] = a;
    }
    const float fw = bs[t] * __expf(Gs[t]), fu = bs[t];
#pragma unroll
    for (int i = 0; i < kC; ++i) {
      Aw[i * kAS + t] = __float2bfloat16_rn(x[i] * fw);
      Au[i * kAS + t] = __float2bfloat16_rn(x[i] * fu);
    }
  }
  __syncthreads();
  // W = Aw K ([kC][kDK]) and Ut = Au V ([kC][dv]): this warp's 16 rows, A fragments loaded once.
  uint32_t fa[4][4];
#pragma unroll
  for (int ks = 0; ks < kC / 16; ++ks)
    ldmatrix_x4(fa[ks][0], fa[ks][1], fa[ks][2], fa[ks][3],
                Aw + (r0 + (mi & 1) * 8 + mr) * kAS + ks * 16 + (mi >> 1) * 8);
  const int rowA = r0 + g4, rowB = rowA + 8;
#pragma unroll
  for (int nb = 0; nb < kDK; nb += 32) {
    float acc[4][4] = {};
#pragma unroll
    for (int ks = 0; ks < kC / 16; ++ks)
#pragma unroll
      for (int n = 0; n < 4; n += 2) {
        uint32_t b0, b1, c0, c1;
        ldmatrix_x4_trans(b0, b1, c0, c1, Ks + (ks * 16 + (mi & 1) * 8 + mr) * kKS + nb + (n + (mi >> 1)) * 8);
        mma16816(acc[n], fa[ks][0], fa[ks][1], fa[ks][2], fa[ks][3], b0, b1);
        mma16816(acc[n + 1], fa[ks][0], fa[ks][1], fa[ks][2], fa[ks][3], c0, c1);
      }
    bf16* wdst = wk.w + base * kC * kDK + nb + 2 * t4;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      store_bf16x2(wdst + rowA * kDK + n * 8, acc[n][0], acc[n][1]);
      store_bf16x2(wdst + rowB * kDK + n * 8, acc[n][2], acc[n][3]);
    }
  }
#pragma unroll
  for (int ks = 0; ks < kC / 16; ++ks)
    ldmatrix_x4(fa[ks][0], fa[ks][1], fa[ks][2], fa[ks][3],
                Au + (r0 + (mi & 1) * 8 + mr) * kAS + ks * 16 + (mi >> 1) * 8);
  for (int nb = 0; nb < dv; nb += 32) {
    float acc[4][4] = {};
#pragma unroll
    for (int ks = 0; ks < kC / 16; ++ks)
#pragma unroll
      for (int n = 0; n < 4; n += 2) {
        uint32_t b0, b1, c0, c1;
        ldmatrix_x4_trans(b0, b1, c0, c1, Vs + (ks * 16 + (mi & 1) * 8 + mr) * VS + nb + (n + (mi >> 1)) * 8);
        mma16816(acc[n], fa[ks][0], fa[ks][1], fa[ks][2], fa[ks][3], b0, b1);
        mma16816(acc[n + 1], fa[ks][0], fa[ks][1], fa[ks][2], fa[ks][3], c0, c1);
      }
    bf16* udst = wk.ut + base * kC * dv + nb + 2 * t4;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      store_bf16x2(udst + rowA * dv + n * 8, acc[n][0], acc[n][1]);
      store_bf16x2(udst + rowB * dv + n * 8, acc[n][2], acc[n][3]);
    }
  }
}

// (2) Per value head h and block of kNC state columns: value columns [0, dv), then T_C's columns.
// Warp w owns state rows [16w, 16w + 16) of the block's columns in f32 registers (C layout).
constexpr int kStage = (2 * kC * kKS + kC * kNS) * 2 + kC * 4;  // bytes: W, K, Ut (bf16), G (f32)
constexpr size_t kStateSmem = 2 * kStage + (kDK * kNS + kC * kNS) * 2;

__global__ void __launch_bounds__(kStateThreads)
    k_tc_state(int64_t N, int dv, TcWork wk, float* __restrict__ state, float* __restrict__ transition) {
  pdl_entry();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Ss = reinterpret_cast<bf16*>(smem_raw + 2 * kStage);  // [kDK][kNS]: S as an operand
  bf16* Us = Ss + kDK * kNS;                                  // [kC][kNS]: e^{G_last-G_i} U_i
  const int h = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g4 = lane / 4, t4 = lane % 4, mi = lane / 8, mr = lane % 8;
  const int col0 = blockIdx.x * kNC;
  const bool is_T = col0 >= dv;  // dv % kNC == 0: a block is all value or all T columns

  auto load = [&](int64_t c, int st) {
    unsigned char* sb = smem_raw + st * kStage;
    bf16* Ws = reinterpret_cast<bf16*>(sb);
    bf16* Kn = Ws + kC * kKS;
    bf16* Ut = Kn + kC * kKS;
    float* Gt = reinterpret_cast<float*>(Ut + kC * kNS);
    const int64_t base = static_cast<int64_t>(h) * N + c;
    const bf16* wsrc = wk.w + base * kC * kDK;
    const bf16* ksrc = wk.kn + base * kC * kDK;
    for (int e = tid; e < kC * kDK / 8; e += kStateThreads) {
      const int i = e / (kDK / 8), d = 8 * (e % (kDK / 8));
      cp_async16(Ws + i * kKS + d, wsrc + i * kDK + d);
      cp_async16(Kn + i * kKS + d, ksrc + i * kDK + d);
    }
    for (int e = tid; e < kC * kNC / 8; e += kStateThreads) {
      const int i = e / (kNC / 8), d = 8 * (e % (kNC / 8));
      cp_async16(Ut + i * kNS + d, is_T ? wk.ut : wk.ut + (base * kC + i) * dv + col0 + d, !is_T);
    }
    if (tid < kC / 4) cp_async16(Gt + 4 * tid, wk.G + base * kC + 4 * tid);
    cp_async_commit();
  };

  float s[4][4];
  const int srowA = warp * 16 + g4, srowB = srowA + 8;
#pragma unroll
  for (int n = 0; n < 4; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e < 2 ? srowA : srowB, cl = col0 + n * 8 + 2 * t4 + (e & 1);
      s[n][e] = is_T ? (r == cl - dv ? 1.f : 0.f) : state[(static_cast<int64_t>(h) * kDK + r) * dv + cl];
    }
  load(0, 0);
  // U's jobs: m-tile (w & 3) of the chunk's 64 rows, n-tiles 2 (w >> 2) and the next.
  const int umt = warp & 3, unt = 2 * (warp >> 2);
  const int urowA = umt * 16 + g4, urowB = urowA + 8;
  for (int64_t c = 0; c < N; ++c) {
    const int st = static_cast<int>(c & 1);
    const int64_t base = static_cast<int64_t>(h) * N + c;
    cp_async_wait_all();
    __syncthreads();  // chunk c landed; every warp is done with chunk c - 1 (the other stage, Ss, Us)
    if (c + 1 < N) load(c + 1, st ^ 1);
    unsigned char* sb = smem_raw + st * kStage;
    const bf16* Ws = reinterpret_cast<const bf16*>(sb);
    const bf16* Kn = Ws + kC * kKS;
    const bf16* Ut = Kn + kC * kKS;
    const float* Gt = reinterpret_cast<const float*>(Ut + kC * kNS);
    // S as the bf16 operand, and the chunk's start state for the output kernel.
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const int cl = n * 8 + 2 * t4;
      store_bf16x2(Ss + srowA * kNS + cl, s[n][0], s[n][1]);
      store_bf16x2(Ss + srowB * kNS + cl, s[n][2], s[n][3]);
      if (!is_T) {
        bf16* d0 = wk.s0 + base * kDK * dv + col0 + cl;
        store_bf16x2(d0 + srowA * dv, s[n][0], s[n][1]);
        store_bf16x2(d0 + srowB * dv, s[n][2], s[n][3]);
      }
    }
    __syncthreads();
    // U = Ut - W S.
    float u[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < kDK / 16; ++kk) {
      uint32_t a0, a1, a2, a3, b0, b1, c0, c1;
      ldmatrix_x4(a0, a1, a2, a3, Ws + (umt * 16 + (mi & 1) * 8 + mr) * kKS + kk * 16 + (mi >> 1) * 8);
      ldmatrix_x4_trans(b0, b1, c0, c1, Ss + (kk * 16 + (mi & 1) * 8 + mr) * kNS + (unt + (mi >> 1)) * 8);
      mma16816(u[0], a0, a1, a2, a3, b0, b1);
      mma16816(u[1], a0, a1, a2, a3, c0, c1);
    }
    const float Gl = Gt[kC - 1];
    const float dA = __expf(Gl - Gt[urowA]), dB = __expf(Gl - Gt[urowB]);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int cl = (unt + j) * 8 + 2 * t4;
      const float2 tA = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(Ut + urowA * kNS + cl));
      const float2 tB = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(Ut + urowB * kNS + cl));
      const float uA0 = tA.x - u[j][0], uA1 = tA.y - u[j][1], uB0 = tB.x - u[j][2], uB1 = tB.y - u[j][3];
      if (!is_T) {
        bf16* d0 = wk.u + base * kC * dv + col0 + cl;
        store_bf16x2(d0 + urowA * dv, uA0, uA1);
        store_bf16x2(d0 + urowB * dv, uB0, uB1);
      }
      store_bf16x2(Us + urowA * kNS + cl, dA * uA0, dA * uA1);
      store_bf16x2(Us + urowB * kNS + cl, dB * uB0, dB * uB1);
    }
    __syncthreads();
    // S <- e^{G_last} S + K^T (decayed U): A = K^T through ldmatrix.trans of K's [token][d] tile.
    const float el = __expf(Gl);
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] *= el;
#pragma unroll
    for (int ks = 0; ks < kC / 16; ++ks) {
      uint32_t a0, a1, a2, a3;
      ldmatrix_x4_trans(a0, a1, a2, a3, Kn + (ks * 16 + (mi >> 1) * 8 + mr) * kKS + warp * 16 + (mi & 1) * 8);
#pragma unroll
      for (int n = 0; n < 4; n += 2) {
        uint32_t b0, b1, c0, c1;
        ldmatrix_x4_trans(b0, b1, c0, c1, Us + (ks * 16 + (mi & 1) * 8 + mr) * kNS + (n + (mi >> 1)) * 8);
        mma16816(s[n], a0, a1, a2, a3, b0, b1);
        mma16816(s[n + 1], a0, a1, a2, a3, c0, c1);
      }
    }
  }
#pragma unroll
  for (int n = 0; n < 4; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e < 2 ? srowA : srowB, cl = col0 + n * 8 + 2 * t4 + (e & 1);
      if (is_T)
        transition[(static_cast<int64_t>(h) * kDK + r) * kDK + cl - dv] = s[n][e];
      else
        state[(static_cast<int64_t>(h) * kDK + r) * dv + cl] = s[n][e];
    }
}

// (3) Per chunk c, value head h and kOC output columns.
constexpr size_t kOutSmem = (2 * kC * kKS + kDK * kOS + kC * kOS) * 2 + kC * 4;

__global__ void __launch_bounds__(kOutThreads)
    k_tc_out(const float* __restrict__ q, bool l2norm, int64_t T, int64_t Hk, int64_t Hv, int dv, int64_t N, TcWork wk,
             float* __restrict__ out) {
  pdl_entry();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);  // [kC][kKS]
  bf16* Ks = Qs + kC * kKS;                      // [kC][kKS]
  bf16* S0 = Ks + kC * kKS;                      // [kDK][kOS]
  bf16* Us = S0 + kDK * kOS;                     // [kC][kOS]
  float* Gs = reinterpret_cast<float*>(Us + kC * kOS);
  const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g4 = lane / 4, t4 = lane % 4, mi = lane / 8, mr = lane % 8;
  const int col0 = blockIdx.z * kOC;
  const int64_t hk = h / (Hv / Hk), t0 = static_cast<int64_t>(c) * kC;
  const int L = static_cast<int>(T - t0 < kC ? T - t0 : kC);
  const int64_t base = static_cast<int64_t>(h) * N + c;
  {
    const bf16* ksrc = wk.kn + base * kC * kDK;
    for (int e = tid; e < kC * kDK / 8; e += kOutThreads) {
      const int i = e / (kDK / 8), d = 8 * (e % (kDK / 8));
      cp_async16(Ks + i * kKS + d, ksrc + i * kDK + d);
    }
    for (int e = tid; e < kDK * kOC / 8; e += kOutThreads) {
      const int i = e / (kOC / 8), d = 8 * (e % (kOC / 8));
      const bool ok = col0 + d < dv;
      cp_async16(S0 + i * kOS + d, ok ? wk.s0 + (base * kDK + i) * dv + col0 + d : wk.s0, ok);
    }
    for (int e = tid; e < kC * kOC / 8; e += kOutThreads) {
      const int i = e / (kOC / 8), d = 8 * (e % (kOC / 8));
      const bool ok = col0 + d < dv;
      cp_async16(Us + i * kOS + d, ok ? wk.u + (base * kC + i) * dv + col0 + d : wk.u, ok);
    }
    if (tid < kC / 4) cp_async16(Gs + 4 * tid, wk.G + base * kC + 4 * tid);
    cp_async_commit();
  }
  load_rows_normalised(q + (t0 * Hk + hk) * kDK, Hk * kDK, L, l2norm, rsqrtf(static_cast<float>(kDK)), Qs, nullptr,
                       warp, kOutThreads / 32, lane);
  cp_async_wait_all();
  __syncthreads();
  const int r0 = warp * 16, rowA = r0 + g4, rowB = rowA + 8;
  // P = Q K^T, causal (j <= i) and decayed by e^{G_i - G_j}.
  float p[8][4] = {};
  gram_rows(Qs, Ks, r0, lane, p);
  const float GA = Gs[rowA], GB = Gs[rowB];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = e < 2 ? rowA : rowB, jj = j * 8 + 2 * t4 + (e & 1);
      p[j][e] = jj <= i ? __expf((e < 2 ? GA : GB) - Gs[jj]) * p[j][e] : 0.f;
    }
  // O = diag(e^G) Q S0 ...
  float o[kOC / 8][4] = {};
#pragma unroll
  for (int kk = 0; kk < kDK / 16; ++kk) {
    uint32_t a0, a1, a2, a3;
    ldmatrix_x4(a0, a1, a2, a3, Qs + (r0 + (mi & 1) * 8 + mr) * kKS + kk * 16 + (mi >> 1) * 8);
#pragma unroll
    for (int n = 0; n < kOC / 8; n += 2) {
      uint32_t b0, b1, c0, c1;
      ldmatrix_x4_trans(b0, b1, c0, c1, S0 + (kk * 16 + (mi & 1) * 8 + mr) * kOS + (n + (mi >> 1)) * 8);
      mma16816(o[n], a0, a1, a2, a3, b0, b1);
      mma16816(o[n + 1], a0, a1, a2, a3, c0, c1);
    }
  }
  const float eA = __expf(GA), eB = __expf(GB);
#pragma unroll
  for (int n = 0; n < kOC / 8; ++n) {
    o[n][0] *= eA, o[n][1] *= eA, o[n][2] *= eB, o[n][3] *= eB;
  }
  // ... + P U, P's accumulator layout being the A operand's.
#pragma unroll
  for (int ks = 0; ks < kC / 16; ++ks) {
    const uint32_t a0 = pack2(p[2 * ks][0], p[2 * ks][1]), a1 = pack2(p[2 * ks][2], p[2 * ks][3]);
    const uint32_t a2 = pack2(p[2 * ks + 1][0], p[2 * ks + 1][1]), a3 = pack2(p[2 * ks + 1][2], p[2 * ks + 1][3]);
#pragma unroll
    for (int n = 0; n < kOC / 8; n += 2) {
      uint32_t b0, b1, c0, c1;
      ldmatrix_x4_trans(b0, b1, c0, c1, Us + (ks * 16 + (mi & 1) * 8 + mr) * kOS + (n + (mi >> 1)) * 8);
      mma16816(o[n], a0, a1, a2, a3, b0, b1);
      mma16816(o[n + 1], a0, a1, a2, a3, c0, c1);
    }
  }
#pragma unroll
  for (int n = 0; n < kOC / 8; ++n) {
    const int cl = col0 + n * 8 + 2 * t4;
    if (cl >= dv) continue;
    if (rowA < L) *reinterpret_cast<float2*>(out + ((t0 + rowA) * Hv + h) * dv + cl) = make_float2(o[n][0], o[n][1]);
    if (rowB < L) *reinterpret_cast<float2*>(out + ((t0 + rowB) * Hv + h) * dv + cl) = make_float2(o[n][2], o[n][3]);
  }
}

void set_smem(const void* fn, size_t bytes) {
  if (bytes > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace

bool gated_delta_chunked_tc_supported(const float* q, const float* k, const float* v, const float* out, int64_t dk,
                                      int64_t dv) {
  return dk == kDK && dv > 0 && dv <= 256 && dv % kNC == 0 && aligned16(q) && aligned16(k) && aligned16(v) &&
         reinterpret_cast<uintptr_t>(out) % 8 == 0;
}

int64_t gated_delta_chunked_tc_workspace_bytes(int64_t T, int64_t Hv, int64_t dk, int64_t dv) {
  const int64_t N = (T + kC - 1) / kC, HN = Hv * N;
  return HN * (2 * (2 * kC * dk + 2 * kC * dv + dk * dv) + 4 * kC);
}

void launch_gated_delta_rule_chunked_tc(cudaStream_t s, const float* q, const float* k, const float* v, const float* g,
                                        const float* beta, bool l2norm_qk, int64_t T, int64_t Hk, int64_t Hv,
                                        int64_t dv, float* state, float* out, float* transition, void* workspace) {
  if (Hv == 0 || T == 0) return;
  const int64_t N = (T + kC - 1) / kC;
  const TcWork w = carve(workspace, Hv, N, dv);
  const int idv = static_cast<int>(dv);

  const size_t prep_smem = static_cast<size_t>(kC * kKS + kC * (dv + 8) + 2 * kC * kAS) * 2 +
                           static_cast<size_t>(kC * (kC + 1) + 2 * kC) * 4;
  set_smem(reinterpret_cast<const void*>(k_tc_prep), prep_smem);
  launch(s, dim3(static_cast<unsigned>(N), static_cast<unsigned>(Hv)), kPrepThreads, prep_smem, k_tc_prep, k, v, g,
         beta, l2norm_qk, T, Hk, Hv, idv, N, w);
  CUDA_LAUNCH_CHECK("k_tc_prep");

  set_smem(reinterpret_cast<const void*>(k_tc_state), kStateSmem);
  const int64_t ncols = dv + (transition ? kDK : 0);
  launch(s, dim3(static_cast<unsigned>(ncols / kNC), static_cast<unsigned>(Hv)), kStateThreads, kStateSmem, k_tc_state,
         N, idv, w, state, transition);
  CUDA_LAUNCH_CHECK("k_tc_state");

  set_smem(reinterpret_cast<const void*>(k_tc_out), kOutSmem);
  launch(s, dim3(static_cast<unsigned>(N), static_cast<unsigned>(Hv), static_cast<unsigned>((dv + kOC - 1) / kOC)),
         kOutThreads, kOutSmem, k_tc_out, q, l2norm_qk, T, Hk, Hv, idv, N, w, out);
  CUDA_LAUNCH_CHECK("k_tc_out");
}

}  // namespace hypic::cuda
