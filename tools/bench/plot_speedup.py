#!/usr/bin/env python3
"""Speedup against builders (the combine node + workers) from segment_workers.py JSON lines, as a
small SVG (standard library only: no plotting package on the build machine).
Usage: plot_speedup.py OUT.svg LABEL=FILE.jsonl[@WORKLOAD/SCHEDULE] ...  (default even/lpt; the lone
server's row, schedule "-", starts every curve)"""
import json
import sys

W, H, L, B = 480, 320, 50, 40
out, series = sys.argv[1], [a.split("=", 1) for a in sys.argv[2:]]
curves = []
for label, spec in series:
    path, _, sel = spec.partition("@")
    workload, _, schedule = (sel or "even/lpt").partition("/")
    rows = [r for r in (json.loads(x) for x in open(path) if x.strip()) if "workload" in r]  # not run heads
    pts = sorted((r["workers"] + 1, r["speedup"]) for r in rows
                 if r["workload"] == workload and r["schedule"] in (schedule, "-"))
    curves.append((label, pts))
nmax = max(p[0] for _, pts in curves for p in pts)
x = lambda n: L + (n - 1) / max(nmax - 1, 1) * (W - L - 20)
y = lambda s: H - B - (s - 1) / max(nmax - 1, 1) * (H - B - 20)
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       f'<rect width="{W}" height="{H}" fill="white"/>',
       f'<line x1="{L}" y1="{H-B}" x2="{W-20}" y2="{H-B}" stroke="black"/>',
       f'<line x1="{L}" y1="{H-B}" x2="{L}" y2="20" stroke="black"/>',
       f'<text x="{W/2}" y="{H-8}" text-anchor="middle">builders (combine node + workers)</text>',
       f'<text x="14" y="{H/2}" transform="rotate(-90 14 {H/2})" text-anchor="middle">speedup of a cold request</text>',
       f'<line x1="{x(1)}" y1="{y(1)}" x2="{x(nmax)}" y2="{y(nmax)}" stroke="#aaa" stroke-dasharray="4"/>',
       f'<text x="{x(nmax)-4}" y="{y(nmax)+14}" text-anchor="end" fill="#888">ideal</text>']
for n in range(1, nmax + 1):
    svg.append(f'<text x="{x(n)}" y="{H-B+16}" text-anchor="middle">{n}</text>')
    svg.append(f'<text x="{L-6}" y="{y(n)+4}" text-anchor="end">{n}</text>')
colors = ["#1f77b4", "#d62728", "#2ca02c", "#999999"]
for i, (label, pts) in enumerate(curves):
    c = colors[i % len(colors)]
    svg.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="' +
               " ".join(f"{x(n):.1f},{y(s):.1f}" for n, s in pts) + '"/>')
    for n, s in pts:
        svg.append(f'<circle cx="{x(n):.1f}" cy="{y(s):.1f}" r="3" fill="{c}"/>')
        svg.append(f'<text x="{x(n)+5:.1f}" y="{y(s)-5:.1f}" fill="{c}">{s}</text>')
    svg.append(f'<text x="{L+10}" y="{30+16*i}" fill="{c}">{label}</text>')
svg.append("</svg>")
open(out, "w").write("\n".join(svg) + "\n")
