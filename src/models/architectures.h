// The architecture registry: every architecture hypic runs, the names it answers to in config.json
// and GGUF files, and the functions its own file provides (src/models/<arch>.cpp). Adding an
// architecture touches its file, this header (a value of Arch, its functions' declarations, a row
// of arch_specs()) and its tests; nothing else names architectures one by one.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "tensor/tensor.h"

namespace hypic {

enum class Arch { Qwen3_5, Qwen3_5Moe, Qwen3Next, NemotronH, MiniMax, KimiLinear };

struct ModelConfig;
class Backend;
class ArchBlocks;
namespace config_detail {
class Fields;
}
namespace gguf_detail {
struct Source;
class GgufKeys;
class GgufKeyWriter;
}  // namespace gguf_detail

// A weight as the checkpoint holds it, on the host (counted into the model's size and fingerprint).
using LoadWeight = std::function<Tensor(const std::string& name, const Shape& shape)>;

struct ArchSpec {
  Arch arch;
  const char* name = nullptr;  // hypic's name for it (`hypic info`, benchmark JSON)
  // The config.json names it answers to: architectures[0], else model_type. `nested`: the text
  // model's fields sit in text_config and its weights under model.language_model.
  struct HfName {
    const char* architecture;
    const char* model_type;
    bool nested;
  };
  HfName hf[2] = {};  // the second may be empty (architecture null)
  void (*parse)(const config_detail::Fields& f, ModelConfig& cfg) = nullptr;
  // Its layers as `hypic info` describes them: the recurrence family of its linear layers, the
  // name of its attention mixer, whether a block holds one sub-layer (a mixer or a feed-forward,
  // Nemotron-H) instead of both, and whether its linear layers keep a short-conv tail.
  const char* linear_family = "";
  const char* attention_mixer = "attention";
  bool one_sublayer_per_block = false;
  bool short_conv = true;
  // Its blocks in their own file, and the names of the weights Model loads itself (embedding, the
  // final RMSNorm whose weight multiplies directly). Null: Qwen's layers, which are Model's own.
  std::unique_ptr<ArchBlocks> (*blocks)(const ModelConfig& c, const LoadWeight& load, Backend& be) = nullptr;
  const char* embed = nullptr;
  const char* final_norm = nullptr;
  // llama.cpp GGUF files: the general.architecture values it answers to (empty when hypic does not
  // load it from GGUF; a second one is its MoE form, written when the config has experts), their
  // metadata into a config, and where each Hugging Face tensor lies. gguf_write_config is the
  // inverse of gguf_config for `hypic quantize` (null: hypic reads the files but does not write them).
  const char* gguf[2] = {};
  void (*gguf_config)(const gguf_detail::GgufKeys& k, ModelConfig& c) = nullptr;
  std::optional<gguf_detail::Source> (*gguf_source)(const ModelConfig& c, const std::string& name) = nullptr;
  void (*gguf_write_config)(const ModelConfig& c, gguf_detail::GgufKeyWriter& k) = nullptr;
};

// The functions each architecture's file provides (config.json parsers in config_detail beside
// config_fields.h, GGUF mappings in gguf_detail beside gguf_arch.h).
namespace config_detail {
void parse_qwen(const Fields& f, ModelConfig& cfg);  // config.cpp
void parse_nemotron_h(const Fields& f, ModelConfig& cfg);
void parse_minimax(const Fields& f, ModelConfig& cfg);
void parse_kimi_linear(const Fields& f, ModelConfig& cfg);
}  // namespace config_detail
namespace gguf_detail {
void qwen_gguf_config(const GgufKeys& k, ModelConfig& c);  // gguf_checkpoint.cpp
std::optional<Source> qwen_gguf_source(const ModelConfig& c, const std::string& name);
void qwen_gguf_write_config(const ModelConfig& c, GgufKeyWriter& k);
void nemotron_h_gguf_config(const GgufKeys& k, ModelConfig& c);
std::optional<Source> nemotron_h_gguf_source(const ModelConfig& c, const std::string& name);
void nemotron_h_gguf_write_config(const ModelConfig& c, GgufKeyWriter& k);
void kimi_linear_gguf_config(const GgufKeys& k, ModelConfig& c);
std::optional<Source> kimi_linear_gguf_source(const ModelConfig& c, const std::string& name);
}  // namespace gguf_detail
// Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: layers inside Model (qwen3_5.cpp).
// Nemotron-H (nemotron_h.cpp): Mamba2, NoPE attention, ReLU^2 MLP and MoE blocks.
std::unique_ptr<ArchBlocks> nemotron_h_blocks(const ModelConfig& c, const LoadWeight& load, Backend& be);
// MiniMax (minimax.cpp): lightning attention, RoPE attention, MoE, scaled residuals.
std::unique_ptr<ArchBlocks> minimax_blocks(const ModelConfig& c, const LoadWeight& load, Backend& be);
// Kimi-Linear (kimi_linear.cpp): KDA, MLA without RoPE, sigmoid-routed MoE.
std::unique_ptr<ArchBlocks> kimi_linear_blocks(const ModelConfig& c, const LoadWeight& load, Backend& be);

inline std::span<const ArchSpec> arch_specs() {
  using namespace config_detail;
  using namespace gguf_detail;
  static const ArchSpec kSpecs[] = {
      {.arch = Arch::Qwen3_5,
       .name = "qwen3_5",
       .hf = {{"Qwen3_5ForCausalLM", "qwen3_5_text", false}, {"Qwen3_5ForConditionalGeneration", "qwen3_5", true}},
       .parse = parse_qwen,
       .linear_family = "gated_deltanet",
       .attention_mixer = "attention",
       .gguf = {"qwen35", nullptr},
       .gguf_config = qwen_gguf_config,
       .gguf_source = qwen_gguf_source,
       .gguf_write_config = qwen_gguf_write_config},
      {.arch = Arch::Qwen3_5Moe,
       .name = "qwen3_5_moe",
       .hf = {{"Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", false},
              {"Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", true}},
       .parse = parse_qwen,
       .linear_family = "gated_deltanet",
       .attention_mixer = "attention",
       .gguf = {"qwen35moe", nullptr},
       .gguf_config = qwen_gguf_config,
       .gguf_source = qwen_gguf_source,
       .gguf_write_config = qwen_gguf_write_config},
      {.arch = Arch::Qwen3Next,
       .name = "qwen3_next",
       .hf = {{"Qwen3NextForCausalLM", "qwen3_next", false}, {}},
       .parse = parse_qwen,
       .linear_family = "gated_deltanet",
       .attention_mixer = "attention",
       .gguf = {"qwen3next", nullptr},
       .gguf_config = qwen_gguf_config,
       .gguf_source = qwen_gguf_source,
       .gguf_write_config = qwen_gguf_write_config},
      {.arch = Arch::NemotronH,
       .name = "nemotron_h",
       .hf = {{"NemotronHForCausalLM", "nemotron_h", false}, {}},
       .parse = parse_nemotron_h,
       .linear_family = "mamba2",
       .attention_mixer = "attention",
       .one_sublayer_per_block = true,
       .blocks = nemotron_h_blocks,
       .embed = "backbone.embeddings.weight",
       .final_norm = "backbone.norm_f.weight",
       .gguf = {"nemotron_h", "nemotron_h_moe"},
       .gguf_config = nemotron_h_gguf_config,
       .gguf_source = nemotron_h_gguf_source,
       .gguf_write_config = nemotron_h_gguf_write_config},
      {.arch = Arch::MiniMax,
       .name = "minimax",
       .hf = {{"MiniMaxForCausalLM", "minimax", false}, {}},
       .parse = parse_minimax,
       .linear_family = "lightning",
       .attention_mixer = "attention",
       .short_conv = false,
       .blocks = minimax_blocks,
       .embed = "model.embed_tokens.weight",
       .final_norm = "model.norm.weight"},
      {.arch = Arch::KimiLinear,
       .name = "kimi_linear",
       .hf = {{"KimiLinearForCausalLM", "kimi_linear", false}, {}},
       .parse = parse_kimi_linear,
       .linear_family = "kda",
       .attention_mixer = "mla",
       .blocks = kimi_linear_blocks,
       .embed = "model.embed_tokens.weight",
       .final_norm = "model.norm.weight",
       .gguf = {"kimi-linear", nullptr},
       .gguf_config = kimi_linear_gguf_config,
       .gguf_source = kimi_linear_gguf_source},
  };
  return kSpecs;
}

inline const ArchSpec& arch_spec(Arch a) {
  for (const ArchSpec& s : arch_specs())
    if (s.arch == a) return s;
  return arch_specs()[0];  // unreachable: every Arch has a row
}
inline const char* arch_name(Arch a) {
  return arch_spec(a).name;
}

}  // namespace hypic
