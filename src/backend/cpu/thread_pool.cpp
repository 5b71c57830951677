#include "backend/cpu/thread_pool.h"

#include <chrono>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HYPIC_CPU_RELAX() _mm_pause()
#else
#define HYPIC_CPU_RELAX() std::this_thread::yield()
#endif

namespace hypic::cpu {

namespace {
thread_local bool t_in_job = false;
constexpr auto kSpinFor = std::chrono::microseconds(300);
}  // namespace

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  size_ = threads < 1 ? 1 : threads;
  workers_.reserve(static_cast<size_t>(size_ - 1));
  for (int i = 1; i < size_; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  { std::lock_guard<std::mutex> lk(sleep_mu_); }
  sleep_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_chunk(int index) {
  if (index >= chunks_) return;
  int64_t b = n_ * index / chunks_, e = n_ * (index + 1) / chunks_;
  if (b >= e) return;
  try {
    tramp_(ctx_, b, e);
  } catch (...) {
    std::lock_guard<std::mutex> lk(err_mu_);
    if (!error_) error_ = std::current_exception();
  }
}

void ThreadPool::run(int64_t n, int64_t grain, Tramp tramp, void* ctx) {
  if (grain < 1) grain = 1;
  int64_t want = n / grain;
  int chunks = static_cast<int>(want < size_ ? (want < 1 ? 1 : want) : size_);
  if (chunks == 1 || t_in_job) {
    tramp(ctx, 0, n);
    return;
  }
  std::unique_lock<std::mutex> call(call_mu_, std::try_to_lock);
  if (!call.owns_lock()) {  // another thread is using the pool: do the work here
    tramp(ctx, 0, n);
    return;
  }
  tramp_ = tramp;
  ctx_ = ctx;
  n_ = n;
  chunks_ = chunks;
  error_ = nullptr;
  // Every worker acknowledges every job (even without a chunk), so none can lag into the next.
  pending_.store(size_ - 1);
  generation_.fetch_add(1);
  if (sleepers_.load() > 0) {
    { std::lock_guard<std::mutex> lk(sleep_mu_); }
    sleep_cv_.notify_all();
  }
  t_in_job = true;
  run_chunk(0);
  t_in_job = false;
  for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < 4096)
      HYPIC_CPU_RELAX();
    else
      std::this_thread::yield();
  }
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void ThreadPool::worker(int index) {
  t_in_job = true;  // nested parallel_for inside a job runs inline
  uint64_t seen = 0;
  for (;;) {
    auto start = std::chrono::steady_clock::now();
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_relaxed)) {
      HYPIC_CPU_RELAX();
      if (++spins % 64 == 0 && std::chrono::steady_clock::now() - start > kSpinFor) {
        std::unique_lock<std::mutex> lk(sleep_mu_);
        sleepers_.fetch_add(1);
        sleep_cv_.wait(lk, [&] { return generation_.load() != seen || stop_.load(); });
        sleepers_.fetch_sub(1);
        break;
      }
    }
    if (stop_.load()) return;
    seen = generation_.load(std::memory_order_acquire);
    run_chunk(index);
    pending_.fetch_sub(1, std::memory_order_release);
  }
}

}  // namespace hypic::cpu
