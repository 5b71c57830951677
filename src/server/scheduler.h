// The engine thread of `hypic serve`. The model and its caches are not safe for concurrent
// forwards, so one thread owns them; HTTP handler threads submit Jobs into a bounded queue and
// wait on each job's output channel.
//
// Each engine iteration (continuous batching):
//   1. admits queued jobs while fewer than max_running are running;
//   2. drops jobs whose client went away (their sequence state is freed);
//   3. runs ONE prefill unit for the oldest job still prefilling: a span of at most
//      prefill_chunk tokens (full mode, or a prompt without segments), one missing segment built
//      in isolation (pic / naive, and the segments API; a long one a chunk at a time), or a step
//      of the final composition (at most compose_chunk seam rows);
//   4. advances every decoding sequence by one token (decode_step: one Model::forward per
//      sequence today; a batched Model call replaces that one function).
// So a long prompt is spread over many iterations and never stalls the streams already running.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/sampler.h"
#include "models/model.h"
#include "pic/composer.h"
#include "server/api.h"
#include "server/metrics.h"

namespace hypic {
class Tokenizer;
}
namespace hypic::cluster {
class WorkerPool;
struct BuildOutcome;
}  // namespace hypic::cluster

namespace hypic::server {

using Clock = std::chrono::steady_clock;

// One generated token as the handler sees it: the text that may be shown now (held back while it
// could still be the start of a stop string, so streamed text always equals the final text).
struct TokenOut {
  int32_t id = 0;
  std::string text;
  std::optional<TokenLogprob> logprob;
};

struct Job {
  enum class Kind { Generate, Segments };
  Kind kind = Kind::Generate;
  std::string id;  // request id (cmpl-..., chatcmpl-..., seg-...)
  GenSpec gen;
  SegmentsSpec segs;
  Clock::time_point arrived = Clock::now();
  std::atomic<bool> cancelled{false};

  // ---- output channel (guarded by mu) ----
  std::mutex mu;
  std::condition_variable cv;
  std::vector<TokenOut> out;  // produced, not yet taken by the handler
  std::string tail;           // text released at the end (held-back bytes, decoder flush)
  bool done = false;
  int error_status = 0;  // != 0: the job failed (499: cancelled)
  std::string error_message;
  // Final figures (valid once done).
  std::string finish_reason;
  int64_t completion_tokens = 0;
  CacheReport report;  // hit/miss segments, reused / computed prompt tokens for THIS request
  double ttft_ms = -1, total_ms = 0;
  nlohmann::json segments_result;   // Segments jobs: [{"id", "tokens", "bytes", "cached"}]
  std::string wire;                 // Segments jobs with segs.encode: the entry, encoded
  bool wire_cached = false;         // ... found in the cache rather than built
  std::shared_ptr<void> wire_keep;  // ... in the shared form (segs.share): its buffer
  // Called once on the engine thread when the job is done (failed too), after the waiters are woken.
  std::function<void(Job&)> on_done;

  // Handler side: waits up to `timeout` for output; moves new tokens into `got`. Returns done.
  bool wait(std::vector<TokenOut>& got, std::chrono::milliseconds timeout);
};

struct SchedulerOptions {
  size_t cache_budget_bytes = size_t(4096) << 20;
  int max_queue = 64;
  int max_running = 8;
  int prefill_chunk = 0;  // 0: 512 on the CPU, 2048 on a GPU (MoE layers read most experts at 512 rows already)
  // PIC work per engine iteration, in rows through every layer: a composition step's seam rows, and
  // a segment build step's token-layers (whole layers of its chunk, at least one). 0:
  // prefill_chunk / 32 on the CPU (its composition products run row-independent, several times a
  // GEMM row's time; steps this small keep a short request's wait under its own time there, at no
  // measured cost in throughput), else prefill_chunk.
  int compose_chunk = 0;
  // Persistent segment store (--cache-dir): "" = memory only. Segments missing from memory are
  // looked up on disk before being computed; new ones are written through.
  std::string cache_dir;
  size_t disk_budget_bytes = std::numeric_limits<size_t>::max();
  // Host tier of the segment cache (--host-cache-mib, GPU backends): 0 = none.
  size_t host_cache_bytes = 0;
  // Segment workers (--workers, a list "host:port,..." or a cluster file's text): the missing
  // entries of a PIC plan are spread over them and this engine by LPT. "" = build everything here.
  std::string workers;
  double worker_deadline_seconds = 30;  // a remote build's deadline: at least this, or
  double worker_deadline_factor = 8;    // this many times the estimated time of the worker's queue
  double worker_probe_seconds = 5;      // an unhealthy worker is probed again after this
  bool worker_round_robin = false;      // deal segments in turn instead of LPT (benchmarks)
};

struct SegmentInfo {
  std::string id;
  int64_t tokens = 0;
  size_t bytes = 0;
  int seam = 0;
};

class Scheduler {
 public:
  Scheduler(Model& model, const Tokenizer* tok, SchedulerOptions opt, Metrics& metrics);
  ~Scheduler();
  void start();
  // Fails every queued and running job with 503 and joins the engine thread.
  void stop();
  // false: the queue is full (or the scheduler stopped) and the job was not taken.
  bool submit(const std::shared_ptr<Job>& job);

  SegmentCacheStats cache_stats() const { return engine_.cache().stats(); }
  // Seconds the engine thread has spent in its current iteration while work is waiting; 0 when it
  // is idle. /health turns a value past the watchdog limit into 503.
  double stalled_seconds() const;
  // Entries this server put in (or found in) the segment cache and that are still there.
  std::vector<SegmentInfo> list_segments();
  bool erase_segment(const std::string& id);  // false: unknown id
  void clear_segments();
  // A segment worker's build (cluster::SegmentService): the entry of `key`, found in the cache or
  // built in isolation as one more job of this engine, encoded; `reply` gets it on the engine
  // thread (or at once when the queue is full).
  // shared: in the entry's shared form where this backend can share memory (same host).
  void submit_remote_build(SegmentKey key, bool shared, std::function<void(cluster::BuildOutcome)> reply);
  // Combine node: the segment workers and their state (empty without --workers).
  nlohmann::json workers_json() const;

 private:
  struct Seq;
  std::atomic<int64_t> beat_ns_{0};  // steady clock at the start of the current iteration
  std::atomic<bool> busy_{false};
  size_t next_prefill_ = 0;  // where the round robin over prefilling sequences resumes
  uint64_t unpinned_ = 0;    // counts requests letting go of their segment entries (engine thread)
  int short_first_ = 0;      // short prompts run ahead of the round robin in a row
  void beat();
  void loop();
  void step();
  bool prefill_unit(Seq& s);  // true when the sequence is ready to decode (or finished)
  // PIC work per iteration: compose_chunk rows through every layer; a segment build's step takes
  // as many whole layers of its chunk as that many token-layers allow.
  int64_t build_budget() const { return int64_t{opt_.compose_chunk} * model_.config().num_hidden_layers; }
  const char* unit_kind(const Seq& s) const;  // the phase label of s's next prefill unit
  void start_decode(Seq& s);
  void decode_sample(Seq& s);  // samples from s.logits (or takes s.picked), emits; may finish the job
  // Greedy or plain temperature sampling without log-probs: the token is drawn on the device
  // (Backend::sample_rows, padded ids masked there) and only its id comes back.
  bool device_pick(const Seq& s) const;
  // Advances each sequence by its next token: one Model::forward_batch over all of them (a
  // replayed graph per batch size on the GPU), or one forward each when the batch call fails.
  void decode_step(std::vector<Seq*>& seqs);
  void finish(Seq& s, const std::string& reason);
  void fail(Job& j, int status, const std::string& msg);
  void drop_cancelled_queued();  // fails and removes queued jobs whose client went away (mu_ held)
  void remember(const std::shared_ptr<const SegmentEntry>& e);
  // Combine node: sends the plan's missing entries that LPT gives to workers; takes in the ones
  // that came back (a failed one stays missing and is built here); forgets a request's builds.
  void dispatch_remote(Seq& s);
  void collect_remote(Seq& s);
  void drop_remote(Seq& s);
  bool remote_waiting(const Seq& s) const;   // only remote builds left, none finished yet
  bool wait_for_cache(Seq& s);               // a full cache: let go of the request's entries and wait
  size_t local_missing(const Seq& s) const;  // the first part missing and not at a worker (npos: none)
  void build_local(Seq& s, size_t part);     // one bounded step of that part's build here
  void sync_pool_metrics();
  void wake();  // a remote build finished: the engine loop looks again
  // "" when an entry loaded from disk fits this model's layer layout and shapes.

  Model& model_;
  const Tokenizer* tok_;
  std::vector<int32_t> padded_ids_;  // ids without a tokenizer entry (requests with mask_padded_ids)
  Tensor padded_mask_;               // U8 [vocab] on the model's device: 1 at padded_ids_ (device draws)
  SchedulerOptions opt_;
  Metrics& metrics_;
  mutable PicEngine engine_;
  std::shared_ptr<cluster::WorkerPool> pool_;  // shared: its deleter is made where it is
  double local_rate_ = 0;                      // tokens/s of this engine's isolated builds (measured; 0: none yet)
  uint64_t wakes_ = 0;                         // guarded by mu_: remote builds finished
  bool idle_ = false;                          // the last iteration did nothing (all prefills wait on workers)

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stopping_ = false;
  std::thread thread_;
  std::vector<std::unique_ptr<Seq>> running_;  // engine thread only

  struct IndexEntry {
    SegmentKey key;
    std::weak_ptr<const SegmentEntry> entry;
    size_t bytes = 0;
  };
  std::mutex index_mu_;
  std::map<uint64_t, IndexEntry> index_;
};

}  // namespace hypic::server
