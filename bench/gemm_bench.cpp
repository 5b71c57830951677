// GEMM throughput of this machine: raw OpenBLAS sgemm (its own threads) and the CPU backend's
// matmul for f32 / bf16 / f16 weights, at prefill (M = 512) and decode (M = 1) sizes, one-thread
// decode products in bf16 and Q8_0 (the "gflops" column there is weight GB/s), the products with
// bf16 activations (oneDNN) where available, plus the tiled
// causal attention. Prints JSON, then a short table.
//   gemm_bench [threads]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/bf16_gemm.h"
#include "backend/cpu/blas_core.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/quant_dot.h"
#include "tensor/quant.h"

using namespace hypic;
using Clock = std::chrono::steady_clock;

namespace {

Tensor randn(Shape s, uint32_t seed) {
  Tensor t = Tensor::empty(DType::F32, std::move(s));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = nd(rng);
  return t;
}

Tensor as(const Tensor& f, DType dt) {
  Tensor t = Tensor::empty(dt, f.shape());
  convert_from_f32(f.data<float>(), dt, t.raw(), static_cast<size_t>(f.numel()));
  return t;
}

// Best (minimum) seconds per call over repeated runs (at least 5 runs and ~0.6 s), after a warm-up.
template <typename F>
double time_it(F f) {
  f();
  std::vector<double> ts;
  auto start = Clock::now();
  while (ts.size() < 5 || (std::chrono::duration<double>(Clock::now() - start).count() < 0.6 && ts.size() < 1000)) {
    auto t0 = Clock::now();
    f();
    ts.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  return ts[0];  // best run: the machine may be shared, the minimum is the least disturbed figure
}

struct Row {
  std::string name, dtype;
  int64_t M, K, N;
  double ms, gflops;
};

}  // namespace

int main(int argc, char** argv) {
  cpu::reexec_for_openblas_core(argv);  // the kernels hypic itself runs (blas_core.h)
  int threads = argc > 1 ? std::atoi(argv[1]) : 0;
  cpu::CpuBackend be(threads);
  threads = be.num_threads();
  std::vector<Row> rows;
  const int64_t K = 2048, N = 2048;

  // Raw OpenBLAS, its own threads (the machine's reference GEMM figure).
  for (int64_t M : {512, 1}) {
    Tensor x = randn({M, K}, 1), w = randn({N, K}, 2), y = Tensor::empty(DType::F32, {M, N});
    openblas_set_num_threads(threads);
    double s = time_it([&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(N), int(K), 1.f, x.data<float>(), int(K),
                  w.data<float>(), int(K), 0.f, y.data<float>(), int(N));
    });
    openblas_set_num_threads(1);
    rows.push_back({"openblas_sgemm", "f32", M, K, N, s * 1e3, 2.0 * M * N * K / s / 1e9});
  }
  // Backend matmul.
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (int64_t M : {512, 64, 8, 4, 1}) {
      if (dt == DType::F16 && M != 512 && M != 1) continue;
      Tensor x = randn({M, K}, 1), w = as(randn({N, K}, 2), dt), y = Tensor::empty(DType::F32, {M, N});
      double s = time_it([&] { be.matmul(x, w, y); });
      rows.push_back({"backend_matmul", dtype_name(dt), M, K, N, s * 1e3, 2.0 * M * N * K / s / 1e9});
    }
  // Quantized weights (backend matmul): the GEMV path below CpuBackend::kQuantGemvRows rows and
  // the dequantized-panel sgemm above it; these rows place the cut-over.
  for (DType dt : {DType::Q8_0, DType::Q4_K, DType::Q6_K})
    for (int64_t M : {512, 64, 32, 16, 8, 1}) {
      Tensor x = randn({M, K}, 1), wf = randn({N, K}, 2), w = Tensor::empty(dt, {N, K}),
             y = Tensor::empty(DType::F32, {M, N});
      quant::quantize(dt, wf.data<float>(), N * K, w.raw());
      double s = time_it([&] { be.matmul(x, w, y); });
      rows.push_back({"backend_matmul", dtype_name(dt), M, K, N, s * 1e3, 2.0 * M * N * K / s / 1e9});
    }
  // Row-independent products (PIC's seams): the few-row kernel at every M.
  be.set_row_independent(true);
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t M : {128, 64, 16, 8, 1}) {
      Tensor x = randn({M, K}, 1), w = as(randn({N, K}, 2), dt), y = Tensor::empty(DType::F32, {M, N});
      double s = time_it([&] { be.matmul(x, w, y); });
      rows.push_back({"backend_matmul_row_indep", dtype_name(dt), M, K, N, s * 1e3, 2.0 * M * N * K / s / 1e9});
    }
  // ... and at the default model's seam products (80 rows, hidden 256, MLP 512: the GEMV's weak spot
  // until the FMA-chain kernels; docs/perf-notes.md).
  for (auto [k, n] : {std::pair<int64_t, int64_t>{256, 1024}, {512, 256}}) {
    const int64_t M = 80;
    Tensor x = randn({M, k}, 1), w = as(randn({n, k}, 2), DType::BF16), y = Tensor::empty(DType::F32, {M, n});
    double s = time_it([&] { be.matmul(x, w, y); });
    rows.push_back({"backend_matmul_row_indep", "bf16", M, k, n, s * 1e3, 2.0 * M * n * k / s / 1e9});
  }
  be.set_row_independent(false);
  // A question's rows under PIC (40 rows, hidden 256): the chain kernel from 16 rows, f32 activations.
  {
    const int64_t M = 40, k = 256, n = 1024;
    Tensor x = randn({M, k}, 1), w = as(randn({n, k}, 2), DType::BF16), y = Tensor::empty(DType::F32, {M, n});
    double s = time_it([&] { be.matmul(x, w, y); });
    rows.push_back({"backend_matmul", "bf16", M, k, n, s * 1e3, 2.0 * M * n * k / s / 1e9});
  }
  // bf16 activations (`--activations bf16`: oneDNN from CpuBackend::kBf16Rows rows), where this
  // build and CPU have them; with the f32 rows above they place that cut-over.
  if (cpu::bf16_gemm::unavailable_reason().empty()) {
    be.set_precise(false);
    for (DType dt : {DType::BF16, DType::Q8_0, DType::Q4_K})
      for (int64_t M : {512, 256, 64, 32, 16}) {
        Tensor x = randn({M, K}, 1), wf = randn({N, K}, 2), y = Tensor::empty(DType::F32, {M, N});
        Tensor w = dt == DType::BF16 ? as(wf, dt) : Tensor::empty(dt, {N, K});
        if (dt != DType::BF16) quant::quantize(dt, wf.data<float>(), N * K, w.raw());
        double s = time_it([&] { be.matmul(x, w, y); });
        rows.push_back({"backend_matmul_bf16_act", dtype_name(dt), M, K, N, s * 1e3, 2.0 * M * N * K / s / 1e9});
      }
    be.set_precise(true);
  }
  // Decode products on one thread, by weight type: weight bytes per second is what bounds decode.
  // The last shape (a 128k-row head) is larger than the caches: one core's bandwidth from memory.
  {
    cpu::CpuBackend one(1);
    for (auto [k, n] : {std::pair<int64_t, int64_t>{1024, 3584}, {3584, 1024}, {2048, 2048}, {1024, 131072}}) {
      Tensor x = randn({1, k}, 1), wf = randn({n, k}, 2), y = Tensor::empty(DType::F32, {1, n});
      for (DType dt : {DType::BF16, DType::Q8_0, DType::Q4_K, DType::Q6_K}) {
        Tensor w = dt == DType::BF16 ? as(wf, dt) : Tensor::empty(dt, {n, k});
        if (dt != DType::BF16) quant::quantize(dt, wf.data<float>(), n * k, w.raw());
        const double sb = time_it([&] { one.matmul(x, w, y); });
        const std::string kernel = dt == DType::BF16 ? "" : std::string("_") + quant::dot_kernel();
        rows.push_back({"gemv_1thread_weight_GB/s" + kernel, dtype_name(dt), 1, k, n, sb * 1e3,
                        static_cast<double>(w.nbytes()) / sb / 1e9});
      }
    }
  }
  // Causal prefill attention (Qwen3.5-like full-attention layer: 16 q heads, 2 kv heads, d 256).
  for (int64_t T : {512, 2048}) {
    const int64_t Hq = 16, Hkv = 2, D = 256;
    Tensor q = randn({T, Hq, D}, 3), k = randn({T, Hkv, D}, 4), v = randn({T, Hkv, D}, 5),
           o = Tensor::empty(DType::F32, {T, Hq, D});
    double s = time_it([&] { be.attention(q, k, v, T, 0, 0.0625f, o); });
    double flops = 2.0 * 2.0 * Hq * D * (double(T) * (T + 1) / 2);  // QK^T and PV over the causal half
    rows.push_back({"backend_attention_causal", "f32", T, D, Hq, s * 1e3, flops / s / 1e9});
  }
  {  // decode attention over a 4096-token cache
    const int64_t S = 4096, Hq = 16, Hkv = 2, D = 256;
    Tensor q = randn({1, Hq, D}, 3), k = randn({S, Hkv, D}, 4), v = randn({S, Hkv, D}, 5),
           o = Tensor::empty(DType::F32, {1, Hq, D});
    double s = time_it([&] { be.attention(q, k, v, S, S - 1, 0.0625f, o); });
    rows.push_back({"backend_attention_decode", "f32", 1, D, Hq, s * 1e3, 2.0 * 2.0 * Hq * D * S / s / 1e9});
  }

  std::printf("{\"threads\": %d, \"openblas_core\": \"%s\", \"results\": [\n", threads, cpu::openblas_core());
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::printf(
        "  {\"name\": \"%s\", \"dtype\": \"%s\", \"M\": %lld, \"K\": %lld, \"N\": %lld, \"ms\": %.4f, "
        "\"gflops\": %.2f}%s\n",
        r.name.c_str(), r.dtype.c_str(), (long long)r.M, (long long)r.K, (long long)r.N, r.ms, r.gflops,
        i + 1 < rows.size() ? "," : "");
  }
  std::printf("]}\n\n");
  std::printf("%-26s %-5s %6s %6s %6s %10s %9s\n", "op", "dtype", "M/T", "K/D", "N/Hq", "ms", "GFLOP/s");
  for (const Row& r : rows)
    std::printf("%-26s %-5s %6lld %6lld %6lld %10.3f %9.2f\n", r.name.c_str(), r.dtype.c_str(), (long long)r.M,
                (long long)r.K, (long long)r.N, r.ms, r.gflops);
  return 0;
}
