#!/usr/bin/env python3
"""How much of its state each Gated DeltaNet head of a model keeps across one document.

For every linear layer and value head: the summed log-decay sum_t g_t over each document of the
first held-out prompts (g_t = -exp(A_log) softplus(a_t + dt_bias), the per-token state decay), as
log10. The transition operator T_C of a document is bounded by exp(sum_t g_t) in norm, so a head
at 10^-50 has forgotten everything before the document: there T_C S_prefix vanishes and naive
addition equals PIC's composition. Explains docs/quality.md's naive rows.

Usage: python3 tools/train/decay_report.py [--model models/default] [--task lookup] [--n 3]
(needs torch; Debian's python3-torch 1.13 on a CPU is enough)
"""

import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools", "tasks"))
sys.path.insert(0, HERE)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(HERE, "..", "..", "models", "default"))
    ap.add_argument("--task", default="lookup")
    ap.add_argument("--set", default="moderate")
    ap.add_argument("--n", type=int, default=3)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    import eval_rag as E
    from hybrid import load_folder
    from train import PyBPE

    m = load_folder(args.model)
    tok = PyBPE(os.path.join(args.model, "tokenizer.json"))
    per_layer = {}
    with torch.no_grad():
        for ex in E.eval_examples(args.set, args.task, args.n):
            segs = [tok.encode(s + "\n") for s in ex["segments"]]
            bounds, p = [], 0
            for s in segs:
                bounds.append((p, p + len(s)))
                p += len(s)
            x = m.model.embed_tokens(torch.tensor([sum(segs, [])]))
            for li, layer in enumerate(m.model.layers):
                if layer.kind == "linear_attention":
                    la = layer.linear_attn
                    h = layer.input_layernorm(x)
                    g = -la.A_log.float().exp() * F.softplus(la.in_proj_a(h).float() + la.dt_bias)
                    for a, b in bounds[1:-1]:  # the documents
                        per_layer.setdefault(li, []).append(g[0, a:b].sum(0) / math.log(10))
                x = layer(x)
    print(f"log10 of the decay across one document ({args.task}/{args.set}, {args.n} prompts); per value head:")
    print(f"{'layer':>5}  {'largest (longest memory)':<36} median")
    for li in sorted(per_layer):
        t = torch.stack(per_layer[li])
        mx = " ".join(f"{v:8.1f}" for v in t.max(0).values.tolist())
        md = " ".join(f"{v:8.1f}" for v in t.median(0).values.tolist())
        print(f"{li + 1:>5}  {mx:<36} {md}")


if __name__ == "__main__":
    main()
