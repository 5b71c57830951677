// Q8_0 weights on the CPU (issue 17, first quantized type): ggml's layout, as GGUF files store
// them: blocks of 32 int8 values with one f16 scale, d = max|x| / 127, q = round(x / d).
// A product with f32 activations quantizes the activations to Q8_0 blocks too (as llama.cpp
// does) and sums int8 x int8 in integers, one block at a time: AVX-512 VNNI / AVX-VNNI where the
// CPU has them, a plain loop otherwise. The plain loop (`*_ref`) is also the reference the fast
// kernels are tested against. Not wired into the model yet: GGUF files' Q8_0 tensors are
// dequantized at load for now (models/gguf_checkpoint.h).
#pragma once
#include <cstdint>

namespace hypic::q8_0 {

constexpr int64_t kBlock = 32;

#pragma pack(push, 1)
struct Block {
  uint16_t d;  // f16 scale
  int8_t q[kBlock];
};
#pragma pack(pop)
static_assert(sizeof(Block) == 34, "Q8_0 blocks are 34 bytes");

// The f16 scales convert with f16_to_f32 / f32_to_f16 of tensor/dtype.h.
// n % kBlock == 0
void quantize(const float* x, int64_t n, Block* out);
void dequantize(const Block* b, int64_t n, float* out);

// sum over blocks of d_a d_b (q_a . q_b)
float dot_ref(const Block* a, const Block* b, int64_t nblocks);
float dot(const Block* a, const Block* b, int64_t nblocks);  // the fast kernel where available
const char* dot_kernel();                                    // "avx512-vnni", "avx-vnni", "avx2" or "plain"

// y[n] = W[n, :] . x for rows n0 <= n < n1: W as rows of K / kBlock blocks, xq the activations
// quantized with quantize() (K values).
void gemv_rows(const Block* w, const Block* xq, int64_t K, int64_t n0, int64_t n1, float* y);

}  // namespace hypic::q8_0
