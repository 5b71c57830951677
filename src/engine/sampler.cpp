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
  // Probabilities relative to the row's maximum; the row is never sorted whole: sorting 250k
  // logits per token costs ~20 ms, as much as a decode step of a large model.
  const float inv_t = 1.f / p_.temperature;
  float mx = -std::numeric_limits<float>::infinity();
  for (float v : logits) mx = std::max(mx, v);
  if (!std::isfinite(mx)) mx = 0;  // everything masked (-inf): no mass, the last id comes out
  auto weight = [&](float v) {     // unnormalised probability; NaN logits get none
    const float w = std::exp((v - mx) * inv_t);
    return w == w ? static_cast<double>(w) : 0.0;
  };
  auto draw = [&](double mass) { return uniform() * (mass > 0 ? mass : 1.0); };
  const bool cut_k = p_.top_k > 0 && p_.top_k < V;
  double total = 0;  // the mass the nucleus is measured against: the whole row, or the k best
  if (!cut_k) {
    weights_.resize(static_cast<size_t>(V));
    for (size_t i = 0; i < weights_.size(); ++i) total += weights_[i] = static_cast<float>(weight(logits[i]));
    if (p_.top_p >= 1.f) {
      // Plain temperature sampling: the draw against the running mass, in id order.
      const double r = draw(total);
      double acc = 0;
      for (int32_t i = 0; i < V; ++i) {
        acc += weights_[static_cast<size_t>(i)];
        if (r < acc) return i;
      }
      return V - 1;
    }
  }
  // top-k and/or top-p: candidates best first (ties to the lower id). A nucleus usually sits in
  // the first few hundred tokens, so those are ordered first and the rest only when needed.
  auto by_value = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  scratch_.clear();
  scratch_.reserve(static_cast<size_t>(V));
  for (int32_t i = 0; i < V; ++i) {
    const float v = logits[static_cast<size_t>(i)];
    scratch_.emplace_back(v == v ? v : -std::numeric_limits<float>::infinity(), i);
  }
  const size_t n = cut_k ? static_cast<size_t>(p_.top_k) : scratch_.size();
  size_t sorted = std::min<size_t>(n, 1024);
  auto order = [&](size_t from, size_t to) {
    std::partial_sort(scratch_.begin() + static_cast<ptrdiff_t>(from), scratch_.begin() + static_cast<ptrdiff_t>(to),
                      scratch_.end(), by_value);
  };
  order(0, sorted);
  if (cut_k) {
    if (sorted < n) order(sorted, n), sorted = n;
    for (size_t i = 0; i < n; ++i) total += weight(scratch_[i].first);
  }
  double sum = 0;
  size_t keep = n;
  for (size_t i = 0; i < n; ++i) {
    if (i == sorted) order(sorted, n), sorted = n;  // the first 1024 did not reach top_p
    sum += weight(scratch_[i].first);
    // Smallest prefix whose mass reaches top_p (at least one token).
    if (p_.top_p < 1.f && sum >= p_.top_p * total) {
      keep = i + 1;
      break;
    }
  }
  const double r = draw(sum);
  double acc = 0;
  for (size_t i = 0; i < keep; ++i) {
    acc += weight(scratch_[i].first);
    if (r < acc) return scratch_[i].second;
  }
  return scratch_[keep - 1].second;
}

double Sampler::uniform() {
  return std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
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
