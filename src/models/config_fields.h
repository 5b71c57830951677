// Internal to src/models: the config.json field reader shared by config.cpp and the architecture
// files that parse their own fields (nemotron_h.cpp, kimi_linear.cpp), so an architecture's
// parsing lives beside its layers.
#pragma once
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/config.h"

namespace hypic::config_detail {

using json = nlohmann::json;

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

  // Sizes and counts of a config are at most this (2^24: a 16M-token context or vocabulary), so that
  // the products the engine forms of them (per-layer state, weight shapes) cannot overflow.
  static constexpr int64_t kMaxSize = int64_t{1} << 24;
  int64_t positive(const std::string& field) const {
    const json& v = need(field);
    if (!v.is_number()) bad(field, "a positive integer", v);
    int64_t x = to_int(field, v);
    if (x <= 0) bad(field, "a positive integer", v);
    if (x > kMaxSize) bad(field, "a positive integer up to 16777216", v);
    return x;
  }
  int64_t positive_or(const std::string& field, int64_t dflt) const { return find(field) ? positive(field) : dflt; }
  int64_t non_negative_or(const std::string& field, int64_t dflt) const {
    const json* v = find(field);
    if (!v) return dflt;
    if (!v->is_number()) bad(field, "a non-negative integer", *v);
    int64_t x = to_int(field, *v);
    if (x < 0) bad(field, "a non-negative integer", *v);
    if (x > kMaxSize) bad(field, "a non-negative integer up to 16777216", *v);
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

DType parse_dtype(const Fields& f);
// Applies one RoPE parameter object (rope_parameters, or legacy rope_scaling) to cfg.
void apply_rope_object(const Fields& f, const std::string& field, const json& obj, ModelConfig& cfg);
std::vector<int64_t> int_list(const Fields& f, const std::string& field);
// The first of several spellings that is present (else the first).
std::string first_present(const Fields& f, std::initializer_list<const char*> names);
// DeepSeek-V3-style routed experts (Nemotron-H, Kimi-Linear): sigmoid scores, grouped top-k, scaling.
void parse_grouped_moe(const Fields& f, ModelConfig& cfg, std::initializer_list<const char*> experts,
                       std::initializer_list<const char*> per_tok, std::initializer_list<const char*> renorm,
                       std::initializer_list<const char*> group);

// Shared by the softmax-attention-with-RoPE architectures (config.cpp): sizes, norms, dtype,
// attention heads, head dim and RoPE; the linear/full schedule (layer_types or
// full_attention_interval); every dense layer's MLP width, then the special token ids.
void parse_attention_common(const Fields& f, ModelConfig& cfg);
void parse_layer_types(const Fields& f, ModelConfig& cfg);
void parse_mlp_widths_and_token_ids(const Fields& f, ModelConfig& cfg);

}  // namespace hypic::config_detail
