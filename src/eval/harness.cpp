#include "eval/harness.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <stdexcept>

#include "engine/generate.h"
#include "eval/scoring.h"

namespace hypic::eval {

std::vector<Example> parse_examples_jsonl(const std::string& text, const std::string& path) {
  std::vector<Example> out;
  std::istringstream in(text);
  std::string line;
  size_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(lineno);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      throw std::invalid_argument(where + ": malformed JSON: " + e.what());
    }
    try {
      Example ex;
      ex.task = j.value("task", "");
      ex.id = j.value("id", std::to_string(lineno));
      ex.metric = j.at("metric").get<std::string>();
      ex.segments = j.at("segments").get<std::vector<std::string>>();
      ex.answers = j.contains("answers") ? j["answers"].get<std::vector<std::string>>()
                                         : std::vector<std::string>{j.at("answer").get<std::string>()};
      if (ex.segments.size() < 2) throw std::invalid_argument("needs at least a prefix and a question");
      out.push_back(std::move(ex));
    } catch (const std::exception& e) {
      throw std::invalid_argument(where + ": " + e.what());
    }
  }
  return out;
}

std::vector<Example> load_examples(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::invalid_argument("cannot open examples file " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_examples_jsonl(ss.str(), path);
}

SetSpec eval_set(const std::string& name) {
  // Same seeds and sizes as tools/train/eval_rag.py, plus the full-size set of the task spec.
  if (name == "smoke") return {7003, 2, 4, 50, 100, 20};
  if (name == "moderate") return {7001, 4, 16, 100, 400, 100};
  if (name == "long") return {7002, 16, 32, 100, 400, 30};
  if (name == "full") return {7004, 4, 32, 100, 1000, 300};
  // Documents 2.5-6x longer than any the default model trained on (its curriculum's longest: 400).
  if (name == "longdocs") return {7005, 3, 6, 1000, 2500, 30};
  throw std::invalid_argument("unknown eval set '" + name + "' (expected smoke, moderate, long, longdocs or full)");
}

std::vector<Example> generate_examples(const std::string& task, const SetSpec& s) {
  if (task != "lookup" && task != "twohop" && task != "aggregate")
    throw std::invalid_argument("unknown task '" + task + "' (expected lookup, twohop or aggregate)");
  const std::string script = std::string(HYPIC_SOURCE_DIR) + "/tools/tasks/rag_tasks.py";
  const std::string cmd = "python3 '" + script + "' --task " + task + " --n " + std::to_string(s.n) + " --seed " +
                          std::to_string(s.seed) + " --min-docs " + std::to_string(s.min_docs) + " --max-docs " +
                          std::to_string(s.max_docs) + " --min-doc-tokens " + std::to_string(s.min_doc_tokens) +
                          " --max-doc-tokens " + std::to_string(s.max_doc_tokens);
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) throw std::runtime_error("cannot run " + cmd);
  std::string text;
  std::array<char, 65536> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) text.append(buf.data(), n);
  const int st = pclose(p);
  if (st != 0) throw std::runtime_error("task generator failed (exit " + std::to_string(st) + "): " + cmd);
  return parse_examples_jsonl(text, task + " generator");
}

std::vector<std::vector<int32_t>> prompt_segments(const Tokenizer& tok, const Example& ex) {
  std::vector<std::vector<int32_t>> segs;
  for (const auto& s : ex.segments) segs.push_back(tok.encode(s + "\n"));
  return segs;
}

int max_new_tokens(const Example& ex) {
  if (ex.task == "aggregate") return 6 * static_cast<int>(ex.segments.size() - 2) + 16;
  return 24;
}

std::vector<Result> run(LoadedModel& lm, const std::vector<Example>& examples, const std::vector<Config>& configs,
                        const RunOptions& opt) {
  if (!lm.tokenizer) throw std::invalid_argument("evaluation needs a model with tokenizer.json");
  if (examples.empty()) throw std::invalid_argument("no examples to evaluate");
  Model& m = *lm.model;
  const Tokenizer& tok = *lm.tokenizer;
  std::vector<std::vector<std::vector<int32_t>>> prompts;
  for (const auto& ex : examples) prompts.push_back(prompt_segments(tok, ex));
  const std::vector<int32_t> masked = opt.mask_padded_ids ? padded_ids_to_mask(m, &tok) : std::vector<int32_t>{};
  // The configs take turns prompt by prompt, so that a machine whose speed drifts over minutes
  // (a shared or throttled CPU) moves every config's TTFT alike and their ratios stay put. Each has
  // its own engine and cache (a share of the budget: a prompt's documents are reused only within
  // that prompt) and its own shuffles, so its scores are those of a run of its own.
  const size_t C = configs.size();
  std::vector<std::unique_ptr<PicEngine>> engines;
  std::vector<std::mt19937_64> rngs(C, std::mt19937_64(opt.seed));
  std::vector<Result> out(C);
  std::vector<std::vector<double>> ttft(C);
  std::vector<double> seconds(C, 0.0);
  for (size_t c = 0; c < C; ++c) {
    engines.push_back(std::make_unique<PicEngine>(m, static_cast<size_t>(opt.cache_mib * 1048576.0 / C)));
    out[c].config = configs[c].name;
  }
  for (size_t i = 0; i < examples.size(); ++i) {
    const auto& segs = prompts[i];
    for (size_t c = 0; c < C; ++c) {
      const Config& cfg = configs[c];
      PicEngine& eng = *engines[c];
      Result& res = out[c];
      const auto t_cfg = std::chrono::steady_clock::now();
      const bool warmed = opt.warm && segs.size() > 3 && cfg.opt.mode != PicMode::Full;
      // A document larger than a config's share of the budget: say that the budget is shared.
      auto prefill = [&](const std::vector<std::vector<int32_t>>& p, const PicOptions& po) {
        try {
          return eng.prefill(p, po);
        } catch (const std::length_error& e) {
          throw std::length_error(std::string(e.what()) + " (--cache-budget-mib " + fmt::format("{:g}", opt.cache_mib) +
                                  " is shared by the " + std::to_string(C) + " configs)");
        }
      };
      if (warmed) {  // full recompute reads no cache
        // The documents were seen before, in another order (as retrieval reorders them).
        auto warm = segs;
        std::shuffle(warm.begin() + 1, warm.end() - 1, rngs[c]);
        PicOptions w = cfg.opt;
        w.skip_question = true;
        prefill(warm, w);
      }
      GenerateRequest req;
      for (const auto& s : segs) req.prompt.insert(req.prompt.end(), s.begin(), s.end());
      req.max_tokens = max_new_tokens(examples[i]);
      req.eos_ids = m.config().eos_token_ids;
      req.masked_ids = masked;
      const auto t0 = std::chrono::steady_clock::now();
      PrefillResult pre = prefill(segs, cfg.opt);
      const double prefill_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      GenerateResult g = decode_from(m, nullptr, req, pre.state, pre.logits);
      ttft[c].push_back(prefill_ms + g.ttft_ms);
      std::vector<int32_t> ids = g.ids;
      if (!ids.empty() && std::find(req.eos_ids.begin(), req.eos_ids.end(), ids.back()) != req.eos_ids.end())
        ids.pop_back();
      std::string text = tok.decode(ids, /*skip_special=*/true);
      const size_t a = text.find_first_not_of(" \t\r\n"), b = text.find_last_not_of(" \t\r\n");
      text = a == std::string::npos ? "" : text.substr(a, b - a + 1);
      res.scores.push_back(score(examples[i].metric, text, examples[i].answers));
      res.predictions.push_back(text);
      seconds[c] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t_cfg).count();
    }
    // Progress on stderr: a full evaluation runs for many minutes.
    if (const size_t step = std::max<size_t>(1, examples.size() / 5); (i + 1) % step == 0 && i + 1 < examples.size())
      spdlog::info("eval {}: {} of {} prompts", examples[0].task, i + 1, examples.size());
  }
  for (size_t c = 0; c < C; ++c) {
    Result& res = out[c];
    double sum = 0;
    for (double s : res.scores) sum += s;
    res.score = sum / static_cast<double>(res.scores.size());
    std::sort(ttft[c].begin(), ttft[c].end());
    res.ttft_ms_median = ttft[c][ttft[c].size() / 2];
    spdlog::info("eval {} {}: score {:.3f} over {} prompts in {:.1f} s", examples[0].task, res.config, res.score,
                 examples.size(), seconds[c]);
  }
  return out;
}

}  // namespace hypic::eval
