// The worker's side of segment parallelism: accepts build requests from combine nodes (over
// UcxNode) and answers each with the entry, found in the worker's cache or built in isolation by
// its engine (the `build` function: the server's scheduler, so that remote builds interleave with
// the worker's own requests like any other work).
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "cluster/protocol.h"
#include "cluster/ucx_transport.h"
#include "pic/segment_cache.h"

namespace hypic::cluster {

class SegmentService {
 public:
  using Reply = std::function<void(BuildOutcome)>;
  // Must call reply exactly once, on any thread.
  // shared: the combine node shares this host and can map device memory (BuildHeader::host).
  using BuildFn = std::function<void(SegmentKey key, bool shared, Reply reply)>;
  SegmentService(uint64_t fingerprint, BuildFn build);
  ~SegmentService();
  int listen(const std::string& host, int port);  // the bound port

  struct Stats {
    std::atomic<uint64_t> requests{0}, built{0}, cached{0}, refused{0}, failed{0}, bytes_sent{0}, shared{0};
  };
  const Stats& stats() const { return st_; }

 private:
  void on_message(Message&& m);
  void on_down(PeerId peer);
  uint64_t fingerprint_;
  uint64_t host_ = host_identity();
  // Shared entries' buffers until their combine node releases them (kRelease), goes away, or
  // kSharedHoldSeconds pass; by (peer, request).
  struct Held {
    std::shared_ptr<void> keep;
    std::chrono::steady_clock::time_point until;
  };
  std::mutex held_mu_;
  std::map<std::pair<PeerId, uint64_t>, Held> held_;
  BuildFn build_;
  Stats st_;
  struct Life {
    std::mutex mu;
    bool alive = true;
  };
  std::shared_ptr<Life> life_;     // replies that come after destruction are dropped
  std::unique_ptr<UcxNode> node_;  // last: its thread stops first
};

}  // namespace hypic::cluster
