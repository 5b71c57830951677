// hypic_attack: the hardening issue's attacks replayed against `hypic serve`, each on a fresh server
// process, checking after (or during) each that a normal request is still served within a stated
// time and that the server's resident memory stays under a stated bound. Prints a JSON line per
// attack and a table; exits 1 when any check fails.
//   hypic_attack --server build/hypic --model models/default [--sockets 1024] [--deadline-s 1]
//                [--rss-limit-mib 1024] [--post-scale 1] [--only NAME,...] [--serve-arg ARG]... [--server-log FILE]
// Attacks: idle_flood, keepalive_flood, slowloris, connection_cap, huge_chunked_body, huge_head,
// range_header, pipelined, slow_readers, big_segment_post, many_segment_prompt, chat_without_max_tokens,
// abandoned_queue,
// tiny_segments, short_segments, cross_origin, fifo_in_cache_dir, log_injection, form_content_type,
// delete_during_pic.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "server_process.h"

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

struct Args {
  std::string server, model, log = "/dev/null";
  std::vector<std::string> serve_args, only;
  int sockets = 1024;
  double deadline_s = 1, rss_limit_mib = 1024;
  // Documents of the large posts (big_segment_post, short_segments) as a fraction of the full run's
  // 1000 and 2000: CI runs 0.25 (the sanitizer build spends minutes on the full posts).
  double post_scale = 1;
  int scaled(int n) const { return std::max(1, static_cast<int>(n * post_scale)); }
};

[[noreturn]] void usage_exit(const std::string& msg) {
  std::fprintf(stderr, "hypic_attack: %s\n", msg.c_str());
  std::exit(2);
}

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

int connect_to(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

bool send_str(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

// Reads until the peer closes or `timeout_s` passes.
std::string read_all(int fd, double timeout_s) {
  std::string out;
  const auto t0 = Clock::now();
  char buf[65536];
  while (since(t0) < timeout_s) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// The bytes of a JSON POST (kept alive unless `extra_headers` says otherwise).
std::string json_post(const std::string& path, const std::string& body, const std::string& extra_headers = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra_headers +
         "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

struct Reply {
  int status = -1;  // -1: no answer in time
  std::string body;
  double seconds = 0;
};

// One request on its own connection (Connection: close), answered within `timeout_s`.
Reply request(int port, const std::string& method, const std::string& path, const std::string& body = "",
              const std::string& extra_headers = "", double timeout_s = 30) {
  Reply r;
  const auto t0 = Clock::now();
  const int fd = connect_to(port);
  if (fd < 0) return r;
  const std::string close_hdr = "Connection: close\r\n" + extra_headers;
  send_str(fd, method == "POST" ? json_post(path, body, close_hdr)
                                : method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" + close_hdr + "\r\n");
  const std::string resp = read_all(fd, timeout_s);
  close(fd);
  r.seconds = since(t0);
  if (resp.rfind("HTTP/1.1 ", 0) != 0) return r;
  r.status = std::atoi(resp.c_str() + 9);
  const size_t b = resp.find("\r\n\r\n");
  if (b != std::string::npos) r.body = resp.substr(b + 4);
  return r;
}

const std::string kNormal = R"({"prompt": "Hello there", "max_tokens": 4, "temperature": 0})";

// A normal completion request; true when answered 200 within the deadline.
bool normal_served(int port, double deadline_s, double& seconds) {
  const Reply r = request(port, "POST", "/v1/completions", kNormal, "", deadline_s * 5 + 5);
  seconds = r.seconds;
  return r.status == 200 && r.seconds <= deadline_s;
}

struct Result {
  std::string name, what;
  bool ok = true;
  double normal_s = -1, rss_mib = 0;
  std::vector<std::string> failures;
  void check(bool c, const std::string& why) {
    if (!c) {
      ok = false;
      failures.push_back(why);
    }
  }
};

class Attack {
 public:
  // `running`: --max-running (the queue holds four times as many).
  // `log`: the server's log file (default --server-log).
  Attack(const Args& a, std::vector<std::string> extra, int running = 4, const std::string& log = "") {
    std::vector<std::string> args = a.serve_args;
    for (auto& e : extra) args.push_back(e);
    pid_ = start_server(a.server, a.model, args, running, port_, log.empty() ? a.log : log);
  }
  ~Attack() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  int port() const { return port_; }
  double rss_mib() const { return status_kib(pid_, "VmHWM:") / 1024.0; }
  bool alive() const { return kill(pid_, 0) == 0; }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
};

void close_all(std::vector<int>& fds) {
  for (int fd : fds)
    if (fd >= 0) close(fd);
  fds.clear();
}

std::vector<int> open_sockets(int port, int n, const std::string& first_bytes = "") {
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    const int fd = connect_to(port);
    if (fd < 0) break;
    if (!first_bytes.empty()) send_str(fd, first_bytes);
    fds.push_back(fd);
  }
  return fds;
}

std::vector<std::string> docs(int n, int words, int seed) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) {
    std::string t = "Document " + std::to_string(seed * 100000 + i) + ":";
    for (int w = 0; w < words; ++w) t += " w" + std::to_string((i * 31 + w * 7) % 997);
    out.push_back(std::move(t));
  }
  return out;
}
std::string docs_post(int n, int words, int seed) {
  json segs = json::array();
  for (auto& t : docs(n, words, seed)) segs.push_back(json{{"text", t}});
  return json{{"segments", segs}}.dump();
}

// The checks every attack shares: a normal request answered within the deadline (while the attack
// runs), the server alive, its peak RSS under the bound.
void normal(const Args& a, const Attack& srv, Result& r, const std::string& when) {
  double s = 0;
  const bool ok = normal_served(srv.port(), a.deadline_s, s);
  r.normal_s = std::max(r.normal_s, s);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f s", s);
  r.check(ok, "normal request " + when + " not served within the deadline (" + buf + ")");
}
void finish(const Args& a, const Attack& srv, Result& r) {
  r.check(srv.alive(), "the server died");
  r.rss_mib = srv.rss_mib();
  r.check(r.rss_mib <= a.rss_limit_mib,
          "peak RSS " + std::to_string(static_cast<int>(r.rss_mib)) + " MiB over the bound");
}

void idle_flood(const Args& a, Result& r) {
  r.what = std::to_string(a.sockets) + " connections opened and left idle";
  Attack srv(a, {});
  auto fds = open_sockets(srv.port(), a.sockets);
  r.check(static_cast<int>(fds.size()) == a.sockets, "only " + std::to_string(fds.size()) + " sockets connected");
  normal(a, srv, r, "among idle connections");
  close_all(fds);
  finish(a, srv, r);
}

void keepalive_flood(const Args& a, Result& r) {
  r.what = std::to_string(a.sockets) + " keep-alive connections, each after one answered request";
  Attack srv(a, {});
  auto fds = open_sockets(srv.port(), a.sockets, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  normal(a, srv, r, "among kept-alive connections");
  int answered = 0;  // every one of those requests got its 200 (none refused as busy)
  for (int fd : fds) {
    pollfd p{fd, POLLIN, 0};
    char buf[512];
    if (poll(&p, 1, 2000) > 0) {
      const ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      answered += n > 12 && std::string(buf, 12) == "HTTP/1.1 200";
    }
  }
  r.check(answered == static_cast<int>(fds.size()),
          std::to_string(fds.size() - answered) + " of the flood's own requests not answered 200");
  close_all(fds);
  finish(a, srv, r);
}

void slowloris(const Args& a, Result& r) {
  r.what = std::to_string(a.sockets) +
           " connections trickling a request head (a byte per socket every 0.5 s); --head-timeout-s 2";
  Attack srv(a, {"--head-timeout-s", "2"});
  auto fds = open_sockets(srv.port(), a.sockets, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n");
  std::atomic<bool> go{true};
  std::thread trickle([&] {
    while (go) {
      for (int fd : fds) send(fd, "X", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  });
  normal(a, srv, r, "during the trickle");
  std::this_thread::sleep_for(std::chrono::milliseconds(2600));
  normal(a, srv, r, "after the head timeout");
  go = false;
  trickle.join();
  // Every trickling connection was closed by the server at its head deadline.
  int closed = 0;
  for (int fd : fds) {
    pollfd p{fd, POLLIN, 0};
    char c;
    if (poll(&p, 1, 0) > 0 && recv(fd, &c, 1, MSG_DONTWAIT) <= 0) ++closed;
  }
  r.check(closed == static_cast<int>(fds.size()),
          std::to_string(fds.size() - closed) + " trickling connections still open after the head timeout");
  close_all(fds);
  finish(a, srv, r);
}

void connection_cap(const Args& a, Result& r) {
  r.what = "--max-connections-per-client 32: 32 idle connections, then one more";
  Attack srv(a, {"--max-connections-per-client", "32"});
  auto fds = open_sockets(srv.port(), 32);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const Reply over = request(srv.port(), "GET", "/health");
  r.check(over.status == 503 && over.body.find("too many open connections") != std::string::npos,
          "the connection past the cap got " + std::to_string(over.status));
  close_all(fds);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  normal(a, srv, r, "after the capped connections closed");
  finish(a, srv, r);
}

void huge_chunked_body(const Args& a, Result& r) {
  r.what = "a 512 MiB chunked request body (limit 32 MiB)";
  Attack srv(a, {});
  const int fd = connect_to(srv.port());
  send_str(fd,
           "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           "Transfer-Encoding: chunked\r\n\r\n");
  const std::string chunk = "100000\r\n" + std::string(1 << 20, ' ') + "\r\n";
  int sent = 0;
  for (; sent < 512; ++sent)
    if (!send_str(fd, chunk)) break;
  const std::string resp = read_all(fd, 5);
  close(fd);
  r.check(resp.rfind("HTTP/1.1 413", 0) == 0, "no 413 (got: " + resp.substr(0, 20) + ")");
  r.check(sent < 512, "the server read all 512 MiB");
  normal(a, srv, r, "after the upload");
  finish(a, srv, r);
}

void huge_head(const Args& a, Result& r) {
  r.what = "a 1 MiB request head";
  Attack srv(a, {});
  const Reply big = request(srv.port(), "GET", "/health", "", "X-Big: " + std::string(1 << 20, 'a') + "\r\n");
  r.check(big.status == 431, "got " + std::to_string(big.status) + ", not 431");
  normal(a, srv, r, "after it");
  finish(a, srv, r);
}

void range_header(const Args& a, Result& r) {
  r.what = "GET /v1/models with a Range of 2000 overlapping ranges";
  Attack srv(a, {});
  const Reply plain = request(srv.port(), "GET", "/v1/models");
  std::string many = "bytes=0-";
  for (int i = 0; i < 2000; ++i) many += ",0-";
  const Reply ranged = request(srv.port(), "GET", "/v1/models", "", "Range: " + many + "\r\n");
  r.check(ranged.status == 200 && ranged.body == plain.body, "the ranged answer differs from the plain one");
  finish(a, srv, r);
}

void pipelined(const Args& a, Result& r) {
  r.what = "three requests in one packet on one connection";
  Attack srv(a, {});
  const int fd = connect_to(srv.port());
  const std::string one = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
  send_str(fd, one + json_post("/v1/completions", kNormal) +
                   "GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  const std::string resp = read_all(fd, 10);
  close(fd);
  const size_t p1 = resp.find("HTTP/1.1 200"), p2 = resp.find("HTTP/1.1 200", p1 + 1),
               p3 = p2 == std::string::npos ? p2 : resp.find("HTTP/1.1 200", p2 + 1);
  r.check(p3 != std::string::npos, "not all three answered 200");
  r.check(resp.find("\"status\"") < resp.find("\"choices\"") && resp.find("\"choices\"") < resp.find("\"owned_by\""),
          "the answers are not in request order");
  finish(a, srv, r);
}

void slow_readers(const Args& a, Result& r) {
  r.what = "8 connections pipelining 20000 GET /metrics each and reading none of the answers";
  Attack srv(a, {});
  std::string many;
  for (int i = 0; i < 20000; ++i) many += "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  std::vector<int> fds;
  for (int i = 0; i < 8; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    const int small = 4096;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(srv.port()));
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
      close(fd);
      continue;
    }
    timeval tv{3, 0};  // the sender gives up once the server stops reading requests
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    fds.push_back(fd);
  }
  std::vector<std::thread> senders;
  for (int fd : fds) senders.emplace_back([fd, &many] { send_str(fd, many); });
  std::this_thread::sleep_for(std::chrono::milliseconds(2000));
  const Reply health = request(srv.port(), "GET", "/health", "", "", a.deadline_s * 5 + 5);
  r.check(health.status == 200 && health.seconds <= a.deadline_s, "GET /health not answered within the deadline");
  normal(a, srv, r, "while the answers pile up");
  for (auto& t : senders) t.join();
  close_all(fds);
  finish(a, srv, r);
}

void big_segment_post(const Args& a, Result& r) {
  const int n = a.scaled(1000);
  r.what = "POST /v1/segments of " + std::to_string(n) + " documents while normal requests arrive";
  Attack srv(a, {});
  double idle = 0;
  normal_served(srv.port(), 60, idle);
  Reply big;
  std::thread t([&] { big = request(srv.port(), "POST", "/v1/segments", docs_post(n, 40, 1), "", 600); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  normal(a, srv, r, "during the post");
  t.join();
  r.check(big.status == 200, "the post got " + std::to_string(big.status));
  finish(a, srv, r);
}

// A prompt of many cached documents: its composition (every document's seam through every layer)
// runs at most --prefill-chunk seam rows per engine iteration, so a normal request is served
// between the steps.
void many_segment_prompt(const Args& a, Result& r) {
  r.what = "a completion over 60 cached documents while normal requests arrive";
  Attack srv(a, {});
  const Reply post = request(srv.port(), "POST", "/v1/segments", docs_post(60, 8, 2), "", 600);
  r.check(post.status == 200, "the segment post got " + std::to_string(post.status));
  std::string prompt = "Answer from the documents.";
  for (auto& t : docs(60, 8, 2)) prompt += "<<PIC_SEP>>" + t;
  prompt += "<<PIC_SEP>>Which document mentions w5?";
  Reply big;
  const std::string body = json{{"prompt", prompt}, {"max_tokens", 2}, {"temperature", 0}}.dump();
  std::thread t([&] { big = request(srv.port(), "POST", "/v1/completions", body, "", 600); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  normal(a, srv, r, "during its composition");
  t.join();
  r.check(big.status == 200, "the prompt got " + std::to_string(big.status));
  if (big.status == 200) {
    const json b = json::parse(big.body, nullptr, false);
    const int hits = b.contains("pic") ? b["pic"].value("hit_segments", 0) : 0;
    r.check(hits == 60, std::to_string(hits) + " of the 60 documents were cache hits");
  }
  finish(a, srv, r);
}

void chat_without_max_tokens(const Args& a, Result& r) {
  r.what = "8 streamed chats without max_tokens (ignore_eos), then the clients vanish";
  Attack srv(a, {}, 16);
  const std::string body =
      R"({"messages": [{"role": "user", "content": "Tell me everything."}], "stream": true, "ignore_eos": true})";
  std::vector<int> fds;
  for (int i = 0; i < 8; ++i) {
    const int fd = connect_to(srv.port());
    send_str(fd, json_post("/v1/chat/completions", body));
    fds.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  normal(a, srv, r, "while they stream");
  close_all(fds);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  normal(a, srv, r, "after they vanished");
  finish(a, srv, r);
}

void abandoned_queue(const Args& a, Result& r) {
  r.what = "64 requests whose clients give up while queued (--max-running 1, --max-queue 4)";
  Attack srv(a, {}, 1);
  const std::string body = R"({"prompt": "Go on", "max_tokens": 200, "ignore_eos": true})";
  for (int i = 0; i < 64; ++i) {
    const int fd = connect_to(srv.port());
    send_str(fd, json_post("/v1/completions", body));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    close(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const Reply after = request(srv.port(), "POST", "/v1/completions", kNormal, "", 30);
  r.check(after.status == 200, "a new request got " + std::to_string(after.status) + " after the clients left");
  normal(a, srv, r, "after the clients left");
  finish(a, srv, r);
}

void tiny_segments(const Args& a, Result& r) {
  r.what = "3000 two-token segments in one post";
  Attack srv(a, {});
  json segs = json::array();
  for (int i = 0; i < 3000; ++i) segs.push_back(json{{"ids", json::array({i % 400 + 10, i % 97 + 3})}});
  const Reply rep = request(srv.port(), "POST", "/v1/segments", json{{"segments", segs}}.dump(), "", 300);
  r.check(rep.status == 200, "the post got " + std::to_string(rep.status));
  normal(a, srv, r, "after it");
  finish(a, srv, r);
}

// Entries tied to content: 2000 (scaled) segments just past the seam are all stored, and their entries are
// small next to a ten-times-longer segment's (before compact bodies every entry cost the model's
// full T and S whatever its length: 1.25 MB each on the default model, 2.5 GB for this post; now
// 217 KB for 16 tokens).
void short_segments(const Args& a, Result& r) {
  const int n = a.scaled(2000);
  r.what = std::to_string(n) + " sixteen-token segments in one post, every one stored";
  Attack srv(a, {});
  auto ids_of = [](int i, int n) {
    json ids = json::array({3 + i % 500, 3 + i / 500});  // distinct segments for i < 254000
    for (int t = 2; t < n; ++t) ids.push_back(3 + (i * 7 + t * 13) % 500);
    return ids;
  };
  json segs = json::array();
  for (int i = 0; i < n; ++i) segs.push_back(json{{"ids", ids_of(i, 16)}});
  const Reply rep = request(srv.port(), "POST", "/v1/segments", json{{"segments", segs}}.dump(), "", 600);
  r.check(rep.status == 200, "the post got " + std::to_string(rep.status));
  const Reply big = request(srv.port(), "POST", "/v1/segments",
                            json{{"segments", json::array({json{{"ids", ids_of(3001, 160)}}})}}.dump(), "", 60);
  r.check(big.status == 200, "the 160-token post got " + std::to_string(big.status));
  if (rep.status == 200 && big.status == 200) {
    const json d = json::parse(rep.body, nullptr, false), b = json::parse(big.body, nullptr, false);
    double bytes = 0;
    int stored = 0;
    if (d.contains("data"))
      for (const auto& e : d["data"])
        if (e.value("stored", false)) ++stored, bytes += e.value("bytes", 0.0);
    const double per = stored ? bytes / stored : 0,
                 big_bytes = b.contains("data") && !b["data"].empty() ? b["data"][0].value("bytes", 0.0) : 0;
    r.check(stored == n, std::to_string(stored) + " of " + std::to_string(n) + " segments stored");
    r.check(per > 0 && per * 3 < big_bytes,
            "a 16-token entry takes " + std::to_string(static_cast<int64_t>(per)) + " bytes, a 160-token one " +
                std::to_string(static_cast<int64_t>(big_bytes)) + ": not tied to length");
  }
  normal(a, srv, r, "after it");
  finish(a, srv, r);
}

// A FIFO planted in --cache-dir under an entry's file name: the entry is a miss and recomputed,
// nothing hangs (the store opens files with O_NONBLOCK and checks they are regular files).
void fifo_in_cache_dir(const Args& a, Result& r) {
  r.what = "a FIFO planted in --cache-dir under a cached entry's file name";
  char tmpl[] = "/tmp/hypic_attack_fifo_XXXXXX";
  const char* dir = mkdtemp(tmpl);
  if (!dir) {
    r.check(false, "mkdtemp failed");
    return;
  }
  const std::string post =
      R"({"segments": [{"text": "A document that is cached on disk, long enough to have a body."}]})";
  std::string id;
  {
    Attack first(a, {"--cache-dir", dir});
    const Reply p = request(first.port(), "POST", "/v1/segments", post, "", 60);
    r.check(p.status == 200, "the first post got " + std::to_string(p.status));
    const json j = json::parse(p.body, nullptr, false);
    if (j.contains("data") && !j["data"].empty()) id = j["data"][0].value("id", "");
  }
  const std::string file = std::string(dir) + "/" + id + ".hseg";
  r.check(!id.empty() && std::filesystem::exists(file), "no entry file " + file);
  std::filesystem::remove(file);
  r.check(mkfifo(file.c_str(), 0644) == 0, "mkfifo failed");
  {
    Attack srv(a, {"--cache-dir", dir});
    const Reply p = request(srv.port(), "POST", "/v1/segments", post, "", 10);
    r.check(p.status == 200 && p.body.find("\"cached\":false") != std::string::npos,
            "the post over the FIFO got " + std::to_string(p.status) + " " + p.body.substr(0, 200));
    const Reply h = request(srv.port(), "GET", "/health", "", "", 5);
    r.check(h.status == 200, "/health got " + std::to_string(h.status));
    normal(a, srv, r, "after it");
    finish(a, srv, r);
  }
  std::filesystem::remove_all(dir);
}

// A URL with %0A cannot forge a line in the server's log: control bytes are escaped.
void log_injection(const Args& a, Result& r) {
  r.what = "GET of a URL with %0A and an escape sequence, to forge a log line";
  char tmpl[] = "/tmp/hypic_attack_log_XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd >= 0) close(fd);
  {
    Attack srv(a, {}, 4, tmpl);
    const Reply g = request(srv.port(), "GET", "/v1/nothing%0A2026-12-01%20forged%20line%1B[31m", "", "", 5);
    r.check(g.status == 404, "got " + std::to_string(g.status));
    normal(a, srv, r, "after it");
    finish(a, srv, r);
  }
  std::ifstream in(tmpl);
  bool escaped = false;
  for (std::string line; std::getline(in, line);) {
    r.check(line.rfind("2026-12-01 forged", 0) != 0, "a forged log line: " + line);
    r.check(line.find('\x1b') == std::string::npos, "an escape byte in the log: " + line);
    escaped |= line.find("\\x0a2026-12-01 forged line") != std::string::npos;
  }
  r.check(escaped, "the request's line (escaped) is not in the log");
  std::remove(tmpl);
}

// `curl -d` sends JSON as application/x-www-form-urlencoded: read as JSON at any size up to the limit.
void form_content_type(const Args& a, Result& r) {
  r.what = "a 20 KB JSON completion sent as application/x-www-form-urlencoded (curl -d)";
  Attack srv(a, {});
  std::string body = kNormal;
  body.insert(body.size() - 1, std::string(20000, ' '));
  const int fd = connect_to(srv.port());
  send_str(fd,
           "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
           "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: " +
               std::to_string(body.size()) + "\r\n\r\n" + body);
  const std::string resp = read_all(fd, 30);
  close(fd);
  r.check(resp.rfind("HTTP/1.1 200", 0) == 0, "got " + resp.substr(0, 60));
  finish(a, srv, r);
}

// DELETE /v1/segments while PIC requests run: every answer's cache report stays whole (each context
// segment a hit or a miss), nothing is answered with an error, nothing crashes.
void delete_during_pic(const Args& a, Result& r) {
  r.what = "DELETE /v1/segments every 20 ms during 24 PIC requests";
  Attack srv(a, {});
  std::string prompt = "Answer from the documents.";
  for (auto& t : docs(4, 20, 3)) prompt += "<<PIC_SEP>>" + t;
  prompt += "<<PIC_SEP>>Which document mentions w7?";
  const std::string body = json{{"prompt", prompt}, {"max_tokens", 2}, {"temperature", 0}}.dump();
  std::atomic<bool> stop{false};
  std::thread deleter([&] {
    while (!stop) {
      request(srv.port(), "DELETE", "/v1/segments", "", "", 10);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  int bad = 0, wrong = 0;
  for (int i = 0; i < 24; ++i) {
    const Reply p = request(srv.port(), "POST", "/v1/completions", body, "", 60);
    if (p.status != 200) {
      ++bad;
      continue;
    }
    const json j = json::parse(p.body, nullptr, false);
    const int hits = j.contains("pic") ? j["pic"].value("hit_segments", -1) : -1,
              misses = j.contains("pic") ? j["pic"].value("miss_segments", -1) : -1;
    if (hits < 0 || misses < 0 || hits + misses != 5) ++wrong;
  }
  stop = true;
  deleter.join();
  r.check(bad == 0, std::to_string(bad) + " of 24 requests failed");
  r.check(wrong == 0, std::to_string(wrong) + " of 24 cache reports do not count 5 segments");
  normal(a, srv, r, "after it");
  finish(a, srv, r);
}

void cross_origin(const Args& a, Result& r) {
  r.what = "a browser's cross-origin text/plain POST and DELETE /v1/segments";
  Attack srv(a, {});
  const Reply post = request(srv.port(), "POST", "/v1/completions", kNormal, "Origin: http://evil.example\r\n", 10);
  const Reply del = request(srv.port(), "DELETE", "/v1/segments", "", "Origin: http://evil.example\r\n", 10);
  r.check(post.status == 403 && del.status == 403,
          "got " + std::to_string(post.status) + " / " + std::to_string(del.status) + ", not 403");
  finish(a, srv, r);
}

const std::vector<std::pair<std::string, std::function<void(const Args&, Result&)>>> kAttacks = {
    {"idle_flood", idle_flood},
    {"keepalive_flood", keepalive_flood},
    {"slowloris", slowloris},
    {"connection_cap", connection_cap},
    {"huge_chunked_body", huge_chunked_body},
    {"huge_head", huge_head},
    {"range_header", range_header},
    {"pipelined", pipelined},
    {"slow_readers", slow_readers},
    {"big_segment_post", big_segment_post},
    {"many_segment_prompt", many_segment_prompt},
    {"chat_without_max_tokens", chat_without_max_tokens},
    {"abandoned_queue", abandoned_queue},
    {"tiny_segments", tiny_segments},
    {"short_segments", short_segments},
    {"cross_origin", cross_origin},
    {"fifo_in_cache_dir", fifo_in_cache_dir},
    {"log_injection", log_injection},
    {"form_content_type", form_content_type},
    {"delete_during_pic", delete_during_pic},
};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage_exit("missing value for " + k);
      return argv[++i];
    };
    if (k == "--server")
      a.server = val();
    else if (k == "--model")
      a.model = val();
    else if (k == "--serve-arg")
      a.serve_args.push_back(val());
    else if (k == "--server-log")
      a.log = val();
    else if (k == "--sockets")
      a.sockets = std::stoi(val());
    else if (k == "--deadline-s")
      a.deadline_s = std::stod(val());
    else if (k == "--rss-limit-mib")
      a.rss_limit_mib = std::stod(val());
    else if (k == "--post-scale")
      a.post_scale = std::stod(val());
    else if (k == "--only") {
      std::stringstream ss(val());
      for (std::string n; std::getline(ss, n, ',');) a.only.push_back(n);
    } else
      usage_exit("unknown argument " + k);
  }
  if (a.server.empty() || a.model.empty()) usage_exit("--server and --model are required");
  for (const auto& n : a.only) {
    bool known = false;
    for (const auto& [name, f] : kAttacks) known = known || name == n;
    if (!known) usage_exit("unknown attack " + n);
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  const Args a = parse_args(argc, argv);
  // Floods need a descriptor per socket here too.
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  std::vector<Result> results;
  for (const auto& [name, f] : kAttacks) {
    if (!a.only.empty() && std::find(a.only.begin(), a.only.end(), name) == a.only.end()) continue;
    Result r;
    r.name = name;
    const auto t0 = Clock::now();
    f(a, r);
    json j{{"attack", r.name},
           {"what", r.what},
           {"ok", r.ok},
           {"normal_request_s", r.normal_s},
           {"peak_rss_mib", r.rss_mib},
           {"deadline_s", a.deadline_s},
           {"rss_limit_mib", a.rss_limit_mib},
           {"seconds", since(t0)},
           {"failures", r.failures}};
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
    results.push_back(r);
  }
  int failed = 0;
  std::printf("\n%-24s %-5s %12s %10s  %s\n", "attack", "ok", "normal (s)", "RSS (MiB)", "what");
  for (const auto& r : results) {
    failed += !r.ok;
    std::printf("%-24s %-5s %12.3f %10.0f  %s\n", r.name.c_str(), r.ok ? "yes" : "NO", r.normal_s, r.rss_mib,
                r.what.c_str());
    for (const auto& f : r.failures) std::printf("    %s\n", f.c_str());
  }
  std::printf("%d of %zu attacks failed (deadline %.1f s, RSS bound %.0f MiB)\n", failed, results.size(), a.deadline_s,
              a.rss_limit_mib);
  return failed ? 1 : 0;
}
