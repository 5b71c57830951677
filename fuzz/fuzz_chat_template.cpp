// The Jinja engine behind chat templates (a checkpoint's tokenizer_config.json is outside input):
// the input is a template, parsed and rendered over a conversation with tools, under tight limits
// so that each run stays short. Syntax and runtime errors are std::runtime_error.
#include <cstdint>
#include <string>

#include "tokenizer/chat_template.h"

using namespace hypic;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::json context = nlohmann::json::parse(R"({
    "messages": [{"role": "system", "content": "be brief"},
                 {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
                 {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
                 {"role": "tool", "content": "42"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>", "enable_thinking": false})");
  ChatTemplate::Limits lim;
  lim.max_output_bytes = 1 << 20;
  lim.max_call_depth = 20;
  lim.max_nesting = 50;
  lim.max_iterations = 100'000;
  try {
    const ChatTemplate t(std::string(reinterpret_cast<const char*>(data), size), lim);
    (void)t.render(context);
  } catch (const std::exception&) {
  }
  return 0;
}
