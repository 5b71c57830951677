#include "pic/segment_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <stdexcept>
#include <system_error>
#include <vector>

#include "backend/backend.h"
#include "pic/entry_codec.h"

namespace hypic {

namespace {

std::string errno_str(int e) {
  return std::strerror(e);
}

// The open file as the codec's source: reads exactly what it is asked (the codec bounds every
// length by size() first).
class FileSource final : public ByteSource {
 public:
  FileSource(int fd, uint64_t size) : fd_(fd), size_(size) {}
  uint64_t size() const override { return size_; }
  void read(void* dst, size_t n) override {
    char* p = static_cast<char*>(dst);
    size_t done = 0;
    while (done < n) {
      ssize_t r = ::read(fd_, p + done, n - done);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw EntryFormatError("read error: " + errno_str(errno));
      if (r == 0) throw EntryFormatError("truncated while reading (file shrank)");
      done += static_cast<size_t>(r);
    }
  }

 private:
  int fd_;
  uint64_t size_;
};

// Buffered file writer for the codec; throws std::system_error on failure.
class FileSink final : public ByteSink {
 public:
  explicit FileSink(int fd) : fd_(fd) { buf_.reserve(kBuf); }
  void write(const void* p, size_t n) override {
    if (buf_.size() + n > kBuf) flush();
    if (n >= kBuf) {
      raw(p, n);
    } else {
      const char* c = static_cast<const char*>(p);
      buf_.insert(buf_.end(), c, c + n);
    }
  }
  void flush() {
    raw(buf_.data(), buf_.size());
    buf_.clear();
  }

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
};

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

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
  return encoded_entry_size(e);
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
    for (Tensor* t : l.tensors())
      if (t->defined()) *t = be_.to_device(*t);
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
  std::shared_ptr<SegmentEntry> e;
  try {
    FileSource src(fd.fd, static_cast<uint64_t>(sb.st_size));
    e = decode_entry(src);
  } catch (const std::exception& x) {  // EntryFormatError, or e.g. allocation failure
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
    quarantine(path, h, sb.st_dev, sb.st_ino, key_difference(key, e->key));
    return nullptr;
  }
  if (check) {
    std::string why = check(*e);
    if (!why.empty()) {
      quarantine(path, h, sb.st_dev, sb.st_ino, why);
      return nullptr;
    }
  }
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
    FileSink w(fd.fd);
    encode_entry(e, be_, w);
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
