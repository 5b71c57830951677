// Tree-walking interpreter of the chat-template Jinja subset (see tokenizer/chat_template.h).
#pragma once
#include <cstddef>
#include <string>

#include "tokenizer/jinja/syntax.h"
#include "tokenizer/jinja/value.h"

namespace hypic::jinja {

struct RenderLimits {
  size_t max_output_bytes;
  size_t max_call_depth;
  size_t max_iterations;
};

// Thrown by raise_exception(msg); what() is msg.
struct TemplateException : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Renders `prog` with `globals` (a dict value) as the template's variables. Errors other than
// raise_exception are PosError (offset into prog.source).
std::string render_program(const Program& prog, const Value& globals, const RenderLimits& limits);

// Python-style text of a value: str() for strings/numbers, repr() inside containers.
std::string to_str(const Value& v);
// json.dumps(v, ensure_ascii, indent, separators, sort_keys) as transformers' tojson filter.
std::string to_json(const Value& v, bool ensure_ascii, int indent, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys);

}  // namespace hypic::jinja
