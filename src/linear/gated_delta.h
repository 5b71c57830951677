// Gated DeltaNet (Qwen3-Next, Qwen3.5) kernels on plain host memory, per sequence.
// Layout: q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv]; state [Hv, dk, dv] (f32).
// Recurrence per value head h (key head h / (Hv/Hk)):
//   S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
// with q, k optionally L2-normalised (eps 1e-6, as transformers) and q scaled by dk^-0.5.
#pragma once
#include <cstdint>

namespace hypic::linear {

struct GdnShape {
  int64_t T, Hk, Hv, dk, dv;
};

// Chunked forward (UT/WY chunks) from `state`, which is advanced in place; out [T, Hv, dv].
// transition, when non-null ([Hv, dk, dk]), receives the span's transition operator T_C
// computed in the same pass. Threads over heads with the given thread count.
void gated_delta_forward(const GdnShape& s, const float* q, const float* k, const float* v, const float* g,
                         const float* beta, bool l2norm_qk, float* state, float* out, float* transition, int threads);

// Head h alone, on the calling thread, with gated_delta_forward's arithmetic for that head:
// state_h [dk, dv] advanced in place, out's rows of head h written.
void gated_delta_forward_head(const GdnShape& s, const float* q, const float* k, const float* v, const float* g,
                              const float* beta, bool l2norm_qk, int64_t h, float* state_h, float* out);

}  // namespace hypic::linear
