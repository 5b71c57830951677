// Safetensors reading (mmap) and writing. Format: 8-byte little-endian header length N, then N
// bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {..}}, then
// the data section; offsets are relative to the start of the data section.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

namespace hypic {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // real headers are a few MB at most

[[noreturn]] void fail(const std::string& path, const std::string& msg) {
  throw std::runtime_error("safetensors " + path + ": " + msg);
}

const char* st_dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "F32";
    case DType::F16:
      return "F16";
    case DType::BF16:
      return "BF16";
    case DType::F64:
      return "F64";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
    case DType::U8:
      return "U8";
  }
  return "?";
}

bool parse_st_dtype(const std::string& s, DType& out) {
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::F64, DType::I32, DType::I64, DType::U8}) {
    if (s == st_dtype_name(t)) {
      out = t;
      return true;
    }
  }
  return false;
}

// Reads a non-negative integer that fits in uint64; false for anything else (floats, negatives).
bool as_u64(const json& v, uint64_t& out) {
  if (v.is_number_unsigned()) {
    out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer()) {
    int64_t x = v.get<int64_t>();
    if (x < 0) return false;
    out = static_cast<uint64_t>(x);
    return true;
  }
  return false;
}

std::string errno_str() {
  return std::strerror(errno);
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, "cannot open: " + errno_str());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    std::string e = errno_str();
    ::close(fd);
    fail(path, "cannot stat: " + e);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "not a regular file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail(path, "file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  }
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  std::string map_err = p == MAP_FAILED ? errno_str() : "";
  ::close(fd);  // the mapping stays valid after close
  if (p == MAP_FAILED) fail(path, "mmap failed: " + map_err);
  map_ = std::make_shared<Storage>(p, size, Device{}, [size](void* q) { ::munmap(q, size); });

  const auto* bytes = static_cast<const unsigned char*>(p);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > kMaxHeaderBytes)
    fail(path, "header length " + std::to_string(header_len) + " is absurd (limit " + std::to_string(kMaxHeaderBytes) +
                   " bytes); not a safetensors file?");
  if (header_len > size - 8)
    fail(path, "header length " + std::to_string(header_len) + " runs past the end of the file (" +
                   std::to_string(size) + " bytes); truncated file?");
  data_offset_ = 8 + header_len;
  const uint64_t data_size = size - data_offset_;

  json header;
  try {
    header = json::parse(reinterpret_cast<const char*>(bytes + 8), reinterpret_cast<const char*>(bytes + data_offset_));
  } catch (const json::exception& e) {
    fail(path, std::string("malformed JSON header: ") + e.what());
  }
  if (!header.is_object()) fail(path, "JSON header is not an object");

  struct Span {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Span> spans;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(path, "'__metadata__' must be an object");
      continue;
    }
    auto bad = [&](const std::string& msg) { fail(path, "tensor '" + name + "': " + msg); };
    if (!v.is_object()) bad("header entry is not an object");
    if (!v.contains("dtype")) bad("missing field 'dtype'");
    if (!v.contains("shape")) bad("missing field 'shape'");
    if (!v.contains("data_offsets")) bad("missing field 'data_offsets'");
    const json& jd = v["dtype"];
    if (!jd.is_string()) bad("field 'dtype' is not a string");
    Entry e{};
    if (!parse_st_dtype(jd.get<std::string>(), e.dtype))
      bad("unsupported dtype '" + jd.get<std::string>() + "' (supported: F32, F16, BF16, F64, I32, I64, U8)");
    const json& js = v["shape"];
    if (!js.is_array()) bad("field 'shape' is not an array");
    uint64_t numel = 1;
    bool overflow = false;
    for (const json& d : js) {
      uint64_t x;
      if (!as_u64(d, x) || x > static_cast<uint64_t>(INT64_MAX))
        bad("shape " + js.dump() + " has an invalid dimension");
      e.shape.push_back(static_cast<int64_t>(x));
      overflow |= __builtin_mul_overflow(numel, x, &numel);
    }
    const json& jo = v["data_offsets"];
    uint64_t b = 0, en = 0;
    if (!jo.is_array() || jo.size() != 2 || !as_u64(jo[0], b) || !as_u64(jo[1], en))
      bad("field 'data_offsets' must be [begin, end] with non-negative integers, found " + jo.dump());
    if (en < b) bad("data_offsets " + jo.dump() + " end before begin");
    uint64_t want = 0;
    overflow |= __builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(e.dtype)), &want);
    if (overflow || en - b != want)
      bad("data_offsets " + jo.dump() + " span " + std::to_string(en - b) + " bytes but " + jd.get<std::string>() +
          shape_str(e.shape) + " needs " + (overflow ? std::string("an overflowing number of") : std::to_string(want)) +
          " bytes");
    if (en > data_size)
      bad("data_offsets " + jo.dump() + " run outside the file (data section is " + std::to_string(data_size) +
          " bytes); truncated file?");
    e.begin = static_cast<size_t>(b);
    e.end = static_cast<size_t>(en);
    auto [pos, inserted] = index_.emplace(name, std::move(e));
    (void)inserted;  // nlohmann::json objects cannot hold duplicate keys
    if (b != en) spans.push_back({b, en, &pos->first});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& x, const Span& y) { return x.begin < y.begin; });
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].begin < spans[i - 1].end)
      fail(path, "tensors '" + *spans[i - 1].name + "' and '" + *spans[i].name + "' overlap (bytes [" +
                     std::to_string(spans[i - 1].begin) + ", " + std::to_string(spans[i - 1].end) + ") and [" +
                     std::to_string(spans[i].begin) + ", " + std::to_string(spans[i].end) + "))");
  }
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [k, v] : index_) out.push_back(k);
  return out;
}

Tensor SafetensorsFile::get(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) fail(path_, "no tensor '" + name + "'");
  const Entry& e = it->second;
  const size_t at = data_offset_ + e.begin;  // the mapping itself is page-aligned
  if (at % dtype_size(e.dtype) != 0) {
    // Files written by the safetensors library order tensors so every one is aligned; a file
    // that is not gets an aligned host copy rather than a misaligned view.
    Tensor t = Tensor::empty(e.dtype, e.shape);
    std::memcpy(t.raw(), static_cast<const char*>(map_->data()) + at, e.end - e.begin);
    return t;
  }
  return Tensor(map_, at, e.dtype, e.shape);
}

// ---------------------------------------------------------------------------------------------
// WeightStore

namespace {

std::string join_path(const std::string& dir, const std::string& file) {
  return (fs::path(dir) / file).string();
}

}  // namespace

WeightStore::WeightStore(const std::string& model_dir) : dir_(model_dir) {
  std::error_code ec;
  if (!fs::exists(model_dir, ec)) throw std::runtime_error("model folder " + model_dir + " does not exist");
  if (!fs::is_directory(model_dir, ec)) throw std::runtime_error("model folder " + model_dir + " is not a directory");

  const std::string single = join_path(model_dir, "model.safetensors");
  const std::string index_path = join_path(model_dir, "model.safetensors.index.json");

  auto add_file = [&](const std::string& path, bool register_all) -> size_t {
    files_.push_back(std::make_unique<SafetensorsFile>(path));
    size_t idx = files_.size() - 1;
    if (register_all) {
      for (const auto& n : files_[idx]->names()) {
        auto [it, inserted] = where_.emplace(n, idx);
        if (!inserted)
          throw std::runtime_error("tensor '" + n + "' appears in both " + files_[it->second]->path() + " and " + path);
      }
    }
    return idx;
  };

  if (fs::is_regular_file(single, ec)) {
    add_file(single, true);
  } else if (fs::is_regular_file(index_path, ec)) {
    std::ifstream in(index_path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot open " + index_path);
    std::stringstream ss;
    ss << in.rdbuf();
    json idx;
    try {
      idx = json::parse(ss.str());
    } catch (const json::exception& e) {
      throw std::runtime_error(index_path + ": malformed JSON: " + e.what());
    }
    if (!idx.is_object() || !idx.contains("weight_map") || !idx["weight_map"].is_object())
      throw std::runtime_error(index_path + ": missing object field 'weight_map'");
    std::map<std::string, size_t> shard_idx;  // shard file name -> files_ index
    for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
      if (!it.value().is_string())
        throw std::runtime_error(index_path + ": weight_map entry for '" + it.key() + "' is not a string");
      const std::string shard = it.value().get<std::string>();
      if (shard.empty() || fs::path(shard).is_absolute())
        throw std::runtime_error(index_path + ": weight_map entry for '" + it.key() + "' has invalid shard name '" +
                                 shard + "'");
      auto sit = shard_idx.find(shard);
      if (sit == shard_idx.end()) {
        const std::string shard_path = join_path(model_dir, shard);
        if (!fs::exists(shard_path, ec))
          throw std::runtime_error("shard " + shard_path + " listed in " + index_path + " does not exist");
        sit = shard_idx.emplace(shard, add_file(shard_path, false)).first;
      }
      const SafetensorsFile& f = *files_[sit->second];
      if (!f.has(it.key()))
        throw std::runtime_error("tensor '" + it.key() + "' is mapped to " + f.path() + " by " + index_path +
                                 " but is absent from " + f.path());
      where_.emplace(it.key(), sit->second);
    }
  } else {
    std::vector<std::string> found;
    for (const auto& de : fs::directory_iterator(model_dir, ec)) {
      if (de.path().extension() == ".safetensors" && de.is_regular_file(ec)) found.push_back(de.path().string());
    }
    if (ec) throw std::runtime_error("cannot list " + model_dir + ": " + ec.message());
    std::sort(found.begin(), found.end());
    for (const auto& p : found) add_file(p, true);
  }
  if (files_.empty()) throw std::runtime_error("no safetensors weights in " + model_dir);
}

bool WeightStore::has(const std::string& name) const {
  return where_.count(name) != 0;
}

std::vector<std::string> WeightStore::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [k, v] : where_) out.push_back(k);
  return out;
}

namespace {

std::string missing_message(const std::string& name, const std::string& dir,
                            const std::map<std::string, size_t>& where) {
  // Suggest up to three names sharing the longest common prefix with `name` (names are sorted,
  // so the best candidates cluster around name's insertion point).
  auto common = [&](const std::string& s) {
    size_t n = 0;
    while (n < s.size() && n < name.size() && s[n] == name[n]) ++n;
    return n;
  };
  size_t best = 0;
  for (const auto& [k, v] : where) best = std::max(best, common(k));
  std::vector<std::string> similar;
  if (best > 0) {
    for (const auto& [k, v] : where) {
      if (common(k) == best) similar.push_back(k);
      if (similar.size() == 3) break;
    }
  }
  std::string msg = "missing tensor '" + name + "' in " + dir + " (" + std::to_string(where.size()) + " tensors";
  if (!similar.empty()) {
    msg += "; similar: ";
    for (size_t i = 0; i < similar.size(); ++i) msg += (i ? ", '" : "'") + similar[i] + "'";
  }
  return msg + ")";
}

}  // namespace

Tensor WeightStore::get(const std::string& name, const Shape& expected) const {
  auto it = where_.find(name);
  if (it == where_.end()) throw std::runtime_error(missing_message(name, dir_, where_));
  const SafetensorsFile& f = *files_[it->second];
  Tensor t = f.get(name);
  if (!expected.empty() && t.shape() != expected)
    throw std::runtime_error("tensor '" + name + "' in " + f.path() + ": expected shape " + shape_str(expected) +
                             ", found " + shape_str(t.shape()));
  return t;
}

std::string WeightStore::file_of(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) throw std::runtime_error(missing_message(name, dir_, where_));
  return files_[it->second]->path();
}

size_t WeightStore::total_bytes() const {
  size_t total = 0;
  for (const auto& [name, idx] : where_) total += files_[idx]->get(name).nbytes();
  return total;
}

// ---------------------------------------------------------------------------------------------
// Writing

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) {
    json md = json::object();
    for (const auto& [k, v] : metadata) md[k] = v;
    header["__metadata__"] = md;
  }
  // Data in order of decreasing element size (stable), so that with the 8-byte aligned data
  // section every tensor is aligned to its element size without padding (the format forbids
  // holes in the data section).
  std::vector<const std::pair<std::string, Tensor>*> order;
  for (const auto& p : tensors) order.push_back(&p);
  std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return dtype_size(a->second.dtype()) > dtype_size(b->second.dtype());
  });
  uint64_t offset = 0;
  std::set<std::string> seen;
  for (const auto* p : order) {
    const auto& [name, t] = *p;
    if (name == "__metadata__") throw std::invalid_argument("write_safetensors " + path + ": reserved tensor name");
    if (!seen.insert(name).second)
      throw std::invalid_argument("write_safetensors " + path + ": duplicate tensor name '" + name + "'");
    if (!t.defined()) throw std::invalid_argument("write_safetensors " + path + ": tensor '" + name + "' is undefined");
    if (!t.is_cpu())
      throw std::invalid_argument("write_safetensors " + path + ": tensor '" + name + "' is not on the host");
    json shape = json::array();
    for (auto d : t.shape()) shape.push_back(d);
    header[name] = {
        {"dtype", st_dtype_name(t.dtype())}, {"shape", shape}, {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // data section starts 8-byte aligned

  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw std::runtime_error("write_safetensors: cannot create " + tmp + ": " + errno_str());
  bool ok = true;
  unsigned char len[8];
  uint64_t hl = h.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(hl >> (8 * i));
  ok &= std::fwrite(len, 1, 8, f) == 8;
  ok &= std::fwrite(h.data(), 1, h.size(), f) == h.size();
  for (const auto* p : order) {
    const Tensor& t = p->second;
    if (t.nbytes() > 0) ok &= std::fwrite(t.raw(), 1, t.nbytes(), f) == t.nbytes();
  }
  ok &= std::fflush(f) == 0;
  ok &= ::fsync(::fileno(f)) == 0;
  std::string err = ok ? "" : errno_str();
  ok &= std::fclose(f) == 0;
  if (!ok) {
    std::remove(tmp.c_str());
    throw std::runtime_error("write_safetensors: cannot write " + tmp + ": " + (err.empty() ? errno_str() : err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno_str();
    std::remove(tmp.c_str());
    throw std::runtime_error("write_safetensors: cannot rename " + tmp + " to " + path + ": " + err);
  }
}

}  // namespace hypic
