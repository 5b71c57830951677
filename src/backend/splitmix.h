// splitmix64's finaliser (Steele, Lea, Flood 2014): a 64-bit mix with full avalanche, for the
// payload checksum of shared entries (Backend::payload_checksum) on the host and on the GPU alike.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define HYPIC_HOST_DEVICE __host__ __device__
#else
#define HYPIC_HOST_DEVICE
#endif

namespace hypic {

HYPIC_HOST_DEVICE inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace hypic
