#!/usr/bin/env python3
"""The work of a warm request under full recompute against pic, counted in FLOPs per prompt.

A bound for the TTFT ratio full / pic that `hypic eval` and `hypic bench ttft` measure: if every row
ran at the same FLOP rate, the ratio would be this one. Counted from the model's config.json and the
prompts' token counts (`hypic tokenize --jsonl`), for a Qwen3.5-style hybrid:
  * every computed row: 2 x the parameters outside the embedding (its products), its linear layers'
    recurrence (~7 FLOPs per state element per value head) and its attention over the keys before
    it (QK and PV in every full-attention layer);
  * full recompute computes every row of the prompt;
  * pic computes each context segment's first `seam` rows after the first segment, and the question,
    at their real positions (so they attend to every key before them), and composes each cached
    segment's state in every linear layer (T S per value head: 2 dk^2 dv).
The LM head (once) and the splice of cached keys (copies) are left out on both sides.

  python3 tools/bench/pic_work.py [--model models/default] [--set moderate] [--n 30] [--seam 8]
Prints JSON and a short table.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "train"))
from eval_rag import EVAL_SETS, eval_examples  # noqa: E402  (the held-out sets, as hypic eval makes them)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models/default"))
    ap.add_argument("--hypic", default=os.path.join(ROOT, "build/hypic"))
    ap.add_argument("--set", default="moderate", choices=sorted(EVAL_SETS))
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--tasks", default="lookup,twohop,aggregate")
    a = ap.parse_args()

    cfg = json.load(open(os.path.join(a.model, "config.json")))
    cfg = cfg.get("text_config", cfg)
    info = subprocess.run([a.hypic, "info", "--model", a.model], capture_output=True, text=True, check=True).stdout
    params = int(info.split("parameters")[1].split()[0])
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    kinds = cfg["layer_types"]
    n_full = sum(k == "full_attention" for k in kinds)
    n_lin = sum(k == "linear_attention" for k in kinds)
    head_dim = cfg.get("head_dim", hidden // cfg["num_attention_heads"])
    hv, dk, dv = cfg["linear_num_value_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    per_row = 2 * (params - vocab * hidden) + n_lin * hv * 7 * dk * dv
    per_key = n_full * 2 * 2 * cfg["num_attention_heads"] * head_dim
    per_compose = n_lin * hv * 2 * dk * dk * dv

    def rows(start, count):  # FLOPs of rows at positions start .. start+count-1 (each sees itself)
        return count * per_row + per_key * (count * start + count * (count + 1) // 2)

    out = {"model": a.model, "set": a.set, "n": a.n, "seam": a.seam, "tasks": {}}
    for task in a.tasks.split(","):
        examples = eval_examples(a.set, task, a.n)
        # Every segment as the harness encodes it (with a newline), in one `hypic tokenize --jsonl`.
        texts = [s + "\n" for ex in examples for s in ex["segments"]]
        r = subprocess.run([a.hypic, "tokenize", "--model", a.model, "--jsonl"], capture_output=True, text=True,
                           check=True, input="".join(json.dumps(t) + "\n" for t in texts))
        counts = iter(len(json.loads(line)["ids"]) for line in r.stdout.splitlines())
        ratios, tokens, pic_rows = [], [], []
        for ex in examples:
            lens = [next(counts) for _ in ex["segments"]]
            n = sum(lens)
            full = rows(0, n)
            pic, pos, computed = 0, 0, 0
            for j, l in enumerate(lens[:-1]):
                seam = min(a.seam, l) if j > 0 else 0
                pic += rows(pos, seam) + (per_compose if j > 0 and seam < l else 0)
                computed += seam
                pos += l
            pic += rows(pos, lens[-1])
            computed += lens[-1]
            ratios.append(full / pic)
            tokens.append(n)
            pic_rows.append(computed)
        out["tasks"][task] = {"prompt_tokens_mean": statistics.mean(tokens), "pic_rows_mean": statistics.mean(pic_rows),
                              "flop_ratio_median": statistics.median(ratios), "flop_ratio_min": min(ratios)}
    print(json.dumps(out, indent=1))
    print(f"{'task':10} {'tokens':>7} {'pic rows':>8} {'full/pic FLOPs (median, min)':>30}")
    for t, r in out["tasks"].items():
        print(f"{t:10} {r['prompt_tokens_mean']:7.0f} {r['pic_rows_mean']:8.0f} "
              f"{r['flop_ratio_median']:20.1f}x {r['flop_ratio_min']:6.1f}x")


if __name__ == "__main__":
    main()
