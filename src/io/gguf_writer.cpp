#include "io/gguf_writer.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace hypic {

namespace {

// Whether v's contents fit its declared type (arrays: every item of the element type).
bool well_typed(const GgufValue& v) {
  switch (v.type) {
    case GgufType::U8:
    case GgufType::U16:
    case GgufType::U32:
    case GgufType::U64:
      return std::holds_alternative<uint64_t>(v.v);
    case GgufType::I8:
    case GgufType::I16:
    case GgufType::I32:
    case GgufType::I64:
      return std::holds_alternative<int64_t>(v.v);
    case GgufType::F32:
    case GgufType::F64:
      return std::holds_alternative<double>(v.v);
    case GgufType::Bool:
      return std::holds_alternative<bool>(v.v);
    case GgufType::String:
      return std::holds_alternative<std::string>(v.v);
    case GgufType::Array: {
      const auto* a = std::get_if<GgufArray>(&v.v);
      if (!a || a->elem == GgufType::Array) return false;  // the reader takes no arrays of arrays
      for (const auto& it : a->items)
        if (it.type != a->elem || !well_typed(it)) return false;
      return true;
    }
  }
  return false;
}

class Out {
 public:
  Out(std::FILE* f, const std::string& path) : f_(f), path_(path) {}
  void bytes(const void* p, size_t n) {
    if (n && std::fwrite(p, 1, n, f_) != n) fail("write failed: " + std::string(std::strerror(errno)));
    pos_ += n;
  }
  template <typename T>
  void put(T v) {
    bytes(&v, sizeof v);
  }
  void str(const std::string& s) {
    put<uint64_t>(s.size());
    bytes(s.data(), s.size());
  }
  void pad(uint64_t align) {
    static const char zeros[64] = {};
    while (pos_ % align) bytes(zeros, std::min<uint64_t>(align - pos_ % align, sizeof zeros));
  }
  void value(const GgufValue& v) {
    switch (v.type) {
      case GgufType::U8:
        return put<uint8_t>(static_cast<uint8_t>(std::get<uint64_t>(v.v)));
      case GgufType::I8:
        return put<int8_t>(static_cast<int8_t>(std::get<int64_t>(v.v)));
      case GgufType::U16:
        return put<uint16_t>(static_cast<uint16_t>(std::get<uint64_t>(v.v)));
      case GgufType::I16:
        return put<int16_t>(static_cast<int16_t>(std::get<int64_t>(v.v)));
      case GgufType::U32:
        return put<uint32_t>(static_cast<uint32_t>(std::get<uint64_t>(v.v)));
      case GgufType::I32:
        return put<int32_t>(static_cast<int32_t>(std::get<int64_t>(v.v)));
      case GgufType::U64:
        return put<uint64_t>(std::get<uint64_t>(v.v));
      case GgufType::I64:
        return put<int64_t>(std::get<int64_t>(v.v));
      case GgufType::F32:
        return put<float>(static_cast<float>(std::get<double>(v.v)));
      case GgufType::F64:
        return put<double>(std::get<double>(v.v));
      case GgufType::Bool:
        return put<uint8_t>(std::get<bool>(v.v) ? 1 : 0);
      case GgufType::String:
        return str(std::get<std::string>(v.v));
      case GgufType::Array: {
        const auto& a = std::get<GgufArray>(v.v);
        put<uint32_t>(static_cast<uint32_t>(a.elem));
        put<uint64_t>(a.items.size());
        for (const auto& it : a.items) value(it);
        return;
      }
    }
  }
  uint64_t pos() const { return pos_; }
  [[noreturn]] void fail(const std::string& msg) const { throw std::runtime_error("gguf " + path_ + ": " + msg); }

 private:
  std::FILE* f_;
  std::string path_;
  uint64_t pos_ = 0;
};

}  // namespace

void GgufWriter::set(const std::string& key, GgufValue v) {
  if (key.empty()) throw std::invalid_argument("gguf writer: an empty metadata key");
  if (!well_typed(v))
    throw std::invalid_argument("gguf writer: key " + key +
                                ": the value does not match its type (or an array mixes types, or holds arrays)");
  for (auto& [k, old] : kv_)
    if (k == key) {
      old = std::move(v);
      return;
    }
  kv_.emplace_back(key, std::move(v));
}

void GgufWriter::set_strings(const std::string& key, const std::vector<std::string>& v) {
  GgufArray a{GgufType::String, {}};
  a.items.reserve(v.size());
  for (const auto& s : v) a.items.push_back({GgufType::String, s});
  set(key, {GgufType::Array, std::move(a)});
}

void GgufWriter::set_i32s(const std::string& key, const std::vector<int32_t>& v) {
  GgufArray a{GgufType::I32, {}};
  a.items.reserve(v.size());
  for (int32_t x : v) a.items.push_back({GgufType::I32, int64_t{x}});
  set(key, {GgufType::Array, std::move(a)});
}

void GgufWriter::add_tensor(const std::string& name, const Tensor& t) {
  if (name.empty()) throw std::invalid_argument("gguf writer: a tensor without a name");
  for (const auto& e : tensors_)
    if (e.name == name) throw std::invalid_argument("gguf writer: tensor " + name + " added twice");
  if (!t.defined() || !t.is_cpu()) throw std::invalid_argument("gguf writer: tensor " + name + " is not on the CPU");
  const std::optional<uint32_t> gid = ggml_id_of(t.dtype());
  if (!gid || t.dtype() == DType::F64)
    throw std::invalid_argument("gguf writer: tensor " + name + " is " + t.str() +
                                ": GGUF tensors are written as f32, f16, bf16, q8_0, q4_k or q6_k");
  if (t.ndim() < 1 || t.ndim() > 4)
    throw std::invalid_argument("gguf writer: tensor " + name + " " + t.str() + " has not 1 to 4 dimensions");
  const uint32_t id = *gid;
  const GgmlType* g = ggml_type(id);
  const Shape& sh = t.shape();
  if (sh.back() % g->block != 0)
    throw std::invalid_argument("gguf writer: tensor " + name + " " + t.str() + ": rows are not whole " + g->name +
                                " blocks");
  Entry e{name, id, std::vector<int64_t>(sh.rbegin(), sh.rend()), t};
  tensors_.push_back(std::move(e));
}

void GgufWriter::write(const std::string& path) const {
  uint64_t align = 32;
  for (const auto& [k, v] : kv_)
    if (k == "general.alignment") {
      if (v.type != GgufType::U32 || std::get<uint64_t>(v.v) == 0 || std::get<uint64_t>(v.v) % 8 != 0)
        throw std::invalid_argument("gguf writer: general.alignment must be a u32 multiple of 8");
      align = std::get<uint64_t>(v.v);
    }
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw std::runtime_error("gguf " + path + ": cannot create " + tmp + ": " + std::strerror(errno));
  try {
    Out o(f, path);
    o.bytes("GGUF", 4);
    o.put<uint32_t>(3);
    o.put<uint64_t>(tensors_.size());
    o.put<uint64_t>(kv_.size());
    for (const auto& [k, v] : kv_) {
      o.str(k);
      o.put<uint32_t>(static_cast<uint32_t>(v.type));
      o.value(v);
    }
    uint64_t off = 0;
    for (const auto& e : tensors_) {
      o.str(e.name);
      o.put<uint32_t>(static_cast<uint32_t>(e.ne.size()));
      for (int64_t n : e.ne) o.put<uint64_t>(static_cast<uint64_t>(n));
      o.put<uint32_t>(e.type);
      o.put<uint64_t>(off);
      off += (e.data.nbytes() + align - 1) / align * align;
    }
    o.pad(align);
    for (const auto& e : tensors_) {
      o.bytes(e.data.raw(), e.data.nbytes());
      o.pad(align);
    }
    if (std::fflush(f) != 0) o.fail("write failed: " + std::string(std::strerror(errno)));
  } catch (...) {
    std::fclose(f);
    std::remove(tmp.c_str());
    throw;
  }
  if (std::fclose(f) != 0) {
    std::remove(tmp.c_str());
    throw std::runtime_error("gguf " + path + ": close failed: " + std::strerror(errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = std::strerror(errno);
    std::remove(tmp.c_str());
    throw std::runtime_error("gguf " + path + ": cannot rename " + tmp + ": " + err);
  }
}

}  // namespace hypic
