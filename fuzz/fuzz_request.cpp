// Request bodies of the OpenAI-compatible API: the first byte picks the endpoint (completions,
// chat, segments), the rest is the body as a client sends it. Every rejection is an ApiError (a
// std::exception) that the server turns into a 4xx answer.
#include <cstdint>
#include <string>

#include "fuzz_common.h"
#include "server/api.h"
#include "tokenizer/tokenizer.h"

using namespace hypic;
using namespace hypic::server;

namespace {
const ModelFacts& facts() {
  static const Tokenizer tok =
      Tokenizer::load(fuzz::model_file("tokenizer.json"), fuzz::model_file("tokenizer_config.json"));
  static const ModelFacts m = [] {
    ModelFacts f;
    f.name = "hypic-mini";
    f.context = 4096;
    f.vocab = static_cast<int64_t>(tok.vocab_size());
    f.tok = &tok;
    f.chat_template = tok.chat_template();  // as the server takes it
    f.eos_ids = {1};
    return f;
  }();
  return m;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    const nlohmann::json j = parse_body(body, 64);
    switch (data[0] % 3) {
      case 0:
        (void)parse_completion(j, facts());
        break;
      case 1:
        (void)parse_chat(j, facts());
        break;
      default:
        (void)parse_segments(j, facts());
    }
  } catch (const std::exception&) {
  }
  return 0;
}
