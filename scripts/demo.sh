#!/usr/bin/env bash
# The main job on the bundled default model (hypic-mini, trained on the multi-document tasks of
# tools/tasks/rag_tasks.py): a multi-document (RAG) question answered twice,
# the second time with the documents in another order, as retrieval reorders them. The first
# request prefills every document in isolation and caches it; the second reuses them at their new
# positions (PIC) and computes only the seams and the question. The same request with exact
# prefix caching (--mode prefix) and full recompute (--mode full) is shown for comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
hypic=build/hypic
[ -x "$hypic" ] || { echo "build first: scripts/build.sh" >&2; exit 1; }
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT

# Prints one line of figures and the answer from generate's JSON.
read -r -d '' FORMAT <<'PY' || true
import json, sys
r = json.load(sys.stdin)
c = r["cache"]
print("%-38s TTFT %8.1f ms   segments hit/missed %d/%d   prompt tokens reused %5d, computed %5d"
      % (sys.argv[1], r["ttft_ms"], c["hit_segments"], c["miss_segments"], c["reused_tokens"], c["computed_tokens"]))
print("%-38s answer: %r" % ("", r.get("text", "").strip()))
PY

run() {  # label, extra args...
  local label=$1
  shift
  "$hypic" generate --max-tokens 16 --json "$@" 2>/dev/null | python3 -c "$FORMAT" "$label"
}

echo "question: $(python3 -c 'import json; d=json.load(open("examples/rag-request-2.json")); print(d["segments"][-1]["text"].splitlines()[0], "(expected:", d["expected_answer"] + ")")')"
echo "model: $("$hypic" info --json | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["architecture"], d["layer_map"], d["parameters"], "parameters")')"
run "request 1 (cold, pic)" --segments-file examples/rag-request-1.json --mode pic --cache-dir "$cache"
run "request 2 (documents reordered, pic)" --segments-file examples/rag-request-2.json --mode pic --cache-dir "$cache"
run "request 2, prefix caching" --segments-file examples/rag-request-2.json --mode prefix
run "request 2, full recompute" --segments-file examples/rag-request-2.json --mode full
