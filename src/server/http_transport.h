// The HTTP/1.1 layer under `hypic serve`, on Boost.Beast and Asio (Debian's libboost-dev, header-only):
// one event-loop thread owns every connection while it is idle or sending a request, so an idle or
// slow connection costs a socket and a small buffer, not a thread; a request reaches a worker thread
// only once its head and body are complete. Chosen over cpp-httplib (a thread per connection, no
// deadline on a request head) and libmicrohttpd (a C API whose streamed responses would need its
// suspend/resume machinery, and a shared library to carry to the GPU machine).
//  * Deadlines: a request head must be complete within `head_timeout_s` of the connection opening or
//    of the previous response (idle keep-alive included), its body within `body_timeout_s`; a client
//    that stops reading a response is dropped after `write_timeout_s`.
//  * Limits: head size (431), body size whatever its framing, chunked included (413, before reading
//    it when Content-Length says so), connections in total and per client address (503 past them),
//    requests waiting for a worker (503).
//  * Pipelined requests are answered in order, one at a time. Range headers are not implemented (the
//    full response). Paths are percent-decoded. HEAD is answered as GET without the body.
//  * A response with a body is written by the event loop (a client that does not read holds no
//    thread); only streamed responses are written by their handler's thread.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace hypic::server {

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method;  // as sent ("GET", "POST", ...); a HEAD request arrives as "GET" with `head` set
  bool head = false;   // HEAD: the GET answer's head only
  std::string target;  // as sent: path and query
  std::string path;    // percent-decoded, without the query
  std::string body;
  std::string remote_addr;
  int remote_port = 0;
  HttpHeaders headers;
  // The connection's socket, for a handler to poll whether the client went away while it waits (it
  // must not read or write it).
  int fd = -1;
  bool has_header(std::string_view name) const;     // names compare case-insensitively
  std::string header(std::string_view name) const;  // "" when absent
};

// Where a streamed response's body goes, one chunk per write.
class ChunkSink {
 public:
  virtual ~ChunkSink() = default;
  virtual bool write(std::string_view data) = 0;  // false: the client is gone or stopped reading
};

struct HttpResponse {
  int status = 200;
  std::string body, content_type;
  HttpHeaders headers;
  bool close = false;  // close the connection after this response
  // A streamed body (chunked encoding), written by this function on the handler's thread after the
  // head; returns false when the client went away (the response is then cut short).
  std::function<bool(ChunkSink&)> stream;
  void set_header(std::string name, std::string value);
  void set_content(std::string b, std::string type) {
    body = std::move(b);
    content_type = std::move(type);
  }
  std::string header(std::string_view name) const;
};

struct HttpLimits {
  size_t max_body_bytes = size_t(32) << 20;
  size_t max_head_bytes = size_t(64) << 10;
  double head_timeout_s = 15;
  double body_timeout_s = 120;
  double write_timeout_s = 30;
  int max_connections = 8192;             // lowered to what the process's open-file limit allows
  int max_connections_per_client = 2048;  // per remote address; 0: no per-client cap
  int workers = 16;                       // threads for requests that may block (generation, segment builds)
  int light_workers = 2;                  // threads for the others (health, metrics, listings, errors)
};

class HttpTransport {
 public:
  struct Callbacks {
    std::function<void(const HttpRequest&, HttpResponse&)> handle;  // on a worker thread
    std::function<bool(const HttpRequest&)> heavy;                  // true: may block long, runs on the `workers` pool
    // Fills a refusal of the transport itself (400, 413, 431, 503, 500) with the API's error body.
    std::function<void(HttpResponse&, int status, const std::string& message)> refuse;
    // After each response went out (or failed), on the thread that wrote it: logging and metrics.
    std::function<void(const HttpRequest&, const HttpResponse&)> done;
  };
  HttpTransport(HttpLimits limits, Callbacks cb);
  ~HttpTransport();
  // Binds and listens; port 0 picks a free one. Returns the port; throws std::runtime_error naming
  // the address when it cannot bind.
  int bind(const std::string& host, int port);
  void run();   // serves until stop(); returns at once if stop() came first
  void stop();  // stops accepting, lets handlers finish, closes every connection

  struct Impl;  // (public for the connection sessions of the .cpp)

 private:
  std::shared_ptr<Impl> impl_;
};

// "/v1/a%20b" -> "/v1/a b" (no '+' rule: that is for query strings); malformed escapes stay as sent.
std::string percent_decode(std::string_view s);

}  // namespace hypic::server
