// Kernel launches with programmatic dependent launch (PDL, Hopper): a kernel may be scheduled
// while the one before it in the stream is still running, and runs until `pdl_wait()`, which
// returns once that kernel has finished and its writes are visible. A decode step is hundreds of
// short kernels, and without this each one's launch and block scheduling sit in the gap after the
// previous one: with it they overlap the previous kernel's tail (measured: 0.8B batch-1 step
// 1.64 -> 1.57 ms, 9B 5.97 -> 5.88 ms). A GEMV may even send its first weights to L2 before
// its input exists (weights are never written by the kernel just before; gemv.cu).
//
// Contract for every kernel launched through `launch`: no global memory that an earlier kernel
// writes is read or written before `pdl_wait()`. Kernels call `pdl_entry()` first (GEMVs after
// sending their first weights to L2): it waits, then lets the next kernel be scheduled, so at most
// one kernel runs ahead and visibility is transitive. (Triggering before the wait, so that a GEMV
// could start while the GEMV two kernels back still ran, measured no faster on the 9B step.)
// Where: in recorded graphs (decode steps) by default; HYPIC_PDL=2 everywhere, HYPIC_PDL=0 nowhere
// (A/B measurements; the waits are then no-ops). Eager work (prefill) keeps plain launches: PDL
// there measured the same within 1% and the prefill tests run without it.
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "backend/cuda/cuda_check.h"

namespace hypic::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next kernel in the stream be scheduled once every block of this one has called it.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
__device__ __forceinline__ void pdl_entry() {
  pdl_wait();
  pdl_trigger();
}

__device__ __forceinline__ float silu(float x) {
  return x / (1.0f + expf(-x));
}

// 16-byte asynchronous copies global -> shared (zero-filled when `ok` is false): operands load
// while the block computes on others (cp.async, sm_80+).
__device__ inline void cp_async16(void* dst, const void* src, bool ok = true) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0));
}
__device__ inline void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
__device__ inline void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
// Waits until at most N of this thread's commit groups are still in flight.
template <int N>
__device__ inline void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// True on a thread while CudaBackend::capture records (set_graph_recording, kernels.h).
bool graph_recording();

inline bool pdl_enabled() {
  static const int mode = [] {
    const char* e = std::getenv("HYPIC_PDL");
    const int want = e && *e ? std::atoi(e) : 1;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return 0;
    return major >= 9 ? want : 0;
  }();
  return mode >= 2 || (mode == 1 && graph_recording());
}

// kernel<<<grid, block, smem, s>>>(args...), with the PDL attribute when enabled.
template <typename... P, typename... A>
void launch(cudaStream_t s, dim3 grid, dim3 block, size_t smem, void (*kernel)(P...), A&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...));
}

}  // namespace hypic::cuda
