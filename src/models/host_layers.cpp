#include "models/host_layers.h"

#include <algorithm>
#include <stdexcept>

namespace hypic {

void ffn_forward(Backend& be, const Tensor& x, const FfnWeights& w, Tensor& out) {
  Tensor h = be.alloc_uninit(DType::F32, {x.dim(0), w.up.dim(0)});
  if (w.gate.defined()) {
    be.matmul_swiglu(x, w.gate, w.up, h);
  } else {
    be.matmul(x, w.up, h);
    be.activate(Backend::Activation::ReluSquared, h);
  }
  be.matmul(h, w.down, out);
}

void SigmoidMoe::add_expert(const FfnWeights& w) {
  if (w.gate.defined()) experts.gate.push_back(w.gate);
  experts.up.push_back(w.up);
  experts.down.push_back(w.down);
}

MoeRouter sigmoid_router(const ModelConfig& c, Tensor bias) {
  MoeRouter r;
  r.top_k = static_cast<int>(c.num_experts_per_tok);
  r.norm_topk = c.norm_topk_prob;
  r.sigmoid = true;
  r.bias = std::move(bias);
  r.n_group = c.n_group;
  r.topk_group = c.topk_group;
  r.scaling = static_cast<float>(c.routed_scaling_factor);
  return r;
}

void sigmoid_moe_forward(Backend& be, const Tensor& x, const SigmoidMoe& m, Tensor& out) {
  Tensor logits = be.alloc_uninit(DType::F32, {x.dim(0), m.router.dim(0)});
  be.matmul(x, m.router, logits);
  be.moe_experts(x, logits, m.routing, m.experts, out);
}

void attend_spans(Model& model, Backend& be, const Tensor& q, const Tensor& k, const Tensor& v,
                  std::span<const LayerSpan> spans, float scale, Tensor& o) {
  // A batch of decode steps (a row per sequence, no after-work): one attention_step for all, with
  // tables of the caches' addresses and the positions (one launch on the GPU instead of two a row).
  const bool steps = spans.size() > 1 && plain_spans(spans) &&
                     std::all_of(spans.begin(), spans.end(), [](const LayerSpan& sp) { return sp.rows == 1; });
  if (steps) {
    const int64_t B = static_cast<int64_t>(spans.size());
    Tensor caches = Tensor::empty(DType::I64, {2 * B}), positions = Tensor::empty(DType::I64, {B});
    for (int64_t b = 0; b < B; ++b) {
      LayerState& ls = *spans[b].state;
      if (spans[b].pos0 + 1 > ls.k.dim(0)) throw std::logic_error("KV cache too small: call Model::reserve first");
      caches.data<int64_t>()[b] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(ls.k.data<float>()));
      caches.data<int64_t>()[B + b] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(ls.v.data<float>()));
      positions.data<int64_t>()[b] = spans[b].pos0;
    }
    be.attention_step(q, k, v, be.to_device(caches), be.to_device(positions), scale, o);
    return;
  }
  int64_t r0 = 0;
  for (const LayerSpan& sp : spans) {
    LayerState& ls = *sp.state;
    if (sp.rows > 0) {
      if (sp.pos0 + sp.rows > ls.k.dim(0)) throw std::logic_error("KV cache too small: call Model::reserve first");
      const Backend::RowCopy pieces[2] = {{&k, r0, &ls.k, sp.pos0, sp.rows}, {&v, r0, &ls.v, sp.pos0, sp.rows}};
      be.copy_rows(pieces);
      const Backend::RowSpan run{sp.pos0, sp.rows};
      Tensor os = o.slice_rows(r0, r0 + sp.rows);
      be.attention_spans(q.slice_rows(r0, r0 + sp.rows), ls.k, ls.v, std::span<const Backend::RowSpan>(&run, 1), scale,
                         os);
    }
    if (sp.after.any()) model.apply_after(ls, sp.after);
    r0 += sp.rows;
  }
}

Tensor host_tensor(const std::vector<float>& v, Shape shape) {
  Tensor t = Tensor::empty(DType::F32, std::move(shape));
  if (t.numel() != static_cast<int64_t>(v.size())) throw std::logic_error("host_tensor: size mismatch");
  std::copy(v.begin(), v.end(), t.data<float>());
  return t;
}

std::vector<float> host_f32(const Tensor& t) {
  Tensor f = t.to_f32();
  return std::vector<float>(f.data<float>(), f.data<float>() + f.numel());
}

}  // namespace hypic
