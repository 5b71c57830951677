#include "pic/composer.h"

#include <xxhash.h>

#include <algorithm>
#include <functional>
#include <list>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

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
struct PicEngine::PrefixCache {
  struct Snap {
    std::vector<int32_t> ids;
    SequenceState state;
    size_t bytes;
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
  // Longest cached prefix of `ids` that ends at one of `boundaries`; returns its length or 0.
  const Snap* longest(const std::vector<int32_t>& ids, const std::vector<size_t>& boundaries) {
    const Snap* best = nullptr;
    for (auto it = lru.begin(); it != lru.end(); ++it) {
      const size_t n = it->ids.size();
      if (n > ids.size() || (best && n <= best->ids.size())) continue;
      if (std::find(boundaries.begin(), boundaries.end(), n) == boundaries.end()) continue;
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
  void put(std::vector<int32_t> ids, SequenceState st) {
    const size_t b = state_bytes(st);
    if (b > budget) return;
    for (auto it = lru.begin(); it != lru.end(); ++it)
      if (it->ids == ids) {
        lru.splice(lru.begin(), lru, it);
        return;
      }
    while (bytes + b > budget && !lru.empty()) {
      bytes -= lru.back().bytes;
      lru.pop_back();
    }
    lru.push_front(Snap{std::move(ids), std::move(st), b});
    bytes += b;
  }
};

PicEngine::PicEngine(Model& model, size_t segment_cache_bytes, size_t prefix_cache_bytes)
    : model_(model), cache_(segment_cache_bytes), prefix_(std::make_unique<PrefixCache>()) {
  prefix_->budget = prefix_cache_bytes ? prefix_cache_bytes : segment_cache_bytes;
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

std::shared_ptr<SegmentEntry> PicEngine::build_entry(const std::vector<int32_t>& ids, int seam, int tail) {
  Model& m = model_;
  Backend& be = m.backend();
  const auto& cfg = m.config();
  const int64_t L = static_cast<int64_t>(ids.size());
  if (L == 0) throw std::invalid_argument("cannot cache an empty segment");
  const int64_t head = std::clamp<int64_t>(seam, 0, L);
  const int64_t tl = std::clamp<int64_t>(tail, 0, L - head);
  const int64_t body_end = L - tl;
  auto e = std::make_shared<SegmentEntry>();
  e->key = SegmentKey{m.fingerprint(), seam, tail, ids};
  e->layers.resize(static_cast<size_t>(cfg.num_hidden_layers));
  SequenceState st = m.new_state(L);  // zero state at position 0: the segment in isolation
  Tensor x = m.embed(ids);
  // One pass per layer over the whole segment as three spans on one state: head | body | tail.
  // Hooks between the spans snapshot what the cache keeps: the state after the head, then the
  // body's transition (chained by the kernel in the same pass), its zero-start state
  // S_body = S_end - T_body S_head (linearity), and the conv state at the end of the body.
  Tensor s_head;
  std::function<void()> after_head, after_body;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    auto& ls = st.layers[static_cast<size_t>(l)];
    auto& out = e->layers[static_cast<size_t>(l)];
    if (cfg.layer_types[static_cast<size_t>(l)] == LayerKind::Linear) {
      const auto& sh = ls.ssm.shape();  // [Hv, dk, dv]
      out.T = be.alloc(DType::F32, {sh[0], sh[1], sh[1]});
      out.S = be.alloc(DType::F32, sh);
      s_head = be.alloc(DType::F32, sh);
      after_head = [&] { be.copy(ls.ssm, s_head); };
      after_body = [&] {
        if (head < body_end)
          be.compose_state(out.T, s_head, ls.ssm, -1.f, out.S);
        else
          be.set_identity(out.T);  // empty body: T = I, S = 0
        out.conv_tail = be.alloc(DType::F32, ls.conv.shape());
        be.copy(ls.conv, out.conv_tail);
      };
      const LayerSpan spans[3] = {{&ls, 0, head, nullptr, &after_head},
                                  {&ls, head, body_end - head, &out.T, &after_body},
                                  {&ls, body_end, tl, nullptr, nullptr}};
      m.layer_forward(l, x, spans);
    } else {
      m.layer_forward(l, x, ls, 0);
      const auto& ks = ls.k.shape();
      out.k = be.alloc(DType::F32, {L, ks[1], ks[2]});
      out.v = be.alloc(DType::F32, {L, ks[1], ls.v.dim(2)});
      be.copy(ls.k.slice_rows(0, L), out.k);
      be.copy(ls.v.slice_rows(0, L), out.v);
    }
  }
  e->account();
  return e;
}

void PicEngine::attach_store(std::shared_ptr<SegmentStore> store) {
  // Expected summary shapes, taken from a one-token state of this model.
  const auto& cfg = model_.config();
  SequenceState st = model_.new_state(1);
  expect_.clear();
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const auto& ls = st.layers[static_cast<size_t>(l)];
    if (cfg.layer_types[static_cast<size_t>(l)] == LayerKind::Linear) {
      const auto& sh = ls.ssm.shape();  // [Hv, dk, dv]
      expect_.push_back({sh[0], sh[1], sh[1]});
      expect_.push_back(sh);
      expect_.push_back(ls.conv.shape());
    } else {
      expect_.push_back({ls.k.dim(1), ls.k.dim(2)});
      expect_.push_back({ls.v.dim(1), ls.v.dim(2)});
    }
  }
  cache_.attach_store(std::move(store));
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
    auto want = [&](const Tensor& t, const char* name, const Shape& shape) -> std::string {
      if (!t.defined()) return at + name + " missing";
      if (t.dtype() != DType::F32 || t.shape() != shape)
        return at + name + " is " + t.str() + ", expected f32" + shape_str(shape);
      return "";
    };
    std::string why;
    if (cfg.layer_types[static_cast<size_t>(l)] == LayerKind::Linear) {
      if (why.empty()) why = want(s.T, "T", expect_[x]);
      if (why.empty()) why = want(s.S, "S", expect_[x + 1]);
      if (why.empty()) why = want(s.conv_tail, "conv_tail", expect_[x + 2]);
      if (why.empty() && (s.k.defined() || s.v.defined())) why = at + "unexpected k/v in a linear layer";
      x += 3;
    } else {
      if (why.empty()) why = want(s.k, "k", {L, expect_[x][0], expect_[x][1]});
      if (why.empty()) why = want(s.v, "v", {L, expect_[x + 1][0], expect_[x + 1][1]});
      if (why.empty() && (s.T.defined() || s.S.defined() || s.conv_tail.defined()))
        why = at + "unexpected linear state in a full-attention layer";
      x += 2;
    }
    if (!why.empty()) return why;
  }
  return "";
}

std::shared_ptr<const SegmentEntry> PicEngine::get_or_build(const std::vector<int32_t>& ids, int seam, int tail,
                                                            CacheReport& rep) {
  SegmentKey key{model_.fingerprint(), seam, tail, ids};
  if (auto hit = cache_.store() ? cache_.find_or_load(key, [this](const SegmentEntry& e) { return check_entry(e); })
                                : cache_.find(key)) {
    ++rep.hit_segments;
    return hit;
  }
  ++rep.miss_segments;
  rep.computed_tokens += static_cast<int64_t>(ids.size());  // the isolated prefill
  return cache_.insert(build_entry(ids, seam, tail));
}

PrefillResult PicEngine::prefill(const std::vector<std::vector<int32_t>>& segs, const PicOptions& opt) {
  check_segments(model_, segs);
  if (opt.seam < 0) throw std::invalid_argument("seam must be >= 0, got " + std::to_string(opt.seam));
  if (opt.tail_seam < 0) throw std::invalid_argument("tail seam must be >= 0, got " + std::to_string(opt.tail_seam));
  switch (opt.mode) {
    case PicMode::Full:
      return prefill_full(segs, opt.skip_question);
    case PicMode::Prefix:
      return prefill_prefix(segs, opt.skip_question);
    case PicMode::Pic:
    case PicMode::Naive:
      return prefill_composed(segs, opt);
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

PrefillResult PicEngine::prefill_prefix(const std::vector<std::vector<int32_t>>& segs, bool skip_question) {
  std::vector<int32_t> all;
  std::vector<size_t> bounds;  // segment ends before the question
  for (size_t i = 0; i < segs.size(); ++i) {
    all.insert(all.end(), segs[i].begin(), segs[i].end());
    if (i + 1 < segs.size()) bounds.push_back(all.size());
  }
  PrefillResult r;
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
  for (size_t b : bounds) r.report.hit_segments += b <= done ? 1 : 0;
  // Recompute the rest segment by segment, snapshotting each new boundary.
  size_t pos = 0;
  for (size_t i = 0; i + (skip_question ? 1 : 0) < segs.size(); ++i) {
    const size_t end = pos + segs[i].size();
    if (end > done) {
      const size_t from = std::max(pos, done);
      std::span<const int32_t> span(all.data() + from, end - from);
      r.logits = model_.forward(span, r.state);
      r.report.computed_tokens += static_cast<int64_t>(span.size());
      if (i + 1 < segs.size()) {
        ++r.report.miss_segments;
        std::lock_guard<std::mutex> g(prefix_->mu);
        prefix_->put(std::vector<int32_t>(all.begin(), all.begin() + static_cast<long>(end)),
                     snapshot(model_, r.state));
      }
    }
    pos = end;
  }
  return r;
}

PrefillResult PicEngine::prefill_composed(const std::vector<std::vector<int32_t>>& segs, const PicOptions& opt) {
  Model& m = model_;
  Backend& be = m.backend();
  const auto& cfg = m.config();
  const bool naive = opt.mode == PicMode::Naive;
  int64_t total = 0;
  for (auto& s : segs) total += static_cast<int64_t>(s.size());
  PrefillResult r;
  r.state = m.new_state(total);
  SequenceState& st = r.state;
  const int rot = static_cast<int>(cfg.rotary_dim());

  // Entries for every context segment (built in isolation when missing), and the rows this
  // request computes: the seams of all segments, then the question.
  struct Part {
    std::shared_ptr<const SegmentEntry> e;
    int64_t pos, len, head, tail;  // cached body: [head, len - tail)
  };
  std::vector<Part> parts;
  std::vector<int32_t> rows;
  int64_t pos = 0;
  for (size_t i = 0; i + 1 < segs.size(); ++i) {
    const auto& ids = segs[i];
    const int64_t L = static_cast<int64_t>(ids.size());
    // The first segment sits at its true position 0: reused whole, no seam needed.
    const int seam = (i == 0 || naive) ? 0 : opt.seam;
    const int tail = (i == 0 || naive) ? 0 : opt.tail_seam;
    const int hits_before = r.report.hit_segments;
    auto e = get_or_build(ids, seam, tail, r.report);
    const int64_t head = std::min<int64_t>(seam, L);
    const int64_t tl = std::min<int64_t>(tail, L - head);
    // Only entries that were already cached count as reused; one built for this request was computed.
    if (r.report.hit_segments > hits_before) r.report.reused_tokens += L - head - tl;
    r.report.computed_tokens += head + tl;
    rows.insert(rows.end(), ids.begin(), ids.begin() + head);
    rows.insert(rows.end(), ids.end() - tl, ids.end());
    parts.push_back({std::move(e), pos, L, head, tl});
    pos += L;
  }
  const bool with_q = !opt.skip_question;
  const int64_t Q = static_cast<int64_t>(segs.back().size());
  if (with_q) {
    rows.insert(rows.end(), segs.back().begin(), segs.back().end());
    r.report.computed_tokens += Q;
  }

  // One pass over the layers for all of those rows: projections and MLPs run once per layer over
  // every seam and the question together; the token mixers walk the segments in order, and
  // each segment's cached body is composed in right after its seam (LayerSpan::after).
  Tensor x;
  if (!rows.empty()) x = m.embed(rows);
  std::vector<std::function<void()>> hooks(parts.size());
  std::vector<LayerSpan> spans;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    LayerState& ls = st.layers[static_cast<size_t>(l)];
    const bool linear = cfg.layer_types[static_cast<size_t>(l)] == LayerKind::Linear;
    spans.clear();
    for (size_t i = 0; i < parts.size(); ++i) {
      const Part& p = parts[i];
      const LayerSummary& sum = p.e->layers[static_cast<size_t>(l)];
      if (linear) {
        // Seam tokens have advanced the running state from the prefix state (conv warmed by the
        // previous segment's tail); now S <- T_body S + S_body and the conv tail moves on.
        hooks[i] = [&be, &ls, &sum, &p, naive] {
          // No cached body: the running conv state already holds the true inputs before the tail.
          if (p.head + p.tail >= p.len) return;
          if (naive) {
            be.add(ls.ssm, sum.S, ls.ssm);
          } else {
            Tensor next = be.alloc(DType::F32, ls.ssm.shape());
            be.compose_state(sum.T, ls.ssm, sum.S, 1.f, next);
            ls.ssm = next;
          }
          be.copy(sum.conv_tail, ls.conv);
        };
      } else if (p.head + p.tail < p.len) {
        // Splice the body's K/V; keys were stored at relative positions and RoPE angles add, so
        // rotating them by the segment's start is exact (only the rotary dims change).
        const int64_t b0 = p.head, b1 = p.len - p.tail;
        Tensor kd = ls.k.slice_rows(p.pos + b0, p.pos + b1), vd = ls.v.slice_rows(p.pos + b0, p.pos + b1);
        be.copy(sum.k.slice_rows(b0, b1), kd);
        be.copy(sum.v.slice_rows(b0, b1), vd);
        if (!naive && opt.rerotate && p.pos > 0) {
          std::vector<int64_t> shift(static_cast<size_t>(b1 - b0), p.pos);
          be.rope_neox(kd, shift, rot, cfg.rope_theta);
        }
      }
      spans.push_back(LayerSpan{&ls, p.pos, p.head, nullptr, linear ? &hooks[i] : nullptr});
      // Both-ends seam: the segment's last tokens are recomputed too, after its body.
      if (p.tail > 0) spans.push_back(LayerSpan{&ls, p.pos + p.len - p.tail, p.tail, nullptr, nullptr});
    }
    if (with_q) spans.push_back(LayerSpan{&ls, pos, Q, nullptr, nullptr});
    if (x.defined()) {
      m.layer_forward(l, x, spans);
    } else {
      for (auto& sp : spans)
        if (sp.after) (*sp.after)();
    }
  }
  st.n_past = pos + (with_q ? Q : 0);
  if (with_q) r.logits = m.logits(x.slice_rows(x.dim(0) - 1, x.dim(0)));
  return r;
}

}  // namespace hypic
