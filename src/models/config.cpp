// config.json parsing for the Qwen3.5 / Qwen3.5-MoE / Qwen3-Next families, the pieces other
// architectures share, and the dispatch (through the registry, architectures.h) to the parsers
// that live with their architectures, each in the field names transformers 5 writes and those of
// the checkpoints on the Hub.
#include "models/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "models/config_fields.h"

namespace hypic {

using json = nlohmann::json;

bool ModelConfig::layer_is_moe(int64_t i) const {
  if (num_experts <= 0) return false;
  if (!moe_blocks.empty())  // the architecture lists its MoE blocks (Nemotron-H, Kimi-Linear)
    return i >= 0 && static_cast<size_t>(i) < moe_blocks.size() && moe_blocks[i];
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) != mlp_only_layers.end()) return false;
  return decoder_sparse_step > 0 && (i + 1) % decoder_sparse_step == 0;
}

int64_t ModelConfig::num_linear_layers() const {
  return static_cast<int64_t>(std::count(layer_types.begin(), layer_types.end(), LayerKind::Linear));
}

int64_t ModelConfig::num_attention_layers() const {
  return static_cast<int64_t>(std::count(layer_types.begin(), layer_types.end(), LayerKind::Attention));
}

LayerDesc describe_layer(const ModelConfig& c, int64_t i) {
  LayerDesc d;
  const ArchSpec& spec = arch_spec(c.arch);
  const LayerKind k = c.layer_types[static_cast<size_t>(i)];
  if (k == LayerKind::Linear) {
    d.mixer = "linear";
    d.family = spec.linear_family;
    // Model::new_state's shapes: the recurrent state, and the short conv's last K-1 inputs (q, k, v
    // as one conv or three).
    const int64_t conv_ch =
        2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim;
    d.state_floats = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim +
                     (spec.short_conv ? (c.linear_conv_kernel_dim - 1) * conv_ch : 0);
  } else if (k == LayerKind::Attention) {
    d.mixer = spec.attention_mixer;
    d.kv_floats_per_token = 2 * c.num_key_value_heads * c.head_dim;
  } else {
    d.mixer = "none";
  }
  d.ffn = spec.one_sublayer_per_block && k != LayerKind::Ffn ? "none" : c.layer_is_moe(i) ? "moe" : "mlp";
  return d;
}

namespace config_detail {

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

// Fields every softmax-attention architecture with RoPE shares (Qwen's and MiniMax's): sizes,
// norms, dtype, attention heads and head dim, RoPE.
void parse_attention_common(const Fields& f, ModelConfig& cfg) {
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
}

void parse_layer_types(const Fields& f, ModelConfig& cfg) {
  if (const json* lt = f.find("layer_types")) {
    if (!lt->is_array()) f.bad("layer_types", "a list of strings", *lt);
    for (size_t i = 0; i < lt->size(); ++i) {
      const json& s = (*lt)[i];
      if (s == "linear_attention") {
        cfg.layer_types.push_back(LayerKind::Linear);
      } else if (s == "full_attention") {
        cfg.layer_types.push_back(LayerKind::Attention);
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
      cfg.layer_types.push_back((i + 1) % interval == 0 ? LayerKind::Attention : LayerKind::Linear);
  }
}

void parse_mlp_widths_and_token_ids(const Fields& f, ModelConfig& cfg) {
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
}

// Qwen3.5, Qwen3.5-MoE and Qwen3-Next (their layers are Model's own).
void parse_qwen(const Fields& f, ModelConfig& cfg) {
  parse_attention_common(f, cfg);
  cfg.linear_num_key_heads = f.positive("linear_num_key_heads");
  cfg.linear_num_value_heads = f.positive("linear_num_value_heads");
  cfg.linear_key_head_dim = f.positive("linear_key_head_dim");
  cfg.linear_value_head_dim = f.positive("linear_value_head_dim");
  cfg.linear_conv_kernel_dim = f.positive_or("linear_conv_kernel_dim", 4);
  if (cfg.linear_num_value_heads % cfg.linear_num_key_heads != 0)
    f.fail("field 'linear_num_value_heads' (" + std::to_string(cfg.linear_num_value_heads) +
           ") must be a multiple of 'linear_num_key_heads' (" + std::to_string(cfg.linear_num_key_heads) + ")");
  parse_layer_types(f, cfg);

  // Mixture of experts.
  cfg.num_experts = f.non_negative_or("num_experts", 0);
  if (cfg.num_experts > 0) {
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
  parse_mlp_widths_and_token_ids(f, cfg);
}

}  // namespace config_detail

using namespace config_detail;

namespace {

std::string supported_list() {
  std::string s;
  for (const ArchSpec& a : arch_specs())
    for (const auto& n : a.hf)
      if (n.architecture) s += (s.empty() ? "" : ", ") + std::string(n.architecture);
  return s;
}

// A linear layer's per-sequence state (heads x key dim x value dim, plus the conv's inputs) and an
// attention layer's cache row, from fields each within Fields::kMaxSize: their products can still
// pass any memory (or int64); such a config is refused here rather than misread later.
void check_state_sizes(const Fields& f, const ModelConfig& c) {
  constexpr int64_t kMax = int64_t{1} << 40;
  auto mul = [&](std::initializer_list<int64_t> xs, const char* what) {
    int64_t p = 1;
    for (int64_t x : xs)
      if (__builtin_mul_overflow(p, x, &p) || p > kMax)
        f.fail(std::string("implausible sizes: ") + what + " would hold more than 2^40 values");
    return p;
  };
  mul({c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim}, "a linear layer's state");
  const int64_t conv_ch = mul({3, c.linear_num_value_heads, c.linear_value_head_dim}, "a short conv") +
                          mul({2, c.linear_num_key_heads, c.linear_key_head_dim}, "a short conv");
  mul({std::max<int64_t>(c.linear_conv_kernel_dim, 1), conv_ch}, "a short conv's state");
  mul({2, c.num_key_value_heads, c.head_dim}, "an attention layer's cache row");
}

}  // namespace

// Python's json module writes the non-finite floats as bare Infinity, -Infinity and NaN, which JSON
// has no words for; config.json files saved by transformers 4 carry them (Nemotron-H's
// time_step_limit [0.0, Infinity]). Outside strings they become the strings "Infinity", "-Infinity"
// and "NaN": a field this engine ignores parses, a field it reads is refused by name.
static std::string quote_nonfinite_floats(const std::string& text) {
  std::string out;
  out.reserve(text.size() + 16);
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < text.size())
        out += text[++i];
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
      out += c;
      continue;
    }
    bool replaced = false;
    for (const char* word : {"-Infinity", "Infinity", "NaN"}) {
      const size_t n = std::char_traits<char>::length(word);
      if (text.compare(i, n, word) == 0) {
        out += '"';
        out += word;
        out += '"';
        i += n - 1;
        replaced = true;
        break;
      }
    }
    if (!replaced) out += c;
  }
  return out;
}

ModelConfig parse_model_config(const std::string& json_text, const std::string& path) {
  json root;
  try {
    root = json::parse(quote_nonfinite_floats(json_text));
  } catch (const json::exception& e) {
    throw std::runtime_error(path + ": malformed JSON: " + e.what());
  }
  if (!root.is_object()) throw std::runtime_error(path + ": top level is not a JSON object");

  ModelConfig cfg;
  // Architecture: architectures[0], else model_type.
  const ArchSpec* spec = nullptr;
  const ArchSpec::HfName* info = nullptr;
  auto find = [&](const std::string& named, bool by_type) {
    for (const ArchSpec& a : arch_specs())
      for (const auto& n : a.hf)
        if (n.architecture && named == (by_type ? n.model_type : n.architecture)) {
          spec = &a;
          info = &n;
        }
  };
  std::string named;
  auto ait = root.find("architectures");
  if (ait != root.end() && ait->is_array() && !ait->empty()) {
    if (!(*ait)[0].is_string())
      throw std::runtime_error(path + ": field 'architectures' must be a list of strings, found " + ait->dump());
    named = (*ait)[0].get<std::string>();
    find(named, false);
  } else {
    auto mt = root.find("model_type");
    if (mt == root.end() || !mt->is_string())
      throw std::runtime_error(
          path + ": neither 'architectures' nor 'model_type' names the model (supported: " + supported_list() + ")");
    named = mt->get<std::string>();
    find(named, true);
  }
  if (!info)
    throw std::runtime_error("unsupported architecture '" + named + "' in " + path +
                             " (supported: " + supported_list() + ")");
  cfg.architecture = info->architecture;
  cfg.arch = spec->arch;
  cfg.nested_text = info->nested;

  const json* text = &root;
  if (cfg.nested_text) {
    auto tc = root.find("text_config");
    if (tc == root.end() || !tc->is_object())
      throw std::runtime_error(path + ": " + cfg.architecture + " needs an object field 'text_config'");
    text = &*tc;
  }
  Fields f(root, *text, path);
  spec->parse(f, cfg);
  check_state_sizes(f, cfg);
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
