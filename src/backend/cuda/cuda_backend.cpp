#include "backend/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda.h>  // driver types for cuMemGetAddressRange (fetched through the runtime)
#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

#include "backend/checks.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace hypic::cuda {

using namespace checks;

namespace {

constexpr DeviceKind kDev = DeviceKind::CUDA;

// Memory of one captured graph: blocks handed out while it was recorded, reused only by later
// allocations of the same recording (a graph replays its work in recorded order), freed with it.
struct GraphPool {
  std::map<size_t, std::vector<void*>> free;
  std::vector<void*> blocks;
  size_t bytes = 0;
  ~GraphPool() {
    for (void* p : blocks) cudaFree(p);  // synchronises: the graph's last replay is done
  }
  void put(void* p, size_t r) { free[r].push_back(p); }
};

// Caching device allocator. Blocks are rounded (powers of two up to 1 MiB, then 2 MiB steps) and
// kept per rounded size when freed. One stream orders all work, so a block freed by the host can be
// handed out again at once: every later use is enqueued after every earlier one.
class DeviceAllocator {
 public:
  explicit DeviceAllocator(int dev) : dev_(dev) {}
  ~DeviceAllocator() { release_cached(); }

  static size_t round(size_t bytes) {
    if (bytes <= 512) return 512;
    if (bytes <= (size_t(1) << 20)) {
      size_t r = 512;
      while (r < bytes) r <<= 1;
      return r;
    }
    // Eight size classes per power of two (at most 12.5% slack): buffers whose size drifts from
    // call to call (MoE batches, key counts, workspaces) land in the same class and are reused
    // instead of costing a cudaMalloc (which synchronises) each time.
    size_t top = size_t(1) << 20;
    while (top < bytes / 2) top <<= 1;  // top <= bytes < 2 top... or bytes just above 1 MiB
    const size_t step = std::max<size_t>(top / 8, size_t(1) << 17);
    return (bytes + step - 1) / step * step;
  }

  // While a graph is recorded, blocks come from (and return to) its pool.
  void set_pool(std::shared_ptr<GraphPool> p) {
    std::lock_guard<std::mutex> lk(mu_);
    pool_ = std::move(p);
  }
  std::shared_ptr<GraphPool> pool() const {
    std::lock_guard<std::mutex> lk(mu_);
    return pool_;
  }
  void* get_from(GraphPool& gp, size_t bytes) {
    const size_t r = round(bytes);
    if (auto it = gp.free.find(r); it != gp.free.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      return p;
    }
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, r);
    if (e != cudaSuccess)
      throw std::runtime_error("cudaMalloc of " + std::to_string(r) +
                               " bytes for a captured graph failed: " + cudaGetErrorString(e));
    gp.blocks.push_back(p);
    gp.bytes += r;
    return p;
  }

  void* get(size_t bytes) {
    const size_t r = round(bytes);
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = free_.find(r);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_ -= r;
        in_use_ += r;
        peak_ = std::max(peak_, in_use_);
        return p;
      }
    }
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, r);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // clear the sticky-free error state of the failed call
      release_cached();
      e = cudaMalloc(&p, r);
    }
    if (e != cudaSuccess)
      throw std::runtime_error("cudaMalloc of " + std::to_string(r) + " bytes failed: " + cudaGetErrorString(e) + " (" +
                               std::to_string(in_use_ >> 20) + " MiB in use by hypic)");
    std::lock_guard<std::mutex> lk(mu_);
    in_use_ += r;
    peak_ = std::max(peak_, in_use_);
    return p;
  }

  void put(void* p, size_t bytes) {
    const size_t r = round(bytes);
    std::lock_guard<std::mutex> lk(mu_);
    free_[r].push_back(p);
    in_use_ -= r;
    cached_ += r;
  }

  void release_cached() {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [sz, v] : free_)
      for (void* p : v) cudaFree(p);  // errors at process exit (context gone) are harmless
    free_.clear();
    cached_ = 0;
  }

  size_t reserved() const {
    std::lock_guard<std::mutex> lk(mu_);
    return in_use_ + cached_;
  }
  size_t peak() const {
    std::lock_guard<std::mutex> lk(mu_);
    return peak_;
  }
  size_t cached() const {
    std::lock_guard<std::mutex> lk(mu_);
    return cached_;
  }

 private:
  int dev_;
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;
  size_t in_use_ = 0, cached_ = 0, peak_ = 0;
  std::shared_ptr<GraphPool> pool_;
};

cudaDataType_t cuda_type(DType d) {
  switch (d) {
    case DType::BF16:
      return CUDA_R_16BF;
    case DType::F16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

}  // namespace

// HYPIC_CUDA_PROFILE=1: GPU time per op, from events around every call, printed to stderr when the
// backend is destroyed (ops run in one stream, so the times add up to the stream's busy time).
// HYPIC_CUDA_PROFILE=2 adds phases inside ops ("moe_experts/gate"), listed apart from the total.
struct OpProfile {
  struct Rec {
    const char* op;
    cudaEvent_t a, b;
    bool phase = false;
  };
  std::vector<Rec> recs;
  int level = 1;
  std::set<std::string> names;  // phase names made at run time ("gemv 1x4096x12352")
  const char* intern(std::string s) { return names.insert(std::move(s)).first->c_str(); }
  void clear() {
    cudaDeviceSynchronize();
    for (auto& r : recs) cudaEventDestroy(r.a), cudaEventDestroy(r.b);
    recs.clear();
  }
  ~OpProfile() {
    if (recs.empty()) return;
    cudaDeviceSynchronize();
    std::map<std::string, std::pair<int64_t, double>> by;
    double total = 0, span = 0;
    for (auto& r : recs) {
      float ms = 0, end = 0;
      if (cudaEventElapsedTime(&ms, r.a, r.b) == cudaSuccess) {
        by[r.op].first++;
        by[r.op].second += ms;
        if (!r.phase) total += ms;
      }
      if (cudaEventElapsedTime(&end, recs.front().a, r.b) == cudaSuccess) span = std::max(span, double(end));
    }
    for (auto& r : recs) cudaEventDestroy(r.a), cudaEventDestroy(r.b);
    std::vector<std::pair<double, std::string>> rows;
    for (auto& [op, v] : by) rows.push_back({v.second, op});
    std::sort(rows.rbegin(), rows.rend());
    // Busy against the span from the first op to the last: the rest is the GPU waiting for the
    // host (launch overhead, syncs) or for the caller between requests.
    std::fprintf(stderr, "hypic cuda profile: %.1f ms of GPU time in %zu calls over a span of %.1f ms\n", total,
                 recs.size(), span);
    for (auto& [ms, op] : rows)
      std::fprintf(stderr, "  %-20s %8lld calls %10.2f ms %5.1f%%\n", op.c_str(), static_cast<long long>(by[op].first),
                   ms, 100 * ms / std::max(total, 1e-9));
  }
};

struct CudaBackend::Impl {
  int dev = 0;
  std::unique_ptr<OpProfile> prof;
  cudaDeviceProp prop{};
  cudaStream_t stream = nullptr;
  cudaStream_t copy_stream = nullptr;  // copy_async: host-tier promotions beside the work
  cublasHandle_t blas = nullptr;
  std::shared_ptr<DeviceAllocator> mem;
  // Reused scratch for activations converted to a weight's dtype (stream order makes reuse safe).
  Tensor half_x;
  Tensor blas_ws;
  bool exact_half = false;
  // HYPIC_CUDA_GDN=token keeps every span on the token-recurrence kernel, =f32 long spans on the
  // f32 chunked kernel instead of the tensor-core one (benchmarks, bisecting, tests).
  bool gdn_token_only = false;
  bool gdn_f32_chunks = false;
  // Makes this backend's GPU current on the calling thread (a no-op after the first call there).
  void bind() const {
    thread_local int current = -1;
    if (current != dev) {
      CUDA_CHECK(cudaSetDevice(dev));
      current = dev;
    }
  }
  // Device pointer tables [gate x E, up x E, down x E] of MoE layers, keyed by the first gate
  // weight and checked against every pointer before reuse.
  struct ExpertTable {
    std::vector<const void*> host;
    Tensor dev;
  };
  std::map<const void*, ExpertTable> expert_tables;
  // inv_freq tables per (rot_dim, theta), uploaded once.
  std::map<std::pair<int, double>, Tensor> inv_freq;
  int depth = 0;  // nesting of OpScopes (an op calling ops is profiled as one)
  // While a graph is recorded: tensors made before it that it uses (scratch), kept alive with it.
  std::vector<Tensor>* capture_keep = nullptr;
  bool capturing() const { return capture_keep != nullptr; }
};

namespace {
// Events around a stretch of the stream, kept in the profile when `on` (and the profile is not
// full).
class EventSpan {
 public:
  EventSpan(CudaBackend::Impl& m, const char* name, bool phase, bool on) : m_(m) {
    if (!on || m.capturing() || m.prof->recs.size() >= (size_t(1) << 22)) return;
    rec_.op = name;
    rec_.phase = phase;
    cudaEventCreate(&rec_.a);
    cudaEventCreate(&rec_.b);
    cudaEventRecord(rec_.a, m.stream);
    on_ = true;
  }
  ~EventSpan() {
    if (!on_) return;
    cudaEventRecord(rec_.b, m_.stream);
    m_.prof->recs.push_back(rec_);
  }

 private:
  CudaBackend::Impl& m_;
  OpProfile::Rec rec_{};
  bool on_ = false;
};

// A phase inside an op, recorded at HYPIC_CUDA_PROFILE=2 only.
class PhaseScope {
 public:
  PhaseScope(CudaBackend::Impl& m, const char* name) : span_(m, name, true, m.prof && m.prof->level >= 2) {}

 private:
  EventSpan span_;
};

// A few-row product as a phase named by its shape M x K -> N (HYPIC_CUDA_PROFILE=2), so a decode
// step's profile shows each weight's time and hence its bandwidth.
class GemvPhase {
 public:
  GemvPhase(CudaBackend::Impl& m, const char* kind, int64_t M, int64_t K, int64_t N)
      : span_(m,
              m.prof && m.prof->level >= 2 ? m.prof->intern(std::string(kind) + " " + std::to_string(M) + "x" +
                                                            std::to_string(K) + "->" + std::to_string(N))
                                           : "",
              true, m.prof && m.prof->level >= 2) {}

 private:
  EventSpan span_;
};

// First line of every op: binds the device and, when profiling, brackets the op with events.
class OpScope {
 public:
  OpScope(CudaBackend::Impl& m, const char* op) : m_((m.bind(), m)), span_(m, op, false, m.prof && m.depth++ == 0) {}
  ~OpScope() {
    if (m_.prof) --m_.depth;
  }

 private:
  CudaBackend::Impl& m_;
  EventSpan span_;
};
}  // namespace

bool device_available() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) (void)cudaGetLastError();
  return e == cudaSuccess && n > 0;
}

CudaBackend::CudaBackend(int device) : impl_(std::make_unique<Impl>()) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0)
    throw std::runtime_error(std::string("cuda backend: no CUDA device found (") +
                             (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices") + ")");
  if (device < 0 || device >= n)
    throw std::runtime_error("cuda backend: device " + std::to_string(device) + " does not exist (" +
                             std::to_string(n) + " found)");
  auto& m = *impl_;
  m.dev = device;
  CUDA_CHECK(cudaSetDevice(device));
  CUDA_CHECK(cudaGetDeviceProperties(&m.prop, device));
  CUDA_CHECK(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  CUBLAS_CHECK(cublasCreate(&m.blas));
  CUBLAS_CHECK(cublasSetStream(m.blas, m.stream));
  // Plain f32 products stay f32: conformance with f32 references needs it (no TF32).
  CUBLAS_CHECK(cublasSetMathMode(m.blas, CUBLAS_PEDANTIC_MATH));
  m.mem = std::make_shared<DeviceAllocator>(device);
  // A workspace of our own: cuBLAS then allocates nothing while a graph is recorded.
  m.blas_ws = alloc_uninit(DType::U8, {32 << 20});
  CUBLAS_CHECK(cublasSetWorkspace(m.blas, m.blas_ws.raw(), m.blas_ws.nbytes()));
  if (const char* e = std::getenv("HYPIC_CUDA_PROFILE"); e && *e && std::string(e) != "0")
    m.prof = std::make_unique<OpProfile>(), m.prof->level = std::atoi(e) >= 2 ? 2 : 1;
  if (const char* e = std::getenv("HYPIC_CUDA_GDN"); e && *e) {
    const std::string mode = e;
    if (mode != "token" && mode != "f32" && mode != "tc")
      throw std::invalid_argument("HYPIC_CUDA_GDN=" + mode + ": expected token, f32 or tc");
    m.gdn_token_only = mode == "token";
    m.gdn_f32_chunks = mode == "f32";
  }
}

CudaBackend::~CudaBackend() {
  auto& m = *impl_;
  if (m.stream) cudaStreamSynchronize(m.stream);
  m.half_x = Tensor();
  m.inv_freq.clear();
  if (m.blas) cublasSetWorkspace(m.blas, nullptr, 0);
  m.blas_ws = Tensor();
  m.expert_tables.clear();
  if (m.blas) cublasDestroy(m.blas);
  if (m.copy_stream) cudaStreamSynchronize(m.copy_stream), cudaStreamDestroy(m.copy_stream);
  if (m.stream) cudaStreamDestroy(m.stream);
}

Device CudaBackend::device() const {
  return Device{DeviceKind::CUDA, impl_->dev};
}
int CudaBackend::num_threads() const {
  return impl_->prop.multiProcessorCount;
}
std::string CudaBackend::description() const {
  const auto& p = impl_->prop;
  char buf[512];
  std::snprintf(buf, sizeof buf, "%s, sm_%d%d, %d SMs, %.1f GiB", p.name, p.major, p.minor, p.multiProcessorCount,
                static_cast<double>(p.totalGlobalMem) / (1u << 30));
  return buf;
}
size_t CudaBackend::reserved_bytes() const {
  return impl_->mem->reserved();
}
size_t CudaBackend::peak_bytes() const {
  return impl_->mem->peak();
}
int64_t CudaBackend::free_memory_bytes() const {
  impl_->bind();
  size_t free = 0, total = 0;
  CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return static_cast<int64_t>(free + impl_->mem->cached());
}

// ---- memory ----------------------------------------------------------------------------------

Tensor CudaBackend::alloc_uninit(DType dt, Shape shape) {
  impl_->bind();
  for (auto d : shape)
    if (d < 0) throw std::invalid_argument("alloc: negative dimension in shape " + shape_str(shape));
  if (dtype_is_quantized(dt))
    throw std::invalid_argument(
        std::string("cuda: ") + dtype_name(dt) +
        " weights run on the CPU backend only (--backend cpu), or load an f32, f16 or bf16 file");
  const size_t bytes = dtype_bytes(dt, shape_numel(shape));
  auto mem = impl_->mem;
  std::shared_ptr<Storage> st;
  const size_t nb = std::max<size_t>(bytes, 1);
  if (auto gp = mem->pool()) {
    void* p = mem->get_from(*gp, nb);
    st = std::make_shared<Storage>(p, bytes, device(), [gp, nb](void* q) { gp->put(q, DeviceAllocator::round(nb)); });
  } else {
    void* p = mem->get(nb);
    st = std::make_shared<Storage>(p, bytes, device(), [mem, nb](void* q) { mem->put(q, nb); });
  }
  void* p = st->data();
  if (bytes && Tensor::poison_uninitialized()) CUDA_CHECK(cudaMemsetAsync(p, 0xff, bytes, impl_->stream));
  return Tensor(std::move(st), 0, dt, std::move(shape));
}

Tensor CudaBackend::alloc(DType dt, Shape shape) {
  Tensor t = alloc_uninit(dt, std::move(shape));
  if (t.nbytes()) CUDA_CHECK(cudaMemsetAsync(t.raw(), 0, t.nbytes(), impl_->stream));
  return t;
}

Tensor CudaBackend::upload(const void* host, DType dt, int64_t n) {
  impl_->bind();
  Tensor t = alloc_uninit(dt, {n});
  // From pageable memory the call returns once the bytes are staged, so `host` may go away after.
  if (n) CUDA_CHECK(cudaMemcpyAsync(t.raw(), host, t.nbytes(), cudaMemcpyHostToDevice, impl_->stream));
  return t;
}

Tensor CudaBackend::to_device(const Tensor& host) {
  impl_->bind();
  if (!host.defined()) fail("to_device", "host is undefined");
  if (host.device().kind == DeviceKind::CUDA) return host;
  Tensor t = alloc_uninit(host.dtype(), host.shape());
  if (t.nbytes()) CUDA_CHECK(cudaMemcpyAsync(t.raw(), host.raw(), t.nbytes(), cudaMemcpyHostToDevice, impl_->stream));
  return t;
}

Tensor CudaBackend::to_host(const Tensor& t) {
  impl_->bind();
  if (!t.defined()) fail("to_host", "t is undefined");
  if (t.is_cpu()) return t;
  Tensor h = Tensor::empty(t.dtype(), t.shape());
  if (t.nbytes()) CUDA_CHECK(cudaMemcpyAsync(h.raw(), t.raw(), t.nbytes(), cudaMemcpyDeviceToHost, impl_->stream));
  CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  return h;
}

void CudaBackend::copy(const Tensor& src, Tensor& dst) {
  OpScope scope_(*impl_, "copy");
  if (!src.defined()) fail("copy", "src is undefined");
  if (!dst.defined()) fail("copy", "dst is undefined");
  if (src.dtype() != dst.dtype() || src.numel() != dst.numel())
    fail("copy", "src " + src.str() + " and dst " + dst.str() + ": dtype or element count differ");
  if (src.raw() == dst.raw() || src.nbytes() == 0) return;
  CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), src.nbytes(), cudaMemcpyDefault, impl_->stream));
  if (src.is_cpu() || dst.is_cpu()) CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
}

Tensor CudaBackend::alloc_host(size_t bytes) {
  impl_->bind();
  void* p = nullptr;
  // Page-locked, so that copy_async's copies run on the copy engines while kernels run.
  CUDA_CHECK(cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocDefault));
  auto st = std::make_shared<Storage>(p, bytes, Device{}, [](void* q) { cudaFreeHost(q); });
  return Tensor(std::move(st), 0, DType::U8, {static_cast<int64_t>(bytes)});
}

// ---- memory shared with other processes (CUDA IPC) ---------------------------------------------
// A worker packs an entry into one cudaMalloc'd buffer (not the caching allocator's: the buffer
// leaves with its handle and is freed when the combine node is done) and exports its IPC handle;
// the combine node maps it, copies the pieces into tensors of its own and unmaps it.

std::optional<Backend::Shared> CudaBackend::share(std::span<const Tensor* const> src, std::span<const uint64_t> offsets,
                                                  uint64_t bytes) {
  impl_->bind();
  if (src.size() != offsets.size())
    fail("share", std::to_string(src.size()) + " tensors for " + std::to_string(offsets.size()) + " offsets");
  for (size_t i = 0; i < src.size(); ++i)
    if (!src[i]->defined() || offsets[i] > bytes || src[i]->nbytes() > bytes - offsets[i])
      fail("share", "piece " + std::to_string(i) + " does not fit the buffer of " + std::to_string(bytes) + " bytes");
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, std::max<uint64_t>(bytes, 1)); e != cudaSuccess) {
    (void)cudaGetLastError();
    spdlog::warn("cuda: no memory to share an entry of {} bytes ({}); it goes through the host", bytes,
                 cudaGetErrorString(e));
    return std::nullopt;
  }
  const int dev = impl_->dev;
  std::shared_ptr<void> keep(p, [dev](void* q) {
    cudaSetDevice(dev);
    cudaFree(q);
  });
  for (size_t i = 0; i < src.size(); ++i)
    if (src[i]->nbytes())
      CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(p) + offsets[i], src[i]->raw(), src[i]->nbytes(), cudaMemcpyDefault,
                                 impl_->stream));
  CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  cudaIpcMemHandle_t h{};
  if (cudaError_t e = cudaIpcGetMemHandle(&h, p); e != cudaSuccess) {
    (void)cudaGetLastError();
    spdlog::warn("cuda: cudaIpcGetMemHandle failed ({}); entries go through the host", cudaGetErrorString(e));
    return std::nullopt;
  }
  return Shared{std::string(reinterpret_cast<const char*>(&h), sizeof h), std::move(keep)};
}

bool CudaBackend::can_map_shared() const {
  return true;
}

namespace {
// The driver's cuMemGetAddressRange, through the runtime (no link to libcuda): the size of a mapped
// allocation, so that a descriptor claiming more than the worker shared is refused before a copy
// reads past it (an illegal address would end this process's CUDA context).
using MemRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
MemRangeFn mem_range_fn() {
  static const MemRangeFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return MemRangeFn{nullptr};
    }
    return reinterpret_cast<MemRangeFn>(f);
  }();
  return fn;
}
}  // namespace

void CudaBackend::copy_from_shared(const std::string& handle, uint64_t bytes, std::span<const uint64_t> offsets,
                                   std::span<Tensor> dst) {
  impl_->bind();
  if (handle.size() != sizeof(cudaIpcMemHandle_t))
    throw SharedMemoryError("a CUDA IPC handle has " + std::to_string(sizeof(cudaIpcMemHandle_t)) + " bytes, not " +
                            std::to_string(handle.size()));
  if (dst.size() != offsets.size())
    fail("copy_from_shared",
         std::to_string(dst.size()) + " tensors for " + std::to_string(offsets.size()) + " offsets");
  for (size_t i = 0; i < dst.size(); ++i)
    if (!dst[i].defined() || dst[i].is_cpu() || offsets[i] > bytes || dst[i].nbytes() > bytes - offsets[i])
      fail("copy_from_shared", "piece " + std::to_string(i) + " is not a device tensor inside the " +
                                   std::to_string(bytes) + "-byte buffer");
  cudaIpcMemHandle_t h{};
  std::memcpy(&h, handle.data(), sizeof h);
  void* p = nullptr;
  if (cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
    (void)cudaGetLastError();
    throw SharedMemoryError(std::string("cudaIpcOpenMemHandle: ") + cudaGetErrorString(e));
  }
  struct Unmap {
    void* p;
    ~Unmap() { cudaIpcCloseMemHandle(p); }
  } unmap{p};
  if (MemRangeFn range = mem_range_fn()) {
    CUdeviceptr base = 0;
    size_t size = 0;
    if (range(&base, &size, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS)
      throw SharedMemoryError("cuMemGetAddressRange failed on the mapped buffer");
    if (reinterpret_cast<CUdeviceptr>(p) + bytes > base + size)
      throw SharedMemoryError("the shared buffer has " + std::to_string(size) + " bytes, the entry claims " +
                              std::to_string(bytes));
  }
  for (size_t i = 0; i < dst.size(); ++i)
    if (dst[i].nbytes())
      CUDA_CHECK(cudaMemcpyAsync(dst[i].raw(), static_cast<const char*>(p) + offsets[i], dst[i].nbytes(),
                                 cudaMemcpyDeviceToDevice, impl_->stream));
  CUDA_CHECK(cudaStreamSynchronize(impl_->stream));  // before the unmap
}

uint64_t CudaBackend::payload_checksum(std::span<const Tensor* const> ts, std::span<const uint64_t> offsets) {
  impl_->bind();
  if (ts.size() != offsets.size())
    fail("payload_checksum", std::to_string(ts.size()) + " tensors for " + std::to_string(offsets.size()) + " offsets");
  std::vector<cuda::ChecksumPiece> pieces;
  uint64_t max_bytes = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    if (offsets[i] % 4 != 0)
      fail("payload_checksum", "offset " + std::to_string(offsets[i]) + " is not a multiple of 4");
    if (ts[i]->is_cpu()) return Backend::payload_checksum(ts, offsets);  // host pieces: the reference loop
    pieces.push_back({ts[i]->raw(), ts[i]->nbytes(), offsets[i] / 4});
    max_bytes = std::max<uint64_t>(max_bytes, ts[i]->nbytes());
  }
  Tensor table = upload(pieces.data(), DType::U8, static_cast<int64_t>(pieces.size() * sizeof(cuda::ChecksumPiece)));
  Tensor out = alloc_uninit(DType::U8, {8});
  cuda::launch_payload_checksum(impl_->stream, static_cast<const cuda::ChecksumPiece*>(table.raw()),
                                static_cast<int>(pieces.size()), max_bytes,
                                static_cast<unsigned long long*>(out.raw()));
  uint64_t sum = 0;
  CUDA_CHECK(cudaMemcpyAsync(&sum, out.raw(), 8, cudaMemcpyDeviceToHost, impl_->stream));
  CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  return sum;
}

namespace {
struct CudaFence : Backend::Fence {
  cudaEvent_t done = nullptr;
  std::vector<Tensor> keep;  // the copies' host sources, alive until their copies are done
  ~CudaFence() override {
    if (done) {
      // The sources may go once the copies have: wait for them (normally long done) first.
      cudaEventSynchronize(done);
      cudaEventDestroy(done);
    }
  }
};
}  // namespace

std::shared_ptr<Backend::Fence> CudaBackend::copy_async(std::span<const Tensor> src, std::span<Tensor> dst) {
  OpScope scope_(*impl_, "copy_async");
  auto& m = *impl_;
  if (src.size() != dst.size())
    fail("copy_async", std::to_string(src.size()) + " sources for " + std::to_string(dst.size()) + " targets");
  if (m.capturing()) fail("copy_async", "cannot be recorded in a graph");
  if (!m.copy_stream) CUDA_CHECK(cudaStreamCreateWithFlags(&m.copy_stream, cudaStreamNonBlocking));
  auto f = std::make_shared<CudaFence>();
  // The targets come from the stream-ordered allocator: their memory may still be read by work
  // queued before this call, so the copies start after it.
  cudaEvent_t queued = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&queued, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(queued, m.stream));
  CUDA_CHECK(cudaStreamWaitEvent(m.copy_stream, queued, 0));
  CUDA_CHECK(cudaEventDestroy(queued));
  for (size_t i = 0; i < src.size(); ++i) {
    const Tensor& a = src[i];
    Tensor& b = dst[i];
    if (!a.defined() || !b.defined() || a.dtype() != b.dtype() || a.numel() != b.numel() || !a.is_cpu() ||
        b.device().kind != kDev)
      fail("copy_async", "source " + (a.defined() ? a.str() : std::string("undefined")) + " on " + a.device().str() +
                             " to " + (b.defined() ? b.str() : std::string("undefined")) +
                             ": host to this GPU, same dtype and size");
    if (a.nbytes()) CUDA_CHECK(cudaMemcpyAsync(b.raw(), a.raw(), a.nbytes(), cudaMemcpyHostToDevice, m.copy_stream));
    f->keep.push_back(a);
  }
  CUDA_CHECK(cudaEventCreateWithFlags(&f->done, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(f->done, m.copy_stream));
  return f;
}

void CudaBackend::wait(const Fence& f) {
  impl_->bind();
  const auto* cf = dynamic_cast<const CudaFence*>(&f);
  if (!cf) fail("wait", "a fence of another backend");
  CUDA_CHECK(cudaStreamWaitEvent(impl_->stream, cf->done, 0));
}

void CudaBackend::fill(Tensor& t, float value) {
  OpScope scope_(*impl_, "fill");
  need_f32("fill", "t", t, kDev);
  launch_fill(impl_->stream, t.data<float>(), t.numel(), value);
}

void CudaBackend::convert(const Tensor& src, Tensor& dst) {
  OpScope scope_(*impl_, "convert");
  check_convert(src, dst, kDev);
  if (src.dtype() == dst.dtype()) {
    copy(src, dst);
  } else if (src.dtype() == DType::F32) {
    launch_convert_f32(impl_->stream, src.data<float>(), dst.dtype(), dst.raw(), src.numel());
  } else {
    launch_to_f32(impl_->stream, src.raw(), src.dtype(), dst.data<float>(), src.numel());
  }
}

void CudaBackend::set_precise(bool exact) {
  impl_->exact_half = exact;
}
bool CudaBackend::precise() const {
  return impl_->exact_half;
}

void CudaBackend::write(Tensor& dst, const void* src, size_t bytes) {
  OpScope scope_(*impl_, "write");
  if (!dst.defined() || dst.device().kind != kDev || bytes != dst.nbytes())
    fail("write", std::to_string(bytes) + " bytes for " + (dst.defined() ? dst.str() : "an undefined tensor"));
  // From pageable memory: returns once the bytes are staged, so src may change right after.
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src, bytes, cudaMemcpyHostToDevice, impl_->stream));
}

namespace {
class CudaGraph : public Backend::Graph {
 public:
  CudaGraph(CudaBackend::Impl& m, cudaGraphExec_t exec, std::shared_ptr<GraphPool> pool, std::vector<Tensor> keep)
      : m_(m), exec_(exec), pool_(std::move(pool)), keep_(std::move(keep)) {}
  ~CudaGraph() override {
    cudaStreamSynchronize(m_.stream);
    cudaGraphExecDestroy(exec_);
  }
  void replay() override {
    m_.bind();
    CUDA_CHECK(cudaGraphLaunch(exec_, m_.stream));
  }

 private:
  CudaBackend::Impl& m_;
  cudaGraphExec_t exec_;
  std::shared_ptr<GraphPool> pool_;  // after exec_ in destruction order: freed once the graph is gone
  std::vector<Tensor> keep_;
};
}  // namespace

std::unique_ptr<Backend::Graph> CudaBackend::capture(const std::function<void()>& fn) {
  auto& m = *impl_;
  m.bind();
  if (m.capturing()) throw std::logic_error("capture: a graph is already being recorded");
  auto pool = std::make_shared<GraphPool>();
  std::vector<Tensor> keep;
  if (m.half_x.defined()) keep.push_back(m.half_x);
  m.mem->set_pool(pool);
  m.capture_keep = &keep;
  set_graph_recording(true);
  auto finish = [&] {
    set_graph_recording(false);
    m.capture_keep = nullptr;
    m.mem->set_pool(nullptr);
  };
  CUDA_CHECK(cudaStreamBeginCapture(m.stream, cudaStreamCaptureModeRelaxed));
  cudaGraph_t g = nullptr;
  try {
    fn();
  } catch (...) {
    // A sync (host round trip) inside fn fails under capture: end it, clear the error, no graph.
    (void)cudaStreamEndCapture(m.stream, &g);
    if (g) cudaGraphDestroy(g);
    (void)cudaGetLastError();
    finish();
    return nullptr;
  }
  const cudaError_t e = cudaStreamEndCapture(m.stream, &g);
  finish();
  if (e != cudaSuccess || !g) {
    (void)cudaGetLastError();
    if (g) cudaGraphDestroy(g);
    return nullptr;
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t ie = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  if (ie != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  if (m.half_x.defined()) keep.push_back(m.half_x);
  return std::make_unique<CudaGraph>(m, exec, std::move(pool), std::move(keep));
}

void CudaBackend::synchronize() {
  impl_->bind();
  CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
}

void CudaBackend::profile_reset() {
  if (impl_->prof) impl_->prof->clear();
}

// ---- dense -----------------------------------------------------------------------------------

void CudaBackend::matmul(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate) {
  OpScope scope_(*impl_, "matmul");
  check_matmul(x, w, y, kDev);
  const int64_t M = x.dim(0), K = x.dim(1), N = w.dim(0);
  if (M == 0 || N == 0) return;
  auto& m = *impl_;
  if (K == 0) {
    if (!accumulate) launch_fill(m.stream, y.data<float>(), M * N, 0.f);
    return;
  }
  // Decode-sized products stream the weights with a warp per row (f32 activations: exact in
  // precise mode too); cuBLAS takes the rest.
  if (M <= kGemvMaxRows && gemv_supported(w.dtype(), M, K, w.raw(), x.data<float>())) {
    GemvPhase ph(m, "gemv", M, K, N);
    launch_gemv(m.stream, w.raw(), w.dtype(), x.data<float>(), y.data<float>(), M, N, K, accumulate);
    return;
  }
  // Row-major y[M,N] = x[M,K] W[N,K]^T is column-major y^T[N,M] = W^T(N x K) x^T(K x M).
  if (w.dtype() == DType::F32) {
    const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
    CUBLAS_CHECK(cublasSgemm(m.blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M),
                             static_cast<int>(K), &alpha, w.data<float>(), static_cast<int>(K), x.data<float>(),
                             static_cast<int>(K), &beta, y.data<float>(), static_cast<int>(N)));
    return;
  }
  GemvPhase ph(m, "gemm", M, K, N);
  gemm_half(m, stage_half(m, x, w.dtype()), w, y, accumulate);
}

// x [M, K] rounded to a 16-bit dtype in the shared staging buffer, for cuBLAS: one part, or three
// (hi + mid + lo = x) in precise mode.
CudaBackend::HalfX CudaBackend::stage_half(Impl& m, const Tensor& x, DType dt) {
  const int64_t M = x.dim(0), K = x.dim(1), need = M * K * (m.exact_half ? 3 : 1);
  if (!m.half_x.defined() || m.half_x.numel() < need || m.half_x.dtype() != dt) {
    if (m.capturing() && m.half_x.defined()) m.capture_keep->push_back(m.half_x);  // recorded work uses it
    m.half_x = alloc_uninit(dt, {std::max<int64_t>(need, m.half_x.defined() ? m.half_x.numel() : 0)});
  }
  HalfX h;
  h.dt = dt;
  h.M = M;
  h.K = K;
  h.hi = static_cast<char*>(m.half_x.raw());
  h.mid = h.hi + static_cast<size_t>(M * K) * dtype_size(dt);
  h.lo = h.mid + static_cast<size_t>(M * K) * dtype_size(dt);
  if (m.exact_half)
    launch_split_f32(m.stream, x.data<float>(), dt, h.hi, h.mid, h.lo, M * K);
  else
    launch_convert_f32(m.stream, x.data<float>(), dt, h.hi, M * K);
  return h;
}

void CudaBackend::gemm_half(Impl& m, const HalfX& h, const Tensor& w, Tensor& y, bool accumulate) {
  const int64_t M = h.M, K = h.K, N = w.dim(0);
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  auto gemm = [&](const void* xh, const float* b) {
    CUBLAS_CHECK(cublasGemmEx(m.blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M),
                              static_cast<int>(K), &alpha, w.raw(), cuda_type(w.dtype()), static_cast<int>(K), xh,
                              cuda_type(w.dtype()), static_cast<int>(K), b, y.raw(), CUDA_R_32F, static_cast<int>(N),
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  gemm(h.hi, &beta);
  if (m.exact_half) {
    const float one = 1.f;
    gemm(h.mid, &one);
    gemm(h.lo, &one);
  }
}

void CudaBackend::matmul_many(const Tensor& x, std::initializer_list<Tensor> w, std::initializer_list<Tensor> y) {
  OpScope scope_(*impl_, "matmul");
  if (w.size() != y.size())
    fail("matmul_many", std::to_string(w.size()) + " weights for " + std::to_string(y.size()) + " outputs");
  // Decode-sized x with weights of one dtype: all products in one launch of the few-row kernel.
  bool one = w.size() <= static_cast<size_t>(kGemvMaxOutputs) && w.size() > 0 && x.defined() && x.ndim() == 2 &&
             x.dtype() == DType::F32 && x.device().kind == kDev;
  GemvOutputs o;
  if (one) {
    auto yi = y.begin();
    for (const Tensor& wt : w) {
      const Tensor& yt = *yi++;
      check_matmul(x, wt, yt, kDev);
      if (wt.dtype() != w.begin()->dtype() ||
          !gemv_supported(wt.dtype(), x.dim(0), x.dim(1), wt.raw(), x.data<float>()))
        one = false;
      o.w[o.count] = wt.raw();
      o.y[o.count] = yt.data<float>();
      o.end[o.count] = (o.count ? o.end[o.count - 1] : 0) + wt.dim(0);
      ++o.count;
    }
  }
  if (!one) {
    // Prefill-sized x with 16-bit weights of one dtype: x rounded for cuBLAS once for all products
    // (a composition's 200-row forward converted it once per weight).
    bool shared = w.size() > 1 && x.defined() && x.ndim() == 2 && x.dtype() == DType::F32 && x.device().kind == kDev &&
                  x.dim(0) > kGemvMaxRows && x.dim(1) > 0;
    for (const Tensor& wt : w)
      shared = shared && wt.defined() && wt.dtype() == w.begin()->dtype() &&
               (wt.dtype() == DType::BF16 || wt.dtype() == DType::F16);
    if (!shared) {
      auto wi = w.begin();
      for (Tensor out : y) matmul(x, *wi++, out);
      return;
    }
    auto wi = w.begin();
    for (const Tensor& out : y) check_matmul(x, *wi++, out, kDev);
    const HalfX h = stage_half(*impl_, x, w.begin()->dtype());
    wi = w.begin();
    for (Tensor out : y) {
      const Tensor& wt = *wi++;
      if (wt.dim(0) == 0) continue;
      GemvPhase ph(*impl_, "gemm", x.dim(0), x.dim(1), wt.dim(0));
      gemm_half(*impl_, h, wt, out, false);
    }
    return;
  }
  if (x.dim(1) == 0) {
    for (Tensor out : y) launch_fill(impl_->stream, out.data<float>(), out.numel(), 0.f);
    return;
  }
  GemvPhase ph(*impl_, "gemv_many", x.dim(0), x.dim(1), o.end[o.count - 1]);
  launch_gemv_many(impl_->stream, o, w.begin()->dtype(), x.data<float>(), x.dim(0), x.dim(1), false);
}

void CudaBackend::matmul_swiglu(const Tensor& x, const Tensor& gate, const Tensor& up, Tensor& h) {
  OpScope scope_(*impl_, "matmul");
  check_matmul(x, gate, h, kDev);
  check_matmul(x, up, h, kDev);
  const int64_t M = x.dim(0), K = x.dim(1), N = gate.dim(0);
  if (M > kGemvMaxRows || K == 0 || N == 0 || gate.dtype() != up.dtype() ||
      !gemv_supported(gate.dtype(), M, K, gate.raw(), x.data<float>()) ||
      !gemv_supported(up.dtype(), M, K, up.raw(), x.data<float>())) {
    Backend::matmul_swiglu(x, gate, up, h);
    return;
  }
  GemvPhase ph(*impl_, "gemv_swiglu", M, K, 2 * N);
  launch_gemv_swiglu(impl_->stream, gate.raw(), up.raw(), gate.dtype(), x.data<float>(), h.data<float>(), M, N, K);
}

void CudaBackend::embedding(const Tensor& table, std::span<const int32_t> ids, Tensor& out) {
  OpScope scope_(*impl_, "embedding");
  check_embedding(table, ids, out, kDev);
  const int64_t H = table.dim(1), n = static_cast<int64_t>(ids.size());
  if (n == 0) return;
  Tensor d = upload(ids.data(), DType::I32, n);
  launch_embedding(impl_->stream, table.raw(), table.dtype(), d.data<int32_t>(), n, H, out.data<float>());
}

void CudaBackend::embedding(const Tensor& table, const Tensor& ids, Tensor& out) {
  OpScope scope_(*impl_, "embedding");
  need_float("embedding", "table", table, kDev);
  need_f32("embedding", "out", out, kDev);
  need_def("embedding", "ids", ids, kDev);
  if (ids.dtype() != DType::I32 || ids.ndim() != 1 || table.ndim() != 2)
    fail("embedding", "ids " + ids.str() + " and table " + table.str() + ": expected i32[n] and [V, H]");
  need_shape("embedding", "out", out, {ids.dim(0), table.dim(1)});
  if (ids.dim(0) == 0) return;
  launch_embedding(impl_->stream, table.raw(), table.dtype(), ids.data<int32_t>(), ids.dim(0), table.dim(1),
                   out.data<float>());
}

// ---- elementwise and norms -------------------------------------------------------------------

void CudaBackend::rms_norm(const Tensor& x, const Tensor& w, float eps, bool one_plus_w, Tensor& out) {
  OpScope scope_(*impl_, "rms_norm");
  check_rms_norm(x, nullptr, w, out, kDev);
  const int64_t D = last_dim(x), R = rows_of(x);
  launch_rms_norm(impl_->stream, x.data<float>(), w.raw(), w.dtype(), eps, one_plus_w, out.data<float>(), R, D);
}

void CudaBackend::rms_norm_gated(const Tensor& x, const Tensor& z, const Tensor& w, float eps, Tensor& out) {
  OpScope scope_(*impl_, "rms_norm_gated");
  check_rms_norm(x, &z, w, out, kDev);
  const int64_t D = last_dim(x), R = rows_of(x);
  launch_rms_norm_gated(impl_->stream, x.data<float>(), z.data<float>(), w.raw(), w.dtype(), eps, out.data<float>(), R,
                        D);
}

void CudaBackend::add(const Tensor& a, const Tensor& b, Tensor& out) {
  OpScope scope_(*impl_, "add");
  check_binary("add", "a", a, "b", b, out, kDev);
  launch_binary(impl_->stream, BinOp::Add, a.data<float>(), b.data<float>(), out.data<float>(), a.numel());
}
void CudaBackend::add_rms_norm(Tensor& x, const Tensor& d, const Tensor& w, float eps, bool one_plus_w, Tensor& out) {
  OpScope scope_(*impl_, "add_rms_norm");
  check_binary("add_rms_norm", "x", x, "d", d, x, kDev);
  check_rms_norm(x, nullptr, w, out, kDev);
  launch_add_rms_norm(impl_->stream, x.data<float>(), d.data<float>(), w.raw(), w.dtype(), eps, one_plus_w,
                      out.data<float>(), rows_of(x), last_dim(x));
}
void CudaBackend::silu_mul(const Tensor& gate, const Tensor& up, Tensor& out) {
  OpScope scope_(*impl_, "silu_mul");
  check_binary("silu_mul", "gate", gate, "up", up, out, kDev);
  launch_binary(impl_->stream, BinOp::SiluMul, gate.data<float>(), up.data<float>(), out.data<float>(), gate.numel());
}
void CudaBackend::sigmoid_mul(const Tensor& x, const Tensor& gate, Tensor& out) {
  OpScope scope_(*impl_, "sigmoid_mul");
  if (check_sigmoid_mul(x, gate, out, kDev))
    launch_sigmoid_mul_rows(impl_->stream, x.data<float>(), gate.data<float>(), out.data<float>(), rows_of(x),
                            last_dim(x));
  else
    launch_binary(impl_->stream, BinOp::SigmoidMul, x.data<float>(), gate.data<float>(), out.data<float>(), x.numel());
}

void CudaBackend::copy_cols(const Tensor& src, int64_t col, Tensor& dst) {
  OpScope scope_(*impl_, "copy_cols");
  check_cols("copy_cols", src, dst, col, "src", "dst", kDev);
  if (last_dim(dst) == 0) return;
  launch_copy_cols(impl_->stream, src.raw(), last_dim(src), col, dst.raw(), last_dim(dst), 0, rows_of(dst),
                   last_dim(dst), dtype_size(src.dtype()));
}

void CudaBackend::set_cols(const Tensor& src, int64_t col, Tensor& dst) {
  OpScope scope_(*impl_, "set_cols");
  check_cols("set_cols", dst, src, col, "dst", "src", kDev);
  if (last_dim(src) == 0) return;
  launch_copy_cols(impl_->stream, src.raw(), last_dim(src), 0, dst.raw(), last_dim(dst), col, rows_of(src),
                   last_dim(src), dtype_size(src.dtype()));
}

void CudaBackend::copy_rows(std::span<const RowCopy> pieces, int rot_dim, double theta) {
  OpScope scope_(*impl_, "copy_rows");
  check_copy_rows(pieces, rot_dim, theta, kDev);
  std::vector<cuda::RowPiece> tab;
  int64_t total = 0;
  bool rotate = false;
  for (const auto& p : pieces) {
    if (p.rows == 0) continue;
    const int64_t rb = static_cast<int64_t>(p.src->nbytes()) / p.src->dim(0);
    if (rb % 4 != 0) fail("copy_rows", "rows of " + p.src->str() + " are not a whole number of 4-byte words");
    cuda::RowPiece r;
    r.src = static_cast<const char*>(p.src->raw()) + p.src_row * rb;
    r.dst = static_cast<char*>(p.dst->raw()) + p.dst_row * rb;
    r.words = rb / 4;
    r.rows = p.rows;
    r.first = total;
    r.shift = p.rope_shift;
    r.head_dim = p.dst->ndim() == 3 ? p.dst->dim(2) : r.words;
    rotate = rotate || p.rope_shift != 0;
    total += p.rows;
    tab.push_back(r);
  }
  if (tab.empty()) return;
  const float* f = rotate ? inv_freq(rot_dim, theta) : nullptr;
  Tensor d = upload(tab.data(), DType::U8, static_cast<int64_t>(tab.size() * sizeof(cuda::RowPiece)));
  launch_copy_rows(impl_->stream, reinterpret_cast<const cuda::RowPiece*>(d.raw()), static_cast<int>(tab.size()), total,
                   f, rotate ? rot_dim / 2 : 0);
}

// ---- positions -------------------------------------------------------------------------------

const float* CudaBackend::inv_freq(int rot_dim, double theta) {
  auto& m = *impl_;
  auto key = std::make_pair(rot_dim, theta);
  auto it = m.inv_freq.find(key);
  if (it == m.inv_freq.end()) {
    if (m.capturing()) throw std::logic_error("rope_neox: first use of a rotary table while recording a graph");
    // As transformers (and the CPU backend): 1 / theta ** (2i / rot) in f32.
    const int half = rot_dim / 2;
    std::vector<float> f(static_cast<size_t>(half));
    const float th = static_cast<float>(theta);
    for (int i = 0; i < half; ++i) {
      const float e = static_cast<float>(2 * i) / static_cast<float>(rot_dim);
      f[i] = 1.0f / static_cast<float>(std::pow(static_cast<double>(th), static_cast<double>(e)));
    }
    it = m.inv_freq.emplace(key, upload(f.data(), DType::F32, half)).first;
  }
  return it->second.data<float>();
}

void CudaBackend::rope_neox(Tensor& x, std::span<const int64_t> positions, int rot_dim, double theta) {
  OpScope scope_(*impl_, "rope_neox");
  check_rope(x, positions.size(), rot_dim, theta, kDev);
  const int64_t T = x.dim(0), H = x.dim(1), D = x.dim(2);
  if (T == 0) return;
  const float* f = inv_freq(rot_dim, theta);
  Tensor pos = upload(positions.data(), DType::I64, T);
  launch_rope_neox(impl_->stream, x.data<float>(), T, H, D, pos.data<int64_t>(), f, rot_dim / 2);
}

void CudaBackend::rope_neox(Tensor& x, const Tensor& positions, int rot_dim, double theta) {
  OpScope scope_(*impl_, "rope_neox");
  const int64_t T = x.ndim() > 0 ? x.dim(0) : 0;
  check_rope(x, static_cast<size_t>(T), rot_dim, theta, kDev);
  check_step_table("rope_neox", "positions", positions, T, kDev);
  if (T == 0) return;
  launch_rope_neox(impl_->stream, x.data<float>(), T, x.dim(1), x.dim(2), positions.data<int64_t>(),
                   inv_freq(rot_dim, theta), rot_dim / 2);
}

// ---- attention -------------------------------------------------------------------------------

void CudaBackend::attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t kv_len, int64_t q_offset,
                            float scale, Tensor& out) {
  OpScope scope_(*impl_, "attention");
  check_attention(q, k, v, kv_len, q_offset, out, kDev);
  const int64_t T = q.dim(0), Hq = q.dim(1), D = q.dim(2), Hkv = k.dim(1), Dv = v.dim(2);
  if (T == 0) return;
  // Prefill-sized spans on the tensor cores; decode steps and precise mode in f32 (key-split).
  if (!impl_->exact_half && T >= 16) return flash(q, k, v, kv_len, q_offset, nullptr, scale, out);
  Tensor part = alloc_uninit(DType::F32, {attention_part_floats(T, Hq, Dv, kv_len)});
  launch_attention(impl_->stream, q.data<float>(), k.data<float>(), v.data<float>(), T, Hq, Hkv, D, Dv, kv_len,
                   q_offset, scale, out.data<float>(), part.data<float>());
}

void CudaBackend::flash(const Tensor& q, const Tensor& k, const Tensor& v, int64_t kv_len, int64_t q_offset,
                        const int64_t* qpos, float scale, Tensor& out) {
  const int64_t T = q.dim(0), Hq = q.dim(1), D = q.dim(2), Hkv = k.dim(1), Dv = v.dim(2);
  // Few rows over many keys (a composition's seams, a question) would leave most of the GPU idle:
  // the keys are then split across blocks and the partial sums merged.
  const cuda::FlashPlan plan =
      cuda::flash_attention_plan(T, Hq, Hkv, kv_len, qpos != nullptr, impl_->prop.multiProcessorCount);
  Tensor part =
      plan.splits > 1 ? alloc_uninit(DType::F32, {cuda::split_part_floats(T, Hq, Dv, plan.splits)}) : Tensor();
  float* pp = plan.splits > 1 ? part.data<float>() : nullptr;
  // The cache is f32 (the CPU's convention): the keys and values this span sees are rounded to
  // bf16 once per call (kv_len rows, cheap next to the T x kv_len products) so that the kernel
  // can stream them with cp.async instead of converting every tile in every block.
  if (flash_attention_kv16(D, Dv) && kv_len > 0) {
    std::optional<PhaseScope> ph(std::in_place, *impl_, "attention/kv_to_bf16");
    Tensor kh = alloc_uninit(DType::BF16, {kv_len * Hkv * D}), vh = alloc_uninit(DType::BF16, {kv_len * Hkv * Dv});
    launch_convert_f32(impl_->stream, k.data<float>(), DType::BF16, kh.raw(), kv_len * Hkv * D);
    launch_convert_f32(impl_->stream, v.data<float>(), DType::BF16, vh.raw(), kv_len * Hkv * Dv);
    ph.emplace(*impl_, "attention/flash");
    launch_flash_attention(impl_->stream, plan, q.data<float>(), kh.raw(), vh.raw(), true, T, Hq, Hkv, D, Dv, kv_len,
                           q_offset, qpos, scale, out.data<float>(), pp);
    return;
  }
  launch_flash_attention(impl_->stream, plan, q.data<float>(), k.data<float>(), v.data<float>(), false, T, Hq, Hkv, D,
                         Dv, kv_len, q_offset, qpos, scale, out.data<float>(), pp);
}

void CudaBackend::attention_spans(const Tensor& q, const Tensor& k, const Tensor& v, std::span<const RowSpan> spans,
                                  float scale, Tensor& out) {
  OpScope scope_(*impl_, "attention");
  std::vector<int64_t> pos;
  pos.reserve(static_cast<size_t>(q.ndim() > 0 ? q.dim(0) : 0));
  bool forward = true;
  for (const auto& sp : spans) {
    if (sp.rows < 0 || sp.pos0 < 0 || (sp.rows > 0 && !pos.empty() && sp.pos0 <= pos.back())) forward = false;
    for (int64_t t = 0; t < sp.rows; ++t) pos.push_back(sp.pos0 + t);
  }
  // Short or out-of-order runs, and the precise mode: one call per span (the base class).
  if (impl_->exact_half || pos.size() < 16 || !forward || spans.size() == 1)
    return Backend::attention_spans(q, k, v, spans, scale, out);
  const int64_t kv_len = pos.back() + 1;
  check_attention(q, k, v, kv_len, 0, out, kDev);
  if (static_cast<int64_t>(pos.size()) != q.dim(0))
    fail("attention_spans",
         "spans cover " + std::to_string(pos.size()) + " rows, q " + q.str() + " has " + std::to_string(q.dim(0)));
  Tensor dpos = upload(pos.data(), DType::I64, static_cast<int64_t>(pos.size()));
  flash(q, k, v, kv_len, 0, dpos.data<int64_t>(), scale, out);
}

// ---- linear-attention layer pieces -----------------------------------------------------------

void CudaBackend::causal_conv1d_silu(const Tensor& x, const Tensor& w, Tensor& state, Tensor& out) {
  OpScope scope_(*impl_, "causal_conv1d_silu");
  check_conv1d(x, w, state, out, kDev);
  const int64_t T = x.dim(0), C = x.dim(1), K = w.dim(-1);
  launch_causal_conv1d_silu(impl_->stream, x.data<float>(), w.raw(), w.dtype(), state.data<float>(), out.data<float>(),
                            T, C, K);
}

void CudaBackend::causal_conv1d_silu_spans(const Tensor& x, const Tensor& w, std::span<const ConvSpan> spans,
                                           Tensor& state, std::span<Tensor> out_cols) {
  OpScope scope_(*impl_, "causal_conv1d_silu");
  check_conv1d_spans(x, w, spans, state, out_cols, kDev);
  const int64_t C = x.dim(1), K = w.dim(-1);
  if (out_cols.size() > 3) return Backend::causal_conv1d_silu_spans(x, w, spans, state, out_cols);
  cuda::ColSplit out = cuda::ColSplit::whole(out_cols[0].data<float>(), C);
  if (out_cols.size() > 1) {
    out.end0 = out_cols[0].dim(1);
    out.p1 = out_cols[1].data<float>();
    out.end1 = out.end0 + out_cols[1].dim(1);
    out.p2 = out_cols.size() > 2 ? out_cols[2].data<float>() : out.p1;  // two blocks: the third is empty
  }
  // Groups of rows that continue one another; each span with an `after` ends one, and the next
  // starts from that tensor.
  std::vector<cuda::ConvGroup> groups;
  const float* start = state.data<float>();
  int64_t row0 = 0, rows = 0;
  for (const auto& sp : spans) {
    rows += sp.rows;
    if (sp.after) {
      if (rows > 0) groups.push_back({row0, rows, start});
      row0 += rows;
      rows = 0;
      start = sp.after->data<float>();
    }
  }
  if (rows > 0) groups.push_back({row0, rows, start});
  if (groups.size() == 1 && groups[0].row0 == 0) {  // one continued conv (a prefill span): the tiled kernel
    launch_conv1d_rows(impl_->stream, x.data<float>(), w.raw(), w.dtype(), groups[0].start, out, x.dim(0), C, K);
  } else if (!groups.empty()) {
    Tensor d = upload(groups.data(), DType::U8, static_cast<int64_t>(groups.size() * sizeof(cuda::ConvGroup)));
    launch_conv1d_spans(impl_->stream, x.data<float>(), w.raw(), w.dtype(),
                        reinterpret_cast<const cuda::ConvGroup*>(d.raw()), static_cast<int>(groups.size()), out,
                        x.dim(0), C, K);
  }
  // The state after the last span: its `after`, or the last K-1 inputs of the open group.
  if (rows > 0)
    launch_conv1d_state(impl_->stream, x.data<float>() + row0 * C, start, state.data<float>(), rows, C, K);
  else if (start != state.data<float>() && state.nbytes())
    CUDA_CHECK(cudaMemcpyAsync(state.raw(), start, state.nbytes(), cudaMemcpyDeviceToDevice, impl_->stream));
}

void CudaBackend::gdn_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, Tensor& g,
                            Tensor& beta) {
  OpScope scope_(*impl_, "gdn_gates");
  check_gdn_gates(a, b, A_log, dt_bias, g, beta, kDev);
  const int64_t T = a.dim(0), H = a.dim(1);
  launch_gdn_gates(impl_->stream, a.data<float>(), b.data<float>(), A_log.raw(), A_log.dtype(), dt_bias.raw(),
                   dt_bias.dtype(), g.data<float>(), beta.data<float>(), T, H);
}

void CudaBackend::gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                   const Tensor& beta, bool l2norm_qk, Tensor& state, Tensor& out, Tensor* transition) {
  OpScope scope_(*impl_, "gated_delta_rule");
  check_gated_delta_rule(q, k, v, g, beta, state, out, transition, kDev);
  const int64_t T = q.dim(0), Hk = q.dim(1), dk = q.dim(2), Hv = v.dim(1), dv = v.dim(2);
  float* tr = transition && transition->defined() ? transition->data<float>() : nullptr;
  // Long spans take the chunked form (tensor-friendly, parallel over chunks); decode steps and
  // short seams stay on the token recurrence, which has no workspace and fewer launches.
  // Outside precise mode, on the tensor cores where the shape allows (bf16 operands, f32 state).
  if (T >= kGdnChunkedMin && !impl_->gdn_token_only && !impl_->gdn_f32_chunks && !impl_->exact_half &&
      gated_delta_chunked_tc_supported(q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(), dk, dv)) {
    const int64_t bytes = gated_delta_chunked_tc_workspace_bytes(T, Hv, dk, dv);
    Tensor ws = alloc_uninit(DType::F32, {(bytes + 3) / 4});
    launch_gated_delta_rule_chunked_tc(impl_->stream, q.data<float>(), k.data<float>(), v.data<float>(),
                                       g.data<float>(), beta.data<float>(), l2norm_qk, T, Hk, Hv, dv,
                                       state.data<float>(), out.data<float>(), tr, ws.raw());
    return;
  }
  if (T >= kGdnChunkedMin && !impl_->gdn_token_only &&
      gated_delta_chunked_supported(q.data<float>(), k.data<float>(), dk, dv)) {
    Tensor ws = alloc_uninit(DType::F32, {gated_delta_chunked_workspace_floats(T, Hv, dk, dv)});
    launch_gated_delta_rule_chunked(impl_->stream, q.data<float>(), k.data<float>(), v.data<float>(), g.data<float>(),
                                    beta.data<float>(), l2norm_qk, T, Hk, Hv, dk, dv, state.data<float>(),
                                    out.data<float>(), tr, ws.data<float>());
    return;
  }
  launch_gated_delta_rule(impl_->stream, q.data<float>(), k.data<float>(), v.data<float>(), g.data<float>(),
                          beta.data<float>(), l2norm_qk, T, Hk, Hv, dk, dv, state.data<float>(), out.data<float>(), tr);
}

void CudaBackend::gated_delta_chain(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                    const Tensor& beta, bool l2norm_qk, Tensor& state, Tensor& out,
                                    std::span<const GdnLink> links) {
  OpScope scope_(*impl_, "gated_delta_chain");
  check_gated_delta_rule(q, k, v, g, beta, state, out, nullptr, kDev);
  const int64_t T = q.dim(0), Hk = q.dim(1), dk = q.dim(2), Hv = v.dim(1), dv = v.dim(2);
  auto shape_is = [&](const Tensor* t, const char* what, Shape want, bool bf16_ok = false) {
    const bool dtype_ok = t->dtype() == DType::F32 || (bf16_ok && t->dtype() == DType::BF16);
    if (!t->defined() || !dtype_ok || t->device().kind != DeviceKind::CUDA || t->shape() != want)
      fail("gated_delta_chain", std::string(what) + " " + t->str() + ": expected f32" + (bf16_ok ? " or bf16" : "") +
                                    shape_str(want) + " on cuda");
  };
  // A long span takes the chunked kernel: then the span ops one by one.
  for (const auto& L : links)
    if (L.rows >= kGdnChunkedMin && !impl_->gdn_token_only)
      return Backend::gated_delta_chain(q, k, v, g, beta, l2norm_qk, state, out, links);
  std::vector<cuda::GdnChainLink> tab;
  tab.reserve(links.size());
  int64_t rows = 0;
  bool aligned_t = true;  // every T 16-byte aligned: the kernel may stage T whole with cp.async
  for (const auto& L : links) {
    if (L.rows < 0) fail("gated_delta_chain", "a link of " + std::to_string(L.rows) + " rows");
    cuda::GdnChainLink c;
    c.rows = L.rows;
    rows += L.rows;
    if (L.rk) {
      if (!L.rv || !L.rg || !L.rbeta) fail("gated_delta_chain", "a replayed body without all its inputs");
      const int64_t n = L.rk->ndim() > 0 ? L.rk->dim(0) : 0;
      shape_is(L.rk, "replayed keys", {n, Hk, dk});
      shape_is(L.rv, "replayed values", {n, Hv, dv});
      shape_is(L.rg, "replayed decays", {n, Hv});
      shape_is(L.rbeta, "replayed betas", {n, Hv});
      c.replay_rows = n;
      c.rk = L.rk->data<float>(), c.rv = L.rv->data<float>(), c.rg = L.rg->data<float>();
      c.rbeta = L.rbeta->data<float>();
    }
    if (L.T) {
      // f32 or bf16 (entries store dense T in bf16 outside precise mode: docs/pic.md).
      shape_is(L.T, "T", {Hv, dk, dk}, /*bf16_ok=*/true);
      c.t_bf16 = L.T->dtype() == DType::BF16;
      c.T = L.T->raw();
      aligned_t = aligned_t && (reinterpret_cast<uintptr_t>(c.T) & 15) == 0 && (!c.t_bf16 || dk % 8 == 0);
    }
    if (L.B) shape_is(L.B, "B", {Hv, dk, dv}), c.B = L.B->data<float>();
    tab.push_back(c);
  }
  if (rows != T)
    fail("gated_delta_chain",
         "links cover " + std::to_string(rows) + " rows, q " + q.str() + " has " + std::to_string(T));
  if (tab.empty()) return;
  Tensor dtab = upload(tab.data(), DType::U8, static_cast<int64_t>(tab.size() * sizeof(cuda::GdnChainLink)));
  cuda::launch_gated_delta_chain(impl_->stream, q.data<float>(), k.data<float>(), v.data<float>(), g.data<float>(),
                                 beta.data<float>(), l2norm_qk, Hk, Hv, dk, dv, state.data<float>(), out.data<float>(),
                                 reinterpret_cast<const cuda::GdnChainLink*>(dtab.raw()), static_cast<int>(tab.size()),
                                 aligned_t);
}

// ---- decode steps ----------------------------------------------------------------------------

void CudaBackend::causal_conv1d_silu_step(const Tensor& x, const Tensor& w, const Tensor& states, Tensor& out) {
  OpScope scope_(*impl_, "causal_conv1d_silu");
  check_conv1d_step(x, w, states, out, kDev);
  launch_conv1d_step(impl_->stream, x.data<float>(), w.raw(), w.dtype(), states.data<int64_t>(), out.data<float>(),
                     x.dim(0), x.dim(1), w.dim(1));
}

void CudaBackend::gated_delta_rule_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                        const Tensor& beta, bool l2norm_qk, const Tensor& states, Tensor& out) {
  OpScope scope_(*impl_, "gated_delta_rule");
  check_gated_delta_rule_step(q, k, v, g, beta, states, out, kDev);
  launch_gated_delta_rule_step(impl_->stream, q.data<float>(), k.data<float>(), v.data<float>(), g.data<float>(),
                               beta.data<float>(), l2norm_qk, q.dim(0), q.dim(1), v.dim(1), q.dim(2), v.dim(2),
                               states.data<int64_t>(), out.data<float>());
}

void CudaBackend::attention_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& caches,
                                 const Tensor& positions, float scale, Tensor& out) {
  OpScope scope_(*impl_, "attention");
  check_attention_step(q, k, v, caches, positions, out, kDev);
  const int64_t B = q.dim(0), Hq = q.dim(1), Hkv = k.dim(1), D = q.dim(2), Dv = v.dim(2);
  if (B == 0) return;
  launch_kv_write(impl_->stream, k.data<float>(), v.data<float>(), caches.data<int64_t>(), positions.data<int64_t>(), B,
                  Hkv, D, Dv);
  Tensor part = alloc_uninit(DType::F32, {attention_step_part_floats(B, Hq, Hkv, Dv)});
  launch_attention_step(impl_->stream, q.data<float>(), caches.data<int64_t>(), positions.data<int64_t>(), B, Hq, Hkv,
                        D, Dv, scale, out.data<float>(), part.data<float>());
}

void CudaBackend::sample_rows(const Tensor& x, const Tensor& params, const Tensor& mask, Tensor& ids) {
  OpScope scope_(*impl_, "sample_rows");
  check_sample_rows(x, params, mask, ids, kDev);
  launch_sample_rows(impl_->stream, x.data<float>(), x.dim(0), x.dim(1), params.data<float>(),
                     mask.defined() ? mask.data<uint8_t>() : nullptr, ids.data<int32_t>());
}

void CudaBackend::argmax_rows(const Tensor& x, Tensor& ids) {
  OpScope scope_(*impl_, "argmax_rows");
  need_f32("argmax_rows", "x", x, kDev);
  need_def("argmax_rows", "ids", ids, kDev);
  need_ndim("argmax_rows", "x", x, 2);
  if (ids.dtype() != DType::I32 || ids.ndim() != 1 || ids.dim(0) != x.dim(0))
    fail("argmax_rows", "ids " + ids.str() + ": expected i32[" + std::to_string(x.dim(0)) + "]");
  if (x.dim(1) == 0) fail("argmax_rows", "x " + x.str() + " has empty rows");
  launch_argmax_rows(impl_->stream, x.data<float>(), x.dim(0), x.dim(1), ids.data<int32_t>());
}

// ---- segment summaries -----------------------------------------------------------------------

void CudaBackend::compose_state(const Tensor& T, const Tensor& S, const Tensor& B, float alpha, Tensor& out) {
  OpScope scope_(*impl_, "compose_state");
  check_compose_state(T, S, B, out, kDev);
  const int64_t H = T.dim(0), dk = T.dim(1), dv = S.dim(2);
  if (H == 0 || dk == 0 || dv == 0) return;
  if (T.dtype() != DType::F32) {  // a bf16 T (entries outside precise mode): composed in f32
    Tensor t = alloc_uninit(DType::F32, T.shape());
    convert(T, t);
    compose_state(t, S, B, alpha, out);
    return;
  }
  if (dk == 1 && S.dim(1) != 1) {  // T [H, 1, 1]: a scaled identity per head
    launch_compose_scaled(impl_->stream, T.data<float>(), S.data<float>(), B.data<float>(), alpha, out.data<float>(), H,
                          S.dim(1) * dv);
    return;
  }
  copy(B, out);
  // Row-major out_h[dk,dv] += alpha T_h S_h is column-major out_h^T = alpha S_h^T T_h^T + out_h^T.
  const float beta = 1.f;
  CUBLAS_CHECK(cublasSgemmStridedBatched(impl_->blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(dv),
                                         static_cast<int>(dk), static_cast<int>(dk), &alpha, S.data<float>(),
                                         static_cast<int>(dv), dk * dv, T.data<float>(), static_cast<int>(dk), dk * dk,
                                         &beta, out.data<float>(), static_cast<int>(dv), dk * dv, static_cast<int>(H)));
}

// ---- the other families: recurrences and the Mamba2 / MiniMax layer pieces ----------------------

namespace {
// The arguments of the recurrence kernel that a span and a batch of runs share.
LinearRecurrenceArgs recurrence_args(const char* op, const Backend::Recurrence& r, const Tensor& q, const Tensor& k,
                                     const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& log_gamma,
                                     Tensor& out) {
  // The token kernel keeps a column of S in registers.
  if (q.dim(2) > kLinearRecurrenceMaxDk)
    fail(op, "key head dim " + std::to_string(q.dim(2)) + " of q " + q.str() + " above " +
                 std::to_string(kLinearRecurrenceMaxDk) + " is not supported on cuda");
  const linear::FamilyTraits tr = linear::traits(r.family);
  LinearRecurrenceArgs a;
  a.q = q.data<float>();
  a.k = k.data<float>();
  a.v = v.data<float>();
  a.g = g.defined() ? g.data<float>() : nullptr;
  a.beta = beta.defined() ? beta.data<float>() : nullptr;
  a.log_gamma = log_gamma.defined() ? log_gamma.data<float>() : nullptr;
  a.decay = static_cast<int>(tr.decay);
  a.delta = tr.delta;
  a.l2norm = r.l2norm_qk;
  a.q_scale = r.q_scale;
  a.T = q.dim(0);
  a.Hk = q.dim(1);
  a.Hv = v.dim(1);
  a.dk = q.dim(2);
  a.dv = v.dim(2);
  a.out = out.data<float>();
  return a;
}
}  // namespace

void CudaBackend::linear_recurrence(const Recurrence& r, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& g, const Tensor& beta, const Tensor& log_gamma, Tensor& state,
                                    Tensor& out, Tensor* transition) {
  OpScope scope_(*impl_, "linear_recurrence");
  check_linear_recurrence(r, q, k, v, g, beta, log_gamma, state, out, transition, kDev);
  LinearRecurrenceArgs a = recurrence_args("linear_recurrence", r, q, k, v, g, beta, log_gamma, out);
  a.state = state.data<float>();
  if (transition && transition->defined()) {
    // [Hv, 1, 1] against dk != 1: the factor of a scaled identity (as the shared check reads it).
    const bool scaled = transition->dim(1) == 1 && a.dk != 1;
    (scaled ? a.t_factor : a.transition) = transition->data<float>();
  }
  launch_linear_recurrence(impl_->stream, a);
}

namespace {
// Device tables of a batch of runs: the rows' prefix sums [runs + 1] and the states' addresses.
struct RunTables {
  std::vector<int64_t> row0;
  std::vector<uintptr_t> state;
  int64_t max_run = 0;
};
RunTables run_tables(const char* op, std::span<Tensor* const> states, std::span<const int64_t> rows,
                     const Shape& state_shape, int64_t total) {
  if (states.size() != rows.size())
    fail(op, std::to_string(states.size()) + " states for " + std::to_string(rows.size()) + " runs");
  RunTables t;
  t.row0.push_back(0);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0 || !states[i]) fail(op, "run " + std::to_string(i) + " has no state or negative rows");
    need_f32(op, "state", *states[i], kDev);
    need_shape(op, "state", *states[i], state_shape);
    t.row0.push_back(t.row0.back() + rows[i]);
    t.state.push_back(reinterpret_cast<uintptr_t>(states[i]->data<float>()));
    t.max_run = std::max(t.max_run, rows[i]);
  }
  if (t.row0.back() != total)
    fail(op, "runs of " + std::to_string(t.row0.back()) + " rows for " + std::to_string(total) + " rows of input");
  return t;
}
}  // namespace

void CudaBackend::linear_recurrence_runs(const Recurrence& r, const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& g, const Tensor& beta, const Tensor& log_gamma,
                                         std::span<Tensor* const> states, std::span<const int64_t> rows, Tensor& out) {
  OpScope scope_(*impl_, "linear_recurrence_runs");
  if (states.empty()) fail("linear_recurrence_runs", "no runs");
  // Shapes as one span of all rows against the first state; every state of that shape.
  check_linear_recurrence(r, q, k, v, g, beta, log_gamma, *states[0], out, nullptr, kDev);
  const RunTables t = run_tables("linear_recurrence_runs", states, rows, states[0]->shape(), q.dim(0));
  LinearRecurrenceArgs a = recurrence_args("linear_recurrence_runs", r, q, k, v, g, beta, log_gamma, out);
  Tensor row0 = upload(t.row0.data(), DType::I64, static_cast<int64_t>(t.row0.size()));
  Tensor addr = upload(t.state.data(), DType::I64, static_cast<int64_t>(t.state.size()));
  a.runs = static_cast<int64_t>(rows.size());
  a.max_run = t.max_run;
  a.run_rows = row0.data<int64_t>();
  a.run_states = reinterpret_cast<float* const*>(addr.data<int64_t>());
  launch_linear_recurrence(impl_->stream, a);
}

void CudaBackend::causal_conv1d_bias_silu_runs(const Tensor& x, const Tensor& w, const Tensor& bias,
                                               std::span<Tensor* const> states, std::span<const int64_t> rows,
                                               Tensor& out) {
  OpScope scope_(*impl_, "causal_conv1d_bias_silu_runs");
  if (states.empty()) fail("causal_conv1d_bias_silu_runs", "no runs");
  check_conv_bias(x, w, bias, *states[0], out, kDev);
  const RunTables t = run_tables("causal_conv1d_bias_silu_runs", states, rows, states[0]->shape(), x.dim(0));
  Tensor row0 = upload(t.row0.data(), DType::I64, static_cast<int64_t>(t.row0.size()));
  Tensor addr = upload(t.state.data(), DType::I64, static_cast<int64_t>(t.state.size()));
  launch_conv1d_bias_silu_runs(impl_->stream, x.data<float>(), w.data<float>(), bias.data<float>(),
                               reinterpret_cast<float* const*>(addr.data<int64_t>()), row0.data<int64_t>(),
                               static_cast<int64_t>(rows.size()), t.max_run, out.data<float>(), x.dim(1), w.dim(1));
}

void CudaBackend::causal_conv1d_bias_silu(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& state,
                                          Tensor& out) {
  OpScope scope_(*impl_, "causal_conv1d_bias_silu");
  check_conv_bias(x, w, bias, state, out, kDev);
  const int64_t T = x.dim(0), C = x.dim(1), K = w.dim(1);
  if (T == 0 || C == 0) return;
  launch_conv1d_bias_silu(impl_->stream, x.data<float>(), w.data<float>(), bias.data<float>(), state.data<float>(),
                          out.data<float>(), T, C, K);
}

void CudaBackend::mamba2_gates(const Tensor& dt_raw, const Tensor& x, const Tensor& A, const Tensor& dt_bias,
                               float dt_min, Tensor& g, Tensor& v) {
  OpScope scope_(*impl_, "mamba2_gates");
  check_mamba2_gates(dt_raw, x, A, dt_bias, g, v, kDev);
  launch_mamba2_gates(impl_->stream, dt_raw.data<float>(), x.data<float>(), A.data<float>(), dt_bias.data<float>(),
                      dt_min, g.data<float>(), v.data<float>(), x.dim(0), x.dim(1), x.dim(2));
}

void CudaBackend::mamba2_gated_norm(const Tensor& y, const Tensor& x, const Tensor& z, const Tensor& D, const Tensor& w,
                                    int64_t groups, float eps, Tensor& out) {
  OpScope scope_(*impl_, "mamba2_gated_norm");
  check_mamba2_gated_norm(y, x, z, D, w, groups, out, kDev);
  const int64_t C = y.dim(1);
  launch_mamba2_gated_norm(impl_->stream, y.data<float>(), x.data<float>(), z.data<float>(), D.data<float>(),
                           w.data<float>(), eps, out.data<float>(), y.dim(0), C, C / D.dim(0), groups);
}

void CudaBackend::kda_gates(const Tensor& a, const Tensor& b, const Tensor& A, const Tensor& dt_bias, Tensor& g,
                            Tensor& beta) {
  OpScope scope_(*impl_, "kda_gates");
  check_kda_gates(a, b, A, dt_bias, g, beta, kDev);
  launch_kda_gates(impl_->stream, a.data<float>(), b.data<float>(), A.data<float>(), dt_bias.data<float>(),
                   g.data<float>(), beta.data<float>(), a.dim(0), a.dim(1), a.dim(2));
}

void CudaBackend::scale_add(const Tensor& x, float a, const Tensor& y, float b, Tensor& out) {
  OpScope scope_(*impl_, "scale_add");
  check_binary("scale_add", "x", x, "y", y, out, kDev);
  launch_scale_add(impl_->stream, x.data<float>(), a, y.data<float>(), b, out.data<float>(), x.numel());
}

void CudaBackend::activate(Activation act, Tensor& x) {
  OpScope scope_(*impl_, "activate");
  need_f32("activate", "x", x, kDev);
  launch_activate(impl_->stream, act == Activation::Silu ? 0 : 1, x.data<float>(), x.numel());
}

void CudaBackend::set_identity(Tensor& t) {
  OpScope scope_(*impl_, "set_identity");
  check_set_identity(t, kDev);
  launch_set_identity(impl_->stream, t.data<float>(), t.dim(0), t.dim(1));
}

// ---- mixture of experts ----------------------------------------------------------------------
// Routing runs on the device (softmax, top-k, ranks in token order); only the E expert counts come
// back to the host, which sizes the padded batch. The used experts' rows are gathered into one
// buffer [experts used, rows of the busiest, H], and each projection is ONE batched cuBLAS product
// over all of them (pointer arrays: any weight layout); a combine kernel then sums every token's
// top-k outputs with their weights. A layer is about ten launches whatever the expert count; the
// price is the padding of less busy experts.
void CudaBackend::moe_experts(const Tensor& x, const Tensor& router_logits, const MoeRouter& router,
                              const ExpertWeights& experts, Tensor& out) {
  OpScope scope_(*impl_, "moe_experts");
  run_moe(x, router_logits, router, experts, out, nullptr, nullptr, false);
}

void CudaBackend::moe_experts_add(const Tensor& xn, const Tensor& router_logits, int top_k, bool norm_topk,
                                  const ExpertWeights& experts, const Tensor& shared, const Tensor& shared_gate,
                                  Tensor& x) {
  OpScope scope_(*impl_, "moe_experts");
  check_moe_shared(shared, shared_gate, x, kDev);
  MoeRouter router;
  router.top_k = top_k;
  router.norm_topk = norm_topk;
  run_moe(xn, router_logits, router, experts, x, shared.defined() ? shared.data<float>() : nullptr,
          shared.defined() ? shared_gate.data<float>() : nullptr, true);
}

void CudaBackend::run_moe(const Tensor& x, const Tensor& router_logits, const MoeRouter& router,
                          const ExpertWeights& experts, Tensor& out, const float* shared, const float* shared_gate,
                          bool residual) {
  const cuda::MoeTail tail{shared, shared_gate, residual};
  const int64_t I = check_moe(x, router_logits, router, experts, out, kDev);
  const int64_t T = x.dim(0), H = x.dim(1), E = router_logits.dim(1);
  const int top_k = router.top_k;
  const bool norm_topk = router.norm_topk;
  const bool relu2 = experts.gate.empty();  // ReLU^2 experts: the few-slot kernels and cuBLAS below
  const DType wdt = experts.up[0].dtype();
  auto& m = *impl_;
  if (T == 0) return;
  Tensor sel = alloc_uninit(DType::I32, {T * top_k}), dw = alloc_uninit(DType::F32, {T * top_k}),
         rank = alloc_uninit(DType::I32, {T * top_k}), counts = alloc_uninit(DType::I32, {E});
  const cuda::SigmoidRouter sig{router.bias.defined() ? router.bias.data<float>() : nullptr,
                                static_cast<int>(router.n_group), static_cast<int>(router.topk_group), router.scaling};
  // Few slots (decode): every slot reads its expert's rows directly, no counts come back to the host;
  // routing and the slots' order by expert in one launch (softmax) or two (sigmoid).
  if (T * top_k <= kMoeGemvMaxSlots) {
    if (const void* const* tab = expert_table(experts, H, I)) {
      const int64_t n = T * top_k;
      Tensor order = alloc_uninit(DType::I32, {n}), hs = alloc_uninit(DType::F32, {n, I}),
             ys = alloc_uninit(DType::F32, {n, H});
      if (router.sigmoid) {
        launch_moe_route_sigmoid(m.stream, router_logits.data<float>(), T, E, top_k, norm_topk, sig,
                                 sel.data<int32_t>(), dw.data<float>(), rank.data<int32_t>(), counts.data<int32_t>());
        launch_moe_order(m.stream, sel.data<int32_t>(), rank.data<int32_t>(), counts.data<int32_t>(), E, n,
                         order.data<int32_t>(), nullptr, nullptr);
      } else {
        launch_moe_route_order(m.stream, router_logits.data<float>(), T, E, top_k, norm_topk, sel.data<int32_t>(),
                               dw.data<float>(), rank.data<int32_t>(), counts.data<int32_t>(), order.data<int32_t>());
      }
      launch_moe_gemv(m.stream, wdt, relu2 ? nullptr : tab, tab + E, tab + 2 * E, x.data<float>(), sel.data<int32_t>(),
                      order.data<int32_t>(), n, top_k, H, I, hs.data<float>(), ys.data<float>());
      launch_moe_combine(m.stream, ys.data<float>(), nullptr, dw.data<float>(), T, top_k, H, out.data<float>(), tail);
      return;
    }
  }
  {
    PhaseScope ph(m, "moe_experts/route");
    if (router.sigmoid)
      launch_moe_route_sigmoid(m.stream, router_logits.data<float>(), T, E, top_k, norm_topk, sig, sel.data<int32_t>(),
                               dw.data<float>(), rank.data<int32_t>(), counts.data<int32_t>());
    else
      launch_moe_route(m.stream, router_logits.data<float>(), T, E, top_k, norm_topk, sel.data<int32_t>(),
                       dw.data<float>(), rank.data<int32_t>(), counts.data<int32_t>());
  }
  // Up to a few thousand slots (a PIC composition's rows, larger decode batches): the grouped
  // tensor-core kernels, sized on the device, so nothing comes back to the host.
  if (!relu2 && T * top_k <= kMoeGroupedMaxSlots && moe_grouped_enabled() && !m.exact_half &&
      (experts.gate[0].dtype() == DType::BF16 || experts.gate[0].dtype() == DType::F16)) {
    if (const void* const* tab = expert_table(experts, H, I)) {
      const int64_t n = T * top_k;
      Tensor order = alloc_uninit(DType::I32, {n}), offs = alloc_uninit(DType::I32, {E}),
             pos = alloc_uninit(DType::I32, {n}), hs = alloc_uninit(DType::F32, {n, I}),
             ys = alloc_uninit(DType::F32, {n, H});
      launch_moe_order(m.stream, sel.data<int32_t>(), rank.data<int32_t>(), counts.data<int32_t>(), E, n,
                       order.data<int32_t>(), offs.data<int32_t>(), pos.data<int32_t>());
      const DType wd = experts.gate[0].dtype();
      std::optional<PhaseScope> ph(std::in_place, m, "moe_experts/grouped gate+up");
      launch_moe_grouped(m.stream, wd, true, x.data<float>(), order.data<int32_t>(), offs.data<int32_t>(),
                         counts.data<int32_t>(), tab, tab + E, E, top_k, H, I, hs.data<float>());
      ph.emplace(m, "moe_experts/grouped down");
      launch_moe_grouped(m.stream, wd, false, hs.data<float>(), order.data<int32_t>(), offs.data<int32_t>(),
                         counts.data<int32_t>(), tab + 2 * E, nullptr, E, top_k, I, H, ys.data<float>());
      ph.emplace(m, "moe_experts/combine");
      launch_moe_combine(m.stream, ys.data<float>(), pos.data<int32_t>(), dw.data<float>(), T, top_k, H,
                         out.data<float>(), tail);
      return;
    }
  }
  // Prefill-sized batches: the grouped GEMM over slots sorted by expert, sized on the device
  // (no padding to the busiest expert, no gathered copy, no sync). Measured level with cuBLAS's
  // padded batches (35B-A3B 32k prefill 1.461 vs 1.449 s) and less memory; cuBLAS's batched
  // products below stay for f32 weights, precise mode and HYPIC_MOE_GROUPED=0.
  if (!relu2 && moe_grouped_enabled() && !m.exact_half && H % 8 == 0 && I % 8 == 0 &&
      (experts.gate[0].dtype() == DType::BF16 || experts.gate[0].dtype() == DType::F16)) {
    if (const void* const* tab = expert_table(experts, H, I)) {
      const int64_t n = T * top_k;
      const DType wd = experts.gate[0].dtype();
      Tensor order = alloc_uninit(DType::I32, {n}), offs = alloc_uninit(DType::I32, {E}),
             pos = alloc_uninit(DType::I32, {n}), tiles = alloc_uninit(DType::I32, {E + 1}),
             x16 = alloc_uninit(wd, {T, H}), hs = alloc_uninit(wd, {n, I}), ys = alloc_uninit(DType::F32, {n, H});
      std::optional<PhaseScope> ph(std::in_place, m, "moe_experts/order+convert");
      launch_moe_order(m.stream, sel.data<int32_t>(), rank.data<int32_t>(), counts.data<int32_t>(), E, n,
                       order.data<int32_t>(), offs.data<int32_t>(), pos.data<int32_t>());
      launch_moe_tiles(m.stream, counts.data<int32_t>(), E, tiles.data<int32_t>());
      launch_convert_f32(m.stream, x.data<float>(), wd, x16.raw(), T * H);
      ph.emplace(m, "moe_experts/gemm gate+up");
      launch_moe_gemm(m.stream, wd, true, x16.raw(), order.data<int32_t>(), offs.data<int32_t>(),
                      counts.data<int32_t>(), tiles.data<int32_t>(), E, n, tab, tab + E, top_k, H, I, hs.raw());
      ph.emplace(m, "moe_experts/gemm down");
      launch_moe_gemm(m.stream, wd, false, hs.raw(), order.data<int32_t>(), offs.data<int32_t>(),
                      counts.data<int32_t>(), tiles.data<int32_t>(), E, n, tab + 2 * E, nullptr, top_k, I, H, ys.raw());
      ph.emplace(m, "moe_experts/combine");
      launch_moe_combine(m.stream, ys.data<float>(), pos.data<int32_t>(), dw.data<float>(), T, top_k, H,
                         out.data<float>(), tail);
      return;
    }
  }
  std::optional<PhaseScope> ph(std::in_place, m, "moe_experts/counts+index");
  Tensor hc = to_host(counts);
  std::vector<int64_t> used;
  std::vector<int32_t> batch_of(static_cast<size_t>(E), 0);
  int64_t maxn = 0;
  for (int64_t e = 0; e < E; ++e)
    if (const int32_t c = hc.data<int32_t>()[e]; c > 0) {
      batch_of[static_cast<size_t>(e)] = static_cast<int32_t>(used.size());
      used.push_back(e);
      maxn = std::max<int64_t>(maxn, c);
    }
  const int64_t B = static_cast<int64_t>(used.size());
  Tensor dbatch = upload(batch_of.data(), DType::I32, E);
  Tensor drows = alloc_uninit(DType::I32, {B * maxn}), dpos = alloc_uninit(DType::I32, {T * top_k});
  CUDA_CHECK(cudaMemsetAsync(drows.raw(), 0xff, drows.nbytes(), m.stream));  // -1: padding rows
  launch_moe_index(m.stream, sel.data<int32_t>(), rank.data<int32_t>(), dbatch.data<int32_t>(), T, top_k, maxn,
                   drows.data<int32_t>(), dpos.data<int32_t>());
  // With 16-bit experts (default mode) the rows are gathered straight into the products' input
  // dtype, once for gate and up; precise mode keeps them f32 for the split products.
  const DType wd = wdt;
  const bool half_in = !m.exact_half && (wd == DType::BF16 || wd == DType::F16);
  Tensor xs = alloc_uninit(half_in ? wd : DType::F32, {B * maxn, H}), gs = alloc_uninit(DType::F32, {B * maxn, I}),
         us = relu2 ? Tensor() : alloc_uninit(DType::F32, {B * maxn, I}), ds = alloc_uninit(DType::F32, {B * maxn, H});
  ph.emplace(m, "moe_experts/gather");
  if (half_in)
    launch_gather_rows_half(m.stream, x.data<float>(), drows.data<int32_t>(), wd, xs.raw(), B * maxn, H);
  else
    launch_gather_rows(m.stream, x.data<float>(), drows.data<int32_t>(), xs.data<float>(), B * maxn, H);
  auto pick = [&](const std::vector<Tensor>& w) {
    std::vector<const Tensor*> p;
    for (int64_t e : used) p.push_back(&w[static_cast<size_t>(e)]);
    return p;
  };
  ph.emplace(m, "moe_experts/gate+up");
  if (relu2) {
    batched_matmul(xs, pick(experts.up), maxn, gs);
    launch_activate(m.stream, 1, gs.data<float>(), gs.numel());  // ReLU^2
  } else {
    batched_matmul(xs, pick(experts.gate), maxn, gs);
    batched_matmul(xs, pick(experts.up), maxn, us);
    launch_binary(m.stream, BinOp::SiluMul, gs.data<float>(), us.data<float>(), gs.data<float>(), gs.numel());
  }
  ph.emplace(m, "moe_experts/down");
  batched_matmul(gs, pick(experts.down), maxn, ds);
  ph.emplace(m, "moe_experts/combine");
  launch_moe_combine(m.stream, ds.data<float>(), dpos.data<int32_t>(), dw.data<float>(), T, top_k, H, out.data<float>(),
                     tail);
}

// The device pointer table of a MoE layer's experts, or null where the few-slot kernels cannot
// take them (mixed dtypes, sizes not a multiple of 8, unaligned rows).
const void* const* CudaBackend::expert_table(const ExpertWeights& experts, int64_t H, int64_t I) {
  auto& m = *impl_;
  const size_t E = experts.up.size();
  const bool relu2 = experts.gate.empty();  // the gate slots then repeat up (never read)
  if (E == 0 || H % 8 != 0 || I % 8 != 0) return nullptr;
  const DType dt = experts.up[0].dtype();
  if (dt != DType::BF16 && dt != DType::F16 && dt != DType::F32) return nullptr;
  std::vector<const void*> host(3 * E);
  for (size_t e = 0; e < E; ++e) {
    const Tensor* w[3] = {relu2 ? &experts.up[e] : &experts.gate[e], &experts.up[e], &experts.down[e]};
    for (int j = 0; j < 3; ++j) {
      if (w[j]->dtype() != dt || (reinterpret_cast<uintptr_t>(w[j]->raw()) & 15u) != 0) return nullptr;
      host[j * E + e] = w[j]->raw();
    }
  }
  auto& entry = m.expert_tables[host[0]];
  if (entry.host != host) {
    entry.dev = upload(host.data(), DType::I64, static_cast<int64_t>(host.size()));
    entry.host = std::move(host);
  }
  return reinterpret_cast<const void* const*>(entry.dev.raw());
}

// y[b*M .. (b+1)*M) = x[b*M .. (b+1)*M) w[b]^T for every b, one cuBLAS batched call (three in precise
// mode, over the split parts of x). All w[b] share one dtype and shape [N, K].
void CudaBackend::batched_matmul(const Tensor& x, const std::vector<const Tensor*>& w, int64_t M, Tensor& y) {
  auto& m = *impl_;
  const int64_t B = static_cast<int64_t>(w.size());
  if (B == 0 || M == 0) return;
  const int64_t K = x.dim(1), N = y.dim(1);
  const DType wd = w[0]->dtype();
  const float alpha = 1.f, zero = 0.f, one = 1.f;
  // x may already be in the weights' 16-bit dtype (rounded by the caller): used as it is.
  const bool pre = x.dtype() == wd && wd != DType::F32;
  if (!pre && x.dtype() != DType::F32)
    throw std::logic_error("batched_matmul: x is " + std::string(dtype_name(x.dtype())) + ", weights " +
                           std::string(dtype_name(wd)));
  const int parts = wd == DType::F32 || pre ? 1 : m.exact_half ? 3 : 1;
  const size_t es = dtype_size(wd);
  Tensor xh = pre ? x : Tensor();
  if (wd != DType::F32 && !pre) {
    xh = alloc_uninit(wd, {parts * B * M * K});
    char* p0 = static_cast<char*>(xh.raw());
    if (parts == 3)
      launch_split_f32(m.stream, x.data<float>(), wd, p0, p0 + B * M * K * es, p0 + 2 * B * M * K * es, B * M * K);
    else
      launch_convert_f32(m.stream, x.data<float>(), wd, p0, B * M * K);
  }
  // Pointer arrays [A..., X..., Y...] for each part, uploaded in one copy.
  std::vector<const void*> ptr(static_cast<size_t>(3 * B * parts));
  for (int p = 0; p < parts; ++p)
    for (int64_t b = 0; b < B; ++b) {
      const size_t o = static_cast<size_t>(3 * B * p);
      ptr[o + b] = w[static_cast<size_t>(b)]->raw();
      ptr[o + B + b] = wd == DType::F32 ? static_cast<const void*>(x.data<float>() + b * M * K)
                                        : static_cast<const char*>(xh.raw()) + (p * B * M * K + b * M * K) * es;
      ptr[o + 2 * B + b] = y.data<float>() + b * M * N;
    }
  Tensor dptr = upload(ptr.data(), DType::I64, static_cast<int64_t>(ptr.size()));
  for (int p = 0; p < parts; ++p) {
    void** base = reinterpret_cast<void**>(dptr.data<int64_t>()) + 3 * B * p;
    const float* beta = p == 0 ? &zero : &one;
    if (wd == DType::F32) {
      CUBLAS_CHECK(cublasSgemmBatched(m.blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M),
                                      static_cast<int>(K), &alpha, reinterpret_cast<const float* const*>(base),
                                      static_cast<int>(K), reinterpret_cast<const float* const*>(base + B),
                                      static_cast<int>(K), beta, reinterpret_cast<float* const*>(base + 2 * B),
                                      static_cast<int>(N), static_cast<int>(B)));
    } else {
      CUBLAS_CHECK(cublasGemmBatchedEx(
          m.blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M), static_cast<int>(K), &alpha, base,
          cuda_type(wd), static_cast<int>(K), base + B, cuda_type(wd), static_cast<int>(K), beta, base + 2 * B,
          CUDA_R_32F, static_cast<int>(N), static_cast<int>(B), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
  }
}

}  // namespace hypic::cuda
