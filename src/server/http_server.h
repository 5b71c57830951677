// `hypic serve`: an OpenAI-compatible HTTP server over one loaded model (HTTP layer: http_transport.h).
//   POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics,
//   POST|GET|DELETE /v1/segments, GET|DELETE /v1/segments/{id}.
// See docs/serving.md for the request fields, the PIC extension and the metrics.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "pic/composer.h"
#include "server/scheduler.h"

namespace hypic {
struct LoadedModel;
}

namespace hypic::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;         // 0: any free port (see HttpServer::bind)
  std::string model_name;  // served name; default: the model folder's base name
  PicOptions pic;          // defaults for requests without a "pic" object
  SchedulerOptions sched;
  size_t max_body_bytes = size_t(32) << 20;  // larger bodies get 413
  int max_json_depth = 64;                   // deeper JSON gets 400
  int http_threads = 0;                      // threads for POSTs; 0: max_running + max_queue + 8
  // Connection limits (http_transport.h): idle or slow connections cost a socket each, not a thread.
  double head_timeout_s = 15;             // a request head complete within this (idle keep-alive too)
  int max_connections = 8192;             // in total (lowered to the open-file limit); 503 past it
  int max_connections_per_client = 2048;  // per remote address (0: none); 503 past it
  bool mask_padded_ids = false;           // default of the request field: ids without a tokenizer entry never sampled
  // Access control (docs/serving.md, "Security"). With api_key set, /v1/* needs
  // "Authorization: Bearer <api_key or admin_key>"; with either key set, POST and DELETE of
  // /v1/segments (which fill and wipe the shared cache) need the admin key. /health and /metrics
  // stay open for probes and scrapers.
  std::string api_key, admin_key;
  // Browser Origins allowed to call the server ("*": any). A request carrying another Origin gets
  // 403: without this, any web page a user visits could drive or wipe a local server.
  std::vector<std::string> cors_origins;
  // /health answers 503 once the engine has spent this long in one iteration while requests wait
  // (a stuck engine must not look healthy to a load balancer); 0 disables the check.
  double watchdog_s = 600;
  // Segment worker service (--segment-port): >= 0 accepts segment builds from combine nodes over
  // UCX on this port (0: any free port, see HttpServer::segment_port); -1: off.
  int segment_port = -1;
};

class HttpServer {
 public:
  // The model must outlive the server. Starts the engine thread.
  HttpServer(LoadedModel& lm, ServerOptions opt);
  ~HttpServer();
  // Binds the listening socket; returns the port (the chosen one when opt.port == 0). Throws
  // std::runtime_error when the address cannot be bound.
  int bind();
  // Serves until stop(); call bind() first.
  void run();
  // Stops accepting, fails queued/running jobs with 503, returns once handlers are released.
  void stop();
  const std::string& model_name() const;
  int segment_port() const;  // the bound segment service port, or -1
  Metrics& metrics();
  SegmentCacheStats cache_stats() const;  // memory and disk tiers

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hypic::server
