// ggml's block-quantized weight formats (DType::Q8_0, Q4_K, Q6_K), byte for byte as GGUF files
// store them, with plain-loop quantizers and dequantizers. Written here from the format's
// definition (ggml-common.h documents the layouts); no Debian library reads them.
//  * Q8_0: 32 values, one f16 scale: x = d q, q in [-127, 127].
//  * Q4_K: 256 values in 8 sub-blocks of 32; x = d sc_j q - dmin m_j with q in [0, 15] and 6-bit
//    sub-block scales sc_j and mins m_j packed into 12 bytes.
//  * Q6_K: 256 values in 16 sub-blocks of 16; x = d sc_j (q - 32) with q in [0, 63] (4 low bits
//    in ql, 2 high bits in qh) and int8 sub-block scales.
//  * Q8_K: activations only (never stored): 256 int8 values with an f32 scale and the sums of
//    each 16 values, which the K-quant dot products need for their mins and offsets.
// The quantizers round each sub-block's scale from its range (llama.cpp's search for the best
// scales is not reproduced: files made by llama.cpp load unchanged, files made here are a little
// less accurate at 4 bits).
#pragma once
#include <cstdint>

#include "tensor/dtype.h"

namespace hypic::quant {

constexpr int64_t kQ8_0 = 32;  // values per Q8_0 block
constexpr int64_t kQK = 256;   // values per K-quant super-block

#pragma pack(push, 1)
struct BlockQ8_0 {
  uint16_t d;  // f16
  int8_t q[kQ8_0];
};
struct BlockQ4_K {
  uint16_t d, dmin;     // f16 super-block scales of the sub-block scales and mins
  uint8_t scales[12];   // 8 scales and 8 mins of 6 bits
  uint8_t qs[kQK / 2];  // chunk c of 64 values: low nibbles values 64c..64c+31, high nibbles the next 32
};
struct BlockQ6_K {
  uint8_t ql[kQK / 2];  // low 4 bits
  uint8_t qh[kQK / 4];  // high 2 bits
  int8_t scales[kQK / 16];
  uint16_t d;  // f16
};
struct BlockQ8_K {
  float d;
  int8_t q[kQK];
  int16_t bsums[kQK / 16];
};
#pragma pack(pop)
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_K) == 144 && sizeof(BlockQ6_K) == 210 &&
              sizeof(BlockQ8_K) == 292);

// The sub-block scale and min j (0..7) of a Q4_K block.
inline void q4_k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// n % block == 0 for every function below.
void quantize_q8_0(const float* x, int64_t n, BlockQ8_0* out);
void quantize_q4_k(const float* x, int64_t n, BlockQ4_K* out);
void quantize_q6_k(const float* x, int64_t n, BlockQ6_K* out);
void quantize_q8_k(const float* x, int64_t n, BlockQ8_K* out);

// Any quantized dtype (and Q8_K's values through dequantize_q8_k).
void dequantize(DType t, const void* src, int64_t n, float* dst);
void dequantize_q8_k(const BlockQ8_K* b, int64_t n, float* dst);

// Values of dtype t to t's blocks (quantize_* by type).
void quantize(DType t, const float* x, int64_t n, void* out);

}  // namespace hypic::quant
