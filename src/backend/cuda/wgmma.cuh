// Hopper warpgroup MMA (wgmma.mma_async): 128 threads issue one 64 x N x 16 product together,
// B (and A, unless it comes from registers) read straight from shared memory through a matrix
// descriptor. Only sm_90a has it: code that uses it sits under `#if HYPIC_WGMMA`, and the host
// asks wgmma_available() whether the loaded image has it (the sm_90 and PTX builds do not).
//
// Shared-memory tiles use the 128-byte swizzle: a tile is a set of atoms of 8 rows x 128 bytes
// (64 bf16), 1024-byte aligned, rows 128 bytes apart, and the 16-byte chunk c of row r stored at
// chunk c ^ (r % 8) (swz below), which is what the tensor cores read without bank conflicts.
//   K-major operand (rows of M or N, 64 contiguous K values per atom column): SBO = 1024 (the next
//   8 rows), LBO unused; a k16 step inside an atom adds 32 bytes to the start address.
//   MN-major operand (rows of K, 64 contiguous N values per atom column, e.g. V for P V): SBO =
//   1024 (the next 8 K rows), LBO = the distance between atom columns (the next 64 N values).
#pragma once
#include <cstdint>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HYPIC_WGMMA 1
#else
#define HYPIC_WGMMA 0
#endif

namespace hypic::cuda {

// Whether the kernels' loaded image has the sm_90a (wgmma) code: false off Hopper, or where the
// driver picked the sm_90 or PTX image. Cached after the first call (one GPU per process).
bool wgmma_available();

namespace wg {

// Byte offset of 16-byte chunk c (0..7) of row r inside a 128B-swizzled atom column.
__host__ __device__ constexpr uint32_t swz(uint32_t r, uint32_t c) {
  return r * 128u + ((c ^ (r & 7u)) << 4);
}

#if HYPIC_WGMMA
__device__ __forceinline__ uint64_t desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return static_cast<uint64_t>((a & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (static_cast<uint64_t>(1) << 62);  // 1: 128B swizzle
}
// Before the first wgmma of a batch whose registers (accumulators, A) other code has touched.
__device__ __forceinline__ void fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared-memory writes by ordinary stores and cp.async become visible to the tensor cores' reads
// (the async proxy) only after this fence (then a barrier).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accesses of accumulators across the asynchronous products.
template <int K>
__device__ __forceinline__ void fence_operand(float (&d)[K]) {
#pragma unroll
  for (int i = 0; i < K; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#include "backend/cuda/wgmma_ops.inc"
#endif

}  // namespace wg
}  // namespace hypic::cuda
