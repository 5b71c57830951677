// The disk tier of the segment cache: round trips, restarts, damaged / foreign / misplaced files,
// unwritable directories and the disk budget, on the qwen3_5_dense conformance checkpoint.
#include "pic/segment_store.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <random>
#include <thread>

#include "backend/cpu/cpu_backend.h"
#include "engine/loader.h"
#include "engine/sampler.h"
#include "pic/composer.h"
#include "pic/entry_codec.h"

namespace fs = std::filesystem;
using namespace hypic;

namespace {

constexpr size_t kMem = 64 << 20;

std::vector<int32_t> rand_ids(size_t n, int64_t vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> d(0, vocab - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = static_cast<int32_t>(d(rng));
  return v;
}

std::vector<char> read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}
void write_all(const fs::path& p, const std::vector<char>& b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(b.data(), static_cast<std::streamsize>(b.size()));
}

// Collects spdlog output of the default logger for the lifetime of the object.
class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(256)) {
    spdlog::default_logger()->sinks().push_back(sink_);
  }
  ~LogCapture() {
    auto& s = spdlog::default_logger()->sinks();
    s.erase(std::remove(s.begin(), s.end(), sink_), s.end());
  }
  // A warning that mentions every one of the needles.
  bool has(std::initializer_list<std::string> needles) const {
    for (const auto& line : sink_->last_formatted()) {
      if (line.find("warn") == std::string::npos) continue;
      bool all = true;
      for (const auto& n : needles) all = all && line.find(n) != std::string::npos;
      if (all) return true;
    }
    return false;
  }
  std::string dump() const {
    std::string s;
    for (const auto& l : sink_->last_formatted()) s += l;
    return s;
  }

 private:
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> sink_;
};

bool same_tensor(Backend& be, const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  Tensor x = be.to_host(a), y = be.to_host(b);
  return std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

void expect_same_entry(Backend& be, const SegmentEntry& a, const SegmentEntry& b) {
  EXPECT_TRUE(a.key == b.key);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t l = 0; l < a.layers.size(); ++l) {
    const auto &x = a.layers[l], &y = b.layers[l];
    EXPECT_TRUE(same_tensor(be, x.T, y.T)) << "layer " << l << " T";
    EXPECT_TRUE(same_tensor(be, x.S, y.S)) << "layer " << l << " S";
    EXPECT_TRUE(same_tensor(be, x.conv_tail, y.conv_tail)) << "layer " << l << " conv_tail";
    EXPECT_TRUE(same_tensor(be, x.k, y.k)) << "layer " << l << " k";
    EXPECT_TRUE(same_tensor(be, x.v, y.v)) << "layer " << l << " v";
    EXPECT_TRUE(same_tensor(be, x.body.k, y.body.k)) << "layer " << l << " body k";
    EXPECT_TRUE(same_tensor(be, x.body.v, y.body.v)) << "layer " << l << " body v";
    EXPECT_TRUE(same_tensor(be, x.body.g, y.body.g)) << "layer " << l << " body g";
    EXPECT_TRUE(same_tensor(be, x.body.beta, y.body.beta)) << "layer " << l << " body beta";
  }
  EXPECT_EQ(a.bytes, b.bytes);
}

class Store : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    lm_ = new LoadedModel(load_model((fs::path(HYPIC_TEST_DATA) / "models" / "qwen3_5_dense").string(), "cpu", 2));
  }
  static void TearDownTestSuite() {
    delete lm_;
    lm_ = nullptr;
  }
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string("hypic_store_") + info->name() + "_" + std::to_string(::getpid()) + "_" +
                       std::to_string(std::random_device{}());
    std::replace(name.begin(), name.end(), '/', '_');  // parameterized names hold a '/'
    dir_ = fs::temp_directory_path() / name;
    fs::remove_all(dir_);
    std::mt19937_64 rng(99);
    const int64_t V = lm_->model->config().vocab_size;
    segs_ = {rand_ids(20, V, rng), rand_ids(50, V, rng), rand_ids(33, V, rng), rand_ids(61, V, rng),
             rand_ids(9, V, rng)};
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  Model& model() { return *lm_->model; }
  Backend& be() { return *lm_->backend; }
  std::vector<float> run(PicEngine& eng, CacheReport* rep = nullptr) {
    PrefillResult r = eng.prefill(segs_, {PicMode::Pic});
    if (rep) *rep = r.report;
    Tensor h = be().to_host(r.logits);
    return log_softmax(std::span<const float>(h.data<float>(), static_cast<size_t>(h.numel())));
  }
  // The answer without any disk tier.
  std::vector<float> reference() {
    PicEngine eng(model(), kMem);
    return run(eng);
  }
  // Key of request segment i as the composer builds it (seam 0 for the first, 8 after).
  SegmentKey key_of(size_t i) { return SegmentKey{model().fingerprint(), i == 0 ? 0 : 8, 0, segs_[i]}; }
  fs::path file_of(size_t i) {
    SegmentStore s(dir_.string(), be());
    return s.path_for(key_of(i));
  }
  size_t count_files(const std::string& ext) {
    size_t n = 0;
    if (fs::exists(dir_))
      for (auto& e : fs::directory_iterator(dir_)) n += e.path().extension() == ext ? 1 : 0;
    return n;
  }

  static LoadedModel* lm_;
  fs::path dir_;
  std::vector<std::vector<int32_t>> segs_;
};
LoadedModel* Store::lm_ = nullptr;

TEST_F(Store, RoundTripIsBitwiseIdentical) {
  PicEngine eng(model(), kMem);
  SegmentStore store(dir_.string(), be());
  for (int seam : {0, 8}) {
    auto e = eng.build_entry(segs_[1], seam);
    ASSERT_TRUE(store.save(*e));
    EXPECT_TRUE(fs::exists(store.path_for(e->key)));
    EXPECT_EQ(fs::file_size(store.path_for(e->key)), SegmentStore::file_size(*e));
    auto back = store.load(e->key);
    ASSERT_NE(back, nullptr);
    expect_same_entry(be(), *e, *back);
  }
  // Linear and full-attention layers both present, so both kinds of tensors went through.
  auto e = eng.build_entry(segs_[1], 8);
  bool lin = false, full = false;
  for (auto& l : e->layers) lin |= l.T.defined(), full |= l.k.defined();
  EXPECT_TRUE(lin && full);
  auto s = store.stats();
  EXPECT_EQ(s.disk_writes, 2u);
  EXPECT_EQ(s.disk_hits, 2u);
  EXPECT_EQ(s.disk_entries, 2u);
  EXPECT_EQ(s.corrupt_files, 0u);
  EXPECT_EQ(count_files(".tmp"), 0u);
  // A key that was never written is a plain miss.
  EXPECT_EQ(store.load(SegmentKey{model().fingerprint(), 8, 0, segs_[2]}), nullptr);
  EXPECT_EQ(store.stats().corrupt_files, 0u);
}

TEST_F(Store, RestartGetsDiskHitsWithBitwiseIdenticalLogprobs) {
  const auto ref = reference();
  std::vector<float> first;
  {
    PicEngine eng(model(), kMem);
    eng.attach_cache_dir(dir_.string());
    CacheReport rep;
    first = run(eng, &rep);
    EXPECT_EQ(rep.miss_segments, 4);
    auto s = eng.cache().stats();
    EXPECT_EQ(s.disk_writes, 4u);
    EXPECT_EQ(s.disk_hits, 0u);
    EXPECT_EQ(s.disk_entries, 4u);
    EXPECT_GT(s.disk_bytes, 0u);
  }
  EXPECT_EQ(count_files(".hseg"), 4u);
  PicEngine again(model(), kMem);  // a "restart": empty memory, same directory
  again.attach_cache_dir(dir_.string());
  EXPECT_EQ(again.cache().stats().disk_entries, 4u);  // found by the startup scan
  CacheReport rep;
  auto second = run(again, &rep);
  EXPECT_EQ(first, ref);
  EXPECT_EQ(second, first);  // bitwise
  EXPECT_EQ(rep.hit_segments, 4);
  EXPECT_EQ(rep.miss_segments, 0);
  EXPECT_EQ(rep.computed_tokens, 8 * 3 + 9);  // seams + question only
  auto s = again.cache().stats();
  EXPECT_EQ(s.disk_hits, 4u);
  EXPECT_EQ(s.disk_writes, 0u);  // disk hits are not written back
  EXPECT_EQ(s.corrupt_files, 0u);
  // Now in memory: a second request does not touch the disk.
  run(again, &rep);
  EXPECT_EQ(again.cache().stats().disk_hits, 4u);
  EXPECT_EQ(again.cache().stats().hits, 4u);
}

// One damaged file among four: detected, reported, quarantined, recomputed and rewritten.
struct Damage {
  const char* name;
  const char* reason;  // expected in the warning
  std::function<void(std::vector<char>&)> apply;
};

class StoreDamage : public Store, public ::testing::WithParamInterface<Damage> {};

TEST_P(StoreDamage, DamagedFileIsReportedNotUsedAndRecomputed) {
  const auto ref = reference();
  {
    PicEngine eng(model(), kMem);
    eng.attach_cache_dir(dir_.string());
    run(eng);
  }
  const fs::path victim = file_of(2);
  ASSERT_TRUE(fs::exists(victim));
  auto bytes = read_all(victim);
  GetParam().apply(bytes);
  write_all(victim, bytes);

  LogCapture log;
  PicEngine eng(model(), kMem);
  eng.attach_cache_dir(dir_.string());
  CacheReport rep;
  auto lp = run(eng, &rep);
  EXPECT_EQ(lp, ref);  // the right answer, bitwise
  EXPECT_EQ(rep.hit_segments, 3);
  EXPECT_EQ(rep.miss_segments, 1);
  auto s = eng.cache().stats();
  EXPECT_EQ(s.corrupt_files, 1u);
  EXPECT_EQ(s.disk_hits, 3u);
  EXPECT_EQ(s.disk_writes, 1u);  // the recomputed entry replaces it
  EXPECT_TRUE(log.has({victim.filename().string(), GetParam().reason})) << log.dump();
  EXPECT_TRUE(fs::exists(victim.string() + ".bad"));
  // The rewritten file is good: a third engine hits on everything.
  PicEngine third(model(), kMem);
  third.attach_cache_dir(dir_.string());
  EXPECT_EQ(run(third, &rep), ref);
  EXPECT_EQ(rep.hit_segments, 4);
  EXPECT_EQ(third.cache().stats().corrupt_files, 0u);
}

INSTANTIATE_TEST_SUITE_P(Kinds, StoreDamage,
                         ::testing::Values(Damage{"Truncated", "truncated",
                                                  [](std::vector<char>& b) { b.resize(b.size() / 2); }},
                                           Damage{"TruncatedInHeader", "truncated",
                                                  [](std::vector<char>& b) { b.resize(30); }},
                                           Damage{"TruncatedChecksum", "truncated",
                                                  [](std::vector<char>& b) { b.resize(b.size() - 3); }},
                                           Damage{"Empty", "truncated", [](std::vector<char>& b) { b.clear(); }},
                                           Damage{"FlippedDataByte", "checksum",
                                                  [](std::vector<char>& b) { b[b.size() * 2 / 3] ^= 0x10; }},
                                           Damage{"FlippedLastDataByte", "checksum",
                                                  [](std::vector<char>& b) { b[b.size() - 9] ^= 0x01; }},
                                           Damage{"FlippedTokenIdInHeader", "checksum",
                                                  [](std::vector<char>& b) { b[37] ^= 0x04; }},  // ids start at byte 36
                                           Damage{"FlippedFingerprintInHeader", "checksum",
                                                  [](std::vector<char>& b) { b[17] ^= 0x80; }},
                                           Damage{"FlippedChecksum", "checksum",
                                                  [](std::vector<char>& b) { b[b.size() - 1] ^= 0x20; }},
                                           Damage{"BadMagic", "magic", [](std::vector<char>& b) { b[0] = 'X'; }},
                                           Damage{"WrongVersion", "version 1", [](std::vector<char>& b) { b[8] = 1; }},
                                           Damage{"HugeLayerCount", "implausible layer count",
                                                  [](std::vector<char>& b) {
                                                    // Layer count field set absurdly high: rejected before any
                                                    // allocation.
                                                    const size_t n_ids = 33;
                                                    const size_t at = 8 + 4 + 4 + 8 + 4 + 4 + 4 +
                                                                      4 * n_ids;  // magic..tail, n_ids, ids
                                                    b[at + 3] = 0x7f;
                                                  }},
                                           Damage{"TrailingGarbage", "trailing",
                                                  [](std::vector<char>& b) { b.push_back(0); }}),
                         [](const auto& i) { return std::string(i.param.name); });

TEST_F(Store, FileOfAnotherModelIsNotUsed) {
  const auto ref = reference();
  PicEngine builder(model(), kMem);
  auto foreign = builder.build_entry(segs_[2], 8);
  foreign->key.model_fingerprint ^= 0x5a5a;  // as if another checkpoint had written it
  {
    SegmentStore s(dir_.string(), be());
    ASSERT_TRUE(s.save(*foreign));
    // Directly: under its own name it is a valid file, but not for our key.
    fs::rename(s.path_for(foreign->key), s.path_for(key_of(2)));
    EXPECT_EQ(s.load(key_of(2)), nullptr);
    EXPECT_EQ(s.stats().corrupt_files, 1u);
  }
  // Through an engine, put it back under our key's name again.
  {
    SegmentStore s(dir_.string(), be());
    ASSERT_TRUE(s.save(*foreign));
    fs::rename(s.path_for(foreign->key), s.path_for(key_of(2)));
  }
  LogCapture log;
  PicEngine eng(model(), kMem);
  eng.attach_cache_dir(dir_.string());
  CacheReport rep;
  EXPECT_EQ(run(eng, &rep), ref);
  EXPECT_EQ(rep.hit_segments, 0);
  EXPECT_EQ(eng.cache().stats().corrupt_files, 1u);
  EXPECT_TRUE(log.has({file_of(2).filename().string(), "another model"})) << log.dump();
}

TEST_F(Store, HashCollisionIsCaughtByTheFullKey) {
  const auto ref = reference();
  PicEngine builder(model(), kMem);
  // Same model, same seam, different ids; and same ids with another seam.
  for (auto [other, what] : {std::pair{builder.build_entry(segs_[3], 8), "ids differ"},
                             std::pair{builder.build_entry(segs_[2], 5), "seam 5"}}) {
    fs::remove_all(dir_);
    {
      SegmentStore s(dir_.string(), be());
      ASSERT_TRUE(s.save(*other));
      fs::rename(s.path_for(other->key), s.path_for(key_of(2)));  // now it sits under key 2's name
    }
    LogCapture log;
    PicEngine eng(model(), kMem);
    eng.attach_cache_dir(dir_.string());
    CacheReport rep;
    EXPECT_EQ(run(eng, &rep), ref);
    EXPECT_EQ(rep.hit_segments, 0);
    EXPECT_EQ(eng.cache().stats().corrupt_files, 1u);
    EXPECT_TRUE(log.has({file_of(2).filename().string(), what})) << log.dump();
    // The store now holds the right entry under that name.
    SegmentStore s(dir_.string(), be());
    auto e = s.load(key_of(2));
    ASSERT_NE(e, nullptr);
    EXPECT_TRUE(e->key == key_of(2));
  }
}

TEST_F(Store, EntryThatDoesNotFitTheModelIsRejected) {
  // A well-formed file under the right key whose tensors do not match the model's layout.
  PicEngine builder(model(), kMem);
  auto e = builder.build_entry(segs_[2], 8);
  for (auto& l : e->layers)
    if (l.k.defined()) l.k = l.k.reshape({l.k.dim(0) * l.k.dim(1), 1, l.k.dim(2)});
  e->account();
  {
    SegmentStore s(dir_.string(), be());
    ASSERT_TRUE(s.save(*e));
  }
  const auto ref = reference();
  LogCapture log;
  PicEngine eng(model(), kMem);
  eng.attach_cache_dir(dir_.string());
  CacheReport rep;
  EXPECT_EQ(run(eng, &rep), ref);
  EXPECT_EQ(eng.cache().stats().corrupt_files, 1u);
  EXPECT_TRUE(log.has({file_of(2).filename().string(), "expected f32"})) << log.dump();
}

// A short body's compact entry (its recurrence inputs) goes through the file bitwise; one whose
// rows do not match its body is reported and recomputed, never composed.
TEST_F(Store, CompactEntryRoundTripsAndIsChecked) {
  PicEngine builder(model(), kMem);
  const std::vector<int32_t> ids(segs_[2].begin(), segs_[2].begin() + 14);
  auto e = builder.build_entry(ids, 8);
  bool compact = false;
  for (auto& l : e->layers) compact |= l.body.defined();
  ASSERT_TRUE(compact);
  {
    SegmentStore s(dir_.string(), be());
    ASSERT_TRUE(s.save(*e));
    EXPECT_EQ(fs::file_size(s.path_for(e->key)), SegmentStore::file_size(*e));
    auto back = s.load(e->key);
    ASSERT_NE(back, nullptr);
    expect_same_entry(be(), *e, *back);
  }
  PicEngine eng(model(), kMem);
  eng.attach_cache_dir(dir_.string());
  auto hit = eng.find(ids, 8);
  ASSERT_NE(hit, nullptr);
  expect_same_entry(be(), *e, *hit);

  for (auto& l : e->layers)
    if (l.body.defined()) l.body.v = l.body.v.slice_rows(0, l.body.v.dim(0) - 1);
  e->account();
  fs::remove_all(dir_);
  {
    SegmentStore s(dir_.string(), be());
    ASSERT_TRUE(s.save(*e));
  }
  LogCapture log;
  PicEngine eng2(model(), kMem);
  eng2.attach_cache_dir(dir_.string());
  EXPECT_EQ(eng2.find(ids, 8), nullptr);
  EXPECT_EQ(eng2.cache().stats().corrupt_files, 1u);
  EXPECT_TRUE(log.has({"body v", "expected f32"})) << log.dump();
}

// Format v2 names each tensor: every name round-trips, a name this build does not know (a newer
// layer kind's state) is refused by name even under a valid checksum, and a v1 entry by its version.
TEST_F(Store, StateTensorsAreStoredByName) {
  PicEngine eng(model(), kMem);
  auto e = eng.build_entry(segs_[1], 8);
  const std::string bytes = encode_entry(*e, be());
  EXPECT_EQ(bytes.size(), encoded_entry_size(*e));
  expect_same_entry(be(), *e, *decode_entry(bytes));
  const std::string tail = std::string(1, '\x09') + "conv_tail";  // length byte, name
  const size_t at = bytes.find(tail);
  ASSERT_NE(at, std::string::npos) << "no conv_tail record";
  auto resealed = [](std::string b) {  // a valid checksum over the edited bytes
    const uint64_t sum = XXH64(b.data(), b.size() - 8, 0);
    std::memcpy(b.data() + b.size() - 8, &sum, 8);
    return b;
  };
  std::string renamed = bytes;
  renamed[at + 1 + 6] = 'X';  // conv_tXil (the name starts after its length byte)
  try {
    decode_entry(resealed(renamed));
    ADD_FAILURE() << "an unknown state tensor was accepted";
  } catch (const EntryFormatError& err) {
    EXPECT_NE(std::string(err.what()).find("unknown state tensor 'conv_tXil'"), std::string::npos) << err.what();
  }
  std::string v1 = bytes;
  v1[8] = 1;
  try {
    decode_entry(resealed(v1));
    ADD_FAILURE() << "a v1 entry was accepted";
  } catch (const EntryFormatError& err) {
    EXPECT_NE(std::string(err.what()).find("unsupported format version 1"), std::string::npos) << err.what();
  }
}

TEST_F(Store, UnwritableDirDoesNotFailRequests) {
  const auto ref = reference();
  fs::create_directories(dir_);
  const fs::path blocker = dir_ / "not_a_dir";
  write_all(blocker, {'x'});
  {
    // The directory cannot even be created (its parent is a file): works as root too.
    LogCapture log;
    PicEngine eng(model(), kMem);
    eng.attach_cache_dir((blocker / "cache").string());
    CacheReport rep;
    EXPECT_EQ(run(eng, &rep), ref);
    auto s = eng.cache().stats();
    EXPECT_EQ(s.disk_writes, 0u);
    EXPECT_EQ(s.disk_write_errors, 4u);
    EXPECT_EQ(s.disk_hits, 0u);
    EXPECT_TRUE(log.has({"cache"})) << log.dump();
    EXPECT_EQ(run(eng, &rep), ref);  // and again, from memory
    EXPECT_EQ(rep.hit_segments, 4);
  }
  {
    // The directory disappears after startup.
    const fs::path d = dir_ / "vanishing";
    PicEngine eng(model(), kMem);
    eng.attach_cache_dir(d.string());
    fs::remove_all(d);
    write_all(d, {'x'});
    EXPECT_EQ(run(eng), ref);
    EXPECT_EQ(eng.cache().stats().disk_write_errors, 4u);
  }
}

TEST_F(Store, BudgetEvictsLeastRecentlyUsed) {
  PicEngine builder(model(), kMem);
  std::vector<std::shared_ptr<SegmentEntry>> es;
  for (size_t i = 1; i <= 3; ++i) es.push_back(builder.build_entry(segs_[i], 8));
  size_t most = 0;
  for (auto& e : es) most = std::max(most, SegmentStore::file_size(*e));
  {
    SegmentStore s(dir_.string(), be(), 2 * most + most / 2);  // room for two
    ASSERT_TRUE(s.save(*es[0]));
    ASSERT_TRUE(s.save(*es[1]));
    ASSERT_NE(s.load(es[0]->key), nullptr);  // es[1] is now least recent
    ASSERT_TRUE(s.save(*es[2]));
    auto st = s.stats();
    EXPECT_EQ(st.evictions, 1u);
    EXPECT_EQ(st.disk_entries, 2u);
    EXPECT_LE(st.disk_bytes, st.budget);
    EXPECT_FALSE(fs::exists(s.path_for(es[1]->key)));
    EXPECT_TRUE(fs::exists(s.path_for(es[0]->key)));
    EXPECT_TRUE(fs::exists(s.path_for(es[2]->key)));
    // An entry larger than the whole budget is not written, and nothing is evicted for it.
    SegmentStore tiny(dir_.string(), be(), 100);
    EXPECT_EQ(tiny.stats().evictions, 2u);  // the startup scan trimmed to 100 bytes
  }
  // Startup scan: recency from file times. Make es[2] old, es[0] new; a budget for one keeps es[0].
  fs::remove_all(dir_);
  {
    SegmentStore s(dir_.string(), be());
    for (auto& e : es) ASSERT_TRUE(s.save(*e));
    auto age = [&](const SegmentEntry& e, int64_t secs_ago) {
      timespec ts[2];
      ts[0].tv_sec = ts[1].tv_sec = time(nullptr) - secs_ago;
      ts[0].tv_nsec = ts[1].tv_nsec = 0;
      ASSERT_EQ(utimensat(AT_FDCWD, s.path_for(e.key).c_str(), ts, 0), 0);
    };
    age(*es[2], 3000);
    age(*es[1], 2000);
    age(*es[0], 1000);
  }
  SegmentStore s(dir_.string(), be(), most + most / 2);
  EXPECT_EQ(s.stats().evictions, 2u);
  EXPECT_EQ(s.stats().disk_entries, 1u);
  EXPECT_TRUE(fs::exists(s.path_for(es[0]->key)));
  EXPECT_NE(s.load(es[0]->key), nullptr);
}

TEST_F(Store, FileBeingReadIsNeverEvicted) {
  PicEngine builder(model(), kMem);
  auto a = builder.build_entry(segs_[1], 8), b = builder.build_entry(segs_[2], 8), c = builder.build_entry(segs_[3], 8);
  const size_t most = std::max({SegmentStore::file_size(*a), SegmentStore::file_size(*b), SegmentStore::file_size(*c)});
  SegmentStore s(dir_.string(), be(), 2 * most + most / 2);
  ASSERT_TRUE(s.save(*a));  // a is least recent
  ASSERT_TRUE(s.save(*b));
  // While a is being loaded (the validator runs mid-load), a write needs room: b goes, not a.
  bool saved = false;
  auto got = s.load(a->key, [&](const SegmentEntry&) {
    saved = s.save(*c);
    return std::string();
  });
  ASSERT_TRUE(saved);
  ASSERT_NE(got, nullptr);
  EXPECT_TRUE(fs::exists(s.path_for(a->key)));
  EXPECT_FALSE(fs::exists(s.path_for(b->key)));
  EXPECT_TRUE(fs::exists(s.path_for(c->key)));
  expect_same_entry(be(), *a, *got);
}

TEST_F(Store, ConcurrentWritersAndReadersNeverSeeTornFiles) {
  // Several threads write and read the same keys under a budget that forces evictions: every load
  // is either a miss or the exact entry, and no file is ever seen half-written.
  PicEngine builder(model(), kMem);
  std::vector<std::shared_ptr<SegmentEntry>> es;
  for (size_t i = 1; i <= 3; ++i) es.push_back(builder.build_entry(segs_[i], 8));
  const size_t most = SegmentStore::file_size(*es[2]) + SegmentStore::file_size(*es[1]);
  SegmentStore s(dir_.string(), be(), most);  // never room for all three
  std::atomic<int> bad{0}, hits{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&, t] {
      for (int i = 0; i < 30; ++i) {
        const auto& e = es[static_cast<size_t>(i + t) % es.size()];
        if ((i + t) % 2 == 0) {
          s.save(*e);
        } else if (auto got = s.load(e->key)) {
          ++hits;
          for (size_t l = 0; l < e->layers.size(); ++l)
            if (!same_tensor(be(), e->layers[l].S, got->layers[l].S) ||
                !same_tensor(be(), e->layers[l].k, got->layers[l].k))
              ++bad;
        }
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(hits.load(), 0);
  EXPECT_EQ(s.stats().corrupt_files, 0u);
  EXPECT_EQ(s.stats().write_errors, 0u);
  EXPECT_LE(s.stats().disk_bytes, most);
  EXPECT_EQ(count_files(".tmp"), 0u);
}

TEST_F(Store, NoDamageIsEverUsedOrCrashes) {
  // Every truncation length through the header and a spread of single-byte flips over the file.
  PicEngine builder(model(), kMem);
  auto e = builder.build_entry(segs_[4], 2);
  SegmentStore s(dir_.string(), be());
  ASSERT_TRUE(s.save(*e));
  const fs::path p = s.path_for(e->key);
  const auto good = read_all(p);
  uint64_t tried = 0;
  auto check = [&](std::vector<char> b) {
    write_all(p, b);
    EXPECT_EQ(s.load(e->key), nullptr);
    ++tried;
  };
  for (size_t n = 0; n < 200 && n < good.size(); ++n) check(std::vector<char>(good.begin(), good.begin() + n));
  std::mt19937_64 rng(7);
  for (int i = 0; i < 150; ++i) {
    auto b = good;
    const size_t at = i < 100 ? static_cast<size_t>(i) : rng() % b.size();  // the whole header, then anywhere
    b[at] ^= static_cast<char>(1u << (rng() % 8));
    check(b);
  }
  EXPECT_EQ(s.stats().corrupt_files, tried);
  write_all(p, good);
  auto back = s.load(e->key);
  ASSERT_NE(back, nullptr);
  expect_same_entry(be(), *e, *back);
}

// A CPU backend that "shares" memory within this process (a buffer per handle), standing in for
// CUDA IPC so that the shared form's checks run without a GPU.
class SharingCpu : public cpu::CpuBackend {
 public:
  SharingCpu() : cpu::CpuBackend(1) {}
  std::optional<Shared> share(std::span<const Tensor* const> src, std::span<const uint64_t> offsets,
                              uint64_t bytes) override {
    auto buf = std::make_shared<std::vector<char>>(bytes);
    for (size_t i = 0; i < src.size(); ++i) std::memcpy(buf->data() + offsets[i], src[i]->raw(), src[i]->nbytes());
    const std::string h = "buf:" + std::to_string(next_++);
    buffers_[h] = buf;
    return Shared{h, std::shared_ptr<void>(nullptr, [this, h](void*) { buffers_.erase(h); })};
  }
  bool can_map_shared() const override { return true; }
  void copy_from_shared(const std::string& handle, uint64_t bytes, std::span<const uint64_t> offsets,
                        std::span<Tensor> dst) override {
    auto it = buffers_.find(handle);
    if (it == buffers_.end()) throw SharedMemoryError("no buffer " + handle);
    if (bytes > it->second->size()) throw SharedMemoryError("the buffer is smaller than claimed");
    for (size_t i = 0; i < dst.size(); ++i) std::memcpy(dst[i].raw(), it->second->data() + offsets[i], dst[i].nbytes());
  }
  std::vector<char>& buffer(const std::string& handle) { return *buffers_.at(handle); }

 private:
  std::map<std::string, std::shared_ptr<std::vector<char>>> buffers_;
  int next_ = 1000;
};

// Entries that segment workers hand over device to device (entry_codec.h, "shared form"): the
// round trip is bitwise, and a damaged descriptor, a changed payload, a buffer gone or claimed
// larger than it is, or a backend that cannot map are refused by name.
TEST_F(Store, SharedFormRoundTripsAndIsChecked) {
  PicEngine builder(model(), kMem);
  auto e = builder.build_entry(segs_[3], 8);
  EXPECT_FALSE(share_entry(*e, be()).has_value());  // the plain CPU backend shares nothing
  SharingCpu sharing;
  auto sh = share_entry(*e, sharing);
  ASSERT_TRUE(sh.has_value());
  EXPECT_GE(sh->payload_bytes, e->bytes);
  auto back = receive_shared_entry(sh->descriptor, sharing);
  ASSERT_NE(back, nullptr);
  expect_same_entry(be(), *e, *back);
  // The checksum of the pieces is the host reference's, wherever they are.
  std::vector<const Tensor*> ts;
  std::vector<uint64_t> offs;
  for (auto& l : e->layers)
    for (Tensor* t : l.tensors())
      if (t->defined()) ts.push_back(t), offs.push_back(offs.empty() ? 0 : offs.back() + 4096);
  EXPECT_EQ(sharing.payload_checksum(ts, offs), be().payload_checksum(ts, offs));

  const std::string good = sh->descriptor;
  auto refused = [&](const std::string& d) -> std::string {
    try {
      receive_shared_entry(d, sharing);
    } catch (const EntryFormatError& x) {
      return x.what();
    } catch (const SharedMemoryError& x) {
      return std::string("shared: ") + x.what();
    }
    return "";
  };
  EXPECT_NE(refused(good.substr(0, 7)).find("truncated"), std::string::npos);
  for (size_t n = 0; n < good.size(); n += std::max<size_t>(1, good.size() / 97))
    EXPECT_NE(refused(good.substr(0, n)), "") << "truncated to " << n;
  std::mt19937_64 rng(3);
  for (int i = 0; i < 120; ++i) {
    std::string d = good;
    d[i < 60 ? static_cast<size_t>(i) : rng() % d.size()] ^= static_cast<char>(1u << (rng() % 8));
    const std::string why = refused(d);
    EXPECT_NE(why, "") << "flip " << i;
    EXPECT_EQ(why.find("shared: "), std::string::npos) << why;  // caught before any mapping
  }
  // Re-signed descriptors (a worker that computes a valid checksum over wrong fields).
  const size_t n = good.size();
  const std::string handle = "buf:1000";
  ASSERT_EQ(good.substr(n - 8 - handle.size(), handle.size()), handle);
  auto resign = [](std::string d) {
    const uint64_t sum = XXH64(d.data(), d.size() - 8, 0);
    std::memcpy(d.data() + d.size() - 8, &sum, 8);
    return d;
  };
  const size_t at_bytes = n - 8 - handle.size() - 4 - 8 - 8;
  std::string small = good;
  const uint64_t tiny = 256;
  std::memcpy(small.data() + at_bytes, &tiny, 8);
  EXPECT_NE(refused(resign(small)).find("outside the shared buffer"), std::string::npos) << refused(resign(small));
  std::string big = good;
  const uint64_t huge = sh->payload_bytes + 4096;
  std::memcpy(big.data() + at_bytes, &huge, 8);
  EXPECT_NE(refused(resign(big)).find("shared: the buffer is smaller"), std::string::npos) << refused(resign(big));
  // The worker changed its buffer after sharing: the payload checksum catches it.
  sharing.buffer(handle)[sh->payload_bytes / 2] ^= 1;
  EXPECT_NE(refused(good).find("payload checksum mismatch"), std::string::npos) << refused(good);
  // The worker let go of the buffer.
  sh->keep.reset();
  EXPECT_NE(refused(good).find("shared: no buffer"), std::string::npos) << refused(good);
}

}  // namespace

// A FIFO or a symlink planted under an entry's name is not followed or waited on: the load is a
// miss at once (a FIFO used to block the engine thread until some writer opened it).
TEST_F(Store, FifoOrSymlinkUnderAnEntryNameIsAMissNotAHang) {
  SegmentStore store(dir_.string(), be());
  const std::string fifo = store.path_for(key_of(1));
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  auto f = std::async(std::launch::async, [&] { return store.load(key_of(1)); });
  if (f.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "load() blocked on a FIFO";
    const int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // release it so the test can end
    if (w >= 0) ::close(w);
  }
  EXPECT_EQ(f.get(), nullptr);
  // A symlink to a valid entry file elsewhere is not followed either.
  PicEngine eng(model(), kMem);
  auto e = eng.build_entry(segs_[2], 8);
  const fs::path other = dir_ / "elsewhere";
  fs::create_directories(other);
  {
    SegmentStore side(other.string(), be());
    ASSERT_TRUE(side.save(*e));
    fs::create_symlink(side.path_for(e->key), store.path_for(e->key));
  }
  EXPECT_EQ(store.load(e->key), nullptr);
}
