#include "pic/requests.h"

#include <gtest/gtest.h>

using namespace hypic;

TEST(Requests, SeparatorSplitsInOrder) {
  auto s = split_prompt("sys<<PIC_SEP>>doc A<<PIC_SEP>>doc B<<PIC_SEP>>question");
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].text, "sys");
  EXPECT_EQ(s[2].text, "doc B");
  EXPECT_EQ(s[3].text, "question");
  EXPECT_EQ(split_prompt("no separator").size(), 1u);
  auto e = split_prompt("<<PIC_SEP>>x");
  ASSERT_EQ(e.size(), 2u);
  EXPECT_TRUE(e[0].text.empty());
}

TEST(Requests, SegmentsJsonTextAndIds) {
  auto s = parse_segments_json(R"({"segments": [{"text": "a"}, {"ids": [1, 2, 3]}, {"text": "q"}]})", "f.json");
  ASSERT_EQ(s.size(), 3u);
  EXPECT_FALSE(s[0].has_ids);
  EXPECT_TRUE(s[1].has_ids);
  EXPECT_EQ(s[1].ids, (std::vector<int32_t>{1, 2, 3}));
  auto toks = tokenize_segments({s[1]}, nullptr);
  EXPECT_EQ(toks[0], s[1].ids);
}

TEST(Requests, MalformedSegmentsNameTheProblem) {
  struct Case {
    const char* json;
    const char* needle;
  };
  const Case cases[] = {
      {"{", "malformed JSON"},
      {"[]", "\"segments\" array"},
      {R"({"segments": 3})", "\"segments\" array"},
      {R"({"segments": [3]})", "segments[0] must be an object"},
      {R"({"segments": [{}]})", "needs \"text\" or \"ids\""},
      {R"({"segments": [{"text": "a"}, {"ids": [1, -2]}]})", "segments[1].ids: -2"},
      {R"({"segments": [{"ids": [1.5]}]})", "1.5"},
      {R"({"segments": [{"text": "a", "ids": [1]}]})", "both"},
      {R"({"segments": [{"text": ["x"]}]})", "segments[0].text must be a string"},
  };
  for (const auto& c : cases) {
    try {
      parse_segments_json(c.json, "req.json");
      ADD_FAILURE() << c.json;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("req.json"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(tokenize_segments({}, nullptr), std::invalid_argument);
  SegmentSpec empty_ids;
  empty_ids.has_ids = true;
  try {
    tokenize_segments({SegmentSpec{"", {1}, true}, empty_ids}, nullptr);
    ADD_FAILURE();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("segment 1 is empty"), std::string::npos);
  }
  EXPECT_THROW(load_segments_file("/nonexistent/segments.json"), std::invalid_argument);
}
