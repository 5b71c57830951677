#include "cluster/worker_pool.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <numeric>
#include <sstream>
#include <stdexcept>

#include "cluster/protocol.h"

namespace hypic::cluster {

namespace {
double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
// Before any build is measured, a node is assumed to build this many tokens per second (only the
// ratio between nodes matters to LPT, and all start equal).
constexpr double kUnknownRate = 1000;
// For deadlines only, an unmeasured worker is assumed this slow (a 0.8B model on one CPU thread
// builds ~20 tokens/s): a deadline must not fail a healthy worker before its rate is known.
constexpr double kDeadlineRate = 10;
// A worker that already holds a segment sends it without building: that much of a build's time.
constexpr double kFetchShare = 0.05;
}  // namespace

std::vector<WorkerAddress> parse_workers(const std::string& list) {
  std::vector<WorkerAddress> out;
  std::string flat;
  std::istringstream lines(list);
  for (std::string line; std::getline(lines, line);) {
    if (auto c = line.find('#'); c != std::string::npos) line.resize(c);
    flat += line + ",";
  }
  std::istringstream items(flat);
  for (std::string item; std::getline(items, item, ',');) {
    item.erase(0, item.find_first_not_of(" \t\r"));
    item.erase(item.find_last_not_of(" \t\r") + 1);
    if (item.empty()) continue;
    const auto colon = item.rfind(':');
    int port = 0;
    try {
      if (colon == std::string::npos || colon == 0) throw std::invalid_argument("");
      size_t used = 0;
      port = std::stoi(item.substr(colon + 1), &used);
      if (used != item.size() - colon - 1 || port <= 0 || port > 65535) throw std::invalid_argument("");
    } catch (const std::exception&) {
      throw std::invalid_argument("bad worker address '" + item + "' (expected host:port, port 1-65535)");
    }
    out.push_back({item.substr(0, colon), port});
  }
  return out;
}

WorkerPool::WorkerPool(std::vector<WorkerAddress> workers, uint64_t fingerprint, PoolOptions opt,
                       std::function<void()> wake)
    : fingerprint_(fingerprint), opt_(opt), wake_(std::move(wake)) {
  for (auto& a : workers) workers_.push_back(Worker{std::move(a)});
  node_ = std::make_unique<UcxNode>([this](Message&& m) { on_message(std::move(m)); },
                                    [this](PeerId p, const std::string& why) { on_down(p, why); });
  std::lock_guard<std::mutex> g(mu_);
  for (size_t i = 0; i < workers_.size(); ++i) connect(i);
}

WorkerPool::~WorkerPool() {
  node_.reset();  // no callback runs after this
}

void WorkerPool::connect(size_t i) {
  Worker& w = workers_[i];
  try {
    w.peer = node_->connect(w.addr.host, w.addr.port);
    PingHeader h{next_request_++, fingerprint_};
    node_->send(w.peer, kPing, pack(h), {});
  } catch (const std::exception& e) {
    w.peer = 0;
    mark_down(w, e.what());
  }
}

void WorkerPool::mark_down(Worker& w, const std::string& why) {
  if (w.healthy) spdlog::warn("segment worker {} marked unhealthy: {}", w.addr.str(), why);
  w.healthy = false;
  w.why = why;
  w.probe_at =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opt_.probe_seconds));
}

void WorkerPool::finish(RemoteBuild& b) {
  if (b.worker >= 0 && static_cast<size_t>(b.worker) < workers_.size()) {
    Worker& w = workers_[static_cast<size_t>(b.worker)];
    w.busy = std::max(0.0, w.busy - b.estimate_seconds);
    --w.in_flight;
  }
  b.done = true;
}

void WorkerPool::fail(const std::shared_ptr<RemoteBuild>& b, const std::string& error, uint64_t PoolStats::*counter) {
  b->ok = false;
  b->error = error;
  ++(st_.*counter);
  pending_.erase(b->request);
  if (b->worker >= 0) mark_down(workers_[static_cast<size_t>(b->worker)], error);
  finish(*b);
}

std::vector<int> WorkerPool::assign(const std::vector<const SegmentKey*>& keys, double local_rate, double local_busy) {
  std::lock_guard<std::mutex> g(mu_);
  const size_t n = workers_.size();
  // Node 0 is the local engine, node k the worker k-1.
  std::vector<double> load(n + 1), rate(n + 1);
  std::vector<bool> up(n + 1, true);
  double known = local_rate > 0 ? local_rate : 0;
  for (const auto& w : workers_) known = std::max(known, w.rate);
  const double fallback = known > 0 ? known : kUnknownRate;
  load[0] = std::max(0.0, local_busy);
  rate[0] = local_rate > 0 ? local_rate : fallback;
  for (size_t k = 0; k < n; ++k) {
    up[k + 1] = workers_[k].healthy && workers_[k].peer != 0;
    load[k + 1] = workers_[k].busy;
    rate[k + 1] = workers_[k].rate > 0 ? workers_[k].rate : fallback;
  }
  if (opt_.round_robin) {
    std::vector<int> where(keys.size(), -1), nodes{-1};
    for (size_t k = 0; k < n; ++k)
      if (up[k + 1]) nodes.push_back(static_cast<int>(k));
    for (size_t i = 0; i < keys.size(); ++i) where[i] = nodes[i % nodes.size()];
    return where;
  }
  std::vector<size_t> order(keys.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return keys[a]->ids.size() > keys[b]->ids.size(); });
  std::vector<int> where(keys.size(), -1);
  for (size_t i : order) {
    const double tokens = static_cast<double>(keys[i]->ids.size());
    auto held = holds_.find(keys[i]->hash());
    size_t best = 0;
    double best_end = load[0] + tokens / rate[0];
    for (size_t k = 1; k <= n; ++k) {
      if (!up[k]) continue;
      double cost = tokens / rate[k];
      if (held != holds_.end() && held->second == static_cast<int>(k - 1)) cost *= kFetchShare;
      if (load[k] + cost < best_end) {
        best = k;
        best_end = load[k] + cost;
      }
    }
    load[best] = best_end;
    where[i] = static_cast<int>(best) - 1;
  }
  return where;
}

std::shared_ptr<RemoteBuild> WorkerPool::request(int worker, const SegmentKey& key) {
  auto b = std::make_shared<RemoteBuild>();
  b->key = key;
  b->worker = worker;
  b->sent = Clock::now();
  std::lock_guard<std::mutex> g(mu_);
  Worker& w = workers_.at(static_cast<size_t>(worker));
  const double rate = w.rate > 0 ? w.rate : kUnknownRate;
  b->estimate_seconds = static_cast<double>(key.ids.size()) / rate;
  b->request = next_request_++;
  ++w.in_flight;
  w.busy += b->estimate_seconds;
  // The worker builds its requests one after another: this one is due after everything queued
  // there before it, so its deadline counts that work too.
  const double ahead = w.rate > 0 ? w.busy : w.busy * kUnknownRate / kDeadlineRate;
  const double limit = std::max(opt_.deadline_min_seconds, opt_.deadline_factor * ahead);
  b->deadline = b->sent + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(limit));
  ++st_.requests;
  if (!w.healthy || w.peer == 0) {
    fail(b, "segment worker " + w.addr.str() + " is down: " + w.why, &PoolStats::lost);
    return b;
  }
  pending_[b->request] = b;
  BuildHeader h{b->request, key.model_fingerprint, key.seam, key.tail, w.shared_ok ? opt_.host : 0};
  std::string ids(reinterpret_cast<const char*>(key.ids.data()), key.ids.size() * sizeof(int32_t));
  node_->send(w.peer, kBuild, pack(h), std::move(ids));
  return b;
}

void WorkerPool::check() {
  bool woke = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    const auto now = Clock::now();
    std::vector<std::shared_ptr<RemoteBuild>> overdue;
    for (auto& [id, b] : pending_)
      if (now > b->deadline) overdue.push_back(b);
    for (auto& b : overdue) {
      fail(b,
           "segment worker " + workers_[static_cast<size_t>(b->worker)].addr.str() + " missed the deadline (" +
               std::to_string(seconds_between(b->sent, now)) + " s)",
           &PoolStats::timeouts);
      woke = true;
    }
    for (size_t i = 0; i < workers_.size(); ++i) {
      Worker& w = workers_[i];
      if (w.healthy || now < w.probe_at) continue;
      w.probe_at = now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opt_.probe_seconds));
      if (w.peer != 0) node_->close(w.peer);  // a stalled connection is not reused
      connect(i);
    }
  }
  if (woke && wake_) wake_();
}

void WorkerPool::bad_entry(const RemoteBuild& b, const std::string& why) {
  std::lock_guard<std::mutex> g(mu_);
  ++st_.bad_entries;
  holds_.erase(b.key.hash());
  if (b.worker >= 0) mark_down(workers_[static_cast<size_t>(b.worker)], "sent an unusable entry: " + why);
}

void WorkerPool::abandon(const RemoteBuild& b) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = pending_.find(b.request);
  if (it == pending_.end()) return;
  auto keep = it->second;
  pending_.erase(it);
  finish(*keep);
}

void WorkerPool::release(const RemoteBuild& b) {
  if (!b.shared || b.worker < 0) return;
  std::lock_guard<std::mutex> g(mu_);
  const Worker& w = workers_[static_cast<size_t>(b.worker)];
  if (w.peer != 0) node_->send(w.peer, kRelease, pack(ReleaseHeader{b.request}), {});
}

void WorkerPool::shared_failed(const RemoteBuild& b, const std::string& why) {
  std::lock_guard<std::mutex> g(mu_);
  ++st_.shared_failures;
  if (b.worker < 0) return;
  Worker& w = workers_[static_cast<size_t>(b.worker)];
  if (w.shared_ok)
    spdlog::warn("segment worker {}: its shared entries cannot be mapped here ({}); it sends bytes from now on",
                 w.addr.str(), why);
  w.shared_ok = false;
}

void WorkerPool::on_message(Message&& m) {
  {
    std::lock_guard<std::mutex> g(mu_);
    auto wi = std::find_if(workers_.begin(), workers_.end(), [&](const Worker& w) { return w.peer == m.peer; });
    if (wi == workers_.end()) return;  // a connection closed since
    Worker& w = *wi;
    if (m.kind == kPong) {
      auto h = unpack<PingHeader>(m.header);
      if (!h || h->fingerprint != fingerprint_) {
        mark_down(w, h ? "serves another model" : "malformed reply to a ping");
        return;
      }
      if (!w.healthy) {
        spdlog::info("segment worker {} is back", w.addr.str());
        ++st_.recoveries;
      }
      w.healthy = true;
      w.why.clear();
      return;
    }
    if (m.kind != kBuildReply) return;
    auto h = unpack<ReplyHeader>(m.header);
    if (!h) {
      mark_down(w, "malformed reply header");
      return;
    }
    auto it = pending_.find(h->request);
    if (it == pending_.end()) {  // timed out or abandoned before
      if (h->shared) node_->send(m.peer, kRelease, pack(ReleaseHeader{h->request}), {});
      return;
    }
    auto b = it->second;
    if (b->worker != static_cast<int>(wi - workers_.begin())) return;
    if (!h->ok) {
      fail(b, "segment worker " + w.addr.str() + ": " + m.payload.substr(0, 500), &PoolStats::errors);
    } else {
      pending_.erase(it);
      const auto now = Clock::now();
      b->ok = true;
      b->cached = h->cached != 0;
      b->shared = h->shared != 0;
      b->bytes = std::move(m.payload);
      b->seconds = seconds_between(b->sent, now);
      b->worker_seconds = h->build_seconds;
      ++st_.replies;
      st_.bytes += b->bytes.size();
      st_.transfer_seconds += std::max(0.0, b->seconds - b->worker_seconds);
      holds_[b->key.hash()] = b->worker;
      if (!b->cached && b->worker_seconds > 0) {
        // Its tokens over its service time (transfer included): a worker builds the requests it
        // holds one after another in arrival order, so a build waited in its queue until the
        // previous reply; over the whole round trip the later builds of a request read slow.
        const double r = static_cast<double>(b->key.ids.size()) /
                         std::max(seconds_between(std::max(b->sent, w.last_reply), now), 1e-6);
        w.rate = w.rate > 0 ? 0.7 * w.rate + 0.3 * r : r;
      }
      w.last_reply = now;
      finish(*b);
    }
  }
  if (wake_) wake_();
}

void WorkerPool::on_down(PeerId peer, const std::string& why) {
  {
    std::lock_guard<std::mutex> g(mu_);
    auto wi = std::find_if(workers_.begin(), workers_.end(), [&](const Worker& w) { return w.peer == peer; });
    if (wi == workers_.end()) return;
    const int idx = static_cast<int>(wi - workers_.begin());
    wi->peer = 0;
    mark_down(*wi, why);
    std::vector<std::shared_ptr<RemoteBuild>> lost;
    for (auto& [id, b] : pending_)
      if (b->worker == idx) lost.push_back(b);
    for (auto& b : lost) fail(b, "segment worker " + wi->addr.str() + ": " + why, &PoolStats::lost);
  }
  if (wake_) wake_();
}

PoolStats WorkerPool::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  return st_;
}

int WorkerPool::healthy() const {
  std::lock_guard<std::mutex> g(mu_);
  return static_cast<int>(std::count_if(workers_.begin(), workers_.end(), [](const Worker& w) { return w.healthy; }));
}

nlohmann::json WorkerPool::workers_json() const {
  std::lock_guard<std::mutex> g(mu_);
  nlohmann::json a = nlohmann::json::array();
  for (const auto& w : workers_)
    a.push_back({{"address", w.addr.str()},
                 {"healthy", w.healthy},
                 {"fault", w.why},
                 {"tokens_per_second", w.rate},
                 {"in_flight", w.in_flight}});
  return a;
}

}  // namespace hypic::cluster
