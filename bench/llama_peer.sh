#!/usr/bin/env bash
# The llama.cpp CUDA peer of bench/gpu_compare.sh (issue 18), on the device machine:
#   prepare SHAPES...  builds llama-bench with CUDA from .peer/llama.cpp.tar.gz (scripts/pack-llama-peer.sh),
#                      writes each shape's random bf16 HF folder (tools/bench/make_hf_folder.py) and
#                      converts it to a bf16 GGUF with llama.cpp's own converter; the shapes in STRETCH
#                      (default qwen3_5_35b_a3b: 2 x 70 GB would not fit the 64 GB disk) are written and
#                      converted with one period of their layer pattern, then stretched to their real
#                      depth by tools/bench/extend_gguf.py (large tensors as zero holes: see there);
#   bench SHAPES...    runs llama-bench (-ngl 99 -fa 1 -ub 2048, medians of REPEATS) and prints JSON
#                      lines in gpu_compare's schema (peer "llama.cpp"): prefill seconds at PREFILL
#                      lengths, decode ms/token at batch 1 after CONTEXT tokens.
# Work lands in $PEER_DIR (default /tmp/hypic-peer): a warm machine keeps it between calls.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
peer="${PEER_DIR:-/tmp/hypic-peer}"
mkdir -p "$peer"
cmd="${1:?usage: llama_peer.sh prepare|bench SHAPES...}"
shift
shapes=("$@")

unpack() {
  [ -f "$peer/llama.cpp/convert_hf_to_gguf.py" ] || tar -C "$peer" -xzf "$root/.peer/llama.cpp.tar.gz"
}

build() {
  [ -x "$peer/llama.cpp/build/bin/llama-bench" ] && return
  # tools/app links the server's libraries, which LLAMA_BUILD_SERVER=OFF leaves out.
  : > "$peer/llama.cpp/app/CMakeLists.txt"
  cmake -S "$peer/llama.cpp" -B "$peer/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$peer/cmake.log"
  cmake --build "$peer/llama.cpp/build" -j"$(nproc)" --target llama-bench > "$peer/build.log"
}

gguf() {  # shape -> $peer/gguf/<shape>.gguf
  local s="$1" hf="$peer/hf/$1" out="$peer/gguf/$1.gguf"
  [ -s "$out" ] && return
  mkdir -p "$peer/gguf" "$peer/tok"
  [ -f "$peer/tok/tokenizer.json" ] || tar -C "$peer/tok" -xzf "$root/.peer/tokenizer.tar.gz"
  local cfg="bench/configs/$s.json" stretch=0
  if [[ " ${STRETCH:-qwen3_5_35b_a3b} " == *" $s "* ]]; then
    stretch=1
    cfg="$peer/$s-period.json"
    python3 - "bench/configs/$s.json" "$cfg" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
n = c["layer_types"].index("full_attention") + 1  # one period: the linear layers and a full one
c["num_hidden_layers"], c["layer_types"] = n, c["layer_types"][:n]
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
  fi
  python3 tools/bench/make_hf_folder.py --config "$cfg" --tokenizer "$peer/tok" --out "$hf"
  python3 "$peer/llama.cpp/convert_hf_to_gguf.py" "$hf" --outtype bf16 --outfile "$out.part" > "$peer/convert-$s.log" 2>&1 ||
    { tail -20 "$peer/convert-$s.log" >&2; return 1; }
  if [ "$stretch" = 1 ]; then
    local layers
    layers="$(python3 -c "import json; print(json.load(open('bench/configs/$s.json'))['num_hidden_layers'])")"
    PYTHONPATH="$peer/llama.cpp/gguf-py" python3 tools/bench/extend_gguf.py "$out.part" "$out.full" --layers "$layers" ||
      return 1
    mv "$out.full" "$out.part"
  fi
  mv "$out.part" "$out"
  [ "${KEEP_HF:-0}" = 1 ] || rm -rf "$hf"  # the device disk holds 64 GB
}

case "$cmd" in
  prepare)
    # The build (CPU, ~200 s) overlaps writing and converting the checkpoints (GPU, disk).
    unpack
    build &
    b=$!
    for s in "${shapes[@]}"; do gguf "$s"; done
    wait "$b" || { tail -30 "$peer/build.log" >&2; exit 1; }
    ;;
  bench)
    bin="$peer/llama.cpp/build/bin/llama-bench"
    reps="${REPEATS:-3}"
    for s in "${shapes[@]}"; do
      m="$peer/gguf/$s.gguf"
      [ -s "$m" ] || { echo "{\"peer\": \"llama.cpp\", \"shape\": \"$s\", \"error\": \"no GGUF (run prepare)\"}"; continue; }
      { "$bin" -m "$m" -ngl 99 -fa 1 -ub 2048 -r "$reps" -p "${PREFILL:-4096,32768}" -n 0 -o jsonl
        "$bin" -m "$m" -ngl 99 -fa 1 -ub 2048 -r "$reps" -p 0 -n "${STEPS:-32}" -d "${CONTEXT:-4096}" -o jsonl
      } 2> "$peer/bench-$s.log" | python3 -c "
import json, statistics, sys
for l in sys.stdin:
    if not l.startswith('{'): continue
    r = json.loads(l); t = statistics.median(r['samples_ns']) / 1e9
    base = dict(peer='llama.cpp', shape='$s', commit='$(cat .peer/llama.cpp.commit)', peak_device_bytes=-1)
    if r['n_gen'] == 0:
        print(json.dumps(dict(base, bench='prefill', tokens=r['n_prompt'], seconds=t)))
    else:
        print(json.dumps(dict(base, bench='decode', batch=1, context=r.get('n_depth', 0), ms_per_token=1e3 * t / r['n_gen'])))
"
    done
    ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
