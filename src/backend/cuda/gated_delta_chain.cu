// A linear layer's share of a PIC composition in one launch: for each link (a reused segment),
// the recurrence over its seam rows, then its cached body composed in: a compact body replayed
// (its recurrence inputs from the state reached), a dense one as S <- T S + B. The links are
// sequential, but the columns of S are independent through all of it (the delta rule and T S
// both mix rows only), so a block owns 32 columns of one head's state for the whole chain and
// keeps them in registers: no launch, allocation or round trip per segment. The plain reference
// is the same sequence of span ops (Backend::gated_delta_chain).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/gated_delta_token.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace hypic::cuda {

namespace {

constexpr int kPanel = 16;  // columns of T per shared-memory panel

// HYPIC_GDN_CHAIN_PROF=1: block 0's thread 0 adds the SM clocks of each part of every link here
// (a measurement aid for docs/perf-notes.md; off, the kernel only tests a flag per part).
enum ChainPart { kSeam, kReplay, kStage, kWaitT, kProduct, kDone, kLinks, kParts };
__device__ unsigned long long g_chain_clocks[kParts];

// Four consecutive elements of a bf16 row, 8-byte aligned, as floats (exact).
__device__ __forceinline__ float4 bf16x4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

// Element (r, c) of head h's T, stored f32 or bf16.
__device__ __forceinline__ float t_at(const GdnChainLink& L, int64_t h, int dk, int r, int c) {
  const int64_t i = (h * dk + r) * dk + c;
  return L.t_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(L.T)[i]) : static_cast<const float*>(L.T)[i];
}

// Shared memory of the chain (floats): the token loop's, or the composition's column and panel.
constexpr int chain_smem_floats(int dk) {
  return gdn_tokens_smem_floats(dk) > (kGdnCols + kPanel) * (dk + 1) ? gdn_tokens_smem_floats(dk)
                                                                     : (kGdnCols + kPanel) * (dk + 1);
}

template <int P, int R>
__global__ void __launch_bounds__(kGdnCols* P, 1)
    k_gdn_chain(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                const float* __restrict__ g, const float* __restrict__ beta, bool l2norm, int64_t Hk, int64_t Hv,
                int dk, int dv, float* state, float* out, const GdnChainLink* __restrict__ links, int n_links,
                bool full_t, bool prof) {
  pdl_entry();
  prof = prof && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0;
  long long t_mark = prof ? clock64() : 0;
  auto mark = [&](int part) {
    if (prof) {
      const long long now = clock64();
      g_chain_clocks[part] += static_cast<unsigned long long>(now - t_mark);
      t_mark = now;
    }
  };
  extern __shared__ float smem[];
  // full_t: each dense body's T (this head's dk x dk) comes whole into shared memory with cp.async
  // (issue_t below).
  const int ldt = dk + 4;  // rows stay 16-byte aligned
  const int ldb = dk + 8;  // the same for a bf16 T (needs dk % 8 == 0: checked by the host)
  float* tT = full_t ? smem + chain_smem_floats(dk) : nullptr;
  __nv_bfloat16* tB = reinterpret_cast<__nv_bfloat16*>(tT);  // the same space holding a bf16 T
  const int h = blockIdx.y;
  const int64_t hk = h / (Hv / Hk);
  const int p = threadIdx.x % P, cl = threadIdx.x / P;
  const int c = blockIdx.x * kGdnCols + cl;
  const bool valid = c < dv;
  float* sh = state + static_cast<int64_t>(h) * dk * dv;
  float s[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = i * P + p;
    s[i] = (valid && r < dk) ? sh[static_cast<int64_t>(r) * dv + c] : 0.f;
  }
  int64_t row = 0;
  // The next link's description is read a link ahead: read when needed, its global load's
  // latency (~1 us) sat on every link's critical path.
  GdnChainLink next = n_links > 0 ? links[0] : GdnChainLink{};
  for (int li = 0; li < n_links; ++li) {
    const GdnChainLink L = next;
    if (li + 1 < n_links) next = links[li + 1];
    // The dense body's T is issued after the seam's first tile, so that the seam waits only for
    // its own rows while the copy runs under its recurrence. The previous link's last reads of tT
    // came before a barrier every thread has passed.
    auto issue_t = [&]() -> bool {
      if (!(tT && L.T && L.B)) return false;
      if (L.t_bf16) {
        const __nv_bfloat16* Th = static_cast<const __nv_bfloat16*>(L.T) + static_cast<int64_t>(h) * dk * dk;
        for (int e = threadIdx.x; e < dk * dk / 8; e += kGdnCols * P) {
          const int r = 8 * e / dk, j = 8 * e % dk;
          cp_async16(tB + r * ldb + j, Th + static_cast<int64_t>(r) * dk + j);
        }
      } else {
        const float* Th = static_cast<const float*>(L.T) + static_cast<int64_t>(h) * dk * dk;
        for (int e = threadIdx.x; e < dk * dk / 4; e += kGdnCols * P) {
          const int r = 4 * e / dk, j = 4 * e % dk;
          cp_async16(tT + r * ldt + j, Th + static_cast<int64_t>(r) * dk + j);
        }
      }
      cp_async_commit();
      return true;
    };
    if (prof) ++g_chain_clocks[kLinks];
    if (L.rows > 0) {
      const int64_t o = row;
      gdn_tokens<P, R>(q + o * Hk * dk, k + o * Hk * dk, v + o * Hv * dv, g + o * Hv, beta + o * Hv, l2norm, L.rows, Hk,
                       Hv, dk, dv, h, hk, blockIdx.x * kGdnCols, valid, false, c, s, out + o * Hv * dv, smem, issue_t);
      row += L.rows;
    } else {
      issue_t();
    }
    mark(kSeam);
    // A compact body: its own recurrence inputs (keys stand in for the queries; no outputs).
    if (L.replay_rows > 0)
      gdn_tokens<P, R>(L.rk, L.rk, L.rv, L.rg, L.rbeta, l2norm, L.replay_rows, Hk, Hv, dk, dv, h, hk,
                       blockIdx.x * kGdnCols, valid, false, c, s, nullptr, smem);
    mark(kReplay);
    if (!L.B) continue;
    const float* Bh = L.B + static_cast<int64_t>(h) * dk * dv;
    if (L.T && tT) {
      // S <- T S + B with T in shared memory. The product is bound by shared-memory loads, so it
      // takes a layout of its own: a thread computes rows rg + RG i (i < R / 4) of 4 adjacent
      // columns, reading per 4 steps of j one 16-byte T row piece per row and one 16-byte S row
      // piece per j (conflict-free: a warp's 4 row groups hit distinct banks, its 8 column groups
      // too), i.e. 4 multiply-adds per 4 bytes loaded instead of one. S goes through shared memory
      // ([j][column], row-major) on the way in and out. Sums run over j in the same order as the
      // panel form below, so both give the same numbers.
      constexpr int ldss = kGdnCols + 4;
      constexpr int TR = R / 4 > 0 ? R / 4 : 1;  // rows per thread: 8 column groups x RG >= dk / TR
      float* ss = smem;                          // [dk][ldss]
      float b[R];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int r = i * P + p;
        b[i] = valid && r < dk ? Bh[static_cast<int64_t>(r) * dv + c] : 0.f;
      }
      __syncthreads();  // the token loop may still read shared memory
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int r = i * P + p;
        if (r < dk) ss[r * ldss + cl] = s[i];
      }
      mark(kStage);
      cp_async_wait_all();
      __syncthreads();
      mark(kWaitT);
      const int RG = kGdnCols * P / 8, lane = threadIdx.x % 32;
      const int rg = threadIdx.x / 32 * 4 + lane / 8, c0 = 4 * (lane % 8);
      float acc[TR][4];
#pragma unroll
      for (int i = 0; i < TR; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
      for (int j = 0; j < dk; j += 4) {
        float4 sj[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) sj[u] = *reinterpret_cast<const float4*>(ss + (j + u) * ldss + c0);
#pragma unroll
        for (int i = 0; i < TR; ++i) {
          const int r = rg + RG * i;
          if (r < dk) {
            const float4 t = L.t_bf16 ? bf16x4(tB + r * ldb + j) : *reinterpret_cast<const float4*>(tT + r * ldt + j);
            const float tv[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
            for (int u = 0; u < 4; ++u) {
              acc[i][0] += tv[u] * sj[u].x;
              acc[i][1] += tv[u] * sj[u].y;
              acc[i][2] += tv[u] * sj[u].z;
              acc[i][3] += tv[u] * sj[u].w;
            }
          }
        }
      }
      __syncthreads();  // every row of S read (and tT free for the next link's copy)
      mark(kProduct);
#pragma unroll
      for (int i = 0; i < TR; ++i) {
        const int r = rg + RG * i;
        if (r < dk)
          *reinterpret_cast<float4*>(ss + r * ldss + c0) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int r = i * P + p;
        s[i] = r < dk ? ss[r * ldss + cl] + b[i] : 0.f;
      }
    } else if (L.T) {
      // S <- T S + B. The block's columns of S go to shared memory (sc, [column][row], padded),
      // then T comes through shared memory a panel of kPanel columns at a time, transposed
      // (tp[j][row], padded); each thread accumulates its rows of its column in place, every row
      // an independent sum (no dependent chains), one shared load per multiply-add.
      const int ldc = dk + 1;
      float* sc = smem;                 // [kGdnCols][dk + 1]
      float* tp = sc + kGdnCols * ldc;  // [kPanel][dk + 1]
      __syncthreads();                  // the token loop may still read shared memory
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int r = i * P + p;
        if (r < dk) sc[cl * ldc + r] = s[i];
        s[i] = 0.f;
      }
      for (int j0 = 0; j0 < dk; j0 += kPanel) {
        __syncthreads();  // sc written; the previous panel consumed
        for (int e = threadIdx.x; e < kPanel * dk; e += kGdnCols * P) {
          const int r = e / kPanel, jj = e % kPanel;
          tp[jj * ldc + r] = j0 + jj < dk ? t_at(L, h, dk, r, j0 + jj) : 0.f;
        }
        __syncthreads();
        const int nj = dk - j0 < kPanel ? dk - j0 : kPanel;
        for (int jj = 0; jj < nj; ++jj) {
          const float cj = sc[cl * ldc + j0 + jj];
          const float* trow = tp + jj * ldc;
#pragma unroll
          for (int i = 0; i < R; ++i) {
            const int r = i * P + p;
            if (r < dk) s[i] += trow[r] * cj;
          }
        }
      }
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int r = i * P + p;
        if (valid && r < dk) s[i] += Bh[static_cast<int64_t>(r) * dv + c];
      }
    } else {
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int r = i * P + p;
        if (valid && r < dk) s[i] += Bh[static_cast<int64_t>(r) * dv + c];
      }
    }
    mark(kDone);
  }
  if (valid) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int r = i * P + p;
      if (r < dk) sh[static_cast<int64_t>(r) * dv + c] = s[i];
    }
  }
}

// Whole-T staging needs dk % 4 == 0 (16-byte rows), 16-byte aligned T, and shared memory for it
// (the device's opt-in limit, asked once: one GPU per process is the norm).
bool full_t_fits(int dk, size_t smem_floats) {
  static const int optin = [] {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
      return 0;
    return v;
  }();
  return dk % 4 == 0 && smem_floats * sizeof(float) <= static_cast<size_t>(optin);
}

template <int P, int R>
void run(cudaStream_t st, const float* q, const float* k, const float* v, const float* g, const float* beta,
         bool l2norm, int64_t Hk, int64_t Hv, int dk, int dv, float* state, float* out, const GdnChainLink* links,
         int n_links, bool aligned_t) {
  const size_t full = static_cast<size_t>(chain_smem_floats(dk)) + static_cast<size_t>(dk) * (dk + 4);
  const bool full_t = aligned_t && full_t_fits(dk, full);
  const size_t smem = (full_t ? full : static_cast<size_t>(chain_smem_floats(dk))) * sizeof(float);
  static size_t allowed = 48 * 1024;  // this instantiation's shared-memory limit as set so far
  if (smem > allowed) {
    CUDA_CHECK(
        cudaFuncSetAttribute(k_gdn_chain<P, R>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    allowed = smem;
  }
  dim3 grid(static_cast<unsigned>((dv + kGdnCols - 1) / kGdnCols), static_cast<unsigned>(Hv));
  static const bool prof = [] {
    const char* e = std::getenv("HYPIC_GDN_CHAIN_PROF");
    return e && std::string(e) == "1";
  }();
  launch(st, grid, kGdnCols * P, smem, k_gdn_chain<P, R>, q, k, v, g, beta, l2norm, Hk, Hv, dk, dv, state, out, links,
         n_links, full_t, prof);
  CUDA_LAUNCH_CHECK("k_gdn_chain");
  if (prof) {
    // Every 30 calls (a 35B-A3B composition's linear layers), the running totals per link.
    static int calls = 0;
    if (++calls % 30 == 0) {
      unsigned long long c[kParts];
      CUDA_CHECK(cudaMemcpyFromSymbolAsync(c, g_chain_clocks, sizeof(c), 0, cudaMemcpyDeviceToHost, st));
      CUDA_CHECK(cudaStreamSynchronize(st));
      int dev = 0, khz = 1;
      CUDA_CHECK(cudaGetDevice(&dev));
      CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev));
      const double links_n = c[kLinks] ? static_cast<double>(c[kLinks]) : 1.0, us = 1e3 / khz;
      std::fprintf(stderr,
                   "gdn chain (block 0, %llu links, us per link): seam %.2f replay %.2f stage %.2f wait_T %.2f "
                   "product %.2f done %.2f\n",
                   c[kLinks], c[kSeam] * us / links_n, c[kReplay] * us / links_n, c[kStage] * us / links_n,
                   c[kWaitT] * us / links_n, c[kProduct] * us / links_n, c[kDone] * us / links_n);
    }
  }
}

}  // namespace

namespace {
int chain_rows = 0;        // set_gdn_chain_rows(); 0: HYPIC_GDN_CHAIN_ROWS or 8
bool chain_full_t = true;  // set_gdn_chain_full_t(); HYPIC_GDN_CHAIN_FULL_T=0 turns it off

// P threads per column of S with R rows each (P * R >= dk).
template <int R>
void run_rows(cudaStream_t s, const float* q, const float* k, const float* v, const float* g, const float* beta,
              bool l2norm_qk, int64_t Hk, int64_t Hv, int dk, int dv, float* state, float* out,
              const GdnChainLink* links, int n_links, bool aligned_t) {
  if (dk <= R)
    run<1, R>(s, q, k, v, g, beta, l2norm_qk, Hk, Hv, dk, dv, state, out, links, n_links, aligned_t);
  else if (dk <= 2 * R)
    run<2, R>(s, q, k, v, g, beta, l2norm_qk, Hk, Hv, dk, dv, state, out, links, n_links, aligned_t);
  else if (dk <= 4 * R)
    run<4, R>(s, q, k, v, g, beta, l2norm_qk, Hk, Hv, dk, dv, state, out, links, n_links, aligned_t);
  else if (dk <= 8 * R || 8 * R >= 256)  // dk <= 256 (checked by the caller)
    run<8, R>(s, q, k, v, g, beta, l2norm_qk, Hk, Hv, dk, dv, state, out, links, n_links, aligned_t);
  else if constexpr (8 * R < 256) {  // not instantiated where 8 threads per column hold every dk
    if (dk <= 16 * R)
      run<16, R>(s, q, k, v, g, beta, l2norm_qk, Hk, Hv, dk, dv, state, out, links, n_links, aligned_t);
    else
      run<32, R>(s, q, k, v, g, beta, l2norm_qk, Hk, Hv, dk, dv, state, out, links, n_links, aligned_t);
  }
}
}  // namespace

void set_gdn_chain_rows(int rows) {
  chain_rows = rows;
}
void set_gdn_chain_full_t(bool on) {
  chain_full_t = on;
}

void launch_gated_delta_chain(cudaStream_t s, const float* q, const float* k, const float* v, const float* g,
                              const float* beta, bool l2norm_qk, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                              float* state, float* out, const GdnChainLink* links, int n_links, bool aligned_t) {
  if (Hv == 0 || dk == 0 || dv == 0 || n_links == 0) return;
  static const bool env_full_t = [] {
    const char* e = std::getenv("HYPIC_GDN_CHAIN_FULL_T");
    return !(e && std::string(e) == "0");
  }();
  aligned_t = aligned_t && env_full_t && chain_full_t;
  if (dk > 256)
    throw std::invalid_argument("gated_delta_chain: key head dim " + std::to_string(dk) +
                                " above 256 is not supported on cuda");
  static const int env = [] {
    const char* e = std::getenv("HYPIC_GDN_CHAIN_ROWS");
    return e && *e ? std::atoi(e) : 0;
  }();
  const int want = chain_rows ? chain_rows : env;
  const int idk = static_cast<int>(dk), idv = static_cast<int>(dv);
  // Rows of S per thread. The chain is latency-bound (each token's update waits on the last), so
  // more threads per column help until the block's reductions cost more: on the H200 (35B-A3B,
  // dk 128) 8 rows took 16 x 2k documents from 104.6 to 68.6 ms against 32 rows (docs/perf-notes.md,
  // PIC on the GPU v3). 4 rows only where a column's 32 threads hold all of dk (<= 128).
  if (want == 32)
    run_rows<kGdnRows>(s, q, k, v, g, beta, l2norm_qk, Hk, Hv, idk, idv, state, out, links, n_links, aligned_t);
  else if (want == 4 && dk <= 128)
    run_rows<4>(s, q, k, v, g, beta, l2norm_qk, Hk, Hv, idk, idv, state, out, links, n_links, aligned_t);
  else
    run_rows<8>(s, q, k, v, g, beta, l2norm_qk, Hk, Hv, idk, idv, state, out, links, n_links, aligned_t);
}

}  // namespace hypic::cuda
