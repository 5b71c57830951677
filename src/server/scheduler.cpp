#include "server/scheduler.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "cluster/protocol.h"
#include "cluster/worker_pool.h"
#include "engine/generate.h"
#include "pic/entry_codec.h"
#include "tokenizer/tokenizer.h"

namespace hypic::server {

namespace {
// Tokens of KV reserved ahead of decoding; more comes as the sequence grows.
constexpr int64_t kDecodeReserve = 256;
}  // namespace

namespace {
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}
}  // namespace

bool Job::wait(std::vector<TokenOut>& got, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu);
  cv.wait_for(lk, timeout, [&] { return done || !out.empty(); });
  for (auto& t : out) got.push_back(std::move(t));
  out.clear();
  return done;
}

// Engine-side state of one admitted job.
struct Scheduler::Seq {
  std::shared_ptr<Job> job;
  enum class Stage { Start, Prefix, Warm, Compose, Chunked, Decode } stage = Stage::Start;
  const char* unit_did = nullptr;  // the phase label of the work the last prefill unit did
  // prefill progress
  size_t warm_next = 0;                   // segment posts: the next segment to look up or build
  std::shared_ptr<EntryBuild> seg_build;  // segment posts: that segment's build under way
  std::unique_ptr<PicPlan> plan;          // pic / naive: entries found or built so far (pinned)
  std::shared_ptr<ComposeRun> compose;    // pic / naive: the composition under way
  std::shared_ptr<PrefixRun> prefix;      // prefix: the recomputation under way
  // Combine node: per plan part, the build asked of a segment worker (null: none, or taken in).
  std::vector<std::shared_ptr<cluster::RemoteBuild>> remote;
  bool remote_sent = false;
  double build_seconds = 0;  // time spent so far on the local build under way (the local rate)
  int hits = 0, misses = 0;
  std::vector<int32_t> flat;
  size_t flat_done = 0;
  // decoding
  SequenceState st;
  Tensor logits;
  std::unique_ptr<Sampler> sampler;
  std::vector<float> masked;  // the logits row with padded ids masked (mask_padded_ids)
  std::unique_ptr<Tokenizer::StreamDecoder> dec;
  std::string text;    // decoded so far (cut at a stop string)
  size_t emitted = 0;  // bytes of text released to the handler
  int generated = 0;
  int32_t next_id = 0;
  int32_t picked = -1;  // the token chosen on the device (greedy rows), or -1
  bool finished = false;
  // The segment cache was full of entries other requests hold: this request let go of its own and
  // waits until some request lets go of entries (Scheduler::unpinned_ passes this value).
  bool cache_wait = false;
  uint64_t cache_wait_at = 0;
  bool holds_entries() const { return plan || compose; }
};

Scheduler::Scheduler(Model& model, const Tokenizer* tok, SchedulerOptions opt, Metrics& metrics)
    : model_(model), tok_(tok), opt_(opt), metrics_(metrics), engine_(model, opt.cache_budget_bytes) {
  if (opt_.max_running < 1) throw std::invalid_argument("--max-running must be >= 1");
  if (opt_.max_queue < 1) throw std::invalid_argument("--max-queue must be >= 1");
  if (opt_.prefill_chunk < 0) throw std::invalid_argument("--prefill-chunk must be >= 0");
  if (opt_.prefill_chunk == 0) opt_.prefill_chunk = model.backend().name() == "cpu" ? 512 : 2048;
  if (opt_.compose_chunk < 0) throw std::invalid_argument("--compose-chunk must be >= 0");
  if (opt_.compose_chunk == 0)
    opt_.compose_chunk = model.backend().name() == "cpu" ? std::max(opt_.prefill_chunk / 32, 1) : opt_.prefill_chunk;
  if (opt_.host_cache_bytes > 0) engine_.attach_host_tier(opt_.host_cache_bytes);
  if (!opt_.cache_dir.empty()) engine_.attach_cache_dir(opt_.cache_dir, opt_.disk_budget_bytes);
  if (!opt_.workers.empty()) {
    auto list = cluster::parse_workers(opt_.workers);
    if (list.empty()) throw std::invalid_argument("--workers: no worker address given");
#ifdef HYPIC_HAVE_CLUSTER
    cluster::PoolOptions po;
    po.deadline_min_seconds = opt_.worker_deadline_seconds;
    po.probe_seconds = opt_.worker_probe_seconds;
    po.deadline_factor = opt_.worker_deadline_factor;
    po.round_robin = opt_.worker_round_robin;
    po.host = model_.backend().can_map_shared() ? cluster::host_identity() : 0;
    metrics_.workers = static_cast<int64_t>(list.size());
    pool_ = std::make_shared<cluster::WorkerPool>(std::move(list), model_.fingerprint(), po, [this] { wake(); });
#else
    throw std::invalid_argument("--workers: this build has no segment workers (built without UCX, libucx-dev)");
#endif
  }
  if (tok_) {
    try {
      padded_ids_ = padded_ids_to_mask(model_, tok_);
      if (!padded_ids_.empty()) {
        std::vector<uint8_t> m(static_cast<size_t>(model_.config().vocab_size), 0);
        for (int32_t id : padded_ids_) m.at(static_cast<size_t>(id)) = 1;
        padded_mask_ = model_.backend().alloc_uninit(DType::U8, {static_cast<int64_t>(m.size())});
        model_.backend().write(padded_mask_, m.data(), m.size());
      }
    } catch (const std::invalid_argument& e) {
      spdlog::warn("mask_padded_ids will have no effect: {}", e.what());
    }
  }
}

Scheduler::~Scheduler() {
  stop();
}

void Scheduler::start() {
  std::lock_guard<std::mutex> g(mu_);
  if (thread_.joinable()) return;
  stopping_ = false;
  thread_ = std::thread([this] { loop(); });
}

void Scheduler::stop() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::deque<std::shared_ptr<Job>> left;
  {
    std::lock_guard<std::mutex> g(mu_);
    left.swap(queue_);
  }
  for (auto& j : left) fail(*j, 503, "the server is shutting down");
  for (auto& s : running_) fail(*s->job, 503, "the server is shutting down");
  running_.clear();
  metrics_.queue_depth = 0;
  metrics_.running = 0;
  metrics_.kv_reserved_tokens = 0;
}

bool Scheduler::submit(const std::shared_ptr<Job>& job) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stopping_ || !thread_.joinable()) return false;
    drop_cancelled_queued();  // clients that gave up while waiting do not hold queue places
    if (static_cast<int>(queue_.size()) >= opt_.max_queue) return false;
    queue_.push_back(job);
    metrics_.queue_depth = static_cast<int64_t>(queue_.size());
  }
  cv_.notify_all();
  return true;
}

// Caller holds mu_.
void Scheduler::drop_cancelled_queued() {
  for (auto it = queue_.begin(); it != queue_.end();) {
    if ((*it)->cancelled.load()) {
      fail(**it, 499, "the client closed the connection");
      metrics_.cancelled++;
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  metrics_.queue_depth = static_cast<int64_t>(queue_.size());
}

void Scheduler::fail(Job& j, int status, const std::string& msg) {
  {
    std::lock_guard<std::mutex> g(j.mu);
    if (j.done) return;
    j.error_status = status;
    j.error_message = msg;
    j.total_ms = ms_since(j.arrived);
    j.done = true;
  }
  j.cv.notify_all();
  if (j.on_done) std::exchange(j.on_done, nullptr)(j);
}

void Scheduler::beat() {
  beat_ns_ =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Scheduler::stalled_seconds() const {
  if (!busy_.load()) return 0;
  const int64_t now =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  return static_cast<double>(now - beat_ns_.load()) / 1e9;
}

void Scheduler::loop() {
  while (true) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (queue_.empty() && running_.empty()) busy_ = false;
      cv_.wait(lk, [&] { return stopping_ || !queue_.empty() || !running_.empty(); });
      if (idle_ && queue_.empty()) {
        // Every prefill waits on segment workers and nothing decodes: sleep until a build comes
        // back (wake), a job arrives, or the next deadline check.
        const uint64_t seen = wakes_;
        cv_.wait_for(lk, std::chrono::milliseconds(50), [&] { return stopping_ || !queue_.empty() || wakes_ != seen; });
      }
      if (stopping_) return;
      beat();
      busy_ = true;
      drop_cancelled_queued();
      while (static_cast<int>(running_.size()) < opt_.max_running && !queue_.empty()) {
        auto s = std::make_unique<Seq>();
        s->job = std::move(queue_.front());
        queue_.pop_front();
        running_.push_back(std::move(s));
      }
      metrics_.queue_depth = static_cast<int64_t>(queue_.size());
      metrics_.running = static_cast<int64_t>(running_.size());
    }
    try {
      step();
    } catch (const std::exception& e) {  // never expected: per-job errors are caught inside
      spdlog::error("engine iteration failed: {}", e.what());
      for (auto& s : running_) fail(*s->job, 500, std::string("engine error: ") + e.what());
      running_.clear();
    }
    for (const auto& s : running_) {
      if (s->finished && s->holds_entries()) ++unpinned_;
      if (s->finished) drop_remote(*s);
    }
    running_.erase(std::remove_if(running_.begin(), running_.end(), [](const auto& s) { return s->finished; }),
                   running_.end());
    metrics_.running = static_cast<int64_t>(running_.size());
    int64_t kv = 0;
    for (const auto& s : running_) kv += s->st.capacity;
    metrics_.kv_reserved_tokens = kv;
  }
}

void Scheduler::step() {
  idle_ = false;
  if (pool_) {
    pool_->check();
    sync_pool_metrics();
  }
  bool worked = false;
  // Client went away: free the sequence now.
  for (auto& s : running_)
    if (s->job->cancelled.load()) {
      {
        std::lock_guard<std::mutex> g(s->job->mu);
        s->job->completion_tokens = s->generated;
      }
      fail(*s->job, 499, "the client closed the connection");
      metrics_.cancelled++;
      s->finished = true;
    }
  // One prefill unit per iteration, taken in turn from the sequences still prefilling (round
  // robin): a large segment post or a long prompt cannot hold back a short request that arrives
  // after it. A short prompt (one segment of at most one prefill chunk: a chat turn, a plain
  // completion) goes ahead of the turn, so its first token waits for at most the unit in flight;
  // every fourth unit still follows the round robin, so short prompts arriving without pause
  // cannot starve a long prompt or a segment post.
  const size_t n_run = running_.size();
  auto prefilling = [this](const Seq& s) {
    return !s.finished && s.stage != Seq::Stage::Decode && !(s.cache_wait && s.cache_wait_at == unpinned_) &&
           !remote_waiting(s);
  };
  // Builds for combine nodes (segment workers) go one at a time in arrival order, not in turn with
  // each other: each entry then ships as soon as it is built and its combine node composes while
  // the next one builds, where taking turns finished all of a request's entries together at the
  // end (and switched sequences every unit). They still take turns with this node's own requests.
  auto remote_build = [](const Seq& s) { return s.job->kind == Job::Kind::Segments && s.job->segs.encode; };
  size_t remote_turn = n_run;
  for (size_t i = 0; i < n_run && remote_turn == n_run; ++i)
    if (remote_build(*running_[i]) && prefilling(*running_[i])) remote_turn = i;
  size_t first = n_run;
  if (short_first_ < 3)
    for (size_t i = 0; i < n_run && first == n_run; ++i) {
      const Seq& s = *running_[i];
      const GenSpec& g = s.job->gen;
      if (prefilling(s) && s.job->kind == Job::Kind::Generate && s.stage == Seq::Stage::Start &&
          g.segments.size() == 1 && g.prompt_tokens <= opt_.prefill_chunk)
        first = i;
    }
  for (size_t k = 0; k < n_run; ++k) {
    const size_t i = first < n_run ? first : (next_prefill_ + k) % n_run;
    auto& s = running_[i];
    if (!prefilling(*s)) continue;
    if (i != remote_turn && remote_build(*s)) continue;
    if (first < n_run) {
      ++short_first_;
    } else {
      short_first_ = 0;
      next_prefill_ = i + 1;
    }
    metrics_.prefill_chunks++;
    worked = true;
    const char* kind = unit_kind(*s);
    const auto t0 = Clock::now();
    try {
      s->unit_did = nullptr;
      if (prefill_unit(*s) && s->job->kind == Job::Kind::Generate) start_decode(*s);
      model_.backend().synchronize();  // the unit's device work counts in its phase
      // A unit may start in one stage and work in the next (a request whose entries are all
      // cached composes in the unit that found them): the label is what it did last.
      metrics_.observe_phase(s->unit_did ? s->unit_did : kind, ms_since(t0) / 1000.0);
    } catch (const std::length_error& e) {
      fail(*s->job, 503, e.what());
      s->finished = true;
    } catch (const std::invalid_argument& e) {
      fail(*s->job, 400, e.what());
      s->finished = true;
    } catch (const std::exception& e) {
      fail(*s->job, 500, std::string("engine error: ") + e.what());
      s->finished = true;
    }
    break;
  }
  // Sample the next token of every decoding sequence, then advance them together. Greedy and plain
  // temperature rows (no log-probs, no top-k / top-p) are drawn on the device from their sampler's
  // next uniform draw, and their ids come back in one read; the others read their logits row.
  const auto t_sample = Clock::now();
  bool sampled = false;
  {
    std::vector<Seq*> picks;
    for (auto& s : running_)
      if (!s->finished && s->stage == Seq::Stage::Decode && device_pick(*s)) picks.push_back(s.get());
    if (!picks.empty()) {
      try {
        Backend& be = model_.backend();
        const int64_t n = static_cast<int64_t>(picks.size());
        std::vector<float> par(static_cast<size_t>(3 * n));
        for (int64_t i = 0; i < n; ++i) {
          const Seq& s = *picks[static_cast<size_t>(i)];
          const float t = s.job->gen.sampling.temperature;
          par[static_cast<size_t>(3 * i)] = t;
          par[static_cast<size_t>(3 * i + 1)] = t > 0.f ? static_cast<float>(s.sampler->uniform()) : 0.f;
          par[static_cast<size_t>(3 * i + 2)] = s.job->gen.mask_padded_ids && padded_mask_.defined() ? 1.f : 0.f;
        }
        Tensor params = be.alloc_uninit(DType::F32, {n, 3}), ids = be.alloc_uninit(DType::I32, {n});
        be.write(params, par.data(), par.size() * sizeof(float));
        for (int64_t i = 0; i < n; ++i) {
          Tensor one = ids.slice_rows(i, i + 1);
          be.sample_rows(picks[static_cast<size_t>(i)]->logits, params.slice_rows(i, i + 1), padded_mask_, one);
        }
        Tensor h = be.to_host(ids);
        for (int64_t i = 0; i < n; ++i) picks[static_cast<size_t>(i)]->picked = h.data<int32_t>()[i];
      } catch (const std::exception&) {
        for (Seq* s : picks) s->picked = -1;  // decode_sample reads the logits instead
      }
    }
  }
  std::vector<Seq*> cont;
  for (auto& s : running_) {
    if (s->finished || s->stage != Seq::Stage::Decode) continue;
    try {
      sampled = true;
      decode_sample(*s);
      if (!s->finished) cont.push_back(s.get());
    } catch (const std::exception& e) {
      fail(*s->job, 500, std::string("engine error: ") + e.what());
      s->finished = true;
    }
  }
  if (sampled) metrics_.observe_phase("sample", ms_since(t_sample) / 1000.0);
  if (sampled || !cont.empty()) worked = true;
  if (!worked) idle_ = std::any_of(running_.begin(), running_.end(), [&](const auto& s) { return remote_waiting(*s); });
  if (!cont.empty()) {
    metrics_.decode_steps++;
    const auto t0 = Clock::now();
    decode_step(cont);
    model_.backend().synchronize();
    metrics_.observe_phase("decode", ms_since(t0) / 1000.0);
  }
}

const char* Scheduler::unit_kind(const Seq& s) const {
  if (s.job->kind == Job::Kind::Segments) return "segments";
  const GenSpec& g = s.job->gen;
  switch (s.stage) {
    case Seq::Stage::Start:
      if (g.segments.size() < 2) return "prefill";
      if (g.pic.mode == PicMode::Prefix) return "prefix";
      return g.pic.mode == PicMode::Pic || g.pic.mode == PicMode::Naive ? "build" : "prefill";
    case Seq::Stage::Prefix:
      return "prefix";
    case Seq::Stage::Warm:
      return "build";
    case Seq::Stage::Compose:
      return "compose";
    default:
      return "prefill";
  }
}

void Scheduler::remember(const std::shared_ptr<const SegmentEntry>& e) {
  std::lock_guard<std::mutex> g(index_mu_);
  auto& x = index_[e->key.hash()];
  x.key = e->key;
  x.entry = e;
  x.bytes = e->bytes;
}

bool Scheduler::prefill_unit(Seq& s) {
  Job& j = *s.job;
  if (j.kind == Job::Kind::Segments) {
    if (s.warm_next == 0 && !s.seg_build) j.segments_result = nlohmann::json::array();
    while (s.warm_next < j.segs.segments.size()) {
      const auto& ids = j.segs.segments[s.warm_next];
      if (static_cast<int64_t>(ids.size()) <= int64_t{j.segs.seam} + j.segs.tail) {
        if (j.segs.encode) throw std::invalid_argument("the segment has no body past its seams: nothing to build");
        // No body past the seam: every request recomputes such a segment whole, so an entry
        // would never be used.
        const SegmentKey key{engine_.model().fingerprint(), j.segs.seam, 0, ids};
        j.segments_result.push_back({{"id", hex64(key.hash())},
                                     {"tokens", ids.size()},
                                     {"bytes", 0},
                                     {"seam", j.segs.seam},
                                     {"cached", false},
                                     {"stored", false}});
        ++s.warm_next;
        continue;
      }
      std::shared_ptr<const SegmentEntry> e;
      if (!s.seg_build) {
        // Memory, then the disk tier (verified), else built in isolation in steps.
        e = engine_.find(ids, j.segs.seam, j.segs.tail);
        if (!e) s.seg_build = engine_.start_build(ids, j.segs.seam, j.segs.tail);
      }
      const bool built = !e;
      if (built) {
        auto done = engine_.step_build(*s.seg_build, build_budget());  // a bounded step per iteration
        if (!done) return false;
        s.seg_build.reset();
        e = engine_.cache().insert(std::move(done));
      }
      remember(e);
      ++s.warm_next;
      if (j.segs.encode) {
        // Here: the engine thread owns the device.
        if (j.segs.share)
          if (auto sh = share_entry(*e, model_.backend())) {
            j.wire = std::move(sh->descriptor);
            j.wire_keep = std::move(sh->keep);
          }
        if (!j.wire_keep) j.wire = encode_entry(*e, model_.backend());
        j.wire_cached = !built;
      }
      j.segments_result.push_back({{"id", hex64(e->key.hash())},
                                   {"tokens", ids.size()},
                                   {"bytes", e->bytes},
                                   {"stored", true},
                                   {"seam", j.segs.seam},
                                   {"cached", !built}});
      if (built) {
        ++s.misses;
        break;  // one isolated prefill per iteration
      }
      ++s.hits;
    }
    if (s.warm_next < j.segs.segments.size()) return false;
    {
      std::lock_guard<std::mutex> g(j.mu);
      j.report.hit_segments = s.hits;
      j.report.miss_segments = s.misses;
      j.total_ms = ms_since(j.arrived);
      j.finish_reason = "stop";
      j.done = true;
    }
    j.cv.notify_all();
    if (j.on_done) std::exchange(j.on_done, nullptr)(j);
    s.finished = true;
    return true;
  }

  GenSpec& g = j.gen;
  const auto& segs = g.segments;
  const int64_t ctx = model_.config().max_position_embeddings;
  // KV for the prompt and the first kDecodeReserve tokens; decoding grows it as tokens come
  // (Model::reserve doubles), so a request without max_tokens does not hold a whole context.
  const int64_t want = g.prompt_tokens + std::min<int64_t>(std::max(g.max_tokens, 0), kDecodeReserve);
  const int64_t cap = ctx > 0 ? std::min(want, ctx) : want;
  if (s.stage == Seq::Stage::Start) {
    const bool composed = segs.size() > 1 && (g.pic.mode == PicMode::Pic || g.pic.mode == PicMode::Naive);
    if (segs.size() > 1 && g.pic.mode == PicMode::Prefix) {
      // The longest cached prefix, then the rest at most prefill_chunk tokens per unit; a
      // question longer than a prefill chunk goes in chunks after.
      s.prefix = engine_.start_prefix(segs, segs.back().size() > static_cast<size_t>(opt_.prefill_chunk));
      s.stage = Seq::Stage::Prefix;
    } else if (composed) {
      s.stage = Seq::Stage::Warm;
    } else {
      for (auto& x : segs) s.flat.insert(s.flat.end(), x.begin(), x.end());
      s.st = model_.new_state(std::max<int64_t>(cap, 1));
      s.stage = Seq::Stage::Chunked;
    }
  }
  if (s.stage == Seq::Stage::Prefix) {
    std::optional<PrefillResult> done = engine_.step_prefix(*s.prefix, opt_.prefill_chunk);
    if (!done) return false;
    s.prefix.reset();
    PrefillResult r = std::move(*done);
    s.st = std::move(r.state);
    model_.reserve(s.st, std::max<int64_t>(cap, 1));
    {
      std::lock_guard<std::mutex> lk(j.mu);  // the logger may read it for a cancelled job
      j.report = r.report;
    }
    if (segs.back().size() <= static_cast<size_t>(opt_.prefill_chunk)) {
      s.logits = r.logits;
      return true;
    }
    s.flat = segs.back();
    s.stage = Seq::Stage::Chunked;
    return false;
  }
  if (s.stage == Seq::Stage::Chunked) {
    const size_t n = std::min(static_cast<size_t>(opt_.prefill_chunk), s.flat.size() - s.flat_done);
    s.logits = model_.forward(std::span<const int32_t>(s.flat.data() + s.flat_done, n), s.st);
    s.flat_done += n;
    if (s.flat_done < s.flat.size()) return false;
    std::lock_guard<std::mutex> lk(j.mu);
    j.report.computed_tokens += static_cast<int64_t>(s.flat.size());
    return true;
  }
  if (s.stage == Seq::Stage::Warm) {
    // The request's plan looks every context segment up once; a missing entry is built in
    // isolation (one per iteration, so other requests' work interleaves) and pinned by the plan.
    // When the cache is full of entries other requests hold, this request lets go of its own
    // (cached, unpinned: others may evict them) and waits until a request lets go of entries, so
    // that requests never hold each other up; alone, its segments exceed the budget (503).
    try {
      s.cache_wait = false;
      if (!s.plan) {
        s.plan = std::make_unique<PicPlan>(engine_.plan(segs, g.pic));
        for (const auto& p : s.plan->parts)
          if (p.entry) remember(p.entry);
      }
      if (pool_) {
        if (!s.remote_sent) dispatch_remote(s);
        collect_remote(s);
      }
      // Alone, every missing entry is built here (one bounded step per iteration: a long segment
      // does not hold the engine either), then composed. With segment workers the composition
      // starts at once: it goes on in plan order as entries arrive, and this node builds its own
      // share while it waits for workers (the Compose stage below).
      if (!pool_) {
        if (const size_t i = local_missing(s); i != PicEngine::npos) {
          build_local(s, i);
          return false;
        }
      }
    } catch (const std::length_error&) {
      if (!wait_for_cache(s)) throw;
      return false;
    }
    s.stage = Seq::Stage::Compose;
  }
  if (s.stage == Seq::Stage::Compose) {
    // Composition of the context from the plan's entries, at most compose_chunk seam rows per
    // iteration (a prompt of many segments does not hold the engine either), the question with
    // the last of them; a question longer than a prefill chunk is left out and prefilled in
    // chunks after.
    const bool skip_question = segs.back().size() > static_cast<size_t>(opt_.prefill_chunk);
    if (!s.compose) {
      s.plan->opt.skip_question = skip_question;
      s.compose = engine_.start_compose(segs, *s.plan, /*allow_pending=*/true);
    }
    if (s.plan) {
      // Entries still being built: those that arrived from workers go into the run. Where the
      // composition waits at a segment of this node's share (or one whose worker failed), it is
      // built here; where it waits for a worker, this node builds the next segment of its share
      // meanwhile. The plan goes once every entry is in the run (the composition pins them then).
      bool built_here = false;
      try {
        if (pool_) collect_remote(s);
        engine_.supply(*s.compose, *s.plan);
        if (const size_t w = engine_.compose_waits_for(*s.compose); w != PicEngine::npos) {
          const bool ours = s.plan->parts[w].missing() && !(w < s.remote.size() && s.remote[w]);
          if (const size_t b = ours ? w : local_missing(s); b != PicEngine::npos) {
            build_local(s, b);
            built_here = true;
          }
        }
      } catch (const std::length_error&) {
        if (!wait_for_cache(s)) throw;
        return false;
      }
      if (!engine_.supply(*s.compose, *s.plan)) s.plan.reset();
      // One unit per iteration; waiting for a worker's entry is remote_waiting.
      if (built_here || engine_.compose_waits_for(*s.compose) != PicEngine::npos) return false;
    }
    s.unit_did = "compose";
    if (s.plan) metrics_.remote_overlap_steps++;
    std::optional<PrefillResult> done = engine_.step_compose(*s.compose, opt_.compose_chunk);
    if (!done) return false;
    s.compose.reset();
    ++unpinned_;
    PrefillResult r = std::move(*done);
    s.st = std::move(r.state);
    model_.reserve(s.st, std::max<int64_t>(cap, 1));
    const CacheReport& rep = r.report;
    {
      std::lock_guard<std::mutex> lk(j.mu);
      j.report = rep;
    }
    if (!skip_question) {
      s.logits = r.logits;
      return true;
    }
    s.flat = segs.back();
    s.stage = Seq::Stage::Chunked;
    return false;
  }
  return false;
}

void Scheduler::start_decode(Seq& s) {
  Job& j = *s.job;
  s.stage = Seq::Stage::Decode;
  const int64_t ctx = model_.config().max_position_embeddings;
  int64_t want = s.st.n_past + std::min<int64_t>(std::max(j.gen.max_tokens, 0), kDecodeReserve);
  if (ctx > 0) want = std::min(want, ctx);
  model_.reserve(s.st, std::max<int64_t>(want, 1));
  s.sampler = std::make_unique<Sampler>(j.gen.sampling);
  if (tok_) s.dec = std::make_unique<Tokenizer::StreamDecoder>(*tok_, /*skip_special=*/true);
  if (j.gen.max_tokens <= 0) finish(s, "length");
}

bool Scheduler::device_pick(const Seq& s) const {
  const GenSpec& g = s.job->gen;
  if (g.logprobs >= 0 || !s.logits.defined() || !s.sampler) return false;
  return g.sampling.temperature == 0.f || s.sampler->plain(model_.config().vocab_size);
}

void Scheduler::decode_sample(Seq& s) {
  Job& j = *s.job;
  const GenSpec& g = j.gen;
  Backend& be = model_.backend();
  TokenOut t;
  int32_t id = std::exchange(s.picked, -1);
  if (id < 0) {
    Tensor host = be.to_host(s.logits);
    std::span<const float> row(host.data<float>(), static_cast<size_t>(host.numel()));
    if (g.mask_padded_ids && !padded_ids_.empty()) {
      s.masked.assign(row.begin(), row.end());
      mask_ids(s.masked, padded_ids_);
      row = s.masked;
    }
    // Any id of the row may come out (a padded row included): it decodes to no text, never to an error.
    id = s.sampler->sample(row);
    if (g.logprobs >= 0) t.logprob = token_logprob(row, id, g.logprobs);
  }
  t.id = id;
  ++s.generated;
  bool is_eos = false;
  for (auto e : g.eos_ids) is_eos |= (e == id);
  std::string reason;
  bool cut_at_stop = false;
  if (s.dec) {
    const size_t before = s.text.size();
    s.text += s.dec->push(id);
    if (!g.stop.empty()) {
      size_t cut = std::string::npos;
      for (const auto& stop : g.stop) {
        const size_t from = before >= stop.size() ? before - stop.size() + 1 : 0;
        const size_t p = s.text.find(stop, from);
        if (p != std::string::npos) cut = std::min(cut, p);
      }
      if (cut != std::string::npos) {
        s.text.resize(cut);
        reason = "stop";
        cut_at_stop = true;
      }
    }
  }
  if (reason.empty() && is_eos) reason = "stop";
  const int64_t ctx = model_.config().max_position_embeddings;
  if (reason.empty() && (s.generated >= g.max_tokens || (ctx > 0 && s.st.n_past + 1 > ctx))) reason = "length";
  if (!reason.empty() && !cut_at_stop && s.dec) s.text += s.dec->flush();
  // Release what can no longer turn into a stop string.
  const size_t safe = reason.empty() ? s.text.size() - stop_holdback(s.text, g.stop) : s.text.size();
  if (safe > s.emitted) {
    t.text = s.text.substr(s.emitted, safe - s.emitted);
    s.emitted = safe;
  }
  {
    std::lock_guard<std::mutex> lk(j.mu);
    if (s.generated == 1) j.ttft_ms = ms_since(j.arrived);
    j.out.push_back(std::move(t));
  }
  j.cv.notify_all();
  if (!reason.empty()) {
    finish(s, reason);
    return;
  }
  s.next_id = id;
}

void Scheduler::decode_step(std::vector<Seq*>& seqs) {
  // Continuous batching: one forward over every running sequence's next token; weight GEMMs run
  // once for the whole batch, the token mixers per sequence against its own state.
  if (seqs.size() > 1) {
    std::vector<BatchItem> items;
    items.reserve(seqs.size());
    for (Seq* s : seqs) items.push_back({&s->st, std::span<const int32_t>(&s->next_id, 1)});
    try {
      Tensor all = model_.forward_batch(items);
      for (size_t i = 0; i < seqs.size(); ++i)
        seqs[i]->logits = all.slice_rows(static_cast<int64_t>(i), static_cast<int64_t>(i) + 1);
      return;
    } catch (const std::exception&) {
      // forward_batch validates every sequence before touching any state (context length, ids),
      // so a failure leaves the states as they were: redo one by one to isolate the culprit.
    }
  }
  for (Seq* s : seqs) {
    try {
      s->logits = model_.forward(std::span<const int32_t>(&s->next_id, 1), s->st);
    } catch (const std::exception& e) {
      fail(*s->job, 500, std::string("engine error: ") + e.what());
      s->finished = true;
    }
  }
}

void Scheduler::finish(Seq& s, const std::string& reason) {
  Job& j = *s.job;
  {
    std::lock_guard<std::mutex> lk(j.mu);
    if (s.emitted < s.text.size()) j.tail = s.text.substr(s.emitted);
    s.emitted = s.text.size();
    j.finish_reason = reason;
    j.completion_tokens = s.generated;
    j.total_ms = ms_since(j.arrived);
    j.done = true;
  }
  j.cv.notify_all();
  if (j.on_done) std::exchange(j.on_done, nullptr)(j);
  metrics_.observe_generation(j.ttft_ms >= 0 ? j.ttft_ms / 1000.0 : -1, j.total_ms / 1000.0, j.report.computed_tokens,
                              j.report.reused_tokens, s.generated, j.report.hit_segments, j.report.miss_segments);
  s.finished = true;
}

std::vector<SegmentInfo> Scheduler::list_segments() {
  std::vector<SegmentInfo> out;
  std::lock_guard<std::mutex> g(index_mu_);
  for (auto it = index_.begin(); it != index_.end();) {
    if (it->second.entry.expired()) {
      it = index_.erase(it);
      continue;
    }
    out.push_back(
        {hex64(it->first), static_cast<int64_t>(it->second.key.ids.size()), it->second.bytes, it->second.key.seam});
    ++it;
  }
  return out;
}

bool Scheduler::erase_segment(const std::string& id) {
  uint64_t h = 0;
  if (id.empty() || id.size() > 16 || id.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) return false;
  h = std::stoull(id, nullptr, 16);
  std::lock_guard<std::mutex> g(index_mu_);
  auto it = index_.find(h);
  if (it == index_.end()) return false;
  const bool alive = !it->second.entry.expired();
  const bool erased = engine_.cache().erase(it->second.key);
  index_.erase(it);
  return erased || alive;
}

void Scheduler::clear_segments() {
  std::lock_guard<std::mutex> g(index_mu_);
  engine_.cache().clear();
  index_.clear();
}

void Scheduler::submit_remote_build(SegmentKey key, bool shared, std::function<void(cluster::BuildOutcome)> reply) {
  auto job = std::make_shared<Job>();
  job->kind = Job::Kind::Segments;
  job->id = "remote-" + hex64(key.hash());
  job->segs.segments = {std::move(key.ids)};
  job->segs.seam = key.seam;
  job->segs.tail = key.tail;
  job->segs.encode = true;
  job->segs.share = shared;
  job->on_done = [this, reply](Job& j) {
    cluster::BuildOutcome out;
    out.ok = j.error_status == 0 && !j.wire.empty();
    out.cached = j.wire_cached;
    out.bytes = out.ok ? std::move(j.wire) : (j.error_message.empty() ? "no entry" : j.error_message);
    out.shared = out.ok && j.wire_keep != nullptr;
    out.keep = std::move(j.wire_keep);
    if (out.ok) {
      metrics_.served_builds++;
      metrics_.served_bytes += out.bytes.size();
      if (out.shared) metrics_.served_shared++;
    }
    reply(std::move(out));
  };
  if (!submit(job)) {
    job->on_done = nullptr;
    reply({false, false, "the worker's queue is full"});
  }
}

nlohmann::json Scheduler::workers_json() const {
  return pool_ ? pool_->workers_json() : nlohmann::json::array();
}

void Scheduler::wake() {
  {
    std::lock_guard<std::mutex> g(mu_);
    ++wakes_;
  }
  cv_.notify_all();
}

void Scheduler::dispatch_remote(Seq& s) {
  s.remote_sent = true;
  auto& parts = s.plan->parts;
  s.remote.assign(parts.size(), nullptr);
  std::vector<size_t> idx;
  std::vector<const SegmentKey*> keys;
  for (size_t i = 0; i < parts.size(); ++i)
    if (parts[i].missing() && !parts[i].building) {
      idx.push_back(i);
      keys.push_back(&parts[i].key);
    }
  if (idx.empty()) return;
  const auto where = pool_->assign(keys, local_rate_, 0);
  for (size_t k = 0; k < idx.size(); ++k)
    if (where[k] >= 0) {
      s.remote[idx[k]] = pool_->request(where[k], parts[idx[k]].key);
      metrics_.remote_requests++;
    }
}

void Scheduler::collect_remote(Seq& s) {
  for (size_t i = 0; i < s.remote.size(); ++i) {
    auto& b = s.remote[i];
    if (!b || !b->done.load()) continue;
    auto build = std::move(b);
    if (!build->ok) {
      spdlog::warn("request {}: segment {} rebuilt here: {}", s.job->id, i, build->error);
      metrics_.remote_fallbacks++;
      continue;  // stays missing: the local builder takes it
    }
    // A shared entry is copied out of the worker's buffer here; the worker frees it once told,
    // whatever became of the copy.
    struct Release {
      cluster::WorkerPool& pool;
      const cluster::RemoteBuild& b;
      ~Release() { pool.release(b); }
    } release{*pool_, *build};
    try {
      std::shared_ptr<SegmentEntry> e;
      if (build->shared) {
        const auto t0 = Clock::now();
        e = receive_shared_entry(build->bytes, model_.backend());
        metrics_.remote_shared_entries++;
        metrics_.remote_import_us +=
            static_cast<uint64_t>(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      } else {
        e = decode_entry(build->bytes);
      }
      const size_t bytes = build->shared ? e->bytes : build->bytes.size();
      engine_.adopt(*s.plan, i, std::move(e));
      remember(s.plan->parts[i].entry);
      metrics_.remote_entries++;
      metrics_.remote_bytes += bytes;
    } catch (const std::length_error&) {
      throw;  // the cache is full: the Warm stage's wait
    } catch (const SharedMemoryError& e) {
      spdlog::warn("request {}: segment {} from worker {} could not be mapped here ({}); rebuilt here", s.job->id, i,
                   build->worker, e.what());
      pool_->shared_failed(*build, e.what());
      metrics_.remote_fallbacks++;
    } catch (const std::exception& e) {
      spdlog::warn("request {}: segment {} from worker {} rejected ({}); rebuilt here", s.job->id, i, build->worker,
                   e.what());
      pool_->bad_entry(*build, e.what());
      metrics_.remote_fallbacks++;
    }
  }
}

void Scheduler::drop_remote(Seq& s) {
  if (pool_)
    for (auto& b : s.remote)
      if (b) pool_->abandon(*b);
  s.remote.clear();
  s.remote_sent = false;
}

// The cache is full of entries other requests hold: this request lets go of its own (its plan
// and any composition under way; cached, unpinned: others may evict them) and waits until a
// request lets go of entries, so that requests never hold each other up. false: no other request
// holds entries (alone, its segments exceed the budget: the caller rethrows, a 503).
bool Scheduler::wait_for_cache(Seq& s) {
  const bool others = std::any_of(running_.begin(), running_.end(),
                                  [&](const auto& o) { return o.get() != &s && !o->finished && o->holds_entries(); });
  if (!others) return false;
  drop_remote(s);
  s.compose.reset();
  s.plan.reset();
  s.stage = Seq::Stage::Warm;
  s.cache_wait = true;
  s.cache_wait_at = unpinned_;
  metrics_.cache_waits++;
  return true;
}

size_t Scheduler::local_missing(const Seq& s) const {
  for (size_t i = 0; i < s.plan->parts.size(); ++i)
    if (s.plan->parts[i].missing() && !(i < s.remote.size() && s.remote[i])) return i;
  return PicEngine::npos;
}

void Scheduler::build_local(Seq& s, size_t i) {
  s.unit_did = "build";
  const auto t0 = Clock::now();
  const bool done = engine_.build_step(*s.plan, i, build_budget());
  model_.backend().synchronize();
  s.build_seconds += ms_since(t0) / 1000.0;
  if (done) {
    remember(s.plan->parts[i].entry);
    const double r = static_cast<double>(s.plan->parts[i].len) / std::max(s.build_seconds, 1e-6);
    local_rate_ = local_rate_ > 0 ? 0.7 * local_rate_ + 0.3 * r : r;
    s.build_seconds = 0;
  }
}

bool Scheduler::remote_waiting(const Seq& s) const {
  if (s.stage == Seq::Stage::Compose && s.compose && s.plan) {
    // Composing up to a segment a worker still builds, nothing of this node's share left to
    // build and no reply to take in: nothing to do until one arrives.
    const size_t w = engine_.compose_waits_for(*s.compose);
    if (w == PicEngine::npos || s.plan->parts[w].entry || local_missing(s) != PicEngine::npos) return false;
    for (const auto& b : s.remote)
      if (b && b->done.load()) return false;
    const auto* b = w < s.remote.size() ? s.remote[w].get() : nullptr;
    return b != nullptr;
  }
  if (s.stage != Seq::Stage::Warm || !s.plan || s.remote.empty()) return false;
  bool pending = false;
  for (size_t i = 0; i < s.plan->parts.size(); ++i) {
    const auto& p = s.plan->parts[i];
    if (!p.missing()) continue;
    const auto* b = i < s.remote.size() ? s.remote[i].get() : nullptr;
    if (!b || b->done.load()) return false;  // local work, or a build to take in
    pending = true;
  }
  return pending;
}

void Scheduler::sync_pool_metrics() {
  const auto st = pool_->stats();
  metrics_.remote_timeouts = st.timeouts;
  metrics_.remote_lost = st.lost;
  metrics_.remote_errors = st.errors;
  metrics_.remote_bad_entries = st.bad_entries;
  metrics_.remote_recoveries = st.recoveries;
  metrics_.remote_shared_failures = st.shared_failures;
  metrics_.remote_transfer_us = static_cast<uint64_t>(st.transfer_seconds * 1e6);
  metrics_.workers_healthy = pool_->healthy();
}

}  // namespace hypic::server
