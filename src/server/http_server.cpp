#include "server/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <ctime>
#include <filesystem>
#include <random>

#ifdef HYPIC_HAVE_CLUSTER
#include "cluster/segment_service.h"
#endif
#include "engine/generate.h"
#include "engine/loader.h"
#include "server/http_transport.h"
#include "tokenizer/tokenizer.h"

namespace hypic::server {

using nlohmann::json;

namespace {

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

void send_json(HttpResponse& res, int status, const json& j) {
  res.status = status;
  res.set_content(dump(j), "application/json");
}

void send_error(HttpResponse& res, const ApiError& e) {
  send_json(res, e.status, error_body(e));
}

// ---- client-disconnect detection -------------------------------------------------------------
// A client that closed (or half-closed) its connection reads as end-of-file on the socket.
bool peer_closed(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, static_cast<short>(POLLIN | POLLRDHUP), 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
  if (p.revents & POLLIN) {
    char c;
    const ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
  }
  return false;
}

// ---- per-request context (handler, content provider and logger run on one thread) -------------
struct ReqCtx {
  bool active = false;
  Clock::time_point start;
  std::shared_ptr<Job> job;
};
thread_local ReqCtx t_ctx;

std::string endpoint_label(const std::string& path) {
  static const char* known[] = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                "/metrics",        "/v1/segments"};
  for (const char* k : known)
    if (path == k) return k;
  if (path.rfind("/v1/segments/", 0) == 0) return "/v1/segments/{id}";
  return "other";
}

std::string new_id(const char* prefix) {
  static std::atomic<uint64_t> n{0};
  thread_local std::mt19937_64 rng(std::random_device{}() ^
                                   static_cast<uint64_t>(Clock::now().time_since_epoch().count()));
  return std::string(prefix) + hex64(rng() ^ (n.fetch_add(1) << 48)).substr(0, 16);
}

}  // namespace

struct HttpServer::Impl {
  LoadedModel& lm;
  ServerOptions opt;
  ModelFacts facts;
  Metrics metrics;
  std::unique_ptr<Scheduler> sched;
  std::unique_ptr<HttpTransport> http;
#ifdef HYPIC_HAVE_CLUSTER
  std::unique_ptr<cluster::SegmentService> segments;  // after sched: destroyed before it
#endif
  int bound_port = -1, segment_port = -1;
  std::atomic<bool> stopped{false};
  // /v1/models' `created`: when this server began serving the model, the same in every listing
  // (it was the time of each request, so two listings a second apart differed).
  const int64_t model_created = static_cast<int64_t>(std::time(nullptr));

  Impl(LoadedModel& m, ServerOptions o) : lm(m), opt(std::move(o)) {
    spdlog::default_logger_raw();  // create the logger registry before any handler thread exists
    const auto& cfg = lm.model->config();
    facts.name = opt.model_name;
    if (facts.name.empty()) {
      std::filesystem::path p(lm.dir ? lm.dir->dir : lm.description);
      if (!p.has_filename()) p = p.parent_path();
      facts.name = (p.extension() == ".gguf" ? p.stem() : p.filename()).string();
      if (facts.name.empty()) facts.name = "hypic";
    }
    facts.context = cfg.max_position_embeddings;
    facts.vocab = cfg.vocab_size;
    facts.tok = lm.tokenizer.get();
    if (lm.tokenizer) facts.chat_template = lm.tokenizer->chat_template();
    facts.defaults.temperature = 1.f;
    facts.eos_ids = cfg.eos_token_ids;  // the model's config: a folder's, or --config's
    if (lm.dir) {
      const auto& gd = lm.dir->generation;
      if (gd.temperature) facts.defaults.temperature = *gd.temperature;
      if (gd.top_p) facts.defaults.top_p = *gd.top_p;
      if (gd.top_k) facts.defaults.top_k = *gd.top_k;
    }
    facts.pic = opt.pic;
    // Checked at start: a default that cannot apply (no tokenizer) is a configuration error.
    if (opt.mask_padded_ids) padded_ids_to_mask(*lm.model, lm.tokenizer.get());
    facts.mask_padded_ids = opt.mask_padded_ids;
    if (!opt.mask_padded_ids && lm.tokenizer) {
      // Sampled ids without a token produce no text: a stream goes quiet for as many tokens.
      const size_t n = lm.tokenizer->ids_without_entry(cfg.vocab_size).size();
      if (n > 0)
        spdlog::warn(
            "{} of the model's {} output ids have no token in the tokenizer; sampled, they produce no "
            "text (--mask-padded-ids, or the request field mask_padded_ids, keeps them out)",
            n, cfg.vocab_size);
    }
    sched = std::make_unique<Scheduler>(*lm.model, lm.tokenizer.get(), opt.sched, metrics);
    sched->start();
    setup();
  }

  ~Impl() {
    sched->stop();
    if (http) http->stop();
  }

  // Text of one token for logprobs.
  std::string token_text(int32_t id) const {
    if (!lm.tokenizer) return std::to_string(id);
    try {
      int32_t one[1] = {id};
      return lm.tokenizer->decode(one);
    } catch (...) {
      return std::to_string(id);
    }
  }

  json usage(const Job& j) const {
    return json{{"prompt_tokens", j.gen.prompt_tokens},
                {"completion_tokens", j.completion_tokens},
                {"total_tokens", j.gen.prompt_tokens + j.completion_tokens},
                {"prompt_tokens_details", {{"cached_tokens", j.report.reused_tokens}}}};
  }
  json pic_info(const Job& j) const {
    return json{{"mode", pic_mode_name(j.gen.pic.mode)},       {"seam", j.gen.pic.seam},
                {"segments", j.gen.segments.size()},           {"hit_segments", j.report.hit_segments},
                {"miss_segments", j.report.miss_segments},     {"reused_tokens", j.report.reused_tokens},
                {"computed_tokens", j.report.computed_tokens}, {"prefix_tokens", j.report.prefix_tokens}};
  }

  // Completions-style logprobs for a run of tokens; text_offset counts from `offset`.
  json completion_logprobs(const std::vector<TokenOut>& toks, size_t offset) const {
    json tokens = json::array(), lps = json::array(), tops = json::array(), offs = json::array();
    for (const auto& t : toks) {
      if (!t.logprob) continue;
      tokens.push_back(token_text(t.id));
      lps.push_back(t.logprob->logprob);
      json top = json::object();
      for (auto& [id, lp] : t.logprob->top) top[token_text(id)] = lp;
      tops.push_back(top);
      offs.push_back(offset);
      offset += t.text.size();
    }
    return json{{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offs}};
  }
  json chat_logprobs(const std::vector<TokenOut>& toks) const {
    json content = json::array();
    auto bytes = [](const std::string& s) {
      json b = json::array();
      for (unsigned char c : s) b.push_back(static_cast<int>(c));
      return b;
    };
    for (const auto& t : toks) {
      if (!t.logprob) continue;
      const std::string s = token_text(t.id);
      json top = json::array();
      for (auto& [id, lp] : t.logprob->top) {
        const std::string ts = token_text(id);
        top.push_back({{"token", ts}, {"logprob", lp}, {"bytes", bytes(ts)}});
      }
      content.push_back({{"token", s}, {"logprob", t.logprob->logprob}, {"bytes", bytes(s)}, {"top_logprobs", top}});
    }
    return json{{"content", content}};
  }

  static int64_t now_unix() {
    return static_cast<int64_t>(std::time(nullptr));
  }

  std::shared_ptr<Job> submit_or_throw(std::shared_ptr<Job> job) {
    t_ctx.job = job;
    if (!sched->submit(job)) {
      if (stopped) throw ApiError(503, "the server is shutting down", "server_error", "", "shutting_down");
      throw ApiError(429, "the request queue is full (" + std::to_string(opt.sched.max_queue) + "); retry later",
                     "rate_limit_error", "", "queue_full");
    }
    return job;
  }

  static ApiError job_error(const Job& j) {
    const int st = j.error_status;
    return ApiError(st, j.error_message, error_type_for(st), "",
                    st == 499 ? "client_closed" : (st == 503 ? "unavailable" : ""));
  }

  // Waits for a non-streaming job; cancels it when the client goes away.
  bool wait_done(Job& job, int fd, std::vector<TokenOut>& toks) {
    while (!job.wait(toks, std::chrono::milliseconds(50))) {
      if (peer_closed(fd)) {
        job.cancelled = true;
        return false;
      }
    }
    return true;
  }

  void handle_generate(const HttpRequest& req, HttpResponse& res, Endpoint ep) {
    const json body = parse_body(req.body, opt.max_json_depth);
    GenSpec g = ep == Endpoint::Chat ? parse_chat(body, facts) : parse_completion(body, facts);
    auto job = std::make_shared<Job>();
    job->kind = Job::Kind::Generate;
    job->id = new_id(ep == Endpoint::Chat ? "chatcmpl-" : "cmpl-");
    job->arrived = t_ctx.active ? t_ctx.start : Clock::now();
    job->gen = std::move(g);
    const int fd = req.fd;
    submit_or_throw(job);
    if (job->gen.stream) {
      start_stream(res, job, fd, ep);
      return;
    }
    std::vector<TokenOut> toks;
    if (!wait_done(*job, fd, toks)) {
      send_error(res, ApiError(499, "client closed the connection", "invalid_request_error", "", "client_closed"));
      return;
    }
    if (job->error_status) throw job_error(*job);
    std::string text;
    for (auto& t : toks) text += t.text;
    {
      std::lock_guard<std::mutex> lk(job->mu);
      text += job->tail;
    }
    json choice{{"index", 0}, {"finish_reason", job->finish_reason}};
    const bool lp = job->gen.logprobs >= 0;
    if (ep == Endpoint::Chat) {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
      choice["logprobs"] = lp ? chat_logprobs(toks) : json(nullptr);
    } else {
      choice["text"] = text;
      choice["logprobs"] = lp ? completion_logprobs(toks, 0) : json(nullptr);
    }
    json out{{"id", job->id},
             {"object", ep == Endpoint::Chat ? "chat.completion" : "text_completion"},
             {"created", now_unix()},
             {"model", facts.name},
             {"choices", json::array({choice})},
             {"usage", usage(*job)},
             {"pic", pic_info(*job)}};
    send_json(res, 200, out);
  }

  struct StreamState {
    std::shared_ptr<Job> job;
    int fd = -1;
    Endpoint ep;
    bool first = true;
    size_t offset = 0;  // text bytes sent (completions text_offset)
    int64_t created = 0;
  };

  json chunk(StreamState& s, const std::string& text, const std::vector<TokenOut>* toks, const json& finish) {
    const Job& j = *s.job;
    json choice{{"index", 0}, {"finish_reason", finish}};
    const bool lp = j.gen.logprobs >= 0 && toks;
    if (s.ep == Endpoint::Chat) {
      json delta = json::object();
      if (s.first) delta["role"] = "assistant";
      if (!text.empty() || (s.first && finish.is_null())) delta["content"] = text;
      choice["delta"] = delta;
      choice["logprobs"] = lp ? chat_logprobs(*toks) : json(nullptr);
    } else {
      choice["text"] = text;
      choice["logprobs"] = lp ? completion_logprobs(*toks, s.offset) : json(nullptr);
    }
    s.first = false;
    s.offset += text.size();
    json c{{"id", j.id},
           {"object", s.ep == Endpoint::Chat ? "chat.completion.chunk" : "text_completion"},
           {"created", s.created},
           {"model", facts.name},
           {"choices", json::array({choice})}};
    if (j.gen.include_usage) c["usage"] = nullptr;
    return c;
  }

  static bool send_event(ChunkSink& sink, const json& j) {
    return sink.write("data: " + dump(j) + "\n\n");
  }

  void start_stream(HttpResponse& res, std::shared_ptr<Job> job, int fd, Endpoint ep) {
    auto st = std::make_shared<StreamState>();
    st->job = job;
    st->fd = fd;
    st->ep = ep;
    st->created = now_unix();
    res.status = 200;
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    res.content_type = "text/event-stream";
    // Runs on the handler's thread after the head is sent, until the job ends or the client goes.
    res.stream = [this, st](ChunkSink& sink) -> bool {
      Job& j = *st->job;
      while (true) {
        std::vector<TokenOut> toks;
        bool done = false;
        while (true) {
          done = j.wait(toks, std::chrono::milliseconds(50));
          if (done || !toks.empty()) break;
          if (peer_closed(st->fd)) {
            j.cancelled = true;
            return false;
          }
        }
        for (auto& t : toks) {
          std::vector<TokenOut> one{t};
          if (t.text.empty() && !(j.gen.logprobs >= 0)) continue;  // held back: nothing to show yet
          if (!send_event(sink, chunk(*st, t.text, &one, nullptr))) {
            j.cancelled = true;
            return false;
          }
        }
        if (!done) continue;
        bool ok = true;
        if (j.error_status) {
          ok = send_event(sink, error_body(job_error(j)));
        } else {
          std::string tail;
          {
            std::lock_guard<std::mutex> lk(j.mu);
            tail = j.tail;
          }
          if (!tail.empty()) ok = ok && send_event(sink, chunk(*st, tail, nullptr, nullptr));
          ok = ok && send_event(sink, chunk(*st, "", nullptr, j.finish_reason));
          if (j.gen.include_usage) {
            json u{{"id", j.id},
                   {"object", st->ep == Endpoint::Chat ? "chat.completion.chunk" : "text_completion"},
                   {"created", st->created},
                   {"model", facts.name},
                   {"choices", json::array()},
                   {"usage", usage(j)},
                   {"pic", pic_info(j)}};
            ok = ok && send_event(sink, u);
          }
        }
        ok = ok && sink.write("data: [DONE]\n\n");
        if (!ok) j.cancelled = true;
        return ok;
      }
    };
  }

  void handle_segments_post(const HttpRequest& req, HttpResponse& res) {
    const json body = parse_body(req.body, opt.max_json_depth);
    SegmentsSpec spec = parse_segments(body, facts);
    auto job = std::make_shared<Job>();
    job->kind = Job::Kind::Segments;
    job->id = new_id("seg-");
    job->arrived = t_ctx.active ? t_ctx.start : Clock::now();
    job->segs = std::move(spec);
    const int fd = req.fd;
    submit_or_throw(job);
    std::vector<TokenOut> toks;
    if (!wait_done(*job, fd, toks)) {
      send_error(res, ApiError(499, "client closed the connection", "invalid_request_error", "", "client_closed"));
      return;
    }
    if (job->error_status) throw job_error(*job);
    int64_t tokens = 0;
    for (auto& s : job->segs.segments) tokens += static_cast<int64_t>(s.size());
    send_json(res, 200,
              json{{"object", "list"},
                   {"data", job->segments_result},
                   {"hit_segments", job->report.hit_segments},
                   {"miss_segments", job->report.miss_segments},
                   {"tokens", tokens}});
  }

  json cache_json() const {
    const auto c = sched->cache_stats();
    return json{{"hits", c.hits},
                {"misses", c.misses},
                {"evictions", c.evictions},
                {"inserts", c.inserts},
                {"bytes", c.bytes},
                {"entries", c.entries},
                {"budget_bytes", c.budget},
                // host tier (--host-cache-mib on a GPU; all zero without one)
                {"host", c.host_budget > 0},
                {"host_hits", c.host_hits},
                {"host_demotions", c.host_demotions},
                {"host_evictions", c.host_evictions},
                {"host_bytes", c.host_bytes},
                {"host_entries", c.host_entries},
                {"host_budget_bytes", c.host_budget},
                // disk tier (--cache-dir; all zero without one)
                {"disk", !opt.sched.cache_dir.empty()},
                {"disk_hits", c.disk_hits},
                {"disk_writes", c.disk_writes},
                {"disk_write_errors", c.disk_write_errors},
                {"corrupt_files", c.corrupt_files},
                {"disk_bytes", c.disk_bytes},
                {"disk_entries", c.disk_entries}};
  }

  static json segment_json(const SegmentInfo& s) {
    return json{{"id", s.id}, {"object", "segment"}, {"tokens", s.tokens}, {"bytes", s.bytes}, {"seam", s.seam}};
  }

  void setup() {
    HttpLimits lim;
    lim.max_body_bytes = opt.max_body_bytes;
    lim.workers =
        opt.http_threads > 0 ? opt.http_threads : std::min(opt.sched.max_running + opt.sched.max_queue + 8, 1024);
    lim.head_timeout_s = opt.head_timeout_s;
    lim.max_connections = opt.max_connections;
    lim.max_connections_per_client = opt.max_connections_per_client;
    HttpTransport::Callbacks cb;
    cb.handle = [this](const HttpRequest& req, HttpResponse& res) { route(req, res); };
    // Generation and segment posts wait for the engine; everything else answers at once.
    cb.heavy = [](const HttpRequest& req) { return req.method == "POST"; };
    cb.refuse = [](HttpResponse& res, int status, const std::string& msg) {
      send_json(res, status, error_body(status, msg));
    };
    cb.done = [this](const HttpRequest& req, const HttpResponse& res) { log_request(req, res); };
    http = std::make_unique<HttpTransport>(lim, std::move(cb));
  }

  // Runs `fn`, turning what it throws into the API's error responses.
  template <typename F>
  static void guarded(HttpResponse& res, F&& fn) {
    try {
      fn();
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const std::bad_alloc&) {
      send_json(res, 503, error_body(503, "out of memory for this request"));
    } catch (const std::exception& e) {
      send_json(res, 500, error_body(500, std::string("internal error: ") + e.what()));
    } catch (...) {
      send_json(res, 500, error_body(500, "internal error"));
    }
  }

  void route(const HttpRequest& req, HttpResponse& res) {
    t_ctx = ReqCtx{};
    t_ctx.active = true;
    t_ctx.start = Clock::now();
    if (!admit(req, res)) return;
    const std::string& m = req.method;
    const std::string& path = req.path;
    static const std::string kSeg = "/v1/segments/";
    auto only = [&](std::initializer_list<const char*> allowed) {
      for (const char* a : allowed)
        if (m == a) return true;
      std::string allow;
      for (const char* a : allowed) allow += (allow.empty() ? "" : ", ") + std::string(a);
      res.set_header("Allow", allow);
      send_json(res, 405,
                error_body(405, "method " + m + " is not allowed on " + path + " (allowed: " + allow + ")",
                           "invalid_request_error", "", "method_not_allowed"));
      return false;
    };
    guarded(res, [&] {
      if (path == "/v1/completions") {
        if (only({"POST"})) handle_generate(req, res, Endpoint::Completions);
      } else if (path == "/v1/chat/completions") {
        if (only({"POST"})) handle_generate(req, res, Endpoint::Chat);
      } else if (path == "/v1/models") {
        if (only({"GET"}))
          send_json(res, 200,
                    json{{"object", "list"},
                         {"data", json::array({json{{"id", facts.name},
                                                    {"object", "model"},
                                                    {"created", model_created},
                                                    {"owned_by", "hypic"},
                                                    {"max_model_len", facts.context}}})}});
      } else if (path == "/health") {
        if (only({"GET"})) health(res);
      } else if (path == "/metrics") {
        if (only({"GET"}))
          res.set_content(metrics.render(sched->cache_stats()), "text/plain; version=0.0.4; charset=utf-8");
      } else if (path == "/v1/segments") {
        if (!only({"GET", "POST", "DELETE"})) return;
        if (m == "POST") {
          handle_segments_post(req, res);
        } else if (m == "GET") {
          json data = json::array();
          for (auto& sg : sched->list_segments()) data.push_back(segment_json(sg));
          send_json(res, 200, json{{"object", "list"}, {"data", data}, {"cache", cache_json()}});
        } else {
          const size_t n = sched->list_segments().size();
          sched->clear_segments();
          send_json(res, 200, json{{"object", "list"}, {"deleted", n}});
        }
      } else if (path.size() > kSeg.size() && path.rfind(kSeg, 0) == 0 &&
                 path.find('/', kSeg.size()) == std::string::npos) {
        if (!only({"GET", "DELETE"})) return;
        const std::string id = path.substr(kSeg.size());
        if (m == "GET") {
          for (auto& sg : sched->list_segments())
            if (sg.id == id) return send_json(res, 200, segment_json(sg));
          throw ApiError(404, "no segment with id '" + id + "'", "not_found_error", "id", "segment_not_found");
        }
        if (!sched->erase_segment(id))
          throw ApiError(404, "no segment with id '" + id + "'", "not_found_error", "id", "segment_not_found");
        send_json(res, 200, json{{"id", id}, {"object", "segment"}, {"deleted", true}});
      } else {
        send_json(res, 404, error_body(404, "no route " + m + " " + path));
      }
    });
  }

  void health(HttpResponse& r) {
    const double stalled = sched->stalled_seconds();
    if (opt.watchdog_s > 0 && stalled > opt.watchdog_s) {
      char msg[160];
      std::snprintf(msg, sizeof msg, "the engine has been in one iteration for %.1f s (watchdog %.1f s)", stalled,
                    opt.watchdog_s);
      send_json(r, 503, json{{"status", "stalled"}, {"message", msg}});
      return;
    }
    json body{{"status", "ok"}};
    if (auto w = sched->workers_json(); !w.empty()) body["segment_workers"] = std::move(w);
    if (segment_port >= 0) body["segment_port"] = segment_port;
    send_json(r, 200, body);
  }

  // Origin and key checks before any route runs; false: `res` holds the refusal.
  // (Range headers need nothing here: the transport does not implement them, so a header of many
  // overlapping ranges cannot turn a small request into a multipart copy many times its size.)
  bool admit(const HttpRequest& req, HttpResponse& res) {
    if (req.has_header("Origin")) {
      const std::string origin = req.header("Origin");
      const bool ok = std::any_of(opt.cors_origins.begin(), opt.cors_origins.end(),
                                  [&](const std::string& o) { return o == "*" || o == origin; });
      if (!ok) {
        send_json(res, 403,
                  error_body(403,
                             "cross-origin request from " + origin + " refused; start the server with --cors-origin " +
                                 origin + " to allow it",
                             "invalid_request_error", "", "origin_not_allowed"));
        return false;
      }
      res.set_header("Access-Control-Allow-Origin", origin);
      res.set_header("Vary", "Origin");
      if (req.method == "OPTIONS") {  // preflight
        res.set_header("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS");
        res.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type");
        res.set_header("Access-Control-Max-Age", "600");
        res.status = 204;
        return false;
      }
    }
    const bool v1 = req.path.rfind("/v1/", 0) == 0;
    const bool segment_write =
        (req.method == "POST" || req.method == "DELETE") && req.path.rfind("/v1/segments", 0) == 0;
    if (!v1 || (opt.api_key.empty() && !(segment_write && !opt.admin_key.empty()))) return true;
    const std::string auth = req.header("Authorization");
    const std::string given = auth.rfind("Bearer ", 0) == 0 ? auth.substr(7) : std::string();
    const bool admin = !opt.admin_key.empty() && same_secret(given, opt.admin_key);
    if (segment_write) {
      if (admin) return true;
      if (!opt.api_key.empty() && !same_secret(given, opt.api_key)) return refuse_key(res, given.empty());
      send_json(res, 403,
                error_body(403,
                           opt.admin_key.empty()
                               ? "adding or deleting segments needs the admin key, and this server has none "
                                 "(start it with --admin-key)"
                               : "adding or deleting segments needs the admin key",
                           "permission_error", "", "admin_key_required"));
      return false;
    }
    if (admin || same_secret(given, opt.api_key)) return true;
    return refuse_key(res, given.empty());
  }

  static bool refuse_key(HttpResponse& res, bool missing) {
    res.set_header("WWW-Authenticate", "Bearer");
    send_json(res, 401,
              error_body(401,
                         missing ? "missing API key: send the header 'Authorization: Bearer <key>'"
                                 : "incorrect API key provided",
                         "invalid_request_error", "", "invalid_api_key"));
    return false;
  }

  // Equal strings, in time that depends on their lengths only (no early exit on the first
  // differing byte, which would let a client find a key byte by byte).
  static bool same_secret(const std::string& a, const std::string& b) {
    unsigned char d = a.size() != b.size() ? 1 : 0;
    const size_t n = std::max(a.size(), b.size());
    for (size_t i = 0; i < n; ++i)
      d |= static_cast<unsigned char>((i < a.size() ? a[i] : 0) ^ (i < b.size() ? b[i] : 0));
    return d == 0;
  }

  void log_request(const HttpRequest& req, const HttpResponse& res) {
    int status = res.status;
    const std::string ep = endpoint_label(req.path);
    std::shared_ptr<Job> job = t_ctx.job;
    const std::string method = log_safe(req.method), path = log_safe(req.path);
    const double ms = t_ctx.active ? std::chrono::duration<double, std::milli>(Clock::now() - t_ctx.start).count() : 0;
    if (job && job->cancelled.load()) status = 499;
    metrics.count_request(ep, status);
    if (job) {
      std::lock_guard<std::mutex> lk(job->mu);
      if (job->kind == Job::Kind::Generate)
        spdlog::info(
            "{} {} {} status={} prompt_tokens={} cached_tokens={} completion_tokens={} ttft_ms={:.1f} total_ms={:.1f} "
            "mode={} segments={} finish={}",
            job->id, method, path, status, job->gen.prompt_tokens, job->report.reused_tokens, job->completion_tokens,
            job->ttft_ms, ms, pic_mode_name(job->gen.pic.mode), job->gen.segments.size(),
            job->finish_reason.empty() ? "-" : job->finish_reason);
      else
        spdlog::info("{} {} {} status={} segments={} built={} total_ms={:.1f}", job->id, method, path, status,
                     job->segs.segments.size(), job->report.miss_segments, ms);
    } else if (status < 400 && (ep == "/metrics" || ep == "/health")) {
      spdlog::debug("{} {} status={} total_ms={:.1f}", method, path, status, ms);  // scrapes and probes
    } else {
      spdlog::info("{} {} status={} total_ms={:.1f}", method, path, status, ms);
    }
    t_ctx = ReqCtx{};
  }
};

HttpServer::HttpServer(LoadedModel& lm, ServerOptions opt) : impl_(std::make_unique<Impl>(lm, std::move(opt))) {
  std::signal(SIGPIPE, SIG_IGN);
}

HttpServer::~HttpServer() {
  stop();
}

int HttpServer::bind() {
  auto& s = *impl_;
  s.bound_port = s.http->bind(s.opt.host, s.opt.port);
  if (s.opt.segment_port >= 0) {
#ifdef HYPIC_HAVE_CLUSTER
    Scheduler* sched = s.sched.get();
    s.segments = std::make_unique<cluster::SegmentService>(
        s.lm.model->fingerprint(), [sched](SegmentKey key, bool shared, cluster::SegmentService::Reply reply) {
          sched->submit_remote_build(std::move(key), shared, std::move(reply));
        });
    s.segment_port = s.segments->listen(s.opt.host, s.opt.segment_port);
#else
    throw std::runtime_error("--segment-port: this build has no segment workers (built without UCX, libucx-dev)");
#endif
  }
  return s.bound_port;
}

int HttpServer::segment_port() const {
  return impl_->segment_port;
}

void HttpServer::run() {
  impl_->http->run();
}

void HttpServer::stop() {
  if (!impl_) return;
  if (!impl_->stopped.exchange(true)) impl_->sched->stop();
  impl_->http->stop();
}

const std::string& HttpServer::model_name() const {
  return impl_->facts.name;
}
Metrics& HttpServer::metrics() {
  return impl_->metrics;
}

SegmentCacheStats HttpServer::cache_stats() const {
  return impl_->sched->cache_stats();
}

}  // namespace hypic::server
