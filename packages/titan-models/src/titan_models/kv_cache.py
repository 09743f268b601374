"""Keys and values kept between forwards, so generation computes each position once.

The training forward (`Transformer.forward`) recomputes every position of its input. Here the prompt
runs once (prefill) and each later forward appends one token: every block writes the new keys and
values into static buffers and attends over what the buffers hold. It runs the model's own modules
and rotary table (`model.freqs_cis`, so Llama 3.1 rope scaling included); nothing is copied or
re-derived.

Rows of a batch are left-padded to one length: padding slots are masked out of every attention, and
each row counts its positions from its own first real token, so a padded row computes what it would
alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.errors import ModelError
from titan_models.rope import rotary_at, rotate


class KVCache:
    """Static key/value buffers of every block for `batch` rows of up to `max_len` slots.

    `length` slots are filled, the same number in every row; `valid` marks the slots that hold a real
    token (False: left padding).
    """

    def __init__(
        self,
        n_layers: int,
        batch: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        shape = (batch, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.doc_ids = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)
        self.next_doc = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_len = max_len
        self.length = 0
        self.padded = False

    @classmethod
    def for_model(cls, model: nn.Module, batch: int, max_len: int) -> KVCache:
        """Buffers shaped for `model` (a whole `Transformer`), in its parameters' dtype and device."""
        _check_whole_model(model)
        a = model.args
        if max_len > model.freqs_cis.shape[0]:
            raise ModelError(
                f"model: generation needs {max_len} positions but the rotary table has {model.freqs_cis.shape[0]} "
                "(max_seq_len); build the model with a larger max_seq_len, or ask for fewer tokens"
            )
        weight = model.tok_embeddings.weight
        return cls(
            a.n_layers, batch, max_len, a.kv_heads, a.head_dim, dtype=weight.dtype, device=weight.device
        )


def _check_whole_model(model: nn.Module) -> None:
    if model.tok_embeddings is None or model.norm is None or model.output is None:
        raise ModelError(
            "model: generation needs the whole model, not a pipeline stage; load the checkpoint into an "
            "unsplit Transformer"
        )


def _attention_mask(cache: KVCache, start: int, end: int, doc_ids: torch.Tensor | None) -> torch.Tensor:
    """(batch, 1, new, end) boolean mask of the new slots [start, end) over every filled slot.

    A query sees real slots at or before its own (of its own document under block-causal attention),
    and always itself, so that padding queries stay finite: their outputs are never read.
    """
    slots = torch.arange(end, device=cache.valid.device)
    queries = slots[start:end]
    mask = (slots[None, :] <= queries[:, None])[None] & cache.valid[:, None, :end]
    if doc_ids is not None:
        mask &= cache.doc_ids[:, None, :end] == doc_ids[:, :, None]
    mask |= (slots[None, :] == queries[:, None])[None]
    return mask[:, None]


def _attend(
    attention: nn.Module,
    x: torch.Tensor,
    cos_sin: torch.Tensor,
    cache: KVCache,
    layer: int,
    start: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    bs, seq_len, _ = x.shape
    end = start + seq_len
    hd = attention.head_dim
    xq = attention.wq(x).view(bs, seq_len, -1, hd)
    xk = attention.wk(x).view(bs, seq_len, -1, hd)
    xv = attention.wv(x).view(bs, seq_len, -1, hd)
    xq, xk = rotate(xq, cos_sin), rotate(xk, cos_sin)
    keys, values = cache.keys[layer], cache.values[layer]
    keys[:, :, start:end] = xk.transpose(1, 2)
    values[:, :, start:end] = xv.transpose(1, 2)
    # Plain causal prefill of unpadded rows needs no mask; one new token sees every filled slot.
    causal = mask is None and seq_len > 1
    out = F.scaled_dot_product_attention(
        xq.transpose(1, 2),
        keys[:, :, :end],
        values[:, :, :end],
        attn_mask=mask,
        is_causal=causal,
        enable_gqa=True,
    )
    return attention.wo(out.transpose(1, 2).reshape(bs, seq_len, -1))


@torch.no_grad()
def forward_cached(
    model: nn.Module, tokens: torch.Tensor, cache: KVCache, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Append `tokens` (batch, seq) to `cache` and return the logits (batch, vocab) of the last position.

    `valid` (batch, seq) marks real tokens; False marks left padding, which may only precede a row's
    first real token. The first call is the prefill; later calls usually pass one token per row.
    """
    bs, seq_len = tokens.shape
    start, end = cache.length, cache.length + seq_len
    if end > cache.max_len:
        raise ModelError(
            f"model: the KV cache holds {cache.max_len} slots; appending {seq_len} to {start} overflows it"
        )
    if valid is None:
        valid = torch.ones_like(tokens, dtype=torch.bool)
    elif start == 0:
        cache.padded = not bool(valid.all())
    cache.valid[:, start:end] = valid
    # Positions count real tokens only: a left-padded row starts at 0 at its first real token.
    counted = torch.cumsum(valid, dim=1)
    positions = (cache.next_position[:, None] + counted - 1).clamp(min=0)
    cache.next_position += counted[:, -1]
    doc_ids = None
    if model.args.attn_mask_type == "block_causal":
        # As `document_ids`: the id goes up after each end-of-text, which belongs to the document it closes.
        is_eos = ((tokens == model.args.eos_id) & valid).long()
        seen = torch.cumsum(is_eos, dim=1)
        doc_ids = cache.next_doc[:, None] + seen - is_eos
        cache.doc_ids[:, start:end] = doc_ids
        cache.next_doc += seen[:, -1]
    needs_mask = cache.padded or doc_ids is not None or (seq_len > 1 and start > 0)
    mask = _attention_mask(cache, start, end, doc_ids) if needs_mask else None

    cos_sin = rotary_at(model.freqs_cis, positions)
    h = model.tok_embeddings(tokens)
    for layer, block in enumerate(model.layers.values()):
        h = h + _attend(block.attention, block.attention_norm(h), cos_sin, cache, layer, start, mask)
        h = h + block.feed_forward(block.ffn_norm(h))
    cache.length = end
    return model.output(model.norm(h[:, -1]))
