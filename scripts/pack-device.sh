#!/usr/bin/env bash
# Packs what the GPU device machine needs to run a build made here (Debian 12) into one archive,
# .device/hypic-device.tar.xz: the hypic binary, the GPU test binaries and every non-system shared
# library they load (spdlog, fmt, OpenBLAS, ...), found with ldd. glibc and the CUDA libraries
# (runtime, cuBLAS) are left out: the device machine has its own, of the same CUDA version.
# Usage: scripts/pack-device.sh [build-dir]   (then carry .device; scripts/device-run.sh unpacks it)
# The tracked tree alone is close to the 64 MiB a device call may carry: pack one GPU test binary
# at a time (PACK_HYPIC=0 PACK_TOOLS=0 PACK_TESTS=ops, then =model: 3.3 and 3.9 MB), and for the
# call move tests/data/gguf/default-q4_k_m.gguf (5.9 MB, which no GPU test reads) out of the tree,
# putting it back after (thirty-seventh session: cuda_ops_test 37/37, cuda_model_test 38/38).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
out=.device
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib" "$out"
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude

# PACK_HYPIC=0 leaves the hypic binary out (a tests-only call: the carried tree's limit).
bins=()
[ "${PACK_HYPIC:-1}" = 1 ] && bins+=("$build/hypic")
# The load generator (cpp-httplib is compiled into it), for `hypic serve --backend cuda` runs there.
# PACK_TOOLS=0 leaves them out (the carried tree has a 64 MiB limit); PACK_TOOLS=hypic_rag_trace
# (a list of names) packs only those.
case "${PACK_TOOLS:-1}" in
  0) tools=() ;;
  1) tools=(hypic_loadtest hypic_rag_trace) ;;
  *) read -r -a tools <<< "$PACK_TOOLS" ;;
esac
for t in "${tools[@]}"; do [ -x "$build/tools/loadtest/$t" ] && bins+=("$build/tools/loadtest/$t"); done
# PACK_TESTS=0 leaves the GPU test binaries out (a benchmark-only call with the load tools);
# PACK_TESTS="ops model segment_workers_test" packs those (ops: cuda_ops_test, model:
# cuda_model_test, else a test binary's own name).
case "${PACK_TESTS:-1}" in
  0) ;;
  1) for t in "$build"/tests/cuda_*_test; do [ -x "$t" ] && bins+=("$t"); done ;;
  *) for t in $PACK_TESTS; do
       if [ -x "$build/tests/cuda_${t}_test" ]; then bins+=("$build/tests/cuda_${t}_test"); else bins+=("$build/tests/$t"); fi
     done ;;
esac
for b in "${bins[@]}"; do
  cp "$b" "$stage/bin/"
  strip --strip-all "$stage/bin/$(basename "$b")"
done
# The device's newer libstdc++ and libgcc_s serve binaries built against older ones.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libnvidia|libopenblas|libgfortran|libquadmath)'
# PACK_LEAN=1 also leaves out libraries the device's Ubuntu 24.04 has under the same soname (PCRE2,
# libnuma, fmt 9, UCX 1.x): ~1 MB of archive, for calls at the carried tree's limit.
[ "${PACK_LEAN:-0}" = 1 ] && skip="${skip%)}|libpcre2-8|libnuma|libfmt|libucp|libucs|libuct|libucm)"
# OpenBLAS (36 MB, with libgfortran) is left out too: the device machine has its own, and the
# archive must fit the carried tree's 64 MiB beside the test models. PACK_BLAS=1 packs it.
[ "${PACK_BLAS:-0}" = 1 ] && skip="${skip/|libopenblas|libgfortran|libquadmath/}"
for b in "${bins[@]}"; do
  ldd "$b" | awk '$3 ~ /^\// {print $1, $3}' | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    [ -e "$stage/lib/$name" ] || cp -L "$path" "$stage/lib/$name"
  done
done
# oneDNN is opened at run time (the CPU's `--activations bf16`), so ldd does not list it; PACK_DNNL=1
# packs it (7 MB compressed) with its OpenMP runtime and the OpenCL loader it links.
if [ "${PACK_DNNL:-0}" = 1 ]; then
  for name in libdnnl.so.2 libgomp.so.1 libOpenCL.so.1; do
    # (awk reads to the end: an early exit would stop ldconfig with SIGPIPE, fatal under pipefail)
    path="$(ldconfig -p | awk -v n="$name" '$1 == n && !p {p = $NF} END {print p}')"
    [ -n "$path" ] && cp -L "$path" "$stage/lib/$name"
  done
fi
# The binaries name this checkout's folder (test data, the default model) by absolute path.
pwd > "$stage/srcdir"
# xz -9e with a 256 MiB window: the binaries share their ~50 MB of GPU code, which a window wider
# than one binary stores once (4 binaries: 11 -> 7.8 MB). The carried tree has a 64 MiB limit.
rm -f "$out/hypic-device.tar.gz"
tar -C "$stage" -cf - bin lib srcdir | xz -T0 --lzma2=preset=9e,dict=256MiB > "$out/hypic-device.tar.xz"
du -h "$out/hypic-device.tar.xz"
