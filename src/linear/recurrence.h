// Every linear-attention family as one linear recurrence over a per-head state S [d_k, d_v]:
//
//   S_t = A_t S_{t-1} + B_t,   o_t = S_t^T q_t      (left multiplication, as backend.h)
//
// All seven families are instances of one "decayed (delta) rule":
//
//   S_t = (I - beta_t k_t k_t^T)^[delta] D_t S_{t-1} + b_t k_t v_t^T,   D_t = diag(exp(g_t))
//
// where the decay D_t is one of: none (I), a fixed per-head scalar (RetNet/Lightning), a
// data-dependent per-head scalar (Mamba2, Gated DeltaNet), or a data-dependent per-key-channel
// vector (GLA, KDA); the delta factor is present for DeltaNet, Gated DeltaNet and KDA, and
// b_t = beta_t for delta families, 1 otherwise. The decay is applied BEFORE the delta step,
// which is the published KDA order (Kimi Linear: S_t = (I - b k k^T) Diag(a_t) S_{t-1} + b k v^T,
// fla naive_recurrent_kda: S *= exp(g); S += k (beta (v - k^T S))^T); for scalar decays the two
// orders coincide. Mamba2 is expressed with k = B_t, v = dt_t x_t, q = C_t, g = dt_t A.
//
// The segment summary of a span C (tokens 1..L) is (T_C, S(C|0)) with T_C = A_L ... A_1, so that
// S_end = T_C S_0 + S(C|0). T_C is stored in the compact form its family allows (TStorage).
//
// Layout (plain host f32 memory, one sequence): q, k [T, Hk, dk]; v [T, Hv, dv]; key heads are
// repeat-interleaved over value heads (value head h reads key head h / (Hv / Hk));
// g [T, Hv] (scalar decay) or [T, Hv, dk] (channel decay); beta [T, Hv]; log_gamma [Hv];
// state [Hv, dk, dv]; out [T, Hv, dv]; dense transitions [Hv, dk, dk].
#pragma once
#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

namespace hypic::linear {

enum class Family { LinearAttention, Retention, Mamba2, GLA, DeltaNet, GatedDeltaNet, KDA };
inline constexpr Family kAllFamilies[] = {Family::LinearAttention, Family::Retention,     Family::Mamba2, Family::GLA,
                                          Family::DeltaNet,        Family::GatedDeltaNet, Family::KDA};

enum class Decay {
  None,         // D = I
  FixedScalar,  // D = gamma_h (log_gamma[h]); RetNet / Lightning (MiniMax, Ring)
  Scalar,       // D = exp(g[t, h])
  Channel,      // D = diag(exp(g[t, h, :]))
};

// Compact storage of T_C per head.
enum class TStorage {
  Identity,    // linear attention: T = I, nothing stored
  FromLength,  // RetNet: T = gamma_h^L I, only L (Summary::length) is stored
  LogScalar,   // Mamba2: one float per head, sum_t g_t  (T = exp(.) I)
  LogVector,   // GLA: dk floats per head, sum_t g_t per channel (T = diag(exp(.)))
  Dense,       // DeltaNet, Gated DeltaNet, KDA: dk x dk per head
};

struct FamilyTraits {
  Decay decay;
  bool delta;
  TStorage storage;
  std::string_view name;
};

constexpr FamilyTraits traits(Family f) {
  switch (f) {
    case Family::LinearAttention:
      return {Decay::None, false, TStorage::Identity, "linear_attention"};
    case Family::Retention:
      return {Decay::FixedScalar, false, TStorage::FromLength, "retention"};
    case Family::Mamba2:
      return {Decay::Scalar, false, TStorage::LogScalar, "mamba2"};
    case Family::GLA:
      return {Decay::Channel, false, TStorage::LogVector, "gla"};
    case Family::DeltaNet:
      return {Decay::None, true, TStorage::Dense, "deltanet"};
    case Family::GatedDeltaNet:
      return {Decay::Scalar, true, TStorage::Dense, "gated_deltanet"};
    case Family::KDA:
      return {Decay::Channel, true, TStorage::Dense, "kda"};
  }
  return {Decay::None, false, TStorage::Identity, "?"};
}

struct RecShape {
  int64_t T, Hk, Hv, dk, dv;
};

// RoPE inside the linear layer (Ring-linear style): NeoX half-split rotation of the first rot_dim
// dims of q and k, token t at absolute position start + t, angle pos * theta^(-2i/rot_dim).
struct RopeSpec {
  int rot_dim = 0;  // 0: no RoPE
  double theta = 10000.0;
  int64_t start = 0;
};

struct RecInputs {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* g = nullptr;          // log decay, Decay::Scalar [T,Hv] / Decay::Channel [T,Hv,dk]
  const float* beta = nullptr;       // [T,Hv], delta families
  const float* log_gamma = nullptr;  // [Hv], Decay::FixedScalar
  bool l2norm_qk = false;            // x * rsqrt(sum x^2 + 1e-6), before scaling and RoPE
  float q_scale = 1.0f;              // q multiplied by this after the norm
  RopeSpec rope;
};

// Spreads `workers` bodies over threads. Kernels spawn std::threads by default; a backend with a
// persistent pool installs its own for the calls made on this thread (ScopedRunner), so kernels
// reuse the pool instead of creating threads on every call (costly for decode steps).
using Runner = std::function<void(int64_t workers, const std::function<void(int64_t worker)>& body)>;
class ScopedRunner {
 public:
  explicit ScopedRunner(const Runner* r);
  ~ScopedRunner();
  ScopedRunner(const ScopedRunner&) = delete;
  ScopedRunner& operator=(const ScopedRunner&) = delete;

 private:
  const Runner* prev_;
};

// Floats of compact T storage for the family (0 for Identity / FromLength).
int64_t transition_floats(Family f, int64_t Hv, int64_t dk);

// Token-by-token forward ("decode step", usable for any T): state advanced in place, out [T,Hv,dv]
// (may be null). transition (compact, transition_floats) receives T of the span when non-null.
void recurrent_forward(Family f, const RecShape& s, const RecInputs& in, float* state, float* out, float* transition,
                       int threads = 1);

// Chunked (UT / WY) forward, same contract. chunk <= 0 picks the default (32, fastest measured on
// CPU; any size is exact). Channel decays use factorised products while the within-chunk log decay
// stays within +-60 and exact per-pair exponentials beyond. The transition is chained per chunk in
// the same pass (no second run). T == 1 takes the token-step path.
void chunked_forward(Family f, const RecShape& s, const RecInputs& in, float* state, float* out, float* transition,
                     int threads = 1, int chunk = 0);

// One head of chunked_forward on the calling thread (no transition): head h's rows, from
// state_h ([dk, dv]) advanced in place, out [T, Hv, dv] written for that head only. The same
// arithmetic as chunked_forward gives the head (the token step for T == 1), for callers that
// spread heads over threads themselves and run several calls per head in one go.
void chunked_forward_head(Family f, const RecShape& s, const RecInputs& in, int64_t h, float* state_h, float* out,
                          int chunk = 0);

// Segment summary: S(C|0) and compact T_C of a span, from the zero state, in one chunked pass
// that also writes the span's outputs when out is non-null.
struct Summary {
  Family family = Family::LinearAttention;
  int64_t Hv = 0, dk = 0, dv = 0, length = 0;
  std::vector<float> T;  // compact, transition_floats(family, Hv, dk)
  std::vector<float> S;  // [Hv, dk, dv]
};
Summary summarize(Family f, const RecShape& s, const RecInputs& in, float* out, int threads = 1, int chunk = 0);

// X <- T X for X [Hv, dk, n] (n columns: dv for states, dk for transitions), from compact T.
// log_gamma is needed only for TStorage::FromLength.
void apply_transition(Family f, int64_t Hv, int64_t dk, int64_t n, const float* T, int64_t length,
                      const float* log_gamma, float* X);
// S_out = T_C S_prefix + S(C|0)   ([Hv, dk, dv]; S_out may alias S_prefix).
void compose(const Summary& seg, const float* log_gamma, const float* S_prefix, float* S_out);
// Summary of `first` followed by `second`: (T2 T1, T2 S1 + S2), lengths added.
Summary compose(const Summary& first, const Summary& second, const float* log_gamma);
// Dense [Hv, dk, dk] form of a compact transition (for tests and for mixing storages).
std::vector<float> expand_transition(Family f, int64_t Hv, int64_t dk, const float* T, int64_t length,
                                     const float* log_gamma);

// RoPE inside the layer: a state computed with keys at segment-relative positions becomes the
// state at absolute start `start` by rotating its key axis: S <- R(start) S (per head, exact;
// scalar/fixed decay commutes with R). X is [H, dk, n].
void rerotate_state(float* X, int64_t H, int64_t dk, int64_t n, int64_t start, int rot_dim, double theta);

// ---- fp64 sequential references (naive, literal recurrence; next to every fast kernel) -------
// state [Hv,dk,dv] advanced in place; out [T,Hv,dv] (nullable); dense_T [Hv,dk,dk] (nullable) is
// left-multiplied by every A_t (pass identity to get T_C).
void reference_forward(Family f, const RecShape& s, const RecInputs& in, double* state, double* out, double* dense_T);

}  // namespace hypic::linear
