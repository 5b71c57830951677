#!/usr/bin/env python3
"""Writes a GGUF with more layers than its source: the source's metadata (block_count changed;
arrays as they are: qwen35/qwen35moe keep no per-layer arrays, and an array whose length happens to
equal the layer count, such as rope.dimension_sections, is not one), the tensors of layer i copied from layer i % source_layers with the same
shapes and types. Used by bench/llama_peer.sh for shapes whose bf16 GGUF does not fit the device's
disk (Qwen3.5-35B-A3B: 70 GB): llama.cpp's own converter writes a GGUF of the first layers (one full
period of the layer pattern) from transformers' random initialisation, and this stretches it to the
real depth.

Tensors up to --copy-max bytes, and the token embedding, get the source layer's values; larger ones
are left as holes of the file (zeros that take no disk space). Dense products cost the same whatever
the values, and the routers are small, so they keep their random values and routing stays
data-dependent; but a model whose large projections are zero computes nothing meaningful, and
zero operands draw less power than random ones, which can only favour the engine that runs this
file. Runs wherever gguf-py (llama.cpp's gguf-py folder) and numpy are importable.
Usage: extend_gguf.py SRC DST --layers N [--copy-max BYTES]"""
import argparse
import re

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def pad(n, align):
    return (n + align - 1) // align * align


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--copy-max", type=int, default=64 << 20)
    a = ap.parse_args()

    r = GGUFReader(a.src)
    arch = r.fields["general.architecture"].contents()
    src_layers = int(r.fields[f"{arch}.block_count"].contents())
    if a.layers < src_layers:
        raise SystemExit(f"--layers {a.layers} is fewer than the source's {src_layers}")
    align = int(r.fields["general.alignment"].contents()) if "general.alignment" in r.fields else 32

    w = GGUFWriter(a.dst, arch)  # writes general.architecture itself
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype, val = f.types[0], f.contents()
        sub = f.types[1] if vtype == GGUFValueType.ARRAY else None
        if key == f"{arch}.block_count":
            val = a.layers
        w.add_key_value(key, val, vtype, sub_type=sub)

    blk = re.compile(r"^blk\.(\d+)\.(.*)$")
    per_layer = [[] for _ in range(src_layers)]
    head, tail = [], []
    for t in r.tensors:
        m = blk.match(t.name)
        if m:
            per_layer[int(m.group(1))].append((m.group(2), t))
        elif not per_layer[0]:
            head.append((t.name, t))
        else:
            tail.append((t.name, t))
    plan = list(head)
    for i in range(a.layers):
        plan += [(f"blk.{i}.{suffix}", t) for suffix, t in per_layer[i % src_layers]]
    plan += tail

    for name, t in plan:
        # numpy order (the writer reverses it); a non-uint8 dtype keeps the shape as given
        w.add_tensor_info(name, [int(d) for d in reversed(t.shape)], np.dtype(np.float32), int(t.n_bytes),
                          raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    f.flush()
    start = pad(f.tell(), align)
    off, copied = start, 0
    for name, t in plan:
        n = int(t.n_bytes)
        if n <= a.copy_max or name == "token_embd.weight":
            f.seek(off)
            f.write(r.data[t.data_offset:t.data_offset + n].tobytes())
            copied += n
        off += pad(n, align)
    f.truncate(off)
    f.close()
    print(f"{a.dst}: {len(plan)} tensors, {a.layers} layers from {src_layers}, {off / 1e9:.1f} GB "
          f"({copied / 1e9:.2f} GB written, the rest holes)")


if __name__ == "__main__":
    main()
