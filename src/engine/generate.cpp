#include "engine/generate.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "tokenizer/tokenizer.h"

namespace hypic {

namespace {
using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

}  // namespace

std::vector<int32_t> padded_ids_to_mask(const Model& model, const Tokenizer* tok) {
  if (!tok) throw std::invalid_argument("--mask-padded-ids needs a model with a tokenizer (tokenizer.json)");
  const int64_t rows = model.config().vocab_size;
  std::vector<int32_t> ids = tok->ids_without_entry(rows);
  const auto& eos = model.config().eos_token_ids;
  std::erase_if(ids, [&](int32_t id) { return std::find(eos.begin(), eos.end(), id) != eos.end(); });
  if (static_cast<int64_t>(ids.size()) >= rows)
    throw std::invalid_argument("--mask-padded-ids: the tokenizer has an entry for none of the model's " +
                                std::to_string(rows) + " ids");
  return ids;
}

void validate_request(const Model& model, const Tokenizer* tok, const GenerateRequest& req) {
  if (req.prompt.empty()) throw std::invalid_argument("the prompt is empty");
  if (req.max_tokens < 0) throw std::invalid_argument("max_tokens must be >= 0, got " + std::to_string(req.max_tokens));
  validate(req.sampling);
  if (!req.stop.empty() && !tok) throw std::invalid_argument("stop strings need a tokenizer");
  for (const auto& s : req.stop)
    if (s.empty()) throw std::invalid_argument("stop strings must not be empty");
  const int64_t ctx = model.config().max_position_embeddings;
  if (ctx > 0 && static_cast<int64_t>(req.prompt.size()) > ctx)
    throw std::length_error("prompt of " + std::to_string(req.prompt.size()) +
                            " tokens exceeds the model's context of " + std::to_string(ctx) + " tokens");
}

GenerateResult decode_from(Model& model, const Tokenizer* tok, const GenerateRequest& req, SequenceState& st,
                           Tensor logits, const TokenCallback& on_token) {
  GenerateResult res;
  res.prompt_tokens = st.n_past;
  Sampler sampler(req.sampling);
  Backend& be = model.backend();
  const int64_t ctx = model.config().max_position_embeddings;
  std::string full;  // all decoded text, for stop-string matching
  std::unique_ptr<Tokenizer::StreamDecoder> dec;
  if (tok) dec = std::make_unique<Tokenizer::StreamDecoder>(*tok);
  std::vector<float> masked;
  auto t0 = Clock::now();
  res.finish_reason = "length";
  // Greedy without log-probs or masks: the argmax runs where the logits are, and only the id
  // comes back (a row of logits is ~1 MB for real vocabularies).
  const bool device_greedy = req.sampling.temperature == 0.f && req.logprobs < 0 && req.masked_ids.empty();
  Tensor picked = device_greedy ? be.alloc(DType::I32, {1}) : Tensor();
  for (int step = 0; step < req.max_tokens; ++step) {
    int32_t id = 0;
    if (device_greedy) {
      be.argmax_rows(logits, picked);
      id = be.to_host(picked).data<int32_t>()[0];
    } else {
      Tensor host = be.to_host(logits);
      std::span<const float> row(host.data<float>(), static_cast<size_t>(host.numel()));
      if (!req.masked_ids.empty()) {
        masked.assign(row.begin(), row.end());
        mask_ids(masked, req.masked_ids);
        row = masked;
      }
      id = sampler.sample(row);
      if (req.logprobs >= 0) res.logprobs.push_back(token_logprob(row, id, req.logprobs));
    }
    if (step == 0) res.ttft_ms = ms_since(t0);
    res.ids.push_back(id);
    bool is_eos = false;
    for (auto e : req.eos_ids) is_eos |= (e == id);
    // An end-of-sequence token ends the text and is not part of it (as in the server's output).
    std::string piece = dec && !is_eos ? dec->push(id) : std::string();
    bool stop_now = false;
    if (!req.stop.empty()) {
      const size_t from = full.size() > 64 ? full.size() - 64 : 0;
      full += piece;
      size_t cut = std::string::npos;
      for (const auto& s : req.stop) {
        size_t p = full.find(s, from > s.size() ? from - s.size() : 0);
        if (p != std::string::npos) cut = std::min(cut, p);
      }
      if (cut != std::string::npos) {
        // Only the part of this piece before the stop string is emitted.
        const size_t before = full.size() - piece.size();
        piece = cut > before ? piece.substr(0, cut - before) : std::string();
        full.resize(cut);
        stop_now = true;
      }
    } else {
      full += piece;
    }
    if (on_token && !on_token(id, piece)) {
      res.finish_reason = "stop";
      break;
    }
    if (is_eos || stop_now) {
      res.finish_reason = "stop";
      break;
    }
    if (step + 1 == req.max_tokens) break;
    if (ctx > 0 && st.n_past + 1 > ctx) break;  // context full: finish with "length"
    const int32_t next[1] = {id};
    logits = model.forward(next, st);
  }
  if (dec && req.stop.empty()) full += dec->flush();
  res.text = full;
  res.decode_ms = ms_since(t0) - res.ttft_ms;
  return res;
}

GenerateResult generate(Model& model, const Tokenizer* tok, const GenerateRequest& req, const TokenCallback& on_token) {
  validate_request(model, tok, req);
  auto t0 = Clock::now();
  // KV rows for the whole generation up front, but never beyond the context (huge max_tokens
  // must not allocate memory the sequence can never use; decoding stops at the context anyway).
  int64_t want = static_cast<int64_t>(req.prompt.size()) + req.max_tokens;
  if (model.config().max_position_embeddings > 0) want = std::min(want, model.config().max_position_embeddings);
  SequenceState st = model.new_state(want);
  Tensor logits = model.forward(req.prompt, st);
  const double prefill_ms = ms_since(t0);
  if (req.max_tokens == 0) {
    GenerateResult r;
    r.prompt_tokens = static_cast<int64_t>(req.prompt.size());
    r.finish_reason = "length";
    r.ttft_ms = prefill_ms;
    return r;
  }
  GenerateResult r = decode_from(model, tok, req, st, logits, on_token);
  r.ttft_ms += prefill_ms;
  return r;
}

}  // namespace hypic
