// Layer pieces shared by the architectures with a file of their own (models/blocks.h): a dense MLP
// (SwiGLU, or ReLU^2 with up/down only), routed experts over a MoeRouting computed on the host, the
// attention of spans, and small host-to-device helpers. Everything runs as backend ops.
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

// Whether a layer call's spans are plain runs of rows (no transition, recorded body or after-work:
// a batch of decode steps or of whole prompts), which the backend's *_runs ops take in one call.
inline bool plain_spans(std::span<const LayerSpan> spans) {
  for (const LayerSpan& sp : spans)
    if (sp.transition || sp.record || sp.after.any()) return false;
  return true;
}
// The spans' rows and one of their states each (member: &LayerState::ssm or &LayerState::conv).
struct SpanRuns {
  std::vector<Tensor*> states;
  std::vector<int64_t> rows;
  SpanRuns(std::span<const LayerSpan> spans, Tensor LayerState::*member) {
    for (const LayerSpan& sp : spans) {
      states.push_back(&(sp.state->*member));
      rows.push_back(sp.rows);
    }
  }
};

// Host f32 copy of a (small) weight.
std::vector<float> host_f32(const Tensor& t);
// A host f32 tensor holding v (shape's element count == v.size()).
Tensor host_tensor(const std::vector<float>& v, Shape shape);

}  // namespace hypic
