#!/usr/bin/env python3
"""A Qwen3-Next checkpoint that llama.cpp's converter can take, derived from the committed reference
tests/data/models/qwen3_next: llama.cpp's qwen3next architecture has a sparse MLP in every layer,
while the reference has a dense one in layer 1 (`mlp_only_layers: [1]`). Layer 1's dense MLP is
replaced by a copy of layer 0's sparse MLP (router, experts, shared expert and its gate) and
`mlp_only_layers` emptied; every other tensor and file is copied unchanged. The tests build the
same model in memory from the reference folder (tests/models/gguf_checkpoint_test.cpp), so the
derived folder itself is not committed. Standard library only.
Usage: qwen3_next_all_moe.py SRC_DIR OUT_DIR
"""
import json
import shutil
import struct
import sys
from pathlib import Path

src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
raw = (src / "model.safetensors").read_bytes()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
meta = header.pop("__metadata__", None)
data = raw[8 + n:]
tensors = {k: data[v["data_offsets"][0]:v["data_offsets"][1]] for k, v in header.items()}
info = {k: (v["dtype"], v["shape"]) for k, v in header.items()}
for k in [k for k in tensors if k.startswith("model.layers.1.mlp.")]:
    del tensors[k], info[k]
for k in [k for k in list(tensors) if k.startswith("model.layers.0.mlp.")]:
    k1 = "model.layers.1." + k[len("model.layers.0."):]
    tensors[k1], info[k1] = tensors[k], info[k]
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
cfg = json.loads((src / "config.json").read_text())
cfg["mlp_only_layers"] = []
(out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
    if (src / f).exists():
        shutil.copy(src / f, out / f)
print(f"wrote {out}: {len(tensors)} tensors, every layer sparse")
