// MoE routing shared by the backends: softmax over router logits (f32), top-k (ties: lower expert
// index first), optional renormalisation, and the selected (token, slot) pairs grouped by expert
// (a counting sort, so tokens keep their order within an expert).
#pragma once
#include <cstdint>
#include <vector>

#include "backend/backend.h"

namespace hypic {

struct MoeRouting {
  int64_t tokens = 0, experts = 0;
  int top_k = 0;
  std::vector<int32_t> expert;  // [T * top_k]: chosen expert of slot i = token * top_k + j
  std::vector<float> weight;    // [T * top_k]: its routing weight
  std::vector<int64_t> start;   // [E + 1]: slots of expert e are order[start[e] .. start[e+1])
  std::vector<int64_t> order;   // [T * top_k]: slot indices grouped by expert
};

MoeRouting route_topk(const float* logits, int64_t T, int64_t E, int top_k, bool norm_topk);

}  // namespace hypic
