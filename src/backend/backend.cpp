#include "backend/backend.h"

#include <stdexcept>

#include "backend/cpu/cpu_backend.h"

namespace hypic {

std::unique_ptr<Backend> make_backend(const std::string& name, int threads) {
  if (name == "cpu") return std::make_unique<cpu::CpuBackend>(threads);
  throw std::invalid_argument("unknown backend '" + name + "' (available: cpu)");
}

}  // namespace hypic
