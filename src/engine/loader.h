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

// A regular file that starts with GGUF's magic.
bool is_gguf_file(const std::string& path);

// The bundled default model: $HYPIC_MODEL, else models/default in the source tree.
std::string default_model_dir();

// `path`: a checkpoint folder (config.json, safetensors, tokenizer.json), or a GGUF file written by
// llama.cpp's converter (the architectures models/gguf_checkpoint.h lists).
// `quantize` (Q8_0, Q4_K or Q6_K): the matrices quantized as they load (models/model.h,
// quantized_weights), so any checkpoint runs quantized on the CPU without a converted file.
LoadedModel load_model(const std::string& path, const std::string& backend = "cpu", int threads = 0,
                       std::optional<DType> quantize = std::nullopt);
// Seeded random weights for a bare config.json (benchmarks on real shapes); a quantized `dtype`
// quantizes f32 random matrices as they are made.
LoadedModel load_random_model(const std::string& config_json, uint64_t seed, DType dtype,
                              const std::string& backend = "cpu", int threads = 0);

// A weight dtype named on the command line (bf16, f16, f32, q8_0, q4_k, q6_k; `option` names the
// flag in the error).
DType parse_weight_dtype(const std::string& name, const std::string& option);
// --quantize: empty for none, else q8_0, q4_k or q6_k.
std::optional<DType> quantize_option(const std::string& name);
// --activations: how products treat their activations. "f32": exact (Backend::set_precise(true));
// "bf16": rounded to bf16 for the GPU's tensor cores; empty: the backend's default (f32 on the CPU,
// bf16 on CUDA). An unknown name, or bf16 on the CPU (which has no faster bf16 products), is an
// error naming the flag.
void apply_activations_option(Backend& backend, const std::string& name);
// The same flag checked before any loading: whether it asks for precise products (nullopt: the
// backend's default); an unknown name is the same error.
std::optional<bool> activations_precise(const std::string& name);

}  // namespace hypic
