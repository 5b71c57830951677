#include "models/gguf_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>

namespace hypic {

namespace {

using json = nlohmann::json;

[[noreturn]] void fail(const GgufFile& f, const std::string& what) {
  throw std::runtime_error("gguf " + f.path() + ": " + what);
}

// Where a Hugging Face tensor comes from in the file, and what undoes the converter's change.
struct Source {
  std::string tensor;
  int64_t expert = -1;  // a slice of the stacked experts
  enum class Fix { None, MinusOne, LogNeg } fix = Fix::None;
  int axis = -1;             // value heads regrouped along rows (0) or columns (1)
  int64_t from = 0, hd = 0;  // from this index, in blocks of hd
};

// The file's tensor for a Hugging Face name under config c, and what undoes the converter's change.
std::optional<Source> resolve(const ModelConfig& c_, const std::string& name) {
  using Fix = Source::Fix;
  if (name == "model.embed_tokens.weight") return Source{"token_embd.weight"};
  if (name == "lm_head.weight") return Source{"output.weight"};
  if (name == "model.norm.weight") return Source{"output_norm.weight", -1, Fix::MinusOne};
  const std::string L = "model.layers.";
  if (name.rfind(L, 0) != 0) return std::nullopt;
  size_t dot = name.find('.', L.size());
  if (dot == std::string::npos) return std::nullopt;
  const std::string idx = name.substr(L.size(), dot - L.size());
  if (idx.empty() || idx.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  const std::string blk = "blk." + idx + ".", rest = name.substr(dot + 1);
  // Value-head regrouping only exists when key heads are repeated over value heads.
  const bool regroup = c_.linear_num_key_heads != c_.linear_num_value_heads;
  const int64_t qk = 2 * c_.linear_num_key_heads * c_.linear_key_head_dim, dv = c_.linear_value_head_dim;
  auto heads = [&](const std::string& t, int axis, int64_t from, int64_t hd, Fix fix = Fix::None) {
    Source s{blk + t, -1, fix};
    if (regroup) s.axis = axis, s.from = from, s.hd = hd;
    return s;
  };
  static const std::pair<const char*, const char*> kPlain[] = {
      {"linear_attn.norm.weight", "ssm_norm.weight"},
      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.o_proj.weight", "attn_output.weight"},
      {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"},
      {"mlp.gate.weight", "ffn_gate_inp.weight"},
      {"mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"},
      {"mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"},
      {"mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"},
      {"mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"},
  };
  for (auto [hf, gg] : kPlain)
    if (rest == hf) return Source{blk + gg};
  static const std::pair<const char*, const char*> kPlusOne[] = {
      {"input_layernorm.weight", "attn_norm.weight"},
      {"post_attention_layernorm.weight", "post_attention_norm.weight"},
      {"self_attn.q_norm.weight", "attn_q_norm.weight"},
      {"self_attn.k_norm.weight", "attn_k_norm.weight"},
  };
  for (auto [hf, gg] : kPlusOne)
    if (rest == hf) return Source{blk + gg, -1, Fix::MinusOne};
  if (rest == "linear_attn.in_proj_qkv.weight") return heads("attn_qkv.weight", 0, qk, dv);
  if (rest == "linear_attn.in_proj_z.weight") return heads("attn_gate.weight", 0, 0, dv);
  if (rest == "linear_attn.in_proj_b.weight") return heads("ssm_beta.weight", 0, 0, 1);
  if (rest == "linear_attn.in_proj_a.weight") return heads("ssm_alpha.weight", 0, 0, 1);
  if (rest == "linear_attn.A_log") return heads("ssm_a", 0, 0, 1, Fix::LogNeg);
  if (rest == "linear_attn.dt_bias") return heads("ssm_dt.bias", 0, 0, 1);
  if (rest == "linear_attn.conv1d.weight") return heads("ssm_conv1d.weight", 0, qk, dv);
  if (rest == "linear_attn.out_proj.weight") return heads("ssm_out.weight", 1, 0, dv);
  // mlp.experts.E.{gate,up,down}_proj.weight: expert E of the layer's stacked tensor.
  const std::string ex = "mlp.experts.";
  if (rest.rfind(ex, 0) == 0) {
    const size_t d2 = rest.find('.', ex.size());
    if (d2 == std::string::npos) return std::nullopt;
    const std::string e = rest.substr(ex.size(), d2 - ex.size()), what = rest.substr(d2 + 1);
    if (e.empty() || e.size() > 9 || e.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
    const char* t = what == "gate_proj.weight"   ? "ffn_gate_exps.weight"
                    : what == "up_proj.weight"   ? "ffn_up_exps.weight"
                    : what == "down_proj.weight" ? "ffn_down_exps.weight"
                                                 : nullptr;
    if (!t) return std::nullopt;
    return Source{blk + t, std::stoll(e)};
  }
  return std::nullopt;
}

class GgufWeights : public WeightSource {
 public:
  GgufWeights(std::shared_ptr<const GgufFile> f, const ModelConfig& c) : f_(std::move(f)), c_(c) {}
  bool has(const std::string& name) const override {
    auto s = resolve(c_, name);
    return s && f_->find(s->tensor);
  }
  Tensor get(const std::string& name, const Shape& expected) const override;
  std::string describe() const override { return "gguf " + f_->path(); }

 private:
  std::shared_ptr<const GgufFile> f_;
  ModelConfig c_;
};

Tensor GgufWeights::get(const std::string& name, const Shape& expected) const {
  const GgufFile& f = *f_;
  const auto s = resolve(c_, name);
  if (!s) fail(f, "no GGUF tensor corresponds to " + name);
  const GgufTensorInfo* info = f.find(s->tensor);
  if (!info) fail(f, "missing tensor " + s->tensor + " (for " + name + ")");
  static constexpr uint32_t kLoads[] = {0, 1, 30, 8, 12, 14};  // F32, F16, BF16, Q8_0, Q4_K, Q6_K
  if (std::find(std::begin(kLoads), std::end(kLoads), info->type->id) == std::end(kLoads))
    fail(f, "tensor " + s->tensor + " is " + info->type->name + ": hypic loads F32, F16, BF16, Q8_0, Q4_K and Q6_K");
  Tensor t = f.get(s->tensor);
  // Quantized blocks stay quantized in products and embeddings (the model's 2-D weights); any
  // other tensor is used as f32.
  if (dtype_is_quantized(t.dtype()) && expected.size() != 2) t = t.to_f32();

  if (s->expert >= 0) {
    const Shape sh = t.shape();
    if (sh.size() != 3 || s->expert >= sh[0])
      fail(f, "tensor " + s->tensor + " " + shape_str(sh) + " has no expert " + std::to_string(s->expert));
    t = t.reshape({sh[0] * sh[1], sh[2]}).slice_rows(s->expert * sh[1], (s->expert + 1) * sh[1]);
  }
  if (s->fix != Source::Fix::None) {
    t = t.dtype() == DType::F32 ? t.clone() : t.to_f32();  // a copy: views of the mapping are read-only
    float* p = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (s->fix == Source::Fix::MinusOne) {
        p[i] -= 1.0f;
      } else {
        if (!(p[i] < 0.0f)) fail(f, "tensor " + s->tensor + " holds " + std::to_string(p[i]) + ", not -exp(A_log)");
        p[i] = std::log(-p[i]);
      }
    }
  }
  if (s->axis >= 0) {
    // Stored value head p = j * nk + g holds Hugging Face head h = g * r + j.
    const int64_t nk = c_.linear_num_key_heads, nv = c_.linear_num_value_heads, r = nv / nk;
    const Shape sh = t.shape();
    const int64_t rows = sh.empty() ? 1 : sh[0], cols = t.numel() / std::max<int64_t>(rows, 1);
    const int64_t along = s->axis == 0 ? rows : cols;
    if (s->from + nv * s->hd > along)
      fail(f, "tensor " + s->tensor + " " + shape_str(sh) + " is too small for " + std::to_string(nv) +
                  " value heads of " + std::to_string(s->hd));
    // Quantized columns move in whole blocks only; heads narrower than a block go through f32.
    if (s->axis == 1 && s->hd % dtype_block(t.dtype()) != 0) t = t.to_f32();
    const Tensor src = t;
    t = src.clone();
    const DType dt = src.dtype();
    auto bytes = [dt](int64_t n) { return dtype_bytes(dt, n); };  // n: a whole number of blocks
    const auto* in = static_cast<const char*>(src.raw());
    auto* out = static_cast<char*>(t.raw());
    for (int64_t h = 0; h < nv; ++h) {
      const int64_t g = h / r, j = h % r, p = j * nk + g;
      const int64_t dst0 = s->from + h * s->hd, src0 = s->from + p * s->hd;
      if (s->axis == 0) {
        std::memcpy(out + bytes(dst0 * cols), in + bytes(src0 * cols), bytes(s->hd * cols));
      } else {
        for (int64_t row = 0; row < rows; ++row)
          std::memcpy(out + bytes(row * cols + dst0), in + bytes(row * cols + src0), bytes(s->hd));
      }
    }
  }
  if (t.shape() != expected) {
    // conv1d is stored without its middle axis of one; nothing else may differ.
    auto squeeze = [](Shape x) {
      Shape o;
      for (int64_t d : x)
        if (d != 1) o.push_back(d);
      return o;
    };
    if (t.numel() != shape_numel(expected) || squeeze(t.shape()) != squeeze(expected))
      fail(f,
           "tensor " + s->tensor + " is " + shape_str(t.shape()) + ", " + name + " should be " + shape_str(expected));
    t = t.reshape(expected);
  }
  return t;
}

// The Hugging Face originals of llama.cpp's pre-tokenizer names (tokenizer.json's Split regex).
const char* pre_tokenizer_regex(const std::string& pre) {
  if (pre == "qwen2")
    return R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  if (pre == "qwen35")
    return R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  return nullptr;
}

}  // namespace

ModelConfig gguf_model_config(const GgufFile& f) {
  const std::string a = f.get_string("general.architecture");
  ModelConfig c;
  if (a == "qwen35") {
    c.arch = Arch::Qwen3_5;
    c.architecture = "Qwen3_5ForCausalLM";
  } else if (a == "qwen35moe") {
    c.arch = Arch::Qwen3_5Moe;
    c.architecture = "Qwen3_5MoeForCausalLM";
  } else if (a == "qwen3next") {
    fail(f,
         "architecture qwen3next is not supported yet (llama.cpp's converter cannot write the mlp-only "
         "layers of hypic's Qwen3-Next reference checkpoint, so there is no file to test a mapping against)");
  } else {
    fail(f, "architecture '" + a + "' is not one hypic runs from GGUF (qwen35, qwen35moe)");
  }
  auto positive = [&](const std::string& k) {
    const int64_t v = f.get_int(a + "." + k);
    if (v <= 0) fail(f, a + "." + k + " must be positive, is " + std::to_string(v));
    return v;
  };
  c.hidden_size = positive("embedding_length");
  c.num_hidden_layers = positive("block_count");
  c.max_position_embeddings = positive("context_length");
  c.rms_norm_eps = f.get_float(a + ".attention.layer_norm_rms_epsilon");
  c.num_attention_heads = positive("attention.head_count");
  c.num_key_value_heads = positive("attention.head_count_kv");
  c.head_dim = positive("attention.key_length");
  if (f.has(a + ".attention.value_length") && positive("attention.value_length") != c.head_dim)
    fail(f, a + ".attention.value_length differs from key_length");
  c.rope_theta = f.get_float(a + ".rope.freq_base");
  const int64_t rot = positive("rope.dimension_count");
  if (rot > c.head_dim) fail(f, a + ".rope.dimension_count exceeds the head dimension");
  c.partial_rotary_factor = static_cast<double>(rot) / static_cast<double>(c.head_dim);
  c.linear_num_key_heads = positive("ssm.group_count");
  c.linear_num_value_heads = positive("ssm.time_step_rank");
  if (c.linear_num_value_heads % c.linear_num_key_heads != 0)
    fail(f, a + ".ssm.time_step_rank is not a multiple of ssm.group_count");
  c.linear_key_head_dim = positive("ssm.state_size");
  const int64_t inner = positive("ssm.inner_size");
  if (inner % c.linear_num_value_heads != 0) fail(f, a + ".ssm.inner_size is not a multiple of ssm.time_step_rank");
  c.linear_value_head_dim = inner / c.linear_num_value_heads;
  c.linear_conv_kernel_dim = positive("ssm.conv_kernel");
  const int64_t every = positive("full_attention_interval");
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    c.layer_types.push_back((i + 1) % every == 0 ? LayerKind::Full : LayerKind::Linear);
  if (c.arch == Arch::Qwen3_5Moe) {
    c.num_experts = positive("expert_count");
    c.num_experts_per_tok = positive("expert_used_count");
    c.moe_intermediate_size = positive("expert_feed_forward_length");
    if (f.has(a + ".expert_shared_feed_forward_length"))
      c.shared_expert_intermediate_size = positive("expert_shared_feed_forward_length");
    c.norm_topk_prob = true;  // Qwen3.5-MoE renormalises its top-k; the converter writes no key for it
  } else {
    c.intermediate_size = positive("feed_forward_length");
  }
  const GgufTensorInfo* emb = f.find("token_embd.weight");
  if (!emb) fail(f, "missing tensor token_embd.weight");
  const Shape es = emb->shape();
  if (es.size() != 2 || es[1] != c.hidden_size)
    fail(f, "token_embd.weight is " + shape_str(es) + ", expected [vocab, " + std::to_string(c.hidden_size) + "]");
  c.vocab_size = es[0];
  c.tie_word_embeddings = f.find("output.weight") == nullptr;
  c.dtype = emb->type->id == 30 ? DType::BF16 : emb->type->id == 1 ? DType::F16 : DType::F32;
  if (f.has("tokenizer.ggml.eos_token_id")) c.eos_token_ids = {f.get_int("tokenizer.ggml.eos_token_id")};
  if (f.has("tokenizer.ggml.bos_token_id")) c.bos_token_id = f.get_int("tokenizer.ggml.bos_token_id");
  if (f.has("tokenizer.ggml.padding_token_id")) c.pad_token_id = f.get_int("tokenizer.ggml.padding_token_id");
  return c;
}

const GgufTensorInfo* gguf_tensor_for(const GgufFile& f, const ModelConfig& cfg, const std::string& hf_name) {
  const auto s = resolve(cfg, hf_name);
  return s ? f.find(s->tensor) : nullptr;
}

std::unique_ptr<WeightSource> weights_from_gguf(std::shared_ptr<const GgufFile> f, const ModelConfig& cfg) {
  return std::make_unique<GgufWeights>(std::move(f), cfg);
}

TokenizerTexts gguf_tokenizer_texts(const GgufFile& f) {
  const std::string model = f.get_string("tokenizer.ggml.model");
  if (model != "gpt2") fail(f, "tokenizer.ggml.model '" + model + "' is not supported (only gpt2: byte-level BPE)");
  const std::string pre = f.has("tokenizer.ggml.pre") ? f.get_string("tokenizer.ggml.pre") : "default";
  const char* regex = pre_tokenizer_regex(pre);
  if (!regex) fail(f, "tokenizer.ggml.pre '" + pre + "' is not supported (qwen2, qwen35)");
  const GgufArray& tokens = f.get_array("tokenizer.ggml.tokens");
  const GgufArray& merges = f.get_array("tokenizer.ggml.merges");
  const GgufArray* types = f.has("tokenizer.ggml.token_type") ? &f.get_array("tokenizer.ggml.token_type") : nullptr;
  if (types && types->items.size() != tokens.items.size())
    fail(f, "tokenizer.ggml.token_type has " + std::to_string(types->items.size()) + " entries, tokens " +
                std::to_string(tokens.items.size()));
  auto str = [&](const GgufValue& v, const char* key) -> const std::string& {
    if (const auto* s = std::get_if<std::string>(&v.v)) return *s;
    fail(f, std::string(key) + " holds a value that is not a string");
  };
  // Token types (llama.cpp's llama_token_type): 1 normal, 2 unknown, 3 control, 4 user-defined,
  // 5 unused, 6 byte. Control and user-defined tokens are tokenizer.json's added tokens.
  json vocab = json::object(), added = json::array();
  for (size_t i = 0; i < tokens.items.size(); ++i) {
    const std::string& tok = str(tokens.items[i], "tokenizer.ggml.tokens");
    int64_t type = 1;
    if (types) {
      const auto& tv = types->items[i].v;
      if (const auto* x = std::get_if<int64_t>(&tv))
        type = *x;
      else if (const auto* u = std::get_if<uint64_t>(&tv))
        type = static_cast<int64_t>(*u);
    }
    if (type == 3 || type == 4)
      added.push_back({{"id", i},
                       {"content", tok},
                       {"single_word", false},
                       {"lstrip", false},
                       {"rstrip", false},
                       {"normalized", type == 4},
                       {"special", type == 3}});
    else if (type != 5)
      vocab[tok] = i;
  }
  json ms = json::array();
  for (const auto& m : merges.items) ms.push_back(str(m, "tokenizer.ggml.merges"));
  const json tj = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         json::array(
             {{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}})}}},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", vocab},
        {"merges", ms},
        {"ignore_merges", false},
        {"byte_fallback", false},
        {"fuse_unk", false},
        {"dropout", nullptr},
        {"unk_token", nullptr}}}};
  json cj = json::object();
  if (f.has("tokenizer.chat_template")) cj["chat_template"] = f.get_string("tokenizer.chat_template");
  auto token = [&](const char* key, const char* field) {
    if (!f.has(key)) return;
    const int64_t id = f.get_int(key);
    if (id < 0 || static_cast<size_t>(id) >= tokens.items.size())
      fail(f, std::string(key) + " " + std::to_string(id) + " is outside the vocabulary");
    cj[field] = str(tokens.items[static_cast<size_t>(id)], "tokenizer.ggml.tokens");
  };
  token("tokenizer.ggml.eos_token_id", "eos_token");
  token("tokenizer.ggml.bos_token_id", "bos_token");
  token("tokenizer.ggml.padding_token_id", "pad_token");
  return {tj.dump(), cj.dump()};
}

}  // namespace hypic
