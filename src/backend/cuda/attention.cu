// Causal GQA attention on the GPU, f32 (correctness-first version: the CPU backend's arithmetic,
// one block per (query row, query head), warps splitting the visible keys with an online softmax
// each, merged at the end). Head dims up to 256. A tensor-core flash-attention prefill kernel and a
// key-split decode kernel replace it for speed; this one stays as their reference.
#include <cfloat>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace hypic::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kMaxD = 256;
constexpr int kPer = kMaxD / 32;  // elements of a head vector per lane

__global__ void __launch_bounds__(kWarps * 32)
    k_attention(const float* q, const float* k, const float* v, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv,
                int64_t kv_len, int64_t q_offset, float scale, float* out) {
  const int64_t t = blockIdx.x, h = blockIdx.y;
  const int64_t g = h / (Hq / Hkv);
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  const int64_t n = min(kv_len, q_offset + t + 1);
  float qr[kPer], acc[kPer];
  const float* qp = q + (t * Hq + h) * D;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int d = lane + 32 * i;
    qr[i] = d < D ? qp[d] : 0.f;
    acc[i] = 0.f;
  }
  float m = -FLT_MAX, l = 0.f;
  for (int64_t j = w; j < n; j += kWarps) {
    const float* kp = k + (j * Hkv + g) * D;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int d = lane + 32 * i;
      if (d < D) s += qr[i] * kp[d];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    s *= scale;
    const float mn = fmaxf(m, s);
    const float corr = expf(m - mn), p = expf(s - mn);
    l = l * corr + p;
    const float* vp = v + (j * Hkv + g) * Dv;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int d = lane + 32 * i;
      acc[i] = acc[i] * corr + (d < Dv ? p * vp[d] : 0.f);
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
  float* op = out + (t * Hq + h) * Dv;
  for (int64_t d = threadIdx.x; d < Dv; d += blockDim.x) {
    float o = 0.f;
    for (int i = 0; i < kWarps; ++i) o += sacc[i][d] * f[i];
    op[d] = o / L;
  }
}

}  // namespace

void launch_attention(cudaStream_t s, const float* q, const float* k, const float* v, int64_t T, int64_t Hq,
                      int64_t Hkv, int64_t D, int64_t Dv, int64_t kv_len, int64_t q_offset, float scale, float* out) {
  if (T == 0) return;
  if (D > kMaxD || Dv > kMaxD)
    throw std::invalid_argument("attention: head dims up to " + std::to_string(kMaxD) + " on cuda, got " +
                                std::to_string(D) + "/" + std::to_string(Dv));
  k_attention<<<dim3(static_cast<unsigned>(T), static_cast<unsigned>(Hq)), kWarps * 32, 0, s>>>(
      q, k, v, Hq, Hkv, D, Dv, kv_len, q_offset, scale, out);
  CUDA_LAUNCH_CHECK("k_attention");
}

}  // namespace hypic::cuda
