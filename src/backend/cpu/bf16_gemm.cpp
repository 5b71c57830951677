#include "backend/cpu/bf16_gemm.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <vector>

#ifdef HYPIC_HAVE_DNNL
#include <dnnl.hpp>
// libgomp's, declared here so that builds without OpenMP headers (clang's fuzz build) compile:
// oneDNN (Debian's build) runs on OpenMP, and the thread count is set per calling thread.
extern "C" void omp_set_num_threads(int);
#endif

namespace hypic::cpu::bf16_gemm {

#ifdef HYPIC_HAVE_DNNL
namespace {

struct State {
  std::string reason;  // empty: available
  std::unique_ptr<dnnl::engine> eng;
};

State& state() {
  static State s = [] {
    State st;
    // These machines advertise AMX, whose instructions trap: keep oneDNN below it unless the user
    // chose a level (DNNL_MAX_CPU_ISA). Must precede the first primitive.
    if (!std::getenv("DNNL_MAX_CPU_ISA")) dnnl::set_max_cpu_isa(dnnl::cpu_isa::avx512_core_bf16);
    if (!__builtin_cpu_supports("avx512bf16")) {
      st.reason = "this CPU has no AVX512_BF16 (vdpbf16ps)";
      return st;
    }
    st.eng = std::make_unique<dnnl::engine>(dnnl::engine::kind::cpu, 0);
    return st;
  }();
  return s;
}

using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool>;

// One product of exactly M rows; its primitive is built once per shape (oneDNN's own cache would
// still pay for the primitive descriptor on every call).
void run(State& st, int64_t M, int64_t N, int64_t K, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw,
         float* y, int64_t ldy, bool accumulate) {
  using dt = dnnl::memory::data_type;
  const dnnl::memory::desc xd({M, K}, dt::bf16, dnnl::memory::dims{ldx, 1});
  // W is stored [N, K] row-major: the K x N operand oneDNN wants, read with strides (1, ldw).
  const dnnl::memory::desc wd({K, N}, dt::bf16, dnnl::memory::dims{1, ldw});
  const dnnl::memory::desc yd({M, N}, dt::f32, dnnl::memory::dims{ldy, 1});
  static std::mutex mu;
  static std::map<Key, dnnl::matmul> cache;
  dnnl::matmul prim;
  {
    std::lock_guard<std::mutex> lk(mu);
    const Key key{M, N, K, ldx, ldw, ldy, accumulate};
    auto it = cache.find(key);
    if (it == cache.end()) {
      dnnl::primitive_attr attr;
      if (accumulate) {
        dnnl::post_ops po;
        po.append_sum(1.f);
        attr.set_post_ops(po);
      }
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(xd, wd, yd), attr, *st.eng);
      if (cache.size() > 512) cache.clear();  // many models or odd strides must not grow it forever
      it = cache.emplace(key, dnnl::matmul(pd)).first;
    }
    prim = it->second;
  }
  dnnl::stream s(*st.eng);
  dnnl::memory xm(xd, *st.eng, const_cast<uint16_t*>(x)), wm(wd, *st.eng, const_cast<uint16_t*>(w)), ym(yd, *st.eng, y);
  prim.execute(s, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym}});
  s.wait();
}

}  // namespace

const std::string& unavailable_reason() {
  return state().reason;
}

// Rows go in blocks of kBlock and a tail padded up to a multiple of kTail, so that a model needs
// a handful of primitives per weight shape whatever its prompt lengths (building one takes
// milliseconds; a request-dependent M would build one per request).
void matmul(int64_t M, int64_t N, int64_t K, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* y,
            int64_t ldy, bool accumulate, int threads) {
  State& st = state();
  if (!st.reason.empty()) throw std::runtime_error("bf16 products: " + st.reason);
  constexpr int64_t kBlock = 256, kTail = 32;
  omp_set_num_threads(threads);
  int64_t m0 = 0;
  for (; m0 + kBlock <= M; m0 += kBlock)
    run(st, kBlock, N, K, x + m0 * ldx, ldx, w, ldw, y + m0 * ldy, ldy, accumulate);
  const int64_t r = M - m0;
  if (r == 0) return;
  const int64_t rp = (r + kTail - 1) / kTail * kTail;
  if (rp == r) {
    run(st, r, N, K, x + m0 * ldx, ldx, w, ldw, y + m0 * ldy, ldy, accumulate);
    return;
  }
  // The padded tail: its rows copied beside zero rows, its products written to a scratch.
  thread_local std::vector<uint16_t> xt;
  thread_local std::vector<float> yt;
  xt.assign(static_cast<size_t>(rp * K), 0);
  for (int64_t i = 0; i < r; ++i) std::copy(x + (m0 + i) * ldx, x + (m0 + i) * ldx + K, xt.begin() + i * K);
  yt.resize(static_cast<size_t>(rp * N));
  run(st, rp, N, K, xt.data(), K, w, ldw, yt.data(), N, false);
  for (int64_t i = 0; i < r; ++i) {
    float* yr = y + (m0 + i) * ldy;
    const float* tr = yt.data() + i * N;
    if (accumulate)
      for (int64_t j = 0; j < N; ++j) yr[j] += tr[j];
    else
      std::copy(tr, tr + N, yr);
  }
}

#else

const std::string& unavailable_reason() {
  static const std::string r = "hypic was built without oneDNN (libdnnl-dev)";
  return r;
}

void matmul(int64_t, int64_t, int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, bool, int) {
  throw std::runtime_error("bf16 products: " + unavailable_reason());
}

#endif

}  // namespace hypic::cpu::bf16_gemm
