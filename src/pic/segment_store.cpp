#include "pic/segment_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <stdexcept>
#include <system_error>
#include <vector>

#include "backend/backend.h"

namespace hypic {

static_assert(std::endian::native == std::endian::little, "the .hseg format is little-endian");

namespace {

constexpr char kMagic[8] = {'H', 'Y', 'P', 'I', 'C', 'S', 'E', 'G'};
constexpr int kFields = 9;  // T, S, conv_tail, k, v, then a compact body's recurrence inputs
constexpr uint32_t kMaxLayers = 1u << 16;
constexpr uint8_t kMaxDims = 8;
constexpr int64_t kMaxDim = int64_t{1} << 40;
constexpr int kDTypes = static_cast<int>(DType::U8) + 1;

const char* field_name(int f) {
  static const char* names[kFields] = {"T", "S", "conv_tail", "k", "v", "body_k", "body_v", "body_g", "body_beta"};
  return names[f];
}

Tensor& field_of(LayerSummary& l, int f) {
  Tensor* t[kFields] = {&l.T, &l.S, &l.conv_tail, &l.k, &l.v, &l.body.k, &l.body.v, &l.body.g, &l.body.beta};
  return *t[f];
}
const Tensor& field_of(const LayerSummary& l, int f) {
  return field_of(const_cast<LayerSummary&>(l), f);
}

std::string errno_str(int e) {
  return std::strerror(e);
}

struct Bad {
  std::string reason;
};

class Hasher {
 public:
  Hasher() : s_(XXH64_createState()) { XXH64_reset(s_, 0); }
  ~Hasher() { XXH64_freeState(s_); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  void update(const void* p, size_t n) { XXH64_update(s_, p, n); }
  uint64_t digest() const { return XXH64_digest(s_); }

 private:
  XXH64_state_t* s_;
};

// Sequential reader over an open file of known size: never reads past the end, hashes as it goes.
class Reader {
 public:
  Reader(int fd, uint64_t size) : fd_(fd), size_(size) {}
  uint64_t remaining() const { return size_ - off_; }
  void read(void* dst, size_t n, const char* what, bool hash = true) {
    if (n > remaining())
      throw Bad{"truncated: " + std::string(what) + " needs " + std::to_string(n) + " bytes at offset " +
                std::to_string(off_) + ", file has " + std::to_string(size_)};
    char* p = static_cast<char*>(dst);
    size_t done = 0;
    while (done < n) {
      ssize_t r = ::read(fd_, p + done, n - done);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw Bad{"read error: " + errno_str(errno)};
      if (r == 0) throw Bad{"truncated while reading (file shrank)"};
      done += static_cast<size_t>(r);
    }
    if (hash) h_.update(dst, n);
    off_ += n;
  }
  template <typename T>
  T get(const char* what) {
    T v;
    read(&v, sizeof(T), what);
    return v;
  }
  uint64_t digest() const { return h_.digest(); }

 private:
  int fd_;
  uint64_t size_, off_ = 0;
  Hasher h_;
};

// Buffered writer that hashes everything it writes; throws std::system_error on failure.
class Writer {
 public:
  explicit Writer(int fd) : fd_(fd) { buf_.reserve(kBuf); }
  void put(const void* p, size_t n, bool hash = true) {
    if (hash) h_.update(p, n);
    if (buf_.size() + n > kBuf) flush();
    if (n >= kBuf) {
      raw(p, n);
    } else {
      const char* c = static_cast<const char*>(p);
      buf_.insert(buf_.end(), c, c + n);
    }
  }
  template <typename T>
  void put(const T& v) {
    put(&v, sizeof(T));
  }
  void flush() {
    raw(buf_.data(), buf_.size());
    buf_.clear();
  }
  uint64_t digest() const { return h_.digest(); }

 private:
  static constexpr size_t kBuf = 1 << 20;
  void raw(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      ssize_t w = ::write(fd_, c, n);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) throw std::system_error(errno, std::generic_category(), "write");
      c += w;
      n -= static_cast<size_t>(w);
    }
  }
  int fd_;
  std::vector<char> buf_;
  Hasher h_;
};

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

std::string key_diff(const SegmentKey& want, const SegmentKey& got) {
  if (want.model_fingerprint != got.model_fingerprint)
    return fmt::format("written by another model (fingerprint {:016x}, expected {:016x})", got.model_fingerprint,
                       want.model_fingerprint);
  if (want.seam != got.seam) return fmt::format("holds seam {} (expected {})", got.seam, want.seam);
  if (want.tail != got.tail) return fmt::format("holds tail seam {} (expected {})", got.tail, want.tail);
  return fmt::format("holds another segment ({} token ids, expected {}; ids differ)", got.ids.size(), want.ids.size());
}

bool parse_name(const std::string& name, uint64_t& h) {
  if (name.size() != 16 + 5 || name.compare(16, 5, ".hseg") != 0) return false;
  auto r = std::from_chars(name.data(), name.data() + 16, h, 16);
  return r.ec == std::errc() && r.ptr == name.data() + 16;
}

}  // namespace

SegmentStore::SegmentStore(std::string dir, Backend& backend, size_t budget_bytes)
    : dir_(std::move(dir)), be_(backend), budget_(budget_bytes) {
  st_.budget = budget_;
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) {
    spdlog::warn("segment store: cannot use cache dir {}: {}; continuing without a disk tier", dir_, ec.message());
    return;
  }
  scan();
}

std::string SegmentStore::path_for(const SegmentKey& key) const {
  return fmt::format("{}/{:016x}.hseg", dir_, key.hash());
}

size_t SegmentStore::file_size(const SegmentEntry& e) {
  size_t n = 8 + 4 + 4 + 8 + 4 + 4 + 4 + 4 * e.key.ids.size() + 4 + 4;  // ..seam, tail, n_ids, ids, counts
  for (const auto& l : e.layers)
    for (int f = 0; f < kFields; ++f) {
      const Tensor& t = field_of(l, f);
      if (t.defined()) n += 4 + 4 + 8 * t.shape().size() + 8 + t.nbytes();
    }
  return n + 8;
}

SegmentStoreStats SegmentStore::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  SegmentStoreStats s = st_;
  s.disk_entries = index_.size();
  return s;
}

void SegmentStore::touch(uint64_t h, size_t bytes) {
  auto it = index_.find(h);
  if (it != index_.end()) {
    st_.disk_bytes -= it->second.bytes;
    it->second.bytes = bytes;
    lru_.splice(lru_.begin(), lru_, it->second.lru);
  } else {
    lru_.push_front(h);
    index_.emplace(h, Item{bytes, lru_.begin()});
  }
  st_.disk_bytes += bytes;
}

void SegmentStore::forget(uint64_t h) {
  auto it = index_.find(h);
  if (it == index_.end()) return;
  st_.disk_bytes -= it->second.bytes;
  lru_.erase(it->second.lru);
  index_.erase(it);
}

void SegmentStore::evict_for(size_t need, uint64_t keep) {
  // The file being replaced does not count against the space it will reuse.
  size_t have = st_.disk_bytes;
  if (auto k = index_.find(keep); k != index_.end()) have -= k->second.bytes;
  auto it = lru_.end();
  while (have + need > budget_ && it != lru_.begin()) {
    --it;
    const uint64_t h = *it;
    if (h == keep || reading_.count(h)) continue;  // in use
    const std::string path = fmt::format("{}/{:016x}.hseg", dir_, h);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      spdlog::warn("segment store: cannot evict {}: {}", path, errno_str(errno));
      continue;
    }
    auto n = index_.find(h);
    have -= n->second.bytes;
    st_.disk_bytes -= n->second.bytes;
    index_.erase(n);
    it = lru_.erase(it);
    ++st_.evictions;
  }
}

void SegmentStore::scan() {
  struct Found {
    uint64_t h;
    size_t bytes;
    int64_t stamp_ns;
  };
  std::vector<Found> found;
  DIR* d = ::opendir(dir_.c_str());
  if (!d) {
    spdlog::warn("segment store: cannot scan cache dir {}: {}", dir_, errno_str(errno));
    return;
  }
  const int64_t now = static_cast<int64_t>(std::time(nullptr));
  while (dirent* de = ::readdir(d)) {
    const std::string name = de->d_name;
    const std::string path = dir_ + "/" + name;
    struct stat sb;
    if (::lstat(path.c_str(), &sb) != 0 || !S_ISREG(sb.st_mode)) continue;  // no links, FIFOs, devices
    uint64_t h;
    if (parse_name(name, h)) {
      const int64_t a = int64_t(sb.st_atim.tv_sec) * 1000000000 + sb.st_atim.tv_nsec;
      const int64_t m = int64_t(sb.st_mtim.tv_sec) * 1000000000 + sb.st_mtim.tv_nsec;
      found.push_back({h, static_cast<size_t>(sb.st_size), std::max(a, m)});
    } else if (name.size() > 4 && name[0] == '.' && name.ends_with(".tmp") && now - sb.st_mtim.tv_sec > 3600) {
      ::unlink(path.c_str());  // left by a writer that died an hour or more ago
    }
  }
  ::closedir(d);
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.stamp_ns < b.stamp_ns; });
  std::lock_guard<std::mutex> g(mu_);
  for (const auto& f : found) touch(f.h, f.bytes);  // oldest first, so the newest ends at the front
  evict_for(0, 0);
  if (!found.empty()) spdlog::info("segment store: {} has {} entries, {} bytes", dir_, index_.size(), st_.disk_bytes);
}

void SegmentStore::quarantine(const std::string& path, uint64_t h, uint64_t dev, uint64_t ino,
                              const std::string& reason) {
  struct stat now;
  const bool same = ::stat(path.c_str(), &now) == 0 && now.st_dev == dev && now.st_ino == ino;
  if (same) {
    spdlog::warn("segment store: ignoring {}: {}; moved to {}.bad", path, reason, path);
    if (::rename(path.c_str(), (path + ".bad").c_str()) != 0 && errno != ENOENT) ::unlink(path.c_str());
  } else {
    spdlog::warn("segment store: ignoring {}: {} (already replaced by a newer file)", path, reason);
  }
  std::lock_guard<std::mutex> g(mu_);
  ++st_.corrupt_files;
  ++st_.disk_misses;
  if (same) forget(h);
}

std::shared_ptr<SegmentEntry> SegmentStore::load(const SegmentKey& key, const Validator& check) {
  auto e = load_host(key, check);
  if (!e) return nullptr;
  for (auto& l : e->layers)
    for (int f = 0; f < kFields; ++f) {
      Tensor& t = field_of(l, f);
      if (t.defined()) t = be_.to_device(t);
    }
  return e;
}

std::shared_ptr<SegmentEntry> SegmentStore::load_host(const SegmentKey& key, const Validator& check) {
  const uint64_t h = key.hash();
  const std::string path = path_for(key);
  {
    std::lock_guard<std::mutex> g(mu_);
    ++reading_[h];
  }
  struct Unpin {
    SegmentStore* s;
    uint64_t h;
    ~Unpin() {
      std::lock_guard<std::mutex> g(s->mu_);
      if (--s->reading_[h] == 0) s->reading_.erase(h);
      // A save may have gone over budget while this file could not be evicted: catch up now.
      if (s->st_.disk_bytes > s->budget_) s->evict_for(0, 0);
    }
  } unpin{this, h};

  // Not through symlinks, and without blocking: opening a FIFO planted under an entry's name would
  // otherwise wait for a writer forever, with the engine thread in it.
  Fd fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK)};
  if (fd.fd < 0) {
    const int e = errno;
    if (e != ENOENT && e != ENOTDIR) spdlog::warn("segment store: cannot open {}: {}", path, errno_str(e));
    std::lock_guard<std::mutex> g(mu_);
    ++st_.disk_misses;
    forget(h);  // deleted behind our back, or not a file we may read
    return nullptr;
  }
  struct stat sb;
  const bool stat_ok = ::fstat(fd.fd, &sb) == 0;
  if (!stat_ok || !S_ISREG(sb.st_mode)) {
    if (stat_ok) spdlog::warn("segment store: ignoring {}: not a regular file", path);
    std::lock_guard<std::mutex> g(mu_);
    ++st_.disk_misses;
    forget(h);
    return nullptr;
  }
  auto e = std::make_shared<SegmentEntry>();
  try {
    Reader r(fd.fd, static_cast<uint64_t>(sb.st_size));
    char magic[8];
    r.read(magic, 8, "magic");
    if (std::memcmp(magic, kMagic, 8) != 0) throw Bad{"not a hypic segment file (bad magic)"};
    const auto version = r.get<uint32_t>("version");
    if (version != kVersion)
      throw Bad{"unsupported format version " + std::to_string(version) + " (this build reads " +
                std::to_string(kVersion) + ")"};
    if (r.get<uint32_t>("reserved") != 0) throw Bad{"reserved header field is not zero"};
    e->key.model_fingerprint = r.get<uint64_t>("model fingerprint");
    e->key.seam = r.get<int32_t>("seam");
    e->key.tail = r.get<int32_t>("tail seam");
    const auto n_ids = r.get<uint32_t>("id count");
    if (uint64_t{n_ids} * 4 > r.remaining()) throw Bad{"truncated: " + std::to_string(n_ids) + " token ids"};
    e->key.ids.resize(n_ids);
    r.read(e->key.ids.data(), size_t{n_ids} * 4, "token ids");
    const auto n_layers = r.get<uint32_t>("layer count");
    const auto n_tensors = r.get<uint32_t>("tensor count");
    if (n_layers > kMaxLayers) throw Bad{"implausible layer count " + std::to_string(n_layers)};
    if (n_tensors > n_layers * kFields) throw Bad{"implausible tensor count " + std::to_string(n_tensors)};
    e->layers.resize(n_layers);
    for (uint32_t i = 0; i < n_tensors; ++i) {
      const auto layer = r.get<uint32_t>("tensor layer");
      uint8_t b[4];
      r.read(b, 4, "tensor header");
      const std::string where = "tensor " + std::to_string(i);
      if (layer >= n_layers) throw Bad{where + ": layer " + std::to_string(layer) + " out of range"};
      if (b[0] >= kFields) throw Bad{where + ": bad field " + std::to_string(b[0])};
      if (b[1] >= kDTypes) throw Bad{where + ": bad dtype " + std::to_string(b[1])};
      if (b[2] > kMaxDims) throw Bad{where + ": bad rank " + std::to_string(b[2])};
      if (b[3] != 0) throw Bad{where + ": reserved byte is not zero"};
      Shape shape(b[2]);
      uint64_t numel = 1;
      for (auto& d : shape) {
        d = r.get<int64_t>("tensor shape");
        if (d < 0 || d > kMaxDim || __builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel))
          throw Bad{where + ": bad shape"};
      }
      const DType dt = static_cast<DType>(b[1]);
      const auto nbytes = r.get<uint64_t>("tensor size");
      uint64_t expect;
      if (__builtin_mul_overflow(numel, uint64_t{dtype_size(dt)}, &expect) || nbytes != expect)
        throw Bad{where + ": size " + std::to_string(nbytes) + " does not match " + dtype_name(dt) + shape_str(shape)};
      if (nbytes > r.remaining()) throw Bad{"truncated: " + where + " needs " + std::to_string(nbytes) + " bytes"};
      Tensor& dst = field_of(e->layers[layer], b[0]);
      if (dst.defined())
        throw Bad{where + ": layer " + std::to_string(layer) + " field " + field_name(b[0]) + " given twice"};
      Tensor host = Tensor::uninitialized(dt, shape);  // read in full below
      r.read(host.raw(), nbytes, "tensor data");
      dst = host;  // moved to the device once the whole file checks out (load)
    }
    const uint64_t want = r.digest();
    uint64_t sum;
    r.read(&sum, 8, "checksum", /*hash=*/false);
    if (sum != want) throw Bad{fmt::format("checksum mismatch (stored {:016x}, computed {:016x})", sum, want)};
    if (r.remaining() != 0) throw Bad{std::to_string(r.remaining()) + " trailing bytes after the checksum"};
  } catch (const Bad& b) {
    quarantine(path, h, sb.st_dev, sb.st_ino, b.reason);
    return nullptr;
  } catch (const std::exception& x) {  // e.g. allocation failure
    quarantine(path, h, sb.st_dev, sb.st_ino, x.what());
    return nullptr;
  }

  if (!(e->key == key)) {
    if (e->key.hash() == h) {
      // A valid entry of another key whose hash collides with ours: not ours to delete.
      spdlog::debug("segment store: {} holds another key with the same hash", path);
      std::lock_guard<std::mutex> g(mu_);
      ++st_.collisions;
      ++st_.disk_misses;
      return nullptr;
    }
    quarantine(path, h, sb.st_dev, sb.st_ino, key_diff(key, e->key));
    return nullptr;
  }
  if (check) {
    std::string why = check(*e);
    if (!why.empty()) {
      quarantine(path, h, sb.st_dev, sb.st_ino, why);
      return nullptr;
    }
  }
  e->account();
  ::futimens(fd.fd, nullptr);  // refresh atime/mtime for LRU across restarts; best effort
  std::lock_guard<std::mutex> g(mu_);
  touch(h, static_cast<size_t>(sb.st_size));
  ++st_.disk_hits;
  return e;
}

void SegmentStore::write_error(const std::string& path, const std::string& what) {
  uint64_t n;
  {
    std::lock_guard<std::mutex> g(mu_);
    n = ++st_.write_errors;
  }
  // Every failure is counted; the log gets the 1st, 2nd, 4th, 8th, ... so a full disk cannot flood it.
  if ((n & (n - 1)) == 0)
    spdlog::warn("segment store: cannot write {}: {} ({} write error{} so far; requests go on uncached on disk)", path,
                 what, n, n == 1 ? "" : "s");
}

bool SegmentStore::save(const SegmentEntry& e) {
  const uint64_t h = e.key.hash();
  const std::string path = path_for(e.key);
  const size_t size = file_size(e);
  std::string tmp;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (size > budget_) {
      spdlog::debug("segment store: entry of {} bytes exceeds the disk budget of {}; not written", size, budget_);
      return false;
    }
    evict_for(size, h);
    tmp = fmt::format("{}/.{:016x}.{}.{}.tmp", dir_, h, ::getpid(), tmp_counter_++);
  }
  Fd fd{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644)};
  if (fd.fd < 0) {
    write_error(path, "cannot create temp file " + tmp + ": " + errno_str(errno));
    return false;
  }
  try {
    Writer w(fd.fd);
    w.put(kMagic, 8);
    w.put(kVersion);
    w.put(uint32_t{0});
    w.put(e.key.model_fingerprint);
    w.put(e.key.seam);
    w.put(e.key.tail);
    w.put(static_cast<uint32_t>(e.key.ids.size()));
    w.put(e.key.ids.data(), e.key.ids.size() * 4);
    uint32_t n_tensors = 0;
    for (const auto& l : e.layers)
      for (int f = 0; f < kFields; ++f) n_tensors += field_of(l, f).defined() ? 1 : 0;
    w.put(static_cast<uint32_t>(e.layers.size()));
    w.put(n_tensors);
    for (size_t li = 0; li < e.layers.size(); ++li)
      for (int f = 0; f < kFields; ++f) {
        const Tensor& t = field_of(e.layers[li], f);
        if (!t.defined()) continue;
        Tensor host = be_.to_host(t);
        w.put(static_cast<uint32_t>(li));
        const uint8_t b[4] = {static_cast<uint8_t>(f), static_cast<uint8_t>(host.dtype()),
                              static_cast<uint8_t>(host.shape().size()), 0};
        w.put(b, 4);
        for (int64_t d : host.shape()) w.put(d);
        w.put(static_cast<uint64_t>(host.nbytes()));
        w.put(host.raw(), host.nbytes());
      }
    const uint64_t sum = w.digest();
    w.put(&sum, 8, /*hash=*/false);
    w.flush();
    if (::fsync(fd.fd) != 0) throw std::system_error(errno, std::generic_category(), "fsync");
    const int c = ::close(fd.fd);
    fd.fd = -1;
    if (c != 0) throw std::system_error(errno, std::generic_category(), "close");
  } catch (const std::exception& x) {
    ::unlink(tmp.c_str());
    write_error(path, x.what());
    return false;
  }
  {
    // Rename and index together, so an eviction can never unlink the new file between the two and
    // leave the index counting a file that is gone.
    std::unique_lock<std::mutex> g(mu_);
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      const int err = errno;
      g.unlock();
      ::unlink(tmp.c_str());
      write_error(path, "rename: " + errno_str(err));
      return false;
    }
    touch(h, size);
    ++st_.disk_writes;
    // Concurrent saves each made room for themselves before writing: settle the budget now.
    if (st_.disk_bytes > budget_) evict_for(size, h);  // keeps h, counting its size
  }
  // Make the rename durable. Some filesystems refuse fsync on a directory (EINVAL): not an error.
  Fd dfd{::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (dfd.fd >= 0 && ::fsync(dfd.fd) != 0 && errno != EINVAL && errno != EROFS)
    spdlog::warn("segment store: fsync of {} failed: {}", dir_, errno_str(errno));
  return true;
}

}  // namespace hypic
