// The payload checksum of entries shared between processes (Backend::payload_checksum; the
// reference is the host loop in backend.cpp). Written here because no NVIDIA library sums a
// position-keyed hash over a list of buffers: each thread hashes 4-byte words of one piece
// (grid-stride), a warp adds its sums, and one 64-bit atomic per warp adds them up. Integer sums
// are exact and commutative, so the result does not depend on the order.
#include <cuda_runtime.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/splitmix.h"

namespace hypic::cuda {

namespace {

__global__ void k_payload_checksum(const ChecksumPiece* pieces, int n_pieces, unsigned long long* out) {
  uint64_t sum = 0;
  for (int p = 0; p < n_pieces; ++p) {
    const ChecksumPiece pc = pieces[p];
    const uint64_t words = (pc.bytes + 3) / 4;
    const auto* b = static_cast<const uint8_t*>(pc.data);
    const bool aligned = (reinterpret_cast<uintptr_t>(b) & 3) == 0;
    for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < words;
         i += uint64_t{gridDim.x} * blockDim.x) {
      uint32_t w = 0;
      if (aligned && 4 * i + 4 <= pc.bytes) {
        w = reinterpret_cast<const uint32_t*>(b)[i];
      } else {
        for (uint64_t k = 0; k < 4 && 4 * i + k < pc.bytes; ++k) w |= uint32_t{b[4 * i + k]} << (8 * k);
      }
      sum += splitmix64(((pc.base_word + i) << 32) | w);
    }
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, static_cast<unsigned long long>(sum));
}

}  // namespace

void launch_payload_checksum(cudaStream_t s, const ChecksumPiece* pieces, int n_pieces, uint64_t max_bytes,
                             unsigned long long* out) {
  CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(unsigned long long), s));
  if (n_pieces == 0) return;
  constexpr int kThreads = 256;
  const uint64_t words = (max_bytes + 3) / 4;
  const int blocks =
      static_cast<int>(std::min<uint64_t>(1024, std::max<uint64_t>(1, (words + kThreads - 1) / kThreads)));
  k_payload_checksum<<<blocks, kThreads, 0, s>>>(pieces, n_pieces, out);
  CUDA_LAUNCH_CHECK("payload_checksum");
}

}  // namespace hypic::cuda
