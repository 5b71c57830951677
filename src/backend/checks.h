// Argument checks shared by every backend: each op validates dtypes, ranks, shapes and the device
// of its tensors before touching memory and throws std::invalid_argument("<op>: <what>") naming the
// tensors involved, so a bad call fails the same way on the CPU and on the GPU.
#pragma once
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

#include "backend/backend.h"
#include "tensor/tensor.h"

namespace hypic::checks {

[[noreturn]] inline void fail(const char* op, const std::string& msg) {
  throw std::invalid_argument(std::string(op) + ": " + msg);
}

inline void need_def(const char* op, const char* name, const Tensor& t, DeviceKind dev = DeviceKind::CPU) {
  if (!t.defined()) fail(op, std::string(name) + " is undefined");
  if (t.device().kind != dev)
    fail(op, std::string(name) + " " + t.str() + " is on " + t.device().str() + ", not on the " +
                 (dev == DeviceKind::CPU ? "cpu" : "cuda") + " device");
}

inline void need_f32(const char* op, const char* name, const Tensor& t, DeviceKind dev = DeviceKind::CPU) {
  need_def(op, name, t, dev);
  if (t.dtype() != DType::F32) fail(op, std::string(name) + " " + t.str() + ": must be f32");
}

inline bool is_half_or_f32(DType d) {
  return d == DType::F32 || d == DType::BF16 || d == DType::F16;
}

inline void need_float(const char* op, const char* name, const Tensor& t, DeviceKind dev = DeviceKind::CPU) {
  need_def(op, name, t, dev);
  if (!is_half_or_f32(t.dtype())) fail(op, std::string(name) + " " + t.str() + ": must be f32, bf16 or f16");
}

// A weight of a product: a float dtype, or on the CPU a quantized one (tensor/quant.h).
inline void need_weight(const char* op, const char* name, const Tensor& t, DeviceKind dev) {
  need_def(op, name, t, dev);
  if (dtype_is_quantized(t.dtype()) && dev == DeviceKind::CPU) return;
  if (!is_half_or_f32(t.dtype()))
    fail(op, std::string(name) + " " + t.str() + ": must be f32, bf16 or f16" +
                 (dev == DeviceKind::CPU ? ", or q8_0, q4_k or q6_k" : " (quantized weights run on the CPU only)"));
}

inline void need_ndim(const char* op, const char* name, const Tensor& t, int nd) {
  if (t.ndim() != nd)
    fail(op, std::string(name) + " " + t.str() + ": expected " + std::to_string(nd) + " dims, got " +
                 std::to_string(t.ndim()));
}

inline void need_shape(const char* op, const char* name, const Tensor& t, const Shape& s) {
  if (t.shape() != s) fail(op, std::string(name) + " " + t.str() + ": expected shape " + shape_str(s));
}

inline int64_t last_dim(const Tensor& t) {
  return t.ndim() == 0 ? 1 : t.dim(-1);
}
inline int64_t rows_of(const Tensor& t) {
  int64_t d = last_dim(t);
  return d == 0 ? 0 : t.numel() / d;
}

// Address ranges intersect (valid for host and device pointers alike: both are flat addresses).
inline bool overlaps(const Tensor& a, const Tensor& b) {
  auto pa = static_cast<const char*>(a.raw()), pb = static_cast<const char*>(b.raw());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes() && a.nbytes() && b.nbytes();
}

// Per-op checks (op_checks.cpp), one per op of backend.h, used by every backend.
void check_matmul(const Tensor& x, const Tensor& w, const Tensor& y, DeviceKind dev);
void check_embedding(const Tensor& table, std::span<const int32_t> ids, const Tensor& out, DeviceKind dev);
void check_rms_norm(const Tensor& x, const Tensor* z, const Tensor& w, const Tensor& out, DeviceKind dev);  // z: gated
void check_binary(const char* op, const char* an, const Tensor& a, const char* bn, const Tensor& b, const Tensor& out,
                  DeviceKind dev);
// true: gate is [rows, 1], one gate per row.
bool check_sigmoid_mul(const Tensor& x, const Tensor& gate, const Tensor& out, DeviceKind dev);
void check_cols(const char* op, const Tensor& wide, const Tensor& narrow, int64_t col, const char* wn, const char* nn,
                DeviceKind dev);
void check_rope(const Tensor& x, size_t positions, int rot_dim, double theta, DeviceKind dev);
void check_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t kv_len, int64_t q_offset,
                     const Tensor& out, DeviceKind dev);
void check_conv1d(const Tensor& x, const Tensor& w, const Tensor& state, const Tensor& out, DeviceKind dev);
// out: the result's column blocks (one [T, C] tensor, or [T, C_i] with sum C_i = C).
void check_conv1d_spans(const Tensor& x, const Tensor& w, std::span<const Backend::ConvSpan> spans, const Tensor& state,
                        std::span<const Tensor> out, DeviceKind dev);
void check_copy_rows(std::span<const Backend::RowCopy> pieces, int rot_dim, double theta, DeviceKind dev);
void check_gather_col_blocks(const Tensor& src, std::span<const int64_t> order, const Tensor& dst, DeviceKind dev);
void check_convert(const Tensor& src, const Tensor& dst, DeviceKind dev);
void check_gdn_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, const Tensor& g,
                     const Tensor& beta, DeviceKind dev);
void check_gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                            const Tensor& state, const Tensor& out, const Tensor* transition, DeviceKind dev);
void check_linear_recurrence(const Backend::Recurrence& r, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& g, const Tensor& beta, const Tensor& log_gamma, const Tensor& state,
                             const Tensor& out, const Tensor* transition, DeviceKind dev);
void check_conv_bias(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& state, const Tensor& out,
                     DeviceKind dev);
void check_mamba2_gates(const Tensor& dt_raw, const Tensor& x, const Tensor& A, const Tensor& dt_bias, const Tensor& g,
                        const Tensor& v, DeviceKind dev);
void check_mamba2_gated_norm(const Tensor& y, const Tensor& x, const Tensor& z, const Tensor& D, const Tensor& w,
                             int64_t groups, const Tensor& out, DeviceKind dev);
void check_kda_gates(const Tensor& a, const Tensor& b, const Tensor& A, const Tensor& dt_bias, const Tensor& g,
                     const Tensor& beta, DeviceKind dev);
void check_compose_state(const Tensor& T, const Tensor& S, const Tensor& B, const Tensor& out, DeviceKind dev);
void check_set_identity(const Tensor& t, DeviceKind dev);
// Decode-step tables: an I64 tensor of n entries (addresses or positions) on dev.
void check_step_table(const char* op, const char* name, const Tensor& t, int64_t n, DeviceKind dev);
void check_conv1d_step(const Tensor& x, const Tensor& w, const Tensor& states, const Tensor& out, DeviceKind dev);
void check_gated_delta_rule_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                 const Tensor& states, const Tensor& out, DeviceKind dev);
void check_attention_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& caches,
                          const Tensor& positions, const Tensor& out, DeviceKind dev);
// x F32 [R, V] (V >= 1), params F32 [R, 3], mask U8 [V] or undefined, ids I32 [R].
void check_sample_rows(const Tensor& x, const Tensor& params, const Tensor& mask, const Tensor& ids, DeviceKind dev);
// Returns the experts' intermediate size.
int64_t check_moe(const Tensor& x, const Tensor& router_logits, const MoeRouter& router, const ExpertWeights& experts,
                  const Tensor& out, DeviceKind dev);
// moe_experts_add's shared expert output [T, H] and gate logit [T, 1] (both or neither defined).
void check_moe_shared(const Tensor& shared, const Tensor& shared_gate, const Tensor& x, DeviceKind dev);

}  // namespace hypic::checks
