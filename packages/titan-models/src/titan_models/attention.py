"""Grouped-query self-attention and its kernels: SDPA, flex attention, flash-attn and variable-length."""

from __future__ import annotations

import functools
import importlib.util
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from titan_models.args import ModelArgs
from titan_models.attention_masks import (
    AttentionMask,
    GatheredMask,
    VarlenMask,
    causal_block_mask,
    flex_can_run,
)
from titan_models.cached_attention import HeadsCache
from titan_models.errors import BackendUnavailableError, ModelConfigError
from titan_models.rope import apply_rotary


def check_attention_backend(args: ModelArgs) -> None:
    """Fail at model build, not at the first step, when the configured attention cannot run here."""
    if args.attn_mask_type == "block_causal" and args.eos_id is None:
        raise ModelConfigError(
            "model: attn_mask_type='block_causal' needs eos_id, the end-of-text token that separates "
            "packed documents; set ModelArgs.eos_id (the trainer passes the tokenizer's)"
        )
    if args.attn_backend == "varlen" and args.attn_mask_type != "block_causal":
        raise ModelConfigError(
            "model: attn_backend='varlen' attends within the packed documents of a sequence; set "
            "attn_mask_type='block_causal' (or use attn_backend='sdpa' for plain causal attention)"
        )
    if args.attn_backend != "flash":
        return
    if importlib.util.find_spec("flash_attn") is None:
        raise BackendUnavailableError(
            "model: attn_backend='flash' needs the flash-attn package, which is not installed; on a machine "
            "with a CUDA GPU and CUDA-enabled torch run `pip install 'titan-models[flash]' --no-build-isolation` "
            "(flash-attn compiles against that torch), or use attn_backend='sdpa' or 'flex'"
        )
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            "model: attn_backend='flash' needs a CUDA GPU, and torch.cuda.is_available() is False here; "
            "use attn_backend='sdpa' or 'flex' on this machine"
        )
    if args.attn_mask_type != "causal":
        raise ModelConfigError(
            f"model: attn_backend='flash' supports attn_mask_type='causal' only, not '{args.attn_mask_type}'; "
            "use attn_backend='flex' for block-causal attention"
        )


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Expand (batch, kv_heads, seq, head_dim) to n_rep times the heads, for GQA."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    # Uncompiled flex attention materialises the full score matrix; compiled, it is a fused kernel.
    return torch.compile(flex_attention, dynamic=False)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, **options):
    """Flex attention of (batch, heads, seq, head_dim) q, k, v with grouped-query heads: compiled on CUDA;
    `options` are flex_attention's own (`scale`, `return_lse`)."""
    if q.device.type == "cuda":
        return _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=True, **options)
    # Elsewhere flex runs forward-only (see attention_masks), where the unfused path is intended.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        warnings.filterwarnings("ignore", message=".*return_lse.*")
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True, **options)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from flash_attn import flash_attn_func

    # flash-attn takes (batch, seq, heads, head_dim) and handles GQA itself.
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    return out.transpose(1, 2)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: VarlenMask) -> torch.Tensor:
    """Causal attention within each packed document, the batch flattened to (tokens, heads, head_dim).

    On CUDA torch's variable-length kernel (flash or cuDNN) runs over `cu_seqlens`; elsewhere SDPA runs
    with the mask those lengths describe (a document's tokens see its earlier tokens), the same attention.
    """
    b, h, s, d = q.shape
    n_rep = h // k.shape[1]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)  # torch 2.11's varlen kernel has no GQA switch
    if q.device.type == "cuda":
        from torch.nn.attention.varlen import varlen_attn

        packed = [t.transpose(1, 2).reshape(b * s, h, d) for t in (q, k, v)]
        cu, longest = mask.cu_seqlens, mask.max_seqlen
        out = varlen_attn(*packed, cu, cu, longest, longest, window_size=(-1, 0))
        return out.view(b, s, h, d).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_varlen_bool_mask(mask, b))


def _varlen_bool_mask(mask: VarlenMask, batch: int) -> torch.Tensor:
    """(batch, 1, seq, seq): position i sees j <= i of the same document, documents read from cu_seqlens."""
    total = batch * mask.seq_len
    positions = torch.arange(total, device=mask.cu_seqlens.device)
    document = torch.searchsorted(mask.cu_seqlens[1:], positions, right=True).view(batch, mask.seq_len)
    pos = positions[: mask.seq_len]
    causal = pos[:, None] >= pos[None, :]
    return (causal & (document[:, :, None] == document[:, None, :]))[:, None]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, mask: AttentionMask
) -> torch.Tensor:
    """Attention of (batch, heads, seq, head_dim) queries over fewer or equal key/value heads."""
    if isinstance(mask, GatheredMask):  # context parallel: every rank's keys and values
        k, v, mask = mask.gather(k, 2), mask.gather(v, 2), mask.mask
    if isinstance(mask, VarlenMask):
        return _varlen(q, k, v, mask)
    if mask is None and backend == "flex" and flex_can_run(q.device):
        mask = causal_block_mask(q.shape[2], str(q.device))
    if isinstance(mask, BlockMask):
        return flex(q, k, v, mask)
    if backend == "flash" and mask is None:
        return _flash(q, k, v)
    n_rep = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def output_projection(wo: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """`wo` over the heads of `out` (batch, heads, seq, head_dim) merged back: (batch, seq, dim)."""
    bs, _, seq_len, _ = out.shape
    return wo(out.transpose(1, 2).reshape(bs, seq_len, -1))


def attention_tail(
    wo: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel, *args
) -> torch.Tensor:
    """The end every attention forward shares: `kernel(q, k, v, *args)` on heads-first views of the
    (batch, seq, heads, head_dim) queries, keys and values, then `output_projection`."""
    out = kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), *args)
    return output_projection(wo, out)


@torch.no_grad()
def fold_max_logits(
    max_logits: torch.Tensor, q: torch.Tensor, k: torch.Tensor, mask: AttentionMask, scale: float
) -> None:
    """Fold one pass's largest pre-softmax logit `scale * q.k` per query head into `max_logits` (QK-clip
    reads it), over the positions the mask lets attend (a boolean mask as given; any other mask counts
    as causal). `q` (batch, seq, heads, dim), `k` (batch, seq, heads or fewer, dim)."""
    q, k = q.transpose(1, 2).float(), k.transpose(1, 2).float()
    k = _repeat_kv(k, q.shape[1] // k.shape[1])
    scores = (q @ k.transpose(-2, -1)) * scale
    seq = q.shape[2]
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    peak = scores.masked_fill(~allowed, -torch.inf).amax(dim=(0, 2, 3))
    torch.maximum(max_logits, peak, out=max_logits)


class Attention(nn.Module):
    """Self-attention with rotary embeddings and grouped-query heads."""

    # Keys and values per head in a KV cache (`titan_models.kv_cache`); a subclass may bring its own.
    kv_cache: HeadsCache = HeadsCache()

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.backend = args.attn_backend
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.n_heads = args.n_heads
        # Largest pre-softmax logit per query head since last filled with -inf, while recording (QK-clip).
        self.max_logits: torch.Tensor | None = None

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unrotated queries, keys and values of `x`, each (batch, seq, heads, head_dim)."""
        bs, seq_len, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of the heads.
        xq = self.wq(x).view(bs, seq_len, -1, self.head_dim)
        xk = self.wk(x).view(bs, seq_len, -1, self.head_dim)
        xv = self.wv(x).view(bs, seq_len, -1, self.head_dim)
        return xq, xk, xv

    def project(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries, keys and values (batch, seq, heads, head_dim) attention runs on: what the forward
        attends with and what the KV cache keeps (`titan_models.kv_cache`), so both compute one thing.

        `freqs_cis` is the rotary table (its first rows are used) or rows gathered per token
        (batch, seq, pairs); `positions` (batch, seq) are for families whose queries depend on the
        position beyond the rotation (Llama 4's temperature); None: 0, 1, ...
        """
        xq, xk, xv = self.heads(x)
        xq, xk = apply_rotary(xq, xk, freqs_cis)
        return xq, xk, xv

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        xq, xk, xv = self.project(x, freqs_cis)
        if self.max_logits is not None and torch.is_grad_enabled():  # training passes, not validation
            fold_max_logits(self.max_logits, xq, xk, mask, self.head_dim**-0.5)
        return attention_tail(self.wo, xq, xk, xv, attend, self.backend, mask)

    def record_max_logits(self, on: bool) -> None:
        """Keep (or stop keeping) the largest logit per query head in `max_logits`."""
        device = self.wq.weight.device
        self.max_logits = torch.full((self.n_heads,), -torch.inf, device=device) if on else None
