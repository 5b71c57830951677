#!/usr/bin/env python3
"""Runs `hypic generate` (greedy, 24 tokens) on each committed reference model's two prompts and checks
the tokens against transformers' greedy tokens in its reference.safetensors. Standard library only, so
it runs on the device machine and here. Exit status 1 if any model differs.
Usage: check_generate.py [--hypic PATH] [--backend cpu|cuda] [--activations f32|bf16] [MODEL_DIR...]
(default: every folder of tests/data/models that has a reference.safetensors)."""
import argparse
import json
import pathlib
import shutil
import struct
import subprocess
import sys


def read_i64(path, name):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        t = head[name]
        if t["dtype"] != "I64":
            raise ValueError(f"{path}: {name} is {t['dtype']}, expected I64")
        a, b = t["data_offsets"]
        f.seek(8 + n + a)
        raw = f.read(b - a)
    return list(struct.unpack(f"<{(b - a) // 8}q", raw))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hypic", default=shutil.which("hypic") or "build/hypic")
    ap.add_argument("--backend", default="cuda")
    # f32 products, as transformers' f32 reference ran (the conformance suite's setting); bf16 is
    # the GPU's fast default, checked the same way (tiny random models have greedy margins of ~0.03
    # that bf16 rounding could flip: a failure there is a margin to look at before a bug).
    ap.add_argument("--activations", default="f32")
    ap.add_argument("models", nargs="*")
    a = ap.parse_args()
    dirs = [pathlib.Path(m) for m in a.models] or sorted(
        p.parent for p in pathlib.Path("tests/data/models").glob("*/reference.safetensors"))
    bad = 0
    for d in dirs:
        ref = d / "reference.safetensors"
        for s in ("a", "b"):
            prompt, want = read_i64(ref, f"prompt_{s}"), read_i64(ref, f"greedy_{s}")
            cmd = [a.hypic, "generate", "--backend", a.backend, "--model", str(d), "--prompt-ids",
                   ",".join(map(str, prompt)), "--max-tokens", str(len(want)), "--ignore-eos", "--json",
                   "--activations", a.activations]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"FAIL {d.name} prompt {s}: exit {p.returncode}: {p.stderr.strip()[-300:]}")
                bad += 1
                continue
            got = json.loads(p.stdout.strip().splitlines()[-1])["ids"]
            same = sum(1 for x, y in zip(got, want) if x == y)
            first = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
            ok = got == want
            bad += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {d.name:20} prompt {s} ({len(prompt)} tokens): {same}/{len(want)} "
                  f"greedy tokens equal" + ("" if ok else f", first difference at step {first}"))
    print(json.dumps({"bench": "check_generate", "backend": a.backend, "activations": a.activations, "models": len(dirs), "failed": bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
