// Argument checks of every op, shared by the backends (declared in checks.h): the CPU and the GPU
// reject the same calls with the same messages.
#include <string>
#include <vector>

#include "backend/checks.h"

namespace hypic::checks {

void check_matmul(const Tensor& x, const Tensor& w, const Tensor& y, DeviceKind dev) {
  const char* op = "matmul";
  need_f32(op, "x", x, dev);
  need_weight(op, "w", w, dev);
  need_f32(op, "y", y, dev);
  need_ndim(op, "x", x, 2);
  need_ndim(op, "w", w, 2);
  need_ndim(op, "y", y, 2);
  const int64_t M = x.dim(0), K = x.dim(1), N = w.dim(0);
  if (w.dim(1) != K) fail(op, "x " + x.str() + " and w " + w.str() + ": inner dims differ");
  if (y.dim(0) != M || y.dim(1) != N)
    fail(op, "y " + y.str() + ": expected shape " + shape_str({M, N}) + " for x " + x.str() + " and w " + w.str());
  if (overlaps(y, x) || overlaps(y, w)) fail(op, "y " + y.str() + " overlaps an input");
}

void check_embedding(const Tensor& table, std::span<const int32_t> ids, const Tensor& out, DeviceKind dev) {
  const char* op = "embedding";
  need_weight(op, "table", table, dev);
  need_f32(op, "out", out, dev);
  need_ndim(op, "table", table, 2);
  const int64_t V = table.dim(0), H = table.dim(1), n = static_cast<int64_t>(ids.size());
  need_shape(op, "out", out, {n, H});
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= V)
      fail(op, "id " + std::to_string(ids[i]) + " at " + std::to_string(i) + " out of range for table " + table.str());
}

void check_rms_norm(const Tensor& x, const Tensor* z, const Tensor& w, const Tensor& out, DeviceKind dev) {
  const char* op = z ? "rms_norm_gated" : "rms_norm";
  need_f32(op, "x", x, dev);
  if (z) need_f32(op, "z", *z, dev);
  need_float(op, "w", w, dev);
  need_f32(op, "out", out, dev);
  if (x.ndim() == 0) fail(op, "x " + x.str() + ": needs at least one dim");
  if (z) need_shape(op, "z", *z, x.shape());
  need_ndim(op, "w", w, 1);
  if (w.dim(0) != last_dim(x)) fail(op, "w " + w.str() + " does not match the last dim of x " + x.str());
  need_shape(op, "out", out, x.shape());
}

void check_binary(const char* op, const char* an, const Tensor& a, const char* bn, const Tensor& b, const Tensor& out,
                  DeviceKind dev) {
  need_f32(op, an, a, dev);
  need_f32(op, bn, b, dev);
  need_f32(op, "out", out, dev);
  if (a.shape() != b.shape())
    fail(op, std::string(an) + " " + a.str() + " and " + bn + " " + b.str() + ": shapes differ");
  need_shape(op, "out", out, a.shape());
}

bool check_sigmoid_mul(const Tensor& x, const Tensor& gate, const Tensor& out, DeviceKind dev) {
  if (gate.defined() && x.defined() && gate.ndim() == 2 && gate.dim(1) == 1 && last_dim(x) != 1) {
    const char* op = "sigmoid_mul";
    need_f32(op, "x", x, dev);
    need_f32(op, "gate", gate, dev);
    need_f32(op, "out", out, dev);
    if (rows_of(x) != gate.dim(0) || out.numel() != x.numel())
      fail(op, "x " + x.str() + ", gate " + gate.str() + " and out " + out.str() + ": shapes differ");
    return true;
  }
  check_binary("sigmoid_mul", "x", x, "gate", gate, out, dev);
  return false;
}

void check_cols(const char* op, const Tensor& wide, const Tensor& narrow, int64_t col, const char* wn, const char* nn,
                DeviceKind dev) {
  need_def(op, wn, wide, dev);
  need_def(op, nn, narrow, dev);
  if (wide.dtype() != narrow.dtype())
    fail(op, std::string(wn) + " " + wide.str() + " and " + nn + " " + narrow.str() + ": dtypes differ");
  if (wide.ndim() < 1 || narrow.ndim() < 1) fail(op, "tensors need at least one dim");
  if (rows_of(wide) != rows_of(narrow) && last_dim(narrow) != 0 && last_dim(wide) != 0)
    fail(op, std::string(wn) + " " + wide.str() + " and " + nn + " " + narrow.str() + ": row counts differ");
  if (col < 0 || col + last_dim(narrow) > last_dim(wide))
    fail(op, "columns [" + std::to_string(col) + ", " + std::to_string(col + last_dim(narrow)) + ") out of range of " +
                 wn + " " + wide.str());
  if (overlaps(wide, narrow)) fail(op, "src and dst overlap");
}

void check_gather_col_blocks(const Tensor& src, std::span<const int64_t> order, const Tensor& dst, DeviceKind dev) {
  const char* op = "gather_col_blocks";
  need_float(op, "src", src, dev);
  need_def(op, "dst", dst, dev);
  if (src.dtype() != dst.dtype()) fail(op, "src " + src.str() + " and dst " + dst.str() + ": dtypes differ");
  if (src.ndim() < 1 || dst.ndim() < 1) fail(op, "tensors need at least one dim");
  if (last_dim(src) != last_dim(dst) || rows_of(src) != rows_of(dst))
    fail(op, "src " + src.str() + " and dst " + dst.str() + " differ in rows or columns");
  const int64_t n = static_cast<int64_t>(order.size()), C = last_dim(src);
  if (n == 0 || C % n != 0)
    fail(op, std::to_string(n) + " blocks do not divide the " + std::to_string(C) + " columns of src " + src.str());
  std::vector<bool> seen(static_cast<size_t>(n));
  for (int64_t b : order) {
    if (b < 0 || b >= n || seen[static_cast<size_t>(b)])
      fail(op, "the block order is not a permutation of " + std::to_string(n) + " blocks");
    seen[static_cast<size_t>(b)] = true;
  }
  if (overlaps(src, dst)) fail(op, "src and dst overlap");
}

void check_rope(const Tensor& x, size_t positions, int rot_dim, double theta, DeviceKind dev) {
  const char* op = "rope_neox";
  need_f32(op, "x", x, dev);
  need_ndim(op, "x", x, 3);
  const int64_t T = x.dim(0), D = x.dim(2);
  if (static_cast<int64_t>(positions) != T)
    fail(op, "x " + x.str() + " has " + std::to_string(T) + " rows but " + std::to_string(positions) + " positions");
  if (rot_dim <= 0 || rot_dim % 2 != 0 || rot_dim > D)
    fail(op, "rot_dim " + std::to_string(rot_dim) + " must be even, positive and <= head dim of x " + x.str());
  if (!(theta > 0)) fail(op, "theta must be positive");
}

// q, k, v and out of an attention op: f32 on dev, three dims each.
static void need_attention_tensors(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                   DeviceKind dev) {
  need_f32(op, "q", q, dev);
  need_f32(op, "k", k, dev);
  need_f32(op, "v", v, dev);
  need_f32(op, "out", out, dev);
  need_ndim(op, "q", q, 3);
  need_ndim(op, "k", k, 3);
  need_ndim(op, "v", v, 3);
}

void check_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t kv_len, int64_t q_offset,
                     const Tensor& out, DeviceKind dev) {
  const char* op = "attention";
  need_attention_tensors(op, q, k, v, out, dev);
  const int64_t T = q.dim(0), Hq = q.dim(1), D = q.dim(2), S = k.dim(0), Hkv = k.dim(1), Dv = v.dim(2);
  if (k.dim(2) != D) fail(op, "q " + q.str() + " and k " + k.str() + ": head dims differ");
  if (v.dim(0) != S || v.dim(1) != Hkv) fail(op, "k " + k.str() + " and v " + v.str() + ": rows or heads differ");
  if (Hkv <= 0 || Hq % Hkv != 0)
    fail(op, "q " + q.str() + " and k " + k.str() + ": query heads not a multiple of kv heads");
  need_shape(op, "out", out, {T, Hq, Dv});
  if (kv_len < 0 || kv_len > S) fail(op, "kv_len " + std::to_string(kv_len) + " out of range for k " + k.str());
  if (q_offset < 0) fail(op, "q_offset " + std::to_string(q_offset) + " is negative");
  if (T > 0 && kv_len == 0) fail(op, "kv_len is 0: no keys to attend to");
  if (overlaps(out, q) || overlaps(out, k) || overlaps(out, v)) fail(op, "out overlaps an input");
}

namespace {
// x, w and state of a conv; returns C.
int64_t check_conv1d_inputs(const char* op, const Tensor& x, const Tensor& w, const Tensor& state, DeviceKind dev) {
  need_f32(op, "x", x, dev);
  need_float(op, "w", w, dev);
  need_f32(op, "state", state, dev);
  need_ndim(op, "x", x, 2);
  const int64_t C = x.dim(1);
  // w: [C, K] (or torch's [C, 1, K]).
  if (!(w.ndim() == 2 || (w.ndim() == 3 && w.dim(1) == 1))) fail(op, "w " + w.str() + ": expected [C, K] or [C, 1, K]");
  const int64_t K = w.dim(-1);
  if (w.dim(0) != C) fail(op, "w " + w.str() + " and x " + x.str() + ": channel counts differ");
  if (K < 1) fail(op, "w " + w.str() + ": kernel size must be >= 1");
  need_shape(op, "state", state, {K - 1, C});
  if (overlaps(state, x)) fail(op, "x and state must not overlap");
  return C;
}
}  // namespace

void check_conv1d(const Tensor& x, const Tensor& w, const Tensor& state, const Tensor& out, DeviceKind dev) {
  const char* op = "causal_conv1d_silu";
  check_conv1d_inputs(op, x, w, state, dev);
  need_f32(op, "out", out, dev);
  need_shape(op, "out", out, {x.dim(0), x.dim(1)});
  if (overlaps(out, x) || overlaps(out, state) || overlaps(out, w)) fail(op, "out, x and state must not overlap");
}

void check_conv1d_spans(const Tensor& x, const Tensor& w, std::span<const Backend::ConvSpan> spans, const Tensor& state,
                        std::span<const Tensor> out_cols, DeviceKind dev) {
  const char* op = "causal_conv1d_silu_spans";
  const int64_t C = check_conv1d_inputs(op, x, w, state, dev);
  if (out_cols.empty()) fail(op, "no output");
  int64_t cols = 0;
  for (size_t i = 0; i < out_cols.size(); ++i) {
    const Tensor& o = out_cols[i];
    const std::string name = out_cols.size() == 1 ? std::string("out") : "out block " + std::to_string(i);
    need_f32(op, name.c_str(), o, dev);
    need_ndim(op, name.c_str(), o, 2);
    if (o.dim(0) != x.dim(0)) fail(op, name + " " + o.str() + " and x " + x.str() + ": row counts differ");
    if (overlaps(o, x) || overlaps(o, state) || overlaps(o, w)) fail(op, name + ", x and state must not overlap");
    for (size_t j = 0; j < i; ++j)
      if (overlaps(o, out_cols[j])) fail(op, name + " overlaps block " + std::to_string(j));
    cols += o.dim(1);
  }
  if (cols != C)
    fail(op, "out covers " + std::to_string(cols) + " columns, x " + x.str() + " has " + std::to_string(C));
  int64_t rows = 0;
  for (const auto& sp : spans) {
    if (sp.rows < 0) fail(op, "a span of " + std::to_string(sp.rows) + " rows");
    rows += sp.rows;
    if (sp.after) {
      need_f32(op, "after", *sp.after, dev);
      need_shape(op, "after", *sp.after, state.shape());
      if (overlaps(*sp.after, state)) fail(op, "after overlaps state");
      for (const Tensor& o : out_cols)
        if (overlaps(*sp.after, o)) fail(op, "after overlaps out");
    }
  }
  if (rows != x.dim(0))
    fail(op, "spans cover " + std::to_string(rows) + " rows, x " + x.str() + " has " + std::to_string(x.dim(0)));
}

void check_convert(const Tensor& src, const Tensor& dst, DeviceKind dev) {
  const char* op = "convert";
  need_float(op, "src", src, dev);
  need_float(op, "dst", dst, dev);
  if (src.numel() != dst.numel()) fail(op, "src " + src.str() + " and dst " + dst.str() + " differ in size");
  if (src.dtype() != DType::F32 && dst.dtype() != DType::F32 && src.dtype() != dst.dtype())
    fail(op, "src " + src.str() + " to dst " + dst.str() + ": one side must be f32");
}

void check_copy_rows(std::span<const Backend::RowCopy> pieces, int rot_dim, double theta, DeviceKind dev) {
  const char* op = "copy_rows";
  struct Range {
    const char *a, *b;
  };
  std::vector<Range> reads, writes;
  for (const auto& p : pieces) {
    if (!p.src || !p.dst) fail(op, "a piece without src or dst");
    need_def(op, "src", *p.src, dev);
    need_def(op, "dst", *p.dst, dev);
    const Tensor &s = *p.src, &d = *p.dst;
    if (s.ndim() == 0 || d.ndim() == 0) fail(op, "src " + s.str() + " and dst " + d.str() + " need rows");
    if (s.dtype() != d.dtype()) fail(op, "src " + s.str() + " and dst " + d.str() + ": dtypes differ");
    const int64_t ws = s.dim(0) ? s.numel() / s.dim(0) : 0, wd = d.dim(0) ? d.numel() / d.dim(0) : 0;
    if (ws != wd && p.rows > 0) fail(op, "src " + s.str() + " and dst " + d.str() + ": row sizes differ");
    if (p.rows < 0 || p.src_row < 0 || p.dst_row < 0 || p.src_row + p.rows > s.dim(0) || p.dst_row + p.rows > d.dim(0))
      fail(op, std::to_string(p.rows) + " rows from row " + std::to_string(p.src_row) + " of src " + s.str() +
                   " to row " + std::to_string(p.dst_row) + " of dst " + d.str() + ": out of range");
    if (p.rope_shift != 0) {
      if (s.dtype() != DType::F32 || d.ndim() != 3)
        fail(op, "a rotated piece needs f32 [rows, H, D] tensors, got dst " + d.str());
      if (rot_dim <= 0 || rot_dim % 2 != 0 || rot_dim > d.dim(2))
        fail(op, "rot_dim " + std::to_string(rot_dim) + " must be even, positive and <= the head dim of " + d.str());
      if (!(theta > 0)) fail(op, "theta must be positive");
    }
    if (p.rows == 0) continue;
    const size_t rb = s.nbytes() / static_cast<size_t>(s.dim(0));
    auto at = [&](const Tensor& t, int64_t r) {
      return static_cast<const char*>(t.raw()) + rb * static_cast<size_t>(r);
    };
    reads.push_back({at(s, p.src_row), at(s, p.src_row + p.rows)});
    writes.push_back({at(d, p.dst_row), at(d, p.dst_row + p.rows)});
  }
  // Pieces run in any order on the GPU (a few hundred per call: pairs are cheap to check).
  auto cross = [](const Range& u, const Range& v) { return u.a < v.b && v.a < u.b; };
  for (size_t i = 0; i < writes.size(); ++i)
    for (size_t j = 0; j < writes.size(); ++j)
      if (cross(writes[i], reads[j]) || (i < j && cross(writes[i], writes[j])))
        fail(op, "piece " + std::to_string(i) + " writes where piece " + std::to_string(j) + " reads or writes");
}

void check_gdn_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, const Tensor& g,
                     const Tensor& beta, DeviceKind dev) {
  const char* op = "gdn_gates";
  need_f32(op, "a", a, dev);
  need_f32(op, "b", b, dev);
  need_float(op, "A_log", A_log, dev);
  need_float(op, "dt_bias", dt_bias, dev);
  need_f32(op, "g", g, dev);
  need_f32(op, "beta", beta, dev);
  need_ndim(op, "a", a, 2);
  const int64_t H = a.dim(1);
  need_shape(op, "b", b, a.shape());
  need_shape(op, "A_log", A_log, {H});
  need_shape(op, "dt_bias", dt_bias, {H});
  need_shape(op, "g", g, a.shape());
  need_shape(op, "beta", beta, a.shape());
}

namespace {
// The q, k, v, state and out of a linear recurrence over a span: f32 on the device, q and k
// [T, Hk, dk], v [T, Hv, dv] with Hv a multiple of Hk.
void need_qkv_span(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& state,
                   const Tensor& out, DeviceKind dev) {
  need_f32(op, "q", q, dev);
  need_f32(op, "k", k, dev);
  need_f32(op, "v", v, dev);
  need_f32(op, "state", state, dev);
  need_f32(op, "out", out, dev);
  need_ndim(op, "q", q, 3);
  need_ndim(op, "v", v, 3);
  need_shape(op, "k", k, q.shape());
  if (v.dim(0) != q.dim(0)) fail(op, "v " + v.str() + " and q " + q.str() + ": token counts differ");
  if (q.dim(1) <= 0 || v.dim(1) % q.dim(1) != 0)
    fail(op, "v " + v.str() + " and k " + k.str() + ": value heads not a multiple of key heads");
}
}  // namespace

void check_gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                            const Tensor& state, const Tensor& out, const Tensor* transition, DeviceKind dev) {
  const char* op = "gated_delta_rule";
  need_qkv_span(op, q, k, v, state, out, dev);
  need_f32(op, "g", g, dev);
  need_f32(op, "beta", beta, dev);
  const int64_t T = q.dim(0), dk = q.dim(2), Hv = v.dim(1), dv = v.dim(2);
  need_shape(op, "g", g, {T, Hv});
  need_shape(op, "beta", beta, {T, Hv});
  need_shape(op, "state", state, {Hv, dk, dv});
  need_shape(op, "out", out, {T, Hv, dv});
  if (transition && transition->defined()) {
    need_f32(op, "transition", *transition, dev);
    need_shape(op, "transition", *transition, {Hv, dk, dk});
  }
}

void check_linear_recurrence(const Backend::Recurrence& r, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& g, const Tensor& beta, const Tensor& log_gamma, const Tensor& state,
                             const Tensor& out, const Tensor* transition, DeviceKind dev) {
  const char* op = "linear_recurrence";
  const linear::FamilyTraits tr = linear::traits(r.family);
  need_qkv_span(op, q, k, v, state, out, dev);
  const int64_t T = q.dim(0), dk = q.dim(2), Hv = v.dim(1), dv = v.dim(2);
  const std::string fam(tr.name);
  auto need_absent = [&](const char* name, const Tensor& t) {
    if (t.defined()) fail(op, std::string(name) + " " + t.str() + ": the " + fam + " family takes none");
  };
  if (tr.decay == linear::Decay::Scalar || tr.decay == linear::Decay::Channel) {
    need_f32(op, "g", g, dev);
    if (tr.decay == linear::Decay::Scalar)
      need_shape(op, "g", g, {T, Hv});
    else
      need_shape(op, "g", g, {T, Hv, dk});
  } else {
    need_absent("g", g);
  }
  if (tr.delta) {
    need_f32(op, "beta", beta, dev);
    need_shape(op, "beta", beta, {T, Hv});
  } else {
    need_absent("beta", beta);
  }
  if (tr.decay == linear::Decay::FixedScalar) {
    need_f32(op, "log_gamma", log_gamma, dev);
    need_shape(op, "log_gamma", log_gamma, {Hv});
  } else {
    need_absent("log_gamma", log_gamma);
  }
  need_shape(op, "state", state, {Hv, dk, dv});
  need_shape(op, "out", out, {T, Hv, dv});
  if (overlaps(out, state)) fail(op, "out overlaps state");
  if (transition && transition->defined()) {
    need_f32(op, "transition", *transition, dev);
    const bool scalar = !tr.delta && tr.decay != linear::Decay::Channel;
    if (transition->ndim() == 3 && transition->dim(1) == 1 && transition->dim(2) == 1 && dk != 1) {
      if (!scalar)
        fail(op, "transition " + transition->str() + ": the " + fam + " family's T_C is not a scaled identity");
      need_shape(op, "transition", *transition, {Hv, 1, 1});
    } else {
      need_shape(op, "transition", *transition, {Hv, dk, dk});
    }
  }
}

void check_conv_bias(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& state, const Tensor& out,
                     DeviceKind dev) {
  const char* op = "causal_conv1d_bias_silu";
  need_f32(op, "x", x, dev);
  need_f32(op, "w", w, dev);
  need_f32(op, "bias", bias, dev);
  need_f32(op, "state", state, dev);
  need_f32(op, "out", out, dev);
  need_ndim(op, "x", x, 2);
  need_ndim(op, "w", w, 2);
  const int64_t C = x.dim(1), K = w.dim(1);
  if (w.dim(0) != C) fail(op, "w " + w.str() + " does not match the channels of x " + x.str());
  if (K < 1) fail(op, "w " + w.str() + ": kernel width must be at least 1");
  need_shape(op, "bias", bias, {C});
  need_shape(op, "state", state, {K - 1, C});
  need_shape(op, "out", out, x.shape());
  if (overlaps(out, x) || overlaps(out, state)) fail(op, "out overlaps an input");
}

void check_mamba2_gates(const Tensor& dt_raw, const Tensor& x, const Tensor& A, const Tensor& dt_bias, const Tensor& g,
                        const Tensor& v, DeviceKind dev) {
  const char* op = "mamba2_gates";
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"dt_raw", &dt_raw},
                      {"x", &x},
                      {"A", &A},
                      {"dt_bias", &dt_bias},
                      {"g", &g},
                      {"v", &v}})
    need_f32(op, n, *t, dev);
  need_ndim(op, "dt_raw", dt_raw, 2);
  need_ndim(op, "x", x, 3);
  const int64_t T = x.dim(0), H = x.dim(1);
  need_shape(op, "dt_raw", dt_raw, {T, H});
  need_shape(op, "A", A, {H});
  need_shape(op, "dt_bias", dt_bias, {H});
  need_shape(op, "g", g, {T, H});
  need_shape(op, "v", v, x.shape());
}

void check_mamba2_gated_norm(const Tensor& y, const Tensor& x, const Tensor& z, const Tensor& D, const Tensor& w,
                             int64_t groups, const Tensor& out, DeviceKind dev) {
  const char* op = "mamba2_gated_norm";
  for (auto [n, t] :
       {std::pair<const char*, const Tensor*>{"y", &y}, {"x", &x}, {"z", &z}, {"D", &D}, {"w", &w}, {"out", &out}})
    need_f32(op, n, *t, dev);
  need_ndim(op, "y", y, 2);
  need_ndim(op, "D", D, 1);
  const int64_t C = y.dim(1), H = D.dim(0);
  need_shape(op, "x", x, y.shape());
  need_shape(op, "z", z, y.shape());
  need_shape(op, "out", out, y.shape());
  need_shape(op, "w", w, {C});
  if (H <= 0 || C % H != 0) fail(op, "D " + D.str() + ": heads do not split the " + std::to_string(C) + " channels");
  if (groups <= 0 || C % groups != 0)
    fail(op, std::to_string(groups) + " groups do not split the " + std::to_string(C) + " channels");
}

void check_kda_gates(const Tensor& a, const Tensor& b, const Tensor& A, const Tensor& dt_bias, const Tensor& g,
                     const Tensor& beta, DeviceKind dev) {
  const char* op = "kda_gates";
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"a", &a},
                      {"b", &b},
                      {"A", &A},
                      {"dt_bias", &dt_bias},
                      {"g", &g},
                      {"beta", &beta}})
    need_f32(op, n, *t, dev);
  need_ndim(op, "a", a, 3);
  const int64_t T = a.dim(0), H = a.dim(1), dk = a.dim(2);
  need_shape(op, "b", b, {T, H});
  need_shape(op, "A", A, {H});
  need_shape(op, "dt_bias", dt_bias, {H * dk});
  need_shape(op, "g", g, a.shape());
  need_shape(op, "beta", beta, {T, H});
}

void check_compose_state(const Tensor& T, const Tensor& S, const Tensor& B, const Tensor& out, DeviceKind dev) {
  const char* op = "compose_state";
  need_def(op, "T", T, dev);
  if (T.dtype() != DType::F32 && T.dtype() != DType::BF16) fail(op, "T " + T.str() + ": must be f32 or bf16");
  need_f32(op, "S", S, dev);
  need_f32(op, "B", B, dev);
  need_f32(op, "out", out, dev);
  need_ndim(op, "T", T, 3);
  need_ndim(op, "S", S, 3);
  const int64_t H = T.dim(0), dk = T.dim(1);
  if (T.dim(2) != dk) fail(op, "T " + T.str() + ": matrices must be square");
  // T [H, 1, 1] against S [H, dk, dv]: a scaled identity per head (scalar-decay families).
  const bool scaled = dk == 1 && S.dim(1) != 1;
  if (S.dim(0) != H || (S.dim(1) != dk && !scaled))
    fail(op, "T " + T.str() + " and S " + S.str() + ": shapes do not chain");
  need_shape(op, "B", B, S.shape());
  need_shape(op, "out", out, S.shape());
  if (overlaps(out, S) || overlaps(out, T)) fail(op, "out must not overlap T or S");
  if (B.raw() != out.raw() && overlaps(out, B)) fail(op, "out partially overlaps B");
}

void check_set_identity(const Tensor& t, DeviceKind dev) {
  const char* op = "set_identity";
  need_f32(op, "t", t, dev);
  need_ndim(op, "t", t, 3);
  if (t.dim(2) != t.dim(1)) fail(op, "t " + t.str() + ": matrices must be square");
}

void check_moe_shared(const Tensor& shared, const Tensor& shared_gate, const Tensor& x, DeviceKind dev) {
  const char* op = "moe_experts_add";
  if (shared.defined() != shared_gate.defined()) fail(op, "shared and shared_gate must be given together");
  if (!shared.defined()) return;
  need_f32(op, "shared", shared, dev);
  need_f32(op, "shared_gate", shared_gate, dev);
  need_shape(op, "shared", shared, x.shape());
  need_shape(op, "shared_gate", shared_gate, {x.dim(0), 1});
  if (overlaps(shared, x) || overlaps(shared_gate, x)) fail(op, "shared and shared_gate must not overlap x");
}

int64_t check_moe(const Tensor& x, const Tensor& router_logits, const MoeRouter& router, const ExpertWeights& experts,
                  const Tensor& out, DeviceKind dev) {
  const int top_k = router.top_k;
  const char* op = "moe_experts";
  need_f32(op, "x", x, dev);
  need_f32(op, "router_logits", router_logits, dev);
  need_f32(op, "out", out, dev);
  need_ndim(op, "x", x, 2);
  need_ndim(op, "router_logits", router_logits, 2);
  const int64_t T = x.dim(0), H = x.dim(1), E = router_logits.dim(1);
  if (router_logits.dim(0) != T)
    fail(op, "router_logits " + router_logits.str() + " and x " + x.str() + ": token counts differ");
  need_shape(op, "out", out, {T, H});
  if (top_k < 1 || top_k > E)
    fail(op, "top_k " + std::to_string(top_k) + " out of range for " + std::to_string(E) + " experts");
  if (router.sigmoid) {
    if (router.n_group < 1 || router.topk_group < 1 || router.topk_group > router.n_group || E % router.n_group != 0)
      fail(op, "groups: " + std::to_string(router.topk_group) + " of " + std::to_string(router.n_group) +
                   " must divide the " + std::to_string(E) + " experts");
    if (top_k > router.topk_group * (E / router.n_group))
      fail(op, "top_k " + std::to_string(top_k) + " exceeds the " +
                   std::to_string(router.topk_group * (E / router.n_group)) + " experts of the chosen groups");
    if (router.bias.defined()) {
      need_f32(op, "bias", router.bias, dev);
      need_shape(op, "bias", router.bias, {E});
    }
  } else if (router.bias.defined()) {
    fail(op, "a bias is for sigmoid routing only");
  }
  const bool relu2 = experts.gate.empty();  // ReLU^2 experts: up and down only
  if ((!relu2 && static_cast<int64_t>(experts.gate.size()) != E) || static_cast<int64_t>(experts.up.size()) != E ||
      static_cast<int64_t>(experts.down.size()) != E)
    fail(op, "expected " + std::to_string(E) + " experts in gate (or none)/up/down, got " +
                 std::to_string(experts.gate.size()) + "/" + std::to_string(experts.up.size()) + "/" +
                 std::to_string(experts.down.size()));
  if (overlaps(out, x)) fail(op, "out overlaps x");
  int64_t I = -1;
  for (int64_t e = 0; e < E; ++e) {
    const Tensor &ut = experts.up[e], &dt = experts.down[e];
    const Tensor& gt = relu2 ? ut : experts.gate[e];
    need_weight(op, relu2 ? "up" : "gate", gt, dev);
    need_weight(op, "up", ut, dev);
    need_weight(op, "down", dt, dev);
    if (gt.ndim() != 2 || gt.dim(1) != H || (I >= 0 && gt.dim(0) != I))
      fail(op, "expert " + std::to_string(e) + (relu2 ? " up " : " gate ") + gt.str() + " does not match x " + x.str());
    I = gt.dim(0);
    if (ut.shape() != gt.shape()) fail(op, "expert " + std::to_string(e) + " up " + ut.str() + " != gate " + gt.str());
    if (dt.shape() != Shape{H, I})
      fail(op, "expert " + std::to_string(e) + " down " + dt.str() + ": expected shape " + shape_str({H, I}));
  }
  return I;
}

void check_step_table(const char* op, const char* name, const Tensor& t, int64_t n, DeviceKind dev) {
  need_def(op, name, t, dev);
  if (t.dtype() != DType::I64 || t.ndim() != 1 || t.dim(0) != n)
    fail(op, std::string(name) + " " + t.str() + ": expected i64[" + std::to_string(n) + "]");
}

void check_conv1d_step(const Tensor& x, const Tensor& w, const Tensor& states, const Tensor& out, DeviceKind dev) {
  const char* op = "causal_conv1d_silu_step";
  need_f32(op, "x", x, dev);
  need_float(op, "w", w, dev);
  need_f32(op, "out", out, dev);
  need_ndim(op, "x", x, 2);
  need_ndim(op, "w", w, 2);
  if (w.dim(0) != x.dim(1) || w.dim(1) < 1)
    fail(op, "w " + w.str() + ": expected [" + std::to_string(x.dim(1)) + ", K] for x " + x.str());
  need_shape(op, "out", out, x.shape());
  check_step_table(op, "states", states, x.dim(0), dev);
}

void check_gated_delta_rule_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                 const Tensor& states, const Tensor& out, DeviceKind dev) {
  const char* op = "gated_delta_rule_step";
  for (auto [n, t] : {std::pair<const char*, const Tensor*>{"q", &q},
                      {"k", &k},
                      {"v", &v},
                      {"g", &g},
                      {"beta", &beta},
                      {"out", &out}})
    need_f32(op, n, *t, dev);
  need_ndim(op, "q", q, 3);
  need_ndim(op, "v", v, 3);
  const int64_t B = q.dim(0), Hk = q.dim(1), Hv = v.dim(1);
  need_shape(op, "k", k, q.shape());
  if (v.dim(0) != B) fail(op, "v " + v.str() + ": expected " + std::to_string(B) + " rows as q " + q.str());
  if (Hk == 0 || Hv % Hk != 0) fail(op, "value heads of v " + v.str() + " are not a multiple of key heads of q");
  need_shape(op, "g", g, {B, Hv});
  need_shape(op, "beta", beta, {B, Hv});
  need_shape(op, "out", out, v.shape());
  check_step_table(op, "states", states, B, dev);
}

void check_sample_rows(const Tensor& x, const Tensor& params, const Tensor& mask, const Tensor& ids, DeviceKind dev) {
  const char* op = "sample_rows";
  need_f32(op, "x", x, dev);
  need_f32(op, "params", params, dev);
  need_def(op, "ids", ids, dev);
  need_ndim(op, "x", x, 2);
  const int64_t R = x.dim(0), V = x.dim(1);
  if (V == 0) fail(op, "x " + x.str() + " has empty rows");
  if (V > INT32_MAX) fail(op, "x " + x.str() + ": rows of more than 2^31 ids");
  need_shape(op, "params", params, {R, 3});
  if (ids.dtype() != DType::I32) fail(op, "ids " + ids.str() + ": expected i32");
  need_shape(op, "ids", ids, {R});
  if (mask.defined()) {
    need_def(op, "mask", mask, dev);
    if (mask.dtype() != DType::U8) fail(op, "mask " + mask.str() + ": expected u8");
    need_shape(op, "mask", mask, {V});
  }
}

void check_attention_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& caches,
                          const Tensor& positions, const Tensor& out, DeviceKind dev) {
  const char* op = "attention_step";
  need_attention_tensors(op, q, k, v, out, dev);
  const int64_t B = q.dim(0), Hq = q.dim(1), Hkv = k.dim(1);
  if (k.dim(0) != B || v.dim(0) != B || v.dim(1) != Hkv || k.dim(2) != q.dim(2))
    fail(op, "q " + q.str() + ", k " + k.str() + ", v " + v.str() + ": shapes do not match");
  if (Hkv == 0 || Hq % Hkv != 0) fail(op, "query heads of q " + q.str() + " are not a multiple of key heads");
  need_shape(op, "out", out, {B, Hq, v.dim(2)});
  check_step_table(op, "caches", caches, 2 * B, dev);
  check_step_table(op, "positions", positions, B, dev);
}

}  // namespace hypic::checks
