// Default byte budgets of `hypic serve` that are safe on a small machine (issue 12): the segment
// cache in memory and the disk tier, when the flags do not set them.
#pragma once
#include <cstdint>
#include <string>

namespace hypic::server {

// A quarter of the machine's memory, at most 4 GiB, at least 256 MiB.
uint64_t default_cache_budget(uint64_t physical_ram_bytes);
// On a GPU, where the segment cache is device memory: half of what is free once the weights are
// loaded (the rest for KV rows, recurrent states and activations of the running requests), at
// least 256 MiB.
uint64_t default_gpu_cache_budget(uint64_t free_device_bytes);
// Half of the space free on the cache folder's file system when the server starts, at most 32 GiB.
uint64_t default_disk_budget(uint64_t free_bytes);

uint64_t physical_ram_bytes();  // 0 when unknown
// Free bytes on the file system of `dir`, or of its nearest existing parent (0 when unknown).
uint64_t free_bytes_at(const std::string& dir);

}  // namespace hypic::server
