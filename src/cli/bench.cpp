// hypic bench prefill | decode: throughput figures as JSON plus a short table. Programs, not
// tests: they print measurements and assert nothing about them.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>

#include "cli/commands.h"
#include "engine/loader.h"

namespace hypic::cli {

namespace {
using Clock = std::chrono::steady_clock;
double secs(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Multiply-adds x 2 of the weight matmuls one token goes through (MoE: routed top-k plus the
// shared expert), plus the LM head.
double weight_flops_per_token(const ModelConfig& c) {
  const double H = static_cast<double>(c.hidden_size);
  double f = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (c.layer_types[static_cast<size_t>(i)] == LayerKind::Linear) {
      const double kd = c.linear_num_key_heads * c.linear_key_head_dim, vd = c.linear_num_value_heads * c.linear_value_head_dim;
      f += H * (2 * kd + 2 * vd + 2 * c.linear_num_value_heads) + vd * H;
    } else {
      const double qd = c.num_attention_heads * c.head_dim, kvd = c.num_key_value_heads * c.head_dim;
      f += H * (2 * qd + 2 * kvd) + qd * H;
    }
    if (c.layer_is_moe(i))
      f += H * c.num_experts + 3 * H * c.moe_intermediate_size * c.num_experts_per_tok +
           3 * H * c.shared_expert_intermediate_size + H;
    else
      f += 3 * H * c.intermediate_size;
  }
  return 2 * f;
}

// Token-mixing work that is not a weight matmul: GDN recurrence (~6 dk dv per value head per
// token: decay, read, write, output) and causal attention over `ctx` previous positions.
double mixer_flops_per_token(const ModelConfig& c, double ctx) {
  double f = 0;
  for (auto k : c.layer_types) {
    if (k == LayerKind::Linear)
      f += 6.0 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
    else
      f += 4.0 * c.num_attention_heads * c.head_dim * ctx;
  }
  return f;
}

// Measured f32 GEMM rate of this backend, the ceiling prefill efficiency is compared with.
double measure_gemm_gflops(Backend& be) {
  const int64_t M = 512, N = 1024, K = 1024;
  Tensor x = be.alloc(DType::F32, {M, K}), w = be.alloc(DType::F32, {N, K}), y = be.alloc(DType::F32, {M, N});
  be.fill(x, 0.5f);
  be.fill(w, 0.25f);
  be.matmul(x, w, y);
  double best = 0;
  for (int r = 0; r < 5; ++r) {
    auto t0 = Clock::now();
    be.matmul(x, w, y);
    be.synchronize();
    best = std::max(best, 2.0 * M * N * K / secs(t0, Clock::now()) / 1e9);
  }
  return best;
}

struct BenchOpts {
  std::string model = default_model_dir(), config, dtype = "bf16", backend = "cpu";
  bool random = false, json = false;
  int tokens = 512, repeats = 3, context = 128, threads = 0;
  uint64_t seed = 1;
};

LoadedModel open(const BenchOpts& o) {
  if (o.random || !o.config.empty()) {
    if (o.config.empty()) throw std::invalid_argument("--random-weights needs --config FILE");
    DType dt = o.dtype == "bf16" ? DType::BF16 : o.dtype == "f16" ? DType::F16 : o.dtype == "f32" ? DType::F32 : DType::U8;
    if (dt == DType::U8) throw std::invalid_argument("--dtype must be bf16, f16 or f32");
    return load_random_model(o.config, o.seed, dt, o.backend, o.threads);
  }
  return load_model(o.model, o.backend, o.threads);
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> d(0, vocab - 1);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& v : ids) v = static_cast<int32_t>(d(rng));
  return ids;
}

void add_common(CLI::App* c, BenchOpts& o) {
  c->add_option("--model", o.model, "Model folder")->capture_default_str();
  c->add_option("--config", o.config, "Bare config.json (with --random-weights)");
  c->add_flag("--random-weights", o.random, "Seeded random weights generated in memory");
  c->add_option("--dtype", o.dtype, "Weight dtype for --random-weights: bf16, f16, f32")->capture_default_str();
  c->add_option("--seed", o.seed, "Seed for weights and token ids")->capture_default_str();
  c->add_option("--repeats", o.repeats, "Timed repetitions (median reported)")->capture_default_str();
  c->add_option("--threads", o.threads, "CPU threads (0: all cores)");
  c->add_option("--backend", o.backend, "Compute backend")->capture_default_str();
  c->add_flag("--json", o.json, "Print JSON only");
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

void register_bench(CLI::App& app) {
  auto* b = app.add_subcommand("bench", "Throughput benchmarks (print figures)");
  b->require_subcommand(1);

  auto po = std::make_shared<BenchOpts>();
  auto* p = b->add_subcommand("prefill", "Prefill throughput and efficiency against measured GEMM");
  add_common(p, *po);
  p->add_option("--tokens", po->tokens, "Prompt length")->capture_default_str();
  p->callback([po] {
    guarded([&] {
      const auto& o = *po;
      if (o.tokens <= 0 || o.repeats <= 0) throw std::invalid_argument("--tokens and --repeats must be positive");
      LoadedModel lm = open(o);
      auto& m = *lm.model;
      const auto& cfg = m.config();
      auto ids = random_ids(o.tokens, cfg.vocab_size, o.seed);
      std::vector<double> times;
      for (int r = 0; r < o.repeats + 1; ++r) {  // first run warms caches and page-ins
        SequenceState st = m.new_state(o.tokens);
        auto t0 = Clock::now();
        Tensor lg = m.forward(ids, st);
        m.backend().synchronize();
        if (r > 0) times.push_back(secs(t0, Clock::now()));
      }
      const double t = median(times);
      const double flops = o.tokens * (weight_flops_per_token(cfg) + mixer_flops_per_token(cfg, o.tokens / 2.0));
      const double gemm = measure_gemm_gflops(m.backend());
      nlohmann::json j{{"bench", "prefill"},          {"model", lm.description},
                       {"backend", m.backend().name()}, {"threads", m.backend().num_threads()},
                       {"parameters", m.parameter_count()}, {"tokens", o.tokens},
                       {"seconds", t},                  {"tokens_per_s", o.tokens / t},
                       {"gflop", flops / 1e9},          {"gflops_per_s", flops / t / 1e9},
                       {"gemm_gflops_per_s", gemm},     {"efficiency", flops / t / 1e9 / gemm}};
      std::cout << j.dump(o.json ? -1 : 2) << "\n";
      if (!o.json)
        std::printf("prefill %d tokens: %.3f s, %.1f tok/s, %.1f GFLOP/s = %.0f%% of measured GEMM %.1f GFLOP/s\n",
                    o.tokens, t, o.tokens / t, flops / t / 1e9, 100 * flops / t / 1e9 / gemm, gemm);
    });
  });

  auto dopt = std::make_shared<BenchOpts>();
  dopt->tokens = 64;
  auto* d = b->add_subcommand("decode", "Decode throughput after a prompt of --context tokens");
  add_common(d, *dopt);
  d->add_option("--tokens", dopt->tokens, "Tokens to decode")->capture_default_str();
  d->add_option("--context", dopt->context, "Prompt length before decoding")->capture_default_str();
  d->callback([dopt] {
    guarded([&] {
      const auto& o = *dopt;
      if (o.tokens <= 0 || o.context <= 0 || o.repeats <= 0)
        throw std::invalid_argument("--tokens, --context and --repeats must be positive");
      LoadedModel lm = open(o);
      auto& m = *lm.model;
      const auto& cfg = m.config();
      auto ids = random_ids(o.context + o.tokens, cfg.vocab_size, o.seed);
      std::vector<double> times;
      for (int r = 0; r < o.repeats + 1; ++r) {
        SequenceState st = m.new_state(o.context + o.tokens);
        m.forward(std::span<const int32_t>(ids.data(), static_cast<size_t>(o.context)), st);
        auto t0 = Clock::now();
        for (int i = 0; i < o.tokens; ++i) {
          Tensor lg = m.forward(std::span<const int32_t>(ids.data() + o.context + i, 1), st);
          m.backend().to_host(lg);  // a real decode step reads its logits
        }
        if (r > 0) times.push_back(secs(t0, Clock::now()));
      }
      const double t = median(times);
      // Bytes one step must stream: every weight once (MoE: upper bound, all experts).
      const double gbps = m.weight_bytes() * o.tokens / t / 1e9;
      nlohmann::json j{{"bench", "decode"},
                       {"model", lm.description},
                       {"backend", m.backend().name()},
                       {"threads", m.backend().num_threads()},
                       {"parameters", m.parameter_count()},
                       {"context", o.context},
                       {"tokens", o.tokens},
                       {"seconds", t},
                       {"tokens_per_s", o.tokens / t},
                       {"ms_per_token", 1000 * t / o.tokens},
                       {"weight_bytes", m.weight_bytes()},
                       {"weight_gb_per_s", gbps}};
      std::cout << j.dump(o.json ? -1 : 2) << "\n";
      if (!o.json)
        std::printf("decode %d tokens after %d: %.2f ms/token, %.1f tok/s, weights streamed at %.2f GB/s\n", o.tokens,
                    o.context, 1000 * t / o.tokens, o.tokens / t, gbps);
    });
  });
}

}  // namespace hypic::cli
