#!/usr/bin/env python3
"""Does a model name a two-hop question's bridge entity anywhere inside? At the position that predicts
the answer (the prompt's last token), each layer's output goes through the final norm and the tied
unembedding (a logit lens); the report gives, layer by layer, the median rank of the bridge name's
first token (spelled " Name", as the documents have it), of the question's first entity, and of the
gold value's first token, for the prompts whose greedy first answer token is right and for the others.
CPU is enough (python3-torch 1.13; ~4 minutes for 100 moderate prompts on two threads).

Usage:
    python3 tools/tasks/rag_tasks.py --task twohop --n 100 --seed 7001 --min-docs 4 --max-docs 16 \\
        --min-doc-tokens 100 --max-doc-tokens 400 > twohop.jsonl
    python3 tools/train/bridge_lens.py --model models/default --data twohop.jsonl
"""
import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tasks"))
import hybrid  # noqa: E402
import train as T  # noqa: E402
from eval_rag import prompt_ids  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="two-hop examples JSONL (rag_tasks.py --task twohop)")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = os.path.join(a.model, "tokenizer.json")
    enc, _, _ = T.load_tokenizer(tok if os.path.exists(tok) else os.path.join(HERE, "tokenizer", "tokenizer.json"))
    exs = [json.loads(line) for line in open(a.data)][: a.n]
    if not exs or any("bridge" not in ex.get("meta", {}) for ex in exs):
        raise SystemExit(f"--data {a.data}: expected two-hop examples with meta.bridge")
    model = hybrid.load_folder(a.model).eval()
    layers = model.model.layers
    outs = []
    for layer in layers:
        layer.register_forward_hook(lambda m, i, o: outs.append(o[0, -1]))
    rows = []
    with torch.no_grad():
        for ex in exs:
            first = {"bridge": enc([T.NAME_LEAD + ex["meta"]["bridge"]])[0][0],
                     "first entity": enc([T.NAME_LEAD + ex["meta"]["first"]])[0][0],
                     "value": enc([ex["answers"][0]])[0][0]}  # values are trained bare
            outs.clear()
            right = int(model(torch.tensor([prompt_ids(enc, ex["segments"])]))[0, -1].argmax()) == first["value"]
            ranks = []
            for h in outs:
                lg = model.logits(model.model.norm(h))
                ranks.append({k: int((lg > lg[t]).sum()) for k, t in first.items()})
            rows.append((right, ranks))
    report = {"model": a.model, "data": a.data, "n": len(rows), "right": sum(r for r, _ in rows), "median_rank": {}}
    print(f"{len(rows)} prompts, {report['right']} right (greedy first answer token); median rank by layer")
    print(f"{'':26s}" + "".join(f"{i:>6d}" for i in range(len(layers))))
    for k in ("bridge", "first entity", "value"):
        for grp in (True, False):
            sel = [r for ok, r in rows if ok == grp]
            if not sel:
                continue
            med = [statistics.median(x[i][k] for x in sel) for i in range(len(layers))]
            report["median_rank"][f"{k}/{'right' if grp else 'wrong'}"] = med
            print(f"{k + (' (right)' if grp else ' (wrong)'):26s}" + "".join(f"{m:6.0f}" for m in med))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
