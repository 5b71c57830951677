#!/usr/bin/env python3
"""Two-hop scores split by document order: is the relation's document (e1 -> bridge) before or after
the document that states the bridge's asked attribute? Full recompute can read the first of the two
while it prefills the second; pic prefills each alone, so a gap that sits where the relation comes
first is the cross-document reading pic gives up.

Usage (predictions of `hypic eval --task twohop ... --predictions P.jsonl`; the set's parameters must
be those the eval used, default the moderate set):
    python3 tools/tasks/twohop_order.py P.jsonl [--seed 7001 --min-docs 4 --max-docs 16 --min-tok 100 --max-tok 400]
"""
import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rag_tasks  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("predictions")
ap.add_argument("--seed", type=int, default=7001)
ap.add_argument("--min-docs", type=int, default=4)
ap.add_argument("--max-docs", type=int, default=16)
ap.add_argument("--min-tok", type=int, default=100)
ap.add_argument("--max-tok", type=int, default=400)
args = ap.parse_args()

scores = defaultdict(dict)  # id -> config -> score
for line in open(args.predictions):
    p = json.loads(line)
    if p["task"] == "twohop":
        scores[p["id"]][p["config"]] = p["score"]
if not scores:
    sys.exit(f"{args.predictions}: no two-hop predictions")

configs = sorted({c for s in scores.values() for c in s})
groups = defaultdict(lambda: defaultdict(float))  # order -> config -> summed score
counts = defaultdict(int)
for ident, by_config in scores.items():
    i = int(ident.rsplit("-", 1)[1])
    ex = rag_tasks.example("twohop", args.seed, i, args.min_docs, args.max_docs, args.min_tok, args.max_tok)
    if ex["id"] != ident:
        sys.exit(f"{ident}: not an example of seed {args.seed}")
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
