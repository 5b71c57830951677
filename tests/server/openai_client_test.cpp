// The official `openai` npm client, unchanged, against the built `hypic serve` (a child process on
// an ephemeral loopback port, the small test model): tools/openai_client_test.mjs runs completions
// and chat completions (plain and streamed), models.list, stream_options.include_usage and RAG
// requests whose repeated documents must come back as cached_tokens, and checks every shape.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "serve_process.h"

namespace {

namespace fs = std::filesystem;
const fs::path kSrc = fs::path(HYPIC_TEST_DATA).parent_path().parent_path();

// Runs `cmd` (stderr folded into stdout); returns the exit code and the output.
std::pair<int, std::string> run(const std::string& cmd) {
  std::string out;
  FILE* p = popen(("timeout -k 5 300 " + cmd + " 2>&1").c_str(), "r");
  if (!p) return {-1, "popen failed"};
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

TEST(OpenAIClient, OfficialNpmClientWorksUnchanged) {
  const fs::path pkg = kSrc / "tools/npm/node_modules/openai/package.json";
  if (!fs::exists(pkg)) FAIL() << "npm package 'openai' missing (" << pkg << "): run scripts/install-deps.sh";
  if (run("node --version").first != 0) FAIL() << "node not found: run scripts/install-deps.sh";

  const std::string log =
      (fs::path(::testing::TempDir()) / ("hypic_openai_client_serve_" + std::to_string(::getpid()) + ".log")).string();
  fs::remove(log);
  hypic::testing::ServeProcess srv(std::string(HYPIC_TEST_DATA) + "/models/qwen3_5_dense", {"--threads", "1"}, log);
  const auto [rc, out] =
      run("node \"" + (kSrc / "tools/openai_client_test.mjs").string() + "\" " + srv.base_url() + "/v1");
  EXPECT_EQ(rc, 0) << out << "\nserver log:\n" << srv.log();
  EXPECT_NE(out.find("checks passed"), std::string::npos) << out;
  std::printf("%s", out.c_str());
  const int st = srv.stop(SIGTERM);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "status " << st << "\n" << srv.log();
}

}  // namespace
