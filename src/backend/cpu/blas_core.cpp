#include "backend/cpu/blas_core.h"

#include <cblas.h>
#include <strings.h>
#include <unistd.h>

#include <cstdlib>

namespace hypic::cpu {

namespace {

// 0: SSE-era kernels, 1: AVX, 2: AVX2 + FMA, 3: AVX-512.
int rank_of(const char* core) {
  static const char* const avx512[] = {"skylakex", "cooperlake", "sapphirerapids"};
  static const char* const avx2[] = {"haswell", "zen", "excavator"};
  for (const char* c : avx512)
    if (strcasecmp(core, c) == 0) return 3;
  for (const char* c : avx2)
    if (strcasecmp(core, c) == 0) return 2;
  if (strcasecmp(core, "sandybridge") == 0 || strcasecmp(core, "bulldozer") == 0 ||
      strcasecmp(core, "piledriver") == 0 || strcasecmp(core, "steamroller") == 0)
    return 1;
  return 0;
}

}  // namespace

const char* openblas_core() {
  return openblas_get_corename();
}

const char* openblas_cpu_core() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has512 ? "SkylakeX" : has2 ? "Haswell" : nullptr;
#else
  return nullptr;
#endif
}

const char* openblas_held_back() {
  const char* cpu = openblas_cpu_core();
  const char* core = openblas_get_corename();
  if (!cpu || !core || rank_of(cpu) <= rank_of(core)) return nullptr;
  return cpu;
}

const char* openblas_better_core() {
  if (std::getenv("OPENBLAS_CORETYPE")) return nullptr;  // the user's choice, or our own re-execution
  return openblas_held_back();
}

void reexec_for_openblas_core(char** argv) {
  const char* better = openblas_better_core();
  if (!better) return;
  if (setenv("OPENBLAS_CORETYPE", better, 1) != 0) return;
  execv("/proc/self/exe", argv);
  unsetenv("OPENBLAS_CORETYPE");  // exec failed: stay on the kernels already loaded
}

}  // namespace hypic::cpu
