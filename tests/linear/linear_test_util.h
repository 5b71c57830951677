// Shared helpers for the linear-recurrence tests: seeded random inputs per family and norms.
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "linear/recurrence.h"

namespace hypic::linear::testing {

// Owns the buffers behind a RecInputs.
struct Case {
  Family family;
  RecShape shape;
  std::vector<float> q, k, v, g, beta, log_gamma;
  RecInputs in;
};

inline float softplus(float x) {
  return x > 20.f ? x : std::log1p(std::exp(x));
}

// strong: decays far beyond one chunk's factorisable range (channel families' exact path).
inline Case make_case(Family f, RecShape s, uint64_t seed, bool strong = false, int rot_dim = 0,
                      int64_t rope_start = 0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> N(0.f, 1.f);
  std::uniform_real_distribution<float> U(0.f, 1.f);
  Case c{f, s, {}, {}, {}, {}, {}, {}, {}};
  const FamilyTraits tr = traits(f);
  c.q.resize(s.T * s.Hk * s.dk);
  c.k.resize(s.T * s.Hk * s.dk);
  c.v.resize(s.T * s.Hv * s.dv);
  for (auto& x : c.q) x = N(rng);
  for (auto& x : c.k) x = N(rng);
  for (auto& x : c.v) x = N(rng);
  c.in.l2norm_qk = tr.delta;  // delta rules need |k| ~ 1 to stay contractive
  c.in.q_scale = 1.0f / std::sqrt(float(s.dk));
  if (!tr.delta) {  // plain families: keys scaled as after a projection, no norm
    for (auto& x : c.k) x *= 1.0f / std::sqrt(float(s.dk));
  }
  if (tr.delta) {
    c.beta.resize(s.T * s.Hv);
    for (auto& x : c.beta) x = 1.f / (1.f + std::exp(-N(rng)));
    c.in.beta = c.beta.data();
  }
  switch (tr.decay) {
    case Decay::FixedScalar:
      c.log_gamma.resize(s.Hv);
      for (int64_t h = 0; h < s.Hv; ++h) c.log_gamma[h] = std::log(1.f - std::exp2(-5.f - float(h % 8)));
      c.in.log_gamma = c.log_gamma.data();
      break;
    case Decay::Scalar: {
      // Mamba2 / Qwen GDN: g = -exp(A_log) * softplus(a + dt_bias), A_log ~ log U(1, 16).
      std::vector<float> A(s.Hv);
      for (auto& a : A) a = (strong ? 16.f : 1.f) * (1.f + 15.f * U(rng)) / 16.f;
      c.g.resize(s.T * s.Hv);
      for (int64_t t = 0; t < s.T; ++t)
        for (int64_t h = 0; h < s.Hv; ++h) c.g[t * s.Hv + h] = -A[h] * softplus(N(rng) - 2.f);
      c.in.g = c.g.data();
      break;
    }
    case Decay::Channel: {
      // GLA: logsigmoid(x) / 16; KDA: -exp(A_log) * softplus(x) per channel. strong: up to ~ -8.
      c.g.resize(s.T * s.Hv * s.dk);
      for (auto& x : c.g) {
        const float z = N(rng);
        x = strong ? -8.f * U(rng) * softplus(z) : -softplus(-z - 1.f) / 8.f;
      }
      c.in.g = c.g.data();
      break;
    }
    case Decay::None:
      break;
  }
  c.in.q = c.q.data();
  c.in.k = c.k.data();
  c.in.v = c.v.data();
  c.in.rope.rot_dim = rot_dim;
  c.in.rope.start = rope_start;
  return c;
}

inline double rel_l2(const float* a, const double* ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = double(a[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1e-300));
}
inline double rel_l2(const std::vector<float>& a, const std::vector<double>& ref) {
  return rel_l2(a.data(), ref.data(), ref.size());
}
inline double rel_l2f(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<double> d(b.begin(), b.end());
  return rel_l2(a, d);
}

inline std::vector<double> identity_dense(int64_t H, int64_t d) {
  std::vector<double> I(H * d * d, 0.0);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < d; ++i) I[(h * d + i) * d + i] = 1.0;
  return I;
}

}  // namespace hypic::linear::testing
