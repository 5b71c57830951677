// bf16 products on the CPU through oneDNN (Debian's libdnnl): the `--activations bf16` mode of the
// CPU backend. Activations are rounded to bf16 once per product and multiplied with bf16 weights in
// place (no f32 copy of W), accumulating in f32, on AVX512_BF16's `vdpbf16ps` as oneDNN's brgemm
// kernels schedule it: 2.3x the rate of our f32 panels + OpenBLAS sgemm on the same cores
// (docs/perf-notes.md). Not hand-written: our own vdpbf16ps kernel reached half of oneDNN's rate.
// libdnnl.so.2 is opened on first use (dlopen), so nothing else in hypic depends on it.
#pragma once
#include <cstdint>
#include <string>

namespace hypic::cpu::bf16_gemm {

// Empty when bf16 products can run here; otherwise why not (built without oneDNN, or a CPU
// without AVX512_BF16), for the error that refuses `--activations bf16`.
const std::string& unavailable_reason();

// y[m, 0:n] (+)= x[m, 0:k] . w[0:n, 0:k]^T for m < M, every operand row-major with the given row
// strides in elements; x and w bf16, y f32. `threads`: oneDNN's threads for this call (OpenMP; our
// pool idles meanwhile). Throws std::runtime_error if unavailable.
void matmul(int64_t M, int64_t N, int64_t K, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* y,
            int64_t ldy, bool accumulate, int threads);

}  // namespace hypic::cpu::bf16_gemm
