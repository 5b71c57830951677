// A loaded hybrid-attention model (Qwen3.5 dense/MoE and Qwen3-Next here; Nemotron-H, MiniMax and
// Kimi-Linear through their own files, models/blocks.h): weights on a backend and a
// layer-by-layer forward that the engine (plain prefill/decode) and PIC (segment summaries,
// composition, seams) both drive.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "models/config.h"

namespace hypic {

// Where weights come from: a checkpoint folder, or seeded random values for benchmarks.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual bool has(const std::string& name) const = 0;
  // Host tensor; throws naming the tensor, expected and found shape on mismatch.
  virtual Tensor get(const std::string& name, const Shape& expected) const = 0;
  // A matrix [N, K] whose K input columns may stay in the source's own order of column blocks where
  // putting them in Hugging Face's order would change its values (quantized blocks wider than the
  // blocks to move). When `col_order` comes back non-empty, the columns are col_order.size() equal
  // blocks and block p holds Hugging Face's block col_order[p]: x's columns go through
  // Backend::gather_col_blocks(x, col_order) before the product. Empty: get()'s tensor, in order
  // (the default).
  virtual Tensor get_with_col_order(const std::string& name, const Shape& expected,
                                    std::vector<int64_t>& col_order) const {
    col_order.clear();
    return get(name, expected);
  }
  virtual std::string describe() const = 0;
};

class WeightStore;
std::unique_ptr<WeightSource> weights_from_store(const WeightStore& store);
// Deterministic random weights of the given dtype for any requested name/shape (benchmarks on
// real shapes without a checkpoint). Norm weights get values near their identity.
std::unique_ptr<WeightSource> random_weights(uint64_t seed, DType dtype);
// `inner`'s matrices quantized to `to` (Q8_0, Q4_K or Q6_K) as they load: every 2-D weight whose
// rows are whole blocks, except the MoE routers (mlp.gate, shared_expert_gate: routing is kept in
// full precision, as llama.cpp does); everything else passes through. With Q4_K the token
// embedding (and a tied head) is Q6_K, as in llama.cpp's Q4_K_M.
std::unique_ptr<WeightSource> quantized_weights(std::unique_ptr<WeightSource> inner, DType to);

// Per-layer recurrent / attention state of one sequence.
struct LayerState {
  Tensor conv;  // linear layers: [K-1, conv_dim], the last K-1 pre-conv inputs
  Tensor ssm;   // linear layers: [Hv, dk, dv]
  Tensor k, v;  // full layers: [capacity, Hkv, D] (rows are absolute positions)
};

struct SequenceState {
  std::vector<LayerState> layers;
  int64_t n_past = 0;    // tokens consumed
  int64_t capacity = 0;  // KV rows allocated in full layers
};

struct ForwardOptions {
  bool all_logits = false;  // logits for every input row instead of only the last
};

// What a linear layer does to a sequence's state right after one span's token mixer (also after
// an empty span), as data rather than a callback, so that work holding it can be recorded and
// replayed: PIC composes a cached segment body into the running state there, between one seam and
// the next, and keeps the state after the context as an exact-prefix snapshot. In order:
struct SpanAfter {
  const Tensor* T = nullptr;  // S <- T S + B ([Hv, dk, dk], [Hv, dk, dv]); T null: S <- S + B
  const Tensor* B = nullptr;  //   (B null: the recurrent state is left alone)
  // Or S <- the recurrence over these inputs from S (a body in compact form: the same T S + B).
  const RecurrenceInputs* replay = nullptr;
  const Tensor* conv = nullptr;  // conv state <- conv (the cached body's conv tail)
  LayerState* keep = nullptr;    // copies of the recurrent and conv state are stored here
  bool any() const { return B || replay || conv || keep; }
};

// One sequence's share of a layer call: its state, the position of its first row, its rows.
struct LayerSpan {
  LayerState* state;
  int64_t pos0;
  int64_t rows;
  Tensor* transition = nullptr;        // linear layers: receives T_C of this span when set
  SpanAfter after;                     // linear layers: applied right after this span's mixer
  RecurrenceInputs* record = nullptr;  // linear layers: receives copies of this span's recurrence inputs
};

// One sequence in a batched forward: new tokens appended to its state.
struct BatchItem {
  SequenceState* state;
  std::span<const int32_t> ids;
};

class Model {
 public:
  // Builds the model from a weight source. Throws with the tensor name and shapes on mismatch.
  Model(ModelConfig cfg, const WeightSource& weights, Backend& be);
  ~Model();

  const ModelConfig& config() const { return cfg_; }
  Backend& backend() const { return be_; }
  int64_t parameter_count() const { return n_params_; }
  size_t weight_bytes() const { return weight_bytes_; }
  // Weight bytes one decode step of `batch` tokens reads at least once: everything but the rows of
  // an untied embedding table it does not look up, with the routed experts counted at the
  // expected share a batch selects (1 - (1 - k/E)^batch under uniform routing).
  double step_weight_bytes(int64_t batch) const;
  // FLOPs of one token through the decoder layers, attending to `context` earlier positions: 2 per
  // weight it multiplies (routed experts at the expected share k/E), plus its token mixers'
  // recurrence and attention. The LM head is head_flops() per row of logits.
  double flops_per_token(double context) const;
  double head_flops() const;
  // Identifies config + weights (names, shapes, dtypes and sampled bytes of every tensor); part
  // of every cache key so entries never cross models.
  uint64_t fingerprint() const { return fingerprint_; }

  SequenceState new_state(int64_t capacity = 0) const;
  // Grows the KV rows of every full layer to hold at least n positions (amortised doubling).
  void reserve(SequenceState& st, int64_t n) const;
  // Deep copy of a state (for snapshots).
  SequenceState clone_state(const SequenceState& st) const;

  // Runs ids at positions n_past.. through every layer, advancing st. Returns logits [R, V]
  // (R = 1, or ids.size() with all_logits) on the backend's device.
  Tensor forward(std::span<const int32_t> ids, SequenceState& st, const ForwardOptions& opt = {});
  // Several sequences in one pass (continuous batching: decode steps of many requests, possibly
  // with a prefill span among them). Weight GEMMs run once over all rows; mixers per sequence.
  // Returns logits [items, V] of each sequence's last new token.
  Tensor forward_batch(std::span<const BatchItem> items);

  // Building blocks for PIC.
  Tensor embed(std::span<const int32_t> ids);
  // x [T, H] in/out: one decoder layer (norm, mixer, residual, norm, MLP/MoE, residual) over
  // positions pos0.. with state ls. For a linear layer, `transition` (if given, [Hv, dk, dk])
  // receives the span's transition operator T_C.
  void layer_forward(int64_t layer, Tensor& x, LayerState& ls, int64_t pos0, Tensor* transition = nullptr);
  // Rows of x are the spans' tokens concatenated, each span against its own state.
  void layer_forward(int64_t layer, Tensor& x, std::span<const LayerSpan> spans);
  // Final norm + LM head over x [R, H] -> logits [R, V].
  Tensor logits(const Tensor& x);
  // Applies `a` to a linear layer's state (what layer_forward does after a span's mixer).
  void apply_after(LayerState& ls, const SpanAfter& a);
  // Its two halves: the recurrent state's work (replay, composition, snapshot) and the conv
  // state's (cached tail, snapshot); layer_forward runs every conv before any recurrence.
  void apply_after_state(LayerState& ls, const SpanAfter& a);
  void apply_after_conv(LayerState& ls, const SpanAfter& a);
  // Runs a linear layer's recurrence over recorded inputs (LayerSpan::record) from ssm [Hv, dk, dv],
  // advancing it in place.
  void replay(const RecurrenceInputs& in, Tensor& ssm);

  // Whether PIC may keep short segment bodies in compact form (recurrence inputs) for this model.
  bool compact_bodies() const;
  // Shape of a linear layer's segment transition T_C: [Hv, dk, dk], or [Hv, 1, 1] where every
  // transition is a scaled identity per head (Mamba2, lightning attention).
  Shape transition_shape() const;

  // Decode steps (forward_batch with one token per sequence, forward of one token) run each mixer
  // once over the batch from device tables of positions and state addresses; on a backend with
  // graphs the step is recorded once per batch size and replayed (HYPIC_GRAPHS=0 or
  // set_step_graphs(false): every step runs op by op). Results are the same either way.
  void set_step_graphs(bool on) { step_graphs_ = on; }
  bool step_graphs() const { return step_graphs_; }
  // Batch sizes whose step is currently held as a replayable graph.
  int64_t captured_steps() const;

 private:
  struct Impl;
  struct StepRefs;
  void layer_forward(int64_t layer, Tensor& x, std::span<const LayerSpan> spans, const StepRefs* step);
  Tensor decode_step(std::span<const BatchItem> items);
  ModelConfig cfg_;
  Backend& be_;
  std::unique_ptr<Impl> impl_;
  int64_t n_params_ = 0;
  size_t weight_bytes_ = 0;
  size_t expert_bytes_ = 0;    // routed experts, all layers
  size_t embed_bytes_ = 0;     // the embedding table when it is not also the head
  int64_t embed_params_ = 0;   // its values (a lookup, not a product)
  int64_t routed_params_ = 0;  // routed experts' values, all layers
  uint64_t fingerprint_ = 0;
  bool step_graphs_ = true;
};

}  // namespace hypic
