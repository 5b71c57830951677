// Writing GGUF files (version 3), the inverse of io/gguf.h: metadata in insertion order, the
// tensor table, then each tensor's bytes at an offset aligned to `general.alignment` (32 unless a
// u32 of that key is set). Written by hand for the same reason as the reader (Debian has no GGUF
// library); the first step of `hypic quantize` (issue 17). Tensors are kept by reference (a
// Tensor shares its storage), so a model's weights are streamed to the file, not copied first.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "io/gguf.h"
#include "tensor/tensor.h"

namespace hypic {

class GgufWriter {
 public:
  // Sets a key (replacing an earlier value of it, keeping its place). Throws naming the key when
  // a value's type does not match its contents, or an array mixes types or holds arrays (which
  // the reader refuses).
  void set(const std::string& key, GgufValue v);
  void set_u32(const std::string& key, uint32_t v) { set(key, {GgufType::U32, uint64_t{v}}); }
  void set_i32(const std::string& key, int32_t v) { set(key, {GgufType::I32, int64_t{v}}); }
  void set_u64(const std::string& key, uint64_t v) { set(key, {GgufType::U64, v}); }
  void set_f32(const std::string& key, float v) { set(key, {GgufType::F32, double{v}}); }
  void set_bool(const std::string& key, bool v) { set(key, {GgufType::Bool, v}); }
  void set_string(const std::string& key, std::string v) { set(key, {GgufType::String, std::move(v)}); }
  void set_strings(const std::string& key, const std::vector<std::string>& v);
  void set_i32s(const std::string& key, const std::vector<int32_t>& v);

  // A tensor of dtype F32, F16, BF16, Q8_0, Q4_K or Q6_K (row-major shape, at most 4 dims; the
  // file stores them fastest-first). Throws naming the tensor on a duplicate name or another dtype.
  void add_tensor(const std::string& name, const Tensor& t);

  // Writes PATH.tmp and renames it to PATH, so a failed write never leaves a partial file under
  // the name. Throws std::runtime_error("gguf PATH: ...") on any I/O error.
  void write(const std::string& path) const;

  size_t tensor_count() const { return tensors_.size(); }

 private:
  std::vector<std::pair<std::string, GgufValue>> kv_;
  struct Entry {
    std::string name;
    uint32_t type;
    std::vector<int64_t> ne;  // fastest-varying first
    Tensor data;
  };
  std::vector<Entry> tensors_;
};

}  // namespace hypic
