#!/usr/bin/env python3
"""Evaluate a hypic-mini style checkpoint on the synthetic RAG tasks under full recompute.

Greedy decoding with HF transformers (plain prefill of the whole prompt, then cached decode), the
model in float32 (bf16 weights upcast), the prompt tokenised segment by segment exactly as the hypic
harness must do it:

    ids = concat(tokenize(segment + "\\n") for segment in [system, doc1..docN, question])

then the model generates until <|im_end|>. The decoded answer (special tokens dropped, stripped) is
scored with tools/tasks/rag_tasks.py (em / rougeL).

Usage (device machine; needs torch, transformers 5.17, tokenizers):
    python3 tools/train/eval_rag.py --model models/hypic-mini [--sets moderate,long] [--n 100]
        [--out eval.json] [--preds preds.jsonl]
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tools", "tasks"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import rag_tasks as R  # noqa: E402

# held-out evaluation sets (training never uses these seeds: its prompts come from other rng streams)
EVAL_SETS = {
    "moderate": dict(seed=7001, min_docs=4, max_docs=16, min_doc_tokens=100, max_doc_tokens=400, n=100),
    "long": dict(seed=7002, min_docs=16, max_docs=32, min_doc_tokens=100, max_doc_tokens=400, n=30),
    "longdocs": dict(seed=7005, min_docs=3, max_docs=6, min_doc_tokens=1000, max_doc_tokens=2500, n=30),
    "smoke": dict(seed=7003, min_docs=2, max_docs=4, min_doc_tokens=50, max_doc_tokens=100, n=2),
}
CHANCE = {"lookup": (0.043, 0.306), "twohop": (0.027, 0.303), "aggregate": (0.101, 0.0)}


def eval_examples(set_name, task, n=None):
    s = EVAL_SETS[set_name]
    n = s["n"] if n is None else n
    return [R.example(task, s["seed"], i, s["min_docs"], s["max_docs"], s["min_doc_tokens"], s["max_doc_tokens"])
            for i in range(n)]


def prompt_ids(encode_batch, segments):
    ids = []
    for e in encode_batch([s + "\n" for s in segments]):
        ids.extend(e)
    return ids


def max_new_tokens(ex):
    if ex["task"] == "aggregate":
        return 6 * (len(ex["segments"]) - 2) + 16
    return 24


def run_examples(model, encode_batch, decode, eos, pad, examples, device, deadline=None):
    """Greedy answers for the examples; stops early (fewer results) once time.time() passes deadline."""
    import torch

    results = []
    model.eval()
    with torch.no_grad():
        for ex in examples:
            if deadline is not None and time.time() > deadline:
                break
            ids = prompt_ids(encode_batch, ex["segments"])
            x = torch.tensor([ids], device=device)
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens(ex),
                                 do_sample=False, eos_token_id=eos, pad_token_id=pad)
            gen = out[0, len(ids):].tolist()
            stopped = eos in gen
            if stopped:
                gen = gen[: gen.index(eos)]
            pred = decode(gen).strip()
            results.append({"id": ex["id"], "task": ex["task"], "prediction": pred, "answer": ex["answer"],
                            "score": R.score(pred, ex), "prompt_tokens": len(ids), "stopped": stopped})
    return results


def summarize(results):
    out = {}
    for t in R.TASKS:
        rs = [r for r in results if r["task"] == t]
        if not rs:
            continue
        out[t] = {
            "metric": R.METRIC[t],
            "score": round(sum(r["score"] for r in rs) / len(rs), 4),
            "n": len(rs),
            "mean_prompt_tokens": round(sum(r["prompt_tokens"] for r in rs) / len(rs), 1),
            "max_prompt_tokens": max(r["prompt_tokens"] for r in rs),
            "stopped_at_eos": sum(r["stopped"] for r in rs),
            "chance_random_value": CHANCE[t][0],
            ("chance_informed" if t != "aggregate" else "chance_empty"): CHANCE[t][1],
        }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--sets", default="moderate,long")
    ap.add_argument("--tasks", default=",".join(R.TASKS))
    ap.add_argument("--n", type=int, default=None, help="prompts per task and set (default: the set's own)")
    ap.add_argument("--out", default="")
    ap.add_argument("--preds", default="")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--n-aggregate", type=int, default=None, help="prompts per set for aggregate (slow to decode)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds for the whole run; each task gets an equal share of what is left")
    args = ap.parse_args()

    import torch
    import transformers
    from tokenizers import Tokenizer

    t0 = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), attn_implementation="sdpa").to(device)
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")

    def encode_batch(texts):
        return [e.ids for e in tok.encode_batch(texts)]

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    # the HF tokenizer must give the same ids as tokenizers on a whole prompt
    at = transformers.AutoTokenizer.from_pretrained(args.model)
    ex0 = eval_examples("smoke", "twohop", 1)[0]
    full = R.prompt_text(ex0["segments"])
    tok_check = {
        "autotokenizer_class": type(at).__name__,
        "autotokenizer_equal": at.encode(full, add_special_tokens=False) == tok.encode(full).ids,
        "per_segment_equals_whole": prompt_ids(encode_batch, ex0["segments"]) == tok.encode(full).ids,
    }
    print(json.dumps(tok_check), flush=True)

    report = {"model": args.model, "dtype": args.dtype, "device": device, "tokenizer_check": tok_check,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__}, "sets": {}}
    all_preds = []
    todo = [(s, t) for s in args.sets.split(",") for t in args.tasks.split(",")]
    for s in args.sets.split(","):
        res = []
        for t in args.tasks.split(","):
            ts = time.time()
            deadline = None
            if args.time_limit is not None:
                left = t0 + args.time_limit - time.time()
                deadline = time.time() + left / len(todo)
            todo.pop(0)
            n = args.n_aggregate if (t == "aggregate" and args.n_aggregate) else args.n
            r = run_examples(model, encode_batch, decode, eos, pad, eval_examples(s, t, n), device, deadline)
            res += r
            print(f"[{s}] {t}: {summarize(r).get(t)}  ({time.time() - ts:.1f} s)", flush=True)
        report["sets"][s] = {"config": EVAL_SETS[s], "results": summarize(res)}
        for r in res:
            r["set"] = s
        all_preds += res
    report["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(report["sets"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    if args.preds:
        with open(args.preds, "w") as f:
            for r in all_preds:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
