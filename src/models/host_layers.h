// Layer pieces shared by the architectures with a file of their own (models/blocks.h): a dense MLP
// (SwiGLU, or ReLU^2 with up/down only), sigmoid-routed experts, the attention of spans, and small
// host-to-device helpers. Everything runs as backend ops.
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
// A sigmoid-routed MoE layer (Nemotron-H, Kimi-Linear): the router, DeepSeek-V3's routing with the
// selection bias on the device, the routed experts (gate empty: ReLU^2 experts).
struct SigmoidMoe {
  Tensor router;  // [E, H]
  MoeRouter routing;
  ExpertWeights experts;
  void add_expert(const FfnWeights& w);
};
// The config's routing (top-k, renormalisation, groups, scaling) with this selection bias [E] (f32,
// on the device).
MoeRouter sigmoid_router(const ModelConfig& c, Tensor bias);
// out [T, H] = the routed experts' weighted sum for x [T, H]: router logits, routing and experts all
// on the backend (Backend::moe_experts), nothing through the host.
void sigmoid_moe_forward(Backend& be, const Tensor& x, const SigmoidMoe& m, Tensor& out);

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
