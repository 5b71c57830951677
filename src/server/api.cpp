#include "server/api.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>

#include "pic/requests.h"
#include "tokenizer/tokenizer.h"

#if defined(HYPIC_HAVE_CHAT_TEMPLATE) && __has_include("tokenizer/chat_template.h")
#include "tokenizer/chat_template.h"
#define HYPIC_SERVER_CHAT 1
#endif

namespace hypic::server {

using nlohmann::json;

std::string error_type_for(int status) {
  switch (status) {
    case 401:
      return "authentication_error";
    case 404:
      return "not_found_error";
    case 405:
      return "invalid_request_error";
    case 413:
      return "invalid_request_error";
    case 429:
      return "rate_limit_error";
    default:
      return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

json error_body(int status, const std::string& message, const std::string& type, const std::string& param,
                const std::string& code) {
  json e{{"message", message}, {"type", type.empty() ? error_type_for(status) : type}};
  e["param"] = param.empty() ? json(nullptr) : json(param);
  e["code"] = code.empty() ? json(nullptr) : json(code);
  return json{{"error", e}};
}

json error_body(const ApiError& e) {
  return error_body(e.status, e.what(), e.type, e.param, e.code);
}

std::string log_safe(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\\') {
      out += "\\\\";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, v);
  return buf;
}

void check_json_depth(const std::string& body, int max_depth) {
  int depth = 0;
  bool in_str = false, esc = false;
  for (char c : body) {
    if (in_str) {
      if (esc)
        esc = false;
      else if (c == '\\')
        esc = true;
      else if (c == '"')
        in_str = false;
      continue;
    }
    if (c == '"') {
      in_str = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth)
        throw ApiError(400, "JSON nesting deeper than " + std::to_string(max_depth) + " levels",
                       "invalid_request_error", "", "json_too_deep");
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
}

json parse_body(const std::string& body, int max_depth) {
  if (body.empty()) throw ApiError(400, "the request body is empty; expected a JSON object");
  check_json_depth(body, max_depth);
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {
    throw ApiError(400, std::string("malformed JSON body: ") + e.what(), "invalid_request_error", "", "invalid_json");
  }
  if (!j.is_object()) throw ApiError(400, "the request body must be a JSON object");
  return j;
}

namespace {

[[noreturn]] void bad(const std::string& param, const std::string& msg) {
  throw ApiError(400, msg, "invalid_request_error", param, "invalid_value");
}

// Present and not null.
bool has(const json& b, const char* k) {
  return b.contains(k) && !b[k].is_null();
}

int64_t get_int(const json& b, const char* k, int64_t lo, int64_t hi) {
  const json& v = b[k];
  if (!v.is_number_integer()) {
    // Accept integral floats such as 5.0 (some clients send them).
    if (v.is_number_float() && std::isfinite(v.get<double>()) && std::floor(v.get<double>()) == v.get<double>() &&
        std::fabs(v.get<double>()) < 9e15) {
      const auto x = static_cast<int64_t>(v.get<double>());
      if (x < lo || x > hi)
        bad(k, std::string("'") + k + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi));
      return x;
    }
    bad(k, std::string("'") + k + "' must be an integer, got " + std::string(v.type_name()));
  }
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
    bad(k, std::string("'") + k + "' is out of range");
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi)
    bad(k, std::string("'") + k + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " +
               std::to_string(x));
  return x;
}

double get_num(const json& b, const char* k) {
  const json& v = b[k];
  if (!v.is_number()) bad(k, std::string("'") + k + "' must be a number, got " + std::string(v.type_name()));
  return v.get<double>();
}

bool get_bool(const json& b, const char* k) {
  const json& v = b[k];
  if (!v.is_boolean()) bad(k, std::string("'") + k + "' must be a boolean, got " + std::string(v.type_name()));
  return v.get<bool>();
}

std::vector<int32_t> get_ids(const json& arr, const std::string& param, const ModelFacts& m) {
  std::vector<int32_t> ids;
  ids.reserve(arr.size());
  for (const auto& v : arr) {
    if (!v.is_number_integer()) bad(param, "'" + param + "' must hold integer token ids");
    const int64_t x =
        v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX) ? -1 : v.get<int64_t>();
    if (x < 0 || (m.vocab > 0 && x >= m.vocab))
      bad(param, "token id " + v.dump() + " is outside the vocabulary (0.." + std::to_string(m.vocab - 1) + ")");
    ids.push_back(static_cast<int32_t>(x));
  }
  return ids;
}

void check_model(const json& b, const ModelFacts& m) {
  if (!b.contains("model") || b["model"].is_null()) return;
  if (!b["model"].is_string()) bad("model", "'model' must be a string");
  const std::string name = b["model"].get<std::string>();
  if (name != m.name)
    throw ApiError(404, "the model '" + name + "' does not exist; this server serves '" + m.name + "'",
                   "invalid_request_error", "model", "model_not_found");
}

std::vector<std::vector<int32_t>> tokenize_text_segments(const std::string& prompt, const ModelFacts& m,
                                                         const char* param) {
  if (!m.tok) bad(param, "the model has no tokenizer; send token ids instead of text");
  std::vector<std::vector<int32_t>> segs;
  for (auto& s : split_prompt(prompt)) {
    if (s.text.empty()) continue;
    auto ids = m.tok->encode(s.text);
    if (!ids.empty()) segs.push_back(std::move(ids));
  }
  return segs;
}

// Fields shared by both endpoints.
void parse_common(const json& b, const ModelFacts& m, GenSpec& g, bool chat) {
  check_model(b, m);
  if (has(b, "n") && get_int(b, "n", INT64_MIN, INT64_MAX) != 1) bad("n", "only n = 1 is supported");
  if (has(b, "best_of") && get_int(b, "best_of", INT64_MIN, INT64_MAX) != 1)
    bad("best_of", "only best_of = 1 is supported");
  for (const char* k : {"presence_penalty", "frequency_penalty"})
    if (has(b, k) && get_num(b, k) != 0.0) bad(k, std::string("'") + k + "' is not supported (only 0)");
  if (has(b, "logit_bias")) {
    if (!b["logit_bias"].is_object()) bad("logit_bias", "'logit_bias' must be an object");
    if (!b["logit_bias"].empty()) bad("logit_bias", "'logit_bias' is not supported");
  }
  if (has(b, "max_completion_tokens"))
    g.max_tokens = static_cast<int>(get_int(b, "max_completion_tokens", 0, INT32_MAX));
  else if (has(b, "max_tokens"))
    g.max_tokens = static_cast<int>(get_int(b, "max_tokens", 0, INT32_MAX));
  else
    g.max_tokens = chat ? INT32_MAX : 16;  // chat: until EOS or the context is full

  g.sampling = m.defaults;
  if (has(b, "temperature")) {
    const double t = get_num(b, "temperature");
    if (!(t >= 0.0) || t > 1e4) bad("temperature", "'temperature' must be between 0 and 10000");
    g.sampling.temperature = static_cast<float>(t);
  }
  if (has(b, "top_p")) {
    const double p = get_num(b, "top_p");
    if (!(p > 0.0 && p <= 1.0)) bad("top_p", "'top_p' must be in (0, 1]");
    g.sampling.top_p = static_cast<float>(p);
  }
  if (has(b, "top_k")) {
    const int64_t k = get_int(b, "top_k", -1, INT32_MAX);
    g.sampling.top_k = k < 0 ? 0 : static_cast<int>(k);
  }
  if (has(b, "seed")) {
    const json& v = b["seed"];
    if (!v.is_number_integer()) bad("seed", "'seed' must be an integer");
    g.sampling.seed = v.is_number_unsigned() ? v.get<uint64_t>() : static_cast<uint64_t>(v.get<int64_t>());
  } else {
    static std::atomic<uint64_t> counter{0x9e3779b97f4a7c15ull};
    g.sampling.seed = counter.fetch_add(0x9e3779b97f4a7c15ull) ^
                      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }

  if (has(b, "stop")) {
    const json& s = b["stop"];
    if (s.is_string()) {
      g.stop.push_back(s.get<std::string>());
    } else if (s.is_array()) {
      if (s.size() > 16) bad("stop", "at most 16 stop strings");
      for (const auto& x : s) {
        if (!x.is_string()) bad("stop", "'stop' must be a string or a list of strings");
        g.stop.push_back(x.get<std::string>());
      }
    } else {
      bad("stop", "'stop' must be a string or a list of strings");
    }
    for (const auto& x : g.stop) {
      if (x.empty()) bad("stop", "stop strings must not be empty");
      if (x.size() > 1024) bad("stop", "stop strings must be at most 1024 bytes");
    }
    if (!g.stop.empty() && !m.tok) bad("stop", "stop strings need a model with a tokenizer");
  }

  if (has(b, "stream")) g.stream = get_bool(b, "stream");
  if (has(b, "stream_options")) {
    const json& so = b["stream_options"];
    if (!so.is_object()) bad("stream_options", "'stream_options' must be an object");
    if (has(so, "include_usage")) {
      if (!so["include_usage"].is_boolean()) bad("stream_options.include_usage", "'include_usage' must be a boolean");
      g.include_usage = so["include_usage"].get<bool>();
    }
  }

  g.eos_ids = m.eos_ids;
  if (has(b, "ignore_eos") && get_bool(b, "ignore_eos")) g.eos_ids.clear();

  g.mask_padded_ids = m.mask_padded_ids;
  if (has(b, "mask_padded_ids")) {
    g.mask_padded_ids = get_bool(b, "mask_padded_ids");
    if (g.mask_padded_ids && !m.tok) bad("mask_padded_ids", "'mask_padded_ids' needs a model with a tokenizer");
  }

  g.pic = m.pic;
  if (has(b, "pic")) {
    const json& p = b["pic"];
    if (!p.is_object()) bad("pic", "'pic' must be an object {\"mode\", \"seam\"}");
    if (has(p, "mode")) {
      if (!p["mode"].is_string()) bad("pic.mode", "'pic.mode' must be a string");
      try {
        g.pic.mode = parse_pic_mode(p["mode"].get<std::string>());
      } catch (const std::exception& e) {
        bad("pic.mode", e.what());
      }
    }
    if (has(p, "seam")) g.pic.seam = static_cast<int>(get_int(p, "seam", 0, 1 << 20));
  }
}

void finish_prompt(GenSpec& g, const ModelFacts& m) {
  if (g.segments.empty()) bad(g.endpoint == Endpoint::Chat ? "messages" : "prompt", "the prompt is empty");
  g.prompt_tokens = 0;
  for (auto& s : g.segments) g.prompt_tokens += static_cast<int64_t>(s.size());
  if (m.context > 0 && g.prompt_tokens > m.context)
    throw ApiError(413,
                   "the prompt has " + std::to_string(g.prompt_tokens) + " tokens; the model's context is " +
                       std::to_string(m.context) + " tokens",
                   "invalid_request_error", g.endpoint == Endpoint::Chat ? "messages" : "prompt",
                   "context_length_exceeded");
  if (m.context > 0) g.max_tokens = static_cast<int>(std::min<int64_t>(g.max_tokens, m.context - g.prompt_tokens));
}

}  // namespace

GenSpec parse_completion(const json& b, const ModelFacts& m) {
  GenSpec g;
  g.endpoint = Endpoint::Completions;
  parse_common(b, m, g, false);
  if (has(b, "echo") && get_bool(b, "echo")) bad("echo", "'echo' is not supported");
  if (has(b, "suffix")) bad("suffix", "'suffix' is not supported");
  if (has(b, "logprobs")) {
    const json& v = b["logprobs"];
    if (v.is_boolean()) {  // lenient: true means the chosen token only
      g.logprobs = v.get<bool>() ? 0 : -1;
    } else {
      g.logprobs = static_cast<int>(get_int(b, "logprobs", 0, 20));
    }
  }
  if (!b.contains("prompt") || b["prompt"].is_null()) bad("prompt", "'prompt' is required");
  const json& p = b["prompt"];
  if (p.is_string()) {
    g.segments = tokenize_text_segments(p.get<std::string>(), m, "prompt");
  } else if (p.is_array()) {
    if (p.empty()) bad("prompt", "the prompt is empty");
    if (p[0].is_number_integer()) {
      auto ids = get_ids(p, "prompt", m);
      if (!ids.empty()) g.segments.push_back(std::move(ids));
    } else if (p.size() == 1 && p[0].is_string()) {
      g.segments = tokenize_text_segments(p[0].get<std::string>(), m, "prompt");
    } else if (p.size() == 1 && p[0].is_array()) {
      auto ids = get_ids(p[0], "prompt", m);
      if (!ids.empty()) g.segments.push_back(std::move(ids));
    } else if (p[0].is_string() || p[0].is_array()) {
      bad("prompt", "batched prompts are not supported; send one prompt per request");
    } else {
      bad("prompt", "'prompt' must be a string, a list of token ids, or a list with one of those");
    }
  } else {
    bad("prompt", "'prompt' must be a string or a list of token ids");
  }
  finish_prompt(g, m);
  return g;
}

std::string render_chat(const json& b, const ModelFacts& m) {
  if (!b.contains("messages") || b["messages"].is_null()) bad("messages", "'messages' is required");
  const json& msgs = b["messages"];
  if (!msgs.is_array() || msgs.empty()) bad("messages", "'messages' must be a non-empty list");
  const std::string sep = kPicSeparator;
  json out = json::array();
  for (size_t i = 0; i < msgs.size(); ++i) {
    const json& msg = msgs[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!msg.is_object()) bad(at, at + " must be an object");
    if (!msg.contains("role") || !msg["role"].is_string()) bad(at + ".role", at + ".role must be a string");
    json o = msg;
    if (!msg.contains("content") || msg["content"].is_null()) {
      o["content"] = "";
    } else if (msg["content"].is_string()) {
      // kept as is
    } else if (msg["content"].is_array()) {
      std::string text;
      size_t k = 0;
      for (const auto& part : msg["content"]) {
        const std::string pat = at + ".content[" + std::to_string(k++) + "]";
        if (!part.is_object()) bad(pat, pat + " must be an object");
        const std::string type =
            part.contains("type") && part["type"].is_string() ? part["type"].get<std::string>() : "";
        if (type != "text") bad(pat + ".type", pat + ": only parts of type \"text\" are supported");
        if (!part.contains("text") || !part["text"].is_string()) bad(pat + ".text", pat + ".text must be a string");
        bool cache = false;
        if (has(part, "cache")) {
          if (!part["cache"].is_string() || (part["cache"] != "segment" && part["cache"] != "none"))
            bad(pat + ".cache", pat + ".cache must be \"segment\" or \"none\"");
          cache = part["cache"] == "segment";
        }
        if (has(part, "cache_control")) {
          const json& cc = part["cache_control"];
          if (!cc.is_object() || !cc.contains("type") || cc["type"] != "ephemeral")
            bad(pat + ".cache_control", pat + ".cache_control must be {\"type\": \"ephemeral\"}");
          cache = true;
        }
        const std::string t = part["text"].get<std::string>();
        text += cache ? sep + t + sep : t;
      }
      o["content"] = text;
    } else {
      bad(at + ".content", at + ".content must be a string or a list of parts");
    }
    out.push_back(std::move(o));
  }
#ifdef HYPIC_SERVER_CHAT
  if (m.chat_template.empty())
    throw ApiError(400, "the model has no chat template (tokenizer_config.json chat_template); use /v1/completions",
                   "invalid_request_error", "messages", "no_chat_template");
  bool add_gen = true;
  if (has(b, "add_generation_prompt")) add_gen = get_bool(b, "add_generation_prompt");
  json extra = json::object();
  if (m.tok) {
    extra["bos_token"] = m.tok->bos_token();
    extra["eos_token"] = m.tok->eos_token();
  }
  if (has(b, "tools")) extra["tools"] = b["tools"];
  if (has(b, "chat_template_kwargs")) {
    if (!b["chat_template_kwargs"].is_object()) bad("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    for (auto& [k, v] : b["chat_template_kwargs"].items()) extra[k] = v;
  }
  try {
    return apply_chat_template(m.chat_template, out, add_gen, extra);
  } catch (const std::exception& e) {
    throw ApiError(400, std::string("chat template: ") + e.what(), "invalid_request_error", "messages",
                   "chat_template_error");
  }
#else
  (void)m;
  throw ApiError(501, "this build has no chat template renderer; use /v1/completions", "server_error", "messages",
                 "not_implemented");
#endif
}

GenSpec parse_chat(const json& b, const ModelFacts& m) {
  GenSpec g;
  g.endpoint = Endpoint::Chat;
  parse_common(b, m, g, true);
  bool lp = false;
  if (has(b, "logprobs")) lp = get_bool(b, "logprobs");
  if (has(b, "top_logprobs")) {
    const int k = static_cast<int>(get_int(b, "top_logprobs", 0, 20));
    if (!lp && k > 0) bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    g.logprobs = k;
  } else if (lp) {
    g.logprobs = 0;
  }
  if (!lp) g.logprobs = -1;
  if (!m.tok) bad("messages", "the model has no tokenizer");
  const std::string prompt = render_chat(b, m);
  g.segments = tokenize_text_segments(prompt, m, "messages");
  finish_prompt(g, m);
  return g;
}

SegmentsSpec parse_segments(const json& b, const ModelFacts& m) {
  SegmentsSpec s;
  s.seam = m.pic.seam;
  if (has(b, "seam")) s.seam = static_cast<int>(get_int(b, "seam", 0, 1 << 20));
  if (has(b, "pic")) {
    if (!b["pic"].is_object()) bad("pic", "'pic' must be an object");
    if (has(b["pic"], "seam")) s.seam = static_cast<int>(get_int(b["pic"], "seam", 0, 1 << 20));
  }
  if (!b.contains("segments") || !b["segments"].is_array() || b["segments"].empty())
    bad("segments", "expected {\"segments\": [{\"text\": ...} | {\"ids\": [...]}, ...]}");
  if (b["segments"].size() > 4096) bad("segments", "at most 4096 segments per request");
  size_t i = 0;
  for (const auto& seg : b["segments"]) {
    const std::string at = "segments[" + std::to_string(i++) + "]";
    if (!seg.is_object()) bad(at, at + " must be an object with \"text\" or \"ids\"");
    std::vector<int32_t> ids;
    if (seg.contains("ids")) {
      if (seg.contains("text")) bad(at, at + " has both \"text\" and \"ids\"");
      if (!seg["ids"].is_array()) bad(at + ".ids", at + ".ids must be a list of token ids");
      ids = get_ids(seg["ids"], at + ".ids", m);
    } else if (seg.contains("text")) {
      if (!seg["text"].is_string()) bad(at + ".text", at + ".text must be a string");
      if (!m.tok) bad(at + ".text", "the model has no tokenizer; send ids");
      ids = m.tok->encode(seg["text"].get<std::string>());
    } else {
      bad(at, at + " needs \"text\" or \"ids\"");
    }
    if (ids.empty()) bad(at, at + " is empty");
    if (m.context > 0 && static_cast<int64_t>(ids.size()) > m.context)
      throw ApiError(413, at + " has " + std::to_string(ids.size()) + " tokens, over the model's context",
                     "invalid_request_error", at, "context_length_exceeded");
    s.segments.push_back(std::move(ids));
  }
  return s;
}

size_t stop_holdback(const std::string& text, const std::vector<std::string>& stops) {
  size_t best = 0;
  for (const auto& s : stops) {
    const size_t maxk = std::min(text.size(), s.size() - 1);
    for (size_t k = maxk; k > best; --k)
      if (text.compare(text.size() - k, k, s, 0, k) == 0) {
        best = k;
        break;
      }
  }
  return best;
}

}  // namespace hypic::server
