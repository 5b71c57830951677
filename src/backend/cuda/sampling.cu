// Token selection on the GPU: temperature sampling of each row of logits by a uniform draw made on
// the host (so a request's seed fixes its tokens on every backend), ids returned in one read. The
// reference is Backend::sample_rows (backend.cpp); the CPU sampler (engine/sampler.cpp) draws the
// same way for rows it serves itself.
#include <cfloat>
#include <climits>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace hypic::cuda {

namespace {

constexpr int kThreads = 1024;

// One block per row. Each thread owns a contiguous run of ids, so the block's exclusive scan of
// the runs' masses orders the whole row by id: the run holding u * total is then rescanned by its
// thread alone.
__global__ void __launch_bounds__(kThreads)
    k_sample_rows(const float* x, int64_t V, const float* params, const uint8_t* mask, int32_t* ids) {
  pdl_entry();
  using Reduce = cub::BlockReduce<float, kThreads>;
  using Scan = cub::BlockScan<float, kThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ float s_max;
  __shared__ int s_found, s_last;
  const float* r = x + blockIdx.x * V;
  const float* p = params + 3 * blockIdx.x;
  const float temp = p[0], u = p[1];
  const uint8_t* off = p[2] != 0.f ? mask : nullptr;
  const int64_t n = V, per = (n + kThreads - 1) / kThreads, i0 = threadIdx.x * per, i1 = min(n, i0 + per);
  // A masked id reads as NaN: it never wins the maximum and has no mass.
  auto at = [&](int64_t i) { return off && off[i] ? NAN : r[i]; };
  float mx = -INFINITY;
  for (int64_t i = i0; i < i1; ++i) mx = at(i) > mx ? at(i) : mx;
  const float block_max = Reduce(tmp.reduce).Reduce(mx, [](float a, float b) { return fmaxf(a, b); });
  if (threadIdx.x == 0) {
    s_max = block_max;
    s_found = INT_MAX;
    s_last = -1;
  }
  __syncthreads();
  const float m = isfinite(s_max) ? s_max : 0.f;
  if (temp <= 0.f) {  // greedy: the lowest id holding the maximum
    for (int64_t i = i0; i < i1; ++i)
      if (at(i) == s_max) {
        atomicMin(&s_found, static_cast<int>(i));
        break;
      }
    __syncthreads();
    if (threadIdx.x == 0) ids[blockIdx.x] = s_found == INT_MAX ? 0 : s_found;
    return;
  }
  const float inv_t = 1.f / temp;
  auto weight = [&](float v) {
    const float w = expf((v - m) * inv_t);
    return w == w ? w : 0.f;
  };
  float mass = 0.f;
  int last = -1;
  for (int64_t i = i0; i < i1; ++i) {
    const float w = weight(at(i));
    mass += w;
    if (w > 0.f) last = static_cast<int>(i);
  }
  if (last >= 0) atomicMax(&s_last, last);
  float before = 0.f, total = 0.f;
  Scan(tmp.scan).ExclusiveSum(mass, before, total);
  const float target = u * total;
  if (mass > 0.f && before <= target && target < before + mass) {
    float acc = before;
    int pick = last;
    for (int64_t i = i0; i < i1; ++i) {
      acc += weight(at(i));
      if (target < acc) {
        pick = static_cast<int>(i);
        break;
      }
    }
    atomicMin(&s_found, pick);
  }
  __syncthreads();
  // Rounding at a run's edge found nothing: the last id with mass (as the CPU sampler does).
  if (threadIdx.x == 0)
    ids[blockIdx.x] = s_found != INT_MAX ? s_found : (s_last >= 0 ? s_last : static_cast<int>(n - 1));
}

}  // namespace

void launch_sample_rows(cudaStream_t s, const float* x, int64_t R, int64_t V, const float* params, const uint8_t* mask,
                        int32_t* ids) {
  if (R == 0) return;
  launch(s, static_cast<unsigned>(R), kThreads, 0, k_sample_rows, x, V, params, mask, ids);
  CUDA_LAUNCH_CHECK("k_sample_rows");
}

}  // namespace hypic::cuda
