// The CUDA backend: every op of backend.h on one NVIDIA GPU, in one stream.
//  * Memory comes from a caching allocator (freed blocks are kept per size and reused in stream
//    order; the driver is asked again only when no cached block fits, and the cache is emptied and
//    the request retried once when the driver runs out).
//  * Dense products go through cuBLAS: f32 weights in f32 (no TF32), bf16/f16 weights with the
//    activations rounded to the weight's dtype and f32 accumulation, as bf16 checkpoints are served
//    elsewhere (transformers, vLLM); set_precise(true) makes them f32-exact in the
//    activations (x split into three half-precision parts, three products: f32 precision).
//  * Every call first makes the backend's GPU current on the calling thread (the server calls from
//    its engine thread, tests from the main thread).
//  * Activations, recurrent states and KV rows are f32 for now (the CPU backend's conventions).
// This header has no CUDA types, so the rest of hypic builds with the host compiler alone.
#pragma once
#include <memory>
#include <vector>

#include "backend/backend.h"

namespace hypic::cuda {

// Warps per output row of the few-row products (1, 2, 4 or 8; 0, the default: HYPIC_GEMV_SPLIT or
// the size rule in gemv.cu). For tests, which check every factor; not thread-safe.
void set_gemv_split(int split);
// Rows of S per thread in the PIC chain kernel (gated_delta_chain.cu): 8 (the default), 4 (key
// heads up to 128) or 32; 0 restores HYPIC_GDN_CHAIN_ROWS, else 8.
void set_gdn_chain_rows(int rows);
// Dense bodies' T staged whole in shared memory (default) or a panel at a time (false).
void set_gdn_chain_full_t(bool on);
// MoE layers of up to 2048 slots on the grouped tensor-core kernels (default) or on cuBLAS's
// batched products sized from the expert counts on the host (false); for tests and A/B runs.
void set_moe_grouped(bool on);
// Flash attention blocks packed by query group (a kv head's query heads for 128 / group rows):
// -1 the rule (rows with positions of their own: a composition), 0 never, 1 whenever the group
// divides 128; for tests and A/B runs (HYPIC_FLASH_PACK sets it for a process).
void set_flash_pack(int mode);
// Prefill attention on Hopper's warpgroup MMA where it serves the call (flash_attention_wgmma.cu):
// -1 the default (on; HYPIC_FLASH_WGMMA=0 turns it off for a process), 0 off, 1 on.
void set_flash_wgmma(int mode);
// Launches of the warpgroup-MMA kernels so far in this process (tests: which kernel ran).
int64_t flash_wgmma_launches();
int64_t moe_wgmma_launches();
// The grouped MoE GEMM (bf16 weights) on Hopper's warpgroup MMA (moe_gemm.cu): -1 the default (on;
// HYPIC_MOE_WGMMA=0 turns it off for a process), 0 off (the mma.sync kernel), 1 on.
void set_moe_wgmma(int mode);
// Whether the loaded kernels have the sm_90a (wgmma) code: true on Hopper GPUs.
bool wgmma_available();

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(int device = 0);
  ~CudaBackend() override;

  Device device() const override;
  std::string name() const override { return "cuda"; }
  int num_threads() const override;  // multiprocessors of the device
  // "NVIDIA H200, sm_90, 132 SMs, 139.8 GiB"
  std::string description() const;

  Tensor alloc(DType dt, Shape shape) override;
  Tensor alloc_uninit(DType dt, Shape shape) override;
  Tensor to_device(const Tensor& host) override;
  Tensor to_host(const Tensor& t) override;
  void copy(const Tensor& src, Tensor& dst) override;
  void fill(Tensor& t, float value) override;
  void convert(const Tensor& src, Tensor& dst) override;
  void synchronize() override;
  void profile_reset() override;
  int64_t prefill_chunk() const override { return 8192; }  // fewer launches per token; memory is plenty
  int64_t peak_memory_bytes() const override { return static_cast<int64_t>(peak_bytes()); }
  int64_t free_memory_bytes() const override;
  void set_precise(bool exact) override;
  bool precise() const override;
  void write(Tensor& dst, const void* src, size_t bytes) override;
  // Page-locked host memory; copies on a stream of their own, ordered by events.
  Tensor alloc_host(size_t bytes) override;
  std::shared_ptr<Fence> copy_async(std::span<const Tensor> src, std::span<Tensor> dst) override;
  void wait(const Fence& f) override;
  // CUDA IPC between processes of one host (segment workers): backend.h, "memory shared".
  std::optional<Shared> share(std::span<const Tensor* const> src, std::span<const uint64_t> offsets,
                              uint64_t bytes) override;
  bool can_map_shared() const override;
  void copy_from_shared(const std::string& handle, uint64_t bytes, std::span<const uint64_t> offsets,
                        std::span<Tensor> dst) override;
  uint64_t payload_checksum(std::span<const Tensor* const> ts, std::span<const uint64_t> offsets) override;
  // CUDA graphs: the stream is captured (relaxed mode), allocations inside come from a pool the
  // graph owns, and a host round trip inside (a sync) abandons the capture (null).
  std::unique_ptr<Graph> capture(const std::function<void()>& fn) override;

  void matmul(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate = false) override;
  void matmul_many(const Tensor& x, std::initializer_list<Tensor> w, std::initializer_list<Tensor> y) override;
  void matmul_swiglu(const Tensor& x, const Tensor& gate, const Tensor& up, Tensor& h) override;
  void embedding(const Tensor& table, std::span<const int32_t> ids, Tensor& out) override;
  void embedding(const Tensor& table, const Tensor& ids, Tensor& out) override;

  void rms_norm(const Tensor& x, const Tensor& w, float eps, bool one_plus_w, Tensor& out) override;
  void rms_norm_gated(const Tensor& x, const Tensor& z, const Tensor& w, float eps, Tensor& out) override;
  void add(const Tensor& a, const Tensor& b, Tensor& out) override;
  void add_rms_norm(Tensor& x, const Tensor& d, const Tensor& w, float eps, bool one_plus_w, Tensor& out) override;
  void silu_mul(const Tensor& gate, const Tensor& up, Tensor& out) override;
  void sigmoid_mul(const Tensor& x, const Tensor& gate, Tensor& out) override;
  void copy_cols(const Tensor& src, int64_t col, Tensor& dst) override;
  void set_cols(const Tensor& src, int64_t col, Tensor& dst) override;
  void copy_rows(std::span<const RowCopy> pieces, int rot_dim = 0, double theta = 0) override;

  void rope_neox(Tensor& x, std::span<const int64_t> positions, int rot_dim, double theta) override;
  void rope_neox(Tensor& x, const Tensor& positions, int rot_dim, double theta) override;

  void attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t kv_len, int64_t q_offset, float scale,
                 Tensor& out) override;
  void gated_delta_chain(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                         bool l2norm_qk, Tensor& state, Tensor& out, std::span<const GdnLink> links) override;
  void attention_spans(const Tensor& q, const Tensor& k, const Tensor& v, std::span<const RowSpan> spans, float scale,
                       Tensor& out) override;

  void causal_conv1d_silu(const Tensor& x, const Tensor& w, Tensor& state, Tensor& out) override;
  using Backend::causal_conv1d_silu_spans;
  void causal_conv1d_silu_spans(const Tensor& x, const Tensor& w, std::span<const ConvSpan> spans, Tensor& state,
                                std::span<Tensor> out) override;
  void gdn_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, Tensor& g,
                 Tensor& beta) override;
  void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                        bool l2norm_qk, Tensor& state, Tensor& out, Tensor* transition = nullptr) override;

  void causal_conv1d_silu_step(const Tensor& x, const Tensor& w, const Tensor& states, Tensor& out) override;
  void gated_delta_rule_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                             bool l2norm_qk, const Tensor& states, Tensor& out) override;
  void attention_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& caches, const Tensor& positions,
                      float scale, Tensor& out) override;

  void argmax_rows(const Tensor& x, Tensor& ids) override;
  void sample_rows(const Tensor& x, const Tensor& params, const Tensor& mask, Tensor& ids) override;

  void linear_recurrence(const Recurrence& r, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                         const Tensor& beta, const Tensor& log_gamma, Tensor& state, Tensor& out,
                         Tensor* transition = nullptr) override;
  void linear_recurrence_runs(const Recurrence& r, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                              const Tensor& beta, const Tensor& log_gamma, std::span<Tensor* const> states,
                              std::span<const int64_t> rows, Tensor& out) override;
  void causal_conv1d_bias_silu_runs(const Tensor& x, const Tensor& w, const Tensor& bias,
                                    std::span<Tensor* const> states, std::span<const int64_t> rows,
                                    Tensor& out) override;
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
  void moe_experts_add(const Tensor& xn, const Tensor& router_logits, int top_k, bool norm_topk,
                       const ExpertWeights& experts, const Tensor& shared, const Tensor& shared_gate,
                       Tensor& x) override;

  // Bytes held by the caching allocator (in use + cached) and the peak in use since start.
  size_t reserved_bytes() const;
  size_t peak_bytes() const;

 public:
  struct Impl;  // public so the implementation file's helpers can name it

 private:
  // The tensor-core path of attention() and attention_spans() (qpos: per-row positions on the device).
  void flash(const Tensor& q, const Tensor& k, const Tensor& v, int64_t kv_len, int64_t q_offset, const int64_t* qpos,
             float scale, Tensor& out);
  std::unique_ptr<Impl> impl_;
  Tensor upload(const void* host, DType dt, int64_t n);  // small host array -> device tensor
  const float* inv_freq(int rot_dim, double theta);
  const void* const* expert_table(const ExpertWeights& experts, int64_t H, int64_t I);
  // moe_experts, and moe_experts_add with its tail (shared expert, residual) in the combine.
  void run_moe(const Tensor& x, const Tensor& router_logits, const MoeRouter& router, const ExpertWeights& experts,
               Tensor& out, const float* shared, const float* shared_gate, bool residual);
  void batched_matmul(const Tensor& x, const std::vector<const Tensor*>& w, int64_t M, Tensor& y);
  // cuBLAS products over x rounded to 16 bits once (matmul, matmul_many).
  struct HalfX {
    DType dt = DType::BF16;
    int64_t M = 0, K = 0;
    char *hi = nullptr, *mid = nullptr, *lo = nullptr;
  };
  HalfX stage_half(Impl& m, const Tensor& x, DType dt);
  void gemm_half(Impl& m, const HalfX& h, const Tensor& w, Tensor& y, bool accumulate);
};

// True when this process can see at least one CUDA device (false on machines without a GPU or
// driver; never throws).
bool device_available();

}  // namespace hypic::cuda
