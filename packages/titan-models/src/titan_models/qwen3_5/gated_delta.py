"""The gated delta rule over a recurrent state, in two forms that compute one function.

For each value head the state S (key_dim x value_dim) follows, token by token,

    S <- exp(g_t) S                                  (decay first: g_t <= 0 is the gate)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T          (delta rule: write the correction, at rate beta_t)
    o_t = S^T q_t

with q, k L2-normalised and q scaled by 1 / sqrt(key_dim) by the caller. `resets[b, t]` True empties the
state before token t's decay: packed documents and left padding never see each other.

`recurrent_gated_delta` runs that loop (generation's one-token steps). `chunked_gated_delta` (training,
prefill) gives the same result a chunk of C tokens at a time. Inside a chunk, with D[i, j] the decay
from after token j to token i (0 when a reset lies in (j, i]) and d[i] the decay from the chunk's start
to token i (0 after a reset in the chunk), the corrections u_i = beta_i (v_i - (decayed S)^T k_i) solve a
unit lower-triangular system:

    (I + A) U = beta V - (beta d K) S0,      A[i, j] = beta_i D[i, j] (k_i . k_j)  for j < i
    O = d Q S0 + (D * (Q K^T)) U             (j <= i)
    S_end = d[C-1] S0 + sum_j D[C-1, j] k_j u_j^T

so each chunk costs matrix products and one triangular solve, and only S0 passes between chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def recurrent_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    resets: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs (batch, seq, heads, value_dim) and the final state (batch, heads, key_dim, value_dim), in
    float32, token by token. q, k: (batch, seq, heads, key_dim); v: (batch, seq, heads, value_dim);
    g, beta: (batch, seq, heads); resets: (batch, seq) bool; state: the state before the first token."""
    b, s, h, dk = k.shape
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if state is None:
        state = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=v.device)
    state = state.float()
    keep = (~resets).float() if resets is not None else torch.ones(b, s, device=k.device)
    # Unbound once: indexing inside the loop would make backward write a full-size gradient per token.
    steps = zip(*(t.unbind(1) for t in (q, k, v, g.exp(), beta, keep)), strict=True)
    out = []
    for qt, kt, vt, decay, bt, kept in steps:
        state = state * (kept[:, None, None, None] * decay[..., None, None])
        correction = bt[..., None] * (vt - torch.einsum("bhkv,bhk->bhv", state, kt))
        state = state + kt[..., :, None] * correction[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, qt))
    return torch.stack(out, dim=1), state


def _chunked(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """(batch, seq, heads, ...) -> (batch, heads, chunks, chunk, ...), seq padded with zeros."""
    pad = (-x.shape[1]) % chunk
    if pad:
        x = F.pad(x, (0,) * (2 * (x.dim() - 2)) + (0, pad))
    x = x.movedim(1, 2)
    return x.reshape(*x.shape[:2], -1, chunk, *x.shape[3:])


def chunked_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    resets: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrent_gated_delta`'s result, a chunk of `chunk` tokens at a time (see the module docstring)."""
    b, s, h, dk = k.shape
    dv = v.shape[-1]
    if resets is None:
        resets = torch.zeros(b, s, dtype=torch.bool, device=k.device)
    # Padded tokens decay nothing (g = 0) and write nothing (beta = 0, k = 0): the final state is kept.
    qc, kc, vc = (_chunked(t.float(), chunk) for t in (q, k, v))  # (b, h, n, C, d)
    gc, bc = (_chunked(t.float(), chunk) for t in (g, beta))  # (b, h, n, C)
    # A document counter per chunk: token j reaches token i when no reset lies in (j, i].
    rc = _chunked(resets[:, :, None].long(), chunk)[:, 0].cumsum(-1)  # (b, n, C)
    same_doc = rc[..., :, None] == rc[..., None, :]  # (b, n, C, C)
    from_start = (rc == 0)[:, None]  # (b, 1, n, C): S0 still reaches token i

    cum = gc.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    keep = lower & same_doc[:, None]
    pair_decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~keep, float("-inf")).exp()
    start_decay = cum.exp() * from_start  # d[i]

    a = (bc[..., None] * pair_decay * (kc @ kc.transpose(-1, -2))).tril(-1)
    system = a + torch.eye(chunk, device=k.device)
    rhs_v = bc[..., None] * vc
    rhs_s = (bc * start_decay)[..., None] * kc
    solved = torch.linalg.solve_triangular(system, torch.cat([rhs_v, rhs_s], dim=-1), upper=False)
    u_free, u_from_state = solved.split([dv, dk], dim=-1)  # U = u_free - u_from_state @ S0
    scores = pair_decay * (qc @ kc.transpose(-1, -2))  # zero above the diagonal
    q_start = start_decay[..., None] * qc
    end_decay = pair_decay[..., -1, :]  # D[C-1, j]

    if state is None:
        state = torch.zeros(b, h, dk, dv, dtype=torch.float32, device=k.device)
    state = state.float()
    # Per chunk, unbound once: indexing inside the loop would make backward write a full-size gradient
    # per chunk (quadratic in the sequence).
    keys_out = (kc * end_decay[..., None]).transpose(-1, -2)
    per_chunk = (u_free, u_from_state, q_start, scores, keys_out, start_decay[..., -1])
    out = []
    for free, from_state, q_n, scores_n, keys_n, decay_n in zip(
        *(t.unbind(2) for t in per_chunk), strict=True
    ):
        u = free - from_state @ state
        out.append(q_n @ state + scores_n @ u)
        state = decay_n[..., None, None] * state + keys_n @ u
    o = torch.stack(out, dim=2).reshape(b, h, -1, dv)[:, :, :s]
    return o.transpose(1, 2), state
