// Layer pieces shared by the architectures with a file of their own (models/blocks.h): a dense MLP
// (SwiGLU, or ReLU^2 with up/down only), routed experts over a MoeRouting, and the short causal conv of
// linear layers. Elementwise work runs on host memory (CPU backend), matrix products on the backend.
#pragma once
#include <cmath>
#include <vector>

#include "backend/backend.h"
#include "backend/moe_routing.h"
#include "models/model.h"

namespace hypic {

struct FfnWeights {
  Tensor gate, up, down;  // [I, H], [I, H], [H, I]; no gate: down(relu(up x)^2)
};

// out [T, H] = the MLP of x [T, H].
void ffn_forward(Backend& be, const Tensor& x, const FfnWeights& w, Tensor& out);
// out [T, H] = sum over each token's routed experts of weight * expert(x).
void routed_experts(Backend& be, const Tensor& x, const MoeRouting& r, const std::vector<FfnWeights>& experts,
                    Tensor& out);

// Causal softmax attention of each span's rows of q [T, Hq, D] against its sequence's cache: the
// span's k, v rows [T, Hkv, D] are written at its positions first; then its `after` work runs
// (through model.apply_after). o [T, Hq, D].
void attend_spans(Model& model, Backend& be, const Tensor& q, const Tensor& k, const Tensor& v,
                  std::span<const LayerSpan> spans, float scale, Tensor& o);

// Depthwise causal conv1d + SiLU over n rows: in(t, c) = in[t * in_stride + c] for c < C, w [C, K],
// bias [C] or null; state [K-1, C] holds the K-1 inputs before row 0 (oldest first) and is advanced.
// out [n, C].
void causal_conv_silu(const float* in, int64_t in_stride, int64_t n, int64_t C, const float* w, int64_t K,
                      const float* bias, float* state, float* out);

inline float silu(float x) {
  return x / (1.0f + std::exp(-x));
}
// torch.nn.functional.softplus (beta 1, threshold 20).
inline float softplus(float x) {
  return x > 20.0f ? x : std::log1p(std::exp(x));
}
// t [H, n, n] <- scale[h] times the identity per head (n = 1: the compact form of such a transition).
void write_scaled_identity(const std::vector<float>& scale, Tensor& t);
// Host f32 copy of a (small) weight.
std::vector<float> host_f32(const Tensor& t);

}  // namespace hypic
