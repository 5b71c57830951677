// Test helper: runs the built `hypic serve` as a child process on an ephemeral loopback port.
// stdout is read for the "listening on http://127.0.0.1:PORT" line; stderr (the log) goes to a file.
#pragma once
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace hypic::testing {

class ServeProcess {
 public:
  // Starts `HYPIC_BIN serve --host 127.0.0.1 --port 0 --model MODEL ARGS...` and waits (up to
  // `timeout`) for its listening line. Throws std::runtime_error with the log on failure.
  ServeProcess(const std::string& model, const std::vector<std::string>& args, const std::string& log_path,
               std::chrono::seconds timeout = std::chrono::seconds(120))
      : log_path_(log_path) {
    int out[2];
    if (pipe(out) != 0) throw std::runtime_error("pipe() failed");
    std::vector<std::string> argv_s = {HYPIC_BIN, "serve", "--host", "127.0.0.1", "--port", "0", "--model", model};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork() failed");
    if (pid_ == 0) {
      // The server dies with the test: a test killed at its timeout leaves no server behind.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      dup2(out[1], 1);
      const int err = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (err >= 0) dup2(err, 2);
      close(out[0]);
      close(out[1]);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    out_ = out[0];
    std::string line;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (line.find('\n') == std::string::npos) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0) fail_start("no listening line within the timeout");
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000))) <= 0) continue;
      char buf[256];
      const ssize_t n = read(out_, buf, sizeof buf);
      if (n <= 0) fail_start("the server exited before listening");
      line.append(buf, static_cast<size_t>(n));
    }
    const auto colon = line.rfind(':');
    if (line.rfind("listening on http://", 0) != 0 || colon == std::string::npos)
      fail_start("unexpected first stdout line: " + line);
    port_ = std::stoi(line.substr(colon + 1));
  }
  ServeProcess(const ServeProcess&) = delete;
  ServeProcess& operator=(const ServeProcess&) = delete;
  ~ServeProcess() {
    if (pid_ > 0) stop(SIGKILL);
    if (out_ >= 0) close(out_);
  }

  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  std::string base_url() const { return "http://127.0.0.1:" + std::to_string(port_); }

  // Sends `sig` and waits (up to `timeout`, then SIGKILL) for the exit; returns the wait status.
  int stop(int sig = SIGTERM, std::chrono::seconds timeout = std::chrono::seconds(60)) {
    if (pid_ <= 0) return status_;
    kill(pid_, sig);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int st = 0;
    while (true) {
      const pid_t r = waitpid(pid_, &st, WNOHANG);
      if (r == pid_) break;
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &st, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid_ = -1;
    status_ = st;
    return st;
  }

  std::string log() const {
    std::ifstream f(log_path_);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

 private:
  [[noreturn]] void fail_start(const std::string& why) {
    stop(SIGKILL);
    throw std::runtime_error("hypic serve did not start (" + why + "); log:\n" + log());
  }

  std::string log_path_;
  pid_t pid_ = -1;
  int out_ = -1;
  int port_ = 0;
  int status_ = 0;
};

}  // namespace hypic::testing
