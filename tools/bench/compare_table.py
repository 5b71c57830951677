#!/usr/bin/env python3
"""Prints the side-by-side table of bench/gpu_compare.sh from its JSON lines: hypic, llama.cpp (CUDA)
and transformers per shape and row, hypic's speed-up over each, and each row's floor (prefill: FLOPs at the measured bf16 GEMM rate;
decode: the bytes one step must move at the measured copy bandwidth: active bf16 weights, bf16 KV of
the context, f32 recurrent states read and written; for architectures other than Qwen's, the weights
alone) with hypic's ratio to it."""
import json
import sys


def step_bytes(cfg, batch, context):
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    kinds = cfg["layer_types"]
    w = 2 * H * cfg["vocab_size"] * (1 if cfg.get("tie_word_embeddings") else 2) / 2  # LM head read once
    state = kv = 0.0
    E, k = cfg.get("num_experts", 0), cfg.get("num_experts_per_tok", 0)
    for kind in kinds:
        if kind == "linear_attention":
            kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
            vd = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
            w += 2 * H * (2 * kd + 2 * vd + 2 * cfg["linear_num_value_heads"])
            state += 2 * 4 * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"]
        else:
            qd, kvd = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
            w += 2 * H * (3 * qd + 2 * kvd)
            kv += 2 * 2 * kvd * context
        if E:
            used = E * (1 - (1 - k / E) ** batch)  # experts touched by `batch` tokens (expected)
            w += 2 * (3 * H * cfg["moe_intermediate_size"] * used + 3 * H * cfg.get("shared_expert_intermediate_size", 0)
                      + H * E)
        else:
            w += 2 * 3 * H * cfg["intermediate_size"]
    return w + batch * (state + kv)


def main():
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
    ceil = next((r for r in rows if r.get("bench") == "ceilings"), None)
    bw = ceil["copy_gb_per_s"] * 1e9 if ceil else 4.3e12
    table = []
    shapes = []
    for r in rows:
        if r.get("shape") and r["shape"] not in shapes:
            shapes.append(r["shape"])
    for s in shapes:
        cfg = json.load(open(f"bench/configs/{s}.json"))
        hy = [r for r in rows if r.get("shape") == s and r.get("peer") == "hypic"]
        tf = [r for r in rows if r.get("shape") == s and r.get("peer") == "transformers"]
        ll = [r for r in rows if r.get("shape") == s and r.get("peer") == "llama.cpp" and "error" not in r]
        for h in hy:
            if h["bench"] == "prefill":
                n = h["tokens"]
                key = f"prefill {n // 1024}k" if n >= 1024 else f"prefill {n}"
                t = next((x for x in tf if x.get("bench") == "prefill" and x.get("tokens") == h["tokens"]), None)
                l = next((x for x in ll if x.get("bench") == "prefill" and x.get("tokens") == h["tokens"]), None)
                rate = (ceil["bf16_tflops"] * 1e12) if ceil else h["gemm_gflops_per_s"] * 1e9
                floor = h["gflop"] * 1e9 / rate
                mine, unit = h["seconds"], "s"
                peer = t.get("seconds") if t else None
                lpeer = l["seconds"] if l else None
            else:
                key = f"decode b{h['batch']} @{h['context'] // 1024}k"
                t = next((x for x in tf if x.get("bench") == "decode" and x.get("batch") == h["batch"]), None)
                l = next((x for x in ll if x.get("bench") == "decode" and x.get("batch") == h["batch"]
                          and x.get("context") == h["context"]), None)
                # Qwen's configs: the whole step's bytes; other architectures: the weights hypic
                # reports reading (a lower bound: states and KV left out).
                nbytes = (step_bytes(cfg, h["batch"], h["context"]) if "layer_types" in cfg
                          else h["step_weight_bytes"])
                floor = nbytes / bw * 1e3
                mine, unit = h["ms_per_token"], "ms/step"
                peer = t.get("ms_per_token") if t else None
                lpeer = l["ms_per_token"] if l else None
            table.append(dict(shape=s, row=key, unit=unit, hypic=mine, llama_cpp=lpeer,
                              vs_llama_cpp=(lpeer / mine if lpeer else None), transformers=peer,
                              speedup=(peer / mine if peer else None), floor=floor, of_floor=mine / floor,
                              hypic_peak_gib=h.get("peak_device_bytes", -1) / 2**30,
                              peer_peak_gib=(t or {}).get("peak_device_bytes", -1) / 2**30))
    print(json.dumps({"ceilings": ceil, "rows": table}))
    hdr = (f"{'shape':16} {'row':14} {'hypic':>10} {'llama.cpp':>10} {'vs llama':>9} {'transformers':>13} "
           f"{'vs tf':>7} {'floor':>9} {'x floor':>8} {'GiB h/t':>12}")
    print(hdr)
    for t in table:
        peer = f"{t['transformers']:.3f}" if t["transformers"] else "-"
        sp = f"{t['speedup']:.1f}x" if t["speedup"] else "-"
        lp = f"{t['llama_cpp']:.3f}" if t["llama_cpp"] else "-"
        lsp = f"{t['vs_llama_cpp']:.2f}x" if t["vs_llama_cpp"] else "-"
        print(f"{t['shape']:16} {t['row']:14} {t['hypic']:10.3f} {lp:>10} {lsp:>9} {peer:>13} {sp:>7} {t['floor']:9.3f} "
              f"{t['of_floor']:7.1f}x {t['hypic_peak_gib']:5.1f}/{t['peer_peak_gib']:5.1f}  ({t['unit']})")


if __name__ == "__main__":
    main()
