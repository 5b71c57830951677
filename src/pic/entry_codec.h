// The byte form of a segment entry: the disk tier's file format (SegmentStore) and the wire
// format of entries sent between hypic processes (cluster/), one codec for both, so an entry that
// arrives over the network is checked exactly as a file is (magic, version, bounds, checksum).
//
// Layout (little-endian; v2):
//   "HYPICSEG"            8 bytes magic
//   u32 version           = 2
//   u32 reserved          = 0
//   u64 model_fingerprint
//   i32 seam, i32 tail
//   u32 n_ids, i32 ids[n_ids]
//   u32 n_layers, u32 n_tensors
//   n_tensors records:    u32 layer, u8 name_len, char name[name_len] (the state tensor's name:
//                         T, S, conv_tail, k, v; a compact body: body.k, body.v, body.g, body.beta),
//                         u8 dtype, u8 ndim, u8 reserved, i64 shape[ndim], u64 nbytes, raw data[nbytes]
//   u64 xxh64 (seed 0) of every byte above
// The bytes must end exactly after the checksum. Tensors are named, not numbered, so that a layer
// kind can add state of its own without renumbering the others' (v1, numbered fields, is refused:
// its entries are recomputed); a name this build does not know is refused by name.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "pic/segment_cache.h"

namespace hypic {

class Backend;

// A damaged, truncated, foreign-version or implausible entry: what() names the problem.
struct EntryFormatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class ByteSink {
 public:
  virtual ~ByteSink() = default;
  virtual void write(const void* p, size_t n) = 0;  // throws on failure
};

class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual uint64_t size() const = 0;  // total bytes
  // Exactly n bytes; the caller has checked n against what is left (throws on I/O errors).
  virtual void read(void* dst, size_t n) = 0;
};

inline constexpr uint32_t kEntryFormatVersion = 2;
// The state tensors an entry may hold, by name (LayerSummary::tensors() order).
inline constexpr const char* kStateTensorNames[] = {"T",      "S",         "conv_tail", "body.k", "body.v",
                                                    "body.g", "body.beta", "k",         "v"};

// Bytes encode_entry writes for e.
size_t encoded_entry_size(const SegmentEntry& e);
// Writes e (tensors copied to the host through be where they live on a device).
void encode_entry(const SegmentEntry& e, Backend& be, ByteSink& out);
std::string encode_entry(const SegmentEntry& e, Backend& be);
// Reads one entry, every length and count bounded before use and the checksum verified; tensors
// stay in host memory and bytes is accounted. Throws EntryFormatError.
std::shared_ptr<SegmentEntry> decode_entry(ByteSource& in);
std::shared_ptr<SegmentEntry> decode_entry(std::string_view bytes);

// The shared form (segment workers on one host; Backend::share, CUDA IPC on a GPU): the same
// head and records, each record followed by its u64 offset in a buffer the worker shares instead
// of its bytes, then u64 payload size, u64 payload checksum (Backend::payload_checksum), u32
// handle length, the handle, and the xxh64 of all of it. Magic "HYPICIPC".
inline constexpr uint32_t kSharedFormatVersion = 1;
struct SharedEntry {
  std::string descriptor;
  uint64_t payload_bytes = 0;
  std::shared_ptr<void> keep;  // the shared buffer: keep it until the receiver is done
};
// Null where `be` cannot share memory (then send encode_entry's bytes).
std::optional<SharedEntry> share_entry(const SegmentEntry& e, Backend& be);
// Checks the descriptor as decode_entry checks bytes (and every piece inside the buffer), copies
// the tensors out of the worker's buffer into `be`'s memory and verifies their payload checksum.
// Throws EntryFormatError, or SharedMemoryError (backend.h) where the buffer cannot be mapped here.
std::shared_ptr<SegmentEntry> receive_shared_entry(std::string_view descriptor, Backend& be);

// "" when got is want, else what differs (another model, seam, tail or segment).
std::string key_difference(const SegmentKey& want, const SegmentKey& got);

}  // namespace hypic
