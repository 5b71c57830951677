#!/usr/bin/env python3
"""Train hypic-mini: a small Qwen3.5-style hybrid model (Gated DeltaNet : gated attention = 3:1) on the
synthetic multi-document tasks of tools/tasks/rag_tasks.py.

Runs on the device machine (torch 2.11, transformers 5.17, tokenizers). Training is budgeted in
wall-clock seconds and split over calls: each call trains --train-seconds, and the learning-rate
schedule and the length curriculum follow progress = trained seconds / --total-train-seconds.

    # first call: train the tokenizer, build the model, train, checkpoint (what was run, curriculum "a")
    python3 tools/train/train.py --init --work .hypic-train --out $OUT --train-seconds 400 --total-train-seconds 700
    # tools/train/stage_carry.sh <files brought back>   (checkpoint parts + bundle into .hypic-train/)
    # second call: resume the fp32 weights (AdamW moments restart), new schedule, export + evaluate
    python3 tools/train/train.py --work .hypic-train --out $OUT --curriculum b --restart-schedule \
        --train-seconds 380 --total-train-seconds 380 --lr 1.5e-3 --warmup 30 --final --end-eval-n 0 \
        --quick-eval-every 190 --deadline 580

Data: fresh prompts from rag_tasks.make_prompt on every step (rng streams "hypic-train/<seed>/<worker>",
disjoint from the evaluation sets' "hypic-rag/<task>/<seed>/<i>"), tokenised segment by segment
(segment + "\\n"), followed by the question, the answer and <|im_end|>. Loss: cross-entropy on the
answer tokens and <|im_end|> (curriculum "b" adds the question tokens at weight 0.3). Lookup / twohop
training prompts carry several questions about distinct facts of the same documents, one after the
other (question, answer, <|im_end|>, next question...): the first is exactly the evaluation format,
the rest multiply the supervision per forward pass. See CURRICULA. The gated delta rule runs through fast_gdn.chunk_gated_delta_rule_scan (same math as
transformers' torch fallback, no per-chunk Python loop); evaluation uses transformers' own code.
"""

import argparse
import copy
import io
import json
import math
import os
import random
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tools", "tasks"))
sys.path.insert(0, HERE)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import rag_tasks as R  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 4096
N_BPE = VOCAB - len(SPECIALS)
MODEL_KW = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=12,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    bos_token_id=None,
)
# curricula over progress p in [0, 1]: documents per prompt, tokens per document, tokens per prompt cap;
# task mix; questions per training prompt; loss weight of question tokens (answers weigh 1).
# "a" was the first call's recipe (no retrieval emerged in 1121 steps); "b" restarts the length schedule
# from very short prompts and adds a copy signal: next-token loss on the question tokens too (the
# entity names in a question can only be predicted by finding them in the documents).
CURRICULA = {
    "a": dict(
        stages=[
            dict(until=0.15, docs=(2, 8), doc_tok=(30, 200), cap=1600),
            dict(until=0.40, docs=(3, 12), doc_tok=(50, 400), cap=4000),
            dict(until=0.70, docs=(4, 20), doc_tok=(80, 700), cap=8000),
            dict(until=9.99, docs=(4, 32), doc_tok=(100, 1000), cap=12000),
        ],
        task_p=[("lookup", 0.40), ("twohop", 0.35), ("aggregate", 0.25)],
        qmax={"lookup": 8, "twohop": 4, "aggregate": 1},
        question_weight=0.0,
    ),
    "b": dict(
        stages=[
            dict(until=0.20, docs=(2, 4), doc_tok=(20, 100), cap=500),
            dict(until=0.45, docs=(2, 8), doc_tok=(30, 250), cap=1600),
            dict(until=0.70, docs=(3, 16), doc_tok=(50, 400), cap=4000),
            dict(until=9.99, docs=(4, 24), doc_tok=(80, 700), cap=8000),
        ],
        task_p=[("lookup", 0.50), ("twohop", 0.25), ("aggregate", 0.25)],
        qmax={"lookup": 12, "twohop": 6, "aggregate": 1},
        question_weight=0.3,
    ),
}
PART_BYTES = 15 * 1024 * 1024

QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------------
# data
def stage_index(p, stages):
    for i, s in enumerate(stages):
        if p < s["until"]:
            return i
    return len(stages) - 1


def sample_doc_tokens(rng, st):
    n = rng.randint(*st["docs"])
    lens = [rng.randint(*st["doc_tok"]) for _ in range(n)]
    tot = sum(lens) + 40
    if tot > st["cap"]:
        scale = st["cap"] / tot
        lens = [max(20, int(x * scale)) for x in lens]
    return lens


def build_row(rng, encode_batch, task, doc_tok, eos, qmax):
    """One training sequence: token ids and a mask: 2 = answer tokens and eos, 1 = question tokens, 0 = rest."""
    words = [max(8, int(round(t / R.TOKENS_PER_WORD))) for t in doc_tok]
    segs, qa = R.make_prompt(rng, task, words)
    k = 1 if qmax[task] == 1 else rng.randint(1, min(qmax[task], len(qa)))
    texts = [s + "\n" for s in segs[:-1]]
    qtexts = [R.question_segment(q[0]) + "\n" for q in qa[:k]]
    atexts = [q[1] for q in qa[:k]]
    enc = encode_batch(texts + qtexts + atexts)
    ids, mask = [], []
    for e in enc[: len(texts)]:
        ids += e
        mask += [0] * len(e)
    for j in range(k):
        qi = enc[len(texts) + j]
        ai = enc[len(texts) + k + j] + [eos]
        ids += qi
        mask += [1] * len(qi)
        ids += ai
        mask += [2] * len(ai)
    return ids, mask


def make_batches(rng, encode_batch, p, budget, eos, pad, cur="a"):
    """A pool of rows for progress p, bucketed by length into batches of <= budget tokens each.
    Each batch: x (inputs), y (next-token targets, -100 = unsupervised), c (2 = answer, 1 = question), stage."""
    import numpy as np

    C = CURRICULA[cur]
    stages = C["stages"]
    si = stage_index(p, stages)
    rows, tot = [], 0
    while tot < 3 * budget:
        st = stages[si] if rng.random() > 0.2 else stages[rng.randrange(si + 1)]
        r, acc = rng.random(), 0.0
        for task, w in C["task_p"]:
            acc += w
            if r < acc:
                break
        ids, mask = build_row(rng, encode_batch, task, sample_doc_tokens(rng, st), eos, C["qmax"])
        rows.append((ids, mask))
        tot += len(ids)
    rows.sort(key=lambda r: len(r[0]))
    batches, cur = [], []
    for r in rows:
        if cur and (len(cur) + 1) * len(r[0]) > budget:
            batches.append(cur)
            cur = []
        cur.append(r)
    if cur:
        batches.append(cur)
    out = []
    for b in batches:
        L = max(len(r[0]) for r in b) - 1
        x = np.full((len(b), L), pad, dtype=np.int32)
        y = np.full((len(b), L), -100, dtype=np.int32)
        c = np.zeros((len(b), L), dtype=np.int8)
        for i, (ids, mask) in enumerate(b):
            n = len(ids) - 1
            x[i, :n] = ids[:-1]
            tgt = np.asarray(ids[1:], dtype=np.int32)
            m = np.asarray(mask[1:], dtype=np.int8)
            if C["question_weight"] <= 0:
                m = np.where(m == 2, 2, 0).astype(np.int8)
            y[i, :n] = np.where(m > 0, tgt, -100)
            c[i, :n] = m
        out.append((x, y, c, si))
    rng.shuffle(out)
    return out


def worker_main(wid, seed, tok_path, queue, progress, budget, eos, pad, cur):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)

    def encode_batch(texts):
        return [e.ids for e in tok.encode_batch(texts)]

    rng = random.Random(f"hypic-train/{seed}/{wid}")
    while True:
        for b in make_batches(rng, encode_batch, progress.value, budget, eos, pad, cur):
            queue.put(b)


# ------------------------------------------------------------------------------------------------
# tokenizer
def train_tokenizer(n_per_task=150):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    texts = []
    for t in R.TASKS:
        for i in range(n_per_task):
            ex = R.example(t, 424242, i, 2, 24, 50, 600)
            texts.append(R.prompt_text(ex["segments"]) + ex["answer"])
    vocab_text = " ".join(sum((v for v in R.ATTRIBUTES.values() if v), [])) + " " + ", ".join(R.CARGO)
    texts += [vocab_text] * 4 + [" ".join(R.NUMBER_VALUES)] * 2
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=N_BPE, min_frequency=2, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    n_bpe = tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok, n_bpe, sum(len(t) for t in texts)


def tokenizer_config(tok):
    added = {}
    for s in SPECIALS:
        added[str(tok.token_to_id(s))] = {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer(tok, folder):
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(tok), f, indent=2, ensure_ascii=False)
        f.write("\n")


# ------------------------------------------------------------------------------------------------
# checkpoints: fp32 weights + state, torch.save'd and cut into <= 15 MiB parts (the device's file limit)
def save_parts(obj, folder, prefix="ckpt"):
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    os.makedirs(folder, exist_ok=True)
    for f in os.listdir(folder):
        if f.startswith(prefix + "."):
            os.remove(os.path.join(folder, f))
    for i in range(0, len(data), PART_BYTES):
        with open(os.path.join(folder, f"{prefix}.{i // PART_BYTES:03d}"), "wb") as f:
            f.write(data[i: i + PART_BYTES])
    return len(data)


def load_parts(folder, prefix="ckpt"):
    import torch

    parts = sorted(f for f in os.listdir(folder) if f.startswith(prefix + "."))
    data = b"".join(open(os.path.join(folder, f), "rb").read() for f in parts)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def export_model(model, tok, folder):
    import torch
    from transformers import GenerationConfig

    os.makedirs(folder, exist_ok=True)
    m = copy.deepcopy(model).to(torch.bfloat16).cpu()
    m.generation_config = GenerationConfig(eos_token_id=tok.token_to_id("<|im_end|>"),
                                           pad_token_id=tok.token_to_id("<|endoftext|>"),
                                           bos_token_id=None, do_sample=False)
    m.config.eos_token_id = tok.token_to_id("<|im_end|>")
    m.config.pad_token_id = tok.token_to_id("<|endoftext|>")
    m.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(tok, folder)
    del m


# ------------------------------------------------------------------------------------------------
def patch_gdn(model):
    """Route the chunked gated delta rule through the loop-free scan; check it against transformers'."""
    import torch
    import transformers.models.qwen3_5.modeling_qwen3_5 as mq
    from fast_gdn import chunk_gated_delta_rule_scan as fast

    orig = mq.torch_chunk_gated_delta_rule
    g = torch.Generator(device="cuda").manual_seed(0)
    B, L, hk, hv, dk, dv = 2, 300, 2, 4, 64, 64
    q = torch.randn(B, L, hk, dk, device="cuda", generator=g)
    k = torch.randn(B, L, hk, dk, device="cuda", generator=g)
    v = torch.randn(B, L, hv, dv, device="cuda", generator=g)
    gg = -torch.rand(B, L, hv, device="cuda", generator=g) * 0.1  # weak decay: cross-chunk terms matter
    beta = torch.rand(B, L, hv, device="cuda", generator=g)
    q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)  # equal heads: any version
    try:
        o1, s1 = orig(q, k, v, g=gg, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        o2, s2 = fast(q, k, v, g=gg, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        err = ((o1 - o2).norm() / o1.norm()).item()
        serr = ((s1 - s2).norm() / s1.norm()).item()
    except Exception as e:  # noqa: BLE001
        log(f"fast GDN check failed: {type(e).__name__}: {e}")
        return False
    log(f"fast GDN vs transformers: rel err out {err:.2e} state {serr:.2e}")
    if not (err < 1e-3 and serr < 1e-3):
        log("fast GDN disagrees: keeping transformers' implementation")
        return False
    mq.torch_chunk_gated_delta_rule = fast
    n = 0
    for m in model.modules():
        if hasattr(m, "chunk_gated_delta_rule"):
            m.chunk_gated_delta_rule = fast
            n += 1
    fast.calls = 0
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 70, dtype=torch.long, device="cuda"), use_cache=False)
    log(f"fast GDN patched ({n} module attributes); calls in a test forward: {fast.calls}")
    return fast.calls > 0


def lr_at(p, step, peak, warmup):
    w = min(1.0, (step + 1) / warmup)
    return peak * w * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, p))))


def plot_log(log_path, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(l) for l in open(log_path)]
    tr = [r for r in rows if "loss" in r]
    ev = [r for r in rows if "eval" in r]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([r["tokens_seen"] / 1e6 for r in tr], [r["loss"] for r in tr], lw=1, label="train loss (answer tokens)")
    ax.set_yscale("log")
    ax.set_xlabel("tokens seen (millions, padding excluded)")
    ax.set_ylabel("cross-entropy")
    last = None
    for r in tr:
        if r["stage"] != last:
            ax.axvline(r["tokens_seen"] / 1e6, color="gray", ls=":", lw=0.8)
            ax.text(r["tokens_seen"] / 1e6, max(x["loss"] for x in tr), f" stage {r['stage']}", fontsize=7, va="top")
            last = r["stage"]
    if ev:
        ax2 = ax.twinx()
        for t, mk in (("lookup", "o"), ("twohop", "s"), ("aggregate", "^")):
            pts = [(r["tokens_seen"] / 1e6, r["eval"][t]["score"]) for r in ev if t in r["eval"]]
            if pts:
                ax2.plot(*zip(*pts), marker=mk, ls="--", lw=0.8, label=f"{t} ({'em' if t != 'aggregate' else 'rougeL'})")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("held-out score (quick evals, greedy)")
        ax2.legend(loc="center right", fontsize=7)
    ax.legend(loc="upper right", fontsize=7)
    ax.set_title("hypic-mini training")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


# ------------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="carried folder: checkpoint parts, tokenizer, config, log")
    ap.add_argument("--out", required=True, help="files to bring back")
    ap.add_argument("--init", action="store_true")
    ap.add_argument("--final", action="store_true", help="export the model folder and run the held-out evaluation")
    ap.add_argument("--train-seconds", type=float, required=True)
    ap.add_argument("--total-train-seconds", type=float, required=True)
    ap.add_argument("--budget", type=int, default=65536, help="tokens (with padding) per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick-eval-every", type=float, default=150.0, help="seconds between quick evaluations")
    ap.add_argument("--quick-eval-n", type=int, default=12)
    ap.add_argument("--curriculum", default="a", choices=sorted(CURRICULA))
    ap.add_argument("--restart-schedule", action="store_true",
                    help="learning-rate and length schedule run over this call alone (weights are resumed)")
    ap.add_argument("--end-eval-n", type=int, default=30, help="end-of-call quick evaluation (0: none)")
    ap.add_argument("--deadline", type=float, default=585.0,
                    help="seconds from start by which the final evaluation must stop")
    args = ap.parse_args()
    t_start = time.time()

    import multiprocessing as mp

    import numpy as np  # noqa: F401
    import torch
    import torch.nn.functional as F
    import transformers
    from tokenizers import Tokenizer

    import eval_rag as E

    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.work, "train_log.jsonl")
    tok_path = os.path.join(args.work, "tokenizer.json")
    log(f"torch {torch.__version__} transformers {transformers.__version__} cuda {torch.cuda.is_available()}")

    if args.init:
        ts = time.time()
        tok, n_bpe, nchars = train_tokenizer()
        write_tokenizer(tok, args.work)
        log(f"tokenizer: {n_bpe} BPE tokens + specials {[tok.token_to_id(s) for s in SPECIALS]} "
            f"from {nchars / 1e6:.1f} M chars in {time.time() - ts:.1f} s")
        if os.path.exists(log_path):
            os.remove(log_path)
    tok = Tokenizer.from_file(tok_path)
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")

    def encode_batch(texts):
        return [e.ids for e in tok.encode_batch(texts)]

    # data workers first (spawned before CUDA is touched)
    ctx = mp.get_context("spawn")
    progress = ctx.Value("d", 0.0)
    queue = ctx.Queue(maxsize=64)
    state = {"step": 0, "trained_s": 0.0, "tokens": 0, "calls": 0}
    ck = None
    if not args.init:
        ck = load_parts(args.work)
        state = ck["state"]
    sched0 = 0.0 if args.restart_schedule else state["trained_s"]
    progress.value = sched0 / args.total_train_seconds
    procs = [ctx.Process(target=worker_main, args=(w, args.seed * 1000 + state["calls"], tok_path, queue, progress,
                                                    args.budget, eos, pad, args.curriculum), daemon=True)
             for w in range(args.workers)]
    for p_ in procs:
        p_.start()

    cfg = transformers.Qwen3_5TextConfig(**MODEL_KW, eos_token_id=eos, pad_token_id=pad)
    try:
        cfg._attn_implementation = "sdpa"
    except Exception as e:  # noqa: BLE001
        log(f"could not set sdpa on the config: {e}")
    torch.manual_seed(args.seed)
    model = transformers.Qwen3_5ForCausalLM(cfg)
    if ck is not None:
        missing, unexpected = model.load_state_dict(ck["model"], strict=False)
        log(f"resumed step {state['step']} trained {state['trained_s']:.0f} s; missing {missing} unexpected {unexpected}")
    model = model.cuda()
    log(f"attention implementation: {model.config._attn_implementation}")
    nparams = sum(p.numel() for p in model.parameters())
    log(f"model: {nparams / 1e6:.3f} M parameters (bf16 {nparams * 2 / 2**20:.2f} MiB), layers {cfg.layer_types}")
    patched = patch_gdn(model)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)

    qw = CURRICULA[args.curriculum]["question_weight"]

    def forward_loss(x, y, c=None):
        """(weighted loss to optimise, answer-token cross-entropy, answer-token accuracy)"""
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = model.model(input_ids=x, use_cache=False).last_hidden_state
            sel = y != -100
            logits = model.lm_head(h[sel]).float()
        tgt = y[sel]
        ce = F.cross_entropy(logits, tgt, reduction="none")
        ans = torch.ones_like(ce, dtype=torch.bool) if c is None else (c[sel] == 2)
        w = torch.where(ans, 1.0, qw)
        loss = (ce * w).sum() / w.sum()
        ans_f = ans.float()
        ans_ce = (ce * ans_f).sum() / ans_f.sum().clamp(min=1)
        acc = ((logits.argmax(-1) == tgt).float() * ans_f).sum() / ans_f.sum().clamp(min=1)
        return loss, ans_ce, acc

    def quick_eval(set_name, n):
        model.eval()
        res = []
        for t in R.TASKS:
            res += E.run_examples(model, encode_batch, lambda ids: tok.decode(ids, skip_special_tokens=True),
                                  eos, pad, E.eval_examples(set_name, t, n), "cuda")
        model.train()
        return E.summarize(res), res

    def write_log(rec):
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    # smoke: throughput per sequence length (random ids, no optimizer step), generation, export + reload
    if args.init:
        model.train()
        for L in (1600, 4000, 8000, 12000):
            bsz = max(1, args.budget // L)
            x = torch.randint(0, N_BPE, (bsz, L), device="cuda")
            y = torch.where(torch.rand(bsz, L, device="cuda") < 0.01, x, torch.full_like(x, -100))
            for rep in range(2):
                torch.cuda.synchronize()
                ts = time.time()
                loss, _, _ = forward_loss(x, y)
                loss.backward()
                torch.cuda.synchronize()
                dt = time.time() - ts
            opt.zero_grad(set_to_none=True)
            log(f"smoke L={L} batch={bsz}: {dt * 1000:.0f} ms/step, {bsz * L / dt / 1e3:.0f} k tok/s, "
                f"max mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        s, _ = quick_eval("smoke", 1)
        log(f"smoke generate ok: {s}")
        ts = time.time()
        tmp = "/tmp/hypic_export_smoke"
        export_model(model, tok, tmp)
        r = subprocess.run([sys.executable, os.path.join(HERE, "eval_rag.py"), "--model", tmp, "--sets", "smoke",
                            "--n", "1"], capture_output=True, text=True)
        log(f"smoke export+eval_rag.py rc={r.returncode} ({time.time() - ts:.1f} s): {r.stdout[-600:]} {r.stderr[-1500:]}")

    # training
    model.train()
    state["calls"] += 1
    t0 = time.time()
    t_last_eval = t0
    base_trained = state["trained_s"]
    step0 = state["step"]
    state.setdefault("history", []).append({"call": state["calls"], "curriculum": args.curriculum,
                                            "start_step": step0, "train_seconds": args.train_seconds,
                                            "schedule_seconds": args.total_train_seconds, "lr": args.lr,
                                            "restart_schedule": args.restart_schedule})
    agg = {"loss": 0.0, "wloss": 0.0, "acc": 0.0, "n": 0, "tok": 0, "padtok": 0}
    t_log = time.time()
    warmup = args.warmup
    log(f"training {args.train_seconds:.0f} s from progress {progress.value:.3f} (warmup {warmup} steps)")
    try:
        while True:
            el = time.time() - t0
            if el >= args.train_seconds:
                break
            p = (sched0 + el) / args.total_train_seconds
            progress.value = p
            lr = lr_at(p, state["step"] - step0, args.lr, warmup)
            for gr in opt.param_groups:
                gr["lr"] = lr
            bx, by, bc, si = queue.get(timeout=180)
            x = torch.from_numpy(bx).to("cuda", non_blocking=True).long()
            y = torch.from_numpy(by).to("cuda", non_blocking=True).long()
            c = torch.from_numpy(bc).to("cuda", non_blocking=True)
            loss, ans_ce, acc = forward_loss(x, y, c)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            state["step"] += 1
            ntok = int((bx != pad).sum())
            state["tokens"] += ntok
            agg["loss"] += ans_ce.detach()
            agg["wloss"] += loss.detach()
            agg["acc"] += acc.detach()
            agg["n"] += 1
            agg["tok"] += ntok
            agg["padtok"] += bx.size
            if state["step"] % 25 == 0:
                dt = time.time() - t_log
                rec = {"step": state["step"], "trained_s": round(base_trained + time.time() - t0, 1),
                       "progress": round(p, 4), "stage": si, "curriculum": args.curriculum,
                       "loss": round(float(agg["loss"]) / agg["n"], 4),
                       "weighted_loss": round(float(agg["wloss"]) / agg["n"], 4),
                       "answer_token_acc": round(float(agg["acc"]) / agg["n"], 4), "lr": round(lr, 7),
                       "tokens_per_s": round(agg["tok"] / dt), "padded_tokens_per_s": round(agg["padtok"] / dt),
                       "tokens_seen": state["tokens"], "rows": int(bx.shape[0]), "seq_len": int(bx.shape[1]),
                       "queue": queue.qsize()}
                write_log(rec)
                if state["step"] % 100 == 0:
                    log(json.dumps(rec))
                agg = {"loss": 0.0, "wloss": 0.0, "acc": 0.0, "n": 0, "tok": 0, "padtok": 0}
                t_log = time.time()
            if time.time() - t_last_eval > args.quick_eval_every and args.train_seconds - (time.time() - t0) > 60:
                te = time.time()
                s, _ = quick_eval("moderate", args.quick_eval_n)
                write_log({"step": state["step"], "tokens_seen": state["tokens"], "eval_set": "moderate",
                           "eval_n": args.quick_eval_n, "eval": {t: {"score": v["score"]} for t, v in s.items()}})
                log(f"quick eval step {state['step']}: " + json.dumps({t: v["score"] for t, v in s.items()})
                    + f" ({time.time() - te:.1f} s)")
                t0 += time.time() - te  # evaluation time does not count as training time
                t_last_eval = time.time()
    finally:
        state["trained_s"] = base_trained + min(time.time() - t0, args.train_seconds)
        for p_ in procs:
            p_.terminate()
        sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
        nbytes = save_parts({"model": sd, "state": state, "model_kw": MODEL_KW}, args.out)
        log(f"checkpoint: step {state['step']} trained {state['trained_s']:.0f} s tokens {state['tokens']} "
            f"({nbytes / 2**20:.1f} MiB in parts); patched GDN {patched}")

    # end-of-call evaluation
    if args.end_eval_n > 0:
        te = time.time()
        s, _ = quick_eval("moderate", args.end_eval_n)
        write_log({"step": state["step"], "tokens_seen": state["tokens"], "eval_set": "moderate",
                   "eval_n": args.end_eval_n, "eval": {t: {"score": v["score"]} for t, v in s.items()}})
        log(f"end-of-call eval step {state['step']}: {json.dumps(s)} ({time.time() - te:.1f} s)")

    def write_bundle(files):
        with tarfile.open(os.path.join(args.out, "bundle.tar"), "w") as tf:
            for f in files:
                if os.path.exists(f):
                    tf.add(f, arcname=os.path.basename(f))

    if not args.final:
        write_bundle([log_path, os.path.join(args.work, "tokenizer.json"),
                      os.path.join(args.work, "tokenizer_config.json")])
    else:
        # export first, so that the model comes back even if the evaluation runs out of time
        mdir = "/tmp/hypic-mini"
        export_model(model, tok, mdir)
        import shutil

        shutil.copy(os.path.join(mdir, "model.safetensors"), os.path.join(args.out, "model.safetensors"))
        log(f"model.safetensors {os.path.getsize(os.path.join(mdir, 'model.safetensors'))} bytes")

        def small_files():
            return [log_path] + [os.path.join(mdir, f) for f in sorted(os.listdir(mdir)) if f != "model.safetensors"]

        try:
            plot_log(log_path, os.path.join(mdir, "loss.png"))
        except Exception as e:  # noqa: BLE001
            log(f"plot failed: {e}")
        write_bundle(small_files())
        te = time.time()
        limit = max(30.0, args.deadline - (time.time() - t_start))
        r = subprocess.run([sys.executable, os.path.join(HERE, "eval_rag.py"), "--model", mdir, "--sets", "moderate",
                            "--n-aggregate", "50", "--time-limit", str(limit),
                            "--out", os.path.join(mdir, "eval.json"), "--preds", os.path.join(mdir, "preds.jsonl")],
                           capture_output=True, text=True)
        log(f"eval_rag.py rc={r.returncode} ({time.time() - te:.1f} s)\n{r.stdout[-5000:]}\n{r.stderr[-2000:]}")
        write_bundle(small_files())
    log(f"done in {time.time() - t_start:.0f} s; out: {sorted(os.listdir(args.out))}")


if __name__ == "__main__":
    main()
