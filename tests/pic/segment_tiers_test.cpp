// The host tier of the segment cache (SegmentCache::attach_host_tier): demotion on eviction,
// promotion on a hit (its copies queued with per-layer fences, batched by PromotionBatch), the
// host budget's LRU, statistics, and a PIC request answered bitwise the same from either tier.
// Runs on the CPU backend (its copies are synchronous; the GPU's asynchronous path is covered by
// tests/backend/cuda_model_test.cpp).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "engine/loader.h"
#include "engine/sampler.h"
#include "pic/composer.h"
#include "pic/segment_cache.h"

namespace fs = std::filesystem;
using namespace hypic;

namespace {

// An entry of `layers` layers, each with a T and S of n x n floats filled from `seed`: 8 n^2 bytes
// per layer plus the key's ids.
std::shared_ptr<SegmentEntry> make_entry(Backend& be, int32_t id, int layers, int64_t n, float seed) {
  auto e = std::make_shared<SegmentEntry>();
  e->key.model_fingerprint = 7;
  e->key.ids = {id, id + 1};
  e->layers.resize(static_cast<size_t>(layers));
  for (int l = 0; l < layers; ++l) {
    for (Tensor* t : {&e->layers[l].T, &e->layers[l].S}) {
      Tensor h = Tensor::empty(DType::F32, {n, n});
      for (int64_t i = 0; i < h.numel(); ++i) h.data<float>()[i] = seed + float(l) * 100 + float(i);
      *t = be.to_device(h);
    }
  }
  e->account();
  return e;
}

SegmentKey key_of(int32_t id) {
  SegmentKey k;
  k.model_fingerprint = 7;
  k.ids = {id, id + 1};
  return k;
}

bool same_tensors(Backend& be, const SegmentEntry& a, const SegmentEntry& b) {
  if (a.layers.size() != b.layers.size()) return false;
  for (size_t l = 0; l < a.layers.size(); ++l) {
    auto x = a.layers[l].tensors();
    auto y = b.layers[l].tensors();
    for (size_t i = 0; i < x.size(); ++i) {
      if (x[i]->defined() != y[i]->defined()) return false;
      if (!x[i]->defined()) continue;
      Tensor hx = be.to_host(*x[i]), hy = be.to_host(*y[i]);
      if (hx.shape() != hy.shape() || std::memcmp(hx.raw(), hy.raw(), hx.nbytes()) != 0) return false;
    }
  }
  return true;
}

class Tiers : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be_ = make_backend("cpu", 1);
};

TEST_F(Tiers, EvictedEntriesMoveToTheHostTierAndComeBack) {
  const int64_t n = 16;
  auto probe = make_entry(*be_, 0, 2, n, 0);
  const size_t one = probe->bytes;
  SegmentCache c(2 * one + one / 2);  // two entries fit in memory
  c.attach_host_tier(*be_, 10 * one);
  std::vector<std::shared_ptr<SegmentEntry>> kept;  // equal values, other objects (no pins)
  for (int32_t id = 0; id < 3; ++id) {
    kept.push_back(make_entry(*be_, id * 10, 2, n, float(id)));
    c.insert(make_entry(*be_, id * 10, 2, n, float(id)));
  }
  SegmentCacheStats s = c.stats();
  EXPECT_EQ(s.entries, 2u);
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(s.host_demotions, 1u);
  EXPECT_EQ(s.host_entries, 1u);
  EXPECT_EQ(s.host_bytes, one);
  EXPECT_EQ(s.host_budget, 10 * one);

  // Entry 0 was least recently used: it is in the host tier now, and comes back whole.
  auto back = c.find(key_of(0));
  ASSERT_NE(back, nullptr);
  EXPECT_TRUE(same_tensors(*be_, *back, *kept[0]));
  EXPECT_EQ(back->bytes, one);
  ASSERT_EQ(back->ready.size(), 2u);
  for (size_t l = 0; l < 2; ++l) back->wait_layer(*be_, l);  // the CPU's copies are done: null fences
  s = c.stats();
  EXPECT_EQ(s.host_hits, 1u);
  EXPECT_EQ(s.entries, 2u) << "promoted into memory, evicting the next least recently used";
  EXPECT_EQ(s.host_entries, 2u) << "the host tier keeps its copy of 0 and receives 10";
  EXPECT_EQ(s.host_demotions, 2u);
  // The next lookup is a memory hit.
  const uint64_t host_hits = s.host_hits;
  EXPECT_EQ(c.find(key_of(0)).get(), back.get());
  EXPECT_EQ(c.stats().host_hits, host_hits);
  // Entry 10 went down, and comes back as well.
  auto ten = c.find(key_of(10));
  ASSERT_NE(ten, nullptr);
  EXPECT_TRUE(same_tensors(*be_, *ten, *kept[1]));
  EXPECT_EQ(c.find(key_of(99)), nullptr);
}

TEST_F(Tiers, HostTierKeepsItsBudgetLeastRecentlyUsedFirst) {
  const int64_t n = 8;
  const size_t one = make_entry(*be_, 0, 1, n, 0)->bytes;
  SegmentCache c(one);  // one entry in memory
  c.attach_host_tier(*be_, 2 * one);
  for (int32_t id = 0; id < 5; ++id) c.insert(make_entry(*be_, id * 10, 1, n, float(id)));
  // Memory holds 40; the host tier the two before it (30, 20); 0 and 10 were dropped.
  SegmentCacheStats s = c.stats();
  EXPECT_EQ(s.host_demotions, 4u);
  EXPECT_EQ(s.host_evictions, 2u);
  EXPECT_EQ(s.host_entries, 2u);
  EXPECT_LE(s.host_bytes, 2 * one);
  EXPECT_EQ(c.find(key_of(0)), nullptr);
  EXPECT_EQ(c.find(key_of(10)), nullptr);
  // 30 comes back into memory; 40 goes down in its place and the host tier drops its least
  // recently used entry, 20 (it keeps its copy of 30, just used).
  EXPECT_NE(c.find(key_of(30)), nullptr);
  EXPECT_EQ(c.stats().host_evictions, 3u);
  EXPECT_EQ(c.find(key_of(20)), nullptr);
  EXPECT_NE(c.find(key_of(40)), nullptr);
  // An entry larger than the whole host budget is not kept there.
  SegmentCache d(one);
  d.attach_host_tier(*be_, one / 2);
  d.insert(make_entry(*be_, 0, 1, n, 0));
  d.insert(make_entry(*be_, 10, 1, n, 1));
  EXPECT_EQ(d.stats().host_entries, 0u);
  EXPECT_EQ(d.find(key_of(0)), nullptr);
}

TEST_F(Tiers, DemoteAllSkipsPinnedEntriesAndBatchesPromotions) {
  const int64_t n = 8;
  SegmentCache c(size_t(1) << 20);
  c.attach_host_tier(*be_, size_t(1) << 20);
  std::vector<std::shared_ptr<SegmentEntry>> src;
  for (int32_t id = 0; id < 4; ++id) {
    src.push_back(make_entry(*be_, id * 10, 3, n, float(id)));
    c.insert(src.back());
  }
  src.clear();  // the cache holds the only references now
  auto pinned = c.find(key_of(30));
  EXPECT_EQ(c.demote_all(), 3u);
  EXPECT_EQ(c.stats().entries, 1u);
  EXPECT_EQ(c.stats().host_entries, 3u);
  {
    SegmentCache::PromotionBatch batch(c);
    auto a = c.find(key_of(0)), b = c.find(key_of(10));
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    // Not in memory until the batch ends (its copies are queued then).
    EXPECT_EQ(c.stats().entries, 1u);
  }
  EXPECT_EQ(c.stats().entries, 3u);
  EXPECT_EQ(c.stats().host_hits, 2u);
  // Promoted entries carry the values they were demoted with.
  auto a = c.find(key_of(10));
  ASSERT_NE(a, nullptr);
  Tensor t = be_->to_host(a->layers[2].S);
  EXPECT_EQ(t.data<float>()[5], 1.0f + 200 + 5);
  c.clear();
  EXPECT_EQ(c.stats().host_entries, 0u);
  EXPECT_EQ(c.stats().host_bytes, 0u);
  EXPECT_EQ(c.find(key_of(20)), nullptr);
}

// A PIC request whose entries come back from the host tier answers bitwise as from memory.
TEST(TiersPic, RequestsFromTheHostTierAnswerAsFromMemory) {
  auto lm = load_model((fs::path(HYPIC_TEST_DATA) / "models" / "qwen3_5_moe").string(), "cpu", 2);
  std::mt19937 rng(5);
  const int64_t V = lm.model->config().vocab_size;
  auto seg = [&](int n) {
    std::vector<int32_t> s(static_cast<size_t>(n));
    for (auto& t : s) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(V));
    return s;
  };
  const std::vector<std::vector<int32_t>> req = {seg(16), seg(40), seg(12), seg(55), seg(7)};
  PicOptions o;
  o.mode = PicMode::Pic;
  o.seam = 4;
  PicEngine mem(*lm.model, size_t(64) << 20), host(*lm.model, size_t(64) << 20);
  host.attach_host_tier(size_t(64) << 20);
  mem.prefill(req, o);
  host.prefill(req, o);
  EXPECT_EQ(host.cache().demote_all(), 4u);
  // Another system prefix: no exact-prefix snapshot applies, every document body is composed.
  auto req2 = req;
  req2[0] = seg(16);
  PrefillResult a = mem.prefill(req2, o), b = host.prefill(req2, o);
  EXPECT_EQ(b.report.hit_segments, 3);
  EXPECT_EQ(b.report.miss_segments, 1);
  EXPECT_EQ(host.cache().stats().host_hits, 3u);
  Tensor x = lm.backend->to_host(a.logits), y = lm.backend->to_host(b.logits);
  ASSERT_EQ(x.nbytes(), y.nbytes());
  EXPECT_EQ(std::memcmp(x.raw(), y.raw(), x.nbytes()), 0);
}

// A request's entries that are on disk are read together (several threads) and come back in the
// request's order beside memory hits and misses; the answer is bitwise the writer's.
TEST(TiersPic, DiskEntriesOfARequestAreReadTogether) {
  auto lm = load_model((fs::path(HYPIC_TEST_DATA) / "models" / "qwen3_5_dense").string(), "cpu", 2);
  std::mt19937 rng(9);
  const int64_t V = lm.model->config().vocab_size;
  auto seg = [&](int n) {
    std::vector<int32_t> s(static_cast<size_t>(n));
    for (auto& t : s) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(V));
    return s;
  };
  std::vector<std::vector<int32_t>> req = {seg(16)};
  for (int d = 0; d < 6; ++d) req.push_back(seg(20 + 5 * d));
  req.push_back(seg(6));
  PicOptions o;
  o.mode = PicMode::Pic;
  o.seam = 4;
  std::string tmpl = (fs::temp_directory_path() / "hypic_tiers_XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  const std::string dir = tmpl;
  {
    PicEngine writer(*lm.model, size_t(64) << 20);
    writer.attach_cache_dir(dir);
    writer.prefill(req, o);
    EXPECT_EQ(writer.cache().stats().disk_writes, 7u);
  }
  PicEngine writer(*lm.model, size_t(64) << 20), reader(*lm.model, size_t(64) << 20);
  writer.attach_cache_dir(dir);
  reader.attach_cache_dir(dir);
  // The reader has documents 0 and 1 in memory already (read from disk by a first request).
  reader.prefill({seg(16), req[1], req[2], seg(5)}, o);
  EXPECT_EQ(reader.cache().stats().disk_hits, 2u);
  auto req2 = req;
  req2[0] = seg(16);  // a new prefix (a miss), then the six documents, then a new document
  req2.insert(req2.end() - 1, seg(30));
  PrefillResult b = reader.prefill(req2, o);  // first: the writer would put the two new entries on disk
  PrefillResult a = writer.prefill(req2, o);
  EXPECT_EQ(b.report.hit_segments, 6);
  EXPECT_EQ(b.report.miss_segments, 2);
  EXPECT_EQ(reader.cache().stats().disk_hits, 6u) << "documents 2-5 from disk, 0-1 from memory";
  Tensor x = lm.backend->to_host(a.logits), y = lm.backend->to_host(b.logits);
  ASSERT_EQ(x.nbytes(), y.nbytes());
  EXPECT_EQ(std::memcmp(x.raw(), y.raw(), x.nbytes()), 0);
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
