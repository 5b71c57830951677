// Byte-level BPE tokenizer loaded from a Hugging Face tokenizer.json (+ optional tokenizer_config.json).
//
// Pipeline (mirrors the Hugging Face `tokenizers` library):
//   1. Invalid UTF-8 in the input is replaced first: every maximal subpart of an ill-formed
//      sequence becomes one U+FFFD (Unicode "best practice", the same as Rust's
//      String::from_utf8_lossy and the WHATWG decoder used by Node's Buffer.toString). The HF
//      tokenizer only ever sees such a repaired string, so this is what we match.
//   2. Added tokens whose `normalized` is false are split out of the raw text (leftmost-longest;
//      `single_word`, `lstrip`, `rstrip` honoured). When parse_special is false, tokens marked
//      special are not matched (HF's encode_special_tokens); non-special added tokens still are.
//   3. Each remaining piece is normalized (NFC via utf8proc, when the file asks), then added tokens
//      with `normalized` true are split out of it.
//   4. Pre-tokenizers (Split by regex through PCRE2 in UTF+UCP mode, ByteLevel) cut the rest into
//      words; the BPE model turns each word into ids (priority-queue merge loop, word cache).
//   Nothing is added around the sequence (no BOS/EOS): callers that want one add it themselves.
//
// decode() concatenates the bytes of each token (ByteLevel / ByteFallback decoders applied per
// token; added tokens contribute their content verbatim; with no decoder, tokens are simply
// concatenated) and repairs invalid UTF-8 as in step 1.
//
// Supported tokenizer.json features: normalizer null / NFC / Sequence of NFC; pre_tokenizer null /
// Split (Regex or String pattern, behavior Isolated or Removed, invert false) / ByteLevel
// (add_prefix_space, use_regex with GPT-2's pattern) / Sequence of those; model BPE (merges as
// "a b" strings or [a, b] pairs, ignore_merges, byte_fallback, unk_token, fuse_unk,
// continuing_subword_prefix, end_of_word_suffix; no dropout); decoder null / ByteLevel /
// ByteFallback / Fuse / Sequence of those; added_tokens with special, single_word, lstrip, rstrip,
// normalized. Anything else throws at load. Post-processors are ignored (encode adds nothing).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace hypic {

struct TokenizerImpl;  // defined in tokenizer.cpp

class Tokenizer {
 public:
  // Throws std::runtime_error naming the file and the problem (missing file, malformed JSON,
  // unsupported model / normalizer / pre-tokenizer / decoder type).
  static Tokenizer load(const std::string& tokenizer_json_path, const std::string& tokenizer_config_path = "");
  // The same from the two files' texts (a GGUF's tokenizer, rebuilt from its metadata); `name`
  // names the source in errors.
  static Tokenizer from_json_text(const std::string& tokenizer_json, const std::string& config_json,
                                  const std::string& name);

  // Special / added tokens in the text are matched when parse_special (see the header comment).
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;
  // Ids without a tokenizer entry (a padded vocabulary's extra rows, holes) decode to no text;
  // negative ids throw std::out_of_range.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  std::string id_to_token(int32_t id) const;        // throws std::out_of_range for an unknown id
  int32_t token_to_id(std::string_view tok) const;  // -1 if absent
  size_t vocab_size() const;                        // including added tokens (max id + 1)
  bool is_special(int32_t id) const;
  // Whether `id` has an entry (a vocabulary token or an added token). Padded embedding rows and
  // holes in the id space have none.
  bool has_entry(int32_t id) const;
  // The ids in [0, rows) without an entry, ascending: what --mask-padded-ids keeps out of sampling
  // for a model with `rows` output rows.
  std::vector<int32_t> ids_without_entry(int64_t rows) const;

  // From tokenizer_config.json when given (empty otherwise).
  const std::string& chat_template() const;
  const std::string& eos_token() const;
  const std::string& bos_token() const;
  const std::string& pad_token() const;

  // Streaming helper: the bytes of decode(ids) that form complete UTF-8 are returned, incomplete
  // trailing bytes are held back until a later token completes them (or flush()). The
  // concatenation of every push() and the final flush() equals decode(all ids).
  class StreamDecoder {
   public:
    explicit StreamDecoder(const Tokenizer& tok, bool skip_special = false);
    std::string push(int32_t id);
    std::string flush();

   private:
    std::shared_ptr<const TokenizerImpl> impl_;
    bool skip_special_;
    std::string pending_;
  };

  // Replaces each maximal ill-formed subsequence by U+FFFD (exposed for tests and callers).
  static std::string sanitize_utf8(std::string_view s);

 private:
  std::shared_ptr<const TokenizerImpl> impl_;
};

}  // namespace hypic
