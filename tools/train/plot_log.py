#!/usr/bin/env python3
"""Plot a train.py log (train_log.jsonl): losses, training exact match per task, held-out checks.

Usage: python3 tools/train/plot_log.py LOG.jsonl OUT.png   (needs matplotlib)
"""

import json
import sys


def main(log_path, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(l) for l in open(log_path)]
    tr = [r for r in rows if "loss" in r]
    ho = [r for r in rows if r.get("heldout") == "moderate"]
    adv = [r for r in rows if "advance_to_stage" in r]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    x = [r["tokens_seen"] / 1e6 for r in tr]
    ax.plot(x, [r["loss"] for r in tr], lw=1, label="weighted loss (all tokens)")
    ax.plot(x, [r["answer_loss"] for r in tr], lw=1, label="answer-token loss")
    ax.set_yscale("log")
    ax.set_ylabel("cross-entropy")
    ax.set_title("hypic-mini training (tools/train/train.py)")
    step_tokens = {r["step"]: r["tokens_seen"] for r in tr}
    for r in adv:
        s = min(step_tokens, key=lambda k: abs(k - r["step"]))
        for a in (ax, bx):
            a.axvline(step_tokens[s] / 1e6, color="gray", ls=":", lw=0.8)
        ax.text(step_tokens[s] / 1e6, ax.get_ylim()[1], f" stage {r['advance_to_stage']}", fontsize=7, va="top")
    first_bind = next((r for r in tr if "bind" in r["train_em"]), None)
    if first_bind:  # attempt 3: the binding drill starts (the curriculum restarts at stage 0)
        for a in (ax, bx):
            a.axvline(first_bind["tokens_seen"] / 1e6, color="C3", ls="--", lw=0.8)
        ax.text(first_bind["tokens_seen"] / 1e6, ax.get_ylim()[0], " bind task", fontsize=7, color="C3", va="bottom")
    ax.legend(fontsize=8)
    for t, c in (("lookup", "C0"), ("twohop", "C1"), ("aggregate", "C2"), ("bind", "C3")):
        pts = [(xx, r["train_em"][t]) for xx, r in zip(x, tr) if t in r["train_em"]]
        bx.plot([p[0] for p in pts], [p[1] for p in pts], lw=0.8, color=c, alpha=0.6, label=f"{t}: training batches (EM)")
        if ho and t in ho[-1]["scores"]:
            bx.plot([r["tokens_seen"] / 1e6 for r in ho], [r["scores"][t]["em"] for r in ho], "o--", color=c, lw=1,
                    label=f"{t}: held-out moderate (EM)")
    bx.set_ylim(0, 1)
    bx.set_xlabel("tokens seen (millions, padding excluded)")
    bx.set_ylabel("teacher-forced exact match")
    bx.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
