// Quality evaluation of the prefill modes on the multi-document tasks of
// tools/tasks/rag_tasks.py: every prompt runs under each configuration (full, prefix, pic at
// several seam widths, pic without RoPE re-rotation, naive) against a warm cache, greedy
// decoding, scored by exact match / F1 / ROUGE-L.
#pragma once
#include <string>
#include <vector>

#include "engine/loader.h"
#include "pic/composer.h"

namespace hypic::eval {

struct Example {
  std::string task, id, metric;
  std::vector<std::string> segments;  // system, documents..., question
  std::vector<std::string> answers;
};

std::vector<Example> parse_examples_jsonl(const std::string& text, const std::string& path);
std::vector<Example> load_examples(const std::string& jsonl_path);

// Held-out sets, regenerated bit-identically by the generator from fixed seeds.
struct SetSpec {
  int seed, min_docs, max_docs, min_doc_tokens, max_doc_tokens, n;
};
SetSpec eval_set(const std::string& name);  // "smoke", "moderate", "long", "longdocs", "full"
// Runs `python3 tools/tasks/rag_tasks.py` (standard library only) and parses its output.
std::vector<Example> generate_examples(const std::string& task, const SetSpec& s);

struct Config {
  std::string name;
  PicOptions opt;
};

struct Result {
  std::string config;
  double score = 0;  // mean over examples, in [0, 1]
  double ttft_ms_median = 0;
  std::vector<double> scores;
  std::vector<std::string> predictions;
};

struct RunOptions {
  bool warm = true;         // serve each prompt once with its documents in another order first
  double cache_mib = 4096;  // shared by the configs, which take turns prompt by prompt
  uint64_t seed = 1;
  bool mask_padded_ids = false;  // never decode ids without a tokenizer entry (--mask-padded-ids)
};

// Token ids of a prompt exactly as the model was trained: each segment + "\n", tokenised alone.
std::vector<std::vector<int32_t>> prompt_segments(const Tokenizer& tok, const Example& ex);
int max_new_tokens(const Example& ex);

std::vector<Result> run(LoadedModel& lm, const std::vector<Example>& examples, const std::vector<Config>& configs,
                        const RunOptions& opt);

}  // namespace hypic::eval
