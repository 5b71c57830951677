#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace hypic {

void validate(const SamplingParams& p) {
  if (!(p.temperature >= 0.f) || !std::isfinite(p.temperature))
    throw std::invalid_argument("temperature must be a finite number >= 0, got " + std::to_string(p.temperature));
  if (p.top_k < 0) throw std::invalid_argument("top_k must be >= 0, got " + std::to_string(p.top_k));
  if (!(p.top_p > 0.f && p.top_p <= 1.f))
    throw std::invalid_argument("top_p must be in (0, 1], got " + std::to_string(p.top_p));
}

Sampler::Sampler(SamplingParams p) : p_(p), rng_(p.seed) {
  validate(p_);
}

int32_t Sampler::sample(std::span<const float> logits) {
  const int32_t V = static_cast<int32_t>(logits.size());
  if (V == 0) throw std::invalid_argument("sample: empty logits");
  if (p_.temperature == 0.f) {
    // Ties go to the lowest id, as torch.argmax does.
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  scratch_.clear();
  scratch_.reserve(static_cast<size_t>(V));
  for (int32_t i = 0; i < V; ++i) scratch_.emplace_back(logits[static_cast<size_t>(i)] / p_.temperature, i);
  auto by_value = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  size_t n = scratch_.size();
  if (p_.top_k > 0 && static_cast<size_t>(p_.top_k) < n) {
    std::partial_sort(scratch_.begin(), scratch_.begin() + p_.top_k, scratch_.end(), by_value);
    n = static_cast<size_t>(p_.top_k);
  } else {
    std::sort(scratch_.begin(), scratch_.end(), by_value);
  }
  const double mx = scratch_[0].first;
  std::vector<double> prob(n);
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += prob[i] = std::exp(static_cast<double>(scratch_[i].first) - mx);
  if (p_.top_p < 1.f) {
    // Smallest prefix whose mass reaches top_p (at least one token).
    double acc = 0;
    size_t keep = n;
    for (size_t i = 0; i < n; ++i) {
      acc += prob[i] / sum;
      if (acc >= p_.top_p) {
        keep = i + 1;
        break;
      }
    }
    n = keep;
    sum = 0;
    for (size_t i = 0; i < n; ++i) sum += prob[i];
  }
  std::uniform_real_distribution<double> u(0.0, sum);
  double r = u(rng_), acc = 0;
  for (size_t i = 0; i < n; ++i) {
    acc += prob[i];
    if (r < acc) return scratch_[i].second;
  }
  return scratch_[n - 1].second;
}

void mask_ids(std::span<float> logits, std::span<const int32_t> ids) {
  for (int32_t id : ids)
    if (id >= 0 && static_cast<size_t>(id) < logits.size())
      logits[static_cast<size_t>(id)] = -std::numeric_limits<float>::infinity();
}

std::vector<float> log_softmax(std::span<const float> logits) {
  double mx = -std::numeric_limits<double>::infinity();
  for (float v : logits) mx = std::max(mx, static_cast<double>(v));
  double s = 0;
  for (float v : logits) s += std::exp(static_cast<double>(v) - mx);
  const double lse = mx + std::log(s);
  std::vector<float> out(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<float>(static_cast<double>(logits[i]) - lse);
  return out;
}

TokenLogprob token_logprob(std::span<const float> logits, int32_t id, int k) {
  std::vector<float> lp = log_softmax(logits);
  TokenLogprob r;
  r.id = id;
  r.logprob = lp.at(static_cast<size_t>(id));
  k = std::min<int>(k, static_cast<int>(lp.size()));
  if (k > 0) {
    std::vector<int32_t> idx(lp.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>(i);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
      return lp[static_cast<size_t>(a)] > lp[static_cast<size_t>(b)] ||
             (lp[static_cast<size_t>(a)] == lp[static_cast<size_t>(b)] && a < b);
    });
    for (int i = 0; i < k; ++i)
      r.top.emplace_back(idx[static_cast<size_t>(i)], lp[static_cast<size_t>(idx[static_cast<size_t>(i)])]);
  }
  return r;
}

}  // namespace hypic
