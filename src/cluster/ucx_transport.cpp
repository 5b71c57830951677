#include "cluster/ucx_transport.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <variant>

namespace hypic::cluster {

namespace {

constexpr uint16_t kAmId = 17;  // hypic's one active-message id; the message kind is in the header

void check(ucs_status_t st, const char* call) {
  if (st != UCS_OK) throw TransportError(std::string(call) + " failed: " + ucs_status_string(st));
}

sockaddr_storage resolve(const std::string& host, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0 || !res) throw TransportError("cannot resolve " + host + ": " + gai_strerror(rc));
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  ::freeaddrinfo(res);
  return ss;
}

}  // namespace

struct UcxNode::Impl {
  struct SendOp {
    PeerId peer;
    std::string frame;  // kind (2 bytes) + header
    std::string payload;
  };
  struct ConnectOp {
    PeerId peer;
    sockaddr_storage addr;
  };
  struct CloseOp {
    PeerId peer;
  };
  struct ListenOp {
    sockaddr_storage addr;
    std::shared_ptr<std::promise<int>> port;
  };
  using Op = std::variant<SendOp, ConnectOp, CloseOp, ListenOp>;
  struct SendReq {
    Impl* impl;
    PeerId peer;
    std::string frame, payload;
  };
  struct RecvReq {
    Impl* impl;
    Message msg;
  };

  OnMessage on_message;
  OnPeerDown on_down;
  ucp_context_h ctx = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_listener_h listener = nullptr;
  int efd = -1;
  std::thread thread;
  std::atomic<bool> stopping{false};
  std::atomic<PeerId> next_peer{1};

  std::mutex mu;
  std::deque<Op> ops;

  // Progress thread only.
  std::unordered_map<PeerId, ucp_ep_h> eps;
  std::unordered_map<ucp_ep_h, PeerId> peers;
  std::vector<ucp_ep_h> to_close;  // failed endpoints, closed outside UCX's callbacks

  Impl(OnMessage m, OnPeerDown d) : on_message(std::move(m)), on_down(std::move(d)) {
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
    p.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    p.name = "hypic";
    ucp_config_t* cfg = nullptr;
    check(ucp_config_read(nullptr, nullptr, &cfg), "ucp_config_read");
    const ucs_status_t st = ucp_init(&p, cfg, &ctx);
    ucp_config_release(cfg);
    check(st, "ucp_init");
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches the worker
    if (ucs_status_t s = ucp_worker_create(ctx, &wp, &worker); s != UCS_OK) {
      ucp_cleanup(ctx);
      check(s, "ucp_worker_create");
    }
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = kAmId;
    hp.cb = &Impl::am_cb;
    hp.arg = this;
    ucs_status_t s = ucp_worker_set_am_recv_handler(worker, &hp);
    if (s == UCS_OK) s = ucp_worker_get_efd(worker, &efd);
    if (s != UCS_OK) {
      ucp_worker_destroy(worker);
      ucp_cleanup(ctx);
      check(s, "ucp_worker_set_am_recv_handler / ucp_worker_get_efd");
    }
    thread = std::thread([this] { loop(); });
  }

  ~Impl() {
    stopping = true;
    ucp_worker_signal(worker);
    thread.join();
    for (auto& [peer, ep] : eps) close_ep(ep);
    for (int i = 0; i < 100; ++i) ucp_worker_progress(worker);  // let forced closes finish
    if (listener) ucp_listener_destroy(listener);
    ucp_worker_destroy(worker);
    ucp_cleanup(ctx);
  }

  void push(Op op) {
    {
      std::lock_guard<std::mutex> g(mu);
      ops.push_back(std::move(op));
    }
    ucp_worker_signal(worker);
  }

  void loop() {
    while (!stopping) {
      std::deque<Op> todo;
      {
        std::lock_guard<std::mutex> g(mu);
        todo.swap(ops);
      }
      for (auto& op : todo) std::visit([this](auto& o) { run(o); }, op);
      while (ucp_worker_progress(worker) != 0) {
      }
      for (ucp_ep_h ep : std::exchange(to_close, {})) close_ep(ep);
      const ucs_status_t st = ucp_worker_arm(worker);
      if (st == UCS_ERR_BUSY) continue;
      {
        std::lock_guard<std::mutex> g(mu);
        if (!ops.empty()) continue;
      }
      pollfd p{efd, POLLIN, 0};
      ::poll(&p, 1, 100);
    }
  }

  void close_ep(ucp_ep_h ep) {
    ucp_request_param_t cp{};
    cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &cp);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);  // released when it completes
  }

  void add_peer(PeerId id, ucp_ep_h ep) {
    eps[id] = ep;
    peers[ep] = id;
  }

  // A failed endpoint: forget it, close it after the current callback, tell the owner.
  void peer_failed(ucp_ep_h ep, const std::string& why) {
    auto it = peers.find(ep);
    if (it == peers.end()) return;
    const PeerId id = it->second;
    peers.erase(it);
    eps.erase(id);
    to_close.push_back(ep);
    if (on_down) on_down(id, why);
  }

  static void err_cb(void* arg, ucp_ep_h ep, ucs_status_t status) {
    static_cast<Impl*>(arg)->peer_failed(ep, std::string("connection lost: ") + ucs_status_string(status));
  }

  ucp_ep_params_t ep_params() {
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &Impl::err_cb;
    ep.err_handler.arg = this;
    return ep;
  }

  void run(ListenOp& o) {
    try {
      if (listener) throw TransportError("already listening");
      ucp_listener_params_t lp{};
      lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
      lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&o.addr);
      lp.sockaddr.addrlen = sizeof(sockaddr_in);
      lp.conn_handler.cb = &Impl::conn_cb;
      lp.conn_handler.arg = this;
      check(ucp_listener_create(worker, &lp, &listener), "ucp_listener_create");
      ucp_listener_attr_t la{};
      la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
      check(ucp_listener_query(listener, &la), "ucp_listener_query");
      o.port->set_value(ntohs(reinterpret_cast<const sockaddr_in*>(&la.sockaddr)->sin_port));
    } catch (...) {
      o.port->set_exception(std::current_exception());
    }
  }

  static void conn_cb(ucp_conn_request_h req, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    ucp_ep_params_t ep = self->ep_params();
    ep.field_mask |= UCP_EP_PARAM_FIELD_CONN_REQUEST;
    ep.conn_request = req;
    ucp_ep_h h = nullptr;
    if (ucs_status_t s = ucp_ep_create(self->worker, &ep, &h); s != UCS_OK) {
      spdlog::warn("cluster: cannot accept a connection: ucp_ep_create: {}", ucs_status_string(s));
      return;
    }
    self->add_peer(self->next_peer++, h);
  }

  void run(ConnectOp& o) {
    ucp_ep_params_t ep = ep_params();
    ep.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&o.addr);
    ep.sockaddr.addrlen = sizeof(sockaddr_in);
    ucp_ep_h h = nullptr;
    if (ucs_status_t s = ucp_ep_create(worker, &ep, &h); s != UCS_OK) {
      if (on_down) on_down(o.peer, std::string("ucp_ep_create: ") + ucs_status_string(s));
      return;
    }
    add_peer(o.peer, h);
  }

  void run(CloseOp& o) {
    auto it = eps.find(o.peer);
    if (it == eps.end()) return;
    peers.erase(it->second);
    close_ep(it->second);
    eps.erase(it);
  }

  static void send_cb(void* request, ucs_status_t status, void* user) {
    auto* r = static_cast<SendReq*>(user);
    if (status != UCS_OK && status != UCS_ERR_CANCELED) {
      auto it = r->impl->eps.find(r->peer);
      if (it != r->impl->eps.end())
        r->impl->peer_failed(it->second, std::string("send failed: ") + ucs_status_string(status));
    }
    delete r;
    ucp_request_free(request);
  }

  void run(SendOp& o) {
    auto it = eps.find(o.peer);
    if (it == eps.end()) return;  // closed or failed: its owner has been told
    auto* r = new SendReq{this, o.peer, std::move(o.frame), std::move(o.payload)};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    p.cb.send = &Impl::send_cb;
    p.user_data = r;
    ucs_status_ptr_t sp =
        ucp_am_send_nbx(it->second, kAmId, r->frame.data(), r->frame.size(), r->payload.data(), r->payload.size(), &p);
    if (sp == nullptr) {
      delete r;
    } else if (UCS_PTR_IS_ERR(sp)) {
      delete r;
      peer_failed(it->second, std::string("ucp_am_send_nbx: ") + ucs_status_string(UCS_PTR_STATUS(sp)));
    }
  }

  static void recv_cb(void* request, ucs_status_t status, size_t, void* user) {
    auto* r = static_cast<RecvReq*>(user);
    if (status == UCS_OK && r->impl->on_message) r->impl->on_message(std::move(r->msg));
    delete r;
    ucp_request_free(request);
  }

  static ucs_status_t am_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                            const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    if (header_length < 2 || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;  // not ours
    auto it = self->peers.find(param->reply_ep);
    if (it == self->peers.end()) return UCS_OK;
    Message m;
    m.peer = it->second;
    std::memcpy(&m.kind, header, 2);
    m.header.assign(static_cast<const char*>(header) + 2, header_length - 2);
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
      auto* r = new RecvReq{self, std::move(m)};
      r->msg.payload.resize(length);
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      p.cb.recv_am = &Impl::recv_cb;
      p.user_data = r;
      ucs_status_ptr_t sp = ucp_am_recv_data_nbx(self->worker, data, r->msg.payload.data(), length, &p);
      if (sp == nullptr) {
        if (self->on_message) self->on_message(std::move(r->msg));
        delete r;
      } else if (UCS_PTR_IS_ERR(sp)) {
        spdlog::warn("cluster: cannot receive a message: {}", ucs_status_string(UCS_PTR_STATUS(sp)));
        delete r;
      }
      return UCS_OK;
    }
    m.payload.assign(static_cast<const char*>(data), length);
    if (self->on_message) self->on_message(std::move(m));
    return UCS_OK;
  }
};

UcxNode::UcxNode(OnMessage on_message, OnPeerDown on_down)
    : impl_(std::make_unique<Impl>(std::move(on_message), std::move(on_down))) {}

UcxNode::~UcxNode() = default;

int UcxNode::listen(const std::string& host, int port) {
  auto p = std::make_shared<std::promise<int>>();
  auto f = p->get_future();
  impl_->push(Impl::ListenOp{resolve(host, port), p});
  return f.get();
}

PeerId UcxNode::connect(const std::string& host, int port) {
  const PeerId id = impl_->next_peer++;
  impl_->push(Impl::ConnectOp{id, resolve(host, port)});
  return id;
}

void UcxNode::send(PeerId peer, uint16_t kind, std::string header, std::string payload) {
  std::string frame(2, '\0');
  std::memcpy(frame.data(), &kind, 2);
  frame += header;
  impl_->push(Impl::SendOp{peer, std::move(frame), std::move(payload)});
}

void UcxNode::close(PeerId peer) {
  impl_->push(Impl::CloseOp{peer});
}

}  // namespace hypic::cluster
