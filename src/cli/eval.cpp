// hypic eval: task scores of every prefill mode on the multi-document tasks (a program that
// prints figures: JSON and a table).
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "eval/harness.h"

namespace hypic::cli {

namespace {
// Every task side by side, as docs/quality.md shows them (markdown): each configuration's score and
// its difference from full per task, their means, and the first task's median TTFT.
void print_summary(const nlohmann::json& out, const std::vector<std::string>& tasks, bool has_full) {
  std::printf("\n| config |");
  for (const auto& t : tasks) {
    std::printf(" %s %s |", t.c_str(), out["tasks"][t]["metric"].get<std::string>().c_str());
    if (has_full) std::printf(" vs full |");
  }
  std::printf(" mean |%s TTFT p50 ms (%s) |\n|---|", has_full ? " mean vs full |" : "", tasks.front().c_str());
  for (size_t i = 0; i < tasks.size() * (has_full ? 2 : 1) + (has_full ? 3 : 2); ++i) std::printf("---:|");
  std::printf("\n");
  const auto& first = out["tasks"][tasks.front()]["rows"];
  for (size_t r = 0; r < first.size(); ++r) {
    const std::string config = first[r]["config"];
    std::printf("| %s |", config.c_str());
    double mean = 0, mean_diff = 0;
    for (const auto& t : tasks) {
      const auto& row = out["tasks"][t]["rows"][r];
      const double score = row["score"];
      mean += score / static_cast<double>(tasks.size());
      std::printf(" %.1f |", score);
      if (has_full) {
        const double d = row["diff_vs_full"];
        mean_diff += d / static_cast<double>(tasks.size());
        std::printf(" %+.1f |", d);
      }
    }
    std::printf(" %.1f |", mean);
    if (has_full) std::printf(" %+.1f |", mean_diff);
    std::printf(" %.1f |\n", first[r]["ttft_ms_median"].get<double>());
  }
}
}  // namespace

void register_eval(CLI::App& app) {
  struct Opts {
    std::string quantize, activations;
    std::string model = default_model_dir(), task = "all", set = "moderate", data, modes = "full,prefix,pic,naive",
                seams = "8", predictions;
    int n = 0, threads = 0;
    bool json = false, no_warm = false, no_extra = false, mask_padded = false;
    double cache_mib = 4096;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("eval", "Score full / prefix / pic / naive prefill on multi-document tasks");
  c->add_option("--model", o->model, kModelHelp)->capture_default_str();
  c->add_option("--task", o->task, "lookup, twohop, aggregate or all")->capture_default_str();
  c->add_option("--set", o->set,
                "Held-out set: smoke, moderate, long (more documents), longdocs (longer documents), full")
      ->capture_default_str();
  c->add_option("--n", o->n, "Prompts per task (default: the set's size)");
  c->add_option("--data", o->data, "Examples JSONL instead of a generated set");
  c->add_option("--modes", o->modes, "Modes to compare")->capture_default_str();
  c->add_option("--seams", o->seams, "Seam widths for pic")->capture_default_str();
  c->add_flag("--no-warm", o->no_warm, "Do not serve each prompt's documents in another order first");
  c->add_flag("--no-extra-rows", o->no_extra,
              "Skip the rows pic without RoPE re-rotation and pic with both-ends seams");
  c->add_option("--cache-budget-mib", o->cache_mib,
                "Segment cache budget, shared by the configs (they take turns prompt by prompt)")
      ->capture_default_str();
  c->add_option("--predictions", o->predictions, "Write every prediction to this JSONL file");
  c->add_flag("--mask-padded-ids", o->mask_padded,
              "Never decode ids without a tokenizer entry (default: every row, as transformers does)");
  c->add_option("--threads", o->threads, "CPU threads (0: all cores)");
  c->add_option("--quantize", o->quantize, "Quantize the matrices as they load: q8_0, q4_k or q6_k (CPU backend)");
  c->add_option("--activations", o->activations,
                "Activations of the products: f32 (exact) or bf16 (cuda's tensor cores; on the cpu oneDNN's "
                "AVX512_BF16 kernels; default: cpu f32, cuda bf16)");
  c->add_flag("--json", o->json, "Print JSON only");
  c->callback([o] {
    guarded([&] {
      std::vector<eval::Config> configs;
      bool has_full = false;
      const std::vector<int> seams = parse_int_list(o->seams, "--seams", 0);
      for (const auto& ms : split_csv(o->modes)) {
        PicMode mode = parse_pic_mode(ms);
        if (mode == PicMode::Pic) {
          for (int w : seams) configs.push_back({"pic/seam=" + std::to_string(w), {PicMode::Pic, w}});
          if (!o->no_extra) {
            const int w = seams.front();
            PicOptions nr{PicMode::Pic, w};
            nr.rerotate = false;
            configs.push_back({"pic/no-rerotate", nr});
            PicOptions be{PicMode::Pic, w};
            be.tail_seam = w;
            configs.push_back({"pic/both-ends", be});
          }
        } else {
          has_full |= mode == PicMode::Full;
          configs.push_back({pic_mode_name(mode), {mode, 0}});
        }
      }
      if (configs.empty()) throw std::invalid_argument("--modes selects nothing");
      std::vector<std::string> tasks = o->task == "all" ? std::vector<std::string>{"lookup", "twohop", "aggregate"}
                                                        : std::vector<std::string>{o->task};
      LoadedModel lm = load_model(o->model, "cpu", o->threads, quantize_option(o->quantize));
      apply_activations_option(*lm.backend, o->activations);
      eval::RunOptions ro;
      ro.warm = !o->no_warm;
      ro.cache_mib = o->cache_mib;
      ro.mask_padded_ids = o->mask_padded;
      nlohmann::json out{
          {"model", o->model}, {"set", o->data.empty() ? o->set : o->data}, {"tasks", nlohmann::json::object()}};
      std::FILE* pred = o->predictions.empty() ? nullptr : std::fopen(o->predictions.c_str(), "w");
      if (!o->predictions.empty() && !pred) throw std::invalid_argument("cannot write " + o->predictions);
      std::vector<std::string> ran;  // the tasks with examples
      for (const auto& task : tasks) {
        std::vector<eval::Example> ex;
        if (!o->data.empty()) {
          // Each task scores its own examples of the file (with --task all too: every task in turn).
          ex = eval::load_examples(o->data);
          ex.erase(std::remove_if(ex.begin(), ex.end(), [&](const auto& e) { return e.task != task; }), ex.end());
          if (o->n > 0 && static_cast<size_t>(o->n) < ex.size()) ex.resize(static_cast<size_t>(o->n));
          if (ex.empty()) {
            if (!o->json) std::printf("task %s: no examples in %s\n", task.c_str(), o->data.c_str());
            continue;
          }
        } else {
          eval::SetSpec s = eval::eval_set(o->set);
          if (o->n > 0) s.n = o->n;
          ex = eval::generate_examples(task, s);
        }
        ran.push_back(task);
        auto results = eval::run(lm, ex, configs, ro);
        double full = 0;
        for (auto& r : results)
          if (r.config == "full") full = r.score;
        auto& tj = out["tasks"][task];
        tj["n"] = ex.size();
        tj["metric"] = ex.empty() ? "" : ex[0].metric;
        for (auto& r : results) {
          nlohmann::json row{{"config", r.config}, {"score", 100 * r.score}, {"ttft_ms_median", r.ttft_ms_median}};
          if (has_full) row["diff_vs_full"] = 100 * (r.score - full);
          tj["rows"].push_back(row);
          if (pred)
            for (size_t i = 0; i < ex.size(); ++i)
              std::fprintf(pred, "%s\n",
                           nlohmann::json{{"task", task},
                                          {"id", ex[i].id},
                                          {"config", r.config},
                                          {"prediction", r.predictions[i]},
                                          {"answers", ex[i].answers},
                                          {"score", r.scores[i]}}
                               .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                               .c_str());
        }
        if (!o->json) {
          std::printf("task %s (%zu prompts, %s)\n  %-18s %8s %10s %12s\n", task.c_str(), ex.size(),
                      ex.empty() ? "" : ex[0].metric.c_str(), "config", "score", "vs full", "TTFT p50 ms");
          for (auto& r : results) {
            char diff[32] = "-";
            if (has_full) std::snprintf(diff, sizeof diff, "%+.1f", 100 * (r.score - full));
            std::printf("  %-18s %8.1f %10s %12.1f\n", r.config.c_str(), 100 * r.score, diff, r.ttft_ms_median);
          }
        }
      }
      if (pred) std::fclose(pred);
      if (ran.empty()) throw std::invalid_argument("no examples of task '" + o->task + "' in " + o->data);
      if (!o->json && ran.size() > 1) print_summary(out, ran, has_full);
      if (o->json) std::cout << out.dump(-1) << "\n";
    });
  });
}

}  // namespace hypic::cli
