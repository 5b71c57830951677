// Model hyper-parameters, parsed from a Hugging Face config.json (top level, or the nested
// `text_config` of ...ForConditionalGeneration checkpoints).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "models/architectures.h"
#include "tensor/dtype.h"

namespace hypic {

// A layer's token mixer: linear attention or a state space (config "linear_attention": Gated
// DeltaNet, Mamba2, lightning, KDA), softmax attention (config "full_attention"; "full" alone names
// the prefill mode that recomputes everything), or none (Nemotron-H's MLP and MoE blocks: one
// sub-layer per block there, so its feed-forward blocks hold no state).
enum class LayerKind { Linear, Attention, Ffn };

// One character per layer in `hypic info` and bench layer maps: L linear, A attention, - no mixer.
inline char layer_map_char(LayerKind k) {
  return k == LayerKind::Linear ? 'L' : k == LayerKind::Attention ? 'A' : '-';
}

// The most decoder layers a config may declare: far above any real model (the largest have ~128),
// low enough that a damaged or hostile count cannot drive a huge allocation before tensors are read.
inline constexpr int64_t kMaxLayers = 4096;

struct ModelConfig {
  std::string architecture;  // architectures[0] as written in config.json
  Arch arch = Arch::Qwen3_5;
  // Weights live under "model.language_model." (ForConditionalGeneration) instead of "model.".
  bool nested_text = false;

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t intermediate_size = 0;  // dense MLP
  std::string hidden_act = "silu";
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;
  DType dtype = DType::BF16;  // "dtype"/"torch_dtype" of the checkpoint

  // Gated full attention.
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  bool attention_bias = false;
  double rope_theta = 10000.0;
  double partial_rotary_factor = 1.0;
  int64_t rotary_dim() const { return static_cast<int64_t>(head_dim * partial_rotary_factor); }

  // Gated DeltaNet.
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  int64_t linear_conv_kernel_dim = 4;

  std::vector<LayerKind> layer_types;  // one per layer

  // Mixture of experts (num_experts == 0: dense everywhere).
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;
  bool norm_topk_prob = true;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;

  // Nemotron-H (its Mamba2 layers use the linear_* fields as the recurrence sees them: key heads =
  // n_groups, key dim = ssm_state_size (B and C), value heads = mamba_num_heads, value dim =
  // mamba_head_dim; no RoPE anywhere: partial_rotary_factor 0).
  std::vector<uint8_t> moe_blocks;      // per layer: the Ffn block is an MoE
  std::string mlp_act = "silu";         // "relu2": Nemotron-H's MLPs and experts, up/down only
  double time_step_min = 0.0;           // Mamba2: dt clamped below at this
  bool conv_bias = false;               // Mamba2 conv1d has a bias
  int64_t n_group = 1, topk_group = 1;  // grouped top-k routing (sigmoid scores)
  double routed_scaling_factor = 1.0;
  // Kimi-Linear: MLA without RoPE. Keys and values from a normed latent of kv_lora_rank, queries
  // direct (q_lora_rank 0) or through a normed latent. Queries and keys have qk_nope_head_dim +
  // qk_rope_head_dim values a head: the second part of every key is one vector shared by all heads
  // (kv_a_proj_with_mqa's last qk_rope_head_dim outputs, which this NoPE model never rotates).
  // Values have v_head_dim; head_dim, the width of the cache's rows, is the keys' (values are
  // padded with zeros to it).
  int64_t kv_lora_rank = 0, q_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  // MiniMax: residual scaling, x <- alpha * norm(x) + beta * sublayer(norm(x)), per sub-layer kind.
  double linear_attn_alpha = 1, linear_attn_beta = 1, full_attn_alpha = 1, full_attn_beta = 1, mlp_alpha = 1,
         mlp_beta = 1;

  std::vector<int64_t> eos_token_ids;  // from config.json and generation_config.json
  int64_t bos_token_id = -1;
  int64_t pad_token_id = -1;

  bool layer_is_moe(int64_t i) const;
  int64_t num_linear_layers() const;
  int64_t num_attention_layers() const;
};

// One layer as `hypic info` shows it: its token mixer ("linear", "attention", "mla" or "none"), the
// recurrence family of a linear mixer (gated_deltanet, mamba2, lightning, kda), its feed-forward
// ("mlp", "moe" or "none"), and what it keeps per sequence: a fixed state (linear layers: recurrent
// state plus short-conv tail) or key/value rows per token (attention), in f32 values.
struct LayerDesc {
  std::string mixer, family, ffn;
  int64_t state_floats = 0, kv_floats_per_token = 0;
};
LayerDesc describe_layer(const ModelConfig& c, int64_t i);

// Parses config.json text. `path` only names the file in error messages. Throws
// std::runtime_error naming the file and the missing or malformed field.
ModelConfig parse_model_config(const std::string& json_text, const std::string& path);
ModelConfig load_model_config(const std::string& config_json_path);

}  // namespace hypic
