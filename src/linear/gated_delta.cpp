// Gated DeltaNet entry point used by the CPU backend: the chunked (UT/WY) kernel of
// linear/recurrence.cpp with the Qwen3.5 / Qwen3-Next conventions (q scaled by dk^-0.5).
#include "linear/gated_delta.h"

#include <cmath>

#include "linear/recurrence.h"

namespace hypic::linear {

namespace {
RecInputs gdn_inputs(const GdnShape& s, const float* q, const float* k, const float* v, const float* g,
                     const float* beta, bool l2norm_qk) {
  RecInputs in;
  in.q = q, in.k = k, in.v = v, in.g = g, in.beta = beta;
  in.l2norm_qk = l2norm_qk;
  in.q_scale = 1.0f / std::sqrt(float(s.dk));
  return in;
}
}  // namespace

void gated_delta_forward_head(const GdnShape& s, const float* q, const float* k, const float* v, const float* g,
                              const float* beta, bool l2norm_qk, int64_t h, float* state_h, float* out) {
  chunked_forward_head(Family::GatedDeltaNet, RecShape{s.T, s.Hk, s.Hv, s.dk, s.dv},
                       gdn_inputs(s, q, k, v, g, beta, l2norm_qk), h, state_h, out, 0);
}

void gated_delta_forward(const GdnShape& s, const float* q, const float* k, const float* v, const float* g,
                         const float* beta, bool l2norm_qk, float* state, float* out, float* transition, int threads) {
  const RecInputs in = gdn_inputs(s, q, k, v, g, beta, l2norm_qk);
  // Chunk 0 = the library default (32): any size is exact, 32 measured 15-20% faster than 64 here.
  chunked_forward(Family::GatedDeltaNet, RecShape{s.T, s.Hk, s.Hv, s.dk, s.dv}, in, state, out, transition, threads, 0);
}

}  // namespace hypic::linear
