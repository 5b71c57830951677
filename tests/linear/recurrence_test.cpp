// Property tests for every linear-recurrence family (fp32 kernels vs fp64 literal recurrence):
// chunked / token-step forward, one-pass compact transitions, segment composition, split points,
// exact RoPE re-rotation (Ring-style retention) and the failure of naive addition.
#include "linear/recurrence.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>

#include "linear_test_util.h"

namespace hypic::linear {
namespace {

using testing::Case;
using testing::make_case;
using testing::rel_l2;

constexpr double kTol = 1e-5;

std::string name_of(Family f) {
  return std::string(traits(f).name);
}

std::vector<float> random_state(int64_t n, uint64_t seed, float sd = 0.5f) {
  std::mt19937 rng{uint32_t(seed)};
  std::normal_distribution<float> N(0.f, sd);
  std::vector<float> S(n);
  for (auto& x : S) x = N(rng);
  return S;
}

// Slices tokens [a, b) of a case into a new case (same family, shape, decays).
Case slice(const Case& c, int64_t a, int64_t b) {
  Case r = c;
  const RecShape& s = c.shape;
  r.shape.T = b - a;
  auto cut = [&](const std::vector<float>& x, int64_t per) {
    return x.empty() ? x : std::vector<float>(x.begin() + a * per, x.begin() + b * per);
  };
  r.q = cut(c.q, s.Hk * s.dk);
  r.k = cut(c.k, s.Hk * s.dk);
  r.v = cut(c.v, s.Hv * s.dv);
  r.g = cut(c.g, traits(c.family).decay == Decay::Channel ? s.Hv * s.dk : s.Hv);
  r.beta = cut(c.beta, s.Hv);
  r.in.q = r.q.data(), r.in.k = r.k.data(), r.in.v = r.v.data();
  r.in.g = r.g.empty() ? nullptr : r.g.data();
  r.in.beta = r.beta.empty() ? nullptr : r.beta.data();
  r.in.log_gamma = r.log_gamma.empty() ? nullptr : r.log_gamma.data();
  r.in.rope.start = c.in.rope.start + a;
  return r;
}

// ---- forward kernels vs the fp64 reference ---------------------------------------------------
struct FwdParam {
  Family f;
  int64_t T;
  bool strong;
  int rot;
};

class Forward : public ::testing::TestWithParam<FwdParam> {};

TEST_P(Forward, ChunkedAndStepMatchReference) {
  const auto [f, T, strong, rot] = GetParam();
  for (uint64_t seed : {11u, 12u, 13u}) {
    const RecShape s{T, 2, 4, 32, 40};
    Case c = make_case(f, s, seed * 1000 + T, strong, rot, rot ? 17 : 0);
    const std::vector<float> S0 = random_state(s.Hv * s.dk * s.dv, seed);
    std::vector<double> Sref(S0.begin(), S0.end()), Oref(s.T * s.Hv * s.dv), Tref = testing::identity_dense(s.Hv, s.dk);
    reference_forward(f, s, c.in, Sref.data(), Oref.data(), Tref.data());
    const int64_t tn = transition_floats(f, s.Hv, s.dk);
    for (int chunk : {0, 16, 64}) {
      for (int mode = 0; mode < 2; ++mode) {
        std::vector<float> S = S0, O(Oref.size()), Tr(tn);
        if (mode == 0)
          chunked_forward(f, s, c.in, S.data(), O.data(), Tr.data(), 2, chunk);
        else
          recurrent_forward(f, s, c.in, S.data(), O.data(), Tr.data(), 2);
        const auto Td = expand_transition(f, s.Hv, s.dk, Tr.data(), s.T, c.in.log_gamma);
        const std::string what = name_of(f) + (mode ? " step" : " chunk") + " T=" + std::to_string(T) +
                                 " seed=" + std::to_string(seed) + " chunk=" + std::to_string(chunk);
        EXPECT_LE(rel_l2(O, Oref), kTol) << what;
        EXPECT_LE(rel_l2(S, Sref), kTol) << what;
        if (!strong) {
          EXPECT_LE(rel_l2(Td, Tref), kTol) << what;
        } else {  // T_C underflows towards 0 under strong decay: compare absolutely
          double err = 0;
          for (size_t i = 0; i < Td.size(); ++i) err = std::max(err, std::fabs(Td[i] - Tref[i]));
          EXPECT_LE(err, 1e-6) << what;
        }
      }
    }
  }
}

std::vector<FwdParam> forward_params() {
  std::vector<FwdParam> p;
  for (Family f : kAllFamilies)
    for (int64_t T : {1, 2, 31, 33, 64, 65, 150}) p.push_back({f, T, false, 0});
  for (Family f : {Family::Mamba2, Family::GLA, Family::GatedDeltaNet, Family::KDA}) p.push_back({f, 150, true, 0});
  p.push_back({Family::Retention, 150, false, 32});
  p.push_back({Family::Retention, 150, false, 16});
  return p;
}

INSTANTIATE_TEST_SUITE_P(Families, Forward, ::testing::ValuesIn(forward_params()), [](const auto& i) {
  return name_of(i.param.f) + "_T" + std::to_string(i.param.T) + (i.param.strong ? "_strong" : "") +
         (i.param.rot ? "_rope" + std::to_string(i.param.rot) : "");
});

// ---- composition of segment summaries --------------------------------------------------------
struct ComposeParam {
  Family f;
  int rot;
};
class Compose : public ::testing::TestWithParam<ComposeParam> {};

TEST_P(Compose, SegmentsComposeToSequentialScan) {
  const auto [f, rot] = GetParam();
  for (uint64_t seed : {21u, 22u, 23u, 24u}) {
    std::mt19937 rng{uint32_t(seed)};
    const int nseg = 2 + int(rng() % 4);
    std::vector<int64_t> cuts{0};
    for (int i = 0; i < nseg; ++i) cuts.push_back(cuts.back() + 1 + int64_t(rng() % 140));
    const RecShape s{cuts.back(), 1, 2, 24, 36};
    const Case c = make_case(f, s, seed, false, rot, 0);
    const std::vector<float> S0 = random_state(s.Hv * s.dk * s.dv, seed + 5);

    std::vector<double> Sref(S0.begin(), S0.end()), Tref = testing::identity_dense(s.Hv, s.dk);
    reference_forward(f, s, c.in, Sref.data(), nullptr, Tref.data());

    // Each segment summarised alone at relative positions (cold, position independent).
    std::vector<Summary> sums;
    for (int i = 0; i < nseg; ++i) {
      Case seg = slice(c, cuts[i], cuts[i + 1]);
      seg.in.rope.start = 0;
      sums.push_back(summarize(f, seg.shape, seg.in, nullptr, 2));
      if (rot) rerotate_state(sums.back().S.data(), s.Hv, s.dk, s.dv, cuts[i], rot, seg.in.rope.theta);
    }
    // (a) fold states left to right: S <- T_i S + S_i.
    std::vector<float> S = S0;
    for (auto& sm : sums) compose(sm, c.in.log_gamma, S.data(), S.data());
    EXPECT_LE(rel_l2(S, Sref), kTol) << name_of(f) << " seed " << seed << " nseg " << nseg;
    // (b) compose the summaries first (right-to-left tree), then apply once.
    Summary all = sums.back();
    for (int i = nseg - 2; i >= 0; --i) all = compose(sums[i], all, c.in.log_gamma);
    EXPECT_EQ(all.length, s.T);
    std::vector<float> S2(S0.size());
    compose(all, c.in.log_gamma, S0.data(), S2.data());
    EXPECT_LE(rel_l2(S2, Sref), kTol) << name_of(f) << " seed " << seed;
    const auto Td = expand_transition(f, s.Hv, s.dk, all.T.data(), all.length, c.in.log_gamma);
    EXPECT_LE(rel_l2(Td, Tref), kTol) << name_of(f) << " seed " << seed;
  }
}

TEST_P(Compose, AnySplitPointGivesTheSameState) {
  const auto [f, rot] = GetParam();
  const RecShape s{130, 2, 2, 24, 20};
  const Case c = make_case(f, s, 77, false, rot, 5);
  const std::vector<float> S0 = random_state(s.Hv * s.dk * s.dv, 78);
  std::vector<double> Sref(S0.begin(), S0.end()), Oref(s.T * s.Hv * s.dv);
  reference_forward(f, s, c.in, Sref.data(), Oref.data(), nullptr);
  for (int64_t split : {1, 31, 32, 33, 63, 64, 65, 100, 129}) {
    const Case a = slice(c, 0, split), b = slice(c, split, s.T);
    std::vector<float> S = S0, O(Oref.size());
    chunked_forward(f, a.shape, a.in, S.data(), O.data(), nullptr, 1);
    chunked_forward(f, b.shape, b.in, S.data(), O.data() + split * s.Hv * s.dv, nullptr, 1);
    EXPECT_LE(rel_l2(S, Sref), kTol) << name_of(f) << " split " << split;
    EXPECT_LE(rel_l2(O, Oref), kTol) << name_of(f) << " split " << split;
    // Same via summaries of the two halves (each from zero, at its own positions).
    Summary sa = summarize(f, a.shape, a.in, nullptr), sb = summarize(f, b.shape, b.in, nullptr);
    std::vector<float> S2 = S0;
    compose(sa, c.in.log_gamma, S2.data(), S2.data());
    compose(sb, c.in.log_gamma, S2.data(), S2.data());
    EXPECT_LE(rel_l2(S2, Sref), kTol) << name_of(f) << " split " << split;
  }
}

std::vector<ComposeParam> compose_params() {
  std::vector<ComposeParam> p;
  for (Family f : kAllFamilies) p.push_back({f, 0});
  p.push_back({Family::Retention, 24});  // RoPE on every dim
  p.push_back({Family::Retention, 8});   // partial RoPE
  return p;
}
INSTANTIATE_TEST_SUITE_P(Families, Compose, ::testing::ValuesIn(compose_params()), [](const auto& i) {
  return name_of(i.param.f) + (i.param.rot ? "_rope" + std::to_string(i.param.rot) : "");
});

// ---- RoPE re-rotation ------------------------------------------------------------------------
TEST(Rerotate, RelativeSummaryRotatedEqualsAbsolute) {
  for (int rot : {32, 12}) {
    for (int64_t start : {1, 37, 1000, 123457}) {
      const RecShape s{90, 2, 4, 32, 24};
      Case rel = make_case(Family::Retention, s, 5 + rot, false, rot, 0);
      Case abs = rel;
      abs.in.rope.start = start;
      Summary r = summarize(Family::Retention, s, rel.in, nullptr, 2);
      rerotate_state(r.S.data(), s.Hv, s.dk, s.dv, start, rot, rel.in.rope.theta);
      std::vector<double> Sref(s.Hv * s.dk * s.dv, 0.0);
      reference_forward(Family::Retention, s, abs.in, Sref.data(), nullptr, nullptr);
      EXPECT_LE(rel_l2(r.S, Sref), kTol) << "rot " << rot << " start " << start;
      // And without re-rotation it is wrong (the test can fail).
      Summary r2 = summarize(Family::Retention, s, rel.in, nullptr, 2);
      EXPECT_GT(rel_l2(r2.S, Sref), 1e-2) << "rot " << rot << " start " << start;
    }
  }
}

// ---- naive addition is wrong -----------------------------------------------------------------
TEST(NaiveAddition, RetNetSlowDecayLoses22PercentAt256Tokens) {
  // One head with gamma = 1 - 2^-10: a 256-token segment after a prefix.
  const RecShape sp{512, 1, 1, 64, 64}, sc{256, 1, 1, 64, 64};
  Case pre = make_case(Family::Retention, sp, 1), seg = make_case(Family::Retention, sc, 2);
  const float lg = std::log1p(-std::exp2(-10.f));
  pre.log_gamma[0] = seg.log_gamma[0] = lg;
  Summary a = summarize(Family::Retention, sp, pre.in, nullptr), b = summarize(Family::Retention, sc, seg.in, nullptr);
  std::vector<float> truth(a.S.size()), naive(a.S.size());
  compose(b, seg.in.log_gamma, a.S.data(), truth.data());
  for (size_t i = 0; i < naive.size(); ++i) naive[i] = a.S[i] + b.S[i];
  double num = 0, den = 0, tn = 0;
  for (size_t i = 0; i < naive.size(); ++i)
    num += double(naive[i] - truth[i]) * (naive[i] - truth[i]), den += double(a.S[i]) * a.S[i],
        tn += double(truth[i]) * truth[i];
  const double frac = std::sqrt(num / den), frac_true = std::sqrt(num / tn);
  std::printf(
      "RetNet gamma=1-2^-10, 256 tokens: naive-addition error = %.4f of the prefix state norm "
      "(%.4f of the true state norm); 1-gamma^256 = %.4f\n",
      frac, frac_true, 1.0 - std::exp(256.0 * lg));
  EXPECT_GT(frac, 0.20);
  EXPECT_LT(frac, 0.24);
}

TEST(NaiveAddition, WrongForEveryFamilyButLinearAttention) {
  for (Family f : kAllFamilies) {
    const RecShape s{200, 1, 2, 16, 16};
    const Case p = make_case(f, s, 31), q = make_case(f, s, 32);
    Summary a = summarize(f, s, p.in, nullptr), b = summarize(f, s, q.in, nullptr);
    std::vector<float> truth(a.S.size()), naive(a.S.size());
    compose(b, q.in.log_gamma, a.S.data(), truth.data());
    for (size_t i = 0; i < naive.size(); ++i) naive[i] = a.S[i] + b.S[i];
    const double err = testing::rel_l2f(naive, truth);
    std::printf("naive addition, %-16s relative error %.3e\n", std::string(traits(f).name).c_str(), err);
    if (f == Family::LinearAttention)
      EXPECT_LE(err, 1e-6);
    else
      EXPECT_GT(err, 1e-2) << name_of(f);
  }
}

// ---- decode (T = 1) equals the chunked forward -----------------------------------------------
TEST(Decode, TokenStepsEqualChunkedForward) {
  for (Family f : kAllFamilies) {
    const RecShape s{70, 2, 4, 32, 16};
    const Case c = make_case(f, s, 99, false, f == Family::Retention ? 32 : 0);
    std::vector<float> Sc(s.Hv * s.dk * s.dv, 0.f), Oc(s.T * s.Hv * s.dv), Ss = Sc, Os = Oc;
    chunked_forward(f, s, c.in, Sc.data(), Oc.data(), nullptr, 2);
    for (int64_t t = 0; t < s.T; ++t) {
      const Case one = slice(c, t, t + 1);
      recurrent_forward(f, one.shape, one.in, Ss.data(), Os.data() + t * s.Hv * s.dv, nullptr, 1);
    }
    EXPECT_LE(testing::rel_l2f(Ss, Sc), kTol) << name_of(f);
    EXPECT_LE(testing::rel_l2f(Os, Oc), kTol) << name_of(f);
  }
}

}  // namespace
}  // namespace hypic::linear
