"""Keys and values kept between forwards, so generation computes each position once.

The training forward (`Decoder.forward`) recomputes every position of its input. Here the prompt runs
once (prefill) and each later forward appends one token: every block writes what its attention caches
into static buffers and attends over what the buffers hold. It runs the model's own modules and
rotary table (`model.freqs_cis`: Llama 3.1 scaling, YaRN included) for every family; what a family
caches and how it attends differ only through the hook its attention class brings
(`titan_models.cached_attention`). Feed-forwards
and mixtures of experts run as in training: each token is routed alone, no capacity limit.

Rows of a batch are left-padded to one length: padding slots are masked out of every attention, and
each row counts its positions from its own first real token, so a padded row computes what it would
alone.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_models.attention import output_projection
from titan_models.cached_attention import CachedAttention, StateCache, cache_hook
from titan_models.errors import ModelError


class KVCache:
    """Static buffers of every block for `batch` rows of up to `max_len` slots.

    `layers[i]` holds what block i's attention caches (its hook's `buffers`: keys and values with the
    slot dimension second to last, or a recurrent layer's fixed-size state). `length` slots are filled, the same number in every row; `valid` marks the slots that
    hold a real token (False: left padding), `positions` each slot's position in its row.
    """

    def __init__(
        self,
        layers: list[list[torch.Tensor]],
        batch: int,
        max_len: int,
        *,
        device: torch.device | str | None = None,
    ):
        self.layers = layers
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.doc_ids = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)
        self.next_doc = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_len = max_len
        self.length = 0

    @classmethod
    def for_model(cls, model: nn.Module, batch: int, max_len: int) -> KVCache:
        """Buffers shaped for `model` (a whole decoder of any family), in its parameters' dtype and device."""
        _check_whole_model(model)
        if not supports_kv_cache(model):
            raise ModelError(
                f"model: {type(model).__name__} has an attention without a KV-cache hook; give its attention "
                "class a `kv_cache` (titan_models.cached_attention.HeadsCache or a subclass of it)"
            )
        if max_len > model.freqs_cis.shape[0]:
            raise ModelError(
                f"model: generation needs {max_len} positions but the rotary table has {model.freqs_cis.shape[0]} "
                "(max_seq_len); build the model with a larger max_seq_len, or ask for fewer tokens"
            )
        weight = model.tok_embeddings.weight
        layers = [
            cache_hook(b.attention).buffers(b.attention, batch, max_len, weight.dtype, weight.device)
            for b in model.layers.values()
        ]
        return cls(layers, batch, max_len, device=weight.device)

    def segments(self, start: int, end: int) -> torch.Tensor:
        """(batch, end - start) document id of each slot, -1 for left padding and for slots before the first."""
        ids = torch.where(self.valid, self.doc_ids, -1)
        before = max(0, -start)
        filled = ids[:, max(start, 0) : end]
        return torch.cat([torch.full_like(ids[:, :before], -1), filled], dim=1) if before else filled


def supports_kv_cache(model: nn.Module) -> bool:
    """Whether every block's attention brings its KV-cache hook (`CachedAttention`; every family Titan builds)."""
    return all(isinstance(getattr(b, "attention", None), CachedAttention) for b in model.layers.values())


def _check_whole_model(model: nn.Module) -> None:
    if model.tok_embeddings is None or model.norm is None or model.output is None:
        raise ModelError(
            "model: generation needs the whole model, not a pipeline stage; load the checkpoint into an "
            "unsplit model"
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
    freqs_cis: torch.Tensor,
    cache: KVCache,
    layer: int,
    start: int,
    mask: torch.Tensor,
) -> torch.Tensor:
    """One block's attention of the new tokens `x` over its cache: the same steps for every family."""
    hook = cache_hook(attention)
    end = start + x.shape[1]
    query_pos = cache.positions[:, start:end]
    q, new = hook.project(attention, x, freqs_cis, query_pos)
    buffers = cache.layers[layer]
    for buffer, entry in zip(buffers, new, strict=True):
        buffer[..., start:end, :] = entry
    first = hook.first_slot(attention, start)
    k, v = hook.keys_values(attention, [buffer[..., first:end, :] for buffer in buffers])
    mask = hook.restrict(attention, mask[..., first:end], query_pos, cache.positions[:, first:end])
    out = hook.attend(attention, q, k, v, mask)
    return output_projection(attention.wo, out)


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
    cache.valid[:, start:end] = valid
    # Positions count real tokens only: a left-padded row starts at 0 at its first real token.
    counted = torch.cumsum(valid, dim=1)
    positions = (cache.next_position[:, None] + counted - 1).clamp(min=0)
    cache.positions[:, start:end] = positions
    cache.next_position += counted[:, -1]
    doc_ids = None
    if model.args.attn_mask_type == "block_causal":
        # As `document_ids`: the id goes up after each end-of-text, which belongs to the document it closes.
        is_eos = ((tokens == model.args.eos_id) & valid).long()
        seen = torch.cumsum(is_eos, dim=1)
        doc_ids = cache.next_doc[:, None] + seen - is_eos
        cache.doc_ids[:, start:end] = doc_ids
        cache.next_doc += seen[:, -1]
    mask = _attention_mask(cache, start, end, doc_ids)

    # The table's rows gathered per token: each family's own rotation takes them as it takes the table.
    freqs_cis = model.freqs_cis[positions]
    h = model.tok_embeddings(tokens)
    for layer, block in enumerate(model.layers.values()):
        x, hook = block.attention_norm(h), cache_hook(block.attention)
        if isinstance(hook, StateCache):
            segments = cache.segments(start - hook.context(block.attention), end)
            h = h + hook.step(block.attention, x, cache.layers[layer], segments)
        else:
            h = h + _attend(block.attention, x, freqs_cis, cache, layer, start, mask)
        ffn = block.moe if block.moe_enabled else block.feed_forward
        h = h + ffn(block.ffn_norm(h))
    cache.length = end
    return model.output(model.norm(h[:, -1]))
