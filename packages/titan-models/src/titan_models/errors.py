"""The one error type of titan-models, and its kinds."""

from __future__ import annotations


class ModelError(ValueError):
    """Anything titan-models refuses; the message names the bad value and what to change."""


class ModelConfigError(ModelError):
    """Model arguments that cannot build a model (bad shape, unknown flavor or backend)."""


class BackendUnavailableError(ModelConfigError):
    """An attention backend that this machine cannot run (e.g. flash-attn without CUDA)."""


class WeightMappingError(ModelError):
    """A state dict or weight folder that does not match the model it is mapped to."""
