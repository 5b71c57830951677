// Causal GQA attention on the GPU in f32: decode steps, short spans and the precise mode (prefill
// spans otherwise go to the tensor-core kernel in flash_attention.cu). One block per (query row,
// query head, key split): the visible keys of a row are cut into splits of at least 128 keys so a
// single decode row still fills the GPU (flash-decoding); warps share a split with an online
// softmax each, and a second kernel merges the splits' (max, sum, accumulator) triples.
#include <algorithm>
#include <cfloat>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace hypic::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kMaxD = 256;
constexpr int kPer = kMaxD / 32;  // elements of a head vector per lane

__global__ void __launch_bounds__(kWarps * 32)
    k_attention(const float* q, const float* k, const float* v, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv,
                int64_t kv_len, int64_t q_offset, float scale, int64_t chunk, float* out, float* part_ml,
                float* part_acc, const int64_t* caches, const int64_t* positions) {
  pdl_entry();
  const int64_t t = blockIdx.x, h = blockIdx.y, sp = blockIdx.z;
  const int64_t g = h / (Hq / Hkv);
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  int64_t visible = min(kv_len, q_offset + t + 1);
  // Decode step over a batch: row t is sequence t's one token, at positions[t], over its own cache;
  // the splits share out that sequence's keys (a fixed grid whatever the lengths: replayable).
  if (caches) {
    k = reinterpret_cast<const float*>(caches[t]);
    v = reinterpret_cast<const float*>(caches[gridDim.x + t]);
    visible = positions[t] + 1;
    chunk = (visible + gridDim.z - 1) / gridDim.z;
  }
  const int64_t j0 = sp * chunk, n = min(visible, j0 + chunk);
  float qr[kPer], acc[kPer];
  const float* qp = q + (t * Hq + h) * D;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int d = lane + 32 * i;
    qr[i] = d < D ? qp[d] : 0.f;
    acc[i] = 0.f;
  }
  float m = -FLT_MAX, l = 0.f;
  // Four keys per step with independent loads and reductions: one key at a time leaves the warp
  // waiting on memory latency (decode reads each key once).
  constexpr int kU = 4;
  for (int64_t jb = j0 + w * kU; jb < n; jb += kWarps * kU) {
    float s[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      s[u] = 0.f;
      const int64_t j = jb + u;
      if (j < n) {
        const float* kp = k + (j * Hkv + g) * D;
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          const int d = lane + 32 * i;
          if (d < D) s[u] += qr[i] * kp[d];
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int u = 0; u < kU; ++u) s[u] += __shfl_xor_sync(0xffffffffu, s[u], o);
    float mn = m;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      s[u] = jb + u < n ? s[u] * scale : -FLT_MAX;
      mn = fmaxf(mn, s[u]);
    }
    const float corr = expf(m - mn);
    float p[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      p[u] = jb + u < n ? expf(s[u] - mn) : 0.f;
      l = l * (u == 0 ? corr : 1.f) + p[u];
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int d = lane + 32 * i;
      if (d >= Dv) continue;
      float a = acc[i] * corr;
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (jb + u < n) a += p[u] * v[((jb + u) * Hkv + g) * Dv + d];
      acc[i] = a;
    }
    m = mn;
  }
  __shared__ float sm[kWarps], sl[kWarps], sacc[kWarps][kMaxD];
  if (lane == 0) {
    sm[w] = m;
    sl[w] = l;
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int d = lane + 32 * i;
    if (d < Dv) sacc[w][d] = acc[i];
  }
  __syncthreads();
  float M = -FLT_MAX;
  for (int i = 0; i < kWarps; ++i) M = fmaxf(M, sm[i]);
  float L = 0.f, f[kWarps];
  for (int i = 0; i < kWarps; ++i) {
    f[i] = sl[i] > 0.f ? expf(sm[i] - M) : 0.f;
    L += sl[i] * f[i];
  }
  if (gridDim.z == 1) {
    float* op = out + (t * Hq + h) * Dv;
    for (int64_t d = threadIdx.x; d < Dv; d += blockDim.x) {
      float o = 0.f;
      for (int i = 0; i < kWarps; ++i) o += sacc[i][d] * f[i];
      op[d] = o / L;
    }
    return;
  }
  // One split's share: its max, its sum and its unnormalised accumulator (relative to that max).
  const int64_t slot = (t * Hq + h) * gridDim.z + sp;
  if (threadIdx.x == 0) {
    part_ml[2 * slot] = M;
    part_ml[2 * slot + 1] = L;
  }
  for (int64_t d = threadIdx.x; d < Dv; d += blockDim.x) {
    float o = 0.f;
    for (int i = 0; i < kWarps; ++i) o += sacc[i][d] * f[i];
    part_acc[slot * Dv + d] = o;
  }
}

__global__ void k_attention_merge(const float* part_ml, const float* part_acc, int64_t Hq, int64_t Dv, int splits,
                                  float* out) {
  pdl_entry();
  const int64_t t = blockIdx.x, h = blockIdx.y;
  const int64_t base = (t * Hq + h) * splits;
  float M = -FLT_MAX;
  for (int s = 0; s < splits; ++s)
    if (part_ml[2 * (base + s) + 1] > 0.f) M = fmaxf(M, part_ml[2 * (base + s)]);
  float L = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float l = part_ml[2 * (base + s) + 1];
    if (l > 0.f) L += l * expf(part_ml[2 * (base + s)] - M);
  }
  float* op = out + (t * Hq + h) * Dv;
  for (int64_t d = threadIdx.x; d < Dv; d += blockDim.x) {
    float o = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float l = part_ml[2 * (base + s) + 1];
      if (l > 0.f) o += part_acc[(base + s) * Dv + d] * expf(part_ml[2 * (base + s)] - M);
    }
    op[d] = o / L;
  }
}

}  // namespace

int attention_splits(int64_t T, int64_t Hq, int64_t kv_len) {
  // Enough blocks to fill the GPU (~1000), each split at least 128 keys.
  const int64_t by_keys = (kv_len + 127) / 128, by_blocks = (1024 + T * Hq - 1) / (T * Hq);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({by_keys, by_blocks, 256})));
}

void launch_attention(cudaStream_t s, const float* q, const float* k, const float* v, int64_t T, int64_t Hq,
                      int64_t Hkv, int64_t D, int64_t Dv, int64_t kv_len, int64_t q_offset, float scale, float* out,
                      float* part) {
  if (T == 0) return;
  if (D > kMaxD || Dv > kMaxD)
    throw std::invalid_argument("attention: head dims up to " + std::to_string(kMaxD) + " on cuda, got " +
                                std::to_string(D) + "/" + std::to_string(Dv));
  const int splits = part ? attention_splits(T, Hq, kv_len) : 1;
  const int64_t chunk = (kv_len + splits - 1) / splits;
  float* part_ml = part;
  float* part_acc = part ? part + 2 * T * Hq * splits : nullptr;
  launch(s, dim3(static_cast<unsigned>(T), static_cast<unsigned>(Hq), static_cast<unsigned>(splits)), kWarps * 32, 0,
         k_attention, q, k, v, Hq, Hkv, D, Dv, kv_len, q_offset, scale, chunk, out, part_ml, part_acc, nullptr,
         nullptr);
  CUDA_LAUNCH_CHECK("k_attention");
  if (splits > 1) {
    launch(s, dim3(static_cast<unsigned>(T), static_cast<unsigned>(Hq)), 128, 0, k_attention_merge, part_ml, part_acc,
           Hq, Dv, splits, out);
    CUDA_LAUNCH_CHECK("k_attention_merge");
  }
}

void launch_attention_merge(cudaStream_t s, const float* part, int64_t T, int64_t Hq, int64_t Dv, int splits,
                            float* out) {
  if (T == 0 || splits <= 1) return;
  launch(s, dim3(static_cast<unsigned>(T), static_cast<unsigned>(Hq)), 128, 0, k_attention_merge, part,
         part + 2 * T * Hq * splits, Hq, Dv, splits, out);
  CUDA_LAUNCH_CHECK("k_attention_merge");
}

int attention_step_splits(int64_t B, int64_t Hq) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(64, (1024 + B * Hq - 1) / std::max<int64_t>(1, B * Hq))));
}

void launch_attention_step(cudaStream_t s, const float* q, const int64_t* caches, const int64_t* positions, int64_t B,
                           int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, float scale, float* out, float* part) {
  if (B == 0) return;
  if (D > kMaxD || Dv > kMaxD)
    throw std::invalid_argument("attention_step: head dims up to " + std::to_string(kMaxD) + " on cuda, got " +
                                std::to_string(D) + "/" + std::to_string(Dv));
  const int splits = attention_step_splits(B, Hq);
  float* part_ml = part;
  float* part_acc = part + 2 * B * Hq * splits;
  launch(s, dim3(static_cast<unsigned>(B), static_cast<unsigned>(Hq), static_cast<unsigned>(splits)), kWarps * 32, 0,
         k_attention, q, nullptr, nullptr, Hq, Hkv, D, Dv, 0, 0, scale, 0, out, part_ml, part_acc, caches, positions);
  CUDA_LAUNCH_CHECK("k_attention(step)");
  if (splits > 1) {
    launch(s, dim3(static_cast<unsigned>(B), static_cast<unsigned>(Hq)), 128, 0, k_attention_merge, part_ml, part_acc,
           Hq, Dv, splits, out);
    CUDA_LAUNCH_CHECK("k_attention_merge");
  }
}

}  // namespace hypic::cuda
