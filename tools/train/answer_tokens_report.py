#!/usr/bin/env python3
"""Where a model's answers go wrong, token by token: teacher-forced greedy accuracy at each position
of the gold answers of an examples JSONL (rag_tasks.py output), and what the model puts first
instead of the gold's first token (the question's first entity, another capitalised name of the
prompt, or something else). Written for first-hop questions (rag_tasks.py --first-hop), whose answers
are invented names of ~3.4 tokens: are they lost at retrieval (the first token) or at copying (the
rest, given the first)? The gold is spelled as train.py trains name answers, with a leading space (the
documents' tokens; train.NAME_LEAD); --bare scores the spelling without it, which models trained
before the forty-second session were taught. CPU is enough (python3-torch 1.13).

Usage:
    python3 tools/tasks/rag_tasks.py --task twohop --first-hop --n 100 --seed 7001 --min-docs 4 \\
        --max-docs 16 --min-doc-tokens 100 --max-doc-tokens 400 > hop1.jsonl
    python3 tools/train/answer_tokens_report.py --model models/default --data hop1.jsonl --n 40
"""
import argparse
import json
import os
import re
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tasks"))
import hybrid  # noqa: E402
import train as T  # noqa: E402
from eval_rag import prompt_ids  # noqa: E402

NOT_NAMES = {"The", "Records", "It", "As", "Everyone", "Some", "Nobody", "A", "An", "Question", "Answer"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="examples JSONL (the first gold answer is scored)")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bare", action="store_true", help="score the gold without train.NAME_LEAD")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = os.path.join(args.model, "tokenizer.json")
    enc, _, _ = T.load_tokenizer(tok if os.path.exists(tok) else os.path.join(HERE, "tokenizer", "tokenizer.json"))
    exs = [json.loads(line) for line in open(args.data)][: args.n]
    if not exs:
        raise SystemExit(f"--data {args.data}: no examples")
    model = hybrid.load_folder(args.model)
    lead = "" if args.bare else T.NAME_LEAD
    per_pos, whole, ranks, lens = {}, 0, [], []
    first = {"gold": 0, "first entity": 0, "another name": 0, "other": 0}
    with torch.no_grad():
        for ex in exs:
            p = prompt_ids(enc, ex["segments"])
            a = enc([lead + ex["answers"][0]])[0]
            lens.append(len(a))
            lg = model(torch.tensor([p + a]))[0, len(p) - 1: len(p) + len(a) - 1]
            ok = [int(x == y) for x, y in zip(lg.argmax(-1).tolist(), a)]
            for i, o in enumerate(ok):
                per_pos.setdefault(i, []).append(o)
            whole += all(ok)
            top = int(lg[0].argmax())
            ranks.append(int((lg[0] > lg[0, a[0]]).sum()))
            names = set(re.findall(r"\b[A-Z][a-z]+\b", " ".join(ex["segments"][1:-1]))) - NOT_NAMES
            e1 = ex.get("meta", {}).get("first")
            if top == a[0]:
                first["gold"] += 1
            elif e1 and top == enc([lead + e1])[0][0]:
                first["first entity"] += 1
            elif top in {enc([lead + nm])[0][0] for nm in names}:
                first["another name"] += 1
            else:
                first["other"] += 1
    out = {"model": args.model, "data": args.data, "n": len(exs), "gold_spelling": repr(lead + "Name"),
           "answer_tokens_mean": round(sum(lens) / len(lens), 2),
           "teacher_forced_accuracy_by_position": {i: round(sum(v) / len(v), 3) for i, v in per_pos.items()},
           "whole_answer_right": whole, "first_token_argmax": first,
           "gold_first_token_median_rank": statistics.median(ranks)}
    print(json.dumps(out))
    print(f"{'position':>10} " + " ".join(f"{i:>6}" for i in per_pos))
    print(f"{'accuracy':>10} " + " ".join(f"{out['teacher_forced_accuracy_by_position'][i]:>6.2f}" for i in per_pos))
    print("first token: " + ", ".join(f"{k} {v}" for k, v in first.items()) +
          f"; gold's median rank {out['gold_first_token_median_rank']}")


if __name__ == "__main__":
    main()
