// KimiLinearForCausalLM (transformers 5.17 modeling_kimi_linear.py; weights under the checkpoint's own
// names). Every layer: x += mixer(RMSNorm(x)); x += FFN(RMSNorm(x)), the mixer being
//   KDA   q, k, v projections, each through its own causal conv + SiLU (no bias); per-channel decay
//         g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias); beta = sigmoid(b_proj(x));
//         S_t = (I - beta k k^T) diag(exp(g_t)) S_{t-1} + beta k v^T on L2-normed q, k, q scaled by
//         dk^-0.5 (linear::Family::KDA); RMSNorm per head times sigmoid(g_b(g_a(x))); o_proj
//   MLA   without RoPE: q = q_proj(x) (or through a normed q latent), qk_nope + qk_rope values a
//         head; kv_a_proj_with_mqa(x) = [latent | shared part]; [k_nope | v] per head =
//         kv_b_proj(RMSNorm(latent)), every head's key [k_nope | shared part] (not rotated);
//         softmax attention scaled by (qk_nope + qk_rope)^-0.5
// and the FFN a SwiGLU MLP on the first layers, then sigmoid-routed grouped top-k experts (SwiGLU,
// Moonshot's w1 gate / w3 up / w2 down) plus shared experts. RMSNorm weights multiply directly; the
// latents' norms use eps 1e-6, as transformers builds them. Every piece is a backend op (CPU and
// CUDA), the MoE routing included. The K/V cache holds the expanded keys and values (values padded
// with zeros to the keys' width).
#include <cmath>
#include <stdexcept>

#include "backend/moe_routing.h"
#include "linear/recurrence.h"
#include "models/blocks.h"
#include "models/config_fields.h"
#include "models/gguf_arch.h"
#include "models/host_layers.h"

namespace hypic {
namespace {

struct Kda {
  Tensor q, k, v, f_a, f_b, b, g_a, g_b, o_norm, o;
  Tensor conv, conv_bias;  // f32 [3 HD, K]: q's, then k's, then v's; zeros [3 HD] (the convs have no bias)
  Tensor A, dt_bias;       // f32 exp(A_log) [heads]; [HD]
};
struct Mla {
  Tensor q, q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o;
};
struct Layer {
  LayerKind kind;
  bool moe = false;
  Tensor in_norm, post_norm;
  Kda kda;
  Mla mla;
  FfnWeights mlp, shared;
  SigmoidMoe routed;
};

class KimiLinear : public ArchBlocks {
 public:
  KimiLinear(const ModelConfig& c, const LoadWeight& load, Backend& be) : c_(c), be_(be) {
    H_ = c.hidden_size;
    Hl_ = c.linear_num_value_heads;
    dk_ = c.linear_key_head_dim;
    K_ = c.linear_conv_kernel_dim;
    HD_ = Hl_ * dk_;
    Hq_ = c.num_attention_heads;
    D_ = c.head_dim;
    P_ = c.qk_nope_head_dim;
    R_ = c.qk_rope_head_dim;
    V_ = c.v_head_dim;
    auto dev = [&](const std::string& n, const Shape& s) { return be.to_device(load(n, s)); };
    auto swiglu = [&](const std::string& p, const char* g, const char* u, const char* d, int64_t I) {
      return FfnWeights{dev(p + g + ".weight", {I, H_}), dev(p + u + ".weight", {I, H_}),
                        dev(p + d + ".weight", {H_, I})};
    };
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      const std::string a = p + "self_attn.";
      Layer l;
      l.kind = c.layer_types[static_cast<size_t>(i)];
      l.moe = c.layer_is_moe(i);
      l.in_norm = dev(p + "input_layernorm.weight", {H_});
      l.post_norm = dev(p + "post_attention_layernorm.weight", {H_});
      if (l.kind == LayerKind::Linear) {
        auto& w = l.kda;
        w.q = dev(a + "q_proj.weight", {HD_, H_});
        w.k = dev(a + "k_proj.weight", {HD_, H_});
        w.v = dev(a + "v_proj.weight", {HD_, H_});
        std::vector<float> conv;
        for (const char* n : {"q_conv1d", "k_conv1d", "v_conv1d"}) {
          const auto part = host_f32(load(a + n + ".weight", {HD_, 1, K_}));
          conv.insert(conv.end(), part.begin(), part.end());
        }
        w.conv = be.to_device(host_tensor(conv, {3 * HD_, K_}));
        w.conv_bias = be.alloc(DType::F32, {3 * HD_});
        w.f_a = dev(a + "f_a_proj.weight", {dk_, H_});
        w.f_b = dev(a + "f_b_proj.weight", {HD_, dk_});
        std::vector<float> A = host_f32(load(a + "A_log", {1, 1, Hl_, 1}));
        for (float& x : A) x = std::exp(x);
        w.A = be.to_device(host_tensor(A, {Hl_}));
        w.dt_bias = be.to_device(load(a + "dt_bias", {HD_}).to_f32());
        w.b = dev(a + "b_proj.weight", {Hl_, H_});
        w.g_a = dev(a + "g_a_proj.weight", {dk_, H_});
        w.g_b = dev(a + "g_b_proj.weight", {HD_, dk_});
        w.o_norm = dev(a + "o_norm.weight", {dk_});
        w.o = dev(a + "o_proj.weight", {H_, HD_});
      } else {
        auto& w = l.mla;
        const int64_t r = c.kv_lora_rank;
        if (c.q_lora_rank > 0) {
          w.q_a = dev(a + "q_a_proj.weight", {c.q_lora_rank, H_});
          w.q_a_norm = dev(a + "q_a_layernorm.weight", {c.q_lora_rank});
          w.q_b = dev(a + "q_b_proj.weight", {Hq_ * D_, c.q_lora_rank});
        } else {
          w.q = dev(a + "q_proj.weight", {Hq_ * D_, H_});
        }
        w.kv_a = dev(a + "kv_a_proj_with_mqa.weight", {r + R_, H_});
        w.kv_a_norm = dev(a + "kv_a_layernorm.weight", {r});
        w.kv_b = be.to_device(mla_kv_weights(load(a + "kv_b_proj.weight", {Hq_ * (P_ + V_), r})));
        w.o = be.to_device(mla_o_weights(load(a + "o_proj.weight", {H_, Hq_ * V_})));
      }
      const std::string m = p + "block_sparse_moe.";
      if (!l.moe) {
        l.mlp = swiglu(m, "gate_proj", "up_proj", "down_proj", c.intermediate_size);
      } else {
        const int64_t E = c.num_experts, I = c.moe_intermediate_size;
        l.routed.router = dev(m + "gate.weight", {E, H_});
        l.routed.routing = sigmoid_router(c, be.to_device(load(m + "gate.e_score_correction_bias", {E}).to_f32()));
        for (int64_t e = 0; e < E; ++e) {
          const FfnWeights ex = swiglu(m + "experts." + std::to_string(e) + ".", "w1", "w3", "w2", I);
          l.routed.add_expert(ex);
          expert_bytes_ += ex.gate.nbytes() + ex.up.nbytes() + ex.down.nbytes();
        }
        if (c.shared_expert_intermediate_size > 0)
          l.shared =
              swiglu(m + "shared_experts.", "gate_proj", "up_proj", "down_proj", c.shared_expert_intermediate_size);
      }
      layers_.push_back(std::move(l));
    }
  }

  size_t expert_bytes() const override { return expert_bytes_; }
  // KDA's decay is per key channel: a compact body's g would not fit the entry format ([n, heads]).
  bool compact_bodies() const override { return false; }
  void replay(const RecurrenceInputs&, Tensor&) override {
    throw std::logic_error(c_.architecture + ": no compact bodies to replay");
  }

  void layer_forward(Model& model, int64_t layer, Tensor& x, std::span<const LayerSpan> spans) override {
    Layer& l = layers_[static_cast<size_t>(layer)];
    const int64_t T = x.dim(0);
    const float eps = static_cast<float>(c_.rms_norm_eps);
    Tensor y = be_.alloc_uninit(DType::F32, {T, H_});
    Tensor mix = be_.alloc_uninit(DType::F32, {T, H_});
    be_.rms_norm(x, l.in_norm, eps, false, y);
    if (l.kind == LayerKind::Linear)
      kda(model, l.kda, y, spans, mix);
    else
      mla(model, l.mla, y, spans, mix);
    be_.add(x, mix, x);
    be_.rms_norm(x, l.post_norm, eps, false, y);
    if (!l.moe) {
      ffn_forward(be_, y, l.mlp, mix);
    } else {
      sigmoid_moe_forward(be_, y, l.routed, mix);
      if (l.shared.up.defined()) {
        Tensor sh = be_.alloc_uninit(DType::F32, {T, H_});
        ffn_forward(be_, y, l.shared, sh);
        be_.add(mix, sh, mix);
      }
    }
    be_.add(x, mix, x);
  }

 private:
  void kda(Model& model, const Kda& w, const Tensor& y, std::span<const LayerSpan> spans, Tensor& mix) {
    const int64_t T = y.dim(0);
    Tensor qkv = be_.alloc_uninit(DType::F32, {T, 3 * HD_});  // conv input, [q | k | v] per row
    Tensor q = be_.alloc_uninit(DType::F32, {T, HD_}), k = be_.alloc_uninit(DType::F32, {T, HD_}),
           v = be_.alloc_uninit(DType::F32, {T, HD_});
    Tensor fa = be_.alloc_uninit(DType::F32, {T, dk_}), ga = be_.alloc_uninit(DType::F32, {T, dk_});
    Tensor braw = be_.alloc_uninit(DType::F32, {T, Hl_});
    be_.matmul_many(y, {w.q, w.k, w.v, w.f_a, w.g_a, w.b}, {q, k, v, fa, ga, braw});
    be_.set_cols(q, 0, qkv);
    be_.set_cols(k, HD_, qkv);
    be_.set_cols(v, 2 * HD_, qkv);
    Tensor fb = be_.alloc_uninit(DType::F32, {T, HD_}), gate = be_.alloc_uninit(DType::F32, {T, HD_});
    be_.matmul(fa, w.f_b, fb);
    be_.matmul(ga, w.g_b, gate);
    // Gates for all rows: g [T, heads, dk], beta [T, heads].
    Tensor g = be_.alloc_uninit(DType::F32, {T, Hl_, dk_}), beta = be_.alloc_uninit(DType::F32, {T, Hl_});
    be_.kda_gates(fb.reshape({T, Hl_, dk_}), braw, w.A, w.dt_bias, g, beta);
    Tensor conv = be_.alloc_uninit(DType::F32, {T, 3 * HD_});
    Tensor qs = be_.alloc_uninit(DType::F32, {T, Hl_, dk_}), ks = be_.alloc_uninit(DType::F32, {T, Hl_, dk_}),
           vs = be_.alloc_uninit(DType::F32, {T, Hl_, dk_});
    Tensor o = be_.alloc_uninit(DType::F32, {T, HD_});
    Backend::Recurrence kda{linear::Family::KDA, true, 1.0f / std::sqrt(static_cast<float>(dk_))};
    const bool batch = plain_spans(spans);
    if (batch) {  // a batch: one call per op for every sequence's rows
      const SpanRuns cs(spans, &LayerState::conv), ss(spans, &LayerState::ssm);
      be_.causal_conv1d_bias_silu_runs(qkv, w.conv, w.conv_bias, cs.states, cs.rows, conv);
      for (auto [t, col] : {std::pair<Tensor*, int64_t>{&qs, 0}, {&ks, HD_}, {&vs, 2 * HD_}}) {
        Tensor t2 = t->reshape({T, HD_});
        be_.copy_cols(conv, col, t2);
      }
      Tensor o3 = o.reshape({T, Hl_, dk_});
      be_.linear_recurrence_runs(kda, qs, ks, vs, g, beta, Tensor(), ss.states, ss.rows, o3);
    }
    int64_t r0 = 0;
    for (const LayerSpan& sp : batch ? std::span<const LayerSpan>() : spans) {
      const int64_t n = sp.rows, r1 = r0 + n;
      if (sp.record) throw std::logic_error(c_.architecture + ": compact bodies are not supported");
      LayerState& ls = *sp.state;
      Tensor cv = conv.slice_rows(r0, r1), q1 = qs.slice_rows(r0, r1), k1 = ks.slice_rows(r0, r1),
             v1 = vs.slice_rows(r0, r1);
      if (n > 0) {
        be_.causal_conv1d_bias_silu(qkv.slice_rows(r0, r1), w.conv, w.conv_bias, ls.conv, cv);
        for (auto [t, col] : {std::pair<Tensor*, int64_t>{&q1, 0}, {&k1, HD_}, {&v1, 2 * HD_}}) {
          Tensor t2 = t->reshape({n, HD_});
          be_.copy_cols(cv, col, t2);
        }
      }
      Tensor os = o.slice_rows(r0, r1).reshape({n, Hl_, dk_});
      be_.linear_recurrence(kda, q1, k1, v1, g.slice_rows(r0, r1), beta.slice_rows(r0, r1), Tensor(), ls.ssm, os,
                            sp.transition);
      if (sp.after.any()) model.apply_after(ls, sp.after);
      r0 = r1;
    }
    Tensor o2 = o.reshape({T * Hl_, dk_});
    be_.rms_norm(o2, w.o_norm, static_cast<float>(c_.rms_norm_eps), false, o2);
    be_.sigmoid_mul(o, gate, o);
    be_.matmul(o, w.o, mix);
  }

  // kv_b_proj [Hq (P + V), r] as the map from [normed latent r | shared key part R] to the cache's
  // rows [every head's key (P from the latent, then the shared part: identity) | every head's value
  // (V from the latent, then D - V zeros)]: one product gives the keys and values in place, where a
  // gather of column blocks would take two launches a block on a GPU. In the checkpoint's dtype
  // where it is a float type (the identity and zeros are exact in all of them), else f32.
  Tensor mla_kv_weights(const Tensor& kv_b) const {
    const int64_t r = c_.kv_lora_rank, in = r + R_;
    const Tensor src = kv_b.to_f32();
    const float* s = src.data<float>();
    std::vector<float> w(static_cast<size_t>(2 * Hq_ * D_ * in), 0.f);
    for (int64_t h = 0; h < Hq_; ++h) {
      for (int64_t i = 0; i < P_; ++i)  // key row h D + i <- kv_b row h (P + V) + i
        std::copy_n(s + (h * (P_ + V_) + i) * r, r, w.data() + (h * D_ + i) * in);
      for (int64_t i = 0; i < R_; ++i) w[static_cast<size_t>((h * D_ + P_ + i) * in + r + i)] = 1.f;
      for (int64_t i = 0; i < V_; ++i)  // value row Hq D + h D + i <- kv_b row h (P + V) + P + i
        std::copy_n(s + (h * (P_ + V_) + P_ + i) * r, r, w.data() + (Hq_ * D_ + h * D_ + i) * in);
    }
    return typed(w, {2 * Hq_ * D_, in}, kv_b.dtype());
  }
  // o_proj [H, Hq V] as [H, Hq D]: zero columns against the values' padding.
  Tensor mla_o_weights(const Tensor& o) const {
    if (D_ == V_) return o;
    const Tensor src = o.to_f32();
    std::vector<float> w(static_cast<size_t>(H_ * Hq_ * D_), 0.f);
    for (int64_t n = 0; n < H_; ++n)
      for (int64_t h = 0; h < Hq_; ++h)
        std::copy_n(src.data<float>() + n * Hq_ * V_ + h * V_, V_, w.data() + n * Hq_ * D_ + h * D_);
    return typed(w, {H_, Hq_ * D_}, o.dtype());
  }
  static Tensor typed(const std::vector<float>& v, Shape shape, DType like) {
    const DType dt = like == DType::BF16 || like == DType::F16 ? like : DType::F32;
    Tensor t = Tensor::empty(dt, std::move(shape));
    convert_from_f32(v.data(), dt, t.raw(), v.size());
    return t;
  }

  void mla(Model& model, const Mla& w, const Tensor& y, std::span<const LayerSpan> spans, Tensor& mix) {
    const int64_t T = y.dim(0), r = c_.kv_lora_rank;
    Tensor q = be_.alloc_uninit(DType::F32, {T, Hq_, D_});
    Tensor q2 = q.reshape({T, Hq_ * D_});
    Tensor kva = be_.alloc_uninit(DType::F32, {T, r + R_});  // [latent | shared key part]
    if (w.q.defined()) {
      be_.matmul_many(y, {w.q, w.kv_a}, {q2, kva});
    } else {
      Tensor qa = be_.alloc_uninit(DType::F32, {T, c_.q_lora_rank});
      be_.matmul_many(y, {w.q_a, w.kv_a}, {qa, kva});
      be_.rms_norm(qa, w.q_a_norm, 1e-6f, false, qa);
      be_.matmul(qa, w.q_b, q2);
    }
    if (R_ == 0) {
      be_.rms_norm(kva, w.kv_a_norm, 1e-6f, false, kva);
    } else {  // the latent alone is normed
      Tensor latent = be_.alloc_uninit(DType::F32, {T, r});
      be_.copy_cols(kva, 0, latent);
      be_.rms_norm(latent, w.kv_a_norm, 1e-6f, false, latent);
      be_.set_cols(latent, 0, kva);
    }
    // Every head's key and value in the cache's layout from one product (mla_kv_weights).
    Tensor kv = be_.alloc_uninit(DType::F32, {T, 2 * Hq_ * D_});
    be_.matmul(kva, w.kv_b, kv);
    Tensor k = be_.alloc_uninit(DType::F32, {T, Hq_, D_}), v = be_.alloc_uninit(DType::F32, {T, Hq_, D_});
    Tensor k2 = k.reshape({T, Hq_ * D_}), v2 = v.reshape({T, Hq_ * D_});
    be_.copy_cols(kv, 0, k2);
    be_.copy_cols(kv, Hq_ * D_, v2);
    Tensor o = be_.alloc_uninit(DType::F32, {T, Hq_, D_});
    const float scale = 1.0f / std::sqrt(static_cast<float>(P_ + R_));
    attend_spans(model, be_, q, k, v, spans, scale, o);
    be_.matmul(o.reshape({T, Hq_ * D_}), w.o, mix);  // o_proj with zero columns where values are padded
  }

  const ModelConfig& c_;
  Backend& be_;
  int64_t H_, Hl_, dk_, K_, HD_, Hq_, D_, P_, R_, V_;
  std::vector<Layer> layers_;
  size_t expert_bytes_ = 0;
};

}  // namespace

std::unique_ptr<ArchBlocks> kimi_linear_blocks(const ModelConfig& c, const LoadWeight& load, Backend& be) {
  return std::make_unique<KimiLinear>(c, load, be);
}

// This architecture's config.json fields (parse_model_config dispatches here).

namespace config_detail {

// KimiLinearForCausalLM, in transformers 5 names or in the checkpoint's own (linear_attn_config,
// num_experts_per_token, moe_renormalize, num_expert_group, num_shared_experts, model_max_length).
void parse_kimi_linear(const Fields& f, ModelConfig& cfg) {
  cfg.vocab_size = f.positive("vocab_size");
  cfg.hidden_size = f.positive("hidden_size");
  cfg.num_hidden_layers = f.positive("num_hidden_layers");
  if (cfg.num_hidden_layers > kMaxLayers)
    f.bad("num_hidden_layers", "at most " + std::to_string(kMaxLayers) + " layers", f.need("num_hidden_layers"));
  cfg.rms_norm_eps = f.number_or("rms_norm_eps", 1e-5);
  if (!(cfg.rms_norm_eps > 0)) f.bad("rms_norm_eps", "a positive number", f.need("rms_norm_eps"));
  cfg.tie_word_embeddings = f.boolean_or("tie_word_embeddings", false, true);
  cfg.max_position_embeddings = f.positive_or(first_present(f, {"model_max_length", "max_position_embeddings"}), 0);
  cfg.dtype = parse_dtype(f);
  cfg.hidden_act = f.string_or("hidden_act", "silu");
  if (cfg.hidden_act != "silu") f.fail("field 'hidden_act': '" + cfg.hidden_act + "' is not supported (silu only)");
  if (f.boolean_or("attention_bias", false)) f.fail("field 'attention_bias' = true is not supported");
  if (f.boolean_or("mla_use_output_gate", false)) f.fail("field 'mla_use_output_gate' = true is not supported");
  if (f.non_negative_or("attn_res_block_size", 0) != 0)
    f.fail("field 'attn_res_block_size' (AttnRes) is not supported");

  // MLA, NoPE.
  cfg.num_attention_heads = f.positive("num_attention_heads");
  cfg.num_key_value_heads = f.positive_or("num_key_value_heads", cfg.num_attention_heads);
  if (cfg.num_key_value_heads != cfg.num_attention_heads)
    f.fail("field 'num_key_value_heads' (" + std::to_string(cfg.num_key_value_heads) +
           ") must equal 'num_attention_heads' (MLA expands its latent to every head)");
  cfg.qk_nope_head_dim = f.positive("qk_nope_head_dim");
  cfg.qk_rope_head_dim = f.non_negative_or("qk_rope_head_dim", 0);
  cfg.head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim;
  cfg.v_head_dim = f.positive_or("v_head_dim", cfg.qk_nope_head_dim);
  if (cfg.v_head_dim > cfg.head_dim)
    f.fail("field 'v_head_dim' (" + std::to_string(cfg.v_head_dim) +
           ") must not exceed qk_nope_head_dim + qk_rope_head_dim (" + std::to_string(cfg.head_dim) + ")");
  if (f.boolean_or("mla_use_nope", true) == false)
    f.fail("field 'mla_use_nope' = false (MLA with RoPE) is not supported: Kimi-Linear's MLA has none");
  cfg.kv_lora_rank = f.positive("kv_lora_rank");
  cfg.q_lora_rank = f.non_negative_or("q_lora_rank", 0);
  cfg.partial_rotary_factor = 0;

  // KDA: q, k, v of linear_num_heads heads of linear_head_dim, each with its own short conv.
  const json* lac = f.find("linear_attn_config");
  if (lac && !lac->is_object()) f.bad("linear_attn_config", "an object", *lac);
  auto lin = [&](const char* nested, const char* flat, int64_t dflt) {
    if (lac)
      if (const json* v = Fields::field_of(*lac, nested)) {
        if (!v->is_number_integer() || v->get<int64_t>() <= 0)
          f.bad(std::string("linear_attn_config.") + nested, "a positive integer", *v);
        return v->get<int64_t>();
      }
    return f.positive_or(flat, dflt);
  };
  const int64_t heads = lin("num_heads", "linear_num_heads", 32), hd = lin("head_dim", "linear_head_dim", 128);
  cfg.linear_num_key_heads = cfg.linear_num_value_heads = heads;
  cfg.linear_key_head_dim = cfg.linear_value_head_dim = hd;
  cfg.linear_conv_kernel_dim = lin("short_conv_kernel_size", "linear_conv_kernel_dim", 4);

  // Layer kinds: layer_types, else linear_attn_config's 1-based full_attn_layers, else every 4th.
  const int64_t L = cfg.num_hidden_layers;
  if (const json* lt = f.find("layer_types")) {
    if (!lt->is_array() || static_cast<int64_t>(lt->size()) != L)
      f.bad("layer_types", "a list of " + std::to_string(L) + " layer types", *lt);
    for (size_t i = 0; i < lt->size(); ++i) {
      const json& s = (*lt)[i];
      if (s == "linear_attention")
        cfg.layer_types.push_back(LayerKind::Linear);
      else if (s == "full_attention")
        cfg.layer_types.push_back(LayerKind::Attention);
      else
        f.fail("field 'layer_types[" + std::to_string(i) + "]': unknown layer type " + s.dump());
    }
  } else if (lac && Fields::field_of(*lac, "full_attn_layers")) {
    cfg.layer_types.assign(static_cast<size_t>(L), LayerKind::Linear);
    const json& fl = *Fields::field_of(*lac, "full_attn_layers");
    if (!fl.is_array()) f.bad("linear_attn_config.full_attn_layers", "a list of layer numbers", fl);
    for (const json& v : fl) {
      if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > L)
        f.bad("linear_attn_config.full_attn_layers", "layer numbers in [1, " + std::to_string(L) + "]", fl);
      cfg.layer_types[static_cast<size_t>(v.get<int64_t>() - 1)] = LayerKind::Attention;
    }
  } else {
    for (int64_t i = 0; i < L; ++i)
      cfg.layer_types.push_back((i + 1) % 4 == 0 ? LayerKind::Attention : LayerKind::Linear);
  }

  // Feed-forward: dense for the first first_k_dense_replace layers (or per mlp_layer_types), MoE after.
  if (const json* mt = f.find("mlp_layer_types")) {
    if (!mt->is_array() || static_cast<int64_t>(mt->size()) != L)
      f.bad("mlp_layer_types", "a list of " + std::to_string(L) + " of \"dense\" / \"sparse\"", *mt);
    for (const json& s : *mt) {
      if (s != "dense" && s != "sparse") f.bad("mlp_layer_types", "a list of \"dense\" / \"sparse\"", *mt);
      cfg.moe_blocks.push_back(s == "sparse");
    }
  } else {
    const int64_t k = f.non_negative_or("first_k_dense_replace", 1);
    for (int64_t i = 0; i < L; ++i) cfg.moe_blocks.push_back(i >= k);
  }
  cfg.intermediate_size = f.non_negative_or(first_present(f, {"dense_ffn_hidden", "intermediate_size"}), 0);
  const bool any_moe = std::find(cfg.moe_blocks.begin(), cfg.moe_blocks.end(), 1) != cfg.moe_blocks.end();
  const bool any_dense = std::find(cfg.moe_blocks.begin(), cfg.moe_blocks.end(), 0) != cfg.moe_blocks.end();
  if (any_dense && cfg.intermediate_size <= 0) f.fail("field 'intermediate_size' must be a positive integer");
  if (any_moe) {
    parse_grouped_moe(f, cfg, {"num_experts", "num_local_experts"}, {"num_experts_per_token", "num_experts_per_tok"},
                      {"moe_renormalize", "norm_topk_prob"}, {"num_expert_group", "n_group"});
    cfg.shared_expert_intermediate_size =
        cfg.moe_intermediate_size * f.non_negative_or(first_present(f, {"num_shared_experts", "n_shared_experts"}), 1);
  }
  cfg.eos_token_ids = f.token_ids("eos_token_id");
  cfg.bos_token_id = f.token_id("bos_token_id");
  cfg.pad_token_id = f.token_id("pad_token_id");
}

}  // namespace config_detail

// llama.cpp's GGUF files of this architecture (convert_hf_to_gguf.py's KimiLinearModel; gguf_checkpoint.cpp
// dispatches here).

namespace gguf_detail {

// kimi-linear: KDA where attention.head_count_kv is zero, MLA where it is not (the converter writes 1:
// llama.cpp runs MLA as MQA over the latent); KDA heads are attention.head_count heads of
// kda.head_dim (llama.cpp has no key of their own); dense feed-forward in the first
// leading_dense_block_count layers, experts after; routing by sigmoid (expert_gating_func 2), top-k
// renormalised (llama.cpp's kimi-linear always does; no key).
void kimi_linear_gguf_config(const GgufKeys& k, ModelConfig& c) {
  const int64_t L = c.num_hidden_layers;
  const std::vector<int64_t> kv = k.per_layer("attention.head_count_kv", L);
  for (int64_t i = 0; i < L; ++i)
    c.layer_types.push_back(kv[static_cast<size_t>(i)] > 0 ? LayerKind::Attention : LayerKind::Linear);
  c.rms_norm_eps = k.number("attention.layer_norm_rms_epsilon");
  if (!(c.rms_norm_eps > 0)) k.fail(k.key("attention.layer_norm_rms_epsilon") + " must be positive");

  // MLA without RoPE, expanded to every head.
  c.num_attention_heads = c.num_key_value_heads = k.positive("attention.head_count");
  if (const int64_t rot = k.count_or("rope.dimension_count", 0); rot != 0)
    k.fail(k.key("rope.dimension_count") + " is " + std::to_string(rot) +
           ": MLA keys with a shared qk_rope part are read from Hugging Face checkpoints only, not from GGUF yet");
  c.head_dim = k.positive("attention.key_length_mla");
  if (k.positive("attention.value_length_mla") != c.head_dim)
    k.fail(k.key("attention.value_length_mla") + " differs from key_length_mla");
  c.qk_nope_head_dim = c.v_head_dim = c.head_dim;
  c.kv_lora_rank = k.positive("attention.kv_lora_rank");
  c.q_lora_rank = k.count_or("attention.q_lora_rank", 0);
  c.partial_rotary_factor = 0;

  // KDA.
  c.linear_num_key_heads = c.linear_num_value_heads = c.num_attention_heads;
  c.linear_key_head_dim = c.linear_value_head_dim = k.positive("kda.head_dim");
  c.linear_conv_kernel_dim = k.positive("ssm.conv_kernel");

  // Feed-forward: SwiGLU.
  const bool moe = k.count_or("expert_count", 0) > 0;
  const int64_t dense = moe ? k.count_or("leading_dense_block_count", 0) : L;
  for (int64_t i = 0; i < L; ++i) c.moe_blocks.push_back(i >= dense);
  if (dense > 0) c.intermediate_size = k.positive("feed_forward_length");
  if (moe) {
    c.num_experts = k.positive("expert_count");
    c.num_experts_per_tok = k.positive("expert_used_count");
    if (c.num_experts_per_tok > c.num_experts) k.fail(k.key("expert_used_count") + " exceeds expert_count");
    c.moe_intermediate_size = k.positive("expert_feed_forward_length");
    c.shared_expert_intermediate_size = c.moe_intermediate_size * k.count_or("expert_shared_count", 0);
    if (const int64_t g = k.positive("expert_gating_func"); g != 2)
      k.fail(k.key("expert_gating_func") + " is " + std::to_string(g) + ": Kimi-Linear routes by sigmoid (2)");
    c.norm_topk_prob = true;
    c.routed_scaling_factor = k.number_or("expert_weights_scale", 1.0);
    c.n_group = std::max<int64_t>(k.count_or("expert_group_count", 1), 1);
    c.topk_group = c.n_group > 1 ? k.positive("expert_group_used_count") : 1;
    if (c.num_experts % c.n_group != 0 || c.topk_group > c.n_group)
      k.fail(k.key("expert_group_count") + " (" + std::to_string(c.n_group) + ") and expert_group_used_count (" +
             std::to_string(c.topk_group) + ") do not divide the " + std::to_string(c.num_experts) + " experts");
  }
}

// Hugging Face names (transformers 5's, as the model loads them) to the converter's. Its changes:
// A_log stored as -exp(A_log), the short convs as [1, C, 1, K], the experts stacked (w1 gate, w3 up,
// w2 down), and kv_b_proj split per head into k_b (transposed) and v_b.
std::optional<Source> kimi_linear_gguf_source(const ModelConfig&, const std::string& name) {
  using Fix = Source::Fix;
  if (name == "model.embed_tokens.weight") return Source{"token_embd.weight"};
  if (name == "lm_head.weight") return Source{"output.weight"};
  if (name == "model.norm.weight") return Source{"output_norm.weight"};
  const auto layer = gguf_layer_of(name, "model.");
  if (!layer) return std::nullopt;
  const auto& [blk, rest] = *layer;
  static const std::pair<const char*, const char*> kPlain[] = {
      {"input_layernorm.weight", "attn_norm.weight"},
      {"post_attention_layernorm.weight", "ffn_norm.weight"},
      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.o_proj.weight", "attn_output.weight"},
      {"self_attn.q_conv1d.weight", "ssm_conv1d_q.weight"},
      {"self_attn.k_conv1d.weight", "ssm_conv1d_k.weight"},
      {"self_attn.v_conv1d.weight", "ssm_conv1d_v.weight"},
      {"self_attn.f_a_proj.weight", "ssm_f_a.weight"},
      {"self_attn.f_b_proj.weight", "ssm_f_b.weight"},
      {"self_attn.g_a_proj.weight", "ssm_g_a.weight"},
      {"self_attn.g_b_proj.weight", "ssm_g_b.weight"},
      {"self_attn.b_proj.weight", "ssm_beta.weight"},
      {"self_attn.dt_bias", "ssm_dt.bias"},
      {"self_attn.o_norm.weight", "ssm_norm.weight"},
      {"self_attn.q_a_proj.weight", "attn_q_a.weight"},
      {"self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"},
      {"self_attn.q_b_proj.weight", "attn_q_b.weight"},
      {"self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"},
      {"self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"},
      {"block_sparse_moe.gate_proj.weight", "ffn_gate.weight"},
      {"block_sparse_moe.up_proj.weight", "ffn_up.weight"},
      {"block_sparse_moe.down_proj.weight", "ffn_down.weight"},
      {"block_sparse_moe.gate.weight", "ffn_gate_inp.weight"},
      {"block_sparse_moe.gate.e_score_correction_bias", "exp_probs_b.bias"},
      {"block_sparse_moe.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"},
      {"block_sparse_moe.shared_experts.up_proj.weight", "ffn_up_shexp.weight"},
      {"block_sparse_moe.shared_experts.down_proj.weight", "ffn_down_shexp.weight"},
  };
  for (auto [hf, gg] : kPlain)
    if (rest == hf) return Source{blk + gg};
  if (rest == "self_attn.A_log") return Source{blk + "ssm_a", -1, Fix::LogNeg};
  if (rest == "self_attn.kv_b_proj.weight") {
    Source s{blk + "attn_k_b.weight", -1, Fix::MlaKvB};
    s.second = blk + "attn_v_b.weight";
    return s;
  }
  // block_sparse_moe.experts.E.w{1,2,3}.weight: expert E of the layer's stacked tensor.
  if (const auto e = gguf_expert_of(rest, "block_sparse_moe.experts.")) {
    const char* t = e->second == "w1.weight"   ? "ffn_gate_exps.weight"
                    : e->second == "w3.weight" ? "ffn_up_exps.weight"
                    : e->second == "w2.weight" ? "ffn_down_exps.weight"
                                               : nullptr;
    if (!t) return std::nullopt;
    return Source{blk + t, e->first};
  }
  return std::nullopt;
}

}  // namespace gguf_detail

}  // namespace hypic
