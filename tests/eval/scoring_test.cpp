// The C++ scorers against the task generator's own Python scorers (tools/tasks/rag_tasks.py),
// on hand-picked and random prediction/answer pairs.
#include "eval/scoring.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

using namespace hypic::eval;

TEST(Scoring, HandCheckedCases) {
  EXPECT_EQ(normalize("The  Red-Fox, a friend!"), (std::vector<std::string>{"redfox", "friend"}));
  EXPECT_EQ(exact_match("  april. ", {"April"}), 1.0);
  EXPECT_EQ(exact_match("May", {"April", "may"}), 1.0);
  EXPECT_EQ(exact_match("April 3", {"April"}), 0.0);
  EXPECT_NEAR(token_f1("red green blue", {"green blue yellow"}), 2.0 / 3.0, 1e-12);
  EXPECT_NEAR(rouge_l("a b c d", {"b d"}), 2 * (2.0 / 3) * 1.0 / (2.0 / 3 + 1.0),
              1e-12);  // "a" dropped: [b c d] vs [b d]
  EXPECT_EQ(rouge_l("", {""}), 1.0);
  EXPECT_EQ(token_f1("", {"x"}), 0.0);
  EXPECT_THROW(score("bleu", "x", {"x"}), std::invalid_argument);
}

TEST(Scoring, MatchesThePythonReference) {
  std::mt19937_64 rng(5);
  const std::vector<std::string> words = {"the",    "a",     "an",  "Red", "red,",  "green", "blue!", "salt",  "iron",
                                          "copper", "April", "May", "42",  "x-ray", "The",   "tea",   "(tin)", "wool"};
  auto phrase = [&](int max_len) {
    std::string s;
    int n = static_cast<int>(rng() % (max_len + 1));
    for (int i = 0; i < n; ++i) s += (i ? (rng() % 3 ? " " : ", ") : "") + words[rng() % words.size()];
    return s;
  };
  nlohmann::json cases = nlohmann::json::array();
  for (int i = 0; i < 300; ++i) {
    std::vector<std::string> ans;
    for (int k = 0, n = 1 + static_cast<int>(rng() % 2); k < n; ++k) ans.push_back(phrase(6));
    cases.push_back({{"pred", phrase(7)}, {"answers", ans}});
  }
  const std::string in = testing::TempDir() + "/scoring_cases_" + std::to_string(getpid()) + ".json",
                    out = testing::TempDir() + "/scoring_ref_" + std::to_string(getpid()) + ".json";
  std::ofstream(in) << cases.dump();
  const std::string cmd = "python3 -c \"import sys, json; sys.path.insert(0, '" + std::string(HYPIC_SOURCE_DIR) +
                          "/tools/tasks'); import rag_tasks as R; c = json.load(open('" + in +
                          "')); json.dump([[R.em(x['pred'], x['answers']), R.f1(x['pred'], x['answers']), "
                          "R.rouge_l(x['pred'], x['answers'])] for x in c], open('" +
                          out + "', 'w'))\"";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "python3 with tools/tasks/rag_tasks.py is needed: " << cmd;
  nlohmann::json ref = nlohmann::json::parse(std::ifstream(out));
  ASSERT_EQ(ref.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto pred = cases[i]["pred"].get<std::string>();
    const auto ans = cases[i]["answers"].get<std::vector<std::string>>();
    EXPECT_NEAR(exact_match(pred, ans), ref[i][0].get<double>(), 1e-12) << pred;
    EXPECT_NEAR(token_f1(pred, ans), ref[i][1].get<double>(), 1e-12) << pred;
    EXPECT_NEAR(rouge_l(pred, ans), ref[i][2].get<double>(), 1e-12) << pred;
  }
}
