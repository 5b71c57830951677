"""The engine's PIC prefill as a differentiable PyTorch forward of a HybridLM (hybrid.py), for
PIC-aware fine-tuning: what is trained is what hypic serves (check_pic_forward.py compares the two
on the same weights).

A prompt is segments [prefix, doc_1 .. doc_n, question (+ answer)]. hypic's pic mode (src/pic/
composer.cpp) computes it as:
  * every context segment is prefilled alone, from position 0 (its entry);
  * the first `seam` tokens of each document (none of the prefix: it is an exact prefix) and the
    question are recomputed in context, layer by layer, in prompt order;
  * a linear-attention layer advances its running state over a segment's seam rows (conv warmed by
    the previous segment's conv tail), then composes the body: S <- T_body S + S(body | 0), and its
    conv state becomes the segment's own conv tail (as prefilled alone);
  * an attention layer splices the body's K/V as prefilled alone, keys re-rotated to their real
    positions; seam and question rows attend causally to everything before them.
Every document's T_body and S(body | 0) come from two scans over all bodies at once (the body's
own inputs from its isolated prefill; T as the map of the identity state with v = 0: the
recurrence is linear in the state), then the composition is one matmul per document. Re-rotation is RoPE at the real positions (angles add). Tail seams
(both ends) are not modelled.
"""

import torch
import torch.nn.functional as F

from fast_gdn import chunk_gated_delta_rule_scan
from hybrid import rotate_half


def _rope(attn, x, pos):
    """x [B, H, L, D] rotated at the given positions [L] (hybrid.Attention.rope at any positions)."""
    inv = 1.0 / (attn.theta ** (torch.arange(0, attn.rot, 2, device=x.device, dtype=torch.float32) / attn.rot))
    f = pos.to(torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([f, f], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    xr, xp = x[..., : attn.rot], x[..., attn.rot:]
    return torch.cat([xr * cos + rotate_half(xr) * sin, xp], dim=-1)


def _gdn_inputs(m, proj, h):
    """q, k, v [1, n, heads, d], g, beta [1, n, hv] of conv'd projections proj [n, C] and normed input h [n, H]."""
    n = proj.shape[0]
    nk = m.hk * m.dk
    q = proj[:, :nk].reshape(1, n, m.hk, m.dk)
    k = proj[:, nk:2 * nk].reshape(1, n, m.hk, m.dk)
    v = proj[:, 2 * nk:].reshape(1, n, m.hv, m.dv)
    beta = m.in_proj_b(h).sigmoid()[None]
    g = (-m.A_log.float().exp() * F.softplus(m.in_proj_a(h).float() + m.dt_bias))[None]
    return q, k, v, g, beta


def _conv(m, prev, x):
    """Depthwise causal conv + SiLU of rows x [n, C] after the K-1 rows prev [K-1, C]."""
    full = torch.cat([prev, x], dim=0).t()[None]  # [1, C, K-1+n]
    y = F.conv1d(full, m.conv1d.weight, groups=full.shape[1])  # valid: n outputs
    return F.silu(y[0].t())


def _tail(m, rows):
    """The last K-1 rows of conv inputs, zero-padded at the front (a conv state)."""
    K1 = m.K - 1
    if rows.shape[0] >= K1:
        return rows[rows.shape[0] - K1:]
    return torch.cat([rows.new_zeros(K1 - rows.shape[0], rows.shape[1]), rows], dim=0)


def pic_logits(model, segments, seam=8):
    """Logits [Q, V] of the last segment's rows (the question, and an answer when training) under
    hypic's pic mode with `seam` (segments: lists of token ids; the first is the exact prefix)."""
    dev = model.model.embed_tokens.weight.device
    ctx = segments[:-1]
    lens = [len(s) for s in ctx]
    starts = [sum(lens[:i]) for i in range(len(ctx))]
    heads = [0] + [min(seam, n) for n in lens[1:]]  # recomputed rows of each context segment
    Qn = len(segments[-1])
    q_pos0 = sum(lens)

    # 1. Each context segment alone from position 0, all in one batch (right-padded: causal layers
    # leave a row's numbers to the rows before it): every layer's normed input, by segment.
    iso = [[None] * len(model.model.layers) for _ in ctx]
    L = max(lens)
    batch = torch.tensor([s + [0] * (L - len(s)) for s in ctx], device=dev)
    x = model.model.embed_tokens(batch)
    for li, layer in enumerate(model.model.layers):
        h = layer.input_layernorm(x)
        for i, n in enumerate(lens):
            iso[i][li] = h[i, :n]
        x = x + (layer.linear_attn(h) if layer.kind == "linear_attention" else layer.self_attn(h))
        x = x + layer.mlp(layer.post_attention_layernorm(x))

    # 2. The rows computed in context: each segment's seam rows, then the question.
    ids, pos, owner = [], [], []  # owner: context segment index, or -1 for the question
    for i, s in enumerate(ctx):
        ids += s[:heads[i]]
        pos += list(range(starts[i], starts[i] + heads[i]))
        owner += [i] * heads[i]
    ids += segments[-1]
    pos += list(range(q_pos0, q_pos0 + Qn))
    owner += [-1] * Qn
    pos_t = torch.tensor(pos, device=dev)
    x = model.model.embed_tokens(torch.tensor(ids, device=dev))  # [R, H]
    for li, layer in enumerate(model.model.layers):
        h = layer.input_layernorm(x)
        if layer.kind == "linear_attention":
            mix = _linear_layer(layer.linear_attn, h, owner, iso, li, heads, lens)
        else:
            mix = _attention_layer(layer.self_attn, h, pos_t, owner, iso, li, heads, lens, starts)
        x = x + mix
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = model.model.norm(x)
    return model.logits(x[len(ids) - Qn:])


def _linear_layer(m, h, owner, iso, li, heads, lens):
    C = m.conv1d.weight.shape[0]
    conv = h.new_zeros(m.K - 1, C)
    S = h.new_zeros(1, m.hv, m.dk, m.dv, dtype=torch.float32)
    outs = []
    r = 0

    def run(rows_h, proj_rows, prev, S):
        q, k, v, g, beta = _gdn_inputs(m, _conv(m, prev, proj_rows), rows_h)
        return chunk_gated_delta_rule_scan(q, k, v, g=g, beta=beta, initial_state=S, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)

    # Every body's summary at once (right-padded with decay 1 and beta 0, which leave a state as it
    # is): S(body|0) from a zero state, T_body as the map of the identity with v = 0.
    bodies = [i for i in range(len(lens)) if lens[i] > heads[i]]
    summary, tails = {}, {}
    if bodies:
        ins, Lb = [], max(lens[i] - heads[i] for i in bodies)
        for i in bodies:
            hi = iso[i][li]
            proj = m.in_proj_qkv(hi)
            tails[i] = _tail(m, proj)
            q, k, v, g, beta = _gdn_inputs(m, _conv(m, _tail(m, proj[:heads[i]]), proj[heads[i]:]), hi[heads[i]:])
            pad = Lb - q.shape[1]
            ins.append([F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v)] + [F.pad(t, (0, 0, 0, pad)) for t in (g, beta)])
        q, k, v, g, beta = (torch.cat([x[j] for x in ins], dim=0) for j in range(5))
        _, Sb = chunk_gated_delta_rule_scan(q, k, v, g=g, beta=beta, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
        eye = torch.eye(m.dk, device=h.device).expand(len(bodies), m.hv, m.dk, m.dk)
        _, Tb = chunk_gated_delta_rule_scan(q, k, v.new_zeros(*v.shape[:3], m.dk), g=g, beta=beta, initial_state=eye,
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
        for j, i in enumerate(bodies):
            summary[i] = (Tb[j:j + 1], Sb[j:j + 1])
    for i in range(len(lens)):
        n = heads[i]
        if n:  # seam rows, in context
            proj = m.in_proj_qkv(h[r:r + n])
            o, S = run(h[r:r + n], proj, conv, S)
            outs.append(o[0])
            conv = _tail(m, torch.cat([conv, proj], dim=0))
            r += n
        if i in summary:  # the body as prefilled alone, composed: S <- T_body S + S(body|0)
            T, Sb = summary[i]
            S = T @ S + Sb
            conv = tails[i]
    proj = m.in_proj_qkv(h[r:])
    o, _ = run(h[r:], proj, conv, S)
    outs.append(o[0])
    o = torch.cat(outs, dim=0)  # [R, hv, dv]
    R = o.shape[0]
    z = m.in_proj_z(h).reshape(R * m.hv, m.dv)
    o = m.norm(o.reshape(R * m.hv, m.dv).to(h.dtype), z)
    return m.out_proj(o.reshape(R, m.hv * m.dv))


def _attention_layer(a, h, pos_t, owner, iso, li, heads, lens, starts):
    R = h.shape[0]
    dev = h.device

    def qkv(rows_h, p):
        n = rows_h.shape[0]
        qg = a.q_proj(rows_h).reshape(1, n, a.hq, 2 * a.D)
        q, gate = qg[..., :a.D], qg[..., a.D:].reshape(n, a.hq * a.D)
        q = _rope(a, a.q_norm(q).transpose(1, 2), p)
        k = _rope(a, a.k_norm(a.k_proj(rows_h).reshape(1, n, a.hkv, a.D)).transpose(1, 2), p)
        v = a.v_proj(rows_h).reshape(1, n, a.hkv, a.D).transpose(1, 2)
        return q, k, v, gate

    q, k_rows, v_rows, gate = qkv(h, pos_t)
    # Every body's K/V in one call (rows are independent), at their real positions.
    bodies = [i for i in range(len(lens)) if lens[i] > heads[i]]
    if bodies:
        hb = torch.cat([iso[i][li][heads[i]:] for i in bodies], dim=0)
        pb = torch.cat([torch.arange(starts[i] + heads[i], starts[i] + lens[i], device=dev) for i in bodies])
        _, kb_all, vb_all, _ = qkv(hb, pb)
    # The cache in position order: each segment's seam rows (in context) and body (alone), then
    # the question's rows.
    ks, vs, kpos = [], [], []
    r = rb = 0
    for i in range(len(lens)):
        n = heads[i]
        if n:
            ks.append(k_rows[:, :, r:r + n])
            vs.append(v_rows[:, :, r:r + n])
            kpos.append(pos_t[r:r + n])
            r += n
        if lens[i] > n:
            m = lens[i] - n
            ks.append(kb_all[:, :, rb:rb + m])
            vs.append(vb_all[:, :, rb:rb + m])
            kpos.append(pb[rb:rb + m])
            rb += m
    ks.append(k_rows[:, :, r:])
    vs.append(v_rows[:, :, r:])
    kpos.append(pos_t[r:])
    k, v, kp = torch.cat(ks, dim=2), torch.cat(vs, dim=2), torch.cat(kpos)
    rep = a.hq // a.hkv
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)) * a.D ** -0.5  # [1, hq, R, P]
    s = s.float().masked_fill(kp[None, :] > pos_t[:, None], float("-inf"))
    o = s.softmax(-1).to(v.dtype) @ v
    o = o.transpose(1, 2).reshape(R, a.hq * a.D)
    return a.o_proj(o * gate.sigmoid())
