// Token selection from a row of logits: greedy, or temperature / top-k / top-p sampling with a
// seeded generator, plus the log-probabilities reported to users.
#pragma once
#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

namespace hypic {

struct SamplingParams {
  float temperature = 0.f;  // 0: greedy
  int top_k = 0;            // 0: all tokens
  float top_p = 1.f;        // 1: no nucleus cut
  uint64_t seed = 0;
};

// Validates ranges; throws std::invalid_argument naming the parameter.
void validate(const SamplingParams& p);

struct TokenLogprob {
  int32_t id;
  float logprob;
  std::vector<std::pair<int32_t, float>> top;  // k best (id, logprob), best first
};

class Sampler {
 public:
  explicit Sampler(SamplingParams p);
  // Picks a token from logits (host memory, length V).
  int32_t sample(std::span<const float> logits);
  const SamplingParams& params() const { return p_; }
  // Greedy or plain temperature sampling over `vocab` ids (no top-k / top-p cut): what
  // Backend::sample_rows draws on the device, given uniform().
  bool plain(int64_t vocab) const { return (p_.top_k == 0 || p_.top_k >= vocab) && p_.top_p >= 1.f; }
  // The next draw in [0, 1) of this sampler's seeded stream: sample() takes one per sampled token
  // (none when greedy), so a request's tokens follow its seed wherever the draw is applied.
  double uniform();

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<float> weights_;                      // exp((logit - max) / temperature)
  std::vector<std::pair<float, int32_t>> scratch_;  // (logit, id) candidates for top-k / top-p
};

// Keeps ids out of sampling: their logits become -inf (ids outside the row are ignored). Used by
// --mask-padded-ids for output rows without a tokenizer entry.
void mask_ids(std::span<float> logits, std::span<const int32_t> ids);

// log_softmax of the row (computed in double) at `id`, and the k most likely tokens.
TokenLogprob token_logprob(std::span<const float> logits, int32_t id, int k);
// Full log_softmax of a row (double accumulation).
std::vector<float> log_softmax(std::span<const float> logits);

}  // namespace hypic
