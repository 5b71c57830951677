// hypic serve: the OpenAI-compatible HTTP server (src/server/, docs/serving.md).
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "engine/loader.h"

#ifdef HYPIC_HAVE_SERVER
#include "server/budgets.h"
#include "server/http_server.h"
#endif

namespace hypic::cli {

namespace {
int g_sig_pipe[2] = {-1, -1};
void on_signal(int) {
  const char c = 's';
  [[maybe_unused]] ssize_t n = write(g_sig_pipe[1], &c, 1);
}
}  // namespace

// A key from its flag, its file (first line, surrounding whitespace dropped) or the environment,
// in that order; the flag and the file together are an error, as is an empty file.
[[maybe_unused]] static std::string secret_option(const std::string& flag, const std::string& value,
                                                  const std::string& file, const char* env) {
  if (!value.empty() && !file.empty()) throw std::invalid_argument(flag + " and " + flag + "-file are exclusive");
  std::string key = value;
  if (!file.empty()) {
    std::ifstream in(file);
    if (!in) throw std::invalid_argument(flag + "-file: cannot read " + file);
    std::getline(in, key);
  } else if (key.empty()) {
    if (const char* e = std::getenv(env)) key = e;
  }
  const auto b = key.find_first_not_of(" \t\r\n"), e = key.find_last_not_of(" \t\r\n");
  key = b == std::string::npos ? std::string() : key.substr(b, e - b + 1);
  if (!file.empty() && key.empty())
    throw std::invalid_argument(flag + "-file: " + file + " has no key on its first line");
  return key;
}

void register_serve(CLI::App& app) {
  struct Opts {
    std::string model = default_model_dir(), host = "127.0.0.1", mode = "pic", name, backend = "cpu";
    std::string quantize, activations;
    int port = 8080, seam = 8, max_queue = 64, max_running = 8, threads = 0, prefill_chunk = 0, http_threads = 0,
        compose_chunk = 0;
    double cache_mib = 0, max_body_mib = 32, host_cache_mib = 0;  // cache_mib: set from the machine unless given
    int max_json_depth = 64;
    bool mask_padded = false;
    std::string cache_dir;
    double disk_budget_mib = 0;  // set from the free space unless given; 0 given: unlimited
    std::string api_key, api_key_file, admin_key, admin_key_file;
    std::vector<std::string> cors_origins;
    double watchdog_s = 600;
    double head_timeout_s = 15;
    int max_connections = 8192, max_connections_per_client = 2048;
    // Real shapes without a checkpoint (serving benchmarks): a bare config, seeded random weights,
    // and a tokenizer folder of its own.
    std::string config, dtype = "bf16", tokenizer;
    bool random = false;
    // Segment parallelism (docs/cluster.md).
    std::string role = "server", workers, cluster_file;
    int segment_port = -1;
    double worker_deadline_s = 30, worker_probe_s = 5, worker_deadline_factor = 8;
    std::string worker_schedule = "lpt";
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("serve", "Serve the model over an OpenAI-compatible HTTP API");
  c->add_option("--model", o->model, kModelHelp)->capture_default_str();
  c->add_option("--config", o->config, "Bare config.json to serve with --random-weights (benchmarks at real shapes)");
  c->add_flag("--random-weights", o->random, "Seeded random weights for --config instead of a model folder");
  c->add_option("--dtype", o->dtype, "Weight dtype for --random-weights: bf16, f16, f32, q8_0, q4_k, q6_k")
      ->capture_default_str();
  c->add_option("--quantize", o->quantize, "Quantize the matrices as they load: q8_0, q4_k or q6_k (CPU backend)");
  c->add_option("--activations", o->activations,
                "Activations of the products: f32 (exact) or bf16 (cuda's tensor cores; on the cpu oneDNN's "
                "AVX512_BF16 kernels; default: cpu f32, cuda bf16)");
  c->add_option("--tokenizer", o->tokenizer,
                "Folder with tokenizer.json (and tokenizer_config.json) to use instead of the model's");
  c->add_option("--host", o->host, "Address to listen on")->capture_default_str();
  c->add_option("--port", o->port, "Port to listen on (0: any free port, printed at start)")->capture_default_str();
  c->add_option("--served-model-name", o->name, "Model name in the API (default: the folder's name)");
  c->add_option("--mode", o->mode, "Default prefill mode: full, prefix, pic, naive")->capture_default_str();
  c->add_option("--seam", o->seam, "Default recomputed head tokens of each reused segment")->capture_default_str();
  c->add_option("--cache-budget-mib", o->cache_mib,
                "Segment cache budget in MiB (default: a quarter of this machine's memory, at most 4096; on a GPU, "
                "half of the device memory free after loading)");
  c->add_option("--cache-dir", o->cache_dir,
                "Persistent segment store: segments survive restarts (memory misses look here first)");
  c->add_option("--host-cache-mib", o->host_cache_mib,
                "GPU backends: keep segments evicted from GPU memory in page-locked host memory, up to this many "
                "MiB (0: none); a request copies them back while it starts")
      ->capture_default_str();
  c->add_option("--disk-budget-mib", o->disk_budget_mib,
                "Byte budget of --cache-dir in MiB (default: half the free space there at start, at most 32 GiB; "
                "0: unlimited)");
  c->add_option("--max-queue", o->max_queue, "Requests waiting for the engine before 429")->capture_default_str();
  c->add_option("--max-running", o->max_running, "Requests prefilled/decoded concurrently")->capture_default_str();
  c->add_option("--prefill-chunk", o->prefill_chunk,
                "Prompt tokens prefilled per engine iteration (full and prefix modes, long questions; 0: 512 on "
                "the CPU, 2048 on a GPU, where a mixture-of-experts layer costs nearly as much for 512 rows as for "
                "2048)")
      ->capture_default_str();
  c->add_option("--compose-chunk", o->compose_chunk,
                "PIC work per engine iteration, in rows through every layer: a composition's seam rows, a "
                "segment build's tokens x layers (0: --prefill-chunk / 32 on the CPU, --prefill-chunk on a GPU)")
      ->capture_default_str();
  c->add_option("--threads", o->threads, "CPU threads for the model (0: all cores)")->capture_default_str();
  c->add_option("--http-threads", o->http_threads,
                "Threads for POST requests, which wait for the engine (0: max-running + max-queue + 8)")
      ->capture_default_str();
  c->add_option("--head-timeout-s", o->head_timeout_s,
                "A request head must be complete within this, counted from the connection or the previous "
                "response (slow or idle connections are closed)")
      ->capture_default_str();
  c->add_option("--max-connections", o->max_connections,
                "Open connections in total (lowered to the open-file limit); more get 503")
      ->capture_default_str();
  c->add_option("--max-connections-per-client", o->max_connections_per_client,
                "Open connections per client address (0: no per-client cap); more get 503")
      ->capture_default_str();
  c->add_option("--max-body-mib", o->max_body_mib, "Largest accepted request body in MiB (larger: 413)")
      ->capture_default_str();
  c->add_option("--max-json-depth", o->max_json_depth, "Deepest accepted JSON nesting (deeper: 400)")
      ->capture_default_str();
  c->add_flag("--mask-padded-ids", o->mask_padded,
              "Default of the request field mask_padded_ids: never sample ids without a tokenizer entry (default: "
              "sample over every row, as transformers does)");
  c->add_option("--backend", o->backend, "Compute backend")->capture_default_str();
  c->add_option("--api-key", o->api_key,
                "Key clients must send as 'Authorization: Bearer <key>' for /v1/* (also HYPIC_API_KEY)");
  c->add_option("--api-key-file", o->api_key_file, "File whose first line is the API key (keeps it out of ps)");
  c->add_option("--admin-key", o->admin_key,
                "Key for POST and DELETE of /v1/segments, which fill and wipe the shared cache (also "
                "HYPIC_ADMIN_KEY); with an API key set and no admin key, segment writes are refused");
  c->add_option("--admin-key-file", o->admin_key_file, "File whose first line is the admin key");
  c->add_option("--cors-origin", o->cors_origins,
                "Browser Origin allowed to call the server (repeatable, or '*'); requests from any other "
                "Origin get 403")
      ->delimiter(',');
  c->add_option("--role", o->role,
                "server: answer requests (and build segments for others with --segment-port); worker: the same "
                "with the segment service on by default (--segment-port 7070)")
      ->check(CLI::IsMember({"server", "worker"}))
      ->capture_default_str();
  c->add_option("--segment-port", o->segment_port,
                "Build segments for combine nodes over UCX on this port (0: any free port, in GET /health; -1: off)");
  c->add_option("--workers", o->workers,
                "Segment workers (host:port,...) to spread the missing segments of a PIC request over, LPT");
  c->add_option("--cluster-file", o->cluster_file, "File of segment workers: host:port per line ('#' comments)");
  c->add_option("--worker-deadline-s", o->worker_deadline_s,
                "A worker's build fails (and is done here) after this long, or 8x the estimated time of its queue "
                "there if longer")
      ->capture_default_str();
  c->add_option("--worker-schedule", o->worker_schedule,
                "lpt: longest segment to the node that finishes it first; round-robin: in turn (for comparison)")
      ->check(CLI::IsMember({"lpt", "round-robin"}))
      ->capture_default_str();
  c->add_option("--worker-deadline-factor", o->worker_deadline_factor,
                "... or this many times the estimated time of the worker's queue up to the build")
      ->capture_default_str();
  c->add_option("--worker-probe-s", o->worker_probe_s, "An unhealthy worker is probed again after this long")
      ->capture_default_str();
  c->add_option("--watchdog-s", o->watchdog_s,
                "GET /health answers 503 once the engine has spent this long in one iteration while requests "
                "wait (0: off)")
      ->capture_default_str();
  c->callback([o, c] {
    guarded([&] {
#ifndef HYPIC_HAVE_SERVER
      throw std::runtime_error(
          "this hypic was built without a server; install libboost-dev and libcpp-httplib-dev and rebuild");
#else
      server::ServerOptions so;
      so.host = o->host;
      so.port = o->port;
      so.model_name = o->name;
      so.pic.mode = parse_pic_mode(o->mode);
      if (o->seam < 0) throw std::invalid_argument("--seam must be >= 0");
      so.pic.seam = o->seam;
      const bool cache_given = c->count("--cache-budget-mib") > 0, disk_given = c->count("--disk-budget-mib") > 0;
      if (cache_given && !(o->cache_mib > 0)) throw std::invalid_argument("--cache-budget-mib must be positive");
      if (!cache_given) o->cache_mib = server::default_cache_budget(server::physical_ram_bytes()) / 1048576.0;
      so.sched.cache_budget_bytes = static_cast<size_t>(o->cache_mib * 1048576.0);
      if (o->disk_budget_mib < 0) throw std::invalid_argument("--disk-budget-mib must be >= 0");
      if (disk_given && o->cache_dir.empty()) throw std::invalid_argument("--disk-budget-mib needs --cache-dir");
      if (o->host_cache_mib < 0) throw std::invalid_argument("--host-cache-mib must be >= 0");
      if (o->host_cache_mib > 0 && o->backend == "cpu")
        throw std::invalid_argument(
            "--host-cache-mib is for GPU backends: the cpu backend's segment cache is in host memory already");
      so.sched.host_cache_bytes = static_cast<size_t>(o->host_cache_mib * 1048576.0);
      so.sched.cache_dir = o->cache_dir;
      if (!disk_given && !o->cache_dir.empty())
        o->disk_budget_mib = server::default_disk_budget(server::free_bytes_at(o->cache_dir)) / 1048576.0;
      if (o->disk_budget_mib > 0) so.sched.disk_budget_bytes = static_cast<size_t>(o->disk_budget_mib * 1048576.0);
      so.sched.max_queue = o->max_queue;
      so.sched.max_running = o->max_running;
      so.sched.prefill_chunk = o->prefill_chunk;
      so.sched.compose_chunk = o->compose_chunk;
      so.http_threads = o->http_threads;
      if (!(o->head_timeout_s > 0)) throw std::invalid_argument("--head-timeout-s must be positive");
      if (o->max_connections < 1) throw std::invalid_argument("--max-connections must be >= 1");
      if (o->max_connections_per_client < 0) throw std::invalid_argument("--max-connections-per-client must be >= 0");
      so.head_timeout_s = o->head_timeout_s;
      so.max_connections = o->max_connections;
      so.max_connections_per_client = o->max_connections_per_client;
      so.mask_padded_ids = o->mask_padded;
      so.api_key = secret_option("--api-key", o->api_key, o->api_key_file, "HYPIC_API_KEY");
      so.admin_key = secret_option("--admin-key", o->admin_key, o->admin_key_file, "HYPIC_ADMIN_KEY");
      so.cors_origins = o->cors_origins;
      if (!(o->watchdog_s >= 0)) throw std::invalid_argument("--watchdog-s must be >= 0");
      so.watchdog_s = o->watchdog_s;
      if (so.api_key.empty() && o->host != "127.0.0.1" && o->host != "localhost" && o->host != "::1")
        spdlog::warn(
            "serving on {} without an API key: anyone who can reach the port can use the model and "
            "the cache (--api-key, --admin-key)",
            o->host);
      if (!(o->max_body_mib > 0)) throw std::invalid_argument("--max-body-mib must be positive");
      so.max_body_bytes = static_cast<size_t>(o->max_body_mib * 1048576.0);
      if (o->max_json_depth < 2) throw std::invalid_argument("--max-json-depth must be >= 2");
      so.max_json_depth = o->max_json_depth;
      if (o->port < 0 || o->port > 65535) throw std::invalid_argument("--port must be in 0..65535");
      if (o->max_running < 1) throw std::invalid_argument("--max-running must be >= 1");
      if (o->max_queue < 1) throw std::invalid_argument("--max-queue must be >= 1");
      if (o->prefill_chunk < 0) throw std::invalid_argument("--prefill-chunk must be >= 0");
      if (o->compose_chunk < 0) throw std::invalid_argument("--compose-chunk must be >= 0");
      if (o->segment_port < -1 || o->segment_port > 65535)
        throw std::invalid_argument("--segment-port must be in 0..65535 (or -1: off)");
      so.segment_port = o->role == "worker" && c->count("--segment-port") == 0 ? 7070 : o->segment_port;
      if (!o->workers.empty() && !o->cluster_file.empty())
        throw std::invalid_argument("--workers and --cluster-file are exclusive");
      so.sched.workers = o->workers;
      if (!o->cluster_file.empty()) {
        std::ifstream in(o->cluster_file);
        if (!in) throw std::invalid_argument("--cluster-file: cannot read " + o->cluster_file);
        so.sched.workers.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
        if (so.sched.workers.find_first_not_of(" \t\r\n") == std::string::npos)
          throw std::invalid_argument("--cluster-file: " + o->cluster_file + " lists no worker");
      }
      if (!(o->worker_deadline_s > 0)) throw std::invalid_argument("--worker-deadline-s must be positive");
      if (!(o->worker_probe_s > 0)) throw std::invalid_argument("--worker-probe-s must be positive");
      so.sched.worker_deadline_seconds = o->worker_deadline_s;
      if (!(o->worker_deadline_factor >= 0)) throw std::invalid_argument("--worker-deadline-factor must be >= 0");
      so.sched.worker_deadline_factor = o->worker_deadline_factor;
      so.sched.worker_probe_seconds = o->worker_probe_s;
      so.sched.worker_round_robin = o->worker_schedule == "round-robin";

      // SIGINT / SIGTERM: a handler (which may run on any thread, including OpenBLAS's, which exist
      // before main) writes to a pipe; a watcher thread reads it and stops the server.
      if (pipe(g_sig_pipe) != 0) throw std::runtime_error("pipe() failed");
      struct sigaction sa {};
      sa.sa_handler = on_signal;
      sigemptyset(&sa.sa_mask);
      sigaction(SIGINT, &sa, nullptr);
      sigaction(SIGTERM, &sa, nullptr);

      // Logs go to stderr (main installs that logger); stdout carries only the "listening on" line
      // (scripts read the port there).
      if (o->random != !o->config.empty())
        throw std::invalid_argument("--random-weights and --config go together (a bare config, random weights)");
      DType rdt = DType::BF16;
      if (o->random) rdt = parse_weight_dtype(o->dtype, "--dtype");
      const auto quantize = quantize_option(o->quantize);
      (void)activations_precise(o->activations);  // a bad name fails before a long load
      spdlog::info("loading model from {}", o->random ? o->config + " (random weights)" : o->model);
      const auto t0 = std::chrono::steady_clock::now();
      std::mutex mu;
      std::condition_variable cv;
      bool loaded = false;
      std::thread ticker([&] {
        std::unique_lock<std::mutex> lk(mu);
        while (!cv.wait_for(lk, std::chrono::seconds(2), [&] { return loaded; }))
          spdlog::info("still loading the model ({:.0f} s)",
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      });
      LoadedModel lm;
      try {
        lm = o->random ? load_random_model(o->config, 1, rdt, o->backend, o->threads)
                       : load_model(o->model, o->backend, o->threads, quantize);
        apply_activations_option(*lm.backend, o->activations);
        if (!o->tokenizer.empty()) {
          namespace fs = std::filesystem;
          const fs::path t = fs::path(o->tokenizer) / "tokenizer.json",
                         tc = fs::path(o->tokenizer) / "tokenizer_config.json";
          if (!fs::is_regular_file(t)) throw std::invalid_argument("--tokenizer: no tokenizer.json in " + o->tokenizer);
          lm.tokenizer = std::make_unique<Tokenizer>(Tokenizer::load(t.string(), fs::exists(tc) ? tc.string() : ""));
          if (static_cast<int64_t>(lm.tokenizer->vocab_size()) > lm.model->config().vocab_size)
            throw std::invalid_argument("--tokenizer: " + std::to_string(lm.tokenizer->vocab_size()) +
                                        " tokens, more than the model's vocabulary of " +
                                        std::to_string(lm.model->config().vocab_size));
        }
      } catch (...) {
        {
          std::lock_guard<std::mutex> g(mu);
          loaded = true;
        }
        cv.notify_all();
        ticker.join();
        throw;
      }
      {
        std::lock_guard<std::mutex> g(mu);
        loaded = true;
      }
      cv.notify_all();
      ticker.join();
      const auto& cfg = lm.model->config();
      spdlog::info(
          "model loaded in {:.2f} s: {} ({} layers, {} parameters, {:.1f} MiB weights, context {}, tokenizer {})",
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), cfg.architecture,
          cfg.num_hidden_layers, lm.model->parameter_count(), lm.model->weight_bytes() / 1048576.0,
          cfg.max_position_embeddings, lm.tokenizer ? "yes" : "no");
      // On a GPU the segment cache lives in device memory: its default follows what the weights left.
      if (const int64_t free_dev = lm.backend->free_memory_bytes(); !cache_given && free_dev >= 0) {
        so.sched.cache_budget_bytes = server::default_gpu_cache_budget(static_cast<uint64_t>(free_dev));
        o->cache_mib = static_cast<double>(so.sched.cache_budget_bytes) / 1048576.0;
      }

      server::HttpServer srv(lm, so);
      const int port = srv.bind();
      std::atomic<bool> run_done{false};
      std::thread sig([&] {
        char c = 0;
        while (read(g_sig_pipe[0], &c, 1) < 0 && errno == EINTR) {
        }
        if (c == 's') spdlog::info("signal received: shutting down");
        // Repeated: a signal that lands before run() starts listening must still end it.
        while (!run_done) {
          srv.stop();
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
      });
      spdlog::info("serving '{}' on http://{}:{} (mode {}, seam {}, cache {:.0f} MiB, max-running {}, max-queue {})",
                   srv.model_name(), o->host, port, o->mode, o->seam, o->cache_mib, o->max_running, o->max_queue);
      if (srv.segment_port() >= 0)
        spdlog::info("building segments for combine nodes on ucx://{}:{}", o->host, srv.segment_port());
      if (!o->cache_dir.empty()) {
        const auto cs = srv.cache_stats();
        spdlog::info("segment store {}: {} files, {:.1f} MiB (budget {})", o->cache_dir, cs.disk_entries,
                     cs.disk_bytes / 1048576.0,
                     o->disk_budget_mib > 0 ? fmt::format("{:.0f} MiB", o->disk_budget_mib) : std::string("unlimited"));
      }
      std::printf("listening on http://%s:%d\n", o->host.c_str(), port);
      std::fflush(stdout);
      srv.run();
      run_done = true;
      const char q = 'q';
      if (write(g_sig_pipe[1], &q, 1) < 0) srv.stop();
      sig.join();
      srv.stop();
      spdlog::info("server stopped");
#endif
    });
  });
}

}  // namespace hypic::cli
