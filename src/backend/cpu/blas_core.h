// Which kernels OpenBLAS runs. Debian's OpenBLAS is a DYNAMIC_ARCH build: when the library loads it
// picks its kernels from the CPU's family and model, and virtual machines that report a generic
// model ("Intel(R) Xeon(R) Processor") make it fall back to Prescott (SSE3) kernels: sgemm 4-5x
// slower on an AVX-512 core (docs/perf-notes.md, "OpenBLAS kernels"). It reads OPENBLAS_CORETYPE
// only at load time, before main, so a program corrects the choice by running itself again with
// the variable set.
#pragma once

namespace hypic::cpu {

// The kernel family OpenBLAS should use on this CPU (by its instruction sets) when the one it
// picked is older, else nullptr (right already, OPENBLAS_CORETYPE set by the user, or unknown).
const char* openblas_better_core();

// The core OpenBLAS runs now (openblas_get_corename()).
const char* openblas_core();

// The kernel family this CPU's instruction sets allow ("SkylakeX", "Haswell"), or nullptr.
const char* openblas_cpu_core();

// openblas_cpu_core() when OpenBLAS runs an older family than that (e.g. an OPENBLAS_CORETYPE set in
// the environment, which hypic leaves standing), else nullptr: for reports that say so.
const char* openblas_held_back();

// For main(): when openblas_better_core() names a family, sets OPENBLAS_CORETYPE to it and
// re-executes this program (/proc/self/exe, same arguments and pid). Returns when there is
// nothing to do or the re-execution failed (the program then runs on the kernels it has).
void reexec_for_openblas_core(char** argv);

}  // namespace hypic::cpu
