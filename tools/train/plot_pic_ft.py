#!/usr/bin/env python3
"""Plot a pic_finetune.py log: held-out teacher-forced answer accuracy under full recompute and pic
(top), and the training losses by mode (bottom), against seconds of training. A log that joins
several calls (a "call" field, as pic-ft-attempt5-log.jsonl) is laid end to end.

Usage: /usr/bin/python3 tools/train/plot_pic_ft.py LOG.jsonl OUT.png   (needs matplotlib)
"""

import json
import sys


def main(log_path, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(log_path)]
    # seconds laid end to end over calls; a call's "before" evaluation repeats the previous "after"
    offset, last_call, last_sec, pts, losses = 0.0, None, 0.0, [], []
    for r in rows:
        if r.get("call") != last_call:
            offset += last_sec
            last_call = r.get("call")
        last_sec = r["seconds"]
        t = offset + r["seconds"]
        if "eval" in r:
            pts.append((t, r["eval"]))
        if "pic" in r or "full" in r:
            losses.append((t, r.get("pic"), r.get("full")))
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    keys = sorted({k for _, e in pts for k in e})
    for k in keys:
        ax.plot([t for t, _ in pts], [e[k] for _, e in pts], marker="o", ms=3, lw=1.2,
                ls="-" if k.startswith("pic/") else "--", label=k)
    ax.set_ylabel("held-out teacher-forced accuracy")
    ax.set_title("PIC-aware fine-tuning of hypic-mini (tools/train/pic_finetune.py)")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)

    def smooth(v, w=9):
        out = []
        for i in range(len(v)):
            win = [x for x in v[max(0, i - w + 1):i + 1] if x is not None]
            out.append(sum(win) / len(win) if win else None)
        return out

    t = [x[0] for x in losses]
    bx.plot(t, smooth([x[1] for x in losses]), lw=1, label="answer loss, pic examples (mean of 9 steps)")
    bx.plot(t, smooth([x[2] for x in losses]), lw=1, label="answer loss, full examples (mean of 9 steps)")
    bx.set_yscale("log")
    bx.set_xlabel("seconds of training (calls laid end to end)")
    bx.set_ylabel("cross-entropy")
    bx.legend(fontsize=8)
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=90)


if __name__ == "__main__":
    main(*sys.argv[1:3])
