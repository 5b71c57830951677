#include "backend/moe_routing.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace hypic {

namespace {
// The selected slots grouped by expert (a counting sort: tokens keep their order within an expert).
void group_by_expert(MoeRouting& r) {
  const int64_t n = r.tokens * r.top_k;
  r.start.assign(static_cast<size_t>(r.experts + 1), 0);
  for (auto e : r.expert) ++r.start[e + 1];
  for (int64_t e = 0; e < r.experts; ++e) r.start[e + 1] += r.start[e];
  r.order.resize(static_cast<size_t>(n));
  std::vector<int64_t> fill(r.start.begin(), r.start.end() - 1);
  for (int64_t i = 0; i < n; ++i) r.order[fill[r.expert[i]]++] = i;
}

// A routing of T tokens to top_k of E experts, its slots not yet filled.
MoeRouting empty_routing(int64_t T, int64_t E, int top_k) {
  MoeRouting r;
  r.tokens = T;
  r.experts = E;
  r.top_k = top_k;
  r.expert.resize(static_cast<size_t>(T * top_k));
  r.weight.resize(static_cast<size_t>(T * top_k));
  return r;
}
}  // namespace

MoeRouting route_topk(const float* lg, int64_t T, int64_t E, int top_k, bool norm_topk) {
  MoeRouting r = empty_routing(T, E, top_k);
  std::vector<float> p(static_cast<size_t>(E));
  std::vector<int32_t> idx(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    const float* row = lg + t * E;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, row[e]);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(row[e] - mx));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    for (int64_t e = 0; e < E; ++e) idx[e] = static_cast<int32_t>(e);
    std::partial_sort(idx.begin(), idx.begin() + top_k, idx.end(),
                      [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float ws = 0.f;
    for (int j = 0; j < top_k; ++j) ws += p[idx[j]];
    for (int j = 0; j < top_k; ++j) {
      r.expert[t * top_k + j] = idx[j];
      r.weight[t * top_k + j] = norm_topk ? p[idx[j]] / ws : p[idx[j]];
    }
  }
  group_by_expert(r);
  return r;
}

MoeRouting route_sigmoid_grouped(const float* lg, const float* bias, int64_t T, int64_t E, int top_k, int64_t n_group,
                                 int64_t topk_group, bool norm_topk, float scaling) {
  MoeRouting r = empty_routing(T, E, top_k);
  const int64_t per = E / n_group;
  std::vector<float> score(static_cast<size_t>(E)), choice(static_cast<size_t>(E)), gsc(static_cast<size_t>(n_group));
  std::vector<int32_t> idx(static_cast<size_t>(std::max(E, n_group)));
  std::vector<uint8_t> keep(static_cast<size_t>(n_group));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      score[e] = 1.0f / (1.0f + std::exp(-lg[t * E + e]));
      choice[e] = score[e] + (bias ? bias[e] : 0.f);
    }
    for (int64_t g = 0; g < n_group; ++g) {
      float a = -INFINITY, b = -INFINITY;
      for (int64_t e = g * per; e < (g + 1) * per; ++e) {
        if (choice[e] > a)
          b = a, a = choice[e];
        else if (choice[e] > b)
          b = choice[e];
      }
      gsc[g] = per >= 2 ? a + b : a;
    }
    for (int64_t g = 0; g < n_group; ++g) idx[g] = static_cast<int32_t>(g);
    std::partial_sort(idx.begin(), idx.begin() + topk_group, idx.begin() + n_group,
                      [&](int32_t a, int32_t b) { return gsc[a] > gsc[b] || (gsc[a] == gsc[b] && a < b); });
    std::fill(keep.begin(), keep.end(), 0);
    for (int64_t g = 0; g < topk_group; ++g) keep[idx[g]] = 1;
    auto masked = [&](int32_t e) { return keep[e / per] ? choice[e] : -INFINITY; };
    for (int64_t e = 0; e < E; ++e) idx[e] = static_cast<int32_t>(e);
    std::partial_sort(idx.begin(), idx.begin() + top_k, idx.begin() + E,
                      [&](int32_t a, int32_t b) { return masked(a) > masked(b) || (masked(a) == masked(b) && a < b); });
    float ws = 0.f;
    for (int j = 0; j < top_k; ++j) ws += score[idx[j]];
    for (int j = 0; j < top_k; ++j) {
      r.expert[t * top_k + j] = idx[j];
      r.weight[t * top_k + j] = (norm_topk ? score[idx[j]] / (ws + 1e-20f) : score[idx[j]]) * scaling;
    }
  }
  group_by_expert(r);
  return r;
}

}  // namespace hypic
