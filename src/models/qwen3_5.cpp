// Qwen3.5 (dense and MoE) and Qwen3-Next: hybrid decoders of Gated DeltaNet and gated full
// attention layers, computed as transformers 5.17 computes them. Qwen3-Next differs only in how
// its GDN input projections are packed (fused qkvz / ba, grouped per key head); those rows are
// reordered once at load time so both share one forward.
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <thread>
#include <utility>

#include "io/safetensors.h"
#include "models/blocks.h"
#include "models/model.h"

namespace hypic {

namespace {

// ---- weight sources ------------------------------------------------------------------------

class StoreSource : public WeightSource {
 public:
  explicit StoreSource(const WeightStore& s) : s_(s) {}
  bool has(const std::string& n) const override { return s_.has(n); }
  Tensor get(const std::string& n, const Shape& e) const override { return s_.get(n, e); }
  std::string describe() const override { return "checkpoint"; }

 private:
  const WeightStore& s_;
};

// Seeded random weights for benchmarks on real shapes. Values come from a counter-based generator
// (splitmix64 per block of 2^16 elements, near-normal values), so blocks are generated in parallel on
// every core and a 35B-parameter model is ready in seconds; the same seed gives the same weights.
class RandomSource : public WeightSource {
 public:
  RandomSource(uint64_t seed, DType dt) : seed_(seed), dt_(dt) {}
  bool has(const std::string&) const override { return true; }
  Tensor get(const std::string& name, const Shape& shape) const override {
    uint64_t h = seed_ ^ 0x9e3779b97f4a7c15ull;
    for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
    Tensor t = Tensor::empty(dt_, shape);
    const int64_t n = t.numel();
    const bool is_norm = name.find("norm") != std::string::npos;
    const bool is_alog = name.find("A_log") != std::string::npos;
    const bool is_dtb = name.find("dt_bias") != std::string::npos;
    const float norm_base = name.find("linear_attn.norm") != std::string::npos ? 1.f : 0.f;
    // Fan-in scaled normal values keep activations O(1) through many layers.
    const double fan_in = shape.size() >= 2 ? static_cast<double>(shape.back()) : 1.0;
    const float sd = static_cast<float>(1.0 / std::sqrt(fan_in));
    constexpr int64_t kBlock = 1 << 16;
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    auto fill = [&](int64_t b0, int64_t b1) {
      std::vector<float> buf(static_cast<size_t>(kBlock));
      for (int64_t b = b0; b < b1; ++b) {
        uint64_t st = h + static_cast<uint64_t>(b) * 0xd1b54a32d192ed03ull;
        auto next = [&st] {  // splitmix64
          uint64_t z = (st += 0x9e3779b97f4a7c15ull);
          z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
          z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
          return z ^ (z >> 31);
        };
        auto uniform = [&] { return (static_cast<float>(next() >> 40) + 0.5f) * (1.0f / 16777216.0f); };
        // Near-normal values from one 64-bit draw: the sum of its four 16-bit parts (Irwin-Hall,
        // variance 4/12 after scaling), ~20x cheaper than Box-Muller's log and sincos, which made
        // a 35B model take over a minute to generate.
        constexpr float kIh = 1.7320508f / 65536.f;  // sqrt(3) / 2^16: unit variance
        auto normal = [&] {
          const uint64_t r = next();
          const float s4 = static_cast<float>((r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48));
          return (s4 - 2.f * 65535.f) * kIh;
        };
        const int64_t off = b * kBlock, m = std::min(kBlock, n - off);
        for (int64_t i = 0; i < m; ++i) {
          float& v = buf[static_cast<size_t>(i)];
          if (is_alog)
            v = std::log(1.f + 15.f * uniform());
          else if (is_dtb)
            v = 1.f;
          else if (is_norm)
            v = norm_base + 0.02f * sd * normal();
          else
            v = sd * normal();
        }
        convert_from_f32(buf.data(), dt_, static_cast<char*>(t.raw()) + off * dtype_size(dt_), static_cast<size_t>(m));
      }
    };
    const int64_t threads = std::min<int64_t>(blocks, std::max(1u, std::thread::hardware_concurrency()));
    if (threads <= 1) {
      fill(0, blocks);
    } else {
      std::vector<std::thread> pool;
      for (int64_t w = 0; w < threads; ++w) pool.emplace_back(fill, blocks * w / threads, blocks * (w + 1) / threads);
      for (auto& th : pool) th.join();
    }
    return t;
  }
  std::string describe() const override { return std::string("random ") + dtype_name(dt_); }

 private:
  uint64_t seed_;
  DType dt_;
};

// Host-side row gather used to repack fused projections at load time.
Tensor gather_rows(const Tensor& w, const std::vector<int64_t>& rows) {
  const int64_t cols = w.dim(1);
  const size_t rb = dtype_bytes(w.dtype(), cols);
  Tensor out = Tensor::empty(w.dtype(), {static_cast<int64_t>(rows.size()), cols});
  for (size_t r = 0; r < rows.size(); ++r)
    std::memcpy(static_cast<char*>(out.raw()) + r * rb, static_cast<const char*>(w.raw()) + rows[r] * rb, rb);
  return out;
}

}  // namespace

std::unique_ptr<WeightSource> weights_from_store(const WeightStore& store) {
  return std::make_unique<StoreSource>(store);
}
std::unique_ptr<WeightSource> random_weights(uint64_t seed, DType dtype) {
  return std::make_unique<RandomSource>(seed, dtype);
}

// ---- layer weights --------------------------------------------------------------------------

struct GdnWeights {
  Tensor in_qkv, in_z, in_b, in_a;  // [C, H], [Hv*dv, H], [Hv, H], [Hv, H]
  Tensor conv;                      // [C, K]
  Tensor A_log, dt_bias, norm, out_proj;
  // out_proj's input columns in a file's order of value heads (WeightSource::get_with_col_order):
  // its block p is head out_order[p]; empty: in order.
  std::vector<int64_t> out_order;
};
struct AttnWeights {
  Tensor q, gate, k, v, o;  // q and gate split out of the packed q_proj
  Tensor q_norm, k_norm;
};
struct MlpWeights {
  Tensor gate, up, down;
};

// out = down(silu(gate(x)) * up(x)) (out += that when accumulate: the residual add in the product).
static void swiglu_forward(Backend& be, const Tensor& x, const MlpWeights& w, Tensor& out, bool accumulate = false) {
  const int64_t T = x.dim(0), I = w.gate.dim(0);
  Tensor h = be.alloc_uninit(DType::F32, {T, I});
  be.matmul_swiglu(x, w.gate, w.up, h);
  be.matmul(h, w.down, out, accumulate);
}
struct MoeWeights {
  Tensor router;  // [E, H]
  ExpertWeights experts;
  MlpWeights shared;
  Tensor shared_gate;  // [1, H]
  bool has_shared = false;
};
struct LayerWeights {
  LayerKind kind;
  Tensor in_norm, post_norm;
  GdnWeights gdn;
  AttnWeights attn;
  bool moe = false;
  MlpWeights mlp;
  MoeWeights moew;
};

// A decode step's device inputs for one batch size: token ids, then a table of positions [B] and,
// per layer, the B addresses of each sequence's first state (conv or keys) and the B of its second
// (recurrent state or values). The recorded graph (if any) reads only these.
struct StepGraph {
  Tensor ids, table, logits;
  std::unique_ptr<Backend::Graph> graph;
  int64_t runs = 0;
  bool no_graph = false;  // the backend cannot record this step: always op by op
};

struct Model::StepRefs {
  Tensor positions;  // I64 [B]
  Tensor states;     // I64 [2B]: this layer's slice of the step table
};

struct Model::Impl {
  Tensor embed, final_norm, lm_head;
  std::vector<LayerWeights> layers;
  std::map<std::pair<int64_t, bool>, StepGraph> steps;  // by (batch size, precise products)
  // Derived sizes.
  int64_t H, Hq, Hkv, D, Hk, Hv, dk, dv, C, K;
  // Another architecture's blocks (models/blocks.h); null for the Qwen families, whose layers are here.
  std::unique_ptr<ArchBlocks> blocks;
  bool norm_offset = true;  // the final RMSNorm scales by 1 + w (Qwen) or w
};

Model::Model(ModelConfig cfg, const WeightSource& ws, Backend& be)
    : cfg_(std::move(cfg)), be_(be), impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  const auto& c = cfg_;
  if (c.attention_bias) throw std::runtime_error("attention_bias = true is not supported");
  if (c.hidden_act != "silu")
    throw std::runtime_error("hidden_act '" + c.hidden_act + "' is not supported (silu only)");
  m.H = c.hidden_size;
  m.Hq = c.num_attention_heads;
  m.Hkv = c.num_key_value_heads;
  m.D = c.head_dim;
  m.Hk = c.linear_num_key_heads;
  m.Hv = c.linear_num_value_heads;
  m.dk = c.linear_key_head_dim;
  m.dv = c.linear_value_head_dim;
  m.C = 2 * m.Hk * m.dk + m.Hv * m.dv;
  m.K = c.linear_conv_kernel_dim;
  const std::string P = c.nested_text ? "model.language_model." : "model.";

  std::unique_ptr<XXH64_state_t, XXH_errorcode (*)(XXH64_state_t*)> fp_state(XXH64_createState(), XXH64_freeState);
  XXH64_state_t* fp = fp_state.get();
  XXH64_reset(fp, 0x68797069ull);
  {
    const std::string arch = cfg_.architecture + "/" + std::to_string(cfg_.num_hidden_layers) + "/" +
                             std::to_string(cfg_.hidden_size) + "/" + std::to_string(cfg_.rope_theta);
    XXH64_update(fp, arch.data(), arch.size());
  }
  auto record = [&](const std::string& name, Tensor t) {
    n_params_ += t.numel();
    if (name.find(".experts.") != std::string::npos) routed_params_ += t.numel();  // not shared_experts.
    weight_bytes_ += t.nbytes();
    // Name, shape, dtype and the first and last 64 bytes: cheap, and different weights differ.
    XXH64_update(fp, name.data(), name.size());
    XXH64_update(fp, t.shape().data(), t.shape().size() * sizeof(int64_t));
    const auto dt = static_cast<uint8_t>(t.dtype());
    XXH64_update(fp, &dt, 1);
    const size_t nb = t.nbytes(), s = std::min<size_t>(64, nb);
    XXH64_update(fp, t.raw(), s);
    XXH64_update(fp, static_cast<const char*>(t.raw()) + nb - s, s);
    return t;
  };
  auto load = [&](const std::string& name, const Shape& shape) { return record(name, ws.get(name, shape)); };
  auto dev = [&](const Tensor& t) { return be_.to_device(t); };
  auto W = [&](const std::string& name, const Shape& shape) { return dev(load(name, shape)); };
  // gate_proj / up_proj [I, H] and down_proj [H, I] under `prefix` (dense MLP, shared expert).
  auto swiglu = [&](const std::string& prefix, int64_t I) {
    return MlpWeights{W(prefix + "gate_proj.weight", {I, m.H}), W(prefix + "up_proj.weight", {I, m.H}),
                      W(prefix + "down_proj.weight", {m.H, I})};
  };

  if (const ArchSpec& arch = arch_spec(c.arch); arch.blocks) {
    m.embed = W(arch.embed, {c.vocab_size, m.H});
    if (!c.tie_word_embeddings) embed_bytes_ = m.embed.nbytes(), embed_params_ = m.embed.numel();
    m.final_norm = W(arch.final_norm, {m.H});
    m.norm_offset = false;
    m.lm_head = c.tie_word_embeddings ? m.embed : W("lm_head.weight", {c.vocab_size, m.H});
    m.layers.resize(static_cast<size_t>(c.num_hidden_layers));  // kinds only: the states' shapes
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) m.layers[static_cast<size_t>(i)].kind = c.layer_types[i];
    m.blocks = arch.blocks(c, load, be_);
    expert_bytes_ = m.blocks->expert_bytes();
    fingerprint_ = XXH64_digest(fp);
    if (const char* e = std::getenv("HYPIC_GRAPHS"); e && std::string(e) == "0") step_graphs_ = false;
    return;
  }
  m.embed = W(P + "embed_tokens.weight", {c.vocab_size, m.H});
  if (!c.tie_word_embeddings) embed_bytes_ = m.embed.nbytes(), embed_params_ = m.embed.numel();
  m.final_norm = W(P + "norm.weight", {m.H});
  if (c.tie_word_embeddings)  // as transformers: tied means the embedding is the head
    m.lm_head = m.embed;
  else
    m.lm_head = W("lm_head.weight", {c.vocab_size, m.H});

  m.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    auto& L = m.layers[static_cast<size_t>(i)];
    const std::string p = P + "layers." + std::to_string(i) + ".";
    L.kind = c.layer_types[static_cast<size_t>(i)];
    L.in_norm = W(p + "input_layernorm.weight", {m.H});
    L.post_norm = W(p + "post_attention_layernorm.weight", {m.H});
    if (L.kind == LayerKind::Linear) {
      const std::string q = p + "linear_attn.";
      auto& g = L.gdn;
      if (c.arch == Arch::Qwen3Next) {
        // in_proj_qkvz rows per key head: [q dk | k dk | v r*dv | z r*dv]; in_proj_ba rows per
        // key head: [b r | a r] (r = Hv/Hk). Regroup to [q all | k all | v all], [z], [b], [a].
        const int64_t r = m.Hv / m.Hk, grp = 2 * m.dk + 2 * r * m.dv;
        Tensor qkvz = load(q + "in_proj_qkvz.weight", {m.Hk * grp, m.H});
        Tensor ba = load(q + "in_proj_ba.weight", {2 * m.Hv, m.H});
        std::vector<int64_t> rq, rk, rv, rz, rb, ra;
        for (int64_t h = 0; h < m.Hk; ++h) {
          const int64_t b0 = h * grp;
          for (int64_t j = 0; j < m.dk; ++j) rq.push_back(b0 + j);
          for (int64_t j = 0; j < m.dk; ++j) rk.push_back(b0 + m.dk + j);
          for (int64_t j = 0; j < r * m.dv; ++j) rv.push_back(b0 + 2 * m.dk + j);
          for (int64_t j = 0; j < r * m.dv; ++j) rz.push_back(b0 + 2 * m.dk + r * m.dv + j);
          for (int64_t j = 0; j < r; ++j) rb.push_back(h * 2 * r + j);
          for (int64_t j = 0; j < r; ++j) ra.push_back(h * 2 * r + r + j);
        }
        std::vector<int64_t> rqkv = rq;
        rqkv.insert(rqkv.end(), rk.begin(), rk.end());
        rqkv.insert(rqkv.end(), rv.begin(), rv.end());
        g.in_qkv = dev(gather_rows(qkvz, rqkv));
        g.in_z = dev(gather_rows(qkvz, rz));
        g.in_b = dev(gather_rows(ba, rb));
        g.in_a = dev(gather_rows(ba, ra));
      } else {
        g.in_qkv = W(q + "in_proj_qkv.weight", {m.C, m.H});
        g.in_z = W(q + "in_proj_z.weight", {m.Hv * m.dv, m.H});
        g.in_b = W(q + "in_proj_b.weight", {m.Hv, m.H});
        g.in_a = W(q + "in_proj_a.weight", {m.Hv, m.H});
      }
      g.conv = dev(load(q + "conv1d.weight", {m.C, 1, m.K}).reshape({m.C, m.K}));
      g.A_log = W(q + "A_log", {m.Hv});
      g.dt_bias = W(q + "dt_bias", {m.Hv});
      g.norm = W(q + "norm.weight", {m.dv});
      // Its columns may stay in a GGUF file's order of value heads (quantized blocks wider than a
      // head); the layer then puts its activations in that order.
      g.out_proj = dev(
          record(q + "out_proj.weight", ws.get_with_col_order(q + "out_proj.weight", {m.H, m.Hv * m.dv}, g.out_order)));
      if (!g.out_order.empty()) {
        if (static_cast<int64_t>(g.out_order.size()) != m.Hv)
          throw std::runtime_error(ws.describe() + ": " + q + "out_proj.weight comes in " +
                                   std::to_string(g.out_order.size()) + " column blocks, not " + std::to_string(m.Hv) +
                                   " value heads");
        XXH64_update(fp, g.out_order.data(), g.out_order.size() * sizeof(int64_t));
      }
    } else {
      const std::string q = p + "self_attn.";
      auto& a = L.attn;
      // q_proj rows per head: [q D | gate D]; split into two contiguous projections.
      Tensor qp = load(q + "q_proj.weight", {2 * m.Hq * m.D, m.H});
      std::vector<int64_t> rq, rg;
      for (int64_t h = 0; h < m.Hq; ++h)
        for (int64_t j = 0; j < m.D; ++j) {
          rq.push_back(h * 2 * m.D + j);
          rg.push_back(h * 2 * m.D + m.D + j);
        }
      a.q = dev(gather_rows(qp, rq));
      a.gate = dev(gather_rows(qp, rg));
      a.k = W(q + "k_proj.weight", {m.Hkv * m.D, m.H});
      a.v = W(q + "v_proj.weight", {m.Hkv * m.D, m.H});
      a.o = W(q + "o_proj.weight", {m.H, m.Hq * m.D});
      a.q_norm = W(q + "q_norm.weight", {m.D});
      a.k_norm = W(q + "k_norm.weight", {m.D});
    }
    L.moe = c.layer_is_moe(i);
    const std::string mp = p + "mlp.";
    if (!L.moe) {
      L.mlp = swiglu(mp, c.intermediate_size);
    } else {
      auto& mo = L.moew;
      const int64_t E = c.num_experts, I = c.moe_intermediate_size;
      mo.router = W(mp + "gate.weight", {E, m.H});
      if (ws.has(mp + "experts.gate_up_proj")) {
        // Fused layout (transformers 5 in-memory form): gate_up [E, 2I, H], down [E, H, I].
        Tensor gu = dev(load(mp + "experts.gate_up_proj", {E, 2 * I, m.H}).reshape({E * 2 * I, m.H}));
        Tensor dn = dev(load(mp + "experts.down_proj", {E, m.H, I}).reshape({E * m.H, I}));
        expert_bytes_ += gu.nbytes() + dn.nbytes();
        for (int64_t e = 0; e < E; ++e) {
          mo.experts.gate.push_back(gu.slice_rows(e * 2 * I, e * 2 * I + I));
          mo.experts.up.push_back(gu.slice_rows(e * 2 * I + I, (e + 1) * 2 * I));
          mo.experts.down.push_back(dn.slice_rows(e * m.H, (e + 1) * m.H));
        }
      } else {
        for (int64_t e = 0; e < E; ++e) {
          const std::string ep = mp + "experts." + std::to_string(e) + ".";
          mo.experts.gate.push_back(W(ep + "gate_proj.weight", {I, m.H}));
          mo.experts.up.push_back(W(ep + "up_proj.weight", {I, m.H}));
          mo.experts.down.push_back(W(ep + "down_proj.weight", {m.H, I}));
          expert_bytes_ +=
              mo.experts.gate.back().nbytes() + mo.experts.up.back().nbytes() + mo.experts.down.back().nbytes();
        }
      }
      if (c.shared_expert_intermediate_size > 0) {
        const int64_t S = c.shared_expert_intermediate_size;
        mo.has_shared = true;
        mo.shared = swiglu(mp + "shared_expert.", S);
        mo.shared_gate = W(mp + "shared_expert_gate.weight", {1, m.H});
      }
    }
  }
  fingerprint_ = XXH64_digest(fp);
  if (const char* e = std::getenv("HYPIC_GRAPHS"); e && std::string(e) == "0") step_graphs_ = false;
}

int64_t Model::captured_steps() const {
  int64_t n = 0;
  for (const auto& [key, sg] : impl_->steps) n += sg.graph ? 1 : 0;
  return n;
}

Model::~Model() = default;

Shape Model::transition_shape() const {
  const auto& m = *impl_;
  if (m.blocks && m.blocks->scalar_transition()) return {m.Hv, 1, 1};
  return {m.Hv, m.dk, m.dk};
}

bool Model::compact_bodies() const {
  return !impl_->blocks || impl_->blocks->compact_bodies();
}

SequenceState Model::new_state(int64_t capacity) const {
  const auto& m = *impl_;
  SequenceState st;
  st.layers.resize(m.layers.size());
  for (size_t i = 0; i < m.layers.size(); ++i) {
    auto& ls = st.layers[i];
    if (m.layers[i].kind == LayerKind::Linear) {
      ls.conv = be_.alloc(DType::F32, {m.K - 1, m.C});
      ls.ssm = be_.alloc(DType::F32, {m.Hv, m.dk, m.dv});
    }
  }
  reserve(st, std::max<int64_t>(capacity, 1));
  return st;
}

void Model::reserve(SequenceState& st, int64_t n) const {
  if (n <= st.capacity) return;
  const auto& m = *impl_;
  const int64_t cap = std::max<int64_t>(n, st.capacity * 2);
  for (size_t i = 0; i < m.layers.size(); ++i) {
    if (m.layers[i].kind != LayerKind::Attention) continue;
    auto& ls = st.layers[i];
    // Uninitialised: every row is written (computed, or spliced from a cached entry) before any
    // attention reads it; zeroing a fresh 2.5k-row cache was ~3% of a warm pic request.
    Tensor k = be_.alloc_uninit(DType::F32, {cap, m.Hkv, m.D});
    Tensor v = be_.alloc_uninit(DType::F32, {cap, m.Hkv, m.D});
    if (st.n_past > 0) {
      Tensor kd = k.slice_rows(0, st.n_past), vd = v.slice_rows(0, st.n_past);
      be_.copy(ls.k.slice_rows(0, st.n_past), kd);
      be_.copy(ls.v.slice_rows(0, st.n_past), vd);
    }
    ls.k = k;
    ls.v = v;
  }
  st.capacity = cap;
}

SequenceState Model::clone_state(const SequenceState& st) const {
  SequenceState out;
  out.n_past = st.n_past;
  out.capacity = st.capacity;
  out.layers.resize(st.layers.size());
  auto dup = [&](const Tensor& t) {
    if (!t.defined()) return Tensor();
    Tensor d = be_.alloc(t.dtype(), t.shape());
    be_.copy(t, d);
    return d;
  };
  for (size_t i = 0; i < st.layers.size(); ++i) {
    out.layers[i].conv = dup(st.layers[i].conv);
    out.layers[i].ssm = dup(st.layers[i].ssm);
    out.layers[i].k = dup(st.layers[i].k);
    out.layers[i].v = dup(st.layers[i].v);
  }
  return out;
}

Tensor Model::embed(std::span<const int32_t> ids) {
  for (int32_t id : ids)
    if (id < 0 || id >= cfg_.vocab_size)
      throw std::out_of_range("token id " + std::to_string(id) + " outside the vocabulary [0, " +
                              std::to_string(cfg_.vocab_size) + ")");
  Tensor x = be_.alloc_uninit(DType::F32, {static_cast<int64_t>(ids.size()), impl_->H});
  be_.embedding(impl_->embed, ids, x);
  return x;
}

void Model::layer_forward(int64_t layer, Tensor& x, LayerState& ls, int64_t pos0, Tensor* transition) {
  const LayerSpan span{&ls, pos0, x.dim(0), transition};
  layer_forward(layer, x, std::span<const LayerSpan>(&span, 1));
}

// Rows of x are the concatenation of the spans' tokens. Norms, projections and MLPs run once
// over all rows (one GEMM per weight for the whole batch); only the token mixers (conv,
// recurrence, KV writes, attention) run per span, each against its own state.
void Model::layer_forward(int64_t layer, Tensor& x, std::span<const LayerSpan> spans) {
  layer_forward(layer, x, spans, nullptr);
}

// With `step`, x holds one token of each of B sequences and the mixers run once over the batch from
// the step table (spans is empty); otherwise per span as above.
void Model::layer_forward(int64_t layer, Tensor& x, std::span<const LayerSpan> spans, const StepRefs* step) {
  auto& m = *impl_;
  auto& L = m.layers[static_cast<size_t>(layer)];
  const int64_t T = x.dim(0);
  if (!step) {
    int64_t rows = 0;
    for (const auto& sp : spans) rows += sp.rows;
    if (rows != T)
      throw std::invalid_argument("layer_forward: spans cover " + std::to_string(rows) + " rows, x has " +
                                  std::to_string(T));
  }
  if (m.blocks) {
    if (step) throw std::logic_error("layer_forward: " + cfg_.architecture + " has no batched decode step");
    m.blocks->layer_forward(*this, layer, x, spans);
    return;
  }
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  Tensor xn = be_.alloc_uninit(DType::F32, {T, m.H});
  Tensor mix = be_.alloc_uninit(DType::F32, {T, m.H});
  be_.rms_norm(x, L.in_norm, eps, true, xn);

  if (L.kind == LayerKind::Linear) {
    auto& g = L.gdn;
    Tensor qkv = be_.alloc_uninit(DType::F32, {T, m.C});
    Tensor z = be_.alloc_uninit(DType::F32, {T, m.Hv * m.dv});
    Tensor b = be_.alloc_uninit(DType::F32, {T, m.Hv});
    Tensor a = be_.alloc_uninit(DType::F32, {T, m.Hv});
    be_.matmul_many(xn, {g.in_qkv, g.in_z, g.in_b, g.in_a}, {qkv, z, b, a});
    Tensor q = be_.alloc_uninit(DType::F32, {T, m.Hk, m.dk});
    Tensor k = be_.alloc_uninit(DType::F32, {T, m.Hk, m.dk});
    Tensor v = be_.alloc_uninit(DType::F32, {T, m.Hv, m.dv});
    Tensor gdec = be_.alloc_uninit(DType::F32, {T, m.Hv});
    Tensor beta = be_.alloc_uninit(DType::F32, {T, m.Hv});
    Tensor o = be_.alloc_uninit(DType::F32, {T, m.Hv, m.dv});
    be_.gdn_gates(a, b, g.A_log, g.dt_bias, gdec, beta);
    if (step) {
      Tensor conv_out = be_.alloc_uninit(DType::F32, {T, m.C});
      be_.causal_conv1d_silu_step(qkv, g.conv, step->states.slice_rows(0, T), conv_out);
      if (T == 1) {
        // One row: the column blocks are contiguous, so views replace the three copies.
        Tensor row = conv_out.reshape({m.C});
        const int64_t nk = m.Hk * m.dk;
        q = row.slice_rows(0, nk).reshape({1, m.Hk, m.dk});
        k = row.slice_rows(nk, 2 * nk).reshape({1, m.Hk, m.dk});
        v = row.slice_rows(2 * nk, m.C).reshape({1, m.Hv, m.dv});
      } else {  // q, k and v are column blocks of the conv output: 3 copies for the whole batch
        Tensor q2 = q.reshape({T, m.Hk * m.dk}), k2 = k.reshape({T, m.Hk * m.dk}), v2 = v.reshape({T, m.Hv * m.dv});
        be_.copy_cols(conv_out, 0, q2);
        be_.copy_cols(conv_out, m.Hk * m.dk, k2);
        be_.copy_cols(conv_out, 2 * m.Hk * m.dk, v2);
      }
      be_.gated_delta_rule_step(q, k, v, gdec, beta, true, step->states.slice_rows(T, 2 * T), o);
    } else {
      // Every span's conv first. A conv depends only on its inputs and the conv state, which the
      // `after` work of a span (PIC composition: the cached body's conv tail) sets right after it,
      // never on the recurrent state: so all convs can run before any recurrence.
      // Consecutive spans of one state go in one call (one launch on the GPU); a snapshot (keep)
      // is taken between calls.
      std::vector<Backend::ConvSpan> cs;
      LayerState* cur = nullptr;
      int64_t c0 = 0, r0 = 0;
      auto flush = [&] {
        if (!cs.empty()) {
          // q, k and v straight from the conv (column blocks of its result): no split copies.
          Tensor qkv_out[3] = {q.slice_rows(c0, r0).reshape({r0 - c0, m.Hk * m.dk}),
                               k.slice_rows(c0, r0).reshape({r0 - c0, m.Hk * m.dk}),
                               v.slice_rows(c0, r0).reshape({r0 - c0, m.Hv * m.dv})};
          be_.causal_conv1d_silu_spans(qkv.slice_rows(c0, r0), g.conv, cs, cur->conv, qkv_out);
        }
        cs.clear();
        c0 = r0;
      };
      for (const auto& sp : spans) {
        if (cur && sp.state != cur) flush();
        cur = sp.state;
        cs.push_back({sp.rows, sp.after.conv});
        r0 += sp.rows;
        if (sp.after.keep) {
          flush();
          SpanAfter keep_only;
          keep_only.keep = sp.after.keep;
          apply_after_conv(*sp.state, keep_only);
        }
      }
      flush();
    }
    // The recurrences. Consecutive spans of one state whose `after` work is composition (a PIC
    // request's seams and cached bodies) form one chain: one call for all its segments (one launch
    // on the GPU). Spans that record inputs, emit T_C or keep a snapshot go one at a time.
    std::vector<Backend::GdnLink> links;
    int64_t r0 = 0;
    const std::span<const LayerSpan> rec_spans = step ? std::span<const LayerSpan>() : spans;
    auto chainable = [](const LayerSpan& sp) { return !sp.transition && !sp.record && !sp.after.keep; };
    for (size_t i = 0; i < rec_spans.size();) {
      LayerState& ls = *rec_spans[i].state;
      links.clear();
      int64_t rows = 0;
      bool body = false;
      size_t j = i;
      for (; j < rec_spans.size() && rec_spans[j].state == &ls && chainable(rec_spans[j]); ++j) {
        const LayerSpan& sp = rec_spans[j];
        Backend::GdnLink L;
        L.rows = sp.rows;
        if (const RecurrenceInputs* rp = sp.after.replay)
          L.rk = &rp->k, L.rv = &rp->v, L.rg = &rp->g, L.rbeta = &rp->beta;
        L.T = sp.after.B ? sp.after.T : nullptr;
        L.B = sp.after.B;
        body = body || L.rk || L.B;
        links.push_back(L);
        rows += sp.rows;
      }
      if (j > i) {
        auto sl = [&](const Tensor& t) { return t.slice_rows(r0, r0 + rows); };
        Tensor os = sl(o);
        if (body) {
          be_.gated_delta_chain(sl(q), sl(k), sl(v), sl(gdec), sl(beta), true, ls.ssm, os, links);
          r0 += rows;
        } else {
          // Nothing between the spans, but each stays a call of its own: a long span's result
          // depends on where its chunks start.
          for (const auto& L : links) {
            if (L.rows == 0) continue;
            const int64_t r1 = r0 + L.rows;
            Tensor ol = o.slice_rows(r0, r1);
            be_.gated_delta_rule(q.slice_rows(r0, r1), k.slice_rows(r0, r1), v.slice_rows(r0, r1),
                                 gdec.slice_rows(r0, r1), beta.slice_rows(r0, r1), true, ls.ssm, ol);
            r0 = r1;
          }
        }
        i = j;
        continue;
      }
      const LayerSpan& sp = rec_spans[i++];
      const int64_t r1 = r0 + sp.rows;
      if (sp.rows > 0) {
        Tensor os = o.slice_rows(r0, r1);
        be_.gated_delta_rule(q.slice_rows(r0, r1), k.slice_rows(r0, r1), v.slice_rows(r0, r1), gdec.slice_rows(r0, r1),
                             beta.slice_rows(r0, r1), true, ls.ssm, os, sp.transition);
      }
      if (sp.record && sp.rows > 0) {
        RecurrenceInputs& rec = *sp.record;
        rec.k = be_.alloc_uninit(DType::F32, {sp.rows, m.Hk, m.dk});
        rec.v = be_.alloc_uninit(DType::F32, {sp.rows, m.Hv, m.dv});
        rec.g = be_.alloc_uninit(DType::F32, {sp.rows, m.Hv});
        rec.beta = be_.alloc_uninit(DType::F32, {sp.rows, m.Hv});
        be_.copy(k.slice_rows(r0, r1), rec.k);
        be_.copy(v.slice_rows(r0, r1), rec.v);
        be_.copy(gdec.slice_rows(r0, r1), rec.g);
        be_.copy(beta.slice_rows(r0, r1), rec.beta);
      }
      if (sp.after.any()) apply_after_state(ls, sp.after);
      r0 = r1;
    }
    Tensor o2 = o.reshape({T * m.Hv, m.dv});
    be_.rms_norm_gated(o2, z.reshape({T * m.Hv, m.dv}), g.norm, eps, o2);
    Tensor on = o.reshape({T, m.Hv * m.dv});
    if (!g.out_order.empty()) {  // the heads in the order of out_proj's columns
      Tensor op = be_.alloc_uninit(DType::F32, {T, m.Hv * m.dv});
      be_.gather_col_blocks(on, g.out_order, op);
      on = op;
    }
    be_.matmul(on, g.out_proj, mix);
  } else {
    auto& at = L.attn;
    Tensor q = be_.alloc_uninit(DType::F32, {T, m.Hq, m.D});
    Tensor gate = be_.alloc_uninit(DType::F32, {T, m.Hq * m.D});
    Tensor k = be_.alloc_uninit(DType::F32, {T, m.Hkv, m.D});
    Tensor v = be_.alloc_uninit(DType::F32, {T, m.Hkv, m.D});
    Tensor q2 = q.reshape({T, m.Hq * m.D}), k2 = k.reshape({T, m.Hkv * m.D}), v2 = v.reshape({T, m.Hkv * m.D});
    be_.matmul_many(xn, {at.q, at.gate, at.k, at.v}, {q2, gate, k2, v2});
    Tensor qr = q.reshape({T * m.Hq, m.D}), kr = k.reshape({T * m.Hkv, m.D});
    be_.rms_norm(qr, at.q_norm, eps, true, qr);
    be_.rms_norm(kr, at.k_norm, eps, true, kr);
    const int rot = static_cast<int>(cfg_.rotary_dim());
    Tensor o = be_.alloc_uninit(DType::F32, {T, m.Hq, m.D});
    const float scale = 1.0f / std::sqrt(static_cast<float>(m.D));
    if (step) {
      be_.rope_neox(q, step->positions, rot, cfg_.rope_theta);
      be_.rope_neox(k, step->positions, rot, cfg_.rope_theta);
      be_.attention_step(q, k, v, step->states, step->positions, scale, o);
    } else {
      std::vector<int64_t> pos(static_cast<size_t>(T));
      size_t i = 0;
      for (const auto& sp : spans)
        for (int64_t t = 0; t < sp.rows; ++t) pos[i++] = sp.pos0 + t;
      be_.rope_neox(q, pos, rot, cfg_.rope_theta);
      be_.rope_neox(k, pos, rot, cfg_.rope_theta);
    }
    // Consecutive spans of one sequence (a composition's seams and question) write their K/V rows
    // first and share one attention call: a row sees only keys at or before its position, so the
    // later spans' rows are invisible to it (one launch instead of one per segment on the GPU).
    const std::span<const LayerSpan> run_spans = step ? std::span<const LayerSpan>() : spans;
    std::vector<Backend::RowSpan> run;
    std::vector<Backend::RowCopy> writes;
    int64_t r0 = 0;
    for (size_t i = 0; i < run_spans.size();) {
      LayerState& ls = *run_spans[i].state;
      run.clear();
      writes.clear();
      int64_t rows = 0;
      size_t j = i;
      int64_t end = 0;  // a run's spans must move forward, or a later write could hide a key
      while (j < run_spans.size() && run_spans[j].state == &ls && (j == i || run_spans[j].pos0 >= end)) {
        const LayerSpan& sp = run_spans[j++];
        end = std::max(end, sp.pos0 + sp.rows);
        if (sp.rows > 0) {
          if (sp.pos0 + sp.rows > ls.k.dim(0)) throw std::logic_error("KV cache too small: call Model::reserve first");
          writes.push_back({&k, r0 + rows, &ls.k, sp.pos0, sp.rows});
          writes.push_back({&v, r0 + rows, &ls.v, sp.pos0, sp.rows});
          run.push_back({sp.pos0, sp.rows});
          rows += sp.rows;
        }
        if (sp.after.any()) break;  // its work must follow its own attention
      }
      be_.copy_rows(writes);  // every span's K/V rows in one call
      if (rows > 0) {
        Tensor os = o.slice_rows(r0, r0 + rows);
        be_.attention_spans(q.slice_rows(r0, r0 + rows), ls.k, ls.v, run, scale, os);
      }
      if (run_spans[j - 1].after.any()) apply_after(*run_spans[j - 1].state, run_spans[j - 1].after);
      r0 += rows;
      i = j;
    }
    Tensor o2 = o.reshape({T, m.Hq * m.D});
    be_.sigmoid_mul(o2, gate, o2);
    be_.matmul(o2, at.o, mix);
  }
  be_.add_rms_norm(x, mix, L.post_norm, eps, true, xn);
  if (!L.moe) {
    swiglu_forward(be_, xn, L.mlp, x, /*accumulate=*/true);
  } else {
    auto& mo = L.moew;
    Tensor logits = be_.alloc_uninit(DType::F32, {T, cfg_.num_experts});
    Tensor sg = mo.has_shared ? be_.alloc_uninit(DType::F32, {T, 1}) : Tensor();
    Tensor sh;
    if (mo.has_shared) {
      be_.matmul_many(xn, {mo.router, mo.shared_gate}, {logits, sg});
      sh = be_.alloc_uninit(DType::F32, {T, m.H});
      swiglu_forward(be_, xn, mo.shared, sh);
    } else {
      be_.matmul(xn, mo.router, logits);
    }
    // The routed experts, the gated shared expert and the residual add: one pass on the GPU.
    be_.moe_experts_add(xn, logits, static_cast<int>(cfg_.num_experts_per_tok), cfg_.norm_topk_prob, mo.experts, sh, sg,
                        x);
  }
}

void Model::replay(const RecurrenceInputs& in, Tensor& ssm) {
  if (impl_->blocks) return impl_->blocks->replay(in, ssm);
  // q only shapes outputs nobody reads: the keys stand in for it.
  Tensor out = be_.alloc_uninit(DType::F32, {in.rows(), ssm.dim(0), ssm.dim(2)});
  be_.gated_delta_rule(in.k, in.k, in.v, in.g, in.beta, true, ssm, out);
}

void Model::apply_after(LayerState& ls, const SpanAfter& a) {
  apply_after_state(ls, a);
  apply_after_conv(ls, a);
}

void Model::apply_after_state(LayerState& ls, const SpanAfter& a) {
  if (a.replay) replay(*a.replay, ls.ssm);
  if (a.B) {
    if (a.T) {
      // compose_state's output may not alias its input state.
      Tensor next = be_.alloc_uninit(DType::F32, ls.ssm.shape());
      be_.compose_state(*a.T, ls.ssm, *a.B, 1.f, next);
      ls.ssm = next;
    } else {
      be_.add(ls.ssm, *a.B, ls.ssm);
    }
  }
  if (a.keep) {
    a.keep->ssm = be_.alloc_uninit(DType::F32, ls.ssm.shape());
    be_.copy(ls.ssm, a.keep->ssm);
  }
}

void Model::apply_after_conv(LayerState& ls, const SpanAfter& a) {
  if (a.conv) be_.copy(*a.conv, ls.conv);
  if (a.keep) {
    a.keep->conv = be_.alloc_uninit(DType::F32, ls.conv.shape());
    be_.copy(ls.conv, a.keep->conv);
  }
}

double Model::head_flops() const {
  return 2.0 * static_cast<double>(cfg_.vocab_size) * static_cast<double>(cfg_.hidden_size);
}

double Model::flops_per_token(double context) const {
  // Every weight of the decoder layers a token meets does one multiply-add (the routed experts'
  // share k/E of them): 2 FLOPs a parameter, norms and conv taps too. Not the embedding (a lookup)
  // nor the head (head_flops: a prefill runs it for its last position only).
  const double E = static_cast<double>(cfg_.num_experts), k = static_cast<double>(cfg_.num_experts_per_tok);
  const double routed = static_cast<double>(routed_params_);
  const double layers = static_cast<double>(n_params_ - embed_params_) - head_flops() / 2.0;
  double f = 2.0 * (layers - routed + (E > 0 ? routed * k / E : 0.0));
  // The token mixers: a linear layer's recurrence (~6 dk dv per value head: decay, read, write,
  // output), attention's scores and values over `context` keys.
  const auto& c = cfg_;
  for (LayerKind kind : c.layer_types) {
    if (kind == LayerKind::Linear)
      f += 6.0 * static_cast<double>(c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim);
    else if (kind == LayerKind::Attention)
      f += 4.0 * static_cast<double>(c.num_attention_heads * c.head_dim) * context;
  }
  return f;
}

double Model::step_weight_bytes(int64_t batch) const {
  const double E = static_cast<double>(cfg_.num_experts), k = static_cast<double>(cfg_.num_experts_per_tok);
  const double used = E > 0 ? 1.0 - std::pow(1.0 - k / E, static_cast<double>(batch)) : 1.0;
  const double lookups = std::min(1.0, static_cast<double>(batch) / static_cast<double>(cfg_.vocab_size));
  return static_cast<double>(weight_bytes_ - expert_bytes_ - embed_bytes_) + used * static_cast<double>(expert_bytes_) +
         lookups * static_cast<double>(embed_bytes_);
}

Tensor Model::logits(const Tensor& x) {
  auto& m = *impl_;
  const int64_t R = x.dim(0);
  Tensor xn = be_.alloc_uninit(DType::F32, {R, m.H});
  be_.rms_norm(x, m.final_norm, static_cast<float>(cfg_.rms_norm_eps), m.norm_offset, xn);
  Tensor out = be_.alloc_uninit(DType::F32, {R, cfg_.vocab_size});
  be_.matmul(xn, m.lm_head, out);
  return out;
}

Tensor Model::forward_batch(std::span<const BatchItem> items) {
  if (items.empty()) throw std::invalid_argument("forward_batch: empty batch");
  std::vector<int32_t> ids;
  for (const auto& it : items) {
    if (it.ids.empty()) throw std::invalid_argument("forward_batch: a sequence has no tokens");
    const int64_t n = static_cast<int64_t>(it.ids.size());
    if (cfg_.max_position_embeddings > 0 && it.state->n_past + n > cfg_.max_position_embeddings)
      throw std::length_error("sequence of " + std::to_string(it.state->n_past + n) +
                              " tokens exceeds the model's context of " + std::to_string(cfg_.max_position_embeddings));
    reserve(*it.state, it.state->n_past + n);
    ids.insert(ids.end(), it.ids.begin(), it.ids.end());
  }
  // Architectures with blocks of their own run decode steps as one-row spans (no step table).
  if (ids.size() == items.size() && !impl_->blocks) return decode_step(items);
  Tensor x = embed(ids);
  std::vector<LayerSpan> spans(items.size());
  for (size_t l = 0; l < impl_->layers.size(); ++l) {
    for (size_t i = 0; i < items.size(); ++i)
      spans[i] = LayerSpan{&items[i].state->layers[l], items[i].state->n_past,
                           static_cast<int64_t>(items[i].ids.size()), nullptr};
    layer_forward(static_cast<int64_t>(l), x, spans);
  }
  // Last row of each sequence.
  Tensor last = be_.alloc_uninit(DType::F32, {static_cast<int64_t>(items.size()), impl_->H});
  int64_t r = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    r += static_cast<int64_t>(items[i].ids.size());
    Tensor dst = last.slice_rows(static_cast<int64_t>(i), static_cast<int64_t>(i) + 1);
    be_.copy(x.slice_rows(r - 1, r), dst);
    items[i].state->n_past += static_cast<int64_t>(items[i].ids.size());
  }
  return logits(last);
}

Tensor Model::forward(std::span<const int32_t> ids, SequenceState& st, const ForwardOptions& opt) {
  const int64_t T = static_cast<int64_t>(ids.size());
  if (T == 0) throw std::invalid_argument("forward: empty token list");
  if (cfg_.max_position_embeddings > 0 && st.n_past + T > cfg_.max_position_embeddings)
    throw std::length_error("sequence of " + std::to_string(st.n_past + T) + " tokens exceeds the model's context of " +
                            std::to_string(cfg_.max_position_embeddings));
  reserve(st, st.n_past + T);
  if (T == 1 && !opt.all_logits && !impl_->blocks) {
    const BatchItem item{&st, ids};
    return decode_step(std::span<const BatchItem>(&item, 1));
  }
  // Prefill in bounded chunks: exact (every layer is causal and carries its state) and keeps
  // activation memory independent of prompt length.
  const int64_t kChunk = be_.prefill_chunk();
  Tensor all;
  if (opt.all_logits) all = be_.alloc_uninit(DType::F32, {T, cfg_.vocab_size});
  Tensor last;
  for (int64_t s = 0; s < T; s += kChunk) {
    const int64_t n = std::min(kChunk, T - s);
    Tensor x = embed(ids.subspan(static_cast<size_t>(s), static_cast<size_t>(n)));
    for (size_t i = 0; i < impl_->layers.size(); ++i)
      layer_forward(static_cast<int64_t>(i), x, st.layers[i], st.n_past);
    st.n_past += n;
    if (opt.all_logits) {
      Tensor lg = logits(x);
      Tensor dst = all.slice_rows(s, s + n);
      be_.copy(lg, dst);
    } else if (s + n == T) {
      last = logits(x.slice_rows(n - 1, n));
    }
  }
  return opt.all_logits ? all : last;
}

// One token for each sequence (states reserved by the caller). Host values enter only through
// write()s of the step's ids and table; the layers read them on the device, so the same recorded
// graph serves every later step of this batch size, whichever sequences fill it.
Tensor Model::decode_step(std::span<const BatchItem> items) {
  auto& m = *impl_;
  const int64_t B = static_cast<int64_t>(items.size()), L = static_cast<int64_t>(m.layers.size());
  std::vector<int32_t> ids(static_cast<size_t>(B));
  std::vector<int64_t> tab(static_cast<size_t>(B * (1 + 2 * L)));
  auto addr = [](const Tensor& t) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(t.raw())); };
  for (int64_t b = 0; b < B; ++b) {
    const auto& it = items[static_cast<size_t>(b)];
    const int32_t id = it.ids[0];
    if (id < 0 || id >= cfg_.vocab_size)
      throw std::out_of_range("token id " + std::to_string(id) + " outside the vocabulary [0, " +
                              std::to_string(cfg_.vocab_size) + ")");
    if (it.state->n_past >= it.state->capacity) throw std::logic_error("decode_step: call Model::reserve first");
    ids[static_cast<size_t>(b)] = id;
    tab[static_cast<size_t>(b)] = it.state->n_past;
    for (int64_t l = 0; l < L; ++l) {
      const LayerState& ls = it.state->layers[static_cast<size_t>(l)];
      const bool lin = m.layers[static_cast<size_t>(l)].kind == LayerKind::Linear;
      const size_t o = static_cast<size_t>(B + l * 2 * B + b);
      tab[o] = addr(lin ? ls.conv : ls.k);
      tab[o + static_cast<size_t>(B)] = addr(lin ? ls.ssm : ls.v);
    }
  }
  StepGraph& sg = m.steps[{B, be_.precise()}];
  if (!sg.ids.defined()) {
    sg.ids = be_.alloc(DType::I32, {B});
    sg.table = be_.alloc(DType::I64, {static_cast<int64_t>(tab.size())});
  }
  be_.write(sg.ids, ids.data(), ids.size() * sizeof(int32_t));
  be_.write(sg.table, tab.data(), tab.size() * sizeof(int64_t));
  auto body = [&] {
    Tensor x = be_.alloc_uninit(DType::F32, {B, m.H});
    be_.embedding(m.embed, sg.ids, x);
    StepRefs refs{sg.table.slice_rows(0, B), Tensor()};
    for (int64_t l = 0; l < L; ++l) {
      refs.states = sg.table.slice_rows(B + l * 2 * B, B + (l + 1) * 2 * B);
      layer_forward(l, x, {}, &refs);
    }
    sg.logits = logits(x);
  };
  // The first step of a batch size runs op by op (it also warms caches a recording cannot fill:
  // expert tables, rotary tables, scratch sizes); the second records the graph; later ones replay it.
  if (step_graphs_ && sg.graph) {
    sg.graph->replay();
  } else if (step_graphs_ && !sg.no_graph && sg.runs > 0) {
    sg.logits = Tensor();
    sg.graph = be_.capture(body);
    if (sg.graph)
      sg.graph->replay();
    else
      sg.no_graph = true, body();
  } else {
    body();
  }
  ++sg.runs;
  for (const auto& it : items) it.state->n_past += 1;
  if (!sg.graph) return std::exchange(sg.logits, Tensor());
  // The graph's logits are overwritten by its next replay: hand out a copy.
  Tensor out = be_.alloc_uninit(DType::F32, sg.logits.shape());
  be_.copy(sg.logits, out);
  return out;
}

}  // namespace hypic
