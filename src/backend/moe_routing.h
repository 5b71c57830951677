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

// DeepSeek-V3-style routing (Nemotron-H, Kimi-Linear): scores = sigmoid(logits); experts are chosen
// by score + bias[e] among the topk_group best of n_group groups (a group scored by its two best
// choices, its only one if it has one); the weights are the chosen scores, divided by their sum
// (+1e-20) when norm_topk, times `scaling`.
MoeRouting route_sigmoid_grouped(const float* logits, const float* bias, int64_t T, int64_t E, int top_k,
                                 int64_t n_group, int64_t topk_group, bool norm_topk, float scaling);

}  // namespace hypic
