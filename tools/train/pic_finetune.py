#!/usr/bin/env python3
"""PIC-aware fine-tuning of any Qwen3.5-architecture checkpoint (a model folder: config.json,
model.safetensors, tokenizer.json): the multi-document tasks of tools/tasks/rag_tasks.py, each
example trained either under full recompute or under hypic's pic mode exactly as the engine
computes it (pic_forward.py; check_pic_forward.py checks the two agree), with the loss on the
answer tokens and, optionally, a distillation term pulling pic's answer distribution toward full
recompute's (Block-Attention / KVLink did this for attention-only models; here the linear layers'
composed states are in the graph too).

Usage (a GPU machine with torch; CPU works for a smoke run):
    python3 tools/train/pic_finetune.py --model models/default --out /tmp/ft --seconds 600
        [--pic-frac 0.5] [--kd 0.5] [--seam 8] [--lr 2e-4] [--task-mix lookup=0.3,twohop=0.2,aggregate=0.5]
        [--long-frac 0.25 --long-micro 2]   (a share of examples with 1,000-2,500-token documents)
        [--full-rows 65536 --full-rows-mix lookup=0.2,twohop=0.4,twohop_drill=0.3,aggregate=0.1]
                                            (train.py's packed multi-question rows under full recompute)
        [--twohop-bridge]                   (two-hop answers name the bridge entity first)
        [--to-attention 2,8 --new-lr-mult 2.5]  (those linear layers become full-attention ones first)
Writes OUT/model (the fine-tuned folder, bf16 weights as the input's; also every --save-every
seconds, so that a crash leaves the last weights; a step that runs out of GPU memory is skipped and
logged, four in a row stop the run), OUT/log.jsonl (per step:
loss by mode; every --eval-every seconds: held-out teacher-forced answer accuracy (per token and whole answers) under full and
pic), and prints a summary.

One loop for both sides: --full-rows T adds to every optimizer step a batch of ~T tokens of train.py's
packed full-recompute rows (several questions a prompt, documents out of the loss, answers and
questions in it, bf16 autocast on the GPU), drawn by --full-rows-workers processes. Run as two phases
(train.py, then this script), full recompute's two-hop rose 57 -> 70 and pic's adaptation fell back;
trained together each step pulls on both (tools/train/README.md; with 64 k tokens of rows a step of
32 examples took 4.4 s on an H100, against 3.9 s without rows at a smaller pic share).

Cost: one pic example costs an isolated prefill of every document plus a composition pass (about
two full forwards), so a step of pic examples costs ~2x a full step.
"""

import argparse
import json
import os
import random
import sys
import time

# Packed rows and pic examples of varying sizes fragment the caching allocator: attempt 13 died of an
# out-of-memory error at step ~200 on an 80 GB H100 with 10.9 GiB reserved but unallocated.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tools", "tasks"))

import rag_tasks as R  # noqa: E402
from hybrid import convert_to_attention, load_folder, save_folder  # noqa: E402
from pic_forward import pic_logits, pic_logits_batch  # noqa: E402
import train as T  # noqa: E402
from train import load_tokenizer, train_prompt  # noqa: E402
from eval_rag import EVAL_SETS  # noqa: E402


def sizes(name):
    """(documents, tokens per document) ranges of one of eval_rag.py's held-out sets."""
    s = EVAL_SETS[name]
    return (s["min_docs"], s["max_docs"]), (s["min_doc_tokens"], s["max_doc_tokens"])


# Prompt sizes of the held-out "moderate" set: 4-16 documents of 100-400 tokens; and of the
# "longdocs" set: 3-6 documents of 1,000-2,500 tokens. Training on the moderate sizes alone cost full
# recompute 25 points of aggregation on long documents (docs/quality.md), so --long-frac mixes long
# ones in, and the held-out evaluation reports both sizes.
DOCS, DOC_TOK = sizes("moderate")
LONG_DOCS, LONG_DOC_TOK = sizes("longdocs")


def example(rng, encode, eos, task, long=False):
    """segments (ids; the last is the question), answer ids (+ eos)."""
    n = rng.randint(*(LONG_DOCS if long else DOCS))
    words = [max(8, int(round(rng.randint(*(LONG_DOC_TOK if long else DOC_TOK)) / R.TOKENS_PER_WORD)))
             for _ in range(n)]
    segs, qa = train_prompt(rng, task, words)  # twohop_drill: every candidate carries the asked attribute
    q, ans = qa[0][0], qa[0][1]
    texts = [s + "\n" for s in segs[:-1]] + [R.question_segment(q) + "\n", ans]
    enc = encode(texts)
    return enc[:-1], enc[-1] + [eos]


def answer_logits(model, segs, ans, mode, seam):
    """Logits of the rows that predict each answer token, under `mode` (full or pic)."""
    return answer_logits_batch(model, [(segs, ans)], mode, seam)[0]


def answer_logits_batch(model, exs, mode, seam):
    """answer_logits() of several examples [(segs, ans)] in one forward (right-padded for full)."""
    qs = [segs[-1] + ans[:-1] for segs, ans in exs]
    if mode == "pic":
        lgs = pic_logits_batch(model, [segs[:-1] + [q] for (segs, _), q in zip(exs, qs)], seam=seam)
        return [lg[len(segs[-1]) - 1:] for lg, (segs, _) in zip(lgs, exs)]
    flats = [[t for s in segs[:-1] for t in s] + q for (segs, _), q in zip(exs, qs)]
    dev = model.model.embed_tokens.weight.device
    L = max(len(f) for f in flats)
    h = model.hidden(torch.tensor([f + [0] * (L - len(f)) for f in flats], device=dev))
    return [model.logits(h[b, len(f) - len(ans):len(f)]) for b, (f, (_, ans)) in enumerate(zip(flats, exs))]


ROWS_CHUNK = 65536  # tokens of packed rows in one forward (the activations of ~200 k OOM an 80 GB H100)


def rows_chunks(a):
    """(batches a step, tokens each): --full-rows tokens as forwards of at most ROWS_CHUNK tokens."""
    n = max(1, -(-a.full_rows // ROWS_CHUNK))
    return n, -(-a.full_rows // n)


def stage_plan(spec):
    """--full-rows-stage: "2" (one stage throughout) or "0,1@150,2@400" (stage 0 from the start, 1 from
    second 150 of training, 2 from second 400) -> [(from second, stage)]."""
    plan = []
    for i, part in enumerate(spec.split(",")):
        st, _, at = part.partition("@")
        try:
            k, t = int(st), float(at) if at else 0.0
        except ValueError:
            raise SystemExit(f"--full-rows-stage: {part!r} is not STAGE or STAGE@SECONDS")
        if not 0 <= k < len(T.STAGES):
            raise SystemExit(f"--full-rows-stage: {k} is not a stage of train.py (0-{len(T.STAGES) - 1})")
        if (i == 0) != (t == 0) or (plan and t <= plan[-1][0]):
            raise SystemExit(f"--full-rows-stage: {spec!r}: the first stage starts at 0, later ones at increasing seconds")
        plan.append((t, k))
    return plan


def stage_at(plan, seconds):
    return [k for t, k in plan if t <= seconds][-1]


def row_source(a, tok_path, eos, first):
    """(next, set_stage): next() returns the next packed batch of train.py's full-recompute rows (numpy
    x, y, kind, ...), rows_chunks(a)[1] tokens each, drawn by spawned workers (or in this process with
    0 workers) at the curriculum stage set_stage(k) last set (`first` until then)."""
    budget = rows_chunks(a)[1]
    mix = [(t, float(w)) for t, w in (kv.split("=") for kv in a.full_rows_mix.split(","))]
    bad = [t for t, _ in mix if t not in T.TRAIN_TASKS]
    if bad:
        raise SystemExit(f"--full-rows-mix: unknown task {bad[0]!r} (tasks: {', '.join(T.TRAIN_TASKS)})")
    if a.full_rows_workers > 0:
        import multiprocessing as mp
        import queue as queue_mod

        ctx = mp.get_context("spawn")
        stage, queue = ctx.Value("i", first), ctx.Queue(maxsize=32)
        procs = [ctx.Process(target=T.worker_main, daemon=True,  # pad = eos: padding is out of the loss
                             args=(w, f"pic-ft-{a.seed}", tok_path, queue, stage, budget, eos, eos, mix, 0.0,
                                   T.BIND_NUMBERS[0], a.twohop_bridge)) for w in range(a.full_rows_workers)]
        for p in procs:
            p.start()

        def get(keep=(stage, procs)):  # holds the shared stage value: the workers unpickle it after we return
            return queue.get(timeout=300)

        def set_stage(k):
            stage.value = k
            try:  # drop the batches drawn at the old stage (up to 32 steps' worth would lag the plan)
                while True:
                    queue.get_nowait()
            except queue_mod.Empty:
                pass
        return get, set_stage
    T.TASK_P[:] = mix
    rng = random.Random(f"pic-ft-rows/{a.seed}")
    encode_batch = load_tokenizer(tok_path)[0]
    pool, cur = [], [first]

    def nxt():
        if not pool:
            pool.extend(T.make_batches(rng, encode_batch, cur[0], budget, eos, eos))
        return pool.pop()

    def set_stage(k):
        cur[0] = k
        pool.clear()
    return nxt, set_stage


def rows_loss(model, batch, device):
    """train.py's loss on one packed batch with documents left out: (weighted loss, answer ce)."""
    x, y, kd = (torch.from_numpy(v).to(device) for v in batch[:3])
    sel = (y != -100) & (kd > 0)
    dt = torch.device(device).type
    with torch.autocast(dt, dtype=torch.bfloat16, enabled=dt == "cuda"):
        logits = model.logits(model.hidden(x)[sel]).float()
    ce = F.cross_entropy(logits, y[sel], reduction="none")
    k = kd[sel].long()
    w = torch.tensor([0.0, T.WEIGHT[1], T.WEIGHT[2]], device=device)[k]
    ans = (k == 2).float()
    return (ce * w).sum() / w.sum().clamp(min=1e-6), (ce * ans).sum() / ans.sum().clamp(min=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--accum", type=int, default=8, help="examples per optimizer step")
    ap.add_argument("--micro", type=int, default=8, help="examples per forward (pic and full ones batched apart)")
    ap.add_argument("--pic-frac", type=float, default=0.5, help="share of examples trained in pic mode")
    ap.add_argument("--kd", type=float, default=0.5, help="weight of KL(full || pic) on pic examples' answers")
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--task-mix", default="lookup=0.3,twohop=0.2,aggregate=0.5",
                    help="tasks of tools/tasks/rag_tasks.py, and twohop_drill: two-hop prompts whose facts share "
                    "one or two attributes, so that only the bridge entity tells the candidates apart")
    ap.add_argument("--long-frac", type=float, default=0.0,
                    help="share of training examples with long documents (the longdocs set's sizes)")
    ap.add_argument("--long-micro", type=int, default=2,
                    help="examples per forward when they have long documents (memory: ~6x the tokens)")
    ap.add_argument("--eval-long-n", type=int, default=0,
                    help="held-out long-document examples per task (0: --eval-n when --long-frac > 0)")
    ap.add_argument("--full-rows", type=int, default=0,
                    help="tokens (padding included) of train.py's packed full-recompute rows added to every step")
    ap.add_argument("--full-rows-mix", default="lookup=0.2,twohop=0.4,twohop_drill=0.3,aggregate=0.1",
                    help="task mix of the packed rows (train.py's tasks, drills included)")
    ap.add_argument("--twohop-bridge", action="store_true",
                    help="two-hop answers (pic examples, rows, held-out) name the bridge entity first")
    ap.add_argument("--full-rows-stage", default="3",
                    help="train.py curriculum stage of the packed rows, or a plan by training seconds: "
                         "0,1@150,2@400 (short prompts teach a new skill first: docs/quality.md, forty-second session)")
    ap.add_argument("--full-rows-weight", type=float, default=1.0, help="weight of the packed rows' loss")
    ap.add_argument("--full-rows-workers", type=int, default=4, help="processes drawing them (0: in this one)")
    ap.add_argument("--eval-every", type=float, default=120)
    ap.add_argument("--eval-n", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=0, help="optimizer steps of linear lr warm-up")
    ap.add_argument("--decay-seconds", type=float, default=0, help="lr decays linearly to 10%% over the last S seconds")
    ap.add_argument("--resume", help="a --save-state file to continue from (weights and optimizer), if it exists")
    ap.add_argument("--save-state", help="write fp32 weights and optimizer state here at the end")
    ap.add_argument("--save-every", type=float, default=300.0,
                    help="seconds between saves of the weights to OUT/model while training (0: at the end only)")
    ap.add_argument("--to-attention", default="",
                    help="comma-separated linear-attention layers to turn into full-attention ones first (new "
                    "mixers, output projection zero; config.json's layer_types follows)")
    ap.add_argument("--new-lr-mult", type=float, default=1.0, help="lr multiplier of the --to-attention layers' mixers")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    plan = stage_plan(a.full_rows_stage)  # a bad plan stops the run before the model loads
    T.TWOHOP_BRIDGE[0] = a.twohop_bridge

    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    model = load_folder(a.model).float().to(a.device).train()
    tok = os.path.join(a.model, "tokenizer.json")
    encode, decode, tid = load_tokenizer(tok)
    eos = tid("<|im_end|>")
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    try:
        new = convert_to_attention(model, [int(i) for i in a.to_attention.split(",") if i.strip()])
    except ValueError as e:
        raise SystemExit(f"--to-attention: {e}")
    cfg["layer_types"] = model.cfg["layer_types"]
    mix = [(t, float(w)) for t, w in (kv.split("=") for kv in a.task_mix.split(","))]
    new_ids = {id(p) for p in new}
    groups = [{"params": [p for p in model.parameters() if id(p) not in new_ids], "mult": 1.0}]
    if new:
        groups.append({"params": new, "mult": a.new_lr_mult})
        print(f"layers {a.to_attention} now full attention: layer_types {cfg['layer_types']}", flush=True)
    opt = torch.optim.AdamW(groups, lr=a.lr, weight_decay=0.0)
    if a.resume and os.path.exists(a.resume):
        st = torch.load(a.resume, map_location=a.device)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        print(f"resumed from {a.resume}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    logf = open(os.path.join(a.out, "log.jsonl"), "w")
    held = [(t, example(random.Random(f"heldout/{t}/{i}"), encode, eos, t)) for t, _ in mix for i in range(a.eval_n)]
    long_n = a.eval_long_n or (a.eval_n if a.long_frac > 0 else 0)
    held_long = [(t, example(random.Random(f"heldout-long/{t}/{i}"), encode, eos, t, long=True))
                 for t, _ in mix for i in range(long_n)]

    def pick():
        r, acc = rng.random() * sum(w for _, w in mix), 0.0
        for t, w in mix:
            acc += w
            if r < acc:
                return t
        return mix[-1][0]

    def evaluate():
        model.eval()
        res = {}
        with torch.no_grad():
            for prefix, examples, micro in (("", held, a.micro), ("long/", held_long, a.long_micro)):
                for mode in ("full", "pic"):
                    for t, _ in mix:
                        exs = [e for tt, e in examples if tt == t]
                        if not exs:
                            continue
                        hit = tot = whole = 0
                        for i in range(0, len(exs), micro):
                            part = exs[i:i + micro]
                            for lg, (_, ans) in zip(answer_logits_batch(model, part, mode, a.seam), part):
                                right = [int(p == y) for p, y in zip(lg.argmax(-1).tolist(), ans)]
                                hit, tot, whole = hit + sum(right), tot + len(ans), whole + int(all(right))
                        res[f"{prefix}{mode}/{t}"] = round(hit / max(tot, 1), 4)
                        # every answer token right, teacher-forced: close to what greedy exact match scores
                        res[f"{prefix}{mode}/{t}/exact"] = round(whole / max(len(exs), 1), 4)
        model.train()
        return res

    rows_stage = plan[0][1]
    next_rows, set_stage = row_source(a, tok, eos, rows_stage) if a.full_rows > 0 else (None, None)
    first = evaluate()
    print("before:", json.dumps(first), flush=True)
    logf.write(json.dumps({"step": 0, "seconds": 0, "eval": first}) + "\n")

    def save(to):
        save_folder(model, to, a.model, eos, cfg.get("pad_token_id"), dtype=cfg.get("dtype", "float32"), config=cfg)

    def step_backward(losses):
        """One optimizer step's forwards and backwards: gradients accumulate, `losses` is filled in."""
        done = 0
        while done < a.accum:
            # a forward holds examples of one size: long ones in smaller groups
            long = a.long_frac > 0 and rng.random() < a.long_frac  # no draw at 0: earlier runs' stream
            k = min(a.long_micro if long else a.micro, a.accum - done)
            exs = [example(rng, encode, eos, pick(), long=long) for _ in range(k)]
            done += k
            pic = [rng.random() < a.pic_frac for _ in exs]
            loss = 0.0
            for mode in ("pic", "full"):
                part = [e for e, p in zip(exs, pic) if p == (mode == "pic")]
                if not part:
                    continue
                lgs = answer_logits_batch(model, part, mode, a.seam)
                if mode == "pic" and a.kd > 0:
                    with torch.no_grad():
                        refs = answer_logits_batch(model, part, "full", a.seam)
                for j, (lg, (_, ans)) in enumerate(zip(lgs, part)):
                    l = F.cross_entropy(lg.float(), torch.tensor(ans, device=a.device))
                    losses[mode].append(l.detach())
                    if mode == "pic" and a.kd > 0:
                        kd = F.kl_div(F.log_softmax(lg.float(), -1), F.log_softmax(refs[j].float(), -1),
                                      log_target=True, reduction="batchmean")
                        losses["kd"].append(kd.detach())
                        l = l + a.kd * kd
                    loss = loss + l
            (loss / a.accum).backward()
        if next_rows:
            nb = rows_chunks(a)[0]
            losses["rows"], losses["rows_ans"] = [], []
            for _ in range(nb):  # one backward a batch: the gradient of their mean, in bounded memory
                rl, ra = rows_loss(model, next_rows(), a.device)
                (a.full_rows_weight * rl / nb).backward()
                losses["rows"].append(rl.detach())
                losses["rows_ans"].append(ra.detach())

    class NoOom(Exception):  # a torch without the out-of-memory class: nothing is caught
        pass

    oom_error = getattr(torch, "OutOfMemoryError", getattr(torch.cuda, "OutOfMemoryError", NoOom))
    t0 = time.time()  # --seconds of training, the evaluations before and after not counted
    step, last_eval, last_save, ooms = 0, time.time(), time.time(), 0
    while time.time() - t0 < a.seconds:
        if a.save_every and time.time() - last_save > a.save_every:  # a crash later leaves these weights
            save(os.path.join(a.out, "model"))
            last_save = time.time()
            logf.write(json.dumps({"step": step, "seconds": round(time.time() - t0, 1), "saved": "model"}) + "\n")
        now_stage = stage_at(plan, time.time() - t0)
        if next_rows and now_stage != rows_stage:
            rows_stage = now_stage
            set_stage(rows_stage)
            logf.write(json.dumps({"step": step, "seconds": round(time.time() - t0, 1), "rows_stage": rows_stage}) + "\n")
        opt.zero_grad(set_to_none=True)
        left = a.seconds - (time.time() - t0)
        scale = min(1.0, (step + 1) / a.warmup) if a.warmup else 1.0
        if a.decay_seconds and left < a.decay_seconds:
            scale *= 0.1 + 0.9 * max(left, 0.0) / a.decay_seconds
        for grp in opt.param_groups:
            grp["lr"] = a.lr * scale * grp.get("mult", 1.0)
        losses = {"full": [], "pic": [], "kd": [], "rows": [], "rows_ans": []}
        try:
            step_backward(losses)
            oom = False
        except oom_error:  # the traceback holds the step's tensors: freed once this clause ends
            oom = True
        if oom:  # drop this step's examples and go on; a persistent shortage still stops the run
            ooms += 1
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            print(json.dumps({"step": step, "oom": ooms}), flush=True)
            logf.write(json.dumps({"step": step, "seconds": round(time.time() - t0, 1), "oom": ooms}) + "\n")
            if ooms > 3:
                save(os.path.join(a.out, "model"))
                raise SystemExit(f"out of GPU memory in {ooms} steps in a row; the weights so far are in {a.out}/model")
            continue
        ooms = 0
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        rec = {"step": step, "seconds": round(time.time() - t0, 1), "lr": round(a.lr * scale, 7)}
        rec.update({k: round(torch.stack(v).mean().item(), 4) for k, v in losses.items() if v})
        if step % 25 == 0:
            print(json.dumps(rec), flush=True)
        if time.time() - last_eval > a.eval_every:
            last_eval = time.time()
            rec["eval"] = evaluate()
            print(json.dumps(rec), flush=True)
        logf.write(json.dumps(rec) + "\n")
        logf.flush()
    final = evaluate()
    logf.write(json.dumps({"step": step, "seconds": round(time.time() - t0, 1), "eval": final}) + "\n")
    print("after:", json.dumps(final), f"({step} steps, {time.time() - t0:.0f} s)", flush=True)
    if a.save_state:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, a.save_state)
    save(os.path.join(a.out, "model"))


if __name__ == "__main__":
    main()
