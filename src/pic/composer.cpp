#include "pic/composer.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <unordered_map>

#include "pic/entry_codec.h"

namespace hypic {

PicMode parse_pic_mode(const std::string& s) {
  if (s == "full") return PicMode::Full;
  if (s == "prefix") return PicMode::Prefix;
  if (s == "pic") return PicMode::Pic;
  if (s == "naive") return PicMode::Naive;
  throw std::invalid_argument("unknown mode '" + s + "' (expected full, prefix, pic or naive)");
}

const char* pic_mode_name(PicMode m) {
  switch (m) {
    case PicMode::Full:
      return "full";
    case PicMode::Prefix:
      return "prefix";
    case PicMode::Pic:
      return "pic";
    case PicMode::Naive:
      return "naive";
  }
  return "?";
}

// ---- prefix cache ----------------------------------------------------------------------------
// Exact-prefix snapshots taken at segment boundaries: what prefix caching engines reuse today.
// Two kinds share one LRU:
//  - exact (tag 0, prefix mode): the state of a plain prefill of `ids`; it fits any request whose
//    tokens start with `ids` and that has a segment boundary at ids.size();
//  - composed (tag != 0, pic / naive): the state the composition left after these segments under
//    one set of options (the tag). A composed state depends on where the segments start and end,
//    so it fits only a request whose first segments are exactly these (`bounds`, their ends).
struct PicEngine::PrefixCache {
  struct Snap {
    std::vector<int32_t> ids;
    SequenceState state;
    size_t bytes;
    uint64_t tag = 0;
    std::vector<size_t> bounds;  // composed snapshots: the ends of the segments they hold
  };
  size_t budget;
  size_t bytes = 0;
  std::list<Snap> lru;  // front = most recent
  std::mutex mu;

  static size_t state_bytes(const SequenceState& st) {
    size_t b = 0;
    for (auto& l : st.layers)
      for (const Tensor* t : {&l.conv, &l.ssm, &l.k, &l.v})
        if (t->defined()) b += t->nbytes();
    return b;
  }
  // Longest cached prefix of `ids` that ends at one of `boundaries` (exact snapshots, tag 0) or
  // whose segments are the request's first ones (composed snapshots of this tag); null if none.
  const Snap* longest(const std::vector<int32_t>& ids, const std::vector<size_t>& boundaries, uint64_t tag = 0) {
    const Snap* best = nullptr;
    for (auto it = lru.begin(); it != lru.end(); ++it) {
      const size_t n = it->ids.size();
      if (it->tag != tag || n > ids.size() || (best && n <= best->ids.size())) continue;
      if (tag == 0) {
        if (std::find(boundaries.begin(), boundaries.end(), n) == boundaries.end()) continue;
      } else if (it->bounds.size() > boundaries.size() ||
                 !std::equal(it->bounds.begin(), it->bounds.end(), boundaries.begin())) {
        continue;
      }
      if (!std::equal(it->ids.begin(), it->ids.end(), ids.begin())) continue;
      best = &*it;
    }
    if (best)
      for (auto it = lru.begin(); it != lru.end(); ++it)
        if (&*it == best) {
          lru.splice(lru.begin(), lru, it);
          break;
        }
    return best;
  }
  void put(std::vector<int32_t> ids, SequenceState st, uint64_t tag = 0, std::vector<size_t> bounds = {}) {
    const size_t b = state_bytes(st);
    if (b > budget) return;
    for (auto it = lru.begin(); it != lru.end(); ++it)
      if (it->tag == tag && it->ids == ids && it->bounds == bounds) {
        lru.splice(lru.begin(), lru, it);
        return;
      }
    while (bytes + b > budget && !lru.empty()) {
      bytes -= lru.back().bytes;
      lru.pop_back();
    }
    lru.push_front(Snap{std::move(ids), std::move(st), b, tag, std::move(bounds)});
    bytes += b;
  }
};

PicEngine::PicEngine(Model& model, size_t segment_cache_bytes, size_t prefix_cache_bytes)
    : model_(model), cache_(segment_cache_bytes), prefix_(std::make_unique<PrefixCache>()) {
  prefix_->budget = prefix_cache_bytes ? prefix_cache_bytes : segment_cache_bytes;
  init_expected_shapes();  // entries from disk and from workers are checked against them
}
PicEngine::~PicEngine() = default;

namespace {
void check_segments(const Model& m, const std::vector<std::vector<int32_t>>& segs) {
  if (segs.empty()) throw std::invalid_argument("the request has no segments");
  int64_t total = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    if (segs[i].empty()) throw std::invalid_argument("segment " + std::to_string(i) + " is empty");
    total += static_cast<int64_t>(segs[i].size());
  }
  const int64_t ctx = m.config().max_position_embeddings;
  if (ctx > 0 && total > ctx)
    throw std::length_error("prompt of " + std::to_string(total) + " tokens exceeds the model's context of " +
                            std::to_string(ctx) + " tokens");
}

// Prefix-cache tag of composed snapshots: everything besides the segments that shapes the state.
uint64_t composed_tag(const PicOptions& o) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint64_t v : {static_cast<uint64_t>(o.mode), static_cast<uint64_t>(o.seam), static_cast<uint64_t>(o.tail_seam),
                     static_cast<uint64_t>(o.rerotate)})
    h = (h ^ v) * 0x100000001b3ull;
  return h | 1;  // never 0, the tag of exact snapshots
}

// A copy of st holding exactly its n_past KV rows.
SequenceState snapshot(const Model& m, const SequenceState& st) {
  Backend& be = m.backend();
  SequenceState out = m.new_state(std::max<int64_t>(st.n_past, 1));
  out.n_past = st.n_past;
  for (size_t i = 0; i < st.layers.size(); ++i) {
    auto& s = st.layers[i];
    auto& d = out.layers[i];
    if (s.conv.defined()) be.copy(s.conv, d.conv);
    if (s.ssm.defined()) be.copy(s.ssm, d.ssm);
    if (s.k.defined() && st.n_past > 0) {
      Tensor dk = d.k.slice_rows(0, st.n_past), dv = d.v.slice_rows(0, st.n_past);
      be.copy(s.k.slice_rows(0, st.n_past), dk);
      be.copy(s.v.slice_rows(0, st.n_past), dv);
    }
  }
  return out;
}
}  // namespace

// An isolated build in progress: the segment's state from position 0, the linear layers' states
// kept at the end of the head and of the body, and each linear layer's body transition so far.
struct EntryBuild {
  std::vector<int32_t> ids;
  int seam = 0, tail = 0;
  int64_t L = 0, head = 0, body_end = 0;
  int64_t done = 0;  // tokens through every layer
  // The chunk under way, [a, e): its activations after `layer` layers (a step may end between layers).
  int64_t a = 0, e = 0, layer = 0;
  Tensor x;
  SequenceState st;
  std::vector<LayerState> at_head, at_body;
  std::vector<Tensor> T;  // per layer (linear): the body's transition so far
  // A short body within one chunk is kept in compact form: per linear layer its recurrence inputs.
  bool compact = false;
  std::vector<RecurrenceInputs> body;
  bool finished = false;
};

// Whether a body of n tokens is smaller as its recurrence inputs than as T and S (both f32).
bool PicEngine::compact_body(int64_t n) const {
  const auto& c = model_.config();
  const int64_t Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads, dk = c.linear_key_head_dim,
                dv = c.linear_value_head_dim;
  return compact_ && model_.compact_bodies() && n > 0 && n * (Hk * dk + Hv * dv + 2 * Hv) < Hv * dk * (dk + dv);
}

std::shared_ptr<EntryBuild> PicEngine::start_build(const std::vector<int32_t>& ids, int seam, int tail) {
  const int64_t L = static_cast<int64_t>(ids.size());
  if (L == 0) throw std::invalid_argument("cannot cache an empty segment");
  auto b = std::make_shared<EntryBuild>();
  b->ids = ids;
  b->seam = seam;
  b->tail = tail;
  b->L = L;
  b->head = std::clamp<int64_t>(seam, 0, L);
  b->body_end = L - std::clamp<int64_t>(tail, 0, L - b->head);
  b->st = model_.new_state(L);  // zero state at position 0: the segment in isolation
  const size_t n = static_cast<size_t>(model_.config().num_hidden_layers);
  b->at_head.resize(n);
  b->at_body.resize(n);
  b->T.resize(n);
  b->compact = L <= build_chunk() && compact_body(b->body_end - b->head);
  if (b->compact) b->body.resize(n);
  return b;
}

// Tokens [done, done + chunk) through every layer. In a linear layer the chunk is up to three spans
// on the one state (its parts of head | body | tail; an empty head or tail as a span of no rows
// where it sits), so a segment within one chunk takes exactly the single pass it always took; the
// state is kept after the head and after the body, and the body's transition is chained across
// chunks (T <- T_chunk T).
std::shared_ptr<SegmentEntry> PicEngine::step_build(EntryBuild& b, int64_t max_token_layers) {
  if (b.finished) throw std::logic_error("step_build: the build is already finished");
  Model& m = model_;
  Backend& be = m.backend();
  const auto& cfg = m.config();
  if (b.layer == 0) {
    b.a = b.done;
    b.e = std::min(b.L, b.done + std::max<int64_t>(build_chunk(), 1));
    std::span<const int32_t> chunk(b.ids.data() + b.a, static_cast<size_t>(b.e - b.a));
    b.x = m.embed(chunk);
  }
  const int64_t a = b.a, e = b.e;
  Tensor& x = b.x;
  // Whole layers up to the step's budget, at least one: the same computation in any steps.
  const int64_t l0 = b.layer;
  const int64_t n_layers =
      std::clamp<int64_t>(max_token_layers / std::max<int64_t>(e - a, 1), 1, cfg.num_hidden_layers - l0);
  struct Region {
    int64_t from, to;
  };
  const Region regions[3] = {{0, b.head}, {b.head, b.body_end}, {b.body_end, b.L}};
  auto in_chunk = [&](const Region& r) {
    if (r.from == r.to) return r.from >= a && (r.from < e || e == b.L);  // an empty region, once
    return r.from < e && r.to > a;
  };
  for (int64_t l = l0; l < l0 + n_layers; ++l) {
    const size_t li = static_cast<size_t>(l);
    auto& ls = b.st.layers[li];
    if (cfg.layer_types[li] != LayerKind::Linear) {
      m.layer_forward(l, x, ls, a);
      continue;
    }
    LayerSpan spans[3];
    size_t n = 0;
    Tensor Tc;
    bool chain = false;
    for (int r = 0; r < 3; ++r) {
      if (!in_chunk(regions[r])) continue;
      const int64_t from = std::max(a, regions[r].from), to = std::min(e, regions[r].to);
      LayerSpan sp{&ls, from, to - from, nullptr, {}};
      if (r == 0 && to == b.head) sp.after.keep = &b.at_head[li];
      if (r == 1 && b.compact) {
        if (to == b.body_end) sp.after.keep = &b.at_body[li];
        sp.record = &b.body[li];
      } else if (r == 1) {
        if (to == b.body_end) sp.after.keep = &b.at_body[li];
        chain = b.T[li].defined();
        sp.transition = chain ? &Tc : &b.T[li];
        if (chain)
          Tc = be.alloc(DType::F32, b.T[li].shape());
        else
          b.T[li] = be.alloc(DType::F32, m.transition_shape());
      }
      spans[n++] = sp;
    }
    m.layer_forward(l, x, std::span<const LayerSpan>(spans, n));
    if (chain) {
      Tensor zero = be.alloc(DType::F32, Tc.shape()), next = be.alloc(DType::F32, Tc.shape());
      be.compose_state(Tc, b.T[li], zero, 1.f, next);
      b.T[li] = next;
    }
  }
  b.layer = l0 + n_layers;
  if (b.layer < cfg.num_hidden_layers) return nullptr;
  b.layer = 0;
  b.x = Tensor();
  b.done = e;
  if (b.done < b.L) return nullptr;

  b.finished = true;
  auto out = std::make_shared<SegmentEntry>();
  out->key = SegmentKey{m.fingerprint(), b.seam, b.tail, b.ids};
  out->layers.resize(static_cast<size_t>(cfg.num_hidden_layers));
  // The cache stores the body's transition, its zero-start state S_body = S_end - T_body S_head
  // (linearity), or in compact form its recurrence inputs, and the conv state at the end of the body.
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const size_t li = static_cast<size_t>(l);
    auto& ls = b.st.layers[li];
    auto& o = out->layers[li];
    if (cfg.layer_types[li] == LayerKind::Linear) {
      const auto& sh = ls.ssm.shape();  // [Hv, dk, dv]
      o.conv_tail = b.at_body[li].conv;
      if (b.compact) {
        o.body = std::move(b.body[li]);
        continue;
      }
      o.S = be.alloc(DType::F32, sh);
      if (b.head < b.body_end) {
        o.T = b.T[li];
        be.compose_state(o.T, b.at_head[li].ssm, b.at_body[li].ssm, -1.f, o.S);
      } else {
        o.T = be.alloc(DType::F32, m.transition_shape());
        be.set_identity(o.T);  // empty body: T = I, S = 0
      }
    } else if (cfg.layer_types[li] == LayerKind::Attention) {
      const auto& ks = ls.k.shape();
      o.k = be.alloc(DType::F32, {b.L, ks[1], ks[2]});
      o.v = be.alloc(DType::F32, {b.L, ks[1], ls.v.dim(2)});
      be.copy(ls.k.slice_rows(0, b.L), o.k);
      be.copy(ls.v.slice_rows(0, b.L), o.v);
    }
  }
  finish_entry(*out);
  return out;
}

std::shared_ptr<SegmentEntry> PicEngine::build_entry(const std::vector<int32_t>& ids, int seam, int tail) {
  auto b = start_build(ids, seam, tail);
  while (true)
    if (auto e = step_build(*b)) return e;
}

void PicEngine::finish_entry(SegmentEntry& e) {
  Backend& be = model_.backend();
  if (rounding_ != EntryRounding::None) {
    // bf16 values (round to nearest even) in the f32 tensors, through the host.
    auto round = [&be](Tensor& t) {
      if (!t.defined()) return;
      Tensor h = be.to_host(t);
      float* p = h.data<float>();
      for (int64_t i = 0; i < h.numel(); ++i) {
        uint32_t u;
        std::memcpy(&u, &p[i], 4);
        if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        std::memcpy(&p[i], &u, 4);
      }
      if (h.raw() != t.raw()) be.write(t, h.raw(), h.nbytes());  // the CPU's to_host is a view
    };
    for (auto& l : e.layers) {
      round(l.T);
      if (rounding_ == EntryRounding::All) {
        round(l.S);
        round(l.conv_tail);
        for (Tensor* t : {&l.body.k, &l.body.v, &l.body.g, &l.body.beta}) round(*t);
        round(l.k);
        round(l.v);
      }
    }
  }
  const bool t_bf16 = t_dtype_ == TransitionDType::BF16 || (t_dtype_ == TransitionDType::Auto && !be.precise());
  if (t_bf16)
    for (auto& l : e.layers)
      if (l.T.defined() && l.T.dtype() == DType::F32 && l.T.numel() > l.T.dim(0)) {  // dense, not [Hv, 1, 1]
        Tensor t = be.alloc_uninit(DType::BF16, l.T.shape());
        be.convert(l.T, t);
        l.T = std::move(t);
      }
  e.account();
}

void PicEngine::attach_store(std::shared_ptr<SegmentStore> store) {
  cache_.attach_store(std::move(store));
}

void PicEngine::init_expected_shapes() {
  // Expected summary shapes, taken from a one-token state of this model.
  const auto& cfg = model_.config();
  SequenceState st = model_.new_state(1);
  expect_.clear();
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const auto& ls = st.layers[static_cast<size_t>(l)];
    if (cfg.layer_types[static_cast<size_t>(l)] == LayerKind::Linear) {
      const auto& sh = ls.ssm.shape();  // [Hv, dk, dv]
      expect_.push_back(model_.transition_shape());
      expect_.push_back(sh);
      expect_.push_back(ls.conv.shape());
    } else if (cfg.layer_types[static_cast<size_t>(l)] == LayerKind::Attention) {
      expect_.push_back({ls.k.dim(1), ls.k.dim(2)});
      expect_.push_back({ls.v.dim(1), ls.v.dim(2)});
    }
  }
}

std::shared_ptr<SegmentStore> PicEngine::attach_cache_dir(const std::string& dir, size_t disk_budget_bytes) {
  auto s = std::make_shared<SegmentStore>(dir, model_.backend(), disk_budget_bytes);
  attach_store(s);
  return s;
}

std::string PicEngine::check_entry(const SegmentEntry& e) const {
  const auto& cfg = model_.config();
  if (e.layers.size() != static_cast<size_t>(cfg.num_hidden_layers))
    return "has " + std::to_string(e.layers.size()) + " layers, the model " + std::to_string(cfg.num_hidden_layers);
  const int64_t L = static_cast<int64_t>(e.key.ids.size());
  size_t x = 0;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const auto& s = e.layers[static_cast<size_t>(l)];
    const std::string at = "layer " + std::to_string(l) + ": ";
    auto want = [&](const Tensor& t, const char* name, const Shape& shape, bool bf16_ok = false) -> std::string {
      if (!t.defined()) return at + name + " missing";
      if ((t.dtype() != DType::F32 && !(bf16_ok && t.dtype() == DType::BF16)) || t.shape() != shape)
        return at + name + " is " + t.str() + ", expected f32" + (bf16_ok ? " or bf16" : "") + shape_str(shape);
      return "";
    };
    std::string why;
    if (cfg.layer_types[static_cast<size_t>(l)] == LayerKind::Linear) {
      if (s.body.defined()) {
        // Compact form: the recurrence inputs of exactly the body's tokens, and no T or S.
        const int64_t Hk = cfg.linear_num_key_heads, Hv = cfg.linear_num_value_heads;
        const int64_t head = std::clamp<int64_t>(e.key.seam, 0, L);
        const int64_t n = L - std::clamp<int64_t>(e.key.tail, 0, L - head) - head;
        if (n <= 0) why = at + "a compact body in an entry without a body";
        if (why.empty()) why = want(s.body.k, "body k", {n, Hk, cfg.linear_key_head_dim});
        if (why.empty()) why = want(s.body.v, "body v", {n, Hv, cfg.linear_value_head_dim});
        if (why.empty()) why = want(s.body.g, "body g", {n, Hv});
        if (why.empty()) why = want(s.body.beta, "body beta", {n, Hv});
        if (why.empty() && (s.T.defined() || s.S.defined())) why = at + "both a compact body and T/S";
      } else {
        if (why.empty()) why = want(s.T, "T", expect_[x], /*bf16_ok=*/true);
        if (why.empty()) why = want(s.S, "S", expect_[x + 1]);
        if (why.empty() && (s.body.v.defined() || s.body.g.defined() || s.body.beta.defined()))
          why = at + "a partial compact body";
      }
      if (why.empty()) why = want(s.conv_tail, "conv_tail", expect_[x + 2]);
      if (why.empty() && (s.k.defined() || s.v.defined())) why = at + "unexpected k/v in a linear layer";
      x += 3;
    } else if (cfg.layer_types[static_cast<size_t>(l)] == LayerKind::Ffn) {
      if (s.T.defined() || s.S.defined() || s.conv_tail.defined() || s.body.defined() || s.body.v.defined() ||
          s.body.g.defined() || s.body.beta.defined() || s.k.defined() || s.v.defined())
        why = at + "unexpected state in a block without a token mixer";
    } else {
      if (why.empty()) why = want(s.k, "k", {L, expect_[x][0], expect_[x][1]});
      if (why.empty()) why = want(s.v, "v", {L, expect_[x + 1][0], expect_[x + 1][1]});
      if (why.empty() && (s.T.defined() || s.S.defined() || s.conv_tail.defined() || s.body.v.defined() ||
                          s.body.g.defined() || s.body.beta.defined() || s.body.defined()))
        why = at + "unexpected linear state in a full-attention layer";
      x += 2;
    }
    if (!why.empty()) return why;
  }
  return "";
}

std::shared_ptr<const SegmentEntry> PicEngine::lookup(const SegmentKey& key) {
  return cache_.store() ? cache_.find_or_load(key, [this](const SegmentEntry& e) { return check_entry(e); })
                        : cache_.find(key);
}

std::shared_ptr<const SegmentEntry> PicEngine::get_or_build(const std::vector<int32_t>& ids, int seam, int tail,
                                                            CacheReport& rep) {
  SegmentKey key{model_.fingerprint(), seam, tail, ids};
  if (auto hit = lookup(key)) {
    ++rep.hit_segments;
    return hit;
  }
  ++rep.miss_segments;
  rep.computed_tokens += static_cast<int64_t>(ids.size());  // the isolated prefill
  return cache_.insert(build_entry(ids, seam, tail));
}

std::pair<int, int> seam_widths(size_t i, const PicOptions& opt) {
  if (i == 0 || opt.mode == PicMode::Naive) return {0, 0};
  return {opt.seam, opt.tail_seam};
}

size_t PicPlan::next_missing() const {
  for (size_t i = 0; i < parts.size(); ++i)
    if (parts[i].missing()) return i;
  return parts.size();
}

namespace {
void check_options(const PicOptions& opt) {
  if (opt.seam < 0) throw std::invalid_argument("seam must be >= 0, got " + std::to_string(opt.seam));
  if (opt.tail_seam < 0) throw std::invalid_argument("tail seam must be >= 0, got " + std::to_string(opt.tail_seam));
}
}  // namespace

PicPlan PicEngine::plan(const std::vector<std::vector<int32_t>>& segs, const PicOptions& opt) {
  check_segments(model_, segs);
  check_options(opt);
  if (opt.mode != PicMode::Pic && opt.mode != PicMode::Naive)
    throw std::invalid_argument(std::string("a PIC plan is for the pic and naive modes, not ") +
                                pic_mode_name(opt.mode));
  PicPlan p;
  p.opt = opt;
  int64_t pos = 0;
  // Entries found in the host tier are copied back together, layer by layer, when the plan is made
  // (before the builds of its missing entries, which overlap the copies).
  SegmentCache::PromotionBatch batch(cache_);
  for (size_t i = 0; i + 1 < segs.size(); ++i) {
    const auto [seam, tail] = seam_widths(i, opt);
    PicPart part;
    part.key = SegmentKey{model_.fingerprint(), seam, tail, segs[i]};
    part.pos = pos;
    part.len = static_cast<int64_t>(segs[i].size());
    part.head = std::min<int64_t>(seam, part.len);
    part.tail = std::min<int64_t>(tail, part.len - part.head);
    pos += part.len;
    p.parts.push_back(std::move(part));
  }
  // Every entry looked up at once: the disk tier reads a request's files in parallel.
  std::vector<SegmentKey> keys;
  std::vector<size_t> at;
  for (size_t i = 0; i < p.parts.size(); ++i)
    if (p.parts[i].has_body()) keys.push_back(p.parts[i].key), at.push_back(i);
  // (Without a disk tier this is find() of each key.)
  auto found = cache_.find_or_load_many(keys, [this](const SegmentEntry& e) { return check_entry(e); });
  for (size_t j = 0; j < keys.size(); ++j) p.parts[at[j]].entry = std::move(found[j]);
  batch.end();  // the copies of the entries found in the host or disk tier are queued (or this throws)
  return p;
}

void PicEngine::build(PicPlan& plan, size_t i) {
  while (!build_step(plan, i)) {
  }
}

bool PicEngine::build_step(PicPlan& plan, size_t i, int64_t max_token_layers) {
  PicPart& part = plan.parts.at(i);
  if (!part.missing()) return true;
  if (!part.building) part.building = start_build(part.key.ids, part.key.seam, part.key.tail);
  auto e = step_build(*part.building, max_token_layers);
  if (!e) return false;
  part.building.reset();
  part.entry = cache_.insert(std::move(e));
  part.built = true;
  return true;
}

void PicEngine::adopt(PicPlan& plan, size_t i, std::shared_ptr<SegmentEntry> e) {
  PicPart& part = plan.parts.at(i);
  if (!e) throw std::invalid_argument("no entry");
  if (std::string d = key_difference(part.key, e->key); !d.empty()) throw std::invalid_argument("the entry " + d);
  if (std::string why = check_entry(*e); !why.empty()) throw std::invalid_argument(why);
  Backend& be = model_.backend();
  for (auto& l : e->layers)
    for (Tensor* t : l.tensors())
      if (t->defined()) *t = be.to_device(*t);
  e->account();
  part.building.reset();
  part.entry = cache_.insert(std::move(e));
  part.built = true;
}

PrefillResult PicEngine::prefill(const std::vector<std::vector<int32_t>>& segs, const PicOptions& opt) {
  check_segments(model_, segs);
  check_options(opt);
  switch (opt.mode) {
    case PicMode::Full:
      return prefill_full(segs, opt.skip_question);
    case PicMode::Prefix:
      return prefill_prefix(segs, opt.skip_question);
    case PicMode::Pic:
    case PicMode::Naive: {
      PicPlan p = plan(segs, opt);
      for (size_t i = p.next_missing(); i < p.parts.size(); i = p.next_missing()) build(p, i);
      return compose(segs, p);
    }
  }
  throw std::logic_error("bad mode");
}

PrefillResult PicEngine::prefill_full(const std::vector<std::vector<int32_t>>& segs, bool skip_question) {
  std::vector<int32_t> all;
  for (size_t i = 0; i + (skip_question ? 1 : 0) < segs.size(); ++i)
    all.insert(all.end(), segs[i].begin(), segs[i].end());
  PrefillResult r;
  r.state = model_.new_state(static_cast<int64_t>(all.size()) + static_cast<int64_t>(segs.back().size()));
  if (!all.empty()) r.logits = model_.forward(all, r.state);
  r.report.computed_tokens = static_cast<int64_t>(all.size());
  return r;
}

// Prefix caching under way (start_prefix, step_prefix): the prompt, its segment ends, and how far
// the recomputation has gone.
struct PrefixRun {
  std::vector<int32_t> all;
  std::vector<size_t> ends;  // every segment's end, the question's included
  size_t run_segments = 0;   // segments to compute: all, or all but the question
  size_t seg = 0, pos = 0;   // the segment under way and the tokens done
  PrefillResult r;
};

std::shared_ptr<PrefixRun> PicEngine::start_prefix(const std::vector<std::vector<int32_t>>& segs, bool skip_question) {
  check_segments(model_, segs);
  auto run = std::make_shared<PrefixRun>();
  auto& all = run->all;
  std::vector<size_t> bounds;  // segment ends before the question: where snapshots may sit
  for (size_t i = 0; i < segs.size(); ++i) {
    all.insert(all.end(), segs[i].begin(), segs[i].end());
    run->ends.push_back(all.size());
    if (i + 1 < segs.size()) bounds.push_back(all.size());
  }
  run->run_segments = segs.size() - (skip_question ? 1 : 0);
  PrefillResult& r = run->r;
  size_t done = 0;
  {
    std::lock_guard<std::mutex> g(prefix_->mu);
    if (const auto* snap = prefix_->longest(all, bounds)) {
      r.state = snapshot(model_, snap->state);
      done = snap->ids.size();
    }
  }
  if (done == 0) r.state = model_.new_state(static_cast<int64_t>(all.size()));
  model_.reserve(r.state, static_cast<int64_t>(all.size()));
  r.report.reused_tokens = static_cast<int64_t>(done);
  r.report.prefix_tokens = static_cast<int64_t>(done);
  for (size_t b : bounds) r.report.hit_segments += b <= done ? 1 : 0;
  run->pos = done;
  return run;
}

std::optional<PrefillResult> PicEngine::step_prefix(PrefixRun& run, int64_t max_tokens) {
  // The rest, segment by segment, at most max_tokens (at least one chunk) per step; each new
  // segment end is snapshotted for later requests.
  int64_t budget = std::max<int64_t>(max_tokens, 1);
  PrefillResult& r = run.r;
  while (run.seg < run.run_segments && budget > 0) {
    const size_t end = run.ends[run.seg];
    if (run.pos >= end) {
      ++run.seg;
      continue;
    }
    const size_t n = std::min(end - run.pos, static_cast<size_t>(budget));
    r.logits = model_.forward(std::span<const int32_t>(run.all.data() + run.pos, n), r.state);
    r.report.computed_tokens += static_cast<int64_t>(n);
    run.pos += n;
    budget -= static_cast<int64_t>(n);
    if (run.pos == end) {
      if (run.seg + 1 < run.ends.size()) {
        ++r.report.miss_segments;
        std::lock_guard<std::mutex> g(prefix_->mu);
        prefix_->put(std::vector<int32_t>(run.all.begin(), run.all.begin() + static_cast<long>(end)),
                     snapshot(model_, r.state));
      }
      ++run.seg;
    }
  }
  while (run.seg < run.run_segments && run.pos >= run.ends[run.seg]) ++run.seg;
  if (run.seg < run.run_segments) return std::nullopt;
  return std::move(run.r);
}

PrefillResult PicEngine::prefill_prefix(const std::vector<std::vector<int32_t>>& segs, bool skip_question) {
  auto run = start_prefix(segs, skip_question);
  for (;;)
    if (auto r = step_prefix(*run, std::numeric_limits<int64_t>::max())) return std::move(*r);
}

size_t PicEngine::cached_prefix_segments(const std::vector<std::vector<int32_t>>& segs, const PicOptions& opt) {
  if ((opt.mode != PicMode::Pic && opt.mode != PicMode::Naive) || segs.size() < 2) return 0;
  std::vector<int32_t> ctx;
  std::vector<size_t> bounds;
  for (size_t i = 0; i + 1 < segs.size(); ++i) {
    ctx.insert(ctx.end(), segs[i].begin(), segs[i].end());
    bounds.push_back(ctx.size());
  }
  std::lock_guard<std::mutex> g(prefix_->mu);
  const auto* snap = prefix_->longest(ctx, bounds, composed_tag(opt));
  return snap ? snap->bounds.size() : 0;
}

// A composition under way (start_compose, step_compose): the request's state, the plan's parts with
// their entries pinned, and how far the steps have gone.
struct ComposeRun {
  struct Part {
    std::shared_ptr<const SegmentEntry> e;  // null: no body, the whole segment is its seam (or pending)
    int64_t pos, len, head, tail;           // cached body: [head, len - tail)
    bool restored;                          // covered by the snapshot: seam rows come from it
    std::vector<int32_t> rows;              // the seam rows this request computes
    bool pending = false;                   // its entry is still being built (supply())
    SegmentKey key;                         // what supply() must give a pending part
  };
  PicOptions opt;
  std::vector<Part> parts;
  std::vector<int32_t> question;  // empty when opt.skip_question
  PrefillResult r;
  SequenceState snap;  // handles to the snapshot's immutable tensors
  size_t next = 0;     // the first part not yet composed
  size_t first = 0;    // parts the snapshot covers (their seam rows are spliced in one step)
  int64_t pos = 0;     // the context's length
  int64_t seam_rows = 0;
  // The snapshot of this context for the next request that starts with these segments.
  bool keep = false;
  SequenceState end;
  std::vector<int32_t> ctx;
  std::vector<size_t> bounds;
  uint64_t tag = 0;
  bool finished = false;
};

PrefillResult PicEngine::compose(const std::vector<std::vector<int32_t>>& segs, const PicPlan& plan) {
  auto run = start_compose(segs, plan);
  while (true)
    if (auto r = step_compose(*run, std::numeric_limits<int64_t>::max())) return std::move(*r);
}

std::shared_ptr<ComposeRun> PicEngine::start_compose(const std::vector<std::vector<int32_t>>& segs, const PicPlan& plan,
                                                     bool allow_pending) {
  Model& m = model_;
  Backend& be = m.backend();
  const auto& cfg = m.config();
  const PicOptions& opt = plan.opt;
  if (segs.empty() || plan.parts.size() + 1 != segs.size())
    throw std::invalid_argument("compose: a plan of " + std::to_string(plan.parts.size()) +
                                " context segments for a prompt of " + std::to_string(segs.size()) + " segments");
  if (const size_t i = plan.next_missing(); i < plan.parts.size() && !allow_pending)
    throw std::logic_error("compose: segment " + std::to_string(i) + " has no entry yet (PicEngine::build)");
  auto run = std::make_shared<ComposeRun>();
  ComposeRun& c = *run;
  c.opt = opt;
  int64_t total = 0;
  for (auto& s : segs) total += static_cast<int64_t>(s.size());
  PrefillResult& r = c.r;
  r.state = m.new_state(total);
  SequenceState& st = r.state;

  // The longest exact prefix this composition already produced: a snapshot of the composed state
  // after the request's first segments, under the same options. It holds what the segment entries
  // cannot give back: the linear layers' recurrent and conv state, and the K/V rows of the seams
  // (the bodies' K/V are the entries' own, spliced and re-rotated below exactly as composing them
  // would). Starting from it gives the state composing those segments again gives, bit for bit,
  // so only the segments after it are composed. It covers `first` segments.
  const size_t n_ctx = segs.size() - 1;
  for (size_t i = 0; i < n_ctx; ++i) {
    c.ctx.insert(c.ctx.end(), segs[i].begin(), segs[i].end());
    c.bounds.push_back(c.ctx.size());
  }
  c.tag = composed_tag(opt);
  size_t first = 0;
  {
    std::lock_guard<std::mutex> g(prefix_->mu);
    if (const auto* s = prefix_->longest(c.ctx, c.bounds, c.tag)) {
      first = s->bounds.size();
      c.snap = s->state;
    }
  }
  for (int64_t l = 0; first > 0 && l < cfg.num_hidden_layers; ++l)
    if (cfg.layer_types[static_cast<size_t>(l)] == LayerKind::Linear) {
      auto& ls = st.layers[static_cast<size_t>(l)];
      be.copy(c.snap.layers[static_cast<size_t>(l)].ssm, ls.ssm);
      be.copy(c.snap.layers[static_cast<size_t>(l)].conv, ls.conv);
    }

  // The plan's entries, and the rows this request computes: the seams of the segments after the
  // snapshot, then the question.
  int64_t pos = 0;
  for (size_t i = 0; i < n_ctx; ++i) {
    const PicPart& pp = plan.parts[i];
    const auto& ids = segs[i];
    const int64_t L = static_cast<int64_t>(ids.size());
    if (pp.key.ids != ids || pp.pos != pos)
      throw std::invalid_argument("compose: the plan was made for another prompt (segment " + std::to_string(i) + ")");
    const int64_t head = pp.head, tl = pp.tail;
    const bool hit = pp.entry && !pp.built;
    const bool pending = pp.missing();  // allow_pending: built for this request, elsewhere or later
    if (pp.built || pending) {
      ++r.report.miss_segments;
      r.report.computed_tokens += L;  // its isolated prefill
    } else if (hit) {
      ++r.report.hit_segments;
    }
    const bool restored = i < first;
    // Only entries that were already cached count as reused; one built for this request was
    // computed. Seam rows are reused from the snapshot, computed otherwise.
    if (hit) r.report.reused_tokens += L - head - tl;
    ComposeRun::Part part{pp.entry, pos, L, head, tl, restored, {}, pending, pending ? pp.key : SegmentKey{}};
    if (restored) {
      r.report.reused_tokens += head + tl;
      r.report.prefix_tokens += (hit ? L - head - tl : 0) + head + tl;
    } else {
      r.report.computed_tokens += head + tl;
      part.rows.insert(part.rows.end(), ids.begin(), ids.begin() + head);
      part.rows.insert(part.rows.end(), ids.end() - tl, ids.end());
    }
    c.seam_rows += head + tl;
    c.parts.push_back(std::move(part));
    pos += L;
  }
  c.pos = pos;
  c.first = first;
  if (!opt.skip_question) {
    c.question = segs.back();
    r.report.computed_tokens += static_cast<int64_t>(c.question.size());
  }
  c.keep = first < n_ctx;  // kept when this request composes any segment itself
  if (c.keep) {
    c.end.layers.resize(st.layers.size());
    c.end.n_past = pos;
  }
  return run;
}

size_t PicEngine::compose_waits_for(const ComposeRun& c) const {
  for (size_t i = c.next; i < c.parts.size() && !c.finished; ++i)
    if (c.parts[i].pending) return i == c.next || i < c.first ? i : npos;  // restored parts go in one step
  return npos;
}

void PicEngine::supply(ComposeRun& c, size_t part, std::shared_ptr<const SegmentEntry> entry) {
  if (part >= c.parts.size() || !c.parts[part].pending)
    throw std::logic_error("supply: part " + std::to_string(part) + " is not waiting for an entry");
  if (!entry || !(entry->key == c.parts[part].key))
    throw std::logic_error("supply: the entry given for part " + std::to_string(part) + " is another segment's");
  c.parts[part].e = std::move(entry);
  c.parts[part].pending = false;
}

bool PicEngine::supply(ComposeRun& c, const PicPlan& plan) {
  bool left = false;
  for (size_t i = 0; i < c.parts.size(); ++i) {
    if (!c.parts[i].pending) continue;
    if (i < plan.parts.size() && plan.parts[i].entry)
      supply(c, i, plan.parts[i].entry);
    else
      left = true;
  }
  return left;
}

std::optional<PrefillResult> PicEngine::step_compose(ComposeRun& c, int64_t max_rows) {
  if (c.finished) throw std::logic_error("step_compose: the composition is already finished");
  if (const size_t w = compose_waits_for(c); w != npos)
    throw std::logic_error("step_compose: part " + std::to_string(w) + " has no entry yet (supply)");
  Model& m = model_;
  Backend& be = m.backend();
  const auto& cfg = m.config();
  const PicOptions& opt = c.opt;
  const bool naive = opt.mode == PicMode::Naive;
  const int rot = static_cast<int>(cfg.rotary_dim());
  SequenceState& st = c.r.state;
  const size_t n_ctx = c.parts.size();

  // This step's parts: the next ones while their seam rows fit max_rows (at least one part with
  // rows; parts without rows, like those the snapshot covers, cost nothing here). The question
  // comes with the last parts if it fits beside them, else in a step of its own. Going through every
  // layer a group of parts at a time is the same computation as all at once (a row depends only
  // on the rows before it), so a server can interleave other work between the steps.
  const size_t p0 = c.next;
  size_t p1 = p0;
  int64_t n_rows = 0;
  for (; p1 < n_ctx && !c.parts[p1].pending; ++p1) {
    const int64_t k = static_cast<int64_t>(c.parts[p1].rows.size());
    if (k > 0 && n_rows > 0 && n_rows + k > max_rows) break;
    n_rows += k;
  }
  const int64_t Q = static_cast<int64_t>(c.question.size());
  const bool with_q = !opt.skip_question;
  const bool finish = p1 == n_ctx && (!with_q || n_rows == 0 || n_rows + Q <= max_rows);
  std::vector<int32_t> rows;
  for (size_t i = p0; i < p1; ++i) rows.insert(rows.end(), c.parts[i].rows.begin(), c.parts[i].rows.end());
  if (finish && with_q) rows.insert(rows.end(), c.question.begin(), c.question.end());
  const bool q_here = finish && with_q;

  // One pass over the layers; in each layer the token mixers walk the segments in order, and each
  // segment's cached body is composed in right after its seam (LayerSpan::after), all rows in one
  // call per layer. A reused exact prefix must continue bit for bit as composing it again, so a
  // row's numbers may not depend on the rows computed with it: the CPU's products run
  // row-independent meanwhile (an OpenBLAS GEMM picks kernels and blocking by M). A backend without
  // that mode on the CPU would run each segment's seam rows, and the question, as calls of their
  // own; the GPU runs one call (a launch per op and group would cost more than the rows), and
  // there a reused prefix matches composing again to rounding.
  struct RowIndependent {
    Backend& be;
    bool on;
    RowIndependent(Backend& b, bool want) : be(b), on(want && b.set_row_independent(true)) {}
    ~RowIndependent() {
      if (on) be.set_row_independent(false);
    }
  } row_independent(be, n_ctx > 0);  // without context segments there is no prefix to continue
  const bool per_segment = be.name() == "cpu" && !row_independent.on;
  Tensor x;
  if (!rows.empty()) x = m.embed(rows);
  std::vector<LayerSpan> spans;
  std::vector<std::pair<size_t, int64_t>> groups;  // (end of the group's spans, its rows)
  const bool keep_here = c.keep && finish;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    LayerState& ls = st.layers[static_cast<size_t>(l)];
    const bool linear = cfg.layer_types[static_cast<size_t>(l)] == LayerKind::Linear;
    const bool stateless = cfg.layer_types[static_cast<size_t>(l)] == LayerKind::Ffn;  // rows only
    spans.clear();
    groups.clear();
    std::deque<Tensor> naive_states;       // naive mode: compact bodies' zero-start states
    std::vector<Backend::RowCopy> splice;  // full layers: the bodies' and the snapshot's K/V rows
    int64_t snap_row = 0;                  // next seam row of the snapshot (full layers)
    for (size_t i = p0; i < p1; ++i) {
      const ComposeRun::Part& p = c.parts[i];
      static const LayerSummary kNoBody;
      const LayerSummary& sum = p.e ? p.e->layers[static_cast<size_t>(l)] : kNoBody;
      if (p.e) p.e->wait_layer(be, static_cast<size_t>(l));  // promoted from the host tier: its copies
      SpanAfter after;
      if (linear) {
        if (p.restored) continue;  // its effect is in the restored state
        // Seam tokens have advanced the running state from the prefix state (conv warmed by the
        // previous segment's tail); now S <- T_body S + S_body and the conv tail moves on. Without
        // a cached body the running conv state already holds the true inputs before the tail.
        if (p.head + p.tail < p.len) {
          if (sum.body.defined() && naive) {
            // naive adds the zero-start state, which the compact form gives by running from zero.
            Tensor& zs = naive_states.emplace_back(be.alloc(DType::F32, ls.ssm.shape()));
            m.replay(sum.body, zs);
            after.B = &zs;
          } else if (sum.body.defined()) {
            after.replay = &sum.body;
          } else {
            after.T = naive ? nullptr : &sum.T;  // f32 or bf16: the backends read either
            after.B = &sum.S;
          }
          after.conv = &sum.conv_tail;
        }
      } else if (stateless) {
        if (p.restored) continue;  // no rows to compute, no state to restore
      } else {
        if (p.head + p.tail < p.len) {
          // Splice the body's K/V; keys were stored at relative positions and RoPE angles add, so
          // rotating them by the segment's start is exact (only the rotary dims change).
          const int64_t b0 = p.head, b1 = p.len - p.tail;
          const bool rerotate = !naive && opt.rerotate && p.pos > 0 && rot > 0;  // NoPE keys: nothing to rotate
          splice.push_back({&sum.k, b0, &ls.k, p.pos + b0, b1 - b0, rerotate ? p.pos : 0});
          splice.push_back({&sum.v, b0, &ls.v, p.pos + b0, b1 - b0, 0});
        }
        if (p.restored) {
          // The seam rows as the composition that made the snapshot computed them (the restored
          // parts all come in the first step).
          const auto& sl = c.snap.layers[static_cast<size_t>(l)];
          for (auto [a, n] : {std::pair<int64_t, int64_t>{p.pos, p.head}, {p.pos + p.len - p.tail, p.tail}}) {
            if (n == 0) continue;
            splice.push_back({&sl.k, snap_row, &ls.k, a, n});
            splice.push_back({&sl.v, snap_row, &ls.v, a, n});
            snap_row += n;
          }
          continue;
        }
      }
      spans.push_back(LayerSpan{&ls, p.pos, p.head, nullptr, after});
      // Both-ends seam: the segment's last tokens are recomputed too, after its body.
      if (p.tail > 0) spans.push_back(LayerSpan{&ls, p.pos + p.len - p.tail, p.tail, nullptr, {}});
      groups.emplace_back(spans.size(), p.head + p.tail);
    }
    be.copy_rows(splice, rot, cfg.rope_theta);  // one call for every segment of the layer
    if (keep_here && linear) {
      SpanAfter snap_after;
      snap_after.keep = &c.end.layers[static_cast<size_t>(l)];
      spans.push_back(LayerSpan{&ls, c.pos, 0, nullptr, snap_after});
      groups.emplace_back(spans.size(), 0);
    }
    if (q_here) {
      spans.push_back(LayerSpan{&ls, c.pos, Q, nullptr, {}});
      groups.emplace_back(spans.size(), Q);
    }
    if (!per_segment && x.defined()) {
      // One call for every row (each span's `after` applied in order), the question's included:
      // on AVX-512 row-independent products run at the usual products' rate (docs/perf-notes.md),
      // and one call per layer reads the weights once. The question stays row-independent when
      // it comes alone in a last step too: composing in steps must give one call's logits, bit
      // for bit (Pic.ComposeInStepsEqualsOneCall).
      groups.assign(1, {spans.size(), x.dim(0)});
    }
    size_t s0 = 0;
    int64_t r0 = 0;
    for (const auto& [s1, n] : groups) {
      if (n == 0) {
        for (size_t i = s0; i < s1; ++i)
          if (spans[i].after.any()) m.apply_after(*spans[i].state, spans[i].after);
      } else {
        Tensor xg = x.slice_rows(r0, r0 + n);
        m.layer_forward(l, xg, std::span<const LayerSpan>(spans.data() + s0, s1 - s0));
      }
      s0 = s1;
      r0 += n;
    }
    if (keep_here && !linear && !stateless && c.seam_rows > 0) {
      // Every context segment's seam rows, in order (the K/V rows no entry holds).
      LayerState& e = c.end.layers[static_cast<size_t>(l)];
      e.k = be.alloc(DType::F32, {c.seam_rows, ls.k.dim(1), ls.k.dim(2)});
      e.v = be.alloc(DType::F32, {c.seam_rows, ls.v.dim(1), ls.v.dim(2)});
      int64_t o = 0;
      std::vector<Backend::RowCopy> seams;
      for (const auto& p : c.parts)
        for (auto [a, n] : {std::pair<int64_t, int64_t>{p.pos, p.head}, {p.pos + p.len - p.tail, p.tail}}) {
          if (n == 0) continue;
          seams.push_back({&ls.k, a, &e.k, o, n});
          seams.push_back({&ls.v, a, &e.v, o, n});
          o += n;
        }
      be.copy_rows(seams);
    }
  }
  c.next = p1;
  if (!finish) return std::nullopt;
  c.finished = true;
  st.n_past = c.pos + (with_q ? Q : 0);
  if (q_here) c.r.logits = m.logits(x.slice_rows(x.dim(0) - 1, x.dim(0)));
  if (c.keep) {
    std::lock_guard<std::mutex> g(prefix_->mu);
    prefix_->put(std::move(c.ctx), std::move(c.end), c.tag, std::move(c.bounds));
  }
  c.parts.clear();  // unpins the entries
  return std::move(c.r);
}

}  // namespace hypic
