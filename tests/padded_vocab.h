// Test fixture: a padded-vocabulary checkpoint derived at run time from the reference test model
// (tests/data/models/qwen3_5_dense), so no extra binary is committed. Like every released Qwen3.5
// (248,320 embedding rows for fewer tokens), the model has more output rows than its tokenizer has
// entries: vocab_size 768 against 512 tokenizer ids. Rows 512..767 are the rows 0..255 scaled by
// 1.5 (tied embeddings: the lm_head rows too), so greedy decoding really picks them whenever one
// of the first 256 tokens leads with a positive logit. Among the ids 0..511 the logits are the
// reference model's own, so with the padded ids masked out the output equals the reference model's.
#pragma once
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "io/safetensors.h"

namespace hypic::testing {

inline constexpr int64_t kPaddedVocabRows = 768;
inline constexpr int64_t kPaddedVocabTokenizerIds = 512;

inline std::filesystem::path reference_model_dir() {
  return std::filesystem::path(HYPIC_TEST_DATA) / "models" / "qwen3_5_dense";
}

// Writes the padded checkpoint into `dir` (created; replaced if present) and returns it.
inline std::filesystem::path make_padded_vocab_model(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  const fs::path src = reference_model_dir();
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"})
    fs::copy_file(src / f, dir / f);
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(src / "config.json"));
  const int64_t rows = cfg.at("vocab_size").get<int64_t>();
  if (rows != kPaddedVocabTokenizerIds || !cfg.value("tie_word_embeddings", false))
    throw std::runtime_error("padded-vocab fixture: unexpected reference model (vocab_size " + std::to_string(rows) +
                             ")");
  cfg["vocab_size"] = kPaddedVocabRows;
  std::ofstream(dir / "config.json") << cfg.dump(2);

  SafetensorsFile in((src / "model.safetensors").string());
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& name : in.names()) {
    Tensor t = in.get(name);
    if (name == "model.embed_tokens.weight") {
      const int64_t H = t.dim(1);
      Tensor padded = Tensor::empty(DType::F32, {kPaddedVocabRows, H});
      const float* s = t.data<float>();
      float* d = padded.data<float>();
      for (int64_t r = 0; r < kPaddedVocabRows; ++r)
        for (int64_t c = 0; c < H; ++c) d[r * H + c] = r < rows ? s[r * H + c] : 1.5f * s[(r - rows) * H + c];
      t = padded;
    }
    out.emplace_back(name, t);
  }
  write_safetensors((dir / "model.safetensors").string(), out, {{"format", "pt"}});
  return dir;
}

}  // namespace hypic::testing
