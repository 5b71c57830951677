// Weights quantized as they load (models/model.h: quantized_weights).
#include <algorithm>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "models/model.h"
#include "tensor/quant.h"

namespace hypic {

namespace {

class QuantizedSource : public WeightSource {
 public:
  QuantizedSource(std::unique_ptr<WeightSource> inner, DType to) : inner_(std::move(inner)), to_(to) {}
  bool has(const std::string& name) const override { return inner_->has(name); }
  std::string describe() const override { return inner_->describe() + " quantized to " + dtype_name(to_); }

  Tensor get(const std::string& name, const Shape& shape) const override {
    return quantize(name, inner_->get(name, shape));
  }
  // The inner source's column order passes through (a file's quantized blocks stay as they are;
  // float columns in any order of whole blocks quantize as well as in order).
  Tensor get_with_col_order(const std::string& name, const Shape& shape,
                            std::vector<int64_t>& col_order) const override {
    return quantize(name, inner_->get_with_col_order(name, shape, col_order));
  }

 private:
  Tensor quantize(const std::string& name, Tensor t) const {
    // MoE routers stay as they are (as in llama.cpp's files): a few rows whose rounding flips the
    // chosen experts. Qwen's mlp.gate, Nemotron-H's mixer.gate, Kimi's and MiniMax's block_sparse_moe.gate.
    const bool router = name.ends_with("mlp.gate.weight") || name.ends_with("shared_expert_gate.weight") ||
                        name.ends_with("mixer.gate.weight") || name.ends_with("block_sparse_moe.gate.weight");
    // At 4 bits the token embedding (also the head when tied) is kept at 6, as llama.cpp's Q4_K_M
    // does: it is the most sensitive matrix (docs/gguf.md).
    const bool embedding = name.ends_with("embed_tokens.weight") || name == "lm_head.weight";
    const DType to = to_ == DType::Q4_K && embedding ? DType::Q6_K : to_;
    const bool half_or_f32 = t.dtype() == DType::F32 || t.dtype() == DType::BF16 || t.dtype() == DType::F16;
    if (router || t.ndim() != 2 || !half_or_f32 || t.dim(1) % dtype_block(to) != 0) return t;
    Tensor q = Tensor::empty(to, t.shape());
    const int64_t rows = t.dim(0), cols = t.dim(1);
    const size_t rb = dtype_bytes(to, cols), eb = dtype_bytes(t.dtype(), cols);
    // Rows are independent: split them over the cores, each converting its rows to f32 one at a
    // time (no f32 copy of the whole matrix), so a large model loads in seconds.
    const int64_t n =
        std::clamp<int64_t>(rows * cols / (1 << 20), 1, std::max(1u, std::thread::hardware_concurrency()));
    auto run = [&](int64_t r0, int64_t r1) {
      std::vector<float> row(static_cast<size_t>(cols));
      for (int64_t r = r0; r < r1; ++r) {
        convert_to_f32(static_cast<const char*>(t.raw()) + static_cast<size_t>(r) * eb, t.dtype(), row.data(),
                       static_cast<size_t>(cols));
        quant::quantize(to, row.data(), cols, static_cast<char*>(q.raw()) + static_cast<size_t>(r) * rb);
      }
    };
    std::vector<std::thread> pool;
    for (int64_t w = 1; w < n; ++w) pool.emplace_back(run, rows * w / n, rows * (w + 1) / n);
    run(0, rows / n);
    for (auto& th : pool) th.join();
    return q;
  }

  std::unique_ptr<WeightSource> inner_;
  DType to_;
};

}  // namespace

std::unique_ptr<WeightSource> quantized_weights(std::unique_ptr<WeightSource> inner, DType to) {
  if (!dtype_is_quantized(to))
    throw std::invalid_argument(std::string("quantized_weights: ") + dtype_name(to) + " is not a quantized type");
  return std::make_unique<QuantizedSource>(std::move(inner), to);
}

}  // namespace hypic
