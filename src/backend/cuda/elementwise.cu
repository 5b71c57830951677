// Elementwise ops, norms, rotary embedding, gates, causal conv1d and row movement on the GPU.
// Arithmetic follows the CPU backend (f32, the same formulas) so the two agree to rounding.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace hypic::cuda {

namespace {

constexpr int kThreads = 256;

inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, 1 << 20)));
}

inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// One element of a weight tensor of any float dtype, as f32.
__device__ __forceinline__ float ldw(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::BF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::F16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
__device__ float block_sum(float v) {
  __shared__ float part[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  __syncthreads();  // `part` may still be read from a previous call
  if (l == 0) part[w] = v;
  __syncthreads();
  float t = 0.f;
  const int nw = blockDim.x / 32;
  for (int i = 0; i < nw; ++i) t += part[i];
  return t;
}

__global__ void k_fill(float* p, int64_t n, float v) {
  pdl_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = v;
}

__global__ void k_convert(const float* x, DType to, void* y, int64_t n) {
  pdl_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (to == DType::BF16)
      static_cast<__nv_bfloat16*>(y)[i] = __float2bfloat16_rn(x[i]);
    else
      static_cast<__half*>(y)[i] = __float2half_rn(x[i]);
  }
}

__global__ void k_to_f32(const void* x, DType from, float* y, int64_t n) {
  pdl_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = from == DType::BF16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(x)[i])
                               : __half2float(static_cast<const __half*>(x)[i]);
}

__global__ void k_convert4(const float4* x, DType to, void* y, int64_t n4) {
  pdl_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = x[i];
    union {
      __nv_bfloat162 b[2];
      __half2 h[2];
      uint2 u;
    } o;
    if (to == DType::BF16) {
      o.b[0] = __floats2bfloat162_rn(v.x, v.y);
      o.b[1] = __floats2bfloat162_rn(v.z, v.w);
    } else {
      o.h[0] = __floats2half2_rn(v.x, v.y);
      o.h[1] = __floats2half2_rn(v.z, v.w);
    }
    static_cast<uint2*>(y)[i] = o.u;
  }
}

// x = p0 + p1 + p2, each part the half-precision rounding of what the previous parts left: 3 x 8
// mantissa bits for bf16, as many as f32 has.
template <typename H>
__device__ __forceinline__ void split3(float x, H* p0, H* p1, H* p2, int64_t i);
template <>
__device__ __forceinline__ void split3(float x, __nv_bfloat16* p0, __nv_bfloat16* p1, __nv_bfloat16* p2, int64_t i) {
  const __nv_bfloat16 a = __float2bfloat16_rn(x);
  const float r = x - __bfloat162float(a);
  const __nv_bfloat16 b = __float2bfloat16_rn(r);
  p0[i] = a;
  p1[i] = b;
  p2[i] = __float2bfloat16_rn(r - __bfloat162float(b));
}
template <>
__device__ __forceinline__ void split3(float x, __half* p0, __half* p1, __half* p2, int64_t i) {
  const __half a = __float2half_rn(x);
  const float r = x - __half2float(a);
  const __half b = __float2half_rn(r);
  p0[i] = a;
  p1[i] = b;
  p2[i] = __float2half_rn(r - __half2float(b));
}

__global__ void k_split(const float* x, DType to, void* p0, void* p1, void* p2, int64_t n) {
  pdl_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (to == DType::BF16)
      split3(x[i], static_cast<__nv_bfloat16*>(p0), static_cast<__nv_bfloat16*>(p1), static_cast<__nv_bfloat16*>(p2),
             i);
    else
      split3(x[i], static_cast<__half*>(p0), static_cast<__half*>(p1), static_cast<__half*>(p2), i);
  }
}

__global__ void k_embedding(const void* table, DType dt, const int32_t* ids, int64_t n, int64_t H, float* out) {
  pdl_entry();
  const int64_t r = blockIdx.x;
  const int64_t base = static_cast<int64_t>(ids[r]) * H;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) out[r * H + c] = ldw(table, dt, base + c);
}

__global__ void k_rms_norm(const float* x, const void* w, DType wdt, float eps, bool one_plus_w, float* out,
                           int64_t D) {
  pdl_entry();
  const float* xr = x + blockIdx.x * D;
  float* o = out + blockIdx.x * D;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    float wv = ldw(w, wdt, i);
    if (one_plus_w) wv = 1.0f + wv;
    o[i] = (xr[i] * inv) * wv;
  }
}

// x += d, out = rms_norm(x): each thread rereads only the elements it wrote itself.
__global__ void k_add_rms_norm(float* x, const float* d, const void* w, DType wdt, float eps, bool one_plus_w,
                               float* out, int64_t D) {
  pdl_entry();
  float* xr = x + blockIdx.x * D;
  const float* dr = d + blockIdx.x * D;
  float* o = out + blockIdx.x * D;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = xr[i] + dr[i];
    xr[i] = v;
    ss += v * v;
  }
  ss = block_sum(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    float wv = ldw(w, wdt, i);
    if (one_plus_w) wv = 1.0f + wv;
    o[i] = (xr[i] * inv) * wv;
  }
}

__global__ void k_rms_norm_gated(const float* x, const float* z, const void* w, DType wdt, float eps, float* out,
                                 int64_t D) {
  pdl_entry();
  const float* xr = x + blockIdx.x * D;
  const float* zr = z + blockIdx.x * D;
  float* o = out + blockIdx.x * D;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) o[i] = ldw(w, wdt, i) * (xr[i] * inv) * silu(zr[i]);
}

// Short rows (a head's 128 or 256 channels: the gated output norm of GDN, q/k norms): one warp per
// row with float4 loads and a shuffle sum, 8 rows a block. One block per row gave ~1M blocks of 64
// threads and two barriers each (35B-A3B 32k prefill: the gated norm at ~1/3 of the memory's rate).
// D == 128 * N4; z (gated form) may be null.
template <int N4>
__global__ void __launch_bounds__(256) k_rms_norm_warp(const float* x, const float* z, const void* w, DType wdt,
                                                       float eps, bool one_plus_w, float* out, int64_t R) {
  pdl_entry();
  constexpr int D = 128 * N4;
  const int64_t r = blockIdx.x * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= R) return;
  const float4* xr = reinterpret_cast<const float4*>(x + r * D);
  float4 v[N4];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < N4; ++j) {
    v[j] = xr[lane + 32 * j];
    ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
  }
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
  float4* orow = reinterpret_cast<float4*>(out + r * D);
#pragma unroll
  for (int j = 0; j < N4; ++j) {
    const int c = 4 * (lane + 32 * j);
    float wv[4] = {ldw(w, wdt, c), ldw(w, wdt, c + 1), ldw(w, wdt, c + 2), ldw(w, wdt, c + 3)};
    float o[4] = {v[j].x * inv, v[j].y * inv, v[j].z * inv, v[j].w * inv};
    if (z) {
      const float4 zv = reinterpret_cast<const float4*>(z + r * D)[lane + 32 * j];
      const float zz[4] = {zv.x, zv.y, zv.z, zv.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) o[k] = wv[k] * o[k] * silu(zz[k]);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) o[k] = o[k] * (one_plus_w ? 1.0f + wv[k] : wv[k]);
    }
    orow[lane + 32 * j] = make_float4(o[0], o[1], o[2], o[3]);
  }
}

// Hidden-size rows (D == 1024 * N4: 2048, 4096): 256 threads a row, each holding N4 float4 in
// registers, so x is read once (the generic kernel reads it twice with 1024 threads of 2 floats).
// With d: x += d first and x is written back (add_rms_norm).
template <int N4>
__global__ void __launch_bounds__(256)
    k_rms_norm_row(float* x, const float* d, const void* w, DType wdt, float eps, bool one_plus_w, float* out) {
  pdl_entry();
  constexpr int D = 1024 * N4;
  float4* xr = reinterpret_cast<float4*>(x + blockIdx.x * int64_t(D));
  float4 v[N4];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < N4; ++j) {
    const int i = threadIdx.x + 256 * j;
    v[j] = xr[i];
    if (d) {
      const float4 dv = reinterpret_cast<const float4*>(d + blockIdx.x * int64_t(D))[i];
      v[j] = make_float4(v[j].x + dv.x, v[j].y + dv.y, v[j].z + dv.z, v[j].w + dv.w);
      xr[i] = v[j];
    }
    ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
  }
  ss = block_sum(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
  float4* orow = reinterpret_cast<float4*>(out + blockIdx.x * int64_t(D));
#pragma unroll
  for (int j = 0; j < N4; ++j) {
    const int i = threadIdx.x + 256 * j, c = 4 * i;
    float wv[4] = {ldw(w, wdt, c), ldw(w, wdt, c + 1), ldw(w, wdt, c + 2), ldw(w, wdt, c + 3)};
#pragma unroll
    for (int k = 0; k < 4; ++k) wv[k] = one_plus_w ? 1.0f + wv[k] : wv[k];
    orow[i] = make_float4(v[j].x * inv * wv[0], v[j].y * inv * wv[1], v[j].z * inv * wv[2], v[j].w * inv * wv[3]);
  }
}

// Launches k_rms_norm_row where D and the pointers allow it; false otherwise.
bool launch_rms_norm_row(cudaStream_t s, float* x, const float* d, const void* w, DType wdt, float eps, bool one_plus_w,
                         float* out, int64_t R, int64_t D) {
  if (!(D == 1024 || D == 2048 || D == 4096) || !aligned16(x) || !aligned16(out) || (d && !aligned16(d))) return false;
  const unsigned blocks = static_cast<unsigned>(R);
  if (D == 1024)
    launch(s, blocks, 256, 0, k_rms_norm_row<1>, x, d, w, wdt, eps, one_plus_w, out);
  else if (D == 2048)
    launch(s, blocks, 256, 0, k_rms_norm_row<2>, x, d, w, wdt, eps, one_plus_w, out);
  else
    launch(s, blocks, 256, 0, k_rms_norm_row<4>, x, d, w, wdt, eps, one_plus_w, out);
  CUDA_LAUNCH_CHECK("k_rms_norm_row");
  return true;
}

// Launches k_rms_norm_warp where D and the pointers allow it; false otherwise.
bool launch_rms_norm_warp(cudaStream_t s, const float* x, const float* z, const void* w, DType wdt, float eps,
                          bool one_plus_w, float* out, int64_t R, int64_t D) {
  if (!(D == 128 || D == 256 || D == 512) || !aligned16(x) || !aligned16(out) || (z && !aligned16(z))) return false;
  const unsigned blocks = static_cast<unsigned>((R + 7) / 8);
  if (D == 128)
    launch(s, blocks, 256, 0, k_rms_norm_warp<1>, x, z, w, wdt, eps, one_plus_w, out, R);
  else if (D == 256)
    launch(s, blocks, 256, 0, k_rms_norm_warp<2>, x, z, w, wdt, eps, one_plus_w, out, R);
  else
    launch(s, blocks, 256, 0, k_rms_norm_warp<4>, x, z, w, wdt, eps, one_plus_w, out, R);
  CUDA_LAUNCH_CHECK("k_rms_norm_warp");
  return true;
}

__global__ void k_binary(BinOp op, const float* a, const float* b, float* out, int64_t n) {
  pdl_entry();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float u = a[i], v = b[i];
    out[i] = op == BinOp::Add ? u + v : op == BinOp::SiluMul ? silu(u) * v : u * sigmoid(v);
  }
}

__global__ void k_sigmoid_mul_rows(const float* x, const float* gate, float* out, int64_t R, int64_t C) {
  pdl_entry();
  const int64_t n = R * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = x[i] * sigmoid(gate[i / C]);
}

template <typename E>
__global__ void k_copy_cols(const E* src, int64_t sc, int64_t scol, E* dst, int64_t dc, int64_t dcol, int64_t R,
                            int64_t W) {
  pdl_entry();
  const int64_t n = R * W;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / W, j = i % W;
    dst[r * dc + dcol + j] = src[r * sc + scol + j];
  }
}

// One block per row t; angles as the CPU backend: f32(pos) * inv_freq in f32, cos/sin in f64.
// The NeoX rotation of the pair (x1, x2) = (r[i], r[i + half]) by position p: its first or second
// element (k_rope_neox and k_copy_rows share it, so a spliced key equals copy + rope_neox). The
// angle's cosine and sine in double, as the CPU backend.
__device__ __forceinline__ float rope_rotated(float x1, float x2, float p, float inv_freq, bool second) {
  const float ang = p * inv_freq;
  const float c = static_cast<float>(cos(static_cast<double>(ang)));
  const float s = static_cast<float>(sin(static_cast<double>(ang)));
  return second ? x2 * c + x1 * s : x1 * c - x2 * s;
}

__global__ void k_rope_neox(float* x, int64_t H, int64_t D, const int64_t* pos, const float* inv_freq, int half) {
  pdl_entry();
  const int64_t t = blockIdx.x;
  const float p = static_cast<float>(pos[t]);
  for (int64_t e = threadIdx.x; e < H * half; e += blockDim.x) {
    const int64_t h = e / half;
    const int i = static_cast<int>(e % half);
    float* r = x + (t * H + h) * D;
    const float x1 = r[i], x2 = r[i + half];
    r[i] = rope_rotated(x1, x2, p, inv_freq[i], false);
    r[i + half] = rope_rotated(x1, x2, p, inv_freq[i], true);
  }
}

__global__ void k_gdn_gates(const float* a, const float* b, const void* A_log, DType adt, const void* dt_bias,
                            DType bdt, float* g, float* beta, int64_t T, int64_t H) {
  pdl_entry();
  const int64_t n = T * H;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = i % H;
    const float u = a[i] + ldw(dt_bias, bdt, h);
    const float sp = u > 20.f ? u : log1pf(expf(u));  // torch softplus, threshold 20
    g[i] = -expf(ldw(A_log, adt, h)) * sp;
    beta[i] = sigmoid(b[i]);
  }
}

// out[t, c] = silu(sum_j w[c, j] * xx(t + j)), xx = state rows (K-1, oldest first) then x rows.
__global__ void k_conv1d(const float* x, const void* w, DType wdt, const float* state, ColSplit out, int64_t T,
                         int64_t C, int64_t K) {
  pdl_entry();
  const int64_t n = T * C, P = K - 1;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / C, c = i % C;
    float acc = 0.f;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t r = t + j;
      const float xv = r < P ? state[r * C + c] : x[(r - P) * C + c];
      acc += ldw(w, wdt, c * K + j) * xv;
    }
    *out.at(t, c) = silu(acc);
  }
}

// The same for 4 adjacent channels a thread over kConvRows rows: a sliding window of K inputs in
// registers, so each input row is read once per tile (not K times) and the weights once per
// thread; 16-byte loads across the channels of a warp. C % 4 == 0, 16-byte aligned rows.
constexpr int kConvRows = 16;
template <int K>
__global__ void k_conv1d_tiled(const float* __restrict__ x, const void* __restrict__ w, DType wdt,
                               const float* __restrict__ state, ColSplit out, int64_t T, int64_t C) {
  pdl_entry();
  const int64_t c = 4 * (blockIdx.x * int64_t(blockDim.x) + threadIdx.x);
  if (c >= C) return;
  constexpr int P = K - 1;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kConvRows;
  float4 wv[K];
#pragma unroll
  for (int j = 0; j < K; ++j)
    wv[j] = make_float4(ldw(w, wdt, c * K + j), ldw(w, wdt, (c + 1) * K + j), ldw(w, wdt, (c + 2) * K + j),
                        ldw(w, wdt, (c + 3) * K + j));
  auto in = [&](int64_t r) {  // row r of (state ++ x)
    return r < P ? *reinterpret_cast<const float4*>(state + r * C + c)
                 : *reinterpret_cast<const float4*>(x + (r - P) * C + c);
  };
  float4 win[K];
#pragma unroll
  for (int j = 0; j < K - 1; ++j) win[j] = t0 + j < T + P ? in(t0 + j) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int i = 0; i < kConvRows; ++i) {
    const int64_t t = t0 + i;
    if (t >= T) break;
    win[K - 1] = in(t + K - 1);
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      a.x += wv[j].x * win[j].x;
      a.y += wv[j].y * win[j].y;
      a.z += wv[j].z * win[j].z;
      a.w += wv[j].w * win[j].w;
    }
    *reinterpret_cast<float4*>(out.at(t, c)) = make_float4(silu(a.x), silu(a.y), silu(a.z), silu(a.w));
#pragma unroll
    for (int j = 0; j < K - 1; ++j) win[j] = win[j + 1];
  }
}

// Of n ranges sorted by their first row (start(k), start(0) <= t), the last one starting at or
// before row t: a binary search (the ranges of a call are few, their rows many).
template <typename F>
__device__ __forceinline__ int last_starting_by(int n, int64_t t, F start) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (start(mid) <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The same over groups of rows, each from its own K-1 earlier inputs (a PIC composition's seams).
__global__ void k_conv1d_spans(const float* x, const void* w, DType wdt, const ConvGroup* G, int ng, ColSplit out,
                               int64_t T, int64_t C, int64_t K) {
  pdl_entry();
  const int64_t n = T * C, P = K - 1;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / C, c = i % C;
    const ConvGroup g = G[last_starting_by(ng, t, [&](int k) { return G[k].row0; })];
    float acc = 0.f;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t r = t - g.row0 + j;
      const float xv = r < P ? g.start[r * C + c] : x[(g.row0 + r - P) * C + c];
      acc += ldw(w, wdt, c * K + j) * xv;
    }
    *out.at(t, c) = silu(acc);
  }
}

// The state becomes rows T .. T+K-2 of (start ++ x); ascending order per channel is safe in place
// (start == state).
__global__ void k_conv1d_state(const float* x, const float* start, float* state, int64_t T, int64_t C, int64_t K) {
  pdl_entry();
  const int64_t P = K - 1;
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < C; c += int64_t(gridDim.x) * blockDim.x)
    for (int64_t r = 0; r < P; ++r) {
      const int64_t src = T + r;
      state[r * C + c] = src < P ? start[src * C + c] : x[(src - P) * C + c];
    }
}

// One block per row of the launch; the piece found by binary search over the pieces' first rows.
// Rotation by rope_rotated, as k_rope_neox: a spliced key equals copy + rope_neox.
__global__ void k_copy_rows(const RowPiece* P, int n, int64_t total, const float* inv_freq, int half) {
  pdl_entry();
  for (int64_t r = blockIdx.x; r < total; r += gridDim.x) {
    const RowPiece p = P[last_starting_by(n, r, [&](int k) { return P[k].first; })];
    const int64_t i = r - p.first;
    const float* src = reinterpret_cast<const float*>(p.src) + i * p.words;
    float* dst = reinterpret_cast<float*>(p.dst) + i * p.words;
    if (p.shift == 0) {
      if (p.words % 4 == 0 && ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
        const float4* s4 = reinterpret_cast<const float4*>(src);
        float4* d4 = reinterpret_cast<float4*>(dst);
        for (int64_t e = threadIdx.x; e < p.words / 4; e += blockDim.x) d4[e] = s4[e];
      } else {
        for (int64_t e = threadIdx.x; e < p.words; e += blockDim.x) dst[e] = src[e];
      }
      continue;
    }
    const float pos = static_cast<float>(p.shift);
    for (int64_t e = threadIdx.x; e < p.words; e += blockDim.x) {
      const int64_t j = e % p.head_dim;
      if (j >= 2 * half) {
        dst[e] = src[e];
        continue;
      }
      const bool second = j >= half;
      const int64_t e1 = second ? e - half : e;  // the pair's first element
      dst[e] = rope_rotated(src[e1], src[e1 + half], pos, inv_freq[second ? j - half : j], second);
    }
  }
}

// Decode step: one token per sequence, each with its own state (addresses in `states`). A thread
// owns one channel of one sequence, so it may shift that channel's state in place after reading it.
__global__ void k_conv1d_step(const float* x, const void* w, DType wdt, const int64_t* states, float* out, int64_t B,
                              int64_t C, int64_t K) {
  pdl_entry();
  const int64_t n = B * C, P = K - 1;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / C, c = i % C;
    float* st = reinterpret_cast<float*>(states[b]);
    const float xv = x[i];
    float acc = 0.f;
    for (int64_t j = 0; j < P; ++j) acc += ldw(w, wdt, c * K + j) * st[j * C + c];
    acc += ldw(w, wdt, c * K + P) * xv;
    out[i] = silu(acc);
    for (int64_t j = 0; j + 1 < P; ++j) st[j * C + c] = st[(j + 1) * C + c];
    if (P > 0) st[(P - 1) * C + c] = xv;
  }
}

// Row positions[b] of sequence b's key and value caches <- k[b], v[b].
__global__ void k_kv_write(const float* k, const float* v, const int64_t* caches, const int64_t* positions, int64_t B,
                           int64_t nk, int64_t nv) {
  pdl_entry();
  const int64_t b = blockIdx.x, p = positions[b];
  float* kc = reinterpret_cast<float*>(caches[b]) + p * nk;
  float* vc = reinterpret_cast<float*>(caches[B + b]) + p * nv;
  for (int64_t i = threadIdx.x; i < nk; i += blockDim.x) kc[i] = k[b * nk + i];
  for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) vc[i] = v[b * nv + i];
}

// One block per row: each thread keeps its first maximum, then the block keeps the lowest id among
// the threads' (torch.argmax's tie rule).
__global__ void k_argmax_rows(const float* x, int64_t V, int32_t* ids) {
  pdl_entry();
  const float* r = x + blockIdx.x * V;
  float best = -INFINITY;
  int64_t at = -1;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x)
    if (at < 0 || r[i] > best) best = r[i], at = i;
  __shared__ float sv[32];
  __shared__ int64_t si[32];
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  auto better = [](float v, int64_t i, float bv, int64_t bi) {
    return bi < 0 || (i >= 0 && (v > bv || (v == bv && i < bi)));
  };
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best, o);
    const int64_t i = __shfl_xor_sync(0xffffffffu, at, o);
    if (better(v, i, best, at)) best = v, at = i;
  }
  if (lane == 0) sv[w] = best, si[w] = at;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int k = 1; k < static_cast<int>(blockDim.x / 32); ++k)
      if (better(sv[k], si[k], best, at)) best = sv[k], at = si[k];
    ids[blockIdx.x] = static_cast<int32_t>(at < 0 ? 0 : at);
  }
}

__global__ void k_set_identity(float* t, int64_t H, int64_t n) {
  pdl_entry();
  const int64_t total = H * n * n;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = (i / n) % n, c = i % n;
    t[i] = r == c ? 1.f : 0.f;
  }
}

__global__ void k_gather_rows(const float* x, const int32_t* idx, float* out, int64_t H) {
  pdl_entry();
  const int64_t r = blockIdx.x;
  const int32_t i = idx[r];
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x)
    out[r * H + c] = i < 0 ? 0.f : x[static_cast<int64_t>(i) * H + c];
}

// The same, written in a 16-bit type (the MoE products' input: one pass instead of gather + convert).
template <typename H16>
__global__ void k_gather_rows_half(const float* x, const int32_t* idx, H16* out, int64_t H) {
  pdl_entry();
  const int64_t r = blockIdx.x;
  const int32_t i = idx[r];
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    const float f = i < 0 ? 0.f : x[static_cast<int64_t>(i) * H + c];
    if constexpr (std::is_same_v<H16, __nv_bfloat16>)
      out[r * H + c] = __float2bfloat16_rn(f);
    else
      out[r * H + c] = __float2half_rn(f);
  }
}

// With a tail, the rest of the MoE block in the same pass, in moe_experts_add's order of f32
// operations (the routed sum, + shared * sigmoid(gate), then the residual add), so the result is
// the same as the three separate kernels'. Block (t, column block): the token's slot rows and
// weights go to shared memory first, so a thread's top_k loads do not each wait on a pos load
// (one block of a decode token walking pos -> y eight times took ~6.6 us for 2048 columns).
constexpr int kCombineThreads = 256, kCombineMaxK = 64;
__global__ void __launch_bounds__(kCombineThreads)
    k_moe_combine(const float* y, const int32_t* pos, const float* w, int top_k, int64_t H, float* out, MoeTail tail) {
  pdl_entry();
  const int64_t t = blockIdx.x;
  __shared__ int64_t s_row[kCombineMaxK];
  __shared__ float s_w[kCombineMaxK];
  for (int j = threadIdx.x; j < top_k; j += blockDim.x) {
    s_row[j] = (pos ? pos[t * top_k + j] : t * top_k + j) * H;
    s_w[j] = w[t * top_k + j];
  }
  __syncthreads();
  const float sg = tail.shared ? sigmoid(tail.shared_gate[t]) : 0.f;
  for (int64_t c = blockIdx.y * int64_t(blockDim.x) + threadIdx.x; c < H; c += int64_t(gridDim.y) * blockDim.x) {
    float acc = 0.f;
#pragma unroll 8
    for (int j = 0; j < top_k; ++j) acc += s_w[j] * y[s_row[j] + c];
    // Rounded as the separate kernels round (no fused multiply-add).
    if (tail.shared) acc = __fadd_rn(acc, __fmul_rn(tail.shared[t * H + c], sg));
    out[t * H + c] = tail.residual ? __fadd_rn(out[t * H + c], acc) : acc;
  }
}

int row_threads(int64_t D) {
  return D >= 1024 ? 1024 : D >= 256 ? 256 : D >= 64 ? 64 : 32;
}

// out = a x + b y.
__global__ void k_scale_add(const float* x, float a, const float* y, float b, float* out, int64_t n) {
  pdl_entry();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = a * x[i] + b * y[i];
}

// act 0: SiLU; act 1: ReLU^2.
__global__ void k_activate(int act, float* x, int64_t n) {
  pdl_entry();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = x[i];
    x[i] = act == 0 ? silu(v) : (v > 0.f ? v * v : 0.f);
  }
}

}  // namespace

namespace {
thread_local bool t_graph_recording = false;
}
void set_graph_recording(bool on) {
  t_graph_recording = on;
}
bool graph_recording() {
  return t_graph_recording;
}

void launch_fill(cudaStream_t s, float* p, int64_t n, float v) {
  if (n == 0) return;
  launch(s, blocks_for(n), kThreads, 0, k_fill, p, n, v);
  CUDA_LAUNCH_CHECK("k_fill");
}

void launch_to_f32(cudaStream_t s, const void* x, DType from, float* y, int64_t n) {
  if (n == 0) return;
  launch(s, blocks_for(n), kThreads, 0, k_to_f32, x, from, y, n);
  CUDA_LAUNCH_CHECK("k_to_f32");
}

void launch_convert_f32(cudaStream_t s, const float* x, DType to, void* y, int64_t n) {
  if (n == 0) return;
  // Four elements a thread (16-byte loads, 8-byte stores) where the addresses allow: the whole K/V
  // cache goes through here per flash attention call, at ~1.2 TB/s one element a thread.
  if (n % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 8 == 0) {
    launch(s, blocks_for(n / 4), kThreads, 0, k_convert4, reinterpret_cast<const float4*>(x), to, y, n / 4);
    CUDA_LAUNCH_CHECK("k_convert4");
    return;
  }
  launch(s, blocks_for(n), kThreads, 0, k_convert, x, to, y, n);
  CUDA_LAUNCH_CHECK("k_convert");
}

void launch_split_f32(cudaStream_t s, const float* x, DType to, void* p0, void* p1, void* p2, int64_t n) {
  if (n == 0) return;
  launch(s, blocks_for(n), kThreads, 0, k_split, x, to, p0, p1, p2, n);
  CUDA_LAUNCH_CHECK("k_split");
}

void launch_embedding(cudaStream_t s, const void* table, DType dt, const int32_t* ids, int64_t n, int64_t H,
                      float* out) {
  if (n == 0) return;
  launch(s, static_cast<unsigned>(n), row_threads(H), 0, k_embedding, table, dt, ids, n, H, out);
  CUDA_LAUNCH_CHECK("k_embedding");
}

void launch_rms_norm(cudaStream_t s, const float* x, const void* w, DType wdt, float eps, bool one_plus_w, float* out,
                     int64_t R, int64_t D) {
  if (R == 0) return;
  if (launch_rms_norm_warp(s, x, nullptr, w, wdt, eps, one_plus_w, out, R, D)) return;
  // x is only read (d null): the const_cast never writes through it.
  if (launch_rms_norm_row(s, const_cast<float*>(x), nullptr, w, wdt, eps, one_plus_w, out, R, D)) return;
  launch(s, static_cast<unsigned>(R), row_threads(D), 0, k_rms_norm, x, w, wdt, eps, one_plus_w, out, D);
  CUDA_LAUNCH_CHECK("k_rms_norm");
}

void launch_add_rms_norm(cudaStream_t s, float* x, const float* d, const void* w, DType wdt, float eps, bool one_plus_w,
                         float* out, int64_t R, int64_t D) {
  if (R == 0) return;
  if (launch_rms_norm_row(s, x, d, w, wdt, eps, one_plus_w, out, R, D)) return;
  launch(s, static_cast<unsigned>(R), row_threads(D), 0, k_add_rms_norm, x, d, w, wdt, eps, one_plus_w, out, D);
  CUDA_LAUNCH_CHECK("k_add_rms_norm");
}

void launch_rms_norm_gated(cudaStream_t s, const float* x, const float* z, const void* w, DType wdt, float eps,
                           float* out, int64_t R, int64_t D) {
  if (R == 0) return;
  if (launch_rms_norm_warp(s, x, z, w, wdt, eps, false, out, R, D)) return;
  launch(s, static_cast<unsigned>(R), row_threads(D), 0, k_rms_norm_gated, x, z, w, wdt, eps, out, D);
  CUDA_LAUNCH_CHECK("k_rms_norm_gated");
}

void launch_binary(cudaStream_t s, BinOp op, const float* a, const float* b, float* out, int64_t n) {
  if (n == 0) return;
  launch(s, blocks_for(n), kThreads, 0, k_binary, op, a, b, out, n);
  CUDA_LAUNCH_CHECK("k_binary");
}

void launch_sigmoid_mul_rows(cudaStream_t s, const float* x, const float* gate, float* out, int64_t R, int64_t C) {
  if (R * C == 0) return;
  launch(s, blocks_for(R * C), kThreads, 0, k_sigmoid_mul_rows, x, gate, out, R, C);
  CUDA_LAUNCH_CHECK("k_sigmoid_mul_rows");
}

void launch_copy_cols(cudaStream_t s, const void* src, int64_t src_cols, int64_t scol, void* dst, int64_t dst_cols,
                      int64_t dcol, int64_t R, int64_t W, size_t es) {
  if (R * W == 0) return;
  const unsigned b = blocks_for(R * W);
  switch (es) {
    case 1:
      launch(s, b, kThreads, 0, k_copy_cols<uint8_t>, static_cast<const uint8_t*>(src), src_cols, scol,
             static_cast<uint8_t*>(dst), dst_cols, dcol, R, W);
      break;
    case 2:
      launch(s, b, kThreads, 0, k_copy_cols<uint16_t>, static_cast<const uint16_t*>(src), src_cols, scol,
             static_cast<uint16_t*>(dst), dst_cols, dcol, R, W);
      break;
    case 4:
      launch(s, b, kThreads, 0, k_copy_cols<uint32_t>, static_cast<const uint32_t*>(src), src_cols, scol,
             static_cast<uint32_t*>(dst), dst_cols, dcol, R, W);
      break;
    default:
      launch(s, b, kThreads, 0, k_copy_cols<uint64_t>, static_cast<const uint64_t*>(src), src_cols, scol,
             static_cast<uint64_t*>(dst), dst_cols, dcol, R, W);
  }
  CUDA_LAUNCH_CHECK("k_copy_cols");
}

void launch_rope_neox(cudaStream_t s, float* x, int64_t T, int64_t H, int64_t D, const int64_t* pos,
                      const float* inv_freq, int half) {
  if (T == 0 || H == 0) return;
  launch(s, static_cast<unsigned>(T), row_threads(H * half), 0, k_rope_neox, x, H, D, pos, inv_freq, half);
  CUDA_LAUNCH_CHECK("k_rope_neox");
}

void launch_gdn_gates(cudaStream_t s, const float* a, const float* b, const void* A_log, DType adt, const void* dt_bias,
                      DType bdt, float* g, float* beta, int64_t T, int64_t H) {
  if (T * H == 0) return;
  launch(s, blocks_for(T * H), kThreads, 0, k_gdn_gates, a, b, A_log, adt, dt_bias, bdt, g, beta, T, H);
  CUDA_LAUNCH_CHECK("k_gdn_gates");
}

bool ColSplit::vec4_ok() const {
  const bool one = end0 == C;
  return end0 % 4 == 0 && end1 % 4 == 0 && C % 4 == 0 && aligned16(p0) && (one || (aligned16(p1) && aligned16(p2)));
}

void launch_conv1d_rows(cudaStream_t s, const float* x, const void* w, DType wdt, const float* start,
                        const ColSplit& out, int64_t T, int64_t C, int64_t K) {
  if (T == 0 || C == 0) return;
  const float* state = start;
  const bool tiled = C % 4 == 0 && K >= 2 && K <= 4 && aligned16(x) && out.vec4_ok() && aligned16(state);
  if (tiled) {
    const dim3 grid(static_cast<unsigned>((C / 4 + kThreads - 1) / kThreads),
                    static_cast<unsigned>((T + kConvRows - 1) / kConvRows));
    if (K == 4)
      launch(s, grid, kThreads, 0, k_conv1d_tiled<4>, x, w, wdt, static_cast<const float*>(state), out, T, C);
    else if (K == 3)
      launch(s, grid, kThreads, 0, k_conv1d_tiled<3>, x, w, wdt, static_cast<const float*>(state), out, T, C);
    else
      launch(s, grid, kThreads, 0, k_conv1d_tiled<2>, x, w, wdt, static_cast<const float*>(state), out, T, C);
    CUDA_LAUNCH_CHECK("k_conv1d_tiled");
  } else {
    launch(s, blocks_for(T * C), kThreads, 0, k_conv1d, x, w, wdt, state, out, T, C, K);
    CUDA_LAUNCH_CHECK("k_conv1d");
  }
}

void launch_causal_conv1d_silu(cudaStream_t s, const float* x, const void* w, DType wdt, float* state, float* out,
                               int64_t T, int64_t C, int64_t K) {
  if (T == 0 || C == 0) return;
  launch_conv1d_rows(s, x, w, wdt, state, ColSplit::whole(out, C), T, C, K);
  if (K > 1) {
    launch(s, blocks_for(C), kThreads, 0, k_conv1d_state, x, static_cast<const float*>(state), state, T, C, K);
    CUDA_LAUNCH_CHECK("k_conv1d_state");
  }
}

void launch_conv1d_spans(cudaStream_t s, const float* x, const void* w, DType wdt, const ConvGroup* groups,
                         int n_groups, const ColSplit& out, int64_t T, int64_t C, int64_t K) {
  if (T == 0 || C == 0 || n_groups == 0) return;
  launch(s, blocks_for(T * C), kThreads, 0, k_conv1d_spans, x, w, wdt, groups, n_groups, out, T, C, K);
  CUDA_LAUNCH_CHECK("k_conv1d_spans");
}

void launch_conv1d_state(cudaStream_t s, const float* x, const float* start, float* state, int64_t T, int64_t C,
                         int64_t K) {
  if (C == 0 || K <= 1) return;
  launch(s, blocks_for(C), kThreads, 0, k_conv1d_state, x, start, state, T, C, K);
  CUDA_LAUNCH_CHECK("k_conv1d_state");
}

void launch_copy_rows(cudaStream_t s, const RowPiece* pieces, int n, int64_t total_rows, const float* inv_freq,
                      int half) {
  if (n == 0 || total_rows == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(total_rows, int64_t(1) << 20));
  launch(s, blocks, 128, 0, k_copy_rows, pieces, n, total_rows, inv_freq, half);
  CUDA_LAUNCH_CHECK("k_copy_rows");
}

void launch_conv1d_step(cudaStream_t s, const float* x, const void* w, DType wdt, const int64_t* states, float* out,
                        int64_t B, int64_t C, int64_t K) {
  if (B == 0 || C == 0) return;
  launch(s, blocks_for(B * C), kThreads, 0, k_conv1d_step, x, w, wdt, states, out, B, C, K);
  CUDA_LAUNCH_CHECK("k_conv1d_step");
}

void launch_kv_write(cudaStream_t s, const float* k, const float* v, const int64_t* caches, const int64_t* positions,
                     int64_t B, int64_t Hkv, int64_t D, int64_t Dv) {
  if (B == 0) return;
  launch(s, static_cast<unsigned>(B), row_threads(Hkv * std::max(D, Dv)), 0, k_kv_write, k, v, caches, positions, B,
         Hkv * D, Hkv * Dv);
  CUDA_LAUNCH_CHECK("k_kv_write");
}

void launch_argmax_rows(cudaStream_t s, const float* x, int64_t R, int64_t V, int32_t* ids) {
  if (R == 0) return;
  launch(s, static_cast<unsigned>(R), 1024, 0, k_argmax_rows, x, V, ids);
  CUDA_LAUNCH_CHECK("k_argmax_rows");
}

void launch_set_identity(cudaStream_t s, float* t, int64_t H, int64_t n) {
  if (H * n == 0) return;
  launch(s, blocks_for(H * n * n), kThreads, 0, k_set_identity, t, H, n);
  CUDA_LAUNCH_CHECK("k_set_identity");
}

void launch_gather_rows(cudaStream_t s, const float* x, const int32_t* idx, float* out, int64_t n, int64_t H) {
  if (n == 0) return;
  launch(s, static_cast<unsigned>(n), row_threads(H), 0, k_gather_rows, x, idx, out, H);
  CUDA_LAUNCH_CHECK("k_gather_rows");
}

void launch_gather_rows_half(cudaStream_t s, const float* x, const int32_t* idx, DType to, void* out, int64_t n,
                             int64_t H) {
  if (n == 0) return;
  if (to == DType::BF16)
    launch(s, static_cast<unsigned>(n), row_threads(H), 0, k_gather_rows_half<__nv_bfloat16>, x, idx,
           static_cast<__nv_bfloat16*>(out), H);
  else if (to == DType::F16)
    launch(s, static_cast<unsigned>(n), row_threads(H), 0, k_gather_rows_half<__half>, x, idx,
           static_cast<__half*>(out), H);
  else
    throw std::logic_error("gather_rows_half: bf16 or f16 only");
  CUDA_LAUNCH_CHECK("k_gather_rows_half");
}

void launch_moe_combine(cudaStream_t s, const float* y, const int32_t* pos, const float* w, int64_t T, int top_k,
                        int64_t H, float* out, const MoeTail& tail) {
  if (T == 0) return;
  if (top_k > kCombineMaxK)
    throw std::invalid_argument("moe_experts: at most " + std::to_string(kCombineMaxK) +
                                " experts a token on cuda, got " + std::to_string(top_k));
  launch(s, dim3(static_cast<unsigned>(T), static_cast<unsigned>((H + kCombineThreads - 1) / kCombineThreads)),
         kCombineThreads, 0, k_moe_combine, y, pos, w, top_k, H, out, tail);
  CUDA_LAUNCH_CHECK("k_moe_combine");
}

void launch_scale_add(cudaStream_t s, const float* x, float a, const float* y, float b, float* out, int64_t n) {
  if (n == 0) return;
  launch(s, blocks_for(n), kThreads, 0, k_scale_add, x, a, y, b, out, n);
  CUDA_LAUNCH_CHECK("k_scale_add");
}

void launch_activate(cudaStream_t s, int act, float* x, int64_t n) {
  if (n == 0) return;
  launch(s, blocks_for(n), kThreads, 0, k_activate, act, x, n);
  CUDA_LAUNCH_CHECK("k_activate");
}

}  // namespace hypic::cuda
