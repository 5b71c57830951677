#include "server/metrics.h"

#include <cstdio>

namespace hypic::server {

namespace {
std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.12g", v);
  return buf;
}
void header(std::string& out, const char* name, const char* type, const char* help) {
  out += "# HELP ";
  out += name;
  out += ' ';
  out += help;
  out += "\n# TYPE ";
  out += name;
  out += ' ';
  out += type;
  out += '\n';
}
void scalar(std::string& out, const char* name, const char* type, const char* help, double v) {
  header(out, name, type, help);
  out += name;
  out += ' ';
  out += num(v);
  out += '\n';
}
const std::vector<double> kLatencyBounds = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
const std::vector<double> kPhaseBounds = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                          0.1,    0.25,  0.5,    1,     2.5,  5,     10};
}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  std::lock_guard<std::mutex> g(mu_);
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++n_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& labels) const {
  std::lock_guard<std::mutex> g(mu_);
  const std::string pre = labels.empty() ? "" : labels + ",";
  const std::string own = labels.empty() ? "" : "{" + labels + "}";
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += name + "_bucket{" + pre + "le=\"" + num(bounds_[i]) + "\"} " + std::to_string(cum) + "\n";
  }
  cum += counts_.back();
  out += name + "_bucket{" + pre + "le=\"+Inf\"} " + std::to_string(cum) + "\n";
  out += name + "_sum" + own + " " + num(sum_) + "\n";
  out += name + "_count" + own + " " + std::to_string(n_) + "\n";
}

Metrics::Metrics() : ttft_(kLatencyBounds), latency_(kLatencyBounds) {}

void Metrics::count_request(const std::string& endpoint, int status) {
  std::lock_guard<std::mutex> g(mu_);
  ++requests_[{endpoint, status}];
}

void Metrics::observe_phase(const std::string& phase, double seconds) {
  Histogram* h = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    h = &phases_.try_emplace(phase, kPhaseBounds).first->second;  // map nodes stay put
  }
  h->observe(seconds);
}

void Metrics::observe_generation(double ttft_s, double total_s, int64_t prompt_computed, int64_t prompt_reused,
                                 int64_t generated, int hit_segments, int miss_segments) {
  if (ttft_s >= 0) ttft_.observe(ttft_s);
  latency_.observe(total_s);
  prompt_computed_ += static_cast<uint64_t>(std::max<int64_t>(prompt_computed, 0));
  prompt_reused_ += static_cast<uint64_t>(std::max<int64_t>(prompt_reused, 0));
  generated_ += static_cast<uint64_t>(std::max<int64_t>(generated, 0));
  seg_hits_ += static_cast<uint64_t>(std::max(hit_segments, 0));
  seg_misses_ += static_cast<uint64_t>(std::max(miss_segments, 0));
}

std::string Metrics::render(const SegmentCacheStats& c) const {
  std::string out;
  header(out, "hypic_requests_total", "counter", "HTTP requests by endpoint and status (499: client went away)");
  {
    std::lock_guard<std::mutex> g(mu_);
    for (const auto& [k, v] : requests_)
      out += "hypic_requests_total{endpoint=\"" + k.first + "\",status=\"" + std::to_string(k.second) + "\"} " +
             std::to_string(v) + "\n";
  }
  header(out, "hypic_time_to_first_token_seconds", "histogram", "Request arrival to first generated token");
  ttft_.render(out, "hypic_time_to_first_token_seconds");
  header(out, "hypic_request_latency_seconds", "histogram", "Generation request arrival to last token");
  latency_.render(out, "hypic_request_latency_seconds");
  header(out, "hypic_engine_phase_seconds", "histogram",
         "Engine iteration phases, device work included: prefill units by kind (prefill, prefix, build, compose, "
         "segments), the batched decode forward (decode), picking the next tokens (sample)");
  {
    std::lock_guard<std::mutex> g(mu_);
    for (const auto& [phase, h] : phases_) h.render(out, "hypic_engine_phase_seconds", "phase=\"" + phase + "\"");
  }
  scalar(out, "hypic_prompt_tokens_prefilled_total", "counter",
         "Prompt tokens run through the model (isolated segment prefills, seams, questions)",
         static_cast<double>(prompt_computed_.load()));
  scalar(out, "hypic_prompt_tokens_reused_total", "counter", "Prompt tokens taken from the cache without recompute",
         static_cast<double>(prompt_reused_.load()));
  scalar(out, "hypic_generation_tokens_total", "counter", "Generated tokens", static_cast<double>(generated_.load()));
  scalar(out, "hypic_segment_cache_hits_total", "counter", "Prompt segments found in the segment cache",
         static_cast<double>(seg_hits_.load()));
  scalar(out, "hypic_segment_cache_misses_total", "counter", "Prompt segments prefilled in isolation and cached",
         static_cast<double>(seg_misses_.load()));
  scalar(out, "hypic_segment_cache_evictions_total", "counter", "Segment cache LRU evictions",
         static_cast<double>(c.evictions));
  scalar(out, "hypic_segment_cache_inserts_total", "counter", "Segment cache insertions",
         static_cast<double>(c.inserts));
  scalar(out, "hypic_segment_cache_bytes", "gauge", "Bytes held by the segment cache", static_cast<double>(c.bytes));
  scalar(out, "hypic_segment_cache_entries", "gauge", "Entries in the segment cache", static_cast<double>(c.entries));
  scalar(out, "hypic_segment_cache_budget_bytes", "gauge", "Segment cache byte budget", static_cast<double>(c.budget));
  scalar(out, "hypic_segment_cache_waits_total", "counter",
         "Times a request let go of its segments and waited: the cache was full of entries other requests held",
         static_cast<double>(cache_waits.load()));
  scalar(out, "hypic_segment_cache_host_hits_total", "counter",
         "Segments copied back from the host tier (--host-cache-mib) on a memory miss",
         static_cast<double>(c.host_hits));
  scalar(out, "hypic_segment_cache_host_demotions_total", "counter",
         "Segments copied to the host tier when evicted from GPU memory", static_cast<double>(c.host_demotions));
  scalar(out, "hypic_segment_cache_host_evictions_total", "counter", "Segments dropped from the host tier",
         static_cast<double>(c.host_evictions));
  scalar(out, "hypic_segment_cache_host_bytes", "gauge", "Bytes of segments in the host tier",
         static_cast<double>(c.host_bytes));
  scalar(out, "hypic_segment_cache_host_entries", "gauge", "Segments in the host tier",
         static_cast<double>(c.host_entries));
  scalar(out, "hypic_segment_cache_host_budget_bytes", "gauge", "Host tier byte budget",
         static_cast<double>(c.host_budget));
  scalar(out, "hypic_segment_cache_disk_hits_total", "counter",
         "Segments loaded from the persistent store (--cache-dir) on a memory miss", static_cast<double>(c.disk_hits));
  scalar(out, "hypic_segment_cache_disk_writes_total", "counter", "Segment files written to the persistent store",
         static_cast<double>(c.disk_writes));
  scalar(out, "hypic_segment_cache_disk_write_errors_total", "counter",
         "Failed segment file writes (the requests still succeeded)", static_cast<double>(c.disk_write_errors));
  scalar(out, "hypic_segment_cache_corrupt_files_total", "counter",
         "Segment files rejected as damaged or foreign (renamed to *.bad)", static_cast<double>(c.corrupt_files));
  scalar(out, "hypic_segment_cache_disk_bytes", "gauge", "Bytes of segment files in the persistent store",
         static_cast<double>(c.disk_bytes));
  scalar(out, "hypic_segment_cache_disk_entries", "gauge", "Segment files in the persistent store",
         static_cast<double>(c.disk_entries));
  if (workers.load() > 0) {
    scalar(out, "hypic_segment_workers", "gauge", "Segment workers this node may hand builds to (--workers)",
           static_cast<double>(workers.load()));
    scalar(out, "hypic_segment_workers_healthy", "gauge", "Of those, the ones taking builds now",
           static_cast<double>(workers_healthy.load()));
    scalar(out, "hypic_remote_builds_requested_total", "counter", "Segment builds asked of workers",
           static_cast<double>(remote_requests.load()));
    scalar(out, "hypic_remote_entries_total", "counter", "Entries received from workers and cached",
           static_cast<double>(remote_entries.load()));
    scalar(out, "hypic_remote_entry_bytes_total", "counter", "Bytes of entries received from workers",
           static_cast<double>(remote_bytes.load()));
    scalar(out, "hypic_remote_transfer_seconds_total", "counter",
           "Sum over worker replies of the round trip less the worker's own time (requests and entries in flight)",
           static_cast<double>(remote_transfer_us.load()) / 1e6);
    scalar(out, "hypic_remote_shared_entries_total", "counter",
           "Entries received device to device, copied out of the worker's shared memory (same host)",
           static_cast<double>(remote_shared_entries.load()));
    scalar(out, "hypic_remote_import_seconds_total", "counter",
           "Time spent copying shared entries out of workers' memory (part of the transfer)",
           static_cast<double>(remote_import_us.load()) / 1e6);
    scalar(out, "hypic_remote_shared_failures_total", "counter",
           "Shared entries that could not be mapped here (that worker sends bytes from then on)",
           static_cast<double>(remote_shared_failures.load()));
    scalar(out, "hypic_remote_timeouts_total", "counter", "Worker builds that missed their deadline",
           static_cast<double>(remote_timeouts.load()));
    scalar(out, "hypic_remote_lost_total", "counter", "Worker builds lost with their connection",
           static_cast<double>(remote_lost.load()));
    scalar(out, "hypic_remote_errors_total", "counter", "Worker builds answered with an error",
           static_cast<double>(remote_errors.load()));
    scalar(out, "hypic_remote_bad_entries_total", "counter",
           "Entries from workers rejected by this node's checks (damaged, foreign, wrong shapes)",
           static_cast<double>(remote_bad_entries.load()));
    scalar(out, "hypic_remote_fallbacks_total", "counter", "Segments built here after their worker failed",
           static_cast<double>(remote_fallbacks.load()));
    scalar(out, "hypic_remote_overlap_steps_total", "counter",
           "Composition steps run while workers still built later segments of the request",
           static_cast<double>(remote_overlap_steps.load()));
    scalar(out, "hypic_segment_worker_recoveries_total", "counter", "Unhealthy workers that answered a probe",
           static_cast<double>(remote_recoveries.load()));
  }
  scalar(out, "hypic_served_builds_total", "counter", "Segment entries sent to combine nodes (--segment-port)",
         static_cast<double>(served_builds.load()));
  scalar(out, "hypic_served_bytes_total", "counter", "Bytes of entries sent to combine nodes",
         static_cast<double>(served_bytes.load()));
  scalar(out, "hypic_served_shared_total", "counter",
         "Of the entries sent to combine nodes: in their shared form (device to device, same host)",
         static_cast<double>(served_shared.load()));
  scalar(out, "hypic_queue_depth", "gauge", "Requests waiting for the engine", static_cast<double>(queue_depth.load()));
  scalar(out, "hypic_running_requests", "gauge", "Requests being prefilled or decoded",
         static_cast<double>(running.load()));
  scalar(out, "hypic_kv_reserved_tokens", "gauge", "KV cache rows held by running requests (grows as they decode)",
         static_cast<double>(kv_reserved_tokens.load()));
  scalar(out, "hypic_cancelled_requests_total", "counter", "Requests cancelled because the client went away",
         static_cast<double>(cancelled.load()));
  scalar(out, "hypic_prefill_steps_total", "counter", "Engine iterations that ran a prefill unit",
         static_cast<double>(prefill_chunks.load()));
  scalar(out, "hypic_decode_steps_total", "counter", "Engine iterations that advanced running sequences",
         static_cast<double>(decode_steps.load()));
  return out;
}

}  // namespace hypic::server
