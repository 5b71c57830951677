#include "pic/segment_cache.h"

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include "pic/segment_store.h"

namespace hypic {

uint64_t SegmentKey::hash() const {
  XXH64_state_t* s = XXH64_createState();
  XXH64_reset(s, model_fingerprint);
  XXH64_update(s, &seam, sizeof(seam));
  XXH64_update(s, &tail, sizeof(tail));
  XXH64_update(s, ids.data(), ids.size() * sizeof(int32_t));
  uint64_t h = XXH64_digest(s);
  XXH64_freeState(s);
  return h;
}

void SegmentEntry::account() {
  bytes = key.ids.size() * sizeof(int32_t);
  for (const auto& l : layers)
    for (const Tensor* t : l.tensors())
      if (t->defined()) bytes += t->nbytes();
}

SegmentCache::SegmentCache(size_t budget_bytes) : budget_(budget_bytes) {
  st_.budget = budget_bytes;
}

std::shared_ptr<const SegmentEntry> SegmentCache::find(const SegmentKey& key) {
  {
    std::lock_guard<std::mutex> g(mu_);
    const uint64_t h = key.hash();
    auto [a, b] = index_.equal_range(h);
    for (auto it = a; it != b; ++it) {
      if (it->second.entry->key == key) {
        lru_.splice(lru_.begin(), lru_, it->second.lru);
        ++st_.hits;
        return it->second.entry;
      }
    }
    ++st_.misses;
  }
  if (!host_be_) return nullptr;
  std::shared_ptr<SegmentEntry> host = host_find(key);
  if (!host) return nullptr;
  return queue_promotion(std::move(host));
}

std::shared_ptr<const SegmentEntry> SegmentCache::queue_promotion(std::shared_ptr<SegmentEntry> host) {
  std::shared_ptr<SegmentEntry> dev = promote(*copy_be_, *host);
  Pending& p = pending();
  p.items.emplace_back(std::move(host), dev);
  if (p.depth == 0) {
    auto items = std::move(p.items);
    p.items.clear();
    issue(items);
  }
  return dev;
}

std::vector<std::shared_ptr<const SegmentEntry>> SegmentCache::find_or_load_many(
    const std::vector<SegmentKey>& keys, const std::function<std::string(const SegmentEntry&)>& check) {
  std::vector<std::shared_ptr<const SegmentEntry>> out(keys.size());
  std::vector<size_t> disk;  // indices that missed memory and the host tier
  for (size_t i = 0; i < keys.size(); ++i) {
    out[i] = find(keys[i]);
    if (!out[i] && store_) disk.push_back(i);
  }
  if (disk.empty()) return out;
  // Reading and checksumming a file runs at a core's memory bandwidth: several at once.
  std::vector<std::shared_ptr<SegmentEntry>> loaded(disk.size());
  const size_t n_threads = std::min<size_t>({disk.size(), std::max(1u, std::thread::hardware_concurrency()), 8});
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t j = next++; j < disk.size(); j = next++) loaded[j] = store_->load_host(keys[disk[j]], check);
  };
  std::vector<std::thread> th;
  for (size_t t = 1; t < n_threads; ++t) th.emplace_back(work);
  work();
  for (auto& t : th) t.join();
  const bool on_host = store_->backend().device().kind == DeviceKind::CPU;
  for (size_t j = 0; j < disk.size(); ++j) {
    if (!loaded[j]) continue;
    // The CPU uses host tensors as they are; a GPU gets them through the promotion copies.
    out[disk[j]] = on_host ? insert_memory(std::move(loaded[j])) : queue_promotion(std::move(loaded[j]));
  }
  return out;
}

SegmentCache::Pending& SegmentCache::pending() {
  thread_local std::unordered_map<const SegmentCache*, Pending> by_cache;
  return by_cache[this];
}

SegmentCache::PromotionBatch::PromotionBatch(SegmentCache& c) : c_(c) {
  ++c_.pending().depth;
}

void SegmentCache::PromotionBatch::end() {
  if (ended_) return;
  ended_ = true;
  Pending& p = c_.pending();
  if (--p.depth > 0 || p.items.empty()) return;
  auto items = std::move(p.items);
  p.items.clear();
  c_.issue(items);
}

SegmentCache::PromotionBatch::~PromotionBatch() {
  try {
    end();
  } catch (const std::exception& e) {
    // Only when the batch's owner left by an exception (and drops the entries): nothing cached is
    // wrong, since the entries enter the cache only once their copies are queued.
    std::fprintf(stderr, "hypic: segment cache: queueing copies back to the device failed: %s\n", e.what());
  }
}

void SegmentCache::attach_host_tier(Backend& be, size_t budget_bytes) {
  host_be_ = &be;
  copy_be_ = &be;
  host_budget_ = budget_bytes;
  std::lock_guard<std::mutex> g(host_mu_);
  host_st_.host_budget = budget_bytes;
}

std::shared_ptr<SegmentEntry> SegmentCache::host_find(const SegmentKey& key) {
  std::lock_guard<std::mutex> g(host_mu_);
  auto [a, b] = host_index_.equal_range(key.hash());
  for (auto it = a; it != b; ++it) {
    if (it->second.entry->key == key) {
      host_lru_.splice(host_lru_.begin(), host_lru_, it->second.lru);
      ++host_st_.host_hits;
      return it->second.entry;
    }
  }
  return nullptr;
}

std::shared_ptr<SegmentEntry> SegmentCache::promote(Backend& be, const SegmentEntry& host) {
  auto e = std::make_shared<SegmentEntry>();
  e->key = host.key;
  e->layers.resize(host.layers.size());
  for (size_t l = 0; l < host.layers.size(); ++l) {
    auto src = host.layers[l].tensors();
    auto dst = e->layers[l].tensors();
    for (size_t i = 0; i < src.size(); ++i)
      if (src[i]->defined()) *dst[i] = be.alloc_uninit(src[i]->dtype(), src[i]->shape());
  }
  e->bytes = host.bytes;
  e->ready.resize(host.layers.size());
  return e;
}

void SegmentCache::issue(std::vector<std::pair<std::shared_ptr<SegmentEntry>, std::shared_ptr<SegmentEntry>>>& batch) {
  if (batch.empty()) return;
  size_t layers = 0;
  for (auto& [h, d] : batch) layers = std::max(layers, h->layers.size());
  // Layer by layer across the entries: composition walks the layers in order.
  std::vector<Tensor> src, dst;
  for (size_t l = 0; l < layers; ++l) {
    src.clear();
    dst.clear();
    for (auto& [h, d] : batch) {
      if (l >= h->layers.size()) continue;
      auto s = h->layers[l].tensors();
      auto t = d->layers[l].tensors();
      for (size_t i = 0; i < s.size(); ++i)
        if (s[i]->defined()) src.push_back(*s[i]), dst.push_back(*t[i]);
    }
    std::shared_ptr<Backend::Fence> f = copy_be_->copy_async(src, dst);
    for (auto& [h, d] : batch)
      if (l < d->ready.size()) d->ready[l] = f;
  }
  for (auto& [h, d] : batch) {
    try {
      insert_memory(d);
    } catch (const std::length_error&) {
      // Memory is full of entries in use: the request still uses this copy, which is not kept.
    }
  }
}

void SegmentCache::demote(const std::shared_ptr<SegmentEntry>& e) {
  if (!host_be_ || !e) return;
  const uint64_t h = e->key.hash();
  {
    std::lock_guard<std::mutex> g(host_mu_);
    auto [a, b] = host_index_.equal_range(h);
    for (auto it = a; it != b; ++it)
      if (it->second.entry->key == e->key) {  // still there since its promotion: nothing to copy
        host_lru_.splice(host_lru_.begin(), host_lru_, it->second.lru);
        return;
      }
    if (e->bytes > host_budget_) return;
  }
  // One host allocation per entry, carved into its tensors (256-byte aligned).
  auto align = [](size_t n) { return (n + 255) & ~size_t(255); };
  size_t total = 0;
  for (const auto& l : e->layers)
    for (const Tensor* t : l.tensors())
      if (t->defined()) total += align(t->nbytes());
  Tensor block = host_be_->alloc_host(total);
  auto he = std::make_shared<SegmentEntry>();
  he->key = e->key;
  he->layers.resize(e->layers.size());
  size_t off = 0;
  for (size_t l = 0; l < e->layers.size(); ++l) {
    e->wait_layer(*host_be_, l);  // a promotion's copies still under way
    auto src = e->layers[l].tensors();
    auto dst = he->layers[l].tensors();
    for (size_t i = 0; i < src.size(); ++i) {
      if (!src[i]->defined()) continue;
      *dst[i] = block.view(off, src[i]->dtype(), src[i]->shape());
      host_be_->copy(*src[i], *dst[i]);
      off += align(src[i]->nbytes());
    }
  }
  he->bytes = e->bytes;
  std::lock_guard<std::mutex> g(host_mu_);
  // Least recently used first; host entries are never pinned (a promotion's copies keep their
  // sources alive through its fence).
  while (host_st_.host_bytes + he->bytes > host_budget_ && !host_lru_.empty()) {
    const uint64_t victim = host_lru_.back();
    auto [a, b] = host_index_.equal_range(victim);
    for (auto n = a; n != b; ++n)
      if (n->second.lru == std::prev(host_lru_.end())) {
        host_st_.host_bytes -= n->second.entry->bytes;
        --host_st_.host_entries;
        ++host_st_.host_evictions;
        host_index_.erase(n);
        break;
      }
    host_lru_.pop_back();
  }
  host_lru_.push_front(h);
  host_index_.emplace(h, Node{he, host_lru_.begin()});
  host_st_.host_bytes += he->bytes;
  ++host_st_.host_entries;
  ++host_st_.host_demotions;
}

size_t SegmentCache::demote_all() {
  std::vector<std::shared_ptr<SegmentEntry>> out;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = lru_.begin(); it != lru_.end();) {
      const uint64_t h = *it;
      bool erased = false;
      auto [a, b] = index_.equal_range(h);
      for (auto n = a; n != b; ++n) {
        if (n->second.lru != it || n->second.entry.use_count() > 1) continue;
        st_.bytes -= n->second.entry->bytes;
        --st_.entries;
        ++st_.evictions;
        out.push_back(n->second.entry);
        index_.erase(n);
        it = lru_.erase(it);
        erased = true;
        break;
      }
      if (!erased) ++it;
    }
  }
  const size_t n = out.size();
  demote(out);
  return n;
}

void SegmentCache::evict_for(size_t need, std::vector<std::shared_ptr<SegmentEntry>>& out) {
  // Walk from the least recently used end; skip pinned entries (use_count > 1: held by a request).
  auto it = lru_.end();
  while (st_.bytes + need > budget_ && it != lru_.begin()) {
    --it;
    const uint64_t h = *it;
    auto [a, b] = index_.equal_range(h);
    bool erased = false;
    for (auto n = a; n != b; ++n) {
      if (n->second.lru != it) continue;
      if (n->second.entry.use_count() > 1) break;  // pinned
      if (host_be_) out.push_back(n->second.entry);
      st_.bytes -= n->second.entry->bytes;
      --st_.entries;
      ++st_.evictions;
      index_.erase(n);
      it = lru_.erase(it);
      erased = true;
      break;
    }
    (void)erased;
  }
  if (st_.bytes + need > budget_)
    throw std::length_error("segment cache full: " + std::to_string(need) + " bytes needed, " +
                            std::to_string(budget_ - std::min(budget_, st_.bytes)) + " free of " +
                            std::to_string(budget_) + " and every other entry is in use");
}

void SegmentCache::attach_store(std::shared_ptr<SegmentStore> store) {
  store_ = std::move(store);
  if (store_ && !copy_be_) copy_be_ = &store_->backend();
}

std::shared_ptr<const SegmentEntry> SegmentCache::insert(std::shared_ptr<SegmentEntry> e) {
  auto r = insert_memory(e);
  if (store_) store_->save(*r);  // outside mu_: disk I/O must not block other lookups
  return r;
}

std::shared_ptr<const SegmentEntry> SegmentCache::find_or_load(
    const SegmentKey& key, const std::function<std::string(const SegmentEntry&)>& check) {
  return find_or_load_many({key}, check)[0];
}

std::shared_ptr<const SegmentEntry> SegmentCache::insert_memory(std::shared_ptr<SegmentEntry> e) {
  if (e->bytes == 0) e->account();
  std::vector<std::shared_ptr<SegmentEntry>> evicted;
  try {
    std::lock_guard<std::mutex> g(mu_);
    insert_locked(e, evicted);
  } catch (...) {
    demote(evicted);
    throw;
  }
  demote(evicted);  // outside mu_: the copies to host memory must not block other lookups
  return e;
}

void SegmentCache::insert_locked(const std::shared_ptr<SegmentEntry>& e,
                                 std::vector<std::shared_ptr<SegmentEntry>>& evicted) {
  if (e->bytes > budget_)
    throw std::length_error("segment of " + std::to_string(e->key.ids.size()) + " tokens needs " +
                            std::to_string(e->bytes) + " bytes, more than the whole segment cache budget of " +
                            std::to_string(budget_) + " bytes");
  const uint64_t h = e->key.hash();
  auto [a, b] = index_.equal_range(h);
  for (auto it = a; it != b; ++it) {
    if (it->second.entry->key == e->key) {
      st_.bytes -= it->second.entry->bytes;
      --st_.entries;
      lru_.erase(it->second.lru);
      index_.erase(it);
      break;
    }
  }
  evict_for(e->bytes, evicted);
  lru_.push_front(h);
  index_.emplace(h, Node{e, lru_.begin()});
  st_.bytes += e->bytes;
  ++st_.entries;
  ++st_.inserts;
}

bool SegmentCache::erase(const SegmentKey& key) {
  std::lock_guard<std::mutex> g(mu_);
  auto [a, b] = index_.equal_range(key.hash());
  for (auto it = a; it != b; ++it) {
    if (it->second.entry->key == key) {
      st_.bytes -= it->second.entry->bytes;
      --st_.entries;
      lru_.erase(it->second.lru);
      index_.erase(it);
      return true;
    }
  }
  return false;
}

void SegmentCache::clear() {
  {
    std::lock_guard<std::mutex> g(mu_);
    index_.clear();
    lru_.clear();
    st_.bytes = 0;
    st_.entries = 0;
  }
  std::lock_guard<std::mutex> g(host_mu_);
  host_index_.clear();
  host_lru_.clear();
  host_st_.host_bytes = 0;
  host_st_.host_entries = 0;
}

SegmentCacheStats SegmentCache::stats() const {
  SegmentCacheStats s;
  {
    std::lock_guard<std::mutex> g(mu_);
    s = st_;
  }
  {
    std::lock_guard<std::mutex> g(host_mu_);
    s.host_hits = host_st_.host_hits;
    s.host_demotions = host_st_.host_demotions;
    s.host_evictions = host_st_.host_evictions;
    s.host_bytes = host_st_.host_bytes;
    s.host_entries = host_st_.host_entries;
    s.host_budget = host_st_.host_budget;
  }
  if (store_) {
    const SegmentStoreStats d = store_->stats();
    s.disk_hits = d.disk_hits;
    s.disk_writes = d.disk_writes;
    s.disk_write_errors = d.write_errors;
    s.corrupt_files = d.corrupt_files;
    s.disk_bytes = d.disk_bytes;
    s.disk_entries = d.disk_entries;
  }
  return s;
}

}  // namespace hypic
