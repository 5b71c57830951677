// Tensor: a dtype, a shape and a view into device memory. Row-major and contiguous only: ops
// take explicit shapes, which keeps every backend's kernels simple and their layouts obvious.
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "tensor/dtype.h"

namespace hypic {

enum class DeviceKind : uint8_t { CPU, CUDA };

struct Device {
  DeviceKind kind = DeviceKind::CPU;
  int index = 0;
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  std::string str() const;
};

// Memory owned by a backend (or borrowed from an mmap'd file). The deleter runs when the last
// tensor viewing it goes away, so a memory-mapped checkpoint stays mapped while weights live.
class Storage {
 public:
  Storage(void* data, size_t bytes, Device dev, std::function<void(void*)> deleter)
      : data_(data), bytes_(bytes), device_(dev), deleter_(std::move(deleter)) {}
  ~Storage() {
    if (deleter_) deleter_(data_);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void* data_;
  size_t bytes_;
  Device device_;
  std::function<void(void*)> deleter_;
};

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

class Tensor {
 public:
  Tensor() = default;
  Tensor(std::shared_ptr<Storage> st, size_t offset_bytes, DType dt, Shape shape);

  // Host allocation (CPU device), zero-filled. Other devices allocate through their Backend.
  static Tensor empty(DType dt, Shape shape);
  static Tensor zeros(DType dt, Shape shape) { return empty(dt, std::move(shape)); }
  // Host allocation left unset, for buffers an op overwrites in full. Debug builds and
  // HYPIC_POISON_UNINIT=1 fill it with 0xff bytes (NaN as f32/bf16/f16, -1 as integers), so that
  // reading an element no op wrote shows up in the results.
  static Tensor uninitialized(DType dt, Shape shape);
  static bool poison_uninitialized();
  // Wraps caller memory without owning it (the caller keeps it alive).
  static Tensor borrow(void* data, DType dt, Shape shape, Device dev = {});

  bool defined() const { return static_cast<bool>(storage_); }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i < 0 ? shape_.size() + i : i]; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return dtype_bytes(dtype_, numel()); }
  Device device() const { return storage_ ? storage_->device() : Device{}; }
  bool is_cpu() const { return device().kind == DeviceKind::CPU; }

  void* raw() const { return static_cast<char*>(storage_->data()) + offset_; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(raw());
  }

  // Same storage, new shape (numel must match).
  Tensor reshape(Shape s) const;
  // Rows [begin, end) along dim 0.
  Tensor slice_rows(int64_t begin, int64_t end) const;
  // A tensor of another dtype and shape over this one's bytes from offset_bytes (carving one
  // allocation into several tensors); throws if it does not fit.
  Tensor view(size_t offset_bytes, DType dt, Shape shape) const;
  // Deep copy on the host.
  Tensor clone() const;
  // Host copy converted to f32 (any float dtype); a no-op view for f32.
  Tensor to_f32() const;

  std::string str() const;  // "bf16[2, 3]"

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;
  DType dtype_ = DType::F32;
  Shape shape_;
};

// Converts n elements of any float or quantized dtype to f32.
void convert_to_f32(const void* src, DType dt, float* dst, size_t n);
void convert_from_f32(const float* src, DType dt, void* dst, size_t n);

}  // namespace hypic
