// Gated delta rule, chunked (WY) form for long spans; gated_delta.cu's token recurrence stays the
// reference and the path for short spans (decode, seams).
//
// Within a chunk of C tokens starting from state S0, with G_i = sum_{j<=i} g_j and the normalised
// keys/queries k_i, q_i, the recurrence S_i = e^{g_i} (I - b_i k_i k_i^T) S_{i-1} + b_i k_i v_i^T
// unrolls to S_i = e^{G_i} S0 + sum_{j<=i} e^{G_i-G_j} k_j u_j^T with pseudo-values
//   (I + A) U = diag(b) V - diag(b e^G) K S0,   A_ij = b_i e^{G_i-G_j} k_i.k_j  (j < i),
// i.e. U = Ut - W S0 with Ut = (I+A)^{-1} diag(b) V and W = (I+A)^{-1} diag(b e^G) K. Then
//   O   = diag(e^G) Q S0 + P U,           P_ij = e^{G_i-G_j} q_i.k_j  (j <= i)
//   S_C = e^{G_last} S0 + Kd^T U,          Kd_j = e^{G_last-G_j} k_j.
// Three kernels: (1) per chunk and head, everything that does not depend on the state (Gram
// matrices, the triangular solve by forward substitution, W, Ut, P, Q and K with their decays);
// (2) per head and block of state columns, the only sequential part: over chunks, U = Ut - W S and
// S <- e^{G_last} S + Kd^T U, saving each chunk's start state and U; (3) per chunk and head, the
// outputs O = Qg S0 + P U, all chunks in parallel. T_C rides along as dk extra state columns that
// start at I and have v = 0 (the same trick as the token kernel), so it costs only kernel (2) more.
// Everything is f32 (CUDA cores): the same arithmetic as the CPU backend's chunked form, so precise
// mode and the conformance tests need no separate path.
#include <algorithm>
#include <cmath>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace hypic::cuda {

namespace {

constexpr int kC = 64;         // tokens per chunk
constexpr int kThreads = 256;  // every kernel
constexpr int kCols = 32;      // state columns per block of the sequential kernel
constexpr int kOutCols = 64;   // output columns per block of the output kernel

struct Work {  // workspace views, all [Hv][N][...]
  float *qg, *kd, *w, *ut, *p, *gl, *u, *s0;
};

Work carve(float* ws, int64_t Hv, int64_t N, int64_t dk, int64_t dv) {
  Work w{};
  const int64_t HN = Hv * N;
  w.qg = ws;
  w.kd = w.qg + HN * kC * dk;
  w.w = w.kd + HN * kC * dk;
  w.ut = w.w + HN * kC * dk;
  w.u = w.ut + HN * kC * dv;
  w.p = w.u + HN * kC * dv;
  w.gl = w.p + HN * kC * kC;
  w.s0 = w.gl + ((HN + 3) / 4) * 4;  // keep float4 alignment
  return w;
}

// (1) Per chunk c and value head h. Shared memory: q and k transposed, [dk][kTS] (a column per
// token: the Gram products read four tokens per float4), A [kC][kC], G, e^G, b.
constexpr int kTS = kC + 4;  // padded token stride of the transposed tiles

__global__ void __launch_bounds__(kThreads, 2)
    k_chunk_prep(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                 const float* __restrict__ g, const float* __restrict__ beta, bool l2norm, int64_t T, int64_t Hk,
                 int64_t Hv, int dk, int dv, int64_t N, Work wk) {
  pdl_entry();
  extern __shared__ float4 smem4p[];
  float* smem = reinterpret_cast<float*>(smem4p);
  float* qT = smem;
  float* kT = qT + dk * kTS;
  float* As = kT + dk * kTS;
  float* Gs = As + kC * kC;
  float* Es = Gs + kC;
  float* bs = Es + kC;
  const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t hk = h / (Hv / Hk), t0 = static_cast<int64_t>(c) * kC;
  const int L = static_cast<int>(T - t0 < kC ? T - t0 : kC);
  const int64_t base = static_cast<int64_t>(h) * N + c;

  for (int e = tid; e < kC * dk; e += kThreads) {  // coalesced reads along d
    const int i = e / dk, d = e % dk;
    const int64_t src = ((t0 + i) * Hk + hk) * dk + d;
    qT[d * kTS + i] = i < L ? q[src] : 0.f;
    kT[d * kTS + i] = i < L ? k[src] : 0.f;
  }
  if (tid < kC) {
    Gs[tid] = tid < L ? g[(t0 + tid) * Hv + h] : 0.f;  // padding: no decay, b = 0, k = q = 0
    bs[tid] = tid < L ? beta[(t0 + tid) * Hv + h] : 0.f;
  }
  __syncthreads();
  // L2 norms (x / sqrt(sum x^2 + 1e-6), as the CPU backend) and the query scale, one warp per token.
  const float qscale = rsqrtf(static_cast<float>(dk));
  for (int i = warp; i < kC; i += kThreads / 32) {
    float sq = 0.f, sk = 0.f;
    for (int d = lane; d < dk; d += 32) {
      sq += qT[d * kTS + i] * qT[d * kTS + i];
      sk += kT[d * kTS + i] * kT[d * kTS + i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, o);
      sk += __shfl_xor_sync(0xffffffffu, sk, o);
    }
    const float fq = l2norm ? qscale / sqrtf(sq + 1e-6f) : qscale, fk = l2norm ? 1.f / sqrtf(sk + 1e-6f) : 1.f;
    for (int d = lane; d < dk; d += 32) {
      qT[d * kTS + i] *= fq;
      kT[d * kTS + i] *= fk;
    }
  }
  if (tid == 0) {  // cumulative log decay: 64 adds, not worth a scan
    float acc = 0.f;
    for (int i = 0; i < kC; ++i) {
      acc += Gs[i];
      Gs[i] = acc;
      Es[i] = expf(acc);
    }
    wk.gl[base] = Es[kC - 1];
  }
  __syncthreads();
  const float Glast = Gs[kC - 1];
  // Gram products, a 4x4 tile of (i, j) per thread: Q K^T for P and K K^T for A together
  // (3 float4 loads per 32 FMAs).
  {
    const int i0 = (tid / 16) * 4, j0 = (tid % 16) * 4;
    float pq[4][4] = {}, pk[4][4] = {};
    for (int d = 0; d < dk; ++d) {
      const float4 qi = *reinterpret_cast<const float4*>(qT + d * kTS + i0);
      const float4 ki = *reinterpret_cast<const float4*>(kT + d * kTS + i0);
      const float4 kj = *reinterpret_cast<const float4*>(kT + d * kTS + j0);
      const float qa[4] = {qi.x, qi.y, qi.z, qi.w}, ka[4] = {ki.x, ki.y, ki.z, ki.w}, kb[4] = {kj.x, kj.y, kj.z, kj.w};
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          pq[a][b] += qa[a] * kb[b];
          pk[a][b] += ka[a] * kb[b];
        }
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int i = i0 + a;
      float pr[4], ar[4];
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int j = j0 + b;
        const float decay = j <= i ? expf(Gs[i] - Gs[j]) : 0.f;
        pr[b] = decay * pq[a][b];
        ar[b] = j < i ? bs[i] * decay * pk[a][b] : 0.f;
      }
      *reinterpret_cast<float4*>(wk.p + (base * kC + i) * kC + j0) = make_float4(pr[0], pr[1], pr[2], pr[3]);
      *reinterpret_cast<float4*>(As + i * kC + j0) = make_float4(ar[0], ar[1], ar[2], ar[3]);
    }
  }
  for (int e = tid; e < kC * dk; e += kThreads) {
    const int i = e / dk, d = e % dk;
    wk.qg[base * kC * dk + e] = Es[i] * qT[d * kTS + i];
    wk.kd[base * kC * dk + e] = expf(Glast - Gs[i]) * kT[d * kTS + i];
  }
  __syncthreads();
  // Forward substitution X_i -= sum_{j<i} A_ij X_j, one column per thread held in registers (A is
  // read as a broadcast): columns < dk give W from b e^G K, the rest Ut from b V.
  for (int col = tid; col < dk + dv; col += kThreads) {
    float x[kC];
    const bool is_k = col < dk;
#pragma unroll
    for (int i = 0; i < kC; ++i) {
      if (is_k)
        x[i] = bs[i] * Es[i] * kT[col * kTS + i];
      else
        x[i] = i < L ? bs[i] * v[((t0 + i) * Hv + h) * dv + (col - dk)] : 0.f;
    }
#pragma unroll
    for (int i = 1; i < kC; ++i) {
      float acc = x[i];
#pragma unroll
      for (int j = 0; j < i; ++j) acc -= As[i * kC + j] * x[j];
      x[i] = acc;
    }
    if (is_k) {
#pragma unroll
      for (int i = 0; i < kC; ++i) wk.w[(base * kC + i) * dk + col] = x[i];
    } else {
#pragma unroll
      for (int i = 0; i < kC; ++i) wk.ut[(base * kC + i) * dv + (col - dk)] = x[i];
    }
  }
}

// (2) Per head h and block of kCols state columns (value columns, then the dk columns of T_C).
// A warp owns DK/8 state rows, a lane one column; the state stays in registers across chunks.
// With STAGES = 2 the operands of chunk c+1 (W, Kd, the block's Ut columns) are in flight while
// chunk c computes: this kernel is the only sequential part, so its latency is the op's.
template <int DK, int STAGES>
__global__ void __launch_bounds__(kThreads) k_chunk_state(int64_t N, int dv, Work wk, float* state, float* transition) {
  pdl_entry();
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  constexpr int kStage = 2 * kC * DK + kC * kCols;  // W [kC][DK], Kd [kC][DK], U [kC][kCols]
  float* Ss = smem + STAGES * kStage;               // [DK][kCols]
  constexpr int R = DK / 8;                         // state rows per thread
  constexpr int RU = kC / 8;                        // U rows per thread
  const int h = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int col0 = blockIdx.x * kCols, col = col0 + lane;
  const int ncols = dv + (transition ? DK : 0);
  const bool valid = col < ncols, is_T = col >= dv, is_v = valid && !is_T;
  float* sbase = is_T ? transition + static_cast<int64_t>(h) * DK * DK : state + static_cast<int64_t>(h) * DK * dv;
  const int ld = is_T ? DK : dv, cc = is_T ? col - dv : col;

  auto load = [&](int64_t c, int stage) {
    const int64_t base = static_cast<int64_t>(h) * N + c;
    float* Ws = smem + stage * kStage;
    float* Ks = Ws + kC * DK;
    float* Us = Ks + kC * DK;
    const float* wsrc = wk.w + base * kC * DK;
    const float* ksrc = wk.kd + base * kC * DK;
    for (int e = tid; e < kC * DK / 4; e += kThreads) {
      cp_async16(Ws + 4 * e, wsrc + 4 * e);
      cp_async16(Ks + 4 * e, ksrc + 4 * e);
    }
    // Ut columns col0.. of each row; groups of 4 are all value columns or all T columns (dv % 4 == 0).
    for (int e = tid; e < kC * kCols / 4; e += kThreads) {
      const int i = e / (kCols / 4), c4 = col0 + 4 * (e % (kCols / 4));
      const bool ok = c4 < dv;
      cp_async16(Us + i * kCols + 4 * (e % (kCols / 4)), ok ? wk.ut + (base * kC + i) * dv + c4 : wk.ut, ok);
    }
    cp_async_commit();
  };

  float s[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int d = warp * R + r;
    s[r] = valid ? (is_T ? (d == cc ? 1.f : 0.f) : sbase[static_cast<int64_t>(d) * ld + cc]) : 0.f;
  }
  if (STAGES == 2) load(0, 0);
  for (int64_t c = 0; c < N; ++c) {
    const int64_t base = static_cast<int64_t>(h) * N + c;
    const int stage = STAGES == 2 ? static_cast<int>(c & 1) : 0;
    __syncthreads();  // every warp is done with the buffer the next load overwrites
    if (STAGES == 1) load(c, 0);
    cp_async_wait_all();
    __syncthreads();
    if (STAGES == 2 && c + 1 < N) load(c + 1, stage ^ 1);
    const float* Ws = smem + stage * kStage;
    const float* Ks = Ws + kC * DK;
    float* Us = smem + stage * kStage + 2 * kC * DK;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int d = warp * R + r;
      Ss[d * kCols + lane] = s[r];
      if (is_v) wk.s0[(base * DK + d) * dv + col] = s[r];
    }
    const float decay = wk.gl[base];
    __syncthreads();
    // U = Ut - W S for this warp's rows.
    float u[RU];
#pragma unroll
    for (int r = 0; r < RU; ++r) u[r] = Us[(warp * RU + r) * kCols + lane];
    for (int d = 0; d < DK; d += 4) {
      const float s0 = Ss[d * kCols + lane], s1 = Ss[(d + 1) * kCols + lane], s2 = Ss[(d + 2) * kCols + lane],
                  s3 = Ss[(d + 3) * kCols + lane];
#pragma unroll
      for (int r = 0; r < RU; ++r) {
        const float4 w4 = *reinterpret_cast<const float4*>(Ws + (warp * RU + r) * DK + d);
        u[r] -= w4.x * s0 + w4.y * s1 + w4.z * s2 + w4.w * s3;
      }
    }
    // Each thread rewrites only the U entries it read itself, but (b) reads all of them.
#pragma unroll
    for (int r = 0; r < RU; ++r) {
      const int i = warp * RU + r;
      Us[i * kCols + lane] = u[r];
      if (is_v) wk.u[(base * kC + i) * dv + col] = u[r];
    }
    __syncthreads();
    // S <- decay S + Kd^T U for this warp's rows.
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] *= decay;
    for (int i = 0; i < kC; ++i) {
      const float ui = Us[i * kCols + lane];
#pragma unroll
      for (int r = 0; r < R; r += 4) {
        const float4 k4 = *reinterpret_cast<const float4*>(Ks + i * DK + warp * R + r);
        s[r] += k4.x * ui;
        s[r + 1] += k4.y * ui;
        s[r + 2] += k4.z * ui;
        s[r + 3] += k4.w * ui;
      }
    }
  }
  if (valid) {
#pragma unroll
    for (int r = 0; r < R; ++r) sbase[static_cast<int64_t>(warp * R + r) * ld + cc] = s[r];
  }
}

// (3) Per chunk, head and block of kOutCols output columns: O = Qg S0 + P U.
__global__ void __launch_bounds__(kThreads)
    k_chunk_out(int64_t T, int64_t Hv, int dk, int dv, int64_t N, Work wk, float* __restrict__ out) {
  pdl_entry();
  extern __shared__ float smem[];
  float* Qs = smem;                // [kC][dk]
  float* Ps = Qs + kC * dk;        // [kC][kC]
  float* Ss = Ps + kC * kC;        // [dk][kOutCols]
  float* Us = Ss + dk * kOutCols;  // [kC][kOutCols]
  const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int col0 = blockIdx.z * kOutCols;
  const int64_t base = static_cast<int64_t>(h) * N + c, t0 = static_cast<int64_t>(c) * kC;
  const int L = static_cast<int>(T - t0 < kC ? T - t0 : kC);
  {
    const float4* qsrc = reinterpret_cast<const float4*>(wk.qg + base * kC * dk);
    for (int e = tid; e < kC * dk / 4; e += kThreads) reinterpret_cast<float4*>(Qs)[e] = qsrc[e];
    const float4* psrc = reinterpret_cast<const float4*>(wk.p + base * kC * kC);
    for (int e = tid; e < kC * kC / 4; e += kThreads) reinterpret_cast<float4*>(Ps)[e] = psrc[e];
  }
  for (int e = tid; e < dk * kOutCols; e += kThreads) {
    const int d = e / kOutCols, cl = col0 + e % kOutCols;
    Ss[e] = cl < dv ? wk.s0[(base * dk + d) * dv + cl] : 0.f;
  }
  for (int e = tid; e < kC * kOutCols; e += kThreads) {
    const int i = e / kOutCols, cl = col0 + e % kOutCols;
    Us[e] = cl < dv ? wk.u[(base * kC + i) * dv + cl] : 0.f;
  }
  __syncthreads();
  constexpr int RO = kC * kOutCols / kThreads;  // 16 rows per thread
  const int cl = tid % kOutCols, r0 = (tid / kOutCols) * RO;
  float acc[RO];
#pragma unroll
  for (int r = 0; r < RO; ++r) acc[r] = 0.f;
  for (int d = 0; d < dk; d += 4) {
    const float s0 = Ss[d * kOutCols + cl], s1 = Ss[(d + 1) * kOutCols + cl], s2 = Ss[(d + 2) * kOutCols + cl],
                s3 = Ss[(d + 3) * kOutCols + cl];
#pragma unroll
    for (int r = 0; r < RO; ++r) {
      const float4 q4 = *reinterpret_cast<const float4*>(Qs + (r0 + r) * dk + d);
      acc[r] += q4.x * s0 + q4.y * s1 + q4.z * s2 + q4.w * s3;
    }
  }
  for (int j = 0; j < kC; j += 4) {
    const float u0 = Us[j * kOutCols + cl], u1 = Us[(j + 1) * kOutCols + cl], u2 = Us[(j + 2) * kOutCols + cl],
                u3 = Us[(j + 3) * kOutCols + cl];
#pragma unroll
    for (int r = 0; r < RO; ++r) {
      const float4 p4 = *reinterpret_cast<const float4*>(Ps + (r0 + r) * kC + j);
      acc[r] += p4.x * u0 + p4.y * u1 + p4.z * u2 + p4.w * u3;
    }
  }
  if (col0 + cl < dv) {
#pragma unroll
    for (int r = 0; r < RO; ++r)
      if (r0 + r < L) out[((t0 + r0 + r) * Hv + h) * dv + col0 + cl] = acc[r];
  }
}

void set_smem(const void* fn, size_t bytes) {
  if (bytes > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

template <int DK>
void run_state(cudaStream_t s, int64_t N, int64_t Hv, int dv, const Work& w, float* state, float* tr) {
  constexpr int stages = DK <= 128 ? 2 : 1;  // two stages of DK = 256 would not fit in shared memory
  const size_t smem = static_cast<size_t>(stages * (2 * kC * DK + kC * kCols) + DK * kCols) * sizeof(float);
  set_smem(reinterpret_cast<const void*>(k_chunk_state<DK, stages>), smem);
  const int ncols = dv + (tr ? DK : 0);
  dim3 grid(static_cast<unsigned>((ncols + kCols - 1) / kCols), static_cast<unsigned>(Hv));
  launch(s, grid, kThreads, smem, k_chunk_state<DK, stages>, N, dv, w, state, tr);
  CUDA_LAUNCH_CHECK("k_chunk_state");
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace

bool gated_delta_chunked_supported(const float* q, const float* k, int64_t dk, int64_t dv) {
  return (dk == 64 || dk == 128 || dk == 256) && dv > 0 && dv <= 256 && dv % 4 == 0 && aligned16(q) && aligned16(k);
}

int64_t gated_delta_chunked_workspace_floats(int64_t T, int64_t Hv, int64_t dk, int64_t dv) {
  const int64_t N = (T + kC - 1) / kC, HN = Hv * N;
  return HN * kC * (3 * dk + 2 * dv + kC) + ((HN + 3) / 4) * 4 + HN * dk * dv;
}

void launch_gated_delta_rule_chunked(cudaStream_t s, const float* q, const float* k, const float* v, const float* g,
                                     const float* beta, bool l2norm_qk, int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                                     int64_t dv, float* state, float* out, float* transition, float* workspace) {
  if (Hv == 0 || T == 0) return;
  const int64_t N = (T + kC - 1) / kC;
  const Work w = carve(workspace, Hv, N, dk, dv);
  const int idk = static_cast<int>(dk), idv = static_cast<int>(dv);

  const size_t prep_smem = static_cast<size_t>(2 * dk * kTS + kC * kC + 3 * kC) * sizeof(float);
  set_smem(reinterpret_cast<const void*>(k_chunk_prep), prep_smem);
  launch(s, dim3(static_cast<unsigned>(N), static_cast<unsigned>(Hv)), kThreads, prep_smem, k_chunk_prep, q, k, v, g,
         beta, l2norm_qk, T, Hk, Hv, idk, idv, N, w);
  CUDA_LAUNCH_CHECK("k_chunk_prep");

  if (dk == 64)
    run_state<64>(s, N, Hv, idv, w, state, transition);
  else if (dk == 128)
    run_state<128>(s, N, Hv, idv, w, state, transition);
  else
    run_state<256>(s, N, Hv, idv, w, state, transition);

  const size_t out_smem = static_cast<size_t>(kC * dk + kC * kC + dk * kOutCols + kC * kOutCols) * sizeof(float);
  set_smem(reinterpret_cast<const void*>(k_chunk_out), out_smem);
  launch(
      s,
      dim3(static_cast<unsigned>(N), static_cast<unsigned>(Hv), static_cast<unsigned>((dv + kOutCols - 1) / kOutCols)),
      kThreads, out_smem, k_chunk_out, T, Hv, idk, idv, N, w, out);
  CUDA_LAUNCH_CHECK("k_chunk_out");
}

}  // namespace hypic::cuda
