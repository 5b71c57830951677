#include "backend/moe_routing.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace hypic {

MoeRouting route_topk(const float* lg, int64_t T, int64_t E, int top_k, bool norm_topk) {
  MoeRouting r;
  r.tokens = T;
  r.experts = E;
  r.top_k = top_k;
  r.expert.resize(static_cast<size_t>(T * top_k));
  r.weight.resize(static_cast<size_t>(T * top_k));
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
  r.start.assign(static_cast<size_t>(E + 1), 0);
  for (auto e : r.expert) ++r.start[e + 1];
  for (int64_t e = 0; e < E; ++e) r.start[e + 1] += r.start[e];
  r.order.resize(static_cast<size_t>(T * top_k));
  std::vector<int64_t> fill(r.start.begin(), r.start.end() - 1);
  for (int64_t i = 0; i < T * top_k; ++i) r.order[fill[r.expert[i]]++] = i;
  return r;
}

}  // namespace hypic
