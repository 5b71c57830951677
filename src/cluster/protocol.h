// Segment workers' messages (over UcxNode). A combine node asks a worker for the entry of one
// segment key; the worker finds it in its cache (memory, disk) or builds it in isolation from
// position 0, exactly as the local builder does, and replies with the entry in the codec of the
// disk tier (pic/entry_codec.h): the combine node checks it as it checks a file.
#pragma once
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

namespace hypic::cluster {

enum Kind : uint16_t {
  kBuild = 1,       // BuildHeader; payload: i32 token ids
  kBuildReply = 2,  // ReplyHeader; payload: the encoded entry, or the error text
  kPing = 3,        // PingHeader
  kPong = 4,        // PingHeader (fingerprint: the worker's model)
  kRelease = 5,     // ReleaseHeader: the combine node has copied a shared entry; its buffer may go
};

struct BuildHeader {
  uint64_t request = 0;
  uint64_t fingerprint = 0;  // the combine node's model: a worker of another model refuses
  int32_t seam = 0, tail = 0;
  // The combine node's host (host_identity()) where it can map shared device memory, else 0: a
  // worker on the same host answers with the entry's shared form (entry_codec.h), device to device.
  uint64_t host = 0;
};

struct ReplyHeader {
  uint64_t request = 0;
  uint32_t ok = 0;           // 1: payload is the entry; 0: payload is the error text
  uint32_t cached = 0;       // 1: the worker had it (memory or disk), no build
  double build_seconds = 0;  // the worker's time from the request to the reply
  uint32_t shared = 0;       // 1: payload is the shared form's descriptor (kRelease when copied)
  uint32_t reserved = 0;
};

struct ReleaseHeader {
  uint64_t request = 0;
};

struct PingHeader {
  uint64_t request = 0;
  uint64_t fingerprint = 0;
};

// A worker's answer to one build, as its engine gives it.
struct BuildOutcome {
  bool ok = false;
  bool cached = false;
  std::string bytes;  // ok: the encoded entry (or its shared form's descriptor); else the error text
  bool shared = false;
  std::shared_ptr<void> keep;  // shared: the buffer, held until the combine node releases it
};

// This machine's identity for shared memory between processes (a hash of the kernel's boot id;
// 0 where there is none): equal on both ends means one host, where CUDA IPC can work.
uint64_t host_identity();

template <typename H>
std::string pack(const H& h) {
  return std::string(reinterpret_cast<const char*>(&h), sizeof h);
}

template <typename H>
std::optional<H> unpack(const std::string& s) {
  if (s.size() != sizeof(H)) return std::nullopt;
  H h;
  std::memcpy(&h, s.data(), sizeof h);
  return h;
}

}  // namespace hypic::cluster
