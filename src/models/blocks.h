// Decoder blocks of the architectures beyond Qwen's, one file each (nemotron_h.cpp): Model keeps the
// embedding, the head, the per-sequence states and the batching, and hands each layer's work to the
// architecture's blocks. Internal to src/models.
#pragma once
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "backend/backend.h"
#include "models/architectures.h"
#include "models/config.h"
#include "models/model.h"

namespace hypic {

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

}  // namespace hypic
