#!/usr/bin/env python3
"""Checks that pic_forward.py (the PIC prefill the fine-tuning recipe trains through) computes what
the C++ engine serves: on the same weights and token ids, hypic's pic-mode log-probs of its greedy
tokens (and their top-k alternatives) against pic_logits(), step by step; full recompute against
the plain forward as the control; and pic against full, which must differ by far more than the
tolerance on these prompts (so the check can fail).

Usage (torch 1.13+, e.g. Debian's python3-torch; no GPU needed):
    /usr/bin/python3 tools/train/check_pic_forward.py --hypic build/hypic [--model models/default]
        [--task aggregate] [--n 3] [--tol 2e-3]
Exit status 1 when a difference passes the tolerance.
"""

import argparse
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tools", "tasks"))

import rag_tasks as R  # noqa: E402
from hybrid import load_folder  # noqa: E402
from pic_forward import pic_logits, pic_logits_batch  # noqa: E402


def tokenize(hypic, model, text):
    out = subprocess.run([hypic, "tokenize", "--model", model, "--text", text, "--json"], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)["ids"]


def engine(hypic, model, segs, mode, seam, steps, k):
    """hypic's greedy tokens and, per step, {id: log-prob} of its top k."""
    req = {"segments": [{"ids": s} for s in segs]}
    path = "/tmp/hypic_check_pic_forward.json"
    with open(path, "w") as f:
        json.dump(req, f)
    out = subprocess.run([hypic, "generate", "--model", model, "--segments-file", path, "--mode", mode, "--seam",
                          str(seam), "--max-tokens", str(steps), "--logprobs", str(k), "--ignore-eos", "--json",
                          "--threads", "2"], check=True, capture_output=True, text=True).stdout
    r = json.loads(out)
    return r["ids"], [{t: lp for t, lp in step["top"]} for step in r["logprobs"]]


def worst(logits, tops):
    """Largest |log-prob difference| over each step's top-k ids."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    return max(abs(lp[i, t].item() - v) for i, top in enumerate(tops) for t, v in top.items())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hypic", default=os.path.join(REPO, "build", "hypic"))
    ap.add_argument("--model", default=os.path.join(REPO, "models", "default"))
    ap.add_argument("--task", default="aggregate")
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--tol", type=float, default=2e-3)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = load_folder(a.model).float()
    ok = True
    rows = []
    batch, singles = [], []
    with torch.no_grad():
        for i in range(a.n):
            ex = R.example(a.task, 7003, i, 2, 4, 50, 100)
            segs = [tokenize(a.hypic, a.model, s + "\n") for s in ex["segments"]]
            ids_pic, top_pic = engine(a.hypic, a.model, segs, "pic", a.seam, a.steps, a.k)
            ids_full, top_full = engine(a.hypic, a.model, segs, "full", a.seam, a.steps, a.k)
            # Teacher-forced on the engine's own greedy tokens: row j predicts step j.
            q_pic = segs[-1] + ids_pic[:-1]
            lg_pic = pic_logits(model, segs[:-1] + [q_pic], seam=a.seam)[len(segs[-1]) - 1:]
            batch.append(segs[:-1] + [q_pic])
            singles.append(lg_pic)
            flat = [t for s in segs[:-1] for t in s]
            q_full = segs[-1] + ids_full[:-1]
            lg_full = model(torch.tensor([flat + q_full]))[0, len(flat) + len(segs[-1]) - 1:]
            d_pic = worst(lg_pic, top_pic)
            d_full = worst(lg_full, top_full)
            # pic against full: the torch full forward on pic's tokens, at pic's top ids.
            lg_cross = model(torch.tensor([flat + q_pic]))[0, len(flat) + len(segs[-1]) - 1:]
            d_cross = worst(lg_cross, top_pic)
            rows.append({"example": ex["id"], "prompt_tokens": len(flat) + len(segs[-1]), "pic_vs_engine": d_pic,
                         "full_vs_engine": d_full, "pic_vs_full": d_cross})
            print(json.dumps(rows[-1]))
            ok &= d_pic <= a.tol and d_full <= a.tol
        # The batched forward the fine-tuning trains through: every prompt at once, against one by one
        # (same math, other summation orders: float32 rounding only).
        lgs = pic_logits_batch(model, batch, seam=a.seam)
        d_batch = max((torch.log_softmax(lg[len(b[-1]) - len(s):].double(), -1) - torch.log_softmax(s.double(), -1))
                      .abs().max().item() for lg, b, s in zip(lgs, batch, singles))
    print(f"batched pic forward vs one prompt at a time: {d_batch:.2e} (every id; tolerance {a.tol:g})")
    ok &= d_batch <= a.tol
    sep = max(r["pic_vs_full"] for r in rows)
    print(f"max |log-prob diff|: pic forward vs engine {max(r['pic_vs_engine'] for r in rows):.2e}, "
          f"full vs engine {max(r['full_vs_engine'] for r in rows):.2e} (tolerance {a.tol:g}); "
          f"pic vs full {sep:.2e}")
    if sep <= 10 * a.tol:
        print("pic and full agree on these prompts: the check cannot tell them apart", file=sys.stderr)
        ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
