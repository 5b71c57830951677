// Gated delta rule on the GPU: the token-sequential recurrence (correctness-first version; the
// chunked tensor-core kernel replaces it for long prefills and keeps this one as its reference).
//
// Per value head h (key head h / (Hv/Hk)), with S [dk, dv] and left multiplication:
//   S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t.
// Columns of S are independent given k_t, so a block owns 32 columns of one head and P threads
// share a column (dk/P rows each, reduced with shuffles). The transition T_C = A_L ... A_1 obeys
// the same update with v = 0 from T = I, so its dk columns ride along as extra columns of the
// same pass: T_C costs (dv + dk)/dv of the plain recurrence and no second sweep over the tokens.
#include <algorithm>
#include <cmath>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/gated_delta_token.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace hypic::cuda {

namespace {

constexpr int kCols = kGdnCols, kRows = kGdnRows, kTile = kGdnTile;

template <int P, int R>
__global__ void __launch_bounds__(kCols* P)
    k_gdn(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
          const float* __restrict__ g, const float* __restrict__ beta, bool l2norm, int64_t T, int64_t Hk, int64_t Hv,
          int dk, int dv, float* state, float* out, float* transition, const int64_t* states) {
  pdl_entry();
  // Decode step over a batch: sequence blockIdx.z has one token and its own state.
  if (states) {
    const int64_t b = blockIdx.z;
    state = reinterpret_cast<float*>(states[b]);
    q += b * Hk * dk;
    k += b * Hk * dk;
    v += b * Hv * dv;
    g += b * Hv;
    beta += b * Hv;
    out += b * Hv * dv;
  }
  extern __shared__ float smem[];
  const int h = blockIdx.y;
  const int64_t hk = h / (Hv / Hk);
  const int p = threadIdx.x % P;
  const int col = blockIdx.x * kCols + threadIdx.x / P;
  const int ncols = dv + (transition ? dk : 0);
  const bool valid = col < ncols, is_T = col >= dv;
  const int c = is_T ? col - dv : col;
  float* sbase = is_T ? transition + static_cast<int64_t>(h) * dk * dk : state + static_cast<int64_t>(h) * dk * dv;
  const int ld = is_T ? dk : dv;

  float s[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = i * P + p;
    s[i] = (valid && r < dk) ? (is_T ? (r == c ? 1.f : 0.f) : sbase[static_cast<int64_t>(r) * ld + c]) : 0.f;
  }
  gdn_tokens<P, R>(q, k, v, g, beta, l2norm, T, Hk, Hv, dk, dv, h, hk, blockIdx.x * kCols, valid, is_T, c, s, out,
                   smem);
  if (valid) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int r = i * P + p;
      if (r < dk) sbase[static_cast<int64_t>(r) * ld + c] = s[i];
    }
  }
}

template <int P, int R = kRows>
void run(cudaStream_t st, const float* q, const float* k, const float* v, const float* g, const float* beta,
         bool l2norm, int64_t T, int64_t Hk, int64_t Hv, int dk, int dv, float* state, float* out, float* tr,
         const int64_t* states = nullptr, int64_t B = 1) {
  const int ncols = dv + (tr ? dk : 0);
  const size_t smem = static_cast<size_t>(kTile * (2 * dk + 2 + kCols)) * sizeof(float);
  if (smem > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(k_gdn<P, R>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  dim3 grid(static_cast<unsigned>((ncols + kCols - 1) / kCols), static_cast<unsigned>(Hv), static_cast<unsigned>(B));
  launch(st, grid, kCols * P, smem, k_gdn<P, R>, q, k, v, g, beta, l2norm, T, Hk, Hv, dk, dv, state, out, tr, states);
  CUDA_LAUNCH_CHECK("k_gdn");
}

}  // namespace

void launch_gated_delta_rule(cudaStream_t s, const float* q, const float* k, const float* v, const float* g,
                             const float* beta, bool l2norm_qk, int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                             int64_t dv, float* state, float* out, float* transition) {
  if (Hv == 0 || dk == 0 || dv == 0) return;
  if (transition) launch_set_identity(s, transition, Hv, dk);  // T of an empty span is I
  if (T == 0) return;
  const int idk = static_cast<int>(dk), idv = static_cast<int>(dv);
  // 8 rows of S per thread (P = dk / 8 threads per column): the token loop is latency-bound, and
  // the chain kernel measured 1.5x faster this way than with 32 rows (gated_delta_chain.cu).
  if (dk <= 32)
    run<4, 8>(s, q, k, v, g, beta, l2norm_qk, T, Hk, Hv, idk, idv, state, out, transition);
  else if (dk <= 64)
    run<8, 8>(s, q, k, v, g, beta, l2norm_qk, T, Hk, Hv, idk, idv, state, out, transition);
  else if (dk <= 128)
    run<16, 8>(s, q, k, v, g, beta, l2norm_qk, T, Hk, Hv, idk, idv, state, out, transition);
  else if (dk <= 256)
    run<32, 8>(s, q, k, v, g, beta, l2norm_qk, T, Hk, Hv, idk, idv, state, out, transition);
  else
    throw std::invalid_argument("gated_delta_rule: key head dim " + std::to_string(dk) +
                                " above 256 is not supported on cuda");
}

void launch_gated_delta_rule_step(cudaStream_t s, const float* q, const float* k, const float* v, const float* g,
                                  const float* beta, bool l2norm_qk, int64_t B, int64_t Hk, int64_t Hv, int64_t dk,
                                  int64_t dv, const int64_t* states, float* out) {
  if (B == 0 || Hv == 0 || dk == 0 || dv == 0) return;
  const int idk = static_cast<int>(dk), idv = static_cast<int>(dv);
  if (dk <= 32)
    run<1>(s, q, k, v, g, beta, l2norm_qk, 1, Hk, Hv, idk, idv, nullptr, out, nullptr, states, B);
  else if (dk <= 64)
    run<2>(s, q, k, v, g, beta, l2norm_qk, 1, Hk, Hv, idk, idv, nullptr, out, nullptr, states, B);
  else if (dk <= 128)
    run<4>(s, q, k, v, g, beta, l2norm_qk, 1, Hk, Hv, idk, idv, nullptr, out, nullptr, states, B);
  else if (dk <= 256)
    run<8>(s, q, k, v, g, beta, l2norm_qk, 1, Hk, Hv, idk, idv, nullptr, out, nullptr, states, B);
  else
    throw std::invalid_argument("gated_delta_rule_step: key head dim " + std::to_string(dk) +
                                " above 256 is not supported on cuda");
}

}  // namespace hypic::cuda
