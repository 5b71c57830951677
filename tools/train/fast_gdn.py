"""A loop-free chunked gated delta rule for training (same math as transformers' torch fallback).

transformers' torch fallback of the chunked gated delta rule runs a Python loop over 64-token chunks
(the recurrent state is carried from chunk to chunk). Here the chunk-to-chunk recurrence is written
as the affine map it is,

    S_{i+1} = M_i S_i + B_i,   M_i = exp(G_i) I - Kd_i^T W_i,   B_i = Kd_i^T U_i

(S is [d_k, d_v] per head, left-multiplied, as in transformers; G_i the chunk's summed log decay,
Kd_i the keys decayed to the chunk end, W_i / U_i the UT-transformed decayed keys / values), and the
states before every chunk come from an inclusive Hillis-Steele scan over (M, B) pairs: log2(chunks)
batched matmul steps instead of one Python iteration per chunk. Everything runs in float32 with
autocast off. This is exactly the segment-transition composition hypic's PIC uses, applied to chunks.

Used only to speed up training; evaluation and the saved checkpoint use transformers' own code.
"""

import math

import torch


def chunk_gated_delta_rule_scan(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    chunk_gated_delta_rule_scan.calls += 1
    dtype0 = query.dtype
    with torch.autocast(device_type=query.device.type, enabled=False):
        B, L, hk, dk = key.shape
        hv, dv = value.shape[-2:]
        if hk != hv:
            query = query.repeat_interleave(hv // hk, dim=2)
            key = key.repeat_interleave(hv // hk, dim=2)
        q, k, v, b, gg = [x.transpose(1, 2).float().contiguous() for x in (query, key, value, beta, g)]
        if use_qk_l2norm_in_kernel:
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        q = q * dk ** -0.5
        C = chunk_size
        pad = (C - L % C) % C
        if pad:
            q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
            b, gg = (torch.nn.functional.pad(x, (0, pad)) for x in (b, gg))
        n = (L + pad) // C
        q, k, v = (x.reshape(B, hv, n, C, x.shape[-1]) for x in (q, k, v))
        b = b.reshape(B, hv, n, C)
        cum = gg.reshape(B, hv, n, C).cumsum(-1)
        upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
        pdec = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
        kb = k * b.unsqueeze(-1)
        A = (kb @ k.transpose(-1, -2)) * pdec
        A = A.masked_fill(~torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1), 0.0)
        A = A + torch.eye(C, device=q.device, dtype=A.dtype)
        rhs = torch.cat([v * b.unsqueeze(-1), kb * cum.exp().unsqueeze(-1)], dim=-1)
        sol = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        U, W = sol[..., :dv], sol[..., dv:]
        intra = (q @ k.transpose(-1, -2)) * pdec
        qd = q * cum.exp().unsqueeze(-1)
        kd = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
        cd = cum[..., -1].exp()  # [B, H, n]
        kdT = kd.transpose(-1, -2)
        M = cd[..., None, None] * torch.eye(dk, device=q.device, dtype=q.dtype) - kdT @ W  # [B,H,n,dk,dk]
        Bm = kdT @ U  # [B,H,n,dk,dv]
        # inclusive scan: after it, (M[i], Bm[i]) maps the state before chunk 0 to the state after chunk i
        off = 1
        while off < n:
            Mn = M[:, :, off:] @ M[:, :, :-off]
            Bn = M[:, :, off:] @ Bm[:, :, :-off] + Bm[:, :, off:]
            M = torch.cat([M[:, :, :off], Mn], dim=2)
            Bm = torch.cat([Bm[:, :, :off], Bn], dim=2)
            off *= 2
        if initial_state is not None:
            S0 = initial_state.float()
            after = M @ S0.unsqueeze(2) + Bm
        else:
            S0 = torch.zeros(B, hv, dk, dv, device=q.device, dtype=q.dtype)
            after = Bm
        before = torch.cat([S0.unsqueeze(2), after[:, :, :-1]], dim=2)
        vnew = U - W @ before
        out = qd @ before + intra @ vnew
        out = out.reshape(B, hv, n * C, dv)[:, :, :L].transpose(1, 2).contiguous().to(dtype0)
        final = after[:, :, -1] if output_final_state else None
    return out, final


chunk_gated_delta_rule_scan.calls = 0


def naive_gated_delta_rule(query, key, value, g, beta, initial_state=None, use_qk_l2norm_in_kernel=True):
    """Token-by-token reference in float64 (for tests): S_t = exp(g_t)(I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,
    o_t = S_t^T q_t, with S as [d_k, d_v]."""
    B, L, hk, dk = key.shape
    hv, dv = value.shape[-2:]
    q, k = query.double(), key.double()
    if hk != hv:
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / math.sqrt(dk)
    v, gg, b = value.double(), g.double(), beta.double()
    S = torch.zeros(B, hv, dk, dv, dtype=torch.float64) if initial_state is None else initial_state.double().clone()
    outs = []
    for t in range(L):
        kt, vt, qt = k[:, t], v[:, t], q[:, t]  # [B,H,d]
        S = S * gg[:, t].exp()[..., None, None]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", kt, (vt - pred) * b[:, t][..., None])
        outs.append(torch.einsum("bhk,bhkv->bhv", qt, S))
    return torch.stack(outs, dim=1), S


if __name__ == "__main__":  # the chunked scan against the token-by-token reference, on the CPU
    torch.manual_seed(0)
    worst = 0.0
    for L, C, hk, hv, init in ((1, 64, 2, 2, False), (8, 8, 2, 4, True), (63, 64, 1, 2, False), (64, 64, 2, 2, True),
                               (65, 64, 2, 4, True), (200, 64, 2, 4, True), (37, 8, 1, 1, False)):
        B, dk, dv = 2, 16, 24
        q, k = torch.randn(B, L, hk, dk), torch.randn(B, L, hk, dk)
        v = torch.randn(B, L, hv, dv)
        g = -torch.rand(B, L, hv) * 0.5
        beta = torch.rand(B, L, hv)
        S0 = torch.randn(B, hv, dk, dv) if init else None
        o, S = chunk_gated_delta_rule_scan(q, k, v, g, beta, chunk_size=C, initial_state=S0,
                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
        o_ref, S_ref = naive_gated_delta_rule(q, k, v, g, beta, initial_state=S0)
        err = max(((o.double() - o_ref).abs().max() / o_ref.abs().max()).item(),
                  ((S.double() - S_ref).abs().max() / S_ref.abs().max()).item())
        print(f"L {L:3d} chunk {C:2d} heads {hk}/{hv} initial state {init!s:5}: max rel err {err:.2e}")
        worst = max(worst, err)
    assert worst < 1e-4, worst
    print("fast_gdn ok")
