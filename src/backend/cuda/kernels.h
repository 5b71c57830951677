// Host-side launchers of the CUDA kernels, one .cu file per op family (elementwise.cu,
// attention.cu, gated_delta.cu). Arguments are device pointers and sizes; every launcher enqueues
// on the given stream and checks the launch. Shapes were validated by CudaBackend before the call.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "tensor/dtype.h"

namespace hypic::cuda {

// Kernels launched while this thread records a graph use programmatic dependent launch (launch.cuh).
void set_graph_recording(bool on);

void launch_fill(cudaStream_t s, float* p, int64_t n, float v);
void launch_convert_f32(cudaStream_t s, const float* x, DType to, void* y, int64_t n);  // to bf16/f16
void launch_to_f32(cudaStream_t s, const void* x, DType from, float* y, int64_t n);     // from bf16/f16
// x = p0 + p1 + p2 in three half-precision parts (p0 = half(x), p1 = half(x - p0), ...): together
// they keep f32's 24 mantissa bits, so three half-precision products give an f32-exact one.
void launch_split_f32(cudaStream_t s, const float* x, DType to, void* p0, void* p1, void* p2, int64_t n);
void launch_embedding(cudaStream_t s, const void* table, DType dt, const int32_t* ids, int64_t n, int64_t H,
                      float* out);
void launch_rms_norm(cudaStream_t s, const float* x, const void* w, DType wdt, float eps, bool one_plus_w, float* out,
                     int64_t R, int64_t D);
void launch_add_rms_norm(cudaStream_t s, float* x, const float* d, const void* w, DType wdt, float eps, bool one_plus_w,
                         float* out, int64_t R, int64_t D);
void launch_rms_norm_gated(cudaStream_t s, const float* x, const float* z, const void* w, DType wdt, float eps,
                           float* out, int64_t R, int64_t D);
enum class BinOp { Add, SiluMul, SigmoidMul };
void launch_binary(cudaStream_t s, BinOp op, const float* a, const float* b, float* out, int64_t n);
void launch_sigmoid_mul_rows(cudaStream_t s, const float* x, const float* gate, float* out, int64_t R, int64_t C);
// dst[r, dcol + j] = src[r, scol + j] for j < W, elements of `es` bytes.
void launch_copy_cols(cudaStream_t s, const void* src, int64_t src_cols, int64_t scol, void* dst, int64_t dst_cols,
                      int64_t dcol, int64_t R, int64_t W, size_t es);
void launch_rope_neox(cudaStream_t s, float* x, int64_t T, int64_t H, int64_t D, const int64_t* pos,
                      const float* inv_freq, int half);
void launch_gdn_gates(cudaStream_t s, const float* a, const float* b, const void* A_log, DType adt, const void* dt_bias,
                      DType bdt, float* g, float* beta, int64_t T, int64_t H);
// Where column c of a conv's [T, C] result goes: up to three column blocks [0, end0), [end0, end1),
// [end1, C), each a [T, width] tensor of its own (q, k and v of a GDN conv: no copy splits them).
// One block: p0 with end0 = end1 = C.
struct ColSplit {
  float *p0 = nullptr, *p1 = nullptr, *p2 = nullptr;
  int64_t end0 = 0, end1 = 0, C = 0;
  static ColSplit whole(float* out, int64_t C) { return {out, nullptr, nullptr, C, C, C}; }
#ifdef __CUDACC__
  __device__ __forceinline__ float* at(int64_t t, int64_t c) const {
    if (c < end0) return p0 + t * end0 + c;
    if (c < end1) return p1 + t * (end1 - end0) + (c - end0);
    return p2 + t * (C - end1) + (c - end1);
  }
#endif
  // Every block's rows 16-byte aligned and 4-column groups inside one block (the tiled kernel).
  bool vec4_ok() const;
};
// The outputs only, from the K-1 rows at start (4 channels x 16 rows a thread where C % 4 == 0).
void launch_conv1d_rows(cudaStream_t s, const float* x, const void* w, DType wdt, const float* start,
                        const ColSplit& out, int64_t T, int64_t C, int64_t K);
void launch_causal_conv1d_silu(cudaStream_t s, const float* x, const void* w, DType wdt, float* state, float* out,
                               int64_t T, int64_t C, int64_t K);
// Spans of rows of one conv (causal_conv1d_silu_spans): rows [row0, row0 + rows) of x start from
// the K-1 inputs at `start` ([K-1, C], oldest first).
struct ConvGroup {
  int64_t row0 = 0, rows = 0;
  const float* start = nullptr;
};
void launch_conv1d_spans(cudaStream_t s, const float* x, const void* w, DType wdt, const ConvGroup* groups,
                         int n_groups, const ColSplit& out, int64_t T, int64_t C, int64_t K);
// state <- the last K-1 inputs of (start ++ x[0..T)) (start may be state itself).
void launch_conv1d_state(cudaStream_t s, const float* x, const float* start, float* state, int64_t T, int64_t C,
                         int64_t K);
// Row-range copies (copy_rows): piece i covers rows [first, first + rows) of the launch; rows of
// `words` 4-byte words; a nonzero shift rotates each head's first 2*half dims (NeoX) by that many
// positions on the way.
struct RowPiece {
  const char* src = nullptr;
  char* dst = nullptr;
  int64_t words = 0, rows = 0, first = 0, shift = 0, head_dim = 0;
};
void launch_copy_rows(cudaStream_t s, const RowPiece* pieces, int n, int64_t total_rows, const float* inv_freq,
                      int half);
void launch_set_identity(cudaStream_t s, float* t, int64_t H, int64_t n);
void launch_argmax_rows(cudaStream_t s, const float* x, int64_t R, int64_t V, int32_t* ids);
void launch_sample_rows(cudaStream_t s, const float* x, int64_t R, int64_t V, const float* params, const uint8_t* mask,
                        int32_t* ids);
// rows: out[i, :] = x[idx[i], :], or zeros where idx[i] < 0 (padding)
void launch_gather_rows(cudaStream_t s, const float* x, const int32_t* idx, float* out, int64_t n, int64_t H);
// the same rounded to bf16/f16 (to = BF16 or F16)
void launch_gather_rows_half(cudaStream_t s, const float* x, const int32_t* idx, DType to, void* out, int64_t n,
                             int64_t H);
// MoE routing (moe.cu): sel/wsel [T*k] chosen experts and weights, rank [T*k] each slot's place
// among its expert's slots in token order, counts [E].
void launch_moe_route(cudaStream_t s, const float* logits, int64_t T, int64_t E, int top_k, bool norm, int32_t* sel,
                      float* wsel, int32_t* rank, int32_t* counts);
// DeepSeek-V3's routing (MoeRouter::sigmoid; route_sigmoid_grouped on the host): sigmoid scores,
// choice by score + bias within the topk_group best of n_group groups (n_group <= 1024), the chosen
// scores as weights (over their sum + 1e-20 when norm), times scaling; then ranks and counts as
// launch_moe_route.
struct SigmoidRouter {
  const float* bias = nullptr;  // [E] or null
  int n_group = 1, topk_group = 1;
  float scaling = 1.f;
};
void launch_moe_route_sigmoid(cudaStream_t s, const float* logits, int64_t T, int64_t E, int top_k, bool norm,
                              const SigmoidRouter& r, int32_t* sel, float* wsel, int32_t* rank, int32_t* counts);
// launch_moe_route then launch_moe_order (gemv.cu) in one: one launch for a decode step's few slots.
void launch_moe_route_order(cudaStream_t s, const float* logits, int64_t T, int64_t E, int top_k, bool norm,
                            int32_t* sel, float* wsel, int32_t* rank, int32_t* counts, int32_t* order,
                            int32_t* offsets = nullptr, int32_t* pos = nullptr);
// rows[batch_of[e] * maxn + rank] = token of each slot (rows pre-filled with -1), pos[slot] = that row.
void launch_moe_index(cudaStream_t s, const int32_t* sel, const int32_t* rank, const int32_t* batch_of, int64_t T,
                      int top_k, int64_t maxn, int32_t* rows, int32_t* pos);
// MoE un-permute: out[t, :] = sum_j w[t*k + j] * y[pos[t*k + j], :] (one block per token: no races);
// pos null means y is indexed by slot. A tail adds shared[t, :] * sigmoid(shared_gate[t]) where
// shared is set, and adds the result to out instead of overwriting it where residual is.
struct MoeTail {
  const float* shared = nullptr;
  const float* shared_gate = nullptr;
  bool residual = false;
};
void launch_moe_combine(cudaStream_t s, const float* y, const int32_t* pos, const float* w, int64_t T, int top_k,
                        int64_t H, float* out, const MoeTail& tail = {});

// MoE for more slots than that (prefill): a grouped GEMM over the slots sorted by expert
// (moe_gemm.cu), 128 x 128 tiles mapped to experts on the device by tile_start (launch_moe_tiles,
// E + 1 ints). a is 16-bit in the weights' dtype: gate_up, x [T, K] (rows by order / top_k), y the
// 16-bit silu(gate) * up [slots, N] in sorted order; else a [slots, K] sorted, y f32 [slots, N].
// K and N multiples of 8; grid sized by moe_gemm_max_tiles.
// bf16 weights on Hopper run the warpgroup-MMA variant; tests: -1 default, 0 off, 1 on.
void set_moe_wgmma(int mode);
int64_t moe_wgmma_launches();  // tests: which kernel ran
int64_t moe_gemm_max_tiles(int64_t slots, int64_t E);
void launch_moe_tiles(cudaStream_t s, const int32_t* counts, int64_t E, int32_t* tile_start);
void launch_moe_gemm(cudaStream_t s, DType wdt, bool gate_up, const void* a, const int32_t* order,
                     const int32_t* offsets, const int32_t* counts, const int32_t* tile_start, int64_t E, int64_t slots,
                     const void* const* w0, const void* const* w1, int top_k, int64_t K, int64_t N, void* y);

// Few-row products (gemv.cu): y[M,N] (+)= x[M,K] W[N,K]^T for M <= kGemvMaxRows, W bf16/f16/f32
// (K % 8 == 0, W and x 16-byte aligned), f32 accumulation from f32 activations.
constexpr int64_t kGemvMaxRows = 8;
constexpr int64_t kMoeGemvMaxSlots = 256;  // T * top_k up to this: the few-slot MoE kernels
bool gemv_supported(DType wdt, int64_t M, int64_t K, const void* w, const float* x);
void launch_gemv(cudaStream_t s, const void* w, DType wdt, const float* x, float* y, int64_t M, int64_t N, int64_t K,
                 bool accumulate);
// Up to kGemvMaxOutputs products of the same x in one launch: y[p][M, N_p] = x W_p^T, where
// N_p = end[p] - end[p-1] (weights of one dtype, each meeting gemv_supported).
constexpr int kGemvMaxOutputs = 4;
struct GemvOutputs {
  const void* w[kGemvMaxOutputs] = {};
  float* y[kGemvMaxOutputs] = {};
  int64_t end[kGemvMaxOutputs] = {};
  int count = 0;
};
void launch_gemv_many(cudaStream_t s, const GemvOutputs& o, DType wdt, const float* x, int64_t M, int64_t K,
                      bool accumulate);
void set_gemv_split(int split);  // documented in cuda_backend.h (which nvcc's C++ level cannot read)
// h[M,N] = silu(x gate^T) * (x up^T), gate and up [N,K] of one dtype (gemv_supported for both).
void launch_gemv_swiglu(cudaStream_t s, const void* gate, const void* up, DType wdt, const float* x, float* h,
                        int64_t M, int64_t N, int64_t K);
// MoE for few slots, with no host round trip: order [n] lists the slots grouped by expert (from
// the routing's ranks and counts); then h[slot] = silu(gate_e x_t) * (up_e x_t) (gate null:
// relu(up_e x_t)^2) and ys[slot] = down_e h[slot] for every slot, reading the expert's weights
// through pointer tables (device arrays of E pointers each; H % 8 == 0, I % 8 == 0, rows 16-byte
// aligned).
// Also, where not null, offsets [E] (each expert's first place in order) and pos [n] (each slot's).
void launch_moe_order(cudaStream_t s, const int32_t* sel, const int32_t* rank, const int32_t* counts, int64_t E,
                      int64_t n, int32_t* order, int32_t* offsets = nullptr, int32_t* pos = nullptr);
// MoE for up to kMoeGroupedMaxSlots slots on the tensor cores, no host round trip either (moe.cu):
// gate_up: y[p, :N] = silu(a_t gate_e^T) * (a_t up_e^T) for the slot at place p of order (token
// t = slot / top_k of a [T, K]); else y[p, :N] = a[p] down_e^T. w0 (and w1: up) are device tables
// of E weight pointers, [N, K] bf16 or f16 each, K % 8 == 0, rows 16-byte aligned.
constexpr int64_t kMoeGroupedMaxSlots = 2048;
void launch_moe_grouped(cudaStream_t s, DType wdt, bool gate_up, const float* a, const int32_t* order,
                        const int32_t* offsets, const int32_t* counts, const void* const* w0, const void* const* w1,
                        int64_t E, int top_k, int64_t K, int64_t N, float* y);
// Grouped products on (default; HYPIC_MOE_GROUPED=0 turns them off) or off; for tests and A/B runs.
void set_moe_grouped(bool on);
bool moe_grouped_enabled();
void launch_moe_gemv(cudaStream_t s, DType wdt, const void* const* gate, const void* const* up, const void* const* down,
                     const float* x, const int32_t* sel, const int32_t* order, int64_t slots, int top_k, int64_t H,
                     int64_t I, float* h, float* ys);

// Causal GQA attention, f32: q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv]; query t sees keys
// j < min(kv_len, q_offset + t + 1). `part` (f32, attention_part_floats(...) elements, or null for
// no key split) is scratch for the per-split partial results.
int attention_splits(int64_t T, int64_t Hq, int64_t kv_len);
inline int64_t attention_part_floats(int64_t T, int64_t Hq, int64_t Dv, int64_t kv_len) {
  return T * Hq * attention_splits(T, Hq, kv_len) * (Dv + 2);
}
void launch_attention(cudaStream_t s, const float* q, const float* k, const float* v, int64_t T, int64_t Hq,
                      int64_t Hkv, int64_t D, int64_t Dv, int64_t kv_len, int64_t q_offset, float scale, float* out,
                      float* part);

// The same on the tensor cores (flash_attention.cu): q, k, v rounded to bf16, f32 accumulation.
// With kv16, k and v are bf16 copies ([kv_len, Hkv, D] and [kv_len, Hkv, Dv], head dims multiples
// of 8: flash_attention_kv16) and stream through a two-stage cp.async pipeline; else f32.
// qpos (I64 [T] on the device, nondecreasing, or null): row t's own position instead of
// q_offset + t. splits > 1 cuts the keys across blocks (flash_attention_plan picks it for the
// GPU's `sms` multiprocessors); `part` then holds attention_part_floats(T, Hq, Dv, splits) floats
// of partial sums, merged into out by the same call.
// The launch's shape: pack (a block holds the query heads of one kv head for 128 / group query
// rows, rather than 128 rows of one head) and the key splits. scattered: the rows carry positions
// of their own (qpos). HYPIC_FLASH_PACK=0|1 forces packing off or on (measurements).
struct FlashPlan {
  bool pack = false;
  int splits = 1;
};
bool flash_attention_kv16(int64_t D, int64_t Dv);
// The launch shape both flash kernels share: blocks of 128 tensor-core rows (128 / group query rows
// of a kv head's query heads when packed) x heads x key splits of whole 64-key tiles (`chunk` keys
// each), and where the partial sums go inside `part` (null without a split).
struct FlashLaunch {
  dim3 grid;
  int64_t chunk;
  float* part_ml;
  float* part_acc;
};
FlashLaunch flash_launch_shape(bool pack, int64_t T, int64_t Hq, int64_t Hkv, int64_t kv_len, int splits, float* part);

FlashPlan flash_attention_plan(int64_t T, int64_t Hq, int64_t Hkv, int64_t kv_len, bool scattered, int sms);
// Tests: -1 the rule (the default), 0 never pack, 1 pack whenever the query group divides a block.
void set_flash_pack(int mode);
void launch_flash_attention(cudaStream_t s, const FlashPlan& plan, const float* q, const void* k, const void* v,
                            bool kv16, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, int64_t kv_len,
                            int64_t q_offset, const int64_t* qpos, float scale, float* out, float* part);
// The same on Hopper's warpgroup MMA (flash_attention_wgmma.cu) where it serves the call: D = Dv
// in {128, 256}, bf16 k/v, the sm_90a image loaded (any plan); launch_flash_attention
// sends such calls there itself. Tests: set_flash_wgmma -1 the default (HYPIC_FLASH_WGMMA=0 turns
// it off), 0 off, 1 on.
void set_flash_wgmma(int mode);
int64_t flash_wgmma_launches();  // tests: which kernel ran
bool flash_attention_wgmma_serves(const FlashPlan& plan, bool kv16, int64_t D, int64_t Dv, const float* q);
void launch_flash_attention_wgmma(cudaStream_t s, const FlashPlan& plan, const float* q, const void* k, const void* v,
                                  int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t kv_len, int64_t q_offset,
                                  const int64_t* qpos, float scale, float* out, float* part);
// Merges `splits` partial (max, sum, accumulator) triples per (row, head) into out [T, Hq, Dv]
// (part as launch_attention and launch_flash_attention write it).
void launch_attention_merge(cudaStream_t s, const float* part, int64_t T, int64_t Hq, int64_t Dv, int splits,
                            float* out);
inline int64_t split_part_floats(int64_t T, int64_t Hq, int64_t Dv, int splits) {
  return T * Hq * splits * (Dv + 2);
}

// Gated delta rule over T tokens from state [Hv, dk, dv] (advanced in place); transition
// [Hv, dk, dk] (may be null) receives T_C of the span, computed in the same pass.
void launch_gated_delta_rule(cudaStream_t s, const float* q, const float* k, const float* v, const float* g,
                             const float* beta, bool l2norm_qk, int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                             int64_t dv, float* state, float* out, float* transition);

// The same in chunked (WY) form (gated_delta_chunked.cu): three kernels, the sequential part only
// over chunks of 64 tokens. Needs dk in {64, 128, 256}, dv <= 256, 16-byte aligned q and k, and a
// workspace of gated_delta_chunked_workspace_floats(...) floats.
constexpr int64_t kGdnChunkedMin = 128;  // shorter spans stay on the token kernel
bool gated_delta_chunked_supported(const float* q, const float* k, int64_t dk, int64_t dv);
int64_t gated_delta_chunked_workspace_floats(int64_t T, int64_t Hv, int64_t dk, int64_t dv);
void launch_gated_delta_rule_chunked(cudaStream_t s, const float* q, const float* k, const float* v, const float* g,
                                     const float* beta, bool l2norm_qk, int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                                     int64_t dv, float* state, float* out, float* transition, float* workspace);

// The chunked form on the tensor cores (gated_delta_chunked_tc.cu): bf16 operands, f32
// accumulation and f32 state, for dk = 128 and dv a multiple of 32 up to 256; the f32 chunked
// kernel above is its reference and the precise-mode path. Workspace in bytes.
bool gated_delta_chunked_tc_supported(const float* q, const float* k, const float* v, const float* out, int64_t dk,
                                      int64_t dv);
int64_t gated_delta_chunked_tc_workspace_bytes(int64_t T, int64_t Hv, int64_t dk, int64_t dv);
void launch_gated_delta_rule_chunked_tc(cudaStream_t s, const float* q, const float* k, const float* v, const float* g,
                                        const float* beta, bool l2norm_qk, int64_t T, int64_t Hk, int64_t Hv,
                                        int64_t dv, float* state, float* out, float* transition, void* workspace);

// A PIC composition's chain of links over one state [Hv, dk, dv] (gated_delta_chain.cu): per
// link, the recurrence over its next `rows` rows of q/k/v/g/beta (outputs to out), then a compact
// body's recurrence inputs replayed (rk as keys and queries), then S <- T S + B (T null: S + B;
// B null: nothing). The table lives on the device.
struct GdnChainLink {
  int64_t rows = 0, replay_rows = 0;
  const float *rk = nullptr, *rv = nullptr, *rg = nullptr, *rbeta = nullptr;
  const void* T = nullptr;  // [Hv, dk, dk], f32 or (t_bf16) bf16
  const float* B = nullptr;
  bool t_bf16 = false;
};
void launch_gated_delta_chain(cudaStream_t s, const float* q, const float* k, const float* v, const float* g,
                              const float* beta, bool l2norm_qk, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                              float* state, float* out, const GdnChainLink* links, int n_links, bool aligned_t);
// Rows of S per thread in the chain kernel: 8 (the default), 4 or 32; 0: HYPIC_GDN_CHAIN_ROWS or 8.
// For tests and A/B measurements.
void set_gdn_chain_rows(int rows);
// Dense bodies' T staged whole in shared memory (on by default where it fits and every T is 16-byte
// aligned: aligned_t above) or a panel at a time; for tests and A/B measurements.
void set_gdn_chain_full_t(bool on);

// ---- decode steps: one token per sequence, per-sequence state addresses in device tables ------
// (I64 arrays of B addresses; the key and value caches' tables are [2B]: keys, then values)
void launch_conv1d_step(cudaStream_t s, const float* x, const void* w, DType wdt, const int64_t* states, float* out,
                        int64_t B, int64_t C, int64_t K);
void launch_gated_delta_rule_step(cudaStream_t s, const float* q, const float* k, const float* v, const float* g,
                                  const float* beta, bool l2norm_qk, int64_t B, int64_t Hk, int64_t Hv, int64_t dk,
                                  int64_t dv, const int64_t* states, float* out);
void launch_kv_write(cudaStream_t s, const float* k, const float* v, const int64_t* caches, const int64_t* positions,
                     int64_t B, int64_t Hkv, int64_t D, int64_t Dv);
// Key splits per sequence of a step: fixed by the batch and head counts alone (never by the
// lengths), so a captured step stays valid as the sequences grow.
int attention_step_splits(int64_t B, int64_t Hq, int64_t Hkv);
inline int64_t attention_step_part_floats(int64_t B, int64_t Hq, int64_t Hkv, int64_t Dv) {
  return B * Hq * attention_step_splits(B, Hq, Hkv) * (Dv + 2);
}
void launch_attention_step(cudaStream_t s, const float* q, const int64_t* caches, const int64_t* positions, int64_t B,
                           int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, float scale, float* out, float* part);

// One piece of a shared entry's payload: `bytes` at device address `data`, its first 4-byte word at
// word index base_word of the payload (Backend::payload_checksum).
struct ChecksumPiece {
  const void* data;
  uint64_t bytes;
  uint64_t base_word;
};
// *out = the payload checksum of the pieces (device array of n_pieces); max_bytes: the largest piece.
void launch_payload_checksum(cudaStream_t s, const ChecksumPiece* pieces, int n_pieces, uint64_t max_bytes,
                             unsigned long long* out);

// ---- Mamba2 (Nemotron-H) and MiniMax pieces (mamba2.cu, elementwise.cu) -------------------------
// Kimi-Linear's KDA gates (Backend::kda_gates): a, g [T, H, dk]; b, beta [T, H].
void launch_kda_gates(cudaStream_t s, const float* a, const float* b, const float* A, const float* dt_bias, float* g,
                      float* beta, int64_t T, int64_t H, int64_t dk);
// out = a x + b y over n floats.
void launch_scale_add(cudaStream_t s, const float* x, float a, const float* y, float b, float* out, int64_t n);
// x <- silu(x) (act 0) or max(x, 0)^2 (act 1) over n floats.
void launch_activate(cudaStream_t s, int act, float* x, int64_t n);
// Depthwise causal conv1d + bias + SiLU over x [T, C] (w [C, K], bias [C]); state [K-1, C] holds
// the inputs before row 0 and is advanced.
void launch_conv1d_bias_silu(cudaStream_t s, const float* x, const float* w, const float* bias, float* state,
                             float* out, int64_t T, int64_t C, int64_t K);
// The same over runs of rows with a state each (device arrays: run_rows [runs + 1] prefix, states
// [runs]); max_run the longest run.
void launch_conv1d_bias_silu_runs(cudaStream_t s, const float* x, const float* w, const float* bias,
                                  float* const* states, const int64_t* run_rows, int64_t runs, int64_t max_run,
                                  float* out, int64_t C, int64_t K);
void launch_mamba2_gates(cudaStream_t s, const float* dt_raw, const float* x, const float* A, const float* dt_bias,
                         float dt_min, float* g, float* v, int64_t T, int64_t H, int64_t P);
void launch_mamba2_gated_norm(cudaStream_t s, const float* y, const float* x, const float* z, const float* D,
                              const float* w, float eps, float* out, int64_t T, int64_t C, int64_t P, int64_t groups);

// ---- the other families' recurrences (linear_recurrence.cu) ------------------------------------
// One span of a linear::Family's recurrence (linear/recurrence.h), token by token. q, k [T, Hk, dk];
// v, out [T, Hv, dv]; state [Hv, dk, dv] advanced in place. decay follows linear::Decay: 0 none,
// 1 fixed (log_gamma [Hv]), 2 scalar (g [T, Hv]), 3 channel (g [T, Hv, dk]); beta [T, Hv] when
// delta. transition (dense [Hv, dk, dk]) and t_factor ([Hv], the factor of a scaled identity, for
// decays 0-2 without delta) receive T_C of the span when set. dk <= kLinearRecurrenceMaxDk.
constexpr int64_t kLinearRecurrenceMaxDk = 128;
struct LinearRecurrenceArgs {
  const float *q = nullptr, *k = nullptr, *v = nullptr;
  const float *g = nullptr, *beta = nullptr, *log_gamma = nullptr;
  int decay = 0;
  bool delta = false, l2norm = false;
  float q_scale = 1.f;
  int64_t T = 0, Hk = 1, Hv = 0, dk = 0, dv = 0;
  float *state = nullptr, *out = nullptr;
  float *transition = nullptr, *t_factor = nullptr;
  // Several sequences' runs in one launch (no transitions): run z is rows [run_rows[z],
  // run_rows[z + 1]) from the state at run_states[z] (both device arrays of runs (+ 1) entries).
  int64_t runs = 0, max_run = 0;
  const int64_t* run_rows = nullptr;
  float* const* run_states = nullptr;
};
void launch_linear_recurrence(cudaStream_t s, const LinearRecurrenceArgs& a);
// out = alpha * t[h] * S + B per head (a scaled-identity transition), n floats a head; out may be B.
void launch_compose_scaled(cudaStream_t s, const float* t, const float* S, const float* B, float alpha, float* out,
                           int64_t H, int64_t n);

}  // namespace hypic::cuda
