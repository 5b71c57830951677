// NemotronHForCausalLM (transformers 5.17 modeling_nemotron_h.py): blocks of one sub-layer each, x +=
// mixer(RMSNorm(x)), the mixer being
//   Mamba2     in_proj -> [z | xBC | dt]; causal conv1d (with bias) + SiLU over xBC -> [x | B | C];
//              dt = max(softplus(dt + dt_bias), time_step_min); the SSM S_t = exp(dt A) S_{t-1} +
//              B_t (dt x_t)^T, y_t = S_t^T C_t + D x_t (linear::Family::Mamba2 with k = B, q = C,
//              v = dt x, g = dt A); y * silu(z), RMSNorm per group of I / n_groups channels; out_proj
//   attention  plain GQA softmax attention, no RoPE, no gate, no q/k norms
//   MLP        down(relu(up(x))^2)
//   MoE        sigmoid router scores, choice by score + e_score_correction_bias within the best
//              topk_group groups (a group scored by its two best), weights = the chosen scores
//              normalised and times routed_scaling_factor; ReLU^2 experts; plus a shared ReLU^2 MLP.
// RMSNorm weights multiply directly (no 1 + w). Every piece is a backend op (CPU and CUDA); the MoE
// routing alone is computed on the host (models/host_layers.h).
#include <algorithm>
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

struct Mamba {
  Tensor in_proj, out_proj;  // [I + Cd + nh, H], [H, I]
  Tensor conv_w, conv_b;     // f32 [Cd, K], [Cd]
  Tensor A, D, dt_bias;      // f32 [nh]; A = -exp(A_log)
  Tensor norm;               // f32 [I]
};
struct Attn {
  Tensor q, k, v, o;
};
struct Moe {
  SigmoidMoe routed;
  FfnWeights shared;
  bool has_shared = false;
};
struct Block {
  LayerKind kind;
  bool moe = false;
  Tensor norm;  // device [H]
  Mamba mamba;
  Attn attn;
  FfnWeights mlp;
  Moe moew;
};

class NemotronH : public ArchBlocks {
 public:
  NemotronH(const ModelConfig& c, const LoadWeight& load, Backend& be) : c_(c), be_(be) {
    H_ = c.hidden_size;
    nh_ = c.linear_num_value_heads;
    P_ = c.linear_value_head_dim;
    N_ = c.linear_key_head_dim;
    G_ = c.linear_num_key_heads;
    K_ = c.linear_conv_kernel_dim;
    I_ = nh_ * P_;
    Cd_ = I_ + 2 * G_ * N_;
    auto dev = [&](const std::string& n, const Shape& s) { return be.to_device(load(n, s)); };
    auto mlp = [&](const std::string& p, int64_t I) {
      return FfnWeights{Tensor(), dev(p + "up_proj.weight", {I, H_}), dev(p + "down_proj.weight", {H_, I})};
    };
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const std::string p = "backbone.layers." + std::to_string(i) + ".";
      const std::string m = p + "mixer.";
      Block b;
      b.kind = c.layer_types[static_cast<size_t>(i)];
      b.moe = c.layer_is_moe(i);
      b.norm = dev(p + "norm.weight", {H_});
      if (b.kind == LayerKind::Linear) {
        auto& w = b.mamba;
        w.in_proj = dev(m + "in_proj.weight", {I_ + Cd_ + nh_, H_});
        w.out_proj = dev(m + "out_proj.weight", {H_, I_});
        // The small per-channel weights in f32 on the device (the ops take them so).
        auto f32 = [&](const std::string& n, const Shape& s) { return be.to_device(load(n, s).to_f32()); };
        w.conv_w = f32(m + "conv1d.weight", {Cd_, 1, K_}).reshape({Cd_, K_});
        w.conv_b = c.conv_bias ? f32(m + "conv1d.bias", {Cd_}) : be.alloc(DType::F32, {Cd_});
        std::vector<float> A = host_f32(load(m + "A_log", {nh_}));
        for (float& a : A) a = -std::exp(a);
        w.A = be.to_device(host_tensor(A, {nh_}));
        w.D = f32(m + "D", {nh_});
        w.dt_bias = f32(m + "dt_bias", {nh_});
        w.norm = f32(m + "norm.weight", {I_});
      } else if (b.kind == LayerKind::Attention) {
        const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
        b.attn = Attn{dev(m + "q_proj.weight", {q, H_}), dev(m + "k_proj.weight", {kv, H_}),
                      dev(m + "v_proj.weight", {kv, H_}), dev(m + "o_proj.weight", {H_, q})};
      } else if (!b.moe) {
        b.mlp = mlp(m, c.intermediate_size);
      } else {
        auto& mo = b.moew;
        const int64_t E = c.num_experts, I = c.moe_intermediate_size;
        mo.routed.router = dev(m + "gate.weight", {E, H_});
        mo.routed.routing = sigmoid_router(c, be.to_device(load(m + "gate.e_score_correction_bias", {E}).to_f32()));
        for (int64_t e = 0; e < E; ++e) {
          const FfnWeights ex = mlp(m + "experts." + std::to_string(e) + ".", I);
          mo.routed.add_expert(ex);
          expert_bytes_ += ex.up.nbytes() + ex.down.nbytes();
        }
        if (c.shared_expert_intermediate_size > 0) {
          mo.has_shared = true;
          mo.shared = mlp(m + "shared_experts.", c.shared_expert_intermediate_size);
        }
      }
      blocks_.push_back(std::move(b));
    }
  }

  size_t expert_bytes() const override { return expert_bytes_; }

  bool scalar_transition() const override { return true; }

  void replay(const RecurrenceInputs& in, Tensor& ssm) override {
    if (in.rows() == 0) return;
    // The keys stand in for the queries: the outputs are dropped.
    Tensor out = be_.alloc_uninit(DType::F32, {in.rows(), nh_, P_});
    be_.linear_recurrence({linear::Family::Mamba2}, in.k, in.k, in.v, in.g, Tensor(), Tensor(), ssm, out);
  }

  void layer_forward(Model& model, int64_t layer, Tensor& x, std::span<const LayerSpan> spans) override {
    Block& b = blocks_[static_cast<size_t>(layer)];
    const int64_t T = x.dim(0);
    Tensor xn = be_.alloc_uninit(DType::F32, {T, H_});
    Tensor mix = be_.alloc_uninit(DType::F32, {T, H_});
    be_.rms_norm(x, b.norm, static_cast<float>(c_.rms_norm_eps), false, xn);
    if (b.kind == LayerKind::Linear)
      mamba(model, b.mamba, xn, spans, mix);
    else if (b.kind == LayerKind::Attention)
      attention(model, b.attn, xn, spans, mix);
    else if (!b.moe)
      ffn_forward(be_, xn, b.mlp, mix);
    else
      moe(b.moew, xn, mix);
    be_.add(x, mix, x);
  }

 private:
  void mamba(Model& model, const Mamba& w, const Tensor& xn, std::span<const LayerSpan> spans, Tensor& mix) {
    const int64_t T = xn.dim(0), W = I_ + Cd_ + nh_, GN = G_ * N_;
    Tensor proj = be_.alloc_uninit(DType::F32, {T, W});
    be_.matmul(xn, w.in_proj, proj);
    // proj's columns: [z I | xBC Cd | dt nh]; the conv's: [x I | B GN | C GN].
    Tensor z = be_.alloc_uninit(DType::F32, {T, I_}), xbc_in = be_.alloc_uninit(DType::F32, {T, Cd_});
    Tensor dt = be_.alloc_uninit(DType::F32, {T, nh_}), xbc = be_.alloc_uninit(DType::F32, {T, Cd_});
    be_.copy_cols(proj, 0, z);
    be_.copy_cols(proj, I_, xbc_in);
    be_.copy_cols(proj, I_ + Cd_, dt);
    Tensor x = be_.alloc_uninit(DType::F32, {T, nh_, P_}), B = be_.alloc_uninit(DType::F32, {T, G_, N_});
    Tensor C = be_.alloc_uninit(DType::F32, {T, G_, N_}), g = be_.alloc_uninit(DType::F32, {T, nh_});
    Tensor v = be_.alloc_uninit(DType::F32, {T, nh_, P_}), y = be_.alloc_uninit(DType::F32, {T, nh_, P_});
    const float tmin = static_cast<float>(c_.time_step_min);
    const bool batch = plain_spans(spans);
    if (batch) {  // a batch: one call per op for every sequence's rows
      const SpanRuns conv(spans, &LayerState::conv), ssm(spans, &LayerState::ssm);
      be_.causal_conv1d_bias_silu_runs(xbc_in, w.conv_w, w.conv_b, conv.states, conv.rows, xbc);
      Tensor x2 = x.reshape({T, I_}), B2 = B.reshape({T, GN}), C2 = C.reshape({T, GN});
      be_.copy_cols(xbc, 0, x2);
      be_.copy_cols(xbc, I_, B2);
      be_.copy_cols(xbc, I_ + GN, C2);
      be_.mamba2_gates(dt, x, w.A, w.dt_bias, tmin, g, v);
      be_.linear_recurrence_runs({linear::Family::Mamba2}, C, B, v, g, Tensor(), Tensor(), ssm.states, ssm.rows, y);
    }
    int64_t r0 = 0;
    for (const LayerSpan& sp : batch ? std::span<const LayerSpan>() : spans) {
      LayerState& ls = *sp.state;
      const int64_t n = sp.rows, r1 = r0 + n;
      Tensor xs = x.slice_rows(r0, r1), Bs = B.slice_rows(r0, r1), Cs = C.slice_rows(r0, r1);
      Tensor gs = g.slice_rows(r0, r1), vs = v.slice_rows(r0, r1), ys = y.slice_rows(r0, r1);
      if (n > 0) {
        // Causal depthwise conv with bias + SiLU over the xBC columns, then the SSM as a
        // scalar-decay linear recurrence (k = B, q = C, v = dt x, g = dt A).
        Tensor cv = xbc.slice_rows(r0, r1), x2 = xs.reshape({n, I_}), B2 = Bs.reshape({n, GN}),
               C2 = Cs.reshape({n, GN});
        be_.causal_conv1d_bias_silu(xbc_in.slice_rows(r0, r1), w.conv_w, w.conv_b, ls.conv, cv);
        be_.copy_cols(cv, 0, x2);
        be_.copy_cols(cv, I_, B2);
        be_.copy_cols(cv, I_ + GN, C2);
        be_.mamba2_gates(dt.slice_rows(r0, r1), xs, w.A, w.dt_bias, tmin, gs, vs);
      }
      // T_C = exp(sum of g) per head: a scaled identity [nh, 1, 1] (or dense [nh, N, N]).
      be_.linear_recurrence({linear::Family::Mamba2}, Cs, Bs, vs, gs, Tensor(), Tensor(), ls.ssm, ys, sp.transition);
      if (sp.record && n > 0) {  // a compact PIC body: k = B, v = dt x, g = dt A (beta unused: zeros)
        RecurrenceInputs& rec = *sp.record;
        rec.k = be_.alloc_uninit(DType::F32, {n, G_, N_});
        rec.v = be_.alloc_uninit(DType::F32, {n, nh_, P_});
        rec.g = be_.alloc_uninit(DType::F32, {n, nh_});
        rec.beta = be_.alloc(DType::F32, {n, nh_});
        be_.copy(Bs, rec.k);
        be_.copy(vs, rec.v);
        be_.copy(gs, rec.g);
      }
      if (sp.after.any()) model.apply_after(ls, sp.after);
      r0 = r1;
    }
    // D skip, gate, grouped RMSNorm, out_proj.
    Tensor yn = be_.alloc_uninit(DType::F32, {T, I_});
    be_.mamba2_gated_norm(y.reshape({T, I_}), x.reshape({T, I_}), z, w.D, w.norm, G_,
                          static_cast<float>(c_.rms_norm_eps), yn);
    be_.matmul(yn, w.out_proj, mix);
  }

  void attention(Model& model, const Attn& w, const Tensor& xn, std::span<const LayerSpan> spans, Tensor& mix) {
    const int64_t T = xn.dim(0), Hq = c_.num_attention_heads, Hkv = c_.num_key_value_heads, D = c_.head_dim;
    Tensor q = be_.alloc_uninit(DType::F32, {T, Hq, D});
    Tensor k = be_.alloc_uninit(DType::F32, {T, Hkv, D});
    Tensor v = be_.alloc_uninit(DType::F32, {T, Hkv, D});
    Tensor q2 = q.reshape({T, Hq * D}), k2 = k.reshape({T, Hkv * D}), v2 = v.reshape({T, Hkv * D});
    be_.matmul_many(xn, {w.q, w.k, w.v}, {q2, k2, v2});
    Tensor o = be_.alloc_uninit(DType::F32, {T, Hq, D});
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    attend_spans(model, be_, q, k, v, spans, scale, o);
    be_.matmul(o.reshape({T, Hq * D}), w.o, mix);
  }

  void moe(const Moe& w, const Tensor& xn, Tensor& out) {
    const int64_t T = xn.dim(0);
    sigmoid_moe_forward(be_, xn, w.routed, out);
    if (w.has_shared) {
      Tensor sh = be_.alloc_uninit(DType::F32, {T, H_});
      ffn_forward(be_, xn, w.shared, sh);
      be_.add(out, sh, out);
    }
  }

  const ModelConfig& c_;
  Backend& be_;
  int64_t H_, nh_, P_, N_, G_, K_, I_, Cd_;
  std::vector<Block> blocks_;
  size_t expert_bytes_ = 0;
};

}  // namespace

std::unique_ptr<ArchBlocks> nemotron_h_blocks(const ModelConfig& c, const LoadWeight& load, Backend& be) {
  return std::make_unique<NemotronH>(c, load, be);
}

// This architecture's config.json fields (parse_model_config dispatches here).

namespace config_detail {

// NemotronHForCausalLM: blocks of one sub-layer each, named by layers_block_type (transformers 5:
// linear_attention / full_attention / mlp / moe; older configs: mamba / attention / mlp / moe) or by
// hybrid_override_pattern (M * - E).
void parse_nemotron_h(const Fields& f, ModelConfig& cfg) {
  cfg.vocab_size = f.positive("vocab_size");
  cfg.hidden_size = f.positive("hidden_size");
  auto add_block = [&](const std::string& t, const std::string& where) {
    if (t == "linear_attention" || t == "mamba" || t == "M") {
      cfg.layer_types.push_back(LayerKind::Linear);
      cfg.moe_blocks.push_back(0);
    } else if (t == "full_attention" || t == "attention" || t == "*") {
      cfg.layer_types.push_back(LayerKind::Attention);
      cfg.moe_blocks.push_back(0);
    } else if (t == "mlp" || t == "-" || t == "moe" || t == "E") {
      cfg.layer_types.push_back(LayerKind::Ffn);
      cfg.moe_blocks.push_back(t == "moe" || t == "E");
    } else {
      f.fail(where + ": unknown block type '" + t + "' (expected linear_attention, full_attention, mlp or moe)");
    }
  };
  if (const json* lt = f.find("layers_block_type")) {
    if (!lt->is_array()) f.bad("layers_block_type", "a list of strings", *lt);
    for (size_t i = 0; i < lt->size(); ++i) {
      if (!(*lt)[i].is_string()) f.bad("layers_block_type", "a list of strings", *lt);
      add_block((*lt)[i].get<std::string>(), "field 'layers_block_type[" + std::to_string(i) + "]'");
      if (static_cast<int64_t>(cfg.layer_types.size()) > kMaxLayers)
        f.bad("layers_block_type", "at most " + std::to_string(kMaxLayers) + " blocks", *lt);
    }
  } else if (const json* pat = f.find("hybrid_override_pattern")) {
    if (!pat->is_string()) f.bad("hybrid_override_pattern", "a string", *pat);
    const std::string s = pat->get<std::string>();
    if (static_cast<int64_t>(s.size()) > kMaxLayers)
      f.bad("hybrid_override_pattern", "at most " + std::to_string(kMaxLayers) + " blocks", *pat);
    for (size_t i = 0; i < s.size(); ++i)
      add_block(std::string(1, s[i]), "field 'hybrid_override_pattern' character " + std::to_string(i));
  } else {
    f.fail("missing field 'layers_block_type' (or 'hybrid_override_pattern')");
  }
  if (cfg.layer_types.empty()) f.fail("field 'layers_block_type' lists no blocks");
  cfg.num_hidden_layers = static_cast<int64_t>(cfg.layer_types.size());
  if (f.find("num_hidden_layers") && f.positive("num_hidden_layers") != cfg.num_hidden_layers)
    f.fail("field 'num_hidden_layers' (" + std::to_string(f.positive("num_hidden_layers")) + ") disagrees with the " +
           std::to_string(cfg.num_hidden_layers) + " blocks of 'layers_block_type'");
  cfg.rms_norm_eps = f.number_or("layer_norm_epsilon", 1e-5);
  if (!(cfg.rms_norm_eps > 0)) f.bad("layer_norm_epsilon", "a positive number", f.need("layer_norm_epsilon"));
  cfg.tie_word_embeddings = f.boolean_or("tie_word_embeddings", false, true);
  cfg.max_position_embeddings = f.positive_or("max_position_embeddings", 0);
  cfg.dtype = parse_dtype(f);
  for (const char* b : {"use_bias", "mlp_bias", "attention_bias"})
    if (f.boolean_or(b, false)) f.fail("field '" + std::string(b) + "' = true is not supported");
  if (f.find("moe_latent_size")) f.fail("field 'moe_latent_size' (latent expert projections) is not supported");

  cfg.num_attention_heads = f.positive("num_attention_heads");
  cfg.num_key_value_heads = f.positive_or("num_key_value_heads", cfg.num_attention_heads);
  if (cfg.num_attention_heads % cfg.num_key_value_heads != 0)
    f.fail("field 'num_attention_heads' (" + std::to_string(cfg.num_attention_heads) +
           ") must be a multiple of 'num_key_value_heads' (" + std::to_string(cfg.num_key_value_heads) + ")");
  cfg.head_dim = f.find("head_dim") ? f.positive("head_dim") : cfg.hidden_size / cfg.num_attention_heads;
  if (cfg.head_dim <= 0) f.fail("no 'head_dim' and 'hidden_size' is smaller than 'num_attention_heads'");
  cfg.partial_rotary_factor = 0;  // attention without RoPE

  cfg.mlp_act = f.string_or("mlp_hidden_act", "relu2");
  if (cfg.mlp_act != "relu2") f.fail("field 'mlp_hidden_act': '" + cfg.mlp_act + "' is not supported (relu2 only)");
  if (const std::string act = f.string_or("mamba_hidden_act", "silu"); act != "silu")
    f.fail("field 'mamba_hidden_act': '" + act + "' is not supported (silu only)");
  cfg.intermediate_size = f.non_negative_or("intermediate_size", 0);
  cfg.linear_num_value_heads = f.positive("mamba_num_heads");
  cfg.linear_value_head_dim = f.positive("mamba_head_dim");
  cfg.linear_key_head_dim = f.positive(first_present(f, {"ssm_state_size", "mamba_d_state"}));
  cfg.linear_num_key_heads = f.positive(first_present(f, {"n_groups", "mamba_n_groups"}));
  cfg.linear_conv_kernel_dim = f.positive(first_present(f, {"conv_kernel", "mamba_d_conv"}));
  cfg.conv_bias = f.boolean_or(first_present(f, {"use_conv_bias", "mamba_conv_bias"}), true);
  cfg.time_step_min = f.number_or(first_present(f, {"time_step_min", "mamba_dt_min"}), 0.001);
  if (cfg.linear_num_value_heads % cfg.linear_num_key_heads != 0)
    f.fail("field 'mamba_num_heads' (" + std::to_string(cfg.linear_num_value_heads) +
           ") must be a multiple of 'n_groups' (" + std::to_string(cfg.linear_num_key_heads) + ")");

  const bool any_moe = std::find(cfg.moe_blocks.begin(), cfg.moe_blocks.end(), 1) != cfg.moe_blocks.end();
  if (any_moe) {
    parse_grouped_moe(f, cfg, {"n_routed_experts"}, {"num_experts_per_tok"}, {"norm_topk_prob"}, {"n_group"});
    cfg.shared_expert_intermediate_size =
        f.non_negative_or("n_shared_experts", 1) > 0 ? f.non_negative_or("moe_shared_expert_intermediate_size", 0) : 0;
  }
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i)
    if (cfg.layer_types[static_cast<size_t>(i)] == LayerKind::Ffn && !cfg.moe_blocks[static_cast<size_t>(i)] &&
        cfg.intermediate_size <= 0)
      f.fail("field 'intermediate_size' must be a positive integer (block " + std::to_string(i) + " is an MLP)");
  cfg.eos_token_ids = f.token_ids("eos_token_id");
  cfg.bos_token_id = f.token_id("bos_token_id");
  cfg.pad_token_id = f.token_id("pad_token_id");
}

}  // namespace config_detail

// llama.cpp's GGUF files of this architecture (convert_hf_to_gguf.py's NemotronHModel; gguf_checkpoint.cpp
// dispatches here).

namespace gguf_detail {

// nemotron_h / nemotron_h_moe: a block's kind is in two per-layer arrays, as llama.cpp reads them:
// attention where head_count_kv is non-zero, a feed-forward block where feed_forward_length is,
// Mamba2 where both are zero. With expert_count every feed-forward block is an MoE (llama.cpp's
// loader has no MLP blocks beside experts), feed_forward_length then giving the experts' width.
void nemotron_h_gguf_config(const GgufKeys& k, ModelConfig& c) {
  const int64_t L = c.num_hidden_layers;
  const std::vector<int64_t> kv = k.per_layer("attention.head_count_kv", L), ff = k.per_layer("feed_forward_length", L);
  const bool moe = k.count_or("expert_count", 0) > 0;
  for (int64_t i = 0; i < L; ++i) {
    const size_t u = static_cast<size_t>(i);
    if (kv[u] > 0 && ff[u] > 0)
      k.fail("layer " + std::to_string(i) + " has both " + k.key("attention.head_count_kv") + " and " +
             k.key("feed_forward_length") + ": a Nemotron-H block is one sub-layer");
    c.layer_types.push_back(kv[u] > 0 ? LayerKind::Attention : ff[u] > 0 ? LayerKind::Ffn : LayerKind::Linear);
    c.moe_blocks.push_back(ff[u] > 0 && moe);
  }
  c.rms_norm_eps = k.has("attention.layer_norm_rms_epsilon") ? k.number("attention.layer_norm_rms_epsilon")
                                                             : k.number("attention.layer_norm_epsilon");
  if (!(c.rms_norm_eps > 0)) k.fail(k.key("attention.layer_norm_epsilon") + " must be positive");

  // Attention: GQA without RoPE (the file's rope keys describe nothing that runs).
  c.num_key_value_heads = k.shared_nonzero("attention.head_count_kv", kv);
  if (c.num_key_value_heads == 0) {  // no attention block: nothing reads the sizes
    c.num_attention_heads = c.num_key_value_heads = 1;
    c.head_dim = k.count_or("attention.key_length", 1);
  } else {
    std::vector<int64_t> heads = k.per_layer("attention.head_count", L);
    for (int64_t i = 0; i < L; ++i)
      if (kv[static_cast<size_t>(i)] == 0) heads[static_cast<size_t>(i)] = 0;
    c.num_attention_heads = k.shared_nonzero("attention.head_count", heads);
    if (c.num_attention_heads == 0 || c.num_attention_heads % c.num_key_value_heads != 0)
      k.fail(k.key("attention.head_count") + " (" + std::to_string(c.num_attention_heads) +
             ") is not a multiple of head_count_kv (" + std::to_string(c.num_key_value_heads) + ")");
    c.head_dim = k.positive("attention.key_length");
    if (k.has("attention.value_length") && k.positive("attention.value_length") != c.head_dim)
      k.fail(k.key("attention.value_length") + " differs from key_length");
  }
  c.partial_rotary_factor = 0;

  // Mamba2: value heads = time_step_rank, of inner_size / time_step_rank; B and C of state_size per
  // group. The dt floor (transformers' time_step_min) is not in the file: its default, which the
  // checkpoints keep (llama.cpp applies none).
  c.linear_num_value_heads = k.positive("ssm.time_step_rank");
  const int64_t inner = k.positive("ssm.inner_size");
  if (inner % c.linear_num_value_heads != 0)
    k.fail(k.key("ssm.inner_size") + " is not a multiple of ssm.time_step_rank");
  c.linear_value_head_dim = inner / c.linear_num_value_heads;
  c.linear_key_head_dim = k.positive("ssm.state_size");
  c.linear_num_key_heads = k.positive("ssm.group_count");
  if (c.linear_num_value_heads % c.linear_num_key_heads != 0)
    k.fail(k.key("ssm.time_step_rank") + " is not a multiple of ssm.group_count");
  c.linear_conv_kernel_dim = k.positive("ssm.conv_kernel");
  c.time_step_min = 0.001;
  for (int64_t i = 0; i < L; ++i)
    if (c.layer_types[static_cast<size_t>(i)] == LayerKind::Linear) {  // llama.cpp: the bias is optional
      c.conv_bias = k.file().find("blk." + std::to_string(i) + ".ssm_conv1d.bias") != nullptr;
      break;
    }

  // Feed-forward: ReLU^2, up/down only.
  c.mlp_act = "relu2";
  const int64_t width = k.shared_nonzero("feed_forward_length", ff);
  if (moe) {
    c.num_experts = k.positive("expert_count");
    c.num_experts_per_tok = k.positive("expert_used_count");
    if (c.num_experts_per_tok > c.num_experts) k.fail(k.key("expert_used_count") + " exceeds expert_count");
    c.moe_intermediate_size = k.positive("expert_feed_forward_length");
    if (width != 0 && width != c.moe_intermediate_size)
      k.fail(k.key("feed_forward_length") + " (" + std::to_string(width) + ") differs from expert_feed_forward_length");
    if (k.count_or("moe_latent_size", 0) > 0) k.fail(k.key("moe_latent_size") + ": latent experts are not supported");
    c.shared_expert_intermediate_size =
        k.count_or("expert_shared_count", 1) > 0 ? k.positive("expert_shared_feed_forward_length") : 0;
    c.norm_topk_prob = k.flag_or("expert_weights_norm", false);
    c.routed_scaling_factor = k.number_or("expert_weights_scale", 1.0);
    c.n_group = std::max<int64_t>(k.count_or("expert_group_count", 1), 1);
    c.topk_group = c.n_group > 1 ? k.positive("expert_group_used_count") : 1;
    if (c.num_experts % c.n_group != 0 || c.topk_group > c.n_group)
      k.fail(k.key("expert_group_count") + " (" + std::to_string(c.n_group) + ") and expert_group_used_count (" +
             std::to_string(c.topk_group) + ") do not divide the " + std::to_string(c.num_experts) + " experts");
  } else {
    c.intermediate_size = width;
  }
}

// Hugging Face names (backbone.*) to the converter's. Its changes: A_log stored as -exp(A_log) [nh, 1],
// D as [nh, 1], conv1d [C, K], the grouped norm as [groups, I / groups], the experts stacked, and q / k
// rows permuted per head as for RoPE (LlamaModel.permute, which the converter applies to every
// attention layer though Nemotron-H has no RoPE).
std::optional<Source> nemotron_h_gguf_source(const ModelConfig& c, const std::string& name) {
  using Fix = Source::Fix;
  if (name == "backbone.embeddings.weight") return Source{"token_embd.weight"};
  if (name == "lm_head.weight") return Source{"output.weight"};
  if (name == "backbone.norm_f.weight") return Source{"output_norm.weight"};
  const auto layer = gguf_layer_of(name, "backbone.");
  if (!layer) return std::nullopt;
  const auto& [blk, rest] = *layer;
  if (rest == "norm.weight") return Source{blk + "attn_norm.weight"};
  if (rest.rfind("mixer.", 0) != 0) return std::nullopt;
  const std::string m = rest.substr(6);
  static const std::pair<const char*, const char*> kPlain[] = {
      {"in_proj.weight", "ssm_in.weight"},
      {"out_proj.weight", "ssm_out.weight"},
      {"conv1d.weight", "ssm_conv1d.weight"},
      {"conv1d.bias", "ssm_conv1d.bias"},
      {"dt_bias", "ssm_dt.bias"},
      {"v_proj.weight", "attn_v.weight"},
      {"o_proj.weight", "attn_output.weight"},
      {"up_proj.weight", "ffn_up.weight"},
      {"down_proj.weight", "ffn_down.weight"},
      {"gate.weight", "ffn_gate_inp.weight"},
      {"gate.e_score_correction_bias", "exp_probs_b.bias"},
      {"shared_experts.up_proj.weight", "ffn_up_shexp.weight"},
      {"shared_experts.down_proj.weight", "ffn_down_shexp.weight"},
  };
  for (auto [hf, gg] : kPlain)
    if (m == hf) return Source{blk + gg};
  if (m == "A_log" || m == "D") {
    Source s{blk + (m == "D" ? "ssm_d" : "ssm_a"), -1, m == "D" ? Fix::None : Fix::LogNeg};
    s.stored = {c.linear_num_value_heads, 1};
    return s;
  }
  if (m == "norm.weight") {
    Source s{blk + "ssm_norm.weight"};
    s.reshape = true;
    const int64_t groups = c.linear_num_key_heads;
    s.stored = {groups, c.linear_num_value_heads * c.linear_value_head_dim / std::max<int64_t>(groups, 1)};
    return s;
  }
  if (m == "q_proj.weight" || m == "k_proj.weight") {
    Source s{blk + (m[0] == 'q' ? "attn_q.weight" : "attn_k.weight"), -1, Fix::RopeRows};
    s.hd = c.head_dim;
    return s;
  }
  // experts.E.{up,down}_proj.weight: expert E of the layer's stacked tensor.
  if (const auto e = gguf_expert_of(m, "experts.")) {
    const char* t = e->second == "up_proj.weight"     ? "ffn_up_exps.weight"
                    : e->second == "down_proj.weight" ? "ffn_down_exps.weight"
                                                      : nullptr;
    if (!t) return std::nullopt;
    return Source{blk + t, e->first};
  }
  return std::nullopt;
}

// The inverse of nemotron_h_gguf_config, keyed and typed as convert_hf_to_gguf.py's NemotronHModel
// writes them (its per-layer arrays, the unused RoPE keys llama.cpp's loader expects). The context
// length is the config's (the converter writes 2^20 for every Mamba2 model).
void nemotron_h_gguf_write_config(const ModelConfig& c, GgufKeyWriter& k) {
  const int64_t L = c.num_hidden_layers;
  if (c.mlp_act != "relu2") k.fail("feed-forward activation " + c.mlp_act + ": llama.cpp's nemotron_h runs relu2");
  // No key holds the dt floor: a file is read with the default every released checkpoint keeps.
  if (std::abs(c.time_step_min - 0.001) > 1e-12)
    k.fail("time_step_min " + std::to_string(c.time_step_min) +
           ": the GGUF format has no key for Mamba2's dt floor, which is read back as 0.001");
  const bool moe = c.num_experts > 0;
  std::vector<int64_t> kv, ff;
  for (int64_t i = 0; i < L; ++i) {
    const size_t u = static_cast<size_t>(i);
    const LayerKind t = c.layer_types.at(u);
    const bool expert = u < c.moe_blocks.size() && c.moe_blocks[u];
    if (t == LayerKind::Ffn && expert != moe)
      k.fail("layer " + std::to_string(i) + std::string(" is ") + (expert ? "an MoE" : "an MLP") +
             " block: llama.cpp's nemotron_h has MLP blocks only and nemotron_h_moe MoE blocks only");
    kv.push_back(t == LayerKind::Attention ? c.num_key_value_heads : 0);
    ff.push_back(t == LayerKind::Ffn ? (moe ? c.moe_intermediate_size : c.intermediate_size) : 0);
  }
  k.i32s("feed_forward_length", ff);
  k.u32("attention.head_count", c.num_attention_heads);
  k.i32s("attention.head_count_kv", kv);
  k.f32("attention.layer_norm_epsilon", c.rms_norm_eps);
  if (moe) {
    k.u32("expert_count", c.num_experts);
    k.u32("expert_used_count", c.num_experts_per_tok);
    k.u32("expert_group_count", c.n_group);
    k.u32("expert_group_used_count", c.topk_group);
    k.u32("expert_feed_forward_length", c.moe_intermediate_size);
    if (c.shared_expert_intermediate_size > 0)
      k.u32("expert_shared_feed_forward_length", c.shared_expert_intermediate_size);
    k.u32("expert_shared_count", c.shared_expert_intermediate_size > 0 ? 1 : 0);
    k.flag("expert_weights_norm", c.norm_topk_prob);
    k.f32("expert_weights_scale", c.routed_scaling_factor);
  }
  k.u32("vocab_size", c.vocab_size);
  k.u32("rope.dimension_count", c.head_dim);
  k.flag("rope.scaling.finetuned", false);
  k.u32("ssm.conv_kernel", c.linear_conv_kernel_dim);
  k.u32("ssm.state_size", c.linear_key_head_dim);
  k.u32("ssm.group_count", c.linear_num_key_heads);
  k.u32("ssm.inner_size", c.linear_num_value_heads * c.linear_value_head_dim);
  k.u32("ssm.time_step_rank", c.linear_num_value_heads);
  k.u32("attention.key_length", c.head_dim);
  k.u32("attention.value_length", c.head_dim);
}

}  // namespace gguf_detail

}  // namespace hypic
