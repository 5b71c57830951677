// GGUF files (llama.cpp's checkpoint format, versions 2 and 3), memory-mapped and validated.
// Written by hand: Debian packages no GGUF reader (llama.cpp's own is its ggml library, and
// gguf-py is Python). This is the format layer of issue 17: metadata, tensor table and data
// bytes; mapping llama.cpp's tensor names onto a model and quantized products come on top.
//
// Layout: "GGUF", u32 version, u64 tensor count, u64 metadata count; the metadata as (string key,
// u32 type, value); the tensor table as (string name, u32 n_dims, u64 dims[n_dims] with the
// fastest-varying first, u32 ggml type, u64 offset); padding to `general.alignment` (default 32);
// the data section, each tensor at its offset (a multiple of the alignment). Strings are a u64
// length and bytes; everything little-endian.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "tensor/tensor.h"

namespace hypic {

enum class GgufType : uint32_t {
  U8 = 0,
  I8 = 1,
  U16 = 2,
  I16 = 3,
  U32 = 4,
  I32 = 5,
  F32 = 6,
  Bool = 7,
  String = 8,
  Array = 9,
  U64 = 10,
  I64 = 11,
  F64 = 12,
};

struct GgufValue;
struct GgufArray {
  GgufType elem = GgufType::U8;
  std::vector<GgufValue> items;
};
// Integers keep their sign class (unsigned in uint64_t, signed in int64_t); floats are double.
struct GgufValue {
  GgufType type = GgufType::U8;
  std::variant<uint64_t, int64_t, double, bool, std::string, GgufArray> v;
};

// A ggml element type: id, name, elements per block, bytes per block.
struct GgmlType {
  uint32_t id;
  const char* name;
  int64_t block;
  int64_t block_bytes;
};
// The type with this id, or null when the reader does not know it.
const GgmlType* ggml_type(uint32_t id);
// The hypic dtype a ggml type id is read as, and back (nullopt where there is none).
std::optional<DType> dtype_of_ggml(uint32_t id);
std::optional<uint32_t> ggml_id_of(DType dt);

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> ne;  // GGUF order: ne[0] varies fastest (a row-major shape reversed)
  const GgmlType* type = nullptr;
  uint64_t offset = 0;  // from the start of the data section
  uint64_t bytes = 0;
  Shape shape() const;  // row-major: ne reversed
};

class GgufFile {
 public:
  // Throws std::runtime_error("gguf PATH: ...") naming the key or tensor on any problem: a bad
  // magic or version, truncation, lengths or counts past the end of the file, unknown value or
  // tensor types, duplicate keys or tensors, misaligned or overlapping tensor data.
  explicit GgufFile(const std::string& path);
  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // start of the data section in the file

  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  bool has(const std::string& key) const { return kv_.count(key) != 0; }
  // Typed reads; throw naming the key when it is absent or of another type.
  std::string get_string(const std::string& key) const;
  int64_t get_int(const std::string& key) const;   // any integer type that fits int64
  double get_float(const std::string& key) const;  // F32/F64 (or an integer)
  const GgufArray& get_array(const std::string& key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find(const std::string& name) const;
  // The tensor's bytes in the mapping (any ggml type).
  const uint8_t* data(const GgufTensorInfo& t) const;
  // A float tensor (F32, F16, BF16, F64) as a view of the mapping, row-major shape; quantized
  // types throw naming the tensor and its type.
  Tensor get(const std::string& name) const;

 private:
  std::string path_;
  std::shared_ptr<Storage> map_;
  uint64_t size_ = 0, data_offset_ = 0, alignment_ = 32;
  uint32_t version_ = 0;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t> index_;
};

}  // namespace hypic
