#!/usr/bin/env bash
# Segment parallelism (issue 13, docs/cluster.md): a cold PIC request of new documents on one
# hypic server, then spread over segment workers on this machine (one process each, loopback UCX),
# LPT and round-robin on an uneven workload. Prints JSON lines and a table, and with --plot an SVG
# of speedup against builders (tools/bench/segment_workers.py; its flags pass through).
# The default workload is the paper's: 11 documents of ~2.4k tokens plus a question, and with
# `--uneven paper` documents of 0.5k-6k tokens; Qwen3.5-0.8B's shape with random weights and the
# default model's tokenizer. The runs in docs/perf-notes.md:
#   this 2-core machine:   bash bench/segment_workers.sh --threads 1 --workers 0,1 --uneven paper
#   16 cores:              bash bench/segment_workers.sh --threads 2 --workers 0,1,3,7 --uneven paper
#   processes on one GPU:  bash bench/segment_workers.sh --backend cuda --config bench/configs/qwen3_5_9b.json --workers 0,1
set -euo pipefail
cd "$(dirname "$0")/.."
# Each process on its best kernels: an OPENBLAS_CORETYPE inherited from the shell (Haswell in this
# machine's environment) would hold the f32 products to AVX2 (src/backend/cpu/blas_core.h).
unset OPENBLAS_CORETYPE
exec python3 tools/bench/segment_workers.py --tokenizer models/default "$@"
