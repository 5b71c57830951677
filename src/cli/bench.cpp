// hypic bench prefill | decode: throughput figures as JSON plus a short table. Programs, not
// tests: they print measurements and assert nothing about them.
#include <spdlog/spdlog.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "backend/cpu/blas_core.h"
#include "cli/commands.h"
#include "engine/loader.h"
#include "engine/sampler.h"
#include "eval/harness.h"
#include "pic/composer.h"

namespace hypic::cli {

namespace {

// Says once when OpenBLAS runs older kernels than this CPU allows (an OPENBLAS_CORETYPE from the
// environment stands): the f32 products of a CPU benchmark are then not what the machine can do.
void warn_if_blas_held_back(const Backend& be) {
  static bool said = false;
  const char* best = be.name() == "cpu" ? cpu::openblas_held_back() : nullptr;
  if (said || !best) return;
  said = true;
  spdlog::warn(
      "OpenBLAS runs its {} kernels where this CPU runs {} (OPENBLAS_CORETYPE={}): f32 products are "
      "slower than this machine allows; unset OPENBLAS_CORETYPE to let hypic choose",
      cpu::openblas_core(), best, std::getenv("OPENBLAS_CORETYPE") ? std::getenv("OPENBLAS_CORETYPE") : "");
}
using Clock = std::chrono::steady_clock;
double secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Measured GEMM rate of this backend, the ceiling prefill efficiency is compared with: f32 weights
// at 512x1024x1024 on the CPU; on a GPU, the model's weight dtype at 8192^3 on random values (large
// enough to fill the chip; zeros would run faster than real data).
double measure_gemm_gflops(Backend& be, DType wdt = DType::F32) {
  const bool gpu = be.device().kind != DeviceKind::CPU;
  const int64_t M = gpu ? 8192 : 512, N = gpu ? 8192 : 1024, K = gpu ? 8192 : 1024;
  if (!gpu) wdt = DType::F32;
  Tensor xh = Tensor::empty(DType::F32, {M, K}), wf = Tensor::empty(DType::F32, {N, K});
  uint64_t st = 12345;
  for (Tensor* t : {&xh, &wf})
    for (int64_t i = 0; i < t->numel(); ++i) {
      st = st * 6364136223846793005ull + 1442695040888963407ull;
      t->data<float>()[i] = static_cast<float>(static_cast<int64_t>(st >> 40) % 2001 - 1000) * 1e-3f;
    }
  Tensor wh = Tensor::empty(wdt, {N, K});
  convert_from_f32(wf.data<float>(), wdt, wh.raw(), static_cast<size_t>(wf.numel()));
  Tensor x = be.to_device(xh), w = be.to_device(wh), y = be.alloc(DType::F32, {M, N});
  be.matmul(x, w, y);
  be.synchronize();
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
  std::string model = default_model_dir(), config, dtype = "bf16", backend = "cpu", quantize, activations;
  bool random = false, json = false;
  int tokens = 512, repeats = 3, context = 128, threads = 0, batch = 1;
  std::string lengths, batches;  // several prefill lengths / decode batch sizes over one model load
  uint64_t seed = 1;
};

LoadedModel open(const BenchOpts& o) {
  LoadedModel lm;
  if (o.random || !o.config.empty()) {
    if (o.config.empty()) throw std::invalid_argument("--random-weights needs --config FILE");
    lm = load_random_model(o.config, o.seed, parse_weight_dtype(o.dtype, "--dtype"), o.backend, o.threads);
  } else {
    lm = load_model(o.model, o.backend, o.threads, quantize_option(o.quantize));
  }
  apply_activations_option(*lm.backend, o.activations);
  return lm;
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> d(0, vocab - 1);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& v : ids) v = static_cast<int32_t>(d(rng));
  return ids;
}

void add_common(CLI::App* c, BenchOpts& o) {
  c->add_option("--model", o.model, kModelHelp)->capture_default_str();
  c->add_option("--config", o.config, "Bare config.json (with --random-weights)");
  c->add_flag("--random-weights", o.random, "Seeded random weights generated in memory");
  c->add_option("--dtype", o.dtype, "Weight dtype for --random-weights: bf16, f16, f32, q8_0, q4_k, q6_k")
      ->capture_default_str();
  c->add_option("--quantize", o.quantize, "Quantize the matrices as they load: q8_0, q4_k or q6_k (CPU backend)");
  c->add_option("--activations", o.activations,
                "Activations of the products: f32 (exact) or bf16 (cuda's tensor cores; on the cpu oneDNN's "
                "AVX512_BF16 kernels; default: cpu f32, cuda bf16)");
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

// A synthetic RAG workload: a system prefix, N documents, and fresh questions; every request
// shuffles the documents, as retrieval does.
struct RagOpts {
  int segments = 16, segment_tokens = 512, query_tokens = 32, prefix_tokens = 32, requests = 5, seam = 8;
  int answer_tokens = 64;              // multi-turn: tokens of each earlier turn's answer
  std::string workload = "reordered";  // bench ttft: reordered | multi-turn
  std::string modes = "full,prefix,pic,naive", seams = "0,4,8,16,32";
  std::string task, set = "moderate";  // fidelity: held-out task prompts instead of random tokens
  double cache_mib = 8192;
  std::string transition_dtype = "auto";  // bench ttft: storage of entries' dense T (auto, f32, bf16)
};

struct RagWorkload {
  std::vector<int32_t> prefix;
  std::vector<std::vector<int32_t>> docs;
  std::mt19937_64 rng;
  int64_t vocab;
  int query_tokens;
  RagWorkload(const RagOpts& o, int64_t V, uint64_t seed) : rng(seed), vocab(V), query_tokens(o.query_tokens) {
    prefix = random_ids(o.prefix_tokens, V, rng());
    for (int i = 0; i < o.segments; ++i) docs.push_back(random_ids(o.segment_tokens, V, rng()));
  }
  // Documents in a fresh random order between the prefix and a fresh question.
  std::vector<std::vector<int32_t>> request(bool shuffle = true) {
    std::vector<std::vector<int32_t>> s{prefix};
    auto d = docs;
    if (shuffle) std::shuffle(d.begin(), d.end(), rng);
    s.insert(s.end(), d.begin(), d.end());
    s.push_back(random_ids(query_tokens, vocab, rng()));
    return s;
  }
};

// A conversation over a fixed set of documents: turn t sends the prefix, the documents (in the
// same order every turn), each earlier turn's question and answer (one segment per turn), then its
// own question. Every turn repeats the previous turn's prompt as its exact prefix.
struct MultiTurnWorkload {
  std::vector<std::vector<int32_t>> context;  // prefix, documents, earlier turns
  std::mt19937_64 rng;
  int64_t vocab;
  int query_tokens, answer_tokens;
  MultiTurnWorkload(const RagOpts& o, int64_t V, uint64_t seed)
      : rng(seed ^ 0x5bd1e995u), vocab(V), query_tokens(o.query_tokens), answer_tokens(o.answer_tokens) {
    RagWorkload docs(o, V, seed);  // the same prefix and documents as the reordered workload
    context.push_back(docs.prefix);
    context.insert(context.end(), docs.docs.begin(), docs.docs.end());
  }
  std::vector<std::vector<int32_t>> next_turn() {
    auto s = context;
    std::vector<int32_t> q = random_ids(query_tokens, vocab, rng());
    s.push_back(q);
    // The answer this turn gets is part of every later turn's context, with its question.
    std::vector<int32_t> a = random_ids(answer_tokens, vocab, rng());
    q.insert(q.end(), a.begin(), a.end());
    context.push_back(std::move(q));
    return s;
  }
};

void add_rag(CLI::App* c, RagOpts& r) {
  c->add_option("--segments", r.segments, "Documents per request")->capture_default_str();
  c->add_option("--segment-tokens", r.segment_tokens, "Tokens per document")->capture_default_str();
  c->add_option("--query-tokens", r.query_tokens, "Question tokens")->capture_default_str();
  c->add_option("--prefix-tokens", r.prefix_tokens, "System prefix tokens")->capture_default_str();
  c->add_option("--requests", r.requests, "Timed requests (shuffled documents; multi-turn: turns)")
      ->capture_default_str();
  c->add_option("--cache-budget-mib", r.cache_mib, "Segment cache budget")->capture_default_str();
}

void check_rag(const RagOpts& r) {
  if (r.segments <= 0 || r.segment_tokens <= 0 || r.query_tokens <= 0 || r.prefix_tokens <= 0 || r.requests <= 0 ||
      r.answer_tokens <= 0)
    throw std::invalid_argument(
        "--segments, --segment-tokens, --query-tokens, --prefix-tokens, --answer-tokens and --requests must be "
        "positive");
  if (r.workload != "reordered" && r.workload != "multi-turn")
    throw std::invalid_argument("unknown --workload '" + r.workload + "' (expected reordered or multi-turn)");
}

double rel_l2(Backend& be, const Tensor& a, const Tensor& ref) {
  Tensor x = be.to_host(a), y = be.to_host(ref);
  double num = 0, den = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double d = double(x.data<float>()[i]) - y.data<float>()[i];
    num += d * d;
    den += double(y.data<float>()[i]) * y.data<float>()[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Runs the question through every layer from a prefilled context, keeping each layer's output.
std::vector<Tensor> question_hidden(Model& m, SequenceState& st, const std::vector<int32_t>& q, Tensor& logits) {
  Backend& be = m.backend();
  Tensor x = m.embed(q);
  std::vector<Tensor> out;
  const int64_t pos = st.n_past;
  for (int64_t l = 0; l < m.config().num_hidden_layers; ++l) {
    m.layer_forward(l, x, st.layers[static_cast<size_t>(l)], pos);
    Tensor c = be.alloc(DType::F32, x.shape());
    be.copy(x, c);
    out.push_back(c);
  }
  st.n_past += static_cast<int64_t>(q.size());
  logits = m.logits(x.slice_rows(x.dim(0) - 1, x.dim(0)));
  return out;
}
}  // namespace

void register_bench(CLI::App& app) {
  auto* b = app.add_subcommand("bench", "Throughput benchmarks (print figures)");
  b->require_subcommand(1);

  auto po = std::make_shared<BenchOpts>();
  auto* p = b->add_subcommand("prefill", "Prefill throughput and efficiency against measured GEMM");
  add_common(p, *po);
  p->add_option("--tokens", po->tokens, "Prompt length")->capture_default_str();
  p->add_option("--lengths", po->lengths, "Several prompt lengths, e.g. 4096,32768 (one JSON object each)");
  auto warmup = std::make_shared<std::string>("each");
  p->add_option("--warmup", *warmup,
                "each: an untimed run before every length's; first: before the first length's only (a long "
                "prefill needs no warm-up of its own once the process has run one)")
      ->check(CLI::IsMember({"each", "first"}))
      ->capture_default_str();
  p->callback([po, warmup] {
    guarded([&] {
      const auto& o = *po;
      if (o.tokens <= 0 || o.repeats <= 0) throw std::invalid_argument("--tokens and --repeats must be positive");
      const std::vector<int> lens =
          o.lengths.empty() ? std::vector<int>{o.tokens} : parse_int_list(o.lengths, "--lengths", 1);
      LoadedModel lm = open(o);
      auto& m = *lm.model;
      const auto& cfg = m.config();
      const double gemm = measure_gemm_gflops(m.backend(), DType::BF16);  // once per model, not per length
      for (size_t li = 0; li < lens.size(); ++li) {
        const int n_tok = lens[li];
        auto ids = random_ids(n_tok, cfg.vocab_size, o.seed);
        std::vector<double> times;
        const int warm = li == 0 || *warmup == "each" ? 1 : 0;  // warms caches and page-ins
        for (int r = 0; r < o.repeats + warm; ++r) {
          SequenceState st = m.new_state(n_tok);
          auto t0 = Clock::now();
          Tensor lg = m.forward(ids, st);
          m.backend().synchronize();
          if (r >= warm) times.push_back(secs(t0, Clock::now()));
        }
        const double t = median(times);
        const double flops = n_tok * m.flops_per_token(n_tok / 2.0) + m.head_flops();  // logits: last row
        warn_if_blas_held_back(m.backend());
        nlohmann::json j{{"bench", "prefill"},
                         {"model", lm.description},
                         {"backend", m.backend().name()},
                         {"threads", m.backend().num_threads()},
                         {"activations", m.backend().precise() ? "f32" : "bf16"},
                         {"openblas_core", m.backend().name() == "cpu" ? cpu::openblas_core() : ""},
                         {"openblas_core_cpu",
                          m.backend().name() == "cpu" && cpu::openblas_cpu_core() ? cpu::openblas_cpu_core() : ""},
                         {"parameters", m.parameter_count()},
                         {"tokens", n_tok},
                         {"peak_device_bytes", m.backend().peak_memory_bytes()},
                         {"seconds", t},
                         {"tokens_per_s", n_tok / t},
                         {"gflop", flops / 1e9},
                         {"gflops_per_s", flops / t / 1e9},
                         {"gemm_gflops_per_s", gemm},
                         {"efficiency", flops / t / 1e9 / gemm}};
        std::cout << j.dump(o.json ? -1 : 2) << "\n";
        if (!o.json)
          std::printf("prefill %d tokens: %.3f s, %.1f tok/s, %.1f GFLOP/s = %.0f%% of measured GEMM %.1f GFLOP/s\n",
                      n_tok, t, n_tok / t, flops / t / 1e9, 100 * flops / t / 1e9 / gemm, gemm);
      }
    });
  });

  auto dopt = std::make_shared<BenchOpts>();
  dopt->tokens = 64;
  auto* d = b->add_subcommand("decode", "Decode throughput after a prompt of --context tokens");
  add_common(d, *dopt);
  d->add_option("--tokens", dopt->tokens, "Tokens to decode")->capture_default_str();
  d->add_option("--context", dopt->context, "Prompt length before decoding")->capture_default_str();
  d->add_option("--batch", dopt->batch, "Sequences decoded together (each after its own --context tokens)")
      ->capture_default_str();
  d->add_option("--batches", dopt->batches, "Several batch sizes, e.g. 1,32 (one JSON object each)");
  d->callback([dopt] {
    guarded([&] {
      const auto& o = *dopt;
      if (o.tokens <= 0 || o.context <= 0 || o.repeats <= 0 || o.batch <= 0)
        throw std::invalid_argument("--tokens, --context, --repeats and --batch must be positive");
      LoadedModel lm = open(o);
      auto& m = *lm.model;
      const auto& cfg = m.config();
      const std::vector<int> bs =
          o.batches.empty() ? std::vector<int>{o.batch} : parse_int_list(o.batches, "--batches", 1);
      int max_b = 0;
      for (int b : bs) max_b = std::max(max_b, b);
      auto ids = random_ids(o.context + int64_t(o.tokens) * max_b, cfg.vocab_size, o.seed);
      // The context is prefilled once; every sequence of the batch starts from a copy of its state.
      SequenceState ctx = m.new_state(o.context + o.tokens);
      m.forward(std::span<const int32_t>(ids.data(), static_cast<size_t>(o.context)), ctx);
      for (const int B : bs) {
        std::vector<double> times;
        for (int r = 0; r < o.repeats + 1; ++r) {
          std::vector<SequenceState> st;
          for (int b = 0; b < B; ++b) st.push_back(m.clone_state(ctx));
          Tensor picked = m.backend().alloc(DType::I32, {B});
          m.backend().synchronize();
          auto t0 = Clock::now();
          for (int i = 0; i < o.tokens; ++i) {
            if (B == 1) {
              Tensor lg = m.forward(std::span<const int32_t>(ids.data() + o.context + i, 1), st[0]);
              m.backend().argmax_rows(lg, picked);  // a real (greedy) step reads back its token
              m.backend().to_host(picked);
            } else {
              std::vector<BatchItem> items;
              for (int b = 0; b < B; ++b)
                items.push_back({&st[static_cast<size_t>(b)],
                                 std::span<const int32_t>(ids.data() + o.context + int64_t(i) * B + b, 1)});
              m.backend().argmax_rows(m.forward_batch(items), picked);
              m.backend().to_host(picked);
            }
          }
          if (r > 0) times.push_back(secs(t0, Clock::now()));
        }
        const double t = median(times);
        // Bytes one step must stream: the weights it reads (routed experts at the share a batch
        // of B selects), once per step.
        const double step_bytes = m.step_weight_bytes(B);
        const double gbps = step_bytes * o.tokens / t / 1e9;
        warn_if_blas_held_back(m.backend());
        nlohmann::json j{{"bench", "decode"},
                         {"model", lm.description},
                         {"backend", m.backend().name()},
                         {"threads", m.backend().num_threads()},
                         {"activations", m.backend().precise() ? "f32" : "bf16"},
                         {"openblas_core", m.backend().name() == "cpu" ? cpu::openblas_core() : ""},
                         {"openblas_core_cpu",
                          m.backend().name() == "cpu" && cpu::openblas_cpu_core() ? cpu::openblas_cpu_core() : ""},
                         {"parameters", m.parameter_count()},
                         {"context", o.context},
                         {"batch", B},
                         {"tokens", o.tokens},
                         {"peak_device_bytes", m.backend().peak_memory_bytes()},
                         {"seconds", t},
                         {"tokens_per_s", double(o.tokens) * B / t},
                         {"ms_per_token", 1000 * t / o.tokens},
                         {"weight_bytes", m.weight_bytes()},
                         {"step_weight_bytes", step_bytes},
                         {"weight_gb_per_s", gbps}};
        std::cout << j.dump(o.json ? -1 : 2) << "\n";
        if (!o.json)
          std::printf("decode %d tokens after %d: %.2f ms/token, %.1f tok/s, weights read at %.2f GB/s\n", o.tokens,
                      o.context, 1000 * t / o.tokens, o.tokens / t, gbps);
      }
    });
  });

  auto to = std::make_shared<BenchOpts>();
  auto tr = std::make_shared<RagOpts>();
  auto* t = b->add_subcommand(
      "ttft", "Time to first token per mode: warm RAG requests with shuffled documents, or a multi-turn conversation");
  add_common(t, *to);
  add_rag(t, *tr);
  t->add_option("--workload", tr->workload,
                "reordered: every request shuffles the documents; multi-turn: a conversation over the documents "
                "growing by one turn per request")
      ->capture_default_str();
  t->add_option("--answer-tokens", tr->answer_tokens, "multi-turn: answer tokens of each earlier turn")
      ->capture_default_str();
  t->add_option("--modes", tr->modes,
                "Modes to compare: full, prefix, pic, naive, and pic-host / pic-disk (pic with the entries in the "
                "host tier / on disk at each request)")
      ->capture_default_str();
  t->add_option("--seam", tr->seam, "Seam width for pic")->capture_default_str();
  t->add_option("--transition-dtype", tr->transition_dtype,
                "Storage of entries' dense transitions T: auto (bf16 on a GPU outside precise mode, else f32), f32, "
                "bf16")
      ->capture_default_str();
  auto sweep = std::make_shared<std::string>();
  t->add_option("--sweep-segments", *sweep,
                "Comma-separated document counts run one after another on the one loaded model (one result per "
                "count; overrides --segments)");
  t->callback([to, tr, sweep] {
    guarded([&] {
      const auto& o = *to;
      check_rag(*tr);
      std::vector<int> counts =
          sweep->empty() ? std::vector<int>{tr->segments} : parse_int_list(*sweep, "--sweep-segments", 1);
      // pic-host / pic-disk: pic with every entry moved to the host tier / dropped to the disk tier
      // before each timed request (not timed), so that the request copies them back.
      struct Mode {
        std::string name, tier;
        PicMode mode;
      };
      std::vector<Mode> modes;
      for (auto& m : split_csv(tr->modes)) {
        const bool tiered = m == "pic-host" || m == "pic-disk";
        modes.push_back({m, tiered ? m.substr(4) : "", parse_pic_mode(tiered ? "pic" : m)});
      }
      const auto t_dtype = tr->transition_dtype == "auto"  ? PicEngine::TransitionDType::Auto
                           : tr->transition_dtype == "f32" ? PicEngine::TransitionDType::F32
                           : tr->transition_dtype == "bf16"
                               ? PicEngine::TransitionDType::BF16
                               : throw std::invalid_argument("--transition-dtype must be auto, f32 or bf16, not '" +
                                                             tr->transition_dtype + "'");
      LoadedModel lm = open(o);
      auto& m = *lm.model;
      for (int count : counts) {
        RagOpts ro = *tr;
        ro.segments = count;
        nlohmann::json res = nlohmann::json::array();
        std::map<std::string, double> med;
        const bool multi_turn = ro.workload == "multi-turn";
        for (const Mode& md : modes) {
          // Same documents, orders and turns for every mode.
          RagWorkload w(ro, m.config().vocab_size, o.seed);
          MultiTurnWorkload conv(ro, m.config().vocab_size, o.seed);
          const size_t budget = static_cast<size_t>(ro.cache_mib * 1048576.0);
          PicEngine eng(m, budget);
          eng.set_transition_dtype(t_dtype);
          std::string disk_dir;
          if (md.tier == "host") eng.attach_host_tier(budget);
          if (md.tier == "disk") {
            std::string tmpl = (std::filesystem::temp_directory_path() / "hypic_bench_XXXXXX").string();
            if (!mkdtemp(tmpl.data())) throw std::runtime_error("pic-disk: cannot make a folder for the segment files");
            disk_dir = tmpl;
            eng.attach_cache_dir(disk_dir);
          }
          struct RemoveDir {
            std::string d;
            ~RemoveDir() {
              std::error_code ec;
              if (!d.empty()) std::filesystem::remove_all(d, ec);
            }
          } remove_dir{disk_dir};
          PicOptions po{md.mode, ro.seam};
          // Warm-up: every document seen once (multi-turn: the conversation's first turn).
          eng.prefill(multi_turn ? conv.next_turn() : w.request(false), po);
          std::vector<double> ttft;
          std::vector<double> computed, cached;
          m.backend().profile_reset();  // a profile (HYPIC_CUDA_PROFILE) of the timed requests only
          for (int r = 0; r < ro.requests; ++r) {
            auto segs = multi_turn ? conv.next_turn() : w.request();
            if (md.tier == "host") eng.cache().demote_all();
            if (md.tier == "disk") eng.cache().clear();  // the files stay (in the OS page cache, too)
            m.backend().synchronize();
            auto t0 = Clock::now();
            PrefillResult pr = eng.prefill(segs, po);
            Tensor h = m.backend().to_host(pr.logits);
            Sampler({}).sample(std::span<const float>(h.data<float>(), static_cast<size_t>(h.numel())));
            ttft.push_back(secs(t0, Clock::now()) * 1000);
            computed.push_back(static_cast<double>(pr.report.computed_tokens));
            cached.push_back(static_cast<double>(pr.report.reused_tokens));
          }
          const double mt = median(ttft);
          med[md.name] = mt;
          const SegmentCacheStats cs = eng.cache().stats();
          res.push_back({{"mode", md.name},
                         {"host_hits", cs.host_hits},
                         {"disk_hits", cs.disk_hits},
                         {"ttft_ms_median", mt},
                         {"ttft_ms", ttft},
                         {"computed_tokens_median", median(computed)},
                         {"cached_tokens_median", median(cached)},
                         {"cache_bytes", cs.bytes}});
        }
        // Multi-turn: the last timed turn's prompt (it carries one earlier turn per timed request).
        const int64_t prompt = ro.prefix_tokens + int64_t(ro.segments) * ro.segment_tokens + ro.query_tokens +
                               (multi_turn ? int64_t(ro.requests) * (ro.query_tokens + ro.answer_tokens) : 0);
        nlohmann::json j{{"bench", "ttft"},
                         {"workload", ro.workload},
                         {"model", lm.description},
                         {"threads", m.backend().num_threads()},
                         {"segments", ro.segments},
                         {"segment_tokens", ro.segment_tokens},
                         {"query_tokens", ro.query_tokens},
                         {"prefix_tokens", ro.prefix_tokens},
                         {"prompt_tokens", prompt},
                         {"seam", ro.seam},
                         {"transition_dtype", ro.transition_dtype},
                         {"requests", ro.requests},
                         {"answer_tokens", multi_turn ? nlohmann::json(ro.answer_tokens) : nlohmann::json()},
                         {"modes", res}};
        if (med.count("prefix") && med.count("pic")) j["prefix_over_pic"] = med["prefix"] / med["pic"];
        if (med.count("full") && med.count("pic")) j["full_over_pic"] = med["full"] / med["pic"];
        std::cout << j.dump(o.json ? -1 : 2) << "\n";
        if (!o.json) {
          std::printf("workload %s\n%-8s %14s %16s %14s\n", ro.workload.c_str(), "mode", "TTFT p50 (ms)",
                      "computed tokens", "cached tokens");
          for (auto& e : res)
            std::printf("%-8s %14.1f %16.0f %14.0f\n", e["mode"].get<std::string>().c_str(),
                        e["ttft_ms_median"].get<double>(), e["computed_tokens_median"].get<double>(),
                        e["cached_tokens_median"].get<double>());
          if (j.contains("prefix_over_pic"))
            std::printf("prefix / pic TTFT: %.2fx\n", j["prefix_over_pic"].get<double>());
        }
        std::cout.flush();
      }
    });
  });

  // What the segment summary costs (issue 11): the linear layers' transition operator T_C comes out
  // of the same pass as their state and outputs. Three levels: the recurrence op alone, one whole
  // linear decoder layer, and a whole entry build against a plain prefill of the same tokens from
  // position 0 (the work an entry adds to the prefill it replaces: T_C and keeping the summary).
  auto eo = std::make_shared<BenchOpts>();
  eo->tokens = 2048;
  eo->repeats = 5;
  auto eseam = std::make_shared<int>(8);
  auto* en = b->add_subcommand("entry",
                               "Cost of building a segment entry: T_C in the linear layers' pass, and a "
                               "whole entry build against a plain prefill of the same tokens");
  add_common(en, *eo);
  en->add_option("--tokens", eo->tokens, "Segment length")->capture_default_str();
  en->add_option("--seam", *eseam, "Seam width of the entry")->capture_default_str();
  en->callback([eo, eseam] {
    guarded([&] {
      const auto& o = *eo;
      if (o.tokens <= 0 || o.repeats <= 0) throw std::invalid_argument("--tokens and --repeats must be positive");
      LoadedModel lm = open(o);
      auto& m = *lm.model;
      Backend& be = m.backend();
      const auto& cfg = m.config();
      const int64_t n = o.tokens;
      if (std::string(arch_spec(cfg.arch).linear_family) != "gated_deltanet")
        throw std::invalid_argument("bench entry times the Gated DeltaNet recurrence; the linear layers of " +
                                    cfg.architecture + " are " + arch_spec(cfg.arch).linear_family);
      const auto lin = std::find(cfg.layer_types.begin(), cfg.layer_types.end(), LayerKind::Linear);
      if (lin == cfg.layer_types.end()) throw std::invalid_argument("the model has no linear layer");
      const int64_t li = lin - cfg.layer_types.begin();
      // Medians over repeats of a() and of b(), run alternately (so that drift of the machine falls on
      // both) after one warm-up round; prep() runs untimed before each.
      auto ab = [&](auto&& prep, auto&& a, auto&& b) {
        std::vector<double> ta, tb;
        auto one = [&](auto&& f) {
          prep();
          be.synchronize();
          auto t0 = Clock::now();
          f();
          be.synchronize();
          return secs(t0, Clock::now());
        };
        for (int r = 0; r <= o.repeats; ++r) {
          const double x = one(a), y = one(b);
          if (r > 0) ta.push_back(x), tb.push_back(y);
        }
        return std::pair{median(ta), median(tb)};
      };
      // 1. The recurrence alone at this model's linear-layer shape, inputs as the layer gives them.
      const int64_t Hk = cfg.linear_num_key_heads, Hv = cfg.linear_num_value_heads, dk = cfg.linear_key_head_dim,
                    dv = cfg.linear_value_head_dim;
      auto host_rand = [&](Shape s, float lo, float hi, uint64_t seed) {
        Tensor t = Tensor::empty(DType::F32, std::move(s));
        std::mt19937_64 rng(seed);
        std::uniform_real_distribution<float> d(lo, hi);
        for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = d(rng);
        return be.to_device(t);
      };
      Tensor q = host_rand({n, Hk, dk}, -1, 1, 1), k = host_rand({n, Hk, dk}, -1, 1, 2),
             v = host_rand({n, Hv, dv}, -1, 1, 3), g = host_rand({n, Hv}, -0.2f, -0.001f, 4),
             beta = host_rand({n, Hv}, 0.05f, 0.95f, 5), out = be.alloc(DType::F32, {n, Hv, dv});
      Tensor S = be.alloc(DType::F32, {Hv, dk, dv}), T = be.alloc(DType::F32, {Hv, dk, dk});
      auto zero_state = [&] { be.fill(S, 0.f); };
      const auto [op_plain, op_t] = ab(
          zero_state, [&] { be.gated_delta_rule(q, k, v, g, beta, true, S, out); },
          [&] { be.gated_delta_rule(q, k, v, g, beta, true, S, out, &T); });
      // 2. One linear decoder layer (norms, projections, conv, recurrence, MLP or MoE).
      Tensor x0 = m.embed(random_ids(n, cfg.vocab_size, o.seed)), x = be.alloc(x0.dtype(), x0.shape());
      SequenceState lst;
      auto layer_prep = [&] {
        lst = m.new_state(n);
        be.copy(x0, x);
      };
      const auto [layer_plain, layer_t] = ab(
          layer_prep, [&] { m.layer_forward(li, x, lst.layers[li], 0); },
          [&] { m.layer_forward(li, x, lst.layers[li], 0, &T); });
      // 3. A whole entry build against a plain prefill of the same tokens.
      const auto ids = random_ids(n, cfg.vocab_size, o.seed + 1);
      SequenceState st;
      PicEngine eng(m, 1 << 20);
      std::shared_ptr<SegmentEntry> e, last;
      const auto [prefill, build] = ab([&] { st = m.new_state(n), e.reset(); }, [&] { m.forward(ids, st); },
                                       [&] { last = e = eng.build_entry(ids, *eseam); });
      const int64_t linear_layers = std::count(cfg.layer_types.begin(), cfg.layer_types.end(), LayerKind::Linear);
      // T_C's own work in a whole build: the op's difference in every linear layer.
      const double t_in_build = (op_t - op_plain) * static_cast<double>(linear_layers);
      nlohmann::json j{{"bench", "entry"},
                       {"model", lm.description},
                       {"backend", be.name()},
                       {"activations", be.precise() ? "f32" : "bf16"},
                       {"tokens", n},
                       {"seam", *eseam},
                       {"linear_layers", linear_layers},
                       {"entry_mib", static_cast<double>(last ? last->bytes : 0) / 1048576.0},
                       {"op_ms", op_plain * 1e3},
                       {"op_with_T_ms", op_t * 1e3},
                       {"op_overhead", op_t / op_plain - 1},
                       {"layer_ms", layer_plain * 1e3},
                       {"layer_with_T_ms", layer_t * 1e3},
                       {"layer_overhead", layer_t / layer_plain - 1},
                       {"prefill_ms", prefill * 1e3},
                       {"entry_build_ms", build * 1e3},
                       {"entry_build_overhead", build / prefill - 1},
                       {"T_share_of_build", t_in_build / build}};
      std::cout << j.dump(o.json ? -1 : 2) << "\n";
      if (!o.json) {
        std::printf("%d tokens, %s, %s activations\n", o.tokens, be.name().c_str(), be.precise() ? "f32" : "bf16");
        std::printf("%-44s %10s %10s %9s\n", "", "plain ms", "with T ms", "overhead");
        std::printf("%-44s %10.3f %10.3f %8.1f%%\n", "gated delta rule (one layer)", op_plain * 1e3, op_t * 1e3,
                    100 * (op_t / op_plain - 1));
        std::printf("%-44s %10.3f %10.3f %8.1f%%\n", "linear decoder layer", layer_plain * 1e3, layer_t * 1e3,
                    100 * (layer_t / layer_plain - 1));
        std::printf("%-44s %10.3f %10.3f %8.1f%%\n", "entry build vs plain prefill", prefill * 1e3, build * 1e3,
                    100 * (build / prefill - 1));
        std::printf("T_C's op time x %lld linear layers = %.1f%% of the entry build\n",
                    static_cast<long long>(linear_layers), 100 * t_in_build / build);
      }
    });
  });

  auto fo = std::make_shared<BenchOpts>();
  auto fr = std::make_shared<RagOpts>();
  fr->segments = 8;
  fr->segment_tokens = 256;
  fr->requests = 4;
  auto* f = b->add_subcommand("fidelity", "Per-layer drift of pic/naive/prefix against full at the question tokens");
  add_common(f, *fo);
  add_rag(f, *fr);
  f->add_option("--seams", fr->seams, "Seam widths for pic")->capture_default_str();
  f->add_option("--modes", fr->modes, "Modes besides full")->capture_default_str();
  f->add_option("--task", fr->task,
                "Measure on held-out task prompts (lookup, twohop, aggregate; the model's own tokenizer) "
                "instead of random-token documents");
  f->add_option("--set", fr->set, "Held-out set for --task: smoke, moderate, long, full")->capture_default_str();
  f->callback([fo, fr] {
    guarded([&] {
      const auto& o = *fo;
      const auto& ro = *fr;
      check_rag(ro);
      LoadedModel lm = open(o);
      auto& m = *lm.model;
      Backend& be = m.backend();
      struct Config {
        std::string name;
        PicOptions opt;
        PicEngine::EntryRounding rounding = PicEngine::EntryRounding::None;
        PicEngine::TransitionDType t_dtype = PicEngine::TransitionDType::Auto;
      };
      std::vector<Config> configs;
      for (auto& ms : split_csv(ro.modes)) {
        PicMode mode = parse_pic_mode(ms);
        if (mode == PicMode::Full) continue;
        if (mode == PicMode::Pic) {
          const std::vector<int> ws = parse_int_list(ro.seams, "--seams", 0);
          for (int w : ws) configs.push_back({"pic/seam=" + std::to_string(w), {mode, w}});
          // Both-ends seams at the largest width, and pic without RoPE re-rotation at seam 8.
          PicOptions be{mode, ws.back()};
          be.tail_seam = be.seam;
          configs.push_back({"pic/both-ends=" + std::to_string(ws.back()), be});
          PicOptions nr{mode, 8};
          nr.rerotate = false;
          configs.push_back({"pic/no-rerotate", nr});
          // The dtype of stored transitions T (issue 11's choice: bf16 on the GPU, f32 on the CPU by
          // default; both here on either backend), then every entry tensor rounded to bf16 values.
          const std::string at = "=" + std::to_string(ws.back());
          const auto none = PicEngine::EntryRounding::None;
          configs.push_back({"pic/T-f32" + at, {mode, ws.back()}, none, PicEngine::TransitionDType::F32});
          configs.push_back({"pic/T-bf16" + at, {mode, ws.back()}, none, PicEngine::TransitionDType::BF16});
          configs.push_back({"pic/entry-bf16" + at, {mode, ws.back()}, PicEngine::EntryRounding::All});
        } else
          configs.push_back({ms, {mode, 0}});
      }
      RagWorkload w(ro, m.config().vocab_size, o.seed);
      // Each request, and the same request with its documents in another order (served first, so
      // that every document is cached from a different position).
      std::vector<std::vector<std::vector<int32_t>>> requests, warm;
      if (ro.task.empty()) {
        for (int r = 0; r < ro.requests; ++r) requests.push_back(w.request());
        warm.push_back(w.request());
      } else {
        if (!lm.tokenizer) throw std::invalid_argument("--task needs a model folder with tokenizer.json");
        eval::SetSpec spec = eval::eval_set(ro.set);
        spec.n = ro.requests;
        for (const auto& ex : eval::generate_examples(ro.task, spec)) {
          requests.push_back(eval::prompt_segments(*lm.tokenizer, ex));
          auto r = requests.back();
          if (r.size() > 3) std::reverse(r.begin() + 1, r.end() - 1);
          warm.push_back(std::move(r));
        }
      }
      const size_t L = static_cast<size_t>(m.config().num_hidden_layers);
      nlohmann::json rows = nlohmann::json::array();
      for (auto& cfg : configs) {
        PicEngine eng(m, static_cast<size_t>(ro.cache_mib * 1048576.0)), ref(m, 1 << 20);
        eng.set_entry_rounding(cfg.rounding);
        eng.set_transition_dtype(cfg.t_dtype);
        PicOptions opt = cfg.opt;
        opt.skip_question = true;
        for (auto& segs : warm) eng.prefill(segs, opt);  // warm: documents seen before in another order
        std::vector<double> drift(L, 0.0);
        double kl = 0, agree = 0;
        for (auto& segs : requests) {
          PrefillResult pf = ref.prefill(segs, PicOptions{.mode = PicMode::Full, .seam = 0, .skip_question = true});
          PrefillResult pm = eng.prefill(segs, opt);
          Tensor lf, lmo;
          auto hf = question_hidden(m, pf.state, segs.back(), lf);
          auto hm = question_hidden(m, pm.state, segs.back(), lmo);
          for (size_t l = 0; l < L; ++l) drift[l] += rel_l2(be, hm[l], hf[l]) / requests.size();
          Tensor a = be.to_host(lf), bb = be.to_host(lmo);
          auto pa = log_softmax(std::span<const float>(a.data<float>(), static_cast<size_t>(a.numel())));
          auto pb = log_softmax(std::span<const float>(bb.data<float>(), static_cast<size_t>(bb.numel())));
          double k = 0;
          for (size_t i = 0; i < pa.size(); ++i) k += std::exp(double(pa[i])) * (double(pa[i]) - pb[i]);
          kl += k / requests.size();
          agree += (std::max_element(pa.begin(), pa.end()) - pa.begin() ==
                    std::max_element(pb.begin(), pb.end()) - pb.begin())
                       ? 1.0 / requests.size()
                       : 0.0;
        }
        rows.push_back({{"config", cfg.name}, {"layer_rel_l2", drift}, {"kl", kl}, {"top1_agreement", agree}});
      }
      std::string map;
      for (auto k : m.config().layer_types) map += layer_map_char(k);
      nlohmann::json j{{"bench", "fidelity"},
                       {"model", lm.description},
                       {"layer_map", map},
                       {"segments", ro.segments},
                       {"segment_tokens", ro.segment_tokens},
                       {"query_tokens", ro.query_tokens},
                       {"requests", requests.size()},
                       {"results", rows}};
      if (!ro.task.empty()) {
        double tokens = 0;
        for (auto& r : requests)
          for (auto& seg : r) tokens += static_cast<double>(seg.size()) / requests.size();
        j.erase("segments");
        j.erase("segment_tokens");
        j.erase("query_tokens");
        j["task"] = ro.task;
        j["set"] = ro.set;
        j["mean_prompt_tokens"] = tokens;
      }
      std::cout << j.dump(o.json ? -1 : 2) << "\n";
      if (!o.json) {
        std::printf("%-14s %10s %8s  rel L2 per layer (%s)\n", "config", "KL", "top1", map.c_str());
        for (auto& r : rows) {
          std::printf("%-14s %10.4g %8.2f ", r["config"].get<std::string>().c_str(), r["kl"].get<double>(),
                      r["top1_agreement"].get<double>());
          for (auto& d : r["layer_rel_l2"]) std::printf(" %.3f", d.get<double>());
          std::printf("\n");
        }
      }
    });
  });
}

}  // namespace hypic::cli
