// Exactness properties of the PIC composer on the conformance checkpoints.
#include "pic/composer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>

#include "backend/cpu/cpu_backend.h"
#include "engine/generate.h"
#include "engine/loader.h"
#include "engine/sampler.h"

namespace fs = std::filesystem;
using namespace hypic;

namespace {

std::vector<int32_t> rand_ids(size_t n, int64_t vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> d(0, vocab - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = static_cast<int32_t>(d(rng));
  return v;
}

std::vector<float> host_logprobs(Backend& be, const Tensor& logits) {
  Tensor h = be.to_host(logits);
  return log_softmax(std::span<const float>(h.data<float>(), static_cast<size_t>(h.numel())));
}

double max_abs(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0;
  for (size_t i = 0; i < a.size(); ++i) e = std::max(e, std::abs(double(a[i]) - b[i]));
  return e;
}

double rel_l2(Backend& be, const Tensor& a, const Tensor& b) {
  Tensor x = be.to_host(a), y = be.to_host(b);
  double num = 0, den = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    double d = double(x.data<float>()[i]) - y.data<float>()[i];
    num += d * d;
    den += double(y.data<float>()[i]) * y.data<float>()[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

class Pic : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    lm_ = std::make_unique<LoadedModel>(
        load_model((fs::path(HYPIC_TEST_DATA) / "models" / GetParam()).string(), "cpu", 2));
    std::mt19937_64 rng(1234);
    const int64_t V = lm_->model->config().vocab_size;
    segs_ = {rand_ids(20, V, rng), rand_ids(70, V, rng), rand_ids(41, V, rng), rand_ids(90, V, rng),
             rand_ids(12, V, rng)};
  }
  std::vector<float> run(PicEngine& eng, const std::vector<std::vector<int32_t>>& s, PicOptions o,
                         SequenceState* keep = nullptr, CacheReport* rep = nullptr) {
    PrefillResult r = eng.prefill(s, o);
    if (rep) *rep = r.report;
    auto lp = host_logprobs(*lm_->backend, r.logits);
    if (keep) *keep = std::move(r.state);
    return lp;
  }
  std::unique_ptr<LoadedModel> lm_;
  std::vector<std::vector<int32_t>> segs_;
};

TEST_P(Pic, OneSegmentEqualsFull) {
  PicEngine eng(*lm_->model, 64 << 20);
  std::vector<std::vector<int32_t>> one = {segs_[1]};
  auto full = run(eng, one, {PicMode::Full});
  auto pic = run(eng, one, {PicMode::Pic});
  EXPECT_LE(max_abs(full, pic), 1e-6);
}

TEST_P(Pic, SeamCoveringEverySegmentEqualsFull) {
  PicEngine eng(*lm_->model, 64 << 20);
  auto full = run(eng, segs_, {PicMode::Full});
  auto pic = run(eng, segs_, {PicMode::Pic, 1000});
  // The same tokens through the same layers, but pic's context products run row-independent (the
  // few-row kernel, another summation order than full's GEMM): f32 rounding, nothing more.
  EXPECT_LE(max_abs(full, pic), 5e-4);
}

TEST_P(Pic, PrefixModeIsExact) {
  PicEngine eng(*lm_->model, 64 << 20);
  auto full = run(eng, segs_, {PicMode::Full});
  CacheReport cold, warm;
  auto p1 = run(eng, segs_, {PicMode::Prefix}, nullptr, &cold);
  auto p2 = run(eng, segs_, {PicMode::Prefix}, nullptr, &warm);
  // Exact up to f32 rounding: the same rows in other chunks (segment by segment) sum in another
  // order. The MoE model's router amplifies it most (1.5e-4 with libm's expf in the activations,
  // 3.5e-4 with the AVX2 lanes' exp; the dense models stay below 5e-5).
  EXPECT_LE(max_abs(full, p1), 5e-4);
  EXPECT_LE(max_abs(full, p2), 5e-4);
  EXPECT_EQ(cold.reused_tokens, 0);
  EXPECT_EQ(warm.reused_tokens, 20 + 70 + 41 + 90);  // everything but the question
}

TEST_P(Pic, LayerZeroComposedStateMatchesFull) {
  PicEngine eng(*lm_->model, 64 << 20);
  SequenceState sf, sp;
  run(eng, segs_, {PicMode::Full}, &sf);
  run(eng, segs_, {PicMode::Pic, 8}, &sp);
  const auto& types = lm_->model->config().layer_types;
  size_t first_linear = std::find(types.begin(), types.end(), LayerKind::Linear) - types.begin();
  ASSERT_LT(first_linear, types.size());
  ASSERT_EQ(first_linear, 0u);
  EXPECT_LE(rel_l2(*lm_->backend, sp.layers[0].ssm, sf.layers[0].ssm), 1e-5);
  EXPECT_LE(rel_l2(*lm_->backend, sp.layers[0].conv, sf.layers[0].conv), 1e-6);
}

TEST_P(Pic, AnswersDoNotDependOnCacheHistory) {
  PicEngine cold(*lm_->model, 64 << 20), warm(*lm_->model, 64 << 20);
  // Warm the second engine with the documents in another order and another prefix.
  auto shuffled = segs_;
  std::swap(shuffled[1], shuffled[3]);
  shuffled[0][0] = (shuffled[0][0] + 1) % 7;
  run(warm, shuffled, {PicMode::Pic});
  CacheReport rc, rw;
  auto a = run(cold, segs_, {PicMode::Pic}, nullptr, &rc);
  auto b = run(warm, segs_, {PicMode::Pic}, nullptr, &rw);
  EXPECT_EQ(a, b);  // bitwise: hits are used exactly as fresh entries
  EXPECT_EQ(rc.miss_segments, 4);
  EXPECT_EQ(rw.hit_segments, 3);
  EXPECT_EQ(rw.miss_segments, 1);
  EXPECT_EQ(rc.reused_tokens, 0);                               // cold: everything computed
  EXPECT_EQ(rw.reused_tokens, (70 - 8) + (41 - 8) + (90 - 8));  // the new prefix was built, not reused
  EXPECT_EQ(rw.computed_tokens, 20 + 8 * 3 + 12);               // new prefix prefilled + seams + question
}

// pic takes the longest exact prefix from its snapshots (issue 19): the next turn of a
// conversation and an exact repeat start from the state the earlier composition left, compose
// only the segments after it, and answer exactly (bitwise) as an engine that composes it all.
TEST_P(Pic, ExactPrefixReuseEqualsComposingAgain) {
  std::mt19937_64 rng(99);
  const int64_t V = lm_->model->config().vocab_size;
  const auto q2 = rand_ids(9, V, rng);
  const std::vector<std::vector<int32_t>> turn1 = {segs_[0], segs_[1], segs_[2], segs_[4]};
  const std::vector<std::vector<int32_t>> turn2 = {segs_[0], segs_[1], segs_[2], segs_[3], q2};
  auto answer = [&](PicEngine& eng, const std::vector<std::vector<int32_t>>& s, PicOptions o, CacheReport& rep) {
    PrefillResult r = eng.prefill(s, o);
    rep = r.report;
    GenerateRequest req;
    req.max_tokens = 12;
    GenerateResult g = decode_from(*lm_->model, nullptr, req, r.state, r.logits);
    return std::make_pair(host_logprobs(*lm_->backend, r.logits), g.ids);
  };
  for (const PicOptions o : {PicOptions{PicMode::Pic, 8}, PicOptions{.mode = PicMode::Pic, .seam = 4, .tail_seam = 3},
                             PicOptions{PicMode::Naive, 0}}) {
    SCOPED_TRACE(std::string(pic_mode_name(o.mode)) + " seam " + std::to_string(o.seam));
    PicEngine warm(*lm_->model, 64 << 20), cold(*lm_->model, 64 << 20);
    CacheReport r1, r2, rc, rr;
    answer(warm, turn1, o, r1);
    EXPECT_EQ(r1.prefix_tokens, 0);
    const auto w = answer(warm, turn2, o, r2);
    const auto c = answer(cold, turn2, o, rc);
    EXPECT_EQ(w.first, c.first);  // bitwise
    EXPECT_EQ(w.second, c.second);
    // The first three segments came from the snapshot; only segs_[3] and the question were new.
    const int64_t ctx3 = 20 + 70 + 41;
    EXPECT_EQ(r2.prefix_tokens, ctx3);
    EXPECT_EQ(rc.prefix_tokens, 0);
    EXPECT_EQ(r2.hit_segments, 3);
    EXPECT_EQ(r2.miss_segments, 1);
    EXPECT_EQ(r2.reused_tokens, ctx3);
    const int64_t seam = o.mode == PicMode::Naive ? 0 : o.seam + o.tail_seam;
    EXPECT_EQ(r2.computed_tokens, 90 + seam + 9);  // segs_[3] built in isolation, its seams, the question
    EXPECT_LT(r2.computed_tokens, rc.computed_tokens);
    // An exact repeat reuses the whole context and computes only the question.
    const auto rep = answer(warm, turn2, o, rr);
    EXPECT_EQ(rep.first, c.first);
    EXPECT_EQ(rep.second, c.second);
    EXPECT_EQ(rr.prefix_tokens, ctx3 + 90);
    EXPECT_EQ(rr.reused_tokens, ctx3 + 90);
    EXPECT_EQ(rr.computed_tokens, 9);
    EXPECT_EQ(rr.hit_segments, 4);
    EXPECT_EQ(warm.cached_prefix_segments(turn2, o), 4u);
    // Entries evicted, snapshot kept: the bodies are rebuilt (bit for bit) and the answer is the same.
    warm.cache().clear();
    CacheReport re;
    const auto rebuilt = answer(warm, turn2, o, re);
    EXPECT_EQ(rebuilt.first, c.first);
    EXPECT_EQ(re.miss_segments, 4);
    EXPECT_EQ(re.prefix_tokens, 3 * seam);  // only the seam rows came from the snapshot
    EXPECT_EQ(re.computed_tokens, ctx3 + 90 + 9);
  }
  // Snapshots fit only the options and the segmentation they were composed under.
  PicEngine eng(*lm_->model, 64 << 20);
  CacheReport rep;
  answer(eng, turn2, {PicMode::Pic, 8}, rep);
  EXPECT_EQ(eng.cached_prefix_segments(turn2, {PicMode::Pic, 8}), 4u);
  EXPECT_EQ(eng.cached_prefix_segments(turn2, {PicMode::Pic, 4}), 0u);
  EXPECT_EQ(eng.cached_prefix_segments(turn2, {PicMode::Prefix}), 0u);
  answer(eng, turn2, {PicMode::Pic, 4}, rep);
  EXPECT_EQ(rep.prefix_tokens, 0);
  std::vector<int32_t> merged = segs_[1];
  merged.insert(merged.end(), segs_[2].begin(), segs_[2].end());
  const std::vector<std::vector<int32_t>> resplit = {segs_[0], merged, segs_[3], q2};
  EXPECT_EQ(eng.cached_prefix_segments(resplit, {PicMode::Pic, 8}), 0u);
  answer(eng, resplit, {PicMode::Pic, 8}, rep);
  EXPECT_EQ(rep.prefix_tokens, 0);
}

TEST_P(Pic, NaiveAdditionIsMeasurablyWrongAndPicIsCloser) {
  PicEngine eng(*lm_->model, 64 << 20);
  auto full = run(eng, segs_, {PicMode::Full});
  auto pic = run(eng, segs_, {PicMode::Pic, 8});
  auto naive = run(eng, segs_, {PicMode::Naive});
  const double e_naive = max_abs(full, naive), e_pic = max_abs(full, pic);
  EXPECT_GT(e_naive, 0.05);
  EXPECT_LT(e_pic, e_naive);
}

// Both-ends seams: the last tokens of each reused segment are recomputed too.
TEST_P(Pic, BothEndsSeamsKeepExactnessProperties) {
  PicEngine eng(*lm_->model, 64 << 20);
  SequenceState sf, sp;
  auto full = run(eng, segs_, {PicMode::Full}, &sf);
  PicOptions covering{PicMode::Pic, 30};
  covering.tail_seam = 70;                                    // head + tail cover every segment: everything recomputed
  EXPECT_LE(max_abs(full, run(eng, segs_, covering)), 5e-4);  // rounding, as SeamCoveringEverySegment
  PicOptions both{PicMode::Pic, 8};
  both.tail_seam = 8;
  CacheReport cold, repeat, warm;
  auto a = run(eng, segs_, both, &sp, &cold);
  auto b = run(eng, segs_, both, nullptr, &repeat);
  EXPECT_EQ(a, b);
  EXPECT_LE(rel_l2(*lm_->backend, sp.layers[0].ssm, sf.layers[0].ssm), 1e-5);  // exact at layer 0
  EXPECT_LE(rel_l2(*lm_->backend, sp.layers[0].conv, sf.layers[0].conv), 1e-6);
  // An exact repeat starts from the composed context's snapshot.
  EXPECT_EQ(repeat.reused_tokens, 20 + 70 + 41 + 90);
  EXPECT_EQ(repeat.computed_tokens, 12);
  // Documents in another order: no snapshot fits, every segment is a hit, composed as if fresh.
  auto swapped = segs_;
  std::swap(swapped[1], swapped[2]);
  auto c = run(eng, swapped, both, nullptr, &warm);
  PicEngine fresh_swapped(*lm_->model, 64 << 20);
  EXPECT_EQ(c, run(fresh_swapped, swapped, both));
  EXPECT_EQ(warm.prefix_tokens, 0);
  EXPECT_EQ(warm.hit_segments, 4);
  EXPECT_EQ(warm.reused_tokens, 20 + (70 - 16) + (41 - 16) + (90 - 16));
  EXPECT_EQ(warm.computed_tokens, 16 * 3 + 12);
  // Tail seams must not change what a head-only request computes.
  auto head_only = run(eng, segs_, {PicMode::Pic, 8});
  PicEngine fresh(*lm_->model, 64 << 20);
  EXPECT_EQ(head_only, run(fresh, segs_, {PicMode::Pic, 8}));
}

// The request plan in steps (what the server does: plan, one build per iteration, compose) gives
// the one-call prefill's answer and report. A segment no longer than its seam is recomputed whole
// in context: it gets no entry, no isolated prefill and no cache memory, and the warm answer is
// still the cold one.
TEST_P(Pic, PlanInStepsEqualsOneCallAndShortSegmentsHaveNoEntry) {
  const std::vector<int32_t> shorty(segs_[2].begin(), segs_[2].begin() + 5);
  const std::vector<std::vector<int32_t>> s = {segs_[0], shorty, segs_[1], segs_[4]};
  const PicOptions o{PicMode::Pic, 8};
  PicEngine a(*lm_->model, 64 << 20), b(*lm_->model, 64 << 20);
  CacheReport ra, rb;
  auto cold = run(a, s, o, nullptr, &ra);
  EXPECT_EQ(ra.miss_segments, 2);
  EXPECT_EQ(ra.hit_segments, 0);
  EXPECT_EQ(a.cache().stats().inserts, 2u) << "no entry for the 5-token segment under an 8-token seam";

  PicPlan plan = b.plan(s, o);
  ASSERT_EQ(plan.parts.size(), 3u);
  EXPECT_FALSE(plan.parts[1].has_body());
  EXPECT_EQ(plan.parts[1].entry, nullptr);
  EXPECT_EQ(plan.parts[2].pos, static_cast<int64_t>(segs_[0].size() + shorty.size()));
  EXPECT_EQ(plan.next_missing(), 0u);
  try {
    b.compose(s, plan);
    ADD_FAILURE() << "composed a plan with missing entries";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("segment 0 has no entry"), std::string::npos) << e.what();
  }
  b.build(plan, 0);
  EXPECT_EQ(plan.next_missing(), 2u);
  b.build(plan, 2);
  EXPECT_EQ(plan.next_missing(), plan.parts.size());
  PrefillResult r = b.compose(s, plan);
  rb = r.report;
  EXPECT_EQ(max_abs(cold, host_logprobs(*lm_->backend, r.logits)), 0.0);
  EXPECT_EQ(ra.miss_segments, rb.miss_segments);
  EXPECT_EQ(ra.computed_tokens, rb.computed_tokens);
  EXPECT_EQ(ra.reused_tokens, rb.reused_tokens);

  // Warm, in another order around the short segment: both entries hit, the answer of a cold run.
  const std::vector<std::vector<int32_t>> s2 = {segs_[0], segs_[1], shorty, segs_[4]};
  PicEngine c(*lm_->model, 64 << 20);
  auto cold2 = run(c, s2, o);
  CacheReport rw;
  auto warm2 = run(a, s2, o, nullptr, &rw);
  EXPECT_EQ(rw.hit_segments, 2);
  EXPECT_EQ(rw.miss_segments, 0);
  EXPECT_EQ(max_abs(cold2, warm2), 0.0);
  EXPECT_THROW(b.plan(s, {PicMode::Full}), std::invalid_argument);
  EXPECT_THROW(b.compose({segs_[0], segs_[4]}, plan), std::invalid_argument);
}

// Composition in steps of at most max_rows seam rows (what the server runs, so that a prompt of
// many segments does not hold the engine) is the one-call composition bitwise on the CPU: with
// both-ends seams, naive, an exact-prefix snapshot restored, and the question in a step of its own.
TEST_P(Pic, ComposeInStepsEqualsOneCall) {
  PicOptions tail{PicMode::Pic, 8};
  tail.tail_seam = 4;
  for (const PicOptions& o : {PicOptions{PicMode::Pic, 8}, tail, PicOptions{PicMode::Naive}}) {
    PicEngine one(*lm_->model, 64 << 20);
    CacheReport ro;
    const auto want = run(one, segs_, o, nullptr, &ro);
    auto next_turn = segs_;
    next_turn.back() = segs_[2];  // the last question becomes context
    next_turn.push_back(segs_[4]);
    const auto want2 = run(one, next_turn, o);
    for (int64_t max_rows : {1, 9, 20, 1 << 20}) {
      PicEngine eng(*lm_->model, 64 << 20);
      int steps = 0;
      auto stepped = [&](const std::vector<std::vector<int32_t>>& s, CacheReport* rep) {
        PicPlan plan = eng.plan(s, o);
        for (size_t i = plan.next_missing(); i < plan.parts.size(); i = plan.next_missing()) eng.build(plan, i);
        auto c = eng.start_compose(s, plan);
        std::optional<PrefillResult> r;
        steps = 1;
        while (!(r = eng.step_compose(*c, max_rows))) ++steps;
        EXPECT_THROW(eng.step_compose(*c, max_rows), std::logic_error);
        if (rep) *rep = r->report;
        return host_logprobs(*lm_->backend, r->logits);
      };
      CacheReport rs;
      EXPECT_EQ(stepped(segs_, &rs), want) << pic_mode_name(o.mode) << " max_rows " << max_rows;
      EXPECT_EQ(rs.computed_tokens, ro.computed_tokens);
      EXPECT_EQ(rs.reused_tokens, ro.reused_tokens);
      // Seam rows 8 (+4) for each of segments 1..3; the question alone when it does not fit.
      if (max_rows == 9 && o.mode == PicMode::Pic && o.tail_seam == 0) EXPECT_EQ(steps, 4);
      if (max_rows == 1 << 20) EXPECT_EQ(steps, 1);
      // The next turn starts from the snapshot this composition kept.
      CacheReport r2;
      EXPECT_EQ(stepped(next_turn, &r2), want2) << pic_mode_name(o.mode) << " max_rows " << max_rows;
      if (o.mode == PicMode::Pic) EXPECT_GT(r2.prefix_tokens, 0);
    }
  }
}

// Composing while entries are still being built (segment workers): a run over a plan with missing
// entries composes the segments before the first one still missing, waits there (a step then is
// an error), takes each entry as it comes (supply; another segment's entry is refused), and
// answers bitwise as one call over the complete plan, with the same report.
TEST_P(Pic, ComposeWithPendingEntriesEqualsOneCall) {
  const PicOptions o{PicMode::Pic, 8};
  PicEngine one(*lm_->model, 64 << 20);
  CacheReport ro;
  const auto want = run(one, segs_, o, nullptr, &ro);
  PicEngine eng(*lm_->model, 64 << 20);
  PicPlan plan = eng.plan(segs_, o);
  ASSERT_EQ(plan.next_missing(), 0u);
  eng.build(plan, 0);
  auto c = eng.start_compose(segs_, plan, /*allow_pending=*/true);
  std::optional<PrefillResult> r;
  int steps_while_pending = 0;
  while (!r) {
    const size_t w = eng.compose_waits_for(*c);
    if (w == PicEngine::npos) {
      if (plan.next_missing() < plan.parts.size()) ++steps_while_pending;
      r = eng.step_compose(*c, 1);
      continue;
    }
    ASSERT_TRUE(plan.parts[w].missing()) << w;
    EXPECT_THROW(eng.step_compose(*c, 1), std::logic_error);
    EXPECT_THROW(eng.supply(*c, w, plan.parts[0].entry), std::logic_error);  // another segment's
    eng.build(plan, w);
    eng.supply(*c, w, plan.parts[w].entry);
    EXPECT_THROW(eng.supply(*c, w, plan.parts[w].entry), std::logic_error);  // no longer waiting
  }
  EXPECT_GE(steps_while_pending, 3);  // segments 0..2 composed before 1..3 existed
  EXPECT_EQ(host_logprobs(*lm_->backend, r->logits), want);
  EXPECT_EQ(r->report.computed_tokens, ro.computed_tokens);
  EXPECT_EQ(r->report.miss_segments, ro.miss_segments);
  EXPECT_EQ(r->report.reused_tokens, ro.reused_tokens);
  // Without allow_pending a plan with a missing entry is refused, as before.
  PicPlan p2 = PicEngine(*lm_->model, 64 << 20).plan(segs_, o);
  EXPECT_THROW(eng.start_compose(segs_, p2), std::logic_error);
}

// A segment longer than the build chunk (the backend's prefill chunk, 1024 rows on the CPU) is built
// a chunk at a time, its transition chained across chunks (T <- T_chunk T): composition stays
// exact at layer 0, a build in steps takes one step per chunk (or per chunk and layer, under a
// budget of token-layers) and gives the one-call entry bitwise, and a server can interleave those
// steps with other work.
TEST_P(Pic, LongSegmentsAreBuiltInChunks) {
  PicEngine eng(*lm_->model, 512 << 20);
  const int64_t C = eng.build_chunk();
  std::mt19937_64 rng(99);
  const int64_t V = lm_->model->config().vocab_size;
  const std::vector<std::vector<int32_t>> s = {segs_[0], rand_ids(static_cast<size_t>(2 * C + 300), V, rng),
                                               rand_ids(static_cast<size_t>(C + 77), V, rng), segs_[4]};
  SequenceState sf, sp;
  run(eng, s, {PicMode::Full}, &sf);
  run(eng, s, {PicMode::Pic, 8}, &sp);
  EXPECT_LE(rel_l2(*lm_->backend, sp.layers[0].ssm, sf.layers[0].ssm), 1e-5);
  EXPECT_LE(rel_l2(*lm_->backend, sp.layers[0].conv, sf.layers[0].conv), 1e-6);

  auto whole = eng.build_entry(s[1], 8);
  auto b = eng.start_build(s[1], 8);
  int steps = 1;
  std::shared_ptr<SegmentEntry> stepped;
  while (!(stepped = eng.step_build(*b))) ++steps;
  EXPECT_EQ(steps, 3);
  EXPECT_THROW(eng.step_build(*b), std::logic_error);
  // Steps of one layer each (a budget of one token-layer): the same entry, a step per chunk and layer.
  auto b1 = eng.start_build(s[1], 8);
  int layer_steps = 1;
  std::shared_ptr<SegmentEntry> layered;
  while (!(layered = eng.step_build(*b1, 1))) ++layer_steps;
  EXPECT_EQ(layer_steps, 3 * lm_->model->config().num_hidden_layers);
  for (const auto& other : {stepped, layered}) {
    ASSERT_EQ(other->layers.size(), whole->layers.size());
    for (size_t l = 0; l < whole->layers.size(); ++l)
      for (auto [x, y] :
           {std::pair{&whole->layers[l].T, &other->layers[l].T}, std::pair{&whole->layers[l].S, &other->layers[l].S},
            std::pair{&whole->layers[l].k, &other->layers[l].k}}) {
        ASSERT_EQ(x->defined(), y->defined());
        if (x->defined()) {
          EXPECT_EQ(std::memcmp(x->raw(), y->raw(), x->nbytes()), 0) << "layer " << l;
        }
      }
  }
}

// Short bodies are kept as their recurrence inputs, run again from the running state on reuse
// (issue 12: an entry's size grows with its tokens). That is T S + S(C|0) by another summation
// order, so answers and states match the T/S form to f32 rounding, layer 0 stays exact against
// full prefill, and a hit composes bitwise as the fresh entry did.
// Mamba2's and lightning's transitions are a number per head ([Hv, 1, 1]); the others' dense.
TEST_P(Pic, EntriesStoreTransitionsInTheirFamilysForm) {
  PicEngine eng(*lm_->model, 64 << 20);
  eng.set_compact_entries(false);
  auto e = eng.build_entry(segs_[1], 4);
  const auto& cfg = lm_->model->config();
  const bool scalar = cfg.arch == Arch::NemotronH || cfg.arch == Arch::MiniMax;
  const int64_t Hv = cfg.linear_num_value_heads, dk = cfg.linear_key_head_dim;
  for (size_t l = 0; l < e->layers.size(); ++l) {
    if (cfg.layer_types[l] != LayerKind::Linear) continue;
    EXPECT_EQ(e->layers[l].T.shape(), scalar ? Shape({Hv, 1, 1}) : Shape({Hv, dk, dk})) << "layer " << l;
  }
}

// Dense transitions stored in bf16 (the GPU's default) compose exactly as f32 transitions rounded
// to bf16 values, take less memory, are accepted back from the disk tier, and give the same
// answers from there. Scalar transitions ([Hv, 1, 1]: Mamba2, lightning) stay f32.
TEST_P(Pic, TransitionsStoredInBf16ComposeAsRoundedOnes) {
  const bool dense_t = lm_->model->transition_shape()[1] > 1;
  const PicOptions o{PicMode::Pic, 4};
  PicEngine bf(*lm_->model, 64 << 20), rounded(*lm_->model, 64 << 20), f32(*lm_->model, 64 << 20);
  for (PicEngine* e : {&bf, &rounded, &f32}) e->set_compact_entries(false);  // every body as T and S
  bf.set_transition_dtype(PicEngine::TransitionDType::BF16);
  rounded.set_transition_dtype(PicEngine::TransitionDType::F32);
  f32.set_transition_dtype(PicEngine::TransitionDType::F32);
  if (dense_t) rounded.set_entry_rounding(PicEngine::EntryRounding::T);
  const auto a = run(bf, segs_, o), b = run(rounded, segs_, o);
  EXPECT_EQ(a, b);
  auto eb = bf.build_entry(segs_[1], 4), ef = f32.build_entry(segs_[1], 4);
  int64_t t_layers = 0;
  for (const auto& l : eb->layers)
    if (l.T.defined()) {
      ++t_layers;
      EXPECT_EQ(l.T.dtype(), dense_t ? DType::BF16 : DType::F32);
    }
  EXPECT_GT(t_layers, 0);
  if (dense_t)
    EXPECT_LT(eb->bytes, ef->bytes);
  else
    EXPECT_EQ(eb->bytes, ef->bytes);
  // Through the disk tier: a fresh engine loads the bf16 entries and answers the same.
  const fs::path dir = fs::temp_directory_path() / ("hypic_bf16_t_" + GetParam());
  fs::remove_all(dir);
  {
    PicEngine w(*lm_->model, 64 << 20);
    w.set_compact_entries(false);
    w.set_transition_dtype(PicEngine::TransitionDType::BF16);
    w.attach_cache_dir(dir.string());
    EXPECT_EQ(run(w, segs_, o), a);
  }
  PicEngine r(*lm_->model, 64 << 20);
  r.set_compact_entries(false);
  r.attach_cache_dir(dir.string());
  EXPECT_EQ(run(r, segs_, o), a);
  EXPECT_GT(r.cache().stats().disk_hits, 0u);
  fs::remove_all(dir);
}

TEST_P(Pic, CompactBodiesComposeAsTransitions) {
  std::mt19937_64 rng(7);
  const int64_t V = lm_->model->config().vocab_size;
  const std::vector<std::vector<int32_t>> s = {rand_ids(10, V, rng), rand_ids(14, V, rng), segs_[1],
                                               rand_ids(19, V, rng), segs_[4]};
  PicEngine compact(*lm_->model, 64 << 20), dense(*lm_->model, 64 << 20);
  dense.set_compact_entries(false);
  if (!lm_->model->compact_bodies()) {  // per-channel decays (KDA): every body is a transition
    EXPECT_FALSE(compact.compact_body(11));
    EXPECT_FALSE(compact.compact_body(1));
    return;
  }
  // Bodies of 10, 6 and 11 tokens are compact on every other test model, 62 is not.
  ASSERT_TRUE(compact.compact_body(11));
  ASSERT_FALSE(compact.compact_body(62));
  ASSERT_FALSE(dense.compact_body(1));
  ASSERT_FALSE(compact.compact_body(0));

  const auto& types = lm_->model->config().layer_types;
  PicOptions tail{PicMode::Pic, 4};
  tail.tail_seam = 3;
  for (const PicOptions& o : {PicOptions{PicMode::Pic, 4}, tail, PicOptions{PicMode::Naive}}) {
    SequenceState sc, sd;
    auto a = run(compact, s, o, &sc), b = run(dense, s, o, &sd);
    // f32 rounding of another summation order, as SeamCoveringEverySegment: 1.3e-4 on one CI CPU.
    EXPECT_LE(max_abs(a, b), 5e-4) << pic_mode_name(o.mode) << " tail " << o.tail_seam;
    for (size_t l = 0; l < types.size(); ++l)
      if (types[l] == LayerKind::Linear) {
        EXPECT_LE(rel_l2(*lm_->backend, sc.layers[l].ssm, sd.layers[l].ssm), 1e-4) << "layer " << l;
      }
    PicEngine again(*lm_->model, 64 << 20);
    CacheReport cold, warm;
    auto c1 = run(again, s, o, nullptr, &cold);
    auto shuffled = s;
    std::swap(shuffled[1], shuffled[3]);
    run(again, shuffled, o);  // another order: no exact-prefix snapshot fits the next request
    PicEngine other(*lm_->model, 64 << 20);
    auto swapped_cold = run(other, shuffled, o);
    EXPECT_EQ(run(again, shuffled, o, nullptr, &warm), swapped_cold);
    EXPECT_EQ(c1, a);
  }
  SequenceState sf, sp;
  run(compact, s, {PicMode::Full}, &sf);
  PicEngine fresh(*lm_->model, 64 << 20);
  run(fresh, s, {PicMode::Pic, 4}, &sp);
  EXPECT_LE(rel_l2(*lm_->backend, sp.layers[0].ssm, sf.layers[0].ssm), 1e-5);
  EXPECT_LE(rel_l2(*lm_->backend, sp.layers[0].conv, sf.layers[0].conv), 1e-6);

  // The entries: recurrence inputs of exactly the body's rows in place of T and S, fewer bytes,
  // growing with the body.
  auto c6 = compact.build_entry(s[1], 8), d6 = dense.build_entry(s[1], 8), c11 = compact.build_entry(s[3], 8);
  for (size_t l = 0; l < types.size(); ++l) {
    const auto &c = c6->layers[l], &d = d6->layers[l];
    if (types[l] != LayerKind::Linear) continue;
    EXPECT_TRUE(c.body.defined() && !c.T.defined() && !c.S.defined() && c.conv_tail.defined());
    EXPECT_EQ(c.body.rows(), 6);
    EXPECT_EQ(c11->layers[l].body.rows(), 11);
    EXPECT_TRUE(!d.body.defined() && d.T.defined() && d.S.defined());
  }
  EXPECT_LT(c6->bytes, d6->bytes);
  EXPECT_LT(c6->bytes, c11->bytes);
}

INSTANTIATE_TEST_SUITE_P(Models, Pic,
                         ::testing::Values("qwen3_5_dense", "qwen3_5_moe", "qwen3_next", "nemotron_h", "minimax",
                                           "kimi_linear", "kimi_linear_rope"),
                         [](const auto& i) { return i.param; });

// The CPU's bf16 products (`--activations bf16`, oneDNN) on the default model (bf16 weights): the
// log-probs of a text stay near those of the f32 products (conformance-tested against
// transformers) and measurably off them (the activations really are rounded), and PIC keeps its
// properties at that precision: one-segment pic and pic with seams over everything equal full
// within the bf16 bound, and warm answers equal cold ones bitwise.
TEST(PicBf16Activations, CpuBf16ProductsKeepPicProperties) {
  LoadedModel lm = load_model(std::string(HYPIC_SOURCE_DIR) + "/models/default", "cpu", 2);
  lm.backend->set_precise(false);
  if (lm.backend->precise()) GTEST_SKIP() << lm.backend->imprecise_unavailable();
  ASSERT_TRUE(lm.tokenizer);
  const std::string text =
      "Document 1: The lighthouse keeper on Arlen Island is named Tomas Reyes. He lives with two cats and "
      "repairs radios in the winter. Document 2: The bakery on Cole Street opens at six and sells rye bread, "
      "almond cakes and coffee. Its owner, Mira, learned the trade from her grandmother in Lyon. "
      "Question: Who is the lighthouse keeper on Arlen Island? Answer:";
  const std::vector<int32_t> ids = lm.tokenizer->encode(text);
  ASSERT_GE(static_cast<int64_t>(ids.size()), 2 * cpu::CpuBackend::kBf16Rows);
  auto logprobs = [&] {
    SequenceState st = lm.model->new_state();
    return host_logprobs(*lm.backend, lm.model->forward(ids, st, {.all_logits = true}));
  };
  const std::vector<float> lp16 = logprobs();
  lm.backend->set_precise(true);
  const std::vector<float> lp32 = logprobs();
  lm.backend->set_precise(false);
  double e = 0;
  for (size_t i = 0; i < lp32.size(); ++i)
    if (lp32[i] > -5) e = std::max(e, std::abs(double(lp16[i]) - lp32[i]));  // the tokens that can be sampled
  std::printf("default model, %zu tokens: bf16 against f32 products, max |log-prob diff| (lp > -5) %.3e\n", ids.size(),
              e);
  EXPECT_LE(e, 0.05);
  EXPECT_GT(e, 1e-4);

  std::mt19937_64 rng(99);
  const int64_t V = lm.model->config().vocab_size;
  std::vector<std::vector<int32_t>> segs = {rand_ids(20, V, rng), rand_ids(70, V, rng), rand_ids(41, V, rng),
                                            rand_ids(90, V, rng), rand_ids(12, V, rng)};
  auto run = [&](PicEngine& eng, const std::vector<std::vector<int32_t>>& s, PicOptions o) {
    return host_logprobs(*lm.backend, eng.prefill(s, o).logits);
  };
  PicEngine eng(*lm.model, 64 << 20);
  const std::vector<std::vector<int32_t>> one = {segs[3]};
  const double d_one = max_abs(run(eng, one, {PicMode::Pic}), run(eng, one, {PicMode::Full}));
  const double d_all = max_abs(run(eng, segs, {PicMode::Pic, 1000}), run(eng, segs, {PicMode::Full}));
  std::printf("pic vs full: one segment %.3e, seams over everything %.3e\n", d_one, d_all);
  EXPECT_LE(d_one, 0.05);
  EXPECT_LE(d_all, 0.08);  // pic's seams run row-independent, in f32: full's rounding, not pic's
  PicEngine cold(*lm.model, 64 << 20), warm(*lm.model, 64 << 20);
  auto shuffled = segs;
  std::swap(shuffled[1], shuffled[3]);
  shuffled[0][0] = (shuffled[0][0] + 1) % 7;
  run(warm, shuffled, {PicMode::Pic});
  EXPECT_EQ(run(cold, segs, {PicMode::Pic}), run(warm, segs, {PicMode::Pic}));
}

TEST(PicErrors, BadRequestsGiveClearErrors) {
  auto lm = load_model((fs::path(HYPIC_TEST_DATA) / "models" / "qwen3_5_dense").string(), "cpu", 1);
  PicEngine eng(*lm.model, 64 << 20);
  auto expect_msg = [&](const std::vector<std::vector<int32_t>>& s, PicOptions o, const std::string& needle) {
    try {
      eng.prefill(s, o);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_msg({}, {}, "no segments");
  expect_msg({{1, 2}, {}, {3}}, {}, "segment 1 is empty");
  const int64_t ctx = lm.model->config().max_position_embeddings;
  expect_msg({std::vector<int32_t>(static_cast<size_t>(ctx) + 1, 5)}, {}, "exceeds the model's context");
  expect_msg({{1}, {2}}, {PicMode::Pic, -1}, "seam");
  // A budget smaller than one entry.
  PicEngine tiny(*lm.model, 1024);
  try {
    tiny.prefill({{1, 2, 3}, {4, 5, 6}, {7}}, {});
    ADD_FAILURE();
  } catch (const std::length_error& e) {
    EXPECT_NE(std::string(e.what()).find("budget"), std::string::npos) << e.what();
  }
}

TEST(PicErrors, PinnedEntriesAreNeverEvicted) {
  auto lm = load_model((fs::path(HYPIC_TEST_DATA) / "models" / "qwen3_5_dense").string(), "cpu", 1);
  PicEngine eng(*lm.model, 64 << 20);
  auto a = eng.build_entry({1, 2, 3, 4}, 0);
  SegmentCache cache(a->bytes + a->bytes / 2);  // room for one entry
  auto pinned = cache.insert(a);
  auto b = eng.build_entry({5, 6, 7, 8}, 0);
  EXPECT_THROW(cache.insert(b), std::length_error);  // the only other entry is in use
  EXPECT_NE(cache.find(a->key), nullptr);
  pinned.reset();
  a.reset();
  EXPECT_NO_THROW(cache.insert(b));  // now the old entry can go
  EXPECT_EQ(cache.stats().evictions, 1u);
}

// The bf16-entry experiment of `bench fidelity`: rounded entries hold bf16 values (low 16 bits
// zero) in exactly the tensors asked for, and the default leaves f32 values.
TEST(PicErrors, EntryRoundingRoundsTheTensorsAskedFor) {
  auto lm = load_model((fs::path(HYPIC_TEST_DATA) / "models" / "qwen3_5_dense").string(), "cpu", 1);
  auto low_bits = [](const Tensor& t) {
    int64_t n = 0;
    for (int64_t i = 0; i < t.numel(); ++i) {
      uint32_t u;
      std::memcpy(&u, &t.data<float>()[i], 4);
      n += (u & 0xffffu) != 0;
    }
    return n;
  };
  const std::vector<int32_t> ids = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3};
  for (auto r : {PicEngine::EntryRounding::None, PicEngine::EntryRounding::T, PicEngine::EntryRounding::All}) {
    PicEngine eng(*lm.model, 64 << 20);
    eng.set_entry_rounding(r);
    eng.set_compact_entries(false);  // an 8-token body would be kept compact, without T
    auto e = eng.build_entry(ids, 2);
    int64_t t_bits = 0, other_bits = 0;
    for (const auto& l : e->layers) {
      if (l.T.defined()) t_bits += low_bits(l.T);
      for (const Tensor* x : {&l.S, &l.conv_tail, &l.k, &l.v})
        if (x->defined()) other_bits += low_bits(*x);
    }
    // The compact form has no T: only All rounds its recurrence inputs.
    PicEngine compact(*lm.model, 64 << 20);
    compact.set_entry_rounding(r);
    auto c = compact.build_entry(ids, 2);
    int64_t body_bits = 0, bodies = 0;
    for (const auto& l : c->layers)
      for (const Tensor* x : {&l.body.k, &l.body.v, &l.body.g, &l.body.beta})
        if (x->defined()) body_bits += low_bits(*x), ++bodies;
    EXPECT_GT(bodies, 0);
    if (r == PicEngine::EntryRounding::All)
      EXPECT_EQ(body_bits, 0);
    else
      EXPECT_GT(body_bits, 0);
    if (r == PicEngine::EntryRounding::None) {
      EXPECT_GT(t_bits, 0);
      EXPECT_GT(other_bits, 0);
    } else {
      EXPECT_EQ(t_bits, 0);
      if (r == PicEngine::EntryRounding::T)
        EXPECT_GT(other_bits, 0);
      else
        EXPECT_EQ(other_bits, 0);
    }
  }
}

}  // namespace
