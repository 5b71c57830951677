// Renders Hugging Face chat templates (tokenizer_config.json `chat_template`, a Jinja2 template).
//
// Hand-written because Debian 12 ships no C++ library with Jinja2 semantics (apt has only the
// Python jinja2 and Rust tera; inja, not packaged anyway, lacks loop.*, namespace(), Python string
// methods, slicing and most filters that these templates rely on). This is the subset of Jinja2
// that chat templates use, interpreted the way Python's jinja2 does inside transformers'
// apply_chat_template: Environment(trim_blocks=True, lstrip_blocks=True) with the loopcontrols
// extension, `raise_exception`, `strftime_now` and a `tojson` that is json.dumps(ensure_ascii=False).
//
// Supported:
//   * {{ }}, {% %}, {# #}; `-` whitespace control on either side; trim_blocks (one newline after a
//     block or comment tag is dropped) and lstrip_blocks (spaces/tabs before a block or comment
//     tag at the start of a line are dropped; `{%+` / `+%}` turn these off for one tag).
//   * Statements: if/elif/else, for (tuple unpacking, `if` filter, else, loop.index/index0/
//     revindex/revindex0/first/last/length/previtem/nextitem/cycle, break/continue), set (names,
//     tuples, `ns.attr = ...`, block set `{% set x %}...{% endset %}`), macro (positional, keyword
//     and default arguments), generation/endgeneration (renders its body), raw/endraw.
//   * Expressions: string (Python escapes), int, float, true/false/none (any case), list, tuple and
//     dict literals; attribute, item and slice access ([a:b:c], negative indices; strings index by
//     code point); + - * / // % ** ~; == != < <= > >=; in / not in; and/or/not; `a if c else b`;
//     calls with keyword arguments; filters; `is [not] test`.
//   * Filters: abs capitalize count d default dictsort first float indent int items join last
//     length list lower map max min reject rejectattr replace reverse round safe select selectattr
//     sort string sum title tojson trim unique upper escape.
//   * Tests: boolean callable defined divisibleby eq equalto even false float ge gt in integer
//     iterable le lower lt mapping ne none number odd sameas sequence string true undefined upper
//     == != < <= > >=.
//   * Methods: str.startswith endswith strip lstrip rstrip split rsplit splitlines upper lower
//     replace title capitalize find count join is*; dict.items keys values get;
//     list.append/extend/insert/pop/index/count.
//   * Globals: range (at most 1,000,000 items), namespace, raise_exception, strftime_now, dict.
// Undefined variables print as "" and are falsy; attribute/item access on undefined (or a missing
// key/attribute) gives undefined. none prints "None", booleans "True"/"False", containers as
// Python's repr. Dicts keep insertion order (pass nlohmann::ordered_json to keep a JSON file's
// key order, as Python's json.load does; nlohmann::json sorts keys).
// Where Python's jinja2 and @huggingface/jinja (the CI reference) differ, this follows Python:
// `{{ none }}` is "None" (hf: ""), `{{ true }}` "True" (hf: "true"), containers print as repr,
// length counts code points (hf: UTF-16 units), "\r\n" in template text becomes "\n". Unlike
// Python's default Undefined, attribute/item access on undefined is undefined (as in hf) instead of
// an error. str.upper/lower use utf8proc's simple case mapping (Python: full, e.g. ß -> SS).
//
// Not supported: extends/block/include/import (no loader), call blocks, filter blocks, recursive
// loops, `%` string formatting and str.format, autoescape, non-string dict keys, `*args`/`**kw`.
// Templates that use them throw at construction (unknown tag) or at render (unknown filter/test/method).
//
// Hostile templates: parse nesting, macro recursion, output size, loop iterations and string sizes
// are bounded (ChatTemplate::Limits); going past a limit throws std::runtime_error naming it.
#pragma once
#include <cstddef>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

namespace hypic {

namespace jinja {
struct Program;  // parsed template (tokenizer/jinja/syntax.h)
}

class ChatTemplate {
 public:
  struct Limits {
    size_t max_output_bytes = size_t(64) << 20;  // rendered text and any one string value
    size_t max_call_depth = 100;                 // nested macro calls
    size_t max_nesting = 200;                    // nested expressions/blocks while parsing
    size_t max_iterations = 10'000'000;          // loop iterations over the whole render
  };

  // Parses the template; throws std::runtime_error "chat template syntax error at line L, column C:
  // ..." on bad syntax (lines and columns count from 1, columns in bytes).
  explicit ChatTemplate(std::string source);
  ChatTemplate(std::string source, Limits limits);
  ~ChatTemplate();
  ChatTemplate(const ChatTemplate&);
  ChatTemplate& operator=(const ChatTemplate&);
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  // Renders with `context` as the template's variables (an object, or null for none). Throws
  // std::runtime_error on runtime errors ("chat template error at line L, column C: ..."); a
  // raise_exception(msg) call throws with exactly msg as what().
  std::string render(const nlohmann::json& context) const;
  std::string render(const nlohmann::ordered_json& context) const;

  const std::string& source() const { return source_; }

 private:
  std::string source_;
  Limits limits_;
  std::shared_ptr<const jinja::Program> program_;
};

// Renders `tmpl` like transformers' apply_chat_template(messages, add_generation_prompt=...,
// tokenize=False): the context is `extra` (bos_token, eos_token, tools, enable_thinking, ... any
// key is passed through) plus messages and add_generation_prompt. A null or empty `tools` in
// extra is left out, as transformers does.
std::string apply_chat_template(const std::string& tmpl, const nlohmann::json& messages, bool add_generation_prompt,
                                const nlohmann::json& extra = {});
std::string apply_chat_template(const std::string& tmpl, const nlohmann::ordered_json& messages,
                                bool add_generation_prompt, const nlohmann::ordered_json& extra = {});

}  // namespace hypic
