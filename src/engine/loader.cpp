#include "engine/loader.h"

#include <cstdlib>
#include <filesystem>

#include "io/safetensors.h"

namespace hypic {

std::string default_model_dir() {
  if (const char* e = std::getenv("HYPIC_MODEL"); e && *e) return e;
  return std::string(HYPIC_SOURCE_DIR) + "/models/default";
}

LoadedModel load_model(const std::string& dir, const std::string& backend, int threads) {
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
