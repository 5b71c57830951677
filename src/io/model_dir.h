// A Hugging Face model folder: config.json, safetensors weights, tokenizer files and the
// optional generation_config.json.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "models/config.h"

namespace hypic {

// Sampling defaults from generation_config.json (all optional; absent file: all empty).
struct GenerationDefaults {
  std::vector<int64_t> eos_token_ids;
  std::optional<float> temperature, top_p;
  std::optional<int> top_k;
};

struct ModelDir {
  std::string dir;
  ModelConfig config;  // eos_token_ids merged with generation_config.json's
  std::unique_ptr<WeightStore> weights;
  std::string tokenizer_json, tokenizer_config_json;  // paths, empty if absent
  GenerationDefaults generation;
};

// Parses generation_config.json text; `path` only names the file in error messages.
GenerationDefaults parse_generation_config(const std::string& json_text, const std::string& path);

// A whole file's bytes; throws std::runtime_error naming the path when it cannot be opened.
std::string read_text_file(const std::string& path);

// Opens a model folder. Throws std::runtime_error naming the path when the folder is missing, is
// not a directory, lacks config.json, or any of its files is malformed.
ModelDir open_model_dir(const std::string& dir);

}  // namespace hypic
