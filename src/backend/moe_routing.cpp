#include "backend/moe_routing.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/checks.h"

namespace hypic {

using namespace checks;

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

int64_t check_moe_args(const Tensor& x, const Tensor& router_logits, int top_k, const ExpertWeights& experts,
                       const Tensor& out, DeviceKind dev) {
  const char* op = "moe_experts";
  need_f32(op, "x", x, dev);
  need_f32(op, "router_logits", router_logits, dev);
  need_f32(op, "out", out, dev);
  need_ndim(op, "x", x, 2);
  need_ndim(op, "router_logits", router_logits, 2);
  const int64_t T = x.dim(0), H = x.dim(1), E = router_logits.dim(1);
  if (router_logits.dim(0) != T)
    fail(op, "router_logits " + router_logits.str() + " and x " + x.str() + ": token counts differ");
  need_shape(op, "out", out, {T, H});
  if (top_k < 1 || top_k > E)
    fail(op, "top_k " + std::to_string(top_k) + " out of range for " + std::to_string(E) + " experts");
  if (static_cast<int64_t>(experts.gate.size()) != E || static_cast<int64_t>(experts.up.size()) != E ||
      static_cast<int64_t>(experts.down.size()) != E)
    fail(op, "expected " + std::to_string(E) + " experts in gate/up/down, got " + std::to_string(experts.gate.size()) +
                 "/" + std::to_string(experts.up.size()) + "/" + std::to_string(experts.down.size()));
  if (overlaps(out, x)) fail(op, "out overlaps x");
  int64_t I = -1;
  for (int64_t e = 0; e < E; ++e) {
    const Tensor &gt = experts.gate[e], &ut = experts.up[e], &dt = experts.down[e];
    need_float(op, "gate", gt, dev);
    need_float(op, "up", ut, dev);
    need_float(op, "down", dt, dev);
    if (gt.ndim() != 2 || gt.dim(1) != H || (I >= 0 && gt.dim(0) != I))
      fail(op, "expert " + std::to_string(e) + " gate " + gt.str() + " does not match x " + x.str());
    I = gt.dim(0);
    if (ut.shape() != gt.shape()) fail(op, "expert " + std::to_string(e) + " up " + ut.str() + " != gate " + gt.str());
    if (dt.shape() != Shape{H, I})
      fail(op, "expert " + std::to_string(e) + " down " + dt.str() + ": expected shape " + shape_str({H, I}));
  }
  return I;
}

}  // namespace hypic
