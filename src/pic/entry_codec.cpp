#include "pic/entry_codec.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <bit>
#include <cstring>
#include <iterator>

#include "backend/backend.h"

namespace hypic {

static_assert(std::endian::native == std::endian::little, "the entry format is little-endian");

namespace {

constexpr char kMagic[8] = {'H', 'Y', 'P', 'I', 'C', 'S', 'E', 'G'};
constexpr int kFields = 9;  // LayerSummary::tensors()
static_assert(std::size(kStateTensorNames) == kFields);
constexpr size_t kMaxName = 64;
constexpr uint32_t kMaxLayers = 1u << 16;
constexpr uint8_t kMaxDims = 8;
constexpr int64_t kMaxDim = int64_t{1} << 40;
constexpr int kDTypes = static_cast<int>(DType::U8) + 1;

Tensor& field_of(LayerSummary& l, int f) {
  return *l.tensors()[static_cast<size_t>(f)];
}
const Tensor& field_of(const LayerSummary& l, int f) {
  return *l.tensors()[static_cast<size_t>(f)];
}
int field_named(std::string_view name) {
  for (int f = 0; f < kFields; ++f)
    if (name == kStateTensorNames[f]) return f;
  return -1;
}

class Hasher {
 public:
  Hasher() : s_(XXH64_createState()) { XXH64_reset(s_, 0); }
  ~Hasher() { XXH64_freeState(s_); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  void update(const void* p, size_t n) { XXH64_update(s_, p, n); }
  uint64_t digest() const { return XXH64_digest(s_); }

 private:
  XXH64_state_t* s_;
};

// Never reads past the end; hashes as it goes.
class Reader {
 public:
  explicit Reader(ByteSource& in) : in_(in), size_(in.size()) {}
  uint64_t remaining() const { return size_ - off_; }
  void read(void* dst, size_t n, const char* what, bool hash = true) {
    if (n > remaining())
      throw EntryFormatError("truncated: " + std::string(what) + " needs " + std::to_string(n) + " bytes at offset " +
                             std::to_string(off_) + ", the entry has " + std::to_string(size_));
    in_.read(dst, n);
    if (hash) h_.update(dst, n);
    off_ += n;
  }
  template <typename T>
  T get(const char* what) {
    T v;
    read(&v, sizeof(T), what);
    return v;
  }
  uint64_t digest() const { return h_.digest(); }

 private:
  ByteSource& in_;
  uint64_t size_, off_ = 0;
  Hasher h_;
};

class Writer {
 public:
  explicit Writer(ByteSink& out) : out_(out) {}
  void put(const void* p, size_t n, bool hash = true) {
    if (hash) h_.update(p, n);
    out_.write(p, n);
  }
  template <typename T>
  void put(const T& v) {
    put(&v, sizeof(T));
  }
  uint64_t digest() const { return h_.digest(); }

 private:
  ByteSink& out_;
  Hasher h_;
};

class StringSink final : public ByteSink {
 public:
  explicit StringSink(std::string& s) : s_(s) {}
  void write(const void* p, size_t n) override { s_.append(static_cast<const char*>(p), n); }

 private:
  std::string& s_;
};

class ViewSource final : public ByteSource {
 public:
  explicit ViewSource(std::string_view v) : v_(v) {}
  uint64_t size() const override { return v_.size(); }
  void read(void* dst, size_t n) override {
    std::memcpy(dst, v_.data() + off_, n);
    off_ += n;
  }

 private:
  std::string_view v_;
  size_t off_ = 0;
};

}  // namespace

size_t encoded_entry_size(const SegmentEntry& e) {
  size_t n = 8 + 4 + 4 + 8 + 4 + 4 + 4 + 4 * e.key.ids.size() + 4 + 4;  // ..seam, tail, n_ids, ids, counts
  for (const auto& l : e.layers)
    for (int f = 0; f < kFields; ++f) {
      const Tensor& t = field_of(l, f);
      if (t.defined()) n += 4 + 1 + std::strlen(kStateTensorNames[f]) + 3 + 8 * t.shape().size() + 8 + t.nbytes();
    }
  return n + 8;
}

void encode_entry(const SegmentEntry& e, Backend& be, ByteSink& out) {
  Writer w(out);
  w.put(kMagic, 8);
  w.put(kEntryFormatVersion);
  w.put(uint32_t{0});
  w.put(e.key.model_fingerprint);
  w.put(e.key.seam);
  w.put(e.key.tail);
  w.put(static_cast<uint32_t>(e.key.ids.size()));
  w.put(e.key.ids.data(), e.key.ids.size() * 4);
  uint32_t n_tensors = 0;
  for (const auto& l : e.layers)
    for (int f = 0; f < kFields; ++f) n_tensors += field_of(l, f).defined() ? 1 : 0;
  w.put(static_cast<uint32_t>(e.layers.size()));
  w.put(n_tensors);
  for (size_t li = 0; li < e.layers.size(); ++li)
    for (int f = 0; f < kFields; ++f) {
      const Tensor& t = field_of(e.layers[li], f);
      if (!t.defined()) continue;
      Tensor host = be.to_host(t);
      w.put(static_cast<uint32_t>(li));
      const size_t len = std::strlen(kStateTensorNames[f]);
      w.put(static_cast<uint8_t>(len));
      w.put(kStateTensorNames[f], len);
      const uint8_t b[3] = {static_cast<uint8_t>(host.dtype()), static_cast<uint8_t>(host.shape().size()), 0};
      w.put(b, 3);
      for (int64_t d : host.shape()) w.put(d);
      w.put(static_cast<uint64_t>(host.nbytes()));
      w.put(host.raw(), host.nbytes());
    }
  const uint64_t sum = w.digest();
  w.put(&sum, 8, /*hash=*/false);
}

std::string encode_entry(const SegmentEntry& e, Backend& be) {
  std::string s;
  s.reserve(encoded_entry_size(e));
  StringSink sink(s);
  encode_entry(e, be, sink);
  return s;
}

std::shared_ptr<SegmentEntry> decode_entry(ByteSource& in) {
  Reader r(in);
  auto e = std::make_shared<SegmentEntry>();
  char magic[8];
  r.read(magic, 8, "magic");
  if (std::memcmp(magic, kMagic, 8) != 0) throw EntryFormatError("not a hypic segment entry (bad magic)");
  const auto version = r.get<uint32_t>("version");
  if (version != kEntryFormatVersion)
    throw EntryFormatError("unsupported format version " + std::to_string(version) + " (this build reads " +
                           std::to_string(kEntryFormatVersion) + ")");
  if (r.get<uint32_t>("reserved") != 0) throw EntryFormatError("reserved header field is not zero");
  e->key.model_fingerprint = r.get<uint64_t>("model fingerprint");
  e->key.seam = r.get<int32_t>("seam");
  e->key.tail = r.get<int32_t>("tail seam");
  const auto n_ids = r.get<uint32_t>("id count");
  if (uint64_t{n_ids} * 4 > r.remaining()) throw EntryFormatError("truncated: " + std::to_string(n_ids) + " token ids");
  e->key.ids.resize(n_ids);
  r.read(e->key.ids.data(), size_t{n_ids} * 4, "token ids");
  const auto n_layers = r.get<uint32_t>("layer count");
  const auto n_tensors = r.get<uint32_t>("tensor count");
  if (n_layers > kMaxLayers) throw EntryFormatError("implausible layer count " + std::to_string(n_layers));
  if (n_tensors > n_layers * kFields) throw EntryFormatError("implausible tensor count " + std::to_string(n_tensors));
  e->layers.resize(n_layers);
  for (uint32_t i = 0; i < n_tensors; ++i) {
    const auto layer = r.get<uint32_t>("tensor layer");
    const std::string where = "tensor " + std::to_string(i);
    if (layer >= n_layers) throw EntryFormatError(where + ": layer " + std::to_string(layer) + " out of range");
    const auto len = r.get<uint8_t>("tensor name length");
    if (len == 0 || len > kMaxName) throw EntryFormatError(where + ": bad name length " + std::to_string(len));
    char name_buf[kMaxName];
    r.read(name_buf, len, "tensor name");
    const std::string_view name(name_buf, len);
    const int field = field_named(name);
    if (field < 0) {
      std::string shown;
      for (char ch : name) shown += ch >= 0x20 && ch < 0x7f ? ch : '?';
      throw EntryFormatError(where + ": unknown state tensor '" + shown + "' (written by a newer hypic?)");
    }
    uint8_t b[3];
    r.read(b, 3, "tensor header");
    if (b[0] >= kDTypes) throw EntryFormatError(where + ": bad dtype " + std::to_string(b[0]));
    if (b[1] > kMaxDims) throw EntryFormatError(where + ": bad rank " + std::to_string(b[1]));
    if (b[2] != 0) throw EntryFormatError(where + ": reserved byte is not zero");
    Shape shape(b[1]);
    uint64_t numel = 1;
    for (auto& d : shape) {
      d = r.get<int64_t>("tensor shape");
      if (d < 0 || d > kMaxDim || __builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel))
        throw EntryFormatError(where + ": bad shape");
    }
    const DType dt = static_cast<DType>(b[0]);
    const auto nbytes = r.get<uint64_t>("tensor size");
    uint64_t expect;
    if (__builtin_mul_overflow(numel, uint64_t{dtype_size(dt)}, &expect) || nbytes != expect)
      throw EntryFormatError(where + ": size " + std::to_string(nbytes) + " does not match " + dtype_name(dt) +
                             shape_str(shape));
    if (nbytes > r.remaining())
      throw EntryFormatError("truncated: " + where + " needs " + std::to_string(nbytes) + " bytes");
    Tensor& dst = field_of(e->layers[layer], field);
    if (dst.defined())
      throw EntryFormatError(where + ": layer " + std::to_string(layer) + " tensor " + kStateTensorNames[field] +
                             " given twice");
    Tensor host = Tensor::uninitialized(dt, shape);  // read in full below
    r.read(host.raw(), nbytes, "tensor data");
    dst = host;
  }
  const uint64_t want = r.digest();
  uint64_t sum;
  r.read(&sum, 8, "checksum", /*hash=*/false);
  if (sum != want)
    throw EntryFormatError(fmt::format("checksum mismatch (stored {:016x}, computed {:016x})", sum, want));
  if (r.remaining() != 0) throw EntryFormatError(std::to_string(r.remaining()) + " trailing bytes after the checksum");
  e->account();
  return e;
}

std::shared_ptr<SegmentEntry> decode_entry(std::string_view bytes) {
  ViewSource src(bytes);
  return decode_entry(src);
}

std::string key_difference(const SegmentKey& want, const SegmentKey& got) {
  if (want == got) return "";
  if (want.model_fingerprint != got.model_fingerprint)
    return fmt::format("written by another model (fingerprint {:016x}, expected {:016x})", got.model_fingerprint,
                       want.model_fingerprint);
  if (want.seam != got.seam) return fmt::format("holds seam {} (expected {})", got.seam, want.seam);
  if (want.tail != got.tail) return fmt::format("holds tail seam {} (expected {})", got.tail, want.tail);
  return fmt::format("holds another segment ({} token ids, expected {}; ids differ)", got.ids.size(), want.ids.size());
}

}  // namespace hypic
