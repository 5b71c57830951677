#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "backend/backend.h"

using namespace hypic;

namespace {
std::vector<float> random_logits(int n, uint64_t seed) {
  std::mt19937_64 r(seed);
  std::normal_distribution<float> d(0, 3);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(r);
  return v;
}
int32_t argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}
}  // namespace

TEST(Sampler, GreedyAndDegenerateSettingsPickArgmax) {
  for (uint64_t s = 0; s < 20; ++s) {
    auto l = random_logits(97, s);
    EXPECT_EQ(Sampler({0.f, 0, 1.f, s}).sample(l), argmax(l));
    EXPECT_EQ(Sampler({1.f, 1, 1.f, s}).sample(l), argmax(l));    // top-k 1
    EXPECT_EQ(Sampler({1.f, 0, 1e-6f, s}).sample(l), argmax(l));  // tiny nucleus
  }
}

TEST(Sampler, SeededRunsRepeatAndSeedsDiffer) {
  auto l = random_logits(50, 7);
  for (auto& x : l) x /= 4;  // flat enough that seeds matter
  std::vector<int32_t> a, b, c;
  Sampler s1({1.f, 0, 1.f, 42}), s2({1.f, 0, 1.f, 42}), s3({1.f, 0, 1.f, 43});
  for (int i = 0; i < 64; ++i) {
    a.push_back(s1.sample(l));
    b.push_back(s2.sample(l));
    c.push_back(s3.sample(l));
  }
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(Sampler, TopKAndTopPRestrictTheSupport) {
  auto l = random_logits(200, 3);
  std::vector<int32_t> order(l.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return l[x] > l[y]; });
  Sampler k5({1.5f, 5, 1.f, 1});
  for (int i = 0; i < 500; ++i) {
    int32_t t = k5.sample(l);
    EXPECT_NE(std::find(order.begin(), order.begin() + 5, t), order.begin() + 5);
  }
  // Nucleus: tokens outside the smallest prefix with mass >= p never appear.
  auto lp = log_softmax(l);
  double acc = 0;
  size_t keep = 0;
  while (acc < 0.5) acc += std::exp(lp[static_cast<size_t>(order[keep++])]);
  Sampler p5({1.f, 0, 0.5f, 9});
  for (int i = 0; i < 500; ++i) {
    int32_t t = p5.sample(l);
    EXPECT_NE(std::find(order.begin(), order.begin() + static_cast<long>(keep), t),
              order.begin() + static_cast<long>(keep));
  }
}

TEST(Sampler, FrequenciesFollowTheSoftmax) {
  std::vector<float> l = {0.f, 1.f, 2.f, -1.f};
  auto lp = log_softmax(l);
  Sampler s({1.f, 0, 1.f, 123});
  std::map<int32_t, int> n;
  const int N = 40000;
  for (int i = 0; i < N; ++i) ++n[s.sample(l)];
  for (int i = 0; i < 4; ++i) {
    double p = std::exp(lp[static_cast<size_t>(i)]), f = double(n[i]) / N;
    EXPECT_NEAR(f, p, 5 * std::sqrt(p * (1 - p) / N)) << "token " << i;
  }
}

// A large vocabulary: the sampler orders only the first 1024 candidates unless the nucleus needs
// more; the support and the frequencies must not depend on that.
TEST(Sampler, LargeVocabulariesKeepTheExactSupportAndFrequencies) {
  const int V = 20000;
  std::vector<float> l(V, 0.f);  // flat: a 0.9 nucleus needs ~18k ids, past the first 1024
  for (int i = 0; i < 8; ++i) l[static_cast<size_t>(1000 * i + 17)] = 2.f;
  std::vector<int32_t> by_value(V);
  for (int i = 0; i < V; ++i) by_value[static_cast<size_t>(i)] = i;
  std::stable_sort(by_value.begin(), by_value.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  auto support = [&](double p, int k) {  // the smallest best-first prefix with mass >= p (within top k)
    auto lp = log_softmax(l);
    const size_t n = k > 0 ? static_cast<size_t>(k) : by_value.size();
    double total = 0, acc = 0;
    for (size_t i = 0; i < n; ++i) total += std::exp(lp[static_cast<size_t>(by_value[i])]);
    size_t keep = 0;
    while (keep < n && acc < p * total) acc += std::exp(lp[static_cast<size_t>(by_value[keep++])]);
    return keep;
  };
  const size_t keep = support(0.9, 0);
  ASSERT_GT(keep, 10000u);
  Sampler wide({1.f, 0, 0.9f, 5});
  int max_rank = 0;
  std::vector<int> rank(V);
  for (int i = 0; i < V; ++i) rank[static_cast<size_t>(by_value[static_cast<size_t>(i)])] = i;
  for (int i = 0; i < 150; ++i) max_rank = std::max(max_rank, rank[static_cast<size_t>(wide.sample(l))]);
  EXPECT_LT(max_rank, static_cast<int>(keep));
  EXPECT_GT(max_rank, 1024);  // the rest of the nucleus was reachable
  // top-k 4 of the 8 peaks, then a nucleus of half of their mass: ids 17 and 1017 only.
  Sampler kp({1.f, 4, 0.5f, 6});
  std::map<int32_t, int> n;
  const int N = 8000;
  for (int i = 0; i < N; ++i) ++n[kp.sample(l)];
  ASSERT_EQ(n.size(), 2u);
  EXPECT_NEAR(double(n[17]) / N, 0.5, 5 * std::sqrt(0.25 / N));
  EXPECT_NEAR(double(n[1017]) / N, 0.5, 5 * std::sqrt(0.25 / N));
  // Plain temperature sampling over the whole row: the 8 peaks take 8e^2 / (8e^2 + V - 8) of the mass.
  Sampler all({1.f, 0, 1.f, 7});
  int peaks = 0;
  for (int i = 0; i < N; ++i) peaks += l[static_cast<size_t>(all.sample(l))] > 1.f;
  const double p = 8 * std::exp(2.0) / (8 * std::exp(2.0) + V - 8);
  EXPECT_NEAR(double(peaks) / N, p, 5 * std::sqrt(p * (1 - p) / N) + 1e-4);
}

TEST(Sampler, LogprobsAreNormalisedAndTopIsSorted) {
  auto l = random_logits(300, 11);
  auto lp = log_softmax(l);
  double s = 0;
  for (float v : lp) s += std::exp(double(v));
  EXPECT_NEAR(s, 1.0, 1e-6);
  auto t = token_logprob(l, 17, 5);
  EXPECT_FLOAT_EQ(t.logprob, lp[17]);
  ASSERT_EQ(t.top.size(), 5u);
  EXPECT_EQ(t.top[0].first, argmax(l));
  for (size_t i = 1; i < t.top.size(); ++i) EXPECT_GE(t.top[i - 1].second, t.top[i].second);
}

TEST(Sampler, RejectsBadParameters) {
  EXPECT_THROW(Sampler({-1.f, 0, 1.f, 0}), std::invalid_argument);
  EXPECT_THROW(Sampler({NAN, 0, 1.f, 0}), std::invalid_argument);
  EXPECT_THROW(Sampler({1.f, -3, 1.f, 0}), std::invalid_argument);
  EXPECT_THROW(Sampler({1.f, 0, 0.f, 0}), std::invalid_argument);
  EXPECT_THROW(Sampler({1.f, 0, 1.5f, 0}), std::invalid_argument);
  try {
    Sampler({1.f, 0, 2.f, 0});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("top_p"), std::string::npos);
  }
}

TEST(Sampler, MaskedIdsAreNeverPicked) {
  for (uint64_t s = 0; s < 20; ++s) {
    auto l = random_logits(97, s);
    const int32_t best = argmax(l);
    std::vector<int32_t> ban = {best, 0, 96, 500, -3};  // out-of-row ids are ignored
    mask_ids(l, ban);
    EXPECT_TRUE(std::isinf(l[static_cast<size_t>(best)]) && l[static_cast<size_t>(best)] < 0);
    EXPECT_NE(Sampler({0.f, 0, 1.f, s}).sample(l), best);
    Sampler hot({3.f, 0, 1.f, s});
    for (int k = 0; k < 200; ++k) {
      const int32_t id = hot.sample(l);
      EXPECT_TRUE(id != best && id != 0 && id != 96) << id;
    }
    const auto lp = token_logprob(l, argmax(l), 5);
    for (const auto& [id, p] : lp.top) EXPECT_TRUE(id != best && id != 0 && id != 96);
  }
}

// Backend::sample_rows (the device draw's reference) picks what the Sampler picks from the same
// uniform draw: the server may draw a request's token on either side.
TEST(Sampler, DeviceDrawReferenceMatchesTheSampler) {
  auto be = make_backend("cpu", 1);
  const int64_t V = 3000;
  for (uint64_t seed = 0; seed < 40; ++seed) {
    auto l = random_logits(static_cast<int>(V), seed);
    const float t = seed % 4 == 0 ? 0.f : 0.3f + 0.2f * static_cast<float>(seed % 5);
    Sampler a({t, 0, 1.f, seed}), b({t, 0, 1.f, seed});
    ASSERT_TRUE(a.plain(V));
    const int32_t want = a.sample(l);
    const float par[3] = {t, t > 0 ? static_cast<float>(b.uniform()) : 0.f, 0.f};
    Tensor x = Tensor::empty(DType::F32, {1, V}), p = Tensor::empty(DType::F32, {1, 3});
    Tensor ids = Tensor::empty(DType::I32, {1});
    std::copy(l.begin(), l.end(), x.data<float>());
    std::copy(par, par + 3, p.data<float>());
    be->sample_rows(x, p, Tensor(), ids);
    EXPECT_EQ(ids.data<int32_t>()[0], want) << "seed " << seed << " t " << t;
  }
  // Masked ids are never drawn: the largest logits sit in a masked tail (and one masked id inside).
  std::vector<float> l(V, 0.f);
  l[V - 1] = 50.f;
  l[3] = 50.f;
  Tensor mask = Tensor::empty(DType::U8, {V});
  for (int64_t i = 0; i < V; ++i) mask.data<uint8_t>()[i] = i >= 2000 || i == 3;
  Tensor x = Tensor::empty(DType::F32, {3, V}), p = Tensor::empty(DType::F32, {3, 3}),
         ids = Tensor::empty(DType::I32, {3});
  for (int r = 0; r < 3; ++r) std::copy(l.begin(), l.end(), x.data<float>() + r * V);
  const float par[9] = {0.f, 0.f, 1.f, 1.f, 0.999f, 1.f, 0.f, 0.f, 0.f};
  std::copy(par, par + 9, p.data<float>());
  be->sample_rows(x, p, mask, ids);
  EXPECT_EQ(ids.data<int32_t>()[0], 0);  // greedy: ties to the lowest unmasked id
  EXPECT_GE(ids.data<int32_t>()[1], 1990);
  EXPECT_LT(ids.data<int32_t>()[1], 2000);
  EXPECT_EQ(ids.data<int32_t>()[2], 3);  // a row without the mask
}
