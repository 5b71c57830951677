#include "cli/commands.h"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/generate.h"
#include "engine/loader.h"
#include "models/gguf_checkpoint.h"
#include "pic/composer.h"
#include "pic/requests.h"

namespace hypic::cli {

namespace {
int g_exit = 0;
}
int exit_code() {
  return g_exit;
}
void set_exit_code(int c) {
  g_exit = c;
}

void guarded(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    g_exit = 1;
  }
}

std::vector<int32_t> parse_ids(const std::string& csv) {
  std::vector<int32_t> ids;
  std::stringstream ss(csv);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t a = item.find_first_not_of(" \t"), b = item.find_last_not_of(" \t");
    if (a == std::string::npos) throw std::invalid_argument("empty entry in id list '" + csv + "'");
    item = item.substr(a, b - a + 1);
    size_t pos = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &pos);
    } catch (...) {
      pos = 0;
    }
    if (pos != item.size() || v < 0 || v > INT32_MAX)
      throw std::invalid_argument("'" + item + "' is not a valid token id");
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.empty()) throw std::invalid_argument("empty id list");
  return ids;
}

std::vector<std::string> split_csv(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<int> parse_int_list(const std::string& csv, const std::string& flag, int min_value) {
  std::vector<int> out;
  for (const auto& item : split_csv(csv)) {
    size_t pos = 0;
    long v = 0;
    try {
      v = std::stol(item, &pos);
    } catch (...) {
      pos = 0;
    }
    if (pos != item.size() || v < min_value || v > INT32_MAX)
      throw std::invalid_argument(flag + ": '" + item + "' is not an integer >= " + std::to_string(min_value));
    out.push_back(static_cast<int>(v));
  }
  if (out.empty()) throw std::invalid_argument(flag + ": empty list");
  return out;
}

// ---- generate -----------------------------------------------------------------------------
void register_generate(CLI::App& app) {
  struct Opts {
    std::string model = default_model_dir(), prompt, prompt_ids, backend = "cpu", segments_file, mode = "pic";
    std::string quantize, activations;
    int max_tokens = 64, top_k = 0, logprobs = -1, threads = 0, seam = 8, tail_seam = 0;
    std::string cache_dir;
    double cache_mib = 4096;
    float temperature = 0.f, top_p = 1.f;
    uint64_t seed = 0;
    std::vector<std::string> stop;
    bool json = false, ignore_eos = false, mask_padded = false;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("generate", "Prefill a prompt and generate tokens");
  c->add_option("--model", o->model, kModelHelp)->capture_default_str();
  auto* p = c->add_option("--prompt", o->prompt, "Prompt text");
  auto* pi = c->add_option("--prompt-ids", o->prompt_ids, "Prompt as comma-separated token ids");
  auto* sf = c->add_option("--segments-file", o->segments_file,
                           "JSON {\"segments\": [{\"text\": ...} | {\"ids\": [...]}, ...]}");
  p->excludes(pi);
  sf->excludes(p);
  sf->excludes(pi);
  c->add_option("--mode", o->mode, "Prefill mode: full, prefix, pic, naive")->capture_default_str();
  c->add_option("--seam", o->seam, "Recomputed head tokens of each reused segment (0: none)")->capture_default_str();
  c->add_option("--tail-seam", o->tail_seam,
                "Also recompute the last W tokens of each reused segment (both-ends seams)")
      ->capture_default_str();
  c->add_option("--cache-budget-mib", o->cache_mib, "Segment cache budget in MiB")->capture_default_str();
  c->add_option("--cache-dir", o->cache_dir, "Persistent segment cache directory (reused across runs)");
  c->add_option("--max-tokens", o->max_tokens, "Maximum tokens to generate")->capture_default_str();
  c->add_option("--temperature", o->temperature, "Sampling temperature (0: greedy)")->capture_default_str();
  c->add_option("--top-k", o->top_k, "Keep the k most likely tokens (0: all)")->capture_default_str();
  c->add_option("--top-p", o->top_p, "Nucleus sampling mass")->capture_default_str();
  c->add_option("--seed", o->seed, "Sampling seed")->capture_default_str();
  c->add_option("--stop", o->stop, "Stop string (repeatable)");
  c->add_option("--logprobs", o->logprobs, "Report each token's log-prob and the top K");
  c->add_flag("--ignore-eos", o->ignore_eos, "Do not stop at end-of-sequence tokens");
  c->add_flag("--mask-padded-ids", o->mask_padded,
              "Never sample ids without a tokenizer entry (padded vocabulary rows); default: sample over every "
              "row, as transformers does");
  c->add_option("--threads", o->threads, "CPU threads (0: all cores)");
  c->add_option("--backend", o->backend, "Compute backend")->capture_default_str();
  c->add_option("--quantize", o->quantize, "Quantize the matrices as they load: q8_0, q4_k or q6_k (CPU backend)");
  c->add_option("--activations", o->activations,
                "Activations of the products: f32 (exact) or bf16 (cuda's tensor cores; on the cpu oneDNN's "
                "AVX512_BF16 kernels; default: cpu f32, cuda bf16)");
  c->add_flag("--json", o->json, "Print one JSON object");
  c->callback([o] {
    guarded([&] {
      if (o->prompt.empty() && o->prompt_ids.empty() && o->segments_file.empty())
        throw std::invalid_argument("give --prompt, --prompt-ids or --segments-file");
      PicOptions popt;
      popt.mode = parse_pic_mode(o->mode);
      popt.seam = o->seam;
      popt.tail_seam = o->tail_seam;
      if (o->seam < 0) throw std::invalid_argument("--seam must be >= 0");
      if (o->tail_seam < 0) throw std::invalid_argument("--tail-seam must be >= 0");
      if (!(o->cache_mib > 0)) throw std::invalid_argument("--cache-budget-mib must be positive");
      LoadedModel lm = load_model(o->model, o->backend, o->threads, quantize_option(o->quantize));
      apply_activations_option(*lm.backend, o->activations);
      GenerateRequest req;
      std::vector<std::vector<int32_t>> segments;
      if (!o->prompt_ids.empty()) {
        segments.push_back(parse_ids(o->prompt_ids));
      } else {
        auto specs = o->segments_file.empty() ? split_prompt(o->prompt) : load_segments_file(o->segments_file);
        if (!lm.tokenizer && !o->prompt.empty())
          throw std::invalid_argument("model folder " + o->model + " has no tokenizer.json: use --prompt-ids");
        segments = tokenize_segments(specs, lm.tokenizer.get());
      }
      for (auto& sgm : segments) req.prompt.insert(req.prompt.end(), sgm.begin(), sgm.end());
      req.max_tokens = o->max_tokens;
      req.sampling = {o->temperature, o->top_k, o->top_p, o->seed};
      req.stop = o->stop;
      req.logprobs = o->logprobs;
      if (!o->ignore_eos) req.eos_ids = lm.model->config().eos_token_ids;
      if (o->mask_padded) req.masked_ids = padded_ids_to_mask(*lm.model, lm.tokenizer.get());
      const bool stream = !o->json;
      // Validate sampling and lengths before any work (generate() repeats these checks).
      validate_request(*lm.model, lm.tokenizer.get(), req);
      PicEngine engine(*lm.model, static_cast<size_t>(o->cache_mib * 1048576.0));
      if (!o->cache_dir.empty()) engine.attach_cache_dir(o->cache_dir);
      const auto t0 = std::chrono::steady_clock::now();
      PrefillResult pre = engine.prefill(segments, popt);
      const double prefill_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      GenerateResult r;
      auto on_token = [&](int32_t id, const std::string& piece) {
        if (stream) {
          if (lm.tokenizer)
            std::fwrite(piece.data(), 1, piece.size(), stdout);
          else
            std::printf("%d ", id);
          std::fflush(stdout);
        }
        return true;
      };
      if (req.max_tokens > 0) {
        r = decode_from(*lm.model, lm.tokenizer.get(), req, pre.state, pre.logits, on_token);
        r.ttft_ms += prefill_ms;
      } else {
        r.finish_reason = "length";
        r.ttft_ms = prefill_ms;
      }
      r.prompt_tokens = static_cast<int64_t>(req.prompt.size());
      const auto& cr = pre.report;
      if (o->json) {
        nlohmann::json j;
        j["ids"] = r.ids;
        j["mode"] = pic_mode_name(popt.mode);
        j["segments"] = segments.size();
        j["cache"] = {{"hit_segments", cr.hit_segments},
                      {"miss_segments", cr.miss_segments},
                      {"reused_tokens", cr.reused_tokens},
                      {"prefix_tokens", cr.prefix_tokens},
                      {"computed_tokens", cr.computed_tokens}};
        if (!o->cache_dir.empty()) {
          const auto cs = engine.cache().stats();
          j["cache"]["disk_hits"] = cs.disk_hits;
          j["cache"]["disk_writes"] = cs.disk_writes;
          j["cache"]["corrupt_files"] = cs.corrupt_files;
        }
        if (lm.tokenizer) j["text"] = r.text;
        j["finish_reason"] = r.finish_reason;
        j["prompt_tokens"] = r.prompt_tokens;
        j["ttft_ms"] = r.ttft_ms;
        j["decode_tokens_per_s"] = r.ids.size() > 1 ? (r.ids.size() - 1) / (r.decode_ms / 1000.0) : 0.0;
        if (o->logprobs >= 0) {
          auto& a = j["logprobs"] = nlohmann::json::array();
          for (auto& t : r.logprobs) {
            nlohmann::json e{{"id", t.id}, {"logprob", t.logprob}, {"top", nlohmann::json::array()}};
            for (auto& [id, lp] : t.top) e["top"].push_back({id, lp});
            a.push_back(e);
          }
        }
        std::cout << j.dump(/*indent=*/-1, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace)
                  << "\n";
      } else {
        std::printf("\n");
        std::fprintf(stderr,
                     "[%s: %zu segments, %lld prompt tokens (%lld reused, %lld computed; %d hit / %d missed segments), "
                     "%zu generated, TTFT %.1f ms, %s]\n",
                     pic_mode_name(popt.mode), segments.size(), static_cast<long long>(r.prompt_tokens),
                     static_cast<long long>(cr.reused_tokens), static_cast<long long>(cr.computed_tokens),
                     cr.hit_segments, cr.miss_segments, r.ids.size(), r.ttft_ms, r.finish_reason.c_str());
      }
    });
  });
}

// ---- info ---------------------------------------------------------------------------------
void register_info(CLI::App& app) {
  struct Opts {
    std::string model = default_model_dir();
    bool json = false;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("info", "Describe a model: architecture, layer map, parameters, bytes");
  c->add_option("--model", o->model, kModelHelp)->capture_default_str();
  c->add_flag("--json", o->json, "Print JSON");
  c->callback([o] {
    guarded([&] {
      LoadedModel lm = load_model(o->model, "cpu", 1);
      const auto& cfg = lm.model->config();
      std::string map;
      for (auto k : cfg.layer_types) map += layer_map_char(k);
      nlohmann::json j{{"model", o->model},
                       {"architecture", cfg.architecture},
                       {"family", arch_name(cfg.arch)},
                       {"layers", cfg.num_hidden_layers},
                       {"layer_map", map},
                       {"linear_layers", cfg.num_linear_layers()},
                       {"attention_layers", cfg.num_attention_layers()},
                       {"hidden_size", cfg.hidden_size},
                       {"vocab_size", cfg.vocab_size},
                       {"experts", cfg.num_experts},
                       {"experts_per_token", cfg.num_experts_per_tok},
                       {"parameters", lm.model->parameter_count()},
                       {"weight_bytes", lm.model->weight_bytes()},
                       {"max_context", cfg.max_position_embeddings},
                       {"tokenizer", static_cast<bool>(lm.tokenizer)}};
      nlohmann::json per = nlohmann::json::array();
      for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
        const LayerDesc d = describe_layer(cfg, i);
        per.push_back({{"mixer", d.mixer},
                       {"family", d.family},
                       {"ffn", d.ffn},
                       {"state_bytes", 4 * d.state_floats},
                       {"kv_bytes_per_token", 4 * d.kv_floats_per_token}});
      }
      j["layer_list"] = per;
      if (o->json) {
        std::cout << j.dump(2) << "\n";
        return;
      }
      std::printf("model         %s\narchitecture  %s\nlayers        %lld (%lld linear, %lld attention)  map %s\n",
                  o->model.c_str(), cfg.architecture.c_str(), static_cast<long long>(cfg.num_hidden_layers),
                  static_cast<long long>(cfg.num_linear_layers()), static_cast<long long>(cfg.num_attention_layers()),
                  map.c_str());
      std::printf("hidden        %lld   vocab %lld   experts %lld (top %lld)\n",
                  static_cast<long long>(cfg.hidden_size), static_cast<long long>(cfg.vocab_size),
                  static_cast<long long>(cfg.num_experts), static_cast<long long>(cfg.num_experts_per_tok));
      std::printf("parameters    %lld   weights %.2f MiB   context %lld   tokenizer %s\n",
                  static_cast<long long>(lm.model->parameter_count()), lm.model->weight_bytes() / 1048576.0,
                  static_cast<long long>(cfg.max_position_embeddings), lm.tokenizer ? "yes" : "no");
      // One line per run of identical layers: what each mixes with and what it keeps per sequence.
      auto line = [&](int64_t a, int64_t b) {
        const LayerDesc d = describe_layer(cfg, a);
        std::string keeps = d.state_floats          ? std::to_string(4 * d.state_floats / 1024) + " KiB state"
                            : d.kv_floats_per_token ? std::to_string(4 * d.kv_floats_per_token) + " B/token K+V"
                                                    : "nothing";
        const std::string at = a + 1 == b ? std::to_string(a) : std::to_string(a) + "-" + std::to_string(b - 1);
        std::printf("  layer %-7s %-10s %-15s ffn %-5s keeps %s\n", at.c_str(), d.mixer.c_str(),
                    d.family.empty() ? "-" : d.family.c_str(), d.ffn.c_str(), keeps.c_str());
      };
      int64_t a = 0;
      for (int64_t i = 1; i <= cfg.num_hidden_layers; ++i)
        if (i == cfg.num_hidden_layers || per[static_cast<size_t>(i)] != per[static_cast<size_t>(a)]) {
          line(a, i);
          a = i;
        }
    });
  });
}

// ---- quantize -----------------------------------------------------------------------------
void register_quantize(CLI::App& app) {
  struct Opts {
    std::string model = default_model_dir(), out, type = "q8_0";
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("quantize", "Write a model as a llama.cpp GGUF file of a chosen weight type");
  c->add_option("--model", o->model, kModelHelp)->capture_default_str();
  c->add_option("--out", o->out, "GGUF file to write")->required();
  c->add_option("--type", o->type, "Matrix type: bf16, f32, q8_0, q4_k, q4_k_m (llama-quantize's mix) or q6_k")
      ->capture_default_str();
  c->callback([o] {
    guarded([&] {
      const bool q4_k_m = o->type == "q4_k_m";
      const DType type = q4_k_m ? DType::Q4_K : parse_weight_dtype(o->type, "--type");
      const auto t0 = std::chrono::steady_clock::now();
      TokenizerTexts tok;
      bool has_tok = false;
      std::unique_ptr<WeightSource> src;
      std::optional<ModelDir> dir;
      std::shared_ptr<const GgufFile> gguf;
      ModelConfig cfg;
      if (is_gguf_file(o->model)) {
        gguf = std::make_shared<const GgufFile>(o->model);
        cfg = gguf_model_config(*gguf);
        src = weights_from_gguf(gguf, cfg);
        if (gguf->has("tokenizer.ggml.model")) tok = gguf_tokenizer_texts(*gguf), has_tok = true;
      } else {
        dir.emplace(open_model_dir(o->model));
        cfg = dir->config;
        src = weights_from_store(*dir->weights);
        if (!dir->tokenizer_json.empty()) {
          tok.tokenizer_json = read_text_file(dir->tokenizer_json);
          if (!dir->tokenizer_config_json.empty()) tok.config_json = read_text_file(dir->tokenizer_config_json);
          has_tok = true;
        }
      }
      write_gguf_checkpoint(cfg, *src, has_tok ? &tok : nullptr, type, o->out, q4_k_m);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("wrote %s (%s matrices%s) in %.1f s\n", o->out.c_str(), q4_k_m ? "q4_k_m" : dtype_name(type),
                  has_tok ? ", tokenizer" : "", s);
    });
  });
}

// ---- tokenize -----------------------------------------------------------------------------
void register_tokenize(CLI::App& app) {
  struct Opts {
    std::string model = default_model_dir(), text, ids;
    bool json = false, no_special = false, jsonl = false;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("tokenize", "Encode text to ids (or decode --ids back to text)");
  c->add_option("--model", o->model, kModelHelp)->capture_default_str();
  auto* t = c->add_option("--text", o->text, "Text to encode");
  auto* i = c->add_option("--ids", o->ids, "Comma-separated ids to decode");
  t->excludes(i);
  // Many texts in one process (a tool counting a data set's tokens would otherwise start the
  // binary and load the tokenizer once per text).
  auto* l = c->add_flag("--jsonl", o->jsonl,
                        "Encode many texts: each stdin line a JSON string; prints {\"ids\": [...]} per line");
  l->excludes(t)->excludes(i);
  c->add_flag("--no-special", o->no_special, "Treat special-token text as plain text");
  c->add_flag("--json", o->json, "Print JSON");
  c->callback([o] {
    guarded([&] {
      auto dir = open_model_dir(o->model);
      if (dir.tokenizer_json.empty())
        throw std::invalid_argument("model folder " + o->model + " has no tokenizer.json");
      Tokenizer tok = Tokenizer::load(dir.tokenizer_json, dir.tokenizer_config_json);
      if (o->jsonl) {
        std::string line;
        for (size_t n = 1; std::getline(std::cin, line); ++n) {
          if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
          nlohmann::json in = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
          if (!in.is_string()) throw std::invalid_argument("stdin line " + std::to_string(n) + " is not a JSON string");
          std::cout << nlohmann::json{{"ids", tok.encode(in.get<std::string>(), !o->no_special)}}.dump() << "\n";
        }
        return;
      }
      if (!o->ids.empty()) {
        auto ids = parse_ids(o->ids);
        std::string text = tok.decode(ids);
        if (o->json)
          std::cout << nlohmann::json{{"text", text}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                    << "\n";
        else
          std::cout << text << "\n";
        return;
      }
      auto ids = tok.encode(o->text, !o->no_special);
      if (o->json) {
        nlohmann::json j{{"ids", ids}, {"tokens", nlohmann::json::array()}};
        for (auto id : ids) j["tokens"].push_back(tok.id_to_token(id));
        std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
      } else {
        for (size_t k = 0; k < ids.size(); ++k) std::printf("%s%d", k ? "," : "", ids[k]);
        std::printf("\n");
      }
    });
  });
}

}  // namespace hypic::cli
