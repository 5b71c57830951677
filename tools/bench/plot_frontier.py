#!/usr/bin/env python3
"""Score against TTFT of the training-free options, from `hypic eval --json` output, as a small SVG
(standard library only: no plotting package on the build machine). One panel per task; lines join
the seam widths, and each selective-recompute criterion's budgets, from the cheapest; full recompute
and single options (both-ends seams, naive) are points.
Usage: plot_frontier.py OUT.svg EVAL.json [EVAL.json ...]   (rows of later files add to earlier ones)"""
import json
import math
import re
import sys

out, paths = sys.argv[1], sys.argv[2:]
tasks = {}
for p in paths:
    for task, t in json.load(open(p))["tasks"].items():
        tasks.setdefault(task, {}).update({r["config"]: (r["ttft_ms_median"], r["score"]) for r in t["rows"]})


def series(rows):
    """[(label, colour, [(ttft, score, point label)], joined)]"""
    seam = sorted((int(m.group(1)), v) for c, v in rows.items() if (m := re.fullmatch(r"pic/seam=(\d+)", c)))
    out = [("pic, seam width", "#1f77b4", [(t, s, str(w)) for w, (t, s) in seam], True)]
    for by, colour in (("deviation", "#d62728"), ("recency", "#2ca02c")):
        pts = sorted((float(m.group(1)), v) for c, v in rows.items()
                     if (m := re.fullmatch(rf"pic/recompute-{by}=([0-9.]+)", c)))
        if pts and seam:  # budgets grow from plain pic at the first seam width
            pts = [(0.0, seam[0][1])] + pts
        out.append((f"recompute by {by}", colour, [(t, s, f"{f:g}") for f, (t, s) in pts], True))
    for c, label, colour in (("pic/both-ends", "both-ends seams", "#9467bd"), ("full", "full", "black"),
                             ("naive", "naive", "#8c564b")):
        if c in rows:
            out.append((label, colour, [(rows[c][0], rows[c][1], "")], False))
    return [s for s in out if s[2]]


PW, PH, L, B, T = 330, 300, 48, 44, 26
names = [t for t in ("lookup", "twohop", "aggregate") if t in tasks] + sorted(set(tasks) - {"lookup", "twohop", "aggregate"})
W, H = PW * len(names), PH + 70
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
       f'<rect width="{W}" height="{H}" fill="white"/>']
legend = {}
for k, task in enumerate(names):
    rows, ox = tasks[task], PW * k
    ss = series(rows)
    ts = [p[0] for s in ss for p in s[2]]
    lo, hi = math.log10(max(min(ts), 1e-3)), math.log10(max(ts))
    lo, hi = math.floor(lo * 2) / 2, math.ceil(hi * 2) / 2
    x = lambda t: ox + L + (math.log10(max(t, 1e-3)) - lo) / max(hi - lo, 1e-9) * (PW - L - 16)
    y = lambda s: T + (100 - s) / 100 * (PH - B - T)
    svg += [f'<text x="{ox + PW / 2}" y="16" text-anchor="middle" font-weight="bold">{task}</text>',
            f'<line x1="{ox + L}" y1="{PH - B}" x2="{ox + PW - 16}" y2="{PH - B}" stroke="black"/>',
            f'<line x1="{ox + L}" y1="{PH - B}" x2="{ox + L}" y2="{T}" stroke="black"/>',
            f'<text x="{ox + PW / 2}" y="{PH - 12}" text-anchor="middle">TTFT p50, ms (log)</text>',
            f'<text x="{ox + 12}" y="{(PH - B + T) / 2}" transform="rotate(-90 {ox + 12} {(PH - B + T) / 2})" '
            f'text-anchor="middle">score</text>']
    for s in range(0, 101, 20):
        svg.append(f'<text x="{ox + L - 5}" y="{y(s) + 4}" text-anchor="end">{s}</text>')
        svg.append(f'<line x1="{ox + L}" y1="{y(s)}" x2="{ox + PW - 16}" y2="{y(s)}" stroke="#eee"/>')
    e = lo
    while e <= hi + 1e-9:
        v = 10 ** e
        svg.append(f'<text x="{x(v)}" y="{PH - B + 15}" text-anchor="middle">{v:.0f}</text>' if v >= 10 else
                   f'<text x="{x(v)}" y="{PH - B + 15}" text-anchor="middle">{v:.2g}</text>')
        e += 0.5 if hi - lo <= 2 else 1
    for label, c, pts, joined in ss:
        legend[label] = c
        pts = sorted(pts)
        if joined and len(pts) > 1:
            svg.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="' +
                       " ".join(f"{x(t):.1f},{y(s):.1f}" for t, s, _ in pts) + '"/>')
        for t, s, tag in pts:
            shape = (f'<rect x="{x(t) - 4:.1f}" y="{y(s) - 4:.1f}" width="8" height="8" fill="{c}"/>' if not joined
                     else f'<circle cx="{x(t):.1f}" cy="{y(s):.1f}" r="2.5" fill="{c}"/>')
            svg.append(shape)
            if tag:
                svg.append(f'<text x="{x(t) + 3:.1f}" y="{y(s) - 4:.1f}" fill="{c}" font-size="9">{tag}</text>')
lx = 10
for label, c in legend.items():
    svg.append(f'<rect x="{lx}" y="{H - 24}" width="10" height="10" fill="{c}"/>')
    svg.append(f'<text x="{lx + 14}" y="{H - 15}">{label}</text>')
    lx += 14 + 7 * len(label) + 18
svg.append("</svg>")
open(out, "w").write("\n".join(svg) + "\n")
print(f"wrote {out}: {', '.join(names)}")
