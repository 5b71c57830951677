// The CPU backend: every op of backend.h on host memory, threaded over a persistent pool.
// Dense products go through OpenBLAS (sgemm) with half-precision weights converted panel by
// panel (never upcast as a whole); decode-size products use a fused convert+dot GEMV.
#pragma once
#include <memory>

#include "backend/backend.h"
#include "backend/cpu/thread_pool.h"

namespace hypic::cpu {

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(int threads = 0);
  ~CpuBackend() override;

  Device device() const override { return Device{}; }
  std::string name() const override { return "cpu"; }
  int num_threads() const override { return pool_.size(); }
  ThreadPool& pool() { return pool_; }
  // Row-independent products: the few-row kernel at every row count, with one accumulation order.
  bool set_row_independent(bool on) override {
    row_independent_ = on;
    return true;
  }
  // Products take f32 activations by default (exact). set_precise(false) (`--activations bf16`)
  // rounds them to bf16 in the products with bf16 weights from kBf16Rows rows and quantized ones
  // from kQuantGemvRows rows, which then run on oneDNN's AVX512_BF16 kernels (bf16_gemm.h); where
  // those cannot run, the backend stays precise and imprecise_unavailable() says why.
  void set_precise(bool exact) override;
  bool precise() const override { return precise_; }
  std::string imprecise_unavailable() const override;
  // From this many rows products with bf16 weights take bf16 activations when not precise: at 16
  // rows oneDNN already runs at ~200 GFLOP/s here against ~150 for the f32 paths at 64 rows
  // (bench/gemm_bench.cpp, docs/perf-notes.md).
  static constexpr int64_t kBf16Rows = 16;
  // Below this many rows a quantized product runs as integer GEMVs (bench/gemm_bench.cpp); from it
  // on, dequantized panels (f32 activations) or, when not precise, bf16 slices through oneDNN.
  static constexpr int64_t kQuantGemvRows = 32;
  // The decode-step overloads come from Backend (per-sequence calls of the span ops).
  using Backend::embedding;
  using Backend::rope_neox;

  Tensor alloc(DType dt, Shape shape) override;
  Tensor alloc_uninit(DType dt, Shape shape) override;
  Tensor to_device(const Tensor& host) override;
  Tensor to_host(const Tensor& t) override;
  void copy(const Tensor& src, Tensor& dst) override;
  void fill(Tensor& t, float value) override;

  void matmul(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate = false) override;
  void matmul_many(const Tensor& x, std::initializer_list<Tensor> w, std::initializer_list<Tensor> y) override;
  void embedding(const Tensor& table, std::span<const int32_t> ids, Tensor& out) override;

  void rms_norm(const Tensor& x, const Tensor& w, float eps, bool one_plus_w, Tensor& out) override;
  void rms_norm_gated(const Tensor& x, const Tensor& z, const Tensor& w, float eps, Tensor& out) override;
  void add(const Tensor& a, const Tensor& b, Tensor& out) override;
  void silu_mul(const Tensor& gate, const Tensor& up, Tensor& out) override;
  void sigmoid_mul(const Tensor& x, const Tensor& gate, Tensor& out) override;
  void copy_cols(const Tensor& src, int64_t col, Tensor& dst) override;
  void set_cols(const Tensor& src, int64_t col, Tensor& dst) override;
  void gather_col_blocks(const Tensor& src, std::span<const int64_t> order, Tensor& dst) override;

  void rope_neox(Tensor& x, std::span<const int64_t> positions, int rot_dim, double theta) override;
  void copy_rows(std::span<const RowCopy> pieces, int rot_dim = 0, double theta = 0) override;

  void attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t kv_len, int64_t q_offset, float scale,
                 Tensor& out) override;
  void attention_spans(const Tensor& q, const Tensor& k, const Tensor& v, std::span<const RowSpan> spans, float scale,
                       Tensor& out) override;

  void causal_conv1d_silu(const Tensor& x, const Tensor& w, Tensor& state, Tensor& out) override;
  using Backend::causal_conv1d_silu_spans;
  void causal_conv1d_silu_spans(const Tensor& x, const Tensor& w, std::span<const ConvSpan> spans, Tensor& state,
                                std::span<Tensor> out_cols) override;
  void gdn_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, Tensor& g,
                 Tensor& beta) override;
  void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                        bool l2norm_qk, Tensor& state, Tensor& out, Tensor* transition = nullptr) override;
  void gated_delta_chain(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                         bool l2norm_qk, Tensor& state, Tensor& out, std::span<const GdnLink> links) override;

  void linear_recurrence(const Recurrence& r, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                         const Tensor& beta, const Tensor& log_gamma, Tensor& state, Tensor& out,
                         Tensor* transition = nullptr) override;
  void causal_conv1d_bias_silu(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& state,
                               Tensor& out) override;
  void mamba2_gates(const Tensor& dt_raw, const Tensor& x, const Tensor& A, const Tensor& dt_bias, float dt_min,
                    Tensor& g, Tensor& v) override;
  void mamba2_gated_norm(const Tensor& y, const Tensor& x, const Tensor& z, const Tensor& D, const Tensor& w,
                         int64_t groups, float eps, Tensor& out) override;
  void kda_gates(const Tensor& a, const Tensor& b, const Tensor& A, const Tensor& dt_bias, Tensor& g,
                 Tensor& beta) override;
  void scale_add(const Tensor& x, float a, const Tensor& y, float b, Tensor& out) override;
  void activate(Activation act, Tensor& x) override;

  void compose_state(const Tensor& T, const Tensor& S, const Tensor& B, float alpha, Tensor& out) override;
  void set_identity(Tensor& t) override;

  using Backend::moe_experts;
  void moe_experts(const Tensor& x, const Tensor& router_logits, const MoeRouter& router, const ExpertWeights& experts,
                   Tensor& out) override;

 private:
  void attention_decode(const float* q, const float* k, const float* v, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                        int64_t Dv, int64_t kv_len, int64_t q_offset, float scale, float* out);
  void attention_tiled(const float* q, const float* k, const float* v, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                       int64_t Dv, int64_t kv_len, int64_t q_offset, float scale, float* out);
  // Rows [row0, row0 + rows) of q and out at positions pos0.., seeing keys [0, kv_len).
  struct TiledSpan {
    int64_t row0, pos0, rows, kv_len;
  };
  void attention_tiled_spans(const float* q, const float* k, const float* v, std::span<const TiledSpan> spans,
                             int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, float scale, float* out);

  void matmul_quantized_gemv(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate);
  void matmul_bf16(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate);
  // AVX-512 builds only (cpu_backend.cpp): which products take the chain kernels, and those
  // products as one parallel region with x transposed once.
  bool chain_applies(int64_t M, int64_t K, DType wd) const;
  void chain_products(const Tensor& x, std::span<const Tensor* const> w, std::span<Tensor* const> y, bool accumulate);

  ThreadPool pool_;
  bool row_independent_ = false;
  bool precise_ = true;
};

}  // namespace hypic::cpu
