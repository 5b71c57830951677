// Content-addressed cache of segment summaries. An entry is everything a later request needs to
// reuse a segment at any position: per linear layer the transition operator T and zero-start
// state S of the segment body (or, for a short body, its recurrence inputs) plus the conv tail; per full-attention
// layer K (at segment-relative positions) and V. Keys are (model fingerprint, seam width, exact token ids): a hash
// finds candidates, a full comparison confirms a hit.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "tensor/tensor.h"

namespace hypic {

struct SegmentKey {
  uint64_t model_fingerprint = 0;
  int32_t seam = 0;  // tokens at the head of the segment that are recomputed on reuse
  int32_t tail = 0;  // tokens at its end recomputed on reuse (both-ends seams)
  std::vector<int32_t> ids;
  uint64_t hash() const;
  bool operator==(const SegmentKey& o) const {
    return model_fingerprint == o.model_fingerprint && seam == o.seam && tail == o.tail && ids == o.ids;
  }
};

struct LayerSummary {
  // Linear layers: T [Hv, dk, dk], S [Hv, dk, dv] of the body (tokens seam..L-tail-1) and the conv
  // state at the end of the body [K-1, C] (the last K-1 pre-conv inputs before the tail). A short
  // body is kept in compact form instead of T and S: its recurrence inputs (`body`), run again
  // from the running state on reuse, so that the entry grows with the body's tokens.
  Tensor T, S, conv_tail;
  RecurrenceInputs body;
  // Full layers: K, V [L, Hkv, D] at positions 0..L-1.
  Tensor k, v;
  // Every tensor field, defined or not (one list for byte counts, copies and rounding); the entry
  // format stores them by the names in kStateTensorNames (entry_codec.h), in this order.
  std::array<Tensor*, 9> tensors() { return {&T, &S, &conv_tail, &body.k, &body.v, &body.g, &body.beta, &k, &v}; }
  std::array<const Tensor*, 9> tensors() const {
    return {&T, &S, &conv_tail, &body.k, &body.v, &body.g, &body.beta, &k, &v};
  }
};

struct SegmentEntry {
  SegmentKey key;
  std::vector<LayerSummary> layers;
  size_t bytes = 0;
  // An entry promoted from the host tier: per layer, the copies of its tensors still under way
  // (null once nothing is pending). Declared after `layers` so that it goes first: a fence waits
  // for its copies before the tensors they write are freed.
  std::vector<std::shared_ptr<Backend::Fence>> ready;
  size_t length() const { return key.ids.size(); }
  void account();  // recomputes bytes from the tensors
  // Orders be's later work after layer l's copies (no host wait); a no-op for other entries.
  void wait_layer(Backend& be, size_t l) const {
    if (l < ready.size() && ready[l]) be.wait(*ready[l]);
  }
};

struct SegmentCacheStats {
  uint64_t hits = 0, misses = 0, evictions = 0, inserts = 0;  // memory tier (a disk hit is a memory miss)
  size_t bytes = 0, entries = 0, budget = 0;
  // Host tier (all zero without one): hits promoted back, entries demoted into it, dropped from it.
  uint64_t host_hits = 0, host_demotions = 0, host_evictions = 0;
  size_t host_bytes = 0, host_entries = 0, host_budget = 0;
  // Disk tier (all zero without an attached SegmentStore); see SegmentStoreStats.
  uint64_t disk_hits = 0, disk_writes = 0, disk_write_errors = 0, corrupt_files = 0;
  size_t disk_bytes = 0, disk_entries = 0;
};

class SegmentStore;

// Thread-safe LRU under a byte budget. Entries handed out are shared_ptr "pins": an entry in use
// is never evicted (it stays alive even if dropped from the index), and eviction skips it.
// Tiers, fastest first: this memory (the backend's device: GPU memory on a GPU), an optional host
// tier (page-locked host memory under its own budget and LRU: entries evicted from memory are
// copied there, and a hit there is copied back asynchronously and moves up; it keeps its copy),
// and an optional disk tier (SegmentStore: written through, read on a miss of both).
class SegmentCache {
 public:
  explicit SegmentCache(size_t budget_bytes);
  // Memory, then the host tier.
  std::shared_ptr<const SegmentEntry> find(const SegmentKey& key);
  // Inserts (replacing an equal key); evicts least-recently-used unpinned entries to fit. Throws
  // std::length_error if the entry alone exceeds the budget, or if everything else is pinned.
  // With a store attached, the entry is also written through to disk (write errors are logged and
  // counted by the store, never thrown).
  std::shared_ptr<const SegmentEntry> insert(std::shared_ptr<SegmentEntry> e);
  // Optional disk tier. Attach before the cache is shared between threads.
  void attach_store(std::shared_ptr<SegmentStore> store);
  SegmentStore* store() const { return store_.get(); }
  // find(), then on a memory miss the disk tier: a valid file is loaded (checked by `check` as
  // well, see SegmentStore::load), put in memory without being written back, and returned.
  std::shared_ptr<const SegmentEntry> find_or_load(const SegmentKey& key,
                                                   const std::function<std::string(const SegmentEntry&)>& check = {});
  // find_or_load of several keys (a request's segments): memory and host hits first, then the
  // disk tier's files read on several threads at once into host memory, and on a GPU their copies
  // to the device queued together, layer by layer, like host hits (the PromotionBatch rule holds:
  // inside a batch, do not read the entries before it ends). Null where a key is found nowhere.
  std::vector<std::shared_ptr<const SegmentEntry>> find_or_load_many(
      const std::vector<SegmentKey>& keys, const std::function<std::string(const SegmentEntry&)>& check = {});
  // The host tier: `be`'s alloc_host memory, at most budget_bytes. Attach before the cache is
  // shared between threads; the backend must outlive the cache.
  void attach_host_tier(Backend& be, size_t budget_bytes);
  bool has_host_tier() const { return host_be_ != nullptr; }
  // Moves every entry in memory that no request holds to the host tier (or drops it without one);
  // returns how many moved. Benchmarks use it to time requests whose entries sit in host memory.
  size_t demote_all();
  // While a PromotionBatch lives on a thread, host hits found by that thread are copied back
  // together when it ends, layer by layer across the entries (every entry's first layers arrive
  // first, so that composition can start while the rest arrives), and enter memory then. The
  // entries returned meanwhile must not be read before the batch ends: call end(), which throws
  // if the copies could not be queued (the entries are then unusable); the destructor of a batch
  // left by an exception queues them on a best-effort basis and swallows errors.
  class PromotionBatch {
   public:
    explicit PromotionBatch(SegmentCache& c);
    ~PromotionBatch();
    void end();
    PromotionBatch(const PromotionBatch&) = delete;
    PromotionBatch& operator=(const PromotionBatch&) = delete;

   private:
    SegmentCache& c_;
    bool ended_ = false;
  };
  bool erase(const SegmentKey& key);
  // Empties memory and the host tier (the disk tier keeps its files).
  void clear();
  SegmentCacheStats stats() const;
  size_t budget() const { return budget_; }

 private:
  struct Node {
    std::shared_ptr<SegmentEntry> entry;
    std::list<uint64_t>::iterator lru;  // position in lru_ (front = most recent)
  };
  // mu_ held: evicts to fit `need` more bytes; entries that leave go to `out` (for the host tier).
  void evict_for(size_t need, std::vector<std::shared_ptr<SegmentEntry>>& out);
  std::shared_ptr<const SegmentEntry> insert_memory(std::shared_ptr<SegmentEntry> e);
  void insert_locked(const std::shared_ptr<SegmentEntry>& e, std::vector<std::shared_ptr<SegmentEntry>>& evicted);
  // Host tier (host_mu_; never held with mu_).
  void demote(const std::shared_ptr<SegmentEntry>& e);
  void demote(std::vector<std::shared_ptr<SegmentEntry>>& es) {
    for (auto& e : es) demote(e);
  }
  std::shared_ptr<SegmentEntry> host_find(const SegmentKey& key);
  // Device tensors for a host entry on `be`; its copies come with issue().
  static std::shared_ptr<SegmentEntry> promote(Backend& be, const SegmentEntry& host);
  // Queues a host entry's copy back to be_ (now, or when the thread's PromotionBatch ends).
  std::shared_ptr<const SegmentEntry> queue_promotion(std::shared_ptr<SegmentEntry> host);
  void issue(std::vector<std::pair<std::shared_ptr<SegmentEntry>, std::shared_ptr<SegmentEntry>>>& batch);
  Backend* host_be_ = nullptr;  // the host tier's backend (null: no host tier)
  Backend* copy_be_ = nullptr;  // where promotions go: the host tier's or the disk tier's backend
  size_t host_budget_ = 0;
  mutable std::mutex host_mu_;
  std::unordered_multimap<uint64_t, Node> host_index_;
  std::list<uint64_t> host_lru_;
  SegmentCacheStats host_st_;  // its host_* fields
  // Per thread: open PromotionBatch count and its (host entry, device entry) pairs.
  struct Pending {
    int depth = 0;
    std::vector<std::pair<std::shared_ptr<SegmentEntry>, std::shared_ptr<SegmentEntry>>> items;
  };
  Pending& pending();
  std::shared_ptr<SegmentStore> store_;
  size_t budget_;
  mutable std::mutex mu_;
  std::unordered_multimap<uint64_t, Node> index_;
  std::list<uint64_t> lru_;  // hashes; collisions resolved by the full key in index_
  SegmentCacheStats st_;
};

}  // namespace hypic
