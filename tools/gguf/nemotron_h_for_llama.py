#!/usr/bin/env python3
"""A Nemotron-H checkpoint that llama.cpp's converter can take, derived from the committed reference
tests/data/models/nemotron_h. Two things stand in the way of converting the reference as it is:

 1. Its config.json is transformers 5's: `layers_block_type` names the blocks linear_attention /
    full_attention / mlp / moe and there is no `num_hidden_layers`. The converter (conversion/nemotron.py
    at 0a50d99) reads the block count from `num_hidden_layers` and the blocks from the Hub's
    `hybrid_override_pattern` string (M mamba, * attention, - MLP, E MoE; its list branch knows only
    the older names mamba / attention / moe). The derived config says the same layers that way.
 2. llama.cpp's nemotron_h_moe has routed experts in every feed-forward block (n_expert != 0 makes
    every one an MoE) and nemotron_h none, while the reference mixes both (MoE in blocks 1 and 8, MLP
    in 4 and 9). `--ffn moe` makes every feed-forward block an MoE, `--ffn mlp` every one an MLP
    (and drops the MoE fields, so that the converter picks nemotron_h): each block of the other kind
    takes a copy of the nearest block of the wanted kind (the earlier one on a tie), router, experts,
    shared expert and score bias, or up/down projections.
Every other tensor and file is copied unchanged. The tests build the same model in memory from the
reference folder (tests/models/gguf_checkpoint_test.cpp), so the derived folder is not committed.
Standard library only.
Usage: nemotron_h_for_llama.py SRC_DIR OUT_DIR --ffn moe|mlp
"""
import json
import shutil
import struct
import sys
from pathlib import Path

if len(sys.argv) != 5 or sys.argv[3] != "--ffn" or sys.argv[4] not in ("moe", "mlp"):
    sys.exit(__doc__)
src, out, want = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[4]
out.mkdir(parents=True, exist_ok=True)
cfg = json.loads((src / "config.json").read_text())
blocks = cfg.pop("layers_block_type")
letter = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}
ffn = [i for i, b in enumerate(blocks) if b in ("mlp", "moe")]
source = {}  # block -> the block whose feed-forward it copies
for i in ffn:
    if blocks[i] != want:
        same = [j for j in ffn if blocks[j] == want]
        if not same:
            sys.exit(f"no {want} block to copy")
        source[i] = min(same, key=lambda j: (abs(j - i), j))
        blocks[i] = want
cfg["hybrid_override_pattern"] = "".join(letter[b] for b in blocks)
cfg["num_hidden_layers"] = len(blocks)
if want == "mlp":
    for k in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
              "n_shared_experts", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
              "moe_latent_size", "moe_shared_expert_overlap", "mtp_layers_block_type"):
        cfg.pop(k, None)

raw = (src / "model.safetensors").read_bytes()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
meta = header.pop("__metadata__", None)
data = raw[8 + n:]
tensors = {k: data[v["data_offsets"][0]:v["data_offsets"][1]] for k, v in header.items()}
info = {k: (v["dtype"], v["shape"]) for k, v in header.items()}
for i, j in source.items():
    pi, pj = f"backbone.layers.{i}.mixer.", f"backbone.layers.{j}.mixer."
    for k in [k for k in tensors if k.startswith(pi)]:
        del tensors[k], info[k]
    for k in [k for k in list(tensors) if k.startswith(pj)]:
        ki = pi + k[len(pj):]
        tensors[ki], info[ki] = tensors[k], info[k]
new_header, blobs, off = {}, [], 0
for k in sorted(tensors):
    b = tensors[k]
    new_header[k] = {"dtype": info[k][0], "shape": info[k][1], "data_offsets": [off, off + len(b)]}
    blobs.append(b)
    off += len(b)
if meta is not None:
    new_header["__metadata__"] = meta
hb = json.dumps(new_header, separators=(",", ":")).encode()
hb += b" " * (-len(hb) % 8)
(out / "model.safetensors").write_bytes(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))
(out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
    if (src / f).exists():
        shutil.copy(src / f, out / f)
print(f"wrote {out}: pattern {cfg['hybrid_override_pattern']}, copied feed-forward blocks {source}")
