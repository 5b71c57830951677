#!/usr/bin/env python3
"""Writes a random-weight Hugging Face folder (config.json, one bf16 model.safetensors, tokenizer
files) for a Qwen3.5 dense bench config with numpy alone, for machines without transformers (the
CPU comparison, bench/cpu_compare.sh); tools/bench/make_hf_folder.py does the same through
transformers on the device machine. Values as hypic's --random-weights: normal with sd
1/sqrt(fan_in), RMSNorm weights near 0 (Qwen3.5 multiplies by 1 + w), the gated norm near 1,
A_log = log(uniform(1, 16)), dt_bias = 1. Seeded.
Usage: random_hf_folder.py --config bench/configs/qwen3_5_0_8b.json --tokenizer DIR --out DIR"""
import argparse
import json
import os
import shutil
import struct

import numpy as np


def shapes(c):
    H, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    Hq, Hkv, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    Hk, Hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv, K = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
    C = 2 * Hk * dk + Hv * dv
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not c.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (V, H)
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        out[p + "mlp.gate_proj.weight"] = (I, H)
        out[p + "mlp.up_proj.weight"] = (I, H)
        out[p + "mlp.down_proj.weight"] = (H, I)
        if kind == "linear_attention":
            q = p + "linear_attn."
            out.update({q + "in_proj_qkv.weight": (C, H), q + "in_proj_z.weight": (Hv * dv, H),
                        q + "in_proj_b.weight": (Hv, H), q + "in_proj_a.weight": (Hv, H),
                        q + "conv1d.weight": (C, 1, K), q + "A_log": (Hv,), q + "dt_bias": (Hv,),
                        q + "norm.weight": (dv,), q + "out_proj.weight": (H, Hv * dv)})
        else:
            q = p + "self_attn."
            out.update({q + "q_proj.weight": (2 * Hq * D, H), q + "k_proj.weight": (Hkv * D, H),
                        q + "v_proj.weight": (Hkv * D, H), q + "o_proj.weight": (H, Hq * D),
                        q + "q_norm.weight": (D,), q + "k_norm.weight": (D,)})
    return out


def bf16(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def trim_tokenizer(path, vocab_size):
    """A config whose vocabulary is smaller than the tokenizer's (the 100M bench config: 32,000) gets
    the tokenizer cut to it: the first tokens in id order (a byte-level BPE vocabulary grows in merge
    order, so every kept token's merge parts are kept too) with the merges that make them, and the
    added tokens moved to the last ids. Still a valid BPE tokenizer, with the same pre-tokenizer."""
    t = json.load(open(path, encoding="utf-8"))
    vocab, added = t["model"]["vocab"], t.get("added_tokens", [])
    if len(vocab) + len(added) <= vocab_size:
        return
    keep = vocab_size - len(added)
    kept = {tok: i for tok, i in vocab.items() if i < keep}
    merges = []
    for m in t["model"]["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a + b in kept and a in kept and b in kept:
            merges.append(m)
    t["model"]["vocab"], t["model"]["merges"] = kept, merges
    for j, tok in enumerate(sorted(added, key=lambda x: x["id"])):
        tok["id"] = keep + j
    json.dump(t, open(path, "w", encoding="utf-8"), ensure_ascii=False)
    # tokenizer_config.json names the added tokens by id too.
    cpath = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    cfg = json.load(open(cpath, encoding="utf-8"))
    if "added_tokens_decoder" in cfg:
        new_id = {tok["content"]: tok["id"] for tok in added}
        cfg["added_tokens_decoder"] = {str(new_id[v["content"]]): v for v in cfg["added_tokens_decoder"].values()}
        json.dump(cfg, open(cpath, "w", encoding="utf-8"), ensure_ascii=False, indent=2)
    print(f"{path}: cut to {vocab_size} tokens ({len(kept)} + {len(added)} added, {len(merges)} merges)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--tokenizer", required=True, help="folder with tokenizer.json and tokenizer_config.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if os.path.exists(os.path.join(a.out, "model.safetensors")):
        print(f"{a.out}: already there")
        return
    c = json.load(open(a.config))
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    header, blobs, off = {}, [], 0
    for name, shp in shapes(c).items():
        n = int(np.prod(shp))
        if name.endswith("A_log"):
            v = np.log(rng.uniform(1.0, 16.0, n))
        elif name.endswith("dt_bias"):
            v = np.ones(n)
        elif name.endswith("linear_attn.norm.weight"):
            v = 1.0 + 0.02 * rng.standard_normal(n, dtype=np.float32)
        elif "norm" in name:
            v = 0.02 * rng.standard_normal(n, dtype=np.float32)
        else:
            v = rng.standard_normal(n, dtype=np.float32) / np.sqrt(shp[-1])
        b = bf16(v).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(shp), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(a.out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    shutil.copy(a.config, os.path.join(a.out, "config.json"))
    for t in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(a.tokenizer, t), os.path.join(a.out, t))
    trim_tokenizer(os.path.join(a.out, "tokenizer.json"), c["vocab_size"])  # after both files are there
    print(f"{a.out}: {off / 2**30:.2f} GiB of bf16 weights")


if __name__ == "__main__":
    main()
