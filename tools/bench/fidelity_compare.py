#!/usr/bin/env python3
"""Compares two `hypic bench fidelity --json` reports of the same model and arguments, e.g. the CPU's
and the GPU's (issue 11: the drift of pic against full on the GPU must equal the CPU's within bf16
noise). Prints, per configuration, the mean and last-layer relative L2 drift, KL and top-1 agreement
of each report, and the largest per-layer gap between them; exits 1 when a gap exceeds --tol
(absolute, on relative L2) or the configurations differ.
Usage: fidelity_compare.py CPU.json GPU.json [--tol 0.01] [--names cpu,gpu]"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--tol", type=float, default=0.01)
    ap.add_argument("--names", default="cpu,gpu")
    args = ap.parse_args()
    na, nb = args.names.split(",")
    ra, rb = (json.load(open(p)) for p in (args.a, args.b))
    ca = {r["config"]: r for r in ra["results"]}
    cb = {r["config"]: r for r in rb["results"]}
    if set(ca) != set(cb):
        print(f"configurations differ: {sorted(ca)} vs {sorted(cb)}")
        return 1
    print(f"model: {ra.get('model')} / {rb.get('model')}")
    print(f"{'config':16} {'mean L2 ' + na:>13} {'mean L2 ' + nb:>13} {'last ' + na:>10} {'last ' + nb:>10} "
          f"{'KL ' + na:>10} {'KL ' + nb:>10} {'top1 ' + na:>9} {'top1 ' + nb:>9} {'max gap':>9}")
    worst = 0.0
    out = []
    for c in ca:
        x, y = ca[c]["layer_rel_l2"], cb[c]["layer_rel_l2"]
        gap = max(abs(p - q) for p, q in zip(x, y))
        worst = max(worst, gap)
        print(f"{c:16} {sum(x) / len(x):13.3e} {sum(y) / len(y):13.3e} {x[-1]:10.3e} {y[-1]:10.3e} "
              f"{ca[c]['kl']:10.2e} {cb[c]['kl']:10.2e} {ca[c]['top1_agreement']:9.3f} {cb[c]['top1_agreement']:9.3f} "
              f"{gap:9.2e}")
        out.append({"config": c, "max_layer_gap": gap})
    print(json.dumps({"max_layer_gap": worst, "tol": args.tol, "configs": out}))
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
