#!/usr/bin/env python3
"""Two-hop scores split by document order: is the relation's document (e1 -> bridge) before or after
the document that states the bridge's asked attribute? Full recompute can read the first of the two
while it prefills the second; pic prefills each alone, so a gap that sits where the relation comes
first is the cross-document reading pic gives up.

Usage (predictions of `hypic eval --task twohop --set S ... --predictions P.jsonl`):
    python3 tools/tasks/twohop_order.py P.jsonl [--set moderate]
"""
import argparse
import json
import os
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "train"))
from eval_rag import EVAL_SETS, eval_examples  # noqa: E402  (the held-out sets; torch is imported lazily there)

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("predictions")
ap.add_argument("--set", default="moderate", choices=sorted(EVAL_SETS))
args = ap.parse_args()

scores = defaultdict(dict)  # id -> config -> score
for line in open(args.predictions):
    p = json.loads(line)
    if p["task"] == "twohop":
        scores[p["id"]][p["config"]] = p["score"]
if not scores:
    sys.exit(f"{args.predictions}: no two-hop predictions")

configs = sorted({c for s in scores.values() for c in s})
n = max(int(ident.rsplit("-", 1)[1]) for ident in scores) + 1
examples = {ex["id"]: ex for ex in eval_examples(args.set, "twohop", n)}
groups = defaultdict(lambda: defaultdict(float))  # order -> config -> summed score
counts = defaultdict(int)
for ident, by_config in scores.items():
    ex = examples.get(ident)
    if ex is None:
        sys.exit(f"{ident}: not an example of the {args.set} set")
    m = ex["meta"]
    order = ("relation first" if m["link_doc"] < m["fact_doc"]
             else "same document" if m["link_doc"] == m["fact_doc"] else "attribute first")
    counts[order] += 1
    for c, s in by_config.items():
        groups[order][c] += s

print(f"{'order':16} {'prompts':>7} " + " ".join(f"{c:>12}" for c in configs))
for order in ("relation first", "attribute first", "same document"):
    if counts[order]:
        print(f"{order:16} {counts[order]:7d} " +
              " ".join(f"{100 * groups[order][c] / counts[order]:12.1f}" for c in configs))
