// Decoder blocks of the architectures beyond Qwen's, one file each (nemotron_h.cpp): Model keeps the
// embedding, the head, the per-sequence states and the batching, and hands each layer's work to the
// architecture's blocks. Internal to src/models.
#pragma once
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "backend/backend.h"
#include "models/config.h"
#include "models/model.h"

namespace hypic {

// A weight as the checkpoint holds it, on the host (counted into the model's size and fingerprint).
using LoadWeight = std::function<Tensor(const std::string& name, const Shape& shape)>;

class ArchBlocks {
 public:
  virtual ~ArchBlocks() = default;
  // x [T, H] in/out (the block's residual included); spans as Model::layer_forward. A span's `after`
  // work is run through model.apply_after once its mixer is done.
  virtual void layer_forward(Model& model, int64_t layer, Tensor& x, std::span<const LayerSpan> spans) = 0;
  // Runs a linear layer's recurrence over recorded inputs (LayerSpan::record) from ssm, in place.
  virtual void replay(const RecurrenceInputs& in, Tensor& ssm) = 0;
  // Whether a segment's transition is a scaled identity per head (stored [heads, 1, 1]).
  virtual bool scalar_transition() const { return false; }
  // Whether PIC may keep a short segment body as its recurrence inputs (RecurrenceInputs with g
  // [n, heads]); false where the decay is per channel.
  virtual bool compact_bodies() const { return true; }
  // Bytes of routed-expert weights (for Model::step_weight_bytes).
  virtual size_t expert_bytes() const = 0;
};

// Nemotron-H (Mamba2, NoPE attention, ReLU^2 MLP and MoE blocks).
std::unique_ptr<ArchBlocks> nemotron_h_blocks(const ModelConfig& c, const LoadWeight& load, Backend& be);
// MiniMax (lightning attention, RoPE attention, MoE, scaled residuals).
std::unique_ptr<ArchBlocks> minimax_blocks(const ModelConfig& c, const LoadWeight& load, Backend& be);

// Kimi-Linear (KDA, MLA without RoPE, sigmoid-routed MoE).
std::unique_ptr<ArchBlocks> kimi_linear_blocks(const ModelConfig& c, const LoadWeight& load, Backend& be);

// The registry: architectures whose blocks live in their own file, with the names of the weights
// Model loads itself. Qwen3.5 / Qwen3.5-MoE / Qwen3-Next are not listed (their layers are Model's).
struct ArchBlocksEntry {
  Arch arch;
  const char* embed;       // token embedding
  const char* final_norm;  // RMSNorm before the head (weight multiplies directly)
  std::unique_ptr<ArchBlocks> (*make)(const ModelConfig&, const LoadWeight&, Backend&);
};
inline const ArchBlocksEntry* find_arch_blocks(Arch a) {
  static const ArchBlocksEntry kEntries[] = {
      {Arch::NemotronH, "backbone.embeddings.weight", "backbone.norm_f.weight", nemotron_h_blocks},
      {Arch::MiniMax, "model.embed_tokens.weight", "model.norm.weight", minimax_blocks},
      {Arch::KimiLinear, "model.embed_tokens.weight", "model.norm.weight", kimi_linear_blocks},
  };
  for (const auto& e : kEntries)
    if (e.arch == a) return &e;
  return nullptr;
}

}  // namespace hypic
