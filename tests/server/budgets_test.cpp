// Default budgets of `hypic serve` on machines of every size (issue 12: safe on a small machine).
#include <gtest/gtest.h>

#ifdef HYPIC_HAVE_SERVER
#include "server/budgets.h"

namespace hypic::server {
namespace {

constexpr uint64_t kMiB = 1 << 20, kGiB = uint64_t(1) << 30;

TEST(Budgets, CacheIsAQuarterOfMemoryWithinBounds) {
  EXPECT_EQ(default_cache_budget(2 * kGiB), 512 * kMiB);    // a small VPS
  EXPECT_EQ(default_cache_budget(512 * kMiB), 256 * kMiB);  // the floor
  EXPECT_EQ(default_cache_budget(24 * kGiB), 4096 * kMiB);  // the ceiling
  EXPECT_EQ(default_cache_budget(0), 4096 * kMiB);          // unknown memory
  EXPECT_LE(default_cache_budget(physical_ram_bytes()), 4096 * kMiB);
  // A GPU's: half of the device memory left by the weights (35B-A3B on an H200: ~34 GiB), a floor.
  EXPECT_EQ(default_gpu_cache_budget(69 * kGiB), 69 * kGiB / 2);
  EXPECT_EQ(default_gpu_cache_budget(100 * kMiB), 256 * kMiB);
}

TEST(Budgets, DiskIsHalfTheFreeSpaceWithinBounds) {
  EXPECT_EQ(default_disk_budget(10 * kGiB), 5 * kGiB);
  EXPECT_EQ(default_disk_budget(1000 * kGiB), 32 * kGiB);
  EXPECT_EQ(default_disk_budget(0), 0u);
  // A folder that does not exist yet is measured on its nearest existing parent.
  const uint64_t here = free_bytes_at(::testing::TempDir());
  EXPECT_GT(here, 0u);
  EXPECT_GT(free_bytes_at(::testing::TempDir() + "/not/yet/made"), 0u);
  EXPECT_GT(physical_ram_bytes(), 0u);
}

}  // namespace
}  // namespace hypic::server

#else
TEST(Budgets, NotBuilt) {
  GTEST_SKIP() << "hypic was built without cpp-httplib";
}
#endif
