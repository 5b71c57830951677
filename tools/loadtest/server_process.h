// What the load tools share: starting `hypic serve` on a free loopback port as a child process,
// reading a process's memory from /proc, percentiles, reading a server-sent-event stream.
#pragma once
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

[[noreturn]] inline void server_exit(const char* msg) {
  std::fprintf(stderr, "%s\n", msg);
  std::exit(2);
}

// Starts `server serve --port 0 ...`, returns its pid and port (read from its stdout). The log
// (stderr) goes to `log_path` when one is given.
inline pid_t start_server(const std::string& server, const std::string& model, const std::vector<std::string>& extra,
                          int clients, int& port, const std::string& log_path = "") {
  int fds[2];
  if (pipe(fds) != 0) server_exit("pipe failed");
  const pid_t pid = fork();
  if (pid < 0) server_exit("fork failed");
  if (pid == 0) {
    // The server dies with this process: a driver killed at its test timeout leaves no server
    // behind holding the test's pipes (ctest would wait for it forever).
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    dup2(fds[1], STDOUT_FILENO);
    if (log_path.empty()) {
      const int nul = open("/dev/null", O_WRONLY);
      if (nul >= 0) dup2(nul, STDERR_FILENO);
    }
    if (!log_path.empty()) {
      const int lf = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (lf >= 0) dup2(lf, STDERR_FILENO);
    }
    close(fds[0]);
    close(fds[1]);
    std::vector<std::string> args = {server,          "serve",
                                     "--model",       model,
                                     "--port",        "0",
                                     "--max-running", std::to_string(clients),
                                     "--max-queue",   std::to_string(4 * clients)};
    for (auto& s : extra) args.push_back(s);
    std::vector<char*> argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    std::perror("execv");
    _exit(127);
  }
  close(fds[1]);
  std::string line;
  char c;
  while (read(fds[0], &c, 1) == 1) {
    if (c == '\n') {
      const std::string tag = "listening on http://";
      const size_t p = line.find(tag);
      if (p != std::string::npos) {
        const size_t colon = line.rfind(':');
        port = std::atoi(line.c_str() + colon + 1);
        break;
      }
      line.clear();
    } else {
      line += c;
    }
  }
  // Keep draining stdout so the server never blocks on a full pipe.
  std::thread([fd = fds[0]] {
    char buf[4096];
    while (read(fd, buf, sizeof buf) > 0) {
    }
    close(fd);
  }).detach();
  if (port <= 0) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    server_exit("the server did not report a port");
  }
  return pid;
}

inline double status_kib(pid_t pid, const char* field) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(field, 0) == 0) return std::atof(line.c_str() + std::strlen(field));
  return -1;
}

inline double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5));
  return v[i];
}

// The `data:` payloads of a server-sent-event stream as its bytes arrive: feed() calls
// on_event(payload) for every complete event ("[DONE]" included).
class SseReader {
 public:
  template <typename F>
  void feed(const char* d, size_t n, F&& on_event) {
    buf_.append(d, n);
    size_t e;
    while ((e = buf_.find("\n\n")) != std::string::npos) {
      std::string ev = buf_.substr(0, e);
      buf_.erase(0, e + 2);
      if (ev.rfind("data: ", 0) == 0) on_event(ev.substr(6));
    }
  }

 private:
  std::string buf_;
};
