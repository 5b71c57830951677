// hypic_loadtest: N concurrent clients send RAG requests (a system prompt, a shuffled subset of a
// fixed document pool, a question) to `hypic serve` on loopback for a bounded time. Half the
// requests stream (time to first token is measured on those), half do not.
//
// Fails (exit 1) on any HTTP error, any lost or truncated response (a stream without [DONE] or
// usage, a wrong token count), a server whose peak RSS exceeds --rss-limit-mib, or a server that
// does not exit cleanly on SIGTERM. Prints one JSON line and a short table.
//
//   hypic_loadtest --server build/hypic --model DIR [--clients 4] [--seconds 10] [--max-tokens 8]
//                  [--docs 12] [--docs-per-request 4] [--rss-limit-mib 1024] [--serve-arg ARG]...
//   hypic_loadtest --url http://127.0.0.1:8080 ...   # an already running server (no RSS check)
#include <fcntl.h>
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "server_process.h"

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string server, model, url;
  std::vector<std::string> serve_args;
  int clients = 4, max_tokens = 8, docs = 12, docs_per_request = 4;
  double seconds = 10, rss_limit_mib = 1024;
};

[[noreturn]] void usage_exit(const char* msg) {
  std::fprintf(stderr, "hypic_loadtest: %s\n", msg);
  std::exit(2);
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage_exit(("missing value for " + k).c_str());
      return argv[++i];
    };
    if (k == "--server")
      a.server = val();
    else if (k == "--model")
      a.model = val();
    else if (k == "--url")
      a.url = val();
    else if (k == "--serve-arg")
      a.serve_args.push_back(val());
    else if (k == "--clients")
      a.clients = std::stoi(val());
    else if (k == "--seconds")
      a.seconds = std::stod(val());
    else if (k == "--max-tokens")
      a.max_tokens = std::stoi(val());
    else if (k == "--docs")
      a.docs = std::stoi(val());
    else if (k == "--docs-per-request")
      a.docs_per_request = std::stoi(val());
    else if (k == "--rss-limit-mib")
      a.rss_limit_mib = std::stod(val());
    else
      usage_exit(("unknown argument " + k).c_str());
  }
  if (a.url.empty() && (a.server.empty() || a.model.empty())) usage_exit("give --server BIN --model DIR, or --url");
  if (a.clients < 1 || a.seconds <= 0 || a.docs < 1 || a.docs_per_request < 1 || a.docs_per_request > a.docs)
    usage_exit("bad sizes");
  return a;
}

std::vector<std::string> make_docs(int n) {
  static const char* words[] = {"river",  "valley", "market",  "bread",   "lighthouse", "keeper", "ship",   "map",
                                "harbor", "winter", "orchard", "glacier", "library",    "signal", "bridge", "tower"};
  std::mt19937 rng(7);
  std::vector<std::string> docs;
  for (int d = 0; d < n; ++d) {
    std::string s = "Document " + std::to_string(d) + ":";
    const int len = 30 + static_cast<int>(rng() % 40);
    for (int w = 0; w < len; ++w) s += std::string(" ") + words[rng() % 16];
    docs.push_back(s + ".");
  }
  return docs;
}

struct Stats {
  std::mutex mu;
  std::vector<double> ttft_ms, latency_ms;
  int64_t sent = 0, ok = 0, errors = 0, lost = 0, prompt_tokens = 0, cached_tokens = 0;
  std::vector<std::string> error_samples;
  void error(const std::string& what) {
    std::lock_guard<std::mutex> g(mu);
    ++errors;
    if (error_samples.size() < 5) error_samples.push_back(what);
  }
};

void client_loop(int idx, const std::string& host, int port, const Args& a, const std::vector<std::string>& docs,
                 Clock::time_point deadline, Stats& st) {
  std::mt19937 rng(1000 + idx);
  httplib::Client cli(host, port);
  cli.set_read_timeout(300, 0);
  cli.set_write_timeout(60, 0);
  int n = 0;
  while (Clock::now() < deadline) {
    std::vector<int> order(docs.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    std::shuffle(order.begin(), order.end(), rng);
    std::string prompt = "You are a helpful assistant. Answer from the documents.";
    for (int k = 0; k < a.docs_per_request; ++k) prompt += "<<PIC_SEP>>" + docs[static_cast<size_t>(order[k])];
    prompt += "<<PIC_SEP>>Question " + std::to_string(rng() % 1000) + ": which document mentions a keeper?";
    const bool stream = (n++ % 2) == 0;
    json body{{"prompt", prompt}, {"max_tokens", a.max_tokens}, {"temperature", 0.7},
              {"seed", rng()},    {"ignore_eos", true},         {"stream", stream}};
    if (stream) body["stream_options"] = {{"include_usage", true}};
    {
      std::lock_guard<std::mutex> g(st.mu);
      ++st.sent;
    }
    const auto t0 = Clock::now();
    double ttft = -1;
    json usage;
    if (stream) {
      SseReader sse;
      bool done = false;
      httplib::Request req;
      req.method = "POST";
      req.path = "/v1/completions";
      req.set_header("Content-Type", "application/json");
      req.body = body.dump();
      int status = 0;
      req.response_handler = [&](const httplib::Response& r) {
        status = r.status;
        return true;
      };
      req.content_receiver = [&](const char* d, size_t len, uint64_t, uint64_t) {
        sse.feed(d, len, [&](const std::string& ev) {
          if (ev == "[DONE]") {
            done = true;
            return;
          }
          json c = json::parse(ev, nullptr, false);
          if (c.is_discarded()) return;
          if (c.contains("error")) return;
          if (c.contains("usage") && c["usage"].is_object()) usage = c["usage"];
          if (ttft < 0 && !c["choices"].empty())
            ttft = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        });
        return true;
      };
      auto res = cli.send(req);
      if (!res || status != 200) {
        st.error(res ? "stream status " + std::to_string(status)
                     : "stream transport error " + httplib::to_string(res.error()));
        continue;
      }
      if (!done || !usage.is_object()) {
        std::lock_guard<std::mutex> g(st.mu);
        ++st.lost;
        continue;
      }
    } else {
      auto res = cli.Post("/v1/completions", body.dump(), "application/json");
      if (!res) {
        st.error("transport error " + httplib::to_string(res.error()));
        continue;
      }
      if (res->status != 200) {
        st.error("status " + std::to_string(res->status) + ": " + res->body.substr(0, 200));
        continue;
      }
      json j = json::parse(res->body, nullptr, false);
      if (j.is_discarded() || !j.contains("usage")) {
        std::lock_guard<std::mutex> g(st.mu);
        ++st.lost;
        continue;
      }
      usage = j["usage"];
    }
    const double lat = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    std::lock_guard<std::mutex> g(st.mu);
    if (usage["completion_tokens"] != a.max_tokens) {
      ++st.lost;
      continue;
    }
    ++st.ok;
    st.latency_ms.push_back(lat);
    if (ttft >= 0) st.ttft_ms.push_back(ttft);
    st.prompt_tokens += usage["prompt_tokens"].get<int64_t>();
    st.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
  }
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  const Args a = parse_args(argc, argv);
  std::string host = "127.0.0.1";
  int port = 0;
  pid_t pid = -1;
  if (!a.url.empty()) {
    const std::string u = a.url.substr(a.url.find("://") == std::string::npos ? 0 : a.url.find("://") + 3);
    host = u.substr(0, u.find(':'));
    port = std::atoi(u.c_str() + u.find(':') + 1);
  } else {
    pid = start_server(a.server, a.model, a.serve_args, a.clients, port);
  }
  const auto docs = make_docs(a.docs);
  Stats st;
  const auto t0 = Clock::now();
  const auto deadline = t0 + std::chrono::milliseconds(static_cast<int64_t>(a.seconds * 1000));
  double rss_peak_kib = 0;
  std::atomic<bool> running{true};
  std::thread sampler([&] {
    while (running && pid > 0) {
      rss_peak_kib = std::max(rss_peak_kib, status_kib(pid, "VmRSS:"));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  std::vector<std::thread> th;
  for (int i = 0; i < a.clients; ++i) th.emplace_back([&, i] { client_loop(i, host, port, a, docs, deadline, st); });
  for (auto& t : th) t.join();
  const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  running = false;
  sampler.join();

  // The server's own count must match ours.
  // (It counts a request after writing its response, so poll briefly.)
  int64_t server_ok = -1;
  for (int attempt = 0; attempt < 100 && server_ok != st.ok; ++attempt) {
    if (attempt) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    httplib::Client cli(host, port);
    if (auto r = cli.Get("/metrics")) {
      const std::string key = "hypic_requests_total{endpoint=\"/v1/completions\",status=\"200\"} ";
      const size_t p = r->body.find(key);
      server_ok = p == std::string::npos ? 0 : std::atoll(r->body.c_str() + p + key.size());
    }
  }
  bool clean_exit = true;
  if (pid > 0) {
    rss_peak_kib = std::max(rss_peak_kib, status_kib(pid, "VmHWM:"));
    kill(pid, SIGTERM);
    int wst = 0;
    waitpid(pid, &wst, 0);
    clean_exit = WIFEXITED(wst) && WEXITSTATUS(wst) == 0;
  }
  const double rss_mib = rss_peak_kib / 1024.0;
  json out{{"clients", a.clients},
           {"seconds", elapsed},
           {"sent", st.sent},
           {"ok", st.ok},
           {"errors", st.errors},
           {"lost", st.lost},
           {"server_ok", server_ok},
           {"requests_per_s", st.ok / elapsed},
           {"ttft_ms_p50", pct(st.ttft_ms, 0.5)},
           {"ttft_ms_p99", pct(st.ttft_ms, 0.99)},
           {"latency_ms_p50", pct(st.latency_ms, 0.5)},
           {"latency_ms_p99", pct(st.latency_ms, 0.99)},
           {"cached_token_fraction", st.prompt_tokens ? double(st.cached_tokens) / double(st.prompt_tokens) : 0.0},
           {"server_peak_rss_mib", rss_mib},
           {"rss_limit_mib", a.rss_limit_mib},
           {"clean_exit", clean_exit}};
  std::printf("%s\n", out.dump().c_str());
  std::printf("requests %lld ok / %lld sent in %.1f s (%.1f/s), errors %lld, lost %lld\n", (long long)st.ok,
              (long long)st.sent, elapsed, st.ok / elapsed, (long long)st.errors, (long long)st.lost);
  std::printf("TTFT p50 %.1f ms  p99 %.1f ms   latency p50 %.1f ms  p99 %.1f ms   cached %.0f%% of prompt tokens\n",
              pct(st.ttft_ms, 0.5), pct(st.ttft_ms, 0.99), pct(st.latency_ms, 0.5), pct(st.latency_ms, 0.99),
              100.0 * (st.prompt_tokens ? double(st.cached_tokens) / double(st.prompt_tokens) : 0.0));
  if (pid > 0) std::printf("server peak RSS %.1f MiB (limit %.0f MiB)\n", rss_mib, a.rss_limit_mib);
  for (auto& e : st.error_samples) std::fprintf(stderr, "error: %s\n", e.c_str());
  bool pass = st.errors == 0 && st.lost == 0 && st.ok > 0 && st.ok == st.sent && clean_exit;
  if (server_ok >= 0 && server_ok != st.ok) {
    std::fprintf(stderr, "FAIL: the server counted %lld successful completions, the clients %lld\n",
                 (long long)server_ok, (long long)st.ok);
    pass = false;
  }
  if (pid > 0 && rss_mib > a.rss_limit_mib) {
    std::fprintf(stderr, "FAIL: server peak RSS %.1f MiB over the limit %.0f MiB\n", rss_mib, a.rss_limit_mib);
    pass = false;
  }
  if (!pass) std::fprintf(stderr, "FAIL\n");
  return pass ? 0 : 1;
}
