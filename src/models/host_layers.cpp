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

void routed_experts(Backend& be, const Tensor& x, const MoeRouting& r, const std::vector<FfnWeights>& experts,
                    Tensor& out) {
  const int64_t H = x.dim(1);
  be.fill(out, 0.f);
  std::vector<int32_t> rows;
  std::vector<float> weights;
  for (int64_t e = 0; e < r.experts; ++e) {
    const int64_t s0 = r.start[e], s1 = r.start[e + 1], R = s1 - s0;
    if (R == 0) continue;
    rows.clear();
    weights.clear();
    for (int64_t i = s0; i < s1; ++i) {
      rows.push_back(static_cast<int32_t>(r.order[i] / r.top_k));
      weights.push_back(r.weight[r.order[i]]);
    }
    // Gather the expert's tokens (an embedding lookup in x), run it, add its weighted outputs.
    Tensor xe = be.alloc_uninit(DType::F32, {R, H}), ye = be.alloc_uninit(DType::F32, {R, H});
    be.embedding(x, rows, xe);
    ffn_forward(be, xe, experts[static_cast<size_t>(e)], ye);
    be.add_rows_scaled(ye, rows, weights, out);
  }
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
