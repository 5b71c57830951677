#!/usr/bin/env python3
"""Does a hypic-mini checkpoint bind values to entities? Lookup exact match split by how many facts
of the asked attribute the prompt holds (k). A model that only matches the attribute scores about
1/k; one that binds the entity scores the same for every k. Lucky numbers (one token per digit)
are counted apart. Teacher-forced (= greedy) on CPU with hybrid.py; needs only torch.

Usage: python3 tools/train/binding_report.py [--model models/default] [--n 150] [--stage 0]
  (--stage: the training curriculum stage whose prompt sizes to draw, train.STAGES)
"""

import argparse
import collections
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tools", "tasks"))
sys.path.insert(0, HERE)

import rag_tasks as R  # noqa: E402
import train as T  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(REPO, "models", "default"))
    ap.add_argument("--n", type=int, default=150)
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()

    import torch

    import hybrid as H

    tok = T.PyBPE(os.path.join(args.model, "tokenizer.json"))
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    eos = cfg["eos_token_id"]
    m = H.load_folder(args.model)
    rng = random.Random(f"binding-report/{args.seed}")
    by_k = collections.defaultdict(lambda: [0, 0])
    numbers = [0, 0]
    for _ in range(args.n):
        words = [max(8, int(round(t / R.TOKENS_PER_WORD))) for t in T.sample_doc_tokens(rng, T.STAGES[args.stage])]
        segs, qa = R.make_prompt(rng, "lookup", words)
        _, ans, _, meta = qa[0]
        k = sum(1 for x in qa if x[3]["attribute"] == meta["attribute"])
        ids = [i for s in segs for i in tok.encode(s + "\n")]
        a = tok.encode(ans) + [eos]
        with torch.no_grad():
            pred = m(torch.tensor([ids + a]))[0, len(ids) - 1: len(ids) + len(a) - 1].argmax(-1).tolist()
        ok = int(pred == a)
        if ans.isdigit():
            numbers[0] += ok
            numbers[1] += 1
        else:
            by_k[min(k, 4)][0] += ok
            by_k[min(k, 4)][1] += 1
    print(f"model {args.model}, {args.n} stage-{args.stage} lookup prompts (first question each)")
    print("same-attribute facts k | prompts | exact | attribute-only guess 1/k")
    for k, (ok, n) in sorted(by_k.items()):
        print(f"{'>=4' if k == 4 else k:>22} | {n:7d} | {ok / n:5.2f} | {1 / k:.2f}{'-' if k == 4 else ''}")
    if numbers[1]:
        print(f"{'lucky numbers':>22} | {numbers[1]:7d} | {numbers[0] / numbers[1]:5.2f} |")


if __name__ == "__main__":
    main()
