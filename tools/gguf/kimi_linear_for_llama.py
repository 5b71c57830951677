#!/usr/bin/env python3
"""A Kimi-Linear checkpoint that llama.cpp's converter can take, derived from the committed reference
tests/data/models/kimi_linear, which is in transformers 5's form where the converter
(conversion/kimi_linear.py at 0a50d99) expects Moonshot's own (the Hub's Kimi-Linear-48B-A3B):

 1. config.json: the converter reads the layer kinds, the KDA heads and the short-conv kernel from
    `linear_attn_config` (full_attn_layers 1-based, kda_layers, num_heads, head_dim,
    short_conv_kernel_size); transformers 5 writes `layer_types`, `linear_num_heads`,
    `linear_head_dim` and `linear_conv_kernel_dim` instead. The derived config adds
    `linear_attn_config` with the same values.
 2. The dense feed-forward of the first `first_k_dense_replace` layers is `mlp.{gate,up,down}_proj`
    in Moonshot's checkpoints (what llama.cpp's tensor map knows) and `block_sparse_moe.{gate,up,
    down}_proj` in transformers 5's: renamed.
 3. Two routing fields the converter looks for under other names: Moonshot's configs say
    `moe_router_activation_func: "sigmoid"` (transformers 5 drops it: its router is always sigmoid),
    without which the file has no `expert_gating_func` and llama.cpp's kimi-linear loader refuses
    it; and the converter writes `expert_group_count` only from DeepSeek's `n_group`, not from Kimi's
    `num_expert_group`, so a file of a grouped router (this one: 4 groups, top 2) would route over
    all experts. The derived config adds both (same values: sigmoid, n_group = num_expert_group).
Every value is unchanged (the same tensors, bit for bit, under those names), so the tests compare
the GGUF with the reference folder itself. Standard library only.
Usage: kimi_linear_for_llama.py SRC_DIR OUT_DIR
"""
import json
import re
import shutil
import struct
import sys
from pathlib import Path

if len(sys.argv) != 3:
    sys.exit(__doc__)
src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
cfg = json.loads((src / "config.json").read_text())
types = cfg["layer_types"]
cfg["linear_attn_config"] = {
    "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
    "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
    "num_heads": cfg["linear_num_heads"],
    "head_dim": cfg["linear_head_dim"],
    "short_conv_kernel_size": cfg["linear_conv_kernel_dim"],
}
cfg["moe_router_activation_func"] = "sigmoid"
if "num_expert_group" in cfg:
    cfg["n_group"] = cfg["num_expert_group"]
dense = {i for i, t in enumerate(cfg.get("mlp_layer_types") or []) if t == "dense"} or set(
    range(cfg.get("first_k_dense_replace", 1)))

raw = (src / "model.safetensors").read_bytes()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
meta = header.pop("__metadata__", None)
new_header = {}
renamed = 0
for k, v in header.items():
    m = re.fullmatch(r"model\.layers\.(\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)", k)
    if m and int(m.group(1)) in dense:
        k = f"model.layers.{m.group(1)}.mlp.{m.group(2)}"
        renamed += 1
    new_header[k] = v
if meta is not None:
    new_header["__metadata__"] = meta
hb = json.dumps(new_header, separators=(",", ":")).encode()
hb += b" " * (-len(hb) % 8)
(out / "model.safetensors").write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])
(out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
    if (src / f).exists():
        shutil.copy(src / f, out / f)
print(f"wrote {out}: linear_attn_config {cfg['linear_attn_config']}, {renamed} dense tensors renamed to mlp.*")
