// config.json parsing for the Qwen3.5 / Qwen3.5-MoE / Qwen3-Next families, Nemotron-H, MiniMax and
// Kimi-Linear (each in the field names transformers 5 writes and those of the checkpoints on the Hub).
#include "models/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <stdexcept>

namespace hypic {

using json = nlohmann::json;

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::Qwen3_5:
      return "qwen3_5";
    case Arch::Qwen3_5Moe:
      return "qwen3_5_moe";
    case Arch::Qwen3Next:
      return "qwen3_next";
    case Arch::NemotronH:
      return "nemotron_h";
    case Arch::MiniMax:
      return "minimax";
    case Arch::KimiLinear:
      return "kimi_linear";
  }
  return "?";
}

bool ModelConfig::layer_is_moe(int64_t i) const {
  if (num_experts <= 0) return false;
  if (arch == Arch::NemotronH || arch == Arch::KimiLinear)
    return i >= 0 && static_cast<size_t>(i) < moe_blocks.size() && moe_blocks[i];
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) != mlp_only_layers.end()) return false;
  return decoder_sparse_step > 0 && (i + 1) % decoder_sparse_step == 0;
}

int64_t ModelConfig::num_linear_layers() const {
  return static_cast<int64_t>(std::count(layer_types.begin(), layer_types.end(), LayerKind::Linear));
}

int64_t ModelConfig::num_full_layers() const {
  return static_cast<int64_t>(std::count(layer_types.begin(), layer_types.end(), LayerKind::Full));
}

LayerDesc describe_layer(const ModelConfig& c, int64_t i) {
  LayerDesc d;
  const LayerKind k = c.layer_types[static_cast<size_t>(i)];
  const bool nemotron = c.arch == Arch::NemotronH;  // one sub-layer per block
  if (k == LayerKind::Linear) {
    d.mixer = "linear";
    d.family = c.arch == Arch::NemotronH    ? "mamba2"
               : c.arch == Arch::MiniMax    ? "lightning"
               : c.arch == Arch::KimiLinear ? "kda"
                                            : "gated_deltanet";
    const int64_t conv_ch = c.arch == Arch::KimiLinear ? 3 * c.linear_num_value_heads * c.linear_value_head_dim
                                                       : 2 * c.linear_num_key_heads * c.linear_key_head_dim +
                                                             c.linear_num_value_heads * c.linear_value_head_dim;
    d.state_floats = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim +
                     (c.arch == Arch::MiniMax ? 0 : (c.linear_conv_kernel_dim - 1) * conv_ch);
  } else if (k == LayerKind::Full) {
    d.mixer = c.arch == Arch::KimiLinear ? "mla" : "attention";
    d.kv_floats_per_token = 2 * c.num_key_value_heads * c.head_dim;
  } else {
    d.mixer = "none";
  }
  d.ffn = nemotron && k != LayerKind::Ffn ? "none" : c.layer_is_moe(i) ? "moe" : "mlp";
  return d;
}

namespace {

struct ArchInfo {
  const char* name;  // architectures[0]
  const char* model_type;
  Arch arch;
  bool nested;
};

constexpr ArchInfo kArchs[] = {
    {"Qwen3_5ForCausalLM", "qwen3_5_text", Arch::Qwen3_5, false},
    {"Qwen3_5ForConditionalGeneration", "qwen3_5", Arch::Qwen3_5, true},
    {"Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", Arch::Qwen3_5Moe, false},
    {"Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", Arch::Qwen3_5Moe, true},
    {"Qwen3NextForCausalLM", "qwen3_next", Arch::Qwen3Next, false},
    {"NemotronHForCausalLM", "nemotron_h", Arch::NemotronH, false},
    {"MiniMaxForCausalLM", "minimax", Arch::MiniMax, false},
    {"KimiLinearForCausalLM", "kimi_linear", Arch::KimiLinear, false},
};

std::string supported_list() {
  std::string s;
  for (const auto& a : kArchs) s += (s.empty() ? "" : ", ") + std::string(a.name);
  return s;
}

// Field access with error messages that name the file and the field. `text` is the object
// holding the text model's hyper-parameters; `root` the whole file (they are the same object
// unless the config nests a text_config).
class Fields {
 public:
  Fields(const json& root, const json& text, std::string path) : root_(root), text_(text), path_(std::move(path)) {}

  [[noreturn]] void fail(const std::string& msg) const { throw std::runtime_error(path_ + ": " + msg); }
  [[noreturn]] void bad(const std::string& field, const std::string& what, const json& v) const {
    fail("field '" + field + "' must be " + what + ", found " + v.dump());
  }

  // The field's value in the text object; with `root_fallback`, also looked up at the top level
  // (the nested value wins). nullptr when absent or null.
  const json* find(const std::string& field, bool root_fallback = false) const {
    auto it = text_.find(field);
    if (it != text_.end() && !it->is_null()) return &*it;
    if (root_fallback && &root_ != &text_) {
      it = root_.find(field);
      if (it != root_.end() && !it->is_null()) return &*it;
    }
    return nullptr;
  }

  const json& need(const std::string& field) const {
    const json* v = find(field);
    if (!v) fail("missing field '" + field + "'");
    return *v;
  }

  int64_t to_int(const std::string& field, const json& v) const {
    if (v.is_number_integer()) return v.get<int64_t>();
    // 4096.0 is tolerated (some tools write ints as floats); 1.5 is not.
    if (v.is_number_float()) {
      double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) return static_cast<int64_t>(d);
    }
    bad(field, "an integer", v);
  }

  int64_t positive(const std::string& field) const {
    const json& v = need(field);
    if (!v.is_number()) bad(field, "a positive integer", v);
    int64_t x = to_int(field, v);
    if (x <= 0) bad(field, "a positive integer", v);
    return x;
  }
  int64_t positive_or(const std::string& field, int64_t dflt) const { return find(field) ? positive(field) : dflt; }
  int64_t non_negative_or(const std::string& field, int64_t dflt) const {
    const json* v = find(field);
    if (!v) return dflt;
    if (!v->is_number()) bad(field, "a non-negative integer", *v);
    int64_t x = to_int(field, *v);
    if (x < 0) bad(field, "a non-negative integer", *v);
    return x;
  }
  double number_or(const std::string& field, double dflt, const json* obj = nullptr) const {
    const json* v = obj ? field_of(*obj, field) : find(field);
    if (!v) return dflt;
    if (!v->is_number()) bad(field, "a number", *v);
    return v->get<double>();
  }
  bool boolean_or(const std::string& field, bool dflt, bool root_fallback = false) const {
    const json* v = find(field, root_fallback);
    if (!v) return dflt;
    if (!v->is_boolean()) bad(field, "true or false", *v);
    return v->get<bool>();
  }
  std::string string_or(const std::string& field, const std::string& dflt) const {
    const json* v = find(field);
    if (!v) return dflt;
    if (!v->is_string()) bad(field, "a string", *v);
    return v->get<std::string>();
  }
  // Token ids: an integer, a list of integers, or absent/null.
  std::vector<int64_t> token_ids(const std::string& field) const {
    std::vector<int64_t> out;
    const json* v = find(field, true);
    if (!v) return out;
    if (v->is_array()) {
      for (const json& x : *v) {
        if (!x.is_number_integer()) bad(field, "an integer or a list of integers", *v);
        out.push_back(x.get<int64_t>());
      }
    } else if (v->is_number_integer()) {
      out.push_back(v->get<int64_t>());
    } else {
      bad(field, "an integer or a list of integers", *v);
    }
    return out;
  }
  int64_t token_id(const std::string& field) const {
    const json* v = find(field, true);
    if (!v) return -1;
    if (!v->is_number_integer()) bad(field, "an integer", *v);
    return v->get<int64_t>();
  }

  static const json* field_of(const json& obj, const std::string& field) {
    auto it = obj.find(field);
    return it != obj.end() && !it->is_null() ? &*it : nullptr;
  }

  const json& root() const { return root_; }
  const std::string& path() const { return path_; }

 private:
  const json& root_;
  const json& text_;
  std::string path_;
};

DType parse_dtype(const Fields& f) {
  const json* v = f.find("dtype", true);
  std::string field = "dtype";
  if (!v) {
    v = f.find("torch_dtype", true);
    field = "torch_dtype";
  }
  if (!v) return DType::BF16;
  if (!v->is_string()) f.bad(field, "a string", *v);
  const std::string s = v->get<std::string>();
  if (s == "bfloat16") return DType::BF16;
  if (s == "float16") return DType::F16;
  if (s == "float32") return DType::F32;
  f.bad(field, "one of bfloat16, float16, float32", *v);
}

// Applies one RoPE parameter object (rope_parameters, or legacy rope_scaling) to cfg.
void apply_rope_object(const Fields& f, const std::string& field, const json& obj, ModelConfig& cfg) {
  if (!obj.is_object()) f.bad(field, "an object", obj);
  const json* type = Fields::field_of(obj, "rope_type");
  if (!type) type = Fields::field_of(obj, "type");
  if (type) {
    if (!type->is_string()) f.bad(field + ".rope_type", "a string", *type);
    const std::string t = type->get<std::string>();
    // Multimodal RoPE ("mrope") with identical text positions in every section is plain RoPE.
    if (t != "default" && t != "mrope")
      f.fail("field '" + field + ".rope_type': unsupported RoPE type '" + t + "' (supported: default)");
  }
  if (const json* v = Fields::field_of(obj, "rope_theta")) {
    if (!v->is_number()) f.bad(field + ".rope_theta", "a number", *v);
    cfg.rope_theta = v->get<double>();
  }
  if (const json* v = Fields::field_of(obj, "partial_rotary_factor")) {
    if (!v->is_number()) f.bad(field + ".partial_rotary_factor", "a number", *v);
    cfg.partial_rotary_factor = v->get<double>();
  }
  // mrope_section / mrope_interleaved: accepted and ignored for text-only positions.
}

std::vector<int64_t> int_list(const Fields& f, const std::string& field) {
  std::vector<int64_t> out;
  const json* v = f.find(field);
  if (!v) return out;
  if (!v->is_array()) f.bad(field, "a list of integers", *v);
  for (const json& x : *v) {
    if (!x.is_number_integer()) f.bad(field, "a list of integers", *v);
    out.push_back(x.get<int64_t>());
  }
  return out;
}

// The first of several spellings that is present (Nemotron-H configs on the Hub use the older
// mamba_* names; transformers 5 writes the newer ones).
std::string first_present(const Fields& f, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (f.find(n)) return n;
  return *names.begin();
}

// DeepSeek-V3-style routed experts (Nemotron-H, Kimi-Linear): sigmoid scores, grouped top-k, scaling.
// Each field is read under the first of its spellings that is present; errors name that spelling.
// The shared experts' width is the caller's (the two architectures size them differently).
void parse_grouped_moe(const Fields& f, ModelConfig& cfg, std::initializer_list<const char*> experts,
                       std::initializer_list<const char*> per_tok, std::initializer_list<const char*> renorm,
                       std::initializer_list<const char*> group) {
  const std::string e = first_present(f, experts), k = first_present(f, per_tok), g = first_present(f, group);
  cfg.num_experts = f.positive(e);
  cfg.num_experts_per_tok = f.positive(k);
  cfg.moe_intermediate_size = f.positive("moe_intermediate_size");
  cfg.norm_topk_prob = f.boolean_or(first_present(f, renorm), true);
  cfg.n_group = f.positive_or(g, 1);
  cfg.topk_group = f.positive_or("topk_group", 1);
  cfg.routed_scaling_factor = f.number_or("routed_scaling_factor", 1.0);
  if (cfg.num_experts_per_tok > cfg.num_experts)
    f.fail("field '" + k + "' (" + std::to_string(cfg.num_experts_per_tok) + ") must not exceed '" + e + "' (" +
           std::to_string(cfg.num_experts) + ")");
  if (cfg.num_experts % cfg.n_group != 0 || cfg.topk_group > cfg.n_group)
    f.fail("fields '" + g + "' (" + std::to_string(cfg.n_group) + ") and 'topk_group' (" +
           std::to_string(cfg.topk_group) + ") do not divide the " + std::to_string(cfg.num_experts) + " experts");
}

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
      cfg.layer_types.push_back(LayerKind::Full);
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
  if (f.non_negative_or("qk_rope_head_dim", 0) != 0)
    f.fail("field 'qk_rope_head_dim' must be 0: MLA with RoPE is not supported (Kimi-Linear's MLA has none)");
  cfg.head_dim = f.positive("qk_nope_head_dim");
  if (const int64_t v = f.positive_or("v_head_dim", cfg.head_dim); v != cfg.head_dim)
    f.fail("field 'v_head_dim' (" + std::to_string(v) + ") must equal 'qk_nope_head_dim' (" +
           std::to_string(cfg.head_dim) + ")");
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
        cfg.layer_types.push_back(LayerKind::Full);
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
      cfg.layer_types[static_cast<size_t>(v.get<int64_t>() - 1)] = LayerKind::Full;
    }
  } else {
    for (int64_t i = 0; i < L; ++i) cfg.layer_types.push_back((i + 1) % 4 == 0 ? LayerKind::Full : LayerKind::Linear);
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

}  // namespace

ModelConfig parse_model_config(const std::string& json_text, const std::string& path) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    throw std::runtime_error(path + ": malformed JSON: " + e.what());
  }
  if (!root.is_object()) throw std::runtime_error(path + ": top level is not a JSON object");

  ModelConfig cfg;
  // Architecture: architectures[0], else model_type.
  const ArchInfo* info = nullptr;
  std::string named;
  auto ait = root.find("architectures");
  if (ait != root.end() && ait->is_array() && !ait->empty()) {
    if (!(*ait)[0].is_string())
      throw std::runtime_error(path + ": field 'architectures' must be a list of strings, found " + ait->dump());
    named = (*ait)[0].get<std::string>();
    for (const auto& a : kArchs)
      if (named == a.name) info = &a;
  } else {
    auto mt = root.find("model_type");
    if (mt == root.end() || !mt->is_string())
      throw std::runtime_error(
          path + ": neither 'architectures' nor 'model_type' names the model (supported: " + supported_list() + ")");
    named = mt->get<std::string>();
    for (const auto& a : kArchs)
      if (named == a.model_type) info = &a;
  }
  if (!info)
    throw std::runtime_error("unsupported architecture '" + named + "' in " + path +
                             " (supported: " + supported_list() + ")");
  cfg.architecture = info->name;
  cfg.arch = info->arch;
  cfg.nested_text = info->nested;

  const json* text = &root;
  if (cfg.nested_text) {
    auto tc = root.find("text_config");
    if (tc == root.end() || !tc->is_object())
      throw std::runtime_error(path + ": " + cfg.architecture + " needs an object field 'text_config'");
    text = &*tc;
  }
  Fields f(root, *text, path);
  if (cfg.arch == Arch::NemotronH) {
    parse_nemotron_h(f, cfg);
    return cfg;
  }
  if (cfg.arch == Arch::KimiLinear) {
    parse_kimi_linear(f, cfg);
    return cfg;
  }
  const bool minimax = cfg.arch == Arch::MiniMax;

  cfg.vocab_size = f.positive("vocab_size");
  cfg.hidden_size = f.positive("hidden_size");
  cfg.num_hidden_layers = f.positive("num_hidden_layers");
  if (cfg.num_hidden_layers > kMaxLayers)
    f.bad("num_hidden_layers", "at most " + std::to_string(kMaxLayers) + " layers", f.need("num_hidden_layers"));
  cfg.intermediate_size = f.non_negative_or("intermediate_size", 0);
  cfg.hidden_act = f.string_or("hidden_act", "silu");
  cfg.rms_norm_eps = f.number_or("rms_norm_eps", 1e-6);
  if (!(cfg.rms_norm_eps > 0)) f.bad("rms_norm_eps", "a positive number", f.need("rms_norm_eps"));
  cfg.tie_word_embeddings = f.boolean_or("tie_word_embeddings", false, /*root_fallback=*/true);
  cfg.max_position_embeddings = f.positive_or("max_position_embeddings", 0);
  cfg.dtype = parse_dtype(f);

  cfg.num_attention_heads = f.positive("num_attention_heads");
  cfg.num_key_value_heads = f.positive_or("num_key_value_heads", cfg.num_attention_heads);
  if (cfg.num_attention_heads % cfg.num_key_value_heads != 0)
    f.fail("field 'num_attention_heads' (" + std::to_string(cfg.num_attention_heads) +
           ") must be a multiple of 'num_key_value_heads' (" + std::to_string(cfg.num_key_value_heads) + ")");
  if (f.find("head_dim")) {
    cfg.head_dim = f.positive("head_dim");
  } else {
    if (cfg.hidden_size % cfg.num_attention_heads != 0)
      f.fail("no 'head_dim' and 'hidden_size' (" + std::to_string(cfg.hidden_size) +
             ") is not a multiple of 'num_attention_heads' (" + std::to_string(cfg.num_attention_heads) + ")");
    cfg.head_dim = cfg.hidden_size / cfg.num_attention_heads;
  }
  cfg.attention_bias = f.boolean_or("attention_bias", false);

  // RoPE: legacy top-level fields first, then rope_scaling, then rope_parameters (transformers 5),
  // each overriding what came before.
  cfg.rope_theta = f.number_or("rope_theta", 10000.0);
  cfg.partial_rotary_factor = f.number_or("partial_rotary_factor", 1.0);
  if (const json* rs = f.find("rope_scaling")) apply_rope_object(f, "rope_scaling", *rs, cfg);
  if (const json* rp = f.find("rope_parameters")) apply_rope_object(f, "rope_parameters", *rp, cfg);
  if (!(cfg.rope_theta > 0))
    f.fail("field 'rope_theta' must be a positive number, found " + json(cfg.rope_theta).dump());
  if (!(cfg.partial_rotary_factor > 0 && cfg.partial_rotary_factor <= 1))
    f.fail("field 'partial_rotary_factor' must be in (0, 1], found " + json(cfg.partial_rotary_factor).dump());
  {
    double rd = cfg.head_dim * cfg.partial_rotary_factor;
    if (rd != std::floor(rd) || cfg.rotary_dim() % 2 != 0 || cfg.rotary_dim() <= 0)
      f.fail("field 'partial_rotary_factor' (" + json(cfg.partial_rotary_factor).dump() + ") with head_dim " +
             std::to_string(cfg.head_dim) + " gives rotary dim " + json(rd).dump() +
             ", which must be a positive even integer");
  }

  if (minimax) {
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
  } else {
    cfg.linear_num_key_heads = f.positive("linear_num_key_heads");
    cfg.linear_num_value_heads = f.positive("linear_num_value_heads");
    cfg.linear_key_head_dim = f.positive("linear_key_head_dim");
    cfg.linear_value_head_dim = f.positive("linear_value_head_dim");
    cfg.linear_conv_kernel_dim = f.positive_or("linear_conv_kernel_dim", 4);
  }
  if (cfg.linear_num_value_heads % cfg.linear_num_key_heads != 0)
    f.fail("field 'linear_num_value_heads' (" + std::to_string(cfg.linear_num_value_heads) +
           ") must be a multiple of 'linear_num_key_heads' (" + std::to_string(cfg.linear_num_key_heads) + ")");

  // Layer schedule.
  if (const json* lt = f.find("layer_types")) {
    if (!lt->is_array()) f.bad("layer_types", "a list of strings", *lt);
    for (size_t i = 0; i < lt->size(); ++i) {
      const json& s = (*lt)[i];
      if (s == "linear_attention") {
        cfg.layer_types.push_back(LayerKind::Linear);
      } else if (s == "full_attention") {
        cfg.layer_types.push_back(LayerKind::Full);
      } else {
        f.fail("field 'layer_types[" + std::to_string(i) + "]': unknown layer type " + s.dump() +
               " (expected \"linear_attention\" or \"full_attention\")");
      }
    }
    if (static_cast<int64_t>(cfg.layer_types.size()) != cfg.num_hidden_layers)
      f.fail("field 'layer_types' has " + std::to_string(cfg.layer_types.size()) +
             " entries but 'num_hidden_layers' is " + std::to_string(cfg.num_hidden_layers));
  } else {
    int64_t interval = f.positive_or("full_attention_interval", 4);
    for (int64_t i = 0; i < cfg.num_hidden_layers; ++i)
      cfg.layer_types.push_back((i + 1) % interval == 0 ? LayerKind::Full : LayerKind::Linear);
  }

  // Mixture of experts.
  cfg.num_experts = f.non_negative_or(minimax ? "num_local_experts" : "num_experts", 0);
  if (minimax && cfg.num_experts == 0) f.fail("missing field 'num_local_experts' (every MiniMax layer is an MoE)");
  if (minimax) {
    // Every layer routes to num_experts_per_tok of num_local_experts SwiGLU experts of intermediate_size.
    cfg.num_experts_per_tok = f.positive("num_experts_per_tok");
    cfg.moe_intermediate_size = f.positive("intermediate_size");
    if (cfg.num_experts_per_tok > cfg.num_experts)
      f.fail("field 'num_experts_per_tok' (" + std::to_string(cfg.num_experts_per_tok) +
             ") must not exceed 'num_local_experts' (" + std::to_string(cfg.num_experts) + ")");
  } else if (cfg.num_experts > 0) {
    cfg.num_experts_per_tok = f.positive("num_experts_per_tok");
    cfg.moe_intermediate_size = f.positive("moe_intermediate_size");
    cfg.shared_expert_intermediate_size = f.non_negative_or("shared_expert_intermediate_size", 0);
    cfg.norm_topk_prob = f.boolean_or("norm_topk_prob", true);
    cfg.decoder_sparse_step = f.positive_or("decoder_sparse_step", 1);
    cfg.mlp_only_layers = int_list(f, "mlp_only_layers");
    if (cfg.num_experts_per_tok > cfg.num_experts)
      f.fail("field 'num_experts_per_tok' (" + std::to_string(cfg.num_experts_per_tok) +
             ") must not exceed 'num_experts' (" + std::to_string(cfg.num_experts) + ")");
    for (int64_t l : cfg.mlp_only_layers)
      if (l < 0 || l >= cfg.num_hidden_layers)
        f.fail("field 'mlp_only_layers' lists layer " + std::to_string(l) + ", outside [0, " +
               std::to_string(cfg.num_hidden_layers) + ")");
  } else if (cfg.arch == Arch::Qwen3_5Moe || cfg.arch == Arch::Qwen3Next) {
    f.fail("missing field 'num_experts' (" + cfg.architecture + " is a mixture-of-experts model)");
  }
  // Every dense layer needs an MLP width.
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    if (!cfg.layer_is_moe(i) && cfg.intermediate_size <= 0)
      f.fail("field 'intermediate_size' must be a positive integer (layer " + std::to_string(i) +
             " has a dense MLP), found " +
             (f.find("intermediate_size") ? f.find("intermediate_size")->dump() : "none"));
  }

  cfg.eos_token_ids = f.token_ids("eos_token_id");
  cfg.bos_token_id = f.token_id("bos_token_id");
  cfg.pad_token_id = f.token_id("pad_token_id");
  return cfg;
}

ModelConfig load_model_config(const std::string& config_json_path) {
  std::ifstream in(config_json_path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + config_json_path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_model_config(ss.str(), config_json_path);
}

}  // namespace hypic
