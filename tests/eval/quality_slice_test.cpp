// A slice of the quality evaluation (docs/quality.md) on the bundled default model, the trained
// hypic-mini: the first 20 prompts per task of the held-out "moderate" set, scored under full
// recompute, pic (seam 8) and naive addition with warm caches. Full must stay well above chance,
// pic must stay with full on the retrieval tasks and above naive where composition matters, and
// pic with seams longer than every document (each document recomputed in its real context) must
// score what full scores, so a regression in the model files, the tokenizer path, the engine or
// PIC fails the build. Labelled "slow" (about a minute in Release): the sanitizer build skips it.
#include <gtest/gtest.h>

#include <string>

#include "engine/loader.h"
#include "eval/harness.h"

using namespace hypic;

namespace {

struct Slice {
  double full = 0, pic = 0, naive = 0, pic_whole = 0;
};

// whole_docs: also run pic with a seam longer than any document of the set (400 tokens at most)
Slice run_task(LoadedModel& lm, const std::string& task, bool whole_docs = false) {
  eval::SetSpec s = eval::eval_set("moderate");
  s.n = 20;
  const auto ex = eval::generate_examples(task, s);
  EXPECT_EQ(ex.size(), 20u);
  std::vector<eval::Config> configs = {{"full", {.mode = PicMode::Full, .seam = 0}},
                                       {"pic/seam=8", {.mode = PicMode::Pic, .seam = 8}},
                                       {"naive", {.mode = PicMode::Naive, .seam = 0}}};
  if (whole_docs) configs.push_back({"pic/seam=1024", {.mode = PicMode::Pic, .seam = 1024}});
  const auto res = eval::run(lm, ex, configs, eval::RunOptions{});
  EXPECT_EQ(res.size(), configs.size());
  Slice out;
  for (const auto& r : res) {
    EXPECT_EQ(r.scores.size(), ex.size());
    if (r.config == "full") out.full = r.score;
    if (r.config == "pic/seam=8") out.pic = r.score;
    if (r.config == "naive") out.naive = r.score;
    if (r.config == "pic/seam=1024") out.pic_whole = r.score;
  }
  std::printf("%s: full %.3f pic/seam=8 %.3f naive %.3f", task.c_str(), out.full, out.pic, out.naive);
  if (whole_docs) std::printf(" pic/seam=1024 %.3f", out.pic_whole);
  std::printf("\n");
  return out;
}

}  // namespace

TEST(QualitySlice, FullAboveFloorAndPicNotWorseThanNaive) {
  LoadedModel lm = load_model(std::string(HYPIC_SOURCE_DIR) + "/models/default", "cpu", 0);
  // Measured on these 20 prompts (docs/quality.md), the shipped weights (PIC-aware fine-tuning in
  // one loop with train.py's packed full-recompute rows): lookup 0.85 / 0.85 / 0.85 (full / pic /
  // naive), twohop 0.90 / 0.90 / 0.80, aggregate 1.000 / 0.971 / 0.210 and 1.000 with whole-document
  // seams. The weights before: lookup 0.95 / 0.95 / 0.95, twohop 0.95 / 0.85 / 0.75, aggregate pic
  // 0.908 (0.160 before any PIC-aware fine-tuning). One prompt is 0.05: the margins leave room for
  // a prompt or two to flip on another CPU's float rounding, not for a regression.
  const Slice lookup = run_task(lm, "lookup"), twohop = run_task(lm, "twohop"),
              aggregate = run_task(lm, "aggregate", /*whole_docs=*/true);
  // Lookup's floor is 0.8 again: these weights answer 17 of these 20 (94 of 100 on the moderate set).
  EXPECT_GE(lookup.full, 0.8) << "lookup under full recompute (chance 0.043)";
  EXPECT_GE(twohop.full, 0.8) << "twohop under full recompute (chance 0.027)";
  EXPECT_GE(aggregate.full, 0.95) << "aggregate ROUGE-L under full recompute (chance 0.10)";
  // Retrieval tasks: pic stays with full (the question attends to cached K/V of every document).
  EXPECT_GE(lookup.pic, lookup.full - 0.1);
  EXPECT_GE(lookup.pic, lookup.naive - 0.1);
  // Two-hop under pic: level with full here, 1 below on the moderate set's 100 (64 / 65). The floor
  // of 0.8 fails the weights before the two-hop continuation (0.45).
  EXPECT_GE(twohop.pic, 0.8) << "twohop under pic seam 8 (chance 0.027)";
  EXPECT_GE(twohop.pic, twohop.full - 0.2);
  EXPECT_GE(twohop.pic, twohop.naive - 0.1);
  // Ordered aggregation needs cross-document context, which isolated prefill gives up: the
  // fine-tuned model learned to read it from the composed states and seams (pic 0.971 against
  // naive's 0.210), and once the seams cover every document, pic is full recompute again. The
  // one-loop fine-tune raised pic's aggregation 0.908 -> 0.971 here (92.2 -> 97.1 over 100), so the
  // floor went back up: the weights before it fail it, as do any before PIC-aware fine-tuning.
  EXPECT_GE(aggregate.pic, 0.94) << "aggregate ROUGE-L under pic seam 8 (before PIC-aware fine-tuning: 0.16)";
  EXPECT_GE(aggregate.pic, aggregate.full - 0.06) << "pic seam 8 more than 0.06 below full on aggregation";
  EXPECT_GE(aggregate.pic, aggregate.naive + 0.6);
  EXPECT_NEAR(aggregate.pic_whole, aggregate.full, 0.02) << "pic with whole-document seams must match full";
  EXPECT_GE(lookup.pic + twohop.pic + aggregate.pic, lookup.naive + twohop.naive + aggregate.naive + 0.7);
}
