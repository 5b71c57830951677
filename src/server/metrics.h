// Server metrics, rendered in the Prometheus text exposition format (version 0.0.4).
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "pic/segment_cache.h"

namespace hypic::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  // Appends `name_bucket{le=...}`, `name_sum`, `name_count` lines; `labels` (`k="v"`) go on each.
  void render(std::string& out, const std::string& name, const std::string& labels = "") const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // one per bound, plus +Inf
  double sum_ = 0;
  uint64_t n_ = 0;
  mutable std::mutex mu_;
};

struct Metrics {
  Metrics();
  void count_request(const std::string& endpoint, int status);
  // Generation requests that finished (any status): latency figures and token counts.
  void observe_generation(double ttft_s, double total_s, int64_t prompt_computed, int64_t prompt_reused,
                          int64_t generated, int hit_segments, int miss_segments);
  // One engine iteration's phase (seconds, device work included): the prefill unit by its kind
  // (prefill, prefix, build, compose, segments), the batched decode forward (decode), and taking
  // the next tokens from the logits (sample).
  void observe_phase(const std::string& phase, double seconds);
  std::string render(const SegmentCacheStats& cache) const;

  std::atomic<int64_t> queue_depth{0}, running{0};
  std::atomic<int64_t> kv_reserved_tokens{0};  // KV rows held by running sequences (sum of capacities)
  std::atomic<uint64_t> cancelled{0}, prefill_chunks{0}, decode_steps{0};
  std::atomic<uint64_t> cache_waits{0};  // requests that waited for others' segment entries
  // Segment parallelism (cluster/). Combine node: builds asked of workers, entries taken from them,
  // their bytes, failures by cause, and segments built here after a worker failed; worker side:
  // builds served to combine nodes.
  std::atomic<uint64_t> remote_requests{0}, remote_entries{0}, remote_bytes{0}, remote_timeouts{0}, remote_lost{0},
      remote_errors{0}, remote_bad_entries{0}, remote_fallbacks{0}, remote_recoveries{0}, served_builds{0},
      served_bytes{0}, remote_transfer_us{0};
  std::atomic<uint64_t> remote_overlap_steps{0};  // composition steps run while workers still built
  // Entries that came in their shared form (device to device), and the time spent copying them in.
  std::atomic<uint64_t> remote_shared_entries{0}, remote_import_us{0};
  // Shared entries this node could not map (their worker sends bytes from then on); worker side:
  // entries served in their shared form.
  std::atomic<uint64_t> remote_shared_failures{0}, served_shared{0};
  std::atomic<int64_t> workers{0}, workers_healthy{0};

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  Histogram ttft_, latency_;
  std::map<std::string, Histogram> phases_;  // guarded by mu_ (insertion); each histogram locks itself
  std::atomic<uint64_t> prompt_computed_{0}, prompt_reused_{0}, generated_{0}, seg_hits_{0}, seg_misses_{0};
};

}  // namespace hypic::server
