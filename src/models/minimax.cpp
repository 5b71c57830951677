// MiniMaxForCausalLM (MiniMax-Text-01 / M1; transformers 5.17 modeling_minimax.py). Every layer:
//   y = RMSNorm(x); x = alpha_a * y + beta_a * mixer(y); z = RMSNorm(x); x = alpha_m * z + beta_m * MoE(z)
// (the residual is the normed input; alpha/beta per sub-layer kind), the mixer being
//   lightning   [q | k | v] per head = silu(qkv_proj(y)); S_t = exp(-s_h) S_{t-1} + k_t v_t^T,
//               o_t = S_t^T q_t (linear::Family::Retention; s_h the per-head slope rate, which
//               falls with depth: slope_rate in the checkpoint, else computed as transformers does);
//               RMSNorm over all heads (eps 1e-6, as transformers builds it), times
//               sigmoid(output_gate(y)), out_proj
//   attention   GQA softmax attention, NeoX RoPE over the whole head (transformers 5.17 ignores
//               partial_rotary_factor here), no gate, no q/k norms
// and the MoE softmax top-k over SwiGLU experts (Mixtral's w1 gate / w3 up / w2 down), renormalised.
// RMSNorm weights multiply directly. Every piece is a backend op (CPU and CUDA).
#include <cmath>
#include <stdexcept>

#include "linear/recurrence.h"
#include "models/blocks.h"
#include "models/config_fields.h"
#include "models/host_layers.h"

namespace hypic {
namespace {

struct Layer {
  LayerKind kind;
  Tensor in_norm, post_norm;
  Tensor qkv, gate, out, norm;   // lightning
  std::vector<float> log_gamma;  // lightning: -slope per head (host copy of log_gamma_dev)
  Tensor log_gamma_dev;          // f32 [heads]
  Tensor q, k, v, o;             // attention
  Tensor router;
  ExpertWeights experts;
};

class MiniMax : public ArchBlocks {
 public:
  MiniMax(const ModelConfig& c, const LoadWeight& load, Backend& be) : c_(c), be_(be) {
    H_ = c.hidden_size;
    Hh_ = c.num_attention_heads;
    D_ = c.head_dim;
    // The fused projection's column blocks of D per head are [q | k | v]; gathered as all q, all k, all v.
    for (int64_t part = 0; part < 3; ++part)
      for (int64_t h = 0; h < Hh_; ++h) qkv_order_.push_back(3 * h + part);
    auto dev = [&](const std::string& n, const Shape& s) { return be.to_device(load(n, s)); };
    const int64_t L = c.num_hidden_layers, E = c.num_experts, I = c.moe_intermediate_size;
    for (int64_t i = 0; i < L; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      const std::string a = p + "self_attn.";
      Layer l;
      l.kind = c.layer_types[static_cast<size_t>(i)];
      l.in_norm = dev(p + "input_layernorm.weight", {H_});
      l.post_norm = dev(p + "post_attention_layernorm.weight", {H_});
      if (l.kind == LayerKind::Linear) {
        l.qkv = dev(a + "qkv_proj.weight", {3 * Hh_ * D_, H_});
        l.gate = dev(a + "output_gate.weight", {Hh_ * D_, H_});
        l.out = dev(a + "out_proj.weight", {H_, Hh_ * D_});
        l.norm = dev(a + "norm.weight", {Hh_ * D_});
        // transformers: rate = (2^(-8/heads))^(h+1) * (1 - layer/(layers - 1 + 1e-5) + 1e-5), in f32.
        const double base = 1.0 / std::pow(2.0, 8.0 / static_cast<double>(Hh_));
        const double factor = 1.0 - static_cast<double>(i) / (static_cast<double>(L) - 1.0 + 1e-5) + 1e-5;
        std::vector<float> slope(static_cast<size_t>(Hh_));
        for (int64_t h = 0; h < Hh_; ++h)
          slope[h] = static_cast<float>(std::pow(base, static_cast<double>(h + 1))) * static_cast<float>(factor);
        l.log_gamma.resize(slope.size());
        for (size_t h = 0; h < slope.size(); ++h) l.log_gamma[h] = -slope[h];
        l.log_gamma_dev = be.to_device(host_tensor(l.log_gamma, {Hh_}));
      } else {
        const int64_t kv = c.num_key_value_heads * D_;
        l.q = dev(a + "q_proj.weight", {Hh_ * D_, H_});
        l.k = dev(a + "k_proj.weight", {kv, H_});
        l.v = dev(a + "v_proj.weight", {kv, H_});
        l.o = dev(a + "o_proj.weight", {H_, Hh_ * D_});
      }
      const std::string m = p + "block_sparse_moe.";
      l.router = dev(m + "gate.weight", {E, H_});
      for (int64_t e = 0; e < E; ++e) {
        const std::string ep = m + "experts." + std::to_string(e) + ".";
        l.experts.gate.push_back(dev(ep + "w1.weight", {I, H_}));
        l.experts.up.push_back(dev(ep + "w3.weight", {I, H_}));
        l.experts.down.push_back(dev(ep + "w2.weight", {H_, I}));
        expert_bytes_ += l.experts.gate.back().nbytes() + l.experts.up.back().nbytes() + l.experts.down.back().nbytes();
      }
      layers_.push_back(std::move(l));
    }
  }

  size_t expert_bytes() const override { return expert_bytes_; }

  bool scalar_transition() const override { return true; }

  // A compact body's g rows hold the layer's log decay (the same in every row).
  void replay(const RecurrenceInputs& in, Tensor& ssm) override {
    const int64_t n = in.rows();
    if (n == 0) return;
    // The keys stand in for the queries: the outputs are dropped.
    Tensor out = be_.alloc_uninit(DType::F32, {n, Hh_, D_});
    be_.linear_recurrence({linear::Family::Retention}, in.k, in.k, in.v, Tensor(), Tensor(),
                          in.g.slice_rows(0, 1).reshape({Hh_}), ssm, out);
  }

  void layer_forward(Model& model, int64_t layer, Tensor& x, std::span<const LayerSpan> spans) override {
    Layer& l = layers_[static_cast<size_t>(layer)];
    const int64_t T = x.dim(0);
    const float eps = static_cast<float>(c_.rms_norm_eps);
    Tensor y = be_.alloc_uninit(DType::F32, {T, H_});
    Tensor mix = be_.alloc_uninit(DType::F32, {T, H_});
    be_.rms_norm(x, l.in_norm, eps, false, y);
    const bool lin = l.kind == LayerKind::Linear;
    if (lin)
      lightning(model, l, y, spans, mix);
    else
      attention(model, l, y, spans, mix);
    be_.scale_add(y, static_cast<float>(lin ? c_.linear_attn_alpha : c_.full_attn_alpha), mix,
                  static_cast<float>(lin ? c_.linear_attn_beta : c_.full_attn_beta), x);
    be_.rms_norm(x, l.post_norm, eps, false, y);
    Tensor logits = be_.alloc_uninit(DType::F32, {T, c_.num_experts});
    be_.matmul(y, l.router, logits);
    be_.moe_experts(y, logits, static_cast<int>(c_.num_experts_per_tok), true, l.experts, mix);
    be_.scale_add(y, static_cast<float>(c_.mlp_alpha), mix, static_cast<float>(c_.mlp_beta), x);
  }

 private:
  void lightning(Model& model, const Layer& l, const Tensor& y, std::span<const LayerSpan> spans, Tensor& mix) {
    const int64_t T = y.dim(0), HD = Hh_ * D_;
    Tensor qkv = be_.alloc_uninit(DType::F32, {T, 3 * HD});
    Tensor gate = be_.alloc_uninit(DType::F32, {T, HD});
    be_.matmul_many(y, {l.qkv, l.gate}, {qkv, gate});
    // Per head the projection's rows are [q D | k D | v D]; SiLU on all three.
    Tensor parts = be_.alloc_uninit(DType::F32, {T, 3 * HD});
    be_.gather_col_blocks(qkv, qkv_order_, parts);
    be_.activate(Backend::Activation::Silu, parts);
    Tensor q = be_.alloc_uninit(DType::F32, {T, Hh_, D_}), k = be_.alloc_uninit(DType::F32, {T, Hh_, D_});
    Tensor v = be_.alloc_uninit(DType::F32, {T, Hh_, D_});
    for (auto [t, col] : {std::pair<Tensor*, int64_t>{&q, 0}, {&k, HD}, {&v, 2 * HD}}) {
      Tensor t2 = t->reshape({T, HD});
      be_.copy_cols(parts, col, t2);
    }
    Tensor o = be_.alloc_uninit(DType::F32, {T, Hh_, D_});
    const bool batch = plain_spans(spans);
    if (batch) {  // a batch: one call for every sequence's rows
      const SpanRuns ssm(spans, &LayerState::ssm);
      be_.linear_recurrence_runs({linear::Family::Retention}, q, k, v, Tensor(), Tensor(), l.log_gamma_dev, ssm.states,
                                 ssm.rows, o);
    }
    int64_t r0 = 0;
    for (const LayerSpan& sp : batch ? std::span<const LayerSpan>() : spans) {
      const int64_t n = sp.rows, r1 = r0 + n;
      Tensor ks = k.slice_rows(r0, r1), vs = v.slice_rows(r0, r1), os = o.slice_rows(r0, r1);
      // T_C = gamma^n per head: a scaled identity [H, 1, 1] (or dense [H, D, D]).
      be_.linear_recurrence({linear::Family::Retention}, q.slice_rows(r0, r1), ks, vs, Tensor(), Tensor(),
                            l.log_gamma_dev, sp.state->ssm, os, sp.transition);
      if (sp.record && n > 0) {  // a compact PIC body: k, v, and the log decay in every row of g
        RecurrenceInputs& rec = *sp.record;
        rec.k = be_.alloc_uninit(DType::F32, {n, Hh_, D_});
        rec.v = be_.alloc_uninit(DType::F32, {n, Hh_, D_});
        rec.beta = be_.alloc(DType::F32, {n, Hh_});
        be_.copy(ks, rec.k);
        be_.copy(vs, rec.v);
        std::vector<float> g;
        for (int64_t t = 0; t < n; ++t) g.insert(g.end(), l.log_gamma.begin(), l.log_gamma.end());
        rec.g = be_.to_device(host_tensor(g, {n, Hh_}));
      }
      if (sp.after.any()) model.apply_after(*sp.state, sp.after);
      r0 = r1;
    }
    Tensor o2 = o.reshape({T, HD});
    be_.rms_norm(o2, l.norm, 1e-6f, false, o2);
    be_.sigmoid_mul(o2, gate, o2);
    be_.matmul(o2, l.out, mix);
  }

  void attention(Model& model, const Layer& l, const Tensor& y, std::span<const LayerSpan> spans, Tensor& mix) {
    const int64_t T = y.dim(0), Hkv = c_.num_key_value_heads;
    Tensor q = be_.alloc_uninit(DType::F32, {T, Hh_, D_});
    Tensor k = be_.alloc_uninit(DType::F32, {T, Hkv, D_});
    Tensor v = be_.alloc_uninit(DType::F32, {T, Hkv, D_});
    Tensor q2 = q.reshape({T, Hh_ * D_}), k2 = k.reshape({T, Hkv * D_}), v2 = v.reshape({T, Hkv * D_});
    be_.matmul_many(y, {l.q, l.k, l.v}, {q2, k2, v2});
    std::vector<int64_t> pos;
    for (const LayerSpan& sp : spans)
      for (int64_t t = 0; t < sp.rows; ++t) pos.push_back(sp.pos0 + t);
    const int rot = static_cast<int>(c_.rotary_dim());
    be_.rope_neox(q, pos, rot, c_.rope_theta);
    be_.rope_neox(k, pos, rot, c_.rope_theta);
    Tensor o = be_.alloc_uninit(DType::F32, {T, Hh_, D_});
    const float scale = 1.0f / std::sqrt(static_cast<float>(D_));
    attend_spans(model, be_, q, k, v, spans, scale, o);
    be_.matmul(o.reshape({T, Hh_ * D_}), l.o, mix);
  }

  const ModelConfig& c_;
  Backend& be_;
  int64_t H_, Hh_, D_;
  std::vector<int64_t> qkv_order_;
  std::vector<Layer> layers_;
  size_t expert_bytes_ = 0;
};

}  // namespace

std::unique_ptr<ArchBlocks> minimax_blocks(const ModelConfig& c, const LoadWeight& load, Backend& be) {
  return std::make_unique<MiniMax>(c, load, be);
}

// This architecture's config.json fields (parse_model_config dispatches here).
namespace config_detail {

void parse_minimax(const Fields& f, ModelConfig& cfg) {
  parse_attention_common(f, cfg);
  // Lightning attention: one state [head_dim, head_dim] per attention head, no short conv (the conv
  // state is a placeholder of one value), RoPE over the whole head (transformers 5.17's MiniMax
  // rotary embedding ignores partial_rotary_factor; so does this engine).
  cfg.partial_rotary_factor = 1.0;
  cfg.linear_num_key_heads = cfg.linear_num_value_heads = cfg.num_attention_heads;
  cfg.linear_key_head_dim = cfg.linear_value_head_dim = cfg.head_dim;
  cfg.linear_conv_kernel_dim = 2;
  cfg.linear_attn_alpha = f.number_or("linear_attn_alpha_factor", 1);
  cfg.linear_attn_beta = f.number_or("linear_attn_beta_factor", 1);
  cfg.full_attn_alpha = f.number_or("full_attn_alpha_factor", 1);
  cfg.full_attn_beta = f.number_or("full_attn_beta_factor", 1);
  cfg.mlp_alpha = f.number_or("mlp_alpha_factor", 1);
  cfg.mlp_beta = f.number_or("mlp_beta_factor", 1);
  if (f.find("sliding_window")) f.fail("field 'sliding_window' (sliding-window attention) is not supported");
  parse_layer_types(f, cfg);
  // Every layer routes to num_experts_per_tok of num_local_experts SwiGLU experts of intermediate_size.
  cfg.num_experts = f.non_negative_or("num_local_experts", 0);
  if (cfg.num_experts == 0) f.fail("missing field 'num_local_experts' (every MiniMax layer is an MoE)");
  cfg.num_experts_per_tok = f.positive("num_experts_per_tok");
  cfg.moe_intermediate_size = f.positive("intermediate_size");
  if (cfg.num_experts_per_tok > cfg.num_experts)
    f.fail("field 'num_experts_per_tok' (" + std::to_string(cfg.num_experts_per_tok) +
           ") must not exceed 'num_local_experts' (" + std::to_string(cfg.num_experts) + ")");
  parse_mlp_widths_and_token_ids(f, cfg);
}

}  // namespace config_detail

}  // namespace hypic
