// End-to-end tests of the OpenAI-compatible server: an in-process HttpServer on an ephemeral
// loopback port, driven with cpp-httplib's client, on the small test model.
#include <gtest/gtest.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>

#ifdef HYPIC_HAVE_SERVER
#include <httplib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "engine/generate.h"
#include "engine/loader.h"
#include "padded_vocab.h"
#include "server/api.h"
#include "server/http_server.h"

namespace {

using hypic::server::HttpServer;
using hypic::server::ServerOptions;
using nlohmann::json;

std::string model_dir() {
  return std::string(HYPIC_TEST_DATA) + "/models/qwen3_5_dense";
}

struct TestServer {
  hypic::LoadedModel lm;
  std::unique_ptr<HttpServer> srv;
  std::thread th;
  int port = 0;

  explicit TestServer(ServerOptions o = {}, const std::string& dir = model_dir()) {
    lm = hypic::load_model(dir, "cpu", 1);
    o.host = "127.0.0.1";
    o.port = 0;
    srv = std::make_unique<HttpServer>(lm, o);
    port = srv->bind();
    th = std::thread([this] { srv->run(); });
  }
  ~TestServer() {
    srv->stop();
    th.join();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(120, 0);
    c.set_write_timeout(120, 0);
    return c;
  }
  // POST JSON; returns status and the parsed body (null when not JSON).
  std::pair<int, json> post(const std::string& path, const std::string& body) const {
    auto c = client();
    auto r = c.Post(path, body, "application/json");
    if (!r) return {-1, json()};
    return {r->status, json::parse(r->body, nullptr, false)};
  }
  std::pair<int, json> post(const std::string& path, const json& body) const { return post(path, body.dump()); }
  std::pair<int, json> get(const std::string& path) const {
    auto c = client();
    auto r = c.Get(path);
    if (!r) return {-1, json()};
    return {r->status, json::parse(r->body, nullptr, false)};
  }
  std::string get_text(const std::string& path) const {
    auto c = client();
    auto r = c.Get(path);
    return r ? r->body : std::string();
  }
  // Streams a POST; returns the raw SSE body.
  std::string stream(const std::string& path, const json& body) const {
    auto c = client();
    auto r = c.Post(path, body.dump(), "application/json");
    EXPECT_TRUE(r);
    if (!r) return "";
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_NE(r->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
    return r->body;
  }
};

// Splits an SSE body into its `data:` payloads, checking the framing on the way.
std::vector<std::string> sse_events(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < body.size()) {
    const size_t end = body.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos) << "event not terminated by a blank line at byte " << pos;
    if (end == std::string::npos) break;
    const std::string ev = body.substr(pos, end - pos);
    EXPECT_EQ(ev.rfind("data: ", 0), 0u) << "event does not start with 'data: ': " << ev;
    out.push_back(ev.substr(6));
    pos = end + 2;
  }
  return out;
}

void expect_error(const std::pair<int, json>& r, int status, const std::string& what) {
  EXPECT_EQ(r.first, status) << what << ": " << r.second.dump();
  ASSERT_TRUE(r.second.is_object()) << what;
  ASSERT_TRUE(r.second.contains("error")) << what << ": " << r.second.dump();
  const json& e = r.second["error"];
  EXPECT_TRUE(e["message"].is_string()) << what;
  EXPECT_TRUE(e["type"].is_string()) << what;
  EXPECT_TRUE(e.contains("param")) << what;
  EXPECT_TRUE(e.contains("code")) << what;
}

json greedy(json extra) {
  json b{{"temperature", 0}, {"max_tokens", 12}, {"ignore_eos", true}};
  for (auto& [k, v] : extra.items()) b[k] = v;
  return b;
}

// The engine iterations that ran a prefill unit so far (-1 when the counter is missing).
long long prefill_steps(const TestServer& s) {
  const std::string m = s.get_text("/metrics"), key = "\nhypic_prefill_steps_total ";
  const size_t at = m.find(key);
  return at == std::string::npos ? -1LL : std::stoll(m.substr(at + key.size()));
}

// Polls /metrics until `line` appears (the engine thread updates gauges asynchronously).
bool wait_metric(const TestServer& s, const std::string& line) {
  for (int i = 0; i < 2000; ++i) {
    if (s.get_text("/metrics").find(line) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

TEST(Server, HealthAndModels) {
  TestServer s;
  auto h = s.get("/health");
  EXPECT_EQ(h.first, 200);
  EXPECT_EQ(h.second["status"], "ok");
  auto m = s.get("/v1/models");
  ASSERT_EQ(m.first, 200);
  EXPECT_EQ(m.second["object"], "list");
  ASSERT_EQ(m.second["data"].size(), 1u);
  EXPECT_EQ(m.second["data"][0]["id"], "qwen3_5_dense");
  EXPECT_EQ(m.second["data"][0]["object"], "model");
}

TEST(Server, CompletionShapeAndUsage) {
  TestServer s;
  auto r = s.post("/v1/completions", greedy({{"prompt", "The capital of France is"}, {"model", "qwen3_5_dense"}}));
  ASSERT_EQ(r.first, 200) << r.second.dump();
  const json& j = r.second;
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "qwen3_5_dense");
  EXPECT_EQ(j["id"].get<std::string>().rfind("cmpl-", 0), 0u);
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_TRUE(j["choices"][0]["text"].is_string());
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());
  const json& u = j["usage"];
  EXPECT_GT(u["prompt_tokens"].get<int>(), 0);
  EXPECT_EQ(u["completion_tokens"], 12);
  EXPECT_EQ(u["total_tokens"].get<int>(), u["prompt_tokens"].get<int>() + 12);
  EXPECT_EQ(u["prompt_tokens_details"]["cached_tokens"], 0);
  // Same greedy request, same answer.
  auto r2 = s.post("/v1/completions", greedy({{"prompt", "The capital of France is"}}));
  ASSERT_EQ(r2.first, 200);
  EXPECT_EQ(r2.second["choices"][0]["text"], j["choices"][0]["text"]);
  // Token-id prompts work too.
  auto r3 = s.post("/v1/completions", greedy({{"prompt", json::array({5, 6, 7, 8})}, {"max_tokens", 3}}));
  ASSERT_EQ(r3.first, 200) << r3.second.dump();
  EXPECT_EQ(r3.second["usage"]["prompt_tokens"], 4);
}

TEST(Server, ModesAgreeWithoutSegments) {
  TestServer s;
  std::string first;
  for (const char* mode : {"full", "prefix", "pic", "naive"}) {
    auto r = s.post("/v1/completions", greedy({{"prompt", "Hello there, world"}, {"pic", {{"mode", mode}}}}));
    ASSERT_EQ(r.first, 200) << mode << r.second.dump();
    const std::string t = r.second["choices"][0]["text"];
    if (first.empty()) first = t;
    EXPECT_EQ(t, first) << mode;
  }
}

TEST(Server, PicWithWideSeamEqualsFullAndPrefixReuses) {
  // With a seam at least as long as every segment, PIC recomputes everything at its true position:
  // the greedy answer must equal full prefill (this also covers the chunked question after the
  // composition, with a chunk smaller than the question).
  ServerOptions o;
  o.sched.prefill_chunk = 2;
  TestServer s(o);
  const std::string p = "System prompt.<<PIC_SEP>>First document here.<<PIC_SEP>>Second one.<<PIC_SEP>>The question?";
  auto full = s.post("/v1/completions", greedy({{"prompt", p}, {"pic", {{"mode", "full"}}}}));
  auto pic = s.post("/v1/completions", greedy({{"prompt", p}, {"pic", {{"mode", "pic"}, {"seam", 1000}}}}));
  ASSERT_EQ(full.first, 200);
  ASSERT_EQ(pic.first, 200) << pic.second.dump();
  EXPECT_EQ(pic.second["choices"][0]["text"], full.second["choices"][0]["text"]);
  auto pre1 = s.post("/v1/completions", greedy({{"prompt", p}, {"pic", {{"mode", "prefix"}}}}));
  auto pre2 = s.post("/v1/completions", greedy({{"prompt", p}, {"pic", {{"mode", "prefix"}}}}));
  ASSERT_EQ(pre1.first, 200);
  ASSERT_EQ(pre2.first, 200);
  EXPECT_EQ(pre1.second["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_GT(pre2.second["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 0);
  EXPECT_EQ(pre2.second["choices"][0]["text"], full.second["choices"][0]["text"]);
}

TEST(Server, ChunkedPrefillMatchesOneShot) {
  // A prompt longer than --prefill-chunk is prefilled over several engine iterations; greedy
  // output must equal a server that prefills it in one span.
  ServerOptions small;
  small.sched.prefill_chunk = 3;
  std::string a, b;
  {
    TestServer s(small);
    auto r = s.post("/v1/completions", greedy({{"prompt", "A somewhat longer prompt that spans chunks."}}));
    ASSERT_EQ(r.first, 200);
    a = r.second["choices"][0]["text"];
  }
  {
    TestServer s;
    auto r = s.post("/v1/completions", greedy({{"prompt", "A somewhat longer prompt that spans chunks."}}));
    ASSERT_EQ(r.first, 200);
    b = r.second["choices"][0]["text"];
  }
  EXPECT_EQ(a, b);
}

TEST(Server, StreamingEqualsNonStreaming) {
  TestServer s;
  const json req = greedy({{"prompt", "Once upon a time"}, {"max_tokens", 16}});
  auto full = s.post("/v1/completions", req);
  ASSERT_EQ(full.first, 200);
  json sreq = req;
  sreq["stream"] = true;
  sreq["stream_options"] = {{"include_usage", true}};
  auto events = sse_events(s.stream("/v1/completions", sreq));
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text;
  std::string finish;
  json usage;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    json c = json::parse(events[i]);
    EXPECT_EQ(c["object"], "text_completion");
    if (c["choices"].empty()) {
      usage = c["usage"];
      continue;
    }
    text += c["choices"][0]["text"].get<std::string>();
    if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(text, full.second["choices"][0]["text"].get<std::string>());
  EXPECT_EQ(finish, "length");
  ASSERT_TRUE(usage.is_object());
  EXPECT_EQ(usage["completion_tokens"], 16);
  EXPECT_EQ(usage["prompt_tokens"], full.second["usage"]["prompt_tokens"]);
}

TEST(Server, ChatAndChatStreaming) {
  TestServer s;
  const json msgs = json::array(
      {{{"role", "system"}, {"content", "You are terse."}}, {{"role", "user"}, {"content", "Say something."}}});
  auto r = s.post("/v1/chat/completions", greedy({{"messages", msgs}, {"max_tokens", 10}}));
  if (r.first == 501) GTEST_SKIP() << "built without the chat template renderer";
  ASSERT_EQ(r.first, 200) << r.second.dump();
  const json& j = r.second;
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_TRUE(j["choices"][0]["message"]["content"].is_string());
  // ChatML: "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay something.<|im_end|>\n
  // <|im_start|>assistant\n" has 8 special/structural tokens plus the text.
  EXPECT_GT(j["usage"]["prompt_tokens"].get<int>(), 8);

  json sreq = greedy({{"messages", msgs}, {"max_tokens", 10}, {"stream", true}});
  auto events = sse_events(s.stream("/v1/chat/completions", sreq));
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text;
  bool saw_role = false;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    json c = json::parse(events[i]);
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    EXPECT_FALSE(c.contains("usage"));  // no include_usage
    const json& d = c["choices"][0]["delta"];
    if (d.contains("role")) {
      EXPECT_EQ(d["role"], "assistant");
      saw_role = true;
    }
    if (d.contains("content")) text += d["content"].get<std::string>();
  }
  EXPECT_TRUE(saw_role);
  EXPECT_EQ(text, j["choices"][0]["message"]["content"].get<std::string>());
}

TEST(Server, RagRequestReusesShuffledDocuments) {
  TestServer s;
  const std::vector<std::string> docs = {
      "Document one: the river flows north through the old valley and feeds the lake.",
      "Document two: bakers in the town rise before dawn to prepare bread for the market.",
      "Document three: the lighthouse keeper logs every ship that passes the rocky point.",
      "Document four: a quiet library holds maps of coastlines drawn centuries ago."};
  auto prompt = [&](std::vector<int> order) {
    std::string p = "You answer questions using the documents.";
    for (int i : order) p += "<<PIC_SEP>>" + docs[static_cast<size_t>(i)];
    return p + "<<PIC_SEP>>Question: what does the keeper log?";
  };
  auto r1 = s.post("/v1/completions", greedy({{"prompt", prompt({0, 1, 2, 3})}, {"max_tokens", 4}}));
  ASSERT_EQ(r1.first, 200) << r1.second.dump();
  EXPECT_EQ(r1.second["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(r1.second["pic"]["miss_segments"], 5);
  // Engine phase counts: a request whose entries are all cached composes and builds nothing.
  auto phase_count = [&](const std::string& phase) {
    const std::string m = s.get_text("/metrics"), key = "hypic_engine_phase_seconds_count{phase=\"" + phase + "\"} ";
    const size_t at = m.find(key);
    return at == std::string::npos ? 0L : std::stol(m.substr(at + key.size()));
  };
  const long builds = phase_count("build"), composes = phase_count("compose");
  EXPECT_GE(builds, 5);  // r1 built its five entries
  auto r2 = s.post("/v1/completions", greedy({{"prompt", prompt({2, 0, 3, 1})}, {"max_tokens", 4}}));
  ASSERT_EQ(r2.first, 200) << r2.second.dump();
  EXPECT_EQ(phase_count("build"), builds);
  EXPECT_GT(phase_count("compose"), composes);
  const int cached = r2.second["usage"]["prompt_tokens_details"]["cached_tokens"];
  EXPECT_GT(cached, 0);
  EXPECT_LT(cached, r2.second["usage"]["prompt_tokens"].get<int>());
  EXPECT_EQ(r2.second["pic"]["hit_segments"], 5);
  EXPECT_EQ(r2.second["pic"]["miss_segments"], 0);
  EXPECT_EQ(r2.second["usage"]["prompt_tokens"], r1.second["usage"]["prompt_tokens"]);
  // Full mode reuses nothing.
  auto r3 = s.post("/v1/completions",
                   greedy({{"prompt", prompt({3, 2, 1, 0})}, {"max_tokens", 2}, {"pic", {{"mode", "full"}}}}));
  ASSERT_EQ(r3.first, 200);
  EXPECT_EQ(r3.second["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  // Metrics saw the reuse.
  const std::string m = s.get_text("/metrics");
  EXPECT_NE(m.find("hypic_segment_cache_hits_total 5"), std::string::npos) << m;
  EXPECT_NE(m.find("hypic_prompt_tokens_reused_total " + std::to_string(cached)), std::string::npos) << m;
  // The engine's time went to entry builds and compositions (and the full request's prefill).
  for (const char* phase : {"build", "compose", "prefill"})
    EXPECT_NE(m.find(std::string("hypic_engine_phase_seconds_count{phase=\"") + phase + "\"}"), std::string::npos)
        << phase << " in\n"
        << m;
}

// The next turn of a conversation repeats the previous prompt: pic starts from the composed
// state of that exact prefix (issue 19), reports it in cached_tokens and pic.prefix_tokens, and
// answers exactly as a server that composes everything afresh (also with a chunked question).
TEST(Server, PicReusesTheExactPrefixOfThePreviousTurn) {
  const std::string ctx =
      "You answer from the documents.<<PIC_SEP>>Document one: the river flows north."
      "<<PIC_SEP>>Document two: bakers rise before dawn.";
  const std::string turn1 = ctx + "<<PIC_SEP>>Question: where does the river flow?";
  const std::string turn2 = ctx + "<<PIC_SEP>>Question: where does the river flow? Answer: north." +
                            "<<PIC_SEP>>Question: when do bakers rise?";
  for (int chunk : {512, 2}) {
    SCOPED_TRACE("prefill chunk " + std::to_string(chunk));
    ServerOptions o;
    o.sched.prefill_chunk = chunk;
    TestServer warm(o);
    auto r1 = warm.post("/v1/completions", greedy({{"prompt", turn1}}));
    ASSERT_EQ(r1.first, 200) << r1.second.dump();
    EXPECT_EQ(r1.second["pic"]["prefix_tokens"], 0);
    auto r2 = warm.post("/v1/completions", greedy({{"prompt", turn2}}));
    ASSERT_EQ(r2.first, 200) << r2.second.dump();
    const json& p2 = r2.second["pic"];
    const auto& tok = *warm.lm.tokenizer;
    const int q1 = static_cast<int>(tok.encode("Question: where does the river flow?").size());
    const int q2 = static_cast<int>(tok.encode("Question: when do bakers rise?").size());
    const int ctx_tokens = r1.second["usage"]["prompt_tokens"].get<int>() - q1;
    EXPECT_EQ(p2["prefix_tokens"], ctx_tokens);
    EXPECT_EQ(p2["hit_segments"], 3);  // from the snapshot; the previous turn is a new middle segment
    EXPECT_EQ(p2["miss_segments"], 1);
    EXPECT_EQ(r2.second["usage"]["prompt_tokens_details"]["cached_tokens"], p2["reused_tokens"]);
    EXPECT_EQ(p2["reused_tokens"], ctx_tokens);  // the previous turn was built for this request
    // An exact repeat: the whole context from the snapshot, only the question computed.
    auto r3 = warm.post("/v1/completions", greedy({{"prompt", turn2}}));
    ASSERT_EQ(r3.first, 200);
    EXPECT_EQ(r3.second["pic"]["computed_tokens"], q2);
    EXPECT_EQ(r3.second["pic"]["prefix_tokens"].get<int>(), r3.second["usage"]["prompt_tokens"].get<int>() - q2);
    EXPECT_EQ(r3.second["usage"]["prompt_tokens_details"]["cached_tokens"], r3.second["pic"]["prefix_tokens"]);
    TestServer cold(o);
    auto c = cold.post("/v1/completions", greedy({{"prompt", turn2}}));
    ASSERT_EQ(c.first, 200);
    EXPECT_EQ(c.second["pic"]["prefix_tokens"], 0);
    EXPECT_EQ(r2.second["choices"][0]["text"], c.second["choices"][0]["text"]);
    EXPECT_EQ(r3.second["choices"][0]["text"], c.second["choices"][0]["text"]);
  }
}

TEST(Server, ChatPartsMarkedForCachingBecomeSegments) {
  TestServer s;
  auto msgs = [](const char* a, const char* b) {
    return json::array(
        {{{"role", "system"}, {"content", "Use the documents."}},
         {{"role", "user"},
          {"content", json::array({{{"type", "text"}, {"text", a}, {"cache", "segment"}},
                                   {{"type", "text"}, {"text", b}, {"cache_control", {{"type", "ephemeral"}}}},
                                   {{"type", "text"}, {"text", "Which document mentions bread?"}}})}}});
  };
  const char* d1 = "The first document talks about rivers and lakes in detail.";
  const char* d2 = "The second document talks about bread and the morning market.";
  auto r1 = s.post("/v1/chat/completions", greedy({{"messages", msgs(d1, d2)}, {"max_tokens", 3}}));
  if (r1.first == 501) GTEST_SKIP() << "built without the chat template renderer";
  ASSERT_EQ(r1.first, 200) << r1.second.dump();
  EXPECT_EQ(r1.second["pic"]["segments"], 4);
  auto r2 = s.post("/v1/chat/completions", greedy({{"messages", msgs(d2, d1)}, {"max_tokens", 3}}));
  ASSERT_EQ(r2.first, 200);
  EXPECT_GT(r2.second["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 0);
}

// A segment cache too small for every running request's entries at once: requests that find it
// full of entries other requests hold let go of theirs and wait their turn, and all of them answer
// as a server with room for everything does. A request whose own segments exceed the budget gets a
// 503 that says so.
TEST(Server, FullSegmentCacheMakesRequestsWaitNotFail) {
  auto doc = [](int r, int d) {
    std::string s = "Document " + std::to_string(r) + "." + std::to_string(d) + ":";
    const char* words[] = {"river", "market", "lantern", "harbor", "summit", "archive", "meadow", "ferry"};
    for (int w = 0; w < 120; ++w) s += std::string(" ") + words[(r * 7 + d * 3 + w * 5) % 8];
    return s + ".";
  };
  auto prompt = [&](int r) {
    std::string p = "Answer from the documents.";
    for (int d = 0; d < 4; ++d) p += "<<PIC_SEP>>" + doc(r, d);
    return p + "<<PIC_SEP>>Question: which word comes first?";
  };
  std::vector<std::string> want;
  size_t one_request = 0;
  {
    TestServer big;
    for (int r = 0; r < 3; ++r) {
      auto res = big.post("/v1/completions", greedy({{"prompt", prompt(r)}, {"max_tokens", 6}}));
      ASSERT_EQ(res.first, 200) << res.second.dump();
      want.push_back(res.second["choices"][0]["text"]);
      if (r == 0) one_request = big.get("/v1/segments").second["cache"]["bytes"].get<size_t>();
    }
  }
  ASSERT_GT(one_request, 0u);
  {
    ServerOptions o;
    o.sched.cache_budget_bytes = one_request + one_request / 3;  // one request's entries, not two
    o.sched.max_running = 3;
    TestServer tight(o);
    std::vector<std::future<std::pair<int, json>>> got;
    for (int r = 0; r < 3; ++r)
      got.push_back(std::async(std::launch::async, [&, r] {
        return tight.post("/v1/completions", greedy({{"prompt", prompt(r)}, {"max_tokens", 6}}));
      }));
    for (int r = 0; r < 3; ++r) {
      auto res = got[static_cast<size_t>(r)].get();
      ASSERT_EQ(res.first, 200) << "request " << r << ": " << res.second.dump();
      EXPECT_EQ(res.second["choices"][0]["text"], want[static_cast<size_t>(r)]) << "request " << r;
    }
    const std::string m = tight.get_text("/metrics");
    const size_t at = m.find("\nhypic_segment_cache_waits_total ");
    ASSERT_NE(at, std::string::npos) << m;
    EXPECT_GT(std::stod(m.substr(at + 33)), 0) << "three requests of four new documents each in a cache for one";
  }
  {
    ServerOptions o;
    o.sched.cache_budget_bytes = one_request / 3;  // not even one request's entries
    TestServer small(o);
    auto res = small.post("/v1/completions", greedy({{"prompt", prompt(0)}, {"max_tokens", 2}}));
    expect_error(res, 503, "segments over the cache budget");
    EXPECT_NE(res.second["error"]["message"].get<std::string>().find("segment"), std::string::npos)
        << res.second.dump();
  }
}

TEST(Server, StopStrings) {
  TestServer s;
  const json base = greedy({{"prompt", "Numbers and letters:"}, {"max_tokens", 24}});
  auto r = s.post("/v1/completions", base);
  ASSERT_EQ(r.first, 200);
  const std::string full = r.second["choices"][0]["text"];
  ASSERT_GT(full.size(), 4u);
  // A stop string taken from the middle of the greedy text (one whole UTF-8 character).
  size_t p = full.size() / 2;
  while (p > 1 && (static_cast<unsigned char>(full[p]) & 0xC0) == 0x80) --p;
  size_t q = p + 1;
  while (q < full.size() && (static_cast<unsigned char>(full[q]) & 0xC0) == 0x80) ++q;
  const std::string stop = full.substr(p, q - p);
  const std::string expect = full.substr(0, full.find(stop));
  json req = base;
  req["stop"] = json::array({stop, "never-appears-xyz"});
  auto rs = s.post("/v1/completions", req);
  ASSERT_EQ(rs.first, 200);
  EXPECT_EQ(rs.second["choices"][0]["text"], expect);
  EXPECT_EQ(rs.second["choices"][0]["finish_reason"], "stop");
  EXPECT_LT(rs.second["usage"]["completion_tokens"].get<int>(), 24);
  // Streaming with the same stop yields the same text.
  req["stream"] = true;
  auto events = sse_events(s.stream("/v1/completions", req));
  std::string text;
  for (size_t i = 0; i + 1 < events.size(); ++i)
    text += json::parse(events[i])["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(text, expect);
  // A longer stop string (several characters, likely spanning tokens): streamed text must hold
  // back its possible beginnings and still equal the non-streamed text.
  size_t q2 = std::min(full.size(), p + 4);
  while (q2 < full.size() && (static_cast<unsigned char>(full[q2]) & 0xC0) == 0x80) ++q2;
  const std::string long_stop = full.substr(p, q2 - p);
  const std::string long_expect = full.substr(0, full.find(long_stop));
  json lreq = base;
  lreq["stop"] = long_stop;
  auto rl = s.post("/v1/completions", lreq);
  ASSERT_EQ(rl.first, 200);
  EXPECT_EQ(rl.second["choices"][0]["text"], long_expect);
  lreq["stream"] = true;
  auto levents = sse_events(s.stream("/v1/completions", lreq));
  std::string ltext;
  for (size_t i = 0; i + 1 < levents.size(); ++i)
    ltext += json::parse(levents[i])["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(ltext, long_expect);
  // A single string works too.
  json one = base;
  one["stop"] = stop;
  auto r1 = s.post("/v1/completions", one);
  ASSERT_EQ(r1.first, 200);
  EXPECT_EQ(r1.second["choices"][0]["text"], expect);
}

TEST(Server, LogprobsShape) {
  TestServer s;
  auto r = s.post("/v1/completions", greedy({{"prompt", "Hello"}, {"max_tokens", 5}, {"logprobs", 3}}));
  ASSERT_EQ(r.first, 200);
  const json& lp = r.second["choices"][0]["logprobs"];
  ASSERT_TRUE(lp.is_object()) << r.second.dump();
  ASSERT_EQ(lp["tokens"].size(), 5u);
  ASSERT_EQ(lp["token_logprobs"].size(), 5u);
  ASSERT_EQ(lp["top_logprobs"].size(), 5u);
  ASSERT_EQ(lp["text_offset"].size(), 5u);
  EXPECT_EQ(lp["text_offset"][0], 0);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_LE(lp["token_logprobs"][i].get<double>(), 0.0);
    EXPECT_TRUE(lp["top_logprobs"][i].is_object());
    EXPECT_GE(lp["top_logprobs"][i].size(), 1u);
    EXPECT_LE(lp["top_logprobs"][i].size(), 3u);
  }
  const json msgs = json::array({{{"role", "user"}, {"content", "Hi"}}});
  auto c = s.post("/v1/chat/completions",
                  greedy({{"messages", msgs}, {"max_tokens", 4}, {"logprobs", true}, {"top_logprobs", 2}}));
  if (c.first == 501) return;
  ASSERT_EQ(c.first, 200) << c.second.dump();
  const json& content = c.second["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 4u);
  for (const auto& t : content) {
    EXPECT_TRUE(t["token"].is_string());
    EXPECT_LE(t["logprob"].get<double>(), 0.0);
    EXPECT_TRUE(t["bytes"].is_array());
    ASSERT_EQ(t["top_logprobs"].size(), 2u);
    EXPECT_GE(t["top_logprobs"][0]["logprob"].get<double>(), t["top_logprobs"][1]["logprob"].get<double>());
    // Greedy: the chosen token is the most likely one.
    EXPECT_FLOAT_EQ(t["top_logprobs"][0]["logprob"].get<float>(), t["logprob"].get<float>());
  }
  // Without logprobs: null.
  auto n = s.post("/v1/chat/completions", greedy({{"messages", msgs}, {"max_tokens", 2}}));
  EXPECT_TRUE(n.second["choices"][0]["logprobs"].is_null());
}

// A segment no longer than the seam has no body a request could reuse: it is not stored (an entry
// would cost megabytes of transition operators for nothing), and the answer says so.
TEST(Server, SegmentsWithoutABodyAreNotStored) {
  TestServer s;
  auto post =
      s.post("/v1/segments",
             json{{"segments", json::array({{{"ids", {5, 6, 7}}}, {{"ids", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}}}})},
                  {"seam", 8}});
  ASSERT_EQ(post.first, 200) << post.second.dump();
  ASSERT_EQ(post.second["data"].size(), 2u);
  EXPECT_EQ(post.second["data"][0]["stored"], false);
  EXPECT_EQ(post.second["data"][0]["bytes"], 0);
  EXPECT_EQ(post.second["data"][0]["tokens"], 3);
  EXPECT_EQ(post.second["data"][1]["stored"], true);
  EXPECT_GT(post.second["data"][1]["bytes"].get<int64_t>(), 0);
  EXPECT_EQ(post.second["miss_segments"], 1);
  auto list = s.get("/v1/segments");
  ASSERT_EQ(list.first, 200);
  EXPECT_EQ(list.second["cache"]["entries"], 1);
  EXPECT_EQ(s.get("/v1/segments/" + post.second["data"][0]["id"].get<std::string>()).first, 404);
}

// A segment longer than the build chunk is built over several engine iterations (one chunk of its
// tokens each), then served from the cache like any other.
TEST(Server, LongSegmentsAreBuiltInSteps) {
  TestServer s;
  std::vector<int> ids(2600);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int>((i * 37 + 11) % 500);
  const json body{{"segments", json::array({{{"ids", ids}}})}, {"seam", 8}};
  auto cold = s.post("/v1/segments", body);
  ASSERT_EQ(cold.first, 200) << cold.second.dump();
  EXPECT_EQ(cold.second["data"][0]["cached"], false);
  EXPECT_EQ(cold.second["data"][0]["tokens"], 2600);
  auto warm = s.post("/v1/segments", body);
  ASSERT_EQ(warm.first, 200) << warm.second.dump();
  EXPECT_EQ(warm.second["data"][0]["cached"], true);
  EXPECT_EQ(warm.second["data"][0]["id"], cold.second["data"][0]["id"]);
  EXPECT_EQ(warm.second["data"][0]["bytes"], cold.second["data"][0]["bytes"]);
  EXPECT_GE(prefill_steps(s), 3) << "one prefill step per chunk of 1024 tokens";
}

// A prompt of many cached segments is composed at most compose_chunk seam rows per engine
// iteration, so it does not hold the engine; the answer is the one-iteration answer.
TEST(Server, ManySegmentPromptsAreComposedInSteps) {
  auto prompt = [](bool reversed) {
    std::string p = "You answer from the documents.";
    for (int k = 0; k < 24; ++k) {
      const int i = reversed ? 23 - k : k;
      p += "<<PIC_SEP>>Document " + std::to_string(i) + ": item " + std::to_string(i * 7) + " is stored in room " +
           std::to_string(i % 5) + " next to the red boxes.";
    }
    return p + "<<PIC_SEP>>Where is 21?";
  };
  json text[2];
  long long composed[2];
  for (int c = 0; c < 2; ++c) {
    ServerOptions o;
    o.sched.compose_chunk = c == 0 ? 4096 : 24;  // 24: three 8-token seams per iteration
    TestServer s(o);
    // The documents cached in another order: every segment hits, and no exact-prefix snapshot fits.
    auto cold = s.post("/v1/completions", greedy({{"prompt", prompt(true)}, {"max_tokens", 1}}));
    ASSERT_EQ(cold.first, 200) << cold.second.dump();
    const long long before = prefill_steps(s);
    auto warm = s.post("/v1/completions", greedy({{"prompt", prompt(false)}, {"max_tokens", 6}, {"logprobs", 2}}));
    ASSERT_EQ(warm.first, 200) << warm.second.dump();
    EXPECT_EQ(warm.second["pic"]["hit_segments"], 25);
    EXPECT_EQ(warm.second["pic"]["prefix_tokens"], 0);
    ASSERT_LE(warm.second["pic"]["computed_tokens"].get<int>(), 24 * 8 + 24) << "a question longer than a chunk";
    composed[c] = prefill_steps(s) - before;
    text[c] = warm.second["choices"][0];
  }
  EXPECT_EQ(text[0], text[1]);
  EXPECT_EQ(composed[0], 1);  // 24 seams and the question in one step
  EXPECT_GE(composed[1], 8);  // three seams a step
}

// Prefix mode recomputes an uncached context at most --prefill-chunk tokens per engine iteration
// (a long prompt does not hold every stream behind it), snapshotting each segment end; the answer
// is the one-iteration answer (to rounding), and a later request reuses the snapshots.
TEST(Server, PrefixModeRecomputesInSteps) {
  std::string p = "You answer from the documents.";
  for (int i = 0; i < 6; ++i)
    p += "<<PIC_SEP>>Document " + std::to_string(i) + ": item " + std::to_string(i * 7) + " is stored in room " +
         std::to_string(i % 5) + " next to the red boxes, behind the blue crates, under the window.";
  p += "<<PIC_SEP>>Where is 21?";
  json text[2];
  long long taken[2];
  for (int c = 0; c < 2; ++c) {
    ServerOptions o;
    o.sched.prefill_chunk = c == 0 ? 4096 : 16;
    TestServer s(o);
    const long long before = prefill_steps(s);
    auto r = s.post("/v1/completions",
                    greedy({{"prompt", p}, {"max_tokens", 5}, {"logprobs", 2}, {"pic", {{"mode", "prefix"}}}}));
    ASSERT_EQ(r.first, 200) << r.second.dump();
    taken[c] = prefill_steps(s) - before;
    text[c] = r.second["choices"][0];
    EXPECT_EQ(r.second["pic"]["miss_segments"], 7);
    // The same prompt again: every segment end was snapshotted, only the question is computed.
    auto again = s.post("/v1/completions", greedy({{"prompt", p}, {"max_tokens", 1}, {"pic", {{"mode", "prefix"}}}}));
    ASSERT_EQ(again.first, 200) << again.second.dump();
    EXPECT_EQ(again.second["pic"]["hit_segments"], 7);
    EXPECT_LT(again.second["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(),
              again.second["usage"]["prompt_tokens"].get<int>());
    EXPECT_GT(again.second["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 100);
  }
  // The same tokens; log-probs to rounding (the linear layers' chunked recurrence splits the
  // context at other points).
  EXPECT_EQ(text[0]["text"], text[1]["text"]);
  EXPECT_EQ(text[0]["logprobs"]["tokens"], text[1]["logprobs"]["tokens"]);
  for (size_t i = 0; i < text[0]["logprobs"]["token_logprobs"].size(); ++i)
    EXPECT_NEAR(text[0]["logprobs"]["token_logprobs"][i].get<double>(),
                text[1]["logprobs"]["token_logprobs"][i].get<double>(), 1e-4);
  EXPECT_EQ(taken[0], 1);  // the whole prompt in one unit
  EXPECT_GE(taken[1], 8);  // 16 tokens a unit
}

TEST(Server, SegmentsRoundTrip) {
  TestServer s;
  const std::string d1 = "A document about glaciers and how slowly they move across mountains.";
  const std::string d2 = "A document about orchards, apples and the autumn harvest festival.";
  auto post = s.post("/v1/segments", json{{"segments", json::array({{{"text", d1}}, {{"text", d2}}})}});
  ASSERT_EQ(post.first, 200) << post.second.dump();
  ASSERT_EQ(post.second["data"].size(), 2u);
  const std::string id1 = post.second["data"][0]["id"], id2 = post.second["data"][1]["id"];
  EXPECT_EQ(id1.size(), 16u);
  EXPECT_NE(id1, id2);
  EXPECT_GT(post.second["data"][0]["tokens"].get<int>(), 0);
  EXPECT_EQ(post.second["data"][0]["cached"], false);
  // Posting again finds them cached.
  auto again = s.post("/v1/segments", json{{"segments", json::array({{{"text", d1}}})}});
  ASSERT_EQ(again.first, 200);
  EXPECT_EQ(again.second["data"][0]["cached"], true);
  EXPECT_EQ(again.second["data"][0]["id"], id1);

  auto list = s.get("/v1/segments");
  ASSERT_EQ(list.first, 200);
  EXPECT_EQ(list.second["data"].size(), 2u);
  EXPECT_EQ(list.second["cache"]["entries"], 2);
  EXPECT_GT(list.second["cache"]["bytes"].get<int64_t>(), 0);
  auto one = s.get("/v1/segments/" + id1);
  ASSERT_EQ(one.first, 200);
  EXPECT_EQ(one.second["tokens"], post.second["data"][0]["tokens"]);

  // A request using both documents in the middle is served from the prefilled entries.
  auto r = s.post(
      "/v1/completions",
      greedy({{"prompt", "System.<<PIC_SEP>>" + d2 + "<<PIC_SEP>>" + d1 + "<<PIC_SEP>>Question?"}, {"max_tokens", 2}}));
  ASSERT_EQ(r.first, 200);
  EXPECT_EQ(r.second["pic"]["hit_segments"], 2);  // the two documents; the system prefix was new
  EXPECT_GT(r.second["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 0);

  auto del = s.get("/v1/segments");
  const size_t before = del.second["data"].size();
  auto c = s.client();
  auto d = c.Delete("/v1/segments/" + id1);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->status, 200) << d->body;
  EXPECT_EQ(s.get("/v1/segments/" + id1).first, 404);
  EXPECT_EQ(s.get("/v1/segments").second["data"].size(), before - 1);
  auto d2r = c.Delete("/v1/segments/" + id1);
  ASSERT_TRUE(d2r);
  EXPECT_EQ(d2r->status, 404);
  auto bad = c.Delete("/v1/segments/not-a-hex-id");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 404);
  auto all = c.Delete("/v1/segments");
  ASSERT_TRUE(all);
  EXPECT_EQ(all->status, 200);
  auto empty = s.get("/v1/segments");
  EXPECT_EQ(empty.second["data"].size(), 0u);
  EXPECT_EQ(empty.second["cache"]["entries"], 0);
  // ids segments, and bad bodies.
  auto ids = s.post("/v1/segments", json{{"segments", json::array({{{"ids", {1, 2, 3, 4}}}})}, {"seam", 0}});
  ASSERT_EQ(ids.first, 200);
  EXPECT_EQ(ids.second["data"][0]["seam"], 0);
  expect_error(s.post("/v1/segments", json{{"segments", json::array({{{"ids", {1, 99999}}}})}}), 400,
               "id out of vocab");
  expect_error(s.post("/v1/segments", json{{"segments", "x"}}), 400, "segments not a list");
  expect_error(s.post("/v1/segments", json{{"segments", json::array({{{"text", ""}}})}}), 400, "empty segment");
}

TEST(Server, MetricsContent) {
  TestServer s;
  ASSERT_EQ(s.post("/v1/completions", greedy({{"prompt", "Hi"}, {"max_tokens", 3}})).first, 200);
  ASSERT_EQ(s.get("/nope").first, 404);
  // Request counters are updated after the response has been written.
  ASSERT_TRUE(wait_metric(s, "hypic_requests_total{endpoint=\"other\",status=\"404\"} 1"));
  const std::string m = s.get_text("/metrics");
  for (const char* want :
       {"# TYPE hypic_requests_total counter", "hypic_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1",
        "hypic_requests_total{endpoint=\"other\",status=\"404\"} 1",
        "# TYPE hypic_time_to_first_token_seconds histogram", "hypic_time_to_first_token_seconds_count 1",
        "hypic_time_to_first_token_seconds_bucket{le=\"+Inf\"} 1", "hypic_request_latency_seconds_count 1",
        "hypic_generation_tokens_total 3", "hypic_prompt_tokens_prefilled_total", "hypic_prompt_tokens_reused_total 0",
        "hypic_segment_cache_hits_total", "hypic_segment_cache_misses_total", "hypic_segment_cache_evictions_total",
        "hypic_segment_cache_bytes", "hypic_segment_cache_entries", "hypic_queue_depth 0", "hypic_running_requests",
        // One prefill unit, three tokens picked, two decode forwards (the third token ends the request).
        "# TYPE hypic_engine_phase_seconds histogram", "hypic_engine_phase_seconds_count{phase=\"prefill\"} 1",
        "hypic_engine_phase_seconds_count{phase=\"sample\"} 3", "hypic_engine_phase_seconds_count{phase=\"decode\"} 2",
        "hypic_engine_phase_seconds_bucket{phase=\"decode\",le=\"+Inf\"} 2"})
    EXPECT_NE(m.find(want), std::string::npos) << "missing '" << want << "' in\n" << m;
}

TEST(Server, HostileInputsGetClearErrors) {
  ServerOptions o;
  o.max_body_bytes = 1 << 20;
  TestServer s(o);
  const std::string C = "/v1/completions", CH = "/v1/chat/completions";
  expect_error(s.post(C, std::string("{\"prompt\": \"abc\", ")), 400, "malformed JSON");
  expect_error(s.post(C, std::string("")), 400, "empty body");
  expect_error(s.post(C, std::string("[1,2,3]")), 400, "array body");
  expect_error(s.post(C, std::string("{\"prompt\": \"bad \xff\xfe utf8\"}")), 400, "invalid UTF-8");
  expect_error(s.post(C, std::string("{\"prompt\": \"lone \\ud800 surrogate\"}")), 400, "lone surrogate");
  expect_error(s.post(C, std::string(100000, '[') + std::string(100000, ']')), 400, "deep nesting");
  expect_error(s.post(C, "{\"prompt\": \"x\", \"a\": " + std::string(5000, '{') + "}"), 400, "deep unterminated");
  {
    const std::string huge = "{\"prompt\": \"" + std::string(2 << 20, 'a') + "\"}";
    auto r = s.post(C, huge);
    if (r.first != -1) expect_error(r, 413, "huge body");  // the server may close before the upload ends
  }
  const json ok = {{"prompt", "Hello"}, {"max_tokens", 2}};
  auto with = [&](const char* k, json v) {
    json b = ok;
    b[k] = std::move(v);
    return b;
  };
  expect_error(s.post(C, with("temperature", -1)), 400, "negative temperature");
  expect_error(s.post(C, with("temperature", "hot")), 400, "string temperature");
  expect_error(s.post(C, with("top_p", 0)), 400, "top_p 0");
  expect_error(s.post(C, with("top_p", 1.5)), 400, "top_p 1.5");
  expect_error(s.post(C, with("top_k", -5)), 400, "top_k -5");
  expect_error(s.post(C, with("max_tokens", -1)), 400, "negative max_tokens");
  expect_error(s.post(C, with("max_tokens", 1e20)), 400, "absurd max_tokens");
  expect_error(s.post(C, with("max_tokens", int64_t(1) << 40)), 400, "max_tokens over int32");
  expect_error(s.post(C, with("max_tokens", "10")), 400, "string max_tokens");
  expect_error(s.post(C, with("n", 2)), 400, "n=2");
  expect_error(s.post(C, with("n", 0)), 400, "n=0");
  expect_error(s.post(C, with("logprobs", 1000)), 400, "logprobs 1000");
  expect_error(s.post(C, with("stop", 3)), 400, "numeric stop");
  expect_error(s.post(C, with("stop", json::array({"a", 1}))), 400, "mixed stop list");
  expect_error(s.post(C, with("stop", "")), 400, "empty stop");
  expect_error(s.post(C, with("stream", "yes")), 400, "string stream");
  expect_error(s.post(C, with("seed", "x")), 400, "string seed");
  expect_error(s.post(C, with("pic", {{"mode", "magic"}})), 400, "unknown pic mode");
  expect_error(s.post(C, with("pic", {{"seam", -1}})), 400, "negative seam");
  expect_error(s.post(C, with("pic", "pic")), 400, "pic not an object");
  expect_error(s.post(C, with("model", "gpt-4")), 404, "unknown model");
  expect_error(s.post(C, with("prompt", 5)), 400, "numeric prompt");
  expect_error(s.post(C, with("prompt", "")), 400, "empty prompt");
  expect_error(s.post(C, with("prompt", "<<PIC_SEP>><<PIC_SEP>>")), 400, "only separators");
  expect_error(s.post(C, with("prompt", json::array({1, 2, 100000}))), 400, "id out of vocab");
  expect_error(s.post(C, with("prompt", json::array({1, -2}))), 400, "negative id");
  expect_error(s.post(C, with("prompt", json::array({"a", "b"}))), 400, "batched prompts");
  expect_error(s.post(C, with("prompt", std::vector<int>(5000, 7))), 413, "prompt over the context");
  expect_error(s.post(C, json{{"max_tokens", 2}}), 400, "missing prompt");
  expect_error(s.post(CH, json{{"messages", "hi"}}), 400, "messages not a list");
  expect_error(s.post(CH, json{{"messages", json::array()}}), 400, "empty messages");
  expect_error(s.post(CH, json{{"messages", json::array({{{"content", "x"}}})}}), 400, "message without role");
  expect_error(s.post(CH, json{{"messages", json::array({{{"role", "user"}, {"content", 5}}})}}), 400,
               "numeric content");
  expect_error(
      s.post(CH, json{{"messages",
                       json::array({{{"role", "user"}, {"content", json::array({{{"type", "image_url"}}})}}})}}),
      400, "image part");
  expect_error(s.post(CH, json{{"messages", json::array({{{"role", "user"}, {"content", "x"}}})}, {"logprobs", 1}}),
               400, "chat logprobs not bool");
  expect_error(s.post(CH, json{{"messages", json::array({{{"role", "user"}, {"content", "x"}}})}, {"top_logprobs", 3}}),
               400, "top_logprobs without logprobs");
  expect_error(s.get("/v1/nothing"), 404, "unknown route");
  expect_error(s.post("/v1/nothing", json::object()), 404, "unknown POST route");
  expect_error(s.get(C), 405, "GET on completions");
  expect_error(s.post("/v1/models", json::object()), 405, "POST on models");
  {
    auto c = s.client();
    auto r = c.Put("/v1/segments", "{}", "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 405);
    EXPECT_EQ(r->get_header_value("Allow"), "GET, POST, DELETE");
  }
  // Still serving.
  auto r = s.post(C, greedy({{"prompt", "Hello"}, {"max_tokens", 3}}));
  ASSERT_EQ(r.first, 200) << r.second.dump();
  EXPECT_EQ(r.second["usage"]["completion_tokens"], 3);
  EXPECT_EQ(s.get("/health").first, 200);
}

TEST(Server, QueueFullGives429AndDisconnectCancels) {
  ServerOptions o;
  o.sched.max_running = 1;
  o.sched.max_queue = 1;
  TestServer s(o);
  // 1) A long stream occupies the only running slot; it is read until its first token, then the
  //    client hangs up.
  std::atomic<bool> got_first{false}, release{false};
  std::thread streamer([&] {
    auto c = s.client();
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.set_header("Content-Type", "application/json");
    req.body = greedy({{"prompt", "Long story:"}, {"max_tokens", 4000}, {"stream", true}}).dump();
    req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
      got_first = true;
      while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return false;  // abort: the client goes away
    };
    c.send(req);
  });
  while (!got_first) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  // 2) A second request waits in the queue.
  std::pair<int, json> queued;
  std::thread waiter([&] { queued = s.post("/v1/completions", greedy({{"prompt", "Queued"}, {"max_tokens", 2}})); });
  ASSERT_TRUE(wait_metric(s, "hypic_queue_depth 1"));
  // 3) A third one finds the queue full.
  auto full = s.post("/v1/completions", greedy({{"prompt", "Rejected"}, {"max_tokens", 2}}));
  expect_error(full, 429, "queue full");
  EXPECT_EQ(full.second["error"]["type"], "rate_limit_error");
  // 4) The streaming client hangs up: its sequence is cancelled and the queued request runs.
  release = true;
  streamer.join();
  waiter.join();
  EXPECT_EQ(queued.first, 200) << queued.second.dump();
  EXPECT_TRUE(wait_metric(s, "hypic_cancelled_requests_total 1"));
  EXPECT_TRUE(wait_metric(s, "hypic_running_requests 0"));
  EXPECT_TRUE(wait_metric(s, "hypic_requests_total{endpoint=\"/v1/completions\",status=\"499\"} 1"));
}

TEST(Server, NonStreamingDisconnectCancels) {
  ServerOptions o;
  o.sched.max_running = 1;
  TestServer s(o);
  {
    auto c = s.client();
    c.set_read_timeout(0, 300000);  // give up after 0.3 s: the client closes the connection
    auto r =
        c.Post("/v1/completions", greedy({{"prompt", "Endless"}, {"max_tokens", 4000}}).dump(), "application/json");
    if (r) GTEST_SKIP() << "4000 tokens finished within 0.3 s; nothing to cancel";
  }
  EXPECT_TRUE(wait_metric(s, "hypic_cancelled_requests_total 1"));
  EXPECT_TRUE(wait_metric(s, "hypic_running_requests 0"));
  auto r = s.post("/v1/completions", greedy({{"prompt", "After"}, {"max_tokens", 2}}));
  EXPECT_EQ(r.first, 200);
}

// Greedy continuation of `prompt` computed in process (the reference the server must reproduce).
hypic::GenerateResult generate_in_process(const std::string& dir, const std::string& prompt, int n, bool mask) {
  hypic::LoadedModel lm = hypic::load_model(dir, "cpu", 1);
  hypic::GenerateRequest req;
  req.prompt = lm.tokenizer->encode(prompt);
  req.max_tokens = n;
  if (mask) req.masked_ids = hypic::padded_ids_to_mask(*lm.model, lm.tokenizer.get());
  return hypic::generate(*lm.model, lm.tokenizer.get(), req);
}

std::string streamed_text(const TestServer& s, json req, json& usage) {
  req["stream"] = true;
  req["stream_options"] = {{"include_usage", true}};
  auto events = sse_events(s.stream("/v1/completions", req));
  EXPECT_FALSE(events.empty());
  if (events.empty()) return "";
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    json c = json::parse(events[i]);
    if (c.contains("error")) ADD_FAILURE() << "stream error: " << events[i];
    if (c["choices"].empty()) {
      usage = c["usage"];
      continue;
    }
    text += c["choices"][0]["text"].get<std::string>();
  }
  return text;
}

// A padded vocabulary (issue 19): sampling picks ids without a tokenizer entry; they come out as no
// text, streamed or not, instead of failing the request. With mask_padded_ids they are never
// picked, and the answer is the unpadded reference model's.
TEST(Server, PaddedVocabularyStreamingAndNot) {
  const auto dir = std::filesystem::temp_directory_path() / ("hypic_padded_server_" + std::to_string(getpid()));
  hypic::testing::make_padded_vocab_model(dir);
  const std::string prompt = "Once upon a time";
  const auto plain = generate_in_process(dir.string(), prompt, 24, false);
  int padded = 0;
  for (int32_t id : plain.ids) padded += id >= hypic::testing::kPaddedVocabTokenizerIds;
  ASSERT_GT(padded, 0) << "the fixture never samples a padded id; the test would prove nothing";
  const auto masked = generate_in_process(dir.string(), prompt, 24, true);
  for (int32_t id : masked.ids) EXPECT_LT(id, hypic::testing::kPaddedVocabTokenizerIds);
  const auto ref = generate_in_process(model_dir(), prompt, 24, false);
  EXPECT_EQ(masked.ids, ref.ids);
  {
    // A server without --mask-padded-ids says at start that padded ids may be sampled.
    auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(64);
    spdlog::default_logger()->sinks().push_back(sink);
    { TestServer warned({}, dir.string()); }
    auto& sinks = spdlog::default_logger()->sinks();
    sinks.erase(std::find(sinks.begin(), sinks.end(), sink));
    bool seen = false;
    for (const std::string& line : sink->last_formatted())
      seen |= line.find("output ids have no token in the tokenizer") != std::string::npos;
    EXPECT_TRUE(seen) << "no warning about the padded vocabulary";
  }
  {
    TestServer s({}, dir.string());
    const json req = greedy({{"prompt", prompt}, {"max_tokens", 24}, {"logprobs", 2}});
    auto r = s.post("/v1/completions", req);
    ASSERT_EQ(r.first, 200) << r.second.dump();
    EXPECT_EQ(r.second["choices"][0]["text"], plain.text);
    EXPECT_EQ(r.second["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(r.second["usage"]["completion_tokens"], 24);
    EXPECT_EQ(r.second["choices"][0]["logprobs"]["tokens"].size(), 24u);
    json usage;
    EXPECT_EQ(streamed_text(s, req, usage), plain.text);
    EXPECT_EQ(usage["completion_tokens"], 24);
    // Masked per request: the reference model's answer, streamed or not.
    json mreq = req;
    mreq["mask_padded_ids"] = true;
    auto m = s.post("/v1/completions", mreq);
    ASSERT_EQ(m.first, 200) << m.second.dump();
    EXPECT_EQ(m.second["choices"][0]["text"], ref.text);
    EXPECT_EQ(streamed_text(s, mreq, usage), ref.text);
    expect_error(s.post("/v1/completions", greedy({{"prompt", prompt}, {"mask_padded_ids", "yes"}})), 400,
                 "mask_padded_ids must be a boolean");
  }
  {
    // --mask-padded-ids as the server default; a request may still turn it off.
    ServerOptions o;
    o.mask_padded_ids = true;
    TestServer s(o, dir.string());
    auto m = s.post("/v1/completions", greedy({{"prompt", prompt}, {"max_tokens", 24}}));
    ASSERT_EQ(m.first, 200) << m.second.dump();
    EXPECT_EQ(m.second["choices"][0]["text"], ref.text);
    auto u = s.post("/v1/completions", greedy({{"prompt", prompt}, {"max_tokens", 24}, {"mask_padded_ids", false}}));
    ASSERT_EQ(u.first, 200) << u.second.dump();
    EXPECT_EQ(u.second["choices"][0]["text"], plain.text);
  }
  std::filesystem::remove_all(dir);
}

TEST(ServerApi, StopHoldback) {
  using hypic::server::stop_holdback;
  EXPECT_EQ(stop_holdback("hello wor", {"world"}), 3u);
  EXPECT_EQ(stop_holdback("hello", {"world"}), 0u);
  EXPECT_EQ(stop_holdback("abc", {"c", "bcd"}), 2u);
  EXPECT_EQ(stop_holdback("", {"x"}), 0u);
}

TEST(ServerApi, JsonDepth) {
  using hypic::server::check_json_depth;
  EXPECT_NO_THROW(check_json_depth("{\"a\": [[1]]}", 3));
  EXPECT_THROW(check_json_depth("{\"a\": [[[1]]]}", 3), hypic::server::ApiError);
  EXPECT_NO_THROW(check_json_depth("{\"a\": \"[[[[[[\"}", 2));  // brackets inside strings do not count
  EXPECT_NO_THROW(check_json_depth("{\"a\": \"\\\"[[[[\"}", 2));
}

}  // namespace

#else
TEST(Server, NotBuilt) {
  GTEST_SKIP() << "hypic was built without cpp-httplib";
}
#endif

// --api-key / --admin-key: /v1/* needs a Bearer key (401, OpenAI-shaped, when missing or wrong),
// segment writes need the admin key (403 with the API key), /health and /metrics stay open.
TEST(Server, ApiKeyAndAdminKey) {
  ServerOptions o;
  o.api_key = "user-key-1";
  o.admin_key = "admin-key-2";
  TestServer s(o);
  auto c = s.client();
  auto with = [&](const std::string& key) { return httplib::Headers{{"Authorization", "Bearer " + key}}; };
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  for (const std::string key : {"", "user-key-", "user-key-1x", "admin-key-1", "Bearer"}) {
    auto r = key.empty() ? c.Get("/v1/models") : c.Get("/v1/models", with(key));
    ASSERT_TRUE(r);
    expect_error({r->status, json::parse(r->body, nullptr, false)}, 401, "key '" + key + "'");
    EXPECT_EQ(json::parse(r->body)["error"]["code"], "invalid_api_key");
    EXPECT_EQ(r->get_header_value("WWW-Authenticate"), "Bearer");
  }
  auto ok = c.Get("/v1/models", with("user-key-1"));
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  auto gen = c.Post("/v1/completions", with("user-key-1"), greedy({{"prompt", "Hello"}, {"max_tokens", 2}}).dump(),
                    "application/json");
  ASSERT_TRUE(gen);
  EXPECT_EQ(gen->status, 200) << gen->body;
  const std::string seg = json{{"segments", json::array({{{"text", "A short document about rivers."}}})}}.dump();
  auto denied = c.Post("/v1/segments", with("user-key-1"), seg, "application/json");
  ASSERT_TRUE(denied);
  expect_error({denied->status, json::parse(denied->body, nullptr, false)}, 403, "segment post with the user key");
  auto wrong = c.Post("/v1/segments", with("nope"), seg, "application/json");
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 401);
  auto posted = c.Post("/v1/segments", with("admin-key-2"), seg, "application/json");
  ASSERT_TRUE(posted);
  EXPECT_EQ(posted->status, 200) << posted->body;
  auto listed = c.Get("/v1/segments", with("user-key-1"));  // reading the cache is not a write
  ASSERT_TRUE(listed);
  EXPECT_EQ(listed->status, 200);
  EXPECT_EQ(json::parse(listed->body)["data"].size(), 1u);
  auto del_user = c.Delete("/v1/segments", with("user-key-1"));
  ASSERT_TRUE(del_user);
  EXPECT_EQ(del_user->status, 403);
  auto del_admin = c.Delete("/v1/segments", with("admin-key-2"));
  ASSERT_TRUE(del_admin);
  EXPECT_EQ(del_admin->status, 200);
  EXPECT_EQ(json::parse(c.Get("/v1/segments", with("admin-key-2"))->body)["data"].size(), 0u);
}

// A browser page on another origin cannot drive the server (the cross-origin text/plain POST of the
// hardening issue), unless --cors-origin names it; clients without an Origin header are unaffected.
TEST(Server, CrossOriginRequestsRefusedUnlessAllowed) {
  const std::string body = greedy({{"prompt", "Hello"}, {"max_tokens", 2}}).dump();
  {
    TestServer s;
    auto c = s.client();
    auto r = c.Post("/v1/completions", httplib::Headers{{"Origin", "http://evil.example"}}, body, "text/plain");
    ASSERT_TRUE(r);
    expect_error({r->status, json::parse(r->body, nullptr, false)}, 403, "cross-origin post");
    EXPECT_NE(r->body.find("--cors-origin"), std::string::npos) << r->body;
    auto d = c.Delete("/v1/segments", httplib::Headers{{"Origin", "http://evil.example"}});
    ASSERT_TRUE(d);
    EXPECT_EQ(d->status, 403);
    auto plain = c.Post("/v1/completions", body, "application/json");
    ASSERT_TRUE(plain);
    EXPECT_EQ(plain->status, 200) << plain->body;
  }
  ServerOptions o;
  o.cors_origins = {"http://app.example"};
  TestServer s(o);
  auto c = s.client();
  auto r = c.Post("/v1/completions", httplib::Headers{{"Origin", "http://app.example"}}, body, "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(r->get_header_value("Access-Control-Allow-Origin"), "http://app.example");
  auto pre = c.Options("/v1/completions",
                       httplib::Headers{{"Origin", "http://app.example"}, {"Access-Control-Request-Method", "POST"}});
  ASSERT_TRUE(pre);
  EXPECT_EQ(pre->status, 204);
  EXPECT_NE(pre->get_header_value("Access-Control-Allow-Headers").find("Authorization"), std::string::npos);
  auto other = c.Post("/v1/completions", httplib::Headers{{"Origin", "http://evil.example"}}, body, "application/json");
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 403);
}

// A decoded %0A (or any control byte) in a URL cannot forge a line in the server's log.
TEST(Server, LogLinesEscapeControlCharacters) {
  EXPECT_EQ(hypic::server::log_safe("/v1/x\n2026-12-01 forged\x1b[31m\\"), "/v1/x\\x0a2026-12-01 forged\\x1b[31m\\\\");
  EXPECT_EQ(hypic::server::log_safe("/v1/models"), "/v1/models");
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(64);
  spdlog::default_logger()->sinks().push_back(sink);
  {
    TestServer s;
    auto c = s.client();
    auto r = c.Get("/v1/nothing%0A2026-12-01%20forged%20line");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 404);
  }
  auto& sinks = spdlog::default_logger()->sinks();
  sinks.erase(std::find(sinks.begin(), sinks.end(), sink));
  bool seen = false;
  for (const std::string& line : sink->last_formatted()) {
    if (line.find("forged") == std::string::npos) continue;
    seen = true;
    EXPECT_NE(line.find("/v1/nothing\\x0a2026-12-01 forged line"), std::string::npos) << line;
    EXPECT_EQ(line.find('\n'), line.size() - 1) << line;  // only the line's own end
  }
  EXPECT_TRUE(seen) << "the request was not logged";
}

// HEAD is answered as GET without the body (load balancers probe /health so).
TEST(Server, HeadIsGetWithoutTheBody) {
  TestServer s;
  auto c = s.client();
  auto get = c.Get("/health");
  auto head = c.Head("/health");
  ASSERT_TRUE(get);
  ASSERT_TRUE(head);
  EXPECT_EQ(head->status, 200);
  EXPECT_TRUE(head->body.empty());
  EXPECT_EQ(head->get_header_value("Content-Length"), std::to_string(get->body.size()));
  auto again = c.Get("/v1/models");  // the connection stays usable after a HEAD
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, 200);
}

// A Range header (here many overlapping ranges) is ignored: the full response, once, not a
// multipart copy many times its size. (The listing is the same in every response: the model's
// `created` is the server's start, not the request's second.)
TEST(Server, RangeHeadersIgnored) {
  TestServer s;
  auto c = s.client();
  auto plain = c.Get("/v1/models");
  ASSERT_TRUE(plain);
  ASSERT_EQ(plain->status, 200);
  std::string many = "bytes=0-";
  for (int i = 0; i < 200; ++i) many += ",0-";
  for (const std::string& range : {many, std::string("bytes=0-3")}) {
    auto r = c.Get("/v1/models", httplib::Headers{{"Range", range}});
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, plain->body);
  }
}

// A chat request without max_tokens runs until EOS or the context's end, but holds KV only for
// what it has produced (plus a step), not for the whole context (4096 rows on this model).
TEST(Server, KvReservedAsTokensComeNotForTheWholeContext) {
  TestServer s;
  auto c = s.client();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.headers = {{"Content-Type", "application/json"}};
  req.body = json{
      {"messages", json::array({{{"role", "user"}, {"content", "Hello"}}})},
      {"stream", true},
      {"ignore_eos", true},
      {"temperature",
       0}}.dump();
  int chunks = 0;
  int64_t kv = -1;
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
    if (++chunks < 20) return true;
    const std::string m = s.get_text("/metrics");
    const std::string key = "\nhypic_kv_reserved_tokens ";
    const size_t p = m.find(key);
    if (p != std::string::npos) kv = std::stoll(m.substr(p + key.size()));
    return false;  // disconnect: the request is cancelled
  };
  c.send(req);
  ASSERT_GE(chunks, 20);
  EXPECT_GT(kv, 0);
  EXPECT_LE(kv, 1024) << "KV rows reserved by one short chat request";
}

// A client that gives up while its request is queued frees the queue place at once (not when the
// request reaches the engine): the next request is queued, not refused with 429.
TEST(Server, AbandonedQueuedRequestsLeaveTheQueue) {
  ServerOptions o;
  o.sched.max_running = 1;
  o.sched.max_queue = 1;
  TestServer s(o);
  // The only running slot: a post of many documents, built one per engine iteration.
  json docs = json::array();
  for (int i = 0; i < 600; ++i)
    docs.push_back({{"text", "Document " + std::to_string(i) + " tells of rivers, hills and the town of " +
                                 std::to_string(i * 7919) + " where the market opens at dawn."}});
  std::atomic<bool> occupant_done{false};
  std::thread occupant([&] {
    auto r = s.post("/v1/segments", json{{"segments", docs}});
    EXPECT_EQ(r.first, 200);
    occupant_done = true;
  });
  ASSERT_TRUE(wait_metric(s, "hypic_running_requests 1"));
  {
    httplib::Client impatient("127.0.0.1", s.port);
    impatient.set_read_timeout(0, 200000);  // gives up after 0.2 s and closes the connection
    auto r =
        impatient.Post("/v1/completions", greedy({{"prompt", "Queued"}, {"max_tokens", 2}}).dump(), "application/json");
    EXPECT_FALSE(r);
  }
  ASSERT_TRUE(wait_metric(s, "hypic_queue_depth 0"));
  EXPECT_FALSE(occupant_done.load()) << "the queue place was freed only when the engine took the request";
  std::pair<int, json> next;
  std::thread waiter([&] { next = s.post("/v1/completions", greedy({{"prompt", "Next"}, {"max_tokens", 2}})); });
  occupant.join();
  waiter.join();
  EXPECT_EQ(next.first, 200) << next.second.dump();
  EXPECT_TRUE(wait_metric(s, "hypic_cancelled_requests_total 1"));
}

// A chunked body (no Content-Length) is held to --max-body-mib too: the read stops at the limit
// with 413 instead of taking the whole upload into memory; the server keeps serving.
TEST(Server, ChunkedBodyOverTheLimitGets413) {
  ServerOptions o;
  o.max_body_bytes = size_t(1) << 20;
  TestServer s(o);
  auto c = s.client();
  size_t sent = 0;
  const std::string piece(64 << 10, 'a');
  auto r = c.Post(
      "/v1/completions",
      [&](size_t, httplib::DataSink& sink) {
        if (sent == 0) sink.write("{\"prompt\": \"", 12);
        if (sent >= (size_t(64) << 20)) {  // 64 MiB at most, then end the body
          sink.done();
          return true;
        }
        if (!sink.write(piece.data(), piece.size())) return false;
        sent += piece.size();
        return true;
      },
      "application/json");
  if (r) {  // the server may also close the connection before the client has finished uploading
    expect_error({r->status, json::parse(r->body, nullptr, false)}, 413, "chunked body over the limit");
  }
  EXPECT_LT(sent, size_t(64) << 20) << "the server read the whole upload";
  auto ok = s.post("/v1/completions", greedy({{"prompt", "Hello"}, {"max_tokens", 2}}));
  EXPECT_EQ(ok.first, 200);
}

// `curl -d` sends JSON as application/x-www-form-urlencoded: bodies of any size up to the limit are
// read as JSON all the same (cpp-httplib's own form reader refused them past 8 KB with 413).
TEST(Server, JsonBodyWithAFormContentType) {
  TestServer s;
  auto c = s.client();
  std::string body = greedy({{"prompt", "Hello"}, {"max_tokens", 1}}).dump();
  body.insert(body.size() - 1, std::string(20000, ' '));  // 20 KB of JSON whitespace
  auto r = c.Post("/v1/completions", body, "application/x-www-form-urlencoded");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body.substr(0, 300);
}

// The watchdog: while the engine sits in one iteration longer than --watchdog-s with work
// waiting, /health answers 503 (here: a 1 ms limit against segment builds of ~1500 tokens each);
// idle again, it answers 200.
TEST(Server, HealthFailsWhileTheEngineIsStalled) {
  ServerOptions o;
  o.watchdog_s = 0.001;
  TestServer s(o);
  EXPECT_EQ(s.get("/health").first, 200);  // idle: never stalled
  json docs = json::array();
  for (int i = 0; i < 6; ++i) docs.push_back({{"text", std::to_string(i) + std::string(1500, 'a' + i)}});
  std::atomic<bool> done{false};
  std::thread poster([&] {
    EXPECT_EQ(s.post("/v1/segments", json{{"segments", docs}}).first, 200);
    done = true;
  });
  bool saw_503 = false;
  while (!done && !saw_503) {
    auto h = s.get("/health");
    if (h.first == 503) {
      saw_503 = true;
      EXPECT_EQ(h.second["status"], "stalled") << h.second.dump();
    }
  }
  poster.join();
  EXPECT_TRUE(saw_503);
  for (int i = 0; i < 200 && s.get("/health").first != 200; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(s.get("/health").first, 200);
}

// Prefill units are taken in turn: a short request arriving during a large segment post is
// answered long before the post finishes (it used to wait for every one of the post's builds).
TEST(Server, ShortRequestIsNotHeldBehindALargeSegmentPost) {
  TestServer s;
  json docs = json::array();
  for (int i = 0; i < 400; ++i)
    docs.push_back({{"text", "Document " + std::to_string(i) + " tells of rivers, hills and the town of " +
                                 std::to_string(i * 7919) + " where the market opens at dawn."}});
  std::thread poster([&] { EXPECT_EQ(s.post("/v1/segments", json{{"segments", docs}}).first, 200); });
  ASSERT_TRUE(wait_metric(s, "hypic_running_requests 1"));
  auto r = s.post("/v1/completions", greedy({{"prompt", "Hello"}, {"max_tokens", 2}}));
  // How far the post had got when the short request was answered: its builds so far.
  const size_t built_by_then = s.get("/v1/segments").second["data"].size();
  poster.join();
  EXPECT_EQ(r.first, 200) << r.second.dump();
  EXPECT_LT(built_by_then, 200u) << "the short request waited for the segment post's builds";
  EXPECT_EQ(s.get("/v1/segments").second["data"].size(), 400u);
}
