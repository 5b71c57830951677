// Disk tier of the segment cache: one file per entry in a directory, named by the key hash
// (16 hex digits + ".hseg"). Files are checked in full before use; a file that is damaged, of
// another format version, or holds another key is reported (spdlog warning naming the file and
// the reason, counted in corrupt_files), renamed to *.bad, and never used.
//
// File layout: the entry codec's (pic/entry_codec.h), which is also the wire format between
// hypic processes.
//
// Writes go to a temp file in the same directory, are fsync'ed, renamed over the final name, and
// the directory is fsync'ed, so a reader sees either the old file, the new file, or none.
// The tier has its own byte budget; on startup the directory is scanned and files are ordered by
// max(atime, mtime) (a hit refreshes both), and the least recently used files are deleted to fit.
// A file being read by this process is never deleted by eviction.
#pragma once
#include <cstdint>
#include <functional>
#include <limits>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "pic/segment_cache.h"

namespace hypic {

class Backend;

struct SegmentStoreStats {
  uint64_t disk_hits = 0;      // loads that returned an entry
  uint64_t disk_misses = 0;    // loads that found no usable file
  uint64_t disk_writes = 0;    // files written
  uint64_t write_errors = 0;   // failed writes (disk full, permissions, ...); requests still succeed
  uint64_t corrupt_files = 0;  // files rejected (damaged, wrong version, foreign model, wrong key)
  uint64_t collisions = 0;     // valid files of another key with the same hash (left in place)
  uint64_t evictions = 0;      // files deleted to stay within the budget
  size_t disk_bytes = 0, disk_entries = 0, budget = 0;
};

class SegmentStore {
 public:
  static constexpr size_t kUnlimited = std::numeric_limits<size_t>::max();

  // Creates `dir` if needed and scans it. Never throws for an unusable directory: that is logged
  // and every later write fails (counted) while requests go on without the disk tier.
  SegmentStore(std::string dir, Backend& backend, size_t budget_bytes = kUnlimited);

  // Extra validation of a loaded entry (e.g. layer count against the model); returns an empty
  // string when the entry is usable, else the reason it is not.
  using Validator = std::function<std::string(const SegmentEntry&)>;

  // The entry stored for `key`, or nullptr (no file, or a rejected one). Tensors are on the
  // backend's device.
  std::shared_ptr<SegmentEntry> load(const SegmentKey& key, const Validator& check = {});
  // The same, with the tensors left in host memory (for copies the caller queues itself).
  // Thread-safe: a request's files may be read on several threads at once.
  std::shared_ptr<SegmentEntry> load_host(const SegmentKey& key, const Validator& check = {});
  Backend& backend() const { return be_; }
  // Writes `e` through to disk. Returns false (logged and counted, never thrown) on failure or
  // when the entry alone exceeds the budget.
  bool save(const SegmentEntry& e);

  std::string path_for(const SegmentKey& key) const;
  const std::string& dir() const { return dir_; }
  size_t budget() const { return budget_; }
  SegmentStoreStats stats() const;
  // Bytes the file for `e` takes.
  static size_t file_size(const SegmentEntry& e);

 private:
  struct Item {
    size_t bytes;
    std::list<uint64_t>::iterator lru;  // front = most recent
  };
  void scan();
  // Reports and renames the file to *.bad, unless a writer has replaced it since it was opened
  // (device/inode differ from `dev`/`ino`).
  void quarantine(const std::string& path, uint64_t h, uint64_t dev, uint64_t ino, const std::string& reason);
  void touch(uint64_t h, size_t bytes);        // mu_ held: mark most recent (adding if new)
  void forget(uint64_t h);                     // mu_ held
  void evict_for(size_t need, uint64_t keep);  // mu_ held
  void write_error(const std::string& path, const std::string& what);

  std::string dir_;
  Backend& be_;
  size_t budget_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Item> index_;
  std::list<uint64_t> lru_;
  std::unordered_map<uint64_t, int> reading_;  // hash -> loads in progress
  uint64_t tmp_counter_ = 0;
  SegmentStoreStats st_;
};

}  // namespace hypic
