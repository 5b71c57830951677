// A padded vocabulary (issue 19) through generate and eval in process: ids without a tokenizer entry
// are sampled like any other (as transformers samples every lm_head row) and decode to no text;
// with the mask (--mask-padded-ids) they are never picked and the output is the unpadded model's.
#include "padded_vocab.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/generate.h"
#include "engine/loader.h"
#include "eval/harness.h"

namespace {

using namespace hypic;
namespace fs = std::filesystem;
namespace fx = hypic::testing;

class PaddedVocab : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("hypic_padded_vocab_" + std::to_string(getpid()));
    fx::make_padded_vocab_model(dir_);
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  static fs::path dir_;
};
fs::path PaddedVocab::dir_;

int count_padded(const std::vector<int32_t>& ids) {
  return static_cast<int>(
      std::count_if(ids.begin(), ids.end(), [](int32_t id) { return id >= fx::kPaddedVocabTokenizerIds; }));
}

TEST_F(PaddedVocab, TokenizerAndMaskName) {
  LoadedModel lm = load_model(dir_.string(), "cpu", 1);
  ASSERT_EQ(lm.model->config().vocab_size, fx::kPaddedVocabRows);
  EXPECT_TRUE(lm.tokenizer->has_entry(0));
  EXPECT_TRUE(lm.tokenizer->has_entry(511));  // an added token
  EXPECT_FALSE(lm.tokenizer->has_entry(512));
  EXPECT_FALSE(lm.tokenizer->has_entry(-1));
  const auto ids = padded_ids_to_mask(*lm.model, lm.tokenizer.get());
  ASSERT_EQ(ids.size(), static_cast<size_t>(fx::kPaddedVocabRows - fx::kPaddedVocabTokenizerIds));
  EXPECT_EQ(ids.front(), 512);
  EXPECT_EQ(ids.back(), 767);
  EXPECT_THROW(padded_ids_to_mask(*lm.model, nullptr), std::invalid_argument);
  // The reference model has no padded rows: nothing to mask.
  LoadedModel ref = load_model(fx::reference_model_dir().string(), "cpu", 1);
  EXPECT_TRUE(padded_ids_to_mask(*ref.model, ref.tokenizer.get()).empty());
}

TEST_F(PaddedVocab, GenerateSamplesPaddedIdsUnlessMasked) {
  LoadedModel lm = load_model(dir_.string(), "cpu", 1);
  LoadedModel ref = load_model(fx::reference_model_dir().string(), "cpu", 1);
  GenerateRequest req;
  req.prompt = lm.tokenizer->encode("Once upon a time");
  req.max_tokens = 24;
  req.logprobs = 3;
  std::string streamed;
  GenerateResult plain = generate(*lm.model, lm.tokenizer.get(), req, [&](int32_t, const std::string& piece) {
    streamed += piece;
    return true;
  });
  ASSERT_EQ(plain.ids.size(), 24u);
  EXPECT_GT(count_padded(plain.ids), 0) << "the fixture never samples a padded id";
  EXPECT_EQ(plain.text, lm.tokenizer->decode(plain.ids));
  EXPECT_EQ(streamed, plain.text);
  // Seeded sampling at a high temperature reaches them too, and never fails.
  GenerateRequest hot = req;
  hot.sampling = {2.f, 0, 1.f, 7};
  GenerateResult h = generate(*lm.model, lm.tokenizer.get(), hot);
  EXPECT_EQ(h.ids.size(), 24u);

  req.masked_ids = padded_ids_to_mask(*lm.model, lm.tokenizer.get());
  for (auto* r : {&req, &hot}) {
    r->masked_ids = req.masked_ids;
    GenerateResult m = generate(*lm.model, lm.tokenizer.get(), *r);
    EXPECT_EQ(count_padded(m.ids), 0);
    for (const auto& lp : m.logprobs)
      for (const auto& [id, p] : lp.top) EXPECT_LT(id, fx::kPaddedVocabTokenizerIds);
    // Among ids 0..511 the padded model's logits are the reference model's own.
    GenerateRequest rr = *r;
    rr.masked_ids.clear();
    GenerateResult want = generate(*ref.model, ref.tokenizer.get(), rr);
    EXPECT_EQ(m.ids, want.ids);
    EXPECT_EQ(m.text, want.text);
  }
}

TEST_F(PaddedVocab, EvalRunsAndMaskGivesReferencePredictions) {
  LoadedModel lm = load_model(dir_.string(), "cpu", 1);
  LoadedModel ref = load_model(fx::reference_model_dir().string(), "cpu", 1);
  const std::string jsonl =
      R"({"task": "lookup", "id": "a", "metric": "em", "segments": ["Answer from the documents.", "Doc one: the key is blue.", "Doc two: the door is red.", "Doc three: the cat is grey.", "Question: what is blue?"], "answer": "key"})"
      "\n"
      R"({"task": "lookup", "id": "b", "metric": "f1", "segments": ["Answer briefly.", "Once upon a time", "Question: when?"], "answer": "once"})";
  const auto ex = eval::parse_examples_jsonl(jsonl, "inline");
  std::vector<eval::Config> configs = {{"full", {.mode = PicMode::Full, .seam = 0}},
                                       {"pic", {.mode = PicMode::Pic, .seam = 8}}};
  // Precondition: these prompts lead greedy decoding into padded ids.
  int padded = 0;
  for (const auto& e : ex) {
    GenerateRequest req;
    for (const auto& s : eval::prompt_segments(*lm.tokenizer, e))
      req.prompt.insert(req.prompt.end(), s.begin(), s.end());
    req.max_tokens = eval::max_new_tokens(e);
    padded += count_padded(generate(*lm.model, lm.tokenizer.get(), req).ids);
  }
  ASSERT_GT(padded, 0) << "the eval prompts never reach a padded id";
  eval::RunOptions ro;
  const auto plain = eval::run(lm, ex, configs, ro);
  ASSERT_EQ(plain.size(), 2u);
  for (const auto& r : plain) EXPECT_EQ(r.predictions.size(), ex.size());
  ro.mask_padded_ids = true;
  const auto masked = eval::run(lm, ex, configs, ro);
  ro.mask_padded_ids = false;
  const auto want = eval::run(ref, ex, configs, ro);
  for (size_t c = 0; c < configs.size(); ++c) EXPECT_EQ(masked[c].predictions, want[c].predictions) << configs[c].name;
}

}  // namespace
