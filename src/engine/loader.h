// Everything a command needs to run a model: backend, weights, tokenizer, generation defaults.
#pragma once
#include <memory>
#include <optional>
#include <string>

#include "backend/backend.h"
#include "io/gguf.h"
#include "io/model_dir.h"
#include "models/model.h"
#include "tokenizer/tokenizer.h"

namespace hypic {

struct LoadedModel {
  std::unique_ptr<Backend> backend;
  std::optional<ModelDir> dir;           // absent for --random-weights and GGUF files
  std::shared_ptr<const GgufFile> gguf;  // a GGUF file's mapping (its float weights are views of it)
  std::unique_ptr<WeightSource> source;
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;  // null when the folder has no tokenizer.json
  std::string description;               // folder path, or "random weights from FILE"
};

// The bundled default model: $HYPIC_MODEL, else models/default in the source tree.
std::string default_model_dir();

// `path`: a checkpoint folder (config.json, safetensors, tokenizer.json), or a GGUF file written by
// llama.cpp's converter for qwen35 / qwen35moe (models/gguf_checkpoint.h).
LoadedModel load_model(const std::string& path, const std::string& backend = "cpu", int threads = 0);
// Seeded random weights for a bare config.json (benchmarks on real shapes).
LoadedModel load_random_model(const std::string& config_json, uint64_t seed, DType dtype,
                              const std::string& backend = "cpu", int threads = 0);

}  // namespace hypic
