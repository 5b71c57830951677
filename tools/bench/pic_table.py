#!/usr/bin/env python3
"""Prints the tables of bench/pic_compare.sh from its JSON lines: TTFT per mode for one RAG shape
(with transformers' full prefill of as many tokens), TTFT against the number of reused segments
with each mode's cost per extra segment (least-squares slope), and the serving sweep (highest rate
within the p90-TTFT SLO per mode). With matplotlib, also plots TTFT against segments per mode.
Usage: pic_table.py RESULTS.jsonl [PLOT.png]"""
import json
import sys


def slope(xs, ys):
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


def main():
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
    out = {}
    ttft = [r for r in rows if r.get("part") == "ttft" and r.get("bench") == "ttft"]
    tf = [r for r in rows if r.get("part") == "ttft" and r.get("peer") == "transformers" and r.get("bench") == "prefill"]
    if ttft:
        t = ttft[0]
        print(f"TTFT, {t['prefix_tokens']}-token prefix + {t['segments']} x {t['segment_tokens']} documents + "
              f"{t['query_tokens']}-token question ({t['prompt_tokens']} tokens), {t['model']}")
        print(f"{'mode':10} {'TTFT ms':>10} {'cached':>8} {'computed':>9} {'x pic':>7}")
        pic = next((m["ttft_ms_median"] for m in t["modes"] if m["mode"] == "pic"), None)
        for m in t["modes"]:
            x = f"{m['ttft_ms_median'] / pic:.1f}x" if pic else "-"
            print(f"{m['mode']:10} {m['ttft_ms_median']:10.1f} {m['cached_tokens_median']:8.0f} "
                  f"{m['computed_tokens_median']:9.0f} {x:>7}")
        for r in tf:
            x = f"{1e3 * r['seconds'] / pic:.1f}x" if pic and "seconds" in r else "-"
            val = f"{1e3 * r['seconds']:10.1f}" if "seconds" in r else f"{r.get('error', '?'):>10}"
            print(f"{'tf full':10} {val} {'':8} {r['tokens']:9d} {x:>7}")
        out["ttft"] = {m["mode"]: m["ttft_ms_median"] for m in t["modes"]}
    sweep = [r for r in rows if r.get("part") == "sweep" and r.get("bench") == "ttft"]
    series = {}
    if sweep:
        print(f"\nTTFT against reused segments of {sweep[0]['segment_tokens']} tokens")
        modes = [m["mode"] for m in sweep[0]["modes"]]
        print(f"{'segments':>8} " + " ".join(f"{m + ' ms':>12}" for m in modes))
        for r in sweep:
            vals = {m["mode"]: m["ttft_ms_median"] for m in r["modes"]}
            for m, v in vals.items():
                series.setdefault(m, []).append((r["segments"], v))
            print(f"{r['segments']:8d} " + " ".join(f"{vals.get(m, float('nan')):12.1f}" for m in modes))
        for m, pts in series.items():
            s = slope([p[0] for p in pts], [p[1] for p in pts])
            print(f"{m}: {s:.2f} ms per extra segment (least squares over {len(pts)} points)")
        out["ms_per_segment"] = {m: slope([p[0] for p in pts], [p[1] for p in pts]) for m, pts in series.items()}
    serve = [r for r in rows if r.get("part") == "serve" and "rate" in r]
    best = {r["mode"]: r["max_rate_within_slo"] for r in rows if r.get("part") == "serve" and "max_rate_within_slo" in r}
    if serve:
        print("\nServing (hypic_rag_trace): mode, rate, TTFT p50/p90/p99 ms, ITL p50/p99 ms, output tok/s, 429s")
        for r in serve:
            print(f"{r['mode']:7} {r['rate']:6.2f} {r['ttft_ms_p50']:9.1f} {r['ttft_ms_p90']:9.1f} {r['ttft_ms_p99']:9.1f} "
                  f"{r['itl_ms_p50']:7.1f} {r['itl_ms_p99']:7.1f} {r['output_tokens_per_s']:9.1f} {r['rejected']:4d}")
        for m, b in best.items():
            print(f"{m}: highest rate with p90 TTFT within its run's SLO: {b} req/s")
        # The same question at fixed SLOs, from the rows: the highest rate up to which every rate
        # of the mode kept p90 TTFT within it, with no errors or 429s.
        at = {}
        for slo in (1000.0, 2500.0):
            for m in sorted({r["mode"] for r in serve}):
                ok = 0.0
                for r in sorted((r for r in serve if r["mode"] == m), key=lambda r: r["rate"]):
                    if r["errors"] or r["rejected"] or not r["ok"] or r["ttft_ms_p90"] > slo:
                        break
                    ok = r["rate"]
                at.setdefault(f"{slo:.0f}", {})[m] = ok
            row = at[f"{slo:.0f}"]
            ratio = f", pic / prefix {row['pic'] / row['prefix']:.2f}x" if row.get("prefix") and "pic" in row else ""
            print(f"p90 TTFT <= {slo:.0f} ms: " + ", ".join(f"{m} {v} req/s" for m, v in row.items()) + ratio)
        out["max_rate_within_slo"] = best
        out["max_rate_at_slo_ms"] = at
    print(json.dumps(out))
    if len(sys.argv) > 2 and series:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        fig, ax = plt.subplots(figsize=(6, 4))
        for m, pts in series.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"reused segments ({sweep[0]['segment_tokens']} tokens each)")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(sweep[0]["model"].split("/")[-1])
        ax.legend()
        fig.tight_layout()
        fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
