#!/usr/bin/env python3
"""Runs hypic and llama.cpp's CPU build side by side on the same GGUF files (bench/cpu_compare.sh
prepares them): prefill at each length and decode after a context, per weight type and thread
count, the two engines alternating run by run, medians of --repeats. Each run is one process over all
prefill lengths, warmed up once by an untimed run of the first length (a warm-up per length doubled
the matrix's time for nothing: the long prefills run for minutes). Prints one JSON line per
figure and a table (tokens/s, hypic / llama.cpp). --activations f32,bf16 adds hypic's bf16-activation
products (oneDNN) as a third column for the prefill figures (decode's few-row products are f32 in both).
Usage: cpu_compare.py --hypic build/hypic --llama-bench DIR/llama-bench --gguf NAME:TYPE:FILE ...
"""
import argparse
import json
import statistics
import subprocess
import sys


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]


def hypic(a, f, t, activations="f32"):
    out = {}
    for j in run([a.hypic, "bench", "prefill", "--model", f, "--lengths", a.prefill, "--threads", str(t),
                  "--repeats", "1", "--warmup", "first", "--activations", activations, "--json"]):
        out[f"prefill {j['tokens']}"] = j["tokens_per_s"]
    if activations != "f32":
        return out
    for j in run([a.hypic, "bench", "decode", "--model", f, "--context", str(a.context), "--tokens",
                  str(a.tokens), "--threads", str(t), "--repeats", "1", "--json"]):
        out[f"decode after {a.context}"] = j["tokens_per_s"]
    return out


def llama(a, f, t):
    out = {}
    base = [a.llama_bench, "-m", f, "-t", str(t), "-r", "1", "-o", "jsonl"]
    # One warm-up for the process, as hypic's `--warmup first`: llama-bench warms every test with a
    # run of its own length (an 8,192-token warm-up is minutes of a one-thread run), so its warm-up is
    # turned off and the first length runs twice; the later result of a length stands.
    lengths = a.prefill.split(",")
    for j in run(base + ["-p", ",".join(lengths[:1] + lengths), "-n", "0", "--no-warmup"]):
        out[f"prefill {j['n_prompt']}"] = j["avg_ts"]
    for j in run(base + ["-p", "0", "-n", str(a.tokens), "-d", str(a.context)]):
        out[f"decode after {a.context}"] = j["avg_ts"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hypic", required=True)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--gguf", action="append", required=True, help="NAME:TYPE:FILE")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--activations", default="f32", help="f32 or f32,bf16 (hypic's products)")
    a = ap.parse_args()
    bf16 = "bf16" in a.activations.split(",")
    rows = []
    for spec in a.gguf:
        name, wtype, f = spec.split(":", 2)
        for t in [int(x) for x in a.threads.split(",")]:
            runs = {"hypic": [], "llama.cpp": []}
            if bf16:
                runs["hypic bf16"] = []
            for r in range(a.repeats):  # alternate, so drifts of the machine fall on both engines
                order = [("hypic", hypic), ("llama.cpp", llama)]
                if bf16:
                    order.insert(1, ("hypic bf16", lambda a, f, t: hypic(a, f, t, "bf16")))
                if r % 2:
                    order.reverse()
                for eng, fn in order:
                    runs[eng].append(fn(a, f, t))
            for work in runs["hypic"][0]:
                fig = {e: statistics.median(x[work] for x in runs[e]) for e in runs if work in runs[e][0]}
                row = {"bench": "cpu_compare", "model": name, "weights": wtype, "threads": t, "work": work,
                       "hypic_tok_s": fig["hypic"], "llama_cpp_tok_s": fig["llama.cpp"],
                       "ratio": fig["hypic"] / fig["llama.cpp"], "repeats": a.repeats}
                if "hypic bf16" in fig:
                    row["hypic_bf16_tok_s"] = fig["hypic bf16"]
                    row["ratio_bf16"] = fig["hypic bf16"] / fig["llama.cpp"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    print(f"{'model':<14} {'weights':<8} {'thr':>3}  {'work':<18} {'hypic tok/s':>12} {'llama.cpp':>10} {'ratio':>6}"
          + (f" {'hypic bf16':>11} {'ratio':>6}" if bf16 else ""))
    for r in rows:
        extra = ""
        if "hypic_bf16_tok_s" in r:
            extra = f" {r['hypic_bf16_tok_s']:>11.1f} {r['ratio_bf16']:>6.2f}"
        print(f"{r['model']:<14} {r['weights']:<8} {r['threads']:>3}  {r['work']:<18} {r['hypic_tok_s']:>12.1f} "
              f"{r['llama_cpp_tok_s']:>10.1f} {r['ratio']:>6.2f}" + extra)


if __name__ == "__main__":
    main()
