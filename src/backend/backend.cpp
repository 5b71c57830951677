#include "backend/backend.h"

#include <stdexcept>

#include "backend/cpu/cpu_backend.h"
#ifdef HYPIC_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace hypic {

namespace {
// "cuda" -> 0, "cuda:3" -> 3; -1 when the name is not a cuda device.
int cuda_index(const std::string& name) {
  if (name == "cuda") return 0;
  if (name.rfind("cuda:", 0) != 0 || name.size() == 5) return -1;
  int i = 0;
  for (char c : name.substr(5)) {
    if (c < '0' || c > '9') return -1;
    i = i * 10 + (c - '0');
  }
  return i;
}
}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& name, int threads) {
  if (name == "cpu") return std::make_unique<cpu::CpuBackend>(threads);
  if (const int dev = cuda_index(name); dev >= 0) {
#ifdef HYPIC_HAVE_CUDA
    return std::make_unique<cuda::CudaBackend>(dev);
#else
    throw std::invalid_argument("backend '" + name +
                                "': this hypic was built without the CUDA backend (nvcc was not found, or "
                                "-DHYPIC_CUDA=OFF)");
#endif
  }
  throw std::invalid_argument("unknown backend '" + name + "' (available: cpu, cuda, cuda:N)");
}

std::string backend_unavailable(const std::string& name) {
  if (name == "cpu") return "";
  if (cuda_index(name) < 0) return "unknown backend '" + name + "'";
#ifdef HYPIC_HAVE_CUDA
  if (!cuda::device_available()) return "no CUDA device is visible to this process";
  return "";
#else
  return "this hypic was built without the CUDA backend";
#endif
}

}  // namespace hypic
