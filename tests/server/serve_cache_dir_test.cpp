// `hypic serve --cache-dir DIR`: the persistent segment store behind the server, tested on the
// built binary (child processes on ephemeral loopback ports, the small test model).
//  - a segment prefilled through POST /v1/segments is a disk hit after a restart on the same dir;
//  - SIGKILL while segment files are being written: the restarted server comes up, answers a RAG
//    request with the same greedy text as a server without a cache dir, never reads a temp file
//    as an entry, and quarantines a damaged file instead of using it.
#include <gtest/gtest.h>

#ifdef HYPIC_HAVE_SERVER
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "serve_process.h"

namespace {

namespace fs = std::filesystem;
using hypic::testing::ServeProcess;
using nlohmann::json;

const std::string kModel = std::string(HYPIC_TEST_DATA) + "/models/qwen3_5_dense";

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::path(::testing::TempDir()) / ("hypic_serve_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string log_path(const std::string& name) {
  const std::string p =
      (fs::path(::testing::TempDir()) / ("hypic_serve_" + name + "_" + std::to_string(::getpid()) + ".log")).string();
  fs::remove(p);
  return p;
}

std::pair<int, json> request(const ServeProcess& s, const std::string& method, const std::string& path,
                             const json& body = nullptr) {
  httplib::Client c("127.0.0.1", s.port());
  c.set_read_timeout(300, 0);
  c.set_write_timeout(60, 0);
  auto r = method == "GET" ? c.Get(path) : c.Post(path, body.dump(), "application/json");
  if (!r) return {-1, json()};
  return {r->status, json::parse(r->body, nullptr, false)};
}

std::string metrics(const ServeProcess& s) {
  httplib::Client c("127.0.0.1", s.port());
  auto r = c.Get("/metrics");
  return r ? r->body : std::string();
}

// Value of an unlabelled metric line "name value" (-1 when absent).
double metric(const std::string& text, const std::string& name) {
  const std::string key = "\n" + name + " ";
  const auto p = text.find(key);
  return p == std::string::npos ? -1 : std::stod(text.substr(p + key.size()));
}

// Seeded pseudo-documents of ~60 words each, distinct per index.
std::string document(int i) {
  static const char* words[] = {"river", "bread",  "lighthouse", "valley", "market", "ship",    "map",
                                "coast", "keeper", "baker",      "dawn",   "lake",   "library", "north"};
  std::mt19937 rng(1000 + static_cast<unsigned>(i));
  std::string d = "Document " + std::to_string(i) + ":";
  for (int k = 0; k < 60; ++k) d += std::string(" ") + words[rng() % 14];
  return d + ".";
}

const std::vector<std::string> kRagDocs = {
    "Document one: the river flows north through the old valley and feeds the lake.",
    "Document two: bakers in the town rise before dawn to prepare bread for the market.",
    "Document three: the lighthouse keeper logs every ship that passes the rocky point."};

std::string rag_prompt(const std::vector<int>& order) {
  std::string p = "You answer questions using the documents.";
  for (int i : order) p += "<<PIC_SEP>>" + kRagDocs[static_cast<size_t>(i)];
  return p + "<<PIC_SEP>>Question: what does the keeper log?";
}

json rag_body(const std::vector<int>& order) {
  return json{{"prompt", rag_prompt(order)}, {"max_tokens", 12}, {"temperature", 0}, {"ignore_eos", true}};
}

// The greedy answer of a server without a cache dir (the reference for every disk-backed answer).
std::string reference_text(const std::vector<int>& order) {
  ServeProcess ref(kModel, {"--threads", "1"}, log_path("reference"));
  auto r = request(ref, "POST", "/v1/completions", rag_body(order));
  EXPECT_EQ(r.first, 200) << r.second.dump();
  EXPECT_EQ(WEXITSTATUS(ref.stop(SIGTERM)), 0);
  return r.second["choices"][0]["text"].get<std::string>();
}

TEST(ServeCacheDir, SegmentsSurviveARestart) {
  const fs::path dir = fresh_dir("restart");
  json docs = json::array();
  for (const auto& d : kRagDocs) docs.push_back({{"text", d}});
  {
    ServeProcess a(kModel, {"--threads", "1", "--cache-dir", dir.string()}, log_path("restart_a"));
    auto r = request(a, "POST", "/v1/segments", json{{"segments", docs}});
    ASSERT_EQ(r.first, 200) << r.second.dump();
    EXPECT_EQ(r.second["miss_segments"], 3);
    auto g = request(a, "GET", "/v1/segments");
    ASSERT_EQ(g.first, 200);
    EXPECT_EQ(g.second["cache"]["disk"], true);
    EXPECT_EQ(g.second["cache"]["disk_writes"], 3) << g.second.dump();
    EXPECT_EQ(g.second["cache"]["disk_entries"], 3) << g.second.dump();
    EXPECT_GT(g.second["cache"]["disk_bytes"].get<int64_t>(), 0);
    EXPECT_EQ(g.second["cache"]["disk_hits"], 0);
    EXPECT_EQ(metric(metrics(a), "hypic_segment_cache_disk_writes_total"), 3);
    const int st = a.stop(SIGTERM);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << a.log();
  }
  const std::string want = reference_text({2, 0, 1});
  {
    ServeProcess b(kModel, {"--threads", "1", "--cache-dir", dir.string()}, log_path("restart_b"));
    auto g0 = request(b, "GET", "/v1/segments");
    EXPECT_EQ(g0.second["cache"]["disk_entries"], 3) << g0.second.dump();  // found by the startup scan
    EXPECT_EQ(g0.second["cache"]["entries"], 0);                           // nothing in memory yet
    // The documents in another order, after a system prompt this store has never seen.
    auto r = request(b, "POST", "/v1/completions", rag_body({2, 0, 1}));
    ASSERT_EQ(r.first, 200) << r.second.dump();
    EXPECT_EQ(r.second["pic"]["hit_segments"], 3) << r.second.dump();
    EXPECT_EQ(r.second["pic"]["miss_segments"], 1);  // the system prompt
    EXPECT_GT(r.second["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 0);
    EXPECT_EQ(r.second["choices"][0]["text"], want);  // same as computing everything afresh
    auto g = request(b, "GET", "/v1/segments");
    EXPECT_EQ(g.second["cache"]["disk_hits"], 3) << g.second.dump();
    EXPECT_EQ(g.second["cache"]["corrupt_files"], 0);
    const std::string m = metrics(b);
    EXPECT_EQ(metric(m, "hypic_segment_cache_disk_hits_total"), 3) << m;
    EXPECT_EQ(metric(m, "hypic_segment_cache_disk_entries"), 4) << m;  // + the system prompt, written through
    EXPECT_EQ(metric(m, "hypic_segment_cache_corrupt_files_total"), 0) << m;
    // POST /v1/segments of a document that is on disk reports it cached.
    auto p = request(b, "POST", "/v1/segments", json{{"segments", json::array({docs[0]})}});
    EXPECT_EQ(p.second["data"][0]["cached"], true) << p.second.dump();
    const int st = b.stop(SIGTERM);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << b.log();
  }
  fs::remove_all(dir);
}

TEST(ServeCacheDir, SigkillDuringDiskWritesThenRestart) {
  const fs::path dir = fresh_dir("kill");
  constexpr int kClients = 4, kDocsPerClient = 12;
  int64_t writes_at_kill = 0;
  {
    ServeProcess a(kModel, {"--threads", "1", "--cache-dir", dir.string()}, log_path("kill_a"));
    // The RAG documents first (so a file exists to damage below), then a stream of prefills.
    json rag = json::array();
    for (const auto& d : kRagDocs) rag.push_back({{"text", d}});
    ASSERT_EQ(request(a, "POST", "/v1/segments", json{{"segments", rag}}).first, 200);
    std::vector<std::thread> clients;
    for (int c = 0; c < kClients; ++c)
      clients.emplace_back([&a, c] {
        json segs = json::array();
        for (int k = 0; k < kDocsPerClient; ++k) segs.push_back({{"text", document(c * kDocsPerClient + k)}});
        request(a, "POST", "/v1/segments", json{{"segments", segs}});  // cut off by the kill
      });
    // Kill once a few of the new files are written, while the rest are still being written.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (std::chrono::steady_clock::now() < deadline) {
      auto g = request(a, "GET", "/v1/segments");
      if (g.first == 200 && g.second["cache"]["disk_writes"].get<int64_t>() >= 3 + 6) {
        writes_at_kill = g.second["cache"]["disk_writes"].get<int64_t>();
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const int st = a.stop(SIGKILL);
    for (auto& t : clients) t.join();
    ASSERT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) << "status " << st << "\n" << a.log();
    ASSERT_GE(writes_at_kill, 9) << "the server did not write segment files within 120 s:\n" << a.log();
  }
  EXPECT_LT(writes_at_kill, 3 + kClients * kDocsPerClient) << "everything was written before the kill";

  // What the kill left: complete files (renamed into place) and perhaps temp files.
  int hseg = 0, tmp = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.ends_with(".hseg")) ++hseg;
    if (n.ends_with(".tmp")) ++tmp;
  }
  EXPECT_GE(hseg, 9);
  std::printf("killed after %lld disk writes: %d .hseg files, %d temp files left\n",
              static_cast<long long>(writes_at_kill), hseg, tmp);
  // A temp file that looks like a torn entry, and a torn entry under a real name (what a non-atomic
  // writer would leave): the first must never be read, the second must be quarantined.
  fs::path victim;
  {
    // The file of the second RAG document (seam 8, the default of both the segments API and requests).
    ServeProcess probe(kModel, {"--threads", "1"}, log_path("kill_probe"));
    auto r = request(probe, "POST", "/v1/segments", json{{"segments", json::array({{{"text", kRagDocs[1]}}})}});
    ASSERT_EQ(r.first, 200);
    victim = dir / (r.second["data"][0]["id"].get<std::string>() + ".hseg");
    probe.stop(SIGTERM);
  }
  ASSERT_TRUE(fs::exists(victim)) << victim;
  const auto full_size = fs::file_size(victim);
  std::string tmp_name = victim.stem().string();
  tmp_name.insert(tmp_name.begin(), '.');
  tmp_name += ".99999.0.tmp";
  fs::copy_file(victim, dir / tmp_name);
  fs::resize_file(victim, full_size / 2);

  const std::string want = reference_text({1, 2, 0});
  ServeProcess b(kModel, {"--threads", "1", "--cache-dir", dir.string()}, log_path("kill_b"));
  auto g0 = request(b, "GET", "/v1/segments");
  ASSERT_EQ(g0.first, 200);
  EXPECT_EQ(g0.second["cache"]["disk_entries"], hseg) << "temp files must not be counted as entries";
  auto r = request(b, "POST", "/v1/completions", rag_body({1, 2, 0}));
  ASSERT_EQ(r.first, 200) << r.second.dump() << b.log();
  EXPECT_EQ(r.second["choices"][0]["text"], want) << b.log();
  EXPECT_EQ(r.second["pic"]["hit_segments"], 2) << r.second.dump();   // documents three and one, from disk
  EXPECT_EQ(r.second["pic"]["miss_segments"], 2) << r.second.dump();  // the system prompt, the torn document
  auto g = request(b, "GET", "/v1/segments");
  EXPECT_EQ(g.second["cache"]["corrupt_files"], 1) << g.second.dump();
  EXPECT_EQ(g.second["cache"]["disk_hits"], 2) << g.second.dump();
  EXPECT_TRUE(fs::exists(victim.string() + ".bad"));
  EXPECT_TRUE(fs::exists(victim));  // rebuilt and written again
  EXPECT_NE(b.log().find("moved to"), std::string::npos) << b.log();

  // Every document of the killed run: complete files load, missing ones are rebuilt, nothing else
  // is rejected (SIGKILL never leaves a torn .hseg behind).
  json all = json::array();
  for (int i = 0; i < kClients * kDocsPerClient; ++i) all.push_back({{"text", document(i)}});
  auto p = request(b, "POST", "/v1/segments", json{{"segments", all}});
  ASSERT_EQ(p.first, 200) << p.second.dump();
  EXPECT_EQ(p.second["hit_segments"].get<int>(), hseg - 3) << p.second.dump();
  auto g2 = request(b, "GET", "/v1/segments");
  EXPECT_EQ(g2.second["cache"]["corrupt_files"], 1) << g2.second.dump();
  EXPECT_EQ(g2.second["cache"]["disk_write_errors"], 0) << g2.second.dump();
  auto h = request(b, "GET", "/health");
  EXPECT_EQ(h.first, 200);
  const int st = b.stop(SIGTERM);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "status " << st << "\n" << b.log();
  fs::remove_all(dir);
}

}  // namespace

#else
TEST(ServeCacheDir, NotBuilt) {
  GTEST_SKIP() << "hypic was built without cpp-httplib";
}
#endif
