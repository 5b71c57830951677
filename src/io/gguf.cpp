// GGUF reading: one bounds-checked cursor over the mapped file (every length and count is
// checked against the bytes left before anything is allocated for it), then the tensor table
// checked against the data section.
#include "io/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <utility>

namespace hypic {

namespace {

// Block sizes and bytes per block as ggml defines them (gguf-py's GGML_QUANT_SIZES).
constexpr GgmlType kTypes[] = {
    {0, "F32", 1, 4},         {1, "F16", 1, 2},         {2, "Q4_0", 32, 18},      {3, "Q4_1", 32, 20},
    {6, "Q5_0", 32, 22},      {7, "Q5_1", 32, 24},      {8, "Q8_0", 32, 34},      {9, "Q8_1", 32, 40},
    {10, "Q2_K", 256, 84},    {11, "Q3_K", 256, 110},   {12, "Q4_K", 256, 144},   {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210},   {15, "Q8_K", 256, 292},   {16, "IQ2_XXS", 256, 66}, {17, "IQ2_XS", 256, 74},
    {18, "IQ3_XXS", 256, 98}, {19, "IQ1_S", 256, 50},   {20, "IQ4_NL", 32, 18},   {21, "IQ3_S", 256, 110},
    {22, "IQ2_S", 256, 82},   {23, "IQ4_XS", 256, 136}, {24, "I8", 1, 1},         {25, "I16", 1, 2},
    {26, "I32", 1, 4},        {27, "I64", 1, 8},        {28, "F64", 1, 8},        {29, "IQ1_M", 256, 56},
    {30, "BF16", 1, 2},       {34, "TQ1_0", 256, 54},   {35, "TQ2_0", 256, 66},   {39, "MXFP4", 32, 17},
};

constexpr uint64_t kMaxDims = 4;  // GGML_MAX_DIMS

const char* type_name(GgufType t) {
  static const char* names[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                "bool", "string", "array", "u64", "i64", "f64"};
  const auto i = static_cast<uint32_t>(t);
  return i < 13 ? names[i] : "?";
}

std::string errno_str() {
  return std::strerror(errno);
}

class Cursor {
 public:
  Cursor(const uint8_t* p, uint64_t size, const std::string& path) : p_(p), size_(size), path_(path) {}
  [[noreturn]] void fail(const std::string& msg) const {
    throw std::runtime_error("gguf " + path_ + ": " + msg + " (at byte " + std::to_string(pos_) + ")");
  }
  uint64_t pos() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }
  void need(uint64_t n, const std::string& what) const {
    if (n > left())
      fail(what + " needs " + std::to_string(n) + " bytes, " + std::to_string(left()) + " left: truncated file?");
  }
  template <typename T>
  T read(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string str(const std::string& what) {
    const uint64_t n = read<uint64_t>(what + " length");
    need(n, what);
    std::string s(reinterpret_cast<const char*>(p_ + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  const uint8_t* p_;
  uint64_t size_, pos_ = 0;
  const std::string& path_;
};

// Smallest encoding of one value of type t (bounds array counts before allocating).
uint64_t min_bytes(GgufType t) {
  switch (t) {
    case GgufType::U8:
    case GgufType::I8:
    case GgufType::Bool:
      return 1;
    case GgufType::U16:
    case GgufType::I16:
      return 2;
    case GgufType::U32:
    case GgufType::I32:
    case GgufType::F32:
      return 4;
    case GgufType::String:  // a length
    case GgufType::U64:
    case GgufType::I64:
    case GgufType::F64:
      return 8;
    case GgufType::Array:  // element type + count
      return 12;
  }
  return 1;
}

GgufValue read_value(Cursor& c, GgufType t, const std::string& key, int depth) {
  GgufValue out;
  out.type = t;
  switch (t) {
    case GgufType::U8:
      out.v = uint64_t{c.read<uint8_t>(key)};
      break;
    case GgufType::I8:
      out.v = int64_t{c.read<int8_t>(key)};
      break;
    case GgufType::U16:
      out.v = uint64_t{c.read<uint16_t>(key)};
      break;
    case GgufType::I16:
      out.v = int64_t{c.read<int16_t>(key)};
      break;
    case GgufType::U32:
      out.v = uint64_t{c.read<uint32_t>(key)};
      break;
    case GgufType::I32:
      out.v = int64_t{c.read<int32_t>(key)};
      break;
    case GgufType::U64:
      out.v = c.read<uint64_t>(key);
      break;
    case GgufType::I64:
      out.v = c.read<int64_t>(key);
      break;
    case GgufType::F32:
      out.v = double{c.read<float>(key)};
      break;
    case GgufType::F64:
      out.v = c.read<double>(key);
      break;
    case GgufType::Bool: {
      const uint8_t b = c.read<uint8_t>(key);
      if (b > 1) c.fail("key " + key + ": bool value " + std::to_string(b));
      out.v = b == 1;
      break;
    }
    case GgufType::String:
      out.v = c.str("key " + key + " value");
      break;
    case GgufType::Array: {
      if (depth > 0) c.fail("key " + key + ": arrays of arrays are not supported");
      const uint32_t et = c.read<uint32_t>("key " + key + " array type");
      if (et > 12) c.fail("key " + key + ": unknown array element type " + std::to_string(et));
      const auto elem = static_cast<GgufType>(et);
      const uint64_t n = c.read<uint64_t>("key " + key + " array length");
      if (n > c.left() / min_bytes(elem))
        c.fail("key " + key + ": array of " + std::to_string(n) + " " + type_name(elem) + " values cannot fit in the " +
               std::to_string(c.left()) + " bytes left");
      GgufArray a;
      a.elem = elem;
      a.items.reserve(n);
      for (uint64_t i = 0; i < n; ++i) a.items.push_back(read_value(c, elem, key, depth + 1));
      out.v = std::move(a);
      break;
    }
  }
  return out;
}

}  // namespace

namespace {
// The ggml types that are hypic dtypes (the rest are read as bytes only).
constexpr std::pair<uint32_t, DType> kDtypes[] = {{0, DType::F32},  {1, DType::F16},  {30, DType::BF16},
                                                  {28, DType::F64}, {8, DType::Q8_0}, {12, DType::Q4_K},
                                                  {14, DType::Q6_K}};
}  // namespace

std::optional<DType> dtype_of_ggml(uint32_t id) {
  for (const auto& [i, dt] : kDtypes)
    if (i == id) return dt;
  return std::nullopt;
}

std::optional<uint32_t> ggml_id_of(DType dt) {
  for (const auto& [i, d] : kDtypes)
    if (d == dt) return i;
  return std::nullopt;
}

const GgmlType* ggml_type(uint32_t id) {
  for (const auto& t : kTypes)
    if (t.id == id) return &t;
  return nullptr;
}

Shape GgufTensorInfo::shape() const {
  return Shape(ne.rbegin(), ne.rend());
}

GgufFile::GgufFile(const std::string& path) : path_(path) {
  auto fail = [&](const std::string& msg) -> void { throw std::runtime_error("gguf " + path + ": " + msg); };
  // O_NONBLOCK: opening a FIFO must not hang; anything but a regular file is refused below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail("cannot open: " + errno_str());
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("not a regular file");
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ < 24) {
    ::close(fd);
    fail("file is " + std::to_string(size_) + " bytes, shorter than the 24-byte header");
  }
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const std::string map_err = p == MAP_FAILED ? errno_str() : "";
  ::close(fd);
  if (p == MAP_FAILED) fail("mmap failed: " + map_err);
  const uint64_t sz = size_;
  map_ = std::make_shared<Storage>(p, size_, Device{}, [sz](void* q) { ::munmap(q, sz); });
  const auto* bytes = static_cast<const uint8_t*>(p);

  Cursor c(bytes, size_, path_);
  if (std::memcmp(bytes, "GGUF", 4) != 0) fail("bad magic (not a GGUF file)");
  c.read<uint32_t>("magic");
  version_ = c.read<uint32_t>("version");
  if (version_ != 2 && version_ != 3) fail("version " + std::to_string(version_) + " is not supported (2 and 3 are)");
  const uint64_t n_tensors = c.read<uint64_t>("tensor count");
  const uint64_t n_kv = c.read<uint64_t>("metadata count");
  // Each entry takes at least a string length and a type; more than the file can hold is damage.
  if (n_kv > c.left() / 12) fail("metadata count " + std::to_string(n_kv) + " cannot fit in the file");
  if (n_tensors > c.left() / 28) fail("tensor count " + std::to_string(n_tensors) + " cannot fit in the file");

  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = c.str("metadata key " + std::to_string(i));
    const uint32_t t = c.read<uint32_t>("key " + key + " type");
    if (t > 12) c.fail("key " + key + ": unknown value type " + std::to_string(t));
    GgufValue v = read_value(c, static_cast<GgufType>(t), key, 0);
    if (!kv_.emplace(key, std::move(v)).second) c.fail("key " + key + " appears twice");
  }
  if (auto it = kv_.find("general.alignment"); it != kv_.end()) {
    if (it->second.type != GgufType::U32) fail("general.alignment must be u32");
    alignment_ = std::get<uint64_t>(it->second.v);
    if (alignment_ == 0 || (alignment_ & (alignment_ - 1)) != 0)
      fail("general.alignment " + std::to_string(alignment_) + " is not a power of two");
  }

  tensors_.reserve(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    t.name = c.str("tensor name " + std::to_string(i));
    const std::string at = "tensor " + t.name;
    const uint32_t nd = c.read<uint32_t>(at + " dimension count");
    if (nd == 0 || nd > kMaxDims) c.fail(at + ": " + std::to_string(nd) + " dimensions (1 to 4 allowed)");
    uint64_t n = 1;
    for (uint32_t d = 0; d < nd; ++d) {
      const uint64_t e = c.read<uint64_t>(at + " dimension");
      if (e == 0 || e > (uint64_t(1) << 40) || n > (uint64_t(1) << 50) / e)
        c.fail(at + ": dimension " + std::to_string(e) + " out of range");
      n *= e;
      t.ne.push_back(static_cast<int64_t>(e));
    }
    const uint32_t ty = c.read<uint32_t>(at + " type");
    t.type = ggml_type(ty);
    if (!t.type) c.fail(at + ": unknown ggml type " + std::to_string(ty));
    if (t.ne[0] % t.type->block != 0)
      c.fail(at + ": row of " + std::to_string(t.ne[0]) + " elements is not whole " + t.type->name + " blocks of " +
             std::to_string(t.type->block));
    t.bytes = n / static_cast<uint64_t>(t.type->block) * static_cast<uint64_t>(t.type->block_bytes);
    t.offset = c.read<uint64_t>(at + " offset");
    if (t.offset % alignment_ != 0)
      c.fail(at + ": offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
             std::to_string(alignment_));
    if (!index_.emplace(t.name, tensors_.size()).second) c.fail(at + " appears twice");
    tensors_.push_back(std::move(t));
  }
  data_offset_ = (c.pos() + alignment_ - 1) / alignment_ * alignment_;
  if (n_tensors > 0 && data_offset_ > size_) fail("the data section starts past the end of the file: truncated?");
  const uint64_t data_size = size_ - std::min(data_offset_, size_);
  // Data inside the section and not overlapping.
  std::vector<const GgufTensorInfo*> by_offset;
  for (const auto& t : tensors_) {
    if (t.offset > data_size || t.bytes > data_size - t.offset)
      fail("tensor " + t.name + ": data [" + std::to_string(t.offset) + ", " + std::to_string(t.offset + t.bytes) +
           ") runs past the end of the data section (" + std::to_string(data_size) + " bytes): truncated file?");
    by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->offset < by_offset[i - 1]->offset + by_offset[i - 1]->bytes)
      fail("tensors " + by_offset[i - 1]->name + " and " + by_offset[i]->name + " overlap");
}

namespace {
const GgufValue& lookup(const std::map<std::string, GgufValue>& kv, const std::string& path, const std::string& key) {
  auto it = kv.find(key);
  if (it == kv.end()) throw std::runtime_error("gguf " + path + ": missing key " + key);
  return it->second;
}
[[noreturn]] void wrong_type(const std::string& path, const std::string& key, GgufType t, const char* want) {
  throw std::runtime_error("gguf " + path + ": key " + key + " is " + type_name(t) + ", expected " + want);
}
}  // namespace

std::string GgufFile::get_string(const std::string& key) const {
  const auto& v = lookup(kv_, path_, key);
  if (v.type != GgufType::String) wrong_type(path_, key, v.type, "a string");
  return std::get<std::string>(v.v);
}

int64_t GgufFile::get_int(const std::string& key) const {
  const auto& v = lookup(kv_, path_, key);
  if (const auto* u = std::get_if<uint64_t>(&v.v)) {
    if (*u > static_cast<uint64_t>(INT64_MAX)) wrong_type(path_, key, v.type, "an integer within int64");
    return static_cast<int64_t>(*u);
  }
  if (const auto* i = std::get_if<int64_t>(&v.v)) return *i;
  wrong_type(path_, key, v.type, "an integer");
}

double GgufFile::get_float(const std::string& key) const {
  const auto& v = lookup(kv_, path_, key);
  if (const auto* d = std::get_if<double>(&v.v)) return *d;
  if (const auto* u = std::get_if<uint64_t>(&v.v)) return static_cast<double>(*u);
  if (const auto* i = std::get_if<int64_t>(&v.v)) return static_cast<double>(*i);
  wrong_type(path_, key, v.type, "a number");
}

const GgufArray& GgufFile::get_array(const std::string& key) const {
  const auto& v = lookup(kv_, path_, key);
  if (v.type != GgufType::Array) wrong_type(path_, key, v.type, "an array");
  return std::get<GgufArray>(v.v);
}

const GgufTensorInfo* GgufFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const uint8_t* GgufFile::data(const GgufTensorInfo& t) const {
  return static_cast<const uint8_t*>(map_->data()) + data_offset_ + t.offset;
}

Tensor GgufFile::get(const std::string& name) const {
  const GgufTensorInfo* t = find(name);
  if (!t) throw std::runtime_error("gguf " + path_ + ": missing tensor " + name);
  const std::optional<DType> d = dtype_of_ggml(t->type->id);
  if (!d)
    throw std::runtime_error("gguf " + path_ + ": tensor " + name + " is " + t->type->name +
                             "; hypic reads F32, F16, BF16, F64, Q8_0, Q4_K and Q6_K tensors");
  const DType dt = *d;
  // Quantized blocks are packed structs, read without alignment.
  if (!dtype_is_quantized(dt) && (data_offset_ + t->offset) % dtype_size(dt) != 0)
    throw std::runtime_error("gguf " + path_ + ": tensor " + name + " is misaligned for its type");
  return Tensor(map_, static_cast<size_t>(data_offset_ + t->offset), dt, t->shape());
}

}  // namespace hypic
