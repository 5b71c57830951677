// The combine node's side of segment parallelism: the segment workers it may hand the missing
// entries of a PIC plan to, which of them is healthy, how fast each builds, and the builds in
// flight. Scheduling is LPT (longest segment first, to the node that would finish it first: its
// queued work plus tokens / its measured rate), the local engine counted as one node; a segment
// that a worker built before is sent back to it (it holds the entry: a fetch, not a build).
//
// Faults: a worker whose connection drops, whose reply is an error or fails the combine node's
// checks, or that misses a build's deadline is marked unhealthy (its builds fail, so the caller
// rebuilds them locally) and is pinged again after probe_seconds; a reply brings it back.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>
#include <vector>

#include "cluster/ucx_transport.h"
#include "pic/segment_cache.h"

namespace hypic::cluster {

using Clock = std::chrono::steady_clock;

struct WorkerAddress {
  std::string host;
  int port = 0;
  std::string str() const { return host + ":" + std::to_string(port); }
};
// "host:port,host:port" (a cluster file holds the same, one per line or comma separated; '#'
// comments). Throws std::invalid_argument naming the bad item.
std::vector<WorkerAddress> parse_workers(const std::string& list);

struct PoolOptions {
  double deadline_min_seconds = 30;  // a build's deadline is at least this,
  double deadline_factor = 8;        // or this many times its estimated time
  double probe_seconds = 5;          // an unhealthy worker is pinged again after this
  bool round_robin = false;          // segments dealt in plan order instead of LPT (benchmarks)
  // This node's host_identity() when its backend can map shared device memory (0: it cannot):
  // workers on the same host then hand entries over device to device.
  uint64_t host = 0;
};

// One build asked of a worker. Filled by the pool's thread; read once `done`.
struct RemoteBuild {
  SegmentKey key;
  int worker = -1;
  uint64_t request = 0;
  Clock::time_point sent, deadline;
  double estimate_seconds = 0;
  std::atomic<bool> done{false};
  bool ok = false;
  bool cached = false;  // the worker had it already
  std::string error;    // !ok: why
  std::string bytes;    // ok: the encoded entry, or (shared) its shared form's descriptor
  bool shared = false;  // release() once copied (or refused)
  double seconds = 0;   // sent to received
  double worker_seconds = 0;
};

struct PoolStats {
  uint64_t requests = 0, replies = 0, bytes = 0;
  uint64_t errors = 0, timeouts = 0, lost = 0, bad_entries = 0;  // builds that failed, by cause
  uint64_t recoveries = 0;                                       // unhealthy workers back in
  uint64_t shared_failures = 0;  // shared entries that could not be mapped here (that worker then sends bytes)
  double transfer_seconds = 0;   // sum over replies of (round trip - the worker's own time)
};

class WorkerPool {
 public:
  // wake: called (on the transport's thread) whenever a build finishes or fails.
  WorkerPool(std::vector<WorkerAddress> workers, uint64_t fingerprint, PoolOptions opt, std::function<void()> wake);
  ~WorkerPool();
  size_t size() const { return workers_.size(); }

  // Where each segment goes: -1 for the local engine, else a worker index. tokens[i] is segment
  // i's length and keys[i] its cache key; local_rate the local build rate (tokens/s, <= 0:
  // unknown) and local_busy the local engine's queued seconds.
  std::vector<int> assign(const std::vector<const SegmentKey*>& keys, double local_rate, double local_busy);
  // Sends one build request. A worker that is down fails it at once (done, !ok).
  std::shared_ptr<RemoteBuild> request(int worker, const SegmentKey& key);
  // Fails overdue builds (their workers are marked unhealthy) and pings workers due a probe. Call
  // regularly (the engine loop does, each iteration).
  void check();
  // The caller rejected what a worker sent (decoding or shape checks): counted, worker unhealthy.
  void bad_entry(const RemoteBuild& b, const std::string& why);
  // A build the caller gave up on (its request went away): forgotten, its reply ignored.
  void abandon(const RemoteBuild& b);
  // The caller is done with a shared entry (copied or refused): the worker may free its buffer.
  void release(const RemoteBuild& b);
  // A shared entry could not be mapped here (another host after all, no IPC between the two
  // processes): that worker sends bytes from now on. Not a fault of the worker.
  void shared_failed(const RemoteBuild& b, const std::string& why);

  PoolStats stats() const;
  int healthy() const;                  // workers taking builds now
  nlohmann::json workers_json() const;  // per worker: address, healthy, rate, in flight

 private:
  struct Worker {
    WorkerAddress addr;
    PeerId peer = 0;
    bool healthy = true;
    std::string why;  // the last fault
    Clock::time_point probe_at{};
    double rate = 0;  // tokens/s, measured (0: none yet)
    // The worker's last reply: builds run one after another there, so a build's service time
    // starts at the later of its sending and this.
    Clock::time_point last_reply{};
    double busy = 0;  // estimated seconds of builds in flight
    int in_flight = 0;
    bool shared_ok = true;  // ask for shared entries (while opt_.host is set)
  };
  void on_message(Message&& m);
  void on_down(PeerId peer, const std::string& why);
  // mu_ held. Fails b with `error`, marks its worker unhealthy when `fault`.
  void fail(const std::shared_ptr<RemoteBuild>& b, const std::string& error, uint64_t PoolStats::*counter);
  void mark_down(Worker& w, const std::string& why);  // mu_ held
  void finish(RemoteBuild& b);                        // mu_ held: releases the worker's share
  void connect(size_t i);                             // mu_ held

  std::vector<Worker> workers_;
  uint64_t fingerprint_;
  PoolOptions opt_;
  std::function<void()> wake_;
  mutable std::mutex mu_;
  uint64_t next_request_ = 1;
  std::unordered_map<uint64_t, std::shared_ptr<RemoteBuild>> pending_;  // by request id
  std::unordered_map<uint64_t, int> holds_;                             // key hash -> worker that built it
  PoolStats st_;
  std::unique_ptr<UcxNode> node_;  // last: its thread stops before the rest goes
};

}  // namespace hypic::cluster
