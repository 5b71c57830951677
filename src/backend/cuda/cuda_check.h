// Error checking for CUDA runtime and cuBLAS calls: a failure throws std::runtime_error naming the
// call that failed, the error and the source line, e.g.
//   "cudaMalloc(&p, bytes) failed: out of memory (cuda_backend.cu:81)".
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace hypic::cuda {

[[noreturn]] inline void throw_cuda(const char* call, cudaError_t e, const char* file, int line) {
  std::string f = file;
  if (auto p = f.rfind('/'); p != std::string::npos) f = f.substr(p + 1);
  throw std::runtime_error(std::string(call) + " failed: " + cudaGetErrorString(e) + " (" + f + ":" +
                           std::to_string(line) + ")");
}
[[noreturn]] inline void throw_cublas(const char* call, cublasStatus_t s, const char* file, int line) {
  std::string f = file;
  if (auto p = f.rfind('/'); p != std::string::npos) f = f.substr(p + 1);
  throw std::runtime_error(std::string(call) + " failed: " + cublasGetStatusString(s) + " (" + f + ":" +
                           std::to_string(line) + ")");
}

}  // namespace hypic::cuda

#define CUDA_CHECK(call)                                                                         \
  do {                                                                                           \
    cudaError_t hypic_e_ = (call);                                                               \
    if (hypic_e_ != cudaSuccess) ::hypic::cuda::throw_cuda(#call, hypic_e_, __FILE__, __LINE__); \
  } while (0)

#define CUBLAS_CHECK(call)                                                                                   \
  do {                                                                                                       \
    cublasStatus_t hypic_s_ = (call);                                                                        \
    if (hypic_s_ != CUBLAS_STATUS_SUCCESS) ::hypic::cuda::throw_cublas(#call, hypic_s_, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: a bad configuration is reported here, naming the kernel.
#define CUDA_LAUNCH_CHECK(name)                                                                              \
  do {                                                                                                       \
    cudaError_t hypic_e_ = cudaGetLastError();                                                               \
    if (hypic_e_ != cudaSuccess) ::hypic::cuda::throw_cuda("launch of " name, hypic_e_, __FILE__, __LINE__); \
  } while (0)
