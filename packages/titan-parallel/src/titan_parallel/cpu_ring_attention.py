"""Ring attention for the CPU flash SDPA kernel, which torch's context parallelism does not cover.

`context_parallel` turns SDPA inputs into DTensors sharded on the sequence dim (2) and routes the
CUDA attention kernels to a ring implementation. On CPU, SDPA lowers to
`aten._scaled_dot_product_flash_attention_for_cpu`, which has no sharding rule under that layout.
This module gives it one (every tensor sharded on the sequence dim, like the CUDA flash kernel's
rule) and a handler that runs torch's ring algorithm with the CPU kernel, for as long as the
context is open. Private torch APIs are used; `check_cpu_ring_attention_support` says which one
is missing if a torch version moves them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from titan_parallel.errors import UnsupportedDeviceError

aten = torch.ops.aten
_SEQ_DIM = 2
_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def check_cpu_ring_attention_support() -> None:
    """Raise a clear error if this torch lacks the pieces CPU context parallelism is built from."""
    try:
        from torch.distributed.tensor._ops.single_dim_strategy import (  # noqa: F401
            _ShardingPlaceholder,
            register_single_dim_strategy,
        )
        from torch.distributed.tensor.experimental._context_parallel._attention import (  # noqa: F401
            _templated_ring_attention,
            _templated_ring_attention_backward,
        )
    except ImportError as e:
        raise UnsupportedDeviceError(
            f"parallelism: context parallel on CPU needs torch's ring-attention internals, missing here ({e}); "
            f"this torch is {torch.__version__}, titan-parallel is tested on 2.11 and 2.15. Use one of those, or run "
            "context parallel on CUDA"
        ) from e


@contextlib.contextmanager
def _single_dim_strategy(op, strategy, schema_info) -> Iterator[None]:
    """Install a sharding strategy for `op` while open, then put back whatever was there before.

    torch's own `_single_dim_strategy_context` (2.15) is missing in 2.11 and leaves the schema
    info behind; both torches register through `register_single_dim_strategy` into the two tables
    restored here.
    """
    from torch.distributed.tensor._ops.single_dim_strategy import register_single_dim_strategy

    propagator = DTensor._op_dispatcher.sharding_propagator
    tables = (propagator.op_single_dim_strategy_funcs, propagator.op_to_schema_info_for_single_dim_strategy)
    missing = object()
    saved = [table.get(op, missing) for table in tables]
    try:
        register_single_dim_strategy(op, schema_info=schema_info)(strategy)
        yield
    finally:
        for table, value in zip(tables, saved, strict=True):
            if value is missing:
                table.pop(op, None)
            else:
                table[op] = value


def _forward_strategy(op, args_schema, kwargs_schema):
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder

    seq = _ShardingPlaceholder(_SEQ_DIM)
    return [[seq, seq, seq, seq, seq]]  # output, logsumexp <- query, key, value


def _backward_strategy(op, args_schema, kwargs_schema):
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder

    seq = _ShardingPlaceholder(_SEQ_DIM)
    return [[seq] * 9]  # grad q, k, v <- grad_out, query, key, value, out, logsumexp


def _ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    _refuse_unsupported(dropout_p, attn_mask)
    return _templated_ring_attention(
        mesh.get_group(),
        _SEQ_DIM,
        aten._scaled_dot_product_flash_attention_for_cpu,
        query=query,
        key=key,
        value=value,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _ring_backward(
    mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None
):
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward,
    )

    _refuse_unsupported(dropout_p, attn_mask)
    return _templated_ring_attention_backward(
        mesh.get_group(),
        _SEQ_DIM,
        _BACKWARD,
        grad_out=grad_out,
        grad_out_name="grad_out",
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=logsumexp,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _refuse_unsupported(dropout_p: float, attn_mask) -> None:
    if attn_mask is not None or dropout_p:
        raise UnsupportedDeviceError(
            "parallelism: context parallel attention supports causal SDPA without attn_mask or dropout; "
            f"got attn_mask={'a tensor' if attn_mask is not None else None}, dropout_p={dropout_p}. Pass "
            "is_causal=True and no mask"
        )


def _handler(op_call, args, kwargs):
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise UnsupportedDeviceError(
            f"parallelism: context parallel expects query, key and value sharded on dim {_SEQ_DIM} for "
            f"{op_call}; got another layout"
        )
    ring = _ring_forward if op_call is _FORWARD else _ring_backward
    local = ring(op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local, sharding.output_spec)


@contextlib.contextmanager
def cpu_ring_attention() -> Iterator[None]:
    """Route the CPU flash SDPA kernel through ring attention while open (inside `context_parallel`)."""
    check_cpu_ring_attention_support()
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    dispatcher = DTensor._op_dispatcher
    previous = dict(dispatcher._custom_op_handlers)
    with contextlib.ExitStack() as stack:
        # is_causal (arg 4) changes which kernel the ring runs, so it is part of the cache key.
        stack.enter_context(_single_dim_strategy(_FORWARD, _forward_strategy, RuntimeSchemaInfo(3)))
        stack.enter_context(_single_dim_strategy(_BACKWARD, _backward_strategy, RuntimeSchemaInfo(6)))
        dispatcher._custom_op_handlers = {**previous, _FORWARD: _handler, _BACKWARD: _handler}
        try:
            yield
        finally:
            dispatcher._custom_op_handlers = previous
