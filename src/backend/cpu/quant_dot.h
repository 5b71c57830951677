// Products of quantized weights (tensor/quant.h: Q8_0, Q4_K, Q6_K) with f32 activations on the
// CPU, as llama.cpp computes them: the activations are quantized per block too (Q8_0 for Q8_0
// weights, Q8_K for the K-quants) and each block's product is summed in integers, then scaled.
// AVX2 kernels (u8 x s8 pairs through maddubs, or VNNI where the CPU has it) with a plain loop
// otherwise; the plain loops (`*_ref`) are also the references the kernels are tested against.
// Every output row is one row's sum in a fixed order, so results never depend on the rows beside
// it (the row-independent products of PIC need that).
#pragma once
#include <cstddef>
#include <cstdint>

#include "tensor/dtype.h"

namespace hypic::quant {

// Bytes of K activations quantized for products with weights of type w.
size_t act_bytes(DType w, int64_t K);
void quantize_act(DType w, const float* x, int64_t K, void* xq);

// y[n] = W[n, :] . x for n0 <= n < n1: W's rows hold K values of type w, xq is x through
// quantize_act(w, ...).
void gemv_rows(DType w, const void* W, const void* xq, int64_t K, int64_t n0, int64_t n1, float* y);
void gemv_rows_ref(DType w, const void* W, const void* xq, int64_t K, int64_t n0, int64_t n1, float* y);

const char* dot_kernel();  // "avx512-vnni, zmm k-quants", "avx512-vnni", "avx-vnni", "avx2" or "plain"

}  // namespace hypic::quant
