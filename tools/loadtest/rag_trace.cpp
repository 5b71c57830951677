// hypic_rag_trace: the serving benchmark of issue 11. A synthetic RAG trace (a system prefix,
// documents drawn with Zipf popularity from a pool, a question; Poisson arrivals) is replayed
// open-loop against `hypic serve` at increasing rates, once per prefill mode (each mode on a fresh
// server, so no mode inherits the other's cache). Every request streams; per rate it reports
// TTFT p50/p90/p99, inter-token latency p50/p99, throughput, rejections, and per mode the highest
// rate whose p90 TTFT stays under the SLO with nothing rejected or lost (rates are tried in the order
// given, which should be increasing; a mode stops at its first rate past the SLO).
//
//   hypic_rag_trace --server build/hypic --model DIR [--serve-arg ARG]... | --url http://HOST:PORT
//       [--modes pic,prefix] [--rates 0.5,1,2,4] [--duration 30] [--pool 64] [--zipf 1.0]
//       [--docs-min 8] [--docs-max 16] [--doc-words 1000] [--gen-min 64] [--gen-max 256]
//       [--slo-ms 1000] [--max-running 16] [--seed 1] [--trace-out FILE]
//
// Prints one JSON line per (mode, rate) (with the server's engine phase times over that rate, from
// /metrics), one summary line per mode, and a table. Exits 1 when a
// request fails for another reason than a 429 (a transport error, a lost or truncated stream).
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "server_process.h"

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string server, model, url, trace_out;
  std::vector<std::string> serve_args, modes = {"pic", "prefix"};
  std::vector<double> rates = {0.5, 1, 2, 4};
  double duration = 30, zipf = 1.0, slo_ms = 1000;
  int pool = 64, docs_min = 8, docs_max = 16, doc_words = 1000, gen_min = 64, gen_max = 256, max_running = 16;
  uint64_t seed = 1;
};

[[noreturn]] void usage_exit(const std::string& msg) {
  std::fprintf(stderr, "hypic_rag_trace: %s\n", msg.c_str());
  std::exit(2);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');)
    if (!x.empty()) out.push_back(x);
  return out;
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage_exit("missing value for " + k);
      return argv[++i];
    };
    try {
      if (k == "--server")
        a.server = val();
      else if (k == "--model")
        a.model = val();
      else if (k == "--url")
        a.url = val();
      else if (k == "--serve-arg")
        a.serve_args.push_back(val());
      else if (k == "--modes")
        a.modes = split(val());
      else if (k == "--rates") {
        a.rates.clear();
        for (auto& r : split(val())) a.rates.push_back(std::stod(r));
      } else if (k == "--duration")
        a.duration = std::stod(val());
      else if (k == "--pool")
        a.pool = std::stoi(val());
      else if (k == "--zipf")
        a.zipf = std::stod(val());
      else if (k == "--docs-min")
        a.docs_min = std::stoi(val());
      else if (k == "--docs-max")
        a.docs_max = std::stoi(val());
      else if (k == "--doc-words")
        a.doc_words = std::stoi(val());
      else if (k == "--gen-min")
        a.gen_min = std::stoi(val());
      else if (k == "--gen-max")
        a.gen_max = std::stoi(val());
      else if (k == "--slo-ms")
        a.slo_ms = std::stod(val());
      else if (k == "--max-running")
        a.max_running = std::stoi(val());
      else if (k == "--seed")
        a.seed = std::stoull(val());
      else if (k == "--trace-out")
        a.trace_out = val();
      else
        usage_exit("unknown argument " + k);
    } catch (const std::logic_error&) {
      usage_exit("bad value for " + k);
    }
  }
  if (a.url.empty() && (a.server.empty() || a.model.empty())) usage_exit("give --server BIN --model DIR, or --url");
  if (a.modes.empty() || a.rates.empty()) usage_exit("--modes and --rates need at least one value");
  for (double r : a.rates)
    if (!(r > 0)) usage_exit("rates must be positive");
  for (auto& m : a.modes)
    if (m != "pic" && m != "prefix" && m != "full" && m != "naive") usage_exit("unknown mode " + m);
  if (a.pool < 1 || a.docs_min < 1 || a.docs_max < a.docs_min || a.docs_max > a.pool || a.doc_words < 1 ||
      a.gen_min < 1 || a.gen_max < a.gen_min || a.duration <= 0 || a.max_running < 1)
    usage_exit("bad sizes (need 1 <= docs-min <= docs-max <= pool, 1 <= gen-min <= gen-max, duration > 0)");
  return a;
}

// The documents: word salad of about `words` words each, distinct per document.
std::vector<std::string> make_pool(int n, int words, uint64_t seed) {
  static const char* vocab[] = {"river",  "valley", "market",  "bread",   "lighthouse", "keeper", "ship",   "map",
                                "harbor", "winter", "orchard", "glacier", "library",    "signal", "bridge", "tower",
                                "copper", "meadow", "lantern", "ferry",   "quarry",     "canal",  "summit", "archive"};
  std::mt19937_64 rng(seed * 7919 + 17);
  std::vector<std::string> docs;
  for (int d = 0; d < n; ++d) {
    std::string s = "Document " + std::to_string(d) + ":";
    for (int w = 0; w < words; ++w) s += std::string(" ") + vocab[rng() % 24];
    docs.push_back(s + ".");
  }
  return docs;
}

struct Request {
  double at_s;  // arrival, from the start of the rate's window
  std::vector<int> docs;
  int question;
  int max_tokens;
};

// Poisson arrivals at `rate` over `duration`; 8-16 documents each, drawn without replacement with
// P(doc i) ~ 1 / (i + 1)^zipf, in shuffled order.
std::vector<Request> make_trace(const Args& a, double rate, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> w(static_cast<size_t>(a.pool));
  for (int i = 0; i < a.pool; ++i) w[static_cast<size_t>(i)] = 1.0 / std::pow(i + 1.0, a.zipf);
  std::exponential_distribution<double> gap(rate);
  std::uniform_int_distribution<int> ndocs(a.docs_min, a.docs_max), gen(a.gen_min, a.gen_max);
  std::vector<Request> out;
  for (double t = gap(rng); t < a.duration; t += gap(rng)) {
    Request r{t, {}, static_cast<int>(rng() % 100000), gen(rng)};
    std::vector<double> left = w;
    const int n = ndocs(rng);
    for (int k = 0; k < n; ++k) {
      std::discrete_distribution<int> pick(left.begin(), left.end());
      const int d = pick(rng);
      r.docs.push_back(d);
      left[static_cast<size_t>(d)] = 0;
    }
    std::shuffle(r.docs.begin(), r.docs.end(), rng);
    out.push_back(std::move(r));
  }
  return out;
}

struct Result {
  bool ok = false, rejected = false;
  std::string error;
  double ttft_ms = -1, total_ms = 0;
  std::vector<double> itl_ms;
  int64_t prompt_tokens = 0, cached_tokens = 0, completion_tokens = 0;
};

Result send(const std::string& host, int port, const std::string& mode, const std::string& prompt, int max_tokens,
            uint64_t seed) {
  Result res;
  httplib::Client cli(host, port);
  cli.set_read_timeout(600, 0);
  cli.set_write_timeout(60, 0);
  json body{{"prompt", prompt},
            {"max_tokens", max_tokens},
            {"temperature", 0.7},
            {"seed", seed},
            {"ignore_eos", true},
            {"stream", true},
            {"stream_options", {{"include_usage", true}}},
            {"pic", {{"mode", mode}}}};
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.set_header("Content-Type", "application/json");
  req.body = body.dump();
  int status = 0;
  SseReader sse;
  std::string err_body;
  bool done = false;
  json usage;
  const auto t0 = Clock::now();
  auto last = t0;
  req.response_handler = [&](const httplib::Response& r) {
    status = r.status;
    return true;
  };
  req.content_receiver = [&](const char* d, size_t len, uint64_t, uint64_t) {
    if (status != 200) {
      err_body.append(d, std::min<size_t>(len, 300));
      return true;
    }
    sse.feed(d, len, [&](const std::string& ev) {
      if (ev == "[DONE]") {
        done = true;
        return;
      }
      json c = json::parse(ev, nullptr, false);
      if (c.is_discarded() || c.contains("error")) return;
      if (c.contains("usage") && c["usage"].is_object()) usage = c["usage"];
      if (c.contains("choices") && !c["choices"].empty()) {
        const auto now = Clock::now();
        if (res.ttft_ms < 0)
          res.ttft_ms = std::chrono::duration<double, std::milli>(now - t0).count();
        else
          res.itl_ms.push_back(std::chrono::duration<double, std::milli>(now - last).count());
        last = now;
      }
    });
    return true;
  };
  auto r = cli.send(req);
  res.total_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (!r) {
    res.error = "transport error " + httplib::to_string(r.error());
    return res;
  }
  if (status == 429) {
    res.rejected = true;
    return res;
  }
  if (status != 200) {
    res.error = "status " + std::to_string(status) + ": " + err_body;
    return res;
  }
  if (!done || !usage.is_object() || usage.value("completion_tokens", -1) != max_tokens) {
    res.error = "lost or truncated stream";
    return res;
  }
  res.ok = true;
  res.prompt_tokens = usage.value("prompt_tokens", 0);
  res.completion_tokens = usage.value("completion_tokens", 0);
  if (usage.contains("prompt_tokens_details") && usage["prompt_tokens_details"].is_object())
    res.cached_tokens = usage["prompt_tokens_details"].value("cached_tokens", 0);
  return res;
}

// The server's engine phase totals (hypic_engine_phase_seconds: sum and count per phase), read
// from /metrics; empty when the server has none. A rate's row reports the difference.
std::map<std::string, std::pair<double, double>> phase_totals(const std::string& host, int port) {
  std::map<std::string, std::pair<double, double>> out;
  httplib::Client cli(host, port);
  cli.set_read_timeout(30, 0);
  auto r = cli.Get("/metrics");
  if (!r || r->status != 200) return out;
  std::istringstream in(r->body);
  std::string line;
  const std::string pre = "hypic_engine_phase_seconds_";
  while (std::getline(in, line)) {
    if (line.rfind(pre, 0) != 0) continue;
    const bool sum = line.compare(pre.size(), 4, "sum{") == 0, count = line.compare(pre.size(), 6, "count{") == 0;
    const size_t q0 = line.find("phase=\""), q1 = q0 == std::string::npos ? q0 : line.find('"', q0 + 7);
    const size_t sp = line.rfind(' ');
    if ((!sum && !count) || q1 == std::string::npos || sp == std::string::npos) continue;
    auto& v = out[line.substr(q0 + 7, q1 - q0 - 7)];
    (sum ? v.first : v.second) = std::atof(line.c_str() + sp + 1);
  }
  return out;
}

std::string prompt_of(const Request& r, const std::vector<std::string>& pool) {
  // A 32-token-class system prefix, the documents as segments, the question.
  std::string p = "You are a careful assistant. Answer the question using only the documents below, and cite them.";
  for (int d : r.docs) p += "<<PIC_SEP>>" + pool[static_cast<size_t>(d)];
  p += "<<PIC_SEP>>Question " + std::to_string(r.question) + ": which documents mention a lighthouse keeper?";
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  const Args a = parse_args(argc, argv);
  const auto pool = make_pool(a.pool, a.doc_words, a.seed);
  std::ofstream trace_out;
  if (!a.trace_out.empty()) {
    trace_out.open(a.trace_out);
    if (!trace_out) usage_exit("cannot write " + a.trace_out);
  }
  bool failed = false;
  std::vector<json> rows, summaries;
  for (const auto& mode : a.modes) {
    std::string host = "127.0.0.1";
    int port = 0;
    pid_t pid = -1;
    if (!a.url.empty()) {
      const std::string u = a.url.substr(a.url.find("://") == std::string::npos ? 0 : a.url.find("://") + 3);
      host = u.substr(0, u.find(':'));
      port = std::atoi(u.c_str() + u.find(':') + 1);
    } else {
      pid = start_server(a.server, a.model, a.serve_args, a.max_running, port);
    }
    double best = 0;
    for (size_t ri = 0; ri < a.rates.size(); ++ri) {
      const double rate = a.rates[ri];
      // The same trace for every mode at a given rate.
      const auto trace = make_trace(a, rate, a.seed * 1000003 + ri);
      if (trace_out)
        for (const auto& r : trace)
          trace_out << json{{"mode", mode},   {"rate", rate},           {"at_s", r.at_s},
                            {"docs", r.docs}, {"question", r.question}, {"max_tokens", r.max_tokens}}
                           .dump()
                    << "\n";
      const auto phases_before = phase_totals(host, port);
      std::vector<Result> results(trace.size());
      std::vector<std::thread> th;
      const auto t0 = Clock::now();
      for (size_t i = 0; i < trace.size(); ++i) {
        std::this_thread::sleep_until(t0 + std::chrono::microseconds(static_cast<int64_t>(trace[i].at_s * 1e6)));
        th.emplace_back([&, i] {
          results[i] = send(host, port, mode, prompt_of(trace[i], pool), trace[i].max_tokens, a.seed + i);
        });
      }
      for (auto& t : th) t.join();
      const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
      std::vector<double> ttft, itl;
      int64_t ok = 0, rejected = 0, errors = 0, prompt = 0, cached = 0, generated = 0;
      std::string first_error;
      for (const auto& r : results) {
        if (r.ok) {
          ++ok;
          ttft.push_back(r.ttft_ms);
          itl.insert(itl.end(), r.itl_ms.begin(), r.itl_ms.end());
          prompt += r.prompt_tokens;
          cached += r.cached_tokens;
          generated += r.completion_tokens;
        } else if (r.rejected) {
          ++rejected;
        } else {
          ++errors;
          if (first_error.empty()) first_error = r.error;
        }
      }
      const double p90 = pct(ttft, 0.9);
      const bool within = ok > 0 && rejected == 0 && errors == 0 && p90 <= a.slo_ms;
      if (within) best = std::max(best, rate);
      json row{{"mode", mode},
               {"rate", rate},
               {"sent", static_cast<int64_t>(trace.size())},
               {"ok", ok},
               {"rejected", rejected},
               {"errors", errors},
               {"ttft_ms_p50", pct(ttft, 0.5)},
               {"ttft_ms_p90", p90},
               {"ttft_ms_p99", pct(ttft, 0.99)},
               {"itl_ms_p50", pct(itl, 0.5)},
               {"itl_ms_p99", pct(itl, 0.99)},
               {"requests_per_s", ok / wall},
               {"output_tokens_per_s", static_cast<double>(generated) / wall},
               {"prompt_tokens_mean", ok ? static_cast<double>(prompt) / static_cast<double>(ok) : 0.0},
               {"cached_token_fraction", prompt ? static_cast<double>(cached) / static_cast<double>(prompt) : 0.0},
               {"within_slo", within}};
      if (!first_error.empty()) row["first_error"] = first_error;
      // Where the server's engine spent this rate's time: seconds and mean ms per call, by phase.
      json phases = json::object();
      for (const auto& [name, v] : phase_totals(host, port)) {
        const auto it = phases_before.find(name);
        const double s = v.first - (it == phases_before.end() ? 0 : it->second.first);
        const double n = v.second - (it == phases_before.end() ? 0 : it->second.second);
        if (n > 0) phases[name] = {{"seconds", s}, {"calls", n}, {"ms_per_call", 1000 * s / n}};
      }
      if (!phases.empty()) row["engine_phases"] = phases;
      std::printf("%s\n", row.dump().c_str());
      std::fflush(stdout);
      rows.push_back(row);
      if (errors) failed = true;
      if (!within && ri + 1 < a.rates.size()) {
        // Rates go up: past the SLO once, a higher rate only queues longer (and takes minutes to drain).
        std::fprintf(stderr, "%s: rate %g is past the SLO; the higher rates are skipped\n", mode.c_str(), rate);
        break;
      }
    }
    int64_t mode_ok = 0;
    for (const auto& r : rows)
      if (r["mode"] == mode) mode_ok += r["ok"].get<int64_t>();
    if (mode_ok == 0) {
      std::fprintf(stderr, "FAIL: no %s request completed\n", mode.c_str());
      failed = true;
    }
    json sum{{"mode", mode}, {"slo_ms_p90_ttft", a.slo_ms}, {"max_rate_within_slo", best}};
    std::printf("%s\n", sum.dump().c_str());
    summaries.push_back(sum);
    if (pid > 0) {
      kill(pid, SIGTERM);
      int wst = 0;
      waitpid(pid, &wst, 0);
      if (!(WIFEXITED(wst) && WEXITSTATUS(wst) == 0)) {
        std::fprintf(stderr, "FAIL: the %s server did not exit cleanly\n", mode.c_str());
        failed = true;
      }
    }
  }
  std::printf("%-7s %6s %5s %4s %4s %9s %9s %9s %8s %8s %9s %7s\n", "mode", "rate", "ok", "429", "err", "TTFT p50",
              "TTFT p90", "TTFT p99", "ITL p50", "ITL p99", "tok/s out", "cached");
  for (const auto& r : rows)
    std::printf("%-7s %6.2f %5lld %4lld %4lld %9.1f %9.1f %9.1f %8.1f %8.1f %9.1f %6.0f%%\n",
                r["mode"].get<std::string>().c_str(), r["rate"].get<double>(), (long long)r["ok"].get<int64_t>(),
                (long long)r["rejected"].get<int64_t>(), (long long)r["errors"].get<int64_t>(),
                r["ttft_ms_p50"].get<double>(), r["ttft_ms_p90"].get<double>(), r["ttft_ms_p99"].get<double>(),
                r["itl_ms_p50"].get<double>(), r["itl_ms_p99"].get<double>(), r["output_tokens_per_s"].get<double>(),
                100 * r["cached_token_fraction"].get<double>());
  for (const auto& s : summaries)
    std::printf("%s: highest rate with p90 TTFT <= %.0f ms: %.2f req/s\n", s["mode"].get<std::string>().c_str(),
                a.slo_ms, s["max_rate_within_slo"].get<double>());
  if (failed) std::fprintf(stderr, "FAIL: requests failed (see first_error)\n");
  return failed ? 1 : 0;
}
