#include "models/gguf_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "backend/backend.h"
#include "io/gguf_writer.h"
#include "models/architectures.h"
#include "models/gguf_arch.h"
#include "tensor/quant.h"

namespace hypic {

namespace {

using json = nlohmann::json;

[[noreturn]] void fail(const GgufFile& f, const std::string& what) {
  throw std::runtime_error("gguf " + f.path() + ": " + what);
}

using gguf_detail::Source;

}  // namespace

// qwen35, qwen35moe, qwen3next: the file's tensor for a Hugging Face name.
std::optional<Source> gguf_detail::qwen_gguf_source(const ModelConfig& c_, const std::string& name) {
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
  // Value-head regrouping only exists when key heads are repeated over value heads, and only in
  // the qwen35 converters (qwen3next keeps each key head's value heads together, as Hugging Face).
  const bool regroup = c_.linear_num_key_heads != c_.linear_num_value_heads && c_.arch != Arch::Qwen3Next;
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
  if (c_.arch == Arch::Qwen3Next) {  // packed per key head in Hugging Face's checkpoints
    if (rest == "linear_attn.in_proj_qkvz.weight") {
      Source s{blk + "attn_qkv.weight", -1, Fix::Qkvz};
      s.second = blk + "attn_gate.weight";
      return s;
    }
    if (rest == "linear_attn.in_proj_ba.weight") return Source{blk + "ssm_ba.weight"};  // stored as is
    if (rest == "linear_attn.in_proj_qkv.weight" || rest == "linear_attn.in_proj_z.weight" ||
        rest == "linear_attn.in_proj_b.weight" || rest == "linear_attn.in_proj_a.weight")
      return std::nullopt;
  }
  if (rest == "linear_attn.in_proj_qkv.weight") return heads("attn_qkv.weight", 0, qk, dv);
  if (rest == "linear_attn.in_proj_z.weight") return heads("attn_gate.weight", 0, 0, dv);
  if (rest == "linear_attn.in_proj_b.weight") return heads("ssm_beta.weight", 0, 0, 1);
  if (rest == "linear_attn.in_proj_a.weight") return heads("ssm_alpha.weight", 0, 0, 1);
  if (rest == "linear_attn.A_log") return heads("ssm_a", 0, 0, 1, Fix::LogNeg);
  if (rest == "linear_attn.dt_bias") return heads("ssm_dt.bias", 0, 0, 1);
  if (rest == "linear_attn.conv1d.weight") return heads("ssm_conv1d.weight", 0, qk, dv);
  if (rest == "linear_attn.out_proj.weight") return heads("ssm_out.weight", 1, 0, dv);
  // mlp.experts.E.{gate,up,down}_proj.weight: expert E of the layer's stacked tensor.
  if (const auto e = gguf_detail::gguf_expert_of(rest, "mlp.experts.")) {
    const char* t = e->second == "gate_proj.weight"   ? "ffn_gate_exps.weight"
                    : e->second == "up_proj.weight"   ? "ffn_up_exps.weight"
                    : e->second == "down_proj.weight" ? "ffn_down_exps.weight"
                                                      : nullptr;
    if (!t) return std::nullopt;
    return Source{blk + t, e->first};
  }
  return std::nullopt;
}

namespace {

// The file's tensor for a Hugging Face name under config c, and what undoes the converter's change
// (the architecture's mapping, architectures.h).
std::optional<Source> resolve(const ModelConfig& c, const std::string& name) {
  const auto source = arch_spec(c.arch).gguf_source;
  if (!source) return std::nullopt;
  return source(c, name);
}

class GgufWeights : public WeightSource {
 public:
  GgufWeights(std::shared_ptr<const GgufFile> f, const ModelConfig& c) : f_(std::move(f)), c_(c) {}
  bool has(const std::string& name) const override {
    auto s = resolve(c_, name);
    return s && f_->find(s->tensor) && (s->second.empty() || f_->find(s->second));
  }
  Tensor get(const std::string& name, const Shape& expected) const override { return read(name, expected, nullptr); }
  Tensor get_with_col_order(const std::string& name, const Shape& expected,
                            std::vector<int64_t>& col_order) const override {
    col_order.clear();
    return read(name, expected, &col_order);
  }
  std::string describe() const override { return "gguf " + f_->path(); }

 private:
  // col_order: where not null, value heads along the columns that a block of the file's type
  // straddles stay in the file's order, and col_order says it (WeightSource::get_with_col_order).
  Tensor read(const std::string& name, const Shape& expected, std::vector<int64_t>* col_order) const;
  Tensor interleave_qkvz(const GgufFile& f, const Source& s, Tensor qkv) const;
  Tensor unpermute_rope_rows(const GgufFile& f, const Source& s, const Tensor& t) const;
  Tensor mla_kv_b(const GgufFile& f, const Source& s, const Tensor& kb) const;
  std::shared_ptr<const GgufFile> f_;
  ModelConfig c_;
};

// Hugging Face's in_proj_qkvz rows, per key head g: [q_g dk | k_g dk | v_g r*dv | z_g r*dv], from the
// converter's [q all | k all | v all] (qkv) and [z all] (the file's `second` tensor). Whole rows
// move, so quantized blocks stay as they are.
Tensor GgufWeights::interleave_qkvz(const GgufFile& f, const Source& s, Tensor qkv) const {
  const GgufTensorInfo* zi = f.find(s.second);
  if (!zi) fail(f, "missing tensor " + s.second + " (the z half of in_proj_qkvz)");
  Tensor z = f.get(s.second);
  if (qkv.dtype() != z.dtype()) qkv = qkv.to_f32(), z = z.to_f32();
  const int64_t nk = c_.linear_num_key_heads, dk = c_.linear_key_head_dim;
  const int64_t vg = c_.linear_num_value_heads / nk * c_.linear_value_head_dim;  // value rows per key head
  const int64_t H = c_.hidden_size;
  if (qkv.ndim() != 2 || z.ndim() != 2 || qkv.dim(1) != H || z.dim(1) != H || qkv.dim(0) != 2 * nk * dk + nk * vg ||
      z.dim(0) != nk * vg)
    fail(f, s.tensor + " " + shape_str(qkv.shape()) + " and " + s.second + " " + shape_str(z.shape()) +
                " do not make in_proj_qkvz of " + std::to_string(nk) + " key heads");
  Tensor out = Tensor::empty(qkv.dtype(), {nk * (2 * dk + 2 * vg), H});
  const size_t rb = dtype_bytes(qkv.dtype(), H);
  auto* o = static_cast<char*>(out.raw());
  auto rows = [&](const Tensor& src, int64_t r0, int64_t n) {
    std::memcpy(o, static_cast<const char*>(src.raw()) + r0 * rb, n * rb);
    o += n * rb;
  };
  for (int64_t g = 0; g < nk; ++g) {
    rows(qkv, g * dk, dk);
    rows(qkv, nk * dk + g * dk, dk);
    rows(qkv, 2 * nk * dk + g * vg, vg);
    rows(z, g * vg, vg);
  }
  return out;
}

// The converter's RoPE permutation of q / k rows (LlamaModel.permute: per head of hd rows, row
// 2i + j holds Hugging Face's row j * hd / 2 + i) undone. Whole rows move, so quantized blocks stay.
Tensor GgufWeights::unpermute_rope_rows(const GgufFile& f, const Source& s, const Tensor& t) const {
  const int64_t hd = s.hd;
  if (t.ndim() != 2 || hd <= 0 || hd % 2 != 0 || t.dim(0) % hd != 0)
    fail(f, "tensor " + s.tensor + " " + shape_str(t.shape()) + " is not rows of heads of " + std::to_string(hd));
  Tensor out = Tensor::empty(t.dtype(), t.shape());
  const size_t rb = dtype_bytes(t.dtype(), t.dim(1));
  const auto* in = static_cast<const char*>(t.raw());
  auto* o = static_cast<char*>(out.raw());
  for (int64_t h = 0; h < t.dim(0) / hd; ++h)
    for (int64_t i = 0; i < hd / 2; ++i)
      for (int64_t j = 0; j < 2; ++j)
        std::memcpy(o + (h * hd + j * hd / 2 + i) * rb, in + (h * hd + 2 * i + j) * rb, rb);
  return out;
}

// MLA's kv_b_proj [heads * 2 * D, rank] (per head: D key rows, then D value rows) from the
// converter's k_b [heads, rank, D] (each head transposed) and v_b [heads, D, rank]. In f32: the
// transpose crosses quantized rows.
Tensor GgufWeights::mla_kv_b(const GgufFile& f, const Source& s, const Tensor& kb_in) const {
  if (!f.find(s.second)) fail(f, "missing tensor " + s.second + " (the value half of kv_b_proj)");
  const Tensor kb = kb_in.to_f32(), vb = f.get(s.second).to_f32();
  const int64_t H = c_.num_attention_heads, D = c_.head_dim, r = c_.kv_lora_rank;
  if (kb.shape() != Shape{H, r, D} || vb.shape() != Shape{H, D, r})
    fail(f, s.tensor + " " + shape_str(kb.shape()) + " and " + s.second + " " + shape_str(vb.shape()) + " are not [" +
                std::to_string(H) + ", " + std::to_string(r) + ", " + std::to_string(D) + "] and [" +
                std::to_string(H) + ", " + std::to_string(D) + ", " + std::to_string(r) + "]");
  Tensor out = Tensor::empty(DType::F32, {H * 2 * D, r});
  const float *k = kb.data<float>(), *v = vb.data<float>();
  float* o = out.data<float>();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t j = 0; j < r; ++j) {
        o[(h * 2 * D + d) * r + j] = k[(h * r + j) * D + d];
        o[(h * 2 * D + D + d) * r + j] = v[(h * D + d) * r + j];
      }
  return out;
}

Tensor GgufWeights::read(const std::string& name, const Shape& expected, std::vector<int64_t>* col_order) const {
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

  if (s->fix == Source::Fix::Qkvz) t = interleave_qkvz(f, *s, t);
  if (s->fix == Source::Fix::RopeRows) t = unpermute_rope_rows(f, *s, t);
  if (s->fix == Source::Fix::MlaKvB) t = mla_kv_b(f, *s, t);
  if (s->expert >= 0) {
    const Shape sh = t.shape();
    if (sh.size() != 3 || s->expert >= sh[0])
      fail(f, "tensor " + s->tensor + " " + shape_str(sh) + " has no expert " + std::to_string(s->expert));
    t = t.reshape({sh[0] * sh[1], sh[2]}).slice_rows(s->expert * sh[1], (s->expert + 1) * sh[1]);
  }
  if (s->fix == Source::Fix::MinusOne || s->fix == Source::Fix::LogNeg) {
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
    // Quantized columns move in whole blocks only. Heads narrower than a block: where the caller
    // takes the columns in the file's order and they are the heads and nothing else, the blocks
    // stay as they are and col_order says which head each column block holds (stored p holds
    // head h = g * r + j); otherwise the tensor goes through f32 and its heads move.
    const bool straddled = s->axis == 1 && s->hd % dtype_block(t.dtype()) != 0;
    if (straddled && col_order && s->from == 0 && nv * s->hd == cols) {
      for (int64_t p = 0; p < nv; ++p) col_order->push_back(p % nk * r + p / nk);
    } else {
      if (straddled) t = t.to_f32();
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
  }
  if (t.shape() != expected) {
    // conv1d is stored without its middle axis of one (or with more), vectors as [n, 1]; nothing
    // else may differ, except where the converter regrouped the values (s->reshape).
    auto squeeze = [](Shape x) {
      Shape o;
      for (int64_t d : x)
        if (d != 1) o.push_back(d);
      return o;
    };
    if (t.numel() != shape_numel(expected) || (!s->reshape && squeeze(t.shape()) != squeeze(expected)))
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

namespace gguf_detail {

std::optional<std::pair<int64_t, std::string>> gguf_expert_of(const std::string& rest, const std::string& prefix) {
  if (rest.rfind(prefix, 0) != 0) return std::nullopt;
  const size_t d = rest.find('.', prefix.size());
  if (d == std::string::npos) return std::nullopt;
  const std::string e = rest.substr(prefix.size(), d - prefix.size());
  if (e.empty() || e.size() > 9 || e.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::make_pair(static_cast<int64_t>(std::stoll(e)), rest.substr(d + 1));
}

std::optional<std::pair<std::string, std::string>> gguf_layer_of(const std::string& name, const std::string& prefix) {
  const std::string L = prefix + "layers.";
  if (name.rfind(L, 0) != 0) return std::nullopt;
  const size_t dot = name.find('.', L.size());
  if (dot == std::string::npos) return std::nullopt;
  const std::string idx = name.substr(L.size(), dot - L.size());
  if (idx.empty() || idx.size() > 9 || idx.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::make_pair("blk." + idx + ".", name.substr(dot + 1));
}

void GgufKeys::fail(const std::string& what) const {
  throw std::runtime_error("gguf " + f_.path() + ": " + what);
}
int64_t GgufKeys::positive(const std::string& k) const {
  const int64_t v = f_.get_int(key(k));
  if (v <= 0) fail(key(k) + " must be positive, is " + std::to_string(v));
  return v;
}
int64_t GgufKeys::count_or(const std::string& k, int64_t dflt) const {
  if (!has(k)) return dflt;
  const int64_t v = f_.get_int(key(k));
  if (v < 0) fail(key(k) + " must not be negative, is " + std::to_string(v));
  return v;
}
double GgufKeys::number(const std::string& k) const {
  const double v = f_.get_float(key(k));
  if (!std::isfinite(v)) fail(key(k) + " is not a finite number");
  return v;
}
double GgufKeys::number_or(const std::string& k, double dflt) const {
  return has(k) ? number(k) : dflt;
}
bool GgufKeys::flag_or(const std::string& k, bool dflt) const {
  if (!has(k)) return dflt;
  if (const auto* b = std::get_if<bool>(&f_.metadata().at(key(k)).v)) return *b;
  fail(key(k) + " is not a bool");
}
std::vector<int64_t> GgufKeys::per_layer(const std::string& k, int64_t n) const {
  const GgufValue& v = [&]() -> const GgufValue& {
    const auto it = f_.metadata().find(key(k));
    if (it == f_.metadata().end()) fail("missing key " + key(k));
    return it->second;
  }();
  auto as_count = [&](const GgufValue& x) {
    int64_t i = -1;
    if (const auto* u = std::get_if<uint64_t>(&x.v))
      i = *u > (uint64_t{1} << 40) ? -1 : static_cast<int64_t>(*u);
    else if (const auto* s = std::get_if<int64_t>(&x.v))
      i = *s;
    else
      fail(key(k) + " holds a value that is not an integer");
    if (i < 0) fail(key(k) + " holds a negative or oversized count");
    return i;
  };
  if (const auto* arr = std::get_if<GgufArray>(&v.v)) {
    if (static_cast<int64_t>(arr->items.size()) != n)
      fail(key(k) + " has " + std::to_string(arr->items.size()) + " entries for " + std::to_string(n) + " layers");
    std::vector<int64_t> out;
    for (const auto& x : arr->items) out.push_back(as_count(x));
    return out;
  }
  return std::vector<int64_t>(static_cast<size_t>(n), as_count(v));
}
int64_t GgufKeys::shared_nonzero(const std::string& k, const std::vector<int64_t>& v) const {
  int64_t one = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] == 0) continue;
    if (one != 0 && v[i] != one)
      fail(key(k) + " differs between layers (" + std::to_string(one) + ", then " + std::to_string(v[i]) +
           " at layer " + std::to_string(i) + "): hypic runs one width per model");
    one = v[i];
  }
  return one;
}

}  // namespace gguf_detail

// qwen35, qwen35moe, qwen3next: Gated DeltaNet with full attention every n-th layer.
void gguf_detail::qwen_gguf_config(const gguf_detail::GgufKeys& k, ModelConfig& c) {
  const GgufFile& f = k.file();
  const std::string& a = k.arch();
  auto positive = [&](const std::string& key) { return k.positive(key); };
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
    c.layer_types.push_back((i + 1) % every == 0 ? LayerKind::Attention : LayerKind::Linear);
  if (c.arch == Arch::Qwen3_5Moe || c.arch == Arch::Qwen3Next) {
    c.num_experts = positive("expert_count");
    c.num_experts_per_tok = positive("expert_used_count");
    c.moe_intermediate_size = positive("expert_feed_forward_length");
    if (f.has(a + ".expert_shared_feed_forward_length"))
      c.shared_expert_intermediate_size = positive("expert_shared_feed_forward_length");
    c.norm_topk_prob = true;  // both renormalise their top-k; the converter writes no key for it
    // llama.cpp's qwen3next has a sparse MLP in every layer (no mlp_only_layers, no sparse step).
    c.decoder_sparse_step = 1;
    if (c.arch == Arch::Qwen3Next && f.has(a + ".feed_forward_length"))
      c.intermediate_size = positive("feed_forward_length");
  } else {
    c.intermediate_size = positive("feed_forward_length");
  }
}

ModelConfig gguf_model_config(const GgufFile& f) {
  const std::string a = f.get_string("general.architecture");
  ModelConfig c;
  const ArchSpec* spec = nullptr;
  std::string known;
  for (const ArchSpec& s : arch_specs())
    for (const char* g : s.gguf) {
      if (!g) continue;
      known += (known.empty() ? "" : ", ") + std::string(g);
      if (a == g) spec = &s;
    }
  if (!spec) fail(f, "architecture '" + a + "' is not one hypic runs from GGUF (" + known + ")");
  c.arch = spec->arch;
  c.architecture = spec->hf[0].architecture;
  const gguf_detail::GgufKeys k(f, a);
  c.hidden_size = k.positive("embedding_length");
  c.num_hidden_layers = k.positive("block_count");
  // Every block has tensors of its own, so a count beyond the tensor table is damage, not a model.
  if (c.num_hidden_layers > kMaxLayers || c.num_hidden_layers > static_cast<int64_t>(f.tensors().size()))
    fail(f, a + ".block_count " + std::to_string(c.num_hidden_layers) + " exceeds the " +
                std::to_string(f.tensors().size()) + " tensors of the file or the bound of " +
                std::to_string(kMaxLayers) + " layers");
  c.max_position_embeddings = k.positive("context_length");
  spec->gguf_config(k, c);
  const GgufTensorInfo* emb = f.find("token_embd.weight");
  if (!emb) fail(f, "missing tensor token_embd.weight");
  const Shape es = emb->shape();
  if (es.size() != 2 || es[1] != c.hidden_size)
    fail(f, "token_embd.weight is " + shape_str(es) + ", expected [vocab, " + std::to_string(c.hidden_size) + "]");
  c.vocab_size = es[0];
  c.tie_word_embeddings = f.find("output.weight") == nullptr;
  const std::optional<DType> ed = dtype_of_ggml(emb->type->id);
  c.dtype = ed && (*ed == DType::BF16 || *ed == DType::F16) ? *ed : DType::F32;
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

// ---- writing (hypic quantize) -------------------------------------------------------------

namespace {

// Records the names and shapes a model asks its weight source for (the tensors a checkpoint of
// this config holds), returning each tensor from the inner source.
class RecordingSource : public WeightSource {
 public:
  explicit RecordingSource(const WeightSource& inner) : inner_(inner) {}
  bool has(const std::string& name) const override { return inner_.has(name); }
  Tensor get(const std::string& name, const Shape& expected) const override {
    names_.emplace_back(name, expected);
    return inner_.get(name, expected);
  }
  std::string describe() const override { return inner_.describe(); }
  std::vector<std::pair<std::string, Shape>> names() const { return names_; }

 private:
  const WeightSource& inner_;
  mutable std::vector<std::pair<std::string, Shape>> names_;
};

// tokenizer.json / tokenizer_config.json texts as tokenizer.ggml.* metadata (the inverse of
// gguf_tokenizer_texts).
void write_tokenizer(GgufWriter& w, const TokenizerTexts& t, int64_t vocab_size, const std::string& path) {
  auto bad = [&](const std::string& what) -> void {
    throw std::runtime_error("gguf " + path + ": tokenizer: " + what);
  };
  json tj, cj;
  try {
    tj = json::parse(t.tokenizer_json);
    cj = t.config_json.empty() ? json::object() : json::parse(t.config_json);
  } catch (const std::exception& e) {
    bad(std::string("not valid JSON: ") + e.what());
  }
  const json& model = tj.value("model", json::object());
  if (model.value("type", "") != "BPE") bad("model type '" + model.value("type", "") + "' is not BPE");
  // The pre-tokenizer's Split regex names llama.cpp's pre-tokenizer.
  std::string pre;
  const json& pt = tj.value("pre_tokenizer", json::object());
  for (const auto& p : pt.value("pretokenizers", json::array()))
    if (p.value("type", "") == "Split" && p.contains("pattern") && p["pattern"].contains("Regex")) {
      const std::string rx = p["pattern"]["Regex"].get<std::string>();
      for (const char* name : {"qwen35", "qwen2"})
        if (rx == pre_tokenizer_regex(name)) pre = name;
    }
  if (pre.empty()) bad("the pre-tokenizer's split pattern is not qwen2's or qwen35's");
  std::vector<std::string> tokens(static_cast<size_t>(vocab_size));
  std::vector<int32_t> types(static_cast<size_t>(vocab_size), 0);
  std::map<std::string, int64_t> ids;
  const json vocab = model.value("vocab", json::object());
  for (const auto& [tok, id] : vocab.items()) {
    const int64_t i = id.get<int64_t>();
    if (i < 0 || i >= vocab_size) bad("token '" + tok + "' has id " + std::to_string(i) + " outside the vocabulary");
    tokens[static_cast<size_t>(i)] = tok, types[static_cast<size_t>(i)] = 1, ids[tok] = i;
  }
  for (const auto& a : tj.value("added_tokens", json::array())) {
    const int64_t i = a.value("id", int64_t{-1});
    const std::string tok = a.value("content", "");
    if (i < 0 || i >= vocab_size)
      bad("added token '" + tok + "' has id " + std::to_string(i) + " outside the vocabulary");
    // Control when special or when it looks special (<|...|>), as the converter decides.
    const bool looks = tok.size() >= 4 && tok.rfind("<|", 0) == 0 && tok.ends_with("|>");
    tokens[static_cast<size_t>(i)] = tok, types[static_cast<size_t>(i)] = a.value("special", false) || looks ? 3 : 4;
    ids[tok] = i;
  }
  // Ids no token names (an embedding padded past the tokenizer): unused, as the converter writes.
  for (size_t i = 0; i < tokens.size(); ++i)
    if (types[i] == 0) tokens[i] = "[PAD" + std::to_string(i) + "]", types[i] = 5;
  std::vector<std::string> merges;
  for (const auto& m : model.value("merges", json::array())) {
    if (m.is_string())
      merges.push_back(m.get<std::string>());
    else if (m.is_array() && m.size() == 2)
      merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
    else
      bad("a merge that is neither \"a b\" nor [a, b]");
  }
  w.set_string("tokenizer.ggml.model", "gpt2");
  w.set_string("tokenizer.ggml.pre", pre);
  w.set_strings("tokenizer.ggml.tokens", tokens);
  w.set_i32s("tokenizer.ggml.token_type", types);
  w.set_strings("tokenizer.ggml.merges", merges);
  auto special = [&](const char* field, const char* key) {
    if (!cj.contains(field) || cj[field].is_null()) return;
    const json& v = cj[field];
    const std::string tok = v.is_string() ? v.get<std::string>() : v.value("content", "");
    const auto it = ids.find(tok);
    if (it == ids.end()) bad(std::string(field) + " '" + tok + "' is not in the vocabulary");
    w.set_u32(key, static_cast<uint32_t>(it->second));
  };
  special("eos_token", "tokenizer.ggml.eos_token_id");
  special("bos_token", "tokenizer.ggml.bos_token_id");
  special("pad_token", "tokenizer.ggml.padding_token_id");
  // As gguf-py's SpecialVocab reads it: tokenizer_config.json's add_bos_token (llama.cpp then adds BOS).
  w.set_bool("tokenizer.ggml.add_bos_token",
             cj.contains("add_bos_token") && cj["add_bos_token"].is_boolean() && cj["add_bos_token"].get<bool>());
  if (cj.contains("chat_template") && cj["chat_template"].is_string())
    w.set_string("tokenizer.chat_template", cj["chat_template"].get<std::string>());
}

// IEEE half, round to nearest even (the fallback type of llama.cpp's converter for rows that are
// not whole quantization blocks).
uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past the largest half
  if (abs < 0x38800000u) {  // subnormal half (or zero): scale by 2^24 and round to an integer
    const float m = std::fabs(f) * 16777216.0f;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(m)));
  }
  const uint32_t e = ((abs >> 23) - 112) << 10, mant = abs & 0x7fffffu;
  uint32_t h = e | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: still right
  return static_cast<uint16_t>(sign | h);
}

Tensor as_f32(const Tensor& t) {
  return t.dtype() == DType::F32 ? t.clone() : t.to_f32();
}

// f32 values in the file's type for a matrix: bf16, or quantized row by row.
Tensor encode(const Tensor& f, DType to) {
  Tensor out = Tensor::empty(to, f.shape());
  const int64_t n = f.numel();
  const float* p = f.data<float>();
  if (to == DType::F32) {
    std::memcpy(out.raw(), p, static_cast<size_t>(n) * sizeof(float));
  } else if (to == DType::BF16 || to == DType::F16) {
    auto* q = out.data<uint16_t>();
    for (int64_t i = 0; i < n; ++i) q[i] = to == DType::BF16 ? f32_to_bf16(p[i]) : f32_to_f16(p[i]);
  } else {
    const int64_t cols = f.shape().back(), rows = n / cols;
    const size_t rb = dtype_bytes(to, cols);
    for (int64_t r = 0; r < rows; ++r)
      quant::quantize(to, p + r * cols, cols, static_cast<char*>(out.raw()) + static_cast<size_t>(r) * rb);
  }
  return out;
}

// Hugging Face's in_proj_qkvz (per key head g: [q_g | k_g | v_g | z_g]) as the converter's q|k|v
// and z halves (the reader's interleave_qkvz undone), in f32.
std::pair<Tensor, Tensor> split_qkvz(const ModelConfig& c, const Tensor& f) {
  const int64_t nk = c.linear_num_key_heads, dk = c.linear_key_head_dim;
  const int64_t vg = c.linear_num_value_heads / nk * c.linear_value_head_dim, H = f.dim(1);
  Tensor qkv = Tensor::empty(DType::F32, {nk * (2 * dk + vg), H}), z = Tensor::empty(DType::F32, {nk * vg, H});
  const float* in = f.data<float>();
  auto rows = [&](Tensor& dst, int64_t d0, int64_t s0, int64_t n) {
    std::memcpy(dst.data<float>() + d0 * H, in + s0 * H, static_cast<size_t>(n * H) * sizeof(float));
  };
  for (int64_t g = 0; g < nk; ++g) {
    const int64_t src = g * (2 * dk + 2 * vg);
    rows(qkv, g * dk, src, dk);
    rows(qkv, nk * dk + g * dk, src + dk, dk);
    rows(qkv, 2 * nk * dk + g * vg, src + 2 * dk, vg);
    rows(z, g * vg, src + 2 * dk + vg, vg);
  }
  return {qkv, z};
}

// The converter's RoPE row permutation (LlamaModel.permute) applied: per head of hd rows, row
// 2i + j holds Hugging Face's row j * hd / 2 + i (the reader's unpermute_rope_rows undone).
Tensor permute_rope_rows(const Tensor& f, int64_t hd) {
  Tensor out = Tensor::empty(DType::F32, f.shape());
  const int64_t cols = f.dim(1);
  for (int64_t h = 0; h < f.dim(0) / hd; ++h)
    for (int64_t i = 0; i < hd / 2; ++i)
      for (int64_t j = 0; j < 2; ++j)
        std::memcpy(out.data<float>() + (h * hd + 2 * i + j) * cols, f.data<float>() + (h * hd + j * hd / 2 + i) * cols,
                    static_cast<size_t>(cols) * sizeof(float));
  return out;
}

}  // namespace

void gguf_detail::GgufKeyWriter::fail(const std::string& what) const {
  throw std::runtime_error("gguf " + path_ + ": " + what);
}
void gguf_detail::GgufKeyWriter::u32(const std::string& k, int64_t v) {
  if (v < 0 || v > int64_t{0xffffffff}) fail(key(k) + " " + std::to_string(v) + " does not fit a u32");
  g_.set_u32(key(k), static_cast<uint32_t>(v));
}
void gguf_detail::GgufKeyWriter::f32(const std::string& k, double v) {
  g_.set_f32(key(k), static_cast<float>(v));
}
void gguf_detail::GgufKeyWriter::flag(const std::string& k, bool v) {
  g_.set_bool(key(k), v);
}
void gguf_detail::GgufKeyWriter::i32s(const std::string& k, const std::vector<int64_t>& v) {
  std::vector<int32_t> out;
  for (int64_t x : v) {
    if (x < 0 || x > int64_t{0x7fffffff}) fail(key(k) + " holds " + std::to_string(x) + ", outside an i32");
    out.push_back(static_cast<int32_t>(x));
  }
  g_.set_i32s(key(k), out);
}

// The inverse of qwen_gguf_config, as llama.cpp's qwen35 / qwen35moe / qwen3next converters write it.
void gguf_detail::qwen_gguf_write_config(const ModelConfig& cfg, GgufKeyWriter& k) {
  // Full attention every n-th layer is all the files' full_attention_interval can say.
  int64_t every = 0;
  for (size_t i = 0; i < cfg.layer_types.size(); ++i)
    if (cfg.layer_types[i] == LayerKind::Attention) {
      every = static_cast<int64_t>(i) + 1;
      break;
    }
  if (every == 0) k.fail("a model without full-attention layers cannot be written as " + k.arch());
  for (size_t i = 0; i < cfg.layer_types.size(); ++i)
    if ((cfg.layer_types[i] == LayerKind::Attention) != ((static_cast<int64_t>(i) + 1) % every == 0))
      k.fail("layer " + std::to_string(i) + " breaks the every-" + std::to_string(every) +
             "th full-attention pattern that " + k.arch() + "'s full_attention_interval describes");
  if (cfg.num_experts > 0) {
    // The reader (as llama.cpp's loader) puts experts in every layer: a dense one would be misread.
    for (int64_t i = 0; i < cfg.num_hidden_layers; ++i)
      if (!cfg.layer_is_moe(i))
        k.fail("layer " + std::to_string(i) + " has a dense MLP: llama.cpp's " + k.arch() +
               " has experts in every layer (decoder_sparse_step 1, no mlp_only_layers)");
    k.u32("expert_count", cfg.num_experts);
    k.u32("expert_used_count", cfg.num_experts_per_tok);
    k.u32("expert_feed_forward_length", cfg.moe_intermediate_size);
    if (cfg.shared_expert_intermediate_size > 0)
      k.u32("expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size);
  }
  if (cfg.intermediate_size > 0) k.u32("feed_forward_length", cfg.intermediate_size);
  k.u32("attention.head_count", cfg.num_attention_heads);
  k.u32("attention.head_count_kv", cfg.num_key_value_heads);
  k.u32("attention.key_length", cfg.head_dim);
  k.u32("attention.value_length", cfg.head_dim);
  k.f32("attention.layer_norm_rms_epsilon", cfg.rms_norm_eps);
  k.f32("rope.freq_base", cfg.rope_theta);
  k.u32("rope.dimension_count", cfg.rotary_dim());
  // Multimodal RoPE sections (llama.cpp's qwen35 requires the key): text positions are the same in
  // every section, so any split is plain RoPE; Qwen3.5's configs all say [11, 11, 10] and the
  // converter pads it to four. Qwen3-Next has plain RoPE and no such key.
  if (cfg.arch != Arch::Qwen3Next) k.i32s("rope.dimension_sections", {11, 11, 10, 0});
  k.u32("ssm.conv_kernel", cfg.linear_conv_kernel_dim);
  k.u32("ssm.state_size", cfg.linear_key_head_dim);
  k.u32("ssm.group_count", cfg.linear_num_key_heads);
  k.u32("ssm.time_step_rank", cfg.linear_num_value_heads);
  k.u32("ssm.inner_size", cfg.linear_num_value_heads * cfg.linear_value_head_dim);
  k.u32("full_attention_interval", every);
}

void write_gguf_checkpoint(const ModelConfig& cfg, const WeightSource& w, const TokenizerTexts* tokenizer, DType type,
                           const std::string& path, bool q4_k_m) {
  if (q4_k_m && type != DType::Q4_K) throw std::invalid_argument("the Q4_K_M mix needs matrices of type q4_k");
  // llama-quantize's Q4_K_M: the value projections (attn_v, and attn_qkv where the linear layers
  // fuse it) and the down projections of the first and last eighth of the layers and of every
  // third layer between them take Q6_K (its use_more_bits).
  const int64_t nl = cfg.num_hidden_layers;
  auto more_bits = [&](const std::string& t) {
    if (t.rfind("blk.", 0) != 0) return false;
    const size_t dot = t.find('.', 4);
    const int64_t i = std::stoll(t.substr(4, dot - 4));
    const std::string what = t.substr(dot + 1);
    const bool v = what == "attn_v.weight" || what == "attn_qkv.weight", down = what.rfind("ffn_down", 0) == 0;
    return (v || down) && (i < nl / 8 || i >= 7 * nl / 8 || (i - nl / 8) % 3 == 2);
  };
  auto bad = [&](const std::string& what) -> void { throw std::runtime_error("gguf " + path + ": " + what); };
  if (!(type == DType::F32 || type == DType::BF16 || dtype_is_quantized(type)))
    bad(std::string("cannot write matrices as ") + dtype_name(type) + " (f32, bf16, q8_0, q4_k or q6_k)");
  const ArchSpec& spec = arch_spec(cfg.arch);
  if (!spec.gguf_write_config || !spec.gguf[0]) {
    std::string can;
    for (const ArchSpec& s : arch_specs())
      if (s.gguf_write_config) can += std::string(can.empty() ? "" : ", ") + s.name;
    bad("architecture " + cfg.architecture + " is not written as GGUF here (" + can + ")");
  }
  // The second name is the architecture's MoE form (nemotron_h_moe).
  const std::string a = spec.gguf[1] && cfg.num_experts > 0 ? spec.gguf[1] : spec.gguf[0];

  GgufWriter g;
  g.set_string("general.architecture", a);
  g.set_string("general.type", "model");
  g.set_u32("general.quantization_version", 2);
  gguf_detail::GgufKeyWriter k(g, a, path);
  k.u32("block_count", cfg.num_hidden_layers);
  k.u32("context_length", cfg.max_position_embeddings);
  k.u32("embedding_length", cfg.hidden_size);
  spec.gguf_write_config(cfg, k);
  if (tokenizer) write_tokenizer(g, *tokenizer, cfg.vocab_size, path);

  // The tensors the model loads, in its order.
  auto cpu = make_backend("cpu", 1);
  RecordingSource rec(w);
  { Model probe(cfg, rec, *cpu); }
  // Stacked experts: gathered per file tensor in f32 and encoded as soon as the last one has come
  // (a layer at a time: a large MoE never holds all its experts in f32).
  struct Stack {
    std::vector<Tensor> experts;
    int64_t have = 0;
  };
  std::map<std::string, Stack> stacks;
  std::vector<std::string> order;
  std::map<std::string, Tensor> out;
  for (const auto& [name, shape] : rec.names()) {
    const auto s = resolve(cfg, name);
    if (!s) bad("no GGUF tensor corresponds to " + name);
    Tensor f = as_f32(w.get(name, shape));
    // The file's type, chosen on the model's tensor: f32 for vectors, conv1d and routers (as
    // llama.cpp's converter writes them); the chosen type for matrices, a Q4_K token embedding at
    // Q6_K; below, f16 where rows are not whole blocks (as the converter falls back).
    const bool router = name.ends_with(".gate.weight") || name.ends_with("shared_expert_gate.weight");
    const bool conv = name.ends_with("conv1d.weight");
    const bool embedding =
        name.ends_with("embed_tokens.weight") || name.ends_with("embeddings.weight") || name == "lm_head.weight";
    DType to = type == DType::Q4_K && embedding ? DType::Q6_K : type;
    if (f.ndim() != 2 || router || conv) to = DType::F32;

    if (s->fix == Source::Fix::MinusOne || s->fix == Source::Fix::LogNeg) {
      float* p = f.data<float>();
      for (int64_t i = 0; i < f.numel(); ++i) p[i] = s->fix == Source::Fix::MinusOne ? p[i] + 1.0f : -std::exp(p[i]);
    }
    if (s->fix == Source::Fix::RopeRows) {
      if (f.ndim() != 2 || s->hd <= 0 || s->hd % 2 != 0 || f.dim(0) % s->hd != 0)
        bad(name + " " + shape_str(f.shape()) + " is not rows of heads of " + std::to_string(s->hd));
      f = permute_rope_rows(f, s->hd);
    }
    if (s->fix == Source::Fix::MlaKvB) bad(name + ": MLA's kv_b_proj is not written as GGUF here");
    if (s->axis >= 0) {
      // Hugging Face value head h = g * r + j is stored as p = j * nk + g (the reader's inverse).
      const int64_t nk = cfg.linear_num_key_heads, nv = cfg.linear_num_value_heads, r = nv / nk;
      const int64_t rows = f.shape().empty() ? 1 : f.dim(0), cols = f.numel() / std::max<int64_t>(rows, 1);
      const Tensor src = f.clone();
      const float* in = src.data<float>();
      float* o = f.data<float>();
      for (int64_t h = 0; h < nv; ++h) {
        const int64_t gk = h / r, j = h % r, pp = j * nk + gk;
        const int64_t src0 = s->from + h * s->hd, dst0 = s->from + pp * s->hd;
        if (s->axis == 0)
          std::memcpy(o + dst0 * cols, in + src0 * cols, static_cast<size_t>(s->hd * cols) * sizeof(float));
        else
          for (int64_t row = 0; row < rows; ++row)
            std::memcpy(o + row * cols + dst0, in + row * cols + src0, static_cast<size_t>(s->hd) * sizeof(float));
      }
    }
    // The file's tensors from this one: two for Qwen3-Next's in_proj_qkvz, else one.
    std::vector<std::pair<std::string, Tensor>> parts;
    if (s->fix == Source::Fix::Qkvz) {
      if (f.ndim() != 2) bad(name + " " + shape_str(f.shape()) + " is not a matrix");
      auto [qkv, z] = split_qkvz(cfg, f);
      parts = {{s->tensor, qkv}, {s->second, z}};
    } else {
      // conv1d [C, 1, K] is stored [C, K]; other shapes as the architecture's Source says.
      if (conv && f.ndim() == 3) f = f.reshape({f.dim(0), f.dim(2)});
      if (!s->stored.empty()) {
        if (shape_numel(s->stored) != f.numel())
          bad(name + " " + shape_str(f.shape()) + " cannot be stored as " + shape_str(s->stored));
        f = f.reshape(s->stored);
      }
      parts = {{s->tensor, f}};
    }
    for (auto& [tensor, t] : parts) {
      DType tt = to;
      if (q4_k_m && tt != DType::F32 && more_bits(tensor)) tt = DType::Q6_K;
      if (dtype_is_quantized(tt) && t.shape().back() % dtype_block(tt) != 0) tt = DType::F16;
      if (s->expert >= 0) {
        Stack& st = stacks[tensor];
        if (st.experts.empty()) order.push_back(tensor), st.experts.resize(static_cast<size_t>(cfg.num_experts));
        if (s->expert >= cfg.num_experts || st.experts[static_cast<size_t>(s->expert)].defined())
          bad("expert " + std::to_string(s->expert) + " of " + tensor + " is out of range or repeated");
        st.experts[static_cast<size_t>(s->expert)] = t;
        if (++st.have < cfg.num_experts) continue;
        const Shape es = st.experts[0].shape();
        Tensor all = Tensor::empty(DType::F32, {cfg.num_experts, es[0], es[1]});
        for (size_t e = 0; e < st.experts.size(); ++e) {
          if (st.experts[e].shape() != es) bad("the experts of " + tensor + " differ in shape");
          std::memcpy(all.data<float>() + static_cast<int64_t>(e) * es[0] * es[1], st.experts[e].data<float>(),
                      static_cast<size_t>(es[0] * es[1]) * sizeof(float));
        }
        out[tensor] = encode(all, tt);
        stacks.erase(tensor);
        continue;
      }
      order.push_back(tensor);
      out[tensor] = encode(t, tt);
    }
  }
  if (!stacks.empty()) bad("the experts of " + stacks.begin()->first + " are incomplete");
  for (const auto& t : order) g.add_tensor(t, out.at(t));
  g.write(path);
}

}  // namespace hypic
