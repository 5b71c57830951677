#include "engine/loader.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "io/safetensors.h"
#include "models/gguf_checkpoint.h"

namespace hypic {

std::string default_model_dir() {
  if (const char* e = std::getenv("HYPIC_MODEL"); e && *e) return e;
  return std::string(HYPIC_SOURCE_DIR) + "/models/default";
}

bool is_gguf_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {};
  f.read(magic, 4);
  return f && std::string(magic, 4) == "GGUF";
}

namespace {

LoadedModel load_gguf(const std::string& path, const std::string& backend, int threads, std::optional<DType> quantize) {
  LoadedModel lm;
  lm.backend = make_backend(backend, threads);
  lm.gguf = std::make_shared<const GgufFile>(path);
  const ModelConfig cfg = gguf_model_config(*lm.gguf);
  lm.source = weights_from_gguf(lm.gguf, cfg);
  if (quantize) lm.source = quantized_weights(std::move(lm.source), *quantize);
  lm.model = std::make_unique<Model>(cfg, *lm.source, *lm.backend);
  if (lm.gguf->has("tokenizer.ggml.model")) {
    const TokenizerTexts t = gguf_tokenizer_texts(*lm.gguf);
    lm.tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_json_text(t.tokenizer_json, t.config_json, path));
  }
  lm.description = path;
  if (quantize) lm.description += std::string(" (quantized to ") + dtype_name(*quantize) + ")";
  return lm;
}

}  // namespace

LoadedModel load_model(const std::string& dir, const std::string& backend, int threads, std::optional<DType> quantize) {
  if (quantize && !dtype_is_quantized(*quantize))
    throw std::invalid_argument(std::string("--quantize ") + dtype_name(*quantize) + ": must be q8_0, q4_k or q6_k");
  if (is_gguf_file(dir) || (dir.size() > 5 && dir.ends_with(".gguf")))
    return load_gguf(dir, backend, threads, quantize);
  LoadedModel lm;
  lm.backend = make_backend(backend, threads);
  lm.dir.emplace(open_model_dir(dir));
  lm.source = weights_from_store(*lm.dir->weights);
  if (quantize) lm.source = quantized_weights(std::move(lm.source), *quantize);
  lm.model = std::make_unique<Model>(lm.dir->config, *lm.source, *lm.backend);
  if (!lm.dir->tokenizer_json.empty())
    lm.tokenizer = std::make_unique<Tokenizer>(Tokenizer::load(lm.dir->tokenizer_json, lm.dir->tokenizer_config_json));
  lm.description = dir;
  if (quantize) lm.description += std::string(" (quantized to ") + dtype_name(*quantize) + ")";
  return lm;
}

LoadedModel load_random_model(const std::string& config_json, uint64_t seed, DType dtype, const std::string& backend,
                              int threads) {
  LoadedModel lm;
  lm.backend = make_backend(backend, threads);
  lm.source = dtype_is_quantized(dtype) ? quantized_weights(random_weights(seed, DType::F32), dtype)
                                        : random_weights(seed, dtype);
  lm.model = std::make_unique<Model>(load_model_config(config_json), *lm.source, *lm.backend);
  lm.description = "random " + std::string(dtype_name(dtype)) + " weights for " + config_json;
  return lm;
}

DType parse_weight_dtype(const std::string& name, const std::string& option) {
  const auto dt = dtype_from_name(name);
  if (!dt || !(dtype_is_quantized(*dt) || *dt == DType::BF16 || *dt == DType::F16 || *dt == DType::F32))
    throw std::invalid_argument(option + " '" + name + "': must be bf16, f16, f32, q8_0, q4_k or q6_k");
  return *dt;
}

std::optional<DType> quantize_option(const std::string& name) {
  if (name.empty()) return std::nullopt;
  const DType dt = parse_weight_dtype(name, "--quantize");
  if (!dtype_is_quantized(dt)) throw std::invalid_argument("--quantize '" + name + "': must be q8_0, q4_k or q6_k");
  return dt;
}

std::optional<bool> activations_precise(const std::string& name) {
  if (name.empty()) return std::nullopt;
  if (name != "f32" && name != "bf16") throw std::invalid_argument("--activations '" + name + "': must be f32 or bf16");
  return name == "f32";
}

void apply_activations_option(Backend& backend, const std::string& name) {
  const std::optional<bool> precise = activations_precise(name);
  if (!precise) return;
  backend.set_precise(*precise);
  if (!*precise && backend.precise())
    throw std::invalid_argument("--activations bf16: the " + backend.name() +
                                " backend cannot run bf16 products: " + backend.imprecise_unavailable());
}

}  // namespace hypic
