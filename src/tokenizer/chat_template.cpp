// Chat-template rendering: glue between the public API and the Jinja subset in tokenizer/jinja/.
#include "tokenizer/chat_template.h"

#include <stdexcept>

#include "tokenizer/jinja/interp.h"
#include "tokenizer/jinja/syntax.h"

namespace hypic {

namespace {

template <class J>
jinja::Value from_json(const J& j, int depth = 0) {
  using jinja::Value;
  if (depth > 512) throw std::runtime_error("chat template context nested too deeply");
  switch (j.type()) {
    case J::value_t::null:
      return Value(jinja::None{});
    case J::value_t::boolean:
      return Value(j.template get<bool>());
    case J::value_t::number_integer:
      return Value(j.template get<int64_t>());
    case J::value_t::number_unsigned: {
      uint64_t u = j.template get<uint64_t>();
      return u <= uint64_t(INT64_MAX) ? Value(int64_t(u)) : Value(double(u));
    }
    case J::value_t::number_float:
      return Value(j.template get<double>());
    case J::value_t::string:
      return Value(j.template get<std::string>());
    case J::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& x : j) items.push_back(from_json(x, depth + 1));
      return jinja::make_list(std::move(items));
    }
    case J::value_t::object: {
      Value d = jinja::make_dict();
      for (auto it = j.begin(); it != j.end(); ++it) d.dict().set(it.key(), from_json(it.value(), depth + 1));
      return d;
    }
    default:
      throw std::runtime_error("chat template context: unsupported JSON value (binary or discarded)");
  }
}

std::string with_position(const std::string& source, const jinja::PosError& e, const char* what) {
  auto [line, col] = jinja::line_col(source, e.pos);
  return std::string(what) + " at line " + std::to_string(line) + ", column " + std::to_string(col) + ": " + e.what();
}

template <class J>
std::string render_impl(const std::string& source, const jinja::Program& prog, const ChatTemplate::Limits& lim,
                        const J& context) {
  if (!context.is_null() && !context.is_object())
    throw std::runtime_error("chat template context must be a JSON object");
  jinja::Value globals = context.is_null() ? jinja::make_dict() : from_json(context);
  try {
    return jinja::render_program(prog, globals, {lim.max_output_bytes, lim.max_call_depth, lim.max_iterations});
  } catch (const jinja::PosError& e) {
    throw std::runtime_error(with_position(source, e, "chat template error"));
  }
}

template <class J>
std::string apply_impl(const std::string& tmpl, const J& messages, bool add_generation_prompt, const J& extra) {
  if (!messages.is_array()) throw std::runtime_error("apply_chat_template: messages must be a JSON array");
  if (!extra.is_null() && !extra.is_object())
    throw std::runtime_error("apply_chat_template: extra must be a JSON object");
  J ctx = J::object();
  if (extra.is_object()) {
    for (auto it = extra.begin(); it != extra.end(); ++it) {
      if (it.key() == "tools" && (it.value().is_null() || (it.value().is_array() && it.value().empty()))) continue;
      ctx[it.key()] = it.value();
    }
  }
  ctx["messages"] = messages;
  ctx["add_generation_prompt"] = add_generation_prompt;
  return ChatTemplate(tmpl).render(ctx);
}

}  // namespace

ChatTemplate::ChatTemplate(std::string source) : ChatTemplate(std::move(source), Limits{}) {}

ChatTemplate::ChatTemplate(std::string source, Limits limits) : source_(std::move(source)), limits_(limits) {
  try {
    program_ = jinja::parse_template(source_, jinja::ParseLimits{limits_.max_nesting});
  } catch (const jinja::PosError& e) {
    throw std::runtime_error(with_position(source_, e, "chat template syntax error"));
  }
}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(const ChatTemplate&) = default;
ChatTemplate& ChatTemplate::operator=(const ChatTemplate&) = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

std::string ChatTemplate::render(const nlohmann::json& context) const {
  return render_impl(source_, *program_, limits_, context);
}
std::string ChatTemplate::render(const nlohmann::ordered_json& context) const {
  return render_impl(source_, *program_, limits_, context);
}

std::string apply_chat_template(const std::string& tmpl, const nlohmann::json& messages, bool add_generation_prompt,
                                const nlohmann::json& extra) {
  return apply_impl(tmpl, messages, add_generation_prompt, extra);
}
std::string apply_chat_template(const std::string& tmpl, const nlohmann::ordered_json& messages,
                                bool add_generation_prompt, const nlohmann::ordered_json& extra) {
  return apply_impl(tmpl, messages, add_generation_prompt, extra);
}

}  // namespace hypic
