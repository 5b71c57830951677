// OpenAI-compatible request parsing and response shapes for `hypic serve`. Everything here is
// pure (no HTTP, no model): JSON in, a validated GenJob description or an ApiError out.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "pic/composer.h"

namespace hypic {
class Tokenizer;
}

namespace hypic::server {

// An error answered to the client as {"error": {"message", "type", "param", "code"}}.
struct ApiError : std::runtime_error {
  int status;
  std::string type, param, code;
  ApiError(int status, std::string message, std::string type = "invalid_request_error", std::string param = "",
           std::string code = "")
      : std::runtime_error(std::move(message)),
        status(status),
        type(std::move(type)),
        param(std::move(param)),
        code(std::move(code)) {}
};

nlohmann::json error_body(int status, const std::string& message, const std::string& type = "",
                          const std::string& param = "", const std::string& code = "");
nlohmann::json error_body(const ApiError& e);
// Error type for a bare HTTP status (404 -> not_found_error, 413 -> ..., 5xx -> server_error).
std::string error_type_for(int status);

// Throws ApiError(400) when the JSON text nests arrays/objects deeper than max_depth (checked on
// the raw text before parsing, so a hostile body never reaches the recursive parts of a parser).
void check_json_depth(const std::string& body, int max_depth);
// Parses a request body: 400 for malformed JSON (invalid UTF-8 included) or a non-object.
nlohmann::json parse_body(const std::string& body, int max_depth);

// Server-wide facts a request is validated against.
struct ModelFacts {
  std::string name;     // served model name
  int64_t context = 0;  // max_position_embeddings (0: unbounded)
  int64_t vocab = 0;    // valid ids are 0..vocab-1
  const Tokenizer* tok = nullptr;
  std::string chat_template;  // from tokenizer_config.json ("" -> no chat endpoint)
  std::vector<int64_t> eos_ids;
  SamplingParams defaults;       // generation_config.json defaults
  PicOptions pic;                // server defaults (--mode, --seam)
  bool mask_padded_ids = false;  // server default (--mask-padded-ids)
};

enum class Endpoint { Completions, Chat };

// A validated generation request.
struct GenSpec {
  Endpoint endpoint = Endpoint::Completions;
  std::vector<std::vector<int32_t>> segments;  // prompt segments, in order (none empty)
  int64_t prompt_tokens = 0;
  int max_tokens = 16;
  SamplingParams sampling;
  std::vector<std::string> stop;
  std::vector<int64_t> eos_ids;
  int logprobs = -1;  // < 0: none; else top-k count reported with each token
  bool stream = false, include_usage = false;
  PicOptions pic;
  bool echo = false;
  bool mask_padded_ids = false;  // keep ids without a tokenizer entry out of sampling
};

// Parse + validate /v1/completions and /v1/chat/completions bodies. Throws ApiError (400 bad
// fields, 404 unknown model, 413 prompt over the context).
GenSpec parse_completion(const nlohmann::json& body, const ModelFacts& m);
GenSpec parse_chat(const nlohmann::json& body, const ModelFacts& m);

// Renders chat messages to a prompt string in which parts marked for caching are delimited by
// kPicSeparator (exposed for tests). Throws ApiError(400) for malformed messages.
std::string render_chat(const nlohmann::json& body, const ModelFacts& m);

// POST /v1/segments body -> token ids per segment and the seam they are cached under.
struct SegmentsSpec {
  std::vector<std::vector<int32_t>> segments;
  int seam = 8;
  int tail = 0;         // tail seam of the entries (segment workers' builds; the HTTP API makes 0)
  bool encode = false;  // segment workers: the entry comes back encoded in Job::wire (one segment)
  bool share = false;   // ... in its shared form where the backend can share memory (same host)
};
SegmentsSpec parse_segments(const nlohmann::json& body, const ModelFacts& m);

// Length in bytes of the longest suffix of `text` that is a proper prefix of one of the stop
// strings: that much text must be held back while streaming.
size_t stop_holdback(const std::string& text, const std::vector<std::string>& stops);

// Client-controlled text made safe for a log line: control bytes (a decoded %0A in a URL would
// forge a line) and backslashes become \xNN / \\.
std::string log_safe(const std::string& s);
std::string hex64(uint64_t v);

}  // namespace hypic::server
