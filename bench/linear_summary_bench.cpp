// Per linear-recurrence family: chunked forward time with and without the one-pass segment
// summary (T_C chained per chunk), the T_C overhead as a fraction of the forward, the token-step
// forward for comparison, achieved GFLOP/s of the chunked Gated DeltaNet forward, and one GDN
// decode step at the Qwen3.5-35B-A3B shape. Prints JSON, then a short table.
//   linear_summary_bench [T=2048] [heads=8] [d=128] [threads=1] [reps=7]
// Times are the best of `reps`; with threads == 1 they are process CPU time (robust on a shared
// machine), otherwise wall time.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "linear/gated_delta.h"
#include "linear/recurrence.h"

using namespace hypic::linear;

namespace {

bool g_cpu_time = true;

double now() {
  if (g_cpu_time) {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class F>
double best_of(int reps, F&& f) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
    f();
    best = std::min(best, now() - t0);
  }
  return best;
}

// FLOPs executed by the chunked kernel for one head-chunk of length C (delta family).
double gdn_chunk_flops(double C, double dk, double dv, bool with_T) {
  double f = 2 * (2 * C) * C * dk;         // [K; Q] K^T
  f += C * (C - 1) / 2 * (dk + dv) * 2;    // forward substitution
  f += 2 * C * dk * dv;                    // U = Uv - W S0
  f += 2 * C * dk * dv + 2 * C * C * dv;   // outputs
  f += 2 * dk * C * dv;                    // state update
  if (with_T) f += 2 * (2 * C * dk * dk);  // -W T, Kd^T (W T)
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 2048;
  const int64_t H = argc > 2 ? std::atoll(argv[2]) : 8;
  const int64_t d = argc > 3 ? std::atoll(argv[3]) : 128;
  const int threads = argc > 4 ? std::atoi(argv[4]) : 1;
  const int reps = argc > 5 ? std::atoi(argv[5]) : 7;
  g_cpu_time = threads == 1;
  const RecShape s{T, H, H, d, d};

  std::mt19937 rng(1);
  std::normal_distribution<float> N(0.f, 1.f);
  std::vector<float> q(T * H * d), k(T * H * d), v(T * H * d), gs(T * H), gc(T * H * d), beta(T * H), lg(H);
  for (auto* x : {&q, &k, &v})
    for (auto& y : *x) y = N(rng);
  for (auto& y : gs) y = -0.05f * std::log1p(std::exp(N(rng)));
  for (auto& y : gc) y = -std::log1p(std::exp(-N(rng) - 1.f)) / 8.f;
  for (auto& y : beta) y = 1.f / (1.f + std::exp(-N(rng)));
  for (int64_t h = 0; h < H; ++h) lg[h] = std::log1p(-std::exp2(-5.f - float(h)));

  struct Row {
    std::string name;
    double t_fwd, t_sum, t_step;
  };
  std::vector<Row> rows;
  std::vector<float> out(T * H * d), S(H * d * d), Tr(H * d * d);
  for (Family f : kAllFamilies) {
    const FamilyTraits tr = traits(f);
    RecInputs in;
    in.q = q.data(), in.k = k.data(), in.v = v.data();
    in.g = tr.decay == Decay::Channel ? gc.data() : gs.data();
    in.beta = beta.data();
    in.log_gamma = lg.data();
    in.l2norm_qk = tr.delta;
    in.q_scale = 1.f / std::sqrt(float(d));
    const bool has_T = transition_floats(f, H, d) > 0;
    auto run = [&](bool with_T) {
      std::fill(S.begin(), S.end(), 0.f);
      chunked_forward(f, s, in, S.data(), out.data(), with_T && has_T ? Tr.data() : nullptr, threads);
    };
    run(true);  // warm-up
    double tf = 1e30, ts = 1e30;
    for (int r = 0; r < reps; ++r) {  // interleaved, so load changes hit both alike
      tf = std::min(tf, best_of(1, [&] { run(false); }));
      ts = std::min(ts, best_of(1, [&] { run(true); }));
    }
    const double tstep = best_of(2, [&] {
      std::fill(S.begin(), S.end(), 0.f);
      recurrent_forward(f, s, in, S.data(), out.data(), nullptr, threads);
    });
    rows.push_back({std::string(tr.name), tf, ts, tstep});
  }

  // GDN through the engine entry point (Hk = H / 2 as in Qwen), FLOPs and GFLOP/s.
  const int64_t Hk = std::max<int64_t>(1, H / 2);
  auto gdn = [&](bool with_T) {
    std::fill(S.begin(), S.end(), 0.f);
    gated_delta_forward(GdnShape{T, Hk, H, d, d}, q.data(), k.data(), v.data(), gs.data(), beta.data(), true, S.data(),
                        out.data(), with_T ? Tr.data() : nullptr, threads);
  };
  gdn(true);
  double g_f = 1e30, g_s = 1e30;
  for (int r = 0; r < reps; ++r) {
    g_f = std::min(g_f, best_of(1, [&] { gdn(false); }));
    g_s = std::min(g_s, best_of(1, [&] { gdn(true); }));
  }
  double fl_f = 0, fl_s = 0;
  for (int64_t t0 = 0; t0 < T; t0 += 64) {
    const double C = double(std::min<int64_t>(64, T - t0));
    fl_f += double(H) * gdn_chunk_flops(C, double(d), double(d), false);
    fl_s += double(H) * gdn_chunk_flops(C, double(d), double(d), true);
  }

  // Decode: one token through gated_delta_forward at the Qwen3.5-35B-A3B GDN shape.
  const int64_t DK = 16, DV = 32, D = 128;
  std::vector<float> dq(DK * D), dkk(DK * D), dvv(DV * D), dg(DV, -0.05f), db(DV, 0.5f), dS(DV * D * D), dout(DV * D);
  for (auto* x : {&dq, &dkk, &dvv})
    for (auto& y : *x) y = N(rng);
  auto dec = [&] {
    for (int i = 0; i < 50; ++i)
      gated_delta_forward(GdnShape{1, DK, DV, D, D}, dq.data(), dkk.data(), dvv.data(), dg.data(), db.data(), true,
                          dS.data(), dout.data(), nullptr, threads);
  };
  dec();
  const double t_dec = best_of(reps, dec) / 50;

  std::printf(
      "{\"bench\":\"linear_summary\",\"T\":%lld,\"heads\":%lld,\"dk\":%lld,\"dv\":%lld,\"threads\":%d,"
      "\"clock\":\"%s\",\"families\":[",
      (long long)T, (long long)H, (long long)d, (long long)d, threads, g_cpu_time ? "cpu" : "wall");
  for (size_t i = 0; i < rows.size(); ++i)
    std::printf(
        "%s{\"family\":\"%s\",\"forward_ms\":%.3f,\"forward_with_summary_ms\":%.3f,\"overhead\":%.4f,"
        "\"token_step_ms\":%.3f}",
        i ? "," : "", rows[i].name.c_str(), rows[i].t_fwd * 1e3, rows[i].t_sum * 1e3, rows[i].t_sum / rows[i].t_fwd - 1,
        rows[i].t_step * 1e3);
  std::printf(
      "],\"gdn\":{\"Hk\":%lld,\"forward_ms\":%.3f,\"with_T_ms\":%.3f,\"overhead\":%.4f,\"gflop\":%.4f,"
      "\"gflop_with_T\":%.4f,\"gflops\":%.2f,\"gflops_with_T\":%.2f},"
      "\"gdn_decode\":{\"Hk\":16,\"Hv\":32,\"d\":128,\"us_per_token\":%.2f}}\n",
      (long long)Hk, g_f * 1e3, g_s * 1e3, g_s / g_f - 1, fl_f * 1e-9, fl_s * 1e-9, fl_f / g_f * 1e-9,
      fl_s / g_s * 1e-9, t_dec * 1e6);

  std::printf("\n%-18s %12s %14s %9s %14s\n", "family", "forward ms", "+summary ms", "T_C ovh", "token-step ms");
  for (auto& r : rows)
    std::printf("%-18s %12.2f %14.2f %8.1f%% %14.2f\n", r.name.c_str(), r.t_fwd * 1e3, r.t_sum * 1e3,
                100 * (r.t_sum / r.t_fwd - 1), r.t_step * 1e3);
  std::printf(
      "gated_delta_forward (Hk=%lld): %.2f ms (%.1f GFLOP/s), with T_C %.2f ms (%.1f GFLOP/s), overhead %.1f%%\n",
      (long long)Hk, g_f * 1e3, fl_f / g_f * 1e-9, g_s * 1e3, fl_s / g_s * 1e-9, 100 * (g_s / g_f - 1));
  std::printf("gated_delta_forward decode (T=1, 16 k / 32 v heads x 128): %.1f us per layer-token\n", t_dec * 1e6);
  return 0;
}
