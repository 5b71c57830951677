#!/usr/bin/env python3
"""Segment parallelism benchmark (issue 13): a cold PIC request whose documents are all new, on one
hypic server alone, then with 1, 2, ... segment workers (`hypic serve --role worker`), LPT and
round-robin; prints one JSON line per run and a table. Standard library only.

Each run starts fresh processes (nothing cached) and sends one request with max_tokens 1 (after an
untimed one of short documents with --warmup-words): its wall time is the time to first token.
Documents are random words, distinct per request."""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request

WORDS = ("river bread lighthouse valley market ship map coast keeper baker dawn lake library north "
         "garden winter copper signal harbor meadow lantern orchard quarry summit thunder village").split()


def spawn(cmd, log):
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)


def port_of(p, log):
    """Waits for a spawned server's "listening on" line (processes start side by side: each one
    makes its own random weights, seconds apiece)."""
    line = p.stdout.readline()
    m = re.match(r"listening on http://[^:]+:(\d+)", line)
    if not m:
        p.kill()
        sys.exit(f"server did not start: {' '.join(p.args)}; see {log}")
    return int(m.group(1))


def get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=600) as r:
        return r.read().decode()


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def samples(text):
    """Every sample of a /metrics text: 'name{labels}' -> value."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            try:
                out[k] = float(v)
            except ValueError:
                pass
    return out


def document(rng, words):
    return "Document: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def run(args, workload, lengths, n_workers, schedule, seed):
    base = [args.hypic, "serve", "--port", "0", "--config", args.config, "--random-weights", "--tokenizer",
            args.tokenizer, "--threads", str(args.threads), "--max-queue", "256", "--backend", args.backend]
    if args.activations:
        base += ["--activations", args.activations]
    procs, addrs, wports = [], [], []
    tag = f"{workload}-{n_workers}-{schedule}"
    try:
        logs = [f"{args.logs}/{tag}-worker{k}.log" for k in range(n_workers)]
        procs = [spawn(base + ["--role", "worker", "--segment-port", "0"], log) for log in logs]
        for p, log in zip(procs, logs):
            wports.append(port_of(p, log))
            addrs.append(f"127.0.0.1:{json.loads(get(wports[-1], '/health'))['segment_port']}")
        extra = ["--workers", ",".join(addrs), "--worker-schedule", schedule] if addrs else []
        p = spawn(base + extra, f"{args.logs}/{tag}-combine.log")
        procs.append(p)
        port = port_of(p, f"{args.logs}/{tag}-combine.log")
        def ask(words, rng):
            prompt = "You answer questions using the documents."
            for n in words:
                prompt += "<<PIC_SEP>>" + document(rng, n)
            prompt += "<<PIC_SEP>>Question: which word comes first?"
            return post(port, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                  "ignore_eos": True})

        # A warm-up request of other, short documents: the combine node measures every builder's rate
        # on it (as a serving node has by its first real request), so the timed request is dealt by
        # measured rates rather than the equal guess a fresh node starts from.
        if args.warmup_words > 0:
            ask([args.warmup_words] * len(lengths), random.Random(seed + 100000))
        before = samples(get(port, "/metrics"))
        wbefore = [samples(get(wp, "/metrics")) for wp in wports]
        t0 = time.perf_counter()
        r = ask(lengths, random.Random(seed))
        ttft = time.perf_counter() - t0
        after = samples(get(port, "/metrics"))
        d = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # this request's share
        phase = lambda name: 'hypic_engine_phase_seconds_sum{phase="' + name + '"}'
        row = {
            "workload": workload, "backend": args.backend, "workers": n_workers, "schedule": schedule if n_workers else "-",
            "segments": len(lengths), "prompt_tokens": r["usage"]["prompt_tokens"],
            "ttft_s": round(ttft, 3),
            "remote_entries": int(d("hypic_remote_entries_total")),
            "remote_mib": round(d("hypic_remote_entry_bytes_total") / 2**20, 2),
            # round trips less the workers' own time, plus copying shared entries in (device to device)
            "transfer_s": round(d("hypic_remote_transfer_seconds_total") + d("hypic_remote_import_seconds_total"), 3),
            "shared_entries": int(d("hypic_remote_shared_entries_total")),
            "import_s": round(d("hypic_remote_import_seconds_total"), 4),
            "fallbacks": int(d("hypic_remote_fallbacks_total")),
            # composition steps run while workers still built (docs/cluster.md)
            "overlap_steps": int(d("hypic_remote_overlap_steps_total")),
            "build_here_s": round(d(phase("build")), 3),
            "compose_s": round(d(phase("compose")), 3),
            # each worker's builds for others (its "segments" phase): how evenly the builders were loaded
            "worker_build_s": [round(samples(get(wp, "/metrics")).get(phase("segments"), 0.0) - wb.get(phase("segments"), 0.0), 3)
                               for wp, wb in zip(wports, wbefore)],
        }
        return row
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def build_bound(lengths, builders, schedule):
    """The speedup the builds alone allow: all documents' work over the busiest builder's, dealing
    documents (by length: tokens are ~words here) as the schedule does, builders equal."""
    load = [0] * builders
    if schedule == "round-robin":
        for i, n in enumerate(lengths):
            load[i % builders] += n
    else:
        for n in sorted(lengths, reverse=True):
            load[load.index(min(load))] += n
    return round(sum(lengths) / max(load), 2)


# The paper's uneven shape: 6,000 / 600 / 2,500 / 800 / 4,000 / 1,000 / 3,000 / 1,200 / 2,000 /
# 1,500 / 500 tokens (words for the default model's tokenizer, ~1.47 tokens a word here).
PAPER_UNEVEN = "4080,410,1700,545,2720,680,2040,815,1360,1020,340"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hypic", default="build/hypic")
    ap.add_argument("--config", default="bench/configs/qwen3_5_0_8b.json")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--threads", type=int, default=1, help="threads per process")
    ap.add_argument("--backend", default="cpu", help="every process's backend (cuda: all share the GPU)")
    ap.add_argument("--activations", default="", help="every process's --activations (f32, bf16); default: hypic's")
    ap.add_argument("--workers", default="0,1", help="worker counts to run")
    ap.add_argument("--segments", type=int, default=11, help="documents of the even workload (0: none)")
    ap.add_argument("--words", type=int, default=1630,
                    help="words per document of the even workload (1630: ~2.4k tokens of the default model's tokenizer)")
    ap.add_argument("--uneven", default="",
                    help=f"words per document of the uneven workload (comma list; 'paper': {PAPER_UNEVEN}, 0.5k-6k tokens)")
    ap.add_argument("--warmup-words", type=int, default=200,
                    help="words per document of an untimed request before each timed one, on which the combine "
                         "node measures its builders' rates (0: none; a fresh node deals by equal rates)")
    ap.add_argument("--logs", default="/tmp/hypic-segment-workers")
    ap.add_argument("--out", default="", help="JSON lines, appended row by row")
    ap.add_argument("--plot", default="", help="SVG of speedup against builders (tools/bench/plot_speedup.py)")
    a = ap.parse_args()
    if a.uneven == "paper":
        a.uneven = PAPER_UNEVEN
    os.makedirs(a.logs, exist_ok=True)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    head = {"bench": "segment_workers_run", "hypic": subprocess.run([a.hypic, "--version"], capture_output=True,
                                                                   text=True).stdout.strip(),
            # HYPIC_COMMIT where the tree was copied without its history (a device machine)
            "commit": os.environ.get("HYPIC_COMMIT") or (git.stdout.strip() if git.returncode == 0 else "?"),
            "cores": os.cpu_count(), "threads": a.threads, "backend": a.backend,
            "activations": a.activations or "default", "config": os.path.basename(a.config),
            "warmup_words": a.warmup_words,
            "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps(head), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(head) + "\n")
    rows = []
    seed = 1
    plans = [("even", [a.words] * a.segments)] if a.segments > 0 else []  # --segments 0: uneven only
    if a.uneven:
        plans.append(("uneven", [int(x) for x in a.uneven.split(",")]))
    for name, lengths in plans:
        for w in [int(x) for x in a.workers.split(",")]:
            for sched in (["lpt", "round-robin"] if w > 0 and name == "uneven" else ["lpt"]):
                row = run(a, name, lengths, w, sched, seed)
                seed += 1
                base = next((r["ttft_s"] for r in rows if r["workload"] == name and r["workers"] == 0), row["ttft_s"])
                row["speedup"] = round(base / row["ttft_s"], 2)
                row["per_builder"] = round(row["speedup"] / (w + 1), 2)
                row["builds_bound"] = build_bound(lengths, w + 1, sched)
                row["transfer_pct"] = round(100 * row["transfer_s"] / row["ttft_s"], 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if a.out:  # row by row: a run cut short keeps what it measured
                    with open(a.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    print("\n| workload | builders | schedule | prompt tokens | TTFT s | speedup | per builder | builds bound | "
          "entries from workers | MiB moved | transfer s | transfer % | built here s | slowest worker's builds s | compose s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['workers'] + 1} | {r['schedule']} | {r['prompt_tokens']} | {r['ttft_s']} | "
              f"{r['speedup']} | {r['per_builder']} | {r['builds_bound']} | {r['remote_entries']} | {r['remote_mib']} | "
              f"{r['transfer_s']} | {r['transfer_pct']} | {r['build_here_s']} | {max(r['worker_build_s'], default=0)} | "
              f"{r['compose_s']} |")
    if a.plot:
        # This run's rows, plus the even workload's builds bound as a curve of its own.
        pts = a.plot + ".jsonl"
        with open(pts, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
                if r["workload"] == "even":
                    f.write(json.dumps(dict(r, workload="bound", speedup=r["builds_bound"])) + "\n")
        series = [f"{w} {s}={pts}@{w}/{s}" for w, s in (("even", "lpt"), ("uneven", "lpt"), ("uneven", "round-robin"))
                  if any(r["workload"] == w and r["schedule"] == s for r in rows)]
        if any(r["workload"] == "even" for r in rows):
            series.append(f"even: builds bound={pts}@bound/lpt")
        subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "plot_speedup.py"),
                        a.plot] + series, check=True)
        os.remove(pts)


if __name__ == "__main__":
    main()
