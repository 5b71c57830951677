#!/usr/bin/env python3
"""Writes a random-weight Hugging Face folder (config.json, bf16 safetensors shards, tokenizer files)
for a bench config, so engines that load checkpoints (llama.cpp's converter, hypic --model) run the
very same weights. Weights are transformers' own initialisation on the GPU (the same code path as
tools/bench/transformers_bench.py), seeded. Runs on the device machine.
Usage: make_hf_folder.py --config bench/configs/qwen3_5_9b.json --tokenizer DIR --out DIR"""
import argparse
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformers_bench import build  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--tokenizer", required=True, help="folder with tokenizer.json and tokenizer_config.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if os.path.exists(os.path.join(a.out, "config.json")):
        print(f"{a.out}: already there")
        return
    t0 = time.time()
    torch.manual_seed(a.seed)
    model, _ = build(a.config)
    model.save_pretrained(a.out, max_shard_size="4GB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(a.tokenizer, f), a.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{a.out}: {n / 1e9:.2f} B parameters in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
