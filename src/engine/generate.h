// Prefill then decode for one sequence: the plain path every other mode is compared with.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "models/model.h"

namespace hypic {

class Tokenizer;

struct GenerateRequest {
  std::vector<int32_t> prompt;
  int max_tokens = 64;
  SamplingParams sampling;
  std::vector<std::string> stop;    // stop strings (matched on decoded text; needs a tokenizer)
  std::vector<int64_t> eos_ids;     // generation ends after emitting one of these
  int logprobs = -1;                // < 0: none; k >= 0: chosen token's logprob and the top k
  std::vector<int32_t> masked_ids;  // kept out of sampling and logprobs (see padded_ids_to_mask)
};

struct GenerateResult {
  std::vector<int32_t> ids;  // generated ids (the EOS / stop-completing token included)
  std::string text;          // decoded, cut before a matched stop string
  std::vector<TokenLogprob> logprobs;
  std::string finish_reason;  // "stop" (EOS or stop string) or "length"
  int64_t prompt_tokens = 0;
  double ttft_ms = 0;    // prompt submitted -> first token chosen
  double decode_ms = 0;  // the remaining tokens
};

// Called with each new token and its decoded text piece; return false to stop early.
using TokenCallback = std::function<bool(int32_t id, const std::string& piece)>;

// The ids --mask-padded-ids keeps out of sampling: the model's output rows (0..vocab_size-1) that
// have no tokenizer entry (padded rows, holes), end-of-sequence ids excepted. Without the option
// hypic samples over every row, as transformers' generate() does. Throws std::invalid_argument
// without a tokenizer, or when the tokenizer has an entry for none of the model's ids.
std::vector<int32_t> padded_ids_to_mask(const Model& model, const Tokenizer* tok);

// Checks a request before any work: empty prompt, max_tokens, sampling ranges, stop strings,
// context length. Throws std::invalid_argument / std::length_error naming the problem.
void validate_request(const Model& model, const Tokenizer* tok, const GenerateRequest& req);

// Validates the request (empty prompt, max_tokens, context length, sampling ranges) and throws
// std::invalid_argument / std::length_error with a message naming the problem.
GenerateResult generate(Model& model, const Tokenizer* tok, const GenerateRequest& req,
                        const TokenCallback& on_token = {});

// Continues decoding from a state whose prompt was already prefilled; `logits` is the last row.
// Used by generate() and by PIC, which builds the prompt state its own way.
GenerateResult decode_from(Model& model, const Tokenizer* tok, const GenerateRequest& req, SequenceState& st,
                           Tensor logits, const TokenCallback& on_token = {});

}  // namespace hypic
