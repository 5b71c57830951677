#include "backend/backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "backend/checks.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/splitmix.h"
#ifdef HYPIC_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace hypic {

namespace {
// "cuda" -> 0, "cuda:3" -> 3; -1 when the name is not a cuda device.
int cuda_index(const std::string& name) {
  if (name == "cuda") return 0;
  if (name.rfind("cuda:", 0) != 0 || name.size() == 5) return -1;
  int i = 0;
  for (char c : name.substr(5)) {
    if (c < '0' || c > '9') return -1;
    i = i * 10 + (c - '0');
  }
  return i;
}
}  // namespace

// ---- reference implementations of the decode-step ops ---------------------------------------
// Tables are read back to the host and every sequence goes through the span ops on views of its
// own state: slow on a GPU (a round trip per call), exact, and the reference the fast kernels are
// compared with.

void Backend::matmul_many(const Tensor& x, std::initializer_list<Tensor> w, std::initializer_list<Tensor> y) {
  if (w.size() != y.size())
    checks::fail("matmul_many", std::to_string(w.size()) + " weights for " + std::to_string(y.size()) + " outputs");
  auto wi = w.begin();
  for (Tensor out : y) matmul(x, *wi++, out);
}

void Backend::matmul_swiglu(const Tensor& x, const Tensor& gate, const Tensor& up, Tensor& h) {
  Tensor u = alloc_uninit(DType::F32, h.shape());
  matmul_many(x, {gate, up}, {h, u});
  silu_mul(h, u, h);
}

void Backend::add_rms_norm(Tensor& x, const Tensor& d, const Tensor& w, float eps, bool one_plus_w, Tensor& out) {
  add(x, d, x);
  rms_norm(x, w, eps, one_plus_w, out);
}

void Backend::convert(const Tensor& src, Tensor& dst) {
  checks::check_convert(src, dst, device().kind);
  Tensor h = to_host(src).to_f32();
  if (dst.dtype() == DType::F32) {
    write(dst, h.raw(), h.nbytes());
    return;
  }
  Tensor o = Tensor::empty(dst.dtype(), {h.numel()});
  convert_from_f32(h.data<float>(), dst.dtype(), o.raw(), static_cast<size_t>(h.numel()));
  write(dst, o.raw(), o.nbytes());
}

void Backend::write(Tensor& dst, const void* src, size_t bytes) {
  if (!dst.defined() || bytes != dst.nbytes())
    checks::fail("write", std::to_string(bytes) + " bytes for " + (dst.defined() ? dst.str() : "an undefined tensor"));
  Tensor h = Tensor::borrow(const_cast<void*>(src), dst.dtype(), dst.shape());
  copy(h, dst);
}

Tensor Backend::alloc_host(size_t bytes) {
  return Tensor::uninitialized(DType::U8, {static_cast<int64_t>(bytes)});
}

std::shared_ptr<Backend::Fence> Backend::copy_async(std::span<const Tensor> src, std::span<Tensor> dst) {
  if (src.size() != dst.size())
    checks::fail("copy_async", std::to_string(src.size()) + " sources for " + std::to_string(dst.size()) + " targets");
  for (size_t i = 0; i < src.size(); ++i) copy(src[i], dst[i]);
  return nullptr;
}

void Backend::copy_from_shared(const std::string&, uint64_t, std::span<const uint64_t>, std::span<Tensor>) {
  throw SharedMemoryError(name() + " backend: cannot map another process's memory");
}

uint64_t Backend::payload_checksum(std::span<const Tensor* const> ts, std::span<const uint64_t> offsets) {
  if (ts.size() != offsets.size())
    checks::fail("payload_checksum",
                 std::to_string(ts.size()) + " tensors for " + std::to_string(offsets.size()) + " offsets");
  uint64_t sum = 0;
  for (size_t t = 0; t < ts.size(); ++t) {
    if (offsets[t] % 4 != 0)
      checks::fail("payload_checksum", "offset " + std::to_string(offsets[t]) + " is not a multiple of 4");
    Tensor h = to_host(*ts[t]);
    const auto* b = static_cast<const uint8_t*>(h.raw());
    const size_t n = h.nbytes();
    const uint64_t base = offsets[t] / 4;
    for (size_t i = 0; i * 4 < n; ++i) {
      uint32_t w = 0;
      std::memcpy(&w, b + 4 * i, std::min<size_t>(4, n - 4 * i));
      sum += splitmix64(((base + i) << 32) | w);
    }
  }
  return sum;
}

namespace {
std::vector<int64_t> host_table(Backend& be, const Tensor& t) {
  Tensor h = be.to_host(t);
  const int64_t* p = h.data<int64_t>();
  return std::vector<int64_t>(p, p + h.numel());
}
void* address(int64_t a) {
  return reinterpret_cast<void*>(static_cast<intptr_t>(a));
}
}  // namespace

void Backend::embedding(const Tensor& table, const Tensor& ids, Tensor& out) {
  checks::need_def("embedding", "ids", ids, device().kind);
  if (ids.dtype() != DType::I32 || ids.ndim() != 1) checks::fail("embedding", "ids " + ids.str() + ": expected i32[n]");
  Tensor h = to_host(ids);
  embedding(table, std::span<const int32_t>(h.data<int32_t>(), static_cast<size_t>(h.numel())), out);
}

void Backend::rope_neox(Tensor& x, const Tensor& positions, int rot_dim, double theta) {
  checks::check_step_table("rope_neox", "positions", positions, x.ndim() > 0 ? x.dim(0) : 0, device().kind);
  const auto pos = host_table(*this, positions);
  rope_neox(x, std::span<const int64_t>(pos), rot_dim, theta);
}

void Backend::causal_conv1d_silu_step(const Tensor& x, const Tensor& w, const Tensor& states, Tensor& out) {
  checks::check_conv1d_step(x, w, states, out, device().kind);
  const auto tab = host_table(*this, states);
  const int64_t C = x.dim(1), K = w.dim(1);
  for (int64_t b = 0; b < x.dim(0); ++b) {
    Tensor st = Tensor::borrow(address(tab[b]), DType::F32, {K - 1, C}, device());
    Tensor o = out.slice_rows(b, b + 1);
    causal_conv1d_silu(x.slice_rows(b, b + 1), w, st, o);
  }
}

void Backend::gated_delta_rule_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                    const Tensor& beta, bool l2norm_qk, const Tensor& states, Tensor& out) {
  checks::check_gated_delta_rule_step(q, k, v, g, beta, states, out, device().kind);
  const auto tab = host_table(*this, states);
  const int64_t Hv = v.dim(1), dk = q.dim(2), dv = v.dim(2);
  for (int64_t b = 0; b < q.dim(0); ++b) {
    Tensor st = Tensor::borrow(address(tab[b]), DType::F32, {Hv, dk, dv}, device());
    Tensor o = out.slice_rows(b, b + 1);
    gated_delta_rule(q.slice_rows(b, b + 1), k.slice_rows(b, b + 1), v.slice_rows(b, b + 1), g.slice_rows(b, b + 1),
                     beta.slice_rows(b, b + 1), l2norm_qk, st, o);
  }
}

void Backend::attention_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& caches,
                             const Tensor& positions, float scale, Tensor& out) {
  checks::check_attention_step(q, k, v, caches, positions, out, device().kind);
  const auto tab = host_table(*this, caches);
  const auto pos = host_table(*this, positions);
  const int64_t B = q.dim(0), Hkv = k.dim(1), D = k.dim(2), Dv = v.dim(2);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = pos[b];
    if (p < 0) checks::fail("attention_step", "negative position " + std::to_string(p));
    Tensor kc = Tensor::borrow(address(tab[b]), DType::F32, {p + 1, Hkv, D}, device());
    Tensor vc = Tensor::borrow(address(tab[B + b]), DType::F32, {p + 1, Hkv, Dv}, device());
    Tensor kd = kc.slice_rows(p, p + 1), vd = vc.slice_rows(p, p + 1), o = out.slice_rows(b, b + 1);
    copy(k.slice_rows(b, b + 1), kd);
    copy(v.slice_rows(b, b + 1), vd);
    attention(q.slice_rows(b, b + 1), kc, vc, p + 1, p, scale, o);
  }
}

void Backend::copy_rows(std::span<const RowCopy> pieces, int rot_dim, double theta) {
  checks::check_copy_rows(pieces, rot_dim, theta, device().kind);
  for (const auto& p : pieces) {
    if (p.rows == 0) continue;
    Tensor d = p.dst->slice_rows(p.dst_row, p.dst_row + p.rows);
    copy(p.src->slice_rows(p.src_row, p.src_row + p.rows), d);
    if (p.rope_shift != 0) {
      const std::vector<int64_t> shift(static_cast<size_t>(p.rows), p.rope_shift);
      rope_neox(d, shift, rot_dim, theta);
    }
  }
}

namespace {
// Checks that runs of rows cover a tensor's rows exactly, one state each.
void check_runs(const char* op, std::span<Tensor* const> states, std::span<const int64_t> rows, int64_t total) {
  if (states.size() != rows.size())
    checks::fail(op, std::to_string(states.size()) + " states for " + std::to_string(rows.size()) + " runs");
  int64_t sum = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0 || !states[i]) checks::fail(op, "run " + std::to_string(i) + " has no state or negative rows");
    sum += rows[i];
  }
  if (sum != total)
    checks::fail(op, "runs of " + std::to_string(sum) + " rows for " + std::to_string(total) + " rows of input");
}
}  // namespace

void Backend::linear_recurrence_runs(const Recurrence& r, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& g, const Tensor& beta, const Tensor& log_gamma,
                                     std::span<Tensor* const> states, std::span<const int64_t> rows, Tensor& out) {
  check_runs("linear_recurrence_runs", states, rows, q.defined() && q.ndim() > 0 ? q.dim(0) : 0);
  int64_t r0 = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t r1 = r0 + rows[i];
    auto part = [&](const Tensor& t) { return t.defined() ? t.slice_rows(r0, r1) : Tensor(); };
    Tensor o = out.slice_rows(r0, r1);
    linear_recurrence(r, part(q), part(k), part(v), part(g), part(beta), log_gamma, *states[i], o);
    r0 = r1;
  }
}

void Backend::causal_conv1d_bias_silu_runs(const Tensor& x, const Tensor& w, const Tensor& bias,
                                           std::span<Tensor* const> states, std::span<const int64_t> rows,
                                           Tensor& out) {
  check_runs("causal_conv1d_bias_silu_runs", states, rows, x.defined() && x.ndim() > 0 ? x.dim(0) : 0);
  int64_t r0 = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t r1 = r0 + rows[i];
    if (r1 > r0) {
      Tensor o = out.slice_rows(r0, r1);
      causal_conv1d_bias_silu(x.slice_rows(r0, r1), w, bias, *states[i], o);
    }
    r0 = r1;
  }
}

void Backend::gather_col_blocks(const Tensor& src, std::span<const int64_t> order, Tensor& dst) {
  checks::check_gather_col_blocks(src, order, dst, device().kind);
  const int64_t C = checks::last_dim(src), w = C / static_cast<int64_t>(order.size());
  const Tensor s2 = src.reshape({checks::rows_of(src), C});
  Tensor d2 = dst.reshape({checks::rows_of(dst), C}), block = alloc_uninit(src.dtype(), {s2.dim(0), w});
  for (size_t p = 0; p < order.size(); ++p) {
    copy_cols(s2, order[p] * w, block);
    set_cols(block, static_cast<int64_t>(p) * w, d2);
  }
}

void Backend::moe_experts_add(const Tensor& xn, const Tensor& router_logits, int top_k, bool norm_topk,
                              const ExpertWeights& experts, const Tensor& shared, const Tensor& shared_gate,
                              Tensor& x) {
  checks::check_moe_shared(shared, shared_gate, x, device().kind);
  Tensor mix = alloc_uninit(DType::F32, x.shape());
  moe_experts(xn, router_logits, top_k, norm_topk, experts, mix);
  if (shared.defined()) {
    Tensor sh = alloc_uninit(DType::F32, shared.shape());
    sigmoid_mul(shared, shared_gate, sh);  // the gate [T, 1] broadcasts over the row
    add(mix, sh, mix);
  }
  add(x, mix, x);
}

void Backend::causal_conv1d_silu_spans(const Tensor& x, const Tensor& w, std::span<const ConvSpan> spans, Tensor& state,
                                       std::span<Tensor> out_cols) {
  checks::check_conv1d_spans(x, w, spans, state, out_cols, device().kind);
  if (out_cols.size() > 1) {  // the result whole, then its column blocks
    Tensor whole = alloc_uninit(DType::F32, {x.dim(0), x.dim(1)});
    causal_conv1d_silu_spans(x, w, spans, state, whole);
    int64_t c0 = 0;
    for (Tensor& o : out_cols) {
      copy_cols(whole, c0, o);
      c0 += o.dim(1);
    }
    return;
  }
  Tensor& out = out_cols[0];
  int64_t r0 = 0;
  for (const auto& sp : spans) {
    if (sp.rows > 0) {
      Tensor o = out.slice_rows(r0, r0 + sp.rows);
      causal_conv1d_silu(x.slice_rows(r0, r0 + sp.rows), w, state, o);
      r0 += sp.rows;
    }
    if (sp.after) copy(*sp.after, state);
  }
}

void Backend::attention_spans(const Tensor& q, const Tensor& k, const Tensor& v, std::span<const RowSpan> spans,
                              float scale, Tensor& out) {
  int64_t r0 = 0;
  for (const auto& sp : spans) {
    if (sp.rows < 0 || sp.pos0 < 0)
      checks::fail("attention_spans",
                   "span at " + std::to_string(sp.pos0) + " of " + std::to_string(sp.rows) + " rows");
    if (sp.rows == 0) continue;
    if (r0 + sp.rows > q.dim(0)) checks::fail("attention_spans", "spans cover more rows than q " + q.str() + " has");
    Tensor o = out.slice_rows(r0, r0 + sp.rows);
    attention(q.slice_rows(r0, r0 + sp.rows), k, v, sp.pos0 + sp.rows, sp.pos0, scale, o);
    r0 += sp.rows;
  }
  if (r0 != q.dim(0))
    checks::fail("attention_spans", "spans cover " + std::to_string(r0) + " rows, q " + q.str() + " has more");
}

void Backend::gated_delta_chain(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                bool l2norm_qk, Tensor& state, Tensor& out, std::span<const GdnLink> links) {
  int64_t r0 = 0;
  Tensor own[2];
  for (const auto& L : links) {
    if (L.rows < 0) checks::fail("gated_delta_chain", "a link of " + std::to_string(L.rows) + " rows");
    if (L.rows > 0) {
      if (r0 + L.rows > q.dim(0)) checks::fail("gated_delta_chain", "links cover more rows than q " + q.str() + " has");
      const int64_t r1 = r0 + L.rows;
      Tensor o = out.slice_rows(r0, r1);
      gated_delta_rule(q.slice_rows(r0, r1), k.slice_rows(r0, r1), v.slice_rows(r0, r1), g.slice_rows(r0, r1),
                       beta.slice_rows(r0, r1), l2norm_qk, state, o);
      r0 = r1;
    }
    if (L.rk) {
      if (!L.rv || !L.rg || !L.rbeta) checks::fail("gated_delta_chain", "a replayed body without all its inputs");
      Tensor scratch = alloc_uninit(DType::F32, {L.rk->dim(0), state.dim(0), state.dim(2)});
      gated_delta_rule(*L.rk, *L.rk, *L.rv, *L.rg, *L.rbeta, l2norm_qk, state, scratch);
    }
    if (L.B) {
      if (L.T) {
        // compose_state's output may not alias its input: two buffers of this call's own in
        // turn (a warm request composes ~10 documents per linear layer); the caller's first
        // state is never written, as something else may hold it.
        Tensor& next = own[0].defined() && own[0].raw() == state.raw() ? own[1] : own[0];
        if (!next.defined()) next = alloc_uninit(DType::F32, state.shape());
        compose_state(*L.T, state, *L.B, 1.f, next);
        state = next;
      } else {
        add(state, *L.B, state);
      }
    }
  }
  if (r0 != q.dim(0))
    checks::fail("gated_delta_chain", "links cover " + std::to_string(r0) + " rows, q " + q.str() + " has more");
}

void Backend::argmax_rows(const Tensor& x, Tensor& ids) {
  checks::need_f32("argmax_rows", "x", x, device().kind);
  checks::need_def("argmax_rows", "ids", ids, device().kind);
  checks::need_ndim("argmax_rows", "x", x, 2);
  if (ids.dtype() != DType::I32 || ids.ndim() != 1 || ids.dim(0) != x.dim(0))
    checks::fail("argmax_rows", "ids " + ids.str() + ": expected i32[" + std::to_string(x.dim(0)) + "]");
  if (x.dim(1) == 0) checks::fail("argmax_rows", "x " + x.str() + " has empty rows");
  Tensor h = to_host(x);
  std::vector<int32_t> out(static_cast<size_t>(x.dim(0)));
  const int64_t V = x.dim(1);
  for (int64_t r = 0; r < x.dim(0); ++r) {
    const float* p = h.data<float>() + r * V;
    out[static_cast<size_t>(r)] = static_cast<int32_t>(std::max_element(p, p + V) - p);
  }
  write(ids, out.data(), out.size() * sizeof(int32_t));
}

void Backend::sample_rows(const Tensor& x, const Tensor& params, const Tensor& mask, Tensor& ids) {
  checks::check_sample_rows(x, params, mask, ids, device().kind);
  const int64_t R = x.dim(0), V = x.dim(1);
  Tensor h = to_host(x), hp = to_host(params), hm = mask.defined() ? to_host(mask) : Tensor();
  std::vector<int32_t> out(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    const float* row = h.data<float>() + r * V;
    const float t = hp.data<float>()[3 * r], u = hp.data<float>()[3 * r + 1];
    const uint8_t* off = hm.defined() && hp.data<float>()[3 * r + 2] != 0.f ? hm.data<uint8_t>() : nullptr;
    auto on = [&](int64_t i) { return !off || !off[i]; };
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < V; ++i)
      if (on(i) && row[i] > mx) mx = row[i];
    int32_t pick = 0;
    if (t <= 0.f) {
      for (int64_t i = 0; i < V; ++i)
        if (on(i) && row[i] == mx) {
          pick = static_cast<int32_t>(i);
          break;
        }
    } else {
      const float m = std::isfinite(mx) ? mx : 0.f;
      auto weight = [&](int64_t i) {
        const float w = std::exp((row[i] - m) / t);
        return on(i) && w == w ? static_cast<double>(w) : 0.0;
      };
      double total = 0;
      int64_t last = -1;
      for (int64_t i = 0; i < V; ++i) {
        const double w = weight(i);
        total += w;
        if (w > 0) last = i;
      }
      // Rounding past the last id with mass: that id (the CPU sampler's rule).
      const double target = static_cast<double>(u) * total;
      double acc = 0;
      pick = static_cast<int32_t>(last >= 0 ? last : V - 1);
      for (int64_t i = 0; i < V; ++i) {
        acc += weight(i);
        if (target < acc) {
          pick = static_cast<int32_t>(i);
          break;
        }
      }
    }
    out[static_cast<size_t>(r)] = pick;
  }
  write(ids, out.data(), out.size() * sizeof(int32_t));
}

std::unique_ptr<Backend> make_backend(const std::string& name, int threads) {
  if (name == "cpu") return std::make_unique<cpu::CpuBackend>(threads);
  if (const int dev = cuda_index(name); dev >= 0) {
#ifdef HYPIC_HAVE_CUDA
    return std::make_unique<cuda::CudaBackend>(dev);
#else
    throw std::invalid_argument("backend '" + name +
                                "': this hypic was built without the CUDA backend (nvcc was not found, or "
                                "-DHYPIC_CUDA=OFF)");
#endif
  }
  throw std::invalid_argument("unknown backend '" + name + "' (available: cpu, cuda, cuda:N)");
}

std::string backend_unavailable(const std::string& name) {
  if (name == "cpu") return "";
  if (cuda_index(name) < 0) return "unknown backend '" + name + "'";
#ifdef HYPIC_HAVE_CUDA
  if (!cuda::device_available()) return "no CUDA device is visible to this process";
  return "";
#else
  return "this hypic was built without the CUDA backend";
#endif
}

}  // namespace hypic
