// Messages between hypic processes over UCX (Debian libucx): active messages on client-server
// endpoints (tcp and shared memory on one host or a network; cuda_copy / cuda_ipc where UCX has
// them). UCX moves the bytes (eager or rendezvous as it sees fit); this class only frames them as
// (kind, header, payload) and gives every open connection a stable id.
//
// One UCX worker, owned by one progress thread: callers on any thread queue their sends and the
// thread wakes through the worker's event fd. Received messages and lost connections are handed
// to callbacks on the progress thread (keep them short: queue the work elsewhere).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

namespace hypic::cluster {

struct TransportError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using PeerId = uint64_t;  // 0 is never a peer

struct Message {
  PeerId peer = 0;
  uint16_t kind = 0;
  std::string header;   // small (a few dozen bytes)
  std::string payload;  // any size
};

class UcxNode {
 public:
  using OnMessage = std::function<void(Message&&)>;
  // A connection that failed or closed; sends to it are dropped from then on.
  using OnPeerDown = std::function<void(PeerId, const std::string& why)>;

  UcxNode(OnMessage on_message, OnPeerDown on_down);  // throws TransportError naming the UCX call
  ~UcxNode();
  UcxNode(const UcxNode&) = delete;
  UcxNode& operator=(const UcxNode&) = delete;

  // Accepts connections on host:port (port 0: any free port); returns the bound port.
  int listen(const std::string& host, int port);
  // Opens a connection (resolved and started at once; a failure comes through OnPeerDown).
  PeerId connect(const std::string& host, int port);
  // Queues one message (thread-safe). A send to a closed peer is dropped.
  void send(PeerId peer, uint16_t kind, std::string header, std::string payload);
  void close(PeerId peer);  // thread-safe; no OnPeerDown for it

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hypic::cluster
