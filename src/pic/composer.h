// Request prefill in four modes over one engine, so they are compared on the same work:
//  full   - plain prefill of the concatenated segments (the quality reference);
//  prefix - exact prefix caching: reuse the state snapshot of the longest cached token prefix
//           (snapshots are taken at segment boundaries), recompute the rest;
//  pic    - position-independent caching: every reusable segment (and the first, exact-prefix
//           segment) is prefilled in isolation from position 0 when missing, cached, and then
//           used exactly like a hit, so an answer never depends on cache history. Linear layers
//           compose S = T_body (S after the seam) + S_body; full-attention layers splice cached
//           K/V re-rotated to the segment's real start; the first `seam` tokens of every reused
//           segment after the first are recomputed through all layers at their true positions
//           (they enter the linear state exactly once, through the recomputation). The composed
//           state at the end of the context is kept as an exact-prefix snapshot (one per request);
//           a later request whose first segments are exactly those (a repeat, the next turn of a
//           conversation) starts from it and composes only the segments after it. The snapshot
//           is the state the composition itself produced, so reusing it changes no answer;
//  naive  - ablation: sum of zero-start states, no transition, no re-rotation, no seam.
// The last segment (the question) is always computed, never cached.
#pragma once
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/model.h"
#include "pic/segment_cache.h"
#include "pic/segment_store.h"

namespace hypic {

enum class PicMode { Full, Prefix, Pic, Naive };
PicMode parse_pic_mode(const std::string& s);  // throws naming the allowed values
const char* pic_mode_name(PicMode m);

struct PicOptions {
  PicMode mode = PicMode::Pic;
  int seam = 8;          // recomputed head tokens of each reused segment after the first
  int tail_seam = 0;     // recomputed last tokens of those segments too (both-ends seams; off by default)
  bool rerotate = true;  // re-rotate cached keys to the segment's real start (pic only)
  // Stop after the context, leaving the question (last segment) unprocessed: the state then
  // holds the context only and logits is undefined. For drift measurements.
  bool skip_question = false;
};

struct CacheReport {
  int hit_segments = 0;
  int miss_segments = 0;
  int64_t reused_tokens = 0;    // tokens taken from cache without recomputation (both kinds)
  int64_t computed_tokens = 0;  // tokens run through the model for this request
  int64_t prefix_tokens = 0;    // of reused_tokens: from an exact-prefix snapshot (prefix, pic, naive)
};

// An entry being built in isolation over several calls (PicEngine::step_build): the segment's
// tokens go through every layer build_chunk() at a time, so that a server can interleave a long
// segment's build with other requests' work.
struct EntryBuild;
// A composition being run over several calls (PicEngine::step_compose).
struct ComposeRun;
// Prefix caching being run over several calls (PicEngine::step_prefix).
struct PrefixRun;

// One PIC request (pic and naive modes) as every caller runs it (CLI, eval, the server): each
// context segment's part with its cache key, position and seams, the entry found or built for it,
// and what is still missing. PicEngine::plan() looks every entry up once (memory, then disk),
// build() makes one missing entry in isolation, compose() prefills from a complete plan; its
// report follows from the plan (a segment built for this request is a miss and computed).
struct PicPart {
  SegmentKey key;                                // ids, seam and tail under this model
  int64_t pos = 0, len = 0, head = 0, tail = 0;  // cached body: [head, len - tail)
  std::shared_ptr<const SegmentEntry> entry;     // pinned; null while missing, and without a body
  bool built = false;                            // made for this request (not a cache hit)
  std::shared_ptr<EntryBuild> building;          // a build in steps under way (build_step)
  // A segment no longer than its seams is recomputed whole in context: nothing of it is worth
  // caching, so it has no entry (and costs no memory or isolated prefill).
  bool has_body() const { return head + tail < len; }
  bool missing() const { return has_body() && !entry; }
};

struct PicPlan {
  PicOptions opt;
  std::vector<PicPart> parts;   // the context segments (all but the last, the question)
  size_t next_missing() const;  // the first part still without its entry, or parts.size()
};

// The seams of context segment i (head, tail): the first segment sits at its true position 0 and
// is reused whole; naive composes without seams.
std::pair<int, int> seam_widths(size_t i, const PicOptions& opt);

struct PrefillResult {
  SequenceState state;  // ready for decoding (n_past = prompt length)
  Tensor logits;        // last row, on the backend
  CacheReport report;
};

class PicEngine {
 public:
  PicEngine(Model& model, size_t segment_cache_bytes, size_t prefix_cache_bytes = 0);
  ~PicEngine();
  // segments: token ids of each segment, in prompt order; none may be empty.
  PrefillResult prefill(const std::vector<std::vector<int32_t>>& segments, const PicOptions& opt);
  // pic / naive in steps (the server interleaves the builds with other requests' work):
  PicPlan plan(const std::vector<std::vector<int32_t>>& segments, const PicOptions& opt);
  void build(PicPlan& plan, size_t part);  // the part's entry, prefilled in isolation and cached
  // One step of that build (at most build_chunk() tokens through as many whole layers as
  // max_token_layers allows, at least one); true once the entry is cached.
  bool build_step(PicPlan& plan, size_t part, int64_t max_token_layers = std::numeric_limits<int64_t>::max());
  // A missing part's entry made elsewhere (a segment worker), in host memory: checked against the
  // part's key and this model's layer layout, moved to the device and cached as a build of this
  // request. Throws std::invalid_argument naming what does not fit; nothing is cached then.
  void adopt(PicPlan& plan, size_t part, std::shared_ptr<SegmentEntry> entry);
  // Every part with a body must have its entry (throws otherwise). opt.skip_question is the plan's.
  PrefillResult compose(const std::vector<std::vector<int32_t>>& segments, const PicPlan& plan);
  // The same in steps (the server's fairness: a prompt of many segments does not hold the engine):
  // each step composes the next segments whose seam rows total at most max_rows (at least one),
  // through every layer; the question comes in the last step. The result comes back with the last
  // step. The same computation as compose(): bitwise on the CPU, to rounding on the GPU.
  // With allow_pending the plan may still lack entries (being built elsewhere: segment workers,
  // the local builder): steps compose up to the first part without its entry and wait there until
  // supply() gives it, so the early segments are composed while later ones are still built. The
  // result is the same (bitwise on the CPU) as composing the complete plan.
  std::shared_ptr<ComposeRun> start_compose(const std::vector<std::vector<int32_t>>& segments, const PicPlan& plan,
                                            bool allow_pending = false);
  std::optional<PrefillResult> step_compose(ComposeRun& run, int64_t max_rows);
  // The part whose entry the run needs before its next step (npos: it can step).
  size_t compose_waits_for(const ComposeRun& run) const;
  // A pending part's entry, once built or adopted into the plan (its key must be the part's).
  void supply(ComposeRun& run, size_t part, std::shared_ptr<const SegmentEntry> entry);
  // Every pending part's entry that the run's plan holds now; true while some part still waits.
  bool supply(ComposeRun& run, const PicPlan& plan);
  static constexpr size_t npos = static_cast<size_t>(-1);
  // Prefix mode in steps (a long uncached context does not hold the engine either): start takes
  // the longest cached exact prefix ending at a segment end; each step recomputes at most
  // max_tokens more (at least one), snapshotting every segment end it passes; the question is left
  // out with skip_question. The same computation as prefill() in prefix mode on the CPU.
  std::shared_ptr<PrefixRun> start_prefix(const std::vector<std::vector<int32_t>>& segments, bool skip_question);
  std::optional<PrefillResult> step_prefix(PrefixRun& run, int64_t max_tokens);
  SegmentCache& cache() { return cache_; }
  // pic / naive: how many leading context segments an exact-prefix snapshot covers for this
  // request now (their seams are not recomputed; their bodies' K/V still come from the entries);
  // 0 for the other modes.
  size_t cached_prefix_segments(const std::vector<std::vector<int32_t>>& segments, const PicOptions& opt);
  // Optional disk tier (--cache-dir): memory misses look on disk before computing, new entries are
  // written through. Loaded entries are also checked against this model's layer layout and shapes.
  // Disk errors never fail a request. Call before serving requests.
  void attach_store(std::shared_ptr<SegmentStore> store);
  // Optional host tier between memory and the disk (GPU backends; --host-cache-mib): entries
  // evicted from GPU memory are kept in page-locked host memory up to `bytes`, and a request that
  // finds its entries there copies them back layer by layer while it starts (SegmentCache).
  void attach_host_tier(size_t bytes) { cache_.attach_host_tier(model_.backend(), bytes); }
  // Convenience: a SegmentStore over `dir` on this model's backend, attached and returned.
  std::shared_ptr<SegmentStore> attach_cache_dir(const std::string& dir,
                                                 size_t disk_budget_bytes = std::numeric_limits<size_t>::max());
  Model& model() { return model_; }
  // Drift experiment for the choice of entry dtype (issue 11): new entries get their transition
  // operators T (EntryRounding::T) or every summary tensor (All: T, S, conv tails, K, V) rounded to
  // bf16 values, kept in f32. Measures what bf16 storage would cost in fidelity; saves no memory.
  enum class EntryRounding { None, T, All };
  void set_entry_rounding(EntryRounding r) { rounding_ = r; }
  // Storage of dense transitions T in new entries. Auto: bf16 where the backend computes in reduced
  // precision (the GPU outside precise mode), f32 where it is exact (the CPU, precise mode). bench
  // fidelity measured no drift from bf16 T on either backend, and T is 30-40% of a
  // 0.5-2k-token entry (docs/pic.md). The backends compose with either (the GPU's chain kernel
  // reads bf16 T as it stages it), so an entry of either kind works on either backend.
  enum class TransitionDType { Auto, F32, BF16 };
  void set_transition_dtype(TransitionDType d) { t_dtype_ = d; }
  // Short bodies (fewer tokens than make their recurrence inputs as large as T and S, and within
  // one build chunk) are kept in compact form by default; off: every body as T and S (tests, A/B).
  void set_compact_entries(bool on) { compact_ = on; }
  bool compact_body(int64_t body_tokens) const;

  // The summary of one segment computed in isolation from position 0 (exposed for tests).
  std::shared_ptr<SegmentEntry> build_entry(const std::vector<int32_t>& ids, int seam, int tail = 0);
  // The same in steps: start, then step until an entry comes back (not yet cached: insert it with
  // cache().insert). Every build runs in chunks of build_chunk() tokens, the backend's prefill
  // chunk, so an entry is the same whether built in one call or in steps.
  // A step takes the next chunk through as many whole layers as max_token_layers (tokens times
  // layers) allows, at least one, so a server can bound the time of one step; the entry is the
  // same whatever the steps.
  std::shared_ptr<EntryBuild> start_build(const std::vector<int32_t>& ids, int seam, int tail = 0);
  std::shared_ptr<SegmentEntry> step_build(EntryBuild& build,
                                           int64_t max_token_layers = std::numeric_limits<int64_t>::max());
  int64_t build_chunk() const { return model_.backend().prefill_chunk(); }
  // Memory, then the disk tier (verified): the cached entry for a key, or null.
  std::shared_ptr<const SegmentEntry> find(const std::vector<int32_t>& ids, int seam, int tail = 0) {
    return lookup(SegmentKey{model_.fingerprint(), seam, tail, ids});
  }
  // The cached entry for a segment: memory, then the disk tier (verified against this model),
  // else built in isolation and inserted. Counts a hit or a miss in rep. The returned pointer
  // pins the entry.
  std::shared_ptr<const SegmentEntry> get_or_build(const std::vector<int32_t>& ids, int seam, int tail,
                                                   CacheReport& rep);

 private:
  PrefillResult prefill_full(const std::vector<std::vector<int32_t>>& segs, bool skip_question);
  PrefillResult prefill_prefix(const std::vector<std::vector<int32_t>>& segs, bool skip_question);
  std::shared_ptr<const SegmentEntry> lookup(const SegmentKey& key);  // memory, then disk (verified)
  void finish_entry(SegmentEntry& e);  // bf16 rounding (set_entry_rounding) and byte count

  Model& model_;
  SegmentCache cache_;
  std::string check_entry(const SegmentEntry& e) const;  // "" when e fits this model
  void init_expected_shapes();
  std::vector<Shape> expect_;  // per layer: T, S, conv_tail (linear) or k row, v row (full) shapes
  struct PrefixCache;
  std::unique_ptr<PrefixCache> prefix_;
  TransitionDType t_dtype_ = TransitionDType::Auto;
  EntryRounding rounding_ = EntryRounding::None;
  bool compact_ = true;
};

}  // namespace hypic
