#!/usr/bin/env python3
"""Build tiny random-weight hybrid-attention checkpoints and HF transformers reference outputs.

Produces, for each architecture below, a folder <out>/<name>/ holding
    config.json, model.safetensors, generation_config.json   (save_pretrained, safetensors)
    tokenizer.json, tokenizer_config.json                      (byte-level BPE trained here)
    reference.safetensors                                      (prompts, log-probs, greedy ids)
    reference.json                                             (versions, stats, saved keys)

Requirements: torch, transformers (written against 5.17), tokenizers, safetensors, numpy.
Everything runs on the CPU in float32, single-threaded and deterministic, so a re-run with
the same library versions and seed regenerates the files bit-identically.

Usage:
    python3 tools/reference/make_reference.py [--out tests/data/models] [--corpus DIR]
        [--seed 1234] [--only name,name] [--inspect FILE]
"""

import argparse
import copy
import glob
import inspect
import json
import math
import os
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # CPU only, on purpose

import torch  # noqa: E402

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

import transformers  # noqa: E402
import tokenizers  # noqa: E402
import safetensors  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# ----------------------------------------------------------------------------------------------
# shapes (shared by every model)
VOCAB = 512
N_BPE = 509  # 256 byte symbols + 253 merges; the three special tokens take ids 509..511
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HIDDEN = 64
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
N_LAYERS = len(LAYER_TYPES)
PROMPT_A_LEN = 150
PROMPT_B_LEN = 3
N_NEW = 24

# std of the random weights (see randomize())
EMB_STD = 0.5  # embeddings (tied: also the LM head)
LM_HEAD_STD = 0.5  # untied LM head, per element (logit std ~ LM_HEAD_STD * sqrt(HIDDEN))
NORM_STD = 0.3  # zero-centred RMSNorm weights w in x_hat * (1 + w); gated GDN norm: 1 + N(0, 0.3)
ROUTER_GAIN = 2.0  # router logits std ~ ROUTER_GAIN
A_LOG_MEAN, A_LOG_STD = -1.0, 0.7
DT_BIAS_STD = 0.5
CONV_STD = 0.5
# greedy steps must be decisive: a model seed is accepted only if every greedy step of both prompts has a
# top-2 log-prob margin >= MIN_GREEDY_MARGIN (otherwise the next seed is tried, deterministically)
MIN_GREEDY_MARGIN = 0.02
MAX_SEED_ATTEMPTS = 20

QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOKENIZER_SAMPLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Hybrid attention models interleave linear and full attention layers.",
    "  leading spaces,\ttabs and\n\nnewlines\r\n",
    "I'm sure they'll say it's what we've DONE, isn't it?",
    "Numbers: 3.25x faster, 12345 tokens, 2026-11-29.",
    "caf\u00e9 na\u00efve \u00e9migr\u00e9 (NFC: cafe\u0301)",
    "\u6df7\u5408\u6ce8\u610f\u529b \u0433\u0438\u0431\u0440\u0438\u0434 \U0001f642",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "trailing space ",
]
CHAT_SAMPLE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Explain linear attention in one sentence."},
]


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------------
# tokenizer
def train_tokenizer(corpus_dir):
    files = sorted(glob.glob(os.path.join(corpus_dir, "*")))
    texts = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            texts.append(fh.read())
    if not texts:
        raise SystemExit(f"no corpus files in {corpus_dir}")

    def build():
        tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=N_BPE,
            min_frequency=2,
            show_progress=False,
            special_tokens=[],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
        n = tok.get_vocab_size(with_added_tokens=True)
        if n != N_BPE:
            raise SystemExit(f"BPE training gave {n} tokens, wanted {N_BPE}: corpus too small?")
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
        return tok

    tok = build()
    if build().to_str() != tok.to_str():  # the trainer must be deterministic for bit-identical re-runs
        raise SystemExit("tokenizer training is not deterministic")
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    assert ids == {SPECIALS[0]: 509, SPECIALS[1]: 510, SPECIALS[2]: 511}, ids
    return tok, [os.path.basename(f) for f in files]


def tokenizer_config(tokenizer_class):
    added = {
        str(509 + i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, s in enumerate(SPECIALS)
    }
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
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": tokenizer_class,
        "unk_token": None,
    }


def write_tokenizer(tok, folder, tokenizer_class):
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(tokenizer_class), f, indent=2, ensure_ascii=False)
        f.write("\n")


def choose_tokenizer_class(tok, tmpdir):
    """Pick a tokenizer_class that transformers' AutoTokenizer loads to the same ids as `tok`."""
    from transformers import AutoTokenizer

    notes = {}
    for cls in ["Qwen2Tokenizer", "PreTrainedTokenizerFast", "TokenizersBackend"]:
        d = os.path.join(tmpdir, "tok_" + cls)
        os.makedirs(d, exist_ok=True)
        write_tokenizer(tok, d, cls)
        try:
            at = AutoTokenizer.from_pretrained(d)
            ok = all(at.encode(s, add_special_tokens=False) == tok.encode(s).ids for s in TOKENIZER_SAMPLES)
            notes[cls] = f"{type(at).__name__}: {'ids match' if ok else 'ids DIFFER'}"
            if ok:
                return cls, at, notes
        except Exception as e:  # noqa: BLE001
            notes[cls] = f"failed: {type(e).__name__}: {e}"[:300]
    raise SystemExit(f"no tokenizer_class reproduces the tokenizers ids: {notes}")


# ----------------------------------------------------------------------------------------------
# configs
def text_kwargs(rope_theta, tie):
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=N_LAYERS,
        layer_types=list(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta), "partial_rotary_factor": 0.25},
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=tie,
        eos_token_id=511,
        pad_token_id=509,
        bos_token_id=None,
    )


MOE_KWARGS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION_KWARGS = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    in_channels=3,
    patch_size=2,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=HIDDEN,
    num_position_embeddings=16,
)


def vl_rope(kw):
    # rotary dim = 32 * 0.25 = 8 -> 4 frequencies, split T/H/W; text-only input uses equal T/H/W positions
    kw["rope_parameters"] = dict(kw["rope_parameters"], mrope_section=[2, 1, 1], mrope_interleaved=True)
    return kw


def make_model(name):
    T = transformers
    if name in ("qwen3_5_dense", "qwen3_5_dense_bf16"):
        cfg = T.Qwen3_5TextConfig(**text_kwargs(10000.0, tie=True))
        return T.Qwen3_5ForCausalLM(cfg)
    if name == "qwen3_5_vl":
        tk = vl_rope(text_kwargs(10000.0, tie=False))
        cfg = T.Qwen3_5Config(text_config=tk, vision_config=dict(VISION_KWARGS), tie_word_embeddings=False)
        return T.Qwen3_5ForConditionalGeneration(cfg)
    if name == "qwen3_5_moe":
        cfg = T.Qwen3_5MoeTextConfig(**text_kwargs(1e6, tie=False), **MOE_KWARGS)
        return T.Qwen3_5MoeForCausalLM(cfg)
    if name == "qwen3_5_moe_vl":
        tk = vl_rope(text_kwargs(10000.0, tie=False))
        tk.update(MOE_KWARGS)
        cfg = T.Qwen3_5MoeConfig(text_config=tk, vision_config=dict(VISION_KWARGS), tie_word_embeddings=False)
        return T.Qwen3_5MoeForConditionalGeneration(cfg)
    if name == "qwen3_next":
        cfg = T.Qwen3NextConfig(
            **text_kwargs(10000.0, tie=False),
            **MOE_KWARGS,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
        return T.Qwen3NextForCausalLM(cfg)
    if name == "nemotron_h":
        cfg = checked_config(T.NemotronHConfig, **common_kwargs(), **NEMOTRON_H_KWARGS)
        return T.NemotronHForCausalLM(cfg)
    if name == "kimi_linear":
        cfg = checked_config(T.KimiLinearConfig, **common_kwargs(), **KIMI_LINEAR_KWARGS)
        return T.KimiLinearForCausalLM(cfg)
    if name == "kimi_linear_rope":
        cfg = checked_config(T.KimiLinearConfig, **common_kwargs(), **KIMI_LINEAR_ROPE_KWARGS)
        return T.KimiLinearForCausalLM(cfg)
    if name == "minimax":
        cfg = checked_config(T.MiniMaxConfig, **common_kwargs(), **MINIMAX_KWARGS)
        return T.MiniMaxForCausalLM(cfg)
    raise KeyError(name)


# ---- the architectures beyond Qwen (issue 15): several layers of every kind, chunks shorter than prompt a
def common_kwargs():
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, max_position_embeddings=4096, tie_word_embeddings=False,
                eos_token_id=511, pad_token_id=509, bos_token_id=None)


# Nemotron-H: M = Mamba2, E = MoE, * = attention (no RoPE), - = ReLU^2 MLP; one mixer per block
NEMOTRON_H_KWARGS = dict(
    hybrid_override_pattern="ME*M-MM*E-",
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mlp_hidden_act="relu2",
    mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, expand=2, chunk_size=32,
    use_conv_bias=True, mamba_proj_bias=False,  # dt clamp: 5.17 applies time_step_min in prefill, not in decode
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
    n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5, layer_norm_epsilon=1e-5,
)
# Kimi-Linear: KDA linear layers, MLA full attention without RoPE, MoE (sigmoid, grouped top-k), layer 0 dense
KIMI_LINEAR_KWARGS = dict(
    num_hidden_layers=N_LAYERS, layer_types=list(LAYER_TYPES), first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=0, v_head_dim=16, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
    intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.446, hidden_act="silu", rms_norm_eps=1e-5,
)
# Kimi-Linear as the released 48B-A3B is shaped: the MLA keys keep a qk_rope_head_dim part from
# kv_a_proj_with_mqa, shared by every head (no rotation: the model is NoPE), queries of
# qk_nope + qk_rope per head; one group of experts.
KIMI_LINEAR_ROPE_KWARGS = dict(KIMI_LINEAR_KWARGS, qk_rope_head_dim=8, n_group=1, topk_group=1, num_experts_per_tok=3)
# MiniMax-Text-01 / M1: lightning attention (per-head decay, block-wise) and RoPE softmax attention, MoE,
# residual scaling factors (distinct values so that a swapped alpha/beta shows)
MINIMAX_KWARGS = dict(
    num_hidden_layers=N_LAYERS, layer_types=list(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, block_size=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    full_attn_alpha_factor=1.3, full_attn_beta_factor=0.9, linear_attn_alpha_factor=1.7,
    linear_attn_beta_factor=0.8, mlp_alpha_factor=1.2, mlp_beta_factor=1.1, rms_norm_eps=1e-5,
)


def checked_config(cls, **kw):
    """Build a config and check that every field we set reads back (a renamed field must fail here, not
    silently leave a default in the reference)."""
    cfg = cls(**kw)
    aliases = {"hybrid_override_pattern": None, "first_k_dense_replace": None}
    for k, v in kw.items():
        if k in aliases:
            continue
        got = getattr(cfg, k, "<missing>")
        if isinstance(v, tuple):
            v = list(v)
        if isinstance(got, tuple):
            got = list(got)
        if got != v:
            raise ValueError(f"{cls.__name__}: {k} = {v!r} was read back as {got!r}")
    return cfg


MODEL_NAMES = ["qwen3_5_dense", "qwen3_5_vl", "qwen3_5_moe", "qwen3_5_moe_vl", "qwen3_next", "qwen3_5_dense_bf16",
               "nemotron_h", "kimi_linear", "minimax", "kimi_linear_rope"]
MODEL_SEEDS = {"qwen3_5_dense": 0, "qwen3_5_vl": 1, "qwen3_5_moe": 2, "qwen3_5_moe_vl": 3, "qwen3_next": 4,
               "qwen3_5_dense_bf16": 0, "nemotron_h": 5, "kimi_linear": 6, "minimax": 7, "kimi_linear_rope": 8}
# RMSNorm weights that multiply directly (not Qwen's zero-centred 1 + w) get 1 + N(0, NORM_STD)
DIRECT_NORM_MODELS = ("nemotron_h", "kimi_linear", "minimax", "kimi_linear_rope")


# ----------------------------------------------------------------------------------------------
# weights
@torch.no_grad()
def randomize(model, gen, direct_norms=False):
    """Overwrite every text-model parameter with seeded random values (vision tower left as built)."""
    rules = {}
    n_experts = getattr(model.config.get_text_config(), "num_experts", None) or getattr(
        model.config.get_text_config(), "n_routed_experts", None) or getattr(
        model.config.get_text_config(), "num_local_experts", None)
    for name, p in model.named_parameters():
        if ".visual." in name or name.startswith("visual.") or ".vision_tower." in name:
            rules.setdefault("vision (constructor init)", 0)
            rules["vision (constructor init)"] += 1
            continue
        leaf = name.split(".")[-2] if "." in name else name
        if name.endswith("A_log"):
            val, rule = torch.randn(p.shape, generator=gen) * A_LOG_STD + A_LOG_MEAN, "A_log"
        elif name.endswith("dt_bias"):
            val, rule = torch.randn(p.shape, generator=gen) * DT_BIAS_STD, "dt_bias"
        elif name.endswith("linear_attn.norm.weight"):
            val, rule = 1.0 + torch.randn(p.shape, generator=gen) * NORM_STD, "gated norm 1+N(0,0.3)"
        elif name.endswith(".weight") and "norm" in leaf and direct_norms:
            val, rule = 1.0 + torch.randn(p.shape, generator=gen) * NORM_STD, "norm 1+N(0,0.3)"
        elif name.endswith(".weight") and "norm" in leaf:
            val, rule = torch.randn(p.shape, generator=gen) * NORM_STD, "zero-centred norm N(0,0.3)"
        elif name.endswith(".D") or name.endswith("mixer.D"):
            val, rule = 1.0 + torch.randn(p.shape, generator=gen) * 0.3, "D skip 1+N(0,0.3)"
        elif name.endswith("e_score_correction_bias"):
            val, rule = torch.randn(p.shape, generator=gen) * 0.5, "router score bias N(0,0.5)"
        elif name.endswith("conv1d.weight"):
            val, rule = torch.randn(p.shape, generator=gen) * CONV_STD, "conv1d"
        elif name.endswith("embed_tokens.weight"):
            val, rule = torch.randn(p.shape, generator=gen) * EMB_STD, "embedding"
        elif name.endswith("lm_head.weight"):
            val, rule = torch.randn(p.shape, generator=gen) * (LM_HEAD_STD), "lm_head"
        elif name.endswith("gate.weight") and p.dim() == 2 and n_experts and p.shape[0] == n_experts:
            val, rule = torch.randn(p.shape, generator=gen) * (ROUTER_GAIN / math.sqrt(p.shape[-1])), "router"
        elif p.dim() >= 2:
            val, rule = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]), "N(0, 1/fan_in)"
        else:
            val, rule = torch.randn(p.shape, generator=gen) * 0.1, "fallback N(0,0.1): " + name
        p.copy_(val.to(p.dtype))
        rules[rule] = rules.get(rule, 0) + 1
    return rules


def saved_keys(path):
    out = []
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        for k in sorted(f.keys()):
            sl = f.get_slice(k)
            out.append({"key": k, "dtype": sl.get_dtype(), "shape": list(sl.get_shape())})
    return out, meta


# ----------------------------------------------------------------------------------------------
# reference computation
def top2_margin(lp):
    t = torch.topk(lp, 2, dim=-1).values
    return t[..., 0] - t[..., 1]


class RouterProbe:
    """Forward hooks on MoE routers: how varied the top-k choice is and how close the k-th/k+1-th probs come."""

    def __init__(self, model, k):
        self.k = k
        self.sets = {}
        self.min_gap = float("inf")
        self.handles = []
        for name, m in model.named_modules():
            w = getattr(m, "weight", None)
            if (name.endswith("mlp.gate") or name.endswith("mixer.gate")) and isinstance(w, torch.Tensor) and w.dim() == 2:
                self.handles.append(m.register_forward_hook(self._hook(name)))

    def _hook(self, name):
        def fn(mod, inp, out):
            x = inp[0].reshape(-1, mod.weight.shape[-1]).float()
            p = torch.softmax(x @ mod.weight.float().t(), dim=-1)
            top = torch.topk(p, self.k + 1, dim=-1)
            gap = (top.values[:, self.k - 1] - top.values[:, self.k]).min().item()
            self.min_gap = min(self.min_gap, gap)
            s = self.sets.setdefault(name, set())
            for row in top.indices[:, : self.k].tolist():
                s.add(tuple(sorted(row)))

        return fn

    def summary(self):
        for h in self.handles:
            h.remove()
        if not self.handles:
            return None
        return {
            "routers": len(self.handles),
            "min_distinct_topk_sets_per_router": min(len(s) for s in self.sets.values()),
            "max_distinct_topk_sets_per_router": max(len(s) for s in self.sets.values()),
            "min_prob_gap_kth_vs_next": self.min_gap,
        }


@torch.no_grad()
def reference(model, prompt):
    ids = prompt[None, :]
    full = model(input_ids=ids, use_cache=False).logits[0]
    lp_full = torch.log_softmax(full, dim=-1)

    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=N_NEW,
        use_cache=True,
        output_logits=True,
        output_scores=True,
        return_dict_in_generate=True,
    )
    seq = out.sequences[0]
    assert seq.shape[0] == ids.shape[1] + N_NEW, (seq.shape, "generation stopped early")
    greedy = seq[ids.shape[1]:].clone()
    step_logits = torch.stack([l[0] for l in out.logits])
    lp_greedy = torch.log_softmax(step_logits, dim=-1)
    assert torch.equal(lp_greedy.argmax(-1), greedy), "greedy tokens are not the argmax of the raw logits"

    # sanity: one full forward over prompt + continuation against the cached decode path
    full2 = model(input_ids=seq[None, :], use_cache=False).logits[0]
    lp_full2 = torch.log_softmax(full2, dim=-1)[ids.shape[1] - 1 : ids.shape[1] - 1 + N_NEW]
    sanity = (lp_full2 - lp_greedy).abs().max().item()
    return {
        "logits_std": full.std().item(),
        "lp_full": lp_full.float().contiguous(),
        "greedy": greedy.to(torch.int64).contiguous(),
        "lp_greedy": lp_greedy.float().contiguous(),
        "seq": seq,
        "sanity": sanity,
        "full_vs_prefill_last": (lp_full[-1] - lp_greedy[0]).abs().max().item(),
    }


def eager_experts(model):
    """torch._grouped_mm (transformers' default MoE path on CPU) has no float64 kernel: use the eager loop."""
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation("eager")
        except Exception as e:  # noqa: BLE001
            log(f"set_experts_implementation('eager') failed: {e}")
    return model


@torch.no_grad()
def f64_check(model, prompt, r):
    """float32 HF noise: compare stored log-probs with a float64 full forward over prompt + continuation."""
    m64 = eager_experts(copy.deepcopy(model).double())
    L = prompt.shape[0]
    lp64 = torch.log_softmax(m64(input_ids=r["seq"][None, :], use_cache=False).logits[0], dim=-1)
    return {
        "max_abs_logprobs_f32_vs_f64": (r["lp_full"].double() - lp64[:L]).abs().max().item(),
        "max_abs_greedy_logprobs_f32_vs_f64": (r["lp_greedy"].double() - lp64[L - 1 : L - 1 + N_NEW]).abs().max().item(),
        "greedy_equals_f64_argmax": bool(torch.equal(lp64[L - 1 : L - 1 + N_NEW].argmax(-1), r["greedy"])),
    }


@torch.no_grad()
def greedy_min_margin(model, prompts):
    saved = model.generation_config
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=N_BPE, do_sample=False)
    worst = float("inf")
    for key in ("a", "b"):
        ids = prompts[key][None, :]
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=N_NEW, use_cache=True, output_logits=True, return_dict_in_generate=True)
        lp = torch.log_softmax(torch.stack([l[0] for l in out.logits]).float(), dim=-1)
        worst = min(worst, top2_margin(lp).min().item())
    model.generation_config = saved
    return worst


def load_model(cls, folder):
    model, info = cls.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    model.eval()
    info = {k: sorted(map(str, v)) for k, v in dict(info).items() if v}
    return model, info


def build_one(name, out_root, tok, tok_class, tok_meta, prompts, seed, base_models, ref_dtype):
    folder = os.path.join(out_root, name)
    os.makedirs(folder, exist_ok=True)
    for f in glob.glob(os.path.join(folder, "*")):
        os.remove(f)

    if name == "qwen3_5_dense_bf16" and "qwen3_5_dense" in base_models:
        model = copy.deepcopy(base_models["qwen3_5_dense"])
        mseed, attempts = base_models["qwen3_5_dense"].hypic_seed
        rules = {"copied from qwen3_5_dense": 1}
    else:
        attempts = []
        for attempt in range(MAX_SEED_ATTEMPTS):
            mseed = seed * 100 + MODEL_SEEDS[name] + 1000 * attempt
            torch.manual_seed(mseed)
            model = make_model(name)
            rules = randomize(model, torch.Generator().manual_seed(mseed), name in DIRECT_NORM_MODELS)
            model.eval()
            margin = greedy_min_margin(model, prompts)
            if name == "qwen3_5_dense":  # the bf16-rounded copy must be decisive too
                margin = min(margin, greedy_min_margin(copy.deepcopy(model).to(torch.bfloat16).float(), prompts))
            attempts.append({"model_seed": mseed, "min_greedy_margin": margin})
            if margin >= MIN_GREEDY_MARGIN:
                break
        else:
            raise SystemExit(f"{name}: no seed gave greedy margins >= {MIN_GREEDY_MARGIN}: {attempts}")
        model.hypic_seed = (mseed, attempts)
        base_models[name] = model
    model.eval()
    eos = tok.token_to_id("<|im_end|>")
    pad = tok.token_to_id("<|endoftext|>")
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None, do_sample=False)
    cls = type(model)

    save_dtype = torch.bfloat16 if name.endswith("_bf16") else torch.float32
    to_save = copy.deepcopy(model).to(save_dtype) if save_dtype != torch.float32 else model
    to_save.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(tok, folder, tok_class)

    # reference from the checkpoint as written (bf16: rounded weights, computed in float32)
    ref_model, load_info = load_model(cls, folder)
    if load_info:
        log(f"[{name}] loading info: {load_info}")
    sd_saved = ref_model.state_dict()
    max_roundtrip = 0.0
    for k, v in model.state_dict().items():
        if k not in sd_saved:
            continue
        want = v.to(save_dtype).float()
        max_roundtrip = max(max_roundtrip, (sd_saved[k].float() - want).abs().max().item())
    if max_roundtrip != 0.0:
        raise SystemExit(f"{name}: reloaded weights differ from the saved ones by {max_roundtrip}")

    ref_model.generation_config.eos_token_id = None  # always decode N_NEW tokens (eos is recorded instead)
    if ref_dtype != torch.float32:
        ref_model = eager_experts(ref_model.to(ref_dtype))
    k = getattr(ref_model.config.get_text_config(), "num_experts_per_tok", None) if "qwen" in name else None
    probe = RouterProbe(ref_model, k) if k else None
    ra = reference(ref_model, prompts["a"])
    router = probe.summary() if probe else None
    rb = reference(ref_model, prompts["b"])
    f64 = {"a": f64_check(ref_model, prompts["a"], ra), "b": f64_check(ref_model, prompts["b"], rb)}

    tensors = {
        "prompt_a": prompts["a"].contiguous(),
        "logprobs_a": ra["lp_full"],
        "prompt_b": prompts["b"].contiguous(),
        "logprobs_b": rb["lp_full"],
        "greedy_a": ra["greedy"],
        "greedy_logprobs_a": ra["lp_greedy"],
        "greedy_b": rb["greedy"],
        "greedy_logprobs_b": rb["lp_greedy"],
    }
    save_file(tensors, os.path.join(folder, "reference.safetensors"), metadata={"format": "pt"})

    keys, st_meta = saved_keys(os.path.join(folder, "model.safetensors"))
    tcfg = ref_model.config.get_text_config()
    info = {
        "model": name,
        "class": cls.__name__,
        "config_class": type(ref_model.config).__name__,
        "saved_dtype": str(save_dtype).replace("torch.", ""),
        "reference_dtype": str(ref_dtype).replace("torch.", ""),
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__,
            "python": sys.version.split()[0],
        },
        "seed": seed,
        "model_seed": mseed,
        "seed_attempts": attempts,
        "min_greedy_margin_required": MIN_GREEDY_MARGIN,
        "prompt_seed": prompts["seed"],
        "attn_implementation": "eager",
        "device": "cpu, 1 thread, deterministic algorithms",
        "rope_parameters": getattr(tcfg, "rope_parameters", None),
        "tie_word_embeddings": bool(getattr(tcfg, "tie_word_embeddings", False)),
        "eos_token_id": eos,
        "pad_token_id": pad,
        "randomisation": {
            "rules_applied": rules,
            "embedding_std": EMB_STD,
            "lm_head_std": LM_HEAD_STD,
            "norm_std": NORM_STD,
            "router_gain": ROUTER_GAIN,
            "A_log": [A_LOG_MEAN, A_LOG_STD],
            "dt_bias_std": DT_BIAS_STD,
            "conv_std": CONV_STD,
        },
        "logits_std_a": ra["logits_std"],
        "logits_std_b": rb["logits_std"],
        "min_top2_margin_logprobs_a": top2_margin(ra["lp_full"]).min().item(),
        "min_top2_margin_logprobs_b": top2_margin(rb["lp_full"]).min().item(),
        "greedy_top2_margins_a": [round(x, 6) for x in top2_margin(ra["lp_greedy"]).tolist()],
        "greedy_top2_margins_b": [round(x, 6) for x in top2_margin(rb["lp_greedy"]).tolist()],
        "min_greedy_top2_margin_a": top2_margin(ra["lp_greedy"]).min().item(),
        "min_greedy_top2_margin_b": top2_margin(rb["lp_greedy"]).min().item(),
        "greedy_a": ra["greedy"].tolist(),
        "greedy_b": rb["greedy"].tolist(),
        "eos_in_greedy": bool((ra["greedy"] == eos).any() or (rb["greedy"] == eos).any()),
        "sanity_max_abs_diff_cached_decode_vs_full_forward_a": ra["sanity"],
        "sanity_max_abs_diff_cached_decode_vs_full_forward_b": rb["sanity"],
        "prefill_last_vs_full_forward_last_a": ra["full_vs_prefill_last"],
        "float64_check": f64,
        "router_probe_prompt_a": router,
        "loading_info": load_info,
        "tokenizer": tok_meta,
        "model_safetensors_metadata": st_meta,
        "model_safetensors_keys": keys,
        "files": {},
    }
    for f in sorted(os.listdir(folder)):
        info["files"][f] = os.path.getsize(os.path.join(folder, f))
    with open(os.path.join(folder, "reference.json"), "w") as f:
        json.dump(info, f, indent=1, ensure_ascii=False)
        f.write("\n")
    info["files"]["reference.json"] = os.path.getsize(os.path.join(folder, "reference.json"))
    log(
        f"[{name}] logits std a={ra['logits_std']:.3f} b={rb['logits_std']:.3f}  "
        f"min margin full a={info['min_top2_margin_logprobs_a']:.4f} b={info['min_top2_margin_logprobs_b']:.4f}  "
        f"greedy a={info['min_greedy_top2_margin_a']:.4f} b={info['min_greedy_top2_margin_b']:.4f}  "
        f"sanity a={ra['sanity']:.2e} b={rb['sanity']:.2e}  eos={info['eos_in_greedy']}  "
        f"f64 a={f64['a']} b={f64['b']}  attempts={len(attempts)}  "
        f"router={router}  size={sum(info['files'].values())}"
    )
    return info


def inspect_dump(path):
    T = transformers
    with open(path, "w") as f:
        for cname in ["Qwen3_5TextConfig", "Qwen3_5Config", "Qwen3_5VisionConfig", "Qwen3_5MoeTextConfig",
                      "Qwen3_5MoeConfig", "Qwen3NextConfig", "NemotronHConfig", "KimiLinearConfig", "MiniMaxConfig"]:
            c = getattr(T, cname)
            f.write(f"===== {cname}\n{inspect.signature(c.__init__)}\n{(c.__doc__ or '')[:3000]}\n")
            try:
                f.write(c().to_json_string()[:4000] + "\n")
            except Exception as e:  # noqa: BLE001
                f.write(f"default construction failed: {e}\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "data", "models"))
    ap.add_argument("--corpus", default=os.path.join(HERE, "corpus"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--only", default="")
    ap.add_argument("--inspect", default="")
    ap.add_argument("--tmp", default="/tmp/make_reference_tmp")
    ap.add_argument("--ref-dtype", default="float32", choices=["float32", "float64"],
                    help="dtype the reference model computes in (outputs are stored as float32 either way)")
    args = ap.parse_args()

    t0 = time.time()
    log(f"transformers {transformers.__version__} torch {torch.__version__} tokenizers {tokenizers.__version__}")
    if args.inspect:
        inspect_dump(args.inspect)

    tok, corpus_files = train_tokenizer(args.corpus)
    os.makedirs(args.tmp, exist_ok=True)
    tok_class, at, tok_notes = choose_tokenizer_class(tok, args.tmp)
    samples = []
    for s in TOKENIZER_SAMPLES:
        ids = tok.encode(s).ids
        samples.append({"text": s, "ids": ids, "decoded_roundtrip": tok.decode(ids, skip_special_tokens=False) == s})
    chat_ids = at.apply_chat_template(CHAT_SAMPLE, add_generation_prompt=True, tokenize=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    chat_text = at.apply_chat_template(CHAT_SAMPLE, add_generation_prompt=True, tokenize=False)
    tok_meta = {
        "corpus_files": corpus_files,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "special_tokens": {s: tok.token_to_id(s) for s in SPECIALS},
        "tokenizer_class": tok_class,
        "tokenizer_class_trials": tok_notes,
        "samples": samples,
        "chat_sample": {"messages": CHAT_SAMPLE, "add_generation_prompt": True, "text": chat_text,
                        "ids": list(map(int, chat_ids))},
    }
    log(f"tokenizer: class {tok_class} trials {tok_notes}")
    for s in samples:
        log(f"  {s['text']!r} -> {s['ids']} roundtrip={s['decoded_roundtrip']}")

    g = torch.Generator().manual_seed(args.seed)
    prompts = {
        "a": torch.randint(0, N_BPE, (PROMPT_A_LEN,), generator=g, dtype=torch.int64),
        "b": torch.randint(0, N_BPE, (PROMPT_B_LEN,), generator=g, dtype=torch.int64),
        "seed": args.seed,
    }
    names = [n for n in MODEL_NAMES if not args.only or n in args.only.split(",")]
    if "qwen3_5_dense_bf16" in names and "qwen3_5_dense" not in names:
        names.insert(0, "qwen3_5_dense")  # the bf16 model is the dense one, rounded
    base_models, summary, failed = {}, {}, []
    for n in names:
        ts = time.time()
        try:
            info = build_one(n, args.out, tok, tok_class, tok_meta, prompts, args.seed, base_models,
                             getattr(torch, args.ref_dtype))
        except Exception:  # noqa: BLE001  (keep going: report every model's failure in one run)
            import traceback

            traceback.print_exc()
            failed.append(n)
            continue
        summary[n] = {
            "bytes": sum(info["files"].values()),
            "logits_std_a": round(info["logits_std_a"], 4),
            "min_margin_full_a": round(info["min_top2_margin_logprobs_a"], 5),
            "min_margin_full_b": round(info["min_top2_margin_logprobs_b"], 5),
            "min_margin_greedy_a": round(info["min_greedy_top2_margin_a"], 5),
            "min_margin_greedy_b": round(info["min_greedy_top2_margin_b"], 5),
            "sanity_a": info["sanity_max_abs_diff_cached_decode_vs_full_forward_a"],
            "sanity_b": info["sanity_max_abs_diff_cached_decode_vs_full_forward_b"],
            "f32_vs_f64": max(v for p in info["float64_check"].values() for k, v in p.items() if k.startswith("max")),
            "seed_attempts": len(info["seed_attempts"]),
            "seconds": round(time.time() - ts, 1),
        }
    log(json.dumps(summary, indent=1))
    log(f"total {sum(v['bytes'] for v in summary.values())} bytes, {time.time() - t0:.1f} s")
    if failed:
        log(f"FAILED: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
