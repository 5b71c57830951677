// Segment parallelism (src/cluster/): a combine node hands the missing entries of PIC requests to
// segment workers over UCX (tcp on loopback here), tested on the built binary with the small test
// model: the answers equal a server that builds everything itself, bitwise for the entries; a
// killed worker, a slow one and one that sends garbage cost time, never the answer.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cluster/worker_pool.h"
#include "pic/entry_codec.h"

using hypic::cluster::parse_workers;

TEST(WorkerList, ParsesHostsPortsAndComments) {
  auto w = parse_workers("127.0.0.1:7070, node-b:7071\n# a comment\nnode-c:9000  # another\n\n");
  ASSERT_EQ(w.size(), 3u);
  EXPECT_EQ(w[0].host, "127.0.0.1");
  EXPECT_EQ(w[0].port, 7070);
  EXPECT_EQ(w[1].str(), "node-b:7071");
  EXPECT_EQ(w[2].port, 9000);
  EXPECT_TRUE(parse_workers(" # nothing\n").empty());
  for (const char* bad : {"host", "host:", ":7070", "host:0", "host:70000", "host:70x"}) {
    try {
      parse_workers(std::string("ok:1,") + bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
}

#if defined(HYPIC_HAVE_SERVER) && defined(HYPIC_HAVE_CLUSTER)
#include <httplib.h>
#include <signal.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "backend/backend.h"
#include "cluster/segment_service.h"
#include "engine/loader.h"
#include "pic/composer.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "server/serve_process.h"

namespace {

namespace fs = std::filesystem;
using hypic::testing::ServeProcess;
using nlohmann::json;
using namespace std::chrono_literals;

const std::string kModel = std::string(HYPIC_TEST_DATA) + "/models/qwen3_5_dense";

std::string log_path(const std::string& name) {
  const std::string p =
      (fs::path(::testing::TempDir()) / ("hypic_cluster_" + name + "_" + std::to_string(::getpid()) + ".log")).string();
  fs::remove(p);
  return p;
}

std::pair<int, json> request(int port, const std::string& method, const std::string& path, const json& body = nullptr) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(300, 0);
  c.set_write_timeout(60, 0);
  auto r = method == "GET" ? c.Get(path) : c.Post(path, body.dump(), "application/json");
  if (!r) return {-1, json()};
  return {r->status, json::parse(r->body, nullptr, false)};
}

double metric(int port, const std::string& name) {
  httplib::Client c("127.0.0.1", port);
  auto r = c.Get("/metrics");
  if (!r) return -1;
  const std::string key = "\n" + name + " ";
  const auto p = r->body.find(key);
  return p == std::string::npos ? -1 : std::stod(r->body.substr(p + key.size()));
}

// A worker process (`--role worker`, segment service on an ephemeral port) and that port.
struct Worker {
  std::unique_ptr<ServeProcess> proc;
  int segment_port = -1;
  Worker(const std::string& name, const std::string& delay_ms = "", const std::string& backend = "cpu") {
    if (!delay_ms.empty()) ::setenv("HYPIC_TEST_SEGMENT_DELAY_MS", delay_ms.c_str(), 1);
    proc = std::make_unique<ServeProcess>(
        kModel,
        std::vector<std::string>{"--threads", "1", "--role", "worker", "--segment-port", "0", "--backend", backend},
        log_path(name));
    ::unsetenv("HYPIC_TEST_SEGMENT_DELAY_MS");
    auto h = request(proc->port(), "GET", "/health");
    EXPECT_EQ(h.first, 200);
    segment_port = h.second.value("segment_port", -1);
    EXPECT_GT(segment_port, 0) << h.second.dump();
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(segment_port); }
};

// Seeded pseudo-documents of ~80 words each, distinct per index (long enough for a body past the seam).
std::string document(int i) {
  static const char* words[] = {"river", "bread",  "lighthouse", "valley", "market", "ship",    "map",
                                "coast", "keeper", "baker",      "dawn",   "lake",   "library", "north"};
  std::mt19937 rng(500 + static_cast<unsigned>(i));
  std::string d = "Document " + std::to_string(i) + ":";
  for (int k = 0; k < 80; ++k) d += std::string(" ") + words[rng() % 14];
  return d + ".";
}

json rag_body(int first_doc, int n_docs) {
  std::string p = "You answer questions using the documents.";
  for (int i = 0; i < n_docs; ++i) p += "<<PIC_SEP>>" + document(first_doc + i);
  p += "<<PIC_SEP>>Question: which word comes most often?";
  return json{{"prompt", p}, {"max_tokens", 8}, {"temperature", 0}, {"ignore_eos", true}, {"logprobs", 1}};
}

// The answer as text and per-token log-probs (compared exactly: same entries, same arithmetic).
struct Answer {
  std::string text;
  std::vector<double> logprobs;
  json pic;
  bool operator==(const Answer& o) const { return text == o.text && logprobs == o.logprobs; }
};

Answer ask(int port, const json& body) {
  auto r = request(port, "POST", "/v1/completions", body);
  EXPECT_EQ(r.first, 200) << r.second.dump();
  Answer a;
  if (r.first != 200) return a;
  a.text = r.second["choices"][0]["text"];
  for (const auto& x : r.second["choices"][0]["logprobs"]["token_logprobs"]) a.logprobs.push_back(x.get<double>());
  a.pic = r.second["pic"];
  return a;
}

// The reference: one server that builds everything itself.
Answer reference(const json& body) {
  ServeProcess ref(kModel, {"--threads", "1"}, log_path("reference"));
  return ask(ref.port(), body);
}

}  // namespace

// An entry a worker builds is the entry this process builds, byte for byte (the same isolated
// prefill from position 0), and a cold request through two workers answers as a local server does.
TEST(SegmentWorkers, EntriesAndAnswersEqualALocalBuild) {
  Worker w1("eq_w1"), w2("eq_w2");
  ASSERT_GT(w1.segment_port, 0);
  // The entry itself, asked for directly and compared with one built here.
  {
    auto lm = hypic::load_model(kModel, "cpu", 1);
    hypic::PicEngine eng(*lm.model, 64 << 20);
    const std::vector<int32_t> ids = lm.tokenizer->encode(document(1));
    auto local = eng.build_entry(ids, 8);
    std::atomic<int> wakes{0};
    hypic::cluster::WorkerPool pool(hypic::cluster::parse_workers(w1.address()), lm.model->fingerprint(), {},
                                    [&] { ++wakes; });
    auto b = pool.request(0, local->key);
    for (int i = 0; i < 600 && !b->done; ++i) std::this_thread::sleep_for(50ms);
    ASSERT_TRUE(b->done);
    ASSERT_TRUE(b->ok) << b->error;
    EXPECT_GT(wakes.load(), 0);
    EXPECT_EQ(b->bytes, hypic::encode_entry(*local, lm.model->backend())) << "the worker's entry differs";
    auto again = pool.request(0, local->key);  // now in the worker's cache: sent, not built
    for (int i = 0; i < 600 && !again->done; ++i) std::this_thread::sleep_for(50ms);
    ASSERT_TRUE(again->ok) << again->error;
    EXPECT_TRUE(again->cached);
    EXPECT_EQ(again->bytes, b->bytes);
  }
  const json body = rag_body(10, 6);
  const Answer want = reference(body);
  ServeProcess combine(kModel, {"--threads", "1", "--workers", w1.address() + "," + w2.address()},
                       log_path("eq_combine"));
  const Answer got = ask(combine.port(), body);
  EXPECT_EQ(got, want) << got.text << " vs " << want.text;
  EXPECT_EQ(got.pic["miss_segments"], 7) << got.pic.dump();  // the system prompt and six documents
  const double remote = metric(combine.port(), "hypic_remote_entries_total");
  EXPECT_GE(remote, 2) << "LPT gave the workers nothing";
  EXPECT_EQ(metric(combine.port(), "hypic_remote_fallbacks_total"), 0);
  EXPECT_EQ(metric(combine.port(), "hypic_segment_workers_healthy"), 2);
  EXPECT_GT(metric(w1.proc->port(), "hypic_served_builds_total") + metric(w2.proc->port(), "hypic_served_builds_total"),
            0);
  // Host memory on the CPU: nothing goes device to device, nothing fails to map.
  EXPECT_EQ(metric(w1.proc->port(), "hypic_served_shared_total") + metric(w2.proc->port(), "hypic_served_shared_total"),
            0);
  EXPECT_EQ(metric(combine.port(), "hypic_remote_shared_failures_total"), 0);
  // Warm: every entry is in the combine node's cache now.
  const Answer warm = ask(combine.port(), body);
  EXPECT_EQ(warm, want);
  EXPECT_EQ(warm.pic["hit_segments"], 7) << warm.pic.dump();
  EXPECT_EQ(WEXITSTATUS(combine.stop(SIGTERM)), 0) << combine.log();
}

// On a GPU: a worker on this host hands its entries over device to device (CUDA IPC, the entry's
// shared form), exactly the entry it would send as bytes, and a combine node answers with them as
// a lone GPU server does.
TEST(SegmentWorkers, GpuEntriesMoveDeviceToDevice) {
  if (!hypic::backend_unavailable("cuda").empty()) GTEST_SKIP() << hypic::backend_unavailable("cuda");
  ASSERT_NE(hypic::cluster::host_identity(), 0u);
  Worker w("ipc_w", "", "cuda");
  ASSERT_GT(w.segment_port, 0);
  {
    auto lm = hypic::load_model(kModel, "cuda", 1);
    const std::vector<int32_t> ids = lm.tokenizer->encode(document(3));
    const hypic::SegmentKey key{lm.model->fingerprint(), 8, 0, ids};
    auto fetch = [&](uint64_t host) {
      hypic::cluster::PoolOptions po;
      po.host = host;
      hypic::cluster::WorkerPool pool(hypic::cluster::parse_workers(w.address()), lm.model->fingerprint(), po, [] {});
      auto b = pool.request(0, key);
      for (int i = 0; i < 600 && !b->done; ++i) std::this_thread::sleep_for(50ms);
      EXPECT_TRUE(b->done && b->ok) << b->error;
      std::shared_ptr<hypic::SegmentEntry> e;
      if (b->shared) {
        e = hypic::receive_shared_entry(b->bytes, lm.model->backend());
        pool.release(*b);
      } else if (b->ok) {
        e = hypic::decode_entry(b->bytes);
      }
      return std::pair{b->shared, e};
    };
    auto [shared, dev] = fetch(hypic::cluster::host_identity());
    EXPECT_TRUE(shared) << "the worker sent bytes although it shares this host";
    auto [bytes_form, host] = fetch(0);  // now from the worker's cache, as bytes
    EXPECT_FALSE(bytes_form);
    ASSERT_NE(dev, nullptr);
    ASSERT_NE(host, nullptr);
    EXPECT_EQ(hypic::encode_entry(*dev, lm.model->backend()), hypic::encode_entry(*host, lm.model->backend()))
        << "the shared form carried another entry than the bytes";
  }
  const json body = rag_body(30, 6);
  Answer want;
  {
    ServeProcess ref(kModel, {"--threads", "1", "--backend", "cuda"}, log_path("ipc_reference"));
    want = ask(ref.port(), body);
  }
  ServeProcess combine(kModel, {"--threads", "1", "--backend", "cuda", "--workers", w.address()},
                       log_path("ipc_combine"));
  const Answer got = ask(combine.port(), body);
  EXPECT_EQ(got.text, want.text);
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size());
  for (size_t i = 0; i < got.logprobs.size(); ++i) EXPECT_NEAR(got.logprobs[i], want.logprobs[i], 1e-3) << i;
  const double remote = metric(combine.port(), "hypic_remote_entries_total");
  EXPECT_GE(remote, 1) << "LPT gave the worker nothing";
  EXPECT_EQ(metric(combine.port(), "hypic_remote_shared_entries_total"), remote) << combine.log();
  EXPECT_EQ(metric(combine.port(), "hypic_remote_shared_failures_total"), 0) << combine.log();
  EXPECT_GE(metric(w.proc->port(), "hypic_served_shared_total"), remote) << "the fetches above count too";
  EXPECT_EQ(metric(combine.port(), "hypic_remote_fallbacks_total"), 0) << combine.log();
  EXPECT_EQ(WEXITSTATUS(combine.stop(SIGTERM)), 0) << combine.log();
}

// A worker sent several builds at once builds them one at a time in arrival order, so each entry
// ships when it is built and the combine node composes while the next one builds (taking turns
// finished them all together at the end). Counted in prefill units, not time: with three equal
// builds the first must be done within the first half of the units.
TEST(SegmentWorkers, WorkerBuildsInArrivalOrder) {
  hypic::LoadedModel lm = hypic::load_model(kModel, "cpu", 1);
  hypic::server::Metrics metrics;
  hypic::server::SchedulerOptions opt;
  opt.prefill_chunk = 64;  // several units per build: 2 chunks x layers
  hypic::server::Scheduler sched(*lm.model, lm.tokenizer.get(), opt, metrics);
  std::mutex mu;
  std::vector<std::pair<int, uint64_t>> done;  // (build, prefill units run when it was replied)
  sched.start();
  for (int b = 0; b < 3; ++b) {
    hypic::SegmentKey key{lm.model->fingerprint(), 8, 0, {}};
    for (int t = 0; t < 120; ++t) key.ids.push_back(5 + (t * 7 + b * 31) % 200);
    sched.submit_remote_build(std::move(key), false, [&, b](hypic::cluster::BuildOutcome out) {
      EXPECT_TRUE(out.ok) << out.bytes;
      std::lock_guard<std::mutex> g(mu);
      done.emplace_back(b, metrics.prefill_chunks.load());
    });
  }
  for (int i = 0; i < 600; ++i) {
    {
      std::lock_guard<std::mutex> g(mu);
      if (done.size() == 3) break;
    }
    std::this_thread::sleep_for(50ms);
  }
  sched.stop();
  ASSERT_EQ(done.size(), 3u);
  EXPECT_EQ(done[0].first, 0);
  EXPECT_EQ(done[1].first, 1);
  EXPECT_EQ(done[2].first, 2);
  EXPECT_LT(2 * done[0].second, done[2].second)
      << "units at the replies: " << done[0].second << ", " << done[1].second << ", " << done[2].second;
}

// A slow worker (each reply held back 800 ms): the combine node composes the segments it has while
// the worker's are still in flight (counted), and answers exactly as a local server does.
TEST(SegmentWorkers, CompositionOverlapsTheWorkersBuilds) {
  Worker slow("overlap_w", "800");
  const json body = rag_body(70, 6);
  const Answer want = reference(body);
  ServeProcess combine(kModel, {"--threads", "1", "--workers", slow.address(), "--worker-deadline-s", "60"},
                       log_path("overlap_combine"));
  const Answer got = ask(combine.port(), body);
  EXPECT_EQ(got, want) << got.text << " vs " << want.text;
  EXPECT_GE(metric(combine.port(), "hypic_remote_entries_total"), 2);
  EXPECT_EQ(metric(combine.port(), "hypic_remote_fallbacks_total"), 0);
  EXPECT_GE(metric(combine.port(), "hypic_remote_overlap_steps_total"), 1);
  EXPECT_EQ(WEXITSTATUS(combine.stop(SIGTERM)), 0) << combine.log();
}

// A worker killed while it holds builds, and one that is down from the start: the combine node
// builds those segments itself and answers as a local server does; the faults are counted.
TEST(SegmentWorkers, KilledWorkerIsRebuiltLocally) {
  Worker slow("kill_w", "3000");  // holds each reply 3 s: the kill lands while builds are in flight
  const json body = rag_body(30, 5);
  const Answer want = reference(body);
  ServeProcess combine(kModel, {"--threads", "1", "--workers", slow.address() + ",127.0.0.1:1"},
                       log_path("kill_combine"));
  std::thread killer([&] {
    for (int i = 0; i < 600; ++i) {
      if (metric(combine.port(), "hypic_remote_builds_requested_total") > 0) break;
      std::this_thread::sleep_for(20ms);
    }
    std::this_thread::sleep_for(300ms);
    slow.proc->stop(SIGKILL);
  });
  const Answer got = ask(combine.port(), body);
  killer.join();
  EXPECT_EQ(got, want);
  EXPECT_GE(metric(combine.port(), "hypic_remote_lost_total"), 1);
  EXPECT_GE(metric(combine.port(), "hypic_remote_fallbacks_total"), 1);
  EXPECT_EQ(metric(combine.port(), "hypic_remote_entries_total"), 0);
  EXPECT_EQ(metric(combine.port(), "hypic_segment_workers_healthy"), 0);
  auto h = request(combine.port(), "GET", "/health");
  ASSERT_EQ(h.first, 200);
  ASSERT_EQ(h.second["segment_workers"].size(), 2u) << h.second.dump();
  EXPECT_EQ(h.second["segment_workers"][0]["healthy"], false);
  EXPECT_EQ(WEXITSTATUS(combine.stop(SIGTERM)), 0) << combine.log();
}

// A worker slower than the deadline: its builds fail over to the combine node; a later reply is
// ignored; the answer is the local one.
TEST(SegmentWorkers, SlowWorkerMissesTheDeadline) {
  Worker slow("slow_w", "4000");
  const json body = rag_body(50, 4);
  const Answer want = reference(body);
  ServeProcess combine(
      kModel,
      {"--threads", "1", "--workers", slow.address(), "--worker-deadline-s", "1", "--worker-deadline-factor", "0"},
      log_path("slow_combine"));
  const Answer got = ask(combine.port(), body);
  EXPECT_EQ(got, want);
  EXPECT_GE(metric(combine.port(), "hypic_remote_timeouts_total"), 1);
  EXPECT_GE(metric(combine.port(), "hypic_remote_fallbacks_total"), 1);
  EXPECT_EQ(WEXITSTATUS(combine.stop(SIGTERM)), 0) << combine.log();
}

// A worker that answers with garbage, then with a valid entry of another segment: both rejected by
// the combine node's checks before they touch its cache; the answers stay the local ones.
TEST(SegmentWorkers, MalformedEntriesAreRejected) {
  auto lm = hypic::load_model(kModel, "cpu", 1);
  const std::vector<int32_t> other_ids = lm.tokenizer->encode(document(99));
  hypic::PicEngine eng(*lm.model, 64 << 20);
  const std::string foreign = hypic::encode_entry(*eng.build_entry(other_ids, 8), lm.model->backend());
  std::atomic<int> calls{0};
  hypic::cluster::SegmentService fake(lm.model->fingerprint(), [&](hypic::SegmentKey, bool, auto reply) {
    const int n = calls++;
    hypic::cluster::BuildOutcome out;
    out.ok = true;
    if (n % 3 == 0) out.bytes = "HYPICSEG garbage";
    if (n % 3 == 1) out.bytes = foreign;  // well formed, another segment
    if (n % 3 == 2) {
      out.bytes = foreign;
      out.bytes[out.bytes.size() / 2] ^= 0x5a;  // damaged in flight
    }
    reply(std::move(out));
  });
  const int port = fake.listen("127.0.0.1", 0);
  const json body = rag_body(70, 4);
  const Answer want = reference(body);
  ServeProcess combine(kModel, {"--threads", "1", "--workers", "127.0.0.1:" + std::to_string(port)},
                       log_path("bad_combine"));
  EXPECT_EQ(ask(combine.port(), body), want);
  EXPECT_GE(calls.load(), 1);
  EXPECT_GE(metric(combine.port(), "hypic_remote_bad_entries_total"), 1);
  EXPECT_EQ(metric(combine.port(), "hypic_remote_entries_total"), 0);
  // Nothing foreign was cached: asked again (warm), the same answer.
  EXPECT_EQ(ask(combine.port(), body), want);
  EXPECT_EQ(WEXITSTATUS(combine.stop(SIGTERM)), 0) << combine.log();
}
#endif
