#include "backend/cpu/bf16_gemm.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <vector>

#ifdef HYPIC_HAVE_DNNL
#include <dlfcn.h>
#include <dnnl.h>
#include <dnnl_version.h>
#endif

// oneDNN is opened at run time (dlopen), not linked: every hypic binary starts where libdnnl is
// absent (a GPU host, a minimal container), and only `--activations bf16` on the CPU needs it.
// The C API of oneDNN 2.x (Debian 12's 2.6) is called through pointers typed by its own header.
#if defined(HYPIC_HAVE_DNNL) && DNNL_VERSION_MAJOR == 2
#define HYPIC_DNNL_API 1
#endif

namespace hypic::cpu::bf16_gemm {

#ifdef HYPIC_DNNL_API
namespace {

#define HYPIC_DNNL_FUNCTIONS(X)                                                                                       \
  X(set_max_cpu_isa)                                                                                                  \
  X(engine_create)                                                                                                    \
  X(stream_create) X(stream_wait) X(stream_destroy) X(memory_desc_init_by_strides) X(memory_create) X(memory_destroy) \
      X(matmul_desc_init) X(primitive_attr_create) X(primitive_attr_destroy) X(post_ops_create) X(post_ops_destroy)   \
          X(post_ops_append_sum) X(primitive_attr_set_post_ops) X(primitive_desc_create) X(primitive_desc_destroy)    \
              X(primitive_create) X(primitive_destroy) X(primitive_execute)

struct Api {
  std::string reason;  // empty: available
#define HYPIC_DNNL_PTR(f) decltype(&dnnl_##f) f = nullptr;
  HYPIC_DNNL_FUNCTIONS(HYPIC_DNNL_PTR)
#undef HYPIC_DNNL_PTR
  void (*omp_set_num_threads)(int) = nullptr;  // libgomp's: Debian's oneDNN runs on OpenMP
  dnnl_engine_t engine = nullptr;
};

Api& api() {
  static Api a = [] {
    Api x;
    if (!__builtin_cpu_supports("avx512bf16")) {
      x.reason = "this CPU has no AVX512_BF16 (vdpbf16ps)";
      return x;
    }
    void* lib = dlopen("libdnnl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      x.reason = "oneDNN 2 (libdnnl.so.2, Debian's libdnnl2) could not be loaded: " + std::string(dlerror());
      return x;
    }
    bool ok = true;
#define HYPIC_DNNL_LOAD(f)                                             \
  x.f = reinterpret_cast<decltype(&dnnl_##f)>(dlsym(lib, "dnnl_" #f)); \
  ok = ok && x.f;
    HYPIC_DNNL_FUNCTIONS(HYPIC_DNNL_LOAD)
#undef HYPIC_DNNL_LOAD
    x.omp_set_num_threads = reinterpret_cast<void (*)(int)>(dlsym(lib, "omp_set_num_threads"));
    if (!ok || !x.omp_set_num_threads) {
      x.reason = "libdnnl.so.2 lacks a function of oneDNN 2's C API (or OpenMP's omp_set_num_threads)";
      return x;
    }
    // These machines advertise AMX, whose instructions trap: keep oneDNN below it unless the user
    // chose a level (DNNL_MAX_CPU_ISA). Must precede the first primitive.
    if (!std::getenv("DNNL_MAX_CPU_ISA")) x.set_max_cpu_isa(dnnl_cpu_isa_avx512_core_bf16);
    if (x.engine_create(&x.engine, dnnl_cpu, 0) != dnnl_success) x.reason = "oneDNN could not create a CPU engine";
    return x;
  }();
  return a;
}

void check(dnnl_status_t s, const char* what) {
  if (s != dnnl_success)
    throw std::runtime_error(std::string("bf16 products: oneDNN ") + what + " failed, status " +
                             std::to_string(static_cast<int>(s)));
}

using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool>;

// One product of exactly M rows; its primitive is built once per shape (oneDNN's own cache would
// still pay for the primitive descriptor on every call).
void run(Api& a, int64_t M, int64_t N, int64_t K, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw,
         float* y, int64_t ldy, bool accumulate) {
  dnnl_memory_desc_t xd, wd, yd;
  const dnnl_dims_t xdims{M, K}, xstr{ldx, 1}, wdims{K, N}, wstr{1, ldw}, ydims{M, N}, ystr{ldy, 1};
  check(a.memory_desc_init_by_strides(&xd, 2, xdims, dnnl_bf16, xstr), "memory_desc");
  // W is stored [N, K] row-major: the K x N operand oneDNN wants, read with strides (1, ldw).
  check(a.memory_desc_init_by_strides(&wd, 2, wdims, dnnl_bf16, wstr), "memory_desc");
  check(a.memory_desc_init_by_strides(&yd, 2, ydims, dnnl_f32, ystr), "memory_desc");
  static std::mutex mu;
  static std::map<Key, dnnl_primitive_t> cache;
  dnnl_primitive_t prim;
  {
    std::lock_guard<std::mutex> lk(mu);
    const Key key{M, N, K, ldx, ldw, ldy, accumulate};
    auto it = cache.find(key);
    if (it == cache.end()) {
      dnnl_matmul_desc_t desc;
      check(a.matmul_desc_init(&desc, &xd, &wd, nullptr, &yd), "matmul_desc_init");
      dnnl_primitive_attr_t attr = nullptr;
      check(a.primitive_attr_create(&attr), "primitive_attr_create");
      if (accumulate) {
        dnnl_post_ops_t po = nullptr;
        check(a.post_ops_create(&po), "post_ops_create");
        check(a.post_ops_append_sum(po, 1.f), "post_ops_append_sum");
        check(a.primitive_attr_set_post_ops(attr, po), "primitive_attr_set_post_ops");
        a.post_ops_destroy(po);
      }
      dnnl_primitive_desc_t pd = nullptr;
      const dnnl_status_t s = a.primitive_desc_create(&pd, &desc, attr, a.engine, nullptr);
      a.primitive_attr_destroy(attr);
      check(s, "matmul primitive_desc_create");
      dnnl_primitive_t p = nullptr;
      const dnnl_status_t s2 = a.primitive_create(&p, pd);
      a.primitive_desc_destroy(pd);
      check(s2, "primitive_create");
      if (cache.size() > 512) {  // many models or odd strides must not grow it forever
        for (auto& [k, v] : cache) a.primitive_destroy(v);
        cache.clear();
      }
      it = cache.emplace(key, p).first;
    }
    prim = it->second;
  }
  dnnl_stream_t s = nullptr;
  check(a.stream_create(&s, a.engine, dnnl_stream_default_flags), "stream_create");
  dnnl_memory_t xm = nullptr, wm = nullptr, ym = nullptr;
  dnnl_status_t st = a.memory_create(&xm, &xd, a.engine, const_cast<uint16_t*>(x));
  if (st == dnnl_success) st = a.memory_create(&wm, &wd, a.engine, const_cast<uint16_t*>(w));
  if (st == dnnl_success) st = a.memory_create(&ym, &yd, a.engine, y);
  if (st == dnnl_success) {
    const dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym}};
    st = a.primitive_execute(prim, s, 3, args);
    if (st == dnnl_success) st = a.stream_wait(s);
  }
  for (dnnl_memory_t m : {xm, wm, ym})
    if (m) a.memory_destroy(m);
  a.stream_destroy(s);
  check(st, "matmul execution");
}

}  // namespace

const std::string& unavailable_reason() {
  return api().reason;
}

// Rows go in blocks of kBlock and a tail padded up to a multiple of kTail, so that a model needs
// a handful of primitives per weight shape whatever its prompt lengths (building one takes
// milliseconds; a request-dependent M would build one per request).
void matmul(int64_t M, int64_t N, int64_t K, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* y,
            int64_t ldy, bool accumulate, int threads) {
  Api& a = api();
  if (!a.reason.empty()) throw std::runtime_error("bf16 products: " + a.reason);
  constexpr int64_t kBlock = 256, kTail = 32;
  a.omp_set_num_threads(threads);
  int64_t m0 = 0;
  for (; m0 + kBlock <= M; m0 += kBlock) run(a, kBlock, N, K, x + m0 * ldx, ldx, w, ldw, y + m0 * ldy, ldy, accumulate);
  const int64_t r = M - m0;
  if (r == 0) return;
  const int64_t rp = (r + kTail - 1) / kTail * kTail;
  if (rp == r) {
    run(a, r, N, K, x + m0 * ldx, ldx, w, ldw, y + m0 * ldy, ldy, accumulate);
    return;
  }
  // The padded tail: its rows copied beside zero rows, its products written to a scratch.
  thread_local std::vector<uint16_t> xt;
  thread_local std::vector<float> yt;
  xt.assign(static_cast<size_t>(rp * K), 0);
  for (int64_t i = 0; i < r; ++i) std::copy(x + (m0 + i) * ldx, x + (m0 + i) * ldx + K, xt.begin() + i * K);
  yt.resize(static_cast<size_t>(rp * N));
  run(a, rp, N, K, xt.data(), K, w, ldw, yt.data(), N, false);
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
#ifdef HYPIC_HAVE_DNNL
  static const std::string r = "hypic was built against a oneDNN other than 2.x (its C API changed in 3.0)";
#else
  static const std::string r = "hypic was built without oneDNN's headers (libdnnl-dev)";
#endif
  return r;
}

void matmul(int64_t, int64_t, int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, bool, int) {
  throw std::runtime_error("bf16 products: " + unavailable_reason());
}

#endif

}  // namespace hypic::cpu::bf16_gemm
