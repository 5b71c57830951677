#!/usr/bin/env python3
"""The peer side of bench/gpu_compare.sh: transformers (its torch fallbacks for the linear layers, sdpa
attention) on the same config with random bf16 weights, on the same GPU. Prints one JSON line per
measurement: prefill seconds at each length, decode milliseconds per step at each batch after a
context, and peak GPU memory. Timed with CUDA events after a warm-up; the median of --repeats."""
import argparse
import json
import statistics
import sys
import time

import torch
import transformers as T


def build(config_path):
    d = json.load(open(config_path))
    arch = d["architectures"][0]
    kw = {k: v for k, v in d.items() if k not in ("architectures", "model_type", "dtype")}
    if arch == "Qwen3_5MoeForCausalLM":
        cfg, cls = T.Qwen3_5MoeTextConfig(**kw), T.Qwen3_5MoeForCausalLM
    elif arch == "Qwen3_5ForCausalLM":
        cfg, cls = T.Qwen3_5TextConfig(**kw), T.Qwen3_5ForCausalLM
    elif arch == "Qwen3NextForCausalLM":
        cfg, cls = T.Qwen3NextConfig(**kw), T.Qwen3NextForCausalLM
    elif hasattr(T, arch) and hasattr(T, arch.replace("ForCausalLM", "Config")):
        # Nemotron-H, Kimi-Linear, MiniMax: transformers' torch paths (no mamba-ssm / fla kernels here).
        cfg, cls = getattr(T, arch.replace("ForCausalLM", "Config"))(**kw), getattr(T, arch)
    else:
        sys.exit(f"unsupported architecture {arch}")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = cls(cfg)
    torch.set_default_dtype(torch.float32)
    return model.eval(), cfg


def timed(fn, repeats):
    fn()  # warm-up
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1000.0)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--prefill", default="4096")
    ap.add_argument("--decode-batches", default="1")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ceilings", action="store_true", help="only measure copy bandwidth and the bf16 GEMM rate")
    a = ap.parse_args()
    if a.ceilings:
        # The two ceilings of every floor (METHOD.md): device-to-device copy (bytes read + written)
        # and an 8192^3 bf16 product on random data.
        x = torch.randn(1 << 30, device="cuda", dtype=torch.float32)  # 4 GiB
        y = torch.empty_like(x)
        cp = timed(lambda: y.copy_(x), 5)
        del x, y
        a_ = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b_ = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        mm = timed(lambda: a_ @ b_, 10)
        print(json.dumps({"bench": "ceilings", "copy_gb_per_s": 2 * 4 * (1 << 30) / cp / 1e9,
                          "bf16_tflops": 2 * 8192 ** 3 / mm / 1e12}))
        return
    t0 = time.time()
    model, cfg = build(a.config)
    g = torch.Generator(device="cuda").manual_seed(1)
    V = cfg.vocab_size
    name = a.config.split("/")[-1].removesuffix(".json")
    print(json.dumps({"peer": "transformers", "model": name, "build_s": round(time.time() - t0, 1),
                      "transformers": T.__version__, "torch": torch.__version__}), flush=True)
    with torch.no_grad():
        for n in [int(x) for x in a.prefill.split(",") if x]:
            ids = torch.randint(0, V, (1, n), device="cuda", generator=g)
            torch.cuda.reset_peak_memory_stats()
            try:
                s = timed(lambda: model(ids, use_cache=True, logits_to_keep=1), a.repeats)
                rec = {"bench": "prefill", "tokens": n, "seconds": s}
            except torch.OutOfMemoryError:
                rec = {"bench": "prefill", "tokens": n, "error": "out of memory"}
            except Exception as e:  # a torch fallback that cannot take the shape: reported, not fatal
                rec = {"bench": "prefill", "tokens": n, "error": str(e)[:300]}
            rec.update(peer="transformers", model=name, peak_device_bytes=torch.cuda.max_memory_allocated())
            print(json.dumps(rec), flush=True)
            torch.cuda.empty_cache()
        for b in [int(x) for x in a.decode_batches.split(",") if x]:
            ids = torch.randint(0, V, (b, a.context), device="cuda", generator=g)
            torch.cuda.reset_peak_memory_stats()
            try:
                out = model(ids, use_cache=True, logits_to_keep=1)
                pkv = out.past_key_values
                nxt = torch.randint(0, V, (b, 1), device="cuda", generator=g)
                steps = []
                for i in range(a.decode_steps + 1):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    o = model(nxt, past_key_values=pkv, use_cache=True, logits_to_keep=1)
                    nxt = o.logits[:, -1:].argmax(-1)
                    e1.record()
                    torch.cuda.synchronize()
                    if i > 0:
                        steps.append(e0.elapsed_time(e1))
                    pkv = o.past_key_values
                rec = {"bench": "decode", "batch": b, "context": a.context, "ms_per_token": statistics.median(steps)}
            except torch.OutOfMemoryError:
                rec = {"bench": "decode", "batch": b, "context": a.context, "error": "out of memory"}
            except Exception as e:
                rec = {"bench": "decode", "batch": b, "context": a.context, "error": str(e)[:300]}
            rec.update(peer="transformers", model=name, peak_device_bytes=torch.cuda.max_memory_allocated())
            print(json.dumps(rec), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
