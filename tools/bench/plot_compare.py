#!/usr/bin/env python3
"""Plots bench/gpu_compare.sh results (JSON lines) as two bar charts: hypic's speed-up over each
peer per row (llama.cpp CUDA and transformers, where the results have them), and hypic's time over
the row's floor. Needs matplotlib (Debian: python3-matplotlib).
Usage: plot_compare.py RESULTS.jsonl OUT.png"""
import json
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    out = subprocess.run([sys.executable, "tools/bench/compare_table.py", sys.argv[1]], capture_output=True,
                         text=True, check=True).stdout.splitlines()[0]
    rows = json.loads(out)["rows"]
    labels = [f"{r['shape'].replace('qwen3_5_', '')}\n{r['row']}" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5.5))
    colors = ["#4c72b0" if "prefill" in r["row"] else "#dd8452" for r in rows]
    x = list(range(len(rows)))
    a.bar([i - 0.2 for i in x], [r.get("vs_llama_cpp") or 0 for r in rows], width=0.4, color="#55a868",
          label="vs llama.cpp CUDA (-ngl 99 -fa 1)")
    a.bar([i + 0.2 for i in x], [r["speedup"] or 0 for r in rows], width=0.4, color="#8172b2",
          label="vs transformers 5.17")
    a.axhline(1, color="k", lw=0.8)
    a.set_yscale("log")
    a.set_ylabel("peer time / hypic time (above 1: hypic ahead)")
    a.set_title("hypic --backend cuda vs its peers (H200, random bf16 weights; no bar: not run)")
    a.legend()
    b.bar(range(len(rows)), [r["of_floor"] for r in rows], color=colors)
    b.axhline(1, color="k", lw=0.8)
    b.set_yscale("log")
    b.set_ylabel("hypic time / floor")
    b.set_title("distance to the floor (FLOPs at bf16 GEMM rate, bytes at copy bandwidth)")
    for ax in (a, b):
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, rotation=70, fontsize=7)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
