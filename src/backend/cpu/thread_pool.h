// A small persistent thread pool for the CPU backend's kernels.
//
// parallel_for(n, fn) splits [0, n) into at most size() contiguous chunks (static chunking) and
// calls fn(begin, end) once per non-empty chunk; the calling thread runs chunk 0 itself. The
// callable is passed by reference through a plain function pointer, so a call allocates nothing.
// Workers spin briefly for the next job (ops come in quick succession during decode) and then
// sleep on a condition variable. Calls from inside a job, or from a second thread while the pool
// is busy, run serially on the caller rather than deadlocking.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace hypic::cpu {

class ThreadPool {
 public:
  // threads: total number of threads working on a job, the caller included (<= 0: all cores).
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return size_; }

  // fn(int64_t begin, int64_t end). Ranges smaller than `grain` items per chunk use fewer chunks
  // (n < 2 * grain runs inline). Exceptions thrown by fn are rethrown on the caller (the first).
  template <typename F>
  void parallel_for(int64_t n, F&& fn, int64_t grain = 1) {
    if (n <= 0) return;
    using Fn = std::remove_reference_t<F>;
    run(
        n, grain, [](void* ctx, int64_t b, int64_t e) { (*static_cast<Fn*>(ctx))(b, e); },
        const_cast<void*>(static_cast<const void*>(&fn)));
  }

 private:
  using Tramp = void (*)(void*, int64_t, int64_t);
  void run(int64_t n, int64_t grain, Tramp tramp, void* ctx);
  void worker(int index);
  void run_chunk(int index);

  int size_;
  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one job at a time

  // Current job (written by the caller before publishing a new generation).
  Tramp tramp_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0;
  int chunks_ = 0;

  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
  std::atomic<int> sleepers_{0};

  std::mutex err_mu_;
  std::exception_ptr error_;
};

}  // namespace hypic::cpu
