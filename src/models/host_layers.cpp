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
    float* p = h.data<float>();
    for (int64_t i = 0; i < h.numel(); ++i) p[i] = p[i] > 0 ? p[i] * p[i] : 0.0f;
  }
  be.matmul(h, w.down, out);
}

void routed_experts(Backend& be, const Tensor& x, const MoeRouting& r, const std::vector<FfnWeights>& experts,
                    Tensor& out) {
  const int64_t H = x.dim(1);
  std::fill(out.data<float>(), out.data<float>() + out.numel(), 0.f);
  for (int64_t e = 0; e < r.experts; ++e) {
    const int64_t s0 = r.start[e], s1 = r.start[e + 1], R = s1 - s0;
    if (R == 0) continue;
    Tensor xe = be.alloc_uninit(DType::F32, {R, H}), ye = be.alloc_uninit(DType::F32, {R, H});
    for (int64_t i = 0; i < R; ++i) {
      const int64_t t = r.order[s0 + i] / r.top_k;
      std::copy(x.data<float>() + t * H, x.data<float>() + (t + 1) * H, xe.data<float>() + i * H);
    }
    ffn_forward(be, xe, experts[static_cast<size_t>(e)], ye);
    for (int64_t i = 0; i < R; ++i) {
      const int64_t slot = r.order[s0 + i], t = slot / r.top_k;
      const float w = r.weight[slot];
      for (int64_t j = 0; j < H; ++j) out.data<float>()[t * H + j] += w * ye.data<float>()[i * H + j];
    }
  }
}

void attend_spans(Model& model, Backend& be, const Tensor& q, const Tensor& k, const Tensor& v,
                  std::span<const LayerSpan> spans, float scale, Tensor& o) {
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

void causal_conv_silu(const float* in, int64_t in_stride, int64_t n, int64_t C, const float* w, int64_t K,
                      const float* bias, float* state, float* out) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < C; ++c) {
      float acc = bias ? bias[c] : 0.0f;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t src = t - (K - 1) + j;
        acc += w[c * K + j] * (src < 0 ? state[(K - 1 + src) * C + c] : in[src * in_stride + c]);
      }
      out[t * C + c] = silu(acc);
    }
  if (n == 0 || K < 2) return;
  // The new state: the last K-1 inputs of (old state, rows).
  std::vector<float> hist(static_cast<size_t>((K - 1 + n) * C));
  std::copy(state, state + (K - 1) * C, hist.begin());
  for (int64_t t = 0; t < n; ++t) std::copy(in + t * in_stride, in + t * in_stride + C, hist.begin() + (K - 1 + t) * C);
  std::copy(hist.end() - (K - 1) * C, hist.end(), state);
}

void write_scaled_identity(const std::vector<float>& scale, Tensor& t) {
  const int64_t H = t.dim(0), n = t.dim(1);
  float* p = t.data<float>();
  std::fill(p, p + t.numel(), 0.f);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i) p[(h * n + i) * n + i] = scale[static_cast<size_t>(h)];
}

std::vector<float> host_f32(const Tensor& t) {
  Tensor f = t.to_f32();
  return std::vector<float>(f.data<float>(), f.data<float>() + f.numel());
}

}  // namespace hypic
