// Unit tests for the tokenizer on tiny hand-made tokenizer.json files (expected ids derived by hand).
#include "tokenizer/tokenizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace hypic {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int32_t>;

// CTest runs every test as its own process, in parallel: names carry the pid so two processes
// never truncate a file the other is reading.
std::string write_temp(const std::string& name, const std::string& content) {
  fs::path p = fs::path(testing::TempDir()) / ("hypic_tok_" + std::to_string(getpid()) + "_" + name);
  std::ofstream f(p, std::ios::binary);
  f << content;
  return p.string();
}

// GPT-2 style: ByteLevel pre-tokenizer (with its regex) and decoder. Ġ is the byte-level space.
// Merges by rank: 0 "a b", 1 "ab c", 2 "Ġ a", 3 "b c", 4 "Ã ©".
std::string byte_level_json(bool pair_merges, bool ignore_merges) {
  std::string merges =
      pair_merges ? R"([["a","b"],["ab","c"],["Ġ","a"],["b","c"],["Ã","©"]])" : R"(["a b","ab c","Ġ a","b c","Ã ©"])";
  return std::string(R"({
  "version": "1.0",
  "added_tokens": [
    {"id": 40, "content": "<|end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 41, "content": "<x>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false},
    {"id": 42, "content": "[M]", "single_word": false, "lstrip": true, "rstrip": true, "normalized": false, "special": true},
    {"id": 43, "content": "cc", "single_word": true, "lstrip": false, "rstrip": false, "normalized": false, "special": false}
  ],
  "normalizer": {"type": "NFC"},
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
  "post_processor": null,
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
  "model": {
    "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
    "fuse_unk": false, "byte_fallback": false, "ignore_merges": )") +
         (ignore_merges ? "true" : "false") + R"(,
    "vocab": {"a": 0, "b": 1, "c": 2, "Ġ": 3, "ab": 4, "abc": 5, "Ġa": 6, "bc": 7, "ac": 8,
              "<": 20, "|": 21, ">": 22, "e": 23, "n": 24, "d": 25, "x": 26, "[": 27, "]": 28, "M": 29,
              "Ã": 30, "©": 31, "Ã©": 32},
    "merges": )" +
         merges +
         R"(
  }
})";
}

// No pre-tokenizer, byte fallback + unk, ByteFallback decoder.
const char* kByteFallbackJson = R"({
  "added_tokens": [],
  "normalizer": null,
  "pre_tokenizer": null,
  "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
  "model": {
    "type": "BPE", "unk_token": "<unk>", "fuse_unk": true, "byte_fallback": true,
    "vocab": {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "<0xC3>": 4, "<0xA9>": 5, "<0xE2>": 6, "<0x82>": 7, "<0xAC>": 8},
    "merges": ["a b"]
  }
})";

Tokenizer tiny(bool pair_merges = false, bool ignore_merges = false) {
  return Tokenizer::load(
      write_temp(std::string("bl_") + (pair_merges ? "p" : "s") + (ignore_merges ? "i" : "") + ".json",
                 byte_level_json(pair_merges, ignore_merges)));
}

TEST(Tokenizer, MergesFollowRank) {
  Tokenizer t = tiny();
  EXPECT_EQ(t.encode("abc"), (Ids{5}));      // a b -> ab (rank 0), ab c -> abc (rank 1)
  EXPECT_EQ(t.encode("bc"), (Ids{7}));       // b c (rank 3)
  EXPECT_EQ(t.encode(" abc"), (Ids{3, 5}));  // Ġ a b c: "a b" (0) beats "Ġ a" (2); (Ġ, ab) has no merge
  EXPECT_EQ(t.encode(" a"), (Ids{6}));       // Ġ a (rank 2)
  EXPECT_EQ(t.encode("cab"), (Ids{2, 4}));   // (c, a) has no merge
  EXPECT_EQ(t.encode("ac"), (Ids{0, 2}));    // "ac" is in the vocab but no merge builds it -> a, c
  EXPECT_EQ(t.encode(""), (Ids{}));
  EXPECT_EQ(t.decode(t.encode(" abc cab")), " abc cab");
}

TEST(Tokenizer, PairMergeFormatIsEquivalent) {
  Tokenizer s = tiny(false), p = tiny(true);
  for (const char* text : {"abc", " abc", "cab abba", "bcabc a"}) EXPECT_EQ(s.encode(text), p.encode(text)) << text;
}

TEST(Tokenizer, IgnoreMergesTakesWholeWordFromVocab) {
  Tokenizer t = tiny(false, true);
  EXPECT_EQ(t.encode("ac"), (Ids{8}));
  EXPECT_EQ(t.encode("cab"), (Ids{2, 4}));  // not in vocab: regular merges
}

TEST(Tokenizer, NfcNormalizer) {
  Tokenizer t = tiny();
  EXPECT_EQ(t.encode("\xC3\xA9"), (Ids{32}));   // é = C3 A9 -> "Ã©"
  EXPECT_EQ(t.encode("e\xCC\x81"), (Ids{32}));  // e + U+0301 composes to é first
  EXPECT_EQ(t.decode(Ids{32}), "\xC3\xA9");
}

TEST(Tokenizer, SpecialTokenSplitting) {
  Tokenizer t = tiny();
  EXPECT_EQ(t.encode("ab<|end|>c"), (Ids{4, 40, 2}));
  // Not parsed: the text goes through BPE; GPT-2 regex pieces "ab" "<|" "end" "|>" "c".
  EXPECT_EQ(t.encode("ab<|end|>c", false), (Ids{4, 20, 21, 23, 24, 25, 21, 22, 2}));
  // Non-special added tokens are matched either way.
  EXPECT_EQ(t.encode("a<x>", true), (Ids{0, 41}));
  EXPECT_EQ(t.encode("a<x>", false), (Ids{0, 41}));
  // lstrip / rstrip swallow the surrounding spaces.
  EXPECT_EQ(t.encode("a  [M]  b"), (Ids{0, 42, 1}));
  // single_word: only matched when not inside a word. "a " -> a, Ġ ; " b" -> Ġ, b (no merge).
  EXPECT_EQ(t.encode("a cc b"), (Ids{0, 3, 43, 3, 1}));
  EXPECT_EQ(t.encode("acc"), (Ids{0, 2, 2}));
  // Leftmost-longest, adjacent tokens.
  EXPECT_EQ(t.encode("<|end|><|end|><x>"), (Ids{40, 40, 41}));
  EXPECT_TRUE(t.is_special(40));
  EXPECT_FALSE(t.is_special(41));
  EXPECT_FALSE(t.is_special(0));
  EXPECT_EQ(t.token_to_id("<|end|>"), 40);
  EXPECT_EQ(t.token_to_id("Ġa"), 6);
  EXPECT_EQ(t.token_to_id("nope"), -1);
  EXPECT_EQ(t.id_to_token(6), "Ġa");
  EXPECT_EQ(t.vocab_size(), 44u);
  EXPECT_EQ(t.decode(Ids{4, 40, 2}), "ab<|end|>c");
  EXPECT_EQ(t.decode(Ids{4, 40, 2}, true), "abc");
  EXPECT_EQ(t.decode(Ids{4, 41, 2}, true), "ab<x>c");
}

// A model may emit ids the tokenizer has no entry for (padded embedding rows, holes): they decode
// to no text; negative ids are never model output and still throw, as id_to_token does for holes.
TEST(Tokenizer, IdsWithoutEntryDecodeToNothing) {
  Tokenizer t = tiny();
  EXPECT_EQ(t.decode(Ids{4, 12345, 2}), t.decode(Ids{4, 2}));
  EXPECT_FALSE(t.decode(Ids{4, 2}).empty());
  EXPECT_EQ(t.decode(Ids{10}), "");  // a hole in the id space
  EXPECT_EQ(t.decode(Ids{44, 1000000}), "");
  try {
    t.decode(Ids{0, -7});
    FAIL() << "no throw";
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("-7"), std::string::npos) << e.what();
  }
  EXPECT_THROW(t.id_to_token(44), std::out_of_range);
}

TEST(Tokenizer, ByteFallback) {
  Tokenizer t = Tokenizer::load(write_temp("bf.json", kByteFallbackJson));
  EXPECT_EQ(t.encode("ab"), (Ids{3}));
  EXPECT_EQ(t.encode("a\xC3\xA9"), (Ids{1, 4, 5}));               // é -> <0xC3> <0xA9>
  EXPECT_EQ(t.encode("\xE2\x82\xAC"), (Ids{6, 7, 8}));            // € -> three byte tokens
  EXPECT_EQ(t.encode("a\xE4\xB8\xAD\xE6\x96\x87"), (Ids{1, 0}));  // 中文: bytes missing -> <unk>, fused
  EXPECT_EQ(t.decode(Ids{1, 4, 5}), "a\xC3\xA9");
  EXPECT_EQ(t.decode(Ids{4}), "\xEF\xBF\xBD");  // a lone lead byte decodes to U+FFFD
  EXPECT_EQ(t.decode(Ids{4, 1}),
            "\xEF\xBF\xBD"
            "a");
}

TEST(Tokenizer, StreamDecoderHoldsIncompleteUtf8) {
  Tokenizer t = Tokenizer::load(write_temp("bf2.json", kByteFallbackJson));
  Tokenizer::StreamDecoder sd(t);
  EXPECT_EQ(sd.push(1), "a");
  EXPECT_EQ(sd.push(6), "");  // E2
  EXPECT_EQ(sd.push(7), "");  // E2 82
  EXPECT_EQ(sd.push(8), "\xE2\x82\xAC");
  EXPECT_EQ(sd.push(4), "");  // C3 ...
  EXPECT_EQ(sd.push(1),
            "\xEF\xBF\xBD"
            "a");  // ... never completed: U+FFFD, as decode() gives
  EXPECT_EQ(sd.push(6), "");
  EXPECT_EQ(sd.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(sd.flush(), "");
  EXPECT_EQ(sd.push(99), "");  // no tokenizer entry: no text, no failure
  EXPECT_EQ(sd.push(1), "a");
  EXPECT_THROW(sd.push(-1), std::out_of_range);
}

TEST(Tokenizer, InvalidUtf8IsReplacedByMaximalSubparts) {
  EXPECT_EQ(Tokenizer::sanitize_utf8("ok"), "ok");
  EXPECT_EQ(Tokenizer::sanitize_utf8("\xC3("), "\xEF\xBF\xBD(");
  EXPECT_EQ(Tokenizer::sanitize_utf8("\xE2\x82"), "\xEF\xBF\xBD");                              // one truncated subpart
  EXPECT_EQ(Tokenizer::sanitize_utf8("\xF0\x80\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // F0 80: bad 2nd byte
  EXPECT_EQ(Tokenizer::sanitize_utf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(Tokenizer::sanitize_utf8("\xFF"
                                     "a"),
            "\xEF\xBF\xBD"
            "a");
  Tokenizer t = tiny();
  // Must not crash; the byte-level path sees U+FFFD (EF BF BD), which this tiny vocab lacks -> dropped.
  EXPECT_EQ(t.encode("ab\xFF\xFE"
                     "c"),
            t.encode("ab\xEF\xBF\xBD\xEF\xBF\xBD"
                     "c"));
}

void expect_load_error(const std::string& path, const std::string& config, const std::string& needle) {
  try {
    Tokenizer::load(path, config);
    FAIL() << "no throw for " << path;
  } catch (const std::runtime_error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(config.empty() ? path : config), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  }
}

TEST(Tokenizer, LoadErrorsNameTheFile) {
  std::string missing = (fs::path(testing::TempDir()) / "hypic_tok_does_not_exist.json").string();
  expect_load_error(missing, "", "cannot open");
  expect_load_error(write_temp("bad.json", "{\"model\": {\"type\": \"BPE\", "), "", "malformed JSON");
  expect_load_error(write_temp("wp.json", R"({"model": {"type": "WordPiece", "vocab": {}}})"), "", "WordPiece");
  expect_load_error(
      write_temp("pt.json",
                 R"({"pre_tokenizer": {"type": "Metaspace"}, "model": {"type": "BPE", "vocab": {}, "merges": []}})"),
      "", "Metaspace");
  expect_load_error(write_temp("mg.json", R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a q"]}})"), "",
                    "merge");
  std::string good = write_temp("good.json", kByteFallbackJson);
  expect_load_error(good, write_temp("badcfg.json", "[1, 2"), "malformed JSON");
  expect_load_error(good, missing, "cannot open");
}

TEST(Tokenizer, ConfigFields) {
  std::string good = write_temp("good2.json", kByteFallbackJson);
  std::string cfg = write_temp("cfg.json", R"({"chat_template": "{{ messages }}", "eos_token": "<eos>",
      "bos_token": {"content": "<s>", "lstrip": false}, "pad_token": null})");
  Tokenizer t = Tokenizer::load(good, cfg);
  EXPECT_EQ(t.chat_template(), "{{ messages }}");
  EXPECT_EQ(t.eos_token(), "<eos>");
  EXPECT_EQ(t.bos_token(), "<s>");
  EXPECT_EQ(t.pad_token(), "");
  Tokenizer u = Tokenizer::load(good);
  EXPECT_EQ(u.chat_template(), "");
}

}  // namespace
}  // namespace hypic
