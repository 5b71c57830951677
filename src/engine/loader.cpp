#include "engine/loader.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "io/safetensors.h"
#include "models/gguf_checkpoint.h"

namespace hypic {

std::string default_model_dir() {
  if (const char* e = std::getenv("HYPIC_MODEL"); e && *e) return e;
  return std::string(HYPIC_SOURCE_DIR) + "/models/default";
}

namespace {

// A regular file that starts with GGUF's magic.
bool is_gguf_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {};
  f.read(magic, 4);
  return f && std::string(magic, 4) == "GGUF";
}

LoadedModel load_gguf(const std::string& path, const std::string& backend, int threads) {
  LoadedModel lm;
  lm.backend = make_backend(backend, threads);
  lm.gguf = std::make_shared<const GgufFile>(path);
  const ModelConfig cfg = gguf_model_config(*lm.gguf);
  lm.source = weights_from_gguf(lm.gguf, cfg);
  lm.model = std::make_unique<Model>(cfg, *lm.source, *lm.backend);
  if (lm.gguf->has("tokenizer.ggml.model")) {
    const TokenizerTexts t = gguf_tokenizer_texts(*lm.gguf);
    lm.tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_json_text(t.tokenizer_json, t.config_json, path));
  }
  lm.description = path;
  return lm;
}

}  // namespace

LoadedModel load_model(const std::string& dir, const std::string& backend, int threads) {
  if (is_gguf_file(dir) || (dir.size() > 5 && dir.ends_with(".gguf"))) return load_gguf(dir, backend, threads);
  LoadedModel lm;
  lm.backend = make_backend(backend, threads);
  lm.dir.emplace(open_model_dir(dir));
  lm.source = weights_from_store(*lm.dir->weights);
  lm.model = std::make_unique<Model>(lm.dir->config, *lm.source, *lm.backend);
  if (!lm.dir->tokenizer_json.empty())
    lm.tokenizer = std::make_unique<Tokenizer>(Tokenizer::load(lm.dir->tokenizer_json, lm.dir->tokenizer_config_json));
  lm.description = dir;
  return lm;
}

LoadedModel load_random_model(const std::string& config_json, uint64_t seed, DType dtype, const std::string& backend,
                              int threads) {
  LoadedModel lm;
  lm.backend = make_backend(backend, threads);
  lm.source = random_weights(seed, dtype);
  lm.model = std::make_unique<Model>(load_model_config(config_json), *lm.source, *lm.backend);
  lm.description = "random " + std::string(dtype_name(dtype)) + " weights for " + config_json;
  return lm;
}

}  // namespace hypic
