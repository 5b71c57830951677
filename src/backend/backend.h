// The op layer. Model, PIC and engine code call only these ops on tensors that live on the
// backend's device; each backend (CPU now, CUDA next) implements them. Nothing above this
// interface may touch tensor memory directly except through to_host()/to_device().
//
// Conventions (all backends):
//  * activations are f32; weights may be f32, bf16 or f16 and are used in place (no upcast copy);
//  * a "linear" weight has the torch layout [out_features, in_features]: y = x W^T;
//  * linear-attention states are per head [d_k, d_v], updated by left multiplication:
//    S_t = A_t S_{t-1} + B_t, output o_t = S_t^T q_t. Transition operators are [d_k, d_k].
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "linear/recurrence.h"
#include "tensor/tensor.h"

namespace hypic {

// The inputs of gated_delta_rule over a span (k [n, Hk, dk] before its L2 norm, v [n, Hv, dv],
// g and beta [n, Hv]), kept so that the span can be run again later from another state: running
// them from S gives T_C S + S(C|0) of the span exactly (it is the recurrence itself), in
// n (Hk dk + Hv dv + 2 Hv) floats instead of the Hv dk (dk + dv) of T_C and S(C|0). The compact
// form of a short segment body in a PIC entry.
struct RecurrenceInputs {
  Tensor k, v, g, beta;
  bool defined() const { return k.defined(); }
  int64_t rows() const { return k.defined() ? k.dim(0) : 0; }
};

// Routed experts of one MoE layer, one view per expert ([I,H], [I,H], [H,I]): SwiGLU experts,
// down(silu(gate x) * up x); with `gate` empty, ReLU^2 experts, down(relu(up x)^2) (Nemotron-H).
struct ExpertWeights {
  std::vector<Tensor> gate, up, down;
};

// How a MoE layer's router logits [T, E] pick each token's experts and their weights (the host
// forms in backend/moe_routing.h define both): softmax scores, top-k (ties to the lower expert),
// renormalised when norm_topk (Qwen, MiniMax); or, with `sigmoid`, DeepSeek-V3's scheme: sigmoid
// scores, experts chosen by score + bias among the topk_group best of n_group groups, the chosen
// scores as weights (over their sum when norm_topk), times `scaling` (Nemotron-H, Kimi-Linear).
struct MoeRouter {
  int top_k = 1;
  bool norm_topk = true;
  bool sigmoid = false;
  Tensor bias;  // sigmoid: f32 [E] on the backend's device, or undefined for none
  int64_t n_group = 1, topk_group = 1;
  float scaling = 1.f;
};

// Another process's shared memory could not be mapped here (another host, no IPC between the
// processes, a handle already freed): what() says which call failed.
struct SharedMemoryError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual std::string name() const = 0;
  virtual int num_threads() const = 0;

  // ---- memory -------------------------------------------------------------------------------
  virtual Tensor alloc(DType dt, Shape shape) = 0;  // zero-filled
  // Left unset (no fill: no memset pass on the CPU, no launch on a GPU), for outputs an op writes
  // in full. Poisoned in debug builds and under HYPIC_POISON_UNINIT=1 (Tensor::uninitialized).
  virtual Tensor alloc_uninit(DType dt, Shape shape) { return alloc(dt, std::move(shape)); }
  // Makes a host tensor usable by this backend. CPU returns the same tensor (no copy), so
  // memory-mapped weights stay mapped rather than duplicated.
  virtual Tensor to_device(const Tensor& host) = 0;
  virtual Tensor to_host(const Tensor& t) = 0;
  virtual void copy(const Tensor& src, Tensor& dst) = 0;  // same dtype and numel
  virtual void fill(Tensor& t, float value) = 0;          // f32 tensors
  // dst <- src with a dtype change between f32 and bf16/f16 (either way; same numel; rounding to
  // nearest even). The base class goes through the host.
  virtual void convert(const Tensor& src, Tensor& dst);
  virtual void synchronize() {}
  // Drops what a profiling backend recorded so far (HYPIC_CUDA_PROFILE), so that a benchmark's
  // profile covers its timed requests and not its warm-up.
  virtual void profile_reset() {}
  // Rows per prefill chunk (Model::forward splits long prompts; results do not depend on it): large
  // enough to amortise per-call costs, small enough to bound activation memory.
  virtual int64_t prefill_chunk() const { return 1024; }
  // Peak bytes of device memory this backend has held for tensors (-1: not tracked).
  virtual int64_t peak_memory_bytes() const { return -1; }
  // Device memory still free for tensors: the driver's free bytes plus what this backend's caching
  // allocator holds unused (-1: host memory, see the machine's RAM instead).
  virtual int64_t free_memory_bytes() const { return -1; }

  // Precision of products. Default (false): a backend may round activations to bf16/f16 for its
  // tensor cores (the GPU does in products with half-precision weights and in prefill attention,
  // as bf16 checkpoints are served elsewhere). true: every product is f32-exact in the activations
  // (the CPU always is; the GPU splits each f32 activation into three half-precision parts and runs
  // three products, and uses its f32 attention kernel), for conformance and quality checks.
  virtual void set_precise(bool exact) {}
  virtual bool precise() const { return false; }
  // Why set_precise(false) left this backend precise, for the error that refuses the request.
  virtual std::string imprecise_unavailable() const { return "not implemented for this backend"; }
  // Products whose every row comes out the same whatever other rows share the call (one kernel
  // and one accumulation order at any row count). PIC composes all seams in one call under it and
  // still continues a reused exact prefix bit for bit. Returns whether the mode is now as asked
  // (false: this backend has no such mode).
  virtual bool set_row_independent(bool on) { return !on; }

  // Host bytes into an existing tensor of this backend (small per-step inputs: ids, tables).
  virtual void write(Tensor& dst, const void* src, size_t bytes);

  // ---- copies beside the work (the segment cache's host tier) ------------------------------
  // Host memory this backend copies from and to fastest: page-locked on a GPU, so that copies
  // run asynchronously on its copy engines; ordinary memory elsewhere. A u8 tensor of `bytes`,
  // carved into tensors with Tensor::view.
  virtual Tensor alloc_host(size_t bytes);
  // The end of a group of copies queued beside the backend's work.
  class Fence {
   public:
    virtual ~Fence() = default;
  };
  // Copies each src[i] (host) into dst[i] (this backend's, same dtype and size) on a queue of
  // their own: they start after the work queued so far and overlap the work queued later, which
  // must wait(fence) before it reads dst. src stays alive until the fence goes away. Null: the
  // copies are already done (the base: copy() one by one).
  virtual std::shared_ptr<Fence> copy_async(std::span<const Tensor> src, std::span<Tensor> dst);
  // Work queued after this starts once f's copies are done; the host does not wait.
  virtual void wait(const Fence& f) {}

  // ---- memory shared with other processes of this host (segment workers) ------------------
  // A worker hands an entry's tensors to a combine node on the same host device to device (CUDA
  // IPC on a GPU) instead of through host memory: share() packs tensors at the given byte offsets
  // into one buffer that another process can map, and names it by an opaque handle; the buffer
  // lives while `keep` does. Null where this backend cannot share memory.
  struct Shared {
    std::string handle;
    std::shared_ptr<void> keep;
  };
  virtual std::optional<Shared> share(std::span<const Tensor* const> src, std::span<const uint64_t> offsets,
                                      uint64_t bytes) {
    return std::nullopt;
  }
  // Whether copy_from_shared can map other processes' buffers here.
  virtual bool can_map_shared() const { return false; }
  // Copies the pieces at `offsets` of another process's shared buffer into dst (tensors of this
  // backend). Throws SharedMemoryError where the handle cannot be mapped.
  virtual void copy_from_shared(const std::string& handle, uint64_t bytes, std::span<const uint64_t> offsets,
                                std::span<Tensor> dst);
  // A checksum of tensors as if they lay at `offsets` of one buffer: the sum (mod 2^64) over
  // every 4-byte word w at word index i (offset/4 + word; a last partial word zero-extended) of
  // splitmix64(i << 32 | w). Integer sums do not depend on order, so a GPU adds the words in
  // parallel and still agrees with this host loop; offsets must be multiples of 4.
  virtual uint64_t payload_checksum(std::span<const Tensor* const> ts, std::span<const uint64_t> offsets);

  // ---- captured steps -----------------------------------------------------------------------
  // A recorded sequence of this backend's work, run again with one launch. Everything it reads or
  // writes keeps the addresses it had when recorded: inputs that change between replays go through
  // device tensors (write()), never host values.
  class Graph {
   public:
    virtual ~Graph() = default;
    virtual void replay() = 0;
  };
  // Records the work fn enqueues instead of running it. Tensors fn allocates come from memory
  // reserved for the graph for its lifetime. Returns null where this backend has no graphs, or
  // where fn did something a graph cannot hold (a host round trip); fn's work has then not run.
  virtual std::unique_ptr<Graph> capture(const std::function<void()>& fn) { return nullptr; }

  // ---- dense --------------------------------------------------------------------------------
  // y[M,N] = x[M,K] W[N,K]^T (+ y when accumulate).
  virtual void matmul(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate = false) = 0;
  // Several products of one x: y_i = x w_i^T (one launch on the GPU for decode-sized x).
  virtual void matmul_many(const Tensor& x, std::initializer_list<Tensor> w, std::initializer_list<Tensor> y);
  // h = silu(x gate^T) * (x up^T), the first half of a SwiGLU MLP (one launch on the GPU for
  // decode-sized x, which never writes the two products).
  virtual void matmul_swiglu(const Tensor& x, const Tensor& gate, const Tensor& up, Tensor& h);
  // out[n, H] = table[ids[n], :] converted to f32.
  virtual void embedding(const Tensor& table, std::span<const int32_t> ids, Tensor& out) = 0;

  // ---- elementwise and norms (rows = numel / last dim) ---------------------------------------
  // out = x * rsqrt(mean(x^2) + eps) * (one_plus_w ? 1 + w : w), w of length D.
  virtual void rms_norm(const Tensor& x, const Tensor& w, float eps, bool one_plus_w, Tensor& out) = 0;
  // out = rms_norm(x) * w * silu(z)   (plain w, as in the gated output norm of GDN)
  virtual void rms_norm_gated(const Tensor& x, const Tensor& z, const Tensor& w, float eps, Tensor& out) = 0;
  virtual void add(const Tensor& a, const Tensor& b, Tensor& out) = 0;  // out = a + b
  // x += d, then out = rms_norm(x) (the residual add and the next norm of a decoder layer).
  virtual void add_rms_norm(Tensor& x, const Tensor& d, const Tensor& w, float eps, bool one_plus_w, Tensor& out);
  virtual void silu_mul(const Tensor& gate, const Tensor& up, Tensor& out) = 0;  // silu(gate) * up
  // x * sigmoid(gate); gate is x's shape, or [rows, 1] (one gate per row, broadcast).
  virtual void sigmoid_mul(const Tensor& x, const Tensor& gate, Tensor& out) = 0;
  // Copies columns [col, col + width) of every row of src[R, C] into dst[R, width].
  virtual void copy_cols(const Tensor& src, int64_t col, Tensor& dst) = 0;
  // Writes src[R, width] into columns [col, col + width) of dst[R, C].
  virtual void set_cols(const Tensor& src, int64_t col, Tensor& dst) = 0;
  // Column blocks of every row in another order: src and dst [R, C] (rows = numel / last dim),
  // C = order.size() blocks of C / order.size() columns; dst's block p <- src's block order[p]
  // (`order` a permutation). The activations of a weight whose input columns stay in a file's
  // order of blocks (WeightSource::get_with_col_order).
  virtual void gather_col_blocks(const Tensor& src, std::span<const int64_t> order, Tensor& dst);
  // Row ranges copied between tensors in one call (one launch on the GPU): dst rows [dst_row,
  // dst_row + rows) <- src rows [src_row, src_row + rows), a row being everything after dim 0 (src
  // and dst of a piece share dtype and row size). A piece with a rope_shift (f32 [*, H, D] rows) is
  // rotated on the way by that many positions as rope_neox would over rot_dim dims: PIC splices
  // keys cached at relative positions at their place in a prompt (RoPE angles add). No piece may
  // write where another piece reads or writes.
  struct RowCopy {
    const Tensor* src = nullptr;
    int64_t src_row = 0;
    Tensor* dst = nullptr;
    int64_t dst_row = 0, rows = 0, rope_shift = 0;
  };
  virtual void copy_rows(std::span<const RowCopy> pieces, int rot_dim = 0, double theta = 0);

  // ---- positions ----------------------------------------------------------------------------
  // In-place NeoX (half-split) rotary embedding of the first rot_dim dims of x[T, H, D];
  // row t is rotated by angle positions[t] * theta^(-2i/rot_dim).
  virtual void rope_neox(Tensor& x, std::span<const int64_t> positions, int rot_dim, double theta) = 0;

  // ---- attention ----------------------------------------------------------------------------
  // Causal GQA attention of q[T, Hq, D] over k[S, Hkv, D], v[S, Hkv, Dv] (the first S rows
  // of the cache are valid): query i sees keys j <= q_offset + i. out[T, Hq, Dv].
  virtual void attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t kv_len, int64_t q_offset,
                         float scale, Tensor& out) = 0;
  // The same for several spans of one sequence at once (a PIC composition's seams and question):
  // q's rows are the spans' rows in order, span s's row t sits at position pos0 + t and sees keys
  // j <= pos0 + t; every span's K/V rows are already in k and v. The base class makes one
  // attention() call per span (the CPU's results stay those of separate calls); the GPU runs one
  // launch for all rows, its keys split across blocks when the rows are few.
  struct RowSpan {
    int64_t pos0 = 0, rows = 0;
  };
  virtual void attention_spans(const Tensor& q, const Tensor& k, const Tensor& v, std::span<const RowSpan> spans,
                               float scale, Tensor& out);

  // ---- linear-attention layer pieces ---------------------------------------------------------
  // Depthwise causal conv1d over time with SiLU: x[T, C], w[C, K], state[K-1, C] holds the
  // previous K-1 inputs (oldest first) and is advanced in place. out[T, C].
  virtual void causal_conv1d_silu(const Tensor& x, const Tensor& w, Tensor& state, Tensor& out) = 0;
  // The same over consecutive spans of x's rows against one state: each span's rows, then the
  // state becomes *after where it is set (a PIC composition: each seam is followed by its cached
  // body, whose conv tail is the state after it). One launch for all spans on the GPU.
  struct ConvSpan {
    int64_t rows = 0;
    const Tensor* after = nullptr;  // [K-1, C] like state
  };
  // out is the result's columns in blocks, each a [T, C_i] tensor of its own with sum C_i = C: a GDN
  // conv writes q, k and v straight into their tensors (no copy splits them afterwards).
  virtual void causal_conv1d_silu_spans(const Tensor& x, const Tensor& w, std::span<const ConvSpan> spans,
                                        Tensor& state, std::span<Tensor> out);
  void causal_conv1d_silu_spans(const Tensor& x, const Tensor& w, std::span<const ConvSpan> spans, Tensor& state,
                                Tensor& out) {
    causal_conv1d_silu_spans(x, w, spans, state, std::span<Tensor>(&out, 1));
  }
  // Qwen3.5/Qwen3-Next gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b).
  virtual void gdn_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, Tensor& g,
                         Tensor& beta) = 0;
  // Gated delta rule over a span of tokens from `state` (advanced in place).
  // q, k: [T, Hk, dk]; v: [T, Hv, dv]; g (log decay), beta: [T, Hv]; state: [Hv, dk, dv] f32.
  // Key heads are repeat-interleaved over value heads (Hv % Hk == 0). q and k are L2-normalised
  // inside when l2norm_qk, and q is scaled by dk^-0.5. out: [T, Hv, dv].
  // If transition is defined ([Hv, dk, dk] f32) it receives T_C = A_T ... A_1 of this span,
  // computed in the same pass (segment summary for position-independent caching).
  virtual void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                bool l2norm_qk, Tensor& state, Tensor& out, Tensor* transition = nullptr) = 0;

  // A linear layer's recurrence over consecutive spans of one state's rows with a reused body
  // composed in after each (a PIC composition): for each link in order, the recurrence over its
  // next `rows` rows of q..beta (outputs to out's rows), then its body: a compact one replayed (the
  // recurrence over its inputs rk, rv, rg, rbeta from the state reached, rk standing in for the
  // queries, outputs dropped), then state <- T state + B (no T: state + B). The base class runs
  // these span ops one by one; the CPU runs each head's chain on one thread with the bits of those
  // separate calls; the GPU runs the whole chain in one launch. `state` may be replaced by a new
  // tensor.
  struct GdnLink {
    int64_t rows = 0;
    const Tensor *rk = nullptr, *rv = nullptr, *rg = nullptr, *rbeta = nullptr;
    const Tensor *T = nullptr, *B = nullptr;
  };
  virtual void gated_delta_chain(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                 bool l2norm_qk, Tensor& state, Tensor& out, std::span<const GdnLink> links);

  // ---- the other families (Mamba2, lightning, KDA: Nemotron-H, MiniMax, Kimi-Linear) -----------
  // The recurrence of family r.family (linear/recurrence.h) over a span of one sequence's tokens
  // from `state` (advanced in place): q, k [T, Hk, dk]; v, out [T, Hv, dv]; g the log decay, [T, Hv]
  // for scalar decays or [T, Hv, dk] for channel decays (undefined otherwise); beta [T, Hv] for
  // delta families (undefined otherwise); log_gamma [Hv] for fixed decays (undefined otherwise);
  // state [Hv, dk, dv]. q and k are L2-normalised when l2norm_qk, then q is multiplied by q_scale.
  // transition, when given, receives T_C of the span: [Hv, 1, 1], the factor of a scaled identity
  // (families with neither a delta rule nor a channel decay), or dense [Hv, dk, dk].
  struct Recurrence {
    linear::Family family = linear::Family::LinearAttention;
    bool l2norm_qk = false;
    float q_scale = 1.f;
  };
  virtual void linear_recurrence(const Recurrence& r, const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& g, const Tensor& beta, const Tensor& log_gamma, Tensor& state,
                                 Tensor& out, Tensor* transition = nullptr) = 0;
  // The same for several sequences at once (a batch of decode steps, or prompts of several
  // sequences): run i is the next rows[i] rows of q..beta and out, from *states[i] (advanced in
  // place). No transitions. The base class calls linear_recurrence run by run (so the CPU's results
  // are those of separate calls); the GPU runs all the runs in one launch.
  virtual void linear_recurrence_runs(const Recurrence& r, const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& g, const Tensor& beta, const Tensor& log_gamma,
                                      std::span<Tensor* const> states, std::span<const int64_t> rows, Tensor& out);
  // Depthwise causal conv1d with a bias added before the SiLU (Mamba2's conv); otherwise as
  // causal_conv1d_silu. bias [C].
  virtual void causal_conv1d_bias_silu(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& state,
                                       Tensor& out) = 0;
  // The same for several sequences at once: run i is the next rows[i] rows of x and out, from
  // *states[i]. The base class runs them one by one; the GPU in one launch.
  virtual void causal_conv1d_bias_silu_runs(const Tensor& x, const Tensor& w, const Tensor& bias,
                                            std::span<Tensor* const> states, std::span<const int64_t> rows,
                                            Tensor& out);
  // Mamba2's discretisation: dt = max(softplus(dt_raw + dt_bias), dt_min) per token and head, then
  // g = dt * A (the log decay) and v = dt * x. dt_raw, g [T, H]; x, v [T, H, P]; A, dt_bias [H] f32.
  virtual void mamba2_gates(const Tensor& dt_raw, const Tensor& x, const Tensor& A, const Tensor& dt_bias, float dt_min,
                            Tensor& g, Tensor& v) = 0;
  // Mamba2's output: out = w * rms_norm((y + D x) * silu(z)), the norm taken over each of `groups`
  // equal groups of a row's channels. y, x, z, out [T, H * P]; D [H]; w [H * P] (f32).
  virtual void mamba2_gated_norm(const Tensor& y, const Tensor& x, const Tensor& z, const Tensor& D, const Tensor& w,
                                 int64_t groups, float eps, Tensor& out) = 0;
  // Kimi-Linear's KDA gates: g = -A[h] * softplus(a + dt_bias) per key channel (transformers' own
  // log(1 + exp) form), beta = sigmoid(b). a, g [T, H, dk]; A [H] (exp(A_log)); dt_bias [H * dk];
  // b, beta [T, H] (all f32).
  virtual void kda_gates(const Tensor& a, const Tensor& b, const Tensor& A, const Tensor& dt_bias, Tensor& g,
                         Tensor& beta) = 0;
  // out = a * x + b * y (f32, one shape; out may be x or y).
  virtual void scale_add(const Tensor& x, float a, const Tensor& y, float b, Tensor& out) = 0;
  // x <- act(x) in place (f32): SiLU, or ReLU^2 = max(x, 0)^2 (Nemotron-H's MLP).
  enum class Activation { Silu, ReluSquared };
  virtual void activate(Activation act, Tensor& x) = 0;

  // ---- segment summaries (PIC) -----------------------------------------------------------------
  // Per head: out = alpha * (T S) + B, T [H, dk, dk], S and B [H, dk, dv]; out must not alias S.
  // T [H, 1, 1] is a scaled identity per head (Mamba2, lightning: their T_C).
  virtual void compose_state(const Tensor& T, const Tensor& S, const Tensor& B, float alpha, Tensor& out) = 0;
  // Sets every [n, n] matrix of t [H, n, n] to the identity.
  virtual void set_identity(Tensor& t) = 0;

  // ---- decode steps: one call per mixer for a batch of sequences, one token each ---------------
  // Row b of the activations belongs to sequence b. `states` (I64 on this device) holds, per
  // sequence, the address of that sequence's state tensor for this layer (f32, laid out as the span
  // ops above take it); `positions` (I64 [B]) each sequence's token position. No host value of the
  // step enters these calls, so a step can be captured once and replayed for other sequences.
  // The base class implements them by reading the tables back and calling the span ops per
  // sequence (the reference the fast kernels are tested against).
  // out[n, H] = table[ids[n], :]; ids I32 [n] on this device, already checked against the table.
  virtual void embedding(const Tensor& table, const Tensor& ids, Tensor& out);
  // rope_neox with one position per row of x from positions (I64 [T]).
  virtual void rope_neox(Tensor& x, const Tensor& positions, int rot_dim, double theta);
  // x, out [B, C]; states [B] -> conv states [K-1, C].
  virtual void causal_conv1d_silu_step(const Tensor& x, const Tensor& w, const Tensor& states, Tensor& out);
  // q, k [B, Hk, dk]; v, out [B, Hv, dv]; g, beta [B, Hv]; states [B] -> [Hv, dk, dv].
  virtual void gated_delta_rule_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                     const Tensor& beta, bool l2norm_qk, const Tensor& states, Tensor& out);
  // Writes k [B, Hkv, D] and v [B, Hkv, Dv] at row positions[b] of sequence b's caches, then
  // out[b] = attention of q[b] ([B, Hq, D]) over that cache's rows 0..positions[b].
  // caches [2B]: the B key caches' addresses, then the B value caches' ([rows, Hkv, D|Dv], f32,
  // at least positions[b] + 1 rows).
  virtual void attention_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& caches,
                              const Tensor& positions, float scale, Tensor& out);

  // ---- token selection ----------------------------------------------------------------------
  // ids[r] = argmax of row r of x [R, V] (f32), ties to the lowest id as torch.argmax: greedy
  // decoding without the logits leaving the device. ids: I32 [R] on this device.
  virtual void argmax_rows(const Tensor& x, Tensor& ids);
  // ids[r] drawn from softmax(x[r] / t) by the uniform draw u in [0, 1): the first id, in id
  // order, whose running mass exceeds u times the row's mass (NaN logits have none); t = 0 is the
  // argmax (ties to the lowest id). params: F32 [R, 3] of (t, u, m) on this device; rows with
  // m != 0 never draw an id whose `mask` byte is set (U8 [V], or undefined when no row masks: a
  // padded vocabulary's ids without a token). The reference loops on the host.
  virtual void sample_rows(const Tensor& x, const Tensor& params, const Tensor& mask, Tensor& ids);

  // ---- mixture of experts -------------------------------------------------------------------
  // Each token's experts chosen from router_logits [T, E] by `router`, run on its row of x [T, H],
  // weighted sum into out [T, H] (overwritten).
  virtual void moe_experts(const Tensor& x, const Tensor& router_logits, const MoeRouter& router,
                           const ExpertWeights& experts, Tensor& out) = 0;
  // Softmax routing: top_k experts, renormalised when norm_topk.
  void moe_experts(const Tensor& x, const Tensor& router_logits, int top_k, bool norm_topk,
                   const ExpertWeights& experts, Tensor& out) {
    MoeRouter r;
    r.top_k = top_k;
    r.norm_topk = norm_topk;
    moe_experts(x, router_logits, r, experts, out);
  }
  // The end of a MoE block and its residual add in one op: x += moe_experts(xn, ...) +
  // sigmoid(shared_gate) * shared, where shared [T, H] is the shared expert's output and
  // shared_gate [T, 1] its gate logit (both undefined: no shared expert). The GPU folds it all into
  // the experts' weighted sum; the base runs moe_experts, sigmoid_mul and add in that order.
  virtual void moe_experts_add(const Tensor& xn, const Tensor& router_logits, int top_k, bool norm_topk,
                               const ExpertWeights& experts, const Tensor& shared, const Tensor& shared_gate,
                               Tensor& x);
};

// Creates a backend by name: "cpu" (threads <= 0: all cores), "cuda" or "cuda:N" (GPU N; threads
// is ignored). Throws naming the problem when the backend is unknown, not built or has no device.
std::unique_ptr<Backend> make_backend(const std::string& name, int threads = 0);
// "" when make_backend(name) can succeed here; otherwise why not (tests skip with this reason).
std::string backend_unavailable(const std::string& name);

}  // namespace hypic
