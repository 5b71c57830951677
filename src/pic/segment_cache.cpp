#include "pic/segment_cache.h"

#include <xxhash.h>

#include <stdexcept>

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
  for (auto& l : layers)
    for (const Tensor* t : {&l.T, &l.S, &l.conv_tail, &l.body.k, &l.body.v, &l.body.g, &l.body.beta, &l.k, &l.v})
      if (t->defined()) bytes += t->nbytes();
}

SegmentCache::SegmentCache(size_t budget_bytes) : budget_(budget_bytes) {
  st_.budget = budget_bytes;
}

std::shared_ptr<const SegmentEntry> SegmentCache::find(const SegmentKey& key) {
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
  return nullptr;
}

void SegmentCache::evict_for(size_t need) {
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
}

std::shared_ptr<const SegmentEntry> SegmentCache::insert(std::shared_ptr<SegmentEntry> e) {
  auto r = insert_memory(e);
  if (store_) store_->save(*r);  // outside mu_: disk I/O must not block other lookups
  return r;
}

std::shared_ptr<const SegmentEntry> SegmentCache::find_or_load(
    const SegmentKey& key, const std::function<std::string(const SegmentEntry&)>& check) {
  if (auto hit = find(key)) return hit;
  if (!store_) return nullptr;
  auto e = store_->load(key, check);
  if (!e) return nullptr;
  return insert_memory(std::move(e));
}

std::shared_ptr<const SegmentEntry> SegmentCache::insert_memory(std::shared_ptr<SegmentEntry> e) {
  if (e->bytes == 0) e->account();
  std::lock_guard<std::mutex> g(mu_);
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
  evict_for(e->bytes);
  lru_.push_front(h);
  index_.emplace(h, Node{e, lru_.begin()});
  st_.bytes += e->bytes;
  ++st_.entries;
  ++st_.inserts;
  return e;
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
  std::lock_guard<std::mutex> g(mu_);
  index_.clear();
  lru_.clear();
  st_.bytes = 0;
  st_.entries = 0;
}

SegmentCacheStats SegmentCache::stats() const {
  SegmentCacheStats s;
  {
    std::lock_guard<std::mutex> g(mu_);
    s = st_;
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
