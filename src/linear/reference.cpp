// fp64 sequential references for every family: the literal recurrence, token by token.
#include <cmath>
#include <vector>

#include "linear/recurrence.h"

namespace hypic::linear {

namespace {

void rope_rotate(double* x, int rot_dim, double theta, int64_t pos) {
  const int half = rot_dim / 2;
  for (int i = 0; i < half; ++i) {
    const double ang = double(pos) * std::pow(theta, -2.0 * i / rot_dim);
    const double c = std::cos(ang), sn = std::sin(ang);
    const double a = x[i], b = x[i + half];
    x[i] = a * c - b * sn;
    x[i + half] = b * c + a * sn;
  }
}

}  // namespace

void reference_forward(Family f, const RecShape& s, const RecInputs& in, double* state, double* out, double* dense_T) {
  const FamilyTraits tr = traits(f);
  const int64_t T = s.T, Hk = s.Hk, Hv = s.Hv, dk = s.dk, dv = s.dv, rep = Hv / Hk;
  std::vector<double> q(dk), k(dk), d(dk), u(dv), w(dk);
  for (int64_t h = 0; h < Hv; ++h) {
    const int64_t kh = h / rep;
    double* S = state + h * dk * dv;
    double* TT = dense_T ? dense_T + h * dk * dk : nullptr;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < dk; ++i) q[i] = in.q[(t * Hk + kh) * dk + i], k[i] = in.k[(t * Hk + kh) * dk + i];
      if (in.l2norm_qk) {
        double sq = 0, sk = 0;
        for (int64_t i = 0; i < dk; ++i) sq += q[i] * q[i], sk += k[i] * k[i];
        for (int64_t i = 0; i < dk; ++i) q[i] /= std::sqrt(sq + 1e-6), k[i] /= std::sqrt(sk + 1e-6);
      }
      for (int64_t i = 0; i < dk; ++i) q[i] *= in.q_scale;
      if (in.rope.rot_dim > 0) {
        rope_rotate(q.data(), in.rope.rot_dim, in.rope.theta, in.rope.start + t);
        rope_rotate(k.data(), in.rope.rot_dim, in.rope.theta, in.rope.start + t);
      }
      // D_t (diagonal over key channels)
      for (int64_t i = 0; i < dk; ++i) {
        switch (tr.decay) {
          case Decay::None:
            d[i] = 1.0;
            break;
          case Decay::FixedScalar:
            d[i] = std::exp(double(in.log_gamma[h]));
            break;
          case Decay::Scalar:
            d[i] = std::exp(double(in.g[t * Hv + h]));
            break;
          case Decay::Channel:
            d[i] = std::exp(double(in.g[(t * Hv + h) * dk + i]));
            break;
        }
      }
      const double b = tr.delta ? double(in.beta[t * Hv + h]) : 1.0;
      const float* vt = in.v + (t * Hv + h) * dv;
      // S <- D S; then (delta) S <- S - b k (k^T S); then S <- S + b k v^T.
      auto apply_A = [&](double* X, int64_t n) {
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < n; ++j) X[i * n + j] *= d[i];
        if (!tr.delta) return;
        std::vector<double> kx(n, 0.0);
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < n; ++j) kx[j] += k[i] * X[i * n + j];
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < n; ++j) X[i * n + j] -= b * k[i] * kx[j];
      };
      apply_A(S, dv);
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dv; ++j) S[i * dv + j] += b * k[i] * double(vt[j]);
      if (TT) apply_A(TT, dk);
      if (out) {
        double* o = out + (t * Hv + h) * dv;
        for (int64_t j = 0; j < dv; ++j) o[j] = 0;
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) o[j] += q[i] * S[i * dv + j];
      }
    }
  }
}

}  // namespace hypic::linear
