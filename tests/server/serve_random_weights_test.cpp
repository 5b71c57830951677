// `hypic serve --config F --random-weights --tokenizer DIR`: real shapes served without a
// checkpoint (the serving benchmarks of issue 11), on the built binary with the small test model's
// config and tokenizer.
#include <gtest/gtest.h>

#ifdef HYPIC_HAVE_SERVER
#include <httplib.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "serve_process.h"

namespace {

namespace fs = std::filesystem;
using hypic::testing::ServeProcess;
using nlohmann::json;

const std::string kModel = std::string(HYPIC_TEST_DATA) + "/models/qwen3_5_dense";

std::string log_path(const std::string& name) {
  return (fs::path(::testing::TempDir()) / ("hypic_serve_random_" + name + "_" + std::to_string(::getpid()) + ".log"))
      .string();
}

TEST(ServeRandomWeights, AnswersTextRequestsAndPicSegments) {
  ServeProcess s(kModel,
                 {"--config", kModel + "/config.json", "--random-weights", "--tokenizer", kModel, "--threads", "1"},
                 log_path("ok"));
  httplib::Client c("127.0.0.1", s.port());
  c.set_read_timeout(120, 0);
  const json body{{"prompt", "System.<<PIC_SEP>>A document about rivers.<<PIC_SEP>>Question?"},
                  {"max_tokens", 4},
                  {"temperature", 0},
                  {"ignore_eos", true}};
  for (int round = 0; round < 2; ++round) {
    auto r = c.Post("/v1/completions", body.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    const json j = json::parse(r->body);
    EXPECT_EQ(j["usage"]["completion_tokens"], 4);
    EXPECT_GT(j["usage"]["prompt_tokens"].get<int>(), 5);
    if (round == 1) {
      EXPECT_GT(j["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 0) << r->body;
    }
  }
  EXPECT_EQ(WEXITSTATUS(s.stop(SIGTERM)), 0);
}

// Half a random-weights configuration, or a tokenizer folder without tokenizer.json, stops the
// server at start with a message naming the option.
TEST(ServeRandomWeights, BadOptionsAreRefusedAtStart) {
  struct Case {
    std::string args, needle;
  } cases[] = {
      {"--random-weights", "--random-weights and --config go together"},
      {"--config " + kModel + "/config.json", "--random-weights and --config go together"},
      {"--config " + kModel + "/config.json --random-weights --dtype q4",
       "--dtype 'q4': must be bf16, f16, f32, q8_0, q4_k or q6_k"},
      {"--tokenizer " + std::string(HYPIC_TEST_DATA), "--tokenizer: no tokenizer.json"},
  };
  for (const auto& cs : cases) {
    const std::string cmd =
        "timeout -k 5 120 " + std::string(HYPIC_BIN) + " serve --port 0 --model " + kModel + " " + cs.args + " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string out;
    char buf[512];
    while (fgets(buf, sizeof buf, p)) out += buf;
    const int st = pclose(p);
    EXPECT_NE(WEXITSTATUS(st), 0) << cs.args;
    EXPECT_NE(out.find(cs.needle), std::string::npos) << cs.args << "\n" << out;
  }
}

}  // namespace

#else
TEST(ServeRandomWeights, NotBuilt) {
  GTEST_SKIP() << "hypic was built without cpp-httplib";
}
#endif
