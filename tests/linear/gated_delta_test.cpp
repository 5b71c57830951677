// gated_delta_forward (the engine's GDN kernel) against the fp64 literal recurrence, including
// the one-pass transition T_C, across chunk boundaries, with Hv = 2 Hk, and from a non-zero state.
#include "linear/gated_delta.h"

#include <gtest/gtest.h>

#include <random>

#include "linear/recurrence.h"
#include "linear_test_util.h"

namespace hypic::linear {
namespace {

using testing::Case;
using testing::make_case;
using testing::rel_l2;

struct GdnParam {
  int64_t T;
  bool l2norm;
};

class GatedDelta : public ::testing::TestWithParam<GdnParam> {};

TEST_P(GatedDelta, MatchesNaiveRecurrenceWithTransition) {
  const auto [T, l2] = GetParam();
  for (uint64_t seed : {1u, 2u, 3u}) {
    const RecShape s{T, 2, 4, 32, 48};  // Hv = 2 Hk, dk != dv
    Case c = make_case(Family::GatedDeltaNet, s, seed * 7919 + T);
    if (!l2) {  // unnormalised inputs of modest norm
      for (auto& x : c.q) x *= 0.2f;
      for (auto& x : c.k) x *= 0.2f;
    }
    c.in.l2norm_qk = l2;
    // Non-zero initial state.
    std::mt19937 rng(seed);
    std::normal_distribution<float> N(0.f, 0.5f);
    std::vector<float> S0(s.Hv * s.dk * s.dv);
    for (auto& x : S0) x = N(rng);

    std::vector<double> Sref(S0.begin(), S0.end()), Oref(s.T * s.Hv * s.dv), Tref = testing::identity_dense(s.Hv, s.dk);
    reference_forward(Family::GatedDeltaNet, s, c.in, Sref.data(), Oref.data(), Tref.data());

    for (int threads : {1, 3}) {
      std::vector<float> S = S0, O(Oref.size()), Tr(s.Hv * s.dk * s.dk);
      gated_delta_forward(GdnShape{s.T, s.Hk, s.Hv, s.dk, s.dv}, c.q.data(), c.k.data(), c.v.data(), c.g.data(),
                          c.beta.data(), l2, S.data(), O.data(), Tr.data(), threads);
      EXPECT_LE(rel_l2(O, Oref), 1e-5) << "T=" << T << " seed=" << seed;
      EXPECT_LE(rel_l2(S, Sref), 1e-5) << "T=" << T << " seed=" << seed;
      EXPECT_LE(rel_l2(Tr, Tref), 1e-5) << "T=" << T << " seed=" << seed;
      // Without transition the outputs and state are identical.
      std::vector<float> S2 = S0, O2(Oref.size());
      gated_delta_forward(GdnShape{s.T, s.Hk, s.Hv, s.dk, s.dv}, c.q.data(), c.k.data(), c.v.data(), c.g.data(),
                          c.beta.data(), l2, S2.data(), O2.data(), nullptr, threads);
      EXPECT_EQ(S2, S);
      EXPECT_EQ(O2, O);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Lengths, GatedDelta,
                         ::testing::Values(GdnParam{1, true}, GdnParam{2, true}, GdnParam{63, true}, GdnParam{64, true},
                                           GdnParam{65, true}, GdnParam{200, true}, GdnParam{200, false},
                                           GdnParam{129, false}));

// Real model shape (Qwen3.5: 16 key heads, 32 value heads, dk = dv = 128), one seed.
TEST(GatedDeltaModelShape, Qwen35Heads) {
  const RecShape s{100, 16, 32, 128, 128};
  Case c = make_case(Family::GatedDeltaNet, s, 42);
  std::vector<double> Sref(s.Hv * s.dk * s.dv, 0.0), Oref(s.T * s.Hv * s.dv),
      Tref = testing::identity_dense(s.Hv, s.dk);
  reference_forward(Family::GatedDeltaNet, s, c.in, Sref.data(), Oref.data(), Tref.data());
  std::vector<float> S(Sref.size(), 0.f), O(Oref.size()), Tr(Tref.size());
  gated_delta_forward(GdnShape{s.T, s.Hk, s.Hv, s.dk, s.dv}, c.q.data(), c.k.data(), c.v.data(), c.g.data(),
                      c.beta.data(), true, S.data(), O.data(), Tr.data(), 2);
  EXPECT_LE(rel_l2(O, Oref), 1e-5);
  EXPECT_LE(rel_l2(S, Sref), 1e-5);
  EXPECT_LE(rel_l2(Tr, Tref), 1e-5);
}

}  // namespace
}  // namespace hypic::linear
