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
    return m.heads_and_gates(proj[None], h[None])


def _conv(m, prev, x):
    """Depthwise causal conv + SiLU of rows x [n, C] after the K-1 rows prev [K-1, C]."""
    return _conv_b(m, prev[None], x[None])[0]


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


# ------------------------------------------------------------------------------------------------
# Many prompts at once. pic_logits() runs one prompt and is bound by kernel launches (every
# document's seam is a scan of its own in every linear layer); training wants dozens of prompts a
# step. Here the prompts of a batch share one slot layout: N context slots (a prompt with fewer
# context segments leaves its first slots empty), each with `seam` rows, then the question rows.
# Empty slots and the prefix's slot hold invalid rows (zero inputs, decay 1, beta 0: a linear
# layer's state and conv stay as they are; attention masks them out), and all of them come before
# the prefix's body, where the running state is still zero. Every linear layer runs three scans
# for the whole batch (the bodies alone, every slot's seam rows at once as affine maps of the state
# they start from, the question's rows) and a loop of N small products between the last two; and
# pic_logits_batch() equals pic_logits() prompt by prompt (check_pic_forward.py checks it). Every
# document must be longer than the seam.


def _conv_b(m, prev, x):
    """Depthwise causal conv + SiLU of rows x [B, n, C] after prev [B, K-1, C]."""
    full = torch.cat([prev, x], dim=1).transpose(1, 2)  # [B, C, K-1+n]
    return F.silu(F.conv1d(full, m.conv1d.weight, groups=full.shape[1]).transpose(1, 2))


def pic_logits_batch(model, batch, seam=8):
    """pic_logits() of every prompt in `batch` (a list of segment lists), as a list of [Q_b, V]."""
    dev = model.model.embed_tokens.weight.device
    B = len(batch)
    ctxs = [ex[:-1] for ex in batch]
    if any(len(s) <= seam for c in ctxs for s in c[1:]):
        return [pic_logits(model, ex, seam) for ex in batch]  # a document within its seam: one by one
    N = max(len(c) for c in ctxs)
    segs = [s for c in ctxs for s in c]  # every context segment, prompt by prompt
    D = len(segs)
    lens = torch.tensor([len(s) for s in segs], device=dev)
    heads = torch.tensor([0 if j == 0 else seam for c in ctxs for j in range(len(c))], device=dev)
    starts, slot_of, first = [], torch.full((B, N), D, dtype=torch.long), 0
    for b, c in enumerate(ctxs):
        off = N - len(c)
        for j, s in enumerate(c):
            slot_of[b, off + j] = first + j
            starts.append(sum(len(t) for t in c[:j]))
        first += len(c)
    slot_of = slot_of.to(dev)
    starts = torch.tensor(starts, device=dev)
    real = slot_of < D  # [B, N]

    # 1. Every context segment alone from position 0, one right-padded batch.
    L = int(lens.max())
    x = model.model.embed_tokens(torch.tensor([s + [0] * (L - len(s)) for s in segs], device=dev))
    iso = []
    for layer in model.model.layers:
        h = layer.input_layernorm(x)
        iso.append(h)
        x = x + (layer.linear_attn(h) if layer.kind == "linear_attention" else layer.self_attn(h))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    t = torch.arange(L, device=dev)
    body = (t[None] >= heads[:, None]) & (t[None] < lens[:, None])  # [D, L]

    # 2. The rows in context: per slot `seam` rows (a document's first tokens), then the question.
    Qmax = max(len(ex[-1]) for ex in batch)
    R = N * seam + Qmax
    ids = torch.zeros(B, R, dtype=torch.long)
    pos = torch.zeros(B, R, dtype=torch.long)
    valid = torch.zeros(B, R, dtype=torch.bool)
    for b, c in enumerate(ctxs):
        off = N - len(c)
        p = 0
        for j, s in enumerate(c):
            if j > 0:
                r0 = (off + j) * seam
                ids[b, r0:r0 + seam] = torch.tensor(s[:seam])
                pos[b, r0:r0 + seam] = torch.arange(p, p + seam)
                valid[b, r0:r0 + seam] = True
            p += len(s)
        qn = len(batch[b][-1])
        ids[b, N * seam:N * seam + qn] = torch.tensor(batch[b][-1])
        pos[b, N * seam:N * seam + qn] = torch.arange(p, p + qn)
        valid[b, N * seam:N * seam + qn] = True
    ids, pos, valid = ids.to(dev), pos.to(dev), valid.to(dev)
    geo = dict(N=N, seam=seam, D=D, lens=lens, heads=heads, starts=starts, slot_of=slot_of, real=real, body=body,
               pos=pos, valid=valid)
    x = model.model.embed_tokens(ids)
    for li, layer in enumerate(model.model.layers):
        h = layer.input_layernorm(x)
        if layer.kind == "linear_attention":
            mix = _linear_layer_b(layer.linear_attn, h, iso[li], geo)
        else:
            mix = _attention_layer_b(layer.self_attn, h, iso[li], geo)
        x = x + mix
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = model.model.norm(x[:, N * seam:])
    return [model.logits(x[b, :len(batch[b][-1])]) for b in range(B)]


def _linear_layer_b(m, h, hi, geo):
    N, seam, D = geo["N"], geo["seam"], geo["D"]
    B, R, _ = h.shape
    K1 = m.K - 1
    # Every segment's summary in one scan over the isolated rows: the rows outside the body get
    # decay 1 and beta 0; state columns [S | T] start at [0 | I] with values [v | 0], so the final
    # state is [S(body|0) | T_body] (the recurrence is linear in the state, column by column).
    proj = m.in_proj_qkv(hi)  # [D, L, C]
    C = proj.shape[-1]
    q, k, v, g, beta = m.heads_and_gates(_conv_b(m, proj.new_zeros(D, K1, C), proj), hi)
    mask = geo["body"].to(g.dtype)
    g, beta = g * mask[..., None], beta * mask[..., None]
    v2 = torch.cat([v, v.new_zeros(*v.shape[:3], m.dk)], dim=-1)
    init = torch.cat([h.new_zeros(D, m.hv, m.dk, m.dv, dtype=torch.float32),
                      torch.eye(m.dk, device=h.device).expand(D, m.hv, m.dk, m.dk)], dim=-1)
    _, fin = chunk_gated_delta_rule_scan(q, k, v2, g=g, beta=beta, initial_state=init, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)
    Sb, T = fin[..., :m.dv], fin[..., m.dv:]
    # conv tails: each segment's last K-1 rows of projections, zero before its first row
    idx = geo["lens"][:, None] - K1 + torch.arange(K1, device=h.device)[None]  # [D, K1]
    tails = proj.gather(1, idx.clamp(min=0)[..., None].expand(D, K1, C)) * (idx >= 0)[..., None].to(proj.dtype)
    # slot tables (index D: an empty slot, identity and zeros)
    T = torch.cat([T, torch.eye(m.dk, device=h.device).expand(1, m.hv, m.dk, m.dk)], dim=0)[geo["slot_of"]]
    Sb = torch.cat([Sb, Sb.new_zeros(1, *Sb.shape[1:])], dim=0)[geo["slot_of"]]
    tails = torch.cat([tails, tails.new_zeros(1, K1, C)], dim=0)[geo["slot_of"]]  # [B, N, K1, C]

    valid, real = geo["valid"][:, :N * seam].reshape(B * N, seam, 1), geo["real"]
    # The seam rows of every slot at once. A seam's conv runs after the previous slot's tail (a
    # segment's last K-1 rows as prefilled alone; zero before the first real slot), so it does not
    # wait for the recurrence; and the recurrence is linear in the state, so one scan from [0 | I]
    # with values [v | 0] gives each seam's outputs as o0 + P S_in and its end state as
    # Sseam + Tseam S_in, for the S_in the slots before it leave.
    if seam == 0:  # no seam rows: the slots are their bodies alone
        return _question_rows(m, h, geo, tails, T, Sb, N, seam, None)
    hs = h[:, :N * seam].reshape(B * N, seam, -1)
    prev = torch.cat([tails.new_zeros(B, 1, K1, C), tails[:, :-1] * real[:, :-1, None, None].to(tails.dtype)], dim=1)
    ps = m.in_proj_qkv(hs) * valid.to(hs.dtype)
    q, k, v, g, beta = m.heads_and_gates(_conv_b(m, prev.reshape(B * N, K1, C), ps), hs)
    ks = valid.to(g.dtype)
    v2 = torch.cat([v, v.new_zeros(*v.shape[:3], m.dk)], dim=-1)
    init = torch.cat([h.new_zeros(B * N, m.hv, m.dk, m.dv, dtype=torch.float32),
                      torch.eye(m.dk, device=h.device).expand(B * N, m.hv, m.dk, m.dk)], dim=-1)
    os_, fs = chunk_gated_delta_rule_scan(q, k, v2, g=g * ks, beta=beta * ks, initial_state=init,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True,
                                          chunk_size=min(64, seam))
    os_ = os_.float().reshape(B, N, seam, m.hv, m.dv + m.dk)
    fs = fs.reshape(B, N, m.hv, m.dk, m.dv + m.dk)
    o0, P = os_[..., :m.dv], os_[..., m.dv:]  # [B, N, seam, hv, dv], [B, N, seam, hv, dk]
    # slot j as one affine map of the state: seam (in context), then body (composed)
    return _question_rows(m, h, geo, tails, T @ fs[..., m.dv:], T @ fs[..., :m.dv] + Sb, N, seam, (o0, P))


def _question_rows(m, h, geo, tails, A, c, N, seam, seams):
    """The running state through the slots (slot j: S <- A_j S + c_j), the seam rows' outputs
    (seams: (o0, P), output o0 + P S_in; None without seams), then the question's rows, after the
    last slot (always a real one); the layer's output [B, R, H]."""
    B, R, _ = h.shape
    vf = geo["valid"].to(h.dtype)[..., None]
    S = h.new_zeros(B, m.hv, m.dk, m.dv, dtype=torch.float32)
    S_in = []
    for j in range(N):
        S_in.append(S)
        S = A[:, j] @ S + c[:, j]
    rows = h[:, N * seam:]
    p = m.in_proj_qkv(rows) * vf[:, N * seam:]
    q, k, v, g, beta = m.heads_and_gates(_conv_b(m, tails[:, -1], p), rows)
    kq = geo["valid"][:, N * seam:, None].to(g.dtype)
    o, _ = chunk_gated_delta_rule_scan(q, k, v, g=g * kq, beta=beta * kq, initial_state=S,
                                       output_final_state=False, use_qk_l2norm_in_kernel=True)
    if seams is not None:
        o0, P = seams
        o_seams = o0 + torch.einsum("bnthk,bnhkv->bnthv", P, torch.stack(S_in, dim=1))
        o = torch.cat([o_seams.reshape(B, N * seam, m.hv, m.dv).to(o.dtype), o], dim=1)  # [B, R, hv, dv]
    z = m.in_proj_z(h).reshape(B * R * m.hv, m.dv)
    o = m.norm(o.reshape(B * R * m.hv, m.dv).to(h.dtype), z)
    return m.out_proj(o.reshape(B, R, m.hv * m.dv))


def _attention_layer_b(a, h, hi, geo):
    B, R, _ = h.shape
    D, L, _ = hi.shape
    N = geo["N"]

    def qkv(x, p):  # x [n, l, H], p [n, l] -> q [n, hq, l, D], k, v [n, hkv, l, D], gate [n, l, hq*D]
        n, l = x.shape[:2]
        qg = a.q_proj(x).reshape(n, l, a.hq, 2 * a.D)
        q, gate = qg[..., :a.D], qg[..., a.D:].reshape(n, l, a.hq * a.D)
        q = _rope_b(a, a.q_norm(q).transpose(1, 2), p)
        k = _rope_b(a, a.k_norm(a.k_proj(x).reshape(n, l, a.hkv, a.D)).transpose(1, 2), p)
        v = a.v_proj(x).reshape(n, l, a.hkv, a.D).transpose(1, 2)
        return q, k, v, gate

    q, k_rows, v_rows, gate = qkv(h, geo["pos"])
    # the bodies' K/V as prefilled alone, at their real positions, gathered into the prompts' slots
    bpos = geo["starts"][:, None] + torch.arange(L, device=h.device)[None]
    _, kb, vb, _ = qkv(hi, bpos)
    slot = geo["slot_of"]

    def slots(x, fill):  # [D, ...] -> [B, N*L, ...] along the rows, index D = an empty slot
        x = torch.cat([x, torch.full_like(x[:1], fill)], dim=0)[slot]  # [B, N, ...]
        return x

    kb = slots(kb, 0).permute(0, 2, 1, 3, 4).reshape(B, a.hkv, N * L, a.D)
    vb = slots(vb, 0).permute(0, 2, 1, 3, 4).reshape(B, a.hkv, N * L, a.D)
    kpos_b = slots(bpos, 0).reshape(B, N * L)
    kval_b = slots(geo["body"], False).reshape(B, N * L)
    k = torch.cat([k_rows, kb], dim=2)
    v = torch.cat([v_rows, vb], dim=2)
    kpos = torch.cat([geo["pos"], kpos_b], dim=1)  # [B, P]
    kval = torch.cat([geo["valid"], kval_b], dim=1)
    allow = kval[:, None, :] & (kpos[:, None, :] <= geo["pos"][:, :, None])  # [B, R, P]
    # an invalid row attends to itself alone (no row is without keys; valid rows never see it)
    allow[:, :, :R] |= torch.eye(R, dtype=torch.bool, device=h.device)[None] & ~geo["valid"][:, :, None]
    rep = a.hq // a.hkv
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)) * a.D ** -0.5  # [B, hq, R, P]
    s = s.float().masked_fill(~allow[:, None], float("-inf"))
    o = s.softmax(-1).to(v.dtype) @ v
    o = o.transpose(1, 2).reshape(B, R, a.hq * a.D)
    return a.o_proj(o * gate.sigmoid())


def _rope_b(attn, x, pos):
    """x [n, heads, l, D] rotated at positions pos [n, l]."""
    inv = 1.0 / (attn.theta ** (torch.arange(0, attn.rot, 2, device=x.device, dtype=torch.float32) / attn.rot))
    f = pos.to(torch.float32)[..., None] * inv  # [n, l, rot/2]
    emb = torch.cat([f, f], dim=-1)[:, None]  # [n, 1, l, rot]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    xr, xp = x[..., : attn.rot], x[..., attn.rot:]
    return torch.cat([xr * cos + rotate_half(xr) * sin, xp], dim=-1)
