#include "cluster/segment_service.h"

#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>

#include "cluster/protocol.h"

namespace hypic::cluster {

namespace {
constexpr size_t kMaxTokens = size_t{1} << 24;  // a request for more is refused, not allocated
// A shared entry's buffer is freed this long after the reply if no release came (a combine node
// that hung without closing its connection must not pin device memory for ever).
constexpr double kSharedHoldSeconds = 120;
}  // namespace

uint64_t host_identity() {
  static const uint64_t id = [] {
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::string s;
    if (!std::getline(f, s) || s.empty()) return uint64_t{0};
    const uint64_t h = XXH64(s.data(), s.size(), 0);
    return h ? h : uint64_t{1};
  }();
  return id;
}

SegmentService::SegmentService(uint64_t fingerprint, BuildFn build)
    : fingerprint_(fingerprint), build_(std::move(build)), life_(std::make_shared<Life>()) {
  node_ = std::make_unique<UcxNode>([this](Message&& m) { on_message(std::move(m)); },
                                    [this](PeerId peer, const std::string& why) {
                                      spdlog::debug("segment service: a combine node went away: {}", why);
                                      on_down(peer);
                                    });
}

SegmentService::~SegmentService() {
  {
    std::lock_guard<std::mutex> g(life_->mu);
    life_->alive = false;
  }
  node_.reset();
}

int SegmentService::listen(const std::string& host, int port) {
  return node_->listen(host, port);
}

void SegmentService::on_down(PeerId peer) {
  std::lock_guard<std::mutex> g(held_mu_);
  std::erase_if(held_, [&](const auto& kv) { return kv.first.first == peer; });
}

void SegmentService::on_message(Message&& m) {
  {
    std::lock_guard<std::mutex> g(held_mu_);
    const auto now = std::chrono::steady_clock::now();
    std::erase_if(held_, [&](const auto& kv) { return kv.second.until < now; });
  }
  if (m.kind == kRelease) {
    if (auto h = unpack<ReleaseHeader>(m.header)) {
      std::lock_guard<std::mutex> g(held_mu_);
      held_.erase({m.peer, h->request});
    }
    return;
  }
  if (m.kind == kPing) {
    auto h = unpack<PingHeader>(m.header);
    if (!h) return;
    node_->send(m.peer, kPong, pack(PingHeader{h->request, fingerprint_}), {});
    return;
  }
  if (m.kind != kBuild) return;
  ++st_.requests;
  auto h = unpack<BuildHeader>(m.header);
  if (!h) {
    ++st_.refused;
    return;  // no request id to answer
  }
  auto refuse = [&](const std::string& why) {
    ++st_.refused;
    ReplyHeader r{h->request, 0, 0, 0};
    node_->send(m.peer, kBuildReply, pack(r), why);
  };
  if (h->fingerprint != fingerprint_) return refuse("this worker serves another model");
  if (m.payload.empty() || m.payload.size() % 4 != 0 || m.payload.size() / 4 > kMaxTokens)
    return refuse("bad token id list (" + std::to_string(m.payload.size()) + " bytes)");
  if (h->seam < 0 || h->tail < 0) return refuse("negative seam");
  SegmentKey key;
  key.model_fingerprint = h->fingerprint;
  key.seam = h->seam;
  key.tail = h->tail;
  key.ids.resize(m.payload.size() / 4);
  std::memcpy(key.ids.data(), m.payload.data(), m.payload.size());
  const auto t0 = std::chrono::steady_clock::now();
  // The node outlives every reply it can still send: a reply after ~SegmentService is dropped.
  std::shared_ptr<Life> life = life_;
  UcxNode* node = node_.get();
  const PeerId peer = m.peer;
  const uint64_t request = h->request;
  const bool shared = h->host != 0 && h->host == host_;
  build_(std::move(key), shared, [this, life, node, peer, request, t0](BuildOutcome out) {
    // Test hook (tests/cluster): a slow worker, every reply held back this long.
    static const long delay_ms = [] {
      const char* e = std::getenv("HYPIC_TEST_SEGMENT_DELAY_MS");
      return e ? std::strtol(e, nullptr, 10) : 0L;
    }();
    if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    std::lock_guard<std::mutex> g(life->mu);
    if (!life->alive) return;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ReplyHeader r{request, out.ok ? 1u : 0u, out.cached ? 1u : 0u, s};
    if (out.ok) {
      ++(out.cached ? st_.cached : st_.built);
      st_.bytes_sent += out.bytes.size();
      if (out.shared) {
        r.shared = 1;
        ++st_.shared;
        std::lock_guard<std::mutex> hg(held_mu_);
        held_[{peer, request}] = {
            std::move(out.keep),
            std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                   std::chrono::duration<double>(kSharedHoldSeconds))};
      }
    } else {
      ++st_.failed;
    }
    node->send(peer, kBuildReply, pack(r), std::move(out.bytes));
  });
}

}  // namespace hypic::cluster
