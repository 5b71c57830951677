// Mamba2's layer pieces on the GPU (Nemotron-H): the conv with bias, the discretisation of dt and
// the gated group norm; and Kimi-Linear's KDA gates, its per-channel counterpart of dt. The recurrence itself is
// linear_recurrence.cu's. Arithmetic follows the CPU backend (cpu_backend.cpp) so the two agree to rounding.
#include <algorithm>
#include <stdexcept>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace hypic::cuda {

namespace {

constexpr int kThreads = 256;

inline unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 20)));
}

// One sequence's rows x [T, C] (already offset to its first row) from its state [K-1, C].
// out[t, c] = silu(bias[c] + sum_j w[c, j] x(t - (K-1) + j)), x before row 0 read from the state.
__device__ void conv_rows(const float* x, const float* w, const float* bias, const float* state, float* out, int64_t T,
                          int64_t C, int64_t K) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < T * C;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / C, c = i % C;
    float acc = bias[c];
    for (int64_t j = 0; j < K; ++j) {
      const int64_t src = t - (K - 1) + j;
      acc += w[c * K + j] * (src < 0 ? state[(K - 1 + src) * C + c] : x[src * C + c]);
    }
    out[i] = silu(acc);
  }
}

// The new state, the last K-1 inputs of (state, x): one thread per channel reads its old column
// before writing it, so the update is in place.
__device__ void advance_state(const float* x, float* state, int64_t T, int64_t C, int64_t K) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= C || T == 0) return;
  const int64_t S = K - 1;
  float old[8];
  for (int64_t r = 0; r < S && r < 8; ++r) old[r] = state[r * C + c];
  for (int64_t r = 0; r < S; ++r) {
    const int64_t src = r + T;  // row of (state, x)
    state[r * C + c] = src < S ? old[src] : x[(src - S) * C + c];
  }
}

__global__ void k_conv1d_bias_silu(const float* x, const float* w, const float* bias, const float* state, float* out,
                                   int64_t T, int64_t C, int64_t K) {
  pdl_entry();
  conv_rows(x, w, bias, state, out, T, C, K);
}

__global__ void k_conv1d_advance(const float* x, float* state, int64_t T, int64_t C, int64_t K) {
  pdl_entry();
  advance_state(x, state, T, C, K);
}

// The two kernels above over runs of rows with a state each (blockIdx.y: the run).
__global__ void k_conv1d_bias_silu_runs(const float* x, const float* w, const float* bias, float* const* states,
                                        const int64_t* run_rows, float* out, int64_t C, int64_t K) {
  pdl_entry();
  const int64_t r0 = run_rows[blockIdx.y];
  conv_rows(x + r0 * C, w, bias, states[blockIdx.y], out + r0 * C, run_rows[blockIdx.y + 1] - r0, C, K);
}

__global__ void k_conv1d_advance_runs(const float* x, float* const* states, const int64_t* run_rows, int64_t C,
                                      int64_t K) {
  pdl_entry();
  const int64_t r0 = run_rows[blockIdx.y];
  advance_state(x + r0 * C, states[blockIdx.y], run_rows[blockIdx.y + 1] - r0, C, K);
}

// One thread per element of v (coalesced: a thread per (token, head) striding over P channels read
// x at stride P and took a fifth of an 8B prefill). dt is recomputed per element; g by p == 0.
__global__ void k_mamba2_gates(const float* dt_raw, const float* x, const float* A, const float* dt_bias, float dt_min,
                               float* g, float* v, int64_t T, int64_t H, int64_t P) {
  pdl_entry();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < T * H * P;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t th = i / P, h = th % H;
    const float u = dt_raw[th] + dt_bias[h];
    const float dt = fmaxf(u > 20.0f ? u : log1pf(expf(u)), dt_min);  // torch softplus, threshold 20
    v[i] = dt * x[i];
    if (i % P == 0) g[th] = dt * A[h];
  }
}

// One block per (row, group): o = (y + D x) * silu(z) over the group's channels, then w * o / rms(o).
__global__ void k_mamba2_gated_norm(const float* y, const float* x, const float* z, const float* D, const float* w,
                                    float eps, float* out, int64_t C, int64_t P, int64_t gs) {
  pdl_entry();
  const int64_t base = blockIdx.x * gs;  // rows are C = groups * gs channels: block b starts at b * gs
  __shared__ float part[32];
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < gs; j += blockDim.x) {
    const int64_t i = base + j, ch = i % C;
    const float o = (y[i] + D[ch / P] * x[i]) * silu(z[i]);
    out[i] = o;
    ss += o * o;
  }
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float t = threadIdx.x < (blockDim.x + 31) / 32 ? part[threadIdx.x] : 0.f;
    for (int off = 16; off > 0; off /= 2) t += __shfl_xor_sync(0xffffffffu, t, off);
    if (threadIdx.x == 0) part[0] = t;
  }
  __syncthreads();
  const float r = 1.0f / sqrtf(part[0] / static_cast<float>(gs) + eps);
  for (int64_t j = threadIdx.x; j < gs; j += blockDim.x) {
    const int64_t i = base + j;
    out[i] = w[i % C] * (out[i] * r);
  }
}

__global__ void k_kda_gates(const float* a, const float* b, const float* A, const float* dt_bias, float* g, float* beta,
                            int64_t T, int64_t H, int64_t dk) {
  pdl_entry();
  const int64_t C = H * dk;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < T * C;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i % C;
    const float z = a[i] + dt_bias[c];
    g[i] = -A[c / dk] * (z > 20.0f ? z : logf(1.0f + expf(z)));  // as transformers writes it
    if (c % dk == 0) {
      const int64_t j = i / C * H + c / dk;
      beta[j] = 1.0f / (1.0f + expf(-b[j]));
    }
  }
}

}  // namespace

void launch_kda_gates(cudaStream_t s, const float* a, const float* b, const float* A, const float* dt_bias, float* g,
                      float* beta, int64_t T, int64_t H, int64_t dk) {
  if (T * H * dk == 0) return;
  launch(s, blocks_for(T * H * dk), kThreads, 0, k_kda_gates, a, b, A, dt_bias, g, beta, T, H, dk);
  CUDA_LAUNCH_CHECK("k_kda_gates");
}

void launch_conv1d_bias_silu(cudaStream_t s, const float* x, const float* w, const float* bias, float* state,
                             float* out, int64_t T, int64_t C, int64_t K) {
  if (T * C == 0) return;
  if (K - 1 > 8) throw std::invalid_argument("causal_conv1d_bias_silu: kernel width above 9 is not supported on cuda");
  launch(s, blocks_for(T * C), kThreads, 0, k_conv1d_bias_silu, x, w, bias, state, out, T, C, K);
  CUDA_LAUNCH_CHECK("k_conv1d_bias_silu");
  if (K < 2) return;
  launch(s, blocks_for(C), kThreads, 0, k_conv1d_advance, x, state, T, C, K);
  CUDA_LAUNCH_CHECK("k_conv1d_advance");
}

void launch_conv1d_bias_silu_runs(cudaStream_t s, const float* x, const float* w, const float* bias,
                                  float* const* states, const int64_t* run_rows, int64_t runs, int64_t max_run,
                                  float* out, int64_t C, int64_t K) {
  if (runs == 0 || max_run * C == 0) return;
  if (K - 1 > 8) throw std::invalid_argument("causal_conv1d_bias_silu: kernel width above 9 is not supported on cuda");
  launch(s, dim3(blocks_for(max_run * C), static_cast<unsigned>(runs)), kThreads, 0, k_conv1d_bias_silu_runs, x, w,
         bias, states, run_rows, out, C, K);
  CUDA_LAUNCH_CHECK("k_conv1d_bias_silu_runs");
  if (K < 2) return;
  launch(s, dim3(blocks_for(C), static_cast<unsigned>(runs)), kThreads, 0, k_conv1d_advance_runs, x, states, run_rows,
         C, K);
  CUDA_LAUNCH_CHECK("k_conv1d_advance_runs");
}

void launch_mamba2_gates(cudaStream_t s, const float* dt_raw, const float* x, const float* A, const float* dt_bias,
                         float dt_min, float* g, float* v, int64_t T, int64_t H, int64_t P) {
  if (T * H * P == 0) return;
  launch(s, blocks_for(T * H * P), kThreads, 0, k_mamba2_gates, dt_raw, x, A, dt_bias, dt_min, g, v, T, H, P);
  CUDA_LAUNCH_CHECK("k_mamba2_gates");
}

void launch_mamba2_gated_norm(cudaStream_t s, const float* y, const float* x, const float* z, const float* D,
                              const float* w, float eps, float* out, int64_t T, int64_t C, int64_t P, int64_t groups) {
  if (T * C == 0) return;
  const int64_t gs = C / groups;
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (gs + 31) / 32 * 32)));
  launch(s, static_cast<unsigned>(T * groups), threads, 0, k_mamba2_gated_norm, y, x, z, D, w, eps, out, C, P, gs);
  CUDA_LAUNCH_CHECK("k_mamba2_gated_norm");
}

}  // namespace hypic::cuda
