#include "server/http_transport.h"

#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <unordered_map>

namespace hypic::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using tcp = net::ip::tcp;

namespace {

// ASCII case-insensitive, as header names compare (Beast's, on Boost 1.74's own string_view).
bool iequals(std::string_view a, std::string_view b) {
  return beast::iequals(beast::string_view(a.data(), a.size()), beast::string_view(b.data(), b.size()));
}

// The path of a request target: percent-decoded, without the query.
std::string target_path(const std::string& target) {
  return percent_decode(std::string_view(target).substr(0, target.find('?')));
}

std::string find_header(const HttpHeaders& h, std::string_view name) {
  for (const auto& [k, v] : h)
    if (iequals(k, name)) return v;
  return {};
}

// Sends all of `data` on a socket the event loop may have made non-blocking, waiting at most
// `timeout_ms` for room each time the socket's buffer is full.
bool send_all(int fd, std::string_view data, int timeout_ms) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      const int r = ::poll(&p, 1, timeout_ms);
      if (r > 0 && !(p.revents & (POLLERR | POLLHUP | POLLNVAL))) continue;
      if (r < 0 && errno == EINTR) continue;
    }
    return false;
  }
  return true;
}

std::string reason(int status) {
  const auto r = bhttp::obsolete_reason(static_cast<bhttp::status>(status));
  return r.empty() ? std::string("Unknown") : std::string(r);
}

// The head of a response, with Content-Length or chunked framing.
std::string response_head(const HttpResponse& res, bool close) {
  std::string h = "HTTP/1.1 " + std::to_string(res.status) + " " + reason(res.status) + "\r\nServer: hypic\r\n";
  if (!res.content_type.empty()) h += "Content-Type: " + res.content_type + "\r\n";
  for (const auto& [k, v] : res.headers) h += k + ": " + v + "\r\n";
  if (res.stream)
    h += "Transfer-Encoding: chunked\r\n";
  else
    h += "Content-Length: " + std::to_string(res.body.size()) + "\r\n";
  if (close) h += "Connection: close\r\n";
  return h + "\r\n";
}

class SocketSink : public ChunkSink {
 public:
  SocketSink(int fd, int timeout_ms) : fd_(fd), timeout_ms_(timeout_ms) {}
  bool write(std::string_view data) override {
    if (!ok_) return false;
    if (data.empty()) return true;  // an empty chunk would end the body
    char size[32];
    const int n = std::snprintf(size, sizeof size, "%zx\r\n", data.size());
    std::string c;
    c.reserve(data.size() + static_cast<size_t>(n) + 2);
    c.append(size, static_cast<size_t>(n)).append(data).append("\r\n");
    return ok_ = send_all(fd_, c, timeout_ms_);
  }
  bool ok() const { return ok_; }

 private:
  int fd_, timeout_ms_;
  bool ok_ = true;
};

// A fixed set of threads running posted tasks; at most `max_pending` wait for a thread.
class Pool {
 public:
  Pool(int threads, size_t max_pending) : max_pending_(max_pending) {
    for (int i = 0; i < std::max(threads, 1); ++i) threads_.emplace_back([this] { loop(); });
  }
  ~Pool() { stop(); }
  bool try_post(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_ || pending_.size() >= max_pending_) return false;
      pending_.push_back(std::move(f));
    }
    cv_.notify_one();
    return true;
  }
  void stop() {  // tasks still waiting are dropped; running ones finish
    std::deque<std::function<void()>> dropped;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopping_ = true;
      dropped.swap(pending_);
    }
    cv_.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }

 private:
  void loop() {
    while (true) {
      std::function<void()> f;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stopping_ || !pending_.empty(); });
        if (stopping_) return;
        f = std::move(pending_.front());
        pending_.pop_front();
      }
      f();
    }
  }
  size_t max_pending_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> pending_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

bool HttpRequest::has_header(std::string_view name) const {
  return std::any_of(headers.begin(), headers.end(), [&](const auto& h) { return iequals(h.first, name); });
}
std::string HttpRequest::header(std::string_view name) const {
  return find_header(headers, name);
}
void HttpResponse::set_header(std::string name, std::string value) {
  for (auto& [k, v] : headers)
    if (iequals(k, name)) {
      v = std::move(value);
      return;
    }
  headers.emplace_back(std::move(name), std::move(value));
}
std::string HttpResponse::header(std::string_view name) const {
  return find_header(headers, name);
}

std::string percent_decode(std::string_view s) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && hex(s[i + 1]) >= 0 && hex(s[i + 2]) >= 0) {
      out.push_back(static_cast<char>(hex(s[i + 1]) * 16 + hex(s[i + 2])));
      i += 2;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

struct HttpTransport::Impl {
  HttpLimits lim;
  Callbacks cb;
  std::atomic<bool> stopping{false};
  // Connection counts (sessions end on the loop thread or, at shutdown, wherever the last reference goes).
  mutable std::mutex count_mu;
  int open = 0;
  std::unordered_map<std::string, int> per_client;
  std::unique_ptr<Pool> heavy, light;
  // Declared last so that it is destroyed first: pending handlers own sessions, whose destructors
  // use the counts above.
  net::io_context ioc{1};
  tcp::acceptor acceptor{ioc};
  net::steady_timer accept_retry{ioc};

  void accept();
  void on_accept(beast::error_code ec, tcp::socket sock);
  // A refusal written straight to the socket by the loop thread (small; never waits), then closed.
  void refuse_now(tcp::socket& sock, int status, const std::string& msg, const HttpRequest* req);
};

namespace {

using Ms = std::chrono::milliseconds;
Ms ms(double s) {
  return Ms(static_cast<int64_t>(s * 1000));
}

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(HttpTransport::Impl& s, tcp::socket sock, std::string addr, int port)
      : s_(s), stream_(std::move(sock)), addr_(std::move(addr)), port_(port) {}
  ~Session() {
    std::lock_guard<std::mutex> lk(s_.count_mu);
    --s_.open;
    auto it = s_.per_client.find(addr_);
    if (it != s_.per_client.end() && --it->second <= 0) s_.per_client.erase(it);
  }

  void read_head() {
    if (s_.stopping) return close();
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(std::min<size_t>(s_.lim.max_head_bytes, UINT32_MAX)));
    parser_->body_limit(s_.lim.max_body_bytes);
    stream_.expires_after(ms(s_.lim.head_timeout_s));
    bhttp::async_read_header(stream_, buf_, *parser_,
                             [self = shared_from_this()](beast::error_code ec, size_t) { self->on_head(ec); });
  }

 private:
  HttpRequest partial_request() const {
    HttpRequest r;
    r.remote_addr = addr_;
    r.remote_port = port_;
    if (parser_ && parser_->is_header_done()) {
      const auto& m = parser_->get();
      r.method = std::string(m.method_string());
      r.target = std::string(m.target());
      r.path = target_path(r.target);
    }
    return r;
  }

  void on_head(beast::error_code ec) {
    if (ec == bhttp::error::header_limit) return refuse(431, "the request head is larger than the server's limit");
    if (ec) return close();  // timeout, reset, end of stream or a malformed head: nothing to answer
    const auto& m = parser_->get();
    if (const auto len = parser_->content_length(); len && *len > s_.lim.max_body_bytes)
      return refuse(413, "the request body is larger than the server's limit of " +
                             std::to_string(s_.lim.max_body_bytes) + " bytes (--max-body-mib)");
    if (iequals(std::string(m[bhttp::field::expect]), "100-continue") && !parser_->is_done()) {
      static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      ::send(stream_.socket().native_handle(), kContinue.data(), kContinue.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    if (parser_->is_done()) return on_body({});
    stream_.expires_after(ms(s_.lim.body_timeout_s));
    bhttp::async_read(stream_, buf_, *parser_,
                      [self = shared_from_this()](beast::error_code e, size_t) { self->on_body(e); });
  }

  void on_body(beast::error_code ec) {
    if (ec == bhttp::error::body_limit)
      return refuse(413, "the request body is larger than the server's limit of " +
                             std::to_string(s_.lim.max_body_bytes) + " bytes (--max-body-mib)");
    if (ec == beast::error::timeout || ec == net::error::eof || ec == bhttp::error::end_of_stream ||
        ec == net::error::connection_reset)
      return close();
    if (ec) return refuse(400, "the request could not be read: " + ec.message());
    stream_.expires_never();
    auto msg = parser_->release();
    parser_.reset();
    HttpRequest req;
    req.method = std::string(msg.method_string());
    if (req.method == "HEAD") {
      req.method = "GET";
      req.head = true;
    }
    req.target = std::string(msg.target());
    req.path = target_path(req.target);
    req.remote_addr = addr_;
    req.remote_port = port_;
    req.fd = stream_.socket().native_handle();
    for (const auto& f : msg) req.headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
    req.body = std::move(msg.body());
    keep_alive_ = msg.keep_alive();
    const bool heavy = s_.cb.heavy && s_.cb.heavy(req);
    auto shared = std::make_shared<HttpRequest>(std::move(req));
    auto task = [self = shared_from_this(), shared] { self->serve(*shared); };
    if (!(heavy ? s_.heavy : s_.light)->try_post(std::move(task)))
      refuse(503, "the server is busy (every worker is taken and the wait list is full); retry later", shared.get());
  }

  // On a worker thread: the handler, then the response, then back to the loop for the next request.
  void serve(const HttpRequest& req) {
    HttpResponse res;
    try {
      s_.cb.handle(req, res);
    } catch (const std::exception& e) {
      res = HttpResponse{};
      s_.cb.refuse(res, 500, std::string("internal error: ") + e.what());
    }
    const bool close_after = res.close || !keep_alive_ || s_.stopping;
    if (!res.stream) {
      // The loop writes it: a client that does not read holds no thread, only its socket, until
      // the write deadline. (Logged here, on the handler's thread, before the bytes go out.)
      if (s_.cb.done) s_.cb.done(req, res);
      auto out = std::make_shared<std::string>(response_head(res, close_after));
      if (!req.head) *out += res.body;
      net::post(stream_.get_executor(), [self = shared_from_this(), out, close_after] {
        self->stream_.expires_after(ms(self->s_.lim.write_timeout_s));
        net::async_write(self->stream_, net::buffer(*out), [self, out, close_after](beast::error_code ec, size_t) {
          self->stream_.expires_never();
          if (ec || close_after)
            self->close();
          else
            self->read_head();
        });
      });
      return;
    }
    const int fd = stream_.socket().native_handle();
    const int wt = static_cast<int>(s_.lim.write_timeout_s * 1000);
    bool ok = send_all(fd, response_head(res, close_after), wt);
    SocketSink sink(fd, wt);
    ok = ok && res.stream(sink) && sink.ok();
    static const std::string kEnd = "0\r\n\r\n";
    ok = ok && send_all(fd, kEnd, wt);
    if (s_.cb.done) s_.cb.done(req, res);
    net::post(stream_.get_executor(), [self = shared_from_this(), again = ok && !close_after] {
      if (again)
        self->read_head();
      else
        self->close();
    });
  }

  void refuse(int status, const std::string& msg, const HttpRequest* req = nullptr) {
    HttpRequest r = req ? *req : partial_request();
    s_.refuse_now(stream_.socket(), status, msg, &r);
    close();
  }

  void close() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.close();
  }

  HttpTransport::Impl& s_;
  beast::tcp_stream stream_;
  beast::flat_buffer buf_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::string addr_;
  int port_;
  bool keep_alive_ = true;
};

}  // namespace

void HttpTransport::Impl::refuse_now(tcp::socket& sock, int status, const std::string& msg, const HttpRequest* req) {
  HttpResponse res;
  if (cb.refuse) cb.refuse(res, status, msg);
  res.status = status;
  res.close = true;
  // One non-blocking attempt: a small answer fits the socket's buffer, and the loop must not wait
  // on a client that does not read.
  const std::string out = response_head(res, true) + res.body;
  ::send(sock.native_handle(), out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  if (cb.done && req) cb.done(*req, res);
}

void HttpTransport::Impl::accept() {
  acceptor.async_accept(net::make_strand(ioc),
                        [this](beast::error_code ec, tcp::socket sock) { on_accept(ec, std::move(sock)); });
}

void HttpTransport::Impl::on_accept(beast::error_code ec, tcp::socket sock) {
  if (stopping || !acceptor.is_open()) return;
  if (ec) {  // out of file descriptors, typically: wait a little rather than spin
    accept_retry.expires_after(Ms(50));
    accept_retry.async_wait([this](beast::error_code e) {
      if (!e) accept();
    });
    return;
  }
  beast::error_code e2;
  const auto peer = sock.remote_endpoint(e2);
  const std::string addr = e2 ? std::string("?") : peer.address().to_string();
  const int port = e2 ? 0 : peer.port();
  bool over_total = false, over_client = false;
  {
    std::lock_guard<std::mutex> lk(count_mu);
    over_total = open >= lim.max_connections;
    over_client =
        !over_total && lim.max_connections_per_client > 0 && per_client[addr] >= lim.max_connections_per_client;
    if (!over_total && !over_client) {
      ++open;
      ++per_client[addr];
    } else if (per_client[addr] == 0) {
      per_client.erase(addr);
    }
  }
  if (over_total || over_client) {
    HttpRequest r;
    r.remote_addr = addr;
    r.remote_port = port;
    refuse_now(sock, 503,
               over_total ? "too many open connections (" + std::to_string(lim.max_connections) + "); retry later"
                          : "too many open connections from " + addr + " (" +
                                std::to_string(lim.max_connections_per_client) + "); retry later",
               &r);
    sock.shutdown(tcp::socket::shutdown_both, e2);
    sock.close(e2);
  } else {
    sock.set_option(tcp::no_delay(true), e2);
    std::make_shared<Session>(*this, std::move(sock), addr, port)->read_head();
  }
  accept();
}

HttpTransport::HttpTransport(HttpLimits limits, Callbacks cb) : impl_(std::make_shared<Impl>()) {
  impl_->lim = limits;
  impl_->cb = std::move(cb);
  // Idle and slow connections cost a descriptor each: take the hard limit, and cap connections below it.
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    if (rl.rlim_cur < rl.rlim_max) {
      rl.rlim_cur = rl.rlim_max;
      setrlimit(RLIMIT_NOFILE, &rl);
      getrlimit(RLIMIT_NOFILE, &rl);
    }
    if (rl.rlim_cur != RLIM_INFINITY)
      impl_->lim.max_connections = static_cast<int>(std::min<rlim_t>(
          static_cast<rlim_t>(impl_->lim.max_connections), rl.rlim_cur > 256 ? rl.rlim_cur - 128 : rl.rlim_cur / 2));
  }
  const int w = std::max(limits.workers, 1), lw = std::max(limits.light_workers, 1);
  impl_->heavy = std::make_unique<Pool>(w, static_cast<size_t>(w));
  // Light requests never block their thread (answers are written by the loop), and a connection has
  // one request in flight at a time: their wait list is bounded by the connections.
  impl_->light = std::make_unique<Pool>(lw, static_cast<size_t>(std::max(impl_->lim.max_connections, 64)));
}

HttpTransport::~HttpTransport() {
  stop();
}

int HttpTransport::bind(const std::string& host, int port) {
  auto& s = *impl_;
  beast::error_code ec;
  const auto addr = net::ip::make_address(host == "localhost" ? "127.0.0.1" : host, ec);
  if (ec) throw std::runtime_error("cannot bind to " + host + ": not an IP address (" + ec.message() + ")");
  const tcp::endpoint ep(addr, static_cast<unsigned short>(port));
  s.acceptor.open(ep.protocol(), ec);
  if (!ec) s.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) s.acceptor.bind(ep, ec);
  if (!ec) s.acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) throw std::runtime_error("cannot bind to " + host + ":" + std::to_string(port) + ": " + ec.message());
  return s.acceptor.local_endpoint().port();
}

void HttpTransport::run() {
  auto& s = *impl_;
  if (s.stopping) return;
  s.accept();
  s.ioc.run();
}

void HttpTransport::stop() {
  auto& s = *impl_;
  if (s.stopping.exchange(true)) return;
  net::post(s.ioc, [&s] {
    beast::error_code ec;
    s.acceptor.close(ec);
    s.accept_retry.cancel();
  });
  // Handlers return once the engine has failed their jobs (the caller stops it first); what they
  // still write goes out, then the loop ends, closing every connection it owns.
  s.heavy->stop();
  s.light->stop();
  s.ioc.stop();
}

}  // namespace hypic::server
