#include "server/budgets.h"

#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

namespace hypic::server {

uint64_t default_cache_budget(uint64_t ram) {
  constexpr uint64_t kMiB = 1 << 20;
  if (ram == 0) return 4096 * kMiB;  // unknown: the old default
  return std::clamp<uint64_t>(ram / 4, 256 * kMiB, 4096 * kMiB);
}

uint64_t default_gpu_cache_budget(uint64_t free_device) {
  return std::max<uint64_t>(free_device / 2, uint64_t(256) << 20);
}

uint64_t default_disk_budget(uint64_t free_bytes) {
  return std::min<uint64_t>(free_bytes / 2, uint64_t(32) << 30);
}

uint64_t physical_ram_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
}

uint64_t free_bytes_at(const std::string& dir) {
  std::filesystem::path p = dir.empty() ? "." : std::filesystem::absolute(dir);
  std::error_code ec;
  while (!std::filesystem::exists(p, ec) && p.has_parent_path() && p != p.parent_path()) p = p.parent_path();
  struct statvfs st {};
  if (::statvfs(p.c_str(), &st) != 0) return 0;
  return static_cast<uint64_t>(st.f_bavail) * static_cast<uint64_t>(st.f_frsize);
}

}  // namespace hypic::server
