#include "pic/entry_codec.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <bit>
#include <cstring>
#include <iterator>
#include <vector>

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

// The fields both forms share: magic, version, key, counts (put_head / get_head) and each
// tensor's record up to its size (put_record / get_record), every value bounded before use.
uint32_t tensor_count(const SegmentEntry& e) {
  uint32_t n = 0;
  for (const auto& l : e.layers)
    for (int f = 0; f < kFields; ++f) n += field_of(l, f).defined() ? 1 : 0;
  return n;
}

void put_head(Writer& w, const char* magic, uint32_t version, const SegmentEntry& e) {
  w.put(magic, 8);
  w.put(version);
  w.put(uint32_t{0});
  w.put(e.key.model_fingerprint);
  w.put(e.key.seam);
  w.put(e.key.tail);
  w.put(static_cast<uint32_t>(e.key.ids.size()));
  w.put(e.key.ids.data(), e.key.ids.size() * 4);
  w.put(static_cast<uint32_t>(e.layers.size()));
  w.put(tensor_count(e));
}

// Fills e's key and layer count; returns the tensor count.
uint32_t get_head(Reader& r, const char* magic, uint32_t version, const char* what, SegmentEntry& e) {
  char m[8];
  r.read(m, 8, "magic");
  if (std::memcmp(m, magic, 8) != 0) throw EntryFormatError(std::string("not ") + what + " (bad magic)");
  const auto v = r.get<uint32_t>("version");
  if (v != version)
    throw EntryFormatError("unsupported format version " + std::to_string(v) + " (this build reads " +
                           std::to_string(version) + ")");
  if (r.get<uint32_t>("reserved") != 0) throw EntryFormatError("reserved header field is not zero");
  e.key.model_fingerprint = r.get<uint64_t>("model fingerprint");
  e.key.seam = r.get<int32_t>("seam");
  e.key.tail = r.get<int32_t>("tail seam");
  const auto n_ids = r.get<uint32_t>("id count");
  if (uint64_t{n_ids} * 4 > r.remaining()) throw EntryFormatError("truncated: " + std::to_string(n_ids) + " token ids");
  e.key.ids.resize(n_ids);
  r.read(e.key.ids.data(), size_t{n_ids} * 4, "token ids");
  const auto n_layers = r.get<uint32_t>("layer count");
  const auto n_tensors = r.get<uint32_t>("tensor count");
  if (n_layers > kMaxLayers) throw EntryFormatError("implausible layer count " + std::to_string(n_layers));
  if (n_tensors > n_layers * kFields) throw EntryFormatError("implausible tensor count " + std::to_string(n_tensors));
  e.layers.resize(n_layers);
  return n_tensors;
}

void put_record(Writer& w, size_t layer, int f, const Tensor& t) {
  w.put(static_cast<uint32_t>(layer));
  const size_t len = std::strlen(kStateTensorNames[f]);
  w.put(static_cast<uint8_t>(len));
  w.put(kStateTensorNames[f], len);
  const uint8_t b[3] = {static_cast<uint8_t>(t.dtype()), static_cast<uint8_t>(t.shape().size()), 0};
  w.put(b, 3);
  for (int64_t d : t.shape()) w.put(d);
  w.put(static_cast<uint64_t>(t.nbytes()));
}

struct Record {
  std::string where;  // "tensor i", for messages
  Tensor* dst;        // the entry's (still undefined) tensor this record fills
  DType dt;
  Shape shape;
  uint64_t nbytes;
};

Record get_record(Reader& r, uint32_t i, SegmentEntry& e) {
  Record rec;
  rec.where = "tensor " + std::to_string(i);
  const std::string& where = rec.where;
  const auto n_layers = static_cast<uint32_t>(e.layers.size());
  const auto layer = r.get<uint32_t>("tensor layer");
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
  rec.shape.resize(b[1]);
  uint64_t numel = 1;
  for (auto& d : rec.shape) {
    d = r.get<int64_t>("tensor shape");
    if (d < 0 || d > kMaxDim || __builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel))
      throw EntryFormatError(where + ": bad shape");
  }
  rec.dt = static_cast<DType>(b[0]);
  rec.nbytes = r.get<uint64_t>("tensor size");
  uint64_t expect;
  if (__builtin_mul_overflow(numel, uint64_t{dtype_size(rec.dt)}, &expect) || rec.nbytes != expect)
    throw EntryFormatError(where + ": size " + std::to_string(rec.nbytes) + " does not match " + dtype_name(rec.dt) +
                           shape_str(rec.shape));
  rec.dst = &field_of(e.layers[layer], field);
  if (rec.dst->defined())
    throw EntryFormatError(where + ": layer " + std::to_string(layer) + " tensor " + kStateTensorNames[field] +
                           " given twice");
  return rec;
}

void get_checksum(Reader& r) {
  const uint64_t want = r.digest();
  uint64_t sum;
  r.read(&sum, 8, "checksum", /*hash=*/false);
  if (sum != want)
    throw EntryFormatError(fmt::format("checksum mismatch (stored {:016x}, computed {:016x})", sum, want));
  if (r.remaining() != 0) throw EntryFormatError(std::to_string(r.remaining()) + " trailing bytes after the checksum");
}

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
  put_head(w, kMagic, kEntryFormatVersion, e);
  for (size_t li = 0; li < e.layers.size(); ++li)
    for (int f = 0; f < kFields; ++f) {
      const Tensor& t = field_of(e.layers[li], f);
      if (!t.defined()) continue;
      Tensor host = be.to_host(t);
      put_record(w, li, f, host);
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
  const uint32_t n_tensors = get_head(r, kMagic, kEntryFormatVersion, "a hypic segment entry", *e);
  for (uint32_t i = 0; i < n_tensors; ++i) {
    Record rec = get_record(r, i, *e);
    if (rec.nbytes > r.remaining())
      throw EntryFormatError("truncated: " + rec.where + " needs " + std::to_string(rec.nbytes) + " bytes");
    Tensor host = Tensor::uninitialized(rec.dt, rec.shape);  // read in full below
    r.read(host.raw(), rec.nbytes, "tensor data");
    *rec.dst = host;
  }
  get_checksum(r);
  e->account();
  return e;
}

std::shared_ptr<SegmentEntry> decode_entry(std::string_view bytes) {
  ViewSource src(bytes);
  return decode_entry(src);
}

namespace {
constexpr char kSharedMagic[8] = {'H', 'Y', 'P', 'I', 'C', 'I', 'P', 'C'};
constexpr uint64_t kSharedAlign = 256;  // each tensor's offset in the shared buffer
constexpr uint32_t kMaxHandle = 4096;
}  // namespace

std::optional<SharedEntry> share_entry(const SegmentEntry& e, Backend& be) {
  std::vector<const Tensor*> ts;
  std::vector<uint64_t> offsets;
  uint64_t bytes = 0;
  for (const auto& l : e.layers)
    for (int f = 0; f < kFields; ++f)
      if (const Tensor& t = field_of(l, f); t.defined()) {
        ts.push_back(&t);
        offsets.push_back(bytes);
        bytes += (t.nbytes() + kSharedAlign - 1) / kSharedAlign * kSharedAlign;
      }
  auto shared = be.share(ts, offsets, bytes);
  if (!shared) return std::nullopt;
  SharedEntry out;
  out.keep = std::move(shared->keep);
  out.payload_bytes = bytes;
  StringSink sink(out.descriptor);
  Writer w(sink);
  put_head(w, kSharedMagic, kSharedFormatVersion, e);
  size_t k = 0;
  for (size_t li = 0; li < e.layers.size(); ++li)
    for (int f = 0; f < kFields; ++f) {
      const Tensor& t = field_of(e.layers[li], f);
      if (!t.defined()) continue;
      put_record(w, li, f, t);
      w.put(offsets[k++]);
    }
  w.put(bytes);
  w.put(be.payload_checksum(ts, offsets));
  w.put(static_cast<uint32_t>(shared->handle.size()));
  w.put(shared->handle.data(), shared->handle.size());
  const uint64_t sum = w.digest();
  w.put(&sum, 8, /*hash=*/false);
  return out;
}

std::shared_ptr<SegmentEntry> receive_shared_entry(std::string_view descriptor, Backend& be) {
  ViewSource src(descriptor);
  Reader r(src);
  auto e = std::make_shared<SegmentEntry>();
  const uint32_t n_tensors = get_head(r, kSharedMagic, kSharedFormatVersion, "a shared hypic segment entry", *e);
  std::vector<Record> recs;
  std::vector<uint64_t> offsets;
  for (uint32_t i = 0; i < n_tensors; ++i) {
    recs.push_back(get_record(r, i, *e));
    offsets.push_back(r.get<uint64_t>("tensor offset"));
    // A record's dst is only marked once filled: two records of one tensor are caught here.
    for (size_t j = 0; j + 1 < recs.size(); ++j)
      if (recs[j].dst == recs.back().dst) throw EntryFormatError(recs.back().where + ": a tensor given twice");
  }
  const auto bytes = r.get<uint64_t>("payload size");
  const auto checksum = r.get<uint64_t>("payload checksum");
  const auto handle_len = r.get<uint32_t>("handle length");
  if (handle_len == 0 || handle_len > kMaxHandle || handle_len > r.remaining())
    throw EntryFormatError("bad handle length " + std::to_string(handle_len));
  std::string handle(handle_len, '\0');
  r.read(handle.data(), handle_len, "handle");
  get_checksum(r);
  // Pieces inside the buffer, aligned, in order and apart: a descriptor cannot make two tensors
  // share bytes or reach past what the worker shared.
  uint64_t end = 0;
  for (size_t i = 0; i < recs.size(); ++i) {
    if (offsets[i] % 4 != 0 || offsets[i] < end || offsets[i] > bytes || recs[i].nbytes > bytes - offsets[i])
      throw EntryFormatError(recs[i].where + ": offset " + std::to_string(offsets[i]) + " (" +
                             std::to_string(recs[i].nbytes) + " bytes) outside the shared buffer of " +
                             std::to_string(bytes) + " bytes");
    end = offsets[i] + recs[i].nbytes;
  }
  if (const int64_t free = be.free_memory_bytes(); free >= 0 && bytes > static_cast<uint64_t>(free))
    throw EntryFormatError("the entry claims " + std::to_string(bytes) + " bytes, more than the device has free (" +
                           std::to_string(free) + ")");
  std::vector<Tensor> dst;
  std::vector<const Tensor*> views;
  for (auto& rec : recs) dst.push_back(be.alloc_uninit(rec.dt, rec.shape));
  be.copy_from_shared(handle, bytes, offsets, dst);
  for (auto& t : dst) views.push_back(&t);
  if (const uint64_t got = be.payload_checksum(views, offsets); got != checksum)
    throw EntryFormatError(fmt::format("payload checksum mismatch (stated {:016x}, computed {:016x})", checksum, got));
  for (size_t i = 0; i < recs.size(); ++i) *recs[i].dst = std::move(dst[i]);
  e->account();
  return e;
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
