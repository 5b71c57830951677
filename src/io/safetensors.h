// Memory-mapped safetensors checkpoints (single file or sharded with model.safetensors.index.json).
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace hypic {

// One .safetensors file, mapped read-only. Tensors returned by get() keep the mapping alive.
class SafetensorsFile {
 public:
  // Throws std::runtime_error naming the file on any problem (missing, truncated, bad header,
  // unsupported dtype, offsets outside the file, overlapping tensors).
  explicit SafetensorsFile(const std::string& path);
  const std::string& path() const { return path_; }
  bool has(const std::string& name) const { return index_.count(name) != 0; }
  std::vector<std::string> names() const;
  Tensor get(const std::string& name) const;

 private:
  struct Entry {
    DType dtype;
    Shape shape;
    size_t begin, end;  // byte offsets into the data section
  };
  std::string path_;
  std::shared_ptr<Storage> map_;  // whole file
  size_t data_offset_ = 0;
  std::map<std::string, Entry> index_;
};

// All weights of a model folder: model.safetensors, or the shards listed in
// model.safetensors.index.json (or every *.safetensors file when neither exists).
class WeightStore {
 public:
  explicit WeightStore(const std::string& model_dir);
  bool has(const std::string& name) const;
  std::vector<std::string> names() const;
  // Throws "missing tensor NAME in DIR" when absent, and "tensor NAME in FILE: expected shape
  // [..], found [..]" when `expected` is non-empty and differs.
  Tensor get(const std::string& name, const Shape& expected = {}) const;
  std::string file_of(const std::string& name) const;
  size_t total_bytes() const;

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // tensor name -> files_ index
};

// Writes tensors to a .safetensors file (used by tests and by tools that make checkpoints).
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace hypic
