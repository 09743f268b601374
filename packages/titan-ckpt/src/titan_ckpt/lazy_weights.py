"""Weights decoded only where indexed: the base every published quantised format's weights share.

A rank that keeps a few rows (or experts) of a weight reads only those from a quantised Hugging Face
file. A lazy weight is a tensor-like: `shape` and `dtype` (float32) are known, indexing with slices
decodes only the part indexed, and any other torch function or tensor method decodes it whole
(correct, not streamed). A format subclasses `LazyWeight` with `shape`, `full()` and `__getitem__`.
"""

from __future__ import annotations

from typing import Any

import torch


class LazyWeight:
    """A weight decoded to float32 only for the part indexed; decoded whole by any other operation."""

    dtype = torch.float32

    @property
    def shape(self) -> torch.Size:
        raise NotImplementedError

    def full(self) -> torch.Tensor:
        """The whole weight, decoded."""
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:  # a tensor method: decode whole
        return getattr(self.full(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return func(*materialised(args), **materialised(kwargs or {}))


def materialised(value: Any) -> Any:
    """`value` with every lazy weight in it decoded (through lists, tuples and dicts)."""
    if isinstance(value, LazyWeight):
        return value.full()
    if isinstance(value, (list, tuple)):
        return type(value)(materialised(v) for v in value)
    if isinstance(value, dict):
        return {k: materialised(v) for k, v in value.items()}
    return value


def is_lazy(value: Any) -> bool:
    """Whether `value` is a weight decoded only where read."""
    return isinstance(value, LazyWeight)
