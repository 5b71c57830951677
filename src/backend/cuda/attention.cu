// Causal GQA attention on the GPU in f32: decode steps, short spans and the precise mode (prefill
// spans otherwise go to the tensor-core kernel in flash_attention.cu). k_attention: one block per
// (query row, query head, key split); k_attention_step (batched decode): one block per (sequence,
// query heads of one key head, key split). The visible keys are cut into splits so a single
// decode row still fills the GPU (flash-decoding); warps share a split with an online softmax
// each, and a second kernel merges the splits' (max, sum, accumulator) triples.
#include <algorithm>
#include <cfloat>
#include <cstdlib>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace hypic::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kMaxD = 256;
constexpr int kPer = kMaxD / 32;  // elements of a head vector per lane

// The warps' (max, sum, accumulator) triples of one (row t, head h), warp i's at sm[i * ml_stride]
// and sacc[i * acc_stride], merged: written normalised (one split) or left as this split's triple
// (max, sum, unnormalised accumulator relative to that max) for k_attention_merge. Every thread of
// the block calls it after the barrier that published the triples.
__device__ __forceinline__ void merge_warps(const float* sm, const float* sl, int ml_stride, const float* sacc,
                                            int acc_stride, int64_t t, int64_t h, int64_t Hq, int64_t Dv, int sp,
                                            float* out, float* part_ml, float* part_acc) {
  float M = -FLT_MAX;
  for (int i = 0; i < kWarps; ++i) M = fmaxf(M, sm[i * ml_stride]);
  float L = 0.f, f[kWarps];
  for (int i = 0; i < kWarps; ++i) {
    f[i] = sl[i * ml_stride] > 0.f ? expf(sm[i * ml_stride] - M) : 0.f;
    L += sl[i * ml_stride] * f[i];
  }
  float* dst = out + (t * Hq + h) * Dv;
  if (gridDim.z > 1) {
    const int64_t slot = (t * Hq + h) * gridDim.z + sp;
    if (threadIdx.x == 0) {
      part_ml[2 * slot] = M;
      part_ml[2 * slot + 1] = L;
    }
    dst = part_acc + slot * Dv;
  }
  for (int64_t d = threadIdx.x; d < Dv; d += blockDim.x) {
    float o = 0.f;
    for (int i = 0; i < kWarps; ++i) o += sacc[i * acc_stride + d] * f[i];
    dst[d] = gridDim.z > 1 ? o : o / L;
  }
}

__global__ void __launch_bounds__(kWarps * 32)
    k_attention(const float* q, const float* k, const float* v, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv,
                int64_t kv_len, int64_t q_offset, float scale, int64_t chunk, float* out, float* part_ml,
                float* part_acc) {
  pdl_entry();
  const int64_t t = blockIdx.x, h = blockIdx.y, sp = blockIdx.z;
  const int64_t g = h / (Hq / Hkv);
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  const int64_t visible = min(kv_len, q_offset + t + 1);
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
  merge_warps(&sm[0], &sl[0], 1, &sacc[0][0], kMaxD, t, h, Hq, Dv, sp, out, part_ml, part_acc);
}

// The splits' triples of one (row, head) merged, 32 output elements a block (grid z): each block
// reduces the splits' max and sum (block reductions; the scales exp(m_s - M) go to shared memory),
// then its eight warps each sum every eighth split for the 32 elements (a lane an element: 128-byte
// rows) and add their shares. Splits with no keys (sum 0) wrote no accumulator: scale 0, skipped.
// History: one thread walking every split's (max, sum) before each load took ~87 us at 256 splits
// (a 35B-A3B decode step's attention layer); one block per head with each thread walking all 256
// splits one dependent load after another still took ~97 us (ncu, caches flushed), 0.97 ms a step.
constexpr int kMaxMergeSplits = 256;
constexpr int kMergeWarps = 8;
__global__ void __launch_bounds__(kMergeWarps * 32)
    k_attention_merge(const float* part_ml, const float* part_acc, int64_t Hq, int64_t Dv, int splits, float* out) {
  pdl_entry();
  __shared__ float f[kMaxMergeSplits];
  __shared__ float red[kMergeWarps];
  __shared__ float share[kMergeWarps][32];
  const int64_t t = blockIdx.x, h = blockIdx.y;
  const int64_t base = (t * Hq + h) * splits;
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  float m = -FLT_MAX;
  for (int sp = threadIdx.x; sp < splits; sp += blockDim.x)
    if (part_ml[2 * (base + sp) + 1] > 0.f) m = fmaxf(m, part_ml[2 * (base + sp)]);
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) red[w] = m;
  __syncthreads();
  float M = red[0];
#pragma unroll
  for (int i = 1; i < kMergeWarps; ++i) M = fmaxf(M, red[i]);
  __syncthreads();  // red is reused below
  float l = 0.f;
  for (int sp = threadIdx.x; sp < splits; sp += blockDim.x) {
    const float ls = part_ml[2 * (base + sp) + 1];
    const float fs = ls > 0.f ? expf(part_ml[2 * (base + sp)] - M) : 0.f;
    f[sp] = fs;
    l += ls * fs;
  }
  for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
  if (lane == 0) red[w] = l;
  __syncthreads();
  float L = 0.f;
#pragma unroll
  for (int i = 0; i < kMergeWarps; ++i) L += red[i];
  const int64_t d = blockIdx.z * 32 + lane;
  float o = 0.f;
  if (d < Dv) {
    const float* pa = part_acc + base * Dv + d;
#pragma unroll 8
    for (int sp = w; sp < splits; sp += kMergeWarps) {
      const float fs = f[sp];
      if (fs != 0.f) o += pa[sp * Dv] * fs;
    }
  }
  share[w][lane] = o;
  __syncthreads();
  if (w == 0 && d < Dv) {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kMergeWarps; ++i) sum += share[i][lane];
    out[(t * Hq + h) * Dv + d] = sum / L;
  }
}

void merge_splits(cudaStream_t s, const float* part_ml, const float* part_acc, int64_t T, int64_t Hq, int64_t Dv,
                  int splits, float* out) {
  launch(s, dim3(static_cast<unsigned>(T), static_cast<unsigned>(Hq), static_cast<unsigned>((Dv + 31) / 32)),
         kMergeWarps * 32, 0, k_attention_merge, part_ml, part_acc, Hq, Dv, splits, out);
  CUDA_LAUNCH_CHECK("k_attention_merge");
}

// Decode step, one block per (sequence, group of HG query heads sharing a key head, key split):
// each key and value row is read once for all HG heads. One block per query head (k_attention)
// reads a GQA group's rows Hq/Hkv times, which at long contexts made decode steps memory-bound
// on re-reads (8x for Qwen3.5-35B-A3B's 16 query heads over 2 key heads).
template <int HG>
__global__ void __launch_bounds__(kWarps * 32)
    k_attention_step(const float* q, const int64_t* caches, const int64_t* positions, int64_t Hq, int64_t Hkv,
                     int64_t D, int64_t Dv, float scale, float* out, float* part_ml, float* part_acc) {
  pdl_entry();
  const int64_t t = blockIdx.x, B = gridDim.x, sp = blockIdx.z, h0 = blockIdx.y * HG;
  const int64_t g = h0 / (Hq / Hkv);
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  const float* k = reinterpret_cast<const float*>(caches[t]);
  const float* v = reinterpret_cast<const float*>(caches[B + t]);
  // A fixed grid whatever the lengths (replayable): the splits share out this sequence's keys.
  const int64_t visible = positions[t] + 1, chunk = (visible + gridDim.z - 1) / gridDim.z;
  const int64_t j0 = sp * chunk, n = min(visible, j0 + chunk);
  float qr[HG][kPer], acc[HG][kPer], m[HG], l[HG];
#pragma unroll
  for (int hh = 0; hh < HG; ++hh) {
    m[hh] = -FLT_MAX;
    l[hh] = 0.f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int d = lane + 32 * i;
      qr[hh][i] = d < D ? q[(t * Hq + h0 + hh) * D + d] : 0.f;
      acc[hh][i] = 0.f;
    }
  }
  // Several keys per warp step, their key and value rows loaded before any reduction: decode
  // reads each row once, so the bytes in flight set the speed.
  constexpr int kU = HG >= 8 ? 2 : 4;
  for (int64_t jb = j0 + w * kU; jb < n; jb += kWarps * kU) {
    float kr[kU][kPer], vr[kU][kPer];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t j = jb + u;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int d = lane + 32 * i;
        kr[u][i] = j < n && d < D ? k[(j * Hkv + g) * D + d] : 0.f;
        vr[u][i] = j < n && d < Dv ? v[(j * Hkv + g) * Dv + d] : 0.f;
      }
    }
    float s[HG][kU];
#pragma unroll
    for (int hh = 0; hh < HG; ++hh)
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        float x = 0.f;
#pragma unroll
        for (int i = 0; i < kPer; ++i) x += qr[hh][i] * kr[u][i];
        s[hh][u] = x;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int hh = 0; hh < HG; ++hh)
#pragma unroll
        for (int u = 0; u < kU; ++u) s[hh][u] += __shfl_xor_sync(0xffffffffu, s[hh][u], o);
#pragma unroll
    for (int hh = 0; hh < HG; ++hh) {
      float mn = m[hh];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        s[hh][u] = jb + u < n ? s[hh][u] * scale : -FLT_MAX;
        mn = fmaxf(mn, s[hh][u]);
      }
      const float corr = expf(m[hh] - mn);
      float p[kU], ps = 0.f;
#pragma unroll
      for (int u = 0; u < kU; ++u) ps += p[u] = jb + u < n ? expf(s[hh][u] - mn) : 0.f;
      l[hh] = l[hh] * corr + ps;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        float a = acc[hh][i] * corr;
#pragma unroll
        for (int u = 0; u < kU; ++u) a += p[u] * vr[u][i];
        acc[hh][i] = a;
      }
      m[hh] = mn;
    }
  }
  // The warps' shares merged per head, then written (one split) or left for k_attention_merge.
  __shared__ float sm[kWarps][HG], sl[kWarps][HG], sacc[kWarps][HG][kMaxD];
#pragma unroll
  for (int hh = 0; hh < HG; ++hh) {
    if (lane == 0) {
      sm[w][hh] = m[hh];
      sl[w][hh] = l[hh];
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int d = lane + 32 * i;
      if (d < Dv) sacc[w][hh][d] = acc[hh][i];
    }
  }
  __syncthreads();
  for (int hh = 0; hh < HG; ++hh)
    merge_warps(&sm[0][hh], &sl[0][hh], HG, &sacc[0][hh][0], HG * kMaxD, t, h0 + hh, Hq, Dv, sp, out, part_ml,
                part_acc);
}

// Query heads one decode block serves: the largest of 8, 4, 2, 1 dividing the GQA group.
int step_heads(int64_t Hq, int64_t Hkv) {
  const int64_t G = Hq / std::max<int64_t>(Hkv, 1);
  for (int hg : {8, 4, 2})
    if (G % hg == 0) return hg;
  return 1;
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
         k_attention, q, k, v, Hq, Hkv, D, Dv, kv_len, q_offset, scale, chunk, out, part_ml, part_acc);
  CUDA_LAUNCH_CHECK("k_attention");
  if (splits > 1) {
    merge_splits(s, part_ml, part_acc, T, Hq, Dv, splits, out);
  }
}

void launch_attention_merge(cudaStream_t s, const float* part, int64_t T, int64_t Hq, int64_t Dv, int splits,
                            float* out) {
  if (T == 0 || splits <= 1) return;
  if (splits > kMaxMergeSplits)
    throw std::invalid_argument("attention: at most " + std::to_string(kMaxMergeSplits) + " key splits, got " +
                                std::to_string(splits));
  merge_splits(s, part, part + 2 * T * Hq * splits, T, Hq, Dv, splits, out);
}

int attention_step_splits(int64_t B, int64_t Hq, int64_t Hkv) {
  // ~512 blocks whatever the batch (up to 256 splits): a single long sequence still spreads over
  // every SM. At batch 32 fewer, longer splits pay: 0.8B at 4k, 8 splits a sequence 3.46 ms a step,
  // 32 splits (a 2048-block target) 3.61 ms; batch 1 the same (256 splits either way).
  // HYPIC_STEP_BLOCKS sets that target (a measurement knob; the split count is fixed per batch
  // size, so captured steps replay at any length).
  static const int64_t target = [] {
    const char* e = std::getenv("HYPIC_STEP_BLOCKS");
    const int64_t v = e && *e ? std::atoll(e) : 0;
    return v > 0 ? v : int64_t{512};
  }();
  const int64_t groups = B * (Hq / step_heads(Hq, Hkv));
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMaxMergeSplits, (target + groups - 1) / groups)));
}

void launch_attention_step(cudaStream_t s, const float* q, const int64_t* caches, const int64_t* positions, int64_t B,
                           int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, float scale, float* out, float* part) {
  if (B == 0) return;
  if (D > kMaxD || Dv > kMaxD)
    throw std::invalid_argument("attention_step: head dims up to " + std::to_string(kMaxD) + " on cuda, got " +
                                std::to_string(D) + "/" + std::to_string(Dv));
  if (Hkv < 1 || Hq % Hkv != 0)
    throw std::invalid_argument("attention_step: " + std::to_string(Hq) + " query heads over " + std::to_string(Hkv) +
                                " key heads");
  const int splits = attention_step_splits(B, Hq, Hkv), hg = step_heads(Hq, Hkv);
  float* part_ml = part;
  float* part_acc = part + 2 * B * Hq * splits;
  const dim3 grid(static_cast<unsigned>(B), static_cast<unsigned>(Hq / hg), static_cast<unsigned>(splits));
  auto go = [&](auto kernel) {
    launch(s, grid, kWarps * 32, 0, kernel, q, caches, positions, Hq, Hkv, D, Dv, scale, out, part_ml, part_acc);
  };
  switch (hg) {
    case 8:
      go(k_attention_step<8>);
      break;
    case 4:
      go(k_attention_step<4>);
      break;
    case 2:
      go(k_attention_step<2>);
      break;
    default:
      go(k_attention_step<1>);
      break;
  }
  CUDA_LAUNCH_CHECK("k_attention_step");
  if (splits > 1) {
    merge_splits(s, part_ml, part_acc, B, Hq, Dv, splits, out);
  }
}

}  // namespace hypic::cuda
