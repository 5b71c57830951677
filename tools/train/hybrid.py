"""A compact PyTorch Qwen3.5 text model for training (the math and parameter names of transformers'
Qwen3_5ForCausalLM, so a state dict loads into it with strict=True).

Why not train transformers' class directly: its torch fallback of the gated delta rule loops over
64-token chunks and over the rows of each chunk's triangular solve in Python, which made the first
training attempt launch-bound (0.24-0.40 s a step at any length). Here the delta rule goes through
fast_gdn (one triangular solve per chunk, a log-depth scan across chunks) and attention through
scaled_dot_product_attention. train.py checks on the device that this module and transformers give
the same logits for the same weights before it trains, and exports through transformers.
Runs on torch 1.13 (CPU) too, for small recipe experiments without a GPU.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fast_gdn import chunk_gated_delta_rule_scan

_HAS_SDPA = hasattr(F, "scaled_dot_product_attention")


class RMSNorm(nn.Module):
    """Qwen3.5's zero-centred RMSNorm: x / rms(x) * (1 + w), computed in float32."""

    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class RMSNormGated(nn.Module):
    """The gated delta rule's output norm: x / rms(x) * w * silu(z) (plain weight, initialised to 1)."""

    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x, z):
        dt = x.dtype
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * y.to(dt)
        return (y * F.silu(z.float())).to(dt)


class GatedDeltaNet(nn.Module):
    def __init__(self, c):
        super().__init__()
        H = c["hidden_size"]
        self.hk, self.hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        self.dk, self.dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        self.K = c["linear_conv_kernel_dim"]
        C = 2 * self.hk * self.dk + self.hv * self.dv
        self.in_proj_qkv = nn.Linear(H, C, bias=False)
        self.in_proj_z = nn.Linear(H, self.hv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(H, self.hv, bias=False)
        self.in_proj_a = nn.Linear(H, self.hv, bias=False)
        self.conv1d = nn.Conv1d(C, C, self.K, groups=C, padding=self.K - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.hv).uniform_(1e-3, 16)))
        self.norm = RMSNormGated(self.dv, c["rms_norm_eps"])
        self.out_proj = nn.Linear(self.hv * self.dv, H, bias=False)

    def heads_and_gates(self, qkv, x):
        """q, k, v [B, L, heads, d] of the conv'd projections qkv [B, L, C]; g (log decay), beta
        [B, L, hv] of the layer's input x [B, L, H]."""
        B, L = qkv.shape[:2]
        nk = self.hk * self.dk
        q = qkv[..., :nk].reshape(B, L, self.hk, self.dk)
        k = qkv[..., nk : 2 * nk].reshape(B, L, self.hk, self.dk)
        v = qkv[..., 2 * nk :].reshape(B, L, self.hv, self.dv)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        return q, k, v, g, beta

    def forward(self, x):
        B, L, _ = x.shape
        qkv = self.in_proj_qkv(x).transpose(1, 2)
        qkv = F.silu(self.conv1d(qkv)[..., :L]).transpose(1, 2)
        q, k, v, g, beta = self.heads_and_gates(qkv, x)
        o, _ = chunk_gated_delta_rule_scan(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        z = self.in_proj_z(x).reshape(B * L * self.hv, self.dv)
        o = self.norm(o.reshape(B * L * self.hv, self.dv).to(x.dtype), z)
        return self.out_proj(o.reshape(B, L, self.hv * self.dv))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H = c["hidden_size"]
        self.hq, self.hkv, self.D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        rp = c["rope_parameters"]
        self.rot = int(self.D * rp.get("partial_rotary_factor", 1.0))
        self.theta = rp["rope_theta"]
        self.q_proj = nn.Linear(H, self.hq * self.D * 2, bias=False)  # per head: [q D | gate D]
        self.k_proj = nn.Linear(H, self.hkv * self.D, bias=False)
        self.v_proj = nn.Linear(H, self.hkv * self.D, bias=False)
        self.o_proj = nn.Linear(self.hq * self.D, H, bias=False)
        self.q_norm = RMSNorm(self.D, c["rms_norm_eps"])
        self.k_norm = RMSNorm(self.D, c["rms_norm_eps"])

    def rope(self, x, L):
        inv = 1.0 / (self.theta ** (torch.arange(0, self.rot, 2, device=x.device, dtype=torch.float32) / self.rot))
        f = torch.arange(L, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat([f, f], dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        xr, xp = x[..., : self.rot], x[..., self.rot :]
        return torch.cat([xr * cos + rotate_half(xr) * sin, xp], dim=-1)

    def forward(self, x):
        B, L, _ = x.shape
        qg = self.q_proj(x).reshape(B, L, self.hq, 2 * self.D)
        q, gate = qg[..., : self.D], qg[..., self.D :].reshape(B, L, self.hq * self.D)
        q = self.rope(self.q_norm(q).transpose(1, 2), L)
        k = self.rope(self.k_norm(self.k_proj(x).reshape(B, L, self.hkv, self.D)).transpose(1, 2), L)
        v = self.v_proj(x).reshape(B, L, self.hkv, self.D).transpose(1, 2)
        r = self.hq // self.hkv
        if r > 1:
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        if _HAS_SDPA:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = (q @ k.transpose(-1, -2)) * self.D**-0.5
            mask = torch.ones(L, L, dtype=torch.bool, device=x.device).triu(1)
            o = s.float().masked_fill(mask, float("-inf")).softmax(-1).to(v.dtype) @ v
        o = o.transpose(1, 2).reshape(B, L, self.hq * self.D)
        return self.o_proj(o * gate.sigmoid())


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, I = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c, kind):
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c)

    def forward(self, x):
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h) if self.kind == "linear_attention" else self.self_attn(h))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([Layer(c, t) for t in c["layer_types"]])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for l in self.layers:
            x = l(x)
        return self.norm(x)


class HybridLM(nn.Module):
    """Qwen3_5ForCausalLM with tied embeddings: state_dict() keys are transformers' (no lm_head.weight)."""

    def __init__(self, c, init_std=0.02):
        super().__init__()
        self.cfg = dict(c)
        self.model = Body(c)
        for p in self.parameters():  # matrices and embeddings as transformers initialises them
            if p.ndim == 2:
                nn.init.normal_(p, 0.0, init_std)

    def hidden(self, ids):
        return self.model(ids)

    def logits(self, h):
        return F.linear(h, self.model.embed_tokens.weight)

    def forward(self, ids):
        return self.logits(self.hidden(ids))


def convert_to_attention(model, layers, init_std=0.02):
    """Turns the given linear-attention layers into full-attention ones: a new token mixer (normal
    init_std, as HybridLM's) whose output projection is zero, so the converted model starts as the
    checkpoint without those layers' token mixing (norms and MLPs kept). Updates model.cfg's
    layer_types; returns the new parameters. Why: the trained hypic-mini has three global layers,
    and a two-hop question needs two retrievals at the question (tools/train/README.md)."""
    types = list(model.cfg["layer_types"])
    new = []
    bad = [i for i in layers if not 0 <= i < len(types) or types[i] != "linear_attention"]
    if bad:  # before any change, so that a refused call leaves the model as it was
        raise ValueError(f"layer {bad[0]} is not a linear-attention layer of this model")
    for i in layers:
        L = model.model.layers[i]
        ref = next(L.parameters())
        att = Attention(model.cfg).to(device=ref.device, dtype=ref.dtype)
        for p in att.parameters():
            if p.ndim == 2:
                nn.init.normal_(p, 0.0, init_std)
        nn.init.zeros_(att.o_proj.weight)
        del L.linear_attn
        L.self_attn, L.kind, types[i] = att, "full_attention", "full_attention"
        new += list(att.parameters())
    model.cfg["layer_types"] = types
    return new


def grow_layers(model, first, last):
    """Depth growth by block expansion (as LLaMA Pro): inserts copies of layers first..last right after
    layer last, each copy's mixer output projection and MLP down projection zero, so the grown model
    computes exactly what the checkpoint did (a zero residual branch) while its new layers start from
    trained weights. Updates model.cfg (layer_types, num_hidden_layers); returns the new parameters.
    Why: two-hop under full recompute plateaued at ~0.74 teacher-forced on the 12-layer model whatever
    the recipe (tools/train/README.md); copying the middle group keeps Qwen3.5's 3:1 pattern."""
    import copy

    layers = model.model.layers
    if not 0 <= first <= last < len(layers):
        raise ValueError(f"grow: layers {first}-{last} are not within the model's {len(layers)}")
    new_layers = [copy.deepcopy(layers[i]) for i in range(first, last + 1)]
    new = []
    for L in new_layers:
        out = L.linear_attn.out_proj if L.kind == "linear_attention" else L.self_attn.o_proj
        nn.init.zeros_(out.weight)
        nn.init.zeros_(L.mlp.down_proj.weight)
        new += list(L.parameters())
    grown = list(layers[: last + 1]) + new_layers + list(layers[last + 1 :])
    model.model.layers = nn.ModuleList(grown)
    model.cfg["layer_types"] = [L.kind for L in grown]
    model.cfg["num_hidden_layers"] = len(grown)
    return new


def n_params(model):
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":  # smoke test on CPU
    c = dict(vocab_size=100, hidden_size=64, intermediate_size=96, layer_types=["linear_attention", "full_attention"],
             num_attention_heads=2, num_key_value_heads=1, head_dim=32,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
             linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
             linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
    m = HybridLM(c)
    ids = torch.randint(0, 100, (2, 150))
    out = m(ids)
    out.sum().backward()
    # causality: the logits at t must not depend on tokens after t
    ids2 = ids.clone()
    ids2[:, 100:] = (ids2[:, 100:] + 1) % 100
    d = (m(ids2)[:, :100] - out[:, :100]).abs().max().item()
    print("logits", tuple(out.shape), "params", n_params(m), "causal leak", d, "sdpa", _HAS_SDPA)
    assert d < 1e-4
    print(sorted(m.state_dict().keys())[:12])
    # --to-attention: the converted layer's mixer starts silent (the model is the checkpoint minus
    # that mixer), is wired in (a non-zero output projection changes the logits), and config follows
    with torch.no_grad():
        L0 = m.model.layers[0]
        x = m.model.embed_tokens(ids)
        x = x + L0.mlp(L0.post_attention_layernorm(x))  # layer 0 without its mixer
        want = m.logits(m.model.norm(m.model.layers[1](x)))
        convert_to_attention(m, [0])
        assert m.cfg["layer_types"] == ["full_attention", "full_attention"]
        assert (m(ids) - want).abs().max().item() < 1e-5
        nn.init.normal_(m.model.layers[0].self_attn.o_proj.weight, 0.0, 0.02)
        assert (m(ids) - want).abs().max().item() > 1e-3
        try:  # a layer that is not linear attention (any more) is refused, the model left as it was
            convert_to_attention(m, [0])
            raise AssertionError("convert_to_attention took a full-attention layer")
        except ValueError:
            assert m.cfg["layer_types"] == ["full_attention", "full_attention"]
    print("convert_to_attention ok")
    # grow_layers: the grown model computes what it did, its new layers are wired in (a non-zero
    # output projection in a copy changes the logits), config follows
    m = HybridLM(c)
    with torch.no_grad():
        want = m(ids)
        new = grow_layers(m, 0, 1)
        assert m.cfg["layer_types"] == c["layer_types"] * 2 and m.cfg["num_hidden_layers"] == 4
        assert len(m.model.layers) == 4 and len(new) > 0
        assert (m(ids) - want).abs().max().item() < 1e-5
        nn.init.normal_(m.model.layers[3].mlp.down_proj.weight, 0.0, 0.02)
        assert (m(ids) - want).abs().max().item() > 1e-3
    print("grow_layers ok")


def save_folder(model, folder, tok_dir, eos, pad, dtype="float32", config=None):
    """A transformers-style folder (safetensors written by hand, f32 or, with dtype "bfloat16", bf16
    rounded to nearest even; config.json, tokenizer) without transformers or safetensors installed:
    for checks against the C++ engine on a CPU machine, and fine-tuned models (pic_finetune.py)."""
    import json
    import os
    import shutil
    import struct

    os.makedirs(folder, exist_ok=True)
    sd = {k: v.detach().float().contiguous().cpu() for k, v in model.state_dict().items()}
    header, off, blobs = {}, 0, []
    for k in sorted(sd):
        if dtype == "bfloat16":
            u = sd[k].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
            u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even (finite weights)
            b = u.to(torch.int32).to(torch.int16).numpy().tobytes()
            st = "BF16"
        else:
            b, st = sd[k].numpy().tobytes(), "F32"
        header[k] = {"dtype": st, "shape": list(sd[k].shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)
    # The source's config.json where given (every field kept), else one made from the model's shape.
    cfg = dict(config, dtype=dtype) if config else dict(
        model.cfg, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", eos_token_id=eos,
        pad_token_id=pad, bos_token_id=None, hidden_act="silu", attention_bias=False, dtype=dtype)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    for n in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if n != "generation_config.json" or os.path.exists(os.path.join(tok_dir, n)):
            shutil.copy(os.path.join(tok_dir, n), os.path.join(folder, n))


def load_safetensors(path):
    """{name: float32 tensor} from a .safetensors file (F32, BF16 or F16), without the safetensors package."""
    import json
    import struct

    import numpy as np

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        s, e = v["data_offsets"]
        raw = np.frombuffer(data[s:e], dtype={"F32": np.float32, "BF16": np.uint16, "F16": np.float16}[v["dtype"]])
        if v["dtype"] == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[k] = torch.from_numpy(raw.astype(np.float32).reshape(v["shape"]))
    return out


# config.json keys that shape the model (the rest are metadata: ids, dtype, architecture name)
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "layer_types",
               "num_attention_heads", "num_key_value_heads", "head_dim", "rope_parameters", "linear_num_key_heads",
               "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
               "rms_norm_eps")


def load_weights(model, folder):
    """A model folder's model.safetensors (F32 / BF16 / F16) into model; the tied lm_head is skipped."""
    import os

    sd = load_safetensors(os.path.join(folder, "model.safetensors"))
    model.load_state_dict({k: v for k, v in sd.items() if k != "lm_head.weight"})
    return model


def load_folder(folder):
    """HybridLM shaped by the folder's config.json, with its weights, in eval mode."""
    import json
    import os

    cfg = json.load(open(os.path.join(folder, "config.json")))
    return load_weights(HybridLM({k: cfg[k] for k in CONFIG_KEYS}), folder).eval()
