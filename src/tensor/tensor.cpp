#include "tensor/tensor.h"

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "tensor/quant.h"

namespace hypic {

std::string Device::str() const {
  return (kind == DeviceKind::CPU ? std::string("cpu") : "cuda:" + std::to_string(index));
}

std::string shape_str(const Shape& s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

Tensor::Tensor(std::shared_ptr<Storage> st, size_t offset_bytes, DType dt, Shape shape)
    : storage_(std::move(st)), offset_(offset_bytes), dtype_(dt), shape_(std::move(shape)) {}

namespace {
// 64-byte aligned host storage; `fill` < 0 leaves the bytes as they come.
Tensor host_tensor(DType dt, Shape shape, int fill) {
  for (auto d : shape)
    if (d < 0) throw std::invalid_argument("negative dimension in shape " + shape_str(shape));
  if (dtype_is_quantized(dt) && (shape.empty() || shape.back() % dtype_block(dt) != 0))
    throw std::invalid_argument(std::string(dtype_name(dt)) + shape_str(shape) + ": rows must be whole blocks of " +
                                std::to_string(dtype_block(dt)));
  size_t bytes = dtype_bytes(dt, shape_numel(shape));
  size_t alloc = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, alloc ? alloc : 64);
  if (!p) throw std::bad_alloc();
  if (fill >= 0) std::memset(p, fill, alloc ? alloc : 64);
  auto st = std::make_shared<Storage>(p, bytes, Device{}, [](void* q) { std::free(q); });
  return Tensor(std::move(st), 0, dt, std::move(shape));
}
}  // namespace

Tensor Tensor::empty(DType dt, Shape shape) {
  return host_tensor(dt, std::move(shape), 0);
}

bool Tensor::poison_uninitialized() {
#ifndef NDEBUG
  return true;
#else
  static const bool on = [] {
    const char* e = std::getenv("HYPIC_POISON_UNINIT");
    return e && *e && std::string(e) != "0";
  }();
  return on;
#endif
}

Tensor Tensor::uninitialized(DType dt, Shape shape) {
  return host_tensor(dt, std::move(shape), poison_uninitialized() ? 0xff : -1);
}

Tensor Tensor::borrow(void* data, DType dt, Shape shape, Device dev) {
  size_t bytes = dtype_bytes(dt, shape_numel(shape));
  auto st = std::make_shared<Storage>(data, bytes, dev, nullptr);
  return Tensor(std::move(st), 0, dt, std::move(shape));
}

Tensor Tensor::reshape(Shape s) const {
  if (shape_numel(s) != numel())
    throw std::invalid_argument("reshape " + shape_str(shape_) + " -> " + shape_str(s) + ": element counts differ");
  if (dtype_is_quantized(dtype_) && (s.empty() || s.back() % dtype_block(dtype_) != 0))
    throw std::invalid_argument("reshape " + str() + " -> " + shape_str(s) + ": rows must be whole blocks of " +
                                std::to_string(dtype_block(dtype_)));
  return Tensor(storage_, offset_, dtype_, std::move(s));
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  if (shape_.empty() || begin < 0 || end < begin || end > shape_[0])
    throw std::out_of_range("slice_rows [" + std::to_string(begin) + ", " + std::to_string(end) + ") of " +
                            shape_str(shape_));
  Shape s = shape_;
  s[0] = end - begin;
  size_t row = dtype_bytes(dtype_, shape_numel(shape_) / std::max<int64_t>(shape_[0], 1));
  return Tensor(storage_, offset_ + static_cast<size_t>(begin) * row, dtype_, std::move(s));
}

Tensor Tensor::view(size_t offset_bytes, DType dt, Shape shape) const {
  const size_t n = dtype_bytes(dt, shape_numel(shape));
  if (!storage_ || offset_bytes > nbytes() || n > nbytes() - offset_bytes)
    throw std::out_of_range("view of " + std::to_string(n) + " bytes at " + std::to_string(offset_bytes) + " in " +
                            (storage_ ? str() : std::string("an undefined tensor")));
  return Tensor(storage_, offset_ + offset_bytes, dt, std::move(shape));
}

Tensor Tensor::clone() const {
  if (!is_cpu()) throw std::logic_error("Tensor::clone is host-only; use Backend::copy");
  Tensor t = empty(dtype_, shape_);
  std::memcpy(t.raw(), raw(), nbytes());
  return t;
}

Tensor Tensor::to_f32() const {
  if (dtype_ == DType::F32) return *this;
  Tensor t = empty(DType::F32, shape_);
  convert_to_f32(raw(), dtype_, t.data<float>(), static_cast<size_t>(numel()));
  return t;
}

std::string Tensor::str() const {
  return std::string(dtype_name(dtype_)) + shape_str(shape_);
}

void convert_to_f32(const void* src, DType dt, float* dst, size_t n) {
  switch (dt) {
    case DType::F32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::BF16: {
      auto s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::F16: {
      auto s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
    case DType::F64: {
      auto s = static_cast<const double*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
    case DType::Q8_0:
    case DType::Q4_K:
    case DType::Q6_K:
      quant::dequantize(dt, src, static_cast<int64_t>(n), dst);
      return;
    default:
      throw std::invalid_argument(std::string("convert_to_f32: not a float dtype: ") + dtype_name(dt));
  }
}

void convert_from_f32(const float* src, DType dt, void* dst, size_t n) {
  switch (dt) {
    case DType::F32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::BF16: {
      auto d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      return;
    }
    case DType::F16: {
      auto d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
      return;
    }
    case DType::F64: {
      auto d = static_cast<double*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = src[i];
      return;
    }
    default:
      throw std::invalid_argument(std::string("convert_from_f32: not a float dtype: ") + dtype_name(dt));
  }
}

}  // namespace hypic
